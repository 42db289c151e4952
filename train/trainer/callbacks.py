"""Trainer callbacks: validation with greedy generation, the metrics JSONL, the end plot."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import TrainerCallback

from crystal_grpo.distributed import even_share, gather_objects, rank_and_world
from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.metrics import better
from crystal_grpo.metrics import names as metric_names
from crystal_grpo.rewards.alignment_view import alignment_rows, log_wandb, question_text, thumbnail, write_page
from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.train.config.run_config import ValidationSection
from crystal_grpo.train.models.generation import Engine, Sampling, generate
from crystal_grpo.train.models.lora_merge import merged_adapters
from crystal_grpo.train.run.layout import (
    BEST,
    METRICS_LOG,
    VALIDATION_LOG,
    BestCheckpoint,
    checkpoint_name,
    read_best,
    samples_file,
    steps_page,
    write_best,
)

logger = logging.getLogger(__name__)


class ValidationCallback(TrainerCallback):
    """Greedy validation every ``eval_steps``; records the best checkpoint by a metric.

    The best record (``best_checkpoint.json`` in the run folder) names the checkpoint
    saved at that step; a save is requested when the metric improves, and the trainer's
    ``best_model_checkpoint`` is set so checkpoint rotation never deletes it. Generation takes
    training's path (``cache_implementation``, continuous batching: :class:`Engine`).
    """

    def __init__(self, trainer, dataset, cfg: ValidationSection, run_dir: str | Path, module: RewardModule) -> None:
        self.trainer, self.dataset, self.cfg, self.module = trainer, dataset, cfg, module
        self.run_dir = Path(run_dir)
        # A resumed run keeps the record; its log was truncated to the checkpoint's step, so a
        # best found after that step is forgotten (that checkpoint will be written again).
        self.best: BestCheckpoint | None = None
        self.last_step = -1
        rows = read_jsonl(self.run_dir / VALIDATION_LOG)
        if rows:
            self.last_step = rows[-1]["step"]
        if (self.run_dir / BEST).exists():
            self.best = read_best(self.run_dir)
            if self.best is None or self.best.step > self.last_step:
                self.best = None
                for row in rows:  # replay the record up to the resumed step (step 0 is no candidate)
                    if row["step"] > 0:
                        self._record(row["step"], {k: row[k] for k in metric_names("reward") if k in row})
                if trainer.is_world_process_zero():
                    write_best(self.run_dir, self.best)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cfg.at_start and state.global_step == 0 and self.last_step < 0:
            self.run(state, control, when="start")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.cfg.eval_steps and state.global_step % self.cfg.eval_steps == 0:
            self.run(state, control)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.last_step != state.global_step and not self.trainer.stopped_early:
            self.run(state, control, when="end")

    def run(self, state, control, when: Literal["start", "step", "end"] = "step") -> dict[str, float]:
        """Validate now. At a step, the metrics join that step's log line and a new best asks for
        a checkpoint; at the start and the end they are a log line of their own."""
        from trl.models.utils import unwrap_model_for_generation

        trainer = self.trainer
        n = len(self.dataset) if self.cfg.max_samples is None else min(self.cfg.max_samples, len(self.dataset))
        rank, world = rank_and_world()
        share, own = even_share(n, rank, world)  # as many rows on every rank: ZeRO-3 generates together
        rows = [{"id": str(i), **self.dataset[i]} for i in share]  # a user's eval set may have no id
        images = [r["images"] for r in rows] if rows and "images" in rows[0] else None
        model = trainer.model_wrapped
        was_training = model.training
        k = self.cfg.num_samples
        sampling = Sampling(self.cfg.max_new_tokens, self.cfg.temperature, num_samples=k)
        with (
            unwrap_model_for_generation(model, trainer.accelerator) as unwrapped,
            merged_adapters(unwrapped, getattr(trainer, "merge_lora_for_generation", True)),
            torch.random.fork_rng(
                devices=[torch.cuda.current_device()] if torch.cuda.is_available() else [],
                enabled=self.cfg.temperature > 0,
            ),
        ):  # training's random state untouched
            unwrapped.eval()
            if self.cfg.temperature > 0:  # the same draws for the same weights, whenever validation runs
                torch.manual_seed(trainer.args.seed + 1_000_003 * state.global_step + rank)
            completions = [
                c
                for cs in generate(
                    unwrapped,
                    trainer.processing_class,
                    [r["prompt"] for r in rows],
                    images,
                    sampling,
                    self.cfg.batch_size,
                    Engine.from_trainer(trainer),
                )
                for c in cs
            ]
        model.train(was_training)
        completions, _ = gather_objects(completions[: own * k])  # the padding's completions dropped
        shown = [{"question": question_text(r), "image": thumbnail(r.get("images"))} for r in rows[:own]]
        rows, _ = gather_objects(
            [
                {k: r.get(k) for k in ("answer", "reference_steps", "choices", "id", "difficulty", "source")}
                | ({"reference_sets": r["reference_sets"]} if "reference_sets" in r else {})
                | s
                for r, s in zip(rows[:own], shown)
                for _ in range(k)
            ]
        )
        scored = self.module.score(completions, rows, with_steps=True)
        batch = scored.batch
        metrics = self.module.metrics(batch)
        self.last_step = state.global_step
        if trainer.is_world_process_zero():
            with open(self.run_dir / VALIDATION_LOG, "a") as fh:
                fh.write(json.dumps({"step": state.global_step, **metrics}) + "\n")
            write_samples(self.run_dir / samples_file(state.global_step), rows, completions, batch, k)
            self.show_steps(state.global_step, scored, rows, completions)
        logged = {f"val_{k}": v for k, v in metrics.items() if math.isfinite(v)}
        if when == "step":  # joins this step's own log line instead of stealing its training metrics
            for k, v in logged.items():
                trainer._metrics["train"][k].append(v)
        else:
            trainer.log(logged)
        if when != "start" and self._record(state.global_step, metrics):
            state.best_metric = self.best.value
            state.best_model_checkpoint = str(Path(trainer.args.output_dir) / self.best.checkpoint)
            if when == "step":
                control.should_save = True
            if trainer.is_world_process_zero():
                write_best(self.run_dir, self.best)
        return metrics

    def show_steps(self, step: int, scored, rows: list[dict], completions: list[str]) -> None:
        """The alignment viewer of this round (rewards/alignment_view.py), and the same rows as a
        wandb Table when ``report_to`` names wandb."""
        k = self.cfg.num_samples
        view = alignment_rows(self.module, scored, rows, completions, [i % k for i in range(len(rows))])
        cfg = self.module.config
        write_page(self.run_dir / steps_page(step), view, cfg.threshold, f"validation at step {step}", cfg.matcher)
        log_wandb(view, self.trainer.args.report_to, "validation_steps")

    def _record(self, step: int, metrics: dict[str, float]) -> bool:
        """Make this step the best one if its metric beats the record; True when it does."""
        value = metrics.get(self.cfg.metric, math.nan)
        if not math.isfinite(value) or (self.best is not None and not better(self.cfg.metric, value, self.best.value)):
            return False
        self.best = BestCheckpoint(self.cfg.metric, value, step, checkpoint_name(step), metrics)
        return True


def write_samples(path: Path, rows: list[dict], completions: list[str], batch, num_samples: int) -> None:
    """Every validation completion with its scores, one line each: accuracy by difficulty (or any
    other cut of the rows) can be recovered from the run folder."""
    with open(path, "w") as fh:
        for i, (r, c) in enumerate(zip(rows, completions)):
            line = {
                "id": r["id"],
                "sample": i % num_samples,
                "completion": c,
                "correct": batch.correct[i].item(),
                "format_ok": batch.format_ok[i].item(),
                "steps": batch.n_pred[i].item(),
                "f1": _number(batch.f1[i].item()),
            }
            if r.get("difficulty") is not None:
                line["difficulty"] = r["difficulty"]
            fh.write(json.dumps(line) + "\n")


def _number(x: float) -> float | None:
    return x if math.isfinite(x) else None  # (JSON has no NaN: a row without reference steps)


class MetricsJsonlCallback(TrainerCallback):
    """Every log line, as JSON, in ``metrics.jsonl`` of the run folder (main process)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / METRICS_LOG

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if state.is_world_process_zero and logs:
            clean = {k: v for k, v in logs.items() if isinstance(v, (int, float, str)) or v is None}
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"step": state.global_step, **clean}) + "\n")


class PlotCallback(TrainerCallback):
    """Reward, Match F1, accuracy and KL curves as a PNG when training ends."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from crystal_grpo.train.run.plot import plot_run

            try:
                plot_run(self.run_dir)
            except Exception as err:  # noqa: BLE001 - a plot must never fail a finished run
                logger.warning("could not draw the training plot: %s", err)
