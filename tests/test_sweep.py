"""scripts/sweep.py: expansion and validation of sweep files, and the whole path on the tiny
model (configs/sweeps/tiny.yaml): run, skip on re-run, resume, a failing point, the report."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from crystal_grpo.train.run.checkpoints import checkpoint_problem
from crystal_grpo.train.run.folder import RunLock
from crystal_grpo.train.run.layout import PHASE_DONE, POINT_LOG, SUMMARY, SWEEP_LOCK, SWEEP_POINT
from crystal_grpo.train.tools import launch, sweep_report
from crystal_grpo.train.tools import sweep as sw
from crystal_grpo.train.tools.sweep_report import build, markdown, point_metrics

from runs import REPO, logged_steps, wait_for

TINY_SWEEP = REPO / "configs" / "sweeps" / "tiny.yaml"


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------ expansion
def test_grid_points_seeds_and_zipped_axes(tmp_path):
    path = write(
        tmp_path,
        """
base: tiny.yaml
overrides: {training: {max_steps: 3}}
points:
  - {name: a, overrides: {reward.name: cpr}}
  - {name: b, overrides: {reward.name: cpr, pcgrad: true}}
grid:
  reward.params.answer_weight,reward.params.step_weight: [[0.8, 0.2], [0.6, 0.4]]
  training.learning_rate: [1.0e-5, 2.0e-5]
seeds: [1, 2]
""",
    )
    sweep = sw.load_sweep(path, tmp_path / "out")
    assert len(sweep.points) == 2 * 2 * 2 * 2
    first = sweep.points[0]
    assert first.name == "a_answer_weight=0.8_step_weight=0.2_learning_rate=1e-05_seed1"
    assert first.arm == "a_answer_weight=0.8_step_weight=0.2_learning_rate=1e-05"
    assert first.overrides == {
        "training.max_steps": 3,
        "reward.name": "cpr",
        "reward.params.answer_weight": 0.8,
        "reward.params.step_weight": 0.2,
        "training.learning_rate": 1e-5,
        "training.seed": 1,
    }
    assert {p.arm for p in sweep.points if p.seed == 2} == {p.arm for p in sweep.points if p.seed == 1}
    # what train/grpo.py is given resolves to exactly those values
    resolved = sw.resolved(sweep.points[-1])
    assert resolved["reward"]["params"]["answer_weight"] == 0.6 and resolved["training"]["seed"] == 2
    assert resolved["pcgrad"] is True and resolved["training"]["learning_rate"] == 2e-5
    cmd = sw.command(sweep, first)
    assert cmd[:2] == ["python", "train/grpo.py"] and cmd[cmd.index("--reward.name") + 1] == "cpr"
    assert cmd[cmd.index("--output_dir") + 1] == str(tmp_path / "out" / first.name)


def test_points_run_seed_by_seed(tmp_path):
    """Every arm of the first seed, then every arm of the next: a sweep stopped part way has its
    arms at the same number of seeds (or one apart). A job array's tasks go in the same order."""
    path = write(tmp_path, "base: tiny.yaml\npoints: [{name: a}, {name: b}, {name: c}]\nseeds: [7, 1, 2]\n")
    sweep = sw.load_sweep(path, tmp_path / "out")
    expected = [f"{arm}_seed{seed}" for seed in (7, 1, 2) for arm in "abc"]
    assert [p.name for p in sweep.points] == expected
    lines = sw.emit(sweep, "commands").splitlines()
    assert [line.split("--output_dir ")[1].split()[0].rsplit("/", 1)[1] for line in lines] == expected


