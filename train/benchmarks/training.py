"""What ``scripts/bench_train.py`` runs: GRPO steps of this framework against plain TRL.

A setting names one run: ``<launcher>-<weights>[-<reward>][-pcgrad][-<generation>]``
(docs/benchmarks.md, "What bench_train.py runs and prints"). Every run is ``python -m
crystal_grpo.train.benchmarks.training ENTRY --config tiny.yaml <overrides>`` with the same
overrides, and the baseline builds its GRPOConfig, dataset, model and LoRA config with the very
functions ``train/grpo.py`` uses: only the trainer and the reward differ. :func:`step_clock`
records each step's wall time, end to end, next to TRL's ``step_time`` in ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.train.run.layout import METRICS_LOG

GENERATIONS = 8
CLOCK_FILE = "step_clock.json"
#: TRL's profiling blocks (``profiling_context(trainer, name)``) that are generation itself.
GENERATION_BLOCKS = ("transformers.generate", "transformers.generate_batch", "vLLM.generate")
LORA = "{r: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}"


LAUNCHERS = ("trl", "trl-zero3", "plain", "zero3")
ENGINES = {
    "static": ["--training.cache_implementation", "static"],
    "cb": ["--training.use_transformers_continuous_batching", "true"],
}


@dataclass(frozen=True)
class Setting:
    """One benchmarked configuration, parsed from its name."""

    launcher: str  # trl | trl-zero3 | plain | zero3
    weights: str  # full | lora
    reward: str  # cpr | answer | trivial (trl's default)
    pcgrad: bool
    unmerged: bool = False
    engine: str = ""  # "" (generate, dynamic KV cache) | static | cb (continuous batching)
    credit: bool = False  # reward.step_credit on (weight STEP_CREDIT_WEIGHT)

    @property
    def trl(self) -> bool:
        """Plain ``trl.GRPOTrainer`` (the baseline) rather than this framework's trainer."""
        return self.launcher.startswith("trl")

    @property
    def zero3(self) -> bool:
        return self.launcher.endswith("zero3")

    @classmethod
    def parse(cls, name: str) -> Setting:
        parts = name.split("-")
        if parts[:2] == ["trl", "zero3"]:
            parts = ["trl-zero3"] + parts[2:]
        ok = len(parts) >= 2 and parts[0] in LAUNCHERS and parts[1] in ("full", "lora")
        trl = ok and parts[0].startswith("trl")
        rest = parts[2:] if ok else []
        engine = rest.pop() if rest and rest[-1] in ENGINES else ""
        unmerged = ok and parts[1] == "lora" and rest[:1] == ["unmerged"]
        rest = rest[1:] if unmerged else rest
        reward = "trivial" if trl else "cpr"
        if rest and rest[0] in (("cpr",) if trl else ("cpr", "answer")):
            reward, rest = rest[0], rest[1:]
        credit = rest[:1] == ["credit"] and not trl
        rest = rest[1:] if credit else rest
        pcgrad = rest == ["pcgrad"] and not trl
        if not ok or (rest and not pcgrad) or (unmerged and trl):
            raise SystemExit(
                f"setting {name!r}: allowed are trl[-zero3]-(full|lora)[-cpr][-static|-cb] and "
                "(plain|zero3)-(full|lora[-unmerged])[-cpr|-answer][-credit][-pcgrad][-static|-cb]"
            )
        return cls(parts[0], parts[1], reward, pcgrad, unmerged, engine, credit)

    @property
    def baseline(self) -> str:
        """The plain-TRL setting this one is compared with (same weights, same generation)."""
        return "-".join(["trl", self.weights] + ([self.engine] if self.engine else []))

    def name(
        self,
        weights: str | None = None,
        engine: str | None = None,
        reward: str | None = None,
        credit: bool | None = None,
    ) -> str:
        """This setting's name with other weights (``full``, ``lora``, ``lora-unmerged``), another
        generation engine (``""``: default ``generate``), another reward or step credit on or off."""
        weights = weights or (self.weights + ("-unmerged" if self.unmerged else ""))
        engine = self.engine if engine is None else engine
        reward = reward or self.reward
        credit = self.credit if credit is None else credit
        return "-".join(
            [self.launcher, weights]
            + ([reward] if reward != ("trivial" if self.trl else "cpr") else [])
            + (["credit"] if credit else [])
            + (["pcgrad"] if self.pcgrad else [])
            + ([engine] if engine else [])
        )


