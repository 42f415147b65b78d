"""torchtitan's CheckpointManager through dcp_volumes: real torchtitan containers, 2 gloo ranks,
``fully_shard`` on a CPU mesh, SeaweedFS.

One run of jobs, in order, shares the store (each job is new processes, as after a restart):

1. train steps 1-6 on 2 ranks, saving 3, 4 and 5 with ``keep_latest_k=2`` (retention leaves
   4 and 5, nothing of 3); step 6's loss is the uninterrupted run's; rank 1 is SIGKILLed
   while it serializes its shards of step 6: step-6 is left incomplete (rank 0's shards, no
   ``.metadata``);
2. resume on 2 ranks: step-6 is skipped, step-5 loads (found with one listing, on rank 0);
   step 6 gives the uninterrupted run's loss exactly; 6 and 7 are saved with
   ``async_mode="async"``;
3. resume on 1 rank (DCP resharding) from the async save at 7: every parameter, optimizer
   moment, the LR scheduler and the train state equal what the 2 ranks held; then step 8 is
   saved in ``async_with_pinned_mem`` mode (torch's process executor; pinned memory off, as
   this machine has no accelerator) and is the newest complete step.

The manager is built the way torchtitan's trainer builds it (``config.checkpoint.build``), from
a config parsed by torchtitan's ConfigManager (``--module``/``--config``, ``--checkpoint.*``).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcp_volumes import catalog
from dcp_volumes.testing.dist import run_ranks, run_ranks_with_victim

pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer.base import BaseCheckpointManager
from torchtitan.components.checkpointer.dcp import CheckpointManager

from dcp_volumes.integrations.torchtitan import VolumeCheckpointManager, use_volumes

pytestmark = pytest.mark.xdist_group("torchtitan")

WIDTH = 32


# --------------------------------------------------------------------------------------------
# the job's config, as a user's config_registry module gives it to torchtitan (--module)


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """The two fields of ``Trainer.Config`` that the checkpoint path reads, with the same
    ``checkpoint`` field type (torchtitan's trainer itself needs tensorboard, not installed)."""

    checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)
    hf_assets_path: str = "."


def preset() -> JobConfig:
    """A preset as torchtitan's model registries give them (torchtitan's manager)."""
    return JobConfig(checkpoint=CheckpointManager.Config(
        enable=True, interval=1, keep_latest_k=3, last_save_model_only=False))


def titan_job() -> JobConfig:
    """The user's config_registry function: the preset, on dcp_volumes."""
    return use_volumes(preset(), folder="s3://placeholder/run")


def parse(*args: str) -> JobConfig:
    from torchtitan.config.manager import ConfigManager

    module = __name__
    return ConfigManager().parse_args(["--module", module, "--config", "titan_job", *args])


# --------------------------------------------------------------------------------------------
# one job: torchtitan's containers around a tiny fully_shard model


class TrainState:
    """What torchtitan's Trainer saves as ``train_state`` (``step``, ``ntokens_seen``)."""

    def __init__(self, bomb_rank: int | None = None) -> None:
        self.step = 0
        self.ntokens_seen = 0
        self.bomb_rank = bomb_rank

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": self.step, "ntokens_seen": self.ntokens_seen}
        if self.bomb_rank is not None:
            # a per-rank item, so the victim serializes its own (DCP keeps replicated ones once)
            sd[f"bomb{dist.get_rank()}"] = _Bomb(dist.get_rank() == self.bomb_rank)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


class _Bomb:
    """Kills its process (SIGKILL) when pickled on the victim: while it writes its shards."""

    def __init__(self, armed: bool) -> None:
        self.armed = armed

    def __reduce__(self) -> Any:
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return (int, (0,))


def _build(world: int, ckpt: Any) -> tuple[Any, Any, Any, Any, TrainState]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(4 * WIDTH, WIDTH))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=20)
    state = TrainState()
    # as torchtitan's Trainer builds its checkpointer (no dataloader state in this job)
    manager = ckpt.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                         lr_schedulers=schedulers, states={"train_state": state},
                         sd_adapter=None)
    return model, optimizers, schedulers, manager, state


