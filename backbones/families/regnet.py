"""Adapter for timm's RegNet class (RegNetX, RegNetY, RegNetZ-free pre-activation variants, timm's ``_tv`` ones).

The label rules of ``backbones._convnet`` (as for ResNet) on RegNet's blocks. Events per block
``layer`` (blocks counted over the four stages):

- ``Bottleneck``: ``ConvNormAct`` 1x1, grouped 3x3 (strided in a stage's first block), SE, 1x1;
  ``PreBottleneck``: the same convs with pre-activation norms (its first norm, before the split,
  is a channel op). The stride-1 grouped 3x3 mixes labels by its (out, in)-averaged normalised
  |kernel| (border-renormalised); a strided one aggregates over its windows; 1x1 convs, norms,
  activations and SE are channel ops;
- the shortcut: identity keeps the labels, a 1x1/2 conv or an avg-pool-then-1x1 downsample
  aggregates over its windows; the branch joins by the residual rule
  (``residual(layer, keep, mixed=P Y)``); a block built without a shortcut (``downsample=''``
  where the width or stride changes) forms every position from its windows: ``aggregate``;
- the stem (3x3 stride-2 conv) aggregates from the pixel grid (a MixToken map starts on its grid);
- readout: ``pool("mean", 0)`` after the 1x1 ``final_conv`` (global average pooling; TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

from einops import rearrange
from timm.layers.drop import DropPath
from timm.models.regnet import Bottleneck, PreBottleneck, RegNet
from torch import Tensor, nn

from mixlabels import AlignedOutput, TokenLabelMap
from mixlabels.backbones._common import AdaptedBase, branch
from mixlabels.backbones._convnet import (
    Path,
    block_kernels,
    block_labels,
    conv_norm_act_ops,
    run_module_stem,
    block_labels_reference,
    path_matrix,
    path_of,
    path_refusal,
    start_on_path,
)
from mixlabels.backbones._dense import DenseRules
from mixlabels.backbones._family import Family, tiny
from timm.models.regnet import RegNetCfg

__all__ = ["AdaptedRegNet", "REGNET_FAMILY", "regnet_refusal"]

REGNET_FAMILY = (
    "timm RegNet (RegNetX/Y, pre-activation variants, conv1x1 or avg-pool shortcuts, static padding): every position "
    "a token; the grouped stride-1 3x3 conv mixes labels by the (out, in)-averaged normalised |kernel| "
    "(border-renormalised); strided convs and pools aggregate over their windows; 1x1 convs, norms, activations, SE "
    "as channel ops; a block's shortcut keeps (or aggregates) the labels and its branch's labels join by the "
    "residual rule; stem from the pixels; global average pooling; stochastic depth"
)


_flat = conv_norm_act_ops  # a module as the ops its forward runs in order


def _branch_modules(blk: Any) -> list[nn.Module]:
    """The branch's modules in timm's ``forward`` order (after a PreBottleneck's ``norm1``, before the sum)."""
    if type(blk) is PreBottleneck:
        return [blk.conv1, blk.norm2, blk.conv2, blk.se, blk.norm3, blk.conv3]
    return _flat(blk.conv1) + _flat(blk.conv2) + [blk.se] + _flat(blk.conv3)


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in (m.s1, m.s2, m.s3, m.s4) for blk in stage.children()]


def regnet_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm RegNet this adapter carries labels through (``None``: it is)."""
    if type(model) is not RegNet:
        return f"{type(model).__name__} is not a timm RegNet"
    m: Any = model
    if m.head.global_pool.pool_type != "avg" or m.head.use_conv:
        return f"the head (global_pool={m.head.global_pool.pool_type!r}, use_conv={m.head.use_conv}) has no label readout; use 'avg' and a linear fc"
    why = path_refusal(_flat(m.stem), "the stem") or path_refusal(_flat(m.final_conv), "the final_conv")
    if why is not None:
        return why
    if path_of(_flat(m.final_conv)):
        return "the final_conv is not a 1x1 stride-1 convolution"
    for i, blk in enumerate(_blocks(m)):
        where = f"block {i}"
        if type(blk) not in (Bottleneck, PreBottleneck):
            return f"{where} is {type(blk).__name__}; only timm's RegNet Bottleneck and PreBottleneck are supported"
        if not isinstance(blk.drop_path, (DropPath, nn.Identity)):
            return f"{where}'s drop_path is {type(blk.drop_path).__name__}, not timm's DropPath"
        mods = _branch_modules(blk) + [blk.norm1 if type(blk) is PreBottleneck else blk.act3]
        why = path_refusal(mods, f"{where}'s branch") or path_refusal(_flat(blk.downsample), f"{where}'s shortcut")
        if why is not None:
            return why
    return None


def _block(blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's block forward with the branch's drop-path draw exposed: the output and who kept the branch."""
    pre = type(blk) is PreBottleneck
    if pre:
        x = blk.norm1(x)
    h = x
    for module in _branch_modules(blk):
        h = module(h)
    keep = None
    if blk.downsample is not None:
        if isinstance(blk.drop_path, DropPath):
            h, keep = branch(blk.drop_path, h)
        h = h + blk.downsample(x)
    return h if pre else blk.act3(h), keep


def _paths(blk: Any) -> tuple[Path, Path | None]:
    return path_of(_branch_modules(blk)), (None if blk.downsample is None else path_of(_flat(blk.downsample)))


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position ``(b, h*w, classes)`` (timm's head without the pooling)."""
    t = rearrange(x, "b c h w -> b (h w) c")
    return m.head.fc(m.head.drop(t))  # type: ignore[no-any-return]


class AdaptedRegNet(AdaptedBase):
    """A timm RegNet returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = REGNET_FAMILY
    refusal = staticmethod(regnet_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, stem, grid, start = run_module_stem(m.stem, images, label_map)
        blocks = _blocks(m)
        tracker = start_on_path(self.scheme, label_map, start, grid, len(blocks), stem)
        paths = [_paths(blk) for blk in blocks]
        kernels = block_kernels(tracker, paths)
        for layer, blk in enumerate(blocks):
            x, keep = _block(blk, x)
            grid = block_labels(tracker, layer, grid, *paths[layer], keep, kernels)
        x = m.final_conv(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices of every path on dense labels."""
        m: Any = self.model
        x, stem, grid, start = run_module_stem(m.stem, images, label_map)
        blocks = _blocks(m)
        rules = DenseRules(self.scheme, label_map, start, 0, len(blocks))
        if not label_map.token_space:
            rules.aggregate(path_matrix(stem, start)[0])
        for layer, blk in enumerate(blocks):
            x, keep = _block(blk, x)
            grid = block_labels_reference(rules, layer, grid, *_paths(blk), keep)
        x = m.final_conv(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="regnet",
    description=REGNET_FAMILY,
    refusal=AdaptedRegNet.refusal,
    build=AdaptedRegNet,
    example=tiny(RegNet, cfg=RegNetCfg(depth=5, w0=8, wa=8.0, wm=1.5, group_size=4, stem_width=8)),
    timm_modules=("regnet",),
    speed_model="regnety_002",
)
