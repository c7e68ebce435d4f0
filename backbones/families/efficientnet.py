"""Adapter for timm's EfficientNet class (EfficientNet, EfficientNetV2, MobileNetV2, MNASNet, FBNet, LCNet, ...).

The label rules of ``backbones._convnet`` (as for ResNet) on the blocks of ``_efficientnet_blocks``.
Events per block ``layer`` (blocks counted over all stages):

- ``InvertedResidual`` (MBConv): 1x1 expansion, depthwise kxk conv, squeeze-excite, 1x1
  projection; ``DepthwiseSeparableConv``: depthwise conv, SE, 1x1; ``EdgeResidual`` (FusedMBConv):
  a full kxk conv, SE, 1x1; ``ConvBnAct``: one conv. The stride-1 depthwise or full kxk conv mixes
  labels by its channel-averaged normalised absolute kernel (border-renormalised); a strided one
  aggregates over its windows (a ``Conv2dSame``'s TF 'same' windows, padded by each input's size,
  resolved on the grid it receives: the tf_* models); 1x1 convs, BatchNormAct, SE are channel ops;
- MixNet's ``MixedConv2d`` (channel groups of kernels 3, 5, 7, ... concatenated) is the one conv it equals, every
  group's kernel zero-padded centred to the largest: stride 1, the conv rule over all groups' (out, in) pairs (a group
  weighs by its pair count); strided, the largest kernel's windows. A space-to-depth block (``s2d``,
  efficientnet_x/h) starts with its 2x2 stride-2 'same' conv's windows; its 2x2 stride-1 'same' depthwise conv is the
  static 3x3 conv with a zero first row and column;
- a block with a skip (``has_skip``: stride 1, same width): ``residual(layer, keep, mixed=P Y)``
  with ``Y = labels_for(layer)``; a block without one forms every position from its windows:
  ``aggregate`` by its path, aligned layer or not (as a stem does);
- the stem (3x3 stride-2 conv) aggregates from the pixel grid (a MixToken map starts on its grid);
- readout: ``pool("mean", 0)`` after the 1x1 ``conv_head`` (global average pooling; TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from einops import rearrange
from timm.layers.conv_bn_act import ConvNormAct
from timm.layers.layer_scale import LayerScale2d
from timm.models._efficientnet_blocks import (
    ConvBnAct,
    DepthwiseSeparableConv,
    EdgeResidual,
    InvertedResidual,
    MobileAttention,
    SqueezeExcite,
    UniversalInvertedResidual,
)
from timm.models.efficientnet import EfficientNet
from torch import Tensor, nn

from mixlabels import AlignedOutput, TokenLabelMap, TokenLayout
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, mix_token_space
from mixlabels.backbones._convnet import (
    Path,
    Window,
    apply_path,
    block_kernels,
    block_labels,
    block_labels_reference,
    path_grid,
    path_matrix,
    path_of,
    path_refusal,
    start_on_path,
    windows_into_stem,
)
from mixlabels.backbones._dense import DenseRules
from mixlabels.backbones._mobile_attention import mobile_attention_labels, mobile_attention_reference, mobile_attention_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedEfficientNet", "EFFICIENTNET_FAMILY", "efficientnet_refusal", "blocks_refusal"]

EFFICIENTNET_FAMILY = (
    "timm EfficientNet class (EfficientNet/V2, MobileNetV2, MNASNet, FBNet, ..., tf_* with TF 'same' padding): "
    "InvertedResidual, DepthwiseSeparable, EdgeResidual and ConvBnAct blocks (space-to-depth too: efficientnet_x/h); "
    "MixNet's MixedConv2d as the one conv with its groups' kernels zero-padded to the largest; stride-1 depthwise or full kxk convs "
    "mix labels by the channel-averaged normalised |kernel| (border-renormalised), strided convs aggregate over their "
    "windows ('same' windows resolved on each input grid), 1x1 convs, BatchNormAct and squeeze-excite as channel ops; a skip block joins its branch's labels by "
    "the residual rule, a block without skip aggregates; stem from the pixels; global average pooling; stochastic depth"
)

_BLOCKS = (InvertedResidual, DepthwiseSeparableConv, EdgeResidual, ConvBnAct, UniversalInvertedResidual)


def _conv_norm_act(module: nn.Module) -> list[nn.Module]:
    """timm's ``ConvNormAct`` (conv, norm with its activation, then the anti-aliasing pool) as its modules in
    the order of its ``forward``; ``Identity`` (an absent optional conv) as itself."""
    if isinstance(module, ConvNormAct):
        aa = getattr(module, "aa", None)
        return [module.conv, module.bn, *([aa] if aa is not None else [])]
    return [module]


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The block's modules in the order of timm's ``forward`` (before drop-path and the skip)."""
    # space-to-depth (s2d, efficientnet_x/h): a 2x2 stride-2 'same' conv first, a window like any strided conv
    s2d = [blk.conv_s2d, blk.bn_s2d] if getattr(blk, "conv_s2d", None) is not None else []
    if type(blk) is InvertedResidual:
        return [*s2d, blk.conv_pw, blk.bn1, blk.conv_dw, blk.bn2, blk.aa, blk.se, blk.conv_pwl, blk.bn3]
    if type(blk) is DepthwiseSeparableConv:
        return [*s2d, blk.conv_dw, blk.bn1, blk.aa, blk.se, blk.conv_pw, blk.bn2]
    if type(blk) is EdgeResidual:
        return [blk.conv_exp, blk.bn1, blk.aa, blk.se, blk.conv_pwl, blk.bn2]
    if type(blk) is UniversalInvertedResidual:  # MobileNetV4's UIB: optional depthwise convs around the 1x1s
        return [*_conv_norm_act(blk.dw_start), *_conv_norm_act(blk.pw_exp), *_conv_norm_act(blk.dw_mid), blk.se,
                *_conv_norm_act(blk.pw_proj), *_conv_norm_act(blk.dw_end), blk.layer_scale]  # fmt: skip
    return [blk.conv, blk.bn1, blk.aa]


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in m.blocks for blk in stage]


