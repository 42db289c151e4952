"""Data as users have it: JSONL, JSON arrays, Parquet, datasets folders, Hub-layout
repositories in the local cache, and a column mapping, all with ``file:N: problem`` errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, Features, Image, Sequence, Value

from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.train.data.splits import DataError, load_split
from crystal_grpo.typed import ConfigError

ROWS = [json.loads(x) for x in Path("data/wordproblems/train.jsonl").read_text().splitlines()[:6]]
# The same rows under the column names of a typical Hub dataset.
THEIRS = {"question": "problem", "answer": "solution", "reference_steps": "steps"}


def _table(rows: list[dict]) -> Dataset:
    """Rows as one table (``Dataset.from_list`` takes its columns from the first row alone)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return Dataset.from_list([{k: r.get(k) for k in keys} for r in rows])


def _theirs(rows: list[dict]) -> list[dict]:
    return [{THEIRS.get(k, k): v for k, v in r.items()} for r in rows]


def _seen(split) -> list[tuple]:
    ds = split.dataset
    return [(r["id"], r["prompt"][-1]["content"], r["answer"], tuple(r["reference_steps"])) for r in ds]


def _hub_snapshot(cache: Path, repo: str, rows: list[dict]) -> Path:
    """A dataset repository as ``huggingface-cli download`` leaves it in the hub cache."""
    root = cache / f"datasets--{repo.replace('/', '--')}"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    snap = root / "snapshots" / sha
    (snap / "data").mkdir(parents=True)
    _table(rows[:4]).to_parquet(str(snap / "data" / "train-00000-of-00001.parquet"))
    _table(rows[4:]).to_parquet(str(snap / "data" / "test-00000-of-00001.parquet"))
    return snap


def test_every_format_gives_the_same_rows(tmp_path, monkeypatch):
    import huggingface_hub.constants

    want = _seen(load_split("data/wordproblems/train.jsonl", limit=6))
    (tmp_path / "rows.json").write_text(json.dumps(ROWS, indent=2))
    _table(ROWS).to_parquet(str(tmp_path / "rows.parquet"))
    _table(ROWS).save_to_disk(str(tmp_path / "saved"))
    DatasetDict(train=_table(ROWS), test=_table(ROWS[:1])).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "files").mkdir()
    _table(ROWS).to_json(str(tmp_path / "files" / "train.jsonl"))
    cache = tmp_path / "hub"
    _hub_snapshot(cache, "someone/word-problems", ROWS)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    for source in ("rows.json", "rows.parquet", "saved", "dict", "files"):
        assert _seen(load_split(tmp_path / source)) == want, source
    hub_train = load_split("someone/word-problems")
    assert _seen(hub_train) == want[:4] and hub_train.source == "someone/word-problems"
    assert [r[0] for r in _seen(load_split("someone/word-problems", split="test"))] == [r["id"] for r in ROWS[4:]]
    with pytest.raises(DataError, match=r"dict: no split 'validation'; it has train, test"):
        load_split(tmp_path / "dict", split="validation")
    with pytest.raises(
        DataError,
        match=r"someone/absent: no such file or folder, and no dataset repository of that "
        r"name in the local Hugging Face cache .*huggingface-cli download "
        r"--repo-type dataset someone/absent",
    ):
        load_split("someone/absent")


def test_column_mapping_and_errors_that_name_the_data_s_columns(tmp_path):
    rows = _theirs(ROWS)
    rows[2]["problem"] = ""
    del rows[4]["steps"]
    path = tmp_path / "theirs.parquet"
    _table(rows).to_parquet(str(path))
    with pytest.raises(DataError) as err:
        load_split(path, columns=THEIRS)
    msg = str(err.value)
    assert f"{path}:3: missing or empty 'problem' (data.columns.question)" in msg
    assert f"{path}:5: 'steps' (data.columns.reference_steps) must be a non-empty list" in msg
    assert "2 invalid row(s)" in msg and f"{path}:1:" not in msg
    kept = load_split(path, columns=THEIRS, skip_invalid=True)
    assert kept.skipped == 2 and [r[0] for r in _seen(kept)] == [ROWS[i]["id"] for i in (0, 1, 3, 5)]
    assert _seen(kept)[0][2:] == (str(ROWS[0]["answer"]), tuple(ROWS[0]["reference_steps"]))


