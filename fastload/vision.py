"""Image transforms for ``Loader(transforms={field: ...})``.

    fastload.vision.train(224)               RandomResizedCrop + flip + normalize (float32 CHW)
    fastload.vision.train(224, dtype="uint8", layout="HWC")   raw pixels; normalise on the GPU
    fastload.vision.eval(224, resize=256)    resize shorter side + center crop + normalize
    fastload.vision.custom(build, shape=(3, 224, 224))        your own DALI graph
    fastload.vision.decode(ds[i]["image"])   one image -> uint8 tensor (H, W, C), for DataLoader code

See :mod:`fastload.pipeline` for how they run (DALI on the GPU; on the CPU DALI decodes and
torch resizes, crops, flips and normalizes: the same transform, a quarter of DALI's resize cost).
"""
from .pipeline.presets import (DEFAULT_MAX_PIXELS, IMAGENET_MEAN, IMAGENET_STD, Custom, Eval, Train,
                               Transform, custom, eval, train)

from .pipeline.pil_decode import decode

__all__ = ["decode", "train", "eval", "custom", "Transform", "Train", "Eval", "Custom", "IMAGENET_MEAN",
           "IMAGENET_STD", "DEFAULT_MAX_PIXELS"]
