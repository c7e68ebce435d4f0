"""Fused attention that also mixes labels, the class-token attention row, and stochastic depth.

Shapes: ``b`` batch, ``h`` heads, ``n`` tokens, ``d`` head dim, ``l`` label channels.

The head mean of attention times labels is ``mean_h(A_h Y)``, and ``A_h Y`` is what
attention computes when ``Y`` is appended to ``V`` as extra value channels. So one
fused ``scaled_dot_product_attention`` call with ``q`` and ``k`` zero-padded to the
widened head dim yields both the output and the aligned labels; no ``(b, h, n, n)``
matrix ever exists. Two traps: the padded call must be given the ORIGINAL scale
(the default would use the widened dim), and the CPU fused kernel needs q, k, v of
equal head dim (else it falls back to the math path, which builds the matrix).

Labels carry no gradient, so only the forward runs widened: with the CPU fused kernel
and CUDA's flash (bf16/fp16) and memory-efficient (fp32, and any additive mask) kernels
the backward is the ordinary kernel's, fed the widened call's log-sum-exp. Elsewhere
autograd runs through the widened call.

An additive mask or bias (a shift mask, a relative position bias) takes the same route
while it needs no gradient. A learnable bias that needs one makes plain SDPA on the CPU
take its math path (no CPU kernel returns a mask's gradient), which builds the attention
matrix anyway: there the labels are mixed by that same matrix (``explicit_attention``).
On CUDA the memory-efficient kernel returns the bias's gradient, so there such a bias
takes the ``separate`` route whatever route is chosen.

Routes. Where the labels are mixed is a choice per device (``ROUTES``; ``attention_route``
picks one for a block of code, ``MIXLABELS_ATTENTION_ROUTE`` for a process):

- ``"widened"``: the widened fused forward above, the ordinary backward (the CPU's default, and
  CUDA's with a mask).
- ``"separate"``: ordinary attention (autograd, whichever kernel SDPA picks) and the labels in
  a second, no-grad SDPA call whose values are the labels alone (``l`` channels padded to 8):
  CUDA's default without a mask, and under ``torch.compile`` on CUDA.
- ``"explicit"``: ordinary attention, and the labels by the explicit head-mean matrix
  ``mean_h(softmax(q k^T s + mask)) @ Y`` under no grad (short sequences: one small product).
- ``"wider-v"``: cuDNN's fused attention with the labels appended to v alone (q and k at their own head
  dim: no padding, and a kernel for DeiT's 64 where FlashAttention-2 runs 72 as 96), the ordinary cuDNN
  backward at the original width; without a mask, where cuDNN takes those head dims; else (the CPU, cuDNN
  off or too old, a mask) the ``separate`` route. A candidate the GPU suite times beside the others; chosen
  under ``torch.compile``, cuDNN's raw ops are in the graph (the probe ran once, at the trace).
- ``"widened-autograd"``: autograd through the widened call (devices without a fused kernel).

Every route gives the same ``out`` (the ordinary attention's) and the same labels up to the
compute dtype's rounding; ``benchmarks/gpu_suite.py`` measures them side by side. The widened
route's CUDA kernel choice depends only on dtypes, head dims and the SDPA settings, probed once
per combination and cached.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
import contextlib
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple, ParamSpec, TypeVar, cast, get_args

import torch
import torch.nn.functional as F
from einops import reduce, repeat
from torch import Tensor

from mixlabels._label_map import fp32_labels
from mixlabels._routes import eager_cpu_routes

__all__ = [
    "ROUTES",
    "Route",
    "attention_route",
    "attention_with_labels",
    "class_attention",
    "drop_path_with_keep",
    "explicit_mix",
    "widened_autograd",
]

Route = Literal["widened", "separate", "explicit", "wider-v", "widened-autograd"]
ROUTES: tuple[Route, ...] = get_args(Route)


def _default_route() -> Route | None:
    name = os.environ.get("MIXLABELS_ATTENTION_ROUTE", "")
    if not name:
        return None
    if name not in ROUTES:
        raise ValueError(f"MIXLABELS_ATTENTION_ROUTE={name!r} is no attention route; choose one of {', '.join(ROUTES)}")
    return ROUTES[ROUTES.index(name)]  # the Route equal to name, checked above


# Module state, not a ContextVar: torch.compile reads (and guards on) a module global on every torch
# version, where torch 2.11's dynamo breaks the graph at ``ContextVar.get``.
_chosen: list[Route | None] = [_default_route()]


@contextmanager
def attention_route(route: Route) -> Iterator[None]:
    """Inside, ``attention_with_labels`` mixes the labels by ``route`` (see the module's docstring) on
    every device: what the benchmarks and the route tests use. Outside, the device's default."""
    if route not in ROUTES:
        raise ValueError(f"{route!r} is no attention route; choose one of {', '.join(ROUTES)}")
    before = _chosen[0]
    _chosen[0] = route
    try:
        yield
    finally:
        _chosen[0] = before


def _route_for(q: Tensor, attn_mask: Tensor | None) -> Route:
    """The route chosen (``attention_route``), else the device's default, by measurement (H100, bf16,
    forward + backward, ``benchmarks/gpu_suite.py``): on CUDA ``separate`` without a mask (DeiT-S's
    shape: 0.84 ms against the widened call's 1.09) and ``widened`` with one (Swin's shifted windows:
    2.95 against 3.89); compiled on CUDA ``separate``, two plain SDPA calls that every torch version
    traces (a chosen route traces too: its kernel probe runs once, at the trace, unmeasured compiled on a
    GPU so far); elsewhere ``widened``."""
    if q.device.type == "cuda" and attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        # A learnable bias (MaxViT's, GCViT's relative positions): CUDA's memory-efficient kernel returns its
        # gradient, where the widened forward would drop it and the explicit matrix would be kept for the backward.
        return "separate"
    chosen = _chosen[0]
    if chosen is not None:
        return chosen
    if q.device.type == "cuda" and (attn_mask is None or torch.compiler.is_compiling()):
        return "separate"
    return "widened"


def widened_autograd() -> contextlib.AbstractContextManager[None]:
    """``attention_route("widened-autograd")``: the route of devices without a fused kernel for the
    widened forward (autograd through the widened call), on every device."""
    return attention_route("widened-autograd")


_Saved = tuple[Any, ...]  # what a kernel's forward hands to its backward besides q, k, v and out


class _Kernel(NamedTuple):
    """One device's fused attention forward (widened) and its ordinary backward.

    Both take an additive mask broadcastable to ``(b, h, n, m)`` (``None``: none), never one
    needing a gradient.
    """

    multiple: int  # head dims the kernel takes: a multiple of this
    tokens_outer: bool  # we store its output b n h d whatever q's layout (else in q's order)
    takes_mask: bool
    forward: Callable[[Tensor, Tensor, Tensor, Tensor | None, float], tuple[Tensor, _Saved]]
    backward: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor, _Saved, float], tuple[Tensor, Tensor, Tensor]]
    pads_qk: bool = True  # the forward takes q and k zero-padded to v's widened head dim (else at their own)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, _Saved]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return out, (lse,)


