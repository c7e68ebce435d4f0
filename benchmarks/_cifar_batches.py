"""CIFAR-10 in torchvision's format (``cifar-10-batches-py``): the data anyone can get.

Where the bundled JPEG archive (``cifar10-jpg.tar.gz`` in ``--data-root``) is not
found, ``--data cifar10`` falls back to CIFAR-10 as ``torchvision.datasets.CIFAR10``
keeps it under ``<cache>/torchvision``: the python-pickle batches
(``data_batch_1`` .. ``data_batch_5``, ``test_batch``, ``batches.meta``). When those
files are missing, torchvision downloads them (``CIFAR10(root, download=True)``,
which checks the archive's MD5); that is the only network access in the
benchmarks, it is announced before it starts, and ``allow_download=False`` forbids it.

The batches are read here, not through ``CIFAR10(...)``, which re-hashes all six
files on every load: a ``(n, 3072)`` uint8 row is one image's red, green and blue
planes of 32x32, and ``labels`` index ``batches.meta``'s ``label_names``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from einops import rearrange
from PIL import Image

from benchmarks._archive import NAMED, TensorSplit

__all__ = ["BASE_FOLDER", "TRAIN_FILES", "TEST_FILES", "META_FILE", "TorchvisionCIFAR10", "read_split", "ensure_files"]

BASE_FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
META_FILE = "batches.meta"
_SIDE = 32


@dataclass(frozen=True)
class TorchvisionCIFAR10:
    """CIFAR-10 in torchvision's layout: ``root`` is what ``CIFAR10(root=...)`` takes (it holds ``cifar-10-batches-py``).

    ``archive`` is where the bundled archive was looked for, so that errors can name both ways.
    """

    root: Path
    archive: Path

    @property
    def folder(self) -> Path:
        return self.root / BASE_FOLDER

    def missing(self) -> list[str]:
        """The files of the layout that are not there."""
        return [name for name in (*TRAIN_FILES, *TEST_FILES, META_FILE) if not (self.folder / name).is_file()]

    @property
    def name(self) -> str:
        return f"CIFAR-10 (torchvision format) at {self.folder}"


def _unpickle(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        blob = pickle.load(f, encoding="latin1")
    if not isinstance(blob, dict):
        raise ValueError(f"{path} is not a CIFAR-10 batch (a pickled dict); delete {path.parent} to download it again")
    return {str(k): v for k, v in blob.items()}


def read_split(data: TorchvisionCIFAR10, split: str, size: int = _SIDE) -> TensorSplit:
    """``train`` or ``test`` as uint8 tensors ``(n, size, size, 3)`` with labels and class names.

    Images are resized (bicubic, as the archive path does) only when ``size`` is not 32.

    Raises:
        FileNotFoundError: a file of the layout is missing (``ensure_files`` fetches them).
        ValueError: a file does not hold what the format says; the message names it.
    """
    if split not in ("train", "test"):
        raise ValueError(f"CIFAR-10 has the splits train and test, not {split!r}")
    if data.missing():
        raise FileNotFoundError(f"{data.folder} lacks {', '.join(data.missing())}; call ensure_files first")
    meta = _unpickle(data.folder / META_FILE)
    classes = tuple(str(c) for c in meta.get("label_names", ()))
    if not classes:
        raise ValueError(f"{data.folder / META_FILE} has no label_names")
    images, labels = [], []
    for name in TRAIN_FILES if split == "train" else TEST_FILES:
        blob = _unpickle(data.folder / name)
        rows = np.asarray(blob.get("data"), dtype=np.uint8)
        ys = np.asarray(blob.get("labels"), dtype=np.int64)
        if rows.ndim != 2 or rows.shape[1] != 3 * _SIDE * _SIDE or len(ys) != len(rows):
            raise ValueError(
                f"{data.folder / name}: expected 'data' of shape (n, 3072) and n 'labels', got data {rows.shape} "
                f"and {len(ys)} labels; delete {data.folder} to download it again"
            )
        if len(ys) and (ys.min() < 0 or ys.max() >= len(classes)):
            raise ValueError(f"{data.folder / name}: labels outside 0..{len(classes) - 1}")
        images.append(rearrange(rows, "n (c h w) -> n h w c", c=3, h=_SIDE, w=_SIDE))
        labels.append(ys)
    stacked = np.concatenate(images)
    if size != _SIDE:
        stacked = np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.BICUBIC))
                            for im in stacked])
    return TensorSplit(torch.from_numpy(np.ascontiguousarray(stacked)), torch.from_numpy(np.concatenate(labels)),
                       classes)


def offline_message(data: TorchvisionCIFAR10) -> str:
    """What to do without the bundled archive and without network: both ways, with their paths."""
    return (
        f"no CIFAR-10 found: neither the bundled archive {data.archive} nor torchvision's files in {data.folder}. "
        f"Either put {NAMED['cifar10']} in {data.archive.parent} (or pass --data-root DIR, the directory holding it), "
        f"or run once with network access so that torchvision downloads CIFAR-10 (about 170 MB) into {data.root} "
        f"(--cache-dir moves it)"
    )


def ensure_files(
    data: TorchvisionCIFAR10,
    *,
    allow_download: bool,
    log: Callable[[str], None] = print,
    dataset: Callable[..., Any] | None = None,
) -> None:
    """Make sure the batches are on disk: use them when present, else download them with torchvision.

    Args:
        data: where the files live.
        allow_download: False forbids the network; missing files then raise at once.
        log: where the announcement of a download goes.
        dataset: ``torchvision.datasets.CIFAR10`` (a stand-in in tests, which never touch the network).

    Raises:
        FileNotFoundError: the files are missing and cannot be downloaded; the message says both ways to get data.
    """
    if not data.missing():
        return
    if not allow_download:
        raise FileNotFoundError(offline_message(data) + "; downloading is turned off (--no-download)")
    if dataset is None:
        from torchvision.datasets import CIFAR10

        dataset = CIFAR10
    log(f"the bundled archive {data.archive} was not found: downloading CIFAR-10 with torchvision "
        f"(torchvision.datasets.CIFAR10(root={str(data.root)!r}, download=True)) ...")
    data.root.mkdir(parents=True, exist_ok=True)
    try:
        dataset(root=str(data.root), train=True, download=True)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; torchvision raises RuntimeError on a bad MD5
        raise FileNotFoundError(f"{offline_message(data)}. The download failed: {err}") from err
    if data.missing():
        raise FileNotFoundError(f"torchvision's download left {data.folder} without {', '.join(data.missing())}")
    log(f"CIFAR-10 downloaded to {data.folder}")
