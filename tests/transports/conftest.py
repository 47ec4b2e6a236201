"""Shared fixtures: small KV pools and connected transport pairs for every plugin."""

from __future__ import annotations

import os

import pytest
import torch

from pdd.shared.kv_layout import KVLayout
from pdd.transports import create_transport

try:
    import ucxx  # noqa: F401

    UCX_SKIP = None
except Exception as exc:  # noqa: BLE001
    UCX_SKIP = f"ucxx cannot be imported here: {exc}"

ROOT_SKIP = None if os.geteuid() == 0 else "needs root (network namespaces, TUN, tc)"

PLUGINS = [
    "inproc",
    "zmq",
    pytest.param("ucx", marks=pytest.mark.skipif(UCX_SKIP is not None, reason=UCX_SKIP or "")),
]


def layout_for(dtype: str = "float16", layers: int = 3) -> KVLayout:
    return KVLayout(num_layers=layers, block_size=4, kv_heads=2, head_dim=8, dtype=dtype)


def make_pool(layout: KVLayout, num_blocks: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *layout.block_shape)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(layout.torch_dtype)

    return [one() for _ in range(layout.num_layers)], [one() for _ in range(layout.num_layers)]


def snapshot(pool: tuple[list[torch.Tensor], list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t.clone() for t in pool[0] + pool[1]]


def unchanged(pool: tuple[list[torch.Tensor], list[torch.Tensor]], snap: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(pool[0] + pool[1], snap))


def options_for(name: str) -> dict:
    # Short ack timeouts keep failure tests quick; they are hang guards, not performance limits.
    return {"zmq": {"streams": 2, "ack_timeout_s": 5.0, "connect_timeout_s": 5.0},
            "ucx": {"ack_timeout_s": 5.0, "connect_timeout_s": 5.0}}.get(name, {})


class Pair:
    """A sender and a receiver transport of one plugin, registered and connected."""

    def __init__(self, name: str, layout: KVLayout, send_blocks: int = 24, recv_blocks: int = 32,
                 sender_opts: dict | None = None, receiver_opts: dict | None = None) -> None:
        self.name, self.layout = name, layout
        self.sender = create_transport(name, {**options_for(name), **(sender_opts or {})})
        self.receiver = create_transport(name, {**options_for(name), **(receiver_opts or {})})
        self.src_pool = make_pool(layout, send_blocks, seed=1)
        self.dst_pool = make_pool(layout, recv_blocks, seed=2)
        self.peer = None

    async def __aenter__(self) -> "Pair":
        await self.sender.start()
        await self.receiver.start()
        self.sender.register(self.layout, *self.src_pool)
        self.receiver.register(self.layout, *self.dst_pool)
        self.peer = await self.sender.connect(self.receiver.descriptor())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()
        await self.receiver.close()
