"""What ``scripts/bench_sweep.py`` runs: the same points of a sweep started in several ways, side by side.

A mode names how ``scripts/sweep.py`` runs them: ``jobs<N>`` (points at a time; with N > 1 each
gets cores / N torch threads), then ``-fork`` (runs forked from one process that imported the
libraries: train/tools/launch.py) or ``-spawn`` (a new interpreter a run, ``--no_fork``). Each
mode runs every point from scratch, in a folder of its own; rounds rotate the modes' order so
that a machine's load drift falls on all of them. Reported per mode: the sweep's wall time, its
CPU seconds (the sweep process and every run it started), and the wall time per point.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from crystal_grpo.train.tools import launch


def sweep_argv(mode: str) -> list[str]:
    """``jobs2-fork`` -> ``--jobs 2``; ``jobs1-spawn`` -> ``--jobs 1 --no_fork``."""
    jobs, _, start = mode.partition("-")
    if not jobs.startswith("jobs") or not jobs[4:].isdigit() or start not in ("fork", "spawn"):
        raise SystemExit(f"mode {mode!r}: expected jobs<N>-fork or jobs<N>-spawn")
    return ["--jobs", jobs[4:]] + (["--no_fork"] if start == "spawn" else [])


def run_mode(sweep: str, points: list[str], mode: str, out: Path, root: Path) -> dict[str, float]:
    """One sweep run of ``points`` in ``mode``: wall and CPU seconds."""
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    argv = [sys.executable, "scripts/sweep.py", sweep, "--output_dir", str(out), *sweep_argv(mode)]
    proc = subprocess.run(argv + [a for p in points for a in ("--point", p)], cwd=root, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{mode}: the sweep exited with {proc.returncode}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall": wall, "cpu": cpu, "per_point": wall / len(points)}


def table(results: dict[str, list[dict[str, float]]], baseline: str) -> str:
    """Medians over rounds; ratios against ``baseline`` paired within a round (min-max)."""
    head = f"{'mode':<14}{'wall s':>9}{'CPU s':>9}{'wall s/point':>14}{'wall/base':>18}{'CPU/base':>18}"
    lines = [head, "-" * len(head)]
    for mode, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu", "per_point")}
        cells = []
        for key in ("wall", "cpu"):
            rs = [r[key] / b[key] for r, b in zip(runs, results[baseline])]
            cells.append(f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})")
        lines.append(
            f"{mode:<14}{med['wall']:>9.1f}{med['cpu']:>9.1f}{med['per_point']:>14.1f}"
            + "".join(f"{c:>18}" for c in cells)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, root: Path = Path.cwd()) -> int:  # noqa: B008 - the start folder
    ap = argparse.ArgumentParser(
        description="Time the same points of a sweep run in several ways, side by side.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("sweep", help="a sweep YAML")
    ap.add_argument("--point", action="append", required=True, help="a point to run (repeatable)")
    ap.add_argument(
        "--modes", default="jobs1-spawn,jobs2-spawn,jobs2-fork", help="comma-separated; the first is the baseline"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="runs/bench_sweep")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    for mode in modes:
        sweep_argv(mode)  # every mode checked before the first run
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for rnd in range(a.rounds):
        for mode in modes[rnd % len(modes) :] + modes[: rnd % len(modes)]:
            r = run_mode(a.sweep, a.point, mode, Path(a.out) / mode, root)
            results[mode].append(r)
            print(
                f"  round {rnd + 1} {mode:<12} wall {r['wall']:.1f} s  CPU {r['cpu']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(
        f"{len(a.point)} point(s) of {a.sweep} ({', '.join(a.point)}), {a.rounds} round(s), {launch.cores()} cores, "
        f"OMP_NUM_THREADS {threads} (the jobs1 modes' threads)"
    )
    print(table(results, modes[0]))
    return 0
