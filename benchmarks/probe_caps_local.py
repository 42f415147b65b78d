"""Local-filesystem probes: copy_file_range, reflink (FICLONE / FICLONERANGE), hard links."""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import tempfile
from pathlib import Path

from probe_caps_common import MIB, Row, random_bytes  # type: ignore[import-not-found]

__all__ = ["filesystem_of", "probe_local"]

_FICLONE = 0x40049409  # _IOW(0x94, 9, int)
_FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range)


def filesystem_of(path: str) -> str:
    """``fstype device`` of the mount holding ``path`` (longest mount-point prefix)."""
    best, found = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                device, mount, fstype = line.split()[:3]
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, found = mount, f"{fstype} ({device} on {mount})"
    except OSError:
        pass
    return found


def _errno(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"error {name} ({exc.strerror})"


def _ioctl(dst: int, request: int, arg: int | bytes) -> str | None:
    try:
        fcntl.ioctl(dst, request, arg)
    except OSError as exc:
        return _errno(exc)
    return None


def probe_local(store: str, directory: str) -> list[Row]:
    """Probe ``directory``'s filesystem; the store column is ``local:<fstype>``."""
    rows: list[Row] = []
    fs = filesystem_of(directory)
    store = f"{store}:{fs.split()[0]}"
    data = random_bytes(4 * MIB)
    with tempfile.TemporaryDirectory(dir=directory, prefix="probe-caps-") as tmp:
        src = Path(tmp, "src")
        src.write_bytes(data)

        def add(probe: str, outcome: str, detail: str = "") -> None:
            rows.append(Row(store=store, probe=probe, outcome=outcome, detail=detail))

        def check(name: str, want: bytes) -> str:
            return "works" if Path(tmp, name).read_bytes() == want else "WRONG BYTES"

        with open(src, "rb") as fin, open(Path(tmp, "cfr"), "wb") as fout:
            try:
                done = 0
                while done < len(data):
                    n = os.copy_file_range(fin.fileno(), fout.fileno(), len(data) - done)
                    if n == 0:
                        break
                    done += n
                err = None
            except OSError as exc:
                err = _errno(exc)
        add("os.copy_file_range (whole file)", err or check("cfr", data), fs)
        with open(src, "rb") as fin, open(Path(tmp, "cfr-range"), "wb") as fout:
            try:
                os.copy_file_range(fin.fileno(), fout.fileno(), MIB, offset_src=MIB, offset_dst=0)
                err = None
            except OSError as exc:
                err = _errno(exc)
        add(
            "os.copy_file_range (1 MiB at offset 1 MiB)",
            err or check("cfr-range", data[MIB : 2 * MIB]),
        )
        with open(src, "rb") as fin, open(Path(tmp, "clone"), "wb") as fout:
            err = _ioctl(fout.fileno(), _FICLONE, fin.fileno())
        add("reflink: ioctl FICLONE", err or check("clone", data))
        with open(src, "rb") as fin, open(Path(tmp, "clone-range"), "wb") as fout:
            arg = struct.pack("qQQQ", fin.fileno(), MIB, MIB, 0)
            err = _ioctl(fout.fileno(), _FICLONERANGE, arg)
        add(
            "reflink: ioctl FICLONERANGE (1 MiB at 1 MiB)",
            err or check("clone-range", data[MIB : 2 * MIB]),
        )
        try:
            os.link(src, Path(tmp, "hard"))
            add("os.link (hard link)", check("hard", data), f"st_nlink={os.stat(src).st_nlink}")
        except OSError as exc:
            add("os.link (hard link)", _errno(exc))
    return rows
