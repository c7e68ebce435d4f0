"""TokenLabelMap: which batch element every region of a mixed batch comes from.

A mixed sample is a convex combination of K *sources* (K = 2 for pairwise mixing;
source 0 is always the sample itself, the un-permuted batch element). The map keeps

- ``sources``       ``(b, k)``          batch index of each source,
- ``mask``          a ``Mask``: weight of each source in every region (a ``CellMask``
                    ``(b, k, mh, mw)``, or a ``BoxMask`` for CutMix's boxes),
- ``image_weights`` ``(b, k)``          image-level weight (lambda) of each source,
- the class targets of the un-mixed batch (integer or soft labels),

and derives from them, exactly, the weights of any token grid that divides the
image, and the class distributions those weights stand for. Everything stays
compact: labels travel through a network as ``(b, n, k)`` weights and become
``(b, n, c)`` class distributions only at the end (see ``targets``). A CutMix
mask is kept as its boxes (``from_boxes``): its token weights come from box/token
overlaps, and its cells are built only when ``mask.dense()`` asks for them.

Shapes, named once: ``b`` batch, ``k`` sources, ``mh mw`` mask cells, ``h w`` a
token grid, ``n = h * w`` tokens, ``c`` classes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import NoReturn

import torch
from einops import rearrange, reduce
from torch import Tensor

from mixlabels._mask import BoxMask, CellMask, Mask
from mixlabels._routes import rounding_matmuls

__all__ = ["TokenLabelMap", "class_distributions", "check_labels", "check_token_targets"]


def fp32_labels(device: torch.device) -> AbstractContextManager[object]:
    """A region where label arithmetic stays fp32 under a caller's autocast: matmul and einsum would otherwise run in
    bf16 there, and fp32 label tensors would meet bf16 ones (``lerp`` refuses the pair; a sum would quietly round).
    The meta device has no autocast (and refuses the context), so nothing is needed there; nor where autocast is off
    (entering and leaving an autocast context costs a few microseconds of host time, and the label path enters it dozens
    of times a step), except while tracing, where the context is kept for the graph to record."""
    if device.type == "meta" or not (torch.compiler.is_compiling() or torch.is_autocast_enabled(device.type)):
        return nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def _weighted_sum(weights: Tensor, values: Callable[[int], Tensor]) -> Tensor:
    """``sum_s weights[..., s] * values(s)``, ``weights`` ``(b, n, k)`` and ``values(s)`` broadcasting to ``(b, n, c)``:
    a product over the sources by fp32 multiply-adds, which no matmul precision setting rounds (a label expansion's
    ``k`` is 2 or a few). Eagerly accumulated in place: one ``(b, n, c)`` buffer, as the matmul's output. While
    compiling, out of place: the compiler fuses the sum into one kernel, where the in-place chain cost compiled
    resnet18's CutMix step four kernels more (62 -> 66 launches, ``benchmarks/op_count.py --compiled``)."""
    out = weights[..., 0:1] * values(0)
    compiling = torch.compiler.is_compiling()
    for s in range(1, int(weights.shape[-1])):
        out = out + weights[..., s : s + 1] * values(s) if compiling else out.addcmul_(weights[..., s : s + 1], values(s))
    return out


def _fail(message: str) -> None:
    raise ValueError(message)


def check_labels(labels: Tensor, num_classes: int) -> None:
    """Raise a clear error unless ``labels`` are valid class targets for ``num_classes``.

    Integer labels ``(b,)`` must lie in ``[0, num_classes)``; soft labels
    ``(b, c)`` must be finite, non-negative rows summing to 1. One host sync.
    """
    _check_num_classes(num_classes)
    if not isinstance(labels, Tensor):
        _fail(f"labels must be a tensor of class ids (batch,) or probabilities (batch, c), got {type(labels).__name__}")
    if labels.is_floating_point():
        if labels.ndim != 2 or labels.shape[1] != num_classes:
            _fail(
                f"soft labels must have shape (batch, num_classes={num_classes}), got "
                f"{tuple(labels.shape)}; pass integer class ids of shape (batch,) or "
                f"probabilities of shape (batch, {num_classes})"
            )
        if labels.numel() == 0:
            return
        bad = (~torch.isfinite(labels)).any() | (labels < 0).any()
        off_simplex = (labels.sum(dim=1) - 1).abs().max() > 1e-3
        flags = torch.stack([bad, off_simplex]).tolist()
        if flags[0]:
            _fail("soft labels contain NaN, inf or negative values; each row must be a distribution")
        if flags[1]:
            _fail("soft label rows must sum to 1 (within 1e-3); normalise them or pass class ids")
        return
    if labels.dtype in (torch.bool, torch.complex64, torch.complex128):
        _fail(f"labels must be integer class ids or float probabilities, got dtype {labels.dtype}")
    if labels.ndim != 1:
        _fail(
            f"integer labels must have shape (batch,), got {tuple(labels.shape)}; "
            "for one-hot or soft targets pass a float tensor of shape (batch, num_classes)"
        )
    if labels.numel() == 0:
        return
    lo, hi = torch.aminmax(labels)
    lo_v, hi_v = int(lo), int(hi)
    if lo_v < 0 or hi_v >= num_classes:
        _fail(
            f"labels out of range: found class ids in [{lo_v}, {hi_v}] but num_classes={num_classes}; "
            f"ids must lie in [0, {num_classes - 1}]"
        )


