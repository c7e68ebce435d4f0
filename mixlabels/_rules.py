"""A scheme's label rules in one object, read by the compact tracker and the dense reference tracker.

A ``Scheme`` resolves its ``Rules`` for one batch (``Scheme.rules(label_map, layout)``):
which layers' spatial mixes move labels, what a residual does to them (with the
stochastic-depth rule), what a merge does, the readout, and how the targets combine
(image/area weights, the aligned readout, class-attention weights, token targets and
the token-loss weight). The rule *arithmetic* is written here once, for any label
width (``(b, n, k)`` compact source weights or ``(b, n, c)`` dense class
distributions) and any float dtype, so the fast path (``CompactTracker``, fp32) and the
reference paths (``DenseTracker``, float64 with explicit matrices) apply the same
rules, and a backbone adapter never needs to know which scheme it runs.

Example:
    >>> import torch
    >>> r = Rules(align=frozenset({0}), target="aligned")
    >>> y, mixed = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]])
    >>> r.residual(y, mixed, keep=None).tolist()  # Eq. 11: Norm(Y + A Y)
    [[[0.5, 0.5]]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Rules", "TargetRule", "TokenTargetRule", "normalise_rows"]

TargetRule = Literal["image", "aligned", "attention"]
"""The class target: the image (area) weights, the aligned labels' readout, or
``area_weight * area + (1 - area_weight) * class-attention`` weights."""

TokenTargetRule = Literal["none", "input", "aligned"]
"""Per-patch-token targets: none, the tokens' input labels (unaligned), or the aligned labels."""


def normalise_rows(w: Tensor) -> Tensor:
    """Rows divided by their sum (the sum clamped away from 0): removes low-precision drift."""
    return w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)


