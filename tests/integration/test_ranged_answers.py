"""Every ranged GET's answer is checked (issue 37, finding 6): a store or proxy that ignores
``Range`` (200 with the whole object), answers another range, or cuts a body midway makes a
load of a plain torch checkpoint (no manifest, so no checksum would catch the bytes) fail
with a typed error that names the object and what came back — never torch's
``RuntimeError``/``IndexError``/``UnpicklingError``, never wrong values — and a cut body is
a short body after a bounded number of GETs, not "HTTP 400".

Real servers behind the fault proxy: moto (S3; it checks no request signature, so the proxy
may rewrite the ``Range`` header), SeaweedFS (S3, a cut body only: it checks the signature
over ``Range``), fake-gcs-server, and Azurite read through a container SAS (which signs no
header).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

import dcp_volumes
from dcp_volumes import RetryOptions, errors
from dcp_volumes._compat import no_dist
from dcp_volumes.testing.faultproxy import (
    FaultProxy,
    FaultRule,
    cut_body,
    ignore_range,
    shift_range,
)

MAX_ATTEMPTS = 3
RETRY = RetryOptions(max_attempts=MAX_ATTEMPTS, initial_backoff_s=0.01, max_backoff_s=0.05)
N = 1 << 20  # 4 MiB of float32: read as split GETs into the tensor, then the tail
SENTINEL = -1
#: Azure's SDK reads a body that ended early up to three times itself, within one attempt
SDK_READS = {"azurite": 3}

#: the whole state, or one small item (one GET of a range inside the shard)
KEYS = {"whole-state": ("w", "b"), "one-small-item": ("b",)}


def _state() -> dict[str, torch.Tensor]:
    # no value equals SENTINEL: a target element is either untouched or the saved value
    return {"w": torch.arange(1, N + 1, dtype=torch.float32),
            "b": torch.arange(1, 8, dtype=torch.int64)}


class _Through:
    """A fresh checkpoint URL on ``kind``'s server, its direct options, and options that
    reach it through the server's fault proxy (``media``: the regex of its shard GETs)."""

    def __init__(self, request: pytest.FixtureRequest, kind: str) -> None:
        running = request.getfixturevalue(kind)
        store = running.store()
        self.url = store.url()
        self.direct: dict[str, Any] = store.storage_options
        self.proxied, self.proxy = store.proxied_options()
        self.proxy.clear_rules()
        request.addfinalizer(self.proxy.clear_rules)
        # gcsfs reads an object's size with a GET of its JSON: only media GETs are shards'
        self.media = r"\.distcp.*alt=media" if kind == "fake_gcs" else r"\.distcp"
        if kind == "azurite":  # the shared key signs x-ms-range, a SAS signs no header
            self.proxied = {"connection_string": _sas_connection(running, self.proxy)}

    def save_plain(self) -> None:
        """A plain torch checkpoint: torch's own FsspecWriter, no manifest, no checksums."""
        dcp.save(_state(), storage_writer=FsspecWriter(self.url, sync_files=False,
                                                       **self.direct), **no_dist())

    def load(self, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        target = {k: torch.full_like(v, SENTINEL) for k, v in _state().items() if k in keys}
        try:
            dcp_volumes.load(target, self.url, storage_options=self.proxied, retry=RETRY,
                             no_dist=True)
        finally:
            saved = _state()
            for key, tensor in target.items():
                ok = (tensor == SENTINEL) | (tensor == saved[key])
                assert bool(ok.all()), f"{key} holds values that were never saved"
        return target

    def clean_gets(self, keys: tuple[str, ...]) -> int:
        """The shard GETs of a load when nothing goes wrong (counted by a rule that never
        injects), the load's values checked."""
        counter = self.proxy.add_rule(FaultRule(action="delay", method="GET",
                                                path_regex=self.media, times=0))
        target = self.load(keys)
        assert all(torch.equal(t, _state()[k]) for k, t in target.items())
        gets = self.proxy.stats.rule(counter).matched
        self.proxy.remove_rule(counter)
        assert gets >= 1
        return gets


def _sas_connection(running: Any, proxy: FaultProxy) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from dcp_volumes.testing.servers._azure import AZURITE_ACCOUNT_KEY, AZURITE_ACCOUNT_NAME

    sas = generate_container_sas(
        AZURITE_ACCOUNT_NAME, running.bucket, account_key=AZURITE_ACCOUNT_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1))
    return (f"BlobEndpoint={proxy.endpoint_url}/{AZURITE_ACCOUNT_NAME};"
            f"SharedAccessSignature={sas}")


