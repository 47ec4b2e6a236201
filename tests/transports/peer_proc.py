"""A transport peer in its own process, for tests that kill one side mid-transfer.

    python peer_proc.py sender PLUGIN DESCRIPTOR_JSON   # sends half the layers, prints HALF, dies (SIGKILL)
    python peer_proc.py receiver PLUGIN                 # prints its descriptor, dies after 2 frames
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import torch

from pdd.shared.kv_layout import KVLayout
from pdd.transports import create_transport

LAYOUT = KVLayout(num_layers=4, block_size=4, kv_heads=2, head_dim=8, dtype="float16")
BLOCKS = 8


def pool() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (BLOCKS, *LAYOUT.block_shape)
    return ([torch.randn(shape).half() for _ in range(4)], [torch.randn(shape).half() for _ in range(4)])


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


async def sender(plugin: str, desc: dict) -> None:
    t = create_transport(plugin, {"streams": 2} if plugin == "zmq" else {})
    await t.start()
    t.register(LAYOUT, *pool())
    peer = await t.connect(desc)
    await t.send(peer, "victim", list(range(BLOCKS)), list(range(BLOCKS)), layers=range(0, 2))
    print("HALF", flush=True)
    die()


async def receiver(plugin: str) -> None:
    t = create_transport(plugin, {"max_frame_bytes": 256})
    await t.start()
    t.register(LAYOUT, *pool())
    t.expect("victim", list(range(BLOCKS)), timeout_s=120)
    accept, count = t._registry.accept, [0]

    def accept_then_die(*args, **kwargs):
        count[0] += 1
        if count[0] > 2:
            die()
        return accept(*args, **kwargs)

    t._registry.accept = accept_then_die
    print(json.dumps(t.descriptor()), flush=True)
    await asyncio.sleep(120)


if __name__ == "__main__":
    role, plugin = sys.argv[1], sys.argv[2]
    asyncio.run(sender(plugin, json.loads(sys.argv[3])) if role == "sender" else receiver(plugin))
