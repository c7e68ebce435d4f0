"""The sharded score-map store: a JSON index and shards of packed top-k maps, written resumably, read lazily."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
from torch import Tensor

from mixlabels.score_maps._topk import ScoreMapError, TopKMaps

__all__ = ["FORMAT", "ScoreMapWriter", "ScoreMaps"]

FORMAT = "mixlabels.score_maps"
_VERSION = 1
_INDEX = "index.json"

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


def _check_contents(arr: np.ndarray, path: Path, num_classes: int) -> None:
    """Class ids in ``[0, num_classes)`` and finite, non-negative scores, or a ``ScoreMapError`` naming the file."""
    ids = arr[:, 1].view(np.int16)
    bad = (ids < 0) | (ids >= num_classes)
    if bad.any():
        found = np.unique(ids[bad])
        raise ScoreMapError(
            f"score-map shard {path} holds invalid class ids {found[:8].tolist()} (of {int(bad.sum())} entries; "
            f"ids must lie in [0, {num_classes - 1}]): re-annotate this store"
        )
    scores = arr[:, 0].view(np.float16)
    if not np.isfinite(scores).all() or (scores < 0).any():
        raise ScoreMapError(f"score-map shard {path} holds NaN, inf or negative scores: re-annotate this store")


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
        >>> from mixlabels.score_maps import compress
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
        if maps.indices.numel():
            lo, hi = int(maps.indices.min()), int(maps.indices.max())
            if lo < 0 or hi >= h.num_classes:
                raise ValueError(f"maps hold class ids in [{lo}, {hi}] but num_classes={h.num_classes}; ids must lie in [0, {h.num_classes - 1}]")
            v = maps.values.float()
            if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
                raise ValueError("maps hold NaN, inf or negative scores; store probabilities (compress(softmax(logits)))")
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
    shards are memory-mapped on first use, when each is checked once, whole: its checksum,
    its class ids and scores (a ``ScoreMapError`` names the file). ``verify`` checks every
    shard's checksum at once.

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
            # The first read of a shard checks it whole (checksum, class ids, scores): once per shard
            # and process, never per step, and a corrupted shard (zeroed bytes of the same size)
            # is a ScoreMapError naming the file instead of targets that sum to 0.
            self._verify_shard(s)
            arr = _open_shard(self._paths[s], self._header, self._shards[s]["count"], self.root / _INDEX)
            _check_contents(arr, self._paths[s], self.num_classes)
            self._open[s] = arr
        return self._open[s]

    def _verify_shard(self, s: int) -> None:
        shard, path = self._shards[s], self._paths[s]
        if _sha256(path) != shard["sha256"]:
            raise ScoreMapError(
                f"score-map shard {path} is corrupted: its sha256 differs from the one {self.root / _INDEX} records; "
                "re-annotate the store (delete the shard and its index entry, or the directory)"
            )

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
        """Check every shard's checksum against the index (reading a shard checks it the first time anyway)."""
        for s in range(len(self._shards)):
            self._verify_shard(s)

    def load_all(self, verify: bool = True) -> TopKMaps:
        """The whole store in memory, ``(n, hm, wm, k)`` (checksums checked unless ``verify=False``)."""
        if verify:
            self.verify()
        if not verify:  # the caller vouches for the shards: open them without the first-read check
            for s in range(len(self._shards)):
                if s not in self._open:
                    path = self._paths[s]
                    arr = _open_shard(path, self._header, self._shards[s]["count"], self.root / _INDEX)
                    _check_contents(arr, path, self.num_classes)
                    self._open[s] = arr
        blocks = [np.asarray(self._shard(s)) for s in range(len(self._shards))]
        if not blocks:
            return self._unpack(np.empty((0, 2, *self.map_size, self.k), dtype=np.uint16))
        return self._unpack(np.concatenate(blocks))


