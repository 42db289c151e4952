"""Is the step encoder blind to wrong numbers? Measured on the model organism's sentence wording.

    python scripts/measure_step_gate.py [--encoder packaged:all-MiniLM-L6-v2] [--pairs 2000] [--chains 2000]

Two tables (docs/rewards.md, "The step gate"): pairs, a right step against the same step with
one part changed and against another step of its chain (the encoder's cosines, and what would
match with and without ``step_gate: facts``); chains, the organism's slipped demonstrations
against the clean reference chain, scored exact, by the encoder and gated, in both wordings.
Everything is drawn from seeds, so a run prints the same numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace

from crystal_grpo.rewards.encoder import EXACT, PACKAGED_MINILM
from crystal_grpo.train.organism.task import NAMES, OP_WORDS, TaskSpec, make_split, step_text

KINDS = ("result", "input", "operand", "operator", "other step")


def changed_pairs(n: int, seed: int, modulus: int = 10) -> dict[str, list[tuple[str, str]]]:
    """``n`` (right step, changed step) pairs of each kind in :data:`KINDS`, sentence wording."""
    rng = random.Random(seed)
    out: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    other = lambda v: (v + rng.randrange(1, modulus)) % modulus  # any other value
    for _ in range(n):
        i, a, op, b = rng.randrange(1, 6), rng.randrange(modulus), rng.choice("+-"), rng.randint(1, 3)
        r = (a + b if op == "+" else a - b) % modulus
        say = lambda *x: step_text(NAMES[x[0]], x[1], x[2], x[3], x[4], "sentence")
        right = say(i, a, op, b, r)
        flip = "-" if op == "+" else "+"
        out["result"].append((right, say(i, a, op, b, other(r))))
        out["input"].append((right, say(i, other(a), op, b, r)))
        out["operand"].append((right, say(i, a, op, rng.choice([x for x in (1, 2, 3) if x != b]), r)))
        out["operator"].append((right, say(i, a, flip, b, r)))
        c = rng.randint(1, 3)
        out["other step"].append((right, say(i + 1, r, rng.choice("+-"), c, rng.randrange(modulus))))
    return out


def quantiles(values: list[float], qs=(0.0, 0.05, 0.5, 0.95, 1.0)) -> list[float]:
    s = sorted(values)
    return [s[min(len(s) - 1, round(q * (len(s) - 1)))] for q in qs]


def pair_table(scorers: dict, pairs: dict[str, list[tuple[str, str]]]) -> list[dict]:
    """Per kind: the encoder's cosine quantiles and the share of pairs each scorer matches
    (F1 of the one-step pair is 1 exactly when the pair matches)."""
    encoder = next(s for s in scorers.values() if not s.exact)
    rows = []
    for kind, ps in pairs.items():
        texts = list(dict.fromkeys(t for p in ps for t in p))
        emb = encoder.embed(texts)
        at = {t: i for i, t in enumerate(texts)}
        cos = [float(emb[at[a]] @ emb[at[b]]) for a, b in ps]
        row = {"kind": kind, "pairs": len(ps), "cosine min/p5/median/p95/max": quantiles(cos)}
        for name, s in scorers.items():
            row[f"matched: {name}"] = float(s.score([[b] for _, b in ps], [[a] for a, _ in ps]).f1.mean())
        rows.append(row)
    return rows


def chain_table(scorers: dict, n: int, seed: int) -> list[dict]:
    """Match F1 of slipped demonstrations against the clean chains, per scorer and subset."""
    spec = TaskSpec(wording="sentence", error_rate=0.3)
    truth = make_split(replace(spec, error_rate=0.0), n, seed, "train", "chk")
    demos = make_split(spec, n, seed, "train", "chk", demonstrate=True)
    equation = make_split(replace(spec, wording="equation"), n, seed, "train", "chk", demonstrate=True)
    refs = [r["reference_steps"] for r in truth]
    slipped = [bool(d.get("slips")) for d in demos]
    exact = scorers[EXACT].score([d["reference_steps"] for d in demos], refs).f1.tolist()
    rows = []
    for label, preds in (("sentence", demos), ("equation vs sentence refs", equation)):
        for name, s in scorers.items():
            f1 = s.score([d["reference_steps"] for d in preds], refs).f1.tolist()
            pick = lambda want: [f for f, sl in zip(f1, slipped) if sl == want]
            rows.append(
                {
                    "predictions": label,
                    "scorer": name,
                    "all": sum(f1) / len(f1),
                    "slipped chains": sum(pick(True)) / max(1, len(pick(True))),
                    "clean chains": sum(pick(False)) / max(1, len(pick(False))),
                    "n slipped/clean": f"{sum(slipped)}/{len(slipped) - sum(slipped)}",
                    "chains unlike exact (sentence)": sum(a != b for a, b in zip(f1, exact)),
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    fmt = lambda v: (
        " / ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else f"{v:.3f}" if isinstance(v, float) else str(v)
    )
    head = list(rows[0])
    body = [[fmt(r[k]) for k in head] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    for line in [head, ["-" * w for w in widths], *body]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", default=PACKAGED_MINILM)
    ap.add_argument("--threshold", type=float, default=0.35)
    ap.add_argument("--pairs", type=int, default=2000, help="pairs of each kind")
    ap.add_argument("--chains", type=int, default=2000, help="demonstration chains")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the tables here")
    a = ap.parse_args(argv)
    from crystal_grpo.rewards.match_f1 import MatchF1Scorer  # after the arguments: --help answers at once

    encoder = MatchF1Scorer(a.encoder, threshold=a.threshold, device=a.device)
    scorers = {
        EXACT: MatchF1Scorer(EXACT, device=a.device),
        "encoder": encoder,
        "encoder + facts gate": MatchF1Scorer(
            encoder.model, threshold=a.threshold, device=a.device, step_gate="facts"
        ),
    }
    print(
        f"encoder {a.encoder}, tau {a.threshold}, seed {a.seed}; organism steps, sentence wording "
        f"(ops {', '.join(OP_WORDS.values())})\n"
    )
    pairs = pair_table(scorers, changed_pairs(a.pairs, a.seed))
    print_table(pairs)
    chains = chain_table(scorers, a.chains, a.seed)
    print_table(chains)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"pairs": pairs, "chains": chains, "settings": vars(a)}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
