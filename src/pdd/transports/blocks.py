"""Between a paged pool and frame payloads: plan frames, gather source bytes, scatter into the pool.

Sorting by source block id and cutting into runs lets a run of consecutive source blocks go out as
a zero-copy view of the pool; scattered blocks are gathered once with index_select.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class FramePlan:
    layer: int
    tensor: int  # 0 = K, 1 = V
    src: tuple[int, ...]
    dst: tuple[int, ...]
    # the send's tally of the codecs its frames carried (base.py counts per send; plugins pass plans through)
    tally: dict[str, int] | None = field(default=None, compare=False, repr=False)


def plan_frames(src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: Sequence[int],
                bytes_per_block: int, max_frame_bytes: int,
                tally: dict[str, int] | None = None) -> list[FramePlan]:
    """Layer by layer (so a sender can overlap with prefill), K then V, runs of <= max_frame_bytes."""
    pairs = sorted(zip(src_blocks, dst_blocks))
    per_frame = max(1, max_frame_bytes // bytes_per_block)
    chunks = [pairs[i:i + per_frame] for i in range(0, len(pairs), per_frame)]
    plans = []
    for layer in layers:
        for tensor in (0, 1):
            for chunk in chunks:
                plans.append(FramePlan(layer, tensor, tuple(s for s, _ in chunk), tuple(d for _, d in chunk), tally))
    return plans


def _run_start(ids: Sequence[int]) -> int | None:
    """First id if ids are consecutive ascending, else None."""
    first, n = ids[0], len(ids)
    if ids[-1] - first != n - 1:
        return None
    return first if tuple(ids) == tuple(range(first, first + n)) else None  # C-speed comparison


def gather(pool: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """Blocks ``ids`` of one layer's pool as one contiguous CPU tensor (a view when consecutive)."""
    start = _run_start(ids)
    if start is not None:
        out = pool[start:start + len(ids)]
    else:
        out = pool.index_select(0, torch.tensor(ids, dtype=torch.long, device=pool.device))
    return out.cpu() if out.device.type != "cpu" else out


def byte_view(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous tensor, without copying (works for bfloat16 too)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def scatter(pool: torch.Tensor, ids: Sequence[int], payload: Any) -> None:
    """Write a verified payload into blocks ``ids`` of one layer's pool."""
    n = len(ids)
    start = _run_start(ids)
    if pool.device.type == "cpu":  # numpy accepts read-only sources (zmq frames) without a copy
        src = np.frombuffer(payload, dtype=np.uint8).reshape(n, -1)
        dst = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()
        if start is not None:
            dst[start:start + n] = src
        else:
            dst[np.asarray(ids)] = src
        return
    with warnings.catch_warnings():  # torch warns about read-only buffers; we only read them
        warnings.simplefilter("ignore", UserWarning)
        src_t = torch.frombuffer(payload, dtype=torch.uint8).view(n, -1).to(pool.device)
    dst_t = pool.view(pool.shape[0], -1).view(torch.uint8)
    if start is not None:
        dst_t[start:start + n].copy_(src_t)
    else:
        dst_t.index_copy_(0, torch.tensor(ids, dtype=torch.long, device=pool.device), src_t)
