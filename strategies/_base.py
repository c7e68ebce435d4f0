"""The mixer base: typed params, the pure pixel mix, and the kornia mix-augmentation module.

Every mixer is a ``kornia.augmentation.MixAugmentationBaseV2``: it samples
frozen params (``sample``), then applies them purely (``mix``), and is called as
``mixed, label_map = mixer(images, labels)``. Inside a kornia
``AugmentationSequential`` it mixes the images only (kornia refuses class labels
for mix augmentations) and ``sequential_label_map`` recovers the map afterwards.

Shapes: ``b`` batch, ``c`` channels, ``H W`` image, ``mh mw`` mask cells.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Sequence, TypeVar, Union, overload

import torch
from einops import rearrange
from kornia.augmentation import MixAugmentationBaseV2
from kornia.constants import DataKey
from torch import Tensor

from mixlabels import CellMask, TokenLabelMap, check_labels
from mixlabels._mask import BoxMask, Mask
from mixlabels._shape_cache import shape_cache
from mixlabels.strategies._host_draws import to_fp32
from mixlabels.strategies._sampling import MixSampler
from mixlabels.strategies._transfer import to_device

__all__ = ["MixParams", "Mixer", "PairMixer", "mix_images", "blend_images", "select_images", "paste_box", "pair_label_map", "host_params"]

P = TypeVar("P")
PP = TypeVar("PP", bound="MixParams")
D = TypeVar("D", bound="MixParams")

# Key under which the typed params travel in kornia's per-module params dict
# (``AugmentationSequential`` records one dict per module and hands it back on replay).
PARAMS_KEY = "mix_params"

DataKeys = Sequence[Union[str, int, DataKey]]


@dataclass(frozen=True, eq=False, kw_only=True)
class MixParams:
    """The random draws of one pairwise mix, frozen; subclasses add the kind's draws.

    Attributes:
        partner: ``(b,)`` long, batch index of source 1 (the sample mixed in).
        applied: ``(b,)`` bool, the sample is mixed; unmixed samples have weight 1 for source 0.
        image_size: ``(H, W)`` the params were drawn for.
        token_space: the mix applies to patch embeddings, not pixels (MixToken).
        any_unmixed: whether some sample keeps weight 1 everywhere, when the sampler knew it
            on the host (Python draws); ``None``: unknown (read from the tensors on the CPU).
        label_sources: ``(b, 2)`` long ``[i, partner[i]]``, the label map's sources, when the
            sampler computed them with its draws (Python draws); ``None``: computed from ``partner``.
        label_weights: ``(b, 2)`` fp32 ``[lam, 1 - lam]``, the label map's image weights (lam: the
            mask mean, or ``image_weight`` where ``lambda_is_mask_mean`` is false), likewise.
        label_cells: ``(b, 2, mh, mw)`` fp32 cells of the map's ``CellMask`` ``[w0, 1 - w0]``,
            likewise (box params need none: their boxes are the mask).
    """

    partner: Tensor
    applied: Tensor
    image_size: tuple[int, int]
    token_space: bool = False
    any_unmixed: bool | None = None
    # The label map's values, computed by a Python-drawing sampler from the same numbers (the
    # arithmetic the CPU path does, to the bit) and sent in the params' one buffer: the device
    # then only takes views of it, instead of ~15 small kernels per call.
    label_sources: Tensor | None = None
    label_weights: Tensor | None = None
    label_cells: Tensor | None = None
    # The draws the derived values above were computed from (the very objects), recorded when the params are made:
    # ``dataclasses.replace`` copies the derived values, so a replaced draw would leave them stale (labels that no
    # longer match the pixels, silently); ``current()`` drops them then.
    drawn_from: tuple[object, ...] | None = dataclasses.field(default=None, repr=False)

    DERIVED: ClassVar[tuple[str, ...]] = ("any_unmixed", "label_sources", "label_weights", "label_cells")
    """Fields computed from the draws (a subclass adds its own), valid only with the draws they came from."""

    def __post_init__(self) -> None:
        if self.drawn_from is None and any(getattr(self, n) is not None for n in self.DERIVED):
            object.__setattr__(self, "drawn_from", self._draws())

    def _draws(self) -> tuple[object, ...]:
        return tuple(getattr(self, n) for n in _draw_names(self))

    def current(self: D) -> D:
        """These params, or, where a draw was replaced since the derived values were computed
        (``dataclasses.replace(params, lam=...)``), the same params without them (recomputed from the draws)."""
        if self.drawn_from is None or getattr(self, "_current", False):
            return self
        now = self._draws()
        if len(now) == len(self.drawn_from) and all(a is b for a, b in zip(now, self.drawn_from)):
            if not torch.compiler.is_compiling():  # frozen: no draw of these params can change, so once is enough
                object.__setattr__(self, "_current", True)
            return self
        cleared: dict[str, Any] = {n: None for n in self.DERIVED}
        return dataclasses.replace(self, **cleared, drawn_from=None)

    @property
    def batch_size(self) -> int:
        return int(self.partner.shape[0])

    def source_weight(self) -> Tensor:
        """Weight of source 0 (the sample itself) in every mask cell, ``(b, mh, mw)`` fp32."""
        raise NotImplementedError

    def shared_weight(self) -> float | None:
        """One weight of source 0 that every sample and cell shares, when it is known on the host for free (else
        ``None``): the pixels are then ``lam * x + (1 - lam) * x[partner]`` with two Python scalars."""
        return None

    def shared_box(self) -> tuple[int, int, int, int] | None:
        """One pixel box ``(y0, y1, x0, x1)`` that every sample takes from its partner, if there is one.

        Samples whose partner is themselves may be included: pasting from oneself changes nothing.
        """
        return None

    def cell_boxes(self) -> tuple[Tensor, tuple[int, int]] | None:
        """``(boxes, grid)`` when the mask is one box per sample filled from the partner; else ``None``.

        ``boxes`` is ``(b, 4)`` long ``(y0, y1, x0, x1)`` in cells of ``grid``, half-open. The
        label map then keeps the boxes instead of a cell mask (``TokenLabelMap.from_boxes``).
        """
        return None

    def keep_cells(self) -> Tensor | None:
        """``(b, mh, mw)`` bool, True where a cell is the sample's own, when the mask is binary; else ``None``.

        Binary masks (boxes, cells) mix pixels by selection, which is exact and cheaper.
        """
        return None

    @property
    def lambda_is_mask_mean(self) -> bool:
        """``image_weight()`` is the mean of ``source_weight()`` (false for timm's uncorrected CutMix lambda)."""
        return True

    def image_weight(self) -> Tensor:
        """Lambda (timm convention: weight of source 0) of every sample, ``(b,)`` fp32: the mask mean."""
        return self.source_weight().mean(dim=(1, 2))

    def to(self: D, device: torch.device | str) -> D:
        """The same params with every tensor on ``device`` (from the host to CUDA: in one asynchronous copy)."""
        params, dev = self.current(), torch.device(device)
        names = [n for n in _field_names(params) if isinstance(getattr(params, n), Tensor)]
        if all(getattr(params, n).device == dev for n in names):
            return params  # nothing moves: a mixer's call on the CPU builds no second params object
        moved: dict[str, Any] = dict(zip(names, to_device([getattr(params, n) for n in names], device)))
        return dataclasses.replace(params, **moved, drawn_from=None)  # the moved draws and their derived values


def _names(params: MixParams) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The dataclass fields of ``params`` and those of them that are draws (not derived from them, ``DERIVED``, nor
    their record), read once per class: ``dataclasses.fields`` walks them per call, and a mixer's call asks for both
    several times. While dynamo traces, read from the instance (it traces ``fields`` of an instance only)."""
    kind = type(params)
    names = None if torch.compiler.is_compiling() else _NAMES.get(kind)
    if names is None:
        fields = tuple(f.name for f in dataclasses.fields(params))
        names = (fields, tuple(n for n in fields if n not in (*params.DERIVED, "drawn_from")))
        if not torch.compiler.is_compiling():
            _NAMES[kind] = names
    return names


def _field_names(params: MixParams) -> tuple[str, ...]:
    """The dataclass fields of ``params`` (``_names``)."""
    return _names(params)[0]


def _draw_names(params: MixParams) -> tuple[str, ...]:
    """The fields of ``params`` that are draws (``_names``)."""
    return _names(params)[1]


_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def host_params(params: MixParams) -> bool:
    """The params live on the host (their values can be read for free) and no tracing is under way."""
    return params.partner.device.type == "cpu" and not torch.compiler.is_compiling()


def mix_images(images: Tensor, partner: Tensor, weight: Tensor, *, unmixed: bool | None = None) -> Tensor:
    """Mix every image with its partner cell by cell: ``w * x + (1 - w) * x[partner]``.

    Where ``w`` is exactly 1 the image's own pixels are selected (an unmixed sample comes
    back bit-identical even if its partner holds NaN or inf); in cell masks, where ``w`` is
    exactly 0 the partner's pixels are. Pure (never in place). Half-precision images are mixed in fp32 and rounded once,
    so pixels follow the fp32 weights the labels use.

    Args:
        images: ``(b, c, H, W)`` floating point.
        partner: ``(b,)`` long batch indices.
        weight: ``(b, mh, mw)`` fp32 weight of the image itself; ``mh | H``, ``mw | W``.
        unmixed: whether a weight is exactly 1, when the caller knows it on the host: ``False``
            skips selecting the image's own pixels there (a pass over the batch). ``None``: unknown.

    Returns:
        ``(b, c, H, W)`` in the images' dtype.

    Example:
        >>> x = torch.arange(8.0).view(2, 1, 2, 2)
        >>> mix_images(x, torch.tensor([1, 0]), torch.tensor([[[1.0, 0.0]], [[0.5, 0.5]]]))[0, 0].tolist()
        [[0.0, 5.0], [2.0, 7.0]]
    """
    check_images(images)
    b, _, hh, ww = images.shape
    if partner.shape != (b,) or weight.ndim != 3 or weight.shape[0] != b or hh % weight.shape[1] or ww % weight.shape[2]:
        raise ValueError(
            f"mix_images takes images (b, c, H, W), partner (b,) and weight (b, mh, mw) with mh dividing H and mw "
            f"dividing W; got images {tuple(images.shape)}, partner {tuple(partner.shape)}, weight {tuple(weight.shape)}"
        )
    compute = _mix_dtype(images)
    w0 = weight.to(device=images.device, dtype=torch.float32)
    # Where a weight is exactly 1 (0) the pixel is the image's own (the partner's), selected, not
    # computed: ``1 * x + 0 * y`` is NaN when y holds NaN or inf, and an unmixed sample must come
    # back bit-identical whatever its partner holds.
    w1 = torch.rsub(w0, 1.0).to(compute)  # 1 - w0 in fp32 first, as TokenLabelMap does, so both paths agree bit for bit
    w0 = w0.to(compute)
    mh, mw = int(weight.shape[1]), int(weight.shape[2])
    # Gather the partners on the contiguous 4-d batch: gathering a 6-d cell view is ~10x slower on CPU.
    own = images.to(compute)
    other = gather_partners(own, partner)
    if mh == mw == 1:  # one weight per image (MixUp): plain broadcasting, no cell view
        # Same roundings as timm (x * lam + x[partner] * (1 - lam)); ``_blend`` scales ``other`` in place: ours.
        if other is images:
            other = other.clone()
        # b 1 1 1 weights (views, not einops patterns: this path is all host time on a GPU)
        out = _blend(own, other, w0.view(-1, 1, 1, 1), w1.view(-1, 1, 1, 1))
        # Unmixed samples (lam = 1) are their own pixels, selected (no host sync: no branch on values).
        # A sample with lam = 0 is a full mix: 0 * its own NaN stays NaN, as in timm.
        if unmixed is False:
            return out.to(images.dtype)
        select = images.device.type != "cpu" or torch.compiler.is_compiling()
        return keep_unmixed(out, own, (w0 == 1.0).view(-1), select).to(images.dtype)
    own_only, other_only = w0 == 1.0, w0 == 0.0  # (b, mh, mw) bool
    cells = "b c (mh ph) (mw pw) -> b c mh ph mw pw"
    own6 = rearrange(own, cells, mh=mh, mw=mw)
    other6 = rearrange(other, cells, mh=mh, mw=mw)
    out = own6 * rearrange(w0, "b mh mw -> b 1 mh 1 mw 1") + other6 * rearrange(w1, "b mh mw -> b 1 mh 1 mw 1")
    out = torch.where(rearrange(own_only, "b mh mw -> b 1 mh 1 mw 1"), own6, out)
    out = torch.where(rearrange(other_only, "b mh mw -> b 1 mh 1 mw 1"), other6, out)
    return rearrange(out, "b c mh ph mw pw -> b c (mh ph) (mw pw)").to(images.dtype)


def blend_images(images: Tensor, partner: Tensor, lam: float) -> Tensor:
    """``mix_images`` for one weight shared by every sample and cell, a Python number: ``lam * x + (1 - lam) *
    x[partner]``.

    The same pixels, bit for bit, as ``mix_images`` with that weight in every sample (an fp32 scalar multiplies as
    the fp32 weight tensor does, and ``1 - lam`` is rounded to fp32 once, as there), in four operators and no weight
    tensor: timm's batch-mode MixUp blends so. ``lam == 1`` (nothing mixed) returns a copy of the images, bit for bit.

    Args:
        images: ``(b, c, H, W)`` floating point.
        partner: ``(b,)`` long batch indices.
        lam: the weight of the image itself, an fp32 value in ``[0, 1]``.

    Example:
        >>> x = torch.arange(4.0).view(2, 1, 1, 2)
        >>> blend_images(x, torch.tensor([1, 0]), 0.75)[0, 0].tolist()
        [[0.5, 1.5]]
    """
    check_images(images)
    if partner.shape != images.shape[:1]:
        raise ValueError(f"blend_images takes images (b, c, H, W) and partner (b,); got {tuple(images.shape)} and {tuple(partner.shape)}")
    if lam == 1.0:  # selected, not computed: 1 * x + 0 * y is NaN where the partner holds NaN or inf
        return images.clone()
    own = images.to(_mix_dtype(images))
    return _blend(own, gather_partners(own, partner), lam, to_fp32(1.0 - lam)).to(images.dtype)


def _mix_dtype(images: Tensor) -> torch.dtype:
    """The dtype pixels are mixed in: fp32 for half-precision images (rounded once at the end), else their own."""
    return torch.float32 if images.dtype in (torch.float16, torch.bfloat16) else images.dtype


def _blend(own: Tensor, other: Tensor, w0: Tensor | float, w1: Tensor | float) -> Tensor:
    """``own * w0 + other * w1`` with timm's roundings (each product rounded, then their sum), the weights per sample
    or one number for all: ``other`` (a fresh gather, the caller's to give) is scaled in place, so the products take
    one new batch, not two (fresh CPU allocations cost page faults)."""
    out = own * w0
    return out.add_(other.mul_(w1))


def keep_unmixed(out: Tensor, own: Tensor, unmixed: Tensor, select: bool) -> Tensor:
    """``out`` with the rows where ``unmixed`` (``(b,)`` bool) replaced by ``own``'s, bit for bit.

    ``select=False`` (the CPU, where reading ``unmixed`` is free) copies those rows back into
    ``out`` in place: a full-batch select costs a whole extra pass, about a third of MixUp at
    32x3x224x224. ``select=True`` (accelerators, compiling) selects, so no step waits for the device.
    """
    if select:
        return torch.where(unmixed.view(-1, *([1] * (out.ndim - 1))), own, out)
    rows = unmixed.nonzero().view(-1)
    if rows.numel():
        out.index_copy_(0, rows, own.index_select(0, rows))
    return out


def gather_partners(images: Tensor, partner: Tensor) -> Tensor:
    """``images[partner]`` as a fresh tensor in the images' memory format (channels-last stays so).

    Advanced indexing, not ``index_select``: it keeps channels-last strides, and ``index_select``
    over a large batch was up to 10x slower on 2 contended CPU threads (2.3 s vs 0.14 s at 128x3x224x224).
    On the CPU the fixed pairings are read off the partners (free there) and gathered as the copies they
    are, the same pixels: ``flip`` (timm's) as ``images.flip(0)``, ``roll`` (torchvision's) as ``images.roll(1, 0)``;
    a 64x3x224x224 batch on 2 cores, kept heap: 1.6 ms against the indexing's 8.8.
    """
    partner = partner.to(images.device)
    b = int(images.shape[0])
    if images.device.type == "cpu" and not torch.compiler.is_compiling() and b > 1 and partner.shape == (b,) and partner.dtype == torch.long:
        flip, roll = _fixed_pairings(b)
        if torch.equal(partner, flip):
            return images.flip(0)
        if torch.equal(partner, roll):
            return images.roll(1, 0)
    return images[partner]


@shape_cache(maxsize=16)
def _fixed_pairings(b: int) -> tuple[Tensor, Tensor]:
    """The partners of the fixed pairings of a CPU batch of ``b``: ``flip`` (``b - 1 - i``) and ``roll`` (``i - 1``)."""
    flip = torch.arange(b - 1, -1, -1)
    return flip, flip.flip(0).roll(1)


def select_images(images: Tensor, partner: Tensor, keep: Tensor) -> Tensor:
    """``mix_images`` for a binary mask: each cell is the image's own or its partner's, copied exactly.

    Equal to ``mix_images(images, partner, keep.float())`` for finite pixels, without
    the arithmetic: one gather and one select, in the images' own dtype.

    Args:
        images: ``(b, c, H, W)`` floating point.
        partner: ``(b,)`` long batch indices.
        keep: ``(b, mh, mw)`` bool, True where the cell keeps the image's own pixels.

    Example:
        >>> x = torch.arange(8.0).view(2, 1, 2, 2)
        >>> select_images(x, torch.tensor([1, 0]), torch.tensor([[[True, False]], [[False, True]]]))[0, 0].tolist()
        [[0.0, 5.0], [2.0, 7.0]]
    """
    mh, mw = int(keep.shape[1]), int(keep.shape[2])
    other = gather_partners(images, partner)
    keep = keep.to(images.device)
    # The gathered partners are ours: the select writes into them (no second full-size allocation),
    # unless autograd must see the select (out= is not differentiable).
    in_place = not (torch.is_grad_enabled() and images.requires_grad) and not torch.compiler.is_compiling()
    if (mh, mw) == tuple(images.shape[2:]):  # per-pixel mask: broadcasting over channels only is much faster
        keep4 = rearrange(keep, "b h w -> b 1 h w")
        return torch.where(keep4, images, other, out=other) if in_place else torch.where(keep4, images, other)
    cells = "b c (mh ph) (mw pw) -> b c mh ph mw pw"
    keep6 = rearrange(keep, "b mh mw -> b 1 mh 1 mw 1")
    own6, other6 = rearrange(images, cells, mh=mh, mw=mw), rearrange(other, cells, mh=mh, mw=mw)
    if in_place:
        torch.where(keep6, own6, other6, out=other6)
        return other
    return rearrange(torch.where(keep6, own6, other6), "b c mh ph mw pw -> b c (mh ph) (mw pw)")


def paste_box(images: Tensor, partner: Tensor, box: tuple[int, int, int, int]) -> Tensor:
    """``select_images`` for one box shared by the whole batch (CutMix in batch mode), by slicing.

    Copies the batch and copies only the box from the partners, as timm's in-place
    CutMix does, but without touching the input.

    Args:
        images: ``(b, c, H, W)``.
        partner: ``(b,)`` long batch indices.
        box: ``(y0, y1, x0, x1)`` in pixels, half-open.

    Example:
        >>> x = torch.arange(8.0).view(2, 1, 2, 2)
        >>> paste_box(x, torch.tensor([1, 0]), (0, 2, 1, 2))[0, 0].tolist()
        [[0.0, 5.0], [2.0, 7.0]]
    """
    y0, y1, x0, x1 = box
    out = images.clone()
    if y1 <= y0 or x1 <= x0:
        return out
    src, dst = images[:, :, y0:y1, x0:x1], out[:, :, y0:y1, x0:x1]  # b c bh bw views
    if images.device.type == "cpu" and not (torch.is_grad_enabled() and images.requires_grad):
        # One strided copy per sample, straight from its partner: a batched gather would first
        # write every box to a temporary and then copy it again (up to ~1.8x slower for the large
        # boxes CutMix draws). Not on accelerators (b launches) nor under autograd (b graph nodes).
        for i, j in enumerate(partner.tolist()):
            if i != j:  # a sample paired with itself keeps its pixels
                dst[i].copy_(src[j])
        return out
    dst.copy_(src.index_select(0, partner.to(images.device)))
    return out


def pair_label_map(
    params: MixParams,
    labels: Tensor,
    num_classes: int,
    label_smoothing: float,
) -> TokenLabelMap:
    """The ``k = 2`` label map of pairwise params, on the labels' device (no host sync).

    The map's small tensors (sources, image weights, the mask's boxes or cells) are the ones
    a Python-drawing sampler computed with its draws (views of the params' buffer: no kernel);
    otherwise they are computed where the params were drawn and reach the labels' device in
    one copy. Either way: the same bits on every device.

    Args:
        params: sampled params; ``source_weight`` gives the mask, ``image_weight`` lambda.
        labels: ``(b,)`` ids or ``(b, c)`` probabilities of the un-mixed batch.
        num_classes: ``c``.
        label_smoothing: in ``[0, 1)``.

    Returns:
        A map whose mask is the params' cell mask (kept as boxes for box params) and whose
        image weights are ``[lam, 1 - lam]``.
    """
    params = params.current()
    if params.label_sources is not None and params.label_weights is not None:
        drawn = params.cell_boxes()
        mask_values = drawn[0] if drawn is not None else params.label_cells
        if mask_values is not None:
            sources, weights, mask_values = to_device([params.label_sources, params.label_weights, mask_values], labels.device)
            mask: Mask = BoxMask(mask_values, drawn[1]) if drawn is not None else CellMask(mask_values)
            return TokenLabelMap(
                sources=sources, mask=mask, image_weights=weights, labels=labels, num_classes=num_classes,
                image_size=params.image_size, label_smoothing=label_smoothing, token_space=params.token_space,
                validated=True,  # the sampler's own values, as below
            )  # fmt: skip
    p = params if host_params(params) else params.to(labels.device)
    own = torch.arange(p.batch_size, device=p.partner.device)
    sources = torch.stack([own, p.partner.long()], dim=1)
    boxes = p.cell_boxes()
    if boxes is not None:
        # Four numbers a sample instead of a (b, 2, H, W) fp32 mask that the image targets never
        # read: building it cost as much as the pixels (24 of 55 ms at 64x3x224x224, issue 7).
        cells, grid = boxes
        box_mask = BoxMask(cells, (int(grid[0]), int(grid[1])))
        lam = box_mask.source_mean() if p.lambda_is_mask_mean else p.image_weight().float()
        sources, weights, cells = to_device([sources, torch.stack([lam, 1.0 - lam], dim=1), cells], labels.device)
        mask = BoxMask(cells, box_mask.grid)
    else:
        w0 = p.source_weight().float()
        lam = w0.mean(dim=(1, 2)) if p.lambda_is_mask_mean else p.image_weight().float()  # the mask once, not twice
        dense = torch.empty((p.batch_size, 2, *w0.shape[1:]), dtype=torch.float32, device=w0.device)
        dense[:, 0] = w0
        dense[:, 1].fill_(1.0).sub_(w0)  # written in place: no stacked copy of a per-pixel mask
        sources, weights, dense = to_device([sources, torch.stack([lam, 1.0 - lam], dim=1), dense], labels.device)
        mask = CellMask(dense)
    return TokenLabelMap(
        sources=sources,
        mask=mask,
        image_weights=weights,
        labels=labels,
        num_classes=num_classes,
        image_size=p.image_size,
        label_smoothing=label_smoothing,
        token_space=p.token_space,
        validated=True,  # a sampler's boxes, lambdas and weights in [0, 1]; [w0, 1 - w0] sums to 1
    )


def check_worker_generator(mixer: object, generator: torch.Generator | None) -> None:
    """Refuse a seeded generator inside a DataLoader worker: every worker holds a copy of the same state.

    Each worker process receives a pickled copy of the mixer, so a generator seeded once in the
    main process would make every worker draw the same params, batch after batch.
    """
    info = torch.utils.data.get_worker_info()
    if generator is not None and info is not None:
        raise RuntimeError(
            f"{type(mixer).__name__} was called with a seeded torch.Generator inside DataLoader worker {info.id} of "
            f"{info.num_workers}: every worker holds a copy of the same generator state and would draw the same "
            "params. Mix in the workers with mixlabels.strategies.CollateMixer(mixer, seed=...) (one generator per "
            "worker, derived from the seed and the worker), or construct the mixer with generator=None"
        )


def check_generator(generator: object, where: str) -> None:
    """Raise a clear error unless ``generator`` is ``None`` or a ``torch.Generator``."""
    if generator is None or isinstance(generator, torch.Generator):
        return
    if isinstance(generator, int):
        raise TypeError(
            f"{where}: generator must be a torch.Generator, got the int {generator}; for a seed pass "
            f"torch.Generator().manual_seed({generator}) (once, at construction: a seed given again at "
            "every call would draw the same params at every step)"
        )
    raise TypeError(f"{where}: generator must be a torch.Generator or None, got {type(generator).__name__}")


def check_num_classes(num_classes: object) -> int:
    """``num_classes`` as an int, or a clear error (floats and bools are refused, not truncated)."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes!r}; pass the number of classes as an integer")
    return int(num_classes)


