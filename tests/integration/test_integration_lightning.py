"""Lightning integration against the real ``lightning`` package, SeaweedFS and gloo ranks.

One scenario, run once for the module (Lightning's import costs seconds per process), and
tests that read what it recorded:

1. 2 ranks train 3 epochs (12 steps) with :class:`VolumeModelParallelStrategy` (FSDP2 on
   CPU), saving every epoch with ``keep_last=2``; rank 1 is SIGKILLed after uploading its
   shards of step 12 (nothing committed) -- up to there an uninterrupted run;
2. 1 process (world size 2 -> 1) resumes from that root: the incomplete step 12 is skipped;
   in the same process, a single-device run saves and resumes through
   :class:`VolumeCheckpointIO`;
3. 2 new processes resume and train epoch 3 again: their losses equal the uninterrupted
   run's; then Fabric with :class:`VolumeFabricModelParallelStrategy` saves and loads.

Ranks are started by ``run_ranks`` (gloo on 127.0.0.1); Lightning picks up the process group
and the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` variables (``LightningEnvironment``).
"""

from __future__ import annotations

import os
import re
import signal
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dcp_volumes import catalog
from dcp_volumes.testing.dist import run_ranks, run_ranks_with_victim

pytestmark = pytest.mark.xdist_group("lightning")

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

BATCHES = 4  # per rank per epoch, at 2 ranks
WIDTH = 8


@dataclass
class HParams:
    """A dataclass argument of the module, recorded by ``save_hyperparameters()``."""

    width: int = WIDTH
    name: str = "tiny"


# ---- what runs in the ranks -----------------------------------------------------------------
def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _module(cfg: Any = None) -> Any:
    import lightning.pytorch as pl
    import torch
    from torch.distributed.fsdp import fully_shard

    class Tiny(pl.LightningModule):
        def __init__(self, cfg: Any = None) -> None:
            super().__init__()
            if cfg is not None:
                self.save_hyperparameters()  # {"cfg": cfg}, pickled into the checkpoint
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(),
                                           torch.nn.Linear(32, 1))
            self.losses: list[float] = []
            self.start_step: int | None = None
            self.start_weights: dict[str, Any] | None = None
            self.start_optim: Any = None
            self.sgd = False  # plain SGD: no optimizer state at all
            self.loaded_hparams: str | None = None

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.loaded_hparams = repr(checkpoint.get("hyper_parameters"))

        def configure_model(self) -> None:
            if self.device_mesh is None:  # not ModelParallelStrategy
                return
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_start(self) -> None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            self.start_step = self.trainer.global_step
            full = get_model_state_dict(
                self.net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            # plain lists: tensors would cross to the parent as shared memory
            self.start_weights = {k: v.tolist() for k, v in full.items()}
            if self.device_mesh is None:  # one device: the optimizer state, as plain lists
                self.start_optim = _plain(self.trainer.optimizers[0].state_dict()["state"])

        def configure_optimizers(self) -> Any:
            if self.sgd:
                return torch.optim.SGD(self.parameters(), lr=1e-2)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Tiny(cfg)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value.tolist() if hasattr(value, "tolist") else value


def _data() -> Any:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BATCHES * 4, WIDTH, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4,
                                       shuffle=False)


def _kill_after_upload(step: int) -> None:
    """This process SIGKILLs itself once its shards of checkpoint ``step`` are in the store
    (so the coordinator never commits it)."""
    from dcp_volumes import writer as writer_module

    original = writer_module.VolumeWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        future = original(self, plan, planner)
        if self.checkpoint_id.rstrip("/").endswith(f"step-{step:08d}"):
            future.wait()  # this rank's bytes are in the store
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    writer_module.VolumeWriter.write_data = write_then_die  # type: ignore[method-assign]


def _fit(trainer: Any, model: Any, ckpt_path: str | None) -> dict[str, Any]:
    """``trainer.fit``; what it recorded, and the error it raised (if any)."""
    error = message = None
    try:
        trainer.fit(model, train_dataloaders=_data(), ckpt_path=ckpt_path)
    except Exception as exc:  # noqa: BLE001 -- the survivor of a kill: its error is checked
        error, message = type(exc).__name__, str(exc)[:2000]
    return {"losses": model.losses, "start_step": model.start_step, "ckpt_path": ckpt_path,
            "start_weights": model.start_weights, "global_step": trainer.global_step,
            "error": error, "message": message, "hparams": model.loaded_hparams}


