"""Checkpoints (and run-folder files) that survive interruption, and resuming from them.

HF's Trainer writes ``checkpoint-N`` file by file, so a run killed while saving leaves a folder
that looks like a checkpoint but is not one. Here every checkpoint gets a completion marker,
written last (after every rank's shards), listing each file's size and sha256; ``latest`` is
the newest complete one, and the checksums are compared where a checkpoint is resumed or
started from (docs/training.md, "Resume"). Resuming also truncates the run folder's logs to
the checkpoint's step. The trainer's hooks are train/trainer/checkpoint_hooks.py; this module
imports neither torch nor transformers, so ``--check`` stays fast.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import struct
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import atomic_write_text, read_json, read_jsonl
from crystal_grpo.train.run.layout import (
    LOG_FILES,
    MARKER,
    RECORD,
    checkpoint_folders,
    checkpoint_name,
    run_folder,
    step_of,
)

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
#: Training settings that live in the optimizer/scheduler state: a resumed run keeps the
#: checkpoint's values whatever the config says (torch restores param-group hyperparameters
#: and the scheduler's base learning rates from the saved state).
RESTORED_SETTINGS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")


class CheckpointError(CrystalError, RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the folder or file."""


class DiskFull(CrystalError, RuntimeError):
    """A save that does not fit (or did not): the message says how much is free, how much a
    checkpoint takes and which complete checkpoint remains."""


# --- writing checkpoints ------------------------------------------------------------------
def remove_marker(folder: str | Path) -> None:
    """Call before (re)writing a checkpoint folder: until the new marker exists it is incomplete."""
    (Path(folder) / MARKER).unlink(missing_ok=True)


def write_marker(folder: str | Path, step: int) -> None:
    """List every file of the finished checkpoint with its size and sha256, and the run that
    wrote it (:func:`run_of`); written atomically, last, once every file has the umask's mode
    (:func:`follow_umask`). The files were just written, so they are read back from the page cache."""
    folder = Path(folder)
    follow_umask(folder)
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER]
    names = [str(p.relative_to(folder)) for p in paths]
    files = {name: p.stat().st_size for name, p in zip(names, paths)}
    sha256 = dict(zip(names, sha256_files(paths)))
    run = run_of(folder.parent)
    marker = {"step": step, "files": files, "sha256": sha256, **({"run": run} if run else {})}
    atomic_write_text(folder / MARKER, json.dumps(marker, indent=1))


def run_of(phase: str | Path) -> str | None:
    """Which run a phase folder's checkpoints belong to: its run folder's ``run_id`` (``run.json``,
    kept for the run's life, whatever folder it is moved to), and for a phase of a multi-phase run
    the phase's folder name; None where no run record says (a trainer built by hand)."""
    phase = Path(phase)
    top = run_folder(phase)
    record = read_json(top / RECORD)
    run_id = record.get("run_id") if isinstance(record, dict) else None
    if not isinstance(run_id, str):
        return None
    return run_id if top == phase else f"{run_id}/{phase.name}"


def umask() -> int:
    """This process's umask (``os.umask`` only sets it, returning the old one: it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(folder: str | Path) -> None:
    """Give every file under ``folder`` the mode a file this process creates gets (0666 less the
    umask): safetensors writes its files 0600, so a group sharing the run folder could read every
    file of a checkpoint but its weights."""
    mode = 0o666 & ~umask()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def sha256_files(paths: list[Path]) -> list[str]:
    """Each file's sha256, several files at once (hashlib releases the GIL while it hashes)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256_file, paths))


