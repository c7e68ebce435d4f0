"""The two trackers that apply a scheme's ``Rules``: compact (the fast path) and dense (the reference).

- ``CompactTracker`` receives the adapters' events (``mixlabels._align``) and carries labels
  as ``(b, n, k)`` fp32 source weights, expanded to classes only at the end (alignment is
  linear), or as ``(b, n, c)`` classes when the label map carries annotator maps.
- ``DenseTracker`` is the reference paths' tracker: dense ``(b, n, c)`` class distributions
  in float64 and explicit ``(b|1, n, n)`` spatial-mix and ``(n', n)`` merge matrices, so a
  fast path (compact labels, fused attention, convolutions, pooling) is tested against a
  second implementation of the same rules, for any scheme.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mixlabels._align import AlignedOutput, AlignedTargets, Fork, Readout, Scheme, TokenLayout, initial_weights
from mixlabels._label_map import TokenLabelMap
from mixlabels._label_map import fp32_labels as _fp32
from mixlabels._routes import eager_launch_routes
from mixlabels._rules import Rules, normalise_rows

__all__ = ["CompactTracker", "DenseTracker"]

_LARGEST_SCALE = 2.0**64
"""The largest power of two ``CompactTracker`` leaves its labels at (``residual_sum``): label weights lie in [0, 1],
so a scaled one stays far below fp32's largest (2^128) and every scaling is exact."""


def _no_class_attention(rules: Rules) -> ValueError:
    return ValueError(
        f"this scheme's target reads the class token's attention in layer {rules.class_attention_layer}, "
        "but the model reported none (no class token?); use TLAlign() or NoAlign() instead"
    )


def _forked(y: Tensor, forked: Tensor) -> Tensor:
    """``forked`` (the forked part's labels at the join), checked to lie on ``y``'s grid."""
    if forked.shape != y.shape:
        raise ValueError(
            f"join: the forked part's labels {tuple(forked.shape)} and the current ones {tuple(y.shape)} lie on different "
            "grids (an aggregate ran between fork and join); join parts that end on the same grid, or pass the forked "
            "part's own map (merge) to join"
        )
    return forked


