"""The main job: GRPO with step-level rewards, from one YAML config.

    accelerate launch train/grpo.py --config cpr_curriculum.yaml [--section.key value ...]
    python train/grpo.py --config demo.yaml --resume_from_checkpoint latest

A bare config name resolves against configs/. With ``phases`` in the config (the
CPR-Curriculum), each phase runs in its own folder and starts from the previous
phase's best (or last) checkpoint; an interrupted run resumes inside the right phase.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from crystal_grpo.distributed import (
    is_main_process,
    launch_command,
    launcher_problem,
    release_process_group,
    wait_for_every_process,
)
from crystal_grpo.errors import CrystalError, traceback_if_asked
from crystal_grpo.jsonl import atomic_write_text, read_json, read_jsonl
from crystal_grpo.paths import user_path
from crystal_grpo.train.config.preflight import preflight, row_checks
from crystal_grpo.train.config.run_config import (
    ConfigError,
    PaperRecipe,
    PhaseSection,
    RunConfig,
    load_config,
    parse_overrides,
    phase_configs,
)
from crystal_grpo.train.run.checkpoints import (
    CheckpointError,
    checkpoint_problem,
    checkpoint_step,
    disk_full,
    explicit_resume_problem,
    follow_umask,
    latest_complete,
    resolve_resume,
    set_back,
    settings_undone,
    shape_problem,
    tensor_file_problem,
    truncate_logs,
    undone_line,
)
from crystal_grpo.train.run.folder import (
    RunFolderError,
    RunLock,
    as_record,
    clear_attempt,
    clear_run,
    data_digests,
    foreign_folder,
    holds_run,
    mark_phase_done,
    phase_state,
    plan_launch,
    read_only_problem,
    record_kept,
    reopen,
    restart_problem,
    unshared_problem,
    unwritable,
)
from crystal_grpo.train.run.layout import (
    CHECKPOINT_GLOB,
    CONFIG,
    CURVES,
    FINAL,
    METRICS_LOG,
    RUN_SUMMARY,
    STATE_FILE,
    SUMMARY,
    VALIDATION_LOG,
    checkpoint_name,
    phase_dir,
    read_best,
    read_config,
)
from crystal_grpo.typed import to_dict


def say(msg: str) -> None:
    if is_main_process():
        print(msg, flush=True)


def setup_distributed(cfg: RunConfig) -> dict:
    """CPU multi-process route (tests, CI): gloo for DDP and for DeepSpeed ZeRO-3.

    Must run before the training arguments exist (otherwise DeepSpeed's batch-size checks
    fail, and ``accelerate launch --cpu --num_processes 2`` silently runs one process: docs/training.md).
    """
    if cfg.cpu_backend != "gloo":
        return {}
    from accelerate import PartialState

    if cfg.training.get("deepspeed"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        return {"use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return {}
    PartialState(cpu=True, backend="gloo")  # DDP over gloo (MULTI_CPU)
    return {"use_cpu": True, "accelerator_config": {"use_configured_state": True}}


def check_zero_resume(checkpoint: str, world_size: int) -> None:
    """DeepSpeed ZeRO shards resume only with the number of processes that wrote them.

    (DeepSpeed can re-shard through its "universal checkpoint" conversion, which HF's
    Trainer does not load; the consolidated ``model.safetensors`` starts a new run.)
    """
    tag_file = Path(checkpoint) / "latest"
    if not tag_file.exists():
        return  # not a DeepSpeed checkpoint: full states resume on any number of processes
    shards = list((Path(checkpoint) / tag_file.read_text().strip()).glob("*zero_pp_rank_*_model_states.pt"))
    if shards and len(shards) != world_size:
        raise ConfigError(
            f"checkpoint {checkpoint} holds DeepSpeed ZeRO shards written by {len(shards)} process(es), "
            f"but this run has {world_size}. Resume with {len(shards)} processes, or start a new run "
            f"from its consolidated weights: --model.name_or_path {checkpoint}"
        )


def training_args(cfg: RunConfig, output_dir: Path, extra: dict):
    """Map the config onto TRL's GRPOConfig (or SFTConfig for an SFT phase); the paper's
    recipe (:class:`PaperRecipe`) fills what the config's ``training`` leaves unset."""
    from trl import GRPOConfig, SFTConfig

    recipe = PaperRecipe()
    defaults = {
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": recipe.save_steps,
        "report_to": "none",
        **cfg.precision(),
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "seed": recipe.seed,
        "disable_tqdm": False,
    }
    if cfg.trainer == "grpo":
        defaults.update({**dataclasses.asdict(recipe), "remove_unused_columns": False})
    t = {**defaults, **cfg.training, **extra, "output_dir": str(output_dir), **trl_model_settings(cfg)}
    try:
        return (GRPOConfig if cfg.trainer == "grpo" else SFTConfig)(**t)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"training: {err}") from err


