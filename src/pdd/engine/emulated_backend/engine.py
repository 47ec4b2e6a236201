"""The emulated engine backend: no weights; step times from the cost model; tokens from a deterministic oracle.

See docs/ENGINE.md "Emulated backend". ``EmulatedEngine`` is the paged engine every backend shares
(engine/core/paged_engine.py: the request table, the real paged KV pool, the radix prefix cache, the
continuous-batching scheduler with chunked prefill, extend and preemption, the export/import and handoff
calls), so those paths are the very same code as the torch engine's, not a copy; it adds what a model would:

- *Tokens.* ``TokenOracle``: the next token is a seeded hash of (oracle seed, absolute position, the last
  ``window`` token ids) mod the vocabulary. It depends on the tokens so far only, so a request continued by
  another engine (``commit_import``/``extend_known`` with the tokens so far, as at handoff) yields exactly
  the tokens one engine alone yields. Greedy-equivalent: temperature, top-k/p, penalties and the request's
  sampling seed are ignored; logprobs are not produced (``None``). EOS: with ``eos_rate`` 0 (the default)
  the oracle never emits an EOS id, so ``max_new_tokens`` (or ``stop_at``) sets every length, as a benchmark
  with ``ignore_eos`` would; with ``eos_rate`` p > 0 it emits the first EOS id with probability p per output
  position (a hash too, so also handoff-exact), never for a request with ``ignore_eos`` or before its
  ``min_tokens``. ``stop_token_ids`` end a request when drawn (masked before ``min_tokens``); ``stop``
  strings are ignored (no tokenizer).
- *Step times.* Each step's modeled duration is ``CostModel.batch_time`` of its batch (decode sequences and
  their context, prefill chunks, extend passes) times ``time_dilation``; the step then sleeps until
  ``start + duration`` (``time.sleep(max(0, deadline - now))``), so the emulator's own CPU time is paid out
  of the step budget, as Dynamo's mocker does. A step starts on the modeled timeline: at the previous
  step's deadline when they run back to back, else when its work reached the engine, so the host's work
  around steps is paid out of the budget too (``_pace``). A step whose deadline had already passed counts in
  ``stats()["overrun_steps"]`` (the box could not keep up).
- *KV bytes.* The pool is a real ``KVPool`` with a small layout (default 2 layers x 1 KV head x 8 dims,
  float32): every computed token writes its token id into K and its position into V (all layers, all
  dims), so the bytes the transports move are real and checkable. Scaling those bytes to the modeled
  ``kv_bytes_per_token / scale`` is a later step.

Capacity: ``num_blocks`` blocks of ``block_size`` tokens; by default the cost model's ``kv_capacity_tokens``
(from ``from_hardware``: chip memory less weights), else 1024 blocks.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdd.engine.core.dtypes import DtypeChoice
from pdd.engine.core.paged_engine import PagedEngine
from pdd.engine.core.request import Request, StepOutput
from pdd.engine.core.sampling_params import SamplingParams
from pdd.engine.core.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS
from pdd.shared.cost_model import Chip, CostModel, ModelSpec, from_hardware
from pdd.shared.kv_layout import KVLayout

PAGE_FORMAT = "emulated"  # KVLayout.backend: the page format this engine writes
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_NUM_BLOCKS = 1024  # when the cost model states no KV capacity
_UNBOUNDED = 1 << 40  # CostModel's default kv_capacity_tokens: "no capacity stated"


class TokenOracle:
    """The next token as a seeded hash of the tokens so far: the same on every engine of a fleet."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int = 0, window: int = 8,
                 eos_rate: float = 0.0) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if window < 1:
            raise ValueError(f"oracle window must be >= 1, got {window}")
        if not 0.0 <= eos_rate <= 1.0:
            raise ValueError(f"eos_rate must be in [0, 1], got {eos_rate}")
        if eos_rate > 0 and not eos_token_ids:
            raise ValueError("eos_rate > 0 needs an EOS token id")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.seed = int(seed) & ((1 << 63) - 1)
        self.window = window
        self.eos_rate = float(eos_rate)

    def _hash(self, tokens: Sequence[int], salt: int) -> tuple[int, float]:
        tail = tokens[-self.window:]
        data = struct.pack(f"<qqq{len(tail)}q", self.seed, len(tokens), salt, *tail)
        d = hashlib.blake2b(data, digest_size=16).digest()
        return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") / 2.0**64

    def next_token(self, tokens: Sequence[int], num_outputs: int, params: SamplingParams) -> int:
        """The token after ``tokens`` (prompt plus outputs so far; ``num_outputs`` of them are outputs)."""
        h, u = self._hash(tokens, 0)
        early = num_outputs < params.min_tokens
        if self.eos_rate > 0 and not params.ignore_eos and not early and u < self.eos_rate:
            return self.eos_token_ids[0]
        banned = set(self.eos_token_ids)
        if early:
            banned.update(params.stop_token_ids)
        salt = 0
        tok = h % self.vocab_size
        while tok in banned:  # redraw (the vocabulary is far larger than the banned set)
            salt += 1
            tok = self._hash(tokens, salt)[0] % self.vocab_size
        return tok


