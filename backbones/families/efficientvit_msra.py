"""Adapter for timm's EfficientViT (MSRA): cascaded group attention in local windows, depthwise convs, subsampling.

TL-Align Table 10 and Appendix D extended by the same reasoning as for Swin (windows) and
ConvNeXt (depthwise convs). Every residual is timm's ``ResidualDrop`` (its own stochastic
depth draw, replayed here for ``keep``). Events, ``layer`` counting each ``EfficientVitBlock``
and each subsample stage's ``res1`` and ``res2``:

- ``ConvNorm`` depthwise 3x3 (``dw0``, ``dw1``, ``res1.0``, ``res2.0``): ``Norm(T(K)) Y``, the
  normalised absolute kernel averaged over channels (``apply_path``; every layer's kernels computed
  together); ``ConvMlp`` (1x1 convs) and batch norms: channel ops, ``mixed=None``.
- ``LocalWindowAttention``: timm's ``CascadedGroupAttention`` on non-overlapping windows.
  Head ``i`` attends within each window, ``softmax(q^T k * scale + bias_i)`` with the learned
  attention biases by offset (``A_i``); its q first passes a depthwise conv (it only sets the
  weights: no label moves). Its input is the input's channel chunk ``i`` plus head ``i-1``'s
  output (the cascade), so its values carry ``(Y + Z_{i-1}) / 2`` (two summed features, equal
  weights as a residual's), ``Y`` for head 0, and it outputs ``Z_i = A_i V_i``. The heads'
  outputs are concatenated and projected (a channel op): the branch's labels are
  ``mean_i Z_i``. A grid that is no multiple of the window would be padded by timm with
  content-free tokens whose keys and values are not zero: refused with the sizes that work.
- ``PatchMerging`` (1x1, depthwise 3x3 stride 2, squeeze-excite, 1x1): ``aggregate`` over the
  strided conv's windows; squeeze-excite scales channels per sample (channel op).
- the patch embedding (four 3x3 stride-2 convs): four ``aggregate`` events from the pixels;
  a MixToken map starts on the patch grid instead.
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).
  Token logits apply the head per position with the batch norm's statistics of the pooled
  features (running statistics in eval), so their mean is the model's logits.

Shapes: ``b`` batch, ``n`` tokens, ``l`` label channels, ``h w`` grid, ``wh ww`` a window.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models.efficientvit_msra import (
    CascadedGroupAttention,
    ConvMlp,
    ConvNorm,
    EfficientVitBlock,
    EfficientVitMsra,
    LocalWindowAttention,
    NormLinear,
    PatchMerging,
    ResidualDrop,
)
from torch import Tensor, nn

from mixlabels._label_map import fp32_labels
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._common import AdaptedBase, check_static_conv, conv_aggregate, mix_token_space, start_on_convs
from mixlabels.backbones._convnet import Kernels, fold_labels, residual_labels
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise, window_matrix
from mixlabels import AlignedOutput, LabelTracker, TokenLabelMap, TokenLayout
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedEfficientViTMSRA", "EFFICIENTVIT_MSRA_FAMILY"]

EFFICIENTVIT_MSRA_FAMILY = (
    "timm EfficientVitMsra (EfficientViT M0-M5): cascaded group attention in local windows with attention biases "
    "(each head's values carry its input chunk's and the previous head's labels), depthwise convs as "
    "normalised-absolute-kernel spatial mixes, subsampling and the 4-conv patch embedding as aggregation; "
    "1x1 convs, squeeze-excite, batch norms as channel ops; global average pooling; ResidualDrop stochastic depth"
)


def _residual_why(rd: Any, where: str) -> str | None:
    if type(rd) is not ResidualDrop:
        return f"{where} is {type(rd).__name__}, not a ResidualDrop"
    mod = rd.m
    if type(mod) is ConvNorm:
        return check_static_conv(mod.conv, f"{where}'s conv", depthwise=True)
    if type(mod) is ConvMlp:
        return None
    if type(mod) is LocalWindowAttention and type(mod.attn) is CascadedGroupAttention:
        dws: Any = mod.attn.dws
        for i, dw in enumerate(dws):
            why = check_static_conv(dw.conv, f"{where}'s head {i} query conv", depthwise=True)
            if why is not None:
                return why
        return None
    return f"{where} wraps {type(mod).__name__}; only ConvNorm (depthwise), ConvMlp and LocalWindowAttention are supported"


def _msra_refusal(model: nn.Module) -> str | None:
    if type(model) is not EfficientVitMsra:
        return f"{type(model).__name__} is not a timm EfficientVitMsra"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    if type(m.head) is not NormLinear:
        return "the head is not a NormLinear classifier (num_classes=0?); adapt a model with a classifier"
    for i, conv in enumerate(_stem_convs(m)):
        why = check_static_conv(conv, f"the patch embedding's conv {i + 1}")
        if why is not None:
            return why
    for i, stage in enumerate(m.stages):
        if not isinstance(stage.downsample, nn.Identity):
            ds = stage.downsample
            if type(ds.patchmerge) is not PatchMerging:
                return f"stage {i}'s downsampling is not a PatchMerging"
            conv = ds.patchmerge.conv2.conv
            if type(conv) is not nn.Conv2d or conv.groups != conv.in_channels or isinstance(conv.padding, str):
                return f"stage {i}'s PatchMerging conv2 must be a depthwise nn.Conv2d with static padding"
            for name in ("res1", "res2"):
                for j, rd in enumerate(getattr(ds, name)):
                    why = _residual_why(rd, f"stage {i} {name}.{j}")
                    if why is not None:
                        return why
        for j, blk in enumerate(stage.blocks):
            if type(blk) is not EfficientVitBlock:
                return f"stage {i} block {j} is {type(blk).__name__}, not an EfficientVitBlock"
            for name in ("dw0", "ffn0", "mixer", "dw1", "ffn1"):
                why = _residual_why(getattr(blk, name), f"stage {i} block {j} {name}")
                if why is not None:
                    return why
    return None


def _stem_convs(m: Any) -> list[Any]:
    return [m.patch_embed.conv1.conv, m.patch_embed.conv2.conv, m.patch_embed.conv3.conv, m.patch_embed.conv4.conv]


def _layers(m: Any) -> list[tuple[str, Any]]:
    """The model in order: ``("layer", residuals)`` (one layer index each) and ``("merge", PatchMerging)``."""
    out: list[tuple[str, Any]] = []
    for stage in m.stages:
        if not isinstance(stage.downsample, nn.Identity):
            ds = stage.downsample
            out += [("layer", list(ds.res1)), ("merge", ds.patchmerge), ("layer", list(ds.res2))]
        out += [("layer", [blk.dw0, blk.ffn0, blk.mixer, blk.dw1, blk.ffn1]) for blk in stage.blocks]
    return out


def _dw_kernels(plan: list[tuple[str, Any]], tracker: LabelTracker) -> Kernels:
    """The label kernels of every depthwise ``ConvNorm`` whose layer's labels are read, computed together on the first
    read (a few operators for all of them, not five per conv; ``apply_path`` reads them). The model has no FSDP2
    units below the root (``fsdp_units``), so its weights are whole here."""
    layers = [part for kind, part in plan if kind == "layer"]
    return Kernels(rd.m.conv for layer, part in enumerate(layers) if tracker.labels_for(layer) is not None
                   for rd in part if type(rd.m) is ConvNorm)


def _residual_drop(rd: Any, x: Tensor, out: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's ``ResidualDrop`` with its own draw (``rand >= drop``), and who kept the branch."""
    if rd.training and rd.drop > 0:
        scale = torch.rand(x.size(0), 1, 1, 1, device=x.device).ge_(rd.drop).div(1 - rd.drop).detach()
        return x + out * scale, scale.reshape(-1) > 0
    return x + out, None


