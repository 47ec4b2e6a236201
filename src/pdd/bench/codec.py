"""KV wire codecs (transports/codec.py) on a real model's real KV: lossless ratio and speed, fp8's accuracy.

    python -m pdd.bench.codec                  # SmolLM2-135M-Instruct, 50 prompts of 512-2,048 tokens
    python -m pdd.bench.codec --quick --model DIR   # tests: a tiny checkpoint, 3 short prompts
    python -m pdd.bench.codec --slice 30:42 --fp8-tensors k   # fp8 on K alone, 12 of the longer prompts

What it does:
* prompts: real text on this machine (the long descriptions of the installed Python packages, which are their
  READMEs, and this repository's docs/*.md), one source each, cut to lengths spread evenly over the range and
  wrapped in the model's chat template ("Summarize ..."). The output names the source.
* lossless: the prompts' KV as the transport frames it (one frame per layer, tensor and request), byte shuffle +
  zstd; ``lossless_ratio_bf16`` from the bf16 KV of every prompt, ``lossless_ratio_fp32`` from an fp32 engine's
  KV (fp32 weights) of the first ``--fp32-prompts``; a level sweep on bf16 justifies the level;
  ``lossless_mb_s_per_core``: the slower of compress and decompress (raw MB/s), bf16 KV, torch and zstd on one
  thread.
* fp8: per prompt, prefill (held, as P does), copy the prompt's KV out, then import it twice into the same
  engine (prepare_import / commit_import, P's first token as the known output): exact KV, which greedy-generates
  ``--gen`` tokens (the reference), and fp8-round-tripped KV, teacher-forced on the reference (after every step
  its token is compared with the reference's and replaced by it). ``fp8_top1_agreement``: share of those
  positions whose top-1 matches; the first mismatch is where free greedy decoding would first diverge
  (identical contexts until then), so ``fp8_greedy_prefix_agreement`` is the mean share of tokens before it and
  ``fp8_first_divergence_p50`` its median position (0-based; a prompt that never diverges counts as ``--gen``).
  A control imports exact KV teacher-forced the same way (must agree 100 %: the engine is batch-invariant).
The last stdout line is one JSON object.

    python -m pdd.bench.codec --memory         # buffer memory of one 64K-token transfer per codec (~1 min)

``--memory``: with a codec, frames are no longer zero-copy; this measures what that costs in memory. Per codec
(none, lossless, fp8, fp8+lossless), a receiver and a sender process (zmq on loopback, the production options:
4 streams, default ``window_bytes`` and ``max_frame_bytes``) each register a pool of ``--tokens`` (65,536) tokens
of SmolLM2-135M-shaped KV (30 layers, block 16, 3 KV heads, head_dim 64, bf16; synthetic: normal values with a
lognormal scale per (head, channel), which code like the real KV above: lossless 1.45, fp8+lossless 2.33), then
move it all in one send. Each process resets its peak RSS (VmHWM, ``/proc/self/clear_refs``) once its pool is
registered and touched (the sender: and its link up), and reads VmHWM again when the transfer completed: the
difference is the transfer's own buffer memory, not the pool. A fresh sender has not measured its link yet, so
``lossless`` compresses every frame (its worst case). The last stdout line is one JSON object
(``memory_peak_extra_mb``: {codec: {sender, receiver}} in MiB, ``pool_mb``, ``kv_tokens``, ...).

Why one module: it is the one benchmark of the codecs, whose figures the docs quote together (what a codec saves,
what it costs in accuracy, in speed and in memory); its two modes share the model's layout, the codec names and
the report's shape, and mean little apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# What this benchmark measured on real bf16 KV, for whoever must charge a codec without running it on real KV (the
# emulated benchmark: bench/pipelines_emulated.py --wan-codec). The one place these figures are written in code;
# docs/TRANSPORTS.md "Measured" has the run.
MEASURED_BF16_RATIO = {"none": 1.0, "lossless": 1.456, "fp8": 1.992, "fp8+lossless": 2.399}  # KV bytes per wire byte
MEASURED_LOSSLESS_MB_S_PER_CORE = 418.0  # the lossless stage's compress speed on bf16 KV, one core (its slower end)
MEASURED_ON = ("python -m pdd.bench.codec, 2026-12-05: SmolLM2-135M-Instruct's bf16 KV of 50 real-text prompts "
               "(529-2,033 tokens); AMD EPYC, 2 cores with avx512_bf16 (docs/TRANSPORTS.md)")

PROMPT_SOURCE = "real text: installed packages' READMEs (site-packages */METADATA) and this repository's docs/*.md"
INSTRUCTION = "Summarize the following document in a few sentences, then list its three most important points.\n\n"


def cpu_info() -> tuple[str, bool]:
    """(/proc/cpuinfo's model name, whether the CPU has avx512_bf16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", False
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                "unknown")
    return name, " avx512_bf16" in text