#: W of the ``-credit`` settings (its cost does not depend on it).
STEP_CREDIT_WEIGHT = 1.0
#: The plain-TRL entry per reward: the trivial one, or the configured reward's functions.
TRL_ENTRIES = {"trivial": "trl", "cpr": "trl-reward"}


def command(name: str, model: str, out: Path, a: argparse.Namespace, cuda: bool) -> list[str]:
    """The command line of one run (from the repository root)."""
    s = Setting.parse(name)
    py = [sys.executable]
    if not s.zero3:
        launch, extra = py, []
    elif cuda:
        launch = py + ["-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/zero3_1x1.yaml"]
        extra = []
    else:
        launch = py + ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        extra = ["--cpu_backend", "gloo", "--training.deepspeed", "configs/accelerate/zero3.json"]
    device = "cuda" if cuda else "cpu"
    reward = {"cpr": "cpr", "answer": "answer_only", "trivial": "cpr"}[s.reward]  # trivial: config only, never built
    args = [
        "--config",
        a.config,
        "--output_dir",
        str(out),
        "--model.name_or_path",
        model,
        "--model.dtype",
        a.dtype,
        "--data.validation",
        "null",
        "--data.validation_fraction",
        "0",
        "--data.max_train_samples",
        "null",
        "--reward.name",
        reward,
        "--reward.params",
        json.dumps({"encoder": a.encoder, "device": device}),
        "--training.max_steps",
        str(a.warmup + a.steps),
        "--training.save_strategy",
        "'no'",
        "--training.per_device_train_batch_size",
        str(a.batch),
        "--training.num_generations",
        str(GENERATIONS),
        "--training.max_completion_length",
        str(a.completion_length),
        "--training.logging_steps",
        "1",
        "--training.learning_rate",
        str(a.learning_rate),
        "--training.seed",
        str(a.seed),
        "--training.disable_tqdm",
        "true",
        "--training.use_cpu",
        str(not cuda).lower(),
    ]
    if s.weights == "lora":
        args += ["--model.lora", LORA.replace("}", f", merge_for_generation: {str(not s.unmerged).lower()}}}")]
    if s.pcgrad:
        args += ["--pcgrad", "true"]
    if s.credit:
        args += ["--reward.step_credit.weight", str(STEP_CREDIT_WEIGHT)]
    args += ENGINES.get(s.engine, [])
    entry = ["-m", "crystal_grpo.train.benchmarks.training", TRL_ENTRIES[s.reward] if s.trl else "grpo"]
    return launch + entry + args + extra


def step_clock(run_dir: str | Path) -> Any:
    """The callback that times a run's steps (transformers loads with it, not with this module)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall and process CPU time between consecutive step ends, and the time in generation
        (``step_clock.json``). CPU time (all threads) is the work done, which on a loaded machine
        varies less than wall time. Generation is timed by TRL's own profiling contexts
        (``transformers.generate``, ``vLLM.generate``, ...), which TRL hands only to experiment
        trackers: their ``_log_metrics`` is wrapped for the run. On CUDA it also records the
        process's peak allocated GPU memory (``peak_gib``, for any trainer; null on CPU), and
        whether the model's parameters are ZeRO-3 partitions (``zero3``); and the process's peak resident set
        (``rss_gib``), the memory a CPU run has."""

        def __init__(self, run_dir: str | Path) -> None:
            self.path = Path(run_dir) / CLOCK_FILE
            self.ends: list[tuple[float, float]] = []
            self.gen: list[float] = []
            self._pending = 0.0

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from trl.extras.profiling import ProfilingContext

            self.zero3 = model is not None and any(hasattr(p, "ds_id") for p in model.parameters())
            self.ends, self.gen, self._pending = [(time.perf_counter(), time.process_time())], [], 0.0
            original = self._original = ProfilingContext._log_metrics
            clock = self

            def log_metrics(ctx, duration: float) -> None:
                if ctx.name.split(".", 1)[-1] in GENERATION_BLOCKS:
                    clock._pending += duration
                original(ctx, duration)

            ProfilingContext._log_metrics = log_metrics

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append((time.perf_counter(), time.process_time()))
            self.gen.append(self._pending)
            self._pending = 0.0

        def on_train_end(self, args, state, control, **kwargs):
            from trl.extras.profiling import ProfilingContext

            ProfilingContext._log_metrics = self._original
            if state.is_world_process_zero:
                import torch

                pairs = list(zip(self.ends, self.ends[1:]))
                peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
                wall, cpu = [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]
                times = {"wall": wall, "cpu": cpu, "gen": self.gen}
                self.path.write_text(json.dumps({**times, "peak_gib": peak, "rss_gib": rss, "zero3": self.zero3}))

    return StepClock(run_dir)


