"""``dcp-volumes plan --from-run`` when the store refuses the record (issue 37, finding 7):
it says the store refused, with the store's answer, not "no usable run record". A real S3
server (SeaweedFS), which checks signatures, through the real entry point."""

from __future__ import annotations

import time
from typing import Any

import pytest
from _cli import run_cli

from dcp_volumes.backends import open_backend
from dcp_volumes.goodput import Incarnation, RunRecord, SaveSample, record_root, write_run_record

pytestmark = pytest.mark.xdist_group("seaweedfs")


def test_plan_from_run_says_the_store_refused_the_key(seaweedfs: Any) -> None:
    """A wrong secret: the store refused the record's GET. It is said so, with the store's
    answer, and no credential; not "no usable run record"."""
    store = seaweedfs.store()
    opts = seaweedfs.server.storage_options()
    root = f"{store.root}/run"
    now = time.time()
    record = RunRecord(root=record_root(open_backend(root, opts)))
    record.add_incarnation(Incarnation(now - 100, now - 50))
    record.add_save(SaveSample("durable", 2.0, 0.0, 1, now - 60))
    assert write_run_record(root, opts, None, record)

    def plan(secret: str) -> Any:
        return run_cli("plan", "--from-run", root, "--endpoint-url", opts["endpoint_url"],
                       "-o", f"key={opts['key']}", "-o", f"secret={secret}",
                       env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})

    assert plan(opts["secret"]).returncode == 0  # the record is there, and usable
    wrong = "wrong-" + opts["secret"]
    proc = plan(wrong)
    assert proc.returncode == 1, proc.stderr
    assert "no usable run record" not in proc.stderr
    assert "refused" in proc.stderr and "SignatureDoesNotMatch" in proc.stderr, proc.stderr
    assert wrong not in proc.stderr + proc.stdout and opts["secret"] not in proc.stderr
