"""Tokenizer + chat template through transformers' AutoTokenizer (folder or GGUF metadata).

Building a tokenizer from GGUF metadata takes seconds, so the result is saved once under the
user cache (PDD_CACHE_DIR, default ~/.cache/pdd) keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


def _cache_dir() -> Path:
    return Path(os.environ.get("PDD_CACHE_DIR") or Path.home() / ".cache" / "pdd")


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    cached = _cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # noqa: BLE001 - a broken cache entry is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
    except OSError:
        pass
    return tok


def render_chat(tokenizer: Any, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt appended."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