def test_a_point_with_its_own_seeds_and_data_joins_the_seed_order(tmp_path):
    """A point's own ``seeds`` (more seeds for some arms) keep the sweep seed by seed: after the common
    seeds' arms, its extra seeds; its own ``eval`` settings go over the sweep's for its evaluations."""
    path = write(
        tmp_path,
        "base: tiny.yaml\npoints: [{name: a, seeds: [1, 2, 3, 4], eval: {data: other.jsonl, max_samples: 3}},"
        " {name: b}]\nseeds: [1, 2]\neval: {data: d.jsonl, max_samples: 5, also: {g: {temperature: 0.0}}}\n",
    )
    sweep = sw.load_sweep(path, tmp_path / "out")
    assert [p.name for p in sweep.points] == ["a_seed1", "b_seed1", "a_seed2", "b_seed2", "a_seed3", "a_seed4"]
    a, b = sweep.points[0], sweep.points[1]
    assert sweep.eval_for(a) == {"data": "other.jsonl", "max_samples": 3, "also": {"g": {"temperature": 0.0}}}
    assert sweep.eval_for(b)["data"] == "d.jsonl"
    for bad, message in (
        ("seeds: [-1]", r"points\[0\].seeds: expected a list of integers >= 0"),
        ("eval: {dat: x}", r"points\[0\].eval: expected a mapping of"),
    ):
        with pytest.raises(sw.SweepError, match=message):
            sw.load_sweep(write(tmp_path, f"base: tiny.yaml\npoints: [{{name: a, {bad}}}]\neval: {{data: d}}\n"))


