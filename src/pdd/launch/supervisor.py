"""Keep a launcher's child processes running: a child that exits is restarted after a capped backoff.

Why: under `pdd up` one crashed service (a ``kill -9``, an out-of-memory kill) must not take the
whole system down; the others keep serving while it comes back. A child that crash-loops (a bad
config, a port it cannot bind) is restarted at most every ``backoff_max_s`` seconds with one log line
per exit (its exit code, the restart count, the delay and, when it exited by itself, the last line of
its log), so it never spins fast or silently. Only ``stop()`` ends a child for good.

A child that never became ready is different: exiting again and again the same way before it ever
served (a failed import, a bad model path) is not a crash a restart mends. After ``CRASH_LOOP_EXITS``
such exits in a row with the same last log line, ``poll()`` raises ``CrashLoop`` so that the launcher
stops and says why instead of restarting without end. Once a child has been ready, its exits are
restarted with the backoff, whatever they say.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def describe_exit(code: int) -> str:
    """Popen's return code in words: 'code 1', 'signal SIGKILL'."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def last_line(path: Path | None, offset: int = 0, limit: int = 300) -> str:
    """The last non-empty line a child wrote to its log since ``offset`` (why it died, usually)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, f.seek(0, 2) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


CRASH_LOOP_EXITS = 3  # exits before the first ready, in a row with the same last log line
VOLATILE_LOG_KEYS = ("timestamp", "time", "ts", "pid", "trace_id", "span_id")  # differ on every run of a JSON log


def exit_signature(line: str) -> str:
    """What two exits are compared by: their last log line, without what differs on every run (a JSON
    log's timestamp, pid, trace ids)."""
    try:
        event = json.loads(line)
    except ValueError:
        return line
    if not isinstance(event, dict):
        return line
    return json.dumps({k: v for k, v in event.items() if k not in VOLATILE_LOG_KEYS}, sort_keys=True)


class CrashLoop(RuntimeError):
    """A child exited ``CRASH_LOOP_EXITS`` times in a row, the same way, before it was ever ready."""

    def __init__(self, child: Child, why: str):
        self.child = child
        self.why = why
        where = f"; log {child.log_path}" if child.log_path else ""
        super().__init__(f"{child.name} exited {CRASH_LOOP_EXITS} times in a row before it was ever ready, "
                         f"each time with: {why}{where}")


@dataclass
class Child:
    """One supervised process. ``start`` launches it (and may wait until it listens) and returns it.
    ``ready`` tells whether the current process serves (None: it does once ``start`` returned)."""

    name: str
    start: Callable[[], subprocess.Popen]
    log_path: Path | None
    tier: int  # stop() ends higher tiers first (services before the nats-server they talk through)
    ready: Callable[[Child], bool] | None = None
    was_ready: bool = False  # some process of this child was ready once
    early_exits: list[str] = field(default_factory=list)  # signatures of exits before the first ready
    proc: subprocess.Popen | None = None
    log_offset: int = 0  # where the current process's log lines start (restarts append)
    started_at: float = 0.0
    restarts: int = 0  # how many times this child was restarted, in total
    failures: int = 0  # exits in a row without a stable run; sets the backoff
    due_at: float | None = None  # when a crashed child starts again

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Children started, watched by ``poll()`` (call it every fraction of a second) and stopped together.

    Backoff after an exit: ``backoff_s * 2**(failures-1)``, capped at ``backoff_max_s``; a child that
    ran ``stable_s`` seconds before it exited starts again from ``backoff_s``.
    """

    def __init__(self, say: Callable[[str], None], backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 stable_s: float = 60.0):
        self.say = say
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.stable_s = stable_s
        self.children: dict[str, Child] = {}
        self.stopped = False

    def add(self, name: str, start: Callable[[], subprocess.Popen], log_path: Path | None = None,
            tier: int = 1, ready: Callable[[Child], bool] | None = None) -> Child:
        """Start a child now; an error here propagates (the first start is the caller's to judge)."""
        child = Child(name, start, log_path, tier, ready)
        self.children[name] = child
        self._launch(child)
        return child

    def _launch(self, child: Child) -> None:
        child.log_offset = child.log_path.stat().st_size if child.log_path and child.log_path.exists() else 0
        child.started_at = time.monotonic()
        child.due_at = None
        child.proc = child.start()
        if child.ready is None:
            child.was_ready = True

    def _delay(self, child: Child) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** (child.failures - 1))

    def poll(self) -> None:
        """Notice exits (schedule a restart, say so) and restart the children whose backoff is over.

        Raises ``CrashLoop`` when a child that was never ready keeps exiting the same way."""
        if self.stopped:
            return
        now = time.monotonic()
        for child in self.children.values():
            if not child.was_ready and child.proc is not None and child.ready is not None and child.ready(child):
                child.was_ready = True
                child.early_exits.clear()
            if child.due_at is None and child.proc is not None and child.proc.poll() is not None:
                ran = now - child.started_at
                child.failures = 1 if ran >= self.stable_s else child.failures + 1
                delay = self._delay(child)
                child.due_at = now + delay
                code = child.proc.returncode
                why = last_line(child.log_path, child.log_offset) if code > 0 else ""  # a signal says it all
                if not child.was_ready:
                    child.early_exits.append(exit_signature(why or describe_exit(code)))
                    last = child.early_exits[-CRASH_LOOP_EXITS:]
                    if len(last) == CRASH_LOOP_EXITS and len(set(last)) == 1:
                        raise CrashLoop(child, why or f"exit {describe_exit(code)}")
                self.say(f"{child.name} exited with {describe_exit(code)} after {ran:.0f}s; "
                         f"restart #{child.restarts + 1} in {delay:g}s"
                         + (f" (last log line: {why})" if why else "")
                         + (f"; log {child.log_path}" if child.log_path else ""))
            if child.due_at is not None and now >= child.due_at:
                child.restarts += 1
                try:
                    self._launch(child)
                except (OSError, RuntimeError, TimeoutError) as exc:  # e.g. nats-server could not listen: same backoff as an exit
                    child.proc = None
                    child.failures += 1
                    delay = self._delay(child)
                    child.due_at = time.monotonic() + delay
                    self.say(f"{child.name} failed to start ({exc}); restart #{child.restarts + 1} in {delay:g}s")
                    continue
                self.say(f"restarted {child.name} pid={child.proc.pid} (restart #{child.restarts})")

    def restarts(self) -> dict[str, int]:
        return {name: child.restarts for name, child in self.children.items()}

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM each tier (highest first; its members drain in parallel), SIGKILL what outlives ``timeout``."""
        self.stopped = True
        for tier in sorted({c.tier for c in self.children.values()}, reverse=True):
            members = [c for c in self.children.values() if c.tier == tier]
            for child in members:
                child.due_at = None  # no restart after this
                if child.alive:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for child in members:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
