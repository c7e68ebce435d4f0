"""Input checks shared by the adapters: clear errors before any compute."""

from __future__ import annotations

from torch import Tensor

from mixlabels import TokenLabelMap

__all__ = ["check_batch"]


def check_batch(images: Tensor, label_map: TokenLabelMap, patch_size: tuple[int, ...]) -> tuple[int, int]:
    """Check images against a label map and a patch size; return the token grid ``(h, w)``."""
    if images.ndim != 4:
        raise ValueError(f"images must have shape (batch, channels, H, W), got {tuple(images.shape)}")
    b, _, hh, ww = images.shape
    if b != label_map.batch_size:
        raise ValueError(f"images have batch size {b} but the label map has {label_map.batch_size}")
    if (hh, ww) != tuple(label_map.image_size):
        raise ValueError(
            f"the label map was made for {label_map.image_size[0]}x{label_map.image_size[1]} images "
            f"but the images are {hh}x{ww}; mix and adapt at the same resolution"
        )
    ph, pw = int(patch_size[0]), int(patch_size[1])
    if hh % ph or ww % pw:
        raise ValueError(
            f"image size {hh}x{ww} is not divisible by the patch size {ph}x{pw}: patch tokens would not tile "
            "the image, so their labels are undefined; resize or crop to a multiple of the patch size"
        )
    return hh // ph, ww // pw