def _loss(model: Any, step: int, world: int) -> float:
    """The global loss of ``step``: 8 rows per rank of 2, the same 16 rows on 1 rank."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, WIDTH, generator=g)
    rank = dist.get_rank()
    rows = x if world == 1 else x[8 * rank: 8 * rank + 8]
    loss = model(rows).pow(2).mean()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def _full_state(model: Any, optimizers: Any, schedulers: Any, state: TrainState
                ) -> dict[str, Any]:
    # numpy copies: tensors through the result queue would be shared memory of a gone process
    full: dict[str, Any] = {f"p.{k}": v.full_tensor().numpy().copy()
                            for k, v in model.state_dict().items()}
    for k, v in optimizers.state_dict().items():
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            full[f"o.{k}"] = v.numpy().copy()
    full["lr"] = schedulers.state_dict()
    full["train_state"] = (state.step, state.ntokens_seen)
    return full


def job(rank: int, world: int, url: str, options: dict[str, Any], spec: dict[str, Any]
        ) -> dict[str, Any]:
    """Resume (or start), train ``spec["steps"]``, save those in ``spec["save"]``."""
    args = ["--checkpoint.folder", url, "--checkpoint.async-mode", spec.get("async", "disabled"),
            "--checkpoint.keep-latest-k", str(spec.get("keep", 0)),
            "--checkpoint.storage-options-json", options["json"]]
    ckpt = parse(*args).checkpoint
    model, optimizers, schedulers, manager, state = _build(world, ckpt)
    before = catalog._listing.listings_made()
    resumed = manager.load()
    listings = catalog._listing.listings_made() - before
    resumed_step = state.step if resumed else None
    losses, failed = {}, None
    for step in spec["steps"]:
        losses[step] = _loss(model, step, world)
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step, state.ntokens_seen = step, state.ntokens_seen + 16
        if step == spec.get("bomb_step"):
            state.bomb_rank = spec["bomb"]  # this save's state holds the bomb
            try:
                manager.save(step)
            except Exception as exc:  # noqa: BLE001 -- the survivor's view of the kill
                failed = f"{type(exc).__name__}: {exc}"
            break
        if step in spec["save"]:
            manager.save(step)
    manager.maybe_wait_for_saving()
    manager.close()  # joins the purge thread: retention has run
    out = {"resumed": resumed, "resumed_step": resumed_step,
           "listings": listings, "losses": losses, "failed": failed}
    if spec.get("full_state"):
        out["full"] = _full_state(model, optimizers, schedulers, state)
    return out


def job_resumed_state(rank: int, world: int, url: str, options: dict[str, Any]
                      ) -> dict[str, Any]:
    """Resume, hand back the whole state, then train step 8 and save it in torchtitan's
    ``async_with_pinned_mem`` mode: the upload runs in torch's checkpoint process, which
    receives the writer pickled. Pinned memory needs an accelerator, so torch's stager is
    given without it (the manager creates its own only when it has none)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    ckpt = parse("--checkpoint.folder", url, "--checkpoint.storage-options-json",
                 options["json"], "--checkpoint.async-mode", "async_with_pinned_mem").checkpoint
    model, optimizers, schedulers, manager, state = _build(world, ckpt)
    assert manager.load()
    full = _full_state(model, optimizers, schedulers, state)
    _loss(model, 8, world)
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    state.step = 8
    manager.stager = DefaultStager(StagingOptions(
        use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
        use_non_blocking_copy=False))
    assert manager.save(8)
    manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()
    manager.close()
    return full


def job_last_step(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The docs' CPU route (issue 26): ``VolumeCheckpointManager.Config(...).build(...)``
    as torchtitan's trainer.py builds it, no parser. A first run (``load()`` is False: a
    fresh start) saves 1-3 with ``keep_latest_k=2``, the last with ``last_step=True``; a
    second manager resumes from 3 and saves 4 (not a last step)."""
    listed: dict[str, Any] = {}
    for first, steps in ((True, (1, 2, 3)), (False, (4,))):
        config = VolumeCheckpointManager.Config(
            enable=True, folder=url, interval=1, keep_latest_k=2, last_save_model_only=False,
            storage_options=options)
        model, optimizers, schedulers, manager, state = _build(world, config)
        listed["loaded" if first else "resumed"] = (manager.load(), state.step)
        for step in steps:
            _loss(model, step, world)
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            state.step = step
            manager.save(step, last_step=step == 3)
        manager.close()  # joins the purge thread: retention has run
        listed["after_first" if first else "after_second"] = [
            i.name for i in catalog.list_checkpoints(url, storage_options=options)
            if i.complete]
    return listed


# --------------------------------------------------------------------------------------------


def objects(store: Any, url: str) -> list[str]:
    """Every object under ``url``, read behind the manager's back (a separate fsspec)."""
    base = store.raw_path(url).rstrip("/")
    return sorted(p[len(base) + 1:] for p in store.raw_fs.find(base))


