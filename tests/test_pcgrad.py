"""PCGrad (train/pcgrad.py): hand-computed projections, the objective advantages, the
trainer hook on a fixed batch (against plain TRL GRPO runs, and the same update in one
process, two DDP processes and two DeepSpeed ZeRO-3 processes on CPU), and short
end-to-end runs of train/grpo.py with ``pcgrad: true`` (full fine-tuning and LoRA).

Run as a script (``torchrun ... tests/test_pcgrad.py MODE MODEL OUT CASES``) this file is
also the worker of the multi-process tests.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.train.pcgrad import (
    objective_advantages,
    pcgrad_coefficients,
    pcgrad_stats,
    project_conflicting,
)


# ----------------------------------------------------------------------------- pure maths
def test_projection_by_hand_conflicting():
    g_acc, g_reason = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])
    # dot = -1, |g_acc|^2 = 1, |g_reason|^2 = 2
    # g_acc'    = (1, 0) - (-1/2)(-1, 1) = (0.5, 0.5)
    # g_reason' = (-1, 1) - (-1/1)(1, 0) = (0, 1)
    combined, cos = project_conflicting(g_acc, g_reason)
    assert torch.allclose(combined, torch.tensor([0.5, 1.5]))
    assert cos == pytest.approx(-1 / math.sqrt(2))
    # Each projected gradient is orthogonal to the other's original one.
    assert float(torch.dot(torch.tensor([0.5, 0.5]), g_reason)) == pytest.approx(0.0)
    assert float(torch.dot(torch.tensor([0.0, 1.0]), g_acc)) == pytest.approx(0.0)


def test_projection_by_hand_three_dims_and_opposite():
    g_acc, g_reason = torch.tensor([2.0, 1.0, 0.0]), torch.tensor([-1.0, 0.0, 3.0])
    # dot = -2, |a|^2 = 5, |r|^2 = 10: a' = a + 0.2 r = (1.8, 1, 0.6); r' = r + 0.4 a = (-0.2, 0.4, 3)
    combined, cos = project_conflicting(g_acc, g_reason)
    assert torch.allclose(combined, torch.tensor([1.6, 1.4, 3.6]))
    assert cos == pytest.approx(-2 / math.sqrt(50))
    # Exactly opposite gradients cancel completely.
    combined, cos = project_conflicting(torch.tensor([1.0, 2.0]), torch.tensor([-2.0, -4.0]))
    assert torch.allclose(combined, torch.zeros(2), atol=1e-6) and cos == pytest.approx(-1.0)


def test_no_conflict_is_the_plain_sum():
    g_acc, g_reason = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, 1.0, 5.0])
    combined, cos = project_conflicting(g_acc, g_reason)
    assert torch.equal(combined, g_acc + g_reason) and cos > 0
    combined, cos = project_conflicting(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))  # orthogonal
    assert torch.equal(combined, torch.tensor([1.0, 1.0])) and cos == 0.0
    combined, cos = project_conflicting(torch.zeros(3), torch.tensor([1.0, 0.0, 0.0]))  # a zero gradient
    assert torch.equal(combined, torch.tensor([1.0, 0.0, 0.0])) and cos == 0.0


def test_coefficients_and_stats_match_the_vector_form():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a, r = torch.randn(50, generator=gen, dtype=torch.float64), torch.randn(50, generator=gen, dtype=torch.float64)
        combined, cos = project_conflicting(a, r)
        dot, sa, sr = float(a @ r), float(a @ a), float(r @ r)
        ca, cr = pcgrad_coefficients(dot, sa, sr)
        assert torch.allclose(combined, ca * a + cr * r)
        st = pcgrad_stats(dot, sa, sr)
        assert st["cosine"] == pytest.approx(cos)
        assert st["conflict"] == float(dot < 0)
        assert st["norm_acc"] == pytest.approx(float(a.norm())) and st["norm_reason"] == pytest.approx(float(r.norm()))
        frac = float((combined - a - r).norm() / (a + r).norm())
        assert st["projected_fraction"] == pytest.approx(frac, abs=1e-9)


# ----------------------------------------------------------------------------- advantages
OBJ = ["accuracy", "reasoning", "accuracy"]


def test_objective_advantages_by_hand():
    # Two groups of 2. Columns: answer (acc), steps (reason), format (acc).
    r = torch.tensor([[1.0, 0.2, 0.1],
                      [0.0, 0.6, 0.1],
                      [0.0, 0.0, 0.0],
                      [0.0, 0.4, 0.0]])
    w = torch.ones(3)
    acc, reason, total = objective_advantages(r, OBJ, w, num_generations=2)
    # group 1: totals 1.3, 0.7 -> mean 1.0, std (Bessel) = 0.6/sqrt(2); acc parts 1.1, 0.1 (mean 0.6);
    # reason parts 0.2, 0.6 (mean 0.4)
    s1 = 0.6 / math.sqrt(2) + 1e-4
    s2 = 0.4 / math.sqrt(2) + 1e-4
    assert acc.tolist() == pytest.approx([0.5 / s1, -0.5 / s1, 0.0, 0.0])
    assert reason.tolist() == pytest.approx([-0.2 / s1, 0.2 / s1, -0.2 / s2, 0.2 / s2])
    assert (acc + reason).tolist() == pytest.approx(total.tolist())
    assert total.tolist() == pytest.approx([0.3 / s1, -0.3 / s1, -0.2 / s2, 0.2 / s2])


def _trl_advantages(r, w, G, scale):
    """TRL 1.16's sum_then_normalize, written out (grpo_trainer._generate_and_score_completions)."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(r).all(dim=1)
    rewards = (r * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_objective_advantages_add_up_to_trl(scale):
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(24, 3, generator=gen)
    r[torch.rand(24, 3, generator=gen) < 0.25] = torch.nan  # "not applicable" components
    r[5] = torch.nan  # an unscorable completion
    r[8:12] = 0.5  # a group with zero std
    w = torch.tensor([1.0, 0.5, 2.0])
    acc, reason, total = objective_advantages(r, OBJ, w, num_generations=4, scale_rewards=scale)
    trl = _trl_advantages(r, w, 4, scale)
    assert torch.allclose(total, trl.double(), atol=1e-5)
    assert torch.allclose(acc + reason, trl.double(), atol=1e-5)
    assert acc[5] == 0 and reason[5] == 0
    assert torch.all(acc[8:12] == 0) and torch.all(reason[8:12] == 0)
    # each objective is centred within its group (over the scorable rows)
    ok = ~torch.isnan(r).all(dim=1)
    for part in (acc, reason):
        for g in range(6):
            rows = [i for i in range(4 * g, 4 * g + 4) if ok[i]]
            assert float(part[rows].sum()) == pytest.approx(0.0, abs=1e-6)


def test_objective_advantages_own_std_and_single_objective():
    gen = torch.Generator().manual_seed(2)
    r = torch.rand(8, 3, generator=gen)
    acc, reason, _ = objective_advantages(r, OBJ, torch.ones(3), 4, objective_std=True)
    for part in (acc, reason):  # unit std per group (up to the 1e-4)
        assert torch.allclose(part.view(2, 4).std(dim=1), torch.ones(2, dtype=torch.float64), atol=1e-3)
    acc, reason, total = objective_advantages(r, ["accuracy"] * 3, torch.ones(3), 4)
    assert torch.equal(reason, torch.zeros(8, dtype=torch.float64)) and torch.allclose(acc, total)
    with pytest.raises(ValueError):
        objective_advantages(r, ["accuracy", "style", "accuracy"], torch.ones(3), 4)


# ----------------------------------------------------------------------------- a reward for these tests
class HashReward(RewardModule):
    """A cheap reward with both objectives whose values vary across completions (a random
    tiny model never writes valid JSON, so the paper rewards would all be 0): C and F of the
    evaluation are replaced by numbers hashed from the completion's text."""

    name = "hash"
    objectives = {"hash_accuracy": "accuracy", "hash_reasoning": "reasoning"}
    uses_steps = False

    def score(self, completions, rows, with_steps=None):
        scored = super().score(completions, rows, with_steps=False)
        h = torch.tensor([zlib.crc32((c if isinstance(c, str) else json.dumps(c)).encode()) for c in completions],
                         dtype=torch.float64)
        scored.batch.correct, scored.batch.format_ok = h % 2, (h // 7 % 10) / 10
        return scored

    def components(self, batch):
        return {"hash_accuracy": batch.correct, "hash_reasoning": batch.format_ok}


# ----------------------------------------------------------------------------- fixed-batch trainer runs
N_GLOBAL, PROMPT_LEN, COMP_LEN = 8, 6, 5
LENGTHS = [5, 3, 4, 5, 2, 5, 4, 1]
BETA = 0.04


def fixed_batch(model, vocab: int, kind: str) -> dict[str, torch.Tensor]:
    """A global batch of 8 completions (2 prompts x 4). Prompts have no padding and
    completions are right-padded, so a row's log-probs do not depend on its neighbours.

    The reference log-probs lie within about 0.3 nats of the policy's own. Arbitrary ones
    (a KL of thousands of nats per token) make the KL gradient a small difference of huge
    per-token terms, whose float32 rounding (about 3e-5 relative) would blur the exact
    identities these tests check."""
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(20, vocab, (N_GLOBAL, PROMPT_LEN), generator=g),
        "prompt_mask": torch.ones(N_GLOBAL, PROMPT_LEN, dtype=torch.long),
        "completion_ids": torch.randint(20, vocab, (N_GLOBAL, COMP_LEN), generator=g),
        "completion_mask": (torch.arange(COMP_LEN)[None] < torch.tensor(LENGTHS)[:, None]).long(),
    }
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1:-1].float()
        logps = logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    batch["ref_per_token_logps"] = logps + 0.3 * torch.randn(N_GLOBAL, COMP_LEN, generator=g)
    acc = torch.randn(N_GLOBAL, generator=g)
    noise = torch.randn(N_GLOBAL, generator=g)
    reason = {"conflict": -0.6 * acc + 0.5 * noise, "aligned": 0.5 * acc}[kind]
    batch.update(advantages=acc + reason, advantages_acc=acc, advantages_reason=reason)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    return batch


