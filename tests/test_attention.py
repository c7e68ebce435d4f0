"""The fused attention kernels: what the widened forward keeps for the backward, and its device kernels.

The CUDA flash kernel cannot run here; its plumbing (the private ops' argument order,
the shapes handed from forward to backward) runs on the meta device, and its numbers
in a GPU-only test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from mixlabels.backbones import attention_with_labels
from mixlabels.backbones._common import launch_routes
from mixlabels.backbones._attention import (
    _CPU,
    _CUDA_EFFICIENT,
    _CUDA_FLASH,
    _CUDNN_WIDER_V,
    ROUTES,
    _Kernel,
    _WidenedForward,
    _head_mean,
    attention_route,
    widened_autograd,
)

B, H, N, D, L = 2, 3, 10, 16, 2


def qkv_labels(
    device: str = "cpu", dtype: torch.dtype = torch.float32, timm_layout: bool = True, d: int = D
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(b, h, n, d)`` q, k, v (views of one ``(b, n, 3, h, d)`` tensor, as timm's qkv gives them, or
    contiguous) needing grad, and ``(b, n, l)`` labels."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, N, 3, H, d, generator=gen).to(device, dtype).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0) if timm_layout else (t.contiguous() for t in qkv.permute(2, 0, 3, 1, 4))
    labels = torch.rand(B, N, L, generator=gen).softmax(-1).to(device)
    return q, k, v, labels


def saved_by(fn: object) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """Shape, strides and dtype of every tensor autograd keeps for the backward while ``fn`` runs."""
    kept: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = []

    def pack(t: Tensor) -> Tensor:
        kept.append((tuple(t.shape), t.stride(), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return sorted(kept, key=str)


@pytest.mark.parametrize("timm_layout", [True, False])
def test_cpu_fast_path_keeps_what_plain_attention_keeps(timm_layout: bool) -> None:
    """Same tensors, shapes and layouts as plain SDPA keeps: the widened forward adds no memory to the step."""
    q, k, v, labels = qkv_labels(timm_layout=timm_layout)
    plain = saved_by(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.3))
    ours = saved_by(lambda: attention_with_labels(q, k, v, labels, scale=0.3))
    assert ours == plain
    with widened_autograd():
        widened = saved_by(lambda: attention_with_labels(q, k, v, labels, scale=0.3))
    assert widened != plain  # the check can fail: autograd through the widened call keeps wider tensors


def test_widened_autograd_route_gives_the_fast_paths_results() -> None:
    """The route of devices without a fused kernel (and speed.py's ``tlalign-widened``): same numbers."""
    q, k, v, labels = qkv_labels()
    out, mixed = attention_with_labels(q, k, v, labels, scale=0.3)
    with widened_autograd():
        out_w, mixed_w = attention_with_labels(q, k, v, labels, scale=0.3)
    assert_close(out_w, out)
    assert_close(mixed_w, mixed)
    g = torch.randn_like(out)
    assert_close(torch.autograd.grad(out_w, (q, k, v), g), torch.autograd.grad(out, (q, k, v), g))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("masked", [False, True])
def test_every_route_equals_the_explicit_reference(route: str, masked: bool) -> None:
    """Each route (the device default and its tested fallbacks): plain SDPA's output and gradients, and
    the labels mixed by the explicit head-mean attention matrix; ``m != n`` as in a spatial reduction."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, N, D, generator=gen).mul_(3.0).requires_grad_()  # sharp: the labels move
    k, v = (torch.randn(B, H, 7, D, generator=gen).requires_grad_() for _ in range(2))
    labels = torch.rand(B, 7, L, generator=gen).softmax(-1)
    mask = torch.randn(1, H, N, 7, generator=gen) if masked else None
    with attention_route(route):  # type: ignore[arg-type]
        out, mixed = attention_with_labels(q, k, v, labels, scale=D**-0.5, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5)
    a = torch.softmax(q.detach() @ k.detach().transpose(-1, -2) * D**-0.5 + (0 if mask is None else mask), -1)
    assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close(mixed, a.mean(1) @ labels, atol=1e-5, rtol=1e-5)
    assert (mixed - labels.mean(1, keepdim=True)).abs().max() > 0.05  # the check can fail: the labels moved
    assert not mixed.requires_grad
    g = torch.randn_like(ref)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_unknown_route_is_refused() -> None:
    with pytest.raises(ValueError, match="no attention route; choose one of widened, separate"):
        with attention_route("flash"):  # type: ignore[arg-type]
            pass


def test_cpu_kernel_gradients_equal_plain_attention() -> None:
    q, k, v, labels = qkv_labels()
    out, mixed = _WidenedForward.apply(q, k, v, labels, 0.3, _CPU)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert_close(out, ref)
    a = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1)
    assert_close(mixed, (a.detach() @ labels[:, None]).mean(dim=1))  # the head mean, b n l
    assert mixed.dtype == torch.float32 and not mixed.requires_grad
    g = torch.randn_like(ref)
    assert_close(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g))


@pytest.mark.parametrize("kernel, dtype", [(_CUDA_FLASH, torch.bfloat16), (_CUDA_EFFICIENT, torch.float32)])
def test_cuda_kernel_plumbing_on_meta(kernel: _Kernel, dtype: torch.dtype) -> None:
    """Runs a CUDA kernel's forward and backward ops on meta tensors: argument order and shapes."""
    q, k, v = (torch.empty(B, H, N, 64, device="meta", dtype=dtype, requires_grad=True) for _ in range(3))
    labels = torch.empty(B, N, L, device="meta")
    kept = saved_by(lambda: _WidenedForward.apply(q, k, v, labels, 0.125, kernel))
    # q, k, v, the output's first d channels and the log-sum-exp: nothing widened (64 + 2 -> 72)
    assert sorted(s for s, _, _ in kept if len(s) == 4) == [(B, H, N, 64)] * 4
    assert [s[:2] for s, _, _ in kept if len(s) == 3] == [(B, H)]
    out, mixed = _WidenedForward.apply(q, k, v, labels, 0.125, kernel)
    assert out.shape == (B, H, N, 64) and out.transpose(1, 2).is_contiguous()  # b n h d, as the kernel's own
    assert mixed.shape == (B, N, L) and mixed.dtype == torch.float32 and not mixed.requires_grad  # the head mean
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert gq.shape == gk.shape == gv.shape == (B, H, N, 64)
    assert gq.dtype == gk.dtype == gv.dtype == dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("route", ["widened", "separate"])
@pytest.mark.parametrize(
    "dtype, backend", [(torch.bfloat16, "FLASH_ATTENTION"), (torch.float32, "EFFICIENT_ATTENTION")]
)
def test_cuda_path_equals_plain_attention_and_keeps_no_more(dtype: torch.dtype, backend: str, route: str) -> None:
    """Each CUDA route keeps what the plain call it stands for keeps: the widened route runs the raw kernel
    SDPA's ``backend`` runs; the separate route is plain SDPA by its own backend choice (on an H100 with
    torch 2.11 that is cuDNN's, whose log-sum-exp is ``b h n 1``) plus a label call that keeps nothing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mixlabels.backbones._attention import _cuda_kernel

    q, k, v, labels = qkv_labels("cuda", dtype, d=64)  # DeiT's head dim
    assert _cuda_kernel(q, k, v, labels) is {torch.bfloat16: _CUDA_FLASH, torch.float32: _CUDA_EFFICIENT}[dtype]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    with attention_route(route):  # type: ignore[arg-type]
        out, mixed = attention_with_labels(q, k, v, labels, scale=0.125)
        ours_kept = saved_by(lambda: attention_with_labels(q, k, v, labels, scale=0.125))
    with sdpa_kernel(getattr(SDPBackend, backend)):  # the kernel the widened route runs
        ref = F.scaled_dot_product_attention(q, k, v, scale=0.125)
        plain = saved_by(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125))
    if route == "separate":
        plain = saved_by(lambda: F.scaled_dot_product_attention(q, k, v, scale=0.125))
    assert_plain_and_explicit(out, mixed, ref, (q, k, v), labels, tol)
    # q, k, v, out and the log-sum-exp, in the same layouts (the rest: the kernel's RNG state)
    assert [x for x in ours_kept if len(x[0]) >= 3] == [x for x in plain if len(x[0]) >= 3]


def assert_plain_and_explicit(
    out: Tensor, mixed: Tensor, ref: Tensor, qkv: tuple[Tensor, Tensor, Tensor], labels: Tensor, tol: float
) -> None:
    """``out`` is plain SDPA's ``ref`` (scale 0.125), with its gradients, and ``mixed`` the labels mixed by the
    explicit head-mean attention matrix."""
    q, k, _ = qkv
    assert_close(out, ref, atol=tol, rtol=tol)
    a = torch.softmax(q.float() @ k.float().transpose(-1, -2) * 0.125, -1).mean(1)
    assert_close(mixed, a.detach() @ labels, atol=tol, rtol=tol)
    g = torch.randn_like(ref)
    for ours, theirs in zip(torch.autograd.grad(out, qkv, g), torch.autograd.grad(ref, qkv, g)):
        assert_close(ours, theirs, atol=tol, rtol=tol)


def _bias(requires_grad: bool, shape: tuple[int, ...] = (1, H, N, N)) -> Tensor:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(*shape, generator=gen) * 2).requires_grad_(requires_grad)


@pytest.mark.parametrize("shape", [(1, H, N, N), (B, 1, N, N), (N, N)])
def test_masked_fast_path_equals_sdpa_and_keeps_what_it_keeps(shape: tuple[int, ...]) -> None:
    """A mask that needs no gradient (Swin's shift mask, any bias at eval) takes the forward-only fused route."""
    q, k, v, labels = qkv_labels()
    mask = _bias(False, shape)
    out, mixed = attention_with_labels(q, k, v, labels, scale=0.3, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert_close(out, ref)
    a = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + mask, -1).mean(1)
    assert_close(mixed, a.detach() @ labels)
    unmasked = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1).mean(1)
    assert (mixed - unmasked.detach() @ labels).abs().max() > 1e-3  # the mask reached the labels
    g = torch.randn_like(ref)
    assert_close(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g))
    plain = saved_by(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3))
    assert saved_by(lambda: attention_with_labels(q, k, v, labels, scale=0.3, attn_mask=mask)) == plain


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("route", ROUTES)
def test_learnable_bias_gets_its_gradient_and_mixes_the_labels(route: str, device: str) -> None:
    """A bias that needs a gradient (a relative position bias in training), whatever route is chosen: on the CPU
    through the matrix, like SDPA's math path; on CUDA plain SDPA (its efficient kernel returns the bias's gradient)."""
    q, k, v, labels = (t.detach().to(device).requires_grad_(t.requires_grad) for t in qkv_labels())
    bias = _bias(True).detach().to(device).requires_grad_()
    with attention_route(route):  # type: ignore[arg-type]
        out, mixed = attention_with_labels(q, k, v, labels, scale=0.3, attn_mask=bias)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    tol = {"atol": 1e-4, "rtol": 1e-4} if device == "cuda" else {}  # CUDA's kernels sum in their own order
    assert_close(out, ref, **tol)  # type: ignore[arg-type]
    a = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, -1).mean(1)
    assert_close(mixed, a.detach() @ labels, **tol)  # type: ignore[arg-type]
    assert not mixed.requires_grad
    g = torch.randn_like(ref)
    ours, theirs = torch.autograd.grad(out, (q, k, v, bias), g), torch.autograd.grad(ref, (q, k, v, bias), g)
    assert theirs[3].abs().max() > 0  # the check can fail: the bias has a gradient to lose
    assert_close(ours, theirs, **tol)  # type: ignore[arg-type]


