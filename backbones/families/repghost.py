"""Adapter for timm's RepGhostNet (``repghostnet_*``), with its training-time branches or reparameterised for
inference (``convert_to_deploy``, ``reparameterize``); it is ``ghostnet``'s adapter with RepGhost's module rule,
and folds the fused kernel with ``backbones._reparam`` (every norm's scale of a forward in one pass).

The label rules of ``backbones._convnet`` on RepGhostNet's bottlenecks. Units after the stem, in
order: every ``RepGhostBottleneck`` (one layer each), then the last stage's 1x1 ``ConvBnAct`` (a
channel op):

- a RepGhost module: a primary 1x1 conv, then a cheap depthwise kxk conv of its output ``x1``
  (with its norm) SUMMED with a batch norm of ``x1`` itself (the identity branch): no concatenation
  (GhostNet's) and no residual, but one depthwise conv whose kernel is the cheap conv's scaled by
  its norm's ``gamma / sqrt(running_var + eps)`` plus the identity's centre tap scaled by the fusion
  norm's (the kernel timm's ``switch_to_deploy`` writes): the labels move by that kernel's conv rule
  (a ``KernelConv``). A reparameterised module's cheap conv holds that very kernel; a module built
  with ``reparam=False`` has the cheap conv alone;
- a bottleneck: RepGhost module, a strided depthwise conv (a window aggregation) where it
  downsamples, squeeze-excite (a channel gate), RepGhost module; its shortcut (identity, or a
  depthwise kxk conv then a 1x1: a window aggregation if strided, else a mix by its kernel) keeps or
  moves the labels, and the branch's labels join by the residual rule (no stochastic depth);
- the stem (3x3 stride-2 conv) aggregates from the pixel grid (a MixToken map starts on its grid);
- readout: ``pool("mean", 0)``: global average pooling, then the 1x1 ``conv_head`` and the classifier.

The label kernel reads the norms' running statistics in training too: the rule is the reparameterised
model's, the same for a model trained with branches and for it after ``convert_to_deploy``.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from timm.models.repghost import RepGhostBottleneck, RepGhostModule, RepGhostNet
from torch import Tensor, nn

from mixlabels.backbones._convnet import KernelBatch, KernelConv, Path, path_of, path_refusal
from mixlabels.backbones._reparam import Scales, add_centre, folded, joined, parted, scales_of
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.ghostnet import TINY_CFGS, AdaptedGhostNet, bottleneck_middle_refusal, ghost_units_refusal

__all__ = ["AdaptedRepGhostNet", "REPGHOST_FAMILY", "repghost_refusal", "repghost_kernel"]

REPGHOST_FAMILY = (
    "timm RepGhostNet (repghostnet_*, training-time branches or reparameterised): every position a token; a "
    "RepGhost module's cheap depthwise conv summed with its identity norm is the one conv it fuses into, mixing "
    "labels by that kernel's normalised |kernel| (border-renormalised); strided convs aggregate over their windows; "
    "1x1 convs, norms, activations, SE as channel ops; a bottleneck's labels join its shortcut's by the residual "
    "rule; stem from the pixels; global average pooling"
)


def _fused(ghost: Any) -> bool:
    """Whether a RepGhost module has an identity branch to fuse (built with ``reparam=True``, not yet deployed)."""
    return isinstance(ghost.cheap_operation, nn.Sequential) and len(ghost.fusion_bn) > 0


def repghost_norms(ghost: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The cheap conv's norm and the fusion norm: what ``repghost_kernel`` folds."""
    g: Any = ghost
    return g.cheap_operation[1], g.fusion_bn[0]


def repghost_kernel(ghost: nn.Module, scales: Scales | None = None) -> Tensor:
    """The ``(c, 1, k, k)`` kernel timm's ``RepGhostModule.switch_to_deploy`` writes: the cheap depthwise conv scaled
    by its norm, plus the identity (centre taps) scaled by the fusion norm. ``scales``: the norms' fold scales
    where computed together with others' (``_reparam``)."""
    return repghost_kernels([ghost], scales)[0]


