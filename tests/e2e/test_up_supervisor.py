"""The supervisor behind `pdd up`, on real processes: a crash-looping child is restarted with a doubling,
capped backoff and one line per exit (code, restart count, delay, its last log line); a kill -9'd
nats-server comes back on its port; stop() ends everything and cancels a pending restart."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pdd.services.launch.natsserver import free_port, start_nats_server
from pdd.services.launch.supervisor import Supervisor


def _poll_until(supervisor: Supervisor, predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        supervisor.poll()
        time.sleep(0.02)


def _script(log: Path, code: str):
    def start() -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    return start


def test_a_crash_looping_child_backs_off_to_the_cap_and_says_why_each_time(tmp_path):
    said: list[str] = []
    supervisor = Supervisor(said.append, backoff_s=0.05, backoff_max_s=0.2, stable_s=3600)
    log = tmp_path / "bad.log"
    supervisor.add("bad", _script(log, "import sys; print('config error: model.path missing'); sys.exit(3)"), log)
    try:
        _poll_until(supervisor, lambda: supervisor.children["bad"].restarts >= 5, "five restarts")
        exits = [line for line in said if line.startswith("bad exited")]
        assert len(exits) >= 5, said
        for n, line in enumerate(exits[:5], start=1):
            assert "exited with code 3" in line and f"restart #{n} in" in line, line
            assert "config error: model.path missing" in line, line  # why, from its own log
        delays = [float(re.search(r"in ([0-9.]+)s", line).group(1)) for line in exits[:5]]
        assert delays == [0.05, 0.1, 0.2, 0.2, 0.2]  # doubling, then capped
        assert sum(line.startswith("restarted bad pid=") for line in said) >= 5
    finally:
        supervisor.stop()
    assert not supervisor.children["bad"].alive


def test_a_killed_nats_server_comes_back_on_its_port_and_stop_ends_everything(tmp_path):
    said: list[str] = []
    supervisor = Supervisor(said.append, backoff_s=0.05)
    port = free_port()
    nats = supervisor.add("nats-server", lambda: start_nats_server(port=port, log_file=str(tmp_path / "n.log")).process,
                          tmp_path / "n.log", tier=0)
    sleeper = supervisor.add("sleeper", _script(tmp_path / "s.log", "import time; time.sleep(600)"), tmp_path / "s.log")
    first = nats.proc.pid
    try:
        nats.proc.send_signal(signal.SIGKILL)
        _poll_until(supervisor, lambda: nats.restarts == 1 and nats.alive, "nats-server restarted")
        assert nats.proc.pid != first
        assert any(line.startswith("nats-server exited with signal SIGKILL") for line in said), said
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            assert conn.recv(4096).startswith(b"INFO ")  # a nats-server answers on the same port again
        assert sleeper.restarts == 0 and sleeper.alive  # the others were left alone
        # a child that just exited has a restart pending: stop() cancels it and ends the rest
        sleeper.proc.send_signal(signal.SIGKILL)
        sleeper.proc.wait()
        supervisor.poll()
        assert sleeper.due_at is not None
    finally:
        supervisor.stop()
    assert not nats.alive and not sleeper.alive
    supervisor.poll()  # nothing comes back, or is scheduled to, after stop()
    assert not sleeper.alive and sleeper.restarts == 0 and sleeper.due_at is None
