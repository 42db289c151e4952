"""Interrupted runs lose nothing: completion markers, ``latest`` skipping incomplete or
corrupt checkpoints, a real SIGKILL in the middle of a save, graceful SIGINT/SIGTERM (one
process and two), logs that hold each step once after a resume, and the warning about
overrides the restored optimizer state undoes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.train.run.checkpoints import (
    CheckpointError,
    checkpoint_problem,
    latest_complete,
    resolve_resume,
    truncate_logs,
    write_marker,
)
from crystal_grpo.train.run.layout import MARKER, checkpoint_folders, checkpoint_name, step_of
from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer

from runs import REPO, env, grpo_cmd, grpo_with, logged_steps, wait_for


# --- the marker and what "complete" means ------------------------------------------------------
def _fake_checkpoint(run: Path, step: int, marker: bool = True) -> Path:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "optimizer.pt").write_bytes(b"x" * 100)
    if marker:
        write_marker(folder, step)
    return folder


def test_checkpoint_folders_are_named_as_transformers_saves_them(tmp_path):
    """train/run/layout.py spells the folder name once, and it is the one the Trainer writes."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    assert checkpoint_name(12) == f"{PREFIX_CHECKPOINT_DIR}-12" and step_of(tmp_path / checkpoint_name(12)) == 12
    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-x", "final"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-11").write_text("not a folder")
    assert [p.name for p in checkpoint_folders(tmp_path)] == ["checkpoint-9", "checkpoint-10"]
    assert step_of(tmp_path / "final") is None and step_of(tmp_path / "checkpoint-x") is None


def test_latest_is_the_newest_complete_checkpoint_and_says_what_it_skipped(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    good = _fake_checkpoint(tmp_path, 10)
    truncated = _fake_checkpoint(tmp_path, 20)
    with open(truncated / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    _fake_checkpoint(tmp_path, 30, marker=False)  # killed before the marker
    (tmp_path / "checkpoint-40").mkdir()  # killed right after mkdir
    (tmp_path / "checkpoint-50").write_text("not a folder")
    chosen, skipped = latest_complete(tmp_path)
    assert chosen == good
    assert [s.split(":")[0] for s in skipped] == [
        str(tmp_path / "checkpoint-40"),
        str(tmp_path / "checkpoint-30"),
        str(truncated / "model.safetensors"),
    ]
    assert "incomplete (no checkpoint_complete.json" in skipped[0]
    assert "100 bytes, " in skipped[2] and "truncated" in skipped[2]
    said = []
    assert resolve_resume(tmp_path, "latest", said.append) == str(good)
    assert said[-1] == f"resuming from {good}" and len(said) == 4


def test_a_checkpoint_corrupted_at_the_same_size_is_not_resumed(tmp_path):
    """model.safetensors corrupted at the same size, marker intact: resumed, and the accuracy fell
    from 0.375 to 0. The marker's sha256 finds it where a run resumes: latest
    falls back to the previous complete checkpoint and says so; an explicit path is refused."""
    good = _fake_checkpoint(tmp_path, 2)
    bad = _fake_checkpoint(tmp_path, 4)
    weights = bad / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as fh:  # a byte of the last weight: the header stays valid
        fh.seek(size - 1)
        last = fh.read(1)
        fh.seek(size - 1)
        fh.write(bytes([last[0] ^ 0xFF]))
    assert weights.stat().st_size == size and checkpoint_problem(bad) is None  # sizes and header agree
    problem = (
        f"{weights}: its content is not what was saved (sha256 differs from checkpoint_complete.json's: "
        "corrupted or overwritten)"
    )
    assert checkpoint_problem(bad, checksums=True) == problem
    said = []
    assert resolve_resume(tmp_path, "latest", said.append) == str(good)
    assert said == [f"skipping {problem}", f"resuming from {good}"]
    with pytest.raises(CheckpointError) as err:
        resolve_resume(tmp_path, str(bad))
    assert str(err.value) == f"cannot resume: {problem}"


def test_a_resume_on_a_longer_schedule_trains_at_its_rate_not_the_saved_one():
    """transformers restores the optimizer's saved rate (0 at the end of a linear schedule) and
    builds the scheduler for the new max_steps; the first step after the resume trained at 0."""
    from transformers import get_scheduler

    from crystal_grpo.train.trainer.checkpoint_hooks import continue_schedule

    def made(steps: int):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-4)
        return optimizer, get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=steps)

    optimizer, scheduler = made(4)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()
    optimizer, scheduler = made(5)  # resumed with max_steps 5, as the Trainer does it
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] == 0.0  # what step 5 trained at
    assert continue_schedule(optimizer, scheduler) == (4, 0.0, pytest.approx(2e-5))
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == pytest.approx(2e-5)
    optimizer, scheduler = made(4)  # the same schedule: nothing changes, bit for bit
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert continue_schedule(optimizer, scheduler) is None


