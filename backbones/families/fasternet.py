"""Adapter for timm's FasterNet (``fasternet_*``): partial-conv MLP blocks; builds on ``inception_next``'s
``partial_concat`` and ``stride_one_refusal``, and ``mambaout``'s stage walk (``_units``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on FasterNet's parts. Units after
the stem, in order: each stage's ``PatchMerging`` (not a layer; the first stage has none), then its ``MLPBlock``\\ s,
one layer each:

- the stem (``PatchEmbed``: a 4x4 stride-4 conv, its norm) starts from the pixels and aggregates over its windows (a
  MixToken map starts on the stem's grid);
- ``PatchMerging`` (a 2x2 stride-2 conv, its norm): ``aggregate`` over its windows;
- ``MLPBlock``: the partial conv (``Partial_conv3``, PConv) runs a stride-1 3x3 conv on the first ``dim // n_div``
  channels and leaves the others untouched, its split and concatenation a ``Parallel.concat`` weighed by channel
  count (the conv's labels by its channel-averaged normalised |kernel|, border-renormalised); the MLP (1x1 convs,
  norm, activation) and layer scale are channel ops; ``residual(layer, keep, mixed=P Y)`` with timm's drop-path draw.
  Its slicing forward (the conv's output written over the first channels of a copy) is the same map;
- readout: ``pool("mean", 0)`` (global average pooling, then the 1x1 ``conv_head``, activation and classifier on the
  pooled features; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from einops import rearrange
from timm.layers.drop import DropPath
from timm.models.fasternet import Block, FasterNet, MLPBlock, Partial_conv3, PatchEmbed, PatchMerging
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Path, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.inception_next import partial_concat, stride_one_refusal
from mixlabels.backbones.families.mambaout import _units

__all__ = ["AdaptedFasterNet", "FASTERNET_FAMILY", "fasternet_refusal"]

FASTERNET_FAMILY = (
    "timm FasterNet (fasternet_*): every position a token; the partial conv's 3x3 conv on the first channels and the "
    "untouched rest are concatenated, so their labels join weighed by channel count (the conv's by its "
    "channel-averaged normalised |kernel|, border-renormalised), then by the residual rule; 1x1 conv MLPs, norms, "
    "layer scale and activations as channel ops; strided patch embedding and merging convs aggregate over their "
    "windows; global average pooling (1x1 conv head); stochastic depth"
)


def _branch_path(blk: Any) -> Path:
    """``cat(conv(x1), x2)``, then the MLP's ops."""
    pconv = blk.spatial_mixing
    mixer = partial_concat([([pconv.partial_conv3], int(pconv.dim_conv3)), ([], int(pconv.dim_untouched))])
    return (*mixer, *path_of(list(blk.mlp)))


def _stem_modules(m: Any) -> list[nn.Module]:
    return [m.patch_embed.proj, m.patch_embed.norm]



def _block_refusal(blk: nn.Module, where: str) -> str | None:
    if type(blk) is not MLPBlock:
        return f"{where} is {type(blk).__name__}, not timm's FasterNet MLPBlock"
    b: Any = blk
    if not isinstance(b.drop_path, (DropPath, nn.Identity)):
        return f"{where}'s drop_path is {type(b.drop_path).__name__}, not timm's DropPath"
    if type(b.spatial_mixing) is not Partial_conv3:
        return f"{where}'s spatial_mixing is {type(b.spatial_mixing).__name__}, not timm's Partial_conv3"
    if not isinstance(b.mlp, nn.Sequential):
        return f"{where}'s mlp is {type(b.mlp).__name__}, not an nn.Sequential of 1x1 convs, norm and activation"
    why = path_refusal([b.spatial_mixing.partial_conv3], f"{where}'s partial conv") or path_refusal(list(b.mlp), f"{where}'s mlp")
    return why or stride_one_refusal(_branch_path(b), f"{where}'s branch")


def fasternet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm FasterNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not FasterNet:
        return f"{type(model).__name__} is not a timm FasterNet"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    why = path_refusal([m.conv_head, m.act], "the head")
    if why is not None or path_of([m.conv_head]):
        return why or f"the head's conv_head has kernel {tuple(m.conv_head.kernel_size)}: it runs on the pooled map, only a 1x1 stride-1 conv has a label readout"
    if type(m.patch_embed) is not PatchEmbed:
        return f"the stem is {type(m.patch_embed).__name__}, not timm's FasterNet PatchEmbed"
    why = path_refusal(_stem_modules(m), "the stem")
    for s, stage in enumerate(m.stages):
        if why is None and type(stage) is not Block:
            why = f"stage {s} is {type(stage).__name__}, not timm's FasterNet Block (stage)"
        if why is not None:
            return why
        ds = stage.downsample
        if not isinstance(ds, nn.Identity):
            why = (f"stage {s}'s downsample is {type(ds).__name__}, not timm's PatchMerging" if type(ds) is not PatchMerging
                   else path_refusal([ds.reduction, ds.norm], f"stage {s}'s downsample"))  # fmt: skip
        for i, blk in enumerate(stage.blocks):
            why = why or _block_refusal(blk, f"stage {s} block {i}")
    return why


class AdaptedFasterNet(AdaptedConvNet):
    """A timm FasterNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = FASTERNET_FAMILY
    refusal = staticmethod(fasternet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        return _stem_modules(self.model)

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is MLPBlock

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``MLPBlock.forward`` with the drop-path draw exposed; a ``PatchMerging`` as itself."""
        if type(blk) is not MLPBlock:
            return blk(x), None
        h = blk.mlp(blk.spatial_mixing(x))
        if blk.layer_scale is not None:
            h = blk.layer_scale.unsqueeze(-1).unsqueeze(-1) * h
        h, keep = branch(blk.drop_path, h)
        return x + h, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is MLPBlock:
            return _branch_path(blk), ()
        return path_of([blk.reduction]), None  # a patch merging aggregates

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The head on every final position ``(b, h*w, k)``: ``conv_head``, activation, dropout and classifier."""
        m: Any = self.model
        t = rearrange(m.act(m.conv_head(x)), "b c h w -> b (h w) c")
        return m.classifier(F.dropout(t, p=float(m.drop_rate), training=m.training) if m.drop_rate > 0.0 else t)  # type: ignore[no-any-return]


FAMILY = Family(
    name="fasternet",
    description=FASTERNET_FAMILY,
    refusal=AdaptedFasterNet.refusal,
    build=AdaptedFasterNet,
    example=tiny("fasternet_t0", embed_dim=8, depths=(1, 1, 2, 1), feature_dim=32),
    timm_modules=("fasternet",),
    speed_model="fasternet_t0",
)