def _cpu_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, saved: _Saved, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    (lse,) = saved
    # the gradient as it comes (a strided view of the block's b n (h d) gradient): the CPU kernel reads any strides,
    # with the same bits as from a contiguous copy
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
    )
    return grads[0], grads[1], grads[2]


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, _Saved]:
    assert mask is None  # flash takes no mask: _cuda_kernel never picks it for one
    # out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug mask
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return res[0], tuple(res[1:8])


def _cuda_flash_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, saved: _Saved, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    lse, cum_q, cum_k, max_q, max_k, rng_state, unused = saved
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False, rng_state, unused, scale=scale
    )
    return grads[0], grads[1], grads[2]


_BIAS_ALIGNMENT = 16  # elements: the memory-efficient kernel reads the bias's rows at this alignment


def _efficient_bias(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    """The mask as the memory-efficient kernel takes it: 4-d ``(b, h, n, m)`` (broadcast by
    strides), in q's dtype, its rows aligned (padded, then sliced back), as SDPA prepares it."""
    if mask is None:
        return None
    b, h, n, m = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    bias = mask.to(q.dtype).expand(b, h, n, m)
    if m % _BIAS_ALIGNMENT:
        bias = F.pad(bias, (0, -m % _BIAS_ALIGNMENT))[..., :m]
    return bias


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, _Saved]:
    # out, lse (padded along n), philox seed, philox offset
    bias = _efficient_bias(mask, q, k)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=scale
    )
    return out, (lse, seed, offset)


