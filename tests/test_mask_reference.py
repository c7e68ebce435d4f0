"""``source_mean`` of both masks against a naive pixel-mask reference (plain loops over pixels).

``source_mean`` is lambda of a pixel mix: the area share of source 0. The reference paints
every pixel of the image by hand (a box's pixels, or the pixels each cell covers) and
averages; boxes reaching past the grid (which ``BoxMask`` accepts and clips) are included.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from mixlabels import TokenLabelMap
from mixlabels._mask import BoxMask, CellMask


def naive_box_lambda(boxes: Tensor, grid: tuple[int, int], image_size: tuple[int, int]) -> Tensor:
    """Source 0's pixel share: a pixel is the partner's when its cell lies in the half-open box."""
    gh, gw = grid
    hh, ww = image_size
    out = []
    for y0, y1, x0, x1 in boxes.tolist():
        own = 0
        for py in range(hh):
            for px in range(ww):
                cy, cx = py * gh // hh, px * gw // ww  # the cell this pixel lies in
                own += not (y0 <= cy < y1 and x0 <= cx < x1)
        out.append(own / (hh * ww))
    return torch.tensor(out, dtype=torch.float32)


def naive_cell_lambda(cells: Tensor, image_size: tuple[int, int]) -> Tensor:
    """Source 0's mean weight over the pixels, each pixel taking its cell's weight."""
    b, _, mh, mw = cells.shape
    hh, ww = image_size
    out = []
    for i in range(b):
        total = 0.0
        for py in range(hh):
            for px in range(ww):
                total += float(cells[i, 0, py * mh // hh, px * mw // ww])
        out.append(total / (hh * ww))
    return torch.tensor(out, dtype=torch.float32)


def edge_boxes(grid: tuple[int, int], n: int, seed: int) -> Tensor:
    """Boxes with corners from 3 cells before the grid to 3 past it: inside, straddling, outside, empty, inverted."""
    g = torch.Generator().manual_seed(seed)
    gh, gw = grid
    ys = torch.randint(-3, gh + 4, (n, 2), generator=g)
    xs = torch.randint(-3, gw + 4, (n, 2), generator=g)
    fixed = torch.tensor([[0, gh, 0, gw], [-5, gh + 5, -5, gw + 5], [gh, gh + 2, 0, gw], [-2, 0, 0, gw],
                          [1, 1, 0, gw], [3, 1, 0, gw], [-1, 2, gw - 1, gw + 3], [0, 0, 0, 0]])  # fmt: skip
    return torch.cat([fixed, torch.stack([ys[:, 0], ys[:, 1], xs[:, 0], xs[:, 1]], dim=1)])


@pytest.mark.parametrize(("grid", "image_size"), [((4, 4), (16, 16)), ((3, 5), (12, 20)), ((8, 6), (8, 6))])
def test_box_source_mean_matches_the_painted_pixels(grid: tuple[int, int], image_size: tuple[int, int]) -> None:
    boxes = edge_boxes(grid, 40, seed=sum(grid))
    mask = BoxMask(boxes, grid)
    want = naive_box_lambda(boxes, grid, image_size)
    assert_close(mask.source_mean(), want, rtol=0, atol=1e-6)
    assert_close(mask.source_mean(), CellMask(mask.dense()).source_mean(), rtol=0, atol=0)
    assert want.min() == 0.0 and want.max() == 1.0 and ((want > 0) & (want < 1)).any()  # the cases are varied
    # the pixels a label map mixes with it carry the same share: source 0 all ones, the partner all zeros
    b = boxes.shape[0]
    w0 = mask.source_mean()
    lm = TokenLabelMap(sources=torch.stack([torch.arange(b), torch.arange(b).roll(1)], dim=1), mask=mask,
                       image_weights=torch.stack([w0, 1 - w0], dim=1), labels=torch.zeros(b, dtype=torch.long),
                       num_classes=3, image_size=image_size)
    own = torch.zeros(boxes.shape[0], 1, *image_size)
    own[0::2] = 1.0  # even samples ones, odd samples zeros: the partner (the previous sample) differs in parity
    mixed = lm.mix_pixels(own)
    share = torch.where(own[:, 0, 0, 0] == 1.0, mixed.mean(dim=(1, 2, 3)), 1.0 - mixed.mean(dim=(1, 2, 3)))
    assert_close(share, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("cells_hw", "image_size"), [((1, 1), (8, 8)), ((2, 3), (8, 9)), ((4, 4), (16, 16))])
def test_cell_source_mean_matches_the_painted_pixels(cells_hw: tuple[int, int], image_size: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(cells_hw[0] * 10 + cells_hw[1])
    cells = torch.softmax(3 * torch.randn(6, 3, *cells_hw, generator=g), dim=1)  # K = 3 sources
    cells[0, :, :, :] = torch.tensor([0.0, 1.0, 0.0])[:, None, None]  # none of source 0
    cells[1, :, :, :] = torch.tensor([1.0, 0.0, 0.0])[:, None, None]  # all of it
    mask = CellMask(cells)
    want = naive_cell_lambda(cells, image_size)
    assert_close(mask.source_mean(), want)
    assert_close(mask.source_mean(), mask.pixel_weights(image_size)[:, 0].mean(dim=(1, 2)))
    assert want[0] == 0.0 and want[1] == 1.0


def test_box_source_mean_reaching_past_the_grid_by_hand() -> None:
    # a 4x4 grid; the box rows -2..2 (2 inside) by columns 3..9 (1 inside): 2 of 16 cells are the partner's
    assert_close(BoxMask(torch.tensor([[-2, 2, 3, 9]]), (4, 4)).source_mean(), torch.tensor([14 / 16]))
    # wholly outside: nothing mixed
    assert_close(BoxMask(torch.tensor([[5, 9, 0, 4]]), (4, 4)).source_mean(), torch.tensor([1.0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_box_source_mean_on_the_gpu_matches_the_painted_pixels() -> None:
    """Off the CPU ``BoxMask.source_mean`` builds and averages the cells (the device's own rounding)."""
    grid, image_size = (3, 5), (12, 20)
    boxes = edge_boxes(grid, 40, seed=1)
    got = BoxMask(boxes.cuda(), grid).source_mean()
    assert got.device.type == "cuda"
    assert_close(got.cpu(), naive_box_lambda(boxes, grid, image_size), rtol=0, atol=1e-6)
    cells = torch.softmax(torch.randn(4, 2, 2, 3, generator=torch.Generator().manual_seed(0)), dim=1)
    assert_close(CellMask(cells.cuda()).source_mean().cpu(), naive_cell_lambda(cells, (8, 9)))


def _painted_token_weights(boxes: Tensor, grid: tuple[int, int], tokens: tuple[int, int]) -> Tensor:
    """``(b, h*w, 2)`` float64: each token's share of own and partner cells, counted cell by cell at the lcm grid
    (a cell lies in a half-open box or not; corners past the grid and inverted boxes take no cell)."""
    (gh, gw), (h, w) = grid, tokens
    fh, fw = gh * h, gw * w  # a common refinement of both tilings
    out = torch.zeros(boxes.shape[0], h * w, 2, dtype=torch.float64)
    for i, (y0, y1, x0, x1) in enumerate(boxes.tolist()):
        for fy in range(fh):
            for fx in range(fw):
                cy, cx = fy // h, fx // w  # the mask cell of this fine cell
                token = (fy // gh) * w + fx // gw
                out[i, token, int(y0 <= cy < y1 and x0 <= cx < x1)] += 1.0
    return out / (gh * gw)


@pytest.mark.parametrize(("grid", "tokens"), [((4, 4), (2, 2)), ((3, 5), (3, 5)), ((6, 4), (4, 6)), ((8, 6), (2, 3))])
def test_box_token_weights_match_the_painted_cells(grid: tuple[int, int], tokens: tuple[int, int]) -> None:
    """Boxes inside, straddling and past the grid, empty and inverted: the partner's share of every token from the box
    bounds clamped into the token's span equals the cells counted one by one, and is bit for bit the cell mask's."""
    boxes = edge_boxes(grid, 40, seed=3 * sum(grid) + sum(tokens))
    mask = BoxMask(boxes, grid)
    got = mask.token_weights(tokens)
    assert got.dtype == torch.float32 and got.shape == (boxes.shape[0], tokens[0] * tokens[1], 2)
    assert_close(got.double(), _painted_token_weights(boxes, grid, tokens), rtol=0, atol=1e-7)
    assert torch.equal(got, CellMask(mask.dense()).token_weights(tokens))
    assert (got[:, :, 1] > 0).any() and (got[:, :, 1] < 1).any() and (got[:, :, 1] == 0).any()  # the cases are varied


def test_box_window_weights_of_inverted_and_outside_boxes_are_the_cell_mask_ones() -> None:
    """The window weights compare every cell with the box by clamping the box bounds into the cell's span: a box
    past the grid, an empty one and an inverted one weigh exactly as their painted cells do (an inverted box: none)."""
    from mixlabels.backbones._windows import axis_windows, chain_matrices

    grid = (8, 6)
    boxes = edge_boxes(grid, 24, seed=5)
    wh, ww = axis_windows((3, 3), (2, 2), (1, 1)), axis_windows((3, 3), (2, 2), (1, 1))
    rows, cols = chain_matrices((16, 12), ((wh[0], ww[0]), (wh[1], ww[1])), True, torch.device("cpu"))
    box = BoxMask(boxes, grid)
    got = box.window_weights(rows, cols)
    assert_close(got, CellMask(box.dense()).window_weights(rows, cols), rtol=1e-6, atol=1e-6)
    inverted = [i for i, (y0, y1, x0, x1) in enumerate(boxes.tolist()) if y1 < y0 or x1 < x0]
    assert inverted and torch.equal(got[inverted, :, 1], torch.zeros_like(got[inverted, :, 1]))
    assert (got >= 0).all()