def text_sources() -> list[tuple[str, str]]:
    """(name, text) of every long real text on this machine we use: package READMEs, then the repo's docs."""
    out: list[tuple[str, str]] = []
    for entry in sorted({p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir()}):
        for meta in sorted(entry.glob("*.dist-info/METADATA")):
            body = meta.read_text(errors="replace").partition("\n\n")[2].strip()
            if len(body) >= 6000:
                out.append((meta.parent.name.split("-")[0], body))
    docs = Path(__file__).resolve().parents[3] / "docs"
    for md in sorted(docs.glob("*.md")) if docs.is_dir() else []:
        out.append((f"docs/{md.name}", md.read_text(errors="replace")))
    return out


def build_prompts(tokenizer: Any, n: int, lo: int, hi: int) -> list[list[int]]:
    """``n`` chat prompts of ``lo``..``hi`` tokens (evenly spread), each from a different real text."""
    from pdd.shared.tokenizer import render_chat

    sources = text_sources()
    overhead = len(render_chat(tokenizer, INSTRUCTION))
    prompts: list[list[int]] = []
    for _, text in sources:
        if len(prompts) == n:
            break
        target = lo + 16 + (hi - lo - 32) * len(prompts) // max(1, n - 1)  # spread, clear of both ends
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < target - overhead:
            continue
        body = tokenizer.decode(ids[:max(1, target - overhead)])
        prompt = render_chat(tokenizer, INSTRUCTION + body)
        if lo <= len(prompt) <= hi:
            prompts.append(prompt)
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} of {n} prompts of {lo}-{hi} tokens: not enough real text here "
                         f"({len(sources)} sources)")
    return prompts


def load_model(model: str, dtype: str, kv_dtype: str, threads: int) -> Any:
    """An engine without room (its model, tokenizer and dtypes are what ``engine_for`` reuses)."""
    from pdd.engine.torch_backend.engine import TorchEngine

    return TorchEngine.from_model(model, dtype=dtype, kv_dtype=kv_dtype, num_threads=threads, num_blocks=1)