def _cuda_efficient_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, saved: _Saved, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    lse, seed, offset = saved
    # The kernel derives out's strides from its (b, n, h, d) shape: the fresh b n h d copy
    # _WidenedForward stores is the layout it reads.
    assert out.transpose(1, 2).is_contiguous(), "the efficient backward reads out as a contiguous b n h d"
    bias = _efficient_bias(mask, q, k)
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale
    )
    return grads[0], grads[1], grads[2]


_CPU = _Kernel(1, False, True, _cpu_forward, _cpu_backward)
# CUDA's kernels take head dims in multiples of 8. We store both outputs as a fresh b n h d
# copy: the efficient backward requires that layout, and for timm's qkv it is the layout
# plain attention hands the block (its b n (h d) reshape is then a view).
_CUDA_FLASH = _Kernel(8, True, False, _cuda_flash_forward, _cuda_flash_backward)  # bf16 / fp16, no mask
_CUDA_EFFICIENT = _Kernel(8, True, True, _cuda_efficient_forward, _cuda_efficient_backward)  # fp32 too, masks


_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")


def _constant_while_tracing(probe: Callable[_Args, _Result]) -> Callable[_Args, _Result]:
    """``probe`` (a kernel probe: tensors made, SDPA's checks, no traceable op), which ``torch.compile`` runs once,
    while tracing, its answer a constant of the graph (``torch.compiler.assume_constant_result``): a graph compiled
    under some SDPA settings keeps the kernel they chose. Eager, the plain call."""
    return cast(Callable[_Args, _Result], torch.compiler.assume_constant_result(probe))  # type: ignore[no-untyped-call]


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, _Saved]:
    assert mask is None  # the wider-v route takes no mask: _wider_v_kernel never picks cuDNN for one
    # out, lse (b h n 1), cum_seq_q, cum_seq_k, max_q, max_k, philox seed, philox offset, debug mask
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
    return res[0], tuple(res[1:8])


def _cudnn_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, saved: _Saved, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
    # the log-sum-exp of the call with the wider v is the narrow call's (it reads q and k alone), and ``out`` the
    # wide output's first d channels, laid out as cuDNN lays out its own output (q's order; see _WidenedForward)
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, False, scale=scale
    )
    return grads[0], grads[1], grads[2]


# q and k at their own head dim, v (and the output) widened to a multiple of 8; the output stored in q's order
_CUDNN_WIDER_V = _Kernel(8, False, False, _cudnn_forward, _cudnn_backward, pads_qk=False)


def _wider_v_kernel(q: Tensor, k: Tensor, v: Tensor, labels: Tensor, mask: Tensor | None = None) -> _Kernel | None:
    """cuDNN's kernel, if it takes q and k at their head dim with v widened by the labels (the forward) and q, k
    and v at one (the backward), on these lengths, dtype and SDPA settings, without a mask (a shift mask or a bias:
    the widened route measured faster there, and cuDNN's bias layout rules are left untried); else ``None`` (the
    ``separate`` route)."""
    d = int(q.shape[-1])
    if q.device.type != "cuda" or mask is not None or d % 8 or int(k.shape[-1]) != d or int(v.shape[-1]) != d:
        return None
    dims, lengths = (d, _widened_dim(d, int(labels.shape[-1]), 8)), (int(q.shape[2]), int(k.shape[2]))
    ok = _cudnn_takes(_compute_dtype(q, k, v), dims, lengths, q.requires_grad, q.device.index)
    return _CUDNN_WIDER_V if ok else None


