"""The catalogue of bad and edge inputs: every public entry point, every common mistake once.

Each bad input must raise an error of the right type whose message names the problem
(the ``match`` words); each edge input must give the right result, compared with a
reference. Tiny sizes throughout: the whole module runs in seconds.
"""

from __future__ import annotations

import copy

import dataclasses
import functools
import json
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import timm
import torch
from pydantic import TypeAdapter
from torch import Tensor, nn
from torch.testing import assert_close

from mixlabels import (
    BoxMask,
    CellMask,
    MixPro,
    NoAlign,
    TLAlign,
    TLAlignConfig,
    TokenLabeling,
    TokenLabelMap,
    TransMix,
    check_labels,
    soft_target_cross_entropy,
    token_soft_target_cross_entropy,
)
from mixlabels.backbones import AdaptedViT, adapt
from mixlabels.score_maps import (
    ScoreMapDataset,
    ScoreMapError,
    ScoreMaps,
    ScoreMapWriter,
    compress,
    sample_resized_crops,
    to_dense,
)
from mixlabels.strategies import (
    BlockwiseMix,
    CutMix,
    CutMixConfig,
    ElemSwitch,
    MixerConfig,
    MixToken,
    MixUp,
    RandomPatchMix,
    ResizeMix,
    SaliencyMix,
    Switch,
    mix_images,
    timm_collate_mixup,
    timm_mixup,
)

C = 5  # classes
X = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
Y = torch.tensor([0, 1, 2, 4])
FLIP = torch.tensor([3, 2, 1, 0])  # partners under timm's flip pairing
G = torch.Generator  # a fresh seeded generator per call keeps cases independent


def gen(seed: int = 0) -> torch.Generator:
    return G().manual_seed(seed)


@functools.cache
def vit() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16,
                             depth=2, num_heads=2, num_classes=C)


@functools.cache
def _vit24() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=24, patch_size=4, embed_dim=16,
                             depth=1, num_heads=2, num_classes=C)


def _eva_avg() -> nn.Module:
    from timm.models.eva import Eva

    return Eva(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=C, global_pool="avg")


def _beit_avg() -> nn.Module:
    from timm.models.beit import Beit

    return Beit(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=C, global_pool="avg")


def _reference_at(name: str, size: int) -> object:
    """The float64 reference of a timm model at its default size, on the meta device: refused before allocating."""
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    lm = TokenLabelMap.unmixed(torch.tensor([0, 1]), 1000, (size, size)).to("meta")
    return adapt(model, TLAlign(), reference=True)(torch.empty(2, 3, size, size, device="meta"), lm)


def cutmix_map(images: Tensor = X) -> TokenLabelMap:
    return CutMix(C, patch_size=4, generator=gen())(images, Y[: images.shape[0]])[1]


def hand_map(w0: float | Tensor, w1: float | Tensor) -> TokenLabelMap:
    """A map built by hand (not by a mixer): source weights ``w0`` and ``w1`` in every 4x4 cell, flip partners."""
    cells = torch.stack([torch.full((4, 4, 4), 1.0) * w0, torch.full((4, 4, 4), 1.0) * w1], dim=1)
    lam = cells.mean(dim=(2, 3))
    return TokenLabelMap(sources=torch.stack([torch.arange(4), FLIP], dim=1), mask=CellMask(cells), image_weights=lam,
                         labels=Y, num_classes=C, image_size=(16, 16))


def soft(rows: list[list[float]]) -> Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ store helpers
def _store(root: Path, n: int = 3) -> Path:
    maps = torch.softmax(torch.randn(n, 2, 2, C, generator=gen()), -1)
    with ScoreMapWriter(root, num_classes=C, map_size=(2, 2), k=2, shard_size=8) as w:
        w.append([f"img{i}" for i in range(n)], compress(maps, k=2))
    return root


def _zero_shard_data(root: Path) -> Path:
    """Zero a shard's data bytes, keeping its size (and its .npy header)."""
    path = root / "shard-00000.npy"
    nbytes = np.load(path).nbytes
    raw = bytearray(path.read_bytes())
    raw[len(raw) - nbytes :] = bytes(nbytes)
    path.write_bytes(bytes(raw))
    return path


def _bad_ids_shard(root: Path) -> Path:
    """Write class id -1 into a shard and record its new checksum: the index agrees, the content is wrong."""
    from mixlabels.score_maps._store import _sha256

    path = root / "shard-00000.npy"
    arr = np.load(path)
    arr[0, 1, 0, 0, 0] = np.array([-1], dtype=np.int16).view(np.uint16)[0]
    np.save(path, arr, allow_pickle=False)
    index = json.loads((root / "index.json").read_text())
    index["shards"][0]["sha256"] = _sha256(path)
    index["shards"][0]["bytes"] = path.stat().st_size
    (root / "index.json").write_text(json.dumps(index))
    return path


def _read_store_via_dataset(root: Path) -> object:
    data = [(torch.rand(3, 8, 8), 0) for _ in range(3)]
    return ScoreMapDataset(data, ScoreMaps(root), size=(8, 8), grid=(2, 2))[0]


# ------------------------------------------------------------------------------------------ bad inputs
Bad = tuple[str, Callable[[Path], object], type[BaseException], str]


