"""See the steps: one self-contained HTML page of how each completion's steps matched the references.

A process reward is debugged by looking at which predicted step matched which reference step.
:func:`alignment_rows` reads that from the one evaluation (:meth:`RewardModule.score`: the pairs
and similarities the Match F1 scorer accepted, never a second matcher) together with the answer
verdict, each reward component, the total and the GRPO advantage within a row's samples;
:func:`render_page` writes them as one HTML file (inline CSS and JS, no server, nothing fetched)
with a per-source summary and filters; :func:`wandb_table` gives the same rows as a wandb Table.
Every model string is HTML-escaped: completions are untrusted.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crystal_grpo.rewards.batch import reference_chains
from crystal_grpo.rewards.diagnostics import total
from crystal_grpo.rewards.parsing import prompt_text
from crystal_grpo.rewards.step_credit import credit_scale, moments, scored_step_scores, step_terms

if TYPE_CHECKING:
    from crystal_grpo.rewards.base import RewardModule
    from crystal_grpo.rewards.batch import Scored

#: Longest side of an image thumbnail, in pixels (inlined as a data URI, so kept small).
THUMBNAIL = 96
#: TRL's epsilon in the group-normalised advantage ``(r - mean) / (std + eps)``.
ADVANTAGE_EPS = 1e-4


@dataclass
class StepPair:
    """One accepted match: predicted step ``pred`` and reference step ``ref`` (0-based), and their similarity."""

    pred: int
    ref: int
    similarity: float


@dataclass
class ViewRow:
    """One completion as the page shows it."""

    id: str
    sample: int
    question: str
    completion: str
    predicted: list[str]
    reference: list[str]
    pairs: list[StepPair]
    answer: str | None
    truth: str | None
    correct: bool
    format_ok: bool
    f1: float | None  # Match F1 = 2 matched / (predicted + reference steps): the "matched share"
    components: dict[str, float | None]
    reward: float
    advantage: float | None = None
    source: str = "-"
    image: str | None = None  # a data URI
    #: Each predicted step's step credit (reward.step_credit on): (raw score, its term W x normalised score).
    credit: list[tuple[float, float]] | None = None


@dataclass
class AlignmentLine:
    """One line of a completion's alignment table: a matched pair, or a step left unmatched on one side."""

    pred: int | None
    ref: int | None
    similarity: float | None = None


@dataclass
class SourceSummary:
    source: str
    n: int
    accuracy: float
    f1: float | None
    steps: float
    reward: float


# ----------------------------------------------------------------------------- the rows
def question_text(row: Mapping[str, Any]) -> str:
    """The question as the model saw it: the prompt's last user text (options included)."""
    return prompt_text(row.get("prompt") or [{}])


def thumbnail(images: Any, size: int = THUMBNAIL) -> str | None:
    """The first image (a PIL image or a path) as a small PNG data URI; None when there is none or it
    does not open (a page must never fail a run)."""
    first = images[0] if isinstance(images, (list, tuple)) and images else images
    if first is None or isinstance(first, (list, tuple)):
        return None
    try:
        from PIL import Image

        img = first.copy() if isinstance(first, Image.Image) else Image.open(first)
        img.thumbnail((size, size))
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="PNG", optimize=True)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def group_advantages(rewards: Sequence[float], groups: Sequence[Any]) -> list[float | None]:
    """GRPO's advantage of each completion within its group (the samples of one row), as TRL computes
    it by default: ``(r - mean) / (std + 1e-4)`` with the unbiased std; None for a group of one."""
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out: list[float | None] = [None] * len(rewards)
    for idx in members.values():
        if len(idx) < 2:
            continue
        vals = [rewards[i] for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + ADVANTAGE_EPS)
    return out


