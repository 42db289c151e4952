"""Real two-process runs on CPU (gloo): DDP and DeepSpeed ZeRO-3 with the CPR reward (the ZeRO-3 run
validates one row on two processes).

Both processes sample with the same seed, so DDP and ZeRO-3 see the same rollouts and
must produce the same losses; ZeRO-3 must really shard the weights, save a consolidated
model next to its shards, and resume from them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runs import ONE_VALIDATION_ROW, ZERO3, grpo_cmd, torchrun, torchrun_runs, two_nodes, worker_of


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in rows(run) if "loss" in r]


# ddp_run, zero3_run: the session's two-process runs (tests/conftest.py); tests/test_export.py exports zero3_run.


def test_ddp_two_processes_train_and_checkpoint_reloads(ddp_run):
    from transformers import AutoModelForCausalLM

    assert len(losses(ddp_run)) == 2
    assert all(torch.isfinite(torch.tensor(x)).all() for x in losses(ddp_run))
    state = json.loads((ddp_run / "checkpoint-2" / "crystal_state.json").read_text())
    # The guard window holds the step counts of the GLOBAL batch (2 processes x 4 completions
    # per step, as TRL logs them on the main process), those with steps.
    import pandas as pd

    from crystal_grpo.rewards.parsing import parse_completion

    logged = [
        c
        for s in (1, 2)
        for c in pd.read_parquet(ddp_run / "completions" / f"completions_{s:05d}.parquet")["completion"]
    ]
    counts = [len(parse_completion(c if isinstance(c, str) else list(c)).steps) for c in logged]
    assert len(counts) == 16 and any(counts)
    assert state["rewards"]["cpr"]["guard"]["history"] == [n for n in counts if n > 0]
    model = AutoModelForCausalLM.from_pretrained(ddp_run / "checkpoint-2")
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape[1] == 6


def test_zero3_shards_weights_and_matches_ddp(zero3_run, ddp_run):
    shard = zero3_run / "checkpoint-2" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    opt = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    from safetensors.torch import load_file

    full = load_file(zero3_run / "checkpoint-2" / "model.safetensors")  # consolidated 16-bit save
    total = sum(v.numel() for v in full.values())
    local = sum(t.numel() for t in opt["fp32_flat_groups"])
    assert opt["partition_count"] == 2 and abs(local - total / 2) <= 64, (local, total)
    for (l1, g1), (l2, g2) in zip(losses(ddp_run), losses(zero3_run)):
        assert l1 == pytest.approx(l2, abs=1e-6) and g1 == pytest.approx(g2, rel=1e-4)
    # step credit ran in both (its per-token advantages are in the losses compared above), alike
    credit = [[r["step_credit/token_share"] for r in rows(run) if "loss" in r] for run in (ddp_run, zero3_run)]
    assert len(credit[0]) == 2 and credit[0] == pytest.approx(credit[1])


def test_zero3_validates_fewer_rows_than_processes(zero3_run, repo_root):
    """One validation row, two processes: the rank without a row generates a repeat of it, whose
    result is dropped. Under ZeRO-3 every rank generates in step with the others (a collective at
    every token); the rank that skipped generation left the other waiting in gloo (the fixture's
    run hung until its timeout)."""
    steps = [json.loads(x)["step"] for x in (zero3_run / "validation.jsonl").read_text().splitlines()]
    assert steps[:2] == [0, 2]
    first = json.loads((repo_root / "data" / "wordproblems" / "val.jsonl").read_text().splitlines()[0])["id"]
    for step in (0, 2):
        (line,) = (zero3_run / f"validation_samples_step{step}.jsonl").read_text().splitlines()
        assert json.loads(line)["id"] == first
        assert (zero3_run / f"validation_steps_step{step}.html").read_text().count('<section class="row') == 1


def test_a_pickle_planted_as_a_zero_shard_is_refused_before_deepspeed_unpickles_it(zero3_run, tmp_path):
    """DeepSpeed loads its shards with weights_only=False: a pickle put in their place (its completion
    marker rewritten to match) ran its command on resume. The check of a resume reads every torch
    file, the shards too, as torch's safe loader does (DeepSpeed's own classes allowed)."""
    from crystal_grpo.train.run.checkpoints import tensor_file_problem, write_marker

    assert tensor_file_problem(zero3_run / "checkpoint-2") is None  # DeepSpeed's own shards pass
    run = shutil.copytree(zero3_run, tmp_path / "run")
    shard = run / "checkpoint-2" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    evidence = tmp_path / "ran"
    torch.save(_Planted(evidence), shard)
    write_marker(run / "checkpoint-2", 2)
    assert tensor_file_problem(run / "checkpoint-2") == (
        f"{shard}: not a file of tensors that torch loads safely (Trying to load unsupported GLOBAL posix.system "
        "whose module posix is blocked); it is not loaded"
    )
    assert not evidence.exists()


class _Planted:
    def __init__(self, evidence: Path) -> None:
        self.evidence = evidence

    def __reduce__(self):
        return (os.system, (f"touch {self.evidence}",))


def test_even_share_gives_every_process_as_many_rows_and_drops_the_repeats():
    from crystal_grpo.distributed import even_share

    assert [even_share(1, r, 2) for r in (0, 1)] == [([0], 1), ([0], 0)]
    assert [even_share(5, r, 2) for r in (0, 1)] == [([0, 2, 4], 3), ([1, 3, 0], 2)]
    assert [even_share(4, r, 2) for r in (0, 1)] == [([0, 2], 2), ([1, 3], 2)]
    assert even_share(0, 1, 2) == ([], 0) and even_share(3, 0, 1) == ([0, 1, 2], 3)


def test_zero3_resumes_from_shards_and_refuses_another_world_size(zero3_run, tiny_lm_path, tmp_path):
    run = shutil.copytree(zero3_run, tmp_path / "run")  # the session's run stays as it finished
    proc = torchrun(
        run,
        tiny_lm_path,
        *ZERO3,
        *ONE_VALIDATION_ROW,
        "--training.max_steps",
        "3",
        "--resume_from_checkpoint",
        "latest",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r] == [
        1,
        2,
        3,
    ]
    proc = torchrun(
        run,
        tiny_lm_path,
        *ZERO3,
        "--training.max_steps",
        "4",
        "--resume_from_checkpoint",
        str(run / "checkpoint-3"),
        nproc=1,
    )
    assert proc.returncode != 0  # the worker exits 2; torchrun reports it as a failure
    assert "written by 2 process(es), but this run has 1" in proc.stderr


@pytest.mark.slow
def test_zero3_lora_generates_through_merged_adapters_bit_identically(tiny_lm_path, tmp_path):
    """ZeRO-3 gathers the weights for generation; the adapters are merged there (gathered
    buffers in place, persistent ones in a copy) and training stays exactly what it is unmerged.
    Both runs in one launch (tests/runs.py's torchrun_runs)."""
    from safetensors.torch import load_file

    runs = {merge: tmp_path / merge for merge in ("true", "false")}
    argvs = [
        grpo_cmd(
            out,
            tiny_lm_path,
            "--cpu_backend",
            "gloo",
            *ZERO3,
            "--model.lora",
            f"{{r: 8, alpha: 16, dropout: 0.0, target_modules: all-linear, merge_for_generation: {merge}}}",
            "--reward.name",
            "answer_only",
            "--reward.params",
            "{}",
            "--training.learning_rate",
            "1e-2",
            "--validation.eval_steps",
            "2",
            "--validation.at_start",
            "false",
            "--validation.max_new_tokens",
            "16",
        )[2:]
        for merge, out in runs.items()
    ]
    proc = torchrun_runs(argvs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    on, off = runs["true"], runs["false"]
    assert losses(on) == losses(off) and len(losses(on)) == 2
    a, b = (load_file(r / "final" / "adapter_model.safetensors") for r in (on, off))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (on / "validation.jsonl").read_text() == (off / "validation.jsonl").read_text()


def test_the_command_releases_the_process_group_before_the_process_exits(tmp_path, monkeypatch):
    """`python train/grpo.py` (grpo.cli) destroys the process group once main returns: left to
    interpreter shutdown, gloo's threads aborted a rank of a finished torchrun job (SIGABRT,
    "terminate called without an active exception"), intermittently. Here a one-process gloo group
    and a run refused at its config (exit 2): the group must be gone when cli returns."""
    import torch.distributed as dist

    from crystal_grpo.train import grpo

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(sys, "argv", ["train/grpo.py", "--config", "tiny.yaml", "--training.max_steps", "-5"])
        assert grpo.cli() == 2
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --- two nodes, simulated on this machine: one process a node (torchrun --nnodes 2 on localhost) ----------
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "zero3"])
def test_two_nodes_resume_identically_after_the_second_node_is_killed(kind, tiny_lm_path, tmp_path, free_port):
    """Two nodes train (DDP, or DeepSpeed ZeRO-3 sharded across them); node 1's process is killed
    (SIGKILL) once checkpoint-2 is complete; node 0 stops too; both nodes resumed from latest end
    with the uninterrupted run's every logged value and final weights, bit for bit."""
    from crystal_grpo.train.tools.kill_trials import compare

    extra = ["--training.max_steps", "4", "--training.save_steps", "1", *(ZERO3 if kind == "zero3" else [])]
    ref, run = tmp_path / "ref", tmp_path / "run"
    for node in two_nodes(ref, tiny_lm_path, free_port, *extra):
        assert node.wait(timeout=900) == 0, (tmp_path / "ref.node0.log").read_text()[-3000:]
    node0, node1 = two_nodes(run, tiny_lm_path, free_port, *extra)
    worker = worker_of(node1)
    while not (run / "checkpoint-2" / "checkpoint_complete.json").exists():
        assert node0.poll() is None and node1.poll() is None, (tmp_path / "run.node0.log").read_text()[-3000:]
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    assert node1.wait(timeout=300) != 0 and node0.wait(timeout=300) != 0  # (gloo: node 0 sees its peer gone)
    assert (run / "checkpoint-2" / "checkpoint_complete.json").exists() and not (run / "final").exists()
    for node in two_nodes(run, tiny_lm_path, free_port, *extra, "--resume_from_checkpoint", "latest"):
        assert node.wait(timeout=900) == 0, (tmp_path / "run.node0.log").read_text()[-3000:]
    assert compare(ref, run) == []


