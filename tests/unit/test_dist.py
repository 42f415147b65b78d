"""The shared process-group helpers (``_dist``) on a one-rank gloo group in this process:
a status every rank agrees on, the failing rank's own error, bounded waits."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dcp_volumes import _dist, errors


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tmp_path / 'store'}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _agree(err: BaseException | None, code: int = _dist.OK) -> int:
    return _dist.agree(err, group=None, world=1, me=0, timeout_s=10, task="testing",
                       step="step 1", code=code)


def test_agree_returns_the_highest_status(one_rank: None) -> None:
    assert _agree(None) == _dist.OK
    assert _agree(None, _dist.FALLBACK) == _dist.FALLBACK


def test_the_failing_rank_raises_its_own_error(one_rank: None) -> None:
    own = errors.IntegrityError("checksum mismatch in shard x")
    with pytest.raises(errors.IntegrityError) as info:
        _agree(own)
    assert info.value is own


def test_wait_all_names_the_work_that_failed() -> None:
    class _Work:  # a torch Work whose peer never answers
        def __init__(self, ok: bool) -> None:
            self.ok = ok

        def wait(self, timeout: datetime.timedelta) -> bool:
            if not self.ok:
                raise RuntimeError(f"timed out after {timeout.total_seconds():.0f}s")
            return True

    def fail(i: int, exc: RuntimeError) -> errors.DownloadError:
        return errors.DownloadError(f"work {i}: {exc}")

    _dist.wait_all([_Work(True)], 1.0, fail)
    with pytest.raises(errors.DownloadError, match="work 1: timed out"):
        _dist.wait_all([_Work(True), _Work(False)], 1.0, fail)
    with pytest.raises(RuntimeError, match="timed out"):
        _dist.wait_all([_Work(False)], 1.0)


def test_uint8_tensor_is_a_view() -> None:
    buf = bytearray(b"\x01\x02\x03")
    t = _dist.uint8_tensor(buf)
    t[0] = 9
    assert buf[0] == 9 and t.dtype == torch.uint8
