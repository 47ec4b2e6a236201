"""The KV layout two engines compare: its page format (``backend``) is part of it, so engines of different
backends refuse each other's pages; an announce from before the field reads as the torch engine's."""

from __future__ import annotations

import dataclasses

from pdd.shared.kv_layout import KVLayout


def test_layouts_of_different_backends_are_incompatible():
    torch_layout = KVLayout(num_layers=30, block_size=32, kv_heads=3, head_dim=64, dtype="float32")
    vllm_layout = dataclasses.replace(torch_layout, backend="vllm-0.32.0+cpu-cpu-vec")
    assert torch_layout.backend == "torch"
    assert not torch_layout.compatible_with(vllm_layout)
    assert vllm_layout.compatible_with(KVLayout.from_dict(vllm_layout.to_dict()))
    old_announce = {k: v for k, v in torch_layout.to_dict().items() if k != "backend"}
    assert KVLayout.from_dict(old_announce) == torch_layout
