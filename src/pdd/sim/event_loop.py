"""Discrete-event core: prefill queues, KV transfers, fluid continuous-batching decoders, handoff.

Lean by design (1M requests must run in under a minute on one core):
- Prefill and transfers are FIFO multi-server queues with known service times: a request takes the
  earliest-free server when it arrives, so its end follows from a heap of "free at" times at once.
- A request may arrive only once another one has ended (`SimInput.after`: a session's next turn after
  its previous answer), so arrivals are merged into the event stream rather than fixed up front.
- A decoder is modelled in virtual time: every running sequence gains one token per step, so the
  next finisher is the one with the fewest tokens left. Events happen only when a batch changes
  (join, finish, relay stop), never per token.
Routing and handoff decisions call `pdd.shared.policy`, the router's own module; pipeline names
come from `pdd.shared.pipelines`.

Why one module: it is one job, the event loop. `_Run` builds the per-request lists and pools once;
`_loop` copies them into locals, and its helpers are closures over the same lists (`_transfer_ops`,
`_decode_ops`): locals and closure cells, not attribute look-ups, are what keep 1M requests under a
minute. Its inputs and results (`SimInput`, `SimResult`) and the decoder model (`_Inst`) are what the
loop reads and writes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from pdd.scenarios import WanLink
from pdd.shared.config import ModelConfig, ServiceConfig
from pdd.shared.cost_model import DATACENTER_PREFILL_CHUNK_TOKENS, CostModel
from pdd.shared.pipelines import HandoffMode, Pipeline
from pdd.shared.policy import PolicyConfig, RouteInputs, choose_handoff_mode, choose_pipeline, instance_cost

from .prefix_cache import BlockCache
from .wan_view import HeartbeatWanView

# Pipeline codes in results: PDD's pipelines, and the baselines' conventional prefill -> decode path.
P_MD, P_RLD_MD, P_RLD, P_D = 0, 1, 2, 3
BASELINE_PD = "P-D"  # the simulator's own baseline path (naive/local runs), not a PDD pipeline
_CODE = {Pipeline.P_MD: P_MD, Pipeline.P_RLD_MD: P_RLD_MD, Pipeline.P_RLD: P_RLD}
PIPELINE_NAMES = {**{code: pipeline.value for pipeline, code in _CODE.items()}, P_D: BASELINE_PD}

# Event kinds.
_KV_READY, _FINISH, _MD_READY, _HANDOFF, _RLD_STOP, _MD_JOIN, _PREFILLED, _ARRIVE = range(8)
TOKEN_ID_BYTES = 15  # report: 100 token ids = 1.5 KB on the wire


@dataclass
class SimInput:
    """Everything one run needs; built by `scenario.py` or directly by tests and benchmarks."""

    arrivals: np.ndarray  # a request's arrival, or its earliest one where ``after`` holds it back
    prompt: np.ndarray
    cached: np.ndarray
    output: np.ndarray
    prefill: CostModel
    decode: CostModel
    n_prefill: int
    n_decode: int
    kv_bytes_per_token: float
    kind: str = "pdd"  # "pdd" (policy routing), "naive" (P-D over WAN), "local" (P-D in one site)
    relay: CostModel | None = None
    n_relay: int = 0
    wan: WanLink | None = None
    rdma_gbps: float = 3200.0
    rdma_setup_s: float = 0.02
    drc: bool = True  # decode-side radix cache: MD holds what P holds (times drc_alignment)
    drc_alignment: float = 1.0
    # main decode's prefix hits where they differ from P's (a later turn: MD decoded the previous answer, P never
    # saw it, so MD holds more); None: cached x drc_alignment
    md_cached: np.ndarray | None = None
    first_token_from_prefill: bool = False
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    seed: int = 0
    record_itl: bool = True
    route_bandwidth_bps: float | None = None  # what the router believes the WAN does (None: the link's per-flow rate)
    # per request, the request whose end (completed or failed) it waits for before it arrives, -1 for none: an
    # agent sends a session's next turn only after its previous answer; None: every request arrives on time
    after: np.ndarray | None = None
    # what the router knows of each request's output: the max_tokens its client sent, else the model's room
    # (max_context_tokens - prompt); never the output length itself, which no live router knows in advance
    route_max_tokens: np.ndarray | None = None
    max_context_tokens: int = 131072
    # each prompt's block-hash chain (a trace's hash_ids): P's and MD's prefix caches are then simulated per
    # instance and placement follows the router's cost, so hits come from the traffic and `cached`/`md_cached`
    # are not read; None: hits are the `cached` column (a workload that states its hit distribution)
    chains: list[tuple[int, ...]] | None = None
    block_tokens: int = 512
    prefill_cache_tokens: int | None = None  # one P instance's cache (None: its KV capacity)
    # the live router's load figure is requests in flight over this (the engines' max_num_seqs default)
    load_norm_seqs: int = ModelConfig.model_fields["max_num_seqs"].default
    # how often each P reports its WAN backlog: the router's WAN-saturated rule reads the last report (wan_view.py)
    heartbeat_s: float = ServiceConfig.model_fields["heartbeat_ms"].default / 1000
    # P streams its KV: each prefill chunk's blocks leave as the chunk ends (roles/kv_export.py); None: the whole
    # prompt's KV leaves at the prefill's end
    prefill_chunk_tokens: int | None = DATACENTER_PREFILL_CHUNK_TOKENS


@dataclass
class SimResult:
    arrival: np.ndarray  # when each request arrived (later than SimInput.arrivals where `after` held it back)
    ttft: np.ndarray  # NaN where failed
    tt2: np.ndarray  # time to token position 1 (NaN where failed or a one-token answer)
    tpot: np.ndarray
    e2e: np.ndarray
    ok: np.ndarray
    pipeline: np.ndarray
    output: np.ndarray
    prompt: np.ndarray
    p_cached: np.ndarray  # prompt tokens P held (simulated cache, or the input column)
    md_cached: np.ndarray  # prompt tokens MD held when the router chose (0 where no decode-side cache)
    p_evictions: int  # blocks the simulated P caches evicted (0 without chains)
    md_evictions: int  # blocks the simulated MD caches evicted
    wan_bytes: float
    wan_bytes_naive: float  # what the same requests would move without any decode-side cache, uncoded (full KV)
    wan_bandwidth_gbps: float
    makespan: float
    tokens_relay: float
    tokens_main: float
    itl_values: np.ndarray
    itl_weights: np.ndarray
    events: int

    @property
    def completed(self) -> int:
        return int(self.ok.sum())

    @property
    def failed(self) -> int:
        return int((~self.ok).sum())


class _Inst:
    """One decode instance in virtual time (steps done so far, batch, KV tokens in the batch)."""

    __slots__ = ("cm", "pool", "gid", "steps", "last_t", "batch", "ctx_base", "heap", "step",
                 "version", "reserved", "cap", "itl_v", "itl_w", "fixed", "d_ctx")

    def __init__(self, cm: CostModel, pool: int, gid: int, fixed: list[float]) -> None:
        self.cm, self.pool, self.gid = cm, pool, gid
        self.steps = 0.0
        self.last_t = 0.0
        self.batch = 0
        self.ctx_base = 0.0
        self.heap: list = []
        self.step = cm.step_time(0, 0)
        self.version = 0
        self.reserved = 0
        self.cap = cm.kv_capacity_tokens
        self.itl_v: list[float] | None = None
        self.itl_w: list[float] | None = None
        # step time minus its KV term, per batch size: the MoE weight term is costly to recompute
        self.fixed = fixed
        self.d_ctx = cm.d_ctx

    def step_time(self) -> float:
        b = self.batch
        if b < 1025:
            return self.fixed[b] + self.d_ctx * (self.ctx_base + b * self.steps)
        return self.cm.step_time(b, self.ctx())

    def advance(self, now: float) -> None:
        if self.batch:
            d = (now - self.last_t) / self.step
            self.steps += d
            if self.itl_v is not None and d > 0:
                self.itl_v.append(self.step)
                self.itl_w.append(d * self.batch)
        self.last_t = now

    def ctx(self) -> float:
        return self.ctx_base + self.batch * self.steps


class _Run:
    """One run's state: per-request lists (plain lists: fastest in CPython), prefill queue, decode pools.
    Built once; the loop and the helper factories copy what they use into locals and closure cells,
    because attribute look-ups inside the loop would cost speed."""

    def __init__(self, inp: SimInput) -> None:
        self.inp = inp
        n = int(len(inp.arrivals))
        rng = np.random.default_rng(inp.seed)
        arrivals = np.asarray(inp.arrivals, dtype=float)
        prompt = inp.prompt.astype(np.int64)
        cached = np.minimum(inp.cached.astype(np.int64), prompt)
        self.output = output = inp.output.astype(np.int64)
        self.kvb = float(inp.kv_bytes_per_token)
        self.wan = wan = inp.wan
        jitter = (rng.lognormal(-0.5 * wan.jitter_sigma**2, wan.jitter_sigma, n) if wan and wan.jitter_sigma > 0
                  else np.ones(n))
        # a large transfer's time varies with the throughput it gets (median = the per-flow rate)
        tput = (np.random.default_rng(inp.seed + 104729).lognormal(0.0, wan.throughput_sigma, n)
                if wan and wan.throughput_sigma > 0 else np.ones(n))

        # --- prefill: FIFO per instance, join the earliest-free instance ---------------------------
        pc = inp.prefill
        noise = (np.random.default_rng(inp.seed + 7919).choice(np.asarray(pc.p_noise), n) if pc.p_noise
                 else np.ones(n))  # own stream: the other draws stay as they were
        self.noise_l = noise.tolist()
        new = (prompt - cached).astype(float)
        self.svc_l = ((pc.p0 + pc.p_tok * new + pc.p_attn * new * (cached + new / 2)) * noise).tolist()
        self.arr_l = arrivals.tolist()  # becomes the actual arrival of a request held back by `after`
        after_l = [-1] * n if inp.after is None else np.asarray(inp.after, dtype=np.int64).tolist()
        self.waiters: dict[int, list[int]] = {}  # request -> the requests that arrive once it ended
        for rid, prev in enumerate(after_l):
            if prev >= 0:
                self.waiters.setdefault(prev, []).append(rid)
        self.on_time = [rid for rid in np.argsort(arrivals, kind="stable").tolist() if after_l[rid] < 0]
        self.prefill_free = [(0.0, i) for i in range(max(1, inp.n_prefill))]
        heapq.heapify(self.prefill_free)
        room = inp.max_context_tokens - prompt
        self.route_mt_l = (room if inp.route_max_tokens is None else np.asarray(inp.route_max_tokens)).tolist()

        # --- per-request state ----------------------------------------------------------------------
        self.prompt_l, self.cached_l, self.out_l = prompt.tolist(), cached.tolist(), output.tolist()
        if not inp.drc:
            self.md_cached_l = np.zeros(n, np.int64).tolist()
        elif inp.md_cached is not None:
            self.md_cached_l = np.minimum(inp.md_cached.astype(np.int64), prompt).tolist()
        else:
            self.md_cached_l = np.floor(cached * inp.drc_alignment).astype(np.int64).tolist()
        self.jit_l, self.tput_l = jitter.tolist(), tput.tolist()
        self.need_l = (prompt + output).tolist()
        self.first = [math.nan] * n
        self.second = [math.nan] * n  # token position 1 (TT2): the decoder's first or second token
        self.finish = [math.nan] * n
        self.ok = [False] * n
        self.pipe = [P_D] * n
        self.rld_tokens = [0.0] * n
        self.req_inst: list = [None] * n  # instance a request is decoding on
        self.req_term = [0.0] * n
        self.req_join = [0.0] * n
        self.req_jid = [0] * n
        self.md_res: list = [None] * n  # MD instance holding a reservation for a P-RLD-MD request
        self.finished = [False] * n
        self.cancelled = [False] * n  # left a relay queue because MD took over

        # --- decode pools ----------------------------------------------------------------------------
        self.insts: list[_Inst] = []
        self.pools: list[list[_Inst]] = [[], []]  # 0 = decode / MD, 1 = relay
        for pool, cm, count in ((0, inp.decode, inp.n_decode), (1, inp.relay, inp.n_relay)):
            fixed = [cm.step_time(b, 0.0) for b in range(1025)] if cm is not None and count else []
            for _ in range(count if cm is not None else 0):
                inst = _Inst(cm, pool, len(self.insts), fixed)
                if inp.record_itl:
                    inst.itl_v, inst.itl_w = [], []
                self.insts.append(inst)
                self.pools[pool].append(inst)
        self.pick = rng.integers(0, 1 << 30, size=(2 * n + 2, 2)).tolist()  # power-of-two choices, seeded
        self.waiting: list[list] = [[], []]  # FIFO of (rid, kind) per pool
        self.wait_head = [0, 0]
        self.cap = [p[0].cap if p else 0 for p in self.pools]
        self.pool_reserved = [0, 0]
        self.pool_cap = [self.cap[k] * len(self.pools[k]) for k in (0, 1)]

        # --- events and links -------------------------------------------------------------------------
        self.events: list = []
        self.seq = itertools.count(1)  # event tie-break: the order events were pushed
        self.wan_flows = [0.0] * (wan.concurrent_transfers if wan else 1)  # when each slot frees
        self.flow_bps = wan.kv_bytes_per_s if wan else 1.0  # KV through one transfer (the codec's wire ratio in)
        self.wire_ratio = wan.codec_wire_ratio if wan else 1.0  # WAN bytes per KV byte
        self.wan_bytes = [0.0]  # one cell, added to by the transfer helpers and the loop
        self.wan_sending: dict[int, tuple[float, float, float]] = {}  # rid -> (data begins, ends, bytes) of its KV
        # PDD's router sees the WAN queue through P's heartbeats
        self.wan_view = (HeartbeatWanView(inp.n_prefill, inp.heartbeat_s, inp.policy) if wan and inp.kind == "pdd"
                         else None)
        self.rdma_bps = inp.rdma_gbps * 1e9 / 8
        self.stall_v: list[float] = []

        # --- simulated prefix caches (when the workload has block chains) -----------------------------
        self.chains = inp.chains
        bt = self.block_tokens = inp.block_tokens
        p_cap = inp.prefill_cache_tokens if inp.prefill_cache_tokens is not None else pc.kv_capacity_tokens
        self.p_caches = [BlockCache(p_cap // bt) for _ in range(max(1, inp.n_prefill))] if self.chains else []
        self.p_free_at = [0.0] * len(self.p_caches)  # per P instance: when its FIFO queue drains
        self.p_queued = [0] * len(self.p_caches)  # requests routed to it and not yet prefilled (its load)
        self.req_p = [0] * n
        drc_caches = bool(self.chains) and inp.drc and inp.kind == "pdd"
        self.md_caches = {i.gid: BlockCache(i.cap // bt) for i in self.pools[0]} if drc_caches else {}
        self.md_pin: list = [None] * n  # the MD instance the router chose (its cache got the hit)
        self.inst_wait: dict[int, list] = {gid: [] for gid in self.md_caches}  # FIFO per pinned MD instance


def _transfer_ops(run: _Run):
    """Arrivals, request ends and the WAN/RDMA transfers, as closures over the run's lists (cell reads are
    as fast as locals). Returns (ended, arrive, wan_transfer, cancel_wan_transfer, rdma_ready)."""
    events, seq, waiters, arr_l, svc_l, prefill_free = (
        run.events, run.seq, run.waiters, run.arr_l, run.svc_l, run.prefill_free)
    wan, jit_l, tput_l, wan_flows, wan_sending, wan_bytes = (
        run.wan, run.jit_l, run.tput_l, run.wan_flows, run.wan_sending, run.wan_bytes)
    wan_view, req_p = run.wan_view, run.req_p
    flow_bps, rdma_bps, rdma_setup_s, wire_ratio = run.flow_bps, run.rdma_bps, run.inp.rdma_setup_s, run.wire_ratio
    prompt_l, cached_l, noise_l, kvb, pc = run.prompt_l, run.cached_l, run.noise_l, run.kvb, run.inp.prefill
    chunk = run.inp.prefill_chunk_tokens
    heappush, heappop = heapq.heappush, heapq.heappop

    def ended(rid: int, now: float) -> None:
        """A request ended (completed or failed): the requests waiting for it arrive now, or at their time."""
        for w in waiters.pop(rid, ()):
            heappush(events, (now if now > arr_l[w] else arr_l[w], next(seq), _ARRIVE, w, 0))

    def arrive(rid: int, now: float) -> None:
        """Join the FIFO prefill queue: the earliest-free prefill instance takes the request."""
        arr_l[rid] = now
        t_free, i = heappop(prefill_free)
        req_p[rid] = i
        end = (now if now > t_free else t_free) + svc_l[rid]
        heappush(prefill_free, (end, i))
        heappush(events, (end, next(seq), _PREFILLED, rid, 0))

    if run.chains:
        arrive = _cached_arrive(run)

    def streamed(rid: int, nbytes: float, ready: float) -> tuple[float, float]:
        """(when the first chunk with bytes to send ends, the bytes of the last chunk) of a prefill that ended at
        ``ready``: P streams each chunk's blocks as it ends, so a transfer may begin before ``ready`` but not end
        before the last chunk's bytes cross after it. The bytes to send are the prompt's last ``nbytes``; a
        chunk's end follows the cost model's prefill time of the tokens up to it (``p0`` is paid once, first)."""
        hit = cached_l[rid]
        new = prompt_l[rid] - hit
        if chunk is None or new <= chunk or kvb <= 0:
            return ready, nbytes
        skip = max(0.0, new - nbytes / kvb)  # leading computed tokens the receiver holds already

        def prefill_s(k: float) -> float:
            return pc.prefill_time(k, hit) * noise_l[rid]
        first_end = min(new, (int(skip) // chunk + 1) * chunk)
        last = new - ((new - 1) // chunk) * chunk
        return ready - prefill_s(new) + prefill_s(first_end), min(nbytes, last * kvb)

    def wan_transfer(rid: int, nbytes: float, ready: float) -> float:
        """The bytes hold a transfer slot of the line from the first streamed chunk on; the per-transfer setup
        (handshake, slow start: round trips, not bandwidth) does not, so other transfers' bytes cross meanwhile.
        As the live emulation's shaper does (transports/shaper.py: the link busy for the bytes, the setup a
        delay). ``ready``: the prefill's end (now: the slot is booked back to the first chunk's end when free)."""
        t_free = heappop(wan_flows)
        first_ready, tail = streamed(rid, nbytes, ready)
        begin = first_ready if first_ready > t_free else t_free
        bps = flow_bps / tput_l[rid]
        data_end = max(begin + nbytes / bps, ready + tail / bps)
        heappush(wan_flows, data_end)
        wan_bytes[0] += nbytes * wire_ratio
        wan_sending[rid] = (begin, data_end, nbytes)
        if wan_view is not None:
            wan_view.started(rid, req_p[rid], nbytes, ready)
        return data_end + wan.setup_s * jit_l[rid]

    def cancel_wan_transfer(rid: int, now: float) -> None:
        """The relay finished the request first: the live system cancels its KV transfer to MD, and the
        bytes not yet sent never cross the WAN (the flow stays booked to its end: a simplification)."""
        sending = wan_sending.pop(rid, None)
        if sending is None:
            return
        data_begin, end, nbytes = sending
        unsent = 0.0 if now >= end else (
            nbytes * (end - max(now, data_begin)) / (end - data_begin) if end > data_begin else nbytes)
        wan_bytes[0] -= unsent * wire_ratio
        if wan_view is not None:
            wan_view.finished(rid, now, nbytes - unsent)

    def rdma_ready(rid: int, nbytes: float, ready: float) -> float:
        """When KV streamed over the in-site link (rdma) has landed, for a prefill that ended at ``ready``."""
        first_ready, tail = streamed(rid, nbytes, ready)
        return rdma_setup_s + max(first_ready + nbytes / rdma_bps, ready + tail / rdma_bps)

    return ended, arrive, wan_transfer, cancel_wan_transfer, rdma_ready


def _cached_arrive(run: _Run):
    """Arrival with simulated P caches: the router's own cost (`instance_cost`: tokens still to prefill plus
    load) picks the P instance; the prefill then costs what that instance's cache leaves, and the prompt's
    blocks are in its cache for the requests queued behind it (FIFO per instance)."""
    events, seq, arr_l, chains, prompt_l, cached_l, noise_l = (
        run.events, run.seq, run.arr_l, run.chains, run.prompt_l, run.cached_l, run.noise_l)
    p_caches, p_free_at, p_queued, req_p, bt, norm = (
        run.p_caches, run.p_free_at, run.p_queued, run.req_p, run.block_tokens, float(run.inp.load_norm_seqs))
    pc = run.inp.prefill
    heappush = heapq.heappush

    def arrive(rid: int, now: float) -> None:
        arr_l[rid] = now
        chain, n = chains[rid], prompt_l[rid]
        best_cost, i, hit = math.inf, 0, 0
        for k, cache in enumerate(p_caches):
            held = min(cache.match(chain) * bt, n - 1)
            cost = instance_cost(held, n, min(1.0, p_queued[k] / norm))
            if cost < best_cost:
                best_cost, i, hit = cost, k, held
        p_caches[i].insert(chain)
        cached_l[rid], req_p[rid] = hit, i
        p_queued[i] += 1
        new = n - hit
        end = max(now, p_free_at[i]) + (pc.p0 + pc.p_tok * new + pc.p_attn * new * (hit + new / 2)) * noise_l[rid]
        p_free_at[i] = end
        heappush(events, (end, next(seq), _PREFILLED, rid, 0))

    return arrive


def _decode_ops(run: _Run, ended, cancel_wan_transfer):
    """Decode-side helpers as closures over the run's lists: reservations (power of two choices, FIFO
    when full), batch joins, stops and finishes. Returns (set_reserved, schedule, join, remove,
    release_check, admit, complete)."""
    events, seq, pools, pick, waiting, wait_head, cap, pool_reserved = (
        run.events, run.seq, run.pools, run.pick, run.waiting, run.wait_head, run.cap, run.pool_reserved)
    need_l, prompt_l, out_l, first, second, finish, ok, pipe, rld_tokens = (
        run.need_l, run.prompt_l, run.out_l, run.first, run.second, run.finish, run.ok, run.pipe, run.rld_tokens)
    req_inst, req_term, req_join, req_jid, md_res, finished, cancelled = (
        run.req_inst, run.req_term, run.req_join, run.req_jid, run.md_res, run.finished, run.cancelled)
    wan = run.wan
    md_caches, md_pin, inst_wait, chains, bt = run.md_caches, run.md_pin, run.inst_wait, run.chains, run.block_tokens
    release_pinned = None  # set below, once `start` exists (see _md_cache_ops)
    heappush, heappop = heapq.heappush, heapq.heappop
    pick_i = [0]

    def best(pool: int, tokens: int):
        """Least-reserved of two random instances (power of two choices); scan all if neither fits."""
        p = pools[pool]
        k = pick_i[0]
        pick_i[0] = k + 1 if k + 1 < len(pick) else 0
        a, b = p[pick[k][0] % len(p)], p[pick[k][1] % len(p)]
        inst = a if a.reserved <= b.reserved else b
        if inst.reserved + tokens <= inst.cap:
            return inst
        inst = min(p, key=lambda i: i.reserved)
        return inst if inst.reserved + tokens <= inst.cap else None

    def set_reserved(inst: _Inst, delta: int) -> None:
        inst.reserved += delta
        pool_reserved[inst.pool] += delta
        cache = md_caches.get(inst.gid) if inst.pool == 0 else None
        if cache is not None:  # MD's cache lives in MD's memory: what requests reserve is not cache
            cache.shrink((inst.cap - inst.reserved) // bt)

    def schedule(inst: _Inst, now: float) -> None:
        h = inst.heap
        while h and h[0][2] != req_jid[h[0][1]]:
            heappop(h)
        inst.version += 1
        inst.step = inst.step_time()
        if inst.batch and h:
            left = h[0][0] - inst.steps
            t = now + left * inst.step if left > 0.0 else now
            heappush(events, (t, next(seq), _FINISH, inst.gid, inst.version))

    def join(inst: _Inst, rid: int, now: float, ctx: int, tokens: int) -> None:
        inst.advance(now)
        inst.batch += 1
        term = ctx - inst.steps
        inst.ctx_base += term
        req_jid[rid] += 1
        req_term[rid] = term
        req_join[rid] = inst.steps
        req_inst[rid] = inst
        heappush(inst.heap, (inst.steps + tokens, rid, req_jid[rid]))
        schedule(inst, now)
        if second[rid] != second[rid]:  # NaN: the request's first decoder
            if first[rid] != first[rid]:  # NaN: this decoder emits the first token as well
                first[rid] = now + inst.step
                second[rid] = now + 2 * inst.step
            else:
                second[rid] = now + inst.step

    def remove(inst: _Inst, rid: int, now: float) -> float:
        """Stop a sequence mid-way (relay handing over); returns tokens it produced."""
        inst.advance(now)
        inst.batch -= 1
        inst.ctx_base -= req_term[rid]
        req_jid[rid] += 1
        req_inst[rid] = None
        produced = inst.steps - req_join[rid]
        schedule(inst, now)
        return produced

    def start(rid: int, kind: int, inst: _Inst, now: float) -> None:
        """Continue a request once its decode reservation is granted."""
        if kind == _KV_READY:
            join(inst, rid, now, prompt_l[rid], out_l[rid])
        else:  # MD ready for a P-RLD-MD request: tell the relay, hand over
            if finished[rid]:
                set_reserved(inst, -need_l[rid])
                release_check(inst.pool, now)
                return
            md_res[rid] = inst
            heappush(events, (now + (wan.latency_s if wan else 0.0), next(seq), _HANDOFF, rid, 0))

    def release_check(pool: int, now: float) -> None:
        if pool == 0 and inst_wait:
            for inst in pools[0]:
                release_pinned(inst, now)
        q = waiting[pool]
        while wait_head[pool] < len(q):
            rid, kind = q[wait_head[pool]]
            if cancelled[rid]:
                wait_head[pool] += 1
                continue
            inst = best(pool, need_l[rid])
            if inst is None:
                return
            wait_head[pool] += 1
            set_reserved(inst, need_l[rid])
            start(rid, kind, inst, now)

    def admit(rid: int, pool: int, kind: int, now: float) -> None:
        """Reserve a lightly loaded instance that fits, else queue FIFO; a request that can never fit fails.
        A request the router placed on one main decoder (its cache) waits for that one."""
        if not pools[pool] or need_l[rid] > cap[pool]:
            finished[rid] = True  # cannot ever fit: counted failed
            ended(rid, now)
            return
        pin = md_pin[rid] if pool == 0 else None
        if pin is not None:
            if inst_wait[pin.gid] or pin.reserved + need_l[rid] > pin.cap:
                inst_wait[pin.gid].append((rid, kind))
            else:
                set_reserved(pin, need_l[rid])
                start(rid, kind, pin, now)
            return
        inst = best(pool, need_l[rid]) if wait_head[pool] == len(waiting[pool]) else None
        if inst is None:
            waiting[pool].append((rid, kind))
        else:
            set_reserved(inst, need_l[rid])
            start(rid, kind, inst, now)

    def complete(inst: _Inst, rid: int, now: float) -> None:
        inst.batch -= 1
        inst.ctx_base -= req_term[rid]
        req_inst[rid] = None
        produced = inst.steps - req_join[rid]
        if inst.pool == 1:
            rld_tokens[rid] += produced
            if pipe[rid] == P_RLD_MD:
                cancel_wan_transfer(rid, now)
        finished[rid] = True
        ok[rid] = True
        finish[rid] = now
        set_reserved(inst, -need_l[rid])
        cache = md_caches.get(inst.gid) if inst.pool == 0 else None
        if cache is not None:  # the finished request's blocks stay cached (evictable)
            cache.insert(chains[rid])
        ended(rid, now)

    release_pinned, pick_md = _md_cache_ops(run, set_reserved, start)
    return set_reserved, schedule, join, remove, release_check, admit, complete, pick_md


def _md_cache_ops(run: _Run, set_reserved, start):
    """Main decoders with simulated caches: the router's choice of one (its cache got the hit), and the FIFO of
    requests waiting for that very instance. Returns (release_pinned, pick_md)."""
    pools, inst_wait, need_l, cancelled = run.pools, run.inst_wait, run.need_l, run.cancelled
    md_caches, chains, bt = run.md_caches, run.chains, run.block_tokens

    def release_pinned(inst: _Inst, now: float) -> None:
        """Start the requests waiting for this very instance (its cache got their hit) while they fit."""
        q = inst_wait[inst.gid]
        while q:
            rid, kind = q[0]
            if cancelled[rid]:
                q.pop(0)
                continue
            if inst.reserved + need_l[rid] > inst.cap:
                return
            q.pop(0)
            set_reserved(inst, need_l[rid])
            start(rid, kind, inst, now)

    def pick_md(rid: int, n_prompt: int) -> tuple[_Inst, int]:
        """The main decoder the router would choose: `instance_cost` over each one's cached prefix and load."""
        chain, best_inst, best_cost, hit = chains[rid], None, math.inf, 0
        for inst in pools[0]:
            held = min(md_caches[inst.gid].match(chain) * bt, n_prompt - 1)
            cost = instance_cost(held, n_prompt, min(1.0, inst.reserved / inst.cap) if inst.cap else 1.0)
            if cost < best_cost:
                best_inst, best_cost, hit = inst, cost, held
        return best_inst, hit

    return release_pinned, pick_md


