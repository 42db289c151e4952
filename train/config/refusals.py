"""Every combination of settings this project refuses, one rule a function: ``(key, why)`` when it is
refused, else None. The config's check (``--check``, train/config/run_config.py) and a trainer built by
hand (train/trainer/grpo_trainer.py, train/pcgrad/trainer.py) call the same rule, so the two cannot
drift apart. No torch, no TRL: plain values in, one line out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crystal_grpo.train.config.run_config import DynamicSamplingSection

#: A refusal: the config key and why, or None (nothing refused).
Refusal = tuple[str, str] | None


def refuse(*found: Refusal | bool) -> None:
    """Raise the first refusal of ``found`` as ``ValueError("key: why")`` (a trainer built by hand)."""
    for refusal in found:
        if refusal:
            raise ValueError(f"{refusal[0]}: {refusal[1]}")


def remove_unused_columns_refused(value: object) -> Refusal:
    """TRL's ``remove_unused_columns`` would hide the rows' columns from a GRPO reward."""
    if not value:
        return None
    return (
        "training.remove_unused_columns",
        "true would drop the columns the reward reads (answer, reference_steps), judging every completion "
        "wrong; GRPO keeps them (false)",
    )


#: TRL loss types whose gradient is each token's advantage times its log-probability's gradient with the
#: importance ratio detached, so that a sequence-level ratio still leaves each token its own advantage.
DETACHED_RATIO = frozenset({"cispo", "vespo"})


def step_credit_refused(importance_sampling_level: object, loss_type: object) -> Refusal:
    """TRL's loss cannot give each token its own advantage (``reward.step_credit``)."""
    if importance_sampling_level != "sequence" or loss_type in DETACHED_RATIO:
        return None
    return (
        "training.importance_sampling_level",
        f"'sequence' cannot be combined with reward.step_credit and loss_type {loss_type!r}: the loss's gradient "
        "then flows through one importance ratio a sequence, which weighs every token by the mean of the "
        "sequence's advantages, so a step's credit would reach every token of its completion alike; use 'token', "
        f"a loss_type of {sorted(DETACHED_RATIO)}, or set reward.step_credit.weight: 0",
    )


def dynamic_sampling_refused(
    section: DynamicSamplingSection,
    *,
    pcgrad: bool,
    scale_rewards: Any,
    aggregation: str,
    outcome: str | None,
    step_credit: bool = False,
) -> Refusal:
    """``section`` cannot work with these settings. ``outcome``: the reward's outcome component;
    ``step_credit``: reward.step_credit is on."""
    if section.mode == "none":
        return None
    if section.metric == "outcome" and outcome is None:
        return (
            "dynamic_sampling.metric",
            "'outcome' gates on the reward's accuracy component (the answer's "
            "correctness), and this reward has none (format, or reward.components without crystal:accuracy); "
            "use metric: reward",
        )
    if section.metric == "objectives" and not pcgrad:
        return (
            "dynamic_sampling.metric",
            "'objectives' filters each of PCGrad's two losses on its own objective and "
            "needs pcgrad: true; without PCGrad there is one loss, on the total reward (metric: reward)",
        )
    if section.metric == "objectives" and step_credit:
        return (
            "dynamic_sampling.metric",
            "'objectives' cannot be combined with reward.step_credit: it judges the reasoning objective's "
            "groups on its reward components alone, so the groups whose steps vary where those do not (every "
            "group, with answer-only) would lose the step term; use metric: reward or outcome",
        )
    if scale_rewards == "batch" or aggregation == "normalize_then_sum":
        key, value = (
            ("training.scale_rewards", "'batch'")
            if scale_rewards == "batch"
            else ("training.multi_objective_aggregation", "'normalize_then_sum'")
        )
        return (
            key,
            f"{value} cannot be combined with dynamic_sampling.mode: {section.mode}: the advantages would be "
            "scaled by a std over the whole batch, flat groups included, so dropping or replacing those would "
            "change every other group's advantage; use scale_rewards: group or none (sum_then_normalize)",
        )
    return None


