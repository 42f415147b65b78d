"""Conformance tests 1-5: round trip, resharding, async_save, commit last, killed saves."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, cast

import pytest
import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_volumes import (
    SpoolOptions,
    VolumeReader,
    errors,
)
from dcp_volumes._compat import HAS_PROCESS_ASYNC_SAVE, TORCH_VERSION
from dcp_volumes.testing._suite_support import (
    SMALL_PARTS,
    MiB,
    RankBudget,
    Store,
    SuiteBase,
    load_with,
    save_with,
    shards_complete,
    versioned,
)
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.scenarios import async_save_on_ranks, load_on_ranks, save_on_ranks
from dcp_volumes.testing.states import assert_state_equal, mixed_state, zeros_like_state


class DurabilityTests(SuiteBase):
    # ---- 1. round trip ---------------------------------------------------------------
    @pytest.mark.parametrize("mode", ["disk", "memory"], ids=["disk-spool", "memory-spool"])
    def test_round_trip_mixed_state(self, store: Store, mode: str) -> None:
        url = store.url()
        state = mixed_state()
        writer = save_with(state, url, store, spool=SpoolOptions(mode=cast(Any, mode)))
        assert writer.last_stats is not None and writer.last_stats.parts >= 3
        out = zeros_like_state(state)
        reader = load_with(out, url, store)
        assert_state_equal(out, state)
        assert reader.last_stats is not None and reader.last_stats.verified

    # ---- 2. multi-rank and resharding --------------------------------------------------
    @pytest.mark.parametrize(("save_ws", "load_ws"), [(2, (1, 3)), (4, (4, 2))],
                             ids=["save2-load1-load3", "save4-load4-load2"])
    def test_multi_rank_resharding(self, store: Store, save_ws: int,
                                   load_ws: tuple[int, ...]) -> None:
        self._need(store, "multi_process", "the store is private to one process")
        url = store.url()
        kw = {"storage_options": store.storage_options, "transfer": SMALL_PARTS}
        budget = RankBudget(self.multi_rank_budget_s)
        stats = run_ranks(save_ws, save_on_ranks, url, kw,
                          **budget.next(f"save on {save_ws} ranks"))
        assert sum(s["bytes"] > 0 for s in stats) >= 2  # replicated writes are spread
        for ws in load_ws:
            loaded = run_ranks(ws, load_on_ranks, url, {"storage_options": store.storage_options},
                               **budget.next(f"load on {ws} ranks (saved on {save_ws})"))
            assert all(s["verified"] for s in loaded)
            # a rank fetches what its new shards need, rounded to 1 MiB checksum blocks
            assert all(s["bytes_fetched"] <= 1.1 * s["bytes_needed"] + 2 * MiB for s in loaded)

    # ---- 3. async_save ------------------------------------------------------------------
    @pytest.mark.parametrize("checkpointer", ["thread", "process"], ids=["thread", "process"])
    def test_async_save_training_continues(self, store: Store, checkpointer: str) -> None:
        self._need(store, "multi_process", "async_save needs a process group and a shared store")
        if checkpointer == "process" and not HAS_PROCESS_ASYNC_SAVE:
            pytest.skip(f"needs dcp.async_save(async_checkpointer_type=AsyncCheckpointerType"
                        f".PROCESS), which torch {TORCH_VERSION} lacks")
        url = store.url()
        opts = store.storage_options
        budget = RankBudget(self.multi_rank_budget_s)
        proxy = None
        if store.proxied_options is not None:
            opts, proxy = store.proxied_options()
            from dcp_volumes.testing.faultproxy import FaultRule

            proxy.clear_rules()
            proxy.add_rule(FaultRule(action="delay", method="PUT", delay_s=0.3, times=None))
        try:
            out = run_ranks(2, async_save_on_ranks, url, {"storage_options": opts,
                                                          "transfer": SMALL_PARTS}, checkpointer,
                            **budget.next(f"async_save ({checkpointer}) on 2 ranks"))
        finally:
            if proxy is not None:
                proxy.clear_rules()
        for o in out:
            assert o["blocked_s"] < o["total_s"]
            if proxy is not None:  # uploads were slowed: training must have made progress
                assert o["steps_during_upload"] > 0
        run_ranks(1, load_on_ranks, url, {"storage_options": store.storage_options},
                  **budget.next("load on 1 rank"))

    # ---- 4. .metadata never visible early ----------------------------------------------
    def test_metadata_invisible_until_data_durable(self, store: Store) -> None:
        url = store.url()
        fs, root = store.raw_fs, store.raw_path(url)
        state = {f"t{i}": torch.randn(50_000) for i in range(8)}
        observations: list[tuple[bool, bool]] = []  # (metadata seen, all shards complete)
        observed = threading.Condition()

        def poll() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                fs.invalidate_cache()
                seen = fs.exists(f"{root}/.metadata")
                complete = shards_complete(fs, root) if seen else False
                with observed:
                    observations.append((seen, complete))
                    observed.notify_all()
                if seen:
                    return
                time.sleep(0.02)

        class _Gated(DefaultSavePlanner):
            """Resolves item k only once the poller has looked k + 1 times: the save is
            observed in progress however slow the store or the machine is."""

            def __init__(self) -> None:
                super().__init__()
                self.resolved = 0

            def resolve_data(self, write_item: Any) -> Any:
                with observed:
                    observed.wait_for(lambda: len(observations) > self.resolved, timeout=60)
                self.resolved += 1
                return super().resolve_data(write_item)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        save_with(state, url, store, planner=_Gated())
        poller.join(120)  # the poller returns once it sees .metadata
        before = [o for o in observations if not o[0]]
        after = [o for o in observations if o[0]]
        assert len(before) >= len(state), "the poller did not observe the save in progress"
        assert after, "the poller never saw the committed .metadata"
        assert all(complete for _, complete in after)

    # ---- 5. killed mid-upload ----------------------------------------------------------
    def test_killed_mid_save_leaves_no_metadata(self, store: Store, tmp_path: Any) -> None:
        self._need(store, "multi_process", "the store is private to one process")
        url = store.url()
        script = tmp_path / "victim.py"
        script.write_text(textwrap.dedent(f"""
            import pickle, sys, torch, torch.distributed.checkpoint as dcp
            from dcp_volumes import VolumeWriter, SpoolOptions, TransferOptions
            from dcp_volumes._compat import no_dist
            from dcp_volumes.testing.suite import SlowPlanner
            opts = pickle.loads(bytes.fromhex(sys.argv[1]))
            state = {{f"t{{i}}": torch.randn(400_000) for i in range(40)}}
            print("start", flush=True)
            # 20 files of 2 items: the first shard is complete (visible) after ~0.2 s of a
            # save that takes >= 4 s, so the kill lands mid-save even on a loaded machine.
            dcp.save(state, storage_writer=VolumeWriter({url!r}, storage_options=opts,
                     spool=SpoolOptions(files_per_rank=20),
                     transfer=TransferOptions(part_size=5 << 20, max_concurrency=2)),
                     planner=SlowPlanner(0.1), **no_dist())
            print("done", flush=True)
        """))
        proc = subprocess.Popen([sys.executable, str(script),
                                 pickle.dumps(store.storage_options).hex()],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if any(n.endswith(".distcp") for n in store.names(url)):
                    break
                assert proc.poll() is None, proc.stdout.read().decode()[-2000:]  # type: ignore[union-attr]
                time.sleep(0.1)
            else:
                pytest.fail("the victim never uploaded a shard")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            output = proc.stdout.read().decode()  # type: ignore[union-attr]
            assert "done" not in output, "the save finished before it could be killed"
            assert proc.returncode == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert ".metadata" not in store.names(url)
        with pytest.raises(errors.IncompleteCheckpointError):
            VolumeReader(url, storage_options=store.storage_options).read_metadata()
        state = versioned(7.0)
        save_with(state, url, store)
        out = versioned(0.0)
        load_with(out, url, store)
        assert_state_equal(out, state)

