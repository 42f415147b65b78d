"""torch_checkpointing's CheckpointManager on SeaweedFS through VolumeStorage: save on 2
ranks, end the processes, load bit-identical; a save killed before its commit stays
invisible; a retry commits only its own files; committed bytes are never overwritten; the
commit record is untrusted input; and the library still commits by a directory rename."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pickle
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_reader import CheckpointReader
from torch_checkpointing.checkpoint_writer import (
    CallbackArgs,
    CheckpointWriter,
    CheckpointWriterConfig,
)
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.metadata_manager import DefaultMetadataManager

from dcp_volumes import errors
from dcp_volumes.integrations.torch_checkpointing import (
    COMMIT_NAME,
    VolumeStorage,
    VolumeStorageConfig,
    manager_config,
    record_rank_files,
    resume_path,
)
from dcp_volumes.testing.dist import run_ranks, run_ranks_with_victim

pytestmark = pytest.mark.xdist_group("torch_checkpointing")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def payload(rank: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return {"model": {"w": torch.randn(1536, 1024, generator=g),  # 6 MiB: 2 parts of 5 MiB
                      "b": torch.randn(17, generator=g).to(torch.bfloat16)},
            "step": seed}


def blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(1536, 1024), "b": torch.zeros(17, dtype=torch.bfloat16)},
            "step": None}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return (got["step"] == want["step"]
            and all(torch.equal(got["model"][k], v) for k, v in want["model"].items()))


def config(root: str, opts: dict[str, Any], *, sync: bool = True, barrier_s: int = 600,
           **fields: Any) -> CheckpointManager.Config:
    writer = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=barrier_s)
    save = (SyncCheckpointSaverConfig(writer_config=writer) if sync
            else AsyncCheckpointSaverConfig(writer_config=writer))
    return manager_config(root, storage_options=opts, save=save,
                          storage={"part_size": 5 << 20}, **fields)


def _save_rank(rank: int, world: int, root: str, opts: dict[str, Any], name: str, seed: int
               ) -> bool:
    manager = CheckpointManager(config(root, opts))
    manager.save(name, payload(rank, seed))
    manager.close()
    return True


def _load_rank(rank: int, world: int, root: str, opts: dict[str, Any], name: str, seed: int
               ) -> bool:
    manager = CheckpointManager(config(root, opts))
    ok = same(dict(manager.load(name, into=blank())), payload(rank, seed))
    manager.close()
    return ok


def _die_after_record(args: CallbackArgs) -> None:
    """Rank 1: its files and its record are durable, then it is killed before the commit."""
    record_rank_files(args)
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def _killed_save_rank(rank: int, world: int, root: str, opts: dict[str, Any], name: str
                      ) -> str:
    cfg = config(root, opts, barrier_s=2)
    cfg.pre_finalize_callback = _die_after_record
    manager = CheckpointManager(cfg)
    try:
        manager.save(name, {**payload(rank, 1), f"extra_{rank}": torch.ones(3)})
    except Exception as exc:  # noqa: BLE001 — rank 0: the barrier times out, nothing commits
        return type(exc).__name__
    return "saved"


@pytest.fixture(scope="module")
def where(seaweedfs: Any) -> Iterator[tuple[str, dict[str, Any], Any, str]]:
    store = seaweedfs.store()
    fs, root_path = fsspec.url_to_fs(store.root, **store.storage_options)
    yield store.root, store.storage_options, fs, root_path


def raw(fs: Any, root_path: str, prefix: str) -> dict[str, int]:
    """Objects under ``prefix`` seen behind the storage's back: key -> size."""
    fs.invalidate_cache()
    found = fs.find(f"{root_path}/{prefix}", detail=True)
    return {k[len(root_path) + 1:]: int(v["size"]) for k, v in found.items()
            if v.get("type", "file") == "file"}  # SeaweedFS keeps emptied directories


def storage(root: str, opts: dict[str, Any]) -> VolumeStorage:
    return VolumeStorageConfig(url=root, storage_options=opts, rank=0, world_size=1
                               ).create_storage()


