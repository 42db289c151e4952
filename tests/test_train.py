"""End-to-end GRPO runs of train/grpo.py with tiny models on CPU: every reward, a VLM,
checkpoints, resume, config and data errors, the non-finite guard and validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import TrainerCallback

from crystal_grpo import rewards as rewards_pkg
from crystal_grpo.rewards.base import RewardModule
from crystal_grpo.rewards.parsing import parse_completion
from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import load_config
from crystal_grpo.train.data.splits import DataError, load_split


def run_main(tmp_path: Path, model: Path, *overrides: str, config: str = "tiny.yaml", resume=None) -> Path:
    out = tmp_path / "run"
    argv = ["--config", config, "--output_dir", str(out), "--model.name_or_path", str(model), *overrides]
    if resume:
        argv += ["--resume_from_checkpoint", resume]
    assert grpo.main(argv) == 0
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "reward, components",
    [
        ("cpr", ["cpr_accuracy", "cpr_reasoning"]),
        ("composite", ["composite_reasoning", "composite_accuracy", "composite_format"]),
        ("answer_only", ["answer_only_accuracy", "answer_only_format"]),
        ("format", ["format"]),
    ],
)
def test_grpo_run_logs_every_component(tmp_path, tiny_lm_path, reward, components):
    run = run_main(tmp_path, tiny_lm_path, "--reward.name", reward, "--validation.eval_steps", "0")
    rows = [r for r in metrics(run) if "loss" in r]
    assert len(rows) == 2 and rows[-1]["step"] == 2
    for comp in components:
        assert all(f"rewards/{comp}/mean" in r for r in rows), comp
    if reward != "format":
        assert f"{reward}/accuracy" in rows[-1] and "kl_max" in rows[-1]
    assert (run / "checkpoint-2" / "model.safetensors").exists()
    assert (run / "final" / "model.safetensors").exists()
    assert (run / "training_curves.png").stat().st_size > 1000
    card = (run / "README.md").read_text()
    assert "[None]" not in card and f"Fine-tuned from the local model `{tiny_lm_path}`" in card


def test_reference_steps_are_embedded_before_the_first_step(tmp_path, tiny_lm_path, monkeypatch):
    """Every reference the reward meets is already pinned, so no step encodes a reference."""
    from crystal_grpo.rewards.match_f1 import MatchF1Scorer

    calls = []
    score = MatchF1Scorer.score

    def recording_score(self, predicted, references):
        refs = {s for chains in references for chain in chains for s in chain}
        calls.append((len(refs), refs - set(self._pinned)))
        return score(self, predicted, references)

    monkeypatch.setattr(MatchF1Scorer, "score", recording_score)
    run_main(
        tmp_path,
        tiny_lm_path,
        "--reward.name",
        "cpr",
        "--validation.eval_steps",
        "0",
        "--validation.at_start",
        "false",
    )
    train_calls, (_, val_unpinned) = calls[:-1], calls[-1]  # 2 steps, then the final validation
    assert len(train_calls) == 2 and all(n > 0 and not unpinned for n, unpinned in train_calls)
    assert val_unpinned  # validation rows are not the training set's: the check can fail
    assert RewardModule.pin_references(rewards_pkg.build_reward("format"), [{"reference_steps": ["a"]}]) == 0


class BrevityReward(RewardModule):
    """A reward defined in this file alone: fewer steps score higher (objective: accuracy)."""

    name = "brevity"
    objectives = {"brevity": "accuracy"}
    uses_steps = False

    def components(self, batch):
        return {"brevity": 1.0 / (1.0 + batch.n_pred)}


def test_a_new_reward_is_one_class_and_one_registry_line(tmp_path, tiny_lm_path, monkeypatch):
    monkeypatch.setattr(rewards_pkg, "REWARDS", dict(rewards_pkg.REWARDS))  # registered for this test only
    rewards_pkg.register_reward(BrevityReward)
    run = run_main(tmp_path, tiny_lm_path, "--reward.name", "brevity", "--validation.eval_steps", "0")
    rows = [r for r in metrics(run) if "loss" in r]
    assert len(rows) == 2 and all("rewards/brevity/mean" in r and "brevity/steps_mean" in r for r in rows)
    assert all(0 < r["rewards/brevity/mean"] <= 1 for r in rows)
    assert "brevity" in json.loads((run / "checkpoint-2" / "crystal_state.json").read_text())["rewards"]
    assert json.loads((run / "validation.jsonl").read_text().splitlines()[-1])["reward"] > 0


def test_checkpoint_reloads_and_generates(tmp_path, tiny_lm_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = run_main(tmp_path, tiny_lm_path, "--validation.eval_steps", "0", "--training.log_completions", "true")
    ckpt = run / "checkpoint-2"
    state = json.loads((ckpt / "crystal_state.json").read_text())
    # The guard's window: the step counts of the 2 steps x 4 completions that have steps.
    counts = [
        len(parse_completion(c if isinstance(c, str) else list(c)).steps)  # messages: array after parquet
        for step in (1, 2)
        for c in _step_column(run, step, "completion")
    ]
    assert len(counts) == 8 and any(counts)
    assert state["rewards"]["cpr"]["guard"]["history"] == [n for n in counts if n > 0]
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    before = AutoModelForCausalLM.from_pretrained(tiny_lm_path)
    changed = any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.state_dict().values()))
    assert changed, "training must change the weights"
    ids = tok("Tom has 3 apples.", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 5


def _step_column(run: Path, step: int, column: str) -> list:
    return list(pd.read_parquet(run / "completions" / f"completions_{step:05d}.parquet")[column])


def _step_prompts(run: Path, step: int) -> list[str]:
    return [str(p) for p in _step_column(run, step, "prompt")]


def test_validation_metrics_and_best_checkpoint(tmp_path, tiny_lm_path):
    run = run_main(tmp_path, tiny_lm_path, "--training.save_steps", "100", "--validation.metric", "format_rate")
    vals = [json.loads(x) for x in (run / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in vals] == [0, 2]  # validation.at_start: step 0 too
    for key in ("accuracy", "f1", "precision", "recall", "ordered_f1", "format_rate", "steps_mean"):
        assert key in vals[0]
    best = json.loads((run / "best_checkpoint.json").read_text())
    assert best["metric"] == "format_rate" and best["step"] == 2
    assert (run / best["checkpoint"]).is_dir(), "a save is requested when the metric improves"
    assert any("val_accuracy" in r for r in metrics(run))


def test_sampled_validation_keeps_every_scored_completion_and_leaves_training_alone(tmp_path, tiny_lm_path):
    """validation.temperature > 0: num_samples completions a row, each written with its scores;
    drawn from a seed fixed per step, so the training rollouts are those of a run without it.
    Each round's alignment viewer is written."""
    sampled = run_main(
        tmp_path / "a",
        tiny_lm_path,
        "--validation.temperature",
        "1.0",
        "--validation.num_samples",
        "3",
        "--validation.eval_steps",
        "1",
        "--training.log_completions",
        "true",
    )
    plain = run_main(
        tmp_path / "b",
        tiny_lm_path,
        "--validation.eval_steps",
        "0",
        "--validation.at_start",
        "false",
        "--training.log_completions",
        "true",
    )
    lines = [json.loads(x) for x in (sampled / "validation_samples_step1.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 4 and [x["sample"] for x in lines[:3]] == [0, 1, 2]  # max_samples 4 rows x 3
    assert {"id", "completion", "correct", "format_ok", "steps", "f1", "difficulty"} <= set(lines[0])
    val = [json.loads(x) for x in (sampled / "validation.jsonl").read_text().splitlines()]
    assert val[1]["accuracy"] == pytest.approx(sum(x["correct"] for x in lines) / len(lines))
    assert len({x["completion"] for x in lines}) > 4, "sampled, not greedy: a row's samples differ"
    page = (sampled / "validation_steps_step1.html").read_text()  # the alignment viewer of that round
    assert page.count('<section class="row') == 12 and page.count("advantage ") == 12  # 3 samples a row: a group
    rewards = lambda run: [r["reward"] for r in metrics(run) if "loss" in r]
    assert rewards(sampled) == rewards(plain)


class InjectNaN(TrainerCallback):
    """Poison the gradients at chosen steps, just before the optimizer step."""

    def __init__(self, steps):
        self.steps, self.model, self.snapshots = set(steps), None, {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        p = next(x for x in model.parameters() if x.grad is not None)
        self.snapshots[state.global_step] = p.detach().clone()
        if state.global_step + 1 in self.steps:
            p.grad.fill_(float("nan"))
        else:  # a finite gradient that must move the weights, whatever the sampled rewards were
            p.grad.add_(1.0)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        p = next(x for x in model.parameters() if x.requires_grad)
        self.snapshots[(state.global_step, "after")] = p.detach().clone()


def _run_with_callback(tmp_path, model_path, cb, *overrides):
    cfg, _ = load_config(
        "tiny.yaml", ["--model.name_or_path", str(model_path), "--validation.eval_steps", "0", *overrides]
    )
    return grpo.run(cfg, tmp_path / "run", callbacks=[cb])


def test_nonfinite_gradient_skips_the_update(tmp_path, tiny_lm_path):
    cb = InjectNaN(steps={2})
    _run_with_callback(tmp_path, tiny_lm_path, cb, "--training.max_steps", "3")
    # Step 2's update was skipped: weights after it equal weights before it.
    assert torch.equal(cb.snapshots[1], cb.snapshots[(1, "after")])
    assert not torch.equal(cb.snapshots[0], cb.snapshots[(0, "after")])
    rows = metrics(tmp_path / "run")
    assert [r["nonfinite_skipped_total"] for r in rows if "loss" in r] == [0.0, 1.0, 1.0]
    assert all(torch.isfinite(p).all() for p in [cb.snapshots[2]])


def test_consecutive_nonfinite_updates_save_and_stop(tmp_path, tiny_lm_path):
    cb = InjectNaN(steps=set(range(1, 10)))
    with pytest.raises(SystemExit, match="3 consecutive updates had non-finite"):
        _run_with_callback(
            tmp_path,
            tiny_lm_path,
            cb,
            "--training.max_steps",
            "8",
            "--stability.max_consecutive_nonfinite",
            "3",
            "--training.save_steps",
            "100",
        )
    assert (tmp_path / "run" / "checkpoint-3").is_dir(), "the run saves before it stops"


def test_bad_data_rows_are_listed_with_file_and_line(tmp_path):
    good = {"id": "a", "question": "1+1?", "answer": "2", "reference_steps": ["1 + 1 = 2."]}
    bad = [
        good,
        {**good, "answer": ""},
        "not json",
        {**good, "reference_steps": []},
        {**good, "image": "missing.png"},
        good,
        {**good, "answer": float("nan")},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in bad) + "\n")
    assert '"answer": NaN' in path.read_text()  # what json.dumps writes, and json.loads accepts
    with pytest.raises(DataError) as err:
        load_split(path)
    msg = str(err.value)
    for line in (2, 3, 4, 5, 7):
        assert f"{path}:{line}:" in msg
    assert f"{path}:1:" not in msg and "5 invalid row(s)" in msg and "unreadable image" in msg
    assert f"{path}:7: 'answer' is nan (JSON NaN/Infinity)" in msg
    split = load_split(path, skip_invalid=True)
    assert len(split.dataset) == 2 and split.skipped == 5


def test_rows_json_cannot_read_are_bad_rows_too(tmp_path):
    good = json.dumps({"id": "a", "question": "1+1?", "answer": "2", "reference_steps": ["1 + 1 = 2."]})
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b"\n".join(
            [good.encode(), b"\xff\xfe broken", b'{"answer": ' + b"9" * 5000 + b"}", b"[" * 100_000, good.encode()]
        )
        + b"\n"
    )
    with pytest.raises(DataError) as err:
        load_split(path)
    msg = str(err.value)
    assert f"{path}:2: not UTF-8 text" in msg and f"{path}:3: unreadable JSON (ValueError" in msg
    assert f"{path}:4: unreadable JSON (RecursionError" in msg and "3 invalid row(s)" in msg


def test_plain_python_entry_point_reports_data_errors(tmp_path, repo_root, tiny_lm_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q"}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "train/grpo.py",
            "--config",
            "tiny.yaml",
            "--data.train",
            str(path),
            "--model.name_or_path",
            str(tiny_lm_path),
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert f"{path}:1: missing or empty 'answer'" in proc.stderr


def test_unloadable_encoder_is_one_line_before_the_policy_loads(tmp_path, tiny_lm_path, capsys):
    argv = [
        "--config",
        "tiny.yaml",
        "--output_dir",
        str(tmp_path / "run"),
        "--model.name_or_path",
        str(tiny_lm_path),
        "--reward.params.encoder",
        str(tmp_path / "no-encoder"),
    ]
    assert grpo.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "cannot start: 1 problem(s)",
        f"  reward.params.encoder: no such folder '{tmp_path / 'no-encoder'}'",
    ]
    assert not (tmp_path / "run").exists()


def test_prompts_longer_than_the_context_are_counted_and_skipped_or_refused(tmp_path, tiny_lm_path, capsys):
    rows = [json.loads(x) for x in Path("data/wordproblems/train.jsonl").read_text().splitlines()[:8]]
    rows[2]["question"] = "x" * 51_000  # past the tiny model's 2,048 positions
    rows[5]["question"] = "How many apples? " + "apples and pears " * 3000
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--data.train", str(data), "--validation.eval_steps", "0", "--training.max_steps", "1"]
    run = run_main(tmp_path, tiny_lm_path, *argv)
    out = capsys.readouterr().out
    assert (
        f"warning: 2 of 8 prompt(s) of {data} leave no room for training.max_completion_length (48) in the "
        f"model's 2048 positions: longer than 2000 tokens (e.g. {rows[2]['id']}, {rows[5]['id']}); skipped"
    ) in out
    assert (run / "final").is_dir()
    argv += ["--output_dir", str(tmp_path / "refused"), "--data.long_prompts", "error"]
    assert grpo.main(["--config", "tiny.yaml", "--model.name_or_path", str(tiny_lm_path), *argv]) == 2
    assert "DataError: 2 of 8 prompt(s)" in capsys.readouterr().err


class DeleteImages(TrainerCallback):
    """After step 1, every image file but one disappears (a cleaned-up scratch disk)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            for p in sorted(self.folder.glob("*.png"))[1:]:
                p.unlink()


def test_an_image_deleted_mid_run_skips_its_row_with_a_warning(tmp_path, tiny_vlm_path, caplog):
    import shutil

    data = shutil.copytree("data/shapes", tmp_path / "shapes")
    cfg, _ = load_config(
        "tiny.yaml",
        [
            "--model.name_or_path",
            str(tiny_vlm_path),
            "--data.train",
            str(data / "shapes.jsonl"),
            "--data.validation",
            "null",
            "--data.validation_fraction",
            "0",
            "--data.max_train_samples",
            "null",
            "--training.max_steps",
            "4",
            "--training.save_steps",
            "100",
        ],
    )
    with caplog.at_level("WARNING"):
        grpo.run(cfg, tmp_path / "run", callbacks=[DeleteImages(data / "images")])
    assert [r["step"] for r in metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4]
    skipped = [r.getMessage() for r in caplog.records if "image is unreadable now" in r.getMessage()]
    assert skipped and "skipped, the next readable row takes its place (1 row(s) skipped so far)" in skipped[0]
    places = [m.split(": ")[0] for m in skipped]  # each row named by its file:line, once
    assert all(p.startswith(f"{data / 'shapes.jsonl'}:") and p.rsplit(":", 1)[1].isdigit() for p in places)
    assert len(set(places)) == len(places)


def test_vision_language_run_with_images(tmp_path, tiny_vlm_path):
    run = run_main(
        tmp_path,
        tiny_vlm_path,
        "--data.train",
        "data/shapes/shapes.jsonl",
        "--data.validation",
        "null",
        "--data.validation_fraction",
        "0.25",
        "--data.max_train_samples",
        "null",
        "--validation.max_samples",
        "2",
    )
    rows = [r for r in metrics(run) if "loss" in r]
    assert len(rows) == 2 and all("rewards/cpr_reasoning/mean" in r for r in rows)
    assert (run / "checkpoint-2" / "model.safetensors").exists()
    vals = [json.loads(x) for x in (run / "validation.jsonl").read_text().splitlines()]
    assert vals[-1]["step"] == 2 and "f1" in vals[-1]
    assert "data:image/png;base64," in (run / "validation_steps_step2.html").read_text()  # thumbnails


def phases(p2_steps: int) -> str:
    # %-formatting: the YAML's braces would each need doubling in an f-string
    return (
        "[{name: warmup, init_from: none, overrides: {reward: {name: answer_only, params: "  # noqa: UP031
        "{encoder: 'packaged:all-MiniLM-L6-v2', device: cpu}}, training: {max_steps: 2}}}, "
        "{name: cpr, init_from: best, overrides: {training: {max_steps: %d, learning_rate: 1.0e-5}, "
        "curriculum: {mode: competence, c0: 0.3}}}]" % p2_steps
    )


class RecordStart(TrainerCallback):
    def __init__(self):
        self.starts = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.starts.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def test_two_phase_curriculum_starts_phase2_from_phase1_best(tmp_path, tiny_lm_path):
    from safetensors.torch import load_file

    cfg, _ = load_config(
        "tiny.yaml",
        [
            "--model.name_or_path",
            str(tiny_lm_path),
            "--phases",
            phases(2),
            "--validation.eval_steps",
            "1",
            "--training.save_steps",
            "100",
            "--training.log_completions",
            "true",
        ],
    )
    rec = RecordStart()
    summary = grpo.run(cfg, tmp_path / "run", callbacks=[rec])
    p1, p2 = tmp_path / "run" / "phase1-warmup", tmp_path / "run" / "phase2-cpr"
    best = json.loads((p1 / "best_checkpoint.json").read_text())
    start = json.loads((p2 / "config.json").read_text())["model"]["name_or_path"]
    assert start == str(p1 / best["checkpoint"])
    chosen = load_file(Path(start) / "model.safetensors")
    for name, tensor in chosen.items():  # phase 2 starts from exactly those weights
        assert torch.equal(rec.starts[1][name], tensor), name
    m1 = [r for r in metrics(p1) if "loss" in r]
    m2 = [r for r in metrics(p2) if "loss" in r]
    assert "rewards/answer_only_accuracy/mean" in m1[0] and "rewards/cpr_reasoning/mean" in m2[0]
    assert m2[0]["learning_rate"] == pytest.approx(1e-5) and m1[0]["learning_rate"] == pytest.approx(1e-4)
    assert "curriculum/mean_ref_steps" in m2[0] and "curriculum/frac_easy" in m2[0]
    assert set(summary) == {"warmup", "cpr"}
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["cpr"]["step"] == 2


def test_resume_mid_phase_two_continues_the_same_batches(tmp_path, tiny_lm_path):
    common = [
        "--model.name_or_path",
        str(tiny_lm_path),
        "--validation.eval_steps",
        "0",
        "--training.log_completions",
        "true",
        "--training.save_steps",
        "1",
    ]

    def go(out, p2, resume=None):
        cfg, _ = load_config("tiny.yaml", [*common, "--phases", phases(p2)])
        grpo.run(cfg, out, resume)
        return out / "phase2-cpr"

    straight = go(tmp_path / "a", 3)
    go(tmp_path / "b", 2)
    resumed = go(tmp_path / "b", 3, resume="latest")
    assert [r["step"] for r in metrics(resumed) if "loss" in r] == [1, 2, 3]
    assert _step_prompts(resumed, 3) == _step_prompts(straight, 3)
    guard = lambda run, step: json.loads((run / f"checkpoint-{step}" / "crystal_state.json").read_text())["rewards"][
        "cpr"
    ]["guard"]["history"]
    assert guard(resumed, 2), "steps 1-2 put counts in the window (else the next check could not fail)"
    assert guard(resumed, 3) == guard(straight, 3), "the guard's window was restored on resume and continued"
