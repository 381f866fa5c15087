"""Verdicts on the host: the dataset, the limits a job of it meets (pinned memory, memory
mappings and descriptors, ``/dev/shm``) and the threads of this rank (pure functions of
:class:`Facts`)."""
from __future__ import annotations

from .facts import DECODE_WORKERS, FAIL, FD_RESERVE, MAP_RESERVE, OK, SHM_MIN, WARN, Check, Facts, _bytes


NCCL_IB = ("NCCL over InfiniBand (RDMA) registers its communication buffers with the network card, which "
           "page-locks them against this limit: a job across nodes needs ulimit -l unlimited")
RAISE_MEMLOCK = "ulimit -l unlimited (docker run --ulimit memlock=-1; memlock in /etc/security/limits.conf)"


def check_memlock(f: Facts) -> Check:
    """``ulimit -l`` against what the ring page-locks and, for a job across nodes (``WORLD_SIZE``
    above ``LOCAL_WORLD_SIZE``), what NCCL over InfiniBand needs: unlimited."""
    if f.device == "cpu":
        return Check(OK, "pinned memory", "not used with --device cpu")
    if f.memlock is None:
        return Check(WARN, "pinned memory", "cannot read RLIMIT_MEMLOCK (ulimit -l)")
    soft = f.memlock[0]
    limit = _bytes(soft)
    nodes = f.world_size is not None and f.world_size > f.local_world_size
    if nodes and soft >= 0:
        return Check(WARN, "pinned memory", f"ulimit -l {limit}, and this job spans nodes (WORLD_SIZE={f.world_size} "
                     f"> LOCAL_WORLD_SIZE={f.local_world_size}): {NCCL_IB}; raise it: {RAISE_MEMLOCK}")
    ib = "" if soft < 0 else f"; {NCCL_IB}"
    if f.pinned_bytes is None:
        return Check(OK, "pinned memory", f"ulimit -l {limit} (pass a DATASET to compare with the ring's slots){ib}")
    need = f"the ring page-locks up to {_bytes(f.pinned_bytes)}"
    if soft < 0 or soft >= f.pinned_bytes:
        return Check(OK, "pinned memory", f"ulimit -l {limit}; {need}{ib}")
    return Check(WARN, "pinned memory", f"ulimit -l {limit} < {need}: page-locking may be refused (the loader "
                 f"then falls back to slower pageable copies){ib}; raise it: {RAISE_MEMLOCK}")


def check_nofile(f: Facts) -> Check:
    """Shards are memory-mapped without keeping a file descriptor (``fastload._C.map_file``
    closes it right after ``mmap``), so ``ulimit -n`` does not bound their number: each is
    one memory mapping (one VMA, never split: the mapping is read-only and never advised),
    and the limit on those is ``vm.max_map_count``; a reader and a Loader's ring each keep at
    most :func:`~fastload.store.mapped.mapped_shard_limit` shards mapped (a quarter of it, at
    most 4096; ``$FASTLOAD_MAPPED_SHARDS``). The open-file limit only has to leave
    the process its own descriptors (:data:`FD_RESERVE`)."""
    if f.nofile is None:
        return Check(WARN, "open files", "cannot read RLIMIT_NOFILE (ulimit -n)")
    soft, hard = f.nofile
    base = (f"ulimit -n {soft}; shards are memory-mapped without keeping a file descriptor, so it does not "
            "limit their number")
    if 0 <= soft < FD_RESERVE:
        return Check(WARN, "open files", f"{base}, but {soft} descriptors leave too few for Python, torch, DALI "
                     f"and sockets; {_raise_nofile(soft, hard)}")
    if f.shards is None:
        return Check(OK, "open files", f"{base} (pass a DATASET to compare its shards with vm.max_map_count)")
    from ..store.mapped import ENV_LIMIT, mapped_shard_limit

    try:
        most = mapped_shard_limit(f.max_map_count)
    except ValueError as e:  # a bad $FASTLOAD_MAPPED_SHARDS
        return Check(WARN, "open files", f"{base}; {e}")
    # every shard mapped once; past the limit, the reader's and the ring's (mostly the same shards)
    need = (f.shards if f.shards <= most else 2 * most) + MAP_RESERVE
    msg = f"{base}; the dataset's {f.shards} shard(s) are {f.shards} memory mapping(s)"
    if f.shards > most:
        msg = (f"{base}; of the dataset's {f.shards} shards at most {most} are kept memory-mapped at once (the "
               f"least recently used are unmapped; ${ENV_LIMIT} sets it)")
    if f.max_map_count is None or need <= f.max_map_count:
        limit = "" if f.max_map_count is None else f" (vm.max_map_count {f.max_map_count})"
        return Check(OK, "open files", msg + limit)
    return Check(WARN, "open files", f"{msg}: up to {need} mappings with {MAP_RESERVE} for the process, more than "
                 f"vm.max_map_count {f.max_map_count} allows; raise it (sysctl -w vm.max_map_count={need * 2}) or "
                 f"lower ${ENV_LIMIT}")


