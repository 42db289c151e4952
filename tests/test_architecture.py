"""The package's layering, checked on the source: each package (a folder of modules) imports only
the packages below it, so no folder imports one above it and no two folders import each other; the
core a training run needs never imports the tools built on it; no private name crosses a module
boundary, and no two modules import each other (at module level or inside a function).

The layers, lowest first (:data:`LAYERS`): ``crystal_grpo`` (shared helpers, statistics, the metric
table) < ``rewards`` < ``curricula`` < the core of ``train``, each folder a layer of its own: ``data``
(rows read and checked) < ``run`` (the run folder) < ``models`` (loading, generation) < ``config``
(the run config's sections and refusals) < ``trainer`` < ``pcgrad`` < ``capacity`` < ``grpo.py`` (the
entry point) < what is built on a run: ``fixtures`` (the test and demo builders) < ``organism`` <
``tools`` < ``benchmarks``. ``if TYPE_CHECKING:`` imports are annotations only and are not counted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The packages, lowest layer first; each package's folder is its name under the repository, as
#: pyproject.toml maps them.
LAYERS = [
    "crystal_grpo",
    "crystal_grpo.rewards",
    "crystal_grpo.curricula",
    *(f"crystal_grpo.train.{p}" for p in ("data", "run", "models", "config", "trainer", "pcgrad", "capacity")),
    "crystal_grpo.train",
    *(f"crystal_grpo.train.{p}" for p in ("fixtures", "organism", "tools", "benchmarks")),
]
LAYER = {pkg: i for i, pkg in enumerate(LAYERS)}
PACKAGES = {
    pkg: pkg.removeprefix("crystal_grpo.").replace(".", "/") if pkg != "crystal_grpo" else pkg for pkg in LAYER
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted((REPO / folder).glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


MODULES = modules()


def package_of(module: str) -> str:
    return module if module in PACKAGES else module.rsplit(".", 1)[0]


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


def imports(module: str) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import in ``module``, at any depth."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    skip = _type_checking_only(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("crystal_grpo"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.append((full, None) if full in MODULES else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("crystal_grpo")]
    return out


def test_every_module_is_seen():
    assert {
        "crystal_grpo.train.trainer.grpo_trainer",
        "crystal_grpo.train.tools.evaluate",
        "crystal_grpo.metrics",
        "crystal_grpo.rewards.cpr",
        "crystal_grpo.curricula.sampler",
    } <= set(MODULES)


def test_every_source_folder_is_a_layered_package_the_wheel_ships():
    """A new folder of modules gets a layer here and a line in pyproject.toml's package list, or
    neither this file nor the wheel would see it."""
    import tomllib

    roots = {"crystal_grpo", "rewards", "curricula", "train"}
    folders = {p.parent.relative_to(REPO).as_posix() for r in roots for p in (REPO / r).rglob("*.py")}
    assert folders - {".cache"} == set(PACKAGES.values())
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert set(PACKAGES) <= set(shipped)


def module_level_imports(module: str) -> set[str]:
    """The modules ``module`` imports when it is imported (not inside a function)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def importers(prefix: str, module_level: bool = False) -> set[str]:
    """The modules outside ``prefix`` that import a module under it."""
    found = set()
    for m in MODULES:
        if m.startswith(prefix):
            continue
        targets = module_level_imports(m) if module_level else {t for t, _ in imports(m)}
        if any(t == prefix or t.startswith(prefix + ".") for t in targets):
            found.add(m)
    return found


def test_the_capacity_planner_is_off_the_run_path():
    """Only ``--check`` (inside grpo.py's main) and the GPU check, which compares the measured peak
    with the plan, import the capacity planner; no module of a run imports it when it is imported."""
    assert importers("crystal_grpo.train.capacity") == {
        "crystal_grpo.train.grpo",
        "crystal_grpo.train.benchmarks.gpu_check",
    }
    assert importers("crystal_grpo.train.capacity", module_level=True) == set()


def test_test_and_demo_builders_stay_out_of_the_library():
    """``train.fixtures`` (tiny models, the shapes and word-problem sets, the SmolLM2 conversion) serves
    tests, scripts and the benchmarks; no module of the library imports them."""
    assert {
        m for m in importers("crystal_grpo.train.fixtures") if not m.startswith("crystal_grpo.train.benchmarks.")
    } == set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_from_a_higher_layer(module):
    """A module imports its own package and the packages below it (tools import the core, never the
    reverse; rewards and curricula never import train): so no two packages import each other."""
    mine = LAYER[package_of(module)]
    above = sorted({target for target, _ in imports(module) if target in MODULES and LAYER[package_of(target)] > mine})
    assert not above, f"{module} ({LAYERS[mine]}) imports {above}"


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(package, package it imports) -> the modules that make the arrow, over the whole source."""
    out: dict[tuple[str, str], list[str]] = {}
    for module in MODULES:
        for target, _ in imports(module):
            if target in MODULES and package_of(target) != package_of(module):
                out.setdefault((package_of(module), package_of(target)), []).append(module)
    return out


def test_the_packages_import_downward_only_and_never_each_other():
    """The drawing's arrows (README.md, "Architecture"): 0 upward, 0 mutual."""
    arrows = package_imports()
    assert sorted((a, b) for a, b in arrows if LAYER[b] > LAYER[a]) == []
    assert sorted((a, b) for a, b in arrows if (b, a) in arrows) == []
    assert ("crystal_grpo.train.pcgrad", "crystal_grpo.train.trainer") in arrows  # the check sees arrows


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_modules(module):
    private = [
        f"{target}.{name}" for target, name in imports(module) if name and name.startswith("_") and target != module
    ]
    assert not private, f"{module} imports private names {private}"


