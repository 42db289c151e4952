"""The extension points docs/extending.md names, each added from outside the package
as a user adds it: a module of their own and a YAML file, no edit of crystal_grpo. A reward and
a reward component are in tests/test_user_rewards.py; a metric, a curriculum mode, a mode's
option and a data format are here. Each check reads what the run would read (the loaded
config, the reward's metrics, the evaluation report, the sampler's chunks, the loaded data)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crystal_grpo import metrics
from crystal_grpo.curricula import make_sampler_factory
from crystal_grpo.rewards import build_reward
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.typed import ConfigError

USER_CODE = '''
from dataclasses import dataclass

from crystal_grpo.curricula.schedule import Schedule
from crystal_grpo.metrics import MetricSpec, register
from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.typed import option

register(MetricSpec("short", "shortness", "reward"),  # the value of my reward's component of that name
         MetricSpec("answer_only_format", "format term", "reward"))  # a shipped reward's component


class Short(RewardModule):
    name = "short"
    objectives = {"short": "accuracy"}
    uses_steps = False

    def components(self, batch):
        return {"short": 1.0 / (1.0 + batch.n_pred)}


class HardestFirst(Schedule):
    """The pool is always the hardest `share` of the data."""

    mode = "hardest_first"
    needs_horizon = False

    @dataclass
    class Options:
        share: float = option(0.5, "Share of the data in the pool.", gt=0, le=1)

    def __init__(self, order, batch_size, total_steps, **kwargs):
        super().__init__(order, batch_size, total_steps, **kwargs)
        self.key = [0] * self.n
        for rank, i in enumerate(reversed(order)):
            self.key[i] = rank

    def threshold(self, t):
        return max(self.batch_size, round(self.options.share * self.n))

    def competence(self, t):
        return self.options.share
'''

ROWS = [
    {"id": "r0", "question": "2 + 2?", "answer": "4", "reference_steps": ["2 + 2 = 4."]},
    {"id": "r1", "question": "3 * 3?", "answer": "9", "reference_steps": ["3 * 3 = 9.", "So 9."]},
]
PREDICTIONS = [
    {"id": "r0", "sample": 0, "completion": '{"reasoning_steps": ["2 + 2 = 4."], "answer": "4"}'},
    {"id": "r1", "sample": 0, "completion": '{"reasoning_steps": ["a", "b", "c"], "answer": "8"}'},
]


@pytest.fixture
def user_file(tmp_path, monkeypatch) -> Path:
    """The user's module; the metric rows it registers are undone after the test."""
    monkeypatch.setattr(metrics, "TABLE", metrics.TABLE)
    path = tmp_path / "extend.py"
    path.write_text(USER_CODE)
    return path


def user_config(tmp_path: Path, **sections) -> Path:
    """The user's YAML: the shipped tiny config with their sections."""
    raw = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    raw.update(sections)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_metric_is_one_row(user_file, tmp_path):
    """A row registered by the user's module is reported by validation (``RewardModule.metrics``),
    kept per completion and reported with its label by evaluation, and can pick the best
    checkpoint; a ``reward`` row that a reward has no value for is NaN (it raised AttributeError)."""
    from crystal_grpo.train.tools.eval_report import build_report, markdown
    from crystal_grpo.train.tools.evaluate import score_predictions

    cfg, _ = load_config(
        str(user_config(tmp_path, reward={"name": f"{user_file}:Short"}, validation={"metric": "short"}))
    )
    assert cfg.validation.metric == "short"
    module = cfg.reward.build()
    completions = [p["completion"] for p in PREDICTIONS]
    batch = module.score(completions, ROWS).batch
    assert module.metrics(batch)["short"] == pytest.approx((1 / 2 + 1 / 4) / 2)  # 1 and 3 steps

    answer_only = build_reward("answer_only")
    shipped = answer_only.metrics(answer_only.score(completions, ROWS).batch)
    assert shipped["answer_only_format"] == pytest.approx(0.1) and math.isnan(shipped["short"])

    scored, _ = score_predictions(module, ROWS, PREDICTIONS)
    assert [s["short"] for s in scored] == [0.5, 0.25]
    report = build_report(ROWS, scored, {}, bootstrap=20)
    assert report["overall"]["short"]["value"] == pytest.approx(0.375)
    text = markdown({**report, "data": "d", "reward": "short", "sampling": {"temperature": 0}})
    assert any(line.startswith("| Shortness | 0.375 |") for line in text.splitlines())

    with pytest.raises(
        ConfigError,
        match=r"^validation.metric: invalid value 'shrot'; expected one of 'accuracy'.*"
        r"'reward', 'short', 'answer_only_format'$",
    ):
        load_config(str(user_config(tmp_path, reward={"name": f"{user_file}:Short"}, validation={"metric": "shrot"})))
    with pytest.raises(metrics.MetricTableError, match="'short' is already in the metric table"):
        metrics.register(metrics.MetricSpec("short", "brevity", "reward"))


