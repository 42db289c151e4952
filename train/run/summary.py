"""What a run folder says, phase by phase: steps, validation before and after, reward trend.

A multi-phase run folder holds one folder per phase (``phase<i>-<name>``); a single-phase
folder is one phase named after the folder (train/run/layout.py). :func:`read_phases` reads each
phase's logs (the plot uses it too); :func:`run_summary` condenses each phase into what a person
asks first (did format rate, accuracy and Match F1 move, and did the training reward rise),
and :func:`format_summary` prints it as a table for a terminal or a README.

    python train/run/summary.py runs/demo
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from crystal_grpo.jsonl import atomic_write_text, read_json, read_jsonl
from crystal_grpo.metrics import label
from crystal_grpo.train.run.layout import METRICS_LOG, RUN_SUMMARY, VALIDATION_LOG, phases


@dataclass
class Phase:
    """One phase's logs; ``offset`` is the run's optimizer steps before it (0 for the first)."""

    name: str
    folder: Path
    train: list[dict]
    validation: list[dict]
    steps: int
    offset: int = 0


def _stepped(rows: list[dict]) -> list[dict]:
    return [r for r in rows if isinstance(r.get("step"), int)]


def read_phase(name: str, folder: Path, offset: int = 0) -> Phase:
    """A phase's training rows (``loss`` or ``reward``: GRPO and SFT alike) and validation rows.

    Its optimizer steps are the highest step any of its logs reached: the trainer's closing
    row carries the final step even when ``logging_steps`` skipped it.
    """
    logged = _stepped(read_jsonl(folder / METRICS_LOG))
    validation = _stepped(read_jsonl(folder / VALIDATION_LOG))
    train = [r for r in logged if "loss" in r or "reward" in r]
    steps = max((r["step"] for r in logged + validation), default=0)
    return Phase(name, folder, train, validation, steps, offset)


def read_phases(run_dir: str | Path) -> list[Phase]:
    """Every phase of a run folder, each with the steps of the phases before it as offset."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder")
    found, offset = [], 0
    for name, folder in phases(run_dir):
        found.append(read_phase(name, folder, offset))
        offset += found[-1].steps
    return found


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def phase_summary(phase: Phase) -> dict:
    """Steps, validation rows before (the step-0 row, else the first) and after (the last),
    and for a phase with training rewards the reward's slope per step and the mean share of
    groups whose rewards were all equal (``frac_reward_zero_std``: no GRPO signal)."""
    val = phase.validation
    before = next((r for r in val if r["step"] == 0), val[0] if val else None)
    rewarded = [r for r in phase.train if _finite(r.get("reward"))]
    zero_std = [r["frac_reward_zero_std"] for r in phase.train if _finite(r.get("frac_reward_zero_std"))]
    return {
        "name": phase.name,
        "folder": phase.folder.name,
        "steps": phase.steps,
        "before": before,
        "after": val[-1] if val else None,
        "reward_slope": slope([r["step"] for r in rewarded], [r["reward"] for r in rewarded]) if rewarded else None,
        "frac_reward_zero_std": sum(zero_std) / len(zero_std) if rewarded and zero_std else None,
    }


def run_summary(run_dir: str | Path) -> dict:
    """``{"run": folder name, "steps": total optimizer steps, "phases": [phase_summary, ...]}``."""
    phases = read_phases(run_dir)
    return {
        "run": Path(run_dir).name,
        "steps": sum(p.steps for p in phases),
        "phases": [phase_summary(p) for p in phases],
    }


#: The validation metrics of the before -> after columns (headers: the metric table's labels).
COLUMNS = ("format_rate", "accuracy", "f1", "ordered_f1", "steps_mean", "reward")


def _header(metric: str) -> str:
    return "val reward" if metric == "reward" else label(metric)  # the training reward has its own column


def _num(v, spec: str) -> str:
    return "-" if v is None else "nan" if isinstance(v, float) and math.isnan(v) else format(v, spec)


def _change(p: dict, key: str, spec: str = ".3f") -> str:
    if p["before"] is None:
        return "-"
    return f"{_num(p['before'].get(key), spec)} -> {_num(p['after'].get(key), spec)}"


def format_summary(summary: dict) -> str:
    """One row per phase, each column as wide as its widest cell: optimizer steps, the steps
    validated before and after (a "before" that is not 0 had no step-0 validation), the
    validation metrics ``before -> after`` (3 decimals), the training reward's least-squares
    slope per step and mean ``frac_reward_zero_std`` ("-": not logged, e.g. an SFT phase)."""
    header = ["phase", "steps", "validated at", *(_header(m) for m in COLUMNS), "reward slope", "zero-std"]
    rows = [
        [
            p["name"],
            str(p["steps"]),
            _change(p, "step", "d"),
            *(_change(p, k) for k in COLUMNS),
            _num(p["reward_slope"], "+.5f"),
            _num(p["frac_reward_zero_std"], ".3f"),
        ]
        for p in summary["phases"]
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def write_summary(run_dir: str | Path, write: bool = True) -> str:
    """Write ``run_summary.json`` into the run folder; returns the table. With ``write`` False (a
    finished run launched again, which changes nothing), the table of the file already there."""
    summary = (None if write else read_json(Path(run_dir) / RUN_SUMMARY)) or run_summary(run_dir)
    if write:
        atomic_write_text(Path(run_dir) / RUN_SUMMARY, json.dumps(summary, indent=2) + "\n")
    return format_summary(summary)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python train/run/summary.py RUN_DIR")
    try:
        print(write_summary(sys.argv[1]))
    except FileNotFoundError as err:
        sys.exit(f"error: {err}")
