"""Adapter for timm's ResNet family (ResNet, ResNet-B/C/D/S/T, ResNeXt, SE-/ECA-ResNet, ResNet-RS, wide, blur/aa).

The paper's "beyond": the label rules of ``backbones._convnet`` on every position of the
feature maps. Events per residual block ``layer`` (blocks counted over all stages):

- the branch (``BasicBlock``: 3x3, 3x3; ``Bottleneck``: 1x1, 3x3 (grouped for ResNeXt), 1x1;
  then squeeze-excite or ECA): its stride-1 3x3 convs mix labels by their channel-averaged
  normalised absolute kernels (border-renormalised), its strided 3x3 conv (or, for the
  anti-aliased variants, its stride-1 conv then the blur/average pool) aggregates over the
  windows; the 1x1 convs, batch/group norms, activations, gates and DropBlock are channel ops;
- the shortcut: the identity, or a 1x1 projection (labels kept); when it downsamples, its
  window aggregates: a 1x1 stride-2 conv reads one position of each 2x2 cell (so it carries
  that position's labels), ResNet-D's 2x2 average pool sums the whole cell;
- ``aggregate(shortcut)`` then ``residual(layer, keep, mixed=branch(Y))`` with
  ``Y = labels_for(layer)`` before the shortcut: ``(P_s Y + P_f Y) / 2`` for TL-Align, which
  is the paper's ``Norm(Y + W Y)`` with the shortcut's own path in place of the identity;
- the stem (7x7 stride-2 conv, or the deep stem's 3x3 stride-2 conv then two stride-1 3x3
  convs; then the 3x3 stride-2 max pool, or its replacements) forms the first tokens from
  windows of pixels: the labels start on the pixel grid and follow it (aggregate events), so
  every first-stage position gets the source fractions of its receptive field; a MixToken map
  (mixed in token space) starts on the stem's output grid instead;
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``l`` label channels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from einops import rearrange
from timm.layers.drop import DropPath
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._common import AdaptedBase, branch
from mixlabels.backbones._convnet import (
    Kernels,
    Path,
    block_kernels,
    block_labels,
    run_stem,
    block_labels_reference,
    path_matrix,
    path_of,
    path_refusal,
    start_on_path,
)
from mixlabels.backbones._dense import DenseRules
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import is_sharded, through_hooks

__all__ = ["AdaptedResNet", "RESNET_FAMILY", "resnet_refusal", "blocks_refusal"]

RESNET_FAMILY = (
    "timm ResNet (ResNet/ResNeXt/SE-/ECA-ResNet/ResNet-RS/wide, 7x7 or deep stem, conv or avg-pool (ResNet-D) "
    "shortcuts, blur/avg anti-aliasing): every position a token; stride-1 kxk convs mix labels by the "
    "(out, in)-averaged normalised |kernel| (border-renormalised, as a depthwise conv); strided convs and pools "
    "aggregate over their windows; 1x1 convs, norms, activations, SE/ECA as channel ops; a block's shortcut keeps "
    "(or aggregates) the labels and its branch's labels join by the residual rule; stem from the pixels; "
    "global average pooling; stochastic depth"
)


def _flat(module: nn.Module | None) -> list[nn.Module]:
    if module is None:
        return []
    return list(module) if isinstance(module, nn.Sequential) else [module]


def _stem_modules(m: Any) -> list[nn.Module]:
    return _flat(m.conv1) + [m.bn1, m.act1] + _flat(m.maxpool)


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in the order of timm's ``forward`` (before drop-path and the sum)."""
    if isinstance(blk, BasicBlock):
        mods = [blk.conv1, blk.bn1, blk.drop_block, blk.act1, *_flat(blk.aa), blk.conv2, blk.bn2]
    else:
        mods = [blk.conv1, blk.bn1, blk.act1, blk.conv2, blk.bn2, blk.drop_block, blk.act2, *_flat(blk.aa), blk.conv3, blk.bn3]
    return mods + _flat(blk.se)


def _last_act(blk: Any) -> nn.Module:
    act: nn.Module = blk.act2 if isinstance(blk, BasicBlock) else blk.act3
    return act


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in (m.layer1, m.layer2, m.layer3, m.layer4) for blk in stage]


def resnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ResNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not ResNet:
        return f"{type(model).__name__} is not a timm ResNet"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    return path_refusal(_stem_modules(m), "the stem") or blocks_refusal(_blocks(m))


