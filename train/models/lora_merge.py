"""Generation through merged LoRA adapters, without changing what training sees.

Unmerged, every adapted layer runs two extra adapter matmuls per generated token; merged
(W + s BA, PEFT's ``merge_adapter``) generation costs what the base model costs
(docs/benchmarks.md has the figures). PEFT's unmerge subtracts the delta again, which is not
exact in floating point, so here each adapted base weight is merged into a *copy* and the
parameter gets its original tensor back: the gradients and the saved adapter are bit for bit
what they are without merging. Under ZeRO-3 a gathered parameter's full tensor is a temporary
buffer, so it is merged in place. Only the sampling differs: merged logits round differently,
and LoRA dropout on the adapter branch is gone (as in TRL's vLLM path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _base_params(model) -> list[torch.nn.Parameter]:
    """The parameters a merge writes to: those of every adapted layer's base layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [
        p
        for m in model.modules()
        if isinstance(m, BaseTunerLayer)
        for p in m.get_base_layer().parameters(recurse=False)
    ]


def _zero3_status(p: torch.nn.Parameter) -> str | None:
    """None for an ordinary parameter; else DeepSpeed's status: 'gathered', 'persistent' or 'sharded'."""
    if not hasattr(p, "ds_id"):
        return None
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if getattr(p, "ds_persist", False):
        return "persistent"
    return "gathered" if p.ds_status == ZeroParamStatus.AVAILABLE else "sharded"


@contextlib.contextmanager
def merged_adapters(model, enabled: bool = True) -> Iterator[bool]:
    """Within: ``model`` (a PeftModel) runs with its active LoRA adapters merged into the base
    weights; on exit the original base tensors are back and the adapters unmerged. Yields
    whether it merged: not for a model without adapters, when ``enabled`` is false, when
    adapters are already merged, or under ZeRO-3 when the weights are not gathered
    (``ds3_gather_for_generation: false``)."""
    if not enabled or not _is_peft(model):
        yield False
        return
    params = _base_params(model)
    status = [_zero3_status(p) for p in params]
    if not params or "sharded" in status or any(getattr(m, "merged", False) for m in model.modules()):
        yield False
        return
    originals = []
    with torch.no_grad():
        for p, s in zip(params, status):
            if s != "gathered":  # gathered ZeRO-3 buffers are thrown away anyway
                originals.append((p, p.data))
                p.data = p.data.clone()
        try:
            model.merge_adapter()
            yield True
        finally:
            model.unmerge_adapter()  # PEFT's bookkeeping; the arithmetic is undone below
            for p, data in originals:
                p.data = data


@contextlib.contextmanager
def merged_generate(model, enabled: bool = True) -> Iterator[None]:
    """Within: every ``model.generate(...)`` (and continuous batching's ``generate_batch``)
    call runs under :func:`merged_adapters`.

    For generation that happens inside someone else's context (TRL gathers ZeRO-3 weights
    and removes DeepSpeed's hooks around its ``generate`` call): the merge must happen
    there, between the gather and the call, not around it.
    """
    names = [n for n in ("generate", "generate_batch") if n not in vars(model)]
    if not enabled or not _is_peft(model) or len(names) < 2:
        yield
        return
    for name in names:
        setattr(model, name, _merging(model, getattr(model, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(model, name)


def _merging(model, method):
    def merged(*args, **kwargs):
        with merged_adapters(model):
            return method(*args, **kwargs)

    return merged
