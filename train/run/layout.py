"""A run folder's layout: every file name in it, its phase folders, and typed readers.

The one place these names are spelled; every other module asks here. A run folder
(``--output_dir``, one run: train/run/folder.py) holds ``run.lock run.json summary.json
run_summary.json training_curves.png`` and, per phase, ``phase<i>-<name>/`` with ``config.json
metrics.jsonl validation.jsonl validation_samples_step<N>.jsonl validation_steps_step<N>.html
best_checkpoint.json phase_done.json README.md checkpoint-<step>/ final/`` (a single-phase run is
its own phase folder). A run is finished when ``summary.json``, written last, exists. A sweep point adds
``sweep_point.json`` and ``train.log``. These names are all that ``--overwrite_output_dir`` may remove.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import atomic_write_text, read_json

#: A checkpoint's folder: transformers' Trainer saves step N in ``checkpoint-N``
#: (``PREFIX_CHECKPOINT_DIR``; tests/test_checkpoints.py keeps the two equal).
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_GLOB = CHECKPOINT_PREFIX + "*"
LOCK = "run.lock"
RECORD = "run.json"
SUMMARY = "summary.json"  # the run's validation per phase; written last: the run is finished
RUN_SUMMARY = "run_summary.json"  # the phase-by-phase table (train/run/summary.py)
CONFIG = "config.json"  # a phase's resolved config
METRICS_LOG = "metrics.jsonl"
VALIDATION_LOG = "validation.jsonl"
LOG_FILES = (METRICS_LOG, VALIDATION_LOG)
BEST = "best_checkpoint.json"
PHASE_DONE = "phase_done.json"
CURVES = "training_curves.png"
FINAL = "final"
MARKER = "checkpoint_complete.json"  # inside a checkpoint folder, written last
STATE_FILE = "crystal_state.json"  # inside a checkpoint folder: what this project's trainer adds to HF's state
SWEEP_POINT = "sweep_point.json"
SWEEP_LOCK = "sweep.lock"  # in a sweep folder: held while a sweep runs its points
POINT_LOG = "train.log"
MODEL_CARD = "README.md"  # a phase's model card: the run's only when train/run/model_card.py recognises it
#: A folder holding one of these holds this project's run (or a sweep point about to run one: the
#: sweep writes ``sweep_point.json`` before the point's log, so a lone ``train.log`` marks nothing).
RUN_MARKERS = (RECORD, LOCK, SWEEP_POINT)
#: The files a run writes at the top of its folder and of each phase folder (besides the samples
#: files and steps pages, the model card, and the folders of :func:`run_entry`).
RUN_FILES = frozenset(
    {LOCK, RECORD, SUMMARY, RUN_SUMMARY, CURVES, CONFIG, METRICS_LOG, VALIDATION_LOG, BEST, PHASE_DONE}
)
#: What a phase leaves once it has trained at least one step (or was killed trying).
PROGRESS = (METRICS_LOG, VALIDATION_LOG, PHASE_DONE, FINAL)
#: What starting a phase over removes: a killed attempt's logs and records.
ATTEMPT_FILES = (METRICS_LOG, VALIDATION_LOG, BEST, PHASE_DONE, CURVES)

_PHASE_DIR = re.compile(r"phase(\d+)-(.+)")
_CHECKPOINT_DIR = re.compile(re.escape(CHECKPOINT_PREFIX) + r"(\d+)")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"{CHECKPOINT_PREFIX}{step}"


def step_of(folder: str | Path) -> int | None:
    """N of a ``checkpoint-N`` folder; None for any other folder (``final/``, a model folder)."""
    m = _CHECKPOINT_DIR.fullmatch(Path(folder).name)
    return int(m[1]) if m else None


def checkpoint_folders(folder: Path) -> list[Path]:
    """The ``checkpoint-N`` folders in a phase folder, oldest (lowest N) first."""
    found = [p for p in Path(folder).glob(CHECKPOINT_GLOB) if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def samples_file(step: int | str) -> str:
    """Validation's completions at ``step`` with their scores (``"*"``: a glob of them all)."""
    return f"validation_samples_step{step}.jsonl"


def steps_page(step: int | str) -> str:
    """Validation's alignment viewer at ``step``: each completion's steps against the references."""
    return f"validation_steps_step{step}.html"


SAMPLES_GLOB = samples_file("*")
STEPS_GLOB = steps_page("*")
_SAMPLES = re.compile("|".join(re.escape(f("@")).replace("@", r"\d+") for f in (samples_file, steps_page)))