def trl_model_settings(cfg: RunConfig) -> dict:
    """The config's model and prompt settings under TRL's names (train/config/run_config.py moves TRL's
    names into the sections): TRL builds the reference model from ``model_init_kwargs`` and
    ``trust_remote_code``, and renders rollout prompts with ``chat_template_kwargs`` (GRPO)."""
    from crystal_grpo.train.models.loading import from_pretrained_kwargs

    out: dict = {"trust_remote_code": cfg.model.trust_remote_code}
    init = from_pretrained_kwargs(cfg.model)
    if init and cfg.trainer == "grpo":  # (an SFT phase has no reference model)
        out["model_init_kwargs"] = init
    if cfg.trainer == "grpo" and cfg.data.chat_template_kwargs:
        out["chat_template_kwargs"] = dict(cfg.data.chat_template_kwargs)
    return out


def _sampler_factory(cfg: RunConfig, dataset, max_steps: int):
    if cfg.curriculum is None:
        return None
    from crystal_grpo.curricula.sampler import make_sampler_factory

    return make_sampler_factory(cfg.curriculum, dataset, max_steps)


def run_phase(
    cfg: RunConfig,
    output_dir: Path,
    resume: str | None = None,
    callbacks: list | None = None,
    record: Callable[[dict], None] | None = None,
) -> tuple[dict, int]:
    """One phase (GRPO, or SFT for ``trainer: sft``); returns its final validation metrics and
    the step it reached. ``record`` is given the training settings a resume keeps from its
    checkpoint instead of the config's (``checkpoints.RESTORED_SETTINGS``), for run.json."""
    from crystal_grpo.train.data.row_problems import system_prompt_problem
    from crystal_grpo.train.data.splits import DataError, batch_problem, load_datasets, same_rows_line
    from crystal_grpo.train.models.loading import load_policy, model_file, model_source, special_tokens
    from crystal_grpo.train.models.vision import parameter_line, resolution_line
    from crystal_grpo.train.trainer.callbacks import MetricsJsonlCallback, PlotCallback, ValidationCallback
    from crystal_grpo.train.trainer.interrupt import Interrupted

    extra = setup_distributed(cfg)
    args = training_args(cfg, output_dir, extra)  # TRL's own value checks, before anything loads
    apart = unshared_problem(output_dir)  # (the processes exist now: every rank asks)
    if apart:
        raise RunFolderError(apart)
    model_source(cfg.model)  # and a missing model folder
    checkpoint = resolve_resume(output_dir, resume, say)
    problem = restart_problem(output_dir) if resume and not checkpoint else None
    if checkpoint:  # everything a resume needs, checked before anything of the run is changed
        check_zero_resume(checkpoint, args.world_size)
        base = model_file(cfg.model, "config.json")
        problem = shape_problem(checkpoint, base and base.parent) or tensor_file_problem(checkpoint)
        problem = problem and f"cannot resume: {problem}"
    if problem:
        raise CheckpointError(problem)
    if checkpoint:
        state = Path(checkpoint) / STATE_FILE
        kept = settings_undone((read_json(state) or {}).get("settings", {}), args)
        for key, (now, then) in kept.items():
            say(f"warning: {undone_line(key, now, then)}")
            setattr(args, key, then)  # what the trainer, its saved arguments and config.json then say
            cfg.training[key] = then
        if kept and record is not None and is_main_process():
            record({key: then for key, (_, then) in kept.items()})
        with args.main_process_first(desc="truncating the run's logs to the checkpoint"):
            if is_main_process():  # every rank then reads the same logs (validation record)
                reopen(output_dir)
                truncate_logs(output_dir, checkpoint_step(checkpoint))
                line = set_back(output_dir, checkpoint)
                if line:
                    say(line)
    else:
        with args.main_process_first(desc="starting the phase over"):
            if is_main_process() and output_dir.is_dir() and METRICS_LOG in clear_attempt(output_dir):
                say(
                    f"{output_dir}: no complete checkpoint, so the phase starts over at step 0; the logs of "
                    "the attempt that was stopped before its first checkpoint are removed"
                )
    # The sentence encoder loads outside DeepSpeed's partitioning (rewards/match_f1.py).
    module = cfg.reward.build()
    tokens = special_tokens(cfg.model)
    injected = system_prompt_problem(cfg.data.system_prompt, tokens)
    if injected:
        raise DataError(injected)
    train, val = load_datasets(cfg.data, seed=int(cfg.training.get("seed", 42)), special_tokens=tokens)
    if train.skipped:
        say(f"skipped {train.skipped} invalid training row(s) (data.skip_invalid)")
    lines = [*train.warnings, *(val.warnings if val is not None else ()), same_rows_line(cfg.data)]
    for line in dict.fromkeys(x for x in lines if x):
        say(f"warning: {line}")
    too_few = batch_problem(train, args) if cfg.trainer == "grpo" else None
    if too_few:  # before the model loads; again below, once long prompts are dropped
        raise DataError(too_few)
    model, processing_class = load_policy(cfg.model)
    train, val = limit_prompts(cfg, args, model, processing_class, train, val)
    too_few = batch_problem(train, args) if cfg.trainer == "grpo" else None
    if too_few:
        raise DataError(f"{too_few} (after dropping prompts too long for the context)")
    for line in length_warnings(cfg, args, processing_class, train, val):
        say(f"warning: {line}")
    output_dir.mkdir(parents=True, exist_ok=True)  # only now: a failed start leaves no phase folder
    trainer = make_trainer(
        cfg,
        args,
        model,
        processing_class,
        module,
        train.dataset,
        val.dataset if val is not None and args.eval_strategy != "no" else None,
    )
    for line in (parameter_line(trainer.model), resolution_line(processing_class)):
        if line:
            say(line)
    if cfg.trainer == "grpo":  # before the metrics file: its alarm/* values join the same row
        from crystal_grpo.train.trainer.alarms import AlarmCallback

        alarms = AlarmCallback(cfg.alarms, say)
        alarms.replay(read_jsonl(output_dir / METRICS_LOG) if checkpoint else [])
        trainer.add_callback(alarms)
    trainer.add_callback(MetricsJsonlCallback(output_dir))
    if val is not None:
        trainer.add_callback(ValidationCallback(trainer, val.dataset, cfg.validation, output_dir, module))
    trainer.add_callback(PlotCallback(output_dir))
    for cb in callbacks or []:
        trainer.add_callback(cb)
    if is_main_process():
        atomic_write_text(output_dir / CONFIG, json.dumps(to_dict(cfg), indent=2, default=str))
    if checkpoint and 0 < args.max_steps <= checkpoint_step(checkpoint):
        say(
            f"{checkpoint} already holds step {checkpoint_step(checkpoint)} of max_steps {args.max_steps}: "
            "finishing the phase without training"
        )
        trainer.finish_from(checkpoint)
    else:
        with trainer.interrupt.handling():
            trainer.train(resume_from_checkpoint=checkpoint)
    if trainer.interrupt.stopped_at is not None:
        step = trainer.interrupt.stopped_at
        raise Interrupted(trainer.interrupt.signum, step, str(output_dir / checkpoint_name(step)))
    if trainer.guard.stopped:
        raise SystemExit(
            f"stopped: {cfg.stability.max_consecutive_nonfinite} consecutive updates had non-finite "
            f"loss/gradients (step {trainer.state.global_step}). The last good state is saved in "
            f"{output_dir}; lower the learning rate or check the data, then resume with "
            f"--resume_from_checkpoint latest."
        )
    trainer.save_model(str(output_dir / FINAL))
    if is_main_process():
        follow_umask(output_dir / FINAL)
    val_file = output_dir / VALIDATION_LOG
    last = (read_jsonl(val_file) or [{}])[-1]
    say(
        f"\nrun folder: {output_dir}\n  checkpoints: {output_dir / CHECKPOINT_GLOB}  final model: {output_dir / FINAL}"
        f"\n  metrics: {output_dir / METRICS_LOG}  validation: {val_file}"
        f"\n  plot: {output_dir / CURVES}"
    )
    return last, trainer.state.global_step


