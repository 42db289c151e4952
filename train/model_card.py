"""The model card (``README.md``) in a run folder.

TRL's card links the base model as ``https://huggingface.co/<id>`` and, for a model loaded
from a local folder (every phase-2 start, every converted model), writes "fine-tuned
version of [None]". This card names the base model either way and says how it was
trained and where the run's own records are.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml


def _base_model(trainer) -> str:
    config = getattr(trainer.model, "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


def model_card(base_model: str, model_name: str, reward_names: list[str], versions: dict[str, str],
               method: str = "GRPO") -> str:
    """Markdown with a YAML header; ``base_model`` is a hub id or a local path."""
    local = not base_model or os.path.isdir(base_model) or os.path.isabs(base_model)
    header = {"library_name": "transformers", "tags": ["trl", method.lower(), "crystal-grpo"]}
    if base_model and not local:
        header["base_model"] = base_model
    origin = (f"the local model `{base_model}`" if local and base_model else
              "a model of unknown origin" if not base_model else
              f"[{base_model}](https://huggingface.co/{base_model})")
    lines = [
        "---", yaml.safe_dump(header, sort_keys=False).strip(), "---", "",
        f"# {model_name}", "",
        f"Fine-tuned from {origin} with {method} (TRL) by crystal-grpo: CRYSTAL's step-level rewards "
        "(Match F1, Causal Process Reward) and the warm start that teaches their output format.", "",
        f"- Reward functions: {', '.join(f'`{r}`' for r in reward_names) or '-'}",
        "- The run folder holds the full configuration (`config.json`), the training log "
        "(`metrics.jsonl`) and validation (`validation.jsonl`, `best_checkpoint.json`).",
        "", "## Framework versions", "",
        *(f"- {name}: {version}" for name, version in versions.items()), "",
    ]
    return "\n".join(lines)


def write_model_card(trainer, model_name: str | None = None) -> Path:
    import torch
    import transformers
    import trl

    out = Path(trainer.args.output_dir) / "README.md"
    versions = {"TRL": trl.__version__, "Transformers": transformers.__version__, "PyTorch": torch.__version__}
    out.write_text(model_card(_base_model(trainer), model_name or Path(trainer.args.output_dir).name,
                              list(getattr(trainer, "reward_func_names", [])), versions,
                              getattr(trainer, "_name", "GRPO")), encoding="utf-8")
    return out