# --- checking --------------------------------------------------------------------------
class _Truncated(ValueError):
    pass


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (each tensor's dtype, shape and offsets), read alone; raises
    OSError or ValueError (and the like) for a file that has none."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _Truncated(f"truncated safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise _Truncated(f"truncated safetensors file (header of {n} bytes, file of {size})")
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise _Truncated(f"truncated or corrupt safetensors file ({size} bytes, header says {8 + n + end})")
    return header


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is unreadable (truncated, bad header), or None. Reads the header only."""
    try:
        safetensors_header(path)
    except _Truncated as err:
        return f"{path}: {err}"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        return f"{path}: corrupt safetensors header ({type(err).__name__}: {err})"
    return None


def tensor_shapes(folder: str | Path) -> dict[str, list[int]]:
    """Each weight's shape in a model folder's ``model*.safetensors`` (one file or its shards),
    from their headers; {} without any (a LoRA adapter, a GGUF file) or with an unreadable one."""
    out: dict[str, list[int]] = {}
    for path in sorted(Path(folder).glob("model*.safetensors")):
        try:
            header = safetensors_header(path)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return {}
        out.update({k: v["shape"] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)})
    return out


def shape_problem(checkpoint: str | Path, model: str | Path | None) -> str | None:
    """Why the weights of ``checkpoint`` do not fit the model a resume builds from ``model`` (its
    folder), or None: a weight of both with another shape (another model size), or no weight in
    common (another model). Read from the safetensors headers, before anything loads."""
    ours, theirs = tensor_shapes(checkpoint), tensor_shapes(model) if model else {}
    if not ours or not theirs:
        return None  # nothing to compare: the load itself checks
    common = sorted(ours.keys() & theirs.keys())
    differ = [k for k in common if ours[k] != theirs[k]]
    if common and not differ:
        return None
    what = (
        f"{len(differ)} of its {len(ours)} weights have another shape (e.g. {differ[0]}: {ours[differ[0]]} in the "
        f"checkpoint, {theirs[differ[0]]} in the model)"
        if differ
        else "none of its weights are the model's (another architecture)"
    )
    return f"{checkpoint} does not fit the model {model}: {what}"


#: The checkpoint files a resume loads with ``torch.load``: the optimizer and scheduler states,
#: each rank's RNG state, a gradient scaler (``training_args.bin`` is not loaded), and DeepSpeed's
#: shards in the folder its ``latest`` file names, which DeepSpeed unpickles with
#: ``weights_only=False``: whatever such a file holds would run.
TORCH_FILES = ("*.pt", "*.pth")


def _deepspeed_globals() -> list:
    """The classes DeepSpeed's own shards hold besides tensors (its loss scaler, its ZeRO stage)."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError:
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum]


def tensor_file_problem(folder: str | Path) -> str | None:
    """Why one of the checkpoint's :data:`TORCH_FILES` (its DeepSpeed shards too) is not a file
    torch loads without running code (``weights_only=True``; numpy's arrays and DeepSpeed's own
    classes allowed), or None. Only each file's pickled structure is read (its tensors are
    memory-mapped), so this is cheap however large. The reason never repeats torch's advice to
    load the file unsafely."""
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals

    folder = Path(folder)
    tag = folder / "latest"
    shards = folder / tag.read_text(encoding="utf-8").strip() if tag.is_file() else None
    paths = [p for where in (folder, shards) if where for pattern in TORCH_FILES for p in where.glob(pattern)]
    allowed = _deepspeed_globals() if shards else []
    for path in sorted(paths):
        if not zipfile.is_zipfile(path):
            reason = "not in torch.save's zip format"
        else:
            try:
                with safe_globals(), torch.serialization.safe_globals(allowed):
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                continue
            except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError, AttributeError) as err:
                reason = _unpickling_reason(str(err)) or type(err).__name__
        return f"{path}: not a file of tensors that torch loads safely ({reason}); it is not loaded"
    return None