def test_masked_attention_with_dropout_mixes_labels_by_the_undropped_masked_attention() -> None:
    q, k, v, labels = qkv_labels()
    mask = _bias(False)
    torch.manual_seed(3)
    out, mixed = attention_with_labels(q, k, v, labels, scale=0.3, dropout_p=0.5, attn_mask=mask)
    torch.manual_seed(3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5, scale=0.3)
    assert_close(out, ref)
    a = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + mask, -1).mean(1)
    assert_close(mixed, a.detach() @ labels)


def test_bool_mask_is_refused() -> None:
    q, k, v, labels = qkv_labels()
    with pytest.raises(TypeError, match="additive float mask"):
        attention_with_labels(q, k, v, labels, scale=0.3, attn_mask=torch.ones(N, N, dtype=torch.bool))


def test_cudnn_wider_v_plumbing_on_meta() -> None:
    """cuDNN's forward with q and k at their head dim and v widened by the labels (64 + 2 -> 72), and its backward
    at 64, on meta tensors: argument order and shapes; the step keeps nothing widened."""
    q, k, v = (torch.empty(B, H, N, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    labels = torch.empty(B, N, L, device="meta")
    kept = saved_by(lambda: _WidenedForward.apply(q, k, v, labels, 0.125, _CUDNN_WIDER_V))
    assert sorted(s for s, _, _ in kept if len(s) == 4 and s[-1] != 1 and s[0] == B) == [(B, H, N, 64)] * 4
    assert [s for s, _, _ in kept if len(s) == 4 and s[-1] == 1] == [(B, H, N, 1)]  # cuDNN's log-sum-exp
    out, mixed = _WidenedForward.apply(q, k, v, labels, 0.125, _CUDNN_WIDER_V)
    assert out.shape == (B, H, N, 64) and mixed.shape == (B, N, L) and mixed.dtype == torch.float32
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert gq.shape == gk.shape == gv.shape == (B, H, N, 64) and gq.dtype == torch.bfloat16


def _math_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, tuple[Any, ...]]:
    """A stand-in for cuDNN's forward on the CPU (the raw op runs on CUDA alone): q and k must come at their own head
    dim and v wider, as the ``wider-v`` route hands them, and no mask; output and log-sum-exp by the explicit matrix,
    handed on as cuDNN's are (log-sum-exp, no cumulative lengths, the two lengths, the RNG seed and offset)."""
    assert q.shape[-1] == k.shape[-1] < v.shape[-1] and mask is None
    s = q @ k.transpose(-1, -2) * scale
    lse = s.logsumexp(-1, keepdim=True)
    return (s - lse).exp() @ v, (lse, None, None, q.shape[2], k.shape[2], torch.zeros(()), torch.zeros(()))


def _math_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, saved: tuple[Any, ...], scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The stand-in's backward at the original width: the softmax from the wide call's log-sum-exp, which reads q and
    k alone, and ``out`` the wide output's first d channels (the gradient of q needs both)."""
    lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
    assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[2], k.shape[2]) and seed.shape == ()
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] == out.shape[-1] and mask is None
    a = (q @ k.transpose(-1, -2) * scale - lse).exp()
    ga = grad @ v.transpose(-1, -2)
    gs = a * (ga - (grad * out).sum(-1, keepdim=True)) * scale
    return gs @ k, gs.transpose(-1, -2) @ q, a.transpose(-1, -2) @ grad


