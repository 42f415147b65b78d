"""A step whose ``.metadata`` is not a regular object (issue 37, finding 2).

A directory, a FIFO or a symbolic link where a step's ``.metadata`` belongs (local disk), or
a stray key under ``step-N/.metadata/`` (object stores: ``.metadata`` is then a prefix with
keys under it, not an object), makes the step incomplete by the one definition
(:mod:`dcp_volumes._complete`): ``ls`` and ``latest`` skip it, ``load_latest`` resumes the
step before, and a new save of that step replaces it (before: ``CheckpointExistsError``, or
``UnsafeCheckpointError`` for a link, at every restart). The replacement removes the entry
itself -- never what a link points to, never anything outside the step.

The odd entries are made behind the code's back with ``os`` calls (local) and raw fsspec
calls (moto and SeaweedFS, the session's servers from tests/conftest.py).
"""

from __future__ import annotations

import os
import pickle
import threading
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _run_root import RunRoot
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import Checkpointer, VolumeWriter, _layout, catalog, errors
from dcp_volumes._commit_read import NOT_REGULAR
from dcp_volumes._compat import no_dist
from dcp_volumes._complete import completeness
from dcp_volumes.backends import open_backend
from dcp_volumes.testing.suite import failures_of

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state_of(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((32, 16), value) for i in range(2)}


class Run(RunRoot):
    """A run root, raw access to it, and a place outside it (what a link may point to)."""

    shape = (32, 16)

    def __init__(self, root: str, options: dict[str, Any], outside: Path) -> None:
        super().__init__(root, options)
        self.outside = outside

    def snapshot(self, rels: list[str]) -> dict[str, bytes]:
        """Every object of the steps ``rels`` (and every file outside the root) with its
        bytes: what a replacement of another step must leave exactly as it was."""
        out = {f"outside/{p.name}": p.read_bytes() for p in sorted(self.outside.iterdir())}
        for rel in rels:
            for name in self.names(rel):
                out[f"{rel}/{name}"] = bytes(self.fs.cat_file(self.path(f"{rel}/{name}")))
        return out


def statuses(run: Run) -> dict[str, str]:
    return {i.name: i.status
            for i in catalog.list_checkpoints(run.root, storage_options=run.options)}


# --------------------------------------------------------------------------------------------
# What is put where .metadata belongs (after the real .metadata is removed)


def _directory(run: Run, rel: str) -> None:
    path = run.path(f"{rel}/.metadata")
    os.mkdir(path)
    Path(path, "inside").write_bytes(b"a file under the directory")
    os.mkdir(os.path.join(path, "sub"))
    Path(path, "sub", "deeper").write_bytes(b"deeper")


def _empty_directory(run: Run, rel: str) -> None:
    os.mkdir(run.path(f"{rel}/.metadata"))


def _fifo(run: Run, rel: str) -> None:
    os.mkfifo(run.path(f"{rel}/.metadata"))


def _link_out(run: Run, rel: str) -> None:
    os.symlink(run.outside / "target", run.path(f"{rel}/.metadata"))


def _link_to_another_step(run: Run, rel: str) -> None:
    os.symlink(run.path("step-00000002/.metadata"), run.path(f"{rel}/.metadata"))


def _relative_link_to_another_step(run: Run, rel: str) -> None:
    os.symlink("../step-00000002/.metadata", run.path(f"{rel}/.metadata"))


def _link_to_a_directory_out(run: Run, rel: str) -> None:
    os.symlink(run.outside, run.path(f"{rel}/.metadata"))


def _dangling_link(run: Run, rel: str) -> None:
    os.symlink(run.outside / "nothing-here", run.path(f"{rel}/.metadata"))


def _directory_with_a_link_out(run: Run, rel: str) -> None:
    path = run.path(f"{rel}/.metadata")
    os.mkdir(path)
    os.symlink(run.outside / "target", os.path.join(path, "link"))
    os.symlink(run.outside, os.path.join(path, "dirlink"))


def _stray_key(run: Run, rel: str) -> None:
    run.fs.pipe_file(run.path(f"{rel}/.metadata/stray"), b"one stray key")


LOCAL_CASES: dict[str, Callable[[Run, str], None]] = {
    "directory": _directory,
    "empty-directory": _empty_directory,
    "fifo": _fifo,
    "link-out": _link_out,
    "link-to-another-step": _link_to_another_step,
    "relative-link-to-another-step": _relative_link_to_another_step,
    "link-to-a-directory-out": _link_to_a_directory_out,
    "dangling-link": _dangling_link,
    "directory-with-links-out": _directory_with_a_link_out,
}