def _unpickling_reason(text: str) -> str:
    """What torch's refusal says is wrong (its ``WeightsUnpickler error``, else its first line that
    is not advice), without the advice to load the file with ``weights_only=False``, that is, to
    run whatever it holds."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    said = [x.split("WeightsUnpickler error: ", 1)[1] for x in lines if "WeightsUnpickler error: " in x] or [
        x for x in lines if "weights_only" not in x.lower() and not x.startswith(("Check the documentation", "("))
    ]
    first = said[0] if said else ""
    return re.split(r" was not an allowed global|\. Please |\. Check ", first)[0].rstrip(".")[:200]


def checkpoint_problem(
    folder: str | Path, require_marker: bool = True, checksums: bool = False, own: bool = True
) -> str | None:
    """Why ``folder`` cannot be resumed from, or None when it is complete.

    Without ``require_marker`` (a checkpoint named explicitly, possibly written by another
    tool or an older version) the files present are still checked. With ``checksums`` each
    file's sha256 is compared with the marker's (a marker that has them): this reads the
    whole checkpoint. With ``own``, a marker naming the run that wrote it must name the run of the
    folder it is in (:func:`run_of`): a checkpoint copied in from another run is not resumed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder}: {'a file, not a' if folder.exists() else 'no such'} checkpoint folder"
    marker = folder / MARKER
    if marker.exists():
        try:
            saved = json.loads(marker.read_text())
            files, sha256 = saved["files"], saved.get("sha256", {}) if checksums else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{marker}: unreadable completion marker ({err})"
        writer, here = saved.get("run"), run_of(folder.parent) if own else None
        if writer and here and writer != here:
            return (
                f"{folder}: written by another run ({MARKER} names run {writer}, the run in {folder.parent} is "
                f"{here}): copied in from elsewhere, it is not this run's to resume; start a new run from its "
                f"weights (--model.name_or_path {folder})"
            )
        step = saved.get("step")
        if isinstance(step, int) and step_of(folder) not in (None, step):
            return (
                f"{folder}: renamed (its {MARKER} holds step {step}): resuming it as step {step_of(folder)} would "
                f"log steps twice or skip them; rename it back to {checkpoint_name(step)}"
            )
        for rel, size in files.items():
            p = folder / rel
            if not p.is_file():
                return f"{p}: missing (the checkpoint is incomplete)"
            if p.stat().st_size != size:
                return f"{p}: {p.stat().st_size} bytes, {size} when it was saved (truncated or overwritten)"
        now = sha256_files([folder / rel for rel in sha256])
        for (rel, digest), found in zip(sha256.items(), now):
            if found != digest:
                return (
                    f"{folder / rel}: its content is not what was saved (sha256 differs from {MARKER}'s: "
                    "corrupted or overwritten)"
                )
    elif require_marker:
        return (
            f"{folder}: incomplete (no {MARKER}: the run was stopped while saving it, or an older "
            "version wrote it; pass its path to --resume_from_checkpoint to try it anyway)"
        )
    elif not (folder / TRAINER_STATE).is_file():
        return f"{folder / TRAINER_STATE}: missing (the checkpoint is incomplete)"
    for p in sorted(folder.rglob("*.safetensors")):
        problem = safetensors_problem(p)
        if problem:
            return problem
    return None


def checkpoint_step(folder: str | Path) -> int:
    """The step a checkpoint holds: N of ``checkpoint-N``, else its trainer state's (0 without)."""
    step = step_of(folder)
    if step is not None:
        return step
    state = Path(folder) / TRAINER_STATE
    return int(json.loads(state.read_text())["global_step"]) if state.is_file() else 0


def latest_complete(run_dir: str | Path, checksums: bool = False) -> tuple[Path | None, list[str]]:
    """The newest complete ``checkpoint-N`` in ``run_dir`` and why each newer one was skipped
    (``checksums``: see :func:`checkpoint_problem`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None, []
    found = checkpoint_folders(run_dir)[::-1]
    skipped = []
    for folder in found:
        problem = checkpoint_problem(folder, checksums=checksums)
        if problem is None:
            return folder, skipped
        skipped.append(problem)
    return None, skipped


def resolve_resume(run_dir: str | Path, resume: str | None, say=logger.info) -> str | None:
    """The checkpoint to resume from: ``latest`` (newest complete) or a checked explicit path."""
    if not resume:
        return None
    if resume == "latest":
        chosen, skipped = latest_complete(run_dir, checksums=True)
        for problem in skipped:
            say(f"skipping {problem}")
        say(f"resuming from {chosen}" if chosen else f"no complete checkpoint in {run_dir}: starting fresh")
        return str(chosen) if chosen else None
    problem = checkpoint_problem(resume, require_marker=False, checksums=True)
    if problem:
        raise CheckpointError(f"cannot resume: {problem}")
    return resume


def explicit_resume_problem(checkpoint: str | Path, run_dir: Path, folders: list[Path]) -> str | None:
    """Why ``--resume_from_checkpoint PATH`` cannot resume the run in ``run_dir`` (whose phase
    folders are ``folders``), or None: PATH must be a checkpoint that resumes (checked file by
    file) of this run. A missing path or another run's checkpoint started this one fresh."""
    problem = checkpoint_problem(checkpoint, require_marker=False)
    if problem:
        return f"cannot resume: {problem}"
    if Path(checkpoint).resolve().parent not in {f.resolve() for f in folders}:
        return (
            f"cannot resume: {checkpoint} is not a checkpoint of the run in {run_dir}: resume its own run "
            f"(--output_dir {Path(checkpoint).parent}), or start a new run from its weights "
            f"(--model.name_or_path {checkpoint})"
        )
    return None


