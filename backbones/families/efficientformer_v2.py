"""Adapter for timm's EfficientFormerV2 (``efficientformerv2_s0/s1/s2/l``): conv stages, then 2D attention.

TL-Align Table 10 and Appendix D, extended by one rule this family needs: **a sum of two token
paths carries the average of their labels** (the residual rule ``(Y + Y_g) / 2`` is its case with
the identity as one path). Events, ``layer`` counting every block and every attention downsample:

- the stem (two 3x3 stride-2 convs) and a plain ``Downsample`` (a 3x3 stride-2 conv): labels are
  summed over every window (``aggregate``, renormalised); a MixToken map starts on the stem's grid;
- ``EfficientFormerV2Block``: ``x + ls1(Attention2d(x))`` (the last blocks of stages 3 and 4),
  then ``x + ls2(ConvMlpWithNorm(x))``. The MLP's 3x3 depthwise ``mid`` conv mixes labels by its
  channel-averaged normalised ``|kernel|`` (border-renormalised); its 1x1 convs and norms are
  channel ops; the residual rule joins each branch;
- ``Attention2d``: ``out = TH2(softmax(TH1(q k^T s + B))) v + v_local(v)``. The talking heads mix
  heads before and after the softmax, so a head's weights ``A'_h = sum_g W_hg S_g + b_h`` are no
  distribution (and may be negative): the labels move by ``mean_h Norm(|A'_h|)``, the normalised
  absolute weights, as for any attention-like mixer. ``v_local`` (a 3x3 depthwise conv on the
  values) is the second path: ``mixed = (mean_h Norm(|A'_h|) Y + Norm(T(K)) Y) / 2``. With
  ``stride`` (stage 3) the attention runs on the grid of a strided depthwise conv (window sums)
  and its output is upsampled bilinearly back: the labels take the same windows and the same
  bilinear weights (non-negative, a distribution per output position);
- ``Downsample`` with ``Attention2dDownsample`` (stage 4): the conv path's window sums, and an
  attention from the stride-2 query grid over every position, plus ``v_local`` (a 3x3 stride-2
  depthwise conv: window sums). The labels are ``aggregate``\\ d over the conv's windows (what
  the geometry does: unaligned token labels follow it) and, where the scheme aligns the layer,
  ``residual(layer, mixed=(A Y + W Y) / 2)``: ``(W Y + (A Y + W Y) / 2) / 2``, the two-path rule
  applied twice;
- readout: the final norm (a channel op), global average pooling; ``head`` and ``head_dist``
  averaged, or ``head`` in distilled training (timm returns both).

timm fixes the attention biases for the grid of its ``img_size`` (224 px): other image sizes are
refused before any compute. Shapes: ``b`` batch, ``h`` heads, ``n`` positions, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from timm.layers.drop import DropPath
from timm.models.efficientformer_v2 import (
    Attention2d,
    Attention2dDownsample,
    ConvMlpWithNorm,
    Downsample,
    EfficientFormerV2,
    EfficientFormerV2Block,
    Stem4,
)
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap
from mixlabels._label_map import fp32_labels
from mixlabels._rules import normalise_rows
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import (
    AdaptedBase,
    branch,
    mix_token_space,
    mixing_rows,
    start_on_convs,
)
from mixlabels.backbones._convnet import Kernels, apply_path, residual_labels
from mixlabels.backbones._windows import window_means
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._family import Family

__all__ = ["AdaptedEfficientFormerV2", "EFFICIENTFORMERV2_FAMILY", "efficientformer_v2_refusal", "tiny_efficientformer_v2"]

EFFICIENTFORMERV2_FAMILY = (
    "timm EfficientFormerV2 (efficientformerv2_s0/s1/s2/l): conv stem and strided convs as aggregation; the MLPs' "
    "3x3 depthwise conv mixes labels by its normalised |kernel|; Attention2d's talking-heads weights by their "
    "normalised absolute values (head mean), averaged with its v_local depthwise conv (a sum of two paths carries "
    "the average of their labels), on the strided conv's windows and bilinearly upsampled back where it attends at "
    "half resolution; the attention downsample as conv windows plus query-grid attention and v_local windows; "
    "norms and 1x1 convs as channel ops; global average pooling, head and head_dist averaged; stochastic depth"
)


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _stem_convs(m: Any) -> list[Any]:
    return [m.stem.conv1.conv, m.stem.conv2.conv]


def _units(m: Any) -> list[tuple[int, Any]]:
    """``(stage, module)`` in forward order: each stage's ``Downsample`` (if any), then its blocks."""
    units: list[tuple[int, Any]] = []
    for i, stage in enumerate(m.stages):
        if type(stage.downsample) is Downsample:
            units.append((i, stage.downsample))
        units += [(i, blk) for blk in stage.blocks]
    return units