def test_a_renamed_checkpoint_is_not_resumed_as_another_step(tmp_path):
    """checkpoint-2 renamed checkpoint-3: resumed, the logs were cut at step 3 but training went on
    from step 2, so step 3 was logged twice. Its marker holds the step it saved."""
    run = tmp_path / "run"
    for step in (1, 2):
        _fake_checkpoint(run, step)
    (run / "checkpoint-2").rename(run / "checkpoint-3")
    chosen, skipped = latest_complete(run)
    assert chosen == run / "checkpoint-1" and skipped == [
        f"{run / 'checkpoint-3'}: renamed (its {MARKER} holds step 2): resuming it as step 3 would log steps twice or "
        "skip them; rename it back to checkpoint-2"
    ]


def test_explicit_checkpoint_is_checked_file_by_file(tmp_path):
    folder = _fake_checkpoint(tmp_path, 5, marker=False)  # e.g. written by an older version: allowed
    assert checkpoint_problem(folder, require_marker=False) is None
    assert resolve_resume(tmp_path, str(folder)) == str(folder)
    with open(folder / "model.safetensors", "r+b") as fh:  # corrupt the header length
        fh.write(b"\xff" * 8)
    with pytest.raises(Exception, match=rf"cannot resume: {folder / 'model.safetensors'}: truncated safetensors"):
        resolve_resume(tmp_path, str(folder))
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    assert "corrupt safetensors header" in checkpoint_problem(folder, require_marker=False)
    (folder / "trainer_state.json").unlink()
    assert "trainer_state.json: missing" in checkpoint_problem(folder, require_marker=False)
    assert "no such checkpoint folder" in checkpoint_problem(tmp_path / "nope")


