"""Ray Train: a TorchTrainer whose workers each read their share through a fastload Loader.

    python examples/ray_train.py --data /tmp/ds --make-data 4096 --workers 2
    python examples/ray_train.py --data /tmp/ds --workers 2 --fail-at-step 12   # a worker dies once; Ray restarts

Ray Train starts the workers and initialises ``torch.distributed`` among them (gloo on CPUs,
nccl with ``--gpu``) before it calls ``train_loop_per_worker``; each worker's Loader then takes
rank and world size from ``torch.distributed``, as under torchrun: the ranks read disjoint
shares of every epoch, and no Ray Dataset is involved (the data stays in memory-mapped Arrow
shards that every worker on a node shares through the page cache).

Checkpoints: every ``--save-every`` steps rank 0 reports a checkpoint holding the model, the
optimizer and the Loader's position (``loader.state_dict()``, plain JSON). When a worker fails,
Ray (``FailureConfig(max_failures=...)``) starts the worker group again and
``ray.train.get_checkpoint()`` hands it the last checkpoint: the restarted workers read exactly
the samples the interrupted epoch had not read yet at that checkpoint (the Loader's position is
global, so it holds for any number of workers).

``--record DIR`` writes the sample indices each rank trained on, one JSON line per step (what
the tests check).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import fastload

FEATURES, CLASSES = 32, 4


def make_data(path: Path, n: int, seed: int = 0) -> None:
    """A learnable synthetic classification set (a fixed linear teacher), written once."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES), dtype=np.float32)
    y = (x @ rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)).argmax(axis=1).astype(np.int64)
    with fastload.ShardWriter(path, {"x": f"float32[{FEATURES}]", "label": "int64"}, label="label") as w:
        w.write_batch({"x": x, "label": y})


def train_loop_per_worker(config: dict) -> None:
    """Runs on every Ray Train worker, with torch.distributed already initialised by Ray."""
    import ray.train
    import ray.train.torch

    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device()
    # rank and world size: from torch.distributed (the Loader also checks that every rank opened
    # the same dataset)
    loader = fastload.Loader(config["data"], batch_size=config["batch_size"], seed=0, fields=["x", "label"],
                             device=device)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    start_epoch, step, restored = 0, 0, None
    checkpoint = ray.train.get_checkpoint()  # the last one reported, after a restart
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(json.loads(state["loader"]))
        start_epoch, step = state["epoch"], state["step"]
        restored = step
        if rank == 0:
            print(f"restored from the checkpoint of step {step}: epoch {start_epoch}, "
                  f"{json.loads(state['loader'])['sampler']['consumed']} samples of the epoch already read")
    model = ray.train.torch.prepare_model(net)  # DistributedDataParallel when there are several workers
    record = Path(config["record"]) / f"rank{rank}.jsonl" if config.get("record") else None
    try:
        for epoch in range(start_epoch, config["epochs"]):
            loader.set_epoch(epoch)  # keeps a restored mid-epoch position
            loss_sum, seen = 0.0, 0
            for batch in loader:
                loss = nn.functional.cross_entropy(model(batch["x"]), batch["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                loss_sum, seen = loss_sum + loss.item() * len(batch["label"]), seen + len(batch["label"])
                if record is not None:
                    with open(record, "a") as f:
                        f.write(json.dumps({"epoch": epoch, "step": step, "restored": restored,
                                            "index": batch["index"].tolist()}) + "\n")
                if step == config.get("fail_at_step") and rank == config["workers"] - 1 and restored is None:
                    raise RuntimeError(f"simulated failure of rank {rank} at step {step}")
                if step % config["save_every"] == 0:
                    report(rank, {"epoch": epoch, "step": step, "loss": loss.item()}, net, opt, epoch, step, loader)
            if rank == 0 and seen:
                print(f"epoch {epoch}: loss {loss_sum / seen:.3f} on rank 0 ({seen} samples)")
            loader.set_epoch(epoch + 1)  # the position a checkpoint now holds: the next epoch's start
            report(rank, {"epoch": epoch + 1, "step": step, "loss": loss_sum / max(seen, 1)}, net, opt, epoch + 1,
                   step, loader)
    finally:
        loader.close()


def report(rank: int, metrics: dict, net, opt, epoch: int, step: int, loader) -> None:
    """Every worker reports (Ray waits for all); rank 0 attaches the checkpoint."""
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "step": step,
                        "loader": json.dumps(loader.state_dict())}, Path(d) / "state.pt")
            checkpoint = ray.train.Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a fastload dataset with fields x (float32[32]) and label")
    ap.add_argument("--make-data", type=int, default=0, help="first write this many synthetic samples there")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu", action="store_true", help="one GPU per worker (nccl)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--fail-at-step", type=int, default=None,
                    help="the last rank fails once at this step (Ray restarts from the last checkpoint)")
    ap.add_argument("--storage", default="ray-results", help="where Ray keeps the run's checkpoints")
    ap.add_argument("--address", default=None, help="a Ray cluster to join (default: a local one)")
    ap.add_argument("--record", default=None, help="append each rank's sample indices to DIR/rankN.jsonl")
    a = ap.parse_args(argv)

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    data = Path(a.data).resolve()  # the workers may start in another directory
    if a.make_data and not (data / "manifest.json").exists():
        make_data(data, a.make_data)
    if a.record:
        Path(a.record).mkdir(parents=True, exist_ok=True)
    if a.address:
        ray.init(address=a.address)
    else:  # a private local Ray: one logical CPU per worker even on a smaller machine
        ray.init(num_cpus=max(os.cpu_count() or 1, a.workers), include_dashboard=False)
    try:
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"data": str(data), "batch_size": a.batch_size, "epochs": a.epochs,
                               "save_every": a.save_every, "fail_at_step": a.fail_at_step, "workers": a.workers,
                               "record": str(Path(a.record).resolve()) if a.record else None},
            scaling_config=ScalingConfig(num_workers=a.workers, use_gpu=a.gpu),
            run_config=RunConfig(name="fastload-example", storage_path=str(Path(a.storage).resolve()),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2),
                                 failure_config=FailureConfig(max_failures=1 if a.fail_at_step else 0)))
        result = trainer.fit()
        print(f"finished: {result.metrics}; last checkpoint {result.checkpoint.path if result.checkpoint else None}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
