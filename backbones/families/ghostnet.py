"""Adapter for timm's GhostNet (v1 and v2: ``ghostnet_*``, ``ghostnetv2_*``); its head is MobileNetV3's (``mobilenetv3``).

The label rules of ``backbones._convnet`` on GhostNet's bottlenecks. Units after the stem, in
order: every ``GhostBottleneck`` (one layer each), then the last stage's 1x1 ``ConvBnAct`` (a
channel op):

- a ghost module concatenates a primary conv's output ``x1`` with a cheap depthwise conv of it
  ``x2`` (cut to the module's width): ``Parallel`` branches weighed by channel count, the
  identity for ``x1``'s channels and the depthwise kxk conv (mixing labels by its normalised
  |kernel|, border-renormalised) for ``x2``'s. GhostNet v2's module multiplies its output by a
  gate computed from an average-pooled, 1x5 and 5x1 convolved copy of its input (DFC attention):
  like squeeze-excite's gate it scales each position's own channels and brings no content from
  other positions, so it is a channel op;
- a bottleneck: ghost module, a strided depthwise conv (a window aggregation) where it
  downsamples, squeeze-excite, ghost module; its shortcut (identity, or a depthwise kxk conv then a
  1x1: a window aggregation if strided, else a mix by its kernel) keeps or moves the labels, and
  the branch's labels join by the residual rule (GhostNet has no stochastic depth);
- the stem (3x3 stride-2 conv) aggregates from the pixel grid (a MixToken map starts on its grid);
- readout: ``pool("mean", 0)``: global average pooling, then the 1x1 ``conv_head`` and the
  classifier on the pooled features (channel ops).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from timm.models._efficientnet_blocks import ConvBnAct, SqueezeExcite
from timm.models.ghostnet import GhostBottleneck, GhostModule, GhostModuleV2, GhostNet
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, Parallel, Path, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.mobilenetv3 import conv_head_position_logits

__all__ = ["AdaptedGhostNet", "GHOSTNET_FAMILY", "ghostnet_refusal", "ghost_units_refusal", "bottleneck_middle_refusal"]

GHOSTNET_FAMILY = (
    "timm GhostNet v1/v2: every position a token; a ghost module concatenates a primary conv's output and a cheap "
    "depthwise conv of it, so their labels join weighed by channel count (v2's DFC gate as a channel op); stride-1 "
    "kxk convs mix labels by the (out, in)-averaged normalised |kernel| (border-renormalised); strided convs "
    "aggregate over their windows; 1x1 convs, norms, activations, SE as channel ops; a bottleneck's labels join its "
    "shortcut's by the residual rule; stem from the pixels; global average pooling"
)


def _ghost_modules(ghost: Any) -> list[nn.Module]:
    return [*ghost.primary_conv, *ghost.cheap_operation]


def _ghost_path(ghost: Any) -> Path:
    """The primary conv's ops, then its output and its cheap depthwise conv's concatenated (cut to ``out_chs``)."""
    primary = int(ghost.primary_conv[0].out_channels)
    cheap = path_of(list(ghost.cheap_operation))
    return (*path_of(list(ghost.primary_conv)), Parallel.concat([(), cheap], [primary, int(ghost.out_chs) - primary]))


def _branch_path(blk: Any) -> Path:
    middle = [] if blk.conv_dw is None else [blk.conv_dw]
    return (*_ghost_path(blk.ghost1), *path_of(middle), *_ghost_path(blk.ghost2))


def _units(m: Any) -> list[nn.Module]:
    return [unit for stage in m.blocks for unit in stage]


def ghost_units_refusal(m: Any, bottleneck_refusal: Callable[[Any, str], str | None]) -> str | None:
    """Why a GhostNet-like model (GhostNet's, RepGhostNet's: stem, ``blocks`` of bottlenecks then a 1x1 ``ConvBnAct``,
    a pool-then-``conv_head`` head) has no label rule; ``bottleneck_refusal(unit, where)`` judges every other unit."""
    if m.global_pool.pool_type != "avg" or not isinstance(m.classifier, (nn.Linear, nn.Identity)):
        return f"the head (global_pool={m.global_pool.pool_type!r}) has no label readout; use 'avg'"
    why = path_refusal([m.conv_stem, m.bn1, m.act1], "the stem")
    for i, blk in enumerate(_units(m)):
        if why is not None:
            return why
        where = f"block {i}"
        if type(blk) is ConvBnAct:
            why = f"{where} is a ConvBnAct that is not a 1x1 stride-1 conv without skip" if path_of([blk.conv]) or blk.has_skip else None
        else:
            why = bottleneck_refusal(blk, where)
    return why


def bottleneck_middle_refusal(blk: Any, where: str) -> str | None:
    """Why a ghost bottleneck's strided depthwise conv, squeeze-excite or shortcut has no label rule."""
    mods = [blk.conv_dw, blk.bn_dw] if blk.conv_dw is not None else []
    why = path_refusal(mods + ([blk.se] if blk.se is not None else []), f"{where}'s branch", (SqueezeExcite,))
    return why or path_refusal(list(blk.shortcut), f"{where}'s shortcut")


def _bottleneck_refusal(blk: Any, where: str) -> str | None:
    if type(blk) is not GhostBottleneck:
        return f"{where} is {type(blk).__name__}; only GhostNet v1/v2's GhostBottleneck is supported (not v3's)"
    for name in ("ghost1", "ghost2"):
        ghost = getattr(blk, name)
        if type(ghost) not in (GhostModule, GhostModuleV2):
            return f"{where}'s {name} is {type(ghost).__name__}, not GhostModule or GhostModuleV2"
        why = path_refusal(_ghost_modules(ghost), f"{where}'s {name}")
        if why is None and path_of(list(ghost.primary_conv)):
            why = f"{where}'s {name} has a spatial primary conv; only a 1x1 stride-1 one is supported"
        if why is not None:
            return why
    return bottleneck_middle_refusal(blk, where)


def ghostnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm GhostNet (v1/v2) this adapter carries labels through (``None``: it is)."""
    if type(model) is not GhostNet:
        return f"{type(model).__name__} is not a timm GhostNet"
    return ghost_units_refusal(model, _bottleneck_refusal)


class AdaptedGhostNet(AdaptedConvNet):
    """A timm GhostNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = GHOSTNET_FAMILY
    refusal = staticmethod(ghostnet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return [m.conv_stem, m.bn1, m.act1]

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is GhostBottleneck

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return blk(x), None  # no stochastic depth in GhostNet: every branch is kept

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is not GhostBottleneck:
            return (), None  # the last stage's 1x1 ConvBnAct: channel ops
        return _branch_path(blk), path_of(list(blk.shortcut))

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        return conv_head_position_logits(self.model, x)

TINY_CFGS = [
    [[3, 16, 8, 0, 1]],
    [[3, 24, 16, 0, 2]],
    [[3, 24, 16, 0.25, 1], [5, 32, 24, 0, 2]],
    [[3, 48, 24, 0.25, 1]],
]
"""Four stages on a 32x32 image (grids 16 (stem), 16, 8, 8 then 4): identity and conv shortcuts, SE, a 5x5."""

FAMILY = Family(
    name="ghostnet",
    description=GHOSTNET_FAMILY,
    refusal=AdaptedGhostNet.refusal,
    build=AdaptedGhostNet,
    example=tiny(GhostNet, cfgs=TINY_CFGS, width=1.0),
    timm_modules=("ghostnet",),
    speed_model="ghostnet_100",
)
