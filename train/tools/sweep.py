"""Sweeps: many runs of train/grpo.py that differ in a few overrides (the paper's Tables 4 and 5).

A sweep file (YAML, configs/sweeps/) names a ``base`` config, a ``launcher``, ``overrides`` for
every point, named ``points`` and/or a ``grid``, ``seeds``, and optionally ``init_from``,
``eval`` and ``x`` (a weight sweep's axis). Every point's overrides are validated before
anything runs; each point is a run folder ``<sweep folder>/<point>``. Re-running skips finished
points, resumes interrupted ones, and reports a failed point without stopping the others. The
file's every key: docs/experiments.md; the report: train/tools/sweep_report.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crystal_grpo.distributed import launch_command
from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import atomic_write_text
from crystal_grpo.paths import user_path
from crystal_grpo.train.run.folder import RunFolderError, RunLock, foreign_folder, wait_for_holder
from crystal_grpo.train.run.layout import BEST, FINAL, POINT_LOG, SWEEP_LOCK, SWEEP_POINT, is_finished, run_targets
from crystal_grpo.train.tools import launch
from crystal_grpo.train.tools.launch import EVALUATE, TRAIN
from crystal_grpo.train.tools.sweep_report import STATUS_FILE, eval_targets, read_status, write_report
from crystal_grpo.typed import to_dict

# train/config/run_config.py is imported where it is used: it loads TRL and transformers (seconds), and
# transformers prints a note to stdout on import, which ``--emit`` keeps off the script it prints.

_CHECKOUT = Path(__file__).resolve().parents[2]
#: Where points run and relative paths start: the source checkout (the commands its README
#: shows), or, for an installed package, the folder the sweep is started from.
ROOT = _CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else Path.cwd()
KEYS = {
    "base",
    "launcher",
    "init_from",
    "output_dir",
    "overrides",
    "points",
    "grid",
    "seeds",
    "eval",
    "x",
    "contrasts",
}
#: A pre-registered contrast: arm ``b`` minus arm ``a`` on ``metric`` of ``variant``'s rows in each seed's ``eval``
#: folder (train/organism/step_diagnosis.py), by ``test`` (welch: per-seed values; fisher: a per-seed yes/no);
#: the report corrects each ``family`` (default: primary) with Holm.
CONTRAST_KEYS = ("a", "b", "metric", "variant", "eval")
CONTRAST_OPTIONAL = {"test": ("welch", "fisher"), "family": None}
EVAL_KEYS = {"data", "max_samples", "batch_size", "max_new_tokens", "temperature", "num_samples"}
#: ``eval.also``: more evaluations of the final weights, each the primary one with some settings changed.
ALSO = "also"


class SweepError(CrystalError, ValueError):
    """A sweep file that cannot run; the message names the key or point."""


@dataclass
class Point:
    """One run of the sweep: ``arm`` is what the report groups over seeds."""

    name: str
    arm: str
    config: str
    overrides: dict[str, Any]
    seed: int | None = None
    run_config: dict | None = field(default=None, repr=False)  # set once by resolved()
    eval: dict[str, Any] = field(default_factory=dict)  #: the point's own evaluation settings (e.g. its data)

    def overrides_argv(self) -> list[str]:
        """``--section.key value`` pairs, each value as the config reader parses it back (YAML)."""
        return [a for k, v in self.overrides.items() for a in (f"--{k}", _as_yaml(v))]


def _as_yaml(value: Any) -> str:
    """A plain word stays as it is; anything else is JSON (which YAML reads back unchanged)."""
    from crystal_grpo.train.config.run_config import parse_yaml

    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w./:-]*", value) and parse_yaml(value, "") == value:
        return value
    return json.dumps(value)


@dataclass
class Sweep:
    name: str
    launcher: str
    output_dir: Path
    points: list[Point]
    eval: dict[str, Any] = field(default_factory=dict)
    x: str | None = None
    contrasts: list[dict[str, str]] = field(default_factory=list)

    def eval_for(self, point: Point) -> dict[str, Any]:
        """The sweep's ``eval`` with the point's own settings over it (a point on other data)."""
        return {**self.eval, **point.eval}


def _flat(overrides: Any, where: str) -> dict[str, Any]:
    """``{a: {b: 1}}`` and ``{a.b: 1}`` alike become ``{"a.b": 1}``."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise SweepError(f"{where}: expected a mapping of section.key: value, got {overrides!r}")
    out = {}
    for key, value in overrides.items():
        if isinstance(value, dict) and value:
            out.update({f"{key}.{k}": v for k, v in _flat(value, f"{where}.{key}").items()})
        else:
            out[str(key)] = value
    return out