def test_two_rank_save_then_load_in_new_processes(where: Any) -> None:
    root, opts, fs, root_path = where
    assert run_ranks(2, _save_rank, root, opts, "run/step-10", 10, timeout=150) == [True, True]
    objects = raw(fs, root_path, "run")
    assert f"run/step-10/{COMMIT_NAME}" in objects
    assert not [k for k in objects if "/tmp_step-10/" in k]  # every byte in its checkpoint
    assert len([k for k in objects if "/.dcpv-manifest-" in k]) == 1
    assert not [k for k in objects if "/.dcpv-rank-" in k]  # the ranks' records: removed
    names = {k.rsplit(".", 1)[0] for k in objects if "/.dcpv" not in k and k != f"run/step-10/{COMMIT_NAME}"}
    assert names == {f"run/step-10/{n}" for n in
                     ("model_0.pt", "model_1.pt", "step_0.pt", "step_1.pt")}
    # Fresh processes, each rank its own files: bit-identical
    assert run_ranks(2, _load_rank, root, opts, "run/step-10", 10, timeout=120) == [True, True]
    st = storage(root, opts)
    assert st.exists(Path("run/step-10")) and st.isdir(Path("run/step-10"))
    assert st.ls(Path("run/step-10")) == ["model_0.pt", "model_1.pt", "step_0.pt", "step_1.pt"]
    assert st.remap_path(Path("run/step-10/model_0.pt")) == f"{root}/run/step-10/model_0.pt"


def test_async_save_writes_from_its_subprocess(where: Any) -> None:
    """The default saver: the config crosses into torch_checkpointing's spawned writer."""
    root, opts, fs, root_path = where
    manager = CheckpointManager(config(root, opts, sync=False))
    future = manager.save("async/step-1", payload(0, 5))
    assert future is not None
    future.result()
    assert f"async/step-1/{COMMIT_NAME}" in raw(fs, root_path, "async")
    assert same(dict(manager.load("async/step-1", into=blank())), payload(0, 5))
    manager.close()


def test_killed_save_is_invisible_and_a_retry_commits_only_its_own_files(where: Any) -> None:
    root, opts, fs, root_path = where
    name = "run/step-20"
    reported = run_ranks_with_victim(2, 1, _killed_save_rank, root, opts, name, timeout=120)
    assert reported[0][0] and reported[0][1] != "saved", reported
    staged = raw(fs, root_path, name)
    assert any("model_1.pt." in k for k in staged) and any("extra_1_1.pt." in k for k in staged)
    assert any("/.dcpv-rank-1-of-2-" in k for k in staged)  # rank 1 recorded, then died
    assert f"{name}/{COMMIT_NAME}" not in staged  # every byte durable, still no checkpoint
    assert not any("/.dcpv-manifest-" in k for k in staged)
    st = storage(root, opts)
    assert not st.exists(Path(name))
    manager = CheckpointManager(config(root, opts))
    with pytest.raises(FileNotFoundError):
        manager.load(name, into=blank())
    # A retry on 1 rank (smaller world) commits; the dead attempt's files are not part of it
    manager.save(name, payload(0, 21))
    assert same(dict(manager.load(name, into=blank())), payload(0, 21))
    assert not st.exists(Path(f"{name}/model_1.pt")) and not st.exists(Path(f"{name}/extra_1_1.pt"))
    with pytest.raises(FileNotFoundError):
        st.getsize(Path(f"{name}/model_1.pt"))
    left = raw(fs, root_path, name)
    assert not any("model_1.pt." in k or "extra_1_1" in k for k in left)  # stale ones removed
    # Saving again to a committed checkpoint fails and leaves its bytes untouched
    before = raw(fs, root_path, name)
    with pytest.raises(FileExistsError, match="Checkpoint already exists"):
        manager.save(name, payload(0, 22))
    assert same(dict(manager.load(name, into=blank())), payload(0, 21))
    assert raw(fs, root_path, name) == before  # the refused save's objects removed too
    with pytest.raises(FileNotFoundError, match="never change"):
        st.delete(Path(f"{name}/model_0.pt"))
    st.rmdir(Path(name))
    assert not st.exists(Path(name)) and not raw(fs, root_path, name)
    assert not raw(fs, root_path, "run/tmp_step-20")  # the temporary directory held nothing
    manager.close()