def _cascade(attn: Any, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """timm's ``CascadedGroupAttention`` on windows ``(b', c, wh, ww)``: the output and every head's weights ``(b', a, a)``."""
    b, _, h, w = x.shape
    chunks = x.chunk(len(attn.qkvs), dim=1)
    feat, bias = chunks[0], attn.get_attention_biases(x.device)
    outs, weights = [], []
    for i, (qkv, dws) in enumerate(zip(attn.qkvs, attn.dws)):
        if i > 0:
            feat = feat + chunks[i]
        q, k, v = qkv(feat).view(b, -1, h, w).split([attn.key_dim, attn.key_dim, attn.val_dim], dim=1)
        q, k, v = dws(q).flatten(2), k.flatten(2), v.flatten(2)
        a = ((q * attn.scale).transpose(-2, -1) @ k + bias[i]).softmax(dim=-1)
        feat = (v @ a.transpose(-2, -1)).view(b, attn.val_dim, h, w)
        outs.append(feat)
        weights.append(a)
    return attn.proj(torch.cat(outs, 1)), weights


def _window(lwa: Any, grid: tuple[int, int]) -> int:
    ws = int(lwa.attn.resolution)
    if grid != (ws, ws) and (grid[0] % ws or grid[1] % ws):
        raise ValueError(
            f"a {grid[0]}x{grid[1]} grid is no multiple of the {ws}x{ws} attention window: timm pads it with tokens "
            "whose keys and values are not zero but carry no image content, which no label rule covers; use an image "
            "size whose grid at every stage is the window or a multiple of it (224 px: 14x14, 7x7, 4x4)"
        )
    return ws


def _window_attention(lwa: Any, x: Tensor, labels: Tensor | None, grid: tuple[int, int]) -> tuple[Tensor, Tensor | None]:
    """The window attention's output ``(b, c, h, w)`` and, given labels ``(b, n, l)``, its mixed labels."""
    ws = _window(lwa, grid)
    nh, nw = grid[0] // ws, grid[1] // ws
    windows = rearrange(x, "b c (nh wh) (nw ww) -> (b nh nw) c wh ww", wh=ws, ww=ws)
    out, weights = _cascade(lwa.attn, windows)
    out = rearrange(out, "(b nh nw) c wh ww -> b c (nh wh) (nw ww)", nh=nh, nw=nw)
    if labels is None:
        return out, None
    with torch.no_grad(), fp32_labels(x.device):
        y = rearrange(labels.float(), "b (nh wh nw ww) l -> (b nh nw) (wh ww) l", nh=nh, wh=ws, nw=nw)
        # ``bmm`` on the 3-d weights (``@`` dispatches an expand and a view of each side around it), no detach (no
        # graph is recorded here), and the sum started from head 0's labels (not from zeros)
        z = torch.bmm(weights[0].float(), y)
        total = z
        for a in weights[1:]:
            z = torch.bmm(a.float(), (y + z) / 2)  # the cascade: chunk i plus head i-1
            total = total + z
        mixed = rearrange(total / len(weights), "(b nh nw) (wh ww) l -> b (nh wh nw ww) l", nh=nh, nw=nw, wh=ws)
    return out, mixed


def _embed(m: Any, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    grid = check_batch(images, label_map, (16, 16))
    x = m.patch_embed(images)
    if (int(x.shape[2]), int(x.shape[3])) != grid:
        raise ValueError(f"the patch embedding made a {tuple(x.shape[2:])} grid, not {grid}; use an image size divisible by 16")
    if label_map.token_space:
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, (label_map.image_size[0], label_map.image_size[1])


def _token_logits(m: Any, x: Tensor) -> Tensor:
    """The head on every position ``(b, h*w, classes)``, normalised by the statistics its batch norm gave the pooled features."""
    bn = m.head.bn
    t = rearrange(x, "b c h w -> b (h w) c")
    if bn.training:
        pooled = t.mean(dim=1)
        mean, var = pooled.mean(dim=0), pooled.var(dim=0, unbiased=False)
    else:
        mean, var = bn.running_mean, bn.running_var
    t = (t - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias
    return m.head.linear(m.head.drop(t))  # type: ignore[no-any-return]


class AdaptedEfficientViTMSRA(AdaptedBase):
    """A timm EfficientViT (MSRA) returning the scheme's aligned targets."""

    family = EFFICIENTVIT_MSRA_FAMILY
    refusal = staticmethod(_msra_refusal)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        plan = _layers(m)
        depth = sum(1 for kind, _ in plan if kind == "layer")
        tracker = start_on_convs(self.scheme, label_map, start, grid, depth, _stem_convs(m))  # the four strided convs
        kernels = _dw_kernels(plan, tracker)
        layer = 0
        for kind, part in plan:
            if kind == "merge":
                grid = conv_aggregate(tracker, grid, part.conv2.conv)
                x = part(x)
                continue
            for rd in part:
                x = self._residual(rd, x, layer, tracker, grid, kernels)
            layer += 1
        tracker.pool("mean", 0)
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        t = tracker.finish()
        return AlignedOutput(output, output, t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    @staticmethod
    def _residual(rd: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int], kernels: Kernels) -> Tensor:
        mod = rd.m
        # a depthwise conv's labels position-major where the CPU's folded conv pays; ConvMlp mixes channels only
        labels, mixed = (fold_labels(tracker, layer, grid) if type(mod) is ConvNorm else tracker.labels_for(layer)), None
        if type(mod) is LocalWindowAttention:
            out, mixed = _window_attention(mod, x, labels, grid)
        else:
            out = mod(x)
        x, keep = _residual_drop(rd, x, out)
        if type(mod) is ConvNorm:  # a depthwise conv (its residual folded into its matrix on a GPU's small grids)
            residual_labels(tracker, layer, keep, labels, (mod.conv,), grid, kernels)
        else:  # the window attention's labels; ConvMlp's none (it mixes channels only)
            tracker.residual(layer, keep, mixed=mixed)
        return x

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """timm's modules for the output; explicit window, cascade, conv and merge matrices on dense labels."""
        m: Any = self.model
        x, grid, start = _embed(m, images, label_map)
        plan = _layers(m)
        rules = DenseRules(self.scheme, label_map, start, 0, sum(1 for kind, _ in plan if kind == "layer"))
        rules.aggregate_convs(start, grid, _stem_convs(m))
        layer = 0
        for kind, part in plan:
            if kind == "merge":
                conv = part.conv2.conv
                merge, grid = conv_matrix(grid, torch.ones(conv.kernel_size), conv.stride, conv.padding)
                rules.aggregate(merge)
                x = part(x)
                continue
            for rd in part:
                mod = rd.m
                out = mod(x)  # timm's own module
                matrix = None
                if type(mod) is LocalWindowAttention:
                    matrix = _cascade_matrix(mod, x, grid)
                elif type(mod) is ConvNorm:
                    dw: Any = mod.conv
                    kernel = kernel_reference(dw.weight)
                    matrix = row_normalise(conv_matrix(grid, kernel, padding=dw.padding, dilation=dw.dilation)[0]).unsqueeze(0)
                x, keep = _residual_drop(rd, x, out)
                if matrix is not None:
                    rules.mix(layer, matrix, keep)
            layer += 1
        output = m.forward_head(x)
        token_logits = _token_logits(m, x) if self.scheme.needs_token_logits else None
        return rules.result(output, output, "mean", token_logits)


def _cascade_matrix(lwa: Any, x: Tensor, grid: tuple[int, int]) -> Tensor:
    """``mean_i Z_i`` as one ``(b, n, n)`` matrix: ``Z_i = A_i (I + Z_{i-1}) / 2``, ``A_i`` scattered from its windows."""
    ws = _window(lwa, grid)
    nh, nw = grid[0] // ws, grid[1] // ws
    n = grid[0] * grid[1]
    with torch.no_grad():
        _, weights = _cascade(lwa.attn, rearrange(x, "b c (nh wh) (nw ww) -> (b nh nw) c wh ww", wh=ws, ww=ws))
    index = rearrange(torch.arange(n).view(grid), "(nh wh) (nw ww) -> (nh nw) (wh ww)", wh=ws, ww=ws)
    eye = torch.eye(n, dtype=torch.float64)
    z: Tensor | None = None
    total = torch.zeros(x.shape[0], n, n, dtype=torch.float64)
    for a in weights:
        full = window_matrix(rearrange(a.double(), "(b w) i j -> b w i j", b=x.shape[0]), index, n)
        z = full @ (eye if z is None else (eye + z) / 2)
        total = total + z
    return total / len(weights)


FAMILY = Family(
    name="efficientvit_msra",
    description=EFFICIENTVIT_MSRA_FAMILY,
    refusal=AdaptedEfficientViTMSRA.refusal,
    build=AdaptedEfficientViTMSRA,
    example=tiny("efficientvit_m0", img_size=32, embed_dim=(16, 32), key_dim=(4, 4), depth=(1, 1), num_heads=(2, 2),
        down_ops=(("", 1), ("subsample", 2))),
    timm_modules=("efficientvit_msra",),
    speed_model="efficientvit_m0",
)