CASES = [pytest.param(("local", name), id=f"local-{name}") for name in LOCAL_CASES]
CASES += [pytest.param((server, "stray-key"), id=f"{server}-stray-key")
          for server in ("moto", "seaweedfs")]
#: the writer's replacement on Azure too (the Checkpointer's: S3 is enough). Not on
#: fake-gcs-server: its filesystem backend keeps the directory a deleted ``.metadata/stray``
#: leaves on its own disk, which no API call removes, and then fails every write of
#: ``.metadata`` with a 500 ("rename ...: file exists"), even a first save's; real GCS has
#: no directories
WRITER_CASES = [*CASES, pytest.param(("azurite", "stray-key"), id="azurite-stray-key")]


def _spoil(run: Run, rel: str, case: str) -> None:
    run.fs.rm_file(run.path(f"{rel}/.metadata"))
    (_stray_key if case == "stray-key" else LOCAL_CASES[case])(run, rel)


#: how the one definition names what stands there, in each case
KIND = {"directory": "is a directory", "empty-directory": "is a directory",
        "fifo": "is a FIFO", "link-out": "is a link", "link-to-another-step": "is a link",
        "relative-link-to-another-step": "is a link", "dangling-link": "is a link",
        "link-to-a-directory-out": "is a link",
        "directory-with-links-out": "is a directory",
        "stray-key": "is a prefix with keys under it"}


def leftovers(run: Run, rel: str) -> list[str]:
    """What of the odd entry, or of a replacement's claim, is still in the step."""
    return [n for n in run.names(rel) if n.startswith(".metadata/") or ".replacing-" in n]


@pytest.fixture
def spoiled(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Run, str]:
    where, case = request.param
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"precious bytes outside the checkpoint")
    if where == "local":
        return Run(str(tmp_path / "run"), {}, outside), case
    server = request.getfixturevalue(where)
    return Run(f"{server.root}/{uuid.uuid4().hex[:12]}", server.server.storage_options(),
               outside), case


#: the steps a replacement of step 3 must leave as they were
UNTOUCHED = ["step-00000001", "step-00000002"]


def verifies(run: Run, rel: str) -> bool:
    try:
        return catalog.verify(run.url(rel), storage_options=run.options).ok
    except errors.DCPVolumesError:
        return False


@pytest.mark.parametrize("spoiled", CASES, indirect=True)
def test_the_checkpointer_resumes_past_the_step_and_saves_it_again(
        spoiled: tuple[Run, str]) -> None:
    run, case = spoiled
    ckpt = Checkpointer(run.root, storage_options=run.options, every_steps=1)
    for step in (1, 2, 3):
        ckpt.save(step, state_of(float(step)))
    ckpt.close()
    _spoil(run, "step-00000003", case)
    before = run.snapshot(UNTOUCHED)

    assert statuses(run) == {"step-00000001": "complete", "step-00000002": "complete",
                             "step-00000003": "incomplete"}
    found = completeness(open_backend(run.url("step-00000003"), run.options))
    assert (found.state, found.version) == ("damaged", NOT_REGULAR)
    assert KIND[case] in (found.problem or ""), found.problem
    info = catalog.latest(run.root, storage_options=run.options)
    assert info is not None and info.name == "step-00000002"

    again = Checkpointer(run.root, storage_options=run.options, every_steps=1)
    state = state_of(0.0)
    assert again.load_latest(state) == 2 and float(state["t0"][0, 0]) == 2.0
    assert again.save(3, state_of(7.0))  # was CheckpointExistsError / UnsafeCheckpointError
    again.close()

    assert statuses(run)["step-00000003"] == "complete"
    third = Checkpointer(run.root, storage_options=run.options, every_steps=1)
    assert third.load_latest(state) == 3 and float(state["t0"][0, 0]) == 7.0
    third.close()
    assert run.snapshot(UNTOUCHED) == before  # what a link pointed to: untouched
    assert not leftovers(run, "step-00000003")


@pytest.mark.parametrize("spoiled", WRITER_CASES, indirect=True)
def test_a_volume_writer_save_replaces_the_step(spoiled: tuple[Run, str]) -> None:
    run, case = spoiled
    for step in (1, 2, 3):
        run.save(f"step-0000000{step}", float(step))
    _spoil(run, "step-00000003", case)
    before = run.snapshot(UNTOUCHED)
    assert not verifies(run, "step-00000003")  # verify agrees with ls

    run.save("step-00000003", 9.0)  # default overwrite=False

    assert run.load("step-00000003") == 9.0
    assert statuses(run) == {f"step-0000000{s}": "complete" for s in (1, 2, 3)}
    assert run.snapshot(UNTOUCHED) == before
    assert run.load("step-00000002") == 2.0
    assert not leftovers(run, "step-00000003")
    assert verifies(run, "step-00000003")


