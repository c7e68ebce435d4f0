"""Adapter for timm's RepViT (``repvit_*``), with its training-time branches or ``fuse()``\\ d for inference.

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on RepViT's parts;
a reparameterisable token mixer by the one kernel it fuses into, as in ``fastvit`` (folded with
``backbones._reparam``: every norm's scale of a forward in one pass). Events, ``layer`` counting every ``RepViTBlock`` and every
``RepVitDownsample``'s FFN:

- the stem (two 3x3 stride-2 ``ConvNorm``\\ s): the labels start on the pixels and aggregate over
  both convs' windows (a MixToken map starts on the stem's grid);
- ``RepVggDw`` (every block's token mixer): ``bn(conv_kxk(x) + conv_1x1(x) + x)``, three depthwise
  branches at the same positions with the identity INSIDE the sum: no residual, but one conv with the
  summed kernel (each branch scaled by its norm's ``gamma / sqrt(running_var + eps)``, the 1x1 and
  the identity as centre taps: the kernel timm's ``fuse`` writes), so the labels ``aggregate`` by
  that kernel's conv rule; a ``fuse()``\\ d model's depthwise conv holds that very kernel. The
  squeeze-excite after it is a channel gate;
- ``RepVitMlp`` (a block's channel mixer, the downsampling's FFN): 1x1 convs and norms around an
  identity: ``residual(layer, None, mixed=None)`` (RepViT has no stochastic depth);
- ``RepVitDownsample``: its pre-block (a block as above), a strided depthwise conv aggregating over
  its windows, a 1x1 conv, then the FFN residual;
- readout: ``pool("mean", 0)``; ``NormLinear`` (batch norm, linear) and the distillation head
  ``head_dist`` on the same pooled features are channel ops, their logits averaged (in distilled
  training timm returns both and the loss reads ``head``'s). Token logits apply the heads per
  position with the statistics their batch norms gave the pooled features: their mean is the logits.

The label kernel reads the norms' running statistics in training too: the rule is the reparameterised
model's, the same for a model trained with branches and for it after ``fuse()``.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models.repvit import (
    ConvNorm,
    NormLinear,
    RepVggDw,
    RepVit,
    RepVitClassifier,
    RepViTBlock,
    RepVitDownsample,
    RepVitMlp,
    RepVitStem,
)
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, KernelBatch, KernelConv, Path, conv_norm_act_ops, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._reparam import Scales, add_centre, folded, joined, parted, scales_of

__all__ = ["AdaptedRepViT", "REPVIT_FAMILY", "repvit_refusal", "repvgg_kernel", "repvgg_kernels"]

REPVIT_FAMILY = (
    "timm RepViT (repvit_*, training-time branches or fuse()d): every position a token; the RepVggDw token mixer "
    "(depthwise kxk, 1x1 and identity summed, no residual) aggregates by the normalised |kernel| of the one conv it "
    "fuses into (border-renormalised); strided stem and downsampling convs aggregate over their windows; 1x1 convs, "
    "norms, activations, squeeze-excite as channel ops; the MLP residuals keep the labels; global average pooling; "
    "the distillation head averaged as a channel op"
)

_LAYERS = (RepViTBlock, RepVitDownsample)
"""The units with a residual (the channel mixer, the FFN): the layers a scheme counts."""


# ---------------------------------------------------------------------------------------------- the fused kernel
def _norm(module: nn.Module) -> nn.Module | None:
    """A batch norm timm's ``fuse`` folds; ``None``: no norm (an ``Identity``)."""
    return module if isinstance(module, nn.BatchNorm2d) else None


def _fold(weights: Sequence[Tensor], norms: Sequence[nn.Module | None], scales: Scales) -> Tensor:
    """Weights (one tensor, or the parts of one joined along the channels) scaled per output channel by their
    norms' fold scales (all of them norms, or all ``None``: unscaled)."""
    present = [n for n in norms if n is not None]
    return joined(weights) if not present else folded(weights, present, scales)


def _conv_of(module: Any) -> Any:
    """A ``ConvNorm``'s conv (the legacy 1x1 branch); a bare conv as itself."""
    return module.c if type(module) is ConvNorm else module


def repvgg_norms(dw: nn.Module) -> tuple[nn.Module, ...]:
    """The batch norms ``RepVggDw.fuse()`` folds: the kxk branch's, the legacy 1x1's, the shared one."""
    d: Any = dw
    norms = [_norm(d.conv.bn), None if type(d.conv1) is nn.Conv2d else _norm(d.conv1.bn), _norm(d.bn)]
    return tuple(n for n in norms if n is not None)


