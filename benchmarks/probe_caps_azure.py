"""Azure probes (Azurite) with azure-storage-blob: Put Block From URL, Copy Blob, MD5 / CRC64.

Where the public ``BlobClient`` computes or hides a header the probe needs to choose (a wrong
transactional MD5, a source ``If-Match`` on Put Block From URL), it calls the SDK's generated
REST operations (``BlobClient._client``), one request each, with exactly those headers.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
from typing import Any

from azure.core import MatchConditions
from azure.storage.blob import BlobSasPermissions, BlobServiceClient, generate_blob_sas
from azure.storage.blob._generated.models import (
    BlobHTTPHeaders,
    BlockLookupList,
    SourceModifiedAccessConditions,
)
from probe_caps_common import (  # type: ignore[import-not-found]
    MIB,
    Row,
    attempt,
    crc64nvme_int,
    flip_b64,
    md5_b64,
    random_bytes,
)

from dcp_volumes.testing.servers import AZURITE_ACCOUNT_KEY

__all__ = ["probe_azure"]

_WRONG_ETAG = '"0x8DEADBEEF000000"'


def _block_id(n: int) -> str:
    return base64.b64encode(f"block-{n:06d}".encode()).decode()


def _raw(value: str) -> bytes:
    return base64.b64decode(value)


class _AzureProbe:
    def __init__(self, store: str, server: Any) -> None:
        self.store = store
        server.create_bucket("probe")
        self.service = BlobServiceClient.from_connection_string(server.connection_string())
        self.container = self.service.get_container_client("probe")
        self.rows: list[Row] = []
        self.src_data = random_bytes(MIB + 4096)
        self.src = self.container.upload_blob("src", self.src_data)
        self.src_etag = self.src.get_blob_properties().etag
        sas = generate_blob_sas(
            account_name=self.src.account_name,
            container_name="probe",
            blob_name="src",
            account_key=AZURITE_ACCOUNT_KEY,
            permission=BlobSasPermissions(read=True),
            expiry=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1),
        )
        self.src_url = f"{self.src.url}?{sas}"

    def add(self, probe: str, outcome: str, detail: str = "") -> None:
        self.rows.append(Row(store=self.store, probe=probe, outcome=outcome, detail=detail))

    def blob(self, name: str) -> Any:
        return self.container.get_blob_client(name)

    def md5_of(self, name: str, want: bytes) -> str:
        md5 = self.blob(name).get_blob_properties().content_settings.content_md5
        if md5 is None:
            return "Content-MD5 not kept"
        right = bytes(md5) == _raw(md5_b64(want))
        return f"Content-MD5 kept, {'right' if right else 'WRONG'}"

    def check(self, probe: str, err: str | None, name: str, want: bytes, md5: bool = True) -> None:
        if err:
            self.add(probe, err)
            return
        same = self.blob(name).download_blob().readall() == want
        self.add(probe, "works" if same else "WRONG BYTES", self.md5_of(name, want) if md5 else "")

    # -- checksums -----------------------------------------------------------------------

    def single_put(self) -> None:
        data = self.src_data
        self.add("Put Blob (upload_blob, no MD5 sent)", "works", self.md5_of("src", data))
        raw = self.blob("put-md5")._client.block_blob
        _, err = attempt(
            lambda: raw.upload(
                len(data), io.BytesIO(data), transactional_content_md5=_raw(md5_b64(data))
            )
        )
        self.check("Put Blob, right transactional Content-MD5", err, "put-md5", data)
        bad = _raw(flip_b64(md5_b64(data)))
        raw = self.blob("put-bad")._client.block_blob
        _, err = attempt(
            lambda: raw.upload(len(data), io.BytesIO(data), transactional_content_md5=bad)
        )
        self.add("Put Blob, wrong transactional Content-MD5", err or "IGNORED (stored)")

    def stage_blocks(self) -> None:
        data = self.src_data[:MIB]
        raw = self.blob("blocks")._client.block_blob
        md5 = _raw(md5_b64(data))
        crc = crc64nvme_int(data).to_bytes(8, "little")
        cases = [
            ("transactional MD5 (right)", {"transactional_content_md5": md5}),
            ("transactional MD5 (wrong)", {"transactional_content_md5": md5[::-1]}),
            (
                "x-ms-content-crc64 = CRC-64/NVME, little-endian (right)",
                {"transactional_content_crc64": crc},
            ),
            ("x-ms-content-crc64 (wrong)", {"transactional_content_crc64": b"\x01" * 8}),
        ]
        for n, (label, kwargs) in enumerate(cases):
            _, err = attempt(
                lambda n=n, kwargs=kwargs: raw.stage_block(
                    _block_id(n), len(data), io.BytesIO(data), **kwargs
                )
            )
            wrong = "(wrong)" in label
            self.add(f"Put Block {label}", err or ("IGNORED (staged)" if wrong else "works"))
        blocks = BlockLookupList(latest=[_block_id(0)])
        _, err = attempt(lambda: raw.commit_block_list(blocks))
        self.check("Put Block List (no x-ms-blob-content-md5)", err, "blocks", data)
        raw.stage_block(_block_id(0), len(data), io.BytesIO(data))
        headers = BlobHTTPHeaders(blob_content_md5=md5[::-1])
        _, err = attempt(lambda: raw.commit_block_list(blocks, blob_http_headers=headers))
        self.add(
            "Put Block List with a wrong x-ms-blob-content-md5",
            err or "IGNORED (stored)",
            "" if err else self.md5_of("blocks", data),
        )

    def echoed_crc64(self) -> None:
        """Does the store answer Put Block (From URL) with its own CRC64 of the block?"""
        half = MIB // 2
        raw = self.blob("echo")._client.block_blob
        calls = {
            "Put Block (no checksum sent)": lambda cls: raw.stage_block(
                _block_id(0), half, io.BytesIO(self.src_data[:half]), cls=cls
            ),
            "Put Block From URL (no checksum sent)": lambda cls: raw.stage_block_from_url(
                _block_id(1), 0, self.src_url, source_range=f"bytes=0-{half - 1}", cls=cls
            ),
        }
        want = crc64nvme_int(self.src_data[:half]).to_bytes(8, "little")
        for label, call in calls.items():
            headers, err = attempt(lambda call=call: call(lambda _resp, _body, hdrs: hdrs))
            got = (headers or {}).get("x-ms-content-crc64")
            named = "CRC-64/NVME of the block, little-endian" if got == want else repr(got)
            outcome = err or ("works" if got == want else "not returned" if got is None else "?")
            self.add(f"{label}: x-ms-content-crc64 in the response", outcome, "" if err else named)

    # -- in-store copy -------------------------------------------------------------------

    def from_url(self, name: str, ranges: list[tuple[int, int]], **kw: Any) -> str | None:
        raw = self.blob(name)._client.block_blob
        ids = []
        for n, (lo, hi) in enumerate(ranges):
            _, err = attempt(
                lambda n=n, lo=lo, hi=hi: raw.stage_block_from_url(
                    _block_id(n), 0, self.src_url, source_range=f"bytes={lo}-{hi}", **kw
                )
            )
            if err:
                return err
            ids.append(_block_id(n))
        _, err = attempt(lambda: raw.commit_block_list(BlockLookupList(latest=ids)))
        return err

    def block_from_url(self) -> None:
        half = MIB // 2
        want = self.src_data[half:MIB] + self.src_data[:half]
        ranges = [(half, MIB - 1), (0, half - 1)]
        err = self.from_url("fu1", ranges)
        self.check("Put Block From URL with x-ms-source-range (2 blocks)", err, "fu1", want)
        cond = SourceModifiedAccessConditions(source_if_match=self.src_etag)
        err = self.from_url("fu2", ranges, source_modified_access_conditions=cond)
        self.check("Put Block From URL x-ms-source-if-match (right)", err, "fu2", want, md5=False)
        cond = SourceModifiedAccessConditions(source_if_match=_WRONG_ETAG)
        err = self.from_url("fu3", ranges, source_modified_access_conditions=cond)
        self.add("Put Block From URL x-ms-source-if-match (wrong)", err or "IGNORED (copied)")
        part = self.src_data[:half]
        err = self.from_url("fu6", [(0, half - 1)], source_content_md5=_raw(md5_b64(part)))
        self.add("Put Block From URL right x-ms-source-content-md5", err or "works")
        crc = crc64nvme_int(part).to_bytes(8, "little")
        err = self.from_url("fu7", [(0, half - 1)], source_contentcrc64=crc)
        self.add("Put Block From URL right x-ms-source-content-crc64", err or "works")
        err = self.from_url("fu4", [(0, half - 1)], source_content_md5=b"\x00" * 16)
        self.add("Put Block From URL wrong x-ms-source-content-md5", err or "IGNORED (copied)")
        err = self.from_url("fu5", [(0, half - 1)], source_contentcrc64=b"\x00" * 8)
        self.add("Put Block From URL wrong x-ms-source-content-crc64", err or "IGNORED (copied)")

    def unsigned_source(self) -> None:
        """The source URL without a SAS: does the request's shared key authorise the source?"""
        raw = self.blob("nosas")._client.block_blob
        _, err = attempt(
            lambda: raw.stage_block_from_url(
                _block_id(0), 0, self.src.url, source_range="bytes=0-99"
            )
        )
        self.add("Put Block From URL, source URL without a SAS", err or "works")
        for sync in (False, True):
            copy = self.blob(f"nosas-{sync}").start_copy_from_url
            _, err = attempt(lambda copy=copy, sync=sync: copy(self.src.url, requires_sync=sync))
            label = "Copy Blob From URL (sync)" if sync else "Copy Blob (start_copy_from_url)"
            self.add(f"{label}, source URL without a SAS (same account)", err or "works")

    def copy_blob(self) -> None:
        data = self.src_data
        for sync in (False, True):
            label = "Copy Blob From URL (sync)" if sync else "Copy Blob (start_copy_from_url)"
            copy = self.blob(f"cp-{sync}").start_copy_from_url
            resp, err = attempt(lambda copy=copy, sync=sync: copy(self.src_url, requires_sync=sync))
            status = (resp or {}).get("copy_status")
            self.check(label, err, f"cp-{sync}", data)
            if not err:
                self.add(label + ": copy_status", str(status))
            _, err = attempt(
                lambda copy=copy, sync=sync: copy(
                    self.src_url,
                    requires_sync=sync,
                    source_etag=self.src_etag,
                    source_match_condition=MatchConditions.IfNotModified,
                )
            )
            self.add(label + " source If-Match (right)", err or "works")
            _, err = attempt(
                lambda copy=copy, sync=sync: copy(
                    self.src_url,
                    requires_sync=sync,
                    source_etag=_WRONG_ETAG,
                    source_match_condition=MatchConditions.IfNotModified,
                )
            )
            self.add(label + " source If-Match (wrong)", err or "IGNORED (copied)")
            _, err = attempt(
                lambda copy=copy, sync=sync: copy(
                    self.src_url, requires_sync=sync, match_condition=MatchConditions.IfMissing
                )
            )
            self.add(
                label + " If-None-Match: * onto an existing blob", err or "IGNORED (overwrote)"
            )
        put = self.blob("pfu").upload_blob_from_url
        _, err = attempt(lambda: put(self.src_url))
        self.check("Put Blob From URL (upload_blob_from_url)", err, "pfu", data)
        _, err = attempt(
            lambda: put(
                self.src_url,
                overwrite=True,
                source_etag=_WRONG_ETAG,
                source_match_condition=MatchConditions.IfNotModified,
            )
        )
        self.add("Put Blob From URL source If-Match (wrong)", err or "IGNORED (copied)")

    def run(self) -> list[Row]:
        self.single_put()
        self.stage_blocks()
        self.echoed_crc64()
        self.block_from_url()
        self.copy_blob()
        self.unsigned_source()
        return self.rows


def probe_azure(store: str, server: Any) -> list[Row]:
    """All Azure probes against ``server`` (a started Azurite LocalServer)."""
    return _AzureProbe(store, server).run()
