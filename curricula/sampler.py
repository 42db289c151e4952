"""A drop-in for TRL's ``RepeatSampler`` that picks WHICH prompts by difficulty
(CPR-Curriculum, docs/method.md section 8: simplest reference chains first, harder ones later).

The layout is RepeatSampler's (a chunk is one generation batch of distinct indices, each
repeated for its group), so the Trainer's epoch and step arithmetic is unchanged. A chunk is a
pure function of (seed, global chunk index): every rank yields the same order and a resumed
run continues the identical sequence. The modes are the :class:`Schedule` subclasses of
curricula/schedule.py. The layout and how a pool is walked in passes: docs/training.md,
"CPR-Curriculum: the modes and the sampler".
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from crystal_grpo.curricula.complexity import TIERS, annotate, rows
from crystal_grpo.curricula.schedule import CurriculumSection, Difficulty, Schedule, resolve, schedule_class

_RECENT = 512  # chunks kept for logging calls right after iteration


@dataclass
class _Walk:
    """Position of the pass walk just before chunk ``t``."""

    t: int = 0
    pass_no: int = -1
    pos: int = 0
    perm: np.ndarray | None = None
    deferred: list[int] = field(default_factory=list)


class CurriculumSampler(Sampler[int]):
    """RepeatSampler's layout with a difficulty curriculum (docs/training.md, "CPR-Curriculum: the
    modes and the sampler"); the mode's :class:`Schedule` decides the pool, this class the layout
    and the draw."""

    def __init__(
        self,
        difficulty: Sequence[float],
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        *,
        mode: str | type[Schedule] = "competence",
        total_steps: int | None = None,
        seed: int = 42,
        buckets: Sequence[Hashable] | None = None,
        start_chunk: int = 0,
        options: Any = None,
        **mode_options: Any,
    ) -> None:
        """``mode``: a registered mode, a Schedule subclass or its import path; its options as the
        typed ``options`` (``CurriculumSection.config``) or as keyword arguments (``c0=0.3``)."""
        n = len(difficulty)
        schedule = schedule_class(mode)
        if options is None:
            options = schedule.make_options(mode_options)
        if min(mini_repeat_count, batch_size, repeat_count) < 1:
            raise ValueError("mini_repeat_count, batch_size and repeat_count must be >= 1")
        if n < batch_size:
            raise ValueError(f"{n} examples cannot fill one chunk of batch_size={batch_size}")
        if schedule.needs_horizon and (total_steps is None or total_steps < 1):
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
        self.schedule = schedule(self.order, batch_size, total_steps, options=options, buckets=buckets)
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


def curriculum_stats(
    indices: Sequence[int], step_counts: Sequence[float], tiers: Sequence[str] | None = None
) -> dict[str, float]:
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

    def __init__(
        self,
        dataset: Any,
        *,
        mode: str | type[Schedule] = "competence",
        total_steps: int | None = None,
        difficulty: Difficulty = "steps",
        start_chunk: int = 0,
        options: Any = None,
        **mode_options: Any,
    ) -> None:
        if difficulty not in ("steps", "complexity"):
            raise ValueError(f"difficulty {difficulty!r} is unknown: allowed values are steps, complexity")
        self.mode, self.total_steps = schedule_class(mode), total_steps
        self.options = options if options is not None else self.mode.make_options(mode_options)
        self.difficulty_key, self.start_chunk = difficulty, start_chunk
        self.sampler: CurriculumSampler | None = None
        self.steps_per_chunk = 1.0
        self._annotate(dataset)

    def _annotate(self, dataset: Any) -> None:
        self.step_counts, self.scores, self.tiers = annotate(rows(dataset))
        self.difficulty = self.step_counts if self.difficulty_key == "steps" else self.scores

    def __call__(
        self,
        dataset: Any = None,
        *,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        seed: int = 42,
        steps_per_chunk: float = 1.0,
    ) -> CurriculumSampler:
        if dataset is not None and len(dataset) != len(self.difficulty):
            self._annotate(dataset)
        n_chunks = len(self.difficulty) // batch_size
        horizon = self.total_steps if self.total_steps and self.total_steps > 0 else None
        t_chunks = max(1, math.ceil(horizon / steps_per_chunk)) if horizon else max(1, n_chunks)
        self.steps_per_chunk = steps_per_chunk
        self.sampler = CurriculumSampler(
            self.difficulty,
            mini_repeat_count,
            batch_size,
            repeat_count,
            mode=self.mode,
            total_steps=t_chunks,
            seed=seed,
            buckets=self.tiers,
            start_chunk=self.start_chunk,
            options=self.options,
        )
        return self.sampler

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


def make_sampler_factory(
    section: CurriculumSection, dataset: Any, max_steps: int | None = None
) -> CurriculumSamplerFactory:
    """Factory for ``CrystalGRPOTrainer(sampler_factory=...)`` from a ``curriculum:`` config
    section (resolved here unless the config's validation did); ``total_steps`` defaults to the
    run's ``max_steps``."""
    if section.schedule is None:
        resolve(section)
    return CurriculumSamplerFactory(
        dataset,
        mode=section.schedule,
        total_steps=section.total_steps or max_steps,
        difficulty=section.difficulty,
        start_chunk=section.start_chunk,
        options=section.config,
    )
