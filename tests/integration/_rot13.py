"""A custom torch stream transform for the export tests (torch's ``Rot13Example`` style:
letters' case swapped both ways), importable by name for ``dcp-volumes export --extension
_rot13:Rot13Example`` (``tests/integration`` on ``PYTHONPATH``), and one whose decoded
stream never ends."""

from __future__ import annotations

import io
from typing import IO, Any

from torch.distributed.checkpoint._extension import StreamTransformExtension

_SWAP = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
                        b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class _Swapped(io.RawIOBase):
    def __init__(self, raw: IO[bytes], writing: bool) -> None:
        self.raw, self.writing = raw, writing

    def readable(self) -> bool:
        return not self.writing

    def writable(self) -> bool:
        return self.writing

    def readinto(self, b: Any) -> int:
        data = self.raw.read(len(memoryview(b))) or b""
        memoryview(b)[:len(data)] = data.translate(_SWAP)
        return len(data)

    def write(self, b: Any) -> int:
        self.raw.write(bytes(b).translate(_SWAP))
        return len(memoryview(b))

    def flush(self) -> None:
        self.raw.flush()


class Rot13Example(StreamTransformExtension):
    @staticmethod
    def from_descriptor(version: str) -> Rot13Example:
        if version.partition(".")[0] != "1":
            raise ValueError(f"Unknown extension {version=}")
        return Rot13Example()

    @staticmethod
    def registry_name() -> str:
        return "stream.rot13"

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _Swapped(output, writing=True)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _Swapped(input, writing=False)  # type: ignore[return-value]


class _Zeros(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b)
        view[:] = bytes(len(view))
        return len(view)


class Endless(Rot13Example):
    """Decodes to zeros without end: a crafted item must not exhaust memory."""

    @staticmethod
    def from_descriptor(version: str) -> Endless:
        return Endless()

    @staticmethod
    def registry_name() -> str:
        return "stream.endless"

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _Zeros()  # type: ignore[return-value]
