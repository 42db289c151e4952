"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): groups whose rewards do not vary.

A flat group (one prompt's completions, all scored alike) teaches nothing yet still trains
under TRL, through the KL term and the loss's normaliser. ``dynamic_sampling:`` (off by
default) takes such groups out: ``mask`` gives them zero weight, ``refill`` replaces them with
informative groups from up to ``max_num_gen_batches - 1`` more generation batches. The modes,
the ``metric`` (reward, objectives, outcome), the normaliser per loss type and the logged
metrics: docs/training.md, "Groups whose rewards do not vary".

How a group leaves the loss: TRL 1.16's ``_compute_loss`` weighs every token by
``completion_mask * tool_mask``; a dropped group's rows get ``tool_mask`` 0 (attention, so the
forward pass, stays as it was: PCGrad's losses share one forward), and a row-mean loss type gets the
``loss_scale`` by which the trainer scales its surrogate and KL term. :class:`DynamicSampler` is all
of it; the trainer calls :meth:`DynamicSampler.batch` for each generation batch of a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from crystal_grpo.rewards.base import OBJECTIVES
from crystal_grpo.train.config.run_config import DynamicSamplingSection
from crystal_grpo.train.trainer.groups import group_flat, weighted_reward
from crystal_grpo.train.trainer.reward_evaluation import Evaluation
from crystal_grpo.train.trainer.step_credit import STEP_FIELD

#: Separates the refill draws from the other random streams seeded by the run's seed.
REFILL_STREAM = 0xD5A
#: How TRL 1.16's ``_compute_loss`` normalises each loss_type (docs/training.md, "Groups whose rewards
#: do not vary", the normaliser).
ROW_MEAN = frozenset({"grpo", "sapo", "dr_grpo", "luspo"})
TOKEN_COUNT = frozenset({"dapo", "cispo", "vespo"})
MICRO_BATCH_TOKEN_MEAN = frozenset({"bnpo"})
#: The batch fields that weigh rows; ``<field>_<objective>`` is an objective's own (metric: objectives).
WEIGHT_FIELDS = ("tool_mask", "num_items_in_batch", "loss_scale")
#: Padding of the fields a refill merges: prompt fields on the left, completion fields on the right
#: (as TRL pads them); None: the tokenizer's pad id.
PROMPT_FIELDS = {"prompt_ids": None, "prompt_mask": 0}
COMPLETION_FIELDS = {
    "completion_ids": None,
    "completion_mask": 0,
    "tool_mask": 1,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    STEP_FIELD: 0.0,
}


