"""PCGrad on a fixed batch: what ``scripts/bench_pcgrad.py --memory`` measures and PCGrad's
tests train on.

:func:`fixed_batch` replaces generation (:func:`fixed_batch_trainer`), so an optimizer step
through the real training loop sees the same data in one process, under DDP and under ZeRO-3
(:func:`topology_args`), PCGrad on or off. :class:`AllocationPeak` is the peak of the bytes
allocated inside a block above what was allocated when it began (CUDA: ``max_memory_allocated``;
CPU: the profiler's memory events replayed in order); :func:`memory_case` measures two optimizer
steps of one configuration. Run as ``python -m crystal_grpo.train.benchmarks.pcgrad MODE MODEL
WORKDIR STEPS BETA IMPL OUT`` (under ``torchrun`` for ZeRO-3) it measures one configuration.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.train.config.run_config import CONFIG_DIR

N_GLOBAL, PROMPT_LEN, COMP_LEN = 8, 6, 5
LENGTHS = [5, 3, 4, 5, 2, 5, 4, 1]


class HashReward(RewardModule):
    """A cheap reward with both objectives whose values vary across completions (a random
    tiny model never writes valid JSON, so the paper rewards would all be 0): C and F of the
    evaluation are replaced by numbers hashed from the completion's text."""

    name = "hash"
    objectives = {"hash_accuracy": "accuracy", "hash_reasoning": "reasoning"}
    uses_steps = False

    def score(self, completions, rows, with_steps=None):
        scored = super().score(completions, rows, with_steps=False)
        h = torch.tensor(
            [zlib.crc32((c if isinstance(c, str) else json.dumps(c)).encode()) for c in completions],
            dtype=torch.float64,
        )
        scored.batch.correct, scored.batch.format_ok = h % 2, (h // 7 % 10) / 10
        return scored

    def components(self, batch):
        return {"hash_accuracy": batch.correct, "hash_reasoning": batch.format_ok}


def fixed_batch(model, vocab: int, kind: str) -> dict[str, torch.Tensor]:
    """A global batch of 8 completions (2 prompts x 4). Prompts have no padding and
    completions are right-padded, so a row's log-probs do not depend on its neighbours.
    ``kind``: the reasoning advantages pull against the accuracy ones (``conflict``) or with
    them (``aligned``).

    The reference log-probs lie within about 0.3 nats of the policy's own. Arbitrary ones
    (a KL of thousands of nats per token) make the KL gradient a small difference of huge
    per-token terms, whose float32 rounding (about 3e-5 relative) would blur the exact
    identities PCGrad's tests check."""
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(20, vocab, (N_GLOBAL, PROMPT_LEN), generator=g),
        "prompt_mask": torch.ones(N_GLOBAL, PROMPT_LEN, dtype=torch.long),
        "completion_ids": torch.randint(20, vocab, (N_GLOBAL, COMP_LEN), generator=g),
        "completion_mask": (torch.arange(COMP_LEN)[None] < torch.tensor(LENGTHS)[:, None]).long(),
    }
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        logits = model(input_ids=ids).logits[:, PROMPT_LEN - 1 : -1].float()
        logps = logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    batch["ref_per_token_logps"] = logps + 0.3 * torch.randn(N_GLOBAL, COMP_LEN, generator=g)
    acc = torch.randn(N_GLOBAL, generator=g)
    noise = torch.randn(N_GLOBAL, generator=g)
    reason = {"conflict": -0.6 * acc + 0.5 * noise, "aligned": 0.5 * acc}[kind]
    batch.update(advantages=acc + reason, advantages_acc=acc, advantages_reason=reason)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    return batch


def fixed_batch_trainer(base: type, batch: dict[str, torch.Tensor]) -> type:
    """``base`` with generation replaced by ``batch`` (this process's rows); everything after
    it (shuffle, split, loss, backward, PCGrad, optimizer) is the real loop."""

    class FixedBatchTrainer(base):
        def _generate_and_score_completions(self, inputs):
            n = len(inputs)
            mine = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
            return {k: (v[mine] if v.dim() else v).to(self.accelerator.device) for k, v in batch.items()}

    return FixedBatchTrainer


