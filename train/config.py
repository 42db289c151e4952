"""One YAML file describes a run: model, data, reward, curriculum, validation and TRL's
``GRPOConfig`` fields (under ``training``). Every field is documented here, in one place.

Every key and value is checked before any model loads: unknown keys, values of the wrong
type (for ``training`` against ``GRPOConfig``'s own field types, for ``reward.params``
against the reward module's signature) and values out of range each stop the run with
one line naming the key, the value and what is expected. Command-line overrides
(``--section.key value``, values parsed as YAML) win over the file. YAML is read with
the safe loader, extended so that ``1e-5`` is a number (YAML 1.2, as every user writes
it) and a key given twice in one mapping is an error instead of a silent overwrite.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from crystal_grpo.rewards.base import Metric

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the YAML."""


@dataclass(frozen=True)
class Range:
    """Bounds a number must respect (None: unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, x: float) -> bool:
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))

    def __str__(self) -> str:
        low = f"{self.ge} <= " if self.ge is not None else f"{self.gt} < " if self.gt is not None else ""
        high = f" <= {self.le}" if self.le is not None else f" < {self.lt}" if self.lt is not None else ""
        if low and not high:  # "x >= 0" reads better than "0 <= x"
            return "x " + low.split()[1].replace("<", ">") + " " + low.split()[0]
        return f"{low}x{high}"


def bounded(default: Any, **bounds: float) -> Any:
    """A dataclass field whose numeric value must lie in ``Range(**bounds)``."""
    return field(default=default, metadata={"range": Range(**bounds)})


@dataclass
class LoraSection:
    """LoRA through PEFT; TRL's GRPOTrainer wraps the model itself."""

    r: int = bounded(16, ge=1)  #: LoRA rank.
    alpha: int = bounded(32, gt=0)  #: LoRA scaling numerator (lora_alpha).
    dropout: float = bounded(0.05, ge=0, lt=1)  #: Dropout on the LoRA branch.
    target_modules: Union[list[str], str] = "all-linear"  #: Modules to adapt.


@dataclass
class ModelSection:
    name_or_path: str = ""  #: HF folder, hub id (local cache only offline), or folder holding a GGUF file.
    gguf_file: Union[str, None] = None  #: GGUF file name inside ``name_or_path`` (dequantised on load).
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  #: Weights dtype.
    attn_implementation: Union[str, None] = None  #: e.g. sdpa, eager, flash_attention_2.
    trust_remote_code: bool = False  #: Needed for InternVL3.5; off unless asked for.
    gradient_checkpointing: bool = False  #: Also sets TRL's flag of the same name.
    lora: Union[LoraSection, None] = None  #: Set to train a LoRA adapter instead of all weights.


@dataclass
class DataSection:
    train: str = ""  #: JSONL file (SPEC section 1) or a ``datasets`` folder saved with save_to_disk.
    validation: Union[str, None] = None  #: Same formats; when absent a fraction of train is held out.
    validation_fraction: float = bounded(0.1, ge=0, lt=1)  #: Held-out share of train when ``validation`` is not given.
    skip_invalid: bool = False  #: Drop (and count) bad rows instead of stopping with their file:line.
    max_errors_shown: int = bounded(20, ge=0)  #: How many bad rows a data error lists.
    system_prompt: Union[str, None] = None  #: Overrides the instruction asking for the JSON output.
    max_train_samples: Union[int, None] = bounded(None, ge=1)  #: Use only the first N training rows (smoke runs).


