"""The safetensors file format: the header export writes, and the untrusted header a reader
parses.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON + the data buffer. The JSON
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the
data buffer) and may hold ``"__metadata__"`` (str → str). The header is padded with spaces so the
data buffer starts 8-byte aligned, as the ``safetensors`` library writes it.

Torch-free: dtypes are named by their ``torch`` attribute (``"bfloat16"``), so the CLI can plan
an export without importing torch.

Every header read from storage is untrusted (``DESIGN.md``, "Trust boundary"):
:func:`parse_header` checks the header length against the object's real size before the JSON
is fetched, and every entry's dtype, shape and offsets before any tensor byte is: a length that
does not match its shape, an offset past the end, two tensors that overlap, an unknown dtype or
a duplicate name is an :class:`~dcp_volumes.errors.IntegrityError` naming the file, and nothing
is allocated from a size the header claims.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dcp_volumes import errors

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "Header", "TensorEntry", "code_for", "encode_header",
           "layout", "parse_header", "read_header"]

#: safetensors dtype code → (torch dtype attribute, element size in bytes)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2),
    "I8": ("int8", 1), "U8": ("uint8", 1), "U16": ("uint16", 2), "U32": ("uint32", 4),
    "U64": ("uint64", 8), "BOOL": ("bool", 1), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
}
_CODES: dict[str, str] = {name: code for code, (name, _) in DTYPES.items()}

#: the largest header accepted, as the safetensors library's own limit (100 MB)
MAX_HEADER_BYTES = 100_000_000
#: the most tensors one file may hold (the largest models have some 10**4 per file); checked
#: before the JSON is parsed, so a 100 MB header cannot build a million Python objects
MAX_ENTRIES = 200_000
#: the most dimensions a tensor may have (torch's own limit is 64)
MAX_DIMS = 64
_PREFIX = 8  # the u64 header length
_INT64 = 2**63  # torch's sizes and byte counts are signed 64-bit
_ALIGN = 8


def code_for(torch_dtype: str) -> str:
    """The safetensors code of a torch dtype attribute name (``"bfloat16"`` → ``"BF16"``).

    Raises:
        ConfigError: safetensors cannot store that dtype.
    """
    code = _CODES.get(torch_dtype.removeprefix("torch."))
    if code is None:
        raise errors.ConfigError(
            f"safetensors has no dtype for torch.{torch_dtype}: cast it (--dtype) or leave "
            "the tensor out")
    return code


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are in the data buffer."""

    name: str
    dtype: str  # the safetensors code
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A file's header: its entries in data order, and where the data buffer starts."""

    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    data_start: int  # 8 + the header's JSON length (padding included)

    @property
    def file_size(self) -> int:
        return self.data_start + (self.entries[-1].end if self.entries else 0)

    def entry(self, name: str) -> TensorEntry | None:
        for e in self.entries:
            if e.name == name:
                return e
        return None


def layout(tensors: Iterable[tuple[str, str, Sequence[int]]],
           metadata: Mapping[str, str] | None = None) -> tuple[Header, bytes]:
    """Lay out ``(name, torch dtype name, shape)`` tensors in the given order: the header and
    its encoded bytes (prefix, JSON and padding: the first ``data_start`` bytes of the file)."""
    entries = []
    offset = 0
    for name, torch_dtype, shape in tensors:
        code = code_for(torch_dtype)
        nbytes = math.prod(shape) * DTYPES[code][1]
        entries.append(TensorEntry(name, code, tuple(int(d) for d in shape), offset,
                                   offset + nbytes))
        offset += nbytes
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    encoded = encode_header(entries, meta)
    return Header(tuple(entries), meta, len(encoded)), encoded


def encode_header(entries: Sequence[TensorEntry], metadata: Mapping[str, str]) -> bytes:
    """The first bytes of the file: the u64 length, the JSON, spaces up to 8-byte alignment."""
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape),
                       "data_offsets": [e.begin, e.end]}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-(len(body) + _PREFIX) % _ALIGN)
    return struct.pack("<Q", len(body)) + body


