"""Adapter for timm's MambaOut (``mambaout_*``): channels-last gated CNN blocks.

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on MambaOut's parts; the maps
stay channels-last ``(b, h, w, c)`` as timm keeps them. Units after the stem, in order: each stage's downsampler
(not a layer), then its ``GatedConvBlock``\\ s, one layer each:

- the stem (two 3x3 stride-2 convs, each with its LayerNorm) starts from the pixels and aggregates over its
  windows (a MixToken map starts on the stem's grid);
- a downsampler (a 3x3 stride-2 conv, its LayerNorm before or after): ``aggregate`` over its windows;
- ``GatedConvBlock``: LayerNorm, ``fc1`` to ``(g, i, c)`` at each position, a stride-1 depthwise conv on ``c``
  only, ``act(g) * cat(i, c)``, ``fc2``, layer scale. The concatenation is ``Parallel.concat`` weighed by channel
  count: ``i`` (the identity, ``hidden - conv_channels`` channels) and ``c`` through the conv (its
  channel-averaged normalised |kernel|, border-renormalised); the gate multiplies each position's channels by
  values computed at that position (as StarNet's star): a channel op. Then ``residual(layer, keep, mixed=P Y)``
  with timm's drop-path draw;
- readout: ``pool("mean", 0)`` (the head's average pooling comes first, then its norm and MLP; no class token:
  TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from timm.layers.classifier import ClNormMlpClassifierHead
from timm.layers.drop import DropPath
from timm.layers.layer_scale import LayerScale
from timm.models.mambaout import Downsample, DownsampleNormFirst, GatedConvBlock, MambaOut, MlpHead, Stem
from torch import Tensor, nn

from mixlabels import TokenLabelMap
from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Parallel, Path, path_of, path_refusal, run_stem
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedMambaOut", "MAMBAOUT_FAMILY", "mambaout_refusal"]

MAMBAOUT_FAMILY = (
    "timm MambaOut (mambaout_*): every position a token; a gated conv block's stride-1 depthwise conv on part of "
    "the channels, concatenated with the untouched part, joins labels weighed by channel count (the conv's labels "
    "by its channel-averaged normalised |kernel|, border-renormalised) and by the residual rule; the elementwise "
    "gate, linear layers, LayerNorms, layer scale and activations as channel ops; strided stem and downsampling "
    "convs aggregate over their windows; global average pooling (MLP head); stochastic depth"
)


def _stem_modules(stem: Any) -> list[nn.Module]:
    """timm's ``Stem.forward`` order: conv, its norm (optional), activation, conv, norm."""
    return [stem.conv1, *([stem.norm1] if stem.norm1 is not None else []), stem.act, stem.conv2, stem.norm2]


def _units(m: Any) -> list[nn.Module]:
    """Every unit after the stem: each stage's downsampler (an identity left out), then its blocks."""
    return [u for stage in m.stages for u in ([] if isinstance(stage.downsample, nn.Identity) else [stage.downsample]) + list(stage.blocks)]


def _gated_branch(blk: Any) -> Path:
    """``cat(i, conv(c))`` as ``Parallel`` branches weighed by their channel counts (``split_indices``)."""
    _, identity, conv = blk.split_indices
    return (Parallel.concat([(), path_of([blk.conv])], [int(identity), int(conv)]),)


def _head_refusal(head: nn.Module) -> str | None:
    if type(head) not in (MlpHead, ClNormMlpClassifierHead):
        return f"the head is {type(head).__name__}, not timm's MlpHead or ClNormMlpClassifierHead"
    h: Any = head
    if h.pool_type != "avg":
        return f"the head's pool_type={h.pool_type!r} has no label readout; use 'avg'"
    return None