@_constant_while_tracing
def _cudnn_takes(
    dtype: torch.dtype, dims: tuple[int, int], lengths: tuple[int, int], requires_grad: bool, index: int | None
) -> bool:
    """``_cudnn_probe`` under the SDPA settings of now (under ``torch.compile``: of the trace)."""
    settings = (bool(torch.backends.cuda.cudnn_sdp_enabled()), index)  # type: ignore[no-untyped-call]
    return _cudnn_probe(dtype, dims, lengths, requires_grad, settings)


@functools.lru_cache(maxsize=64)
def _cudnn_probe(
    dtype: torch.dtype, dims: tuple[int, int], lengths: tuple[int, int], requires_grad: bool, settings: tuple[bool, int | None],
) -> bool:
    """Whether cuDNN takes q and k of head dim ``dims[0]`` with v of ``dims[1]`` (the forward) and all three of
    ``dims[0]`` (the backward), at these query and key lengths: probed once per combination on one-sample stand-ins
    (the checks read head dims, lengths, dtype, strides and the GPU, not the batch)."""
    if not settings[0]:
        return False
    device = torch.device("cuda", settings[1]) if settings[1] is not None else torch.device("cuda")
    (d, width), (n, m) = dims, lengths

    def takes(value_dim: int) -> bool:
        q = torch.empty((1, 1, n, d), dtype=dtype, device=device).requires_grad_(requires_grad)
        k = torch.empty((1, 1, m, d), dtype=dtype, device=device).requires_grad_(requires_grad)
        v = torch.empty((1, 1, m, value_dim), dtype=dtype, device=device).requires_grad_(requires_grad)
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
        return bool(torch.backends.cuda.can_use_cudnn_attention(params, False))

    return takes(width) and takes(d)


def _widened_dim(d: int, ll: int, multiple: int) -> int:
    """Head dim of the widened call: ``d`` value channels and ``ll`` label channels, padded to ``multiple``."""
    return d + ll + (-(d + ll) % multiple)


