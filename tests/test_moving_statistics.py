"""Every family with batch norms: the fast path equals the reference when a training forward moves the running
statistics.

Some label rules read a batch norm's running statistics (a re-parameterisable block's fused kernel, a norm folded
into attention). A training forward updates them as it goes, so the fast path must read them at the same point of
the forward as the reference: before or after the block's norms update. The families' own parity checks run both
paths on one model with momentum 0 (both then see the same statistics), which cannot see this; here each path runs
on its own copy, from the same random statistics, with momentum 0.5.
"""

from __future__ import annotations

import pytest
import torch
from test_backbones_common import check_parity_moving_statistics
from torch import nn

from mixlabels import backbones


def _has_norms(family: backbones.Family) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in family.example().modules())


WITH_NORMS = [f for f in backbones.FAMILIES if f.name != "any" and _has_norms(f)]


def test_the_families_with_batch_norms_are_many() -> None:
    assert len(WITH_NORMS) >= 30, [f.name for f in WITH_NORMS]


@pytest.mark.parametrize("family", WITH_NORMS, ids=lambda f: f.name)
def test_fast_path_reads_the_running_statistics_the_reference_reads(family: backbones.Family) -> None:
    model = family.example()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_var is not None:
                m.running_var.uniform_(0.5, 2.0, generator=g)  # not init's 1 and 0, which a wrong fold could hide
                m.running_mean.normal_(0.0, 0.5, generator=g)
    check_parity_moving_statistics(model, "tl_align")
