"""Adapter for timm's Res2Net (``res2net50_*``, ``res2net101_*``, ``res2net50d``, ``res2net101d``, ``res2next50``).

A timm ``ResNet`` built with ``Bottle2neck`` blocks: everything but the block is ``resnet``'s (stem, shortcuts,
readout, drop path, the events of ``backbones._convnet``); this file gives the block's forward and its paths.

A ``Bottle2neck`` branch splits its 1x1 conv's output into ``scale`` groups of ``width`` channels, all carrying the
block's labels ``Y``. Group ``i < scale - 1`` runs a 3x3 conv; outside a block's first (``is_first``: it strides or
projects) group ``i > 0`` convolves the sum of its own split and group ``i - 1``'s output. The last group passes
through (an average pool in a first block). The groups are concatenated, then a 1x1 conv (and SE) acts on channels.
As ``backbones._convnet.Parallel`` writes joins:

- group 0: ``P_0 = C_0`` (its conv's label rule; a strided conv aggregates);
- group ``i > 0``: ``P_i = C_i`` in a first block, else ``P_i = C_i (P_{i-1} + I) / 2`` (a sum of two maps weighs
  them equally, as the residual rule does);
- the last group: ``I``, or the pool's windows;
- the branch: ``sum_i P_i / scale`` (a concatenation weighs each group by its channel count, all ``width``).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.layers.drop import DropPath
from timm.models.res2net import Bottle2neck
from timm.models.resnet import ResNet
from torch import Tensor, nn

from mixlabels.backbones._common import AdaptedBase, branch
from mixlabels.backbones._convnet import Parallel, Path, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.resnet import AdaptedResNet, _blocks, _flat, _stem_modules

__all__ = ["AdaptedRes2Net", "RES2NET_FAMILY", "res2net_refusal"]

RES2NET_FAMILY = (
    "timm Res2Net (ResNet with Bottle2neck blocks: res2net50_*, res2net101_*, res2net50d, res2net101d, res2next50): "
    "resnet's stem, shortcuts and readout; a block's split groups each mix labels by their 3x3 conv (a strided one "
    "aggregates), a group's input summed with the previous group's output weighs both equally, the concatenated "
    "groups weigh equally (equal widths); 1x1 convs, norms, activations, SE as channel ops; stochastic depth"
)


def _group_modules(blk: Any, i: int) -> list[nn.Module]:
    return [blk.convs[i], blk.bns[i], blk.relu]


def res2net_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm Res2Net this adapter carries labels through (``None``: it is)."""
    if type(model) is not ResNet:
        return f"{type(model).__name__} is not a timm ResNet"
    m: Any = model
    blocks = _blocks(m)
    if not blocks or any(type(blk) is not Bottle2neck for blk in blocks):
        kinds = sorted({type(blk).__name__ for blk in blocks})
        return f"a ResNet of {', '.join(kinds)} blocks is not a Res2Net (every block a Bottle2neck)"
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    why = path_refusal(_stem_modules(m), "the stem")
    for i, blk in enumerate(blocks):
        where = f"block {i}"
        if why is not None:
            return why
        if blk.drop_path is not None and type(blk.drop_path) is not DropPath:
            return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
        modules = [blk.conv1, blk.bn1, blk.relu, *(op for g in range(blk.num_scales) for op in _group_modules(blk, g)),
                   *_flat(blk.pool), blk.drop_block, blk.conv3, blk.bn3, *_flat(blk.se)]  # fmt: skip
        why = path_refusal(modules, f"{where}'s branch") or path_refusal(_flat(blk.downsample), f"{where}'s shortcut")
    return why


def _res2_block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's ``Bottle2neck.forward`` with the branch's drop-path draw exposed: the output and who kept the branch."""
    out = blk.relu(blk.bn1(blk.conv1(x)))
    spx = torch.split(out, blk.width, 1)
    spo = []
    sp = spx[0]
    for i, (conv, bn) in enumerate(zip(blk.convs, blk.bns)):
        sp = spx[i] if i == 0 or blk.is_first else sp + spx[i]
        sp = blk.relu(bn(conv(sp)))
        spo.append(sp)
    if blk.scale > 1:
        spo.append(blk.pool(spx[-1]) if blk.pool is not None else spx[-1])
    out = blk.bn3(blk.conv3(blk.drop_block(torch.cat(spo, 1))))
    if blk.se is not None:
        out = blk.se(out)
    keep = None
    if blk.drop_path is not None:
        out, keep = branch(blk.drop_path, out)
    shortcut = blk.downsample(x) if blk.downsample is not None else x
    return blk.relu(out + shortcut), keep


def _res2_paths(blk: Any) -> tuple[Path, Path]:
    """The branch (the groups' paths joined as the concatenation does) and the shortcut's path."""
    groups: list[Path] = []
    for i in range(blk.num_scales):
        own = path_of(_group_modules(blk, i))
        groups.append(own if i == 0 or blk.is_first else (Parallel.sum([groups[-1], ()]), *own))
    if blk.scale > 1:
        groups.append(path_of(_flat(blk.pool)))
    return (Parallel.concat(groups, [blk.width] * len(groups)),), path_of(_flat(blk.downsample))


class AdaptedRes2Net(AdaptedResNet):
    """A timm Res2Net returning the scheme's aligned targets (resnet's walks with Bottle2neck's paths)."""

    family = RES2NET_FAMILY
    refusal = staticmethod(res2net_refusal)
    # per-block FSDP2 sharding has not been run on Bottle2neck (tests/test_fsdp.py): the adapted root alone is sharded
    fsdp_units = AdaptedBase.fsdp_units

    @staticmethod
    def block_forward(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return _res2_block(blk, x)

    @staticmethod
    def block_paths(blk: Any) -> tuple[Path, Path]:
        return _res2_paths(blk)


FAMILY = Family(
    name="res2net",
    description=RES2NET_FAMILY,
    refusal=AdaptedRes2Net.refusal,
    build=AdaptedRes2Net,
    example=tiny("res2net50_26w_4s", layers=(2, 1, 1, 1), channels=(8, 16, 24, 32)),
    timm_modules=("res2net",),
    speed_model="res2net50_26w_4s",
)