def trivial_reward(completions, **kwargs) -> list[float]:
    """The baseline's reward: as cheap as a reward can be (the completion's length parity)."""
    return [float(len(c if isinstance(c, str) else str(c)) % 2) for c in completions]


def run_trl(argv: list[str], configured_reward: bool = False) -> None:
    """Plain ``trl.GRPOTrainer`` on exactly what ``train/grpo.py`` would build from ``argv``, with
    the trivial reward or the configured reward module's TRL functions (``reward_funcs()``)."""
    from trl import GRPOTrainer

    from crystal_grpo.train.data.splits import load_datasets
    from crystal_grpo.train.grpo import setup_distributed, training_args
    from crystal_grpo.train.models.loading import load_policy, peft_config
    from crystal_grpo.train.trainer.callbacks import MetricsJsonlCallback

    cfg, out = config_and_folder(argv)
    out.mkdir(parents=True, exist_ok=True)
    args = training_args(cfg, out, setup_distributed(cfg))
    reward_funcs = cfg.reward.build().reward_funcs() if configured_reward else trivial_reward
    train, _ = load_datasets(cfg.data, seed=int(cfg.training.get("seed", 42)))
    model, processing_class = load_policy(cfg.model)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train.dataset,
        processing_class=processing_class,
        peft_config=peft_config(cfg.model, model),
    )
    trainer.add_callback(MetricsJsonlCallback(out))
    trainer.add_callback(step_clock(out))
    trainer.train()


def run_grpo(argv: list[str]) -> int:
    """``train/grpo.py`` with the :func:`step_clock`."""
    from crystal_grpo.train import grpo

    cfg, out = config_and_folder(argv)
    grpo.run(cfg, out, callbacks=[step_clock(out)])
    return 0


def config_and_folder(argv: list[str]):
    """``--config NAME --output_dir DIR [--section.key value ...]``, as train/grpo.py reads them."""
    from crystal_grpo.train.config.run_config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--output_dir", required=True)
    known, overrides = ap.parse_known_args(argv)
    return load_config(known.config, overrides)[0], Path(known.output_dir)


def summarise(out: Path, warmup: int) -> dict[str, float]:
    """Medians over the measured steps (after ``warmup``) of one run's records."""
    rows = read_jsonl(out / METRICS_LOG)
    steps = [r for r in rows if "step_time" in r][warmup:]
    if not steps:
        raise SystemExit(f"{out}: no measured steps in {METRICS_LOG}")

    def med(key: str) -> float:
        return statistics.median([r[key] for r in steps if key in r] or [math.nan])

    score = next((k for k in steps[0] if k.endswith("/scoring_seconds")), "")
    prefix = score.removesuffix("scoring_seconds")
    clock = json.loads((out / CLOCK_FILE).read_text()) if (out / CLOCK_FILE).exists() else {}
    peak = [r["memory/max_allocated_gb"] for r in rows if "memory/max_allocated_gb" in r]
    peak += [clock["peak_gib"]] if clock.get("peak_gib") is not None else []
    wall, cpu, gen = (clock.get(k, [])[warmup:] for k in ("wall", "cpu", "gen"))
    net = [r["step_time"] - r.get(score, 0.0) for r in steps]  # the step without the reward's scoring
    return {
        "step": med("step_time"),
        "net": statistics.median(net),
        "wall": statistics.median(wall) if wall else math.nan,
        "cpu": statistics.median(cpu) if cpu else math.nan,
        "gen": statistics.median(gen) if gen else math.nan,
        "tokens": med("completions/mean_length"),
        "score": med(score),
        "format": med(prefix + "format_rate"),
        "steps": med(prefix + "steps_mean"),
        "peak": max(peak, default=math.nan),
        "rss": clock.get("rss_gib") or math.nan,
        "zero3": clock.get("zero3"),
    }


