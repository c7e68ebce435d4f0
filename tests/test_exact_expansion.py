"""Label expansions stay exact whatever fp32 matmul precision the caller set.

Many training scripts turn TF32 on (``torch.backends.cuda.matmul.allow_tf32 = True``, or
``torch.set_float32_matmul_precision("high")``); on a CPU with bf16 kernels ``"medium"`` rounds a matmul's inputs to
bf16. ``TokenLabelMap.targets`` expands ``(b, n, k)`` source weights into class distributions; as one matmul it would
follow that setting and move a plain CutMix target by up to 1e-3, where timm's ``Mixup`` mixes exactly. Under a
setting that may round (``rounding_matmuls``) the expansions take fp32 multiply-adds instead; at the default they keep
the matmul (the CPU's bits, which the targets digest holds). Every check compares against a float64 product.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch.testing import assert_close

from mixlabels import TokenLabelMap
from mixlabels._routes import rounding_matmuls

B, C, GRID = 64, 1000, (14, 14)
CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")


def _switches() -> list[tuple[object, str]]:
    """The precision settings a test may change (torch >= 2.9's per-backend ones, where this torch has them)."""
    out: list[tuple[object, str]] = []
    for mod in (torch.backends, torch.backends.mkldnn, getattr(torch.backends.mkldnn, "matmul", None), torch.backends.cuda.matmul):
        if mod is not None and getattr(mod, "fp32_precision", None) is not None:
            out.append((mod, "fp32_precision"))
    return out


@pytest.fixture(autouse=True)
def restored_precision() -> Iterator[None]:
    """Leave the precision settings as found: a later test (and inductor, which reads the legacy switches) must not
    meet a mix of the legacy and the new settings, which torch's getters refuse."""
    legacy = torch.get_float32_matmul_precision()
    saved = [(mod, name, getattr(mod, name)) for mod, name in _switches()]
    yield
    torch.set_float32_matmul_precision(legacy)
    for mod, name, value in saved:
        setattr(mod, name, value)


def _set_medium() -> None:
    torch.set_float32_matmul_precision("medium")


def _set_high() -> None:
    torch.set_float32_matmul_precision("high")


def _set_legacy_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True


def _set_mkldnn_bf16() -> None:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


def _set_global_tf32() -> None:
    torch.backends.fp32_precision = "tf32"


NEW_API = hasattr(torch.backends, "fp32_precision") and hasattr(torch.backends.mkldnn, "matmul")
# (setting, whether it rounds a CPU matmul, whether it rounds a CUDA one)
SETTINGS: dict[str, tuple[Callable[[], None], bool, bool]] = {
    "default": (lambda: None, False, False),
    "medium": (_set_medium, True, True),
    "high": (_set_high, True, True),
    "legacy allow_tf32": (_set_legacy_tf32, False, True),
}
if NEW_API:
    SETTINGS |= {"mkldnn matmul bf16": (_set_mkldnn_bf16, True, False), "global tf32": (_set_global_tf32, True, True)}
ROUNDING = [name for name, (_, cpu, _cuda) in SETTINGS.items() if cpu]


def _cutmix_map(seed: int = 0, token_maps: bool = False) -> TokenLabelMap:
    """CutMix boxes of varied sizes on a 14x14 grid, 1000 classes, label smoothing 0.1: weights like 97/196 that no
    bf16 or TF32 input holds exactly."""
    g = torch.Generator().manual_seed(seed)
    y0, x0 = torch.randint(0, 10, (B,), generator=g), torch.randint(0, 10, (B,), generator=g)
    hh, ww = torch.randint(1, 5, (B,), generator=g), torch.randint(1, 5, (B,), generator=g)
    boxes = torch.stack([y0, y0 + hh, x0, x0 + ww], dim=1)
    labels = torch.randint(0, C, (B,), generator=g)
    lm = TokenLabelMap.from_boxes(boxes, GRID, torch.randperm(B, generator=g), labels, C, label_smoothing=0.1, image_size=(224, 224))
    if token_maps:
        lm = lm.with_token_targets(torch.rand(B, *GRID, C, generator=g).softmax(-1))
    return lm


def _exact(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[..., k] * values[..., k, :]`` in float64: ``weights`` ``(b, n, k)``, ``values`` ``(b, [n,] k, c)``."""
    values = values.double() if values.ndim == 4 else values.double().unsqueeze(1)
    return (weights.double().unsqueeze(-1) * values).sum(-2)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_route_reads_the_callers_precision(setting: str) -> None:
    apply, on_cpu, on_cuda = SETTINGS[setting]
    apply()
    assert rounding_matmuls(CPU) is on_cpu
    assert rounding_matmuls(CUDA) is on_cuda  # the switches are global: read without a GPU
    assert not rounding_matmuls(META)  # nothing to round: the matmul's shapes
    assert rounding_matmuls(torch.device("mps"))  # settings this cannot read: the exact route


@pytest.mark.parametrize("setting", ROUNDING)
def test_image_targets_are_exact_under_a_rounding_precision(setting: str) -> None:
    lm = _cutmix_map()
    want = _exact(lm.image_weights.unsqueeze(1), lm.source_targets())[:, 0]
    g = torch.Generator().manual_seed(1)
    a, b = torch.rand(64, 64, generator=g), torch.rand(64, 64, generator=g)
    product = a @ b
    SETTINGS[setting][0]()
    got = lm.image_targets()
    assert got.dtype == torch.float32 and got.shape == (B, C)
    assert_close(got.double(), want, rtol=0, atol=1e-7)  # one fp32 rounding of values at most 1
    # the case caught: where this CPU's kernels do round under the setting (bf16 ones: AMX, AVX512-BF16), the plain
    # matmul's targets move by far more than that
    if (a @ b - product).abs().max() > 1e-4:
        rounded = torch.bmm(lm.image_weights.unsqueeze(1), lm.source_targets())[:, 0]
        assert (rounded.double() - want).abs().max() > 1e-5


@pytest.mark.parametrize("setting", ROUNDING)
def test_token_targets_are_exact_under_a_rounding_precision(setting: str) -> None:
    """Per-token expansions (the trackers' ``finish``, TokenLabeling's patch labels) and the annotator maps mixed
    like the tokens."""
    lm = _cutmix_map(token_maps=True)
    weights = lm.token_weights(GRID)  # b n k
    want = _exact(weights, lm.source_targets())
    maps = lm.token_targets
    assert maps is not None
    per_source = maps.reshape(B, -1, C)[lm.sources]  # b k n c
    want_maps = _exact(weights, per_source.transpose(1, 2)) * (1 - lm.label_smoothing) + lm.label_smoothing / C  # b n c
    SETTINGS[setting][0]()
    assert_close(lm.targets(weights).double(), want, rtol=0, atol=1e-7)
    assert_close(lm.mixed_token_targets(GRID).double(), want_maps, rtol=0, atol=1e-7)


def test_the_default_keeps_the_matmul_and_its_bits() -> None:
    """At the default precision nothing changes: the expansion is the matmul (the CPU's bits; one operator)."""
    lm = _cutmix_map(token_maps=True)
    weights = lm.token_weights(GRID)
    assert torch.equal(lm.targets(weights), torch.bmm(weights, lm.source_targets()))
    assert torch.equal(lm.image_targets(), torch.bmm(lm.image_weights.unsqueeze(1), lm.source_targets())[:, 0])
    maps = lm.token_targets
    assert maps is not None
    want = torch.einsum("bknc,bnk->bnc", maps.reshape(B, -1, C)[lm.sources], weights)
    assert torch.equal(lm.mixed_token_targets(GRID), want * (1 - lm.label_smoothing) + lm.label_smoothing / C)


def test_a_compiled_expansion_traces_whole_and_is_exact() -> None:
    """The precision getters do not trace: a compiled graph takes the exact products whatever the setting, with no
    graph break (fullgraph), and equals the float64 product."""
    lm = _cutmix_map()
    weights = lm.token_weights(GRID)
    compiled = torch.compile(lm.targets, fullgraph=True, backend="eager")
    torch.set_float32_matmul_precision("medium")
    assert_close(compiled(weights).double(), _exact(weights, lm.source_targets()), rtol=0, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_targets_are_exact_with_tf32_on() -> None:
    """TF32 as timm-style scripts set it: a GPU's CutMix targets as exact as the CPU's."""
    lm = _cutmix_map(token_maps=True).to("cuda")
    weights = lm.token_weights(GRID)
    want = _exact(weights, lm.source_targets())
    torch.backends.cuda.matmul.allow_tf32 = True
    assert rounding_matmuls(CUDA)
    assert_close(lm.targets(weights).double(), want, rtol=0, atol=1e-7)
    assert_close(lm.image_targets().double(), _exact(lm.image_weights.unsqueeze(1), lm.source_targets())[:, 0], rtol=0, atol=1e-7)