def _widen(q: Tensor, k: Tensor, v: Tensor, labels: Tensor, multiple: int) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad q and k, append the labels to v (``_widen_values``), all to one head dim (a multiple of ``multiple``)."""
    pad = _widened_dim(q.shape[-1], labels.shape[-1], multiple) - q.shape[-1]
    return F.pad(q, (0, pad)), F.pad(k, (0, pad)), _widen_values(v, labels, multiple)


def _widen_values(v: Tensor, labels: Tensor, multiple: int) -> Tensor:
    """The labels appended to v (broadcast over the heads), to a head dim that is a multiple of ``multiple``: v of
    the widened routes (the ``wider-v`` route's kernel takes q and k at their own head dim, the others padded)."""
    h, d, ll = v.shape[1], v.shape[-1], labels.shape[-1]
    # "b m l -> b h m l" as a broadcast view (einops' repeat of the same view costs 13 us of host time a layer)
    y = labels.to(v.dtype).unsqueeze(1).expand(-1, h, -1, -1)
    extra = _widened_dim(d, ll, multiple) - d - ll
    if extra:  # the padding on the narrow labels, so that v is copied once (by the cat); F.pad copies even where
        y = F.pad(y, (0, extra))  # it pads nothing, so none where nothing is padded (the CPU kernel's multiple is 1)
    return torch.cat([v, y], dim=-1)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    device = tensors[0].device.type
    # what sdpa would run in (not torch.amp.is_autocast_available: torch 2.11's dynamo cannot trace it)
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype != dtype:  # promote_types is a dispatched operator: only where it decides something
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _cuda_kernel(q: Tensor, k: Tensor, v: Tensor, labels: Tensor, mask: Tensor | None = None) -> _Kernel | None:
    """CUDA's flash kernel (no mask), else its memory-efficient one, if one takes both the
    widened forward and the ordinary backward (dtype, head dims, GPU generation,
    ``torch.nn.attention.sdpa_kernel`` settings).

    The forward runs at the widened head dim and the backward at the original one, so both
    widths are checked: one outside a GPU's backward window (flash on sm86/89) would pass the
    forward's check and fail the backward. A head dim that is no multiple of 8 takes neither:
    SDPA pads it before its kernels, so ``can_use_*`` says yes (torch 2.11, H100), but the raw
    backward ops called here do not ("head_size should be a multiple of 8").
    """
    if q.shape[-1] % _CUDA_FLASH.multiple:
        return None  # autograd through the widened call instead
    widths = (_widened_dim(q.shape[-1], labels.shape[-1], _CUDA_FLASH.multiple), int(q.shape[-1]))
    # under torch.compile on CUDA the default route is "separate" and never comes here; a step compiled with
    # "widened" chosen probes once, at the trace (``_cuda_kernel_name``), and its graph keeps the answer
    name = _cuda_kernel_name(_compute_dtype(q, k, v), widths, q.requires_grad, mask is not None, q.device.index)
    return {"flash": _CUDA_FLASH, "efficient": _CUDA_EFFICIENT}.get(name)


@_constant_while_tracing
def _cuda_kernel_name(
    dtype: torch.dtype, widths: tuple[int, int], requires_grad: bool, with_mask: bool, index: int | None
) -> str:
    """``_cuda_probe`` under the SDPA settings of now (under ``torch.compile``: of the trace)."""
    settings = (
        bool(torch.backends.cuda.flash_sdp_enabled()),  # type: ignore[no-untyped-call]
        bool(torch.backends.cuda.mem_efficient_sdp_enabled()),  # type: ignore[no-untyped-call]
        index,
    )
    return _cuda_probe(dtype, widths, requires_grad, with_mask, settings)


@functools.lru_cache(maxsize=64)
def _cuda_probe(
    dtype: torch.dtype, widths: tuple[int, int], requires_grad: bool, with_mask: bool, settings: tuple[bool, bool, int | None]
) -> str:
    """``"flash"``, ``"efficient"`` or ``""`` for these dtypes, head dims and SDPA settings, probed once and cached."""
    device = torch.device("cuda", settings[2]) if settings[2] is not None else torch.device("cuda")

    def takes(can_use: Callable[[Any, bool], bool], mask: bool) -> bool:
        # Tiny stand-ins of the dtype and each head dim: the checks read neither batch nor length.
        for width in widths:
            probe = torch.empty((1, 1, 1, width), dtype=dtype, device=device).requires_grad_(requires_grad)
            bias = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device) if mask else None
            if not can_use(torch.backends.cuda.SDPAParams(probe, probe, probe, bias, 0.0, False, False), False):
                return False
        return True

    if not with_mask and takes(torch.backends.cuda.can_use_flash_attention, False):
        return "flash"
    if takes(torch.backends.cuda.can_use_efficient_attention, with_mask):
        return "efficient"
    return ""


def _fused_kernel(q: Tensor, k: Tensor, v: Tensor, labels: Tensor, mask: Tensor | None = None) -> _Kernel | None:
    """The device's fused kernel for the widened forward, if one takes these inputs."""
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return None  # the fused kernels need q, k and v of one head dim
    if q.device.type == "cpu":
        return _CPU
    if q.device.type == "cuda":
        return _cuda_kernel(q, k, v, labels, mask)
    return None


_CHAINED_HEADS = 4
"""At most this many heads, the CPU averages a wide output's label columns by adding the heads' slices in turn."""