def test_bench_sweep_modes_are_sweep_command_lines():
    from crystal_grpo.train.benchmarks.launch_modes import sweep_argv

    assert sweep_argv("jobs2-fork") == ["--jobs", "2"]
    assert sweep_argv("jobs1-spawn") == ["--jobs", "1", "--no_fork"]
    for bad in ("jobs-fork", "jobs2", "two-fork", "jobs2-thread"):
        with pytest.raises(SystemExit, match="expected jobs<N>-fork or jobs<N>-spawn"):
            sweep_argv(bad)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "base: tiny.yaml\npoints: [{name: a, overrides: {training.learnin_rate: 1.0e-5}}]",
            "point a: training: unknown key 'learnin_rate'",
        ),
        (
            "base: tiny.yaml\ngrid: {reward.params.answer_weight: [0.6, oops]}",
            "point answer_weight=oops: reward.params.answer_weight",
        ),
        ("base: tiny.yaml\npoints: [{name: a}, {name: a}]", "points named more than once: a"),
        ("base: tiny.yaml\npoints: [{name: ../x}]", "point '../x': a point's name is the name of its run folder"),
        ("base: tiny.yaml\npoints: [{name: /tmp/x}]", "point '/tmp/x': a point's name is the name of its run folder"),
        ("base: tiny.yaml\npoints: [{name: .}]", "point '.': a point's name is the name of its run folder"),
        ("base: tiny.yaml\ngrid: {reward.name: [cpr]}\nseeds: [1, -2]", "seeds: expected a list of integers >= 0"),
        ('base: tiny.yaml\ngrid: {"a.b,c.d": [[1, 2], [3]]}', "grid.a.b,c.d: [3] must be a list of 2 values"),
        ("base: tiny.yaml\npoint: [{name: a}]", "unknown key(s) 'point'"),
        ("points: [{name: a}]", "points[0]: no config"),
        ("base: tiny.yaml\npoints: [{name: a}]\neval: {max_samples: 3}", "eval: expected a mapping with `data`"),
        ("base: tiny.yaml\npoints: [{name: a}]\neval: {data: x, also: {greedy: {temprature: 0}}}", "eval.also.greedy"),
        ("base: tiny.yaml\npoints: [{name: a}]\neval: {data: x, also: {best: {temperature: 0}}}", "eval.also.best"),
        (
            "base: tiny.yaml\npoints: [{name: a}]\neval: {data: x}\n"
            "contrasts: [{a: a, b: z, metric: f1, variant: all, eval: eval}]",
            "contrasts[0]: no arm 'z'",
        ),
        (
            "base: tiny.yaml\npoints: [{name: a}]\neval: {data: x}\n"
            "contrasts: [{a: a, b: a, metric: f2, variant: all, eval: eval_greedy}]",
            "no metric 'f2'",
        ),
        ("base: tiny.yaml\npoints: [{name: a}]\ninit_from: /nonexistent/run/phase1", "init_from: /nonexistent"),
        (
            "base: tiny.yaml\npoints: [{name: a, overrides: {training.output_dir: /tmp/elsewhere}}]",
            "point a: overrides training.output_dir, but a point's run folder is <sweep folder>/<point name>",
        ),
        ("base: tiny.yaml\npoints: [{name: a}]\nbase: cpr.yaml", "duplicate key 'base'"),
    ],
)
def test_invalid_sweeps_are_rejected_before_anything_runs(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(sw.SweepError, match=None) as err:
        sw.load_sweep(path, tmp_path / "out")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()
    assert sw.main([str(path), "--output_dir", str(tmp_path / "out")]) == 2


def test_jobs_below_one_are_refused(tmp_path, capsys):
    """--jobs 0 or -2 ran the points one after another without a word."""
    path = write(tmp_path, "base: tiny.yaml\npoints: [{name: a}]")
    for jobs in ("0", "-2"):
        assert sw.main([str(path), "--output_dir", str(tmp_path / "out"), "--jobs", jobs]) == 2
        assert (
            capsys.readouterr().err == f"sweep error: --jobs {jobs}: expected an integer >= 1 (points run at once)\n"
        )
    assert not (tmp_path / "out").exists()


def test_shipped_sweeps_expand_and_validate(tmp_path):
    sizes = {"reward_ablation": 5, "cpr_weights": 6, "tiny": 2}
    for name, n in sizes.items():
        sweep = sw.load_sweep(REPO / "configs" / "sweeps" / f"{name}.yaml", tmp_path / name)
        assert len(sweep.points) == n, name
    weights = sw.load_sweep(REPO / "configs" / "sweeps" / "cpr_weights.yaml", tmp_path / "w")
    pairs = [
        (p.overrides["reward.params.answer_weight"], p.overrides["reward.params.step_weight"]) for p in weights.points
    ]
    assert pairs[0] == (0.8, 0.2) and pairs[-1] == (0.4, 0.6) and all(abs(a + s - 1) < 1e-9 for a, s in pairs)
    ablation = sw.load_sweep(REPO / "configs" / "sweeps" / "reward_ablation.yaml", tmp_path / "r")
    authors = sw.resolved(ablation.points[-1])
    assert authors["reward"]["name"] == "authors_code"
    assert (authors["reward"]["params"]["answer_weight"], authors["reward"]["params"]["step_weight"]) == (0.6, 0.4)


def test_a_point_folder_holding_someone_elses_files_is_refused(tmp_path):
    sweep = sw.load_sweep(TINY_SWEEP, tmp_path / "w")
    folder = tmp_path / "w" / sweep.points[0].name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"mine": true}')
    with pytest.raises(
        sw.SweepError,
        match=f"point {sweep.points[0].name}: --output_dir {folder} holds config.json but no run of this project",
    ):
        sw.prepare(sweep, sweep.points[0])
    assert os.listdir(folder) == ["config.json"]


