"""Simulator scale check: 1,000,000 requests over 1,000 instances on one core (target <= 60 s).

`seconds` is wall time; `cpu_seconds` is this process's CPU time (the fair figure on a shared machine).
Uses the report scenario's chips, model and link, scaled to 400 prefill + 100 relay + 500 main-decode
instances, offered at 70% of the bottleneck stage's capacity. Last line: JSON with seconds, requests.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from pdd.shared.roles import Role

SIM_MAIN_DECODE = "decode"  # the simulator's name for the main-decode role (sim/scenario.py)


def main(n: int = 1_000_000, instances: tuple[int, int, int] = (400, 100, 500)) -> dict:
    from pdd.loadgen.workload import agentic_arrays
    from pdd.sim.event_loop import simulate
    from pdd.sim.scenario import Scenario, load_yaml, stage_capacity, unit_poisson

    scn = Scenario.from_dict(load_yaml("report"))
    t0 = time.perf_counter()
    wl = agentic_arrays(replace(scn.workload, num_requests=n, seed=3))
    unit = unit_poisson(n, 3)
    split = {Role.PREFILL: instances[0], Role.RELAY: instances[1], SIM_MAIN_DECODE: instances[2]}
    probe = scn.sim_input("pdd", split, 1.0, wl, unit, record_itl=False)
    rate = 0.7 * min(stage_capacity(probe).values())
    inp = scn.sim_input("pdd", split, rate, wl, unit, record_itl=False)
    t_setup = time.perf_counter() - t0
    t1, c1 = time.perf_counter(), time.process_time()
    res = simulate(inp)
    seconds, cpu = time.perf_counter() - t1, time.process_time() - c1
    out = {
        "requests": n, "instances": sum(instances), "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
        "setup_seconds": round(t_setup, 2), "events": res.events, "completed": res.completed,
        "failed": res.failed, "offered_rps": round(rate, 1), "requests_per_second_simulated": round(n / seconds),
    }
    print(f"{'requests':>12} {'instances':>10} {'seconds':>8} {'events':>10} {'completed':>10}")
    print(f"{n:>12} {sum(instances):>10} {seconds:>8.1f} {res.events:>10} {res.completed:>10}")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requests", type=int, nargs="?", default=1_000_000, help="simulated requests")
    print(json.dumps(main(ap.parse_args().requests)))
