"""A token mixer whose weights are all zeros reads nothing: its token keeps its own labels, not a row of zeros.

ResMLP's and gMLP's token linears, MLP-Mixer's token MLP, CaiT's and EfficientFormerV2's talking heads mix the tokens by the
normalised absolute weights. A row with no mass (zero-initialised weights, and a zero bias where the bias joins the
row) was divided by a clamped sum: a row of zeros, so that token's label mass was lost at that layer and the
readout's renormalisation quietly reweighted the tokens (the reference, ``_dense.row_normalise``, gives such a row
the identity's, and CaiT's and MLP-Mixer's references divided 0 by 0). ``_common.mixing_rows`` and CaiT's fast
product now add the self tap ``_READS_NOTHING`` (the conv label kernels' rule, ``tests/test_zero_weight_convs.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.testing import assert_close

from mixlabels import TLAlign, backbones
from mixlabels.backbones._common import mixing_rows
from mixlabels.backbones._dense import row_normalise
from mixlabels.backbones.families.cait import label_matrix, talking_heads_label_mix
from test_zero_weight_convs import _batch  # the same two-box CutMix batch

FAMILIES = {f.name: f for f in backbones.FAMILIES}


def test_mixing_rows_gives_a_massless_row_the_identity_and_keeps_other_rows_bits() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.rand(3, 6, 6, generator=g)
    w[0, 2] = 0.0  # token 2 of the first mixer draws from nothing
    w[2] = 0.0  # a mixer of zeros
    before = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # the old rule
    rows = mixing_rows(w.clone())
    assert_close(rows.double(), row_normalise(w.double()), atol=1e-7, rtol=0)
    assert_close(rows[0, 2], torch.eye(6)[2]) and assert_close(rows[2], torch.eye(6))
    assert torch.equal(rows[1], before[1]) and torch.equal(rows[0, :2], before[0, :2])  # a row with mass: same bits


def test_talking_heads_row_without_mass_keeps_the_token_and_matches_label_matrix() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 3, 5, 5, generator=g)
    a[0, 1, 3] = 0.0  # head 1 of sample 0: token 3 reads nothing
    a[1, :, 0] = 0.0  # sample 1: token 0 reads nothing in every head
    y = torch.rand(2, 5, 4, generator=g)
    y = y / y.sum(-1, keepdim=True)
    fast = talking_heads_label_mix(a, y)
    assert_close(fast, label_matrix(a) @ y)
    assert_close(fast[1, 0], y[1, 0])  # every head leaves token 0 its own labels
    assert_close(fast.sum(-1), torch.ones(2, 5))
    w = a.double().abs()
    assert_close(fast.double(), row_normalise(w).mean(1) @ y.double(), atol=1e-7, rtol=0)


def _token_mixers(family: str, model: torch.nn.Module) -> list[tuple[Any, slice]]:
    """The weights that mix ``family``'s tokens, with the output rows to zero: half of the tokens of a linear over
    tokens (were all of them zeroed, every token would lose the same mass, which the readout's renormalisation
    hides), every head mix of a talking-heads attention (a 1x1 conv over heads in EfficientFormerV2)."""
    m: Any = model
    if family == "resmlp":
        return [(blk.linear_tokens, slice(0, blk.linear_tokens.out_features // 2)) for blk in m.blocks]
    if family == "mlp_mixer":
        return [(blk.mlp_tokens.fc2, slice(0, blk.mlp_tokens.fc2.out_features // 2)) for blk in m.blocks]
    if family == "gmlp":
        return [(blk.mlp_channels.gate.proj, slice(0, blk.mlp_channels.gate.proj.out_features // 2)) for blk in m.blocks]
    if family == "cait":
        return [(blk.attn.proj_w, slice(None)) for blk in m.blocks]
    return [(mod.talking_head2, slice(None)) for mod in m.modules() if hasattr(mod, "talking_head2")]


@pytest.mark.parametrize("family", ["resmlp", "mlp_mixer", "gmlp", "cait", "efficientformer_v2"])
def test_zeroed_token_mixers_keep_every_tokens_mass_fast_equal_to_reference(family: str) -> None:
    images, lm = _batch()
    out = []
    for reference in (False, True):
        torch.manual_seed(0)
        model = FAMILIES[family].example().train()
        mixers = _token_mixers(family, model)
        assert mixers
        with torch.no_grad():
            for mixer, rows in mixers:
                mixer.weight[rows] = 0.0
                if mixer.bias is not None:
                    mixer.bias[rows] = 0.0
        torch.manual_seed(0)
        out.append(backbones.adapt(model, TLAlign(), reference=reference)(images, lm).target.double())
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).all()
    assert_close(out[0].sum(-1), torch.ones(2, dtype=torch.float64))
    assert_close(out[0], out[1], atol=1e-6, rtol=0)
