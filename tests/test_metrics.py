"""The metric table (crystal_grpo/metrics.py) is the one list of metric names: every report,
plot and summary names only metrics in it, and adding a metric is one row."""

import json
import subprocess
import sys
import textwrap

import pytest

from crystal_grpo import metrics
from crystal_grpo.rewards import score
from crystal_grpo.rewards.base import METRICS
from crystal_grpo.train.run import plot, summary
from crystal_grpo.train.tools import eval_report, sweep_report

KNOWN = {m.name for m in metrics.TABLE}


def test_names_are_unique_and_sources_known():
    assert len(KNOWN) == len(metrics.TABLE)
    assert {m.source for m in metrics.TABLE} <= {"reward", "row", "evaluation", "training"}
    assert METRICS == metrics.names("reward")


@pytest.mark.parametrize(
    "where, used",
    [
        ("validation (RewardModule.metrics)", METRICS),
        ("evaluation report rows", eval_report.row_metrics()),
        ("sweep report: best checkpoint, evaluations", sweep_report.BEST + sweep_report.EVAL),
        (
            "sweep report: diagnostics, paired, columns",
            sweep_report.DIAGNOSTICS + sweep_report.PAIRED + sweep_report.COLUMNS,
        ),
        ("run summary columns", summary.COLUMNS),
        ("training plot panels", tuple(p.metric for p in plot.PANELS)),
        ("scorer CLI", score.METRICS),
    ],
)
def test_every_report_names_only_table_metrics(where, used):
    assert set(used) <= KNOWN, f"{where} names metrics missing from the table: {set(used) - KNOWN}"


def test_labels_come_from_the_table():
    assert [p.title for p in plot.PANELS] == ["reward", "Match F1", "accuracy", "format rate", "KL", "training loss"]
    assert metrics.spec("format_rate").heading == "Format rate" and metrics.spec("pass_at_k").heading == "pass@k"
    assert metrics.spec("format_rate").column == "format"
    with pytest.raises(KeyError, match="not in the metric table"):
        metrics.spec("f2")


def test_better_follows_the_direction():
    assert metrics.better("accuracy", 0.5, 0.4) and not metrics.better("accuracy", 0.4, 0.4)
    assert metrics.better("kl_max", 0.1, 0.2) and not metrics.better("kl_max", 0.3, 0.2)


def test_a_new_metric_is_one_row(tmp_path):
    """One row added to the table (a field evaluation keeps per completion) appears in the
    evaluation report's overall table with its label, its interval and its format, with no
    other edit: the report reads the table."""
    scored = [{"id": f"r{i}", "sample": 0, "accuracy": float(i % 2), "brevity": 0.25 * i} for i in range(4)]
    rows = [{"id": f"r{i}", "question": "q", "answer": "1"} for i in range(4)]
    code = textwrap.dedent(f"""
        import json
        from crystal_grpo import metrics
        metrics.TABLE = metrics.TABLE + (metrics.MetricSpec("brevity", "brevity", "row"),)
        from crystal_grpo.train.tools import eval_report
        rep = eval_report.build_report({rows!r}, {scored!r}, {{}}, bootstrap=50)
        print(json.dumps({{"overall": rep["overall"]["brevity"],
                           "line": [x for x in eval_report.markdown({{**rep, "data": "d", "reward": "r",
                                    "samples_per_row": 1, "sampling": {{"temperature": 0}},
                                    "bootstrap_resamples": 50}}).splitlines() if x.startswith("| Brevity")]}}))
    """)
    out = json.loads(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()[
            -1
        ]
    )
    assert out["overall"]["value"] == pytest.approx(0.375)
    assert len(out["line"]) == 1 and out["line"][0].startswith("| Brevity | 0.375 |")