def _trainer(world: int, epochs: int, save: bool, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    ckpt_dir = Path(os.environ["LIGHTNING_TEST_TMP"]) / f"mc-{uuid.uuid4().hex[:6]}"
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1,
                                              save_top_k=-1, save_on_train_epoch_end=True)]
    return pl.Trainer(accelerator="cpu", devices=world, max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=save, callbacks=callbacks if save else None,
                      **kwargs), ckpt_dir


def _train(world: int, root: str, options: dict[str, Any], epochs: int, resume: bool,
           save: bool = True) -> dict[str, Any]:
    """Train to ``epochs`` with :class:`VolumeModelParallelStrategy` (``keep_last=2``)."""
    from dcp_volumes.integrations.lightning import VolumeModelParallelStrategy

    # FSDP over every rank ("auto" would make the ranks of one node tensor-parallel)
    strategy = VolumeModelParallelStrategy(root, storage_options=options, keep_last=2,
                                           data_parallel_size=world, tensor_parallel_size=1)
    trainer, ckpt_dir = _trainer(world, epochs, save, strategy=strategy)
    out = _fit(trainer, _module(), strategy.resume_path() if resume else None)
    # ModelCheckpoint decided when; nothing went to its local directory
    out["local_files"] = sorted(os.listdir(ckpt_dir)) if ckpt_dir.exists() else []
    return out


