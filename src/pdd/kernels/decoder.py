"""Every decoder layer of a pass in one C call (kernels/cpu_decoder.c), for passes of exact rows only.

A decode step through the torch engine's model.py's per-op loop is ~12 kernel calls per layer from Python; at batch 1
their interpreter, ctypes and allocation costs were ~10 ms of a 45 ms SmolLM2 step (docs/ENGINE.md). When
every row of a pass takes the exact attention path (decode tokens and extends of output tokens, the usual
decode step) and every projection runs our kernel, ``DecoderLayers`` makes the same calls from C. A row's
bits are the per-op route's (the same kernels, same order, same arguments), so a request's tokens do not
depend on which route a pass took.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from pdd.kernels import native
from pdd.kernels.attention import NATIVE_KV_DTYPES, AttentionMetadata
from pdd.kernels.linear import Linear

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):  # pdd_layer in cpu_decoder.c
    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "o", "gate_up",
                                        "down", "qkv_bias", "o_bias")]


class _Dims(ctypes.Structure):  # pdd_dims in cpu_decoder.c
    _fields_ = [(name, _I64) for name in ("hidden", "hq", "hkv", "d", "inter", "block_size", "num_slots")] + [
        ("w_format", ctypes.c_int), ("kv_bf16", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_double)]


class LayerWeightsLike(Protocol):
    """What a model's layer holds (the torch engine's model.py LayerWeights)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecoderLayers:
    """The layers of one model, bound once; ``run`` takes a pass when ``takes`` says it can."""

    def __init__(self, layers: Sequence[LayerWeightsLike], num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float, scale: float) -> None:
        self._layers = (_Layer * len(layers))()
        for slot, layer in zip(self._layers, layers):
            for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
                setattr(slot, name, _ptr(getattr(layer, name)))
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(slot, name, getattr(layer, name).weight.data_ptr())
            slot.qkv_bias, slot.o_bias = _ptr(layer.qkv.bias), _ptr(layer.o.bias)
        self._keep = list(layers)  # the pointers above are into these tensors
        hidden = layers[0].o.shape[0][0]
        self._shape = (hidden, num_heads, num_kv_heads, head_dim, intermediate_size)
        self._w_format = int(layers[0].qkv.format)
        self._eps, self._scale = eps, scale
        self._pools: tuple | None = None  # (key, dims, k pointer array, v pointer array)
        # floats of scratch per row: normed input, qkv, attention output, gate|up, activation
        self._work_per_row = hidden + (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim \
            + 3 * intermediate_size

    @staticmethod
    def build(layers: Sequence[LayerWeightsLike], **dims) -> DecoderLayers | None:
        """Bound layers, or None where the route cannot run them (no kernel, a projection on another route,
        norm weights not float32)."""
        if native.lib() is None or not layers:
            return None
        for layer in layers:
            if not all(getattr(layer, n).row_invariant for n in ("qkv", "o", "gate_up", "down")):
                return None
            norms = [t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm) if t is not None]
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms):
                return None
        if len({getattr(layer, n).format for layer in layers for n in ("qkv", "o", "gate_up", "down")}) != 1:
            return None
        return DecoderLayers(layers, **dims)

    def takes(self, meta: AttentionMetadata, num_tokens: int, k_caches: Sequence[torch.Tensor]) -> bool:
        """Every row of the pass is an exact row, and the pool is one the kernels read."""
        exact = meta.exact
        return (exact is not None and exact.rows.shape[0] == num_tokens and num_tokens > 0
                and k_caches[0].dtype in NATIVE_KV_DTYPES)

    def _bind_pools(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> tuple:
        key = (len(k_caches), k_caches[0].data_ptr(), v_caches[0].data_ptr(), k_caches[0].dtype)
        if self._pools is None or self._pools[0] != key:
            if any(not t.is_contiguous() or t.shape != k_caches[0].shape or t.dtype != k_caches[0].dtype
                   for t in (*k_caches, *v_caches)):
                raise ValueError("KV pools must be contiguous and of one shape and dtype")
            hidden, hq, hkv, d, inter = self._shape
            blocks, block_size = k_caches[0].shape[:2]
            dims = _Dims(hidden, hq, hkv, d, inter, block_size, blocks * block_size, self._w_format,
                         NATIVE_KV_DTYPES[k_caches[0].dtype], self._eps, self._scale)
            ks = (_P * len(k_caches))(*(t.data_ptr() for t in k_caches))
            vs = (_P * len(v_caches))(*(t.data_ptr() for t in v_caches))
            self._pools = (key, dims, ks, vs, (list(k_caches), list(v_caches)))
        return self._pools

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        """Update the residual stream ``hidden`` [T, hidden] (float32, contiguous) through every layer."""
        if len(k_caches) != len(self._layers):
            raise ValueError(f"{len(k_caches)} KV pools for {len(self._layers)} layers")
        if hidden.dtype != torch.float32 or not hidden.is_contiguous() or hidden.shape[1:] != (self._shape[0],):
            raise ValueError(f"hidden must be contiguous float32 [rows, {self._shape[0]}], got {hidden.dtype} "
                             f"{list(hidden.shape)}")
        _, dims, ks, vs, _ = self._bind_pools(k_caches, v_caches)
        rows = hidden.shape[0]
        exact = meta.exact
        work = torch.empty(rows * self._work_per_row, dtype=torch.float32)
        cos, sin = cos.contiguous(), sin.contiguous()
        status = native.lib().pdd_decoder_layers(
            ctypes.byref(dims), self._layers, len(self._layers), ks, vs, hidden.data_ptr(), rows, cos.data_ptr(),
            sin.data_ptr(), meta.slot_mapping.data_ptr(), exact.rows.data_ptr(), exact.tables.data_ptr(),
            exact.offsets.data_ptr(), exact.lens.data_ptr(), work.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"decoder layers kernel failed (status {status}: -1 no memory, -2 bad sizes or slots)")