def _catch_up_time(md: _Inst, rld: _Inst, pending: int, lat: float, final_gap: float) -> float:
    """Catch-up handoff: MD extends batches while the relay keeps going, until the gap is small."""
    gap, spent, r = float(pending), 0.0, rld.step
    for _ in range(64):
        dt = lat + md.cm.extend_time(int(gap), md.batch, md.ctx())
        spent += dt
        gap = dt / r
        if gap <= final_gap:
            break
    return spent


def _loop(run: _Run) -> tuple[int, float]:
    """The event loop: everything it touches per event is a local or a closure cell (the speed is in
    that). Returns (events handled, WAN bytes the requests would move without any decode-side cache)."""
    inp, pol, kvb, wan = run.inp, run.inp.policy, run.kvb, run.wan
    ended, arrive, wan_transfer, _, rdma_ready = xfer = _transfer_ops(run)
    set_reserved, schedule, join, remove, release_check, admit, complete, pick_md = _decode_ops(run, ended, xfer[3])
    events, seq, arr_l, on_time, insts, wan_bytes, stall_v = (
        run.events, run.seq, run.arr_l, run.on_time, run.insts, run.wan_bytes, run.stall_v)
    prompt_l, cached_l, md_cached_l, out_l, need_l, first, finish, ok, pipe = (
        run.prompt_l, run.cached_l, run.md_cached_l, run.out_l, run.need_l, run.first, run.finish, run.ok, run.pipe)
    req_inst, req_join, req_jid, md_res, finished, cancelled, rld_tokens = (
        run.req_inst, run.req_join, run.req_jid, run.md_res, run.finished, run.cancelled, run.rld_tokens)
    wan_view = run.wan_view
    pool_reserved, pool_cap, route_mt_l, md_pin, md_caches = (
        run.pool_reserved, run.pool_cap, run.route_mt_l, run.md_pin, run.md_caches)
    p_queued, req_p = run.p_queued, run.req_p
    route_bytes = [0.0] * len(prompt_l)  # WAN bytes the route decided on, sent once the prefill ends
    heappush, heappop = heapq.heappush, heapq.heappop
    n_events = 0
    wan_naive = 0.0
    rld_available = inp.n_relay > 0 and inp.relay is not None
    route_bps = inp.route_bandwidth_bps or run.flow_bps
    kind_sys = inp.kind
    ftfp = inp.first_token_from_prefill
    i_on_time, n_on_time = 0, len(on_time)
    inf = math.inf
    while True:
        t_next_a = arr_l[on_time[i_on_time]] if i_on_time < n_on_time else inf
        if events and events[0][0] < t_next_a:
            now, _, kind, a, b = heappop(events)
        elif i_on_time < n_on_time:
            now, kind, a, b = t_next_a, _ARRIVE, on_time[i_on_time], 0
            i_on_time += 1
        else:
            break
        n_events += 1

        if kind == _ARRIVE:
            arrive(a, now)
            if kind_sys == "pdd":  # the router decides on arrival, as the live one does, from what it sees now
                load = pool_reserved[1] / pool_cap[1] if rld_available and pool_cap[1] else 0.0
                if md_caches:
                    md_pin[a], md_cached_l[a] = pick_md(a, prompt_l[a])
                dec = choose_pipeline(RouteInputs(
                    prompt_tokens=prompt_l[a], max_tokens=route_mt_l[a], p_cached_tokens=cached_l[a],
                    md_cached_tokens=md_cached_l[a], kv_bytes_per_token=int(kvb),
                    wan_bandwidth_bps=route_bps, rld_available=rld_available, rld_load=load,
                    wan_queue_s=wan_view.queue_s(now) if wan_view is not None else 0.0,
                ), pol)
                pipe[a], route_bytes[a] = _CODE[dec.pipeline], dec.wan_bytes
        elif kind == _PREFILLED:  # send the KV where the route says
            rid = a
            if p_queued:
                p_queued[req_p[rid]] -= 1
            if ftfp:
                first[rid] = now
            full = prompt_l[rid] * kvb
            if kind_sys == "local":
                heappush(events, (rdma_ready(rid, full, now), next(seq), _KV_READY, rid, 0))
                continue
            wan_naive += full
            if kind_sys == "naive":
                heappush(events, (wan_transfer(rid, full, now), next(seq), _KV_READY, rid, 0))
                continue
            code = pipe[rid]
            if code == P_MD:
                heappush(events, (wan_transfer(rid, route_bytes[rid], now), next(seq), _KV_READY, rid, 0))
            elif code == P_RLD:
                heappush(events, (rdma_ready(rid, full, now), next(seq), _KV_READY, rid, 1))
            else:
                heappush(events, (rdma_ready(rid, full, now), next(seq), _KV_READY, rid, 1))
                heappush(events, (wan_transfer(rid, route_bytes[rid], now), next(seq), _MD_READY, rid, 0))
        elif kind == _KV_READY:
            if b == 0 and wan_view is not None:  # MD's KV over the WAN landed: P's transfer ends
                wan_view.finished(a, now)
            admit(a, b, _KV_READY, now)
        elif kind == _FINISH:
            inst = insts[a]
            if b != inst.version:
                continue
            inst.advance(now)
            h = inst.heap
            lim = inst.steps + 1e-6
            while h and h[0][0] <= lim:
                fin, rid, jid = heappop(h)
                if jid == req_jid[rid]:
                    complete(inst, rid, now)
            schedule(inst, now)
            release_check(inst.pool, now)
        elif kind == _MD_READY:
            if wan_view is not None:
                wan_view.finished(a, now)
            if not finished[a]:
                admit(a, 0, _MD_READY, now)
        elif kind == _HANDOFF:
            rid = a
            md = md_res[rid]
            rld = req_inst[rid]
            if finished[rid]:
                set_reserved(md, -need_l[rid])
                release_check(0, now)
                continue
            if rld is None:  # relay never got to it (queued): MD simply takes the request
                cancelled[rid] = True
                join(md, rid, now, prompt_l[rid], out_l[rid])
                continue
            rld.advance(now)
            pending = int(rld.steps - req_join[rid])
            load = pool_reserved[1] / pool_cap[1] if pool_cap[1] else 0.0
            mode = choose_handoff_mode(pending, load, pol)
            if mode == HandoffMode.ONE_SHOT:
                stop_at = now
            else:
                stop_at = now + _catch_up_time(md, rld, pending, wan.latency_s if wan else 0.0, pol.handoff_final_gap)
            heappush(events, (stop_at, next(seq), _RLD_STOP, rid, 0 if mode == HandoffMode.ONE_SHOT else 1))
        elif kind == _RLD_STOP:
            rid = a
            rld = req_inst[rid]
            md = md_res[rid]
            if finished[rid] or rld is None or rld.pool != 1:  # relay finished it first
                set_reserved(md, -need_l[rid])
                release_check(0, now)
                continue
            produced = remove(rld, rid, now)
            rld_tokens[rid] += produced
            set_reserved(rld, -need_l[rid])
            release_check(1, now)
            lat = wan.latency_s if wan else 0.0
            # one-shot: MD extends everything now; catch-up: only the final small gap is left
            gap = produced if b == 0 else min(produced, pol.handoff_final_gap)
            t_join = now + lat + md.cm.extend_time(int(gap), md.batch, md.ctx())
            wan_bytes[0] += produced * TOKEN_ID_BYTES
            heappush(events, (t_join, next(seq), _MD_JOIN, rid, now))
        elif kind == _MD_JOIN:
            rid = a
            md = md_res[rid]
            done_tokens = int(rld_tokens[rid])
            left = out_l[rid] - done_tokens
            if left <= 0:
                finished[rid] = True
                ok[rid] = True
                finish[rid] = now
                set_reserved(md, -need_l[rid])
                release_check(0, now)
                ended(rid, now)
            else:
                join(md, rid, now, prompt_l[rid] + done_tokens, left)
                stall_v.append(now - b + md.step)  # relay's last token -> MD's first token
    return n_events, wan_naive


