"""What a launch can know before anything loads is said then, in one line (issue 43 items 13-15,
18, 21): an --output_dir that cannot be made, a launcher's variables without a launcher, a
generation batch num_generations does not divide, a Hub id the hub cannot answer for, a data
file that is empty or not a regular file, and the command that makes a missing shipped input.

The runs here use the committed organism warm start as the model (a real model folder that
needs no build), so that every check before it passes and the one under test is the first to
speak: each test fails if the launch goes on to load anything.
"""

from __future__ import annotations

import os

import pytest

from crystal_grpo.train import grpo
from runs import REPO, torchrun_script

#: tiny.yaml on the committed organism policy: everything the run needs is there.
READY = ["--config", "tiny.yaml", "--model.name_or_path", str(REPO / "data/organism/warm_start")]


def refused(capsys, *argv: str) -> list[str]:
    """stderr's lines of a launch that must stop with exit code 2 (stdout must be empty)."""
    assert grpo.main([*READY, *argv]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return err.strip().splitlines()


# --- item 13: an --output_dir that cannot be made -------------------------------------------------
@pytest.mark.parametrize("where, reason", [
    ("a_file/run", "{tmp}/a_file is not a folder"),
    ("x" * 300, "the name xxxxxxxxxxxxxxxxxxxxxxxx... is 300 bytes long, the file system takes 255"),
    ("/proc/crystal-grpo-run", "/proc takes no new folder (No such file or directory)"),
], ids=["under_a_file", "name_too_long", "proc"])
@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_an_output_dir_that_cannot_be_made_is_one_line_before_anything_loads(tmp_path, capsys, where, reason, check):
    (tmp_path / "a_file").write_text("mine")
    out = tmp_path / where
    err = refused(capsys, "--output_dir", str(out), *(["--check"] if check else []))
    assert err == [f"RunFolderError: --output_dir {out} cannot be made: {reason.format(tmp=tmp_path)}; choose another "
                   "--output_dir"]
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # the probe left nothing


# --- item 13: a launcher's variables without a launcher ---------------------------------------------
@pytest.mark.parametrize("variables, said", [
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK=0 set, as a launcher sets them for each process, but not RANK, WORLD_SIZE, "
                          "MASTER_ADDR, MASTER_PORT: start several processes with torchrun or accelerate launch, or "
                          "unset LOCAL_RANK for one"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "RANK=1, WORLD_SIZE=2 set, as a launcher sets them for each process, but not "
                                       "LOCAL_RANK, MASTER_ADDR, MASTER_PORT: start several processes with torchrun or "
                                       "accelerate launch, or unset RANK, WORLD_SIZE for one"),
], ids=["local_rank", "rank_and_world_size"])
def test_launcher_variables_without_a_launcher_are_one_line(tmp_path, capsys, monkeypatch, variables, said):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    # said by the process even when its RANK says it is not the main one: without a launcher, none is
    assert refused(capsys, "--output_dir", str(tmp_path / "run")) == [f"cannot start: environment: {said}"]
    assert not (tmp_path / "run").exists()


def test_a_process_group_that_failed_to_start_leaves_the_rank_readable(monkeypatch):
    """The error handler asks whether this is the main process after accelerate failed half-way
    (no MASTER_ADDR): that question must not raise (it did: AttributeError), hiding the error."""
    from accelerate import PartialState

    from crystal_grpo.distributed import is_main_process

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    PartialState._reset_state()
    try:
        with pytest.raises(ValueError, match="MASTER_ADDR"):
            PartialState(cpu=True)
        assert is_main_process() is True
    finally:
        PartialState._reset_state()


# --- item 18: the main process's message under torchrun ---------------------------------------------
#: rank 0 reaches the message a few seconds after rank 1 (a loaded node): rank 1 must not exit first,
#: or torchrun stops rank 0 before it prints.
SLOW_MAIN_PROCESS = """
from crystal_grpo.train import grpo as g
checked = g.preflight
def slow_on_rank_0(cfg):
    if os.environ.get("RANK") == "0":
        time.sleep(4)
    return checked(cfg)
g.preflight = slow_on_rank_0
"""


@pytest.mark.slow
def test_two_processes_report_missing_pieces_once_however_late_the_main_process(tmp_path):
    from runs import grpo_with

    script = tmp_path / "slow_main.py"
    script.write_text(grpo_with(SLOW_MAIN_PROCESS))
    proc = torchrun_script(script, "--config", "tiny.yaml", "--cpu_backend", "gloo", "--output_dir",
                           str(tmp_path / "r"), "--model.name_or_path", str(tmp_path / "no-model"), "--data.train",
                           str(tmp_path / "no.jsonl"))
    assert proc.returncode != 0
    assert proc.stderr.count("cannot start: 2 problem(s)") == 1, proc.stderr[-3000:]
    assert proc.stderr.count(f"model.name_or_path: no such folder '{tmp_path / 'no-model'}'") == 1
    assert not (tmp_path / "r").exists()

