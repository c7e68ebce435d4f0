"""Adapter for timm's EfficientFormer (v1: ``efficientformer_l1/l3/l7``): pooling stages, then attention with biases.

TL-Align Table 10 and Appendix D, by the reasoning already used for PoolFormer and LeViT. Events,
``layer`` counting every ``MetaBlock2d`` and ``MetaBlock1d``:

- the stem (``Stem4``: two 3x3 stride-2 convs with padding 1) and each stage's ``Downsample``
  (a 3x3 stride-2 conv): labels start on the pixels and are summed over every window
  (``aggregate``, renormalised); a MixToken map starts on the stem's grid instead.
- ``MetaBlock2d``: the token mixer is PoolFormer's ``pool(x) - x`` (a stride-1 average pool that
  counts only in-grid taps), so its labels are ``backbones.families.metaformer.pooling_mix``'s: by the
  normalised absolute weights of ``P - I``, half on the token itself, half over the other
  in-grid taps. Its ``ConvMlpWithNorm`` (1x1 convs, batch norms) and layer scales: channel ops.
- ``Flat``: the grid becomes a token sequence in the same row-major order; labels stay.
- ``MetaBlock1d``: ``softmax(q k^T * scale + B)`` with ``B`` the learned ``attention_biases``
  indexed by offset (as LeViT's); the labels move by the head-mean of those rows. The matrix is
  built as timm builds it (q and k have ``key_dim`` channels, v ``attn_ratio * key_dim``: no
  widened fused call takes unequal head dims, and the bias needs its gradient anyway).
- readout: the final norm (per token), then the mean over tokens: ``pool("mean", 0)``; the logits
  are ``head`` and ``head_dist`` averaged, or, in distilled training (timm returns both),
  ``head``'s. Both heads are linear, so the per-token logits average to the logits.

Shapes: ``b`` batch, ``h`` heads, ``n`` tokens, ``c`` channels, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from timm.layers.drop import DropPath
from timm.layers.mlp import Mlp
from timm.models.efficientformer import (
    Attention,
    ConvMlpWithNorm,
    Downsample,
    EfficientFormer,
    Flat,
    MetaBlock1d,
    MetaBlock2d,
    Pooling,
    Stem4,
)
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import (
    AdaptedBase,
    branch,
    check_static_conv,
    conv_aggregate,
    explicit_mix,
    mix_token_space,
    start_on_convs,
)
from mixlabels.backbones._dense import DenseRules, conv_matrix
from mixlabels.backbones._dense import drop_path_reference as _drop
from mixlabels.backbones.families.metaformer import _pool_kernel, _pool_refusal, _pooling_matrix, pooling_mix
from mixlabels.backbones._family import Family

__all__ = ["AdaptedEfficientFormer", "EFFICIENTFORMER_FAMILY", "efficientformer_refusal", "tiny_efficientformer"]

EFFICIENTFORMER_FAMILY = (
    "timm EfficientFormer (v1, efficientformer_l1/l3/l7): conv stem and strided downsampling convs as aggregation; "
    "PoolFormer's pooling token mixer pool(x) - x by its normalised absolute weights (1/2 self, 1/2 over the other "
    "in-grid taps); attention with learned attention biases in the last stage (head-mean rows move the labels); "
    "1x1-conv MLPs, norms and layer scales as channel ops; global average pooling, head and head_dist averaged; "
    "stochastic depth"
)


def _stem_convs(m: Any) -> list[Any]:
    return [m.stem.conv1, m.stem.conv2]


def _blocks(m: Any) -> list[Any]:
    return [blk for stage in m.stages for blk in stage.blocks]


def _depth(m: Any) -> int:
    return sum(1 for blk in _blocks(m) if type(blk) is not Flat)


def _drop_path_refusal(blk: Any, where: str) -> str | None:
    for name in ("drop_path1", "drop_path2"):
        if type(getattr(blk, name)) not in (nn.Identity, DropPath):
            return f"{where}'s {name} is {type(getattr(blk, name)).__name__}, not timm's DropPath"
    return None


def _mlp_input(blk: Any, x: Tensor) -> Tensor:
    """What the block's MLP reads: ``MetaBlock1d`` normalises first, ``MetaBlock2d``'s MLP has its own norms."""
    return x if type(blk) is MetaBlock2d else blk.norm2(x)


def efficientformer_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm EfficientFormer this adapter carries labels through (``None``: it is)."""
    if type(model) is not EfficientFormer:
        return f"{type(model).__name__} is not a timm EfficientFormer (v1)"
    m: Any = model
    if m.global_pool != "avg":
        return f"global_pool={m.global_pool!r} returns per-token outputs, no image logits to align; use 'avg'"
    if type(m.stem) is not Stem4:
        return f"the stem is {type(m.stem).__name__}, not timm's Stem4"
    convs: list[tuple[str, Any]] = [("the stem's first conv", m.stem.conv1), ("the stem's second conv", m.stem.conv2)]
    convs += [(f"stage {i}'s downsampling", s.downsample.conv) for i, s in enumerate(m.stages) if type(s.downsample) is Downsample]
    for what, conv in convs:
        why = check_static_conv(conv, what)
        if why is not None:
            return why
    flat = False
    for i, stage in enumerate(m.stages):
        if not isinstance(stage.downsample, (nn.Identity, Downsample)):
            return f"stage {i}'s downsample is {type(stage.downsample).__name__}, not timm's Downsample"
        for j, blk in enumerate(stage.blocks):
            where = f"stage {i} block {j}"
            if type(blk) is Flat:
                flat = True
            elif type(blk) is MetaBlock2d and not flat:
                if type(blk.token_mixer) is not Pooling or type(blk.mlp) is not ConvMlpWithNorm:
                    return f"{where}'s token mixer or MLP is not timm's Pooling / ConvMlpWithNorm"
                why = _pool_refusal(blk.token_mixer, where) or _drop_path_refusal(blk, where)
                if why is not None:
                    return why
            elif type(blk) is MetaBlock1d and flat:
                if type(blk.token_mixer) is not Attention or type(blk.mlp) is not Mlp:
                    return f"{where}'s token mixer or MLP is not timm's EfficientFormer Attention / Mlp"
                why = _drop_path_refusal(blk, where)
                if why is not None:
                    return why
            else:
                return f"{where} is {type(blk).__name__} where the stage expects {'MetaBlock1d' if flat else 'MetaBlock2d or Flat'}"
    return None


