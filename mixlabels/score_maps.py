"""Dense score maps from a machine annotator (Token Labeling, sections 3.2-4.1).

An annotator model scores every region of every training image once, offline: a map
``(hm, wm, c)`` of class distributions per image. This module

1. stores those maps compactly: the top-k (default 5) scores of every map cell in
   fp16 and their class ids in int16 (``4 k`` bytes a cell instead of ``4 c``), in
   shards of many images with a JSON index (``ScoreMapWriter``, ``ScoreMaps``);
2. reconstructs dense distributions from the top-k (``to_dense``);
3. aligns each map to the random-resized crop and flip of its image, with RoIAlign,
   onto the token grid (``sample_resized_crops``, ``crop_resize``, ``align_score_maps``);
4. mixes the aligned per-sample targets like a mixed batch's tokens
   (``DenseTokenAnnotator``, the ``TokenAnnotator`` of ``TokenLabeling``).

Storage layout (a directory)::

    index.json          {"format": "mixlabels.score_maps", "version": 1, "k": 5, "num_classes": c,
                         "map_size": [hm, wm], "shard_size": n, "meta": {...},
                         "shards": [{"file": "shard-00000.npy", "count": n, "bytes": ..., "sha256": ...,
                                     "ids": ["train/cls/img.jpg", ...]}, ...]}
    shard-00000.npy     uint16 (count, 2, hm, wm, k): [:, 0] the fp16 scores' bits (descending),
                        [:, 1] the int16 class ids' bits; memory-mapped for random access
    ...

Image ``i`` of the store is the ``i``-th id over the shards in order. The writer
appends whole shards atomically (temporary file, then rename) and rewrites the index
after each, so an interrupted run keeps every completed shard and redoes only the
last, partial one. The reader checks every shard's presence and size when opened and
its checksum when it loads it whole (``load_all``, ``verify``); any mismatch is a
``ScoreMapError`` naming the file.

Reconstruction (``fill``): the paper stores "the top-5 score maps for each position in
half-precision"; LV-ViT's code scatters the five stored values into zeros (it then
RoIAligns and applies a softmax, as its stored values are scores before a softmax).
We store probabilities, so a softmax afterwards would flatten them; the default
``"renormalize"`` divides the top-k probabilities by their sum: exactly the softmax of
the annotator's logits restricted to its top-k classes. ``"spread"`` instead keeps the
annotator's remaining mass ``1 - sum(top-k)`` spread evenly over the other classes;
``"zeros"`` is the raw scatter (rows sum to less than 1).

Shapes, named once: ``b`` batch, ``hm wm`` map cells, ``k`` kept scores, ``c`` classes,
``h w`` token grid, ``n = h * w``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch import Tensor

from mixlabels._label_map import TokenLabelMap

__all__ = [
    "FORMAT",
    "ScoreMapError",
    "TopKMaps",
    "Fill",
    "compress",
    "to_dense",
    "ScoreMapWriter",
    "ScoreMaps",
    "CropParams",
    "sample_resized_crops",
    "sample_padded_crops",
    "crop_resize",
    "align_score_maps",
    "DenseTokenAnnotator",
]

FORMAT = "mixlabels.score_maps"
_VERSION = 1
_INDEX = "index.json"
Fill = Literal["renormalize", "spread", "zeros"]
Padding = Literal["border", "zeros"]


class ScoreMapError(ValueError):
    """A score-map store that is not what its index says (the message names the file)."""


# ---------------------------------------------------------------------- top-k maps
@dataclass(frozen=True, eq=False)
class TopKMaps:
    """Top-k scores of score maps: ``values`` fp16 (descending) and ``indices`` int16, ``(..., hm, wm, k)``.

    Example:
        >>> maps = torch.softmax(torch.randn(2, 4, 4, 10), dim=-1)
        >>> top = compress(maps, k=3)
        >>> top.values.dtype, top.indices.dtype, tuple(top.dense().shape)
        (torch.float16, torch.int16, (2, 4, 4, 10))
    """

    values: Tensor
    indices: Tensor
    num_classes: int

    @property
    def k(self) -> int:
        return int(self.values.shape[-1])

    def to(self, device: torch.device | str) -> TopKMaps:
        """The same maps on another device."""
        return TopKMaps(self.values.to(device), self.indices.to(device), self.num_classes)

    def __getitem__(self, items: Tensor | slice | int) -> TopKMaps:
        """The maps of some images (indexing the leading dimension)."""
        return TopKMaps(self.values[items], self.indices[items], self.num_classes)

    def dense(self, fill: Fill = "renormalize") -> Tensor:
        """``(..., hm, wm, c)`` fp32 distributions; see ``to_dense``."""
        return to_dense(self.values, self.indices, self.num_classes, fill)


def compress(scores: Tensor, k: int = 5) -> TopKMaps:
    """Keep the ``k`` largest scores of every map cell: fp16 values, int16 class ids.

    Args:
        scores: ``(..., hm, wm, c)`` class scores (probabilities) per map cell.
        k: how many to keep (``1 <= k <= c``).
    """
    c = int(scores.shape[-1])
    if not 1 <= k <= c:
        raise ValueError(f"k must lie in [1, num_classes={c}], got {k}")
    if c > torch.iinfo(torch.int16).max + 1:
        raise ValueError(f"class ids are stored as int16: at most 32768 classes, got {c}")
    values, indices = scores.float().topk(k, dim=-1)  # descending
    return TopKMaps(values.half(), indices.to(torch.int16), c)


def to_dense(values: Tensor, indices: Tensor, num_classes: int, fill: Fill = "renormalize") -> Tensor:
    """Dense ``(..., c)`` fp32 distributions from top-k ``values`` and class ``indices`` ``(..., k)``.

    Args:
        fill: ``"renormalize"`` (top-k scores over their sum), ``"spread"`` (the remaining
            mass shared evenly by the other classes) or ``"zeros"`` (raw scatter, unnormalised).
    """
    v = values.float()
    idx = indices.long()
    k = int(v.shape[-1])
    total = v.sum(dim=-1, keepdim=True)
    if fill == "spread" and num_classes > k:
        rest = (1.0 - total).clamp_min(0.0) / (num_classes - k)
        out = rest.expand(*v.shape[:-1], num_classes).clone().scatter_(-1, idx, v)
        return out / out.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.zeros(*v.shape[:-1], num_classes, dtype=torch.float32, device=v.device).scatter_(-1, idx, v)
    if fill == "zeros":
        return out
    if fill not in ("renormalize", "spread"):
        raise ValueError(f"fill must be 'renormalize', 'spread' or 'zeros', got {fill!r}")
    return out / total.clamp_min(torch.finfo(torch.float32).tiny)


# ---------------------------------------------------------------------- storage
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _pack(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    # One self-describing .npy per shard: fp16 and int16 both fit uint16 bit patterns.
    return np.stack([values.astype(np.float16).view(np.uint16), indices.astype(np.int16).view(np.uint16)], axis=1)


class _Shard(TypedDict):
    file: str
    count: int
    bytes: int
    sha256: str
    ids: list[str]


@dataclass(frozen=True)
class _Header:
    k: int
    num_classes: int
    map_size: tuple[int, int]
    shard_size: int
    meta: dict[str, Any]


def _read_index(root: Path) -> tuple[_Header, list[_Shard]]:
    path = root / _INDEX
    if not path.is_file():
        raise ScoreMapError(f"no score-map index at {path}: not a score-map store (run benchmarks/annotate.py)")
    try:
        blob = json.loads(path.read_text())
        if blob.get("format") != FORMAT or blob.get("version") != _VERSION:
            raise ScoreMapError(
                f"{path} is not a {FORMAT} index of version {_VERSION} "
                f"(format={blob.get('format')!r}, version={blob.get('version')!r})"
            )
        header = _Header(
            int(blob["k"]), int(blob["num_classes"]), (int(blob["map_size"][0]), int(blob["map_size"][1])),
            int(blob["shard_size"]), dict(blob.get("meta", {})),
        )  # fmt: skip
        shards = [
            _Shard(file=str(s["file"]), count=int(s["count"]), bytes=int(s["bytes"]),
                   sha256=str(s["sha256"]), ids=[str(i) for i in s["ids"]])
            for s in blob["shards"]
        ]  # fmt: skip
    except ScoreMapError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as e:  # JSONDecodeError is a ValueError
        raise ScoreMapError(f"corrupted score-map index {path}: {type(e).__name__}: {e}") from e
    for s in shards:
        if len(s["ids"]) != s["count"]:
            raise ScoreMapError(f"corrupted score-map index {path}: shard {s['file']} lists {len(s['ids'])} ids for {s['count']} maps")
    return header, shards


def _write_index(root: Path, header: _Header, shards: list[_Shard]) -> None:
    blob = {
        "format": FORMAT,
        "version": _VERSION,
        "k": header.k,
        "num_classes": header.num_classes,
        "map_size": list(header.map_size),
        "shard_size": header.shard_size,
        "meta": header.meta,
        "shards": shards,
    }
    _atomic_write(root / _INDEX, lambda f: f.write(json.dumps(blob, indent=1).encode()))


def _check_present(root: Path, shard: _Shard) -> Path:
    path = root / shard["file"]
    if not path.is_file():
        raise ScoreMapError(f"score-map shard {path} is missing (listed in {root / _INDEX})")
    size = path.stat().st_size
    if size != shard["bytes"]:
        raise ScoreMapError(
            f"score-map shard {path} is truncated or corrupted: {size} bytes, but {root / _INDEX} records {shard['bytes']}"
        )
    return path


def _open_shard(path: Path, header: _Header, count: int, index: Path) -> np.ndarray:
    try:
        arr: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ScoreMapError(f"score-map shard {path} cannot be read: {e}") from e
    want = (count, 2, *header.map_size, header.k)
    if arr.dtype != np.uint16 or arr.shape != want:
        raise ScoreMapError(f"score-map shard {path} holds {arr.dtype} {arr.shape}, but {index} says uint16 {want}")
    return arr


class ScoreMapWriter:
    """Append top-k score maps to a sharded store; reopening a store resumes it.

    Completed shards listed in the index are kept (and checked); a final shard shorter
    than ``shard_size`` is read back into the buffer and rewritten when it fills or on
    ``close``; files the index does not list (an interrupted write) are removed.

    Args:
        root: the store's directory (created if absent).
        num_classes, map_size, k: what every map holds (``(hm, wm)`` cells, top-k).
        shard_size: images per shard.
        meta: JSON-able provenance (annotator model, input size, dataset); a resumed store
            must have been started with the same values.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with ScoreMapWriter(tmp.name, num_classes=10, map_size=(2, 2), k=3, shard_size=4) as w:
        ...     w.append(["a", "b"], compress(torch.softmax(torch.randn(2, 2, 2, 10), -1), k=3))
        >>> len(ScoreMaps(tmp.name)), ScoreMaps(tmp.name).ids
        (2, ('a', 'b'))
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        root: str | Path,
        *,
        num_classes: int,
        map_size: tuple[int, int],
        k: int = 5,
        shard_size: int = 1024,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if shard_size < 1 or k < 1 or num_classes < k:
            raise ValueError(f"need shard_size >= 1 and 1 <= k <= num_classes, got {shard_size}, {k}, {num_classes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        meta = json.loads(json.dumps(meta or {}))  # the JSON round trip that the index will make
        self._header = _Header(k, num_classes, (int(map_size[0]), int(map_size[1])), shard_size, meta)
        self._shards: list[_Shard] = []
        self._ids: list[str] = []
        self._buf_ids: list[str] = []
        self._buf: list[np.ndarray] = []  # (n, 2, hm, wm, k) uint16 blocks
        if (self.root / _INDEX).exists():
            self._resume()
        else:
            _write_index(self.root, self._header, [])
        self._seen = set(self._ids) | set(self._buf_ids)
        listed = {s["file"] for s in self._shards}
        for stray in self.root.glob("*shard-*"):  # shards of an interrupted write, and temporary files
            if stray.name not in listed:
                stray.unlink()

    def _resume(self) -> None:
        index = self.root / _INDEX
        header, shards = _read_index(self.root)
        differ = [
            name for name in ("k", "num_classes", "map_size", "shard_size", "meta")
            if getattr(header, name) != getattr(self._header, name)
        ]  # fmt: skip
        if differ:
            got = {n: getattr(header, n) for n in differ}
            want = {n: getattr(self._header, n) for n in differ}
            raise ScoreMapError(
                f"{index} was written with {got} but this run asks for {want}: "
                "use another output directory, or delete it to start over"
            )
        for shard in shards:
            _check_present(self.root, shard)
        if shards and shards[-1]["count"] < header.shard_size:  # the short last shard is rewritten
            last = shards.pop()
            path = self.root / last["file"]
            self._buf.append(np.array(_open_shard(path, header, last["count"], index)))
            self._buf_ids = list(last["ids"])
            _write_index(self.root, header, shards)  # before its file goes: the index never lists a missing shard
        self._shards = shards
        self._ids = [i for s in shards for i in s["ids"]]

    @property
    def ids(self) -> tuple[str, ...]:
        """Ids of every map written or buffered, in order."""
        return (*self._ids, *self._buf_ids)

    def __len__(self) -> int:
        return len(self._ids) + len(self._buf_ids)

    def append(self, ids: Sequence[str], maps: TopKMaps) -> None:
        """Add maps ``(b, hm, wm, k)`` for images ``ids``; full shards are written at once."""
        h = self._header
        want = (len(ids), *h.map_size, h.k)
        if tuple(maps.values.shape) != want or tuple(maps.indices.shape) != want or maps.num_classes != h.num_classes:
            raise ValueError(
                f"maps must be top-{h.k} of {h.num_classes} classes with shape {want}, got "
                f"{tuple(maps.values.shape)} of {maps.num_classes} classes"
            )
        dup = [i for i in ids if i in self._seen]
        if dup or len(set(ids)) != len(ids):
            raise ValueError(f"image ids must be unique; already present: {dup[:3]}")
        self._seen.update(ids)
        self._buf.append(_pack(maps.values.cpu().numpy(), maps.indices.cpu().numpy()))
        self._buf_ids.extend(ids)
        while len(self._buf_ids) >= h.shard_size:
            self._flush(h.shard_size)

    def _flush(self, count: int) -> None:
        block = np.concatenate(self._buf) if len(self._buf) > 1 else self._buf[0]
        data, rest = block[:count], block[count:]
        ids, self._buf_ids = self._buf_ids[:count], self._buf_ids[count:]
        self._buf = [rest] if len(rest) else []
        name = f"shard-{len(self._shards):05d}.npy"
        path = self.root / name
        _atomic_write(path, lambda f: np.save(f, np.ascontiguousarray(data), allow_pickle=False))
        self._shards.append(_Shard(file=name, count=count, bytes=path.stat().st_size, sha256=_sha256(path), ids=ids))
        self._ids.extend(ids)
        _write_index(self.root, self._header, self._shards)

    def close(self) -> None:
        """Write the buffered maps as a (short) last shard."""
        if self._buf_ids:
            self._flush(len(self._buf_ids))

    def __enter__(self) -> ScoreMapWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ScoreMaps:
    """Random access to a score-map store written by ``ScoreMapWriter``.

    Opening reads the index and checks that every shard exists with the recorded size;
    shards are memory-mapped on first use. ``load_all`` (and ``verify``) also check
    the checksums.

    Args:
        root: the store's directory.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._header, self._shards = _read_index(self.root)
        self._paths = [_check_present(self.root, s) for s in self._shards]
        self.ids: tuple[str, ...] = tuple(i for s in self._shards for i in s["ids"])
        counts = [s["count"] for s in self._shards]
        self._starts = np.cumsum([0, *counts])
        self._open: dict[int, np.ndarray] = {}
        self._positions: dict[str, int] | None = None

    @property
    def k(self) -> int:
        return self._header.k

    @property
    def num_classes(self) -> int:
        return self._header.num_classes

    @property
    def map_size(self) -> tuple[int, int]:
        return self._header.map_size

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self._header.meta)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes on disk: every shard and the index."""
        return sum(s["bytes"] for s in self._shards) + (self.root / _INDEX).stat().st_size

    def index_of(self, image_id: str) -> int:
        """Position of ``image_id`` in the store."""
        if self._positions is None:
            self._positions = {i: n for n, i in enumerate(self.ids)}
        if image_id not in self._positions:
            raise KeyError(f"no score map for image {image_id!r} in {self.root}")
        return self._positions[image_id]

    def _shard(self, s: int) -> np.ndarray:
        if s not in self._open:
            self._open[s] = _open_shard(self._paths[s], self._header, self._shards[s]["count"], self.root / _INDEX)
        return self._open[s]

    def get(self, items: Sequence[int] | Tensor) -> TopKMaps:
        """Top-k maps ``(b, hm, wm, k)`` of images at positions ``items``, in that order."""
        pos = np.asarray(items.cpu() if isinstance(items, Tensor) else items, dtype=np.int64).reshape(-1)
        n = len(self)
        if len(pos) and (pos.min() < -n or pos.max() >= n):
            raise IndexError(f"score-map positions must lie in [0, {n}), got {pos.min()}..{pos.max()}")
        pos = pos % max(n, 1)
        shard = np.searchsorted(self._starts, pos, side="right") - 1
        out = np.empty((len(pos), 2, *self.map_size, self.k), dtype=np.uint16)
        for s in np.unique(shard):
            rows = shard == s
            out[rows] = self._shard(int(s))[pos[rows] - self._starts[s]]
        return self._unpack(out)

    def __getitem__(self, item: int) -> TopKMaps:
        """One image's top-k map ``(hm, wm, k)``."""
        one = self.get([item])
        return TopKMaps(one.values[0], one.indices[0], self.num_classes)

    def _unpack(self, packed: np.ndarray) -> TopKMaps:
        values = torch.from_numpy(np.ascontiguousarray(packed[:, 0]).view(np.float16))
        indices = torch.from_numpy(np.ascontiguousarray(packed[:, 1]).view(np.int16))
        return TopKMaps(values, indices, self.num_classes)

    def verify(self) -> None:
        """Check every shard's checksum against the index."""
        for shard, path in zip(self._shards, self._paths):
            if _sha256(path) != shard["sha256"]:
                raise ScoreMapError(f"score-map shard {path} is corrupted: its sha256 differs from {self.root / _INDEX}")

    def load_all(self, verify: bool = True) -> TopKMaps:
        """The whole store in memory, ``(n, hm, wm, k)`` (checksums checked unless ``verify=False``)."""
        if verify:
            self.verify()
        blocks = [np.asarray(self._shard(s)) for s in range(len(self._shards))]
        if not blocks:
            return self._unpack(np.empty((0, 2, *self.map_size, self.k), dtype=np.uint16))
        return self._unpack(np.concatenate(blocks))


# ---------------------------------------------------------------------- crops and alignment
@dataclass(frozen=True, eq=False)
class CropParams:
    """Random crops of a batch, sampled apart from their application (and replayable).

    Args:
        boxes: ``(b, 4)`` fp32 ``x0, y0, x1, y1`` in pixels of each original image (edges,
            not centres: the whole image is ``0, 0, W, H``); a box may reach past the
            image (crops of a zero-padded image).
        flips: ``(b,)`` bool, a horizontal flip applied after the crop.
        image_sizes: ``(b, 2)`` long ``(H, W)`` of each original image.
    """

    boxes: Tensor
    flips: Tensor
    image_sizes: Tensor


def _sizes(image_sizes: Tensor | tuple[int, int], b: int) -> Tensor:
    if isinstance(image_sizes, Tensor):
        return image_sizes.long().reshape(b, 2)
    return torch.tensor(image_sizes, dtype=torch.long).expand(b, 2).clone()


def sample_resized_crops(
    image_sizes: Tensor | tuple[int, int],
    batch_size: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    generator: torch.Generator | None = None,
) -> CropParams:
    """torchvision's ``RandomResizedCrop`` boxes (10 tries, then a centre crop) and flips, per sample.

    Example:
        >>> p = sample_resized_crops((32, 32), 4, generator=torch.Generator().manual_seed(0))
        >>> tuple(p.boxes.shape), bool((p.boxes[:, 2:] <= 32).all())
        ((4, 4), True)
    """
    b, tries = batch_size, 10
    sizes = _sizes(image_sizes, b)
    hh, ww = sizes[:, 0:1].double(), sizes[:, 1:2].double()
    area = hh * ww
    u = torch.rand(b, tries, 4, generator=generator, dtype=torch.float64)
    target = area * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[..., 1])
    w = torch.round(torch.sqrt(target * aspect))
    h = torch.round(torch.sqrt(target / aspect))
    ok = (w > 0) & (w <= ww) & (h > 0) & (h <= hh)
    first = torch.where(ok.any(1), ok.double().argmax(1), torch.full((b,), -1, dtype=torch.long))
    pick = first.clamp_min(0).unsqueeze(1)
    w_, h_ = w.gather(1, pick).squeeze(1), h.gather(1, pick).squeeze(1)
    y0 = torch.floor(u[..., 2].gather(1, pick).squeeze(1) * (hh[:, 0] - h_ + 1))
    x0 = torch.floor(u[..., 3].gather(1, pick).squeeze(1) * (ww[:, 0] - w_ + 1))
    # fallback of torchvision: a centre crop with the aspect ratio clamped to the range
    in_ratio = ww[:, 0] / hh[:, 0]
    fw = torch.where(in_ratio < ratio[0], ww[:, 0], torch.where(in_ratio > ratio[1], torch.round(hh[:, 0] * ratio[1]), ww[:, 0]))
    fh = torch.where(in_ratio < ratio[0], torch.round(ww[:, 0] / ratio[0]), hh[:, 0])
    fallback = first < 0
    w_, h_ = torch.where(fallback, fw, w_), torch.where(fallback, fh, h_)
    y0 = torch.where(fallback, torch.floor((hh[:, 0] - h_) / 2), y0)
    x0 = torch.where(fallback, torch.floor((ww[:, 0] - w_) / 2), x0)
    boxes = torch.stack([x0, y0, x0 + w_, y0 + h_], dim=1).float()
    flips = torch.rand(b, generator=generator) < hflip
    return CropParams(boxes, flips, sizes)


