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

Why one module: it is one job, the event loop, written as one function whose closures share the
per-request lists (plain locals are what keep 1M requests under a minute); its inputs and results
(`SimInput`, `SimResult`) and the decoder model (`_Inst`) are what that function reads and writes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from pdd.shared.cost_model import CostModel
from pdd.shared.pipelines import HandoffMode, Pipeline
from pdd.shared.policy import PolicyConfig, RouteInputs, choose_handoff_mode, choose_pipeline

from pdd.scenarios import WanLink

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


@dataclass
class SimResult:
    arrival: np.ndarray  # when each request arrived (later than SimInput.arrivals where `after` held it back)
    ttft: np.ndarray  # NaN where failed
    tpot: np.ndarray
    e2e: np.ndarray
    ok: np.ndarray
    pipeline: np.ndarray
    output: np.ndarray
    wan_bytes: float
    wan_bytes_naive: float  # what the same requests would move without any decode-side cache
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


def simulate(inp: SimInput) -> SimResult:
    """Run one scenario to completion; every request ends completed or counted failed."""
    n = int(len(inp.arrivals))
    rng = np.random.default_rng(inp.seed)
    arrivals = np.asarray(inp.arrivals, dtype=float)
    prompt = inp.prompt.astype(np.int64)
    cached = np.minimum(inp.cached.astype(np.int64), prompt)
    output = inp.output.astype(np.int64)
    kvb = float(inp.kv_bytes_per_token)
    wan = inp.wan
    jitter = (rng.lognormal(-0.5 * wan.jitter_sigma**2, wan.jitter_sigma, n) if wan and wan.jitter_sigma > 0
              else np.ones(n))
    # a large transfer's time varies with the throughput it gets (median = the per-flow rate)
    tput = (np.random.default_rng(inp.seed + 104729).lognormal(0.0, wan.throughput_sigma, n)
            if wan and wan.throughput_sigma > 0 else np.ones(n))
    pol = inp.policy

    # --- prefill: FIFO per instance, join the earliest-free instance ---------------------------
    pc = inp.prefill
    new = (prompt - cached).astype(float)
    service = pc.p0 + pc.p_tok * new + pc.p_attn * new * (cached + new / 2)
    if pc.p_noise:  # own stream: the other draws stay as they were
        service = service * np.random.default_rng(inp.seed + 7919).choice(np.asarray(pc.p_noise), n)
    svc_l = service.tolist()
    arr_l = arrivals.tolist()  # becomes the actual arrival of a request held back by `after`
    after_l = [-1] * n if inp.after is None else np.asarray(inp.after, dtype=np.int64).tolist()
    waiters: dict[int, list[int]] = {}  # request -> the requests that arrive once it ended
    for rid, prev in enumerate(after_l):
        if prev >= 0:
            waiters.setdefault(prev, []).append(rid)
    on_time = [rid for rid in np.argsort(arrivals, kind="stable").tolist() if after_l[rid] < 0]
    prefill_free = [(0.0, i) for i in range(max(1, inp.n_prefill))]
    heapq.heapify(prefill_free)

    # --- per-request state (plain lists: fastest in CPython) ----------------------------------
    prompt_l, cached_l, out_l = prompt.tolist(), cached.tolist(), output.tolist()
    if not inp.drc:
        md_cached_l = np.zeros(n, np.int64).tolist()
    elif inp.md_cached is not None:
        md_cached_l = np.minimum(inp.md_cached.astype(np.int64), prompt).tolist()
    else:
        md_cached_l = np.floor(cached * inp.drc_alignment).astype(np.int64).tolist()
    jit_l, tput_l = jitter.tolist(), tput.tolist()
    first = [math.nan] * n
    finish = [math.nan] * n
    ok = [False] * n
    pipe = [P_D] * n
    rld_tokens = [0.0] * n
    req_inst: list = [None] * n  # instance a request is decoding on
    req_term = [0.0] * n
    req_join = [0.0] * n
    req_jid = [0] * n
    md_res: list = [None] * n  # MD instance holding a reservation for a P-RLD-MD request
    finished = [False] * n
    cancelled = [False] * n  # left a relay queue because MD took over

    # --- decode pools ----------------------------------------------------------------------------
    insts: list[_Inst] = []
    pools: list[list[_Inst]] = [[], []]  # 0 = decode / MD, 1 = relay
    for pool, cm, count in ((0, inp.decode, inp.n_decode), (1, inp.relay, inp.n_relay)):
        fixed = [cm.step_time(b, 0.0) for b in range(1025)] if cm is not None and count else []
        for _ in range(count if cm is not None else 0):
            inst = _Inst(cm, pool, len(insts), fixed)
            if inp.record_itl:
                inst.itl_v, inst.itl_w = [], []
            insts.append(inst)
            pools[pool].append(inst)
    pick = rng.integers(0, 1 << 30, size=(2 * n + 2, 2)).tolist()  # power-of-two choices, seeded
    pick_i = [0]
    waiting: list[list] = [[], []]  # FIFO of (rid, kind) per pool
    wait_head = [0, 0]
    cap = [p[0].cap if p else 0 for p in pools]
    pool_reserved = [0, 0]
    pool_cap = [cap[k] * len(pools[k]) for k in (0, 1)]

    events: list = []
    seq = 0
    n_events = 0
    wan_flows = [0.0] * (wan.flows if wan else 1)
    flow_bps = wan.flow_bytes_per_s if wan else 1.0
    wan_bytes = 0.0
    wan_sending: dict[int, tuple[float, float, float]] = {}  # rid -> (data begins, ends, bytes) of its KV transfer
    wan_naive = 0.0
    rdma_bps = inp.rdma_gbps * 1e9 / 8
    stall_v: list[float] = []
    heappush, heappop = heapq.heappush, heapq.heappop

    need_l = (prompt + output).tolist()

    def need(rid: int) -> int:
        return need_l[rid]

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

    def reserve(rid: int, pool: int):
        """A lightly loaded instance that fits, or None (the request queues FIFO)."""
        if wait_head[pool] != len(waiting[pool]):
            return None
        inst = best(pool, need_l[rid])
        if inst is not None:
            set_reserved(inst, need_l[rid])
        return inst

    def schedule(inst: _Inst, now: float) -> None:
        nonlocal seq
        h = inst.heap
        while h and h[0][2] != req_jid[h[0][1]]:
            heappop(h)
        inst.version += 1
        inst.step = inst.step_time()
        if inst.batch and h:
            left = h[0][0] - inst.steps
            t = now + left * inst.step if left > 0.0 else now
            seq += 1
            heappush(events, (t, seq, _FINISH, inst.gid, inst.version))

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
        if first[rid] != first[rid]:  # NaN: this decoder emits the first token
            first[rid] = now + inst.step

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
        nonlocal seq
        if kind == _KV_READY:
            join(inst, rid, now, prompt_l[rid], out_l[rid])
        else:  # MD ready for a P-RLD-MD request: tell the relay, hand over
            if finished[rid]:
                set_reserved(inst, -need(rid))
                release_check(inst.pool, now)
                return
            md_res[rid] = inst
            seq += 1
            heappush(events, (now + (wan.latency_s if wan else 0.0), seq, _HANDOFF, rid, 0))

    def release_check(pool: int, now: float) -> None:
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
            set_reserved(inst, need(rid))
            start(rid, kind, inst, now)

    def admit(rid: int, pool: int, kind: int, now: float) -> None:
        if not pools[pool] or need(rid) > cap[pool]:
            finished[rid] = True  # cannot ever fit: counted failed
            ended(rid, now)
            return
        inst = reserve(rid, pool)
        if inst is None:
            waiting[pool].append((rid, kind))
        else:
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
        set_reserved(inst, -need(rid))
        ended(rid, now)

    def ended(rid: int, now: float) -> None:
        """A request ended (completed or failed): the requests waiting for it arrive now, or at their time."""
        nonlocal seq
        for w in waiters.pop(rid, ()):
            seq += 1
            heappush(events, (now if now > arr_l[w] else arr_l[w], seq, _ARRIVE, w, 0))

    def arrive(rid: int, now: float) -> None:
        """Join the FIFO prefill queue: the earliest-free prefill instance takes the request."""
        nonlocal seq
        arr_l[rid] = now
        t_free, i = heappop(prefill_free)
        end = (now if now > t_free else t_free) + svc_l[rid]
        heappush(prefill_free, (end, i))
        seq += 1
        heappush(events, (end, seq, _PREFILLED, rid, 0))

    def wan_transfer(rid: int, nbytes: float, ready: float) -> float:
        nonlocal wan_bytes
        t_free = heappop(wan_flows)
        begin = ready if ready > t_free else t_free
        data_begin = begin + wan.setup_s * jit_l[rid]
        end = data_begin + nbytes / flow_bps * tput_l[rid]
        heappush(wan_flows, end)
        wan_bytes += nbytes
        wan_sending[rid] = (data_begin, end, nbytes)
        return end

    def cancel_wan_transfer(rid: int, now: float) -> None:
        """The relay finished the request first: the live system cancels its KV transfer to MD, and the
        bytes not yet sent never cross the WAN (the flow stays booked to its end: a simplification)."""
        nonlocal wan_bytes
        sending = wan_sending.pop(rid, None)
        if sending is None or now >= sending[1]:
            return
        data_begin, end, nbytes = sending
        wan_bytes -= nbytes * (end - max(now, data_begin)) / (end - data_begin) if end > data_begin else nbytes

    def rdma_time(nbytes: float) -> float:
        return inp.rdma_setup_s + nbytes / rdma_bps

    rld_available = inp.n_relay > 0 and inp.relay is not None
    route_bps = inp.route_bandwidth_bps or flow_bps
    kind_sys = inp.kind
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
        elif kind == _PREFILLED:  # route the request
            rid = a
            if inp.first_token_from_prefill:
                first[rid] = now
            full = prompt_l[rid] * kvb
            if kind_sys == "local":
                seq += 1
                heappush(events, (now + rdma_time(full), seq, _KV_READY, rid, 0))
                continue
            wan_naive += full
            if kind_sys == "naive":
                seq += 1
                heappush(events, (wan_transfer(rid, full, now), seq, _KV_READY, rid, 0))
                continue
            load = pool_reserved[1] / pool_cap[1] if rld_available and pool_cap[1] else 0.0
            dec = choose_pipeline(RouteInputs(
                prompt_tokens=prompt_l[rid], max_tokens=out_l[rid], p_cached_tokens=cached_l[rid],
                md_cached_tokens=md_cached_l[rid], kv_bytes_per_token=int(kvb),
                wan_bandwidth_bps=route_bps, rld_available=rld_available, rld_load=load,
            ), pol)
            code = _CODE[dec.pipeline]
            pipe[rid] = code
            seq += 1
            if code == P_MD:
                heappush(events, (wan_transfer(rid, dec.wan_bytes, now), seq, _KV_READY, rid, 0))
            elif code == P_RLD:
                heappush(events, (now + rdma_time(full), seq, _KV_READY, rid, 1))
            else:
                heappush(events, (now + rdma_time(full), seq, _KV_READY, rid, 1))
                seq += 1
                heappush(events, (wan_transfer(rid, dec.wan_bytes, now), seq, _MD_READY, rid, 0))
        elif kind == _KV_READY:
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
            if not finished[a]:
                admit(a, 0, _MD_READY, now)
        elif kind == _HANDOFF:
            rid = a
            md = md_res[rid]
            rld = req_inst[rid]
            if finished[rid]:
                set_reserved(md, -need(rid))
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
            lat = wan.latency_s if wan else 0.0
            if mode == HandoffMode.ONE_SHOT:
                stop_at = now
            else:  # catch-up: MD extends batches while the relay keeps going
                gap, spent, r = float(pending), 0.0, rld.step
                for _ in range(64):
                    dt = lat + md.cm.extend_time(int(gap), md.batch, md.ctx())
                    spent += dt
                    gap = dt / r
                    if gap <= pol.handoff_final_gap:
                        break
                stop_at = now + spent
            seq += 1
            heappush(events, (stop_at, seq, _RLD_STOP, rid, 0 if mode == HandoffMode.ONE_SHOT else 1))
        elif kind == _RLD_STOP:
            rid = a
            rld = req_inst[rid]
            md = md_res[rid]
            if finished[rid] or rld is None or rld.pool != 1:  # relay finished it first
                set_reserved(md, -need(rid))
                release_check(0, now)
                continue
            produced = remove(rld, rid, now)
            rld_tokens[rid] += produced
            set_reserved(rld, -need(rid))
            release_check(1, now)
            lat = wan.latency_s if wan else 0.0
            # one-shot: MD extends everything now; catch-up: only the final small gap is left
            gap = produced if b == 0 else min(produced, pol.handoff_final_gap)
            t_join = now + lat + md.cm.extend_time(int(gap), md.batch, md.ctx())
            wan_bytes += produced * TOKEN_ID_BYTES
            seq += 1
            heappush(events, (t_join, seq, _MD_JOIN, rid, now))
        elif kind == _MD_JOIN:
            rid = a
            md = md_res[rid]
            done_tokens = int(rld_tokens[rid])
            left = out_l[rid] - done_tokens
            if left <= 0:
                finished[rid] = True
                ok[rid] = True
                finish[rid] = now
                set_reserved(md, -need(rid))
                release_check(0, now)
                ended(rid, now)
            else:
                join(md, rid, now, prompt_l[rid] + done_tokens, left)
                stall_v.append(now - b + md.step)  # relay's last token -> MD's first token
    # anything still waiting can never be admitted (capacity); count it failed
    first_a = np.array(first)
    finish_a = np.array(finish)
    ok_a = np.array(ok)
    arr = np.array(arr_l)
    ttft = np.where(ok_a, first_a - arr, np.nan)
    e2e = np.where(ok_a, finish_a - arr, np.nan)
    tpot = np.where(ok_a & (output > 1), (finish_a - first_a) / np.maximum(output - 1, 1), 0.0)
    tpot = np.where(ok_a, tpot, np.nan)
    rld_arr = np.array(rld_tokens)
    tokens_relay = float(rld_arr[ok_a].sum())
    tokens_main = float(output[ok_a].sum()) - tokens_relay
    makespan = float(np.nanmax(finish_a) - arr.min()) if ok_a.any() else 0.0
    if inp.record_itl:
        iv = [v for i in insts for v in i.itl_v]
        iw = [w for i in insts for w in i.itl_w]
    else:
        iv, iw = [], []
    bw = wan_bytes * 8 / 1e9 / makespan if makespan > 0 else 0.0
    return SimResult(
        arrival=arr, ttft=ttft, tpot=tpot, e2e=e2e, ok=ok_a, pipeline=np.array(pipe), output=output,
        wan_bytes=wan_bytes, wan_bytes_naive=wan_naive, wan_bandwidth_gbps=bw, makespan=makespan,
        tokens_relay=tokens_relay, tokens_main=tokens_main,
        itl_values=np.array(iv + stall_v), itl_weights=np.array(iw + [1.0] * len(stall_v)), events=n_events,
    )