def make_trainer(cfg: RunConfig, args, model, processing_class, module, dataset, eval_dataset=None):
    """The phase's trainer: GRPO (with PCGrad when asked for) or the SFT warm start.
    ``eval_dataset`` (the validation split, when ``training.eval_strategy`` asks for TRL's
    evaluation) is what TRL's own evaluation loop reads."""
    from crystal_grpo.train.models.loading import peft_config

    common = dict(
        model=model,
        args=args,
        processing_class=processing_class,
        peft_config=peft_config(cfg.model, model),
        max_consecutive_nonfinite=cfg.stability.max_consecutive_nonfinite,
        merge_lora_for_generation=cfg.model.lora is not None and cfg.model.lora.merge_for_generation,
    )
    if cfg.trainer == "sft":
        from crystal_grpo.train.data.splits import sft_dataset
        from crystal_grpo.train.trainer.sft import CrystalSFTTrainer

        kwargs = cfg.data.chat_template_kwargs
        return CrystalSFTTrainer(
            train_dataset=sft_dataset(dataset, processing_class, kwargs),
            chat_template_kwargs=kwargs,
            eval_dataset=None if eval_dataset is None else sft_dataset(eval_dataset, processing_class, kwargs),
            **common,
        )
    from crystal_grpo.train.pcgrad.trainer import trainer_class

    extra = {"pcgrad_objective_std": cfg.pcgrad_objective_std} if cfg.pcgrad else {}
    with _reference_kwargs_meant():
        return trainer_class(cfg.pcgrad)(
            reward=module,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            sampler_factory=_sampler_factory(cfg, dataset, args.max_steps),
            dynamic_sampling=cfg.dynamic_sampling,
            **common,
            **extra,
        )


