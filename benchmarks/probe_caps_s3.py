"""S3 probes (SeaweedFS, moto) with a raw boto3 client: in-store copy and stored checksums.

Checksum values in the results are named rather than printed (``CRC32C(object)``,
``COMPOSITE(parts)-2``, ``the wrong value sent``...), so a run's table does not depend on the
random payload; a value the probe cannot name is printed as it came back.
"""

from __future__ import annotations

import zlib
from typing import Any

import boto3
from botocore.config import Config
from probe_caps_common import (  # type: ignore[import-not-found]
    MIB,
    Row,
    attempt,
    b64,
    crc32c_b64,
    crc32c_int,
    crc64nvme_b64,
    flip_b64,
    random_bytes,
)

__all__ = ["probe_s3"]

_KEYS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")
_SPLIT = 5 * MIB + 100  # part 1 ends off any power-of-two boundary
_WRONG_ETAG = '"0123456789abcdef0123456789abcdef"'
_FN = {"CRC32C": crc32c_b64, "CRC64NVME": crc64nvme_b64}


def _client(server: Any) -> Any:
    config = Config(
        s3={"addressing_style": "path"},
        retries={"max_attempts": 1, "mode": "standard"},
        # the probe chooses every checksum it sends and checks every one it gets
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
        config=config,
    )


