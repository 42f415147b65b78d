"""Core writer/reader behaviour on the local filesystem and fsspec's memory filesystem.

The conformance suite (tests/conformance/test_local.py) also runs against these two
backends; the tests here cover what the suite does not: spool options, stock-torch
compatibility both ways, staging, option validation and failure cleanup."""

from __future__ import annotations

import io
import os
import pickle
import uuid
import warnings

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_volumes import (
    RetryOptions,
    SpoolOptions,
    TransferOptions,
    VolumeReader,
    VolumeWriter,
    errors,
)
from dcp_volumes._compat import no_dist
from dcp_volumes.testing.states import assert_state_equal, mixed_state, zeros_like_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
SMALL_PARTS = TransferOptions(part_size=5 * MiB, max_concurrency=4)


@pytest.fixture(params=["local", "memory"], ids=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://dcpv-tests/{uuid.uuid4().hex}/ckpt"


def failures_of(exc: BaseException) -> list[BaseException]:
    """The original exceptions DCP wrapped in a CheckpointException."""
    assert isinstance(exc, CheckpointException), exc
    return [err for err, _tb in exc.failures.values()]


def save(state, url, **kw):
    writer = VolumeWriter(url, transfer=kw.pop("transfer", SMALL_PARTS), **kw)
    dcp.save(state, storage_writer=writer, **no_dist())
    return writer


def load(state, url, **kw):
    reader = VolumeReader(url, **kw)
    dcp.load(state, storage_reader=reader, **no_dist())
    return reader


def list_names(url: str) -> list[str]:
    fs, root = fsspec.url_to_fs(url)
    if not fs.exists(root):
        return []
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


@pytest.mark.parametrize("mode", ["disk", "memory"], ids=["disk-spool", "memory-spool"])
def test_round_trip_mixed_state(url: str, mode: str, tmp_path) -> None:
    state = mixed_state()
    writer = save(state, url, spool=SpoolOptions(mode=mode, directory=str(tmp_path / "spool")))
    stats = writer.last_stats
    assert stats is not None and stats.bytes > 6 * MiB and stats.parts >= 3
    if mode == "disk":
        assert os.listdir(tmp_path / "spool") == []  # spool emptied
    out = zeros_like_state(state)
    reader = load(out, url)
    assert_state_equal(out, state)
    assert reader.last_stats is not None and reader.last_stats.verified


def test_files_per_rank_balances_sizes(url: str) -> None:
    state = {f"t{i}": torch.ones(1000 * (i + 1)) for i in range(8)}
    save(state, url, spool=SpoolOptions(files_per_rank=3))
    shards = [n for n in list_names(url) if n.endswith(".distcp")]
    assert len(shards) == 3


def test_stock_torch_reader_loads_our_checkpoint(tmp_path) -> None:
    url = str(tmp_path / "ours")
    state = mixed_state()
    save(state, url)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=dcp.FileSystemReader(url), **no_dist())
    assert_state_equal(out, state)


def test_fsspec_reader_loads_our_checkpoint_from_memory() -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"memory://dcpv-tests/{uuid.uuid4().hex}/ours"
    state = {"a": torch.randn(100, 10), "n": {"k": 3}}
    save(state, url)
    out = {"a": torch.zeros(100, 10), "n": {"k": 0}}
    dcp.load(out, storage_reader=FsspecReader(url), **no_dist())
    assert torch.equal(out["a"], state["a"]) and out["n"]["k"] == 3


def test_we_load_stock_torch_checkpoint(tmp_path, caplog) -> None:
    url = str(tmp_path / "theirs")
    state = mixed_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(url, sync_files=False), **no_dist())
    out = zeros_like_state(state)
    with caplog.at_level("DEBUG", logger="dcp_volumes"):
        reader = load(out, url)
    assert_state_equal(out, state)
    assert reader.last_stats is not None and not reader.last_stats.verified
    assert any("not verified" in r.getMessage() for r in caplog.records)


