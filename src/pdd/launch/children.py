"""How a launcher starts its children on one host: the command, the environment, and a lifetime tied to it.

Why one module: `pdd up` (through its supervisor), the programmable ``LocalCluster`` and the nats-server
launcher start the same kinds of processes, and two things must hold for all of them:
- Engines sharing a host's cores must not spin idle OpenMP threads (``shared_host_env``).
- A child never outlives its launcher, even a launcher killed with ``kill -9``: a `pdd serve` child
  watches its parent (``watch_parent``, started by `pdd serve` when ``PARENT_PID_ENV`` is set) and
  drains when it is gone; a non-Python child (nats-server) gets the kernel's parent-death signal
  (``die_with_parent``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

PARENT_PID_ENV = "PDD_LAUNCHER_PID"  # the launcher's pid, set in a child's environment by child_env()
PARENT_POLL_S = 0.5  # how often a child checks that its launcher still runs
ORPHAN_DRAIN_S = 30.0  # how long an orphaned child may drain before it exits regardless
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def shared_host_env() -> dict[str, str]:
    """Environment for engine processes that share one host's cores (``pdd up``, tests, benchmarks).

    libgomp's default spin-waiting makes each engine's idle OpenMP threads burn the cores the others
    need: three SmolLM2 engines (2 threads each) decoding at once on 2 cores made 0.3-0.4 tok/s each
    spinning, 1.4-1.8 passive (load ~8). It must be set before torch loads, hence in the child's
    environment. A user's own ``OMP_WAIT_POLICY`` wins.
    """
    return {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}


def serve_argv(role: str, config_path: str | Path, instance_id: str, prefix: list[str] | None = None) -> list[str]:
    """`pdd serve ROLE` as a child process (``prefix``: argv that execs it, e.g. ``ip netns exec SITE``)."""
    return [*(prefix or []), sys.executable, "-m", "pdd.launch.cli", "serve", role,
            "--config", str(config_path), "--instance-id", instance_id]


def child_env(*overrides: dict[str, str] | None) -> dict[str, str]:
    """This process's environment, the shared-host settings, this launcher's pid, then ``overrides`` in order."""
    env = {**os.environ, **shared_host_env(), PARENT_PID_ENV: str(os.getpid())}
    for extra in overrides:
        env.update(extra or {})
    return env


def die_with_parent() -> None:
    """``preexec_fn``: the kernel sends the child SIGTERM when the thread that started it exits.

    The kernel ties this to the starting *thread*, so only a launcher's main thread (which lives as long
    as the process) may use it: see ``death_signal_preexec``.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def death_signal_preexec():
    """``die_with_parent`` when called on the main thread of Linux, else None (no parent-death signal)."""
    on_main = threading.current_thread() is threading.main_thread()
    return die_with_parent if on_main and sys.platform.startswith("linux") else None


def _watch(parent_pid: int, log) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    log(parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)  # the service drains as on any SIGTERM
    time.sleep(ORPHAN_DRAIN_S)
    os._exit(1)  # the drain did not end in time


def watch_parent(log) -> bool:
    """In a child started with ``child_env``: drain (SIGTERM to itself) once the launcher is gone.

    Call it first thing: a launcher that died before the watch started is noticed at once. ``log(parent_pid)``
    is called before the SIGTERM. Returns whether a watch was started (False outside a launcher, e.g.
    `pdd serve` started by hand or by a container runtime).
    """
    try:
        parent_pid = int(os.environ.get(PARENT_PID_ENV, ""))
    except ValueError:
        return False
    threading.Thread(target=_watch, args=(parent_pid, log), name="parent-watch", daemon=True).start()
    return True
