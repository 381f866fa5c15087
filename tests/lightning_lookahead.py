"""A PyTorch Lightning fit over a fastload image Loader, counting what the Loader decoded.

Run by tests/test_lookahead_lightning.py in a child process (Lightning's Trainer starts its own
threads and sets process-wide state), and by hand to measure (the numbers of the look-ahead
under Lightning's call order)::

    python tests/lightning_lookahead.py DATASET --epochs 4 [--reload] [--size 224] [--step-ms 20]

Prints one JSON object: ``puts`` (batches put to the image feeder, by the epoch they were
requested for: every batch requested for an epoch that is then dropped unused is a wasted
decode), ``decoded`` (batches whose decode began, by epoch), ``delivered`` (batches per
epoch the training step saw), ``ahead`` (the Loader's ``batches_ahead`` per epoch: its first
batches requested while the previous epoch ended), ``first_s`` (per epoch, seconds from
Lightning's ``on_train_epoch_start`` to the first ``on_train_batch_start``: the training loop's
wait for its first batch, ``iter()`` and the first ``next()`` included), ``fit_first_s``
(from ``on_fit_start``, before Lightning asks for the loader, to the first batch) and ``calls``
(the Loader calls Lightning made, in order).
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import time
import warnings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--reload", action="store_true", help="reload_dataloaders_every_n_epochs=1")
    ap.add_argument("--size", type=int, default=32, help="vision.train(size)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=5.0, help="each training step sleeps this long")
    a = ap.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    import lightning as L
    import torch

    import fastload
    from fastload.loader.feeder import ImageFeeder

    puts: collections.Counter = collections.Counter()
    decoded: collections.Counter = collections.Counter()
    calls: list[str] = []
    put, fill = ImageFeeder.put, ImageFeeder._fill

    def counted_put(self, idx, epoch):
        puts[epoch] += 1
        return put(self, idx, epoch)

    def counted_fill(self, slot, idx, epoch, runners):
        decoded[epoch] += 1
        return fill(self, slot, idx, epoch, runners)

    ImageFeeder.put, ImageFeeder._fill = counted_put, counted_fill

    class Recorded(fastload.Loader):
        """The Loader, recording the calls Lightning makes on it and on its sampler."""

        def __iter__(self):
            calls.append(f"iter@{self.epoch}")
            return super().__iter__()

    class Data(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.loader: fastload.Loader | None = None

        def train_dataloader(self):
            if self.loader is None:
                self.loader = Recorded(a.data, batch_size=a.batch_size, seed=3, prefetch=a.prefetch, device="cpu",
                                       transforms={"image": fastload.vision.train(a.size)})
                sampler = self.loader.sampler
                set_epoch = sampler.set_epoch

                def recorded_set_epoch(epoch: int) -> None:
                    calls.append(f"sampler.set_epoch({epoch})")
                    set_epoch(epoch)

                sampler.set_epoch = recorded_set_epoch
            return self.loader

        def teardown(self, stage: str) -> None:
            if self.loader is not None:
                self.loader.close()

    data = Data()
    delivered: collections.Counter = collections.Counter()
    ahead: dict[int, int] = {}
    first_s: dict[int, float] = {}
    started: dict[int, float] = {}

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def on_fit_start(self) -> None:
            started["fit"] = time.perf_counter()

        def on_train_epoch_start(self) -> None:
            started[self.current_epoch] = time.perf_counter()

        def on_train_batch_start(self, batch, batch_idx: int) -> None:
            if batch_idx == 0:
                now = time.perf_counter()
                first_s[self.current_epoch] = now - started[self.current_epoch]
                started.setdefault("fit_first", now - started["fit"])

        def training_step(self, batch, batch_idx: int):
            e = self.current_epoch
            delivered[e] += 1
            ahead[e] = data.loader.stats()["batches_ahead"]
            time.sleep(a.step_ms / 1000)
            return self.net(batch["image"].float().mean(dim=(2, 3))).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=a.epochs, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        reload_dataloaders_every_n_epochs=1 if a.reload else 0)
    trainer.fit(Model(), datamodule=data)
    out = {"puts": puts, "decoded": decoded, "delivered": delivered, "ahead": ahead, "first_s": first_s,
           "fit_first_s": started["fit_first"], "calls": calls}
    print(json.dumps({k: {str(e): n for e, n in v.items()} if isinstance(v, dict) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
