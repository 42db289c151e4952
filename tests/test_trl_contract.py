"""The contract with TRL (and DeepSpeed) internals that the trainer and PCGrad rely on.

train/trainer/grpo_trainer.py and train/pcgrad/trainer.py override or call private GRPOTrainer methods
(every one a row of train/trainer/trl_seams.py); between TRL 1.9 and 1.16 those changed by 30-270
lines each. ``pyproject.toml`` pins TRL's minor version, and this file is the one place a TRL upgrade
fails loudly: every private signature, attribute and behaviour the hooks depend on is checked here
against the installed TRL, and the trainers' shape (classes, overrides, no swaps) is held. When
upgrading, make these pass, then move ``TESTED_TRL`` and the pin together.
"""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import pytest
import tomllib
import torch
import trl
from packaging.requirements import Requirement
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer

from crystal_grpo.train.config.refusals import DETACHED_RATIO
from crystal_grpo.train.config.training_section import TABLES
from crystal_grpo.train.pcgrad.trainer import TESTED_TRL
from crystal_grpo.train.trainer.dynamic_sampling import MICRO_BATCH_TOKEN_MEAN, ROW_MEAN, TOKEN_COUNT

REPO = Path(__file__).resolve().parents[1]


def unwrapped(method):
    """A DeepSpeed method without its NVTX decorator (which sets no ``__wrapped__``)."""
    return inspect.getclosurevars(method).nonlocals.get("func", method)


def normalised(source: str) -> str:
    """Source text with its whitespace collapsed, to compare code across formatting."""
    return " ".join(source.split())


def test_installed_trl_is_the_tested_minor_and_pyproject_pins_it():
    installed = Version(trl.__version__)
    assert f"{installed.major}.{installed.minor}" == TESTED_TRL, (
        f"TRL {trl.__version__} is installed but train/pcgrad/trainer.py was verified against {TESTED_TRL}.x"
    )
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "trl"]
    assert str(spec) == f"~={TESTED_TRL}.0", "pin TRL to the tested minor version"
    assert installed in spec and Version(f"{TESTED_TRL}.99") in spec and Version("1.17.0") not in spec


def test_the_vllm_extra_is_the_range_trl_supports():
    """pyproject's ``vllm`` extra is TRL's own ``vllm`` extra's range (an unbounded one took vLLM
    0.32/0.33, which TRL 1.16 does not support and whose transformers pin breaks the lock)."""
    from packaging.specifiers import SpecifierSet

    from crystal_grpo.train.models.generation import trl_vllm_range

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (vllm,) = [Requirement(r) for r in extras["vllm"] if Requirement(r).name == "vllm"]
    assert vllm.specifier == SpecifierSet(trl_vllm_range())


# Parameter names, in order, of every TRL / transformers method the hooks override or call.
SIGNATURES = {
    (GRPOTrainer, "_calculate_rewards"): ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    (GRPOTrainer, "_generate_and_score_completions"): ["self", "inputs"],
    # train/models/lora_merge.py merges LoRA adapters around the ``generate`` call inside it; that TRL's
    # generation really goes through that call is checked by tests/test_lora_merge.py.
    (GRPOTrainer, "_generate_single_turn"): [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ],
    (GRPOTrainer, "_compute_loss"): ["self", "model", "inputs"],
    (GRPOTrainer, "compute_loss"): ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
    (GRPOTrainer, "training_step"): ["self", "model", "inputs", "num_items_in_batch"],
    (GRPOTrainer, "_prepare_inputs"): ["self", "generation_batch"],
    (GRPOTrainer, "_get_train_sampler"): ["self", "dataset"],
    (GRPOTrainer, "_save_checkpoint"): ["self", "model", "trial"],
    (GRPOTrainer, "_load_optimizer_and_scheduler"): ["self", "checkpoint"],
    (GRPOTrainer, "create_optimizer"): ["self", "model"],
    (GRPOTrainer, "create_model_card"): ["self", "model_name", "dataset_name", "tags"],
    (GRPOTrainer, "log"): ["self", "logs", "start_time"],
    (GRPOTrainer, "_log_metric"): ["self", "name", "value"],
    # train/trainer/checkpoint_hooks.py drops tied weights (lm_head of tied embeddings) from the resume warning
    (GRPOTrainer, "_issue_warnings_after_load"): ["self", "load_result"],
    (GRPOTrainer, "_get_output_dir"): ["self", "trial"],
}


@pytest.mark.parametrize("owner, name", list(SIGNATURES), ids=[n for _, n in SIGNATURES])
def test_private_signatures(owner, name):
    params = list(inspect.signature(getattr(owner, name)).parameters)
    assert params == SIGNATURES[(owner, name)], f"{owner.__name__}.{name}{params}"


def test_logps_helper_takes_the_arguments_pcgrad_forwards():
    params = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    assert list(params)[:5] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]
    assert {"compute_entropy", "compute_aux_loss", "pixel_values", "image_grid_thw"} <= set(params)