def read_header(fetch: Callable[[int, int], bytes], size: int, what: str) -> Header:
    """Read and check the header of the safetensors object ``what`` of ``size`` bytes.

    ``fetch(start, end)`` returns those bytes of the object. Two reads: the 8-byte length,
    then (once the length is checked against ``size`` and :data:`MAX_HEADER_BYTES`) the JSON.
    """
    if size < _PREFIX:
        raise _bad(what, f"it has {size} bytes, fewer than a safetensors header's 8")
    prefix = fetch(0, _PREFIX)
    if len(prefix) != _PREFIX:
        raise _bad(what, f"reading its first 8 bytes returned {len(prefix)}")
    (length,) = struct.unpack("<Q", prefix)
    _check_length(length, size, what)
    return parse_header(fetch(_PREFIX, _PREFIX + length), size, what)


def _check_length(length: int, size: int, what: str) -> None:
    if length > MAX_HEADER_BYTES:
        raise _bad(what, f"its header claims {length} bytes, more than the "
                         f"{MAX_HEADER_BYTES} the format allows")
    if _PREFIX + length > size:
        raise _bad(what, f"its header claims {length} bytes, but the object has {size}")


def parse_header(body: bytes, size: int, what: str) -> Header:
    """Check a header's JSON (``body``, the bytes after the u64 length) against the object's
    ``size``: every entry known, consistent, inside the data buffer, none overlapping."""
    _check_length(len(body), size, what)
    if not body.startswith(b"{"):
        raise _bad(what, "its header is not a JSON object")
    if body.count(b":") > 8 * MAX_ENTRIES:  # each entry has 4 colons; a bound before parsing
        raise _bad(what, f"its header holds more than {MAX_ENTRIES} tensors")
    try:
        doc = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(what, f"its header is not valid JSON ({str(exc)[:200]})") from None
    except RecursionError:
        raise _bad(what, "its header nests JSON deeper than Python can parse (a header "
                         "is one flat object of tensors)") from None
    if not isinstance(doc, dict):
        raise _bad(what, "its header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _bad(what, "its __metadata__ is not a map of strings to strings")
    if len(doc) > MAX_ENTRIES:
        raise _bad(what, f"its header holds {len(doc)} tensors, more than {MAX_ENTRIES}")
    capacity = size - _PREFIX - len(body)
    entries = sorted((_entry(name, value, what) for name, value in doc.items()),
                     key=lambda e: (e.begin, e.end))
    end = 0
    for e in entries:
        if e.end > capacity:
            raise _bad(what, f"tensor {e.name!r} ends at byte {e.end} of the data, which has "
                             f"{capacity}")
        if e.begin < end:
            raise _bad(what, f"tensor {e.name!r} overlaps the tensor before it (bytes "
                             f"{e.begin}..{e.end}, the previous one ends at {end})")
        end = max(end, e.end)
    return Header(tuple(entries), dict(metadata), _PREFIX + len(body))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _entry(name: str, value: Any, what: str) -> TensorEntry:
    if not name:
        raise _bad(what, "a tensor has an empty name")
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise _bad(what, f"tensor {name!r} is not {{dtype, shape, data_offsets}}")
    code, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise _bad(what, f"tensor {name!r} has dtype {str(code)[:20]!r}, which dcp_volumes "
                         f"does not know (known: {', '.join(DTYPES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(_natural(d) and d < _INT64 for d in shape)
            or math.prod(max(d, 1) for d in shape) * DTYPES[code][1] >= _INT64):
        raise _bad(what, f"tensor {name[:200]!r} has a shape that is not a list of at most "
                         f"{MAX_DIMS} non-negative integers whose bytes fit in 63 bits")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_natural, offsets))
            or offsets[0] > offsets[1]):
        raise _bad(what, f"tensor {name!r} has data_offsets that are not [begin, end] with "
                         "0 <= begin <= end")
    nbytes = math.prod(shape) * DTYPES[code][1]  # Python ints: no overflow, nothing allocated
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(what, f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but its "
                         f"shape and dtype need {nbytes}")
    return TensorEntry(name, code, tuple(shape), offsets[0], offsets[1])


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(what: str, why: str) -> errors.IntegrityError:
    return errors.IntegrityError(
        f"{what} is not a usable safetensors file: {why}. It is damaged, truncated or not "
        "safetensors; export or upload it again")