def _attend(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's EfficientFormer ``Attention`` step by step: its output ``(b, n, c)`` and its matrix ``(b, h, n, n)``."""
    b, n, _ = x.shape
    idxs = attn.attention_bias_idxs
    if int(idxs.shape[0]) != n:
        side = int(round(int(idxs.shape[0]) ** 0.5))
        raise ValueError(
            f"EfficientFormer's attention biases are for a {side}x{side} grid ({int(idxs.shape[0])} tokens) but the last "
            f"stage has {n}: its images are 32x that side (224 px for timm's models); resize the images to it"
        )
    qkv = rearrange(attn.qkv(x), "b n (h d) -> b h n d", h=attn.num_heads)
    q, k, v = qkv.split([attn.key_dim, attn.key_dim, attn.val_dim], dim=3)
    a = ((q @ k.transpose(-2, -1)) * attn.scale + attn.get_attention_biases(x.device)).softmax(dim=-1)
    return attn.proj(rearrange(a @ v, "b h n d -> b n (h d)")), a


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Stem output ``(b, c, h, w)``, its grid, and the grid the labels start on (the pixels, or the stem's)."""
    grid = check_batch(images, label_map, (4, 4))
    x = m.stem(images)
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _logits(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output  # type: ignore[no-any-return]


def _token_logits(m: Any, x: Tensor, output: Any) -> Tensor:
    """The head(s) on every final token ``(b, n, classes)``: ``head``'s in distilled training, else the average."""
    t = m.head_drop(x)
    return m.head(t) if isinstance(output, tuple) else (m.head(t) + m.head_dist(t)) / 2  # type: ignore[no-any-return]


class AdaptedEfficientFormer(AdaptedBase):
    """A timm EfficientFormer returning the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = EFFICIENTFORMER_FAMILY
    refusal = staticmethod(efficientformer_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        tracker = start_on_convs(self.scheme, label_map, start, grid, _depth(m), _stem_convs(m))
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                grid = conv_aggregate(tracker, grid, stage.downsample.conv)
                x = stage.downsample(x)
            for blk in stage.blocks:
                if type(blk) is Flat:
                    x = blk(x)
                    continue
                x = self._block(blk, x, layer, tracker, grid)
                layer += 1
        x = m.norm(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x, output) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, _logits(output), t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    @staticmethod
    def _block(blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int]) -> Tensor:
        labels, mixed = tracker.labels_for(layer), None
        if type(blk) is MetaBlock2d:
            out = blk.ls1(blk.token_mixer(x))
            if labels is not None:
                mixed = pooling_mix(labels, grid, _pool_kernel(blk.token_mixer))
        else:
            out, a = _attend(blk.token_mixer, blk.norm1(x))
            out = blk.ls1(out)
            if labels is not None:
                mixed = explicit_mix(a, labels)
        out, keep = branch(blk.drop_path1, out)
        tracker.residual(layer, keep, mixed=mixed)
        x = x + out
        out, keep = branch(blk.drop_path2, blk.ls2(blk.mlp(_mlp_input(blk, x))))
        tracker.residual(layer, keep, mixed=None)  # channel mixing
        return x + out

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """timm's modules for the output; explicit stem, downsampling, pooling and attention matrices on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, _depth(m))
        rules.aggregate_convs(start, grid, _stem_convs(m))
        layer = 0
        for stage in m.stages:
            if not isinstance(stage.downsample, nn.Identity):
                conv = stage.downsample.conv
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
                x = stage.downsample(x)
            for blk in stage.blocks:
                if type(blk) is Flat:
                    x = blk(x)
                    continue
                if type(blk) is MetaBlock2d:
                    out = blk.ls1(blk.token_mixer(x))
                    matrix = _pooling_matrix(grid, _pool_kernel(blk.token_mixer)).unsqueeze(0)
                else:
                    out, a = _attend(blk.token_mixer, blk.norm1(x))
                    out = blk.ls1(out)
                    matrix = a.detach().double().mean(dim=1)
                out, keep = _drop(blk.drop_path1, out)
                rules.mix(layer, matrix, keep)
                x = x + out
                x = x + _drop(blk.drop_path2, blk.ls2(blk.mlp(_mlp_input(blk, x))))[0]
                layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x, output) if self.scheme.needs_token_logits else None
        return rules.result(output, _logits(output), "mean", token_logits)


def tiny_efficientformer(num_classes: int = 10, **kwargs: Any) -> EfficientFormer:
    """A seeded EfficientFormer for 32x32 images: a pooling stage on the 8x8 grid, then a downsampling stage with a
    pooling block and an attention block on the 4x4 grid. timm fixes the attention biases at 7x7 (224 px), so the
    attention is timm's own ``Attention`` built for the 4x4 grid (2 heads, key dim 8)."""
    torch.manual_seed(0)
    model = EfficientFormer(depths=(1, 2), embed_dims=(16, 32), num_vit=1, num_classes=num_classes, **kwargs)
    last: Any = model.stages[-1]
    for blk in last.blocks:
        if type(blk) is MetaBlock1d:
            blk.token_mixer = Attention(32, key_dim=8, num_heads=2, attn_ratio=2, resolution=4)
    return model


FAMILY = Family(
    name="efficientformer",
    description=EFFICIENTFORMER_FAMILY,
    refusal=AdaptedEfficientFormer.refusal,
    build=AdaptedEfficientFormer,
    example=tiny_efficientformer,
    timm_modules=("efficientformer",),
    speed_model="efficientformer_l1",
)