def test_a_marker_is_removed_before_a_checkpoint_is_rewritten(tmp_path, tiny_lm_path):
    """The trainer's save: marker last, and an overwritten folder never looks complete midway
    (resumed from checkpoint-1, the run writes checkpoint-2 again)."""
    args = ["--model.name_or_path", str(tiny_lm_path), "--validation.eval_steps", "0", "--training.save_steps", "1"]
    run = tmp_path / "run"
    grpo.run(load_config("tiny.yaml", [*args, "--training.max_steps", "2"])[0], run)
    folder = run / "checkpoint-2"
    stale = json.loads((folder / MARKER).read_text())
    seen = {}

    class Spy(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen["marker"] = json.loads((folder / MARKER).read_text())

    original = CrystalGRPOTrainer._save_optimizer_and_scheduler

    def save_opt(trainer, output_dir):
        seen.setdefault("marker_during_save", (Path(output_dir) / MARKER).exists())
        return original(trainer, output_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CrystalGRPOTrainer, "_save_optimizer_and_scheduler", save_opt)
        grpo.run(
            load_config("tiny.yaml", [*args, "--training.max_steps", "3"])[0],
            run,
            str(run / "checkpoint-1"),
            callbacks=[Spy()],
        )
    assert stale["step"] == 2 and seen["marker_during_save"] is False
    assert "model.safetensors" in seen["marker"]["files"] and "crystal_state.json" in seen["marker"]["files"]
    assert checkpoint_problem(folder) is None and checkpoint_problem(run / "checkpoint-3") is None


def test_truncate_logs_keeps_rows_up_to_the_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo'
    )
    truncate_logs(tmp_path, 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


# --- real runs -----------------------------------------------------------------------------------
KILL_DURING_SAVE = grpo_with("""
from transformers import Trainer
original = Trainer._save_optimizer_and_scheduler
def dying(self, output_dir):
    if self.state.global_step == int(os.environ["KILL_AT_STEP"]):
        os.kill(os.getpid(), signal.SIGKILL)  # the weights of this checkpoint are on disk, the rest is not
    return original(self, output_dir)
Trainer._save_optimizer_and_scheduler = dying
""")


def test_sigkill_while_saving_then_resume_latest_picks_the_last_complete_one(tmp_path, tiny_lm_path, capsys):
    run = tmp_path / "run"
    args = grpo_cmd(
        run, tiny_lm_path, "--training.max_steps", "3", "--training.save_steps", "1", "--validation.eval_steps", "1"
    )[2:]
    proc = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, *args],
        cwd=REPO,
        env={**env(), "KILL_AT_STEP": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (run / "checkpoint-2" / "model.safetensors").exists() and not (run / "checkpoint-2" / MARKER).exists()
    # Before the fix, latest picked checkpoint-2 and crashed (no trainer_state.json there).
    # The resume: in this process.
    assert grpo.main([*args, "--resume_from_checkpoint", "latest"]) == 0
    out = capsys.readouterr().out
    assert f"skipping {run / 'checkpoint-2'}: incomplete" in out
    assert f"resuming from {run / 'checkpoint-1'}" in out
    assert logged_steps(run) == [1, 2, 3]  # step 2 was logged before the kill, and is logged once
    assert logged_steps(run, "validation.jsonl", "accuracy") == [0, 1, 2, 3]  # step 0: validation.at_start
    assert all(checkpoint_problem(run / f"checkpoint-{s}") is None for s in (1, 2, 3))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_saves_and_says_how_to_resume(tmp_path, tiny_lm_path, sig):
    run = tmp_path / "run"
    cmd = grpo_cmd(
        run, tiny_lm_path, "--training.max_steps", "40", "--training.save_steps", "100", "--validation.eval_steps", "0"
    )
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(run / "metrics.jsonl", proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-3000:]
    step = max(logged_steps(run))
    assert step < 40
    line = [x for x in out.splitlines() if x.startswith("interrupted by")]
    resume = (
        f"resume with: python train/grpo.py --config tiny.yaml --output_dir {run} --model.name_or_path "
        f"{tiny_lm_path} --training.max_steps 40 --training.save_steps 100 --validation.eval_steps 0 "
        "--resume_from_checkpoint latest"
    )
    assert line == [f"interrupted by {sig.name} at step {step}: saved {run / f'checkpoint-{step}'}; {resume}"]
    assert checkpoint_problem(run / f"checkpoint-{step}") is None
    assert not (run / "final").exists()  # no end-of-run work: no final model, no final validation
    assert logged_steps(run, "validation.jsonl", "accuracy") == [0]  # only the one before the first step
    if sig == signal.SIGINT:  # the printed command resumes and finishes
        resumed = resume.split(": ", 1)[1].split()[1:]
        resumed[resumed.index("40")] = str(step + 1)
        assert grpo.main(resumed[1:]) == 0
        assert logged_steps(run) == list(range(1, step + 2))


def test_a_closed_terminal_stops_the_run_after_a_save_as_sigterm_does(tmp_path, tiny_lm_path):
    """A terminal closed (an ssh connection dropped) under a run: SIGHUP killed it at once, no
    checkpoint and no line. Here the run's terminal is a pseudo-terminal whose other end is closed:
    the kernel sends the SIGHUP, and every later write to that terminal fails."""
    import fcntl
    import pty
    import termios
    import threading

    run = tmp_path / "run"
    cmd = grpo_cmd(
        run, tiny_lm_path, "--training.max_steps", "40", "--training.save_steps", "100", "--validation.eval_steps", "0"
    )
    master, slave = pty.openpty()

    def own_terminal():  # a session of its own whose controlling terminal is the pty, as a login shell's
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=own_terminal,
    )
    os.close(slave)
    said = bytearray()
    reader = threading.Thread(target=lambda: _drain(master, said), daemon=True)  # a full pty would block the run
    reader.start()
    wait_for(run / "metrics.jsonl", proc)
    os.close(master)  # the terminal closes: SIGHUP to its session
    assert proc.wait(timeout=300) == 128 + signal.SIGHUP
    step = max(logged_steps(run))
    assert step < 40 and checkpoint_problem(run / f"checkpoint-{step}") is None and not (run / "final").exists()
    resumed = [str(step + 1) if a == "40" else a for a in cmd[2:]]
    assert grpo.main([*resumed, "--resume_from_checkpoint", "latest"]) == 0
    assert logged_steps(run) == list(range(1, step + 2))


def _drain(fd: int, into: bytearray) -> None:
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 4096):
            into += chunk


