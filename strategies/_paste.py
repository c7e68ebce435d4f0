"""Copying only what moves: the CPU paths of the box mixers and of every binary cell mixer.

``PairMixer``'s select gathers every partner pixel and selects (about three passes
over the batch); timm's CutMix copies the batch once and the box twice. On the
CPU, outside tracing by dynamo, these helpers copy about as much as timm: the batch
once, then only regions (a box per sample from its partner; for a cell mask that
every mixed sample shares, as in ``mode="batch"``, the partners whole and then the
runs of cells each sample keeps, back from itself, one copy a run for the batch).
Results are bit-identical to the select: the same pixels are copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mixlabels.strategies._base import MixParams, gather_partners
from mixlabels.strategies._patch import CellParams

__all__ = ["paste_boxes", "pixel_boxes", "shared_cells", "paste_cells", "fast_paths", "apply_cells", "apply_boxes"]


def fast_paths(images: Tensor) -> bool:
    """The copy paths apply: CPU tensors (host-side loops are free there) and not being traced."""
    return images.device.type == "cpu" and not torch.compiler.is_compiling()


def pixel_boxes(boxes: Tensor, grid: tuple[int, int], image_size: tuple[int, int]) -> Tensor:
    """``(b, 4)`` long boxes in cells of ``grid`` scaled to pixels."""
    ch, cw = image_size[0] // grid[0], image_size[1] // grid[1]
    return boxes * torch.tensor([ch, ch, cw, cw], device=boxes.device)


def paste_boxes(images: Tensor, partner: Tensor, boxes: Tensor) -> Tensor:
    """A copy of ``images`` where sample ``i``'s pixel box ``boxes[i]`` shows ``images[partner[i]]``; one copy a box.

    Empty boxes and samples paired with themselves come back bit-identical.

    Example:
        >>> x = torch.arange(8.0).view(2, 1, 2, 2)
        >>> paste_boxes(x, torch.tensor([1, 0]), torch.tensor([[0, 2, 1, 2], [0, 0, 0, 0]]))[:, 0].tolist()
        [[[0.0, 5.0], [2.0, 7.0]], [[4.0, 5.0], [6.0, 7.0]]]
    """
    out = images.clone()
    for i, ((y0, y1, x0, x1), j) in enumerate(zip(boxes.tolist(), partner.tolist())):
        if y1 > y0 and x1 > x0 and i != j:
            out[i, :, y0:y1, x0:x1] = images[j, :, y0:y1, x0:x1]
    return out


def shared_cells(params: CellParams) -> Tensor | None:
    """The ``(gh, gw)`` partner cells every mixed sample shares, if it is so; else ``None``.

    Shared means: every mixed sample takes the same cells, and every unmixed one is paired
    with itself (copying a sample's own pixels over themselves changes nothing). That is
    ``mode="batch"`` with any pairing; a sample unmixed by ``prob`` in the other modes breaks it.
    """
    cells, applied = params.cells, params.applied
    if not bool(applied.any()):
        return torch.zeros(cells.shape[1:], dtype=torch.bool, device=cells.device)
    first = cells[int(applied.nonzero()[0, 0])]
    own = params.partner == torch.arange(params.batch_size, device=params.partner.device)
    ok = ((cells == first) | ~applied[:, None, None]).all() & (applied | own).all()
    return first if bool(ok) else None


def paste_cells(images: Tensor, partner: Tensor, cells: Tensor) -> Tensor:
    """A copy of ``images`` where the ``(gh, gw)`` True cells show each sample's partner, run by run.

    The partners are gathered whole (one copy of the batch, as a clone would be), then each row's runs of
    consecutive cells the samples keep are copied back from ``images``, one strided copy per run for the
    whole batch: the same index in both, so no per-sample loop (a run per sample cost a copy call each,
    thousands a call for a 14 x 14 grid at batch 64). Meant for cell grids: a few runs in all.

    Example:
        >>> x = torch.arange(8.0).view(2, 1, 2, 2)
        >>> paste_cells(x, torch.tensor([1, 0]), torch.tensor([[False, True], [False, False]]))[:, 0].tolist()
        [[[0.0, 5.0], [2.0, 3.0]], [[4.0, 1.0], [6.0, 7.0]]]
    """
    gh, gw = cells.shape
    if not bool(cells.any()) or bool((partner == torch.arange(partner.shape[0], device=partner.device)).all()):
        return images.clone()  # nothing moves
    ch, cw = images.shape[2] // gh, images.shape[3] // gw
    out = gather_partners(images, partner)  # every sample its partner's pixels (an unmixed one: its own)
    edges = torch.diff(F.pad((~cells).to(torch.int8), (1, 1)), dim=1)  # +1 where a kept run starts, -1 after it ends
    starts, ends = (edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()  # row-major: runs pair up
    for (r, q0), (_, q1) in zip(starts, ends):
        rows, cols = slice(r * ch, (r + 1) * ch), slice(q0 * cw, q1 * cw)
        out[:, :, rows, cols] = images[:, :, rows, cols]
    return out


def apply_boxes(images: Tensor, params: MixParams) -> Tensor | None:
    """The copy path for params with a box per sample (``cell_boxes``: CutMix's pair and elem modes, SaliencyMix's
    placed boxes), or ``None`` where the select must run: traced, off the CPU, without boxes, or under autograd (a
    graph node a box, where the select is one)."""
    drawn = params.cell_boxes()
    if drawn is None or not fast_paths(images) or (torch.is_grad_enabled() and images.requires_grad):
        return None
    boxes, grid = drawn
    return paste_boxes(images, params.partner, pixel_boxes(boxes, grid, params.image_size))


def apply_cells(images: Tensor, params: CellParams) -> Tensor | None:
    """The copy path for binary cell params, or ``None`` where the select must run (traced, autograd, GPU, ...)."""
    # A per-pixel mask (FMix) has hundreds of runs: copying them costs more than the select, which runs instead.
    if not fast_paths(images) or params.grid == tuple(images.shape[2:]):
        return None
    cells = shared_cells(params)
    return None if cells is None else paste_cells(images, params.partner, cells)
