"""Every GRPOConfig field has one row in train/config/trl_fields.py (passes through, adapted, refused),
each refusal is one line at ``--check`` naming the key, and docs/training.md's table is the rows'."""

from __future__ import annotations

import importlib
import re

import pytest

from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import ConfigError, load_config
from crystal_grpo.train.config.training_section import TABLES
from crystal_grpo.train.config.trl_fields import DOC, FIELDS, render, with_table

REPO = DOC.parents[1]
PCGRAD = ["--pcgrad", "true"]
CURRICULUM = ["--curriculum", "{mode: competence, c0: 0.25, difficulty: steps}"]

#: (field, command-line arguments, what the one line says): a case for every refused row.
REFUSALS = [
    ("remove_unused_columns", ["--training.remove_unused_columns", "true"], "training.remove_unused_columns: true"),
    ("reward_weights", ["--training.reward_weights", "[-1.0, 1.0]"], "training.reward_weights: invalid value"),
    (
        "scale_rewards",
        ["--dynamic_sampling.mode", "mask", "--training.scale_rewards", "batch"],
        "training.scale_rewards: 'batch' cannot",
    ),
    (
        "multi_objective_aggregation",
        [*PCGRAD, "--training.multi_objective_aggregation", "normalize_then_sum"],
        "training.multi_objective_aggregation: 'normalize_then_sum' cannot",
    ),
    ("use_liger_kernel", [*PCGRAD, "--training.use_liger_kernel", "true"], "training.use_liger_kernel: pcgrad"),
    (
        "off_policy_mask_threshold",
        [*PCGRAD, "--training.off_policy_mask_threshold", "0.5"],
        "training.off_policy_mask_threshold: 0.5 cannot be combined with pcgrad",
    ),
    (
        "sync_ref_model",
        ["--training.sync_ref_model", "true", "--training.beta", "0"],
        "training.sync_ref_model: true, but beta is 0",
    ),
    (
        "sync_ref_model",
        ["--training.sync_ref_model", "true", "--model.lora", "{}"],
        "training.sync_ref_model: true, but with model.lora",
    ),
    ("shuffle_dataset", [*CURRICULUM, "--training.shuffle_dataset", "false"], "training.shuffle_dataset: false"),
    ("save_on_each_node", ["--training.save_on_each_node", "true"], "training.save_on_each_node: true, but"),
    (
        "eval_strategy",
        ["--training.eval_strategy", "steps", "--data.validation", "null", "--data.validation_fraction", "0"],
        "training.eval_strategy: 'steps' evaluates on the validation split",
    ),
    ("use_vllm", ["--training.use_vllm", "true"], "training.use_vllm: true, but vLLM"),
    ("fsdp", [*PCGRAD, "--training.fsdp", "full_shard"], "training.fsdp: 'full_shard': pcgrad"),
    (
        "importance_sampling_level",
        ["--reward.step_credit.weight", "1", "--training.importance_sampling_level", "sequence"],
        "training.importance_sampling_level: 'sequence' cannot be combined with reward.step_credit",
    ),
    ("deepspeed", [*PCGRAD, "--training.deepspeed", "{zero_optimization: {stage: 2}}"], "DeepSpeed ZeRO-2"),
]


@pytest.mark.parametrize("module", list(TABLES))
def test_every_grpo_config_field_of_each_locked_set_has_one_row(module):
    fields = importlib.import_module(f"crystal_grpo.train.config.{module}").GRPO
    missing = sorted(set(fields) - set(FIELDS))
    assert not missing, f"GRPOConfig fields without a row in train/config/trl_fields.py: {missing}"


def test_no_row_is_for_a_field_grpo_config_lacks():
    known = set().union(*(importlib.import_module(f"crystal_grpo.train.config.{m}").GRPO for m in TABLES))
    assert sorted(set(FIELDS) - known) == []


def test_each_adapted_row_names_a_test_that_exists():
    for name, row in FIELDS.items():
        if row.kind != "adapted":
            assert not row.test, name
            continue
        path, function = row.test.split("::")
        assert re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M), f"{name}: no {row.test}"


def test_the_docs_table_is_the_rows():
    text = DOC.read_text(encoding="utf-8")
    assert render() in text and with_table(text) == text, "run python -m crystal_grpo.train.config.trl_fields"


def test_every_refused_row_has_a_check_case():
    assert {field for field, _, _ in REFUSALS} == {name for name, row in FIELDS.items() if row.kind == "refused"}


@pytest.mark.parametrize("field, args, says", REFUSALS, ids=[f"{c[0]}-{i}" for i, c in enumerate(REFUSALS)])
def test_each_refused_field_is_refused_at_check(field, args, says, capsys):
    assert grpo.main(["--config", "tiny.yaml", *args, "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err
    if err.startswith("config error: "):  # refused at load: one line
        assert "\n" not in err and err.startswith(f"config error: training.{field}"), err


@pytest.mark.parametrize(
    "args",
    [
        ["--training.off_policy_mask_threshold", "0.5"],
        ["--training.sync_ref_model", "true"],
        ["--training.shuffle_dataset", "false"],
        ["--training.fsdp", "full_shard"],
        [*CURRICULUM, *PCGRAD, "--training.shuffle_dataset", "true", "--training.off_policy_mask_threshold", "null"],
        ["--training.importance_sampling_level", "sequence"],
        ["--reward.step_credit.weight", "1", "--training.importance_sampling_level", "sequence"]
        + ["--training.loss_type", "cispo"],
    ],
)
def test_the_new_refusals_leave_their_values_alone_in_other_runs(args):
    load_config("tiny", args)


def test_a_phase_cannot_move_its_own_folder():
    with pytest.raises(ConfigError, match=r"^phases\[g\].overrides.training.output_dir: a phase writes into its own"):
        load_config("tiny", ["--phases", "[{name: g, overrides: {training: {output_dir: elsewhere}}}]"])
