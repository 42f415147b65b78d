"""The Hugging Face integration against the real packages: a tiny Llama trained by the real
transformers ``Trainer`` (DDP over gloo, 2 CPU ranks) checkpointing to SeaweedFS through
:class:`~dcp_volumes.integrations.huggingface.VolumeTrainer`, and Accelerate's state through
``save_state`` / ``load_state``.

Few rank launches (transformers' import costs seconds per process), each checking several
things: an uninterrupted reference run (+ retention, + the Accelerate round trip); a run whose
rank 1 is SIGKILLed in the middle of its second save; new processes resuming it; one process
resuming a 2-process checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import numpy as np
import pytest
import torch

from dcp_volumes import Checkpointer, catalog
from dcp_volumes.testing.dist import run_ranks, run_ranks_with_victim

pytestmark = pytest.mark.xdist_group("huggingface")

TOTAL_STEPS = 6
SAVE_STEPS = 2
KEEP = 2
BATCH = 4  # per process, on 2 processes
PATTERN = r"^checkpoint-(?P<step>\d+)$"


# ---- what every rank runs ------------------------------------------------------------------
def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (64, 16), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class _Record:
    """Collects what a run did: the step it started from and each step's loss."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class Record(TrainerCallback):
            def __init__(self) -> None:
                self.start_step: int | None = None

            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                self.start_step = state.global_step

        return Record()


class _DieWhenPickled:
    """An item whose serialization (inside the writer, once the save is under way) SIGKILLs
    the process: a rank dying in the middle of a save."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def _trainer_class(die_at: int | None) -> Any:
    from dcp_volumes.integrations.huggingface import VolumeTrainer

    class Trainer(VolumeTrainer):
        def checkpoint_state(self) -> dict[str, Any]:
            state = super().checkpoint_state()
            if self.state.global_step == die_at and self.args.process_index == 1:
                state["die"] = _DieWhenPickled()
            return state

    return Trainer


def _train(root: str, options: dict[str, Any], tmp: str, *, resume: str | bool | None,
           batch: int = BATCH, die_at: int | None = None, async_save: bool = False
           ) -> dict[str, Any]:
    from transformers import TrainingArguments

    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=batch, max_steps=TOTAL_STEPS,
        save_strategy="steps", save_steps=SAVE_STEPS, save_total_limit=KEEP, logging_steps=1,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, seed=0, use_cpu=True,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    record = _Record()
    trainer = _trainer_class(die_at)(
        model=_model(), args=args, train_dataset=_dataset(), callbacks=[record],
        checkpoint_root=root, storage_options=options, async_save=async_save)
    if resume == "resume_path":  # issue 26: the one spelling, first run or not
        resume = trainer.resume_path()
        record.resume_path = resume
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    # numpy, not tensors: tensors cross the result queue as shared memory of a process that
    # may be gone before the parent reads them
    weights = {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}
    return {"start": record.start_step, "resume_path": getattr(record, "resume_path", "-"),
            "losses": losses, "weights": weights,
            "lr": trainer.lr_scheduler.get_last_lr()[0]}


class _Counter:
    """An object registered for checkpointing (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def _snapshot(model: Any, opt: Any, sched: Any, n: int, step: int, epoch: int
              ) -> dict[str, Any]:
    """What the Accelerate round trip compares (the next RNG draws included)."""
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "exp_avg": [opt.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()],
        "lr": sched.get_last_lr(), "n": n, "step": step, "epoch": epoch,
        "draws": (torch.rand(3), torch.randn(2)),
        "other_draws": (random.random(), float(np.random.rand())),
    }