def test_sighup_routes_to_the_stop_unless_it_is_ignored():
    """``nohup`` leaves SIGHUP ignored: the run goes on when the terminal closes, as it asked."""
    from crystal_grpo.signals import routed

    got = []
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with routed(lambda signum, frame: got.append(signum)):
            os.kill(os.getpid(), signal.SIGHUP)
        signal.signal(signal.SIGHUP, lambda signum, frame: got.append("not routed"))
        with routed(lambda signum, frame: got.append(signum)):
            os.kill(os.getpid(), signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert got == [signal.SIGHUP]


def test_one_interrupt_delivered_twice_is_one_and_a_later_one_aborts(monkeypatch):
    """A terminal's Ctrl-C reaches every process of a torchrun job and the launcher forwards it
    again: signals within SAME_INTERRUPT_S of the first are that interrupt; a later one aborts."""
    from crystal_grpo.train.trainer import interrupt

    clock = iter([100.0, 100.0 + interrupt.SAME_INTERRUPT_S / 2, 100.0 + interrupt.SAME_INTERRUPT_S * 2])
    monkeypatch.setattr(interrupt.time, "monotonic", lambda: next(clock))
    stop = interrupt.GracefulStop()
    stop._handler(signal.SIGINT, None)
    assert stop.signum == signal.SIGINT
    stop._handler(signal.SIGINT, None)  # the same Ctrl-C, forwarded: nothing happens
    with pytest.raises(KeyboardInterrupt):
        stop._handler(signal.SIGINT, None)


BLOCKED_SAVE = grpo_with("""
from crystal_grpo.train.trainer import interrupt
from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer
interrupt.SAME_INTERRUPT_S = 0.0  # the test's second Ctrl-C comes whenever it comes
def saving_for_an_hour(self, model, trial):  # a save that takes a while, as a multi-GB one does
    print("SAVE STARTED", flush=True)
    time.sleep(3600)
CrystalGRPOTrainer._save_checkpoint = saving_for_an_hour
""")


def test_a_second_ctrl_c_aborts_at_once(tmp_path, tiny_lm_path):
    """The first Ctrl-C asks for a save; a second one during that save aborts the process
    instead of waiting for it (which here would take an hour: the communicate timeout)."""
    run = tmp_path / "run"
    args = grpo_cmd(
        run, tiny_lm_path, "--training.max_steps", "40", "--training.save_steps", "100", "--validation.eval_steps", "0"
    )[2:]
    with open(tmp_path / "stderr.txt", "w+") as err:  # a file: an unread stderr pipe could fill and block the run
        proc = subprocess.Popen(
            [sys.executable, "-c", BLOCKED_SAVE, *args],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            wait_for(run / "metrics.jsonl", proc)
            proc.send_signal(signal.SIGINT)
            seen = []
            for line in proc.stdout:  # until the graceful save has started
                seen.append(line)
                if line.startswith("SAVE STARTED"):
                    break
            assert seen and seen[-1].startswith("SAVE STARTED"), "".join(seen)[-3000:]
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        err.seek(0)
        assert proc.returncode == 130, err.read()[-3000:]
    assert "aborted" in out and "interrupted by" not in out
    assert not [p for p in run.glob("checkpoint-*") if checkpoint_problem(p) is None]


def test_resume_warns_about_overrides_the_checkpoint_undoes(tmp_path, tiny_lm_path, capsys):
    common = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(tmp_path / "run"),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--validation.eval_steps",
        "0",
        "--training.save_steps",
        "1",
        "--training.lr_scheduler_type",
        "constant",
    ]
    assert grpo.main([*common, "--training.max_steps", "2"]) == 0
    capsys.readouterr()
    assert (
        grpo.main(
            [
                *common,
                "--training.max_steps",
                "3",
                "--training.learning_rate",
                "5e-5",
                "--resume_from_checkpoint",
                "latest",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "warning: training.learning_rate is 5e-05 but the checkpoint was trained with 0.0001: resuming "
        "restores the optimizer and scheduler state, so the run continues with 0.0001"
    ) in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (step3,) = [r for r in rows if "loss" in r and r["step"] == 3]
    assert step3["learning_rate"] == pytest.approx(1e-4)  # as the warning says: the checkpoint's rate, not 5e-5
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "crystal_state.json").read_text())
    assert state["settings"]["learning_rate"] == pytest.approx(1e-4)  # the optimizer's truth, not the config's
    record, config = (json.loads((tmp_path / "run" / name).read_text()) for name in ("run.json", "config.json"))
    assert record["config"]["training"]["learning_rate"] == config["training"]["learning_rate"] == 1e-4  # were 5e-5


def test_resume_with_logs_after_the_checkpoint_logs_each_step_once(tmp_path, tiny_lm_path):
    common = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(tmp_path / "run"),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--validation.eval_steps",
        "1",
        "--validation.max_samples",
        "2",
    ]
    assert grpo.main([*common, "--training.max_steps", "3", "--training.save_steps", "2"]) == 0
    run = tmp_path / "run"
    assert (
        grpo.main(
            [
                *common,
                "--training.max_steps",
                "4",
                "--training.save_steps",
                "2",
                "--resume_from_checkpoint",
                str(run / "checkpoint-2"),
            ]
        )
        == 0
    )
    assert logged_steps(run) == [1, 2, 3, 4]
    assert logged_steps(run, "validation.jsonl", "accuracy") == [0, 1, 2, 3, 4]
    best = json.loads((run / "best_checkpoint.json").read_text())
    assert (run / best["checkpoint"]).is_dir()


