"""The supervised warm-start phase (``phases[].trainer: sft``): teach the output format first.

A model that never writes the JSON answer format gets reward 0 on every completion, so GRPO
groups carry no signal (the demo's SmolLM2-135M: 0 of 16 sampled completions parse). The
usual remedy is a short supervised "cold start" on the format; here it is a phase of the
same run: TRL's ``SFTTrainer`` on the training rows rendered as the target completion
(``train.data.render_target``), with exactly the prompt GRPO uses (chat template, system
instruction, images) and the loss on the completion only (TRL's prompt-completion
format). It writes the same run folder as a GRPO phase (checkpoints with their completion
marker, ``metrics.jsonl``, ``validation.jsonl``, the best checkpoint), so the next phase
starts from it with ``init_from: best|last`` and a resume continues inside it.
"""

from __future__ import annotations

from trl import SFTTrainer

from crystal_grpo.train.trainer.grpo_trainer import CrystalTrainerMixin


class CrystalSFTTrainer(CrystalTrainerMixin, SFTTrainer):
    """``SFTTrainer`` with the pieces every phase's trainer has (train/trainer/grpo_trainer.py): the
    non-finite guard, checkpoint state and completion marker, Ctrl-C / SIGTERM, the model card."""

    def __init__(self, *args, chat_template_kwargs: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The run's prompt rendering (data.chat_template_kwargs), under the name TRL's GRPOTrainer
        # keeps it: validation renders this phase's prompts as the GRPO phases do (Engine.from_trainer).
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
