"""Language-model tokens: packed sequences from a fastload dataset vs the usual DataLoader +
padding collate_fn vs memcpy of the same bytes, in one run.

    .venv/bin/python bench/bench_tokens.py            # 100M tokens (writes ~400 MB to a temp dir)
    .venv/bin/python bench/bench_tokens.py --smoke    # 2M tokens, one repeat (seconds)
    .venv/bin/python bench/bench_tokens.py --tokens 20e6 --repeats 3

The corpus: documents of log-normal length (median ~600 tokens, 1..16k), int32 token ids,
stored as one ragged field (``int32[]``). Rows measured (tokens/s counts real tokens):

  * fastload Loader, ``pack_to=2048``, ``batch_size=8`` (8 rows of 2048 tokens per batch,
    shuffled documents, document boundaries as cu_seqlens and positions): one epoch;
  * fastload Loader, padded (``batch_size`` documents per batch, ``(B, L_max)`` + lengths);
  * torch DataLoader over the same documents held as a list of tensors (the usual
    map-style dataset), shuffled, ``collate_fn`` padding each batch with ``pad_sequence``
    (num_workers 0 and 2; epochs of 400 random batches, run to their end), as many documents
    per batch as fill 16,384 tokens on average;
  * memcpy (the limit): per packed batch, the bytes a ``pack_to`` batch delivers — tokens
    (int32), positions (int64), cu_seqlens (int32) and the per-piece index (int64), on
    average over the epoch — copied from the corpus in memory into one of as many rotating
    destination buffers as the Loader has ring slots (not one cache-hot buffer), as many
    batches as the packed epoch has.

Every row, the DataLoader's included, is measured round-robin so ratios hold on a machine
whose memory bandwidth drifts; figures are medians (min–max), ratios carry the spread of the
per-round ratios. Batches are consumed as torch tensors, like a training loop. The
GB/s column counts every byte delivered (positions, offsets and index included; padding too
for the padded Loader); tokens/s counts real tokens.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

from fastload.bench.machine import equal_priority
from fastload.bench.report import Measurement, headline, interleaved_times, print_table, system_info

ROWS, SEQ = 8, 2048
BATCH_TOKENS = ROWS * SEQ


def make_corpus(path: str, tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Write the corpus; return (all tokens, lengths) for the baselines."""
    from fastload.store import ShardWriter
    from fastload.store.values import Ragged

    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(np.log(600), 1.0, int(tokens / 800) + 16), 1, 16_384).astype(np.int64)
    cum = np.cumsum(lens)
    lens = lens[:int(np.searchsorted(cum, tokens)) + 1]
    lens[-1] -= int(lens.sum() - tokens)  # exactly `tokens`
    lens = lens[lens > 0]
    values = rng.integers(0, 50_257, int(lens.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    with ShardWriter(path, {"tokens": "int32[]"}, metadata={"source": "bench_tokens"}) as w:
        step = 4096
        for a in range(0, len(lens), step):
            b = min(len(lens), a + step)
            w.write_batch({"tokens": Ragged(values[offsets[a]:offsets[b]], offsets[a:b + 1] - offsets[a])})
    return values, lens


class Docs(torch.utils.data.Dataset):
    """The usual map-style dataset: one tensor per document."""

    def __init__(self, values: np.ndarray, lens: np.ndarray):
        offsets = np.concatenate([[0], np.cumsum(lens)])
        t = torch.from_numpy(values)
        self.docs = [t[offsets[i]:offsets[i + 1]].clone() for i in range(len(lens))]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.docs[i]


def pad_collate(batch: list[torch.Tensor]) -> dict:
    lengths = torch.tensor([len(d) for d in batch])
    return {"tokens": torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=0), "lengths": lengths}


def dataloader_epoch(docs: Docs, docs_per_batch: int, workers: int, max_batches: int):
    """(one epoch of the DataLoader baseline: ``max_batches`` random batches drawn by its
    sampler, so each epoch runs to its end and persistent workers are idle between epochs;
    its counts {"tokens", "padded"}; the DataLoader)."""
    rows = min(len(docs), max_batches * docs_per_batch)
    dl = DataLoader(docs, batch_size=docs_per_batch, sampler=RandomSampler(docs, num_samples=rows),
                    num_workers=workers, collate_fn=pad_collate, persistent_workers=workers > 0)
    count = {"tokens": 0, "padded": 0}

    def epoch() -> None:
        real = padded = 0
        for b in dl:
            real += int(b["lengths"].sum())
            padded += b["tokens"].numel()
        count.update(tokens=real, padded=padded)
    return epoch, count, dl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="2M tokens, one repeat")
    ap.add_argument("--tokens", type=float, default=None, help="corpus size in tokens (default 100M)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 5)")
    a = ap.parse_args(argv)
    equal_priority()  # the rows compared run at one priority (FASTLOAD_NICE=0 unless set)
    import fastload

    tokens = int(a.tokens or (2e6 if a.smoke else 100e6))
    repeats = a.repeats or (1 if a.smoke else 5)
    print(f"# fastload bench_tokens — {system_info()}")
    tmp = tempfile.mkdtemp(prefix="fastload-bench-tokens-")
    try:
        t0 = time.perf_counter()
        values, lens = make_corpus(f"{tmp}/ds", tokens)
        print(f"# corpus: {tokens:,} tokens in {len(lens):,} documents (median {int(np.median(lens))}, "
              f"mean {lens.mean():.0f}, max {lens.max()} tokens), written in {time.perf_counter() - t0:.1f} s")
        docs_per_batch = max(1, round(BATCH_TOKENS / lens.mean()))
        docs = Docs(values, lens)
        dl_batches = 30 if a.smoke else 400
        dls = {w: dataloader_epoch(docs, docs_per_batch, w, dl_batches) for w in (0, 2)}

        packed = fastload.Loader(f"{tmp}/ds", batch_size=ROWS, pack_to=SEQ, seed=0)
        padded = fastload.Loader(f"{tmp}/ds", batch_size=docs_per_batch, seed=0)
        counts: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        epoch = {"packed": 0, "padded": 0}

        def run(name: str, loader, key: str) -> None:
            epoch[name] += 1
            loader.set_epoch(epoch[name])
            n = size = 0
            for b in loader:
                n += int(b[key].sum()) if key == "tokens_lengths" else b["tokens"].numel()
                size += sum(v.element_size() * v.nelement() for v in b.values())
            counts[name], nbytes[name] = n, size

        run("packed", packed, "tokens")  # what a packed epoch delivers: the memcpy copies as much
        batches = len(packed)
        per_batch = -(-nbytes["packed"] // batches)
        corpus = values.view(np.uint8)
        dst = [np.empty(per_batch, np.uint8) for _ in range(packed.options.slots)]

        def memcpy_epoch() -> None:
            at = 0
            for k in range(batches):
                if at + per_batch > len(corpus):
                    at = 0
                np.copyto(dst[k % len(dst)], corpus[at:at + per_batch])
                at += per_batch

        try:
            times = interleaved_times({"packed": lambda: run("packed", packed, "tokens"),
                                       "padded": lambda: run("padded", padded, "tokens_lengths"),
                                       **{f"dl{w}": fn for w, (fn, _, _) in dls.items()},
                                       "memcpy": memcpy_epoch}, repeats=repeats, warmup=1)
        finally:
            packed.close()
            padded.close()
            for _, _, dl in dls.values():
                dl._iterator = None  # shut persistent workers down  # noqa: SLF001
            del docs

        def row(key, *args, **kw):
            return Measurement.from_times(*args[:3], times[key], *args[3:], group="epoch", **kw)

        rows = [
            row("packed", "fastload Loader pack_to=2048 x 8 rows", counts["packed"], nbytes["packed"], "ours",
                "shuffled documents packed into full rows, cu_seqlens + positions"),
            row("padded", "fastload Loader padded", counts["padded"], nbytes["padded"], "ours",
                f"{docs_per_batch} docs/batch as (B, L_max) + lengths (tokens/s counts real tokens)"),
        ]
        for w, (_, c, _) in dls.items():
            waste = 1 - c["tokens"] / max(c["padded"], 1)
            rows.append(row(f"dl{w}", f"DataLoader + pad collate, workers={w}", c["tokens"], c["tokens"] * 4,
                            "dataloader", f"{docs_per_batch} docs/batch, {100 * waste:.0f}% of each batch is padding, "
                            f"{dl_batches} random batches per epoch, round-robin with the rest"))
        rows.append(row("memcpy", "memcpy (1 thread)", batches * BATCH_TOKENS, batches * per_batch, "limit",
                        f"the bytes of each packed batch ({per_batch:,}: tokens, positions, offsets, index) into "
                        f"{len(dst)} rotating buffers"))
        print_table(f"{tokens:,} tokens, int32, batches of {BATCH_TOKENS:,} tokens (samples = tokens)", rows)
        ours = rows[0]
        dl = max((r for r in rows if r.kind == "dataloader"), key=lambda r: r.samples_per_s)
        lim = rows[-1]
        headline(f"LM tokens: pack_to={SEQ} x {ROWS} rows, {tokens / 1e6:.0f}M-token corpus", script="bench_tokens.py",
                 unit="tokens/s", ours=("Loader pack_to", ours.rate_spread), baseline=(dl.system, dl.rate_spread),
                 limit=("memcpy", lim.rate_spread), vs_baseline=ours.paired(dl), vs_limit=ours.paired(lim),
                 smoke=a.smoke,
                 note=f"padded Loader {rows[1].samples_per_s / 1e6:.1f} M tokens/s")
        print("\n## Summary")
        print(f"pack_to: {ours.samples_per_s / 1e6:.1f} M tokens/s = {ours.samples_per_s / dl.samples_per_s:.1f}x "
              f"the best DataLoader + padding collate, {100 * ours.samples_per_s / lim.samples_per_s:.0f}% of memcpy")
        print(f"(total {time.perf_counter() - t0:.0f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
