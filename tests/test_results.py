"""Per-seed results beside the docs (train/tools/results.py): the CSV holds what the tables need, the
tables and contrasts are recomputed from it, and every results block of the README and the docs is
what the committed CSV gives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from crystal_grpo.train.organism.step_diagnosis import SUMMARY
from crystal_grpo.train.tools.results import (
    DOCS,
    ResultsError,
    generated_for,
    load_experiment,
    main,
    read_csv,
    render,
    tables,
    write_csv,
)

REPO = Path(__file__).resolve().parents[1]

EXPERIMENT = """
sweeps: []
axis: r
values: ["1", "0.8"]
methods: {a: method A, b: method B}
contrasts:
  - {a: a_r1, b: b_r1, metric: holds, variant: hinted, eval: eval_greedy, test: fisher}
  - {a: a_r1, b: b_r1, metric: f1, variant: hinted, eval: eval, family: secondary}
"""


def run_rows(arm: str, seed: int, copies: float, f1: float) -> list[dict]:
    base = {k: math.nan for k in SUMMARY}
    out = []
    for ev in ("eval", "eval_greedy"):
        for variant in ("all", "hinted"):
            numbers = {**base, "n": 10.0, "accuracy": 0.9, "f1": f1, "copies_hint": copies}
            numbers["holds"] = float(copies < 0.1)
            out.append({"arm": arm, "seed": seed, "eval": ev, "variant": variant, **numbers})
    return out


@pytest.fixture
def experiment(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    rows = []
    for seed in range(1, 6):
        rows += run_rows("a_r1", seed, copies=1.0, f1=0.1 + 0.01 * seed)
        rows += run_rows("b_r1", seed, copies=0.0 if seed < 5 else 0.5, f1=0.8 + 0.01 * seed)
    rows += run_rows("a_r0.8", 1, copies=0.0, f1=0.7)
    write_csv(rows, tmp_path / "exp.csv")
    return load_experiment(path)


def test_the_csv_round_trips_and_the_tables_read_it(experiment):
    rows = read_csv(experiment.csv)
    assert len(rows) == 11 * 4 and {r["seed"] for r in rows} == {1, 2, 3, 4, 5}
    got = tables(experiment, rows)
    assert "| method A | 0/5 [0.00, 0.52] | 1/1 [0.03, 1.00] |" in got["holds"]
    assert "| method B | 4/5 [0.28, 0.99] | - |" in got["holds"]
    assert "| method B | 5 | 0.900 ± 0.000 | 0.830 ± 0.016 |" in got["metrics_r1"]
    assert "| b_r1 | 5 | 0.500 | no | 0.900 | 0.850 |" in got["seeds"] and got["seeds"].count("\n") == 2 + 11
    # Fisher 0/5 against 4/5: p = 0.048; alone in its family, so Holm leaves it
    assert (
        "| primary | eval_greedy | hinted | holds the chain | fisher | a_r1 | b_r1 | 5, 5 | 0/5 [" in got["contrasts"]
    )
    assert "| 0.048 | - | 0.048 |" in got["contrasts"]
    assert (
        "| secondary | eval | hinted | Match F1 | welch | a_r1 | b_r1 | 5, 5 | 0.130 | 0.830 | +0.700"
        in got["contrasts"]
    )


def test_a_block_is_replaced_by_its_table_and_an_unknown_one_is_an_error(experiment):
    rows = read_csv(experiment.csv)
    generated = {"exp": tables(experiment, rows)}
    text = "before\n<!-- results exp holds -->\nstale\n<!-- /results -->\nafter\n"
    new = render(text, generated)
    assert new.startswith("before\n<!-- results exp holds -->\n| reward |") and new.endswith(
        "<!-- /results -->\nafter\n"
    )
    assert "stale" not in new and render(new, generated) == new
    with pytest.raises(ResultsError, match="exp nope: no such experiment or table"):
        render("<!-- results exp nope -->\n<!-- /results -->", generated)


def test_a_contrast_naming_no_arm_of_the_experiment_is_refused(tmp_path):
    (tmp_path / "x.yaml").write_text(EXPERIMENT.replace("b: b_r1, metric: holds", "b: c_r1, metric: holds"))
    (tmp_path / "x.csv").write_text(",".join(("arm", "seed", "eval", "variant", *SUMMARY)) + "\n")
    with pytest.raises(ResultsError, match=r"contrasts\[0\]: no arm 'c_r1'"):
        generated_for(["<!-- results x holds -->\n<!-- /results -->"], tmp_path)


def test_the_docs_tables_are_what_the_committed_results_give(capsys):
    """Every results block of README.md and the docs equals its table recomputed from docs/results/."""
    assert all((REPO / p).is_file() for p in DOCS)
    assert main(["tables", "--check", "--root", str(REPO)]) == 0, capsys.readouterr().out


def test_check_fails_on_a_stale_block_and_tables_rewrites_it(experiment, tmp_path, capsys):
    root = tmp_path / "repo"
    (root / "docs" / "results").mkdir(parents=True)
    for suffix in (".yaml", ".csv"):
        (root / "docs" / "results" / f"exp{suffix}").write_bytes(experiment.path.with_suffix(suffix).read_bytes())
    stale = "# R\n<!-- results exp holds -->\n| old |\n<!-- /results -->\n"
    (root / "README.md").write_text(stale)
    assert main(["tables", "--check", "--root", str(root)]) == 1
    assert "README.md" in capsys.readouterr().out and (root / "README.md").read_text() == stale
    assert main(["tables", "--root", str(root)]) == 0
    assert "| method A | 0/5" in (root / "README.md").read_text()
    assert main(["tables", "--check", "--root", str(root)]) == 0


def test_the_figure_is_drawn_from_the_csv(experiment, tmp_path):
    from crystal_grpo.train.tools.results import figure

    path = figure(experiment, read_csv(experiment.csv), tmp_path / "holds.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
