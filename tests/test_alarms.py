"""Alarms on the training log (train/trainer/alarms.py), each provoked by construction on the tiny model."""

from __future__ import annotations

import json

from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import AlarmSection
from crystal_grpo.train.trainer.alarms import AlarmCallback


def _run(tmp_path, tiny_lm_path, *overrides):
    out = tmp_path / "run"
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(out),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--validation.eval_steps",
        "0",
        "--validation.at_start",
        "false",
        *overrides,
    ]
    assert grpo.main(argv) == 0
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_truncation_steps_and_recall_alarms(tmp_path, tiny_lm_path, capsys):
    """Four tokens: every completion is cut off and writes no finished step, so no step matches."""
    _, rows = _run(
        tmp_path,
        tiny_lm_path,
        "--training.max_completion_length",
        "4",
        "--alarms.window",
        "2",
        "--alarms.max_truncated",
        "0.5",
    )
    out = capsys.readouterr().out
    first, second = [r for r in rows if "loss" in r]
    assert not any(k.startswith("alarm/") for k in first)  # the window is not full yet
    assert {k for k in second if k.startswith("alarm/")} == {"alarm/truncated", "alarm/steps", "alarm/recall"}
    for name in ("truncated", "steps", "recall"):
        assert out.count(f"alarm {name}:") == 1, out


def test_zero_reward_std_alarm_stops_the_run_when_asked(tmp_path, tiny_lm_path, capsys):
    run, rows = _run(
        tmp_path,
        tiny_lm_path,
        "--reward.params.answer_weight",
        "0",
        "--reward.params.step_weight",
        "0",
        "--training.max_steps",
        "4",
        "--alarms.zero_std_steps",
        "2",
        "--alarms.stop_on_alarm",
        "true",
    )
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and "alarm/zero_std" in steps[1] and "alarm/zero_std" not in steps[0]
    assert (run / "checkpoint-2").is_dir()
    assert "alarm zero_std: the reward's std was 0 for 2 steps in a row" in capsys.readouterr().out


def test_an_alarm_fires_once_until_it_recovers():
    said = []
    cb = AlarmCallback(AlarmSection(min_steps=3.0, window=1, max_truncated=None, min_recall=None), said.append)

    class State:
        is_world_process_zero, global_step = True, 0

    class Control:
        should_save = should_training_stop = False

    for steps in (2.0, 2.5, 4.0, 1.0):
        State.global_step += 1
        cb.on_log(None, State, Control, {"loss": 0.0, "cpr/steps_mean": steps})
    assert [line.split(":")[1].strip() for line in said] == ["step 1", "step 4"]


def test_a_resumed_run_takes_up_the_alarms_where_its_log_left_them():
    rows = [{"step": s, "loss": 0.0, "reward_std": 0.0} for s in (1, 2, 3)]
    cb = AlarmCallback(AlarmSection(zero_std_steps=3), print)
    cb.replay(rows)
    assert cb.zero_std_run == 3 and cb.active == {"zero_std"}
