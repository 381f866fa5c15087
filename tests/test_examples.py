"""The examples run in a shortened form so they cannot rot: the MLP with both loaders, the
image script alone, and under torchrun (2 gloo ranks) resumed on 1 rank from its checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from _zygote import run_python

ROOT = Path(__file__).resolve().parent.parent


def run(*args, cwd, timeout=300, **launcher):
    """``python *args``, forked from the tests' process launcher (tests/_zygote.py: a fresh
    process without the start-up of a new interpreter); ``launcher``: ``preload`` /
    ``fork_python`` (the Python processes it starts forked too: torchrun's, Lightning's ranks)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = run_python(*args, timeout=timeout, env=env, cwd=cwd, **launcher)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


def test_mnist_mlp_both_loaders(tmp_path):
    out = run(ROOT / "examples" / "mnist_mlp.py", "--samples", "3000", "--epochs", "2", "--steps", "5", cwd=tmp_path)
    assert "DataLoader epoch 1" in out and "fastload   epoch 1" in out and "median time per epoch" in out


def test_train_images_ddp_then_resume_on_another_world_size(tmp_path):
    script = ROOT / "examples" / "train_images.py"
    common = ["--data", tmp_path / "ds", "--size", "32", "--batch-size", "8", "--epochs", "2",
              "--checkpoint", tmp_path / "ckpt.pt", "--save-every", "1"]
    out = run(script, *common, "--make-data", "48", "--stop-after-steps", "2", cwd=tmp_path)
    assert "stopping after step 2" in out and (tmp_path / "ckpt.pt").exists()
    # 2 real ranks (gloo) continue the interrupted epoch from the 1-process checkpoint
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,  # (a port of its own)
              *common, "--stop-after-steps", "4", cwd=tmp_path, fork_python=True)
    assert "resumed at epoch 0, step 2, 16 samples of the epoch already read" in out
    # and 1 rank finishes the run from the checkpoint the 2 ranks wrote
    out = run(script, *common, cwd=tmp_path)
    assert "resumed at epoch 0, step 4, 48 samples of the epoch already read" in out  # 16 + 2 steps x 2 ranks x 8
    assert "epoch 1: loss" in out
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["epoch"] == 2


def test_train_tokens_packed_then_resumed_inside_the_epoch(tmp_path):
    script = ROOT / "examples" / "train_tokens.py"
    common = ["--data", tmp_path / "tok", "--checkpoint", tmp_path / "ck.pt", "--seq-len", "64", "--rows", "8"]
    out = run(script, *common, "--make-data", "600", "--stop-after-steps", "8", cwd=tmp_path)
    assert "stopping after step 8" in out
    out = run(script, *common, cwd=tmp_path)
    assert "resumed at epoch 0, step 8, 4096 tokens of the epoch already read" in out  # 8 steps x 8 rows x 64
    last = [line for line in out.splitlines() if line.startswith("epoch 0: first loss")][0]
    first_loss, final_loss = float(last.split()[4].rstrip(",")), float(last.split()[-1])
    assert final_loss < 0.6 * first_loss, last  # it learns: counting sequences are predictable
