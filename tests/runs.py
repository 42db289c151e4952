"""Helpers for tests that launch train/grpo.py as a real process (kills, signals, locks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def grpo_cmd(run: Path, model: Path, *extra: str) -> list[str]:
    """``python train/grpo.py`` on tiny.yaml into ``run``."""
    return [
        sys.executable,
        "train/grpo.py",
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(run),
        "--model.name_or_path",
        str(model),
        *extra,
    ]


def env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def grpo_with(patch: str) -> str:
    """A ``python -c`` program: ``patch`` (which wraps one method), then the train/grpo.py command."""
    return f"import os, signal, sys, time\n{patch}\nfrom crystal_grpo.train import grpo\nsys.exit(grpo.cli())\n"


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
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


#: DeepSpeed ZeRO-3 on CPU (gloo), the project's recipe (docs/training.md).
ZERO3 = ["--training.deepspeed", "configs/accelerate/zero3.json"]
#: Fewer validation rows than processes (validation at step 0 and at the end).
ONE_VALIDATION_ROW = ["--validation.max_samples", "1", "--validation.max_new_tokens", "8"]


def torchrun_script(script: Path | str, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """``script`` in ``nproc`` processes under ``torchrun --standalone``: its rendezvous takes a free
    port from the OS, so parallel runs never collide."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(script),
        *args,
    ]
    return subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env(TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions")),
    )


#: train/grpo.py's main once per command line of the JSON list ``sys.argv[1]``, each run with a
#: fresh accelerator state over the same process group.
RUNS = """
import json, sys
from accelerate.state import AcceleratorState
from crystal_grpo.distributed import release_process_group
from crystal_grpo.train import grpo
for argv in json.loads(sys.argv[1]):
    AcceleratorState._reset_state(reset_partial_state=True)
    if code := grpo.main(argv):
        sys.exit(code)
release_process_group()
"""


def torchrun_runs(argvs: list[list[str]], nproc: int = 2) -> subprocess.CompletedProcess:
    """Several train/grpo.py runs (``argvs``: their arguments), one after the other in the same
    ``nproc`` processes: one launch, its start-up (torch, transformers, TRL, DeepSpeed) paid once."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "runs.py"
        script.write_text(RUNS)
        return torchrun_script(script, json.dumps(argvs), nproc=nproc)


def torchrun(out: Path, model: Path, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """train/grpo.py on tiny.yaml under torchrun, gloo, no mid-run validation."""
    return torchrun_script(
        *grpo_cmd(out, model, "--cpu_backend", "gloo", "--validation.eval_steps", "0", *extra)[1:], nproc=nproc
    )


def two_nodes(
    out: Path, model: Path, port: int, *extra: str, node1: list[str] | None = None
) -> tuple[subprocess.Popen, subprocess.Popen]:
    """train/grpo.py on tiny.yaml as two nodes of one process each on this machine (torchrun
    ``--nnodes 2``, rendezvous on localhost), gloo, no mid-run validation; ``node1``: what node 1's
    torchrun is started through (e.g. ``unshare -m ...``: another disk at the run folder's path).
    Their stdout and stderr go to files beside ``out`` (node0.log, node1.log)."""
    argv = grpo_cmd(out, model, "--cpu_backend", "gloo", "--validation.eval_steps", "0", *extra)[1:]
    procs = []
    for rank, prefix in enumerate(([], node1 or [])):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
        torchrun += ["--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port)]
        log = open(out.parent / f"{out.name}.node{rank}.log", "a")
        procs.append(
            subprocess.Popen(
                [*prefix, *torchrun, *argv],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env(TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions")),
            )
        )
        log.close()
    return procs[0], procs[1]


def worker_of(launcher: subprocess.Popen) -> int:
    """The pid of the one worker a torchrun started (its child running train/grpo.py)."""
    for _ in range(600):
        for task in Path(f"/proc/{launcher.pid}/task").iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.1)
    raise AssertionError("torchrun started no worker")