def test_a_curriculum_mode_is_one_class_named_from_yaml_with_its_own_option(user_file, tmp_path):
    mode = f"{user_file}:HardestFirst"
    cfg, _ = load_config(str(user_config(tmp_path, curriculum={"mode": mode, "share": 0.25})))
    assert cfg.curriculum.config.share == 0.25
    data = [
        {"prompt": [{"role": "user", "content": f"q{k}"}], "answer": "1", "reference_steps": ["s"] * k}
        for k in range(1, 41)
    ]
    factory = make_sampler_factory(cfg.curriculum, data, max_steps=10)
    sampler = factory(data, mini_repeat_count=2, batch_size=4)
    hardest = {i for i, row in enumerate(data) if len(row["reference_steps"]) > 30}  # the hardest quarter
    assert all(set(sampler.chunk_indices(t)) <= hardest for t in range(20))
    assert {i for t in range(20) for i in sampler.chunk_indices(t)} == hardest
    # named in YAML, checked with the config: one line each, and no heavy package loaded
    code = (
        "import sys; from crystal_grpo.train.config.run_config import load_config; "
        f"load_config({str(tmp_path / 'mine.yaml')!r}); "
        "print(sorted(m for m in ('torch', 'trl', 'transformers', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    "curriculum, message",
    [
        (
            {"mode": "no_such_pkg.schedules:S"},
            "curriculum.mode 'no_such_pkg.schedules:S': no_such_pkg.schedules does not "
            "import (ModuleNotFoundError: No module named 'no_such_pkg')",
        ),
        ({"mode": "{f}:Missing"}, "curriculum.mode '{f}:Missing': {f} has no 'Missing'"),
        ({"mode": "{f}:Short"}, "curriculum.mode '{f}:Short' is a type, not a Schedule subclass"),
        ({"mode": "hardest_third"}, "curriculum.mode: invalid value 'hardest_third'; expected one of 'competence'"),
        (
            {"mode": "{f}:HardestFirst", "shares": 0.5},
            "unknown key 'curriculum.shares' (did you mean 'share'?) for mode 'hardest_first'",
        ),
        ({"mode": "{f}:HardestFirst", "share": 2}, "curriculum.share: invalid value 2; expected 0 < x <= 1"),
        (
            {"mode": "sorted", "c0": 0.3},
            "unknown key 'curriculum.c0' for mode 'sorted'; curriculum takes mode, "
            "total_steps, difficulty, start_chunk, and it has no options of its own",
        ),
    ],
)
def test_a_bad_curriculum_mode_or_option_is_one_line(user_file, tmp_path, curriculum, message):
    f = str(user_file)
    with pytest.raises(ConfigError) as err:
        load_config(
            str(
                user_config(
                    tmp_path,
                    curriculum={k: v.replace("{f}", f) if isinstance(v, str) else v for k, v in curriculum.items()},
                )
            )
        )
    assert message.replace("{f}", f) in str(err.value) and "\n" not in str(err.value)


def test_a_shipped_modes_option_from_yaml_bucket_order(tmp_path):
    """``bucket_order`` reaches the buckets schedule from YAML, and a phase that switches mode does
    not inherit the base mode's options."""
    phases = [
        {"name": "first", "overrides": {"curriculum": {"mode": "buckets", "bucket_order": ["hard", "medium", "easy"]}}}
    ]
    cfg, _ = load_config(str(user_config(tmp_path, curriculum={"mode": "competence", "c0": 0.3}, phases=phases)))
    section = cfg.phases[0].config.curriculum
    assert section.mode == "buckets" and section.config.bucket_order == ["hard", "medium", "easy"]
    easy = {"question": "Is the cat black?", "answer": "yes", "reference_steps": ["s"] * 3}  # tiers: test_curriculum
    hard = {
        "question": "Why is it not warmer if it is closer because of the sun?",
        "answer": "the sun heats the air",
        "reference_steps": ["s"] * 24,
    }
    data = [easy, hard] * 12
    factory = make_sampler_factory(section, data, max_steps=9)
    sampler = factory(data, mini_repeat_count=1, batch_size=4)
    assert sampler.bucket_order == ["hard", "medium", "easy"]
    assert all(data[i] is hard for t in range(3) for i in sampler.chunk_indices(t))  # hard opens first
    assert any(data[i] is easy for t in range(6, 9) for i in sampler.chunk_indices(t))


def test_a_data_format_is_a_column_mapping_in_yaml(tmp_path):
    """Data in the user's own column names, as a JSON array: ``data.columns`` in their YAML maps
    them onto ours, and a bad row is named by file, row and the user's column name."""
    from crystal_grpo.train.data.splits import DataError, load_datasets

    rows = [
        {"problem": f"What is {k} + {k}?", "solution": str(2 * k), "steps": [f"{k} + {k} = {2 * k}."]}
        for k in range(1, 5)
    ]
    (tmp_path / "mine.json").write_text(json.dumps(rows))
    columns = {"question": "problem", "answer": "solution", "reference_steps": "steps"}
    data = {"train": str(tmp_path / "mine.json"), "validation": str(tmp_path / "mine.json"), "columns": columns}
    cfg, _ = load_config(str(user_config(tmp_path, data=data)))
    train, _ = load_datasets(cfg.data)
    first = train.dataset[0]
    assert "What is 1 + 1?" in first["prompt"][-1]["content"]
    assert first["answer"] == "2" and first["reference_steps"] == ["1 + 1 = 2."]
    rows[2]["steps"] = "3 + 3 = 6."
    (tmp_path / "mine.json").write_text(json.dumps(rows))
    with pytest.raises(
        DataError, match=r"mine.json:3: 'steps' \(data.columns.reference_steps\) must be a non-empty list"
    ):
        load_datasets(cfg.data)
