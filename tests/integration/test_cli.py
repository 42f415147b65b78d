"""The ``dcp-volumes`` lifecycle commands, run as a user runs them: a subprocess, exit codes,
``--json`` parsed, errors on one line. Storage is a moto S3 server (credentials and endpoint
from the environment, as a user's shell would have them) and local directories."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli import run_cli as dcpv

from dcp_volumes import VolumeWriter
from dcp_volumes._compat import no_dist
from dcp_volumes.cli._exit import EXIT_NOT_FOUND
from dcp_volumes.cli._options import key_value, storage_options_for
from dcp_volumes.testing.servers import LocalServer, start_server

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[2]
SAVE_ID = "6a000000-0123456789ab"


@pytest.fixture(scope="module")
def moto() -> Iterator[LocalServer]:
    server = start_server("moto")
    server.create_bucket("cli")
    yield server
    server.stop()


def save(url: str, options: dict[str, Any], value: float = 1.0) -> None:
    state = {
        "model": {"w": torch.full((4, 2), value), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "step": int(value),
    }
    dcp.save(state, storage_writer=VolumeWriter(url, storage_options=options), **no_dist())


class Run:
    """A run root on moto with steps 1 and 2 complete and step 3 killed mid-save."""

    def __init__(self, server: LocalServer) -> None:
        self.root = f"s3://cli/{uuid.uuid4().hex[:12]}"
        self.options = server.storage_options()
        self.env = server.env()
        self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.options)
        for step in (1, 2):
            save(f"{self.root}/step-{step}", self.options, float(step))
        self.fs.pipe_file(
            f"{self.root}/step-3/__0_0-{SAVE_ID}.distcp".removeprefix("s3://"), b"x" * 10
        )

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return dcpv(*args, env=self.env)


@pytest.fixture
def run(moto: LocalServer) -> Run:
    return Run(moto)


# --------------------------------------------------------------------------------------------
# ls / latest


def test_ls_table_and_json(run: Run) -> None:
    out = run("ls", run.root + "/")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["step", "name", "status"]
    assert [ln.split()[1:3] for ln in lines[2:5]] == [
        ["step-1", "complete"],
        ["step-2", "complete"],
        ["step-3", "incomplete"],
    ]
    assert "3 checkpoints (2 complete, 1 incomplete)" in out.stdout

    doc = json.loads(run("ls", run.root, "--json").stdout)
    assert [(c["name"], c["step"], c["status"]) for c in doc["checkpoints"]] == [
        ("step-1", 1, "complete"),
        ("step-2", 2, "complete"),
        ("step-3", 3, "incomplete"),
    ]
    assert doc["checkpoints"][2]["bytes"] == 10


def test_latest_prints_the_url_and_exits_3_when_there_is_none(run: Run, tmp_path) -> None:
    out = run("latest", run.root)
    assert (out.returncode, out.stdout) == (0, f"{run.root}/step-2\n")
    doc = json.loads(run("latest", run.root, "--json").stdout)
    assert doc["name"] == "step-2" and doc["complete"] is True
    empty = dcpv("latest", str(tmp_path))
    assert empty.returncode == EXIT_NOT_FOUND == 3
    assert empty.stdout == "" and "no complete checkpoint" in empty.stderr


def test_flags_instead_of_environment(moto: LocalServer, run: Run) -> None:
    opts = moto.storage_options()
    no_env = dcpv(
        "latest",
        run.root,
        "--endpoint-url",
        opts["endpoint_url"],
        "-o",
        f"key={opts['key']}",
        "--storage-option",
        f"secret={opts['secret']}",
        env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""},
    )
    assert (no_env.returncode, no_env.stdout.strip()) == (0, f"{run.root}/step-2"), no_env.stderr


# --------------------------------------------------------------------------------------------
# info / verify / rm / gc


def test_info(run: Run) -> None:
    doc = json.loads(run("info", f"{run.root}/step-2", "--json").stdout)
    entries = {e["key"]: e for e in doc["entries"]}
    assert entries["model.w"]["shape"] == [4, 2] and entries["model.w"]["dtype"] == "float32"
    assert entries["model.b"]["dtype"] == "bfloat16" and entries["model.b"]["nbytes"] == 6
    assert entries["step"]["kind"] == "bytes"
    assert doc["world_size"] == 1 and doc["writer"].startswith("dcp_volumes ")
    human = run("info", f"{run.root}/step-2")
    assert human.returncode == 0
    assert "world size  1" in human.stdout and "model.w" in human.stdout
    missing = run("info", f"{run.root}/step-9")
    assert missing.returncode == 3 and "no checkpoint" in missing.stderr
    incomplete = run("info", f"{run.root}/step-3")
    assert incomplete.returncode == 3 and "no .metadata" in incomplete.stderr


def test_verify_ok_then_corrupted(run: Run) -> None:
    url = f"{run.root}/step-1"
    ok = run("verify", url)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("OK:")
    shard = next(p for p in run.fs.find(url.removeprefix("s3://")) if p.endswith(".distcp"))
    data = bytearray(run.fs.cat_file(shard))
    data[-3] ^= 0x01
    run.fs.pipe_file(shard, bytes(data))
    bad = run("verify", url, "--json")
    assert bad.returncode == 1
    doc = json.loads(bad.stdout)
    assert doc["ok"] is False and doc["checksummed"] is True
    assert [f["status"] for f in doc["files"] if f["name"] in shard] == ["checksum mismatch"]
    human = run("verify", url)
    assert human.returncode == 1 and "FAILED (1 of" in human.stdout and "crc32c" in human.stdout


def test_rm(run: Run) -> None:
    out = run("rm", f"{run.root}/step-1", "--dry-run")
    assert out.returncode == 0 and out.stdout.startswith("would remove")
    assert run("latest", run.root).stdout.strip().endswith("step-2")
    doc = json.loads(run("rm", f"{run.root}/step-2", "--yes", "--json").stdout)
    assert doc["objects"][0].endswith("step-2/.metadata") and doc["dry_run"] is False
    assert run("latest", run.root).stdout.strip().endswith("step-1")
    assert run("rm", f"{run.root}/step-2", "--yes").returncode == 3
    refused = run("rm", run.root, "--yes")
    assert refused.returncode == 2 and "run root" in refused.stderr


def test_rm_and_gc_confirm_deletion_the_same_way(run: Run) -> None:
    """Issue 26: ``rm`` deleted at once and rejected --yes, ``gc`` needed --yes. Now both
    delete only with --yes (or a y at a terminal's prompt); without it, a dry run."""
    step1 = f"{run.root}/step-1"
    for cmd in (["rm", step1], ["gc", run.root, "--older-than", "0s"]):
        dry = run(*cmd)  # no terminal here: nothing deleted, the report says how to delete
        assert dry.returncode == 0, dry.stderr
        assert "would remove" in dry.stdout and "run again with --yes" in dry.stdout
        assert json.loads(run(*cmd, "--json").stdout)["dry_run"] is True
        both = run(*cmd, "--yes", "--dry-run")
        assert both.returncode == 2 and "not allowed with argument" in both.stderr
    assert run("latest", run.root).stdout.strip().endswith("step-2")
    listing = run("ls", run.root).stdout
    assert "step-1" in listing and "step-3" in listing
    removed = run("rm", step1, "--yes")
    assert removed.returncode == 0 and removed.stdout.startswith("removed")
    assert "step-1" not in run("ls", run.root).stdout
    for cmd in (["rm", "--help"], ["gc", "--help"]):
        assert "Deletes only with --yes" in run(*cmd).stdout


def _on_terminal(run: Run, answer: str, *args: str) -> tuple[int, str, str]:
    """The CLI with stdin and stderr on a pseudo-terminal that types ``answer``: (exit code,
    stdout, what the terminal showed)."""
    import os
    import pty
    import select

    master, slave = pty.openpty()
    try:
        os.write(master, answer.encode() + b"\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")}
        proc = subprocess.run([sys.executable, "-m", "dcp_volumes.cli", *args], stdin=slave,
                              stderr=slave, stdout=subprocess.PIPE, text=True, timeout=120,
                              cwd=REPO, env={**env, **run.env}, check=False)
        shown = b""
        while select.select([master], [], [], 0.2)[0]:
            shown += os.read(master, 65536)
    finally:
        os.close(slave)
        os.close(master)
    return proc.returncode, proc.stdout, shown.decode("utf-8", "replace")


