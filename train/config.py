"""One YAML file describes a run: model, data, reward, curriculum, validation and TRL's
``GRPOConfig`` fields (under ``training``). Every field is documented here, in one place.

Unknown keys and invalid values stop the run before any model loads, naming the key,
the value and what is allowed. Command-line overrides (``--section.key value``, values
parsed as YAML) win over the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the YAML."""


@dataclass
class LoraSection:
    """LoRA through PEFT; TRL's GRPOTrainer wraps the model itself."""

    r: int = 16  #: LoRA rank.
    alpha: int = 32  #: LoRA scaling numerator (lora_alpha).
    dropout: float = 0.05  #: Dropout on the LoRA branch.
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
    validation_fraction: float = 0.1  #: Held-out share of train when ``validation`` is not given.
    skip_invalid: bool = False  #: Drop (and count) bad rows instead of stopping with their file:line.
    max_errors_shown: int = 20  #: How many bad rows a data error lists.
    system_prompt: Union[str, None] = None  #: Overrides the instruction asking for the JSON output.
    max_train_samples: Union[int, None] = None  #: Use only the first N training rows (smoke runs).


@dataclass
class RewardSection:
    name: Literal["format", "answer_only", "composite", "cpr"] = "cpr"  #: Reward module.
    #: Keyword arguments of the module: weights (e.g. answer_weight, step_weight,
    #: wrong_answer_discount for cpr), scorer settings (encoder, threshold, order_alpha,
    #: matcher, step_metric, device), verbosity guard (verbosity_guard, guard_k,
    #: guard_window, guard_factor) and answer tolerance (rel_tol, abs_tol).
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class CurriculumSection:
    """Step-count curriculum (CPR-Curriculum, SPEC section 8); see curricula/sampler.py."""

    mode: Literal["competence", "sorted", "buckets"] = "competence"
    c0: float = 0.25  #: Initial competence: share of easiest data available at step 0.
    total_steps: Union[int, None] = None  #: Pacing horizon T in optimizer steps (default: max_steps).
    difficulty: Literal["steps", "complexity"] = "steps"  #: Order by reference step count or complexity score.


@dataclass
class ValidationSection:
    eval_steps: int = 0  #: Validate every N optimizer steps (0: only at the end).
    max_samples: Union[int, None] = None  #: Cap on validation rows (None: all).
    max_new_tokens: int = 256  #: Greedy generation length.
    batch_size: int = 8  #: Generation batch size per process.
    metric: Literal["accuracy", "f1", "ordered_f1", "format_rate", "reward"] = "accuracy"  #: Best checkpoint by this.


@dataclass
class StabilitySection:
    max_consecutive_nonfinite: int = 5  #: Save and stop after this many skipped non-finite updates.


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


# --- loading and validation --------------------------------------------------------
def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return getattr(tp, "__name__", str(tp))


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, checking every key and value."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown key {path!r}{hint}; allowed keys: {', '.join(names)}")
        tp = hints[key]
        if not _type_ok(value, tp):
            raise ConfigError(f"{path}: invalid value {value!r}; expected {_describe(tp)}")
        kwargs[key] = _build(tp, value, path)
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
    if tp is float:
        return float(value)
    return value


def resolve_config_path(name_or_path: str) -> Path:
    """A bare name such as ``cpr.yaml`` resolves against configs/."""
    p = Path(name_or_path)
    if p.exists():
        return p
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.exists():
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
        node[leaf] = yaml.safe_load(raw)
    return out


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(name_or_path: str, overrides: list[str] | None = None) -> tuple[RunConfig, dict]:
    """Read, merge overrides, validate. Returns the config and the merged raw mapping."""
    path = resolve_config_path(name_or_path)
    with open(path) as fh:
        raw = yaml.safe_load(fh) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    raw = deep_merge(raw, parse_overrides(overrides or []))
    cfg = from_dict(RunConfig, raw)
    validate(cfg)
    return cfg, raw


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that need more than a type: reward params, GRPOConfig fields."""
    from rewards import REWARDS, reward_params

    for i, phase in enumerate(cfg.phases or [None]):
        c = cfg if phase is None else apply_phase(cfg, phase)
        where = "" if phase is None else f"phases[{i}].overrides."
        unknown = sorted(set(c.reward.params) - reward_params(c.reward.name))
        if unknown:
            raise ConfigError(
                f"{where}reward.params: unknown key(s) {', '.join(map(repr, unknown))} for reward "
                f"{c.reward.name!r}; allowed: {', '.join(sorted(reward_params(c.reward.name)))}")
        assert c.reward.name in REWARDS
        grpo_fields = {f.name for f in dataclasses.fields(grpo_config_class())}
        for key in c.training:
            if key not in grpo_fields:
                near = difflib.get_close_matches(key, sorted(grpo_fields), n=3)
                raise ConfigError(f"{where}training: unknown key {key!r}; it must be a field of trl.GRPOConfig"
                                  + (f" (close: {', '.join(near)})" if near else ""))
        if not c.model.name_or_path:
            raise ConfigError(f"{where}model.name_or_path: required (an HF folder, hub id or GGUF folder)")
        if not c.data.train:
            raise ConfigError(f"{where}data.train: required (a JSONL file or a datasets folder)")
        if not 0.0 <= c.data.validation_fraction < 1.0:
            raise ConfigError(f"{where}data.validation_fraction: invalid value "
                              f"{c.data.validation_fraction!r}; expected 0 <= x < 1")


def apply_phase(cfg: RunConfig, phase: PhaseSection) -> RunConfig:
    """The config one phase runs with: the base config with the phase's overrides merged."""
    base = dataclasses.asdict(cfg)
    base.pop("phases")
    over = phase.overrides.get("reward")
    if isinstance(over, dict) and over.get("name", base["reward"]["name"]) != base["reward"]["name"]:
        base["reward"] = {}  # another reward: the base reward's weights do not carry over
    merged = deep_merge(base, phase.overrides)
    return from_dict(RunConfig, _drop_none_sections(merged), f"phases[{phase.name}].overrides")


def _drop_none_sections(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None or k in ("curriculum", "cpu_backend")}


def grpo_config_class():
    from trl import GRPOConfig

    return GRPOConfig
