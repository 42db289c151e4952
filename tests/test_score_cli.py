"""`python -m rewards.score`: the shipped sample end to end, malformed input, duplicate ids.

One MiniLM encoder is loaded for the whole module and lent to every ``main`` call.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from crystal_grpo.rewards.encoder import PACKAGED_MINILM
from crystal_grpo.rewards.match_f1 import MatchF1Scorer
from crystal_grpo.rewards.score import build_parser, main


@pytest.fixture(scope="module")
def scorer():
    return MatchF1Scorer(PACKAGED_MINILM, device="cpu")


@pytest.fixture
def sample(repo_root):
    return repo_root / "data" / "sample_predictions.jsonl", repo_root / "data" / "sample_data.jsonl"


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD_DATA = {"id": "q1", "question": "2 + 3?", "answer": "5", "reference_steps": ["2 + 3 = 5."]}
GOOD_PRED = {"id": "q1", "reasoning_steps": ["2 + 3 = 5."], "answer": "5"}


def test_a_prediction_longer_than_the_reward_cap_is_scored_as_given(tmp_path, capsys):
    """A prediction identical to its 257-step reference scored F1 0.000 and n_pred 0 (the reward's
    cap on predicted steps); at 256 steps 1.000. An evaluation scores what it is given."""
    steps = [f"step {i}: x{i} = {i} + 1." for i in range(257)]
    data = write(tmp_path / "d.jsonl", [json.dumps({**GOOD_DATA, "reference_steps": steps})])
    preds = write(tmp_path / "p.jsonl", [json.dumps({**GOOD_PRED, "reasoning_steps": steps})])
    out = tmp_path / "r.json"
    assert main(["--predictions", str(preds), "--data", str(data), "--out", str(out), "--encoder", "exact"]) == 0
    (example,) = json.loads(out.read_text())["examples"]
    assert example["f1"] == 1.0 and example["n_pred"] == 257 and example["n_matched"] == 257


def test_an_out_that_is_a_folder_or_an_input_is_refused_before_scoring(tmp_path, capsys):
    """--out naming its own predictions file replaced them with the report; --out naming a folder
    scored, then ended in IsADirectoryError."""
    data = write(tmp_path / "d.jsonl", [json.dumps(GOOD_DATA)])
    preds = write(tmp_path / "p.jsonl", [json.dumps(GOOD_PRED)])
    kept = preds.read_text()
    for out, said in (
        (preds, f"--out {preds} is an input of this scoring, which the report would replace; choose another --out"),
        (tmp_path, f"--out {tmp_path}: a folder; the report is one JSON file"),
    ):
        assert main(["--predictions", str(preds), "--data", str(data), "--out", str(out), "--encoder", "exact"]) == 2
        out_, err = capsys.readouterr()
        assert f"error: {said}\n" in err and out_ == ""
    assert preds.read_text() == kept
    assert main(["--predictions", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "r.json")]) == 2
    assert f"error: {tmp_path}: a folder, not a file\n" in capsys.readouterr().err


def test_sample_report(scorer, sample, tmp_path, capsys):
    preds, data = sample
    out = tmp_path / "sub" / "report.json"
    assert (
        main(["--predictions", str(preds), "--data", str(data), "--out", str(out), "--device", "cpu"], scorer=scorer)
        == 0
    )
    printed = capsys.readouterr()
    table = printed.out.splitlines()
    assert table[0].split() == [
        "subset",
        "precision",
        "recall",
        "match_f1",
        "lis_ratio",
        "ordered_f1",
        "pred_steps",
        "n",
    ]
    assert [line.split()[0] for line in table[2:5]] == ["all", "MathWord", "ScienceQA"]
    assert table[2].split()[-1] == "11"
    assert "1 example(s)" in printed.err and "math-007" in printed.err
    assert "1 prediction(s)" in printed.err and "sci-999" in printed.err

    report = json.loads(out.read_text())
    assert report["missing_predictions"] == ["math-007"]
    assert report["unknown_predictions"] == ["sci-999"]
    assert set(report["per_source"]) == {"MathWord", "ScienceQA"}
    assert report["per_source"]["MathWord"]["n"] + report["per_source"]["ScienceQA"]["n"] == 11
    assert report["settings"] == {
        "predictions": str(preds),
        "data": str(data),
        "encoder": PACKAGED_MINILM,
        "encoder_preloaded": True,
        "threshold": 0.35,
        "alpha": 0.3,
        "matcher": "greedy",
        "step_gate": "none",
        "device": "cpu",
    }
    ex = {e["id"]: e for e in report["examples"]}
    assert len(ex) == 11 and "math-007" not in ex and "sci-999" not in ex
    overall = report["overall"]
    assert overall["f1"] == pytest.approx(sum(e["f1"] for e in ex.values()) / 11)
    assert overall["mean_pred_steps"] == pytest.approx(sum(e["n_pred"] for e in ex.values()) / 11)
    keys = {
        "id",
        "source",
        "precision",
        "recall",
        "f1",
        "lis_ratio",
        "ordered_f1",
        "n_pred",
        "n_ref",
        "n_matched",
        "pairs",
        "best_reference",
    }
    assert all(set(e) == keys for e in ex.values())
    # No steps -> F1 0; identical steps -> F1 1; reversed order -> LIS ratio below 1.
    assert ex["math-006"]["n_pred"] == 0 and ex["math-006"]["f1"] == 0.0 and ex["math-006"]["pairs"] == []
    assert ex["sci-005"]["f1"] == 1.0 and ex["sci-005"]["pairs"] == [[0, 0], [1, 1], [2, 2]]
    assert ex["math-005"]["f1"] == 1.0 and ex["math-005"]["lis_ratio"] < 1.0
    assert ex["math-005"]["ordered_f1"] < ex["math-005"]["f1"]
    # The alternative chain in reference_sets wins for math-004 (index 1; 0 is reference_steps).
    assert ex["math-004"]["best_reference"] == 1 and ex["math-004"]["n_ref"] == 2
    assert 0 < ex["math-002"]["f1"] < 1


def test_malformed_rows_exit_2_with_file_and_line(scorer, tmp_path, capsys):
    preds = write(
        tmp_path / "p.jsonl",
        [
            json.dumps(GOOD_PRED),
            '{"id": "q2", "reasoning_steps": ["a", ',  # line 2: invalid JSON
            json.dumps({"id": "q3", "answer": "1"}),  # line 3: no reasoning_steps
            "",
            json.dumps({"id": "q4", "reasoning_steps": ["ok", 7], "answer": "1"}),  # line 5: non-string
            json.dumps(["not", "an", "object"]),  # line 6
        ],
    )
    data = write(tmp_path / "d.jsonl", [json.dumps(GOOD_DATA), json.dumps({"id": "q2", "question": "?"})])
    out = tmp_path / "report.json"
    assert main(["--predictions", str(preds), "--data", str(data), "--out", str(out)], scorer=scorer) == 2
    err = capsys.readouterr().err
    assert f"{preds}:2: invalid JSON" in err
    assert f"{preds}:3: id 'q3': missing field 'reasoning_steps'" in err
    assert f"{preds}:5: id 'q4': 'reasoning_steps' must be a list of strings" in err
    assert f"{preds}:6: expected a JSON object" in err
    assert f"{data}:2: id 'q2': missing field 'answer'" in err
    assert f"{preds}:1:" not in err and f"{data}:1:" not in err
    assert "5 problem(s) in the input; nothing scored" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "preds, data, message",
    [
        ([], [GOOD_DATA], "p.jsonl holds no rows; nothing scored"),
        ([GOOD_PRED], [], "d.jsonl holds no rows; nothing scored"),
        ([{**GOOD_PRED, "id": "other"}], [GOOD_DATA], "no prediction id of"),
    ],
    ids=["no_predictions", "no_data", "no_shared_ids"],
)
def test_nothing_to_score_is_one_line(scorer, tmp_path, capsys, preds, data, message):
    p, d = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    write(p, [json.dumps(x) for x in preds])
    write(d, [json.dumps(x) for x in data])
    assert main(["--predictions", str(p), "--data", str(d), "--out", str(tmp_path / "r.json")], scorer=scorer) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "AssertionError" not in err


def test_at_most_20_errors_are_listed(scorer, tmp_path, capsys):
    preds = write(tmp_path / "p.jsonl", ["{bad"] * 25)
    data = write(tmp_path / "d.jsonl", [json.dumps(GOOD_DATA)])
    assert (
        main(["--predictions", str(preds), "--data", str(data), "--out", str(tmp_path / "r.json")], scorer=scorer) == 2
    )
    err = capsys.readouterr().err
    assert f"{preds}:20:" in err and f"{preds}:21:" not in err and "and 5 more" in err


@pytest.mark.parametrize("which", ["predictions", "data"])
def test_duplicate_ids_name_file_and_line(scorer, tmp_path, capsys, which):
    rows = {"predictions": [GOOD_PRED], "data": [GOOD_DATA]}
    rows[which] = rows[which] * 2
    preds = write(tmp_path / "p.jsonl", [json.dumps(r) for r in rows["predictions"]])
    data = write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows["data"]])
    assert (
        main(["--predictions", str(preds), "--data", str(data), "--out", str(tmp_path / "r.json")], scorer=scorer) == 2
    )
    path = preds if which == "predictions" else data
    assert f"{path}:2: duplicate id 'q1' (first on line 1)" in capsys.readouterr().err


def test_encoder_load_failure_exits_2(tmp_path, capsys):
    preds = write(tmp_path / "p.jsonl", [json.dumps(GOOD_PRED)])
    data = write(tmp_path / "d.jsonl", [json.dumps(GOOD_DATA)])
    argv = [
        "--predictions",
        str(preds),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "r.json"),
        "--encoder",
        str(tmp_path / "no-such-model"),
        "--device",
        "cpu",
    ]
    assert main(argv) == 2
    assert "could not load sentence encoder" in capsys.readouterr().err


@pytest.mark.slow
def test_lone_surrogates_in_every_text_field_are_scored(repo_root, tmp_path):
    """The real command line, in its own process: surrogates reach the tokenizer, stdout and the report."""
    preds = write(
        tmp_path / "p.jsonl",
        [
            '{"id": "q1", "reasoning_steps": ["2 + 3 = 5.", "\\ud800"], "answer": "\\ud83d 5"}',
            '{"id": "q\\udfff", "reasoning_steps": ["a \\ud83d b"], "answer": null}',
        ],
    )
    data = write(
        tmp_path / "d.jsonl",
        [
            '{"id": "q1", "question": "2 + 3?", "answer": "5", "reference_steps": ["2 + 3 = 5.", "\\udfff"],'
            ' "source": "Math\\ud800"}',
            '{"id": "q\\udfff", "question": "?", "answer": "x", "reference_steps": ["a b"], "source": "Other"}',
            '{"id": "q3", "question": "?", "answer": "x", "reference_steps": ["\\ud800"]}',
        ],
    )
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crystal_grpo.rewards.score",
            "--predictions",
            str(preds),
            "--data",
            str(data),
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
        cwd=repo_root,
        capture_output=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8"},
    )
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    ex = {e["id"]: e for e in report["examples"]}
    assert set(ex) == {"q1", "q\udfff"} and report["missing_predictions"] == ["q3"]
    assert ex["q1"]["f1"] == 1.0 and ex["q1"]["source"] == "Math\ud800"  # "\ud800" twice: same text
    assert all(math.isfinite(e[k]) for e in ex.values() for k in ("f1", "ordered_f1", "precision", "recall"))
    assert "Math\ufffd".encode() in proc.stdout


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_data_answer_is_a_bad_row(scorer, tmp_path, capsys, literal):
    data = write(
        tmp_path / "d.jsonl",
        [
            json.dumps(GOOD_DATA),
            '{"id": "q2", "question": "?", "answer": ' + literal + ', "reference_steps": ["a"]}',
        ],
    )
    preds = write(tmp_path / "p.jsonl", [json.dumps(GOOD_PRED)])
    out = tmp_path / "r.json"
    assert main(["--predictions", str(preds), "--data", str(data), "--out", str(out)], scorer=scorer) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: id 'q2': 'answer' must be a string or a finite number" in err
    assert "1 problem(s)" in err and not out.exists()


def test_unreadable_json_lines_are_bad_rows_not_crashes(scorer, tmp_path, capsys):
    preds = write(
        tmp_path / "p.jsonl",
        [
            json.dumps(GOOD_PRED),
            '{"id": "q2", "reasoning_steps": [], "answer": ' + "9" * 5000 + "}",  # over int()'s digit limit
            "[" * 100_000 + "]" * 100_000,  # deeper than the recursion limit
            '{"id": "q4", "reasoning_steps": [], "answer": NaN}',
        ],
    )
    data = write(tmp_path / "d.jsonl", [json.dumps(GOOD_DATA)])
    assert (
        main(["--predictions", str(preds), "--data", str(data), "--out", str(tmp_path / "r.json")], scorer=scorer) == 2
    )
    err = capsys.readouterr().err
    assert f"{preds}:2: unreadable JSON (ValueError" in err
    assert f"{preds}:3: unreadable JSON (RecursionError" in err
    assert f"{preds}:4: id 'q4': 'answer' must be a string, a finite number or null" in err


def test_every_option_has_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no line breaks inside a help text
    parser = build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} == {
        "predictions",
        "data",
        "out",
        "encoder",
        "threshold",
        "alpha",
        "matcher",
        "step_gate",
        "device",
    }
    for action in options:
        assert action.help and len(action.help) > 15, action.dest
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for action in options:
        assert " ".join(action.help.split()) in shown, action.dest
