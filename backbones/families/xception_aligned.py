"""Adapter for timm's aligned Xception (``xception41/65/71`` and the pre-activation ``xception41p/65p``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on XceptionAligned's parts; a
block's shortcut follows ``resnet``'s rule; the head (a ``ClassifierHead``) is read as ``resnetv2``'s. Units after
the stem, in order: every Xception block (one layer each where it has a skip), then the final activation
(pre-activation models; a channel op):

- the stem (a 3x3 stride-2 conv, then a stride-1 3x3 conv, with their norms and activations) starts from the pixels:
  the strided conv aggregates over its windows, the stride-1 conv mixes by its kernel (a MixToken map starts on the
  stem's grid);
- a block's branch is three separable convs (``SeparableConv2d``: depthwise kxk, norm, activation, pointwise 1x1,
  norm, activation; ``PreSeparableConv2d``: norm-activation, depthwise, pointwise), activations before them where
  ``start_with_relu``: each stride-1 depthwise conv mixes labels by its channel-averaged normalised |kernel|
  (border-renormalised, dilated where ``output_stride`` < 32), the last one, where strided, aggregates over its
  windows; the rest are channel ops;
- its shortcut (as ``resnet``'s): the identity, or a 1x1 conv (its norm: labels kept); a strided one aggregates over
  its windows (a 1x1 stride-2 conv reads one position of each 2x2 cell, so it carries that position's labels); then
  ``residual(layer, keep, mixed=P Y)`` with ``Y = labels_for(layer)`` before the shortcut and timm's drop-path draw;
  a pre-activation block's norm, which the branch and the shortcut both read, is a channel op;
- a block without skip (``no_skip``, the last one) forms every position from its windows: its path ``aggregate``\\ s,
  aligned layer or not (not a layer: no residual);
- readout: ``pool("mean", 0)`` (the ``ClassifierHead``'s global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers.drop import DropPath
from timm.models.xception_aligned import PreSeparableConv2d, PreXceptionModule, SeparableConv2d, XceptionAligned, XceptionModule
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family
from mixlabels.backbones.families.resnetv2 import AdaptedResNetV2, head_refusal

__all__ = ["AdaptedXceptionAligned", "XCEPTION_ALIGNED_FAMILY", "xception_aligned_refusal", "tiny_xception"]

XCEPTION_ALIGNED_FAMILY = (
    "timm aligned Xception (xception41/65/71, pre-activation xception41p/65p): every position a token; a block's "
    "separable convs' depthwise kxk convs mix labels by the channel-averaged normalised |kernel| (border-renormalised), "
    "a strided one aggregates over its windows; pointwise convs, norms and activations as channel ops; the shortcut "
    "keeps (1x1 conv) or aggregates (strided 1x1 conv) the labels and the branch's join by the residual rule; a block "
    "without skip aggregates; stem from the pixels; global average pooling; stochastic depth"
)

_BLOCKS = (XceptionModule, PreXceptionModule)


def _stack_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in the order of timm's ``forward``: each separable conv's ops in turn (a pre-activation
    block's own norm, read by the shortcut too, left out: a channel op the refusal checks apart)."""
    mods: list[nn.Module] = []
    for child in blk.stack:
        if type(child) is SeparableConv2d:
            mods += [child.conv_dw, child.bn_dw, child.act_dw, child.conv_pw, child.bn_pw, child.act_pw]
        elif type(child) is PreSeparableConv2d:
            mods += [child.norm, child.conv_dw, child.conv_pw]
        else:
            mods.append(child)  # an activation (start_with_relu), else refused by path_refusal
    return mods


def _skips(blk: Any) -> bool:
    return isinstance(blk, _BLOCKS) and not blk.no_skip


