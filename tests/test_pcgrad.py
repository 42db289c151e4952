"""PCGrad (train/pcgrad*.py): hand-computed projections, the objective advantages, the
accumulation window against the first implementation's maths (every memory plan, the rows it
allocates counted by torch), the trainer hook on a fixed batch (against plain TRL GRPO runs
and the first implementation's maths, and the same update in one process, two DDP processes
and two DeepSpeed ZeRO-3 processes on CPU), and short end-to-end runs of train/grpo.py with
``pcgrad: true`` (full fine-tuning and LoRA).

Run as a script (``torchrun ... tests/test_pcgrad.py PLAN MODEL WORKDIR``, PLAN a JSON
``{mode: cases}``) this file is also the worker of the multi-process tests.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crystal_grpo.train.benchmarks.pcgrad import (
    COMP_LEN,
    MEASURING,
    N_GLOBAL,
    AllocationPeak,
    HashReward,
    fixed_batch,
    fixed_batch_trainer,
    topology_args,
)
from crystal_grpo.train.pcgrad.gradients import AccumulationWindow
from crystal_grpo.train.pcgrad.memory import ACCURACY, REASONING, REST, pcgrad_plan
from crystal_grpo.train.pcgrad.trainer import (
    objective_advantages,
    pcgrad_coefficients,
    pcgrad_extra_partitions,
    pcgrad_stats,
    project_conflicting,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


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
    r = torch.tensor([[1.0, 0.2, 0.1], [0.0, 0.6, 0.1], [0.0, 0.0, 0.0], [0.0, 0.4, 0.0]])
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


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_whose_total_is_flat_gets_zero_objective_advantages(scale):
    """Accuracy and reasoning vary in the first two groups but cancel: their total is the same in
    every row (0.75 exactly; 0.9 up to float32 rounding, std ~3e-8). TRL gives such a group zero
    advantage, so its parts are zero too (the second group's: its tiny total advantage, split
    evenly), not its deviations divided by the total's std + 1e-4 (~1e3 each). The third group
    is untouched; pcgrad_objective_std (each part by its own std) keeps the flat groups' parts."""
    from trl.trainer.utils import nanstd

    r = torch.tensor(
        [
            [0.75, 0.0, 0.0],
            [0.5, 0.25, 0.0],
            [0.25, 0.5, 0.0],
            [0.0, 0.75, 0.0],
            [0.9, 0.0, 0.0],
            [0.6, 0.3, 0.0],
            [0.3, 0.6, 0.0],
            [0.0, 0.9, 0.0],
            [1.0, 0.2, 0.1],
            [0.0, 0.6, 0.1],
            [0.0, 0.0, 0.0],
            [0.0, 0.4, 0.0],
        ]
    )
    w = torch.ones(3)
    totals = (r.double() * w.double()).sum(dim=1).view(3, 4)
    assert nanstd(totals[0]) == 0 and 0 < nanstd(totals[1]) < 1e-7 < nanstd(totals[2])  # by construction
    acc, reason, total = objective_advantages(r, OBJ, w, num_generations=4, scale_rewards=scale)
    assert torch.equal(acc[:4], torch.zeros(4, dtype=torch.float64)) and torch.equal(reason[:4], acc[:4])
    assert acc[4:8].abs().max() < 1e-3 and torch.equal(acc[4:8], reason[4:8])
    # TRL sums in float32: on the float32-flat group its advantage differs by up to 6e-4 (noise / 1e-4)
    assert torch.allclose(total, _trl_advantages(r, w, 4, scale).double(), atol=1e-3)
    assert torch.equal(acc[:8] + reason[:8], total[:8]) and torch.allclose(acc + reason, total, rtol=0, atol=1e-12)
    kept = objective_advantages(r[8:], OBJ, w, 4, scale) if scale != "batch" else (acc[8:], reason[8:])
    assert torch.equal(acc[8:], kept[0]) and torch.equal(reason[8:], kept[1]) and acc[8:].abs().max() > 0.1
    own_acc, own_reason, _ = objective_advantages(r, OBJ, w, 4, scale_rewards=scale, objective_std=True)
    assert 0.1 < own_acc[:8].abs().max() < 5 and torch.equal(own_acc[:8].sign(), -own_reason[:8].sign())


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


# ----------------------------------------------------------------------------- fixed-batch trainer runs
BETA = 0.04


