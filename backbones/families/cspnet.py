"""Adapter for timm's CspNet module in its DarkNet form (``darknet17/21/53``, ``darknetaa53``, ``sedarknet21``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on DarkNet's stages; the head's
readout is VoVNet's (``classifier_head_refusal``, ``classifier_head_positions`` from ``families/vovnet.py``). Units
after the stem, in order: each ``DarkStage``'s ``conv_down`` (not a layer), then its ``DarkBlock``\\ s, one layer each:

- ``conv_down`` (a 3x3 conv, strided: its windows; or ``darknetaa53``'s 2x2 average pool then a 1x1 conv) has no
  shortcut: it forms every position from its windows, so its labels ``aggregate``;
- a ``DarkBlock`` (1x1 conv, an optional channel gate (SE), 3x3 conv) adds its branch to the identity: the branch's
  stride-1 3x3 conv mixes labels by its (out, in)-averaged normalised |kernel| (border-renormalised), and joins
  the kept labels by the residual rule, with the block's drop path;
- the stem (``ConvNormAct``\\ s, strided ones aggregating, and an optional max pool) starts from the pixels (a
  MixToken map on its grid);
- readout: ``pool("mean", 0)``, timm's ``ClassifierHead`` with average pooling.

The CSP forms (``CrossStage``: cspresnet*, cspresnext50, cspdarknet53; ``CrossStage3``: cs3*) are refused: they split
the channels and run residual blocks on one half only, and a residual event acts on every channel's labels (the
tracker holds one label map per position), so a residual rule inside one branch of a concatenation has no event here.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from timm.layers.drop import DropPath
from timm.models.cspnet import CspModelCfg, CspNet, CspStagesCfg, CspStemCfg, CrossStage, CrossStage3, DarkBlock, DarkStage
from torch import Tensor, nn

from mixlabels.backbones._common import branch
from mixlabels.backbones._convnet import AdaptedConvNet, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.vovnet import classifier_head_positions, classifier_head_refusal

__all__ = ["AdaptedCspNet", "CSPNET_FAMILY", "cspnet_refusal"]

CSPNET_FAMILY = (
    "timm CspNet in its DarkNet form (DarkNet-17/21/53, DarkNet-AA-53, SE-DarkNet-21): every position a token; "
    "stride-1 3x3 convs mix labels by the (out, in)-averaged normalised |kernel| (border-renormalised); strided convs "
    "and pools aggregate over their windows (a stage's conv_down has no shortcut: it aggregates); 1x1 convs, norms, "
    "activations, SE as channel ops; a DarkBlock's branch joins the identity's labels by the residual rule; stem from "
    "the pixels; global average pooling; stochastic depth. CSP stages (CrossStage, CrossStage3) are refused"
)


def _branch_modules(blk: Any) -> list[nn.Module]:
    """A ``DarkBlock``'s branch in the order of timm's ``forward`` (before the sum with the identity)."""
    return [*conv_norm_act_ops(blk.conv1), blk.attn, *conv_norm_act_ops(blk.conv2)]


def _units(m: Any) -> list[nn.Module]:
    return [unit for stage in m.stages for unit in [stage.conv_down, *stage.blocks]]


def cspnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm CspNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not CspNet:
        return f"{type(model).__name__} is not a timm CspNet"
    m: Any = model
    why = classifier_head_refusal(m.head) or path_refusal(conv_norm_act_ops(m.stem), "the stem")
    if why is not None:
        return why
    for s, stage in enumerate(m.stages):
        if type(stage) in (CrossStage, CrossStage3):
            return (f"stage {s} is {type(stage).__name__}: it splits the channels and runs residual blocks on one half "
                    "only, and a residual event moves every channel's labels, so a residual rule inside one branch of "
                    "a concatenation has no event here; only DarkStage (darknet*) is supported")
        if type(stage) is not DarkStage:
            return f"stage {s} is {type(stage).__name__}; only timm's DarkStage is supported"
        why = path_refusal(conv_norm_act_ops(stage.conv_down), f"stage {s}'s conv_down")
        if why is not None:
            return why
        for i, blk in enumerate(stage.blocks):
            where = f"stage {s} block {i}"
            if type(blk) is not DarkBlock:
                return f"{where} is {type(blk).__name__}; only timm's DarkBlock is supported"
            if not isinstance(blk.drop_path, (nn.Identity, DropPath)):
                return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
            why = path_refusal(_branch_modules(blk), f"{where}'s branch")
            if why is not None:
                return why
    return None


class AdaptedCspNet(AdaptedConvNet):
    """A timm CspNet (DarkNet stages) returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = CSPNET_FAMILY
    refusal = staticmethod(cspnet_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return conv_norm_act_ops(m.stem)

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is DarkBlock

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's ``DarkBlock.forward`` with the drop-path draw exposed (a stage's ``conv_down``: itself)."""
        if type(blk) is not DarkBlock:
            return blk(x), None
        h = blk.conv2(blk.attn(blk.conv1(x)))
        h, keep = branch(blk.drop_path, h) if isinstance(blk.drop_path, DropPath) else (h, None)
        return h + x, keep

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is not DarkBlock:
            return path_of(conv_norm_act_ops(blk)), None
        return path_of(_branch_modules(blk)), ()

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return classifier_head_positions(m.head, x)


def tiny_cfg(attn_layer: str | None = None, avg_down: bool = False) -> CspModelCfg:
    """Three DarkNet stages on a 32x32 image: grids 32 (stem, stride 1), 16, 8, 4; the second stage two blocks."""
    return CspModelCfg(
        stem=CspStemCfg(out_chs=8, kernel_size=3, stride=1, pool=""),
        stages=CspStagesCfg(
            depth=(1, 2, 1), out_chs=(16, 24, 32), stride=2, bottle_ratio=0.5, block_ratio=1.0,
            avg_down=avg_down, attn_layer=attn_layer, stage_type="dark", block_type="dark",
        ),
    )  # fmt: skip


FAMILY = Family(
    name="cspnet",
    description=CSPNET_FAMILY,
    refusal=AdaptedCspNet.refusal,
    build=AdaptedCspNet,
    example=tiny(CspNet, cfg=tiny_cfg(), zero_init_last=False, drop_path_rate=0.1),
    timm_modules=("cspnet",),
    speed_model="darknet17",
)
