"""Checkpointer: policy, sync and async saves, retention, resume, failures that must surface,
2 ranks, and the kill-and-resume example run through a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcp_volumes import Checkpointer, catalog, errors
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.servers import LocalServer, start_server

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def moto() -> Iterator[LocalServer]:
    server = start_server("moto")
    server.create_bucket("ckpt")
    yield server
    server.stop()


@pytest.fixture(params=["local", "moto"], ids=["local", "moto"])
def where(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict[str, Any]]:
    if request.param == "local":
        return str(tmp_path / "run"), {}
    server: LocalServer = request.getfixturevalue("moto")
    return f"s3://ckpt/{uuid.uuid4().hex[:12]}", server.storage_options()


def state_at(step: int) -> dict[str, Any]:
    return {"w": torch.full((3, 4), float(step)), "extra": {"step": step}}


# --------------------------------------------------------------------------------------------
# policy and options (no storage touched)


@pytest.mark.parametrize(
    ("kwargs", "due"),
    [
        ({}, [1, 2, 3, 4, 5, 6]),
        ({"every_steps": 3}, [3, 6]),
        ({"every_steps": 2, "every_seconds": 3600}, [2, 4, 6]),
        ({"every_seconds": 3600}, []),
    ],
    ids=["no-policy-saves-always", "every-3-steps", "steps-or-long-time", "long-time-only"],
)
def test_should_save_policy(tmp_path, kwargs: dict[str, Any], due: list[int]) -> None:
    ckpt = Checkpointer(str(tmp_path), **kwargs)
    assert [s for s in range(1, 7) if ckpt.should_save(s)] == due


def test_should_save_every_seconds(tmp_path) -> None:
    # a fake clock: a real 0.2 s cadence failed under load (a descheduled thread is late)
    now = [100.0]
    ckpt = Checkpointer(str(tmp_path / "run"), every_seconds=0.2, clock=lambda: now[0])
    assert not ckpt.should_save(1)
    now[0] += 0.25
    assert ckpt.should_save(2)
    assert ckpt.save(2, state_at(2))
    assert not ckpt.should_save(2)  # just saved this step
    assert not ckpt.should_save(3)  # the clock restarted with the save
    ckpt.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_steps": 0}, "every_steps"),
        ({"every_seconds": -1}, "every_seconds"),
        ({"keep_last": 0}, "keep_last"),
        ({"transfer": {"part_size": 1 << 20}}, "must be a TransferOptions"),
        ({"step_format": "ckpt"}, "does not parse back"),
        ({"step_format": "ckpt-{step}"}, "does not parse back"),
        ({"step_format": "{stp}"}, "format string"),
    ],
    ids=[
        "every-steps-0",
        "every-seconds-negative",
        "keep-last-0",
        "untyped-transfer-options",
        "format-without-step",
        "format-pattern-mismatch",
        "format-bad-field",
    ],
)
def test_bad_options_fail_at_construction(tmp_path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.ConfigError, match=match):
        Checkpointer(str(tmp_path), **kwargs)


def test_custom_step_format_round_trips(tmp_path) -> None:
    ckpt = Checkpointer(
        str(tmp_path / "run"), step_format="ckpt-{step}", step_pattern=r"^ckpt-(\d+)$", keep_last=1
    )
    for step in (1, 2):
        ckpt.save(step, state_at(step))
    ckpt.close()
    assert ckpt.url_for(2) == str(tmp_path / "run" / "ckpt-2")
    assert [
        i.name for i in catalog.list_checkpoints(tmp_path / "run", step_pattern=r"^ckpt-(\d+)$")
    ] == ["ckpt-2"]


# --------------------------------------------------------------------------------------------
# save, retention, resume


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_retain_and_resume(where: tuple[str, dict[str, Any]], async_save: bool) -> None:
    root, options = where
    ckpt = Checkpointer(
        root, storage_options=options, every_steps=2, keep_last=2, async_save=async_save
    )
    started = [ckpt.save(step, state_at(step)) for step in range(1, 8)]
    ckpt.close()
    assert started == [False, True, False, True, False, True, False]
    infos = catalog.list_checkpoints(root, storage_options=options)
    assert [(i.name, i.complete) for i in infos] == [
        ("step-00000004", True),
        ("step-00000006", True),
    ]

    resumed = Checkpointer(root, storage_options=options, every_steps=2)
    target = state_at(0)
    assert resumed.load_latest(target) == 6
    assert torch.equal(target["w"], state_at(6)["w"]) and target["extra"]["step"] == 6
    assert resumed.last_step == 6 and not resumed.should_save(6)
    assert resumed.save(7, state_at(7), force=True)  # force: outside the policy
    resumed.close()


def flip_a_byte(url: str, options: dict[str, Any]) -> None:
    """Flip one byte of the checkpoint's first shard file, behind the writer's back."""
    import fsspec

    fs, path = fsspec.url_to_fs(url, skip_instance_cache=True, **options)
    shard = min(p for p in fs.find(path) if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[5] ^= 0x01
    fs.pipe_file(shard, bytes(data))


def test_resume_skips_a_damaged_newest_checkpoint(where: tuple[str, dict[str, Any]],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # issue 25, finding 10: a flipped byte in the newest checkpoint stopped the resume
    root, options = where
    with Checkpointer(root, storage_options=options) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state_at(step))
    flip_a_byte(f"{root}/step-00000003", options)
    assert catalog.latest(root, storage_options=options).step == 3  # cheap: still complete
    target = state_at(0)
    resumed = Checkpointer(root, storage_options=options)
    with caplog.at_level("WARNING", logger="dcp_volumes"):
        assert resumed.load_latest(target) == 2
    assert torch.equal(target["w"], state_at(2)["w"]) and target["extra"]["step"] == 2
    skipped = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("step-00000003" in m and "damaged" in m and "checksum" in m.lower()
               for m in skipped), skipped
    # the run reaches step 3 again: its save replaces the damaged one (it was refused as
    # "Checkpoint already exists" on every retry: complete, but skipped at resume)
    assert resumed.save(3, state_at(33), force=True)
    resumed.close()
    again = state_at(0)
    assert Checkpointer(root, storage_options=options).load_latest(again) == 3
    assert torch.equal(again["w"], state_at(33)["w"]) and again["extra"]["step"] == 33
    # nothing verifies: the newest one's error, typed
    flip_a_byte(f"{root}/step-00000003", options)
    flip_a_byte(f"{root}/step-00000002", options)
    flip_a_byte(f"{root}/step-00000001", options)
    with pytest.raises(errors.IntegrityError, match="step-00000003"):
        Checkpointer(root, storage_options=options).load_latest(state_at(0))


def test_a_second_run_on_the_root_is_refused(moto: LocalServer) -> None:
    # issue 25, finding 10: two runs on one root replaced each other's checkpoints
    root, options = f"s3://ckpt/{uuid.uuid4().hex[:12]}", moto.storage_options()
    first = Checkpointer(root, storage_options=options, run_id="first")
    assert first.save(1, state_at(1))
    second = Checkpointer(root, storage_options=options, run_id="second")
    with pytest.raises(errors.RootInUseError, match="held by another run: run 'first'"):
        second.save(1, state_at(100), force=True)
    assert [i.step for i in catalog.list_checkpoints(root, storage_options=options)] == [1]
    first.close()  # releases the root
    assert second.save(2, state_at(2))
    second.close()


def test_load_latest_with_nothing_saved(tmp_path) -> None:
    ckpt = Checkpointer(str(tmp_path / "empty"))
    target = state_at(0)
    assert ckpt.load_latest(target) is None
    assert torch.equal(target["w"], state_at(0)["w"])


def test_async_save_returns_before_the_upload_ends(where: tuple[str, dict[str, Any]]) -> None:
    root, options = where
    ckpt = Checkpointer(root, storage_options=options, async_save=True)
    state = state_at(1)
    assert ckpt.save(1, state)
    state["w"].fill_(99.0)  # staged already: changing it now must not change the checkpoint
    ckpt.wait()
    loaded = state_at(0)
    assert Checkpointer(root, storage_options=options).load_latest(loaded) == 1
    assert torch.equal(loaded["w"], state_at(1)["w"])
    ckpt.close()


# --------------------------------------------------------------------------------------------
# failures surface, never swallowed


def remove_bucket(server: LocalServer, bucket: str) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options())
    if fs.exists(f"{bucket}/run"):
        fs.rm(f"{bucket}/run", recursive=True)
    fs.rmdir(bucket)


def test_missing_bucket_fails_at_construction(moto: LocalServer) -> None:
    # issue 25, finding 10: it surfaced only at the first save
    with pytest.raises(errors.BucketNotFoundError, match="no-such-bucket.*create it"):
        Checkpointer("s3://no-such-bucket/run", storage_options=moto.storage_options())


@pytest.mark.parametrize(
    "surfaced_by", ["next-save", "wait", "close"], ids=["next-save", "wait", "close"]
)
def test_failed_background_save_surfaces(moto: LocalServer, surfaced_by: str) -> None:
    # (the bucket is removed after construction, which checks that it exists)
    bucket = f"gone-{uuid.uuid4().hex[:8]}"
    moto.create_bucket(bucket)
    ckpt = Checkpointer(
        f"s3://{bucket}/run", storage_options=moto.storage_options(), async_save=True
    )
    ckpt.claim()  # the root's lease is taken: the save's first request is its upload
    remove_bucket(moto, bucket)
    assert ckpt.save(1, state_at(1))  # returns at once; the upload fails in the background
    # The typed error behind DCP's CheckpointException (kept as its context).
    with pytest.raises(errors.BucketNotFoundError) as info:
        if surfaced_by == "next-save":
            ckpt.save(2, state_at(2))
        elif surfaced_by == "wait":
            ckpt.wait()
        else:
            ckpt.close()
    assert isinstance(info.value.__context__, CheckpointException)
    assert any("background save of step 1" in n for n in info.value.__notes__)
    if surfaced_by != "close":
        ckpt.wait()  # reported once; nothing pending any more
        ckpt.close()


def test_failed_sync_save_raises_at_once(moto: LocalServer) -> None:
    bucket = f"gone-{uuid.uuid4().hex[:8]}"
    moto.create_bucket(bucket)
    ckpt = Checkpointer(f"s3://{bucket}/run", storage_options=moto.storage_options())
    ckpt.claim()
    remove_bucket(moto, bucket)
    with pytest.raises(errors.BucketNotFoundError) as info:
        ckpt.save(1, state_at(1))
    assert isinstance(info.value.__context__, CheckpointException)
    ckpt.close()


def test_closed_checkpointer_refuses_work(tmp_path) -> None:
    ckpt = Checkpointer(str(tmp_path / "run"))
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(errors.DCPVolumesError, match="closed"):
        ckpt.save(1, state_at(1))


# --------------------------------------------------------------------------------------------
# two ranks


def _two_rank_run(rank: int, world_size: int, root: str, options: dict[str, Any]) -> dict[str, Any]:
    ckpt = Checkpointer(root, storage_options=options, every_steps=2, keep_last=2, async_save=True)
    for step in range(1, 7):
        ckpt.save(step, state_at(step))
    ckpt.close()
    resumed = Checkpointer(root, storage_options=options)
    target = state_at(0)
    before = catalog._listing.listings_made()
    step = resumed.load_latest(target)
    listings = catalog._listing.listings_made() - before
    resumed.close()
    # every_seconds: rank 0's clock decides for all. Rank 1's own clock says "due", rank 0's not.
    timed = Checkpointer(root, storage_options=options, every_seconds=1.5)
    if rank == 1:
        time.sleep(1.7)
    due = timed.should_save(7)
    return {"step": step, "w": float(target["w"].sum()), "listings": listings, "due": due}


def test_two_ranks_async_save_retain_and_resume(moto: LocalServer) -> None:
    root = f"s3://ckpt/{uuid.uuid4().hex[:12]}"
    out = run_ranks(2, _two_rank_run, root, moto.storage_options())
    assert [o["step"] for o in out] == [6, 6]
    assert [o["w"] for o in out] == [72.0, 72.0]
    assert sum(o["listings"] for o in out) == 1  # resume listed once for both ranks
    assert [o["due"] for o in out] == [False, False]
    infos = catalog.list_checkpoints(root, storage_options=moto.storage_options())
    assert [i.name for i in infos] == ["step-00000004", "step-00000006"]
    assert all(i.complete for i in infos)


# --------------------------------------------------------------------------------------------
# the example: kill, resume, same losses


def _run_example(*args: str) -> subprocess.CompletedProcess[str]:
    # A session of its own: the example SIGKILLs its ranks, never this process.
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_resume.py"), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def _losses(output: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step (\d+) loss (\S+)$", output, re.MULTILINE)}


def test_example_kill_and_resume_keeps_the_loss_curve(tmp_path) -> None:
    common = ["--steps", "9", "--save-every", "3"]
    reference = _run_example("--root", str(tmp_path / "reference"), *common)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = _run_example("--root", str(tmp_path / "run"), *common, "--kill-at-step", "6")
    assert killed.returncode == 128 + 9, killed.stderr[-3000:]
    assert max(_losses(killed.stdout)) == 6, killed.stdout
    resumed = _run_example("--root", str(tmp_path / "run"), *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    match = re.search(r"^resumed from step (\d+)$", resumed.stdout, re.MULTILINE)
    assert match is not None, resumed.stdout
    start = int(match.group(1))
    assert start in (3, 6)  # step 3 committed before step 6's save began; 6 may not have
    ref, got = _losses(reference.stdout), _losses(resumed.stdout)
    assert sorted(ref) == list(range(1, 10))
    assert sorted(got) == list(range(start + 1, 10)), resumed.stdout
    assert all(got[s] == ref[s] for s in got), (reference.stdout, resumed.stdout)