# name -> (advantage kind, pcgrad, which advantages TRL sees, beta, gradient accumulation steps)
CASES = {
    "pcgrad": ("conflict", True, "advantages", BETA, 2),
    "plain": ("conflict", False, "advantages", BETA, 2),
    "acc_only": ("conflict", False, "advantages_acc", 0.0, 2),
    "reason_only": ("conflict", False, "advantages_reason", 0.0, 2),
    "kl_only": ("conflict", False, None, BETA, 2),
    "aligned_pcgrad": ("aligned", True, "advantages", BETA, 2),
    "aligned_plain": ("aligned", False, "advantages", BETA, 2),
    # each of PCGrad's memory plans (train/pcgrad/memory.py): one micro-step with and without a KL
    # term, several micro-steps without one (several with one: "pcgrad")
    "pcgrad_k1": ("conflict", True, "advantages", BETA, 1),
    "pcgrad_k1_beta0": ("conflict", True, "advantages", 0.0, 1),
    "pcgrad_beta0": ("conflict", True, "advantages", 0.0, 2),
}
#: ZeRO-3 with a bf16 gradient buffer (DeepSpeed bf16's default): the paper configs' case.
BF16_BUFFER = "pcgrad_bf16_buffer"
#: SGD's learning rate: large enough that a weight delta (w - lr g) - w carries float32 rounding of
#: about 1e-7 of lr g, not of the weight itself.
LR = 1e4


def run_cases(mode: str, model_path: str, out_file: str, cases: list[str], workdir: str) -> None:
    """One optimizer step (SGD, no clipping) per case on the fixed batch, through the real
    training loop; saves each update (-delta / lr) and the logged pcgrad metrics. In one
    process PCGrad cases also save the gradient PCGrad wrote for the optimizer and the
    reference: the first implementation's maths (each loss's gradient, from ``autograd.grad``,
    summed over the micro-steps in its own fp32 vector; ``project_conflicting`` on the two
    sums; the KL part added)."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from crystal_grpo.train.pcgrad.trainer import trainer_class

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # named_parameters, not the state dict: tied weights (embeddings / lm_head) count once.
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    initial = {k: v.detach().clone() for k, v in policy.named_parameters()}
    tok = AutoTokenizer.from_pretrained(model_path)
    vocab = min(len(tok), AutoConfig.from_pretrained(model_path).vocab_size)

    results = {}
    for i, name in enumerate(cases):
        extra = topology_args(mode, first=i == 0, grad_accum_dtype="bf16" if name == BF16_BUFFER else None)
        kind, pcgrad, adv_key, beta, steps = CASES[name if name != BF16_BUFFER else "pcgrad"]
        batch = fixed_batch(policy, vocab, kind)
        if adv_key is None:
            batch["advantages"] = torch.zeros(N_GLOBAL)
        else:
            batch["advantages"] = batch[adv_key].clone()
        sums: dict[str, torch.Tensor] = {}
        captured: dict[str, torch.Tensor] = {}

        class FixedBatchTrainer(fixed_batch_trainer(trainer_class(pcgrad), batch)):
            def pcgrad_losses(self, model, inputs):
                plain, losses = super().pcgrad_losses(model, inputs)
                if mode == "single":
                    params = [p for p in model.parameters() if p.requires_grad]
                    for key, loss in losses.items():
                        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
                        flat = torch.cat(
                            [
                                (torch.zeros_like(p) if g is None else g).reshape(-1).float()
                                for p, g in zip(params, grads)
                            ]
                        )
                        sums[key] = sums[key] + flat if key in sums else flat
                return plain, losses

        class Capture(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                if mode == "single" and sums:
                    captured["grad"] = torch.cat(
                        [p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]
                    ).double()
                    combined, _ = project_conflicting(sums["accuracy"], sums["reasoning"])
                    captured["reference"] = (combined + sums.get("rest", 0.0)).double()

        args = GRPOConfig(
            output_dir=os.path.join(workdir, f"{mode}-{name}"),
            per_device_train_batch_size=N_GLOBAL // world // steps,
            gradient_accumulation_steps=steps,
            num_generations=4,
            max_steps=1,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            beta=beta,
            max_completion_length=COMP_LEN,
            **MEASURING,
            **extra,
        )
        trainer = FixedBatchTrainer(
            model=model_path,
            reward=HashReward(),
            args=args,
            callbacks=[Capture()],
            train_dataset=Dataset.from_dict({"prompt": ["q"] * 16}),
            processing_class=tok,
        )
        trainer.train()
        if mode == "ddp":
            assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        if trainer.accelerator.is_main_process:
            update = {k: (initial[k].float() - state[k].float().cpu()) / LR for k in initial if k in state}
            logs = {k: v for row in trainer.state.log_history for k, v in row.items() if k.startswith("pcgrad/")}
            results[name] = {"update": update, "logs": logs, **captured}
            if mode == "zero3":
                results[name]["grad_dtype"] = str(trainer.model_wrapped.optimizer.grad_partitions_flat_buffer.dtype)
        trainer.accelerator.wait_for_everyone()
        del trainer
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_file)


def _flat(update: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([update[k].reshape(-1) for k in sorted(update)]).double()


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-6) -> None:
    """Relative error in norm (updates read from weight deltas carry float32 rounding)."""
    err = float((got - want).norm() / want.norm())
    assert err < rel, f"relative error {err:.3g}"


@pytest.fixture(scope="module")
def pcg_model(tiny_lm_path) -> Path:
    return Path(tiny_lm_path)


def _launch(plan: dict[str, list[str]], model: Path, workdir: Path) -> dict[str, dict]:
    """One torchrun launch of two processes that run ``plan``'s cases for each topology in turn
    (``{mode: cases}``); each topology's results, as rank 0 saved them."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": ext}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        json.dumps(plan),
        str(model),
        str(workdir),
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    outs = {mode: workdir / f"{mode}.pt" for mode in plan}
    assert proc.returncode == 0 and all(o.exists() for o in outs.values()), proc.stdout[-3000:] + proc.stderr[-6000:]
    return {mode: torch.load(out) for mode, out in outs.items()}


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
    # SGD without clipping: the update is the gradient. Plain TRL runs give each gradient alone.
    g_acc, g_reason = _flat(single["acc_only"]["update"]), _flat(single["reason_only"]["update"])
    g_kl = _flat(single["kl_only"]["update"])
    combined, cos = project_conflicting(g_acc, g_reason)
    update = _flat(single["pcgrad"]["update"])
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
    plain = _flat(single["plain"]["update"])
    assert (update - plain).norm() > 0.1 * plain.norm()
    assert not single["plain"]["logs"], "pcgrad: false is plain TRL GRPO (no PCGrad metrics)"
    # Plain GRPO's gradient is the sum of the three parts (the surrogate is linear on-policy).
    assert_close(plain, g_acc + g_reason + g_kl)