@dataclass
class RewardSection:
    name: str = "cpr"  #: Reward module: a name registered in ``crystal_grpo.rewards.REWARDS``.
    #: Keyword arguments of the module: weights (e.g. answer_weight, step_weight,
    #: wrong_answer_discount for cpr), scorer settings (encoder, threshold, order_alpha,
    #: matcher, step_metric, device), verbosity guard (verbosity_guard, guard_k,
    #: guard_window, guard_factor, guard_min_history) and answer tolerance (rel_tol, abs_tol).
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class CurriculumSection:
    """Step-count curriculum (CPR-Curriculum, SPEC section 8); see curricula/sampler.py."""

    mode: Literal["competence", "sorted", "buckets"] = "competence"
    c0: float = bounded(0.25, gt=0, le=1)  #: Initial competence: share of easiest data available at step 0.
    total_steps: Union[int, None] = bounded(None, ge=1)  #: Pacing horizon T in optimizer steps (default: max_steps).
    difficulty: Literal["steps", "complexity"] = "steps"  #: Order by reference step count or complexity score.


@dataclass
class ValidationSection:
    eval_steps: int = bounded(0, ge=0)  #: Validate every N optimizer steps (0: only at the end).
    max_samples: Union[int, None] = bounded(None, ge=1)  #: Cap on validation rows (None: all).
    max_new_tokens: int = bounded(256, ge=1)  #: Greedy generation length.
    batch_size: int = bounded(8, ge=1)  #: Generation batch size per process.
    metric: Metric = "accuracy"  #: Best checkpoint by this (any of rewards.base.METRICS).


@dataclass
class StabilitySection:
    max_consecutive_nonfinite: int = bounded(5, ge=1)  #: Save and stop after this many skipped non-finite updates.


@dataclass
class PhaseSection:
    """One phase of a multi-phase schedule: any top-level section overridden."""

    name: str = ""
    init_from: Literal["best", "last", "none"] = "best"  #: Which checkpoint of the previous phase to start from.
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    curriculum: Union[CurriculumSection, None] = None  #: None: TRL's random order.
    pcgrad: bool = False  #: Project conflicting accuracy/reasoning gradients (SPEC section 9).
    pcgrad_objective_std: bool = False  #: Scale each objective's advantage by its own group std.
    validation: ValidationSection = field(default_factory=ValidationSection)
    stability: StabilitySection = field(default_factory=StabilitySection)
    #: Any field of ``trl.GRPOConfig`` (which extends ``transformers.TrainingArguments``).
    training: dict[str, Any] = field(default_factory=dict)
    phases: list[PhaseSection] = field(default_factory=list)  #: Empty: one phase.
    #: Multi-process on CPU for tests and CI: ``gloo`` runs DDP/ZeRO-3 without a GPU.
    cpu_backend: Union[Literal["gloo"], None] = None


# --- values: types and ranges -----------------------------------------------------
#: Ranges of ``GRPOConfig`` fields whose bad values TRL reports only deep inside a run, or never.
TRAINING_RANGES: dict[str, Range] = {
    "learning_rate": Range(ge=0), "weight_decay": Range(ge=0), "max_grad_norm": Range(ge=0),
    "max_steps": Range(ge=-1), "num_train_epochs": Range(gt=0), "warmup_steps": Range(ge=0),
    "per_device_train_batch_size": Range(ge=1), "gradient_accumulation_steps": Range(ge=1),
    "num_generations": Range(ge=2), "num_iterations": Range(ge=1), "max_completion_length": Range(ge=1),
    "save_steps": Range(gt=0), "logging_steps": Range(gt=0), "save_total_limit": Range(ge=1),
    "temperature": Range(gt=0), "top_p": Range(gt=0, le=1), "top_k": Range(ge=0), "min_p": Range(ge=0, le=1),
    "beta": Range(ge=0), "epsilon": Range(ge=0), "epsilon_high": Range(ge=0), "seed": Range(ge=0),
}
#: Ranges of reward parameters (the names are shared by every reward module).
REWARD_PARAM_RANGES: dict[str, Range] = {
    "threshold": Range(ge=-1, le=1), "order_alpha": Range(ge=0, le=1), "scorer_batch_size": Range(ge=1),
    "cache_size": Range(ge=0), "guard_k": Range(gt=0), "guard_window": Range(ge=1),
    "guard_factor": Range(ge=0, le=1), "guard_min_history": Range(ge=1), "rel_tol": Range(ge=0),
    "abs_tol": Range(ge=0), "delta": Range(gt=0),
}


