"""The ``training`` section's schema: ``trl.GRPOConfig``'s and ``trl.SFTConfig``'s fields and types,
written out per locked set (train/config/trl_fields_table.py, ..._vllm.py; ``make lock`` renews them) so
that a config validates without importing TRL (about 4 s on 2 cores). Other installed versions: one
warning, ``requirements.lock``'s table, and a key it lacks looked up in the installed classes. Enums are
``str`` enums of the same members, a dataclass field is a mapping; tests/test_trl_contract.py compares
each table with its lock and the installed classes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.metadata
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

Kind = Literal["grpo", "sft"]
logger = logging.getLogger(__name__)


def installed_versions() -> dict[str, str]:
    """The versions the schema depends on, read without importing the packages."""
    return {name: importlib.metadata.version(name) for name in ("trl", "transformers")}


#: GRPOConfig defaults the checks and the capacity plan read when the config leaves them out (TRL 1.16;
#: tests/test_capacity.py checks them against GRPOConfig and SFTConfig).
TRL_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 512,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": None,
    "generation_batch_size": None,
    "ds3_gather_for_generation": True,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_gpu_memory_utilization": 0.3,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
}


#: The generated tables (modules of this package), each for a lock's TRL and transformers; the first
#: answers when no table is for the installed versions.
TABLES = {"trl_fields_table": "requirements.lock", "trl_fields_table_vllm": "requirements-vllm.lock"}


def table() -> types.ModuleType:
    """The table for the installed TRL and transformers, else requirements.lock's."""
    import importlib

    modules = [importlib.import_module(f"crystal_grpo.train.config.{name}") for name in TABLES]
    return next((m for m in modules if m.VERSIONS == installed_versions()), modules[0])


def table_is_current() -> bool:
    """A table was generated for the installed TRL and transformers."""
    return table().VERSIONS == installed_versions()


@functools.lru_cache(maxsize=1)
def _say_table_is_stale() -> None:
    logger.warning(
        "TRL's field table (train/config/trl_fields_table.py) is for %s, installed: %s; training keys are checked "
        "against it and again by TRL when the run starts (make lock renews it)",
        _versions(table().VERSIONS),
        _versions(installed_versions()),
    )


def _versions(versions: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def training_field_types(kind: Kind = "grpo") -> dict[str, Any]:
    """Field name -> type of ``trl.GRPOConfig`` (``grpo``) or ``trl.SFTConfig`` (``sft``), from the table."""
    if not table_is_current():
        _say_table_is_stale()
    return table().GRPO if kind == "grpo" else table().SFT


def newer_field_type(kind: Kind, name: str) -> Any | None:
    """The type of a field the table lacks, where the installed TRL is not the table's (a field
    added since); None when the table is current or the installed classes lack it too."""
    return None if table_is_current() else live_field_types(kind).get(name)


@functools.lru_cache(maxsize=2)
def live_field_types(kind: Kind) -> dict[str, Any]:
    """The schema read from the installed classes (imports TRL: seconds)."""
    from trl import GRPOConfig, SFTConfig

    hints = typing.get_type_hints(GRPOConfig if kind == "grpo" else SFTConfig)
    return {name: normalize(tp) for name, tp in hints.items()}


def normalize(tp: Any) -> Any:
    """A type hint with dataclasses as mappings (see the module docstring)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return Union[tuple(normalize(a) for a in args)]
    if dataclasses.is_dataclass(tp):
        return dict
    if origin in (list, dict) and args:
        return origin[tuple(normalize(a) for a in args)] if origin is dict else list[normalize(args[0])]
    return tp


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


def shape(tp: Any) -> Any:
    """A comparable form of a type hint: an enum is its name and members, wherever it is defined."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_enum(tp):
        return ("enum", tp.__name__, tuple((m.name, m.value) for m in tp))
    if origin in (Union, types.UnionType):
        return ("union", frozenset(shape(a) for a in args))
    if origin is not None:
        return (origin, tuple(shape(a) for a in args))
    return tp


def _enums(tp: Any) -> list[type[enum.Enum]]:
    if _is_enum(tp):
        return [tp]
    return [e for a in typing.get_args(tp) for e in _enums(a)]


def source(tp: Any) -> str:
    """Python source for a normalized type hint (an enum by its name: :func:`render` defines it)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if origin in (Union, types.UnionType):
        return f"Union[{', '.join(source(a) for a in args)}]"
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(source(a) for a in args)}]"
    if _is_enum(tp) or (isinstance(tp, type) and tp.__module__ == "builtins"):
        return tp.__name__
    raise TypeError(f"no source for {tp!r}: extend training_section.source")


def render() -> str:
    """The text of a table (train/config/trl_fields_table.py) for the installed TRL and transformers."""
    tables = {name: live_field_types(kind) for name, kind in (("GRPO", "grpo"), ("SFT", "sft"))}
    enums = list(dict.fromkeys(e for table in tables.values() for tp in table.values() for e in _enums(tp)))
    lines = [
        '"""Generated by ``python -m crystal_grpo.train.config.training_section``: do not edit."""',
        "",
        "import enum",
        "from typing import Any, Literal, Union",
        "",
        f"VERSIONS = {installed_versions()!r}",
        "",
    ]
    for e in enums:
        if not issubclass(e, str):
            raise TypeError(f"{e!r} is not a str enum: extend training_section.render")
        lines += [
            "",
            f"class {e.__name__}(str, enum.Enum):",
            f'    """Stand-in for {e.__module__}.{e.__qualname__}."""',
            "",
            *(f"    {m.name} = {m.value!r}" for m in e),
            "",
        ]
    code = {name: {field: source(tp) for field, tp in table.items()} for name, table in tables.items()}
    shared = {f: src for f, src in code["GRPO"].items() if code["SFT"].get(f) == src}  # TrainingArguments' mostly
    lines += [
        "",
        "#: The fields both configs have, with the same type.",
        "SHARED: dict = {",
        *(f"    {field!r}: {src}," for field, src in shared.items()),
        "}",
    ]
    for name, fields in code.items():
        lines += [
            "",
            f"{name}: dict = {{",
            "    **SHARED,",
            *(f"    {field!r}: {src}," for field, src in fields.items() if field not in shared),
            "}",
        ]
    lines += [
        "",
        "#: transformers.TrainingArguments' own fields: what every kind of phase understands alike.",
        "TRAINING_ARGUMENTS = frozenset({",
        *(f"    {name!r}," for name in training_arguments()),
        "})",
    ]
    return "\n".join(lines) + "\n"


def training_arguments() -> list[str]:
    """The field names of ``transformers.TrainingArguments`` (imports transformers)."""
    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments)]


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else next(iter(TABLES))
    if name not in TABLES:
        sys.exit(f"usage: python -m crystal_grpo.train.config.training_section [{'|'.join(TABLES)}]")
    out = Path(__file__).with_name(f"{name}.py")
    out.write_text(render(), encoding="utf-8")
    print(f"wrote {out} for {installed_versions()}", file=sys.stderr)