def engine_for(base: Any, prompts: list[list[int]], copies: int, gen: int) -> Any:
    """A fresh engine on ``base``'s model with room for ``copies`` of every prompt plus its generated tokens;
    no prefix cache (each import is computed from the KV it was given)."""
    from pdd.engine.torch_backend.engine import TorchEngine

    blocks = copies * sum(-(-(len(p) + gen + 2) // base.block_size) for p in prompts) + 16
    return TorchEngine(base.model, base.tokenizer, num_blocks=blocks, max_num_seqs=64, max_prefill_tokens=4096,
                       enable_prefix_cache=False, cache_finished=False, dtype_choice=base.dtype_choice)


def run_until_done(eng: Any, rids: set[str], on_output: Any = None) -> None:
    pending = set(rids)
    while pending:
        outs = eng.step()
        for out in outs:
            if on_output is not None:
                on_output(out)
        for out in outs:
            if out.finished:
                pending.discard(out.rid)


def prefill_kv(eng: Any, prompts: list[list[int]], tag: str) -> list[tuple[int, list[Any], list[Any]]]:
    """Prefill every prompt as P does (held), then (first token, per-layer K, per-layer V) of its prompt blocks."""
    from pdd.engine.core.sampling_params import SamplingParams

    first: dict[str, int] = {}
    rids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, SamplingParams(ignore_eos=True), max_new_tokens=1, hold_kv=True)
    run_until_done(eng, set(rids), lambda out: first.setdefault(out.rid, out.token_ids[0]))
    k_cache, v_cache = eng.kv_buffers()
    out = []
    for rid in rids:
        blocks = eng.request_blocks(rid)
        out.append((first[rid], [k[blocks] for k in k_cache], [v[blocks] for v in v_cache]))  # copies
        eng.release(rid)
    return out


def import_kv(eng: Any, rid: str, prompt: list[int], first: int, ks: list[Any], vs: list[Any], gen: int) -> None:
    from pdd.engine.core.sampling_params import SamplingParams

    res = eng.prepare_import(rid, prompt, use_cache=False)
    k_cache, v_cache = eng.kv_buffers()
    for layer, (k, v) in enumerate(zip(ks, vs)):
        k_cache[layer][res.dst_blocks] = k
        v_cache[layer][res.dst_blocks] = v
    eng.commit_import(rid, prompt, [first], SamplingParams(ignore_eos=True), max_new_tokens=gen + 1)


def fp8_round_trip(t: Any, dtype: str) -> Any:
    import torch

    from pdd.transports import codec

    raw = codec.decode(codec.encode(t, "fp8", dtype, tuple(t.shape)), "fp8", dtype, tuple(t.shape), 1 << 40)
    return torch.frombuffer(bytearray(bytes(raw)), dtype=torch.uint8).view(t.dtype).view(t.shape)


def teacher_forced(eng: Any, prompts: list[list[int]], kv: list[tuple[int, list[Any], list[Any]]], gen: int,
                   controls: int, tensors: str = "kv") -> tuple[list[list[bool]], list[list[bool]]]:
    """Reference greedy run on exact imported KV, then fp8 KV (and ``controls`` exact copies) teacher-forced on it:
    per prompt, per generated position 1..gen, whether the top-1 token matched. ``tensors``: which of K and V
    cross as fp8 (``kv``, as the codec does; ``k`` or ``v`` to see which one bounds the agreement)."""
    dtype = eng.layout.dtype
    ref: dict[int, dict[int, int]] = {i: {} for i in range(len(prompts))}  # prompt -> output position -> token
    for i, (p, (first, ks, vs)) in enumerate(zip(prompts, kv)):
        import_kv(eng, f"ref{i}", p, first, ks, vs, gen)

    def record(out: Any) -> None:
        for j, tok in enumerate(out.token_ids):
            ref[int(out.rid[3:])][out.start_position + j] = tok

    run_until_done(eng, {f"ref{i}" for i in range(len(prompts))}, record)
    match: dict[str, list[bool]] = {}
    for i, (p, (first, ks, vs)) in enumerate(zip(prompts, kv)):
        import_kv(eng, f"fp8{i}", p, first, [fp8_round_trip(k, dtype) if "k" in tensors else k for k in ks],
                  [fp8_round_trip(v, dtype) if "v" in tensors else v for v in vs], gen)
        match[f"fp8{i}"] = []
        if i < controls:
            import_kv(eng, f"ctl{i}", p, first, ks, vs, gen)
            match[f"ctl{i}"] = []

    def force(out: Any) -> None:
        i, pos = int(out.rid[3:]), out.start_position
        if pos == 0:
            return  # P's first token, known
        want = ref[i][pos]
        match[out.rid].append(out.token_ids[0] == want)
        if out.token_ids[0] != want and not out.finished:
            eng.extend_known(out.rid, [want], start_position=pos)

    run_until_done(eng, set(match), force)
    fp8 = [match[f"fp8{i}"] for i in range(len(prompts))]
    ctl = [match[f"ctl{i}"] for i in range(min(controls, len(prompts)))]
    return fp8, ctl


def frames_of(kv: list[tuple[int, list[Any], list[Any]]]) -> list[Any]:
    """The payloads a transport would send: one per request, layer and tensor (each well under 16 MiB here)."""
    return [t for _, ks, vs in kv for t in [*ks, *vs]]


def coded_sizes(frames: list[Any], dtype: str, sizes: dict[str, int]) -> None:
    """Add the frames' raw bytes and their size under each codec to ``sizes``."""
    from pdd.transports import codec

    sizes["raw"] = sizes.get("raw", 0) + sum(t.numel() * t.element_size() for t in frames)
    for spec in ("lossless", "fp8", "fp8+lossless"):
        sizes[spec] = sizes.get(spec, 0) + sum(len(codec.encode(t, spec, dtype, tuple(t.shape))) for t in frames)


def lossless_speed(frames: list[Any], dtype: str, level: int, repeats: int = 2) -> tuple[float, float, float]:
    """(ratio, compress MB/s, decompress MB/s) of raw bytes, best of ``repeats`` passes, on this thread."""
    import torch

    from pdd.transports import codec

    item = frames[0].element_size()
    raws = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in frames]
    total = sum(r.nbytes for r in raws)
    best_c = best_d = float("inf")
    packed: list[bytes] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        packed = [codec.compress(r, item, level) for r in raws]
        best_c = min(best_c, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for r, z in zip(raws, packed):
            codec.decompress(z, item, r.nbytes)
        best_d = min(best_d, time.perf_counter() - t0)
    return total / sum(map(len, packed)), total / best_c / 1e6, total / best_d / 1e6


def subset(frames: list[Any], max_bytes: int) -> list[Any]:
    out, n = [], 0
    for t in frames:
        if n >= max_bytes:
            break
        out.append(t)
        n += t.numel() * t.element_size()
    return out


def summarize_fp8(fp8: list[list[bool]], gen: int) -> dict[str, Any]:
    firsts = [next((j for j, ok in enumerate(m) if not ok), gen) for m in fp8]
    positions = [ok for m in fp8 for ok in m]
    return {"fp8_top1_agreement": sum(positions) / len(positions),
            "fp8_greedy_prefix_agreement": statistics.fmean(f / gen for f in firsts),
            "fp8_first_divergence_p50": statistics.median(firsts),
            "fp8_first_divergence_min": min(firsts),
            "fp8_prompts_never_diverged": sum(f == gen for f in firsts),
            "fp8_positions": len(positions)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: the SmolLM2-135M-Instruct "
                    "HF folder under PDD_CACHE_DIR/hf, else the packaged SmolLM2 GGUF)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--min-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=128, help="tokens generated on the imported KV")
    ap.add_argument("--batch", type=int, default=25, help="prompts per engine batch (memory)")
    ap.add_argument("--fp32-prompts", type=int, default=8, help="prompts whose fp32 KV gives lossless_ratio_fp32")
    ap.add_argument("--dtype", default="auto", help="engine weights for the fp8 run (auto: what serving picks)")
    ap.add_argument("--kv-dtype", default="bfloat16", help="KV dtype of the fp8 run and of the bf16 figures")
    ap.add_argument("--controls", type=int, default=2, help="exact-KV teacher-forced controls per batch")
    ap.add_argument("--fp8-tensors", choices=("kv", "k", "v"), default="kv",
                    help="which tensors cross as fp8 in the accuracy run (k or v alone: which one bounds it)")
    ap.add_argument("--slice", default=":", help="START:END of the --prompts built (sorted by length), e.g. 30:42")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="tests: 3 prompts of 48-160 tokens, 8 generated tokens")
    ap.add_argument("--memory", action="store_true",
                    help="instead: peak RSS growth of a zmq sender and receiver process during one transfer, per codec")
    ap.add_argument("--tokens", type=int, default=65536, help="--memory: KV tokens in the transfer (and the pools)")
    ap.add_argument("--window-bytes", type=int, default=None,
                    help="--memory: the zmq window per stream (default: the transport's, 32 MiB), to see what it holds")
    ap.add_argument("--memory-role", nargs=2, metavar=("ROLE", "CODEC"), default=None,
                    help=argparse.SUPPRESS)  # internal: one side of a --memory run (rx, or tx with --peer)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # internal: the receiver's descriptor (JSON)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.min_tokens, args.max_tokens, args.gen = 3, 48, 160, 8
        args.batch, args.fp32_prompts, args.controls = 3, 2, 1
    return args


# ---- --memory: the buffer memory of one transfer per codec -------------------------------------------------
MEMORY_CODECS = ("none", "lossless", "fp8", "fp8+lossless")
MEMORY_REQUEST = "mem"
# SmolLM2-135M-Instruct (config.json: num_hidden_layers 30, num_key_value_heads 3, head_dim 64), the engine's
# block size 16, bf16 KV (what `dtype: auto` picks here): 23,040 bytes of K and V per token
MEMORY_LAYOUT = {"num_layers": 30, "block_size": 16, "kv_heads": 3, "head_dim": 64, "dtype": "bfloat16"}


def _status_kib(*keys: str) -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            out[name] = int(rest.split()[0])
    return out


def reset_peak_rss() -> bool:
    """Set VmHWM back to the current RSS (Linux >= 4.0, ``clear_refs`` 5); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def synthetic_pool(layout: Any, blocks: int, seed: int) -> tuple[list[Any], list[Any]]:
    """K and V of every layer, [blocks, block_size, heads, head_dim] bf16, every page touched: normal values times a
    lognormal (sigma 0.5) scale per (head, channel), which code like SmolLM2's real bf16 KV (lossless ~1.45,
    fp8+lossless ~2.33; real: 1.456, 2.399). One random bank per tensor kind; each layer holds it rotated by its
    own random number of tokens (cheap; a frame never repeats bytes within zstd's window)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = blocks * layout.block_size
    heads, dim = layout.kv_heads, layout.head_dim
    pools: tuple[list[Any], list[Any]] = ([], [])
    for kind in (0, 1):
        scale = torch.exp(0.5 * torch.randn(heads, dim, generator=g))
        bank = (torch.randn(tokens, heads, dim, generator=g) * scale).to(layout.torch_dtype)
        for _ in range(layout.num_layers):
            shift = int(torch.randint(tokens, (1,), generator=g))
            t = torch.empty(blocks, *layout.block_shape, dtype=layout.torch_dtype)
            flat = t.view(tokens, heads, dim)
            flat[:tokens - shift] = bank[shift:]
            flat[tokens - shift:] = bank[:shift]
            pools[kind].append(t)
        del bank
    return pools


def pool_digest(k: list[Any], v: list[Any]) -> str:
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for t in [*k, *v]:
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


async def memory_role(role: str, codec_name: str, tokens: int, peer_desc: str | None,
                      window_bytes: int | None = None) -> None:
    """One side of a --memory run. rx: registers a touched pool, expects the request, resets its peak RSS, prints its
    descriptor, waits for the transfer. tx: registers a filled pool, connects, resets its peak RSS, sends every block
    in one send. Each prints one JSON line with its RSS figures (KiB) and the transfer's stats."""
    import asyncio

    import torch

    from pdd.shared.kv_layout import KVLayout
    from pdd.transports import create_transport

    layout = KVLayout(**MEMORY_LAYOUT)
    blocks = -(-tokens // layout.block_size)
    ids = list(range(blocks))
    options: dict[str, Any] = {"streams": 4, "codec": codec_name}  # production defaults otherwise
    if window_bytes:
        options["window_bytes"] = window_bytes
    t = create_transport("zmq", options)
    await t.start()
    if role == "rx":
        k = [torch.zeros(blocks, *layout.block_shape, dtype=layout.torch_dtype) for _ in range(layout.num_layers)]
        v = [torch.zeros(blocks, *layout.block_shape, dtype=layout.torch_dtype) for _ in range(layout.num_layers)]
        for x in [*k, *v]:
            x.fill_(1.0)  # every page resident before the baseline (zeros may come from untouched calloc pages)
    else:
        k, v = synthetic_pool(layout, blocks, seed=1)
    t.register(layout, k, v)
    out: dict[str, Any] = {"role": role, "codec": codec_name, "streams": t.streams, "window_bytes": t.window_bytes,
                           "max_frame_bytes": t.max_frame_bytes}
    if role == "rx":
        handle = t.expect(MEMORY_REQUEST, ids, timeout_s=600)
        out["hwm_reset"] = reset_peak_rss()
        out.update(baseline_rss_kib=_status_kib("VmRSS")["VmRSS"], baseline_hwm_kib=_status_kib("VmHWM")["VmHWM"])
        print(json.dumps(t.descriptor()), flush=True)
        stats = await handle
    else:
        peer = await t.connect(json.loads(peer_desc or "{}"))
        out["hwm_reset"] = reset_peak_rss()
        out.update(baseline_rss_kib=_status_kib("VmRSS")["VmRSS"], baseline_hwm_kib=_status_kib("VmHWM")["VmHWM"])
        stats = await t.send(peer, MEMORY_REQUEST, ids, ids)
    now = _status_kib("VmRSS", "VmHWM")
    out.update(peak_hwm_kib=now["VmHWM"], after_rss_kib=now["VmRSS"], seconds=stats.seconds, wire_bytes=stats.bytes,
               raw_bytes=stats.raw_bytes, frames=stats.frames, frame_codec=stats.codec,
               pool_bytes=sum(x.numel() * x.element_size() for x in [*k, *v]), digest=pool_digest(k, v))
    if role == "rx":  # the handle completes before the last frame's acknowledgement leaves: close only once the
        await asyncio.to_thread(sys.stdin.readline)  # sender has it (the parent says so), or its send fails
    await t.close()
    print(json.dumps(out), flush=True)


def _last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def memory_main(args: argparse.Namespace) -> int:
    """Per codec, a fresh receiver and sender process; a table, then one JSON line."""
    import subprocess

    t_start = time.monotonic()
    cpu, _ = cpu_info()
    load = os.getloadavg()
    me = [sys.executable, "-m", "pdd.bench.codec", "--tokens", str(args.tokens),
          *(["--window-bytes", str(args.window_bytes)] if args.window_bytes else []), "--memory-role"]
    mib = 1 / 1024  # KiB -> MiB
    window = f"window_bytes {args.window_bytes}" if args.window_bytes else "default window_bytes"
    print(f"cpu: {cpu}; load {load[0]:.2f}; {args.tokens} KV tokens of {MEMORY_LAYOUT}; zmq loopback, 4 streams, "
          f"{window} and default max_frame_bytes; sender and receiver in separate processes")
    rows: dict[str, dict[str, Any]] = {}
    for name in MEMORY_CODECS:
        rx = subprocess.Popen([*me, "rx", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            desc = rx.stdout.readline()
            if not desc.strip():
                raise SystemExit(f"{name}: the receiver gave no descriptor (exit {rx.wait(timeout=60)})")
            tx = subprocess.run([*me, "tx", name, "--peer", desc.strip()], capture_output=True, text=True,
                                timeout=600, check=False)
            if tx.returncode != 0:
                raise SystemExit(f"{name}: the sender failed:\n{tx.stderr[-3000:]}")
            rx_out, _ = rx.communicate("sender done\n", timeout=120)
        finally:
            if rx.poll() is None:
                rx.kill()
        if rx.returncode != 0:
            raise SystemExit(f"{name}: the receiver failed (exit {rx.returncode})")
        rows[name] = {"tx": _last_json(tx.stdout), "rx": _last_json(rx_out)}
    pool_mib = rows["none"]["tx"]["pool_bytes"] / 2**20
    print(f"\npool: {pool_mib:.0f} MiB per process (K and V, {MEMORY_LAYOUT['num_layers']} layers); peak RSS growth "
          f"during the transfer (VmHWM after it minus RSS once the pool was registered), MiB:")
    print(f"{'codec':<14}{'sender':>9}{'receiver':>10}{'seconds':>9}{'wire MB':>9}{'ratio':>7}{'frames':>8}  carried")
    figures_rows: dict[str, dict[str, float]] = {}
    for name, r in rows.items():
        tx, rx = r["tx"], r["rx"]
        # with the reset, VmHWM started at the baseline RSS; without it (refused), this is an upper bound
        extra = {"sender": max(0, tx["peak_hwm_kib"] - tx["baseline_rss_kib"]) * mib,
                 "receiver": max(0, rx["peak_hwm_kib"] - rx["baseline_rss_kib"]) * mib}
        figures_rows[name] = extra
        print(f"{name:<14}{extra['sender']:>9.1f}{extra['receiver']:>10.1f}{tx['seconds']:>9.2f}"
              f"{tx['wire_bytes'] / 1e6:>9.1f}{tx['raw_bytes'] / tx['wire_bytes']:>7.2f}{tx['frames']:>8}  "
              f"{tx['frame_codec']}")
    exact = {n: r["tx"]["digest"] == r["rx"]["digest"] for n, r in rows.items() if "fp8" not in n}
    figures: dict[str, Any] = {
        "memory_peak_extra_mb": {n: {k: round(v, 1) for k, v in e.items()} for n, e in figures_rows.items()},
        "memory_unit": "MiB",
        "memory_baseline_rss_mb": {n: {"sender": round(r["tx"]["baseline_rss_kib"] * mib, 1),
                                       "receiver": round(r["rx"]["baseline_rss_kib"] * mib, 1)}
                                   for n, r in rows.items()},
        "transfer_seconds": {n: round(r["tx"]["seconds"], 3) for n, r in rows.items()},
        "wire_bytes": {n: r["tx"]["wire_bytes"] for n, r in rows.items()},
        "raw_bytes": rows["none"]["tx"]["raw_bytes"],
        "frames": rows["none"]["tx"]["frames"],
        "frame_codec": {n: r["tx"]["frame_codec"] for n, r in rows.items()},
        "bit_exact": exact,
        "hwm_reset": all(r[s]["hwm_reset"] for r in rows.values() for s in ("tx", "rx")),
        "pool_mb": round(pool_mib, 1), "kv_tokens": args.tokens, "layout": MEMORY_LAYOUT,
        "transport": {"name": "zmq", **{k: rows["none"]["tx"][k] for k in ("streams", "window_bytes",
                                                                          "max_frame_bytes")}},
        "cpu": cpu, "load_before": round(load[0], 2), "load_after": round(os.getloadavg()[0], 2),
        "seconds": round(time.monotonic() - t_start, 1),
    }
    if not all(exact.values()):
        print(f"WARNING: a lossless transfer did not arrive bit-exact: {exact}")
    print(json.dumps(figures))
    return 0


def main() -> int:
    args = parse_args()
    if args.memory_role:
        import asyncio

        asyncio.run(memory_role(args.memory_role[0], args.memory_role[1], args.tokens, args.peer, args.window_bytes))
        return 0
    if args.memory:
        return memory_main(args)
    import torch

    from pdd.shared.model_files import cache_dir
    from pdd.transports import codec

    t_start = time.monotonic()
    hf = cache_dir() / "hf" / "SmolLM2-135M-Instruct"
    model = args.model or (str(hf) if hf.is_dir() else "default")
    cpu, bf16 = cpu_info()
    load = os.getloadavg()
    print(f"cpu: {cpu}; avx512_bf16: {'yes' if bf16 else 'no'}; threads {args.threads}; load {load[0]:.2f}")
    base = load_model(model, args.dtype, args.kv_dtype, args.threads)
    kv_dtype, choice = base.layout.dtype, base.dtype_choice
    start, _, end = args.slice.partition(":")
    prompts = build_prompts(base.tokenizer, args.prompts, args.min_tokens, args.max_tokens)
    prompts = prompts[int(start or 0):int(end) if end else None]
    lens = [len(p) for p in prompts]
    print(f"model: {model}; {choice.reason}; {len(prompts)} prompts of {min(lens)}-{max(lens)} tokens from "
          f"{PROMPT_SOURCE}")
    fp8: list[list[bool]] = []
    ctl: list[list[bool]] = []
    kept: list[Any] = []  # up to 256 MiB of KV frames for the speed figures
    sizes16: dict[str, int] = {}
    for b in range(0, len(prompts), args.batch):
        batch = prompts[b:b + args.batch]
        eng = engine_for(base, batch, 3, args.gen)
        kv = prefill_kv(eng, batch, f"b{b}_")
        coded_sizes(frames_of(kv), kv_dtype, sizes16)
        kept = subset(kept + frames_of(kv), 256 << 20)
        f, c = teacher_forced(eng, batch, kv, args.gen, args.controls, args.fp8_tensors)
        fp8 += f
        ctl += c
        del eng, kv
        print(f"prompts {b}-{b + len(batch) - 1}: fp8 top-1 {sum(map(sum, f))}/{sum(map(len, f))} positions; "
              f"control {sum(map(sum, c))}/{sum(map(len, c))}; {time.monotonic() - t_start:.0f} s")
    del base
    base32 = load_model(model, "float32", "float32", args.threads)
    eng32 = engine_for(base32, prompts[:args.fp32_prompts], 1, 0)
    sizes32: dict[str, int] = {}
    coded_sizes(frames_of(prefill_kv(eng32, prompts[:args.fp32_prompts], "f")), "float32", sizes32)
    del eng32, base32
    torch.set_num_threads(1)
    ratios16 = {k: sizes16["raw"] / v for k, v in sizes16.items() if k != "raw"}
    ratios32 = {k: sizes32["raw"] / v for k, v in sizes32.items() if k != "raw"}
    bf16_frames = kept
    sweep_frames = subset(bf16_frames, 64 << 20 if not args.quick else 1 << 20)
    sweep = {lvl: lossless_speed(sweep_frames, kv_dtype, lvl) for lvl in (-5, -1, 1, 3, 6)}
    speed_frames = subset(bf16_frames, 256 << 20)
    _, c_mb, d_mb = lossless_speed(speed_frames, kv_dtype, codec.DEFAULT_LEVEL, repeats=3)
    for lvl, (r, c, d) in sweep.items():
        print(f"zstd level {lvl:>2} on {kv_dtype} KV: ratio {r:.3f}, compress {c:.0f} MB/s, decompress {d:.0f} MB/s "
              f"(one thread, shuffle included)")
    figures: dict[str, Any] = {
        "lossless_ratio_fp32": ratios32["lossless"], "lossless_ratio_bf16": ratios16["lossless"],
        "lossless_mb_s_per_core": min(c_mb, d_mb), "lossless_compress_mb_s": c_mb, "lossless_decompress_mb_s": d_mb,
        "zstd_level": codec.DEFAULT_LEVEL,
        "zstd_level_sweep": {str(k): {"ratio": v[0], "compress_mb_s": v[1], "decompress_mb_s": v[2]}
                             for k, v in sweep.items()},
        "fp8_ratio_bf16": ratios16["fp8"], "fp8_lossless_ratio_bf16": ratios16["fp8+lossless"],
        "fp8_ratio_fp32": ratios32["fp8"], "fp8_lossless_ratio_fp32": ratios32["fp8+lossless"],
        **summarize_fp8(fp8, args.gen),
        "control_exact_top1_agreement": (sum(map(sum, ctl)) / max(1, sum(map(len, ctl)))) if ctl else None,
        "prompts": len(prompts), "prompt_tokens_min": min(lens), "prompt_tokens_max": max(lens),
        "generated_tokens": args.gen, "prompt_source": PROMPT_SOURCE, "fp8_kv_dtype": kv_dtype,
        "fp8_tensors": args.fp8_tensors,
        "fp8_dtype_choice": choice.reason, "model": model, "cpu": cpu, "avx512_bf16": bf16,
        "load_before": round(load[0], 2), "load_after": round(os.getloadavg()[0], 2),
        "seconds": round(time.monotonic() - t_start, 1),
    }
    print(f"lossless ratio: fp32 {ratios32['lossless']:.3f} ({args.fp32_prompts} prompts), {kv_dtype} "
          f"{ratios16['lossless']:.3f}; fp8 {ratios16['fp8']:.3f}, fp8+lossless {ratios16['fp8+lossless']:.3f}; "
          f"{kv_dtype} one core: compress {c_mb:.0f} MB/s, decompress {d_mb:.0f} MB/s")
    print(f"fp8: top-1 {figures['fp8_top1_agreement']:.4f} over {figures['fp8_positions']} positions; greedy prefix "
          f"{figures['fp8_greedy_prefix_agreement']:.3f}; first divergence p50 {figures['fp8_first_divergence_p50']} "
          f"(of {args.gen}); control {figures['control_exact_top1_agreement']}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
