"""Alignment schemes: what the adapter's events do to the labels.

- ``NoAlign``: the image-level mix (the CutMix/MixUp baseline). Asks for nothing.
- ``TransMix``: last layer's class-token attention over the patch tokens re-weights
  the sources; the target averages it with the area weights.
- ``TLAlign``: token-label alignment (TL-Align, Eq. 5-12) in every layer or in chosen ones.
- ``TokenLabeling``: class loss plus beta times a dense per-token loss (Token Labeling
  Eq. 3-7), token targets unaligned (MixToken) or aligned through the layers.

All trackers carry labels as ``(b, n, l)`` fp32 weights: ``l = k`` sources (compact,
expanded to classes only at the end: alignment is linear) or ``l = c`` classes when
a token annotator supplies dense per-token labels.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor

from mixlabels._align import AlignedTargets, LabelTracker, Readout, TokenLayout, initial_weights
from mixlabels._label_map import TokenLabelMap

__all__ = ["NoAlign", "TransMix", "TLAlign", "TokenLabeling", "TokenAnnotator", "DropPathRule"]

DropPathRule = Literal["follow", "official"]
"""What a block's label update does for a sample whose attention branch stochastic depth dropped.

``"follow"``: labels follow the tokens; the sample's tokens did not mix, so its labels stay.
``"official"``: the official TL-Align code's rule, ``Y <- Norm(Y + A Y)`` for every sample.
"""


class TokenAnnotator(Protocol):
    """Dense per-token class distributions of a mixed batch (token labeling's annotator maps).

    Called with the label map and the patch grid, returns ``(b, h*w, c)`` fp32 rows on the
    simplex, already mixed like the images. A later issue provides score-map annotators.
    """

    def __call__(self, label_map: TokenLabelMap, grid: tuple[int, int]) -> Tensor: ...


def _fp32(device: torch.device) -> torch.autocast:
    # Labels stay fp32 under autocast: einsum/matmul would otherwise run in bf16.
    return torch.autocast(device_type=device.type, enabled=False)


def _normalise(w: Tensor) -> Tensor:
    # Rows are convex combinations in exact arithmetic; dividing by the sum removes the
    # drift of low-precision attention (bf16 autocast) so targets stay distributions.
    return w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)


class _Tracker:
    """One tracker for every scheme; the schemes below only choose its switches."""

    def __init__(
        self,
        label_map: TokenLabelMap,
        layout: TokenLayout,
        *,
        align: frozenset[int] = frozenset(),
        normalize: bool = True,
        follow_drop: bool = True,
        transmix_layer: int | None = None,
        aligned_target: bool = False,
        token_targets: bool = False,
        token_loss_weight: float = 0.0,
        annotator: TokenAnnotator | None = None,
    ) -> None:
        self._lm = label_map
        self._layout = layout
        self._align = align
        self._normalize = normalize
        self._follow_drop = follow_drop
        self._transmix_layer = transmix_layer
        self._aligned_target = aligned_target
        self._token_targets = token_targets
        self._beta = token_loss_weight
        self._dense = annotator is not None
        self._y: Tensor | None = None  # b n l, the aligned labels
        self._static: Tensor | None = None  # b n l, unaligned labels for token targets
        self._pending: Tensor | None = None  # b n l, labels of the residual branch in flight
        self._class_weights: Tensor | None = None  # b k, TransMix's attention lambda
        self._readout: tuple[Readout, int] = ("token" if layout.class_token else "mean", layout.num_prefix)
        if align or token_targets:
            if annotator is not None:
                tokens = annotator(label_map, layout.grid).float()  # b n c
                prefix = label_map.image_targets().unsqueeze(1).expand(-1, layout.num_prefix, -1)
                y0 = torch.cat([prefix, tokens], dim=1)
            else:
                y0 = initial_weights(label_map, layout)  # b n k
            self._y = y0 if (align or aligned_target) else None
            self._static = y0 if token_targets and not aligned_target else None

    # ------------------------------------------------------------------ events
    def wants_labels(self, layer: int) -> bool:
        return layer in self._align

    def labels(self) -> Tensor:
        if self._y is None:
            raise RuntimeError("labels() called on a tracker that aligns no labels; check wants_labels() first")
        return self._y

    def spatial_mix(self, layer: int, mixed: Tensor) -> None:
        self._pending = mixed.detach().float()

    def wants_class_attention(self, layer: int) -> bool:
        return layer == self._transmix_layer

    def class_attention(self, layer: int, weights: Tensor) -> None:
        p = self._layout.num_prefix
        attn = weights.detach().float()[:, p:]  # b n: renormalised over the patch tokens only
        attn = attn / attn.sum(dim=-1, keepdim=True)
        area = self._lm.token_weights(self._layout.grid)  # b n k
        with _fp32(attn.device):
            self._class_weights = torch.einsum("bn,bnk->bk", attn, area)

    def residual(self, layer: int, keep: Tensor | None) -> None:
        branch, self._pending = self._pending, None
        if branch is None or self._y is None:
            return  # channel mixing: Norm(Y + Y) = Y
        # Eq. 11: Norm(Y + A Y), Norm a simple average. Without normalisation (Table 8)
        # the label residual is not modelled: the branch's labels replace Y (see TLAlign).
        new = (self._y + branch) / 2 if self._normalize else branch
        if keep is not None and self._follow_drop:  # a sample whose branch was dropped keeps its labels
            new = torch.where(keep.view(-1, 1, 1), new, self._y)
        self._y = new

    def aggregate(self, merge: Callable[[Tensor], Tensor]) -> None:
        with _fp32(self._lm.device):
            if self._y is not None:
                self._y = _normalise(merge(self._y).float())
            if self._static is not None:
                self._static = _normalise(merge(self._static).float())

    def pool(self, how: Readout, first: int) -> None:
        self._readout = (how, first)

    # ------------------------------------------------------------------ targets
    def _expand(self, w: Tensor) -> Tensor:
        return w if self._dense else self._lm.targets(w)

    def finish(self) -> AlignedTargets:
        with _fp32(self._lm.device):
            return self._finish()

    def _finish(self) -> AlignedTargets:
        image = self._lm.image_weights  # b k
        weights: Tensor | None
        if self._class_weights is not None:
            weights = (self._class_weights + image) / 2  # TransMix: average with the area lambda
            target = self._lm.targets(weights)
        elif self._aligned_target and self._y is not None:
            how, first = self._readout
            readout = self._y[:, first] if how == "token" else self._y[:, first:].mean(dim=1)  # b l
            readout = _normalise(readout)
            target = self._expand(readout)
            weights = None if self._dense else readout
        else:
            weights = image
            target = self._lm.targets(image)
        token_target = None
        if self._token_targets:
            source = self._y if self._aligned_target else self._static
            assert source is not None
            token_target = self._expand(_normalise(source[:, self._layout.num_prefix :]))  # b n c
        return AlignedTargets(target.detach(), weights, token_target, self._beta)


@dataclass(frozen=True)
class NoAlign:
    """The image-level mix: target = ``label_map.image_targets()``; adds no work.

    Example:
        >>> NoAlign().needs_token_logits
        False
    """

    @property
    def needs_token_logits(self) -> bool:
        return False

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return _Tracker(label_map, layout)


@dataclass(frozen=True)
class TransMix:
    """TransMix: ``lambda = (lambda_attn + lambda_area) / 2``.

    ``lambda_attn`` is the last layer's class-token attention (mean over heads,
    renormalised over the patch tokens) summed over each source's token area. Needs
    a class token; a pooled model gets a clear error.
    """

    @property
    def needs_token_logits(self) -> bool:
        return False

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        if not layout.class_token:
            raise ValueError(
                "TransMix reads the class token's attention, but this model has no class token "
                "(global pooling); use TLAlign() or NoAlign() instead"
            )
        return _Tracker(label_map, layout, transmix_layer=layout.depth - 1)


def _resolve_layers(layers: Sequence[int] | None, depth: int) -> frozenset[int]:
    if layers is None:
        return frozenset(range(depth))
    bad = [i for i in layers if not -depth <= i < depth]
    if bad:
        raise ValueError(
            f"TLAlign layers {bad} out of range for a model with {depth} layers: use 0-based indices "
            f"in [0, {depth - 1}] or negative ones from the end (-1 is the last layer)"
        )
    resolved = [i % depth for i in layers]
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"TLAlign layers {list(layers)} name the same layer twice on a model with {depth} layers "
            f"(negative indices count from the end); list each layer once"
        )
    return frozenset(resolved)


_LAYERS_ACCEPTED = (
    "TLAlign layers takes distinct integer layer indices, 0-based (negative ones count from the end: -1 is "
    "the last layer), e.g. layers=(1, 3, 5, 7); or None to align every layer"
)


def _check_layers(layers: object) -> tuple[int, ...]:
    """``layers`` as a tuple of distinct ints, or an error saying what is accepted (never truncated)."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"{_LAYERS_ACCEPTED}; got {layers!r}")
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{_LAYERS_ACCEPTED}; got {list(layers)!r}, where {i!r} is not an integer")
        out.append(int(i))
    if not out:
        raise ValueError(f"{_LAYERS_ACCEPTED}; got no layers (NoAlign() aligns none)")
    if len(set(out)) != len(out):
        raise ValueError(f"{_LAYERS_ACCEPTED}; got {out}, which repeats a layer")
    return tuple(out)