def repvgg_kernel(dw: nn.Module, scales: Scales | None = None) -> Tensor:
    """The ``(c, 1, k, k)`` kernel timm's ``RepVggDw.fuse()`` writes: the kxk and 1x1 branches, each scaled by its
    norm, plus the identity as centre taps, then the shared norm's scale (``legacy``: each branch has its own).
    Computed here rather than by ``fuse()``, which builds convs whose init would draw from the global RNG.
    ``scales``: the norms' fold scales where computed together with others' (``_reparam``)."""
    return repvgg_kernels([dw], scales)[0]


def repvgg_kernels(dws: Sequence[nn.Module], scales: Scales | None = None) -> list[Tensor]:
    """``repvgg_kernel`` of several ``RepVggDw`` alike (``_batch_key``: kernel shape, legacy or not, which norms),
    in one pass over their weights and scales concatenated along the channels (the same elementwise operations:
    the same bits)."""
    ds: list[Any] = list(dws)
    s = scales_of(n for d in ds for n in repvgg_norms(d)) if scales is None else scales
    with torch.no_grad():
        k = _fold([d.conv.c.weight for d in ds], [_norm(d.conv.bn) for d in ds], s)
        if type(ds[0].conv1) is nn.Conv2d:  # a bare conv
            one = joined([d.conv1.weight for d in ds])
        else:  # a ConvNorm (legacy)
            one = _fold([d.conv1.c.weight for d in ds], [_norm(d.conv1.bn) for d in ds], s)
        ph, pw = k.shape[-2] // 2, k.shape[-1] // 2
        k = add_centre(k + F.pad(one, [pw, pw, ph, ph]), 1.0)  # the sum is a new tensor: the identity adds in place
        k = _fold([k], [_norm(d.bn) for d in ds], s).detach()
        return parted(k, [int(d.conv.c.weight.shape[0]) for d in ds])


def _batch_key(dw: Any) -> tuple[Any, ...]:
    """What ``repvgg_kernels`` needs alike of the modules it builds together."""
    w = dw.conv.c.weight
    legacy = type(dw.conv1) is not nn.Conv2d
    norms = (_norm(dw.conv.bn) is None, legacy and _norm(dw.conv1.bn) is None, _norm(dw.bn) is None)
    return ("repvgg", tuple(w.shape[1:]), legacy, norms, w.dtype, w.device)


def _fused_conv(dw: Any) -> KernelConv:
    """A ``RepVggDw`` as the one stride-1 conv it fuses into (its kxk branch's geometry)."""
    conv = dw.conv.c
    return KernelConv(functools.partial(repvgg_kernel, dw), (int(conv.padding[0]), int(conv.padding[1])),
                      (int(conv.dilation[0]), int(conv.dilation[1])), repvgg_norms(dw), KernelBatch(_batch_key(dw), dw, repvgg_kernels))


# ---------------------------------------------------------------------------------------------- refusals
def _repvgg_refusal(dw: Any, where: str) -> str | None:
    conv, one = dw.conv.c, _conv_of(dw.conv1)
    why = path_refusal([conv, dw.conv.bn, one, *conv_norm_act_ops(dw.conv1)[1:], dw.bn], where)
    if why is not None:
        return why
    kh, kw = conv.kernel_size
    shapes_fit = tuple(conv.weight.shape[:2]) == tuple(one.weight.shape[:2]) == (conv.in_channels, 1)
    if conv.stride != (1, 1) or one.kernel_size != (1, 1) or one.stride != (1, 1) or not shapes_fit or kh % 2 == 0 or kw % 2 == 0:
        return f"{where} is not timm's RepVggDw (stride-1 depthwise odd kxk and 1x1 convs beside the identity)"
    return None


def _mlp_refusal(mlp: Any, where: str) -> str | None:
    if type(mlp) is not RepVitMlp:
        return f"{where} is {type(mlp).__name__}, not timm's RepVitMlp"
    ops = conv_norm_act_ops(mlp.conv1) + [mlp.act] + conv_norm_act_ops(mlp.conv2)
    why = path_refusal(ops, where)
    if why is None and path_of(ops):
        return f"{where} mixes positions: only 1x1 stride-1 convs keep the MLP residual's labels"
    return why


def _block_refusal(blk: Any, where: str) -> str | None:
    if type(blk) is not RepViTBlock:
        return f"{where} is {type(blk).__name__}, not timm's RepViTBlock"
    mixer = blk.token_mixer
    why = _repvgg_refusal(mixer, f"{where}'s token mixer") if type(mixer) is RepVggDw else path_refusal([mixer], f"{where}'s token mixer")
    return why or path_refusal([blk.se], f"{where}'s squeeze-excite") or _mlp_refusal(blk.channel_mixer, f"{where}'s channel mixer")


