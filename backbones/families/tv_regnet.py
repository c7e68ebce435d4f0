"""Adapter for torchvision's RegNet class (regnet_y_400mf to regnet_y_128gf, regnet_x_400mf to regnet_x_32gf).

The rules and events of timm's RegNet family (``backbones.families.regnet``; the label rules of
``backbones._convnet``, both walks in its ``AdaptedConvNet``) on torchvision's modules; the head
is ``tv_resnet``'s (``avgpool``, flatten, ``fc``). Events per ``ResBottleneckBlock`` ``layer``
(blocks counted over the ``AnyStage``\\ s of ``trunk_output``):

- the branch ``f`` (``BottleneckTransform``: 1x1, grouped 3x3 (strided in a stage's first block),
  optional ``SqueezeExcitation`` (RegNetY), 1x1): the stride-1 grouped 3x3 mixes labels by its
  (out, in)-averaged normalised |kernel| (border-renormalised), a strided one aggregates over its
  windows; 1x1 convs, batch norms, activations and the squeeze-excite gates are channel ops;
- the shortcut: the identity, or ``proj`` (a 1x1 conv, stride 2 where the stage downsamples: it
  carries one position of each 2x2 cell; then a batch norm): ``aggregate(shortcut)`` then
  ``residual(layer, None, mixed=P_f Y)`` with ``Y = labels_for(layer)`` (torchvision's RegNet has
  no stochastic depth); the activation after the sum is a channel op;
- the stem (``SimpleStemIN``: 3x3 stride-2 conv, batch norm, ReLU) aggregates from the pixel grid
  (a MixToken map starts on its grid);
- readout: ``pool("mean", 0)`` (``avgpool`` to 1x1; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torchvision.models.regnet import AnyStage, BlockParams, RegNet, ResBottleneckBlock
from torchvision.ops.misc import SqueezeExcitation

from mixlabels.backbones._convnet import AdaptedConvNet, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.tv_resnet import AdaptedTvResNet, adaptive_avgpool_refusal

__all__ = ["AdaptedTvRegNet", "TV_REGNET_FAMILY", "tv_regnet_refusal", "tiny_block_params"]

TV_REGNET_FAMILY = (
    "torchvision RegNet (RegNetX/Y 400MF to 128GF): every position a token; the grouped stride-1 3x3 conv mixes labels "
    "by the (out, in)-averaged normalised |kernel| (border-renormalised); strided convs aggregate over their windows; "
    "1x1 convs, batch norms, activations and squeeze-excitation as channel ops; a block's shortcut keeps (or "
    "aggregates) the labels and its branch's labels join by the residual rule; stem from the pixels; global average "
    "pooling"
)

BUILDERS = tuple(f"regnet_y_{s}" for s in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf", "128gf")) + tuple(
    f"regnet_x_{s}" for s in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")
)


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in m.trunk_output for blk in stage]


def tv_regnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a torchvision RegNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not RegNet:
        return f"{type(model).__name__} is not a torchvision RegNet"
    m: Any = model
    why = adaptive_avgpool_refusal(m.avgpool, m.fc, "the head") or path_refusal(conv_norm_act_ops(m.stem), "the stem")
    if why is not None:
        return why
    for i, stage in enumerate(m.trunk_output):
        if type(stage) is not AnyStage:
            return f"stage {i} is {type(stage).__name__}; only torchvision's AnyStage is supported"
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) is not ResBottleneckBlock:
            return f"{where} is {type(blk).__name__}; only torchvision's ResBottleneckBlock is supported"
        branch = conv_norm_act_ops(blk.f) + [blk.activation]
        why = path_refusal(branch, f"{where}'s branch", (SqueezeExcitation,)) or path_refusal(conv_norm_act_ops(blk.proj), f"{where}'s shortcut")
        if why is not None:
            return why
    return None


class AdaptedTvRegNet(AdaptedConvNet):
    """A torchvision RegNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = TV_REGNET_FAMILY
    refusal = staticmethod(tv_regnet_refusal)
    _logits = AdaptedTvResNet._logits  # the same head: avgpool, flatten, fc
    _position_logits = AdaptedTvResNet._position_logits

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return conv_norm_act_ops(m.stem)

    def _blocks(self) -> list[nn.Module]:
        return _blocks(self.model)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """torchvision's block forward (no stochastic depth: every branch kept)."""
        return blk(x), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        return path_of(conv_norm_act_ops(blk.f)), path_of(conv_norm_act_ops(blk.proj))


def tiny_block_params(se_ratio: float | None = 0.25, strides: tuple[int, ...] = (2, 2, 2, 1)) -> BlockParams:
    """Four small stages for 32x32 images (the stem to 16x16): a stage of two blocks (an identity shortcut after
    the first), grouped 3x3 convs, squeeze-excitation (RegNetY; ``se_ratio=None``: RegNetX)."""
    return BlockParams(depths=[1, 2, 1, 1], widths=[8, 16, 24, 32], group_widths=[4, 4, 8, 8],
                       bottleneck_multipliers=[1.0] * 4, strides=list(strides), se_ratio=se_ratio)  # fmt: skip


FAMILY = Family(
    name="tv_regnet",
    description=TV_REGNET_FAMILY,
    refusal=AdaptedTvRegNet.refusal,
    build=AdaptedTvRegNet,
    example=tiny(RegNet, block_params=tiny_block_params(), stem_width=8),
    timm_modules=(),
    torchvision_builders=BUILDERS,
)