def _trained_prompts(model: Path, out: Path, resume: str | None = None, trainer_class=CrystalGRPOTrainer) -> dict:
    """{step: the prompts it trained on, in order}: 8 prompts, 4 a step, so an epoch is 2 steps."""
    from datasets import Dataset
    from trl import GRPOConfig

    seen = {}

    def record(prompts, completions, trainer_state, **kwargs):
        seen[trainer_state.global_step + 1] = list(dict.fromkeys(prompts))
        return [float(i % 2) for i in range(len(completions))]

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=4,
        max_steps=6,
        save_strategy="no" if resume else "steps",
        save_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
    )
    trainer_class(
        model=str(model),
        reward_funcs=record,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)]),
    ).train(resume_from_checkpoint=resume)
    return seen


def test_a_run_resumed_in_a_later_epoch_trains_the_prompts_of_the_uninterrupted_one(tmp_path, tiny_lm_path):
    """Without a curriculum (TRL's sampler): resumed at the epoch boundary, a run trained epoch
    0's prompts again (step 3 got step 1's); mid-epoch 1, epoch 0's second half."""
    from trl import GRPOTrainer

    straight = _trained_prompts(tiny_lm_path, tmp_path / "run")
    assert straight == _trained_prompts(tiny_lm_path, tmp_path / "trl", trainer_class=GRPOTrainer)  # TRL's order
    assert [straight[1], straight[2]] != [straight[3], straight[4]]  # epochs differ (seed 42): the check can fail
    for step in (2, 3):  # at the boundary of epochs 0 and 1; inside epoch 1
        resumed = _trained_prompts(
            tiny_lm_path, tmp_path / f"from{step}", str(tmp_path / "run" / f"checkpoint-{step}")
        )
        assert resumed == {s: straight[s] for s in range(step + 1, 7)}, step


def torchrun_40_steps(run: Path, model: Path, port: int) -> list[str]:
    """Two CPU processes under torchrun, 40 steps with no checkpoint or validation on the way."""
    args = ["--cpu_backend", "gloo", "--training.max_steps", "40", "--training.save_steps", "100"]
    args += ["--validation.eval_steps", "0"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    return [*launcher, *grpo_cmd(run, model, *args)[1:]]


@pytest.mark.slow
def test_ctrl_c_on_a_torchrun_job_stops_gracefully(tmp_path, tiny_lm_path, free_port):
    """A terminal's Ctrl-C reaches the launcher's process group; torchrun forwards it to the
    workers (in sessions of their own) and SIGKILLs them after its shutdown timeout."""
    run = tmp_path / "run"
    cmd = torchrun_40_steps(run, tiny_lm_path, free_port)
    run_env = env(TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    wait_for(run / "metrics.jsonl", proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    step = max(logged_steps(run))
    assert f"interrupted by SIGINT at step {step}" in out, err[-3000:]
    assert "aborted" not in out and checkpoint_problem(run / f"checkpoint-{step}") is None


@pytest.mark.slow
def test_two_processes_stop_at_the_same_step_when_only_one_gets_the_signal(tmp_path, tiny_lm_path, free_port):
    """Only rank 1 receives SIGTERM; both ranks agree (all-reduce) and save one checkpoint."""
    run = tmp_path / "run"
    cmd = torchrun_40_steps(run, tiny_lm_path, free_port)
    run_env = env(TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(run / "metrics.jsonl", proc)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    rank1 = [
        pid
        for pid in children
        if "LOCAL_RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    ]
    assert len(rank1) == 1, children
    os.kill(int(rank1[0]), signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    step = max(logged_steps(run))
    assert f"interrupted by SIGTERM at step {step}" in out, err[-3000:]
    assert checkpoint_problem(run / f"checkpoint-{step}") is None
    # the hint repeats the launcher actually used (it said `accelerate launch` for torchrun jobs)
    launcher = f"{sys.executable} -m torch.distributed.run --nproc_per_node 2 --master_port {free_port}"
    assert f"resume with: {launcher} train/grpo.py --config tiny.yaml --output_dir {run} " in out
    assert out.rstrip().endswith("--resume_from_checkpoint latest")