def test_helpers_the_project_imports_exist():
    from trl.data_utils import prepare_multimodal_messages
    from trl.models.utils import unwrap_model_for_generation
    from trl.trainer.utils import RepeatSampler, nanstd, shuffle_sequence_dict, split_tensor_dict

    assert list(inspect.signature(RepeatSampler).parameters)[:6] == [
        "data_source",
        "mini_repeat_count",
        "batch_size",
        "repeat_count",
        "shuffle",
        "seed",
    ]
    assert all(map(callable, (prepare_multimodal_messages, unwrap_model_for_generation)))
    x = torch.tensor([1.0, float("nan"), 3.0])
    assert float(nanstd(x)) == pytest.approx(2**0.5)  # Bessel-corrected, NaN ignored
    # Extra per-row tensors (PCGrad's advantages_acc/_reason) ride along TRL's shuffle and split.
    batch = {"advantages": torch.arange(4.0), "advantages_acc": torch.arange(4.0) * 10, "n": None}
    parts = split_tensor_dict(shuffle_sequence_dict(batch), 2)
    assert all(torch.equal(p["advantages_acc"], p["advantages"] * 10) for p in parts)


def test_trl_training_order_is_one_seeded_permutation_an_epoch(trainer):
    """What train/trainer/prompt_order.py relies on: TRL's training sampler is a RepeatSampler whose
    iteration e (epoch e) is the (e+1)-th permutation of a generator seeded with ``seed``, so
    ``EpochRepeatSampler.set_epoch(e)`` on a fresh sampler gives TRL's epoch e, in any order."""
    from trl.trainer.utils import RepeatSampler

    from crystal_grpo.train.trainer.prompt_order import EpochRepeatSampler

    trl_sampler = trainer._get_train_sampler()
    assert type(trl_sampler) is RepeatSampler and trl_sampler.shuffle and trl_sampler.seed == trainer.args.seed
    epochs = [list(trl_sampler) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]  # the check can fail
    ours = EpochRepeatSampler.like(trainer._get_train_sampler())
    for e in (2, 0, 1, 1):  # backwards and repeated too
        ours.set_epoch(e)
        assert list(ours) == epochs[e], e
    assert list(ours) == epochs[2]  # an iteration moves to the next epoch, as RepeatSampler's does


def test_deepspeed_internals_used_under_zero3():
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero import parameter_offload, stage3

    backward = unwrapped(deepspeed.DeepSpeedEngine.backward)
    assert list(inspect.signature(backward).parameters) == ["self", "loss", "retain_graph", "scale_wrt_gas"]
    assert "is_boundary" in inspect.signature(deepspeed.DeepSpeedEngine.set_gradient_accumulation_boundary).parameters
    # The per-module counters ZeRO-3's backward hooks consume (restored between PCGrad's backwards).
    source = inspect.getsource(parameter_offload)
    for counter in ("applied_pre_backward_ref_cnt", "ds_grads_remaining"):
        assert counter in source, counter
    # PCGrad's gradient storage under ZeRO-3 is the optimizer's flat partition buffer: every
    # parameter's partition a view of it, the optimizer's gradients those views, and a backward
    # pass overwriting them in a window's first micro-step and adding to them afterwards.
    zero3 = normalised(inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3))
    assert "self.grad_partitions_flat_buffer: Tensor = torch.zeros(" in zero3
    assert "self.__param_id_to_grad_partition[param.ds_id] = self.grad_partitions_flat_buffer.narrow(" in zero3
    assert (
        "self.averaged_gradients[i] = [ self.__param_id_to_grad_partition[param.ds_id] if param.requires_grad" in zero3
    )
    partition = normalised(inspect.getsource(unwrapped(stage3.DeepSpeedZeroOptimizer_Stage3.partition_grads)))
    assert "if self.micro_step_id == 0: # don't accumulate grad_buffer.copy_(grad_partition" in partition
    assert "grad_buffer.add_(grad_partition" in partition


# --- behaviours, on a real trainer with the tiny model -----------------------------------------
@pytest.fixture(scope="module")
def trainer(tiny_lm_path, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoTokenizer

    def acc(completions, **kw):
        return [float(len(c) % 2) for c in completions]

    def reason(completions, **kw):
        return [None if i == 0 else 0.5 for i in range(len(completions))]

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("contract")),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        beta=0.04,
        loss_type="grpo",
        bf16=False,
        use_cpu=True,
        report_to="none",
        max_steps=1,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=str(tiny_lm_path),
        reward_funcs=[acc, reason],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["q"] * 8}),
        processing_class=AutoTokenizer.from_pretrained(tiny_lm_path),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by HF's training loop
    return trainer


def test_attributes_the_trainer_reads_and_writes(trainer):
    for name in (
        "_entropy_bonus_enabled",
        "aux_loss_enabled",
        "beta",
        "multi_objective_aggregation",
        "scale_rewards",
        "reward_weights",
        "reward_func_names",
        "num_generations",
        "_metrics",
        "accelerator",
        "loss_type",
        "_tokenizer",
        "state",
        "train_dataset",
        "_logs",  # a quiet round's undone
        "_name",  # the model card
        "chat_template_kwargs",  # validation's prompt rendering (an SFT phase's too)
    ):
        assert hasattr(trainer, name), name
    assert trainer.multi_objective_aggregation == "sum_then_normalize"  # the default PCGrad splits
    assert set(trainer._metrics) == {"train", "eval"} and trainer._metrics["train"]["x"] == []
    # PCGrad sizes its accumulation window by it; HF's loop sets it at each accumulation window.
    from transformers import Trainer

    assert "self.current_gradient_accumulation_steps =" in inspect.getsource(Trainer)


