"""Adapter for timm's FocalNet: focal modulation as a gated mix of depthwise-conv context levels.

Focal modulation (per token ``i``): ``out_i = q_i * h(sum_l g_l(i) ctx_l(i) + g_G(i) ctx_G)`` with
``ctx_0 = z`` (a 1x1 projection of the token), ``ctx_l = GELU(DW_l(ctx_{l-1}))`` (a chain of depthwise
convs, each level seeing a wider window), ``ctx_G = GELU(mean_j ctx_L(j))`` (the global level,
every token), the gates ``g`` per token and level (a 1x1 projection, shared by all channels),
``q`` and ``h`` per token (channel ops). The label rule follows the spatial paths by their
normalised absolute weights, as attention's rows do (TL-Align Table 10, Appendix D):

- level ``l``'s spatial mix is the chain of the first ``l`` depthwise convs, each as ConvNeXt's
  ``Norm(T(K))`` (channels' normalised ``|K|`` averaged, border-renormalised), composed:
  ``M_l = C_l ... C_1``; the global level averages ``M_L``'s labels over all tokens: ``M_G = (1/n) 1 1^T M_L``.
- token ``i`` combines the levels by its normalised absolute gates
  ``w_l(i) = |g_l(i)| / sum_k |g_k(i)|`` (the gates are per token and level and shared by the
  channels, so they are to the levels what an attention row is to the tokens):
  ``mixed_i = sum_l w_l(i) (M_l Y)_i + w_G(i) (M_G Y)_i``.
- the block's residuals: ``residual(layer, keep, mixed=...)`` for the modulation, ``mixed=None``
  for the MLP; layer scale, post norms (per position) and ``normalize_modulator`` (a scalar) are
  channel ops.
- stem and downsampling convs (patch, or overlapping for the large models): ``aggregate`` over
  their windows; a patch stem starts the labels on its grid (exact area fractions), an
  overlapping one on the pixels (``start_on_stem``).
- readout: ``pool("mean", 0)`` (no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` tokens, ``l`` label channels, ``k`` levels.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from einops import rearrange
from timm.layers.classifier import ClassifierHead, NormMlpClassifierHead
from timm.models.focalnet import FocalModulation, FocalNet, FocalNetBlock
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels._label_map import fp32_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, conv_aggregate, mix_token_space, start_on_stem, stride_grid
from mixlabels.backbones._convnet import Kernels, walk_path
from mixlabels.backbones._windows import as_tokens
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import is_sharded, through_hooks

__all__ = ["AdaptedFocalNet", "FOCALNET_FAMILY", "gate_weights"]

FOCALNET_FAMILY = (
    "timm FocalNet (focal modulation: every context level's chain of depthwise convs as normalised-absolute-kernel "
    "mixes, the global level as the mean over all tokens, combined per token by its normalised absolute gates; "
    "q, h, gates, norms, layer scale as channel ops; patch or overlapping stem and downsampling as aggregation; "
    "global average pooling; stochastic depth)"
)


def _focalnet_refusal(model: nn.Module) -> str | None:
    if type(model) is not FocalNet:
        return f"{type(model).__name__} is not a timm FocalNet"
    m: Any = model
    if not isinstance(m.head, (ClassifierHead, NormMlpClassifierHead)) or m.head.global_pool.pool_type != "avg":
        return f"global_pool={m.head.global_pool.pool_type!r} has no label readout; use 'avg'"
    convs = [("the stem", m.stem.proj)] + [(f"stage {i}'s downsampling", s.downsample.proj) for i, s in enumerate(m.layers) if not isinstance(s.downsample, nn.Identity)]
    for what, conv in convs:
        why = check_static_conv(conv, what)
        if why is not None:
            return why
    for i, stage in enumerate(m.layers):
        for j, blk in enumerate(stage.blocks):
            where = f"stage {i} block {j}"
            if type(blk) is not FocalNetBlock or type(blk.modulation) is not FocalModulation:
                return f"{where} is {type(blk).__name__}; only timm's FocalNetBlock with FocalModulation is supported"
            levels: Any = blk.modulation.focal_layers
            for k, level in enumerate(levels):
                why = check_static_conv(level[0], f"{where}'s focal level {k} conv", depthwise=True)
                if why is not None:
                    return why
    return None


def gate_weights(gates: Tensor) -> Tensor:
    """Every token's normalised absolute gates ``(b, k, h, w) -> (b, h*w, k)`` fp32 (uniform where all are 0)."""
    with torch.no_grad():
        return rearrange(_grid_gate_weights(gates), "b k h w -> b (h w) k")


