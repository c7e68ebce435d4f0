"""Every aligning family with its model in float64 (``model.double()``, as for a gradient check), on the CPU.

The labels stay fp32 whatever the model's dtype (the ``LabelTracker`` protocol), so a float64 model's label path meets
float64 attention weights, conv weights and biases: a rule that mixed them with the labels without casting would
raise (``lerp`` refuses mixed dtypes) or round the labels differently on the fast path and the reference. Targets must
be fp32 rows summing to 1, equal to the reference's, and to the same model's targets in fp32 to fp32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_backbones_common import B, cutmix_batch
from test_backbones_cuda import ALIGNING, _model
from torch.testing import assert_close

from mixlabels import TLAlign, backbones


@pytest.mark.parametrize("family", ALIGNING, ids=lambda f: f.name)
def test_float64_model_gives_the_fp32_models_targets(family: backbones.Family) -> None:
    model = _model(family).train()
    images, lm = cutmix_batch()
    targets: dict[str, torch.Tensor] = {}
    for name, dtype, reference in (("fp32", torch.float32, False), ("fast", torch.float64, False), ("reference", torch.float64, True)):
        # a copy each: a training forward moves batch norms' running statistics, which reparameterised families'
        # label kernels read
        m = copy.deepcopy(model).to(dtype)
        torch.manual_seed(5)  # the same dropout and drop-path draws for each
        out = backbones.adapt(m, TLAlign(), reference=reference)(images.to(dtype), lm)
        targets[name] = out.target
        if name == "fast":
            assert out.logits.dtype == torch.float64
            out.loss().backward()
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            assert grads and all(g.dtype == torch.float64 and torch.isfinite(g).all() for g in grads)
    fast = targets["fast"]
    assert fast.dtype == torch.float32 and not fast.requires_grad
    assert_close(fast.sum(-1), torch.ones(B))
    assert_close(fast, targets["reference"], rtol=0, atol=1e-6)
    assert_close(fast, targets["fp32"], rtol=0, atol=1e-4)
