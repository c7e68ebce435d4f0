"""Reference label rules on dense ``(b, n, c)`` class distributions, with explicit matrices.

The reference paths of the Swin, PVT v2, CaiT, MLP-Mixer and ConvNeXt adapters
run the model's modules with explicit attention and apply each scheme's rules here,
written independently of the event protocol and of ``mixlabels``' trackers: every
spatial mix is an explicit ``(b, n, n)`` (or ``(n, n)``) matrix and every merge an
explicit ``(n', n)`` 0/1 matrix, so the fast paths (compact labels, convolutions,
pooling, rolled windows, fused attention) are tested against a second implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mixlabels import AlignedOutput, NoAlign, Scheme, TLAlign, TokenLabeling, TokenLabelMap, TransMix

__all__ = ["DenseRules", "conv_matrix", "window_matrix", "row_normalise", "drop_path_reference"]


def row_normalise(m: Tensor) -> Tensor:
    return m / m.sum(dim=-1, keepdim=True)


def _taps(grid: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> tuple[tuple[int, int], list[tuple[int, int, Tensor, Tensor, Tensor]]]:
    """For every tap ``(i, j)``: output and input flat indices of the in-grid pairs."""
    h, w = grid
    oh = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    oy, ox = torch.meshgrid(torch.arange(oh), torch.arange(ow), indexing="ij")
    taps = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            iy = oy * stride[0] - padding[0] + i * dilation[0]
            ix = ox * stride[1] - padding[1] + j * dilation[1]
            ok = (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)
            taps.append((i, j, (oy * ow + ox)[ok], (iy * w + ix)[ok], ok))
    return (oh, ow), taps


def conv_matrix(
    grid: tuple[int, int],
    kernel: Tensor,
    stride: tuple[int, int] = (1, 1),
    padding: tuple[int, int] = (0, 0),
    dilation: tuple[int, int] = (1, 1),
) -> tuple[Tensor, tuple[int, int]]:
    """The explicit ``(n_out, n_in)`` matrix of a single-channel cross-correlation with zero padding."""
    out, taps = _taps(grid, (int(kernel.shape[0]), int(kernel.shape[1])), stride, padding, dilation)
    m = torch.zeros(out[0] * out[1], grid[0] * grid[1], dtype=torch.float64)
    for i, j, rows, cols, _ in taps:
        m[rows, cols] += float(kernel[i, j])
    return m, out


def window_matrix(attn: Tensor, index: Tensor, n: int) -> Tensor:
    """Scatter per-window matrices ``(b, nw, a, a)`` to one ``(b, n, n)`` over original token ids ``index`` ``(nw, a)``."""
    b, nw, a, _ = attn.shape
    m = attn.new_zeros(b, n, n)
    rows = index[:, :, None].expand(nw, a, a)
    cols = index[:, None, :].expand(nw, a, a)
    m[:, rows, cols] = attn
    return m


def drop_path_reference(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """timm's DropPath with the same draw, written out (reference)."""
    prob = float(getattr(module, "drop_prob", 0.0))
    if prob == 0.0 or not module.training:
        return x, None
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - prob)
    return x * (mask / (1.0 - prob) if getattr(module, "scale_by_keep", True) else mask), mask.flatten() > 0


class DenseRules:
    """One scheme's label rules on dense labels ``(b, n, c)``.

    Args:
        scheme: ``NoAlign``, ``TransMix``, ``TLAlign`` or ``TokenLabeling`` (no annotator).
        label_map: the batch's map.
        grid: the token grid the labels start on.
        num_prefix: prefix tokens (class token) before the patch tokens, labelled with the image target.
        depth: number of layers (``TLAlign`` layer indices resolve against it).
    """

    def __init__(self, scheme: Scheme, label_map: TokenLabelMap, grid: tuple[int, int], num_prefix: int, depth: int) -> None:
        self.scheme = scheme
        self.lm = label_map
        self.p = num_prefix
        self.align: set[int] = set()
        self.normalize = True
        self.follow_drop = True  # TLAlign(drop_path="official"): a dropped sample's labels mix anyway
        if isinstance(scheme, TLAlign):
            layers = range(depth) if scheme.layers is None else scheme.layers
            self.align, self.normalize = {i % depth for i in layers}, scheme.normalize
            self.follow_drop = scheme.drop_path == "follow"
        elif isinstance(scheme, TokenLabeling):
            if scheme.annotator is not None:
                raise NotImplementedError("the reference path covers label-map token targets only")
            self.align = set(range(depth)) if scheme.aligned else set()
        elif not isinstance(scheme, (NoAlign, TransMix)):
            raise TypeError(f"the reference path knows NoAlign, TransMix, TLAlign and TokenLabeling, got {scheme!r}")
        self.image_target = label_map.image_targets()  # b c
        self.patch_target = label_map.targets(label_map.token_weights(grid)).double()  # b n c
        prefix = self.image_target.double().unsqueeze(1).expand(-1, num_prefix, -1)
        self.y = torch.cat([prefix, self.patch_target], dim=1)  # b n c, float64 for a tight comparison
        self.static = self.y
        self.class_row: Tensor | None = None

    def mix(self, layer: int, matrix: Tensor, keep: Tensor | None) -> None:
        """A residual branch whose spatial mix is ``matrix`` ``(b|1, n, n)`` (rows sum to 1)."""
        if layer not in self.align:
            return
        mixed = matrix.double() @ self.y
        new = (self.y + mixed) / 2 if self.normalize else mixed
        self.y = new if keep is None or not self.follow_drop else torch.where(keep.view(-1, 1, 1), new, self.y)

    def aggregate(self, matrix: Tensor) -> None:
        """Tokens merged by the 0/1 (or weighted) matrix ``(n', n)``; rows renormalised."""
        self.y = row_normalise(matrix.double() @ self.y)
        self.static = row_normalise(matrix.double() @ self.static)

    def attend_class(self, row: Tensor) -> None:
        """The head-mean attention row ``(b, n)`` of the class token in the last layer (TransMix)."""
        self.class_row = row.detach().double()

    def result(self, output: Tensor, logits: Tensor, readout: str, token_logits: Tensor | None) -> AlignedOutput:
        """The ``AlignedOutput`` for a ``"token"`` (class token 0) or ``"mean"`` (patch mean) readout."""
        p = self.p
        aligned = self.y[:, 0] if readout == "token" else self.y[:, p:].mean(dim=1)
        aligned = aligned / aligned.sum(-1, keepdim=True)
        image = self.image_target.double()
        tokens = None
        beta = 0.0
        if isinstance(self.scheme, TLAlign):
            target = aligned
        elif isinstance(self.scheme, TransMix):
            if readout != "token" or self.class_row is None:
                raise ValueError("TransMix needs a class token")
            w = self.class_row[:, p:] / self.class_row[:, p:].sum(dim=-1, keepdim=True)
            target = (torch.einsum("bn,bnc->bc", w, self.patch_target) + image) / 2
        elif isinstance(self.scheme, TokenLabeling):
            target = aligned if self.scheme.aligned else image
            tokens = row_normalise((self.y if self.scheme.aligned else self.static)[:, p:]).float()
            beta = self.scheme.beta
        else:
            target = image
        return AlignedOutput(output, logits, target.float().detach(), None, token_logits, tokens, beta)
