"""scripts/export.py: checkpoints of tiny runs become standalone Hugging Face folders.

Two runs, made once: a two-phase run (GRPO on all weights, then a LoRA SFT phase whose
high learning rate moves the adapter away from zero) and the session's two-process DeepSpeed
ZeRO-3 run (tests/conftest.py's ``zero3_run``, which tests/test_distributed.py checks). Each
export must reload and give the logits of the checkpoint it came from: the full checkpoint's
own weights, the unmerged adapter over its base (PEFT), and for ZeRO-3 the weights the trainer
gathered from the live partitioned parameters at save time, an independent path from the
optimizer shards the export consolidates.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crystal_grpo.jsonl import read_jsonl
from crystal_grpo.train import grpo
from crystal_grpo.train.tools.export import MANIFEST, export, main

PHASES = (
    "[{name: grpo, init_from: none, overrides: {training: {max_steps: 2, max_completion_length: 32}}}, "
    "{name: lora, trainer: sft, init_from: last, overrides: {model: {lora: {r: 4, alpha: 8, dropout: 0.0}}, "
    "validation: {at_start: false}, training: {max_steps: 2, learning_rate: 0.05, "
    "per_device_train_batch_size: 2}}}]"
)
#: Validation at the start and the end only (steps 0 and 2), of 2 rows.
SMALL = [
    "--validation.eval_steps",
    "0",
    "--validation.max_samples",
    "2",
    "--validation.max_new_tokens",
    "16",
    "--data.max_train_samples",
    "8",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_lm_path) -> Path:
    """phase1-grpo: full weights, saved every step; phase2-lora: a LoRA adapter."""
    out = tmp_path_factory.mktemp("export") / "run"
    assert (
        grpo.main(
            [
                "--config",
                "tiny.yaml",
                "--output_dir",
                str(out),
                "--model.name_or_path",
                str(tiny_lm_path),
                "--phases",
                PHASES,
                *SMALL,
            ]
        )
        == 0
    )
    return out


# zero3_run: the session's two-process DeepSpeed ZeRO-3 run (tests/conftest.py), shared with
# tests/test_distributed.py.


@pytest.fixture(scope="module")
def full_export(run, tmp_path_factory) -> tuple[Path, list[str]]:
    lines: list[str] = []
    out = tmp_path_factory.mktemp("exports") / "grpo-2"
    export(run / "phase1-grpo" / "checkpoint-2", out, max_shard_size="200KB", say=lines.append)
    return out, lines


def logits(model, tok) -> torch.Tensor:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 apples and buys 4 more."}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return model(**ids).logits


def causal_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def lora_reference(ckpt: Path):
    """The LoRA checkpoint as training left it: the adapter, unmerged, over its base (PEFT)."""
    from peft import PeftModel

    base = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    return PeftModel.from_pretrained(causal_lm(base), ckpt).eval(), base


def assert_same(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_full_checkpoint_becomes_a_sharded_folder_with_the_same_logits(run, full_export):
    out, lines = full_export
    ckpt = run / "phase1-grpo" / "checkpoint-2"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)  # 200KB shards of a 0.5 MB model
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja", "README.md"):
        assert (out / name).is_file(), name
    assert not any(p.name.startswith(".") for p in out.parent.iterdir())  # no temporary folder left beside it
    tok = tokenizer(out)
    assert tok.chat_template  # generation in a harness needs the training chat template
    assert_same(logits(causal_lm(out), tok), logits(causal_lm(ckpt), tokenizer(ckpt)), atol=1e-6)
    assert any(line.startswith("  check: reloaded with AutoModelForCausalLM") for line in lines)
    assert lines[-1].startswith(f"exported {out} (full, float32")
    assert not any("warning" in line for line in lines)


def test_a_checkpoint_without_its_completion_marker_is_exported_with_a_warning(run, tmp_path):
    ckpt = shutil.copytree(run / "phase1-grpo" / "checkpoint-1", tmp_path / "run" / "checkpoint-1")
    (ckpt / "checkpoint_complete.json").unlink()  # as if the run was killed before the marker
    lines: list[str] = []
    export(ckpt, tmp_path / "out", say=lines.append)
    assert lines[1].startswith(f"  warning: {ckpt} has no checkpoint_complete.json: the run may have been stopped")


def test_card_names_base_model_reward_step_and_validation(run, full_export, tiny_lm_path):
    card = (full_export[0] / "README.md").read_text()
    val = [r for r in read_jsonl(run / "phase1-grpo" / "validation.jsonl") if r["step"] == 2][-1]
    assert f"- Base model: `{tiny_lm_path}`" in card
    assert '- Reward: `cpr`, parameters `{"device": "cpu", "encoder": "packaged:all-MiniLM-L6-v2"}`' in card
    assert "- Step: 2 of phase `grpo` (step 2 of the run)" in card
    assert "| grpo (this checkpoint) | grpo | cpr | 2 |" in card and "| lora | sft | cpr | 2 |" in card
    assert "## Validation at step 2" in card
    for key in ("accuracy", "f1", "format_rate", "reward"):
        assert f"| {key} | {val[key]:.4g} |" in card, key


def test_lora_checkpoint_merged_gives_the_adapters_logits_not_the_bases(run, tmp_path):
    from safetensors.torch import load_file

    ckpt = run / "phase2-lora" / "checkpoint-2"
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), "training must move B off zero"
    reference, base = lora_reference(ckpt)
    assert base == str(run / "phase1-grpo" / "final")  # phase 2 started from phase 1's last weights
    lines: list[str] = []
    export(ckpt, tmp_path / "merged", say=lines.append)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    tok = tokenizer(tmp_path / "merged")
    merged = logits(causal_lm(tmp_path / "merged"), tok)
    assert_same(merged, logits(reference, tok), atol=1e-4)  # merged weights round differently
    assert (merged - logits(causal_lm(base), tok)).abs().max() > 1e-3  # the adapter really is in the weights
    card = (tmp_path / "merged" / "README.md").read_text()
    assert f"- This phase started from: `{base}`" in card and "LoRA adapter merged into" in card


def test_lora_checkpoint_kept_as_an_adapter_reloads_with_peft(run, tmp_path, monkeypatch):
    from peft import PeftModel

    ckpt = run / "phase2-lora" / "checkpoint-2"
    reference, base = lora_reference(ckpt)
    out = tmp_path / "adapter"
    assert main([str(ckpt), "--out", str(out), "--keep_adapter"]) == 0
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"} <= set(os.listdir(out))
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    assert "library_name: peft" in (out / "README.md").read_text()
    monkeypatch.chdir(tmp_path)  # the adapter names its base by an absolute path: it loads from anywhere
    tok = tokenizer(out)
    assert_same(logits(PeftModel.from_pretrained(causal_lm(base), out), tok), logits(reference, tok), atol=1e-6)


def test_zero3_shards_are_consolidated_on_one_cpu_process(zero3_run, tmp_path):
    ckpt = zero3_run / "checkpoint-2"
    assert len(list((ckpt / "global_step2").glob("*optim_states.pt"))) == 2
    lines: list[str] = []
    export(ckpt, tmp_path / "z3", say=lines.append)
    assert any(
        "fp32 master weights of the ZeRO shards, consolidated by DeepSpeed" in line and "from 2 ranks" in line
        for line in lines
    )
    tok = tokenizer(tmp_path / "z3")
    exported = logits(causal_lm(tmp_path / "z3"), tok)
    # The trainer's gathered save (fp32 training, so a full-precision copy) is the independent reference.
    assert_same(exported, logits(causal_lm(ckpt), tok), atol=1e-6)

    # The shards win over the consolidated model.safetensors beside them: other weights in that file
    # (marked as saved, so the checkpoint is complete and intact) leave the export unchanged.
    from safetensors.torch import load_file, save_file

    from crystal_grpo.train.run.checkpoints import write_marker

    copy = tmp_path / "copied" / "checkpoint-2"  # copied out of its run: no run records either
    shutil.copytree(ckpt, copy)
    save_file(
        {k: v + 0.5 for k, v in load_file(copy / "model.safetensors").items()},
        copy / "model.safetensors",
        metadata={"format": "pt"},
    )
    write_marker(copy, 2)
    assert (logits(causal_lm(copy), tok) - exported).abs().max() > 1e-2
    export(copy, tmp_path / "z3-copy", say=lambda _: None)
    assert_same(logits(causal_lm(tmp_path / "z3-copy"), tok), exported, atol=1e-6)
    card = (tmp_path / "z3-copy" / "README.md").read_text()
    assert "- Base model: unknown" in card and "- Step: 2" in card and "unknown (no validation" in card


def test_failed_export_leaves_no_folder_and_keeps_the_good_one(run, full_export, tmp_path, capsys):
    broken = tmp_path / "broken" / "checkpoint-2"
    shutil.copytree(run / "phase1-grpo" / "checkpoint-2", broken)
    (broken / "checkpoint_complete.json").unlink()  # a checkpoint copied without its marker
    (broken / "chat_template.jinja").write_text("{% for message in messages %}{{ message.content ")  # unclosed tag
    exports = tmp_path / "exports"
    exports.mkdir()
    # Fails in the check after the weights were written: nothing appears, nothing is left beside it.
    assert main([str(broken), "--out", str(exports / "new" / "deeper")]) == 1
    assert "export failed, nothing written to" in capsys.readouterr().err
    assert list(exports.iterdir()) == []  # not even the parent folders it made
    # An existing good export: refused without --overwrite, untouched by a failed --overwrite.
    good = exports / "good"
    shutil.copytree(full_export[0], good)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    assert main([str(broken), "--out", str(good)]) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err
    assert main([str(broken), "--out", str(good), "--overwrite"]) == 1
    assert f"export failed, nothing written to {good}" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before and os.listdir(exports) == ["good"]
    # An --out that holds the checkpoint (here its run folder) is never swapped away.
    assert main([str(run / "phase1-grpo" / "checkpoint-2"), "--out", str(run / "phase1-grpo"), "--overwrite"]) == 2
    assert "overlaps the checkpoint" in capsys.readouterr().err and (run / "phase1-grpo" / "checkpoint-2").is_dir()
    # A truncated weights file is bad input, caught before anything is written.
    trunc = tmp_path / "trunc" / "checkpoint-2"
    shutil.copytree(run / "phase1-grpo" / "checkpoint-2", trunc)
    with open(trunc / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    assert main([str(trunc), "--out", str(exports / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: broken checkpoint:") and "model.safetensors" in err and err.count("\n") == 1
    # --overwrite with a good checkpoint swaps the new folder in (here in bfloat16).
    assert (
        main([str(run / "phase1-grpo" / "checkpoint-2"), "--out", str(good), "--overwrite", "--dtype", "bfloat16"])
        == 0
    )
    assert os.listdir(exports) == ["good"] and json.loads((good / "config.json").read_text())["dtype"] == "bfloat16"
    weights = causal_lm(good).state_dict()
    for name, tensor in causal_lm(run / "phase1-grpo" / "checkpoint-2").state_dict().items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_overwrite_replaces_only_an_export(run, full_export, tmp_path, capsys):
    """Lost files: --overwrite on a folder that is no export, or an export holding
    a user's file, is refused in one line and loses nothing; an export carries its marker."""
    ckpt = str(run / "phase1-grpo" / "checkpoint-2")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "mine.txt").write_text("not an export")
    assert main([ckpt, "--out", str(mine), "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {mine} holds mine.txt but is no export ({MANIFEST}, the list "
        "every export writes, is missing or unreadable); --overwrite replaces only an "
        "export: choose another --out\n"
    )
    assert os.listdir(mine) == ["mine.txt"] and (mine / "mine.txt").read_text() == "not an export"
    listed = json.loads((full_export[0] / MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in full_export[0].iterdir() if p.name != MANIFEST)
    exported = shutil.copytree(full_export[0], tmp_path / "exported")
    (exported / "notes.txt").write_text("my notes on this export")
    assert main([ckpt, "--out", str(exported), "--overwrite"]) == 2
    assert f"--out {exported} holds notes.txt, which the export there did not write" in capsys.readouterr().err
    assert (exported / "notes.txt").read_text() == "my notes on this export"


def test_a_marker_naming_a_file_outside_its_folder_is_no_export_s(tmp_path):
    """--overwrite replaced an export whose marker also listed ../victim.txt, then deleted that file
    outside it with the old export (second hostile set)."""
    from crystal_grpo.train.tools.export import overwrite_problem

    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "model.safetensors").write_bytes(b"12345")
    (tmp_path / "victim.txt").write_text("outside the export")
    (forged / MANIFEST).write_text(json.dumps({"files": {"model.safetensors": 5, "../victim.txt": 18}}))
    assert overwrite_problem(forged) == (
        f"--out {forged} holds {MANIFEST}, model.safetensors but is no export "
        f"({MANIFEST}, the list every export writes, is missing or unreadable); "
        "--overwrite replaces only an export: choose another --out"
    )
    (forged / MANIFEST).write_text(json.dumps({"files": {"model.safetensors": 5}}))
    assert overwrite_problem(forged) is None  # the same export, its marker its own


def test_a_killed_export_s_partial_folder_is_removed_by_the_next_export_to_its_out(run, tmp_path):
    """kill -9 during an export left .e.partial-* beside --out for ever, a model's worth of disk; a
    later export to the same --out did not notice it (third hostile set). One still in use stays."""
    import fcntl

    out = tmp_path / "e"
    killed = tmp_path / ".e.partial-killed"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"0" * 1000)
    live = tmp_path / ".e.partial-live"
    live.mkdir()
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running export holds its own
    (tmp_path / ".other.partial-x").mkdir()  # another --out's
    said = []
    try:
        export(run / "phase1-grpo" / "checkpoint-2", out, say=said.append)
    finally:
        os.close(held)
    assert f"  removed {killed} (0.0 MB), left by an export to {out} that was stopped before its end" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == [".e.partial-live", ".other.partial-x", "e"]