def test_config_selects_the_manager_from_the_command_line(capsys) -> None:
    config = parse("--checkpoint.folder", "s3://bucket/run", "--checkpoint.keep-every", "10",
                   "--checkpoint.storage-options-json", '{"endpoint_url": "http://h:1"}',
                   "--checkpoint.async-mode", "async")
    ckpt = config.checkpoint
    assert type(ckpt) is VolumeCheckpointManager.Config
    assert ckpt._owner is VolumeCheckpointManager
    # the preset's settings carried over, the command line's on top
    assert (ckpt.folder, ckpt.keep_every, ckpt.async_mode, ckpt.keep_latest_k,
            ckpt.last_save_model_only, ckpt.enable) == (
        "s3://bucket/run", 10, "async", 3, False, True)
    with pytest.raises(ValueError, match="unknown checkpoint options"):
        use_volumes(preset(), folder="s3://b/r", keep_evry=2)
    assert ckpt.fsspec_options() == {"endpoint_url": "http://h:1"}
    assert "h:1" not in repr(ckpt)  # options may hold credentials: not in reprs or logs
    with pytest.raises(SystemExit):  # tyro turns the ValueError into its usage error
        parse("--checkpoint.storage-options-json", '{"key": "s3cr3t"')
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "s3cr3t" not in err


def test_train_kill_resume_reshard(seaweedfs) -> None:
    import json

    store = seaweedfs.store()
    url = store.url("titan")
    options = {"json": json.dumps(store.storage_options)}

    # 1. train 1-6 saving 3, 4, 5 with keep_latest_k=2; the save of 6 loses rank 1
    reported = run_ranks_with_victim(
        2, 1, job, url, options, {"steps": range(1, 8), "save": {3, 4, 5}, "keep": 2,
                                  "bomb_step": 6, "bomb": 1}, label="train, killed save")
    assert set(reported) == {0} and reported[0][0], reported
    first = reported[0][1]
    assert not first["resumed"] and first["failed"] and sorted(first["losses"]) == [1, 2, 3, 4,
                                                                                   5, 6]
    reference = first["losses"]  # step 6's loss came before its save
    infos = catalog.list_checkpoints(url, storage_options=store.storage_options)
    assert [(i.name, i.complete) for i in infos] == [
        ("step-4", True), ("step-5", True), ("step-6", False)]
    left = objects(store, url)
    # retention left nothing of step 3 behind, not even a shard; step 6 has rank 0's shards
    assert {n.split("/")[0] for n in left} == {"step-4", "step-5", "step-6"}, left
    assert "step-6/.metadata" not in left and any(n.endswith(".distcp") for n in left
                                                   if n.startswith("step-6/"))
    # written by VolumeWriter (its manifest), not torch's FsspecWriter
    assert {n.split("/")[0] for n in left if "/.dcpv-manifest-" in n} == {"step-4", "step-5"}

    # 2. resume skips the incomplete step-6: the same loss as never interrupted; async saves
    resumed = run_ranks(2, job, url, options, {"steps": [6, 7], "save": {6, 7},
                                               "async": "async", "full_state": True},
                        label="resume")
    for r in resumed:
        assert (r["resumed"], r["resumed_step"]) == (True, 5)
        assert r["losses"][6] == reference[6]
    # the newest step was found with one listing in all, on rank 0
    assert [r["listings"] for r in resumed] == [1, 0]
    assert catalog.latest(url, storage_options=store.storage_options).name == "step-7"

    # 3. the async save at 7 loads on 1 rank: DCP reshards, every value as the 2 ranks held it
    one = run_ranks(1, job_resumed_state, url, options, label="reshard")[0]
    held = resumed[0]["full"]
    assert one.keys() == held.keys()
    assert any(k.endswith("exp_avg") for k in one)
    for key, value in held.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == one[key].dtype and np.array_equal(one[key], value), key
        else:
            assert one[key] == value, key
    assert one["train_state"] == (7, 7 * 16)
    # ... and its pinned-memory-mode save (process executor) committed step 8, which loads
    newest = catalog.latest(url, storage_options=store.storage_options)
    assert newest is not None and newest.name == "step-8"



def test_last_step_save_is_not_purged_and_the_cpu_route_starts_fresh(seaweedfs) -> None:
    """What docs/integrations/torchtitan.md states: torchtitan's ``save(step,
    last_step=True)`` returns before it queues the purge, so ``keep_latest_k=2`` leaves 3
    complete checkpoints after a run's last save; the next run's first save purges to 2.
    And the manager built without torchtitan's Trainer starts fresh on an empty folder."""
    store = seaweedfs.store()
    url = store.url("titan-last")
    got = run_ranks(1, job_last_step, url, store.storage_options, label="last step")[0]
    assert got["loaded"] == (False, 0)  # nothing stored: load() is False, a fresh start
    assert got["after_first"] == ["step-1", "step-2", "step-3"]  # 3 with keep_latest_k=2
    assert got["resumed"] == (True, 3)  # the last step's checkpoint holds the whole state
    assert got["after_second"] == ["step-3", "step-4"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