def run_entry(path: Path) -> str | None:
    """What a run wrote at ``path``, an entry of a run or phase folder, judged by its name and
    kind, never through a link: ``"file"``, ``"folder"`` (``checkpoint-N/``, ``final/``: the
    trainer's, whole), ``"phase"`` (``phase<i>-<name>/``: its entries judged the same way),
    ``"card"`` (a ``README.md``: the run's only if it is its model card), ``"link"`` (a link
    under one of those names: the run would write through it), or None: not the run's."""
    name = Path(path).name
    if name in RUN_FILES or _SAMPLES.fullmatch(name):
        what, kind = "file", Path.is_file
    elif name == MODEL_CARD:
        what, kind = "card", Path.is_file
    elif name == FINAL or step_of(name) is not None:
        what, kind = "folder", Path.is_dir
    elif _PHASE_DIR.fullmatch(name):
        what, kind = "phase", Path.is_dir
    else:
        return None
    if path.is_symlink():
        return "link"
    return what if kind(path) else None


def phase_dir(run_dir: Path, index: int, name: str, phases: int) -> Path:
    """Where phase ``index`` (0-based) of a run lives; a single-phase run is the run folder."""
    return run_dir if phases == 0 else run_dir / f"phase{index + 1}-{name or index + 1}"


def run_folder(phase: Path) -> Path:
    """The run folder a phase folder belongs to: its parent for a ``phase<i>-<name>`` folder of a
    run, else the folder itself (a single-phase run is its own phase folder)."""
    phase = Path(phase)
    return phase.parent if _PHASE_DIR.fullmatch(phase.name) and (phase.parent / RECORD).is_file() else phase


def phase_folders(run_dir: Path) -> list[tuple[str, Path]]:
    """(name, folder) of each ``phase<i>-<name>`` folder, in phase order (phase10 after phase9)."""
    found = [
        (int(m[1]), m[2], p) for p in Path(run_dir).iterdir() if p.is_dir() and (m := _PHASE_DIR.fullmatch(p.name))
    ]
    return [(name, p) for _, name, p in sorted(found, key=lambda t: t[0])]


def phases(run_dir: Path) -> list[tuple[str, Path]]:
    """Every phase of a run: its phase folders, or the run folder itself (named after it)."""
    return phase_folders(run_dir) or [(Path(run_dir).name, Path(run_dir))]


def is_finished(run_dir: Path) -> bool:
    return (Path(run_dir) / SUMMARY).is_file()


def read_config(folder: Path) -> dict | None:
    """A phase's ``config.json`` (the resolved config it trained with), or None."""
    return read_json(Path(folder) / CONFIG)


class NotARunFolder(CrystalError, ValueError):
    """A folder that holds no (finished) run phase; the message says what is missing."""


@dataclass(frozen=True)
class BestCheckpoint:
    """``best_checkpoint.json``: the phase's best validation step by ``metric``."""

    metric: str
    value: float
    step: int
    checkpoint: str  # the folder name inside the phase folder
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "value": self.value,
            "step": self.step,
            "checkpoint": self.checkpoint,
            "metrics": self.metrics,
        }


def read_best(folder: Path) -> BestCheckpoint | None:
    """The phase's best record, or None when it has none (or an unreadable one)."""
    raw = read_json(Path(folder) / BEST)
    try:
        return BestCheckpoint(raw["metric"], raw["value"], raw["step"], raw["checkpoint"], raw.get("metrics") or {})
    except (TypeError, KeyError):
        return None


def write_best(folder: Path, best: BestCheckpoint | None) -> None:
    """Write (or, with None, remove) the phase's best record; atomic."""
    path = Path(folder) / BEST
    if best is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write_text(path, json.dumps(best.to_dict(), indent=2))


def run_targets(run_dir: Path) -> list[tuple[str, Path, Path]]:
    """(phase name, checkpoint, its config.json) for every phase of a run folder: the best
    checkpoint, or ``final/`` when the phase has no usable best."""
    found = [p for _, p in phase_folders(run_dir) if (p / CONFIG).is_file()] or (
        [run_dir] if (run_dir / CONFIG).is_file() else []
    )
    if not found:
        raise NotARunFolder(f"{run_dir}: not a run folder (no {CONFIG}, no phaseN-name/ folders)")
    out = []
    for p in found:
        best = read_best(p)
        ckpt = p / best.checkpoint if best else None
        if ckpt is None or not ckpt.is_dir():
            ckpt = p / FINAL
        if not ckpt.is_dir():
            raise NotARunFolder(f"{p}: neither a best checkpoint nor {FINAL}/ (did the phase finish?)")
        out.append((p.name, ckpt, p / CONFIG))
    return out
