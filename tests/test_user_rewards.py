"""A user's own reward, named in YAML: a RewardModule subclass by import path, or a weighted
sum of TRL-style reward functions and crystal: terms (rewards/user.py)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.user import RewardFunctionError, load_object
from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.train.tools.evaluate import main as evaluate_main
from crystal_grpo.typed import ConfigError

REPO = Path(__file__).resolve().parents[1]
USER_CODE = '''
import json
import re
import threading
from crystal_grpo.rewards.base import RewardModule

def says_answer(completions, answer, **kwargs):
    """1 when the completion's JSON answer is the row's answer (what an open-r1 user writes)."""
    out = []
    for c, a in zip(completions, answer):
        text = c[0]["content"] if isinstance(c, list) else c
        try:
            out.append(float(str(json.loads(text).get("answer")) == str(a)))
        except Exception:
            out.append(0.0)
    return out

def only_with_choices(completions, choices, **kwargs):
    return [None if not ch else 0.5 for ch in choices]

def one_value(completions, **kwargs):
    return [1.0]

def words(completions, **kwargs):
    return ["many"] * len(completions)

def divides(completions, **kwargs):
    return [1 / 0 for _ in completions]

def keyword_only(*, completions, answer):
    return [0.0 for _ in completions]

#: set by the test once it has heard that ``waits`` is still running
HEARD = threading.Event()

def waits(completions, **kwargs):
    HEARD.wait(60)  # (a judge model, an API) until the progress line came, so no clock decides the test
    return [0.0 for _ in completions]

def inf_reward(completions, **kwargs):
    return [float("inf")] * len(completions)

def one_minus_inf(completions, **kwargs):
    return [0.0] * (len(completions) - 1) + [float("-inf")]

def huge(completions, **kwargs):
    return [1e308] * len(completions)

def nan_reward(completions, **kwargs):
    return [float("nan")] * len(completions)

def numpy_scalars(completions, **kwargs):
    import numpy as np
    return [np.float32(0.5), np.int64(1), np.float64(0.25)][:len(completions)]

def numpy_array(completions, **kwargs):
    import numpy as np
    return np.arange(len(completions), dtype=np.float32)

def booleans(completions, **kwargs):
    import numpy as np
    return [True, False, np.bool_(True)][:len(completions)]

def tensor_values(completions, **kwargs):
    import torch
    return torch.arange(len(completions), dtype=torch.float32)

def exits(completions, **kwargs):
    raise SystemExit(0)

NOT_A_FUNCTION = 3

class Shortness(RewardModule):
    name = "shortness"
    objectives = {"short": "accuracy"}
    uses_steps = False

    def components(self, batch):
        return {"short": 1.0 / (1.0 + batch.n_pred)}

class Unbounded(RewardModule):
    name = "unbounded"
    objectives = {"x": "accuracy"}
    uses_steps = False

    def components(self, batch):
        return {"x": batch.correct.new_tensor([0.0, float("inf")] + [float("nan")] * (len(batch) - 2))}

class Exiting(Unbounded):
    def components(self, batch):
        import sys
        sys.exit(0)
'''

DIVIDES_LINE = next(i for i, line in enumerate(USER_CODE.splitlines(), 1) if "1 / 0" in line)
ROWS = [
    {"answer": "4", "reference_steps": ["2 + 2 = 4."], "choices": []},
    {"answer": "B", "reference_steps": ["The second option is right."], "choices": ["x", "y"]},
    {"answer": "9", "reference_steps": ["3 * 3 = 9.", "So 9."], "choices": []},
]
COMPLETIONS = [
    '{"reasoning_steps": ["2 + 2 = 4."], "answer": "4"}',
    '{"reasoning_steps": ["The first option is right."], "answer": "A"}',
    '{"reasoning_steps": ["3 * 3 = 9."], "answer": "9"}',
]
ENC = {"encoder": "packaged:all-MiniLM-L6-v2", "device": "cpu"}


@pytest.fixture
def user_file(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    return path


def test_composed_crystal_terms_are_cpr_and_user_functions_add_their_values(user_file):
    cpr = build_reward("cpr", **ENC)
    same = build_reward(
        "composed",
        **ENC,
        components=[
            {"fn": "crystal:accuracy", "weight": 0.65, "objective": "accuracy"},
            {"fn": "crystal:cpr_steps", "weight": 0.35, "objective": "reasoning"},
        ],
    )
    want = cpr.total(cpr.score(COMPLETIONS, ROWS).batch)
    assert torch.allclose(same.total(same.score(COMPLETIONS, ROWS).batch), want)
    mixed = build_reward(
        "composed",
        **ENC,
        components=[
            {"fn": f"{user_file}:says_answer", "weight": 2.0, "objective": "accuracy"},
            {"fn": f"{user_file}:only_with_choices", "name": "mc", "objective": "accuracy"},
            {"fn": "crystal:steps", "weight": 0.5, "objective": "reasoning"},
        ],
    )
    batch = mixed.score(COMPLETIONS, ROWS).batch
    comps = mixed.components(batch)
    assert list(comps) == ["says_answer", "mc", "steps"] and mixed.objectives["steps"] == "reasoning"
    assert comps["says_answer"].tolist() == [2.0, 0.0, 2.0]
    assert torch.isnan(comps["mc"][0]) and comps["mc"][1] == 0.5  # None: not applicable, as in TRL
    assert torch.allclose(comps["steps"], 0.5 * batch.step)
    funcs = mixed.reward_funcs()  # the same reward in a plain trl.GRPOTrainer
    assert [f.__name__ for f in funcs] == ["says_answer", "mc", "steps"]
    got = funcs[0](prompts=["p"] * 3, completions=COMPLETIONS, **{k: [r[k] for r in ROWS] for k in ROWS[0]})
    assert got == [2.0, 0.0, 2.0]


def test_a_reward_module_by_import_path_and_by_relative_file(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    module = build_reward("./my_rewards.py:Shortness")
    assert module.name == "shortness" and load_object("./my_rewards.py:NOT_A_FUNCTION") == 3
    assert module.total(module.score(COMPLETIONS, ROWS).batch).tolist() == [0.5, 0.5, 0.5]
    monkeypatch.syspath_prepend(str(user_file.parent))
    cfg, _ = load_config("tiny.yaml", ["--reward.name", "my_rewards:Shortness", "--reward.params", "{}"])
    assert cfg.reward.name == "my_rewards:Shortness"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            ["--reward.name", "no_such_pkg.rewards:R"],
            "reward 'no_such_pkg.rewards:R': no_such_pkg.rewards does not import "
            "(ModuleNotFoundError: No module named "
            "'no_such_pkg')",
        ),
        (
            ["--reward.name", "{d}/my_rewards.py:Missing"],
            "reward '{d}/my_rewards.py:Missing': {d}/my_rewards.py has no 'Missing'",
        ),
        (
            ["--reward.name", "{d}/my_rewards.py:says_answer"],
            "is a function, not a RewardModule subclass (a plain reward function goes in reward.components)",
        ),
        (["--reward.components", "[{fn: '{d}/my_rewards.py:NOT_A_FUNCTION'}]"], "is a int, not a function"),
        (["--reward.components", "[{fn: '{d}/broken.py:f'}]"], "broken.py does not import (SyntaxError"),
        (
            ["--reward.components", "[{fn: 'crystal:f1'}]"],
            "unknown term 'crystal:f1'; crystal: terms are crystal:accuracy",
        ),
        (
            ["--reward.components", "[{fn: 'crystal:accuracy', weight: two}]"],
            "reward.components[0].weight: invalid value 'two'; expected float",
        ),
        (
            [
                "--reward.components",
                "[{fn: 'crystal:accuracy', objective: accuracy}, {fn: 'crystal:steps'}]",
                "--pcgrad",
                "true",
            ],
            "reward.components[1].objective: required with pcgrad: true",
        ),
        (
            ["--reward.name", "composite", "--reward.components", "[{fn: 'crystal:accuracy'}]"],
            "reward: both name 'composite' and components; give one of them",
        ),
    ],
)
def test_bad_user_rewards_are_one_line_before_anything_loads(user_file, override, message):
    (user_file.parent / "broken.py").write_text("def f(:\n")
    d = str(user_file.parent)
    with pytest.raises(ConfigError) as err:
        load_config("tiny.yaml", [o.replace("{d}", d) for o in override])
    assert message.replace("{d}", d) in str(err.value)


@pytest.mark.parametrize(
    "fn, message",
    [
        ("one_value", "returned 1 value(s) for 3 completion(s); expected a list with one number (or None) per"),
        ("words", "returned 'many' for completion 0; expected a number or None"),
    ],
)
def test_a_function_returning_the_wrong_thing_is_named_at_the_first_batch(user_file, fn, message):
    module = build_reward("composed", components=[{"fn": f"{user_file}:{fn}"}])
    with pytest.raises(RewardFunctionError, match=re.escape(f"reward component '{user_file}:{fn}' {message}")):
        module.score(COMPLETIONS, ROWS)


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            "divides",
            f"on 3 completion(s) of rows a, b, c raised ZeroDivisionError: division by zero (at "
            f"my_rewards.py:{DIVIDES_LINE} in <listcomp>; CRYSTAL_GRPO_TRACEBACK=1 prints the traceback)",
        ),
        (
            "keyword_only",
            "on 3 completion(s) of rows a, b, c: cannot be called as TRL calls a reward function, "
            "fn(completions, **columns) with the columns answer, reference_steps, choices, id (got an "
            "unexpected keyword argument 'reference_steps'); give it a **kwargs parameter",
        ),
    ],
)
def test_a_function_that_raises_or_cannot_take_the_columns_is_one_line_naming_it_and_the_rows(user_file, fn, message):
    module = build_reward("composed", components=[{"fn": f"{user_file}:{fn}"}])
    rows = [{**row, "id": name} for row, name in zip(ROWS, "abc")]
    with pytest.raises(RewardFunctionError) as err:
        module.score(COMPLETIONS, rows)
    assert str(err.value) == f"reward component '{user_file}:{fn}' {message}"


@pytest.mark.parametrize(
    "fn, values",
    [
        ("numpy_scalars", [0.5, 1.0, 0.25]),
        ("numpy_array", [0.0, 1.0, 2.0]),
        ("tensor_values", [0.0, 1.0, 2.0]),
        ("booleans", [1.0, 0.0, 1.0]),
    ],
)
def test_numbers_numpy_and_torch_return_are_numbers_as_in_trl(user_file, fn, values):
    """np.float32(0.5) and np.int64(1) were refused as "not a number", a numpy array or a torch
    tensor as "not a list", True and False as "not a number" (`[c == a for ...]`); TRL takes them
    all (second hostile set)."""
    module = build_reward("composed", components=[{"fn": f"{user_file}:{fn}"}])
    assert module.components(module.score(COMPLETIONS, ROWS).batch)[fn].tolist() == values


UNUSABLE = (
    "(a reward value must be finite and at most 1e+15 in magnitude: TRL's float32 group statistics cannot hold it)"
)


@pytest.mark.parametrize(
    "fn, message",
    [
        ("inf_reward", f"returned inf {UNUSABLE} for completion 0 (row 'a')"),
        ("one_minus_inf", f"returned -inf {UNUSABLE} for completion 2 (row 'c')"),
        ("huge", f"returned 1e+308 {UNUSABLE} for completion 0 (row 'a')"),
        (
            "nan_reward",
            "returned nan (NaN is not a reward: return None where the function does not apply, as in TRL) for "
            "completion 0 (row 'a')",
        ),
        (
            "exits",
            "on 3 completion(s) of rows a, b, c raised SystemExit(0): a reward returns one value a completion; it "
            "must not end the process",
        ),
    ],
)
def test_a_value_no_advantage_can_be_made_of_is_an_error_naming_function_row_and_value(user_file, fn, message):
    """inf or 1e308 trained nothing (grad norm 0) without a word; -inf in one completion, from the
    next step on; NaN was read as None, so a weight-1.0 term vanished; sys.exit(0) ended the run
    with exit status 0. None stays "not applicable", as in TRL."""
    module = build_reward("composed", components=[{"fn": f"{user_file}:{fn}"}])
    rows = [{**r, "id": i} for r, i in zip(ROWS, "abc")]
    with pytest.raises(RewardFunctionError) as err:
        module.score(COMPLETIONS, rows)
    assert str(err.value) == f"reward component '{user_file}:{fn}' {message}"


def test_a_slow_function_is_said_to_be_running(user_file, monkeypatch, caplog):
    """The function returns only once its progress line was logged (or after 60 s, failing), so
    the test needs no timing: the threshold is made small, and the line must come."""
    from crystal_grpo.rewards import user

    monkeypatch.setattr(user, "SLOW_CALL_S", 0.01)
    heard = load_object(f"{user_file}:HEARD")

    class Hears(logging.Handler):
        def emit(self, record):
            if "still running" in record.getMessage():
                heard.set()

    module = build_reward("composed", components=[{"fn": f"{user_file}:waits"}])
    hears = Hears()
    logging.getLogger(user.__name__).addHandler(hears)
    try:
        with caplog.at_level(logging.WARNING, logger=user.__name__):
            module.score(COMPLETIONS, [{**row, "id": f"r{i}"} for i, row in enumerate(ROWS)])
    finally:
        logging.getLogger(user.__name__).removeHandler(hears)
    said = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert heard.is_set() and said[0] == (
        f"reward component '{user_file}:waits' on 3 completion(s) of rows r0, r1, r2: still running, 0 s so far"
    ), said


@pytest.mark.slow  # a run, though of a committed model
@pytest.mark.parametrize("traceback", [False, True], ids=["one_line", "with_traceback"])
def test_a_run_whose_reward_raises_says_it_in_one_line(user_file, tmp_path, capsys, monkeypatch, traceback):
    monkeypatch.delenv("CRYSTAL_GRPO_TRACEBACK", raising=False)
    if traceback:
        monkeypatch.setenv("CRYSTAL_GRPO_TRACEBACK", "1")
    argv = [
        "--config",
        "tiny.yaml",
        "--model.name_or_path",
        str(REPO / "data/organism/warm_start"),
        "--output_dir",
        str(tmp_path / "run"),
        "--reward.components",
        f"[{{fn: '{user_file}:divides'}}]",
        "--validation.max_samples",
        "1",
        "--validation.max_new_tokens",
        "4",
        "--reward.params.encoder",
        "exact",
        "--training.disable_tqdm",
        "false",
    ]  # the trainer's bar, and no other, is open when the error comes
    assert grpo.main(argv) == 2  # at the first call: validation before the first step
    err = capsys.readouterr().err  # (besides transformers' progress bars)
    said = [line for line in err.splitlines() if line.startswith("RewardFunctionError")]
    assert len(said) == 1 and said[0].startswith(
        f"RewardFunctionError: reward component '{user_file}:divides' on 1 completion(s) of rows "
    )
    assert said[0].endswith(
        f"raised ZeroDivisionError: division by zero (at my_rewards.py:{DIVIDES_LINE} in "
        "<listcomp>; CRYSTAL_GRPO_TRACEBACK=1 prints the traceback)"
    )
    assert ("Traceback (most recent call last):" in err) is traceback
    assert (f'my_rewards.py", line {DIVIDES_LINE}' in err) is traceback


def test_a_reward_module_s_infinite_component_is_an_error_wherever_it_is_read(user_file):
    """A module's NaN is "not applicable" (its components' contract); inf is not a reward."""
    module = build_reward(f"{user_file}:Unbounded")
    batch = module.score(COMPLETIONS, ROWS).batch
    for read in (module.total, module.rewards, module.metrics):  # training, validation, evaluation
        with pytest.raises(
            RewardFunctionError,
            match=re.escape(f"reward 'unbounded': component 'x' is inf {UNUSABLE} for completion 1 of the batch"),
        ):
            read(batch)


def _user_run(user_file, tmp_path, tiny_lm_path, reward: dict) -> list[str]:
    """train/grpo.py's arguments for tiny.yaml with ``reward``, validating one short row at step 0
    (the first call of the reward)."""
    config = tmp_path / "mine.yaml"
    raw = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    raw["reward"] = reward
    config.write_text(yaml.safe_dump(raw))
    return [
        "--config",
        str(config),
        "--output_dir",
        str(tmp_path / "run"),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--validation.max_samples",
        "1",
        "--validation.max_new_tokens",
        "8",
    ]


def test_runs_with_an_unusable_reward_stop_with_one_line(user_file, tmp_path, tiny_lm_path, capsys):
    """Before: exit 0, "steps 2", validation "inf -> inf", nothing learnt; a
    reward calling sys.exit(0): exit 0, no word, no run folder."""

    def fn(name):
        return {"params": ENC, "components": [{"fn": f"{user_file}:{name}", "objective": "accuracy"}]}

    for reward, code, line in (
        (fn("one_minus_inf"), 2, f"RewardFunctionError: reward component '{user_file}:one_minus_inf' returned -inf"),
        (fn("exits"), 2, f"RewardFunctionError: reward component '{user_file}:exits' on 1 completion(s)"),
        (
            {"name": f"{user_file}:Exiting", "params": ENC},
            1,
            f"error: the run was ended by SystemExit(0) raised in components ({user_file}:",
        ),
    ):
        assert grpo.main(_user_run(user_file, tmp_path, tiny_lm_path, reward)) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(line), err[-3:]


def test_yaml_trains_with_a_reward_from_a_user_file_and_evaluates_with_it(user_file, tmp_path, tiny_lm_path):
    config = tmp_path / "mine.yaml"
    raw = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    raw["model"]["name_or_path"] = str(tiny_lm_path)
    raw["reward"] = {
        "params": ENC,
        "components": [
            {"fn": f"{user_file}:says_answer", "weight": 1.0, "objective": "accuracy"},
            {"fn": "crystal:cpr_steps", "weight": 0.35, "objective": "reasoning"},
        ],
    }
    raw["pcgrad"] = True
    raw["training"]["max_steps"] = 2
    config.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    assert grpo.main(["--config", str(config), "--output_dir", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert len(trained) == 2 and all(
        "rewards/says_answer/mean" in r and "rewards/cpr_steps/mean" in r and "pcgrad/cosine" in r for r in trained
    )
    out = tmp_path / "eval"
    assert (
        evaluate_main(
            [
                "--model",
                str(run / "final"),
                "--data",
                "data/wordproblems/val.jsonl",
                "--max_samples",
                "4",
                "--max_new_tokens",
                "24",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["reward"] == "composed" and "reward" in report["overall"]