def sample_padded_crops(
    image_size: tuple[int, int],
    batch_size: int,
    padding: int = 4,
    hflip: float = 0.5,
    generator: torch.Generator | None = None,
) -> CropParams:
    """CIFAR's augmentation: an image-sized crop of the image zero-padded by ``padding``, and flips."""
    hh, ww = image_size
    off = torch.randint(0, 2 * padding + 1, (batch_size, 2), generator=generator).float() - padding  # dy, dx
    boxes = torch.stack([off[:, 1], off[:, 0], off[:, 1] + ww, off[:, 0] + hh], dim=1)
    flips = torch.rand(batch_size, generator=generator) < hflip
    return CropParams(boxes, flips, _sizes(image_size, batch_size))


def crop_resize(x: Tensor, params: CropParams, size: tuple[int, int], padding: Padding = "zeros") -> Tensor:
    """Crop every sample's box out of ``x`` and resize it to ``size`` with RoIAlign, then flip.

    ``x`` may be the images themselves or any map that covers the whole image at a
    lower resolution (a score map): boxes in image pixels are scaled to ``x``'s cells.
    Each output cell averages bilinear samples (``ceil(bin size)`` per axis) of its bin.

    Args:
        x: ``(b, ch, hx, wx)`` float, covering each whole original image.
        params: the crops (boxes in original image pixels) and flips.
        size: ``(h, w)`` of the output.
        padding: what lies outside the image: ``"zeros"`` (padded images) or ``"border"``
            (the nearest cell: score maps, whose labels do not vanish at the border).

    Returns:
        ``(b, ch, h, w)`` in ``x``'s dtype.
    """
    from torchvision.ops import roi_align

    b, _, hx, wx = x.shape
    sizes = params.image_sizes.to(x.device).to(torch.float64)
    scale = torch.stack([wx / sizes[:, 1], hx / sizes[:, 0]] * 2, dim=1)
    boxes = params.boxes.to(x.device).to(torch.float64) * scale  # in cells of x
    lo = torch.stack([boxes[:, 0], boxes[:, 1]], dim=1)
    hi = torch.stack([boxes[:, 2] - wx, boxes[:, 3] - hx], dim=1)
    overhang = float(torch.cat([-lo, hi]).max()) if b else 0.0
    if overhang > 0:
        # roi_align clamps within one cell of the border and returns 0 beyond it; padding
        # explicitly gives every sample point its intended value (+1 for the bilinear neighbour).
        p = math.ceil(overhang) + 1
        x = F.pad(x, (p, p, p, p), mode="constant" if padding == "zeros" else "replicate")
        boxes = boxes + p
    rois = torch.cat([torch.arange(b, device=x.device, dtype=torch.float64).unsqueeze(1), boxes], dim=1)
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    out: Tensor = roi_align(work, rois.to(work.dtype), output_size=size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    out = torch.where(params.flips.to(x.device).view(b, 1, 1, 1), out.flip(-1), out)
    return out.to(x.dtype)


def align_score_maps(
    maps: Tensor | TopKMaps, params: CropParams, grid: tuple[int, int], fill: Fill = "renormalize"
) -> Tensor:
    """Each sample's score map aligned to its crop and flip, on the token grid.

    RoIAlign of the map (the paper's choice) over the crop box; map regions outside the
    image take the nearest cell's scores. Alignment is linear and the output cells are
    convex combinations of map cells, so distributions stay distributions.

    Args:
        maps: dense ``(b, c, hm, wm)`` maps, or ``TopKMaps`` ``(b, hm, wm, k)`` (made dense
            first with ``fill``: fine at small ``c``; the memory is ``b c hm wm`` fp32).
        params: the crops and flips applied to the images.
        grid: ``(h, w)`` token grid of the model.

    Returns:
        ``(b, h, w, c)`` fp32 per-token class distributions of the un-mixed samples.
    """
    dense = rearrange(maps.dense(fill), "b hm wm c -> b c hm wm") if isinstance(maps, TopKMaps) else maps.float()
    return rearrange(crop_resize(dense, params, grid, padding="border"), "b c h w -> b h w c")


@dataclass(frozen=True, eq=False)
class DenseTokenAnnotator:
    """Per-token targets from aligned score maps, mixed like the batch (a ``TokenAnnotator``).

    Holds each un-mixed sample's aligned targets and, called with a batch's label map,
    gives every token ``sum_k w_k * targets[source_k]`` at that token, ``w`` the map's
    exact token weights (Token Labeling Eq. 6 for MixToken's binary mask). The label
    map's ``label_smoothing`` ``s`` is applied as to soft labels: ``(1 - s) y + s / c``.

    Args:
        targets: ``(b, h, w, c)`` (from ``align_score_maps``) or ``(b, h*w, c)`` with ``grid``.
        grid: ``(h, w)``, needed for 3-d targets.

    Example:
        >>> from mixlabels import TokenLabeling
        >>> aligned = torch.softmax(torch.randn(2, 4, 4, 10), dim=-1)  # align_score_maps(...)
        >>> scheme = TokenLabeling(beta=0.5, annotator=DenseTokenAnnotator(aligned))
        >>> lm = TokenLabelMap.unmixed(torch.tensor([1, 2]), num_classes=10, image_size=(16, 16))
        >>> tuple(scheme.annotator(lm, (4, 4)).shape)
        (2, 16, 10)
    """

    targets: Tensor
    grid: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        t = self.targets
        if t.ndim == 4:
            object.__setattr__(self, "grid", (int(t.shape[1]), int(t.shape[2])))
            object.__setattr__(self, "targets", rearrange(t, "b h w c -> b (h w) c"))
        elif t.ndim != 3 or self.grid is None or self.grid[0] * self.grid[1] != t.shape[1]:
            raise ValueError(
                f"targets must be (b, h, w, c), or (b, h*w, c) with grid=(h, w); got {tuple(t.shape)} and grid={self.grid}"
            )

    def __call__(self, label_map: TokenLabelMap, grid: tuple[int, int]) -> Tensor:
        assert self.grid is not None
        (th, tw), (h, w) = self.grid, grid
        if self.targets.shape[0] != label_map.batch_size or self.targets.shape[2] != label_map.num_classes:
            raise ValueError(
                f"annotator targets {tuple(self.targets.shape)} do not fit a batch of {label_map.batch_size} "
                f"with {label_map.num_classes} classes"
            )
        targets = self.targets.to(label_map.device, torch.float32)
        if (th, tw) != (h, w):  # a coarser model grid: average the cells exactly
            if th % h or tw % w:
                raise ValueError(f"annotator targets on a {th}x{tw} grid cannot serve a {h}x{w} token grid")
            targets = reduce(targets, "b (h ph w pw) c -> b (h w) c", "mean", h=h, ph=th // h, w=w, pw=tw // w)
        weights = label_map.token_weights(grid)  # b n k
        mixed = torch.einsum("bknc,bnk->bnc", targets[label_map.sources], weights)
        s = label_map.label_smoothing
        return mixed * (1.0 - s) + s / label_map.num_classes if s else mixed
