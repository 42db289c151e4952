"""The locked set of versions (requirements.lock, crystal_grpo/lock.py): what make installs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from crystal_grpo import lock

REPO = Path(__file__).resolve().parents[1]


#: The venvs make fills from a lock: `make test` / `make demo`'s, and make test-vllm-set's (the
#: vLLM set's versions on CPU, vLLM itself left out).
MAKE_VENVS = {".venv": "requirements.lock", ".cache/vllm-set-venv": "requirements-vllm.lock"}


def test_the_make_venv_holds_exactly_the_locked_set():
    """Every distribution of a venv make fills is pinned by its lock and at its locked release
    (another venv, e.g. make test-latest's, is not a lock's by design)."""
    venv = next((name for name in MAKE_VENVS if Path(sys.prefix).resolve() == (REPO / name).resolve()), None)
    if venv is None:
        pytest.skip(f"not a venv make manages ({sys.prefix})")
    assert lock.drift(REPO / MAKE_VENVS[venv]) == []


def test_the_vllm_set_is_trls_vllm_range_with_the_tested_trl_resolved_for_a_gpu_machine():
    """requirements-vllm.lock: a vLLM release TRL's vllm extra allows, the TRL of requirements.lock
    (PCGrad's hooks are verified against it), and the CUDA build of torch's own dependencies
    pinned: resolved as a GPU machine sees the index, not from this machine's CPU torch wheel
    (whose dependencies differ: the CUDA build pins triton and the CUDA wheels)."""
    from packaging.specifiers import SpecifierSet

    from crystal_grpo.train.models.generation import trl_vllm_range

    pins, main = lock.read(REPO / "requirements-vllm.lock"), lock.read(REPO / "requirements.lock")
    assert pins["vllm"] in SpecifierSet(trl_vllm_range())
    assert pins["trl"] == main["trl"]
    assert {"triton", "nvidia-cudnn-cu13"} <= set(pins) and "nvidia-cudnn-cu13" not in main
    assert lock.resolved_for(REPO / "requirements-vllm.lock") == lock.python_tag()


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


# The resolved locks (the vLLM set): pip's resolver in dry-run against a package index. Here the
# index is a folder of tiny wheels made by the test (file://), so nothing leaves the machine.


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal wheel of ``name`` in a PEP 503 project folder of ``folder`` (with its index.html)."""
    import zipfile

    project = folder / lock.canonical(name)
    project.mkdir(parents=True, exist_ok=True)
    file = f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(project / file, "w") as whl:
        whl.writestr(f"{info}/METADATA", metadata)
        whl.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{info}/RECORD", "")
    links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
    (project / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A package index of app (which needs lib < 2) and lib 1.0, 1.5, 2.0, as PIP_INDEX_URL."""
    folder = tmp_path / "index"
    _wheel(folder, "app", "1.0", ("lib<2",))
    for version in ("1.0", "1.5", "2.0"):
        _wheel(folder, "lib", version)
    monkeypatch.setenv("PIP_INDEX_URL", folder.as_uri())
    monkeypatch.setenv("PIP_FIND_LINKS", "/nonexistent-wheel-folder")  # left out by index_env
    return folder


def test_resolve_writes_the_newest_allowed_versions_for_this_python(index, tmp_path, capsys):
    path = tmp_path / "requirements-x.lock"
    assert lock.main(["resolve", str(path), "app"]) == 0
    assert lock.read(path) == {"app": "1.0", "lib": "1.5"}  # lib 2.0 is newer but app excludes it
    assert lock.resolved_for(path) == lock.python_tag() and lock.main(["fits", str(path)]) == 0
    assert "wrote" in capsys.readouterr().out


def test_check_passes_a_set_that_resolves_and_names_the_conflict_of_one_that_does_not(index, tmp_path, capsys):
    path = tmp_path / "requirements-x.lock"
    path.write_text("app==1.0\nlib==1.0\n")
    assert lock.main(["check", str(path), "app"]) == 0
    assert "app resolves: 2 distributions" in capsys.readouterr().out
    path.write_text("app==1.0\nlib==2.0\n")  # app needs lib < 2: what a new vLLM pinning transformers does
    assert lock.main(["check", str(path), "app"]) == 1
    err = capsys.readouterr().err
    assert "does not resolve" in err and "ResolutionImpossible" in err and "lib<2" in err and "NOT CHECKED" not in err


def test_check_tells_an_unreachable_index_from_a_set_that_does_not_resolve(tmp_path, monkeypatch, capsys):
    """Nothing listens on port 9 of the loopback address: pip cannot reach that index."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    path = tmp_path / "requirements-x.lock"
    path.write_text("app==1.0\nlib==2.0\n")
    assert lock.main(["check", str(path), "app"]) == 75
    err = capsys.readouterr().err
    assert "NOT CHECKED, the package index did not answer" in err and "does not resolve" not in err


def test_index_env_sees_the_index_only():
    """A GPU machine has no folder of CPU torch wheels: the vLLM set is resolved (and checked)
    without this machine's pip configuration and find-links, the index URL kept."""
    env = lock.index_env("requirements-vllm.lock")
    assert env["PIP_CONFIG_FILE"] == __import__("os").devnull and "PIP_FIND_LINKS" not in env
    assert env["PIP_CONSTRAINT"] == str((Path("requirements-vllm.lock")).resolve())


def test_fits_refuses_another_python_in_one_line(tmp_path, capsys):
    path = tmp_path / "requirements-x.lock"
    path.write_text("# python: CPython-3.99-sparc\napp==1.0\n")
    assert lock.main(["fits", str(path)]) == 1
    err = capsys.readouterr().err
    assert "was resolved for CPython-3.99-sparc, this is " + lock.python_tag() in err and err.count("\n") == 1
    assert lock.main(["fits", str(REPO / "requirements.lock")]) == 0  # a freeze of this machine: no tag
