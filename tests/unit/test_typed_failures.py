# moved verbatim from tests/unit/test_hardening.py (split by subject, issue 24)
"""Bad input and unreachable stores fail clearly, as typed errors (issue 10): a deadline bounds
a request to a store that never answers (a loopback "tarpit" socket stands in for it), a
missing manifest gives no advice to skip verification, and the load and save helpers raise
the typed error that ``dcp.load`` / ``dcp.save`` hide.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_volumes
from dcp_volumes import (
    RetryOptions,
    VolumeReader,
    VolumeWriter,
    errors,
)
from dcp_volumes._compat import no_dist


# a copy of the helper in tests/unit/test_untrusted_reads.py
def _state(extra: object) -> dict[str, object]:
    return {"w": torch.arange(16, dtype=torch.float32), "extra": extra}


# ---- 8. deadlines, advice, typed errors, dead spools ---------------------------------------
@pytest.fixture
def tarpit() -> Iterator[str]:
    """An endpoint that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                held.append(conn)
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def test_deadline_bounds_a_request_to_a_store_that_never_answers(tarpit: str) -> None:
    opts = {"endpoint_url": tarpit, "key": "k", "secret": "s"}
    retry = RetryOptions(deadline_s=3.0, max_attempts=50, initial_backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(errors.DCPVolumesError):
        dcp_volumes.save({"w": torch.ones(4)}, "s3://bucket/run/step-1", storage_options=opts,
                         retry=retry, no_dist=True)
    # botocore's own read timeout is 60 s a request: only the deadline ends it this early
    assert time.monotonic() - start < 30


def test_missing_manifest_gives_no_advice_to_skip_verification(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=VolumeWriter(str(url)), **no_dist())
    for f in url.glob(".dcpv-manifest-*"):
        f.unlink()
    with pytest.raises(errors.IntegrityError) as info:
        VolumeReader(str(url)).read_metadata()
    assert "verify=False" not in str(info.value)


@pytest.mark.parametrize("state", ["nothing", "incomplete"])
def test_load_helper_raises_the_typed_error(tmp_path: Path, state: str) -> None:
    url = tmp_path / "ckpt"
    expected: type[errors.DCPVolumesError] = errors.CheckpointNotFoundError
    if state == "incomplete":
        url.mkdir()
        (url / "__0_0.distcp").write_bytes(b"x")
        expected = errors.IncompleteCheckpointError
    with pytest.raises(expected):
        dcp_volumes.load(_state(None), str(url), no_dist=True)
    reader = VolumeReader(str(url))
    with pytest.raises((AssertionError, CheckpointException)) as plain:  # dcp.load hides it,
        dcp.load(_state(None), storage_reader=reader, **no_dist())
    assert not isinstance(plain.value, errors.DCPVolumesError)
    assert isinstance(reader.last_error, expected)  # ... the reader keeps it


def test_save_helper_raises_the_typed_error(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dcp_volumes.save(_state(1), url, no_dist=True)
    with pytest.raises(errors.CheckpointExistsError):
        dcp_volumes.save(_state(2), url, no_dist=True)
