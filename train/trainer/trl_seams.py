"""Every private TRL / transformers name the trainers touch, in one table: where, how, what for, and
the test of tests/test_trl_contract.py that pins it. That test file also fails when a module of the
library touches a private name of TRL's or transformers' trainers that has no row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: override: a method (or property) of ours replaces theirs, declared once in the class, and calls or
#: reads theirs; call / read / write: we use theirs as it is. Nothing is swapped on an instance at run time.
How = Literal["override", "call", "read", "write"]


@dataclass(frozen=True)
class Seam:
    name: str  #: the private attribute or method, e.g. ``_calculate_rewards``
    module: str  #: the file that touches it, from the repository's root
    how: How
    why: str
    test: str  #: the function of tests/test_trl_contract.py that pins what this row relies on


SEAMS: tuple[Seam, ...] = (
    Seam(
        "_get_train_sampler",
        "train/trainer/grpo_trainer.py",
        "override",
        "the curriculum's order, or TRL's made resumable mid-epoch",
        "test_trl_training_order_is_one_seeded_permutation_an_epoch",
    ),
    Seam(
        "_generate_single_turn",
        "train/trainer/grpo_trainer.py",
        "override",
        "generation through merged LoRA adapters",
        "test_private_signatures",
    ),
    Seam(
        "_calculate_rewards",
        "train/trainer/grpo_trainer.py",
        "override",
        "one evaluation of the reward module per generation round, and the step credit read from it",
        "test_calculate_rewards_is_one_global_column_per_function_with_none_as_nan",
    ),
    Seam(
        "_log_metric",
        "train/trainer/grpo_trainer.py",
        "call",
        "the reward module's diagnostics and the step credit's, logged as TRL's",
        "test_private_signatures",
    ),
    Seam(
        "_generate_and_score_completions",
        "train/trainer/grpo_trainer.py",
        "override",
        "one round plus the step term and PCGrad's parts (add_advantages), or dynamic sampling's rounds",
        "test_generation_output_carries_advantages_of_local_rows",
    ),
    Seam(
        "_metrics",
        "train/trainer/grpo_trainer.py",
        "write",
        "dynamic sampling's metrics; a quiet round's or loss's undone (quiet_logs); the KL maximum read",
        "test_quiet_logs_undo_what_a_round_and_a_loss_log",
    ),
    Seam(
        "_logs",
        "train/trainer/grpo_trainer.py",
        "write",
        "a refill round's completions undone (quiet_logs)",
        "test_quiet_logs_undo_what_a_round_and_a_loss_log",
    ),
    Seam(
        "_tokenizer",
        "train/trainer/grpo_trainer.py",
        "read",
        "the pad token of refilled rows",
        "test_attributes_the_trainer_reads_and_writes",
    ),
    Seam(
        "_compute_loss",
        "train/trainer/grpo_trainer.py",
        "override",
        "TRL's loss on advantages + step_advantages, (B, T), its terms (LossTerms) scaled for masked groups",
        "test_compute_loss_takes_per_token_advantages_token_by_token",
    ),
    Seam(
        "_entropy_bonus_enabled",
        "train/trainer/grpo_trainer.py",
        "override",
        "a property: off in PCGrad's objective losses (LossTerms)",
        "test_the_loss_reads_its_terms_when_it_is_formed",
    ),
    Seam(
        "_save_checkpoint",
        "train/trainer/grpo_trainer.py",
        "override",
        "complete checkpoints: disk space checked, a completion marker after every rank saved",
        "test_private_signatures",
    ),
    Seam(
        "_get_output_dir",
        "train/trainer/grpo_trainer.py",
        "call",
        "the run folder a checkpoint goes to",
        "test_private_signatures",
    ),
    Seam(
        "_load_optimizer_and_scheduler",
        "train/trainer/grpo_trainer.py",
        "override",
        "restores our checkpoint state and the schedule's rate at the restored step",
        "test_private_signatures",
    ),
    Seam(
        "_issue_warnings_after_load",
        "train/trainer/grpo_trainer.py",
        "override",
        "a resumed model's tied lm_head is not reported missing",
        "test_private_signatures",
    ),
    Seam(
        "_name",
        "train/trainer/grpo_trainer.py",
        "read",
        "the trainer's name on the model card",
        "test_attributes_the_trainer_reads_and_writes",
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
        "read",
        "whether the unprojected rest loss is needed",
        "test_the_loss_reads_its_terms_when_it_is_formed",
    ),
    Seam(
        "_last_world_entropy",
        "train/pcgrad/trainer.py",
        "write",
        "the adaptive entropy controller as the plain loss saw it, for the rest loss, then as it left it",
        "test_trls_loss_rebinds_only_the_entropy_controller_and_mutates_only_its_metrics",
    ),
    Seam(
        "_entropy_window_stats",
        "train/pcgrad/trainer.py",
        "write",
        "the adaptive entropy controller as the plain loss saw it, for the rest loss, then as it left it",
        "test_trls_loss_rebinds_only_the_entropy_controller_and_mutates_only_its_metrics",
    ),
    Seam(
        "_metrics",
        "train/pcgrad/trainer.py",
        "write",
        "PCGrad's own diagnostics in TRL's metric store",
        "test_attributes_the_trainer_reads_and_writes",
    ),
    Seam(
        "_metrics",
        "train/trainer/callbacks.py",
        "write",
        "validation's metrics beside TRL's",
        "test_attributes_the_trainer_reads_and_writes",
    ),
)

#: Public attributes of TRL's trainer that a module overrides or writes: not private, but seams all the same.
PUBLIC: tuple[Seam, ...] = (
    Seam(
        "control",
        "train/trainer/grpo_trainer.py",
        "write",
        "finish_from ends a finished phase's callbacks as transformers' loop does",
        "test_private_signatures",
    ),
    Seam(
        "chat_template_kwargs",
        "train/trainer/sft.py",
        "write",
        "the run's prompt rendering, under the name GRPOTrainer keeps it: validation renders SFT's prompts as GRPO's",
        "test_attributes_the_trainer_reads_and_writes",
    ),
    Seam(
        "beta",
        "train/trainer/grpo_trainer.py",
        "override",
        "a property: args.beta times the loss terms' KL scale (0 in PCGrad's objective losses; masked rows' scale)",
        "test_the_loss_reads_its_terms_when_it_is_formed",
    ),
    Seam(
        "aux_loss_enabled",
        "train/trainer/grpo_trainer.py",
        "override",
        "a property: off in PCGrad's objective losses",
        "test_the_loss_reads_its_terms_when_it_is_formed",
    ),
    Seam(
        "entropy_coef",
        "train/pcgrad/trainer.py",
        "write",
        "the adaptive entropy controller as the plain loss saw it, for the rest loss, then as it left it",
        "test_trls_loss_rebinds_only_the_entropy_controller_and_mutates_only_its_metrics",
    ),
)