def _head_mean(y: Tensor) -> Tensor:
    """``mean_h`` of a wide output's label columns ``(b, h, n, l)`` (strided: ``l`` of each row's channels), fp32:
    every route's head mean of ``A_h Y``.

    On the CPU in eager mode, for a few fp32 heads, the heads' slices added in turn and divided once: the same
    additions in the same order as ``mean``'s, so the same bits (checked in ``tests/test_attention.py``), where
    ``mean``'s reduction over the strided head axis, whose rows hold two or three values, takes a slow loop
    (2 cores, batch 8, 2 label columns: 2 heads x 962 tokens 0.235 ms against 0.036, 3 x 401 0.103 against 0.031,
    4 x 257 0.067 against 0.033; at 8 heads and more the slices are slower). A GPU keeps the one reduction."""
    h = int(y.shape[1])
    if h == 1 and y.dtype == torch.float32:
        return y[:, 0]  # one head: its label columns as they lie (a mean of one value is that value, bit for bit)
    if not (1 < h <= _CHAINED_HEADS and y.dtype == torch.float32 and eager_cpu_routes(y.device)):
        return y.mean(dim=1, dtype=torch.float32)
    heads = y.unbind(1)  # the heads' slices in one call
    total = heads[0] + heads[1]
    for head in heads[2:]:
        total.add_(head)
    return total.div_(h)