def test_training_step_is_trl_and_transformers_own_with_the_loss_standing_in():
    """PCGrad's training_step is TRL's (which wraps transformers'), its ``compute_loss`` running
    PCGrad's backward passes: transformers' step must call ``compute_loss`` once and then
    ``accelerator.backward`` once, on what it returned (a leaf of its own, reaching no parameter;
    GRPO's loss is scaled for gradient accumulation already, so transformers does not divide it)."""
    import re

    from transformers import Trainer

    assert "super().training_step(model, inputs, num_items_in_batch)" in normalised(
        inspect.getsource(GRPOTrainer.training_step)
    )
    hf = inspect.getsource(Trainer.training_step)
    assert re.findall(r"self\.(compute_loss|accelerator\.backward)\(", hf) == ["compute_loss", "accelerator.backward"]
    assert GRPOTrainer.loss_is_scaled_for_ga is True
    # PCGrad runs each of its backward passes through accelerate's own backward, retaining the graph.
    from accelerate import Accelerator

    assert list(inspect.signature(Accelerator.backward).parameters) == ["self", "loss", "kwargs"]
    assert "loss.backward(**kwargs)" in inspect.getsource(Accelerator.backward)


@pytest.fixture(scope="module")
def adaptive(tiny_lm_path, tmp_path_factory):
    """A PCGrad trainer whose loss moves state: TRL's adaptive entropy controller (its
    coefficient applied: last entropy below the target; raised at every optimizer step)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    def acc(completions, **kw):
        return [float(len(c) % 2) for c in completions]

    def reason(completions, **kw):
        return [0.5] * len(completions)

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("adaptive")),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        beta=0.04,
        loss_type="grpo",
        bf16=False,
        use_cpu=True,
        report_to="none",
        max_steps=1,
        seed=0,
        entropy_coef=0.01,
        use_adaptive_entropy=True,
        entropy_target=100.0,
        entropy_coef_delta=0.5,
    )
    trainer = PCGradGRPOTrainer(
        model=str(tiny_lm_path),
        reward_funcs=[acc, reason],
        args=args,
        reward_objectives=["accuracy", "reasoning"],
        train_dataset=Dataset.from_dict({"prompt": ["q"] * 8}),
        processing_class=AutoTokenizer.from_pretrained(tiny_lm_path),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by HF's training loop; one micro-step: a boundary
    trainer._last_world_entropy = 0.0
    trainer.model.train()
    return trainer


def test_trls_loss_rebinds_only_the_entropy_controller_and_mutates_only_its_metrics(adaptive):
    """PCGrad sets back what TRL's loss rebinds, the adaptive entropy controller (attributes compared
    by identity: ENTROPY_CONTROLLER must name every one), and undoes its metrics (quiet_logs);
    anything else rebound or mutated in place would escape that."""
    import copy

    from crystal_grpo.train.pcgrad.trainer import ENTROPY_CONTROLLER

    def snapshot() -> dict:
        out = {}
        for k, v in vars(trainer).items():
            if k == "_metrics" or not isinstance(
                v, (torch.Tensor, int, float, str, bool, type(None), list, tuple, dict)
            ):
                continue
            try:
                out[k] = (v, copy.deepcopy(v))
            except Exception:  # noqa: BLE001 - not copyable: not state a loss keeps
                continue
        return out

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - containers of tensors: compare element-wise
            return (
                type(a) is type(b)
                and len(a) == len(b)
                and all(same(x, y) for x, y in (zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)))
            )

    trainer = adaptive
    batch = {**_batch(trainer), "advantages": torch.tensor([1.0, -2.0, 0.5, 0.0])}
    before = snapshot()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, batch)
    rebound = [k for k, (obj, _) in before.items() if vars(trainer).get(k) is not obj]
    assert "entropy_coef" in rebound, "the loss moved the controller (the precondition)"
    assert set(rebound) <= set(ENTROPY_CONTROLLER), rebound
    changed = [k for k, (obj, copied) in before.items() if vars(trainer).get(k) is obj and not same(obj, copied)]
    assert not changed, f"TRL's loss mutates {changed} in place"


def test_pcgrad_losses_see_and_leave_the_trainer_as_the_plain_loss_does(adaptive):
    """The objective losses and the rest see the state the plain loss saw (the controller's
    coefficient before its update) and the trainer ends as the plain loss alone leaves it."""
    from crystal_grpo.train.pcgrad.trainer import entropy_controller

    trainer = adaptive
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = 0.01, 0.0, None
    a, b = torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([0.3, 0.3, -1.0, 2.0])
    batch = {**_batch(trainer), "advantages": a + b, "advantages_acc": a, "advantages_reason": b}
    start = entropy_controller(trainer)
    counts = [{k: len(v) for k, v in trainer._metrics["train"].items()}]
    with torch.no_grad():
        alone = float(trainer.compute_loss(trainer.model, batch))
    left = {k: vars(trainer)[k] for k in ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")}
    assert left["entropy_coef"] == pytest.approx(0.51)  # the precondition: the plain loss moved it
    counts.append({k: len(v) for k, v in trainer._metrics["train"].items()})
    entropy_controller(trainer, start)
    plain, losses = trainer.pcgrad_losses(trainer.model, batch)
    assert set(losses) == {"accuracy", "reasoning", "rest"}
    assert float(plain) == pytest.approx(alone, rel=1e-6)
    assert float(sum(losses.values()).detach()) == pytest.approx(alone, rel=1e-5)  # the rest used the old coefficient
    assert {k: vars(trainer)[k] for k in left} == left
    # The extra losses logged nothing: the metrics grew as by the plain loss alone, not four times as much.
    counts.append({k: len(v) for k, v in trainer._metrics["train"].items()})
    assert {k: n - counts[1][k] for k, n in counts[2].items()} == {
        k: n - counts[0].get(k, 0) for k, n in counts[1].items()
    }


def test_quiet_logs_undo_what_a_round_and_a_loss_log(adaptive):
    """What TRL logs in a generation round (its metrics, the completions' table) and in a loss, it only
    adds to its containers, so quiet_logs can put them back: a refill round and PCGrad's extra losses
    log nothing, while the step's first round and plain loss keep what they logged."""
    from crystal_grpo.train.pcgrad.trainer import entropy_controller

    trainer = adaptive
    start = entropy_controller(trainer)

    def contents() -> tuple:
        metrics = {mode: {k: list(v) for k, v in m.items()} for mode, m in trainer._metrics.items()}
        logs = {
            k: {c: list(d) for c, d in v.items()} if isinstance(v, dict) else list(v) for k, v in trainer._logs.items()
        }
        return metrics, logs

    before = contents()
    with trainer.quiet_logs():
        trainer._generate_and_score_completions([{"prompt": "q"}] * 4)
        with torch.no_grad():
            trainer.compute_loss(trainer.model, {**_batch(trainer), "advantages": torch.tensor([1.0, -2.0, 0.5, 0.0])})
        logged = contents()
    entropy_controller(trainer, start)
    assert logged[0]["train"]["reward"] and logged[0]["train"]["entropy"] and logged[1]["completion"]  # precondition
    assert contents() == before


def test_the_loss_reads_its_terms_when_it_is_formed(adaptive):
    """TRL's loss reads ``beta``, ``_entropy_bonus_enabled`` and ``aux_loss_enabled`` when it is formed,
    and its ``__init__`` sets each once: the trainer's properties choose them per loss (LossTerms). On
    policy, the surrogate alone plus the rest (zero advantages, every term) is the whole loss."""
    from crystal_grpo.train.pcgrad.trainer import entropy_controller
    from crystal_grpo.train.trainer.grpo_trainer import SURROGATE_ONLY

    source = normalised(inspect.getsource(GRPOTrainer._compute_loss))
    for read in ("if self.beta != 0.0:", "if self._entropy_bonus_enabled:", "if self.aux_loss_enabled:"):
        assert read in source, read
    init = normalised(inspect.getsource(GRPOTrainer.__init__))
    for write in ("self.beta = args.beta", "self._entropy_bonus_enabled =", "self.aux_loss_enabled ="):
        assert init.count(write) == 1, write
    trainer = adaptive
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = 0.01, 0.0, None
    start = entropy_controller(trainer)
    assert trainer.beta == trainer.args.beta == 0.04 and trainer._entropy_bonus_enabled  # as TRL set them
    batch = {**_batch(trainer), "advantages": torch.tensor([1.0, -2.0, 0.5, 0.0])}
    with torch.no_grad(), trainer.quiet_logs():
        whole = float(trainer.loss(trainer.model, batch))
        entropy_controller(trainer, start)
        surrogate = float(trainer.loss(trainer.model, batch, SURROGATE_ONLY))
        rest = float(trainer.loss(trainer.model, {**batch, "advantages": torch.zeros(4)}))
    entropy_controller(trainer, start)
    assert abs(surrogate) > 1e-4 and abs(rest) > 1e-6  # the precondition: both parts are there
    assert whole == pytest.approx(surrogate + rest, rel=1e-5)
    assert trainer.beta == 0.04 and trainer._entropy_bonus_enabled  # back as TRL set them


def test_calculate_rewards_is_one_global_column_per_function_with_none_as_nan(trainer):
    inputs = [{"prompt": "q", "answer": "a"}] * 4
    out = trainer._calculate_rewards(inputs, ["q"] * 4, ["a", "bb", "ccc", "dddd"], [[1]] * 4)
    assert out.shape == (4, 2)
    assert out[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert torch.isnan(out[0, 1]) and out[1:, 1].tolist() == [0.5] * 3


def _batch(trainer) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 4, 2])[:, None]).long()
    batch = {
        "prompt_ids": torch.randint(20, vocab, (4, 6), generator=g),
        "prompt_mask": torch.ones(4, 6).long(),
        "completion_ids": torch.randint(20, vocab, (4, 5), generator=g),
        "completion_mask": mask,
    }
    batch["ref_per_token_logps"] = -5.0 + torch.randn(4, 5, generator=g)
    batch["num_items_in_batch"] = mask.sum()
    return batch