@dataclass(frozen=True)
class TLAlign:
    """Token-label alignment (TL-Align Eq. 5-12): labels follow the tokens through attention.

    Labels start as in Eq. 5 (prefix tokens: the image weights; patch tokens: their exact
    area fractions). In each aligned layer, ``Y <- Norm(Y + mean_h(A_h) Y)`` (Eq. 11, Norm a
    simple average); MLP residuals leave labels unchanged; a sample whose attention branch
    is dropped by stochastic depth keeps its labels (``drop_path="follow"``). The target is the class token's label,
    or the mean of the patch tokens' labels for pooled models.

    Args:
        layers: 0-based indices of the aligned layers (negative counts from the end);
            ``None`` aligns every layer. Table 8's rows on a 12-layer DeiT-S:
            "Layer 12" is ``layers=(-1,)`` (or ``(11,)``), "Layer 2,4,6,8" (1-based in the
            paper) is ``layers=(1, 3, 5, 7)``.
        normalize: ``False`` is Table 8's "Normalization Disabled". Summing without the
            average (``Y <- Y + A Y``, ``Y <- Y + Y``) scales every row by the same 2 per
            residual, so a final renormalisation would make it identical to the default:
            not an ablation. We read it as the paper's stated cause, "inaccurate alignment
            at the presence of residual connections": the label update drops the residual,
            ``Y <- mean_h(A_h) Y`` (labels follow the attention alone). Rows stay on the
            simplex, so targets remain distributions (renormalised at readout anyway).
        drop_path: ``"follow"`` (default): a sample whose attention branch stochastic depth
            dropped keeps its labels in that layer: its tokens did not mix, and labels follow
            the tokens. ``"official"``: the official TL-Align code's rule, which updates every
            sample's labels (``Y <- Norm(Y + mean_h(A_h) Y)``) whether or not its branch was
            dropped; use it to reproduce the official numbers. Identical without stochastic
            depth (``drop_path_rate=0`` or eval mode).

    Example:
        >>> TLAlign(layers=(-1,)), TLAlign(layers=(1, 3, 5, 7)), TLAlign(normalize=False)  # Table 8
        (TLAlign(layers=(-1,), normalize=True, drop_path='follow'), TLAlign(layers=(1, 3, 5, 7), normalize=True, drop_path='follow'), TLAlign(layers=None, normalize=False, drop_path='follow'))
        >>> TLAlign(drop_path="official").drop_path
        'official'
    """

    layers: tuple[int, ...] | None = None
    normalize: bool = True
    drop_path: DropPathRule = "follow"

    def __init__(self, layers: Sequence[int] | None = None, normalize: bool = True, drop_path: DropPathRule = "follow") -> None:
        if drop_path not in ("follow", "official"):
            raise ValueError(
                f"TLAlign drop_path={drop_path!r} is not a rule: use 'follow' (labels of a sample whose "
                "attention branch was dropped stay) or 'official' (the official code: they mix anyway)"
            )
        object.__setattr__(self, "layers", None if layers is None else _check_layers(layers))
        if not isinstance(normalize, bool):
            raise TypeError(f"TLAlign normalize must be True or False, got {normalize!r}")
        object.__setattr__(self, "normalize", normalize)
        object.__setattr__(self, "drop_path", drop_path)

    @property
    def needs_token_logits(self) -> bool:
        return False

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return _Tracker(
            label_map,
            layout,
            align=_resolve_layers(self.layers, layout.depth),
            normalize=self.normalize,
            follow_drop=self.drop_path == "follow",
            aligned_target=True,
        )


