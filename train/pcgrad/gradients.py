"""PCGrad's gradient plumbing: the per-objective gradient sums of an accumulation window,
kept in the model's own gradient storage plus the fewest fp32 rows, projected in place.

The storage is what the optimizer reads: ``.grad`` (one process, DDP), made here the views of one
flat tensor per dtype, or DeepSpeed ZeRO-3's flat gradient partition. Each backward pass adds
into it; the sum about to receive a gradient is swapped into the storage in place, or, where the
storage cannot hold a sum exactly (bf16 over several micro-steps), each gradient moves out into
its fp32 row, as :func:`crystal_grpo.train.pcgrad.memory.pcgrad_plan` says. At the optimizer
step the sums are averaged across DDP ranks (ZeRO-3 sums only the dot products across its
ranks), projected (docs/method.md section 9) and combined in place into the storage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from crystal_grpo.train.pcgrad.math import pcgrad_coefficients, pcgrad_stats
from crystal_grpo.train.pcgrad.memory import ACCURACY, CHUNK_ELEMENTS, REASONING, REST, PCGradPlan, pcgrad_plan

#: A gradient-sized vector: one flat tensor per (dtype, device) group of trainable parameters.
Vector = list[torch.Tensor]


def is_deepspeed_engine(model: Any) -> bool:
    try:
        from deepspeed import DeepSpeedEngine
    except Exception:  # noqa: BLE001 - deepspeed optional
        return False
    return isinstance(model, DeepSpeedEngine)


# --------------------------------------------------------------------------- vector ops
def _chunks(n: int) -> Iterable[slice]:
    return (slice(i, min(i + CHUNK_ELEMENTS, n)) for i in range(0, n, CHUNK_ELEMENTS))


def vector_dot(x: Vector, y: Vector) -> torch.Tensor:
    """Float64 dot product; tensors of another dtype than fp32 are converted chunk by chunk."""
    total = torch.zeros((), dtype=torch.float64, device=x[0].device if x else "cpu")
    for a, b in zip(x, y):
        if a.dtype == b.dtype == torch.float32:
            total += torch.dot(a, b).double()
        else:
            for s in _chunks(a.numel()):
                total += torch.dot(a[s].float(), b[s].float()).double()
    return total


def _swap(x: Vector, y: Vector) -> None:
    """Exchange the contents in place: of equal dtypes by three XORs of their bits (no
    temporary), else through a chunk."""
    for a, b in zip(x, y):
        if a.dtype == b.dtype and a.element_size() == 4:
            ia, ib = a.view(torch.int32), b.view(torch.int32)
            ia.bitwise_xor_(ib)
            ib.bitwise_xor_(ia)
            ia.bitwise_xor_(ib)
            continue
        for s in _chunks(a.numel()):
            held = a[s].clone()
            a[s].copy_(b[s])
            b[s].copy_(held)
            del held  # before the next chunk's: one chunk at a time


# --------------------------------------------------------------------------- the window
class AccumulationWindow:
    """The gradient sums of one accumulation window, from its first backward pass to the step.

    ``storage``: the model's gradient storage (zeroed here). ``mean_over_ranks`` averages a
    vector in place across data-parallel ranks (DDP); ``sum_over_ranks`` sums a tensor of
    partial dot products (ZeRO-3, where each rank holds a slice of every vector).
    """

    def __init__(
        self,
        storage: Vector,
        plan: PCGradPlan,
        mean_over_ranks: Callable[[torch.Tensor], None] | None = None,
        sum_over_ranks: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.storage, self.plan = storage, plan
        self.rows: dict[str, Vector] = {}
        self.resident: str | None = None  # the sum the storage holds
        self.rows_allocated = 0
        self._mean, self._sum = mean_over_ranks, sum_over_ranks
        for t in storage:
            t.zero_()

    def _new_row(self) -> Vector:
        self.rows_allocated += 1
        return [torch.zeros(t.numel(), dtype=torch.float32, device=t.device) for t in self.storage]

    def order(self, names: Iterable[str]) -> list[str]:
        """The backward order of one micro-step: the storage's sum first (one swap fewer), the
        late rest left out (it runs inside :meth:`project`)."""
        names = [n for n in names if not (n == REST and self.plan.late_rest)]
        return sorted(names, key=lambda n: n != self.resident)

    def accumulate(self, name: str, backward: Callable[[], None]) -> None:
        """Run one backward pass whose gradient belongs to the sum ``name``."""
        if name not in self.plan.accumulated:
            raise ValueError(f"pcgrad: no sum {name!r} in this window ({self.plan.accumulated})")
        if not self.plan.storage_holds_one:
            backward()
            if name not in self.rows:
                self.rows[name] = self._new_row()
            for r, s in zip(self.rows[name], self.storage):
                r.add_(s)
                s.zero_()
            return
        if self.resident is None:
            self.resident = name
        elif self.resident != name:
            row = self.rows.pop(name) if name in self.rows else self._new_row()
            _swap(self.storage, row)  # the storage now holds `name`'s sum, the row the other one
            self.rows[self.resident] = row
            self.resident = name
        backward()

    def sums(self) -> dict[str, Vector]:
        held = {self.resident: self.storage} if self.resident is not None else {}
        return {**self.rows, **held}

    def project(self, late_backward: Callable[[], None] | None = None) -> dict[str, float]:
        """Average (DDP), project and write the update into the storage; returns the logged
        statistics. ``late_backward``: the rest's backward pass of a late-rest plan."""
        if self.plan.late_rest != (late_backward is not None):
            raise RuntimeError(
                "pcgrad: the rest term's backward pass belongs after the projection exactly when "
                "the window has one micro-step"
            )
        sums = self.sums()
        if set(sums) != set(self.plan.accumulated):
            raise RuntimeError(f"pcgrad: sums {sorted(sums)} at the optimizer step, expected {self.plan.accumulated}")
        if self._mean is not None:
            for vec in sums.values():
                for t in vec:
                    self._mean(t)
        g_acc, g_reason = sums[ACCURACY], sums[REASONING]
        partial = torch.stack([vector_dot(g_acc, g_reason), vector_dot(g_acc, g_acc), vector_dot(g_reason, g_reason)])
        if self._sum is not None:
            self._sum(partial)
        dot, sq_acc, sq_reason = partial.tolist()
        a, b = pcgrad_coefficients(dot, sq_acc, sq_reason)
        coef = {ACCURACY: a, REASONING: b, REST: 1.0}
        # Combine in the storage when it holds a sum in fp32 and nothing comes after; otherwise in a row.
        in_storage = (
            self.resident is not None and late_backward is None and all(t.dtype == torch.float32 for t in self.storage)
        )
        target = self.resident if in_storage else next(iter(self.rows))
        out = sums[target]
        if coef[target] != 1.0:
            for t in out:
                t.mul_(coef[target])
        for name, vec in sums.items():
            if name != target:
                for t, v in zip(out, vec):
                    t.add_(v, alpha=coef[name])
        if not in_storage:
            for s in self.storage:
                s.zero_()
            if late_backward is not None:
                late_backward()  # the rest's gradient, alone in the storage
                if self._mean is not None:
                    for s in self.storage:
                        self._mean(s)
            for s, t in zip(self.storage, out):
                s.add_(t)
        self.rows.clear()
        return pcgrad_stats(dot, sq_acc, sq_reason)


