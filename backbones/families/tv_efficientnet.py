"""Adapter for torchvision's EfficientNet (B0 to B7, V2 S/M/L); its helpers serve ``tv_mobilenet`` too.

The rules and events of timm's EfficientNet family (``backbones.families.efficientnet``; the label
rules of ``backbones._convnet``, both walks in its ``AdaptedConvNet``) on torchvision's modules.
Events per block ``layer`` (``MBConv``, ``FusedMBConv``; MobileNet's ``InvertedResidual``),
counted over the stages:

- the branch (``MBConv``: 1x1 expansion, depthwise kxk conv, ``SqueezeExcitation``, 1x1
  projection; ``FusedMBConv``: a full kxk conv, then a 1x1): a stride-1 depthwise or full kxk
  conv mixes labels by its channel-averaged normalised |kernel| (border-renormalised), a strided
  one aggregates over its windows; 1x1 convs, batch norms, activations and the squeeze-excite
  gates are channel ops;
- a block with a residual (``use_res_connect``): ``residual(layer, keep, mixed=P Y)`` with
  ``Y = labels_for(layer)`` and torchvision's stochastic-depth draw; a block without one forms
  every position from its windows: ``aggregate`` by its path (as a stem does);
- the stem (3x3 stride-2 conv) aggregates from the pixel grid (a MixToken map starts on its
  grid); the last 1x1 conv is a channel op;
- readout: ``pool("mean", 0)`` (global average pooling, then the classifier: dropout, linear
  layers and activations on the pooled vector; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torchvision.models import mobilenetv2, mobilenetv3
from torchvision.models.efficientnet import EfficientNet, FusedMBConv, FusedMBConvConfig, MBConv, MBConvConfig
from torchvision.ops.misc import Conv2dNormActivation, SqueezeExcitation

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family

__all__ = ["AdaptedTvEfficientNet", "TV_EFFICIENTNET_FAMILY", "tv_efficientnet_refusal", "units_refusal", "tiny_tv_efficientnet"]

TV_EFFICIENTNET_FAMILY = (
    "torchvision EfficientNet (B0-B7, V2 S/M/L): MBConv and FusedMBConv blocks; stride-1 depthwise or full kxk convs "
    "mix labels by the channel-averaged normalised |kernel| (border-renormalised), strided convs aggregate over their "
    "windows, 1x1 convs, batch norms, activations and squeeze-excitation as channel ops; a residual block joins its "
    "branch's labels by the residual rule, a block without one aggregates; stem from the pixels; global average "
    "pooling; stochastic depth"
)

BUILDERS = tuple(f"efficientnet_b{i}" for i in range(8)) + ("efficientnet_v2_s", "efficientnet_v2_m", "efficientnet_v2_l")

_BLOCKS = (MBConv, FusedMBConv, mobilenetv2.InvertedResidual, mobilenetv3.InvertedResidual)
_PER_POSITION = (nn.Dropout, nn.Linear, nn.ReLU, nn.Hardswish, nn.SiLU)


def _units(m: Any) -> list[nn.Module]:
    """Every unit after the stem: the blocks (EfficientNet's stages are ``Sequential``\\ s of them), then the last conv."""
    return [blk for f in list(m.features)[1:] for blk in (f if type(f) is nn.Sequential else [f])]


def _branch_modules(blk: Any) -> list[nn.Module]:
    """A block's branch (before stochastic depth and the sum) as the ops its forward runs in order."""
    return conv_norm_act_ops(blk.conv if type(blk) is mobilenetv2.InvertedResidual else blk.block)


def units_refusal(m: Any) -> str | None:
    """Why the stem, a block, the last conv or the head of a torchvision EfficientNet or MobileNet has no label rule."""
    pool = getattr(m, "avgpool", nn.AdaptiveAvgPool2d(1))  # MobileNetV2 pools by the function
    if type(pool) is not nn.AdaptiveAvgPool2d or pool.output_size not in (1, (1, 1)):
        return f"the pool is {pool!r}; only global average pooling (AdaptiveAvgPool2d(1)) has a label readout"
    if not all(type(mod) in _PER_POSITION for mod in m.classifier):
        return "the classifier has a module other than dropout, linear layers and activations"
    why = path_refusal(conv_norm_act_ops(m.features[0]), "the stem")
    units = _units(m)
    for i, blk in enumerate(units):
        where = f"block {i}"
        if why is not None:
            return why
        if i == len(units) - 1 and type(blk) is Conv2dNormActivation:
            why = path_refusal(conv_norm_act_ops(blk), "the last conv")
        elif type(blk) not in _BLOCKS:
            why = f"{where} is {type(blk).__name__}; only torchvision's MBConv, FusedMBConv and InvertedResidual are supported"
        else:
            why = path_refusal(_branch_modules(blk), f"{where}'s branch", (SqueezeExcitation,))
    return why


def tv_efficientnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision EfficientNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not EfficientNet:
        return f"{type(model).__name__} is not a torchvision EfficientNet"
    return units_refusal(model)


class AdaptedTvEfficientNet(AdaptedConvNet):
    """A torchvision EfficientNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = TV_EFFICIENTNET_FAMILY
    refusal = staticmethod(tv_efficientnet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return conv_norm_act_ops(m.features[0])

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) in _BLOCKS

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """torchvision's block forward with the stochastic-depth draw exposed; the last conv as itself."""
        if type(blk) not in _BLOCKS:
            return blk(x), None
        h = blk.conv(x) if type(blk) is mobilenetv2.InvertedResidual else blk.block(x)
        if not blk.use_res_connect:
            return h, None
        sd = getattr(blk, "stochastic_depth", None)  # MobileNets have none
        h, keep = (h, None) if sd is None else branch(sd, h)
        return h + x, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) not in _BLOCKS:
            return path_of(conv_norm_act_ops(blk)), None  # the last conv: 1x1, channels only
        return path_of(_branch_modules(blk)), (() if blk.use_res_connect else None)

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        pooled = m.avgpool(x) if hasattr(m, "avgpool") else F.adaptive_avg_pool2d(x, (1, 1))
        return m.classifier(torch.flatten(pooled, 1))  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The classifier on every final position ``(b, h*w, classes)`` (the head without the pooling)."""
        m: Any = self.model
        return m.classifier(rearrange(x, "b c h w -> b (h w) c"))  # type: ignore[no-any-return]


def tiny_tv_efficientnet(num_classes: int = 10, **kwargs: Any) -> EfficientNet:
    """A seeded torchvision EfficientNet for 32x32 images (grids 16, 16, 8, 4, 4): FusedMBConv (with and without
    residual), strided and stride-1 MBConv with squeeze-excitation, a 5x5 depthwise conv. ``kwargs`` go to
    ``EfficientNet`` (``stochastic_depth_prob``, ``dropout``)."""
    torch.manual_seed(0)
    settings = [FusedMBConvConfig(1, 3, 1, 8, 8, 1), FusedMBConvConfig(4, 3, 2, 8, 16, 1), MBConvConfig(4, 3, 2, 16, 24, 2),
                MBConvConfig(6, 5, 1, 24, 32, 1)]  # fmt: skip
    return EfficientNet(settings, **{"dropout": 0.2, "num_classes": num_classes, "last_channel": 64, **kwargs})


FAMILY = Family(
    name="tv_efficientnet",
    description=TV_EFFICIENTNET_FAMILY,
    refusal=AdaptedTvEfficientNet.refusal,
    build=AdaptedTvEfficientNet,
    example=tiny_tv_efficientnet,
    timm_modules=(),
    torchvision_builders=BUILDERS,
)