@contextlib.contextmanager
def _reference_kwargs_meant():
    """TRL warns that ``model_init_kwargs`` are ignored when the policy is given loaded; here the
    policy was loaded with them (load_policy) and TRL builds the reference model from them, so
    the warning would mislead."""
    import logging

    def meant(record: logging.LogRecord) -> bool:
        return "model_init_kwargs" not in record.getMessage()

    trl_logger = logging.getLogger("trl.trainer.grpo_trainer")
    trl_logger.addFilter(meant)
    try:
        yield
    finally:
        trl_logger.removeFilter(meant)


def limit_prompts(cfg: RunConfig, args, model, processing_class, train, val):
    """Training and validation prompts that fit the model's context with their completion
    (``data.long_prompts``); one warning line per split that had any that do not."""
    from crystal_grpo.train.data.splits import context_length, limit_prompt_lengths

    context = context_length(model)
    if context is None:
        return train, val
    if cfg.trainer == "grpo":
        train, line = limit_prompt_lengths(
            train,
            processing_class,
            context - args.max_completion_length,
            cfg.data.long_prompts,
            f"training.max_completion_length ({args.max_completion_length}) in the model's {context} positions",
            cfg.data.chat_template_kwargs,
        )
        if line:
            say(f"warning: {line}")
    if val is not None:
        val, line = limit_prompt_lengths(
            val,
            processing_class,
            context - cfg.validation.max_new_tokens,
            cfg.data.long_prompts,
            f"validation.max_new_tokens ({cfg.validation.max_new_tokens}) in the model's {context} positions",
            cfg.data.chat_template_kwargs,
        )
        if line:
            say(f"warning: {line}")
    return train, val


