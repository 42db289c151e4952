"""A drop-in for TRL's ``RepeatSampler`` that picks WHICH prompts by difficulty
(CPR-Curriculum, docs/method.md section 8: simplest reference chains first, harder ones later).

Layout (identical to ``trl.trainer.utils.RepeatSampler``): one *chunk* is ``batch_size``
distinct indices, i.e. one generation batch; every index is yielded
``mini_repeat_count`` times in a row (the group of generations of one prompt) and the
whole chunk ``repeat_count`` times (``num_iterations * steps_per_generation``
dataloader steps reuse one generation batch). Like RepeatSampler, one iteration
(= one Trainer epoch) yields ``len(difficulty) // batch_size`` chunks, so ``__len__``
is the same number and the Trainer's epoch/step arithmetic is unchanged.

Progress is the GLOBAL chunk index ``t = start_chunk + epoch * chunks_per_epoch + i``.
A chunk is a pure function of (seed, t) and the constructor's arguments, never of the
rank, the epoch or what was iterated before; every rank therefore yields the same
order, and a resumed run that skips chunks continues the identical sequence.
``set_epoch`` (called by the Trainer/accelerate every epoch) selects the epoch; an
iteration that runs to its end also moves to the next epoch, as RepeatSampler's
advancing generator does.

Modes (one :class:`Schedule` subclass each; a new subclass with a ``mode`` name is a new
mode, no other change):

- ``competence`` (Platanios et al. 2019): at chunk t the pool is the easiest
  ``c(t) = min(1, c0 + (1 - c0) t / T)`` share of the data (``pacing="sqrt"``:
  ``min(1, sqrt(c0^2 + (1 - c0^2) t / T))``), sorted by difficulty with ties broken by
  index, and never fewer than ``batch_size`` items.
- ``buckets``: labelled buckets (e.g. complexity tiers) open in ``bucket_order``; bucket
  k (0-based, of K) is available from ``t >= k T / K`` on, so the first is available at
  once and the last from ``(K-1)/K T``. If the open buckets hold fewer than
  ``batch_size`` items the next ones open early.
- ``sorted``: the whole dataset easiest-first (ties by index) as one endless stream
  cut into chunks: chunk t holds sorted positions ``t*B .. t*B+B-1`` modulo N, so
  every example is visited once per cycle (RepeatSampler would drop the N mod B
  hardest every epoch) and a chunk never repeats an index.

How competence/buckets draw from the pool (our choice; the brief suggested seeding by
(seed, t)). Drawing every chunk independently covers the pool unevenly (some prompts
come back often, others never), so we walk *passes*: pass k is a permutation of ALL N
indices, seeded by (seed, k); a chunk takes the next indices of the current pass that
are in the current pool. Each pool member is therefore drawn exactly once per pass (an
epoch over the pool), and an example entering the pool mid-pass lands at a uniformly
random place in the rest of that pass: it becomes available at once, without
reshuffling. An index met again right after a pass boundary in a chunk that already
holds it is deferred to the start of the next chunk: no repeats inside a chunk, no
lost visits. The walk's state depends only on (seed, t), so ``chunk_indices(t)``
replays it from chunk 0 when needed (O(samples drawn / c0), cached for sequential use).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

import numpy as np
from torch.utils.data import Sampler

from crystal_grpo.curricula.complexity import TIERS, annotate, rows
from crystal_grpo.typed import option

Pacing = Literal["linear", "sqrt"]
Difficulty = Literal["steps", "complexity"]
_RECENT = 512  # chunks kept for logging calls right after iteration


@dataclass
class CurriculumSection:
    """The step-count curriculum (``curriculum:`` in a run config; CPR-Curriculum, docs/method.md section 8)."""

    mode: str = option("competence", "A Schedule's mode: competence (the pool grows from the easiest c0 share), "
                       "buckets (complexity tiers open in turn), sorted (the whole data easiest-first).")
    c0: float = option(0.25, "Initial competence: share of the easiest data available at step 0.", gt=0, le=1)
    total_steps: Union[int, None] = option(None, "Pacing horizon T in optimizer steps (default: max_steps).", ge=1)
    difficulty: Difficulty = option("steps", "Order by reference step count or by complexity score.")
    pacing: Pacing = option("linear", "c(t) = c0 + (1 - c0) t/T (linear) or sqrt(c0^2 + (1 - c0^2) t/T).")
    start_chunk: int = option(0, "Global chunk the run starts at (continue a curriculum in a new run).", ge=0)


@dataclass
class _Walk:
    """Position of the pass walk just before chunk ``t``."""

    t: int = 0
    pass_no: int = -1
    pos: int = 0
    perm: np.ndarray | None = None
    deferred: list[int] = field(default_factory=list)


def _default_bucket_order(labels: Sequence[Hashable]) -> list[Hashable]:
    present = list(dict.fromkeys(labels))
    if all(b in TIERS for b in present):
        return [t for t in TIERS if t in present]
    return sorted(present)


class Schedule:
    """A curriculum mode: which examples chunk t may draw from, and its pacing.

    Example i is in the pool of chunk t iff ``key[i] < threshold(t)``; the sampler draws
    chunks from the pool (the pass walk of the module docstring) unless the mode fixes them
    itself (:meth:`fixed_chunk`). A subclass with a ``mode`` name registers itself: adding a
    mode is one class, usable as ``curriculum.mode: <name>``.
    """

    mode: ClassVar[str] = ""
    needs_horizon: ClassVar[bool] = True
    registry: ClassVar[dict[str, type[Schedule]]] = {}
    key: list[int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.mode:
            Schedule.registry[cls.mode] = cls

    def __init__(self, order: list[int], batch_size: int, total_steps: int | None, **options: Any) -> None:
        self.order, self.batch_size, self.total_steps = order, batch_size, total_steps
        self.n = len(order)

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


class CompetenceSchedule(Schedule):
    """Platanios et al. 2019: the easiest ``c(t)`` share of the data, never under one chunk."""

    mode = "competence"

    def __init__(self, order, batch_size, total_steps, *, c0: float = 0.25, pacing: Pacing = "linear",
                 **options: Any) -> None:
        super().__init__(order, batch_size, total_steps)
        if not 0.0 < c0 <= 1.0:
            raise ValueError(f"c0 must be in (0, 1], got {c0}")
        if pacing not in ("linear", "sqrt"):
            raise ValueError(f"pacing {pacing!r} is unknown: allowed values are linear, sqrt")
        self.c0, self.pacing = c0, pacing
        self.key = [0] * self.n
        for r, i in enumerate(order):
            self.key[i] = r

    def competence(self, t: int) -> float:
        x = t / self.total_steps
        if self.pacing == "sqrt":
            return min(1.0, math.sqrt(self.c0 ** 2 + (1.0 - self.c0 ** 2) * x))
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

    def __init__(self, order, batch_size, total_steps, *, buckets: Sequence[Hashable] | None = None,
                 bucket_order: Sequence[Hashable] | None = None, **options: Any) -> None:
        super().__init__(order, batch_size, total_steps)
        if buckets is None or len(buckets) != self.n:
            raise ValueError("mode 'buckets' needs one bucket label per example")
        self.bucket_order = list(bucket_order) if bucket_order is not None else _default_bucket_order(buckets)
        rank = {b: k for k, b in enumerate(self.bucket_order)}
        missing = sorted({str(b) for b in buckets if b not in rank})
        if missing:
            raise ValueError(f"bucket label(s) {', '.join(missing)} not in bucket_order {self.bucket_order}")
        self.key = [rank[b] for b in buckets]
        sizes = np.bincount(self.key, minlength=len(self.bucket_order))
        self._open_size = [0, *np.cumsum(sizes).tolist()]  # items in the first k buckets

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

    def __init__(self, order, batch_size, total_steps, **options: Any) -> None:
        super().__init__(order, batch_size, total_steps)
        self.key = [0] * self.n

    def competence(self, t: int) -> float:
        return 1.0

    def threshold(self, t: int) -> int:
        return 1

    def fixed_chunk(self, t: int) -> list[int]:
        return [self.order[(t * self.batch_size + j) % self.n] for j in range(self.batch_size)]


class CurriculumSampler(Sampler[int]):
    """RepeatSampler's layout with a difficulty curriculum (see the module docstring); the
    mode's :class:`Schedule` decides the pool, this class the layout and the draw."""

    def __init__(
        self,
        difficulty: Sequence[float],
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        *,
        mode: str = "competence",
        c0: float = 0.25,
        total_steps: int | None = None,
        pacing: Pacing = "linear",
        seed: int = 42,
        buckets: Sequence[Hashable] | None = None,
        bucket_order: Sequence[Hashable] | None = None,
        start_chunk: int = 0,
    ) -> None:
        n = len(difficulty)
        if mode not in Schedule.registry:
            raise ValueError(f"mode {mode!r} is unknown: allowed values are {', '.join(Schedule.registry)}")
        if min(mini_repeat_count, batch_size, repeat_count) < 1:
            raise ValueError("mini_repeat_count, batch_size and repeat_count must be >= 1")
        if n < batch_size:
            raise ValueError(f"{n} examples cannot fill one chunk of batch_size={batch_size}")
        if Schedule.registry[mode].needs_horizon and (total_steps is None or total_steps < 1):
            raise ValueError(f"mode {mode!r} needs total_steps >= 1 (pacing horizon T, in chunks)")
        if seed < 0 or start_chunk < 0:
            raise ValueError("seed and start_chunk must be >= 0")
        self.num_samples = n
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.mode = mode
        self.total_steps = total_steps
        self.seed = seed
        self.start_chunk = start_chunk
        self.epoch = 0
        self.order: list[int] = sorted(range(n), key=lambda i: (float(difficulty[i]), i))
        self.schedule = Schedule.registry[mode](self.order, batch_size, total_steps, c0=c0, pacing=pacing,
                                                buckets=buckets, bucket_order=bucket_order)
        self._walk = _Walk()
        self._recent: OrderedDict[int, list[int]] = OrderedDict()

    @property
    def bucket_order(self) -> list[Hashable] | None:
        return getattr(self.schedule, "bucket_order", None)

    # -- layout, as RepeatSampler ----------------------------------------------------
    @property
    def chunks_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def __len__(self) -> int:
        return self.chunks_per_epoch * self.batch_size * self.mini_repeat_count * self.repeat_count

    def set_epoch(self, epoch: int) -> None:
        """Called by Trainer/accelerate before each epoch; selects chunks from
        ``start_chunk + epoch * chunks_per_epoch`` on."""
        self.epoch = int(epoch)

    def first_chunk(self, epoch: int | None = None) -> int:
        """Global index of the first chunk of ``epoch`` (default: the current one)."""
        return self.start_chunk + (self.epoch if epoch is None else epoch) * self.chunks_per_epoch

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        first = self.first_chunk(epoch)
        for t in range(first, first + self.chunks_per_epoch):
            chunk = self.chunk_indices(t)
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index
        self.epoch = epoch + 1

    # -- the pool (the schedule's) ------------------------------------------------------
    def competence(self, t: int) -> float:
        """Scheduled share of the data at chunk t."""
        return self.schedule.competence(t)

    def pool_size(self, t: int) -> int:
        """How many indices chunk t may draw from."""
        return self.schedule.pool_size(t)

    def available(self, t: int) -> list[int]:
        """The pool of chunk t (sorted by index)."""
        thr = self.schedule.threshold(t)
        return [i for i, k in enumerate(self.schedule.key) if k < thr]

    # -- chunks ----------------------------------------------------------------------
    def chunk_indices(self, t: int) -> list[int]:
        """The ``batch_size`` distinct indices of global chunk t (pure in (seed, t))."""
        if t < 0:
            raise ValueError("chunk index must be >= 0")
        fixed = self.schedule.fixed_chunk(t)
        if fixed is not None:
            return fixed
        if t in self._recent:
            return list(self._recent[t])
        if t < self._walk.t:
            self._walk = _Walk()  # replay from the start: the walk is deterministic
        while self._walk.t <= t:
            s = self._walk.t
            self._remember(s, self._draw(self._walk))
        return list(self._recent[t])

    def _remember(self, t: int, chunk: list[int]) -> None:
        self._recent[t] = chunk
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def _permutation(self, pass_no: int) -> np.ndarray:
        return np.random.default_rng([self.seed, pass_no]).permutation(self.num_samples)

    def _draw(self, walk: _Walk) -> list[int]:
        thr, key = self.schedule.threshold(walk.t), self.schedule.key
        chunk = walk.deferred  # earlier pool members stay in the (growing) pool
        taken = set(chunk)
        walk.deferred = []
        while len(chunk) < self.batch_size:
            if walk.perm is None or walk.pos == self.num_samples:
                walk.pass_no += 1
                walk.perm, walk.pos = self._permutation(walk.pass_no), 0
            i = int(walk.perm[walk.pos])
            walk.pos += 1
            if key[i] >= thr:
                continue
            if i in taken:
                walk.deferred.append(i)
            else:
                chunk.append(i)
                taken.add(i)
        walk.t += 1
        return chunk


