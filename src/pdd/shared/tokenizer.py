"""Tokenizer + chat template through transformers' AutoTokenizer (folder or GGUF metadata).

Building a tokenizer from GGUF metadata takes seconds, so the result is saved once under the
user cache (PDD_CACHE_DIR, default ~/.cache/pdd) keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from pdd.shared.model_files import cache_dir


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
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


# apply_chat_template's own parameters: a request's template kwargs must not reach them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def render_messages(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template, with transformers'
    ``apply_chat_template`` semantics (``template_kwargs`` become template variables). Rendered to text,
    then encoded, as vLLM does: the template already holds the special tokens it wants, hence no
    ``add_special_tokens`` by default."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=False,
                                         **(template_kwargs or {}))
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(tokenizer: Any, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt appended."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return render_messages(tokenizer, messages)
