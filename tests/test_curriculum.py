"""Curriculum sampler (layout = TRL's RepeatSampler, determinism, resume, pacing) and the
S3 complexity tiers on hand-computed examples."""

from __future__ import annotations

import math
import random

import pytest
from trl.trainer.utils import RepeatSampler

from crystal_grpo.curricula import (
    CurriculumSampler,
    CurriculumSection,
    answer_type,
    complexity_components,
    complexity_score,
    complexity_tier,
    curriculum_stats,
    make_sampler_factory,
    question_text,
    step_count,
    tier_of,
)


def _difficulty(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(2, 30) for _ in range(n)]


def _structure(seq: list[int], chunk_len: int) -> list[list[int]]:
    """Each chunk relabelled by order of first appearance: the pattern, not the indices."""
    out = []
    for s in range(0, len(seq), chunk_len):
        labels: dict[int, int] = {}
        out.append([labels.setdefault(i, len(labels)) for i in seq[s : s + chunk_len]])
    return out


def _chunks(seq: list[int], s: CurriculumSampler) -> list[list[int]]:
    """Unique indices of each chunk, read off the yielded sequence."""
    step = s.batch_size * s.mini_repeat_count * s.repeat_count
    return [seq[k : k + s.batch_size * s.mini_repeat_count : s.mini_repeat_count] for k in range(0, len(seq), step)]


# -- layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["competence", "sorted", "buckets"])
@pytest.mark.parametrize("n,mini,bs,rep", [(7, 2, 3, 4), (24, 3, 4, 2), (10, 1, 1, 1), (9, 5, 9, 3)])
def test_layout_matches_trl_repeat_sampler(mode, n, mini, bs, rep):
    trl = list(RepeatSampler(list(range(n)), mini_repeat_count=mini, batch_size=bs, repeat_count=rep, seed=1))
    buckets = [i % 3 for i in range(n)] if mode == "buckets" else None
    ours = CurriculumSampler(_difficulty(n), mini, bs, rep, mode=mode, total_steps=5, buckets=buckets)
    seq = list(ours)
    assert len(seq) == len(ours) == len(trl)
    chunk_len = bs * mini * rep
    assert _structure(seq, chunk_len) == _structure(trl, chunk_len)
    for chunk in _chunks(seq, ours):
        assert len(set(chunk)) == bs  # distinct indices inside a chunk


def test_chunk_indices_is_what_iter_yields():
    s = CurriculumSampler(_difficulty(50), 2, 4, 3, total_steps=20)
    s.set_epoch(1)
    assert _chunks(list(s), s) == [s.chunk_indices(t) for t in range(12, 24)]


# -- determinism and resume -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["competence", "sorted", "buckets"])
def test_two_ranks_yield_the_same_order(mode):
    d = _difficulty(60)
    kw = dict(mode=mode, total_steps=30, seed=7, buckets=[x % 4 for x in d] if mode == "buckets" else None)
    a, b = CurriculumSampler(d, 3, 5, 2, **kw), CurriculumSampler(d, 3, 5, 2, **kw)
    b.chunk_indices(40)  # a rank that logged ahead must not drift
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b)


def test_seed_changes_order():
    d = _difficulty(60)
    a, b = (CurriculumSampler(d, 1, 5, total_steps=30, seed=seed) for seed in (1, 2))
    assert list(a) != list(b)


@pytest.mark.parametrize("mode", ["competence", "sorted", "buckets"])
@pytest.mark.parametrize("k", [0, 1, 5, 11])
def test_resume_continues_the_identical_sequence(mode, k):
    d = _difficulty(50)
    kw = dict(mode=mode, total_steps=17, seed=3, buckets=[x % 3 for x in d] if mode == "buckets" else None)
    full = CurriculumSampler(d, 2, 4, 3, **kw)
    seq = list(full) + list(full) + list(full)  # epochs 0, 1, 2 (iteration moves the epoch on)
    resumed = CurriculumSampler(d, 2, 4, 3, start_chunk=k, **kw)
    per_chunk = 4 * 2 * 3
    tail = seq[k * per_chunk :]
    assert list(resumed) == tail[: len(resumed)]
    assert list(resumed) == tail[len(resumed) : 2 * len(resumed)]


def test_set_epoch_selects_global_chunks_and_iteration_advances():
    d = _difficulty(40)
    s = CurriculumSampler(d, 1, 4, total_steps=25)
    e0, e1 = list(s), list(s)
    t = CurriculumSampler(d, 1, 4, total_steps=25)
    t.set_epoch(1)
    assert list(t) == e1 != e0
    t.set_epoch(0)
    assert list(t) == e0  # going back replays the same chunks