def check_token_targets(maps: Tensor) -> None:
    """Raise unless annotator maps ``(b, h, w, c)`` are probabilities: finite, >= 0, each cell summing to at most 1
    and more than 0.

    (At most, not exactly: top-k maps expanded with ``fill="zeros"`` leave the rest of the mass out; the trackers
    read every cell as its classes' distribution, ``mixed_token_targets(distributions=True)``.) A cell with no mass
    at all is refused: it has no distribution, a token covering it and labelled cells would get a row summing to
    less than 1, and such rows mix differently wherever a backbone renormalises (the fast path and the float64
    reference renormalise at different points). One host read.
    """
    if maps.numel() == 0:
        return
    m = maps.float()
    total = m.sum(dim=-1)
    flags = torch.stack([(~torch.isfinite(m)).any(), (m < 0).any(), (total > 1.01).any(), (total <= 0).any()]).tolist()
    if flags[0] or flags[1] or flags[2]:
        found = "NaN or inf values" if flags[0] else "negative values" if flags[1] else "cells summing to more than 1"
        _fail(
            f"token_targets must be class probabilities per cell, found {found}: these look like logits or "
            "unnormalised scores. Pass probabilities, e.g. maps.softmax(dim=-1) of an annotator's logits"
        )
    if flags[3]:
        b, h, w = (int(i) for i in (total <= 0).nonzero()[0])
        _fail(
            f"token_targets has cells with no class mass (all zeros; the first: sample {b}, cell ({h}, {w})): every "
            "cell needs a class distribution, since a token's target is made of its cells'. Give such cells one "
            "(the image's one-hot label, or a uniform 1 / num_classes), or store the maps with more classes per cell"
        )


def _check_num_classes(num_classes: object) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        _fail(f"num_classes must be >= 1, got {num_classes!r}; pass the number of classes as an integer")


def _check_image_size(image_size: object) -> None:
    sides = list(image_size) if isinstance(image_size, (tuple, list, torch.Size)) else []
    if len(sides) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sides):
        _fail(f"image_size must be (height, width) in pixels, two positive integers, got {image_size!r}")


def class_distributions(labels: Tensor, num_classes: int, label_smoothing: float = 0.0) -> Tensor:
    """Class distributions ``(b, c)`` in fp32 for integer ``(b,)`` or soft ``(b, c)`` labels.

    Label smoothing follows timm's ``one_hot``: off value ``s / c``, on value
    ``1 - s + s / c``; soft labels are smoothed as ``(1 - s) y + s / c``.
    """
    off = label_smoothing / num_classes
    if labels.is_floating_point():
        return labels.float() * (1.0 - label_smoothing) + off
    out = torch.full((labels.shape[0], num_classes), off, dtype=torch.float32, device=labels.device)
    return out.scatter_(1, labels.long().unsqueeze(1), 1.0 - label_smoothing + off)


_NOT_A_TARGET_TENSOR = (
    "a TokenLabelMap reached a loss written for target tensors (timm's SoftTargetCrossEntropy or BinaryCrossEntropy "
    "inside a timm task that does not take label maps: LogitDistillationTask or TokenDistillationTask from "
    "train.py's --kd-model-name, or ClassificationTask). Train with mixlabels.backbones.AlignedClassificationTask("
    "model, scheme), which aligns the targets; timm's distillation tasks cannot align them: pass them "
    "label_map.image_targets() (the mixed image-level targets, as timm's Mixup gives) or distil without mixing"
)


