"""The environment a launcher gives services it starts on one host."""

from __future__ import annotations

import os


def shared_host_env() -> dict[str, str]:
    """Environment for engine processes that share one host's cores (``pdd up``, tests, benchmarks).

    libgomp's default spin-waiting makes each engine's idle OpenMP threads burn the cores the others
    need: three SmolLM2 engines (2 threads each) decoding at once on 2 cores made 0.3-0.4 tok/s each
    spinning, 1.4-1.8 passive (load ~8). It must be set before torch loads, hence in the child's
    environment. A user's own ``OMP_WAIT_POLICY`` wins.
    """
    return {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}
