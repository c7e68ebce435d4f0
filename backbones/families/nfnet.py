"""Adapter for timm's NormFreeNet (NFNet-F, NFNet-L, ECA-NFNet, NF-RegNet, NF-ResNet, NF-SE/ECA-ResNet); it takes
``resnetv2``'s head check and per-position head.

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on NormFreeNet's blocks. Events per
``NormFreeBlock`` ``layer`` (blocks counted over the four stages):

- the branch (activation scaled by ``beta``, 1x1, 3x3 (grouped; strided in a stage's first block), the extra 3x3 of
  NFNet-F, squeeze-excite or ECA (mid-branch for NF-RegNet, ``attn_last`` for the others), 1x1): a stride-1 3x3
  conv mixes labels by its (out, in)-averaged normalised |kernel| (border-renormalised), read from the standardised
  weight its forward convolves with (``ScaledStdConv2d``: ``backbones._common.effective_weight``); a strided one
  aggregates over its windows; 1x1 convs, activations, the channel gates and the scalar gains (``beta``,
  ``attn_gain``, ``skipinit_gain``, ``alpha``) are channel ops;
- the shortcut: the identity keeps the labels; ``DownsampleAvg`` (ceil-mode 2x2 average pool where the stage
  downsamples, then a 1x1 conv, on the pre-activated input: a channel op away, the same labels) aggregates over its
  windows; ``residual(layer, keep, mixed=P Y)`` with ``Y = labels_for(layer)`` and the drop-path draw;
- the stem (3x3 or 7x7 stride-2 conv, the 7x7 then a max pool, or the deep stems' strided and stride-1 3x3 convs)
  aggregates from the pixel grid (a MixToken map starts on its grid);
- ``final_conv`` (1x1) and ``final_act`` are channel ops; readout ``pool("mean", 0)`` (global average pooling,
  then the linear classifier; no class token: TransMix refuses).

TF-'same' padded models (``dm_nfnet_*``: ``ScaledStdConv2dSame``): a stride-1 conv with an odd kernel is padded
statically (symmetric: the same rule), a strided one pads each input by its size, its windows resolved on the grid
it gets (``_convnet.Window(..., same=True)``, as ``Conv2dSame``).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from timm.layers.drop import DropPath
from timm.models.nfnet import DownsampleAvg, GammaAct, NfCfg, NormFreeBlock, NormFreeNet
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import CHANNEL_GATES, AdaptedConvNet, Path, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.resnetv2 import head_per_position, head_refusal

__all__ = ["AdaptedNFNet", "NFNET_FAMILY", "nfnet_refusal"]

NFNET_FAMILY = (
    "timm NormFreeNet (NFNet-F/L, DM-NFNet-F with TF 'same' padding, ECA-NFNet, NF-RegNet, NF-ResNet, NF-SE/ECA-ResNet): "
    "every position a token; stride-1 kxk convs mix labels by the (out, in)-averaged normalised |kernel| of the "
    "scaled standardised weight the forward uses (border-renormalised); strided convs ('same'-padded ones on the "
    "windows their padding gives each grid) and pools aggregate over their windows; 1x1 convs, activations, SE/ECA and scalar gains as channel ops; a block's "
    "shortcut keeps (or aggregates) the labels and its branch's labels join by the residual rule; stem from the "
    "pixels; global average pooling; stochastic depth"
)

_GATES: tuple[type[nn.Module], ...] = (GammaAct, *CHANNEL_GATES)
"""NFNet's activation times a constant (``gamma_in_act``) acts on each position's channels, as the gates do."""


def _flat(module: nn.Module | None) -> list[nn.Module]:
    if module is None:
        return []
    return list(module.children()) if type(module) in (nn.Sequential, DownsampleAvg) else [module]


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in timm's ``forward`` order, after ``act1`` (whose output a downsampling shortcut reads
    too) and before drop-path, ``skipinit_gain`` and the sum; the attention gates scaled by ``attn_gain``."""
    mods = [blk.conv1, blk.act2, blk.conv2, blk.act2b, blk.conv2b, blk.attn, blk.act3, blk.conv3, blk.attn_last]
    return [mod for mod in mods if mod is not None]


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in m.stages for blk in stage]


def nfnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm NormFreeNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not NormFreeNet:
        return f"{type(model).__name__} is not a timm NormFreeNet"
    m: Any = model
    why = head_refusal(m.head) or path_refusal(_flat(m.stem), "the stem", _GATES)
    why = why or path_refusal([m.final_conv, m.final_act], "the final conv", _GATES)
    if why is not None:
        return why
    for i, stage in enumerate(m.stages):
        if type(stage) is not nn.Sequential:
            return f"stage {i} is {type(stage).__name__}; only an nn.Sequential of NormFreeBlocks is supported"
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) is not NormFreeBlock:
            return f"{where} is {type(blk).__name__}; only timm's NormFreeBlock is supported"
        if type(blk.drop_path) not in (DropPath, nn.Identity):
            return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
        if blk.downsample is not None and type(blk.downsample) is not DownsampleAvg:
            return f"{where}'s shortcut is {type(blk.downsample).__name__}; only NFNet's DownsampleAvg is supported"
        why = path_refusal([blk.act1, *_branch_modules(blk)], f"{where}'s branch", _GATES)
        why = why or path_refusal(_flat(blk.downsample), f"{where}'s shortcut", _GATES)
        if why is not None:
            return why
    return None


class AdaptedNFNet(AdaptedConvNet):
    """A timm NormFreeNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = NFNET_FAMILY
    refusal = staticmethod(nfnet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return _flat(m.stem)

    def _blocks(self) -> list[nn.Module]:
        m: Any = self.model
        return [*_blocks(m), m.final_conv, m.final_act]  # the last two: units of channel ops (a 1x1 conv or none)

    def _is_layer(self, blk: Any) -> bool:
        return isinstance(blk, NormFreeBlock)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block forward with the drop-path draw exposed: the output and who kept the branch."""
        if not self._is_layer(blk):
            return blk(x), None
        h = blk.act1(x) * blk.beta
        shortcut = x if blk.downsample is None else blk.downsample(h)  # from the pre-activated input
        h = blk.conv2(blk.act2(blk.conv1(h)))
        if blk.conv2b is not None:
            h = blk.conv2b(blk.act2b(h))
        if blk.attn is not None:
            h = blk.attn_gain * blk.attn(h)
        h = blk.conv3(blk.act3(h))
        if blk.attn_last is not None:
            h = blk.attn_gain * blk.attn_last(h)
        h, keep = branch(blk.drop_path, h)
        if blk.skipinit_gain is not None:
            h = h * blk.skipinit_gain  # timm multiplies in place: the same product
        return h * blk.alpha + shortcut, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if not self._is_layer(blk):
            return path_of([blk]), None  # a 1x1 final conv: no spatial op
        return path_of(_branch_modules(blk)), path_of(_flat(blk.downsample))

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return head_per_position(m.head, x)


def tiny_cfg(**overrides: Any) -> NfCfg:
    """NFNet-F's layout, small for 32x32 images: the deep 'quad' stem to 8x8, stages of 1, 2, 1, 1 blocks to 8, 4, 2, 1
    (widths 8 to 32), grouped 3x3 convs and the extra 3x3, SE after the last conv, a 1x1 final conv."""
    base = NfCfg(depths=(1, 2, 1, 1), channels=(8, 16, 24, 32), stem_type="deep_quad", stem_chs=16, group_size=4,
                 bottle_ratio=0.5, extra_conv=True, num_features=48, attn_layer="se", attn_kwargs={"rd_ratio": 0.5},
                 act_layer="gelu")  # fmt: skip
    return NfCfg(**(vars(base) | overrides))


FAMILY = Family(
    name="nfnet",
    description=NFNET_FAMILY,
    refusal=AdaptedNFNet.refusal,
    build=AdaptedNFNet,
    example=tiny(NormFreeNet, cfg=tiny_cfg()),
    timm_modules=("nfnet",),
    speed_model="nf_regnet_b0",
)