def _stride1_convs(m: Any) -> list[nn.Conv2d]:
    """The stride-1 convs whose label kernels the blocks read: each block's ``mlp.mid`` and its attention's ``v_local``."""
    convs = []
    for _, unit in _units(m):
        if type(unit) is Downsample:
            continue
        if unit.token_mixer is not None:
            convs.append(unit.token_mixer.v_local.conv)
        if not isinstance(unit.mlp.mid, nn.Identity):
            convs.append(unit.mlp.mid.conv)
    return convs


def _is_layer(unit: Any) -> bool:
    return type(unit) is EfficientFormerV2Block or (type(unit) is Downsample and unit.attn is not None)


def _depth(m: Any) -> int:
    return sum(1 for _, unit in _units(m) if _is_layer(unit))


def _windows(conv: Any) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    return _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.padding)


def efficientformer_v2_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm EfficientFormerV2 this adapter carries labels through (``None``: it is)."""
    if type(model) is not EfficientFormerV2:
        return f"{type(model).__name__} is not a timm EfficientFormerV2"
    m: Any = model
    if m.global_pool != "avg":
        return f"global_pool={m.global_pool!r} returns per-position outputs, no image logits to align; use 'avg'"
    if type(m.stem) is not Stem4:
        return f"the stem is {type(m.stem).__name__}, not timm's Stem4"
    convs: list[tuple[str, Any]] = [("the stem's first conv", m.stem.conv1.conv), ("the stem's second conv", m.stem.conv2.conv)]
    for i, unit in _units(m):
        where = f"stage {i}'s {type(unit).__name__}"
        if type(unit) is Downsample:
            convs.append((f"{where} conv", unit.conv.conv))
            if unit.attn is not None:
                if type(unit.attn) is not Attention2dDownsample:
                    return f"{where}'s attention is {type(unit.attn).__name__}, not timm's Attention2dDownsample"
                convs.append((f"{where}'s v_local", unit.attn.v_local.conv))
        elif type(unit) is EfficientFormerV2Block:
            if type(unit.mlp) is not ConvMlpWithNorm or not isinstance(unit.mlp.mid, nn.Module):
                return f"{where}'s MLP is not timm's ConvMlpWithNorm"
            if not isinstance(unit.mlp.mid, nn.Identity):
                convs.append((f"{where}'s mid conv", unit.mlp.mid.conv))
            for name in ("drop_path1", "drop_path2"):
                dp = getattr(unit, name)
                if dp is not None and type(dp) not in (nn.Identity, DropPath):
                    return f"{where}'s {name} is {type(dp).__name__}, not timm's DropPath"
            if unit.token_mixer is not None:
                if type(unit.token_mixer) is not Attention2d:
                    return f"{where}'s token mixer is {type(unit.token_mixer).__name__}, not timm's Attention2d"
                convs.append((f"{where}'s v_local", unit.token_mixer.v_local.conv))
                if unit.token_mixer.stride_conv is not None:
                    convs.append((f"{where}'s stride conv", unit.token_mixer.stride_conv.conv))
        elif not isinstance(unit, nn.Identity):
            return f"stage {i} holds {type(unit).__name__}; only timm's Downsample and EfficientFormerV2Block are supported"
    for what, conv in convs:
        if type(conv) is not nn.Conv2d or isinstance(conv.padding, str) or conv.padding_mode != "zeros":
            return f"{what} is not a plain nn.Conv2d with static zero padding (TF 'same' padding has no static windows)"
        if conv.dilation != (1, 1):
            return f"{what} is dilated, which has no label rule here"
    return None


# ---------------------------------------------------------------------------------------------- the steps
def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """Stem output ``(b, c, h, w)``, its grid, and the grid the labels start on; refuses an image size whose grids
    do not match the attention biases timm built (before any compute)."""
    grid = check_batch(images, label_map, (4, 4))
    for i, unit in _units(m):
        attn: Any = unit.token_mixer if type(unit) is EfficientFormerV2Block else getattr(unit, "attn", None)
        if attn is None:
            continue
        built = _pair(attn.resolution)
        stride = 4 * 2 ** sum(1 for s in m.stages[: i + 1] if type(s.downsample) is Downsample)
        if type(attn) is Attention2d and attn.stride_conv is not None:
            stride *= 2
        if type(attn) is Attention2dDownsample:
            stride //= 2  # its keys are the stage's input grid
        got = (-(-int(images.shape[2]) // stride), -(-int(images.shape[3]) // stride))
        if got != built:
            size = tuple(r * stride for r in built)
            raise ValueError(
                f"EfficientFormerV2's attention biases in stage {i} are for a {built[0]}x{built[1]} grid, but "
                f"{int(images.shape[2])}x{int(images.shape[3])} images give {got[0]}x{got[1]}: timm fixes them for "
                f"the model's img_size; use {size[0]}x{size[1]} images (or build the model with img_size=your size)"
            )
    x = m.stem(images)
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _talking_heads(attn: Any, xs: Tensor) -> tuple[Tensor, Tensor]:
    """``Attention2d``'s head weights ``A'`` ``(b, h, n, n)`` (after both talking heads) and its values
    ``(b, h, n, d)``, from the (strided) input ``xs``, as timm computes them."""
    b = int(xs.shape[0])
    q = attn.q(xs).reshape(b, attn.num_heads, -1, attn.N).permute(0, 1, 3, 2)
    k = attn.k(xs).reshape(b, attn.num_heads, -1, attn.N)
    a = (q @ k) * attn.scale + attn.get_attention_biases(xs.device)
    return attn.talking_head2(attn.talking_head1(a).softmax(dim=-1)), attn.v(xs)


def _attention2d(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``Attention2d`` step by step: its output and its head weights ``A'`` ``(b, h, n', n')``."""
    b = int(x.shape[0])
    xs = attn.stride_conv(x) if attn.stride_conv is not None else x
    a, v = _talking_heads(attn, xs)
    v_local = attn.v_local(v)
    v = v.reshape(b, attn.num_heads, -1, attn.N).permute(0, 1, 3, 2)
    out = (a @ v).transpose(2, 3).reshape(b, attn.dh, attn.resolution[0], attn.resolution[1]) + v_local
    if attn.upsample is not None:
        out = attn.upsample(out)
    return attn.proj(attn.act(out)), a


