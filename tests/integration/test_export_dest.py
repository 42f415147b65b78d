"""Export's destination under attack (issue 25, findings 2, 3, 7 and 9): racing exports, a DEST
that differs per rank, user files that look like an export's, DEST inside SRC, a dangling link,
the CLI asking before it replaces an earlier export, and a killed rank's message.

Sources are small checkpoints saved with ``VolumeWriter`` to local directories; destinations
are SeaweedFS (S3) and local directories.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import run_cli
from safetensors.torch import load, load_file

from dcp_volumes import errors
from dcp_volumes.export import export_safetensors
from dcp_volumes.testing.dist import run_ranks, run_ranks_with_victim
from dcp_volumes.testing.suite import Store

pytestmark = pytest.mark.xdist_group("export")

INDEX = "model.safetensors.index.json"
FILES3 = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
MARKER = ".dcp-volumes-export.json"
#: each 1 MiB tensor is bigger than 1 MB: one file per tensor
ONE_EACH = "1MB"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(256, 1024, generator=g) for k in ("a", "b", "c")}


def _save(path: Path, state: dict[str, torch.Tensor]) -> str:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter

    dcp.save({"model": state}, storage_writer=VolumeWriter(str(path)))
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[tuple[str, dict[str, torch.Tensor]], tuple[str, dict[str, torch.Tensor]]]:
    """Two checkpoints with the same names and different values."""
    base = tmp_path_factory.mktemp("sources")
    one, two = _state(1), _state(2)
    return (_save(base / "one", one), one), (_save(base / "two", two), two)


@pytest.fixture(scope="module")
def store(seaweedfs: Any) -> Store:
    return seaweedfs.store()


def _loaded(store: Store, dest: str, names: list[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n in names:
        out.update(load(bytes(store.raw_fs.cat_file(f"{store.raw_path(dest)}/{n}"))))
    return out


def test_racing_exports_to_one_s3_dest_at_most_one_commits(store: Store, sources: Any) -> None:
    # issue 25, finding 2: A pauses after its first file while B runs whole; both reported OK
    # and the files visible as complete held values half from each source
    (src_a, _), (src_b, state_b) = sources
    dest = store.url("race")
    first = export_safetensors(src_a, dest, prefix="model.", max_shard_size=ONE_EACH,
                               storage_options={}, dest_storage_options=store.storage_options,
                               slab_size=1 << 20)
    assert list(first.files) == FILES3
    first_size = store.raw_fs.size(f"{store.raw_path(dest)}/{FILES3[0]}")
    paused, go = threading.Event(), threading.Event()
    outcome: dict[str, BaseException | None] = {}

    def pause_after_first_file(done: int, total: int) -> None:
        if done > first_size and not paused.is_set():
            paused.set()
            assert go.wait(120)

    def run_a() -> None:
        try:
            export_safetensors(src_a, dest, prefix="model.", max_shard_size=ONE_EACH,
                               storage_options={}, dest_storage_options=store.storage_options,
                               slab_size=1 << 20, progress=pause_after_first_file)
            outcome["a"] = None
        except BaseException as exc:  # noqa: BLE001 — inspected below
            outcome["a"] = exc

    a = threading.Thread(target=run_a)
    a.start()
    try:
        assert paused.wait(120), "A never reached its second file"
        b = export_safetensors(src_b, dest, prefix="model.", max_shard_size=ONE_EACH,
                               storage_options={}, dest_storage_options=store.storage_options,
                               slab_size=1 << 20)
        assert list(b.files) == FILES3
    finally:
        go.set()
        a.join(120)
    assert isinstance(outcome["a"], errors.ExportConflictError), outcome
    assert "another export" in str(outcome["a"])
    # what is visible as complete is entirely B's output
    assert store.names(dest) == sorted([*FILES3, INDEX])
    got = _loaded(store, dest, FILES3)
    assert set(got) == set(state_b)
    for name, ref in state_b.items():
        assert torch.equal(got[name], ref), name


def _export_per_rank_dir(rank: int, world: int, src: str, base: str) -> Any:
    try:
        export_safetensors(src, os.path.join(base, f"node{rank}"), prefix="model.",
                           max_shard_size=ONE_EACH, storage_options={})
    except errors.DCPVolumesError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_multi_rank_export_whose_dest_differs_per_rank_is_refused(
        sources: Any, tmp_path: Path) -> None:
    # issue 25, finding 3: './hf' on two hosts: both ranks reported OK, and node 0 held an
    # index naming files it did not have
    (src, _), _ = sources
    out = run_ranks(2, _export_per_rank_dir, src, str(tmp_path), timeout=180)
    assert [o[0] for o in out] == ["DestinationMismatchError"] * 2, out
    assert "do not see the same DEST" in out[1][1], out
    for node in ("node0", "node1"):
        left = os.listdir(tmp_path / node) if (tmp_path / node).exists() else []
        assert not [n for n in left if n.endswith((".safetensors", ".json")) and
                    n != MARKER], left


def test_only_files_an_earlier_export_wrote_are_removed(sources: Any, tmp_path: Path) -> None:
    # issue 25, finding 7: export deleted user files that merely looked like its own, then
    # failed on a directory
    (src, state), _ = sources
    dest = tmp_path / "hf"
    dest.mkdir()
    (dest / "model-99999-of-99999.safetensors").write_bytes(b"the user's")
    (dest / "model.notes.0123456789abcdef.tmp").write_bytes(b"the user's notes")
    (dest / "model-00007-of-00009.safetensors").mkdir()
    one = export_safetensors(src, str(dest), prefix="model.", storage_options={})
    assert one.files == ("model.safetensors",)
    many = export_safetensors(src, str(dest), prefix="model.", max_shard_size=ONE_EACH,
                              storage_options={})
    assert list(many.files) == FILES3
    assert (dest / "model-99999-of-99999.safetensors").read_bytes() == b"the user's"
    assert (dest / "model.notes.0123456789abcdef.tmp").read_bytes() == b"the user's notes"
    assert (dest / "model-00007-of-00009.safetensors").is_dir()
    # the earlier export's own single file went (the index names the new files)
    assert not (dest / "model.safetensors").exists()
    got: dict[str, torch.Tensor] = {}
    for f in FILES3:
        got.update(load_file(dest / f))
    assert all(torch.equal(got[k], v) for k, v in state.items())
    # and back to one file: the earlier export's numbered files go, the user's stay
    export_safetensors(src, str(dest), prefix="model.", storage_options={})
    assert sorted(os.listdir(dest)) == sorted([
        "model.safetensors", "model-99999-of-99999.safetensors",
        "model.notes.0123456789abcdef.tmp", "model-00007-of-00009.safetensors"])


def test_dest_that_is_src_or_inside_it_is_refused(store: Store, sources: Any) -> None:
    # issue 25, finding 7: accepted, after which `rm SRC` removed the export with it
    (src, _), _ = sources
    for dest in (src, os.path.join(src, "hf"), src + "/hf/"):
        with pytest.raises(errors.ConfigError, match="inside it"):
            export_safetensors(src, dest, prefix="model.", storage_options={})
    assert not os.path.exists(os.path.join(src, "hf"))
    s3_src = store.url("ckpt")
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter

    dcp.save({"model": {"w": torch.ones(4)}},
             storage_writer=VolumeWriter(s3_src, storage_options=store.storage_options))
    with pytest.raises(errors.ConfigError, match="inside it"):
        export_safetensors(s3_src, s3_src + "/hf", prefix="model.",
                           storage_options=store.storage_options)
    # a sibling whose name starts like SRC's is outside it
    export_safetensors(s3_src, s3_src + "-hf", prefix="model.",
                       storage_options=store.storage_options)


def test_dangling_link_dest_says_what_is_wrong(sources: Any, tmp_path: Path) -> None:
    # issue 25, finding 9: a dangling-link DEST said "another save committed first"
    (src, _), _ = sources
    link = tmp_path / "hf"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(errors.ConfigError, match="symbolic link") as caught:
        export_safetensors(src, str(link), prefix="model.", storage_options={})
    assert "committed first" not in str(caught.value)


def test_cli_asks_before_it_removes_an_earlier_export(sources: Any, tmp_path: Path) -> None:
    # issue 25, finding 7: a re-export that failed or was killed had already removed the
    # earlier good export; the CLI now refuses to remove it unless told (no terminal here)
    (src, _), (src_two, state_two) = sources
    dest = tmp_path / "hf"
    first = run_cli("export", src, str(dest), "--prefix", "model.", "--json")
    assert first.returncode == 0, first.stderr
    before = (dest / "model.safetensors").read_bytes()
    again = run_cli("export", src_two, str(dest), "--prefix", "model.")
    assert again.returncode == 1, again.stderr
    assert "earlier export" in again.stderr and "--replace" in again.stderr, again.stderr
    assert (dest / "model.safetensors").read_bytes() == before  # untouched
    with pytest.raises(errors.CheckpointExistsError):
        export_safetensors(src_two, str(dest), prefix="model.", storage_options={},
                           replace=False)
    assert (dest / "model.safetensors").read_bytes() == before
    replaced = run_cli("export", src_two, str(dest), "--prefix", "model.", "--replace")
    assert replaced.returncode == 0, replaced.stderr
    got = load_file(dest / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in state_two.items())
    assert "--replace" in run_cli("export", "--help").stdout


def _export_then_die(rank: int, world: int, src: str, dest: str) -> Any:
    def die_on_rank_1(done: int, total: int) -> None:
        if rank == 1:
            os.kill(os.getpid(), 9)

    export_safetensors(src, dest, prefix="model.", max_shard_size=ONE_EACH,
                       storage_options={}, progress=die_on_rank_1)


def test_a_killed_rank_is_reported_as_died_not_as_a_long_wait(
        sources: Any, tmp_path: Path) -> None:
    # issue 25, finding 9: a killed rank said "waited 3600s" after 1.6 s
    (src, _), _ = sources
    reported = run_ranks_with_victim(2, 1, _export_then_die, src, str(tmp_path / "hf"),
                                     timeout=180)
    ok, text = reported[0]
    assert not ok
    assert "UploadError" in text and "died" in text, text
    assert "waited 3600s" not in text and "within 3600s" not in text, text


def test_a_directory_where_a_file_goes_is_a_typed_error(sources: Any, tmp_path: Path) -> None:
    # issue 25, finding 9: crafted destinations reached users as IsADirectoryError
    (src, _), _ = sources
    dest = tmp_path / "hf"
    (dest / "model.safetensors").mkdir(parents=True)
    with pytest.raises(errors.UploadError, match="model.safetensors.*move what is there away"):
        export_safetensors(src, str(dest), prefix="model.", storage_options={})
    assert (dest / "model.safetensors").is_dir()
    assert not [n for n in os.listdir(dest) if n.endswith(".tmp")]  # its temporary went
    # a DEST under a regular file said "list of ... failed (NotADirectoryError)", a
    # DownloadError of a destination
    (tmp_path / "afile").write_text("x")
    with pytest.raises(errors.ConfigError, match="is a file, not a directory"):
        export_safetensors(src, str(tmp_path / "afile" / "hf"), prefix="model.",
                           storage_options={})
