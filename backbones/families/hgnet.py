"""Adapter for timm's PP-HGNet (``hgnet_*``) and PP-HGNetV2 (``hgnetv2_*``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on HGNet's parts, as VoVNet's
one-shot aggregation. Units after the stem, in order: each stage's downsampler (a depthwise 3x3 stride-2 conv; not
a layer), then its ``HighPerfGpuBlock``\\ s, one layer each:

- a block concatenates its input with the output of every conv of a chain (a ``ConvBNAct`` kxk, or a
  ``LightConvBNAct``: 1x1 then depthwise kxk), then aggregates with 1x1 convs (and an ESE gate). The concatenation is
  ``Parallel`` branches weighed by their channel counts: the identity (the input's channels), then the chain's
  prefixes, each stride-1 conv mixing labels by its (out, in)-averaged normalised |kernel| (border-renormalised);
- a residual block (a stage's later blocks) joins the concatenation's labels to its input's by the residual rule,
  with its drop path; a stage's first block has no shortcut and forms every position from its branch: its labels
  ``aggregate``;
- norms, ReLUs, ``LearnableAffineBlock`` (one scale and bias for the whole map) and the ESE gate (channels scaled
  by a gate pooled over every position) are channel ops;
- the V1 stem (3x3 convs, then a 3x3 stride-2 max pool) aggregates over its windows; the V2 stem pads its map by
  one zero row and column after (``F.pad``) before a 2x2 stride-1 max pool and, in parallel, two 2x2 convs (each on
  a right-bottom padded map), then concatenates both. A 2x2 window on such a map is a 3x3 window centred on its
  top-left tap with the first row and column zero: each conv is ``KernelConv`` with its kernel so padded
  (``padding=1``), the pool ``KernelConv`` with such a kernel of ones (its in-grid taps weighed alike, as a
  window's); the two branches join weighed by channel count. Labels start on the pixels (a MixToken map on the
  stem's grid);
- readout: ``pool("mean", 0)``; timm's head pools first, then its 1x1 ``last_conv`` and classifier.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.drop import DropPath
from timm.models.hgnet import (
    ClassifierHead,
    ConvBNAct,
    EseModule,
    HighPerfGpuBlock,
    HighPerfGpuNet,
    HighPerfGpuStage,
    LearnableAffineBlock,
    LightConvBNAct,
    StemV1,
    StemV2,
)
from torch import Tensor, nn

from mixlabels import TokenLabelMap
from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, KernelConv, Parallel, Path, Window, path_of, path_refusal, run_stem
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedHGNet", "HGNET_FAMILY", "hgnet_refusal"]

HGNET_FAMILY = (
    "timm PP-HGNet and PP-HGNetV2 (hgnet_*, hgnetv2_*): every position a token; a block concatenates its input and "
    "every conv of its chain, so their labels join weighed by channel count; stride-1 convs mix labels by the "
    "(out, in)-averaged normalised |kernel| (border-renormalised); the V2 stem's right-bottom padded 2x2 convs and "
    "max pool as 3x3 kernels on a zero-padded grid; max pools and strided convs aggregate over their windows; 1x1 "
    "convs, norms, ReLUs, learnable affine and ESE gates as channel ops; a residual block's labels join its input's "
    "by the residual rule; stem from the pixels; global average pooling; stochastic depth"
)

_GATES = (LearnableAffineBlock, EseModule)
"""A scalar scale and bias over the whole map, and a gate pooled over every position: channel ops."""


def _ops(module: nn.Module) -> list[nn.Module]:
    """A module as the ops its forward runs in order (``ConvBNAct``: conv, norm, activation, affine)."""
    if isinstance(module, nn.Sequential):
        return [op for child in module for op in _ops(child)]
    if type(module) is ConvBNAct:
        c: Any = module
        return [c.conv, c.bn, c.act, c.lab]
    if type(module) is LightConvBNAct:
        light: Any = module
        return _ops(light.conv1) + _ops(light.conv2)
    return [module]


def _right_bottom_padded(weight: Tensor) -> Tensor:
    """A 2x2 kernel ``(o, i, 2, 2)`` read on a map padded by one row and column after, as a 3x3 kernel (``padding=1``)
    whose first row and column are zero: output ``(y, x)`` reads inputs ``(y + dy, x + dx)``, ``dy, dx in {0, 1}``."""
    return F.pad(weight.detach(), (1, 0, 1, 0))


def _stem_v2_path(stem: Any) -> Path:
    """``stem1``'s windows, ``cat(pool(pad(x)), stem2b(pad(stem2a(pad(x)))))`` as ``Parallel``, ``stem3``'s windows."""
    mid = int(stem.stem1.conv.out_channels)
    pool = KernelConv(lambda: _right_bottom_padded(stem.stem1.conv.weight.new_ones(1, 1, 2, 2)), (1, 1))
    conv_a = KernelConv(lambda: _right_bottom_padded(stem.stem2a.conv.weight), (1, 1))
    conv_b = KernelConv(lambda: _right_bottom_padded(stem.stem2b.conv.weight), (1, 1))
    joined = Parallel.concat([(pool,), (conv_a, conv_b)], [mid, int(stem.stem2b.conv.out_channels)])
    return (*path_of(_ops(stem.stem1)), joined, *path_of(_ops(stem.stem3) + _ops(stem.stem4)))


def _stem_path(stem: Any) -> Path:
    if type(stem) is StemV2:
        return _stem_v2_path(stem)
    return path_of(_ops(stem.stem) + [stem.pool])


def _stem_v2_refusal(stem: Any) -> str | None:
    why = path_refusal(_ops(stem.stem1) + _ops(stem.stem3) + _ops(stem.stem4), "the stem", _GATES)
    for name in ("stem2a", "stem2b"):
        conv = getattr(stem, name).conv
        if why is None and (type(conv) is not nn.Conv2d or conv.kernel_size != (2, 2) or conv.stride != (1, 1)
                            or conv.padding != (0, 0) or conv.dilation != (1, 1)):  # fmt: skip
            why = f"the stem's {name} is not a 2x2 stride-1 unpadded nn.Conv2d (the right-bottom padded kernel rule)"
        # the conv itself is checked above (padded right-bottom by the stem, so not grid-keeping alone): its norm-act here
        why = why or path_refusal([op for op in _ops(getattr(stem, name)) if op is not conv], f"the stem's {name}", _GATES)
    p = stem.pool
    if why is None and (type(p) is not nn.MaxPool2d or p.kernel_size not in (2, (2, 2)) or p.stride not in (1, (1, 1))
                        or p.padding not in (0, (0, 0)) or p.dilation not in (1, (1, 1))):  # fmt: skip
        why = "the stem's pool is not a 2x2 stride-1 unpadded MaxPool2d (the right-bottom padded window rule)"
    if why is None and any(isinstance(op, Window) for op in path_of(_ops(stem.stem4))):
        why = "the stem's stem4 is not a stride-1 convolution"
    return why


def _head_refusal(head: nn.Module) -> str | None:
    if type(head) is not ClassifierHead:
        return f"the head is {type(head).__name__}, not timm's HGNet ClassifierHead"
    h: Any = head
    if h.global_pool.pool_type != "avg" or not isinstance(h.fc, (nn.Linear, nn.Identity)):
        return f"the head (global_pool={h.global_pool.pool_type!r}) has no label readout; use 'avg' and a linear fc"
    why = path_refusal(_ops(h.last_conv), "the head's last_conv", _GATES)
    if why is None and path_of(_ops(h.last_conv)):
        why = "the head's last_conv is not a 1x1 stride-1 convolution"
    return why


def _block_refusal(blk: nn.Module, where: str) -> str | None:
    if type(blk) is not HighPerfGpuBlock:
        return f"{where} is {type(blk).__name__}, not timm's HighPerfGpuBlock"
    b: Any = blk
    if not isinstance(b.drop_path, (DropPath, nn.Identity)):
        return f"{where}'s drop_path is {type(b.drop_path).__name__}, not timm's DropPath"
    for j, layer in enumerate(b.layers):
        if type(layer) not in (ConvBNAct, LightConvBNAct):
            return f"{where} layer {j} is {type(layer).__name__}, not timm's ConvBNAct or LightConvBNAct"
    why = path_refusal([op for layer in b.layers for op in _ops(layer)] + _ops(b.aggregation), where, _GATES)
    if why is None and any(isinstance(op, Window) for layer in b.layers for op in path_of(_ops(layer))):
        why = f"{where} has a strided layer: the concatenation needs every layer on the block's grid"
    if why is None and path_of(_ops(b.aggregation)):
        why = f"{where}'s aggregation is not 1x1 stride-1 convolutions"
    return why


def hgnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm HGNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not HighPerfGpuNet:
        return f"{type(model).__name__} is not a timm HighPerfGpuNet"
    m: Any = model
    if type(m.stem) is StemV2:
        why = _stem_v2_refusal(m.stem)
    elif type(m.stem) is StemV1:
        why = path_refusal(_ops(m.stem.stem) + [m.stem.pool], "the stem", _GATES)
    else:
        why = f"the stem is {type(m.stem).__name__}, not timm's StemV1 or StemV2"
    why = why or _head_refusal(m.head)
    for s, stage in enumerate(m.stages):
        if why is None and type(stage) is not HighPerfGpuStage:
            why = f"stage {s} is {type(stage).__name__}, not timm's HighPerfGpuStage"
        elif why is None and not isinstance(stage.downsample, nn.Identity):
            why = path_refusal(_ops(stage.downsample), f"stage {s}'s downsampler", _GATES)
        for i, blk in enumerate(stage.blocks if why is None else ()):
            why = why or _block_refusal(blk, f"stage {s} block {i}")
    return why


def _units(m: Any) -> list[nn.Module]:
    """Every unit after the stem: each stage's downsampler (an identity left out), then its blocks."""
    return [u for stage in m.stages for u in ([] if isinstance(stage.downsample, nn.Identity) else [stage.downsample]) + list(stage.blocks)]


