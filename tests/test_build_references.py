"""scripts/build_references.py end to end: from trajectory files and from a (tiny) model, kept
and skipped rows, the consensus record, resume after a kill, a failing row, settings that
would mix two builds, and bad input as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.train.tools import build_references as br

STEP1 = "Ann starts with 3 apples."
STEP2 = "She buys 4 more apples, so she has 3 + 4 = 7 apples."
ROWS = [
    {"id": "r1", "question": "Ann has 3 apples and buys 4 more. How many apples does she have?", "answer": "7"},
    {"id": "r2", "question": "What is 2 + 2?", "answer": "4", "reference_steps": ["Two plus two is 4."]},
    {"id": "r3", "question": "Bo has 9 pens and loses 4. How many are left?", "answer": "5"},
    {"id": "r4", "question": "A box holds 6 eggs. How many eggs are in 2 boxes?", "answer": "12"},
]
# File a: r1 right once and wrong once; r3 wrong; r4 right twice but the two share no step.
# File b: r1 right (one step more), r2 right, r3 wrong with a step a's wrong one shares.
TRAJ_A = [
    {"id": "r1", "reasoning_steps": [STEP1, STEP2], "answer": "7"},
    {"id": "r1", "reasoning_steps": ["Ann has three.", "Penguins live in Antarctica."], "answer": "8"},
    {"id": "r3", "reasoning_steps": ["Bo has 9 pens.", "He loses 4, so 9 + 4 = 13 pens are left."], "answer": "13"},
    {"id": "r4", "reasoning_steps": ["Each box holds 6 eggs, so 2 boxes hold 12."], "answer": "12"},
    {"id": "r4", "reasoning_steps": ["The sky over the harbour was grey that morning."], "answer": "12 eggs"},
    {"id": "unknown-id", "reasoning_steps": ["x"], "answer": "1"},
]
TRAJ_B = [
    {"id": "r1", "reasoning_steps": [STEP1, STEP2, "The answer is 7."], "answer": "7 apples"},
    {"id": "r2", "reasoning_steps": ["2 + 2 = 4."], "answer": "4"},
    {"id": "r3", "reasoning_steps": ["Bo has 9 pens."], "answer": "4"},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def inputs(tmp_path) -> dict:
    return {
        "data": write_jsonl(tmp_path / "data.jsonl", ROWS),
        "a": write_jsonl(tmp_path / "a.jsonl", TRAJ_A),
        "b": write_jsonl(tmp_path / "b.jsonl", TRAJ_B),
        "out": tmp_path / "out.jsonl",
    }


def run(inputs, *extra, out=None) -> int:
    return br.main(
        [
            "--data",
            str(inputs["data"]),
            "--out",
            str(out or inputs["out"]),
            "--trajectories",
            str(inputs["a"]),
            str(inputs["b"]),
            "--device",
            "cpu",
            *extra,
        ]
    )


def summary(out: Path) -> dict:
    return json.loads((out.with_name(out.stem + ".work") / "summary.json").read_text())


def test_built_from_trajectory_files(inputs, capsys):
    assert run(inputs) == 0
    rows = read_jsonl(inputs["out"])
    assert [r["id"] for r in rows] == ["r1", "r2"]  # data order; r3 and r4 have no usable consensus
    r1, r2 = rows
    assert r1["reference_steps"] == [STEP1, STEP2]  # "The answer is 7." is in b only
    assert r1["question"] == ROWS[0]["question"] and r1["answer"] == "7"
    info = r1["reference_build"]
    assert info["accepted"] == 2 and info["trajectories"] == 3  # a's wrong answer (8) is dropped
    assert info["generators"] == [str(inputs["a"]), str(inputs["b"])]
    assert [s["generators"] for s in info["steps"]] == [[str(inputs["a"]), str(inputs["b"])]] * 2
    assert [(s["support"], s["cluster_size"]) for s in info["steps"]] == [(2, 2), (2, 2)]
    assert info["dropped_cluster_sizes"] == [1] and info["warnings"] == []
    assert "reference_sets" not in r1
    assert r2 == ROWS[1]  # already had references: written as it was, b's trajectory unused
    s = summary(inputs["out"])
    assert (s["built"], s["kept"], s["no_correct"], s["no_consensus"]) == (1, 1, ["r3"], ["r4"])
    assert s["disagreed"] == ["r4"] and s["reference_lengths"] == {"1": 1, "2": 1}
    printed = capsys.readouterr().out
    assert "1 row(s) built, 1 kept with their references" in printed
    assert "1 skipped, no correct trajectory: r3" in printed
    assert "every generator disagreed on every step: r4" in printed


def test_keep_incorrect_reference_sets_and_rebuild(inputs, tmp_path):
    assert run(inputs, "--keep_incorrect", "--reference_sets", "--rebuild") == 0
    rows = {r["id"]: r for r in read_jsonl(inputs["out"])}
    assert rows["r3"]["reference_steps"] == ["Bo has 9 pens."]  # the step both wrong solutions share
    assert rows["r3"]["reference_build"]["accepted"] == 2
    # r1: with the wrong solution kept there are three; the one equal to the chain is not repeated.
    assert rows["r1"]["reference_sets"] == [
        ["Ann has three.", "Penguins live in Antarctica."],
        [STEP1, STEP2, "The answer is 7."],
    ]
    # r2 is rebuilt from b alone: one trajectory cannot reach --min_support 2 ...
    assert "r2" not in rows and summary(inputs["out"])["no_consensus"] == ["r2", "r4"]
    # ... and with --min_support 1 it is, and scored against the references it had.
    out = tmp_path / "one.jsonl"
    assert run(inputs, "--rebuild", "--min_support", "1", out=out) == 0
    r2 = {r["id"]: r for r in read_jsonl(out)}["r2"]
    assert r2["reference_steps"] == ["2 + 2 = 4."]
    assert r2["reference_build"]["original_steps"] == ["Two plus two is 4."]
    s = summary(out)
    assert s["rows_vs_original"] == 1 and s["match_f1_vs_original"] == r2["reference_build"]["match_f1_vs_original"]


def test_collapse_is_reported_not_written(inputs, tmp_path):
    data = write_jsonl(tmp_path / "long.jsonl", [{"id": "L", "question": "Count.", "answer": "3"}])
    steps = ["Ann picks three apples from the tree.", "She washes them in cold water.", "Then she bakes a pie."]
    a = write_jsonl(tmp_path / "la.jsonl", [{"id": "L", "reasoning_steps": steps, "answer": "3"}] * 2)
    out = tmp_path / "long-out.jsonl"
    args = ["--data", str(data), "--trajectories", str(a), "--device", "cpu", "--cluster_threshold", "0.1"]
    assert br.main([*args, "--out", str(out)]) == 0
    assert read_jsonl(out) == [] and list(summary(out)["collapsed"]) == ["L"]
    out2 = tmp_path / "kept.jsonl"
    assert br.main([*args, "--out", str(out2), "--keep_collapsed"]) == 0
    (row,) = read_jsonl(out2)
    assert len(row["reference_steps"]) == 1 and row["reference_build"]["warnings"][0].startswith("one cluster holds 6")
    # The shipped threshold keeps the three steps apart.
    out3 = tmp_path / "default.jsonl"
    assert br.main([*args[:-2], "--out", str(out3)]) == 0
    assert read_jsonl(out3)[0]["reference_steps"] == steps


def test_resume_keeps_written_rows_and_finishes_the_rest(inputs):
    assert run(inputs, "--keep_incorrect") == 0
    full = inputs["out"].read_text().splitlines()
    assert len(full) == 3
    # A kill after the first row, in the middle of writing the second.
    first = json.loads(full[0])
    first["marker"] = "written before the kill"
    inputs["out"].write_text(json.dumps(first) + "\n" + full[1][:25])
    assert run(inputs, "--keep_incorrect") == 0
    resumed = inputs["out"].read_text().splitlines()
    assert json.loads(resumed[0])["marker"] == "written before the kill"  # not rebuilt
    assert [json.loads(x) for x in resumed[1:]] == [json.loads(x) for x in full[1:]]
    assert summary(inputs["out"])["already_written"] == 1
    assert run(inputs, "--keep_incorrect") == 0  # finished: nothing more
    assert len(inputs["out"].read_text().splitlines()) == 3


def test_other_settings_refuse_to_mix_into_one_output(inputs, capsys):
    assert run(inputs) == 0
    assert run(inputs, "--cluster_threshold", "0.5") == 2
    assert "holds a build with other settings (cluster_threshold)" in capsys.readouterr().err


def test_a_failing_row_is_reported_and_the_rest_written(inputs, monkeypatch, capsys):
    from crystal_grpo.rewards import references as chains  # where the build reads build_chain when it runs

    real = chains.build_chain

    def fail_on_r3(scorer, trajectories, threshold, min_support=2):
        if any("Bo has 9 pens." in t.steps for t in trajectories):
            raise RuntimeError("encoder fell over")
        return real(scorer, trajectories, threshold, min_support)

    monkeypatch.setattr(chains, "build_chain", fail_on_r3)
    assert run(inputs, "--keep_incorrect") == 1
    assert [r["id"] for r in read_jsonl(inputs["out"])] == ["r1", "r2"]
    assert summary(inputs["out"])["failed"] == ["r3: RuntimeError: encoder fell over"]
    assert "1 row(s) failed: r3: RuntimeError: encoder fell over" in capsys.readouterr().out
    monkeypatch.setattr(chains, "build_chain", real)
    assert run(inputs, "--keep_incorrect") == 0  # the rerun builds only what is missing
    assert [r["id"] for r in read_jsonl(inputs["out"])] == ["r1", "r2", "r3"]


def test_bad_input_is_one_line(inputs, tmp_path, capsys):
    assert br.main(["--data", str(inputs["data"]), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "nothing to build from" in capsys.readouterr().err
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "r1", "answer": "7"}])
    assert br.main(["--data", str(bad), "--out", str(tmp_path / "y.jsonl"), "--trajectories", str(inputs["a"])]) == 2
    assert "bad.jsonl:1: missing or empty 'question'" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "r1", "reasoning_steps": ["x"], "answer": "7"}\n{"id": \n')
    assert (
        br.main(["--data", str(inputs["data"]), "--out", str(tmp_path / "z.jsonl"), "--trajectories", str(broken)])
        == 2
    )
    assert "broken.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert (
        br.main(
            [
                "--data",
                str(inputs["data"]),
                "--out",
                str(tmp_path / "w.jsonl"),
                "--generator",
                "m",
                "--samples",
                "2",
                "--temperature",
                "0",
            ]
        )
        == 2
    )
    assert "greedy decoding gives identical solutions" in capsys.readouterr().err


@pytest.mark.parametrize("same", ["data", "a"])
def test_out_naming_an_input_file_is_refused_and_the_file_left_as_it_is(inputs, capsys, same):
    """--out = --data said "0 rows built, 8 already written" and exited 0."""
    before = inputs[same].read_bytes()
    assert run(inputs, out=inputs[same]) == 2
    flag = {"data": "--data", "a": "--trajectories"}[same]
    assert capsys.readouterr().err.strip() == (
        f"error: --out {inputs[same]} is also the {flag} file: the build "
        "appends its rows to --out; choose another --out"
    )
    assert inputs[same].read_bytes() == before


def test_sampling_outside_its_range_is_one_line(inputs, tmp_path, capsys):
    """--temperature -1 ran greedy while the report said -1."""
    args = ["--data", str(inputs["data"]), "--out", str(tmp_path / "x.jsonl"), "--generator", "m"]
    for flag, value, expected in (
        ("--temperature", "-1", "expected a number >= 0 (0: greedy decoding)"),
        ("--top_p", "1.5", "expected a number in (0, 1]"),
    ):
        assert br.main([*args, "--samples", "1", flag, value]) == 2
        assert capsys.readouterr().err.strip() == f"error: {flag} {float(value)}: {expected}"


def test_a_failed_start_does_not_block_the_retry(inputs, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "refs.jsonl"
    assert br.main(["--data", str(empty), "--out", str(out), "--trajectories", str(inputs["a"])]) == 2
    assert f"{empty}: an empty file (0 bytes), no rows" in capsys.readouterr().err
    assert br.main(["--data", str(inputs["data"]), "--out", str(out), "--trajectories", str(inputs["a"])]) == 0
    assert out.is_file()


def test_a_model_generator_with_the_training_prompt_resumes_its_generation(inputs, tiny_lm_path, tmp_path):
    """The tiny random model writes no JSON, so its solutions never count; the files' do. Its
    completions are kept, and a rerun does not generate them again."""
    out = tmp_path / "model.jsonl"
    args = ["--generator", str(tiny_lm_path), "--samples", "2", "--max_new_tokens", "8", "--batch_size", "2"]
    assert run(inputs, *args, out=out) == 0
    predictions = next((tmp_path / "model.work").glob("tiny-qwen2-*")) / "predictions.jsonl"
    lines = read_jsonl(predictions)
    assert sorted((r["id"], r["sample"]) for r in lines) == [(i, k) for i in ("r1", "r3", "r4") for k in (0, 1)]
    assert all(isinstance(r["completion"], str) for r in lines)
    row = read_jsonl(out)[0]
    assert row["id"] == "r1" and row["reference_steps"] == [STEP1, STEP2]
    assert row["reference_build"]["generators"][0] == str(tiny_lm_path)
    assert row["reference_build"]["trajectories"] == 5 and row["reference_build"]["accepted"] == 2
    before = predictions.read_bytes()
    out.unlink()  # build every row again: the completions are reused
    assert run(inputs, *args, out=out) == 0
    assert predictions.read_bytes() == before
    assert [r["id"] for r in read_jsonl(out)] == ["r1", "r2"]


def test_the_shipped_threshold_keeps_different_reference_steps_of_the_shipped_data_apart(capsys):
    """--measure_threshold on shipped rows: 99% of the pairs of different reference steps of one
    row stay below MiniLM's default, which is what the default was chosen by."""
    from crystal_grpo.rewards.references import default_threshold

    m = br.measure_threshold("data/demo/val.jsonl", br.PACKAGED_MINILM, "cpu")
    assert (m["rows"], m["pairs"]) == (19, 158)  # the 19 rows with two or more steps
    assert m["p50"] < m["p90"] < m["p99"] <= m["max"] < 1
    assert m["suggested"] <= default_threshold(br.PACKAGED_MINILM) == m["default"]
    assert br.main(["--data", "data/demo/val.jsonl", "--measure_threshold", "--device", "cpu"]) == 0
    assert f"suggested --cluster_threshold {m['suggested']:.2f}" in capsys.readouterr().out
