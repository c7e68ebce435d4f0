"""Adapter for torchvision's ConvNeXt (convnext_tiny to convnext_large).

The rules of timm's ConvNeXt family (``backbones.families.convnext``) on torchvision's modules,
both walks in ``backbones._convnet.AdaptedConvNet``. Events per ``CNBlock`` ``layer`` (blocks
counted over the four stages):

- the depthwise 7x7 conv: the branch's labels ``Norm(T(K)) Y`` (``Y = labels_for(layer)``) with
  ``K = mean_c(|K_c| / sum|K_c|)``, border-renormalised; the rest of the block (permutes,
  LayerNorm, the MLP, layer scale) is channel mixing; then ``residual(layer, keep, mixed=...)``
  with torchvision's stochastic depth draw;
- the stem (4x4 stride-4 conv, LayerNorm2d): the labels start as the exact area fractions of its
  cells; each stage's downsampling (LayerNorm2d, 2x2 stride-2 conv) aggregates over its windows;
- readout: ``pool("mean", 0)``: the head (``avgpool``, then LayerNorm2d, flatten, linear) pools
  first, its norm a channel op on the pooled vector (no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn
from torchvision.models.convnext import CNBlock, CNBlockConfig, ConvNeXt, LayerNorm2d
from torchvision.ops.misc import Permute

from mixlabels.backbones._common import branch, check_static_conv
from mixlabels.backbones._convnet import AdaptedConvNet, Path, path_of, path_refusal
from mixlabels.backbones._family import Family
from mixlabels.backbones.families.tv_resnet import adaptive_avgpool_refusal

__all__ = ["AdaptedTvConvNeXt", "TV_CONVNEXT_FAMILY", "tv_convnext_refusal"]

TV_CONVNEXT_FAMILY = (
    "torchvision ConvNeXt (tiny/small/base/large): depthwise conv as normalised-absolute-kernel spatial mix; "
    "LayerNorm, MLP and layer scale as channel ops; the 'patch' stem and the strided downsampling as aggregation; "
    "global average pooling before the head's norm; stochastic depth"
)

BUILDERS = ("convnext_tiny", "convnext_small", "convnext_base", "convnext_large")

_CHANNEL_MIX = (Permute, nn.LayerNorm, nn.Linear, nn.GELU)


def _blocks(m: Any) -> list[nn.Module]:
    """Every unit after the stem: each stage's ``CNBlock``\\ s, and the downsamplings between stages."""
    units: list[nn.Module] = []
    for stage in list(m.features)[1:]:
        units += list(stage) if all(type(blk) is CNBlock for blk in stage) else [stage]
    return units


def tv_convnext_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision ConvNeXt this adapter carries labels through (``None``: it is)."""
    if type(model) is not ConvNeXt:
        return f"{type(model).__name__} is not a torchvision ConvNeXt"
    m: Any = model
    head = list(m.classifier)
    if [type(mod) for mod in head] != [LayerNorm2d, nn.Flatten, nn.Linear]:
        return "the classifier is not torchvision's (LayerNorm2d, Flatten, Linear)"
    stem = m.features[0]
    if type(stem[0]) is not nn.Conv2d or stem[0].kernel_size != stem[0].stride or stem[0].padding != (0, 0):
        return "only the 'patch' stem (kernel == stride) has patch tokens"
    why = adaptive_avgpool_refusal(m.avgpool, head[2], "the head") or path_refusal(list(stem), "the stem")
    for i, unit in enumerate(_blocks(m)):
        if why is not None:
            return why
        where = f"unit {i}"
        if type(unit) is not CNBlock:
            why = path_refusal(list(unit), f"{where} (downsampling)") if isinstance(unit, nn.Sequential) else f"{where} is {type(unit).__name__}"
            continue
        cn: Any = unit
        mods = list(cn.block)
        why = check_static_conv(mods[0], f"{where}'s depthwise conv", depthwise=True)
        if why is None and not all(type(mod) in _CHANNEL_MIX for mod in mods[1:]):
            why = f"{where}'s block is not torchvision's (depthwise conv, then permutes, LayerNorm, Linear, GELU)"
    return why


class AdaptedTvConvNeXt(AdaptedConvNet):
    """A torchvision ConvNeXt returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = TV_CONVNEXT_FAMILY
    refusal = staticmethod(tv_convnext_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return list(m.features[0])

    def _blocks(self) -> list[nn.Module]:
        return _blocks(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is CNBlock

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """torchvision's ``CNBlock.forward`` with the stochastic-depth draw exposed; a downsampling as itself."""
        if type(blk) is not CNBlock:
            return blk(x), None
        h, keep = branch(blk.stochastic_depth, blk.layer_scale * blk.block(x))
        return h + x, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is not CNBlock:
            return path_of(list(blk)), None  # the downsampling: no shortcut, its windows aggregate
        return path_of([blk.block[0]]), ()

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.classifier(m.avgpool(x))  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The head's norm (per position) and linear on every final position ``(b, h*w, classes)``."""
        m: Any = self.model
        return m.classifier[2](rearrange(m.classifier[0](x), "b c h w -> b (h w) c"))  # type: ignore[no-any-return]


def tiny_tv_convnext(num_classes: int = 10, **kwargs: Any) -> ConvNeXt:
    """A seeded torchvision ConvNeXt for 32x32 images (grids 8, 4, 2, 1), widths 8 to 32, one block a stage."""
    torch.manual_seed(0)
    settings = [CNBlockConfig(8, 16, 1), CNBlockConfig(16, 24, 1), CNBlockConfig(24, 32, 1), CNBlockConfig(32, None, 1)]
    return ConvNeXt(settings, num_classes=num_classes, **{"layer_scale": 1.0, **kwargs})


FAMILY = Family(
    name="tv_convnext",
    description=TV_CONVNEXT_FAMILY,
    refusal=AdaptedTvConvNeXt.refusal,
    build=AdaptedTvConvNeXt,
    example=tiny_tv_convnext,
    timm_modules=(),
    torchvision_builders=BUILDERS,
)