def _type_ok(value: Any, tp: Any) -> bool:
    """Does a YAML value fit a type hint? Floats must be finite; an int field takes 1e3."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    if isinstance(value, bool):  # bool is an int subclass; YAML true/false only fits bool
        return tp is bool
    if tp is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or value in {m.value for m in tp}
    if origin is not None:  # collections.abc.Callable[...] and other generics
        return isinstance(origin, type) and isinstance(value, origin)
    return isinstance(tp, type) and isinstance(value, tp)


def _coerce(value: Any, tp: Any) -> Any:
    """int -> float for float fields, 1e3 -> 1000 for int fields; everything else as is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    kinds = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    if isinstance(value, float):
        return int(value) if int in kinds and float not in kinds and value.is_integer() else value
    return float(value) if float in kinds and int not in kinds else value


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if tp is float:
        return "float (a finite number)"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def check_value(path: str, value: Any, tp: Any, bounds: Range | None = None) -> Any:
    """The value, coerced to the hinted type, or a ConfigError naming key, value and type."""
    if not _type_ok(value, tp):
        raise ConfigError(f"{path}: invalid value {value!r}; expected {_describe(tp)}")
    coerced = _coerce(value, tp)
    if bounds is not None and isinstance(coerced, (int, float)) and not isinstance(coerced, bool) \
            and not bounds.holds(coerced):
        raise ConfigError(f"{path}: invalid value {value!r}; expected {bounds}")
    return coerced


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, checking every key and value."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown key {path!r}{hint}; allowed keys: {', '.join(fields)}")
        value = check_value(path, value, hints[key], fields[key].metadata.get("range"))
        kwargs[key] = _build(hints[key], value, path)
    return cls(**kwargs)


def _build(tp: Any, value: Any, path: str):
    if value is None:
        return None
    candidates = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    for t in candidates:
        if dataclasses.is_dataclass(t) and isinstance(value, dict):
            return from_dict(t, value, path)
        if typing.get_origin(t) is list and dataclasses.is_dataclass(typing.get_args(t)[0]):
            return [from_dict(typing.get_args(t)[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


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
                        None, None, f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) needs a dot in a float, so 1e-5 would stay the string "1e-5".
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _yaml_error(where: str, err: yaml.YAMLError) -> ConfigError:
    """One line: where, line and column, and the problem (no traceback)."""
    mark = getattr(err, "problem_mark", None)
    pos = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    if "could not determine a constructor" in problem:
        problem += " (only plain YAML values are allowed)"
    context = getattr(err, "context", None)
    return ConfigError(f"{where}{pos}: invalid YAML: {problem}" + (f" ({context})" if context else ""))


def parse_yaml(text: str, where: str) -> Any:
    """Safe YAML with floats in scientific notation and no duplicate keys."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as err:
        raise _yaml_error(where, err) from None


def resolve_config_path(name_or_path: str) -> Path:
    """A bare name such as ``cpr.yaml`` resolves against configs/."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = ", ".join(sorted(x.name for x in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config {name_or_path!r} not found (as a path or in configs/: {shipped})")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--a.b value`` / ``--a.b=value`` pairs into a nested dict; values parsed as YAML."""
    out: dict[str, Any] = {}
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
        node[leaf] = parse_yaml(raw, f"override --{key}")
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(name_or_path: str, overrides: list[str] | None = None) -> tuple[RunConfig, dict]:
    """Read, merge overrides, validate. Returns the config and the merged raw mapping."""
    path = resolve_config_path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config ({err})") from None
    raw = parse_yaml(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    raw = deep_merge(raw, parse_overrides(overrides or []))
    cfg = from_dict(RunConfig, raw)
    validate(cfg)
    return cfg, raw


@functools.lru_cache(maxsize=1)
def grpo_field_types() -> dict[str, Any]:
    """``trl.GRPOConfig``'s fields and their type hints (the ``training`` section's schema)."""
    from trl import GRPOConfig

    return typing.get_type_hints(GRPOConfig)


def _check_training(training: dict[str, Any], where: str) -> None:
    """Every ``training`` key is a GRPOConfig field and its value fits that field's type."""
    types_ = grpo_field_types()
    for key, value in list(training.items()):
        if key not in types_:
            near = difflib.get_close_matches(key, sorted(types_), n=3)
            raise ConfigError(f"{where}training: unknown key {key!r}; it must be a field of trl.GRPOConfig"
                              + (f" (close: {', '.join(near)})" if near else ""))
        training[key] = check_value(f"{where}training.{key}", value, types_[key], TRAINING_RANGES.get(key))


