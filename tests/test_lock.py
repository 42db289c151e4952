"""The locked set of versions (requirements.lock, crystal_grpo/lock.py): what make installs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from crystal_grpo import lock

REPO = Path(__file__).resolve().parents[1]


def test_the_make_venv_holds_exactly_the_locked_set():
    """`make test` / `make demo` install requirements.lock into .venv: every distribution
    there is pinned and at its locked release (another venv, e.g. make test-latest's, is not
    the lock's by design)."""
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip(f"not the venv make manages ({sys.prefix})")
    assert lock.drift(REPO / "requirements.lock") == []


def test_freeze_pins_every_distribution_by_release(tmp_path):
    """A lock line per installed distribution, local labels dropped (torch's +cpu), the
    editable project left out; read() gives back the installed releases."""
    path = tmp_path / "requirements.lock"
    lock.write(path)
    pins = lock.read(path)
    assert pins == {name: v for name, v in lock.installed().items() if name != "crystal-grpo"}
    assert "+" not in "".join(pins.values()) and "torch" in pins and "pip" in pins
    assert lock.drift(path) == []
    path.write_text(path.read_text().replace(f"torch=={pins['torch']}", "torch==0.0.1"))
    assert lock.drift(path) == [f"torch: installed {pins['torch']}, locked 0.0.1"]


def test_a_line_that_is_not_a_pin_is_named(tmp_path):
    path = tmp_path / "requirements.lock"
    path.write_text("# header\naccelerate==1.0\ntorch>=2\n")
    with pytest.raises(ValueError, match=r"requirements.lock:3: 'torch>=2' is not a name==version pin"):
        lock.read(path)