def set_back(run_dir: Path, checkpoint: str | Path) -> str | None:
    """Resuming a checkpoint older than the run's newest complete ones: those hold steps the run
    now trains again, so their completion markers go (``latest`` never resumes them; their files
    stay until the run saves over them); returns the line that says so, or None."""
    step = checkpoint_step(checkpoint)
    newer = [f for f in checkpoint_folders(run_dir) if (step_of(f) or 0) > step and (f / MARKER).is_file()]
    for folder in newer:
        remove_marker(folder)
    return (
        (
            f"resuming from {checkpoint}, older than {', '.join(f.name for f in newer)}: "
            f"{'that one is' if len(newer) == 1 else 'those are'} no longer complete (completion marker removed), so "
            "that latest never resumes them; the run saves over them as it reaches their steps"
        )
        if newer
        else None
    )


# --- resuming ----------------------------------------------------------------------------
def truncate_logs(run_dir: str | Path, step: int) -> None:
    """Drop log rows after ``step``: the resumed run logs those steps again."""
    for name in LOG_FILES:
        path = Path(run_dir) / name
        if path.exists():
            keep = [r for r in read_jsonl(path) if isinstance(r.get("step"), (int, float)) and r["step"] <= step]
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def optimizer_settings(optimizer: Any, scheduler: Any) -> dict[str, float]:
    """The :data:`RESTORED_SETTINGS` as the optimizer and scheduler really hold them (after a
    resume these are the checkpoint's values, not necessarily the config's)."""
    groups = list(getattr(optimizer, "param_groups", None) or [])
    out: dict[str, float] = {}
    base = getattr(scheduler, "base_lrs", None)
    if base:
        out["learning_rate"] = float(base[0])
    elif groups:
        out["learning_rate"] = float(groups[0].get("initial_lr", groups[0]["lr"]))
    if groups:
        first = groups[0]
        if "weight_decay" in first:
            out["weight_decay"] = max(float(g.get("weight_decay", 0.0)) for g in groups)
        if "betas" in first:
            out["adam_beta1"], out["adam_beta2"] = (float(b) for b in first["betas"])
        if "eps" in first:
            out["adam_epsilon"] = float(first["eps"])
    return out


def settings_undone(saved: dict[str, float], args: Any) -> dict[str, tuple[float, float]]:
    """``{key: (the config's value, the checkpoint's)}`` for each :data:`RESTORED_SETTINGS` that
    differs: resuming keeps the checkpoint's (the run goes on with it, and records it)."""
    out = {}
    for key in RESTORED_SETTINGS:
        now, then = getattr(args, key, None), saved.get(key)
        if (
            now is not None
            and then is not None
            and not math.isclose(float(now), float(then), rel_tol=1e-9, abs_tol=0.0)
        ):
            out[key] = (now, then)
    return out


def undone_line(key: str, now: float, then: float) -> str:
    return (
        f"training.{key} is {now!r} but the checkpoint was trained with {then!r}: resuming restores the "
        f"optimizer and scheduler state, so the run continues with {then!r} (and run.json records it). To "
        "change it, start a new run from the checkpoint's weights (--model.name_or_path CHECKPOINT) instead "
        "of resuming."
    )


