"""Llama-family decoder (Llama, Mistral, Qwen2/2.5, Qwen3) executed over a paged KV pool.

One class covers the family; the differences are flags in ModelConfig (qkv bias, q/k norm,
tied embeddings). Weights are repacked at load time: q/k/v into one matrix and gate/up into
one, so a layer is four GEMMs plus attention (fewer kernel launches, better GEMM shapes).

Projections are `pdd.kernels.Linear`: our row-invariant kernel on AVX2 CPUs (fp32 or bf16 weights, fp32
activations), oneDNN-packed weights elsewhere on CPU where available, else a transposed weight for
``torch.mm``. The o and down projections fuse the residual add into the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdd.engine.torch_backend.config import ModelConfig
from pdd.kernels import (
    AttentionMetadata,
    DecoderLayers,
    Linear,
    RotaryEmbedding,
    activation_dtype,
    apply_rotary_,
    paged_attention,
    rms_norm,
    silu_mul,
)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class CausalLM:
    """Forward pass of a flat token batch; returns logits only for the requested rows."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype  # the weights'
        # the residual stream's, norms', attention's: float32 where the projections take bf16 weights in
        # fp32 arithmetic (our kernel), which keeps SmolLM2's bf16 top-1 within 1 % of fp32 (docs/ENGINE.md)
        self.activation_dtype = activation_dtype(dtype)
        act = self.activation_dtype

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing weight {name}")
            return weights[name].to(dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return weights[name].to(dtype).to(act).contiguous() if name in weights else None

        self.embed = w("model.embed_tokens.weight")  # weights' dtype; rows widen to act at lookup
        self.final_norm = w("model.norm.weight").to(act)
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = Linear(w("lm_head.weight"), fp32_inputs=True)
        else:
            # tied: its own copy (the embedding lookup keeps [vocab, hidden])
            self.lm_head = Linear(self.embed, fp32_inputs=True)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                             w(p + "self_attn.v_proj.weight")], dim=0)
            bias = None
            if config.qkv_bias:
                bias = torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                  w(p + "self_attn.v_proj.bias")]).to(act).contiguous()
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight").to(act),
                qkv=Linear(qkv, bias),
                o=Linear(w(p + "self_attn.o_proj.weight"), opt(p + "self_attn.o_proj.bias")),
                q_norm=opt(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                k_norm=opt(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                post_norm=w(p + "post_attention_layernorm.weight").to(act),
                gate_up=Linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], dim=0)),
                down=Linear(w(p + "mlp.down_proj.weight")),
            ))
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, act
        )
        self.scale = config.head_dim ** -0.5
        # decode steps through every layer in one C call where all projections run our kernel (kernels/decoder.py)
        self.decoder_layers = DecoderLayers.build(
            self.layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            intermediate_size=config.intermediate_size, eps=config.rms_norm_eps, scale=self.scale,
        )

    @property
    def linear_kernel(self) -> str:
        """The projections' route (kernels/linear.py), for the startup log."""
        return self.layers[0].qkv.kernel if self.layers else self.lm_head.kernel

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids/positions [T]; returns float32 logits [len(logits_rows), vocab]."""
        num_tokens = input_ids.shape[0]
        cos, sin = self.rotary.lookup(positions)
        hidden = self.embed.index_select(0, input_ids).to(self.activation_dtype)
        if self.decoder_layers is not None and self.decoder_layers.takes(meta, num_tokens, k_caches):
            self.decoder_layers.run(hidden, cos, sin, meta, k_caches, v_caches)  # in place, same kernels from C
        else:
            hidden = self._layers(hidden, cos, sin, meta, k_caches, v_caches)
        if logits_rows.shape[0] != num_tokens:
            hidden = hidden.index_select(0, logits_rows)
        hidden = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return self.lm_head(hidden).float()

    def _layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
        """The residual stream through every layer, one kernel call per op."""
        cfg = self.config
        hq, hkv, dim, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        num_tokens = hidden.shape[0]
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            x = rms_norm(hidden, layer.input_norm, eps)
            qkv = layer.qkv(x).view(num_tokens, hq + 2 * hkv, dim)
            v = qkv[:, hq + hkv :]
            if layer.q_norm is not None:
                q = apply_rotary_(rms_norm(qkv[:, :hq], layer.q_norm, eps), cos, sin)
                k = apply_rotary_(rms_norm(qkv[:, hq : hq + hkv], layer.k_norm, eps), cos, sin)
            else:
                q, k = apply_rotary_(qkv[:, :hq], cos, sin), apply_rotary_(qkv[:, hq : hq + hkv], cos, sin)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            hidden = layer.o.add_to(hidden, attn)
            x = rms_norm(hidden, layer.post_norm, eps)
            hidden = layer.down.add_to(hidden, silu_mul(layer.gate_up(x)))
        return hidden