@pytest.mark.slow
def test_nodes_that_do_not_share_the_run_folder_are_refused_in_one_line(tiny_lm_path, tmp_path, free_port):
    """Node 1 with another disk at the run folder's path (its own mount namespace, another folder
    bound over the path): both nodes trained and node 0 marked checkpoints complete that lacked
    rank 1's shards and RNG state, which sat on node 1's disk. Now one line, before anything is
    written, on both disks."""
    shared, elsewhere = tmp_path / "shared", tmp_path / "node1_disk"
    shared.mkdir(), elsewhere.mkdir()
    probe = subprocess.run(["unshare", "-m", "mount", "--bind", str(elsewhere), str(shared)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here ({probe.stderr.decode().strip()})")
    mount = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"', str(elsewhere), str(shared)]
    run = shared / "run"
    nodes = two_nodes(run, tiny_lm_path, free_port, *ZERO3, "--training.max_steps", "2", node1=mount)
    assert [node.wait(timeout=900) for node in nodes] == [1, 1]  # torchrun: a worker exited 2
    said = [x for x in (shared / "run.node0.log").read_text().splitlines() if x.startswith("RunFolderError")]
    assert said == [
        f"RunFolderError: the processes of this run do not share one run folder: rank 1 on {socket.gethostname()} "
        f"does not see the run.json rank 0 wrote in {run} (another disk at that path); every rank's part of a "
        "checkpoint must land in one folder: put --output_dir on a file system every node shares "
        "(training.save_on_each_node, a copy on each node's own disk, is not supported: such checkpoints cannot "
        "be resumed as one)"
    ]
    assert sorted(os.listdir(shared)) == ["run.node0.log", "run.node1.log"] and os.listdir(elsewhere) == []
