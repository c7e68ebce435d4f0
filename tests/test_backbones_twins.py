"""The Twins adapter (PCPVT, SVT): preservation, fast = reference, padded windows, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import timm
import torch
from test_backbones_common import C, POOLED, SCHEMES, check_parity, check_preservation, check_unmixed_is_one_hot, cutmix_batch, set_fused, sharpen
from timm.models.twins import Twins
from torch.testing import assert_close

from mixlabels import NoAlign, TLAlign, TransMix, backbones
from mixlabels.backbones._common import launch_routes
from mixlabels.backbones.families import twins as twins_module
from mixlabels.backbones.families.twins import _lsa_reference

# 32 px, patch 4 then 2: 8x8 then 4x4 tokens. "svt_padded": 3x3 windows pad the 8x8 grid to 9x9 and
# the 4x4 grid to 6x6, so padded keys take part in the softmax.
CONFIGS: dict[str, dict[str, Any]] = {
    "pcpvt": {"sr_ratios": (2, 1)},
    "svt": {"wss": (4, 4), "sr_ratios": (2, 1)},
    "svt_padded": {"wss": (3, 3), "sr_ratios": (4, 2)},
}


def make(config: str, drop_path_rate: float = 0.0, fused: bool = True) -> Twins:
    torch.manual_seed(0)
    model = Twins(num_classes=C, depths=(2, 2), embed_dims=(16, 32), num_heads=(2, 2), mlp_ratios=(2, 2),
                  drop_path_rate=drop_path_rate, **CONFIGS[config])  # fmt: skip
    sharpen(set_fused(model, fused))
    return model


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_function_preservation_train_mode(config: str, fused: bool) -> None:
    for scheme in ("none", "tl_align", "tokens_aligned"):
        check_preservation(make(config, drop_path_rate=0.5, fused=fused), SCHEMES[scheme])


@pytest.mark.parametrize("scheme", POOLED)
def test_fast_path_equals_reference(scheme: str) -> None:
    check_parity(make("svt_padded", drop_path_rate=0.4), scheme)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fast_path_equals_reference_variants(config: str) -> None:
    check_parity(make(config, drop_path_rate=0.4), "tl_align")
    check_parity(make(config, drop_path_rate=0.4, fused=False), "tokens_aligned")
    check_parity(make(config, drop_path_rate=0.2), "tl_align", token_space=True)


def test_unmixed_gives_one_hot() -> None:
    check_unmixed_is_one_hot(make("svt_padded"), POOLED)


def test_padded_windows_renormalise_over_real_tokens() -> None:
    """The reference's LSA matrix: rows sum to 1, no weight on padding, a token sees only its own window."""
    model = make("svt_padded")
    attn = model.blocks[0][0].attn
    x = torch.randn(2, 64, 16)
    out, matrix = _lsa_reference(attn, x, (8, 8))
    assert_close(out, attn(x, (8, 8)))
    assert_close(matrix.sum(-1), torch.ones(2, 64, dtype=torch.float64))
    window = torch.arange(64).view(8, 8)[6:, 6:].flatten()  # the last window: 2x2 real of 3x3
    assert_close(matrix[:, window][:, :, window].sum(-1), torch.ones(2, 4, dtype=torch.float64))
    assert (matrix[:, window[0], 0] == 0).all()


def test_timm_names_adapt_and_refusals() -> None:
    names = timm.list_models("twins_*")
    assert names
    for name in names:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False)
        assert next(f for f in backbones.FAMILIES if f.name == "twins").refusal(model) is None, name
    images, lm = cutmix_batch()
    with pytest.raises(ValueError, match="no class token"):
        backbones.adapt(make("svt"), TransMix())(images, lm)
    pooled = make("svt")
    pooled.global_pool = ""
    with pytest.raises(TypeError, match="global_pool='' has no label readout; use 'avg'"):
        backbones.adapt(pooled, TLAlign())
    assert type(backbones.adapt(pooled, NoAlign())).__name__ == "AdaptedClassifier"  # any classifier
    strided = make("svt")
    strided.pos_block[1].stride = 2
    with pytest.raises(TypeError, match="stage 1's position block is not timm's stride-1 PosConv"):
        backbones.adapt(strided, TLAlign())
    plain = make("svt")
    plain.blocks[0][1].attn = torch.nn.Identity()
    with pytest.raises(TypeError, match="stage 0 block 1 is not timm's twins Block .*got attention Identity"):
        backbones.adapt(plain, TLAlign())
    padded = make("pcpvt")
    padded.blocks[0][0].attn.sr.padding = (1, 1)
    with pytest.raises(TypeError, match="stage 0 block 0's sub-sampling conv overlaps"):
        backbones.adapt(padded, TLAlign())


def _label_widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The label channels every attention's label mix receives (fused and explicit routes)."""
    widths: list[int] = []
    fused, explicit = twins_module.attention_with_labels, twins_module.explicit_mix

    def fused_spy(q: Any, k: Any, v: Any, y: torch.Tensor, *args: Any) -> Any:
        widths.append(int(y.shape[-1]))
        return fused(q, k, v, y, *args)

    def explicit_spy(a: Any, y: torch.Tensor) -> Any:
        widths.append(int(y.shape[-1]))
        return explicit(a, y)

    monkeypatch.setattr(twins_module, "attention_with_labels", fused_spy)
    monkeypatch.setattr(twins_module, "explicit_mix", explicit_spy)
    return widths


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("config", ["svt", "svt_padded"])
def test_a_gpus_route_leaves_the_mass_channel_out_where_the_windows_tile_the_grid(config: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every operator is a launch, local attention on a grid its windows tile mixes the labels alone (every
    row's real mass is 1), and a padded grid's labels keep the mass channel: the reference's targets either way. The
    CPU's eager route keeps the channel on every grid (the digest's bits)."""
    widths = _label_widths(monkeypatch)
    with launch_routes():
        check_parity(make(config, drop_path_rate=0.4, fused=fused), "tl_align")
    # the sources' weights (two) alone, or with the mass channel: LSA's on a padded grid, GSA's never
    assert set(widths) == ({2} if config == "svt" else {2, 3})
    widths.clear()
    check_parity(make("svt", fused=fused), "tl_align")
    assert set(widths) == {2, 3}  # the CPU's eager route: LSA's labels with the mass channel


def test_a_padded_grid_without_its_mass_channel_fails_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the mass channel left out on a grid the windows pad (padded keys take part in the softmax, so
    the rows' real mass is below 1) gives other targets than the reference's."""
    monkeypatch.setattr(twins_module, "_needs_mass", lambda grid, ws, device: False)
    widths = _label_widths(monkeypatch)
    with launch_routes(), pytest.raises(AssertionError):
        check_parity(make("svt_padded"), "tl_align")
    assert widths and set(widths) == {2}


def test_a_gpus_route_reads_the_position_convs_kernels_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every operator is a launch, the position convs' label kernels come from one ``Kernels`` read for the
    forward (no conv's own ``conv_label_kernel``), with the reference's targets; the CPU's eager route reads each
    stage's own (the digest's bits)."""
    calls: list[int] = []
    real = twins_module.conv_label_kernel

    def counted(weight: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(weight)

    monkeypatch.setattr(twins_module, "conv_label_kernel", counted)
    with launch_routes():
        check_parity(make("pcpvt"), "tl_align")
    assert not calls
    check_parity(make("pcpvt"), "tl_align")
    assert len(calls) == 2  # one per stage: the model's two position convs
