"""Token fluctuation pictures and numbers (TL-Align Figures 3, 4 and 5) for a ViT on real images.

For a checkpoint (a timm state dict) or a random-init model and a few real images
read straight from a ``../shared/data`` archive, CutMix the images (boxes snapped to
the token grid) and write, under ``--out``:

- ``label_maps.png`` (Figure 5/8 layout): the two sources, the mixed image, the
  original label map and the label map aligned by TL-Align after the last block
  (plus one extra panel: after the first block); red = the first source (the sample
  itself), blue = the second (the pasted box).
- ``mixing_ratio.png`` (Figure 4): the mixing ratio (weight of the first source)
  per block of the class token and of the most fluctuating patch token, the
  similarity "ground truth" (App. B Eq. 13) against CutMix, TransMix, TokenLabeling
  and TL-Align; and the token presence of Eq. 2 per block.
- ``rmse_by_size.png`` (Figure 3): RMSE between CutMix targets and TL-Align targets
  for trained checkpoints of several widths (``--size-checkpoints``), or else for
  random-init tiny/small/base-like ViTs at a small image size, next to a bar for
  the analysed model.
- ``analysis.json``: every number behind the pictures.

Random-init ViTs attend almost uniformly, so their aligned labels stay at the image
lambda; ``--sharpen S`` scales every block's attention logits by ``S`` (q and k by
sqrt(S)) as a stand-in for a trained model's peaked attention, and says so in the titles.

Usage::

    python benchmarks/analysis.py                                   # Imagenette, random-init DeiT-S-like
    python benchmarks/analysis.py --sharpen 30 --out runs/analysis-sharpened
    python benchmarks/analysis.py --data cifar10 --img-size 32 --patch-size 4
    python benchmarks/analysis.py --checkpoint runs/ablation/model.pt --model deit_tiny_patch16_224 \\
        --data cifar10 --num-heads 2                               # a state dict from training

A checkpoint written by ``benchmarks/ablation.py --save-checkpoints``
(``<out>/checkpoints/<run key>.pth``) is read with its run file
(``<out>/runs/<run key>.json``), which gives the head count a state dict cannot tell.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from benchmarks._provenance import finish, provenance

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMED = {"cifar10": "cifar10-jpg.tar.gz", "imagenette": "imagenette2-224-jpg.tar.gz"}
IMAGE_EXT = (".jpg", ".jpeg", ".png")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
# DeiT's three sizes (embed dim, heads); depth 12 unless --size-depth says otherwise.
SIZES: dict[str, tuple[int, int]] = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12)}
SCHEMES = ("cutmix", "transmix", "token_labeling", "tl_align")
SCHEME_LABELS = {
    "similarity": "token similarity (Eq. 13, 'ground truth')",
    "cutmix": "CutMix",
    "transmix": "TransMix",
    "token_labeling": "TokenLabeling",
    "tl_align": "TL-Align",
}
SCHEME_STYLE: dict[str, dict[str, Any]] = {
    "similarity": {"color": "black", "linewidth": 2.5, "marker": "o"},
    "cutmix": {"color": "tab:gray", "linestyle": "--"},
    "transmix": {"color": "tab:orange", "linestyle": "-."},
    "token_labeling": {"color": "tab:green", "linestyle": ":", "linewidth": 2.0},
    "tl_align": {"color": "tab:red", "marker": "s"},
}


# ---------------------------------------------------------------------- data
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


# ---------------------------------------------------------------------- models
def load_state_dict(path: Path) -> dict[str, Tensor]:
    """A timm state dict, unwrapped from ``{"model": ...}``/``{"state_dict": ...}`` and ``module.`` prefixes."""
    blob: Any = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(blob, dict) and isinstance(blob.get(key), dict):
            blob = blob[key]
    if not isinstance(blob, dict):
        raise ValueError(f"{path} holds a {type(blob).__name__}, not a state dict")
    state: dict[str, Tensor] = {}
    for k, v in blob.items():
        for prefix in ("module.", "model."):
            k = k[len(prefix) :] if k.startswith(prefix) else k
        state[k] = v
    return state


def architecture_of(state: dict[str, Tensor]) -> dict[str, Any]:
    """What a ViT state dict tells about its architecture (not the number of heads)."""
    proj = state["patch_embed.proj.weight"]  # d 3 p p
    embed_dim, patch = int(proj.shape[0]), int(proj.shape[-1])
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    arch: dict[str, Any] = {"embed_dim": embed_dim, "patch_size": patch, "depth": depth}
    if "head.weight" in state:
        arch["num_classes"] = int(state["head.weight"].shape[0])
    prefix = int("cls_token" in state) + (int(state["reg_token"].shape[1]) if "reg_token" in state else 0)
    if "cls_token" not in state:
        arch.update(class_token=False, global_pool="avg")
    if "pos_embed" in state:
        for n in (int(state["pos_embed"].shape[1]) - prefix, int(state["pos_embed"].shape[1])):
            side = math.isqrt(n)
            if side * side == n:
                arch["img_size"] = side * patch
                break
    return arch


def heads_from_run_file(checkpoint: Path) -> int | None:
    """The head count of an ablation checkpoint ``<out>/checkpoints/<key>.pth``, from ``<out>/runs/<key>.json``."""
    run_file = checkpoint.parent.parent / "runs" / f"{checkpoint.stem}.json"
    try:
        heads = json.loads(run_file.read_text())["run"]["model"]["num_heads"]
    except (OSError, ValueError, KeyError, TypeError):  # no run file, or not the ablation's
        return None
    return heads if isinstance(heads, int) else None


def checkpoint_model(name: str, path: Path, overrides: dict[str, Any], sharpen: float) -> tuple[nn.Module, dict[str, Any]]:
    """The trained ViT in ``path``: its architecture from the state dict, its heads from the run file or
    ``overrides``/``embed_dim // 64``, every other ``overrides`` value on top."""
    state = load_state_dict(path)
    arch: dict[str, Any] = {"num_classes": 10, **architecture_of(state)}
    arch["num_heads"] = heads_from_run_file(path) or max(1, arch["embed_dim"] // 64)
    arch.update({k: v for k, v in overrides.items() if v is not None})
    arch.setdefault("img_size", 224)
    model = build_model(name, arch, sharpen)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(
            f"checkpoint {path} does not fit {name} {arch}: missing {missing[:4]}, unexpected {unexpected[:4]}; "
            "set --model/--num-heads/--img-size to the trained architecture"
        )
    return model, arch


def build_model(name: str, arch: dict[str, Any], sharpen: float) -> nn.Module:
    """A timm ViT (``pretrained=False``) in eval mode, attention logits optionally scaled by ``sharpen``."""
    import timm  # imports torchvision: keep it off the --help path

    model: nn.Module = timm.create_model(name, pretrained=False, **arch)
    if sharpen != 1.0:
        # Random-init ViTs attend almost uniformly; scaling q and k by sqrt(s) scales the
        # attention logits by s: a stand-in for the peaked attention of trained models.
        m: Any = model
        with torch.no_grad():
            for blk in m.blocks:
                qk = 2 * blk.attn.qkv.weight.shape[0] // 3
                blk.attn.qkv.weight[:qk] *= math.sqrt(sharpen)
                if blk.attn.qkv.bias is not None:
                    blk.attn.qkv.bias[:qk] *= math.sqrt(sharpen)
    return model.eval()


# ---------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class Batch:
    raw: Tensor  # b 3 H W, [0, 1], for pictures
    images: Tensor  # b 3 H W, normalised, un-mixed
    labels: Tensor  # b
    classes: list[str]


def cutmix_map(batch: Batch, num_classes: int, patch: int, seed: int) -> Any:
    """A CutMix map with boxes of 40-60% side ratio snapped to the token grid, partner = flipped batch."""
    from mixlabels.strategies import CutMix

    generator = torch.Generator().manual_seed(seed)
    mixer = CutMix(num_classes=num_classes, minmax=(0.4, 0.6), patch_size=patch, mode="elem", generator=generator)
    _, label_map = mixer(batch.images, batch.labels % num_classes)
    return label_map


def layer_numbers(result: Any, sample: int) -> dict[str, Any]:
    """Per-block curves (weight of source 0) for the JSON and Figure 4."""
    r = result.ratios
    sim = r.similarity  # b l n k
    curves: dict[str, Any] = {}
    # The most fluctuating patch token: its similarity ratio moves most over the blocks.
    p = result.mixed.num_prefix
    span = sim[sample, :, p:, 0].amax(0) - sim[sample, :, p:, 0].amin(0)  # n
    token = p + int(span.argmax())
    for tok_name, tok in (("class_token", 0), ("fluctuating_token", token)):
        entry: dict[str, Any] = {"token_index": tok}
        for name in ("similarity", *SCHEMES):
            ratio = getattr(r, name)
            if ratio is not None:
                entry[name] = ratio[sample, :, tok, 0].tolist()
        curves[tok_name] = entry
    # Mean |scheme - similarity| over all samples and tokens, per block.
    curves["mean_abs_error_vs_similarity"] = {
        name: (getattr(r, name)[..., 0] - sim[..., 0]).abs().mean(dim=(0, 2)).tolist()
        for name in SCHEMES
        if getattr(r, name) is not None
    }
    pres = result.presence[:, :, p:]  # b l n, patch tokens
    flat = rearrange(pres, "b l n -> l (b n)")
    curves["presence_patch_tokens"] = {
        "mean": flat.mean(1).tolist(),
        "std": flat.std(1).tolist(),
        "min": flat.amin(1).tolist(),
        "p10": flat.quantile(0.1, dim=1).tolist(),
        "median": flat.median(1).values.tolist(),
        "p90": flat.quantile(0.9, dim=1).tolist(),
        "max": flat.amax(1).tolist(),
    }
    return curves


# ---------------------------------------------------------------------- pictures
def _rgb(x: Tensor) -> Any:
    return x.clamp(0, 1).permute(1, 2, 0).numpy()


def plot_label_maps(path: Path, batch: Batch, label_map: Any, result: Any, pairs: int, title: str) -> None:
    """Figure 5's layout: sources, mixed image, original and aligned label maps (red: source 0)."""
    import matplotlib.pyplot as plt

    grid = result.mixed.grid
    p = result.mixed.num_prefix
    mixed_raw = label_map.mix_pixels(batch.raw)
    original = result.ratios.token_labeling[:, 0, p:, 0]  # b n: weight of source 0
    first = result.ratios.tl_align[:, 0, p:, 0]
    aligned = result.ratios.tl_align[:, -1, p:, 0]
    depth = result.mixed.depth
    fig, axes = plt.subplots(pairs, 6, figsize=(18, 3.2 * pairs + 0.8), squeeze=False)
    image = None
    for row in range(pairs):
        s0, s1 = (int(i) for i in label_map.sources[row])
        lam = float(label_map.image_weights[row, 0])
        lam_aligned = float(result.tl_align_target[row, 0])
        panels = [
            (_rgb(batch.raw[s0]), f"source 1 (red): {batch.classes[int(batch.labels[s0])]}"),
            (_rgb(batch.raw[s1]), f"source 2 (blue): {batch.classes[int(batch.labels[s1])]}"),
            (_rgb(mixed_raw[row]), f"CutMix image, lambda = {lam:.2f}"),
        ]
        for col, (img, text) in enumerate(panels):
            axes[row, col].imshow(img)
            axes[row, col].set_title(text, fontsize=9)
        maps = [
            (original[row], f"original label map ({grid[0]}x{grid[1]} tokens)"),
            (first[row], f"aligned after block 1 (extra panel)\n"
             f"token range [{float(first[row].min()):.2f}, {float(first[row].max()):.2f}]"),
            (aligned[row], f"aligned after block {depth}: cls lambda = {lam_aligned:.2f}\n"
             f"token range [{float(aligned[row].min()):.2f}, {float(aligned[row].max()):.2f}]"),
        ]
        for col, (values, text) in enumerate(maps, start=3):
            image = axes[row, col].imshow(
                values.reshape(grid).numpy(), cmap="bwr", vmin=0.0, vmax=1.0, interpolation="nearest"
            )
            axes[row, col].set_title(text, fontsize=9)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    assert image is not None
    cax = fig.add_axes((0.94, 0.15, 0.012, 0.7))
    fig.colorbar(image, cax=cax, label="weight of source 1 (red) in the token's label")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_mixing_ratio(path: Path, curves: dict[str, Any], title: str) -> None:
    """Figure 4: mixing ratio per block, similarity 'ground truth' against each scheme; presence."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, what in (
        (axes[0], "class_token", "class token"),
        (axes[1], "fluctuating_token", f"most fluctuating patch token (#{curves['fluctuating_token']['token_index']})"),
    ):
        entry = curves[key]
        layers = np.arange(1, len(entry["similarity"]) + 1)
        for name in ("similarity", *SCHEMES):
            if name in entry:
                ax.plot(layers, entry[name], label=SCHEME_LABELS[name], **SCHEME_STYLE[name])
        ax.set_xlabel("transformer block")
        ax.set_ylabel("mixing ratio lambda (weight of source 1)")
        ax.set_title(what, fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(layers)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    pres = curves["presence_patch_tokens"]
    layers = np.arange(1, len(pres["median"]) + 1)
    floor = 1e-3  # log scale: presence can reach 0 (a token no output attends to)

    def clip(values: list[float]) -> Any:
        return np.maximum(np.asarray(values), floor)

    band = {"color": "tab:purple", "alpha": 0.25, "label": "10-90th percentile"}
    axes[2].fill_between(layers, clip(pres["p10"]), clip(pres["p90"]), **band)
    axes[2].plot(layers, clip(pres["median"]), color="tab:purple", marker="o", label="median")
    axes[2].plot(layers, clip(pres["min"]), color="tab:purple", linestyle=":", label="min / max")
    axes[2].plot(layers, clip(pres["max"]), color="tab:purple", linestyle=":")
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("transformer block")
    axes[2].set_ylabel("token presence p(z_i) (Eq. 2), log scale")
    axes[2].set_title(
        "presence of patch tokens in the attention output\n"
        "(1 = no fluctuation, as a convolution; the mean over all tokens is 1)",
        fontsize=10,
    )
    axes[2].set_xticks(layers)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rmse(path: Path, bars: list[dict[str, Any]], title: str) -> None:
    """Figure 3: RMSE between CutMix targets and TL-Align labels per model size."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 3, 4.5))
    xs = np.arange(len(bars))
    values = [b["rmse"] for b in bars]
    colours = ["tab:blue" if b["kind"] == "size" else "tab:red" for b in bars]
    rects = ax.bar(xs, values, color=colours, width=0.6)
    for rect, v in zip(rects, values):
        ax.annotate(f"{v:.4f}", (rect.get_x() + rect.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels([b["label"] for b in bars], fontsize=9)
    ax.set_ylabel("RMSE(CutMix target, TL-Align target)\nover source weights")
    ax.set_xlabel("model")
    ax.set_ylim(0, max(max(values) * 1.25, 1e-3))
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- command
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="imagenette", help="cifar10, imagenette, or a <split>/<class>/<img> .tar.gz path")
    ap.add_argument("--split", default="train", help="split folder in the archive (train comes first in the tar)")
    ap.add_argument("--checkpoint", default=None, help="a timm ViT state dict; without it the model is random init")
    ap.add_argument("--model", default="deit_small_patch16_224", help="timm model name (pretrained=False)")
    ap.add_argument("--img-size", type=int, default=None, help="image side (default: the checkpoint's, else 224)")
    ap.add_argument("--patch-size", type=int, default=None, help="default: the checkpoint's, else the model's")
    ap.add_argument("--embed-dim", type=int, default=None)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--num-heads", type=int, default=None, help="with a checkpoint: default embed_dim // 64")
    ap.add_argument("--batch-size", type=int, default=8, help="images read (distinct classes) and mixed")
    ap.add_argument("--pairs", type=int, default=2, help="rows of the label-map picture")
    ap.add_argument("--sizes", default="tiny,small,base", help="tiny/small/base, comma-separated, for the RMSE chart")
    ap.add_argument("--size-checkpoints", default=None,
                    help="comma-separated trained checkpoints (e.g. of several widths) for the RMSE chart, "
                    "instead of the random-init --sizes")
    ap.add_argument("--size-img", type=int, default=64, help="image side of the model-size comparison")
    ap.add_argument("--size-patch", type=int, default=8, help="patch size of the model-size comparison")
    ap.add_argument("--size-depth", type=int, default=12, help="depth of the model-size comparison")
    ap.add_argument("--sharpen", type=float, default=1.0, help="scale attention logits (stand-in for training)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/analysis")
    args = ap.parse_args(argv)
    if args.batch_size < 2 or not 1 <= args.pairs <= args.batch_size:
        ap.error("need --batch-size >= 2 and 1 <= --pairs <= --batch-size")
    return args


def analysed_model(args: argparse.Namespace) -> tuple[nn.Module, dict[str, Any], str]:
    """The model to analyse: a checkpoint's architecture with command-line overrides, or random init."""
    overrides = {key: getattr(args, key) for key in ("img_size", "patch_size", "embed_dim", "depth", "num_heads")}
    if args.checkpoint:
        model, arch = checkpoint_model(args.model, Path(args.checkpoint), overrides, args.sharpen)
    else:
        arch = {"num_classes": 10, "img_size": 224, **{k: v for k, v in overrides.items() if v is not None}}
        model = build_model(args.model, arch, args.sharpen)
    init = f"checkpoint {Path(args.checkpoint).name}" if args.checkpoint else "RANDOM INIT (untrained)"
    if args.sharpen != 1.0:
        init += f", attention logits x{args.sharpen:g}"
    return model, arch, init


def make_batch(raw: Tensor, labels: Tensor, classes: list[str], cifar: bool) -> Batch:
    mean, std = (CIFAR_MEAN, CIFAR_STD) if cifar else (IMAGENET_MEAN, IMAGENET_STD)
    images = (raw - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    return Batch(raw=raw, images=images, labels=labels, classes=classes)


def size_bars(
    args: argparse.Namespace, batch: Batch, cifar: bool, sizes: list[str], progress: Any
) -> list[dict[str, Any]]:
    """Figure 3's bars: RMSE of tiny/small/base-like ViTs (DeiT widths) on the same images, smaller."""
    from mixlabels.analysis import analyse

    side = (args.size_img, args.size_img)
    raw = F.interpolate(batch.raw, size=side, mode="bilinear", antialias=True)
    small = make_batch(raw, batch.labels, batch.classes, cifar)
    label_map = cutmix_map(small, 10, args.size_patch, args.seed)
    bars = []
    for name in sizes:
        progress.set_postfix_str(f"RMSE, {name}-like ViT")
        dim, heads = SIZES[name]
        torch.manual_seed(args.seed)
        arch = {"img_size": args.size_img, "patch_size": args.size_patch, "embed_dim": dim, "depth": args.size_depth}
        arch["num_heads"] = heads
        model = build_model("vit_base_patch16_224", arch | {"num_classes": 10}, args.sharpen)
        result = analyse(model, small.images, label_map, similarity=False)
        bars.append({"label": f"{name}-like\nd={dim}, h={heads}", "kind": "size", "rmse": float(result.rmse)} | arch)
        progress.update()
    return bars


def checkpoint_bars(args: argparse.Namespace, batch: Batch, cifar: bool, paths: list[Path], progress: Any
                    ) -> list[dict[str, Any]]:
    """Figure 3's bars from trained checkpoints, narrowest first, each on the images at its own size."""
    from mixlabels.analysis import analyse

    bars = []
    for path in paths:
        progress.set_postfix_str(f"RMSE, {path.name}")
        model, arch = checkpoint_model(args.model, path, {}, 1.0)
        side = (int(arch["img_size"]),) * 2
        resized = make_batch(F.interpolate(batch.raw, size=side, mode="bilinear", antialias=True), batch.labels,
                             batch.classes, cifar)
        label_map = cutmix_map(resized, int(arch["num_classes"]), int(arch["patch_size"]), args.seed)
        result = analyse(model, resized.images, label_map, similarity=False)
        label = f"trained d={arch['embed_dim']}\nh={arch['num_heads']}, depth {arch['depth']}"
        bars.append({"label": label, "kind": "size", "rmse": float(result.rmse), "checkpoint": str(path)} | arch)
        progress.update()
    return sorted(bars, key=lambda b: int(b["embed_dim"]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import matplotlib
    from tqdm import tqdm

    matplotlib.use("Agg")
    from mixlabels.analysis import analyse

    start = time.perf_counter()
    job = provenance()
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = [Path(c) for c in (args.size_checkpoints or "").split(",") if c]
    sizes = [] if checkpoints else [s for s in args.sizes.split(",") if s]
    absent = [str(c) for c in checkpoints if not c.is_file()]
    if absent:
        raise SystemExit(f"no checkpoint at {', '.join(absent)} (--size-checkpoints)")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown --sizes {unknown}; choose from {', '.join(SIZES)}")
    progress = tqdm(total=2 + len(sizes) + len(checkpoints), desc="analysis", unit="step", disable=None)

    model, arch, init = analysed_model(args)
    m: Any = model
    patch, img = int(m.patch_embed.patch_size[0]), int(arch["img_size"])
    archive = resolve_data(args.data)
    progress.set_postfix_str("reading images")
    cifar = "cifar" in archive.name.lower()
    batch = make_batch(*read_images(archive, args.split, args.batch_size, img), cifar)
    progress.update()

    progress.set_postfix_str("analysing the model")
    label_map = cutmix_map(batch, int(m.num_classes) or 10, patch, args.seed)
    result = analyse(model, batch.images, label_map)
    curves = layer_numbers(result, sample=0)
    progress.update()

    desc = f"{args.model} (d={m.embed_dim}, depth={len(m.blocks)}, heads={m.blocks[0].attn.num_heads}), {img}px/{patch}"
    title = f"TL-Align label maps, {desc}, {init}, {archive.name}"
    plot_label_maps(out / "label_maps.png", batch, label_map, result, args.pairs, title)
    plot_mixing_ratio(out / "mixing_ratio.png", curves, f"Mixing ratio per block (sample 0), {desc}, {init}")

    bars = checkpoint_bars(args, batch, cifar, checkpoints, progress) if checkpoints else []
    bars += size_bars(args, batch, cifar, sizes, progress) if sizes else []
    label = f"analysed model\n{img}px" + (" (ckpt)" if args.checkpoint else "")
    bars.append({"label": label, "kind": "main", "rmse": float(result.rmse)})
    if checkpoints:
        dirs = [Path(b["checkpoint"]).parent.parent.name for b in bars if "checkpoint" in b]  # narrowest first
        blue = f"trained checkpoints ({', '.join(dict.fromkeys(dirs))})"
    else:
        size_init = "RANDOM INIT" + (f", logits x{args.sharpen:g}" if args.sharpen != 1.0 else "")
        blue = f"{size_init}, depth {args.size_depth}, {args.size_img}px/{args.size_patch}"
    plot_rmse(
        out / "rmse_by_size.png",
        bars,
        f"RMSE of CutMix vs TL-Align targets by model size\nblue: {blue}\nred: the analysed model, {init}",
    )
    progress.close()

    numbers = {
        "config": vars(args),
        "archive": str(archive),
        "model": arch | {"name": args.model},
        "initialisation": init,
        "grid": list(result.mixed.grid),
        "classes": [batch.classes[int(i)] for i in batch.labels],
        "lambda_cutmix": result.cutmix_target[:, 0].tolist(),
        "lambda_tl_align": result.tl_align_target[:, 0].tolist(),
        "lambda_transmix": None if result.transmix_target is None else result.transmix_target[:, 0].tolist(),
        "rmse": float(result.rmse),
        "per_block_sample0": curves,
        "rmse_by_size": [b | {"label": b["label"].replace("\n", " ")} for b in bars],
        "pictures": {name: str(out / f"{name}.png") for name in ("label_maps", "mixing_ratio", "rmse_by_size")},
        "seconds": time.perf_counter() - start,
        "provenance": finish(job),
    }
    (out / "analysis.json").write_text(json.dumps(numbers, indent=2))
    summary = ", ".join(f"{b['label'].splitlines()[0]} {b['rmse']:.4f}" for b in bars)
    print(f"wrote {out}/label_maps.png, mixing_ratio.png, rmse_by_size.png, analysis.json in {numbers['seconds']:.1f}s")
    print(f"RMSE CutMix vs TL-Align: {numbers['rmse']:.4f}; by size: {summary}")
    return numbers


if __name__ == "__main__":
    main()
