"""Every private TRL / transformers name the trainers touch, in one table: where, how, what for, and
the test of tests/test_trl_contract.py that pins it. That test file also fails when a module of the
library touches a private name of TRL's or transformers' trainers that has no row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: override: a method of ours replaces theirs and calls ``super()``; call / read / write: we use
#: theirs as it is; swap: an attribute replaced on the instance (or the accelerator) for one call.
How = Literal["override", "call", "read", "write", "swap"]


@dataclass(frozen=True)
class Seam:
    name: str  #: the private attribute or method, e.g. ``_calculate_rewards``
    module: str  #: the file that touches it, from the repository's root
    how: How
    why: str
    test: str  #: the function of tests/test_trl_contract.py that pins what this row relies on


SEAMS: tuple[Seam, ...] = (
    Seam(
        "_calculate_rewards",
        "train/trainer/reward_hooks.py",
        "override",
        "one evaluation of the reward module per generation batch",
        "test_calculate_rewards_is_one_global_column_per_function_with_none_as_nan",
    ),
    Seam(
        "_calculate_rewards",
        "train/pcgrad/trainer.py",
        "override",
        "keeps the global rewards_per_func for the objective advantages",
        "test_calculate_rewards_is_one_global_column_per_function_with_none_as_nan",
    ),
    Seam(
        "_calculate_rewards",
        "train/trainer/dynamic_sampling.py",
        "swap",
        "records each generation round's rewards while flat groups are refilled",
        "test_the_calls_dynamic_sampling_intercepts",
    ),
    Seam(
        "_calculate_rewards",
        "train/trainer/step_credit.py",
        "override",
        "scores each step of the reward module's evaluation and finds its tokens in completion_ids_list",
        "test_calculate_rewards_is_one_global_column_per_function_with_none_as_nan",
    ),
    Seam(
        "_generate_and_score_completions",
        "train/trainer/step_credit.py",
        "override",
        "adds the per-token step term (step_advantages) beside TRL's advantages",
        "test_generation_output_carries_advantages_of_local_rows",
    ),
    Seam(
        "_generate_and_score_completions",
        "train/pcgrad/trainer.py",
        "override",
        "adds each objective's advantages to the batch",
        "test_generation_output_carries_advantages_of_local_rows",
    ),
    Seam(
        "_generate_and_score_completions",
        "train/trainer/dynamic_sampling.py",
        "swap",
        "generates again until the batch's groups are not flat (refill), PCGrad's split included",
        "test_the_calls_dynamic_sampling_intercepts",
    ),
    Seam(
        "_prepare_inputs",
        "train/trainer/dynamic_sampling.py",
        "override",
        "the step's generation, where flat groups are masked or refilled",
        "test_private_signatures",
    ),
    Seam(
        "_compute_loss",
        "train/trainer/dynamic_sampling.py",
        "override",
        "rescales the advantages so that masked groups leave the loss's normaliser",
        "test_each_loss_type_weighs_rows_by_tool_mask_as_dynamic_sampling_assumes",
    ),
    Seam(
        "_compute_loss",
        "train/trainer/step_credit.py",
        "override",
        "passes advantages + step_advantages, (B, T), which TRL's loss reads token by token",
        "test_compute_loss_takes_per_token_advantages_token_by_token",
    ),
    Seam(
        "_compute_loss",
        "train/pcgrad/trainer.py",
        "call",
        "each objective's loss is TRL's own loss on that objective's advantages",
        "test_compute_loss_uses_one_logps_call_and_reads_beta_and_advantages_at_call_time",
    ),
    Seam(
        "_get_per_token_logps_and_entropies",
        "train/pcgrad/trainer.py",
        "override",
        "one forward pass shared by the objective losses of a micro-batch",
        "test_compute_loss_uses_one_logps_call_and_reads_beta_and_advantages_at_call_time",
    ),
    Seam(
        "_entropy_bonus_enabled",
        "train/pcgrad/trainer.py",
        "swap",
        "the objective losses leave out the entropy bonus, which joins the unprojected rest",
        "test_pcgrad_losses_see_and_leave_the_trainer_as_the_plain_loss_does",
    ),
    Seam(
        "_metrics",
        "train/pcgrad/trainer.py",
        "write",
        "PCGrad's own diagnostics in TRL's metric store",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
    Seam(
        "_metrics",
        "train/trainer/dynamic_sampling.py",
        "swap",
        "a discarded generation round logs nothing",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
    Seam(
        "_metrics",
        "train/trainer/grpo_trainer.py",
        "read",
        "the KL maximum over the logging window",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
    Seam(
        "_metrics",
        "train/trainer/nonfinite.py",
        "write",
        "the skipped non-finite updates, logged as TRL logs",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
    Seam(
        "_metrics",
        "train/trainer/callbacks.py",
        "write",
        "validation's metrics beside TRL's",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
    Seam(
        "_logs",
        "train/trainer/dynamic_sampling.py",
        "swap",
        "a discarded generation round logs no completions",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
    Seam(
        "_tokenizer",
        "train/trainer/dynamic_sampling.py",
        "read",
        "the pad token of refilled rows",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
    Seam(
        "_log_metric",
        "train/trainer/reward_hooks.py",
        "call",
        "the reward module's diagnostics, logged as TRL's",
        "test_private_signatures",
    ),
    Seam(
        "_log_metric",
        "train/trainer/step_credit.py",
        "call",
        "the step credit's fallback rate, token share and mean term, logged as TRL's",
        "test_private_signatures",
    ),
    Seam(
        "_get_train_sampler",
        "train/trainer/prompt_order.py",
        "override",
        "the curriculum's order, or TRL's made resumable mid-epoch",
        "test_trl_training_order_is_one_seeded_permutation_an_epoch",
    ),
    Seam(
        "_generate_single_turn",
        "train/models/lora_merge.py",
        "override",
        "generation through merged LoRA adapters",
        "test_private_signatures",
    ),
    Seam(
        "_save_checkpoint",
        "train/trainer/checkpoint_hooks.py",
        "override",
        "complete checkpoints: disk space checked, a completion marker after every rank saved",
        "test_private_signatures",
    ),
    Seam(
        "_get_output_dir",
        "train/trainer/checkpoint_hooks.py",
        "call",
        "the run folder a checkpoint goes to",
        "test_private_signatures",
    ),
    Seam(
        "_load_optimizer_and_scheduler",
        "train/trainer/checkpoint_hooks.py",
        "override",
        "restores our checkpoint state and the schedule's rate at the restored step",
        "test_private_signatures",
    ),
    Seam(
        "_issue_warnings_after_load",
        "train/trainer/checkpoint_hooks.py",
        "override",
        "a resumed model's tied lm_head is not reported missing",
        "test_private_signatures",
    ),
    Seam(
        "_name",
        "train/run/model_card.py",
        "read",
        "the trainer's name on the model card",
        "test_attributes_pcgrad_reads_and_swaps",
    ),
)

#: Public attributes swapped on an instance: not private, but a seam all the same.
SWAPS: tuple[Seam, ...] = (
    Seam(
        "backward",
        "train/pcgrad/trainer.py",
        "swap",
        "the accelerator's backward runs PCGrad's passes for one training_step (TRL's and transformers' own)",
        "test_training_step_is_trl_and_transformers_own_with_the_loss_and_backward_standing_in",
    ),
)