def blocks_refusal(m: Any) -> str | None:
    """Why the stem or a block of an EfficientNet-built model (EfficientNet, MobileNetV3) has no label rule."""
    why = path_refusal([m.conv_stem, m.bn1], "the stem")
    if why is not None:
        return why
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) is MobileAttention:
            why = mobile_attention_refusal(blk, where)
            if why is not None:
                return why
            continue
        if type(blk) not in _BLOCKS:
            return (f"{where} is {type(blk).__name__}; only InvertedResidual, DepthwiseSeparableConv, EdgeResidual, "
                    "ConvBnAct and UniversalInvertedResidual are supported")  # fmt: skip
        if getattr(blk, "conv_s2d", None) is not None and blk.has_skip:  # timm's forward would add maps of two sizes
            return f"{where} has a space-to-depth conv (s2d) and a skip, whose maps differ in size; build it with s2d=0"
        why = path_refusal(_branch_modules(blk), f"{where}'s branch", (SqueezeExcite, LayerScale2d))
        if why is not None:
            return why
    return None


def efficientnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm EfficientNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not EfficientNet:
        return f"{type(model).__name__} is not a timm EfficientNet"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    why = blocks_refusal(m) or path_refusal([m.conv_head, m.bn2], "the head")
    if why is None and path_of([m.conv_head]):
        return "the head's conv_head is not a 1x1 stride-1 convolution"
    return why


