"""The ``GRPOConfig`` of tests that compare the update of one training step: plain SGD at a constant
learning rate of 0.5 without gradient clipping, so the update is the gradient itself; beta 0.1; the
tiny model on CPU, nothing saved or reported."""

from __future__ import annotations

from pathlib import Path

from trl import GRPOConfig


def one_step_args(tmp_path: Path, name: str, **kw) -> GRPOConfig:
    """Into ``tmp_path / name``, 12 completions in groups of 3 unless ``kw`` says otherwise."""
    base = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=12,
        num_generations=3,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        beta=0.1,
        loss_type="grpo",
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_completion_length=8,
        seed=0,
        disable_tqdm=True,
        gradient_checkpointing=False,
    )
    return GRPOConfig(**{**base, **kw})
