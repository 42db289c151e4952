"""Code a config names by import path: ``package.module:Name``, or ``path/to/file.py:Name`` (a
file relative to the folder the run starts in, like data paths). A reward
(``reward.name``), a reward component (``reward.components[].fn``) and a curriculum mode
(``curriculum.mode``) are named this way, so a user's own ones need no edit of this package.

Whatever goes wrong (a module that does not import, a name it does not have, an object of the
wrong kind) is one :class:`ImportPathError` line while the config is checked, before any model
loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from crystal_grpo.paths import user_path
from crystal_grpo.typed import ConfigError

#: What an import path looks like, for error messages.
FORMS = "'package.module:Name' or 'path/file.py:Name'"


class ImportPathError(ConfigError):
    """Code named by import path in a config that cannot be used."""


def is_import_path(name: str) -> bool:
    """Whether a config value names code (``module:Name``) rather than a registered name."""
    return ":" in name


def load_object(spec: str, what: str = "reward") -> Any:
    """The object ``spec`` names (``pkg.module:Name`` or ``path/to/file.py:Name``, relative to
    the working folder); a file is imported once per process however often it is named."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ImportPathError(f"{what} {spec!r}: expected {FORMS}")
    try:
        if module_name.endswith(".py"):
            path = Path(user_path(module_name)).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no such file {str(path)!r}")
            name = f"crystal_grpo_user_{path.stem}_{abs(hash(str(path)))}"
            module = sys.modules.get(name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module
                loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any error while importing the user's code
        sys.modules.pop(locals().get("name", ""), None)
        raise ImportPathError(
            f"{what} {spec!r}: {module_name} does not import ({type(err).__name__}: {err})"
        ) from None
    if not hasattr(module, attr):
        raise ImportPathError(f"{what} {spec!r}: {module_name} has no {attr!r}")
    return getattr(module, attr)


def load_subclass(spec: str, base: type, what: str, hint: str = "") -> type:
    """The class ``spec`` names, which must be a subclass of ``base``."""
    obj = load_object(spec, what)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ImportPathError(f"{what} {spec!r} is a {type(obj).__name__}, not a {base.__name__} subclass{hint}")
    return obj
