"""A row's images: where they are, whether they open, and opening them only when a batch needs them.

Paths are as the row gives them, relative to the data file (or folder). Every image is
checked when the data loads (:func:`image_problem`, reported with the row's ``file:line``);
:class:`ImageLoader` then opens them lazily and survives a file that vanishes or breaks
during a long run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crystal_grpo.train.data.reading import DataError

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)


def image_paths(row: dict, base: Path) -> list[Path]:
    imgs = (
        row.get("images")
        if row.get("images") is not None
        else ([row["image"]] if row.get("image") is not None else [])
    )
    if not isinstance(imgs, list):
        imgs = [imgs]
    return [_image_path(x, base) for x in imgs]


def _image_path(x: Any, base: Path) -> Path:
    """A path as given, relative to the data (``datasets``' ``{"path"}`` form too)."""
    p = Path(str(x["path"] if isinstance(x, dict) and x.get("path") else x))
    return p if p.is_absolute() else base / p


def image_problem(path: Path) -> list[str]:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as err:  # noqa: BLE001 - any failure means unreadable
        return [f"unreadable image {str(path)!r} ({type(err).__name__}: {err})"]
    return []


class ImageLoader:
    """``datasets`` transform: open image files only when a batch is read.

    Images are checked at start-up, but a file can vanish or break during a long run. Such
    a row is skipped (like ``data.skip_invalid``): it is replaced by the next row whose
    images open, with one warning per row naming its ``file:line`` (``where``: image paths ->
    the row's place in the data) and a count, instead of crashing the run. The replacement
    depends on the row alone, so every generation of a prompt gets the same one.
    """

    def __init__(self, dataset: Dataset, where: Mapping[tuple, str] | None = None) -> None:
        self.raw = dataset.with_format(None)
        self.position = {tuple(p): i for i, p in reversed(list(enumerate(self.raw["images"])))}
        self.where = dict(where or {})
        self.skipped: set[tuple] = set()

    @staticmethod
    def of(dataset: Dataset) -> ImageLoader | None:
        """The loader a data set reads its images with (None: it has none)."""
        transform = (dataset.format.get("format_kwargs") or {}).get("transform")
        return transform if isinstance(transform, ImageLoader) else None

    def __call__(self, batch: dict) -> dict:
        if "images" not in batch:
            return batch
        out = {k: list(v) for k, v in batch.items()}
        for j, paths in enumerate(batch["images"]):
            try:
                out["images"][j] = _open_images(paths)
            except (OSError, ValueError) as err:
                row, images = self._replacement(tuple(paths), err)
                for k in out:
                    out[k][j] = images if k == "images" else row.get(k)
        return out

    def _skip(self, paths: tuple, err: Exception) -> None:
        if paths in self.skipped:
            return
        self.skipped.add(paths)
        where = self.where.get(paths, f"row {self.position.get(paths, '?')}")
        logger.warning(
            "%s: the row's image is unreadable now (%s: %s); row skipped, the next readable row takes its "
            "place (%d row(s) skipped so far)",
            where,
            type(err).__name__,
            err,
            len(self.skipped),
        )

    def _replacement(self, paths: tuple, err: Exception) -> tuple[dict, list]:
        self._skip(paths, err)
        start = self.position.get(paths, 0)
        for k in range(1, len(self.raw) + 1):
            row = self.raw[(start + k) % len(self.raw)]
            try:
                return row, _open_images(row["images"])
            except (OSError, ValueError) as other:
                self._skip(tuple(row["images"]), other)
        raise DataError("no row's images can be read any more (were the image files removed?)")


def own_image_loader(ds: Dataset, where: Mapping[tuple, str] | None = None) -> Dataset:
    """``ds`` reading its images through an :class:`ImageLoader` of its own rows (``where``: the
    rows' places, default those of the loader it had). A split or selection otherwise shares its
    parent's loader, which could hand a validation row to training as a replacement, or the reverse."""
    loader = ImageLoader.of(ds)
    if where is None and loader is None:
        return ds
    return ds.with_transform(ImageLoader(ds, where if where is not None else loader.where))


def _open_images(paths: Sequence[str]) -> list:
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in paths]