def _slug(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return re.sub(r"[^\w.=+-]+", "-", Path(text).name if "/" in str(text) else text).strip("-")


def _short(key: str) -> str:
    """``reward.params.answer_weight`` -> ``answer_weight``; ``reward.name`` -> ``reward``."""
    parts = key.split(".")
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def _grid(grid: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, overrides) for each combination; a key ``a,b`` takes a list of (a, b) pairs."""
    if not grid:
        return [("", {})]
    if not isinstance(grid, dict):
        raise SweepError(f"{where}: expected a mapping of section.key: [values]")
    axes = []
    for key, values in grid.items():
        keys = [k.strip() for k in str(key).split(",")]
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}.{key}: expected a non-empty list of values, got {values!r}")
        combos = []
        for v in values:
            vs = v if len(keys) > 1 else [v]
            if not isinstance(vs, list) or len(vs) != len(keys):
                raise SweepError(f"{where}.{key}: {v!r} must be a list of {len(keys)} values ({', '.join(keys)})")
            combos.append(dict(zip(keys, vs)))
        axes.append(combos)
    out = []
    for combo in itertools.product(*axes):
        merged = {k: v for part in combo for k, v in part.items()}
        out.append(("_".join(f"{_short(k)}={_slug(v)}" for k, v in merged.items()), merged))
    return out


def load_sweep(path: str | Path, output_dir: str | Path | None = None, resolve_init: bool = True) -> Sweep:
    """Read a sweep file, expand it into points, and validate every point's config.

    ``resolve_init=False`` (reporting) leaves ``init_from`` as written: a report needs no
    starting checkpoint."""
    from crystal_grpo.train.config.run_config import ConfigError, parse_yaml, read_config_text

    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file")
    try:
        raw = parse_yaml(read_config_text(path), str(path))
    except ConfigError as err:
        raise SweepError(str(err)) from None
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: the top level must be a mapping")
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(KEYS))}")
    if not raw.get("points") and not raw.get("grid"):
        raise SweepError(f"{path}: a sweep needs `points` or `grid`")
    base = raw.get("base")
    common = _flat(raw.get("overrides"), "overrides")
    for node, key in ((raw, "output_dir"), (raw, "init_from"), (raw.get("eval"), "data")):
        if isinstance(node, dict) and key in node:
            node[key] = user_path(node[key])
    if raw.get("init_from"):
        init = Path(raw["init_from"])
        init = init if init.exists() or init.is_absolute() else ROOT / init  # like the configs' paths
        common["model.name_or_path"] = _rel(start_checkpoint(init)) if resolve_init else str(init)
    seeds = raw.get("seeds") or [None]
    if not isinstance(seeds, list) or not all(s is None or (isinstance(s, int) and s >= 0) for s in seeds):
        raise SweepError(f"seeds: expected a list of integers >= 0, got {raw.get('seeds')!r}")
    named = raw.get("points") or [{"name": ""}]
    if not isinstance(named, list):
        raise SweepError("points: expected a list of {name, overrides, config}")
    points: list[Point] = []
    for i, p in enumerate(named):
        if not isinstance(p, dict) or set(p) - {"name", "overrides", "config", "eval", "seeds"}:
            raise SweepError(
                f"points[{i}]: expected a mapping with name, overrides and optional config, eval and seeds, got {p!r}"
            )
        own_seeds = p.get("seeds") or seeds
        if "seeds" in p and not (
            isinstance(own_seeds, list) and all(isinstance(x, int) and x >= 0 for x in own_seeds)
        ):
            raise SweepError(f"points[{i}].seeds: expected a list of integers >= 0, got {p['seeds']!r}")
        own_eval = p.get("eval") or {}
        if not isinstance(own_eval, dict) or set(own_eval) - EVAL_KEYS:
            raise SweepError(
                f"points[{i}].eval: expected a mapping of {', '.join(sorted(EVAL_KEYS))}, got {own_eval!r}"
            )
        if raw.get("points") and not p.get("name"):
            raise SweepError(f"points[{i}]: `name` is required")
        config = p.get("config") or base
        if not config:
            raise SweepError(f"points[{i}]: no config (set `base`, or the point's `config`)")
        for gname, gover in _grid(raw.get("grid"), "grid"):
            arm = "_".join(x for x in (str(p.get("name") or ""), gname) if x)
            overrides = {**common, **_flat(p.get("overrides"), f"points[{i}].overrides"), **gover}
            for seed in own_seeds:
                over = {**overrides, **({"training.seed": seed} if seed is not None else {})}
                name = arm if seed is None else f"{arm}_seed{seed}"
                points.append(Point(name, arm, str(config), over, seed, eval=dict(own_eval)))
    order = list(dict.fromkeys([*seeds, *(x for p in named if isinstance(p, dict) for x in p.get("seeds") or [])]))
    points.sort(key=lambda p: order.index(p.seed))  # seed by seed: a stopped sweep leaves its arms balanced
    for p in points:  # the sweep passes --output_dir <sweep folder>/<point>: a second folder would contradict it
        if "training.output_dir" in p.overrides:
            raise SweepError(
                f"point {p.name}: overrides training.output_dir, but a point's run folder is <sweep folder>/<point "
                "name>; remove it (the sweep's output_dir, or --output_dir, sets where the points go)"
            )
    names = [p.name for p in points]
    for name in names:  # a point's run folder is <sweep folder>/<name>: one folder, never one elsewhere
        if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise SweepError(
                f"point {name!r}: a point's name is the name of its run folder in the sweep folder, so "
                "it may not be . or .. or hold / or \\ or NUL; rename it"
            )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SweepError(f"points named more than once: {', '.join(dupes)}")
    ev = raw.get("eval") or {}
    if (
        not isinstance(ev, dict)
        or set(ev) - EVAL_KEYS - {ALSO}
        or (ev and not ev.get("data"))
        or (not ev and any(p.eval for p in points))
    ):
        optional = ", ".join(sorted(EVAL_KEYS - {"data"} | {ALSO}))
        raise SweepError(f"eval: expected a mapping with `data` and optional {optional}, got {ev!r}")
    also = ev.get(ALSO) or {}
    if not isinstance(also, dict):
        raise SweepError(f"eval.also: expected a mapping of name: {{setting: value}}, got {also!r}")
    for name, changed in also.items():
        if (
            not re.fullmatch(r"\w+", str(name))
            or name == "best"
            or not isinstance(changed, dict)
            or set(changed) - EVAL_KEYS
        ):
            raise SweepError(
                f"eval.also.{name}: expected a name (letters, digits, _; not best) and a mapping of "
                f"{', '.join(sorted(EVAL_KEYS))}, got {changed!r}"
            )
    launcher = raw.get("launcher") or "python"
    if not isinstance(launcher, str):
        raise SweepError(f"launcher: expected a command line (str), got {launcher!r}")
    sweep = Sweep(
        name=path.stem,
        launcher=launcher,
        output_dir=Path(output_dir or raw.get("output_dir") or ROOT / "runs/sweeps" / path.stem).resolve(),
        points=points,
        eval=ev,
        x=raw.get("x"),
        contrasts=_contrasts(raw.get("contrasts"), points, ev),
    )
    for p in points:
        resolved(p)  # every point's config and overrides checked before anything runs
    return sweep


def _contrasts(raw: Any, points: list[Point], ev: dict) -> list[dict[str, str]]:
    """``contrasts:`` checked: each names two arms of the sweep, a metric, a variant and an evaluation,
    and optionally its test and family."""
    from crystal_grpo.train.organism.step_diagnosis import BINARY, SUMMARY

    if raw is None:
        return []
    arms = {p.arm for p in points}
    folders = {"eval", *(f"eval_{n}" for n in (ev.get(ALSO) or {}))}
    if not isinstance(raw, list):
        raise SweepError("contrasts: expected a list of {a, b, metric, variant, eval[, test, family]}")
    for i, c in enumerate(raw):
        if not isinstance(c, dict) or not set(CONTRAST_KEYS) <= set(c) <= set(CONTRAST_KEYS) | set(CONTRAST_OPTIONAL):
            raise SweepError(
                f"contrasts[{i}]: expected the keys {', '.join(CONTRAST_KEYS)} (and optional "
                f"{', '.join(CONTRAST_OPTIONAL)}), got {c!r}"
            )
        test = c.get("test", "welch")
        bad = (
            [f"arm {c[k]!r}" for k in ("a", "b") if c[k] not in arms]
            + ([f"metric {c['metric']!r} (one of {', '.join(SUMMARY)})"] if c["metric"] not in SUMMARY else [])
            + ([f"eval {c['eval']!r} (one of {', '.join(sorted(folders))})"] if c["eval"] not in folders else [])
            + ([f"test {test!r} (one of welch, fisher)"] if test not in CONTRAST_OPTIONAL["test"] else [])
            + (
                [f"yes/no metric {c['metric']!r} for test fisher (one of {', '.join(BINARY)})"]
                if test == "fisher" and c["metric"] not in BINARY
                else []
            )
        )
        if bad:
            raise SweepError(f"contrasts[{i}]: no {'; no '.join(bad)}")
    return [{k: str(v) for k, v in c.items()} for c in raw]


def start_checkpoint(folder: Path) -> Path:
    """A run's phase folder -> its best checkpoint (``final/`` without a usable best); a model
    folder stays as it is."""
    is_phase = (folder / BEST).is_file() or (folder / FINAL).is_dir()
    if not is_phase and (folder / "config.json").is_file():  # a model's own config.json
        return folder
    ckpt = best_checkpoint(folder) if is_phase else None
    if ckpt is None:
        raise SweepError(
            f"init_from: {folder} is neither a model folder nor a finished run phase (best "
            f"checkpoint or final/); `make demo-smollm2` writes runs/demo/phase1-warm_start"
        )
    return ckpt


def resolved(point: Point) -> dict:
    """The point's full run config (every override applied and checked), as train/grpo.py sees it;
    checked once per point (at load) and reused."""
    from crystal_grpo.train.config.run_config import ConfigError, load_config

    if point.run_config is None:
        try:
            cfg, _ = load_config(point.config, point.overrides_argv())
        except ConfigError as err:
            raise SweepError(f"point {point.name}: {err}") from None
        point.run_config = to_dict(cfg)
    return point.run_config


# ------------------------------------------------------------------------------- running
def command(sweep: Sweep, point: Point, python: str = "python") -> list[str]:
    """The point's launch line. It always asks to resume: a fresh folder starts from scratch,
    an interrupted one from its newest complete checkpoint, a finished phase is skipped."""
    launcher = shlex.split(sweep.launcher)
    return [*([python] if launcher == ["python"] else launcher), *TRAIN.argv(ROOT), *train_args(sweep, point)]


def train_args(sweep: Sweep, point: Point) -> list[str]:
    """train/grpo.py's arguments for the point."""
    from crystal_grpo.train.config.run_config import resolve_config_path

    return [
        "--config",
        _rel(resolve_config_path(point.config)),
        "--output_dir",
        _rel(sweep.output_dir / point.name),
        "--resume_from_checkpoint",
        "latest",
        *point.overrides_argv(),
    ]


def _rel(path: Path) -> str:
    """Relative to the repository (where every command runs) when inside it, else absolute."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def shell_line(sweep: Sweep, point: Point) -> str:
    """One self-contained shell line: make the folder, run, append to its log."""
    folder = shlex.quote(_rel(sweep.output_dir / point.name))
    return f"mkdir -p {folder} && {shlex.join(command(sweep, point))} >> {folder}/{POINT_LOG} 2>&1"


def prepare(sweep: Sweep, point: Point) -> Path:
    """The point's folder with its ``sweep_point.json`` (overrides, command, resolved config); a
    folder of that name holding someone else's files is refused, as train/grpo.py refuses it."""
    folder = sweep.output_dir / point.name
    refused = foreign_folder(folder)
    if refused:
        raise SweepError(f"point {point.name}: {refused}")
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "name": point.name,
        "arm": point.arm,
        "seed": point.seed,
        "config": point.config,
        "overrides": point.overrides,
        "command": shell_line(sweep, point),
        "resolved": resolved(point),
    }
    atomic_write_text(folder / SWEEP_POINT, json.dumps(record, indent=2, default=str))
    return folder


