"""The cost model, shared by the simulator (pdd.sim) and the emulated engine (pdd.engine.emulated_backend.engine).

Chips and model: the physical facts a scenario states. ``CostModel``: how long a prefill, a decode step
and an extend take on one instance (a group of chips holding one model replica). Roofline-shaped and
linear in its coefficients, so the same form can be derived from chip datasheets (``from_hardware``) or
fitted to live measurements (``pdd sim calibrate``). Pure data and maths: imports nothing else of pdd
(pyproject's [tool.importlinter] "shared" contract), so both the simulator and the engine may import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Chip:
    """A chip on the report's four axes plus price (per chip, in any consistent unit)."""

    name: str
    peak_tflops: float  # dense peak at the serving precision
    mem_gb: float
    mem_bw_tbs: float
    interconnect_gbs: float  # scale-up (NVLink-class) bandwidth per chip, GB/s
    price: float = 1.0
    attn_peak_tflops: float = 0.0  # dense peak at the attention precision (0 = peak_tflops)

    @property
    def attn_tflops(self) -> float:
        return self.attn_peak_tflops or self.peak_tflops


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs of a model: sizes, not weights."""

    name: str
    layers: int
    kv_bytes_per_token: float
    active_params: float  # parameters touched per token (MoE: shared + routed active)
    weight_bytes: float  # resident weight bytes per instance
    attn_flops_per_pair: float = 0.0  # prefill: FLOPs per (query token, key token) pair, all layers
    decode_attn_flops_per_pair: float = 0.0  # decode: the same per pair, in the decode kernel's form
    experts: int = 0  # routed experts per layer (0 = dense)
    experts_active: int = 0
    expert_weight_fraction: float = 0.0  # share of weight_bytes that is routed experts
    max_context_tokens: int = 131072  # the served context: a router's only bound on output when none is sent

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.active_params

    def touched_weight_fraction(self, batch: float) -> float:
        """Expected share of weights read in a decode step of `batch` sequences (MoE routing)."""
        if self.experts <= 0 or batch <= 0:
            return 1.0
        p_untouched = (1.0 - self.experts_active / self.experts) ** batch
        return (1.0 - self.expert_weight_fraction) + self.expert_weight_fraction * (1.0 - p_untouched)


# Tokens one prefill step computes on a datacenter accelerator (vLLM-class chunked prefill): the emulated fleet's
# chunk (launch/emulate.py) and the simulator's, whose streamed KV export sends each chunk's blocks as it ends.
DATACENTER_PREFILL_CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class CostModel:
    """Seconds per operation on one instance (a group of chips holding one model replica)."""

    p0: float = 0.02  # fixed cost of one prefill (scheduling, launch)
    p_tok: float = 1e-5  # per new prompt token (weights FLOPs)
    p_attn: float = 0.0  # per (new token x attended token) pair (attention FLOPs)
    # prefill service-time multipliers (mean 1) to resample: a live system's measured spread; () = none
    p_noise: tuple[float, ...] = ()
    d0: float = 0.005  # fixed cost of one decode step
    d_w: float = 0.0  # reading all weights once (scaled by the touched share for MoE)
    d_seq: float = 0.0  # per sequence in the batch (compute)
    d_ctx: float = 0.0  # per context token in the batch (KV reads)
    kv_capacity_tokens: int = 1 << 40
    experts: int = 0
    experts_active: int = 0
    expert_weight_fraction: float = 0.0

    def prefill_time(self, new_tokens: float, cached_tokens: float) -> float:
        return self.p0 + self.p_tok * new_tokens + self.p_attn * new_tokens * (cached_tokens + new_tokens / 2)

    def touched(self, batch: float) -> float:
        """Expected share of weights one decode step reads (MoE: only the routed experts hit)."""
        if self.experts <= 0 or batch <= 0:
            return 1.0
        f = self.expert_weight_fraction
        return (1 - f) + f * (1 - (1 - self.experts_active / self.experts) ** batch)

    def step_time(self, batch: float, ctx_tokens: float) -> float:
        """One decode step for `batch` sequences holding `ctx_tokens` KV tokens in total."""
        w = self.d_w * self.touched(batch) if self.d_w else 0.0
        return self.d0 + w + self.d_seq * batch + self.d_ctx * ctx_tokens

    def extend_time(self, tokens: int, batch: float, ctx_tokens: float) -> float:
        """Extend-Decode: k known tokens in one pass cost about one step plus their FLOPs."""
        return self.step_time(batch + 1, ctx_tokens) + self.p_tok * tokens

    def batch_time(self, decode_ctx: Sequence[int], prompt_chunks: Sequence[tuple[int, int, bool]] = (),
                   extend_chunks: Sequence[tuple[int, int]] = ()) -> float:
        """One engine step that mixes work (continuous batching, chunked prefill), as the emulated engine runs it.

        ``decode_ctx``: per decoding sequence, the tokens it attends (its context after this step).
        ``prompt_chunks``: (new tokens, tokens already computed, whether the chunk begins its prompt) per prefill
        chunk. A prompt pays the fixed prefill cost ``p0`` once, in the step of its first chunk, and each chunk
        its token and attention FLOPs, so a prompt cut into chunks costs in total what ``prefill_time`` says
        of it whole (the simulator's prefill).
        ``extend_chunks``: (known tokens, tokens already computed) per extend pass: each joins the decode
        batch as one sequence and adds its tokens' FLOPs (``extend_time``'s form).
        No work: 0."""
        t = 0.0
        batch = len(decode_ctx) + len(extend_chunks)
        if batch:
            ctx = sum(decode_ctx) + sum(start + n for n, start in extend_chunks)
            t += self.step_time(batch, ctx) + self.p_tok * sum(n for n, _ in extend_chunks)
        for n, start, begins in prompt_chunks:
            t += self.prefill_time(n, start) - (0.0 if begins else self.p0)
        return t

    @property
    def p_sigma(self) -> float:
        """Log-spread of the service-time multipliers (a one-number summary of `p_noise`)."""
        return float(np.std(np.log(self.p_noise))) if self.p_noise else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Coefficients for display and JSON (the noise sample summarised by `p_sigma`)."""
        out = asdict(self)
        out.pop("p_noise")
        out["p_sigma"] = self.p_sigma
        return out

    def with_(self, **changes: Any) -> CostModel:
        return replace(self, **changes)


