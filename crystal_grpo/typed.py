"""Typed config dataclasses: checking a mapping (YAML, the command line, keyword arguments)
against a dataclass's type hints and documented ranges, with one-line errors.

Every component declares its settings as a dataclass beside its code, each field made with
:func:`option` (default, help text, range), like TRL's ``GRPOConfig`` fields carry their
help; :func:`from_dict` builds one from a mapping, checking every key and value, and is the
one validation the run config and ``build_reward(**params)`` both use. A field with
``init=False`` (:func:`derived`) is what validation makes of the others (e.g. a reward's typed
config): no file sets it, and :func:`to_dict` leaves it out. A ``rest`` field (``option(...,
rest=True)``, a dict) takes the keys a section does not declare itself, unchecked, for the code
that knows their types to check them later (e.g. a curriculum mode's own options, typed against
the mode's class once the mode is known); :func:`to_dict` writes them back beside the others.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from crystal_grpo.errors import CrystalError


class ConfigError(CrystalError, ValueError):
    """A config problem, phrased for the person who wrote the YAML."""


@dataclass(frozen=True)
class Range:
    """Bounds a number must respect (None: unbounded on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, x: float) -> bool:
        return (
            (self.ge is None or x >= self.ge)
            and (self.gt is None or x > self.gt)
            and (self.le is None or x <= self.le)
            and (self.lt is None or x < self.lt)
        )

    def __str__(self) -> str:
        low = f"{self.ge} <= " if self.ge is not None else f"{self.gt} < " if self.gt is not None else ""
        high = f" <= {self.le}" if self.le is not None else f" < {self.lt}" if self.lt is not None else ""
        if low and not high:  # "x >= 0" reads better than "0 <= x"
            return "x " + low.split()[1].replace("<", ">") + " " + low.split()[0]
        return f"{low}x{high}"


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    default_factory: Any = dataclasses.MISSING,
    weight: bool = False,
    rest: bool = False,
    **bounds: float,
) -> Any:
    """A dataclass field with its help text and, for a number, the range it must lie in.
    ``weight``: a reward weight (negative only when the config opts in: ``negative_weights``);
    ``rest``: the dict field that takes the keys the section does not declare (module docstring)."""
    metadata: dict[str, Any] = {"help": help, "weight": weight, "rest": rest}
    if bounds:
        metadata["range"] = Range(**bounds)
    return field(default=default, default_factory=default_factory, metadata=metadata)


def derived(help: str) -> Any:
    """A field that validation fills in from the others (not a config key; None until then)."""
    return field(default=None, init=False, repr=False, compare=False, metadata={"help": help})


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
        key, item = typing.get_args(tp) or (Any, Any)
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(v, item) for k, v in value.items())
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
    if origin is dict and typing.get_args(tp):
        key, item = typing.get_args(tp)
        return f"a mapping from {_describe(key)} to {_describe(item)}"
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
    if (
        bounds is not None
        and isinstance(coerced, (int, float))
        and not isinstance(coerced, bool)
        and not bounds.holds(coerced)
    ):
        raise ConfigError(f"{path}: invalid value {value!r}; expected {bounds}")
    return coerced


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, checking every key and value."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    rest = rest_field(cls)
    kwargs: dict[str, Any] = {rest: {}} if rest else {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if rest and key not in fields:
            kwargs[rest][key] = value
            continue
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown key {path!r}{hint}; allowed keys: {', '.join(fields)}")
        value = check_value(path, value, hints[key], fields[key].metadata.get("range"))
        value = _build(hints[key], value, path)
        kwargs[key] = {**value, **kwargs[key]} if key == rest else value
    return cls(**kwargs)


def rest_field(cls: type) -> str | None:
    """The name of ``cls``'s ``rest`` field (module docstring), or None."""
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get("rest")), None)


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


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per field, nested sections expanded: ``--prefix.name  type = default  help``."""
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if f.metadata.get("rest"):
            lines.append(f"  --{prefix}<key>  {f.metadata.get('help', '')}")
            continue
        nested = [t for t in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(t)]
        if nested:
            lines.extend(describe(nested[0], key + "."))
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else ""
        )
        bounds = f.metadata.get("range")
        extra = f" ({bounds})" if bounds else ""
        lines.append(f"  --{key}  {_describe(tp)} = {default!r}{extra}\n      {f.metadata.get('help', '')}")
    return lines


def to_dict(obj: Any) -> Any:
    """A config as the mapping a file would hold: ``dataclasses.asdict`` without derived fields."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        rest = rest_field(type(obj))
        if rest:
            out.update(out.pop(rest))
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_dict(v) for v in obj)
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return copy.deepcopy(obj)
