"""Adapter for timm's PVT v2: spatial-reduction attention and the depthwise conv inside the MLP.

Events per block ``layer`` (blocks counted over all stages):

- attention: keys and values come from a reduced grid (a ``sr_ratio`` strided conv, or
  the ``linear`` variant's adaptive average pool to 7x7); their labels are reduced the
  same way, ``Norm(sum_i Y_i)`` over each key's window (an average for the pool), and
  ``residual(layer, keep, mixed=mean_h(A_h) Y_kv)`` with ``Y = labels_for(layer)`` (the
  mix fused into timm's attention when that is on);
- MLP: ``fc1 -> dwconv -> act -> fc2``: the depthwise 3x3 conv is a spatial mix,
  ``Norm(T(K)) Y`` with the normalised absolute kernel (``backbones._convnet.apply_path``; every
  block's kernels computed together);
  ``residual(layer, keep, mixed=...)`` on ``labels_for(layer)`` asked again (the labels
  after the attention residual). One layer index serves both mixes.
- patch embeddings are overlapping strided convs (7x7 stride 4, then 3x3 stride 2 per
  stage): ``aggregate`` sums the labels under every window (zero padding adds nothing).
  For the stem the labels start on the pixel grid (``TokenLayout.grid`` is ``(H, W)``),
  so every first-stage token gets the exact source fractions of its 7x7 receptive field;
  a MixToken map (mixed in token space) starts on the stem's token grid instead;
- readout: ``pool("mean", 0)`` (no class token: TransMix refuses).

Shapes: ``b`` batch, ``h w`` grid, ``n`` tokens, ``m`` reduced keys, ``c`` channels, ``l`` labels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models.pvt_v2 import Attention, Block, MlpWithDepthwiseConv, PyramidVisionTransformerV2
from torch import Tensor, nn

from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, explicit_mix, conv_aggregate, mix_token_space, start_on_stem
from mixlabels.backbones._convnet import Kernels, read_kernels, residual_labels
from mixlabels.backbones._windows import window_means
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedPVTv2", "PVT_FAMILY", "reduced_key_labels"]

PVT_FAMILY = (
    "timm PyramidVisionTransformerV2 (spatial-reduction or linear attention with reduced key labels, depthwise "
    "conv in the MLP as spatial mix, overlapping patch embeddings as aggregation; global average pooling)"
)


def _pvt_refusal(model: nn.Module) -> str | None:
    if type(model) is not PyramidVisionTransformerV2:
        return f"{type(model).__name__} is not a timm PyramidVisionTransformerV2"
    m: Any = model
    if m.global_pool != "avg":
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    convs = [("the stem", m.patch_embed.proj)] + [(f"stage {i}'s downsampling", s.downsample.proj) for i, s in enumerate(m.stages) if s.downsample is not None]
    for what, conv in convs:
        why = check_static_conv(conv, what)
        if why is not None:
            return why
    for i, stage in enumerate(m.stages):
        for blk in stage.blocks:
            if type(blk) is not Block or type(blk.attn) is not Attention or type(blk.mlp) is not MlpWithDepthwiseConv:
                return f"stage {i} has a block other than timm's pvt_v2 Block with Attention and MlpWithDepthwiseConv"
            why = check_static_conv(blk.mlp.dwconv, f"stage {i}'s MLP dwconv", depthwise=True)
            if why is not None:
                return why
    return None


def reduced_key_labels(attn: Any, labels: Tensor, grid: tuple[int, int]) -> Tensor:
    """Labels of the keys/values of a spatial-reduction attention: ``(b, n, l) -> (b, m, l)`` rows on the simplex."""
    if attn.pool is not None:  # linear PVT v2: adaptive average pool of the grid (then a 1x1 conv)
        y = rearrange(labels, "b (h w) l -> b l h w", h=grid[0])
        return rearrange(F.adaptive_avg_pool2d(y, attn.pool.output_size), "b l h w -> b (h w) l")
    if attn.sr is None:
        return labels
    return window_means(labels, grid, attn.sr.kernel_size, attn.sr.stride, attn.sr.padding)[0]


def _keys_values(attn: Any, x: Tensor, grid: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """timm's ``Attention.forward`` up to ``q, k, v`` ``(b, h, n|m, d)``."""
    q = rearrange(attn.q(x), "b n (h d) -> b h n d", h=attn.num_heads)
    if attn.pool is not None:
        t = attn.sr(attn.pool(rearrange(x, "b (h w) c -> b c h w", h=grid[0])))
        x = attn.act(attn.norm(rearrange(t, "b c h w -> b (h w) c")))
    elif attn.sr is not None:
        x = attn.norm(rearrange(attn.sr(rearrange(x, "b (h w) c -> b c h w", h=grid[0])), "b c h w -> b (h w) c"))
    k, v = rearrange(attn.kv(x), "b m (two h d) -> two b h m d", two=2, h=attn.num_heads)
    return q, k, v


def _mlp_in(mlp: Any, x: Tensor, grid: tuple[int, int]) -> Tensor:
    out: Tensor = mlp.relu(rearrange(mlp.fc1(x), "b (h w) c -> b c h w", h=grid[0]))
    return out


def _mlp_out(mlp: Any, t: Tensor) -> Tensor:
    return mlp.drop(mlp.fc2(mlp.drop(mlp.act(rearrange(t, "b c h w -> b (h w) c")))))  # type: ignore[no-any-return]


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Stem output ``(b, h, w, c)``, the stem's token grid, and the grid the labels start on."""
    grid = check_batch(images, label_map, tuple(m.patch_embed.proj.stride))
    x = m.patch_embed(images)
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=True), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])



