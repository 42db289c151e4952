"""Your own reward without editing this package: named by import path, or composed in YAML.

Both live in a run config, so they reach sweeps and every tool that reads the run's config:
``reward.name: my_pkg.rewards:MyReward`` (or ``./my_reward.py:MyReward``) names a
:class:`RewardModule` subclass; ``reward.components`` is a weighted sum of TRL-style reward
functions (``fn(completions, **columns) -> list[float | None]``) and this package's own terms
(``crystal:<term>``, :data:`TERMS`), each tagged with the objective it serves so PCGrad can
split them. A user function is called once per process on that process's completions, as TRL
calls it; its values travel with the rest of the evaluation (``Batch.extra``). Examples:
docs/rewards.md, "Your own reward, from YAML".
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import numbers
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from crystal_grpo.errors import TRACEBACK_VARIABLE, some_of
from crystal_grpo.rewards.base import (
    Batch,
    Objective,
    RewardConfig,
    RewardFunctionError,
    RewardModule,
    Scored,
    value_problem,
)
from crystal_grpo.rewards.cpr import CPRConfig
from crystal_grpo.rewards.step_credit import StepCreditConfig
from crystal_grpo.typed import ConfigError, option
from crystal_grpo.user_code import ImportPathError, load_object

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: ``crystal:<term>``: per-row terms of the one evaluation (docs/method.md sections 2-4),
#: read after a malformed completion is zeroed (``reward.params.malformed``).
TERMS: dict[str, Callable[[Batch], torch.Tensor]] = {
    "accuracy": lambda b: b.correct,  # C
    "format": lambda b: b.format_ok,  # F
    "steps": lambda b: b.step,  # Match F1 (or Ordered Match F1: reward.params.step_metric)
    # CPR's reasoning term without its weight (Eq. 7): the step score, discounted on a wrong answer
    "cpr_steps": lambda b: b.step * (b.correct + CPRConfig.wrong_answer_discount * (1 - b.correct)),
}


#: The error of a reward or component named by import path that cannot be used (the loader,
#: crystal_grpo/user_code.py, serves curriculum modes too).
RewardImportError = ImportPathError


@dataclass
class ComponentSpec:
    """One term of a composed reward (``reward.components`` of a run config)."""

    fn: str = option(
        "",
        "A TRL-style reward function as 'package.module:name' or 'path/file.py:name', or "
        "crystal:<term> (" + ", ".join(TERMS) + ").",
    )
    weight: float = option(1.0, "Its weight in the sum.", weight=True)
    objective: Union[Objective, None] = option(
        None, "accuracy or reasoning: the objective it serves (PCGrad needs it for every component)."
    )
    name: Union[str, None] = option(None, "Its name in logs (default: the function's).")


def component_function(spec: str) -> Callable[..., Any] | None:
    """The user's function of ``spec``, checked; None for a ``crystal:`` term."""
    if spec.startswith("crystal:"):
        if spec[len("crystal:") :] not in TERMS:
            raise ConfigError(
                f"reward.components: unknown term {spec!r}; crystal: terms are "
                + ", ".join(f"crystal:{t}" for t in TERMS)
            )
        return None
    fn = load_object(spec, "reward component")
    if isinstance(fn, type) or not callable(fn):
        raise RewardImportError(
            f"reward component {spec!r} is a {type(fn).__name__}, not a function "
            "fn(completions, **columns) -> list[float | None]"
        )
    return fn


@dataclass
class ComposedConfig(RewardConfig):
    """Shared reward settings plus the components (``reward.components``)."""

    components: list[ComponentSpec] = option(default_factory=list, help="The weighted terms, summed.")


def _names(specs: Sequence[ComponentSpec]) -> list[str]:
    names: list[str] = []
    for s in specs:
        base = s.name or s.fn.rpartition(":")[2]
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


