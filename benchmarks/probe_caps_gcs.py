"""GCS probes (fake-gcs-server) over the raw JSON API with ``requests``: rewrite, compose, crc32c."""

from __future__ import annotations

import json
import secrets
from typing import Any
from urllib.parse import quote

import requests
from probe_caps_common import (  # type: ignore[import-not-found]
    MIB,
    Row,
    crc32c_b64,
    flip_b64,
    md5_b64,
    random_bytes,
)

__all__ = ["probe_gcs"]


class _GCSProbe:
    def __init__(self, store: str, server: Any) -> None:
        self.store = store
        self.ep = server.endpoint_url
        self.bucket = "probe"
        server.create_bucket(self.bucket)
        self.http = requests.Session()
        self.rows: list[Row] = []
        self.a = random_bytes(MIB)
        self.b = random_bytes(256 * 1024)

    def add(self, probe: str, outcome: str, detail: str = "") -> None:
        self.rows.append(Row(store=self.store, probe=probe, outcome=outcome, detail=detail))

    def obj(self, name: str) -> str:
        return f"{self.ep}/storage/v1/b/{self.bucket}/o/{quote(name, safe='')}"

    def upload(
        self,
        name: str,
        data: bytes,
        meta: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        **params: Any,
    ) -> requests.Response:
        """A multipart upload (JSON metadata + media) when ``meta`` is given, else media."""
        url = f"{self.ep}/upload/storage/v1/b/{self.bucket}/o"
        if meta is None:
            params.update(uploadType="media", name=name)
            return self.http.post(url, params=params, data=data, headers=headers or {})
        boundary = secrets.token_hex(8)
        body = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': name, **meta})}\r\n--{boundary}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        body += data + f"\r\n--{boundary}--\r\n".encode()
        return self.http.post(
            url,
            params={"uploadType": "multipart", **params},
            data=body,
            headers={"Content-Type": f"multipart/related; boundary={boundary}"},
        )

    def meta(self, name: str) -> dict[str, Any]:
        resp = self.http.get(self.obj(name))
        resp.raise_for_status()
        return dict(resp.json())

    def data(self, name: str) -> bytes:
        return bytes(self.http.get(self.obj(name), params={"alt": "media"}).content)

    def sums(self, name: str, want: bytes) -> str:
        m = self.meta(name)
        crc = m.get("crc32c")
        md5 = m.get("md5Hash")
        return (
            f"crc32c={'right' if crc == crc32c_b64(want) else crc}, "
            f"md5Hash={'right' if md5 == md5_b64(want) else md5}, "
            f"componentCount={m.get('componentCount')}"
        )

    @staticmethod
    def status(resp: requests.Response) -> str:
        if resp.ok:
            return "works"
        reason = ""
        try:
            reason = resp.json().get("error", {}).get("message", "")[:80]
        except ValueError:
            reason = resp.text[:80]
        return f"error HTTP {resp.status_code} {reason}".strip()

    def uploads(self) -> None:
        resp = self.upload("a", self.a)
        self.add("upload (media)", self.status(resp), self.sums("a", self.a))
        self.gen_a = int(self.meta("a")["generation"])
        self.upload("b", self.b)
        self.gen_b = int(self.meta("b")["generation"])
        good = crc32c_b64(self.a)
        resp = self.upload("a-crc", self.a, {"crc32c": good})
        self.add("upload (multipart) with right crc32c in metadata", self.status(resp))
        for field, value in (("crc32c", good), ("md5Hash", md5_b64(self.a))):
            resp = self.upload(f"a-bad-{field}", self.a, {field: flip_b64(value)})
            detail = self.sums(f"a-bad-{field}", self.a) if resp.ok else ""
            outcome = "IGNORED (stored)" if resp.ok else self.status(resp)
            self.add(f"upload (multipart) with wrong {field} in metadata", outcome, detail)
        for kind, meta in (("multipart", {}), ("media", None)):
            self.upload(f"ctl-{kind}", self.b)
            resp = self.upload(f"ctl-{kind}", self.a, meta, ifGenerationMatch=0)
            kept = self.data(f"ctl-{kind}") == self.b
            if resp.ok:
                outcome = "HTTP 200, existing object kept" if kept else "IGNORED (overwrote)"
            else:
                outcome = f"{self.status(resp)}, existing object {'kept' if kept else 'REPLACED'}"
            self.add(f"upload ({kind}) ifGenerationMatch=0 onto an existing name", outcome)
        hdr = {"x-goog-hash": f"crc32c={flip_b64(good)}"}
        resp = self.upload("a-bad-hdr", self.a, headers=hdr)
        self.add(
            "upload (media) with wrong x-goog-hash: crc32c=",
            "IGNORED (stored)" if resp.ok else self.status(resp),
        )

    def rewrites(self) -> None:
        for verb in ("rewriteTo", "copyTo"):
            url = f"{self.obj('a')}/{verb}/b/{self.bucket}/o/"
            resp = self.http.post(url + f"{verb}-1", json={})
            same = resp.ok and self.data(f"{verb}-1") == self.a
            detail = self.sums(f"{verb}-1", self.a) if resp.ok else ""
            if resp.ok and verb == "rewriteTo":
                body = resp.json()
                detail += f"; done={body.get('done')} rewriteToken={bool(body.get('rewriteToken'))}"
            self.add(f"objects.{verb}", "works" if same else self.status(resp), detail)
            resp = self.http.post(
                url + f"{verb}-2", json={}, params={"ifSourceGenerationMatch": self.gen_a}
            )
            self.add(f"objects.{verb} ifSourceGenerationMatch (right)", self.status(resp))
            resp = self.http.post(
                url + f"{verb}-3", json={}, params={"ifSourceGenerationMatch": self.gen_a + 1}
            )
            self.add(
                f"objects.{verb} ifSourceGenerationMatch (wrong)",
                "IGNORED (copied)" if resp.ok else self.status(resp),
            )
            resp = self.http.post(url + f"{verb}-1", json={}, params={"ifGenerationMatch": 0})
            self.add(
                f"objects.{verb} ifGenerationMatch=0 onto an existing name",
                "IGNORED (overwrote)" if resp.ok else self.status(resp),
            )

    def compose(self, dest: str, sources: list[dict[str, Any]], **params: Any) -> requests.Response:
        return self.http.post(
            f"{self.obj(dest)}/compose",
            params=params,
            json={"sourceObjects": sources, "destination": {"name": dest}},
        )

    def composes(self) -> None:
        want = self.a + self.b
        resp = self.compose("ab", [{"name": "a"}, {"name": "b"}])
        same = resp.ok and self.data("ab") == want
        self.add(
            "objects.compose (2 sources)",
            "works" if same else self.status(resp),
            self.sums("ab", want) if resp.ok else "",
        )
        conds = [
            {"name": "a", "objectPreconditions": {"ifGenerationMatch": self.gen_a}},
            {"name": "b", "objectPreconditions": {"ifGenerationMatch": self.gen_b}},
        ]
        resp = self.compose("ab2", conds)
        self.add("objects.compose source ifGenerationMatch (right)", self.status(resp))
        conds[1]["objectPreconditions"]["ifGenerationMatch"] = self.gen_b + 1
        resp = self.compose("ab3", conds)
        self.add(
            "objects.compose source ifGenerationMatch (wrong)",
            "IGNORED (composed)" if resp.ok else self.status(resp),
        )
        resp = self.compose("ab4", [{"name": "a", "generation": self.gen_a + 1}])
        self.add(
            "objects.compose source generation (nonexistent)",
            "IGNORED (composed)" if resp.ok else self.status(resp),
        )
        resp = self.compose("ab", [{"name": "a"}], ifGenerationMatch=0)
        self.add(
            "objects.compose ifGenerationMatch=0 onto an existing name",
            "IGNORED (overwrote)" if resp.ok else self.status(resp),
        )
        resp = self.compose("only-a", [{"name": "a"}])
        self.add(
            "objects.compose (1 source) as a whole-object copy",
            self.status(resp),
            self.sums("only-a", self.a) if resp.ok else "",
        )

    def run(self) -> list[Row]:
        self.uploads()
        self.rewrites()
        self.composes()
        return self.rows


def probe_gcs(store: str, server: Any) -> list[Row]:
    """All GCS probes against ``server`` (a started fake-gcs LocalServer)."""
    return _GCSProbe(store, server).run()
