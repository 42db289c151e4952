"""One YAML file describes a run: model, data, reward, curriculum, validation and TRL's
``GRPOConfig`` fields (under ``training``). Each section is a config dataclass documented
beside the code that reads it (``ModelSection`` in train/models/loading.py, ``CPRConfig`` in
rewards/cpr.py, ``CurriculumSection`` in curricula/schedule.py, ...); the ones whose code
subclasses transformers' or TRL's classes (validation, stability, dynamic sampling) are defined
here, and ``RunConfig`` composes them all.

Every key and value is checked once, at load, before any model loads: unknown keys,
values of the wrong type (for ``training`` against ``GRPOConfig``'s own field types, read
from train/config/trl_fields_table.py; for ``reward.params`` against the reward's config class) and
values out of range each stop the run with one line naming the key, the value and what is
expected. What the checks make is what the code receives: ``reward.config`` (the reward's
typed config; ``reward.build()`` makes the module from it) and each phase's
``phases[i].config`` (:func:`phase_configs`). Loading imports neither torch nor TRL, so
``train/grpo.py --config X --check`` answers in a fraction of a second. Command-line overrides
(``--section.key value``, values parsed as YAML) win over the file. YAML is read with
the safe loader, extended so that ``1e-5`` is a number (YAML 1.2, as every user writes
it) and a key given twice in one mapping is an error instead of a silent overwrite.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from crystal_grpo.curricula.schedule import SECTION_KEYS as CURRICULUM_KEYS
from crystal_grpo.curricula.schedule import CurriculumSection
from crystal_grpo.curricula.schedule import resolve as resolve_curriculum
from crystal_grpo.metrics import Metric
from crystal_grpo.metrics import names as metric_names
from crystal_grpo.paths import expand_config_paths, name_problem, user_path
from crystal_grpo.rewards import REWARDS, RewardConfig, RewardModule, reward_class
from crystal_grpo.rewards.step_credit import StepCreditConfig
from crystal_grpo.train.config.refusals import (
    aggregation_refused,
    dynamic_sampling_refused,
    liger_refused,
    remove_unused_columns_refused,
    training_refused,
)
from crystal_grpo.train.config.training_section import newer_field_type, training_field_types
from crystal_grpo.train.data.splits import DataSection
from crystal_grpo.train.models.generation import vllm_problem
from crystal_grpo.train.models.loading import LoraSection, ModelSection  # noqa: F401 - part of the run config
from crystal_grpo.train.models.vision import VisionSection  # noqa: F401 - part of the run config
from crystal_grpo.typed import ConfigError, Range, check_value, derived, from_dict, option, to_dict

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
#: What trains a phase: TRL's GRPOTrainer, or its SFTTrainer for a supervised warm start.
TrainerKind = Literal["grpo", "sft"]


@dataclass
class ValidationSection:
    """Greedy validation during training (``validation:`` in a run config)."""

    eval_steps: int = option(0, "Validate every N optimizer steps (0: only at the end).", ge=0)
    max_samples: Union[int, None] = option(None, "Cap on validation rows (None: all).", ge=1)
    max_new_tokens: int = option(256, "Greedy generation length.", ge=1)
    batch_size: int = option(8, "Generation batch size per process.", ge=1)
    temperature: float = option(
        0.0,
        "0: greedy (the paper's evaluation). Above 0: sampled at this temperature, "
        "num_samples completions a row, from a seed fixed per step (training's random "
        "state untouched): the policy's sampled accuracy, which GRPO optimises and which "
        "greedy decoding can hide.",
        ge=0,
    )
    num_samples: int = option(1, "Completions a row (metrics average over all of them).", ge=1)
    metric: str = option(
        "accuracy",
        "Best checkpoint by this metric: a validation metric of the metric table "
        "(crystal_grpo/metrics.py: " + ", ".join(typing.get_args(Metric)) + "), or one your "
        "reward's module registers.",
    )
    at_start: bool = option(
        True,
        "Also validate before the first step (step 0), so every curve shows where it "
        "began; not a best-checkpoint candidate (no checkpoint holds those weights).",
    )


@dataclass
class StabilitySection:
    """What to do about non-finite updates (``stability:`` in a run config)."""

    max_consecutive_nonfinite: int = option(5, "Save and stop after this many skipped non-finite updates.", ge=1)


@dataclass
class DynamicSamplingSection:
    """Groups whose rewards do not vary (DAPO's dynamic sampling; ``dynamic_sampling:`` in a run
    config, train/trainer/dynamic_sampling.py). Off by default: every group trains, as in TRL."""

    mode: Literal["none", "mask", "refill"] = option(
        "none",
        "none: every group trains (TRL). mask: a flat group gets zero weight: out of the loss, the KL term "
        "and the loss's normaliser. refill (DAPO): up to max_num_gen_batches generation batches a step, informative "
        "groups of the later ones taking the flat groups' places; the flat groups still left are masked.",
    )
    min_std: float = option(
        0.0,
        "A group is flat when the std of what the metric judges is at most this (0: only "
        "groups whose values are all equal).",
        ge=0,
    )
    metric: Literal["reward", "objectives", "outcome"] = option(
        "reward",
        "Whose std: reward, the total reward (TRL's advantage is made of it); objectives (pcgrad: true "
        "only), each objective's part: PCGrad's accuracy loss leaves out the groups flat on accuracy, its reasoning "
        "loss those flat on reasoning, and only a group flat on both is out of the KL term and refilled; outcome, "
        "the answer's raw correctness (the reward's accuracy component before its weight): a group whose answers "
        "are all right or all wrong is flat however its step scores vary (verl's filter_groups metric acc).",
    )
    max_num_gen_batches: int = option(
        3, "refill: generation batches a step at most, the first included (verl's name); 1 is mask.", ge=1
    )


@dataclass
class AlarmSection:
    """Alarms on the training log (``alarms:`` in a run config; train/trainer/alarms.py); a bound of None
    turns one off."""

    max_truncated: Union[float, None] = option(
        0.5,
        "Share of completions cut off at max_completion_length above which to warn (their rewards are "
        "mostly the malformed ones).",
        ge=0,
        le=1,
    )
    min_steps: Union[float, None] = option(
        3.0,
        "Mean reasoning steps written below which to warn (the authors' floor; only where the reward scores steps).",
        ge=0,
    )
    min_recall: Union[float, None] = option(
        0.25, "Step recall below which to warn (the authors' floor; only where the reward scores steps).", ge=0, le=1
    )
    zero_std_steps: Union[int, None] = option(
        20, "Warn after this many consecutive steps whose rewards have zero std (no advantage anywhere).", ge=1
    )
    window: int = option(10, "Steps averaged before the steps/recall/truncation bounds are judged.", ge=1)
    stop_on_alarm: bool = option(False, "Save and stop the run when an alarm fires.")


@dataclass
class RewardSection:
    """The reward (``reward:``): its name and the fields of its config class as ``params``."""

    name: str = option(
        "cpr",
        f"A reward registered in crystal_grpo.rewards.REWARDS: {', '.join(REWARDS)}; or your RewardModule "
        "subclass as 'package.module:Name' or 'path/file.py:Name' (rewards/user.py).",
    )
    params: dict[str, Any] = option(
        default_factory=dict,
        help="Fields of the reward's config (RewardConfig and "
        "e.g. CPRConfig: answer_weight, step_weight, wrong_answer_discount).",
    )
    components: list[dict[str, Any]] = option(
        default_factory=list,
        help="Instead of a name: a weighted sum of reward functions, each {fn: "
        "'package.module:name' or crystal:<term>, weight, objective: accuracy|reasoning} (rewards/user.py).",
    )
    step_credit: StepCreditConfig = option(
        default_factory=StepCreditConfig,
        help="Per-token advantages from the matched steps, with any reward: {weight: W} (docs/method.md, "
        '"Step credit"; weight 0: off).',
    )
    config: Union[RewardConfig, None] = derived(
        "The reward's typed config, made from params once when the "
        "config is validated; the reward module is built from it."
    )

    def build(self) -> RewardModule:
        """The reward module this section describes (after validation)."""
        if self.config is None:
            raise ValueError("reward section not validated yet: load it with load_config (or validate)")
        # step_credit only when on: a reward module of your own whose __init__ does not take it still builds
        credit = {"step_credit": self.step_credit} if self.step_credit.on else {}
        return reward_class(self.name)(self.config, **credit)


@dataclass
class PhaseSection:
    """One phase of a multi-phase schedule: any top-level section overridden."""

    name: str = option("", "The phase's name (its folder: phase<i>-<name>).")
    trainer: TrainerKind = option(
        "grpo",
        "grpo, or sft: a supervised warm start on the training rows rendered "
        "as the target JSON, with GRPO's prompt and the loss on the completion only.",
    )
    init_from: Literal["best", "last", "none"] = option(
        "best", "Which checkpoint of the previous phase to start from."
    )
    overrides: dict[str, Any] = option(default_factory=dict, help="Sections of this config, as in the file.")
    config: Union[RunConfig, None] = derived(
        "The config this phase runs with (the run's, overrides merged), made once when the config is validated."
    )
    left_out: Union[list[str], None] = derived(
        "The run's training keys this phase does not take: the other trainer's own (split_training)."
    )


@dataclass
class RunConfig:
    """One run: each section is the config class of the code that reads it."""

    trainer: TrainerKind = option("grpo", "What trains the run (each phase sets its own as phases[].trainer).")
    model: ModelSection = option(default_factory=ModelSection, help="The policy (train/models/loading.py).")
    data: DataSection = option(default_factory=DataSection, help="Training data (train/data/splits.py).")
    reward: RewardSection = option(default_factory=RewardSection, help="The reward (rewards/).")
    curriculum: Union[CurriculumSection, None] = option(
        None, "Step-count curriculum (curricula/sampler.py); None: TRL's random order."
    )
    pcgrad: bool = option(False, "Project conflicting accuracy/reasoning gradients (docs/method.md section 9).")
    pcgrad_objective_std: bool = option(False, "Scale each objective's advantage by its own group std.")
    validation: ValidationSection = option(
        default_factory=ValidationSection, help="Greedy validation (train/trainer/callbacks.py)."
    )
    stability: StabilitySection = option(
        default_factory=StabilitySection, help="Non-finite updates (train/trainer/nonfinite.py)."
    )
    alarms: AlarmSection = option(
        default_factory=AlarmSection,
        help="Warnings when the training signal goes bad: "
        "truncation, steps or recall collapsing, zero reward std (train/trainer/alarms.py).",
    )
    dynamic_sampling: DynamicSamplingSection = option(
        default_factory=DynamicSamplingSection,
        help="Groups whose rewards do not vary: masked, or replaced by "
        "informative ones (DAPO's dynamic sampling; train/trainer/dynamic_sampling.py).",
    )
    training: dict[str, Any] = option(
        default_factory=dict, help="Any field of trl.GRPOConfig (which extends transformers.TrainingArguments)."
    )
    phases: list[PhaseSection] = option(default_factory=list, help="Empty: one phase.")
    cpu_backend: Union[Literal["gloo"], None] = option(
        None, "Multi-process on CPU for tests and CI: gloo runs DDP/ZeRO-3 without a GPU."
    )
    resume_from_checkpoint: Union[str, None] = derived(
        "training.resume_from_checkpoint, taken out of training at load: the run resumes as with the "
        "--resume_from_checkpoint flag (which wins)."
    )

    def precision(self) -> dict[str, Any]:
        """TRL's ``bf16`` / ``fp16`` for this run: ``training``'s keys, else the model's dtype. What
        ``train/grpo.py`` gives TRL, the precision check checks and a DeepSpeed ``"auto"`` becomes."""
        return {
            "bf16": self.training.get("bf16", self.model.dtype == "bfloat16"),
            "fp16": self.training.get("fp16", self.model.dtype == "float16"),
        }


@dataclass
class PaperRecipe:
    """The paper's GRPO recipe (CRYSTAL S6.1, S8.2; docs/method.md section 7): what ``training``
    holds for a GRPO phase unless the config sets the key. TRL 1.x's own defaults differ
    (e.g. ``loss_type: dapo``, ``beta: 0``, ``temperature: 1``)."""

    loss_type: str = option("grpo", "GRPO's per-sequence loss (TRL: dapo).")
    beta: float = option(0.04, "KL coefficient against the reference policy.", ge=0)
    scale_rewards: str = option("group", "Advantages over each prompt's group std.")
    epsilon: float = option(0.2, "PPO clip range.", ge=0)
    temperature: float = option(0.9, "Sampling temperature of the rollouts.", gt=0)
    top_p: float = option(1.0, "Nucleus sampling of the rollouts.", gt=0, le=1)
    top_k: int = option(50, "Top-k sampling of the rollouts.", ge=0)
    save_steps: int = option(100, "A checkpoint every this many steps (every phase, SFT too).", gt=0)
    seed: int = option(42, "Every phase, SFT too.", ge=0)


# --- values: types and ranges -----------------------------------------------------
#: Ranges of ``GRPOConfig`` fields whose bad values TRL reports only deep inside a run, or never.
TRAINING_RANGES: dict[str, Range] = {
    "learning_rate": Range(ge=0),
    "weight_decay": Range(ge=0),
    "max_grad_norm": Range(ge=0),
    "max_steps": Range(ge=-1),
    "num_train_epochs": Range(gt=0),
    "warmup_steps": Range(ge=0),
    "per_device_train_batch_size": Range(ge=1),
    "gradient_accumulation_steps": Range(ge=1),
    "num_generations": Range(ge=2),
    "num_iterations": Range(ge=1),
    "max_completion_length": Range(ge=1),
    "save_steps": Range(gt=0),
    "logging_steps": Range(gt=0),
    "save_total_limit": Range(ge=1),
    "temperature": Range(gt=0),
    "top_p": Range(gt=0, le=1),
    "top_k": Range(ge=0),
    "min_p": Range(ge=0, le=1),
    "beta": Range(ge=0),
    "epsilon": Range(ge=0),
    "epsilon_high": Range(ge=0),
    "seed": Range(ge=0),
}

#: ``GRPOConfig`` fields whose documented values are wider than their type hint.
TRAINING_TYPES: dict[str, Any] = {
    "scale_rewards": Union[str, bool],  # TRL: True means "group", False "none" (GRPOConfig.__post_init__)
}
#: TRL's names for settings that belong to one of this config's sections: a ``training`` key
#: given here is moved into that section's field (model.* reaches every load: the policy,
#: TRL's reference model, evaluation and export; data.chat_template_kwargs every prompt:
#: rollouts, the SFT phase, validation, evaluation).
TRAINING_ALIASES: dict[str, tuple[str, str]] = {
    "trust_remote_code": ("model", "trust_remote_code"),
    "chat_template_kwargs": ("data", "chat_template_kwargs"),
}
#: ``training.model_init_kwargs`` keys that are fields of the model section; the rest go to model.init_kwargs.
MODEL_INIT_FIELDS = {
    "dtype": "dtype",
    "torch_dtype": "dtype",
    "attn_implementation": "attn_implementation",
    "trust_remote_code": "trust_remote_code",
    "revision": "revision",
}


# --- YAML ------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``1e-5`` as a float and refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable key: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first given on line {seen[key] + 1})", key_node.start_mark
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) needs a dot in a float, so 1e-5 would stay the string "1e-5".
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _yaml_error(where: str, err: yaml.YAMLError) -> ConfigError:
    """One line: where, line and column, and the problem (no traceback)."""
    mark = getattr(err, "problem_mark", None)
    pos = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    if "could not determine a constructor" in problem:
        problem += " (only plain YAML values are allowed)"
    context = getattr(err, "context", None)
    return ConfigError(f"{where}{pos}: invalid YAML: {problem}" + (f" ({context})" if context else ""))


#: The most values a config may hold, or expand to through YAML aliases (a shipped config has a few hundred).
MAX_YAML_VALUES = 100_000
#: The largest config file read (a shipped one is a few KB): PyYAML reads about 1 MB of plain values
#: in 12 s and holds them in 330 MB.
MAX_CONFIG_BYTES = 1 << 20


def _expanded_size(value: Any, sizes: dict[int, int], inside: set[int], where: str) -> int:
    """How many values ``value`` holds once its aliases are written out (each shared list or
    mapping counted once per use, measured once); a value that holds itself is an error."""
    if not isinstance(value, (dict, list)):
        return 1
    key = id(value)
    if key in inside:
        raise ConfigError(
            f"{where}: a YAML alias (*name) refers to a value that holds it: a config cannot hold itself"
        )
    if key not in sizes:
        inside.add(key)
        sizes[key] = 1 + sum(
            _expanded_size(v, sizes, inside, where) for v in (value.values() if isinstance(value, dict) else value)
        )
        inside.discard(key)
    return sizes[key]


def read_config_text(path: Path) -> str:
    """A config file's text, read only up to :data:`MAX_CONFIG_BYTES` (a larger one is an error)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path}: {os.stat(path).st_size / 1e6:.1f} MB, more than a config holds (at most "
                f"{MAX_CONFIG_BYTES / 1e6:.1f} MB is read; a config is a few KB)"
            )
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config ({err})") from None


