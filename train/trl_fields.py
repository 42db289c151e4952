"""The ``training`` section's schema: ``trl.GRPOConfig``'s and ``trl.SFTConfig``'s fields and
types, written out for the installed TRL and transformers so that a config validates without
importing them (``import trl`` alone takes about 4 s on 2 cores; ``train/grpo.py --check``
answers in well under a second with this table).

The table lives in ``train/trl_schema.py``, generated for the locked TRL and transformers
(``requirements.lock``) by ``make lock`` (``python -m crystal_grpo.train.trl_fields``), and
:func:`training_field_types` always answers from it. With other versions installed (a user's
upgrade, ``make test-latest``) it still does, after one warning: reading a config must stay
fast and free of heavy imports whatever is installed, TRL's own config classes check the
values again when a run builds them, and a key the table does not know is looked up in the
installed classes (:func:`newer_field_type`) instead of refused. tests/test_trl_contract.py
compares the table with the installed classes under the locked versions.

Types are the classes' own, with two stand-ins so that nothing heavy is imported: each enum
(``SchedulerType``, ``OptimizerNames``, ...) is a ``str`` enum of the same name and members,
defined in the table, and a dataclass field (accelerate's ``ParallelismConfig``) is a
mapping, which is what a YAML file can give it. A value is checked as before
(``crystal_grpo/typed.py``), and the messages name the same types.
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


def table_is_current() -> bool:
    """The table was generated for the installed TRL and transformers."""
    from crystal_grpo.train import trl_schema

    return trl_schema.VERSIONS == installed_versions()


@functools.lru_cache(maxsize=1)
def _say_table_is_stale() -> None:
    from crystal_grpo.train import trl_schema

    logger.warning("TRL's field table (train/trl_schema.py) is for %s, installed: %s; training keys are checked "
                   "against it and again by TRL when the run starts (make lock renews it)",
                   _versions(trl_schema.VERSIONS), _versions(installed_versions()))


def _versions(versions: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items())


def training_field_types(kind: Kind = "grpo") -> dict[str, Any]:
    """Field name -> type of ``trl.GRPOConfig`` (``grpo``) or ``trl.SFTConfig`` (``sft``), from the table."""
    from crystal_grpo.train import trl_schema

    if not table_is_current():
        _say_table_is_stale()
    return trl_schema.GRPO if kind == "grpo" else trl_schema.SFT


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
    raise TypeError(f"no source for {tp!r}: extend trl_fields.source")


def render() -> str:
    """The text of train/trl_schema.py for the installed TRL and transformers."""
    tables = {name: live_field_types(kind) for name, kind in (("GRPO", "grpo"), ("SFT", "sft"))}
    enums = list(dict.fromkeys(e for table in tables.values() for tp in table.values() for e in _enums(tp)))
    lines = ['"""Generated by ``python -m crystal_grpo.train.trl_fields``: do not edit (train/trl_fields.py)."""',
             "", "import enum", "from typing import Any, Literal, Union  # noqa: F401", "",
             f"VERSIONS = {installed_versions()!r}", ""]
    for e in enums:
        if not issubclass(e, str):
            raise TypeError(f"{e!r} is not a str enum: extend trl_fields.render")
        lines += ["", f"class {e.__name__}(str, enum.Enum):", f'    """Stand-in for {e.__module__}.{e.__qualname__}."""',
                  "", *(f"    {m.name} = {m.value!r}" for m in e), ""]
    code = {name: {field: source(tp) for field, tp in table.items()} for name, table in tables.items()}
    shared = {f: src for f, src in code["GRPO"].items() if code["SFT"].get(f) == src}  # TrainingArguments' mostly
    lines += ["", "#: The fields both configs have, with the same type.", "SHARED: dict = {",
              *(f"    {field!r}: {src}," for field, src in shared.items()), "}"]
    for name, fields in code.items():
        lines += ["", f"{name}: dict = {{", "    **SHARED,",
                  *(f"    {field!r}: {src}," for field, src in fields.items() if field not in shared), "}"]
    lines += ["", "#: transformers.TrainingArguments' own fields: what every kind of phase understands alike.",
              "TRAINING_ARGUMENTS = frozenset({", *(f"    {name!r}," for name in training_arguments()), "})"]
    return "\n".join(lines) + "\n"


def training_arguments() -> list[str]:
    """The field names of ``transformers.TrainingArguments`` (imports transformers)."""
    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments)]


if __name__ == "__main__":
    out = Path(__file__).with_name("trl_schema.py")
    out.write_text(render(), encoding="utf-8")
    print(f"wrote {out} for {installed_versions()}", file=sys.stderr)