def blocks_refusal(blocks: list[Any], where_first: str = "block") -> str | None:
    """Why a run of timm ResNet blocks has no label rule (``None``: every block has one); ``vit_hybrid`` asks it of a
    features_only ResNet's, naming them ``where_first``."""
    for i, blk in enumerate(blocks):
        where = f"{where_first} {i}"
        if type(blk) not in (BasicBlock, Bottleneck):
            return f"{where} is {type(blk).__name__}; only timm's BasicBlock and Bottleneck are supported"
        if blk.drop_path is not None and type(blk.drop_path) is not DropPath:
            return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
        why = path_refusal(_branch_modules(blk) + [_last_act(blk)], f"{where}'s branch") or path_refusal(_flat(blk.downsample), f"{where}'s shortcut")
        if why is not None:
            return why
    return None


def _stem(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
    """Stem output ``(b, c, h, w)``, the stem's path, its output grid and the grid the labels start on."""
    stem = path_of(_stem_modules(m))
    x, grid, start = run_stem(lambda i: m.maxpool(m.act1(m.bn1(m.conv1(i)))), stem, images, label_map)
    return x, stem, grid, start


def _block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's block forward with the branch's drop-path draw exposed: the output and who kept the branch."""
    h = x
    for module in _branch_modules(blk):
        h = module(h)
    keep = None
    if blk.drop_path is not None:
        h, keep = branch(blk.drop_path, h)
    shortcut = blk.downsample(x) if blk.downsample is not None else x
    return _last_act(blk)(h + shortcut), keep


BlockForward = Callable[[Any, Tensor], tuple[Tensor, Tensor | None]]
"""A block's forward with its drop-path draw exposed: the output and who kept the branch."""


def _aligned_block(
    forward: BlockForward, blk: Any, layer: int, grid: tuple[int, int], tracker: LabelTracker, paths: tuple[Path, Path],
    kernels: Kernels | None, x: Tensor,
) -> tuple[Tensor, tuple[int, int]]:
    """One block and its label events (``kernels`` ``None``: read here, while the block's parameters are gathered)."""
    x, keep = forward(blk, x)
    return x, block_labels(tracker, layer, grid, *paths, keep, kernels)


def _paths(blk: Any) -> tuple[Path, Path]:
    return path_of(_branch_modules(blk)), path_of(_flat(blk.downsample))


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position ``(b, h*w, classes)`` (timm's head without the pooling)."""
    t = rearrange(x, "b c h w -> b (h w) c")
    if m.drop_rate:
        t = F.dropout(t, p=float(m.drop_rate), training=m.training)
    return m.fc(t)  # type: ignore[no-any-return]


class AdaptedResNet(AdaptedBase):
    """A timm ResNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = RESNET_FAMILY
    refusal = staticmethod(resnet_refusal)

    # A block's forward and its (branch, shortcut) paths: a family of timm ResNets built with other blocks (Res2Net's)
    # replaces these two and keeps the rest.
    @staticmethod
    def block_forward(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return _block(blk, x)

    @staticmethod
    def block_paths(blk: Any) -> tuple[Path, Path]:
        return _paths(blk)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, stem, grid, start = _stem(m, images, label_map)
        blocks = _blocks(m)
        tracker = start_on_path(self.scheme, label_map, start, grid, len(blocks), stem)
        paths = [self.block_paths(blk) for blk in blocks]
        # all label kernels at once (few operators); under FSDP2's per-block sharding each block's parameters are
        # whole only inside its own hooked call, so each block computes its kernels there
        kernels = None if any(is_sharded(blk) for blk in blocks) else block_kernels(tracker, paths)
        for layer, blk in enumerate(blocks):
            work = functools.partial(_aligned_block, self.block_forward, blk, layer, grid, tracker, paths[layer], kernels)
            x, grid = through_hooks(blk, work, x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        return tuple(_blocks(self.model))

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices of every path on dense labels."""
        m: Any = self.model
        x, stem, grid, start = _stem(m, images, label_map)
        blocks = _blocks(m)
        rules = DenseRules(self.scheme, label_map, start, 0, len(blocks))
        if not label_map.token_space:
            rules.aggregate(path_matrix(stem, start)[0])
        for layer, blk in enumerate(blocks):
            x, keep = self.block_forward(blk, x)
            grid = block_labels_reference(rules, layer, grid, *self.block_paths(blk), keep)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="resnet",
    description=RESNET_FAMILY,
    refusal=AdaptedResNet.refusal,
    build=AdaptedResNet,
    example=tiny("resnet18d", layers=(1, 1, 1, 1), channels=(8, 16, 24, 32), stem_width=8),
    timm_modules=("resnet",),
    speed_model="resnet18",
)