def length_warnings(cfg: RunConfig, args, processing_class, train, val) -> list[str]:
    """Length limits that would cut off more than 5% of the rendered reference answers: a
    correct completion cut short fails the format check (docs/training.md)."""
    from crystal_grpo.train.data.splits import target_lengths, truncation_warning

    def sample(split) -> list[dict]:  # the text of the rows: their images stay unopened paths
        return split.dataset.with_format(None).select(range(min(len(split.dataset), 256))).to_list()

    rows, kwargs = sample(train), cfg.data.chat_template_kwargs
    checks = []
    if cfg.trainer == "grpo":
        checks.append(
            (
                target_lengths(processing_class, rows, chat_template_kwargs=kwargs),
                args.max_completion_length,
                "training.max_completion_length",
            )
        )
    else:
        checks.append(
            (
                target_lengths(processing_class, rows, with_prompt=True, chat_template_kwargs=kwargs),
                args.max_length,
                "training.max_length (prompt + target)",
            )
        )
    if val is not None:
        checks.append(
            (
                target_lengths(processing_class, sample(val), chat_template_kwargs=kwargs),
                cfg.validation.max_new_tokens,
                "validation.max_new_tokens",
            )
        )
    return [w for lengths, limit, key in checks if (w := truncation_warning(lengths, limit, key))]


def explicit_phase_problem(checkpoint: str, pdir: Path, name: str, later: list[Path]) -> str | None:
    """Why ``--resume_from_checkpoint PATH`` cannot resume phase ``name`` (in ``pdir``), the first
    unfinished one, or None: PATH must be one of its checkpoints, and no later phase (``later``:
    their folders) may have started from its end."""
    if Path(checkpoint).resolve().parent != pdir.resolve():
        return (
            f"cannot resume: {checkpoint} is not a checkpoint of phase {name} ({pdir}), the phase this run "
            f"resumes in (those before it finished): resume with latest, or start a new run from its weights "
            f"(--model.name_or_path {checkpoint})"
        )
    started = [d.name for d in later if d.is_dir()]
    if started:
        return (
            f"cannot resume: {checkpoint}: later phases ({', '.join(started)}) started from the end of phase "
            f"{name}; start a new run from its weights (--model.name_or_path {checkpoint})"
        )
    return None


def phase_start(prev_dir: Path, init_from: str) -> str | None:
    """The checkpoint a phase starts from: the previous phase's best (if complete) or last."""
    if init_from == "none":
        return None
    record = read_best(prev_dir) if init_from == "best" else None
    if record and (prev_dir / record.checkpoint).exists():  # (a best found by the final
        ckpt = prev_dir / record.checkpoint  # validation lives in final/)
        problem = checkpoint_problem(ckpt, checksums=True)
        if problem is None:
            return str(ckpt)
        say(f"best checkpoint unusable ({problem}); starting from {prev_dir / FINAL}")
    return str(prev_dir / FINAL)


def run(
    cfg: RunConfig, run_dir: Path, resume: str | None = None, callbacks: list | None = None, overwrite: bool = False
) -> dict:
    """All phases of a run (one when the config has none); returns validation per phase.

    The folder holds this run only (train/run/folder.py): a live run elsewhere in it is
    refused, a finished run is left as it is, a fresh start in a folder holding another run
    is refused unless ``overwrite``. With ``resume``, a phase that finished its configured
    steps is skipped, the first unfinished one resumes from its latest checkpoint (or the one
    ``resume`` names, which must be one of that phase's) with the starting weights it was given,
    and later phases start as usual.
    """
    phases = copy.deepcopy(phase_configs(cfg))  # a phase may be given its start below
    max_steps = [p.training.get("max_steps") for p in phases]
    main, created = is_main_process(), not os.path.lexists(run_dir)
    refused = foreign_folder(run_dir) or read_only_problem(run_dir)  # before the lock: it is a file in the folder
    if refused:
        raise RunFolderError(refused)
    where = unwritable(run_dir) if main else None
    if where:  # a finished run (read_only_problem): nothing to do, or a launch that cannot write what it would
        said: list[str] = []
        launch = plan_launch(run_dir, as_record(cfg), max_steps, resume, overwrite, said.append, write=False)
        if launch.action != "finished":
            raise RunFolderError(
                f"{run_dir} {where}: it holds a finished run, which this launch would change (train it further, "
                "or start it again); copy the run folder to a writable place and launch there (--output_dir)"
            )
        for line in said:
            say(line)
        say_summary(cfg, run_dir, write=False)
        return launch.summary or {}
    if resume not in (None, "latest"):
        problem = explicit_resume_problem(resume, run_dir, phase_folders_of(cfg, run_dir))
        if problem:
            raise CheckpointError(problem)
    try:
        with RunLock(run_dir, launch_command(), say) if main else contextlib.nullcontext():
            data = data_digests([f for p in phases for f in (p.data.train, p.data.validation)]) if main else None
            launch = plan_launch(run_dir, as_record(cfg), max_steps, resume, overwrite, say, write=main, data=data)
            if launch.action == "finished":
                if main:
                    say_summary(cfg, run_dir, write=False)
                return launch.summary or {}
            return _run_phases(cfg, phases, run_dir, resume if launch.action == "resume" else None, callbacks)
    except BaseException:
        if main and created and run_dir.is_dir() and not holds_run(run_dir):
            with contextlib.suppress(OSError):  # a failed start leaves no folder behind (a file put there stays)
                if not clear_run(run_dir, keep=()):
                    run_dir.rmdir()
        raise


