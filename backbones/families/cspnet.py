"""Adapter for timm's CspNet module: its DarkNet form (``darknet*``, ``sedarknet21``) and its CSP stages (``csp*``, ``cs3*``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on CspNet's stages; the stem and
the head's readout are VoVNet's (``HeadedConvNet``, ``classifier_head_refusal`` from ``families/vovnet.py``). Units
after the stem, in order, per stage:

- a ``DarkStage``: its ``conv_down``, then its blocks;
- a ``CrossStage`` (cspresnet*, cspresnext50, cspdarknet53, cs3sedarknet_xdw): ``conv_down``, the 1x1 ``conv_exp``,
  then the cross part: ``conv_exp``'s channels split in two, the blocks run on the second half (``xb``) and the
  1x1 ``conv_transition_b`` after them, the first half (``xs``) waits, and both are concatenated: the labels fork
  at the split, the blocks' residual events run on, and the join weighs the waiting half's labels by its channel
  count (``LabelTracker.fork``, ``join``; ``_convnet.CrossPart``); then the 1x1 ``conv_transition``;
- a ``CrossStage3`` (cs3darknet*, cs3sedarknet_l/x, cs3edgenet_x, cs3se_edgenet_x): the same, the blocks on the first
  half, the concatenation ``[blocks(x1), x2]`` without a transition of its own before it.

Each unit's rule:

- ``conv_down`` (a 3x3 conv, strided: its windows; or an ``avg_down`` 2x2 average pool then a 1x1 conv; or the
  identity) has no shortcut: it forms every position from its windows, so its labels ``aggregate``;
- a block (``DarkBlock``: 1x1, channel gate, 3x3; ``BottleneckBlock``: 1x1, 3x3 (grouped in cspresnext50), gates,
  1x1, an activation after the sum; ``EdgeBlock``: 3x3, gate, 1x1) adds its branch to the identity: the branch's
  stride-1 3x3 conv mixes labels by its (out, in)-averaged normalised |kernel| (border-renormalised), and joins
  the kept labels by the residual rule, with the block's drop path; one residual layer each;
- 1x1 convs (``conv_exp``, the transitions), norms, activations and SE are channel ops;
- the stem (``ConvNormAct``\\ s, strided ones aggregating, and an optional max pool) starts from the pixels (a
  MixToken map on its grid);
- readout: ``pool("mean", 0)``, timm's ``ClassifierHead`` with average pooling.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from timm.layers.drop import DropPath
from timm.models.cspnet import (
    BottleneckBlock,
    CspModelCfg,
    CspNet,
    CspStagesCfg,
    CspStemCfg,
    CrossStage,
    CrossStage3,
    DarkBlock,
    DarkStage,
    EdgeBlock,
)
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import CrossPart, Path, Window, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.vovnet import HeadedConvNet, classifier_head_refusal

__all__ = ["AdaptedCspNet", "CSPNET_FAMILY", "cspnet_refusal", "channel_refusal", "headed_refusal", "run_branch"]

CSPNET_FAMILY = (
    "timm CspNet: DarkNet (DarkNet-17/21/53, DarkNet-AA-53, SE-DarkNet-21) and CSP stages (CSPResNet(e)Xt, CSPDarkNet, "
    "CS3DarkNet, CS3EdgeNet, SE variants): every position a token; stride-1 3x3 convs mix labels by the "
    "(out, in)-averaged normalised |kernel| (border-renormalised); strided convs and pools aggregate over their "
    "windows (a stage's conv_down has no shortcut: it aggregates); 1x1 convs, norms, activations, SE as channel ops; "
    "a block's branch joins the identity's labels by the residual rule; a cross stage's blocks run on half its "
    "channels between a fork and a join of the labels, the join weighing the waiting half by its channel count; "
    "stem from the pixels; global average pooling; stochastic depth"
)

_BLOCKS = (DarkBlock, BottleneckBlock, EdgeBlock)


def _branch(blk: Any) -> list[nn.Module]:
    """A block's branch modules in the order of timm's ``forward`` (before the sum with the identity)."""
    if type(blk) is BottleneckBlock:
        return [blk.conv1, blk.conv2, blk.attn2, blk.conv3, blk.attn3]
    return [blk.conv1, blk.attn, blk.conv2]  # DarkBlock, EdgeBlock


def _branch_modules(blk: Any) -> list[nn.Module]:
    return [op for module in _branch(blk) for op in conv_norm_act_ops(module)]


def _cross_part(stage: Any) -> CrossPart:
    """A cross stage's split, blocks and concatenation (timm's ``forward`` between ``conv_exp`` and ``conv_transition``)."""
    half = int(stage.expand_chs) // 2
    if type(stage) is CrossStage:  # [xs, transition_b(blocks(xb))]: xs waits

        def split(x: Tensor) -> tuple[Tensor, Tensor]:
            xs, xb = torch.split(x, half, dim=1)
            return xs, xb

        def cat(xs: Tensor, xb: Tensor) -> Tensor:
            return torch.cat([xs, stage.conv_transition_b(xb).contiguous()], dim=1)

        return CrossPart(split, tuple(stage.blocks), cat)

    def split3(x: Tensor) -> tuple[Tensor, Tensor]:  # CrossStage3: [blocks(x1), x2]: x2 waits
        x1, x2 = torch.split(x, half, dim=1)
        return x2, x1

    def cat3(x2: Tensor, x1: Tensor) -> Tensor:
        return torch.cat([x1, x2], dim=1)

    return CrossPart(split3, tuple(stage.blocks), cat3)


def _units(m: Any) -> list[nn.Module | CrossPart]:
    units: list[nn.Module | CrossPart] = []
    for stage in m.stages:
        if type(stage) is DarkStage:
            units += [stage.conv_down, *stage.blocks]
        else:
            units += [stage.conv_down, stage.conv_exp, _cross_part(stage), stage.conv_transition]
    return units


def channel_refusal(module: nn.Module, where: str) -> str | None:
    """Why a 1x1 ``ConvNormAct`` (a cross stage's expansion and transitions) is not a channel op (``None``: it is)."""
    ops = conv_norm_act_ops(module)
    why = path_refusal(ops, where)
    if why is None and path_of(ops):
        why = f"{where} is not a 1x1 stride-1 conv; it has a rule here as a channel op only"
    return why


def _block_refusal(blk: Any, where: str) -> str | None:
    if type(blk) not in _BLOCKS:
        return f"{where} is {type(blk).__name__}; only timm's DarkBlock, BottleneckBlock and EdgeBlock are supported"
    if not isinstance(blk.drop_path, (nn.Identity, DropPath)):
        return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
    why = path_refusal(_branch_modules(blk), f"{where}'s branch")
    if why is None and type(blk) is BottleneckBlock:
        why = path_refusal([blk.act3], f"{where}'s activation after the sum")
    if why is None and any(isinstance(op, Window) for op in path_of(_branch_modules(blk))):
        why = f"{where}'s branch changes the grid; a block's branch must keep it to join the identity"
    return why


def _stage_refusal(stage: Any, s: int) -> str | None:
    if type(stage) not in (DarkStage, CrossStage, CrossStage3):
        return f"stage {s} is {type(stage).__name__}; only timm's DarkStage, CrossStage and CrossStage3 are supported"
    if stage.conv_down is None:  # CrossStage3 without a downsample: timm's forward calls it anyway
        return f"stage {s} ({type(stage).__name__}) has no conv_down, which timm's forward calls; give the stage a stride"
    why = path_refusal(conv_norm_act_ops(stage.conv_down), f"stage {s}'s conv_down")
    if why is None and type(stage) is not DarkStage:
        transitions = ["conv_exp", "conv_transition"] + (["conv_transition_b"] if type(stage) is CrossStage else [])
        for name in transitions:
            why = why or channel_refusal(getattr(stage, name), f"stage {s}'s {name}")
    for i, blk in enumerate(stage.blocks):
        why = why or _block_refusal(blk, f"stage {s} block {i}")
    return why


def headed_refusal(m: Any, parts: Sequence[Any], part_refusal: Callable[[Any, int], str | None]) -> str | None:
    """Why a model with a ``stem`` of ``ConvNormAct``\\ s, ``parts`` after it and timm's ``ClassifierHead`` has no label
    rule: its head's, its stem's, or its first refused part's reason (``part_refusal(part, index)``); ``None``: it has."""
    why = classifier_head_refusal(m.head) or path_refusal(conv_norm_act_ops(m.stem), "the stem")
    for i, part in enumerate(parts):
        why = why or part_refusal(part, i)
    return why


def cspnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm CspNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not CspNet:
        return f"{type(model).__name__} is not a timm CspNet"
    m: Any = model
    return headed_refusal(m, m.stages, _stage_refusal)


def run_branch(modules: Sequence[nn.Module], drop_path: nn.Module | None, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """A residual branch's ``modules`` in turn on ``x``, then its stochastic depth (``None``, an identity: none),
    with the draw exposed: the branch's output and who kept it."""
    for module in modules:
        x = module(x)
    return branch(drop_path, x) if isinstance(drop_path, DropPath) else (x, None)


class AdaptedCspNet(HeadedConvNet):
    """A timm CspNet (DarkNet or CSP stages) returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = CSPNET_FAMILY
    refusal = staticmethod(cspnet_refusal)

    def _blocks(self) -> Sequence[nn.Module | CrossPart]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) in _BLOCKS

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block ``forward`` with the drop-path draw exposed (a stage's other units: themselves)."""
        if type(blk) not in _BLOCKS:
            return blk(x), None
        h, keep = run_branch(_branch(blk), blk.drop_path, x)
        return (blk.act3(h + x) if type(blk) is BottleneckBlock else h + x), keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) not in _BLOCKS:
            return path_of(conv_norm_act_ops(blk)), None
        return path_of(_branch_modules(blk)), ()


def tiny_cfg(attn_layer: str | None = None, avg_down: bool = False) -> CspModelCfg:
    """Three DarkNet stages on a 32x32 image: grids 32 (stem, stride 1), 16, 8, 4; the second stage two blocks."""
    return CspModelCfg(
        stem=CspStemCfg(out_chs=8, kernel_size=3, stride=1, pool=""),
        stages=CspStagesCfg(
            depth=(1, 2, 1), out_chs=(16, 24, 32), stride=2, bottle_ratio=0.5, block_ratio=1.0,
            avg_down=avg_down, attn_layer=attn_layer, stage_type="dark", block_type="dark",
        ),
    )  # fmt: skip


CSP_KINDS = {
    "csp": {"stage_type": "csp", "block_type": "bottle", "expand_ratio": 2.0, "cross_linear": True},
    "csp_dark": {"stage_type": "csp", "block_type": "dark", "block_ratio": 0.5, "down_growth": True},
    "cs3": {"stage_type": "cs3", "block_type": "dark", "block_ratio": 0.5},
    "cs3_edge": {"stage_type": "cs3", "block_type": "edge", "block_ratio": 0.5, "bottle_ratio": 1.5},
}
"""Tiny cross-stage configurations: CrossStage with BottleneckBlocks (cspresnet50's expansion and linear cross) or
DarkBlocks (cspdarknet53's), CrossStage3 with DarkBlocks (cs3darknet) or EdgeBlocks (cs3edgenet)."""


def tiny_csp_cfg(kind: str = "csp", attn_layer: str | None = None, groups: int = 1) -> CspModelCfg:
    """Three cross stages on a 32x32 image: grids 32 (stem, stride 1), 16, 8, 4; the second stage two blocks."""
    stages: dict[str, Any] = {"bottle_ratio": 0.5, **CSP_KINDS[kind]}
    return CspModelCfg(
        stem=CspStemCfg(out_chs=8, kernel_size=3, stride=1, pool=""),
        stages=CspStagesCfg(depth=(1, 2, 1), out_chs=(16, 24, 32), stride=2, attn_layer=attn_layer, groups=groups, **stages),
    )


FAMILY = Family(
    name="cspnet",
    description=CSPNET_FAMILY,
    refusal=AdaptedCspNet.refusal,
    build=AdaptedCspNet,
    example=tiny(CspNet, cfg=tiny_csp_cfg("csp"), zero_init_last=False, drop_path_rate=0.1),  # cross stages: a fork/join
    timm_modules=("cspnet",),
    speed_model="darknet17",
)
