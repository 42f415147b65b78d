"""The transformers Trainer's checkpoints through ``VolumeTrainer`` vs the Trainer's own route
to the same store (issue 20, part 3): save and resume time, 2 DDP ranks (gloo, CPU).

The Trainer writes only to a local directory, so its route to an object store is: its own
``_save_checkpoint`` to local disk, then an upload of ``checkpoint-N/`` with s3fs
(``fs.put(..., recursive=True)``, from rank 0, which holds every file on one machine); and to
resume: one listing of the root to find the newest checkpoint, a download with s3fs
(``fs.get``), then its own ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler`` /
``_load_rng_state``. ``VolumeTrainer``'s save is its ``_save_checkpoint`` (one DCP save
through the Checkpointer); its resume is what ``train(resume_from_checkpoint=True)`` does
before training: :func:`dcp_volumes.catalog.latest`, the small load (trainer state, RNG) and
the model + optimizer + scheduler load. Both are timed on rank 0 from a barrier to a barrier
(every rank done). Training and the Trainer's set-up (the same in both) are not timed.

The state is a tiny-vocabulary Llama (random init) after one AdamW step: fp32 weights plus
two optimizer moments (``--hidden 384``: about 117 MiB). Profiles: ``direct`` (SeaweedFS on
127.0.0.1) and ``s3-like`` (a FaultProxy process adding ``--first-byte-delay`` per response
and capping each connection at ``--bandwidth`` bytes/s). Routes alternate within each
repetition (vol, hf, vol, hf ...), after one unrecorded warm-up repetition (process groups,
connections, the Checkpointer's writer); each checkpoint is deleted after its resume. Prints one
JSON line per measurement and a markdown table of medians (min–max)::

    python benchmarks/integration_huggingface.py --reps 3 \\
        --out benchmarks/results/integration-huggingface.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20


def _trainer(hidden: int, root: str, options: dict[str, Any], out_dir: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from dcp_volumes.integrations.huggingface import VolumeTrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": r, "labels": r.clone()}
            for r in torch.randint(0, 4096, (16, 32), generator=g)]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=1,
                             save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True,
                             learning_rate=1e-3)
    trainer = VolumeTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=data,
                            checkpoint_root=root, storage_options=options)
    trainer.train()  # one step: the optimizer has its moments
    return trainer


def _timed(fn: Any, *args: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - start


def _vol_resume(trainer: Any) -> None:
    url = trainer._resume_url(True)
    with tempfile.TemporaryDirectory() as local:
        trainer._resume = trainer._load_small(url, local)
        try:
            trainer._load_optimizer_and_scheduler(local)
            trainer._load_rng_state(local)
        finally:
            trainer._resume = None


def _hf_save(trainer: Any, fs: Any, root: str, rank: int) -> None:
    import torch.distributed as dist
    from transformers import Trainer

    Trainer._save_checkpoint(trainer, trainer.model_wrapped, None)
    dist.barrier()
    if rank == 0:
        name = f"checkpoint-{trainer.state.global_step}"
        fs.put(os.path.join(trainer.args.output_dir, name), f"{root}/{name}", recursive=True)


def _hf_resume(trainer: Any, fs: Any, root: str, rank: int, local: str) -> None:
    import torch.distributed as dist
    from transformers import Trainer

    if rank == 0:
        os.makedirs(local, exist_ok=True)
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        newest = max((n for n in names if n.startswith("checkpoint-")),
                     key=lambda n: int(n.split("-")[1]))
        fs.get(f"{root}/{newest}", os.path.join(local, newest), recursive=True)
        box = [newest]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(local, str(box[0]))
    Trainer._load_from_checkpoint(trainer, path)
    Trainer._load_optimizer_and_scheduler(trainer, path)
    Trainer._load_rng_state(trainer, path)


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _rank(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    import shutil

    import fsspec
    import torch
    import torch.distributed as dist

    from dcp_volumes import catalog

    torch.set_num_threads(1)
    trainers = {p: _trainer(spec["hidden"], f"{spec['root']}/{p}/vol", o,
                            os.path.join(spec["tmp"], f"{p}-{rank}"))
                for p, o in spec["profiles"].items()}
    state_bytes = _tensor_bytes(next(iter(trainers.values())).checkpoint_state())
    rows = []
    for rep in range(-1, spec["reps"]):  # rep -1 warms both routes up (not recorded)
        for profile, options in spec["profiles"].items():
            trainer = trainers[profile]
            fs = fsspec.filesystem("s3", **options)
            for route in ("vol", "hf"):
                trainer.state.global_step = 101 + rep
                root = f"{spec['root']}/{profile}/{route}"
                local = os.path.join(spec["tmp"], f"download-{profile}-{route}-{rep}")  # shared
                if route == "vol":
                    save = _timed(trainer._save_checkpoint, trainer.model_wrapped, None)
                    resume = _timed(_vol_resume, trainer)
                else:
                    save = _timed(_hf_save, trainer, fs, root, rank)
                    resume = _timed(_hf_resume, trainer, fs, root, rank, local)
                if rank == 0:
                    if route == "vol":
                        catalog.remove(trainer.checkpointer.url_for(101 + rep),
                                       storage_options=options)
                    else:
                        fs.rm(f"{root}/checkpoint-{101 + rep}", recursive=True)
                        shutil.rmtree(os.path.join(trainer.args.output_dir,
                                                   f"checkpoint-{101 + rep}"), True)
                shutil.rmtree(local, True)
                dist.barrier()
                if rep >= 0:
                    rows.append({"rep": rep, "profile": profile, "route": route, "save_s": save,
                                 "resume_s": resume, "state_bytes": state_bytes})
    return rows


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def _table(rows: list[dict[str, Any]]) -> str:
    out = ["| profile | route | save s | resume s | hf ÷ vol save | hf ÷ vol resume |",
           "|---|---|---|---|---|---|"]
    for profile in dict.fromkeys(r["profile"] for r in rows):
        med = {(route, k): statistics.median(r[k] for r in rows
                                             if r["profile"] == profile and r["route"] == route)
               for route in ("vol", "hf") for k in ("save_s", "resume_s")}
        for route in ("vol", "hf"):
            rs = [r for r in rows if r["profile"] == profile and r["route"] == route]
            ratio = ("" if route == "hf" else
                     f"{med[('hf', 'save_s')] / med[('vol', 'save_s')]:.2f} | "
                     f"{med[('hf', 'resume_s')] / med[('vol', 'resume_s')]:.2f}")
            out.append(f"| {profile} | {route} | {_fmt([r['save_s'] for r in rs])} | "
                       f"{_fmt([r['resume_s'] for r in rs])} | {ratio or ' | '} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from dcp_volumes.bench.facts import machine, versions
    from dcp_volumes.bench.target import ProfileProxy
    from dcp_volumes.testing.dist import run_ranks
    from dcp_volumes.testing.servers import start_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=384, help="model width (384: ~117 MiB state)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--first-byte-delay", type=float, default=0.03)
    p.add_argument("--bandwidth", type=float, default=10e6, help="bytes/s per connection")
    p.add_argument("--out", default=None, help="append JSON lines to this file")
    args = p.parse_args(argv)
    server = start_server("seaweedfs")
    proxy = None
    try:
        root = server.create_bucket("hf-bench")
        proxy = ProfileProxy(server.endpoint_url, args.first_byte_delay, args.bandwidth)
        profiles = {"direct": server.storage_options(),
                    "s3-like": server.storage_options(endpoint_url=proxy.endpoint_url)}
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"root": root, "profiles": profiles, "tmp": tmp, "hidden": args.hidden,
                    "reps": args.reps}
            rows = run_ranks(2, _rank, spec, timeout=3000.0)[0]
        for row in rows:
            row.update({"command": " ".join(sys.argv), "ranks": 2, "versions": versions(),
                        "machine": machine(), "time": time.time(),
                        "first_byte_delay": args.first_byte_delay,
                        "bandwidth": args.bandwidth})
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
        print(f"\nstate: {rows[0]['state_bytes'] / MiB:.0f} MiB (weights + 2 AdamW moments)")
        print(_table(rows))
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
