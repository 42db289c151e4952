"""Kill a run at random moments, resume it, and check the result is the uninterrupted run's.

    python scripts/kill_trials.py --trials 20 --steps 12 --out runs/kill_trials

One uninterrupted reference run of ``tiny.yaml`` (constant learning rate, so an extra or
missing step shows in the weights), then each trial starts the same run, SIGKILLs it
(at a random moment, while a checkpoint is being written, or after the last step), and
launches ``--resume_from_checkpoint latest`` until it exits 0 (a resume is itself killed
at a random moment with probability ``--kill_resume``). A trial passes when every step
and validation point is logged once with the reference's values (losses, rewards, KL,
validation metrics: bit for bit) and ``final/model.safetensors`` is ``torch.equal`` to
the reference's. A last launch of each finished trial checks it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.paths import user_file
from crystal_grpo.train.run.layout import FINAL, LOCK, MARKER, METRICS_LOG, RECORD, VALIDATION_LOG, checkpoint_name

ROOT = Path(__file__).resolve().parents[2]
#: Logged values that must match the reference exactly (timings are not compared).
COMPARED = (
    "loss",
    "reward",
    "reward_std",
    "kl",
    "entropy",
    "grad_norm",
    "learning_rate",
    "num_tokens",
    "completions/mean_length",
    "frac_reward_zero_std",
)
MODES = ("random", "saving", "after_last")


@dataclass
class Trial:
    mode: str
    kills: list[str] = field(default_factory=list)
    launches: int = 0
    problems: list[str] = field(default_factory=list)


def command(model: str, out: Path, steps: int, resume: bool) -> list[str]:
    return [
        sys.executable,
        "train/grpo.py",
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(out),
        "--model.name_or_path",
        model,
        "--training.max_steps",
        str(steps),
        "--training.save_steps",
        "2",
        "--training.lr_scheduler_type",
        "constant",
        "--validation.eval_steps",
        "2",
        "--validation.max_samples",
        "2",
        *(["--resume_from_checkpoint", "latest"] if resume else []),
    ]


def _saving(out: Path, step: int) -> bool:
    """``checkpoint-<step>`` is being written (its folder is there, its marker not yet)."""
    folder = out / checkpoint_name(step)
    return folder.is_dir() and not (folder / MARKER).exists()


def _after_last(out: Path, steps: int) -> bool:
    return (out / checkpoint_name(steps) / MARKER).exists()


def launch(
    cmd: list[str], kill: str | None, deadline: float | None, out: Path, steps: int, log, save_step: int = 2
) -> str:
    """Run ``cmd``; kill it by ``kill`` (a mode: at ``deadline`` seconds, while writing
    ``checkpoint-<save_step>``, after the last step). Returns how it ended."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    start = time.monotonic()
    while proc.poll() is None:
        if (
            (kill == "saving" and _saving(out, save_step))
            or (kill == "after_last" and _after_last(out, steps))
            or (kill == "random" and deadline is not None and time.monotonic() - start >= deadline)
        ):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            where = checkpoint_name(save_step) if kill == "saving" else f"{time.monotonic() - start:.1f}s"
            return f"{kill}@{where}"
        time.sleep(0.005)
    return f"exit {proc.returncode}"


def compare(ref: Path, run: Path) -> list[str]:
    """What differs between two run folders (empty: identical)."""
    import torch
    from safetensors.torch import load_file

    problems = []
    for name, keys in ((METRICS_LOG, COMPARED), (VALIDATION_LOG, ("accuracy", "f1", "format_rate", "reward"))):
        mine = [r for r in read_jsonl(run / name) if any(k in r for k in keys)]
        theirs = [r for r in read_jsonl(ref / name) if any(k in r for k in keys)]
        if [r["step"] for r in mine] != [r["step"] for r in theirs]:
            problems.append(f"{name}: steps {[r['step'] for r in mine]}, reference {[r['step'] for r in theirs]}")
            continue
        for a, b in zip(mine, theirs):
            diff = [k for k in keys if a.get(k) != b.get(k)]
            if diff:
                problems.append(f"{name} step {a['step']}: {', '.join(f'{k} {a.get(k)} vs {b.get(k)}' for k in diff)}")
    try:
        a, b = load_file(run / FINAL / "model.safetensors"), load_file(ref / FINAL / "model.safetensors")
        unequal = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
        if unequal:
            problems.append(f"final weights differ in {len(unequal)} tensor(s), e.g. {unequal[0]}")
    except OSError as err:
        problems.append(f"{FINAL}/model.safetensors: {err}")
    return problems