def ratio(
    results: dict[str, list[dict]], name: str, other: str | None, key: str, per_token: bool = True
) -> tuple[float, float, float]:
    """Median and range over rounds of this run's ``key`` (per token: equal work when completions differ
    in length) over ``other``'s in the same round."""
    if other is None or other not in results or name == other:
        return math.nan, math.nan, math.nan
    norm = (lambda r: r[key] / r["tokens"]) if per_token else (lambda r: r[key])
    rs = [norm(a) / norm(b) for a, b in zip(results[name], results[other])]
    return statistics.median(rs), min(rs), max(rs)


def table(results: dict[str, list[dict]]) -> str:
    """One line per setting: medians over rounds, spread, ratios against plain TRL, full weights
    and default generation."""

    def fmt_ratio(r: tuple[float, float, float]) -> str:
        return "-" if math.isnan(r[0]) else f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"

    head = (
        f"{'setting':<24}{'step s':>8}{'spread':>8}{'wall s':>8}{'tokens':>8}{'step/trl':>18}"
        f"{'net/trl':>18}{'wall/trl':>18}{'cpu/trl':>18}{'lora/full':>18}{'gen/default':>18}{'credit/cpr':>18}"
        f"{'mem/cpr':>18}{'peak GiB':>9}{'rss GiB':>8}"
        f"{'gen s':>7}{'score s':>9}{'share':>7}{'format':>7}{'steps':>6}"
    )
    lines = [head, "-" * len(head)]
    cuda_peak = any(not math.isnan(r["peak"]) for runs in results.values() for r in runs)  # else the CPU's rss
    for name, runs in results.items():
        s = Setting.parse(name)
        med = lambda k: statistics.median([r[k] for r in runs])
        steps = [r["step"] for r in runs]
        spread = (max(steps) - min(steps)) / med("step") if len(runs) > 1 else 0.0
        lora_vs = ratio(results, name, s.name(weights="full"), "step") if s.weights == "lora" else (math.nan,) * 3
        gen_vs = ratio(results, name, s.name(engine=""), "step") if s.engine else (math.nan,) * 3
        cpr = s.name(reward="cpr", credit=False) if s.credit else None  # the same setting with CPR, no credit
        credit_vs = ratio(results, name, cpr, "step")
        memory_vs = ratio(results, name, cpr, "peak" if cuda_peak else "rss", per_token=False)
        lines.append(
            f"{name:<24}{med('step'):>8.3f}{spread:>8.1%}{med('wall'):>8.3f}{med('tokens'):>8.1f}"
            f"{fmt_ratio(ratio(results, name, s.baseline, 'step')):>18}"
            f"{fmt_ratio(ratio(results, name, s.baseline, 'net')):>18}"
            f"{fmt_ratio(ratio(results, name, s.baseline, 'wall')):>18}"
            f"{fmt_ratio(ratio(results, name, s.baseline, 'cpu')):>18}{fmt_ratio(lora_vs):>18}{fmt_ratio(gen_vs):>18}"
            f"{fmt_ratio(credit_vs):>18}{fmt_ratio(memory_vs):>18}"
            f"{med('peak'):>9.2f}{med('rss'):>8.2f}{med('gen'):>7.3f}{med('score'):>9.3f}"
            f"{med('score') / med('step'):>7.1%}{med('format'):>7.2f}"
            f"{med('steps'):>6.1f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command
DESCRIPTION = """Benchmark GRPO training: this framework against plain TRL, LoRA against full fine-tuning,
DeepSpeed ZeRO-3 against one process (one table, every ratio measured in the same run).

    python scripts/bench_train.py [--model tiny|organism|mid|PATH] [--device cpu|cuda]
        [--settings trl-full,plain-full-answer,plain-full,plain-full-pcgrad,...] [--rounds 2]
        [--steps 5] [--warmup 2] [--batch 8] [--completion_length 128] [--threads N]

Settings are ``trl-(full|lora)`` (the baseline) or ``(plain|zero3)-(full|lora[-unmerged])
[-cpr|-answer][-pcgrad][-static|-cb]``; every setting runs the same model, data, batch, seed and
GRPOConfig. The settings, the models and the columns: docs/benchmarks.md, "What
bench_train.py runs and prints".
"""
REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = REPO_ROOT / ".cache" / "models"
DEFAULT_SETTINGS = "trl-full,plain-full-answer,plain-full,plain-full-pcgrad,trl-lora,plain-lora"


def build_model(name: str) -> str:
    """Path of ``tiny`` / ``mid`` (built on first use), the organism's warm start (its data
    written on first use) or the folder given."""
    if name == "organism":
        from crystal_grpo.train.organism.make import DEFAULT_DIR, WARM_START_DIR
        from crystal_grpo.train.organism.task import Layout, write_splits

        data = REPO_ROOT / DEFAULT_DIR / "data"
        if not (data / "train.jsonl").exists():
            write_splits(Layout(), data)
        return str(REPO_ROOT / WARM_START_DIR)
    if name not in ("tiny", "mid"):
        return name
    from crystal_grpo.train.fixtures import tiny_models as mk

    build = mk.build_tiny_lm if name == "tiny" else mk.build_mid_lm
    return str(build(MODELS / ("tiny-qwen2" if name == "tiny" else "mid-qwen2")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="completions per step (a multiple of 8)")
    ap.add_argument("--completion_length", type=int, default=128)
    ap.add_argument("--learning_rate", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--encoder", default="packaged:all-MiniLM-L6-v2")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per run (OMP_NUM_THREADS)")
    ap.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench_train"))
    a = ap.parse_args(argv)
    import torch  # after the arguments: --help answers at once

    cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    if a.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(a.threads)
    model = build_model(a.model)
    # the organism runs its own config (data, prompt, validation off) and matches steps exactly
    a.config = "organism.yaml" if a.model == "organism" else "tiny.yaml"
    if a.model == "organism" and a.encoder == ap.get_default("encoder"):
        a.encoder = "exact"
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    settings = a.settings.split(",")
    print(
        f"GRPO steps on {device}, {time.strftime('%Y-%m-%d')}: model {Path(model).name}, {a.dtype}, "
        f"{a.batch} completions x <= {a.completion_length} tokens, lr {a.learning_rate}, seed {a.seed}, "
        f"encoder {a.encoder}, threads {a.threads or 'default'}; median of {a.steps} steps after {a.warmup}, "
        f"{a.rounds} round(s) of "
        f"{len(settings)} settings",
        flush=True,
    )
    results: dict[str, list[dict]] = {s: [] for s in settings}
    for rnd in range(a.rounds):
        for setting in settings[rnd % len(settings) :] + settings[: rnd % len(settings)]:  # no setting always first
            out = Path(a.out) / f"{Path(model).name}-{setting}"
            shutil.rmtree(out, ignore_errors=True)
            proc = subprocess.run(
                command(setting, model, out, a, cuda), cwd=REPO_ROOT, env=env, capture_output=True, text=True
            )
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
                raise SystemExit(f"{setting}: exit {proc.returncode}")
            r = summarise(out, a.warmup)
            results[setting].append(r)
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            print(
                f"  round {rnd + 1} {setting:<22} step {r['step']:.3f} s  wall {r['wall']:.3f} s  "
                f"tokens {r['tokens']:.1f}  (load {load:.2f})",
                file=sys.stderr,
                flush=True,
            )
    print(table(results))
    return 0


def run(argv: list[str]) -> int:
    """One benchmarked run (a subprocess of :func:`main`): ENTRY and train/grpo.py's arguments."""
    entry, rest = argv[0], argv[1:]
    if entry in TRL_ENTRIES.values():
        run_trl(rest, configured_reward=entry != TRL_ENTRIES["trivial"])
        return 0
    if entry == "grpo":
        return run_grpo(rest)
    raise SystemExit(
        f"usage: python -m crystal_grpo.train.benchmarks.training trl|trl-reward|grpo --config ... (got {entry!r})"
    )


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
