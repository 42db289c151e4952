"""A path a user gives means one place for every part of the program.

A shell expands ``~`` only at the start of a word: ``--output_dir=~/r``, a quoted ``"~/r"`` or
``output_dir: ~/r`` in a YAML file reach the program as written. Some libraries expand it
(transformers' ``TrainingArguments``, ``from_pretrained``), others do not (``pathlib``, ``open``),
so one run wrote its checkpoints under ``$HOME/r`` and its logs under ``./~/r``. Every path is
therefore expanded once, where it is read: the command lines' path arguments (``type=user_path``)
and a config's path fields (:data:`CONFIG_PATHS`, train/config/run_config.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

#: The config fields that name a file or folder, as (section, key) under the top level and under
#: each phase's ``overrides``; ``reward.params.encoder`` is a path or a name, expanded only when it
#: starts with ``~``, like every value here.
CONFIG_PATHS = (
    ("model", "name_or_path"),
    ("data", "train"),
    ("data", "validation"),
    ("reward", "params", "encoder"),
    ("training", "output_dir"),
    ("training", "deepspeed"),
    ("training", "resume_from_checkpoint"),
    ("training", "logging_dir"),
)


def user_path(value: Any) -> Any:
    """``value`` with a leading ``~`` or ``~user`` expanded as a shell would; anything else as it is."""
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


def user_file(value: str) -> Path:
    """:func:`user_path` as a ``Path`` (an argparse ``type``)."""
    return Path(user_path(value))


def expand_config_paths(raw: dict) -> dict:
    """``raw`` (a config's merged mapping) with :data:`CONFIG_PATHS` expanded, in place, at the
    top level and in each phase's overrides."""
    sections = [raw] + [
        p["overrides"] for p in raw.get("phases") or [] if isinstance(p, dict) and isinstance(p.get("overrides"), dict)
    ]
    for section in sections:
        for *parents, key in CONFIG_PATHS:
            node = section
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and key in node:
                node[key] = user_path(node[key])
    return raw


def name_problem(key: str, path: object) -> str | None:
    """Why a file name (or any text given to the program) cannot be used, or None. Under
    ``LC_ALL=C`` without Python's UTF-8 mode file names are ASCII: a UTF-8 name given on the command
    line reaches Python as lone surrogates, which the tokenizer's writer (Rust) and every UTF-8 text
    file refuse (a run crashed at its first save), and one given in a YAML file cannot be opened at
    all; a name whose bytes are not UTF-8 is lone surrogates in any locale."""
    if not isinstance(path, str):
        return None
    try:
        os.fsencode(path)
        path.encode("utf-8")
        return None
    except UnicodeEncodeError:
        shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    encoding = sys.getfilesystemencoding()
    fix = (
        "run with a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1"
        if encoding.lower().replace("-", "") != "utf8"
        else "rename it to UTF-8"
    )
    return f"{key} {shown}: holds bytes that are not text in this process's file-name encoding ({encoding}); {fix}"
