"""Deterministic small vision set: coloured circles, squares and triangles drawn with PIL.

    python scripts/make_shapes.py                     # data/shapes/shapes.jsonl + data/shapes/images/*.png
    python scripts/make_shapes.py --out-dir /tmp/sh   # same bytes elsewhere

Each row (docs/method.md section 1) has one 96x96 PNG (``image``, relative to the JSONL file), a
question about counts or comparisons, reference steps ("I count the red circles: there
are 3.", ...) and the answer (a number, yes/no, or an option letter for the few
multiple-choice rows). Shapes sit in the cells of a 3x3 grid, so they never overlap
and stay countable at this size. Re-running gives byte-identical files: the PNGs are
written without metadata, and everything comes from ``random.Random(seed)``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

#: Relative to the folder the script runs in (the repository root, where data/shapes is committed).
DEFAULT_OUT = Path("data") / "shapes"
SEED = 7
N_ROWS = 24
SIZE = 96
GRID = 3
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220), "green": (30, 160, 60), "yellow": (235, 200, 20)}
SHAPES = ["circle", "square", "triangle"]
LETTERS = "ABCD"


def _plural(shape: str, n: int) -> str:
    return shape if n == 1 else shape + "s"


def draw(objects: list[tuple[str, str, int]]) -> Image.Image:
    """objects: (shape, colour, grid cell 0..8) -> RGB image."""
    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    d = ImageDraw.Draw(img)
    cell = SIZE // GRID
    r = cell // 2 - 5
    for shape, colour, pos in objects:
        cx, cy = (pos % GRID) * cell + cell // 2, (pos // GRID) * cell + cell // 2
        fill = COLOURS[colour]
        if shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=(0, 0, 0))
        elif shape == "square":
            d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=(0, 0, 0))
        else:
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill, outline=(0, 0, 0))
    return img


def _scene(rng: random.Random) -> list[tuple[str, str, int]]:
    n = rng.randint(3, 8)
    cells = rng.sample(range(GRID * GRID), n)
    colours = rng.sample(list(COLOURS), rng.randint(2, 3))
    return [(rng.choice(SHAPES), rng.choice(colours), c) for c in sorted(cells)]


def _count(objs, shape=None, colour=None) -> int:
    return sum(1 for s, c, _ in objs if (shape is None or s == shape) and (colour is None or c == colour))


def question_for(kind: str, objs, rng: random.Random) -> tuple[str, str, list[str], list[str] | None]:
    """(question, answer, reference steps, choices or None)."""
    present = sorted({(s, c) for s, c, _ in objs})
    if kind == "count_colour_shape":
        shape, colour = rng.choice(present)
        n = _count(objs, shape, colour)
        return (
            f"How many {colour} {shape}s are there?",
            str(n),
            [
                f"I look for {colour} {shape}s in the picture.",
                f"I count the {colour} {shape}s: there {'is' if n == 1 else 'are'} {n}.",
            ],
            None,
        )
    if kind == "count_shape":
        shape = rng.choice(sorted({s for s, _ in present}))
        n = _count(objs, shape)
        colours = sorted({c for s, c, _ in objs if s == shape})
        steps = [
            f"I count the {c} {shape}s: there {'is' if k == 1 else 'are'} {k}."
            for c in colours
            for k in [_count(objs, shape, c)]
        ]
        if len(colours) > 1:
            steps.append(
                f"In total there are {' + '.join(str(_count(objs, shape, c)) for c in colours)} = {n} {shape}s."
            )
        else:
            steps.insert(0, f"All the {shape}s are {colours[0]}.")
        return f"How many {shape}s are there?", str(n), steps, None
    if kind == "count_total":
        counts = {s: _count(objs, s) for s in SHAPES}
        steps = [f"I count the {s}s: there {'is' if k == 1 else 'are'} {k}." for s, k in counts.items() if k]
        total = sum(counts.values())
        steps.append(f"Altogether there are {' + '.join(str(k) for k in counts.values() if k)} = {total} shapes.")
        return "How many shapes are there in total?", str(total), steps, None
    if kind == "compare":
        a, b = rng.sample(SHAPES, 2)
        na, nb = _count(objs, a), _count(objs, b)
        yes = na > nb
        rel = "more than" if na > nb else ("the same as" if na == nb else "fewer than")
        return (
            f"Are there more {a}s than {b}s?",
            "yes" if yes else "no",
            [
                f"I count the {a}s: there {'is' if na == 1 else 'are'} {na}.",
                f"I count the {b}s: there {'is' if nb == 1 else 'are'} {nb}.",
                f"{na} is {rel} {nb}, so the answer is {'yes' if yes else 'no'}.",
            ],
            None,
        )
    if kind == "colour_count":
        colour = rng.choice(sorted({c for _, c in present}))
        n = _count(objs, colour=colour)
        shapes = [s for s in SHAPES if _count(objs, s, colour)]
        steps = [
            f"I count the {colour} {s}s: there {'is' if k == 1 else 'are'} {k}."
            for s in shapes
            for k in [_count(objs, s, colour)]
        ]
        steps.append(f"So there are {' + '.join(str(_count(objs, s, colour)) for s in shapes)} = {n} {colour} shapes.")
        return f"How many {colour} shapes are there?", str(n), steps, None
    # "most": multiple choice, which shape appears most often (scenes are re-drawn until unique)
    counts = {s: _count(objs, s) for s in SHAPES}
    best = max(counts, key=counts.get)
    choices = list(SHAPES)
    rng.shuffle(choices)
    letter = LETTERS[choices.index(best)]
    steps = [f"I count the {s}s: there {'is' if k == 1 else 'are'} {k}." for s, k in counts.items()]
    steps.append(f"The {best}s are the most common, which is option {letter}.")
    return "Which shape appears most often?", letter, steps, choices


KINDS = ["count_colour_shape", "count_shape", "count_total", "compare", "colour_count", "most"]


def generate(out_dir: Path = DEFAULT_OUT, n: int = N_ROWS, seed: int = SEED) -> Path:
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        while True:
            objs = _scene(rng)
            counts = sorted((_count(objs, s) for s in SHAPES), reverse=True)
            if kind == "most" and counts[0] == counts[1]:
                continue  # the most common shape must be unique
            if kind == "compare" and len({s for s, _, _ in objs}) < 2:
                continue
            break
        question, answer, steps, choices = question_for(kind, objs, rng)
        rel = f"images/shape-{i + 1:03d}.png"
        # No metadata (no pnginfo, no timestamps): the bytes depend on the pixels only.
        draw(objs).save(out_dir / rel, format="PNG", optimize=False, compress_level=9)
        row = {
            "id": f"shape-{i + 1:03d}",
            "question": question,
            "image": rel,
            "answer": answer,
            "reference_steps": steps,
            "source": f"shapes/{kind}",
        }
        if choices:
            row["choices"] = choices
        rows.append(row)
    path = out_dir / "shapes.jsonl"
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--n", type=int, default=N_ROWS)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    path = generate(args.out_dir, args.n, args.seed)
    print(f"{path}: {args.n} rows, images in {path.parent / 'images'}")