def _attention_downsample(attn: Any, x: Tensor) -> tuple[Tensor, Tensor]:
    """timm's ``Attention2dDownsample`` step by step: its output and its softmax matrix ``(b, h, n/4, n)``."""
    b = int(x.shape[0])
    q = attn.q(x).reshape(b, attn.num_heads, -1, attn.N2).permute(0, 1, 3, 2)
    k = attn.k(x).reshape(b, attn.num_heads, -1, attn.N)
    v = attn.v(x)
    v_local = attn.v_local(v)
    v = v.reshape(b, attn.num_heads, -1, attn.N).permute(0, 1, 3, 2)
    a = ((q @ k) * attn.scale + attn.get_attention_biases(x.device)).softmax(dim=-1)
    out = (a @ v).transpose(2, 3).reshape(b, attn.dh, attn.resolution2[0], attn.resolution2[1]) + v_local
    return attn.proj(attn.act(out)), a


def _abs_weights(a: Tensor) -> Tensor:
    """``mean_h Norm(|A'_h|)`` ``(b, n, n)`` fp32: the normalised absolute weights of every head, averaged (a head
    row of zeros, a zeroed ``talking_head2``'s, is the identity's: ``mixing_rows``)."""
    with fp32_labels(a.device):
        return reduce(mixing_rows(a.detach().float().abs()), "b h n m -> b n m", "mean")


def _upsample(labels: Tensor, low: tuple[int, int], scale: Any) -> Tensor:
    """Labels ``(b, n_low, l)`` through timm's bilinear ``nn.Upsample`` (its weights: a distribution per position)."""
    y = rearrange(labels, "b (h w) l -> b l h w", h=low[0])
    up = F.interpolate(y, scale_factor=scale, mode="bilinear", align_corners=False)
    return normalise_rows(rearrange(up, "b l h w -> b (h w) l"))


