"""Real image data on disk: find an archive, decode its small images once (or extract it once) into a cache.

The cache lives outside the repository (``$MIXLABELS_CACHE`` or
``~/.cache/mixlabels``), one directory per archive content
(``<archive stem>-<sha256 prefix>``). Extraction goes to a temporary directory that
is renamed into place under a file lock, with a completion marker, so concurrent
ranks (or concurrent jobs) never see half an archive. The tensor loader never
extracts: it streams the archive once per split and caches the decoded uint8
tensor (``<split>-<size>px.pt``), which on CIFAR-10 skips writing 60,000 files.

Layout expected (archive or directory): ``<split>/<class>/<image>``, with splits
``train`` and ``test`` or ``val``; classes are the sorted folder names.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

__all__ = [
    "REPO_ROOT",
    "NAMED",
    "default_data_root",
    "resolve_source",
    "cache_root",
    "extract",
    "TensorSplit",
    "tensor_cache",
    "eval_split",
    "train_split",
    "split_counts",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMED = {"cifar10": "cifar10-jpg.tar.gz", "imagenette": "imagenette2-224-jpg.tar.gz"}
_MARKER = ".complete"
_IMAGE_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def default_data_root() -> Path:
    """``<project root>/../shared/data``: where the bundled archives live."""
    return (REPO_ROOT.parent / "shared" / "data").resolve()


def resolve_source(source: str, data_root: str | Path | None = None) -> Path:
    """``cifar10``/``imagenette`` -> ``<data_root>/<archive>``; anything else is a path.

    Raises:
        FileNotFoundError: nothing exists there; the message names the path and the ways to fix it.
    """
    root = Path(data_root).expanduser().resolve() if data_root is not None else default_data_root()
    path = (root / NAMED[source]) if source in NAMED else Path(source).expanduser().resolve()
    if not path.exists():
        if source in NAMED:
            raise FileNotFoundError(
                f"no {source} archive at {path}. Put {NAMED[source]} in {root}, pass --data-root DIR "
                f"(the directory holding {NAMED[source]}), or pass --data PATH (an ImageFolder directory or a .tar.gz)"
            )
        raise FileNotFoundError(
            f"no data at {path}. --data takes 'cifar10', 'imagenette', a directory laid out as "
            f"<split>/<class>/<image> (splits train and val or test), or a .tar/.tar.gz of one"
        )
    return path


def cache_root(cache_dir: str | None) -> Path:
    root = Path(cache_dir or os.environ.get("MIXLABELS_CACHE") or Path.home() / ".cache" / "mixlabels")
    root = root.expanduser().resolve()
    if root == REPO_ROOT or REPO_ROOT in root.parents:
        raise ValueError(f"the data cache must live outside the repository, got {root}")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_cached(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the key so that a replaced archive is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".tar.gz", ".tgz", ".tar"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _cache_dir_for(source: Path, root: Path) -> Path:
    """One cache directory per archive content, or per directory path."""
    if source.is_dir():
        tag = hashlib.sha256(str(source).encode()).hexdigest()[:12]
        return root / f"{source.name}-dir-{tag}"
    return root / f"{_stem(source)}-{_sha256(source)[:12]}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_image(name: str) -> bool:
    return name.lower().endswith(_IMAGE_EXT)


def _layout(paths: Iterable[PurePosixPath]) -> tuple[str, tuple[str, ...], dict[str, tuple[int, int]]]:
    """The common prefix above ``<split>/<class>/<image>``, the split names and each split's ``(classes, images)``."""
    prefixes: set[str] = set()
    classes: dict[str, set[str]] = {}
    images: dict[str, int] = {}
    for path in paths:
        if len(path.parts) < 3 or not _is_image(path.name):
            continue
        prefixes.add("/".join(path.parts[:-3]))
        split = path.parts[-3]
        classes.setdefault(split, set()).add(path.parts[-2])
        images[split] = images.get(split, 0) + 1
    if not classes:
        raise FileNotFoundError("no images laid out as <split>/<class>/<image>")
    if len(prefixes) > 1:
        raise ValueError(f"images at several depths ({sorted(prefixes)[:3]}...); expected one <split>/<class>/<image> tree")
    counts = {split: (len(classes[split]), images[split]) for split in sorted(classes)}
    return prefixes.pop(), tuple(counts), counts