def curriculum_stats(indices: Sequence[int], step_counts: Sequence[float],
                     tiers: Sequence[str] | None = None) -> dict[str, float]:
    """Mean reference step count and tier shares of the given (e.g. one chunk's) indices."""
    idx = list(indices)
    if not idx:
        out = {"mean_ref_steps": float("nan")}
    else:
        out = {"mean_ref_steps": float(sum(step_counts[i] for i in idx) / len(idx))}
    if tiers is not None:
        for tier in TIERS:
            out[f"frac_{tier}"] = sum(tiers[i] == tier for i in idx) / len(idx) if idx else float("nan")
    return out


class CurriculumSamplerFactory:
    """Builds the sampler inside ``GRPOTrainer._get_train_sampler`` and keeps the
    per-example step counts and tiers for logging (``stats``).

    ``total_steps`` is the pacing horizon in OPTIMIZER steps (default: ``max_steps``);
    it becomes chunks as ceil(total_steps / steps_per_chunk), where one chunk lasts
    ``num_iterations * steps_per_generation / gradient_accumulation_steps`` optimizer
    steps (1 with TRL's defaults). Without a horizon (``max_steps <= 0``) T is one epoch.
    """

    def __init__(self, dataset: Any, *, mode: str = "competence", c0: float = 0.25,
                 total_steps: int | None = None, difficulty: Difficulty = "steps",
                 pacing: Pacing = "linear", start_chunk: int = 0) -> None:
        if difficulty not in ("steps", "complexity"):
            raise ValueError(f"difficulty {difficulty!r} is unknown: allowed values are steps, complexity")
        self.mode, self.c0, self.total_steps = mode, c0, total_steps
        self.difficulty_key, self.pacing, self.start_chunk = difficulty, pacing, start_chunk
        self.sampler: CurriculumSampler | None = None
        self.steps_per_chunk = 1.0
        self._annotate(dataset)

    def _annotate(self, dataset: Any) -> None:
        self.step_counts, self.scores, self.tiers = annotate(rows(dataset))
        self.difficulty = self.step_counts if self.difficulty_key == "steps" else self.scores

    def __call__(self, dataset: Any = None, *, mini_repeat_count: int, batch_size: int = 1,
                 repeat_count: int = 1, seed: int = 42, steps_per_chunk: float = 1.0) -> CurriculumSampler:
        if dataset is not None and len(dataset) != len(self.difficulty):
            self._annotate(dataset)
        n_chunks = len(self.difficulty) // batch_size
        horizon = self.total_steps if self.total_steps and self.total_steps > 0 else None
        t_chunks = max(1, math.ceil(horizon / steps_per_chunk)) if horizon else max(1, n_chunks)
        self.steps_per_chunk = steps_per_chunk
        self.sampler = CurriculumSampler(
            self.difficulty, mini_repeat_count, batch_size, repeat_count, mode=self.mode, c0=self.c0,
            total_steps=t_chunks, pacing=self.pacing, seed=seed,
            buckets=self.tiers, start_chunk=self.start_chunk)
        return self.sampler

    def callback(self) -> Any:
        """A ``TrainerCallback`` that re-selects the sampler's epoch from ``state.epoch``
        at every epoch start. Needed when a multi-process run resumes inside epoch >= 1:
        accelerate's ``skip_first_batches`` wraps the batch sampler so that neither the
        Trainer's nor accelerate's ``set_epoch`` reaches this sampler, which would then
        replay epoch 0. Harmless otherwise (the Trainer sets the same epoch after it)."""
        from transformers import TrainerCallback

        factory = self

        class CurriculumEpochCallback(TrainerCallback):
            def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if factory.sampler is not None:
                    factory.sampler.set_epoch(math.floor(float(state.epoch or 0.0) + 1e-9))

        return CurriculumEpochCallback()

    def chunk_at_step(self, step: int) -> int:
        """Global chunk used by 0-based optimizer step ``step`` of a run started at chunk
        ``start_chunk`` (the trainer's ``state.global_step - 1`` after an update)."""
        return self.start_chunk + int(max(0, step) // self.steps_per_chunk)

    def stats(self, t: int) -> dict[str, float]:
        """Logging record for chunk t: pacing, pool size and what the chunk holds."""
        if self.sampler is None:
            return {}
        s = self.sampler
        out = {"chunk": float(t), "competence": s.competence(t), "pool_size": float(s.pool_size(t))}
        out.update(curriculum_stats(s.chunk_indices(t), self.step_counts, self.tiers))
        return out


def make_sampler_factory(section: CurriculumSection, dataset: Any, max_steps: int | None = None
                         ) -> CurriculumSamplerFactory:
    """Factory for ``CrystalGRPOTrainer(sampler_factory=...)`` from a ``curriculum:`` config
    section; ``total_steps`` defaults to the run's ``max_steps``."""
    return CurriculumSamplerFactory(
        dataset, mode=section.mode, c0=section.c0, total_steps=section.total_steps or max_steps,
        difficulty=section.difficulty, pacing=section.pacing, start_chunk=section.start_chunk)