def test_rm_and_gc_ask_on_a_terminal(run: Run) -> None:
    step1 = f"{run.root}/step-1"
    for cmd in (["rm", step1], ["gc", run.root, "--older-than", "0s"]):
        code, out, shown = _on_terminal(run, "n", *cmd)
        assert code == 0 and "[y/N]" in shown and "run again with --yes" in out, (out, shown)
    assert "step-1" in run("ls", run.root).stdout and "step-3" in run("ls", run.root).stdout
    code, out, shown = _on_terminal(run, "y", "rm", step1)
    assert code == 0 and "[y/N]" in shown and "removed" in out, (out, shown)
    code, out, shown = _on_terminal(run, "y", "gc", run.root, "--older-than", "0s")
    assert code == 0 and "removed incomplete checkpoint" in out, (out, shown)
    listing = run("ls", run.root).stdout
    assert "step-1" not in listing and "step-3" not in listing and "step-2" in listing
    code, out, shown = _on_terminal(run, "y", "rm", f"{run.root}/step-2", "--dry-run")
    assert "[y/N]" not in shown and "step-2" in run("ls", run.root).stdout


def test_gc_is_a_dry_run_unless_yes(run: Run) -> None:
    young = run("gc", run.root)
    assert young.returncode == 0 and "kept" in young.stdout and "step-3" in young.stdout
    dry = run("gc", run.root, "--older-than", "0s")
    assert dry.returncode == 0
    assert "would remove incomplete checkpoint" in dry.stdout and "--yes" in dry.stdout
    assert "step-3" in run("ls", run.root).stdout
    doc = json.loads(run("gc", run.root, "--older-than", "0", "--yes", "--json").stdout)
    assert doc["dry_run"] is False and doc["incomplete"] == [f"{run.root}/step-3"]
    assert "step-3" not in run("ls", run.root).stdout
    assert "nothing to collect" in run("gc", run.root, "--older-than", "0s").stdout


