#!/usr/bin/env python
"""Benchmark PCGrad: GRPO step time and peak memory with PCGrad off and on, side by side,
for full fine-tuning and LoRA on the same tiny model (one table, one run); with ``--memory``,
the bytes PCGrad allocates per trainable parameter instead.

    python scripts/bench_pcgrad.py [--model .cache/models/tiny-qwen2] [--pairs 10] [--warmup 2]
                                   [--batch 8] [--completion_length 32] [--beta 0.04] [--threads N]
    python scripts/bench_pcgrad.py --memory [--baseline old_pcgrad.py] [--model ...]

One trainer alternates PCGrad off and on at every step, so both see the same load. The workload,
the columns and the targets: docs/benchmarks.md, "PCGrad step time" and "PCGrad memory".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from crystal_grpo.jsonl import read_jsonl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO_ROOT = Path(__file__).resolve().parents[1]

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

    from crystal_grpo.train.benchmarks.pcgrad import HashReward
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
        loss_type="grpo",
        scale_rewards="group",
        temperature=0.9,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
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
            rows.append(
                {"pcgrad": bool(getattr(trainer, "pcgrad", False)), "step": step, "update": step - gen_time[0]}
            )

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
        __file__,
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

    from crystal_grpo.train.benchmarks.pcgrad import memory_rows
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a = ap.parse_args(argv)

    if a._one:  # child process: one configuration
        setting, mode = a._one.split(":")
        print("RESULT" + json.dumps(run_one(setting, mode, a)), flush=True)
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