class ComposedReward(RewardModule):
    """A weighted sum of user reward functions and ``crystal:`` terms."""

    name = "composed"
    config_class = ComposedConfig
    config: ComposedConfig

    def __init__(
        self, config: ComposedConfig | None = None, *, step_credit: StepCreditConfig | None = None, **params: Any
    ) -> None:
        cfg = config if config is not None else self.make_config(params)
        if not cfg.components:
            raise ConfigError("reward.components: empty; a composed reward needs at least one component")
        self.specs = list(cfg.components)
        self.component_names = _names(self.specs)
        self.functions = [component_function(s.fn) for s in self.specs]
        # untagged components only occur without PCGrad (train/config/run_config.py refuses them with it)
        self.objectives = {n: s.objective or "accuracy" for n, s in zip(self.component_names, self.specs)}
        self.extra_fields = tuple(n for n, f in zip(self.component_names, self.functions) if f is not None)
        self.uses_steps = any(s.fn in ("crystal:steps", "crystal:cpr_steps") for s in self.specs)
        self.outcome_component = self.outcome_name(cfg)
        super().__init__(cfg, step_credit=step_credit)

    @classmethod
    def outcome_name(cls, config: ComposedConfig) -> str | None:
        """The first ``crystal:accuracy`` component (C); a user's own function is no outcome."""
        specs = list(config.components)
        return next((n for n, s in zip(_names(specs), specs) if s.fn == "crystal:accuracy"), None)

    def score(
        self, completions: Sequence[Any], rows: Sequence[Mapping[str, Any]], with_steps: bool | None = None
    ) -> Scored:
        scored = super().score(completions, rows, with_steps)
        if self.extra_fields:
            columns = _columns(rows)
            values = [
                self._call(spec, fn, completions, columns)
                for spec, fn in zip(self.specs, self.functions)
                if fn is not None
            ]
            scored.batch.extra = scored.batch.correct.new_tensor(values).reshape(len(values), -1).T  # float64
        return scored

    @staticmethod
    def _call(spec: ComponentSpec, fn: Callable, completions: Sequence[Any], columns: dict) -> list[float]:
        """The function's values (None: NaN, not applicable), each checked (docs/rewards.md, "What a
        reward returns"): anything else is an error naming the function, the row and the value."""
        what = f"reward component {spec.fn!r} on {_batch(len(completions), columns)}"
        try:
            inspect.signature(fn).bind(completions=completions, **columns)
        except TypeError as err:
            raise RewardFunctionError(
                f"{what}: cannot be called as TRL calls a reward function, "
                f"fn(completions, **columns) with the columns {', '.join(columns)} ({err}); "
                "give it a **kwargs parameter"
            ) from None
        except ValueError:
            pass  # no signature to read (a builtin): the call says what is wrong
        with _said_while_running(what):
            try:
                out = fn(completions=list(completions), **columns)
            except SystemExit as stop:  # (uncaught, it ended the run with its exit code and no word)
                raise RewardFunctionError(
                    f"{what} raised SystemExit({stop.code!r}): a reward returns one value a "
                    "completion; it must not end the process"
                ) from None
            except Exception as err:
                raise RewardFunctionError(
                    f"{what} raised {type(err).__name__}: {err} (at {_origin(err)}; "
                    f"{TRACEBACK_VARIABLE}=1 prints the traceback)"
                ) from err
        if getattr(out, "ndim", None) == 1 and hasattr(out, "tolist"):  # a numpy array or torch tensor, as TRL takes
            out = out.tolist()
        if not isinstance(out, (list, tuple)) or len(out) != len(completions):
            got = f"{len(out)} value(s)" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
            raise RewardFunctionError(
                f"reward component {spec.fn!r} returned {got} for {len(completions)} completion(s); "
                "expected a list with one number (or None) per completion"
            )
        ids = columns.get("id") or [None] * len(out)
        values = []
        for i, v in enumerate(out):
            where = f"for completion {i}" + (f" (row {ids[i]!r})" if ids[i] is not None else "")
            if v is None:
                values.append(math.nan)  # not applicable, as in TRL
                continue
            if isinstance(v, bool) or type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"):
                v = float(v)  # True/False are 1/0, as TRL's float tensor of the values reads them
            if not isinstance(v, numbers.Real):  # numpy's number scalars are numbers.Real
                raise RewardFunctionError(
                    f"reward component {spec.fn!r} returned {v!r} {where}; expected a number or None"
                )
            problem = (
                "nan (NaN is not a reward: return None where the function does not apply, as in TRL)"
                if math.isnan(v)
                else value_problem(float(v))
            )
            if problem:
                raise RewardFunctionError(f"reward component {spec.fn!r} returned {problem} {where}")
            values.append(float(v))
        return values

    def components(self, batch: Batch) -> dict[str, torch.Tensor]:
        out, k = {}, 0
        for name, spec, fn in zip(self.component_names, self.specs, self.functions):
            if fn is None:
                value = TERMS[spec.fn[len("crystal:") :]](batch)
            else:
                value, k = batch.extra[:, k], k + 1
            out[name] = spec.weight * value
        return out


def _batch(n: int, columns: Mapping[str, list]) -> str:
    """``8 completion(s) of rows wp-0001, wp-0002``: what a reward function was scoring."""
    ids = list(dict.fromkeys(str(i) for i in columns.get("id") or []))
    return f"{n} completion(s)" + (f" of rows {some_of(ids)}" if ids else "")


def _origin(err: BaseException) -> str:
    """``file.py:12 in f``: the innermost frame of an error's traceback (where the user's code raised)."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


#: A user's reward function still running after this many seconds is said to be, again every as many.
SLOW_CALL_S = 15.0


@contextlib.contextmanager
def _said_while_running(what: str) -> Iterator[None]:
    """A warning line every :data:`SLOW_CALL_S` seconds while the body runs: a reward function
    that waits on something (a judge model, an API) otherwise stalls a step without a word."""
    done, start = threading.Event(), time.monotonic()

    def watch() -> None:
        while not done.wait(SLOW_CALL_S):
            logger.warning("%s: still running, %.0f s so far", what, time.monotonic() - start)

    watcher = threading.Thread(target=watch, name="reward-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Every data column as one list, the keyword arguments TRL gives a reward function."""
    keys = list(dict.fromkeys(k for r in rows if isinstance(r, Mapping) for k in r))
    columns = {k: [r.get(k) if isinstance(r, Mapping) else None for r in rows] for k in keys}
    if "prompt" in columns:
        columns["prompts"] = columns.pop("prompt")
    return columns
