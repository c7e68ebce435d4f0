"""Adapter for timm's ReXNet (``rexnet_*``, ``rexnetr_*``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on ReXNet's linear bottlenecks; the
stem and the head's readout are VoVNet's (``HeadedConvNet`` from ``families/vovnet.py``), the refusal's frame and
the branch's forward CspNet's (``headed_refusal``, ``run_branch`` from ``families/cspnet.py``).
Units after the stem, in order: every ``LinearBottleneck`` (one layer each), then the 1x1 ``ConvNormAct`` before
the head (a channel op):

- a bottleneck's branch: the 1x1 expansion, the depthwise 3x3 (stride 1: it mixes labels by its normalised
  |kernel|, border-renormalised, dilated where ``output_stride`` asks; strided: its windows), squeeze-excite (a
  channel gate, its norm on the pooled vector), ReLU6 and the 1x1 projection;
- a bottleneck without shortcut (strided, or narrowing) forms every position from its windows: it aggregates;
- a bottleneck with shortcut adds it to its first ``in_channels`` channels only
  (``x[:, :in] + shortcut``), the other ``out - in`` channels are the branch alone: the labels fork at the
  block's input, the first part joins the branch's labels by the residual rule (with drop path), and the join
  weighs the branch's own labels by the plain channels' share ``(out - in) / out``
  (``block_labels``' ``plain``; ``LabelTracker.join``). Stochastic depth drops the whole branch, the plain
  channels too (they are zeros then): a dropped sample keeps its labels under the drop rule;
- the stem (a 3x3 stride-2 ``ConvNormAct``) aggregates from the pixels (a MixToken map starts on its grid);
- readout: ``pool("mean", 0)``, timm's ``ClassifierHead`` with average pooling.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers.conv_bn_act import ConvNormAct
from timm.layers.drop import DropPath
from timm.models.rexnet import LinearBottleneck, RexNet
from torch import Tensor, nn

from mixlabels.backbones._convnet import Path, Window, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.cspnet import channel_refusal, headed_refusal, run_branch
from mixlabels.backbones.families.vovnet import HeadedConvNet

__all__ = ["AdaptedRexNet", "REXNET_FAMILY", "rexnet_refusal"]

REXNET_FAMILY = (
    "timm ReXNet (rexnet_*, rexnetr_*): every position a token; a linear bottleneck's stride-1 depthwise 3x3 mixes "
    "labels by its normalised |kernel| (border-renormalised), a strided one aggregates over its windows (the block "
    "has no shortcut); 1x1 convs, norms, activations, SE as channel ops; the shortcut adds to the first in_channels "
    "channels only: those join the branch's labels by the residual rule, the rest carry the branch alone, joined by "
    "their channel share (a fork and a join of the labels); stem from the pixels; global average pooling; "
    "stochastic depth"
)


def _branch(blk: Any) -> list[nn.Module]:
    """A ``LinearBottleneck``'s branch modules in the order of timm's ``forward``."""
    return [m for m in (blk.conv_exp, blk.conv_dw, blk.se, blk.act_dw, blk.conv_pwl) if m is not None]


def _branch_modules(blk: Any) -> list[nn.Module]:
    return [op for module in _branch(blk) for op in conv_norm_act_ops(module)]


def _units(m: Any) -> list[nn.Module]:
    return list(m.features)


def _unit_refusal(unit: Any, i: int) -> str | None:
    where = f"feature {i}"
    if type(unit) is ConvNormAct:  # the last feature: 1x1 to the head's width
        return channel_refusal(unit, where)
    if type(unit) is not LinearBottleneck:
        return f"{where} is {type(unit).__name__}; only timm's LinearBottleneck and the last 1x1 ConvNormAct are supported"
    if unit.drop_path is not None and not isinstance(unit.drop_path, DropPath):
        return f"{where}'s drop_path is {type(unit.drop_path).__name__}, not timm's DropPath"
    why = path_refusal(_branch_modules(unit), f"{where}'s branch")
    if why is None and unit.use_shortcut and any(isinstance(op, Window) for op in path_of(_branch_modules(unit))):
        why = f"{where} has a shortcut but its branch changes the grid; the shortcut's labels cannot join it"
    return why


def rexnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ReXNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not RexNet:
        return f"{type(model).__name__} is not a timm RexNet"
    m: Any = model
    return headed_refusal(m, _units(m), _unit_refusal)


class AdaptedRexNet(HeadedConvNet):
    """A timm ReXNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = REXNET_FAMILY
    refusal = staticmethod(rexnet_refusal)

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is LinearBottleneck

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``LinearBottleneck.forward`` with the drop-path draw exposed (the last 1x1 conv: itself)."""
        if type(blk) is not LinearBottleneck:
            return blk(x), None
        h, keep = run_branch(_branch(blk), blk.drop_path if blk.use_shortcut else None, x)
        if not blk.use_shortcut:
            return h, None
        return torch.cat([h[:, : blk.in_channels] + x, h[:, blk.in_channels :]], dim=1), keep  # the partial shortcut

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is not LinearBottleneck:
            return path_of(conv_norm_act_ops(blk)), None
        return path_of(_branch_modules(blk)), (() if blk.use_shortcut else None)

    def _plain(self, blk: Any) -> float:
        if type(blk) is not LinearBottleneck or not blk.use_shortcut:
            return 0.0
        return (int(blk.out_channels) - int(blk.in_channels)) / int(blk.out_channels)


TINY: dict[str, Any] = {"width_mult": 0.5, "depth_mult": 0.5, "initial_chs": 16, "final_chs": 48, "output_stride": 8}
"""Ten bottlenecks on a 32x32 image: grids 16 (stem), 16, 8, 4, then dilated (output_stride 8) at 4; five with a
partial shortcut, SE from the third stage on."""

FAMILY = Family(
    name="rexnet",
    description=REXNET_FAMILY,
    refusal=AdaptedRexNet.refusal,
    build=AdaptedRexNet,
    example=tiny(RexNet, **TINY, drop_path_rate=0.1),
    timm_modules=("rexnet",),
    speed_model="rexnet_100",
)
