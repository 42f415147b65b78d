# moved verbatim from tests/unit/test_hardening.py (split by subject, issue 24)
"""URLs and types a checkpoint location must have, and credentials that never belong in one
(issue 10).

Local files and fsspec's memory filesystem. Each test names the finding it guards.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import torch
from _cli import run_cli

import dcp_volumes
from dcp_volumes import (
    VolumeReader,
    VolumeWriter,
    errors,
)


# a copy of the helper in tests/unit/test_untrusted_reads.py
def _state(extra: object) -> dict[str, object]:
    return {"w": torch.arange(16, dtype=torch.float32), "extra": extra}


# ---- 4. mistyped URLs, wrong types -------------------------------------------------------
@pytest.mark.parametrize(("url", "meant"), [
    ("s3:/bucket/x", "s3://bucket/x"),
    ("s3//bucket/x", "s3://bucket/x"),
    ("gs:/b/x", "gs://b/x"),
    ("s3:bucket/x", "s3://bucket/x"),
    ("az:/container/x", "az://container/x"),
], ids=["s3-one-slash", "s3-no-colon", "gs-one-slash", "s3-no-slashes", "az-one-slash"])
def test_mistyped_scheme_is_refused_with_a_suggestion(url: str, meant: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errors.ConfigError, match="did you mean") as info:
        VolumeWriter(url)
    assert repr(meant) in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [None, 123, b"/tmp/x", "", "file://", "memory://"],
                         ids=["none", "int", "bytes", "empty", "empty-file", "empty-memory"])
def test_non_urls_are_config_errors(value: object) -> None:
    for cls in (VolumeWriter, VolumeReader):
        with pytest.raises(errors.ConfigError):
            cls(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/x", "zip://a/b"], ids=["http", "zip"])
def test_protocols_that_cannot_hold_a_checkpoint_are_refused(url: str) -> None:
    with pytest.raises(errors.ConfigError, match="cannot hold a checkpoint"):
        VolumeWriter(url)


def test_unreachable_fsspec_store_is_a_config_error(tmp_path: Path) -> None:
    # ftp connects when its filesystem is built; nothing listens on port 1.
    with pytest.raises(errors.ConfigError, match="cannot reach the store"):
        dcp_volumes.save({"w": torch.ones(2)}, "ftp://127.0.0.1:1/x", no_dist=True)


# ---- 5. credentials in URLs --------------------------------------------------------------
def test_credentials_in_urls_are_refused_and_never_logged(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    url = "s3://AKIAEXAMPLEKEY:TOPSECRETVALUE@bucket/run/step-1"
    caplog.set_level(logging.DEBUG)
    for make in (lambda: VolumeWriter(url), lambda: VolumeReader(url),
                 lambda: dcp_volumes.Checkpointer("s3://AKIAEXAMPLEKEY:TOPSECRETVALUE@b/run")):
        with pytest.raises(errors.ConfigError, match="storage_options") as info:
            make()
        assert "TOPSECRETVALUE" not in str(info.value)
        assert "AKIAEXAMPLEKEY" not in str(info.value)
    assert "TOPSECRETVALUE" not in caplog.text


def test_cli_debug_traceback_never_prints_a_url_secret() -> None:
    out = run_cli("--debug", "ls", "s3://AKIAEXAMPLEKEY:TOPSECRETVALUE@bucket/run")
    assert out.returncode != 0
    assert "TOPSECRETVALUE" not in out.stdout + out.stderr
    assert "storage_options" in out.stderr


def test_memory_url_is_unaffected() -> None:
    url = f"memory://dcpv-tests/{uuid.uuid4().hex}/ckpt"
    dcp_volumes.save(_state("text"), url, no_dist=True)
    target = _state(None)
    dcp_volumes.load(target, url, no_dist=True)
    assert target["extra"] == "text"