def _bad() -> list[Bad]:
    m4: Callable[[], MixUp] = lambda: MixUp(C, generator=gen())  # noqa: E731
    cut = CutMix(C, generator=gen())
    p8 = cut.sample((8, 3, 16, 16), generator=gen())
    p16 = cut.sample((4, 3, 16, 16), generator=gen())
    big = torch.rand(4, 3, 32, 32)
    cases: list[Bad] = [
        # ---- mixer construction
        ("num_classes 0", lambda _: CutMix(0), ValueError, r"num_classes must be >= 1, got 0"),
        ("num_classes float", lambda _: MixUp(2.5), ValueError, r"num_classes must be >= 1, got 2.5.*integer"),  # type: ignore[arg-type]
        ("num_classes bool", lambda _: MixUp(True), ValueError, r"num_classes .*got True"),
        ("alpha nan", lambda _: MixUp(C, alpha=float("nan")), ValueError, r"alpha must be a finite number > 0"),
        ("alpha 0", lambda _: CutMix(C, alpha=0.0), ValueError, r"alpha must be a finite number > 0"),
        ("alpha inf", lambda _: MixUp(C, alpha=float("inf")), ValueError, r"alpha must be a finite"),
        ("alpha negative", lambda _: RandomPatchMix(C, alpha=-1.0), ValueError, r"alpha must be a finite number > 0"),
        ("prob negative", lambda _: MixUp(C, prob=-0.1), ValueError, r"prob must lie in \[0, 1\]"),
        ("prob > 1", lambda _: CutMix(C, prob=1.5), ValueError, r"prob must lie in \[0, 1\]"),
        ("prob nan", lambda _: MixUp(C, prob=float("nan")), ValueError, r"prob must lie in \[0, 1\]"),
        ("label_smoothing 1", lambda _: MixUp(C, label_smoothing=1.0), ValueError, r"label_smoothing must lie in \[0, 1\)"),
        ("label_smoothing nan", lambda _: CutMix(C, label_smoothing=float("nan")), ValueError, r"label_smoothing"),
        ("mode typo", lambda _: MixUp(C, mode="batches"), ValueError, r"mode must be one of"),  # type: ignore[arg-type]
        ("pairing typo", lambda _: CutMix(C, pairing="random"), ValueError, r"pairing must be one of"),  # type: ignore[arg-type]
        ("minmax reversed", lambda _: CutMix(C, minmax=(0.8, 0.2)), ValueError, r"minmax must satisfy 0 <= min < max <= 1"),
        ("minmax three", lambda _: CutMix(C, minmax=(0.1, 0.2, 0.3)), ValueError, r"minmax must be a pair"),  # type: ignore[arg-type]
        ("minmax above 1", lambda _: CutMix(C, minmax=(0.5, 1.5)), ValueError, r"minmax must satisfy"),
        ("patch_size 0", lambda _: CutMix(C, patch_size=0), ValueError, r"patch_size must be a positive number"),
        ("cell_size 0", lambda _: RandomPatchMix(C, cell_size=0), ValueError, r"cell_size must be a positive number"),
        ("ratio 2", lambda _: RandomPatchMix(C, ratio=2.0), ValueError, r"ratio must lie in \[0, 1\]"),
        ("ratio nan", lambda _: BlockwiseMix(C, ratio=float("nan")), ValueError, r"ratio must lie in \[0, 1\]"),
        ("min_aspect 0", lambda _: BlockwiseMix(C, min_aspect=0.0), ValueError, r"aspect ratios must satisfy"),
        ("min_cells 0", lambda _: BlockwiseMix(C, min_cells=0), ValueError, r"min_cells and max_cells must be >= 1"),
        ("ElemSwitch switch_prob 1.5", lambda _: ElemSwitch(C, switch_prob=1.5), ValueError, r"switch_prob must lie in \[0, 1\].*got 1.5"),
        ("timm_mixup switch_prob 1.5", lambda _: timm_mixup(0.8, 1.0, switch_prob=1.5, num_classes=C), ValueError, r"switch_prob must lie in \[0, 1\].*got 1.5"),
        ("timm_mixup switch_prob -0.2 elem", lambda _: timm_mixup(0.8, 1.0, switch_prob=-0.2, mode="elem", num_classes=C), ValueError, r"switch_prob must lie in \[0, 1\].*got -0.2"),
        ("generator int", lambda _: CutMix(C, generator=0), TypeError, r"generator must be a torch.Generator, got the int 0.*manual_seed\(0\)"),  # type: ignore[arg-type]
        ("generator str", lambda _: MixUp(C, generator="cpu"), TypeError, r"generator must be a torch.Generator or None, got str"),  # type: ignore[arg-type]
        # ---- mixer calls: images
        ("generator int per call", lambda _: CutMix(C)(X, Y, generator=0), TypeError, r"generator must be a torch.Generator.*once, at construction"),  # type: ignore[arg-type]
        ("generator int to sample", lambda _: MixUp(C).sample(X.shape, generator=1), TypeError, r"manual_seed\(1\)"),  # type: ignore[arg-type]
        ("images uint8", lambda _: m4()((X * 255).byte(), Y), ValueError, r"images must be floating point.*float\(\) / 255"),
        ("images 3-d", lambda _: m4()(X[0], Y), ValueError, r"\(batch, channels, height, width\).*unsqueeze\(0\)"),
        ("images list", lambda _: m4()([X], Y), ValueError, r"images must be a \(batch, channels, height, width\) tensor, got list"),  # type: ignore[call-overload]
        ("images on meta", lambda _: CutMix(C)(X.to("meta"), Y), ValueError, r"meta device.*pass the real batch"),
        ("image not divisible by patch_size", lambda _: CutMix(C, patch_size=5)(X, Y), ValueError, r"patch_size=5 does not divide the image size 16x16"),
        ("image not divisible by cell_size", lambda _: RandomPatchMix(C, cell_size=6)(X, Y), ValueError, r"cell_size=6 does not divide"),
        ("MixToken patch not dividing", lambda _: MixToken(C, patch_size=3)(X, Y), ValueError, r"patch_size=3 does not divide"),
        ("ResizeMix scale rounding every box to 0 px", lambda _: ResizeMix(C, scale=(0.01, 0.06))(X, Y), ValueError, r"scale=\(0.01, 0.06\) gives only empty boxes on 16x16 images.*nothing would be mixed; raise scale's max above 1/16"),
        ("ResizeMix scale rounding every box to 0 cells", lambda _: ResizeMix(C, scale=(0.2, 0.5), patch_size=8)(X, Y), ValueError, r"only empty boxes.*2x2 grid of cells.*smaller patch_size"),
        ("blockwise min_cells cannot fit", lambda _: BlockwiseMix(C, cell_size=4, min_cells=10)(X, Y), ValueError, r"min_cells=10 cannot fit on the 4x4 cell grid.*at most 9 cells"),
        ("blockwise one-row grid", lambda _: BlockwiseMix(C, cell_size=4, min_cells=1)(torch.rand(2, 3, 4, 16), Y[:2]), ValueError, r"strictly smaller than the grid"),
        # ---- mixer calls: labels
        ("labels list", lambda _: m4()(X, [0, 1, 2, 3]), ValueError, r"labels must be a tensor"),  # type: ignore[call-overload]
        ("labels batch 3 for 4 images", lambda _: m4()(X, Y[:3]), ValueError, r"labels have batch size 3 but the images have 4"),
        ("labels scalar", lambda _: m4()(X, torch.tensor(1)), ValueError, r"batch size none \(a scalar\)"),
        ("labels (b, 1) ids", lambda _: m4()(X, Y[:, None]), ValueError, r"integer labels must have shape \(batch,\)"),
        ("labels one-hot long", lambda _: m4()(X, torch.eye(C, dtype=torch.long)[Y]), ValueError, r"labels.float\(\).*argmax"),
        ("labels bool", lambda _: m4()(X, Y > 1), ValueError, r"dtype torch.bool"),
        ("labels float 1-d", lambda _: m4()(X, Y.float()), ValueError, r"soft labels must have shape \(batch, num_classes=5\)"),
        ("soft labels wrong classes", lambda _: m4()(X, torch.full((4, 3), 1 / 3)), ValueError, r"num_classes=5\), got \(4, 3\)"),
        ("soft labels not summing to 1", lambda _: m4()(X, torch.full((4, C), 0.3)), ValueError, r"rows must sum to 1"),
        ("soft labels negative", lambda _: m4()(X, torch.tensor([[1.5, -0.5, 0, 0, 0]] * 4)), ValueError, r"NaN, inf or negative"),
        ("soft labels NaN", lambda _: m4()(X, torch.full((4, C), float("nan"))), ValueError, r"NaN, inf or negative"),
        ("label id negative", lambda _: CutMix(C)(X, torch.tensor([0, -1, 2, 3])), ValueError, r"labels out of range.*\[-1, 3\].*\[0, 4\]"),
        ("label id == num_classes", lambda _: m4()(X, torch.tensor([0, 1, 2, 5])), ValueError, r"labels out of range.*num_classes=5"),
        # ---- replay
        ("mix: params for 8 on 4", lambda _: cut.mix(X, Y, p8), ValueError, r"params were drawn for 8 images.*got 4 images"),
        ("mix: params for 16px on 32px", lambda _: cut.mix(big, Y, p16), ValueError, r"size \(16, 16\) but got 4 images of size \(32, 32\)"),
        ("call: params for 16px on 32px", lambda _: cut(big, Y, params=p16), ValueError, r"params were drawn for 4 images of size \(16, 16\)"),
        ("params of another mixer", lambda _: cut.mix(X, Y, MixUp(C).sample(X.shape)), TypeError, r"CutMix mixes with BoxParams, got MixUpParams"),
        ("kornia params without the key", lambda _: cut(X, Y, params={}), ValueError, r"must hold the sampled params under 'mix_params'"),
        ("label_map before any call", lambda _: MixUp(C).label_map(Y), ValueError, r"has not mixed a batch yet"),
        ("sample a 3-d shape", lambda _: MixUp(C).sample((4, 16, 16)), ValueError, r"batch_shape must be \(batch, channels, height, width\)"),
        ("data_keys wrong", lambda _: m4()(X, Y, data_keys=["input", "mask"]), ValueError, r"accepts data_keys"),
        ("labels with data_keys input", lambda _: m4()(X, Y, data_keys=["input"]), ValueError, r"drop the labels or add 'class'"),
        # ---- Switch
        ("Switch of nothing", lambda _: Switch([]), ValueError, r"at least one mixer"),
        ("Switch of a string", lambda _: Switch([MixUp(C), "cutmix"]), TypeError, r"Switch takes mixers.*\['str'\]"),  # type: ignore[list-item]
        ("Switch num_classes differ", lambda _: Switch([MixUp(C), CutMix(3)]), ValueError, r"same num_classes, got \[3, 5\]"),
        ("Switch probs negative", lambda _: Switch([MixUp(C), CutMix(C)], probs=[1, -1]), ValueError, r"non-negative number per mixer"),
        ("Switch probs nan", lambda _: Switch([MixUp(C), CutMix(C)], probs=[float("nan"), 1]), ValueError, r"non-negative number per mixer"),
        ("Switch probs inf", lambda _: Switch([MixUp(C), CutMix(C)], probs=[float("inf"), 1]), ValueError, r"non-negative number per mixer"),
        ("Switch probs count", lambda _: Switch([MixUp(C), CutMix(C)], probs=[1.0]), ValueError, r"one non-negative number per mixer \(2\)"),
        ("Switch params of a child", lambda _: Switch([MixUp(C), CutMix(C)]).mix(X, Y, MixUp(C).sample(X.shape)), TypeError, r"Switch mixes with SwitchParams"),
        # ---- collate-time mixing
        ("collate channels-last uint8 (PIL to numpy)", lambda _: timm_collate_mixup(0.8, 1.0, num_classes=C, seed=0)([(np.zeros((16, 16, 3), np.uint8), 0)] * 4), ValueError, r"channels-last \(16, 16, 3\) uint8 image.*ToNumpy\(\).*np.transpose\(x, \(2, 0, 1\)\)"),
        # ---- mixer configs
        ("config extra field", lambda _: CutMixConfig(num_classes=C, alhpa=1.0), pydantic.ValidationError, r"alhpa"),  # type: ignore[call-arg]
        ("config unknown kind", lambda _: TypeAdapter(MixerConfig).validate_python({"kind": "cutmixx", "num_classes": C}), pydantic.ValidationError, r"cutmixx"),
        ("config alpha nan", lambda _: CutMixConfig(num_classes=C, alpha=float("nan")), pydantic.ValidationError, r"alpha"),
        # ---- TokenLabelMap
        ("unmixed labels list", lambda _: TokenLabelMap.unmixed([0, 1], C, (16, 16)), ValueError, r"labels must be a tensor"),  # type: ignore[arg-type]
        ("unmixed num_classes float", lambda _: TokenLabelMap.unmixed(Y, 5.0, (16, 16)), ValueError, r"num_classes must be >= 1, got 5.0"),  # type: ignore[arg-type]
        ("unmixed image_size int", lambda _: TokenLabelMap.unmixed(Y, C, 16), ValueError, r"image_size must be \(height, width\)"),  # type: ignore[arg-type]
        ("unmixed image_size zero", lambda _: TokenLabelMap.unmixed(Y, C, (0, 16)), ValueError, r"two positive integers, got \(0, 16\)"),
        ("unmixed label out of range", lambda _: TokenLabelMap.unmixed(torch.tensor([0, 7]), C, (16, 16)), ValueError, r"labels out of range"),
        ("from_mask int mask", lambda _: TokenLabelMap.from_mask(torch.ones(4, 4, 4, dtype=torch.long), FLIP, Y, C), ValueError, r"mask must be float"),
        ("from_mask weight 2", lambda _: TokenLabelMap.from_mask(torch.full((4, 4, 4), 2.0), FLIP, Y, C), ValueError, r"must lie in \[0, 1\]"),
        ("from_mask NaN", lambda _: TokenLabelMap.from_mask(torch.full((4, 4, 4), float("nan")), FLIP, Y, C), ValueError, r"mask contains NaN"),
        ("from_mask partner out of range", lambda _: TokenLabelMap.from_mask(torch.ones(4, 4, 4), Y + 4, Y, C), ValueError, r"partner indices must lie in \[0, 3\]"),
        ("from_mask labels batch", lambda _: TokenLabelMap.from_mask(torch.ones(4, 4, 4), FLIP, Y[:2], C), ValueError, r"labels have batch size 2 but the mask has 4"),
        ("from_mask cells not tiling", lambda _: TokenLabelMap.from_mask(torch.ones(4, 4, 4), FLIP, Y, C, image_size=(30, 30)), ValueError, r"must tile the image"),
        ("from_boxes float boxes", lambda _: TokenLabelMap.from_boxes(torch.zeros(4, 4), (4, 4), FLIP, Y, C), ValueError, r"boxes must be a \(batch, 4\) long tensor"),
        ("token grid not dividing", lambda _: cutmix_map().token_weights((5, 5)), ValueError, r"token grid 5x5 does not divide the image 16x16"),
        ("mix_pixels wrong size", lambda _: cutmix_map().mix_pixels(big), ValueError, r"images must have shape \(batch=4, channels, 16, 16\)"),
        ("targets wrong k", lambda _: cutmix_map().targets(torch.ones(4, 3)), ValueError, r"weights must have shape \(batch=4, \.\.\., k=2\)"),
        ("BoxMask fractional corners", lambda _: BoxMask(torch.tensor([[0.5, 2.5, 0.0, 3.0]]), (4, 4)), ValueError, r"corners must be whole cells \(an integer tensor\), got torch.float32.*half a cell.*boxes.round\(\).long\(\)"),
        ("label map to a dtype", lambda _: cutmix_map().to(torch.float16), TypeError, r"TokenLabelMap.to\(\) takes a device, got the dtype torch.float16.*stay float32"),
        ("token targets as logits", lambda _: cutmix_map().with_token_targets(torch.randn(4, 2, 2, C, generator=gen())), ValueError, r"token_targets must be class probabilities per cell, found negative values.*logits.*softmax"),
        ("token targets unnormalised scores", lambda _: cutmix_map().with_token_targets(3 * torch.rand(4, 2, 2, C, generator=gen())), ValueError, r"found cells summing to more than 1.*softmax"),
        ("sources int32", lambda _: TokenLabelMap(sources=torch.zeros(4, 1, dtype=torch.int32), mask=torch.ones(4, 1, 1, 1), image_weights=torch.ones(4, 1), labels=Y, num_classes=C, image_size=(16, 16)), ValueError, r"sources must be a \(batch, k\) long tensor"),
        ("check_labels 1-d floats", lambda _: check_labels(torch.tensor([0.5, 0.5]), C), ValueError, r"soft labels must have shape \(batch, num_classes=5\)"),
        # ---- schemes and their configs
        ("TLAlign fractional layers", lambda _: TLAlign(layers=[0.5, 1.5]), TypeError, r"distinct integer layer indices.*0.5 is not an integer"),  # type: ignore[list-item]
        ("TLAlign duplicate layers", lambda _: TLAlign(layers=[1, 1]), ValueError, r"repeats a layer"),
        ("TLAlign layers int", lambda _: TLAlign(layers=1), TypeError, r"e.g. layers=\(1, 3, 5, 7\)"),  # type: ignore[arg-type]
        ("TLAlign layers string", lambda _: TLAlign(layers="1"), TypeError, r"distinct integer layer indices"),  # type: ignore[arg-type]
        ("TLAlign no layers", lambda _: TLAlign(layers=[]), ValueError, r"got no layers \(NoAlign\(\) aligns none\)"),
        ("TLAlign normalize string", lambda _: TLAlign(normalize="no"), TypeError, r"normalize must be True or False"),  # type: ignore[arg-type]
        ("TLAlign layer out of range", lambda _: adapt(vit(), TLAlign(layers=[5]))(X, cutmix_map()), ValueError, r"layers \[5\] out of range for a model with 2 layers"),
        ("TLAlign same layer twice", lambda _: adapt(vit(), TLAlign(layers=[1, -1]))(X, cutmix_map()), ValueError, r"name the same layer twice"),
        ("TLAlignConfig fractional", lambda _: TLAlignConfig(layers=(0.5,)), pydantic.ValidationError, r"fractional part"),  # type: ignore[arg-type]
        ("TokenLabeling beta nan", lambda _: TokenLabeling(beta=float("nan")), ValueError, r"beta must be a finite number >= 0"),
        ("TokenLabeling beta negative", lambda _: TokenLabeling(beta=-1.0), ValueError, r"beta must be a finite number >= 0"),
        ("token targets not (b, h, w, c)", lambda _: cutmix_map().with_token_targets(torch.rand(X.shape[0], 16, C)), ValueError, r"token_targets must be float \(batch=\d+, h, w, num_classes=\d+\)"),
        ("token targets too coarse", lambda _: cutmix_map().with_token_targets(torch.rand(X.shape[0], 3, 3, C).softmax(-1)).mixed_token_targets((2, 2)), ValueError, r"cannot serve a 2x2 token grid"),
        ("no token targets to mix", lambda _: cutmix_map().mixed_token_targets((2, 2)), ValueError, r"with_token_targets\(maps\)"),
        ("progress out of range", lambda _: cutmix_map().with_progress(1.5), ValueError, r"progress must lie in \[0, 1\]"),
        ("MixPro without progress", lambda _: adapt(vit(), MixPro())(X, cutmix_map()), ValueError, r"with_progress\(step / total_steps\)"),
        ("MixPro weight out of range", lambda _: MixPro(final=-0.1), ValueError, r"area weights in \[0, 1\]"),
        # ---- losses
        ("loss shapes differ", lambda _: soft_target_cross_entropy(torch.randn(4, C), torch.rand(4, 3)), ValueError, r"must both have shape \(b, c\)"),
        ("loss with class ids", lambda _: soft_target_cross_entropy(torch.randn(4, C), Y), ValueError, r"must be floating point.*one_hot"),
        ("loss integer logits", lambda _: soft_target_cross_entropy(torch.ones(4, C, dtype=torch.long), torch.rand(4, C)), ValueError, r"floating point, got torch.int64"),
        ("loss devices differ", lambda _: soft_target_cross_entropy(torch.randn(4, C), torch.rand(4, C, device="meta")), ValueError, r"target.to\(logits.device\)"),
        ("loss target needs grad", lambda _: soft_target_cross_entropy(torch.randn(4, C), torch.rand(4, C, requires_grad=True)), ValueError, r"target.detach\(\)"),
        ("token loss 2-d", lambda _: token_soft_target_cross_entropy(torch.randn(4, C), torch.rand(4, C)), ValueError, r"\(b, n, c\)"),
        # ---- adapt and adapted models
        ("adapt an adapted model", lambda _: adapt(adapt(vit(), TLAlign()), NoAlign()), TypeError, r"already adapted.*adapted.model"),
        ("adapt with a scheme class", lambda _: adapt(vit(), TLAlign), TypeError, r"got the class TLAlign: pass TLAlign\(\)"),  # type: ignore[arg-type]
        ("adapt with a scheme config", lambda _: adapt(vit(), TLAlignConfig()), TypeError, r"config.build\(\)"),  # type: ignore[arg-type]
        ("adapt with a string", lambda _: adapt(vit(), "tl_align"), TypeError, r"must be a mixlabels scheme"),  # type: ignore[arg-type]
        ("adapter class with a scheme class", lambda _: AdaptedViT(vit(), TransMix), TypeError, r"pass TransMix\(\)"),  # type: ignore[arg-type]
        ("adapt a compiled model", lambda _: adapt(torch.compile(vit()), TLAlign()), TypeError, r"torch.compile'd.*_orig_mod"),  # type: ignore[arg-type]
        ("adapt DataParallel", lambda _: adapt(nn.DataParallel(vit()), TLAlign()), TypeError, r"DataParallel wrapper.*dp.module"),
        ("adapt a ByobNet with dark blocks", lambda _: adapt(timm.create_model("test_byobnet", num_classes=C), TLAlign()), TypeError, r"(?s)cannot adapt ByobNet.*Supported families"),
        ("adapt a function", lambda _: adapt(print, TLAlign()), TypeError, r"takes a torch.nn.Module"),  # type: ignore[arg-type]
        ("aligned with class ids", lambda _: adapt(vit(), TLAlign())(X, Y), TypeError, r"TokenLabelMap.*TokenLabelMap.unmixed"),
        ("aligned map of other size", lambda _: adapt(vit(), TLAlign())(X, cutmix_map(big)), ValueError, r"made for 32x32 images but the images are 16x16"),
        ("aligned batch differs", lambda _: adapt(vit(), TLAlign())(X[:2], cutmix_map()), ValueError, r"batch size 2 but the label map has 4"),
        ("aligned num_classes differs", lambda _: adapt(vit(), NoAlign())(X, CutMix(3, generator=gen())(X, Y % 3)[1]).loss(), ValueError, r"outputs 5 classes but the label map has num_classes=3"),
        ("TransMix on a pooled ViT", lambda _: adapt(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=C, class_token=False, global_pool="avg"), TransMix())(X, cutmix_map()), ValueError, r"no class token.*TLAlign\(\) or NoAlign\(\)"),
        ("hand-built map summing to 1.4", lambda _: adapt(vit(), TLAlign())(X, hand_map(0.7, 0.7)), ValueError, r"label map passed to AdaptedViT is invalid: mask weights must sum to 1 over the sources"),
        ("hand-built map with negative weights", lambda _: adapt(vit(), NoAlign())(X, hand_map(1.5, -0.5)), ValueError, r"label map passed to AdaptedViT is invalid: mask and image weights must lie in \[0, 1\]"),
        ("hand-built map into any classifier", lambda _: adapt(nn.Sequential(nn.Flatten(), nn.Linear(768, C)), NoAlign())(X, hand_map(0.7, 0.7)), ValueError, r"passed to AdaptedClassifier is invalid: mask weights must sum to 1"),
        ("hand-built map with logits as token targets", lambda _: adapt(vit(), TokenLabeling())(X, dataclasses.replace(hand_map(0.5, 0.5), token_targets=torch.randn(4, 2, 2, C))), ValueError, r"invalid: token_targets must be class probabilities.*softmax"),
        ("TransMix on an EVA that pools by average", lambda _: adapt(_eva_avg(), TransMix())(X, cutmix_map()), ValueError, r"TransMix reads the attention of the class token that the head reads.*pools the tokens.*global_pool='token'"),
        ("TransMix on a BEiT that pools by average (reference)", lambda _: adapt(_beit_avg(), TransMix(), reference=True)(X, cutmix_map()), ValueError, r"class token that the head reads.*global_pool='token'"),
        ("MixPro on a ViT with a class token, pooled by average", lambda _: adapt(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=C, global_pool="avg"), MixPro())(X, cutmix_map().with_progress(0.5)), ValueError, r"MixPro reads the attention of the class token.*global_pool='token'"),
        ("reference of resnet18 at its default size", lambda _: _reference_at("resnet18", 224), ValueError, r"dense reference path would build 38.3 GiB float64 matrices.*use the fast path \(reference=False\), or the reference on smaller images"),
        ("reference of crossvit_tiny_240 at its default size", lambda _: _reference_at("crossvit_tiny_240", 240), ValueError, r"would build 50.3 GiB.*use the fast path"),
        ("aligned uint8 images", lambda _: adapt(vit(), TLAlign())((X * 255).byte(), cutmix_map()), ValueError, r"images must be floating point, got torch.uint8"),
        ("aligned map on another device", lambda _: adapt(vit(), TLAlign())(X, cutmix_map().to("meta")), ValueError, r"label map on meta.*label_map.to\(images.device\)"),
        ("token-space map not lining up with patches", lambda _: adapt(_vit24(), NoAlign())(torch.rand(2, 3, 24, 24), TokenLabelMap.from_mask(torch.ones(2, 4, 4), torch.tensor([1, 0]), Y[:2], C, image_size=(24, 24), token_space=True)), ValueError, r"4x4 cells, which do not line up with the model's 6x6 patches.*patch_size=4"),
        ("mix_images weight not dividing", lambda _: mix_images(X, FLIP, torch.ones(4, 5, 5)), ValueError, r"mh dividing H.*weight \(4, 5, 5\)"),
        ("mix_images partner batch", lambda _: mix_images(X, FLIP[:2], torch.ones(4, 1, 1)), ValueError, r"partner \(2,\)"),
        # ---- score maps
        ("dataset size int", lambda p: ScoreMapDataset([(torch.rand(3, 8, 8), 0)] * 3, ScoreMaps(_store(p / "s")), size=8, grid=(2, 2)), ValueError, r"size must be \(height, width\), two positive integers, got 8"),  # type: ignore[arg-type]
        ("dataset store a path", lambda p: ScoreMapDataset([(torch.rand(3, 8, 8), 0)], str(p), size=(8, 8), grid=(2, 2)), TypeError, r"store must be a ScoreMaps"),  # type: ignore[arg-type]
        ("crops scale reversed", lambda _: sample_resized_crops((16, 16), 2, scale=(0.9, 0.1)), ValueError, r"scale must be \(min, max\) area fractions with 0 < min <= max <= 1"),
        ("crops ratio zero", lambda _: sample_resized_crops((16, 16), 2, ratio=(0.0, 1.0)), ValueError, r"ratio must be \(min, max\) aspect ratios"),
        ("crops hflip 2", lambda _: sample_resized_crops((16, 16), 2, hflip=2.0), ValueError, r"hflip must be a probability in \[0, 1\], got 2.0"),
        ("writer duplicate ids", lambda p: ScoreMapWriter(p / "s", num_classes=C, map_size=(2, 2), k=2).append(["a", "a"], compress(torch.rand(2, 2, 2, C).softmax(-1), 2)), ValueError, r"image ids must be unique"),
        ("writer wrong map size", lambda p: ScoreMapWriter(p / "s", num_classes=C, map_size=(2, 2), k=2).append(["a"], compress(torch.rand(1, 3, 3, C).softmax(-1), 2)), ValueError, r"maps must be top-2 of 5 classes with shape \(1, 2, 2, 2\)"),
        ("writer invalid class ids", lambda p: ScoreMapWriter(p / "s", num_classes=3, map_size=(2, 2), k=2).append(["a"], compress(torch.rand(1, 2, 2, C).softmax(-1), 2).__class__(torch.rand(1, 2, 2, 2).half(), torch.full((1, 2, 2, 2), 4, dtype=torch.int16), 3)), ValueError, r"class ids in \[4, 4\] but num_classes=3"),
        ("writer NaN scores", lambda p: ScoreMapWriter(p / "s", num_classes=C, map_size=(2, 2), k=2).append(["a"], compress(torch.full((1, 2, 2, C), float("nan")), 2)), ValueError, r"NaN, inf or negative scores"),
        ("writer k > classes", lambda p: ScoreMapWriter(p / "s", num_classes=2, map_size=(2, 2), k=3), ValueError, r"1 <= k <= num_classes"),
        ("store zeroed shard", lambda p: ScoreMaps(_zero_and_root(p)).get([0]), ScoreMapError, r"shard-00000.npy is corrupted: its sha256 differs"),
        ("store zeroed shard via dataset", lambda p: _read_store_via_dataset(_zero_and_root(p)), ScoreMapError, r"shard-00000.npy is corrupted"),
        ("store invalid class ids", lambda p: ScoreMaps(_bad_ids_and_root(p))[0], ScoreMapError, r"shard-00000.npy holds invalid class ids \[-1\]"),
        ("store missing shard", lambda p: ScoreMaps(_missing_and_root(p)), ScoreMapError, r"shard-00000.npy is missing"),
        ("store truncated shard", lambda p: ScoreMaps(_truncated_and_root(p)), ScoreMapError, r"shard-00000.npy is truncated or corrupted"),
        ("store without index", lambda p: ScoreMaps(p), ScoreMapError, r"no score-map index at"),
        ("store index not JSON", lambda p: ScoreMaps(_broken_index_and_root(p)), ScoreMapError, r"corrupted score-map index .*index.json"),
        ("store position out of range", lambda p: ScoreMaps(_store(p / "s")).get([3]), IndexError, r"positions must lie in \[0, 3\)"),
        ("dataset of another size", lambda p: ScoreMapDataset([(torch.rand(3, 8, 8), 0)], ScoreMaps(_store(p / "s")), size=(8, 8), grid=(2, 2)), ScoreMapError, r"holds 3 maps but the dataset has 1 images"),
        ("compress k 0", lambda _: compress(torch.rand(2, 2, C), k=0), ValueError, r"k must lie in \[1, num_classes=5\]"),
        ("to_dense fill typo", lambda _: to_dense(torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.long), C, "renormalise"), ValueError, r"fill must be 'renormalize', 'spread' or 'zeros'"),  # type: ignore[arg-type]
        # ---- benchmark CLI and run files
        ("config file broken JSON", lambda p: _load_config(p, "broken.json", '{"table": 7,'), ValueError, r"broken.json is not valid JSON"),
        ("config file a list", lambda p: _load_config(p, "list.json", "[1, 2]"), ValueError, r"list.json must hold a mapping.*got list"),
        ("config file suffix", lambda p: _load_config(p, "cfg.toml", "table = 7"), ValueError, r"must end in .json, .yaml or .yml"),
        ("config file missing", lambda p: _load_config(p, None, ""), FileNotFoundError, r"no config file at"),
        ("ablation model resnet", lambda _: _model_config("resnet18").build(num_classes=C), ValueError, r"'resnet18' does not take the ablation's ViT arguments.*vit_\*, deit_\*"),
        ("ablation model unknown", lambda _: _model_config("deit_tinyy").build(num_classes=C), ValueError, r"unknown timm model 'deit_tinyy'"),
        ("annotate --model-kwargs not JSON", lambda _: _annotate(["--model-kwargs", "{img", "--data", "cifar10"]), SystemExit, r"--model-kwargs is not valid JSON"),
        ("annotate --model-kwargs a list", lambda _: _annotate(["--model-kwargs", "[1]", "--data", "cifar10"]), SystemExit, r"must be a JSON object"),
        ("ablation config table", lambda _: _ablation_config({"table": 9}), pydantic.ValidationError, r"table"),
        ("ablation config extra", lambda _: _ablation_config({"tabel": 7}), pydantic.ValidationError, r"tabel"),
    ]
    return cases


