"""Adapter for timm's TResNet (``tresnet_*``, v1 and v2); it takes ``vovnet``'s ClassifierHead helpers.

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on TResNet's parts:

- the stem: ``SpaceToDepth`` moves every 4x4 block of pixels into the channels of one position, so
  it is a 4x4 stride-4 window (as efficientnet_x/h's space-to-depth conv is its 2x2 stride-2
  windows), then a 3x3 stride-1 ``ConvNormAct`` mixing by its normalised |kernel|: the labels start
  on the pixels and aggregate through both (a MixToken map starts on the stem's grid);
- ``BasicBlock`` (3x3, 3x3, SE) and ``Bottleneck`` (1x1, 3x3, SE, 1x1): a stride-1 3x3 conv mixes
  labels by its normalised |kernel|; a strided block's 3x3 conv runs at stride 1 and is followed by
  its anti-aliasing ``BlurPool2d`` (a fixed depthwise blur at stride 2): windows the labels
  aggregate over; 1x1 convs, norms (BatchNormAct), activations and SE as channel ops. The shortcut
  (identity; or a 2x2 stride-2 average pool with ``ceil_mode`` then a 1x1 conv: the pool's windows)
  keeps or aggregates the labels, and the branch's labels join by the residual rule (stochastic depth:
  a dropped sample keeps the shortcut's where the scheme follows drop path);
- readout: ``pool("mean", 0)``: timm's ``ClassifierHead`` with average pooling (``'fast'``, TResNet's
  default, is the same mean over positions), dropout and a linear layer (channel ops).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from timm.layers.adaptive_avgmax_pool import FastAdaptiveAvgPool
from timm.layers.classifier import ClassifierHead
from timm.layers.drop import DropPath
from timm.layers.space_to_depth import SpaceToDepth
from timm.models.tresnet import BasicBlock, Bottleneck, TResNet
from torch import Tensor, nn

from mixlabels import TokenLabelMap
from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import Path, Window, conv_norm_act_ops, path_of, path_refusal, run_stem
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.vovnet import HeadedConvNet, classifier_head_refusal

__all__ = ["AdaptedTResNet", "TRESNET_FAMILY", "tresnet_refusal"]

TRESNET_FAMILY = (
    "timm TResNet (tresnet_*, v1 and v2): every position a token; the space-to-depth stem as 4x4 stride-4 windows; "
    "stride-1 kxk convs mix labels by the (out, in)-averaged normalised |kernel| (border-renormalised); blur pools "
    "(anti-aliased downsampling) and the shortcut's average pools aggregate over their windows; 1x1 convs, norms, "
    "activations, SE as channel ops; a block's shortcut keeps (or aggregates) the labels and its branch's labels join "
    "by the residual rule; stem from the pixels; global average pooling; stochastic depth"
)

_BODY = ["s2d", "conv1", "layer1", "layer2", "layer3", "layer4"]


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in the order of timm's ``forward`` (before drop path and the sum)."""
    mods = [*conv_norm_act_ops(blk.conv1), *conv_norm_act_ops(blk.conv2), *([blk.se] if blk.se is not None else [])]
    return mods + (conv_norm_act_ops(blk.conv3) if type(blk) is Bottleneck else [])


def _blocks(m: Any) -> list[Any]:
    return [blk for name in _BODY[2:] for blk in getattr(m.body, name)]


def _stem_path(m: Any) -> Path:
    bs = int(m.body.s2d.bs)
    return (Window((bs, bs), (bs, bs), (0, 0)), *path_of(conv_norm_act_ops(m.body.conv1)))


def _head_refusal(head: Any) -> str | None:
    """``classifier_head_refusal``, with timm's ``'fast'`` pooling (the mean over positions, TResNet's default) too."""
    fast = type(head) is ClassifierHead and type(head.global_pool.pool) is FastAdaptiveAvgPool
    if fast and not head.use_conv and isinstance(head.fc, (nn.Linear, nn.Identity)):
        return None
    return classifier_head_refusal(head)


def tresnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm TResNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not TResNet:
        return f"{type(model).__name__} is not a timm TResNet"
    m: Any = model
    if list(m.body._modules) != _BODY:
        return f"the body holds {list(m.body._modules)}, not {_BODY} (a pruned TResNet has no rule here)"
    if type(m.body.s2d) is not SpaceToDepth:
        return f"the stem's s2d is {type(m.body.s2d).__name__}, not timm's SpaceToDepth"
    why = _head_refusal(m.head) or path_refusal(conv_norm_act_ops(m.body.conv1), "the stem's conv1")
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if why is not None:
            return why
        if type(blk) not in (BasicBlock, Bottleneck):
            return f"{where} is {type(blk).__name__}; only timm's TResNet BasicBlock and Bottleneck are supported"
        if type(blk.drop_path) not in (DropPath, nn.Identity):
            return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
        why = path_refusal(_branch_modules(blk) + [blk.act], f"{where}'s branch")
        why = why or path_refusal(conv_norm_act_ops(blk.downsample), f"{where}'s shortcut")
    return why


class AdaptedTResNet(HeadedConvNet):
    """A timm TResNet returning the scheme's aligned targets (pooled readout, labels per position; ``vovnet``'s
    ClassifierHead readout, its own space-to-depth stem)."""

    family = TRESNET_FAMILY
    refusal = staticmethod(tresnet_refusal)

    def _stem(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
        m: Any = self.model
        path = _stem_path(m)
        x, grid, start = run_stem(lambda i: m.body.conv1(m.body.s2d(i)), path, images, label_map)
        return x, path, grid, start

    def _blocks(self) -> list[nn.Module]:
        return _blocks(self.model)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block forward with the branch's drop-path draw exposed: the output and who kept the branch."""
        shortcut = blk.downsample(x) if blk.downsample is not None else x
        h = x
        for module in _branch_modules(blk):
            h = module(h)
        h, keep = branch(blk.drop_path, h)
        return blk.act(h + shortcut), keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        return path_of(_branch_modules(blk)), path_of(conv_norm_act_ops(blk.downsample))


FAMILY = Family(
    name="tresnet",
    description=TRESNET_FAMILY,
    refusal=AdaptedTResNet.refusal,
    build=AdaptedTResNet,
    example=tiny(TResNet, layers=[1, 1, 1, 1], width_factor=0.125),
    timm_modules=("tresnet",),
    speed_model="tresnet_m",
)
