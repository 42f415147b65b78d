"""State dicts for round-trip checks, and a bit-exact comparison."""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["assert_state_equal", "mixed_state", "zeros_like_state"]

MiB = 1 << 20


def mixed_state(*, big_bytes: int = 6 * MiB, many: int = 300) -> dict[str, Any]:
    """Dtypes, empty and 0-d tensors, non-contiguous views, one tensor larger than a 5 MiB
    part, many small tensors, nested dicts, non-tensor objects and raw bytes."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return {
        "f32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(100, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, 3, generator=g).to(torch.float16),
        "i8": torch.randint(-128, 127, (55,), dtype=torch.int8, generator=g),
        "bool": torch.rand(40, generator=g) > 0.5,
        "c64": torch.randn(9, dtype=torch.complex64, generator=g),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(2.5),
        "view_t": base.t(),
        "view_slice": base[::3, 5:20],
        "big": torch.randn(big_bytes // 4, generator=g),
        "many": {f"p{i}": torch.full((i % 7 + 1,), float(i)) for i in range(many)},
        "nested": {"opt": {"step": 17, "betas": (0.9, 0.99), "name": "adamw"}},
        "blob": io.BytesIO(b"\x00\x01raw" * 100),
    }


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """A same-shaped target for ``dcp.load``: zero tensors, placeholder objects."""
    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v.contiguous())
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, io.BytesIO):
            return io.BytesIO()
        return None
    return z(state)


def assert_state_equal(got: Any, want: Any, path: str = "") -> None:
    """Equal keys, dtypes, shapes and bits (NaN-safe); equal objects and bytes."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: keys differ"
        for k in want:
            assert_state_equal(got[k], want[k], f"{path}{k}.")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{path}: dtype/shape"
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), \
            f"{path}: bits differ"
    elif isinstance(want, io.BytesIO):
        assert got.getvalue() == want.getvalue(), f"{path}: bytes differ"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
