"""Adapter for timm's MetaFormer: PoolFormer v1/v2 (pooling), ConvFormer (separable conv), CAFormer (+ attention).

TL-Align Table 10 and Appendix D extended by the same reasoning as for ConvNeXt and
PVT v2: a token mixer moves labels by its normalised absolute weights; strided convs
aggregate; channel operations leave labels alone. Events per block ``layer``:

- ``Pooling`` (PoolFormer): ``pool(x) - x`` with a stride-1 average pool that counts only
  in-grid taps. Its matrix is ``P - I`` (``P`` row ``i``: ``1/m_i`` on the ``m_i`` in-grid
  taps of token ``i``'s window); normalised absolute weights give row ``i``: ``1/2`` on
  token ``i`` itself and ``1/(2(m_i - 1))`` on each other in-grid tap. A 1x1 grid makes the
  branch exactly zero: its labels are the input's (as for a channel branch).
- ``SepConv`` (ConvFormer, CAFormer's first stages): ``pwconv1 -> act -> dwconv -> act ->
  pwconv2``: the depthwise conv is the spatial mix, ``Norm(T(K)) Y`` with ``K`` the channels'
  normalised absolute kernels averaged (``backbones._convnet.apply_path``, as ConvNeXt's; every
  block's kernels computed together).
- ``Attention`` (CAFormer's last stages): ``mean_h(A_h) Y`` fused into the attention call.
- every block: ``residual(layer, keep, mixed=...)`` (token mixer, on ``labels_for(layer)``),
  ``residual(layer, keep, mixed=None)`` (MLP). Layer
  scale and residual scale are per-channel, the norms per token or per sample (timm's
  ``GroupNorm1`` of PoolFormer normalises each sample by statistics over all its tokens: two
  scalars shared by every token move no token's content to another): channel mixing.
- the stem (7x7 stride 4 padding 2) and the downsampling convs (3x3 stride 2 padding 1)
  overlap: ``aggregate`` sums the labels under every window (zero padding adds nothing). The
  labels start on the pixel grid, so every first-stage token gets the exact source
  fractions of its receptive field (as PVT v2's stem); a MixToken map (mixed in token space)
  starts on the stem's token grid instead.
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` tokens, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.norm import LayerNorm2d
from timm.models.metaformer import Attention, MetaFormer, MetaFormerBlock, Pooling, SepConv
from torch import Tensor, nn

from mixlabels._label_map import fp32_labels
from mixlabels._shape_cache import shape_cache
from mixlabels.backbones._attention import attention_with_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, explicit_mix, conv_aggregate, mix_token_space, pool_labels, start_on_stem
from mixlabels.backbones._convnet import Kernels, read_kernels, residual_labels
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._family import Family, tiny
from timm.layers.norm import GroupNorm1
from timm.models.metaformer import LayerNorm2dNoBias
from timm.models.metaformer import LayerNormNoBias
from timm.models.metaformer import Attention as MetaAttention

__all__ = ["AdaptedMetaFormer", "METAFORMER_FAMILY", "pooling_mix"]

METAFORMER_FAMILY = (
    "timm MetaFormer: PoolFormer v1/v2 (pooling token mixer pool(x) - x as normalised-absolute spatial mix: "
    "1/2 self, 1/2 over the other in-grid taps), ConvFormer (separable conv: its depthwise conv as ConvNeXt's), "
    "CAFormer (those stages, then attention); overlapping stem and downsampling convs as aggregation; layer/res "
    "scale and per-token or per-sample norms as channel ops; global average pooling; stochastic depth"
)


def _pool_refusal(pool: Any, where: str) -> str | None:
    p = pool.pool
    k = p.kernel_size if isinstance(p.kernel_size, int) else p.kernel_size[0]
    if (
        type(p) is not nn.AvgPool2d or p.count_include_pad or p.ceil_mode or p.divisor_override is not None
        or p.stride not in (1, (1, 1)) or p.kernel_size not in (k, (k, k)) or k % 2 == 0 or p.padding not in (k // 2, (k // 2, k // 2))
    ):
        return f"{where}'s pooling is not a same-size odd-window AvgPool2d(stride=1, count_include_pad=False)"
    return None


def _metaformer_refusal(model: nn.Module) -> str | None:
    if type(model) is not MetaFormer:
        return f"{type(model).__name__} is not a timm MetaFormer"
    m: Any = model
    if m.head.global_pool.pool_type != "avg":
        return f"global_pool={m.head.global_pool.pool_type!r} has no label readout; use 'avg'"
    if not isinstance(m.head.norm, (LayerNorm2d, nn.Identity)):
        return f"the head's norm is {type(m.head.norm).__name__}; only LayerNorm2d (per position) or none is supported"
    convs = [("the stem", m.stem.conv)] + [(f"stage {i}'s downsampling", s.downsample.conv) for i, s in enumerate(m.stages) if not isinstance(s.downsample, nn.Identity)]
    for what, conv in convs:
        why = check_static_conv(conv, what)
        if why is not None:
            return why
    for i, stage in enumerate(m.stages):
        for j, blk in enumerate(stage.blocks):
            where = f"stage {i} block {j}"
            mixer = blk.token_mixer
            if type(blk) is not MetaFormerBlock or type(mixer) not in (Pooling, SepConv, Attention):
                return f"{where} has token mixer {type(mixer).__name__}; only Pooling, SepConv and Attention are supported"
            why = None
            if type(mixer) is Pooling:
                why = _pool_refusal(mixer, where)
            elif type(mixer) is SepConv:
                why = check_static_conv(mixer.dwconv, f"{where}'s SepConv dwconv", depthwise=True)
            if why is not None:
                return why
    return None


@shape_cache(maxsize=64)
def _pooling_weights(grid: tuple[int, int], kernel: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(1, n, 1)`` fp32 each: row ``i``'s weight on its own labels and on its window's mean (a constant of the grid
    and the window: cached; ``torch.compile`` traces it as constants)."""
    ones = torch.ones(1, 1, grid[0], grid[1], device=device)
    count = F.avg_pool2d(ones, kernel, 1, kernel // 2, count_include_pad=True) * (kernel * kernel)  # in-grid taps
    count = rearrange(count, "1 1 h w -> 1 (h w) 1")
    several = count > 1
    others = 1 / (2 * (count - 1).clamp_min(1.0))  # each other tap's weight, where there are others
    own = torch.where(several, 0.5 - others, torch.ones_like(count))
    mean = torch.where(several, count * others, torch.zeros_like(count))  # the mean of all m taps, own included
    return own, mean


def pooling_mix(labels: Tensor, grid: tuple[int, int], kernel: int) -> Tensor:
    """Labels through PoolFormer's ``pool(x) - x`` by its normalised absolute weights ``(b, n, l)`` fp32.

    Row ``i``: ``Y_i / 2 + (S_i - Y_i) / (2 (m_i - 1))`` with ``S_i`` the sum of the labels in
    token ``i``'s in-grid window of ``m_i`` taps; ``Y_i`` where ``m_i = 1`` (the branch is zero). Computed as
    ``own_i Y_i + mean_i (S_i / m_i)``: the window mean is the same average pool timm runs (in-grid taps only, on
    the labels viewed ``(b, l, h, w)``), the two weights constants of the grid, three operators a block.
    """
    with fp32_labels(labels.device):
        y = labels.float()
        window_mean = F.avg_pool2d(rearrange(y, "b (h w) l -> b l h w", h=grid[0]), kernel, 1, kernel // 2, count_include_pad=False)
        own, mean = _pooling_weights(grid, kernel, y.device)
        return torch.addcmul(y * own, rearrange(window_mean, "b l h w -> b (h w) l"), mean)


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Stem output ``(b, c, h, w)``, the stem's token grid, and the grid the labels start on."""
    grid = check_batch(images, label_map, tuple(m.stem.conv.stride))
    x = m.stem(images)
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the stem made a {tuple(x.shape[2:])} grid, not {grid}; use an image size divisible by 4")
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _heads(m: Any, x: Tensor) -> Tensor:
    """The classifier on every final position: ``(b, h*w, classes)`` (head norm per position)."""
    t = rearrange(m.head.norm(x), "b c h w -> b (h w) c")
    return m.head.fc(m.head.drop(t))  # type: ignore[no-any-return]


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = rearrange(attn.qkv(x), "b n (three h d) -> three b h n d", three=3, h=attn.num_heads)
    return q, k, v


def _attn_out(attn: Any, out: Tensor) -> Tensor:
    return attn.proj_drop(attn.proj(rearrange(out, "b h n d -> b n (h d)")))  # type: ignore[no-any-return]


def _to_tokens(stage: Any, x: Tensor) -> Tensor:
    return x if stage.use_nchw else rearrange(x, "b c h w -> b (h w) c")


def _to_grid(stage: Any, x: Tensor, grid: tuple[int, int]) -> Tensor:
    return x if stage.use_nchw else rearrange(x, "b (h w) c -> b c h w", h=grid[0])


class AdaptedMetaFormer(AdaptedBase):
    """A timm MetaFormer (PoolFormer, ConvFormer, CAFormer) returning the scheme's aligned targets."""

    family = METAFORMER_FAMILY
    refusal = staticmethod(_metaformer_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.stages)
        tracker = start_on_stem(self.scheme, label_map, start, grid, depth, m.stem.conv)
        # every read SepConv's depthwise label kernel, computed together on the first read
        blocks = [blk for stage in m.stages for blk in stage.blocks]
        kernels = read_kernels(blocks, tracker, lambda blk: [blk.token_mixer.dwconv] if type(blk.token_mixer) is SepConv else [])
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                grid = conv_aggregate(tracker, grid, stage.downsample.conv)
                x = stage.downsample(x)
            x = _to_tokens(stage, x)
            for blk in stage.blocks:
                x = self._block(blk, x, layer, tracker, grid, kernels)
                layer += 1
            x = _to_grid(stage, x, grid)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _heads(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def _block(self, blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels | None) -> Tensor:
        mixer, labels, mixed = blk.token_mixer, tracker.labels_for(layer), None
        h = blk.norm1(x)
        if type(mixer) is Attention:
            q, k, v = _qkv(mixer, h)
            dropout_p = mixer.attn_drop.p if mixer.training else 0.0
            if not mixer.fused_attn:
                a = ((q @ k.transpose(-2, -1)) * mixer.scale).softmax(dim=-1)  # timm's explicit path
                if labels is not None:
                    mixed = explicit_mix(a, labels)
                out = mixer.attn_drop(a) @ v
            elif labels is not None:
                out, mixed = attention_with_labels(q, k, v, labels, mixer.scale, dropout_p)
            else:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            out = _attn_out(mixer, out)
        else:
            out = mixer(h)
            if labels is not None and type(mixer) is Pooling:
                mixed = pooling_mix(labels, grid, _pool_kernel(mixer))
        out, keep = branch(blk.drop_path1, out)
        if type(mixer) is SepConv:
            # its depthwise conv, input-independent: a cheap l-channel conv (on a GPU's small grids, the residual's
            # mean folded into its matrix: ``residual_labels``)
            residual_labels(tracker, layer, keep, labels, (mixer.dwconv,), grid, kernels)
        else:
            tracker.residual(layer, keep, mixed=mixed)
        x = blk.res_scale1(x) + blk.layer_scale1(out)
        out, keep = branch(blk.drop_path2, blk.mlp(blk.norm2(x)))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return blk.res_scale2(x) + blk.layer_scale2(out)  # type: ignore[no-any-return]

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices (pooling, convolution, attention, merges) on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        depth = sum(len(stage.blocks) for stage in m.stages)
        rules = DenseRules(self.scheme, label_map, start, 0, depth)
        if start != grid:
            stem = m.stem.conv
            rules.aggregate(conv_matrix(start, torch.ones(stem.kernel_size), stem.stride, stem.padding)[0])
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                conv = stage.downsample.conv
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
                x = stage.downsample(x)
            x = _to_tokens(stage, x)
            for blk in stage.blocks:
                mixer = blk.token_mixer
                h = blk.norm1(x)
                if type(mixer) is Attention:
                    q, k, v = _qkv(mixer, h)
                    a = torch.softmax(q @ k.transpose(-2, -1) * mixer.scale, dim=-1)  # b h n n
                    out = _attn_out(mixer, F.dropout(a, mixer.attn_drop.p, mixer.training) @ v)
                    matrix = a.detach().double().mean(dim=1)
                elif type(mixer) is Pooling:
                    out = mixer(h)
                    matrix = _pooling_matrix(grid, _pool_kernel(mixer)).unsqueeze(0)
                else:
                    out = mixer(h)
                    conv = mixer.dwconv
                    kernel = kernel_reference(conv.weight)
                    matrix = row_normalise(conv_matrix(grid, kernel, padding=conv.padding, dilation=conv.dilation)[0]).unsqueeze(0)
                out, keep = _drop(blk.drop_path1, out)
                rules.mix(layer, matrix, keep)
                x = blk.res_scale1(x) + blk.layer_scale1(out)
                x = blk.res_scale2(x) + blk.layer_scale2(_drop(blk.drop_path2, blk.mlp(blk.norm2(x)))[0])
                layer += 1
            x = _to_grid(stage, x, grid)
        output = m.forward_head(x)
        token_logits = _heads(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _pool_kernel(mixer: Any) -> int:
    k = mixer.pool.kernel_size
    return int(k if isinstance(k, int) else k[0])


def _pooling_matrix(grid: tuple[int, int], kernel: int) -> Tensor:
    """``Norm(|P - I|)`` ``(n, n)`` float64 written out; rows of a zero ``P - I`` (1x1 grid) are ``I``."""
    ones, _ = conv_matrix(grid, torch.ones(kernel, kernel), padding=(kernel // 2, kernel // 2))  # 0/1 windows
    weights = (row_normalise(ones) - torch.eye(ones.shape[0], dtype=torch.float64)).abs()
    sums = weights.sum(dim=-1, keepdim=True)
    return torch.where(sums > 0, weights / sums.clamp_min(1e-300), torch.eye(ones.shape[0], dtype=torch.float64))


FAMILY = Family(
    name="metaformer",
    description=METAFORMER_FAMILY,
    refusal=AdaptedMetaFormer.refusal,
    build=AdaptedMetaFormer,
    example=tiny(MetaFormer, depths=(1, 1, 1), dims=(8, 16, 32), token_mixers=(Pooling, SepConv, MetaAttention),
        norm_layers=(GroupNorm1, LayerNorm2dNoBias, LayerNormNoBias), head_dim=16),
    timm_modules=("metaformer",),
    speed_model="poolformerv2_s12",
)