def _checkpoint_io_round_trip(root: str, options: dict[str, Any]) -> dict[str, Any]:
    """A single-device run saves through VolumeCheckpointIO; a new Trainer resumes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from dcp_volumes.integrations.lightning import VolumeCheckpointIO

    io = VolumeCheckpointIO(root, storage_options=options, keep_last=1)
    trainer, _ = _trainer(1, 2, True, plugins=[io])
    first = _fit(trainer, _module(), None)
    saved = get_model_state_dict(trainer.lightning_module.net,
                                 options=StateDictOptions(full_state_dict=True))
    optim = _plain(trainer.optimizers[0].state_dict()["state"])
    model = _module()
    resumed = _fit(_trainer(1, 3, True, plugins=[io])[0], model, io.resume_path())
    return {"first": first, "resumed": resumed, "saved_optim": optim,
            "start_optim": model.start_optim,
            "saved_weights": {k: v.tolist() for k, v in saved.items()}}


def _hparams_round_trip(root: str, options: dict[str, Any]) -> dict[str, Any]:
    """Issue 25, finding 10: save_hyperparameters() holding a Namespace failed the resume
    with a raw UnpicklingError, even with safe_globals=[Namespace] given to the strategy."""
    from argparse import Namespace

    from dcp_volumes.integrations.lightning import VolumeModelParallelStrategy

    def fit(epochs: int, resume: bool, **kwargs: Any) -> dict[str, Any]:
        strategy = VolumeModelParallelStrategy(root, storage_options=options,
                                               data_parallel_size=1, tensor_parallel_size=1,
                                               **kwargs)
        trainer, _ = _trainer(1, epochs, True, strategy=strategy)
        return _fit(trainer, _module(Namespace(width=WIDTH)),
                    strategy.resume_path() if resume else None)

    return {"first": fit(1, False, safe_globals=[Namespace]),
            "not_allowed": fit(2, True),
            "resumed": fit(2, True, safe_globals=[Namespace])}


def _dataclass_hparams_round_trips(strategy_root: str, io_root: str, options: dict[str, Any]
                                   ) -> dict[str, Any]:
    """Issue 37, finding 8.5: ``save_hyperparameters()`` of a dataclass, resumed through the
    strategy and through ``VolumeCheckpointIO``; the latter with plain SGD, whose optimizer
    state is empty (DCP stores no empty container: that resume raised ``KeyError: 'state'``)."""
    from dcp_volumes.integrations.lightning import (
        VolumeCheckpointIO,
        VolumeModelParallelStrategy,
    )

    def through_strategy(epochs: int, resume: bool) -> dict[str, Any]:
        strategy = VolumeModelParallelStrategy(strategy_root, storage_options=options,
                                               data_parallel_size=1, tensor_parallel_size=1,
                                               safe_globals=[HParams])
        trainer, _ = _trainer(1, epochs, True, strategy=strategy)
        return _fit(trainer, _module(HParams()), strategy.resume_path() if resume else None)

    def through_io(epochs: int, resume: bool, **kwargs: Any) -> dict[str, Any]:
        io = VolumeCheckpointIO(io_root, storage_options=options, **kwargs)
        model = _module(HParams())
        model.sgd = True
        trainer, _ = _trainer(1, epochs, True, plugins=[io])
        return _fit(trainer, model, io.resume_path() if resume else None)

    return {"strategy": [through_strategy(1, False), through_strategy(2, True)],
            "io": [through_io(1, False), through_io(2, True),
                   through_io(2, True, safe_globals=[HParams])]}


def _fabric_round_trip(rank: int, world: int, root: str, options: dict[str, Any]
                       ) -> dict[str, Any]:
    """Fabric: train 2 steps, save, load into a fresh model + optimizer, take one more step
    with each: the same loss (weights and optimizer state both came back)."""
    import lightning as L
    import torch
    from torch.distributed.fsdp import fully_shard

    from dcp_volumes.integrations.lightning import VolumeFabricModelParallelStrategy

    def parallelize(model: Any, mesh: Any) -> Any:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    strategy = VolumeFabricModelParallelStrategy(root, parallelize, storage_options=options,
                                                 data_parallel_size=world,
                                                 tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()

    def make() -> tuple[Any, Any]:
        torch.manual_seed(0)
        net = fabric.setup_module(torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
        return net, fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-2))

    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 + rank))

    def step(net: Any, opt: Any) -> float:
        loss = net(x).pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    net, opt = make()
    # issue 26: the documented line on a first run (nothing stored yet) loads nothing
    first = {"model": net, "optim": opt, "step": 0}
    first_rest = fabric.load(strategy.resume_path(), first)
    for _ in range(2):
        step(net, opt)
    fabric.save(strategy.url_for(2), {"model": net, "optim": opt, "step": 2, "note": "a"})
    # the same state again as step 3, then damaged behind the writer's back: complete (so
    # resume_path() names it), but its data fails its checksum
    fabric.save(strategy.url_for(3), {"model": net, "optim": opt, "step": 3, "note": "a"})
    if rank == 0:
        _flip_a_byte(strategy.url_for(3), options)
    fabric.barrier()
    named = strategy.resume_path()
    net2, opt2 = make()
    state = {"model": net2, "optim": opt2, "step": 0}
    rest = fabric.load(named, state)  # step 3 is skipped with a WARNING; step 2 loads
    # the run's next save of the damaged step replaces it (not refused as existing)
    fabric.save(strategy.url_for(3), {"model": net2, "optim": opt2, "step": 3, "note": "b"})
    return {"first_rest": first_rest, "first_step": first["step"], "named": named,
            "resaved": strategy.resume_path(),
            "step": state["step"], "rest": rest, "next": step(net, opt),
            "next_loaded": step(net2, opt2)}


def _flip_a_byte(url: str, options: dict[str, Any]) -> None:
    """Flip one byte of the checkpoint's first shard file, behind the writer's back."""
    import fsspec

    fs, path = fsspec.url_to_fs(url, skip_instance_cache=True, **options)
    shard = min(p for p in fs.find(path) if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[5] ^= 0x01
    fs.pipe_file(shard, bytes(data))


def _killed_run(rank: int, world: int, root: str, options: dict[str, Any]) -> dict[str, Any]:
    _quiet()
    if rank == 1:
        _kill_after_upload(3 * BATCHES)
    return _train(world, root, options, 3, False)


def _one_rank_then_checkpoint_io(rank: int, world: int, root: str, io_root: str,
                                 hp_roots: list[str], options: dict[str, Any]
                                 ) -> dict[str, Any]:
    _quiet()
    return {"one_rank": _train(world, root, options, 3, True, save=False),
            "io": _checkpoint_io_round_trip(io_root, options),
            "hparams": _hparams_round_trip(hp_roots[0], options),
            "dataclass_hparams": _dataclass_hparams_round_trips(hp_roots[1], hp_roots[2],
                                                                options)}


def _resumed_then_fabric(rank: int, world: int, root: str, fabric_root: str,
                         options: dict[str, Any]) -> dict[str, Any]:
    _quiet()
    return {"resumed": _train(world, root, options, 3, True),
            "fabric": _fabric_round_trip(rank, world, fabric_root, options)}


# ---- the scenario, once ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def scenario(seaweedfs: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    os.environ["LIGHTNING_TEST_TMP"] = str(tmp_path_factory.mktemp("lightning"))
    run, io, fab = seaweedfs.store(), seaweedfs.store(), seaweedfs.store()
    hp_roots = [seaweedfs.store().root for _ in range(3)]
    opts = run.storage_options
    out: dict[str, Any] = {"root": run.root, "io_root": io.root}
    out["killed"] = run_ranks_with_victim(2, 1, _killed_run, run.root, opts, timeout=240)
    out["killed_listing"] = catalog.list_checkpoints(run.root, storage_options=opts)
    out.update(run_ranks(1, _one_rank_then_checkpoint_io, run.root, io.root, hp_roots,
                         opts)[0])
    out["io_listing"] = catalog.list_checkpoints(io.root, storage_options=opts)
    both = run_ranks(2, _resumed_then_fabric, run.root, fab.root, opts)
    out["resumed"] = [b["resumed"] for b in both]
    out["fabric"] = [b["fabric"] for b in both]
    out["final_listing"] = catalog.list_checkpoints(run.root, storage_options=opts)
    yield out


def _names(listing: list[catalog.CheckpointInfo], complete: bool) -> list[str]:
    return sorted(i.name for i in listing if i.complete == complete)


def _step(n: int) -> str:
    return f"step-{n:08d}"


def test_a_killed_save_leaves_an_incomplete_step_that_resume_skips(
        scenario: dict[str, Any]) -> None:
    killed = scenario["killed"]
    assert sorted(killed) == [0]  # rank 1 was SIGKILLed
    ok, out = killed[0]
    assert ok, out
    assert out["error"] is not None  # the survivor's save of step 12 failed: no commit
    assert len(out["losses"]) == 3 * BATCHES  # it trained all of epoch 3 first
    assert _names(scenario["killed_listing"], True) == [_step(4), _step(8)]
    assert _names(scenario["killed_listing"], False) == [_step(12)]
    for rank in (0, 1):
        assert scenario["resumed"][rank]["ckpt_path"] == f"{scenario['root']}/{_step(8)}"


def test_resume_in_new_processes_continues_the_uninterrupted_run_exactly(
        scenario: dict[str, Any]) -> None:
    uninterrupted = scenario["killed"][0][1]["losses"]  # rank 0, steps 1..12
    resumed = scenario["resumed"]
    assert [r["error"] for r in resumed] == [None, None]
    assert [r["start_step"] for r in resumed] == [2 * BATCHES] * 2
    # epoch 3 after resuming from step 8 in new processes: loss for loss, bit for bit
    assert resumed[0]["losses"] == uninterrupted[2 * BATCHES:]
    assert resumed[1]["losses"] != resumed[0]["losses"]  # each rank its own shard of data
    assert [r["local_files"] for r in resumed] == [[], []]


def test_retention_keeps_the_last_two(scenario: dict[str, Any]) -> None:
    # after step 12 committed: 8 and 12 kept, 4 removed; incomplete ones never count
    assert _names(scenario["final_listing"], True) == [_step(8), _step(12)]
    assert _names(scenario["final_listing"], False) == []
    # CheckpointIO, keep_last=1: steps 8 and 16 removed once 16 and 24 committed
    assert _names(scenario["io_listing"], True) == [_step(24)]


def test_resume_on_one_rank_reshards_the_two_rank_checkpoint(scenario: dict[str, Any]) -> None:
    one = scenario["one_rank"]
    assert one["error"] is None
    assert one["start_step"] == 2 * BATCHES
    assert one["ckpt_path"] == f"{scenario['root']}/{_step(8)}"
    # the full weights it starts from are those the 2-rank resume starts from
    assert one["start_weights"] == scenario["resumed"][0]["start_weights"]


def test_checkpoint_io_round_trip_single_device(scenario: dict[str, Any]) -> None:
    io = scenario["io"]
    assert io["first"]["error"] is None and io["resumed"]["error"] is None
    assert io["first"]["global_step"] == 2 * 2 * BATCHES  # 8 batches an epoch on one device
    assert io["resumed"]["ckpt_path"] == f"{scenario['io_root']}/{_step(16)}"
    assert io["resumed"]["start_step"] == 16
    assert io["resumed"]["start_weights"] == io["saved_weights"]
    assert io["saved_optim"] and io["start_optim"] == io["saved_optim"]  # int ids, same values
    assert io["resumed"]["global_step"] == 24


def test_fabric_save_and_load_round_trip(scenario: dict[str, Any]) -> None:
    for out in scenario["fabric"]:
        # fabric.load(strategy.resume_path(), state) on an empty root: nothing loaded
        assert out["first_rest"] == {} and out["first_step"] == 0
        # resume_path() named the damaged step 3; the load fell back to step 2
        assert out["named"].endswith(_step(3)) and out["step"] == 2
        assert out["resaved"].endswith(_step(3))  # replaced by the next save of step 3
        assert out["step"] == 2
        assert out["rest"] == {"note": "a"}  # metadata not asked for comes back
        assert out["next_loaded"] == out["next"]


def test_hyperparameters_with_a_namespace_resume_with_safe_globals(
        scenario: dict[str, Any]) -> None:
    from argparse import Namespace

    """Issue 25, finding 10: the strategy's safe_globals reach Lightning's metadata (the
    hyperparameters); without them the error is typed and says what to pass."""
    hp = scenario["hparams"]
    assert hp["first"]["error"] is None and hp["first"]["global_step"] == BATCHES * 2
    assert hp["not_allowed"]["error"] == "UnsafeCheckpointError"
    # issue 37, finding 8.5: it names the class and both ways to allow it
    assert "references argparse.Namespace" in hp["not_allowed"]["message"]
    assert "safe_globals=[...]" in hp["not_allowed"]["message"]
    assert "weights_only=False" in hp["not_allowed"]["message"]
    assert hp["resumed"]["error"] is None
    assert hp["resumed"]["start_step"] == BATCHES * 2 and hp["resumed"]["global_step"] == 16
    assert hp["resumed"]["hparams"] == repr({"cfg": Namespace(width=WIDTH)})


def test_dataclass_hyperparameters_survive_a_resume(scenario: dict[str, Any]) -> None:
    """Issue 37, finding 8.5: a dataclass in ``save_hyperparameters()`` comes back equal
    through the strategy and ``VolumeCheckpointIO``; without it in ``safe_globals`` the
    error is typed and names it; plain SGD (no optimizer state) resumes."""
    hp = scenario["dataclass_hparams"]
    saved = repr({"cfg": HParams()})
    first, resumed = hp["strategy"]
    assert first["error"] is None and resumed["error"] is None, resumed["message"]
    assert resumed["start_step"] == BATCHES * 2 and resumed["hparams"] == saved
    first, refused, resumed = hp["io"]
    assert first["error"] is None, first["message"]
    assert refused["error"] == "UnsafeCheckpointError"
    assert re.search(r"references \S*\.HParams,", refused["message"]), refused["message"]
    assert resumed["error"] is None, resumed["message"]  # was KeyError: 'state' (SGD)
    assert resumed["start_step"] == BATCHES * 2 and resumed["hparams"] == saved


def test_a_missing_bucket_fails_at_construction(seaweedfs: Any) -> None:
    """Issue 37, finding 8.4: the strategies and ``VolumeCheckpointIO`` made their
    Checkpointer at the first save, so a missing bucket was found after an epoch of training;
    now the constructor checks it (one request), before ``fit``."""
    from dcp_volumes import errors
    from dcp_volumes.integrations.lightning import (
        VolumeCheckpointIO,
        VolumeFabricModelParallelStrategy,
        VolumeModelParallelStrategy,
    )

    store = seaweedfs.store()
    assert store.missing_bucket_root is not None
    root, opts = f"{store.missing_bucket_root}/run", store.storage_options
    makers = {
        "VolumeCheckpointIO": lambda: VolumeCheckpointIO(root, storage_options=opts),
        "VolumeModelParallelStrategy": lambda: VolumeModelParallelStrategy(
            root, storage_options=opts),
        "VolumeFabricModelParallelStrategy": lambda: VolumeFabricModelParallelStrategy(
            root, lambda model, mesh: model, storage_options=opts),
    }
    for name, make in makers.items():
        with pytest.raises(errors.BucketNotFoundError, match="does not exist.*create it") \
                as info:
            make()
        assert "no-such-bucket" in str(info.value), name
