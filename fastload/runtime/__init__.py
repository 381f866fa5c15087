"""Where this process runs: the facts every layer may ask, importing nothing of fastload's.

    world.py      rank and world size (torch.distributed, RANK / WORLD_SIZE), local rank and
                  local world size (LOCAL_RANK / LOCAL_WORLD_SIZE)
    device.py     which CUDA device a rank uses, and guarded CUDA calls
    system.py     usable cores, memory limits, thread priority, the cache root
    lifecycle.py  fork and interpreter exit: what fastload's live objects do then
    kept.py       arrays derived from content, built once per node in the cache directory and
                  memory-mapped by its processes (a dataset's lengths, the sampling tables)
"""
