"""The package as a user installs it: a wheel (not an editable checkout) in a fresh venv, used
from a folder that is not the checkout, through its console scripts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a venv holding the built wheel; its dependencies come from the test venv's
    site-packages (offline), whose editable install of the checkout is not on its path."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"  # built from a copy: the build leaves build/ and *.egg-info where it runs
    skip = shutil.ignore_patterns(".git", ".venv", ".cache", "runs", "build", "*.egg-info", "__pycache__")
    # the data sets in data/ (generated, large) stay behind; train/data/ is a package of the wheel
    shutil.copytree(REPO, src, ignore=lambda d, names: skip(d, names) | ({"data"} if Path(d) == REPO else set()))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    (tmp / "build.log").write_text(built.stdout + built.stderr)  # what test_the_build_is_quiet reads
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("crystal_grpo-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        timeout=600,
    )
    site = next((venv / "lib").glob("python3*/site-packages"))
    # a .pth line adds a folder to sys.path, but the folder's own .pth files (the editable
    # finder of the checkout) are not run
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_the_wheel_trains_and_sweeps_from_any_folder(installed, tiny_lm_path, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run(
        [
            str(installed / "python"),
            "-c",
            "import crystal_grpo.train, crystal_grpo.configs as c; "
            "print(crystal_grpo.train.__file__); print(list(c.__path__)[0])",
        ],
        work,
    )
    assert where.returncode == 0, where.stderr
    module, configs = where.stdout.split()
    assert module.startswith(str(installed.parent)) and not module.startswith(str(REPO)), module
    assert (Path(configs) / "cpr_curriculum.yaml").is_file() and (Path(configs) / "sweeps" / "tiny.yaml").is_file()

    data = [
        f"--data.train={REPO / 'data/wordproblems/train.jsonl'}",
        f"--data.validation={REPO / 'data/wordproblems/val.jsonl'}",
        f"--model.name_or_path={tiny_lm_path}",
    ]
    train = _run(
        [
            str(installed / "crystal-grpo-train"),
            "--config",
            "tiny.yaml",
            "--training.max_steps",
            "1",
            "--output_dir",
            "runs/one",
            *data,
        ],
        work,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert (work / "runs" / "one" / "final" / "model.safetensors").is_file()

    # a sweep launches its points through the installed module, not a checkout's train/grpo.py
    emitted = _run(
        [
            str(installed / "crystal-grpo-sweep"),
            str(REPO / "configs/sweeps/tiny.yaml"),
            "--output_dir",
            "runs/sweep",
            "--emit",
            "commands",
        ],
        work,
    )
    assert emitted.returncode == 0, emitted.stderr[-2000:]
    lines = emitted.stdout.splitlines()
    assert len(lines) == 2 and all(
        f"cd {work} && " in x and " -m crystal_grpo.train.grpo --config " in x and "train/grpo.py" not in x
        for x in lines
    ), lines

    for tool in ("crystal-grpo-evaluate", "crystal-grpo-export", "crystal-grpo-score"):
        shown = _run([str(installed / tool), "--help"], work)
        assert shown.returncode == 0 and shown.stdout.startswith(f"usage: {tool}"), (tool, shown.stderr[-500:])


@pytest.mark.slow  # the wheel's build (no model)
def test_the_build_is_quiet(installed):
    """Every folder of configs/ is a declared package: setuptools warned twice in 80 lines that
    it found crystal_grpo.configs.accelerate and .sweeps undeclared (make setup printed them)."""
    log = (installed.parents[1] / "build.log").read_text()
    assert "BuildBackendWarning" not in log and "absent from the `packages` configuration" not in log, log[-3000:]


def test_every_config_folder_is_a_package_whose_files_its_package_data_names():
    import fnmatch

    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent for p in (REPO / "configs").rglob("*") if p.is_file()}
    for folder in folders:
        package = ".".join(["crystal_grpo.configs", *folder.relative_to(REPO / "configs").parts])
        assert package in setuptools["packages"], package
        patterns = setuptools["package-data"].get(package, [])
        unnamed = [
            p.name for p in folder.iterdir() if p.is_file() and not any(fnmatch.fnmatch(p.name, x) for x in patterns)
        ]
        assert not unnamed, (package, unnamed)