def phase_folders_of(cfg: RunConfig, run_dir: Path) -> list[Path]:
    """The folder of each phase of ``cfg``'s run in ``run_dir`` (the run folder itself for one phase)."""
    return [phase_dir(run_dir, i, p.name, len(cfg.phases)) for i, p in enumerate(cfg.phases)] or [run_dir]


def _run_phases(
    cfg: RunConfig, phases: list[RunConfig], run_dir: Path, resume: str | None, callbacks: list | None
) -> dict:
    summary, prev = {}, None
    for i, pcfg in enumerate(phases):
        phase = cfg.phases[i] if cfg.phases else PhaseSection(name="run")
        pdir = phase_dir(run_dir, i, phase.name, len(cfg.phases))
        state = phase_state(pdir, max_steps=pcfg.training.get("max_steps"))
        if state.status == "done":
            say(f"phase {phase.name}: already done, skipping")
            summary[phase.name], prev = (state.record or {}).get("validation", {}), pdir
            continue
        if resume not in (None, "latest"):
            problem = explicit_phase_problem(
                resume,
                pdir,
                phase.name,
                [phase_dir(run_dir, j, p.name, len(cfg.phases)) for j, p in enumerate(cfg.phases) if j > i],
            )
            if problem:
                raise CheckpointError(problem)
        started = resume is not None and latest_complete(pdir)[0] is not None
        problem = restart_problem(pdir) if resume is not None and not started else None
        if problem:
            raise CheckpointError(problem)
        if prev is not None:
            start = read_config(pdir)["model"]["name_or_path"] if started else phase_start(prev, phase.init_from)
            if start:
                pcfg.model.name_or_path, pcfg.model.gguf_file = start, None
                say(f"phase {phase.name}: starting from {start}")
        if cfg.phases:
            say(f"\n=== phase {i + 1}/{len(cfg.phases)}: {phase.name} ===")
            if phase.left_out:
                say(left_out_line(phase))
        validation, step = run_phase(
            pcfg,
            pdir,
            (resume or "latest") if started else None,
            callbacks,
            functools.partial(record_kept, run_dir, i if cfg.phases else None),
        )
        resume = resume and "latest"  # (an explicit checkpoint is this phase's; later phases had not started)
        summary[phase.name] = validation
        if is_main_process():
            mark_phase_done(pdir, pcfg.training.get("max_steps"), step, validation)
        prev = pdir
    if is_main_process():
        atomic_write_text(run_dir / SUMMARY, json.dumps(summary, indent=2))  # last: the run is finished
        say_summary(cfg, run_dir)
        if cfg.phases:
            from crystal_grpo.train.run.plot import plot_run

            say(f"curves of all phases: {plot_run(run_dir)}")
    return summary


def say_summary(cfg: RunConfig, run_dir: Path, write: bool = True) -> None:
    """The run's table, phase by phase (``write``: into ``run_summary.json`` first)."""
    from crystal_grpo.train.run.summary import write_summary

    say(
        f"\nthe run{', phase by phase' if cfg.phases else ''} (validation before -> after; "
        f"{run_dir / RUN_SUMMARY}):\n" + write_summary(run_dir, write)
    )