def _raise_nofile(soft: int, hard: int, want: int = 4096) -> str:
    """How to raise the open-file limit from ``soft``: with ``ulimit -n`` up to the hard
    limit; past it (or when the hard limit is the soft one) only root or the container can."""
    root = (f"raise the hard limit as root (nofile in /etc/security/limits.conf, LimitNOFILE= for a systemd "
            f"unit) or for the container (docker run --ulimit nofile={want}:{want})")
    if hard < 0 or hard >= want:
        return f"raise it: ulimit -n {want}"
    if hard > soft and hard >= FD_RESERVE:
        return f"raise it to the hard limit: ulimit -n {hard}"
    if hard > soft:
        return f"ulimit -n {hard} (the hard limit) is still too few: {root}"
    return f"the hard limit is {hard} too, so ulimit -n cannot raise it: {root}"


def check_shm(f: Facts) -> Check:
    needs = f.device == "cuda" and f.local_world_size > 1
    why = "NCCL between the local ranks uses it" if needs else "fastload itself does not use it"
    if f.shm is None:
        return Check(WARN if needs else OK, "/dev/shm", f"missing; {why}")
    total, free = f.shm
    msg = f"{_bytes(total)} ({_bytes(free)} free)"
    if needs and total < SHM_MIN:
        return Check(WARN, "/dev/shm", f"{msg}: too small for NCCL between {f.local_world_size} local ranks "
                     "(Docker's default is 64 MB): docker run --shm-size=8g or --ipc=host")
    return Check(OK, "/dev/shm", f"{msg}; {why}")


def check_threads(f: Facts) -> Check:
    per_rank = max(1, f.cores // f.local_world_size)
    rank = f"LOCAL_WORLD_SIZE={f.local_world_size}" + (f", LOCAL_RANK={f.local_rank}" if f.local_rank is not None
                                                       else "")
    msg = (f"{f.cores} usable cores, {rank}: {per_rank} core(s) per rank; fastload starts {f.gather_threads} gather "
           f"+ {f.dali_threads} DALI thread(s) per rank ({DECODE_WORKERS} {f.device.upper()} pipelines)")
    if f.local_rank is not None and not f.local_world_size_set:
        return Check(WARN, "threads", f"{msg}; LOCAL_RANK is set but LOCAL_WORLD_SIZE is not, so every rank sizes "
                     "its threads as if it had the node to itself: export LOCAL_WORLD_SIZE (torchrun does)")
    if per_rank < 2:
        return Check(WARN, "threads", f"{msg}; one core per rank runs the training loop, the gather and DALI's "
                     "host work together: expect the loader to be the bottleneck")
    return Check(OK, "threads", msg)


def check_torch_threads(f: Facts) -> Check:
    """torch's intra-op threads beside fastload's, as the policy has them (docs/how-to/tune-threads.md, "Threads,
    cores and the training step"): fastload never changes torch's threads, and its own run at
    nice ``loader_nice`` below the loop, so on a CPU job they only take the cores the step
    leaves idle. A WARN only where that cannot help: torch alone asks for more threads than
    the rank has cores, or fastload's threads were put at the loop's priority
    (FASTLOAD_NICE=0) with everything together far above the cores."""
    per_rank = max(1, f.cores // f.local_world_size)
    loader = f.gather_threads + f.dali_threads
    msg = f"torch uses {f.torch_threads} intra-op thread(s) per rank"
    if f.loader_nice_error is not None:
        return Check(WARN, "torch threads", f"{msg}; {f.loader_nice_error}")
    if f.torch_threads > per_rank:
        return Check(WARN, "torch threads", f"{msg}, more than the {per_rank} core(s) a rank has: set "
                     f"OMP_NUM_THREADS={per_rank} (or torch.set_num_threads({per_rank}))")
    if f.device == "cpu" and f.loader_nice <= 0 and f.torch_threads + loader > 2 * per_rank:
        return Check(WARN, "torch threads", f"{msg}; fastload's {loader} thread(s) run at the loop's priority "
                     f"(FASTLOAD_NICE=0), so the training step and the loader fight for {per_rank} core(s): unset "
                     "FASTLOAD_NICE (fastload's threads then yield to the loop)")
    yields = (f"; fastload's {loader} thread(s) run at nice {f.loader_nice}, below the loop: they take the cores "
              "the step leaves idle" if f.loader_nice > 0 else "")
    return Check(OK, "torch threads", f"{msg} ({per_rank} core(s) per rank){yields}")


def check_dataset(f: Facts) -> Check | None:
    if f.dataset is None:
        return None
    if f.dataset_error is not None:
        return Check(FAIL, "dataset", f"{f.dataset}: {f.dataset_error}")
    return Check(OK, "dataset", f"{f.dataset}: {f.samples:,} samples in {f.shards} shard(s)")