def test_wider_v_route_with_a_stand_in_kernel_equals_plain_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``wider-v`` route's own plumbing on the CPU, with its cuDNN ops replaced by the explicit math of the same
    contract: q and k reach the kernel unpadded, v with the labels appended; out, gradients and labels are plain
    attention's and the explicit head-mean matrix's."""
    import mixlabels.backbones._attention as attention

    stand_in = _CUDNN_WIDER_V._replace(forward=_math_forward, backward=_math_backward)
    monkeypatch.setattr(attention, "_wider_v_kernel", lambda *args: stand_in)
    q, k, v, labels = qkv_labels()
    with attention_route("wider-v"):
        out, mixed = attention_with_labels(q, k, v, labels, scale=0.125)
    assert_plain_and_explicit(out, mixed, F.scaled_dot_product_attention(q, k, v, scale=0.125), (q, k, v), labels, 1e-5)


def test_wider_v_route_compiles_whole_with_a_stand_in_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled with ``fullgraph=True`` (dynamo and AOT autograd), the route's forward (q and k unpadded, v widened)
    and its backward trace whole and give eager's output, labels and gradients."""
    import mixlabels.backbones._attention as attention

    picked: list[bool] = []

    def pick(*args: object) -> _Kernel:
        picked.append(True)
        return _CUDNN_WIDER_V._replace(forward=_math_forward, backward=_math_backward)  # asserts q and k unpadded

    monkeypatch.setattr(attention, "_wider_v_kernel", pick)
    q, k, v, labels = qkv_labels()

    def call(q: Tensor, k: Tensor, v: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        out, mixed = attention_with_labels(q, k, v, labels, scale=0.125)
        return out, mixed

    torch._dynamo.reset()
    with attention_route("wider-v"):
        want = call(q, k, v, labels)
        got = torch.compile(call, backend="aot_eager", fullgraph=True)(q, k, v, labels)
    assert len(picked) >= 2  # eager's call, then the trace's: the stand-in kernel, not the separate route
    for ours, theirs in zip(got, want):
        assert_close(ours, theirs)
    g = torch.randn_like(want[0])
    assert_close(torch.autograd.grad(got[0], (q, k, v), g), torch.autograd.grad(want[0], (q, k, v), g))


@pytest.mark.parametrize(
    "asks, probe, answer",
    [("_cudnn_takes", "_cudnn_probe", True), ("_cuda_kernel_name", "_cuda_probe", "flash")],
)
def test_a_cuda_probe_runs_once_while_tracing_its_answer_a_constant_of_the_graph(
    asks: str, probe: str, answer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe (tensors made, SDPA's checks) is no traceable op: under ``torch.compile`` it runs once, at the trace,
    and the graph keeps its answer; ``fullgraph=True`` holds (no break at the probe). The wider-v route's cuDNN
    probe, and the widened route's flash/efficient one."""
    import mixlabels.backbones._attention as attention

    asked: list[tuple[object, ...]] = []

    def stub(*args: object) -> object:
        asked.append(args)
        return answer

    monkeypatch.setattr(attention, probe, stub)
    ask = getattr(attention, asks)

    def f(x: Tensor) -> Tensor:
        if asks == "_cudnn_takes":
            got = ask(x.dtype, (64, 72), (int(x.shape[0]), int(x.shape[0])), x.requires_grad, None)
        else:
            got = ask(x.dtype, (72, 64), x.requires_grad, False, None)
        return x * 2 if got == answer else x * 3

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.ones(5, 4)
    assert torch.equal(compiled(x), x * 2) and torch.equal(compiled(x), x * 2)
    assert len(asked) == 1 and asked[0][0] == torch.float32


def test_wider_v_route_without_cudnn_is_the_separate_route() -> None:
    """Where cuDNN takes no wider v (here: the CPU), ``wider-v`` mixes the labels in their own call, as ``separate``:
    the same numbers and the same tensors kept."""
    q, k, v, labels = qkv_labels()
    results, kept = {}, {}
    for route in ("wider-v", "separate"):
        with attention_route(route):  # type: ignore[arg-type]
            results[route] = attention_with_labels(q, k, v, labels, scale=0.3)
            kept[route] = saved_by(lambda: attention_with_labels(q, k, v, labels, scale=0.3))
    assert torch.equal(results["wider-v"][0], results["separate"][0])
    assert torch.equal(results["wider-v"][1], results["separate"][1])
    assert kept["wider-v"] == kept["separate"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_wider_v_route_runs_cudnn_where_it_takes_the_head_dims(dtype: torch.dtype) -> None:
    """On a GPU whose cuDNN takes q and k at 64 with v at 72, the route runs cuDNN's raw ops (not the fallback): plain
    SDPA's output and gradients, the explicit labels, and q, k, v, out and a log-sum-exp kept, nothing widened."""
    from mixlabels.backbones._attention import _wider_v_kernel

    q, k, v, labels = _cuda_case(64, 197, 197, dtype)
    if _wider_v_kernel(q, k, v, labels) is None:
        pytest.skip(f"this GPU's cuDNN takes no v wider than q and k ({dtype}, torch {torch.__version__}): the route is separate")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    with attention_route("wider-v"):
        out, mixed = attention_with_labels(q, k, v, labels, scale=0.125)
        kept = saved_by(lambda: attention_with_labels(q, k, v, labels, scale=0.125))
    assert_plain_and_explicit(out, mixed, F.scaled_dot_product_attention(q, k, v, scale=0.125), (q, k, v), labels, tol)
    assert all(s[-1] in (64, 1) for s, _, _ in kept if len(s) == 4)


def test_cuda_efficient_kernel_with_mask_plumbing_on_meta() -> None:
    """The efficient kernel's forward and backward ops with an (unaligned, broadcast) bias, on meta tensors."""
    q, k, v = (torch.empty(B, H, N, 64, device="meta", requires_grad=True) for _ in range(3))
    labels = torch.empty(B, N, L, device="meta")
    mask = torch.empty(1, H, N, N, device="meta")  # N = 10: rows padded to 16 elements, then sliced
    out, mixed = _WidenedForward.apply(q, k, v, labels, 0.125, _CUDA_EFFICIENT, mask)
    assert out.shape == (B, H, N, 64) and out.transpose(1, 2).is_contiguous()
    assert mixed.shape == (B, N, L) and mixed.dtype == torch.float32
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert gq.shape == gk.shape == gv.shape == (B, H, N, 64)


def _cuda_case(d: int, n: int, m: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, n, d, generator=gen).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(B, H, m, d, generator=gen).to("cuda", dtype).requires_grad_() for _ in range(2))
    labels = torch.rand(B, m, L, generator=gen).softmax(-1).cuda()
    return q, k, v, labels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(
    "d, n, m, dtype, masked",
    [
        (256, 197, 197, torch.bfloat16, False),  # flash may refuse 256 for the backward: efficient or widened
        (64, 197, 197, torch.float16, False),
        (64, 197, 49, torch.bfloat16, False),  # unequal query and key lengths (PVT's reduction, CaiT)
        (64, 1, 197, torch.float32, False),  # one query (class attention)
        (20, 50, 50, torch.bfloat16, False),  # head dim no multiple of 8: the backward's check must refuse flash
        (20, 50, 50, torch.float32, False),
        (32, 49, 49, torch.float32, True),  # a window with a bias
        (32, 49, 49, torch.bfloat16, True),
    ],
)
@pytest.mark.parametrize("route", ROUTES)
def test_cuda_routes_equal_plain_attention(d: int, n: int, m: int, dtype: torch.dtype, masked: bool, route: str) -> None:
    q, k, v, labels = _cuda_case(d, n, m, dtype)
    mask = torch.randn(1, H, n, m, device="cuda", dtype=dtype) if masked else None
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with attention_route(route):  # type: ignore[arg-type]
        out, mixed = attention_with_labels(q, k, v, labels, scale=d**-0.5, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5)
    assert_close(out, ref, atol=tol, rtol=tol)
    scores = q.float() @ k.float().transpose(-1, -2) * d**-0.5 + (0 if mask is None else mask.float())
    assert_close(mixed, torch.softmax(scores, -1).mean(1).detach() @ labels, atol=tol, rtol=tol)
    g = torch.randn_like(ref)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert_close(ours, theirs, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_bf16_autocast_over_fp32_weights() -> None:
    q, k, v, labels = _cuda_case(64, 197, 197, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, mixed = attention_with_labels(q, k, v, labels, scale=0.125)
        ref = F.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out, ref, atol=3e-2, rtol=3e-2)
    g = torch.randn_like(ref)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert ours.dtype == theirs.dtype == torch.float32
        assert_close(ours, theirs, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_head_dim_20_takes_no_fused_kernel(dtype: torch.dtype) -> None:
    """SDPA pads a head dim of 20 for its own kernels, so ``can_use_flash_attention`` says yes (torch 2.11 on an
    H100), but the raw backward ops refuse it ("head_size should be a multiple of 8"): autograd route."""
    from mixlabels.backbones._attention import _cuda_kernel

    q, k, v, labels = _cuda_case(20, 50, 50, dtype)
    assert _cuda_kernel(q, k, v, labels) is None


@pytest.mark.parametrize("masked", [False, True])
def test_dropout_route_mixes_labels_by_the_undropped_attention_at_the_modules_scale(masked: bool) -> None:
    """``dropout_p > 0``: the output is sdpa's dropped attention (same RNG draw), the labels follow
    ``mean_h(softmax(q k^T * scale)) @ labels`` without dropout, at the module's scale (not the widened dim's)."""
    q, k, v, labels = qkv_labels()
    scale = 0.37  # neither 1/sqrt(D) nor 1/sqrt(widened dim): a default scale anywhere shows
    bias = torch.randn(1, H, N, N, generator=torch.Generator().manual_seed(1)) if masked else None
    torch.manual_seed(7)
    out, mixed = attention_with_labels(q, k, v, labels, scale, dropout_p=0.5, attn_mask=bias)
    torch.manual_seed(7)
    want_out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.5, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale + (bias if bias is not None else 0.0)
    want_mixed = scores.softmax(-1).mean(1) @ labels  # b n l: explicit, undropped
    assert_close(out, want_out)
    assert_close(mixed, want_mixed.detach())
    undropped = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    assert not torch.allclose(out, undropped)  # dropout did act on the output


def test_vit_with_attention_dropout_in_train_mode_aligns_labels_by_the_undropped_attention() -> None:
    """A one-block ViT with attn_drop_rate > 0: in train mode its first attention (computed before any
    dropout) must move labels exactly as in eval mode and as the explicit reference does."""
    import timm

    import mixlabels
    from mixlabels.backbones import adapt

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16,
                              depth=1, num_heads=2, num_classes=5, attn_drop_rate=0.5)
    assert model.blocks[0].attn.fused_attn  # the fused route, where dropout takes the second call
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    mask = torch.rand(4, 4, 4, generator=torch.Generator().manual_seed(3)) < 0.5
    lm = mixlabels.TokenLabelMap.from_mask(mask, torch.tensor([3, 2, 1, 0]), torch.tensor([0, 1, 2, 4]), 5, image_size=(16, 16))
    fast, ref = adapt(model, mixlabels.TLAlign()), adapt(model, mixlabels.TLAlign(), reference=True)
    model.train()
    torch.manual_seed(11)
    trained = fast(images, lm)
    model.eval()
    evaluated, explicit = fast(images, lm), ref(images, lm)
    assert not torch.allclose(trained.logits, evaluated.logits)  # dropout acted in train mode
    assert_close(evaluated.target, explicit.target)
    assert_close(trained.target, explicit.target)


class _Ops(TorchDispatchMode):
    """The names of the operators dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("tokens, labels, d", [(7, 1, 16), (65, 2, 32), (401, 3, 32), (197, 5, 64)])
def test_head_mean_of_the_wide_output_has_means_bits(heads: int, tokens: int, labels: int, d: int) -> None:
    """The widened forward's head mean of the label columns (strided: ``l`` of each row's ``d + l`` channels): the
    CPU adds a few heads' slices in turn (``mean``'s strided reduction takes a slow loop there), with the same bits
    as ``mean``; with more heads, and under ``launch_routes`` (a GPU's one reduction), ``mean`` itself; one head's
    columns are a view of the output on every route."""
    g = torch.Generator().manual_seed(heads * tokens + labels)
    q, k, v = (torch.randn(3, heads, tokens, d + labels, generator=g) for _ in range(3))
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=0.2)
    cols = out[..., d:]
    assert not cols.is_contiguous()
    want = cols.mean(dim=1, dtype=torch.float32)
    with _Ops() as ops:
        got = _head_mean(cols)
    assert torch.equal(got, want)
    if heads == 1:  # one head on every route: its columns as they lie, a view (no operator computes)
        assert ops.seen == ["select.int"] and got.data_ptr() == cols.data_ptr()
    else:
        assert ("mean.dim" in ops.seen) == (heads > 4)
    with launch_routes(), _Ops() as ops:
        got = _head_mean(cols)
    assert torch.equal(got, want) and ops.seen == (["select.int"] if heads == 1 else ["mean.dim"])
    for contiguous in (cols.contiguous(), cols.bfloat16().float()):  # the other routes' slices, an autocast one's
        assert torch.equal(_head_mean(contiguous), contiguous.mean(dim=1))
