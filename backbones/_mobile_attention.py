"""MobileNetV4's ``MobileAttention`` (the hybrid models' multi-query attention) as label events.

``x + s * MQA(norm(x))``: queries from every position of the grid, one key and one value head
shared by the query heads, both from a grid downsampled by a strided depthwise conv (``kv_stride``).
The rules (TL-Align Table 10 and Appendix D, as elsewhere):

- the key/value tokens are formed from the windows of the strided conv: their labels are the
  window sums, renormalised (``aggregate``'s rule, on a copy: the grid itself stays);
- the attention moves those labels to every query position by the head-mean softmax rows:
  ``mixed = mean_h(A_h) Y_kv``; the residual joins it by the scheme's rule (``residual``);
- the norm, the 1x1 projections and the layer scale are channel ops.

Refused: query strides (the output is upsampled back, a rule not written here), the block's
conditional position encoding (``use_cpe``) and the einsum layout. Shapes: ``b`` batch, ``h``
heads, ``n`` query positions, ``p`` key/value positions, ``l`` label channels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.attention2d import MultiQueryAttention2d
from torch import Tensor, nn

from mixlabels import LabelTracker
from mixlabels.backbones._attention import attention_with_labels, explicit_mix
from mixlabels.backbones._common import branch
from mixlabels.backbones._windows import window_means
from mixlabels.backbones._dense import DenseRules, conv_matrix, row_normalise
from mixlabels.backbones._dense import drop_path_reference as _drop

__all__ = ["mobile_attention_refusal", "mobile_attention_labels", "mobile_attention_reference"]


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def mobile_attention_refusal(blk: Any, where: str) -> str | None:
    """Why a ``MobileAttention`` block has no label rule here (``None``: it has)."""
    attn: Any = blk.attn
    if type(attn) is not MultiQueryAttention2d:
        return f"{where}'s attention is {type(attn).__name__}; only MobileNetV4's MultiQueryAttention2d is supported"
    if attn.has_query_strides:
        return f"{where} strides its queries and upsamples the output back, which has no label rule here"
    if blk.conv_cpe_dw is not None:
        return f"{where} has a conditional position encoding (use_cpe), which has no label rule here"
    if attn.einsum:
        return f"{where} uses the einsum layout; build it without einsum"
    if not blk.has_skip:
        return f"{where} has no skip connection (a strided or widening attention block)"
    if attn.kv_stride > 1:
        for path in (attn.key, attn.value):
            conv = path.down_conv
            if type(conv) is not nn.Conv2d or isinstance(conv.padding, str) or conv.padding_mode != "zeros":
                return f"{where}'s key/value downsampling conv is not a plain zero-padded nn.Conv2d"
        kc: Any = attn.key.down_conv
        vc: Any = attn.value.down_conv
        if (kc.kernel_size, kc.stride, kc.padding) != (vc.kernel_size, vc.stride, vc.padding):
            return f"{where}'s key and value downsample over different windows"
    return None


def _qkv(attn: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """timm's projections: ``q`` ``(b, h, n, k)``, ``k`` ``(b, 1, p, k)``, ``v`` ``(b, 1, p, v)``."""
    q = attn._reshape_projected_query(attn.query(x), attn.num_heads, attn.key_dim)
    return q, attn._reshape_input(attn.key(x)), attn._reshape_input(attn.value(x))


def _out(attn: Any, o: Tensor, grid: tuple[int, int]) -> Tensor:
    return attn.output(attn._reshape_output(o, attn.num_heads, grid[0], grid[1]))  # type: ignore[no-any-return]


def _kv_labels(attn: Any, labels: Tensor, grid: tuple[int, int]) -> Tensor:
    """The key/value tokens' labels: the downsampling conv's window sums, renormalised (the labels themselves at stride 1)."""
    if attn.kv_stride == 1:
        return labels
    conv = attn.value.down_conv
    return window_means(labels, grid, _pair(conv.kernel_size), _pair(conv.stride), _pair(conv.padding))[0]


def mobile_attention_labels(blk: Any, x: Tensor, layer: int, tracker: LabelTracker, grid: tuple[int, int]) -> Tensor:
    """timm's ``MobileAttention`` forward with its label events (``residual`` with the attention's mix)."""
    attn = blk.attn
    labels = tracker.labels_for(layer)
    q, k, v = _qkv(attn, blk.norm(x))
    mixed = None
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    if labels is None:
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p) if attn.fused_attn else _explicit(attn, q, k, v)[0]
    elif attn.fused_attn and k.shape[-1] == v.shape[-1]:
        h = q.shape[1]  # one shared key/value head, as the fused call broadcasts it
        kv = _kv_labels(attn, labels, grid)
        o, mixed = attention_with_labels(q, k.expand(-1, h, -1, -1), v.expand(-1, h, -1, -1), kv, attn.scale, dropout_p)
    else:
        o, a = _explicit(attn, q, k, v)
        mixed = explicit_mix(a, _kv_labels(attn, labels, grid))
    out, keep = branch(blk.drop_path, blk.layer_scale(_out(attn, o, grid)))
    tracker.residual(layer, keep, mixed=mixed)
    return x + out


def _explicit(attn: Any, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """timm's unfused path: ``attn_drop(softmax(q * scale @ k^T)) @ v`` and the matrix ``(b, h, n, p)``."""
    a = ((q * attn.scale) @ k.transpose(-1, -2)).softmax(dim=-1)
    return attn.attn_drop(a) @ v, a


def mobile_attention_reference(blk: Any, x: Tensor, layer: int, rules: DenseRules, grid: tuple[int, int]) -> Tensor:
    """The explicit ``(b, n, n)`` matrix: head-mean attention rows times the row-normalised window matrix."""
    attn = blk.attn
    q, k, v = _qkv(attn, blk.norm(x))
    o, a = _explicit(attn, q, k, v)
    merge = torch.eye(grid[0] * grid[1], dtype=torch.float64)
    if attn.kv_stride > 1:
        conv = attn.value.down_conv
        merge, _ = conv_matrix(grid, torch.ones(_pair(conv.kernel_size)), _pair(conv.stride), _pair(conv.padding))
        merge = row_normalise(merge)
    matrix = a.detach().double().mean(dim=1) @ merge  # b n n
    out, keep = _drop(blk.drop_path, blk.layer_scale(_out(attn, o, grid)))
    rules.mix(layer, matrix, keep)
    return x + out