def test_commit_takes_only_this_jobs_records_of_every_rank(where: Any) -> None:
    """The protocol on the Storage itself: rank 0 of job A and a rank 1 of another job B
    stage one save; the commit refuses; rank 1 of job A records; the commit takes it."""
    root, opts, fs, root_path = where

    def rank(r: int, job: str) -> VolumeStorage:
        return VolumeStorageConfig(url=root, storage_options=opts, rank=r, world_size=2,
                                   job=job).create_storage()

    a0, b1, a1 = rank(0, "A"), rank(1, "B"), rank(1, "A")
    a0.write(Path("c/tmp_x/model_0.pt"), b"zero")
    for other in (b1, a1):
        with other.stream_write(Path("c/tmp_x/part.tmp")) as f:
            f.write(b"one")
        other.rename(Path("c/tmp_x/part.tmp"), Path("c/tmp_x/model_1.pt"))
    a0.write_rank_record(Path("c/tmp_x"))
    b1.write_rank_record(Path("c/tmp_x"))
    assert a0.exists(Path("c/tmp_x")) and not a0.exists(Path("c/x"))
    with pytest.raises(errors.IncompleteCheckpointError, match="this job"):
        a0.rename(Path("c/tmp_x"), Path("c/x"), is_directory=True)
    assert not a0.exists(Path("c/x")) and f"c/x/{COMMIT_NAME}" not in raw(fs, root_path, "c/x")
    a1.write_rank_record(Path("c/tmp_x"))
    a0.rename(Path("c/tmp_x"), Path("c/x"), is_directory=True)
    reader = storage(root, opts)
    assert reader.ls(Path("c/x")) == ["model_0.pt", "model_1.pt"]
    assert reader.read(Path("c/x/model_1.pt")) == b"one"
    assert reader.getsize(Path("c/x/model_0.pt")) == 4
    assert b1.exists(Path("c/x/model_1.pt")) and not reader.exists(Path("c/x/part.tmp"))
    left = raw(fs, root_path, "c/x")  # job B's staged object and the records went
    assert len([k for k in left if "/.dcpv-" not in k and not k.endswith(COMMIT_NAME)]) == 2
    assert not any("/.dcpv-rank-" in k for k in left) and not raw(fs, root_path, "c/tmp_x")
    with pytest.raises(FileExistsError):
        a0.rename(Path("c/tmp_x"), Path("c/x"), is_directory=True)
    with pytest.raises(FileNotFoundError):  # recorded files are the commit's, not the rank's
        a1.delete(Path("c/tmp_x/model_1.pt"))


def test_no_record_callback_means_no_commit(where: Any) -> None:
    root, opts, fs, root_path = where
    cfg = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=VolumeStorageConfig(url=root, storage_options=opts))
    manager = CheckpointManager(cfg)
    with pytest.raises(errors.IncompleteCheckpointError, match="record_rank_files"):
        manager.save("bare/step-1", payload(0, 1))
    assert f"bare/step-1/{COMMIT_NAME}" not in raw(fs, root_path, "bare/step-1")
    assert not storage(root, opts).exists(Path("bare/step-1"))
    manager.close()


def _crafted(metadata: bytes, **change: Any) -> bytes:
    """The test's own edit of a stored ``.metadata`` (trusted here: written by the test)."""
    md = pickle.loads(metadata)
    (index, info), *_ = [(i, v) for i, v in md.storage_data.items() if i.fqn == "model_0.pt"]
    md.storage_data[index] = dataclasses.replace(info, **change)
    return pickle.dumps(md)


class _Evil:
    def __reduce__(self) -> Any:
        return (os.getcwd, ())


