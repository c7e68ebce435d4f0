"""Adapter for torchvision's ResNet class (ResNet-18 to 152, ResNeXt, Wide ResNet).

The rules and events of timm's ResNet family (``backbones.families.resnet``; the label rules of
``backbones._convnet``, both walks in its ``AdaptedConvNet``) on torchvision's modules. Events
per residual block ``layer`` (blocks counted over the four stages):

- the branch (``BasicBlock``: 3x3, 3x3; ``Bottleneck``: 1x1, 3x3 (grouped for ResNeXt), 1x1):
  its stride-1 3x3 conv (dilated where ``replace_stride_with_dilation``) mixes labels by its
  (out, in)-averaged normalised absolute kernel (border-renormalised), a strided 3x3 conv
  aggregates over its windows; 1x1 convs, batch norms and ReLUs are channel ops;
- the shortcut: the identity, or ``downsample`` (a 1x1 conv, stride 2 where the stage
  downsamples: it carries one position of each 2x2 cell; then a batch norm):
  ``aggregate(shortcut)`` then ``residual(layer, None, mixed=P_f Y)`` with
  ``Y = labels_for(layer)`` (torchvision's ResNet has no stochastic depth);
- the stem (7x7 stride-2 conv, batch norm, ReLU, 3x3 stride-2 max pool) forms the first tokens
  from windows of pixels: the labels start on the pixel grid and follow it (a MixToken map,
  mixed in token space, starts on the stem's grid);
- readout: ``pool("mean", 0)`` (``avgpool`` to 1x1; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from mixlabels.backbones._convnet import AdaptedConvNet, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedTvResNet", "TV_RESNET_FAMILY", "tv_resnet_refusal", "adaptive_avgpool_refusal"]

TV_RESNET_FAMILY = (
    "torchvision ResNet (ResNet-18/34/50/101/152, ResNeXt, Wide ResNet, dilated stages): every position a token; "
    "stride-1 3x3 convs mix labels by the (out, in)-averaged normalised |kernel| (border-renormalised); strided convs "
    "and the stem's max pool aggregate over their windows; 1x1 convs, batch norms, ReLU as channel ops; a block's "
    "shortcut keeps (or aggregates) the labels and its branch's labels join by the residual rule; stem from the "
    "pixels; global average pooling"
)

BUILDERS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "resnext101_32x8d",
            "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2")  # fmt: skip


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in the order of torchvision's ``forward`` (before the sum)."""
    if type(blk) is BasicBlock:
        return [blk.conv1, blk.bn1, blk.relu, blk.conv2, blk.bn2]
    return [blk.conv1, blk.bn1, blk.relu, blk.conv2, blk.bn2, blk.relu, blk.conv3, blk.bn3]


def _stem_modules(m: Any) -> list[nn.Module]:
    return [m.conv1, m.bn1, m.relu, m.maxpool]


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in (m.layer1, m.layer2, m.layer3, m.layer4) for blk in stage]


def adaptive_avgpool_refusal(pool: nn.Module, head: nn.Module, where: str) -> str | None:
    """Why a torchvision head (``pool`` then flatten then ``head``) has no label readout (``None``: it has)."""
    size = getattr(pool, "output_size", None)
    if type(pool) is not nn.AdaptiveAvgPool2d or size not in (1, (1, 1)):
        return f"{where}'s pool is {pool!r}; only global average pooling (AdaptiveAvgPool2d(1)) has a label readout"
    if type(head) is not nn.Linear:
        return f"{where}'s classifier is {type(head).__name__}; only an nn.Linear reads the pooled features here"
    return None


def tv_resnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision ResNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not ResNet:
        return f"{type(model).__name__} is not a torchvision ResNet"
    m: Any = model
    why = adaptive_avgpool_refusal(m.avgpool, m.fc, "the head") or path_refusal(_stem_modules(m), "the stem")
    if why is not None:
        return why
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) not in (BasicBlock, Bottleneck):
            return f"{where} is {type(blk).__name__}; only torchvision's BasicBlock and Bottleneck are supported"
        why = path_refusal(_branch_modules(blk), f"{where}'s branch") or path_refusal(conv_norm_act_ops(blk.downsample), f"{where}'s shortcut")
        if why is not None:
            return why
    return None


class AdaptedTvResNet(AdaptedConvNet):
    """A torchvision ResNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = TV_RESNET_FAMILY
    refusal = staticmethod(tv_resnet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        return _stem_modules(self.model)

    def _blocks(self) -> list[nn.Module]:
        return _blocks(self.model)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """torchvision's block forward (no stochastic depth: every branch kept)."""
        h = x
        for module in _branch_modules(blk):
            h = module(h)
        shortcut = blk.downsample(x) if blk.downsample is not None else x
        return blk.relu(h + shortcut), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        return path_of(_branch_modules(blk)), path_of(conv_norm_act_ops(blk.downsample))

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.fc(torch.flatten(m.avgpool(x), 1))  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The classifier on every final position ``(b, h*w, classes)`` (the head without the pooling)."""
        m: Any = self.model
        return m.fc(rearrange(x, "b c h w -> b (h w) c"))  # type: ignore[no-any-return]


FAMILY = Family(
    name="tv_resnet",
    description=TV_RESNET_FAMILY,
    refusal=AdaptedTvResNet.refusal,
    build=AdaptedTvResNet,
    example=tiny(ResNet, block=BasicBlock, layers=[1, 1, 1, 1]),
    timm_modules=(),
    torchvision_builders=BUILDERS,
)
