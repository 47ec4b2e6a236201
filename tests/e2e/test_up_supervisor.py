"""The supervisor behind `pdd up`, on real processes: a crash-looping child is restarted with a doubling,
capped backoff and one line per exit (code, restart count, delay, its last log line); one that never
became ready and exits the same way three times in a row is a crash loop (``CrashLoop``), one whose exits
differ or that was ready once is restarted; a kill -9'd nats-server comes back on its port; stop() ends
everything and cancels a pending restart."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdd.launch.natsserver import free_port, start_nats_server
from pdd.launch.supervisor import CRASH_LOOP_EXITS, CrashLoop, Supervisor


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


def _said_ready(child) -> bool:
    return "READY" in child.log_path.read_text()[child.log_offset:]


# A JSON log line that differs on every run only by its timestamp and pid, as a service's would.
FAILS_AT_IMPORT = ("import json, os, sys, time; print(json.dumps({'event': 'service_failed', 'error': 'no module x', "
                   "'timestamp': time.time(), 'pid': os.getpid()})); sys.exit(1)")


def test_a_child_that_exits_the_same_way_before_it_was_ever_ready_is_a_crash_loop(tmp_path):
    said: list[str] = []
    supervisor = Supervisor(said.append, backoff_s=0.05, backoff_max_s=0.2, stable_s=3600)
    log = tmp_path / "bad.log"
    supervisor.add("bad", _script(log, FAILS_AT_IMPORT), log, ready=_said_ready)
    try:
        with pytest.raises(CrashLoop) as caught:
            _poll_until(supervisor, lambda: False, "a crash loop", timeout=60.0)
        assert supervisor.children["bad"].restarts == CRASH_LOOP_EXITS - 1
        message = str(caught.value)
        assert "bad exited 3 times in a row before it was ever ready" in message, message
        assert json.loads(message.split("each time with: ")[1].split("; log ")[0])["error"] == "no module x"
        assert message.endswith(f"; log {log}"), message
    finally:
        supervisor.stop()


@pytest.mark.parametrize("code", [
    "import random, sys; print('failed', random.random()); sys.exit(1)",  # a different reason every time
    "import sys; print('READY', flush=True); print('lost the bus'); sys.exit(1)",  # ready once, then crashed
], ids=["exits-differ", "was-ready"])
def test_exits_that_differ_or_follow_a_ready_run_are_restarted_not_a_crash_loop(tmp_path, code):
    supervisor = Supervisor(lambda _: None, backoff_s=0.05, backoff_max_s=0.1, stable_s=3600)
    log = tmp_path / "child.log"
    supervisor.add("child", _script(log, code), log, ready=_said_ready)
    try:
        _poll_until(supervisor, lambda: supervisor.children["child"].restarts >= CRASH_LOOP_EXITS + 2, "restarts")
    finally:
        supervisor.stop()


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
