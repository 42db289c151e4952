"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): groups whose rewards do not vary.

A flat group (one prompt's completions, all scored alike) teaches nothing yet still trains
under TRL, through the KL term and the loss's normaliser. ``dynamic_sampling:`` (off by
default) takes such groups out: ``mask`` gives them zero weight, ``refill`` replaces them with
informative groups from up to ``max_num_gen_batches - 1`` more generation batches. The modes,
the ``metric`` (reward, objectives, outcome), the normaliser per loss type and the logged
metrics: docs/training.md, "Groups whose rewards do not vary".

How a group leaves the loss: TRL 1.16's ``_compute_loss`` weighs every token by
``completion_mask * tool_mask``; a dropped group's rows get ``tool_mask`` 0 (attention, so the
forward pass, stays as it was: PCGrad's losses share one forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from crystal_grpo.rewards.base import OBJECTIVES
from crystal_grpo.train.config.refusals import dynamic_sampling_refused
from crystal_grpo.train.config.run_config import DynamicSamplingSection
from crystal_grpo.train.trainer.groups import group_flat, weighted_reward
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
    of its columns (train/trainer/groups.py's ``weighted_reward``, as TRL sums them). With
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


def objective_inputs(inputs: dict[str, Any], objective: str) -> dict[str, Any]:
    """The batch PCGrad's loss for ``objective`` reads: with ``metric: objectives``, that
    objective's own loss mask, normaliser and scale in place of the batch's."""
    own = {f: inputs[f"{f}_{objective}"] for f in WEIGHT_FIELDS if f"{f}_{objective}" in inputs}
    return {**inputs, **own} if own else inputs


class _Discard:
    """Takes what TRL logs into ``_metrics`` / ``_logs`` (any key, nested) and keeps nothing."""

    def __getitem__(self, key: Any) -> _Discard:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


@contextlib.contextmanager
def _instance_patch(obj: Any, name: str, fn: Callable) -> Any:
    """``obj.name`` is ``fn`` inside (an instance attribute over the class's method)."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, fn)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


# --------------------------------------------------------------------------- trainer hooks
class DynamicSamplingMixin:
    """The hooks of ``dynamic_sampling`` for ``GRPOTrainer`` (module docstring). Between TRL and
    the batch: the generation of a step (``_prepare_inputs``, every round through the trainer's
    own ``_generate_and_score_completions``, PCGrad's split included) and the loss's scale
    (``_compute_loss``)."""

    dynamic_sampling: DynamicSamplingSection | None = None

    def setup_dynamic_sampling(self, section: DynamicSamplingSection | None) -> None:
        """Check ``section`` against the trainer (after TRL's ``__init__``) and switch it on."""
        if section is None or section.mode == "none":
            self.dynamic_sampling = None
            return
        refused = dynamic_sampling_refused(
            section,
            pcgrad=bool(getattr(self, "pcgrad", False)),
            scale_rewards=self.scale_rewards,
            aggregation=self.multi_objective_aggregation,
            outcome=self.reward_outcome,
            step_credit=bool(getattr(self, "step_credit_weight", 0.0)),
        )
        if refused:
            raise ValueError(f"{refused[0]}: {refused[1]}")
        if self.loss_type not in ROW_MEAN | TOKEN_COUNT | MICRO_BATCH_TOKEN_MEAN:
            raise ValueError(
                f"dynamic_sampling: loss_type {self.loss_type!r} is not one whose normaliser this "
                "project knows (train/trainer/dynamic_sampling.py); use mode: none"
            )
        if section.mode == "refill":
            local = self.args.per_device_train_batch_size * self.args.steps_per_generation
            if local % self.num_generations:
                raise ValueError(
                    f"dynamic_sampling.mode: refill keeps each group on the process that generated it, so each "
                    f"process's generation batch (per_device_train_batch_size x steps_per_generation = {local}) "
                    f"must hold whole groups of num_generations={self.num_generations}; use mode: mask"
                )
            columns = set(getattr(self.train_dataset, "column_names", None) or [])
            if not hasattr(self.train_dataset, "__getitem__") or not hasattr(self.train_dataset, "__len__"):
                raise ValueError("dynamic_sampling.mode: refill draws rows by index: give a map-style train_dataset")
            if columns & {"image", "images"}:
                raise ValueError(
                    "dynamic_sampling.mode: refill does not support image inputs (their batch fields "
                    "cannot be merged across generation rounds); use mode: mask"
                )
        self.dynamic_sampling = section

    # -- the generation batch -------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        if self.dynamic_sampling is None or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate = self._generate_and_score_completions  # the whole chain (PCGrad's split too)
        with _instance_patch(self, "_generate_and_score_completions", lambda batch: self._sampled(batch, generate)):
            return super()._prepare_inputs(generation_batch)

    def _scored(self, batch: list[dict], generate: Callable, quiet: bool) -> tuple[dict, torch.Tensor]:
        """One generation round: TRL's output and what judges its groups, global: the ``[N, F]``
        rewards, with the outcome (``[N]``) as one more column under ``metric: outcome``. ``quiet``:
        the round's metrics and completions are not logged (TRL's describe the first round only)."""
        seen = {}
        calculate = self._calculate_rewards

        def record(*args: Any, **kwargs: Any) -> torch.Tensor:
            seen["rewards"] = calculate(*args, **kwargs)
            return seen["rewards"]

        logs = self._metrics, self._logs
        if quiet:
            self._metrics = self._logs = _Discard()
        try:
            with _instance_patch(self, "_calculate_rewards", record):
                out = generate(batch)
        finally:
            self._metrics, self._logs = logs
        scores = seen["rewards"]
        if self.dynamic_sampling.metric == "outcome":
            scores = torch.cat([scores, self.last_outcome.to(scores).unsqueeze(1)], dim=1)
        return out, scores

    def _kept(self, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.dynamic_sampling
        if cfg.metric == "outcome":
            scores, outcome = scores[:, :-1], scores[:, -1]
        else:
            outcome = None
        return kept_groups(
            scores, self.reward_weights, self.reward_objectives, self.num_generations, cfg.min_std, cfg.metric, outcome
        )

    def _sampled(self, batch: list[dict], generate: Callable) -> dict:
        """The step's generation batch: the first round, refilled (``refill``), then weighed."""
        cfg, G = self.dynamic_sampling, self.num_generations
        out, scores = self._scored(batch, generate, quiet=False)
        kept = self._kept(scores)
        first = {k: float((~v).double().mean()) for k, v in kept.items()}
        rounds = 1
        if cfg.mode == "refill":
            n, rank = len(batch), self.accelerator.process_index
            while not bool(kept[""].all()) and rounds < cfg.max_num_gen_batches:
                new, new_scores = self._scored(self._refill_rows(n, rounds), generate, quiet=True)
                pairs = refill_pairs(~kept[""], self._kept(new_scores)[""], n // G)
                rows = [(g * G + j, h * G + j) for g, h in pairs for j in range(G)]  # global rows
                mine = [(a - rank * n, b - rank * n) for a, b in rows if rank * n <= a < (rank + 1) * n]
                if mine:
                    out = merge_rows(
                        out, new, [a for a, _ in mine], [b for _, b in mine], self._tokenizer.pad_token_id
                    )
                if rows:
                    scores = scores.clone()
                    scores[[a for a, _ in rows]] = new_scores[[b for _, b in rows]]
                    kept = self._kept(scores)
                rounds += 1
        self._weigh(out, kept)
        m = self._metrics["train"]
        m["dynamic_sampling/frac_flat"].append(first[""])
        for objective in OBJECTIVES:
            if objective in first:
                m[f"dynamic_sampling/frac_flat_{objective}"].append(first[objective])
        m["dynamic_sampling/frac_masked"].append(float((~kept[""]).double().mean()))
        m["dynamic_sampling/extra_rounds"].append(float(rounds - 1))
        m["dynamic_sampling/effective_batch"].append(float(kept[""].sum() * G))
        return out

    def _refill_rows(self, n: int, round_: int) -> list[dict]:
        """This process's ``n`` rows of refill round ``round_``: whole groups of fresh prompts."""
        G, world, rank = self.num_generations, self.accelerator.num_processes, self.accelerator.process_index
        per_process = n // G
        step = self.state.global_step
        drawn = refill_draw(self.args.seed, step, round_, self._refill_pool(step), per_process * world)
        rows = []
        for index in drawn[rank * per_process : (rank + 1) * per_process]:
            row = self.train_dataset[index]
            rows += [dict(row) for _ in range(G)]  # one dict a completion, as the dataloader gives them
        return rows

    def _refill_pool(self, step: int) -> Sequence[int]:
        """The rows a refill may draw: the curriculum's pool at ``step`` when there is one, else all."""
        factory = getattr(self, "sampler_factory", None)
        sampler = getattr(factory, "sampler", None)
        if sampler is not None and hasattr(sampler, "available") and hasattr(factory, "chunk_at_step"):
            return sampler.available(factory.chunk_at_step(step))
        return range(len(self.train_dataset))

    def _weigh(self, out: dict, kept: dict[str, torch.Tensor]) -> None:
        """Zero weight for the rows of the groups not kept (``tool_mask``, and no step term), the
        normaliser recounted and the row-mean losses' scale (docs/training.md, the normaliser), for the batch and, with
        ``metric: objectives``, for each objective (``<field>_<objective>``)."""
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

    # -- the loss -----------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        """TRL's loss; with a ``loss_scale`` (row-mean loss types, groups masked) the surrogate
        and the KL term are scaled by it: the advantages and ``beta`` enter both linearly."""
        scale = inputs.get("loss_scale")
        if scale is None or float(scale) == 1.0:
            return super()._compute_loss(model, inputs)
        s, beta = float(scale), self.beta
        self.beta = beta * s
        try:
            return super()._compute_loss(model, {**inputs, "advantages": inputs["advantages"] * s})
        finally:
            self.beta = beta
