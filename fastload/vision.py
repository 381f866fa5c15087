"""Image transforms for ``Loader(transforms=...)``.

One field, ``transforms={field: ...}``:

    fastload.vision.train(224)               RandomResizedCrop + flip + normalize (float32 CHW)
    fastload.vision.train(224, dtype="uint8", layout="HWC")   raw pixels; normalise on the GPU
    fastload.vision.eval(224, resize=256)    resize shorter side + center crop + normalize
    fastload.vision.custom(build, shape=(3, 224, 224))        your own DALI graph

Several fields at once, ``transforms=...`` (one transform, reading several fields and
writing several outputs, see :mod:`fastload.pipeline.multi`):

    fastload.vision.detection(640)           IoU crop of image + boxes + labels, resize, flip
    fastload.vision.segmentation(512)        the same window over image and mask
    fastload.vision.custom(build, inputs={"image": "image", "boxes": "boxes"},
                           outputs={"image": Spec((3, 224, 224), "float32"), "boxes": Spec((None, 4), "float32")})

    fastload.vision.decode(ds[i]["image"])   one image -> uint8 tensor (H, W, C), for DataLoader code

See :mod:`fastload.pipeline` for how they run (DALI on the GPU; on the CPU DALI decodes and
torch resizes, crops, flips and normalizes: the same transform, a quarter of DALI's resize cost).
"""
from typing import Any, Callable, Mapping, Sequence

from .pipeline.presets import (DEFAULT_MAX_PIXELS, IMAGENET_MEAN, IMAGENET_STD, Custom, Eval, Train,
                               Transform, eval, train)
from .pipeline.multi import CustomSample, SampleTransform, Spec
from .pipeline.detection import Detection
from .pipeline.segmentation import Segmentation

from .pipeline.pil_decode import decode

__all__ = ["decode", "train", "eval", "custom", "detection", "segmentation", "Spec", "Transform", "Train", "Eval",
           "Custom", "CustomSample", "Detection", "Segmentation", "SampleTransform", "IMAGENET_MEAN",
           "IMAGENET_STD", "DEFAULT_MAX_PIXELS"]


def custom(build: Callable, *, shape: Sequence[int] | None = None, dtype: str = "float32",
           inputs: Mapping[str, str] | None = None, outputs: Mapping[str, Any] | None = None,
           **kw: Any) -> Custom | CustomSample:
    """Your own DALI graph. One field: ``custom(build, shape=..., dtype=...)``, ``build(encoded,
    device=...)`` returns one node (``transforms={field: ...}``). Several fields:
    ``custom(build, inputs={graph input: field}, outputs={name: Spec(shape, dtype)})``,
    ``build(inputs, device=...)`` returns ``{name: node}`` (``transforms=...`` itself; see
    :class:`fastload.pipeline.multi.CustomSample`)."""
    if outputs is not None or inputs is not None:
        if shape is not None:
            raise ValueError("custom(): shape= declares a one-field graph's output; a multi-field graph declares "
                             "outputs={name: Spec(shape, dtype)} instead")
        return CustomSample(build, inputs=inputs if inputs is not None else {"image": "image"},
                            outputs=outputs if outputs is not None else {}, **kw)
    if shape is None:
        raise ValueError("custom(build, shape=...) needs the output shape of one sample (or inputs= and outputs= "
                         "for a graph over several fields)")
    return Custom(build, shape=shape, dtype=dtype, **kw)


def detection(size: int | Sequence[int] = 512, **kw: Any) -> Detection:
    """Object detection: an SSD-style IoU crop of ``image`` with its ``boxes`` (float32
    ``[*, 4]`` xyxy pixels of the stored image) and ``labels``, resized to ``size`` (square; or
    ``letterbox=True``: aspect kept, padded at the bottom/right), flipped with probability
    ``flip``, normalized. Keywords: ``scale=(0.3, 1.0)`` (window side as a fraction of the
    image's), ``min_iou=(0.1, 0.3, 0.5, 0.7, 0.9)``, ``flip=0.5``, ``crop=True`` (False: the
    whole image), ``letterbox=False``, ``mean``, ``std``, ``dtype``, ``layout``,
    ``box_format="xyxy"`` (or ``"xywh"``, ``"cxcywh"``), ``return_crop=False`` (True: also
    ``crop``, each sample's window ``x0, y0, x1, y1`` in stored pixels, and ``flip``), and the
    field names ``image=``, ``boxes=``, ``labels=``. Batches get ``image`` ``(B, 3, S, S)``,
    ``boxes`` ``(B, Lmax, 4)`` in output pixels with ``boxes_lengths``, ``labels`` ``(B, Lmax)``
    with ``labels_lengths`` (or packed with ``ragged="packed"``)."""
    return Detection(size, **kw)


def segmentation(size: int | Sequence[int] = 512, **kw: Any) -> Segmentation:
    """Semantic segmentation: ``image`` and ``mask`` (a single-channel PNG field, one class id
    per pixel) cropped (RandomResizedCrop: ``scale=(0.25, 1.0)``, ``ratio``) and flipped
    (``flip=0.5``) with the same window; the image resized antialiased and normalized, the mask
    resized nearest-neighbour. ``crop=False``: the whole image. Batches get ``image``
    ``(B, 3, S, S)`` and ``mask`` ``(B, S, S)`` (``mask_dtype="int64"`` or ``"uint8"``)."""
    return Segmentation(size, **kw)