# name -> (advantage kind, pcgrad, which advantages TRL sees, beta)
CASES = {
    "pcgrad": ("conflict", True, "advantages", BETA),
    "plain": ("conflict", False, "advantages", BETA),
    "acc_only": ("conflict", False, "advantages_acc", 0.0),
    "reason_only": ("conflict", False, "advantages_reason", 0.0),
    "kl_only": ("conflict", False, None, BETA),
    "aligned_pcgrad": ("aligned", True, "advantages", BETA),
    "aligned_plain": ("aligned", False, "advantages", BETA),
}


def run_cases(mode: str, model_path: str, out_file: str, cases: list[str], workdir: str) -> None:
    """One optimizer step (SGD, lr 1, no clipping, 2 accumulation micro-steps) per case on
    the fixed batch, through the real training loop; saves each weight delta (= -update)
    and the logged pcgrad metrics."""
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from crystal_grpo.train.pcgrad import trainer_class

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # named_parameters, not the state dict: tied weights (embeddings / lm_head) count once.
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    initial = {k: v.detach().clone() for k, v in policy.named_parameters()}
    extra: dict = {}
    if mode == "zero3":  # ZeRO-3 on CPU: gloo, set up before the training arguments (train/grpo.py setup_distributed)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        extra.update(use_cpu=False, deepspeed=str(REPO_ROOT / "configs" / "accelerate" / "zero3.json"),
                     accelerator_config={"use_configured_state": True})
    elif mode == "ddp":  # cpu=True: without it the state is DistributedType.NO (no DDP wrapping, no gather)
        PartialState(cpu=True, backend="gloo")
        extra.update(use_cpu=True, accelerator_config={"use_configured_state": True})
    tok = AutoTokenizer.from_pretrained(model_path)
    vocab = min(len(tok), AutoConfig.from_pretrained(model_path).vocab_size)

    results = {}
    for name in cases:
        kind, pcgrad, adv_key, beta = CASES[name]
        batch = fixed_batch(policy, vocab, kind)
        if adv_key is None:
            batch["advantages"] = torch.zeros(N_GLOBAL)
        else:
            batch["advantages"] = batch[adv_key].clone()

        class FixedBatchTrainer(trainer_class(pcgrad)):
            """Generation replaced by the fixed batch (this process's rows); everything
            after it (shuffle, split, loss, backward, PCGrad, optimizer) is the real loop."""

            def _generate_and_score_completions(self, inputs):
                n = len(inputs)
                mine = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
                return {k: (v[mine] if v.dim() else v).to(self.accelerator.device) for k, v in batch.items()}

        args = GRPOConfig(
            output_dir=os.path.join(workdir, f"{mode}-{name}"), per_device_train_batch_size=4 // world,
            gradient_accumulation_steps=2, num_generations=4, max_steps=1, learning_rate=1.0, optim="sgd",
            lr_scheduler_type="constant", max_grad_norm=0.0, beta=beta, loss_type="grpo", scale_rewards="group",
            bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1,
            disable_tqdm=True, seed=0, max_completion_length=COMP_LEN, remove_unused_columns=False, **extra)
        trainer = FixedBatchTrainer(
            model=model_path, reward=HashReward(), args=args,
            train_dataset=Dataset.from_dict({"prompt": ["q"] * 16}), processing_class=tok)
        trainer.train()
        if mode == "ddp":
            assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if trainer.accelerator.is_main_process:
            delta = {k: (state[k].float().cpu() - initial[k].float()) for k in initial if k in state}
            logs = {k: v for row in trainer.state.log_history for k, v in row.items() if k.startswith("pcgrad/")}
            results[name] = {"delta": delta, "logs": logs}
        trainer.accelerator.wait_for_everyone()
        del trainer
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_file)


