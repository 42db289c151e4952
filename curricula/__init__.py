"""CPR-Curriculum: complexity tiers (paper S3) and a difficulty-paced drop-in for TRL's
RepeatSampler (docs/method.md sections 8 and 11)."""

from __future__ import annotations

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
from crystal_grpo.curricula.sampler import (
    CurriculumSampler,
    CurriculumSamplerFactory,
    CurriculumSection,
    curriculum_stats,
    make_sampler_factory,
)

__all__ = [
    "TIERS", "ComplexityConfig", "CurriculumSampler", "CurriculumSamplerFactory", "CurriculumSection", "annotate",
    "answer_type", "complexity_components", "complexity_score", "complexity_tier",
    "curriculum_stats", "make_sampler_factory", "question_text", "step_count", "tier_of",
]
