"""The docs test's own tools, without servers: block parsing, marks, the page runner's
failures (a broken line fails) and the loopback torchrun."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _snippet_blocks import blocks, bucket_names
from _snippet_run import PageRun, SnippetFailed, block_env, launcher_dir

PAGE = """# A page

*Not run by the docs test: it needs a GPU.*

```python
import torch
```

*Not run by the docs test: too far above.*


```bash
echo runs
```

1. a step:

   ```python title="job.py"
   print("hi")
   ```

```
bare
```

````text
```python
inside a text block
```
````
"""


def _page(tmp_path: Path, text: str = PAGE) -> list:
    (tmp_path / "page.md").write_text(text)
    return blocks(tmp_path / "page.md", tmp_path)


def test_blocks_languages_titles_and_marks(tmp_path: Path) -> None:
    found = _page(tmp_path)
    assert [(b.line, b.language, b.title) for b in found] == [
        (5, "python", None), (12, "bash", None), (18, "python", "job.py"), (22, "", None),
        (26, "text", None)]
    assert found[0].mark == "it needs a GPU" and not found[0].runs
    assert found[1].mark is None and found[1].runs  # two blank lines: the mark is not its
    assert found[2].text == 'print("hi")\n'  # the list's indentation removed
    assert "inside a text block" in found[4].text  # a longer fence holds a shorter one


def test_bucket_names_come_from_run_blocks_only(tmp_path: Path) -> None:
    page = ("```python\nurl = 's3://my-bucket/run/step-1'\nmissing = 's3://no-such-bucket/x'\n```\n\n"
            "*Not run by the docs test: a real account.*\n\n```bash\naws s3 ls s3://real-one/\n```\n")
    assert bucket_names(_page(tmp_path, page)) == ["my-bucket"]


def _run_page(tmp_path: Path, text: str) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = PageRun(Path(__file__).resolve().parents[2], scratch,
                  block_env(tmp_path, launcher_dir(tmp_path / "bin"), {}))
    try:
        for block in _page(tmp_path, text):
            run.run(block)
    finally:
        run.close()


def test_python_blocks_share_one_interpreter_and_titled_ones_are_files(tmp_path: Path) -> None:
    _run_page(tmp_path, "```python\nx = 41\n```\n\n```python\nassert x + 1 == 42\n```\n\n"
              '```python title="mod.py"\nVALUE = 7\n```\n\n'
              "```bash\npython -c 'import mod; assert mod.VALUE == 7'\n```\n")


@pytest.mark.parametrize(("body", "says"), [
    ("```python\nimport torch\nx = 1\nraise ValueError('broken line')\n```\n",
     "page.md:1: the python block raised"),
    ("```bash\necho fine\nfalse\necho never\n```\n", "page.md:1: the bash block exited with 1"),
    ("```python\nimport sys\nsys.exit(3)\n```\n", "page.md:1: the python block raised"),
], ids=["python-raises", "bash-command-fails", "python-exits-nonzero"])
def test_a_broken_line_fails_naming_its_place(tmp_path: Path, body: str, says: str) -> None:
    with pytest.raises(SnippetFailed) as failed:
        _run_page(tmp_path, body)
    assert says in str(failed.value)
    if "ValueError" in body:  # the traceback names the page's own line
        assert 'File "page.md", line 4' in str(failed.value)


def _torchrun(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.py").write_text(script)
    bindir = launcher_dir(tmp_path / "bin")
    return subprocess.run([str(bindir / "torchrun"), *args, str(tmp_path / "job.py")],
                          check=False, capture_output=True, text=True, timeout=60)


def test_torchrun_starts_ranks_with_torchs_variables(tmp_path: Path) -> None:
    # one write per rank: ranks share the pipe, and an unbuffered print writes piece by piece
    script = ("import os\nline = ','.join(os.environ[k] for k in ('RANK', 'WORLD_SIZE', "
              "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR'))\n"
              "os.write(1, f\"{line} {int(os.environ['MASTER_PORT']) > 0}\\n\".encode())\n")
    done = _torchrun(tmp_path, script, "--standalone", "--nproc_per_node=3")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:-1]) == [
        f"{r},3,{r},3,127.0.0.1 True" for r in range(3)]


def test_torchrun_fails_and_stops_the_others_when_a_rank_fails(tmp_path: Path) -> None:
    script = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(4)\ntime.sleep(60)\n"
    start = time.monotonic()
    done = _torchrun(tmp_path, script, "--nproc-per-node", "2")
    assert done.returncode == 4
    assert time.monotonic() - start < 30  # rank 0 was stopped, not waited for


def test_torchrun_refuses_options_it_does_not_implement(tmp_path: Path) -> None:
    done = _torchrun(tmp_path, "pass\n", "--nnodes", "2", "--nproc-per-node", "2")
    assert done.returncode != 0 and "one node only" in done.stderr
    assert sys.executable  # the launcher runs ranks with the test's interpreter
