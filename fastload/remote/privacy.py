"""What may leave the process: a remote dataset's settings in a pickle, never a secret.

A :class:`fastload.Dataset` of a URL pickles (for ``spawn`` / ``forkserver`` DataLoader
workers) as a *description* a worker reopens the same place with: the URL (its non-secret
query), the non-secret ``storage_options`` (endpoint, scheme, region, account name,
timeouts), and a ``filesystem=`` that is safe to pickle (a module-level factory, or a
pyarrow filesystem whose pickled form holds no credential). Credentials given explicitly
(``storage_options={"secret_key": ...}``, an ``Authorization`` header, a filesystem made with
keys) are never written into a pickle: pickling then fails with a message that says where
credentials go instead (the environment or credential files, which worker processes read
themselves, a factory, or fork-started workers).
"""
from __future__ import annotations

import functools
import pickle
from typing import Any, Mapping

from ..errors import RemoteError

__all__ = ["SECRET_WORDS", "is_secret_name", "secret_names", "picklable_filesystem", "safe_options"]

SECRET_WORDS = ("secret", "key", "token", "password", "signature", "sig", "credential", "sas", "authorization",
                "cookie")
_HOW = ("fastload never writes credentials into a pickle. Give them through the environment or credential files "
        "(worker processes read them there), pass filesystem= a module-level function that builds the "
        "filesystem, or start the workers with fork (multiprocessing_context=\"fork\")")


def is_secret_name(name: Any) -> bool:
    n = str(name).lower().replace("-", "_")
    return any(w in n for w in SECRET_WORDS)


def secret_names(obj: Any, prefix: str = "", depth: int = 0) -> list[str]:
    """Names of the non-empty secret-looking entries in ``obj`` (dicts, lists and tuples
    searched recursively)."""
    out: list[str] = []
    if depth > 6:
        return out
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            name = f"{prefix}{k}"
            if is_secret_name(k) and v not in (None, "", b"", {}, [], -1):
                out.append(name)
            else:
                out += secret_names(v, f"{name}.", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += secret_names(v, prefix, depth + 1)
    return out


def safe_options(options: Mapping[str, Any], where: str) -> dict:
    """``options`` when none of them is a secret (RemoteError naming them otherwise)."""
    bad = secret_names(dict(options))
    if bad:
        raise RemoteError(f"fastload.Dataset({where}) cannot be pickled: storage_options {sorted(bad)} hold "
                          f"credentials, and {_HOW}")
    return dict(options)


def picklable_filesystem(fs: Any, where: str) -> Any:
    """``fs`` (a pyarrow filesystem, or a factory making one) when pickling it writes no
    credential; RemoteError otherwise."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.FileSystem):
        if isinstance(fs, pafs.PyFileSystem):
            raise RemoteError(f"fastload.Dataset({where}) cannot be pickled: its filesystem= is a PyFileSystem "
                              "(e.g. an fsspec filesystem), whose pickle may carry its credentials; "
                              + _HOW)
        try:
            args = fs.__reduce__()[1]
        except Exception:  # pragma: no cover - every pyarrow filesystem reduces
            args = ()
        inner = [a for a in args if isinstance(a, pafs.FileSystem)]
        for a in inner:  # SubTreeFileSystem(base, fs)
            picklable_filesystem(a, where)
        bad = secret_names(args)
        if bad:
            raise RemoteError(f"fastload.Dataset({where}) cannot be pickled: its filesystem= was made with "
                              f"credentials ({', '.join(sorted(set(bad)))}), and {_HOW}")
        return fs
    target = fs.func if isinstance(fs, functools.partial) else fs
    if isinstance(fs, functools.partial):
        bad = secret_names(fs.keywords)
        if bad:
            raise RemoteError(f"fastload.Dataset({where}) cannot be pickled: its filesystem= factory is a "
                              f"functools.partial holding what looks like credentials ({', '.join(bad)}); {_HOW}")
    try:
        pickle.dumps(fs)
    except Exception as e:
        raise RemoteError(f"fastload.Dataset({where}) cannot be pickled: its filesystem= factory "
                          f"{getattr(target, '__qualname__', type(target).__name__)} cannot be pickled ({e}); "
                          "make it a module-level function (workers import it by name), or start the workers "
                          "with fork") from None
    return fs
