"""torch_checkpointing's CheckpointManager on a local S3 server through dcp_volumes (CPU).

Run with ``.venv/bin/python examples/torch_checkpointing_cpu.py``. It starts SeaweedFS on
127.0.0.1, saves a model + optimizer on 2 gloo ranks with torch_checkpointing's default
(async) saver into ``s3://…/run-1/step-3`` through :class:`VolumeStorage`, loads it in 2
fresh ranks, checks every value bit for bit, prints the objects the save left and the
timings, and stops the server.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import fsspec
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig

from dcp_volumes.integrations.torch_checkpointing import manager_config
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.servers import start_server


def make_state(rank: int, width: int, trained: bool
               ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if trained:
        for _ in range(3):
            model(torch.randn(8, width)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    return model, optim


def save_rank(rank: int, world: int, url: str, options: dict[str, Any], width: int) -> float:
    model, optim = make_state(rank, width, trained=True)
    save = AsyncCheckpointSaverConfig(process_config=CheckpointProcessConfig(
        subprocess_init_timeout_secs=300))  # the writer's process starts slowly on a busy host
    manager = CheckpointManager(manager_config(url, storage_options=options, save=save))
    start = time.perf_counter()
    future = manager.save("step-3", {"model": model.state_dict(), "optim": optim.state_dict(),
                                     "step": 3})
    if future is not None:
        future.result()  # durable and committed
    manager.close()
    return time.perf_counter() - start


def load_rank(rank: int, world: int, url: str, options: dict[str, Any], width: int
              ) -> tuple[bool, float]:
    model, _ = make_state(rank, width, trained=False)
    want_model, want_optim = make_state(rank, width, trained=True)
    manager = CheckpointManager(manager_config(url, storage_options=options,  # loads only:
                                               save=SyncCheckpointSaverConfig()))  # no writer
    start = time.perf_counter()
    got = manager.load("step-3", into={"model": model.state_dict(), "optim": None, "step": None})
    wall = time.perf_counter() - start
    manager.close()
    ok = got["step"] == 3 and all(torch.equal(v, want_model.state_dict()[k])
                                  for k, v in model.state_dict().items())
    for pid, st in want_optim.state_dict()["state"].items():
        ok = ok and all(torch.equal(torch.as_tensor(v),
                                    torch.as_tensor(got["optim"]["state"][pid][k]))
                        for k, v in st.items())
    return ok, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512, help="MLP width (512: ~25 MiB/rank)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with start_server("seaweedfs") as server:
        url = f"{server.create_bucket('tc-demo')}/run-1"
        options = server.storage_options()
        saved = run_ranks(2, save_rank, url, options, args.width, timeout=300)
        loaded = run_ranks(2, load_rank, url, options, args.width, timeout=300)
        fs, root = fsspec.url_to_fs(url, **options)
        objects = sorted(k[len(root) + 1:] for k in fs.find(root))
    print("objects under run-1/:\n  " + "\n  ".join(objects))
    print(f"save (2 ranks, async): {max(saved):.2f}s; load (2 ranks): "
          f"{max(w for _, w in loaded):.2f}s")
    if not all(ok for ok, _ in loaded):
        print("FAILED: loaded values differ")
        return 1
    print("OK: model and AdamW state loaded bit-identical on both ranks; server stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
