"""Every script in scripts/ answers ``--help`` with its usage and nothing else:
no model built (``make_tiny_models.py --help`` built into ``./--help/``), no data written
(``demo.py --help`` wrote the organism's data first), and nothing heavy loaded on the way (torch
and the model stack load after the arguments are parsed, so the answer comes at once)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py"))
HEAVY = ("torch", "transformers", "trl", "datasets", "deepspeed", "sentence_transformers")

#: ``python -c`` program: the script as ``__main__`` with ``--help``, then which heavy modules it loaded (stderr).
HELP = f"""
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("loaded:", [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)
"""


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts)


def _git_status() -> str | None:
    """The checkout's changed and untracked files (None outside a git checkout)."""
    proc = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True, text=True
    )
    return proc.stdout if proc.returncode == 0 else None


@pytest.fixture(scope="module")
def copied(tmp_path_factory) -> Path:
    """scripts/ copied into an empty folder, run from there: what a script writes next to its own
    checkout (its ROOT) or into the folder it runs in lands where the test sees it."""
    root = tmp_path_factory.mktemp("scripts-copy")
    shutil.copytree(REPO / "scripts", root / "scripts")
    return root


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_with_its_usage_and_nothing_else(copied, script):
    before, status = _files(copied), _git_status()
    proc = subprocess.run(
        [sys.executable, "-c", HELP, f"scripts/{script}"], cwd=copied, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: {script}"), proc.stdout[:500]
    assert proc.stderr.strip().splitlines()[-1] == "loaded: []", proc.stderr[-2000:]
    assert _files(copied) == before  # nothing built, written or downloaded
    assert _git_status() == status  # nor in the checkout
