"""Adapter for timm's EdgeNeXt (``edgenext_*``): ConvNeXt-like conv encoders and split depthwise transpose blocks.

A pooled CNN of blocks (``backbones._convnet.AdaptedConvNet``); the head's per-position logits are ``convnext``'s.
Events, ``layer`` counting the ``ConvBlock`` and ``SplitTransposeBlock`` units:

- the stem (``'patch'``: a 4x4 stride-4 conv; ``'overlap'``: 9x9 stride 4, padding 4) and every stage's
  downsampling conv (2x2 stride 2, after a per-position ``LayerNorm2d``): ``aggregate`` over their windows (the
  labels start on the pixels; a MixToken map on the stem's grid);
- ``ConvBlock``: ``x + f(x)`` with ``f`` its depthwise ``kxk`` conv (the conv rule: ``Norm(T(K)) Y``), then a norm,
  an MLP and layer scale (channel ops), as ConvNeXt's block. With ``downsample_block=True`` (or a change of width)
  the shortcut is taken after the conv: both sides carry the conv's labels (a strided conv: its windows);
- ``SplitTransposeBlock`` (SDTA): one residual whose branch splits the channels into ``scales`` groups chained as
  Res2Net's (``res2net``): group 0 through its 3x3 depthwise conv, group ``i > 0`` through its conv after adding
  group ``i - 1``'s output (``Parallel.sum``), the last passes; the concatenation weighs each group by its channel
  count (``Parallel.concat``). Then the Fourier positional encoding (added per position, independent of the
  content: no label moves), cross-covariance attention XCA in an inner residual (its softmax is over channels, a
  ``d x d`` map per head applied within every token: a channel op, as ``xcit``'s), the norm, MLP and layer scale:
  channel ops. The branch's labels are its groups' ``P Y``; the outer drop path (timm's second draw of the block's
  ``drop_path``) decides who kept it;
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``l`` label channels.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from timm.layers.classifier import ClassifierHead, NormMlpClassifierHead
from timm.layers.drop import DropPath
from timm.layers.mlp import Mlp
from timm.models.edgenext import ConvBlock, CrossCovarianceAttn, EdgeNeXt, EdgeNeXtStage, PositionalEncodingFourier, SplitTransposeBlock
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Parallel, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.convnext import _token_logits

__all__ = ["AdaptedEdgeNeXt", "EDGENEXT_FAMILY", "edgenext_refusal"]

EDGENEXT_FAMILY = (
    "timm EdgeNeXt (edgenext_*; 'patch' or 'overlap' stem and strided downsampling as aggregation; conv encoders' "
    "depthwise conv as normalised-absolute-kernel spatial mix; SDTA's split depthwise convs chained Res2Net-style "
    "as joined branches, its positional encoding per position and cross-covariance attention as channel ops; MLPs "
    "and layer scale as channel ops; global average pooling; stochastic depth)"
)


def _groups(blk: Any) -> list[int]:
    """The channel counts of an SDTA block's split (``Tensor.chunk``'s: ``ceil(c / n)`` each, the rest last)."""
    c, n = int(blk.norm_xca.normalized_shape[0]), len(blk.convs) + 1
    size = math.ceil(c / n)
    return [min(size, c - i * size) for i in range(n) if c - i * size > 0]


def _channel_refusal(blk: Any, where: str) -> str | None:
    """Why a block's per-position parts (norm, MLP, drop path) are not channel ops (``None``: they are)."""
    if not isinstance(blk.norm, nn.LayerNorm) or type(blk.mlp) is not Mlp:
        return f"{where}'s norm or MLP is {type(blk.norm).__name__}, {type(blk.mlp).__name__}; only nn.LayerNorm and timm's Mlp"
    if not isinstance(blk.drop_path, (nn.Identity, DropPath)):
        return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
    return None


def _block_refusal(blk: Any, where: str) -> str | None:
    if type(blk) is ConvBlock:
        return _channel_refusal(blk, where) or path_refusal([blk.conv_dw], f"{where}'s conv_dw")
    if type(blk) is not SplitTransposeBlock:
        return f"{where} is {type(blk).__name__}; only EdgeNeXt's ConvBlock and SplitTransposeBlock have rules here"
    if type(blk.xca) is not CrossCovarianceAttn:
        return f"{where}'s xca is {type(blk.xca).__name__}, not timm's CrossCovarianceAttn (a channel op)"
    if blk.pos_embd is not None and type(blk.pos_embd) is not PositionalEncodingFourier:
        return f"{where}'s positional encoding is {type(blk.pos_embd).__name__}; only PositionalEncodingFourier (added per position)"
    if not isinstance(blk.norm_xca, nn.LayerNorm):
        return f"{where}'s norm_xca is {type(blk.norm_xca).__name__}; only nn.LayerNorm (per position)"
    if len(_groups(blk)) != len(blk.convs) + 1:
        return f"{where} splits {blk.norm_xca.normalized_shape[0]} channels into fewer than {len(blk.convs) + 1} groups"
    why = _channel_refusal(blk, where)
    for i, conv in enumerate(blk.convs):
        why = why or path_refusal([conv], f"{where}'s split conv {i}")
        if why is None and conv.stride != (1, 1):
            why = f"{where}'s split conv {i} is strided; the split groups must keep the grid"
    return why


