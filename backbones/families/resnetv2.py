"""Adapter for timm's ResNetV2 (BiT, pre-activation ResNet-18/34/50/101/152 and their D/T variants); its head helper
serves ``nfnet`` too.

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on ResNetV2's blocks.
Events per block ``layer`` (blocks counted over the four stages):

- the branch (``PreActBasic``: norm-act, 3x3, norm-act, 3x3; ``PreActBottleneck``: norm-act, 1x1,
  norm-act, 3x3, norm-act, 1x1; ``Bottleneck``: 1x1, 3x3, 1x1 with norms): a stride-1 3x3 conv mixes
  labels by its (out, in)-averaged normalised |kernel| (border-renormalised), read from the
  standardised weight its forward convolves with (``StdConv2d``: ``backbones._common.effective_weight``);
  a strided one aggregates over its windows; 1x1 convs and the norms (batch, group, EvoNorm-S0, FRN:
  their statistics pool over the map, as a group norm's) are channel ops;
- the shortcut: the identity keeps the labels; ``DownsampleConv`` (a 1x1 conv, stride 2 where the
  stage downsamples: one position of each 2x2 cell) or ``DownsampleAvg`` (ceil-mode 2x2 average pool,
  then a 1x1 conv) aggregates over its windows. A pre-activation block takes it from the pre-activated
  input (a channel op away from the input: the same labels). ``residual(layer, keep, mixed=P Y)`` with
  ``Y = labels_for(layer)`` and the drop-path draw;
- the stem (7x7 stride-2 conv, or the deep/tiered 3x3 stride-2 then two 3x3 convs; then the 3x3
  stride-2 max pool) aggregates from the pixel grid (a MixToken map starts on its grid). BiT's
  'fixed' stem pads by a constant before an unpadded pool: padding adds no position, so the two are
  one window with that padding;
- the final norm is a channel op; readout ``pool("mean", 0)`` (global average pooling, then the 1x1
  conv classifier; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``k`` classes, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from einops import rearrange
from timm.layers.evo_norm import EvoNorm2dS0
from timm.layers.filter_response_norm import FilterResponseNormTlu2d
from timm.layers.norm_act import GroupNormAct
from timm.layers.std_conv import StdConv2d
from timm.layers.classifier import ClassifierHead
from timm.layers.drop import DropPath
from timm.models.resnetv2 import Bottleneck, DownsampleAvg, DownsampleConv, PreActBasic, PreActBottleneck, ResNetStage, ResNetV2
from torch import Tensor, nn

from mixlabels import Scheme, TokenLabelMap
from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Path, path_of, path_refusal, run_stem
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedResNetV2", "RESNETV2_FAMILY", "resnetv2_refusal", "head_refusal", "head_per_position"]

RESNETV2_FAMILY = (
    "timm ResNetV2 (BiT, pre-activation ResNetV2-18/34/50/101/152, D/T deep stems, conv or avg-pool shortcuts, "
    "weight-standardised convs, static padding): every position a token; stride-1 kxk convs mix labels by the "
    "(out, in)-averaged normalised |kernel| of the weight the forward uses (border-renormalised); strided convs and "
    "pools aggregate over their windows (BiT's constant pad then pool: one padded window); 1x1 convs, norms, "
    "activations as channel ops; a block's shortcut keeps (or aggregates) the labels and its branch's labels join by "
    "the residual rule; stem from the pixels; global average pooling; stochastic depth"
)

_BLOCKS = (PreActBasic, PreActBottleneck, Bottleneck)
_MAP_NORMS = (EvoNorm2dS0, FilterResponseNormTlu2d)
"""Norms whose statistics pool over the map (as a group norm's), then scale each position's channels: channel ops."""


def _flat(module: nn.Module | None) -> list[nn.Module]:
    if module is None:
        return []
    return list(module.children()) if type(module) in (nn.Sequential, DownsampleConv, DownsampleAvg) else [module]


def _stem_path_modules(stem: nn.Sequential) -> list[nn.Module]:
    """The stem's ops for its label path: BiT's ``ConstantPad2d(p)`` then an unpadded max pool is one pool of padding
    ``p`` (the padding adds no position; only the values, which labels do not read, differ)."""
    mods = list(stem.children())
    out: list[nn.Module] = []
    for i, mod in enumerate(mods):
        nxt: Any = mods[i + 1] if i + 1 < len(mods) else None
        if _folds(mod, nxt):
            pad: Any = mod
            out.append(nn.MaxPool2d(nxt.kernel_size, nxt.stride, padding=int(pad.padding[0]), ceil_mode=nxt.ceil_mode))
        elif not (i > 0 and _folds(mods[i - 1], mod)):
            out.append(mod)
    return out


def _folds(mod: nn.Module, nxt: Any) -> bool:
    """Whether ``mod`` is a symmetric constant pad that ``nxt``, an unpadded undilated max pool, takes as its padding."""
    pad: Any = mod
    return (
        type(mod) is nn.ConstantPad2d and len(set(pad.padding)) == 1 and type(nxt) is nn.MaxPool2d
        and nxt.padding in (0, (0, 0)) and nxt.dilation in (1, (1, 1))
    )  # fmt: skip


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in timm's ``forward`` order (after a pre-activation block's ``norm1``, whose output its
    downsampling shortcut reads too; before drop-path and the sum)."""
    if isinstance(blk, PreActBasic):
        return [blk.conv1, blk.norm2, blk.conv2]
    if isinstance(blk, PreActBottleneck):
        return [blk.conv1, blk.norm2, blk.conv2, blk.norm3, blk.conv3]
    return [blk.conv1, blk.norm1, blk.conv2, blk.norm2, blk.conv3, blk.norm3]


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in m.stages for blk in stage.blocks]


