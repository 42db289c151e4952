"""The suite's own machinery (tests/conftest.py): the tests that share a module's run stay on one
pytest-xdist worker, so the run is made once, not once per worker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

SHARING = """
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def made_once():
    return object()


@pytest.mark.parametrize("i", range(6))
def test_sharing(made_once, i):
    (Path(os.environ["WORKERS"]) / str(i)).write_text(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
"""


def test_the_tests_of_a_module_fixture_run_on_one_worker(tmp_path, repo_root):
    (tmp_path / "tests").mkdir()
    shutil.copy(repo_root / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_sharing.py").write_text(SHARING)
    workers = tmp_path / "workers"
    workers.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    proc = subprocess.run(
        [*cmd, "-m", "not slow", "tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WORKERS": str(workers)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran_on = {p.read_text() for p in workers.iterdir()}
    assert len(list(workers.iterdir())) == 6 and len(ran_on) == 1, ran_on