def _grid_gate_weights(gates: Tensor) -> Tensor:
    """``gate_weights`` in the gates' own layout ``(b, k, h, w)``; no graph where called under ``no_grad`` (no detach
    dispatched). A token whose gates are all 0 (0 / 0 is NaN) gets uniform weights, as one with a NaN gate does."""
    g = gates.float().abs()
    return torch.nan_to_num(g / g.sum(dim=1, keepdim=True), nan=1.0 / int(g.shape[1]))


def _modulation(mod: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``FocalModulation.forward``, also returning the gates ``(b, k, h, w)``."""
    x = mod.f(x)
    q, ctx, gates = torch.split(x, mod.input_split, 1)
    ctx_all: Tensor | float = 0.0
    for i, level in enumerate(mod.focal_layers):
        ctx = level(ctx)
        ctx_all = ctx_all + ctx * gates[:, i : i + 1]
    ctx_global = mod.act(ctx.mean((2, 3), keepdim=True))
    ctx_all = ctx_all + ctx_global * gates[:, mod.focal_level :]
    if mod.normalize_modulator:
        ctx_all = ctx_all / (mod.focal_level + 1)
    out = mod.proj_drop(mod.proj(mod.norm(q * mod.h(ctx_all))))
    return out, gates


def focal_mix(mod: Any, labels: Tensor, grid: tuple[int, int], gates: Tensor, kernels: Kernels | None = None) -> Tensor:
    """The modulation's label mix ``(b, n, l)`` fp32: levels by their conv chains, the global level by the
    mean of the last, combined per token by ``gate_weights(gates)``. ``kernels``: the forward's label kernels
    (``_focal_kernels``), else the modulation's own are computed together here.

    The levels run in whichever layout the route leaves them (``walk_path``: the grid, as the gates come, on a
    large grid), the gates are weighed in that layout, and the labels change layout once, not twice a level."""
    kernels = _focal_kernels([mod]) if kernels is None else kernels
    y, on_grid = labels, False
    levels: list[Tensor] = []
    for level in mod.focal_layers:
        y, on_grid, _ = walk_path((level[0],), y, grid, kernels, on_grid=on_grid)
        levels.append(y)
    with torch.no_grad(), fp32_labels(labels.device):  # the gates carry the graph; no detach dispatched
        w = _grid_gate_weights(gates)  # b k h w
        if on_grid:  # labels b l h w: a level's weights b 1 h w, the global level's labels b l 1 1
            parts, last = w.unsqueeze(1).unbind(2), y.mean(dim=(2, 3), keepdim=True)
        else:  # labels b n l: a level's weights b n 1, the global level's labels b 1 l
            parts, last = rearrange(w, "b k h w -> b (h w) 1 k").unbind(-1), y.mean(dim=1, keepdim=True)
        mixed = levels[0] * parts[0] if levels else parts[-1] * last  # the global level alone: no level
        for term, weight in zip([*levels[1:], last] if levels else [], parts[1:]):
            mixed = torch.addcmul(mixed, term, weight)
        return as_tokens(mixed) if on_grid else mixed


def _focal_kernels(modulations: Sequence[Any]) -> Kernels:
    """The label kernels of every focal level's depthwise conv of ``modulations``, computed together (``Kernels``)."""
    return Kernels(level[0] for mod in modulations for level in mod.focal_layers)


def _focal_matrix(mod: Any, grid: tuple[int, int], gates: Tensor) -> Tensor:
    """The same as one explicit ``(b, n, n)`` float64 matrix: ``sum_l diag(w_l) M_l + diag(w_G) M_G``."""
    w = gate_weights(gates).double()  # b n k
    n = grid[0] * grid[1]
    chain = torch.eye(n, dtype=torch.float64)
    matrix = torch.zeros(w.shape[0], n, n, dtype=torch.float64)
    for i, level in enumerate(mod.focal_layers):
        conv = level[0]
        k = kernel_reference(conv.weight)
        chain = row_normalise(conv_matrix(grid, k, padding=conv.padding, dilation=conv.dilation)[0]) @ chain
        matrix = matrix + w[:, :, i : i + 1] * chain
    glob = torch.full((n, n), 1.0 / n, dtype=torch.float64) @ chain
    return matrix + w[:, :, -1:] * glob


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Stem output, its grid, and the grid the labels start on (a patch stem's own grid, else the pixels)."""
    stem = m.stem.proj
    grid = check_batch(images, label_map, tuple(stem.stride))
    x = m.stem(images)
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the stem made a {tuple(x.shape[2:])} grid, not {grid}; use an image size divisible by 4")
    patch = stem.kernel_size == stem.stride and stem.padding == (0, 0)
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (grid if patch else (label_map.image_size[0], label_map.image_size[1]))


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The head's classifier on every final position ``(b, h*w, classes)`` (norms per position)."""
    head = m.head
    if isinstance(head, NormMlpClassifierHead):
        t = rearrange(head.norm(x), "b c h w -> b (h w) c")
        return head.fc(head.drop(head.pre_logits(t)))  # type: ignore[no-any-return]
    return head.fc(head.drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


class AdaptedFocalNet(AdaptedBase):
    """A timm FocalNet returning the scheme's aligned targets (pooled readout)."""

    family = FOCALNET_FAMILY
    refusal = staticmethod(_focalnet_refusal)

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The reference's labels start on a patch stem's grid, else on the pixels (as ``_embed`` decides)."""
        m: Any = self.model
        stem = m.stem.proj
        if label_map.token_space or (stem.kernel_size == stem.stride and stem.padding == (0, 0)):
            return stride_grid(label_map, tuple(stem.stride))
        return label_map.image_size[0], label_map.image_size[1]

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.layers)
        tracker = start_on_stem(self.scheme, label_map, start, grid, depth, m.stem.proj)
        blocks = [blk for stage in m.layers for blk in stage.blocks]
        # all label kernels at once; under FSDP2's per-block sharding each block's weights are whole only inside its
        # own hooked call, so each block computes its own there
        kernels = None if any(is_sharded(blk) for blk in blocks) else _focal_kernels([blk.modulation for blk in blocks])
        layer = 0
        for stage in m.layers:
            if not isinstance(stage.downsample, nn.Identity):
                grid = conv_aggregate(tracker, grid, stage.downsample.proj)
                x = stage.downsample(x)
            for blk in stage.blocks:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker, grid=grid, kernels=kernels), x)
                layer += 1
        x = m.norm(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.layers for blk in stage.blocks)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels | None) -> Tensor:
        labels = tracker.labels_for(layer)
        out, gates = _modulation(blk.modulation, blk.norm1(x))
        mixed = None if labels is None else focal_mix(blk.modulation, labels, grid, gates, kernels)
        out, keep = branch(blk.drop_path1, blk.ls1(blk.norm1_post(out)))
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.ls2(blk.norm2_post(blk.mlp(blk.norm2(x)))))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit per-sample ``(b, n, n)`` modulation matrices and merge matrices on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.layers)
        rules = DenseRules(self.scheme, label_map, start, 0, depth)
        if start != grid:
            stem = m.stem.proj
            rules.aggregate(conv_matrix(start, torch.ones(stem.kernel_size), stem.stride, stem.padding)[0])
        layer = 0
        for stage in m.layers:
            if not isinstance(stage.downsample, nn.Identity):
                conv = stage.downsample.proj
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
                x = stage.downsample(x)
            for blk in stage.blocks:
                out, gates = _modulation(blk.modulation, blk.norm1(x))
                out, keep = branch(blk.drop_path1, blk.ls1(blk.norm1_post(out)))
                rules.mix(layer, _focal_matrix(blk.modulation, grid, gates), keep)
                x = x + out
                x = x + branch(blk.drop_path2, blk.ls2(blk.norm2_post(blk.mlp(blk.norm2(x)))))[0]
                layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


FAMILY = Family(
    name="focalnet",
    description=FOCALNET_FAMILY,
    refusal=AdaptedFocalNet.refusal,
    build=AdaptedFocalNet,
    example=tiny(FocalNet, embed_dim=8, depths=(1, 1, 1)),
    timm_modules=("focalnet",),
    speed_model="focalnet_tiny_srf",
)