def _find_tree(source: Path, depth: int = 3) -> Path | None:
    """The directory holding ``train/`` within ``depth`` levels of ``source``, found without listing every image."""
    level = [source]
    for _ in range(depth + 1):
        for folder in level:
            if (folder / "train").is_dir():
                return folder
        level = [c for folder in level for c in sorted(folder.iterdir()) if c.is_dir()]
    return None


def _dir_counts(tree: Path) -> dict[str, tuple[int, int]]:
    """``{split: (classes, images)}`` of a ``<split>/<class>/<image>`` directory, one listing per class folder."""
    counts: dict[str, tuple[int, int]] = {}
    for split in sorted(p for p in tree.iterdir() if p.is_dir()):
        per_class = [sum(1 for f in c.iterdir() if _is_image(f.name)) for c in split.iterdir() if c.is_dir()]
        per_class = [n for n in per_class if n]
        if per_class:
            counts[split.name] = (len(per_class), sum(per_class))
    return counts


def _tree_of(source: Path, root: Path) -> tuple[str, tuple[str, ...]]:
    """``(prefix, splits)`` of an archive or directory; an archive's is read once and remembered in the cache."""
    if source.is_dir():
        images = (p.relative_to(source) for p in source.rglob("*") if p.is_file())
        prefix, splits, _ = _layout(PurePosixPath(p.as_posix()) for p in images)
        return prefix, splits
    blob = _archive_index(source, root)
    return str(blob["prefix"]), tuple(blob["splits"])


def _archive_index(source: Path, root: Path) -> dict[str, Any]:
    """An archive's layout (prefix, splits, per-split counts): read from the tar once, then from the cache."""
    index = _cache_dir_for(source, root) / "layout.json"
    if index.exists():
        blob: dict[str, Any] = json.loads(index.read_text())
        if "counts" in blob:  # indexes written before the counts existed are read again, once
            return blob
    with tarfile.open(source) as tar:
        prefix, splits, counts = _layout(PurePosixPath(m.name) for m in tar if m.isfile())
    blob = {"prefix": prefix, "splits": list(splits), "counts": {k: list(v) for k, v in counts.items()}}
    index.parent.mkdir(parents=True, exist_ok=True)
    tmp = index.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(blob))
    os.replace(tmp, index)
    return blob


def split_counts(source: Path, root: Path) -> dict[str, tuple[int, int]]:
    """``{split: (classes, images)}`` of an archive or directory, without decoding or extracting it.

    A directory is found by its ``train/`` folder and counted one class folder at a time; an
    archive's member list is read once and remembered beside its cache (``layout.json``).
    """
    if source.is_dir():
        tree = _find_tree(source)
        if tree is None:  # a deeper or odd layout: the full walk the loaders do, which names what is wrong
            prefix, _ = _tree_of(source, root)
            tree = source / prefix
        counts = _dir_counts(tree)
        if not counts:
            raise FileNotFoundError(f"{source}: no images laid out as <split>/<class>/<image>")
        return counts
    blob = _archive_index(source, root)
    return {str(k): (int(v[0]), int(v[1])) for k, v in blob["counts"].items()}


def train_split(source: Path, root: Path) -> str:
    """``train``, checked to exist."""
    _, splits = _tree_of(source, root)
    if "train" not in splits:
        raise FileNotFoundError(f"{source} has no train/ split (splits found: {', '.join(splits)})")
    return "train"


