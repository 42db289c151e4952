"""A run folder holds one run and says so: a finished run launched again changes nothing,
a run killed before its first checkpoint starts its logs over, a second live run or a
different config is refused, a full disk is said in one line, and everything a run needs
is checked before anything starts."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import apply_phase, load_config
from crystal_grpo.train.run.checkpoints import checkpoint_problem
from crystal_grpo.train.run.folder import RunFolderError, RunLock, clear_run, config_diff, data_digests, foreign_folder
from crystal_grpo.train.run.layout import LOCK, MARKER, POINT_LOG, RECORD, SWEEP_POINT
from crystal_grpo.train.tools import sweep

from runs import REPO, env, grpo_cmd, grpo_with, logged_steps, snapshot, wait_for

QUICK = ["--validation.eval_steps", "2", "--validation.max_samples", "2", "--training.save_steps", "2"]


def phases(n1: int = 2, n2: int = 2) -> str:
    return json.dumps(
        [
            {
                "name": "warmup",
                "init_from": "none",
                "overrides": {"reward": {"name": "answer_only"}, "training": {"max_steps": n1}},
            },
            {"name": "cpr", "init_from": "best", "overrides": {"training": {"max_steps": n2, "learning_rate": 1e-5}}},
        ]
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_lm_path) -> dict[str, Path]:
    """A finished single-phase run (4 steps) and a finished two-phase run, trained once per module."""
    root = tmp_path_factory.mktemp("finished")
    common = ["--config", "tiny.yaml", "--model.name_or_path", str(tiny_lm_path), *QUICK]
    assert grpo.main([*common, "--output_dir", str(root / "single"), "--training.max_steps", "4"]) == 0
    assert grpo.main([*common, "--output_dir", str(root / "multi"), "--phases", phases()]) == 0
    return {"single": root / "single", "multi": root / "multi", "common": common}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _user_files(run: Path, outside: Path) -> dict[str, bytes]:
    """A user's note, subfolder, own README (over the run's model card) and a link out of the
    folder, put into a run folder."""
    outside.mkdir()
    (run / "sub").mkdir()
    (outside / "mine.txt").write_text("the user's file, outside the run folder")
    files = {"notes.txt": b"my notes", "sub/a.txt": b"kept", "README.md": b"# my README, not a model card\n"}
    for name, data in files.items():
        (run / name).write_bytes(data)
    (run / "link").symlink_to(outside)  # a link is never followed, nor removed
    return files


# --- a finished run stays finished ----------------------------------------------------------
@pytest.mark.parametrize("kind, extra", [("single", ["--training.max_steps", "4"]), ("multi", ["--phases", phases()])])
@pytest.mark.parametrize("resume", [True, False], ids=["resumed", "launched_again"])
def test_a_finished_run_launched_again_changes_nothing(finished, tmp_path, capsys, kind, extra, resume):
    run = _copy(finished[kind], tmp_path / kind)
    before = snapshot(run)
    argv = [*finished["common"], "--output_dir", str(run), *extra]
    assert grpo.main([*argv, *(["--resume_from_checkpoint", "latest"] if resume else [])]) == 0
    out = capsys.readouterr().out
    assert f"{run}: this run already finished" in out and "nothing to do" in out
    assert f"(validation before -> after; {run / 'run_summary.json'}):\nphase " in out  # its table again
    after = snapshot(run)
    for name in (RECORD, LOCK):  # the launch record and the lock say who came; nothing of the run changed
        after.pop(name), before.pop(name)
    assert after == before  # not a byte, not a timestamp: no step 5, no new checkpoint, final/ untouched


def test_a_finished_sweep_point_run_by_its_emitted_command_changes_nothing(tmp_path, tiny_lm_path, monkeypatch):
    sw = sweep.load_sweep(REPO / "configs/sweeps/tiny.yaml", tmp_path / "sw")
    point = sw.points[0]
    point.overrides["model.name_or_path"] = str(tiny_lm_path)
    point.run_config = None
    folder = sweep.prepare(sw, point)
    cmd = sweep.command(sw, point, sys.executable)
    assert "--resume_from_checkpoint" in cmd  # what a requeued Slurm task runs
    assert cmd[:2] == [sys.executable, "train/grpo.py"]
    monkeypatch.chdir(REPO)  # where the command runs: its config path is relative to the checkout
    assert grpo.main(cmd[2:]) == 0  # the first run: in this process; the run "again" is the command itself
    before = snapshot(folder)
    again = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "this run already finished" in again.stdout, again.stderr[-3000:]
    after = snapshot(folder)
    for name in (RECORD, LOCK, "train.log"):
        after.pop(name, None), before.pop(name, None)
    assert after == before


def test_a_larger_max_steps_continues_the_run_and_says_so(finished, tmp_path, capsys, caplog):
    """...on transformers' schedule for the new max_steps (linear here: 1e-4 x (5 - 4) / 5 at step 5), said
    in one line; step 5 trained at the checkpoint's rate, 0, and changed no weight. And a user's files
    beside the run (their own README.md too) stay as they are."""
    from safetensors.torch import load_file

    run = _copy(finished["single"], tmp_path / "single")
    files = _user_files(run, tmp_path / "outside")
    argv = [*finished["common"], "--output_dir", str(run), "--resume_from_checkpoint", "latest"]
    assert grpo.main([*argv, "--training.max_steps", "5"]) == 0
    out = capsys.readouterr().out
    assert f"{run}: finished at step 4; continuing to training.max_steps 5" in out
    assert logged_steps(run) == [1, 2, 3, 4, 5] and checkpoint_problem(run / "checkpoint-5") is None
    (step5,) = [
        r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r.get("step") == 5 and "loss" in r
    ]
    assert step5["learning_rate"] == pytest.approx(2e-5, rel=1e-6)
    assert (
        "resumed at step 4 on a learning-rate schedule other than the checkpoint's (lr_scheduler_type linear, "
        "max_steps 5): transformers plans it over the whole run from step 0, so step 5 trains at 2e-05, not at "
        "the checkpoint's 0;"
    ) in caplog.text
    before, after = (load_file(run / f"checkpoint-{n}" / "model.safetensors") for n in (4, 5))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert {name: (run / name).read_bytes() for name in files} == files  # no model card over the user's README
    assert json.loads((run / "phase_done.json").read_text())["global_step"] == 5
    launches = json.loads((run / RECORD).read_text())["launches"]
    assert [x["how"] for x in launches] == ["fresh", "resume"]


def test_a_run_killed_after_its_last_step_finishes_without_training_past_it(finished, tmp_path, capsys):
    """Killed after checkpoint-4 (the last step) but before final/: HF's loop, resumed, would train step 5."""
    from safetensors.torch import load_file

    run = _copy(finished["single"], tmp_path / "single")
    for name in ("final", "phase_done.json", "summary.json"):
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    argv = [*finished["common"], "--output_dir", str(run), "--training.max_steps", "4"]
    assert grpo.main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    assert "already holds step 4 of max_steps 4: finishing the phase without training" in capsys.readouterr().out
    assert logged_steps(run) == [1, 2, 3, 4] and not (run / "checkpoint-5").exists()
    ours, theirs = (
        load_file(run / "final" / "model.safetensors"),
        load_file(finished["single"] / "final" / "model.safetensors"),
    )
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert (run / "validation.jsonl").read_text() == (finished["single"] / "validation.jsonl").read_text()


