"""A byte-level BPE tokenizer trained on given text: what the tests' tiny models
(train/fixtures/tiny_models.py) and the model organism (train/organism/make.py) are built with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def train_byte_level_bpe(
    texts: Iterable[str], split_regex: str, special_tokens: list[str], vocab_size: int, nfc: bool = False, **bpe: Any
):
    """A ``tokenizers.Tokenizer`` trained on ``texts``: byte-level BPE (every string encodes), the text
    first split by ``split_regex`` (and NFC-normalised with ``nfc``), pairs merged from 2 occurrences;
    ``bpe``: more of ``tokenizers.models.BPE``'s options."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False, **bpe))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
