"""The alignment viewer (rewards/alignment_view.py): its rows are the scorer's own pairs and the
reward's own components, model strings stay text, the page renders and filters in a real headless
browser (Debian's chromium), and the rows reach an offline wandb run as a Table."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.alignment_view import (
    alignment_lines,
    alignment_rows,
    group_advantages,
    log_wandb,
    render_page,
    summarize,
    thumbnail,
    wandb_table,
)

from runs import REPO, env, grpo_cmd

REF = ["Add 2 and 3 to get 5.", "Multiply 5 by 4 to get 20."]
ATTACK = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
ROWS = [
    {"id": "a", "answer": "20", "reference_steps": REF, "source": "gsm8k", "question": "What is (2+3)*4?"},
    {"id": "a", "answer": "20", "reference_steps": REF, "source": "gsm8k", "question": "What is (2+3)*4?"},
    {
        "id": "b",
        "answer": "7",
        "reference_steps": ["Take 3 from 10 to get 7."],
        "source": "shapes",
        "question": "10-3?",
    },
]


def completion(steps: list[str], answer: str) -> str:
    return json.dumps({"reasoning_steps": steps, "answer": answer})


COMPLETIONS = [
    completion(["Multiply 5 by 4 to get 20.", "Note: " + ATTACK, "Add 2 and 3 to get 5."], "20"),
    completion(["Guess."], "21"),
    ATTACK,  # not the JSON format at all
]


@pytest.fixture(scope="module")
def view():
    module = build_reward("cpr", encoder="exact")  # string identity: no model loads
    scored = module.score(COMPLETIONS, ROWS, with_steps=True)
    return module, scored, alignment_rows(module, scored, ROWS, COMPLETIONS, samples=[0, 1, 0])


def test_rows_hold_the_scorers_pairs_and_the_rewards_components(view):
    module, scored, rows = view
    first, second, third = rows
    assert [(p.pred, p.ref, p.similarity) for p in first.pairs] == [(2, 0, 1.0), (0, 1, 1.0)]
    assert first.pairs == sorted(first.pairs, key=lambda p: p.ref)
    assert sorted(map(tuple, scored.steps.pairs[0].tolist())) == [(0, 1), (2, 0)]  # the same pairs
    lines = [(x.pred, x.ref) for x in alignment_lines(first)]
    assert lines == [(2, 0), (0, 1), (1, None)]  # reference order, then the unmatched predicted step
    assert [(x.pred, x.ref) for x in alignment_lines(second)] == [(None, 0), (None, 1), (0, None)]
    comps = module.checked_components(scored.batch)
    assert first.components == pytest.approx({k: float(v[0]) for k, v in comps.items()})
    assert first.reward == pytest.approx(0.65 + 0.35 * 0.8) and first.correct and first.f1 == pytest.approx(0.8)
    assert not second.correct and second.reward == 0.0 and not third.format_ok
    # GRPO's group advantage within a row's samples; none for a row sampled once.
    assert first.advantage == pytest.approx(-second.advantage) and first.advantage > 0 and third.advantage is None
    assert [s.source for s in summarize(rows)] == ["gsm8k", "shapes", "all"]


def test_group_advantage_is_trls_formula():
    adv = group_advantages([1.0, 0.0, 0.5, 2.0], ["x", "x", "x", "y"])
    std = 0.5  # unbiased std of 1, 0, 0.5
    assert adv[:3] == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0]) and adv[3] is None


def test_model_strings_are_text_not_markup(view):
    page = render_page(view[2], 0.35, "t <b>")
    assert "<script>document.title" not in page and "<img src=x" not in page
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page
    assert page.count("<script>") == 1  # the page's own filter script only


def test_with_step_credit_each_step_shows_its_score_and_term(view):
    """Step credit on: each predicted step's raw score (+1 matched, -1 otherwise) and its term, W x the
    score normalised within the samples of one id; off (the fixture's module), no credit column."""
    from crystal_grpo.rewards.step_credit import StepCreditConfig

    module = build_reward("cpr", encoder="exact", step_credit=StepCreditConfig(weight=0.5))
    scored = module.score(COMPLETIONS, ROWS)
    first, second, third = alignment_rows(module, scored, ROWS, COMPLETIONS, samples=[0, 1, 0])
    pooled = [1.0, -1.0, 1.0, -1.0]  # id a: its two samples' four steps
    mean = sum(pooled) / 4
    std = (sum((x - mean) ** 2 for x in pooled) / 3) ** 0.5  # Bessel-corrected
    term = lambda x: 0.5 * (x - mean) / (std + 1e-4)
    assert first.credit == pytest.approx([(1.0, term(1)), (-1.0, term(-1)), (1.0, term(1))])
    assert second.credit == pytest.approx([(-1.0, term(-1))])
    assert third.credit == []  # id b: no steps
    page = render_page([first], 0.35, "t")
    assert "step credit (score · term)" in page and f"+1 · {term(1):+.2f}" in page and f"-1 · {term(-1):+.2f}" in page
    assert view[2][0].credit is None and "step credit" not in render_page(view[2], 0.35, "t")


def test_thumbnail_is_a_small_png_data_uri():
    uri = thumbnail([str(next(Path("data/shapes/images").glob("*.png")))])
    assert uri.startswith("data:image/png;base64,") and len(uri) < 20_000
    assert thumbnail(None) is None and thumbnail(["missing.png"]) is None


CHROMIUM = shutil.which("chromium")


def chromium(profile: Path, *args: str) -> str:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--hide-scrollbars"]
    flags.append(f"--user-data-dir={profile}")  # nothing written to $HOME
    done = subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make setup-browser installs it)")