def head_refusal(head: nn.Module) -> str | None:
    """Why a timm ``ClassifierHead`` has no label readout (``None``: global average pooling, then dropout and the
    classifier, a linear layer or a 1x1 conv, on the pooled features)."""
    h: Any = head
    if type(head) is not ClassifierHead:
        return f"the head is {type(head).__name__}, not timm's ClassifierHead"
    if h.global_pool.pool_type != "avg":
        return f"the head's global_pool={h.global_pool.pool_type!r} has no label readout; use 'avg'"
    return None


def head_per_position(head: Any, x: Tensor) -> Tensor:
    """A timm ``ClassifierHead``'s classifier on every final position ``(b, h*w, k)`` (the head without the pooling:
    dropout, then the linear layer on each position, or the 1x1 conv (``use_conv``) on the map)."""
    if head.use_conv:
        return rearrange(head.fc(head.drop(x)), "b k h w -> b (h w) k")  # type: ignore[no-any-return]
    return head.fc(head.drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


def resnetv2_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ResNetV2 this adapter carries labels through (``None``: it is)."""
    if type(model) is not ResNetV2:
        return f"{type(model).__name__} is not a timm ResNetV2"
    m: Any = model
    same = [type(mod).__name__ for mod in m.stem if type(mod).__name__ in ("MaxPool2dSame", "AvgPool2dSame")]
    if same:
        return f"the stem's {same[0]} pads by TF 'same' rule, decided per input size: no static windows; use stem_type '' or 'fixed'"
    why = head_refusal(m.head) or path_refusal(_stem_path_modules(m.stem), "the stem", _MAP_NORMS)
    why = why or path_refusal([m.norm], "the final norm", _MAP_NORMS)
    if why is not None:
        return why
    for i, stage in enumerate(m.stages):
        if type(stage) is not ResNetStage:
            return f"stage {i} is {type(stage).__name__}; only timm's ResNetStage is supported"
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) not in _BLOCKS:
            return f"{where} is {type(blk).__name__}; only timm's PreActBasic, PreActBottleneck and Bottleneck are supported"
        if type(blk.drop_path) not in (DropPath, nn.Identity):
            return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
        if blk.downsample is not None and type(blk.downsample) not in (DownsampleConv, DownsampleAvg):
            return f"{where}'s shortcut is {type(blk.downsample).__name__}; only DownsampleConv and DownsampleAvg are supported"
        mods = [blk.act3 if isinstance(blk, Bottleneck) else blk.norm1, *_branch_modules(blk)]
        why = path_refusal(mods, f"{where}'s branch", _MAP_NORMS) or path_refusal(_flat(blk.downsample), f"{where}'s shortcut", _MAP_NORMS)
        if why is not None:
            return why
    return None


class AdaptedResNetV2(AdaptedConvNet):
    """A timm ResNetV2 returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = RESNETV2_FAMILY
    refusal = staticmethod(resnetv2_refusal)

    def __init__(self, model: nn.Module, scheme: Scheme, reference: bool = False) -> None:
        super().__init__(model, scheme, reference)
        m: Any = model
        # built once: BiT's folded pad-and-pool is a module made here, not in the traced forward
        self._stem_path = path_of(_stem_path_modules(m.stem))

    def _stem(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
        m: Any = self.model
        x, grid, start = run_stem(m.stem, self._stem_path, images, label_map)
        return x, self._stem_path, grid, start

    def _blocks(self) -> list[nn.Module]:
        m: Any = self.model
        return [*_blocks(m), m.norm]  # the final norm: a unit of channel ops

    def _is_layer(self, blk: Any) -> bool:
        return isinstance(blk, _BLOCKS)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block forward with the drop-path draw exposed: the output and who kept the branch."""
        if not self._is_layer(blk):
            return blk(x), None
        pre = not isinstance(blk, Bottleneck)
        h = blk.norm1(x) if pre else x  # pre-activation: the branch and a downsampling shortcut read it
        shortcut = x if blk.downsample is None else blk.downsample(h)
        for module in _branch_modules(blk):
            h = module(h)
        h, keep = branch(blk.drop_path, h)
        return (h + shortcut if pre else blk.act3(h + shortcut)), keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if not self._is_layer(blk):
            return (), None
        return path_of(_branch_modules(blk)), path_of(_flat(blk.downsample))

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return head_per_position(m.head, x)


FAMILY = Family(
    name="resnetv2",
    description=RESNETV2_FAMILY,
    refusal=AdaptedResNetV2.refusal,
    build=AdaptedResNetV2,
    example=tiny(ResNetV2, layers=[1, 1, 1, 1], channels=(8, 16, 24, 32), stem_chs=8, stem_type="fixed",
                 conv_layer=StdConv2d, norm_layer=partial(GroupNormAct, num_groups=2)),  # fmt: skip
    timm_modules=("resnetv2",),
    speed_model="resnetv2_18",
)