def _zero_and_root(p: Path) -> Path:
    root = _store(p / "s")
    _zero_shard_data(root)
    return root


def _bad_ids_and_root(p: Path) -> Path:
    root = _store(p / "s")
    _bad_ids_shard(root)
    return root


def _missing_and_root(p: Path) -> Path:
    root = _store(p / "s")
    (root / "shard-00000.npy").unlink()
    return root


def _truncated_and_root(p: Path) -> Path:
    root = _store(p / "s")
    path = root / "shard-00000.npy"
    path.write_bytes(path.read_bytes()[:-4])
    return root


def _broken_index_and_root(p: Path) -> Path:
    root = _store(p / "s")
    (root / "index.json").write_text("{")
    return root


def _load_config(p: Path, name: str | None, text: str) -> object:
    from benchmarks.ablation import load_config_file

    path = p / (name or "absent.json")
    if name is not None:
        path.write_text(text)
    return load_config_file(path)


def _annotate(argv: list[str]) -> object:
    from benchmarks.annotate import main

    return main(argv)


def _model_config(name: str) -> Any:
    from benchmarks._ablation_config import ModelConfig

    return ModelConfig(name=name)


def _ablation_config(tree: dict[str, Any]) -> Any:
    from benchmarks._ablation_config import AblationConfig

    return AblationConfig.model_validate(tree)