class _S3Probe:
    def __init__(self, store: str, server: Any) -> None:
        self.store = store
        self.s3 = _client(server)
        self.bucket = "probe"
        server.create_bucket(self.bucket)
        self.rows: list[Row] = []
        self.small = random_bytes(64 * 1024)
        self.big = random_bytes(_SPLIT + MIB)
        self.parts = [self.big[:_SPLIT], self.big[_SPLIT:]]
        self.ranges = [(0, _SPLIT - 1), (_SPLIT, len(self.big) - 1)]
        put = self.s3.put_object
        self.small_etag = put(Bucket=self.bucket, Key="src", Body=self.small)["ETag"]
        self.big_etag = put(Bucket=self.bucket, Key="big", Body=self.big)["ETag"]
        self.names = self._known_values()

    def _known_values(self) -> dict[str, str]:
        joined = b"".join(crc32c_int(p).to_bytes(4, "big") for p in self.parts)
        names = {
            crc32c_b64(self.small): "CRC32C(object)",
            crc64nvme_b64(self.small): "CRC64NVME(object)",
            crc32c_b64(self.big): "CRC32C(object)",
            crc64nvme_b64(self.big): "CRC64NVME(object)",
            f"{crc32c_b64(joined)}-2": "COMPOSITE(parts)-2",
            crc32c_b64(joined): "COMPOSITE(parts) without -2",
            b64(zlib.crc32(self.big).to_bytes(4, "big")): "zlib CRC32(object)",
        }
        for n, part in enumerate(self.parts, 1):
            names[crc32c_b64(part)] = f"CRC32C(part {n})"
        for value in list(names):
            if not value.endswith("-2"):
                names[flip_b64(value)] = "the wrong value sent"
        return names

    def sums(self, resp: dict[str, Any] | None) -> str:
        """The checksum fields of a response, values named (``CRC32C=CRC32C(object)``)."""
        resp = resp or {}
        found = [
            f"{k.removeprefix('Checksum')}={self.names.get(resp[k], resp[k])}"
            for k in _KEYS
            if resp.get(k)
        ]
        if resp.get("ChecksumType"):
            found.append(f"type {resp['ChecksumType']}")
        return " ".join(found) or "none"

    def add(self, probe: str, outcome: str, detail: str = "") -> None:
        self.rows.append(Row(store=self.store, probe=probe, outcome=outcome, detail=detail))

    def get(self, key: str) -> bytes:
        return bytes(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def head(self, key: str, **kw: Any) -> dict[str, Any]:
        return dict(self.s3.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED", **kw))

    def verdict(self, probe: str, err: str | None, key: str, want: bytes, detail: str = "") -> None:
        if err:
            self.add(probe, err, detail)
        else:
            same = self.get(key) == want
            self.add(probe, "works" if same else "WRONG BYTES", detail)

    # -- checksums on upload -------------------------------------------------------------

    def put_checksums(self) -> None:
        for algo, fn in _FN.items():
            for label, value in (("right", fn(self.small)), ("wrong", flip_b64(fn(self.small)))):
                key = f"k-{algo}-{label}"
                _, err = attempt(
                    lambda key=key, algo=algo, value=value: self.s3.put_object(
                        Bucket=self.bucket,
                        Key=key,
                        Body=self.small,
                        ChecksumAlgorithm=algo,
                        **{f"Checksum{algo}": value},
                    )
                )
                outcome = err or ("works" if label == "right" else "IGNORED (stored)")
                detail = "" if err else f"HEAD ChecksumMode=ENABLED: {self.sums(self.head(key))}"
                self.add(f"PutObject {algo} ({label} value)", outcome, detail)
        self.add(
            "HEAD ChecksumMode=ENABLED, object put without checksum",
            "info",
            self.sums(self.head("src")),
        )

    # -- in-store copy -------------------------------------------------------------------

    def copy_object(self) -> None:
        src = {"Bucket": self.bucket, "Key": "src"}
        copy = self.s3.copy_object
        resp, err = attempt(lambda: copy(Bucket=self.bucket, Key="c1", CopySource=src))
        etag = (resp or {}).get("CopyObjectResult", {}).get("ETag", "")
        same = etag.strip('"') == self.small_etag.strip('"')
        quoted = etag.startswith('"')
        self.verdict(
            "CopyObject",
            err,
            "c1",
            self.small,
            f"CopyObjectResult ETag == source ETag: {same} (quoted: {quoted})",
        )
        for label, tag in (("right", self.small_etag), ("wrong", _WRONG_ETAG)):
            _, err = attempt(
                lambda tag=tag: copy(
                    Bucket=self.bucket, Key="c2", CopySource=src, CopySourceIfMatch=tag
                )
            )
            probe = f"CopyObject x-amz-copy-source-if-match ({label} ETag)"
            if label == "right":
                self.verdict(probe, err, "c2", self.small)
            else:
                self.add(probe, err or "IGNORED (copied)")
        _, err = attempt(
            lambda: copy(Bucket=self.bucket, Key="c1", CopySource=src, IfNoneMatch="*")
        )
        self.add("CopyObject If-None-Match: * onto an existing key", err or "IGNORED (overwrote)")
        source = {"Bucket": self.bucket, "Key": "k-CRC64NVME-right"}
        _, err = attempt(lambda: copy(Bucket=self.bucket, Key="c5", CopySource=source))
        self.add(
            "CopyObject of an object put with CRC64NVME: HEAD of the copy",
            err or "info",
            "" if err else self.sums(self.head("c5")),
        )
        _, err = attempt(
            lambda: copy(Bucket=self.bucket, Key="c4", CopySource=src, ChecksumAlgorithm="CRC32C")
        )
        head = {} if err else self.head("c4")
        outcome = err or ("works" if head.get("ChecksumCRC32C") else "not kept")
        self.add(
            "CopyObject ChecksumAlgorithm=CRC32C (store computes it): HEAD of the copy",
            outcome,
            "" if err else self.sums(head),
        )

    def multipart(
        self,
        key: str,
        kinds: tuple[str, str],
        *,
        algo: str | None = None,
        ctype: str | None = None,
        full: str | None = None,
        if_match: str | None = None,
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """Build ``key`` = ``big`` from two parts, each ``"copy"`` (UploadPartCopy of a range
        of ``big``) or ``"upload"``; returns the first error (or None) and each part's result."""
        create = {"ChecksumAlgorithm": algo} if algo else {}
        if ctype:
            create["ChecksumType"] = ctype
        upload_id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key, **create)
        ids = {"Bucket": self.bucket, "Key": key, "UploadId": upload_id["UploadId"]}
        cond = {"CopySourceIfMatch": if_match} if if_match else {}
        parts, results = [], []
        for number, (kind, body, (lo, hi)) in enumerate(zip(kinds, self.parts, self.ranges), 1):
            if kind == "copy":
                resp, err = attempt(
                    lambda number=number, lo=lo, hi=hi: self.s3.upload_part_copy(
                        PartNumber=number,
                        CopySource={"Bucket": self.bucket, "Key": "big"},
                        CopySourceRange=f"bytes={lo}-{hi}",
                        **cond,
                        **ids,
                    )
                )
            else:
                sums = (
                    {"ChecksumAlgorithm": algo, f"Checksum{algo}": _FN[algo](body)} if algo else {}
                )
                resp, err = attempt(
                    lambda number=number, body=body, sums=sums: self.s3.upload_part(
                        PartNumber=number, Body=body, **sums, **ids
                    )
                )
            if err:
                self.s3.abort_multipart_upload(**ids)
                return err, results
            result = resp.get("CopyPartResult", resp)
            results.append(result)
            kept = {k: result[k] for k in _KEYS if result.get(k)}
            parts.append({"PartNumber": number, "ETag": result["ETag"], **kept})
        done = {"ChecksumType": ctype} if ctype else {}
        if full and algo:
            done[f"Checksum{algo}"] = full
        _, err = attempt(
            lambda: self.s3.complete_multipart_upload(
                MultipartUpload={"Parts": parts}, **done, **ids
            )
        )
        return err, results

    def part_copies(self) -> None:
        err, _ = self.multipart("p1", ("copy", "copy"))
        detail = "" if err else f"HEAD ChecksumMode=ENABLED: {self.sums(self.head('p1'))}"
        self.verdict(
            "UploadPartCopy x2, CopySourceRange (5 MiB+100 B, 1 MiB)", err, "p1", self.big, detail
        )
        err, _ = self.multipart("p2", ("copy", "upload"))
        self.verdict("one upload: UploadPartCopy part + UploadPart part", err, "p2", self.big)
        err, _ = self.multipart("p3", ("copy", "copy"), if_match=self.big_etag)
        self.verdict("UploadPartCopy x-amz-copy-source-if-match (right ETag)", err, "p3", self.big)
        err, _ = self.multipart("p4", ("copy", "copy"), if_match=_WRONG_ETAG)
        self.add(
            "UploadPartCopy x-amz-copy-source-if-match (wrong ETag)", err or "IGNORED (copied)"
        )
        err, results = self.multipart("p5", ("copy", "upload"), algo="CRC32C")
        if err:
            self.add("UploadPartCopy in a CRC32C upload: CopyPartResult checksum", err)
            return
        self.add(
            "UploadPartCopy in a CRC32C upload: CopyPartResult checksum",
            "works" if results[0].get("ChecksumCRC32C") else "none returned",
            f"{self.sums(results[0])}; HEAD after complete: {self.sums(self.head('p5'))}",
        )

    # -- checksums of multipart objects --------------------------------------------------

    def multipart_checksums(self) -> None:
        upload = self.s3.create_multipart_upload(
            Bucket=self.bucket, Key="bad-part", ChecksumAlgorithm="CRC32C"
        )
        ids = {"Bucket": self.bucket, "Key": "bad-part", "UploadId": upload["UploadId"]}
        _, err = attempt(
            lambda: self.s3.upload_part(
                PartNumber=1,
                Body=self.small,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=flip_b64(crc32c_b64(self.small)),
                **ids,
            )
        )
        self.add("UploadPart CRC32C (wrong value)", err or "IGNORED (stored)")
        self.s3.abort_multipart_upload(**ids)
        err, _ = self.multipart("m-comp", ("upload", "upload"), algo="CRC32C")
        self.inspect("multipart CRC32C (type not given)", "m-comp", err, "COMPOSITE(parts)-2")
        whole = crc64nvme_b64(self.big)
        err, _ = self.multipart(
            "m-full", ("upload", "upload"), algo="CRC64NVME", ctype="FULL_OBJECT", full=whole
        )
        self.inspect("multipart CRC64NVME FULL_OBJECT", "m-full", err, "CRC64NVME(object)")
        err, _ = self.multipart(
            "m-bad",
            ("upload", "upload"),
            algo="CRC64NVME",
            ctype="FULL_OBJECT",
            full=flip_b64(whole),
        )
        self.add(
            "CompleteMultipartUpload FULL_OBJECT (wrong whole-object value)",
            err or "IGNORED (completed)",
        )

    def full_object_crc32c(self) -> None:
        """FULL_OBJECT CRC32C: comparable with a CRC32C of the whole file built from item CRCs."""
        whole = crc32c_b64(self.big)
        full = {"algo": "CRC32C", "ctype": "FULL_OBJECT", "full": whole}
        err, _ = self.multipart("f-up", ("upload", "upload"), **full)
        self.inspect("multipart CRC32C FULL_OBJECT", "f-up", err, "CRC32C(object)")
        err, results = self.multipart("f-copy", ("copy", "upload"), **full)
        probe = "multipart CRC32C FULL_OBJECT, part 1 by UploadPartCopy: HEAD"
        if err:
            self.add(probe, err)
            return
        head = self.head("f-copy")
        named = self.names.get(head.get("ChecksumCRC32C", ""), "")
        outcome = "works" if named == "CRC32C(object)" else "OTHER VALUE"
        self.add(
            probe, outcome, f"CopyPartResult: {self.sums(results[0])}; HEAD: {self.sums(head)}"
        )

    def inspect(self, probe: str, key: str, err: str | None, want: str) -> None:
        """HEAD, HEAD of part 1 and GetObjectAttributes of a multipart object."""
        if err:
            self.add(probe, err)
            return
        head = self.head(key)
        value = head.get("ChecksumCRC32C") or head.get("ChecksumCRC64NVME")
        named = self.names.get(value or "", "")
        outcome = "works" if named == want else "none" if value is None else "OTHER VALUE"
        self.add(probe + ": HEAD ChecksumMode=ENABLED", outcome, self.sums(head))
        part, err = attempt(lambda: self.head(key, PartNumber=1))
        self.add(
            probe + ": HEAD PartNumber=1",
            err or "works",
            "" if err else f"ContentLength={part.get('ContentLength')}, {self.sums(part)}",
        )
        self.attributes(probe, key)

    def attributes(self, probe: str, key: str) -> None:
        resp, err = attempt(
            lambda: self.s3.get_object_attributes(
                Bucket=self.bucket,
                Key=key,
                ObjectAttributes=["ETag", "Checksum", "ObjectParts", "ObjectSize"],
            )
        )
        if err:
            self.add(probe + ": GetObjectAttributes", err)
            return
        listed = resp.get("ObjectParts") or {}
        per_part = [self.sums(p) for p in listed.get("Parts") or []]
        detail = (
            f"Checksum: {self.sums(resp.get('Checksum'))}; "
            f"TotalPartsCount={listed.get('TotalPartsCount')}; "
            f"Parts: {', '.join(per_part) or 'not listed'}"
        )
        self.add(probe + ": GetObjectAttributes", "works", detail)

    def run(self) -> list[Row]:
        self.put_checksums()
        self.attributes("single PutObject CRC32C", "k-CRC32C-right")
        self.copy_object()
        self.part_copies()
        self.multipart_checksums()
        self.full_object_crc32c()
        return self.rows


def probe_s3(store: str, server: Any) -> list[Row]:
    """All S3 probes against ``server`` (a started LocalServer with S3 credentials)."""
    return _S3Probe(store, server).run()
