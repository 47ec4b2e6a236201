"""The torch engine: Llama-family weights and exact CPU math (pdd.kernels) over the paged engine every
backend shares (engine/core/paged_engine.py). What it adds is the model: loading a checkpoint, choosing the
serving dtype, and a step that runs one forward pass over the scheduled batch and samples.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pdd.engine.core.dtypes import DtypeChoice, resolve_dtypes
from pdd.engine.core.kv_pool import KVPool
from pdd.engine.core.paged_engine import PagedEngine
from pdd.engine.core.request import Request, StepOutput
from pdd.engine.core.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS
from pdd.engine.torch_backend.config import ModelConfig
from pdd.engine.torch_backend.dtype_probe import probe_dtype
from pdd.engine.torch_backend.model import CausalLM
from pdd.engine.torch_backend.sampling import sample_rows, token_logprobs
from pdd.kernels.attention import build_attention_metadata
from pdd.shared.kv_layout import KVLayout, dtype_from_name

PAGE_FORMAT = "torch"  # KVLayout.backend: the page format this engine writes (a fleet runs one)
DEFAULT_KV_MEMORY_BYTES = 512 * 1024 * 1024


class TorchEngine(PagedEngine):
    """Llama-family weights and exact CPU math (pdd.kernels) over the shared paged engine."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any = None,
        *,
        kv_memory_bytes: int = DEFAULT_KV_MEMORY_BYTES,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 4096,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        max_model_len: int | None = None,
        enable_prefix_cache: bool = True,
        cache_finished: bool = True,
        dtype_choice: DtypeChoice | None = None,
        batch_invariant: bool = True,
    ) -> None:
        """``batch_invariant``: decode-phase attention accumulates in float64, so a request's tokens do not
        depend on its batch mates or on extend vs decode (kernels/attention.py; what makes a handoff exact).
        ``prefill_chunk_tokens``: the most tokens one request computes per step (at most the step budget,
        ``max_prefill_tokens``): a long prompt shares each step with the requests queued behind it."""
        cfg = model.config
        self.model = model
        self.config: ModelConfig = cfg
        weights_dtype = _dtype_name(model.dtype)
        self.dtype_choice = dtype_choice or DtypeChoice(weights_dtype, weights_dtype, "set by the caller")
        self.layout = KVLayout(
            num_layers=cfg.num_layers,
            block_size=block_size,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype_choice.kv_dtype,
            backend=PAGE_FORMAT,
        )
        if num_blocks is None:
            num_blocks = KVPool.blocks_for_budget(self.layout, kv_memory_bytes)
        limit = cfg.max_position_embeddings if max_model_len is None else min(max_model_len, cfg.max_position_embeddings)
        eos = list(cfg.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(int(tok_eos))
        super().__init__(self.layout, num_blocks, position_limit=limit, vocab_size=cfg.vocab_size,
                         eos_token_ids=eos, tokenizer=tokenizer, max_num_seqs=max_num_seqs,
                         max_prefill_tokens=max_prefill_tokens, prefill_chunk_tokens=prefill_chunk_tokens,
                         enable_prefix_cache=enable_prefix_cache, cache_finished=cache_finished)
        self.capture_logits = False  # tests: keep each sampled row's logits in captured_logits
        self.captured_logits: dict[str, list[torch.Tensor]] = {}
        self.decode_accum = torch.float64 if batch_invariant else torch.float32

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        path: str = "default",
        dtype: str = "float32",
        *,
        kv_dtype: str = "auto",
        load_tokenizer: bool = True,
        num_threads: int | None = None,
        **kwargs: Any,
    ) -> "TorchEngine":
        """Load a HF checkpoint folder, a .gguf file, or "default" (the packaged SmolLM2 GGUF).

        ``dtype``/``kv_dtype``: "auto" resolves by timing the model's layer shapes in both dtypes on this CPU
        (engine/torch_backend/dtype_probe.py, cached); ``engine.dtype_choice`` says what was picked and why.
        """
        from pdd.engine.torch_backend.loader import load_checkpoint
        from pdd.shared.model_files import resolve_model_path
        from pdd.shared.tokenizer import load_tokenizer as _load_tok

        if num_threads is None:
            num_threads = int(os.environ.get("PDD_NUM_THREADS", 0)) or os.cpu_count() or 1
        torch.set_num_threads(num_threads)
        path = resolve_model_path(path)
        config, weights = load_checkpoint(path)
        choice = resolve_dtypes(dtype, kv_dtype, probe=lambda: probe_dtype(config))
        model = CausalLM(config, weights, dtype_from_name(choice.dtype))
        del weights
        tokenizer = _load_tok(path) if load_tokenizer else None
        return cls(model, tokenizer, dtype_choice=choice, **kwargs)

    # ---- introspection ----------------------------------------------------------------------
    @property
    def k_cache(self) -> list[torch.Tensor]:
        return self.pool.k_cache

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return self.pool.v_cache

    @property
    def linear_kernel(self) -> str:
        return self.model.linear_kernel

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one forward pass over the scheduled batch; return new tokens and finishes."""
        outputs = self._finishes_before_step()
        decode, prefill = self.scheduler.schedule()
        if not decode and not prefill:
            return outputs
        input_ids: list[int] = [r.tokens[r.num_computed] for r in decode]
        positions: list[int] = [r.num_computed for r in decode]
        sample_reqs: list[Request] = list(decode)
        rows: list[int] = list(range(len(decode)))
        specs = []
        offset = len(decode)
        for req, n in prefill:
            start = req.num_computed
            input_ids.extend(req.tokens[start : start + n])
            positions.extend(range(start, start + n))
            specs.append((req.block_table, start, n, start + n <= req.prompt_len))  # prompt only: fp32 attention
            offset += n
            if start + n == len(req.tokens) and not req.paused:
                sample_reqs.append(req)
                rows.append(offset - 1)
        meta = build_attention_metadata(
            self.block_size, [r.block_table for r in decode], [r.num_computed + 1 for r in decode], specs,
            self.decode_accum,
        )
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            self.pool.k_cache,
            self.pool.v_cache,
            torch.tensor(rows, dtype=torch.long),
        )
        self.num_forward_tokens += len(input_ids)
        for r in decode:
            r.num_computed += 1
        for req, n in prefill:
            req.num_computed += n
        if sample_reqs:
            params = [r.params for r in sample_reqs]
            tokens = sample_rows(logits, params, [r.num_outputs for r in sample_reqs],
                                 [(r.tokens, r.prompt_len) for r in sample_reqs], self.eos_token_ids)
            logprobs = token_logprobs(logits, tokens, [p.logprobs for p in params])
            if self.capture_logits:
                for i, req in enumerate(sample_reqs):
                    self.captured_logits.setdefault(req.rid, []).append(logits[i].clone())
            for req, tok, lp in zip(sample_reqs, tokens, logprobs):
                position = req.num_outputs
                req.tokens.append(tok)
                reason = self._finish_reason(req, tok)
                if reason:
                    self._finish(req, reason)
                outputs.append(StepOutput(req.rid, [tok], position, reason is not None, reason,
                                          None if lp is None else [lp]))
        return outputs


def _dtype_name(dtype: torch.dtype) -> str:
    from pdd.shared.kv_layout import dtype_name

    return dtype_name(dtype)


__all__ = ["TorchEngine"]
