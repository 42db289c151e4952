"""The model organism: the task generator's properties and the from-scratch policy's
folder, loaded through the project's own data and model paths."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from crystal_grpo.train.organism.task import (
    Layout,
    SplitSizes,
    TaskSpec,
    held_out,
    make_split,
    question,
    stated_result,
    values,
    wraps,
    write_splits,
    wrong_share,
)

SMALL = SplitSizes(train=300, val=60, test=60, long_test=30)


def test_rows_are_deterministic_and_in_the_data_format(tmp_path):
    a = write_splits(Layout(TaskSpec(error_rate=0.3), SMALL, seed=3), tmp_path / "a")
    b = write_splits(Layout(TaskSpec(error_rate=0.3), SMALL, seed=3), tmp_path / "b")
    for name in a:
        assert a[name].read_bytes() == b[name].read_bytes(), name
    from crystal_grpo.train.data.splits import load_split

    for name, path in a.items():
        ds = load_split(path).dataset  # the loader's own checks: every row valid
        assert len(ds) == getattr(SMALL, {"sft": "train", "test_long": "long_test"}.get(name, name))
        row = ds[0]
        assert row["source"] == "organism" and row["difficulty"] == str(len(row["reference_steps"]))


def test_steps_form_a_causal_chain():
    spec = TaskSpec()
    for row in make_split(spec, 200, seed=0, partition="train", prefix="t"):
        k = int(row["difficulty"])
        assert len(row["reference_steps"]) == k and 1 <= k <= spec.max_steps
        results = [int(s.rstrip(".").split()[-1]) for s in row["reference_steps"]]
        inputs = [int(s.split()[2]) for s in row["reference_steps"]]
        assert inputs[1:] == results[:-1]  # each step starts from the value the step before computed
        assert row["answer"] == str(results[-1])


def test_held_out_splits_never_share_a_question_with_training():
    layout = Layout(TaskSpec(), SplitSizes(train=2000, val=300, test=300, long_test=60), seed=0)
    splits = layout.splits()
    train = {r["question"] for r in splits["train"]}
    for name in ("val", "test", "test_long"):
        assert not train & {r["question"] for r in splits[name]}, name
    assert {len(r["reference_steps"]) for r in splits["test_long"]} == {6, 7, 8}
    assert {len(r["reference_steps"]) for r in splits["val"]} == {1, 2, 3, 4, 5}


def test_demonstrations_hold_the_same_questions_with_slips():
    spec = TaskSpec(error_rate=0.3)
    layout = Layout(spec, SMALL, seed=0).splits()
    clean, demo = layout["train"], layout["sft"]
    assert [r["question"] for r in clean] == [r["question"] for r in demo]
    share = wrong_share(demo, clean)
    assert 0.3 < share < 0.8  # per-step slips at 0.3 over chains of 1-5 steps
    assert wrong_share(clean, clean) == 0.0
    for r in demo:  # slipped or not, a demonstration stays a consistent chain
        results = [int(s.rstrip(".").split()[-1]) for s in r["reference_steps"]]
        assert [int(s.split()[2]) for s in r["reference_steps"]][1:] == results[:-1]
        assert r["answer"] == str(results[-1])


def test_wrap_slips_hit_only_wrapping_steps():
    spec = TaskSpec(error_rate=1.0, error_kind="wrap")
    for r in make_split(spec, 200, seed=1, partition="train", prefix="t", demonstrate=True):
        for s in r["reference_steps"]:
            words = s.split()  # "b = 9 + 3 = 2"
            a, op, n, shown = int(words[2]), words[3], int(words[4]), int(words[-1])
            right = values_of(a, op, n)
            if wraps(op, a, n, 10):
                assert shown == (right + (1 if op == "+" else -1)) % 10
            else:
                assert shown == right


def values_of(a: int, op: str, n: int) -> int:
    return (a + n if op == "+" else a - n) % 10


def test_shortcut_and_choices():
    spec = TaskSpec(shortcut_rate=1.0, choice_rate=1.0)
    for r in make_split(spec, 50, seed=2, partition="train", prefix="t"):
        value = r["reference_steps"][-1].split()[2]
        assert f"is {value}." in r["question"].split("We are told")[1]  # the answer, stated
        assert r["answer"] in "ABCD" and r["choices"][ord(r["answer"]) - 65] == value
    none = make_split(TaskSpec(), 50, seed=2, partition="train", prefix="t")
    assert not any("We are told" in r["question"] or "choices" in r for r in none)


def test_hinted_demonstrations_either_write_the_chain_or_leave_it_off_and_copy_the_hint():
    """omit_rate: a hinted demonstration writes a prefix of its (slipped) chain, repeats the hint as its
    last step and answers the stated value, or writes the whole chain and answers the chain's own
    result; plain questions always get the whole chain. Either way the answer is the last step's
    result. The clean splits (what GRPO and the held-out tests read) carry the whole true chain."""
    spec = TaskSpec(shortcut_rate=0.5, omit_rate=0.4, error_rate=0.3)
    layout = Layout(spec, SplitSizes(train=2000, val=100, test=100, long_test=10), seed=0).splits()
    clean, demo = layout["train"], layout["sft"]
    assert [r["question"] for r in clean] == [r["question"] for r in demo]
    omitted = full_hinted = 0
    for c, d in zip(clean, demo):
        k = int(c["difficulty"])
        assert c["variant"] == d["variant"] == ("hinted" if "We are told" in c["question"] else "plain")
        assert len(c["reference_steps"]) == k and c["answer"] == stated_result(c["reference_steps"][-1])
        assert d["answer"] == stated_result(d["reference_steps"][-1])
        chain = d["reference_steps"]
        if chain[-1].startswith("We are told"):  # left off: a prefix of a chain, then the hint repeated
            assert d["variant"] == "hinted" and chain[-1] in c["question"] and d["answer"] == c["answer"]
            chain = chain[:-1]
            assert len(chain) < k
            omitted += 1
        else:
            assert len(chain) == k
            full_hinted += d["variant"] == "hinted"
        assert [s.split()[2] for s in chain][1:] == [stated_result(s) for s in chain][:-1]  # a prefix still chains
    hinted = omitted + full_hinted
    assert 0.33 * hinted < omitted < 0.47 * hinted  # omit_rate 0.4
    assert {
        r["variant"] for r in make_split(TaskSpec(), 50, seed=2, partition="train", prefix="t", demonstrate=True)
    } == {"plain"}


def test_hint_reliability_states_a_wrong_value_on_the_same_questions():
    """hint_reliability r: a hinted question states its answer with chance r, another value otherwise;
    the questions, their hints' places, answers and references stay those of r = 1 (the wrong hints of
    r = 0.9 among those of r = 0.6), and a demonstration that copies the hint copies the wrong one."""

    def split(r: float, demonstrate: bool = False) -> list[dict]:
        spec = TaskSpec(shortcut_rate=0.5, omit_rate=0.5, hint_reliability=r)
        return make_split(spec, 2000, seed=4, partition="train", prefix="t", demonstrate=demonstrate)

    def stated(row: dict) -> str:
        return row["question"].split("We are told ")[1].split(" is ")[1].split(".")[0]

    sure, high, low = split(1.0), split(0.9), split(0.6)
    assert not any("hint_true" in r for r in sure)
    for a, b in zip(sure, low):
        assert (a["id"], a["variant"], a["answer"], a["reference_steps"]) == (
            b["id"],
            b["variant"],
            b["answer"],
            b["reference_steps"],
        )
        if a["variant"] == "hinted":
            assert stated(a) == a["answer"]
            assert b["hint_true"] == (stated(b) == b["answer"])
    wrong = {r: {x["id"] for x in rows if x.get("hint_true") is False} for r, rows in ((0.9, high), (0.6, low))}
    hinted = sum(r["variant"] == "hinted" for r in sure)
    assert 0.07 * hinted < len(wrong[0.9]) < 0.13 * hinted and 0.35 * hinted < len(wrong[0.6]) < 0.45 * hinted
    assert wrong[0.9] < wrong[0.6]
    copies = [d for d in split(0.6, demonstrate=True) if d["reference_steps"][-1].startswith("We are told")]
    assert copies and all(d["answer"] == stated(d) for d in copies)
    assert any(d["hint_true"] is False for d in copies)


def test_partition_is_a_property_of_the_question():
    from crystal_grpo.train.organism.task import Problem

    rng = random.Random(0)
    spec = TaskSpec()
    problems = [
        Problem(rng.randrange(10), tuple((rng.choice("+-"), rng.randint(1, 3)) for _ in range(3))) for _ in range(2000)
    ]
    share = sum(held_out(p, spec) for p in problems) / len(problems)
    assert 0.15 < share < 0.25
    p = problems[0]
    assert question(p, spec).startswith("Work mod 10. a is") and values(p, 10)[0] == p.start


def test_bad_knobs_are_refused():
    for bad in (
        dict(modulus=1),
        dict(ops=("^",)),
        dict(min_steps=3, max_steps=2),
        dict(error_rate=1.5),
        dict(omit_rate=-0.1),
        dict(hint_reliability=1.2),
    ):
        with pytest.raises(ValueError):
            TaskSpec(**bad)


@pytest.fixture(scope="module")
def organism_model(tmp_path_factory):
    from crystal_grpo.train.organism.make import build_policy

    return build_policy(tmp_path_factory.mktemp("organism") / "model")


def test_policy_folder_loads_on_the_project_path(organism_model):
    """An ordinary HF folder: train.models.load_policy loads it, ids survive the save and reload,
    digits are single tokens, and the SFT encoding (prompt and target apart) round-trips."""
    from crystal_grpo.train.data.splits import build_prompt, encode_example
    from crystal_grpo.train.models.loading import ModelSection, load_policy

    model, tok = load_policy(ModelSection(name_or_path=str(organism_model)))
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert tok.padding_side == "left" and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    row = make_split(TaskSpec(choice_rate=1.0), 1, seed=5, partition="train", prefix="t")[0]
    prompt_ids, target_ids = encode_example(tok, {**row, "prompt": build_prompt(row)})
    assert target_ids[-1] == tok.eos_token_id
    text = tok.decode(target_ids, skip_special_tokens=True)
    assert json.loads(text) == {"reasoning_steps": row["reference_steps"], "answer": row["answer"]}
    for d in "0123456789":
        assert len(tok(f" {d}", add_special_tokens=False)["input_ids"]) == 1
    assert len(prompt_ids) < 140 and len(target_ids) < 90
    info = json.loads((organism_model / "organism.json").read_text())
    assert info["policy"]["hidden"] == model.config.hidden_size


def test_policy_build_is_deterministic(organism_model, tmp_path):
    from safetensors.torch import load_file

    from crystal_grpo.train.organism.make import build_policy

    again = build_policy(tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (organism_model / "tokenizer.json").read_bytes()
    a, b = load_file(organism_model / "model.safetensors"), load_file(again / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)


def test_both_wordings_state_the_same_chain():
    eq = make_split(TaskSpec(), 20, seed=0, partition="train", prefix="t")
    words = make_split(replace(TaskSpec(), wording="sentence"), 20, seed=0, partition="train", prefix="t")
    for a, b in zip(eq, words):
        assert a["question"] == b["question"] and a["answer"] == b["answer"]
        for x, y in zip(a["reference_steps"], b["reference_steps"]):  # "b = 9 + 3 = 2", "b is 9 plus 3, which is 2."
            assert x.split()[::2] == [y.split()[i].rstrip(",.") for i in (0, 2, 4, 7)]


def test_a_policy_folder_built_from_other_knobs_is_rebuilt(organism_model, tmp_path):
    from crystal_grpo.train.organism.make import PolicySpec, build_policy, built_from

    path = tmp_path / "model"
    build_policy(path)
    again = (path / "model.safetensors").stat().st_mtime_ns
    assert build_policy(path) == path and (path / "model.safetensors").stat().st_mtime_ns == again  # same knobs
    build_policy(path, spec=PolicySpec(layers=1))
    assert built_from(path)["policy"]["layers"] == 1


def test_the_committed_warm_start_loads_and_the_configs_name_it():
    """data/organism/warm_start is what `make_organism.py --warm_start` copies: the weights and
    everything AutoModelForCausalLM and AutoTokenizer load, made for the task the defaults write,
    with the short system prompt both configs use."""
    from crystal_grpo.train.config.run_config import load_config
    from crystal_grpo.train.models.loading import ModelSection, load_policy
    from crystal_grpo.train.organism.make import POLICY_FILES, SYSTEM_PROMPT_SHORT, WARM_START_DIR

    repo = Path(__file__).resolve().parents[1]
    folder = repo / WARM_START_DIR
    assert sorted(p.name for p in folder.iterdir()) == sorted(POLICY_FILES)
    recorded = json.loads((folder / "organism.json").read_text())["task"]
    assert TaskSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()}) == TaskSpec()
    model, tok = load_policy(ModelSection(name_or_path=str(folder)))
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    grpo, _ = load_config("organism.yaml")
    sft, _ = load_config("organism_warm_start.yaml")
    assert grpo.model.name_or_path == str(WARM_START_DIR) and sft.trainer == "sft"
    assert grpo.data.system_prompt == sft.data.system_prompt == SYSTEM_PROMPT_SHORT
    assert grpo.validation.temperature == sft.validation.temperature == 1.0
    assert grpo.training["max_completion_length"] == grpo.validation.max_new_tokens


def test_the_demo_runs_its_own_config_the_organism_with_cpr():
    """`make demo` trains configs/demo_organism.yaml as it is (it ran organism.yaml with --reward.name
    cpr over the file's answer_only): the organism's settings, the Causal Process Reward."""
    import yaml

    configs = Path(__file__).resolve().parents[1] / "configs"
    demo, organism = (yaml.safe_load((configs / name).read_text()) for name in ("demo_organism.yaml", "organism.yaml"))
    assert demo["reward"].pop("name") == "cpr" and organism["reward"].pop("name") == "answer_only"
    assert demo == organism
    assert "demo_organism.yaml" in (configs.parent / "scripts/demo.py").read_text()
    assert "--reward" not in (configs.parent / "scripts/demo.py").read_text()
