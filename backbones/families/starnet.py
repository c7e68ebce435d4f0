"""Adapter for timm's StarNet (``starnet_*``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on StarNet's parts.
Events, ``layer`` counting every ``Block``:

- the stem (a 3x3 stride-2 ``ConvBN``, then the activation): the labels start on the pixels and
  aggregate over its windows (a MixToken map starts on the stem's grid);
- each stage's downsampler (a 3x3 stride-2 ``ConvBN``, no shortcut): ``aggregate`` over its windows;
- ``Block``: depthwise 7x7 conv with its norm, two 1x1 branches ``f1``, ``f2`` multiplied position by
  position (the "star": ``act(f1(x)) * f2(x)`` combines channels at one position, a channel op),
  the 1x1 ``g`` with its norm, a depthwise 7x7 conv: the two depthwise convs mix labels in turn by
  their channel-averaged normalised |kernel| (border-renormalised), then ``residual(layer, keep,
  mixed=P Y)`` with timm's drop-path draw;
- the final batch norm is a channel op; readout: ``pool("mean", 0)`` (global average pooling; no
  class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from einops import rearrange
from timm.layers.drop import DropPath
from timm.models.starnet import Block, StarNet
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedStarNet", "STARNET_FAMILY", "starnet_refusal"]

STARNET_FAMILY = (
    "timm StarNet (starnet_*): every position a token; a block's two depthwise 7x7 convs mix labels in turn by the "
    "channel-averaged normalised |kernel| (border-renormalised) and its labels join by the residual rule; the star "
    "(elementwise product of two 1x1 branches), 1x1 convs, batch norms and activations as channel ops; strided stem "
    "and downsampling convs aggregate over their windows; global average pooling; stochastic depth"
)


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in timm's ``forward`` order; ``f1`` and ``f2`` run side by side on one input and meet in
    a product, which the refusal allows only for channel ops (then their order here is immaterial)."""
    return [*conv_norm_act_ops(blk.dwconv), *conv_norm_act_ops(blk.f1), *conv_norm_act_ops(blk.f2), blk.act,
            *conv_norm_act_ops(blk.g), *conv_norm_act_ops(blk.dwconv2)]  # fmt: skip


def _units(m: Any) -> list[nn.Module]:
    """Every unit after the stem: each stage's downsampler and blocks, then the final norm."""
    return [unit for stage in m.stages for unit in stage] + [m.norm]


def starnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm StarNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not StarNet:
        return f"{type(model).__name__} is not a timm StarNet"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    why = path_refusal(conv_norm_act_ops(m.stem), "the stem") or path_refusal([m.norm], "the final norm")
    for i, stage in enumerate(m.stages):
        for j, unit in enumerate(stage):
            where = f"stage {i} block {j - 1}" if j else f"stage {i}'s downsampler"
            if why is not None:
                return why
            if j == 0:
                why = path_refusal(conv_norm_act_ops(unit), where)
            elif type(unit) is not Block:
                why = f"{where} is {type(unit).__name__}, not timm's StarNet Block"
            elif not isinstance(unit.drop_path, (DropPath, nn.Identity)):
                why = f"{where}'s drop_path is {type(unit.drop_path).__name__}, not timm's DropPath"
            else:
                why = path_refusal(_branch_modules(unit), f"{where}'s branch")
                star = conv_norm_act_ops(unit.f1) + conv_norm_act_ops(unit.f2) + conv_norm_act_ops(unit.g)
                if why is None and path_of(star):
                    why = f"{where}'s f1, f2 or g mixes positions: the star's branches must be 1x1 stride-1 convs"
    return why


class AdaptedStarNet(AdaptedConvNet):
    """A timm StarNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = STARNET_FAMILY
    refusal = staticmethod(starnet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return conv_norm_act_ops(m.stem)

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is Block

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``Block.forward`` with the drop-path draw exposed; a downsampler or the norm as itself."""
        if type(blk) is not Block:
            return blk(x), None
        h = blk.dwconv(x)
        h = blk.act(blk.f1(h)) * blk.f2(h)  # the star: channels combined at each position
        h, keep = branch(blk.drop_path, blk.dwconv2(blk.g(h)))
        return x + h, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is Block:
            return path_of(_branch_modules(blk)), ()
        return path_of(conv_norm_act_ops(blk)), None  # a downsampler's windows aggregate; the norm: none

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The classifier on every final position ``(b, h*w, k)`` (timm's head without the pooling)."""
        m: Any = self.model
        t = F.dropout(rearrange(x, "b c h w -> b (h w) c"), p=m.drop_rate, training=m.training)
        return m.head(t)  # type: ignore[no-any-return]


FAMILY = Family(
    name="starnet",
    description=STARNET_FAMILY,
    refusal=AdaptedStarNet.refusal,
    build=AdaptedStarNet,
    example=tiny(StarNet, base_dim=8, depths=[1, 2, 1], mlp_ratio=2),
    timm_modules=("starnet",),
    speed_model="starnet_s050",
)