@dataclass(frozen=True, eq=False)
class TokenLabelMap:
    """A mixed batch's sources, their per-region weights and their class targets.

    Construct it with ``from_mask`` (pairwise mixing), ``from_boxes`` (CutMix, the
    mask kept as boxes), ``unmixed`` or, for K sources, directly. Construction
    checks shapes and dtypes (no host sync); ``from_mask`` and ``check`` also check
    values.

    Args:
        sources: ``(b, k)`` long, batch index of every source; column 0 is ``arange(b)``.
        mask: the weight of each source in each region: a ``CellMask`` of ``(b, k, mh, mw)``
            fp32 cells, each covering ``(H / mh, W / mw)`` pixels (a 1x1 mask is MixUp),
            or a ``BoxMask`` (``from_boxes``). ``mask.dense()`` gives the cells.
        image_weights: ``(b, k)`` fp32, image-level weight of each source; column 0
            is lambda in timm's convention (the weight of the un-permuted sample).
        labels: class targets of the un-mixed batch: ``(b,)`` integer ids or
            ``(b, c)`` probabilities. Never cast with the images, so ids stay exact.
        num_classes: ``c``.
        image_size: ``(H, W)`` of the mixed images in pixels.
        label_smoothing: applied when class targets are expanded, in ``[0, 1)``.
        token_space: the mix is to be applied to patch embeddings (MixToken), not
            to pixels: the images were returned unmixed.
        token_targets: optional per-batch annotator maps ``(b, h, w, c)``: each un-mixed
            sample's dense class distributions on an ``h x w`` grid, aligned to its crop
            (``score_maps.align_score_maps``); set with ``with_token_targets``. Schemes with
            token targets (``TokenLabeling``) use them, mixed like the tokens, as the patch
            tokens' labels (``mixed_token_targets``).
        progress: optional training progress of this batch in ``[0, 1]`` (e.g. ``step /
            total_steps``), for schemes whose rules change over training (``MixPro``); set
            with ``with_progress``.
        validated: the values are known valid (weights in ``[0, 1]`` summing to 1, labels in
            range): set by this library's mixers, and by ``from_mask`` and ``unmixed`` with their
            value checks. The adapters check a map that is not, once where it enters
            the model (``check``: every call on the CPU, the first call on an accelerator).

    Example:
        >>> import torch
        >>> mask = torch.zeros(2, 4, 4); mask[:, :2] = 1.0  # top half from the sample itself
        >>> lm = TokenLabelMap.from_mask(mask, torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
        >>> lm.image_weights[:, 0].tolist()
        [0.5, 0.5]
        >>> lm.mask.shape, lm.token_weights((2, 2))[0, :, 0].tolist()
        (torch.Size([2, 2, 4, 4]), [1.0, 1.0, 0.0, 0.0])
        >>> lm.targets(lm.image_weights)[0, [3, 7]].tolist()
        [0.5, 0.5]
    """

    sources: Tensor
    mask: Mask
    image_weights: Tensor
    labels: Tensor
    num_classes: int
    image_size: tuple[int, int]
    label_smoothing: float = 0.0
    token_space: bool = False
    token_targets: Tensor | None = None
    progress: float | None = None
    validated: bool = False

    def __post_init__(self) -> None:
        for name in ("sources", "image_weights", "labels"):
            value = getattr(self, name)
            if not isinstance(value, Tensor):
                _fail(f"{name} must be a tensor, got {type(value).__name__}; convert it with torch.as_tensor(...)")
        _check_num_classes(self.num_classes)
        _check_image_size(self.image_size)
        b = self.sources.shape[0] if self.sources.ndim == 2 else -1
        if self.sources.ndim != 2 or self.sources.dtype != torch.long:
            _fail(f"sources must be a (batch, k) long tensor, got {tuple(self.sources.shape)} {self.sources.dtype}")
        k = self.sources.shape[1]
        mask = self.mask
        if isinstance(mask, Tensor):  # the one likely mistake; a protocol check would not compile
            _fail(
                "mask must be a Mask (CellMask or BoxMask), got a Tensor; wrap per-cell weights "
                "of shape (batch, k, mh, mw) as CellMask(weights), or build the map with from_mask/from_boxes"
            )
        if len(mask.shape) != 4 or mask.shape[:2] != (b, k):
            _fail(f"mask must have shape (batch={b}, k={k}, mh, mw), got {tuple(mask.shape)}")
        cells_dtype = mask.cells.dtype if isinstance(mask, CellMask) else torch.float32
        if cells_dtype != torch.float32 or self.image_weights.dtype != torch.float32:
            _fail(
                f"mask and image_weights must be float32 (labels are kept in fp32 whatever the image dtype), "
                f"got {cells_dtype} and {self.image_weights.dtype}. (Under FSDP2, a MixedPrecisionPolicy with "
                "cast_forward_inputs=True casts every float tensor of the forward's arguments, a label map's too: "
                "shard the adapted module with cast_forward_inputs=False and pass the images in param_dtype, "
                "adapted(images.to(param_dtype), label_map); docs/distributed.md)"
            )
        if self.image_weights.shape != (b, k):
            _fail(f"image_weights must have shape (batch={b}, k={k}), got {tuple(self.image_weights.shape)}")
        if self.labels.shape[0] != b:
            _fail(f"labels have batch size {self.labels.shape[0]} but the mask has {b}; they must match")
        if not 0.0 <= self.label_smoothing < 1.0:
            _fail(f"label_smoothing must lie in [0, 1), got {self.label_smoothing}")
        if self.num_classes < 1:
            _fail(f"num_classes must be >= 1, got {self.num_classes}")
        if self.labels.is_floating_point():
            if self.labels.ndim != 2 or self.labels.shape[1] != self.num_classes:
                _fail(
                    f"soft labels must have shape (batch, num_classes={self.num_classes}), "
                    f"got {tuple(self.labels.shape)}"
                )
        elif self.labels.ndim != 1 or self.labels.dtype == torch.bool:
            _fail(
                f"labels must be integer class ids (batch,) or float probabilities (batch, num_classes), "
                f"got {tuple(self.labels.shape)} {self.labels.dtype}"
            )
        t = self.token_targets
        if t is not None and (t.ndim != 4 or t.shape[0] != b or t.shape[3] != self.num_classes or not t.is_floating_point()):
            _fail(
                f"token_targets must be float (batch={b}, h, w, num_classes={self.num_classes}) per-sample maps "
                f"(as align_score_maps returns them), got {tuple(t.shape)} {t.dtype}"
            )
        if self.progress is not None and not 0.0 <= self.progress <= 1.0:
            _fail(f"progress must lie in [0, 1] (e.g. step / total_steps), got {self.progress}")
        hh, ww = self.image_size
        mh, mw = mask.shape[2:]
        if hh % mh or ww % mw:
            _fail(
                f"mask cells ({mh}x{mw}) must tile the image ({hh}x{ww}) exactly: "
                "choose a mask resolution that divides the image size"
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_mask(
        cls,
        mask: Tensor,
        partner: Tensor,
        labels: Tensor,
        num_classes: int,
        label_smoothing: float = 0.0,
        image_size: tuple[int, int] | None = None,
        token_space: bool = False,
        validate: bool = True,
    ) -> TokenLabelMap:
        """Pairwise map from the per-cell weight of source 0 and the batch index of source 1.

        Args:
            mask: ``(b, mh, mw)`` or ``(b, 1, mh, mw)`` weight in ``[0, 1]`` of the sample
                itself in every cell (bool or float; 1 keeps the sample's own pixel).
            partner: ``(b,)`` long, batch index of source 1.
            labels: ``(b,)`` class ids or ``(b, c)`` probabilities of the un-mixed batch.
            num_classes: ``c``.
            label_smoothing: in ``[0, 1)``.
            image_size: ``(H, W)``; defaults to the mask size (a per-pixel mask).
            token_space: mark the map for mixing patch embeddings (MixToken).
            validate: check values (ranges, NaN, label ids): one host sync.

        Returns:
            A map with ``k = 2`` whose image weights are the mask's area means.
        """
        if mask.ndim == 4:
            if mask.shape[1] != 1:
                _fail(f"a 4-d mask must have one channel (b, 1, mh, mw), got {tuple(mask.shape)}")
            mask = mask[:, 0]
        if mask.ndim != 3:
            _fail(f"mask must have shape (batch, mh, mw), got {tuple(mask.shape)}")
        if not (mask.is_floating_point() or mask.dtype == torch.bool):
            _fail(f"mask must be float (weights in [0, 1]) or bool, got {mask.dtype}")
        if partner.ndim != 1 or partner.dtype not in (torch.long, torch.int32, torch.int64):
            _fail(f"partner must be a (batch,) integer tensor of batch indices, got {tuple(partner.shape)} {partner.dtype}")
        b = mask.shape[0]
        if partner.shape[0] != b:
            _fail(f"partner has batch size {partner.shape[0]} but the mask has {b}; they must match")
        if labels.shape[0] != b:
            _fail(f"labels have batch size {labels.shape[0]} but the mask has {b}; they must match")
        if validate:
            check_labels(labels, num_classes)
            if b:
                m = mask.float()
                flags = torch.stack(
                    [torch.isnan(m).any(), (m < 0).any() | (m > 1).any(), (partner < 0).any() | (partner >= b).any()]
                ).tolist()
                if flags[0]:
                    _fail("mask contains NaN; every cell needs a weight in [0, 1]")
                if flags[1]:
                    _fail("mask weights must lie in [0, 1] (the weight of the sample itself); found values outside")
                if flags[2]:
                    _fail(f"partner indices must lie in [0, {b - 1}] (batch indices of the mixed-in samples)")
        w0 = mask.float()
        size = image_size if image_size is not None else (int(mask.shape[1]), int(mask.shape[2]))
        own = torch.arange(b, device=partner.device, dtype=torch.long)
        sources = torch.stack([own, partner.long()], dim=1)
        cells = torch.stack([w0, 1.0 - w0], dim=1)
        lam = reduce(w0, "b mh mw -> b", "mean")
        return cls(
            sources=sources,
            mask=CellMask(cells),
            image_weights=torch.stack([lam, 1.0 - lam], dim=1),
            labels=labels,
            num_classes=num_classes,
            image_size=(int(size[0]), int(size[1])),
            label_smoothing=float(label_smoothing),
            token_space=token_space,
            validated=validate,  # weights 0..1 checked, and [w0, 1 - w0] sums to 1 by construction
        )

    @classmethod
    def from_boxes(
        cls,
        boxes: Tensor,
        grid: tuple[int, int],
        partner: Tensor,
        labels: Tensor,
        num_classes: int,
        label_smoothing: float = 0.0,
        image_size: tuple[int, int] | None = None,
        token_space: bool = False,
        lam: Tensor | None = None,
        validated: bool = False,
    ) -> TokenLabelMap:
        """Pairwise map of CutMix boxes: the partner fills each box, the sample keeps the rest.

        Equal to ``from_mask`` of the boxes' cell mask (1 outside the box), but the mask
        is a ``BoxMask``: token weights come from box/token overlaps, lambda from the box
        areas, and cells are built only for ``pixel_weights``, ``mix_pixels`` or ``mask.dense()``.
        No host sync and no value checks (the boxes come from a sampler).

        Args:
            boxes: ``(b, 4)`` long ``(y0, y1, x0, x1)`` in cells, half-open, inside the grid;
                an empty box (``y1 <= y0`` or ``x1 <= x0``) leaves the sample unmixed.
            grid: ``(gh, gw)`` cells; a cell covers ``(H / gh, W / gw)`` pixels.
            partner: ``(b,)`` long, batch index of source 1.
            labels: ``(b,)`` class ids or ``(b, c)`` probabilities of the un-mixed batch.
            num_classes: ``c``.
            label_smoothing: in ``[0, 1)``.
            image_size: ``(H, W)``; defaults to the grid (pixel boxes).
            token_space: mark the map for mixing patch embeddings (MixToken).
            lam: ``(b,)`` weight of source 0 to use instead of the area (timm's uncorrected lambda).
            validated: the caller vouches for the values (a sampler's boxes and lambdas, labels it
                checked); otherwise an adapter checks them once (see ``validated`` on the class).

        Returns:
            A map with ``k = 2``.

        Example:
            >>> lm = TokenLabelMap.from_boxes(torch.tensor([[0, 2, 0, 4], [0, 0, 0, 0]]), (4, 4),
            ...                               torch.tensor([1, 0]), torch.tensor([3, 7]), num_classes=10)
            >>> lm.image_weights[:, 0].tolist(), lm.mask.dense()[0, 1, :, 0].tolist()
            ([0.5, 1.0], [1.0, 1.0, 0.0, 0.0])
        """
        if boxes.ndim != 2 or boxes.shape[1] != 4 or boxes.dtype != torch.long:
            _fail(f"boxes must be a (batch, 4) long tensor (y0, y1, x0, x1), got {tuple(boxes.shape)} {boxes.dtype}")
        if partner.ndim != 1 or partner.shape[0] != boxes.shape[0]:
            _fail(f"partner must have shape (batch={boxes.shape[0]},), got {tuple(partner.shape)}")
        boxes_mask = BoxMask(boxes, (int(grid[0]), int(grid[1])))
        w0 = boxes_mask.source_mean() if lam is None else lam.float()
        own = torch.arange(boxes.shape[0], device=partner.device, dtype=torch.long)
        size = image_size if image_size is not None else boxes_mask.grid
        return cls(
            sources=torch.stack([own, partner.long()], dim=1),
            mask=boxes_mask,
            image_weights=torch.stack([w0, 1.0 - w0], dim=1),
            labels=labels,
            num_classes=num_classes,
            image_size=(int(size[0]), int(size[1])),
            label_smoothing=float(label_smoothing),
            token_space=token_space,
            validated=validated,
        )

    @classmethod
    def unmixed(
        cls,
        labels: Tensor,
        num_classes: int,
        image_size: tuple[int, int],
        label_smoothing: float = 0.0,
        validate: bool = True,
    ) -> TokenLabelMap:
        """The identity map (k = 1): every token belongs to its own sample.

        Args:
            labels: ``(b,)`` class ids or ``(b, c)`` probabilities.
            num_classes: ``c``.
            image_size: ``(H, W)`` of the images.
            label_smoothing: in ``[0, 1)``.
            validate: check label values (ids in range, rows on the simplex): one host read.
        """
        if not isinstance(labels, Tensor):
            _fail(f"labels must be a tensor of class ids (batch,) or probabilities (batch, c), got {type(labels).__name__}")
        _check_num_classes(num_classes)
        if labels.ndim == 0:
            _fail("labels must have a batch dimension: (batch,) class ids or (batch, num_classes) probabilities")
        if validate:
            check_labels(labels, num_classes)
        b = labels.shape[0]
        dev = labels.device
        return cls(
            sources=torch.arange(b, device=dev, dtype=torch.long).unsqueeze(1),
            mask=CellMask(torch.ones(b, 1, 1, 1, device=dev)),
            image_weights=torch.ones(b, 1, device=dev),
            labels=labels,
            num_classes=num_classes,
            image_size=image_size,
            label_smoothing=float(label_smoothing),
            validated=validate,  # one source of weight 1 everywhere: only the labels could be wrong
        )

    # ------------------------------------------------------------------ properties
    @property
    def batch_size(self) -> int:
        return int(self.sources.shape[0])

    @property
    def num_sources(self) -> int:
        return int(self.sources.shape[1])

    @property
    def device(self) -> torch.device:
        return self.sources.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TokenLabelMap:
        """The same map on another device (``non_blocking`` as ``Tensor.to``: from pinned memory, asynchronous)."""
        if isinstance(device, torch.dtype) or isinstance(non_blocking, torch.dtype):
            dtype = device if isinstance(device, torch.dtype) else non_blocking
            raise TypeError(
                f"TokenLabelMap.to() takes a device, got the dtype {dtype}: the label weights stay float32 whatever "
                "the images' dtype (autocast and half-precision models included), and class ids stay integers. "
                "Cast the images, and move the map with label_map.to(images.device)"
            )
        return replace(
            self,
            sources=self.sources.to(device, non_blocking=non_blocking),
            mask=self.mask.to(device, non_blocking=non_blocking),  # boxes move as boxes
            image_weights=self.image_weights.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            token_targets=None if self.token_targets is None else self.token_targets.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> TokenLabelMap:
        """The same map in page-locked memory (what a DataLoader with ``pin_memory=True`` calls)."""
        return replace(
            self,
            sources=self.sources.pin_memory(),
            mask=self.mask.pin_memory(),
            image_weights=self.image_weights.pin_memory(),
            labels=self.labels.pin_memory(),
            token_targets=None if self.token_targets is None else self.token_targets.pin_memory(),
        )

    def with_token_targets(self, maps: Tensor | None) -> TokenLabelMap:
        """This map carrying the batch's annotator maps ``(b, h, w, c)`` (``None`` removes them).

        ``maps[i]`` are sample ``i``'s dense class distributions before mixing, aligned to its
        crop and flip (``score_maps.align_score_maps``); the map mixes them like the tokens.

        Example:
            >>> lm = TokenLabelMap.unmixed(torch.tensor([1, 2]), num_classes=10, image_size=(16, 16))
            >>> maps = torch.softmax(torch.randn(2, 4, 4, 10), dim=-1)
            >>> tuple(lm.with_token_targets(maps).mixed_token_targets((4, 4)).shape)
            (2, 16, 10)

        Values (probabilities: finite, non-negative, every cell summing to at most 1 and more than 0) are checked here
        for maps on the CPU; maps on an accelerator are checked by the adapter, at its first call
        (no device sync per step).
        """
        if maps is None:
            return replace(self, token_targets=None)
        checked_here = maps.device.type == "cpu" and not torch.compiler.is_compiling()
        out = replace(self, token_targets=maps, validated=self.validated and checked_here)  # shapes and dtype checked
        if checked_here:
            check_token_targets(maps)
        return out

    def with_progress(self, progress: float | None) -> TokenLabelMap:
        """This map carrying the training progress of its batch in ``[0, 1]`` (``step / total_steps``)."""
        return replace(self, progress=None if progress is None else float(progress))

    def check(self) -> None:
        """Check values (one host sync): labels in range, weights in [0, 1] summing to 1 over k, token targets
        (if any) probabilities."""
        check_labels(self.labels, self.num_classes)
        b = self.batch_size
        if b == 0:
            return
        mask = self.mask.dense()  # built once
        total = reduce(mask, "b k mh mw -> b mh mw", "sum")
        flags = torch.stack(
            [
                ~torch.isfinite(mask).all() | ~torch.isfinite(self.image_weights).all(),
                (mask < 0).any() | (mask > 1).any() | (self.image_weights < 0).any(),
                (total - 1).abs().max() > 1e-5,
                (self.image_weights.sum(1) - 1).abs().max() > 1e-5,
                (self.sources < 0).any() | (self.sources >= b).any(),
            ]
        ).tolist()
        messages = [
            "mask or image_weights contain NaN or inf",
            "mask and image weights must lie in [0, 1]",
            "mask weights must sum to 1 over the sources in every cell",
            "image weights must sum to 1 over the sources",
            f"sources must be batch indices in [0, {b - 1}]",
        ]
        for flag, message in zip(flags, messages):
            if flag:
                _fail(message)
        if self.token_targets is not None:
            check_token_targets(self.token_targets)

    # ------------------------------------------------------------------ weights
    def token_weights(self, grid: tuple[int, int]) -> Tensor:
        """Exact area fraction of every source inside every cell of a token grid.

        Args:
            grid: ``(h, w)`` tokens; ``h`` must divide the image height and ``w`` its width.

        Returns:
            ``(b, h*w, k)`` fp32 weights, row-major over the grid, summing to 1 over ``k``.
        """
        h, w = grid
        hh, ww = self.image_size
        if h < 1 or w < 1 or hh % h or ww % w:
            _fail(
                f"token grid {h}x{w} does not divide the image {hh}x{ww}: each token must cover a whole "
                "number of pixels (resize the image or pick a patch size that divides it)"
            )
        return self.mask.token_weights(grid)

    def pixel_weights(self) -> Tensor:
        """Per-pixel weights ``(b, k, H, W)`` (the mask at image resolution)."""
        return self.mask.pixel_weights(self.image_size)

    def window_weights(self, rows: Tensor, cols: Tensor) -> Tensor:
        """The pixel weights under separable windows: ``(b, h*w, k)`` fp32.

        Token ``(i, j)`` gets ``sum_{y,x} rows[i, y] cols[j, x] w(y, x)``: an overlapping conv stem's
        windows (each axis's 0/1 window matrix, row-normalised, chained) give its tokens' labels
        without a per-pixel label map.

        Args:
            rows: ``(h, H)`` non-negative weights over the image's rows, each row summing to 1.
            cols: ``(w, W)`` the same over its columns.
        """
        hh, ww = self.image_size
        for name, m, size in (("rows", rows, hh), ("cols", cols, ww)):
            if m.dim() != 2 or int(m.shape[1]) != size:
                _fail(f"window_weights: {name} must be (tokens, {size}) over the image's {size} pixels, got {tuple(m.shape)}")
        mh, mw = int(self.mask.shape[2]), int(self.mask.shape[3])
        if hh % mh or ww % mw:
            _fail(f"window_weights needs mask cells ({mh}x{mw}) that tile the image ({hh}x{ww})")
        with fp32_labels(self.device):
            return self.mask.window_weights(rows.to(self.device), cols.to(self.device))

    # ------------------------------------------------------------------ targets
    def source_targets(self) -> Tensor:
        """Class distribution of every source, ``(b, k, c)`` fp32, smoothing applied."""
        per_sample = class_distributions(self.labels, self.num_classes, self.label_smoothing)
        # index_select on the flat sources: the same rows as ``per_sample[self.sources]``, without advanced indexing's
        # host-side parsing of the index (about half of this method's host time)
        return per_sample.index_select(0, self.sources.reshape(-1)).view(*self.sources.shape, per_sample.shape[1])

    def targets(self, weights: Tensor) -> Tensor:
        """Expand source weights ``(b, ..., k)`` into class distributions ``(b, ..., c)``.

        Alignment is linear and keeps convex combinations, so aligning compact
        ``(b, n, k)`` weights and expanding here equals aligning dense labels.
        """
        if weights.shape[0] != self.batch_size or weights.shape[-1] != self.num_sources:
            _fail(
                f"weights must have shape (batch={self.batch_size}, ..., k={self.num_sources}), "
                f"got {tuple(weights.shape)}"
            )
        # sizes as the shape holds them (no int(): a dynamic batch stays symbolic under torch.compile); n, not -1: b may be 0
        b, n, k = weights.shape[0], math.prod(weights.shape[1:-1]), self.num_sources
        with fp32_labels(self.device):
            flat_weights, sources = weights.float().reshape(b, n, k), self.source_targets()
            if rounding_matmuls(self.device):  # exact products, as timm's Mixup mixes: b n 1 * b 1 c, source by source
                flat = _weighted_sum(flat_weights, lambda s: sources[:, s : s + 1])
            else:  # einsum's own route (b, n, k) @ (b, k, c), without its host-side planning
                flat = torch.bmm(flat_weights, sources)
            return flat.reshape(*weights.shape[:-1], self.num_classes)

    def image_targets(self) -> Tensor:
        """The image-level soft targets ``(b, c)``: the CutMix/MixUp target."""
        return self.targets(self.image_weights)

    # ------------------------------------------------------------------ applying
    def mix_pixels(self, images: Tensor) -> Tensor:
        """Mask-weighted sum of the sources' pixels, ``(b, ch, H, W)``, in the images' dtype."""
        if images.ndim != 4 or images.shape[0] != self.batch_size or tuple(images.shape[2:]) != self.image_size:
            _fail(
                f"images must have shape (batch={self.batch_size}, channels, {self.image_size[0]}, "
                f"{self.image_size[1]}), got {tuple(images.shape)}"
            )
        weights = self.pixel_weights().to(images.dtype)

        def term(s: int) -> Tensor:
            # A source with weight 0 contributes nothing, selected: 0 * NaN (or inf) would be NaN.
            w = weights[:, s : s + 1]
            return torch.where(w == 0, torch.zeros((), dtype=images.dtype, device=images.device), images[self.sources[:, s]] * w)

        out = term(0)
        for s in range(1, self.num_sources):
            out = out + term(s)
        return out

    def mixed_token_targets(self, grid: tuple[int, int], *, distributions: bool = False) -> Tensor:
        """The annotator maps mixed like the tokens: ``(b, h*w, c)`` fp32 on the token ``grid``.

        Every token gets ``sum_k w_k * maps[source_k]`` at its cell, ``w`` the exact token
        weights (Token Labeling Eq. 6 for MixToken's binary mask); maps on a finer grid are
        averaged over each token's cells exactly. ``label_smoothing`` ``s`` applies as to soft
        labels: ``(1 - s) y + s / c``.

        ``distributions``: every map cell is first divided by its sum (a cell summing to less than 1, as top-k maps
        stored with ``fill="zeros"`` have, becomes its classes' distribution; an all-zero cell, which
        ``with_token_targets`` refuses, would stay zero), so every
        token's row sums to 1. The alignment trackers start from these: then the label rules' renormalisations change
        nothing but rounding wherever a backbone applies them, and the fast path and the reference agree.
        """
        if self.token_targets is None:
            _fail("this label map carries no token targets; attach the batch's maps with with_token_targets(maps)")
        assert self.token_targets is not None
        (th, tw), (h, w) = (int(self.token_targets.shape[1]), int(self.token_targets.shape[2])), grid
        targets = rearrange(self.token_targets.to(self.device, torch.float32), "b h w c -> b (h w) c")
        if distributions:
            targets = targets / targets.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        if (th, tw) != (h, w):  # a coarser model grid: average the cells exactly
            if th % h or tw % w:
                _fail(f"token targets on a {th}x{tw} grid cannot serve a {h}x{w} token grid: use maps on a multiple of it")
            targets = reduce(targets, "b (h ph w pw) c -> b (h w) c", "mean", h=h, ph=th // h, w=w, pw=tw // w)
        weights = self.token_weights(grid)  # b n k
        with fp32_labels(self.device):
            if rounding_matmuls(self.device):  # exact products (see targets), one source's maps gathered at a time
                mixed = _weighted_sum(weights, lambda s: targets[self.sources[:, s]])
            else:
                mixed = torch.einsum("bknc,bnk->bnc", targets[self.sources], weights)
        s = self.label_smoothing
        return mixed * (1.0 - s) + s / self.num_classes if s else mixed

    def mix_tokens(self, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        """Mix patch embeddings ``(b, n, d)`` with this map's token weights (MixToken).

        Returns the weighted sum over sources of each source's token at the same
        position, in the tokens' dtype; gradients flow to every source.
        """
        n = grid[0] * grid[1]
        if tokens.ndim != 3 or tokens.shape[0] != self.batch_size or tokens.shape[1] != n:
            _fail(f"tokens must have shape (batch={self.batch_size}, n={n}, dim), got {tuple(tokens.shape)}")
        weights = rearrange(self.token_weights(grid).to(tokens.dtype), "b n k -> b k n 1")
        gathered = tokens[self.sources]  # b k n d
        # A source with weight 0 contributes nothing, selected: 0 * a NaN or inf token would be NaN.
        terms = torch.where(weights == 0, torch.zeros((), dtype=tokens.dtype, device=tokens.device), gathered * weights)
        return reduce(terms, "b k n d -> b n d", "sum")

    def dense_pixel_targets(self) -> Tensor:
        """Per-pixel class distributions ``(b, c, H, W)``; for pictures and tests, not hot paths."""
        return rearrange(self.targets(rearrange(self.pixel_weights(), "b k h w -> b h w k")), "b h w c -> b c h w")

    # timm's losses read a target tensor: SoftTargetCrossEntropy starts with -target, BinaryCrossEntropy with
    # target.shape. A label map reaches them through a timm task that does not know label maps (train.py's
    # --kd-model-name builds LogitDistillationTask), and Python's own errors ("bad operand type for unary -",
    # "no attribute 'shape'") name neither the cause nor the fix.
    def __neg__(self) -> NoReturn:
        raise TypeError(_NOT_A_TARGET_TENSOR)

    @property
    def shape(self) -> NoReturn:
        """Not a tensor: raises ``AttributeError`` saying which task takes label maps (``hasattr`` stays False)."""
        raise AttributeError("TokenLabelMap has no shape: " + _NOT_A_TARGET_TENSOR)