def _names_the_object(message: str, url: str) -> None:
    assert re.search(r"/__0_\d[^ ]*\.distcp", message), message
    assert url.split("://", 1)[1] in message, message
    assert "HTTP 400" not in message, message


RULES: dict[str, tuple[Callable[..., FaultRule], str]] = {
    # the rule, and what the message must say came back
    "ignores-range": (ignore_range, (r"HTTP 200, no Content-Range, Content-Length \d+: the "
                                     r"store sent the whole object")),
    "shifted-range": (shift_range, (r"HTTP 206, Content-Range 'bytes (\d+)-\d+/\d+', "
                                    r"Content-Length \d+: the store sent another range")),
}
MISMATCH_CASES = (
    [("moto", rule, keys) for rule in RULES for keys in KEYS]
    + [(kind, rule, "whole-state") for kind in ("fake_gcs", "azurite") for rule in RULES])


@pytest.mark.parametrize(("kind", "rule", "keys"), MISMATCH_CASES,
                         ids=[f"{k}-{r}-{w}" for k, r, w in MISMATCH_CASES])
def test_an_answer_of_other_bytes_is_a_typed_error(request: pytest.FixtureRequest, kind: str,
                                                  rule: str, keys: str) -> None:
    store = _Through(request, kind)
    store.save_plain()
    clean = store.clean_gets(KEYS[keys])
    make, came_back = RULES[rule]
    injected = store.proxy.add_rule(make(path_regex=store.media))
    with pytest.raises(errors.RangeMismatchError) as info:
        store.load(KEYS[keys])
    message = str(info.value)
    _names_the_object(message, store.url)
    asked = re.search(r"GET of bytes (\d+)-(\d+) of ", message)
    assert asked is not None, message
    found = re.search(came_back, message)
    assert found is not None, message
    if rule == "shifted-range":  # what came back, against what was asked
        assert int(found.group(1)) == int(asked.group(1)) + 1, message
    assert "not used" in message
    # not retried: asking again gets the same answer
    assert store.proxy.stats.rule(injected).injected <= clean


CUT_CASES = [("moto", "whole-state"), ("moto", "one-small-item"), ("seaweedfs", "whole-state"),
             ("fake_gcs", "whole-state"), ("azurite", "whole-state")]


@pytest.mark.parametrize(("kind", "keys"), CUT_CASES, ids=[f"{k}-{w}" for k, w in CUT_CASES])
def test_a_cut_body_is_a_short_body_within_the_retry_budget(request: pytest.FixtureRequest,
                                                            kind: str, keys: str) -> None:
    store = _Through(request, kind)
    store.save_plain()
    clean = store.clean_gets(KEYS[keys])
    cut = store.proxy.add_rule(cut_body(path_regex=store.media))
    with pytest.raises(errors.ShortBodyError) as info:
        store.load(KEYS[keys])
    message = str(info.value)
    _names_the_object(message, store.url)
    assert re.search(r"\(HTTP 206, Content-Range 'bytes \d+-\d+/\d+', Content-Length \d+\) "
                     r"ended (after \d+ of \d+ bytes|early)", message), message
    assert "RetryOptions.max_attempts" in message
    # each GET retried at most max_attempts times: 54 GETs were seen for three ranges
    gets = store.proxy.stats.rule(cut).injected
    assert MAX_ATTEMPTS <= gets <= clean * MAX_ATTEMPTS * SDK_READS.get(kind, 1), (gets, clean)
