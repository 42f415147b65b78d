"""A ``dcp-volumes export`` killed (SIGKILL) while a multipart upload is open, then run again
(issue 37, finding 8, item 1; first seen in issue 25, finding 7).

The CLI runs in a child process against SeaweedFS through the fault proxy, which holds the
upload of part 2 of ``model.safetensors`` in flight: the child is killed while that request
is held, so the upload is open at the kill, every time. The rerun (the CLI's call, straight
to the server) must succeed and leave no multipart upload open under DEST, whether it
writes the file the killed one was writing or (another ``--max-shard-size``) other files.
Uploads are listed with boto3, behind the code's back (not through the backend's
``stale_uploads``, which the rerun itself uses to find them).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
import torch
from _cli import REPO
from safetensors.torch import load

from dcp_volumes.export import export_safetensors
from dcp_volumes.testing.faultproxy import FaultRule

pytestmark = pytest.mark.xdist_group("export")

#: 17 MiB of float32: parts of 16 and 1 MiB at the CLI's part size
ROWS, COLS = 1088, 4096


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter

    g = torch.Generator().manual_seed(3)
    model = {"a": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(64, 1024, generator=g)}
    path = tmp_path_factory.mktemp("killed-upload") / "ckpt"
    dcp.save({"model": model}, storage_writer=VolumeWriter(str(path)), no_dist=True)
    return str(path), model


def _open_uploads(env: dict[str, str], bucket: str, prefix: str) -> list[str]:
    """The keys of open multipart uploads under ``prefix``, asked of the server with boto3."""
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                          region_name=env["AWS_DEFAULT_REGION"])
    keys: list[str] = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket,
                                                                         Prefix=prefix):
        keys += [up["Key"] for up in page.get("Uploads", []) or []]
    return keys


def _kill_while_part_2_is_held(src: str, dest: str, seaweedfs: Any, name: str,
                               *flags: str) -> None:
    proxy = seaweedfs.proxy
    # held far longer than the test: the child dies with the request in flight
    rule = proxy.add_rule(FaultRule(action="delay", delay_s=300.0, method="PUT",
                                    path_regex=rf"/{re.escape(name)}\?.*partNumber=2",
                                    times=None))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")},
           **seaweedfs.server.env(endpoint_url=proxy.endpoint_url)}
    child = subprocess.Popen([sys.executable, "-m", "dcp_volumes.cli", "export", src, dest,
                              "--to", "safetensors", "--prefix", "model.", "--json", *flags],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while proxy.stats.rule(rule).injected < 1:
            assert child.poll() is None, child.stderr.read().decode()[-2000:] \
                if child.stderr else child.returncode
            assert time.monotonic() < deadline, "the child never sent part 2"
            time.sleep(0.05)  # polls a condition; the outcome does not depend on timing
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        proxy.remove_rule(rule)
        if child.poll() is None:
            child.kill()
            child.wait()


#: the killed export's flags and the file it is writing when killed
KILLED = {
    "same-file": ((), "model.safetensors"),
    "other-files": (("--max-shard-size", "10MB"), "model-00001-of-00002.safetensors"),
}


@pytest.mark.parametrize("case", list(KILLED), ids=list(KILLED))
def test_a_rerun_of_a_killed_cli_export_leaves_no_upload_open(
        seaweedfs: Any, source: tuple[str, dict[str, torch.Tensor]], case: str) -> None:
    src, model = source
    flags, name = KILLED[case]
    bucket, prefix = seaweedfs.bucket, f"hf-{uuid.uuid4().hex[:8]}/"
    dest = f"s3://{bucket}/{prefix}".rstrip("/")
    env = seaweedfs.server.env()
    _kill_while_part_2_is_held(src, dest, seaweedfs, name, *flags)
    assert _open_uploads(env, bucket, prefix) == [prefix + name]

    # the rerun: what the CLI runs without a terminal (replace=False: it would refuse to
    # replace a complete earlier export), in this process to spare a second torch import
    store = seaweedfs.store()
    export_safetensors(src, dest, prefix="model.", storage_options={},
                       dest_storage_options=store.storage_options, replace=False)
    assert _open_uploads(env, bucket, prefix) == []
    assert store.names(dest) == ["model.safetensors"]
    got = load(bytes(store.raw_fs.cat_file(f"{bucket}/{prefix}model.safetensors")))
    assert set(got) == set(model) and all(torch.equal(got[k], v) for k, v in model.items())
