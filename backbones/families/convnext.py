"""Adapter for timm's ConvNeXt: the depthwise convolution as a spatial mix, downsampling as aggregation.

TL-Align Appendix D, ``W^s(Z) = T(K)``. Events per block ``layer``:

- ``conv_dw``: the branch's labels ``Norm(T(K)) Y`` (``Y = labels_for(layer)``) with ``K = mean_c(|K_c| / sum|K_c|)``
  (``backbones._common.conv_mix``: the channels' normalised absolute kernels averaged
  like attention heads, applied with the layer's own padding and dilation, every row
  renormalised over the taps inside the grid); the rest of the block (norm, MLP,
  layer scale, GRN of ConvNeXt V2: per-token or per-channel) is channel mixing;
  then one ``residual(layer, keep, mixed=Norm(T(K)) Y)``: the whole block is one residual branch;
- stem (a ``patch`` stem: ``kernel == stride``): the labels start as the exact area
  fractions of its cells; each stage's downsampling convolution: ``aggregate`` summing
  the labels under its window;
- readout: ``pool("mean", 0)`` (no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from timm.layers.classifier import ClassifierHead, NormMlpClassifierHead
from timm.models.convnext import ConvNeXt, ConvNeXtBlock
from torch import Tensor, nn

from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, mix_token_space, stride_grid
from mixlabels.backbones._convnet import Kernels, aggregate_path, apply_path, fold_labels, path_grid, path_of, residual_labels
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedConvNeXt", "CONVNEXT_FAMILY"]

CONVNEXT_FAMILY = (
    "timm ConvNeXt (v1 and v2/GRN; 'patch' stem; depthwise conv as normalised-absolute-kernel spatial mix; "
    "strided downsampling as aggregation; global average pooling; stochastic depth)"
)


def _convnext_refusal(model: nn.Module) -> str | None:
    if type(model) is not ConvNeXt:
        return f"{type(model).__name__} is not a timm ConvNeXt"
    m: Any = model
    stem = m.stem[0]
    if type(stem) is not nn.Conv2d or stem.kernel_size != stem.stride or stem.padding != (0, 0):
        return "only the 'patch' stem (kernel == stride) has patch tokens; overlapping stems are not supported"
    if not isinstance(m.head, (NormMlpClassifierHead, ClassifierHead)) or m.head.global_pool.pool_type != "avg":
        return "only global average pooling ('avg') has a label readout"
    for i, stage in enumerate(m.stages):
        if not isinstance(stage.downsample, nn.Identity):
            why = check_static_conv(stage.downsample[1], f"stage {i}'s downsampling")
            if why is not None:
                return why
        for j, blk in enumerate(stage.blocks):
            if type(blk) is not ConvNeXtBlock or not isinstance(blk.shortcut, nn.Identity):
                return f"stage {i} block {j} is not a plain ConvNeXtBlock with an identity shortcut"
            why = check_static_conv(blk.conv_dw, f"stage {i} block {j}'s conv_dw", depthwise=True)
            if why is not None:
                return why
    return None


def _branch_tokens(blk: Any, h: Tensor) -> Tensor:
    """Everything after ``conv_dw`` in timm's ``ConvNeXtBlock.forward``: channel mixing only."""
    if blk.use_conv_mlp:
        h = blk.mlp(blk.norm(h))
    else:
        h = rearrange(blk.mlp(blk.norm(rearrange(h, "b c h w -> b h w c"))), "b h w c -> b c h w")
    if blk.gamma is not None:
        h = h.mul(rearrange(blk.gamma, "c -> 1 c 1 1"))
    return h


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The head's classifier on every final position: ``(b, h*w, classes)``."""
    head = m.head
    if isinstance(head, NormMlpClassifierHead):
        t = rearrange(head.norm(x), "b c h w -> b (h w) c")  # LayerNorm2d normalises each position
        return head.fc(head.drop(head.pre_logits(t)))  # type: ignore[no-any-return]
    return head.fc(head.drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


def _stem(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int]]:
    grid = check_batch(images, label_map, tuple(m.stem[0].stride))
    x = m.stem(images)  # b c h w
    if label_map.token_space:
        x = mix_token_space(x, label_map, channels_last=False)
    return x, grid


def _downsample(tracker: LabelTracker, grid: tuple[int, int], conv: nn.Module) -> tuple[int, int]:
    """A stage's strided conv as an ``aggregate`` over its windows (``apply_path``: one cached matrix on small
    grids); returns the grid it makes."""
    path = path_of([conv])
    aggregate_path(tracker, path, grid)
    return path_grid(path, grid)


class AdaptedConvNeXt(AdaptedBase):
    """A timm ConvNeXt whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = CONVNEXT_FAMILY
    refusal = staticmethod(_convnext_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on the patch grid (see ``AdaptedBase.reference_bytes``)."""
        m: Any = self.model
        return stride_grid(label_map, tuple(m.stem[0].stride))

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid = _stem(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.stages)
        tracker = self.scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=depth, class_token=False))
        blocks = [blk for stage in m.stages for blk in stage.blocks]
        kernels = Kernels(blk.conv_dw for layer, blk in enumerate(blocks) if tracker.labels_for(layer) is not None)
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                grid = _downsample(tracker, grid, stage.downsample[1])
            x = stage.downsample(x)
            for blk in stage.blocks:
                x = self._block(blk, x, layer, tracker, grid, kernels)
                layer += 1
        x = m.norm_pre(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels) -> Tensor:
        conv = blk.conv_dw
        out, keep = branch(blk.drop_path, _branch_tokens(blk, conv(x)))
        # the kernel's matrix, input-independent: a cheap l-channel conv (``conv_mix``), its kernel expanded and its
        # in-grid tap weight computed with the other blocks' (``apply_path``); on a GPU's small grids one product
        # with the residual's mean folded in (``residual_labels``). Position-major where the CPU's folded conv pays
        residual_labels(tracker, layer, keep, fold_labels(tracker, layer, grid), (conv,), grid, kernels)
        return out + blk.shortcut(x)  # type: ignore[no-any-return]

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit ``(n, n)`` convolution matrices and ``(n', n)`` merge matrices on dense labels."""
        m: Any = self.model
        x, grid = _stem(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.stages)
        rules = DenseRules(self.scheme, label_map, grid, 0, depth)
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                conv = stage.downsample[1]
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
            x = stage.downsample(x)
            for blk in stage.blocks:
                conv = blk.conv_dw
                kernel = kernel_reference(conv.weight)
                matrix, _ = conv_matrix(grid, kernel, padding=conv.padding, dilation=conv.dilation)
                out, keep = _drop(blk.drop_path, _branch_tokens(blk, conv(x)))
                rules.mix(layer, row_normalise(matrix), keep)
                x = out + x
                layer += 1
        x = m.norm_pre(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="convnext",
    description=CONVNEXT_FAMILY,
    refusal=AdaptedConvNeXt.refusal,
    build=AdaptedConvNeXt,
    example=tiny("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32)),
    timm_modules=("convnext",),
    speed_model="convnext_atto",
)
