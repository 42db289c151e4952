"""A reward module as plain TRL reward functions, one per component, for a plain
``trl.GRPOTrainer(reward_funcs=...)`` (``CrystalGRPOTrainer`` evaluates the module once itself
and uses these for their names only).

TRL calls each function separately on the same batch; the module's evaluation (parse, check,
embed, gather across processes, the guard) must run once per batch, not once per component.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from crystal_grpo.distributed import gather_objects
from crystal_grpo.rewards.evaluation import Batch

if TYPE_CHECKING:
    from crystal_grpo.rewards.base import RewardModule


class TRLRewardFunctions:
    """The functions of one module, sharing one evaluation per generation batch."""

    def __init__(self, module: RewardModule) -> None:
        self.module = module
        self._last: tuple[Any, dict[str, list]] | None = None

    def functions(self) -> list[Callable[..., list[float | None]]]:
        """One function per component, named after it and carrying its ``objective``."""
        funcs = []
        for comp, objective in self.module.objectives.items():

            def func(prompts=None, completions=None, _comp=comp, **kwargs):
                return self.call(prompts, completions, kwargs)[_comp]

            func.__name__ = func.__qualname__ = comp
            func.objective = objective  # type: ignore[attr-defined]
            funcs.append(func)
        return funcs

    def call(self, prompts: Any, completions: Sequence[Any], kwargs: dict) -> dict[str, list[float | None]]:
        """Every component's values for this process's completions; the batch is evaluated by
        the first function TRL calls on it and read by the others."""
        if self._last is not None and self._last[0] is completions:
            return self._last[1]
        out = self.evaluate(prompts, completions, kwargs)
        self._last = (completions, out)
        return out

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