def _ablation_run(p: Path, argv: list[str]) -> object:
    """A dry run of the ablation on ``argv`` (the refusals a dry run shares with the real run)."""
    from benchmarks.ablation import resolve_config, run_ablation

    cfg, _ = resolve_config([*argv, "--cache-dir", str(p / "cache"), "--out", str(p / "out"), "--threads", "1"])
    return run_ablation(cfg, dry_run=True)


def _tiny_folder(p: Path) -> str:
    from test_ablation_cli import _folder

    return str(_folder(p / "ds"))  # 3 classes, 12 training and 12 evaluation images


def _task_mixed_with_ids_only_criterion() -> object:
    from timm.loss import LabelSmoothingCrossEntropy

    from mixlabels.backbones import AlignedClassificationTask

    task = AlignedClassificationTask(vit(), TLAlign(), criterion=LabelSmoothingCrossEntropy(0.1), verbose=False)
    return task(*CutMix(C, generator=gen())(X, Y))


def _timm_distillation_with_a_label_map() -> object:
    from timm.loss import SoftTargetCrossEntropy
    from timm.task import LogitDistillationTask

    # train.py's --kd-model-name with mixing on: timm's task and loss, mixlabels' mixer
    # copies: vit() is cached and shared by every case, and the task puts its teacher in eval mode
    task = LogitDistillationTask(copy.deepcopy(vit()), copy.deepcopy(vit()), criterion=SoftTargetCrossEntropy(), verbose=False)
    return task(*CutMix(C, generator=gen())(X, Y))