# --------------------------------------------------------------------------- pure functions
def kept_groups(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    objectives: Sequence[str | None],
    num_generations: int,
    min_std: float,
    metric: str = "reward",
    outcome: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Which groups of a *global* generation batch carry weight: ``{"": [N / G] bool}`` for the
    batch, plus one entry per objective with ``metric: objectives``, where the batch's is their union.

    ``rewards_per_func`` is TRL's ``[N, F]`` (NaN: not applicable); each part is the weighted sum
    of its columns (:func:`weighted_reward`, as TRL sums them). With
    ``metric: outcome`` the groups are judged on ``outcome`` (``[N]``, the answers' correctness) alone.
    """

    def kept(columns: list[bool]) -> torch.Tensor:
        return ~group_flat(weighted_reward(rewards_per_func, weights, columns), num_generations, min_std)

    if metric == "outcome":
        if outcome is None:
            raise ValueError("dynamic_sampling.metric: 'outcome' needs the batch's outcome (an accuracy component)")
        return {"": ~group_flat(outcome.double(), num_generations, min_std)}
    if metric != "objectives":
        return {"": kept([True] * len(objectives))}
    out = {o: kept([f == o for f in objectives]) for o in OBJECTIVES}
    out[""] = torch.stack(list(out.values())).any(dim=0)
    return out


def refill_draw(seed: int, step: int, round_: int, pool: Sequence[int], n: int) -> list[int]:
    """The ``n`` training rows (prompts) of refill round ``round_`` (>= 1) at optimizer step
    ``step``: pure in its arguments, so a resumed run draws the same. Without replacement
    unless the pool is smaller than ``n``."""
    rng = np.random.default_rng([REFILL_STREAM, seed, step, round_])
    return [int(pool[i]) for i in rng.choice(len(pool), size=n, replace=len(pool) < n)]


def refill_pairs(dropped: torch.Tensor, informative: torch.Tensor, groups_per_process: int) -> list[tuple[int, int]]:
    """(place, new group) pairs, global group indices: on each process its dropped places, in
    order, take its informative new groups, in order (a group stays on the process that made it)."""
    pairs = []
    for lo in range(0, len(dropped), groups_per_process):
        places = (torch.nonzero(dropped[lo : lo + groups_per_process]).flatten() + lo).tolist()
        new = (torch.nonzero(informative[lo : lo + groups_per_process]).flatten() + lo).tolist()
        pairs += zip(places, new)
    return pairs


def _padded(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1]), value)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def merge_rows(
    base: dict[str, Any], new: dict[str, Any], rows: list[int], new_rows: list[int], pad_id: int
) -> dict[str, Any]:
    """``base`` (this process's part of one generation batch, as TRL's
    ``_generate_and_score_completions`` returns it) with its rows ``rows`` replaced by ``new``'s
    rows ``new_rows``; both re-padded to the wider one. Scalars (``num_items_in_batch``) are
    base's: recount them afterwards. Fields it cannot merge (image inputs) are refused."""
    out = {}
    for key, a in base.items():
        b = new.get(key)
        side = PROMPT_FIELDS if key in PROMPT_FIELDS else COMPLETION_FIELDS if key in COMPLETION_FIELDS else None
        if isinstance(a, torch.Tensor) and a.dim() == 0:
            out[key] = a
            continue
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or (side is None and a.dim() != 1):
            raise NotImplementedError(
                f"dynamic_sampling.mode: refill cannot merge the batch field {key!r} (image "
                "inputs are not supported); use mode: mask"
            )
        if side is not None:
            value = pad_id if side[key] is None else side[key]
            width = max(a.shape[1], b.shape[1])
            a, b = (_padded(t, width, value, left=side is PROMPT_FIELDS) for t in (a, b))
        a = a.clone()
        a[rows] = b[new_rows].to(a.dtype)
        out[key] = a
    return out


def loss_scale(inputs: dict[str, Any]) -> float:
    """By how much a micro-batch's row-mean loss scales its surrogate and KL term, so that the masked
    groups leave its normaliser (1.0: none masked, or a loss type normalised otherwise)."""
    scale = inputs.get("loss_scale")
    return 1.0 if scale is None else float(scale)


def objective_inputs(inputs: dict[str, Any], objective: str) -> dict[str, Any]:
    """The batch PCGrad's loss for ``objective`` reads: with ``metric: objectives``, that
    objective's own loss mask, normaliser and scale in place of the batch's."""
    own = {f: inputs[f"{f}_{objective}"] for f in WEIGHT_FIELDS if f"{f}_{objective}" in inputs}
    return {**inputs, **own} if own else inputs


#: What one generation round gives the sampler: the round's batch (this process's rows) and its rewards.
Round = Callable[[list[dict], bool], tuple[dict[str, Any], Evaluation]]


class DynamicSampler:
    """Flat groups of a training step's generation batch, masked or refilled (module docstring).

    ``reward_weights``, ``objectives`` and ``num_generations`` are the trainer's (TRL's columns and
    their objectives); ``pool(step)`` the rows a refill may draw at optimizer step ``step`` (the
    curriculum's pool, or every row of ``dataset``); ``pad_token_id`` pads refilled rows."""

    def __init__(
        self,
        section: DynamicSamplingSection,
        *,
        num_generations: int,
        reward_weights: torch.Tensor,
        objectives: Sequence[str | None],
        loss_type: str,
        accelerator: Any,
        dataset: Any,
        local_batch: int,
        seed: int,
        pool: Callable[[int], Sequence[int]],
        pad_token_id: int | None,
    ) -> None:
        if loss_type not in ROW_MEAN | TOKEN_COUNT | MICRO_BATCH_TOKEN_MEAN:
            raise ValueError(
                f"dynamic_sampling: loss_type {loss_type!r} is not one whose normaliser this "
                "project knows (train/trainer/dynamic_sampling.py); use mode: none"
            )
        if section.mode == "refill":
            if local_batch % num_generations:
                raise ValueError(
                    f"dynamic_sampling.mode: refill keeps each group on the process that generated it, so each "
                    f"process's generation batch (per_device_train_batch_size x steps_per_generation = {local_batch}) "
                    f"must hold whole groups of num_generations={num_generations}; use mode: mask"
                )
            if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
                raise ValueError("dynamic_sampling.mode: refill draws rows by index: give a map-style train_dataset")
            if set(getattr(dataset, "column_names", None) or []) & {"image", "images"}:
                raise ValueError(
                    "dynamic_sampling.mode: refill does not support image inputs (their batch fields "
                    "cannot be merged across generation rounds); use mode: mask"
                )
        self.section, self.num_generations, self.reward_weights = section, num_generations, reward_weights
        self.objectives, self.loss_type, self.accelerator = list(objectives), loss_type, accelerator
        self.dataset, self.seed, self.pool, self.pad_token_id = dataset, seed, pool, pad_token_id

    def batch(self, rows: list[dict], generate: Round, step: int) -> tuple[dict[str, Any], dict[str, float]]:
        """The generation batch of optimizer step ``step`` from this process's ``rows``: the first round,
        refilled (``refill``; the later rounds ``generate(rows, quiet=True)``: they log nothing), then
        weighed; and what the step logs (``dynamic_sampling/*``)."""
        cfg, G = self.section, self.num_generations
        out, scores = self._judged(*generate(rows, False))
        kept = self.kept(scores)
        first = {k: float((~v).double().mean()) for k, v in kept.items()}
        rounds = 1
        if cfg.mode == "refill":
            n, rank = len(rows), self.accelerator.process_index
            while not bool(kept[""].all()) and rounds < cfg.max_num_gen_batches:
                new, new_scores = self._judged(*generate(self.refill_rows(n, rounds, step), True))
                pairs = refill_pairs(~kept[""], self.kept(new_scores)[""], n // G)
                moved = [(g * G + j, h * G + j) for g, h in pairs for j in range(G)]  # global rows
                mine = [(a - rank * n, b - rank * n) for a, b in moved if rank * n <= a < (rank + 1) * n]
                if mine:
                    out = merge_rows(out, new, [a for a, _ in mine], [b for _, b in mine], self.pad_token_id)
                if moved:
                    scores = scores.clone()
                    scores[[a for a, _ in moved]] = new_scores[[b for _, b in moved]]
                    kept = self.kept(scores)
                rounds += 1
        self.weigh(out, kept)
        metrics = {"dynamic_sampling/frac_flat": first[""]}
        metrics.update({f"dynamic_sampling/frac_flat_{o}": first[o] for o in OBJECTIVES if o in first})
        metrics["dynamic_sampling/frac_masked"] = float((~kept[""]).double().mean())
        metrics["dynamic_sampling/extra_rounds"] = float(rounds - 1)
        metrics["dynamic_sampling/effective_batch"] = float(kept[""].sum() * G)
        return out, metrics

    def _judged(self, out: dict[str, Any], evaluation: Evaluation) -> tuple[dict[str, Any], torch.Tensor]:
        """A round's batch and what judges its groups, global: the ``[N, F]`` rewards, with the outcome
        (``[N]``) as one more column under ``metric: outcome``."""
        scores = evaluation.rewards
        if self.section.metric == "outcome":
            scores = torch.cat([scores, evaluation.outcome.to(scores).unsqueeze(1)], dim=1)
        return out, scores

    def kept(self, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.section
        scores, outcome = (scores[:, :-1], scores[:, -1]) if cfg.metric == "outcome" else (scores, None)
        return kept_groups(
            scores, self.reward_weights, self.objectives, self.num_generations, cfg.min_std, cfg.metric, outcome
        )

    def refill_rows(self, n: int, round_: int, step: int) -> list[dict]:
        """This process's ``n`` rows of refill round ``round_``: whole groups of fresh prompts."""
        G, world, rank = self.num_generations, self.accelerator.num_processes, self.accelerator.process_index
        per_process = n // G
        drawn = refill_draw(self.seed, step, round_, self.pool(step), per_process * world)
        rows = []
        for index in drawn[rank * per_process : (rank + 1) * per_process]:
            row = self.dataset[index]
            rows += [dict(row) for _ in range(G)]  # one dict a completion, as the dataloader gives them
        return rows

    def weigh(self, out: dict, kept: dict[str, torch.Tensor]) -> None:
        """Zero weight for the rows of the groups not kept (``tool_mask``, and no step term), the
        normaliser recounted and the row-mean losses' scale (docs/training.md, the normaliser), for the batch
        and, with ``metric: objectives``, for each objective (``<field>_<objective>``)."""
        mask = out["completion_mask"]
        n, rank = mask.shape[0], self.accelerator.process_index
        base = out.get("tool_mask")
        base = torch.ones_like(mask) if base is None else base
        for name, groups in kept.items():
            rows = groups.repeat_interleave(self.num_generations)
            suffix = f"_{name}" if name else ""
            tool = base * rows[rank * n : (rank + 1) * n].to(device=base.device, dtype=base.dtype).unsqueeze(1)
            out[f"tool_mask{suffix}"] = tool
            out[f"num_items_in_batch{suffix}"] = self.accelerator.gather((mask * tool).sum()).sum()
            if self.loss_type in ROW_MEAN:
                scale = len(rows) / max(int(rows.sum()), 1)
                out[f"loss_scale{suffix}"] = torch.tensor(scale, dtype=torch.float32, device=mask.device)
        if out.get(STEP_FIELD) is not None:  # a masked group's step term is zero too (reward.step_credit)
            rows = kept[""].repeat_interleave(self.num_generations)[rank * n : (rank + 1) * n]
            out[STEP_FIELD] = out[STEP_FIELD] * rows.to(out[STEP_FIELD]).unsqueeze(1)
