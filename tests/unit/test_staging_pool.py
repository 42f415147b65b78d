"""The process-wide staging pool behind ``dcp.async_save``: buffers reused by every writer of
the process (a fresh writer per step included), never shared by two saves that overlap,
freed when the layout changes, on request, and never reused after a PROCESS-mode pickle.

Saves are real (local files under ``tmp_path``), and every check that matters reads the
checkpoint back and compares values."""

from __future__ import annotations

import gc
import pickle
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_volumes import VolumeReader, VolumeWriter, release_staging_buffers
from dcp_volumes._compat import no_dist
from dcp_volumes.errors import CheckpointExistsError
from dcp_volumes.saving._staging import _POOL


@pytest.fixture(autouse=True)
def empty_pool() -> Iterator[None]:
    release_staging_buffers()
    gc.collect()
    yield
    release_staging_buffers()


def make_state(seed: float) -> dict[str, Any]:
    return {
        "w": torch.arange(4096, dtype=torch.float32) + seed,
        "opt": {"m": torch.full((64, 32), seed, dtype=torch.float64),
                "steps": [torch.tensor(int(seed)), torch.ones(7, dtype=torch.int32)]},
        "step": int(seed),
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": state["w"].clone(),
            "opt": {"m": state["opt"]["m"].clone(),
                    "steps": [t.clone() for t in state["opt"]["steps"]]},
            "step": state["step"]}


def advance(state: dict[str, Any], by: float) -> None:
    """A training step: values change in place, the layout does not."""
    state["w"].add_(by)
    state["opt"]["m"].mul_(-1.0).add_(by)
    state["opt"]["steps"][0].add_(1)
    state["opt"]["steps"][1].add_(int(by))
    state["step"] += 1


def assert_loads(url: str, expected: dict[str, Any]) -> None:
    out = make_state(-1.0)
    dcp.load(out, storage_reader=VolumeReader(url), **no_dist())
    assert torch.equal(out["w"], expected["w"])
    assert torch.equal(out["opt"]["m"], expected["opt"]["m"])
    for got, want in zip(out["opt"]["steps"], expected["opt"]["steps"]):
        assert torch.equal(got, want)
    assert out["step"] == expected["step"]


def async_save(state: dict[str, Any], url: str, **kw: Any) -> Any:
    return dcp.async_save(state, storage_writer=VolumeWriter(url), **kw, **no_dist())


def a_buffer() -> weakref.ref[torch.Tensor]:
    """A weak reference to a tensor of the pool's (only) idle buffer set."""
    assert _POOL.idle_sets() == 1
    bs = _POOL._idle[0][0]
    return weakref.ref(bs.buffers["w"])


def test_fresh_writer_per_step_reuses_one_buffer_set(tmp_path) -> None:
    state = make_state(1.0)
    before = _POOL.allocations
    expected = []
    for step in range(3):
        expected.append(snapshot(state))
        async_save(state, str(tmp_path / f"step-{step}")).result()
        advance(state, 10.0)
    assert _POOL.allocations - before == 1
    assert _POOL.idle_sets() == 1
    for step, want in enumerate(expected):
        assert_loads(str(tmp_path / f"step-{step}"), want)


def test_one_writer_kept_across_saves_reuses_too(tmp_path) -> None:
    state = make_state(2.0)
    writer = VolumeWriter(str(tmp_path / "step-0"))
    expected = []
    for step in range(3):
        expected.append(snapshot(state))
        dcp.async_save(state, checkpoint_id=str(tmp_path / f"step-{step}"),
                       storage_writer=writer, **no_dist()).result()
        advance(state, 3.0)
    assert writer._staging.allocations == 1
    for step, want in enumerate(expected):
        assert_loads(str(tmp_path / f"step-{step}"), want)


class _HeldPlanner(DefaultSavePlanner):
    """Holds its save in planning until ``go`` is set, so a second save overlaps it."""

    def __init__(self, go: threading.Event) -> None:
        super().__init__()
        self.go = go

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        assert self.go.wait(30)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def test_overlapping_saves_get_distinct_buffers_and_finish_out_of_order(tmp_path) -> None:
    state = make_state(3.0)
    async_save(state, str(tmp_path / "warm")).result()  # one idle set in the pool
    before = _POOL.allocations
    go = threading.Event()
    first_expected = snapshot(state)
    first = async_save(state, str(tmp_path / "first"), planner=_HeldPlanner(go))
    advance(state, 5.0)
    second_expected = snapshot(state)
    # the first save has staged and not read its buffers yet: the second must not share them
    async_save(state, str(tmp_path / "second")).result()
    assert _POOL.allocations - before == 1
    advance(state, 7.0)
    # the second finished first; a third stage must not take the first's buffers either
    third_expected = snapshot(state)
    third = async_save(state, str(tmp_path / "third"))
    third.result()
    assert _POOL.allocations - before == 1  # reused the second's set, not the first's
    go.set()
    first.result()
    assert_loads(str(tmp_path / "first"), first_expected)
    assert_loads(str(tmp_path / "second"), second_expected)
    assert_loads(str(tmp_path / "third"), third_expected)
    assert _POOL.idle_sets() == 1  # bounded: the extra set was freed


