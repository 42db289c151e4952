"""Turn any checkpoint a run writes into a standalone Hugging Face folder.

    python scripts/export.py runs/cpr/checkpoint-2800 --out exports/cpr-2800 [--keep_adapter] [--dtype bfloat16]

A full checkpoint is re-saved in the asked dtype, a LoRA one merged into its base (or kept with
``--keep_adapter``), a DeepSpeed ZeRO one consolidated from its fp32 master weights by
DeepSpeed's ``zero_to_fp32``. The folder is written beside ``--out``, reloaded and made to
generate once before it is renamed into place, so a failed export leaves nothing; its marker
``crystal_export.json`` lists its files for ``--overwrite``. Details: docs/evaluation.md,
"scripts/export.py".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import io
import json
import os
import shutil
import struct
import sys
import tempfile
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from crystal_grpo.errors import CrystalError, some_of
from crystal_grpo.jsonl import iter_jsonl, read_json
from crystal_grpo.paths import user_path
from crystal_grpo.train.models.loading import (
    ModelSection,
    Source,
    from_pretrained_kwargs,
    load_processing,
    load_weights,
    model_class,
    open_source,
    recorded_model,
    torch_dtype,
)
from crystal_grpo.train.run.checkpoints import checkpoint_problem, follow_umask, safetensors_problem, umask
from crystal_grpo.train.run.layout import MARKER, step_of
from crystal_grpo.train.run.model_card import RunRecord, export_card, framework_versions, read_run_record

DTYPES = ("float32", "bfloat16", "float16")
#: Asked when the run's config names no readable training file (or the folder has no run records).
FALLBACK_QUESTION = {"question": "A shop packs 12 pencils in a box. How many pencils are in 3 boxes?"}
EXPECTED = (
    "expected a checkpoint folder: model.safetensors + config.json (a full checkpoint), "
    "adapter_model.safetensors + adapter_config.json (LoRA), or a DeepSpeed ZeRO checkpoint "
    "(a `latest` file naming global_stepN/ with *zero_pp_rank_*optim_states.pt shards, + config.json)"
)
Kind = Literal["full", "lora", "zero"]
#: An export's marker: what it was made from, and every file it wrote with its size.
MANIFEST = "crystal_export.json"


class ExportError(CrystalError, ValueError):
    """Input that cannot be exported (not a checkpoint, ``--out`` taken, base model missing);
    the message is one line that names what was expected."""


@dataclass
class Checkpoint:
    """What kind of checkpoint a folder is, found from its files alone (nothing loaded)."""

    path: Path
    kind: Kind
    zero_tag: str | None = None  # global_stepN
    zero_ranks: int = 0  # processes that wrote the shards
    adapter: dict | None = None  # adapter_config.json

    def describe(self) -> str:
        shards = f"{self.zero_ranks} rank shards in {self.zero_tag}/"
        if self.kind == "zero":
            return f"DeepSpeed ZeRO checkpoint ({shards})"
        if self.kind == "lora":
            return "LoRA adapter checkpoint" + (f" with DeepSpeed ZeRO shards ({shards})" if self.zero_tag else "")
        return "full checkpoint"


@dataclass
class ExportResult:
    out: Path
    kind: str  # full | lora-merged | lora-adapter | zero
    dtype: str
    files: list[str]
    prompt_source: str
    completion: str


# --- what the folder is ---------------------------------------------------------------
def inspect_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint's kind, after checking its files are complete (sizes and sha256 against
    the trainer's completion marker when there is one, safetensors headers always)."""
    p = Path(path)
    if not p.is_dir():
        raise ExportError(f"{p}: no such folder; {EXPECTED}")
    if (p / MARKER).exists():
        problem = checkpoint_problem(p, checksums=True, own=False)  # (any run's weights export)
    else:
        problem = next(filter(None, map(safetensors_problem, sorted(p.rglob("*.safetensors")))), None)
    if problem:
        raise ExportError(f"broken checkpoint: {problem}")
    has = lambda name: (p / name).is_file()
    tag, ranks = None, 0
    if has("latest"):
        tag = (p / "latest").read_text(encoding="utf-8").strip()
        ranks = len(list((p / tag).glob("*zero_pp_rank_*optim_states.pt"))) if tag else 0
        if not ranks:
            raise ExportError(
                f"{p}: `latest` names {tag!r}, but {p / tag} holds no *zero_pp_rank_*optim_states.pt "
                "shards (an incomplete DeepSpeed checkpoint)"
            )
    if has("adapter_config.json"):
        if not has("adapter_model.safetensors"):
            raise ExportError(
                f"{p}: adapter_config.json without adapter_model.safetensors (only safetensors weights are read)"
            )
        try:
            adapter = json.loads((p / "adapter_config.json").read_text(encoding="utf-8"))
        except ValueError as err:
            raise ExportError(f"{p / 'adapter_config.json'}: unreadable ({err})") from err
        return Checkpoint(p, "lora", tag, ranks, adapter)
    if tag:
        if not has("config.json"):
            raise ExportError(f"{p}: DeepSpeed shards without the model's config.json")
        return Checkpoint(p, "zero", tag, ranks)
    if has("config.json") and (has("model.safetensors") or has("model.safetensors.index.json")):
        return Checkpoint(p, "full")
    pickled = sorted(x.name for x in p.glob("*.bin") if x.name != "training_args.bin")
    if pickled:
        raise ExportError(
            f"{p}: holds {', '.join(pickled)} (pickle) but no safetensors weights; only safetensors "
            f"are read. {EXPECTED}"
        )
    raise ExportError(f"{p}: not a checkpoint; {EXPECTED}")