# --- disk space -------------------------------------------------------------------------
#: What torch's zip writer and safetensors say when a write fails for lack of space (torch
#: reports ENOSPC as "[enforce fail at inline_container.cc] unexpected pos ...").
_WRITE_FAILED = ("unexpected pos", "file write failed", "No space left on device", "Disk quota exceeded")
#: Room kept beyond a checkpoint's measured size before a save is attempted.
SPACE_MARGIN = 1.02


def _newest_marker(run_dir: str | Path) -> dict | None:
    newest, _ = latest_complete(run_dir)
    return read_json(newest / MARKER) if newest else None


def checkpoint_bytes(run_dir: str | Path) -> int | None:
    """The size of the newest complete checkpoint in ``run_dir`` (from its marker), or None."""
    marker = _newest_marker(run_dir)
    return sum(marker["files"].values()) if marker else None


def checkpoint_files(run_dir: str | Path) -> int | None:
    """How many files the newest complete checkpoint in ``run_dir`` holds, its marker too, or None."""
    marker = _newest_marker(run_dir)
    return len(marker["files"]) + 1 if marker else None


def _statvfs(path: str | Path) -> os.statvfs_result:
    """The file system holding ``path`` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.statvfs(p)


def free_bytes(path: str | Path) -> int:
    """Free space on the file system holding ``path`` (or its nearest existing parent)."""
    st = _statvfs(path)
    return st.f_bavail * st.f_frsize


def free_inodes(path: str | Path) -> int | None:
    """Free file entries (inodes) on that file system; None where it sets no number (btrfs, ...)."""
    st = _statvfs(path)
    return st.f_favail if st.f_files else None


def has_room(run_dir: str | Path, need: int | None, files: int | None) -> bool:
    """Whether the file system of ``run_dir`` has room for one more checkpoint of ``need`` bytes
    and ``files`` files (the previous one's; None: not known yet), with :data:`SPACE_MARGIN`."""
    inodes = free_inodes(run_dir)
    return (need is None or free_bytes(run_dir) >= need * SPACE_MARGIN) and (
        files is None or inodes is None or inodes >= files * SPACE_MARGIN
    )


def gb(n: int | float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def space_report(run_dir: str | Path, need: int | None = None) -> str:
    """``N GB free on DIR, a checkpoint takes M; newest complete checkpoint: X``; when the file
    system's file entries (inodes) are what runs out, that instead."""
    run_dir = Path(run_dir)
    folders = [run_dir, *sorted(p for p in run_dir.glob("phase*-*") if p.is_dir())] if run_dir.is_dir() else []
    newest = [c for c in (latest_complete(f)[0] for f in folders) if c is not None]
    need = (
        need
        if need is not None
        else next((checkpoint_bytes(f) for f in reversed(folders) if checkpoint_bytes(f)), None)
    )
    files = next((n for n in map(checkpoint_files, reversed(folders)) if n), None)
    inodes = free_inodes(run_dir)
    if inodes is not None and (inodes == 0 or (files and inodes < files * SPACE_MARGIN)):
        room = (
            f"{inodes} free inodes (file entries) on the file system of {run_dir}"
            + (f", a checkpoint of this run holds {files} files" if files else "")
            + f" ({gb(free_bytes(run_dir))} free: the file entries run out, not the space; delete files)"
        )
    else:
        room = f"{gb(free_bytes(run_dir))} free on the file system of {run_dir}" + (
            f", a checkpoint of this run takes {gb(need)}" if need else ""
        )
    return f"{room}; newest complete checkpoint: {newest[-1] if newest else 'none'}"


def disk_full(err: BaseException, run_dir: str | Path) -> str | None:
    """One line for an error that is a full disk (ENOSPC/EDQUOT anywhere in its chain, or
    torch's failed-write message), else None."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, DiskFull):
            return str(seen)
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            break
        if isinstance(seen, RuntimeError) and any(m in str(seen) for m in _WRITE_FAILED):
            break
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    return f"{type(seen).__name__}: {str(seen).strip().splitlines()[0][:200]}; {space_report(run_dir)}"