def _bad_cli_and_task() -> list[Bad]:
    """Issue 29's cases: the ablation's dry run refuses what its run refuses; the task and timm's tasks."""
    return [
        ("ablation finetune --base-data missing (dry run)", lambda p: _ablation_run(p, ["--profile", "finetune", "--base-data", str(p / "nonexistent")]), FileNotFoundError, r"no data at .*nonexistent"),
        ("ablation --subset beyond the data (dry run)", lambda p: _ablation_run(p, ["--data", _tiny_folder(p), "--subset", "100000000", "--img-size", "16", "--patch-size", "4"]), ValueError, r"--subset 100000000 asks for more training images than .*ds has \(12\): pass --subset 12 or fewer, or --subset all"),
        ("ablation --test-subset beyond the data (dry run)", lambda p: _ablation_run(p, ["--data", _tiny_folder(p), "--test-subset", "13", "--img-size", "16", "--patch-size", "4"]), ValueError, r"--test-subset 13 asks for more evaluation images"),
        ("ablation finetune base with other classes (dry run)", lambda p: _ablation_run(p, ["--profile", "finetune", "--base-data", _tiny_folder(p)]), ValueError, r"has 3 classes and the job's cifar10 10.*--base-data with as many classes"),
        ("task: ids-only criterion, mixed batch", lambda _: _task_mixed_with_ids_only_criterion(), TypeError, r"LabelSmoothingCrossEntropy takes class ids, but this batch was mixed.*SoftTargetCrossEntropy"),
        ("timm distillation task given a label map", lambda _: _timm_distillation_with_a_label_map(), TypeError, r"reached a loss written for target tensors.*AlignedClassificationTask.*image_targets\(\)"),
    ]


