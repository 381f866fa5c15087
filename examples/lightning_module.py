"""PyTorch Lightning: a LightningDataModule whose ``train_dataloader()`` returns a fastload Loader.

    python examples/lightning_module.py --data /tmp/ds --make-data 4096              # one process
    python examples/lightning_module.py --data /tmp/ds --devices 2                   # DDP, 2 processes
    python examples/lightning_module.py --data /tmp/ds --devices 2 --resume last     # continue a run

What Lightning does with the Loader, unchanged:

* DDP: Lightning starts one process per device and initialises ``torch.distributed`` before it
  calls ``train_dataloader()``; the Loader takes rank and world size from it, so each rank reads
  its own share of every epoch. Lightning adds no ``DistributedSampler``: it does that only to
  a ``torch.utils.data.DataLoader``.
* Epochs: Lightning calls ``set_epoch`` on the loader's ``sampler`` before each epoch (the
  order is a function of seed and epoch, the same on every rank). When a fit begins or
  resumes, and when it reloads its dataloaders, it does so just after ``iter(loader)``: like a
  ``DataLoader``, a pass follows its sampler's epoch up to its first batch.
* Resume: the Loader has ``state_dict()``/``load_state_dict()``, so Lightning saves its
  position inside every checkpoint (the fit loop's ``combined_loader`` state) and loads it back
  when ``trainer.fit(ckpt_path=...)`` resumes; the resumed run reads exactly the samples the
  interrupted epoch had not read yet (resume on as many devices: Lightning's step counts within
  the epoch assume it). The data module itself needs no ``state_dict``.

``--max-steps`` stops the run early (an interrupted run); ``--record DIR`` writes the sample
indices each rank trained on, one JSON line per step (what the tests check).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
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


class FastloadData(L.LightningDataModule):
    """The training data as a fastload Loader, built once per process (after DDP started)."""

    def __init__(self, path: str | os.PathLike, batch_size: int, seed: int = 0) -> None:
        super().__init__()
        self.path, self.batch_size, self.seed = Path(path), batch_size, seed
        self.loader: fastload.Loader | None = None

    def train_dataloader(self) -> fastload.Loader:
        if self.loader is None:
            # rank and world size from torch.distributed (Lightning initialised it); batches are
            # delivered on this process's device, so Lightning's own device copy has nothing to do
            self.loader = fastload.Loader(self.path, batch_size=self.batch_size, seed=self.seed,
                                          fields=["x", "label"], device=self.trainer.strategy.root_device)
        return self.loader

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()  # joins its threads, frees the ring
            self.loader = None


class Classifier(L.LightningModule):
    def __init__(self, record: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
        self.record = record

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch["x"]), batch["label"])
        self.log("loss", loss, prog_bar=True)
        if self.record is not None:
            with open(Path(self.record) / f"rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"epoch": self.current_epoch, "step": self.global_step, "batch_idx": batch_idx,
                                    "index": batch["index"].tolist()}) + "\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a fastload dataset with fields x (float32[32]) and label")
    ap.add_argument("--make-data", type=int, default=0, help="first write this many synthetic samples there")
    ap.add_argument("--devices", type=int, default=1, help="processes (DDP when more than 1)")
    ap.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (nccl, one GPU per process)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    ap.add_argument("--checkpoints", default="checkpoints", help="directory of Lightning checkpoints")
    ap.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--resume", default=None, help="a checkpoint to continue from, or 'last'")
    ap.add_argument("--reload-every", type=int, default=0,
                    help="Lightning's reload_dataloaders_every_n_epochs (calls train_dataloader() again)")
    ap.add_argument("--record", default=None, help="append each rank's sample indices to DIR/rankN.jsonl")
    a = ap.parse_args(argv)

    data = Path(a.data)
    # Lightning's DDP launcher runs this script once more per extra device (LOCAL_RANK set):
    # only the first process writes the data, before it starts them
    if a.make_data and "LOCAL_RANK" not in os.environ and not (data / "manifest.json").exists():
        make_data(data, a.make_data)
    if a.record:
        Path(a.record).mkdir(parents=True, exist_ok=True)

    L.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=a.checkpoints, filename="{step}", every_n_train_steps=a.save_every,
                                  save_top_k=-1, save_last=True)
    trainer = L.Trainer(accelerator=a.accelerator, devices=a.devices,
                        strategy="ddp" if a.devices > 1 else "auto", max_epochs=a.epochs, max_steps=a.max_steps,
                        callbacks=[checkpoints], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, reload_dataloaders_every_n_epochs=a.reload_every)
    dm = FastloadData(data, a.batch_size)
    trainer.fit(Classifier(a.record), datamodule=dm, ckpt_path=a.resume)
    if trainer.is_global_zero:
        print(f"trained to epoch {trainer.current_epoch}, step {trainer.global_step}, "
              f"loss {float(trainer.callback_metrics['loss']):.3f}; last checkpoint {checkpoints.last_model_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