def repghost_kernels(ghosts: Sequence[nn.Module], scales: Scales | None = None) -> list[Tensor]:
    """``repghost_kernel`` of several modules whose cheap convs share ``(1, k, k)``, in one pass over their weights
    and scales concatenated along the channels (the same elementwise operations: the same bits)."""
    gs: list[Any] = list(ghosts)
    norms = [repghost_norms(g) for g in gs]
    s = scales_of(n for pair in norms for n in pair) if scales is None else scales
    with torch.no_grad():
        k = folded([g.cheap_operation[0].weight for g in gs], [cheap for cheap, _ in norms], s)  # a new tensor
        k = add_centre(k, joined([s[fusion] for _, fusion in norms])).detach()  # the identity adds in place
        return parted(k, [int(g.cheap_operation[0].weight.shape[0]) for g in gs])


def _cheap_modules(ghost: Any) -> list[Any]:
    """The cheap operation's modules: its conv and norm, or the one conv of a reparameterised module."""
    cheap = ghost.cheap_operation
    return list(cheap) if isinstance(cheap, nn.Sequential) else [cheap]


def _cheap_path(ghost: Any) -> Path:
    if not _fused(ghost):  # reparameterised (one conv) or built without the identity branch
        return path_of(_cheap_modules(ghost))
    conv = ghost.cheap_operation[0]
    # every such module of one kernel shape, dtype and device builds its kernel together (``KernelBatch``)
    batch = KernelBatch(("repghost", tuple(conv.weight.shape[1:]), conv.weight.dtype, conv.weight.device), ghost, repghost_kernels)
    return (KernelConv(functools.partial(repghost_kernel, ghost), (int(conv.padding[0]), int(conv.padding[1])), (1, 1),
                       repghost_norms(ghost), batch),)


def _ghost_path(ghost: Any) -> Path:
    return (*path_of(list(ghost.primary_conv)), *_cheap_path(ghost))


def _ghost_refusal(ghost: Any, where: str) -> str | None:
    if type(ghost) is not RepGhostModule:
        return f"{where} is {type(ghost).__name__}, not timm's RepGhostModule"
    cheap = _cheap_modules(ghost)
    why = path_refusal([*ghost.primary_conv, *cheap, ghost.relu], where)
    if why is not None or not _fused(ghost):
        return why
    fusion, conv = [*ghost.fusion_conv, *ghost.fusion_bn], cheap[0]
    (kh, kw), c = conv.kernel_size, int(conv.in_channels)
    if (len(cheap) != 2 or type(conv) is not nn.Conv2d or not isinstance(cheap[1], nn.BatchNorm2d) or conv.stride != (1, 1)
            or conv.groups != c or conv.out_channels != c or kh % 2 == 0 or kw % 2 == 0 or tuple(conv.padding) != (kh // 2, kw // 2)
            or conv.dilation != (1, 1)):
        return f"{where}'s cheap operation is not a stride-1 undilated depthwise odd kxk conv with centred padding and a BatchNorm2d"
    if len(fusion) != 2 or type(fusion[0]) is not nn.Identity or type(fusion[1]) is not nn.BatchNorm2d:
        return f"{where}'s fusion branch is not timm's identity and BatchNorm2d"
    return None


def _bottleneck_refusal(blk: Any, where: str) -> str | None:
    if type(blk) is not RepGhostBottleneck:
        return f"{where} is {type(blk).__name__}; only timm's RepGhostBottleneck is supported"
    why = _ghost_refusal(blk.ghost1, f"{where}'s ghost1") or _ghost_refusal(blk.ghost2, f"{where}'s ghost2")
    return why or bottleneck_middle_refusal(blk, where)


def repghost_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm RepGhostNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not RepGhostNet:
        return f"{type(model).__name__} is not a timm RepGhostNet"
    return ghost_units_refusal(model, _bottleneck_refusal)


class AdaptedRepGhostNet(AdaptedGhostNet):
    """A timm RepGhostNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = REPGHOST_FAMILY
    refusal = staticmethod(repghost_refusal)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is RepGhostBottleneck

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is not RepGhostBottleneck:
            return (), None  # the last stage's 1x1 ConvBnAct: channel ops
        middle = [] if blk.conv_dw is None else [blk.conv_dw]
        return (*_ghost_path(blk.ghost1), *path_of(middle), *_ghost_path(blk.ghost2)), path_of(list(blk.shortcut))


FAMILY = Family(
    name="repghost",
    description=REPGHOST_FAMILY,
    refusal=AdaptedRepGhostNet.refusal,
    build=AdaptedRepGhostNet,
    example=tiny(RepGhostNet, cfgs=TINY_CFGS, width=1.0),
    timm_modules=("repghost",),
    speed_model="repghostnet_100",
)
