"""Fused attention that also mixes labels, the class-token attention row, and stochastic depth.

Shapes: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim, ``l`` label channels.

The head mean of attention times labels is ``mean_h(A_h Y)``, and ``A_h Y`` is what
attention computes when ``Y`` is appended to ``V`` as extra value channels. So one
fused ``scaled_dot_product_attention`` call with ``q`` and ``k`` zero-padded to the
widened head dim yields both the output and the aligned labels; no ``(b, h, n, n)``
matrix ever exists. Two traps: the padded call must be given the ORIGINAL scale
(the default would use the widened dim), and the CPU fused kernel needs q, k, v of
equal head dim (else it falls back to the math path, which builds the matrix).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import reduce, repeat
from torch import Tensor

__all__ = ["attention_with_labels", "class_attention", "drop_path_with_keep"]

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _widen(q: Tensor, k: Tensor, v: Tensor, labels: Tensor, multiple: int) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad q and k, append the labels to v, all to one head dim (a multiple of ``multiple``)."""
    h, d, ll = q.shape[1], q.shape[-1], labels.shape[-1]
    extra = -(d + ll) % multiple  # CUDA flash kernels want head dims in multiples of 8
    y = repeat(labels.to(v.dtype), "b n l -> b h n l", h=h)
    vw = torch.cat([v, y], dim=-1)
    return F.pad(q, (0, ll + extra)), F.pad(k, (0, ll + extra)), F.pad(vw, (0, extra))


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):  # what sdpa itself would run in
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _WidenedForwardCPU(torch.autograd.Function):
    """Widened fused call in the forward only; the backward is the ordinary attention backward.

    Zero padding leaves scores and log-sum-exp unchanged, so the widened call's
    log-sum-exp and the first ``d`` output channels are exactly what the ordinary
    backward kernel needs. Labels carry no gradient.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, labels: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(q, k, v)
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        d = v.shape[-1]
        qw, kw, vw = _widen(q, k, v, labels, 1)
        out_wide, lse = _cpu_flash(qw, kw, vw, scale=scale)  # b h n (d + l), b h n
        # b h n d, stored in the kernel's own b n h d order (as SDPA returns it): the block's
        # reshape to (b, n, h d) is then a view, not a second copy kept for the backward
        out = out_wide[..., :d].transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        mixed = out_wide[..., d:].contiguous()  # b h n l: A_h Y per head
        ctx.mark_non_differentiable(mixed)
        return out, mixed

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_labels: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        gq, gk, gv = _cpu_flash_backward(grad_out.to(out.dtype).contiguous(), q, k, v, out, lse, 0.0, False, scale=ctx.scale)
        dq, dk, dv = ctx.in_dtypes
        return gq.to(dq), gk.to(dk), gv.to(dv), None, None


def attention_with_labels(
    q: Tensor, k: Tensor, v: Tensor, labels: Tensor, scale: float, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Attention output and head-mean attention applied to labels, from one fused call.

    Args:
        q, k, v: ``(b, h, n, d)``.
        labels: ``(b, n, l)`` fp32 (no grad).
        scale: the attention module's own scale (NOT ``1/sqrt`` of the widened dim).
        dropout_p: attention dropout. Labels must see the undropped attention (as in
            the paper's code), so with dropout the labels take a second, no-grad call.

    Returns:
        ``out`` ``(b, h, n, d)`` equal to ``sdpa(q, k, v, dropout_p=dropout_p)`` and
        ``mixed`` ``(b, n, l)`` fp32 ``= mean_h(softmax(q k^T * scale)) @ labels``, no grad.
        Under autocast the label channels run in the autocast dtype (bf16 rounding,
        about 3e-3 relative per layer); the scheme renormalises rows at readout.

    Example:
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)  # b=1, h=2, n=5, d=4
        >>> y = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]])
        >>> out, mixed = attention_with_labels(q, k, v, y, scale=0.5)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6)
        True
        >>> a = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1).mean(1)  # b n n, for the check only
        >>> torch.allclose(mixed, a @ y, atol=1e-6)
        True
    """
    d = v.shape[-1]
    labels = labels.detach()
    if dropout_p > 0.0:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
        with torch.no_grad():
            qw, kw, vw = _widen(q, k, v, labels, 8)
            mixed = F.scaled_dot_product_attention(qw, kw, vw, scale=scale)[..., d : d + labels.shape[-1]]
    elif q.device.type == "cpu" and q.shape[-1] == k.shape[-1] == d:
        out, mixed = _WidenedForwardCPU.apply(q, k, v, labels, scale)
    else:
        # Other devices: autograd through the widened call (zero pads give the same
        # gradients; the backward also runs widened, a few percent slower).
        qw, kw, vw = _widen(q, k, v, labels, 8)
        out_wide = F.scaled_dot_product_attention(qw, kw, vw, scale=scale)
        out, mixed = out_wide[..., :d], out_wide[..., d : d + labels.shape[-1]].detach()
    return out, reduce(mixed.float(), "b h n l -> b n l", "mean")


def class_attention(q: Tensor, k: Tensor, scale: float, index: int = 0) -> Tensor:
    """Head-mean attention row of one query token over all tokens, without the full matrix.

    Args:
        q, k: ``(b, h, n, d)``.
        index: the query token (the class token).

    Returns:
        ``(b, n)`` fp32, no grad, rows sum to 1.
    """
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        scores = torch.einsum("bhd,bhnd->bhn", q[:, :, index].float(), k.float()) * scale  # b h n
        return reduce(scores.softmax(dim=-1), "b h n -> b n", "mean")


def drop_path_with_keep(x: Tensor, drop_prob: float, training: bool, scale_by_keep: bool = True) -> tuple[Tensor, Tensor | None]:
    """timm's ``drop_path`` with the same RNG draw, also returning which samples kept the branch.

    Args:
        x: ``(b, ...)`` the residual branch.

    Returns:
        The branch as timm's ``DropPath`` returns it, and ``keep`` ``(b,)`` bool (``None``
        when nothing can be dropped).
    """
    if drop_prob == 0.0 or not training:
        return x, None
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)  # same draw as timm's drop_path
    keep = random_tensor.reshape(-1) > 0
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor, keep