def test_an_explicit_checkpoint_is_resumed_or_refused_in_one_line(finished, tmp_path, capsys):
    """--resume_from_checkpoint PATH: a missing path or another run's checkpoint started a fresh
    run; an older checkpoint-2 resumed the newest instead."""
    run = _copy(finished["single"], tmp_path / "single")
    argv = [*finished["common"], "--training.max_steps", "4", "--resume_from_checkpoint"]
    for path, where, message in (
        (tmp_path / "nope", tmp_path / "new", f"cannot resume: {tmp_path / 'nope'}: no such checkpoint folder"),
        (
            run / "checkpoint-4",
            tmp_path / "new",
            f"cannot resume: {run / 'checkpoint-4'} is not a checkpoint of "
            f"the run in {tmp_path / 'new'}: resume its own run (--output_dir {run}), or start a new run from its "
            f"weights (--model.name_or_path {run / 'checkpoint-4'})",
        ),
        (
            run / "checkpoint-2",
            run,
            f"{run}: this run already finished (step 4); resuming its older "
            f"{run / 'checkpoint-2'} would train its steps again over its results",
        ),
    ):
        assert grpo.main([*argv, str(path), "--output_dir", str(where)]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "new").exists()
    for name in ("final", "phase_done.json", "summary.json"):  # killed after its last checkpoint
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    assert grpo.main([*argv, str(run / "checkpoint-2"), "--output_dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        f"resuming from {run / 'checkpoint-2'}, older than checkpoint-4: that one is no longer complete "
        "(completion marker removed)"
    ) in out
    assert logged_steps(run) == [1, 2, 3, 4]  # steps 3 and 4 trained again, logged once
    assert checkpoint_problem(run / "checkpoint-4") is None  # saved over


def test_a_data_file_changed_since_the_last_launch_is_named_on_resume(finished, tmp_path, capsys):
    """The training file replaced between a run and its resume: no word. Here
    run.json says it had other content at the last launch; data_digests reads the content."""
    run = _copy(finished["single"], tmp_path / "single")
    for name in ("final", "phase_done.json", "summary.json"):  # killed after its last checkpoint
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    record = json.loads((run / RECORD).read_text())
    train = record["config"]["data"]["train"]
    now = data_digests([train])[train]
    assert record["launches"][-1]["data"][train] == now  # recorded at the launch
    record["launches"][-1]["data"][train] = "sha256:0123456789abcdef"
    (run / RECORD).write_text(json.dumps(record))
    argv = [*finished["common"], "--output_dir", str(run), "--training.max_steps", "4"]
    assert grpo.main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    assert (
        f"warning: {train} changed since this run's last launch (sha256:0123456789abcdef -> {now}): the steps "
        "from here train on its new content, the steps before on the old"
    ) in capsys.readouterr().out
    assert json.loads((run / RECORD).read_text())["launches"][-1]["data"][train] == now


def test_data_digests_follow_a_file_s_content_and_a_folder_s_names_and_sizes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "a.jsonl").write_text('{"q": 1}\n')
    (tmp_path / "d" / "x.arrow").write_text("1234")
    first = data_digests([str(tmp_path / "a.jsonl"), str(tmp_path / "d"), "org/hub-dataset", None])
    assert set(first) == {str(tmp_path / "a.jsonl"), str(tmp_path / "d")}
    (tmp_path / "a.jsonl").write_text('{"q": 2}\n')  # same size, other content
    (tmp_path / "d" / "x.arrow").write_text("12345")
    second = data_digests([str(tmp_path / "a.jsonl"), str(tmp_path / "d")])
    assert all(first[k] != second[k] for k in first)


