"""What ``scripts/bench_pcgrad.py`` runs (:func:`main`: PCGrad's step time, or with ``--memory`` its
memory), and the fixed batch PCGrad's tests train on.

:func:`fixed_batch` replaces generation (:func:`fixed_batch_trainer`), so an optimizer step
through the real training loop sees the same data in one process, under DDP and under ZeRO-3
(:func:`topology_args`), PCGrad on or off. :class:`AllocationPeak` is the peak of the bytes
allocated inside a block above what was allocated when it began (CUDA: ``max_memory_allocated``;
CPU: the profiler's memory events replayed in order); :func:`memory_case` measures two optimizer
steps of one configuration, each in a process of its own (``--_measure``, under ``torchrun`` for
ZeRO-3); :func:`run_one` one setting's step times (``--_one``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.train.config.run_config import CONFIG_DIR

if TYPE_CHECKING:  # torch loads with the first measurement: --help answers at once
    import torch

N_GLOBAL, PROMPT_LEN, COMP_LEN = 8, 6, 5
LENGTHS = [5, 3, 4, 5, 2, 5, 4, 1]
#: The GRPOConfig settings every PCGrad measurement shares: TRL's plain loss, no logging or saving
#: beyond each step's numbers, one seed, fp32 without recomputation.
MEASURING = dict(
    loss_type="grpo",
    scale_rewards="group",
    bf16=False,
    gradient_checkpointing=False,
    report_to="none",
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    seed=0,
    remove_unused_columns=False,
)


class HashReward(RewardModule):
    """A cheap reward with both objectives whose values vary across completions (a random
    tiny model never writes valid JSON, so the paper rewards would all be 0): C and F of the
    evaluation are replaced by numbers hashed from the completion's text."""

    name = "hash"
    objectives = {"hash_accuracy": "accuracy", "hash_reasoning": "reasoning"}
    uses_steps = False

    def score(self, completions, rows, with_steps=None):
        import torch

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
    import torch

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
    import torch
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
        import torch

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
        import torch

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
        max_completion_length=COMP_LEN,
        **MEASURING,
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
    import torch

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
                    "--_measure",
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


# --------------------------------------------------------------------------- the command (scripts/bench_pcgrad.py)
DESCRIPTION = """Benchmark PCGrad: GRPO step time and peak memory with PCGrad off and on, side by side,
for full fine-tuning and LoRA on the same tiny model (one table, one run); with ``--memory``,
the bytes PCGrad allocates per trainable parameter instead.

    python scripts/bench_pcgrad.py [--model .cache/models/tiny-qwen2] [--pairs 10] [--warmup 2]
                                   [--batch 8] [--completion_length 32] [--beta 0.04] [--threads N]
    python scripts/bench_pcgrad.py --memory [--baseline old_pcgrad.py] [--model ...]

One trainer alternates PCGrad off and on at every step, so both see the same load. The workload,
the columns and the targets: docs/benchmarks.md, "PCGrad step time" and "PCGrad memory".
"""
REPO_ROOT = Path(__file__).resolve().parents[2]

TARGETS = {"full": 1.6, "lora": 1.3}


def _prompts(n: int) -> list:
    path = REPO_ROOT / "data" / "wordproblems" / "train.jsonl"
    rows = read_jsonl(path)[:n]
    qs = [r["question"] for r in rows] or [
        f"Tom has {i} apples and buys {i + 3} more. How many now?" for i in range(n)
    ]
    return [[{"role": "user", "content": q}] for q in qs]