def _check_reward_params(reward: RewardSection, where: str) -> None:
    """Every parameter is one the reward module takes, of the type its signature says."""
    from crystal_grpo.rewards import REWARDS, reward_params

    if reward.name not in REWARDS:
        raise ConfigError(f"{where}reward.name: invalid value {reward.name!r}; expected one of "
                          + ", ".join(map(repr, REWARDS)))
    accepted = reward_params(reward.name)
    unknown = sorted(set(reward.params) - set(accepted))
    if unknown:
        raise ConfigError(
            f"{where}reward.params: unknown key(s) {', '.join(map(repr, unknown))} for reward "
            f"{reward.name!r}; allowed: {', '.join(sorted(accepted))}")
    for key, value in list(reward.params.items()):
        reward.params[key] = check_value(f"{where}reward.params.{key}", value, accepted[key],
                                         REWARD_PARAM_RANGES.get(key))


def validate(cfg: RunConfig) -> None:
    """Checks beyond the sections' own types, for every phase: reward parameters,
    ``training`` against GRPOConfig, required fields and combinations that cannot work."""
    for phase in cfg.phases or [None]:
        c = check_dict_sections(cfg) if phase is None else apply_phase(cfg, phase)
        where = "" if phase is None else f"phases[{phase.name}].overrides."
        if not c.model.name_or_path:
            raise ConfigError(f"{where}model.name_or_path: required (an HF folder, hub id or GGUF folder)")
        if not c.data.train:
            raise ConfigError(f"{where}data.train: required (a JSONL file or a datasets folder)")
        if c.pcgrad and c.training.get("use_liger_kernel"):
            from crystal_grpo.train.pcgrad import LIGER_REFUSED

            raise ConfigError(f"{where}training.use_liger_kernel: {LIGER_REFUSED}")
        aggregation = c.training.get("multi_objective_aggregation", "sum_then_normalize")
        if c.pcgrad and aggregation != "sum_then_normalize":
            raise ConfigError(
                f"{where}training.multi_objective_aggregation: {aggregation!r} cannot be combined with pcgrad: "
                "true (the objective advantages are the parts of TRL's summed advantage, sum_then_normalize)")


def check_dict_sections(cfg: RunConfig, where: str = "") -> RunConfig:
    """Type-check (and coerce in place) the two free-form sections: reward.params, training."""
    _check_reward_params(cfg.reward, where)
    _check_training(cfg.training, where)
    return cfg


def apply_phase(cfg: RunConfig, phase: PhaseSection) -> RunConfig:
    """The config one phase runs with: the base config with the phase's overrides merged."""
    base = dataclasses.asdict(cfg)
    base.pop("phases")
    over = phase.overrides.get("reward")
    if isinstance(over, dict) and over.get("name", base["reward"]["name"]) != base["reward"]["name"]:
        base["reward"] = {}  # another reward: the base reward's weights do not carry over
    merged = deep_merge(base, phase.overrides)
    where = f"phases[{phase.name}].overrides"
    return check_dict_sections(from_dict(RunConfig, _drop_none_sections(merged), where), where + ".")


def _drop_none_sections(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None or k in ("curriculum", "cpu_backend")}
