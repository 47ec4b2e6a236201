"""How far concurrent requests on the vLLM backend agree with one vLLM engine serving them one at a time.

vLLM's batch-invariant mode does not run on its CPU attention backend (0.32.0), so a request's greedy tokens may
depend on its batch mates. This measures it, with its own baseline in the same run:

- reference: one vLLM engine (in this process), the prompts one at a time;
- baseline: the same engine, all prompts at once (one batch): vLLM's own batch variance;
- each pipeline (P-MD, P-RLD-MD one-shot / catch-up, P-RLD) of a local vLLM fleet, all prompts at once;
- ``--one-at-a-time``: the pipelines' requests one after another instead (no baseline then): what a handoff alone
  does, as vLLM computes a handed-over token's KV in a prefill-with-prefix pass where one engine decoded it.

Rules, the same for every setup: the same token-id prompts, greedy, ``ignore_eos``, ``max_tokens`` outputs; a
request *agrees* when all its tokens equal the reference's; ``prefix_agreement`` is the share of output
positions before a request's first differing token. Run from .venv-vllm (``bash scripts/install_vllm.sh``):
``.venv-vllm/bin/python -m pdd.bench.vllm_agreement``; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="requests per setup, sent at once")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="send each setup's requests one after another, not at once (what vLLM's numerics alone do "
                         "to a handed-over request, without batching)")
    ap.add_argument("--run-dir", default=None, help="the fleet's logs (default: a temp dir, kept)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import asyncio
    import json
    import random
    import tempfile

    import httpx

    from pdd.engine import SamplingParams
    from pdd.engine.vllm_backend.engine import VllmEngine
    from pdd.engine.vllm_backend.plugin import PLUGIN as VLLM_PLUGIN
    from pdd.launch.local_cluster import LocalCluster, two_site_layout

    from pdd.shared.pipelines import HandoffMode, Pipeline

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(200, 20000) for _ in range(rng.randrange(16, 400))] for _ in range(args.prompts)]
    ref = VllmEngine(dtype=args.dtype, kv_memory_bytes=256 << 20, block_size=32, cache_finished=False, num_threads=1)

    def run_engine(batch: list[list[int]]) -> list[list[int]]:
        outs: dict[str, list[int]] = {}
        for i, prompt in enumerate(batch):
            ref.add_request(f"b{i}-{rng.getrandbits(32)}", prompt, SamplingParams(ignore_eos=True),
                            max_new_tokens=args.max_tokens)
        order = list(ref.entries)
        while ref.has_work():
            for out in ref.step():
                outs.setdefault(out.rid, []).extend(out.token_ids)
        return [outs[rid] for rid in order]

    reference = [run_engine([p])[0] for p in prompts]

    def agreement(got: list[list[int]]) -> dict:
        same = sum(g == w for g, w in zip(got, reference))
        prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) / len(w)
                  for g, w in zip(got, reference)]
        return {"agree": same, "of": len(reference), "prefix_agreement": round(sum(prefix) / len(prefix), 4)}

    report: dict = {"bench": "vllm_agreement", "dtype": args.dtype, "prompts": args.prompts,
                    "max_tokens": args.max_tokens, "rules": "same token-id prompts, greedy, ignore_eos; agree = every "
                    "token equals one vLLM engine's one-at-a-time run", "setups": {}}
    report["one_at_a_time"] = args.one_at_a_time
    if not args.one_at_a_time:
        report["setups"]["one_vllm_batched"] = agreement(run_engine(prompts))
        print(f"one vLLM engine, all at once: {report['setups']['one_vllm_batched']}", flush=True)

    config = {
        "model": {"backend": VLLM_PLUGIN.name, "path": "default", "dtype": args.dtype, "kv_memory_mb": 256,
                  "block_size": 32, "max_num_seqs": 32, "threads": 1},
        **two_site_layout(),
        "transports": {"fast": {"name": "zmq", "options": {}},
                       "wan": {"name": "zmq", "options": {"streams": 2, "shape": {"delay": "100ms"}}}},
        "router": {"request_timeout_s": 300},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdd-vllm-agreement-"))
    cases = [(Pipeline.P_MD, None), (Pipeline.P_RLD_MD, HandoffMode.ONE_SHOT),
             (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP), (Pipeline.P_RLD, None)]

    async def send_all(base_url: str, pipeline: Pipeline, handoff: HandoffMode | None) -> list[list[int]]:
        pdd_opts = {"return_token_ids": True, "pipeline": pipeline.value, **({"handoff": handoff.value}
                                                                              if handoff else {})}
        async with httpx.AsyncClient(timeout=600) as client:
            def post(prompt: list[int]):
                return client.post(base_url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                    "pdd": pdd_opts})
            if args.one_at_a_time:
                replies = [await post(p) for p in prompts]
            else:
                replies = await asyncio.gather(*(post(p) for p in prompts))
        for r in replies:
            r.raise_for_status()
        return [r.json()["pdd"] for r in replies]

    with LocalCluster(run_dir, config) as cluster:
        cluster.start(timeout=600)
        for pipeline, handoff in cases:
            name = pipeline.value + (f" {handoff.value}" if handoff else "")
            infos = asyncio.run(send_all(cluster.base_url, pipeline, handoff))
            report["setups"][name] = {**agreement([info["token_ids"] for info in infos]),
                                      "handed_over": sum(bool(info.get("handoff_mode")) for info in infos)}
            how = "one at a time" if args.one_at_a_time else "all at once"
            print(f"{name}, {how}: {report['setups'][name]}", flush=True)
    report["run_dir"] = str(run_dir)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
