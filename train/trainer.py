"""``CrystalGRPOTrainer``: TRL's GRPOTrainer with the fewest hooks this project needs.

``CrystalTrainerMixin`` holds what every phase's trainer adds (the SFT phase's too,
``train/sft.py``): the non-finite guard, checkpoint state and marker, interruption, model card.

- ``_calculate_rewards``: the reward module (the trainer's explicit ``reward`` argument)
  evaluates each generation batch once; TRL's reward functions only name its components.
  The training set's reference steps are embedded once, when the trainer is built.
- ``_get_train_sampler``: the step-count curriculum, when one is configured; else TRL's order
  with the epoch set from the trainer's state, so a resumed run continues it (train/prompt_order.py).
- ``create_optimizer``: a guard that skips an update whose gradients are not finite and
  stops the run (after saving) when that happens too many times in a row.
- ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``: reward state (the verbosity
  guard's window) and the optimizer settings travel with every checkpoint, and a
  completion marker is written last (``train/checkpoints.py``), so an interrupted save is
  never resumed from. The curriculum order is a pure function of (seed, step).
- ``_prepare_inputs`` / ``_compute_loss`` (``DynamicSamplingMixin``, train/dynamic_sampling.py):
  with ``dynamic_sampling=``, groups whose rewards do not vary are masked or refilled.
- ``_generate_single_turn``: with LoRA, TRL's ``generate`` runs through adapters merged
  into (a copy of) the base weights (``train/lora_merge.py``), as fast as the base model.
- ``log``: adds the KL maximum over the logging window (docs/method.md section 6 diagnostics).
- ``create_model_card``: names the real base model (TRL writes "[None]" for a local folder).
PCGrad touches TRL internals, so it lives in a subclass (``train/pcgrad.py``) that
``pcgrad.trainer_class`` picks only for ``pcgrad: true``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence, Sized
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.extras.profiling import profiling_decorator

from crystal_grpo.rewards.base import OBJECTIVES, Batch, RewardModule
from crystal_grpo.train.callbacks import ValidationCallback
from crystal_grpo.train.checkpoints import (
    SPACE_MARGIN,
    DiskFull,
    checkpoint_bytes,
    disk_full,
    free_bytes,
    optimizer_settings,
    resolve_resume,
    remove_marker,
    space_report,
    write_marker,
)
from crystal_grpo.train.config import DynamicSamplingSection, ValidationSection
from crystal_grpo.train.dynamic_sampling import DynamicSamplingMixin
from crystal_grpo.train.interrupt import GracefulStop
from crystal_grpo.train.layout import checkpoint_name
from crystal_grpo.train.lora_merge import merged_generate
from crystal_grpo.train.prompt_order import EpochRepeatSampler, SamplerEpoch

logger = logging.getLogger(__name__)

STATE_FILE = "crystal_state.json"


class _BeforeFirstStep(Exception):
    """Raised by :class:`_StopBeforeFirstStep` once a checkpoint is loaded (``finish_from``)."""


class _StopBeforeFirstStep(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        raise _BeforeFirstStep


class CrystalTrainerMixin:
    """What every trainer of a run adds to its TRL trainer (GRPO and SFT phases alike):
    the non-finite guard, checkpoints with a completion marker and our state, Ctrl-C /
    SIGTERM handling and the model card. First base, before the TRL trainer class."""

    def __init__(self, *args: Any, max_consecutive_nonfinite: int = 5, merge_lora_for_generation: bool = True,
                 **kwargs: Any) -> None:
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self.merge_lora_for_generation = merge_lora_for_generation  # read by ValidationCallback too
        self.nonfinite_skipped = 0
        self.consecutive_nonfinite = 0
        self.stopped_nonfinite = False
        super().__init__(*args, **kwargs)
        self.interrupt = GracefulStop()  # SIGINT/SIGTERM inside ``with self.interrupt.handling()``
        self.add_callback(self.interrupt)

    @property
    def stopped_early(self) -> bool:
        """Stopped by a signal or by non-finite updates (not at max_steps)."""
        return self.stopped_nonfinite or self.interrupt.stopped_at is not None

    # -- non-finite guard -------------------------------------------------------------
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if not getattr(optimizer, "_crystal_guarded", False):
            step = optimizer.step

            def guarded_step(*args: Any, **kwargs: Any):
                if self._grads_finite(optimizer):
                    self.consecutive_nonfinite = 0
                    return step(*args, **kwargs)
                self._skip_update(optimizer)
                return None

            optimizer.step = guarded_step
            optimizer._crystal_guarded = True
        return optimizer

    def _grads_finite(self, optimizer) -> bool:
        """All ranks agree: under ZeRO each rank only sees its own gradient partition."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            ok = torch.ones((), device=self.accelerator.device)
        else:  # reduced on the device: one host sync a step (``.item()`` below), not one per parameter
            device = grads[0].device
            ok = torch.stack([torch.isfinite(g).all().to(device) for g in grads]).all().float()
        return self._all_ranks(ok)

    def _skip_update(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.nonfinite_skipped += 1
        self.consecutive_nonfinite += 1
        self._metrics["train"]["nonfinite_skipped"].append(1.0)
        logger.warning("non-finite gradients at step %d: update skipped (%d in a row)",
                       self.state.global_step, self.consecutive_nonfinite)
        if self.consecutive_nonfinite >= self.max_consecutive_nonfinite:
            self.stopped_nonfinite = True
            self.control.should_save = True
            self.control.should_training_stop = True

    # -- checkpoint state -------------------------------------------------------------
    def crystal_state(self) -> dict:
        """What travels with a checkpoint besides HF's own state (``crystal_state.json``)."""
        return {"nonfinite_skipped": self.nonfinite_skipped,
                "settings": optimizer_settings(self.optimizer, self.lr_scheduler)}

    def load_crystal_state(self, state: dict) -> None:
        self.nonfinite_skipped = state.get("nonfinite_skipped", 0)

    def _save_checkpoint(self, model, trial):
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, checkpoint_name(self.state.global_step))
        need = checkpoint_bytes(run_dir)  # the previous checkpoint's size: this one's, to the byte or so
        if not self._all_ranks(need is None or free_bytes(run_dir) >= need * SPACE_MARGIN):
            raise DiskFull(f"not saving {folder}: {space_report(run_dir, need)}")
        if self.args.should_save:
            remove_marker(folder)  # a folder being (re)written is incomplete until the end
        self.accelerator.wait_for_everyone()  # before any rank overwrites its shards
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                with open(os.path.join(folder, STATE_FILE), "w") as fh:
                    json.dump(self.crystal_state(), fh)
        except (OSError, RuntimeError) as err:
            if disk_full(err, run_dir) is None:
                raise
            if self.args.should_save:  # never resumable (no marker): give its space back
                shutil.rmtree(folder, ignore_errors=True)
            raise DiskFull(f"saving {folder} failed ({disk_full(err, run_dir)}); the partial folder was "
                           "removed") from None
        self.accelerator.wait_for_everyone()  # every rank's shards are on disk
        if self.args.should_save:
            write_marker(folder, self.state.global_step)

    def _all_ranks(self, ok: bool | torch.Tensor) -> bool:
        """True when ``ok`` holds on every process (a collective: every rank calls it)."""
        flag = ok.float() if isinstance(ok, torch.Tensor) else torch.tensor(float(ok), device=self.accelerator.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint else None
        if path and os.path.exists(path):
            with open(path) as fh:
                self.load_crystal_state(json.load(fh))

    def finish_from(self, checkpoint: str) -> None:
        """End a phase whose ``checkpoint`` already holds its last step: load it (weights,
        state) and run the end-of-training callbacks (final validation, plot) without a step.
        HF's loop always trains one step after resuming, even at ``max_steps``, which is how
        a finished run used to train past its end."""
        stop = _StopBeforeFirstStep()
        self.add_callback(stop)  # last: every other callback has seen on_train_begin
        try:
            self.train(resume_from_checkpoint=checkpoint)
        except _BeforeFirstStep:
            pass
        finally:
            self.remove_callback(stop)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``True`` or ``"latest"`` resume from the newest *complete* checkpoint of ``output_dir``
        (HF's own ``True`` takes the newest folder, complete or not); none yet: a fresh start."""
        if resume_from_checkpoint is True or resume_from_checkpoint == "latest":
            resume_from_checkpoint = resolve_resume(self.args.output_dir, "latest")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """A resumed checkpoint has no ``lm_head.weight`` when it is tied to the embeddings (it is
        saved once): expected, so not reported as missing; every other missing key still is."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        missing = set(load_result.missing_keys)
        storage = {p.data_ptr() for name, p in params.items() if name not in missing and p.numel()}
        tied = [k for k in missing if k in params and params[k].numel() and params[k].data_ptr() in storage]
        if tied:
            self.model.tie_weights()
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        super()._issue_warnings_after_load(load_result)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            logs["nonfinite_skipped_total"] = float(self.nonfinite_skipped)
            self._metrics["train"].pop("nonfinite_skipped", None)
        super().log(logs, start_time)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        if self.is_world_process_zero():
            from crystal_grpo.train.model_card import write_model_card

            write_model_card(self, model_name)


class CrystalGRPOTrainer(CrystalTrainerMixin, DynamicSamplingMixin, GRPOTrainer):
    """A drop-in ``trl.GRPOTrainer``: the same constructor, every argument meaning what it
    means in TRL, plus what this project adds (the non-finite guard, complete-checkpoint
    markers and ``latest`` resume, Ctrl-C / SIGTERM save, the curriculum sampler, the model
    card).

    ``reward=`` (a :class:`RewardModule`) replaces ``reward_funcs``: TRL gets one reward
    function per component, for its names and per-component logs (``rewards/<component>/mean``),
    but the trainer does not call them; it evaluates the module once per generation batch
    (``_calculate_rewards``). Without it, ``reward_funcs`` behave exactly as in TRL.
    ``reward_objectives`` tags each reward function with the objective it serves
    (``accuracy`` / ``reasoning``; a function's own ``objective`` attribute does too), which
    PCGrad needs. ``validation=`` (a :class:`ValidationSection`) with ``reward=`` validates
    greedily on ``eval_dataset`` with the module's metrics (Match F1 included) and records the
    best checkpoint, as ``train/grpo.py`` runs do. ``dynamic_sampling=`` (a
    :class:`DynamicSamplingSection`) masks or refills the groups whose rewards do not vary.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, *args: Any, reward: RewardModule | None = None,
                 reward_objectives: Sequence[str | None] | None = None, sampler_factory: Callable | None = None,
                 validation: ValidationSection | None = None,
                 dynamic_sampling: DynamicSamplingSection | None = None, **kwargs: Any) -> None:
        if isinstance(reward_funcs, RewardModule):  # CrystalGRPOTrainer(model, module, ...)
            reward, reward_funcs = reward_funcs, None
        if reward is not None and reward_funcs is not None:
            raise ValueError("CrystalGRPOTrainer: give reward= (a RewardModule) or reward_funcs (as for "
                             "trl.GRPOTrainer), not both")
        args_ = kwargs.get("args", args[0] if args else None)
        if reward is not None and getattr(args_, "remove_unused_columns", False):
            raise ValueError("CrystalGRPOTrainer(reward=...): remove_unused_columns=True would drop the columns the "
                             "reward reads (answer, reference_steps); set it False (TRL's GRPO default)")
        self.reward = reward
        self.sampler_factory = sampler_factory
        # No reward at all: TRL's own error (or an environment_factory's get_reward as the reward).
        super().__init__(model, reward.reward_funcs() if reward is not None else reward_funcs, *args, **kwargs)
        extra = [n for n in self.reward_func_names if n not in reward.objectives] if reward is not None else []
        if extra:  # TRL appended an environment's get_reward as a reward source
            raise ValueError(f"CrystalGRPOTrainer(reward=...): the environment_factory's get_reward ({', '.join(extra)}) "
                             "would be a second reward beside the reward module, which scores every completion "
                             "itself; give the environment no get_reward method, or use plain reward_funcs with it")
        self.reward_objectives = self._objectives(reward_objectives)
        self.setup_dynamic_sampling(dynamic_sampling)
        if reward is not None:
            start = time.perf_counter()
            pinned = reward.pin_references(self.train_dataset)  # out of the steps, once (MatchF1Scorer.pin)
            if pinned:
                logger.info("embedded %d reference steps before training in %.1f s", pinned,
                            time.perf_counter() - start)
        self.sampler_epoch = SamplerEpoch()  # the prompt order a resumed run continues (train/prompt_order.py)
        self.add_callback(self.sampler_epoch)
        if validation is not None:  # the metrics train/grpo.py runs validate with, for a trainer built by hand
            if reward is None or not isinstance(self.eval_dataset, Sized):
                raise ValueError("validation= reports a reward module's metrics: give reward= (a RewardModule) and "
                                 "one eval_dataset whose rows hold the prompt, answer and reference_steps")
            self.add_callback(ValidationCallback(self, self.eval_dataset, validation, self.args.output_dir, reward))

    def _objectives(self, given: Sequence[str | None] | None) -> list[str | None]:
        """Each of TRL's reward functions' objective (None: untagged)."""
        if self.reward is not None:
            return [self.reward.objectives[name] for name in self.reward_func_names]
        if given is None:
            return [getattr(f, "objective", None) for f in self.reward_funcs]
        given = list(given)
        if len(given) != len(self.reward_funcs) or any(o not in (*OBJECTIVES, None) for o in given):
            raise ValueError(f"reward_objectives {given!r}: expected one of {OBJECTIVES} (or None) for each of the "
                             f"{len(self.reward_funcs)} reward function(s) {self.reward_func_names}")
        return given

    def crystal_state(self) -> dict:
        state = super().crystal_state()
        return state if self.reward is None else {**state, "rewards": {self.reward.name: self.reward.state_dict()}}

    def load_crystal_state(self, state: dict) -> None:
        super().load_crystal_state(state)
        if self.reward is not None and self.reward.name in state.get("rewards", {}):
            self.reward.load_state_dict(state["rewards"][self.reward.name])

    # -- rewards: one evaluation of the batch ---------------------------------------------
    @profiling_decorator  # as TRL's own: the time goes to wandb/mlflow under profiling/
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's ``[N_global, F]`` rewards from ONE evaluation of the reward module.

        Each process scores its own rows (parsing, answers, embedding: the costly part); the
        per-row numbers are gathered so that the components (the composite's batch
        statistics), the verbosity guard and the diagnostics see the whole generation batch.
        """
        if self.reward is None:  # the user's reward functions, exactly as TRL calls them
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        start = time.perf_counter()
        device = self.accelerator.device
        local = self.reward.score(completions, inputs).batch
        batch = Batch.from_tensor(self.accelerator.gather(local.as_tensor().to(device)).cpu(),
                                  len(self.reward.extra_fields))
        comps, metrics = self.reward.rewards(batch, guard=self.model.training)
        metrics.update(self._group_signal(batch, inputs))
        metrics["scoring_seconds"] = time.perf_counter() - start
        for key, value in metrics.items():
            if math.isfinite(value):
                self._log_metric(f"{self.reward.name}/{key}", value)
        return torch.stack([comps[name] for name in self.reward_func_names], dim=1).to(device, torch.float32)

    def _group_signal(self, batch: Batch, inputs: list[dict]) -> dict[str, float]:
        """Whether the answer can teach anything: the share of groups (one prompt's completions)
        whose *accuracy* varies (with none, the answer reward gives every completion of a group
        the same advantage), and the share of easy rows trained on (data with a ``difficulty``)."""
        out = {}
        if len(batch) % self.num_generations == 0 and len(batch):
            groups = batch.correct.reshape(-1, self.num_generations)
            out["accuracy_varies"] = float((groups.amax(dim=1) != groups.amin(dim=1)).double().mean())
        labels = torch.tensor([[float(bool(row.get("difficulty"))), float(row.get("difficulty") == "easy")]
                               for row in inputs], device=self.accelerator.device).reshape(-1, 2)
        labels = self.accelerator.gather(labels)  # on every rank (a collective), labelled or not
        if labels[:, 0].any():
            out["frac_easy"] = float(labels[:, 1].mean())
        return out

    # -- generation -------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, its ``generate`` call through merged LoRA adapters: the merge has to
        happen inside TRL's context, where ZeRO-3 weights are gathered (``merged_generate``)."""
        with merged_generate(self.accelerator.unwrap_model(self.model_wrapped), self.merge_lora_for_generation):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)

    # -- curriculum -------------------------------------------------------------------
    def _get_train_sampler(self, dataset=None):
        if self.sampler_factory is None:  # TRL's order, with the epoch a resumed run is in
            return self.sampler_epoch.track(EpochRepeatSampler.like(super()._get_train_sampler(dataset)))
        return self.sampler_epoch.track(self.sampler_factory(
            dataset if dataset is not None else self.train_dataset,
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            seed=self.args.seed,
            steps_per_chunk=self.num_iterations * self.args.steps_per_generation
            / self.args.gradient_accumulation_steps,
        ))

    # -- logging ----------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        kl = [v for v in self._metrics[mode].get("kl", []) if not math.isnan(v)]
        if kl:
            logs["kl_max"] = max(kl)
        if mode == "train" and hasattr(self.sampler_factory, "stats") and "loss" in logs:
            chunk = self.sampler_factory.chunk_at_step(self.state.global_step - 1)
            logs.update({f"curriculum/{k}": v for k, v in self.sampler_factory.stats(chunk).items()})
        if mode == "train" and torch.cuda.is_available():
            logs["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        super().log(logs, start_time)
