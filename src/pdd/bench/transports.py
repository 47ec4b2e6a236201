"""KV transport benchmark: 256 MiB of KV-block-shaped frames per run, against a raw TCP socket.

    python -m pdd.bench.transports        (no arguments; a few minutes; root adds the emulated WAN run)

Loopback: raw socket (sendall / recv_into straight into the destination pool), zmq with 1 and 4
streams, ucx, inproc — sender and receiver in one process, each transport with its own threads.
WAN (root only): `pdd wan` namespaces at 1 Gbit/s, 40 ms RTT; zmq receiver in site B, sender in
site A, separate processes. Striping: a 64K-token transfer on the report scenario's link (its per-flow rate and
line, and the bytes, / STRIPE_SCALE) through the in-process shaper, over 1-16 streams, against min(streams x
per-flow, line). Best of RUNS per row. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wan-role", nargs=3, metavar=("ROLE", "STREAMS", "ARG"), default=None,
                    help=argparse.SUPPRESS)  # internal: one side of the emulated-WAN run
    return ap.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported: --help stays fast

import torch

from pdd.shared.kv_layout import KVLayout
from pdd.transports import create_transport
from pdd.transports.base import DEFAULT_MAX_FRAME_BYTES

LAYOUT = KVLayout(num_layers=8, block_size=16, kv_heads=8, head_dim=128, dtype="float16")  # 32 KiB/block/tensor
BLOCKS = 512  # 512 blocks x 8 layers x K,V x 32 KiB = 256 MiB
TOTAL = 2 * LAYOUT.num_layers * BLOCKS * LAYOUT.bytes_per_block_per_tensor
FRAME = DEFAULT_MAX_FRAME_BYTES  # the transports' default frame size; the raw socket uses the same
RUNS = 3
WAN_RATE, WAN_DELAY = "1gbit", "20ms"


def pool(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, *LAYOUT.block_shape)
    make = lambda: torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16).view(torch.float16)  # noqa: E731
    return [make() for _ in range(LAYOUT.num_layers)], [make() for _ in range(LAYOUT.num_layers)]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def frames_of(p: tuple[list[torch.Tensor], list[torch.Tensor]]) -> list[memoryview]:
    per = FRAME // LAYOUT.bytes_per_block_per_tensor
    return [memoryview(t[i:i + per].reshape(-1).view(torch.uint8).numpy())
            for t in p[0] + p[1] for i in range(0, BLOCKS, per)]


def raw_socket_once(src, dst) -> float:
    """Same frames over one TCP connection: sendall each frame, recv_into its destination."""
    ls = socket.create_server(("127.0.0.1", 0))
    out, inc = frames_of(src), frames_of(dst)

    def receive() -> None:
        conn, _ = ls.accept()
        for view in inc:
            got = 0
            while got < view.nbytes:
                got += conn.recv_into(view[got:])
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=receive)
    t.start()
    s = socket.create_connection(ls.getsockname())
    t0 = time.perf_counter()
    for view in out:
        s.sendall(view)
    s.recv(1)
    dt = time.perf_counter() - t0
    t.join()
    s.close()
    ls.close()
    return dt


async def transport_runs(name: str, options: dict, src, dst) -> list[float]:
    tx, rx = create_transport(name, options), create_transport(name, options)
    await tx.start()
    await rx.start()
    tx.register(LAYOUT, *src)
    rx.register(LAYOUT, *dst)
    peer = await tx.connect(rx.descriptor())
    ids = list(range(BLOCKS))
    times = []
    for i in range(RUNS + 1):  # first run warms up connections and allocators
        handle = rx.expect(f"{name}-{i}", ids, timeout_s=300)
        t0 = time.perf_counter()
        await asyncio.gather(tx.send(peer, f"{name}-{i}", ids, ids), handle)
        if i:
            times.append(time.perf_counter() - t0)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(src[0] + src[1], dst[0] + dst[1])), "corrupted transfer"
    await tx.close()
    await rx.close()
    return times


# ---- WAN run: two processes in two namespaces --------------------------------------------------
async def wan_role(role: str, streams: int, arg: str) -> None:
    t = create_transport("zmq", {"streams": streams, "bind_host": arg if role == "rx" else "127.0.0.1",
                                 "ack_timeout_s": 60})
    await t.start()
    t.register(LAYOUT, *pool(1 if role == "tx" else 2))
    ids = list(range(BLOCKS))
    if role == "rx":
        handles = [t.expect(f"w{i}", ids, timeout_s=600) for i in range(RUNS + 1)]
        print(json.dumps(t.descriptor()), flush=True)
        for h in handles:
            await h
        print("DONE", flush=True)
        # the last frame's acknowledgement may still be on its way when the handle completes: close only once the
        # parent says the sender has finished (it closes our stdin)
        await asyncio.to_thread(sys.stdin.read)
    else:
        peer = await t.connect(json.loads(arg))
        for i in range(RUNS + 1):
            st = await t.send(peer, f"w{i}", ids, ids)
            print(json.dumps({"seconds": st.seconds}), flush=True)
    await t.close()


def wan_bench(streams_list: list[int]) -> dict:
    from pdd.transports.units import rate_bits
    from pdd.transports.wan_emulation import WanConfig, WanEmulation

    cfg = WanConfig(rate=WAN_RATE, delay=WAN_DELAY, ns_a="pddbench-a", ns_b="pddbench-b", subnet="10.80.0")
    results = {}
    with WanEmulation(cfg) as wan:
        for streams in streams_list:
            me = [sys.executable, "-m", "pdd.bench.transports", "--wan-role"]
            rx = subprocess.Popen([*wan.exec_prefix("b"), *me, "rx", str(streams), cfg.addr_b], stdout=subprocess.PIPE,
                                  stdin=subprocess.PIPE, text=True)
            desc = rx.stdout.readline()
            tx = subprocess.run([*wan.exec_prefix("a"), *me, "tx", str(streams), desc], capture_output=True, text=True,
                                timeout=600)
            rx.stdin.close()  # the sender is done: the receiver may close now
            rx.wait(timeout=60)
            secs = [json.loads(line)["seconds"] for line in tx.stdout.splitlines()[1:]]
            results[streams] = max(gbps(TOTAL, s) for s in secs)
    link = rate_bits(WAN_RATE) / 1e9
    return {"wan_link_gbps": link, "wan_rtt_ms": 2 * float(WAN_DELAY.rstrip("ms")),
            **{f"wan_zmq{s}_gbps": round(g, 3) for s, g in results.items()},
            **{f"ratio_wan{s}_vs_link": round(g / link, 3) for s, g in results.items()},
            "ratio_wan_vs_link": round(results[max(results)] / link, 3)}


# ---- striping on the report's emulated link -----------------------------------------------------
STRIPE_SCALE = 1000  # the report's rates and bytes / this, so a 64K-token transfer takes seconds on loopback
STRIPE_STREAMS = (1, 2, 4, 10, 16)


async def striping_bench() -> dict:
    """A 64K-token transfer over zmq behind the shaper at the report scenario's link (per-flow rate and line, both
    / STRIPE_SCALE, as are the KV bytes): first byte to last (the shaper's delay 0) against
    min(streams x per-flow, line), the rate the simulator gives such a transfer (scenarios/deployment.py WanLink)."""
    from pdd.scenarios import Deployment, load_yaml

    report = Deployment.from_dict(load_yaml("report"))
    tokens = int(load_yaml("report")["workload"]["context_tokens"])
    flow_bits = report.wan.per_flow_gbps * 1e9 / STRIPE_SCALE
    line_bits = report.wan.bandwidth_gbps * 1e9 / STRIPE_SCALE
    nbytes = tokens * report.model.kv_bytes_per_token / STRIPE_SCALE
    blocks = max(1, round(nbytes / (2 * LAYOUT.num_layers * LAYOUT.bytes_per_block_per_tensor)))
    sent = 2 * LAYOUT.num_layers * blocks * LAYOUT.bytes_per_block_per_tensor
    out: dict[str, object] = {"stripe_bytes": sent, "stripe_flow_mbit": flow_bits / 1e6,
                              "stripe_line_mbit": line_bits / 1e6}
    for streams in STRIPE_STREAMS:
        shape = {"rate": f"{line_bits:.0f}bit", "flow_rate": f"{flow_bits:.0f}bit", "delay": "0ms"}
        tx = create_transport("zmq", {"streams": streams, "shape": shape})
        rx = create_transport("zmq", {"streams": streams})
        await tx.start()
        await rx.start()
        tx.register(LAYOUT, *pool(1))
        rx.register(LAYOUT, *pool(2))
        peer = await tx.connect(rx.descriptor())
        ids = list(range(blocks))
        best = 0.0
        for i in range(RUNS):
            handle = rx.expect(f"s{streams}-{i}", ids, timeout_s=120)
            t0 = time.perf_counter()
            await asyncio.gather(tx.send(peer, f"s{streams}-{i}", ids, ids), handle)
            best = max(best, sent * 8 / (time.perf_counter() - t0))
        await tx.close()
        await rx.close()
        model = min(streams * flow_bits, line_bits)
        out[f"stripe{streams}_mbit"] = round(best / 1e6, 2)
        out[f"ratio_stripe{streams}_vs_model"] = round(best / model, 3)
    return out


def main() -> None:
    try:
        import ucxx  # noqa: F401

        have_ucx = True
    except Exception:  # noqa: BLE001
        have_ucx = False
    src, dst = pool(1), pool(2)
    rows: dict[str, float] = {}
    raw = [raw_socket_once(src, dst) for _ in range(RUNS + 1)][1:]
    rows["socket"] = gbps(TOTAL, min(raw))
    cases = [("zmq1", "zmq", {"streams": 1}), ("zmq4", "zmq", {"streams": 4}), ("inproc", "inproc", {})]
    if have_ucx:
        cases.insert(2, ("ucx", "ucx", {}))
    for label, name, opts in cases:
        dst = pool(2)
        rows[label] = gbps(TOTAL, min(asyncio.run(transport_runs(name, opts, src, dst))))
    figures: dict[str, object] = {"bytes_per_run": TOTAL, "frame_bytes": FRAME, "runs": RUNS}
    figures.update({f"{k}_gbps": round(v, 3) for k, v in rows.items()})
    for k in ("zmq1", "zmq4", "ucx", "inproc"):
        if k in rows:
            figures[f"ratio_{k}_vs_socket"] = round(rows[k] / rows["socket"], 3)
    if not have_ucx:
        figures["ratio_ucx_vs_socket"] = None
    print(f"\n{'path':<28}{'Gbit/s':>10}{'vs socket':>12}")
    for k, v in rows.items():
        print(f"{'loopback ' + k:<28}{v:>10.2f}{v / rows['socket']:>12.2f}")
    stripe = asyncio.run(striping_bench())
    figures.update(stripe)
    print(f"\nStriping, the report's link / {STRIPE_SCALE} ({stripe['stripe_flow_mbit']:g} Mbit/s per flow, "
          f"{stripe['stripe_line_mbit']:g} line; a 64K-token transfer, {stripe['stripe_bytes'] / 1e6:.2f} MB; zmq "
          f"behind the shaper, first byte to last):")
    for streams in STRIPE_STREAMS:
        print(f"{'  streams ' + str(streams):<28}{stripe[f'stripe{streams}_mbit'] / 1e3:>10.3f}"
              f"{'':>12}  ({stripe[f'ratio_stripe{streams}_vs_model']:.2f} x min(streams x flow, line))")
    if os.geteuid() == 0:
        wan = wan_bench([1, 4])
        figures.update(wan)
        for s in (1, 4):
            print(f"{'WAN 1Gbit/40ms zmq' + str(s):<28}{wan[f'wan_zmq{s}_gbps']:>10.2f}"
                  f"{'':>12}  ({wan[f'ratio_wan{s}_vs_link']:.2f} x link)")
    else:
        print("(not root: emulated-WAN run skipped)")
    print(json.dumps(figures))


if __name__ == "__main__":
    if ARGS.wan_role:
        role, streams, arg = ARGS.wan_role
        asyncio.run(wan_role(role, int(streams), arg))
    else:
        main()