def test_no_import_cycles():
    graph = {m: {t for t, _ in imports(m) if t in MODULES and t != m} for m in MODULES}
    # A package's __init__ importing its own modules is how packages work; the reverse is a cycle.
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_planted_cycle_and_private_import_are_found(tmp_path, monkeypatch):
    """The checks above can fail: a two-module package importing each other's private names; the
    trainer's folder importing PCGrad's, above it, which imports the trainer's."""
    (tmp_path / "a.py").write_text("from crystal_grpo.x.b import _helper\n")
    (tmp_path / "b.py").write_text("def f():\n    from crystal_grpo.x.a import thing\n")
    monkeypatch.setitem(MODULES, "crystal_grpo.x.a", tmp_path / "a.py")
    monkeypatch.setitem(MODULES, "crystal_grpo.x.b", tmp_path / "b.py")
    assert imports("crystal_grpo.x.a") == [("crystal_grpo.x.b", "_helper")]
    with pytest.raises(AssertionError, match="private"):
        test_no_private_name_crosses_modules("crystal_grpo.x.a")
    with pytest.raises(AssertionError, match="crystal_grpo.x.a -> crystal_grpo.x.b -> crystal_grpo.x.a"):
        test_no_import_cycles()
    (tmp_path / "up.py").write_text("def f():\n    from crystal_grpo.train.pcgrad.math import group_flat\n")
    monkeypatch.setitem(MODULES, "crystal_grpo.train.trainer.up", tmp_path / "up.py")
    with pytest.raises(AssertionError, match="crystal_grpo.train.pcgrad.math"):
        test_no_import_from_a_higher_layer("crystal_grpo.train.trainer.up")
    with pytest.raises(AssertionError, match="crystal_grpo.train.trainer', 'crystal_grpo.train.pcgrad"):
        test_the_packages_import_downward_only_and_never_each_other()


def test_every_error_of_the_library_is_a_crystal_error():
    """One base (crystal_grpo.errors.CrystalError): a user catches "an error from this library"
    once, and each command line answers it in one line."""
    import importlib
    import inspect

    from crystal_grpo.errors import CrystalError

    not_errors = {"crystal_grpo.train.trainer.interrupt.Interrupted"}  # a stop that was asked for, with its exit code
    found = []
    for module in MODULES:
        for name, obj in vars(importlib.import_module(module)).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Exception)
                and obj.__module__ == module
                and not name.startswith("_")
                and f"{module}.{name}" not in not_errors
            ):
                found.append(obj)
    assert len(found) >= 15
    assert [e.__qualname__ for e in found if not issubclass(e, CrystalError)] == []


#: A repository path as the code and the docs name them (``train/tools/sweep.py``, ``docs/method.md``).
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:train|rewards|curricula|crystal_grpo|scripts|tests|configs|docs)/[\w/.-]+"
    r"\.(?:py|md|yaml|json))"
)
#: Paths of other projects' repositories that the text names as such.
ELSEWHERE = {"tests/test_grpo_trainer.py"}  # TRL's own test file


def named_paths(text: str) -> set[str]:
    return {m.group(1) for m in REPO_PATH.finditer(text)} - ELSEWHERE


def test_every_file_the_code_and_docs_name_exists():
    """A moved or renamed module leaves no comment, docstring or doc pointing at where it was."""
    texts = [
        p
        for p in REPO.rglob("*")
        if p.suffix in (".py", ".md", ".yaml")
        and not {".venv", ".cache", ".git", "runs"} & set(p.relative_to(REPO).parts)
    ]
    missing = sorted(
        f"{p.relative_to(REPO)}: {path}"
        for p in texts
        for path in named_paths(p.read_text(encoding="utf-8", errors="replace"))
        if not (REPO / path).exists()
    )
    assert missing == []
    gone = "train/" + "sweep.py"  # spelled apart, or this file would name it
    assert named_paths(f"see {gone}, or ``{gone}``.") == {gone}  # what the check flags
