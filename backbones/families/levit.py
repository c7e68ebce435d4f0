"""Adapter for timm's LeViT (``levit_*`` and ``levit_conv_*``): attention with learned biases, attention downsampling.

TL-Align Table 10 and Appendix D, applied to LeViT's parts. Events, ``layer`` counting each
``LevitBlock``:

- the stem (``Stem16``: four, ``Stem8``: three 3x3 stride-2 convs with padding 1): labels start
  on the pixels and are summed over each conv's windows in turn (``aggregate``, renormalised);
  a MixToken map starts on the stem's grid instead. Its batch norms and activations: channel ops.
- ``Attention``: ``softmax(q k^T * scale + B)`` with ``B`` the learned ``attention_biases``
  indexed by ``attention_bias_idxs`` (a per-head additive bias by offset); the labels move by
  the head-mean of those rows (``residual`` with ``mixed``). The matrix is built explicitly, as
  timm builds it: q and k have ``key_dim`` channels and v ``attn_ratio * key_dim`` (no widened
  fused call takes unequal head dims) and the bias needs its gradient in training anyway.
- ``AttentionDownsample``: queries from the subsampled grid attend over the full grid, and the
  block has no residual around it (timm: ``x = attn_downsample(x)``), so it is a merge: the
  labels of each subsampled query are its head-mean attention row over the full grid's labels
  (``aggregate`` with that ``(n_q, n_kv)`` matrix; rows already sum to 1).
- ``LevitMlp`` (linear or 1x1 conv with batch norm): channel ops, ``mixed=None``; every residual
  branch goes through timm's ``DropPath`` with the same draw (``keep``).
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses). The
  logits are ``head`` and ``head_dist`` averaged (``LevitDistilled``) or ``head`` alone (``Levit``);
  in distilled training timm returns both and the logits are ``head``'s. Token logits apply the
  head(s) per position with the batch norm's statistics of the pooled features, so their mean
  is the logits.

Shapes: ``b`` batch, ``h`` heads, ``n`` tokens, ``l`` label channels, ``q``/``k`` query and key tokens.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from einops import rearrange, reduce
from timm.models.levit import (
    Attention,
    AttentionDownsample,
    ConvNorm,
    Levit,
    LevitBlock,
    LevitDistilled,
    LevitDownsample,
    LevitMlp,
    LevitStage,
    NormLinear,
    Stem8,
    Stem16,
)
from torch import Tensor, nn

from mixlabels._label_map import fp32_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, branch, check_static_conv, explicit_mix, mix_token_space, start_on_convs
from mixlabels.backbones._dense import DenseRules
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones._fsdp import through_hooks

__all__ = ["AdaptedLeViT", "LEVIT_FAMILY", "levit_refusal"]

LEVIT_FAMILY = (
    "timm Levit / LevitDistilled (levit_*, levit_conv_*): the 3x3 stride-2 conv stem as aggregation from the pixels; "
    "attention with learned attention biases (head-mean rows move the labels); AttentionDownsample as a merge by "
    "its head-mean attention (subsampled queries over the full grid); MLPs with batch norm as channel ops; "
    "global average pooling; head and head_dist averaged; stochastic depth"
)


def _stem_convs(m: Any) -> list[Any]:
    return [mod.linear for mod in m.stem.children() if type(mod) is ConvNorm]


def levit_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be adapted as a LeViT (``None`` if it can)."""
    if type(model) not in (Levit, LevitDistilled):
        return f"{type(model).__name__} is not a timm Levit or LevitDistilled"
    m: Any = model
    if m.global_pool != "avg":
        return f"global_pool={m.global_pool!r} has no label readout; use 'avg'"
    heads = [m.head] + ([m.head_dist] if type(m) is LevitDistilled else [])
    if any(type(h) is not NormLinear for h in heads):
        return "the head is not a NormLinear classifier (num_classes=0?); adapt a model with a classifier"
    if type(m.stem) not in (Stem16, Stem8):
        return f"the stem is {type(m.stem).__name__} (a stem_backbone?); only timm's Stem16 and Stem8 are supported"
    for i, conv in enumerate(_stem_convs(m)):
        why = check_static_conv(conv, f"the stem's conv {i + 1}")
        if why is not None:
            return why
    for i, stage in enumerate(m.stages):
        if type(stage) is not LevitStage:
            return f"stage {i} is {type(stage).__name__}, not a LevitStage"
        ds = stage.downsample
        if not isinstance(ds, nn.Identity) and (type(ds) is not LevitDownsample or type(ds.attn_downsample) is not AttentionDownsample
                                                or type(ds.mlp) is not LevitMlp):
            return f"stage {i}'s downsampling is {type(ds).__name__}; only LevitDownsample (AttentionDownsample, LevitMlp) is supported"
        for j, blk in enumerate(stage.blocks):
            if type(blk) is not LevitBlock or type(blk.attn) is not Attention or type(blk.mlp) is not LevitMlp:
                what = f"{type(blk).__name__} with {type(getattr(blk, 'attn', None)).__name__}, {type(getattr(blk, 'mlp', None)).__name__}"
                return f"stage {i} block {j} is {what}; only LevitBlock with Attention and LevitMlp is supported"
    return None