def test_layout_change_frees_the_old_sets(tmp_path) -> None:
    state = make_state(4.0)
    async_save(state, str(tmp_path / "a")).result()
    old = a_buffer()
    before = _POOL.allocations
    other = {"x": torch.randn(33, 3), "y": torch.arange(5)}
    expected_other = {k: v.clone() for k, v in other.items()}
    dcp.async_save(other, storage_writer=VolumeWriter(str(tmp_path / "b")), **no_dist()).result()
    gc.collect()
    assert old() is None  # the old layout's buffers are gone
    assert _POOL.allocations - before == 1 and _POOL.idle_sets() == 1
    out = {"x": torch.zeros(33, 3), "y": torch.zeros(5, dtype=torch.int64)}
    dcp.load(out, storage_reader=VolumeReader(str(tmp_path / "b")), **no_dist())
    assert all(torch.equal(out[k], expected_other[k]) for k in out)
    expected = snapshot(state)
    async_save(state, str(tmp_path / "c")).result()  # back to the first layout: allocates
    assert _POOL.allocations - before == 2
    assert_loads(str(tmp_path / "c"), expected)


def test_release_staging_buffers_frees_idle_and_in_flight_sets(tmp_path) -> None:
    state = make_state(5.0)
    async_save(state, str(tmp_path / "a")).result()
    idle = a_buffer()
    release_staging_buffers()
    gc.collect()
    assert idle() is None and _POOL.idle_sets() == 0
    # a set out with a running save is freed when the save ends, not returned
    go = threading.Event()
    expected = snapshot(state)
    held = async_save(state, str(tmp_path / "b"), planner=_HeldPlanner(go))
    release_staging_buffers()
    go.set()
    held.result()
    assert _POOL.idle_sets() == 0
    assert_loads(str(tmp_path / "b"), expected)
    before = _POOL.allocations
    async_save(state, str(tmp_path / "c")).result()
    assert _POOL.allocations - before == 1


def test_writer_close_frees_what_it_staged(tmp_path) -> None:
    state = make_state(6.0)
    writer = VolumeWriter(str(tmp_path / "a"))
    dcp.async_save(state, storage_writer=writer, **no_dist()).result()
    idle = a_buffer()
    VolumeWriter(str(tmp_path / "unrelated")).close()  # staged nothing: frees nothing
    assert _POOL.idle_sets() == 1
    writer.close()
    gc.collect()
    assert idle() is None and _POOL.idle_sets() == 0


def test_writer_close_frees_its_set_while_the_staged_copy_lives(tmp_path) -> None:
    """The save has finished reading, but whoever ran it still holds the staged copy (the
    thread of a finished ``async_save`` drops its arguments only after the future resolves):
    ``close`` must still let go of the set, not wait for that thread."""
    state = make_state(6.5)
    writer = VolumeWriter(str(tmp_path / "a"))
    staged = writer.stage(state)
    expected = snapshot(state)
    dcp.save(staged, storage_writer=writer, **no_dist())  # write_data: finished reading
    idle = a_buffer()
    writer.close()
    gc.collect()
    assert idle() is None and _POOL.idle_sets() == 0
    assert torch.equal(staged["w"], expected["w"])  # the copy itself is untouched
    assert_loads(str(tmp_path / "a"), expected)


def test_pickled_writer_never_reuses(tmp_path) -> None:
    state = make_state(7.0)
    writer = VolumeWriter(str(tmp_path / "a"))
    staged = writer.stage(state)
    pickle.dumps(writer)  # what AsyncCheckpointerType.PROCESS does with every save
    buffer = weakref.ref(staged["w"])
    del staged
    gc.collect()
    assert buffer() is None and _POOL.idle_sets() == 0  # dropped, not returned
    expected = snapshot(state)
    dcp.async_save(state, storage_writer=writer, **no_dist()).result()
    dcp.async_save(state, checkpoint_id=str(tmp_path / "b"), storage_writer=writer,
                   **no_dist()).result()
    assert writer._staging.allocations == 3  # every save of a pickled writer allocates
    assert _POOL.idle_sets() == 0
    assert_loads(str(tmp_path / "a"), expected)
    assert_loads(str(tmp_path / "b"), expected)


def test_failed_save_returns_its_set_only_once_nothing_reads_it(tmp_path) -> None:
    state = make_state(8.0)
    async_save(state, str(tmp_path / "a")).result()
    before = _POOL.allocations
    failed = async_save(state, str(tmp_path / "a"))  # exists: fails in planning
    with pytest.raises(CheckpointException) as info:
        failed.result()
    assert any(isinstance(e, CheckpointExistsError) for e, _ in info.value.failures.values())
    del info
    del failed  # its traceback held the staged tensors
    gc.collect()
    assert _POOL.idle_sets() == 1
    advance(state, 1.0)
    expected = snapshot(state)
    async_save(state, str(tmp_path / "b")).result()
    assert _POOL.allocations == before  # the failed save's set came back and was reused
    assert_loads(str(tmp_path / "b"), expected)


def test_staged_tensors_alive_keep_their_set_out_of_the_pool(tmp_path) -> None:
    """A writer dropped while its staged copy lives: the copy is never overwritten."""
    state = make_state(9.0)
    writer = VolumeWriter(str(tmp_path / "a"))
    staged = writer.stage(state)
    kept = staged["w"].clone()
    del writer
    gc.collect()
    advance(state, 2.0)
    other = VolumeWriter(str(tmp_path / "b")).stage(state)
    assert other["w"].untyped_storage().data_ptr() != staged["w"].untyped_storage().data_ptr()
    assert torch.equal(staged["w"], kept)
    del staged, other
    gc.collect()
    assert _POOL.idle_sets() == 1  # bounded: one idle set, the other freed
