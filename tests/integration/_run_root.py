"""A run root plus raw access to it, for tests that make or damage objects behind the code's
back (raw fsspec calls) and save and load through the code under test."""

from __future__ import annotations

from typing import Any, ClassVar

import fsspec
import torch
import torch.distributed.checkpoint as dcp

from dcp_volumes import VolumeReader, VolumeWriter
from dcp_volumes._compat import no_dist


class RunRoot:
    """``root`` (a local directory or a store URL) with its storage options."""

    #: the shape of each of the two tensors a step holds
    shape: ClassVar[tuple[int, int]] = (64, 32)

    def __init__(self, root: str, options: dict[str, Any]) -> None:
        self.root, self.options = root, options
        self.local = "://" not in root
        self.fs, self.base = fsspec.url_to_fs(root, skip_instance_cache=True, **options)

    def state(self, value: float) -> dict[str, torch.Tensor]:
        return {f"t{i}": torch.full(self.shape, value) for i in range(2)}

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def path(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    def save(self, rel: str, value: float, writer: type[VolumeWriter] = VolumeWriter) -> None:
        dcp.save(self.state(value), **no_dist(),
                 storage_writer=writer(self.url(rel), storage_options=self.options))

    def load(self, rel: str) -> float:
        state = self.state(0.0)
        dcp.load(state, storage_reader=VolumeReader(self.url(rel), storage_options=self.options),
                 **no_dist())
        (value,) = {float(t.flatten()[0]) for t in state.values()}
        return value

    def names(self, rel: str) -> list[str]:
        self.fs.invalidate_cache()
        base = self.path(rel).rstrip("/") + "/"
        return sorted(p[len(base):] for p in self.fs.find(base.rstrip("/")))