def _snapshot(folder: Path) -> dict:
    skip = {RECORD, LOCK}
    return {
        str(p.relative_to(folder)): p.stat().st_mtime_ns
        for p in folder.rglob("*")
        if p.is_file() and p.name not in skip
    }


def run_trials(
    model: str, out: Path, trials: int, steps: int, seed: int, kill_resume: float, say=print
) -> tuple[list[Trial], float]:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    ref = out / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    t0 = time.monotonic()
    with open(out / "reference.log", "w") as log:
        if launch(command(model, ref, steps, False), None, None, ref, steps, log) != "exit 0":
            raise RuntimeError(f"the reference run failed; see {out / 'reference.log'}")
    wall = time.monotonic() - t0
    say(f"reference run: {steps} steps in {wall:.1f} s")
    results = []
    for i in range(trials):
        mode = MODES[i % len(MODES)] if i < len(MODES) * 2 else rng.choice(MODES)
        folder = out / f"trial{i:02d}"
        shutil.rmtree(folder, ignore_errors=True)
        trial = Trial(mode)
        with open(out / f"trial{i:02d}.log", "w") as log:
            save_step = 2 * rng.randint(1, steps // 2)  # checkpoints every 2 steps: which save is hit
            ended = launch(
                command(model, folder, steps, False), mode, rng.uniform(0, wall), folder, steps, log, save_step
            )
            trial.launches = 1
            while not ended.startswith("exit"):
                trial.kills.append(ended)
                again = rng.random() < kill_resume and len(trial.kills) < 3
                ended = launch(
                    command(model, folder, steps, True),
                    "random" if again else None,
                    rng.uniform(0, wall),
                    folder,
                    steps,
                    log,
                )
                trial.launches += 1
            if ended != "exit 0":
                trial.problems.append(f"{ended} (log: {out / f'trial{i:02d}.log'})")
            else:
                trial.problems += compare(ref, folder)
                before = _snapshot(folder)
                relaunch = launch(command(model, folder, steps, True), None, None, folder, steps, log)
                if relaunch != "exit 0" or _snapshot(folder) != before:
                    trial.problems.append(f"launching the finished run again changed it ({relaunch})")
        say(
            f"trial {i:2d} {mode:10s} kills {', '.join(trial.kills) or '-':28s} launches {trial.launches}  "
            + ("identical" if not trial.problems else "DIFFERENT: " + "; ".join(trial.problems))
        )
        results.append(trial)
    return results, wall


def table(results: list[Trial]) -> str:
    rows = ["| kill moment | trials | kills | identical to the uninterrupted run |", "|---|---|---|---|"]
    for mode in MODES:
        rs = [t for t in results if t.mode == mode]
        if rs:
            rows.append(
                f"| {mode.replace('_', ' ')} | {len(rs)} | {sum(len(t.kills) for t in rs)} | "
                f"{sum(not t.problems for t in rs)} of {len(rs)} |"
            )
    rows.append(
        f"| all | {len(results)} | {sum(len(t.kills) for t in results)} | "
        f"{sum(not t.problems for t in results)} of {len(results)} |"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default=str(ROOT / ".cache" / "models" / "tiny-qwen2"),
        help="the tiny model (scripts/make_tiny_models.py builds it)",
    )
    ap.add_argument("--out", type=user_file, default=ROOT / "runs" / "kill_trials")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill_resume", type=float, default=0.3, help="chance that a resume is killed again")
    args = ap.parse_args(argv)
    if not Path(args.model).is_dir():
        print(f"error: no model folder {args.model}; run scripts/make_tiny_models.py first", file=sys.stderr)
        return 2
    results, _ = run_trials(args.model, args.out, args.trials, args.steps, args.seed, args.kill_resume)
    print("\n" + table(results))
    (args.out / "results.json").write_text(json.dumps([vars(t) for t in results], indent=2))
    return 0 if all(not t.problems for t in results) else 1