# -- pacing -----------------------------------------------------------------------------


def _rank(d: list[int]) -> dict[int, int]:
    return {i: r for r, i in enumerate(sorted(range(len(d)), key=lambda i: (d[i], i)))}


@pytest.mark.parametrize("pacing", ["linear", "sqrt"])
def test_competence_pool_grows_and_bounds_every_chunk(pacing):
    n, bs, horizon, c0 = 200, 8, 40, 0.25
    d = _difficulty(n)
    rank = _rank(d)
    s = CurriculumSampler(d, 2, bs, total_steps=horizon, c0=c0, pacing=pacing)
    sizes = [s.pool_size(t) for t in range(60)]
    assert sizes == sorted(sizes) and sizes[0] == math.ceil(c0 * n) and sizes[horizon] == n
    assert set(s.chunk_indices(0)) <= set(sorted(range(n), key=lambda i: (d[i], i))[: int(c0 * n)])
    for t in range(60):
        assert all(rank[i] < sizes[t] for i in s.chunk_indices(t))
        assert len(s.available(t)) == sizes[t]
    if pacing == "linear":
        assert s.competence(horizon // 2) == pytest.approx(c0 + (1 - c0) * 0.5)


def test_mean_step_count_rises_over_the_run():
    d = _difficulty(300)
    s = CurriculumSampler(d, 4, 10, 2, total_steps=60, c0=0.2)
    means = [sum(d[i] for i in s.chunk_indices(t)) / 10 for t in range(60)]
    thirds = [sum(means[a : a + 20]) / 20 for a in (0, 20, 40)]
    assert thirds[0] < thirds[1] < thirds[2]
    stats = [curriculum_stats(s.chunk_indices(t), d)["mean_ref_steps"] for t in (0, 59)]
    assert stats == [means[0], means[59]]


def test_coverage_is_even_once_the_pool_is_full():
    n, bs = 50, 6
    s = CurriculumSampler(_difficulty(n), 1, bs, total_steps=5)
    counts = [0] * n
    for t in range(5, 5 + 10 * n // bs):
        for i in s.chunk_indices(t):
            counts[i] += 1
    assert max(counts) - min(counts) <= 2


def test_small_pool_still_fills_a_chunk_without_repeats():
    s = CurriculumSampler(_difficulty(40), 1, 8, total_steps=100, c0=0.01)
    assert s.pool_size(0) == 8
    for t in range(30):
        assert len(set(s.chunk_indices(t))) == 8


def test_sorted_mode_is_easiest_first_then_cycles():
    n, bs = 43, 5
    d = _difficulty(n)
    s = CurriculumSampler(d, 2, bs, 2, mode="sorted")
    first_pass = [i for c in _chunks(list(s), s) for i in c]
    assert len(first_pass) == (n // bs) * bs
    assert [d[i] for i in first_pass] == sorted(d[i] for i in first_pass)
    assert first_pass == sorted(range(n), key=lambda i: (d[i], i))[: len(first_pass)]
    seen = [i for t in range(n) for i in s.chunk_indices(t)]  # n chunks = bs full cycles
    assert all(seen.count(i) == bs for i in range(n))


def test_buckets_never_open_early():
    n, horizon = 90, 30
    labels = ["hard", "easy", "medium"] * (n // 3)
    s = CurriculumSampler(list(range(n)), 1, 6, mode="buckets", buckets=labels, total_steps=horizon, seed=5)
    assert s.bucket_order == ["easy", "medium", "hard"]
    opens = {"easy": 0, "medium": 10, "hard": 20}  # bucket k opens at k/3 * T
    seen_at: dict[str, int] = {}
    for t in range(40):
        for i in s.chunk_indices(t):
            assert t >= opens[labels[i]], (t, labels[i])
            seen_at.setdefault(labels[i], t)
    assert seen_at["medium"] < 14 and seen_at["hard"] < 24  # and they do show up
    ints = CurriculumSampler(
        [0] * 12, 1, 2, mode="buckets", buckets=[2, 0, 1] * 4, bucket_order=[0, 1, 2], total_steps=3
    )
    assert ints.competence(0) == pytest.approx(1 / 3) and ints.competence(2) == 1.0


def test_buckets_open_early_rather_than_starve():
    s = CurriculumSampler([0] * 20, 1, 6, mode="buckets", buckets=["easy"] * 2 + ["medium"] * 18, total_steps=10)
    assert s.pool_size(0) == 20 and len(set(s.chunk_indices(0))) == 6


def test_bad_arguments():
    with pytest.raises(ValueError):
        CurriculumSampler([1, 2], 1, 3, total_steps=2)
    with pytest.raises(ValueError):
        CurriculumSampler([1, 2, 3], 1, 1)  # competence needs a horizon
    with pytest.raises(ValueError):
        CurriculumSampler(
            [1, 2, 3], 1, 1, mode="buckets", buckets=["a", "b", "c"], bucket_order=["a", "b"], total_steps=2
        )


def test_curriculum_stats():
    out = curriculum_stats([0, 1, 2, 3], [2, 4, 6, 8], ["easy", "easy", "medium", "hard"])
    assert out == {"mean_ref_steps": 5.0, "frac_easy": 0.5, "frac_medium": 0.25, "frac_hard": 0.25}


def test_factory_as_the_trainer_calls_it():
    data = [
        {"prompt": [{"role": "user", "content": f"Is {k} big?"}], "answer": "yes", "reference_steps": ["s"] * k}
        for k in range(2, 42)
    ]
    factory = make_sampler_factory(
        CurriculumSection(mode="competence", difficulty="steps", options={"c0": 0.25}), data, max_steps=20
    )
    s = factory(data, mini_repeat_count=2, batch_size=4, repeat_count=2, seed=42, steps_per_chunk=2.0)
    assert s.total_steps == 10 and s.pool_size(0) == 10  # 20 optimizer steps = 10 chunks
    assert max(factory.step_counts[i] for i in s.chunk_indices(0)) <= 11
    assert factory.chunk_at_step(5) == 2
    rec = factory.stats(0)
    assert rec["pool_size"] == 10 and rec["frac_easy"] + rec["frac_medium"] + rec["frac_hard"] == 1.0


# -- complexity tiers (hand-computed; step cap 30, 300 chars, 50 words) -------------------


def _steps(k: int) -> list[str]:
    return [f"step {j}" for j in range(k)]


def test_easy_example():
    ex = {"question": "Is the cat black?", "answer": "yes", "reference_steps": _steps(3)}
    # 17 chars, 4 words, no markers, yes/no
    parts = {"steps": 3 / 30, "length": 0.5 * 17 / 300 + 0.5 * 4 / 50, "ling": 0.0, "type": 0.2}
    assert complexity_components(ex) == pytest.approx(parts)
    assert complexity_score(ex) == pytest.approx(0.0936667, abs=1e-6)
    assert complexity_tier(ex) == "easy"


def test_medium_counting_example():
    ex = {"question": "How many apples are on the table?", "answer": "3", "reference_steps": _steps(20)}
    # 33 chars, 7 words; number 0.4 - 0.15 for counting
    parts = {"steps": 20 / 30, "length": 0.125, "ling": 0.0, "type": 0.25}
    assert complexity_components(ex) == pytest.approx(parts)
    assert complexity_score(ex) == pytest.approx(0.4 * 20 / 30 + 0.2 * 0.125 + 0.2 * 0.25)  # 0.3417
    assert complexity_tier(ex) == "medium"


def test_medium_choice_example_just_above_the_easy_border():
    ex = {
        "question": "Which animal is larger?",
        "answer": "B",
        "choices": ["cat", "dog"],
        "reference_steps": _steps(12),
    }
    # 23 chars, 4 words; "larger" is a comparison (1 of 4 families); letter 0.3
    assert complexity_score(ex) == pytest.approx(0.16 + 0.2 * (0.5 * 23 / 300 + 0.04) + 0.05 + 0.06)  # 0.2857
    assert complexity_tier(ex) == "medium"


def test_hard_why_example():
    ex = {
        "question": "Why is it not warmer if it is closer because of the sun?",
        "answer": "the sun heats the air",
        "reference_steps": _steps(24),
    }
    # 56 chars, 13 words; all four marker families; free text 0.5 + 0.2 for "why"
    assert complexity_components(ex) == pytest.approx(
        {"steps": 0.8, "length": 0.5 * 56 / 300 + 0.5 * 13 / 50, "ling": 1.0, "type": 0.7}
    )
    assert complexity_score(ex) == pytest.approx(0.7046667, abs=1e-6)
    assert complexity_tier(ex) == "hard"


def test_caps_keep_subscores_in_unit_interval():
    ex = {"question": "word " * 400, "answer": "x", "reference_steps": _steps(99)}
    parts = complexity_components(ex)
    assert parts["steps"] == 1.0 and parts["length"] == 1.0
    assert all(0.0 <= v <= 1.0 for v in parts.values())


def test_tier_thresholds():
    assert [tier_of(x) for x in (0.0, 0.2699, 0.27, 0.4199, 0.42, 1.0)] == [
        "easy",
        "easy",
        "medium",
        "medium",
        "hard",
        "hard",
    ]


def test_step_count_uses_mean_over_reference_sets():
    assert step_count({"reference_steps": _steps(4)}) == 4
    assert step_count({"reference_steps": _steps(9), "reference_sets": [_steps(2), _steps(3)]}) == 3  # 2.5 -> 3
    assert step_count({"reference_steps": _steps(5), "reference_sets": None}) == 5
    assert step_count({}) == 0


def test_question_and_answer_types():
    conv = {
        "prompt": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Which is red?\nOptions: (A) x (B) y"},
        ]
    }
    assert question_text(conv) == "Which is red?"
    parts = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]}
    assert question_text(parts) == "What is it?"
    kinds = {
        "Yes.": "yes_no",
        "false": "yes_no",
        "(B)": "letter",
        "C": "letter",
        "12 sheep": "number",
        "$12": "number",
        "3.5": "number",
        "red bus": "text",
    }
    assert {a: answer_type({"answer": a}) for a in kinds} == kinds
    assert answer_type({"answer": "the dog", "choices": ["the cat", "the dog"]}) == "letter"


def test_factory_reads_a_datasets_table_without_running_its_transform():
    from datasets import Dataset

    def no_images(batch):
        if "images" in batch:
            raise AssertionError("the curriculum must not load images")
        return batch

    recs = [
        {
            "prompt": [{"role": "user", "content": "Which one?\nOptions: (A) a (B) b"}],
            "answer": "B",
            "choices": ["a", "b"],
            "reference_steps": ["s"] * k,
            "images": ["x.png"],
        }
        for k in range(1, 13)
    ]
    ds = Dataset.from_list(recs).with_transform(no_images).train_test_split(test_size=0.25, seed=0)["train"]
    factory = make_sampler_factory(CurriculumSection(mode="buckets"), ds, max_steps=6)
    s = factory(ds, mini_repeat_count=2, batch_size=3)
    assert factory.step_counts == [len(ds.with_format(None)[i]["reference_steps"]) for i in range(len(ds))]
    assert s.bucket_order == sorted(set(factory.tiers), key=["easy", "medium", "hard"].index)


def test_epoch_callback_reselects_the_epoch_on_resume():
    """The trainer's SamplerEpoch callback (train/trainer/prompt_order.py) reaches the curriculum's sampler."""
    from types import SimpleNamespace

    from crystal_grpo.train.trainer.prompt_order import SamplerEpoch

    data = [{"answer": "yes", "reference_steps": ["s"] * k} for k in range(1, 21)]
    factory = make_sampler_factory(CurriculumSection(mode="competence"), data, max_steps=10)
    callback = SamplerEpoch()
    s = callback.track(factory(None, mini_repeat_count=1, batch_size=4))
    callback.on_epoch_begin(None, SimpleNamespace(epoch=1.4), None)
    assert s.epoch == 1 and s.first_chunk() == 5


def test_a_new_mode_is_one_schedule_class(monkeypatch):
    from crystal_grpo.curricula.schedule import Schedule
    from crystal_grpo.train.config.run_config import ConfigError, load_config

    monkeypatch.setattr(Schedule, "registry", dict(Schedule.registry))  # registered for this test only

    class HardestHalf(Schedule):
        """The pool is always the harder half of the data."""

        mode = "hardest_half"

        def __init__(self, order, batch_size, total_steps, **options):
            super().__init__(order, batch_size, total_steps)
            self.key = [0] * self.n
            for r, i in enumerate(reversed(order)):
                self.key[i] = r

        def threshold(self, t):
            return self.n // 2

        def competence(self, t):
            return 0.5

    d = _difficulty(40)
    s = CurriculumSampler(d, 2, 4, mode="hardest_half", total_steps=10, seed=1)
    hard = set(sorted(range(40), key=lambda i: (d[i], i))[20:])
    assert all(set(s.chunk_indices(t)) <= hard for t in range(30))
    assert s.pool_size(0) == 20 and s.competence(3) == 0.5
    assert load_config("tiny", ["--curriculum", "{mode: hardest_half}"])[0].curriculum.mode == "hardest_half"
    with pytest.raises(ConfigError, match="curriculum.mode: invalid value 'hardest_third'; expected one of"):
        load_config("tiny", ["--curriculum", "{mode: hardest_third}"])
