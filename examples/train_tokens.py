"""A tiny causal language model trained on packed sequences (CPU, seconds).

    python examples/train_tokens.py --data /tmp/tok --make-data 2000         # write a corpus, train
    python examples/train_tokens.py --data /tmp/tok --checkpoint ck.pt --stop-after-steps 20
    python examples/train_tokens.py --data /tmp/tok --checkpoint ck.pt       # resumes inside the epoch

The corpus is one ragged field, ``tokens: int32[]`` — documents of any length (here
generated: each document counts up from a random start, modulo the vocabulary, so there is
something to learn). The Loader packs them into rows of ``--seq-len`` tokens
(``pack_to=``): no padding, documents cut at row ends continue in the next row. Each batch
has ``tokens`` (rows, N), ``tokens_offsets`` (the cu_seqlens of the pieces) and
``tokens_positions`` (each token's position in its document). A ``batch_transform``, run in
a fastload thread beside the training step, turns these into what the model needs:
next-token labels that never cross a document boundary (-100 there) and each token's
document id within its row, for a block-diagonal causal attention mask.

The checkpoint keeps ``loader.state_dict()``: the global count of tokens consumed, so a
resumed run continues at the exact token where it stopped, at any world size.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import fastload


def make_corpus(path: Path, docs: int, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 200, docs)
    starts = rng.integers(0, vocab, docs)
    with fastload.ShardWriter(path, {"tokens": "int32[]"}) as w:
        w.write_batch({"tokens": [((s + np.arange(n)) % vocab).astype(np.int32) for s, n in zip(starts, lens)]})


def labels_and_segments(batch: dict) -> dict:
    """batch_transform: next-token labels inside each document piece, and segment ids."""
    tokens, offsets = batch["tokens"], batch["tokens_offsets"].long()
    rows, n = tokens.shape
    flat = tokens.reshape(-1).long()
    labels = torch.full_like(flat, -100)
    labels[:-1] = flat[1:]
    labels[offsets[1:] - 1] = -100  # the last token of a piece has no next token in it
    segment = torch.zeros(rows * n, dtype=torch.long)
    segment[offsets[1:-1]] = 1
    segment = segment.view(rows, n).cumsum(1)  # pieces never cross a row, so ids restart per row
    return {"input": tokens.long(), "labels": labels.view(rows, n), "segment": segment,
            "positions": batch["tokens_positions"]}


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 48, max_pos: int = 256):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_pos, dim)
        self.max_pos = max_pos
        self.block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True,
                                                dropout=0.0)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x, positions, segment):
        n = x.shape[1]
        h = self.tok(x) + self.pos(positions.clamp(max=self.max_pos - 1))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = causal[None] & (segment[:, :, None] == segment[:, None, :])  # one document at a time
        mask = torch.zeros(allowed.shape, dtype=h.dtype).masked_fill(~allowed, float("-inf"))
        h = self.block(h, src_mask=mask.repeat_interleave(self.block.self_attn.num_heads, 0))
        return self.out(h)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--make-data", type=int, default=0, help="first write a corpus of this many documents")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8, help="rows of --seq-len tokens per batch")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="stop each epoch after this many steps")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--stop-after-steps", type=int, default=None, help="simulate a crash after this many steps")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads for the model (a model this small is fastest on one; the loader's "
                         "threads use the other cores)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(a.torch_threads)
    data = Path(a.data)
    if a.make_data and not (data / "manifest.json").exists():
        make_corpus(data, a.make_data, a.vocab)
    model = TinyLM(a.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = fastload.Loader(data, batch_size=a.rows, pack_to=a.seq_len, seed=0, batch_transform=labels_and_segments)
    ckpt = Path(a.checkpoint) if a.checkpoint else None
    start_epoch, step = 0, 0
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"], state["step"]
        loader.load_state_dict(json.loads(state["loader"]))
        print(f"resumed at epoch {start_epoch}, step {step}, {loader.state_dict()['sampler']['consumed']} tokens of the "
              "epoch already read")
    t0, tokens = time.perf_counter(), 0
    with loader:
        for epoch in range(start_epoch, a.epochs):
            loader.set_epoch(epoch)
            losses = []
            for b in loader:
                logits = model(b["input"], b["positions"], b["segment"])
                loss = nn.functional.cross_entropy(logits.reshape(-1, a.vocab), b["labels"].reshape(-1),
                                                   ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                step += 1
                tokens += b["input"].numel()
                if step % 10 == 0:
                    print(f"epoch {epoch} step {step}: loss {np.mean(losses[-10:]):.3f}")
                if ckpt is not None:
                    tmp = ckpt.with_name(ckpt.name + ".tmp")
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                                "step": step, "loader": json.dumps(loader.state_dict())}, tmp)
                    os.replace(tmp, ckpt)
                if a.stop_after_steps is not None and step >= a.stop_after_steps:
                    print(f"stopping after step {step}")
                    return 0
                if a.steps is not None and len(losses) >= a.steps:
                    break
            print(f"epoch {epoch}: first loss {losses[0]:.3f}, last 10 {np.mean(losses[-10:]):.3f}")
            step = 0
    secs = time.perf_counter() - t0
    print(f"{tokens:,} tokens in {secs:.1f} s ({tokens / secs:,.0f} tokens/s, model included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
