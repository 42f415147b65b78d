"""torchtitan's CheckpointManager on dcp_volumes, on CPU: train, stop, resume from S3.

Run with ``.venv/bin/python examples/torchtitan_cpu.py``. It starts SeaweedFS on 127.0.0.1 (a
real S3 server), then on 2 gloo ranks builds a small model with ``fully_shard`` on a CPU mesh,
torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``, and the
checkpoint manager torchtitan's trainer would build from ``config.checkpoint`` -- here
:class:`~dcp_volumes.integrations.torchtitan.VolumeCheckpointManager`, selected with
:func:`~dcp_volumes.integrations.torchtitan.use_volumes`. The first job trains 6 steps and
saves every 2 (``keep_latest_k=2``: step-2 is removed, ``.metadata`` first); the processes end; a second job
resumes from the newest complete step and trains on. Its losses match a run that was never
stopped, bit for bit. The server is stopped at the end.

torchtitan's full ``Trainer`` needs an accelerator (and its datasets/tensorboard extras); with
one, the same config function is all a job needs (``--module my_job --config ...``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dcp_volumes import catalog
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.servers import start_server

WIDTH = 64


@dataclass
class Job:
    """Stands in for ``Trainer.Config`` (its ``checkpoint`` field is all this uses)."""

    checkpoint: Any = field(default=None)


def job_config(folder: str, options: dict[str, Any]) -> Job:
    """What a ``--module`` config_registry function returns: a preset, on dcp_volumes."""
    from torchtitan.components.checkpoint import CheckpointManager

    from dcp_volumes.integrations.torchtitan import use_volumes

    preset = Job(checkpoint=CheckpointManager.Config(
        enable=True, interval=2, keep_latest_k=2, last_save_model_only=False))
    return use_volumes(preset, folder=folder, storage_options=options)


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def train(rank: int, world: int, folder: str, options: dict[str, Any], last: int
          ) -> dict[int, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(4 * WIDTH, WIDTH))
    mesh = init_device_mesh("cpu", (world,))
    for part in (model[0], model[2], model):
        fully_shard(part, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=20)
    state = TrainState()
    # the trainer's own call (torchtitan/trainer.py), unchanged
    checkpointer = job_config(folder, options).checkpoint.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None)
    checkpointer.load()  # the newest complete step, or a fresh start
    losses = {}
    for step in range(state.step + 1, last + 1):
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(step))
        loss = model(x[8 * rank: 8 * rank + 8]).pow(2).mean()
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step = step
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = float(total) / world
        checkpointer.save(step)
    checkpointer.maybe_wait_for_saving()  # (async_mode="async": the last save in flight)
    checkpointer.close()  # joins the retention thread
    return losses


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print("starting SeaweedFS (S3) on 127.0.0.1 ...", flush=True)
    with start_server("seaweedfs") as server:
        folder = f"{server.create_bucket('titan-demo')}/run-1"
        options = server.storage_options()
        first = run_ranks(2, train, folder, options, 6)[0]  # trains 1-6, then ends
        names = [i.name for i in catalog.list_checkpoints(folder, storage_options=options)]
        print(f"after job 1 (steps 1-6, keep_latest_k=2): {folder} holds {names}")
        second = run_ranks(2, train, folder, options, 9)[0]  # resumes from step-6
        reference = run_ranks(2, train, f"{folder}-reference", options, 9)[0]  # never stopped
    print(f"job 2 resumed at step {min(second)}; losses {second}")
    same = all(second[s] == reference[s] for s in second)
    print(f"losses equal to an uninterrupted run: {same}")
    ok = names == ["step-4", "step-6"] and min(second) == 7 and same and first[6] == reference[6]
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
