"""Two transformers ``Trainer`` runs on one ``checkpoint_root`` (issue 37, finding 8, item 3):
neither may mix its checkpoints with the other's.

What is expected follows from the run lease (``docs/lifecycle.md``, *One run per root*):

- at the same time: the run that holds the root (it saved, or it resumed) keeps it; a second
  run is refused with ``RootInUseError`` naming the holder *before it trains or loads*, a
  fresh start as much as a resume (a fresh start trained up to its first save before);
- one after the other: the first run's lease is released, so a second run may resume from
  its checkpoints and go on (a continuation); a second run that starts *fresh* is refused
  with ``CheckpointExistsError`` before it trains, since its saves would replace the first
  run's checkpoints one step at a time while the newer ones stay the newest, and a resume
  in between would continue the other run (it used to do exactly that).

Two single-process runs, started at once: run A trains (fresh), saves checkpoint-2 and
waits; run B tries a fresh start and a resume on the same root while A holds it, then
(once A finished and released the root) a fresh start and a resume again. The root is
listed behind both runs' backs before and after every refused attempt.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_volumes import catalog
from dcp_volumes.testing.dist import run_ranks

pytestmark = pytest.mark.xdist_group("huggingface")

SAVE_STEPS, KEEP, TOTAL_STEPS = 2, 2, 6
PATTERN = r"^checkpoint-(?P<step>\d+)$"
WAIT_S = 180.0  # bounded waits for the other run: far above what a step takes here


def _wait_for(flag: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not flag.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{flag.name} did not appear within {WAIT_S:.0f}s")
        time.sleep(0.1)  # polls a condition; the outcome does not depend on timing


def _listing(root: str, options: dict[str, Any]) -> list[tuple[str, bool, Any]]:
    return [(i.name, i.complete, i.commit_time) for i in
            catalog.list_checkpoints(root, storage_options=options, step_pattern=PATTERN)]


def _trainer(root: str, options: dict[str, Any], tmp: str, max_steps: int,
             callbacks: list[Any] | None = None) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from dcp_volumes.integrations.huggingface import VolumeTrainer

    class Record(TrainerCallback):
        start: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start = state.global_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))
    ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=4, max_steps=max_steps,
        save_strategy="steps", save_steps=SAVE_STEPS, save_total_limit=KEEP, logging_steps=1,
        use_cpu=True, report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    record = Record()
    trainer = VolumeTrainer(model=model, args=args,
                            train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                            callbacks=[record, *(callbacks or [])], checkpoint_root=root,
                            storage_options=options)
    trainer.record = record
    return trainer


def _run_a(rank: int, world: int, root: str, options: dict[str, Any], tmp: str,
           flags: str) -> dict[str, Any]:
    """Run A: fresh, pauses after its first save until run B has tried, then finishes and
    releases the root."""
    from transformers import TrainerCallback

    class PauseAfterFirstSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == SAVE_STEPS:
                Path(flags, "a-saved").touch()
                _wait_for(Path(flags, "b-tried"))

    trainer = _trainer(root, options, f"{tmp}/a", TOTAL_STEPS, [PauseAfterFirstSave()])
    trainer.train(resume_from_checkpoint=trainer.resume_path())
    trainer.checkpointer.close()  # releases the root, as the end of its process would
    Path(flags, "a-done").touch()
    return {"start": trainer.record.start, "step": trainer.state.global_step,
            "run_id": trainer.checkpointer.run.run_id}


def _attempt(root: str, options: dict[str, Any], tmp: str, resume: Any,
             max_steps: int = TOTAL_STEPS) -> dict[str, Any]:
    """One run B attempt: what it raised, whether it began training, the root around it."""
    before = _listing(root, options)
    trainer = _trainer(root, options, tmp, max_steps)
    error = None
    try:
        trainer.train(resume_from_checkpoint=(trainer.resume_path() if resume == "resume_path"
                                              else resume))
    except Exception as exc:  # noqa: BLE001 -- what it raised is the result
        error = (type(exc).__name__, str(exc))
    finally:
        trainer.checkpointer.close()
    return {"error": error, "start": trainer.record.start, "step": trainer.state.global_step,
            "before": before, "after": _listing(root, options)}


def _run_b(rank: int, world: int, root: str, options: dict[str, Any], tmp: str,
           flags: str) -> dict[str, Any]:
    """Run B: while A holds the root, a fresh start and a resume; once A has finished, a
    fresh start and a resume (to step 8) again."""
    _wait_for(Path(flags, "a-saved"))
    out = {"fresh_while_held": _attempt(root, options, f"{tmp}/b1", None),
           "resume_while_held": _attempt(root, options, f"{tmp}/b2", True)}
    Path(flags, "b-tried").touch()
    _wait_for(Path(flags, "a-done"))
    out["fresh_after"] = _attempt(root, options, f"{tmp}/b3", None)
    out["resume_after"] = _attempt(root, options, f"{tmp}/b4", "resume_path", max_steps=8)
    return out


@pytest.fixture(scope="module")
def two_runs(seaweedfs: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    store = seaweedfs.store()
    root, opts = f"{store.root}/shared", store.storage_options
    tmp = tmp_path_factory.mktemp("hf-two-runs")
    flags = tmp / "flags"
    flags.mkdir()
    # one run id per process, as without a launcher: no id from the environment
    env = {name: "" for name in ("DCP_VOLUMES_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    a: list[Any] = []
    thread = threading.Thread(target=lambda: a.append(
        run_ranks(1, _run_a, root, opts, str(tmp), str(flags), env=env, timeout=480)))
    thread.start()
    try:
        b = run_ranks(1, _run_b, root, opts, str(tmp), str(flags), env=env, timeout=480)[0]
    finally:
        for name in ("b-tried", "a-done"):  # never leave run A waiting on a failed run B
            (flags / name).touch()
        thread.join(timeout=600)
    assert a, "run A did not finish"
    return {"a": a[0][0], "b": b, "final": _listing(root, opts)}


def test_a_second_run_is_refused_before_it_trains_while_the_first_holds_the_root(
        two_runs: dict[str, Any]) -> None:
    a, b = two_runs["a"], two_runs["b"]
    for attempt in ("fresh_while_held", "resume_while_held"):
        got = b[attempt]
        assert got["error"] is not None, attempt
        name, message = got["error"]
        assert name == "RootInUseError", (attempt, got["error"])
        assert f"run {a['run_id']!r}" in message, message
        assert got["start"] is None, (attempt, "it began training")  # was 0: a fresh start
        assert got["after"] == got["before"], attempt  # nothing under the root changed
    # run A was not disturbed: it trained all its steps and kept the last two saves
    assert a["start"] == 0 and a["step"] == TOTAL_STEPS


def test_a_fresh_run_after_the_first_is_refused_and_a_resume_continues_it(
        two_runs: dict[str, Any]) -> None:
    b = two_runs["b"]
    fresh = b["fresh_after"]
    assert fresh["error"] is not None
    name, message = fresh["error"]
    assert name == "CheckpointExistsError", fresh["error"]  # was: trained and replaced A's
    assert "checkpoint-6" in message and "resume_path()" in message, message
    assert fresh["start"] is None and fresh["after"] == fresh["before"]
    assert [n for n, complete, _ in fresh["before"] if complete] == [
        "checkpoint-4", "checkpoint-6"]
    resumed = b["resume_after"]
    assert resumed["error"] is None, resumed["error"]
    assert resumed["start"] == TOTAL_STEPS and resumed["step"] == 8
    assert [(n, c) for n, c, _ in two_runs["final"]] == [("checkpoint-6", True),
                                                          ("checkpoint-8", True)]
    # checkpoint-6 is still run A's own, committed once
    six = [t for n, _, t in fresh["before"] if n == "checkpoint-6"]
    assert [t for n, _, t in two_runs["final"] if n == "checkpoint-6"] == six