def test_compute_loss_uses_one_logps_call_and_reads_beta_and_advantages_at_call_time(trainer, monkeypatch):
    """What PCGrad's one-forward trick and its attribute swaps depend on."""
    batch = _batch(trainer)
    a, b = torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([0.3, 0.3, -1.0, 2.0])
    calls = []
    original = trainer._get_per_token_logps_and_entropies

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", counted)
    trainer.model.train()
    loss = lambda adv: float(trainer.compute_loss(trainer.model, {**batch, "advantages": adv}))
    with torch.no_grad():
        monkeypatch.setattr(trainer, "beta", 0.0)
        la, lb, lab = loss(a), loss(b), loss(a + b)
        assert calls == [1, 1, 1]  # exactly one log-prob computation per loss
        assert la + lb == pytest.approx(lab, rel=1e-5, abs=1e-7)  # linear in the advantages: the split is exact
        assert loss(torch.zeros(4)) == pytest.approx(0.0, abs=1e-7)  # beta = 0: no KL term
        monkeypatch.setattr(trainer, "beta", 0.04)
        kl = loss(torch.zeros(4))
        assert kl > 0  # the KL penalty alone, read from self.beta at call time
        assert loss(a) == pytest.approx(la + kl, rel=1e-5)  # KL adds to the surrogate