def alignment_rows(
    module: RewardModule,
    scored: Scored,
    rows: Sequence[Mapping[str, Any]],
    completions: Sequence[Any],
    samples: Sequence[int] | None = None,
) -> list[ViewRow]:
    """The page's rows from one evaluation of ``completions`` against their data ``rows``.

    ``rows`` carry the data columns, ``id``, and optionally ``source``, ``prompt`` or ``question``
    and ``image`` (a data URI, :func:`thumbnail`). ``samples``: each completion's sample number
    (default 0); the advantage is computed within the completions of one id.
    """
    batch = scored.batch
    comps = module.checked_components(batch)
    rewards = total(comps, len(batch)).tolist()
    comp_values = {name: values.tolist() for name, values in comps.items()}
    step_of = {row: n for n, row in enumerate(scored.step_rows)}
    samples = list(samples) if samples is not None else [0] * len(rows)
    advantages = group_advantages(rewards, [r.get("id") for r in rows])
    credit = step_credit(module, scored, rows)
    out = []
    for i, (row, text, parsed) in enumerate(zip(rows, completions, scored.parsed)):
        chains = reference_chains(row.get("reference_steps"), row.get("reference_sets")) or [[]]
        pairs, chain = [], chains[0]
        n = step_of.get(i)
        if n is not None and scored.steps is not None:
            chain = chains[int(scored.steps.best_reference[n])]
            sims = scored.steps.pair_similarity[n].tolist() if scored.steps.pair_similarity else []
            pairs = [StepPair(p, r, s) for (p, r), s in zip(scored.steps.pairs[n].tolist(), sims)]
        f1 = batch.f1[i].item()
        truth = row.get("answer")
        out.append(
            ViewRow(
                id=str(row.get("id")),
                sample=int(samples[i]),
                question=str(row.get("question") or question_text(row)),
                completion=text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str),
                predicted=[str(s) for s in parsed.steps],
                reference=list(chain),
                pairs=sorted(pairs, key=lambda p: p.ref),
                answer=parsed.answer,
                truth=None if truth is None else str(truth),
                correct=bool(batch.correct[i].item()),
                format_ok=bool(batch.format_ok[i].item()),
                f1=None if math.isnan(f1) else f1,
                components={k: _finite(v[i]) for k, v in comp_values.items()},
                reward=rewards[i],
                advantage=advantages[i],
                source=str(row.get("source") or "-"),
                image=row.get("image"),
                credit=credit[i],
            )
        )
    return out


def step_credit(module: RewardModule, scored: Scored, rows: Sequence[Mapping[str, Any]]) -> list:
    """Each completion's ``(raw score, term)`` per predicted step when the module's step credit is on
    (rewards/step_credit.py; groups: the samples of one id, scaled as ``scale_rewards: group``), else None."""
    if not module.step_credit.on:
        return [None] * len(rows)
    import torch

    raw = scored_step_scores(scored, [prompt_text(r.get("prompt") or r.get("question") or "") for r in rows])
    ids: dict[Any, int] = {}
    groups = torch.tensor([ids.setdefault(r.get("id"), len(ids)) for r in rows], dtype=torch.long)
    terms = step_terms(raw, *credit_scale(moments(raw), groups, "group"))
    w = module.step_credit.weight
    return [None if s is None else [(x, w * t) for x, t in zip(s, ts)] for s, ts in zip(raw, terms)]


def alignment_lines(row: ViewRow) -> list[AlignmentLine]:
    """The alignment table of one completion: reference steps in order, each with its matched
    predicted step or none, then the predicted steps nothing matched, in their order."""
    by_ref = {p.ref: p for p in row.pairs}
    lines = [
        AlignmentLine(by_ref[r].pred, r, by_ref[r].similarity) if r in by_ref else AlignmentLine(None, r)
        for r in range(len(row.reference))
    ]
    matched = {p.pred for p in row.pairs}
    return lines + [AlignmentLine(p, None) for p in range(len(row.predicted)) if p not in matched]


def summarize(rows: Sequence[ViewRow]) -> list[SourceSummary]:
    """Per source (then all rows): completions, accuracy, mean Match F1, steps and reward."""
    groups: dict[str, list[ViewRow]] = {}
    for r in rows:
        groups.setdefault(r.source, []).append(r)
    if len(groups) > 1:
        groups["all"] = list(rows)
    out = []
    for source, rs in groups.items():
        f1s = [r.f1 for r in rs if r.f1 is not None]
        out.append(
            SourceSummary(
                source=source,
                n=len(rs),
                accuracy=sum(r.correct for r in rs) / len(rs),
                f1=sum(f1s) / len(f1s) if f1s else None,
                steps=sum(len(r.predicted) for r in rs) / len(rs),
                reward=sum(r.reward for r in rs) / len(rs),
            )
        )
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ----------------------------------------------------------------------------- the page
def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _summary_html(rows: Sequence[ViewRow]) -> str:
    head = (
        "<tr><th>source</th><th>completions</th><th>accuracy</th><th>Match F1</th><th>steps</th><th>reward</th></tr>"
    )
    body = "".join(
        f"<tr><td>{_e(s.source)}</td><td>{s.n}</td><td>{_fmt(s.accuracy)}</td><td>{_fmt(s.f1)}</td>"
        f"<td>{_fmt(s.steps, 1)}</td><td>{_fmt(s.reward, 3)}</td></tr>"
        for s in summarize(rows)
    )
    return f'<table class="summary">{head}{body}</table>'


