"""The machine annotator: dense per-image score maps for token labeling (Token Labeling, section 4.1).

Any timm model (randomly initialised, or a checkpoint's state dict; nothing is
downloaded) scores every image of a split; its classifier is applied to every patch
token (ViTs, MLP-Mixers) or every feature-map location (CNNs, Swin) and softmaxed,
giving an ``(h, w, c)`` map per image. The top-k (default 5) of each cell are stored
in fp16/int16 in a sharded store with an index (``mixlabels.score_maps``).

Run from the repository root::

    python benchmarks/annotate.py --limit 2000                         # CIFAR-10 train, the default tiny DeiT
    python benchmarks/annotate.py --data imagenette --model resnet18 --model-kwargs '{}' --img-size 224 \\
        --checkpoint teacher.pth --out /data/score-maps/imagenette-r18
    python -m benchmarks.annotate --help

Images are resized whole to the model's input size (no centre crop), so the map
covers the whole image and any random crop of it can be aligned later. Ids are
``<split>/<class>/<file>`` in ImageFolder order (sorted classes, sorted files): the
order of ``benchmarks._archive.tensor_cache`` and of timm's and torchvision's
ImageFolder. Rerunning with the same arguments resumes an interrupted run (done
shards are kept); a larger ``--limit`` extends a finished one.

An archive (``.tar``/``.tar.gz``) is streamed once and the split's compressed images
are held in memory (CIFAR-10 train: 17 MB; Imagenette train: 95 MB); for archives
too large for that, extract them once and pass the directory.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/annotate.py``: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from einops import rearrange, repeat
from PIL import Image
from torch import Tensor, nn

from mixlabels.score_maps import ScoreMapError, ScoreMaps, ScoreMapWriter, compress

__all__ = ["main", "list_images", "dense_scores", "annotate"]

_ROOT = Path(__file__).resolve().parents[1]
_NAMED = {"cifar10": "cifar10-jpg.tar.gz", "imagenette": "imagenette2-224-jpg.tar.gz"}
_IMAGE_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
_DEFAULT_MODEL = "deit_tiny_patch16_224"
# The ablation's CIFAR model, globally average-pooled: a head trained on the mean of the patch tokens is
# meaningful on each token (as a CNN's is on each location, CAM); a class-token head is not trained on patches.
_DEFAULT_KWARGS = (
    '{"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 6, "num_heads": 2, '
    '"class_token": false, "global_pool": "avg"}'
)

Loader = Callable[[], bytes]


def _resolve_data(data: str) -> Path:
    path = (_ROOT.parent / "shared" / "data" / _NAMED[data]) if data in _NAMED else Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"no data at {path}: --data takes cifar10, imagenette, an ImageFolder directory "
            "(<split>/<class>/<image>) or a .tar/.tar.gz of one"
        )
    return path.resolve()


def _is_image(name: str) -> bool:
    return name.lower().endswith(_IMAGE_EXT)


def list_images(source: Path, split: str) -> list[tuple[str, Loader]]:
    """``(id, load bytes)`` of every image of ``split``, ids ``<split>/<class>/<file>`` in ImageFolder order.

    A directory is read lazily; an archive is streamed once (members at any depth
    ``.../<split>/<class>/<file>``) and its images kept in memory.
    """
    found: dict[str, Loader] = {}
    if source.is_dir():
        base = source / split
        if not base.is_dir():
            raise FileNotFoundError(f"no {split}/ directory in {source}")
        for cls_dir in base.iterdir():
            if cls_dir.is_dir():
                for f in cls_dir.iterdir():
                    if _is_image(f.name):
                        found[f"{split}/{cls_dir.name}/{f.name}"] = f.read_bytes
    else:
        with tarfile.open(source, mode="r|*") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                if member.isfile() and len(parts) >= 3 and parts[-3] == split and _is_image(member.name):
                    handle = tar.extractfile(member)
                    if handle is not None:
                        data = handle.read()
                        found[f"{split}/{parts[-2]}/{parts[-1]}"] = lambda data=data: data  # type: ignore[misc]
    if not found:
        raise FileNotFoundError(f"no images under {split}/<class>/ in {source}")
    return sorted(found.items(), key=lambda item: tuple(item[0].split("/")[1:]))


def _decode(data: bytes, size: tuple[int, int]) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
        if rgb.size != (size[1], size[0]):
            rgb = rgb.resize((size[1], size[0]), Image.Resampling.BICUBIC)
        return np.asarray(rgb, dtype=np.uint8)


def dense_scores(model: nn.Module, images: Tensor) -> Tensor:
    """The classifier on every token or feature location, softmaxed: ``(b, h, w, c)`` fp32.

    Each location's feature goes through the model's own ``forward_head`` as if it were
    the whole image's pooled feature (a 1x1 map, or the token repeated in every slot so
    that class-token and average pooling both read it), so head norms and heads of any
    family apply unchanged.
    """
    m: Any = model
    feats = m.forward_features(images)
    if feats.ndim == 3:  # b (prefix + h w) d: ViT-like
        prefix = int(getattr(m, "num_prefix_tokens", 0))
        if getattr(m, "attn_pool", None) is not None:
            raise ValueError("models with attention pooling heads ('map') have no per-token classifier")
        tokens = feats[:, prefix:]
        n = tokens.shape[1]
        grid = getattr(getattr(m, "patch_embed", None), "grid_size", None)
        h, w = (int(grid[0]), int(grid[1])) if grid is not None and grid[0] * grid[1] == n else (int(n**0.5), int(n**0.5))
        if h * w != n:
            raise ValueError(f"cannot lay {n} tokens out on a grid; pass a model with a square token grid")
        flat = repeat(tokens, "b n d -> (b n) p d", p=prefix + 1)
    elif getattr(m, "output_fmt", "NCHW") == "NHWC":  # Swin and friends: b h w d
        b, h, w, _ = feats.shape
        flat = rearrange(feats, "b h w d -> (b h w) 1 1 d")
    else:  # CNNs: b d h w
        b, _, h, w = feats.shape
        flat = rearrange(feats, "b d h w -> (b h w) d 1 1")
    logits: Tensor = m.forward_head(flat)  # (b h w) c
    return rearrange(logits.float().softmax(dim=-1), "(b h w) c -> b h w c", h=h, w=w)


def _load_checkpoint(model: nn.Module, path: Path) -> None:
    blob = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict", "model_ema"):
        if isinstance(blob, dict) and key in blob and isinstance(blob[key], dict):
            blob = blob[key]
            break
    state = {k.removeprefix("module.").removeprefix("model."): v for k, v in blob.items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise RuntimeError(f"checkpoint {path} does not fit the model: {e}") from e


def _batches(items: Sequence[tuple[str, Loader]], size: int) -> Iterator[Sequence[tuple[str, Loader]]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def annotate(
    model: nn.Module,
    items: Sequence[tuple[str, Loader]],
    out: Path,
    *,
    img_size: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    k: int = 5,
    batch_size: int = 64,
    shard_size: int = 1024,
    meta: dict[str, Any] | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> ScoreMaps:
    """Score ``items`` with ``model`` into the store ``out``, resuming what is already there."""
    from tqdm import tqdm

    model = model.eval().to(device)
    mean_t = torch.tensor(mean, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, device=device).view(1, 3, 1, 1)
    ids = [i for i, _ in items]
    probe = torch.zeros(1, 3, *img_size, device=device)
    with torch.inference_mode():
        shape = dense_scores(model, probe).shape  # 1 h w c
    writer = ScoreMapWriter(
        out, num_classes=int(shape[3]), map_size=(int(shape[1]), int(shape[2])), k=k, shard_size=shard_size, meta=meta
    )
    done = writer.ids
    if tuple(ids[: len(done)]) != done:
        first = next((i for i, (a, b) in enumerate(zip(ids, done)) if a != b), min(len(ids), len(done)))
        raise ScoreMapError(
            f"{out / 'index.json'} holds maps of other images than this run's (first difference at position "
            f"{first}); use another --out or delete it"
        )
    todo = items[len(done) :]
    with writer, tqdm(total=len(items), initial=len(done), unit="img", disable=not progress, desc="annotate") as bar:
        for batch in _batches(todo, batch_size):
            pixels = np.stack([_decode(load(), img_size) for _, load in batch])
            x = torch.from_numpy(pixels).to(device).permute(0, 3, 1, 2).float().div_(255.0)
            with torch.inference_mode():
                scores = dense_scores(model, (x - mean_t) / std_t)
            writer.append([i for i, _ in batch], compress(scores, k))
            bar.update(len(batch))
    return ScoreMaps(out)


def _default_out(source: Path, split: str, model: str, img: tuple[int, int]) -> Path:
    cache = Path(os.environ.get("MIXLABELS_CACHE") or Path.home() / ".cache" / "mixlabels").expanduser()
    stem = source.name.split(".")[0]
    return cache / "score-maps" / f"{stem}-{split}-{model}-{img[0]}x{img[1]}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/annotate.py",
        description="Write per-image dense score maps (top-k, fp16/int16, sharded, resumable) from a timm annotator.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", default="cifar10", help="cifar10, imagenette, an ImageFolder directory or a .tar(.gz)")
    p.add_argument("--split", default="train", help="the split folder to annotate")
    p.add_argument("--model", default=_DEFAULT_MODEL, help="timm model name (built with pretrained=False)")
    p.add_argument("--model-kwargs", default=_DEFAULT_KWARGS, help="JSON keyword arguments for timm.create_model")
    p.add_argument("--checkpoint", type=Path, default=None, help="a state dict for the model (random init if absent)")
    p.add_argument("--seed", type=int, default=0, help="seeds a random init (so that a resumed run scores alike)")
    p.add_argument("--num-classes", type=int, default=None, help="classifier size (default: the split's classes)")
    p.add_argument("--img-size", type=int, default=None, help="input side in pixels (default: the model's)")
    p.add_argument("--out", type=Path, default=None, help="store directory (default: under $MIXLABELS_CACHE)")
    p.add_argument("--k", type=int, default=5, help="scores kept per map cell")
    p.add_argument("--shard-size", type=int, default=1024, help="images per shard")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="annotate only the first N images (ImageFolder order)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import timm
    from timm.data.config import resolve_data_config

    try:
        kwargs = json.loads(args.model_kwargs)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--model-kwargs is not valid JSON ({e.msg} at column {e.colno}): {args.model_kwargs!r}; "
                         """e.g. --model-kwargs '{"img_size": 32, "patch_size": 4}'""") from e
    if not isinstance(kwargs, dict):
        raise SystemExit(f"--model-kwargs must be a JSON object of timm.create_model arguments, got {args.model_kwargs!r}")

    if args.threads:
        torch.set_num_threads(args.threads)
    source = _resolve_data(args.data)
    t0 = time.perf_counter()
    items = list_images(source, args.split)
    classes = sorted({i.split("/")[1] for i, _ in items})
    if args.limit is not None:
        items = items[: args.limit]
    num_classes = args.num_classes or len(classes)
    torch.manual_seed(args.seed)
    model = timm.create_model(args.model, pretrained=False, num_classes=num_classes, **kwargs)
    if args.checkpoint is not None:
        _load_checkpoint(model, args.checkpoint)
    cfg: dict[str, Any] = resolve_data_config({}, model=model)  # type: ignore[no-untyped-call]
    side = args.img_size or int(getattr(getattr(model, "patch_embed", None), "img_size", cfg["input_size"][1:])[0])
    img = (side, side)
    meta = {
        "model": args.model,
        "model_kwargs": kwargs,
        "checkpoint": args.checkpoint.name if args.checkpoint else None,
        "seed": None if args.checkpoint else args.seed,
        "img_size": list(img),
        "data": source.name,
        "split": args.split,
        "classes": classes,
    }
    out = args.out or _default_out(source, args.split, args.model, img)
    print(f"annotating {len(items)} images of {source.name}:{args.split} with {args.model} at {side}px -> {out}", flush=True)
    store = annotate(
        model, items, out, img_size=img, mean=cfg["mean"], std=cfg["std"], k=args.k, batch_size=args.batch_size,
        shard_size=args.shard_size, meta=meta, device=args.device, progress=not args.no_progress,
    )  # fmt: skip
    n = len(store)
    hm, wm = store.map_size
    per_image = store.nbytes / max(n, 1)
    dense = hm * wm * store.num_classes * 4
    print(
        f"{n} maps of {hm}x{wm} cells x top-{store.k} of {store.num_classes} classes in {out} "
        f"({time.perf_counter() - t0:.1f} s)\n"
        f"storage: {store.nbytes} bytes, {per_image:.0f} bytes per image (payload {hm * wm * store.k * 4}; "
        f"dense fp32 would be {dense}, {dense / per_image:.1f}x more)"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (FileNotFoundError, ScoreMapError) as err:  # the message names the file and the fix
        print(f"annotate: {err}", file=sys.stderr)
        sys.exit(2)
