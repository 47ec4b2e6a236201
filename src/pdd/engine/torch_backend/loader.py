"""Checkpoint loading: a Hugging Face folder (config.json + *.safetensors) or a GGUF file.

Both produce a ModelConfig and a dict of float tensors under Hugging Face parameter names, so
the model class has one weight-naming scheme. GGUF tensors are dequantized with the ``gguf``
package; llama.cpp's converter permutes attn_q/attn_k rows for its rotary layout (llama and
mistral only), which is undone here so the Hugging Face rotate-half RoPE applies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdd.engine.torch_backend.config import ModelConfig, config_from_gguf, config_from_hf
from pdd.engine.core.errors import UnsupportedArchitectureError
from pdd.shared.model_files import is_gguf, resolve_model_path


def load_checkpoint(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load config and float32 weights (HF names) from a folder or a .gguf file."""
    path = resolve_model_path(path)
    if is_gguf(path):
        return load_gguf(path)
    if os.path.isdir(path):
        return load_hf_folder(path)
    raise FileNotFoundError(f"model path {path!r} is neither a checkpoint folder nor a .gguf file")


def load_model_config(path: str) -> ModelConfig:
    """The config alone, without the weights (seconds less for a GGUF: no dequantizing)."""
    path = resolve_model_path(path)
    if is_gguf(path):
        import gguf

        return _gguf_config(gguf.GGUFReader(path))
    if os.path.isdir(path):
        return _hf_config(path)
    raise FileNotFoundError(f"model path {path!r} is neither a checkpoint folder nor a .gguf file")


def _hf_config(path: str) -> ModelConfig:
    config_path = Path(path) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    raw = json.loads(config_path.read_text())
    config = config_from_hf(raw)
    gen_path = Path(path) / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text()).get("eos_token_id")
        for eos in [gen] if isinstance(gen, int) else (gen or []):
            if eos not in config.eos_token_ids:
                config.eos_token_ids.append(int(eos))
    return config


def load_hf_folder(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = _hf_config(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return config, weights


def _field_value(field: Any) -> Any:
    return field.contents()


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _gguf_config(reader: Any) -> ModelConfig:
    meta: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue
        try:
            meta[name] = _field_value(fld)
        except Exception:  # noqa: BLE001 - a field we cannot decode is one we do not need
            continue
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return config_from_gguf(meta, int(embd.shape[-1]), has_output="output.weight" in names)


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(path)
    config = _gguf_config(reader)  # refuses by metadata first
    names = {t.name for t in reader.tensors}
    unknown = sorted(n for n in names if n not in _GGUF_TOP_NAMES
                     and not (n.startswith("blk.") and n.split(".", 2)[-1] in _GGUF_LAYER_NAMES))
    if unknown:  # e.g. rope_freqs.weight (llama3.1 frequency factors): skipping it would change the math
        raise UnsupportedArchitectureError(
            f"{path}: GGUF tensors this engine does not compute: {', '.join(unknown[:5])}"
            + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    permute = config.architecture in ("llama", "mistral")
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = [int(x) for x in reversed(list(t.shape))]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(data, dtype=np.float32).reshape(shape)
        if t.name in _GGUF_TOP_NAMES:
            hf = _GGUF_TOP_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            hf = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
            if permute and rest == "attn_q.weight":
                arr = _reverse_permute(arr, config.num_heads)
            elif permute and rest == "attn_k.weight":
                arr = _reverse_permute(arr, config.num_kv_heads)
        arr = np.ascontiguousarray(arr)
        weights[hf] = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return config, weights
