"""The alignment analysis' images: a few real images of distinct classes from a ``../shared/data`` archive, as a batch."""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["Batch", "make_batch", "read_images", "resolve_data"]

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMED = {"cifar10": "cifar10-jpg.tar.gz", "imagenette": "imagenette2-224-jpg.tar.gz"}
IMAGE_EXT = (".jpg", ".jpeg", ".png")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@dataclass(frozen=True)
class Batch:
    raw: Tensor  # b 3 H W, [0, 1], for pictures
    images: Tensor  # b 3 H W, normalised, un-mixed
    labels: Tensor  # b
    classes: list[str]


def resolve_data(source: str) -> Path:
    """``cifar10``/``imagenette`` -> ``<repo>/../shared/data/<archive>``; anything else is a path."""
    if source in NAMED:
        return (REPO_ROOT.parent / "shared" / "data" / NAMED[source]).resolve()
    return Path(source).expanduser().resolve()


def read_images(archive: Path, split: str, count: int, size: int) -> tuple[Tensor, Tensor, list[str]]:
    """Stream ``count`` images of distinct classes (as far as possible) from a ``<split>/<class>/<img>`` tar.

    Returns:
        ``(count, 3, size, size)`` fp32 pixels in ``[0, 1]``, ``(count,)`` class ids (the
        order classes were met), class names.
    """
    from PIL import Image

    if not archive.is_file():
        raise FileNotFoundError(f"no archive at {archive}; pass --data cifar10, imagenette or a .tar.gz path")
    per_class: dict[str, list[bytes]] = {}
    found = 0
    with tarfile.open(archive, "r|*") as tar:  # a stream: stops as soon as there are enough
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 3 or parts[-3] != split or not parts[-1].lower().endswith(IMAGE_EXT):
                continue
            cls = parts[-2]
            if cls not in per_class and len(per_class) >= count:
                continue
            images = per_class.setdefault(cls, [])
            if len(images) >= count:
                continue
            data = tar.extractfile(member)
            assert data is not None
            images.append(data.read())
            found += 1
            if len(per_class) >= count:  # one per class already: distinct classes for every slot
                break
    if not per_class:
        raise FileNotFoundError(f"no images under {split}/<class>/ in {archive}")
    names = list(per_class)
    chosen: list[tuple[int, bytes]] = []
    for rank in range(count):  # round-robin over classes: distinct classes first
        for ci, name in enumerate(names):
            if rank < len(per_class[name]) and len(chosen) < count:
                chosen.append((ci, per_class[name][rank]))
    if len(chosen) < count:
        raise ValueError(f"only {len(chosen)} images found under {split}/ in {archive}, need {count}")
    pixels = []
    for _, blob in chosen:
        img = Image.open(io.BytesIO(blob)).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
        pixels.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1))
    return torch.stack(pixels), torch.tensor([ci for ci, _ in chosen]), names



def make_batch(raw: Tensor, labels: Tensor, classes: list[str], cifar: bool) -> Batch:
    """``raw`` (b 3 H W, [0, 1]) with its copy normalised by CIFAR-10's or ImageNet's mean and std."""
    mean, std = (CIFAR_MEAN, CIFAR_STD) if cifar else (IMAGENET_MEAN, IMAGENET_STD)
    images = (raw - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    return Batch(raw=raw, images=images, labels=labels, classes=classes)