def _stem(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
    """Stem output ``(b, c, h, w)``, the stem's path, its output grid and the grid the labels start on."""
    stem = path_of([m.conv_stem])
    stride = stem[0].stride if stem and isinstance(stem[0], Window) else (1, 1)
    pixels = check_batch(images, label_map, stride if label_map.token_space else (1, 1))
    x = m.bn1(m.conv_stem(images))
    grid, start = (int(x.shape[2]), int(x.shape[3])), (int(images.shape[2]), int(images.shape[3]))
    if label_map.token_space:
        if pixels != grid:
            raise ValueError(f"MixToken needs the stem's {grid} grid to tile the image ({pixels}); use an image size divisible by {stride[0]}")
        return mix_token_space(x, label_map, channels_last=False), stem, grid, grid
    if path_grid(stem, start) != grid:
        raise ValueError(f"the stem made a {grid} grid where its windows give {path_grid(stem, start)}; this stem is not supported")
    return x, stem, grid, start


def _block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's block forward with the drop-path draw exposed: the output and who kept the branch."""
    h = x
    for module in _branch_modules(blk):
        h = module(h)
    if not blk.has_skip:
        return h, None
    h, keep = branch(blk.drop_path, h)
    return h + x, keep


def _paths(blk: Any) -> tuple[Path, Path | None]:
    return path_of(_branch_modules(blk)), (() if blk.has_skip else None)


def _head(m: Any, x: Tensor) -> Tensor:
    return m.bn2(m.conv_head(x))  # type: ignore[no-any-return]


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position ``(b, h*w, classes)`` (timm's head without the pooling)."""
    t = rearrange(x, "b c h w -> b (h w) c")
    if m.drop_rate > 0.0:
        t = F.dropout(t, p=m.drop_rate, training=m.training)
    return m.classifier(t)  # type: ignore[no-any-return]


class AdaptedEfficientNet(AdaptedBase):
    """A timm EfficientNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = EFFICIENTNET_FAMILY
    refusal = staticmethod(efficientnet_refusal)

    def _pre_pool(self, x: Tensor) -> Tensor:
        """The map the global pool reads (EfficientNet: after its 1x1 ``conv_head`` and norm)."""
        return _head(self.model, x)

    def _position_logits(self, x: Tensor) -> Tensor:
        """The classifier on every position of the pooled map (``x`` from ``_pre_pool``)."""
        return _token_logits(self.model, x)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, stem, grid, start = _stem(m, images, label_map)
        blocks = _blocks(m)
        paths: list[tuple[Path, Path | None]] = [((), ()) if type(blk) is MobileAttention else _paths(blk) for blk in blocks]
        if paths and not label_map.token_space:
            # the labels start where the first block's leading windows end (MobileNetV3's strided dw conv)
            stem, paths[0], grid = windows_into_stem(stem, paths[0], grid)
        tracker = start_on_path(self.scheme, label_map, start, grid, len(blocks), stem)
        kernels = block_kernels(tracker, paths)
        for layer, blk in enumerate(blocks):
            if type(blk) is MobileAttention:  # MobileNetV4's hybrids: multi-query attention, grid unchanged
                x = mobile_attention_labels(blk, x, layer, tracker, grid)
                continue
            x, keep = _block(blk, x)
            grid = block_labels(tracker, layer, grid, *paths[layer], keep, kernels)
        x = self._pre_pool(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = self._position_logits(x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices of every path on dense labels."""
        m: Any = self.model
        x, stem, grid, start = _stem(m, images, label_map)
        blocks = _blocks(m)
        rules = DenseRules(self.scheme, label_map, start, 0, len(blocks))
        if not label_map.token_space:
            rules.aggregate(path_matrix(stem, start)[0])
        for layer, blk in enumerate(blocks):
            if type(blk) is MobileAttention:
                x = mobile_attention_reference(blk, x, layer, rules, grid)
                continue
            x, keep = _block(blk, x)
            grid = block_labels_reference(rules, layer, grid, *_paths(blk), keep)
        x = self._pre_pool(x)
        output = m.forward_head(x)
        token_logits = self._position_logits(x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="efficientnet",
    description=EFFICIENTNET_FAMILY,
    refusal=AdaptedEfficientNet.refusal,
    build=AdaptedEfficientNet,
    example=tiny("test_efficientnet"),
    timm_modules=("efficientnet",),
    speed_model="efficientnet_b0",
)