def _accelerate_round_trip(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Train a few steps with Accelerate (MULTI_CPU), save_state, keep training, load_state:
    everything must be back to what it was at the save, the RNG streams included."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from dcp_volumes.integrations.huggingface import load_state, save_state

    set_seed(0)
    acc = Accelerator(cpu=True,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = _Counter()
    acc.register_for_checkpointing(counter)

    def steps(n: int) -> None:
        it = iter(loader)
        for _ in range(n):
            x, y = next(it)
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.n += 1
            acc.step += 1

    sampler = loader.batch_sampler.batch_sampler.sampler  # under BatchSamplerShard
    steps(3)
    sampler.epoch = 5
    save_state(acc, url, storage_options=options)
    saved = _snapshot(model, opt, sched, counter.n, acc.step, sampler.epoch)
    steps(2)
    sampler.epoch = 9
    load_state(acc, url, storage_options=options)
    after = _snapshot(model, opt, sched, counter.n, acc.step, sampler.epoch)
    problems = []
    for key in ("params", "exp_avg"):
        if not all(torch.equal(a, b) for a, b in zip(saved[key], after[key], strict=True)):
            problems.append(key)
    if not all(torch.equal(a, b) for a, b in zip(saved["draws"], after["draws"], strict=True)):
        problems.append("rng")
    problems += [k for k in ("lr", "n", "step", "epoch", "other_draws") if saved[k] != after[k]]
    return {"problems": problems, "type": acc.distributed_type.value,
            "processes": acc.num_processes, "step": after["step"], "epoch": after["epoch"]}


def _reference_then_killed(rank: int, world: int, roots: dict[str, str], acc_url: str,
                           options: dict[str, Any], tmp: str) -> dict[str, Any]:
    """The Accelerate round trip, the uninterrupted reference run, then a run whose rank 1
    SIGKILLs itself inside the save of step 4 (one launch: the processes are costly)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    accelerate = [None, None]
    dist.all_gather_object(accelerate, _accelerate_round_trip(acc_url, options))
    AcceleratorState._reset_state(reset_partial_state=False)  # the Trainer makes its own
    out: dict[str, Any] = {"accelerate": accelerate,
                           "train": _train(roots["ref"], options, f"{tmp}/ref-{rank}",
                                           resume="resume_path")}
    try:
        _train(roots["killed"], options, f"{tmp}/killed-{rank}", resume=None,
               die_at=2 * SAVE_STEPS)
        out["killed"] = "no error"
    except Exception as exc:  # noqa: BLE001 -- the survivor's save fails: what we expect
        out["killed"] = type(exc).__name__
    return out


def _guarded(rank: int, world: int, roots: dict[str, str], options: dict[str, Any], tmp: str
             ) -> dict[str, Any]:
    """Issue 25, finding 10, in one process: a missing bucket at construction, a resume of a
    root that another live run holds, and a resume whose newest checkpoint has a flipped
    byte (it resumes from the one before, saying so)."""
    import logging

    from transformers import TrainingArguments

    from dcp_volumes.integrations.huggingface import VolumeTrainer

    out: dict[str, Any] = {}
    args = TrainingArguments(output_dir=f"{tmp}/guarded", use_cpu=True, report_to=[])
    try:
        VolumeTrainer(model=_model(), args=args, checkpoint_root="s3://no-such-bucket/run",
                      storage_options=options)
        out["bucket"] = "no error"
    except Exception as exc:  # noqa: BLE001 -- what it is, is the result
        out["bucket"] = (type(exc).__name__, str(exc))
    try:
        _train(roots["killed"], options, f"{tmp}/held", resume=True, batch=2 * BATCH)
        out["held"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["held"] = (type(exc).__name__, str(exc))
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dcp_volumes").addHandler(handler)
    out["flipped"] = _train(roots["ref"], options, f"{tmp}/flipped", resume="resume_path",
                            batch=2 * BATCH)
    out["warnings"] = warnings
    return out


def _flip_a_byte(url: str, options: dict[str, Any]) -> None:
    """Flip one byte of the checkpoint's first shard file, behind the writer's back."""
    import fsspec

    fs, path = fsspec.url_to_fs(url, skip_instance_cache=True, **options)
    shard = min(p for p in fs.find(path) if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[5] ^= 0x01
    fs.pipe_file(shard, bytes(data))


def _resumed(rank: int, world: int, root: str, options: dict[str, Any], tmp: str,
             resume: str | bool, batch: int, async_save: bool) -> dict[str, Any]:
    return _train(root, options, f"{tmp}/resumed-{world}-{rank}", resume=resume, batch=batch,
                  async_save=async_save)


# ---- the tests -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(seaweedfs: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every rank launch of the module, once: the Accelerate round trip, a reference run and a
    killed run (one launch), the killed run resumed by 2 new processes, and a 2 -> 1 resume
    of the reference run's checkpoint of step 4 (to a root of its own)."""
    store = seaweedfs.store()
    opts, tmp = store.storage_options, str(tmp_path_factory.mktemp("hf"))
    roots = {"ref": f"{store.root}/ref", "killed": f"{store.root}/killed",
             "one": f"{store.root}/one"}
    first = run_ranks_with_victim(2, 1, _reference_then_killed, roots,
                                  f"{store.root}/accelerate/step-3", opts, tmp, timeout=240)
    ref_listing = catalog.list_checkpoints(roots["ref"], storage_options=opts,
                                           step_pattern=PATTERN)
    killed_listing = catalog.list_checkpoints(roots["killed"], storage_options=opts,
                                              step_pattern=PATTERN)
    # the resumed run saves in the background (async_save): its checkpoints must commit too
    resumed = run_ranks(2, _resumed, roots["killed"], opts, tmp, True, BATCH, True,
                        timeout=240)
    resumed_listing = catalog.list_checkpoints(roots["killed"], storage_options=opts,
                                               step_pattern=PATTERN)
    one = run_ranks(1, _resumed, roots["one"], opts, tmp, f"{roots['ref']}/checkpoint-4",
                    2 * BATCH, False, timeout=240)
    # issue 25 finding 10: the newest reference checkpoint damaged; the killed run's root
    # held by another live run (this process)
    _flip_a_byte(f"{roots['ref']}/checkpoint-6", opts)
    killed_before = catalog.list_checkpoints(roots["killed"], storage_options=opts,
                                             step_pattern=PATTERN)
    holder = Checkpointer(roots["killed"], storage_options=opts, run_id="another-run")
    holder.claim()
    try:
        guarded = run_ranks(1, _guarded, roots, opts, tmp, timeout=240)
        killed_after = catalog.list_checkpoints(roots["killed"], storage_options=opts,
                                                step_pattern=PATTERN)
    finally:
        holder.close()
    return {"guarded": guarded[0], "killed_before": killed_before,
            "killed_after": killed_after,"first": first, "ref": first[0][1]["train"] if first.get(0, (0,))[0] else None,
            "ref_listing": ref_listing,
            "killed_listing": killed_listing, "resumed": resumed,
            "resumed_listing": resumed_listing, "one": one[0]}


def _status(listing: list[catalog.CheckpointInfo]) -> list[tuple[str, bool]]:
    return [(i.name, i.complete) for i in listing]


def test_accelerate_save_state_load_state_round_trip(runs: dict[str, Any]) -> None:
    """MULTI_CPU on 2 processes: model, optimizer, scheduler, registered object, step,
    sampler epoch and every process's RNG stream come back exactly as they were saved."""
    assert set(runs["first"]) == {0} and runs["first"][0][0], runs["first"]
    for got in runs["first"][0][1]["accelerate"]:
        assert got["type"] == "MULTI_CPU" and got["processes"] == 2, got
        assert got["problems"] == [], got
        assert got["step"] == 3 and got["epoch"] == 5, got


def test_retention_keeps_save_total_limit(runs: dict[str, Any]) -> None:
    """save_total_limit=2 with a save every 2 of 6 steps: the two newest remain."""
    assert _status(runs["ref_listing"]) == [("checkpoint-4", True), ("checkpoint-6", True)]
    assert runs["ref"]["start"] == 0


def test_resume_path_is_none_on_a_first_run_and_trains_fresh(runs: dict[str, Any]) -> None:
    """Issue 26: train(resume_from_checkpoint=trainer.resume_path()) on an empty root starts
    fresh (train(resume_from_checkpoint=True) raises there, as the Trainer does)."""
    assert runs["ref"]["resume_path"] is None
    assert sorted(runs["ref"]["losses"]) == list(range(1, TOTAL_STEPS + 1))


def test_killed_save_is_skipped_and_resume_equals_uninterrupted(runs: dict[str, Any]) -> None:
    """Rank 1 dies inside the save of step 4: the survivor's save fails, checkpoint-4 stays
    incomplete next to a complete checkpoint-2; new processes resume from checkpoint-2 (one
    listing skips the incomplete one) and then train exactly as the uninterrupted run did:
    the same loss at every step after the resume, bit-identical final weights."""
    assert set(runs["first"]) == {0} and runs["first"][0][0], runs["first"]
    assert runs["first"][0][1]["killed"] != "no error"
    assert _status(runs["killed_listing"]) == [("checkpoint-2", True), ("checkpoint-4", False)]
    ref = runs["ref"]
    for rank, got in enumerate(runs["resumed"]):
        assert got["start"] == 2, (rank, got["start"])
        # steps 1-2 come from the checkpoint's trainer state (log history), 3-6 were trained
        assert got["losses"] == ref["losses"], (got["losses"], ref["losses"])
        assert sorted(got["losses"]) == list(range(1, TOTAL_STEPS + 1))
        assert got["lr"] == ref["lr"]
        mismatched = [k for k, v in ref["weights"].items()
                      if v.tobytes() != got["weights"][k].tobytes()]
        assert mismatched == [], mismatched
    # the resumed run saved 4 and 6 in the background (the incomplete 4 replaced), and
    # retention kept those
    assert _status(runs["resumed_listing"]) == [("checkpoint-4", True), ("checkpoint-6", True)]


def test_resume_on_fewer_processes(runs: dict[str, Any]) -> None:
    """2 -> 1: DDP state is replicated, so one process loads all of it. With the global batch
    kept (8 per step on 1 process instead of 4 on each of 2), the seedable sampler yields the
    same samples per step, so the run is the same computation; only the reduction order
    differs (one mean over 8 vs the mean of two means over 4, averaged by all-reduce), so
    losses and weights agree to float32 rounding, not bit for bit."""
    got, ref = runs["one"], runs["ref"]
    assert got["start"] == 4
    assert sorted(got["losses"]) == list(range(1, TOTAL_STEPS + 1))
    assert all(got["losses"][s] == ref["losses"][s] for s in (1, 2, 3, 4))  # from the state
    for step in (5, 6):
        assert got["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-4)
    assert got["lr"] == pytest.approx(ref["lr"])
    for key, value in ref["weights"].items():
        torch.testing.assert_close(torch.from_numpy(got["weights"][key]),
                                   torch.from_numpy(value), rtol=1e-4, atol=1e-5)


def test_missing_bucket_fails_at_construction(runs: dict[str, Any]) -> None:
    """Issue 25, finding 10: the Trainer named a missing bucket only at its first save."""
    name, message = runs["guarded"]["bucket"]
    assert name == "BucketNotFoundError" and "no-such-bucket" in message, message
    assert "create it" in message


def test_second_run_on_a_root_is_refused_before_it_loads(runs: dict[str, Any]) -> None:
    """Issue 25, finding 10: two Trainer runs on one root resumed from and replaced each
    other's checkpoints. A resume of a root another live run holds is refused, naming it,
    and nothing under the root changes."""
    name, message = runs["guarded"]["held"]
    assert name == "RootInUseError" and "run 'another-run'" in message, message
    before = [(i.name, i.complete, i.commit_time) for i in runs["killed_before"]]
    assert [(i.name, i.complete, i.commit_time) for i in runs["killed_after"]] == before


def test_damaged_newest_checkpoint_is_skipped_with_a_warning(runs: dict[str, Any]) -> None:
    """Issue 25, finding 10: a flipped byte in the newest checkpoint stopped the resume with
    an IntegrityError. The run resumes from the newest one that verifies (checkpoint-4),
    says which it skipped and why, and trains on as the reference run did."""
    got, ref = runs["guarded"]["flipped"], runs["ref"]
    # resume_path() names the newest (damaged) one; train falls back from it
    assert got["resume_path"].endswith("/ref/checkpoint-6"), got["resume_path"]
    assert got["start"] == 4
    skipped = [m for m in runs["guarded"]["warnings"] if "checkpoint-6" in m]
    assert skipped and "damaged" in skipped[0] and "checksum" in skipped[0].lower(), skipped
    assert all(got["losses"][s] == ref["losses"][s] for s in (1, 2, 3, 4))  # from the state
    for step in (5, 6):
        assert got["losses"][step] == pytest.approx(ref["losses"][step], rel=1e-4)