def test_an_unreadable_run_json_is_kept_aside_not_rewritten(finished, tmp_path, capsys):
    """A corrupted run.json was rewritten, its launch history lost. Resumed
    after its last checkpoint (a launch that writes the record and trains no step)."""
    run = _copy(finished["single"], tmp_path / "single")
    for name in ("final", "phase_done.json", "summary.json"):
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    broken = (run / RECORD).read_bytes()[:-40]  # cut off: not JSON
    (run / RECORD).write_bytes(broken)
    argv = [*finished["common"], "--output_dir", str(run), "--training.max_steps", "4"]
    assert grpo.main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    out = capsys.readouterr().out
    (aside,) = run.glob(f"{RECORD}.unreadable-*")
    assert aside.read_bytes() == broken
    assert (
        f"{run / RECORD} is unreadable (not the JSON record of a run's config and launches): kept as "
        f"{aside.name}; a new {RECORD} starts the launch history"
    ) in out
    assert [x["how"] for x in json.loads((run / RECORD).read_text())["launches"]] == ["resume"]


def test_more_steps_for_a_phase_that_later_phases_started_from_is_refused(finished, tmp_path, capsys):
    run = _copy(finished["multi"], tmp_path / "multi")
    argv = [*finished["common"], "--output_dir", str(run), "--resume_from_checkpoint", "latest"]
    assert grpo.main([*argv, "--phases", phases(n1=3)]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'phase1-warmup'} finished at step 2, and later phases started from it" in err


# --- killed before the first complete checkpoint ------------------------------------------
KILL_IN_FIRST_SAVE = grpo_with("""
from transformers import Trainer
original = Trainer._save_optimizer_and_scheduler
def dying(self, output_dir):
    os.kill(os.getpid(), signal.SIGKILL)  # the first checkpoint is never completed
Trainer._save_optimizer_and_scheduler = dying
""")