def test_page_renders_and_filters_in_a_headless_browser(view, tmp_path):
    """The DOM after the page's script ran: every row rendered, a filter from the URL fragment
    applied, no model string executed; and a screenshot."""
    page = tmp_path / "steps.html"
    page.write_text(render_page(view[2], 0.35, "validation at step 3"))
    dom = chromium(tmp_path / "profile", "--dump-dom", page.as_uri())
    assert 'data-ready="1"' in dom and "<title>validation at step 3</title>" in dom  # title not 'pwned'
    assert dom.count('<section class="row') == 3 and "3 of 3 completions shown" in dom
    assert "&lt;script&gt;document.title=" in dom  # shown as text
    filtered = chromium(tmp_path / "profile", "--dump-dom", page.as_uri() + "#source=gsm8k&verdict=wrong")
    assert "1 of 3 completions shown" in filtered
    sections = [s.split(">", 1)[0] for s in filtered.split("<section")[1:]]
    assert [" hidden" in s for s in sections] == [True, False, True]  # only row a #1 (gsm8k, wrong) shown
    shot = tmp_path / "shot.png"
    chromium(tmp_path / "profile", "--window-size=900,600", f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


#: An offline wandb run that logs the pickled rows ``sys.argv[1]``, in its own process: wandb.init
#: hooks sys.exit and keeps a service running, which would leak into the tests after it.
LOG_OFFLINE = """
import pickle, sys
import wandb
from crystal_grpo.rewards.alignment_view import log_wandb
rows = pickle.loads(open(sys.argv[1], "rb").read())
run = wandb.init(project="viewer", dir=sys.argv[2], mode="offline")
logged = log_wandb(rows, ["wandb"], "validation_steps")
run.finish()
print(logged, run.dir)
"""


def test_rows_are_a_wandb_table_in_an_offline_run(view, tmp_path):
    """TRL's log_completions convention: a Table logged when report_to names wandb and a run is open."""
    table = wandb_table(view[2])
    assert table.columns[-4:] == ["cpr_accuracy", "cpr_reasoning", "reward", "advantage"]
    assert table.data[0][7] == "P3-R1 (1.00); P1-R2 (1.00)"
    assert not log_wandb(view[2], ["tensorboard"], "validation_steps")
    (tmp_path / "rows.pkl").write_bytes(pickle.dumps(view[2]))
    proc = subprocess.run(
        [sys.executable, "-c", LOG_OFFLINE, str(tmp_path / "rows.pkl"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged, run_dir = proc.stdout.split()[-2:]
    assert logged == "True"
    (written,) = Path(run_dir).glob("media/table/validation_steps_*.table.json")
    logged = json.loads(written.read_text())
    assert logged["columns"] == table.columns and len(logged["data"]) == 3


def test_a_run_reporting_to_wandb_logs_each_validation_s_rows_as_a_table(tmp_path, tiny_lm_path):
    """The validation callback hands its rows to the wandb run TRL's WandbCallback opened, at every
    validation (steps 0, 1 and 2 here), in a real training run in its own process."""
    run = tmp_path / "run"
    extra = ("--training.report_to", "wandb", "--validation.eval_steps", "1", "--training.save_steps", "2")
    proc = subprocess.run(
        grpo_cmd(run, tiny_lm_path, *extra),
        cwd=REPO,
        env=env(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/validation_steps_*.table.json"))
    samples = sorted(run.glob("validation_samples_step*.jsonl"))
    assert len(tables) == len(samples) == 3
    rows = [len(f.read_text().splitlines()) for f in samples]
    assert sorted(len(json.loads(t.read_text())["data"]) for t in tables) == sorted(rows)


def test_an_evaluation_of_vlm_rows_shows_their_images(tmp_path):
    """scripts/evaluate.py on image rows (a predictions file: no model) writes steps.html with a
    thumbnail a row."""
    from crystal_grpo.train.tools.evaluate import EvalRequest, EvalSetup, evaluate

    rows = [json.loads(x) for x in Path("data/shapes/shapes.jsonl").read_text().splitlines()[:2]]
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps({"id": r["id"], "completion": ATTACK}) + "\n" for r in rows))
    setup = EvalSetup(reward_params={"encoder": "exact"})
    req = EvalRequest(data="data/shapes/shapes.jsonl", out=tmp_path / "eval", predictions=str(preds), setup=setup)
    evaluate(EvalRequest(**{**vars(req), "max_samples": 2, "bootstrap": 10}))
    page = (tmp_path / "eval" / "steps.html").read_text()
    assert page.count('<section class="row') == 2 and page.count('src="data:image/png;base64,') == 2