def _alignment_html(row: ViewRow) -> str:
    out = []
    for line in alignment_lines(row):
        pred = f"<b>P{line.pred + 1}</b> {_e(row.predicted[line.pred])}" if line.pred is not None else "—"
        ref = f"<b>R{line.ref + 1}</b> {_e(row.reference[line.ref])}" if line.ref is not None else "—"
        kind = "pair" if line.similarity is not None else ("miss" if line.pred is None else "extra")
        credit = ""
        if row.credit is not None:
            score, term = row.credit[line.pred] if line.pred is not None else (None, None)
            credit = f'<td class="credit">{"–" if score is None else f"{score:+.0f} · {term:+.2f}"}</td>'
        out.append(
            f'<tr class="{kind}"><td>{pred}</td>{credit}<td class="sim">{_fmt(line.similarity)}</td>'
            f"<td>{ref}</td></tr>"
        )
    credit = "" if row.credit is None else "<th>step credit (score · term)</th>"
    head = f"<tr><th>predicted</th>{credit}<th>similarity</th><th>reference</th></tr>"
    return f'<table class="align">{head}{"".join(out)}</table>'


def _row_html(row: ViewRow) -> str:
    verdict = "correct" if row.correct else "wrong"
    comps = " ".join(f"{_e(k)} {_fmt(v, 3)}" for k, v in row.components.items())
    adv = f" · advantage {_fmt(row.advantage)}" if row.advantage is not None else ""
    image = f'<img class="thumb" alt="image" src="{_e(row.image)}">' if row.image else ""
    share = "" if row.f1 is None else f"{row.f1:.6f}"
    return (
        f'<section class="row {verdict}" data-source="{_e(row.source)}" data-steps="{len(row.predicted)}" '
        f'data-verdict="{verdict}" data-share="{share}">'
        f'<div class="head"><b>{_e(row.id)}</b> #{row.sample} · {_e(row.source)} · '
        f'<span class="verdict">{verdict}</span> (answer {_e(row.answer if row.answer is not None else "none")}, '
        f"expected {_e(row.truth if row.truth is not None else 'none')}"
        f"{'' if row.format_ok else ', format fails'}) · Match F1 {_fmt(row.f1)} · "
        f"{len(row.pairs)}/{len(row.predicted)} predicted, {len(row.pairs)}/{len(row.reference)} reference matched"
        f'</div><div class="reward">{comps} · <b>reward {_fmt(row.reward, 3)}</b>{adv}</div>'
        f'<div class="question">{image}<span>{_e(row.question)}</span></div>'
        f"{_alignment_html(row)}"
        f"<details><summary>completion</summary><pre>{_e(row.completion)}</pre></details></section>"
    )


_CSS = """
body{font:14px system-ui,sans-serif;margin:1em;color:#222}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top}
.summary td,.summary th{text-align:right}.summary td:first-child{text-align:left}
.row{border:1px solid #bbb;border-radius:4px;margin:.6em 0;padding:.4em}
.row.correct{border-left:6px solid #2a2}.row.wrong{border-left:6px solid #c33}
.verdict{font-weight:bold}.correct .verdict{color:#2a2}.wrong .verdict{color:#c33}
.reward{color:#555}.question{margin:.3em 0;display:flex;gap:.5em}.thumb{max-width:96px;max-height:96px}
.align td{width:45%}.align td.sim,.align td.credit{width:10%;text-align:center}
tr.pair{background:#eefbe9}tr.miss{background:#fdecec}tr.extra{background:#fff7e0}
pre{white-space:pre-wrap;background:#f6f6f6;padding:.3em}#filters label{margin-right:1em}
"""

