"""The resume loop every integration uses (checkpointer/_fallback.load_newest) and the
nesting of a whole checkpoint read back for Lightning's CheckpointIO
(integrations/_full_state): pure parts, no storage."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dcp_volumes import catalog, errors
from dcp_volumes.checkpointer import load_newest
from dcp_volumes.integrations._full_state import _nested


def info(step: int) -> catalog.CheckpointInfo:
    return catalog.CheckpointInfo(f"memory://r/step-{step}", f"step-{step}", step, "complete",
                                  1, 1, None, None)


def test_first_that_verifies_wins_and_the_skipped_are_named(
        caplog: pytest.LogCaptureFixture) -> None:
    tried: list[int] = []

    def load(i: catalog.CheckpointInfo) -> str:
        tried.append(i.step or 0)
        if i.step and i.step > 2:
            raise errors.IntegrityError(f"checksum mismatch in step {i.step}")
        return f"loaded {i.step}"

    with caplog.at_level(logging.WARNING):
        got = load_newest(iter([info(4), info(3), info(2), info(1)]), load)
    assert got is not None and got[0].step == 2 and got[1] == "loaded 2"
    assert tried == [4, 3, 2]  # the older ones are never asked for
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "step-4" in warned[0] and "checksum mismatch" in warned[0]


def test_nothing_verifies_raises_the_newest_error_and_nothing_found_is_none() -> None:
    def load(i: catalog.CheckpointInfo) -> None:
        raise errors.IntegrityError(f"bad {i.step}")

    with pytest.raises(errors.IntegrityError, match="bad 2"):
        load_newest(iter([info(2), info(1)]), load)
    assert load_newest(iter([]), load) is None


@pytest.mark.parametrize("error", [errors.StoragePermissionError("refused"),
                                   errors.UnsafeCheckpointError("class not allowed")],
                         ids=["credentials", "not-allowed"])
def test_other_errors_are_raised_at_once(error: Exception) -> None:
    tried: list[int] = []

    def load(i: catalog.CheckpointInfo) -> None:
        tried.append(i.step or 0)
        raise error

    with pytest.raises(type(error)):
        load_newest(iter([info(2), info(1)]), load)
    assert tried == [2]


def test_an_error_after_loading_is_never_retried() -> None:
    began = {"v": False}

    def train(i: catalog.CheckpointInfo) -> None:
        began["v"] = True  # loaded: training runs
        raise errors.IntegrityError("raised by something later")

    with pytest.raises(errors.IntegrityError, match="later"):
        load_newest(iter([info(2), info(1)]), train, while_loading=lambda: not began["v"])


def test_nested_rebuilds_dicts_and_lists_as_flattened() -> None:
    flat: dict[str, Any] = {"a.x": 1, "o.0.state.0.step": 2, "o.0.groups.0.lr": 3, "o.0.groups.1": 4}
    paths = {"a.x": ("a", "x"), "o.0.state.0.step": ("o", 0, "state", "0", "step"),
             "o.0.groups.0.lr": ("o", 0, "groups", 0, "lr"), "o.0.groups.1": ("o", 0, "groups", 1)}
    assert _nested(flat, paths, "u") == {
        "a": {"x": 1}, "o": [{"state": {"0": {"step": 2}}, "groups": [{"lr": 3}, 4]}]}


@pytest.mark.parametrize("paths", [
    {"k": ()}, {"k": "k"}, {"k": (0,)}, {"k": ("a", 10**12)}, {"k": ("a", -1)},
    {"k": ("a", True)}, {"k": ("a", 1.5)},
], ids=["empty", "not-a-tuple", "starts-with-index", "huge-index", "negative", "bool", "float"])
def test_nested_refuses_crafted_paths(paths: dict[str, Any]) -> None:
    with pytest.raises(errors.IntegrityError, match="not a path"):
        _nested({"k": 1}, paths, "u")


def test_nested_refuses_colliding_paths() -> None:
    with pytest.raises(errors.IntegrityError, match="collide"):
        _nested({"a": 1, "b": 2}, {"a": ("x",), "b": ("x", "y")}, "u")