def _block_refusal(blk: nn.Module, where: str) -> str | None:
    if type(blk) is not GatedConvBlock:
        return f"{where} is {type(blk).__name__}, not timm's GatedConvBlock"
    b: Any = blk
    if not isinstance(b.drop_path, (DropPath, nn.Identity)):
        return f"{where}'s drop_path is {type(b.drop_path).__name__}, not timm's DropPath"
    if not isinstance(b.ls, (LayerScale, nn.Identity)):
        return f"{where}'s ls is {type(b.ls).__name__}, not timm's LayerScale"
    if not isinstance(b.fc1, nn.Linear) or not isinstance(b.fc2, nn.Linear):
        return f"{where}'s fc1 or fc2 is not an nn.Linear (a per-position channel map)"
    why = path_refusal([b.norm, b.act, b.conv], f"{where}'s")
    if why is None and b.conv.stride != (1, 1):
        why = f"{where}'s conv has stride {tuple(b.conv.stride)}: the gate needs it on the block's grid (stride 1)"
    return why


def mambaout_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm MambaOut this adapter carries labels through (``None``: it is)."""
    if type(model) is not MambaOut:
        return f"{type(model).__name__} is not a timm MambaOut"
    m: Any = model
    if type(m.stem) is not Stem:
        return f"the stem is {type(m.stem).__name__}, not timm's MambaOut Stem"
    why = _head_refusal(m.head) or path_refusal(_stem_modules(m.stem), "the stem")
    for s, stage in enumerate(m.stages):
        ds = stage.downsample
        if why is None and not isinstance(ds, nn.Identity):
            if type(ds) not in (Downsample, DownsampleNormFirst):
                why = f"stage {s}'s downsampler is {type(ds).__name__}, not timm's Downsample or DownsampleNormFirst"
            else:
                why = path_refusal([ds.norm, ds.conv], f"stage {s}'s downsampler")
        for i, blk in enumerate(stage.blocks):
            why = why or _block_refusal(blk, f"stage {s} block {i}")
    return why


class AdaptedMambaOut(AdaptedConvNet):
    """A timm MambaOut returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = MAMBAOUT_FAMILY
    refusal = staticmethod(mambaout_refusal)

    def _stem(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
        """timm's stem, its channels-last output seen channels-first by ``run_stem`` (which reads the grid from
        ``(b, c, h, w)``), MixToken applied there; the map handed on channels-last again."""
        m: Any = self.model
        path = path_of(_stem_modules(m.stem))

        def run(images: Tensor) -> Tensor:
            out: Tensor = m.stem(images)  # b h w c
            return rearrange(out, "b h w c -> b c h w")

        x, grid, start = run_stem(run, path, images, label_map)
        return rearrange(x, "b c h w -> b h w c"), path, grid, start

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is GatedConvBlock

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``GatedConvBlock.forward`` with the drop-path draw exposed; a downsampler as itself."""
        if type(blk) is not GatedConvBlock:
            return blk(x), None
        g, i, c = torch.split(blk.fc1(blk.norm(x)), list(blk.split_indices), dim=-1)  # b h w c
        c = rearrange(blk.conv(rearrange(c, "b h w c -> b c h w")), "b c h w -> b h w c")
        h = blk.ls(blk.fc2(blk.act(g) * torch.cat((i, c), dim=-1)))  # the gate: channels at one position
        h, keep = branch(blk.drop_path, h)
        return h + x, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is GatedConvBlock:
            return _gated_branch(blk), ()
        return path_of([blk.conv]), None  # a downsampler's windows aggregate

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The head on every final position ``(b, h*w, k)``: its norm, MLP, dropout and classifier, pooling left out."""
        head: Any = self.model.head
        drop = head.head_dropout if type(head) is MlpHead else head.drop
        t = rearrange(x, "b h w c -> b (h w) c")
        return head.fc(drop(head.pre_logits(head.norm(t))))  # type: ignore[no-any-return]


FAMILY = Family(
    name="mambaout",
    description=MAMBAOUT_FAMILY,
    refusal=AdaptedMambaOut.refusal,
    build=AdaptedMambaOut,
    example=tiny("mambaout_femto", depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), conv_ratio=0.5),
    timm_modules=("mambaout",),
    speed_model="mambaout_femto",
)
