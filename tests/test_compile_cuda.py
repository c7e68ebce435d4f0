"""GPU-only: a TL-Align training step compiled by inductor on CUDA equals eager, in one graph, once.

The CUDA attention routes pick their kernel outside the trace (a constant of it); this checks that
the compiled step runs that route's kernels and computes what eager computes, for a family of each
kind of label path. Skipped without CUDA (``benchmarks/gpu_suite.py`` runs it on a lent GPU).
"""

from __future__ import annotations

import pytest
import torch

from test_compile import ALIGNING, check_compiles_whole

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("name", ["vit", "swin", "resnet"])  # attention, a mask, convolutions: inductor compiles take 30-70 s each
def test_cuda_inductor_training_step_equals_eager(name: str) -> None:
    import torch._inductor.config as inductor_config

    family = next(f for f in ALIGNING if f.name == name)
    with inductor_config.patch(fallback_random=True):
        check_compiles_whole(family, "inductor", tol=1e-3, device="cuda")