def from_hardware(
    chip: Chip, chips: int, model: ModelSpec, mfu: float, mbu: float, mem_util: float,
    p0: float = 0.02, d0: float = 0.005,
) -> CostModel:
    """Derive coefficients from datasheet numbers and utilisation assumptions (no fitting).

    Attention runs at its own precision's peak (serving stacks keep it in BF16 while the GEMMs run
    in FP8). A decode step reads each context token's KV once and does the decode kernel's FLOPs on
    it; whichever takes longer sets the per-token cost (roofline), so a chip with much bandwidth but
    little compute can be compute-bound in decode attention.
    """
    peak = chips * chip.peak_tflops * 1e12 * mfu
    attn_peak = chips * chip.attn_tflops * 1e12 * mfu
    bw = chips * chip.mem_bw_tbs * 1e12 * mbu
    kv_bytes = chips * chip.mem_gb * 1e9 * mem_util - model.weight_bytes
    if kv_bytes <= 0:
        raise ValueError(
            f"{model.name} ({model.weight_bytes / 1e9:.0f} GB) does not fit on {chips} x {chip.name} "
            f"at memory utilisation {mem_util}"
        )
    return CostModel(
        p0=p0,
        p_tok=model.flops_per_token / peak,
        p_attn=model.attn_flops_per_pair / attn_peak,
        d0=d0,
        d_w=model.weight_bytes / bw,
        d_seq=model.flops_per_token / peak,
        d_ctx=max(model.kv_bytes_per_token / bw, model.decode_attn_flops_per_pair / attn_peak),
        kv_capacity_tokens=int(kv_bytes / model.kv_bytes_per_token),
        experts=model.experts,
        experts_active=model.experts_active,
        expert_weight_fraction=model.expert_weight_fraction,
    )
