"""The options of an export that are checked before torch is imported (pure, torch-free):
``max_shard_size`` (:func:`parse_size`) and ``dtype`` (:func:`output_dtype`)."""

from __future__ import annotations

import re

from dcp_volumes import errors

__all__ = ["FLOATING", "output_dtype", "parse_size"]

#: the dtypes ``--dtype`` casts (other tensors keep their dtype)
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})
_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                "float16": "float16", "half": "float16", "fp32": "float32",
                "float32": "float32", "float": "float32"}

def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"`` (decimal, as Hugging Face reads it:
    5 * 10**9), ``"500MiB"`` (binary), ``"100KB"``, plain digits.

    Raises:
        ConfigError: not a positive size.
    """
    if isinstance(size, bool):
        raise errors.ConfigError(f"max_shard_size must be a size like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise errors.ConfigError(
                f"max_shard_size must be a size like '5GB', '500MiB' or a number of bytes, "
                f"got {size!r}")
        number, unit, binary = m.groups()
        base = 1024 if binary else 1000
        value = int(float(number) * base ** (" KMGT".index(unit.upper()) if unit else 0))
    if value <= 0:
        raise errors.ConfigError(f"max_shard_size must be greater than 0, got {size!r}")
    return value


def output_dtype(dtype: str | None) -> str | None:
    """The torch dtype name ``--dtype`` asks for (``"bf16"`` → ``"bfloat16"``), or None.

    Raises:
        ConfigError: not one of bf16, fp16, fp32.
    """
    if dtype is None:
        return None
    name = _DTYPE_NAMES.get(str(dtype).removeprefix("torch.").lower())
    if name is None:
        raise errors.ConfigError(
            f"dtype must be bf16, fp16 or fp32 (or None to keep each tensor's), got {dtype!r}")
    return name