OVERWRITES = [pytest.param(("local", name), id=f"local-{name}")
              for name in ("directory", "fifo", "link-out", "link-to-another-step")]
OVERWRITES += [pytest.param((server, "stray-key"), id=f"{server}-stray-key")
               for server in ("moto", "seaweedfs")]


@pytest.mark.parametrize("spoiled", OVERWRITES, indirect=True)
def test_a_save_with_overwrite_replaces_the_step(spoiled: tuple[Run, str]) -> None:
    run, case = spoiled
    for step in (1, 2, 3):
        run.save(f"step-0000000{step}", float(step))
    _spoil(run, "step-00000003", case)
    before = run.snapshot(UNTOUCHED)

    dcp.save(state_of(4.0), **no_dist(), storage_writer=VolumeWriter(
        run.url("step-00000003"), storage_options=run.options, overwrite=True))

    assert run.load("step-00000003") == 4.0
    assert statuses(run) == {f"step-0000000{s}": "complete" for s in (1, 2, 3)}
    assert run.snapshot(UNTOUCHED) == before


def test_a_hard_link_to_another_steps_metadata_is_replaced_not_written_through(
        tmp_path: Path) -> None:
    """A hard link is a regular file: the step is damaged (its manifest is another step's
    and not in it) and a save replaces the entry, never the file both names share."""
    (tmp_path / "outside").mkdir()
    run = Run(str(tmp_path / "run"), {}, tmp_path / "outside")
    for step in (1, 2):
        run.save(f"step-0000000{step}", float(step))
    os.makedirs(run.path("step-00000003"))
    os.link(run.path("step-00000002/.metadata"), run.path("step-00000003/.metadata"))
    before = run.snapshot(["step-00000002"])
    assert statuses(run)["step-00000003"] == "unreadable"

    run.save("step-00000003", 3.0)

    assert run.load("step-00000003") == 3.0
    assert run.snapshot(["step-00000002"]) == before and run.load("step-00000002") == 2.0
    assert os.stat(run.path("step-00000002/.metadata")).st_nlink == 1


class _PausedWriter(VolumeWriter):
    """Plans (and sees the odd .metadata), then waits before its commit."""

    planned = threading.Event()
    go = threading.Event()

    def finish(self, metadata: Any, results: Any) -> None:
        type(self).planned.set()
        assert type(self).go.wait(60)
        super().finish(metadata, results)


RACES = [pytest.param(("local", "directory"), id="local-directory"),
         pytest.param(("local", "link-to-another-step"), id="local-link-to-another-step"),
         pytest.param(("moto", "stray-key"), id="moto-stray-key"),
         pytest.param(("seaweedfs", "stray-key"), id="seaweedfs-stray-key")]


@pytest.mark.parametrize("spoiled", RACES, indirect=True)
def test_of_two_saves_replacing_the_step_exactly_one_commits(spoiled: tuple[Run, str]) -> None:
    run, case = spoiled
    for step in (1, 2, 3):
        run.save(f"step-0000000{step}", float(step))
    _spoil(run, "step-00000003", case)
    before = run.snapshot(UNTOUCHED)
    paused = type("W", (_PausedWriter,), {"planned": threading.Event(), "go": threading.Event()})
    failed: list[BaseException] = []

    def slow() -> None:
        try:
            run.save("step-00000003", 5.0, writer=paused)
        except CheckpointException as exc:
            failed.extend(failures_of(exc))

    thread = threading.Thread(target=slow)
    thread.start()
    try:
        assert paused.planned.wait(60)
        run.save("step-00000003", 6.0)  # replaces the odd entry first
    finally:
        paused.go.set()
        thread.join(60)

    (err,) = failed
    assert isinstance(err, errors.CheckpointExistsError), err
    assert run.load("step-00000003") == 6.0  # entirely the winner's save
    assert statuses(run)["step-00000003"] == "complete"
    winner = pickle.loads(run.fs.cat_file(run.path("step-00000003/.metadata")))
    ids = {_layout.save_id_of(n) for n in run.names("step-00000003")} - {None}
    assert winner.storage_meta.save_id in ids
    assert run.snapshot(UNTOUCHED) == before
