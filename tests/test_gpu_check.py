"""The true-scale GPU check (scripts/gpu_check.py): the 3B model's configuration, the report's
arithmetic, and the whole check on CPU with the tiny VLM (the same code path as on a GPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crystal_grpo.train.benchmarks import gpu_check
from crystal_grpo.train.capacity.estimate import QWEN25_VL_3B_CONFIG, sizes_from_config

REPO = Path(__file__).resolve().parents[1]


def test_the_3b_model_is_the_published_configuration_with_the_project_tokens():
    from transformers import AutoConfig

    from crystal_grpo.train.fixtures.tiny_models import vlm_tokenizer

    tok, ids = vlm_tokenizer()
    raw = gpu_check.qwen25_vl_3b_config(ids, tok.eos_token_id, tok.pad_token_id)
    cfg = AutoConfig.for_model(**raw)
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        2048,
        36,
        16,
        2,
    )
    assert (text.intermediate_size, text.vocab_size, cfg.tie_word_embeddings) == (11008, 151936, True)
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.out_hidden_size) == (
        32,
        1280,
        3420,
        2048,
    )
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") != QWEN25_VL_3B_CONFIG["image_token_id"]
    assert cfg.vision_start_token_id == ids["<|vision_start|>"] and text.eos_token_id == tok.eos_token_id
    ours, published = sizes_from_config(raw), sizes_from_config(QWEN25_VL_3B_CONFIG)
    assert ours.total == published.total and 3.7e9 < ours.total < 3.8e9


def test_a_random_vlm_from_a_config_loads_and_reads_an_image(tmp_path):
    """build_random_vlm (what builds the 3B on the GPU) on a shrunk 3B config, on CPU: the run's
    loader takes it, the image tokens are the tokenizer's, and a forward pass reads a picture."""
    from PIL import Image

    from crystal_grpo.train.fixtures.tiny_models import build_random_vlm
    from crystal_grpo.train.models.loading import ModelSection, load_policy

    def shrunk(ids, eos, pad):
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        vision["fullatt_block_indexes"] = [0]
        return {
            **gpu_check.qwen25_vl_3b_config(ids, eos, pad),
            **small,
            "vocab_size": 1000,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {**QWEN25_VL_3B_CONFIG["vision_config"], **vision},
        }

    path = build_random_vlm(tmp_path / "vlm", shrunk)
    model, processor = load_policy(ModelSection(name_or_path=str(path), dtype="float32"))
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.new("RGB", (224, 168), (200, 30, 30))], return_tensors="pt")
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == 48  # 224 x 168 pixels: 8 x 6 tokens
    assert torch.isfinite(model(**inputs).logits).all()


def summary(wall: float, gen: float, tokens: float, peak: float = math.nan) -> dict:
    return {"wall": wall, "gen": gen, "tokens": tokens, "peak": peak, "zero3": True}


def test_report_rows_ratios_per_token_and_mark_what_was_not_measured():
    rows = {
        "zero3-lora-pcgrad": gpu_check.arm_row("zero3-lora-pcgrad", summary(3.0, 1.5, 100.0, 20.0), 16.0, 8),
        "trl-zero3-lora-cpr": gpu_check.arm_row("trl-zero3-lora-cpr", summary(2.0, 1.0, 50.0), 16.0, 8),
        "zero3-full-pcgrad": gpu_check.arm_row("zero3-full-pcgrad", summary(4.0, 1.0, 64.0), 100.0, 8),
    }
    rows = gpu_check.with_trl_ratios(rows)
    ours, trl, full = rows["zero3-lora-pcgrad"], rows["trl-zero3-lora-cpr"], rows["zero3-full-pcgrad"]
    assert ours["peak_gib"] == 20.0 and ours["peak_over_predicted"] == 20.0 / 16.0
    assert trl["peak_gib"] is None and trl["peak_over_predicted"] is None  # CPU: not measured, not 0
    assert ours["generation_share"] == 0.5 and ours["tokens_per_s"] == 100.0 * 8 / 3.0
    assert ours["step_over_trl"] == (3.0 / 100.0) / (2.0 / 50.0)  # per completion token
    assert trl["step_over_trl"] is None and full["step_over_trl"] is None  # no full-weights TRL arm ran
    lines = gpu_check.table(rows).splitlines()
    assert lines[0].split() == list(gpu_check.COLUMNS) and len(lines) == 4
    assert lines[2].split()[1:5] == ["yes", "n/m", "16.00", "n/m"]


