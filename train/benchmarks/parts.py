"""Where a run's time goes: train/grpo.py or scripts/evaluate.py with a clock on each part.

    OMP_NUM_THREADS=1 python -m crystal_grpo.train.benchmarks.parts train --config organism.yaml --output_dir DIR ...
    OMP_NUM_THREADS=1 python -m crystal_grpo.train.benchmarks.parts evaluate --model DIR/final --data ... --out ...

The arguments are the program's own (``scripts/sweep.py SWEEP --emit commands`` prints a
point's). Each part in :data:`PROGRAMS` is a method or function wrapped for the run; time is
exclusive (a part called inside another counts once, for the inner one; generation inside
validation is its own row), in wall and process CPU seconds. ``imports`` is loading the
program and the libraries it needs before its ``main`` runs; the interpreter's own start and
exit are what the caller's clock adds (docs/benchmarks.md, "A sweep point's wall time").
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from typing import Any

#: program -> (its module, its parts: (label, module, attribute path)).
PROGRAMS = {
    "train": (
        "crystal_grpo.train.grpo",
        (
            ("start-up: config and checks", "crystal_grpo.train.grpo", "load_config"),
            ("start-up: config and checks", "crystal_grpo.train.grpo", "preflight"),
            ("start-up: config and checks", "crystal_grpo.train.grpo", "limit_prompts"),
            ("start-up: config and checks", "crystal_grpo.train.grpo", "length_warnings"),
            ("start-up: data", "crystal_grpo.train.data.splits", "load_datasets"),
            ("start-up: model", "crystal_grpo.train.models.loading", "load_policy"),
            ("start-up: trainer", "crystal_grpo.train.grpo", "make_trainer"),
            ("generation", "transformers", "GenerationMixin.generate"),
            ("rollout bookkeeping (TRL)", "trl", "GRPOTrainer._generate_and_score_completions"),
            ("reward scoring", "crystal_grpo.train.trainer.grpo_trainer", "CrystalGRPOTrainer._calculate_rewards"),
            ("forward", "trl", "GRPOTrainer._get_per_token_logps_and_entropies"),
            ("backward", "accelerate", "Accelerator.backward"),
            ("PCGrad, beyond its backward passes", "crystal_grpo.train.pcgrad.trainer", "PCGradGRPOTrainer._backward"),
            ("optimizer", "accelerate.optimizer", "AcceleratedOptimizer.step"),
            ("validation: scoring, files", "crystal_grpo.train.trainer.callbacks", "ValidationCallback.run"),
            ("checkpoints", "transformers", "Trainer._save_checkpoint"),
            ("final weights", "transformers", "Trainer.save_model"),
            ("plot", "crystal_grpo.train.trainer.callbacks", "PlotCallback.on_train_end"),
            ("training loop, the rest", "transformers", "Trainer._inner_training_loop"),
        ),
    ),
    "evaluate": (
        "crystal_grpo.train.tools.evaluate",
        (
            ("start-up: data", "crystal_grpo.train.data.splits", "load_split"),
            ("start-up: model", "crystal_grpo.train.models.loading", "load_checkpoint"),
            ("generation", "transformers", "GenerationMixin.generate"),
            ("scoring and report", "crystal_grpo.train.tools.evaluate", "score_predictions"),
            ("scoring and report", "crystal_grpo.train.tools.eval_report", "build_report"),
        ),
    ),
}


class Clock:
    """Exclusive wall and CPU time per label: time goes to the innermost part running."""

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = {}
        self.stack: list[list[Any]] = []

    def _add(self, now: tuple[float, float]) -> None:
        label, (wall, cpu) = self.stack[-1]
        entry = self.spent.setdefault(label, [0.0, 0.0, 0])
        entry[0] += now[0] - wall
        entry[1] += now[1] - cpu

    def enter(self, label: str) -> None:
        now = time.perf_counter(), time.process_time()
        if self.stack:
            self._add(now)
            if self.stack[-1][0].startswith("validation") and label == "generation":
                label = "validation: generation"
        self.stack.append([label, now])

    def leave(self) -> None:
        now = time.perf_counter(), time.process_time()
        self._add(now)
        self.spent[self.stack.pop()[0]][2] += 1
        if self.stack:
            self.stack[-1][1] = now

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(label)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, name, timed)

    def table(self) -> str:
        total = sum(w for w, _, _ in self.spent.values()), sum(c for _, c, _ in self.spent.values())
        lines = [f"{'part':<38}{'wall s':>9}{'CPU s':>9}{'CPU share':>11}{'calls':>7}"]
        for label, (wall, cpu, calls) in sorted(self.spent.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{label:<38}{wall:>9.2f}{cpu:>9.2f}{cpu / total[1]:>11.1%}{calls:>7}")
        return "\n".join(lines + [f"{'total':<38}{total[0]:>9.2f}{total[1]:>9.2f}"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in PROGRAMS:
        raise SystemExit(f"usage: python -m crystal_grpo.train.benchmarks.parts {'|'.join(PROGRAMS)} ARGS...")
    name, parts = PROGRAMS[argv[0]]
    clock = Clock()
    clock.enter("imports")
    program = importlib.import_module(name)
    for _, module, _ in parts:
        importlib.import_module(module)
    clock.leave()
    for label, module, path in parts:
        *owner, attr = path.split(".")
        holder = importlib.import_module(module)
        for part in owner:
            holder = getattr(holder, part)
        clock.wrap(holder, attr, label)
    clock.enter("other")
    try:
        code = program.main(argv[1:])
    finally:
        clock.leave()
        print("\n" + clock.table(), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