@pytest.mark.parametrize("loss_type", sorted(ROW_MEAN | TOKEN_COUNT | MICRO_BATCH_TOKEN_MEAN))
def test_each_loss_type_weighs_rows_by_tool_mask_as_dynamic_sampling_assumes(trainer, monkeypatch, loss_type):
    """What train/trainer/dynamic_sampling.py relies on: ``completion_mask * tool_mask`` weighs every term
    of TRL's loss (surrogate, KL, normaliser), and each loss_type's normaliser is of the family
    the module files it under. Two of four rows masked must give the loss of the other two alone."""
    batch = _batch(trainer)
    kept = torch.tensor([1, 1, 0, 0])
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "beta", 0.04)
    trainer.model.train()
    masked = {**batch, "advantages": adv, "tool_mask": kept.unsqueeze(1).expand_as(batch["completion_mask"])}
    if loss_type in TOKEN_COUNT:  # divided by num_items_in_batch: recounted over the kept tokens
        masked["num_items_in_batch"] = (batch["completion_mask"] * masked["tool_mask"]).sum()
    if loss_type in ROW_MEAN:  # a mean over rows: the surrogate and the KL term scaled by rows / kept rows
        masked["advantages"] = adv * 2
        monkeypatch.setattr(trainer, "beta", 0.08)
    alone = {k: (v[:2] if v.dim() else v) for k, v in {**batch, "advantages": adv}.items()}
    alone["num_items_in_batch"] = batch["completion_mask"][:2].sum()
    with torch.no_grad():
        got = float(trainer.compute_loss(trainer.model, masked))
        monkeypatch.setattr(trainer, "beta", 0.04)
        want = float(trainer.compute_loss(trainer.model, alone))
    assert got == pytest.approx(want, rel=1e-5) and abs(want) > 1e-4


@pytest.mark.parametrize("loss_type", sorted(ROW_MEAN | TOKEN_COUNT | MICRO_BATCH_TOKEN_MEAN))
def test_compute_loss_takes_per_token_advantages_token_by_token(trainer, monkeypatch, loss_type):
    """What train/trainer/step_credit.py relies on: TRL's loss reads ``(B, T)`` advantages token by
    token. A row's advantage at each of its tokens gives the loss and the gradient (with respect to
    each token's log-probability) of the ``(B,)`` advantage, and one token's own advantage moves that
    token's gradient alone; with sequence-level importance sampling it moves every token of its row
    (why reward.step_credit refuses it), unless the loss detaches the ratio."""
    batch = _batch(trainer)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    trainer.model.train()
    original = trainer._get_per_token_logps_and_entropies

    def kept(*args, **kwargs):
        out = original(*args, **kwargs)
        out[0].retain_grad()
        kept.logps = out[0]
        return out

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", kept)

    def run(advantages: torch.Tensor) -> tuple[float, torch.Tensor]:
        loss = trainer.compute_loss(trainer.model, {**batch, "advantages": advantages})
        loss.backward()
        trainer.model.zero_grad()
        return float(loss), kept.logps.grad.detach().clone()

    per_row, per_token = run(adv), run(adv.unsqueeze(1).expand_as(batch["completion_mask"]).clone())
    assert per_token[0] == pytest.approx(per_row[0], rel=1e-6) and torch.allclose(per_token[1], per_row[1])
    moved = adv.unsqueeze(1).expand_as(batch["completion_mask"]).clone()
    moved[0, 1] = -4.0
    changed = run(moved)[1] != per_row[1]
    assert changed[0, 1] and int(changed.sum()) == 1
    monkeypatch.setattr(trainer, "importance_sampling_level", "sequence")
    changed = run(moved)[1] != run(adv)[1]
    if loss_type in DETACHED_RATIO:
        assert changed[0, 1] and int(changed.sum()) == 1
    else:
        assert bool(changed[0, : int(batch["completion_mask"][0].sum())].all())


def test_the_calls_the_trainer_overrides_are_made_through_self():
    """Its ``_generate_and_score_completions`` is a step's whole generation batch (dynamic sampling's
    rounds inside), and its ``_calculate_rewards`` keeps what the round's advantages read: TRL must call
    each through self, once a generation."""
    assert "self._generate_and_score_completions(generation_batch)" in inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "self._calculate_rewards(" in inspect.getsource(GRPOTrainer._generate_and_score_completions)


