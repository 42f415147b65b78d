"""A transformers ``Trainer`` checkpointing to S3 through dcp_volumes, stopped and resumed.

Run with ``.venv/bin/python examples/huggingface_trainer_cpu.py`` (CPU, 2 gloo ranks, no
downloads). It starts SeaweedFS on 127.0.0.1 (a real S3 server), trains a tiny randomly
initialised Llama with :class:`~dcp_volumes.integrations.huggingface.VolumeTrainer` for 4 of
8 steps (a checkpoint every 2, ``save_total_limit=2``), stops; new processes resume from the
newest complete checkpoint in the store and finish; a third run trains all 8 steps without
stopping. The resumed run's losses and final weights must equal the uninterrupted run's.

What changes in a training script, against the plain ``Trainer`` (4 lines; every run, the
first one included, is the same code)::

    from dcp_volumes.integrations.huggingface import VolumeTrainer        # 1
    trainer = VolumeTrainer(model=model, args=args, train_dataset=ds,      # 2 (was Trainer)
                            checkpoint_root="s3://bucket/run-42")          # 3
    trainer.train(resume_from_checkpoint=trainer.resume_path())            # 4 (None: fresh)
"""

from __future__ import annotations

import logging
import sys
import tempfile
from typing import Any

import torch

from dcp_volumes import catalog
from dcp_volumes.testing.dist import run_ranks
from dcp_volumes.testing.servers import start_server

STEPS = 8


def train(rank: int, world: int, root: str, options: dict[str, Any], stop_at: int | None
          ) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from dcp_volumes.integrations.huggingface import VolumeTrainer

    class StopAt(TrainerCallback):  # stands in for a job that is preempted
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": r, "labels": r.clone()}
            for r in torch.randint(0, 128, (64, 32), generator=g)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, max_steps=STEPS, save_steps=2,
            save_total_limit=2, logging_steps=1, learning_rate=5e-3, use_cpu=True, seed=0,
            report_to=[], disable_tqdm=True)
        trainer = VolumeTrainer(model=model, args=args, train_dataset=data,
                                callbacks=[StopAt()], checkpoint_root=root,
                                storage_options=options)
        trainer.train(resume_from_checkpoint=trainer.resume_path())  # None on a first run
    return {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "weights": {k: v.detach().numpy().copy()
                        for k, v in trainer.model.state_dict().items()}}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print("starting SeaweedFS (S3) on 127.0.0.1 ...", flush=True)
    with start_server("seaweedfs") as server:
        bucket = server.create_bucket("dcpv-hf-demo")
        options = server.storage_options()
        run = f"{bucket}/run-1"
        run_ranks(2, train, run, options, STEPS // 2)
        print("stopped at step 4:", [(i.name, i.status) for i in catalog.list_checkpoints(
            run, storage_options=options, step_pattern=r"^checkpoint-(?P<step>\d+)$")])
        resumed = run_ranks(2, train, run, options, None)[0]
        print("resumed and finished:", [(i.name, i.status) for i in catalog.list_checkpoints(
            run, storage_options=options, step_pattern=r"^checkpoint-(?P<step>\d+)$")])
        straight = run_ranks(2, train, f"{bucket}/run-2", options, None)[0]
    same_loss = resumed["losses"] == straight["losses"]
    same_weights = all(v.tobytes() == resumed["weights"][k].tobytes()
                       for k, v in straight["weights"].items())
    for step in sorted(straight["losses"]):
        print(f"step {step}: loss {straight['losses'][step]:.6f} (uninterrupted) "
              f"{resumed['losses'][step]:.6f} (stopped at 4, resumed)")
    if not (same_loss and same_weights):
        print("FAILED: the resumed run differs from the uninterrupted one")
        return 1
    print("OK: stopped + resumed == uninterrupted, bit for bit; server stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