def test_not_a_checkpoint_is_one_line_and_exit_2(run, repo_root, tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/export.py", str(run / "phase1-grpo"), "--out", str(tmp_path / "x")],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"error: {run / 'phase1-grpo'}: not a checkpoint; expected")
    assert "model.safetensors + config.json" in proc.stderr and not (tmp_path / "x").exists()


def test_vision_language_model_keeps_its_processor(tiny_vlm_path, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    lines: list[str] = []
    out = tmp_path / "vlm"
    export(tiny_vlm_path, out, say=lines.append)  # a model folder outside any run: the card says unknown
    assert json.loads((out / "processor_config.json").read_text())["processor_class"].endswith("Qwen2_5_VLProcessor")
    assert any("reloaded with Qwen2_5_VLForConditionalGeneration" in line for line in lines)
    tok = tokenizer(out)
    load = lambda p: Qwen2_5_VLForConditionalGeneration.from_pretrained(p).eval()
    assert_same(logits(load(out), tok), logits(load(tiny_vlm_path), tok), atol=1e-6)
    assert "how it was trained is unknown" in (out / "README.md").read_text()


def test_the_removed_merge_lora_flag_is_one_line(tmp_path, capsys):
    """--merge_lora changed nothing (merging is what export does without --keep_adapter): an old
    command line using it gets one line and exit 2, not a traceback, and nothing is written."""
    assert main([str(tmp_path), "--out", str(tmp_path / "x"), "--merge_lora"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --merge_lora is gone") and "--keep_adapter" in err
    assert not (tmp_path / "x").exists()


def test_a_shard_size_that_is_no_size_is_one_line_before_anything_loads(tmp_path, capsys):
    """--max_shard_size abc: the model loaded, then a traceback and "export failed"."""
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "--out", str(tmp_path / "e"), "--max_shard_size", "abc"])
    assert stop.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith("argument --max_shard_size: 'abc': expected a size such as 5GB, 500MB or a number of bytes")
    )
    assert not (tmp_path / "e").exists()