BAD = _bad() + _bad_cli_and_task()


@pytest.mark.parametrize(("case", "call", "error", "match"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_refused_by_name(
    case: str, call: Callable[[Path], object], error: type[BaseException], match: str, tmp_path: Path
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # timm/torch deprecation chatter is not the subject here
        with pytest.raises(error, match=match):
            call(tmp_path)


# ------------------------------------------------------------------------------------------ edge inputs
MIXERS: dict[str, Callable[[], Any]] = {
    "mixup": lambda: MixUp(C, generator=gen(1)),
    "cutmix": lambda: CutMix(C, generator=gen(1)),
    "cutmix elem": lambda: CutMix(C, mode="elem", generator=gen(1)),
    "cutmix patch elem": lambda: CutMix(C, patch_size=4, mode="elem", generator=gen(1)),
    "random patch": lambda: RandomPatchMix(C, cell_size=4, generator=gen(1)),
    "blockwise": lambda: BlockwiseMix(C, cell_size=4, min_cells=2, generator=gen(1)),
    "mixtoken": lambda: MixToken(C, patch_size=4, generator=gen(1)),
    "switch": lambda: Switch([MixUp(C), CutMix(C)], generator=gen(1)),
}
EDGE: list[tuple[str, Callable[[], None]]] = []


def edge(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        EDGE.append((name, fn))
        return fn

    return register


for _kind, _make in MIXERS.items():

    def _empty(make: Callable[[], Any] = _make) -> None:
        out, lm = make()(torch.rand(0, 3, 16, 16), torch.zeros(0, dtype=torch.long))
        assert out.shape == (0, 3, 16, 16) and lm.image_targets().shape == (0, C)

    def _channels_last(make: Callable[[], Any] = _make) -> None:
        x = X.contiguous(memory_format=torch.channels_last)
        out, lm = make()(x, Y)
        want, _ = make()(X, Y)  # the same draws on the contiguous batch
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(out, want)

    def _one_image(make: Callable[[], Any] = _make) -> None:
        out, lm = make()(X[:1], Y[:1])
        assert torch.equal(out, X[:1])  # alone, a sample has no partner: unmixed
        assert_close(lm.image_targets(), torch.eye(C)[Y[:1]])

    def _unmixed_with_nan_partner(make: Callable[[], Any] = _make) -> None:
        mixer = make()
        x = X.clone()
        x[3, 0, 0, 0] = float("nan")  # sample 3, the partner of sample 0 under flip
        x[2, 1, 5, 5] = float("inf")
        params = mixer.sample(x.shape, generator=gen(2))
        if hasattr(params, "params"):  # Switch: the chosen child's params
            inner = params.params
        else:
            inner = params
        unmixed = dataclass_replace_applied(inner)
        replay = type(params)(choice=params.choice, params=unmixed) if inner is not params else unmixed
        out, lm = mixer.mix(x, Y, replay)
        assert_close(out, x, rtol=0, atol=0, equal_nan=True)  # bit-identical, NaN and inf included
        assert_close(lm.image_targets(), torch.eye(C)[Y])

    EDGE.append((f"{_kind}: empty batch", _empty))
    EDGE.append((f"{_kind}: channels-last kept", _channels_last))
    EDGE.append((f"{_kind}: one image", _one_image))
    EDGE.append((f"{_kind}: unmixed next to NaN and inf", _unmixed_with_nan_partner))


def dataclass_replace_applied(params: Any) -> Any:
    """The same params with every sample unmixed, as a ``prob`` draw that failed leaves them."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(params)}
    b = params.partner.shape[0]
    update: dict[str, Any] = {"applied": torch.zeros(b, dtype=torch.bool)}
    if "lam" in fields:
        update["lam"] = torch.ones(b)
    if "boxes" in fields:
        update["boxes"] = torch.zeros_like(params.boxes)
    if "cells" in fields:
        update["cells"] = torch.zeros_like(params.cells)
    return dataclasses.replace(params, **update)


@edge("MixUp prob 0.5 elem: unmixed samples bit-identical beside NaN partners")
def _mixup_prob() -> None:
    x = X.clone()
    x[:, :, 0, 0] = float("nan")
    x[:, :, 1, 1] = float("inf")
    seen = 0
    for seed in range(6):
        mixer = MixUp(C, prob=0.5, mode="elem")
        out, lm = mixer(x, Y, generator=gen(seed))
        params = mixer.last_params
        assert params is not None
        keep = ~params.applied
        seen += int(keep.sum())
        assert_close(out[keep], x[keep], rtol=0, atol=0, equal_nan=True)  # inf stays inf (not 1 * inf + 0 * inf)
    assert seen > 0  # the draws left some samples unmixed


@edge("keep_unmixed: the copy (CPU) and the select (accelerators) routes restore the same rows bit for bit")
def _keep_unmixed_routes() -> None:
    from mixlabels.strategies._base import keep_unmixed

    own = X.clone()
    own[1, 0, 0, 0] = float("inf")
    unmixed = torch.tensor([False, True, False, True])
    for select in (False, True):
        out = torch.full_like(own, float("nan"))
        got = keep_unmixed(out, own, unmixed, select)
        assert_close(got[unmixed], own[unmixed], rtol=0, atol=0)
        assert torch.isnan(got[~unmixed]).all()


@edge("ResizeMix: a draw whose box rounds to 0 px is marked unmixed, and its pixels and targets are untouched")
def _resizemix_empty_boxes_unmixed() -> None:
    x = torch.rand(64, 3, 16, 16, generator=gen(9))
    y = torch.arange(64) % C
    mixer = ResizeMix(C, scale=(0.01, 0.2), mode="elem", generator=gen(9))  # tau < 1/16 rounds to an empty box
    out, lm = mixer(x, y)
    p = mixer.last_params
    assert p is not None
    empty = (p.boxes[:, 1] == p.boxes[:, 0]) | (p.boxes[:, 3] == p.boxes[:, 2])
    assert 0 < int(empty.sum()) < 64  # both kinds of draw happened
    assert not p.applied[empty].any() and p.applied[~empty].all()
    assert torch.equal(out[empty], x[empty])
    assert_close(lm.image_targets()[empty], torch.eye(C)[y[empty]])


@edge("SaliencyMix: an empty batch gives an empty batch (no FFT of nothing)")
def _saliencymix_empty() -> None:
    for mode in ("batch", "elem"):
        out, lm = SaliencyMix(C, mode=mode, generator=gen())(torch.rand(0, 3, 16, 16), torch.zeros(0, dtype=torch.long))
        assert out.shape == (0, 3, 16, 16) and lm.image_targets().shape == (0, C)


@edge("hand-built label map: a valid one trains, with the targets it describes")
def _hand_map_valid() -> None:
    out = adapt(vit(), NoAlign())(X, hand_map(0.75, 0.25))
    assert_close(out.target, 0.75 * torch.eye(C)[Y] + 0.25 * torch.eye(C)[Y[FLIP]])


@edge("hand-built label map: checked at every call on the CPU, never for a mixer's map")
def _hand_map_checked_on_cpu() -> None:
    from unittest import mock

    adapted = adapt(vit(), TLAlign())
    with mock.patch.object(TokenLabelMap, "check", autospec=True) as check:
        for _ in range(2):
            adapted(X, cutmix_map())  # a mixer's map: valid by construction
        assert check.call_count == 0
        for _ in range(2):
            adapted(X, hand_map(0.5, 0.5))
        assert check.call_count == 2
        adapted.check_label_values = False  # the opt-out
        adapted(X, hand_map(0.5, 0.5))
        assert check.call_count == 2


@edge("hand-built label map on an accelerator: checked at the first call only (no device sync per step)")
def _hand_map_checked_once_off_cpu() -> None:
    from mixlabels.backbones._timm_face import check_label_map

    adapted = adapt(vit(), TLAlign())
    gpu = torch.device("cuda")  # only the device is read: stand-ins for a batch and a map on a GPU
    images = types.SimpleNamespace(device=gpu)
    calls: list[int] = []
    lm = types.SimpleNamespace(validated=False, device=gpu, check=lambda: calls.append(1))
    for _ in range(3):
        check_label_map(adapted, images, lm)  # type: ignore[arg-type]
    assert len(calls) == 1
    adapted.check_label_values = True
    check_label_map(adapted, images, lm)  # type: ignore[arg-type]
    assert len(calls) == 2


@edge("hand-built label map: torch.compile traces the adapter in one graph (the check is skipped while compiling)")
def _hand_map_compiles() -> None:
    adapted = adapt(vit(), TLAlign())
    lm = hand_map(0.75, 0.25)
    torch._dynamo.reset()
    out = torch.compile(adapted, backend="eager", fullgraph=True)(X, lm)
    assert_close(out.target, adapted(X, lm).target)


@edge("token targets on an accelerator: left to the adapter's first-call check (the map is marked unchecked)")
def _token_targets_off_cpu() -> None:
    lm = cutmix_map().to("meta")
    assert lm.validated and not lm.with_token_targets(torch.randn(4, 2, 2, C, device="meta")).validated
    assert cutmix_map().with_token_targets(torch.rand(4, 2, 2, C).softmax(-1)).validated  # CPU: checked at once


@edge("BoxMask: integer corners of any integer dtype are accepted")
def _box_mask_int32() -> None:
    m = BoxMask(torch.tensor([[0, 2, 0, 3]], dtype=torch.int32), (4, 4))
    assert_close(m.token_weights((2, 2)), BoxMask(torch.tensor([[0, 2, 0, 3]]), (4, 4)).token_weights((2, 2)))


@edge("distributed refusal: keeps the DDP guidance, names FSDP2's order and refuses FSDP1")
def _distributed_refusal() -> None:
    from unittest import mock

    from mixlabels.backbones import _timm_face

    adapted = adapt(vit(), TLAlign())
    with mock.patch.object(_timm_face, "distributed_world", return_value=2):
        with pytest.raises(RuntimeError, match=r"outside DistributedDataParallel.*prepare_distributed") as err:
            adapted(X, cutmix_map())
    message = str(err.value)
    assert "DistributedDataParallel(adapted" in message
    assert "fully_shard each block, then fully_shard(adapted)" in message  # FSDP2: tests/test_fsdp.py trains it
    assert "FSDP1's FullyShardedDataParallel wrapper is not supported" in message


@edge("mix_images: weight 1 selects the image's own pixels")
def _mix_images_select() -> None:
    x = torch.tensor([[[[1.0, 2.0]]], [[[float("nan"), float("inf")]]]])
    out = mix_images(x, torch.tensor([1, 0]), torch.tensor([[[1.0, 0.0]], [[1.0, 1.0]]]))
    assert out[0, 0, 0, 0] == 1.0 and out[0, 0, 0, 1] == float("inf")  # weight 0: the partner's inf, not 0 * inf = NaN
    assert torch.isnan(out[1, 0, 0, 0]) and out[1, 0, 0, 1] == float("inf")  # own NaN and inf, untouched


@edge("mix_pixels: a zero weight never turns a partner's NaN into the sample's")
def _mix_pixels() -> None:
    x = X.clone()
    x[3] = float("nan")
    lm = TokenLabelMap.from_mask(torch.ones(4, 4, 4), torch.tensor([3, 2, 1, 0]), Y, C, image_size=(16, 16))
    out = lm.mix_pixels(x)
    assert torch.equal(out[:3], x[:3])


@edge("mix_tokens: an unmixed sample's tokens stay exact beside a partner's inf token")
def _mix_tokens() -> None:
    tokens = torch.randn(4, 16, 8, generator=gen(8))
    tokens[3, 0, 0] = float("inf")
    lm = TokenLabelMap.from_mask(torch.ones(4, 4, 4), FLIP, Y, C, image_size=(16, 16), token_space=True)
    assert torch.equal(lm.mix_tokens(tokens, (4, 4))[:3], tokens[:3])


@edge("soft labels: targets are the probabilities mixed by lambda")
def _soft_labels() -> None:
    probs = torch.softmax(torch.randn(4, C, generator=gen(3)), -1)
    mixer = MixUp(C, generator=gen(4))
    _, lm = mixer(X, probs)
    params = mixer.last_params
    assert params is not None
    lam = params.lam[:, None]
    assert_close(lm.image_targets(), lam * probs + (1 - lam) * probs[params.partner])


@edge("unmixed map: one-hot targets with smoothing as timm")
def _unmixed() -> None:
    lm = TokenLabelMap.unmixed(Y, C, (16, 16), label_smoothing=0.1)
    want = torch.full((4, C), 0.1 / C).scatter_(1, Y[:, None], 1 - 0.1 + 0.1 / C)
    assert_close(lm.image_targets(), want)


@edge("label values: checked every call for CPU labels")
def _values_every_call() -> None:
    mixer = MixUp(C)
    mixer(X, Y)
    with pytest.raises(ValueError, match="labels out of range"):
        mixer(X, torch.tensor([0, 1, 2, 9]))


@edge("label values: check_values=False skips the value check (shapes still checked)")
def _values_opt_out() -> None:
    mixer = CutMix(C)
    mixer.check_values = False
    mixer(X, torch.tensor([0, 1, 2, 9]))  # no host read of the values
    with pytest.raises(ValueError, match="batch size 3"):
        mixer(X, Y[:3])


@edge("label values on an accelerator: checked at the first call only (no device sync per step)")
def _values_first_call_off_cpu() -> None:
    from unittest import mock

    from mixlabels.strategies import _base

    mixer = MixUp(C)
    off_cpu = torch.zeros(4, dtype=torch.long, device="meta")  # stands in for labels on a GPU
    with mock.patch.object(_base, "check_labels") as check:
        for _ in range(3):
            mixer._check_labels(off_cpu, 4)
        assert check.call_count == 1
        mixer.check_values = True
        mixer._check_labels(off_cpu, 4)
        assert check.call_count == 2


@edge("replay: mix() equals the call that drew the params")
def _replay() -> None:
    mixer = CutMix(C, patch_size=4, mode="elem")
    out, lm = mixer(X, Y, generator=gen(5))
    params = mixer.last_params
    assert params is not None
    again, lm2 = mixer.mix(X, Y, params)
    assert torch.equal(out, again) and torch.equal(lm.image_weights, lm2.image_weights)


@edge("half precision CutMix: the same pixels as fp32, selected")
def _half() -> None:
    out16, _ = CutMix(C, mode="elem", generator=gen(6))(X.half(), Y)
    out32, _ = CutMix(C, mode="elem", generator=gen(6))(X, Y)
    assert torch.equal(out16, out32.half())


@edge("odd batch under flip: the middle sample is left unmixed")
def _odd() -> None:
    out, lm = MixUp(C, generator=gen(7))(X[:3], Y[:3])
    assert torch.equal(out[1], X[1]) and lm.image_weights[1, 0] == 1.0


@edge("TLAlign layers: numpy integers and negative indices are accepted")
def _layers_ok() -> None:
    assert TLAlign(layers=[np.int64(1), -1]).layers == (1, -1)


@edge("score-map store: a shard is checked once, on its first read")
def _first_read_once() -> None:
    import tempfile
    from unittest import mock

    from mixlabels.score_maps import _store

    with tempfile.TemporaryDirectory() as tmp:
        store = ScoreMaps(_store_tmp(Path(tmp)))
        with mock.patch.object(_store, "_sha256", wraps=_store._sha256) as sha:
            store.get([0])
            store.get([1, 2])
            store[0]
        assert sha.call_count == 1


def _store_tmp(p: Path) -> Path:
    return _store(p / "s")


@edge("run files: a list or a record without result is retrained, with a warning")
def _run_files() -> None:
    import tempfile

    from benchmarks.ablation import _read_done

    run = types.SimpleNamespace(model_dump=lambda mode: {"seed": 0})
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        planned = [types.SimpleNamespace(key=k, run=run, name=f"row {k}") for k in ("a", "b", "c", "d")]
        (runs / "a.json").write_text("[]")
        (runs / "b.json").write_text(json.dumps({"key": "b", "run": {"seed": 0}}))
        (runs / "c.json").write_text('{"key": "c", ')
        (runs / "d.json").write_text(json.dumps({"key": "d", "run": {"seed": 0}, "result": {"top1": 50.0, "steps": 3}}))
        with pytest.warns(UserWarning) as record:
            done = _read_done(runs, planned)  # type: ignore[arg-type]
        assert list(done) == ["d"]
        messages = " ".join(str(w.message) for w in record)
        assert "a.json holds a JSON list" in messages and "b.json has no 'result' entry" in messages
        assert "c.json cannot be read" in messages and messages.count("treating") == 3


@edge("adapt: a compiled adapted model still takes a label map (compile after adapting)")
def _compile_after() -> None:
    adapted = adapt(vit(), NoAlign())
    assert isinstance(adapted, AdaptedViT) and adapted.model is vit()


@edge("ablation: --auto-augment none is unset, as every other 'none' (same run key)")
def _auto_augment_none() -> None:
    from benchmarks._ablation_config import DataConfig
    from benchmarks.ablation import resolve_config

    assert resolve_config(["--auto-augment", "none"])[0].data.auto_augment is None
    assert DataConfig.model_validate({"auto_augment": "None"}) == DataConfig()


@edge("ablation: a dry run on a folder plans with its class count")
def _dry_run_folder_classes() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp)
        report = _ablation_run(p, ["--data", _tiny_folder(p), "--rows", "cutmix", "--seeds", "0", "--img-size", "16",
                                   "--patch-size", "4", "--loader", "tensor"])
        assert report.trained == 0  # type: ignore[attr-defined]
    from benchmarks._ablation_data import peek_sizes
    from benchmarks._ablation_config import AblationConfig

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp)
        cfg = AblationConfig.model_validate({"data": {"source": _tiny_folder(p)}, "cache_dir": str(p / "cache")})
        sizes = peek_sizes(cfg, Path(cfg.data.source))
        assert (sizes.num_classes, sizes.train, sizes.test) == (3, 12, 12)


@edge("task: class ids (mixing off) train as timm's ClassificationTask")
def _task_class_ids() -> None:
    from timm.task import ClassificationTask

    from mixlabels.backbones import AlignedClassificationTask

    model = copy.deepcopy(vit())  # vit() is cached and shared by every case: change a copy
    model.eval()
    ours = AlignedClassificationTask(model, TLAlign(), criterion=nn.CrossEntropyLoss(), verbose=False)(X, Y)
    theirs = ClassificationTask(model, criterion=nn.CrossEntropyLoss(), verbose=False)(X, Y)
    assert_close(ours["loss"], theirs["loss"])


@edge("mask: a box past the grid keeps the clipped area's lambda")
def _box_past_grid_lambda() -> None:
    from mixlabels._mask import BoxMask

    assert_close(BoxMask(torch.tensor([[-2, 2, 3, 9]]), (4, 4)).source_mean(), torch.tensor([14 / 16]))


@pytest.mark.parametrize(("case", "check"), EDGE, ids=[e[0] for e in EDGE])
def test_edge_input_gives_the_right_result(case: str, check: Callable[[], None]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        check()


def test_catalogue_size() -> None:
    """The issue asks for at least 80 bad or edge inputs."""
    assert len(BAD) + len(EDGE) >= 80