# --------------------------------------------------------------------------------------------
# errors and exit codes


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["ls"], 2, "required: ROOT"),
        (["ls", "/tmp", "--bogus"], 2, "unrecognized arguments"),
        (["gc", "/tmp", "--older-than", "5x"], 2, "cannot read duration"),
        (["ls", "s3://bucket-only"], 2, "names no path inside the bucket"),
        (["ls", "nope://x/y"], 2, "unknown URL scheme"),
        (["ls", "/tmp", "-o", "novalue"], 2, "KEY=VALUE"),
        (["ls", "/tmp", "--endpoint-url", "http://x"], 2, "does not apply"),
        (["ls", "s3://no-such-bucket/run"], 3, "does not exist"),
        ([], 2, "usage:"),
    ],
    ids=[
        "missing-root",
        "unknown-flag",
        "bad-duration",
        "bucket-without-path",
        "bad-scheme",
        "bad-storage-option",
        "endpoint-on-local",
        "missing-bucket",
        "no-command",
    ],
)
def test_errors_are_one_line_with_exit_codes(
    moto: LocalServer, args: list[str], code: int, needle: str
) -> None:
    out = dcpv(*args, env=moto.env())
    assert out.returncode == code, out.stderr
    assert needle in out.stderr
    if args:
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_debug_shows_the_traceback(moto: LocalServer) -> None:
    out = dcpv("ls", "s3://no-such-bucket/run", "--debug", env=moto.env())
    assert out.returncode == 3 and "Traceback" in out.stderr


def test_plan_still_works() -> None:
    out = dcpv("plan", "--gpus", "512", "--afr", "0.05", "--checkpoint-cost-s", "30", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["optimum"]["interval_s"] > 0


def test_listing_without_checks_never_imports_torch(tmp_path) -> None:
    save(str(tmp_path / "step-5"), {})
    code = (
        "import sys, dcp_volumes\n"
        "from dcp_volumes import cli, __all__\n"
        "assert 'torch' not in sys.modules, 'import dcp_volumes imported torch'\n"
        f"assert cli.main(['ls', '--check', '0', {str(tmp_path)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'ls --check 0 imported torch'\n"
        # latest and a checked ls read .metadata, whose allow-listed unpickling needs torch
        f"assert cli.main(['latest', {str(tmp_path)!r}]) == 0\n"
        "from dcp_volumes import VolumeWriter, Checkpointer, SpoolOptions, TransferOptions\n"
        "assert {'Checkpointer', 'VolumeWriter', 'RetryOptions'} <= set(__all__)\n"
        "assert all(getattr(dcp_volumes, n) is not None for n in __all__)\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok") and "step-5" in out.stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("key=abc", ("key", "abc")),
        ("anon=true", ("anon", True)),
        ("default_block_size=5242880", ("default_block_size", 5242880)),
        (
            'client_kwargs={"region_name": "eu-west-1"}',
            ("client_kwargs", {"region_name": "eu-west-1"}),
        ),
        ("token=a=b", ("token", "a=b")),
    ],
    ids=["string", "bool", "int", "json-object", "equals-in-value"],
)
def test_storage_option_values(text: str, expected: tuple[str, Any]) -> None:
    assert key_value(text) == expected


def test_environment_endpoint_applies_to_s3_only(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    args = argparse.Namespace(endpoint_url=None, anon=True, storage_option=[("x", 1)])
    assert storage_options_for(args, "s3://b/run") == {
        "endpoint_url": "http://127.0.0.1:9",
        "anon": True,
        "x": 1,
    }
    assert storage_options_for(args, "gs://b/run") == {"token": "anon", "x": 1}
