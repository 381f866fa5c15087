"""Remote datasets: URL -> filesystem, and the node-local shard cache.

    remote = RemoteDataset("s3://bucket/ds")            # fetches and checks the manifest
    cache = ShardCache(remote, RemoteOptions(cache_dir="/nvme/cache", cache_limit="200GB"), ahead=4096)
    cache.plan(sampler_uses(sampler, shard_starts))     # the pass's first-use order
    path = cache.ensure(shard)                           # blocks until the shard is local
    cache.advance(consumed)                              # eviction after each shard's last use

How a dataset is opened (cache directory and budget, filesystem and its options, download
deadline and threads) is one :class:`RemoteOptions` value (:mod:`.options`), checked once.
Nothing here imports torch. Test servers (SeaweedFS, moto, Range-capable HTTP, a fault
injecting proxy, a latency proxy) live in :mod:`_servers`.
"""
from .cache import ShardCache, default_cache_dir, format_bytes, parse_bytes
from .download import Concurrency, Downloader, RetryPolicy
from .options import RemoteOptions
from .manifest import RemoteDataset, check_manifest, manifest_fingerprint
from .schedule import EpochUses, admission_times, epoch_end, epoch_uses, minimum_budget, plan_uses, sampler_uses
from .transports import open_transport
from .url import REMOTE_SCHEMES, display_url, is_remote


def open_cache(url: str, options: RemoteOptions | None = None, *, cache_dir=None, cache_limit=None,
               filesystem=None, storage_options=None, download_timeout: float | None = None,
               download_threads: int | None = None, **kw) -> ShardCache:
    """The manifest at ``url`` and this node's cache of its shards (no thread started yet),
    opened as ``options`` say (a :class:`RemoteOptions`; or its settings as keywords, not
    both): ``download_timeout`` (seconds a shard may take, its deadline, default 600) also
    bounds the manifest's read (all its attempts). ``kw`` go to :class:`ShardCache`."""
    options = RemoteOptions.from_keywords(options, cache_dir=cache_dir, cache_limit=cache_limit,
                                          filesystem=filesystem, storage_options=storage_options,
                                          download_timeout=download_timeout, download_threads=download_threads)
    remote = RemoteDataset(url, filesystem=options.filesystem, storage_options=options.storage_options,
                           timeout=options.download_timeout)
    return ShardCache(remote, options, **kw)

__all__ = [
    "Concurrency", "Downloader", "EpochUses", "REMOTE_SCHEMES", "RemoteDataset", "RemoteOptions", "RetryPolicy", "ShardCache",
    "admission_times", "check_manifest", "default_cache_dir", "display_url", "epoch_end", "epoch_uses",
    "format_bytes", "is_remote", "manifest_fingerprint", "minimum_budget", "open_cache", "open_transport",
    "parse_bytes", "plan_uses", "sampler_uses",
]