def test_commit_record_is_untrusted(where: Any) -> None:
    """The commit (``.metadata`` and manifest) and the data are read as untrusted input:
    through the package's allow-listed, bounded parsers and each block's CRC32C."""
    root, opts, fs, root_path = where
    manager = CheckpointManager(config(root, opts))
    manager.save("t/step-1", payload(0, 1))
    stored = raw(fs, root_path, "t/step-1")
    meta_path = f"{root_path}/t/step-1/{COMMIT_NAME}"
    (manifest_key,) = [k for k in stored if "/.dcpv-manifest-" in k]
    manifest_path = f"{root_path}/{manifest_key}"
    metadata, manifest = fs.cat_file(meta_path), fs.cat_file(manifest_path)
    good = json.loads(manifest)
    (data_key, entry), *_ = [(k, v) for k, v in good["files"].items() if k.startswith("model_0")]
    data_path = f"{root_path}/t/step-1/{data_key}"
    data = fs.cat_file(data_path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    bigger = {**good, "files": {**good["files"], data_key: {**entry, "size": entry["size"] + 1}}}
    cases = [
        (meta_path, _crafted(metadata, relative_path="../../x"), errors.UnsafeCheckpointError),
        (meta_path, _crafted(metadata, relative_path="other.pt"), errors.IntegrityError),
        (meta_path, pickle.dumps(_Evil()), errors.UnsafeCheckpointError),
        (manifest_path, json.dumps(bigger).encode(), errors.IntegrityError),
        (manifest_path, json.dumps({**good, "format": 99}).encode(), errors.IntegrityError),
        (data_path, bytes(flipped), errors.IntegrityError),  # one bit: its block's CRC32C
    ]
    for path, bad, error in cases:
        fs.pipe_file(path, bad)
        with pytest.raises(error):
            CheckpointManager(config(root, opts)).load("t/step-1", into=blank())
        fs.pipe_file(meta_path, metadata)
        fs.pipe_file(manifest_path, manifest)
        fs.pipe_file(data_path, data)
    assert same(dict(CheckpointManager(config(root, opts)).load("t/step-1", into=blank())),
                payload(0, 1))
    with pytest.raises(errors.ConfigError):
        storage(root, opts).write(Path("t/x/../../y"), b"1")
    manager.close()


_CALLED: list[str] = []


def _mine(args: CallbackArgs) -> None:
    _CALLED.append(args.path)


def test_manager_config_runs_your_pre_finalize_callback_then_records(where: Any) -> None:
    """issue 26: ``pre_finalize_callback=`` raised 'got multiple values for keyword
    argument'; now yours runs, then the rank's files are recorded, and the save commits."""
    root, opts, fs, root_path = where
    manager = CheckpointManager(config(root, opts, pre_finalize_callback=_mine))
    manager.save("cb/step-1", payload(0, 1))
    assert _CALLED and _CALLED[-1].endswith("cb/tmp_step-1")
    assert f"cb/step-1/{COMMIT_NAME}" in raw(fs, root_path, "cb/step-1")
    assert same(dict(manager.load("cb/step-1", into=blank())), payload(0, 1))
    manager.close()
    # the default (async) saver sends the chained callback to its writer process
    manager = CheckpointManager(config(root, opts, sync=False, pre_finalize_callback=_mine))
    future = manager.save("cb/step-2", payload(0, 2))
    assert future is not None
    future.result()
    assert same(dict(manager.load("cb/step-2", into=blank())), payload(0, 2))
    manager.close()


def test_resume_path_is_the_newest_committed_checkpoint_or_none(where: Any) -> None:
    root, opts, fs, root_path = where
    run = f"{root}/resume"
    assert resume_path(run, storage_options=opts) is None  # a first run: nothing stored
    manager = CheckpointManager(config(run, opts))
    manager.save("step-1", payload(0, 1))
    manager.save("step-2", payload(0, 2))
    st = storage(run, opts)
    st.write(Path("tmp_step-3/model_0.pt"), b"staged, never committed")
    assert "step-3/" in " ".join(raw(fs, root_path, "resume"))
    assert resume_path(run, storage_options=opts) == "step-2"
    assert same(dict(manager.load(resume_path(run, storage_options=opts), into=blank())),
                payload(0, 2))
    manager.close()


def test_the_library_still_commits_by_directory_rename_and_exists() -> None:
    """What docs/integrations/torch_checkpointing.md says about the library, checked."""
    write = inspect.getsource(CheckpointWriter.write)
    assert "self._storage.rename(tmp_dir_path, final_path, is_directory=True)" in write
    assert write.index("execute_barrier") < write.index("self._storage.rename(")
    assert write.index("self._write_metadata(") < write.index("execute_barrier")
    assert write.index("pre_finalize_callback(") < write.index("execute_barrier")
    read = inspect.getsource(CheckpointReader.read)
    assert "if not self._storage.exists(checkpoint_dir):" in read
    gather = inspect.getsource(DefaultMetadataManager._all_gather_pickled_data)
    assert 'device="cuda"' in gather  # multi-rank resharding metadata needs CUDA


def test_a_missing_bucket_fails_when_the_config_is_built(seaweedfs: Any) -> None:
    """Issue 37, finding 8.4: a missing bucket went unnoticed by ``manager_config`` and
    ``CheckpointManager``; the default async saver then failed in its writer process at the
    first save, while ``manager.save`` returned. Now ``manager_config`` checks it."""
    store = seaweedfs.store()
    assert store.missing_bucket_root is not None
    with pytest.raises(errors.BucketNotFoundError, match="does not exist.*create it") as info:
        manager_config(f"{store.missing_bucket_root}/run",
                       storage_options=store.storage_options)
    assert "no-such-bucket" in str(info.value)