class _RssPeak:
    """Peak resident memory while running (CPU), sampled in a thread."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def run_one(setting: str, mode: str, a: argparse.Namespace) -> dict:
    """One configuration in this process. ``mode``: ``alternate`` (off/on every other step,
    timings), ``off`` or ``on`` (peak memory)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from crystal_grpo.train.pcgrad.trainer import pcgrad_extra_partitions, trainer_class

    if a.threads:
        torch.set_num_threads(a.threads)
    steps = a.warmup + (2 * a.pairs + 1 if mode == "alternate" else a.memory_steps)
    n_prompts = steps * a.batch // 4 + 4
    args = GRPOConfig(
        output_dir=str(Path(a.workdir) / f"{setting}-{mode}"),
        per_device_train_batch_size=a.batch,
        num_generations=4,
        max_completion_length=a.completion_length,
        max_steps=steps,
        learning_rate=1e-5,
        beta=a.beta,
        temperature=0.9,
        use_cpu=not torch.cuda.is_available(),
        **MEASURING,
    )
    peft = None
    if setting == "lora":
        from peft import LoraConfig

        peft = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    trainer = trainer_class(mode != "off")(
        model=a.model,
        reward=HashReward(),
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"prompt": _prompts(n_prompts)}),
        peft_config=peft,
    )
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)

    gen_time = [0.0]
    original = trainer._generate_and_score_completions

    def timed_generation(inputs):
        t = time.perf_counter()
        out = original(inputs)
        gen_time[0] += time.perf_counter() - t
        return out

    trainer._generate_and_score_completions = timed_generation
    rows: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if mode == "alternate":  # odd steps on; the advantage split is computed either way
                trainer.pcgrad = state.global_step % 2 == 1
            self.t0, gen_time[0] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            step = time.perf_counter() - self.t0
            rows.append({"pcgrad": trainer.pcgrad, "step": step, "update": step - gen_time[0]})

    trainer.add_callback(Timer())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with _RssPeak() as rss:
        trainer.train()
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else (rss.peak - rss.base)
    return {
        "rows": rows[a.warmup :],
        "peak_mib": peak / 2**20,
        "trainable": trainable,
        "buffers_mib": pcgrad_extra_partitions(1, a.beta) * trainable * 4 / 2**20,
        "device": "cuda" if cuda else f"cpu ({torch.get_num_threads()} threads)",
    }


def paired(rows: list[dict], key: str) -> tuple[float, float, float]:
    """(median off, median on, median of on / mean of its neighbouring off steps)."""
    off = [r[key] for r in rows if not r["pcgrad"]]
    on = [r[key] for r in rows if r["pcgrad"]]
    ratios = [
        rows[i][key] / ((rows[i - 1][key] + rows[i + 1][key]) / 2)
        for i in range(1, len(rows) - 1)
        if rows[i]["pcgrad"] and not rows[i - 1]["pcgrad"] and not rows[i + 1]["pcgrad"]
    ]
    return statistics.median(off), statistics.median(on), statistics.median(ratios)