def _node_count(text: str, where: str) -> None:
    """Refuse YAML holding more than :data:`MAX_YAML_VALUES` values, counted as the parser reads them,
    so that a huge one stops early (before it is built, which takes seconds and memory per MB)."""
    count = 0
    for event in yaml.parse(text, Loader=_Loader):
        count += isinstance(event, (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if count > MAX_YAML_VALUES:
            raise ConfigError(f"{where}: holds more than {MAX_YAML_VALUES:,} values: a config holds a few hundred")


def parse_yaml(text: str, where: str) -> Any:
    """Safe YAML with floats in scientific notation and no duplicate keys, that holds at most
    :data:`MAX_CONFIG_BYTES` and :data:`MAX_YAML_VALUES` values, and whose aliases neither loop nor
    expand past that many (every later step copies it out in full)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: {len(text) / 1e6:.1f} MB of YAML, more than a config holds (a few KB)")
    try:
        _node_count(text, where)
        value = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as err:
        raise _yaml_error(where, err) from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid YAML: nested too deeply") from None
    try:
        size = _expanded_size(value, {}, set(), where)
    except RecursionError:
        raise ConfigError(f"{where}: invalid YAML: nested too deeply") from None
    if size > MAX_YAML_VALUES:
        raise ConfigError(
            f"{where}: the YAML expands to {size:,} values through its aliases (*name), more than "
            f"{MAX_YAML_VALUES:,}: a config holds a few hundred"
        )
    return value


def resolve_config_path(name_or_path: str) -> Path:
    """A bare name such as ``cpr.yaml`` resolves against configs/."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = ", ".join(sorted(x.name for x in CONFIG_DIR.glob("*.yaml")))
    if p.is_dir():
        raise ConfigError(f"config {name_or_path!r} is a folder; give one YAML file in it, or in configs/: {shipped}")
    raise ConfigError(f"config {name_or_path!r} not found (as a path or in configs/: {shipped})")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--a.b value`` / ``--a.b=value`` pairs into a nested dict; values parsed as YAML. A key
    given twice (also inside a section's value: ``--training '{max_steps: 3}' --training.max_steps
    4``) is an error, as it is in a YAML file: the last would win without a word."""
    out: dict[str, Any] = {}
    given: dict[tuple, str] = {}  # each key path set so far -> the override that set it
    it = iter(args)
    for arg in it:
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            try:
                raw = next(it)
            except StopIteration:
                raise ConfigError(f"override --{key} needs a value") from None
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key}: {part!r} is set to a value above, not a section")
        unnamed = name_problem(f"override --{key}", raw)  # (YAML calls its lone surrogates unacceptable characters)
        if unnamed:
            raise ConfigError(unnamed)
        value = parse_yaml(raw, f"override --{key}")
        path = tuple(key.split("."))
        for sub in [path + p for p, _ in _leaves(value)] if isinstance(value, dict) and value else [path]:
            twice = next((p for p in given if p[: len(sub)] == sub or sub[: len(p)] == p), None)
            if twice is not None:
                what = ".".join(min(twice, sub, key=len))
                raise ConfigError(
                    f"override --{what} is given twice on the command line ({given[twice]}, then "
                    f"--{key} {raw}); give it once"
                )
            given[sub] = f"--{key} {raw}"
        before = node.get(leaf)  # a section given in parts is merged, never replaced
        node[leaf] = deep_merge(before, value) if isinstance(value, dict) and isinstance(before, dict) else value
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(name_or_path: str, overrides: list[str] | None = None) -> tuple[RunConfig, dict]:
    """Read, merge overrides, validate. Returns the config and the merged raw mapping."""
    path = resolve_config_path(user_path(name_or_path))
    raw = parse_yaml(read_config_text(path), str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    cli = parse_overrides(overrides or [])
    raw = expand_config_paths(deep_merge(raw, cli))
    if isinstance(raw.get("phases"), list):
        raw["phases"] = [_cli_wins(p, cli, raw.get("reward")) for p in raw["phases"]]
    cfg = validate(from_dict(RunConfig, raw))
    return cfg, raw


def _leaves(d: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    return [
        leaf
        for k, v in d.items()
        for leaf in (_leaves(v, (*prefix, k)) if isinstance(v, dict) and v else [((*prefix, k), v)])
    ]


def _cli_wins(phase: Any, cli: dict, base_reward: Any) -> Any:
    """A phase's overrides with the command line's values where the phase sets the same key
    (the command line wins over the file, phases included), and the command line's
    ``reward.params`` in a phase that switches to another reward, where that reward has them."""
    over = phase.get("overrides") if isinstance(phase, dict) else None
    if not isinstance(over, dict):
        return phase
    have = {path for path, _ in _leaves(over)}
    reward = over.get("reward") if isinstance(over.get("reward"), dict) else {}
    base_name = base_reward.get("name", "cpr") if isinstance(base_reward, dict) else "cpr"
    switched = reward.get("name", base_name) != base_name
    fields = _reward_fields(reward.get("name")) if switched else set()
    set_ = {}
    for path, value in _leaves({k: v for k, v in cli.items() if k != "phases"}):
        if path in have or (path[:2] == ("reward", "params") and len(path) == 3 and path[2] in fields):
            node = set_
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
    return {**phase, "overrides": deep_merge(over, set_)} if set_ else phase


def _reward_fields(name: Any) -> set[str]:
    try:
        cls = reward_class(name) if isinstance(name, str) else None
    except ConfigError:
        cls = None  # reported where the phase's reward is checked
    return {f.name for f in dataclasses.fields(cls.config_class)} if cls else set()


def _check_training(training: dict[str, Any], where: str, kind: TrainerKind) -> None:
    """Every ``training`` key is a field of the phase's TRL config and its value fits that field's type."""
    types_, name = training_field_types(kind), "trl.GRPOConfig" if kind == "grpo" else "trl.SFTConfig"
    for key, value in list(training.items()):
        tp = types_.get(key) or newer_field_type(kind, key)
        if tp is None:
            near = difflib.get_close_matches(key, sorted(types_), n=3)
            raise ConfigError(
                f"{where}training: unknown key {key!r}; it must be a field of {name}"
                + (f" (close: {', '.join(near)})" if near else "")
            )
        tp = TRAINING_TYPES.get(key, tp)
        training[key] = check_value(f"{where}training.{key}", value, tp, TRAINING_RANGES.get(key))
    if training.get("max_steps") == 0:  # transformers would train one step
        raise ConfigError(
            f"{where}training.max_steps: invalid value 0; expected -1 (train num_train_epochs) or an integer >= 1"
        )


def _check_reward_params(reward: RewardSection, where: str) -> None:
    """The reward exists (its code imports) and ``reward.config`` is its typed config, made
    from ``params``; ``reward.components`` become the composed reward's (and, for the run's
    record, its ``params``)."""
    from crystal_grpo.rewards.user import ComponentSpec, component_function

    specs = [
        from_dict(ComponentSpec, comp, f"{where}reward.components[{i}]") for i, comp in enumerate(reward.components)
    ]
    if specs:
        if reward.name not in ("cpr", "composed"):  # cpr: the default, i.e. no name given
            raise ConfigError(f"{where}reward: both name {reward.name!r} and components; give one of them")
        for spec in specs:
            component_function(spec.fn)
        reward.name, reward.params["components"] = "composed", reward.components
    try:
        cls = reward_class(reward.name)
    except ConfigError as err:
        raise ConfigError(f"{where}{err}") from None
    params = {k: v for k, v in reward.params.items() if not (specs and k == "components")}
    reward.config = cls.make_config(params, where=f"{where}reward.params")
    if specs:
        reward.config.components = specs


def validate(cfg: RunConfig) -> RunConfig:
    """Checks beyond the sections' own types, for every phase: reward parameters,
    ``training`` against GRPOConfig, required fields and combinations that cannot work. Returns
    the normalised copy the run uses (typed reward and phase configs, aliases moved); ``cfg`` is
    left as it was."""
    cfg = copy.deepcopy(cfg)
    resume = cfg.training.pop("resume_from_checkpoint", None)
    cfg.resume_from_checkpoint = check_value("training.resume_from_checkpoint", resume, Union[str, None])
    _move_aliases(cfg, "")  # before a phase of another trainer kind takes only its part of training
    names = [p.name for p in cfg.phases]
    for i, name in enumerate(names):  # a name is a folder's (phase<i>-<name>) and the run summary's key
        if name in (".", "..") or any(c in name for c in "/\\\0"):
            raise ConfigError(
                f"phases[{i}].name: {name!r}: a phase's name is part of its folder's name (phase<i>-<name>), so it "
                "may not be . or .. or hold / or \\ or NUL; rename it"
            )
        if name in names[:i]:
            raise ConfigError(
                f"phases[{i}].name: {name!r} names two phases: the run's summary keeps each phase's result by its "
                "name, so one would be lost; give each phase a name of its own"
            )
    for phase in cfg.phases or [None]:
        if phase is None:
            c = check_dict_sections(cfg)
        else:
            if "resume_from_checkpoint" in (phase.overrides.get("training") or {}):
                raise ConfigError(
                    f"phases[{phase.name}].overrides.training.resume_from_checkpoint: a run resumes "
                    "as a whole (into the phase it stopped in): set it at the top level, or use "
                    "--resume_from_checkpoint"
                )
            if "output_dir" in (phase.overrides.get("training") or {}):
                raise ConfigError(
                    f"phases[{phase.name}].overrides.training.output_dir: a phase writes into its own folder "
                    "of the run folder (phase<i>-<name>): set the run folder at the top level, or use --output_dir"
                )
            c = phase.config = apply_phase(cfg, phase)
        where = "" if phase is None else f"phases[{phase.name}].overrides."
        refused = (c.trainer == "grpo" and remove_unused_columns_refused(c.training.get("remove_unused_columns"))) or (
            training_refused(
                c.training,
                pcgrad=c.pcgrad,
                beta=c.training.get("beta", PaperRecipe.beta),
                loss_type=c.training.get("loss_type", PaperRecipe.loss_type),
                lora=c.model.lora is not None,
                curriculum=c.curriculum is not None,
                step_credit=c.reward.step_credit.on,
            )
        )
        if refused:
            raise ConfigError(f"{where}{refused[0]}: {refused[1]}")
        if c.training.get("eval_strategy", "no") != "no" and not c.data.validation and not c.data.validation_fraction:
            raise ConfigError(
                f"{where}training.eval_strategy: {c.training['eval_strategy']!r} evaluates on the "
                "validation split: set data.validation (or data.validation_fraction > 0)"
            )
        if not c.model.name_or_path:
            raise ConfigError(f"{where}model.name_or_path: required (an HF folder, hub id or GGUF folder)")
        low, high = c.model.vision.min_pixels, c.model.vision.max_pixels
        if low is not None and high is not None and low > high:
            raise ConfigError(f"{where}model.vision.min_pixels: {low} is above model.vision.max_pixels: {high}")
        if not c.data.train:
            raise ConfigError(f"{where}data.train: required (a JSONL file or a datasets folder)")
        if c.trainer == "sft":
            for key, value in (
                ("curriculum", c.curriculum),
                ("pcgrad", c.pcgrad),
                ("dynamic_sampling.mode", c.dynamic_sampling.mode != "none"),
            ):
                if value:
                    raise ConfigError(
                        f"{where}{key}: set for an SFT phase; the curriculum, PCGrad and dynamic sampling are GRPO's"
                    )
        check_value(f"{where}validation.metric", c.validation.metric, Literal[metric_names("reward")])  # after the
        # reward's module loaded: a row it registers is a validation metric too
        refused = c.pcgrad and liger_refused(c.training.get("use_liger_kernel"))
        if refused:
            raise ConfigError(f"{where}{refused[0]}: {refused[1]}")
        problem = c.trainer == "grpo" and c.training.get("use_vllm") and vllm_problem()
        if problem:
            raise ConfigError(f"{where}training.use_vllm: true, but {problem}")
        weights = c.training.get("reward_weights") or []
        if any(w < 0 for w in weights) and not c.reward.config.negative_weights:
            raise ConfigError(
                f"{where}training.reward_weights: invalid value {weights!r}; a reward weight must be >= 0 "
                "(set reward.params.negative_weights: true if the penalty is meant)"
            )
        untagged = [i for i, spec in enumerate(getattr(c.reward.config, "components", [])) if not spec.objective]
        if c.pcgrad and untagged:
            raise ConfigError(
                f"{where}reward.components[{untagged[0]}].objective: required with pcgrad: true "
                "(accuracy or reasoning: PCGrad splits the reward on it)"
            )
        aggregation = c.training.get("multi_objective_aggregation", "sum_then_normalize")
        scale = {True: "group", False: "none"}.get(c.training.get("scale_rewards"), c.training.get("scale_rewards"))
        outcome = reward_class(c.reward.name).outcome_name(c.reward.config)
        refused = c.trainer == "grpo" and dynamic_sampling_refused(
            c.dynamic_sampling,
            pcgrad=c.pcgrad,
            scale_rewards=scale,
            aggregation=aggregation,
            outcome=outcome,
            step_credit=c.reward.step_credit.on,
        )
        if refused:
            raise ConfigError(f"{where}{refused[0]}: {refused[1]}")
        refused = c.pcgrad and aggregation_refused(aggregation)
        if refused:
            raise ConfigError(f"{where}{refused[0]}: {refused[1]}")
    return cfg


def check_dict_sections(cfg: RunConfig, where: str = "") -> RunConfig:
    """Type the free-form parts: reward.params into ``reward.config``, the curriculum mode's own
    keys into ``curriculum.config`` (its Schedule found, by import path too), training (coerced
    in place, TRL's names for other sections' settings moved there: :func:`_move_aliases`)."""
    _check_reward_params(cfg.reward, where)
    if cfg.curriculum is not None:
        resolve_curriculum(cfg.curriculum, where)
    _check_training(cfg.training, where, cfg.trainer)
    _move_aliases(cfg, where)
    return cfg


def _move_aliases(cfg: RunConfig, where: str) -> None:
    """``training`` keys that TRL documents but this config keeps in a section (TRAINING_ALIASES,
    ``model_init_kwargs``) become that section's fields, so that every load and every prompt uses
    them, not only TRL's own. A value that contradicts one the section was given is an error."""
    moves = [
        (key, *TRAINING_ALIASES[key], cfg.training.pop(key)) for key in list(cfg.training) if key in TRAINING_ALIASES
    ]
    init = cfg.training.pop("model_init_kwargs", None) or {}
    if isinstance(init, str):  # TRL accepts a JSON string on its command line
        import json

        try:
            init = json.loads(init)
        except ValueError:
            init = None
        if not isinstance(init, dict):
            raise ConfigError(f"{where}training.model_init_kwargs: invalid value; expected a mapping")
    extra = {}
    for k, v in init.items():
        if k in MODEL_INIT_FIELDS:
            moves.append((f"model_init_kwargs.{k}", "model", MODEL_INIT_FIELDS[k], v))
        else:
            extra[k] = v
    if extra:
        moves.append(("model_init_kwargs", "model", "init_kwargs", {**cfg.model.init_kwargs, **extra}))
    for key, section_name, name, value in moves:
        section = getattr(cfg, section_name)
        ftype = {f.name: f for f in dataclasses.fields(section)}[name]
        value = check_value(
            f"{where}training.{key}",
            value,
            ftype.type if not isinstance(ftype.type, str) else typing.get_type_hints(type(section))[name],
        )
        current, default = getattr(section, name), _default(ftype)
        if current != default and current != value and name != "init_kwargs":
            raise ConfigError(
                f"{where}training.{key}: {value!r} contradicts {section_name}.{name}: {current!r}; "
                f"give it once (as {section_name}.{name})"
            )
        setattr(section, name, value)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def apply_phase(cfg: RunConfig, phase: PhaseSection) -> RunConfig:
    """The config one phase runs with: the base config with the phase's overrides merged."""
    base = to_dict(cfg)
    base.pop("phases")
    over = phase.overrides.get("reward")
    if isinstance(over, dict) and over.get("name", base["reward"]["name"]) != base["reward"]["name"]:
        base["reward"] = {}  # another reward: the base reward's weights do not carry over
    over, curriculum = phase.overrides.get("curriculum"), base["curriculum"]
    if isinstance(over, dict) and curriculum and over.get("mode", curriculum["mode"]) != curriculum["mode"]:
        # another mode: the base mode's own options do not carry over either
        base["curriculum"] = {k: v for k, v in curriculum.items() if k in CURRICULUM_KEYS}
    if phase.trainer != cfg.trainer:  # e.g. an SFT warm start in a GRPO run: GRPO's own settings stay out
        base["training"], phase.left_out = split_training(base["training"])
        if phase.trainer == "sft":
            base["curriculum"], base["pcgrad"], base["dynamic_sampling"] = None, False, {}
    if "trainer" in phase.overrides:
        raise ConfigError(f"phases[{phase.name}].overrides.trainer: set the phase's kind as phases[].trainer")
    merged = deep_merge({**base, "trainer": phase.trainer}, phase.overrides)
    where = f"phases[{phase.name}].overrides"
    return check_dict_sections(from_dict(RunConfig, _drop_none_sections(merged), where), where + ".")


def split_training(training: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What of a run's ``training`` a phase of another trainer kind takes: transformers'
    TrainingArguments fields only (learning rate, steps, saving, precision, ...); the keys
    that are the other trainer's own stay out, even where both trainers have a key of that
    name, because it means another thing there (GRPO's loss_type is not SFT's)."""
    from crystal_grpo.train.config.training_section import table

    kept = {k: v for k, v in training.items() if k in table().TRAINING_ARGUMENTS}
    return kept, sorted(set(training) - set(kept))


def _drop_none_sections(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None or k in ("curriculum", "cpu_backend")}


def phase_configs(cfg: RunConfig) -> list[RunConfig]:
    """The config each phase runs with, as validation made them (one phase: the config itself)."""
    if any(p.config is None for p in cfg.phases):
        raise ValueError("config not validated yet: load it with load_config (or validate)")
    return [p.config for p in cfg.phases] or [cfg]
