"""Every field of TRL's ``GRPOConfig`` and what this trainer does with it, one row each: it passes
through unchanged (TRL acts on it as TRL documents, PCGrad and dynamic sampling calling TRL's own
code for it), it is adapted (how), or a value or combination is refused at load and ``--check``
(when, why; the rest of its values pass through).

The rows are decided by reading TRL 1.16's ``GRPOTrainer`` against this project's hooks
(train/trainer/trl_seams.py). tests/test_trl_fields.py compares them with the generated schema
(train/config/trl_fields_table.py, each locked set's), so a field TRL adds fails until it has a
row here, and checks docs/training.md's table, which :func:`render` writes
(``python -m crystal_grpo.train.config.trl_fields``).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["passes", "adapted", "refused"]


@dataclass(frozen=True)
class Row:
    kind: Kind
    note: str  #: passes: the fields' group; adapted: how; refused: when and why (one sentence)
    test: str = ""  #: adapted: the test (tests/<file>::<function>) that runs it


def _passes(group: str, *names: str) -> dict[str, Row]:
    return {name: Row("passes", group) for name in names}


def _adapted(note: str, test: str, *names: str) -> dict[str, Row]:
    return {name: Row("adapted", note, test) for name in names}


def _one_row_each(*parts: dict[str, Row]) -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for part in parts:
        twice = set(rows) & set(part)
        if twice:
            raise ValueError(f"train/config/trl_fields.py: more than one row for {sorted(twice)}")
        rows.update(part)
    return rows


_RUN_CONFIG_TEST = "tests/test_trl_options.py::test_trl_options_reach_every_phase_and_every_load"
_DYNAMIC_PCGRAD_TEST = "tests/test_dynamic_sampling.py::test_each_loss_type_masks_flat_groups_under_pcgrad"

FIELDS: dict[str, Row] = _one_row_each(
    _passes(
        "Optimizer and schedule",
        "learning_rate",
        "lr_scheduler_type",
        "lr_scheduler_kwargs",
        "warmup_steps",
        "optim",
        "optim_args",
        "optim_target_modules",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "num_train_epochs",
        "max_steps",
    ),
    _passes(
        "Batch and generation sizes (whole groups checked at --check)",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "average_tokens_across_devices",
        "auto_find_batch_size",
        "num_generations",
        "num_generations_eval",
        "generation_batch_size",
        "steps_per_generation",
        "num_iterations",
        "max_completion_length",
        "per_device_eval_batch_size",
        "eval_accumulation_steps",
    ),
    _passes(
        "Sampling (TRL's generation)",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "generation_kwargs",
        "max_tool_calling_iterations",
    ),
    _passes(
        "TRL's loss (PCGrad calls it per objective; dynamic sampling masks rows and scales it linearly)",
        "epsilon",
        "epsilon_high",
        "delta",
        "mask_truncated_completions",
        "top_entropy_quantile",
        "use_bias_correction_kl",
        "sapo_temperature_neg",
        "sapo_temperature_pos",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
    ),
    _passes(
        "TRL's reference-model sync (TRL saves no reference model: a resumed run's starts again from the initial "
        "weights)",
        "ref_model_mixup_alpha",
        "ref_model_sync_steps",
    ),
    _passes(
        "vLLM (docs/training.md, Generation in vLLM; its paths through PCGrad and refill: tests/test_trl_contract.py)",
        "vllm_mode",
        "vllm_model_impl",
        "vllm_enable_sleep_mode",
        "vllm_structured_outputs_regex",
        "vllm_server_base_url",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_timeout",
        "vllm_group_port",
        "vllm_gpu_memory_utilization",
        "vllm_max_model_length",
        "vllm_tensor_parallel_size",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_cap",
    ),
    _passes(
        "Model, precision and memory",
        "bf16",
        "fp16",
        "bf16_full_eval",
        "fp16_full_eval",
        "tf32",
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "torch_compile",
        "torch_compile_backend",
        "torch_compile_mode",
        "liger_kernel_config",
        "use_cache",
        "neftune_noise_alpha",
        "torch_empty_cache_steps",
        "disable_dropout",
        "cast_lm_head_to_fp32",
        "ds3_gather_for_generation",
        "pad_to_multiple_of",
        "fsdp_config",
    ),
    _passes(
        "Logging and tracking",
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "log_on_each_node",
        "logging_nan_inf_filter",
        "include_num_input_tokens_seen",
        "log_level",
        "log_level_replica",
        "disable_tqdm",
        "report_to",
        "run_name",
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        "log_completions",
        "log_multimodal",
        "num_completions_to_print",
        "log_unique_prompts",
        "log_completions_hub_repo",
        "skip_memory_metrics",
    ),
    _passes(
        "TRL's evaluation (beside the project's validation)",
        "eval_steps",
        "eval_delay",
        "eval_on_start",
        "prediction_loss_only",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "include_for_metrics",
        "batch_eval_metrics",
        "label_smoothing_factor",
        "label_names",
        "metric_for_best_model",
        "greater_is_better",
        "load_best_model_at_end",
    ),
    _passes(
        "Checkpoints and the Hub",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "save_only_model",
        "enable_jit_checkpoint",
        "restore_callback_states_from_checkpoint",
        "ignore_data_skip",
        "push_to_hub",
        "hub_token",
        "hub_private_repo",
        "hub_model_id",
        "hub_strategy",
        "hub_always_push",
        "hub_revision",
    ),
    _passes(
        "Processes, data loading and seeds",
        "seed",
        "data_seed",
        "full_determinism",
        "use_cpu",
        "accelerator_config",
        "parallelism_config",
        "dataloader_drop_last",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "dataloader_in_order",
        "train_sampling_strategy",
        "length_column_name",
        "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "ddp_static_graph",
        "ddp_backend",
        "ddp_timeout",
        "debug",
        "do_train",
        "do_eval",
        "do_predict",
        "local_rank",
    ),
    _adapted(
        "Default grpo (the paper's recipe; TRL's is dapo); PCGrad builds each objective's loss with it, and "
        "dynamic sampling recounts its normaliser over the kept groups (train/trainer/dynamic_sampling.py).",
        _DYNAMIC_PCGRAD_TEST,
        "loss_type",
    ),
    _adapted(
        "Default 0.04 (the paper's); under PCGrad the KL term is added after the projection, not projected, and "
        "dynamic sampling scales it with the surrogate for the row-mean loss types.",
        _DYNAMIC_PCGRAD_TEST,
        "beta",
    ),
    _adapted(
        "Under PCGrad the entropy bonus joins the KL term outside the projection; under dynamic sampling it is a "
        "mean over the kept groups' tokens.",
        _DYNAMIC_PCGRAD_TEST,
        "entropy_coef",
    ),
    _adapted(
        "The adaptive entropy controller: under PCGrad it moves once per optimizer step, from the plain loss.",
        "tests/test_trl_contract.py::test_pcgrad_losses_see_and_leave_the_trainer_as_the_plain_loss_does",
        "use_adaptive_entropy",
        "entropy_target",
        "entropy_coef_min",
        "entropy_coef_max",
        "entropy_coef_delta",
    ),
    _adapted(
        "A mixture-of-experts router's aux loss: under PCGrad it joins the KL term outside the projection.",
        "tests/test_trl_contract.py::test_pcgrad_losses_see_and_leave_the_trainer_as_the_plain_loss_does",
        "router_aux_loss_coef",
    ),
    _adapted(
        "Moved into the model section (model.trust_remote_code, model.dtype, model.init_kwargs, ...), which every "
        "load reads: the policy, TRL's reference model, evaluation and export.",
        _RUN_CONFIG_TEST,
        "trust_remote_code",
        "model_init_kwargs",
    ),
    _adapted(
        "Moved into data.chat_template_kwargs, which every prompt reads: rollouts, the SFT phase, validation, "
        "evaluation.",
        _RUN_CONFIG_TEST,
        "chat_template_kwargs",
    ),
    _adapted(
        "Validation generates the same way as training (train/models/generation.py's Engine).",
        "tests/test_generation.py::test_validation_generates_with_the_training_cache",
        "cache_implementation",
        "use_transformers_continuous_batching",
        "transformers_continuous_batching_config",
        "use_transformers_paged",
    ),
    _adapted(
        "The run folder when --output_dir is not given (each phase writes into its own folder under it); "
        "refused inside a phase's overrides.",
        "tests/test_config.py::test_an_empty_output_dir_is_an_error_not_the_default_folder",
        "output_dir",
    ),
    _adapted(
        "Resumes the whole run, as the --resume_from_checkpoint flag does ('latest': its newest complete "
        "checkpoint); refused inside a phase's overrides.",
        "tests/test_trl_options.py::test_resume_from_checkpoint_in_the_config_resumes_like_the_flag",
        "resume_from_checkpoint",
    ),
    {
        "remove_unused_columns": Row(
            "refused", "True, for GRPO: it would drop the columns the reward reads and judge every completion wrong."
        ),
        "reward_weights": Row(
            "refused", "A negative weight unless reward.params.negative_weights says the penalty is meant."
        ),
        "scale_rewards": Row(
            "refused",
            "'batch' with dynamic sampling: a std over the whole batch would change every kept group's advantage when "
            "flat groups are dropped (TRL's booleans are read as group / none, PCGrad's split scales as TRL does).",
        ),
        "multi_objective_aggregation": Row(
            "refused",
            "normalize_then_sum with PCGrad (the objective advantages are the parts of TRL's summed advantage) or "
            "with dynamic sampling (a batch-wide std, as for scale_rewards).",
        ),
        "use_liger_kernel": Row(
            "refused",
            "With PCGrad: its fused kernels are not verified for several backward passes through one retained graph.",
        ),
        "off_policy_mask_threshold": Row(
            "refused",
            "With PCGrad: the mask drops a sequence by its advantage's sign, and an objective's part of a sequence's "
            "advantage can have the other sign than the total, so each objective would drop other sequences.",
        ),
        "sync_ref_model": Row(
            "refused",
            "With beta 0 (no reference model to sync) or model.lora (the reference is the base model under the "
            "adapter): TRL refuses both only after the model loads.",
        ),
        "save_on_each_node": Row(
            "refused",
            "True: a copy of each checkpoint on every node's own disk is no checkpoint a run resumes from (its "
            "completion marker is written where the main process saved); put the run folder on a file system "
            "every node shares (a folder the nodes do not share is refused when the run starts).",
        ),
        "shuffle_dataset": Row(
            "refused",
            "False with a curriculum, which orders the prompts itself; without one, TRL's order is kept and made "
            "resumable mid-epoch (train/trainer/prompt_order.py).",
        ),
        "importance_sampling_level": Row(
            "refused",
            "'sequence' with reward.step_credit, unless loss_type is cispo or vespo: the gradient through one ratio "
            "a sequence weighs every token by the mean of its advantages, so every token would get the same credit.",
        ),
        "eval_strategy": Row("refused", "Other than 'no' without a validation split (data.validation or a fraction)."),
        "use_vllm": Row("refused", "True where vLLM is missing or outside the installed TRL's supported range."),
        "fsdp": Row("refused", "With PCGrad, which runs on one process, DDP and DeepSpeed ZeRO-3."),
        "deepspeed": Row(
            "refused",
            "ZeRO-1/2 with PCGrad (at --check): they expose a rank's gradient partition only at the accumulation "
            "boundary, so the objectives' gradients cannot be kept apart.",
        ),
    },
)


# --------------------------------------------------------------------------- docs/training.md
DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"
BEGIN = "<!-- trl-fields: generated by python -m crystal_grpo.train.config.trl_fields; do not edit -->"
END = "<!-- /trl-fields -->"


def render() -> str:
    """The table in docs/training.md: the fields with one note a row (adapted, refused, then those
    passing through, by group)."""
    lines = [BEGIN, "", "| Field | Treatment | How / when and why |", "|---|---|---|"]
    for kind, label in (("adapted", "adapted"), ("refused", "refused"), ("passes", "passes through")):
        notes: dict[str, list[str]] = {}
        for name, row in FIELDS.items():
            if row.kind == kind:
                notes.setdefault(row.note, []).append(name)
        lines += [f"| {', '.join(f'`{n}`' for n in names)} | {label} | {note} |" for note, names in notes.items()]
    return "\n".join([*lines, "", END])


def with_table(text: str) -> str:
    """``text`` (docs/training.md) with its generated table replaced by :func:`render`'s."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{DOC}: no {BEGIN!r} ... {END!r} section")
    return pattern.sub(lambda _: render(), text)


if __name__ == "__main__":
    DOC.write_text(with_table(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the GRPOConfig table into {DOC}", file=sys.stderr)