def check_images(images: Tensor) -> None:
    """Raise a clear error unless ``images`` is a floating ``(b, c, H, W)`` batch with data."""
    if not isinstance(images, Tensor) or images.ndim != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(
            f"images must be a (batch, channels, height, width) tensor, got {shape}; "
            "add a batch dimension with images.unsqueeze(0)"
        )
    if not images.is_floating_point():
        raise ValueError(
            f"images must be floating point (float16, bfloat16, float32 or float64), got {images.dtype}; "
            "convert them first, e.g. images.float() / 255"
        )
    if images.is_meta:
        raise ValueError(
            "images are on the meta device (a shape without data), so there is nothing to mix; "
            "pass the real batch, on the cpu or an accelerator"
        )


class Mixer(MixAugmentationBaseV2, Generic[P]):
    """Base of every mixer: a kornia mix augmentation with typed, replayable params.

    Subclasses implement ``sample``, ``apply_images``, ``label_map_from`` and ``params_batch_size``;
    ``mix`` applies params purely.

    Args:
        num_classes: ``c``, for the label map and label checks.
        label_smoothing: applied when the map expands targets, in ``[0, 1)``.
        generator: default source of randomness (also used inside ``AugmentationSequential``);
            a ``generator`` given to a call takes precedence. ``None`` uses torch's global RNG.
            A ``torch.Generator``, as torch's own samplers take: an int seed is refused (pass
            ``torch.Generator().manual_seed(seed)`` once; a seed per call would repeat the params).

    Attributes:
        check_values: label values (ids in range, soft rows on the simplex) cost a host read.
            ``None`` (default): checked at every call for labels on the CPU and at the first
            call for labels on an accelerator (no device sync per step); ``True``: every call;
            ``False``: never. Shapes and dtypes are always checked; ``mix`` checks shapes only.
    """

    def __init__(self, num_classes: int, label_smoothing: float = 0.0, generator: torch.Generator | None = None) -> None:
        super().__init__(p=1.0, p_batch=1.0, same_on_batch=False, keepdim=False, data_keys=["input", "class"])
        self.num_classes = check_num_classes(num_classes)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing}")
        check_generator(generator, type(self).__name__)
        self.label_smoothing = float(label_smoothing)
        self.generator = generator
        self.last_params: P | None = None
        # timm's switch (``mixup_fn.mixup_enabled = False`` at ``--mixup-off-epoch``): when off, a call
        # returns the images as they are and the identity map (label smoothing kept, as timm keeps it).
        self.mixup_enabled = True
        self._unmixed_size: tuple[int, int] | None = None  # image size of the last call made while off
        # Label values (ids in range, rows on the simplex) cost a host read. ``None`` (default):
        # checked at every call for labels on the CPU (no device sync) and at the first call for
        # labels on an accelerator; ``True``: at every call; ``False``: never (shapes always are).
        self.check_values: bool | None = None
        self._values_checked = False

    # ---------------------------------------------------------------- to implement
    def sample(
        self,
        batch_shape: Sequence[int],
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> P:
        """Draw params for a batch of shape ``(b, c, H, W)`` (on the generator's device if given)."""
        raise NotImplementedError

    def apply_images(self, images: Tensor, params: P) -> Tensor:
        """Mix ``(b, c, H, W)`` images with ``params``; pure."""
        raise NotImplementedError

    def draw_device(self, images_device: torch.device, generator: torch.Generator | None = None) -> torch.device | None:
        """Where a call's params are drawn: the images' device, unless the kind draws on the host.

        ``None``: on ``generator``'s device (a kind drawing tensors with a given generator).
        """
        return None if generator is not None else images_device

    def label_map_from(self, params: P, labels: Tensor) -> TokenLabelMap:
        """The label map of ``params`` for ``labels``; pure, no host sync."""
        raise NotImplementedError

    def params_batch_size(self, params: P) -> tuple[int, tuple[int, int]]:
        """Batch size and image size the params were drawn for."""
        raise NotImplementedError

    def check_params(self, params: object) -> None:
        """Raise a clear error unless ``params`` are of the kind this mixer draws."""
        raise NotImplementedError

    def _check_batch(self, images: Tensor, params: P) -> None:
        """The one check of params against images, shared by ``forward`` and ``mix``."""
        self.check_params(params)
        b, size = self.params_batch_size(params)
        if b != images.shape[0] or size != tuple(images.shape[2:]):
            raise ValueError(
                f"params were drawn for {b} images of size {tuple(size)} but got {images.shape[0]} images "
                f"of size {tuple(images.shape[2:])}; sample new params for this batch "
                f"(mixer.sample(images.shape)) or replay them on the batch they were drawn for"
            )

    def place(self, params: P, images: Tensor) -> P:
        """The params completed from the pixels they will mix; unchanged by default.

        A mixer whose draws depend on the images (SaliencyMix centres its box on the
        partner's saliency peak) completes them here, as pure tensor ops; already
        completed params come back unchanged, so replaying them never looks at the pixels.
        """
        return params

    # ---------------------------------------------------------------- shared
    def mix(self, images: Tensor, labels: Tensor, params: P) -> tuple[Tensor, TokenLabelMap]:
        """Apply ``params``: mix ``images`` and build the label map; pure, replayable, compilable.

        (Not named ``apply``: ``nn.Module.apply(fn)`` recurses into children and must keep working.)
        Checks shapes (images, params against images, labels against the batch), not label
        values: no host sync.
        """
        check_images(images)
        self._check_batch(images, params)
        self._check_label_shape(labels, images.shape[0])
        params = self.place(params, images)
        return self.apply_images(images, params), self.label_map_from(params, labels.to(images.device))

    def forward_parameters(self, batch_shape: tuple[int, ...]) -> dict[str, Any]:
        """Kornia hook (``AugmentationSequential``): sample with ``self.generator``, wrapped for kornia.

        With ``mixup_enabled`` off the recorded params are ``None``: the replay leaves the images
        alone and ``sequential_label_map`` gives the identity map.
        """
        params = self.sample(tuple(batch_shape), generator=self.generator) if self.mixup_enabled else None
        return self._kornia_params(params, int(batch_shape[0]), tuple(batch_shape))

    def unmixed_map(self, labels: Tensor, image_size: tuple[int, int]) -> TokenLabelMap:
        """The identity map of ``labels`` (what a call returns while ``mixup_enabled`` is off)."""
        return TokenLabelMap.unmixed(labels, self.num_classes, image_size, self.label_smoothing)

    def _kornia_params(self, params: P | None, b: int, shape: Sequence[int]) -> dict[str, Any]:
        key = (b, tuple(int(s) for s in shape))
        cached = self.__dict__.get("_kornia_record")
        if cached is None or cached[0] != key or torch.compiler.is_compiling():
            # kornia reads both, never writes them: built from bytes (no host operator), and kept for the next call of
            # this batch shape (a call's record is then a dict, not two new tensors)
            prob = torch.frombuffer(bytearray(b"\x01") * b, dtype=torch.bool) if b else torch.ones(0, dtype=torch.bool)
            cached = (key, prob, torch.tensor(key[1], dtype=torch.long))
            if not torch.compiler.is_compiling():
                self.__dict__["_kornia_record"] = cached
        return {"batch_prob": cached[1], "forward_input_shape": cached[2], PARAMS_KEY: params}

    def _record(self, last: P | None, unmixed_size: tuple[int, int] | None, record: dict[str, Any]) -> None:
        """A call's state: its params (``last_params``), the image size of a call made while mixing is off, kornia's
        record (``_params``). Written as plain attributes in eager mode: ``nn.Module.__setattr__`` looks every value up
        among the parameters, buffers and submodules first (three writes, about 5 us each, on every call)."""
        if torch.compiler.is_compiling():
            self.last_params, self._unmixed_size, self._params = last, unmixed_size, record
            return
        state = self.__dict__
        state["last_params"], state["_unmixed_size"], state["_params"] = last, unmixed_size, record

    def _unwrap(self, params: P | dict[str, Any]) -> P | None:
        """Typed params, or ``None`` for kornia params recorded while ``mixup_enabled`` was off."""
        if isinstance(params, dict):
            if PARAMS_KEY not in params:
                raise ValueError(
                    f"kornia params for {type(self).__name__} must hold the sampled params under {PARAMS_KEY!r}; "
                    "pass the params this mixer (or its AugmentationSequential) recorded"
                )
            inner: P | None = params[PARAMS_KEY]
            return inner
        return params

    def label_map(self, labels: Tensor, params: P | dict[str, Any] | None = None) -> TokenLabelMap:
        """The label map of the last call (or of ``params``) for ``labels``, after checking them.

        Use it after ``AugmentationSequential`` has mixed the images, or see
        ``sequential_label_map``.
        """
        if params is None:
            if self.last_params is None and self._unmixed_size is not None:  # the last call ran with mixing off
                self._check_labels(labels, labels.shape[0] if isinstance(labels, Tensor) and labels.ndim else -1)
                return self.unmixed_map(labels, self._unmixed_size)
            if self.last_params is None:
                raise ValueError(f"{type(self).__name__} has not mixed a batch yet: call it first or pass params")
            typed = self.last_params
        else:
            unwrapped = self._unwrap(params)
            if unwrapped is None:  # recorded by kornia while mixup_enabled was off
                assert isinstance(params, dict)
                shape = tuple(int(s) for s in params["forward_input_shape"].tolist())
                self._check_labels(labels, shape[0])
                return self.unmixed_map(labels, (shape[-2], shape[-1]))
            typed = unwrapped
        self.check_params(typed)
        b, _ = self.params_batch_size(typed)
        self._check_labels(labels, b)
        return self.label_map_from(typed, labels)

    def _check_label_shape(self, labels: Tensor, batch: int) -> None:
        if not isinstance(labels, Tensor):
            raise ValueError(f"labels must be a tensor of class ids (batch,) or probabilities (batch, c), got {type(labels).__name__}")
        if labels.ndim == 0 or labels.shape[0] != batch:
            raise ValueError(
                f"labels have batch size {labels.shape[0] if labels.ndim else 'none (a scalar)'} but the images "
                f"have {batch}; pass one label per image"
            )
        if labels.is_floating_point():
            if labels.ndim != 2 or labels.shape[1] != self.num_classes:
                raise ValueError(
                    f"soft labels must have shape (batch, num_classes={self.num_classes}), got {tuple(labels.shape)}; "
                    f"pass integer class ids of shape (batch,) or probabilities of shape (batch, {self.num_classes})"
                )
        elif labels.ndim == 2 and labels.dtype not in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(
                f"integer labels must have shape (batch,) (class ids), got {tuple(labels.shape)} {labels.dtype}; "
                "pass one-hot or soft targets as floats (labels.float()) or class ids (labels.argmax(1))"
            )
        elif labels.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(
                f"labels must be integer class ids or float probabilities, got dtype {labels.dtype}; "
                "convert them with labels.long() (ids) or labels.float() (probabilities)"
            )
        elif labels.ndim != 1:
            raise ValueError(
                f"labels must be integer class ids of shape (batch,) or float probabilities of shape (batch, "
                f"{self.num_classes}), got {tuple(labels.shape)} {labels.dtype}"
            )

    def _check_labels(self, labels: Tensor, batch: int) -> None:
        self._check_label_shape(labels, batch)
        values = self.check_values
        if values is None:
            values = labels.device.type == "cpu" or not self._values_checked
        if values:
            check_labels(labels, self.num_classes)
            if not self._values_checked:  # once: nn.Module's attribute write looks the name up among its members first
                self._values_checked = True

    @overload  # type: ignore[override]  # kornia's forward takes *inputs and returns tensors only
    def forward(
        self,
        images: Tensor,
        labels: None = None,
        *,
        params: P | dict[str, Any] | None = None,
        data_keys: DataKeys | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor: ...

    @overload
    def forward(
        self,
        images: Tensor,
        labels: Tensor,
        *,
        params: P | dict[str, Any] | None = None,
        data_keys: DataKeys | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, TokenLabelMap]: ...

    def forward(
        self,
        images: Tensor,
        labels: Tensor | None = None,
        *,
        params: P | dict[str, Any] | None = None,
        data_keys: DataKeys | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor | tuple[Tensor, TokenLabelMap]:
        """Mix a batch: ``mixed, label_map = mixer(images, labels)``; ``mixer(images)`` returns the images.

        Args:
            images: ``(b, c, H, W)`` floating point.
            labels: ``(b,)`` class ids or ``(b, c)`` probabilities, or ``None`` (kornia's
                ``AugmentationSequential`` passes the images only).
            params: replay these params (typed, or the dict kornia recorded) instead of sampling.
            data_keys: kornia's data keys for this call: ``["input"]`` or ``["input", "class"]``.
            generator: source of randomness for this call (default: ``self.generator``).

        Returns:
            The mixed images, and the label map when labels are given.
        """
        if data_keys is not None:
            keys = [DataKey.get(k) for k in data_keys]
            if keys not in ([DataKey.INPUT], [DataKey.INPUT, DataKey.CLASS]):
                raise ValueError(f"{type(self).__name__} accepts data_keys ['input'] or ['input', 'class'], got {data_keys}")
            if keys == [DataKey.INPUT] and labels is not None:
                raise ValueError("labels were given but data_keys is ['input']; drop the labels or add 'class'")
        check_images(images)
        if generator is not None:  # (the message's name is built only for a generator to check)
            check_generator(generator, f"{type(self).__name__}(...) call")
        typed: P | None
        if params is None and not self.mixup_enabled:
            typed = None
        elif params is None:
            if generator is None:  # the mixer's own generator: a copy of one state in every worker
                check_worker_generator(self, self.generator)
            gen = generator if generator is not None else self.generator
            typed = self.sample(tuple(images.shape), generator=gen, device=self.draw_device(images.device, gen))
        else:
            typed = self._unwrap(params)
        if typed is None:  # mixing switched off (now, or when kornia recorded these params)
            size = (int(images.shape[2]), int(images.shape[3]))
            self._record(None, size, self._kornia_params(None, int(images.shape[0]), tuple(images.shape)))
            if labels is None:
                return images
            self._check_labels(labels, int(images.shape[0]))
            return images, self.unmixed_map(labels.to(images.device), size)
        self._check_batch(images, typed)
        b, _ = self.params_batch_size(typed)
        typed = self.place(typed, images)
        if isinstance(params, dict):  # kornia's record of this call then holds what was applied
            params[PARAMS_KEY] = typed
        if labels is not None:
            self._check_labels(labels, b)
        self._record(typed, None, self._kornia_params(typed, b, tuple(images.shape)))
        mixed = self.apply_images(images, typed)
        if labels is None:
            return mixed
        return mixed, self.label_map_from(typed, labels.to(images.device))


class PairMixer(Mixer[PP]):
    """A pairwise mixer (k = 2) whose params come from a ``MixSampler``.

    Args:
        sampler: the kornia random generator drawing this kind's params.
        num_classes: ``c``.
        label_smoothing: in ``[0, 1)``.
        generator: default source of randomness.
    """

    def __init__(
        self,
        sampler: MixSampler[PP],
        num_classes: int,
        label_smoothing: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_classes, label_smoothing, generator)
        self._param_generator = sampler
        self.sampler = sampler
        self.same_on_batch = sampler.mode == "batch"  # kornia's name for one draw per batch

    def sample(
        self,
        batch_shape: Sequence[int],
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> PP:
        """Draw params for a batch of shape ``(b, c, H, W)``.

        Args:
            batch_shape: ``(b, c, H, W)``.
            generator: source of randomness (one seed is drawn from it per call for kinds
                that draw Python numbers; tensor-drawing kinds draw on its device).
            device: where the params' tensors are built (default: the generator's device, else
                kornia's rng device, CPU); tensor-drawing kinds draw there when no generator is given.

        Returns:
            Frozen params; the same generator state gives the same params.
        """
        if len(batch_shape) != 4:
            raise ValueError(f"batch_shape must be (batch, channels, height, width), got {tuple(batch_shape)}")
        if generator is not None:
            check_generator(generator, f"{type(self).__name__}.sample")
        dev = device if device is None or isinstance(device, torch.device) else torch.device(device)
        # The sampler's forward itself: it is this mixer's own module, with no hooks for nn.Module's call to run
        params: PP = self.sampler.forward(tuple(int(s) for s in batch_shape), generator=generator, device=dev)
        return params

    def draw_device(self, images_device: torch.device, generator: torch.Generator | None = None) -> torch.device | None:
        if self.sampler.host_draws:  # Python numbers: the params are built where the images are
            return images_device
        return None if generator is not None else images_device  # tensor draws: on the generator's device

    def params_batch_size(self, params: PP) -> tuple[int, tuple[int, int]]:
        return params.batch_size, params.image_size

    def check_params(self, params: object) -> None:
        kind = self.sampler.params_type
        if not isinstance(params, kind):
            raise TypeError(
                f"{type(self).__name__} mixes with {kind.__name__}, got {type(params).__name__}; "
                f"replay params that this mixer sampled (mixer.sample(images.shape) or mixer.last_params)"
            )

    def apply_images(self, images: Tensor, params: PP) -> Tensor:
        """Mix ``(b, c, H, W)`` images cell by cell with the params' mask; pure.

        What params drawn on the host tell for free (the shared box, whether any sample is
        unmixed) is read there; the params then reach the images' device in one copy.
        """
        if params.token_space:
            return images  # the backbone mixes the patch embeddings instead
        params = params.current()
        box = params.shared_box()
        moved = params.to(images.device)
        if box is not None:
            return paste_box(images, moved.partner, box)
        lam = params.shared_weight()
        if lam is not None:
            return blend_images(images, moved.partner, lam)
        keep = moved.keep_cells()
        if keep is not None:
            return select_images(images, moved.partner, keep)
        unmixed = params.any_unmixed if not torch.compiler.is_compiling() else None
        if unmixed is None and host_params(params):
            unmixed = bool((params.source_weight() == 1.0).any())
        return mix_images(images, moved.partner, moved.source_weight(), unmixed=unmixed)

    def label_map_from(self, params: PP, labels: Tensor) -> TokenLabelMap:
        """The ``k = 2`` label map of ``params`` for ``labels``; pure."""
        return pair_label_map(params, labels, self.num_classes, self.label_smoothing)