def _flat(delta: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([delta[k].reshape(-1) for k in sorted(delta)]).double()


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Relative error in norm: weight deltas carry float32 rounding of the weights."""
    err = float((got - want).norm() / want.norm())
    assert err < rel, f"relative error {err:.3g}"


@pytest.fixture(scope="module")
def pcg_model(tiny_lm_path) -> Path:
    return Path(tiny_lm_path)


def _launch(mode: str, model: Path, out: Path, cases: list[str], workdir: Path) -> dict:
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": ext}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, mode, str(model), str(out), ",".join(cases), str(workdir)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and out.exists(), (proc.stdout[-3000:] + proc.stderr[-6000:])
    return torch.load(out)


@pytest.fixture
def one_thread():
    """Tiny models on a small shared CPU run far faster single-threaded (OpenMP threads
    stall whenever another process holds a core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def single(pcg_model, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("single")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_cases("single", str(pcg_model), str(work / "single.pt"), list(CASES), str(work))
    finally:
        torch.set_num_threads(n)
    return torch.load(work / "single.pt")


def test_projected_update_matches_projection_of_plain_trl_gradients(single):
    # lr 1 SGD without clipping: delta = -update. Plain TRL runs give each gradient alone.
    g_acc, g_reason = -_flat(single["acc_only"]["delta"]), -_flat(single["reason_only"]["delta"])
    g_kl = -_flat(single["kl_only"]["delta"])
    combined, cos = project_conflicting(g_acc, g_reason)
    update = -_flat(single["pcgrad"]["delta"])
    assert cos < -0.1, "the fixed batch is built to conflict"
    assert_close(update, combined + g_kl)
    logs = single["pcgrad"]["logs"]
    assert logs["pcgrad/cosine"] == pytest.approx(cos, abs=1e-4)
    assert logs["pcgrad/conflict"] == 1.0
    assert logs["pcgrad/norm_acc"] == pytest.approx(float(g_acc.norm()), rel=1e-4)
    assert logs["pcgrad/norm_reason"] == pytest.approx(float(g_reason.norm()), rel=1e-4)
    frac = float((combined - g_acc - g_reason).norm() / (g_acc + g_reason).norm())
    assert logs["pcgrad/projected_fraction"] == pytest.approx(frac, rel=1e-3)
    assert logs["pcgrad/overhead_seconds"] >= 0
    # ... and the projection changed the update: it is not plain GRPO's.
    plain = -_flat(single["plain"]["delta"])
    assert (update - plain).norm() > 0.1 * plain.norm()
    assert not single["plain"]["logs"], "pcgrad: false is plain TRL GRPO (no PCGrad metrics)"
    # Plain GRPO's gradient is the sum of the three parts (the surrogate is linear on-policy).
    assert_close(plain, g_acc + g_reason + g_kl)


def test_without_conflict_the_update_equals_plain_grpo(single):
    update, plain = -_flat(single["aligned_pcgrad"]["delta"]), -_flat(single["aligned_plain"]["delta"])
    assert single["aligned_pcgrad"]["logs"]["pcgrad/conflict"] == 0.0
    assert single["aligned_pcgrad"]["logs"]["pcgrad/cosine"] == pytest.approx(1.0, abs=1e-4)
    assert single["aligned_pcgrad"]["logs"]["pcgrad/projected_fraction"] == 0.0
    assert float(update.norm()) > 0
    assert_close(update, plain)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_same_update_in_two_processes(mode, single, pcg_model, tmp_path):
    two = _launch(mode, pcg_model, tmp_path / f"{mode}.pt", ["pcgrad"], tmp_path)
    ref, got = _flat(single["pcgrad"]["delta"]), _flat(two["pcgrad"]["delta"])
    assert_close(got, ref)
    for key, value in single["pcgrad"]["logs"].items():
        if key != "pcgrad/overhead_seconds":
            assert two["pcgrad"]["logs"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("lora", [False, True])
def test_end_to_end_with_pcgrad(tmp_path, pcg_model, monkeypatch, lora, one_thread):
    from crystal_grpo import rewards
    from crystal_grpo.train import grpo

    monkeypatch.setitem(rewards.REWARDS, "cpr", HashReward)  # tiny.yaml's reward, swapped
    out = tmp_path / "run"
    argv = ["--config", "tiny.yaml", "--output_dir", str(out), "--model.name_or_path", str(pcg_model),
            "--pcgrad", "true", "--validation.eval_steps", "0",
            "--training.max_steps", "2", "--training.gradient_accumulation_steps", "2",
            "--training.save_strategy", "'no'"]
    if lora:
        argv += ["--model.lora", "{r: 8, alpha: 16, dropout: 0.0, target_modules: all-linear}"]
    assert grpo.main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "pcgrad/cosine" in r]
    assert len(rows) == 2
    for r in rows:
        for key in ("cosine", "conflict", "norm_acc", "norm_reason", "projected_fraction", "overhead_seconds"):
            assert math.isfinite(r[f"pcgrad/{key}"]), key
        assert -1.0 <= r["pcgrad/cosine"] <= 1.0
    assert any(r["pcgrad/norm_acc"] > 0 and r["pcgrad/norm_reason"] > 0 for r in rows)


def test_unsupported_aggregation_is_refused(pcg_model, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    from crystal_grpo.train.pcgrad import PCGradGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      multi_objective_aggregation="normalize_then_sum", report_to="none", bf16=False,
                      use_cpu=True, max_steps=1)
    with pytest.raises(ValueError, match="sum_then_normalize"):
        PCGradGRPOTrainer(model=str(pcg_model), reward=HashReward(), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["q"] * 4}))


def test_only_pcgrad_runs_get_the_pcgrad_trainer_and_liger_is_refused(pcg_model, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    from crystal_grpo.train.pcgrad import PCGradGRPOTrainer, PCGradMixin
    from crystal_grpo.train.pcgrad import trainer_class
    from crystal_grpo.train.trainer import CrystalGRPOTrainer

    assert trainer_class(False) is CrystalGRPOTrainer and PCGradMixin not in CrystalGRPOTrainer.__mro__
    assert trainer_class(True) is PCGradGRPOTrainer and issubclass(PCGradGRPOTrainer, CrystalGRPOTrainer)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      use_liger_kernel=True, report_to="none", bf16=False, use_cpu=True, max_steps=1)
    with pytest.raises(ValueError, match="cannot be combined with use_liger_kernel"):
        PCGradGRPOTrainer(model=str(pcg_model), reward=HashReward(), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["q"] * 4}))


if __name__ == "__main__":  # worker of test_same_update_in_two_processes
    mode, model, out, cases, workdir = sys.argv[1:6]
    torch.set_num_threads(1)
    run_cases(mode, model, out, cases.split(","), workdir)
