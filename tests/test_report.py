"""Run reports from hand-written run folders (no training): the multi-phase plot on one
cumulative step axis (train/run/plot.py, scripts/plot_run.py) and the per-phase summary table
(train/run/summary.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from crystal_grpo.train.run.layout import phase_folders
from crystal_grpo.train.run.plot import phase_series, plot_run
from crystal_grpo.train.run.summary import format_summary, run_summary, slope, write_summary

# A least-squares slope of 0.4 per step; the endpoints alone would say (3 - 1) / 3.
REWARDS = [1.0, 4.0, 2.0, 3.0]
ZERO_STD = [0.0, 0.5, 1.0, 0.3]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def val_row(step: int, x: float, **over) -> dict:
    """A validation row whose metrics are all ``x`` (steps_mean 10x), with overrides."""
    row = {
        "step": step,
        "accuracy": x,
        "f1": x,
        "precision": x,
        "recall": x,
        "ordered_f1": x,
        "format_rate": x,
        "steps_mean": 10 * x,
        "reward": x,
    }
    return row | over


def closing_row(step: int) -> dict:
    """The trainer's last log line: the final step, no ``loss`` (it says ``train_loss``)."""
    return {"step": step, "train_runtime": 1.0, "train_loss": 0.5}


@pytest.fixture
def multi_run(tmp_path) -> Path:
    """sft (3 steps, loss logged at 1 and 2 only), grpo (4 steps, rewards, validation at 0/2/4), cpr (2 steps,
    no validation). Offsets: 0, 3, 7; 9 steps in all."""
    run = tmp_path / "demo"
    sft = run / "phase1-sft"
    write_rows(sft / "metrics.jsonl", [{"step": s, "loss": 2.0 - s / 2} for s in (1, 2)] + [closing_row(3)])
    write_rows(sft / "validation.jsonl", [val_row(0, 0.0, f1=math.nan), val_row(3, 0.2)])
    grpo = run / "phase2-grpo"
    write_rows(
        grpo / "metrics.jsonl",
        # validation joins its step's log line as val_* (here ahead of the training keys)
        [
            {
                **({"val_f1": 0.99, "val_reward": 0.99} if s == 2 else {}),
                "step": s,
                "loss": 0.01,
                "reward": r,
                "kl": s / 100,
                "frac_reward_zero_std": z,
                "grpo/f1": s / 10,
                "grpo/format_rate": 0.9,
            }
            for s, r, z in zip((1, 2, 3, 4), REWARDS, ZERO_STD)
        ]
        + [closing_row(4), {"step": 4, "val_f1": 0.98, "val_reward": 0.98}],
    )
    write_rows(grpo / "validation.jsonl", [val_row(0, 0.1), val_row(2, 0.2), val_row(4, 0.3, steps_mean=12.5)])
    cpr = run / "phase3-cpr"
    write_rows(cpr / "metrics.jsonl", [{"step": s, "loss": 0.0, "reward": 0.5, "kl": 0.1} for s in (1, 2)])
    (run / "summary.json").write_text("{}")
    return run


def curve_points(curves, panel: str) -> list[tuple[str, str, list[int], list[float]]]:
    return [(c.phase, c.kind, c.steps, c.values) for c in curves.panels[panel]]


def test_phase_series_puts_every_phase_on_the_cumulative_step_axis(multi_run):
    curves = phase_series(multi_run)
    assert curves.boundaries == [(0, 3, "sft"), (3, 7, "grpo"), (7, 9, "cpr")]
    assert curve_points(curves, "reward") == [
        ("grpo", "train", [4, 5, 6, 7], REWARDS),
        ("cpr", "train", [8, 9], [0.5, 0.5]),
        ("sft", "validation", [0, 3], [0.0, 0.2]),
        ("grpo", "validation", [3, 5, 7], [0.1, 0.2, 0.3]),  # its step 0 sits on the sft/grpo boundary
    ]
    # Match F1 from the reward's "<reward>/f1", never from a "val_f1" row of metrics.jsonl
    assert curve_points(curves, "Match F1")[0] == ("grpo", "train", [4, 5, 6, 7], [0.1, 0.2, 0.3, 0.4])
    assert [c.phase for c in curves.panels["KL"]] == ["grpo", "cpr"]  # the SFT phase logs none
    assert curve_points(curves, "training loss")[0] == ("sft", "train", [1, 2], [1.5, 1.0])
    assert [(c.phase, c.kind) for c in curves.panels["format rate"]] == [
        ("grpo", "train"),
        ("sft", "validation"),
        ("grpo", "validation"),
    ]


def test_phase_folders_are_ordered_by_number(tmp_path):
    for name in ("phase10-j", "phase2-b", "phase1-a", "checkpoint-3", "phase-x"):
        (tmp_path / name).mkdir()
    assert [name for name, _ in phase_folders(tmp_path)] == ["a", "b", "j"]


def test_plot_run_writes_the_multi_phase_png_into_the_run_folder(multi_run):
    out = plot_run(multi_run)
    assert out == multi_run / "training_curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_single_phase_folder_keeps_its_own_steps(multi_run, tmp_path):
    phase = multi_run / "phase2-grpo"
    curves = phase_series(phase)
    assert curves.boundaries == [] and curves.title == "phase2-grpo"
    assert curve_points(curves, "reward")[0] == ("phase2-grpo", "train", [1, 2, 3, 4], REWARDS)
    out = plot_run(phase, tmp_path / "one.png")
    assert out == tmp_path / "one.png" and out.stat().st_size > 10_000


