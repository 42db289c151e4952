"""Helpers for tests that launch train/grpo.py as a real process (kills, signals, locks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def grpo_cmd(run: Path, model: Path, *extra: str) -> list[str]:
    """``python train/grpo.py`` on tiny.yaml into ``run``."""
    return [sys.executable, "train/grpo.py", "--config", "tiny.yaml", "--output_dir", str(run),
            "--model.name_or_path", str(model), *extra]


def env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def grpo_with(patch: str) -> str:
    """A ``python -c`` program: ``patch`` (which wraps one method), then train/grpo.py's main."""
    return f"import os, signal, sys, time\n{patch}\nfrom crystal_grpo.train import grpo\nsys.exit(grpo.main(sys.argv[1:]))\n"


def logged_steps(run: Path, name: str = "metrics.jsonl", key: str = "loss") -> list[int]:
    """The steps of ``name``'s rows that carry ``key``, in file order (a step logged twice shows twice)."""
    rows = [json.loads(x) for x in (run / name).read_text().splitlines()]
    return [r["step"] for r in rows if key in r]


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until ``path`` exists and is not empty (the process still alive)."""
    end = time.time() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < end, "timed out"
        time.sleep(0.2)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time (ns): what "nothing changed" compares."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}