def resolve_base(ckpt: Checkpoint, override: str | None = None) -> str:
    """The LoRA base (``--base_model`` or the adapter config's path, resolved from here)."""
    from crystal_grpo.train.models.loading import ModelLoadError, adapter_base

    try:
        return adapter_base(ckpt.path, override)
    except ModelLoadError as err:
        raise ExportError(f"{err} (--base_model PATH)") from err


def _raw_config(source: str) -> dict:
    path = Path(source) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError as err:
        raise ExportError(f"{path}: unreadable ({err})") from err


def default_dtype(raw: dict) -> str:
    """The dtype the checkpoint's config records (``dtype``, or ``torch_dtype`` before
    transformers 5; a VLM may record it in its text config); float32 when none."""
    for cfg in (raw, raw.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if cfg.get(key) in DTYPES:
                return cfg[key]
    return "float32"


# --- loading (through train/models/loading.py, as training and evaluation load) ----------------------
def open_model(source: str, section: ModelSection) -> Source:
    """``source`` (the checkpoint, its LoRA base, the exported folder) with the run's load settings:
    remote code, revision, attention, ``from_pretrained`` extras, image resolution."""
    return open_source(dataclasses.replace(section, name_or_path=source, gguf_file=None))


def processing_of(sources: list[str], opened: Source, section: ModelSection):
    """The tokenizer, or for a VLM the processor with the run's image resolution, from the first
    source that has tokenizer files (a LoRA checkpoint's own, else its base's)."""
    local = [s for s in sources if any((Path(s) / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json"))]
    src = (local or sources)[0]
    return load_processing(dataclasses.replace(opened, path=src, local=Path(src).is_dir()), section.vision)


def zero_state_dict(ckpt: Checkpoint) -> dict:
    """The fp32 master weights, consolidated from every rank's shards by DeepSpeed."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # (its progress lines and bars; the export's own line says what was consolidated)
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.path), tag=ckpt.zero_tag)


def adapter_weights(ckpt: Checkpoint, say) -> dict:
    """The adapter's tensors, named as in ``adapter_model.safetensors``: the fp32 master
    weights from the ZeRO shards when the checkpoint has them (the file then holds the
    copies gathered at save time, 16-bit in bf16/fp16 training), else the file's."""
    from safetensors.torch import load_file

    saved = load_file(ckpt.path / "adapter_model.safetensors")
    if not ckpt.zero_tag:
        return saved
    # DeepSpeed names them as the PeftModel's parameters: <module>.lora_A.<adapter name>.weight
    name = ".default."
    master = {k.replace(name, "."): v for k, v in zero_state_dict(ckpt).items() if "lora_" in k}
    if set(master) != set(saved):
        say(
            f"  note: the ZeRO shards' LoRA tensors do not line up with adapter_model.safetensors ({len(master)} vs "
            f"{len(saved)}); using the file ({_safetensors_dtype(ckpt.path / 'adapter_model.safetensors')})"
        )
        return saved
    say(
        f"  adapter weights: the fp32 master weights of the ZeRO shards, consolidated by DeepSpeed (zero_to_fp32) "
        f"on CPU from {ckpt.zero_ranks} ranks; the {_safetensors_dtype(ckpt.path / 'adapter_model.safetensors')} "
        "adapter_model.safetensors beside them is not used"
    )
    return master


def _safetensors_dtype(path: Path) -> str | None:
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        code = next(v["dtype"] for k, v in header.items() if k != "__metadata__")
        return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(code, code)
    except (OSError, ValueError, StopIteration, KeyError, struct.error):
        return None


# --- the check before success ------------------------------------------------------------
def training_prompt(config: dict | None, max_rows: int = 1000) -> tuple[str, list[dict], list | None]:
    """(where it came from, the conversational prompt, images or None): the first valid row
    of the run's training file, prompted exactly as in training, else a fixed question."""
    from crystal_grpo.train.data.splits import build_prompt, image_paths, row_problems

    data = (config or {}).get("data") or {}
    system = data.get("system_prompt")
    path = Path(str(data.get("train") or ""))
    if data.get("train") and path.is_file():
        with contextlib.suppress(OSError):
            for no, row in iter_jsonl(path):
                if isinstance(row, dict) and not row_problems(row, path.parent):
                    from PIL import Image

                    images = [Image.open(p).convert("RGB") for p in image_paths(row, path.parent)]
                    return f"{path}:{no}", build_prompt(row, system), images or None
                if no >= max_rows:
                    break
    return (
        "a fixed question (no run config naming a readable training file)",
        build_prompt(FALLBACK_QUESTION, system),
        None,
    )


def generate_once(
    model,
    processing,
    prompt: list[dict],
    images: list | None,
    max_new_tokens: int,
    chat_template_kwargs: dict | None = None,
) -> str:
    """Greedy, with the generation code validation and evaluation use (same chat template path)."""
    from crystal_grpo.train.models.generation import Engine, Sampling, generate

    vlm = getattr(processing, "image_processor", None) is not None
    return generate(
        model.eval(),
        processing,
        [prompt],
        [images] if images and vlm else None,
        Sampling(max_new_tokens=max_new_tokens),
        batch_size=1,
        engine=Engine(chat_template_kwargs=dict(chat_template_kwargs or {})),
    )[0][0]


# --- the export -------------------------------------------------------------------------
def _weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors")


def _size(folder: Path) -> str:
    n = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.2f} GB"


def _files(folder: Path) -> dict[str, int]:
    """Every file and link under ``folder`` (links not followed) with its size; folders by their files."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = Path(root, name)
            out[str(path.relative_to(folder))] = path.lstat().st_size
    return out


def write_manifest(folder: Path, ckpt: Checkpoint, kind: str, dtype: str) -> None:
    """The export's marker, written last into the finished folder."""
    record = {"checkpoint": str(ckpt.path.resolve()), "kind": kind, "dtype": dtype, "files": _files(folder)}
    (folder / MANIFEST).write_text(json.dumps(record, indent=1), encoding="utf-8")


def _listed(folder: Path) -> dict[str, int] | None:
    """The files an export's marker lists, or None: no marker, or one no export wrote (unreadable,
    or naming a path outside ``folder``: ``..``, absolute)."""
    record = read_json(folder / MANIFEST)
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or any(Path(rel).is_absolute() or ".." in Path(rel).parts for rel in files):
        return None
    return files


def overwrite_problem(out: Path) -> str | None:
    """Why ``--overwrite`` may not replace ``out``: anything but an empty folder or an export whose
    files are all listed by its marker, at the listed size (None: it may)."""
    if not out.is_dir() or out.is_symlink():
        return f"--out {out} is not a folder"
    found, listed = _files(out), _listed(out)
    if found and listed is None:
        return (
            f"--out {out} holds {some_of(sorted(found))} but is no export ({MANIFEST}, the list every export "
            "writes, is missing or unreadable); --overwrite replaces only an export: choose another --out"
        )
    foreign = sorted(rel for rel, size in found.items() if rel != MANIFEST and (listed or {}).get(rel) != size)
    if foreign:
        return (
            f"--out {out} holds {some_of(foreign)}, which the export there did not write (or which changed "
            "since); move them out or choose another --out"
        )
    return None


def _remove_export(folder: Path) -> None:
    """Delete what an export's marker lists (and the marker, and the folders left empty); a file
    it does not list stays, and with it the folder."""
    listed = _listed(folder) or {}
    for rel in [*listed, MANIFEST]:
        (folder / rel).unlink(missing_ok=True)
    for sub in sorted({p for rel in listed for p in Path(rel).parents if p != Path(".")}, key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            (folder / sub).rmdir()
    folder.rmdir()


def _new_partial(out: Path, say) -> tuple[Path, int]:
    """The folder beside ``out`` that the export is written into, and the descriptor whose lock
    marks it as in use for this process's life. The partial folders of exports to ``out`` that
    were killed (their lock gone with their process) are removed first: a model's worth of disk."""
    prefix = f".{out.name}.partial-"
    for old in sorted(out.parent.glob(glob.escape(prefix) + "*")):
        if old.is_dir() and not old.is_symlink():
            fd = _locked(old)
            if fd is not None:
                size = _size(old)
                shutil.rmtree(old, ignore_errors=True)
                os.close(fd)
                say(f"  removed {old} ({size}), left by an export to {out} that was stopped before its end")
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    return tmp, _locked(tmp)


def _locked(folder: Path) -> int | None:
    """A descriptor of ``folder`` holding its exclusive lock, or None when a live process holds it."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished folder to ``out`` (a fresh name for os.replace); an existing
    ``out`` (an export, or empty) is moved aside first and deleted only once the new one is in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    try:
        _remove_export(old)
    except OSError as err:
        print(f"warning: the previous export, moved aside to {old}, was not deleted ({err})", file=sys.stderr)


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    keep_adapter: bool = False,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    base_model: str | None = None,
    max_new_tokens: int = 16,
    say=print,
) -> ExportResult:
    """Export ``checkpoint`` to ``out`` (docs/evaluation.md, "scripts/export.py")."""
    ckpt = inspect_checkpoint(checkpoint)
    out = Path(out)
    here, there = ckpt.path.resolve(), out.resolve()
    if here == there or here.is_relative_to(there) or there.is_relative_to(here):
        raise ExportError(f"--out {out} overlaps the checkpoint {ckpt.path}: export to a folder outside it")
    if out.exists() or out.is_symlink():
        problem = overwrite_problem(out)
        if problem:
            raise ExportError(problem)
        if not overwrite:
            raise ExportError(
                f"{out} exists: pass --overwrite to replace it (swapped in only after the new export "
                "has passed its check)"
            )
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if keep_adapter and ckpt.kind != "lora":
        raise ExportError(f"--keep_adapter: {ckpt.path} is a {ckpt.describe()}, not a LoRA adapter checkpoint")
    rec = read_run_record(ckpt.path)
    section = recorded_model(rec.model_section)
    base = resolve_base(ckpt, base_model) if ckpt.kind == "lora" else None
    source = base or str(ckpt.path)
    dtype_note = "" if dtype else " (the checkpoint's config)"
    dtype = dtype or default_dtype(_raw_config(source))
    kind = {"lora": "lora-adapter" if keep_adapter else "lora-merged"}.get(ckpt.kind, ckpt.kind)
    say(f"export {ckpt.path} -> {out}")
    if step_of(ckpt.path) is not None and not (ckpt.path / MARKER).exists():
        say(
            f"  warning: {ckpt.path} has no {MARKER}: the run may have been stopped while saving it (or an older "
            "version wrote it); only its safetensors headers could be checked, not that every file is there"
        )
    say(
        f"  checkpoint: {ckpt.describe()}"
        + (f", base model {base}" if base else "")
        + (f"; run records: {ckpt.path.parent} (step {rec.step})" if rec.config else "; no run records beside it")
    )
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]  # removed again on failure
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, held = _new_partial(out, say)
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's 0700 would become --out's mode
        how = _write(ckpt, tmp, base, dtype, section, keep_adapter, max_shard_size, say)
        say(f"  dtype: {dtype}{dtype_note}")
        (tmp / "README.md").write_text(
            export_card(rec, out.name, how, dtype, framework_versions(), adapter_base=base if keep_adapter else None),
            encoding="utf-8",
        )
        files = sorted(p.name for p in tmp.iterdir())
        weights = _weight_files(tmp)
        index = [f for f in files if f.endswith(".safetensors.index.json")]
        shards = "" if keep_adapter else f" (max_shard_size {max_shard_size})"
        say(
            f"  wrote {len(weights)} safetensors file(s){' + ' + index[0] if index else ''}{shards}, "
            + ", ".join(f for f in files if not f.endswith(".safetensors") and f not in index)
        )
        source_desc, completion, cls_name = _check(tmp, rec, base if keep_adapter else None, section, max_new_tokens)
        say(
            f"  check: reloaded with {cls_name} and generated up to {max_new_tokens} greedy tokens from {source_desc}:"
        )
        say(f"         {completion!r}")
        write_manifest(tmp, ckpt, kind, dtype)
        follow_umask(tmp)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        os.close(held)
    say(f"exported {out} ({kind}, {dtype}, {_size(out)})")
    return ExportResult(out, kind, dtype, files, source_desc, completion)


def _write(
    ckpt: Checkpoint,
    tmp: Path,
    base: str | None,
    dtype: str,
    section: ModelSection,
    keep_adapter: bool,
    max_shard_size: str,
    say,
) -> str:
    """Write the weights and the processing class into ``tmp``; returns how (for the card)."""
    opened = open_model(base or str(ckpt.path), section)
    processing = processing_of([str(ckpt.path), *([base] if base else [])], opened, section)
    if keep_adapter:
        return _write_adapter(ckpt, tmp, base, dtype, processing, say)
    init = from_pretrained_kwargs(section)
    if ckpt.kind == "full":
        model = load_weights(opened, dtype, init)
        how = "full checkpoint"
    elif ckpt.kind == "zero":
        model = load_weights(opened, dtype, init, state_dict=zero_state_dict(ckpt))
        if (ckpt.path / "generation_config.json").is_file():  # (from a state dict it is derived from the config)
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(ckpt.path)
        beside = ckpt.path / "model.safetensors"
        other = (
            f"; the {_safetensors_dtype(beside) or '16-bit'} model.safetensors gathered beside them is not used"
            if beside.is_file()
            else ""
        )
        say(
            f"  weights: the fp32 master weights of the ZeRO shards, consolidated by DeepSpeed (zero_to_fp32) on CPU "
            f"from {ckpt.zero_ranks} ranks{other}"
        )
        how = f"fp32 master weights consolidated by DeepSpeed from {ckpt.zero_ranks} ZeRO shards"
    else:
        from peft import PeftModel

        peft_model = PeftModel.from_pretrained(load_weights(opened, "float32", init), str(ckpt.path))
        if ckpt.zero_tag:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(peft_model, adapter_weights(ckpt, say))
            if result.unexpected_keys:
                raise RuntimeError(f"adapter tensors the model has no place for: {result.unexpected_keys[:5]}")
        model = peft_model.merge_and_unload().to(torch_dtype(dtype))
        say(f"  weights: the LoRA adapter merged into {base} (PEFT merge_and_unload, in float32)")
        how = f"LoRA adapter merged into `{base}`"
    model.save_pretrained(tmp, max_shard_size=max_shard_size)
    processing.save_pretrained(tmp)
    return how


def _write_adapter(ckpt: Checkpoint, tmp: Path, base: str, dtype: str, processing, say) -> str:
    """The adapter as trained (cast to ``dtype``), its config naming the base by a path that
    loads from anywhere, and the checkpoint's tokenizer or processor."""
    from safetensors.torch import save_file

    tensors = {k: v.to(torch_dtype(dtype)) for k, v in adapter_weights(ckpt, say).items()}
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(
        json.dumps({**ckpt.adapter, "base_model_name_or_path": base}, indent=2), encoding="utf-8"
    )
    processing.save_pretrained(tmp)
    say(f"  weights: the LoRA adapter kept as an adapter ({dtype}); adapter_config.json names the base as {base}")
    return f"LoRA adapter for `{base}` (not merged)"


def _check(folder: Path, rec: RunRecord, adapter_base: str | None, section: ModelSection, max_new_tokens: int):
    """Reload ``folder`` the way a user would and generate once; returns (prompt source,
    completion, the class that loaded it)."""
    init = from_pretrained_kwargs(section)
    if adapter_base:
        from peft import PeftModel

        opened = open_model(adapter_base, section)
        model = PeftModel.from_pretrained(load_weights(opened, "float32", init), str(folder))
        name = f"PeftModel over {model_class(opened.config).__name__}"
    else:
        opened = open_model(str(folder), section)
        model = load_weights(opened, "auto", init)
        name = model_class(opened.config).__name__
    processing = processing_of([str(folder)], opened, section)
    source, prompt, images = training_prompt(rec.config)
    kwargs = ((rec.config or {}).get("data") or {}).get("chat_template_kwargs") or {}
    return source, generate_once(model, processing, prompt, images, max_new_tokens, kwargs), name


# --- command line -----------------------------------------------------------------------
def shard_size(text: str) -> str:
    """``--max_shard_size`` as the weights' writer reads it (``5GB``, ``500MB``, or bytes: huggingface_hub's
    parser, where this version has it), checked before anything loads: a wrong one stopped the export after
    loading the model, with a traceback."""
    try:
        from huggingface_hub.serialization._base import parse_size_to_int
    except ImportError:  # (a private name: another huggingface_hub may keep it elsewhere; the writer checks)
        return text
    try:
        if parse_size_to_int(text) > 0:
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 5GB, 500MB or a number of bytes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "checkpoint",
        type=user_path,
        help="a checkpoint-N or final/ folder of a run phase (full, LoRA or DeepSpeed ZeRO)",
    )
    ap.add_argument("--out", required=True, type=user_path, help="the folder to create")
    ap.add_argument(
        "--keep_adapter",
        action="store_true",
        help="LoRA: write the adapter (+ tokenizer, card), to load with PEFT over the base, instead of "
        "merging it into the base's weights (the default)",
    )
    ap.add_argument(
        "--dtype", choices=DTYPES, default=None, help="weights dtype (default: the dtype in the checkpoint's config)"
    )
    ap.add_argument("--max_shard_size", default="5GB", type=shard_size, help="largest safetensors shard (default 5GB)")
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export at --out (only that), once the new export has passed its check",
    )
    ap.add_argument(
        "--base_model",
        default=None,
        type=user_path,
        help="LoRA: the base model folder, when adapter_config.json's path does not resolve from here",
    )
    ap.add_argument("--max_new_tokens", type=int, default=16, help="tokens generated by the check (default 16)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(x == "--merge_lora" or x.startswith("--merge_lora=") for x in argv):
        print(
            "error: --merge_lora is gone: a LoRA checkpoint is merged into its base without it (--keep_adapter "
            "writes the adapter instead); drop the flag",
            file=sys.stderr,
        )
        return 2
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars would bury the report
    try:
        export(
            a.checkpoint,
            a.out,
            keep_adapter=a.keep_adapter,
            dtype=a.dtype,
            max_shard_size=a.max_shard_size,
            overwrite=a.overwrite,
            base_model=a.base_model,
            max_new_tokens=a.max_new_tokens,
        )
    except CrystalError as err:  # e.g. a base model or processor that does not load: bad input too
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: nothing written to {a.out}", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - any failure: what it means for --out
        traceback.print_exc()
        print(f"export failed, nothing written to {a.out}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0