def test_plot_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        plot_run(tmp_path / "missing")
    (tmp_path / "empty" / "phase1-a").mkdir(parents=True)
    write_rows(tmp_path / "empty" / "phase2-b" / "metrics.jsonl", [closing_row(3)])  # no training row
    with pytest.raises(FileNotFoundError, match=r"nothing to plot.*phase folders \(phase1-a, phase2-b\)"):
        plot_run(tmp_path / "empty")


def test_plot_cli_draws_a_multi_phase_folder_and_errors_in_one_line(multi_run, repo_root, tmp_path):
    script = str(repo_root / "scripts" / "plot_run.py")
    done = subprocess.run([sys.executable, script, str(multi_run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(multi_run / "training_curves.png")
    assert (multi_run / "training_curves.png").stat().st_size > 10_000
    (tmp_path / "empty").mkdir()
    done = subprocess.run(
        [sys.executable, script, str(tmp_path / "empty")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1


def test_slope_is_least_squares():
    assert slope([1, 2, 3, 4], REWARDS) == pytest.approx(0.4)
    assert slope([0, 10], [1.0, 2.0]) == pytest.approx(0.1)
    assert slope([5], [1.0]) is None and slope([2, 2], [1.0, 3.0]) is None


def test_run_summary_per_phase(multi_run):
    summary = run_summary(multi_run)
    assert summary["run"] == "demo" and summary["steps"] == 9
    sft, grpo, cpr = summary["phases"]
    assert [p["name"] for p in summary["phases"]] == ["sft", "grpo", "cpr"]
    assert [p["steps"] for p in summary["phases"]] == [3, 4, 2]
    # before: the step-0 row; after: the last row
    assert grpo["before"] == val_row(0, 0.1) and grpo["after"] == val_row(4, 0.3, steps_mean=12.5)
    assert grpo["reward_slope"] == pytest.approx(0.4)
    assert grpo["frac_reward_zero_std"] == pytest.approx(0.45)
    # SFT: validation, but no rewards to fit
    assert sft["before"]["step"] == 0 and sft["after"] == val_row(3, 0.2)
    assert sft["reward_slope"] is None and sft["frac_reward_zero_std"] is None
    # no validation rows: nothing before or after; rewards without frac_reward_zero_std
    assert cpr["before"] is None and cpr["after"] is None
    assert cpr["reward_slope"] == pytest.approx(0.0) and cpr["frac_reward_zero_std"] is None


def test_single_phase_folder_without_a_step_0_row(tmp_path):
    run = tmp_path / "tiny"
    write_rows(
        run / "metrics.jsonl",
        [{"step": s, "loss": 0.0, "reward": 2.0 * s, "frac_reward_zero_std": 0.25} for s in (1, 2, 3)]
        + [closing_row(3)],
    )
    write_rows(run / "validation.jsonl", [val_row(2, 0.4), val_row(3, 0.6)])
    (phase,) = run_summary(run)["phases"]
    assert phase["name"] == "tiny" and phase["folder"] == "tiny" and phase["steps"] == 3
    assert phase["before"] == val_row(2, 0.4) and phase["after"] == val_row(3, 0.6)  # before: the first row
    assert phase["reward_slope"] == pytest.approx(2.0) and phase["frac_reward_zero_std"] == pytest.approx(0.25)


def table_rows(text: str) -> dict[str, list[str]]:
    """Cells of each phase row (columns are at least two spaces apart), by phase name."""
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in text.splitlines()[2:])}


def cell_ends(line: str) -> list[int]:
    return [m.end() for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_write_summary_table_and_json(multi_run):
    text = write_summary(multi_run)
    header, rule, *rows = text.splitlines()
    assert re.split(r"\s{2,}", header) == [
        "phase",
        "steps",
        "validated at",
        "format rate",
        "accuracy",
        "Match F1",
        "Ordered F1",
        "mean steps",
        "val reward",
        "reward slope",
        "zero-std",
    ]
    assert len(rows) == 3 and set(rule) <= {"-", " "}
    assert len({len(line) for line in (header, rule)}) == 1  # the rule spans every column
    cells = table_rows(text)
    assert cells["grpo"] == [
        "grpo",
        "4",
        "0 -> 4",
        "0.100 -> 0.300",
        "0.100 -> 0.300",
        "0.100 -> 0.300",
        "0.100 -> 0.300",
        "1.000 -> 12.500",
        "0.100 -> 0.300",
        "+0.40000",
        "0.450",
    ]
    assert cells["sft"][:5] == ["sft", "3", "0 -> 3", "0.000 -> 0.200", "0.000 -> 0.200"]
    assert cells["sft"][5] == "nan -> 0.200" and cells["sft"][-2:] == ["-", "-"]
    assert cells["cpr"] == ["cpr", "2", "-", "-", "-", "-", "-", "-", "-", "+0.00000", "-"]
    # right-aligned columns: every cell but the phase name ends where its header ends
    assert all(cell_ends(line)[1:] == cell_ends(header)[1:] for line in rows)


def test_format_summary_is_the_written_table(multi_run):
    """run_summary.json holds everything the table shows."""
    assert write_summary(multi_run) == format_summary(json.loads((multi_run / "run_summary.json").read_text()))


def test_summary_cli_prints_the_table(multi_run, repo_root, tmp_path):
    script = str(repo_root / "train" / "run" / "summary.py")
    done = subprocess.run([sys.executable, script, str(multi_run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == format_summary(run_summary(multi_run)) + "\n"
    done = subprocess.run(
        [sys.executable, script, str(tmp_path / "missing")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stderr == f"error: {tmp_path / 'missing'}: no such run folder\n"