def test_generation_output_carries_advantages_of_local_rows(trainer):
    trainer.model.train()
    trainer._log_metric("probe/value", 2.0)  # how CrystalGRPOTrainer logs the reward diagnostics
    out = trainer._generate_and_score_completions([{"prompt": "q"}] * 4)
    assert out["advantages"].shape == (4,)
    assert {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask"} <= set(out)
    assert trainer._metrics["train"]["probe/value"] == [2.0]  # flushed into the step's log by TRL


@pytest.mark.parametrize("module, lockfile", TABLES.items())
def test_training_schema_table_is_for_the_locked_versions(module, lockfile):
    """make lock renews each lock and its table (train/config/trl_fields_table.py,
    train/config/trl_fields_table_vllm.py) together."""
    import importlib

    from crystal_grpo import lock

    locked = lock.read(REPO / lockfile)
    assert importlib.import_module(f"crystal_grpo.train.config.{module}").VERSIONS == {
        name: locked[name] for name in ("trl", "transformers")
    }, f"train/config/{module}.py is not for {lockfile}: make lock"


def test_the_vllm_set_has_its_own_table_because_its_transformers_lacks_fields(monkeypatch):
    """The vLLM set shares requirements.lock's TRL but not its transformers (5.17 against 5.24),
    whose TrainingArguments lack activation_checkpointing: under the vLLM set's versions that
    key is refused at --check, not passed to a GRPOConfig that would fail on it at start."""
    from crystal_grpo import lock
    from crystal_grpo.train.config import training_section as trl_fields
    from crystal_grpo.train.config.run_config import ConfigError, load_config

    def installed(lockfile: str):  # whichever set this venv holds
        pins = lock.read(REPO / lockfile)
        monkeypatch.setattr(trl_fields, "installed_versions", lambda: {n: pins[n] for n in ("trl", "transformers")})

    installed("requirements-vllm.lock")
    assert (
        trl_fields.table().__name__ == "crystal_grpo.train.config.trl_fields_table_vllm"
        and trl_fields.table_is_current()
    )
    with pytest.raises(ConfigError, match="training: unknown key 'activation_checkpointing'"):
        load_config("tiny", ["--training.activation_checkpointing", "true"])
    installed("requirements.lock")
    assert trl_fields.table().__name__ == "crystal_grpo.train.config.trl_fields_table"
    assert load_config("tiny", ["--training.activation_checkpointing", "true"])[0].training["activation_checkpointing"]


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_training_schema_table_is_the_installed_configs_fields(kind):
    """The table (what a config is checked against without importing TRL) equals the installed
    GRPOConfig/SFTConfig type hints field for field, under the versions it is for (a lock's:
    train/config/trl_fields_table.py in make test, train/config/trl_fields_table_vllm.py in make test-vllm-set). Under
    others (make test-latest) the differences are the skip reason: what `make lock` would change."""
    from crystal_grpo.train.config.training_section import installed_versions, shape, table, training_field_types

    trl_schema = table()
    table = trl_schema.GRPO if kind == "grpo" else trl_schema.SFT
    hints = typing.get_type_hints(GRPOConfig if kind == "grpo" else trl.SFTConfig)
    differ = {
        k: (table.get(k), hints.get(k))
        for k in set(table) | set(hints)
        if k not in table or k not in hints or shape(table[k]) != shape(hints[k])
    }
    if trl_schema.VERSIONS != installed_versions():
        pytest.skip(
            f"table for {trl_schema.VERSIONS}, installed {installed_versions()}; fields that differ: "
            f"{sorted(set(differ) - {'parallelism_config'})}"
        )
    assert differ == {"parallelism_config": (dict | None, hints["parallelism_config"])}  # a mapping in YAML
    assert training_field_types(kind) is table
    assert table["lr_scheduler_type"] != hints["lr_scheduler_type"]  # the stand-in enum, same name and members


# TRL's vLLM mode (training.use_vllm: true) through this trainer. vLLM cannot run here (no GPU):
# these read TRL's code, or run TRL's own code with no vLLM engine behind it (docs/training.md,
# "Generation in vLLM", says which claim rests on what).


def _block(source: str, start: str, end: str) -> str:
    """The normalised source from ``start`` to ``end`` (both must be there, in that order)."""
    text = normalised(source)
    assert start in text and end in text.split(start, 1)[1], (start, end)
    return start + text.split(start, 1)[1].split(end, 1)[0]


def test_vllm_mode_syncs_the_weights_at_the_first_generation_after_an_optimizer_step():
    """TRL pushes the policy's weights to vLLM before it generates whenever ``global_step`` moved
    since the last push: after an optimizer step, whatever wrote its gradients (PCGrad's
    projection, the non-finite guard's skip), and only once per step, so dynamic sampling's
    refill rounds within a step generate from the same, already pushed weights. Nothing of this
    project moves ``global_step`` or ``_last_loaded_step``, and its one override of
    ``_generate_single_turn`` (LoRA merging, inert here: vLLM never calls ``generate``) defers to TRL's."""
    sync = (
        'if self.state.global_step != self._last_loaded_step: with profiling_context(self, "sync_weights"): '
        "self.vllm_generation.sync_weights() self._last_loaded_step = self.state.global_step"
    )
    single = _block(inspect.getsource(GRPOTrainer._generate_single_turn), "if self.use_vllm:", "elif self.")
    assert single.index(sync) < single.index("self.vllm_generation.generate(")
    assert "self._last_loaded_step = -1" in normalised(inspect.getsource(GRPOTrainer.__init__))
    ours = [p for folder in ("train", "crystal_grpo") for p in (REPO / folder).rglob("*.py")]
    assert not [p for p in ours if re.search(r"_last_loaded_step|global_step\s*[-+]?=(?!=)", p.read_text())]
    from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer

    assert "return super()._generate_single_turn(" in inspect.getsource(CrystalGRPOTrainer._generate_single_turn)


def test_vllm_weight_sync_pushes_the_merged_lora_weights_under_the_base_models_names(tiny_lm_path, trainer):
    """TRL's sync (``VLLMGeneration._iter_named_params``, its own code run here without an engine)
    merges a PeftModel's adapters before reading the weights: vLLM gets W + s*BA under the base
    model's parameter names, what a merged export holds. TRL merges in place (PEFT's
    merge/unmerge), not into a copy as train/models/lora_merge.py does for transformers' generate: the
    base weights come back to within a rounding step, not bit for bit (under ZeRO-3 the gathered
    copy is discarded instead)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_lm_path),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(0))  # B = 0 at init: the merge would change nothing
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): p for name, p in before.items()}
    engine = object.__new__(VLLMGeneration)  # its weight sync without _init_vllm, which needs vLLM
    engine.model, engine._dist = model, DistributedBackend(trainer.accelerator)
    pushed = {name: t.detach().clone() for name, t in engine._iter_named_params()}
    assert set(pushed) == set(merged)
    q = next(name for name in merged if "q_proj.weight" in name)
    assert not torch.allclose(merged[q], base[q])  # the precondition
    for name, weight in merged.items():
        torch.testing.assert_close(pushed[name], weight, rtol=0, atol=1e-6)
    assert not any(getattr(m, "merged", False) for m in model.modules())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=1e-6)


def test_vllm_generation_columns_survive_dynamic_samplings_refill():
    """Under vLLM, TRL's generation batch carries vLLM's log-probabilities and the importance
    sampling ratio; refill merges rounds by these columns' padding (train/trainer/dynamic_sampling.py),
    and a column it does not know would stop the run. The ratio is per token (B, T) or, in TRL's
    default sequence_mask mode, per sequence (B, 1): a merge of rounds of other widths keeps it so."""
    from crystal_grpo.train.trainer.dynamic_sampling import COMPLETION_FIELDS, merge_rows

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    vllm_columns = {"sampling_per_token_logps", "importance_sampling_ratio", "old_per_token_logps"}
    assert vllm_columns <= set(re.findall(r'output\["(\w+)"\] =', source)) & set(COMPLETION_FIELDS)
    assert GRPOConfig.__dataclass_fields__["vllm_importance_sampling_mode"].default == "sequence_mask"

    def batch(rows: int, width: int, ratio: float) -> dict:
        return {
            "completion_ids": torch.ones(rows, width, dtype=torch.long),
            "completion_mask": torch.ones(rows, width, dtype=torch.long),
            "sampling_per_token_logps": torch.full((rows, width), -1.0),
            "importance_sampling_ratio": torch.full((rows, 1), ratio),
            "advantages": torch.zeros(rows),
        }

    out = merge_rows(batch(4, 3, 1.0), batch(4, 5, 0.5), rows=[1, 2], new_rows=[0, 3], pad_id=0)
    assert out["importance_sampling_ratio"].tolist() == [[1.0], [0.5], [0.5], [1.0]]
    assert out["sampling_per_token_logps"].shape == (4, 5) and out["sampling_per_token_logps"][0, 3:].eq(0).all()


def test_vllm_importance_sampling_weighs_each_pcgrad_loss_as_the_plain_loss(adaptive):
    """TRL 1.16 (vllm_importance_sampling_correction, on by default) multiplies the per-token
    surrogate by the batch's ``importance_sampling_ratio`` (vLLM's against the trainer's
    log-probabilities, made at generation, before any advantage). PCGrad's losses get the batch
    with only the advantages replaced, so each objective's surrogate is corrected alike and
    they still add up to the corrected plain loss (KL and entropy, in the rest, uncorrected as
    in TRL)."""
    from crystal_grpo.train.pcgrad.trainer import entropy_controller

    trainer = adaptive
    trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = 0.01, 0.0, None
    a, b = torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([0.3, 0.3, -1.0, 2.0])
    batch = {
        **_batch(trainer),
        "advantages": a + b,
        "advantages_acc": a,
        "advantages_reason": b,
        "importance_sampling_ratio": torch.tensor([[0.5], [2.0], [1.0], [0.25]]),
    }
    start = entropy_controller(trainer)
    assert not trainer.use_vllm and trainer.vllm_importance_sampling_correction  # TRL's default, off without vLLM
    with torch.no_grad():
        uncorrected = float(trainer.compute_loss(trainer.model, batch))
    entropy_controller(trainer, start)
    trainer.use_vllm = True
    try:
        with torch.no_grad():
            alone = float(trainer.compute_loss(trainer.model, batch))
        entropy_controller(trainer, start)
        plain, losses = trainer.pcgrad_losses(trainer.model, batch)
    finally:
        trainer.use_vllm = False
        entropy_controller(trainer, start)
    assert abs(alone - uncorrected) > 1e-3  # the precondition: the ratio changes the loss
    assert float(plain) == pytest.approx(alone, rel=1e-6)
    assert float(sum(losses.values()).detach()) == pytest.approx(alone, rel=1e-5)


# -- the seams table (train/trainer/trl_seams.py) ---------------------------------------------

PRIVATE = re.compile(r"^_[a-z][a-z0-9_]*$")
#: The library's modules whose contact with TRL the table lists (tools and benchmarks measure, and
#: may wrap TRL for that; they are not the trainer).
SEAM_SCOPE = (
    "train/grpo.py",
    "train/trainer",
    "train/pcgrad",
    "train/models",
    "train/run",
    "train/config",
    "train/data",
)


def trl_private_names() -> set[str]:
    """The private methods and ``self._x`` attributes of TRL's and transformers' trainer classes."""
    from trl import SFTTrainer

    names = set()
    for cls in {*GRPOTrainer.__mro__, *SFTTrainer.__mro__}:
        if cls.__module__.split(".")[0] in ("trl", "transformers"):
            names |= {n for n in vars(cls) if PRIVATE.match(n)}
            names |= set(re.findall(r"self\.(_[a-z][a-z0-9_]*)\s*=", inspect.getsource(cls)))
    return names


def touched_private_names(theirs: set[str]) -> set[tuple[str, str]]:
    """(name, module) for every name of ``theirs`` a module in scope defines, reads, writes or spells
    as a string (``setattr(self, "_x", ...)``)."""
    import ast

    files = [REPO / s for s in SEAM_SCOPE if s.endswith(".py")]
    files += [p for s in SEAM_SCOPE if not s.endswith(".py") for p in sorted((REPO / s).glob("*.py"))]
    files = [p for p in files if p.name != "trl_seams.py"]  # the table names them all
    out = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.name
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                else node.value
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                else None
            )
            if name in theirs:
                out.add((name, path.relative_to(REPO).as_posix()))
    return out


def test_every_private_trl_name_the_trainer_touches_has_a_row_in_the_seams_table():
    """A new override, read or swap of a TRL / transformers private name gets a row in
    train/trainer/trl_seams.py (with the test that pins it), and a row whose use is gone goes."""
    from crystal_grpo.train.trainer.trl_seams import SEAMS

    theirs = trl_private_names()
    assert {"_calculate_rewards", "_metrics", "_save_checkpoint"} <= theirs
    rows = {(s.name, s.module) for s in SEAMS}
    assert len(rows) == len(SEAMS), "one row per name and module"
    touched = touched_private_names(theirs)
    assert sorted(touched - rows) == [], "touched without a row in train/trainer/trl_seams.py"
    assert sorted(rows - touched) == [], "rows whose module no longer touches the name"


def test_each_seam_names_a_contract_test_of_this_file_that_exists():
    from crystal_grpo.train.trainer.trl_seams import PUBLIC, SEAMS

    here = {name for name, obj in globals().items() if name.startswith("test_") and callable(obj)}
    assert sorted({s.test for s in (*SEAMS, *PUBLIC)} - here) == []
    for s in PUBLIC:  # a public attribute of TRL's trainer, spelled in its module
        assert s.name in (REPO / s.module).read_text(encoding="utf-8"), s


def trl_public_attributes() -> set[str]:
    """The public attributes TRL's and transformers' trainer classes set on themselves (``self.x =``)."""
    from trl import SFTTrainer

    names = set()
    for cls in {*GRPOTrainer.__mro__, *SFTTrainer.__mro__}:
        if cls.__module__.split(".")[0] in ("trl", "transformers"):
            names |= set(re.findall(r"self\.([a-z][a-z0-9_]*)\s*=[^=]", inspect.getsource(cls)))
    return names


def test_every_public_trl_attribute_the_trainer_overrides_or_writes_has_a_row():
    """A module in scope that writes (``self.x = ...``, or names it to set it by string) or overrides
    (a property) one of TRL's public trainer attributes has a row in the table's ``PUBLIC``."""
    import ast

    from crystal_grpo.train.trainer.trl_seams import PUBLIC

    theirs = trl_public_attributes()
    assert {"beta", "control", "entropy_coef"} <= theirs
    files = [REPO / s for s in SEAM_SCOPE if s.endswith(".py")]
    files += [p for s in SEAM_SCOPE if not s.endswith(".py") for p in sorted((REPO / s).glob("*.py"))]
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [
                    t.attr for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self"
                ]
                if isinstance(node.value, ast.Tuple):  # a tuple of names to set by string
                    names += [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
            elif isinstance(node, ast.FunctionDef) and any(
                getattr(d, "id", "") == "property" for d in node.decorator_list
            ):
                names = [node.name]
            found |= {(n, path.relative_to(REPO).as_posix()) for n in names if n in theirs}
    assert sorted(found ^ {(s.name, s.module) for s in PUBLIC}) == []


def test_each_trainer_is_at_most_three_classes_of_ours_and_overrides_each_trl_method_once():
    """What a maintainer reads: each trainer's classes of ours come first in its MRO, at most three of
    them, and no TRL / transformers method or attribute is overridden in more than one of them (the
    hooks PCGrad's subclass uses are the base trainer's own); nothing is swapped at run time."""
    import typing

    from trl import SFTTrainer

    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer
    from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer
    from crystal_grpo.train.trainer.sft import CrystalSFTTrainer
    from crystal_grpo.train.trainer.trl_seams import How

    for cls, theirs in (
        (CrystalGRPOTrainer, GRPOTrainer),
        (PCGradGRPOTrainer, GRPOTrainer),
        (CrystalSFTTrainer, SFTTrainer),
    ):
        ours = [c for c in cls.__mro__ if c.__module__.startswith("crystal_grpo.")]
        assert len(ours) <= 3 and cls.__mro__[: len(ours)] == tuple(ours), cls.__mro__
        names = {n for c in theirs.__mro__ if c is not object for n in vars(c) if not n.startswith("__")}
        twice = {n: [c.__name__ for c in ours if n in vars(c)] for n in sorted(names)}
        assert {n: where for n, where in twice.items() if len(where) > 1} == {}, cls
    assert "swap" not in typing.get_args(How)


def test_a_planted_private_override_is_found(tmp_path, monkeypatch):
    """The scan above can fail: a module in scope overriding TRL's ``_get_eval_sampler``."""
    planted = "/".join(("train", "x.py"))  # spelled apart: the check of named paths would look for it
    (tmp_path / "train").mkdir()
    (tmp_path / planted).write_text("class M:\n    def _get_eval_sampler(self):\n        pass\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    monkeypatch.setattr(f"{__name__}.SEAM_SCOPE", (planted,))
    assert touched_private_names(trl_private_names()) == {("_get_eval_sampler", planted)}
