"""Re-parameterisable blocks' fused kernels, built with few operators.

RepVGG-style blocks (timm's ``RepVggBlock`` and ``MobileOneBlock``, FastViT's, RepViT's ``RepVggDw``,
RepGhost's cheap operation) train as parallel branches (a kxk conv, a 1x1 conv, an identity, each
followed by a batch norm) that ``reparameterize`` / ``fuse`` folds into one conv. Labels mix by that
one conv's kernel: each branch's weight scaled per output channel by its norm's
``gamma / sqrt(running_var + eps)``, the 1x1 and the identity at the centre tap, summed.

The weights change every step, so the fold runs every step, and per norm it is three operators
(an add, a square root, a division) plus a view and a product per branch: on a model of 40
such norms that is most of what its label path dispatches (FastViT, RepGhostNet, RepViT). Here
the scales of every norm of a forward come from one pass (``norm_scales``), and the identity is
an addition at the centre taps of a kernel already made (``add_centre``), not a kernel of zeros
built each step. Each operation is elementwise, so every kernel has the bits timm's own fold gives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["Scales", "norm_scales", "scales_of", "scaled", "add_centre", "joined", "parted", "folded"]

Scales = Mapping[nn.Module, Tensor]
"""Batch norm -> its ``(c,)`` fold scale ``gamma / sqrt(running_var + eps)``, for the norms of one forward."""


def scales_of(norms: Iterable[nn.Module]) -> dict[nn.Module, Tensor]:
    """``norm_scales`` of the distinct norms in ``norms``, by norm."""
    unique = list(dict.fromkeys(norms))
    return dict(zip(unique, norm_scales(unique)))


def norm_scales(norms: Sequence[nn.Module]) -> list[Tensor]:
    """Each batch norm's per-channel ``gamma / sqrt(running_var + eps)`` (a norm without ``gamma``: ``1 / ...``),
    read without gradient.

    Norms of one ``eps``, dtype and device are computed together: their statistics concatenated, one add,
    square root and division, one split (six operators however many norms; three each, one at a time). The
    operations are elementwise, so a scale has the bits it has when computed alone.
    """
    groups: dict[tuple[float, torch.dtype, torch.device], list[int]] = {}
    for i, norm in enumerate(norms):
        var = _running_var(norm)
        groups.setdefault((float(norm.eps), var.dtype, var.device), []).append(i)  # type: ignore[arg-type]
    out: list[Tensor | None] = [None] * len(norms)
    with torch.no_grad():
        for (eps, _, _), members in groups.items():
            if len(members) == 1:
                norm = norms[members[0]]
                out[members[0]] = _gamma(norm) / (_running_var(norm) + eps).sqrt()
                continue
            var = torch.cat([_running_var(norms[i]) for i in members])
            gamma = torch.cat([_gamma(norms[i]) for i in members])
            scales = torch.split(gamma / (var + eps).sqrt(), [int(_running_var(norms[i]).shape[0]) for i in members])
            for i, s in zip(members, scales):
                out[i] = s
    return [s for s in out if s is not None]


def _running_var(norm: nn.Module) -> Tensor:
    var = getattr(norm, "running_var", None)
    if not isinstance(var, Tensor):
        raise TypeError(f"{type(norm).__name__} keeps no running variance: only a batch norm folds into a conv")
    return var


def _gamma(norm: nn.Module) -> Tensor:
    weight = getattr(norm, "weight", None)
    return weight if isinstance(weight, Tensor) else torch.ones_like(_running_var(norm))


def joined(parts: Sequence[Tensor]) -> Tensor:
    """``parts`` concatenated along the first dimension (the one part as itself: no copy to dispatch)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def parted(joint: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """``joined``'s inverse: the parts of ``sizes`` rows, as views."""
    return [joint] if len(sizes) == 1 else list(torch.split(joint, list(sizes)))


def folded(weights: Sequence[Tensor], norms: Sequence[nn.Module], scales: Scales) -> Tensor:
    """Weights ``(o, i, kh, kw)`` of several convs (or the one weight of a fused kernel, its parts' norms in order)
    joined along ``o`` and each output channel scaled by its norm's fold scale: ``scaled`` of them all in one pass,
    the same elementwise products, so the bits each weight gets alone."""
    return scaled(joined(weights), joined([scales[n] for n in norms]))


def scaled(weight: Tensor, scale: Tensor) -> Tensor:
    """``weight (o, i, kh, kw)`` with output channel ``o`` multiplied by ``scale[o]``: a branch folded with its norm."""
    return weight * scale.view(-1, 1, 1, 1)


def add_centre(kernel: Tensor, values: Tensor | float, alpha: float = 1.0) -> Tensor:
    """``kernel (o, i, kh, kw)`` plus ``alpha`` times an identity scaled by ``values`` (a ``(o,)`` tensor or a number):
    output channel ``c`` reads input ``c mod i`` (itself within its group, as timm's ``_fuse_bn_tensor`` writes the
    identity) at the centre tap.

    ``kernel`` must be a tensor the fold made: it is added to in place (one operator for a depthwise kernel,
    where an identity kernel built from zeros, scaled and added takes six). The sums are the ones adding a
    whole identity kernel makes (``alpha=-1``: its subtraction), bit for bit.
    """
    ch, cw = int(kernel.shape[-2]) // 2, int(kernel.shape[-1]) // 2
    if int(kernel.shape[1]) == 1 and kernel.is_contiguous():  # depthwise: every channel's one input
        centre = kernel.flatten(1).select(1, ch * int(kernel.shape[-1]) + cw)  # two views, not three selects
        if isinstance(values, Tensor):
            centre.add_(values, alpha=alpha)
        else:
            centre.add_(alpha * values)
        return kernel
    channels = torch.arange(int(kernel.shape[0]), device=kernel.device)
    at = (channels, channels % int(kernel.shape[1]), torch.full_like(channels, ch), torch.full_like(channels, cw))
    if isinstance(values, Tensor):
        v = values.to(kernel.dtype) if alpha == 1.0 else values.to(kernel.dtype) * alpha
    else:
        v = torch.full((int(kernel.shape[0]),), alpha * values, dtype=kernel.dtype, device=kernel.device)
    return kernel.index_put_(at, v, accumulate=True)
