"""The ablation's figures and PCGrad summary, read from run folders written as train/grpo.py
writes them (metrics.jsonl, validation.jsonl, validation's per-row records, phase folders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crystal_grpo.train.organism.step_diagnosis import SUMMARY
from crystal_grpo.train.tools.ablation_figures import (
    accuracy_by_k,
    curves_markdown,
    figures,
    mean_curve,
    pcgrad_summary,
    pcgrad_windows,
    train_curve,
)
from crystal_grpo.train.tools.sweep import Point, Sweep


def _phase(folder: Path, reward: str, steps: int, pcgrad: bool, start_acc: float) -> None:
    folder.mkdir(parents=True)
    rows = [
        {
            "step": s,
            "loss": 0.1,
            "reward": 0.5,
            f"{reward}/steps_mean": 2.0 + s / 10,
            f"{reward}/f1": s / steps,
            **(
                {
                    "pcgrad/cosine": -0.2 if s % 2 else 0.1,
                    "pcgrad/conflict": float(s % 2),
                    "pcgrad/projected_fraction": 0.05 * (s % 2),
                }
                if pcgrad
                else {}
            ),
        }
        for s in range(1, steps + 1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    vals = [0, steps]
    (folder / "validation.jsonl").write_text(
        "".join(json.dumps({"step": s, "accuracy": start_acc}) + "\n" for s in vals)
    )
    for s in vals:  # k=1 always right, k=2 right once the phase ends
        lines = [
            {"id": "a", "difficulty": "1", "correct": 1.0},
            {"id": "b", "difficulty": "2", "correct": float(s > 0)},
        ]
        (folder / f"validation_samples_step{s}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture
def sweep(tmp_path) -> Sweep:
    out = tmp_path / "sweep"
    points = []
    for seed in (1, 2):
        run = out / f"cpr_seed{seed}"
        _phase(run, "cpr", 4, pcgrad=True, start_acc=0.3)
        (run / "summary.json").write_text("{}")
        cur = out / f"cpr_curriculum_seed{seed}"
        _phase(cur / "phase1-answer_only", "answer_only", 2, pcgrad=False, start_acc=0.3)
        _phase(cur / "phase2-cpr", "cpr", 3, pcgrad=True, start_acc=0.4)
        (cur / "summary.json").write_text("{}")
        points += [
            Point(f"cpr_seed{seed}", "cpr", "organism.yaml", {}, seed),
            Point(f"cpr_curriculum_seed{seed}", "cpr_curriculum", "organism_curriculum.yaml", {}, seed),
        ]
    points.append(Point("answer_only_seed1", "answer_only", "organism.yaml", {}, 1))  # not started: left out
    return Sweep("s", "python", out, points)


def test_curves_continue_across_phases(sweep):
    cur = sweep.output_dir / "cpr_curriculum_seed1"
    f1 = train_curve(cur, "f1")
    assert sorted(f1) == [1, 2, 3, 4, 5]  # phase 2's steps 1-3 are global steps 3-5
    assert f1[2] == 1.0 and f1[3] == pytest.approx(1 / 3)
    assert accuracy_by_k(cur) == {0: {"1": 1.0, "2": 0.0}, 2: {"1": 1.0, "2": 1.0}, 5: {"1": 1.0, "2": 1.0}}
    steps, means = mean_curve([{1: 1.0, 2: 3.0, 3: 5.0}, {1: 3.0, 2: 5.0}], window=2)
    assert steps == [1, 2] and means == [2.0, 3.0]


def test_pcgrad_summary_and_figures(sweep):
    summary = pcgrad_summary(sweep)
    assert set(summary) == {"cpr", "cpr_curriculum"}
    assert summary["cpr"]["updates"] == 8 and summary["cpr"]["conflict"] == 0.5
    assert summary["cpr"]["cosine"] == pytest.approx(-0.05)
    assert summary["cpr_curriculum"]["updates"] == 6  # phase 2 only: phase 1 has no PCGrad
    paths = figures(sweep)
    assert [p.name for p in paths] == ["collapse.png", "pcgrad.png", "curriculum.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


def test_pcgrad_by_window_of_global_steps(sweep):
    windows = pcgrad_windows(sweep, width=2)
    assert [(w["from"], w["updates"]) for w in windows["cpr"]] == [(1, 4), (3, 4)]  # two seeds, two steps each
    assert windows["cpr"][0]["cosine"] == pytest.approx(-0.05) and windows["cpr"][0]["conflict"] == 0.5
    # the curriculum's phase 2 (its steps 1-3) runs at global steps 3-5: windows 3-4 and 5-6
    assert [(w["from"], w["updates"]) for w in windows["cpr_curriculum"]] == [(3, 4), (5, 2)]


def test_curves_table_is_mean_and_sd_over_the_seeds_that_reached_a_step():
    def at(recall):
        return {"hinted": {k: 0.5 for k in SUMMARY} | {"recall": recall}}

    runs = {"answer_only": [{0: at(0.4), 20: at(0.1)}, {0: at(0.4), 20: at(0.3)}, {0: at(0.4)}]}
    lines = curves_markdown(runs, keys=("recall",)).splitlines()
    assert lines[2] == "| answer_only | hinted | 0 | 3 | 0.400 ± 0.000 |"
    assert lines[3] == "| answer_only | hinted | 20 | 2 | 0.200 ± 0.141 |"


def test_training_tables_give_the_mean_and_the_range_over_seeds(sweep):
    """training.md's pieces: curves as mean [min, max] over the seeds that reached a step (a variant the rows
    lack is '-'), the largest kl_max of each seed over all its phases, and accuracy by k over validation."""
    from crystal_grpo.train.tools.ablation_figures import accuracy_by_k_markdown, kl_max, training_curves_markdown

    def at(recall):
        return {"all": {k: 0.5 for k in SUMMARY}, "hinted": {k: 0.5 for k in SUMMARY} | {"recall": recall}}

    lines = training_curves_markdown({"cpr": [{0: at(0.2), 20: at(0.1)}, {0: at(0.4)}]}).splitlines()
    assert (
        lines[2] == "| cpr | 0 | 2 | 0.500 [0.500, 0.500] | 0.300 [0.200, 0.400] | 0.500 [0.500, 0.500] | "
        "0.500 [0.500, 0.500] | 0.500 [0.500, 0.500] |"
    )
    assert lines[3] == "| cpr | 20 | 1 | 0.500 | 0.100 | 0.500 | 0.500 | 0.500 |"
    plain = training_curves_markdown({"a": [{0: {"all": {k: 0.5 for k in SUMMARY}}}]}).splitlines()[2]
    assert plain == "| a | 0 | 1 | 0.500 | - | - | 0.500 | - |"

    for seed, peaks in ((1, (0.2, 0.7)), (2, (0.4, 0.1))):  # the curriculum's phases: its max is over both
        for phase, peak in zip(("phase1-answer_only", "phase2-cpr"), peaks):
            path = sweep.output_dir / f"cpr_curriculum_seed{seed}" / phase / "metrics.jsonl"
            rows = [{"step": s, "loss": 0.1, "kl_max": peak * s / 2} for s in (1, 2)]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert kl_max(sweep)["cpr_curriculum"] == [pytest.approx(0.7), pytest.approx(0.4)]
    assert kl_max(sweep)["cpr"] == []  # its runs log no kl_max (beta 0)

    text = accuracy_by_k_markdown(sweep, [])
    assert "| cpr | 0 | 2 | 1.000 [1.000, 1.000] | 0.000 [0.000, 0.000] |" in text
    assert "| cpr | 4 | 2 | 1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] |" in text
