"""Rows as data is found in the field, read one way, each with its place in its file.

JSONL (a line that is not JSON is a row that says so), a JSON array, Parquet, a folder saved
with ``save_to_disk``, a folder of data files or a clone of a Hub dataset repository (what
``datasets.load_dataset`` reads), or a Hub dataset id already in the local cache (offline).
``data.columns`` renames the data's columns onto ours. Images stored inside the data (Parquet,
Hub datasets) are written once, by content hash, to a folder of the ``datasets`` cache, and
the row holds their paths: a row stays JSON (``build_references`` writes rows back).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crystal_grpo.errors import CrystalError
from crystal_grpo.jsonl import iter_jsonl, open_bytes, unique_keys

if TYPE_CHECKING:
    from datasets import Dataset


class DataError(CrystalError, ValueError):
    """Bad data rows; the message lists ``file:line: problem`` for each."""


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def locate(source: str | Path) -> Path:
    """A local file or folder, or the snapshot of a Hub dataset repository already in the
    local Hugging Face cache (nothing is downloaded)."""
    path = Path(source)
    if path.exists():
        return _readable(path)
    if _HUB_ID.fullmatch(str(source)):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(source), repo_type="dataset", local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached (the error type differs across huggingface_hub versions)
            from huggingface_hub.constants import HF_HUB_CACHE

            raise DataError(
                f"{source}: no such file or folder, and no dataset repository of that name in the local "
                f"Hugging Face cache ({HF_HUB_CACHE}); fetch it first with: "
                f"huggingface-cli download --repo-type dataset {source}"
            ) from None
    raise DataError(f"{path}: no such file or folder")


#: What a path that is neither a regular file nor a folder is (``stat``'s file types).
_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _readable(path: Path) -> Path:
    """``path``, unless it cannot hold rows: a named pipe (reading one with no writer waits for
    ever), a socket or a device, or an empty file."""
    mode = path.stat().st_mode
    kind = next((name for test, name in _SPECIAL if test(mode)), None)
    if kind:
        raise DataError(f"{path}: {kind}, not a file of rows; write the rows to a file and give that")
    if stat.S_ISREG(mode) and path.stat().st_size == 0:
        raise DataError(f"{path}: an empty file (0 bytes), no rows")
    if stat.S_ISREG(mode):
        with open(path, "rb") as fh:
            head = fh.read(4)
        wide = next((name for mark, name in _WIDE_TEXT if head.startswith(mark)), None)
        if wide:
            raise DataError(
                f"{path}: {wide} text (its byte order mark says so); data files are UTF-8: save it as UTF-8 "
                f"(e.g. iconv -f {wide} -t UTF-8)"
            )
    return path


#: Byte order marks of text that is not UTF-8 (what Windows PowerShell's ``>`` writes), longest first.
_WIDE_TEXT = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def read_rows(path: Path, split: str = "train", columns: Mapping[str, str] | None = None) -> list[tuple[int, Any]]:
    """(line or row number, the row or why it is unreadable) for each row, renamed by ``columns``."""
    return list(iter_rows(path, split, columns))


def iter_rows(path: Path, split: str = "train", columns: Mapping[str, str] | None = None) -> Iterator[tuple[int, Any]]:
    """:func:`read_rows` one row at a time: a JSONL file is never held whole (a folder, a Parquet
    file or a JSON array is read whole first). A ``data.columns`` name no row has is an error once
    every row is read, before the caller's own verdict on them."""
    if path.is_dir():
        rows: Iterable[tuple[int, Any]] = _dataset_rows(path, split)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = list(enumerate(pq.read_table(path).to_pylist(), 1))
        except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from None
    elif ".json" in path.suffixes[-2:] and _first_char(path) == "[":
        rows = _json_array(path)
    else:
        rows = iter_jsonl(path)
    have: set[str] = set()
    for no, row in rows:
        if columns and isinstance(row, dict):
            have.update(row)
        yield no, _with_image_files(_rename(row, columns) if columns else row)
    lacking = {ours: theirs for ours, theirs in (columns or {}).items() if theirs not in have}
    if lacking and have:  # (a file without rows says so in its own words)
        ours, theirs = next(iter(lacking.items()))
        raise DataError(
            f"{path}: data.columns maps {ours} to {theirs!r}, a column no row of it has (its columns: "
            f"{', '.join(sorted(have))})"
        )


def _first_char(path: Path) -> str:
    with open_bytes(path) as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1].decode("latin-1")


def _json_array(path: Path) -> list[tuple[int, Any]]:
    try:
        with open_bytes(path) as fh:
            rows = json.loads(fh.read().decode("utf-8-sig"), object_pairs_hook=unique_keys)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as err:
        where = f" (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
        raise DataError(f"{path}: invalid JSON{where}: {getattr(err, 'msg', err)}") from None
    return list(enumerate(rows, 1))


def _dataset_rows(path: Path, split: str) -> list[tuple[int, Any]]:
    """A folder written by ``save_to_disk``, or one ``datasets.load_dataset`` reads (data
    files, a Hub repository's layout); images stay undecoded bytes until a batch needs them."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    saved = any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))
    try:
        ds = load_from_disk(str(path)) if saved else load_dataset(str(path))
    except Exception as err:  # noqa: BLE001 - datasets raises many types for a folder it cannot read
        raise DataError(f"{path}: not a dataset folder ({type(err).__name__}: {str(err)[:300]})") from None
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(
                f"{path}: no split {split!r}; it has {', '.join(ds)} (data.train_split / "
                "data.validation_split choose one)"
            )
        ds = ds[split]
    ds = _undecoded_images(ds)
    return [(i + 1, dict(r)) for i, r in enumerate(ds)]


def _undecoded_images(ds: Dataset) -> Dataset:
    from datasets import Image

    for name, feature in ds.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, Image) and feature.decode:
            ds = ds.cast_column(name, Image(decode=False))
        elif isinstance(inner, Image) and inner.decode:
            ds = ds.cast_column(name, type(feature)(Image(decode=False)))
    return ds


def _rename(row: Any, columns: Mapping[str, str]) -> Any:
    if not isinstance(row, dict):
        return row
    out = {k: v for k, v in row.items() if k not in columns.values()}
    out.update({ours: row[theirs] for ours, theirs in columns.items() if theirs in row})
    return out


def image_store() -> Path:
    """Where images stored inside data files are written, once, by content hash."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "crystal_grpo_images"


def _stored_image(data: bytes, name: str) -> Path:
    path = image_store() / (hashlib.sha256(data).hexdigest()[:32] + (Path(name).suffix or ".img"))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # several processes may load the same data at once
    return path


def _embedded(x: Any) -> bool:
    return isinstance(x, (bytes, bytearray)) or (isinstance(x, dict) and bool(x.get("bytes")))


def _with_image_files(row: Any) -> Any:
    """The row with each image held in the data (``datasets``' ``{"bytes", "path"}`` form, or
    raw bytes) replaced by the path of its stored copy: written and hashed once, at reading,
    and the row stays JSON (``build_references`` writes rows back)."""
    if not isinstance(row, dict):
        return row
    for key in ("images", "image"):
        value = row.get(key)
        items = value if isinstance(value, list) else [value]
        if any(_embedded(x) for x in items):
            stored = [
                (
                    str(_stored_image(x["bytes"], str(x.get("path") or "")))
                    if isinstance(x, dict)
                    else str(_stored_image(bytes(x), ""))
                )
                if _embedded(x)
                else x
                for x in items
            ]
            row = {**row, key: stored if isinstance(value, list) else stored[0]}
    return row