def test_a_broken_json_array_or_parquet_file_is_one_clear_error(tmp_path):
    bad = tmp_path / "rows.json"
    bad.write_text('[\n  {"question": "q", "answer": "1"},\n  {"question": oops}\n]')
    with pytest.raises(DataError, match=rf"^{bad}: invalid JSON \(line 3, column 16\): Expecting value$"):
        load_split(bad)
    rows = tmp_path / "rows2.json"
    rows.write_text(json.dumps([ROWS[0], {"question": "no answer"}, ROWS[1]]))
    with pytest.raises(DataError, match=rf"{rows}:2: missing or empty 'answer'"):
        load_split(rows)
    broken = tmp_path / "rows.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=rf"^{broken}: not a readable Parquet file"):
        load_split(broken)


def test_a_key_given_twice_in_a_row_is_a_bad_row_and_a_byte_order_mark_is_read_past(tmp_path):
    """A row giving "answer" twice trained on the last value without a word; a file saved with a
    UTF-8 byte order mark (Windows editors) lost its first row: "invalid JSON" (second hostile set)."""
    lines = [json.dumps(r) for r in ROWS[:3]]
    lines[1] = lines[1][:-1] + ', "answer": "999"}'
    twice = tmp_path / "twice.jsonl"
    twice.write_text("\r\n".join(lines) + "\r\n")
    with pytest.raises(DataError) as err:
        load_split(twice)
    assert str(err.value) == (
        f"1 invalid row(s) in {twice} (set data.skip_invalid: true to drop them):\n  {twice}:2: "
        "key 'answer' given twice in one object (which value is meant?)"
    )
    array = tmp_path / "twice.json"
    array.write_text("[" + ",\n".join(lines) + "]")
    with pytest.raises(DataError, match="key 'answer' given twice in one object"):
        load_split(array)
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(r) for r in ROWS).encode() + b"\r\n")
    assert _seen(load_split(marked)) == _seen(load_split("data/wordproblems/train.jsonl", limit=6))


def test_gzip_compressed_rows_load_as_the_same_rows(tmp_path):
    """train.jsonl.gz (as ``datasets`` reads it) was every line "not UTF-8 text" (third hostile set)."""
    import gzip

    plain = _seen(load_split("data/wordproblems/train.jsonl", limit=6))
    lines = gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode())
    (tmp_path / "train.jsonl.gz").write_bytes(lines)
    (tmp_path / "train.json.gz").write_bytes(gzip.compress(json.dumps(ROWS).encode()))
    assert _seen(load_split(tmp_path / "train.jsonl.gz")) == plain
    assert _seen(load_split(tmp_path / "train.json.gz")) == plain


def test_images_stored_in_the_data_load_like_image_files(tmp_path):
    from PIL import Image as PILImage

    from crystal_grpo.train.data.splits import image_store

    shapes = [json.loads(x) for x in Path("data/shapes/shapes.jsonl").read_text().splitlines()[:3]]
    rows = [
        {
            **{k: v for k, v in r.items() if k not in ("image", "images")},
            # .copy(): an image without a file name, so datasets stores its bytes in the table
            "picture": [PILImage.open(Path("data/shapes") / (r.get("images") or [r["image"]])[0]).copy()],
        }
        for r in shapes
    ]
    feats = Features(
        {
            **{k: Value("string") for k in ("id", "question", "answer")},
            "reference_steps": Sequence(Value("string")),
            "picture": Sequence(Image()),
        }
    )
    rows = [{k: r[k] for k in feats} for r in rows]
    path = tmp_path / "shapes.parquet"
    Dataset.from_list(rows, features=feats).to_parquet(str(path))
    split = load_split(path, columns={"images": "picture"})
    stored = split.dataset.with_format(None)["images"]
    assert all(Path(p[0]).parent == image_store() for p in stored)
    first = split.dataset[0]["images"][0]
    assert first.size == PILImage.open(Path("data/shapes") / (shapes[0].get("images") or [shapes[0]["image"]])[0]).size


