"""A run of windows on the labels, three ways, side by side: pooled (one ``avg_pool2d`` a window), one dense
``(n', n)`` matrix per sample, or separable (a matrix product per axis).

``apply_path`` chooses by ``window_route`` (on a CPU pooled while ``b h w`` is small, then dense while ``b n' n``
is, else separable; on a GPU pooled). This times all three routes on the windows of a ResNet at 224 px (its stride-2 convs and shortcuts: 56x56 -> 28x28 -> 14x14 -> 7x7)
at a few batch sizes, interleaved, on the CPU or a GPU, and prints which route ``window_route`` takes. The
numbers behind the threshold, measured where a user trains.

Usage::

    python benchmarks/window_routes.py                          # CPU, batches 8 and 128
    python benchmarks/window_routes.py --device cuda --batch-sizes 128
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` and ``mixlabels`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._gpu_timing import Deadline, timed_rounds  # noqa: E402
from mixlabels.backbones._common import mix_tokens  # noqa: E402
from mixlabels.backbones._convnet import Window, window_axes  # noqa: E402
from mixlabels.backbones._windows import _window_kron, apply_pooled, apply_separable, chain_matrices, pool_ceil_mode, window_route  # noqa: E402

GRIDS = ((56, 56), (28, 28), (14, 14))
WINDOW = Window((3, 3), (2, 2), (1, 1))  # a ResNet block's strided 3x3 conv


@dataclass(frozen=True)
class Row:
    grid: tuple[int, int]
    out: tuple[int, int]
    batch: int
    dense_ms: float
    separable_ms: float
    pooled_ms: float
    route: str

    @property
    def pairs(self) -> int:
        return self.batch * self.out[0] * self.out[1] * self.grid[0] * self.grid[1]


def measure(device: torch.device, batch_sizes: Sequence[int], rounds: int, calls: int) -> list[Row]:
    """For every grid and batch: every route's median ms over ``rounds`` interleaved rounds, and the route taken."""
    rows: list[Row] = []
    for grid in GRIDS:
        axes = window_axes([WINDOW], grid)
        r, c = chain_matrices(grid, axes, True, device)
        out = (int(r.shape[0]), int(c.shape[0]))
        dense_matrix = _window_kron(grid, axes, device)
        ceil_modes = pool_ceil_mode(grid, axes)
        assert ceil_modes is not None  # a ResNet's 3x3 stride-2 window pools
        for b in batch_sizes:
            y = torch.rand(b, grid[0] * grid[1], 2, device=device)
            routes: dict[str, Callable[[], object]] = {
                "dense": lambda: mix_tokens(dense_matrix, y),
                "separable": lambda: apply_separable(y, grid, r, c),
                "pooled": lambda: apply_pooled(y, grid, axes, ceil_modes),
            }
            torch.testing.assert_close(routes["dense"](), routes["separable"](), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(routes["pooled"](), routes["separable"](), rtol=1e-5, atol=1e-6)
            # interleaved rounds, one warm-up call each, CUDA events on a GPU: the GPU suite's timer
            times = timed_rounds(routes, rounds, calls, 1, device, Deadline(math.inf), lambda _: None)
            rows.append(Row(grid, out, b, statistics.median(times["dense"]), statistics.median(times["separable"]),
                            statistics.median(times["pooled"]), window_route(b, grid, out, device)))
    return rows


def main(argv: Sequence[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 128])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is printed")
    p.add_argument("--calls", type=int, default=5, help="calls per round")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(torch.device(args.device), args.batch_sizes, args.rounds, args.calls)
    print("| grid | batch | b n' n | dense ms | separable ms | pooled ms | route taken |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        (h, w), (i, j) = row.grid, row.out
        print(f"| {h}x{w} -> {i}x{j} | {row.batch} | {row.pairs:,} | {row.dense_ms:.3f} | {row.separable_ms:.3f} | "
              f"{row.pooled_ms:.3f} | "
              f"{row.route} |")
    return rows


if __name__ == "__main__":
    main()
