"""The model card (``README.md``) in a run folder, and in an exported checkpoint.

TRL's card writes "fine-tuned version of [None]" for a model loaded from a local folder; this
card names the base model either way and says how it was trained and where the run's records
are. A ``README.md`` is the run's card only when its YAML header's tags hold ``crystal-grpo``
(:func:`is_run_card`): a README a user put in the run folder is never replaced or removed. An
exported folder travels without its run folder, so its card carries the records themselves
(:func:`read_run_record`, :func:`export_card`); a record the run folder lacks reads "unknown".
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from crystal_grpo.jsonl import read_json, read_jsonl
from crystal_grpo.train.run.checkpoints import TRAINER_STATE
from crystal_grpo.train.run.layout import (
    BEST,
    CONFIG,
    FINAL,
    METRICS_LOG,
    MODEL_CARD,
    VALIDATION_LOG,
    BestCheckpoint,
    phase_folders,
    read_best,
    read_config,
    step_of,
)
from crystal_grpo.train.run.summary import Phase, read_phase, read_phases

logger = logging.getLogger(__name__)
#: The tag every card this project writes carries in its YAML header: what marks a card as ours.
CARD_TAG = "crystal-grpo"


def base_model_of(model) -> str:
    """The model's origin as transformers recorded it (a hub id or a folder; empty when unknown)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


def _is_local(base_model: str) -> bool:
    """A folder (here, or by its look: a relative path recorded where training ran), not a hub id."""
    return (
        not base_model
        or os.path.isdir(base_model)
        or os.path.isabs(base_model)
        or base_model.startswith((".", "~"))
        or base_model.count("/") > 1
    )


def _header(base_model: str, tags: list[str], library: str = "transformers") -> list[str]:
    """The YAML front matter; ``base_model`` only for a hub id (the hub rejects a local path)."""
    header = {"library_name": library, "tags": tags}
    if base_model and not _is_local(base_model):
        header["base_model"] = base_model
    return ["---", yaml.safe_dump(header, sort_keys=False).strip(), "---"]


def _origin(base_model: str) -> str:
    return (
        f"the local model `{base_model}`"
        if _is_local(base_model) and base_model
        else "a model of unknown origin"
        if not base_model
        else f"[{base_model}](https://huggingface.co/{base_model})"
    )


def model_card(
    base_model: str, model_name: str, reward_names: list[str], versions: dict[str, str], method: str = "GRPO"
) -> str:
    """Markdown with a YAML header; ``base_model`` is a hub id or a local path."""
    origin = _origin(base_model)
    lines = [
        *_header(base_model, ["trl", method.lower(), CARD_TAG]),
        "",
        f"# {model_name}",
        "",
        f"Fine-tuned from {origin} with {method} (TRL) by crystal-grpo: CRYSTAL's step-level rewards "
        "(Match F1, Causal Process Reward) and the warm start that teaches their output format.",
        "",
        f"- Reward functions: {', '.join(f'`{r}`' for r in reward_names) or '-'}",
        f"- The run folder holds the full configuration (`{CONFIG}`), the training log "
        f"(`{METRICS_LOG}`) and validation (`{VALIDATION_LOG}`, `{BEST}`).",
        "",
        "## Framework versions",
        "",
        *(f"- {name}: {version}" for name, version in versions.items()),
        "",
    ]
    return "\n".join(lines)


def framework_versions() -> dict[str, str]:
    import torch
    import transformers
    import trl

    return {"TRL": trl.__version__, "Transformers": transformers.__version__, "PyTorch": torch.__version__}