def _block_refusal(blk: nn.Module, where: str) -> str | None:
    if type(blk) not in _BLOCKS:
        return f"{where} is {type(blk).__name__}, not timm's XceptionModule or PreXceptionModule"
    b: Any = blk
    if b.drop_path is not None and type(b.drop_path) is not DropPath:
        return f"{where}'s drop_path is {type(b.drop_path).__name__}, not timm's DropPath"
    why = path_refusal([b.norm] if type(b) is PreXceptionModule else [], f"{where}'s norm")
    return why or path_refusal(_stack_modules(b), f"{where}'s branch") or path_refusal(conv_norm_act_ops(b.shortcut), f"{where}'s shortcut")


def xception_aligned_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm aligned Xception this adapter carries labels through (``None``: it is)."""
    if type(model) is not XceptionAligned:
        return f"{type(model).__name__} is not a timm XceptionAligned"
    m: Any = model
    why = head_refusal(m.head) or path_refusal(conv_norm_act_ops(m.stem), "the stem") or path_refusal([m.act], "the final act")
    for i, blk in enumerate(m.blocks):
        why = why or _block_refusal(blk, f"block {i}")
    return why


class AdaptedXceptionAligned(AdaptedConvNet):
    """A timm aligned Xception returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = XCEPTION_ALIGNED_FAMILY
    refusal = staticmethod(xception_aligned_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return conv_norm_act_ops(m.stem)

    def _blocks(self) -> list[nn.Module]:
        m: Any = self.model
        return [*m.blocks, m.act]  # the final activation: a unit of channel ops

    def _is_layer(self, blk: Any) -> bool:
        return _skips(blk)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block forward with the drop-path draw exposed (a block without skip, the final act: themselves)."""
        if not _skips(blk):
            return blk(x), None
        if type(blk) is PreXceptionModule:
            x = blk.norm(x)  # the branch and the shortcut read the normalised map
        h = blk.stack(x)
        shortcut = x if blk.shortcut is None else blk.shortcut(x)
        h, keep = branch(blk.drop_path, h) if blk.drop_path is not None else (h, None)
        return h + shortcut, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if not isinstance(blk, _BLOCKS):
            return (), None  # the final activation
        return path_of(_stack_modules(blk)), (path_of(conv_norm_act_ops(blk.shortcut)) if _skips(blk) else None)

    # the head is a timm ClassifierHead, as ResNetV2's: its readout and its classifier on every position
    _logits = AdaptedResNetV2._logits
    _position_logits = AdaptedResNetV2._position_logits


def tiny_xception(num_classes: int = 10, preact: bool = False, **kwargs: Any) -> XceptionAligned:
    """A seeded aligned Xception for 32x32 images (timm's stem, then grids 16, 8, 8, 4, 2, 2): strided blocks with a
    strided 1x1 conv shortcut, an identity shortcut, and the last block without skip, as ``xception41`` (or
    ``xception41p`` with ``preact``). ``kwargs`` go to ``XceptionAligned`` (``output_stride``, ``drop_path_rate``, ...);
    the block config is built per call: timm's constructor writes into it."""
    torch.manual_seed(0)
    last: dict[str, Any] = {"no_skip": True} if preact else {"no_skip": True, "start_with_relu": False}
    block_cfg: list[dict[str, Any]] = [
        dict(in_chs=64, out_chs=16, stride=2),
        dict(in_chs=16, out_chs=16, stride=1),
        dict(in_chs=16, out_chs=(16, 24, 24), stride=2),
        dict(in_chs=24, out_chs=32, stride=2),
        dict(in_chs=32, out_chs=(32, 32, 48), stride=1, **last),
    ]
    return XceptionAligned(block_cfg, num_classes=num_classes, preact=preact, **kwargs)


FAMILY = Family(
    name="xception_aligned",
    description=XCEPTION_ALIGNED_FAMILY,
    refusal=AdaptedXceptionAligned.refusal,
    build=AdaptedXceptionAligned,
    example=tiny_xception,
    timm_modules=("xception_aligned",),
    speed_model="xception41",
)