def test_overwrite_false_fails_before_uploading(url: str) -> None:
    save({"a": torch.ones(10)}, url)
    before = list_names(url)
    with pytest.raises(CheckpointException) as info:
        save({"a": torch.zeros(10)}, url)
    (err,) = failures_of(info.value)
    assert isinstance(err, errors.CheckpointExistsError) and isinstance(err, FileExistsError)
    assert "overwrite=True" in str(err)
    assert list_names(url) == before
    out = {"a": torch.zeros(10)}
    load(out, url)
    assert torch.equal(out["a"], torch.ones(10))


def test_overwrite_true_replaces_and_removes_old_save(url: str) -> None:
    save({"a": torch.ones(10), "b": torch.ones(3)}, url)
    old = set(list_names(url))
    save({"a": torch.full((10,), 2.0), "b": torch.full((3,), 2.0)}, url, overwrite=True)
    new = set(list_names(url))
    assert ".metadata" in new
    assert not (old - {".metadata"}) & new  # every object of the old save is gone
    out = {"a": torch.zeros(10), "b": torch.zeros(3)}
    load(out, url)
    assert torch.equal(out["a"], torch.full((10,), 2.0))


def test_failed_save_leaves_no_metadata_and_cleans_up(url: str, tmp_path) -> None:
    class FailingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn == "boom":
                raise RuntimeError("simulated failure while serializing")
            return super().resolve_data(write_item)

    spool = tmp_path / "spool"
    state = {"a": torch.randn(3 * MiB), "boom": torch.ones(4), "c": torch.ones(5)}
    with pytest.raises(CheckpointException):
        dcp.save(state, storage_writer=VolumeWriter(
            url, transfer=SMALL_PARTS, spool=SpoolOptions(directory=str(spool),
                                                          files_per_rank=1)),
            planner=FailingPlanner(), **no_dist())
    assert ".metadata" not in list_names(url)
    assert [n for n in list_names(url) if n.endswith(".distcp")] == []
    assert os.listdir(spool) == []
    with pytest.raises(errors.CheckpointNotFoundError):
        VolumeReader(url).read_metadata()


def test_not_found_vs_incomplete(url: str) -> None:
    with pytest.raises(errors.CheckpointNotFoundError) as info:
        VolumeReader(url).read_metadata()
    assert isinstance(info.value, FileNotFoundError)
    save({"a": torch.randn(100)}, url)
    fs, root = fsspec.url_to_fs(url)
    fs.rm_file(f"{root}/.metadata")
    with pytest.raises(errors.IncompleteCheckpointError, match="no .metadata"):
        VolumeReader(url).read_metadata()


@pytest.mark.parametrize("bad", ["../escape.distcp", "/etc/passwd", "a/../../b", "s3://x/y"],
                         ids=["dotdot", "absolute", "nested-dotdot", "url"])
def test_relative_paths_cannot_escape(url: str, bad: str) -> None:
    save({"a": torch.randn(10)}, url)
    fs, root = fsspec.url_to_fs(url)
    metadata = pickle.loads(fs.cat_file(f"{root}/.metadata"))
    for info in metadata.storage_data.values():
        info.relative_path = bad
    fs.pipe_file(f"{root}/.metadata", pickle.dumps(metadata))
    with pytest.raises(errors.UnsafeCheckpointError, match="escapes"):
        VolumeReader(url).read_metadata()


def test_writer_and_reader_pickle_without_clients(url: str) -> None:
    writer = VolumeWriter(url, storage_options={"secret": "s3cr3t"})
    writer.backend()
    clone = pickle.loads(pickle.dumps(writer))
    assert clone._backend_obj is None and clone.url == url
    reader = VolumeReader(url)
    reader.backend()
    assert pickle.loads(pickle.dumps(reader))._backend_obj is None
    assert "s3cr3t" not in repr(writer)


@pytest.mark.parametrize(
    "make",
    [
        lambda: VolumeWriter("nosuchscheme://b/p"),
        lambda: VolumeWriter("s3://"),
        lambda: VolumeWriter(""),
        lambda: VolumeWriter("/tmp/x", storage_options="key=1"),
        lambda: TransferOptions(part_size=1024),
        lambda: TransferOptions(max_concurrency=0),
        lambda: SpoolOptions(mode="tape"),
        lambda: RetryOptions(max_attempts=0),
    ],
    ids=["unknown-scheme", "no-bucket", "empty-url", "bad-options", "tiny-part", "zero-conc",
         "bad-spool-mode", "zero-attempts"],
)
def test_bad_input_is_a_config_error(make) -> None:
    with pytest.raises(errors.ConfigError) as info:
        make()
    assert isinstance(info.value, ValueError) and str(info.value)