def is_run_card(path: Path) -> bool:
    """Whether ``path`` is a card this project wrote (its YAML header's tags hold :data:`CARD_TAG`)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(4096)
        head = text.split("\n---", 1)[0].removeprefix("---\n") if text.startswith("---\n") else ""
        tags = (yaml.safe_load(head) or {}).get("tags") if head else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return False
    return isinstance(tags, list) and CARD_TAG in tags


class RunCard:
    """The run's card in its (phase) folder ``output_dir``, unless a README.md there is someone else's."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / MODEL_CARD
        self.warned = False  # a README.md that is not ours: said once

    def write(self, base_model: str, model_name: str, reward_names: list[str], method: str) -> Path | None:
        """The card (None: the README.md there is someone else's, left as it is)."""
        out = self.path
        ours = out.is_file() and not out.is_symlink() and is_run_card(out)
        if (out.exists() or out.is_symlink()) and not ours:
            if not self.warned:
                logger.warning(
                    "%s: not the run's model card (no %r tag), so it is left as it is and no card is written",
                    out,
                    CARD_TAG,
                )
                self.warned = True
            return None
        text = model_card(base_model, model_name, reward_names, framework_versions(), method)
        out.write_text(text, encoding="utf-8")
        return out


# --- the card of an exported checkpoint -------------------------------------------------
UNKNOWN = "unknown"


@dataclass
class PhaseRecord:
    """One phase of the run as its folder records it (None: not recorded)."""

    name: str
    trainer: str | None
    reward: str | None
    steps: int  # the highest step its logs reached (0 without logs)


@dataclass
class RunRecord:
    """What a run folder says about one checkpoint; None (or empty) where it says nothing.

    A checkpoint sits in its phase folder (``config.json``: the phase's resolved run config,
    ``validation.jsonl``, ``best_checkpoint.json``); a multi-phase run's root holds the phase
    folders ``phase<K>-<name>``, and its first phase names the model the run started from
    (later phases start from a checkpoint of the one before).
    """

    checkpoint: Path
    config: dict | None = None  # the phase's resolved run config
    base_model: str | None = None  # the model the run started from
    phase_start: str | None = None  # what this phase started from, when that differs
    phase: str | None = None  # this phase's name in a multi-phase run
    phases: list[PhaseRecord] = field(default_factory=list)
    step: int | None = None  # the phase's optimizer step
    run_step: int | None = None  # counted over all phases
    validation: dict | None = None  # the validation row at that step
    best: BestCheckpoint | None = None  # the phase's best record

    @property
    def model_section(self) -> dict:
        return (self.config or {}).get("model") or {}


def recorded_step(folder: Path, phase_dir: Path | None) -> int | None:
    """``checkpoint-N``: N; else the saved trainer state's step; a phase's ``final/`` (saved
    without trainer state): the phase's last logged step; else unknown."""
    step = step_of(folder)
    if step is not None:
        return step
    state = read_json(folder / TRAINER_STATE)
    if isinstance(state, dict) and isinstance(state.get("global_step"), int):
        return state["global_step"]
    if phase_dir is not None and folder.name == FINAL:
        return read_phase(phase_dir.name, phase_dir).steps or None
    return None


def _config(folder: Path) -> dict:
    cfg = read_config(folder)
    return cfg if isinstance(cfg, dict) else {}


def _phase_record(phase: Phase) -> PhaseRecord:
    cfg = _config(phase.folder)
    return PhaseRecord(phase.name, cfg.get("trainer"), (cfg.get("reward") or {}).get("name"), phase.steps)


def read_run_record(checkpoint: str | Path) -> RunRecord:
    """Everything the run folder around ``checkpoint`` records about it; a missing or
    unreadable record stays None (a checkpoint copied out of its run has none)."""
    ckpt = Path(checkpoint).resolve()
    phase_dir = ckpt.parent
    config = _config(phase_dir)
    if not config:
        return RunRecord(ckpt, step=recorded_step(ckpt, None))
    rec = RunRecord(ckpt, config=config, step=recorded_step(ckpt, phase_dir))
    rec.base_model = (config.get("model") or {}).get("name_or_path") or None
    root = phase_dir.parent
    if any(folder == phase_dir for _, folder in phase_folders(root)):
        phases = read_phases(root)
        rec.phases = [_phase_record(p) for p in phases]
        this = next(p for p in phases if p.folder == phase_dir)
        rec.phase = this.name
        rec.run_step = None if rec.step is None else this.offset + rec.step
        first = (_config(phases[0].folder).get("model") or {}).get("name_or_path") or None
        if first != rec.base_model:
            rec.phase_start, rec.base_model = rec.base_model, first
    else:
        rec.phases = [_phase_record(read_phase(phase_dir.name, phase_dir))]
    rows = [r for r in read_jsonl(phase_dir / VALIDATION_LOG) if r.get("step") == rec.step]
    rec.validation = rows[-1] if rows and rec.step is not None else None
    rec.best = read_best(phase_dir)
    return rec


