"""Benchmark the batched Match-F1 scorer against a per-example loop (one table, one run).

    python scripts/bench_scorer.py [--encoder packaged:all-MiniLM-L6-v2] [--device cpu]
                                   [--sizes 64,256,1024] [--repeats 3]

Synthetic GRPO batches (8 completions a prompt that repeat steps, as a policy's do), seeded.
Columns: (a) a per-example loop, (b) the batched scorer with a cold cache, (c) cached, (d) one
``encode`` of the unique texts (the floor), (e) Python greedy matching alone, (f)/(g) (b)/(c)
with ``step_gate="facts"``. The workload and the results: docs/benchmarks.md, "Match-F1 scorer".
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from crystal_grpo.rewards.encoder import PACKAGED_MINILM, load_encoder
from crystal_grpo.rewards.facts import step_facts

GEN_PER_PROMPT, N_REF, POOL = 8, 12, 20
NAMES = ["Sam", "Ana", "Li", "Omar", "Mia", "Raj", "Zoe", "Ben", "Ivy", "Tom", "Eva", "Kai"]
ITEMS = [
    "apples",
    "pencils",
    "marbles",
    "stickers",
    "cookies",
    "books",
    "coins",
    "shells",
    "cards",
    "eggs",
    "stamps",
    "beads",
]
# (symbol, action in the reference wording, action in the paraphrase wording)
OPS = [
    ("+", "buys {b} more", "gets another {b}"),
    ("-", "gives {b} away", "hands over {b}"),
    ("*", "multiplies the pile by {b}", "makes the pile {b} times bigger"),
    ("+", "finds {b} more", "picks up {b} extra"),
    ("-", "loses {b}", "drops {b}"),
]
GENERIC = [
    "Let me think about this step by step.",
    "First, read the question carefully.",
    "I should double-check the arithmetic.",
]
OFF_TOPIC = [
    "{n} likes the colour {c}.",
    "The weather was {w} that day, said {n}.",
    "{n} walked to school with a friend.",
    "Rivers flow toward the sea near {n}'s town.",
]


def make_prompt(rng: random.Random, p: int) -> tuple[list[str], list[str]]:
    """One prompt: its 12 reference steps and its pool of 20 candidate completion steps."""
    name, item = NAMES[p % len(NAMES)], ITEMS[(p // len(NAMES)) % len(ITEMS)]
    x = rng.randint(10, 60) + p  # p makes every prompt's numbers (hence texts) distinct
    refs, paras = [f"{name} starts with {x} {item}."], [f"At first {name} has {x} {item}."]
    for _ in range(N_REF - 1):
        sym, act, alt = rng.choice(OPS)
        b = rng.randint(2, 4) if sym == "*" else rng.randint(1, 9)
        y = {"+": x + b, "-": x - b, "*": x * b}[sym]
        refs.append(f"{name} {act.format(b=b)}, so {x} {sym} {b} = {y} {item} remain.")
        paras.append(f"After {name} {alt.format(b=b)}, there are {x} {sym} {b} = {y} {item}.")
        x = y
    ident = sorted(rng.sample(range(N_REF), 5))
    para = sorted(rng.sample(range(N_REF), 9))  # may paraphrase a step also present verbatim
    c, w = rng.choice(["red", "blue", "green", "grey"]), rng.choice(["sunny", "windy", "rainy"])
    own = [t.format(n=name, c=c, w=w) for t in rng.sample(OFF_TOPIC, 3)]
    pool = [refs[k] for k in ident] + [paras[k] for k in para] + GENERIC + own
    # Sort key = position in the chain (off-topic steps go anywhere).
    keys = ident + para + [rng.uniform(0, N_REF) for _ in range(6)]
    return refs, [t for _, t in sorted(zip(keys, pool))]


def make_batch(n: int, seed: int = 0) -> tuple[list[list[str]], list[list[str]]]:
    rng = random.Random(seed)
    preds, refs = [], []
    for p in range(-(-n // GEN_PER_PROMPT)):
        ref, pool = make_prompt(rng, p)
        for _ in range(GEN_PER_PROMPT):
            picked = sorted(rng.sample(range(POOL), rng.randint(8, 12)))
            if rng.random() < 0.3:  # some completions swap two steps
                i, j = rng.sample(range(len(picked)), 2)
                picked[i], picked[j] = picked[j], picked[i]
            preds.append([pool[i] for i in picked])
            refs.append(ref)
    return preds[:n], refs[:n]


def plain_greedy_f1(S: list[list[float]], tau: float) -> float:
    """Per-example reference: docs/method.md section 3 greedy matching and F1, pure Python."""
    cands = sorted((-s, j, k) for j, row in enumerate(S) for k, s in enumerate(row) if s >= tau)
    used_j, used_k = set(), set()
    for _, j, k in cands:
        if j not in used_j and k not in used_k:
            used_j.add(j)
            used_k.add(k)
    n, m, tp = len(S), len(S[0]) if S else 0, len(used_j)
    if n == 0 and m == 0:
        return 1.0
    if tp == 0:
        return 0.0
    p, r = tp / n, tp / m
    return 2 * p * r / (p + r)


def best_of(fn, repeats: int, before=None) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def best_of_alternating(runs, repeats: int) -> list[tuple[float, object]]:
    """:func:`best_of` for several ``(fn, before)``, taking turns within each repeat."""
    best = [(float("inf"), None)] * len(runs)
    for _ in range(repeats):
        for i, (fn, before) in enumerate(runs):
            t, out = best_of(fn, 1, before)
            best[i] = (min(best[i][0], t), out)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", default=PACKAGED_MINILM)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="64,256,1024", help="comma-separated completion counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=0.35)
    args = ap.parse_args(argv)
    import torch  # after the arguments: --help answers at once

    from crystal_grpo.rewards.match_f1 import MatchF1Scorer

    sizes = [int(s) for s in args.sizes.split(",")]
    tau, dev = args.threshold, args.device

    model = load_encoder(args.encoder, dev)
    scorer = MatchF1Scorer(model, threshold=tau, device=dev, cache_size=1_000_000)
    model = scorer.model  # the very same object (the scorer may have cast it to fp16 on CUDA)
    gated = MatchF1Scorer(model, threshold=tau, device=dev, cache_size=1_000_000, step_gate="facts")
    sync = torch.cuda.synchronize if scorer.device.type == "cuda" else (lambda: None)
    enc = lambda texts: model.encode(
        texts, batch_size=scorer.batch_size, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False
    )
    enc(["Warm-up sentence about 3 apples."] * 16)
    scorer.score([["warm up"]], [["warm up"]])
    scorer._cache.clear()

    print(
        f"bench_scorer: encoder={args.encoder} device={scorer.device} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} repeats={args.repeats} ((a) once at >=1024) tau={tau}"
    )
    print(
        f"workload: {GEN_PER_PROMPT} completions/prompt sampled from one policy, so they repeat steps: "
        f"each draws 8-12 steps from a per-prompt pool of {POOL} texts (identical to a reference, "
        f"paraphrases, off-topic); {N_REF} reference steps per prompt"
    )
    head = [
        "completions",
        "unique/total texts",
        "(a) s",
        "(b) s",
        "(c) s",
        "(d) s",
        "(e) s",
        "(f) s",
        "(g) s",
        "a/b speed-up",
        "b/d ratio",
        "e/c speed-up",
        "f/b",
        "g/c",
    ]
    rows, checks = [], []
    for n in sizes:
        preds, refs = make_batch(n, seed=n)
        unique = list(dict.fromkeys(t for ex in preds + refs for t in ex))
        total = sum(map(len, preds)) + sum(map(len, refs))

        def floor():
            out = enc(unique)
            sync()
            return out

        t_d, table = best_of(floor, args.repeats)

        def cold_gated():
            gated._cache.clear()
            step_facts.cache_clear()

        # each ungated measurement and its gated twin alternate, so a change of load hits both alike
        (t_b, s_b), (t_f, s_f) = best_of_alternating(
            [(lambda: scorer.score(preds, refs), scorer._cache.clear), (lambda: gated.score(preds, refs), cold_gated)],
            args.repeats,
        )
        (t_c, _), (t_g, _) = best_of_alternating(
            [(lambda: scorer.score(preds, refs), None), (lambda: gated.score(preds, refs), None)], args.repeats
        )
        row = {t: i for i, t in enumerate(unique)}
        table = table.float().cpu()
        mats = [
            (table[[row[t] for t in p]] @ table[[row[t] for t in r]].T).tolist() if p else []
            for p, r in zip(preds, refs)
        ]
        t_e, _ = best_of(lambda: [plain_greedy_f1(S, tau) for S in mats], args.repeats)

        def loop():
            out = []
            for p, r in zip(preds, refs):
                S = (enc(p) @ enc(r).T).float().cpu().tolist() if p else []
                out.append(plain_greedy_f1(S, tau))
            return out

        t_a, f1_a = best_of(loop, 1 if n >= 1024 else args.repeats)
        diff = max(abs(a - b) for a, b in zip(f1_a, s_b.f1.tolist()))
        checks.append(f"{n}: max |F1(a) - F1(b)| = {diff:.2e}")
        checks.append(f"{n}: gated F1 mean {float(s_f.f1.mean()):.3f} vs {float(s_b.f1.mean()):.3f} ungated")
        rows.append(
            [
                str(n),
                f"{len(unique)}/{total}",
                *(f"{t:.3f}" for t in (t_a, t_b, t_c, t_d, t_e, t_f, t_g)),
                f"{t_a / t_b:.1f}x",
                f"{t_b / t_d:.2f}",
                f"{t_e / t_c:.1f}x",
                f"{t_f / t_b:.2f}",
                f"{t_g / t_c:.2f}",
            ]
        )
        print(f"  measured {n} completions", file=sys.stderr, flush=True)

    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print("per-example F1, (a) vs (b), and the gate's effect: " + "; ".join(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