#: Why PCGrad refuses ``use_liger_kernel`` (the config's check, and the trainer's before TRL patches the model).
LIGER_REFUSED = (
    "pcgrad: true cannot be combined with use_liger_kernel: PCGrad runs several backward passes "
    "through one retained graph, and Liger's fused Triton kernels are neither verified for that nor "
    "testable without a GPU here. Set one of them off."
)


def liger_refused(use_liger_kernel: object) -> Refusal:
    """PCGrad cannot run with ``use_liger_kernel``."""
    return ("training.use_liger_kernel", LIGER_REFUSED) if use_liger_kernel else None


def aggregation_refused(aggregation: str) -> Refusal:
    """PCGrad cannot run with this ``multi_objective_aggregation``."""
    if aggregation == "sum_then_normalize":
        return None
    return (
        "training.multi_objective_aggregation",
        f"{aggregation!r} cannot be combined with pcgrad: true (the objective advantages are the parts of TRL's "
        "summed advantage, sum_then_normalize)",
    )


def off_policy_mask_refused(threshold: object) -> Refusal:
    """PCGrad cannot honour TRL's off-policy sequence mask."""
    if threshold is None:
        return None
    return (
        "training.off_policy_mask_threshold",
        f"{threshold!r} cannot be combined with pcgrad: true: TRL drops a sequence by its advantage's sign, and "
        "PCGrad's objective parts of one advantage can differ in sign, so each objective would drop other sequences; "
        "unset it or set pcgrad: false",
    )


#: Why PCGrad refuses DeepSpeed ZeRO-1/2 (printed by ``train/grpo.py --check``; the trainer says the same).
ZERO12_REFUSED = (
    "pcgrad: true cannot run under DeepSpeed ZeRO-{stage}: ZeRO-1/2 expose a rank's reduced gradient partition "
    "only at the accumulation boundary (DeepSpeed's averaged_gradients), not after each of PCGrad's backward "
    "passes, so the accuracy and reasoning gradients cannot be kept apart; use ZeRO-3 "
    "(configs/accelerate/zero3.json, on one or two GPUs too), DDP, or pcgrad: false"
)


def zero_stage_problem(stage: object) -> str | None:
    """Why PCGrad cannot run under this DeepSpeed ZeRO stage, or None."""
    return ZERO12_REFUSED.format(stage=stage) if stage in (1, 2, "1", "2") else None


def training_refused(
    training: dict[str, Any],
    *,
    pcgrad: bool,
    beta: float,
    loss_type: str,
    lora: bool,
    curriculum: bool,
    step_credit: bool = False,
) -> Refusal:
    """A ``training`` value of a GRPO phase that this trainer cannot honour with the run's other settings
    (train/config/trl_fields.py's refused rows that have no rule of their own above)."""
    refused = (pcgrad and off_policy_mask_refused(training.get("off_policy_mask_threshold"))) or (
        step_credit and step_credit_refused(training.get("importance_sampling_level"), loss_type)
    )
    if refused:
        return refused
    if training.get("sync_ref_model") and (beta == 0 or lora):
        why = (
            "beta is 0, so there is no reference model to sync"
            if beta == 0
            else "with model.lora the reference is the base model under the adapter, which TRL cannot sync"
        )
        return "training.sync_ref_model", f"true, but {why} (TRL refuses it once the model has loaded)"
    if training.get("save_on_each_node"):
        return (
            "training.save_on_each_node",
            "true, but a checkpoint is one folder that every node's processes save into: put the run folder on a "
            "file system every node shares",
        )
    if training.get("shuffle_dataset") is False and curriculum:
        return "training.shuffle_dataset", "false, but the curriculum orders the prompts; remove it"
    if pcgrad and training.get("fsdp"):
        return "training.fsdp", f"{training['fsdp']!r}: pcgrad runs on one process, DDP and DeepSpeed ZeRO-3, not FSDP"
    return None