class EmulatedEngine(PagedEngine):
    """An ``EngineBackend`` with the real KV pool, radix cache and scheduler, timed by a ``CostModel``."""

    def __init__(
        self,
        cost_model: CostModel | None = None,
        *,
        time_dilation: float = 1.0,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        eos_token_ids: Sequence[int] = (DEFAULT_VOCAB_SIZE - 1,),
        eos_rate: float = 0.0,
        oracle_seed: int = 0,
        oracle_window: int = 8,
        num_layers: int = 2,
        kv_heads: int = 1,
        head_dim: int = 8,
        kv_dtype: str = "float32",
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 4096,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        max_model_len: int | None = None,
        enable_prefix_cache: bool = True,
        cache_finished: bool = True,
        write_kv: bool = True,
        profile: dict[str, Any] | None = None,
    ) -> None:
        """``time_dilation`` k: every modeled duration is multiplied by k (k > 0). Other arguments: as
        ``PagedEngine`` (pool, scheduler, cache) and the module docstring (oracle, KV layout)."""
        if not time_dilation > 0:
            raise ValueError(f"time_dilation must be > 0, got {time_dilation}")
        self.cost_model = cost_model or CostModel()
        self.time_dilation = float(time_dilation)
        eos = [int(t) for t in eos_token_ids]
        if any(not 0 <= t < vocab_size for t in eos):
            raise ValueError(f"EOS ids {eos} outside the vocabulary [0, {vocab_size})")
        self.oracle = TokenOracle(vocab_size, eos, oracle_seed, oracle_window, eos_rate)
        self.dtype_choice = DtypeChoice(kv_dtype, kv_dtype, "emulated backend: no weights")
        layout = KVLayout(num_layers=num_layers, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                          dtype=kv_dtype, backend=PAGE_FORMAT)
        if num_blocks is None:
            cap = self.cost_model.kv_capacity_tokens
            num_blocks = cap // block_size if cap < _UNBOUNDED else DEFAULT_NUM_BLOCKS
        super().__init__(layout, num_blocks, position_limit=max_model_len or (1 << 31), vocab_size=vocab_size,
                         eos_token_ids=eos, max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                         prefill_chunk_tokens=prefill_chunk_tokens, enable_prefix_cache=enable_prefix_cache,
                         cache_finished=cache_finished)
        self.write_kv = write_kv
        self.profile = profile or {}  # what it emulates (profile.py's EmulatedProfile.describe), for describe()
        # pacing counters (stats())
        self.steps = 0
        self.overrun_steps = 0
        self.modeled_seconds = 0.0  # sum of modeled step durations, before dilation
        self.overrun_seconds = 0.0  # wall time past the deadlines of overrun steps
        self.last_step_modeled_s = 0.0
        self._last_end = 0.0  # when the previous step ended: its deadline, or when it overran it
        self._chained = False  # the previous step met its deadline with work left: the next one follows it
        self._woken_at: float | None = None  # when work reached the engine while it was not stepping

    @classmethod
    def from_hardware(cls, chip: Chip, chips: int, model: ModelSpec, *, mfu: float = 0.4, mbu: float = 0.7,
                      mem_util: float = 0.9, p0: float = 0.02, d0: float = 0.005, **kwargs: Any) -> EmulatedEngine:
        """An engine timed like ``chips`` x ``chip`` serving ``model`` (the simulator's ``from_hardware``; the
        defaults are a scenario's utilisation defaults, sim/scenario.py)."""
        return cls(from_hardware(chip, chips, model, mfu, mbu, mem_util, p0, d0), **kwargs)

    # ---- what a model would do ----------------------------------------------------------
    @property
    def linear_kernel(self) -> str:
        return "emulated (cost model)"

    def describe(self) -> dict[str, Any]:
        return {"emulated": self.profile} if self.profile else {}

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(
            steps=self.steps,
            overrun_steps=self.overrun_steps,
            overrun_share=self.overrun_steps / self.steps if self.steps else 0.0,
            overrun_seconds=self.overrun_seconds,
            modeled_seconds=self.modeled_seconds,
            time_dilation=self.time_dilation,
        )
        return out

    def step(self) -> list[StepOutput]:
        """As the torch engine's step (same scheduling, finishes and outputs), with the forward pass replaced by the
        cost model's duration, the oracle's tokens and the KV pattern writes; sleeps to the step's deadline."""
        t0 = time.perf_counter()
        outputs = self._finishes_before_step()
        decode, prefill = self.scheduler.schedule()
        if not decode and not prefill:
            return outputs
        modeled = self.cost_model.batch_time(
            [r.num_computed + 1 for r in decode],
            [(n, r.num_computed, r.num_computed == r.cached_tokens) for r, n in prefill
             if r.num_computed < r.prompt_len],
            [(n, r.num_computed) for r, n in prefill if r.num_computed >= r.prompt_len],
        )
        chunks = [(r, r.num_computed, 1) for r in decode] + [(r, r.num_computed, n) for r, n in prefill]
        if self.write_kv:
            self._write_kv(chunks)
        sample_reqs = list(decode)
        sample_reqs += [r for r, n in prefill if r.num_computed + n == len(r.tokens) and not r.paused]
        for r, _, n in chunks:
            r.num_computed += n
        self.num_forward_tokens += sum(n for _, _, n in chunks)
        for req in sample_reqs:
            position = req.num_outputs
            tok = self.oracle.next_token(req.tokens, position, req.params)
            req.tokens.append(tok)
            reason = self._finish_reason(req, tok)
            if reason:
                self._finish(req, reason)
            outputs.append(StepOutput(req.rid, [tok], position, reason is not None, reason, None))
        self._pace(t0, modeled)
        return outputs

    def _write_kv(self, chunks: list[tuple[Request, int, int]]) -> None:
        """K := token id, V := position, for every token computed this step (all layers, heads and dims)."""
        bs = self.block_size
        slots, toks, poss = [], [], []
        for req, start, n in chunks:
            pos = torch.arange(start, start + n)
            table = torch.tensor(req.block_table, dtype=torch.long)
            slots.append(table[pos // bs] * bs + pos % bs)
            toks.append(torch.tensor(req.tokens[start:start + n]))
            poss.append(pos)
        idx = torch.cat(slots)
        dtype = self.layout.torch_dtype
        kval = torch.cat(toks).to(dtype)[:, None, None]
        vval = torch.cat(poss).to(dtype)[:, None, None]
        shape = (-1, self.layout.kv_heads, self.layout.head_dim)
        for k, v in zip(self.pool.k_cache, self.pool.v_cache):
            k.view(shape)[idx] = kval.expand(-1, *shape[1:])
            v.view(shape)[idx] = vval.expand(-1, *shape[1:])

    # ---- pacing -----------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    max_new_tokens: int = 16, hold_kv: bool = False, known_outputs: list[int] | None = None) -> None:
        self._work_arrived()
        super().add_request(rid, prompt_ids, params, max_new_tokens, hold_kv, known_outputs)

    def commit_import(self, rid: str, prompt_ids: list[int], output_ids_so_far: list[int],
                      params: SamplingParams | None = None, max_new_tokens: int = 16) -> None:
        self._work_arrived()
        super().commit_import(rid, prompt_ids, output_ids_so_far, params, max_new_tokens)

    def _work_arrived(self) -> None:
        """A request reached an engine that is not stepping back to back: its next step's budget starts now
        (the prefix match and admission that follow are the host's work, inside the cost model's p0)."""
        if not self._chained and self._woken_at is None:
            self._woken_at = time.perf_counter()

    def _pace(self, t0: float, modeled: float) -> None:
        """Sleep until the step's deadline, ``modeled x time_dilation`` after the step's start; count the step
        as overrun when that has passed.

        The start is on the modeled timeline, not when ``step`` was called: a step that directly follows one
        which met its deadline starts at that deadline (a busy accelerator runs its steps back to back), and
        the first step after an idle spell starts when its work reached the engine (the cost model's fixed
        costs hold scheduling and launch). So the host's work around a step (admitting a request and matching
        its prefix, handing outputs to the event loop, publishing them, the next call onto the engine thread)
        is paid out of the budget. Timing each step from its own call would add that work to every step
        (docs/BENCHMARKS.md measured TPOT 30-60 % above the model on 2 busy cores). A step never starts before the previous one ended, so
        an overrun is not caught up by a burst."""
        self.steps += 1
        self.modeled_seconds += modeled
        self.last_step_modeled_s = modeled
        if self._chained:
            start = self._last_end
        else:
            start = min(t0, max(self._woken_at if self._woken_at is not None else t0, self._last_end))
        self._woken_at = None
        deadline = start + modeled * self.time_dilation
        now = time.perf_counter()
        if now > deadline:
            self.overrun_steps += 1
            self.overrun_seconds += now - deadline
            self._last_end, self._chained = now, False
            return
        time.sleep(deadline - now)
        self._last_end, self._chained = deadline, self.has_work()


__all__ = ["EmulatedEngine", "TokenOracle"]
