"""The MLP-Mixer adapter: preservation, fast = reference, the token-MLP label rule Norm(|W2| |W1|)."""

from __future__ import annotations

import pytest
import torch
from test_backbones_common import C, IMG, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch
from timm.layers.mlp import Mlp
from timm.models.mlp_mixer import MlpMixer
from torch import nn
from torch.testing import assert_close

from mixlabels import backbones
from mixlabels.backbones.families.mlp_mixer import token_mixing_matrices
from mixlabels import TLAlign, TransMix


def make(drop_path_rate: float = 0.0) -> MlpMixer:
    torch.manual_seed(0)
    return MlpMixer(img_size=IMG, patch_size=8, embed_dim=32, num_blocks=2, num_classes=C, drop_path_rate=drop_path_rate)


@pytest.mark.parametrize("scheme", ["none", "tl_align", "tokens_aligned"])
def test_function_preservation_train_mode(scheme: str) -> None:
    check_preservation(make(drop_path_rate=0.5), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make(drop_path_rate=0.4), scheme)


def test_mixtoken_fast_equals_reference() -> None:
    check_parity(make(drop_path_rate=0.2), "tokens_aligned", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make(), POOLED)


def test_token_mixing_matrix_rule() -> None:
    """Rows are distributions; identity-like weights (|W2||W1| = I) leave the labels alone."""
    model = make()
    mlp = model.blocks[0].mlp_tokens
    w = token_mixing_matrices([mlp])[0]
    assert_close(w.sum(-1), torch.ones(w.shape[0]))
    n = w.shape[0]
    with torch.no_grad():
        mlp.fc1.weight.zero_()
        mlp.fc2.weight.zero_()
        mlp.fc1.weight[:n] = -torch.eye(n)  # signs do not matter
        mlp.fc2.weight[:, :n] = 3 * torch.eye(n)
    assert_close(token_mixing_matrices([mlp])[0], torch.eye(n))
    images, lm = cutmix_batch()
    for blk in model.blocks:
        blk.mlp_tokens.load_state_dict(mlp.state_dict())
    out = backbones.adapt(model, TLAlign())(images, lm)
    assert_close(out.target, lm.image_targets())  # labels never moved: the pooled area mix


def test_transmix_refused() -> None:
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make(), TransMix())(images, lm)


def test_a_models_mixes_computed_together_equal_each_blocks_own() -> None:
    """``_read_matrices``' one batched call per model against each block's mix alone, for the three block types."""
    from mixlabels.backbones.families.gmlp import gating_mixing_matrices
    from mixlabels.backbones.families.resmlp import linear_mixing_matrices

    torch.manual_seed(0)
    mlps = [Mlp(9, hidden_features=12) for _ in range(3)]
    linears = [nn.Linear(9, 9) for _ in range(3)]
    for together, alone in (
        (token_mixing_matrices(mlps), [token_mixing_matrices([m])[0] for m in mlps]),
        (gating_mixing_matrices(linears), [gating_mixing_matrices([p])[0] for p in linears]),
        (linear_mixing_matrices(linears), [linear_mixing_matrices([p])[0] for p in linears]),
    ):
        assert together.shape == (3, 9, 9)
        assert_close(together, torch.stack(alone), atol=1e-7, rtol=0)
    no_bias = nn.Linear(9, 9, bias=False)
    with pytest.raises(ValueError, match="some projections have a bias and some not"):
        gating_mixing_matrices([linears[0], no_bias])
