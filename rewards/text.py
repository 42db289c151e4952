"""Make any Python str safe for the tokenizer, files and terminals.

A model can emit a JSON escape for half a surrogate pair (``"\\ud800"``); ``json.loads``
turns it into a lone surrogate code point, which Python strings allow but UTF-8 does
not. The sentence-transformers tokenizer rejects such a string (and so would printing
or writing it as UTF-8), so every text that leaves the parser or enters the encoder goes
through :func:`clean_text` first.
"""

from __future__ import annotations


def clean_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD; valid text comes back as is.

    A high + low surrogate pair that arrives as two code points is joined into the one
    character it encodes (UTF-16 round trip), so only what cannot be encoded is replaced.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