def test_without_conflict_the_update_equals_plain_grpo(single):
    update, plain = _flat(single["aligned_pcgrad"]["update"]), _flat(single["aligned_plain"]["update"])
    assert single["aligned_pcgrad"]["logs"]["pcgrad/conflict"] == 0.0
    assert single["aligned_pcgrad"]["logs"]["pcgrad/cosine"] == pytest.approx(1.0, abs=1e-4)
    assert single["aligned_pcgrad"]["logs"]["pcgrad/projected_fraction"] == 0.0
    assert float(update.norm()) > 0
    assert_close(update, plain)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[1]])
def test_update_equals_the_first_implementations(single, name):
    """What PCGrad hands the optimizer is, to 1e-6, what its first implementation computed from
    the same losses (three fp32 buffers, ``project_conflicting``): for each memory plan, with and
    without conflict."""
    case = single[name]
    conflict = CASES[name][0] == "conflict"
    assert case["logs"]["pcgrad/conflict"] == float(conflict), "the fixed batch is built to (not) conflict"
    err = float((case["grad"] - case["reference"]).norm() / case["reference"].norm())
    assert err < 1e-6, f"relative error {err:.3g}"
    in_order = torch.cat([u.reshape(-1) for u in case["update"].values()]).double()  # parameters' order
    assert_close(in_order, case["reference"])  # ... and it is the update the optimizer made


#: Several micro-steps with a KL term; one (the KL after the projection).
TWO_PROCESS_CASES = ["pcgrad", "pcgrad_k1"]