# --------------------------------------------------------------------------- the model's storage
def model_gradient_storage(model: Any) -> Vector:
    """The gradient storage the optimizer reads, as flat tensors (module docstring)."""
    if is_deepspeed_engine(model):
        flat = getattr(model.optimizer, "grad_partitions_flat_buffer", None)
        if flat is None:
            raise NotImplementedError(
                "pcgrad under DeepSpeed needs ZeRO-3's grad_partitions_flat_buffer "
                "(DeepSpeed 0.17-0.19); this DeepSpeed optimizer has none"
            )
        return [flat]
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise RuntimeError("pcgrad: parameters already hold gradients before the PCGrad backward")
    groups: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for p in params:
        groups[(p.dtype, p.device)].append(p)
    storage = []
    for (dtype, device), group in groups.items():
        flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
        off = 0
        for p in group:  # autograd adds each backward pass's gradient into these views in place
            p.grad = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
        storage.append(flat)
    return storage


def open_window(model: Any, gradient_accumulation_steps: int, rest: bool) -> AccumulationWindow:
    """The window of the accumulation about to start, for this topology."""
    import torch.distributed as dist

    storage = model_gradient_storage(model)
    plan = pcgrad_plan(
        gradient_accumulation_steps, rest, fp32_gradients=all(t.dtype == torch.float32 for t in storage)
    )
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return AccumulationWindow(storage, plan)
    if is_deepspeed_engine(model):
        return AccumulationWindow(storage, plan, sum_over_ranks=dist.all_reduce)

    def mean(t: torch.Tensor) -> None:  # what DDP does with gradients
        dist.all_reduce(t)
        t.div_(world)

    return AccumulationWindow(storage, plan, mean_over_ranks=mean)


# --------------------------------------------------------------------------- ZeRO-3 backward passes
#: Per-module counters ZeRO-3's backward hooks consume: ``applied_pre_backward_ref_cnt``
#: (re-gather the module's parameters before its backward) and ``ds_grads_remaining``
#: (release them after). One forward sets them for ONE backward; a second backward
#: through the retained graph would find them at 0 and run on released (empty)
#: parameters. Restoring the post-forward values lets each backward gather again.
ZERO3_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")


def zero3_backward_counters(engine: Any) -> list[tuple[torch.nn.Module, str, int]]:
    return [(m, k, m.__dict__[k]) for m in engine.module.modules() for k in ZERO3_COUNTERS if k in m.__dict__]


def restore_counters(counters: list[tuple[torch.nn.Module, str, int]]) -> None:
    for m, k, v in counters:
        m.__dict__[k] = v