class _WidenedForward(torch.autograd.Function):
    """Widened fused call in the forward only; the backward is the ordinary attention backward.

    Zero padding leaves scores and log-sum-exp unchanged, so the widened call's
    log-sum-exp and the first ``d`` output channels are exactly what the ordinary
    backward kernel needs, and the tensors kept for the backward are the ones plain
    attention keeps (q, k, v, out, log-sum-exp): no extra memory. Labels carry no gradient.
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, labels: Tensor, scale: float, kernel: _Kernel, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        dtype = _compute_dtype(q, k, v)
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype)
        if not q.dtype == k.dtype == v.dtype == dtype:  # as a rule they are: a cast of each that does nothing is host time
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if mask is not None and mask.dtype != dtype:
            mask = mask.to(dtype)
        d = v.shape[-1]
        if kernel.pads_qk:
            qw, kw, vw = _widen(q, k, v, labels, kernel.multiple)
        else:
            qw, kw, vw = q, k, _widen_values(v, labels, kernel.multiple)
        out_wide, saved = kernel.forward(qw, kw, vw, mask, scale)  # b h n (d + l + pad)
        # b h n d, stored as the plain kernel would store it (b n h d for timm's q, a view
        # of (b, n, 3, h, d)): the block's reshape to (b, n, h d) is then a view, not a
        # second copy kept for the backward
        out = out_wide[..., :d]
        if kernel.tokens_outer or q.stride(1) < q.stride(2):
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            out = out.contiguous()
        # Tensors through save_for_backward, so that saved-tensor hooks (save_on_cpu,
        # offloading) see every one of them; the rest (sizes, None) on ctx.
        is_tensor = [isinstance(x, Tensor) for x in saved]
        ctx.has_mask = mask is not None
        ctx.save_for_backward(q, k, v, out, *([mask] if mask is not None else []), *[x for x, t in zip(saved, is_tensor) if t])
        ctx.others, ctx.is_tensor = [x for x, t in zip(saved, is_tensor) if not t], is_tensor
        ctx.scale, ctx.kernel = scale, kernel
        # b n l: mean_h(A_h Y), read from the wide output's label columns in place (no copy of them first)
        mixed = _head_mean(out_wide[..., d : d + labels.shape[-1]])
        ctx.mark_non_differentiable(mixed)
        ctx.set_materialize_grads(False)  # no zeros built for the labels' gradient: nothing reads it
        return out, mixed

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None, grad_labels: Tensor | None) -> tuple[Tensor | None, ...]:
        if grad_out is None:  # the output took no part in the loss (grads are not materialised)
            return None, None, None, None, None, None, None
        q, k, v, out, *tensors = ctx.saved_tensors
        mask = tensors.pop(0) if ctx.has_mask else None
        tensor_it, other_it = iter(tensors), iter(ctx.others)
        saved = tuple(next(tensor_it) if t else next(other_it) for t in ctx.is_tensor)
        gq, gk, gv = ctx.kernel.backward(grad_out.to(out.dtype), q, k, v, mask, out, saved, ctx.scale)
        dq, dk, dv = ctx.in_dtypes
        return gq.to(dq), gk.to(dk), gv.to(dv), None, None, None, None


def attention_with_labels(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    labels: Tensor,
    scale: float,
    dropout_p: float = 0.0,
    attn_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention output and head-mean attention applied to labels, from one fused call.

    Args:
        q, k, v: ``(b, h, n, d)`` (k and v: ``(b, h, m, d)``).
        labels: ``(b, m, l)`` fp32 (no grad).
        scale: the attention module's own scale (NOT ``1/sqrt`` of the widened dim).
        dropout_p: attention dropout. Labels must see the undropped attention (as in
            the paper's code), so with dropout the labels take a second, no-grad call.
        attn_mask: an additive float mask or bias broadcastable to ``(b, h, n, m)`` (a shift
            mask, a relative position bias), added to the scores before the softmax, as
            SDPA's ``attn_mask``; it may need a gradient (a learnable bias).

    Returns:
        ``out`` ``(b, h, n, d)`` equal to ``sdpa(q, k, v, attn_mask, dropout_p)`` and
        ``mixed`` ``(b, n, l)`` fp32 ``= mean_h(softmax(q k^T * scale + attn_mask)) @ labels``,
        no grad. Under autocast the label channels run in the autocast dtype (bf16 rounding,
        about 3e-3 relative per layer); the scheme renormalises rows at readout.

    Example:
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)  # b=1, h=2, n=5, d=4
        >>> y = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]])
        >>> out, mixed = attention_with_labels(q, k, v, y, scale=0.5)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6)
        True
        >>> a = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1).mean(1)  # b n n, for the check only
        >>> torch.allclose(mixed, a @ y, atol=1e-6)
        True
        >>> bias = torch.randn(1, 2, 5, 5)  # a relative position bias, say
        >>> out, mixed = attention_with_labels(q, k, v, y, scale=0.5, attn_mask=bias)
        >>> a = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + bias, -1).mean(1)
        >>> torch.allclose(mixed, a @ y, atol=1e-6)
        True
    """
    d = v.shape[-1]
    labels = labels.detach() if labels.requires_grad else labels  # a detach is one more operator per layer
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        raise TypeError("attn_mask must be an additive float mask (0 to keep, -inf or a large negative to drop), not bool")
    if dropout_p > 0.0:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
        with torch.no_grad():
            qw, kw, vw = _widen(q, k, v, labels, 8)
            mask = None if attn_mask is None else attn_mask.detach()
            mixed = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=mask, scale=scale)[..., d : d + labels.shape[-1]]
    elif attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled() and q.device.type != "cuda":
        # No CPU kernel returns a mask's gradient, so plain SDPA takes its math path and
        # builds the attention matrix: mix the labels with that same matrix.
        return explicit_attention(q, k, v, labels, scale, attn_mask)
    elif (route := _route_for(q, attn_mask)) == "wider-v" and (kernel := _wider_v_kernel(q, k, v, labels, attn_mask)) is not None:
        out, mean = _WidenedForward.apply(q, k, v, labels, scale, kernel, attn_mask)  # the head mean, fp32
        return out, mean
    elif route in ("separate", "explicit", "wider-v"):  # wider-v where cuDNN takes no wider v: the labels' own call
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        mask = None if attn_mask is None else attn_mask.detach()
        with torch.no_grad():
            if route == "explicit":
                return out, explicit_mix(_attention_matrix(q, k, scale, mask), labels)
            mixed = _label_call(q, k, labels, scale, mask)
    elif route != "widened-autograd" and (kernel := _fused_kernel(q, k, v, labels, attn_mask)) is not None:
        out, mean = _WidenedForward.apply(q, k, v, labels, scale, kernel, attn_mask)  # the head mean, fp32
        return out, mean
    else:
        # Elsewhere (other devices, GPUs neither CUDA kernel supports): autograd through
        # the widened call. Zero pads give the same gradients, but the backward runs
        # widened too, and the step keeps widened q, k, v and output.
        qw, kw, vw = _widen(q, k, v, labels, 8)
        out_wide = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=attn_mask, scale=scale)
        out, mixed = out_wide[..., :d], out_wide[..., d : d + labels.shape[-1]].detach()
    return out, _head_mean(mixed.float())  # b h n l -> b n l