def _attention2d_labels(attn: Any, a: Tensor, labels: Tensor, grid: tuple[int, int], kernels: Kernels | None = None) -> Tensor:
    """The fast path of ``Attention2d``'s labels ``(b, n, l)``: talking-heads weights and ``v_local`` averaged, on
    the strided conv's windows and upsampled back where it attends at half resolution."""
    y, low = labels, grid
    if attn.stride_conv is not None:
        y, low = window_means(labels, grid, *_windows(attn.stride_conv.conv))
    own = Kernels(()) if kernels is None else kernels  # none given: the conv's own kernel
    local, _ = apply_path((attn.v_local.conv,), y, low, own)
    mixed = (_abs_weights(a) @ y + local) / 2
    return mixed if attn.upsample is None else _upsample(mixed, low, attn.upsample.scale_factor)


def _downsample_labels(down: Any, a: Tensor, labels: Tensor, grid: tuple[int, int]) -> Tensor:
    """The attention path of an attention ``Downsample``: ``(A Y + W Y) / 2`` on the query grid ``(b, n/4, l)``."""
    with fp32_labels(a.device):
        attended = reduce(a.detach().float(), "b h n m -> b n m", "mean") @ labels
    local, _ = window_means(labels, grid, *_windows(down.attn.v_local.conv))
    return (attended + local) / 2


class AdaptedEfficientFormerV2(AdaptedBase):
    """A timm EfficientFormerV2 returning the scheme's aligned targets (``adapted(images)`` is the model's)."""

    family = EFFICIENTFORMERV2_FAMILY
    refusal = staticmethod(efficientformer_v2_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        tracker = start_on_convs(self.scheme, label_map, start, grid, _depth(m), _stem_convs(m))
        # every block's stride-1 label kernels at once, on the first read (a dozen operators, not five a conv); the
        # adapter is sharded whole or not at all (no FSDP units), so every weight is whole here
        kernels = Kernels(_stride1_convs(m))
        layer = 0
        for _, unit in _units(m):
            if type(unit) is Downsample:
                x, grid, layer = self._downsample(unit, x, tracker, layer, grid)
            else:
                x = self._block(unit, x, layer, tracker, grid, kernels)
                layer += 1
        x = m.norm(x)
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x, output) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, _logits(output), t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    @staticmethod
    def _downsample(down: Any, x: Tensor, tracker: LabelTracker, layer: int, grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int], int]:
        labels = tracker.labels_for(layer) if down.attn is not None else None
        out = down.conv(x)
        tracker.aggregate(lambda y: window_means(y, grid, *_windows(down.conv.conv))[0], normalised=True)
        low = (int(out.shape[2]), int(out.shape[3]))
        if down.attn is None:
            return out, low, layer
        attended, a = _attention_downsample(down.attn, x)
        mixed = None if labels is None else _downsample_labels(down, a, labels, grid)
        tracker.residual(layer, None, mixed=mixed)
        return attended + out, low, layer + 1

    @staticmethod
    def _block(blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels) -> Tensor:
        labels = tracker.labels_for(layer)
        if blk.token_mixer is not None:
            out, a = _attention2d(blk.token_mixer, x)
            out, keep = branch(blk.drop_path1, blk.ls1(out))
            mixed = None if labels is None else _attention2d_labels(blk.token_mixer, a, labels, grid, kernels)
            tracker.residual(layer, keep, mixed=mixed)
            x = x + out
            labels = tracker.labels_for(layer)
        out, keep = branch(blk.drop_path2, blk.ls2(blk.mlp(x)))
        # kernels expanded, tap weights together; on a GPU's small grids the residual's mean folded into the matrix
        residual_labels(tracker, layer, keep, labels, () if isinstance(blk.mlp.mid, nn.Identity) else (blk.mlp.mid.conv,), grid, kernels)
        return x + out

    # ------------------------------------------------------------------ reference
    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """timm's modules for the output; explicit float64 window, conv, attention and bilinear matrices."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        rules = DenseRules(self.scheme, label_map, start, 0, _depth(m))
        rules.aggregate_convs(start, grid, _stem_convs(m))
        layer = 0
        for _, unit in _units(m):
            if type(unit) is Downsample:
                x, grid, layer = _downsample_reference(unit, x, rules, layer, grid)
            else:
                x = _block_reference(unit, x, rules, layer, grid)
                layer += 1
        x = m.norm(x)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x, output) if self.scheme.needs_token_logits else None
        return rules.result(output, _logits(output), "mean", token_logits)


def _window_matrix(grid: tuple[int, int], conv: Any) -> tuple[Tensor, tuple[int, int]]:
    """The row-normalised ``(n', n)`` float64 matrix of a strided conv's windows."""
    m, out = conv_matrix(grid, torch.ones(conv.kernel_size, dtype=torch.float64), _pair(conv.stride), _pair(conv.padding))
    return row_normalise(m), out


def _conv_mix_matrix(grid: tuple[int, int], conv: Any) -> Tensor:
    """``Norm(T(K))`` of a stride-1 depthwise conv: every channel's |kernel| normalised, averaged, border-renormalised."""
    k = kernel_reference(conv.weight)
    return row_normalise(conv_matrix(grid, k, padding=_pair(conv.padding), dilation=_pair(conv.dilation))[0])


def _bilinear_matrix(low: tuple[int, int], scale: Any) -> Tensor:
    """``(n, n_low)`` float64: timm's bilinear upsample applied to every low-grid basis map."""
    n_low = low[0] * low[1]
    basis = torch.eye(n_low, dtype=torch.float64).reshape(n_low, 1, low[0], low[1])
    up = F.interpolate(basis, scale_factor=scale, mode="bilinear", align_corners=False)
    return row_normalise(rearrange(up, "m 1 h w -> (h w) m"))


def _block_reference(blk: Any, x: Tensor, rules: DenseRules, layer: int, grid: tuple[int, int]) -> Tensor:
    if blk.token_mixer is not None:
        attn = blk.token_mixer
        out, a = _attention2d(attn, x)
        out, keep = branch(blk.drop_path1, blk.ls1(out))
        heads = a.detach().double().abs()
        weights = row_normalise(heads).mean(dim=1)  # b n' n'
        if attn.stride_conv is None:
            matrix = (weights + _conv_mix_matrix(grid, attn.v_local.conv)) / 2
        else:
            down, low = _window_matrix(grid, attn.stride_conv.conv)
            inner = (weights + _conv_mix_matrix(low, attn.v_local.conv)) / 2
            matrix = _bilinear_matrix(low, attn.upsample.scale_factor) @ inner @ down
        rules.mix(layer, matrix, keep)
        x = x + out
    out, keep = branch(blk.drop_path2, blk.ls2(blk.mlp(x)))
    if not isinstance(blk.mlp.mid, nn.Identity):
        rules.mix(layer, _conv_mix_matrix(grid, blk.mlp.mid.conv).unsqueeze(0), keep)
    return x + out


def _downsample_reference(down: Any, x: Tensor, rules: DenseRules, layer: int, grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int], int]:
    windows, low = _window_matrix(grid, down.conv.conv)
    before = rules.y
    rules.aggregate(windows)
    out = down.conv(x)
    if down.attn is None:
        return out, low, layer
    attended, a = _attention_downsample(down.attn, x)
    if rules.rules.wants_labels(layer):
        rows = a.detach().double().mean(dim=1)  # b n/4 n
        local, _ = _window_matrix(grid, down.attn.v_local.conv)
        rules.y = rules.rules.residual(rules.y, (rows @ before + local @ before) / 2, None)
    return attended + out, low, layer + 1


