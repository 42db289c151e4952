"""Alarms a long run needs: a warning line and a metric when the training signal goes bad.

The CRYSTAL authors' training notes tell users to watch the steps written and step recall and
to stop when they fall (steps below 3.0, recall below 0.25: reasoning collapsing); TRL users
report runs where truncation silently zeroed most rewards; and a reward whose std is zero
step after step teaches nothing (every advantage is 0). Each alarm here watches one of these
in the trainer's own log rows, averaged over the last ``window`` steps (one noisy step is not
a collapse), and fires once when it crosses its bound (again only after it has recovered):
one ``warning:`` line, ``alarm/<name>`` = 1 in that step's log row (``metrics.jsonl``), and with
``stop_on_alarm`` a save and a stop.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from crystal_grpo.train.config.run_config import AlarmSection

logger = logging.getLogger(__name__)


def _metric(logs: dict[str, Any], suffix: str) -> float | None:
    """``<reward>/<suffix>`` (the reward module's diagnostics) or ``suffix`` itself, when finite."""
    for key, value in logs.items():
        if (
            (key == suffix or key.endswith("/" + suffix))
            and not key.startswith(("val_", "eval_"))
            and isinstance(value, (int, float))
            and math.isfinite(value)
        ):
            return float(value)
    return None


class AlarmCallback(TrainerCallback):
    """Watches every training log row (see the module docstring). Add it before the callback that
    writes ``metrics.jsonl``, so the ``alarm/*`` values land in the same row."""

    def __init__(self, cfg: AlarmSection, say: Callable[[str], None] = logger.warning) -> None:
        self.cfg, self.say = cfg, say
        self.recent: dict[str, deque] = {k: deque(maxlen=cfg.window) for k in ("truncated", "steps", "recall")}
        self.zero_std_run = 0
        self.active: set[str] = set()

    def checks(self, logs: dict[str, Any]) -> dict[str, str]:
        """The alarms this row raises: name -> why."""
        c, out = self.cfg, {}
        for name, key in (("truncated", "completions/clipped_ratio"), ("steps", "steps_mean"), ("recall", "recall")):
            value = _metric(logs, key)
            if value is not None:
                self.recent[name].append(value)
        mean = {k: sum(v) / len(v) for k, v in self.recent.items() if len(v) == self.cfg.window}
        if c.max_truncated is not None and mean.get("truncated", 0.0) > c.max_truncated:
            out["truncated"] = (
                f"{mean['truncated']:.0%} of completions were cut off at max_completion_length over "
                f"the last {c.window} steps (bound {c.max_truncated:.0%}): raise it, or the reward "
                "judges unfinished answers"
            )
        if c.min_steps is not None and mean.get("steps", math.inf) < c.min_steps:
            out["steps"] = (
                f"{mean['steps']:.2f} reasoning steps written on average over the last {c.window} steps "
                f"(floor {c.min_steps}): the reasoning may be collapsing"
            )
        if c.min_recall is not None and mean.get("recall", math.inf) < c.min_recall:
            out["recall"] = (
                f"step recall {mean['recall']:.3f} over the last {c.window} steps (floor "
                f"{c.min_recall}): the steps written match few reference steps"
            )
        std = _metric(logs, "reward_std")
        if std is not None:
            self.zero_std_run = self.zero_std_run + 1 if std == 0.0 else 0
        if c.zero_std_steps is not None and self.zero_std_run >= c.zero_std_steps:
            out["zero_std"] = (
                f"the reward's std was 0 for {self.zero_std_run} steps in a row: every advantage is "
                "0, nothing is learned (a constant reward, or every completion equally right/wrong)"
            )
        return out

    def replay(self, rows: list[dict[str, Any]]) -> None:
        """Take up a resumed run's state from its log (truncated to the checkpoint), silently: the
        alarms after the resume are those of the run that never stopped."""
        for row in rows:
            if "loss" in row:
                self.active = set(self.checks(row))

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if not logs or "loss" not in logs:  # training rows only (not validation's or the closing summary)
            return control
        raised = self.checks(logs)
        for name, why in raised.items():
            logs[f"alarm/{name}"] = 1.0
            if name not in self.active and state.is_world_process_zero:
                self.say(
                    f"warning: step {state.global_step}: alarm {name}: {why}"
                    + ("; stopping (alarms.stop_on_alarm)" if self.cfg.stop_on_alarm else "")
                )
        self.active = set(raised)
        if raised and self.cfg.stop_on_alarm:
            control.should_save = True
            control.should_training_stop = True
        return control
