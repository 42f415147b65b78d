"""Deletes are all-or-nothing (issue 37, finding 3).

``rm`` of a checkpoint holding one key that XML 1.0 cannot carry (``\\x01``, ``\\x1f``,
U+FFFE: legal S3 keys) deleted ``.metadata`` first, then failed the whole batched
DeleteObjects (MalformedXML); the shards and manifest stayed, and ``gc`` skipped them as
"holds files that are not checkpoint files". The error was an ``UploadError``, and a store
that answered 200 having deleted nothing was reported as "N objects removed".

Now: such keys are deleted one by one (DeleteObject takes the key in the URL); a directory
holding anything gc would not remove gets a removal marker before its ``.metadata`` goes, so
a delete that stops at any request leaves either a complete checkpoint or garbage that ``gc``
removes; a delete's error is a :class:`~dcp_volumes.errors.DeleteError`; and a DeleteObjects
answer is checked against the keys asked.

On real S3 servers (moto and SeaweedFS, the session's, from tests/conftest.py), faults
injected by the fault proxy in front of them; objects are put and listed behind the code's
back with a raw s3fs filesystem.
"""

from __future__ import annotations

import uuid
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli import run_cli

from dcp_volumes import VolumeReader, VolumeWriter, _layout, catalog, errors
from dcp_volumes._compat import no_dist
from dcp_volumes.testing.faultproxy import FaultRule

#: characters legal in an S3 key that XML 1.0 cannot carry
ODD = {"x01": "\x01", "x1f": "\x1f", "ufffe": "\ufffe"}

#: an S3 error answer that is neither transient nor a refusal of the credentials
_INVALID = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>InvalidRequest</Code><Message>injected by the test</Message>"
    b"<RequestId>TEST</RequestId></Error>"
)
_S3_NS = b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
#: 200 answers to DeleteObjects that delete nothing (the proxy answers; the store never sees it)
_NOTHING_DELETED = {
    "empty-answer": b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult ' + _S3_NS
    + b"></DeleteResult>",
    "names-other-keys": b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult ' + _S3_NS
    + b"><Deleted><Key>someone/else.bin</Key></Deleted></DeleteResult>",
}


class Run:
    """A run root on one S3 server, with raw access and the proxy in front of it."""

    def __init__(self, running: Any) -> None:
        self.running = running
        self.root = f"{running.root}/del-{uuid.uuid4().hex[:10]}"
        self.options = running.server.storage_options()
        self.proxied = running.server.storage_options(endpoint_url=running.proxy.endpoint_url)
        self.proxy = running.proxy
        self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.options)

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def path(self, rel: str) -> str:
        return self.url(rel).removeprefix("s3://")

    def save(self, rel: str, value: float = 1.0) -> None:
        writer = VolumeWriter(self.url(rel), storage_options=self.options)
        dcp.save(_state(value), storage_writer=writer, **no_dist())

    def loads(self, rel: str, value: float = 1.0) -> bool:
        state = _state(0.0)
        dcp.load(state, storage_reader=VolumeReader(self.url(rel), storage_options=self.options),
                 **no_dist())
        return all(bool((t == value).all()) for t in state.values())

    def put(self, rel: str, data: bytes = b"notes") -> None:
        self.fs.pipe_file(self.path(rel), data)

    def names(self, rel: str) -> list[str]:
        self.fs.invalidate_cache()
        base = self.path(rel) + "/"
        found = self.fs.find(base.rstrip("/"), detail=True)
        # SeaweedFS lists a directory entry for a prefix it once held: not an object
        return sorted(p[len(base):] for p, i in found.items()
                      if i.get("type") == "file" and p.startswith(base))

    def fault(self, **kwargs: Any) -> FaultRule:
        return self.proxy.add_rule(FaultRule(action="status", **kwargs))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((64, 32), value) for i in range(3)}


@pytest.fixture(params=["moto", "seaweedfs"], ids=["moto", "seaweedfs"])
def s3run(request: pytest.FixtureRequest) -> Any:
    running = request.getfixturevalue(request.param)
    running.proxy.clear_rules()
    yield Run(running)
    running.proxy.clear_rules()


@pytest.fixture
def weed(seaweedfs: Any) -> Any:
    """A run on SeaweedFS, whose MalformedXML answer is AWS's."""
    seaweedfs.proxy.clear_rules()
    yield Run(seaweedfs)
    seaweedfs.proxy.clear_rules()


# --------------------------------------------------------------------------------------------
# keys XML cannot carry