def test_the_step_clock_says_whether_the_parameters_are_zero3_partitions(tmp_path):
    """A model outside DeepSpeed is recorded as such (the CPU check below sees the other side)."""
    from types import SimpleNamespace

    from crystal_grpo.train.benchmarks.training import CLOCK_FILE, step_clock

    clock, state = step_clock(tmp_path), SimpleNamespace(is_world_process_zero=True)
    clock.on_train_begin(None, state, None, model=torch.nn.Linear(2, 2))
    clock.on_step_end(None, state, None)
    clock.on_train_end(None, state, None)
    record = json.loads((tmp_path / CLOCK_FILE).read_text())
    assert record["zero3"] is False and len(record["wall"]) == 1
    assert record["peak_gib"] is None if not torch.cuda.is_available() else record["peak_gib"] > 0


def test_the_3b_model_without_cuda_is_one_line_before_anything_loads(tmp_path):
    def never(*args):
        raise AssertionError("nothing is built before the arguments are checked")

    with pytest.raises(SystemExit, match="--model 3b needs a CUDA GPU; --model tiny runs the same check on CPU"):
        gpu_check.main(never, never, ["--model", "3b", "--device", "cpu", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--arms: unknown \['zero3-lora'\]"):
        gpu_check.main(never, never, ["--arms", "zero3-lora", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def run_check(tmp_path: Path, model: Path, device: str) -> tuple[dict, str]:
    out = tmp_path / "check"
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--model", str(model), "--device", device, "--out", str(out)]
        + ["--steps", "1", "--warmup", "1", "--completion_length", "16"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / gpu_check.REPORT).read_text()), proc.stdout


def check_report(report: dict, stdout: str) -> None:
    assert list(report["arms"]) == list(gpu_check.ARMS) and not report["skipped"]
    for name, row in report["arms"].items():
        assert list(row) == list(gpu_check.COLUMNS[:-1]) + ["step_over_trl"], name
        assert row["zero3"] is True, f"{name} did not run under ZeRO-3"
        assert row["step_s"] > 0 and 0 < row["generation_share"] < 1, row
        assert 0 < row["completion_tokens"] <= 16 and row["predicted_gib"] > 0, row
        assert math.isclose(row["tokens_per_s"], row["completion_tokens"] * 8 / row["step_s"])
        assert (row["step_over_trl"] is None) == name.startswith("trl-"), row
        assert name in stdout
    assert report["settings"]["steps"] == 1 and stdout.splitlines()[-6].split() == list(gpu_check.COLUMNS)


def test_the_check_on_cpu_reports_every_column_for_every_arm(tmp_path, tiny_vlm_path):
    report, stdout = run_check(tmp_path, tiny_vlm_path, "cpu")
    check_report(report, stdout)
    assert report["device"].startswith("CPU")
    assert all(r["peak_gib"] is None and r["peak_over_predicted"] is None for r in report["arms"].values())
    # each arm trained its steps under ZeRO-3, this framework's with PCGrad
    for name in gpu_check.ARMS:
        run = tmp_path / "check" / name
        saved = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else None
        steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in steps if "loss" in r] == [1, 2], name
        if saved is not None:  # this framework's runs record their config
            assert saved["pcgrad"] is True and saved["training"]["deepspeed"] == gpu_check.ZERO3_JSON


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_check_on_cuda_measures_peak_memory(tmp_path, tiny_vlm_path):
    report, stdout = run_check(tmp_path, tiny_vlm_path, "cuda")
    check_report(report, stdout)
    assert all(r["peak_gib"] > 0 and r["peak_over_predicted"] > 0 for r in report["arms"].values())
