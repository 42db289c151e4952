"""How much memory PCGrad adds: answers for a config, without torch (where it cannot run:
train/config/refusals.py).

At the optimizer step PCGrad needs the accuracy and the reasoning gradient summed over the
accumulation window and kept apart, plus the unprojected rest (KL penalty, entropy bonus, aux
loss) when there is one. The model's own gradient storage holds one of these sums; every other
is an fp32 row the size of this rank's trainable partition: 1 to 3 rows, by the micro-steps,
the rest term and the storage's dtype (:func:`pcgrad_plan`). The table and why it is the least
an exact result allows: docs/training.md, "PCGrad memory". train/pcgrad/gradients.py follows
:func:`pcgrad_plan`, so the code and these answers cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCURACY, REASONING, REST = "accuracy", "reasoning", "rest"
#: Elements per chunk where PCGrad converts between a bf16 storage and an fp32 row: 64 MiB in fp32.
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class PCGradPlan:
    """Which gradient sums PCGrad keeps apart through an accumulation window, and where."""

    accumulated: tuple[str, ...]  #: the sums kept apart up to the projection
    late_rest: bool  #: the rest's backward runs after the projection, onto the update
    storage_holds_one: bool  #: the model's own gradient storage holds one of the sums

    @property
    def extra_partitions(self) -> int:
        """fp32 rows of this rank's trainable partition that PCGrad allocates."""
        return len(self.accumulated) - int(self.storage_holds_one)


def pcgrad_plan(gradient_accumulation_steps: int, rest: bool, fp32_gradients: bool = True) -> PCGradPlan:
    """The plan of one accumulation window (why: docs/training.md, "PCGrad memory")."""
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps!r}: expected >= 1")
    single = gradient_accumulation_steps == 1
    accumulated = (ACCURACY, REASONING) + ((REST,) if rest and not single else ())
    return PCGradPlan(accumulated, late_rest=rest and single, storage_holds_one=fp32_gradients or single)


def pcgrad_extra_partitions(
    gradient_accumulation_steps: int,
    beta: float,
    entropy_bonus: bool = False,
    aux_loss: bool = False,
    fp32_gradients: bool = True,
) -> int:
    """fp32 partitions (4 bytes x this rank's trainable parameters) PCGrad adds at its peak.

    ``entropy_bonus``: TRL's ``entropy_coef != 0`` or ``use_adaptive_entropy``; ``aux_loss``: a
    router aux loss (MoE models). ``fp32_gradients``: the model's own gradient storage is fp32
    (float32 weights, also with ``bf16: true`` autocast; DeepSpeed with ``data_types.grad_accum_dtype:
    fp32``); false for bfloat16 weights without DeepSpeed and for DeepSpeed bf16's default bf16
    gradient buffer. The peak adds nothing else (one chunk of :data:`CHUNK_ELEMENTS` x 4 bytes with
    bf16 gradients and one micro-step).
    """
    rest = beta != 0 or entropy_bonus or aux_loss
    return pcgrad_plan(gradient_accumulation_steps, rest, fp32_gradients).extra_partitions