# Filters read (and write) the URL fragment, e.g. #source=gsm8k&verdict=wrong&minsteps=2&maxsteps=9&minshare=0.5
_JS = """
(function(){
const f={source:document.getElementById('f-source'),verdict:document.getElementById('f-verdict'),
 minsteps:document.getElementById('f-minsteps'),maxsteps:document.getElementById('f-maxsteps'),
 minshare:document.getElementById('f-minshare')};
const rows=Array.from(document.querySelectorAll('section.row'));
function apply(){
 const v=k=>f[k].value, num=k=>v(k)===''?null:Number(v(k));
 let shown=0;
 for(const r of rows){const d=r.dataset, steps=Number(d.steps), share=d.share===''?null:Number(d.share);
  const ok=(v('source')===''||d.source===v('source'))&&(v('verdict')===''||d.verdict===v('verdict'))
   &&(num('minsteps')===null||steps>=num('minsteps'))&&(num('maxsteps')===null||steps<=num('maxsteps'))
   &&(num('minshare')===null||(share!==null&&share>=num('minshare')));
  r.hidden=!ok; if(ok) shown++;}
 document.getElementById('shown').textContent=shown+' of '+rows.length+' completions shown';
 const q=Object.keys(f).filter(k=>v(k)!=='').map(k=>k+'='+encodeURIComponent(v(k))).join('&');
 if(location.hash.slice(1)!==q) history.replaceState(null,'',q?'#'+q:location.pathname+location.search);
}
for(const [k,val] of new URLSearchParams(location.hash.slice(1))) if(f[k]) f[k].value=val;
for(const el of Object.values(f)) el.addEventListener('input',apply);
apply(); document.body.dataset.ready='1';
})();
"""


def render_page(rows: Sequence[ViewRow], threshold: float, title: str, matcher: str = "greedy") -> str:
    """The whole page as one HTML string: summary, filters, one section per completion."""
    sources = sorted({r.source for r in rows})
    options = "".join(f'<option value="{_e(s)}">{_e(s)}</option>' for s in sources)
    filters = (
        '<div id="filters">'
        f'<label>source <select id="f-source"><option value="">all</option>{options}</select></label>'
        '<label>answer <select id="f-verdict"><option value="">all</option><option value="correct">correct</option>'
        '<option value="wrong">wrong</option></select></label>'
        '<label>steps from <input id="f-minsteps" type="number" min="0" style="width:4em"></label>'
        '<label>to <input id="f-maxsteps" type="number" min="0" style="width:4em"></label>'
        '<label>Match F1 at least <input id="f-minshare" type="number" min="0" max="1" step="0.05" style="width:5em">'
        '</label><span id="shown"></span></div>'
    )
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{_e(title)}</title><style>{_CSS}</style></head>'
        f"<body><h1>{_e(title)}</h1><p>Steps match when their similarity is at least the threshold "
        f"τ = {threshold:g} ({_e(matcher)} 1:1 matching). Green: a matched pair; red: a reference step no "
        f"predicted step matched; yellow: a predicted step that matched nothing.</p>"
        f"{_summary_html(rows)}{filters}{''.join(_row_html(r) for r in rows)}<script>{_JS}</script></body></html>"
    )


def write_page(
    path: str | Path, rows: Sequence[ViewRow], threshold: float, title: str, matcher: str = "greedy"
) -> None:
    Path(path).write_text(render_page(rows, threshold, title, matcher), encoding="utf-8")


# ----------------------------------------------------------------------------- wandb
@dataclass
class TableData:
    columns: list[str]
    data: list[list[Any]] = field(default_factory=list)


def wandb_table(rows: Sequence[ViewRow]) -> TableData:
    """The rows as a wandb Table's columns and data: one line per completion, pairs as ``P1-R2 (0.91)``."""
    comps = list(rows[0].components) if rows else []
    columns = ["id", "sample", "source", "question", "completion", "predicted_steps", "reference_steps"]
    columns += ["matched_pairs", "match_f1", "correct", "answer", "truth", *comps, "reward", "advantage"]
    data = [
        [
            r.id,
            r.sample,
            r.source,
            r.question,
            r.completion,
            "\n".join(r.predicted),
            "\n".join(r.reference),
            "; ".join(f"P{p.pred + 1}-R{p.ref + 1} ({p.similarity:.2f})" for p in r.pairs),
            r.f1,
            r.correct,
            r.answer,
            r.truth,
            *(r.components.get(c) for c in comps),
            r.reward,
            r.advantage,
        ]
        for r in rows
    ]
    return TableData(columns, data)


def log_wandb(rows: Sequence[ViewRow], report_to: Sequence[str] | str | None, key: str) -> bool:
    """Log the rows as a wandb Table under ``key`` when ``report_to`` names wandb and a run is open
    (TRL's ``log_completions`` convention); True when it logged."""
    if not report_to or "wandb" not in report_to:
        return False
    import wandb

    if wandb.run is None:
        return False
    table = wandb_table(rows)
    wandb.log({key: wandb.Table(columns=table.columns, data=table.data)})
    return True