@pytest.mark.parametrize("odd", list(ODD.values()), ids=list(ODD))
def test_rm_removes_a_checkpoint_holding_a_key_xml_cannot_carry(s3run: Run, odd: str) -> None:
    s3run.save("step-1")
    s3run.put(f"step-1/notes{odd}.txt")
    before = s3run.names("step-1")
    removed = catalog.remove(s3run.url("step-1"), storage_options=s3run.options)
    assert s3run.names("step-1") == []
    assert sorted(u.rsplit("/", 1)[1] for u in removed) == before


def test_retention_removes_a_checkpoint_holding_a_key_xml_cannot_carry(weed: Run) -> None:
    weed.save("step-1", 1.0)
    weed.save("step-2", 2.0)
    weed.put("step-1/odd\x01key")
    removed = catalog.apply_retention(weed.root, keep_last=1, storage_options=weed.options)
    assert removed == [weed.url("step-1")]
    assert weed.names("step-1") == []
    assert weed.loads("step-2", 2.0)


# --------------------------------------------------------------------------------------------
# a delete that stops at any request


# (id, which delete request fails, what it leaves). The requests of rm with a foreign key in
# the directory: the removal marker's PUT, then DeleteObjects of .metadata, of the shards and
# manifest, a DeleteObject of the odd key, and DeleteObjects of the marker.
_STOPS = [
    ("metadata", {"method": "POST", "path_regex": r"[?&]delete", "skip": 0}, "complete"),
    ("shards", {"method": "POST", "path_regex": r"[?&]delete", "skip": 1}, "collected"),
    ("odd-key", {"method": "DELETE"}, "collected"),
    ("marker", {"method": "POST", "path_regex": r"[?&]delete", "skip": 2}, "collected"),
]


@pytest.mark.parametrize(("match", "leaves"), [(m, x) for _, m, x in _STOPS],
                         ids=[i for i, _, _ in _STOPS])
def test_a_delete_that_stops_leaves_a_complete_checkpoint_or_garbage_gc_removes(
        weed: Run, match: dict[str, Any], leaves: str) -> None:
    weed.save("step-1")
    weed.put("step-1/notes\x01.txt")
    weed.fault(status=400, body=_INVALID, times=1, **match)
    with pytest.raises(errors.DCPVolumesError) as failed:
        catalog.remove(weed.url("step-1"), storage_options=weed.proxied)
    left = weed.names("step-1")
    if leaves == "complete":
        assert _layout.METADATA in left and "notes\x01.txt" in left
        assert weed.loads("step-1")
        # and rm, run again, finishes the job
        catalog.remove(weed.url("step-1"), storage_options=weed.options)
    else:
        assert _layout.METADATA not in left and left, left
        report = catalog.gc(weed.root, older_than_s=0, storage_options=weed.options,
                            dry_run=False)
        assert report.incomplete == [weed.url("step-1")], report.skipped
    assert weed.names("step-1") == []
    # a delete's error, saying what the store answered
    assert type(failed.value) is errors.DeleteError, repr(failed.value)
    assert "InvalidRequest" in str(failed.value)


def test_gc_still_keeps_an_incomplete_directory_with_foreign_files_it_was_not_asked_to_remove(
        weed: Run) -> None:
    weed.put("step-1/__0_0.distcp")
    weed.put("step-1/my-notes.txt")
    report = catalog.gc(weed.root, older_than_s=0, storage_options=weed.options, dry_run=False)
    assert report.incomplete == []
    assert any("not checkpoint files" in s for s in report.skipped), report.skipped
    assert weed.names("step-1") == ["__0_0.distcp", "my-notes.txt"]


# --------------------------------------------------------------------------------------------
# the store's answer is checked against what was asked


@pytest.mark.parametrize("answer", list(_NOTHING_DELETED.values()), ids=list(_NOTHING_DELETED))
def test_a_200_that_deletes_nothing_is_a_delete_error(weed: Run, answer: bytes) -> None:
    weed.save("step-1")
    before = weed.names("step-1")
    weed.fault(status=200, body=answer, method="POST", path_regex=r"[?&]delete", times=None)
    with pytest.raises(errors.DeleteError, match="neither deleted nor reported"):
        catalog.remove(weed.url("step-1"), storage_options=weed.proxied)
    assert weed.names("step-1") == before
    assert weed.loads("step-1")


def test_cli_rm_does_not_report_objects_removed_when_the_store_deleted_none(weed: Run) -> None:
    weed.save("step-1")
    before = weed.names("step-1")
    weed.fault(status=200, body=_NOTHING_DELETED["empty-answer"], method="POST",
               path_regex=r"[?&]delete", times=None)
    server = weed.running.server
    out = run_cli("rm", weed.url("step-1"), "--yes",
                  env=server.env(endpoint_url=weed.proxy.endpoint_url))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "removed" not in out.stdout, out.stdout
    assert "neither deleted nor reported" in out.stderr, out.stderr
    assert weed.names("step-1") == before