def main(argv: list[str] | None = None) -> int:
    from crystal_grpo.curricula.schedule import Schedule
    from crystal_grpo.typed import describe

    epilog = (
        "config fields (any of them also as --section.key VALUE; reward.params are the fields of the "
        "reward's config class, training any field of trl.GRPOConfig):\n"
        + "\n".join(describe(RunConfig))
        + "\n\nthe paper's recipe: training defaults of a GRPO phase (a training key of the config wins):\n"
        + "\n".join(describe(PaperRecipe, "training."))
        + "".join(
            f"\n\ncurriculum.mode: {mode}: its own options\n" + "\n".join(describe(cls.Options, "curriculum."))
            for mode, cls in Schedule.registry.items()
            if dataclasses.fields(cls.Options)
        )
    )
    ap = argparse.ArgumentParser(
        description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", required=True, type=user_path, help="YAML file, or a name in configs/")
    ap.add_argument(
        "--resume_from_checkpoint",
        default=None,
        type=user_path,
        help="'latest' (the newest complete checkpoint of the run folder) or a checkpoint folder",
    )
    ap.add_argument(
        "--output_dir", default=None, type=user_path, help="run folder (default: training.output_dir or runs/<config>)"
    )
    ap.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="start again in a folder that holds a run: what that run wrote is removed first",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="check the config, the files the run needs and its predicted memory per GPU, then stop "
        "(nothing is loaded or written)",
    )
    ap.add_argument(
        "--accelerate_config",
        default=None,
        type=user_path,
        help="with --check: the accelerate config the run will be "
        "launched with (a path or a name in configs/accelerate/), for its GPU count and ZeRO stage",
    )
    ap.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="with --check: GPUs (processes) the run will use (default: "
        "the launcher's WORLD_SIZE, else --accelerate_config's num_processes, else 1)",
    )
    ap.add_argument(
        "--gpu_memory",
        type=float,
        default=None,
        help="with --check: GiB per GPU (default: what torch reports when it is loaded and sees a GPU, else 80)",
    )
    args, overrides = ap.parse_known_args(argv)
    try:
        cfg, _ = load_config(args.config, overrides)
    except ConfigError as err:
        return refuse(f"config error: {err}")
    environment = launcher_problem()
    if environment:  # said by every process: without a launcher none is the main one
        print(f"cannot start: {environment}", file=sys.stderr)
        return 2
    given = (parse_overrides(overrides).get("training") or {}).get("output_dir")
    if given is not None and args.output_dir is not None and Path(user_path(str(given))) != Path(args.output_dir):
        return refuse(
            f"config error: --output_dir {args.output_dir} and --training.output_dir {given} name two run folders; "
            "give one"
        )
    where = args.output_dir if args.output_dir is not None else cfg.training.get("output_dir")
    if where is not None and not str(where).strip():  # (it fell back to the default folder)
        return refuse(
            f"config error: {'--output_dir' if args.output_dir is not None else 'training.output_dir'} is "
            f"empty ({where!r}); give the run folder, or leave it out for runs/{Path(args.config).stem}"
        )
    from crystal_grpo.train.capacity.estimate import CapacityError, check_lines, launch_from

    if args.gpus is not None and args.gpus < 1:
        return refuse(f"--gpus {args.gpus}: expected an integer >= 1 (the processes the run will use)")
    try:
        processes, launch = launch_from(args.accelerate_config, cfg.training.get("deepspeed"), args.gpus).gpus, None
    except CapacityError as err:  # (a GPU config's memory line says it too)
        processes, launch = 1, str(err)
    missing = preflight(cfg, processes) + ([launch] if launch and args.accelerate_config else [])
    if args.check:
        for line in check_lines(cfg, args.accelerate_config, args.gpus, args.gpu_memory):
            say(line)
        if not missing:  # the rows, once every file they need is there
            missing, warnings = row_checks(cfg)
            for line in warnings:
                say(f"warning: {line}")
    if missing:  # every missing piece at once, before any folder, lock or model
        return refuse("cannot start: " + f"{len(missing)} problem(s)\n  " + "\n  ".join(missing))
    run_dir = Path(where or f"runs/{Path(args.config).stem}")
    refused = foreign_folder(run_dir) or read_only_problem(run_dir)  # before torch loads (run() checks again)
    if refused:
        return refuse(f"{RunFolderError.__name__}: {refused}")
    resume = args.resume_from_checkpoint or cfg.resume_from_checkpoint
    refused = resume not in (None, "latest") and explicit_resume_problem(
        resume, run_dir, phase_folders_of(cfg, run_dir)
    )
    if refused:
        return refuse(f"{CheckpointError.__name__}: {refused}")
    if args.check:
        phases = ", ".join(f"{p.name} ({p.trainer})" for p in cfg.phases) or cfg.trainer
        say(
            f"{args.config}: config valid and everything it names found; phases: {phases}; reward "
            f"{'components' if cfg.reward.components else cfg.reward.name}; run folder {run_dir}"
        )
        for phase in cfg.phases:
            if phase.left_out:
                say(left_out_line(phase))
        return 0
    from crystal_grpo.train.trainer.interrupt import Interrupted  # torch and transformers: only a run needs them

    try:
        run(
            cfg,
            run_dir,
            args.resume_from_checkpoint or cfg.resume_from_checkpoint,
            overwrite=args.overwrite_output_dir,
        )
    except Interrupted as stop:
        say(
            f"interrupted by {signal.Signals(stop.signum).name} at step {stop.step}: saved {stop.checkpoint}; "
            f"resume with: {resume_command(argv)}"
        )
        return stop.exit_code
    except KeyboardInterrupt:
        say(f"aborted: the newest complete checkpoint is used by: {resume_command(argv)}")
        return 130
    except SystemExit as stop:
        if stop.code not in (None, 0):  # (a message or an exit code: said by Python as usual)
            raise
        close_progress_bars()
        print(f"error: {exited_line(stop)}", file=sys.stderr)
        return 1
    except (CrystalError, OSError, RuntimeError) as err:
        close_progress_bars()
        full = disk_full(err, run_dir)
        if full is not None:
            print(f"disk full: {full}; after freeing space: {resume_command(argv)}", file=sys.stderr)
            return 1
        if not isinstance(err, CrystalError):
            raise
        traceback_if_asked(err)
        if is_main_process() or not isinstance(err, RunFolderError):  # (every rank meets the same folder)
            print(f"{type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


def close_progress_bars() -> None:
    """Close the progress bars an error cut short (the trainer's tqdm bar), so that the error's
    line starts a line of its own instead of following the bar's."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def refuse(message: str) -> int:
    """Exit code 2 for a launch refused before anything loads: the message once (main process),
    then every process of the launch waits for the others (a launcher stops them all as soon as
    one exits, which could cut the message off)."""
    if is_main_process():
        print(message, file=sys.stderr, flush=True)
    wait_for_every_process()
    return 2


def exited_line(stop: SystemExit) -> str:
    """``sys.exit(0)`` called by code a run calls (a user's reward or callback) ended the run with
    exit status 0 and no word: one line naming where it was raised."""
    tb = stop.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" in {tb.tb_frame.f_code.co_name} ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})" if tb else ""
    return (
        f"the run was ended by SystemExit({stop.code!r}) raised{where}: code a run calls (a reward, a callback) "
        "must return, or raise an error, not exit the process"
    )


def left_out_line(phase: PhaseSection) -> str:
    """The run's training keys a phase does not take (train/config/run_config.py split_training)."""
    return (
        f"phase {phase.name} ({phase.trainer}): the run's training keys of the other trainer left out: "
        f"{', '.join(phase.left_out)}"
    )


def resume_command(argv: list[str] | None) -> str:
    """This run's command line, with the launcher actually used, and ``--resume_from_checkpoint latest``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--resume_from_checkpoint" in argv:
        i = argv.index("--resume_from_checkpoint")
        del argv[i : i + 2]
    argv = [a for a in argv if not a.startswith("--resume_from_checkpoint=") and a != "--overwrite_output_dir"]
    return launch_command(argv=[*argv, "--resume_from_checkpoint", "latest"])


def cli() -> int:
    """The command (``python train/grpo.py``, ``crystal-grpo-train``): :func:`main`, then the process
    group released before the process exits (not in ``main``: a caller may run it again in this group)."""
    code = main()
    release_process_group()
    return code


if __name__ == "__main__":
    sys.exit(cli())
