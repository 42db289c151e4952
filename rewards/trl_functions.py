"""A reward module as plain TRL reward functions, one per component, for a plain
``trl.GRPOTrainer(reward_funcs=...)`` (``CrystalGRPOTrainer`` evaluates the module once itself
and uses these for their names only).

TRL calls each function separately on the same batch; the module's evaluation (parse, check,
embed, gather across processes, the guard) must run once per batch, not once per component.
A batch is recognised by *round* and *content*: the first function called evaluates it and
the others read the result, each once; a function called again, or called on other
completions, starts the next batch. (Keyed by the identity of the completions list, as it
was, a list reused and refilled in place, or a new list at a freed list's address, read the
previous batch's rewards; keyed by content alone, two batches that happen to be equal would
be evaluated once and the guard would skip the second.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crystal_grpo.distributed import gather_objects
from crystal_grpo.rewards.batch import Batch

if TYPE_CHECKING:
    from crystal_grpo.rewards.base import RewardModule


def _content(prompts: Any, completions: Sequence[Any]) -> str:
    """What identifies a batch's content (a snapshot: refilling the same list changes it)."""
    return repr((prompts, completions))


@dataclass
class _Evaluated:
    """One evaluated batch: its content, every component's values, the components not yet read."""

    content: str
    values: dict[str, list[float | None]]
    unread: set[str]


class TRLRewardFunctions:
    """The functions of one module, sharing one evaluation per generation batch."""

    def __init__(self, module: RewardModule) -> None:
        self.module = module
        self._batch: _Evaluated | None = None

    def functions(self) -> list[Callable[..., list[float | None]]]:
        """One function per component, named after it and carrying its ``objective``."""
        funcs = []
        for comp, objective in self.module.objectives.items():

            def func(prompts=None, completions=None, _comp=comp, **kwargs):
                return self.call(_comp, prompts, completions, kwargs)[_comp]

            func.__name__ = func.__qualname__ = comp
            func.objective = objective  # type: ignore[attr-defined]
            funcs.append(func)
        return funcs

    def call(
        self, component: str, prompts: Any, completions: Sequence[Any], kwargs: dict
    ) -> dict[str, list[float | None]]:
        """Every component's values for this process's completions, asked for by ``component``'s
        function: the batch is evaluated by the first function called on it, read by the others."""
        content = _content(prompts, completions)
        last = self._batch
        if last is None or component not in last.unread or last.content != content:
            last = self._batch = _Evaluated(
                content, self.evaluate(prompts, completions, kwargs), set(self.module.objectives)
            )
        last.unread.discard(component)
        return last.values

    def evaluate(self, prompts: Any, completions: Sequence[Any], kwargs: dict) -> dict[str, list[float | None]]:
        """Score this process's rows, gather every process's, reward the global batch (the guard
        steps once) and log the diagnostics through TRL's ``log_metric``."""
        module = self.module
        start = time.perf_counter()
        n = len(completions)
        # every column TRL passes (a composed reward's own functions read any of them)
        columns = {k: v for k, v in {"prompt": prompts, **kwargs}.items() if isinstance(v, list) and len(v) == n}
        rows = [{k: v[i] for k, v in columns.items()} for i in range(n)]
        local = module.score(completions, rows).batch
        gathered, offset = gather_objects(local.rows())
        comps, metrics = module.rewards(Batch.from_rows(gathered, len(module.extra_fields)))
        metrics["scoring_seconds"] = time.perf_counter() - start
        if kwargs.get("log_metric") is not None:
            for key, value in metrics.items():
                if math.isfinite(value):
                    kwargs["log_metric"](f"{module.name}/{key}", value)
        mine = slice(offset, offset + n)
        return {k: [None if math.isnan(x) else x for x in v[mine].tolist()] for k, v in comps.items()}