def repvit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm RepViT this adapter carries labels through (``None``: it is)."""
    if type(model) is not RepVit:
        return f"{type(model).__name__} is not a timm RepVit"
    m: Any = model
    if m.global_pool != "avg":
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    if type(m.head) is RepVitClassifier:
        if type(m.head.head) is not NormLinear:
            return "the classifier has no head (num_classes=0?); adapt a model with a classifier"
    elif type(m.head) is not nn.Linear:
        return f"the head is {type(m.head).__name__}, not timm's RepVitClassifier (or the nn.Linear fuse() makes of it)"
    if type(m.stem) is not RepVitStem:
        return f"the stem is {type(m.stem).__name__}, not timm's RepVitStem"
    why = path_refusal(_stem_modules(m), "the stem")
    for i, stage in enumerate(m.stages):
        ds = stage.downsample
        if why is None and type(ds) is RepVitDownsample:
            where = f"stage {i}'s downsampling"
            ops = conv_norm_act_ops(ds.spatial_downsample) + conv_norm_act_ops(ds.channel_downsample)
            why = _block_refusal(ds.pre_block, f"{where}'s pre-block") or path_refusal(ops, where) or _mlp_refusal(ds.ffn, f"{where}'s FFN")
        elif why is None and not isinstance(ds, nn.Identity):
            why = f"stage {i}'s downsampling is {type(ds).__name__}, not timm's RepVitDownsample"
        for j, blk in enumerate(stage.blocks):
            why = why or _block_refusal(blk, f"stage {i} block {j}")
    return why


# ---------------------------------------------------------------------------------------------- the model's parts
def _stem_modules(m: Any) -> list[nn.Module]:
    return conv_norm_act_ops(m.stem.conv1) + [m.stem.act1] + conv_norm_act_ops(m.stem.conv2)


def _units(m: Any) -> list[nn.Module]:
    """Every unit after the stem, in forward order: a block is its token mixer (no residual), then the block itself
    standing for its squeeze-excite and channel-mixer residual; a downsampling is its pre-block, its strided conv,
    its 1x1 conv, then itself standing for its FFN residual."""
    units: list[nn.Module] = []
    for stage in m.stages:
        ds = stage.downsample
        if type(ds) is RepVitDownsample:
            units += [ds.pre_block.token_mixer, ds.pre_block, ds.spatial_downsample, ds.channel_downsample, ds]
        units += [unit for blk in stage.blocks for unit in (blk.token_mixer, blk)]
    return units


def _position_norm(norm: nn.BatchNorm1d, t: Tensor) -> Tensor:
    """``norm`` on every position ``(b, n, c)``, with the statistics it gives the pooled features in training."""
    if norm.training:
        pooled = t.mean(dim=1)  # b c
        mean, var = pooled.mean(dim=0), pooled.var(dim=0, unbiased=False)
    else:
        mean, var = norm.running_mean, norm.running_var  # type: ignore[assignment]
    return (t - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


class AdaptedRepViT(AdaptedConvNet):
    """A timm RepViT returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = REPVIT_FAMILY
    refusal = staticmethod(repvit_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        return _stem_modules(self.model)

    def _blocks(self) -> list[nn.Module]:
        return _units(self.model)

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) in _LAYERS

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's forward of a unit (``_units``): the residuals as timm adds them, every other unit as itself."""
        if type(blk) is RepViTBlock:
            x = blk.se(x)
            return x + blk.channel_mixer(x), None
        if type(blk) is RepVitDownsample:
            return blk.ffn(x) + x, None
        return blk(x), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) in _LAYERS:
            return (), ()  # channel ops around an identity shortcut
        if type(blk) is RepVggDw:
            return (_fused_conv(blk),), None
        return path_of(conv_norm_act_ops(blk)), None  # a fuse()d token mixer, a downsampling's strided or 1x1 conv

    def _logits(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The head(s) on every final position ``(b, h*w, k)``: ``head``'s in distilled training, else the average."""
        m: Any = self.model
        t = m.head_drop(rearrange(x, "b c h w -> b (h w) c"))
        if type(m.head) is nn.Linear:  # fuse()d: both heads folded into one linear
            return m.head(t)  # type: ignore[no-any-return]
        cls, t = m.head, m.head.head_drop(t)
        both = cls.distillation and not (cls.training and cls.distilled_training)
        heads = [cls.head, cls.head_dist] if both else [cls.head]
        return torch.stack([head.l(_position_norm(head.bn, t)) for head in heads]).mean(dim=0)


FAMILY = Family(
    name="repvit",
    description=REPVIT_FAMILY,
    refusal=AdaptedRepViT.refusal,
    build=AdaptedRepViT,
    example=tiny(RepVit, embed_dim=(8, 16, 24), depth=(2, 1, 1)),
    timm_modules=("repvit",),
    speed_model="repvit_m0_9",
)