def _value(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return UNKNOWN if v is None else str(v)


def export_card(
    rec: RunRecord, model_name: str, how: str, dtype: str, versions: dict[str, str], adapter_base: str | None = None
) -> str:
    """The exported folder's ``README.md``: how it was exported and what the run recorded
    (``unknown`` where it recorded nothing). ``adapter_base``: the model a kept LoRA adapter
    loads onto (the card of an adapter folder then says ``library_name: peft``)."""
    cfg = rec.config or {}
    reward = cfg.get("reward") or {}
    method = {"sft": "SFT"}.get(cfg.get("trainer") or "", "GRPO")
    base = rec.base_model or ""
    step = _value(rec.step)
    if rec.phase is not None:
        step += f" of phase `{rec.phase}`" + (f" (step {rec.run_step} of the run)" if rec.run_step is not None else "")
    reward_line = f"`{reward['name']}`" if reward.get("name") else UNKNOWN
    if reward.get("params"):
        reward_line += f", parameters `{json.dumps(reward['params'], sort_keys=True)}`"
    lines = [
        *_header(
            adapter_base or base,
            ["trl", method.lower(), CARD_TAG, *(["lora"] if adapter_base else [])],
            "peft" if adapter_base else "transformers",
        ),
        "",
        f"# {model_name}",
        "",
        f"Exported by crystal-grpo (`scripts/export.py`) from `{rec.checkpoint}`: {how}, {dtype}. "
        + (
            f"Fine-tuned from {_origin(base)} with {method} (TRL): CRYSTAL's step-level rewards (Match F1, "
            "Causal Process Reward)."
            if rec.config
            else "No run records lie beside that checkpoint (the phase "
            "folder's config.json, validation.jsonl), so how it was trained is unknown."
        ),
        "",
        f"- Base model: {f'`{base}`' if base else UNKNOWN}",
        *([f"- This phase started from: `{rec.phase_start}`"] if rec.phase_start else []),
        *(
            [f"- LoRA adapter for `{adapter_base}`: `PeftModel.from_pretrained(base_model, this_folder)`"]
            if adapter_base
            else []
        ),
        f"- Step: {step}",
        f"- Reward: {reward_line}",
    ]
    if rec.best:
        lines.append(
            f"- Best checkpoint of the phase by `{rec.best.metric}`: `{rec.best.checkpoint}` "
            f"(step {rec.best.step}, {_value(rec.best.value)})" + (", this one" if rec.best.step == rec.step else "")
        )
    lines += ["", "## Phases", ""]
    if rec.phases:
        lines += [
            "| phase | trainer | reward | steps |",
            "|---|---|---|---|",
            *(
                f"| {p.name}{' (this checkpoint)' if p.name == rec.phase else ''} | {_value(p.trainer)} | "
                f"{_value(p.reward)} | {p.steps} |"
                for p in rec.phases
            ),
        ]
    else:
        lines.append(f"{UNKNOWN} (no run records beside the checkpoint)")
    lines += ["", f"## Validation at step {_value(rec.step)}", ""]
    if rec.validation:
        lines += [
            "| metric | value |",
            "|---|---|",
            *(f"| {k} | {_value(v)} |" for k, v in rec.validation.items() if k != "step"),
        ]
    else:
        lines.append(f"{UNKNOWN} (no validation recorded at this step)")
    lines += ["", "## Framework versions", "", *(f"- {name}: {version}" for name, version in versions.items()), ""]
    return "\n".join(lines)