@dataclass(frozen=True)
class Rules:
    """One scheme's label rules for one batch (resolved against its ``TokenLayout``).

    Args:
        align: layers whose spatial mixes move the labels.
        normalize: a residual ``Z <- Z + g(Z)`` gives ``Y <- (Y + Y_g) / 2`` (Eq. 11); ``False``:
            ``Y <- Y_g`` (TL-Align's Table 8 "Normalization Disabled").
        follow_drop: a sample whose branch stochastic depth dropped keeps its labels
            (``TLAlign(drop_path="follow")``); ``False``: its labels mix anyway ("official").
        class_attention_layer: the layer whose class-token attention row the targets read.
        target: how the class target is formed (``TargetRule``).
        area_weight: for ``target="attention"``: the weight of the image (area) weights.
        token_targets: the per-token targets (``TokenTargetRule``); not ``"none"`` also makes
            a label map's annotator maps (``TokenLabelMap.with_token_targets``) the token labels.
        token_loss_weight: beta of the dense token loss.
    """

    align: frozenset[int] = frozenset()
    normalize: bool = True
    follow_drop: bool = True
    class_attention_layer: int | None = None
    target: TargetRule = "image"
    area_weight: float = 0.5
    token_targets: TokenTargetRule = "none"
    token_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.area_weight <= 1.0:
            raise ValueError(f"Rules area_weight must lie in [0, 1], got {self.area_weight}")
        if self.target == "attention" and self.class_attention_layer is None:
            raise ValueError("Rules target='attention' needs class_attention_layer (the layer whose attention it reads)")

    # ------------------------------------------------------------------ which labels are carried
    @property
    def tracks_aligned(self) -> bool:
        """Whether labels are carried through the layers (aligned, or read out aligned)."""
        return bool(self.align) or self.target == "aligned" or self.token_targets == "aligned"

    @property
    def tracks_input(self) -> bool:
        """Whether the input labels are carried (merged only) for unaligned token targets."""
        return self.token_targets == "input"

    @property
    def uses_token_targets(self) -> bool:
        """Whether a label map's dense annotator maps replace the area labels of the patch tokens."""
        return self.token_targets != "none"

    def wants_labels(self, layer: int) -> bool:
        return layer in self.align

    def wants_class_attention(self, layer: int) -> bool:
        return layer == self.class_attention_layer

    # ------------------------------------------------------------------ events
    @property
    def residual_share(self) -> float:
        """The branch's share ``s`` of a residual's labels where the branch was kept: ``residual`` is
        ``lerp(y, mixed, s)``, ``(y + mixed) / 2`` normalised, ``mixed`` itself without normalisation (a ``lerp`` to
        ``mixed`` by 1 is ``mixed`` to the bit). A branch whose labels are a matrix ``M`` of ``y`` makes the
        residual's the matrix ``lerp(I, M, s)`` (``CompactTracker.residual_by``)."""
        return 0.5 if self.normalize else 1.0

    def residual(self, y: Tensor, mixed: Tensor, keep: Tensor | None) -> Tensor:
        """Labels after a residual whose branch spatially mixed ``y`` into ``mixed``; ``keep`` ``(b,)`` bool
        per sample, or ``(b, n)`` per token (a drop-path drawn over a batch of token groups, as MobileViT's
        per-offset sequences)."""
        new = torch.lerp(y, mixed, 0.5) if self.normalize else mixed  # (y + mixed) / 2 in one operator
        return self.kept(y, new, keep)

    def kept(self, y: Tensor, new: Tensor, keep: Tensor | None) -> Tensor:
        """A residual's labels ``new`` where its branch was kept: a sample (token) whose branch was dropped keeps its
        labels ``y`` under ``follow_drop`` (``keep`` as ``residual``'s)."""
        if keep is not None and self.follow_drop:
            new = torch.where(keep.reshape(keep.shape[0], -1, 1), new, y)
        return new

    def join(self, y: Tensor, forked: Tensor, share: float, keep: Tensor | None, *, normalised: bool = False) -> Tensor:
        """Labels of a concatenation along channels: ``share`` of the channels carry ``forked`` (the labels a
        ``fork`` kept, through the forked part's spatial map), the rest ``y``; each channel counted once, as
        ``Parallel.concat`` weighs its branches, and renormalised. ``keep`` ``(b,)`` bool: samples that kept the
        forked part under stochastic depth; a dropped one (zeros in its channels) keeps ``y`` under ``follow_drop``.
        ``normalised``: the rows of ``y`` and ``forked`` each sum to 1 already (a tracker's rows do: source weights,
        and annotator maps started as distributions), and so does their mix: no renormalisation (it would change
        rounding only)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"a join's share is the forked part's channel fraction, in [0, 1]; got {share}")
        if normalised:
            new = torch.lerp(y, forked, share)
        else:
            new = normalise_rows(torch.lerp(y, normalise_rows(forked), share))  # (1 - share) y + share forked, one operator
        if keep is not None and self.follow_drop:
            new = torch.where(keep.reshape(keep.shape[0], -1, 1), new, y)
        return new

    def merge(self, merged: Tensor) -> Tensor:
        """Labels of merged tokens (the sums of the merged tokens' labels), renormalised."""
        return normalise_rows(merged)

    def readout(self, y: Tensor, how: Literal["token", "mean"], first: int, *, renormalise: bool = True) -> Tensor:
        """The head's readout of labels ``(b, n, l) -> (b, l)``: token ``first`` or the mean of ``first:``, its rows
        renormalised (rounding drift removed) unless ``renormalise`` is off. Every row of ``y`` is a distribution (its
        sum about 1, never 0), and so is the readout: no clamp of the sum away from 0 (``normalise_rows``), which would
        change no bit of it; without the renormalisation its rows sum to 1 to the drift of ``y``'s (a few units in the
        last place: two launches fewer on a GPU, ``CompactTracker``)."""
        read = y[:, first] if how == "token" else (y if first == 0 else y[:, first:]).mean(dim=1)  # no slice where nothing is left out
        return read / read.sum(dim=-1, keepdim=True) if renormalise else read

    def class_weights(self, row: Tensor, area: Tensor, num_prefix: int) -> Tensor:
        """TransMix's ``lambda_attn``: the class token's row ``(b, n)`` over the patch tokens (renormalised)
        summed over each source's (or class's) area ``(b, n_patches, l)``: ``(b, l)``."""
        attn = row[:, num_prefix:]
        attn = attn / attn.sum(dim=-1, keepdim=True)
        return torch.einsum("bn,bnk->bk", attn, area)

    def combine(self, image: Tensor, attention: Tensor) -> Tensor:
        """``area_weight * image + (1 - area_weight) * attention`` (TransMix: the plain average)."""
        if self.area_weight == 0.5:  # TransMix's own expression (equal in IEEE arithmetic; kept literal)
            return (attention + image) / 2
        return self.area_weight * image + (1.0 - self.area_weight) * attention