def _label_call(q: Tensor, k: Tensor, labels: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """``A_h Y`` ``(b, h, n, l)`` by one SDPA call whose values are the labels alone (padded to 8 channels,
    the fused kernels' multiple): q and k at their own head dim, so the call is a narrow one."""
    ll = labels.shape[-1]
    y = repeat(F.pad(labels.to(q.dtype), (0, -ll % 8)), "b m l -> b h m l", h=q.shape[1])  # autocast casts all alike
    bias = None if mask is None else mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), y, attn_mask=bias, scale=scale)[..., :ll]


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, labels: Tensor, scale: float, attn_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Attention through its matrix (as SDPA's math path computes it), the labels mixed by the same matrix.

    For what no fused kernel takes (a mask that needs a gradient): the matrix is built and
    kept for the backward as the math path keeps it, and mixing ``(b, m, l)`` labels adds
    one small product. Returns ``out`` ``(b, h, n, d)`` and ``mixed`` ``(b, n, l)`` fp32, no grad.
    """
    a = _attention_matrix(q, k, scale, attn_mask)
    return a @ v, explicit_mix(a, labels)


def _attention_matrix(q: Tensor, k: Tensor, scale: float, attn_mask: Tensor | None) -> Tensor:
    """``softmax(q k^T * scale + attn_mask)`` ``(b, h, n, m)``, as SDPA's math path computes it."""
    root = scale**0.5  # q and k each scaled by sqrt(scale), as the math path does: bit-equal outputs
    scores = (q * root) @ (k * root).transpose(-2, -1)  # b h n m
    if attn_mask is not None:
        scores = scores + attn_mask
    a: Tensor = scores.softmax(dim=-1)
    return a


def explicit_mix(a: Tensor, labels: Tensor) -> Tensor:
    """``mean_h(a) @ labels`` in fp32 for an attention matrix ``(b, h, n, m)`` that exists anyway."""
    with fp32_labels(a.device):
        return reduce(a.detach().float(), "b h n m -> b n m", "mean") @ labels.detach().float()


def class_attention(q: Tensor, k: Tensor, scale: float, index: int = 0, bias: Tensor | None = None) -> Tensor:
    """Head-mean attention row of one query token over all tokens, without the full matrix.

    Args:
        q, k: ``(b, h, n, d)``.
        index: the query token (the class token).
        bias: the attention's additive bias broadcastable to ``(b, h, n, n)`` (a relative
            position bias), or ``None``: its row ``index`` joins the scores.

    Returns:
        ``(b, n)`` fp32, no grad, rows sum to 1.
    """
    with torch.no_grad(), fp32_labels(q.device):
        scores = torch.einsum("bhd,bhnd->bhn", q[:, :, index].float(), k.float()) * scale  # b h n
        if bias is not None:
            scores = scores + bias[..., index, :].float()
        return reduce(scores.softmax(dim=-1), "b h n -> b n", "mean")


def drop_path_with_keep(x: Tensor, drop_prob: float, training: bool, scale_by_keep: bool = True) -> tuple[Tensor, Tensor | None]:
    """timm's ``drop_path`` with the same RNG draw, also returning which samples kept the branch.

    Args:
        x: ``(b, ...)`` the residual branch.

    Returns:
        The branch as timm's ``DropPath`` returns it, and ``keep`` ``(b,)`` bool (``None``
        when nothing can be dropped).
    """
    if drop_prob == 0.0 or not training:
        return x, None
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)  # same draw as timm's drop_path
    keep = random_tensor.reshape(-1) > 0
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor, keep
