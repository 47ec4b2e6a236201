"""Which decode instances the router can reach over the WAN for KV, with probing of down links.

A failed WAN transfer marks the link to that decode instance down: the policy stops choosing
pipelines that move KV over it (requests finish on the relay, P-RLD) until a probe — a real
two-token request forced over that link, so it moves one fresh block of KV — gets through.

``WanHealth`` is the link-state machine; ``WanProbe`` sends a probe and reads its answer off the
router's event stream (the orchestrator hands it the events of probe ids).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from pdd.router.registry import Registry
from pdd.shared import metrics
from pdd.shared.bus import Bus, BusError
from pdd.shared.config import PDDConfig
from pdd.shared.pipelines import Pipeline
from pdd.shared.protocol import ErrorReply, Message, SamplingSpec, Subjects, SubmitRequest, TokenChunk
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router.wan")


class WanHealth:
    def __init__(self, probe: Callable[[str], Awaitable[bool]], interval_s: float):
        self._probe = probe
        self.interval_s = interval_s
        self.down_since: dict[str, float] = {}
        self._probers: dict[str, asyncio.Task] = {}

    def is_up(self, decode_id: str) -> bool:
        return decode_id not in self.down_since

    def mark_down(self, decode_id: str, reason: str) -> None:
        if decode_id in self.down_since:
            return
        self.down_since[decode_id] = time.monotonic()
        metrics.WAN_UP.labels(decode_id).set(0)
        log.warning("wan_link_down", decode=decode_id, reason=reason)
        self._probers[decode_id] = asyncio.create_task(self._probe_until_up(decode_id), name=f"wan-probe-{decode_id}")

    def forget(self, decode_id: str) -> None:
        """The instance left the registry: nothing to probe, and no link state to report.

        Its ``pdd:wan_link_up`` series goes too: left at 0, it would report the link down for good, even
        after an instance of that id joins again (it starts up: nothing marks it down or probes it)."""
        task = self._probers.pop(decode_id, None)
        if task is not None:
            task.cancel()
        if self.down_since.pop(decode_id, None) is not None:
            log.info("wan_link_forgotten", decode=decode_id, reason="instance left the registry")
        try:
            metrics.WAN_UP.remove(decode_id)
        except KeyError:  # never marked down: no series
            pass

    async def _probe_until_up(self, decode_id: str) -> None:
        """Probe every ``interval_s`` until one gets through. Only ``forget`` or ``stop`` end this loop
        early (they cancel it): a failed, timed-out or crashed probe is one more failed probe, never the
        end of probing (the link would then stay down for good, with nobody looking)."""
        probes = 0
        while True:
            await asyncio.sleep(self.interval_s)
            probes += 1
            try:
                ok = await self._probe(decode_id)
            except asyncio.CancelledError:
                if decode_id not in self._probers:  # forget() or stop(): this loop is over
                    raise
                ok = False  # a cancellation from inside the probe (e.g. its own timeout), not of this loop
                log.warning("wan_probe_error", decode=decode_id, probes=probes, error="probe cancelled")
            except Exception as exc:  # a probe never takes the router down
                log.warning("wan_probe_error", decode=decode_id, probes=probes, error=repr(exc))
                ok = False
            if not ok and probes & (probes - 1) == 0:  # probes 1, 2, 4, 8, ...: say it is still down
                since = self.down_since.get(decode_id, time.monotonic())
                log.info("wan_link_still_down", decode=decode_id, probes=probes,
                         down_s=round(time.monotonic() - since, 2))
            if ok:
                since = self.down_since.pop(decode_id, time.monotonic())
                self._probers.pop(decode_id, None)
                metrics.WAN_UP.labels(decode_id).set(1)
                log.info("wan_link_up", decode=decode_id, down_s=round(time.monotonic() - since, 2), probes=probes)
                return

    async def stop(self) -> None:
        tasks = list(self._probers.values())
        self._probers.clear()  # first: a prober cancelled now knows it is meant
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probers.clear()


class WanProbe:
    """A real two-token P-MD request over the link to one decode instance (``probe``), answered by the
    first token main decode streams back (``on_event``)."""

    def __init__(self, config: PDDConfig, bus: Bus, registry: Registry, events_subject: str,
                 cancel: Callable[[str, str], Awaitable[None]], forget: Callable[[str], None]):
        self.config = config
        self.bus = bus
        self.registry = registry
        self.events_subject = events_subject
        self._cancel = cancel
        self._forget = forget  # the decode instance left the registry: stop probing it
        self._probes: dict[str, asyncio.Future] = {}

    def owns(self, request_id: str | None) -> bool:
        return request_id in self._probes

    async def probe(self, decode_id: str) -> bool:
        """True when MD's token comes back over the link to ``decode_id``."""
        decode = self.registry.get(decode_id)
        prefills = self.registry.instances(Role.PREFILL)
        if decode is None:
            self._forget(decode_id)
            return False
        if not prefills:
            return False
        block_size = int(decode.cache_summary.get("block_size", self.config.model.block_size))
        prompt = [random.randrange(1, 256) for _ in range(block_size + 1)]  # fresh: MD cannot have it cached
        probe_id = f"wan-probe-{decode_id}-{random.getrandbits(48):012x}"
        done = asyncio.get_running_loop().create_future()
        self._probes[probe_id] = done
        prefill = min(prefills, key=lambda i: (i.load, i.instance_id))
        timeout = max(5.0, self.config.router.stall_timeout_s)
        ok = False
        try:
            await self.bus.publish(Subjects.instance(prefill.instance_id, "submit"), SubmitRequest(
                request_id=probe_id, prompt_ids=prompt, sampling=SamplingSpec(max_tokens=2, ignore_eos=True),
                pipeline=Pipeline.P_MD, events_subject=self.events_subject, deadline_unix=time.time() + timeout,
                md_instance=decode_id))
            # shielded: on timeout the wait cancels what it waits on, and a cancelled ``done`` would make
            # ``done.result()`` below raise CancelledError out of the probe (which ended the prober for good)
            async with asyncio.timeout(timeout):
                return await asyncio.shield(done)
        except asyncio.TimeoutError:
            log.info("wan_probe_failed", decode=decode_id, probe=probe_id, via=prefill.instance_id,
                     reason=f"no token from {decode_id} within {timeout:g}s")
            return False
        except BusError as exc:
            log.info("wan_probe_failed", decode=decode_id, probe=probe_id, via=prefill.instance_id,
                     reason=f"submit failed: {exc}")
            return False
        finally:
            self._probes.pop(probe_id, None)
            if not ok:
                await self._cancel(probe_id, "wan probe over")

    def on_event(self, message: Message) -> None:
        done = self._probes.get(getattr(message, "request_id", ""))
        if done is None or done.done():
            return
        if isinstance(message, ErrorReply):
            log.info("wan_probe_failed", probe=message.request_id, reason=f"{message.code}: {message.message}",
                     instance=message.instance_id)
            done.set_result(False)
        elif isinstance(message, TokenChunk) and message.role == Role.MAIN_DECODE and message.token_ids:
            done.set_result(True)
