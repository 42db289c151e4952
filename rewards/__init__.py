"""Step-level rewards for GRPO: the Match-F1 scorer and the reward modules.

``build_reward(name, **params)`` makes a reward module (``REWARDS`` holds them by name);
``CrystalGRPOTrainer(model, reward=module, ...)`` trains with it. For a plain
``trl.GRPOTrainer``, ``get_reward_funcs(name, **params)`` returns TRL reward functions, one
per named, objective-tagged component; their unweighted sum is the reward.

Importing the package (the registry and every reward's config class) loads no torch; the
scorer's names (``MatchF1Scorer``, ``StepScores``) load it on first use (PEP 562).
"""

from __future__ import annotations

import importlib
import typing
from collections.abc import Callable
from typing import Any

from crystal_grpo.rewards.answer_only import AnswerOnlyConfig, AnswerOnlyReward, FormatConfig, FormatReward
from crystal_grpo.rewards.authors_code import AuthorsCodeConfig, AuthorsCodeReward
from crystal_grpo.rewards.base import RewardConfig, RewardModule
from crystal_grpo.rewards.composite import CompositeConfig, CompositeReward
from crystal_grpo.rewards.cpr import CPRConfig, CPRReward, cpr_reward
from crystal_grpo.rewards.encoder import PACKAGED_MINILM, PAPER_ENCODER
from crystal_grpo.rewards.shuffled import ShuffledAnswerReward, ShuffledConfig
from crystal_grpo.rewards.user import ComposedConfig, ComposedReward
from crystal_grpo.typed import ConfigError
from crystal_grpo.user_code import FORMS, is_import_path, load_subclass

#: Reward name (``reward.name`` in a config) -> module class. A new reward is one file with a
#: ``RewardModule`` subclass plus one line here; from outside this package, ``reward.name:
#: my_pkg.rewards:MyReward`` in a config, or ``reward.components`` (rewards/user.py).
REWARDS: dict[str, type[RewardModule]] = {
    "format": FormatReward,
    "answer_only": AnswerOnlyReward,
    "composite": CompositeReward,
    "cpr": CPRReward,
    "authors_code": AuthorsCodeReward,  # the released code's word-overlap reward, an ablation arm (not Eq. 7)
    "composed": ComposedReward,  # reward.components: user functions and crystal: terms (rewards/user.py)
    "shuffled_answer": ShuffledAnswerReward,  # a control arm: answer-only's rewards, unrelated to the completion
}


def register_reward(cls: type[RewardModule]) -> type[RewardModule]:
    """Make ``cls`` available as ``reward.name: <cls.name>`` (usable as a class decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}.name is empty: a registered reward needs the name configs use")
    REWARDS[cls.name] = cls
    return cls


def reward_class(name: str) -> type[RewardModule]:
    """A ``reward.name``: registered (``REWARDS``) or an import path to a RewardModule subclass."""
    if name in REWARDS:
        return REWARDS[name]
    if not is_import_path(name):
        raise ConfigError(
            f"reward.name: invalid value {name!r}; expected one of {', '.join(map(repr, REWARDS))}, "
            f"or a RewardModule subclass as {FORMS}"
        )
    return load_subclass(name, RewardModule, "reward", " (a plain reward function goes in reward.components)")


def reward_params(name: str) -> dict[str, Any]:
    """Every parameter the named reward takes (its config's fields) and its type hint."""
    return typing.get_type_hints(reward_class(name).config_class)


def build_reward(name: str, **params: Any) -> RewardModule:
    """The named reward module (registered, or an import path: rewards/user.py) with these
    parameters (its ``config_class`` fields)."""
    return reward_class(name)(**params)


def get_reward_funcs(name: str, **params) -> list[Callable]:
    """TRL-compatible reward functions for the named reward (see module docstring)."""
    return build_reward(name, **params).reward_funcs()


def __getattr__(name: str) -> Any:
    if name in ("MatchF1Scorer", "StepScores"):
        return getattr(importlib.import_module("crystal_grpo.rewards.match_f1"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REWARDS",
    "RewardConfig",
    "RewardModule",
    "CPRConfig",
    "CompositeConfig",
    "AnswerOnlyConfig",
    "FormatConfig",
    "AuthorsCodeConfig",
    "ComposedConfig",
    "ShuffledConfig",
    "build_reward",
    "get_reward_funcs",
    "register_reward",
    "reward_params",
    "cpr_reward",
    "MatchF1Scorer",
    "StepScores",
    "PACKAGED_MINILM",
    "PAPER_ENCODER",
]