def log_tail(folder: Path, lines: int = 20) -> str:
    try:
        return "\n".join((folder / POINT_LOG).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


_STATUS_LOCK = threading.Lock()


def _record(sweep: Sweep, name: str, entry: dict) -> None:
    with _STATUS_LOCK:  # points may finish together (--jobs)
        status = read_status(sweep)
        status[name] = entry
        atomic_write_text(sweep.output_dir / STATUS_FILE, json.dumps(status, indent=2))


def run_point(
    sweep: Sweep, point: Point, say: Callable[[str], None] = print, settings: launch.Settings = launch.Settings()
) -> str:
    """Run one point unless finished, then its evaluation unless done: ``"skipped"``, ``"done"``
    or ``"failed"`` (recorded with the log's tail in the sweep folder's ``sweep_status.json``)."""
    folder = sweep.output_dir / point.name
    wait_for_holder(folder, lambda line: say(f"[{point.name}] {line}"))  # a run that outlived an earlier sweep
    if is_finished(folder):
        say(f"[{point.name}] finished earlier: skipped")
        if sweep.eval:  # one stopped during its evaluation is evaluated now
            evaluate_point(sweep, point, say, settings)
        return "skipped"
    resuming = (folder / SWEEP_POINT).is_file()
    prepare(sweep, point)
    say(f"[{point.name}] {'resuming' if resuming else 'starting'} (log: {folder / POINT_LOG})")
    start = time.time()
    launcher = shlex.split(sweep.launcher)
    rc = launch.run(
        TRAIN,
        train_args(sweep, point),
        folder / POINT_LOG,
        ROOT,
        None if launcher == ["python"] else launcher,
        settings,
    )
    seconds = round(time.time() - start, 1)
    if rc == 0 and is_finished(folder):
        _record(sweep, point.name, {"status": "done", "seconds": seconds})
        if sweep.eval:
            evaluate_point(sweep, point, say, settings)
        say(
            f"[{point.name}] done in {seconds:.0f} s"
            + (f" + {time.time() - start - seconds:.0f} s evaluating" if sweep.eval else "")
        )
        return "done"
    tail = log_tail(folder)
    _record(sweep, point.name, {"status": "failed", "returncode": rc, "seconds": seconds, "log_tail": tail})
    say(f"[{point.name}] FAILED (exit code {rc}) after {seconds:.0f} s; the end of its log:\n{tail}\n")
    return "failed"


def run_sweep(
    sweep: Sweep, only: list[str] | None = None, say: Callable[[str], None] = print, jobs: int = 1, fork: bool = True
) -> dict[str, str]:
    """Every point (or those named in ``only``) in the sweep's order (seed by seed), one after
    another, or ``jobs`` at a time with the CPU cores shared among them; a failure stops none.
    On Ctrl-C no point starts any more and the running ones save and stop. ``fork``: runs may
    be forked from a process that imported the libraries once (train/tools/launch.py). One
    sweep at a time runs in a sweep folder (``sweep.lock``): a second one found each point's
    run busy and reported it failed."""
    points = select(sweep, only)
    settings = launch.Settings(max(1, launch.cores() // jobs) if jobs > 1 else None, fork)
    with RunLock(sweep.output_dir, launch_command("scripts/sweep.py"), say, name=SWEEP_LOCK, what="sweep"):
        if jobs <= 1:
            return {p.name: run_point(sweep, p, say, settings) for p in points}
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=jobs)
        futures = [pool.submit(run_point, sweep, p, say, settings) for p in points]
        try:
            return {p.name: f.result() for p, f in zip(points, futures)}
        except KeyboardInterrupt:
            launch.interrupt_running()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def select(sweep: Sweep, only: list[str] | None) -> list[Point]:
    if not only:
        return sweep.points
    known = {p.name: p for p in sweep.points}
    missing = [n for n in only if n not in known]
    if missing:
        raise SweepError(f"no point named {', '.join(missing)}; points: {', '.join(known)}")
    return [known[n] for n in only]


# ------------------------------------------------------------------------------ evaluation
def best_checkpoint(folder: Path) -> Path | None:
    """The best checkpoint of the run's last phase (its ``final/`` when it has no usable best)."""
    try:
        return run_targets(folder)[-1][1]
    except (OSError, ValueError, KeyError):
        return None


def evaluate_point(
    sweep: Sweep, point: Point, say: Callable[[str], None] = print, settings: launch.Settings = launch.Settings()
) -> bool:
    """Score the point's final weights (and its best checkpoint, when another) on ``eval.data``
    into ``<point>/eval`` (and ``<point>/eval_best``); resumable."""
    folder = sweep.output_dir / point.name
    settings_of = sweep.eval_for(point)
    targets = {out: (ckpt, settings_of) for out, ckpt in eval_targets(folder).items()}
    if "eval" in targets:
        targets.update(
            {
                f"eval_{name}": (targets["eval"][0], {**settings_of, **changed})
                for name, changed in (sweep.eval.get(ALSO) or {}).items()
            }
        )
    ok = bool(targets)
    for out, (ckpt, ev) in targets.items():
        if (folder / out / "report.json").is_file():
            continue  # evaluated earlier (scripts/evaluate.py --force re-scores)
        args = ["--model", str(ckpt), "--data", str(ev["data"]), "--out", str(folder / out)]
        for key in sorted(EVAL_KEYS - {"data"}):
            if ev.get(key) is not None:
                args += [f"--{key}", str(ev[key])]
        rc = launch.run(EVALUATE, args, folder / f"{out}.log", ROOT, settings=settings)
        if rc != 0:
            say(f"[{point.name}] evaluation of {ckpt.name} FAILED (exit code {rc}); see {folder / f'{out}.log'}")
            ok = False
    return ok


# ------------------------------------------------------------------------------- emitting
def emit(sweep: Sweep, kind: str) -> str:
    """``commands``: one shell line a point; ``slurm``: an sbatch job array, one task a point.

    Folders and their ``sweep_point.json`` are written now, so the report knows every point.
    """
    lines = []
    for p in sweep.points:
        prepare(sweep, p)
        lines.append(shell_line(sweep, p))
    if kind == "commands":
        return "".join(f"cd {shlex.quote(str(ROOT))} && {line}\n" for line in lines)
    if kind != "slurm":
        raise SweepError(f"--emit {kind!r}: expected 'slurm' or 'commands'")
    (sweep.output_dir / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch opens --output before the script runs
    logs = shlex.quote(str((sweep.output_dir / "slurm").resolve()))
    body = "\n".join(f"  {shlex.quote(line)}" for line in lines)
    return (
        "#!/bin/bash\n"
        f"#SBATCH --job-name=sweep-{sweep.name}\n"
        f"#SBATCH --array=0-{len(lines) - 1}\n"
        f"#SBATCH --output={sweep.output_dir.resolve()}/slurm/%A_%a.out\n"
        "# Add your cluster's --partition, --gres=gpu:N, --time, --cpus-per-task here.\n"
        "set -euo pipefail\n"
        f"mkdir -p {logs}\n"
        f"cd {shlex.quote(str(ROOT))}\n"
        "POINTS=(\n" + body + "\n)\n"
        'eval "${POINTS[$SLURM_ARRAY_TASK_ID]}"\n'
    )


# ------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        description="Run, emit or report a sweep of train/grpo.py runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("sweep", type=user_path, help="a sweep YAML (configs/sweeps/*.yaml)")
    ap.add_argument(
        "--output_dir", type=user_path, help="the sweep folder (default: its output_dir, else runs/sweeps/<name>)"
    )
    what = ap.add_mutually_exclusive_group()
    what.add_argument(
        "--emit",
        choices=["slurm", "commands"],
        help="print an sbatch job-array script, or one shell line a point, instead of running",
    )
    what.add_argument("--report", action="store_true", help="only aggregate what has finished")
    ap.add_argument("--point", action="append", help="run only this point (repeatable)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="points run at once on this machine, each with an equal share "
        "of the CPU cores as its torch threads (default 1: one after another, threads as the environment "
        "sets them)",
    )
    ap.add_argument(
        "--no_fork",
        action="store_true",
        help="start every run in a new interpreter instead of forking it from one that imported the libraries once",
    )
    args = ap.parse_args(argv)
    if args.jobs < 1:
        print(f"sweep error: --jobs {args.jobs}: expected an integer >= 1 (points run at once)", file=sys.stderr)
        return 2
    if args.emit:  # stdout carries the script alone (libraries print notes while they load: to stderr)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                script = emit(load_sweep(args.sweep, args.output_dir), args.emit)
        except SweepError as err:
            print(f"sweep error: {err}", file=sys.stderr)
            return 2
        print(script, end="")
        return 0
    try:
        sweep = load_sweep(args.sweep, args.output_dir, resolve_init=not (args.report and not args.point))
        print(f"sweep {sweep.name}: {len(sweep.points)} point(s) in {sweep.output_dir}")
        start, cpu = time.perf_counter(), launch.children_cpu()
        try:
            with launch.interrupt_on_signals():
                results = {} if args.report else run_sweep(sweep, args.point, jobs=args.jobs, fork=not args.no_fork)
        except KeyboardInterrupt:
            print(
                "\ninterrupted: the running points saved a checkpoint and stopped; the same command resumes the sweep",
                file=sys.stderr,
            )
            return 130
        finally:
            launch.stop()
        if results:
            print(
                f"ran {sum(s != 'skipped' for s in results.values())} point(s) in {time.perf_counter() - start:.0f} s "
                f"({launch.children_cpu() - cpu:.0f} CPU-s)"
            )
        if sweep.eval and args.report:
            for p in sweep.points:
                if is_finished(sweep.output_dir / p.name):
                    evaluate_point(sweep, p)
        text, plots = write_report(sweep)
    except (SweepError, RunFolderError) as err:
        print(f"sweep error: {err}", file=sys.stderr)
        return 2
    print("\n" + text)
    print(f"report: {sweep.output_dir / 'report.md'} (.csv, .json)" + "".join(f"\nplot: {p}" for p in plots))
    failed = [n for n, s in results.items() if s == "failed"]
    if failed:
        print(f"{len(failed)} point(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