def test_a_column_mapping_naming_a_column_the_file_lacks_is_an_error(tmp_path):
    """The row's own field of that name was read instead, without a word."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(DataError) as err:
        load_split(path, columns={"answer": "solution"})
    assert str(err.value) == (
        f"{path}: data.columns maps answer to 'solution', a column no row of it has (its "
        f"columns: {', '.join(sorted({k for r in ROWS for k in r}))})"
    )


def test_training_data_smaller_than_one_batch_is_refused_before_the_model_loads(
    tmp_path, tiny_lm_path, capsys, monkeypatch
):
    """3 prompts, a batch of 4 (16 completions of 4 generations): "steps 0", exit 0, final/ = the
    starting weights."""

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("crystal_grpo.train.models.loading.load_policy", loaded)
    run = tmp_path / "run"
    assert (
        grpo.main(
            [
                "--config",
                "tiny.yaml",
                "--model.name_or_path",
                str(tiny_lm_path),
                "--output_dir",
                str(run),
                "--data.max_train_samples",
                "3",
                "--training.per_device_train_batch_size",
                "16",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("DataError: ") and err[-1].endswith(
        ": 3 training prompt(s), fewer than one generation batch takes (4 = generation_batch_size 16 / "
        "num_generations 4; per_device_train_batch_size x processes x steps_per_generation completions): the run "
        "would train 0 steps; give more rows (data.max_train_samples) or a smaller "
        "training.per_device_train_batch_size"
    ), err[-3:]
    assert not run.exists()


def test_columns_config_names_the_bad_field(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"data.columns: invalid value \{'questoin': 'problem'\}; expected a mapping "
        r"from one of 'id', 'question'",
    ):
        load_config("tiny.yaml", ["--data.columns", "{questoin: problem}"])


def test_training_from_a_hub_dataset_with_its_own_column_names(tmp_path, tiny_lm_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    _hub_snapshot(cache, "someone/word-problems", _theirs(ROWS))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    out = tmp_path / "run"
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(out),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--data.train",
        "someone/word-problems",
        "--data.validation",
        "someone/word-problems",
        "--data.validation_split",
        "test",
        "--data.columns",
        json.dumps(THEIRS),
        "--training.max_steps",
        "1",
        "--validation.max_samples",
        "2",
    ]
    assert grpo.main(argv) == 0
    assert json.loads((out / "validation.jsonl").read_text().splitlines()[-1])["step"] == 1
    samples = [json.loads(x) for x in (out / "validation_samples_step1.jsonl").read_text().splitlines()]
    assert [s["id"] for s in samples] == [r["id"] for r in ROWS[4:]]  # the repository's test split


def _shapes(tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree("data/shapes", tmp_path / "shapes")) / "shapes.jsonl"


def _image_of(data: Path, line: int) -> Path:
    row = json.loads(data.read_text().splitlines()[line - 1])
    return data.parent / (row.get("images") or [row["image"]])[0]


def test_missing_and_broken_images_stop_a_vlm_run_before_training_with_file_and_line(tmp_path, tiny_vlm_path, capsys):
    data = _shapes(tmp_path)
    _image_of(data, 3).unlink()
    broken = _image_of(data, 7)
    broken.write_bytes(broken.read_bytes()[:200])  # a truncated PNG
    run = tmp_path / "run"
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(run),
        "--model.name_or_path",
        str(tiny_vlm_path),
        "--data.train",
        str(data),
        "--data.validation",
        "null",
        "--data.max_train_samples",
        "null",
    ]
    assert grpo.main(argv) == 2
    err = capsys.readouterr().err
    assert f"DataError: 2 invalid row(s) in {data} (set data.skip_invalid: true to drop them):" in err
    assert err.count(f"{data}:3: unreadable image '{_image_of(data, 3)}' (FileNotFoundError") == 1
    assert err.count(f"{data}:7: unreadable image '{broken}' (OSError") == 1
    assert not run.exists()  # stopped before the model loaded or anything was written


def test_an_image_lost_mid_run_is_replaced_from_the_same_split(tmp_path, caplog):
    """After a split, each part replaces a row whose image broke with one of its own rows (a
    shared loader would hand a training row to validation) and names the row's file:line."""
    from crystal_grpo.train.data.splits import DataSection, load_datasets

    data = _shapes(tmp_path)
    train, val = load_datasets(DataSection(train=str(data), validation_fraction=0.25), seed=3)
    ids = [json.loads(x)["id"] for x in data.read_text().splitlines()]
    val_ids = set(val.dataset.with_format(None)["id"])
    # a validation row whose successor in the file is a training row
    i = next(i for i, v in enumerate(ids[:-1]) if v in val_ids and ids[i + 1] not in val_ids)
    _image_of(data, i + 1).unlink()
    with caplog.at_level("WARNING"):
        rows = [val.dataset[k] for k in range(len(val.dataset))]
    got = [r["id"] for r in rows]
    assert ids[i] not in got and set(got) <= val_ids
    assert [r.getMessage()[: len(f"{data}:{i + 1}: ")] for r in caplog.records] == [f"{data}:{i + 1}: "]
    assert "image is unreadable now (FileNotFoundError" in caplog.text
    assert len(train.dataset[0]["images"]) == 1  # the other split still reads its own


