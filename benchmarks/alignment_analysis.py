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

    python benchmarks/alignment_analysis.py                                   # Imagenette, random-init DeiT-S-like
    python benchmarks/alignment_analysis.py --sharpen 30 --out runs/analysis-sharpened
    python benchmarks/alignment_analysis.py --data cifar10 --img-size 32 --patch-size 4
    python benchmarks/alignment_analysis.py --checkpoint runs/ablation/model.pt --model deit_tiny_patch16_224 \\
        --data cifar10 --num-heads 2                               # a state dict from training

A checkpoint written by ``benchmarks/ablation.py --save-checkpoints``
(``<out>/checkpoints/<run key>.pth``) is read with its run file
(``<out>/runs/<run key>.json``), which gives the head count a state dict cannot tell.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from benchmarks._alignment_data import Batch, make_batch, read_images, resolve_data
from benchmarks._alignment_models import build_model, checkpoint_model
from benchmarks._alignment_plots import SCHEMES, plot_label_maps, plot_mixing_ratio, plot_rmse
from benchmarks._provenance import finish, provenance

# DeiT's three sizes (embed dim, heads); depth 12 unless --size-depth says otherwise.
SIZES: dict[str, tuple[int, int]] = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12)}


# ---------------------------------------------------------------------- analysis
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
