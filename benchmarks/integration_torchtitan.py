"""torchtitan's checkpoints: its own route to S3 next to dcp_volumes' manager, same store.

Both contenders are torchtitan ``CheckpointManager`` s on 2 gloo ranks, around the same model
(``fully_shard`` on a CPU mesh, torchtitan's ``OptimizersContainer`` with AdamW, so the state
is about 3x the parameters), saving step 1 synchronously to SeaweedFS and then resuming it:

* ``titan-fsspec``: torchtitan's ``CheckpointManager`` with ``folder="s3://..."``: DCP picks
  torch's ``FsspecWriter`` / ``FsspecReader`` (its defaults: one thread per rank,
  ``sync_files=True``); the store is named by ``AWS_ENDPOINT_URL`` and friends, which is how
  torchtitan's fsspec calls reach a non-AWS endpoint;
* ``titan-volumes``: :class:`~dcp_volumes.integrations.torchtitan.VolumeCheckpointManager`
  (``VolumeWriter`` / ``VolumeReader``, ``catalog.latest``), endpoint in its config.

"save s" is rank 0's ``manager.save(1)`` plus a barrier (both ranks done); "resume s" is
``manager.load()`` on fresh model and optimizer objects in the same processes (finding the
step, reading, applying) plus a barrier; every loaded value is checked against what was
saved. Process start-up is not timed; both contenders' clients are warm for the resume
alike. Profiles: ``direct`` (straight to SeaweedFS) and ``s3-like`` (through the bench's
fault proxy process: ``--first-byte-delay`` per response, ``--bandwidth`` per connection each
way). Contenders alternate within each repetition (A B A B ...).

Then, with ``--steps`` committed steps under one folder, the requests each route makes to
find the newest one are counted at a proxy: torchtitan's ``_find_load_step`` (one listing plus
probes per step directory) and ``catalog.latest`` (one listing, then reads of the newest
``.metadata`` and manifest to check it loads)::

    python benchmarks/integration_torchtitan.py --size 128MiB --reps 3 \\
        --out benchmarks/results/integration-torchtitan.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

MiB = 1 << 20
WIDTH = 1024
CONTENDERS = ("titan-fsspec", "titan-volumes")


# --------------------------------------------------------------------------------------------
# one job on each rank


def _build(world: int, layers: int, ckpt: Any) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=optimizers, training_steps=10)
    manager = ckpt.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                         lr_schedulers=schedulers, states={}, sd_adapter=None)
    return model, optimizers, schedulers, manager


def _config(spec: dict[str, Any], url: str) -> Any:
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    from dcp_volumes.integrations.torchtitan import VolumeCheckpointManager

    common = {"enable": True, "folder": url, "interval": 1, "keep_latest_k": 0}
    if spec["contender"] == "titan-fsspec":
        return CheckpointManager.Config(**common)
    return VolumeCheckpointManager.Config(**common, storage_options=spec["options"])


def _digest(model: Any, optimizers: Any) -> list[float]:
    import torch

    with torch.no_grad():
        out = [float(p.to_local().double().sum()) for p in model.parameters()]
        for v in optimizers.state_dict().values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                local = v.to_local() if hasattr(v, "to_local") else v
                out.append(float(local.double().sum()))
    return out


def _rank_job(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(rank)
    ckpt = _config(spec, spec["url"])
    model, optimizers, _, manager = _build(world, spec["layers"], ckpt)
    loss = model(torch.randn(8, WIDTH)).pow(2).mean()
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    saved = _digest(model, optimizers)
    dist.barrier()
    t0 = time.perf_counter()
    manager.save(1)
    dist.barrier()
    save_s = time.perf_counter() - t0
    manager.close()
    torch.manual_seed(100 + rank)  # different values: the load must bring the saved ones
    # (AdamW's state does not exist yet: torch's optimizer state_dict initializes it to load)
    model, optimizers, _, manager = _build(world, spec["layers"], _config(spec, spec["url"]))
    dist.barrier()
    t0 = time.perf_counter()
    resumed = manager.load()
    dist.barrier()
    load_s = time.perf_counter() - t0
    manager.close()
    return {"save_s": save_s, "load_s": load_s, "resumed": resumed,
            "ok": resumed and _digest(model, optimizers) == saved}


def _count_titan(rank: int, world: int, url: str) -> int:
    """Steps found by torchtitan's ``_find_load_step`` (fsspec as it would do it)."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    return int(CheckpointManager._find_load_step(None, folder=url))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# the harness


