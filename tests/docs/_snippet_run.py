"""Runs one page's blocks in its scratch directory: python blocks in one interpreter (the
driver), bash blocks each in ``bash -eo pipefail`` with the loopback ``torchrun`` first on
PATH, titled python blocks written to their file. A failure raises ``SnippetFailed`` with the
block's place and the output it produced.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from _snippet_blocks import Block

HERE = Path(__file__).resolve().parent
#: one block may take this long: a hang fails, a loaded machine does not (the whole docs test
#: takes ~70 CPU-seconds; a block here takes seconds on a quiet machine)
BLOCK_TIMEOUT_S = 300.0
_TAIL = 6000
#: repository folders a page's commands name relative to the repository root
_LINKED = (".venv", "examples", "scripts", "benchmarks")


class SnippetFailed(AssertionError):
    """A block failed: where, how, and the tail of what it printed."""


def launcher_dir(dest: Path) -> Path:
    """A bin directory holding the loopback ``torchrun``."""
    dest.mkdir(parents=True, exist_ok=True)
    script = dest / "torchrun"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "_snippet_torchrun.py"}" "$@"\n')
    script.chmod(0o755)
    return dest


def block_env(repo: Path, bindir: Path, extra: dict[str, str]) -> dict[str, str]:
    """The environment every block runs in: the worktree's package, the venv's console
    scripts, the loopback torchrun, and ``extra`` (the AWS_* variables of the server)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "PYTEST_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    path = os.pathsep.join([str(bindir), str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update({"PATH": path, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1", **extra})
    return env


class PageRun:
    """The scratch directory, interpreter and log of one page's run."""

    def __init__(self, repo: Path, scratch: Path, env: dict[str, str]) -> None:
        self.scratch = scratch
        self.env = env
        for name in _LINKED:
            if (repo / name).exists():
                (scratch / name).symlink_to(repo / name)
        self.log_path = scratch.parent / f"{scratch.name}.log"
        self._log = self.log_path.open("w+b")
        self._driver: subprocess.Popen[bytes] | None = None
        self._answers = -1

    def run(self, block: Block) -> None:
        if block.title is not None:
            (self.scratch / block.title).write_text(block.text, encoding="utf-8")
            if block.language == "python":  # written, not run: at least it must compile
                compile("\n" * block.line + block.text, block.page, "exec")
            return
        start = self._log.tell()
        self._log.write(f"\n===== {block.where} ({block.language})\n".encode())
        self._log.flush()
        ok, why = self._python(block) if block.language == "python" else self._bash(block)
        if not ok:
            self._log.seek(start)
            output = self._log.read().decode(errors="replace")
            last = next((ln for ln in reversed(output.splitlines()) if ln.strip()), "")
            tail = output[-_TAIL:]
            if len(output) > _TAIL:
                tail = "...\n" + tail.split("\n", 1)[-1]
            raise SnippetFailed(f"{block.where}: the {block.language} block {why}: {last}\n"
                                f"--- its output ---\n{tail}")

    def _bash(self, block: Block) -> tuple[bool, str]:
        proc = subprocess.Popen(["bash", "-eo", "pipefail", "-c", block.text],
                                cwd=self.scratch, env=self.env, stdout=self._log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return False, f"did not finish in {BLOCK_TIMEOUT_S:.0f} s"
        return code == 0, f"exited with {code}"

    def _python(self, block: Block) -> tuple[bool, str]:
        driver = self._start_driver()
        assert driver.stdin is not None
        request = {"page": block.page, "line": block.line, "code": block.text}
        driver.stdin.write(json.dumps(request).encode() + b"\n")
        driver.stdin.flush()
        ready, _, _ = select.select([self._answers], [], [], BLOCK_TIMEOUT_S)
        if not ready:
            _kill_group(driver)
            self._driver = None
            return False, f"did not finish in {BLOCK_TIMEOUT_S:.0f} s"
        answer = os.read(self._answers, 16).decode()
        if answer.startswith("ok"):
            return True, ""
        if not answer:
            self._driver = None
            return False, f"ended its interpreter (exit {driver.wait()})"
        return False, "raised (traceback above)"

    def _start_driver(self) -> subprocess.Popen[bytes]:
        if self._driver is None:
            read_end, write_end = os.pipe()
            self._driver = subprocess.Popen(
                [sys.executable, str(HERE / "_snippet_driver.py"), str(write_end)],
                cwd=self.scratch, env=self.env, stdin=subprocess.PIPE, stdout=self._log,
                stderr=subprocess.STDOUT, pass_fds=(write_end,), start_new_session=True)
            os.close(write_end)
            self._answers = read_end
        return self._driver

    def close(self) -> None:
        """Stops the page's interpreter (by its PID) and closes the log."""
        if self._driver is not None:
            if self._driver.stdin is not None:
                self._driver.stdin.close()
            try:
                self._driver.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_group(self._driver)
            self._driver = None
        if self._answers >= 0:
            os.close(self._answers)
            self._answers = -1
        self._log.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Ends a block's process and everything it started (its own session), by its PID."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