@dataclass(frozen=True)
class TokenLabeling:
    """Token labeling: ``CE(class logits, y_cls) + beta * mean_i CE(token logits_i, y_i)`` (Eq. 3-4).

    Per-token logits are the model's head on its normalised patch tokens (LV-ViT).

    Args:
        beta: weight of the dense token loss (0.5 in the paper).
        aligned: ``False``: token targets are the patch tokens' area fractions and the class
            target the image mix (MixToken, Eq. 6-7). ``True``: both are aligned through every
            layer as in ``TLAlign()``: dense supervision without an annotator.
        annotator: dense per-token labels from a teacher's score maps, replacing the label
            map's token weights as the per-token labels (then carried as ``(b, n, c)``).

    Example:
        >>> TokenLabeling(beta=0.5, aligned=True).needs_token_logits
        True
    """

    beta: float = 0.5
    aligned: bool = False
    annotator: TokenAnnotator | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta < float("inf"):
            raise ValueError(f"TokenLabeling beta must be a finite number >= 0 (the token loss weight), got {self.beta}")
        if self.annotator is not None and not callable(self.annotator):
            raise TypeError(
                f"TokenLabeling annotator must be callable as annotator(label_map, grid) (e.g. a DenseTokenAnnotator), "
                f"got {type(self.annotator).__name__}"
            )

    @property
    def needs_token_logits(self) -> bool:
        return True

    def start(self, label_map: TokenLabelMap, layout: TokenLayout) -> LabelTracker:
        return _Tracker(
            label_map,
            layout,
            align=frozenset(range(layout.depth)) if self.aligned else frozenset(),
            aligned_target=self.aligned,
            token_targets=True,
            token_loss_weight=self.beta,
            annotator=self.annotator,
        )