def _result(run: _Run, n_events: int, wan_naive: float) -> SimResult:
    """Per-request arrays and totals; a request still waiting at the end could never be admitted (failed)."""
    output = run.output
    first_a = np.array(run.first)
    finish_a = np.array(run.finish)
    ok_a = np.array(run.ok)
    arr = np.array(run.arr_l)
    ttft = np.where(ok_a, first_a - arr, np.nan)
    tt2 = np.where(ok_a & (output > 1), np.array(run.second) - arr, np.nan)
    e2e = np.where(ok_a, finish_a - arr, np.nan)
    tpot = np.where(ok_a & (output > 1), (finish_a - first_a) / np.maximum(output - 1, 1), 0.0)
    tpot = np.where(ok_a, tpot, np.nan)
    rld_arr = np.array(run.rld_tokens)
    tokens_relay = float(rld_arr[ok_a].sum())
    tokens_main = float(output[ok_a].sum()) - tokens_relay
    makespan = float(np.nanmax(finish_a) - arr.min()) if ok_a.any() else 0.0
    if run.inp.record_itl:
        iv = [v for i in run.insts for v in i.itl_v]
        iw = [w for i in run.insts for w in i.itl_w]
    else:
        iv, iw = [], []
    wan_bytes = run.wan_bytes[0]
    bw = wan_bytes * 8 / 1e9 / makespan if makespan > 0 else 0.0
    stall_v = run.stall_v
    return SimResult(
        arrival=arr, ttft=ttft, tt2=tt2, tpot=tpot, e2e=e2e, ok=ok_a, pipeline=np.array(run.pipe), output=output,
        prompt=np.array(run.prompt_l), p_cached=np.array(run.cached_l), md_cached=np.array(run.md_cached_l),
        p_evictions=sum(c.evicted for c in run.p_caches), md_evictions=sum(c.evicted for c in run.md_caches.values()),
        wan_bytes=wan_bytes, wan_bytes_naive=wan_naive, wan_bandwidth_gbps=bw, makespan=makespan,
        tokens_relay=tokens_relay, tokens_main=tokens_main,
        itl_values=np.array(iv + stall_v), itl_weights=np.array(iw + [1.0] * len(stall_v)), events=n_events,
    )


def simulate(inp: SimInput) -> SimResult:
    """Run one scenario to completion; every request ends completed or counted failed."""
    run = _Run(inp)
    n_events, wan_naive = _loop(run)
    return _result(run, n_events, wan_naive)
