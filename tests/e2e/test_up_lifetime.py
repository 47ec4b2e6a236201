"""`pdd up` on a fresh machine: it answers from the checkout beside packages named like its folders, a
crash loop stops it with the reason, ``--ask`` without an answer fails, and nothing it or a test run
started outlives them (kill -9 of `pdd up`, SIGTERM of pytest). Real processes: `pdd up` on the tiny
model, a real nats-server; the working directory is the checkout, the worst case for shadowing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdd.launch.natsserver import free_port
from tests.e2e.test_up import alive
from tests.e2e.test_up_supervise import _base_config, _wait_for
from tests.foundation.test_no_shadowing import ROOT, make_stand_ins

UP = [sys.executable, "-m", "pdd.launch.cli", "up"]


def _up_argv(tmp_path: Path, model: str, *extra: str) -> list[str]:
    return [*UP, "--config", str(_base_config(tmp_path / "base.yaml", model)), "--port", str(free_port()),
            "--run-dir", str(tmp_path / "run"), "--wan", "none", "--no-curve", *extra]


def _pids(text: str) -> list[int]:
    """Every child `pdd up` reported (nats-server and the services)."""
    return [int(p) for p in re.findall(r"pid[= ](\d+)", text)]


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def _reap(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(600)
def test_pdd_up_answers_beside_packages_named_like_its_folders_and_a_kill_9_leaves_nothing(tmp_path, tiny_model):
    """Every folder name that has no real distribution gets a stand-in, and the checkout's root is first on
    PYTHONPATH; every service loads its tokenizer through transformers, which imports the PyPI `kernels`."""
    make_stand_ins(tmp_path / "site")
    log = tmp_path / "up.log"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}"}
    proc = subprocess.Popen(_up_argv(tmp_path, tiny_model, "--ask", "Hello"), cwd=ROOT, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    pids: list[int] = []
    try:
        _wait_for(lambda: "[pipeline:" in log.read_text(), "an answer to --ask", log, proc)
        pids = _pids(log.read_text())
        assert len(pids) >= 5, log.read_text()  # nats-server + router + prefill + relay + main decode
        assert "restart #" not in log.read_text(), log.read_text()  # nothing crashed on the way
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert not _wait_gone(pids, 60.0), f"children outlived a kill -9'd pdd up:\n{log.read_text()}"
        for name in ("router-0", "prefill-0", "relay-0", "main-decode-0"):
            assert "launcher_gone" in (tmp_path / "run" / f"{name}.log").read_text(), name
    finally:
        _reap(proc, pids)


@pytest.mark.timeout(600)
def test_pdd_up_stops_a_crash_loop_and_says_why(tmp_path, tiny_model):
    """A service that fails at import (its NATS client package is broken) exits the same way each time:
    `pdd up` stops everything and exits non-zero, printing the last log line and the log's path."""
    broken = tmp_path / "broken" / "nats"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('stand-in: this nats package is broken')\n")
    log = tmp_path / "up.log"
    env = {**os.environ, "PYTHONPATH": str(broken.parent)}
    proc = subprocess.Popen(_up_argv(tmp_path, tiny_model), cwd=ROOT, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.wait(300) != 0, log.read_text()
        text = log.read_text()
        assert "exited 3 times in a row before it was ever ready" in text, text
        assert "ImportError: stand-in: this nats package is broken" in text, text
        assert re.search(r"log \S+/run/\S+\.log", text), text
        assert "stopped" in text.splitlines()[-1], text
        assert not _wait_gone(_pids(text), 30.0), text
    finally:
        _reap(proc, _pids(log.read_text()))


@pytest.mark.timeout(600)
def test_pdd_up_ask_fails_when_no_answer_arrives_by_its_deadline(tmp_path, tiny_model):
    log = tmp_path / "up.log"
    proc = subprocess.Popen(_up_argv(tmp_path, tiny_model, "--ask", "Hello", "--ask-timeout", "0.01"), cwd=ROOT,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.wait(300) == 1, log.read_text()
        text = log.read_text()
        assert "ready: OpenAI API" in text and "--ask got no answer" in text, text
        assert not _wait_gone(_pids(text), 30.0), text
    finally:
        _reap(proc, _pids(log.read_text()))


INNER_TEST = """
import subprocess, sys, time
from pathlib import Path

def test_holds_a_system(nats_server):
    out = Path({out!r})
    proc = subprocess.Popen({argv!r}, stdout=open(out / "up.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        (out / "nats.pid").write_text(str(nats_server.process.pid))
        while True:
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(60)
"""


@pytest.mark.timeout(600)
def test_a_test_run_stopped_with_sigterm_leaves_no_system_behind(tmp_path, tiny_model):
    """A test that runs `pdd up` (killing it in ``finally``, as ours do) and uses the session's nats-server:
    SIGTERM to pytest must end both, and `pdd up`'s children with them."""
    test_file = tmp_path / "inner" / "test_inner.py"
    test_file.parent.mkdir()
    test_file.write_text(textwrap.dedent(INNER_TEST.format(out=str(tmp_path), argv=_up_argv(tmp_path, tiny_model))))
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                              "--rootdir", str(tmp_path / "inner"), "-c", os.devnull, str(test_file)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    log = tmp_path / "up.log"
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while "ready: OpenAI API" not in (log.read_text() if log.exists() else ""):
            assert inner.poll() is None, inner.stdout.read().decode()
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no pdd up log"
            time.sleep(0.3)
        pids = [int((tmp_path / "nats.pid").read_text()), *_pids(log.read_text())]
        inner.send_signal(signal.SIGTERM)
        output = inner.communicate(timeout=120)[0].decode()
        assert "KeyboardInterrupt" in output or "stopped by SIGTERM" in output, output
        assert not _wait_gone(pids, 60.0), f"left behind by a SIGTERM'd test run:\n{output}\n{log.read_text()}"
    finally:
        _reap(inner, pids)
