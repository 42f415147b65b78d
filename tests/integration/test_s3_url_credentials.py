# moved verbatim from tests/integration/test_hardening_s3.py (split by subject, issue 24)
"""Credentials in an S3 URL never reach fsspec or the log, on a real S3 server (SeaweedFS)
(issue 10).
"""

from __future__ import annotations

import pytest
import torch

import dcp_volumes
from dcp_volumes import errors


# a copy of the helper in tests/integration/test_s3_faults.py
def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3)}


def test_credentials_in_an_s3_url_never_reach_fsspec(seaweedfs, caplog) -> None:
    store = seaweedfs.store()
    secret = store.storage_options["secret"]
    url = store.url().replace("s3://", f"s3://{store.storage_options['key']}:{secret}@")
    caplog.set_level("DEBUG")
    with pytest.raises(errors.ConfigError, match="storage_options"):
        dcp_volumes.save(_state(), url, no_dist=True)
    assert secret not in caplog.text
