"""Page-layout descriptor: what two engines compare before moving KV blocks between them.

The transport moves raw blocks and knows nothing about models; this descriptor is the one
fact both sides must agree on so that block ``i`` of layer ``l`` means the same bytes on
both ends. It travels inside bus messages as a plain dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: tuple[str, ...] = tuple(_DTYPES)  # the KV dtypes a layout may name


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; use one of {sorted(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of a paged KV pool: per layer, K and V tensors of [num_blocks, block_size, kv_heads, head_dim]; and
    the page format, the backend that wrote the values (equal shapes of two backends need not mean equal bytes)."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # one of float32 / float16 / bfloat16
    backend: str = "torch"  # the page format: the engine backend that wrote them (vLLM adds its version, ISA)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.kv_heads, self.head_dim)

    @property
    def bytes_per_block_per_tensor(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V, all layers: the unit the WAN cost model uses."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.torch_dtype.itemsize

    def compatible_with(self, other: "KVLayout") -> bool:
        return self == other

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        layout = cls(
            num_layers=int(data["num_layers"]),
            block_size=int(data["block_size"]),
            kv_heads=int(data["kv_heads"]),
            head_dim=int(data["head_dim"]),
            dtype=str(data["dtype"]),
            backend=str(data.get("backend", "torch")),
        )
        dtype_from_name(layout.dtype)
        return layout