class CompactTracker:
    """A ``LabelTracker`` applying ``rules`` to compact labels (the fast path of every adapter)."""

    def __init__(self, rules: Rules, label_map: TokenLabelMap, layout: TokenLayout) -> None:
        self._rules = rules
        self._lm = label_map
        self._layout = layout
        self._dense = rules.uses_token_targets and label_map.token_targets is not None
        self._y: Tensor | None = None  # b n l, the aligned labels
        self._static: Tensor | None = None  # b n l, unaligned labels for token targets
        self._class_weights: Tensor | None = None  # b k, the class-attention lambda
        self._readout: tuple[Readout, int] = ("token" if layout.class_token else "mean", layout.num_prefix)
        # ``_y`` is the aligned labels times ``_scale``, a power of two: summed residuals (``residual_sum``) leave it at
        # 2^k, every other event first brings it back to 1 (``_unit``), exactly
        self._scale = 1.0
        # whether a residual brought labels mixed by the model's own activations (attention): their products ran in the
        # activations' dtype (bf16 label channels under autocast, in a bf16 or FSDP2 mixed-precision model), so their
        # rows sum to 1 only within its rounding, and the readout renormalises them on every route (``_finish``)
        self._by_activations = False
        if self._dense and layout.pixel_windows is not None:
            raise ValueError(
                "token targets (with_token_targets) cannot start on a layout's pixel_windows; start the labels on "
                "the pixels (TokenLayout without pixel_windows) and aggregate them through the stem"
            )
        if rules.tracks_aligned or rules.tracks_input:
            # fp32 under any autocast: the label map computes its weights and targets in an fp32 region
            if self._dense:
                tokens = label_map.mixed_token_targets(layout.grid, distributions=True)  # b n c, rows summing to 1
                prefix = label_map.image_targets().unsqueeze(1).expand(-1, layout.num_prefix, -1)
                y0 = torch.cat([prefix, tokens], dim=1)
            else:
                y0 = initial_weights(label_map, layout)  # b n k
            self._y = y0 if rules.tracks_aligned else None
            self._static = y0 if rules.tracks_input else None

    # ------------------------------------------------------------------ events
    def labels_for(self, layer: int) -> Tensor | None:
        # an aligned layer implies tracked labels (``Rules.tracks_aligned``), so this is never a silent None
        if not self._rules.wants_labels(layer):
            return None
        self._unit()
        return self._y

    def labels_at_scale(self, layer: int) -> Tensor | None:
        """``labels_for(layer)`` as the tracker holds them: times a power of two where summed residuals left them so
        (no multiplication). Only for a linear map whose result comes back through ``residual_sum``."""
        if not self._rules.wants_labels(layer):
            return None
        if self._scale >= _LARGEST_SCALE:  # far inside fp32's range: once in 64 summed residuals, one multiplication
            self._unit()
        return self._y

    def on_launch_routes(self) -> bool:
        """Whether the labels are mixed where every operator is a launch (``eager_launch_routes``)."""
        return eager_launch_routes(self._lm.device)

    def residual_sum(
        self, layer: int, keep: Tensor | None, divided: Callable[[], Tensor], summed: Callable[[Tensor], Tensor] | None,
        shortcut: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """``residual(layer, keep, mixed=divided())`` for a branch whose labels are a linear map of the labels as the
        tracker holds them (``labels_at_scale(layer)``, or ``labels_for(layer)``, with no event between). ``summed(y)``
        (or ``None``) returns ``y`` plus those labels in one operator (``addcdiv``: the branch's last conv divided by its
        in-grid tap weights within the sum, where a division and a ``lerp`` took two). Where the residual is the mean of
        shortcut and branch and no dropped branch is kept, it is taken so: twice the mean, exactly (a power of two),
        which the tracker keeps as its scale (``_unit``).

        ``shortcut``: a linear map of the labels (a downsampling block's shortcut, ``aggregate(shortcut,
        normalised=True, linear=True)``) not yet applied: ``summed(y)`` then applies it to ``y`` itself (a strided view
        the sum reads), and the labels go through it first where the sum is not taken."""
        if self._y is None or not self._rules.wants_labels(layer):
            raise ValueError(
                f"residual_sum(layer={layer}, ...) for a layer this scheme does not align (labels_for({layer}) is None); "
                "mix labels only where labels_for answers"
            )
        if summed is not None and self._rules.residual_share == 0.5 and (keep is None or not self._rules.follow_drop):
            self._y = summed(self._y).float()
            if shortcut is not None and self._static is not None:  # unaligned labels kept for token targets
                with _fp32(self._lm.device):
                    self._static = shortcut(self._static).float()
            self._scale *= 2.0
            return
        if shortcut is not None:
            self.aggregate(shortcut, normalised=True, linear=True)
        mixed = divided()
        self._y = self._rules.residual(self._y, (mixed.detach() if mixed.requires_grad else mixed).float(), keep)

    def _unit(self) -> None:
        """The labels at their own scale again: one exact multiplication by a power of two, where any was left."""
        if self._scale != 1.0 and self._y is not None:
            self._y = self._y * (1.0 / self._scale)
        self._scale = 1.0

    def wants_class_attention(self, layer: int) -> bool:
        return self._rules.wants_class_attention(layer)

    def class_attention(self, layer: int, weights: Tensor, grid: tuple[int, int] | None = None) -> None:
        area = self._layout.area_weights(self._lm) if grid is None else self._lm.token_weights(grid)  # b n k
        with _fp32(weights.device):
            self._class_weights = self._rules.class_weights(weights.detach().float(), area, self._layout.num_prefix)

    def residual(self, layer: int, keep: Tensor | None, *, mixed: Tensor | None) -> None:
        if mixed is None:
            return  # channel mixing (or an unaligned layer): Norm(Y + Y) = Y
        if self._y is None or not self._rules.wants_labels(layer):
            raise ValueError(
                f"residual(layer={layer}, mixed=...) got mixed labels for a layer this scheme does not align "
                f"(labels_for({layer}) is None); pass mixed=None there, and mix labels only where labels_for answers"
            )
        if mixed.requires_grad:  # attention's labels may carry the graph; conv labels never do (no detach to dispatch)
            mixed = mixed.detach()
        self._by_activations = True  # the conv families' launch routes mix by residual_sum/residual_by/projected_by
        self._unit()  # ``mixed`` came from ``labels_for``: at the labels' own scale
        self._y = self._rules.residual(self._y, mixed.float(), keep)

    def residual_by(self, layer: int, keep: Tensor | None, mix: Callable[[Tensor, float], Tensor]) -> None:
        """``residual(layer, keep, mixed=...)`` with the branch's labels and their mean with the labels made by the
        caller in one map: ``mix(y, share)`` returns ``lerp(y, branch(y), share)`` (``Rules.residual_share``; a
        branch of one conv matrix ``M``: ``lerp(I, M, share) @ y``, the matrices of many blocks made together); a
        sample whose branch was dropped keeps its labels as in ``residual`` (``Rules.kept``). Only where
        ``labels_for(layer)`` answers: the same error as ``residual``'s otherwise."""
        if self._y is None or not self._rules.wants_labels(layer):
            raise ValueError(
                f"residual_by(layer={layer}, ...) for a layer this scheme does not align (labels_for({layer}) is None); "
                "mix labels only where labels_for answers"
            )
        self._unit()
        with _fp32(self._lm.device):  # the caller's products in fp32 under any autocast, as ``aggregate``'s
            self._y = self._rules.kept(self._y, mix(self._y, self._rules.residual_share).float(), keep)

    def projected_by(self, layer: int, merge: Callable[[Tensor], Tensor], mix: Callable[[Tensor, float, float], Tensor]) -> None:
        """``aggregate(merge, normalised=True)`` and then ``residual(layer, None, mixed=...)`` of a block whose shortcut
        merges the tokens (a downsampling block's projection) and whose branch's labels the caller maps in one: ``mix(y,
        share, scale)`` returns ``scale * lerp(merge(y), branch(y), share)`` (``Rules.residual_share``), the shortcut's
        and the branch's matrices folded into one, and by ``scale`` (a power of two: one over the scale summed residuals
        left the labels at, ``residual_sum``), which a matrix's ``addmm`` takes without an operator of its own. Unaligned labels kept for token targets go through ``merge`` alone. Only where
        ``labels_for(layer)`` answers and no sample dropped the branch: the same error as ``residual_by``'s otherwise."""
        if self._y is None or not self._rules.wants_labels(layer):
            raise ValueError(
                f"projected_by(layer={layer}, ...) for a layer this scheme does not align (labels_for({layer}) is None); "
                "mix labels only where labels_for answers"
            )
        with _fp32(self._lm.device):
            self._y = mix(self._y, self._rules.residual_share, 1.0 / self._scale).float()
            self._scale = 1.0
            if self._static is not None:
                self._static = merge(self._static).float()

    def aggregate(self, merge: Callable[[Tensor], Tensor], *, normalised: bool = False, linear: bool = False) -> None:
        """The labels through ``merge`` (renormalised unless ``normalised``). ``linear``: ``merge`` is a linear map (a
        path's pools and convs), which takes labels at any scale (``residual_sum``) and keeps it."""
        if not linear:
            self._unit()

        def merged(y: Tensor) -> Tensor:
            y = merge(y).float()
            return y if normalised else self._rules.merge(y)

        with _fp32(self._lm.device):
            if self._y is not None:
                self._y = merged(self._y)
                if not normalised:
                    self._scale = 1.0  # the rows renormalised: at their own scale again
            if self._static is not None:
                self._static = merged(self._static)

    def fork(self) -> Fork:
        self._unit()
        return Fork(self._y, self._static)  # the tensors are never modified in place: each event makes new ones

    def join(
        self, fork: Fork, share: float, *, merge: Callable[[Tensor], Tensor] | None = None, keep: Tensor | None = None,
        normalised: bool = False,
    ) -> None:
        def joined(y: Tensor, forked: Tensor) -> Tensor:
            forked = forked if merge is None else merge(forked)
            return self._rules.join(y, _forked(y, forked.float()), share, keep, normalised=normalised)

        self._unit()
        with _fp32(self._lm.device):
            if self._y is not None and fork.labels is not None:
                self._y = joined(self._y, fork.labels)
            if self._static is not None and fork.static is not None:
                self._static = joined(self._static, fork.static)

    def pool(self, how: Readout, first: int) -> None:
        self._readout = (how, first)

    # ------------------------------------------------------------------ targets
    def _expand(self, w: Tensor) -> Tensor:
        return w if self._dense else self._lm.targets(w)

    def finish(self) -> AlignedTargets:
        self._unit()
        with _fp32(self._lm.device):
            return self._finish()

    def _finish(self) -> AlignedTargets:
        rules, image = self._rules, self._lm.image_weights  # b k
        weights: Tensor | None
        if rules.target == "attention":
            if self._class_weights is None:
                raise _no_class_attention(rules)
            weights = rules.combine(image, self._class_weights)
            target = self._lm.targets(weights)
        elif rules.target == "aligned" and self._y is not None:
            # renormalised where the digest's bits are (the CPU's eager route), in a compiled graph (which fuses it) and
            # wherever a residual mixed the labels by the model's activations: their rounding in the activations' dtype
            # (bf16 under autocast) leaves the rows up to 1e-3 off 1. Where every operator is a launch and only the
            # weights mixed them (the conv families' label convs, fp32), the rows' drift (a few units in the last
            # place) is left alone: two launches fewer
            renormalise = self._by_activations or not eager_launch_routes(self._y.device)
            readout = rules.readout(self._y, *self._readout, renormalise=renormalise)  # b l
            target = self._expand(readout)
            weights = None if self._dense else readout
        else:
            weights = image
            target = self._lm.targets(image)
        token_target = None
        if rules.token_targets != "none":
            source = self._y if rules.token_targets == "aligned" else self._static
            assert source is not None
            token_target = self._expand(normalise_rows(source[:, self._layout.num_prefix :]))  # b n c
        return AlignedTargets(target.detach(), weights, token_target, rules.token_loss_weight)


class DenseTracker:
    """The reference tracker: ``rules`` on dense ``(b, n, c)`` labels with explicit matrices.

    Args:
        rules: the scheme's rules for this batch (``scheme.rules(label_map, layout)``).
        label_map: the batch's map.
        layout: the token layout the labels start on (prefix tokens carry the image target).
        dtype: of the labels; float64 keeps the reference far below the fast path's rounding.

    Example:
        >>> from mixlabels import TLAlign
        >>> lm = TokenLabelMap.unmixed(torch.tensor([0, 1]), num_classes=2, image_size=(4, 4))
        >>> t = DenseTracker.start(TLAlign(), lm, TokenLayout(grid=(2, 2), num_prefix=1, depth=1, class_token=True))
        >>> t.mix(0, torch.full((5, 5), 0.2), keep=None)
        >>> t.result(torch.zeros(2, 2), torch.zeros(2, 2), "token", None).target.tolist()
        [[1.0, 0.0], [0.0, 1.0]]
    """

    def __init__(self, rules: Rules, label_map: TokenLabelMap, layout: TokenLayout, dtype: torch.dtype = torch.float64) -> None:
        self.rules = rules
        self.layout = layout
        self.dtype = dtype
        self._label_map = label_map
        p, grid = layout.num_prefix, layout.grid
        self.image_target = label_map.image_targets()  # b c
        self.area = label_map.targets(layout.area_weights(label_map)).to(dtype)  # b n c, the patches' area labels
        patches = self.area
        if rules.uses_token_targets and label_map.token_targets is not None:
            if layout.pixel_windows is not None:
                raise ValueError("token targets cannot start on a layout's pixel_windows; start the labels on the pixels")
            patches = label_map.mixed_token_targets(grid, distributions=True).to(dtype)  # rows summing to 1
        prefix = self.image_target.to(dtype).unsqueeze(1).expand(-1, p, -1)
        self.y = torch.cat([prefix, patches], dim=1)  # b n c
        self.static = self.y
        self.class_row: Tensor | None = None

    @classmethod
    def start(cls, scheme: Scheme, label_map: TokenLabelMap, layout: TokenLayout, dtype: torch.dtype = torch.float64) -> DenseTracker:
        """The reference tracker of any scheme for one batch."""
        return cls(scheme.rules(label_map, layout), label_map, layout, dtype)

    def mix(self, layer: int, matrix: Tensor, keep: Tensor | None) -> None:
        """A residual branch whose spatial mix is ``matrix`` ``(b|1, n, n)`` (rows sum to 1)."""
        if self.rules.wants_labels(layer):
            self.y = self.rules.residual(self.y, matrix.to(self.y.device, self.dtype) @ self.y, keep)

    def aggregate(self, matrix: Tensor) -> None:
        """Tokens merged by the 0/1 (or weighted) matrix ``(n', n)``; rows renormalised."""
        matrix = matrix.to(self.y.device, self.dtype)  # a matrix built on another device (the CPU) than the labels
        self.y = self.rules.merge(matrix @ self.y)
        self.static = self.rules.merge(matrix @ self.static)

    def fork(self) -> Fork:
        """The labels at a channel split (``LabelTracker.fork``)."""
        return Fork(self.y, self.static)

    def join(self, fork: Fork, share: float, matrix: Tensor | None = None, keep: Tensor | None = None) -> None:
        """The parts concatenated (``LabelTracker.join``), the forked part's spatial map an explicit ``(b|1, n, n)``
        matrix (or none)."""
        def joined(y: Tensor, forked: Tensor) -> Tensor:
            if matrix is not None:
                forked = matrix.to(y.device, self.dtype) @ forked
            return self.rules.join(y, _forked(y, forked), share, keep)

        assert fork.labels is not None and fork.static is not None  # the reference tracks both, always
        self.y, self.static = joined(self.y, fork.labels), joined(self.static, fork.static)

    def wants_class_attention(self, layer: int) -> bool:
        """Whether the rules read the class token's attention row at ``layer`` (``attend_class``)."""
        return self.rules.wants_class_attention(layer)

    def attend_class(self, row: Tensor, grid: tuple[int, int] | None = None) -> None:
        """The head-mean attention row ``(b, n)`` of the class token in the rules' class-attention layer
        (over patch tokens on ``grid``, when that is not the layout's grid)."""
        self.class_row = row.detach().to(self.dtype)
        if grid is not None:
            self.area = self._label_map.targets(self._label_map.token_weights(grid)).to(self.dtype)

    def result(
        self, output: Tensor | tuple[Tensor, ...], logits: Tensor, readout: Readout, token_logits: Tensor | None, first: int | None = None
    ) -> AlignedOutput:
        """The ``AlignedOutput`` for a ``"token"`` (token ``first``, default 0) or ``"mean"`` (tokens
        ``first:``, default the patch tokens) readout."""
        rules, p = self.rules, self.layout.num_prefix
        first = (0 if readout == "token" else p) if first is None else first
        image = self.image_target.to(self.dtype)
        if rules.target == "attention":
            if self.class_row is None:
                raise _no_class_attention(rules)
            target = rules.combine(image, rules.class_weights(self.class_row, self.area, p))
        elif rules.target == "aligned":
            target = rules.readout(self.y, readout, first)
        else:
            target = image
        tokens = None
        if rules.token_targets != "none":
            tokens = normalise_rows((self.y if rules.token_targets == "aligned" else self.static)[:, p:]).float()
        return AlignedOutput(output, logits, target.float().detach(), None, token_logits, tokens, rules.token_loss_weight)
