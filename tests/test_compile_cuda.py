"""GPU-only: a TL-Align training step compiled by inductor on CUDA equals eager, in one graph, once.

The CUDA attention routes pick their kernel outside the trace (a constant of it); this checks that
the compiled step runs that route's kernels and computes what eager computes, for a family of each
kind of label path, also under CUDA graphs (``mode="reduce-overhead"``), and that the GPU suite's compiled,
profiled step runs there. Skipped without CUDA (``benchmarks/gpu_suite.py`` runs it on a lent GPU).
"""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("name", ["resnet", "vit"])
def test_cuda_graphs_training_step_equals_eager(name: str) -> None:
    """``mode="reduce-overhead"`` (CUDA graphs: the step replays without the host's launches): one graph, equal to
    eager, and other boxes and partners replay without a recompile."""
    import torch._inductor.config as inductor_config

    family = next(f for f in ALIGNING if f.name == name)
    with inductor_config.patch(fallback_random=True):
        check_compiles_whole(family, "inductor", tol=1e-3, device="cuda", mode="reduce-overhead")


def test_the_suites_profile_names_the_host_calls(tmp_path: Path) -> None:
    """The GPU suite's ``--profile`` on a GPU: each variant's step gets its host calls' time beside its kernels',
    and ``--compile-mode`` reaches the compile."""
    from benchmarks import gpu_suite

    result = gpu_suite.main(["--dry-run", "--parts", "families", "--families", "resnet", "--profile", "--compile-mode",
                             "reduce-overhead", "--rounds", "1", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    assert "reduce-overhead" in result["provenance"]["command"]
    for variant in ("cutmix", "tlalign"):
        row = result["parts"]["families"]["resnet"][variant]
        assert row["graphs"] == 1 and row["graph_breaks"] == 0
        kernels = row["kernels"]
        assert kernels["per_step_ms"] > 0 and kernels["host_ms_per_step"] > 0 and kernels["host_top"]