def _measure(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    from dcp_volumes.testing.dist import run_ranks

    ranks = run_ranks(2, _rank_job, spec, env=env, timeout=900.0, label=spec["contender"])
    return {"save_s": ranks[0]["save_s"], "load_s": ranks[0]["load_s"],
            "ok": all(r["ok"] for r in ranks)}


def _state_bytes(layers: int) -> int:
    params = layers * (WIDTH * WIDTH + WIDTH) * 4
    return 3 * params  # parameters + AdamW's two moments


def _requests_to_find_newest(server: Any, root: str, steps: int) -> dict[str, Any]:
    """Commit ``steps`` tiny steps, then count each route's requests to find the newest."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_volumes import VolumeWriter, catalog
    from dcp_volumes.integrations.torchtitan import STEP_PATTERN
    from dcp_volumes.testing.dist import run_ranks
    from dcp_volumes.testing.faultproxy import FaultProxy

    url = f"{root}/find-{uuid.uuid4().hex[:8]}"
    options = server.storage_options()
    for step in range(1, steps + 1):
        dcp.save({"w": torch.zeros(4)}, storage_writer=VolumeWriter(
            f"{url}/step-{step}", storage_options=options), no_dist=True)
    proxy = FaultProxy(server)
    proxy.start()
    try:
        proxy.reset_stats()
        found = run_ranks(1, _count_titan, url, env=server.env(endpoint_url=proxy.endpoint_url),
                          label="torchtitan _find_load_step")[0]
        titan = proxy.stats.requests
        proxy.reset_stats()
        info = catalog.latest(url, storage_options=server.storage_options(
            endpoint_url=proxy.endpoint_url), step_pattern=STEP_PATTERN)
        ours = proxy.stats.requests
        proxy.reset_stats()
        catalog.list_checkpoints(url, storage_options=server.storage_options(
            endpoint_url=proxy.endpoint_url), step_pattern=STEP_PATTERN, check=0)
        listing = proxy.stats.requests
    finally:
        proxy.stop()
    return {"kind": "find-newest", "steps": steps, "titan_found": found,
            "titan_requests": titan, "volumes_found": info.step if info else None,
            "volumes_requests": ours, "volumes_listing_requests": listing}


def _table(rows: list[dict[str, Any]]) -> str:
    out = [("| profile | contender | save s | resume s | save ÷ titan-fsspec | "
            "titan-fsspec resume ÷ this |"), "|---|---|---|---|---|---|"]
    for profile in dict.fromkeys(r["profile"] for r in rows):
        med = {c: {k: statistics.median(r[k] for r in rows
                                        if r["profile"] == profile and r["contender"] == c)
                   for k in ("save_s", "load_s")} for c in CONTENDERS}
        for c in CONTENDERS:
            vals = {k: [r[k] for r in rows if r["profile"] == profile and r["contender"] == c]
                    for k in ("save_s", "load_s")}
            cell = {k: f"{med[c][k]:.2f} ({min(v):.2f}–{max(v):.2f})" for k, v in vals.items()}
            out.append(f"| {profile} | {c} | {cell['save_s']} | {cell['load_s']} | "
                       f"{med[c]['save_s'] / med['titan-fsspec']['save_s']:.2f} | "
                       f"{med['titan-fsspec']['load_s'] / med[c]['load_s']:.2f} |")
    return "\n".join(out)


def _emit(row: dict[str, Any], out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    from dcp_volumes.bench.facts import machine, versions
    from dcp_volumes.bench.harness import parse_size
    from dcp_volumes.bench.target import ProfileProxy
    from dcp_volumes.testing.servers import start_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=128 * MiB,
                   help="model state (parameters + AdamW moments), default 128MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profiles", default="direct,s3-like")
    p.add_argument("--first-byte-delay", type=float, default=0.030)
    p.add_argument("--bandwidth", type=float, default=10e6, help="bytes/s per connection")
    p.add_argument("--steps", type=int, default=20, help="steps for the request count")
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    args = p.parse_args(argv)
    layers = max(1, round(args.size / _state_bytes(1)))
    facts = {"command": " ".join(sys.argv), "versions": versions(), "machine": machine(),
             "state_bytes": _state_bytes(layers), "layers": layers, "ranks": 2}
    server = start_server("seaweedfs")
    proxies: dict[str, Any] = {}
    try:
        root = server.create_bucket(f"titan-{uuid.uuid4().hex[:8]}")
        rows = []
        for profile in args.profiles.split(","):
            if profile == "s3-like":
                proxies[profile] = ProfileProxy(server.endpoint_url, args.first_byte_delay,
                                                args.bandwidth)
            endpoint = proxies[profile].endpoint_url if profile in proxies else None
            env = server.env(endpoint_url=endpoint)
            options = {"endpoint_url": env["AWS_ENDPOINT_URL"]}
            for rep in range(args.reps):
                for contender in CONTENDERS:
                    url = f"{root}/{profile}-{contender}-{rep}"
                    spec = {"contender": contender, "url": url, "options": options,
                            "layers": layers}
                    row = {"kind": "save-resume", "profile": profile, "contender": contender,
                           "rep": rep, **_measure(spec, env), **facts, "time": time.time()}
                    if profile == "s3-like":
                        row["network_profile"] = {"first_byte_delay_s": args.first_byte_delay,
                                                  "bytes_per_s": args.bandwidth}
                    rows.append(row)
                    _emit(row, args.out)
        _emit({**_requests_to_find_newest(server, root, args.steps), **facts,
               "time": time.time()}, args.out)
        print(_table(rows))
    finally:
        for proxy in proxies.values():
            proxy.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