@pytest.fixture(scope="module")
def two_processes(pcg_model, tmp_path_factory) -> dict[str, dict]:
    """Two DDP processes, then (the same two processes, a fresh accelerator state) two DeepSpeed
    ZeRO-3 ones: one launch, its start-up paid once."""
    plan = {"ddp": TWO_PROCESS_CASES, "zero3": TWO_PROCESS_CASES + [BF16_BUFFER]}
    return _launch(plan, pcg_model, tmp_path_factory.mktemp("two_processes"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_same_update_in_two_processes(mode, single, two_processes):
    cases, two = TWO_PROCESS_CASES, two_processes[mode]
    if mode == "zero3":
        # A bf16 gradient buffer cannot hold the sums: they stay in fp32 rows (the first
        # implementation, zeroing an fp32 copy of it, was 96% off here), rounded to bf16 once.
        assert two[BF16_BUFFER]["grad_dtype"] == "torch.bfloat16"
        assert_close(_flat(two[BF16_BUFFER]["update"]), _flat(single["pcgrad"]["update"]), rel=1e-2)
    for name in cases:
        assert_close(_flat(two[name]["update"]), _flat(single[name]["update"]))
        for key, value in single[name]["logs"].items():
            if key != "pcgrad/overhead_seconds":
                assert two[name]["logs"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)


# ----------------------------------------------------------------------------- the accumulation window
def _storage(n: int, dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.full((n,), 7.0, dtype=dtype)]  # stale content: the window zeroes it


def _window_run(grads: list[dict[str, torch.Tensor]], plan, storage: list[torch.Tensor], copy_first: bool):
    """Drive an :class:`AccumulationWindow` with given per-micro-step gradients, the storage
    receiving each as autograd does (added) or, with ``copy_first``, as ZeRO-3 does in a window's
    first micro-step (overwritten). Returns the update left in the storage and the window."""
    dtype = storage[0].dtype
    window = AccumulationWindow(storage, plan)

    def backward(k: int, g: torch.Tensor):
        def run():
            if copy_first and k == 0:
                storage[0].copy_(g)
            else:
                storage[0].add_(g.to(dtype))

        return run

    for k, g in enumerate(grads):
        for name in window.order(g):
            window.accumulate(name, backward(k, g[name]))
    late = backward(len(grads) - 1, grads[-1][REST]) if plan.late_rest else None
    window.project(late_backward=late)
    return storage[0], window


def _first_implementation(grads: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    sums = {k: torch.zeros_like(grads[0][ACCURACY]) for k in grads[0]}
    for g in grads:
        for k, v in g.items():
            sums[k].add_(v)
    combined, _ = project_conflicting(sums[ACCURACY], sums[REASONING])
    return combined + sums.get(REST, 0.0)


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("rest", [False, True])
def test_window_is_exact_and_allocates_what_the_plan_says(steps, rest):
    """Every plan, both storage semantics, conflicting and aligned gradients: the in-place update
    equals the first implementation's to 1e-6, with exactly the rows the memory plan counts."""
    gen = torch.Generator().manual_seed(steps * 2 + rest)
    names = [ACCURACY, REASONING] + ([REST] if rest else [])
    for conflict in (True, False):
        grads = [{k: torch.randn(300, generator=gen) for k in names} for _ in range(steps)]
        for g in grads:  # the reasoning gradients pull against the accuracy ones, or with them
            g[REASONING] += (-1.5 if conflict else 1.5) * g[ACCURACY]
        want = _first_implementation(grads)
        cos = float(
            torch.nn.functional.cosine_similarity(
                sum(g[ACCURACY] for g in grads), sum(g[REASONING] for g in grads), dim=0
            )
        )
        assert (cos < 0) == conflict
        for holds in (True, False):  # fp32 storage; storage that cannot hold a sum (bf16 over micro-steps)
            plan = pcgrad_plan(steps, rest, fp32_gradients=holds)
            for copy_first in (False, True):
                got, window = _window_run(grads, plan, _storage(300), copy_first)
                err = float((got - want).norm() / want.norm())
                assert err < 1e-6, (conflict, holds, copy_first, err)
                assert (
                    window.rows_allocated
                    == plan.extra_partitions
                    == pcgrad_extra_partitions(steps, BETA if rest else 0.0, fp32_gradients=holds)
                )


def test_window_in_a_bf16_storage_accumulates_in_fp32():
    """bf16 gradients (bf16-valued, as a bf16 backward pass makes them): the sums stay fp32 and
    the update is rounded to bf16 once, so it is the first implementation's, rounded."""
    gen = torch.Generator().manual_seed(5)
    for steps, rest in ((1, True), (1, False), (2, True), (3, False)):
        names = [ACCURACY, REASONING] + ([REST] if rest else [])
        grads = [{k: torch.randn(300, generator=gen).bfloat16().float() for k in names} for _ in range(steps)]
        for g in grads:
            g[REASONING] = (g[REASONING] - 1.5 * g[ACCURACY]).bfloat16().float()
        want = _first_implementation(grads)
        plan = pcgrad_plan(steps, rest, fp32_gradients=False)
        got, _ = _window_run(grads, plan, _storage(300, torch.bfloat16), copy_first=True)
        assert got.dtype == torch.bfloat16
        # one bf16 rounding of (nearly) the same fp32 value: within one bf16 step of it
        assert torch.all((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-30), (steps, rest)
        assert (got.float() == want.bfloat16().float()).float().mean() > 0.95, (steps, rest)


@pytest.mark.parametrize("steps, rest", [(1, True), (2, False), (2, True)])
def test_window_allocates_its_rows_and_nothing_gradient_sized(steps, rest, monkeypatch):
    """What PCGrad allocates over a window, counted by torch (AllocationPeak): the plan's rows,
    plus at most one chunk of temporaries; no gradient-sized temporary."""
    from crystal_grpo.train.pcgrad import gradients as pcgrad_gradients

    monkeypatch.setattr(pcgrad_gradients, "CHUNK_ELEMENTS", 1024)
    n, gen = 100_000, torch.Generator().manual_seed(3)
    names = [ACCURACY, REASONING] + ([REST] if rest else [])
    grads = [{k: torch.randn(n, generator=gen) for k in names} for _ in range(steps)]
    for g in grads:
        g[REASONING] -= 1.5 * g[ACCURACY]  # a conflict: the projection runs
    for holds in (True, False):
        plan = pcgrad_plan(steps, rest, fp32_gradients=holds)
        storage = _storage(n)
        with AllocationPeak() as measured:
            _window_run(grads, plan, storage, copy_first=False)
        rows = measured.peak / (4 * n)
        assert plan.extra_partitions <= rows <= plan.extra_partitions + 1024 / n + 0.001, (holds, rows)


def test_memory_plan_per_config():
    """docs/training.md's table: fp32 partitions PCGrad adds."""
    assert pcgrad_extra_partitions(1, 0.04) == 1 and pcgrad_extra_partitions(1, 0.0) == 1
    assert pcgrad_extra_partitions(2, 0.0) == 1 and pcgrad_extra_partitions(2, 0.04) == 2  # the paper's, fp32 grads
    assert (
        pcgrad_extra_partitions(4, 0.0, entropy_bonus=True) == 2
        and pcgrad_extra_partitions(4, 0.0, aux_loss=True) == 2
    )
    assert pcgrad_extra_partitions(1, 0.04, fp32_gradients=False) == 1  # a single gradient fits its own dtype
    assert pcgrad_extra_partitions(2, 0.0, fp32_gradients=False) == 2
    assert pcgrad_extra_partitions(2, 0.04, fp32_gradients=False) == 3  # the paper's under bf16 ZeRO-3
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        pcgrad_extra_partitions(0, 0.0)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("lora", [False, True])
def test_end_to_end_with_pcgrad(tmp_path, pcg_model, monkeypatch, lora, one_thread):
    from crystal_grpo import rewards
    from crystal_grpo.train import grpo

    monkeypatch.setitem(rewards.REWARDS, "cpr", HashReward)  # tiny.yaml's reward, swapped
    out = tmp_path / "run"
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(out),
        "--model.name_or_path",
        str(pcg_model),
        "--pcgrad",
        "true",
        "--validation.eval_steps",
        "0",
        "--training.max_steps",
        "2",
        "--training.gradient_accumulation_steps",
        "2",
        "--training.save_strategy",
        "'no'",
    ]
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


@pytest.mark.parametrize(
    "option, says",
    [
        ({"multi_objective_aggregation": "normalize_then_sum"}, "sum_then_normalize"),
        ({"off_policy_mask_threshold": 0.5}, r"^training.off_policy_mask_threshold: 0.5 cannot be combined"),
    ],
)
def test_options_pcgrad_cannot_honour_are_refused(pcg_model, tmp_path, option, says):
    from datasets import Dataset
    from trl import GRPOConfig

    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_steps=1,
        **option,
    )
    with pytest.raises(ValueError, match=says):
        PCGradGRPOTrainer(
            model=str(pcg_model),
            reward=HashReward(),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["q"] * 4}),
        )


def test_only_pcgrad_runs_get_the_pcgrad_trainer_and_liger_is_refused(pcg_model, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    from crystal_grpo.train.pcgrad.trainer import PCGradGRPOTrainer, trainer_class
    from crystal_grpo.train.trainer.grpo_trainer import CrystalGRPOTrainer

    assert trainer_class(False) is CrystalGRPOTrainer and not CrystalGRPOTrainer.pcgrad
    assert trainer_class(True) is PCGradGRPOTrainer and issubclass(PCGradGRPOTrainer, CrystalGRPOTrainer)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        use_liger_kernel=True,
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_steps=1,
    )
    with pytest.raises(ValueError, match="cannot be combined with use_liger_kernel"):
        PCGradGRPOTrainer(
            model=str(pcg_model),
            reward=HashReward(),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["q"] * 4}),
        )


if __name__ == "__main__":  # worker of test_same_update_in_two_processes: PLAN MODEL WORKDIR
    plan, model, workdir = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    for i, (mode, cases) in enumerate(plan.items()):
        if i:  # another topology: a fresh accelerator and process state over the same process group
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)
        run_cases(mode, model, os.path.join(workdir, f"{mode}.pt"), cases, workdir)