class AdaptedPVTv2(AdaptedBase):
    """A timm PVT v2 whose forward also returns the scheme's aligned targets (pooled readout)."""

    family = PVT_FAMILY
    refusal = staticmethod(_pvt_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.stages)
        tracker = start_on_stem(self.scheme, label_map, start, grid, depth, m.patch_embed.proj)
        kernels = read_kernels([blk for stage in m.stages for blk in stage.blocks], tracker, lambda blk: (blk.mlp.dwconv,))
        layer = 0
        for stage in m.stages:
            if stage.downsample is not None:
                grid = conv_aggregate(tracker, grid, stage.downsample.proj)
                x = stage.downsample(x)  # b c h w -> b h w c
            x = rearrange(x, "b h w c -> b (h w) c")
            for blk in stage.blocks:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker, grid=grid, kernels=kernels), x)
                layer += 1
            x = rearrange(stage.norm(x), "b (h w) c -> b c h w", h=grid[0])
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(rearrange(x, "b c h w -> b (h w) c"))) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.stages for blk in stage.blocks)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels | None) -> Tensor:
        attn, labels, mixed = blk.attn, tracker.labels_for(layer), None
        q, k, v = _keys_values(attn, blk.norm1(x), grid)
        y = reduced_key_labels(attn, labels, grid) if labels is not None else None  # b m l
        if attn.fused_attn:
            dropout_p = attn.attn_drop.p if attn.training else 0.0
            if y is not None:
                out, mixed = attention_with_labels(q, k, v, y, attn.scale, dropout_p)
            else:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:
            a = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # b h n m
            if y is not None:
                mixed = explicit_mix(a, y)
            out = attn.attn_drop(a) @ v
        out = attn.proj_drop(attn.proj(rearrange(out, "b h n d -> b n (h d)")))
        out, keep = branch(blk.drop_path1, out)
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        mlp = blk.mlp
        t = mlp.dwconv(_mlp_in(mlp, blk.norm2(x), grid))
        out, keep = branch(blk.drop_path2, _mlp_out(mlp, t))
        # the labels after the attention residual; the conv's residual folded into its matrix on a GPU's small grids
        residual_labels(tracker, layer, keep, tracker.labels_for(layer), (mlp.dwconv,), grid, kernels)
        return x + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit attention, explicit reduction / convolution / merge matrices, dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.stages)
        rules = DenseRules(self.scheme, label_map, start, 0, depth)
        if start != grid:
            stem = m.patch_embed.proj
            rules.aggregate(conv_matrix(start, torch.ones(stem.kernel_size), stem.stride, stem.padding)[0])
        layer = 0
        for stage in m.stages:
            if stage.downsample is not None:
                conv = stage.downsample.proj
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
                x = stage.downsample(x)
            x = rearrange(x, "b h w c -> b (h w) c")
            for blk in stage.blocks:
                attn = blk.attn
                q, k, v = _keys_values(attn, blk.norm1(x), grid)
                a = torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)  # b h n m
                out = attn.proj(rearrange(F.dropout(a, attn.attn_drop.p, attn.training) @ v, "b h n d -> b n (h d)"))
                out, keep = _drop(blk.drop_path1, out)
                rules.mix(layer, a.detach().double().mean(dim=1) @ _reduction_matrix(attn, grid), keep)
                x = x + out
                mlp = blk.mlp
                kernel = kernel_reference(mlp.dwconv.weight)
                matrix, _ = conv_matrix(grid, kernel, padding=mlp.dwconv.padding, dilation=mlp.dwconv.dilation)
                out, keep = _drop(blk.drop_path2, _mlp_out(mlp, mlp.dwconv(_mlp_in(mlp, blk.norm2(x), grid))))
                rules.mix(layer, row_normalise(matrix), keep)
                x = x + out
                layer += 1
            x = rearrange(stage.norm(x), "b (h w) c -> b c h w", h=grid[0])
        output = m.forward_head(x)
        token_logits = m.head(m.head_drop(rearrange(x, "b c h w -> b (h w) c"))) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _reduction_matrix(attn: Any, grid: tuple[int, int]) -> Tensor:
    """``(m, n)`` rows on the simplex: which tokens every reduced key averages."""
    n = grid[0] * grid[1]
    if attn.pool is not None:
        size = attn.pool.output_size
        oh, ow = (size, size) if isinstance(size, int) else size
        rows = []
        for i in range(oh):
            for j in range(ow):
                cell = torch.zeros(grid, dtype=torch.float64)
                # adaptive pooling bins: [floor(i h / oh), ceil((i + 1) h / oh))
                cell[(i * grid[0]) // oh : -(-(i + 1) * grid[0] // oh), (j * grid[1]) // ow : -(-(j + 1) * grid[1] // ow)] = 1.0
                rows.append(cell.flatten())
        return row_normalise(torch.stack(rows))
    if attn.sr is None:
        return torch.eye(n, dtype=torch.float64)
    return row_normalise(conv_matrix(grid, torch.ones(attn.sr.kernel_size), attn.sr.stride, attn.sr.padding)[0])


FAMILY = Family(
    name="pvt_v2",
    description=PVT_FAMILY,
    refusal=AdaptedPVTv2.refusal,
    build=AdaptedPVTv2,
    example=tiny("pvt_v2_b0", depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=(2, 2)),
    timm_modules=("pvt_v2",),
    speed_model="pvt_v2_b0",
)
