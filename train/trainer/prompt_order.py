"""Which prompts each step trains on: the curriculum's order or TRL's, a pure function of the
seed and the step either way, so a run resumes anywhere (docs/reliability.md).

:class:`PromptOrder` is what the trainer's ``_get_train_sampler`` returns: the curriculum sampler
(``sampler_factory=``, curricula/sampler.py) when one is configured, else
:class:`EpochRepeatSampler`, TRL's ``RepeatSampler`` with the ``set_epoch`` transformers 5
calls on resume (without it a run resumed in a later epoch replays epoch 0's order).
:class:`SamplerEpoch` sets the epoch at every epoch start from the trainer's state, for the
multi-process resume mid-epoch where accelerate's ``skip_first_batches`` keeps
transformers' own call from reaching the sampler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import TrainerCallback
from trl.trainer.utils import RepeatSampler

from crystal_grpo.curricula.sampler import CurriculumSamplerFactory


class EpochRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` (same arguments, same order) whose epoch is chosen by ``set_epoch``;
    an iteration moves to the next epoch, as RepeatSampler's advancing generator does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.drawn = 0  # permutations drawn from ``self.generator`` since it was seeded
        self.initial_seed = self.generator.initial_seed() if self.shuffle else None

    @classmethod
    def like(cls, sampler: RepeatSampler) -> EpochRepeatSampler:
        """The sampler TRL built (``GRPOTrainer._get_train_sampler``), with ``set_epoch``."""
        return cls(
            sampler.data_source,
            sampler.mini_repeat_count,
            sampler.batch_size,
            sampler.repeat_count,
            sampler.shuffle,
            sampler.seed,
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        if self.shuffle:
            if self.drawn > epoch:  # an earlier epoch than the generator's: start it over
                self.generator.manual_seed(self.initial_seed)
                self.drawn = 0
            for _ in range(epoch - self.drawn):  # the permutations of the epochs before this one
                torch.randperm(self.num_samples, generator=self.generator)
            self.drawn = epoch + 1  # RepeatSampler's own draw, at its first item
        yield from super().__iter__()


class SamplerEpoch(TrainerCallback):
    """At every epoch start, ``set_epoch(floor(state.epoch))`` on the training sampler
    (:meth:`track` it when it is built); a sampler without ``set_epoch`` is left alone."""

    def __init__(self) -> None:
        self.sampler: Any = None

    def track(self, sampler: Any) -> Any:
        self.sampler = sampler
        return sampler

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(math.floor(float(state.epoch or 0.0) + 1e-9))


class PromptOrder:
    """What the trainer's ``_get_train_sampler`` returns: the curriculum (``sampler_factory=``, a
    ``CurriculumSamplerFactory`` or any callable with its arguments) or TRL's order, with the epoch a
    resumed run is in (:attr:`epoch`, a callback the trainer adds); and what a curriculum says of a
    step (its pool, which dynamic sampling's refill draws from, and its record, which the log shows)."""

    def __init__(self, factory: Callable | None) -> None:
        self.factory = factory
        self.epoch = SamplerEpoch()
        #: The factory when it is a curriculum that keeps a pool and a record (None otherwise).
        self.curriculum = factory if isinstance(factory, CurriculumSamplerFactory) else None

    def resumable(self, trl_sampler: RepeatSampler) -> EpochRepeatSampler:
        """TRL's training sampler, made resumable mid-epoch."""
        return self.epoch.track(EpochRepeatSampler.like(trl_sampler))

    def curriculum_sampler(self, dataset: Any, args: Any, num_generations: int) -> Any:
        """The curriculum's sampler over ``dataset`` with TRL's batch layout (``args``: the GRPOConfig)."""
        repeat = args.num_iterations * args.steps_per_generation
        return self.epoch.track(
            self.factory(
                dataset,
                mini_repeat_count=num_generations,
                batch_size=args.generation_batch_size // num_generations,
                repeat_count=repeat,
                seed=args.seed,
                steps_per_chunk=repeat / args.gradient_accumulation_steps,
            )
        )

    def pool(self, step: int, size: int) -> Sequence[int]:
        """The rows a refill may draw at optimizer step ``step``: the curriculum's pool then, or all ``size``."""
        if self.curriculum is None or self.curriculum.sampler is None:
            return range(size)
        return self.curriculum.sampler.available(self.curriculum.chunk_at_step(step))

    def logs(self, step: int) -> dict[str, float]:
        """``curriculum/*``: the curriculum's record of the chunk optimizer step ``step`` trained on (pacing,
        pool, what it held); empty without a curriculum."""
        if self.curriculum is None:
            return {}
        chunk = self.curriculum.chunk_at_step(step)
        return {f"curriculum/{k}": v for k, v in self.curriculum.stats(chunk).items()}