def topology_args(mode: str, first: bool = True, grad_accum_dtype: str | None = None) -> dict[str, Any]:
    """GRPOConfig keywords for ``single``, ``ddp`` (CPU, gloo) or ``zero3`` (gloo on CPU, NCCL
    on CUDA), the process state set up before the training arguments (train/grpo.py's
    setup_distributed); ``first``:
    the process's first trainer (a later ZeRO-3 one needs a fresh accelerator state);
    ``grad_accum_dtype``: ZeRO-3's gradient buffer dtype (DeepSpeed's ``data_types``)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    if mode == "zero3":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        if not first:  # a new Accelerator may not bring its DeepSpeed plugin to a used state
            AcceleratorState._reset_state()
        PartialState(backend="nccl" if torch.cuda.is_available() else "gloo")
        deepspeed = json.loads((CONFIG_DIR / "accelerate" / "zero3.json").read_text())
        if grad_accum_dtype:
            deepspeed["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
        return {"use_cpu": False, "deepspeed": deepspeed, "accelerator_config": {"use_configured_state": True}}
    if mode == "ddp":  # cpu=True: without it the state is DistributedType.NO (no DDP wrapping, no gather)
        PartialState(cpu=True, backend="gloo")
        return {"use_cpu": True, "accelerator_config": {"use_configured_state": True}}
    return {}


# --------------------------------------------------------------------------- memory
def replay_peak(events) -> int:
    """Peak of the running sum of the profiler's allocation reports (each operator's own,
    children excluded, and the frees outside operators), in time order."""
    deltas = [(e.time_range.start, e.self_cpu_memory_usage) for e in events if e.self_cpu_memory_usage]
    live = peak = 0
    for _, delta in sorted(deltas, key=lambda x: x[0]):
        live += delta
        peak = max(peak, live)
    return peak


class AllocationPeak:
    """``with AllocationPeak() as m: ...`` then ``m.peak``: bytes (see the module docstring)."""

    def __enter__(self) -> AllocationPeak:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.profile.__exit__(*exc)
            self.peak = replay_peak(self.profile.events())


def load_trainer_class(pcgrad: bool, module_file: str | None = None) -> type:
    """``train.pcgrad.trainer_class(pcgrad)``, or that of another version of the module, from a file
    (e.g. ``git show 686a6c0:train/pcgrad/trainer.py > old.py``: the first implementation)."""
    if module_file is None:
        from crystal_grpo.train.pcgrad.trainer import trainer_class
    else:
        spec = importlib.util.spec_from_file_location(f"pcgrad_{Path(module_file).stem}", module_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        trainer_class = module.trainer_class
    return trainer_class(pcgrad)


def load_fixed_batch(model_path: str, kind: str) -> dict[str, torch.Tensor]:
    """:func:`fixed_batch` for a model folder (load it before any ZeRO-3 trainer: that one
    makes later ``from_pretrained`` calls partition the weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    vocab = min(len(AutoTokenizer.from_pretrained(model_path)), AutoConfig.from_pretrained(model_path).vocab_size)
    return fixed_batch(AutoModelForCausalLM.from_pretrained(model_path), vocab, kind)


def memory_case(
    mode: str,
    model_path: str,
    batch: dict[str, torch.Tensor],
    steps: int,
    beta: float,
    pcgrad: bool,
    workdir: str,
    module_file: str | None = None,
    first: bool = True,
) -> dict[str, Any]:
    """Peak bytes allocated by two optimizer steps (AdamW, ``steps`` micro-steps each) on
    ``batch``, above what was allocated before training (model loaded, DeepSpeed not yet
    initialised), and this rank's trainable parameters (its ZeRO-3 partition)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = topology_args(mode, first)
    tok = AutoTokenizer.from_pretrained(model_path)
    args = GRPOConfig(
        output_dir=os.path.join(workdir, f"memory-{mode}"),
        per_device_train_batch_size=N_GLOBAL // world // steps,
        gradient_accumulation_steps=steps,
        num_generations=4,
        max_steps=2,
        learning_rate=1e-6,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=beta,
        loss_type="grpo",
        scale_rewards="group",
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        max_completion_length=COMP_LEN,
        remove_unused_columns=False,
        **extra,
    )
    trainer = fixed_batch_trainer(load_trainer_class(pcgrad, module_file), batch)(
        model=model_path,
        reward=HashReward(),
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": ["q"] * 32}),
    )
    gc.collect()
    with AllocationPeak() as measured:
        trainer.train()
    trainable = sum(getattr(p, "ds_tensor", p).numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.accelerator.wait_for_everyone()
    del trainer
    gc.collect()
    return {"peak": measured.peak, "trainable": trainable}


#: The memory table's configurations: (gradient accumulation steps, beta).
MEMORY_CASES = [(1, 0.0), (1, 0.04), (2, 0.0), (2, 0.04)]


def measure(mode: str, model_path: str, workdir: str, steps: int, beta: float, impl: str) -> dict[str, Any]:
    """One configuration in a fresh process (``impl``: ``plain``, ``pcgrad`` or a module file of
    another version of train/pcgrad/trainer.py), after one unmeasured trainer: a process's first trainer
    also allocates what stays for the next ones (lazy initialisations)."""
    batch = load_fixed_batch(model_path, "conflict")
    memory_case(mode, model_path, batch, 1, 0.0, False, workdir)
    module_file = None if impl in ("plain", "pcgrad") else impl
    return memory_case(mode, model_path, batch, steps, beta, impl != "plain", workdir, module_file, first=False)


def memory_rows(
    mode: str,
    model_path: str,
    workdir: str,
    baseline: str | None = None,
    repeats: int = 1,
    cases: list[tuple[int, float]] = MEMORY_CASES,
) -> list[dict[str, Any]]:
    """For each of ``cases`` (gradient accumulation steps, beta): the peaks of plain GRPO, PCGrad, and the PCGrad of
    ``baseline`` (a module file) if given; each in its own process (``zero3``: two under
    torchrun, one a GPU on CUDA, so one on a single GPU; rank 0's figures), ``repeats`` times
    (lists of peaks, in the order run)."""
    import subprocess

    impls = {"plain": "plain", "pcgrad": "pcgrad", **({"baseline": str(Path(baseline).resolve())} if baseline else {})}
    nproc = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    launcher = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if mode == "zero3" else []
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for steps, beta in cases:
        row: dict[str, Any] = {"mode": mode, "steps": steps, "beta": beta, **{label: [] for label in impls}}
        for repeat in range(repeats):
            for label, impl in impls.items():
                out = Path(workdir) / f"memory-{mode}-{steps}-{beta}-{label}-{repeat}.json"
                out.unlink(missing_ok=True)
                cmd = [
                    *launcher,
                    "-m",
                    "crystal_grpo.train.benchmarks.pcgrad",
                    mode,
                    model_path,
                    workdir,
                    str(steps),
                    str(beta),
                    impl,
                    str(out),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0 or not out.exists():
                    raise RuntimeError(f"{' '.join(cmd)} failed\n{proc.stderr[-4000:]}")
                got = json.loads(out.read_text())
                row[label].append(got["peak"])
                row["trainable"] = got["trainable"]
        rows.append(row)
    return rows


if __name__ == "__main__":  # one measurement: MODE MODEL WORKDIR STEPS BETA IMPL OUT
    mode, model, workdir, steps, beta, impl, out = sys.argv[1:8]
    torch.set_num_threads(1)
    result = measure(mode, model, workdir, int(steps), float(beta), impl)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(result))