def _logits(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output  # type: ignore[no-any-return]


def _token_logits(m: Any, x: Tensor, output: Any) -> Tensor:
    """The head(s) on every final position ``(b, n, classes)``: ``head``'s in distilled training, else the average."""
    t = m.head_drop(rearrange(x, "b c h w -> b (h w) c"))
    if m.head_dist is None or isinstance(output, tuple):
        return m.head(t)  # type: ignore[no-any-return]
    return (m.head(t) + m.head_dist(t)) / 2  # type: ignore[no-any-return]


def tiny_efficientformer_v2(num_classes: int = 10, **kwargs: Any) -> EfficientFormerV2:
    """A seeded EfficientFormerV2 for 32x32 images (timm's class, small widths): 8x8 conv stages, a stage attending
    at half resolution (4x4, upsampled back to 8x8) in its last block, then an attention downsample to 4x4 and an
    attention block there."""
    torch.manual_seed(0)
    return EfficientFormerV2(depths=(1, 1, 2, 2), embed_dims=(16, 16, 16, 32), downsamples=(False, False, False, True),
                             img_size=32, num_vit=1, num_classes=num_classes, **kwargs)


FAMILY = Family(
    name="efficientformer_v2",
    description=EFFICIENTFORMERV2_FAMILY,
    refusal=AdaptedEfficientFormerV2.refusal,
    build=AdaptedEfficientFormerV2,
    example=tiny_efficientformer_v2,
    timm_modules=("efficientformer_v2",),
    speed_model="efficientformerv2_s0",
)
