"""The safetensors header export writes (``dcp_volumes._format.layout``) is read back by
the ``safetensors`` library itself, and parsed back by our own untrusted-header parser."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load, save

from dcp_volumes import errors
from dcp_volumes.export import _format


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 3),
        "h": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "u": torch.arange(4, dtype=torch.uint8),
    }


def _file(ts: dict[str, torch.Tensor]) -> tuple[_format.Header, bytes]:
    header, encoded = _format.layout(
        [(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in ts.items()],
        {"format": "pt"})
    data = b"".join(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for v in ts.values())
    return header, encoded + data


def test_layout_is_read_back_by_the_safetensors_library() -> None:
    ts = _tensors()
    header, blob = _file(ts)
    assert header.data_start % 8 == 0 and header.file_size == len(blob)
    out = load(blob)
    assert set(out) == set(ts)
    for name, tensor in ts.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    # our parser agrees with what we laid out, in data order
    parsed = _format.read_header(lambda a, b: blob[a:b], len(blob), "model.safetensors")
    assert parsed.entries == header.entries and parsed.metadata == {"format": "pt"}


def test_library_written_file_parses_with_the_same_offsets() -> None:
    ts = _tensors()
    blob = save(ts, metadata={"format": "pt"})
    parsed = _format.read_header(lambda a, b: blob[a:b], len(blob), "x.safetensors")
    assert {e.name for e in parsed.entries} == set(ts)
    for e in parsed.entries:
        raw = bytearray(blob[parsed.data_start + e.begin:parsed.data_start + e.end])
        dtype = getattr(torch, e.torch_dtype)
        got = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        assert torch.equal(got.reshape(e.shape), ts[e.name]), e.name
    assert parsed.file_size == len(blob)


def test_a_dtype_safetensors_cannot_store_is_a_config_error() -> None:
    with pytest.raises(errors.ConfigError, match="complex128"):
        _format.layout([("z", "complex128", (2,))])
    assert _format.code_for("torch.bfloat16") == "BF16"


def test_a_header_with_too_many_tensors_is_refused_before_it_is_parsed(monkeypatch) -> None:
    monkeypatch.setattr(_format, "MAX_ENTRIES", 10)
    _, encoded = _format.layout([(f"t{i}", "uint8", (0,)) for i in range(11)])
    with pytest.raises(errors.IntegrityError, match="11 tensors, more than 10"):
        _format.read_header(lambda a, b: encoded[a:b], len(encoded), "many.safetensors")
    _, encoded = _format.layout([(f"t{i}", "uint8", (0,)) for i in range(10)])
    assert len(_format.read_header(lambda a, b: encoded[a:b], len(encoded), "x").entries) == 10
