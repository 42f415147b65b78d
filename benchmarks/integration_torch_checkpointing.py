"""torch_checkpointing save + load, 1 rank, sync saver: its stock local-filesystem storage
against dcp_volumes' VolumeStorage on file:// and on a local SeaweedFS (torch_checkpointing
has no object-store route of its own to compare with).

Usage::

    .venv/bin/python benchmarks/integration_torch_checkpointing.py 128 3

(state MiB, repetitions); one JSON line per target on stdout, then a table. Medians.
"""
import json
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

from dcp_volumes.integrations.torch_checkpointing import manager_config
from dcp_volumes.testing.servers import start_server

MiB = 1 << 20
def run(name, cfg, ids, sd, into):
    m = CheckpointManager(cfg)
    saves, loads = [], []
    for i in ids:
        t = time.perf_counter(); m.save(i, sd); saves.append(time.perf_counter() - t)
        t = time.perf_counter(); out = m.load(i, into=into); loads.append(time.perf_counter() - t)
        assert torch.equal(out["model"]["w"], sd["model"]["w"])
    m.close()
    r = {"target": name, "mib": sd["model"]["w"].numel() * 4 / MiB, "reps": len(ids),
         "save_s_median": statistics.median(saves), "load_s_median": statistics.median(loads),
         "saves": saves, "loads": loads}
    print(json.dumps(r), flush=True)
    return r

def main():
    size_mib, reps = int(sys.argv[1]), int(sys.argv[2])
    sd = {"model": {"w": torch.randn(size_mib * MiB // 4)}, "step": 1}
    into = {"model": {"w": torch.zeros(size_mib * MiB // 4)}, "step": None}
    ids = [f"step-{i}" for i in range(reps)]
    d = tempfile.mkdtemp()
    res = []
    cfg = CheckpointManager.Config(save=SyncCheckpointSaverConfig(),
                                   storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    res.append(run("stock LocalFileSystemStorage (local disk)", cfg, [f"{d}/stock/{i}" for i in ids], sd, into))
    res.append(run("VolumeStorage file:// (local disk)", manager_config(f"file://{d}/vol", save=SyncCheckpointSaverConfig()), ids, sd, into))
    with start_server("seaweedfs") as server:
        url = server.create_bucket("tcbench") + "/run"
        res.append(run("VolumeStorage s3:// SeaweedFS (loopback)", manager_config(url, storage_options=server.storage_options(), save=SyncCheckpointSaverConfig()), ids, sd, into))
    shutil.rmtree(d)
    base = res[0]
    print("\n| target | MiB | reps | save s (median) | load s (median) | save × stock | load × stock |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['target']} | {r['mib']:.0f} | {r['reps']} | {r['save_s_median']:.2f} | {r['load_s_median']:.2f} | "
              f"{r['save_s_median']/base['save_s_median']:.2f} | {r['load_s_median']/base['load_s_median']:.2f} |")
    print(f"\ntorch {torch.__version__}, torch_checkpointing 0.1.1, SeaweedFS via dcp_volumes.testing.servers, shared 2-core VM")

if __name__ == "__main__":
    main()
