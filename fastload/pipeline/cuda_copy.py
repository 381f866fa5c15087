"""A CUDA runner's output handed over: DALI's output buffer copied into a new torch tensor on
the runner's own *copy stream*, asynchronously, with an event recorded after the copy.

Nothing waits on the host: whoever uses the tensor makes its stream wait for the event (the
loader's CUDA delivery, :mod:`fastload.loader.cuda`); the runner synchronizes on it only
before it drops its pipeline. In DALI 2.4 ``CopyToExternal`` makes DALI's own stream wait for
a non-blocking copy before it reuses the output buffer (``wait_order.wait(copy_order)``,
``backend_impl.cc``), so the next ``run()`` needs no host wait either.
"""
from __future__ import annotations

from typing import Any

__all__ = ["copy_to_cuda"]


def copy_to_cuda(dali_tensor, shape: tuple, dtype_name: str, device_id: int, stream) -> tuple[Any, Any, Any]:
    """``(tensor, ready_event, stream)``: ``dali_tensor`` (a DALI TensorListGPU) copied into a
    new ``shape``/``dtype_name`` tensor on CUDA device ``device_id``, on ``stream`` (made on
    first use when None: the returned stream is the one to pass next time; give it back with
    ``fastload.runtime.device.release_stream`` when done)."""
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray

    from ..runtime.device import guard, private_stream

    dt = _TORCH[dtype_name]
    with guard(device_id):
        if stream is None:  # fastload's own: not one of torch's pooled streams (the user's, maybe)
            stream = private_stream(device_id)
        with torch.cuda.stream(stream):  # the tensor's memory belongs to the copy stream
            t = torch.empty(shape, dtype=dt, device=torch.device("cuda", device_id))
        feed_ndarray(dali_tensor, t, cuda_stream=stream)  # asynchronous on the copy stream
        ev = torch.cuda.Event(blocking=True)  # users wait on the GPU; close() on the host
        ev.record(stream)
    return t, ev, stream


def _torch_dtypes() -> dict:
    import torch
    return {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8, "int64": torch.int64,
            "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "float64": torch.float64,
            "bool": torch.bool}


class _LazyDtypes(dict):
    def __missing__(self, key):
        self.update(_torch_dtypes())
        return dict.__getitem__(self, key)


_TORCH = _LazyDtypes()
