"""Train, get killed, resume: the loss curve continues as if nothing happened.

Two gloo ranks on CPU train a small regression model (data-parallel: gradients averaged with
``all_reduce``) and checkpoint through :class:`dcp_volumes.Checkpointer` -- every few steps,
asynchronously, keeping the last two. On start they resume from the newest *complete*
checkpoint under the root. Rank 0 prints ``step N loss X`` for every step it trains.

Two ways to run it::

    # Self-contained demo: starts a local S3 server (moto, or --server seaweedfs), runs an
    # uninterrupted reference, a run SIGKILLed right after step 6's save started, and the
    # resumed run; checks the resumed losses equal the reference's. Exit 0 when they do.
    .venv/bin/python examples/train_resume.py

    # One run against a root you choose (a local directory or any fsspec URL): resumes from
    # the latest complete checkpoint there. --kill-at-step K SIGKILLs every rank right after
    # step K (and its save, if any, started): run it again to resume.
    .venv/bin/python examples/train_resume.py --root /tmp/run-1 --steps 12 --kill-at-step 7
    .venv/bin/python examples/train_resume.py --root /tmp/run-1 --steps 12

The data of step N depends only on N and the rank, and the model and optimizer state come
from the checkpoint, so a resumed run computes bit-identical losses.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

# The launcher only spawns ranks and compares numbers: torch is imported in the ranks, so the
# parent starts fast.


@dataclass
class Config:
    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    steps: int = 12
    save_every: int = 3
    keep_last: int = 2
    kill_at_step: int | None = None
    async_save: bool = True
    world_size: int = 2
    width: int = 16


# ------------------------------------------------------------------------------------------
# One rank


def _rank_main(rank: int, port: int, cfg: Config) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from dcp_volumes import Checkpointer

    dist.init_process_group(
        "gloo", rank=rank, world_size=cfg.world_size, init_method=f"tcp://127.0.0.1:{port}"
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(cfg.width, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    target = torch.randn(cfg.width, 1, generator=torch.Generator().manual_seed(7))

    def state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd}

    ckpt = Checkpointer(
        cfg.root,
        storage_options=cfg.storage_options,
        every_steps=cfg.save_every,
        keep_last=cfg.keep_last,
        async_save=cfg.async_save,
    )
    current = state()
    resumed = ckpt.load_latest(current)
    if resumed is not None:
        set_state_dict(
            model, optim, model_state_dict=current["model"], optim_state_dict=current["optim"]
        )
    if rank == 0:
        print(
            f"resumed from step {resumed}" if resumed is not None else "starting fresh", flush=True
        )

    for step in range((resumed or 0) + 1, cfg.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)  # data of (step, rank) only
        x = torch.randn(8, cfg.width, generator=g)
        y = x @ target + 0.01 * torch.randn(8, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= cfg.world_size
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / cfg.world_size:.10f}", flush=True)
        ckpt.save(step, state())
        if step == cfg.kill_at_step:
            if rank == 0:
                print(f"killing every rank after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no atexit: a real crash
    ckpt.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(cfg: Config) -> int:
    """Spawn ``cfg.world_size`` ranks and wait; returns 0, or 128 + signal if one was killed."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, cfg)) for r in range(cfg.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode or 0 for p in procs]
    if any(c < 0 for c in codes):
        print(f"ranks exited with {codes} (negative: killed by that signal)", flush=True)
        return 128 + max(-c for c in codes if c < 0)
    return max(codes)


# ------------------------------------------------------------------------------------------
# Self-contained demo against a local S3 server

_LOSS_RE = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)


def losses(output: str) -> dict[int, str]:
    """``{step: loss}`` from the output of a run."""
    return {int(m.group(1)): m.group(2) for m in _LOSS_RE.finditer(output)}


def _child(cfg: Config, env: dict[str, str]) -> tuple[int, str]:
    # Runs in its own session so that its SIGKILLed ranks can't take this process with them.
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--config-json",
        json.dumps({k: v for k, v in asdict(cfg).items() if k != "storage_options"}),
    ]
    proc = subprocess.run(
        cmd,
        env={**os.environ, **env},
        check=False,
        capture_output=True,
        text=True,
        start_new_session=True,
        timeout=300,
    )
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "")
    return proc.returncode, proc.stdout


def demo(server_name: str, cfg: Config) -> int:
    from dcp_volumes.testing.servers import start_server

    with start_server(server_name) as server:
        bucket = server.create_bucket("train-resume")
        # Credentials reach the child runs through the environment, not the command line.
        env = {**server.env(), "DCPV_EXAMPLE_ENDPOINT": server.endpoint_url}
        print(f"== {server_name} on {server.endpoint_url}: uninterrupted reference run")
        code, ref_out = _child(
            Config(**{**asdict(cfg), "root": f"{bucket}/reference", "kill_at_step": None}), env
        )
        if code:
            return code
        kill = cfg.kill_at_step or 6
        print(f"== run killed after step {kill}")
        code, _ = _child(
            Config(**{**asdict(cfg), "root": f"{bucket}/run", "kill_at_step": kill}), env
        )
        print(f"   (exit code {code})")
        print("== resumed run")
        code, resumed_out = _child(
            Config(**{**asdict(cfg), "root": f"{bucket}/run", "kill_at_step": None}), env
        )
        if code:
            return code
    ref, got = losses(ref_out), losses(resumed_out)
    same = bool(got) and all(ref.get(s) == v for s, v in got.items())
    print(
        f"resumed steps {min(got)}..{max(got)}: losses "
        f"{'identical to' if same else 'DIFFERENT from'} the uninterrupted run"
    )
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", help="checkpoint root (local dir or URL); omit for the demo")
    parser.add_argument(
        "--server",
        choices=["moto", "seaweedfs"],
        default="moto",
        help="demo only: the local S3 server to start (default moto)",
    )
    parser.add_argument("--endpoint-url", help="S3 endpoint for --root s3://...")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument(
        "--kill-at-step",
        type=int,
        metavar="K",
        help="SIGKILL every rank right after step K (its save started)",
    )
    parser.add_argument("--sync", action="store_true", help="save synchronously")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)  # the demo's child runs
    args = parser.parse_args(argv)

    if args.config_json:
        cfg = Config(**json.loads(args.config_json))
    else:
        cfg = Config(
            root=args.root or "",
            steps=args.steps,
            save_every=args.save_every,
            keep_last=args.keep_last,
            kill_at_step=args.kill_at_step,
            async_save=not args.sync,
            world_size=args.world_size,
        )
        if not args.root:
            return demo(args.server, cfg)
    endpoint = args.endpoint_url or os.environ.get("DCPV_EXAMPLE_ENDPOINT")
    if endpoint and cfg.root.startswith("s3://"):
        cfg.storage_options["endpoint_url"] = endpoint
    return run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