def _hg_branch(blk: Any) -> Path:
    """The concatenation ``[x, l_1, l_2, ...]`` as ``Parallel`` branches (the chain's prefixes), weighed by channels."""
    convs = [op for op in _ops(blk.aggregation) if isinstance(op, nn.Conv2d)]
    mid = [int([op for op in _ops(layer) if isinstance(op, nn.Conv2d)][-1].out_channels) for layer in blk.layers]
    inputs = int(convs[0].in_channels) - sum(mid)
    chain: list[nn.Module] = []
    parts: list[Path] = [()]
    for layer in blk.layers:
        chain = chain + _ops(layer)
        parts.append(path_of(chain))
    return (Parallel.concat(parts, [inputs, *mid]),)


class AdaptedHGNet(AdaptedConvNet):
    """A timm HGNet (V1 or V2) returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = HGNET_FAMILY
    refusal = staticmethod(hgnet_refusal)

    def _stem(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
        """timm's stem as itself (the V2 stem's padding and concatenation inside), its path written out."""
        m: Any = self.model
        path = _stem_path(m.stem)
        x, grid, start = run_stem(m.stem, path, images, label_map)
        return x, path, grid, start

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is HighPerfGpuBlock

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``HighPerfGpuBlock.forward`` with the drop-path draw exposed; a downsampler as itself."""
        if type(blk) is not HighPerfGpuBlock:
            return blk(x), None
        output, h = [x], x
        for layer in blk.layers:
            h = layer(h)
            output.append(h)
        h = blk.aggregation(torch.cat(output, dim=1))  # b c h w
        if not blk.residual:
            return h, None
        h, keep = branch(blk.drop_path, h)
        return h + x, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is HighPerfGpuBlock:
            return _hg_branch(blk), (() if blk.residual else None)
        return path_of(_ops(blk)), None  # a downsampler's windows aggregate

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The head on every final position ``(b, h*w, k)``: its 1x1 last conv, dropout and classifier, pooling left out."""
        head: Any = self.model.head
        t = rearrange(head.dropout(head.last_conv(x)), "b c h w -> b (h w) c")
        return head.fc(t)  # type: ignore[no-any-return]


TINY_V2 = dict(
    stem_type="v2", stem_chs=[8, 16],
    # in, mid, out, blocks, downsample, light block, kernel, layers
    stage1=[16, 8, 16, 1, False, False, 3, 2], stage2=[16, 8, 24, 2, True, True, 3, 2],
    stage3=[24, 8, 32, 1, True, True, 5, 2], stage4=[32, 8, 32, 1, True, False, 3, 2],
)  # fmt: skip
"""Four stages (the second with a residual block) on a 32x32 image: grids 8 (stem), 8, 4, 2, 1."""

FAMILY = Family(
    name="hgnet",
    description=HGNET_FAMILY,
    refusal=AdaptedHGNet.refusal,
    build=AdaptedHGNet,
    example=tiny(HighPerfGpuNet, cfg=TINY_V2, head_hidden_size=16, use_lab=True),
    timm_modules=("hgnet",),
    speed_model="hgnetv2_b0",
)