def test_path_that_is_a_file_is_refused(tmp_path) -> None:
    target = tmp_path / "file"
    target.write_bytes(b"x")
    with pytest.raises(CheckpointException) as info:
        save({"a": torch.ones(3)}, str(target))
    (err,) = failures_of(info.value)
    assert isinstance(err, errors.ConfigError) and "is a file" in str(err)
    assert target.read_bytes() == b"x"


def test_empty_state_dict_is_refused(url: str) -> None:
    with pytest.raises(CheckpointException) as info:
        save({}, url)
    (err,) = failures_of(info.value)
    assert isinstance(err, errors.ConfigError) and "empty" in str(err)
    assert list_names(url) == []


def test_spool_without_space_fails_clearly(url: str, tmp_path) -> None:
    with pytest.raises(CheckpointException) as info:
        save({"a": torch.ones(1000)}, url,
             spool=SpoolOptions(directory=str(tmp_path), free_space_margin=1e12))
    (err,) = failures_of(info.value)
    assert isinstance(err, errors.SpoolError) and "DCP_VOLUMES_SPOOL_DIR" in str(err)
    assert ".metadata" not in list_names(url)


def test_bytes_io_items_round_trip(url: str) -> None:
    payload = {"blob": io.BytesIO(b"\x00\x01raw bytes" * 1000)}
    save(payload, url)
    out = {"blob": io.BytesIO()}
    load(out, url)
    assert out["blob"].getvalue() == payload["blob"].getvalue()


def test_sync_save_after_async_stage_uses_staged_values(url: str) -> None:
    writer = VolumeWriter(url, transfer=SMALL_PARTS)
    state = {"a": torch.arange(1000.0)}
    staged = writer.stage(state)
    state["a"].zero_()  # training goes on after staging
    dcp.save(staged, storage_writer=writer, **no_dist())
    out = {"a": torch.zeros(1000)}
    load(out, url)
    assert torch.equal(out["a"], torch.arange(1000.0))


@pytest.mark.parametrize("n", [1, 5, 1 << 20, 3 << 20, (3 << 20) + 17])
def test_crc32c_extend_equals_reading_on(n: int) -> None:
    import crc32c

    from dcp_volumes._crc import crc32c_extend

    head, block = os.urandom(123), os.urandom(n)
    running = crc32c.crc32c(head)
    assert crc32c_extend(running, crc32c.crc32c(block), n) == crc32c.crc32c(block, value=running)


@pytest.mark.parametrize("mode", ["disk", "memory"])
@pytest.mark.parametrize("nbytes", [2 << 20, (5 << 20) + 12, (10 << 20) - 82])
def test_spool_crcs_of_items_blocks_and_parts(nbytes: int, mode: str, tmp_path) -> None:
    import crc32c

    from dcp_volumes.saving import SpoolFile

    sf = SpoolFile("x", mode=mode, directory=str(tmp_path), part_size=5 << 20)
    head, data, tail = os.urandom(77), os.urandom(nbytes), os.urandom(5)
    sf.begin_item(data_bytes=nbytes, block_size=1 << 20)
    for piece in (head, data, tail):
        sf.write(piece)
    offset, length, crc, layout = sf.end_item()
    sf.close()
    parts = sf.parts.take()
    whole = head + data + tail
    assert (offset, length, crc) == (0, len(whole), crc32c.crc32c(whole))
    assert layout is not None and layout.data_offset == len(head)
    assert layout.block_crcs == [crc32c.crc32c(data[i:i + (1 << 20)])
                                 for i in range(0, nbytes, 1 << 20)]
    assert b"".join(bytes(p.read()) for p in parts) == whole
    assert [p.part.crc for p in parts] == [crc32c.crc32c(bytes(p.read())) for p in parts]
    sf.discard()