def test_a_second_sweep_into_a_folder_a_live_sweep_runs_in_is_refused_before_any_point(tmp_path, capsys):
    """Two sweeps into one folder at once: each found the other's point in use, and both exited 1
    with "1 point(s) failed" although every point finished."""
    out = tmp_path / "w"
    with RunLock(out, "python scripts/sweep.py configs/sweeps/tiny.yaml", name=SWEEP_LOCK, what="sweep"):
        assert sw.main([str(TINY_SWEEP), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sweep error: {out} is in use by a live sweep (pid {os.getpid()} on ") and err.endswith(
        ": python scripts/sweep.py configs/sweeps/tiny.yaml); wait for it, stop it, or choose another --output_dir"
    )
    assert os.listdir(out) == [SWEEP_LOCK]  # no point ran, no status, no report


def test_emit_prints_only_the_script_on_stdout(tmp_path):
    """WANDB_MODE=offline (the Makefile's) makes transformers print a note on import: not into the script."""
    proc = subprocess.run(
        [sys.executable, "scripts/sweep.py", str(TINY_SWEEP), "--emit", "slurm", "--output_dir", str(tmp_path / "w")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("#!/bin/bash\n") and "[INFO]" not in proc.stdout


def test_emit_slurm_is_valid_bash_with_one_task_a_point(tmp_path):
    sweep = sw.load_sweep(REPO / "configs" / "sweeps" / "cpr_weights.yaml", tmp_path / "w")
    script = sw.emit(sweep, "slurm")
    path = write(tmp_path, script, "job.sbatch")
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert f"#SBATCH --array=0-{len(sweep.points) - 1}\n" in script
    assert script.count("train/grpo.py") == len(sweep.points) == 6
    assert (tmp_path / "w" / "slurm").is_dir()  # sbatch opens --output before the script runs
    lines = sw.emit(sweep, "commands").splitlines()
    assert len(lines) == 6 and all("--resume_from_checkpoint latest" in line for line in lines)
    for p in sweep.points:  # every point's resolved config is saved with its folder
        record = json.loads((tmp_path / "w" / p.name / SWEEP_POINT).read_text())
        assert record["resolved"]["reward"]["params"]["answer_weight"] == p.overrides["reward.params.answer_weight"]


# ------------------------------------------------------------------ the whole path, tiny
@pytest.fixture(scope="module")
def tiny_sweep_file(tiny_lm_path, tmp_path_factory) -> Path:
    """configs/sweeps/tiny.yaml as shipped, its model (configs/tiny.yaml's .cache/models/tiny-qwen2,
    which scripts/make_tiny_models.py writes) pointed at the session's tiny model instead."""
    import yaml

    sweep = yaml.safe_load(TINY_SWEEP.read_text())
    sweep["overrides"]["model.name_or_path"] = str(tiny_lm_path)
    path = tmp_path_factory.mktemp("sweep_file") / TINY_SWEEP.name
    path.write_text(yaml.safe_dump(sweep))
    return path


@pytest.fixture(scope="module")
def tiny_sweep(tiny_sweep_file, tmp_path_factory):
    """Both points at once (each with half the cores), forked from one process that imported the libraries."""
    out = tmp_path_factory.mktemp("sweep") / "tiny"
    assert sw.main([str(tiny_sweep_file), "--output_dir", str(out), "--jobs", "2"]) == 0
    return sw.load_sweep(tiny_sweep_file, out)


def test_tiny_sweep_report_equals_the_points_own_files(tiny_sweep):
    out = tiny_sweep.output_dir
    for name in ("report.md", "report.csv", "report.json", "report.png", "report_weights.png"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert [p["status"] for p in report["points"]] == ["done", "done"]
    for point, arm in zip(tiny_sweep.points, report["arms"]):
        best = json.loads((out / point.name / "best_checkpoint.json").read_text())
        for metric in ("accuracy", "f1", "precision", "recall", "ordered_f1", "format_rate", "steps_mean"):
            assert arm["mean"][metric] == pytest.approx(best["metrics"][metric]), (point.name, metric)
        logged = [json.loads(x) for x in (out / point.name / "metrics.jsonl").read_text().splitlines()]
        kl = [r["kl_max"] for r in logged if "kl_max" in r]
        assert arm["mean"]["kl_max"] == pytest.approx(max(kl))
        record = json.loads((out / point.name / SWEEP_POINT).read_text())
        weight = record["resolved"]["reward"]["params"]["answer_weight"]
        key = "reward.params.answer_weight"
        assert weight == point.overrides[key] == arm["overrides"][key]
        assert record["resolved"]["training"]["max_steps"] == 2
    rows = (out / "report.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("arm,seeds_done,accuracy_mean,accuracy_std")
    md = (out / "report.md").read_text()
    for arm in ("answer_weight=0.65_step_weight=0.35", "answer_weight=0.8_step_weight=0.2"):
        assert f"| {arm} | 1 |" in md


def test_a_forked_point_computes_what_a_new_interpreter_computes(tiny_sweep, tiny_sweep_file, tmp_path):
    """The fixture's points were forked (two at a time); the same point in a new interpreter, with
    the same threads, writes the same weights to the bit and validates the same."""
    sweep = sw.load_sweep(tiny_sweep_file, tmp_path / "spawned")
    point = sweep.points[0]
    settings = launch.Settings(threads=max(1, launch.cores() // 2), fork=False)
    assert sw.run_point(sweep, point, say=lambda _: None, settings=settings) == "done"
    for name in ("final/model.safetensors", "validation.jsonl"):
        assert (sweep.output_dir / point.name / name).read_bytes() == (
            tiny_sweep.output_dir / point.name / name
        ).read_bytes(), name


@pytest.mark.slow
@pytest.mark.xdist_group(__name__)  # the fixture's worker: its fork server is started already
@pytest.mark.parametrize("fork", [True, False])
def test_a_run_is_forked_with_the_libraries_loaded_or_started_anew(tmp_path, fork):
    probe = launch.Entry("tests/fork_probe.py", "fork_probe")
    log = tmp_path / "run.log"
    log.write_text("earlier\n")
    assert launch.run(probe, ["--a", "1"], log, REPO, settings=launch.Settings(threads=1, fork=fork)) == 3
    lines = log.read_text().splitlines()
    seen = json.loads(lines[-1])
    assert lines[0] == "earlier"  # appended to
    assert seen["libraries_loaded"] is (fork and launch.can_fork())
    assert seen["threads"] == 1 and seen["argv"] == ["--a", "1"] and seen["argv0"] == "tests/fork_probe.py"
    assert seen["cwd"] == str(REPO) and seen["pid"] != os.getpid()


def test_a_point_stopped_while_evaluated_is_evaluated_when_the_sweep_runs_again(tiny_sweep, tiny_sweep_file, tmp_path):
    import yaml

    raw = yaml.safe_load(tiny_sweep_file.read_text())
    raw["eval"] = {"data": "data/wordproblems/val.jsonl", "max_samples": 2, "max_new_tokens": 8}
    sweep = sw.load_sweep(write(tmp_path, yaml.safe_dump(raw)), tmp_path / "sw")
    point = sweep.points[0]
    shutil.copytree(tiny_sweep.output_dir / point.name, sweep.output_dir / point.name)  # trained, not evaluated
    assert sw.run_point(sweep, point, say=lambda _: None) == "skipped"
    report = json.loads((sweep.output_dir / point.name / "eval" / "report.json").read_text())
    assert report["rows"] == 2 and report["model"] == str(sweep.output_dir / point.name / "final")


def slow_points(tmp_path: Path, model: Path, steps: int, *names: str) -> Path:
    """A sweep file of answer-only points on the tiny model that train ``steps`` steps and save no
    checkpoint before their end (unless stopped)."""
    return write(
        tmp_path,
        f"""
base: {REPO / "configs" / "tiny.yaml"}
overrides: {{training.max_steps: {steps}, training.save_steps: 1000, validation.eval_steps: 0,
            model.name_or_path: {model}, reward.name: answer_only}}
points: [{", ".join(f"{{name: {n}}}" for n in names)}]
""",
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_sweep_stops_its_running_point_after_a_checkpoint(sig, tiny_lm_path, tmp_path):
    """SIGINT (Ctrl-C, to the sweep's process alone) or SIGTERM (a scheduler's): the running point
    hears it from the sweep, saves a checkpoint at the end of its step and stops; no other point
    starts; the sweep exits 130. The sweep starts with SIGINT ignored, as a shell starts a background
    job: it must still hear it."""
    path = slow_points(tmp_path, tiny_lm_path, 300, "a", "b")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "scripts/sweep.py", str(path), "--output_dir", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        wait_for(out / "a" / "metrics.jsonl", proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    saved = [p for p in (out / "a").glob("checkpoint-*") if checkpoint_problem(p) is None]
    assert len(saved) == 1 and 0 < int(saved[0].name.split("-")[1]) < 300
    assert not (out / "b").exists()


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "subprocess"])
def test_a_killed_sweep_takes_its_running_point_with_it_and_a_relaunch_resumes_it(tiny_lm_path, tmp_path, fork):
    """SIGKILL of the sweep (an OOM killer, a scheduler's kill -9): its running point, a child of the
    fork server, was re-parented to PID 1 and trained on; the relaunched sweep found the point in use
    by a live run and reported it FAILED (exit 1), while the orphan finished it. Now the point gets
    SIGTERM when the sweep is gone, saves its step and stops; a relaunch waits for a point still
    alive, then resumes it."""
    import fcntl

    path = slow_points(tmp_path, tiny_lm_path, 40, "a")
    out, run = tmp_path / "out", tmp_path / "out" / "a"
    cmd = [sys.executable, "scripts/sweep.py", str(path), "--output_dir", str(out), *([] if fork else ["--no_fork"])]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(run / "metrics.jsonl", proc)
    finally:
        proc.kill()
        proc.communicate()
    relaunched = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)  # at once
    assert relaunched.returncode == 0, relaunched.stdout[-3000:] + relaunched.stderr[-3000:]
    assert "[a] resuming" in relaunched.stdout  # not "finished earlier": the orphan did not train on to the end
    assert json.loads((out / "sweep_status.json").read_text())["a"]["status"] == "done"
    with open(run / "run.lock") as fh:  # nothing holds the point any more
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    steps = logged_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 40  # each step once


def test_a_relaunch_waits_for_a_point_a_live_run_holds(tmp_path):
    """A point whose run outlived its sweep (saving its last step after the sweep was killed, or
    started by hand) was reported FAILED ("in use by a live run"); a relaunch now waits for it."""
    from crystal_grpo.train.run.folder import wait_for_holder

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "holding\n"
    said = []
    start = time.monotonic()
    wait_for_holder(tmp_path, said.append)
    assert holder.wait(timeout=60) == 0 and time.monotonic() - start >= 1.0
    assert len(said) == 1 and said[0].startswith(f"{tmp_path} is in use by a live run (pid {holder.pid} on ")
    assert said[0].endswith(": python -c): waiting for it to stop")
    said.clear()
    wait_for_holder(tmp_path, said.append)  # nobody holds it: at once, without a word
    assert said == []


HOLD = """
import sys, time
from pathlib import Path
from crystal_grpo.train.run.folder import RunLock
with RunLock(Path(sys.argv[1]), "python -c"):
    print("holding", flush=True)
    time.sleep(1.5)
"""


def test_rerun_skips_finished_points(tiny_sweep):
    logs = {p.name: (tiny_sweep.output_dir / p.name / POINT_LOG).read_bytes() for p in tiny_sweep.points}
    assert sw.run_sweep(tiny_sweep, say=lambda _: None) == {p.name: "skipped" for p in tiny_sweep.points}
    for p in tiny_sweep.points:
        assert (tiny_sweep.output_dir / p.name / POINT_LOG).read_bytes() == logs[p.name]


def test_an_interrupted_point_resumes_from_its_last_checkpoint(tiny_sweep, tiny_sweep_file, tmp_path):
    sweep = sw.load_sweep(tiny_sweep_file, tmp_path / "copy")
    point = sweep.points[1]
    folder = sweep.output_dir / point.name
    shutil.copytree(tiny_sweep.output_dir / point.name, folder)
    # as if killed after checkpoint-1 was written: later checkpoints and the end markers are gone
    for gone in ("checkpoint-2", "final"):
        shutil.rmtree(folder / gone)
    (folder / SUMMARY).unlink()
    (folder / PHASE_DONE).unlink()
    assert sw.run_point(sweep, point, say=lambda _: None) == "done"
    log = (folder / POINT_LOG).read_text()
    assert f"resuming from {folder / 'checkpoint-1'}" in log
    assert (folder / "final").is_dir() and (folder / "checkpoint-2").is_dir()


def test_a_failing_point_does_not_stop_the_others(tiny_lm_path, tmp_path):
    path = write(
        tmp_path,
        f"""
base: {REPO / "configs" / "tiny.yaml"}
overrides: {{training.max_steps: 1, validation.eval_steps: 1, model.name_or_path: {tiny_lm_path}}}
points:
  - {{name: broken, overrides: {{model.name_or_path: {tmp_path / "no-such-model"}}}}}
  - {{name: fine, overrides: {{reward.name: answer_only}}}}
""",
    )
    sweep = sw.load_sweep(path, tmp_path / "out")
    assert sw.run_sweep(sweep, say=lambda _: None) == {"broken": "failed", "fine": "done"}
    status = json.loads((sweep.output_dir / sweep_report.STATUS_FILE).read_text())
    assert status["broken"]["returncode"] == 2 and "no-such-model" in status["broken"]["log_tail"]
    report = build(sweep)
    assert [p["status"] for p in report["points"]] == ["failed", "done"]
    assert [a["seeds_done"] for a in report["arms"]] == [0, 1]
    assert point_metrics(sweep.output_dir / "fine")["best_step"] is not None
    # the CLI reports the failure (exit 1) after running the rest, and lists it in report.md
    assert sw.main([str(path), "--output_dir", str(tmp_path / "out")]) == 1
    md = (tmp_path / "out" / "report.md").read_text()
    assert "- broken: failed (exit code 2)" in md and "no-such-model" in md


def test_collapse_and_divergence_are_reported():
    from crystal_grpo.train.tools.sweep_report import collapse_step, divergence

    val = [{"step": 0, "format_rate": 0.9}, {"step": 4, "format_rate": 0.6}, {"step": 8, "format_rate": 0.3}]
    assert collapse_step(val) == 8
    assert collapse_step([{"step": 0, "format_rate": 0.2}, {"step": 4, "format_rate": 0.05}]) is None
    assert (
        divergence({"nonfinite_skipped": 3.0, "format_collapse_step": 8})
        == "3 non-finite updates skipped; format collapsed at step 8"
    )
    assert divergence({"nonfinite_skipped": 0.0, "format_collapse_step": None}) == "no"


def test_the_report_compares_arms_with_seed_aware_intervals(tmp_path):
    """Two arms x 3 seeds of evaluation files: the report's interval resamples seeds, so an arm
    whose seeds disagree gets a wide interval and a Welch p, not a row-only 'significant' one."""
    from crystal_grpo.train.tools.sweep_report import paired_on_eval

    path = write(
        tmp_path,
        f"""
base: {REPO / "configs" / "tiny.yaml"}
points: [{{name: a}}, {{name: b}}]
seeds: [1, 2, 3]
eval: {{data: data/wordproblems/val.jsonl}}
""",
    )
    sweep = sw.load_sweep(path, tmp_path / "sw")
    rng = np.random.default_rng(0)
    shift = {"a": [0.0, 0.0, 0.0], "b": [0.05, -0.03, 0.12]}  # b's seeds scatter
    for p in sweep.points:
        folder = tmp_path / "sw" / p.name / "eval"
        folder.mkdir(parents=True)
        (folder / "report.json").write_text("{}")
        acc = np.clip(0.4 + shift[p.arm][p.seed - 1] + rng.normal(0, 0.02, 50), 0, 1)
        (folder / "predictions.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "id": f"r{i}",
                        "sample": 0,
                        "accuracy": float(x),
                        "f1": 0.5,
                        "ordered_f1": 0.5,
                        "format_rate": 1.0,
                        "steps_mean": 2.0,
                    }
                )
                + "\n"
                for i, x in enumerate(acc)
            )
        )
    paired = paired_on_eval(sweep, ["a", "b"], bootstrap=500)
    b = paired["arms"]["b"]["accuracy"]
    assert b["seeds"] == 3 and b["diff"] == pytest.approx(np.mean(shift["b"]), abs=0.01)
    assert b["ci_low"] < 0 < b["ci_high"]  # seeds that disagree: no "significant" difference
    assert b["p_seeds"] > 0.05 and b["seeds_needed"] > 3
    text = markdown({"sweep": "s", "arms": [], "points": [], "paired_eval": paired})
    assert "two-level bootstrap" in text and "p=" in text


def test_a_point_is_evaluated_at_its_final_weights_and_at_its_best_checkpoint_when_another(tiny_sweep, tmp_path):
    folder = shutil.copytree(tiny_sweep.output_dir / tiny_sweep.points[0].name, tmp_path / "p")
    best = json.loads((folder / "best_checkpoint.json").read_text())
    assert best["checkpoint"] == "checkpoint-2" and sweep_report.eval_targets(folder) == {"eval": folder / "final"}
    (folder / "best_checkpoint.json").write_text(json.dumps({**best, "step": 1, "checkpoint": "checkpoint-1"}))
    shutil.rmtree(folder / "checkpoint-2")  # the last checkpoint rotated away (save_total_limit): still "another"
    assert sweep_report.eval_targets(folder) == {"eval": folder / "final", "eval_best": folder / "checkpoint-1"}
    # the report reads each from its own evaluation; one not evaluated yet is missing, never the other's numbers
    from crystal_grpo.train.tools.sweep_report import point_metrics

    (folder / "eval").mkdir(exist_ok=True)
    (folder / "eval" / "report.json").write_text(json.dumps({"overall": {"accuracy": {"value": 0.5}}}))
    row = point_metrics(folder)
    assert row["eval_accuracy"] == 0.5 and row.get("eval_best_accuracy") is None
    (folder / "eval_best").mkdir()
    (folder / "eval_best" / "report.json").write_text(json.dumps({"overall": {"accuracy": {"value": 0.25}}}))
    assert point_metrics(folder)["eval_best_accuracy"] == 0.25


def test_eval_also_scores_the_final_weights_again_with_some_settings_changed(tmp_path, monkeypatch):
    """``eval.also``: each named evaluation is the primary one with its settings changed, of the final
    weights, into ``<point>/eval_<name>``; one that has its report is not run again."""
    point = sw.Point("p", "p", "tiny.yaml", {})
    folder = tmp_path / "p"
    (folder / "final").mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # a finished one-phase run folder, as far as the evaluation reads
    sweep = sw.Sweep(
        "s",
        "python",
        tmp_path,
        [point],
        eval={
            "data": "rows.jsonl",
            "temperature": 1.0,
            "num_samples": 2,
            "also": {"greedy": {"temperature": 0, "num_samples": 1}},
        },
    )
    calls = []

    def evaluate(entry, argv, *_, **__):  # scripts/evaluate.py's launch: record it, leave the report it would write
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "report.json").write_text("{}")
        return 0

    monkeypatch.setattr(sw.launch, "run", evaluate)
    assert sw.evaluate_point(sweep, point, say=lambda _: None)
    args = {Path(a[a.index("--out") + 1]).name: dict(zip(a[0::2], a[1::2])) for a in calls}
    common = {"--model": str(folder / "final"), "--data": "rows.jsonl"}
    assert args == {
        "eval": {**common, "--out": str(folder / "eval"), "--num_samples": "2", "--temperature": "1.0"},
        "eval_greedy": {**common, "--out": str(folder / "eval_greedy"), "--num_samples": "1", "--temperature": "0"},
    }
    calls.clear()
    assert sw.evaluate_point(sweep, point, say=lambda _: None) and calls == []


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_sweep_file_loads_with_each_point_s_config_valid(path, tmp_path):
    """The experiments the docs cite are these files: each must expand into points whose configs
    (a point's own, its overrides applied) pass the same checks a run's do, and its contrasts name arms."""
    sweep = sw.load_sweep(path, output_dir=tmp_path, resolve_init=False)
    assert sweep.points
    for point in sweep.points:
        assert sw.resolved(point)["training"]
