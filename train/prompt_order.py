"""Which prompts each step trains on: a pure function of (seed, epoch), so a run resumes anywhere.

TRL's ``RepeatSampler`` draws one permutation per iteration from a generator seeded once:
epoch e trains on the (e+1)-th permutation of that generator. transformers 5 no longer
iterates the sampler through the epochs a resumed run skips; it calls the sampler's
``set_epoch``, which RepeatSampler lacks. So a run resumed in epoch e >= 1 trained on epoch
0's order again (measured: a run resumed at the epoch boundary trained step 1's prompts at
step 3, and every later step was an uninterrupted step two earlier). :class:`EpochRepeatSampler`
is RepeatSampler with ``set_epoch``: epoch e is the (e+1)-th permutation of a generator
seeded with ``seed``, exactly the order an uninterrupted TRL run trains on, whatever was
iterated before. The curriculum's sampler (``curricula/sampler.py``) is a pure function of
(seed, chunk) in the same way.

:class:`SamplerEpoch` sets the epoch at every epoch start from the trainer's state.
transformers and accelerate call ``set_epoch`` themselves, except in a multi-process run
resumed mid-epoch: accelerate's ``skip_first_batches`` wraps the batch sampler so that neither
call reaches the sampler, which would then replay epoch 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import TrainerCallback
from trl.trainer.utils import RepeatSampler


class EpochRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` (same arguments, same order) whose epoch is chosen by ``set_epoch``;
    an iteration moves to the next epoch, as RepeatSampler's advancing generator does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.drawn = 0  # permutations drawn from ``self.generator`` since it was seeded
        self.initial_seed = self.generator.initial_seed() if self.shuffle else None

    @classmethod
    def like(cls, sampler: RepeatSampler) -> "EpochRepeatSampler":
        """The sampler TRL built (``GRPOTrainer._get_train_sampler``), with ``set_epoch``."""
        return cls(sampler.data_source, sampler.mini_repeat_count, sampler.batch_size, sampler.repeat_count,
                   sampler.shuffle, sampler.seed)

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