def test_a_run_killed_before_its_first_checkpoint_logs_each_step_once(tmp_path, tiny_lm_path, capsys):
    run = tmp_path / "run"
    args = grpo_cmd(
        run,
        tiny_lm_path,
        "--training.max_steps",
        "4",
        "--training.save_steps",
        "2",
        "--validation.eval_steps",
        "2",
        "--validation.max_samples",
        "2",
    )[2:]
    killed = subprocess.run(
        [sys.executable, "-c", KILL_IN_FIRST_SAVE, *args],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert logged_steps(run) == [1, 2] and not (run / "checkpoint-2" / MARKER).exists()
    assert grpo.main([*args, "--resume_from_checkpoint", "latest"]) == 0  # the resume: in this process
    out = capsys.readouterr().out
    assert "the phase starts over at step 0" in out
    assert logged_steps(run) == [1, 2, 3, 4]  # was 1, 2, 1, 2, 3, 4
    assert logged_steps(run, "validation.jsonl", "accuracy") == [0, 2, 4]
    assert "taking over the lock of a run that is gone" in out  # the killed run held it


# --- one run per folder ------------------------------------------------------------------
def test_a_second_live_run_in_the_same_folder_is_refused(tmp_path, tiny_lm_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen(
        grpo_cmd(
            run,
            tiny_lm_path,
            "--training.max_steps",
            "40",
            "--training.save_steps",
            "100",
            "--validation.eval_steps",
            "0",
            "--training.lr_scheduler_type",
            "constant",
        ),
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(run / "metrics.jsonl", first)
        capsys.readouterr()
        # the second run: this process (another pid than the live one that holds the folder)
        assert (
            grpo.main(
                grpo_cmd(
                    run,
                    tiny_lm_path,
                    "--training.max_steps",
                    "3",
                    "--training.learning_rate",
                    "5e-5",
                    "--resume_from_checkpoint",
                    "latest",
                )[2:]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert f"RunFolderError: {run} is in use by a live run (pid {first.pid} on " in err
        assert first.poll() is None  # the first run is not disturbed
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=300)
    assert sorted(set(logged_steps(run))) == logged_steps(run)  # no step of the second run mixed in
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["learning_rate"] for r in rows if "learning_rate" in r} == {1e-4}


def test_a_stale_lock_is_taken_over_with_a_line(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"pid": 999999, "host": "gone", "command": "python train/grpo.py"}))
    said = []
    with RunLock(tmp_path, "python train/grpo.py --config x", said.append):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
        with pytest.raises(RunFolderError, match=f"in use by a live run \\(pid {os.getpid()} on "):
            with RunLock(tmp_path, "another", said.append):
                pass
    assert said == ["taking over the lock of a run that is gone (pid 999999 on gone, started ?: python train/grpo.py)"]
    assert (tmp_path / LOCK).read_text() == ""  # released cleanly
    with RunLock(tmp_path, "next", said.append):
        pass
    assert len(said) == 1  # a cleanly released lock is no stale one


def test_a_fresh_start_in_a_folder_holding_a_run_is_refused_naming_what_differs(finished, tmp_path, capsys):
    run = _copy(finished["single"], tmp_path / "single")
    argv = [*finished["common"], "--output_dir", str(run), "--training.max_steps", "4"]
    before = snapshot(run)
    assert grpo.main([*argv, "--training.learning_rate", "5e-5"]) == 2
    err = capsys.readouterr().err
    assert f"{run} already holds a run with other settings: training.learning_rate: 0.0001 -> 5e-05." in err
    after = snapshot(run)
    after.pop(LOCK), before.pop(LOCK)
    assert "--overwrite_output_dir" in err and after == before  # (test_overwrite_removes_only_what_the_run_wrote)


# --- lost files: a run removes only what it wrote, and writes only into its own folder --
def test_overwrite_removes_only_what_the_run_wrote(finished, tmp_path, capsys):
    run = _copy(finished["single"], tmp_path / "single")
    files = _user_files(run, tmp_path / "outside")
    argv = [*finished["common"], "--output_dir", str(run), "--training.max_steps", "1", "--overwrite_output_dir"]
    assert grpo.main(argv) == 0
    out = capsys.readouterr().out
    assert (
        f"--overwrite_output_dir: removed the run that was in {run}; kept 4 files this run did not write: "
        "README.md, link, notes.txt, sub/\n"
    ) in out
    assert {name: (run / name).read_bytes() for name in files} == files  # the README too: no model card over it
    assert (run / "link").is_symlink() and (tmp_path / "outside" / "mine.txt").is_file()
    assert logged_steps(run) == [1] and not (run / "checkpoint-4").exists()  # the old run is gone, not mixed in
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]