def _child(setting: str, mode: str, a: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "crystal_grpo.train.benchmarks.pcgrad",
        "--_one",
        f"{setting}:{mode}",
        "--model",
        a.model,
        "--pairs",
        str(a.pairs),
        "--warmup",
        str(a.warmup),
        "--batch",
        str(a.batch),
        "--completion_length",
        str(a.completion_length),
        "--beta",
        str(a.beta),
        "--workdir",
        a.workdir,
        "--memory_steps",
        str(a.memory_steps),
        "--threads",
        str(a.threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"{setting}:{mode} failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    print(f"  done: {setting} {mode}", file=sys.stderr, flush=True)
    return json.loads(line[0][len("RESULT") :])


def memory_table(a: argparse.Namespace) -> int:
    import torch

    from crystal_grpo.train.pcgrad.trainer import pcgrad_extra_partitions

    rows = []
    for topology in a.topologies.split(","):
        if topology not in ("single", "zero3"):
            raise SystemExit(f"--topologies: {topology!r} is not single or zero3")
        cases = [(int(c.split(":")[0]), float(c.split(":")[1])) for c in a.cases.split(",")]
        rows += memory_rows(topology, a.model, a.workdir, a.baseline, a.repeats if topology == "zero3" else 1, cases)
        print(f"  done: {topology}", file=sys.stderr, flush=True)
    mib = 2**20
    print(
        f"\nPCGrad memory: {Path(a.model).name}, fixed batch of 8 completions, 2 optimizer steps (AdamW); "
        f"peak allocated above the start of training "
        f"({'CUDA allocator' if torch.cuda.is_available() else 'CPU: torch profiler memory events'}); "
        "medians, [min-max] over the runs"
    )
    head = (
        f"{'topology':<9}{'accum':>6}{'beta':>6}{'trainable':>12}{'plain MiB':>11}{'PCGrad MiB':>12}"
        f"{'B/param':>20}{'plan':>6}"
    )
    if a.baseline:
        head += f"{'baseline MiB':>14}{'B/param':>20}{'ratio':>7}"
    print(head)
    print("-" * len(head))

    def extra(r: dict, label: str) -> list[float]:  # per run: that run's peak over plain GRPO's, per parameter
        return [(x - p) / r["trainable"] for x, p in zip(r[label], r["plain"])]

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f}" + (f" [{min(xs):.1f}-{max(xs):.1f}]" if len(xs) > 1 else "")

    for r in rows:
        plan = 4 * pcgrad_extra_partitions(r["steps"], r["beta"])
        line = (
            f"{r['mode']:<9}{r['steps']:>6}{r['beta']:>6.2f}{r['trainable']:>12,}"
            f"{statistics.median(r['plain']) / mib:>11.2f}{statistics.median(r['pcgrad']) / mib:>12.2f}"
            f"{spread(extra(r, 'pcgrad')):>20}{plan:>6}"
        )
        if a.baseline:
            ratio = statistics.median(extra(r, "pcgrad")) / statistics.median(extra(r, "baseline"))
            line += f"{statistics.median(r['baseline']) / mib:>14.2f}{spread(extra(r, 'baseline')):>20}{ratio:>7.2f}"
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=str(REPO_ROOT / ".cache" / "models" / "tiny-qwen2"),
        help="causal LM folder (built with scripts/make_tiny_models.py when missing)",
    )
    ap.add_argument("--pairs", type=int, default=10, help="measured (off, on) step pairs per setting")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--memory_steps", type=int, default=3, help="steps of the off-only / on-only memory runs")
    ap.add_argument("--batch", type=int, default=8, help="completions per step")
    ap.add_argument("--completion_length", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0 drops the third backward pass)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default; 1, the default, keeps OpenMP from stalling on a shared CPU)",
    )
    ap.add_argument("--settings", default="full,lora")
    ap.add_argument("--workdir", default=str(REPO_ROOT / ".cache" / "bench_pcgrad"))
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--memory", action="store_true", help="the memory table (bytes per parameter) instead")
    ap.add_argument(
        "--baseline", default=None, help="--memory: another train/pcgrad/trainer.py to measure beside this one"
    )
    ap.add_argument("--topologies", default="single,zero3", help="--memory: single and/or zero3")
    ap.add_argument(
        "--cases", default="1:0,1:0.04,2:0,2:0.04", help="--memory: gradient_accumulation_steps:beta configurations"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="--memory: runs of each ZeRO-3 configuration (its CPU peaks vary from run to run; one process's do not)",
    )
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_measure", nargs=7, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a._one:  # child process: one configuration's step times
        setting, mode = a._one.split(":")
        print("RESULT" + json.dumps(run_one(setting, mode, a)), flush=True)
        return 0
    if a._measure:  # child process: one configuration's memory (MODE MODEL WORKDIR STEPS BETA IMPL OUT)
        import torch

        mode, model, workdir, steps, beta, impl, out = a._measure
        torch.set_num_threads(1)
        result = measure(mode, model, workdir, int(steps), float(beta), impl)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(out).write_text(json.dumps(result))
        return 0

    if not Path(a.model).exists():
        from crystal_grpo.train.fixtures.tiny_models import build_tiny_lm

        build_tiny_lm(Path(a.model))
    if a.memory:
        return memory_table(a)

    settings = [s for s in a.settings.split(",") if s]
    raw = {f"{s}:{m}": _child(s, m, a) for s in settings for m in ("alternate", "off", "on")}
    first = raw[f"{settings[0]}:alternate"]
    print(
        f"\nPCGrad benchmark: {Path(a.model).name}, {a.batch} completions/step (4 per prompt), "
        f"{a.completion_length} new tokens, beta {a.beta}, device {first['device']}; "
        f"{a.pairs} (off, on) step pairs per setting after {a.warmup} warm-up steps"
    )
    head = (
        f"{'setting':<8}{'trainable':>11}{'pcgrad':>8}{'step s':>9}{'update s':>10}"
        f"{'peak MiB':>10}{'buffers MiB':>13}{'step ratio':>12}{'update ratio':>14}{'target':>8}"
    )
    print(head)
    print("-" * len(head))
    summary = {}
    for s in settings:
        rows = raw[f"{s}:alternate"]["rows"]
        off_step, on_step, step_ratio = paired(rows, "step")
        off_upd, on_upd, upd_ratio = paired(rows, "update")
        trainable = raw[f"{s}:alternate"]["trainable"]
        for mode, st, up in (("off", off_step, off_upd), ("on", on_step, on_upd)):
            buf = raw[f"{s}:on"]["buffers_mib"] if mode == "on" else 0.0
            tail = f"{step_ratio:>12.2f}{upd_ratio:>14.2f}{'<=' + str(TARGETS[s]):>8}" if mode == "on" else ""
            print(
                f"{s:<8}{trainable:>11,}{mode:>8}{st:>9.3f}{up:>10.3f}{raw[f'{s}:{mode}']['peak_mib']:>10.1f}"
                f"{buf:>13.2f}{tail}"
            )
        summary[s] = {
            "step_ratio": step_ratio,
            "update_ratio": upd_ratio,
            "target": TARGETS[s],
            "meets_target": step_ratio <= TARGETS[s],
        }
    print(
        "\n"
        + ", ".join(
            f"{s}: step ratio {v['step_ratio']:.2f} ({'meets' if v['meets_target'] else 'MISSES'} <= {v['target']})"
            for s, v in summary.items()
        )
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
