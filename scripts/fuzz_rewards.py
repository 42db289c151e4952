"""Fuzz every reward module with hostile completions and print what happened.

    python scripts/fuzz_rewards.py                 # 100,000 completions, seed 0, batches of 16
    python scripts/fuzz_rewards.py --n 2000 --seed 3 --batch 8

Each reward (format, answer_only, composite, cpr) is called the way TRL calls it on completions
drawn by ``rewards.fuzz``; the table counts completions, crashes, non-finite rewards, the slowest
call with its shape and the mean time per completion. Exit code 1 when anything crashed or was
non-finite. Results: docs/rewards.md, "Hostile model output".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from crystal_grpo.rewards import build_reward
from crystal_grpo.rewards.encoder import PACKAGED_MINILM
from crystal_grpo.rewards.fuzz import format_table, fuzz


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000, help="completions to generate (default 100,000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the generator (default 0)")
    p.add_argument("--batch", type=int, default=16, help="completions per reward call (default 16)")
    p.add_argument("--encoder", default=PACKAGED_MINILM, help=f"sentence encoder (default {PACKAGED_MINILM!r})")
    p.add_argument("--device", default="cpu", help="encoder device (default cpu)")
    args = p.parse_args(argv)
    modules = {
        name: build_reward(name, encoder=args.encoder, device=args.device)
        for name in ("format", "answer_only", "composite", "cpr")
    }
    start = time.perf_counter()
    step = max(args.n // 20, 1)

    def progress(done: int) -> None:
        if done % step < args.batch:
            print(
                f"  {done:,} / {args.n:,} completions, {time.perf_counter() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    stats = fuzz(modules, args.n, seed=args.seed, batch=args.batch, progress=progress)
    wall = time.perf_counter() - start
    print(format_table(stats))
    print(
        f"\n{args.n:,} completions x {len(modules)} rewards, seed {args.seed}, batch {args.batch}, "
        f"device {args.device}: {wall:.0f} s wall"
    )
    failed = False
    for s in stats.values():
        if s.first_error:
            print(f"first failure in {s.name}: {s.first_error}")
        failed = failed or bool(s.crashes or s.non_finite)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