def test_what_a_multi_phase_run_wrote_goes_and_nothing_else(finished, tmp_path):
    """clear_run on a finished two-phase run: each phase folder's own files go, links unfollowed
    (inside a checkpoint, and ``final`` moved to another disk and linked back: the link goes, the
    weights stay); a phase folder holding a user's file stays with that file alone."""
    run = _copy(finished["multi"], tmp_path / "multi")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "mine.txt").write_text("mine")
    (run / "phase1-warmup" / "checkpoint-2" / "data").symlink_to(tmp_path / "outside")
    shutil.move(run / "phase2-cpr" / "final", tmp_path / "outside" / "final")
    (run / "phase2-cpr" / "final").symlink_to(tmp_path / "outside" / "final")
    weights = (tmp_path / "outside" / "final" / "model.safetensors").read_bytes()
    (run / "phase2-cpr" / "README.md").write_text("---\ntags: [mine]\n---\n# my own card\n")
    (run / "phase2-cpr" / "notes.txt").write_text("notes")
    (run / RECORD).write_text("{not json")  # an unreadable run.json: still the run's file
    assert clear_run(run, keep=()) == ["phase2-cpr/README.md", "phase2-cpr/notes.txt"]
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == [
        "phase2-cpr",
        "phase2-cpr/README.md",
        "phase2-cpr/notes.txt",
    ]
    assert (tmp_path / "outside" / "mine.txt").read_text() == "mine"
    assert (tmp_path / "outside" / "final" / "model.safetensors").read_bytes() == weights


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_a_folder_holding_no_run_is_refused_and_left_as_it_is(tmp_path, tiny_lm_path, capsys, check):
    folder = tmp_path / "clone"
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "README.md").write_text("# a project\n")
    (folder / "config.json").write_text('{"mine": true}')
    before = snapshot(folder)
    argv = grpo_cmd(folder, tiny_lm_path, "--training.max_steps", "1")[2:]
    assert grpo.main([*argv, *(["--check"] if check else [])]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"RunFolderError: --output_dir {folder} holds .git/, README.md, config.json but no run of this "
        "project (no run.json): a run writes only into a new or empty folder or its own run folder, so "
        "nothing here is touched; choose another --output_dir\n"
    )
    assert snapshot(folder) == before and sorted(os.listdir(folder)) == [".git", "README.md", "config.json"]
    with pytest.raises(RunFolderError, match="holds .git/, README.md, config.json but no run"):  # a library caller
        grpo.run(load_config("tiny.yaml", ["--model.name_or_path", str(tiny_lm_path)])[0], folder)
    assert snapshot(folder) == before
    # an empty folder is a new run's folder; a sweep point's (sweep_point.json, then train.log) is its run's,
    # but a lone train.log (a common name) marks nothing
    assert foreign_folder(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    (tmp_path / "point").mkdir()
    (tmp_path / "point" / POINT_LOG).write_text("")
    assert foreign_folder(tmp_path / "point") is not None
    (tmp_path / "point" / SWEEP_POINT).write_text("{}")
    assert foreign_folder(tmp_path / "empty") is None and foreign_folder(tmp_path / "point") is None


def test_make_clean_removes_caches_and_only_clean_runs_removes_runs(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for name in (".cache/models/tiny/config.json", ".cache/wandb/offline-run/log", "runs/x/run.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    assert subprocess.run(["make", "-s", "clean"], cwd=tmp_path).returncode == 0
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        ".cache/wandb/offline-run/log",
        "Makefile",
        "runs/x/run.json",
    ]
    assert subprocess.run(["make", "-s", "clean-runs"], cwd=tmp_path).returncode == 0
    assert not (tmp_path / "runs").exists() and not (tmp_path / ".cache" / "wandb").exists()


def test_config_diff_names_each_changed_key():
    a = {"training": {"learning_rate": 1e-4, "max_steps": 4}, "reward": {"name": "cpr", "params": {}}}
    b = {"training": {"learning_rate": 1e-4, "max_steps": 8}, "reward": {"name": "cpr", "params": {"x": 1}}}
    assert config_diff(a, b) == ["reward.params.x: unset -> 1", "training.max_steps: 4 -> 8"]
    assert config_diff(a, a) == []


# --- disk full ----------------------------------------------------------------------------
ENOSPC_AT_STEP_2 = grpo_with("""
import errno
from transformers import Trainer
original = Trainer._save_optimizer_and_scheduler
def full(self, output_dir):
    if self.state.global_step == 2:
        raise OSError(errno.ENOSPC, "No space left on device", output_dir + "/optimizer.pt")
    return original(self, output_dir)
Trainer._save_optimizer_and_scheduler = full
""")

NO_ROOM_AT_STEP_2 = grpo_with("""
from crystal_grpo.train.run import checkpoints
from crystal_grpo.train.trainer import checkpoint_hooks
real = checkpoints.free_bytes
fake = lambda path: 1000 if os.path.isdir(os.path.join(path, "checkpoint-1")) else real(path)
checkpoints.free_bytes = checkpoint_hooks.free_bytes = fake
""")


@pytest.mark.parametrize(
    "program, said",
    [
        (ENOSPC_AT_STEP_2, "saving {run}/checkpoint-2 failed (OSError: [Errno 28] No space left on device"),
        (NO_ROOM_AT_STEP_2, "not saving {run}/checkpoint-2: 0.0 MB free"),
    ],
    ids=["during_the_save", "before_the_save"],
)
def test_a_full_disk_is_one_line_and_the_run_resumes(tmp_path, tiny_lm_path, caplog, monkeypatch, program, said):
    run = tmp_path / "run"
    args = grpo_cmd(
        run, tiny_lm_path, "--training.max_steps", "3", "--training.save_steps", "1", "--validation.eval_steps", "0"
    )[2:]
    proc = subprocess.run(
        [sys.executable, "-c", program, *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1
    lines = [x for x in proc.stderr.splitlines() if x.startswith("disk full:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"disk full: {said.format(run=run)}")
    assert f"newest complete checkpoint: {run / 'checkpoint-1'}" in lines[0]
    assert "a checkpoint of this run takes" in lines[0] and lines[0].endswith("--resume_from_checkpoint latest")
    assert not (run / "checkpoint-2").exists()  # a partial checkpoint gives its space back
    # the resume: in this process; transformers' log records reach caplog (its logger does not propagate)
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    with caplog.at_level(logging.WARNING):
        assert grpo.main([*args, "--resume_from_checkpoint", "latest"]) == 0
    assert logged_steps(run) == [1, 2, 3]
    assert "missing keys" not in caplog.text  # the tied lm_head is expected to be absent: not reported


def in_tmpfs(options: str, mount: str, program: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c program args`` with a fresh tmpfs (mount ``options``) at ``mount``, in a mount
    namespace of its own (``unshare -m``); skips the test where none can be made."""
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"'
    cmd = ["unshare", "-m", "sh", "-c", script, "sh", options, mount, sys.executable, "-c", program, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    if "mount:" in proc.stderr or "unshare:" in proc.stderr:
        pytest.skip(f"no tmpfs in a mount namespace here: {proc.stderr.strip()[:200]}")
    return proc


OUT_OF_INODES = """
import sys
from pathlib import Path
from crystal_grpo.train.run.checkpoints import space_report, write_marker
run = Path(sys.argv[1], "run")
(run / "checkpoint-1").mkdir(parents=True)
for i in range(12):
    (run / "checkpoint-1" / f"f{i}").write_text("x")
write_marker(run / "checkpoint-1", 1)
for i in range(1000):  # the file system's last entries
    try:
        (run / f"filler{i}").write_text("")
    except OSError:
        break
print(space_report(run))
"""


def test_out_of_inodes_says_inodes_not_space():
    """Out of inodes: "disk full: ... 0.20 GB free ..., a checkpoint of this run takes 7.9 MB", which
    contradicts itself. A tmpfs with 40 inodes and 200 MB of space, filled with empty files."""
    proc = in_tmpfs("size=200m,nr_inodes=40", "/mnt", OUT_OF_INODES, "/mnt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == (
        "0 free inodes (file entries) on the file system of /mnt/run, a checkpoint of this run holds 13 files "
        "(0.21 GB free: the file entries run out, not the space; delete files); newest complete checkpoint: "
        "/mnt/run/checkpoint-1\n"
    )


def test_a_run_out_of_inodes_stops_in_one_line_that_says_inodes(tiny_lm_path):
    """The same on a run: its third checkpoint finds no file entry left (a tmpfs of 45 inodes)."""
    run = "/mnt/run"
    args = grpo_cmd(Path(run), tiny_lm_path, "--training.max_steps", "4", "--training.save_steps", "1")[2:]
    program = "import sys; from crystal_grpo.train import grpo; sys.exit(grpo.cli())"
    proc = in_tmpfs("size=200m,nr_inodes=45", "/mnt", program, *args)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("disk full:")]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "free inodes (file entries) on the file system of /mnt/run, a checkpoint of this run holds" in lines[0]
    assert (
        "the file entries run out, not the space; delete files); newest complete checkpoint: /mnt/run/checkpoint-"
        in lines[0]
    )


# --- everything a run needs, checked first ---------------------------------------------------
def test_the_paper_command_without_its_model_lists_every_missing_piece_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "paper"
    assert grpo.main(["--config", "cpr_curriculum.yaml", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "cannot start: 5 problem(s)"
    assert [x.split(":")[0].strip() for x in err[1:]] == [
        "model.name_or_path",
        "reward.params.encoder",
        "model.dtype",
        "data.train",
        "data.validation",
    ]
    assert "'Qwen/Qwen2.5-VL-3B-Instruct' is not a local folder" in err[1] and "needs a CUDA GPU" in err[3]
    assert not out.exists()  # no run folder, no phase folder


def test_the_command_line_wins_over_a_phase_setting_the_same_key():
    cfg, _ = load_config("cpr_curriculum.yaml", ["--reward.params.encoder", "packaged:all-MiniLM-L6-v2"])
    assert [apply_phase(cfg, p).reward.params["encoder"] for p in cfg.phases] == ["packaged:all-MiniLM-L6-v2"] * 2
    cfg, _ = load_config("cpr_curriculum.yaml", ["--reward.params.step_weight", "0.4"])  # a CPR weight: phase 2 only
    assert [apply_phase(cfg, p).reward.params.get("step_weight") for p in cfg.phases] == [None, 0.4]


# --- the kill-trials tool (its table is docs/reliability.md's evidence) ------------------------
def test_kill_trials_compare_finds_a_repeated_step_a_changed_value_and_other_weights(tmp_path):
    from safetensors.torch import save_file

    from crystal_grpo.train.tools.kill_trials import compare

    def folder(name: str, steps: list[int], loss: float, weight: float) -> Path:
        run = tmp_path / name
        (run / "final").mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": loss}) + "\n" for s in steps))
        (run / "validation.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.5}) + "\n")
        save_file({"w": torch.full((2,), weight)}, run / "final" / "model.safetensors")
        return run

    ref = folder("ref", [1, 2], 0.1, 1.0)
    assert compare(ref, folder("same", [1, 2], 0.1, 1.0)) == []
    assert compare(ref, folder("twice", [1, 1, 2], 0.1, 1.0)) == ["metrics.jsonl: steps [1, 1, 2], reference [1, 2]"]
    assert compare(ref, folder("value", [1, 2], 0.2, 1.0))[0] == "metrics.jsonl step 1: loss 0.2 vs 0.1"
    assert compare(ref, folder("weights", [1, 2], 0.1, 1.0 + 1e-7)) == ["final weights differ in 1 tensor(s), e.g. w"]


def test_a_tilde_in_any_path_is_the_home_folder_for_every_part_of_the_program(
    tmp_path, tiny_lm_path, capsys, monkeypatch
):
    """``--output_dir=~/r`` (a shell expands ``~`` only at the start of a word) or ``~`` in the YAML:
    transformers expanded it, so checkpoints went to $HOME/r while run.json, the logs and final/ went
    to ./~/r, and --check named ``~/r``; a resume then found no checkpoint and trained from step 0.
    Every path given (config, model, data, output folder) is one place."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    (home / "data").mkdir(parents=True)
    shutil.copy(REPO / "data/wordproblems/train.jsonl", home / "data" / "train.jsonl")
    (home / "model").symlink_to(tiny_lm_path)
    config = (REPO / "configs/tiny.yaml").read_text().replace(".cache/models/tiny-qwen2", "~/model")
    (home / "tiny.yaml").write_text(config.replace("data/wordproblems/train.jsonl", "~/data/train.jsonl"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    argv = ["--config=~/tiny.yaml", "--data.validation=~/data/train.jsonl", *QUICK, "--validation.at_start", "false"]
    assert grpo.main([*argv, "--check", "--output_dir=~/r"]) == 0
    assert f"run folder {home / 'r'}\n" in capsys.readouterr().out
    assert grpo.main([*argv, "--training.output_dir", "~/y", "--check"]) == 0  # (quoted: as a YAML file gives it)
    assert f"run folder {home / 'y'}\n" in capsys.readouterr().out
    assert grpo.main([*argv, "--output_dir=~/r", "--training.max_steps", "2"]) == 0
    assert os.listdir(cwd) == []  # no ./~ folder
    run = home / "r"
    assert {"run.json", "metrics.jsonl", "final", "checkpoint-2"} <= set(os.listdir(run))
    assert json.loads((run / RECORD).read_text())["config"]["data"]["train"] == str(home / "data" / "train.jsonl")
    assert (
        grpo.main(
            [*argv, "--output_dir=~/r", "--training.max_steps", "2", "--resume_from_checkpoint=~/r/checkpoint-2"]
        )
        == 0
    )


def test_a_checkpoint_of_another_run_is_not_resumed_and_nothing_is_lost_before_a_resume_can_go_on(
    finished, tmp_path, capsys
):
    """Another run's checkpoint copied into a run folder was resumed by ``latest`` without a word
    (metrics.jsonl then held steps 1-4, then the other run's); resuming on another model size ended
    in a 40-line ``size mismatch`` traceback after the finished run's phase_done.json and
    summary.json were deleted. A checkpoint's marker names the run that wrote it; every check of a
    resume comes before anything of the run is changed."""
    run = _copy(finished["single"], tmp_path / "single")
    argv = [*finished["common"], "--output_dir", str(run), "--training.max_steps", "6"]
    theirs = shutil.copytree(finished["multi"] / "phase2-cpr" / "checkpoint-2", run / "checkpoint-6")
    before = snapshot(run)
    assert grpo.main([*argv, "--resume_from_checkpoint", str(theirs)]) == 2  # named explicitly
    assert capsys.readouterr().err.startswith(f"CheckpointError: cannot resume: {theirs}: written by another run (")
    organism = [str(REPO / "data/organism/warm_start") if a == str(finished["common"][3]) else a for a in argv]
    assert grpo.main([*organism, "--resume_from_checkpoint", "latest"]) == 2  # another model size
    err = capsys.readouterr().err
    assert (
        err.startswith(
            f"CheckpointError: cannot resume: {run / 'checkpoint-4'} does not fit the model "
            f"{REPO / 'data/organism/warm_start'}: 20 of its 26 weights have another shape (e.g. "
        )
        and len(err.splitlines()) == 1
    )
    for name in (LOCK, RECORD):  # the launch record says who came; nothing else changed
        before.pop(name)
    assert {k: v for k, v in snapshot(run).items() if k not in (LOCK, RECORD)} == before
    assert grpo.main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    out = capsys.readouterr().out
    assert f"skipping {theirs}: written by another run (checkpoint_complete.json names run " in out
    assert f"resuming from {run / 'checkpoint-4'}" in out
    assert logged_steps(run) == [1, 2, 3, 4, 5, 6] and checkpoint_problem(run / "checkpoint-6") is None  # its own now
    # no checkpoint of the run left to resume: refused, where the phase used to start over and remove its logs
    other = _copy(finished["single"], tmp_path / "other")
    shutil.rmtree(other / "checkpoint-4")
    marker = json.loads((other / "checkpoint-2" / MARKER).read_text())
    (other / "checkpoint-2" / MARKER).write_text(json.dumps({**marker, "run": "another-run"}))
    before = snapshot(other)
    assert (
        grpo.main(
            [
                *finished["common"],
                "--output_dir",
                str(other),
                "--training.max_steps",
                "6",
                "--resume_from_checkpoint",
                "latest",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(
        f"CheckpointError: cannot resume {other}: it finished, but no checkpoint of this run there can be resumed "
        f"({other / 'checkpoint-2'}: written by another run ("
    ) and err.endswith(
        "and starting it over would remove its logs; nothing was changed. Start the run again with "
        "--overwrite_output_dir, or start a new run (--output_dir)\n"
    )
    assert {k: v for k, v in snapshot(other).items() if k not in (LOCK, RECORD)} == {
        k: v for k, v in before.items() if k not in (LOCK, RECORD)
    }


class _Planted:
    """What an attacker puts in a checkpoint: unpickling it runs a command."""

    def __init__(self, evidence: Path) -> None:
        self.evidence = evidence

    def __reduce__(self):
        return (os.system, (f"touch {self.evidence}",))


@pytest.mark.parametrize("how", ["pickle", "torch_save"])
def test_a_checkpoint_file_that_is_not_tensors_is_one_line_naming_it(finished, tmp_path, capsys, how):
    """rng_state.pth replaced by a pickle (its completion marker rewritten to match): a 40-line
    UnpicklingError whose text advised re-running with weights_only=False. Now one line naming the
    file, before anything of the run changes; the pickle never runs."""
    import pickle

    from crystal_grpo.train.run.checkpoints import write_marker

    run = _copy(finished["single"], tmp_path / "single")
    planted, evidence = run / "checkpoint-4" / "rng_state.pth", tmp_path / "ran"
    if how == "pickle":
        planted.write_bytes(pickle.dumps(_Planted(evidence)))
    else:
        torch.save(_Planted(evidence), planted)
    write_marker(run / "checkpoint-4", 4)
    before = snapshot(run)
    argv = [*finished["common"], "--output_dir", str(run), "--training.max_steps", "6"]
    assert grpo.main([*argv, "--resume_from_checkpoint", "latest"]) == 2
    reason = "not in torch.save's zip format" if how == "pickle" else "Trying to load unsupported GLOBAL posix.system"
    err = capsys.readouterr().err
    assert err.startswith(
        f"CheckpointError: cannot resume: {planted}: not a file of tensors that torch loads safely ({reason}"
    ) and err.endswith("); it is not loaded\n")
    assert "weights_only" not in err and len(err.splitlines()) == 1 and not evidence.exists()
    assert {k: v for k, v in snapshot(run).items() if k not in (LOCK, RECORD)} == {
        k: v for k, v in before.items() if k not in (LOCK, RECORD)
    }


def test_every_file_of_a_run_follows_the_umask_weights_included(finished, tmp_path):
    """safetensors writes 0600: a group sharing the run folder could read everything but the
    weights (checkpoints' and final/'s). Every file gets 0666 less the umask; a checkpoint saved
    under another umask takes that one."""
    from crystal_grpo.train.run.checkpoints import write_marker

    mask = os.umask(0)
    os.umask(mask)
    mode = 0o666 & ~mask
    modes = {str(p.relative_to(finished["single"])): p.stat().st_mode & 0o777 for p in finished["single"].rglob("*")}
    assert {k: oct(m) for k, m in modes.items() if m != mode and not (finished["single"] / k).is_dir()} == {}
    folder = shutil.copytree(finished["single"] / "checkpoint-4", tmp_path / "checkpoint-4")
    (folder / "model.safetensors").chmod(0o600)
    old = os.umask(0o007)
    try:
        write_marker(folder, 4)
    finally:
        os.umask(old)
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o660


def read_only(folder: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` (train/grpo.py's arguments) with ``folder`` bound read-only over itself, in a mount
    namespace of its own (``unshare -m``: the folder stays writable for everyone else)."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    cmd = ["unshare", "-m", "sh", "-c", script, str(folder), sys.executable, "train/grpo.py", *argv]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)


def test_a_read_only_run_folder_is_one_line_and_a_finished_one_has_nothing_to_do(finished, tmp_path):
    """Resuming on a read-only file system, a finished run included: a 15-line ``OSError: [Errno 30]
    Read-only file system: .../run.lock``, --check silent. A finished run has nothing to do (and says
    so); any launch that would write is one line, --check included."""
    probe = subprocess.run(["unshare", "-m", "mount", "--bind", str(tmp_path), str(tmp_path)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here ({probe.stderr.decode().strip()})")
    run = _copy(finished["single"], tmp_path / "single")
    argv = [*finished["common"], "--output_dir", str(run), "--resume_from_checkpoint", "latest"]
    before = snapshot(run)
    done = read_only(run, [*argv, "--training.max_steps", "4"])
    assert done.returncode == 0 and f"{run}: this run already finished (step 4); nothing to do" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    more = read_only(run, [*argv, "--training.max_steps", "6"])
    assert more.returncode == 2 and more.stderr == (
        f"RunFolderError: {run} is on a read-only file system: it holds a finished run, which this launch would "
        "change (train it further, or start it again); copy the run folder to a writable place and launch there "
        "(--output_dir)\n"
    )
    for name in ("final", "phase_done.json", "summary.json"):  # killed after its last checkpoint: not finished
        shutil.rmtree(run / name) if (run / name).is_dir() else (run / name).unlink()
    for check in (["--check"],):  # (a run stops at the same line, before anything loads)
        stopped = read_only(run, [*argv, "--training.max_steps", "4", *check])
        assert stopped.returncode == 2 and stopped.stderr == (
            f"RunFolderError: {run} is on a read-only file system: a run writes its lock, logs and checkpoints "
            "there; make it writable, or copy the run folder to a writable place and resume it there "
            "(--output_dir)\n"
        ), stopped.stderr[-3000:]
    assert {k: v for k, v in snapshot(run).items()} == {
        k: v for k, v in before.items() if k.split("/")[0] not in ("final", "phase_done.json", "summary.json")
    }
