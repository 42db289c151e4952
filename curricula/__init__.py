"""CPR-Curriculum: complexity tiers (paper S3) and a difficulty-paced drop-in for TRL's
RepeatSampler (docs/method.md sections 8 and 11).

The sampler's names load on first use (PEP 562): reading a config needs only the
schedules (curricula/schedule.py), not torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from crystal_grpo.curricula.complexity import (
    TIERS,
    ComplexityConfig,
    annotate,
    answer_type,
    complexity_components,
    complexity_score,
    complexity_tier,
    question_text,
    step_count,
    tier_of,
)
from crystal_grpo.curricula.schedule import CurriculumSection, Schedule

_SAMPLER = ("CurriculumSampler", "CurriculumSamplerFactory", "curriculum_stats", "make_sampler_factory")


def __getattr__(name: str) -> Any:
    if name in _SAMPLER:
        return getattr(importlib.import_module("crystal_grpo.curricula.sampler"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TIERS",
    "ComplexityConfig",
    "CurriculumSampler",
    "CurriculumSamplerFactory",
    "CurriculumSection",
    "Schedule",
    "annotate",
    "answer_type",
    "complexity_components",
    "complexity_score",
    "complexity_tier",
    "curriculum_stats",
    "make_sampler_factory",
    "question_text",
    "step_count",
    "tier_of",
]