def edgenext_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be adapted as an EdgeNeXt (``None`` if it can)."""
    if type(model) is not EdgeNeXt:
        return f"{type(model).__name__} is not a timm EdgeNeXt"
    m: Any = model
    if type(m.head) not in (NormMlpClassifierHead, ClassifierHead) or m.head.global_pool.pool_type != "avg":
        return "only the classifier head with global average pooling ('avg') has a label readout"
    why = path_refusal(list(m.stem), "the stem")
    for i, stage in enumerate(m.stages):
        if why is not None:
            return why
        if type(stage) is not EdgeNeXtStage:
            return f"stage {i} is {type(stage).__name__}, not timm's EdgeNeXtStage"
        why = path_refusal(conv_norm_act_ops(stage.downsample), f"stage {i}'s downsampling")
        for j, blk in enumerate(stage.blocks):
            why = why or _block_refusal(blk, f"stage {i} block {j}")
    return why


def _conv_block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's ``ConvBlock.forward`` with the branch's drop-path draw exposed: the output and who kept the branch."""
    shortcut = x
    x = blk.conv_dw(x)
    if blk.shortcut_after_dw:
        shortcut = x
    x = blk.mlp(blk.norm(rearrange(x, "b c h w -> b h w c")))
    if blk.gamma is not None:
        x = blk.gamma * x
    out, keep = branch(blk.drop_path, rearrange(x, "b h w c -> b c h w"))
    return shortcut + out, keep


def _sdta_block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's ``SplitTransposeBlock.forward`` (both draws of its drop path in order), and who kept the outer branch."""
    shortcut = x
    spx = x.chunk(len(blk.convs) + 1, dim=1)
    spo, sp = [], spx[0]
    for i, conv in enumerate(blk.convs):
        sp = conv(sp if i == 0 else sp + spx[i])
        spo.append(sp)
    spo.append(spx[-1])
    x = torch.cat(spo, 1)
    b, _, h, w = x.shape
    t = rearrange(x, "b c h w -> b (h w) c")
    if blk.pos_embd is not None:  # a per-position additive term
        t = t + rearrange(blk.pos_embd((b, h, w)), "b c h w -> b (h w) c")
    t = t + branch(blk.drop_path, blk.gamma_xca * blk.xca(blk.norm_xca(t)))[0]  # XCA: channels within each position
    t = blk.mlp(blk.norm(rearrange(t, "b (h w) c -> b h w c", h=h)))
    if blk.gamma is not None:
        t = blk.gamma * t
    out, keep = branch(blk.drop_path, rearrange(t, "b h w c -> b c h w"))
    return shortcut + out, keep


def _sdta_paths(blk: Any) -> Path:
    """The SDTA branch's spatial ops: its split groups chained (Res2Net's) and concatenated by channel count."""
    groups: list[Path] = []
    for i, conv in enumerate(blk.convs):
        own = path_of([conv])
        groups.append(own if i == 0 else (Parallel.sum([groups[-1], ()]), *own))
    groups.append(())
    return (Parallel.concat(groups, _groups(blk)),)


class AdaptedEdgeNeXt(AdaptedConvNet):
    """A timm EdgeNeXt returning the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = EDGENEXT_FAMILY
    refusal = staticmethod(edgenext_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return list(m.stem)

    def _blocks(self) -> list[nn.Module]:
        m: Any = self.model
        units: list[nn.Module] = []
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                units.append(stage.downsample)
            units.extend(stage.blocks)
        return units

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) in (ConvBlock, SplitTransposeBlock)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        if type(blk) is ConvBlock:
            return _conv_block(blk, x)
        if type(blk) is SplitTransposeBlock:
            return _sdta_block(blk, x)
        return blk(x), None  # a stage's downsampling

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is ConvBlock:
            conv = path_of([blk.conv_dw])
            return conv, (conv if blk.shortcut_after_dw else ())
        if type(blk) is SplitTransposeBlock:
            return _sdta_paths(blk), ()
        return path_of(conv_norm_act_ops(blk)), None  # no shortcut: the windows aggregate

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(m.norm_pre(x))  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return _token_logits(m, m.norm_pre(x))


FAMILY = Family(
    name="edgenext",
    description=EDGENEXT_FAMILY,
    refusal=edgenext_refusal,
    build=AdaptedEdgeNeXt,
    example=tiny("edgenext_xx_small", dims=(8, 16, 24, 32), depths=(1, 1, 2, 1), heads=(2, 2, 2, 2)),
    timm_modules=("edgenext",),
    speed_model="edgenext_xx_small",
)