def eval_split(source: Path, root: Path) -> str:
    """``val`` if the tree has one, else ``test``."""
    _, splits = _tree_of(source, root)
    for split in ("val", "test"):
        if split in splits:
            return split
    raise FileNotFoundError(f"{source} has neither a val/ nor a test/ split (splits found: {', '.join(splits)})")


def extract(source: Path, root: Path) -> Path:
    """The ImageFolder root of ``source`` (holding ``train/`` ...): the directory, or the archive extracted once.

    Only the folder loader needs files on disk; the tensor loader decodes straight from the archive.
    """
    prefix, _ = _tree_of(source, root)
    if source.is_dir():
        return source / prefix
    dest = _cache_dir_for(source, root) / "images"
    if (dest / _MARKER).exists():
        return dest / prefix
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent / ".lock"):
        if not (dest / _MARKER).exists():  # else another rank finished while we waited
            tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest.parent))
            try:
                with tarfile.open(source) as tar:
                    tar.extractall(tmp, filter="data")
                (tmp / _MARKER).touch()
                if dest.exists():
                    shutil.rmtree(dest)
                os.rename(tmp, dest)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return dest / prefix


@dataclass(frozen=True)
class TensorSplit:
    """A split decoded once: ``images`` ``(n, H, W, 3)`` uint8, ``labels`` ``(n,)`` long."""

    images: Tensor
    labels: Tensor
    classes: tuple[str, ...]


def _decode(data: bytes, size: int) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.Resampling.BICUBIC)
        return np.asarray(rgb, dtype=np.uint8)


def _members(source: Path, prefix: str, split: str) -> Iterator[tuple[str, str, bytes]]:
    """``(class, file name, bytes)`` of every image of ``split``, from a directory or streamed from an archive."""
    if source.is_dir():
        base = source / prefix / split
        for cls_dir in sorted(p for p in base.iterdir() if p.is_dir()):
            for f in sorted(cls_dir.iterdir()):
                if _is_image(f.name):
                    yield cls_dir.name, f.name, f.read_bytes()
        return
    # streaming the tar avoids writing tens of thousands of small files (CIFAR-10: 60,000) just to read them once
    want = PurePosixPath(prefix, split).parts
    with tarfile.open(source, mode="r|*") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if member.isfile() and parts[:-2] == want and _is_image(member.name):
                data = tar.extractfile(member)
                if data is not None:
                    yield parts[-2], parts[-1], data.read()


def _decode_split(source: Path, prefix: str, split: str, size: int) -> TensorSplit:
    decoded = sorted((cls, name, _decode(data, size)) for cls, name, data in _members(source, prefix, split))
    if not decoded:
        raise FileNotFoundError(f"no images under {split}/ of {source}")
    classes = tuple(sorted({cls for cls, _, _ in decoded}))
    index = {c: i for i, c in enumerate(classes)}
    images = torch.from_numpy(np.stack([image for _, _, image in decoded]))
    labels = torch.tensor([index[cls] for cls, _, _ in decoded], dtype=torch.long)
    return TensorSplit(images, labels, classes)


def tensor_cache(source: Path, split: str, size: int, root: Path) -> TensorSplit:
    """``split`` of an archive or ImageFolder directory as uint8 tensors, decoded once and cached in ``root``."""
    prefix, splits = _tree_of(source, root)
    if split not in splits:
        raise FileNotFoundError(f"{source} has no {split}/ split (splits found: {', '.join(splits)})")
    cache = _cache_dir_for(source, root)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{split}-{size}px.pt"
    if not path.exists():
        with _locked(cache / ".lock"):
            if not path.exists():  # else another rank decoded it while we waited
                decoded = _decode_split(source, prefix, split, size)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                torch.save({"images": decoded.images, "labels": decoded.labels, "classes": list(decoded.classes)}, tmp)
                os.replace(tmp, path)
    blob = torch.load(path, weights_only=True)
    return TensorSplit(blob["images"], blob["labels"], tuple(blob["classes"]))
