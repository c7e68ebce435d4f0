"""Every mixer on a GPU: a CUDA batch mixed with a CPU generator gives the CPU's pixels and label map, bit for bit.

Python-drawn params (every mixer's pairs and lambdas, FMix's noise from the CPU generator) are the same numbers on
either device; what the device then computes (FMix's ranks and label cells, SaliencyMix's peaks, boxes and label
weights, ResizeMix's planned paste, CutMix's keep axes, the select) must be what the CPU computes from those params.
Skipped without CUDA (CI has none; ``benchmarks/gpu_suite.py`` runs it on a lent GPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from mixlabels.strategies import (
    BlockwiseMix, CutMix, FMix, GridMix, MixToken, MixUp, RandomPatchMix, ResizeMix, SaliencyMix, Switch, TokenMix,
)  # fmt: skip
from mixlabels.strategies._saliencymix import box_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

NC, H, W, CELL = 10, 32, 24, 4
MIXERS: dict[str, Callable[[str], Any]] = {
    "cutmix": lambda mode: CutMix(NC, mode=mode, prob=0.8),
    "cutmix patch minmax": lambda mode: CutMix(NC, patch_size=CELL, minmax=(0.2, 0.8), mode=mode),
    "mixup": lambda mode: MixUp(NC, mode=mode, prob=0.8),
    "random patch": lambda mode: RandomPatchMix(NC, cell_size=CELL, mode=mode),
    "blockwise": lambda mode: BlockwiseMix(NC, cell_size=CELL, min_cells=2, mode=mode),
    "mixtoken": lambda mode: MixToken(NC, patch_size=CELL, mode=mode),
    "fmix": lambda mode: FMix(NC, mode=mode, prob=0.8),
    "fmix cells": lambda mode: FMix(NC, cell_size=CELL, mode=mode),
    "resizemix": lambda mode: ResizeMix(NC, mode=mode, prob=0.8),
    "resizemix cells": lambda mode: ResizeMix(NC, scale=(0.3, 0.9), patch_size=CELL, mode=mode),
    "saliencymix": lambda mode: SaliencyMix(NC, mode=mode, prob=0.8),
    "saliencymix cells": lambda mode: SaliencyMix(NC, patch_size=CELL, mode=mode),
    "gridmix": lambda mode: GridMix(NC, cell_sizes=(CELL, 2 * CELL), mode=mode),
    "tokenmix": lambda mode: TokenMix(NC, patch_size=CELL, min_tokens=2, mode=mode),
    "switch": lambda mode: Switch([MixUp(NC, mode=mode), CutMix(NC, mode=mode), FMix(NC, mode=mode)]),
}


def squares(b: int) -> torch.Tensor:
    """Dim random texture with one bright 6 x 6 square an image, each somewhere else: a clear saliency peak, so
    the GPU's FFTs and the CPU's find the same one."""
    x = 0.2 * torch.rand(b, 3, H, W, generator=torch.Generator().manual_seed(b))
    for i in range(b):
        r, c = (5 * i) % (H - 6), (7 * i) % (W - 6)
        x[i, :, r : r + 6, c : c + 6] += 0.8
    return x


def maps_match(gpu: Any, cpu: Any) -> None:
    assert torch.equal(gpu.sources.cpu(), cpu.sources)
    assert torch.equal(gpu.image_weights.cpu(), cpu.image_weights)  # host numbers, or one fp32 division a sample
    assert type(gpu.mask) is type(cpu.mask) and torch.equal(gpu.mask.dense().cpu(), cpu.mask.dense())
    assert_close(gpu.image_targets().cpu(), cpu.image_targets())
    assert_close(gpu.token_weights((H // CELL, W // CELL)).cpu(), cpu.token_weights((H // CELL, W // CELL)))


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
@pytest.mark.parametrize("name", list(MIXERS))
def test_cuda_batch_mixes_like_the_cpu(name: str, mode: str) -> None:
    for b, seed in ((7, 0), (8, 1)):  # odd: a flipped batch's middle sample stays unmixed
        x, y = squares(b), torch.arange(b) % NC
        mixer = MIXERS[name](mode)
        out, lm = mixer(x.cuda(), y.cuda(), generator=torch.Generator().manual_seed(seed))
        assert out.device.type == "cuda" and lm.sources.device.type == "cuda"
        if not name.startswith("saliencymix"):  # the GPU's FFTs round their own way: a peak may move (checked below)
            cpu_out, cpu_lm = mixer(x, y, generator=torch.Generator().manual_seed(seed))
            assert_close(out.cpu(), cpu_out, rtol=0, atol=0 if name not in ("mixup", "switch") else 1e-6)
            maps_match(lm, cpu_lm)
        else:  # each box (centred on its partner's peak, then clipped) meets the partner's bright square
            p = mixer.last_params
            assert torch.equal(lm.image_weights.cpu(), box_weights(p.boxes.cpu(), p.grid))  # the CPU's division's bits
            f = 1 if name == "saliencymix" else CELL
            for i, (j, (y0, y1, x0, x1)) in enumerate(zip(p.partner.tolist(), (p.boxes * f).tolist())):
                r, c = (5 * j) % (H - 6), (7 * j) % (W - 6)
                if p.applied[i] and y1 > y0 and x1 > x0:
                    assert y0 < r + 6 + f and y1 > r - f and x0 < c + 6 + f and x1 > c - f, (i, j, (y0, y1, x0, x1))
        # the params the GPU call used (placed, for SaliencyMix), moved to the CPU, mix the CPU batch the same
        replay_out, replay_lm = mixer.mix(x, y, mixer.last_params.to("cpu"))
        assert_close(out.cpu(), replay_out, rtol=0, atol=0 if name not in ("mixup", "switch") else 1e-6)
        maps_match(lm, replay_lm)


@pytest.mark.parametrize("mode", ["batch", "elem"])
def test_fmix_noise_from_a_cuda_generator_labels_its_pixels(mode: str) -> None:
    """A CUDA generator draws FMix's noise on the GPU (its own stream of numbers): the label cells are the pixels'
    selection, the weights their means, and the same generator state gives the same draw."""
    x, y = squares(6).cuda(), torch.arange(6).cuda()
    mixer = FMix(NC, mode=mode)
    out, lm = mixer(x, y, generator=torch.Generator(device="cuda").manual_seed(4))
    p = mixer.last_params
    assert p.cells.device.type == "cuda"
    keep = p.keep_cells()
    assert torch.equal(out, torch.where(keep[:, None], x, x[p.partner]))
    assert torch.equal(lm.mask.dense()[:, 0], keep.float()) and torch.equal(lm.mask.dense()[:, 1], (~keep).float())
    assert torch.equal(lm.image_weights[:, 0].cpu(), keep.float().cpu().mean((1, 2)))
    again, _ = mixer(x, y, generator=torch.Generator(device="cuda").manual_seed(4))
    assert torch.equal(again, out)
