"""Input checks shared by the adapters: clear errors before any compute."""

from __future__ import annotations

from torch import Tensor

from mixlabels import TokenLabelMap

__all__ = ["check_batch"]


def check_batch(images: Tensor, label_map: TokenLabelMap, patch_size: tuple[int, ...]) -> tuple[int, int]:
    """Check images against a label map and a patch size; return the token grid ``(h, w)``."""
    if images.ndim != 4:
        raise ValueError(f"images must have shape (batch, channels, H, W), got {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floating point, got {images.dtype}; convert them first, e.g. images.float() / 255")
    if images.device != label_map.device:
        raise ValueError(
            f"images are on {images.device} but the label map on {label_map.device}; "
            "move the map with label_map.to(images.device)"
        )
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
    grid = (hh // ph, ww // pw)
    if label_map.token_space:
        # Token-space mixing needs mask cells that nest with the patches (either grid divides the
        # other); otherwise every straddling token is a fractional blend of two embeddings.
        mh, mw = (int(s) for s in label_map.mask.shape[2:])
        nests = all(c % g == 0 or g % c == 0 for c, g in ((mh, grid[0]), (mw, grid[1])))
        if not nests:
            raise ValueError(
                f"the token-space (MixToken) map has {mh}x{mw} cells, which do not line up with the model's "
                f"{grid[0]}x{grid[1]} patches; build MixToken with the model's patch_size={ph}"
            )
    return grid