def _attend(mod: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``Attention`` or ``AttentionDownsample`` forward, also returning its weights ``(b, h, q, k)``.

    The same operations in the same order as timm's, so the output is bit-equal."""
    bias = mod.get_attention_biases(x.device)
    if mod.use_conv:
        b, _, hh, ww = x.shape
        if type(mod) is Attention:
            q, k, v = mod.qkv(x).view(b, mod.num_heads, -1, hh * ww).split([mod.key_dim, mod.key_dim, mod.val_dim], dim=2)
            shape: tuple[int, ...] = (b, -1, hh, ww)
        else:
            k, v = mod.kv(x).view(b, mod.num_heads, -1, hh * ww).split([mod.key_dim, mod.val_dim], dim=2)
            q = mod.q(x).view(b, mod.num_heads, mod.key_dim, -1)
            shape = (b, mod.val_attn_dim, (hh - 1) // mod.stride + 1, (ww - 1) // mod.stride + 1)
        a = ((q.transpose(-2, -1) @ k) * mod.scale + bias).softmax(dim=-1)
        out = (v @ a.transpose(-2, -1)).reshape(shape)
    else:
        b, n, _ = x.shape
        if type(mod) is Attention:
            q, k, v = mod.qkv(x).view(b, n, mod.num_heads, -1).split([mod.key_dim, mod.key_dim, mod.val_dim], dim=3)
            q = q.permute(0, 2, 1, 3)
        else:
            k, v = mod.kv(x).view(b, n, mod.num_heads, -1).split([mod.key_dim, mod.val_dim], dim=3)
            q = mod.q(x).view(b, -1, mod.num_heads, mod.key_dim).permute(0, 2, 1, 3)
        k, v = k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)
        a = (q @ k * mod.scale + bias).softmax(dim=-1)
        out = (a @ v).transpose(1, 2).reshape(b, -1, mod.val_attn_dim)
    return mod.proj(out), a


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """The stem's output (flattened to tokens for the linear variant), its grid, and the grid labels start on."""
    stride = int(m.stem.stride)
    grid = check_batch(images, label_map, (stride, stride))
    first = next(mod for mod in m.modules() if type(mod) in (Attention, AttentionDownsample))
    if tuple(first.resolution) != grid:
        size = tuple(r * stride for r in first.resolution)
        raise ValueError(
            f"{images.shape[-2]}x{images.shape[-1]} images give a {grid[0]}x{grid[1]} grid but the model's attention biases "
            f"were built for {first.resolution[0]}x{first.resolution[1]} (img_size={size[0]}x{size[1]}); feed that size or "
            "create the model with img_size set to your images' size"
        )
    x = m.stem(images)
    if label_map.token_space:
        x = mix_token_space(x, label_map, channels_last=False)
    if not m.use_conv:
        x = rearrange(x, "b c h w -> b (h w) c")
    start = grid if label_map.token_space else (label_map.image_size[0], label_map.image_size[1])
    return x, grid, start


def _depth(m: Any) -> int:
    return sum(len(stage.blocks) for stage in m.stages)


def _token_logits(m: Any, x: Tensor, output: Any) -> Tensor:
    """The head(s) on every position ``(b, n, classes)``, normalised by the statistics their batch norms gave the pooled features."""
    t = rearrange(x, "b c h w -> b (h w) c") if m.use_conv else x
    heads = [m.head] + ([m.head_dist] if type(m) is LevitDistilled and not isinstance(output, tuple) else [])
    logits: list[Tensor] = []
    for head in heads:
        bn = head.bn
        if bn.training:
            pooled = t.mean(dim=1)
            mean, var = pooled.mean(dim=0), pooled.var(dim=0, unbiased=False)
        else:
            mean, var = bn.running_mean, bn.running_var
        logits.append(head.linear(head.drop((t - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias)))
    return torch.stack(logits).mean(dim=0)


def _down_grid(grid: tuple[int, int], stride: int) -> tuple[int, int]:
    return (grid[0] - 1) // stride + 1, (grid[1] - 1) // stride + 1


class AdaptedLeViT(AdaptedBase):
    """A timm LeViT returning the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = LEVIT_FAMILY
    refusal = staticmethod(levit_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        tracker = start_on_convs(self.scheme, label_map, start, grid, _depth(m), _stem_convs(m))  # the stem's strided convs
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                x = self._downsample(stage.downsample, x, tracker)
            for blk in stage.blocks:
                x = through_hooks(blk, functools.partial(self._block, blk, layer=layer, tracker=tracker), x)
                layer += 1
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        logits = output[0] if isinstance(output, tuple) else output
        token_logits = _token_logits(m, x, output) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, logits, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        m: Any = self.model
        return tuple(blk for stage in m.stages for blk in stage.blocks)  # the attention downsampling: the root's

    @staticmethod
    def _downsample(ds: Any, x: Tensor, tracker: LabelTracker) -> Tensor:
        x, a = _attend(ds.attn_downsample, x)
        with torch.no_grad(), fp32_labels(x.device):
            merge_matrix = reduce(a.detach().float(), "b h q k -> b q k", "mean")

        def merge(labels: Tensor) -> Tensor:  # each subsampled query's labels: its attention row over the full grid
            return merge_matrix @ labels

        tracker.aggregate(merge)
        out, _ = branch(ds.drop_path, ds.mlp(x))
        return x + out  # a channel-only branch: the labels stay

    @staticmethod
    def _block(blk: Any, x: Tensor, layer: int, tracker: LabelTracker) -> Tensor:
        labels = tracker.labels_for(layer)
        out, a = _attend(blk.attn, x)
        mixed = None if labels is None else explicit_mix(a, labels)
        out, keep = branch(blk.drop_path1, out)
        x = x + out
        tracker.residual(layer, keep, mixed=mixed)
        out, _ = branch(blk.drop_path2, blk.mlp(x))
        return x + out  # channel ops: the labels stay

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """timm's modules for the output; explicit stem, attention and downsample matrices on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, _depth(m))
        rules.aggregate_convs(start, grid, _stem_convs(m))
        layer = 0
        for stage in m.stages:
            ds = stage.downsample
            if not isinstance(ds, nn.Identity):
                rules.aggregate(_head_mean(ds.attn_downsample, x))
                x = ds.attn_downsample(x)  # timm's own module
                out, _ = branch(ds.drop_path, ds.mlp(x))
                x = x + out
            for blk in stage.blocks:
                matrix = _head_mean(blk.attn, x)
                out, keep = branch(blk.drop_path1, blk.attn(x))
                x = x + out
                rules.mix(layer, matrix, keep)
                out, _ = branch(blk.drop_path2, blk.mlp(x))
                x = x + out
                layer += 1
        output = m.forward_head(x)
        logits = output[0] if isinstance(output, tuple) else output
        token_logits = _token_logits(m, x, output) if self.scheme.needs_token_logits else None
        return rules.result(output, logits, "mean", token_logits)


def _head_mean(mod: Any, x: Tensor) -> Tensor:
    """The reference's attention matrix ``(b, q, k)`` in float64, from timm's projections and the raw bias table."""
    with torch.no_grad():
        if type(mod) is Attention:
            qkv = mod.qkv(x)
            qkv = rearrange(qkv, "b c h w -> b (h w) c") if mod.use_conv else qkv
            per_head = rearrange(qkv, "b n (h d) -> b h n d", h=mod.num_heads)
            q, k = per_head[..., : mod.key_dim], per_head[..., mod.key_dim : 2 * mod.key_dim]
        else:
            kv = mod.kv(x)
            kv = rearrange(kv, "b c h w -> b (h w) c") if mod.use_conv else kv
            k = rearrange(kv, "b n (h d) -> b h n d", h=mod.num_heads)[..., : mod.key_dim]
            q = mod.q(x)
            q = rearrange(q, "b c h w -> b (h w) c") if mod.use_conv else q
            q = rearrange(q, "b n (h d) -> b h n d", h=mod.num_heads)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * mod.scale
        scores = scores + mod.attention_biases.double()[:, mod.attention_bias_idxs]
        matrix: Tensor = scores.softmax(dim=-1).mean(dim=1)
        return matrix


FAMILY = Family(
    name="levit",
    description=LEVIT_FAMILY,
    refusal=AdaptedLeViT.refusal,
    build=AdaptedLeViT,
    example=tiny("levit_128s", img_size=32, embed_dim=(16, 32), key_dim=4, num_heads=(2, 2), depth=(1, 1), stem_type="s8"),
    timm_modules=("levit",),
    speed_model="levit_128s",
)
