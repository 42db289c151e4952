"""CPR-Curriculum's modes (docs/method.md section 8): which examples a chunk may draw from, and
the pacing; :class:`~crystal_grpo.curricula.sampler.CurriculumSampler` lays the chunks out as
TRL's RepeatSampler does and draws from the pool.

A mode is one :class:`Schedule` subclass, its options the fields of its nested ``Options``
dataclass (keys of the ``curriculum:`` section beside ``mode``, typed and range-checked with
the config, read as ``self.options``); a new mode is one class, a new option one field. The
modes ``competence``, ``buckets`` and ``sorted``: docs/training.md, "CPR-Curriculum: the modes
and the sampler".
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union

from crystal_grpo.curricula.complexity import TIERS
from crystal_grpo.typed import ConfigError, derived, from_dict, option
from crystal_grpo.user_code import FORMS, is_import_path, load_subclass

Pacing = Literal["linear", "sqrt"]
Difficulty = Literal["steps", "complexity"]


@dataclass
class CurriculumSection:
    """The step-count curriculum (``curriculum:`` in a run config; CPR-Curriculum, docs/method.md section 8).

    The fields are what every mode takes; any other key is an option of the mode (its
    Schedule's ``Options``), checked against it by :func:`resolve` when the config is validated.
    """

    mode: str = option(
        "competence",
        "The mode: competence, buckets, sorted, or your Schedule subclass as 'package.module:Name' or "
        "'path/file.py:Name' (docs/training.md, CPR-Curriculum).",
    )
    total_steps: Union[int, None] = option(None, "Pacing horizon T in optimizer steps (default: max_steps).", ge=1)
    difficulty: Difficulty = option("steps", "Order by reference step count or by complexity score.")
    start_chunk: int = option(0, "Global chunk the run starts at (continue a curriculum in a new run).", ge=0)
    options: dict[str, Any] = option(
        default_factory=dict,
        rest=True,
        help="The mode's own options as keys of this section, e.g. competence's c0 (each mode's are listed below).",
    )
    schedule: Union[type, None] = derived("The mode's Schedule class, found when the config is validated.")
    config: Any = derived("The mode's options, typed (its Schedule's Options), made when the config is validated.")


def _default_bucket_order(labels: Sequence[Hashable]) -> list[Hashable]:
    present = list(dict.fromkeys(labels))
    if all(b in TIERS for b in present):
        return [t for t in TIERS if t in present]
    return sorted(present)


@dataclass
class NoOptions:
    """A mode without options of its own."""


class Schedule:
    """A curriculum mode: which examples chunk t may draw from, and its pacing.

    Example i is in the pool of chunk t iff ``key[i] < threshold(t)``; the sampler draws
    chunks from the pool (the pass walk of curricula/sampler.py) unless the mode fixes them
    itself (:meth:`fixed_chunk`). ``options`` is an instance of the nested ``Options``
    dataclass (the mode's keys of the ``curriculum:`` section, defaults where not given);
    ``buckets`` the examples' labels (complexity tiers) for modes that group them. A subclass
    with a ``mode`` name registers itself: adding a mode is one class, usable as
    ``curriculum.mode: <name>`` (or by import path from outside this package).
    """

    mode: ClassVar[str] = ""
    needs_horizon: ClassVar[bool] = True
    Options: ClassVar[type] = NoOptions
    registry: ClassVar[dict[str, type[Schedule]]] = {}
    key: list[int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.mode:
            Schedule.registry[cls.mode] = cls

    def __init__(
        self,
        order: list[int],
        batch_size: int,
        total_steps: int | None,
        options: Any = None,
        buckets: Sequence[Hashable] | None = None,
    ) -> None:
        self.order, self.batch_size, self.total_steps = order, batch_size, total_steps
        self.n = len(order)
        self.options = options if options is not None else self.Options()
        self.buckets = buckets

    @classmethod
    def make_options(cls, options: Mapping[str, Any], where: str = "curriculum") -> Any:
        """The mode's typed options from the section's other keys: an unknown key or a bad
        value is one line naming it."""
        fields = [f.name for f in dataclasses.fields(cls.Options)]
        unknown = [k for k in options if k not in fields]
        if unknown:
            near = difflib.get_close_matches(str(unknown[0]), fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            own = f"its options: {', '.join(fields)}" if fields else "it has no options of its own"
            raise ConfigError(
                f"unknown key {f'{where}.{unknown[0]}'!r}{hint} for mode {cls.mode or cls.__name__!r}; "
                f"{where} takes {', '.join(SECTION_KEYS)}, and {own}"
            )
        return from_dict(cls.Options, dict(options), where)

    def threshold(self, t: int) -> int:
        raise NotImplementedError

    def competence(self, t: int) -> float:
        """Scheduled share of the data at chunk t (logged as ``curriculum/competence``)."""
        raise NotImplementedError

    def pool_size(self, t: int) -> int:
        thr = self.threshold(t)
        return sum(k < thr for k in self.key)

    def fixed_chunk(self, t: int) -> list[int] | None:
        return None


#: The ``curriculum:`` keys every mode takes; any other key is the mode's own.
SECTION_KEYS = tuple(f.name for f in dataclasses.fields(CurriculumSection) if f.init and not f.metadata.get("rest"))


def schedule_class(mode: str | type[Schedule]) -> type[Schedule]:
    """A ``curriculum.mode``: a registered mode's name, or a Schedule subclass (or its import path)."""
    if isinstance(mode, type) and issubclass(mode, Schedule):
        return mode
    if mode in Schedule.registry:
        return Schedule.registry[mode]
    if not is_import_path(mode):
        raise ConfigError(
            f"curriculum.mode: invalid value {mode!r}; expected one of "
            f"{', '.join(map(repr, Schedule.registry))}, or a Schedule subclass as {FORMS}"
        )
    return load_subclass(mode, Schedule, "curriculum.mode")


def resolve(section: CurriculumSection, where: str = "") -> CurriculumSection:
    """Find the section's mode and type its options (``section.schedule``, ``section.config``);
    every problem is one line, raised while the config is checked."""
    try:
        section.schedule = schedule_class(section.mode)
    except ConfigError as err:
        raise ConfigError(f"{where}{err}") from None
    section.config = section.schedule.make_options(section.options, f"{where}curriculum")
    return section


class CompetenceSchedule(Schedule):
    """Platanios et al. 2019: the easiest ``c(t)`` share of the data, never under one chunk."""

    mode = "competence"

    @dataclass
    class Options:
        c0: float = option(0.25, "Initial competence: share of the easiest data available at step 0.", gt=0, le=1)
        pacing: Pacing = option("linear", "c(t) = c0 + (1 - c0) t/T (linear) or sqrt(c0^2 + (1 - c0^2) t/T).")

    def __init__(self, order, batch_size, total_steps, options=None, buckets=None) -> None:
        super().__init__(order, batch_size, total_steps, options, buckets)
        self.c0, self.pacing = self.options.c0, self.options.pacing
        self.key = [0] * self.n
        for r, i in enumerate(order):
            self.key[i] = r

    def competence(self, t: int) -> float:
        x = t / self.total_steps
        if self.pacing == "sqrt":
            return min(1.0, math.sqrt(self.c0**2 + (1.0 - self.c0**2) * x))
        return min(1.0, self.c0 + (1.0 - self.c0) * x)

    def threshold(self, t: int) -> int:
        # 1e-9: c0 * n = 25.000000000000004 must give 25, not 26.
        return min(self.n, max(self.batch_size, math.ceil(self.competence(t) * self.n - 1e-9)))

    def pool_size(self, t: int) -> int:
        return self.threshold(t)


class BucketSchedule(Schedule):
    """Labelled buckets (e.g. complexity tiers) open in ``bucket_order``: bucket k of K from
    chunk ``k T / K`` on; later ones open early rather than leave a chunk short."""

    mode = "buckets"

    @dataclass
    class Options:
        bucket_order: Union[list[Union[str, int]], None] = option(
            None,
            "The bucket labels in the order they open (default: easy, medium, hard for complexity tiers, "
            "else sorted).",
        )

    def __init__(self, order, batch_size, total_steps, options=None, buckets=None) -> None:
        super().__init__(order, batch_size, total_steps, options, buckets)
        if buckets is None or len(buckets) != self.n:
            raise ValueError("mode 'buckets' needs one bucket label per example")
        given = self.options.bucket_order
        self.bucket_order = list(given) if given is not None else _default_bucket_order(buckets)
        rank = {b: k for k, b in enumerate(self.bucket_order)}
        missing = sorted({str(b) for b in buckets if b not in rank})
        if missing:
            raise ValueError(f"bucket label(s) {', '.join(missing)} not in bucket_order {self.bucket_order}")
        self.key = [rank[b] for b in buckets]
        sizes = [self.key.count(k) for k in range(len(self.bucket_order))]
        self._open_size = [0, *itertools.accumulate(sizes)]  # items in the first k buckets

    def _open(self, t: int) -> int:
        """Buckets scheduled open at chunk t: bucket k opens once t >= k T / K."""
        k = len(self.bucket_order)
        return min(k, t * k // self.total_steps + 1)

    def competence(self, t: int) -> float:
        return self._open(t) / len(self.bucket_order)

    def threshold(self, t: int) -> int:
        k = self._open(t)
        while self._open_size[k] < self.batch_size:  # open later buckets early rather than starve
            k += 1
        return k

    def pool_size(self, t: int) -> int:
        return self._open_size[self.threshold(t)]


class SortedSchedule(Schedule):
    """The whole data easiest-first as one endless stream cut into chunks: chunk t holds
    sorted positions t*B .. t*B+B-1 modulo N (every example once per cycle)."""

    mode = "sorted"
    needs_horizon = False

    def __init__(self, order, batch_size, total_steps, options=None, buckets=None) -> None:
        super().__init__(order, batch_size, total_steps, options, buckets)
        self.key = [0] * self.n

    def competence(self, t: int) -> float:
        return 1.0

    def threshold(self, t: int) -> int:
        return 1

    def fixed_chunk(self, t: int) -> list[int]:
        return [self.order[(t * self.batch_size + j) % self.n] for j in range(self.batch_size)]