class CountingTokenizer:
    """The organism's real tokenizer, counting the characters it is asked to tokenise."""

    def __init__(self):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "data/organism/warm_start")
        self.chars = 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, texts, **kwargs):
        self.chars += sum(map(len, texts))
        return self.tok(texts, **kwargs)


def test_a_prompt_too_long_by_its_size_alone_is_skipped_without_tokenising_it(tmp_path):
    """A 50 MB row took 110-232 s and 9.95 GB to tokenise before it was skipped: a prompt longer
    than room x the longest token (in characters) cannot fit, so it is
    skipped unread by the tokenizer, with the same warning."""
    from crystal_grpo.train.data.splits import limit_prompt_lengths

    rows = [json.loads(x) for x in Path("data/wordproblems/train.jsonl").read_text().splitlines()[:4]]
    tok, room = CountingTokenizer(), 200
    rows[1]["question"] = "apples " * 30_000  # 210,000 characters: past room x 4 x the longest token (12)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    split, line = limit_prompt_lengths(load_split(data), tok, room, "skip", "the completion")
    assert line == (
        f"1 of 4 prompt(s) of {data} leave no room for the completion: longer than {room} tokens (e.g. "
        f"{rows[1]['id']}); skipped (data.long_prompts: skip)"
    )
    assert list(split.dataset["id"]) == [rows[i]["id"] for i in (0, 2, 3)]
    assert 0 < tok.chars < len(rows[1]["question"])  # the three short prompts only


def test_a_row_with_more_options_than_letters_is_a_bad_row(tmp_path):
    """A row with 27 choices ended the run in an IndexError while its prompt was built (A-Z)."""
    rows = [json.loads(x) for x in Path("data/wordproblems/train.jsonl").read_text().splitlines()[:3]]
    rows[1]["choices"] = [f"option {i}" for i in range(27)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DataError, match=re.escape(f"{data}:2: 'choices' has 27 options; a prompt letters them A to Z")
    ):
        load_split(data)


PEAK_PER_ROW = """
import json, sys
from pathlib import Path
from crystal_grpo.train.data.splits import limit_prompt_lengths, load_split
from transformers import AutoTokenizer

def peak():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM")) * 1024

rows = [json.loads(x) for x in open(sys.argv[1])]
data, n = Path(sys.argv[2]), int(sys.argv[3])
data.write_text("".join(json.dumps({**rows[i % len(rows)], "id": f"r{i}"}) + "\\n" for i in range(n)))
tok = AutoTokenizer.from_pretrained(sys.argv[4])
limit_prompt_lengths(load_split(sys.argv[1]), tok, 2000, "skip", "x")  # everything imported and made once
before = peak()
split = load_split(data)
limit_prompt_lengths(split, tok, 2000, "skip", "x")
print((peak() - before) / n)
"""


def test_loading_rows_takes_memory_in_proportion_to_their_size(tmp_path, repo_root):
    """A 200k-row JSONL took 5.2 GB before training (25 KB a row of 400 bytes): every row held as
    Python objects, twice, and the tokenizer's output for every prompt. Loading and measuring the
    prompts of 30,000 rows now takes about 2 KB a row more than loading 320."""
    import subprocess
    import sys

    model = repo_root / "data/organism/warm_start"
    args = [str(repo_root / "data/wordproblems/train.jsonl"), str(tmp_path / "big.jsonl"), "30000", str(model)]
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_PER_ROW, *args], capture_output=True, text=True, timeout=600, cwd=repo_root
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout) < 4096, f"{float(proc.stdout):.0f} bytes a row"
