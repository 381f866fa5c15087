"""Image classification with fastload.vision presets, DDP and exact checkpoint/resume.

    python examples/train_images.py --data /tmp/ds --make-data 512          # one process
    torchrun --nproc-per-node 2 examples/train_images.py --data /tmp/ds     # DDP (nccl with a GPU per rank, else gloo)
    python examples/train_images.py --data /tmp/ds --checkpoint ckpt.pt     # resumes if ckpt.pt exists

The checkpoint holds the model, the optimizer, the epoch and the loader's position
(``loader.state_dict()``: plain JSON, stored as a string so ``torch.load(weights_only=True)``
works). A run restarted from it, on the same or another number of ranks, reads exactly the
samples the interrupted epoch had not read yet, with the same crops.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fastload
from fastload import vision


def tiny_cnn(classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def save(path: Path, model, opt, epoch: int, step: int, loader) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "step": step,
                "loader": json.dumps(loader.state_dict())}, tmp)
    os.replace(tmp, path)  # never a half-written checkpoint


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a fastload dataset with an image and a label field")
    ap.add_argument("--make-data", type=int, default=0, help="first generate and convert this many photos")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps-per-epoch", type=int, default=None)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--save-every", type=int, default=2, help="steps between checkpoints")
    ap.add_argument("--stop-after-steps", type=int, default=None, help="simulate a crash after this many steps")
    a = ap.parse_args(argv)

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # One GPU per local rank, or none: with fewer GPUs than local ranks, train on the CPU (gloo).
    local_rank, local_ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before anything touches CUDA: no context on cuda:0 from this rank
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank() if distributed else 0
    data = Path(a.data)
    if a.make_data and rank == 0 and not (data / "manifest.json").exists():
        from fastload.demo.photos import make_image_folder
        make_image_folder(data.with_name(data.name + "-src"), a.make_data, seed=0)
        fastload.convert("imagefolder", data.with_name(data.name + "-src"), data, progress=False)
    if distributed:
        dist.barrier()

    ds = fastload.Dataset(data)
    loader = fastload.Loader(ds, batch_size=a.batch_size, device=device, seed=0,
                             transforms={"image": vision.train(a.size)})  # rank/world from torch.distributed
    net = tiny_cnn(len(ds.class_names or [])).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    start_epoch, step = 0, 0
    ckpt = Path(a.checkpoint) if a.checkpoint else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(json.loads(state["loader"]))
        start_epoch, step = state["epoch"], state["step"]
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, step {step}, "
                  f"{json.loads(state['loader'])['sampler']['consumed']} samples of the epoch already read")

    model = nn.parallel.DistributedDataParallel(net) if distributed else net
    try:
        for epoch in range(start_epoch, a.epochs):
            loader.set_epoch(epoch)  # keeps a loaded mid-epoch position
            t0, seen, loss_sum = time.perf_counter(), 0, 0.0
            for i, batch in enumerate(loader):
                if a.steps_per_epoch is not None and i >= a.steps_per_epoch:
                    break
                loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                seen += len(batch["label"])
                loss_sum += loss.item() * len(batch["label"])
                if ckpt is not None and rank == 0 and step % a.save_every == 0:
                    save(ckpt, net, opt, epoch, step, loader)
                if a.stop_after_steps is not None and step >= a.stop_after_steps:
                    if rank == 0:
                        print(f"stopping after step {step} (simulated crash)")
                    return 0
            dt = time.perf_counter() - t0
            if rank == 0 and seen:
                print(f"epoch {epoch}: loss {loss_sum / max(seen, 1):.3f}, {seen / dt:,.0f} images/s on rank 0, "
                      f"waited for data {loader.stats()['wait_fraction']:.0%} of the time")
            if ckpt is not None and rank == 0:
                loader.set_epoch(epoch + 1)  # the saved position: the start of the next epoch
                save(ckpt, net, opt, epoch + 1, step, loader)
        return 0
    finally:
        loader.close()
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
