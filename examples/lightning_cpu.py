"""Lightning + dcp_volumes on CPU: 2 ranks train with FSDP2 (``ModelParallelStrategy``),
checkpoint every epoch to a local S3 server, stop; 2 new processes resume from the newest
complete checkpoint and finish. The resumed losses equal those of an uninterrupted run.

Run with ``.venv/bin/python examples/lightning_cpu.py``. It starts SeaweedFS on 127.0.0.1,
launches ranks the way the test suite does (gloo on 127.0.0.1, ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK`` set, the process group already initialized: Lightning's
``LightningEnvironment`` picks both up), and stops the server at the end.

The lines that switch a Lightning script to dcp_volumes are marked ``# dcp_volumes``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from typing import Any

from dcp_volumes import catalog
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.servers import start_server

BATCHES = 4  # per rank per epoch


def fit(rank: int, world: int, root: str, options: dict[str, Any], epochs: int) -> list[float]:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import lightning.pytorch as pl
    import torch
    from torch.distributed.fsdp import fully_shard

    from dcp_volumes.integrations.lightning import VolumeModelParallelStrategy  # dcp_volumes

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                           torch.nn.Linear(64, 1))
            self.losses: list[float] = []

        def configure_model(self) -> None:
            for layer in (*self.net[::2], self.net):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * BATCHES * 4, 16, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)
    strategy = VolumeModelParallelStrategy(  # dcp_volumes
        root, storage_options=options, keep_last=2,  # dcp_volumes
        data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
        callbacks=[pl.callbacks.ModelCheckpoint(every_n_epochs=1, save_on_train_epoch_end=True)])
    model = Net()
    trainer.fit(model, data, ckpt_path=strategy.resume_path())  # dcp_volumes
    return model.losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    print("starting SeaweedFS (S3) on 127.0.0.1 ...", flush=True)
    with start_server("seaweedfs") as server:
        bucket = server.create_bucket("dcpv-lightning")
        options = server.storage_options()
        straight = run_ranks(2, fit, f"{bucket}/straight", options, args.epochs)[0]
        first = run_ranks(2, fit, f"{bucket}/resumed", options, args.epochs - 1)[0]
        print(f"trained {args.epochs - 1} epochs and stopped; checkpoints: " + ", ".join(
            i.name for i in catalog.list_checkpoints(f"{bucket}/resumed",
                                                     storage_options=options)))
        then = run_ranks(2, fit, f"{bucket}/resumed", options, args.epochs)[0]
        kept = [i.name for i in catalog.list_checkpoints(f"{bucket}/resumed",
                                                         storage_options=options)]
    print(f"resumed in new processes for epoch {args.epochs}; kept (keep_last=2): {kept}")
    print(f"rank 0 losses, uninterrupted: {[round(v, 6) for v in straight[-BATCHES:]]}")
    print(f"rank 0 losses, resumed:       {[round(v, 6) for v in then]}")
    if first + then != straight:
        print("FAILED: the resumed run's losses differ from the uninterrupted run's")
        return 1
    print("OK: the resumed run's losses equal the uninterrupted run's, bit for bit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
