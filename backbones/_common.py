"""Shared parts of the non-ViT adapters: the module wrapper, label kernels and merges.

Shapes: ``b`` batch, ``n`` tokens, ``l`` label channels, ``h w`` a token grid,
``c`` channels, ``kh kw`` a kernel.

Two label rules beyond attention (TL-Align Table 10, Appendix D), used by every
convolutional or MLP token mix here:

- spatial mixing by a depthwise convolution (ConvNeXt ``conv_dw``, PVT v2's MLP
  ``dwconv``): ``Y <- Norm(T(K)) Y`` with ``K = mean_c(|K_c| / sum|K_c|)``: each
  channel's kernel as a distribution over its taps (as each attention head's row
  is), averaged over channels (as heads are), and ``T`` the convolution's matrix on
  the actual grid with its zero padding; ``Norm`` renormalises every row over the
  taps that fall inside the grid (border-aware: a border token mixes only real tokens).
- aggregation by a strided window (patch merging, strided or overlapping
  patch-embedding convolutions, spatial reduction): ``Y <- Norm(sum_i Y_i)`` over
  the window of every output token, padding contributing nothing. Where window
  and stride are equal this is the exact area fraction of the merged cells.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.drop import DropPath
from torch import Tensor, nn
from timm.layers.std_conv import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d
from torchvision.ops import StochasticDepth

from mixlabels import AlignedOutput, LabelTracker, Scheme, TokenLabelMap, TokenLayout
from mixlabels._label_map import fp32_labels
from mixlabels._routes import _byte_route, eager_cpu_routes, eager_launch_routes, launch_routes, rounding_matmuls, switched
from mixlabels._shape_cache import shape_cache
from mixlabels.backbones._attention import drop_path_with_keep, explicit_mix
from mixlabels.backbones._fsdp import sharding_refusal
from mixlabels.backbones._grid_plan import planning
from mixlabels.backbones._timm_face import TimmFace, check_distributed, check_label_map, check_label_map_type
from mixlabels.backbones._windows import (
    AxisWindow, apply_separable, as_grid, as_tokens, axis_out, axis_windows, chain_matrices, folded, is_position_major, mix_tokens, unfolded,
    window_means, window_sums,
)

__all__ = [
    "AdaptedBase",
    "REFERENCE_LIMIT",
    "check_reference_size",
    "stride_grid",
    "tap_matrices_for",
    "tap_weights",
    "tap_mixes",
    "branch",
    "conv_label_kernel",
    "effective_weight",
    "kernel_labels",
    "label_kernels",
    "depthwise_route",
    "fold_route",
    "eager_cpu_routes",
    "mix_tokens",
    "conv_mix",
    "conv_steps_on_grid",
    "conv_mix_pair",
    "mean_pool_merge",
    "conv_aggregate",
    "start_on_stem",
    "start_on_windows",
    "start_on_convs",
    "conv_windows",
    "pool_labels",
    "mix_token_space",
    "check_static_conv",
    "explicit_mix",
    "mixing_rows",
    "launch_routes",
]


REFERENCE_LIMIT = 4 * 2**30
"""Bytes of float64 matrices the dense reference path may build; beyond, it refuses before allocating
(a ValueError, which benchmarks/speed.py reports as a refused variant) rather than exhaust the machine."""


def stride_grid(label_map: TokenLabelMap, stride: int | Sequence[int]) -> tuple[int, int]:
    """The grid of a stem or patch embedding of ``stride`` on the label map's images."""
    sh, sw = (stride, stride) if isinstance(stride, int) else (int(stride[0]), int(stride[1]))
    return label_map.image_size[0] // sh, label_map.image_size[1] // sw


def check_reference_size(adapter: AdaptedBase, label_map: TokenLabelMap) -> None:
    """Refuse a reference forward whose estimated matrices (``adapter.reference_bytes``) exceed ``REFERENCE_LIMIT``."""
    need = adapter.reference_bytes(label_map)
    if need > REFERENCE_LIMIT:
        h, w = label_map.image_size
        gh, gw = adapter.reference_grid(label_map)
        raise ValueError(
            f"the dense reference path would build {need / 2**30:.1f} GiB float64 matrices for {label_map.batch_size} "
            f"{h}x{w} images (labels on a {gh}x{gw} grid; the limit is {REFERENCE_LIMIT / 2**30:.1f} GiB); "
            "use the fast path (reference=False), or the reference on smaller images"
        )


class AdaptedBase(TimmFace):
    """``adapted(images)`` is ``model(images)``; ``adapted(images, label_map)`` an ``AlignedOutput``.

    Subclasses set ``refusal`` and ``family`` and implement ``aligned_forward`` (events,
    compact labels) and ``reference_forward`` (explicit matrices, dense labels).
    """

    family: str = ""

    @staticmethod
    def refusal(model: nn.Module) -> str | None:
        raise NotImplementedError

    def __init__(self, model: nn.Module, scheme: Scheme, reference: bool = False) -> None:
        super().__init__()
        from mixlabels.backbones._adapt import _check_model, check_scheme  # one set of checks with adapt()

        _check_model(model)
        check_scheme(scheme)
        why = self.refusal(model)
        if why is not None:
            raise TypeError(f"cannot adapt this model: {why}. Supported: {self.family}")
        self.model = model
        self.scheme = scheme
        self.reference = reference

    @overload
    def forward(self, images: Tensor) -> Any: ...

    @overload
    def forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput: ...

    def forward(self, images: Tensor, label_map: TokenLabelMap | None = None) -> Any:
        if label_map is None:
            return self.model(images)
        check_label_map_type(label_map)
        if _checkpointing(self.model):
            raise RuntimeError(
                "gradient checkpointing re-runs block forwards, which would update the labels twice; "
                "call model.set_grad_checkpointing(False) before training with a label map"
            )
        if not torch.compiler.is_compiling():
            why = sharding_refusal(self, self.fsdp_units, self.reference)
            if why is not None:
                raise RuntimeError(why)
        check_distributed(self)
        check_label_map(self, images, label_map)
        if self.reference:
            check_reference_size(self, label_map)  # before any matrix is built
            # The reference builds its explicit matrices with factory functions (eye, zeros, arange):
            # made on the images' device, a GPU model's reference runs where its modules do.
            with torch.device(images.device):
                return self.reference_forward(images, label_map)
        # on a GPU's eager route, the grids this forward's label convs ask for are kept for the next one of this size,
        # which builds each conv group on all of them at once (``GridPlan``); a null context anywhere else
        with planning(self, images):
            return self.aligned_forward(images, label_map)

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        raise NotImplementedError

    def fsdp_units(self) -> tuple[nn.Module, ...]:
        """The modules to ``fully_shard`` (FSDP2) before the adapted root: those whose forward hooks the aligned
        forward passes through (``backbones._fsdp.through_hooks``), a transformer's blocks. Empty where the family's
        walk enters none yet: shard only the adapted module (docs/distributed.md).
        """
        return ()

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        raise NotImplementedError

    def reference_grid(self, label_map: TokenLabelMap) -> tuple[int, int]:
        """The grid the reference path's dense labels start on: the pixels here (the conv-stem families sum
        them into the stem's grid); families whose reference starts on a patch or stem grid override it."""
        return label_map.image_size[0], label_map.image_size[1]

    def reference_bytes(self, label_map: TokenLabelMap) -> int:
        """Estimated bytes of the reference path's largest float64 buffers: an ``(n, n)`` matrix per sample on the
        first grid of ``n`` cells (path, window and attention matrices are that size there) and the ``(b, n, c)`` labels."""
        gh, gw = self.reference_grid(label_map)
        n, b = gh * gw, max(label_map.batch_size, 1)
        return 8 * (b * n * n + b * n * label_map.num_classes)


def branch(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """A residual branch through timm's or torchvision's stochastic depth (same RNG draw), and who kept it.

    torchvision's ``StochasticDepth`` in ``"row"`` mode draws exactly as timm's ``DropPath`` (one
    Bernoulli per sample, scaled by the survival rate); in ``"batch"`` mode one draw keeps or drops
    the whole batch.
    """
    if isinstance(module, DropPath):
        return drop_path_with_keep(x, module.drop_prob, module.training, module.scale_by_keep)
    if isinstance(module, StochasticDepth):
        if module.mode == "row":
            return drop_path_with_keep(x, module.p, module.training)
        if not module.training or module.p == 0.0:
            return x, None
        noise = x.new_empty((1,) * x.ndim).bernoulli_(1.0 - module.p)  # torchvision's one draw for the batch
        keep = (noise.reshape(1) > 0).expand(x.shape[0])
        if module.p < 1.0:
            noise.div_(1.0 - module.p)
        return x * noise, keep
    return module(x), None


def check_static_conv(conv: nn.Module, what: str, depthwise: bool = False) -> str | None:
    """Why ``conv`` has no label rule here (``None`` if it has): static padding, no groups unless depthwise."""
    if type(conv) is not nn.Conv2d:
        return f"{what} is {type(conv).__name__}, not a plain nn.Conv2d"
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return f"{what} uses padding {conv.padding!r} ({conv.padding_mode}); only static zero padding is supported"
    if depthwise and (conv.groups != conv.in_channels or conv.stride != (1, 1)):
        return f"{what} must be a stride-1 depthwise convolution"
    if not depthwise and conv.groups != 1:
        return f"{what} is a grouped convolution"
    return None


def effective_weight(conv: nn.Conv2d) -> Tensor:
    """The weight ``(o, i, kh, kw)`` ``conv``'s forward convolves with, detached (label kernels carry no gradient).

    A weight-standardised conv (timm's ``StdConv2d``, ``ScaledStdConv2d``, ``ScaledStdConv2dSame``) standardises each output
    channel's weight over ``i kh kw`` in its forward (then scales it by ``gain * scale``): ``|w - mean|``
    is not ``|w|``, so its label kernel is read from that weight, computed as timm's forward does.
    """
    if not isinstance(conv, (StdConv2d, ScaledStdConv2d, ScaledStdConv2dSame)):
        # under no_grad (``Kernels``) the weight is read as it is: a detach would be one more operator per conv
        return conv.weight.detach() if torch.is_grad_enabled() else conv.weight
    scaled: Any = conv
    with torch.no_grad():
        gamma = (scaled.gain * scaled.scale).view(-1) if isinstance(conv, (ScaledStdConv2d, ScaledStdConv2dSame)) else None
        flat = conv.weight.reshape(1, conv.out_channels, -1)  # 1 o (i kh kw): batch norm's statistics per output channel
        return F.batch_norm(flat, None, None, weight=gamma, training=True, momentum=0.0, eps=scaled.eps).reshape_as(conv.weight)


def kernel_labels(weight: Tensor) -> Tensor:
    """``mean_{o,i}(|K_oi| / sum|K_oi|)`` ``(kh, kw)`` fp32 of a conv weight ``(o, i, kh, kw)``.

    Six operators whatever the weight's size (abs, tap sums, their clamp, the division in
    place, the mean, the self tap ``_self_tap``): on a GPU each is one launch, where a chunked pass
    costs several per chunk. A weight of ``_LARGE_WEIGHT`` elements or more is averaged in two sums
    (eight operators), and on the CPU in chunks of output channels (``_chunked_pair_mean``).
    """
    with torch.no_grad():
        # a weight of zeros reads nothing: see _self_tap
        return _pair_mean(weight).add_(_self_tap(int(weight.shape[-2]), int(weight.shape[-1]), weight.device))


def _pair_mean(weight: Tensor) -> Tensor:
    """``mean_{o,i}(|K_oi| / sum|K_oi|)`` ``(kh, kw)`` fp32 (``kernel_labels`` before its self tap), under ``no_grad``."""
    if _byte_route(weight.device, weight.numel(), _LARGE_WEIGHT) and weight.is_contiguous():
        return _chunked_pair_mean(weight)
    k = weight.abs().to(torch.float32)  # o i kh kw; fp32 whatever the weight's dtype (abs is exact)
    sums = k.sum(dim=(-2, -1), keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)  # o i 1 1
    k = k.div_(sums)
    if k.numel() < _LARGE_WEIGHT or not k.is_contiguous():
        return k.mean(dim=(0, 1))
    # over the output channels first (whole contiguous (i kh kw) rows added together), then the input channels:
    # VGG-11's 7x7 head conv (4096 x 512 taps, 411 MB) in 22 ms instead of the mean's 69 on the CPU, and nearer
    # float64 (1.2e-7 of the largest tap against 2.6e-7)
    return k.sum(dim=0).sum(dim=0).div_(k.shape[0] * k.shape[1])


def _chunked_pair_mean(weight: Tensor) -> Tensor:
    """``_pair_mean`` of a large CPU weight, ``_CHUNK`` elements of output channels at a time through one buffer.

    On the CPU the whole-weight pass is slow for a reason other than its arithmetic: its temporary ``|K|`` (411 MB
    for VGG-11's 7x7 head conv) is fresh memory every step, and the kernel's page faults on first touch cost more
    than the reads (``abs`` into new memory 118 ms, into an existing buffer 28). Chunks reuse one buffer, small
    enough to stay in a core's cache between the passes over it: a chunk's ``|K|`` is written there straight from
    the weight (the one pass over the weight in memory), its ``(o, i)`` rows summed, and ``sum_oi |K_oi| / s_oi`` taken
    by one batched product with the reciprocal tap sums instead of a division in place and a second sum. VGG-11's
    head conv, timed alternately in one process: 122 ms on 2 cores where 32 MB chunks divided in place took 215 (1
    core: 172 against 345), and within 6e-8 of the largest tap of float64 (1.2e-7 before), the chunks' sums added in
    float64. Seven operators a chunk (410 chunks for that conv): the CPU pays per byte here, a GPU per launch, so a
    GPU keeps the whole-weight pass.
    """
    o, i = int(weight.shape[0]), int(weight.shape[1])
    kh, kw = int(weight.shape[-2]), int(weight.shape[-1])
    taps = kh * kw
    rows = max(1, _CHUNK // max(1, i * taps))  # output channels a chunk
    buf = torch.empty((min(rows, o) * i, taps), dtype=torch.float32)
    total = torch.zeros(taps, dtype=torch.float64)  # 49 sums of up to 410 chunks' products: float64 costs nothing
    for start in range(0, o, rows):
        n = min(rows, o - start)
        chunk, k = weight[start : start + n].view(n * i, taps), buf[: n * i]
        # |K| in fp32 whatever the weight's dtype (abs is exact); ``abs(out=)`` takes no other dtype than its input's
        k = torch.abs(chunk, out=k) if chunk.dtype == torch.float32 else k.copy_(chunk).abs_()
        inverse = k.sum(dim=-1).clamp_min_(torch.finfo(torch.float32).tiny).reciprocal_()  # (n i): 1 / s_oi
        # sum_i |K_oi| / s_oi per output channel (n t 1), then over the chunk's channels: one product over all of
        # the chunk's rows (a matrix-vector product) is faster still, but its fp32 sum of thousands of rows lands
        # up to 6e-7 of the largest tap from float64 on one thread, where these sums stay within 6e-8 on any number
        total.add_(torch.bmm(k.view(n, i, taps).transpose(1, 2), inverse.view(n, i, 1)).view(n, taps).sum(dim=0))
    return total.div_(o * i).to(torch.float32).view(kh, kw)


@shape_cache(maxsize=64)
def _self_tap(kh: int, kw: int, device: torch.device) -> Tensor:
    """``(kh, kw)`` fp32: ``_READS_NOTHING`` at the tap ``((kh - 1) // 2, (kw - 1) // 2)`` (the centre of an odd kernel,
    which a grid-keeping stride-1 conv reads each position itself through), 0 elsewhere; added to every label kernel
    (cached, a constant: one operator per kernel or stack of kernels).

    A conv whose weight is all zeros reads nothing (timm's ``zero_init_last``: ResNetV2's basic blocks zero their
    second 3x3 conv), and its label kernel was all zeros: every position's in-grid tap weight 0, its labels 0 / 0,
    NaN targets and a NaN loss from the first step. With this tap such a kernel is the identity (``Y <- Y``: the
    labels stay, as a channel op leaves them), and a position whose in-grid taps are all zero keeps its own labels;
    the reference reads both so (``_dense.row_normalise``). Any other kernel is unchanged to the bit: a tap of at
    least 1e-12 (of a kernel summing to 1) is more than 2**23 times ``_READS_NOTHING``."""
    t = torch.zeros(kh, kw)
    t[(kh - 1) // 2, (kw - 1) // 2] = _READS_NOTHING
    return t.to(device)


_READS_NOTHING = 1e-20
"""The self tap's weight (``_self_tap``): a normal fp32 number whose products with labels down to 1e-18 stay normal."""


def mixing_rows(w: Tensor) -> Tensor:
    """``Norm(w)`` of non-negative square token-mixing weights ``(..., n, n)``, in place (pass a fresh tensor): every
    row made a distribution over the tokens it draws from (ResMLP's and gMLP's token linears, MLP-Mixer's token MLP
    paths; four operators for a whole stack).

    ``_READS_NOTHING`` is added on the diagonal first, the token mixers' self tap (``_self_tap``): a token whose row
    has no mass (a token mixer whose weights are all zeros outputs its bias alone, the same for every token) keeps
    its own labels, as the reference's ``_dense.row_normalise`` says, where the clamped division gave it a row of
    zeros and the targets lost that token's label mass. Any other row is unchanged to the bit."""
    w.diagonal(dim1=-2, dim2=-1).add_(_READS_NOTHING)
    return w.div_(w.sum(dim=-1, keepdim=True))


def _meet_einops_types() -> None:
    """Have einops meet a tensor and a parameter now, at import. einops finds a backend by the tensor's type and
    keeps it per type on first use, and dynamo guards a traced graph on how many types it keeps: a forward traced
    before einops met a ``Parameter`` (ConvNeXt's layer scale, rearranged) grows that store while traced, and the
    next call traced the whole step again (a second compile of a user's first steps)."""
    for t in (torch.empty(0), nn.Parameter(torch.empty(0), requires_grad=False)):
        rearrange(t, "n -> n")


_meet_einops_types()

_CHUNK = 1 << 18
"""Elements of a large CPU weight ``_chunked_pair_mean`` takes at a time (1 MB in fp32: a core's L2 holds the chunk
between its passes). VGG-11's head conv on 2 cores, in one process: 122 ms in chunks of 1 MB, 123 of 4 MB, 162 of
32 MB, 239 of 256 KB (1568 chunks' operators)."""


_UNSET = object()


def _checkpointing(model: nn.Module) -> bool:
    """Whether any of ``model``'s modules has gradient checkpointing on (timm's ``grad_checkpointing``), checked on
    every forward. Read from each instance's dict, where timm's ``__init__`` and ``set_grad_checkpointing`` put it:
    ``getattr`` of a module without it goes through ``nn.Module.__getattr__`` and an exception (MobileNetV3-small's
    235 modules, 1 core: 0.44 ms a forward against 0.23). A class-level value (or property) is read as such; traced,
    the plain ``getattr`` (read once, at the trace).

    Every module is visited once, as ``modules()`` visits them, by a walk of the ``_modules`` dicts themselves:
    ``modules()`` builds each module's dotted name and throws it away, about half of this check's host time (1 core,
    a forward: DeiT-S's 276 modules 0.13 ms against 0.24, EfficientNet-B0's 337 0.17 against 0.32)."""
    if torch.compiler.is_compiling():
        return any(getattr(mod, "grad_checkpointing", False) for mod in model.modules())
    stack, seen = [model], {id(model)}
    pop, push, visit = stack.pop, stack.append, seen.add
    while stack:
        mod = pop()
        own = mod.__dict__
        flag = own.get("grad_checkpointing", _UNSET)
        if flag is _UNSET:
            if hasattr(type(mod), "grad_checkpointing") and getattr(mod, "grad_checkpointing"):
                return True
        elif flag:
            return True
        children = own["_modules"]
        if children:
            for child in children.values():
                if child is not None and id(child) not in seen:
                    visit(id(child))
                    push(child)
    return False


def fold_route(y: Tensor, convs: int, *, lasting: bool = False) -> bool:
    """Whether labels viewed ``(b, l, h, w)``, about to go through ``convs`` depthwise label convs on a large grid
    (``depthwise_route``), are first copied position-major (``position_major``), for ``conv_steps_on_grid`` to
    convolve them ``folded``. On the CPU in eager mode, for a batch of label maps with fewer channels than
    ``_FOLD_CHANNELS``, not position-major already, where the copy pays: from labels in any layout but channels-last
    (the labels' own ``as_grid``), always (8 x 2 labels on 56x56, 2 cores: a grouped conv on ``(b, l, h, w)``-major
    memory 0.240 ms, on 112x112 6.7 ms; the copy 0.016 and the folded conv 0.055); from channels-last, where it
    serves at least two convs or lasts (``lasting``: the tracker's own labels, which the convs, pools and residual
    events after it keep in that layout: a forward copies once, not once a block) (a channels-last conv 0.089 ms,
    the copy 0.057). A compiled graph lays its tensors out as its compiler decides (its labels stay as they are),
    and a GPU's depthwise kernels are not the CPU's (``launch_routes``)."""
    b, l = int(y.shape[0]), int(y.shape[1])
    if not eager_cpu_routes(y.device):
        return False
    if b == 1 or l >= _FOLD_CHANNELS or is_position_major(y):
        return False
    return lasting or convs >= 2 or not y.is_contiguous(memory_format=torch.channels_last)


_FOLD_CHANNELS = 8
"""Label channels from which ``fold_route`` leaves the labels as they are (compact labels have two or three sources,
token targets a channel per class). Measured on 8 label maps, 3x3, 2 cores (``conv2d`` channels-last with ``groups=l``
against folded): the fold wins for 2 to 7 channels (112x112: 0.252 against 0.078 ms at 2, 0.222 against 0.157 at
7), loses from 8 (0.334 against 0.563 at 8, 0.228 against 0.261 at 16)."""


_LARGE_WEIGHT = 1 << 22
"""Weights from this many elements up (16 MB in fp32: a classifier head written as a conv) that ``kernel_labels``
averages over output channels, then input channels: a mean over both leading dims at once reads them 3x slower."""


def label_kernels(weights: Sequence[Tensor]) -> list[Tensor]:
    """``kernel_labels`` of many conv weights at once: weights of one tap count are reduced together.

    Weights of one shape are stacked; where a tap count has several shapes, the stacks' ``(o, i)`` tap rows
    are concatenated ``(sum o*i, kh*kw)``, normalised together and averaged per weight: by one product with the
    per-weight mean matrix where it is small (``_MEAN_MATRIX_ENTRIES``), else by the mean of each run of ``gcd``
    rows (every weight's rows are whole runs) and that product over the runs, else (rows sharing no long run)
    split by shape and a view and a mean per shape; then the self tap (``_self_tap``) added to all. About eight
    operators per tap count and two per further shape, instead of six per weight: a ResNet-18's thirteen stride-1
    3x3 convs have four shapes (1.5M rows in runs of 4096), a DenseNet-121's 58 one. The concatenation is one copy of those weights, made once per step; on the CPU a tap count's weights of
    ``_SEPARATE_WEIGHTS`` elements or more go weight by weight instead (``_byte_route``).

    Returns:
        ``(kh, kw)`` fp32 per weight, in order.
    """
    groups: dict[tuple[int, int, torch.dtype, torch.device], dict[tuple[int, ...], list[int]]] = {}
    for i, w in enumerate(weights):
        groups.setdefault((int(w.shape[-2]), int(w.shape[-1]), w.dtype, w.device), {}).setdefault(tuple(w.shape), []).append(i)
    out: list[Tensor | None] = [None] * len(weights)
    for (kh, kw, _, device), by_shape in groups.items():
        # fp32 under a caller's autocast too: the kernels are read together at a forward's start on the launch routes
        # (Kernels), outside any tracker event, where addmm's means would otherwise come out bf16
        with torch.no_grad(), fp32_labels(device):
            # shapes ordered by their trailing (i, kh, kw): weights sharing it concatenate along o without a view
            tails: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
            for shape in by_shape:
                tails.setdefault(shape[1:], []).append(shape)
            shapes = {shape: by_shape[shape] for same_tail in tails.values() for shape in same_tail}
            members = [i for same in shapes.values() for i in same]  # the order of the rows below
            if len(members) == 1 or _byte_route(weights[members[0]].device, sum(weights[i].numel() for i in members), _SEPARATE_WEIGHTS):
                for i in members:  # weight by weight: no stack or concatenation (see _SEPARATE_WEIGHTS)
                    out[i] = kernel_labels(weights[i])
                continue
            tap = _self_tap(kh, kw, weights[members[0]].device)  # a weight of zeros reads nothing: see _self_tap
            if len(shapes) == 1:  # one shape: the stack's mean over (o, i)
                k = torch.stack([weights[i] for i in members]).abs_().to(torch.float32)  # g o i kh kw
                sums = k.sum(dim=(-2, -1), keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
                means = k.div_(sums).mean(dim=(1, 2)).add_(tap)  # g kh kw
            else:
                per_tail = [sum(len(by_shape[shape]) for shape in same_tail) for same_tail in tails.values()]
                rows = _tap_rows([weights[i] for i in members], [len(same) for same in shapes.values()], per_tail, kh * kw)
                rows = rows.abs_().to(torch.float32)  # (sum o i) t, weight by weight
                sums = rows.sum(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
                # each shape's weights are consecutive rows: a (count, o i, t) view and a parallel mean per shape.
                # Not segment_reduce: its CUDA kernel loops over a segment in one thread per output (a 512x512
                # conv's 262144 rows in sequence), tens of milliseconds a step where this takes microseconds
                counts = tuple(shape[0] * shape[1] for shape, same in shapes.items() for _ in same)  # rows per weight
                chunk = math.gcd(*counts)  # every weight's rows are whole runs of this many
                if len(counts) * int(rows.shape[0]) <= _MEAN_MATRIX_ENTRIES:  # one product: depthwise convs, as a rule
                    means = _means_by_product(tap.view(1, -1), _mean_matrix(counts, rows.device), rows.div_(sums)).view(-1, kh, kw)
                elif len(counts) * (int(rows.shape[0]) // chunk) <= _MEAN_MATRIX_ENTRIES and not torch.compiler.is_compiling():
                    # the mean of each run of ``chunk`` rows (one reduction, a ResNet's 1.5M rows to a few hundred),
                    # then each weight's mean of its runs by one product: four operators where the means per shape
                    # and the self tap took two a shape and four more (ResNet-18's four shapes: 12). Eager only: a
                    # compiler fuses the means per shape into its kernels, and the product would be one more extern
                    # call (compiled resnet18: 72 launches a step on the shifted route, 74 this way)
                    run_means = rows.div_(sums).view(-1, chunk, kh * kw).mean(dim=1)
                    means = _means_by_product(tap.view(1, -1), _mean_matrix(tuple(c // chunk for c in counts), rows.device), run_means).view(-1, kh, kw)
                else:
                    runs = torch.split(rows.div_(sums), [len(same) * shape[0] * shape[1] for shape, same in shapes.items()])
                    per_shape = [run.view(len(same), -1, kh * kw).mean(dim=1) for run, same in zip(runs, shapes.values())]
                    means = torch.cat(per_shape).view(-1, kh, kw).add_(tap)
            for i, kernel in zip(members, means.unbind()):
                out[i] = kernel
    return [k for k in out if k is not None]


def _means_by_product(tap: Tensor, matrix: Tensor, rows: Tensor) -> Tensor:
    """``matrix @ rows`` plus the self tap ``tap`` ``(1, t)`` on every row: by ``addmm``'s bias (one operator) where
    every operator is a launch, by a product and an addition on the CPU's eager route (the bits the targets digest
    holds: a BLAS that accumulates onto the bias would round a near-zero tap otherwise)."""
    if eager_cpu_routes(rows.device):
        return (matrix @ rows).add_(tap)
    return torch.addmm(tap, matrix, rows)


_SEPARATE_WEIGHTS = 1 << 20
"""Weights of one tap count totalling this many elements (4 MB in fp32) or more are reduced weight by weight on the
CPU (``_byte_route``), not stacked and concatenated: the concatenation is one or two copies of them in fresh memory
every step, which on 2 CPU cores cost more than the reductions. ResNetV2-18's thirteen stride-1 3x3 convs (9.4M
elements): 29 ms concatenated, 8 to 17 weight by weight (six operators each instead of about two). A GPU pays per
launch and keeps the concatenation."""

_MEAN_MATRIX_ENTRIES = 2**20
"""``label_kernels`` averages the tap rows of weights of several shapes by one product with ``_mean_matrix``
(``(g, sum o*i)``, cached) while it has at most this many entries (4 MiB): a ConvNeXt's or an EfficientNet's
depthwise convs (a few thousand rows) in one operator where a view and a mean per shape and their concatenation
take two per shape and two more; a ResNet's full 3x3 convs (1.5M rows) keep the means per shape."""


@shape_cache(maxsize=64)
def _mean_matrix(counts: tuple[int, ...], device: torch.device) -> Tensor:
    """``(g, sum(counts))`` fp32: row ``k`` is ``1 / counts[k]`` on the ``counts[k]`` consecutive columns of weight ``k``
    (its rows among all weights' tap rows), 0 elsewhere: the matrix of the per-weight means. Built by comparisons
    from static bounds, so ``torch.compile`` traces it without a data-dependent shape (``shape_cache``: not cached while traced)."""
    ends = list(itertools.accumulate(counts))
    starts = torch.tensor([e - c for e, c in zip(ends, counts)], device=device)
    stops = torch.tensor(ends, device=device)
    cols = torch.arange(ends[-1], device=device)
    inside = (cols >= starts[:, None]) & (cols < stops[:, None])  # g R
    return inside.to(torch.float32) / torch.tensor(counts, device=device, dtype=torch.float32)[:, None]


def _tap_rows(weights: Sequence[Tensor], per_shape: Sequence[int], per_tail: Sequence[int], taps: int) -> Tensor:
    """The weights' ``(o, i)`` tap rows ``(sum o*i, taps)`` as a new tensor, weight by weight, built the way that
    dispatches the fewest operators: a view per weight and one concatenation; a stack and a view per shape and one
    concatenation; or, where weights share their ``(i, kh, kw)`` (depthwise convs of any width), a concatenation
    along ``o`` and a view per such tail (and one concatenation of those). ``weights`` come ordered by tail, then
    shape; ``per_shape`` and ``per_tail`` count them (at least two shapes).

    Where every operator is a launch (``eager_launch_routes``) the fewest computing operators decide first, the
    fewest dispatched second: a view launches nothing, and a view per weight and one concatenation copy the weights
    once, where a stack per shape and the concatenation of the stacks copy them twice (ResNet-18's twelve 3x3 convs
    of four shapes: one launch, not five). Elsewhere the fewest dispatched: on the CPU each costs about the same."""
    # each route's (computing, dispatched) operators; the views of a contiguous weight launch nothing
    joined_copies = sum(1 for n in per_tail if n > 1) + (1 if len(per_tail) > 1 else 0)
    routes = {  # ties go to the first
        "views": (1, len(weights) + 1),
        "stacks": (len(per_shape) + 1, 2 * len(per_shape) + 1),
        "joined": (joined_copies, sum(2 if n > 1 else 1 for n in per_tail) + (1 if len(per_tail) > 1 else 0)),
    }
    launches = eager_launch_routes(weights[0].device)
    route = min(routes, key=lambda r: routes[r] if launches else (routes[r][1], 0))
    if route == "joined":
        parts = [(torch.cat(run) if len(run) > 1 else run[0]).reshape(-1, taps) for run in _runs(weights, per_tail)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]  # one tail: its concatenation is already new
    if route == "views":
        return torch.cat([w.reshape(-1, taps) for w in weights])
    return torch.cat([torch.stack(run).reshape(-1, taps) for run in _runs(weights, per_shape)])


def _runs(items: Sequence[Tensor], lengths: Sequence[int]) -> list[list[Tensor]]:
    """``items`` cut into consecutive runs of ``lengths``."""
    runs, k = [], 0
    for n in lengths:
        runs.append(list(items[k : k + n]))
        k += n
    return runs


def conv_label_kernel(weight: Tensor) -> Tensor:
    """``mean_c(|K_c| / sum|K_c|)``: a depthwise kernel ``(c, 1, kh, kw)`` as one distribution ``(kh, kw)`` fp32
    (``kernel_labels`` with one input channel per group)."""
    return kernel_labels(weight)


_DENSE_CONV_TOKENS = 64
"""Grids up to this many positions mix labels by the explicit ``(n, n)`` matrix on the CPU in eager mode
(``eager_cpu_routes``) and in compiled graphs: on a 7x7 grid a depthwise conv call costs three times the small
matrix products (on 14x14 the conv wins)."""

_DENSE_LAUNCH_TOKENS = 196
"""Where every operator is a kernel launch (a GPU's eager route, ``launch_routes``), grids up to this many positions
(14x14) mix labels by the explicit ``(n, n)`` matrix: a conv there is two launches (the conv and the division by the
in-grid tap weights) and the tap weights a third per grid, a matrix one product, and the matrices of all a forward's
convs of one kernel shape on the grid are built together in three (``Kernels.matrix``). A 14x14 matrix is 150 KiB
(7x7 kernels' tap matrices, cached: 7.2 MiB); at 28x28 they would be 2.3 MiB and 113 MiB."""


def _tap_reads(grid: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], device: torch.device) -> tuple[Tensor, Tensor]:
    """For each tap ``t`` of a conv that keeps ``grid`` and each output position ``p`` (row-major): the input position
    it reads (``(t, n)`` long, meaningless outside) and whether that lies inside the grid (``(t, n)`` bool)."""
    h, w = grid
    pos = torch.arange(h * w, device=device)  # n: output positions, row-major
    ti = torch.arange(kernel[0], device=device).repeat_interleave(kernel[1])  # t: each tap's row offset
    tj = torch.arange(kernel[1], device=device).repeat(kernel[0])  # t: its column offset
    iy = (pos // w).unsqueeze(0) + (ti * dilation[0] - padding[0]).unsqueeze(1)  # t n: the input row read
    ix = (pos % w).unsqueeze(0) + (tj * dilation[1] - padding[1]).unsqueeze(1)  # t n
    return iy * w + ix, (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)


@shape_cache(maxsize=256)
def _tap_matrices(grid: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], device: torch.device) -> Tensor:
    """``(kh*kw, n*n)`` fp32 0/1: for each tap, which input position every output position reads (shapes only: cached).

    Built by comparisons only, no boolean indexing: every shape is a constant of the grid and kernel, so
    ``torch.compile`` traces it into the graph (``shape_cache``: not cached while traced) without a data-dependent shape.
    """
    reads, inside = _tap_reads(grid, kernel, padding, dilation, device)
    hits = reads.unsqueeze(-1) == torch.arange(grid[0] * grid[1], device=device)  # t n n: output row reads input column
    return (hits & inside.unsqueeze(-1)).to(torch.float32).reshape(kernel[0] * kernel[1], -1)


@shape_cache(maxsize=32)
def _weighted_tap_matrices(
    grid: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], device: torch.device,
) -> Tensor:
    """``(kh*kw, n*n + n)`` fp32 0/1: ``_tap_matrices``, then every tap's in-grid indicator per output position (its
    row's sum, exact), so that one product with label kernels makes a matrix's entries and every row's in-grid tap
    weight together (``tap_mixes``: no reduction of its own; shapes only: cached)."""
    taps = _tap_matrices(grid, kernel, padding, dilation, device)
    n = grid[0] * grid[1]
    return torch.cat([taps, taps.view(-1, n, n).sum(dim=-1)], dim=1)


def tap_matrices_for(
    grid: tuple[int, int], kernel: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], device: torch.device,
) -> Tensor:
    """The tap matrices ``tap_mixes`` reads on ``device``'s route: ``_weighted_tap_matrices`` where every operator is
    a launch (a GPU's eager route, ``launch_routes``: the rows' sums come with the product, one kernel fewer a grid),
    the plain ``_tap_matrices`` on the CPU's eager route, which sums the rows (its bits, which the targets digest
    holds, are those of that sum), and in a compiled graph, whose compiler fuses the sum into the division (and
    whose trace would break at the strided views' storage offset)."""
    if eager_cpu_routes(device) or torch.compiler.is_compiling():
        return _tap_matrices(grid, kernel, padding, dilation, device)
    return _weighted_tap_matrices(grid, kernel, padding, dilation, device)


def _tap_parts(product: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """A product of label kernels with a grid's tap matrices (``tap_matrices_for``) as its two parts: the matrices'
    entries as ``shape`` (``(g, n, n)``, or ``(n, n)`` for one kernel) and every row's in-grid tap weight
    ``shape[:-1] + (1,)``. Of ``_weighted_tap_matrices`` ``(g, n*n + n)``, each one strided view; of the plain
    ``(g, n*n)`` ones, a view and the rows' sums."""
    n, width = int(shape[-1]), int(product.shape[-1])
    if width == n * n:
        entries = product.view(shape)
        return entries, entries.sum(dim=-1, keepdim=True)
    lead = (width,) if len(shape) == 3 else ()
    start = product.storage_offset()
    entries = product.as_strided(shape, (*lead, n, 1), start)
    weights = product.as_strided((*shape[:-1], 1), (*lead, 1, 1), start + n * n)
    return entries, weights


@shape_cache(maxsize=64)
def _ones(shape: tuple[int, int, int, int], device: torch.device) -> Tensor:
    """``(1, 1, h, w)`` fp32 ones: the map whose convolution is every position's in-grid tap weight (cached, as
    ``_tap_matrices``: a constant of the grid).

    One channel, convolved with every kernel ``(g, 1, kh, kw)`` at once (a plain conv to ``g`` channels), not ``g``
    channels in ``g`` groups: the same sums to the bit, and on the CPU (mkldnn) 2 to 3 times faster on small grids
    (batch 1, 2 threads: 5 kernels on 112x112, 59 against 153 us; 12 kernels on 14x14, 10 against 83 us)."""
    return torch.ones(shape, device=device)


@shape_cache(maxsize=128)
def _axis_reads(size: int, kernel: int, padding: int, dilation: int, device: torch.device) -> Tensor:
    """``(out, kernel)`` fp32 0/1: whether a stride-1 conv's tap ``a`` at output ``o`` reads inside ``[0, size)`` along
    one axis (``o - padding + a * dilation``; shapes only: cached)."""
    out = size + 2 * padding - dilation * (kernel - 1)
    reads = torch.arange(out, device=device).unsqueeze(1) - padding + torch.arange(kernel, device=device) * dilation
    return ((reads >= 0) & (reads < size)).to(torch.float32)


def tap_weights(kernels: Tensor, grid: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """Every kernel's in-grid tap weight ``(1, g, h', w')`` fp32 on ``grid``: at each output position of a stride-1
    conv, the sum of the kernel's taps that read inside the grid (``kernels`` ``(g, 1, kh, kw)``, label kernels).

    A tap is inside where its row and its column are, so the weight is ``R K C^T`` with ``R`` ``(h', kh)`` and ``C``
    ``(w', kw)`` the axes' 0/1 reads (cached): on the CPU's eager route two small products (15-22 us on 2 cores for
    12 7x7 kernels, on 56x56 as on 14x14), where the convolution of ones (every other route's) pays oneDNN's floor
    of a call, 45-190 us whatever the grid. The same sums but for their order; products that would round fp32
    (``rounding_matmuls``: a bf16 matmul precision) keep the convolution."""
    kh, kw = int(kernels.shape[-2]), int(kernels.shape[-1])
    if not eager_cpu_routes(kernels.device) or rounding_matmuls(kernels.device):
        ones = _ones((1, 1, grid[0], grid[1]), kernels.device)  # one channel to every kernel: see ``_ones``
        return F.conv2d(ones, kernels, padding=padding, dilation=dilation)
    rows = _axis_reads(grid[0], kh, padding[0], dilation[0], kernels.device)
    cols = _axis_reads(grid[1], kw, padding[1], dilation[1], kernels.device)
    with fp32_labels(kernels.device):  # fp32 products under a caller's autocast, wherever this is called from
        by_column = torch.mm(kernels.float().reshape(-1, kw), cols.t())  # (g kh) w'
        g = int(by_column.shape[0]) // kh
        # one bmm of the expanded rows: ``rows @`` a 3-d tensor dispatches a transpose, views and expands of its own
        return torch.bmm(rows.expand(g, -1, -1), by_column.view(g, kh, -1)).unsqueeze(0)  # 1 g h' w'


ConvStep = tuple[Tensor, tuple[int, int], tuple[int, int]]
"""A stride-1 conv on labels: its label kernel ``(kh, kw)`` (or ``(l, 1, kh, kw)``, expanded over the labels'
channels, on grids larger than ``_DENSE_CONV_TOKENS``), padding and dilation."""


def conv_mix(labels: Tensor, grid: tuple[int, int], kernel: Tensor, padding: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """``Norm(T(kernel)) @ labels``: a stride-1 convolution applied to labels, renormalised over in-grid taps
    (``conv_chain`` of one step).

    Args:
        labels: ``(b, h*w, l)``, row-major over ``grid``.
        kernel: ``(kh, kw)`` non-negative (``conv_label_kernel``).

    Returns:
        ``(b, h*w, l)`` fp32, rows summing to 1 where the input's do.
    """
    return conv_chain(labels, grid, [(kernel, padding, dilation)])


_LAUNCH_MATRICES = [True]
"""Whether a GPU's eager walk takes the matrices up to ``_DENSE_LAUNCH_TOKENS`` (``launch_matrices``)."""


def launch_matrices(on: bool) -> AbstractContextManager[None]:
    """Inside, a GPU's eager walk mixes labels by matrices on grids up to ``_DENSE_LAUNCH_TOKENS`` positions (``on``,
    the default) or only up to the CPU's ``_DENSE_CONV_TOKENS`` (the depthwise convs above: the tested fallback):
    ``benchmarks/gpu_suite.py --family-mode eager --family-routes matrices=cpu`` times both on a GPU."""
    return switched(_LAUNCH_MATRICES, on)


def depthwise_route(grid: tuple[int, int], device: torch.device) -> bool:
    """Whether ``conv_chain`` mixes labels on ``grid`` (on ``device``) by depthwise convolutions (kernels
    ``(l, 1, kh, kw)``) rather than by tap matrices (kernels ``(kh, kw)``): on grids over ``_DENSE_CONV_TOKENS``
    positions on the CPU's eager route and in a compiled graph, over ``_DENSE_LAUNCH_TOKENS`` on a GPU's eager route
    (``launch_routes`` too; unless ``launch_matrices(False)``), and on every grid in a graph compiled with shifted
    label convs (``compiled_shifted``), where the convs fuse and the matrices' products would be extern calls."""
    if compiled_shifted():
        return True
    cpu = eager_cpu_routes(device) or torch.compiler.is_compiling() or not _LAUNCH_MATRICES[0]
    dense = _DENSE_CONV_TOKENS if cpu else _DENSE_LAUNCH_TOKENS
    return grid[0] * grid[1] > dense


def _chain_matrices(grid: tuple[int, int], steps: Sequence[ConvStep], device: torch.device) -> list[Tensor]:
    """``Norm(T(kernel))`` ``(n, n)`` fp32 of every step on a small grid, from the cached tap matrices.

    Steps of one kernel shape, padding and dilation (a block's convs, as a rule) build theirs together: one
    product of their stacked kernels with the tap matrices, one normalisation, instead of five operators a step.
    """
    n = grid[0] * grid[1]
    kernels = [k[0, 0] if k.dim() == 4 else k for k, _, _ in steps]  # expanded for the depthwise route: any row
    shapes = {(tuple(k.shape), tuple(p), tuple(d)) for k, (_, p, d) in zip(kernels, steps)}
    if len(shapes) == 1 and len(steps) > 1:
        ((kh, kw), padding, dilation), = shapes
        taps = tap_matrices_for(grid, (kh, kw), (padding[0], padding[1]), (dilation[0], dilation[1]), device)
        return list(tap_mixes(torch.stack(kernels).to(taps).view(len(steps), -1), taps, (len(steps), n, n)).unbind(0))
    out = []
    for kernel, (_, padding, dilation) in zip(kernels, steps):
        taps = tap_matrices_for(grid, (int(kernel.shape[0]), int(kernel.shape[1])), (padding[0], padding[1]), (dilation[0], dilation[1]), device)
        out.append(tap_mixes(kernel.to(taps).reshape(1, -1), taps, (n, n)))
    return out


def tap_mixes(kernels: Tensor, taps: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``Norm(T(kernel))`` of label kernels given as rows ``(g, kh*kw)``, from a grid's tap matrices
    (``tap_matrices_for``): one product viewed as ``shape`` (``(g, n, n)``, or ``(n, n)`` for one kernel), every row
    divided by its in-grid tap weight: the product's own last ``n`` columns with ``_weighted_tap_matrices`` (two
    computing operators), the rows' sums with the plain ``(kh*kw, n*n)`` ones (three)."""
    entries, weights = _tap_parts(kernels @ taps, shape)
    return entries / weights


@shape_cache(maxsize=32)
def _joint_tap_matrices(
    grids: tuple[tuple[int, int], ...], mass_grids: tuple[tuple[int, int], ...], kernel: tuple[int, int],
    padding: tuple[int, int], dilation: tuple[int, int], device: torch.device,
) -> Tensor:
    """``(kh*kw, 2 N + M)`` fp32 0/1, ``N`` the ``grids``' ``n*n`` summed, ``M`` the ``mass_grids``' ``n``: every grid's
    ``_tap_matrices`` side by side, then for each the in-grid indicator of every tap at every output position
    (``_weighted_tap_matrices``' last ``n`` columns), repeated along that row's ``n`` entries, then each mass grid's
    in-grid indicators alone, so that one product with label kernels makes every grid's matrix entries, entry by
    entry their rows' in-grid tap weights, and every mass grid's in-grid tap weights (``labels_on_grids``; shapes
    only: cached)."""
    t = kernel[0] * kernel[1]
    taps, weights = [], []
    for grid in grids:
        n = grid[0] * grid[1]
        weighted = _weighted_tap_matrices(grid, kernel, padding, dilation, device)  # t (n*n + n)
        taps.append(weighted[:, : n * n])
        weights.append(weighted[:, n * n :].unsqueeze(-1).expand(t, n, n).reshape(t, n * n))
    masses = [_tap_reads(grid, kernel, padding, dilation, device)[1].to(torch.float32) for grid in mass_grids]  # t n
    return torch.cat([*taps, *weights, *masses], dim=1)


def labels_on_grids(
    kernels: Tensor, grids: Sequence[tuple[int, int]], mass_grids: Sequence[tuple[int, int]], kernel: tuple[int, int],
    padding: tuple[int, int], dilation: tuple[int, int],
) -> tuple[list[Tensor], list[tuple[Tensor, ...]]]:
    """Label kernels ``(g, kh*kw)`` of a conv that keeps its grid (``keeps_grid``) on several grids at once: their
    matrices ``tap_mixes`` ``(g, n, n)`` on each of ``grids`` (the small ones, mixed by matrices) and their in-grid tap
    weights ``(1, h, w)`` on each of ``mass_grids`` (the large ones, mixed by depthwise convs that divide by them), by
    one product with ``_joint_tap_matrices`` and one division, where each grid took a product and a division (a
    matrix) or a convolution of ones (a mass) of its own. Per grid, in order: the matrices as one strided view of the
    quotient, the masses a tuple of strided views of the product, one a kernel (``Kernels`` on a GPU's eager route,
    where the last forward asked for these grids: ``GridPlan``)."""
    taps = _joint_tap_matrices(tuple(grids), tuple(mass_grids), kernel, padding, dilation, kernels.device)
    half = sum(h * w * h * w for h, w in grids)
    product = kernels @ taps  # g (2N + M): the entries, each entry's row weight, then the masses
    g = int(kernels.shape[0])
    matrices, start = [], 0
    if grids:
        mixes = product[:, :half] / product[:, half : 2 * half]  # g N, fresh and contiguous
        for h, w in grids:  # each grid's block of columns as (g, n, n): one strided view (a slice and a view are two)
            n = h * w
            matrices.append(mixes.as_strided((g, n, n), (half, n, 1), start))
            start += n * n
    masses, start, row = [], 2 * half, int(product.shape[1])
    for h, w in mass_grids:  # each grid's block as (g, 1, h, w), then a view a kernel
        masses.append(product.as_strided((g, 1, h, w), (row, h * w, w, 1), start).unbind(0))
        start += h * w
    return matrices, masses


def keeps_grid(kernel: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int]) -> bool:
    """Whether a stride-1 conv of this kernel, padding and dilation maps a grid onto itself ('same': every output
    position reads as far on one side as on the other)."""
    return all((k - 1) * d == 2 * p for k, p, d in zip(kernel, padding, dilation))


def conv_chain(labels: Tensor, grid: tuple[int, int], steps: Sequence[ConvStep]) -> Tensor:
    """``conv_mix`` of consecutive stride-1 convs on one grid.

    Small grids build each ``T(kernel)`` from cached tap matrices. Larger ones run the labels, viewed
    ``(b, l, h, w)`` in place (channels-last memory, no copy), through ``conv_steps_on_grid``, the two layout
    views once for the whole chain rather than per conv.

    Returns:
        ``(b, h*w, l)`` fp32, rows summing to 1 where the input's do.
    """
    with fp32_labels(labels.device):
        if not depthwise_route(grid, labels.device):
            y = labels.float()
            for t in _chain_matrices(grid, steps, labels.device):
                y = mix_tokens(t, y)
            return y
        return as_tokens(conv_steps_on_grid(as_grid(labels.float(), grid), steps))


_SHIFTED_TAPS = 49
"""Under ``torch.compile``, label convs of at most this many taps (7x7) are written as sums of shifted slices
(``shifted_conv``); larger kernels stay convolutions (the fused kernel's code grows with the taps)."""

_SHIFTED = [True]
"""Whether a compiled graph writes label convs as shifted sums (``compiled_label_convs``)."""


@contextmanager
def compiled_label_convs(route: Literal["shifted", "conv"]) -> Iterator[None]:
    """Inside, a compiled graph convolves labels by ``route``: ``"shifted"`` (the default) sums shifted slices of the
    padded labels (``shifted_conv``), which the compiler fuses with the in-grid tap weight and the division into the
    kernels it generates; ``"conv"`` calls the convolution, an extern kernel (cuDNN, mkldnn) that nothing fuses
    with. Eager mode always convolves: there a shifted sum is one operator a tap. The route is read while tracing
    and guarded: a graph traced under one route is traced again when called under the other, so keep the calls
    inside.

    Compiled resnet18 at 224 px, inductor on the CPU: a TL-Align step launches 105 generated kernels and extern
    calls on the conv route, 72 on the shifted one, CutMix + NoAlign's 62 (``benchmarks/op_count.py --compiled``)."""
    if route not in ("shifted", "conv"):
        raise ValueError(f"compiled_label_convs: route must be 'shifted' or 'conv', got {route!r}")
    before = _SHIFTED[0]
    _SHIFTED[0] = route == "shifted"
    try:
        yield
    finally:
        _SHIFTED[0] = before


def compiled_shifted() -> bool:
    """Whether this is a graph ``torch.compile`` traces with shifted label convs (``compiled_label_convs``)."""
    return _SHIFTED[0] and torch.compiler.is_compiling()


def shifted_route(*kernels: Tensor) -> bool:
    """Whether label convs with these kernels (``(..., kh, kw)``) are written as shifted sums: traced by
    ``torch.compile``, the route on (``compiled_label_convs``), every kernel at most ``_SHIFTED_TAPS`` taps."""
    return compiled_shifted() and all(int(k.shape[-2]) * int(k.shape[-1]) <= _SHIFTED_TAPS for k in kernels)


def shifted_conv(y: Tensor, kernel: Tensor, padding: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """A stride-1 conv with zero padding of ``y`` ``(..., c, h, w)`` as a sum of the kernel's taps times shifted
    slices of the padded input: every channel with one ``(kh, kw)`` kernel, or with a ``(g, kh, kw)`` kernel a
    channel's own (``c == g``) or, from one channel (``c == 1``), ``g`` channels out. The same sums as the
    convolution (rounded in tap order), which a compiler fuses into one kernel with what reads the result."""
    kh, kw = int(kernel.shape[-2]), int(kernel.shape[-1])
    (ph, pw), (dh, dw) = padding, dilation
    oh, ow = int(y.shape[-2]) + 2 * ph - dh * (kh - 1), int(y.shape[-1]) + 2 * pw - dw * (kw - 1)
    padded = F.pad(y, (pw, pw, ph, ph))
    taps = kernel if kernel.dim() == 2 else rearrange(kernel, "g kh kw -> kh kw g 1 1")  # tap (i, j): a scalar or (g, 1, 1)
    out = padded[..., :oh, :ow] * taps[0, 0]
    for t in range(1, kh * kw):
        i, j = divmod(t, kw)
        out = out + padded[..., i * dh : i * dh + oh, j * dw : j * dw + ow] * taps[i, j]
    return out


def shifted_mix(y: Tensor, kernel: Tensor, padding: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """``shifted_conv`` of ``y`` divided by that of ones over its grid: a label conv renormalised by its in-grid tap
    weight, as sums a compiler fuses into one kernel (the route a compiled graph takes: ``shifted_route``)."""
    ones = _ones((1, 1, int(y.shape[-2]), int(y.shape[-1])), y.device)
    return shifted_conv(y, kernel, padding, dilation) / shifted_conv(ones, kernel, padding, dilation)


def conv_steps_on_grid(y: Tensor, steps: Sequence[ConvStep], masses: Sequence[Tensor | None] | None = None) -> Tensor:
    """Labels viewed ``(b, l, h, w)`` (``as_grid``) through one depthwise convolution per step (a group per label
    channel), each divided by its in-grid tap weight: three operators a step, two where ``masses`` holds the step's
    tap weight ``(1, h, w)`` already (``Kernels.mass``: computed for many convs in one call).

    Labels in position-major memory (``position_major``) are convolved ``folded``: ``b * l`` channels in one map,
    kernels ``(b l, 1, kh, kw)``. In a compiled graph (``shifted_route``) each step is a shifted sum divided by the
    shifted sum of ones (``masses`` unread: the compiler drops what computed them), which the compiler fuses.

    Returns:
        ``(b, l, h, w)`` fp32 in the input's memory layout, rows summing to 1 where the input's do.
    """
    with fp32_labels(y.device):
        batch, h, w = int(y.shape[0]), int(y.shape[2]), int(y.shape[3])
        if shifted_route(*(k for k, _, _ in steps)):
            for kernel, padding, dilation in steps:
                k = (kernel if kernel.dim() == 2 else kernel[0, 0]).to(y)  # an expanded kernel: every row is the kernel
                y = shifted_mix(y, k, padding, dilation)
            return y
        f = folded(y)  # position-major labels: each conv over the whole batch's labels as b * l channels
        z = y if f is None else f
        l = int(z.shape[1])
        for i, (kernel, padding, dilation) in enumerate(steps):
            k = _depthwise_kernel(kernel, y, l)
            mass = masses[i] if masses is not None else None
            if mass is None:
                mass = tap_weights(k[:1], (h, w), padding, dilation)  # 1 1 h w: the in-grid tap weight of every channel's kernel
            # in place on the conv's fresh output: a new tensor for the quotient cost more than the conv on large
            # grids (8 x 3 labels on 112x112, 2 CPU cores: 1.65 ms against 0.63), the same bits and layout
            z = F.conv2d(z, k, padding=padding, dilation=dilation, groups=l).div_(mass)
        return z if f is None else unfolded(z, batch)


def _depthwise_kernel(kernel: Tensor, like: Tensor, channels: int) -> Tensor:
    """A label kernel ``(kh, kw)``, or one already expanded to ``(channels, 1, kh, kw)`` (``Kernels.wide``, expanded
    per shape), as ``like``'s depthwise conv weight over ``channels`` label channels."""
    k = kernel.to(like)
    if k.dim() == 2 or int(k.shape[0]) != channels:
        k = (k if k.dim() == 2 else k[0, 0]).expand(channels, 1, int(k.shape[-2]), int(k.shape[-1]))
    return k


def conv_steps_undivided(y: Tensor, steps: Sequence[ConvStep], masses: Sequence[Tensor | None]) -> tuple[Tensor, Tensor]:
    """``conv_steps_on_grid`` with its last convolution left undivided, for a caller that divides within an operator
    of its own (``CompactTracker.residual_sum``): that convolution ``(b, l, h, w)`` and its in-grid tap weight
    ``(1, h, w)`` (``masses``' last, else ``tap_weights``: a convolution of ones on this route). Labels ``(b, l, h, w)`` not position-major, a
    GPU's eager route (convolutions, not the compiled graphs' shifted sums)."""
    if is_position_major(y) or not steps:
        raise ValueError("conv_steps_undivided: labels viewed (b, l, h, w), not position-major, and at least one step")
    with fp32_labels(y.device):
        z = conv_steps_on_grid(y, steps[:-1], masses[:-1]) if len(steps) > 1 else y
        kernel, padding, dilation = steps[-1]
        l, h, w = int(z.shape[1]), int(z.shape[2]), int(z.shape[3])
        k = _depthwise_kernel(kernel, z, l)
        mass = masses[-1]
        if mass is None:
            mass = tap_weights(k[:1], (h, w), padding, dilation)[0]  # 1 h w
        return F.conv2d(z, k, padding=padding, dilation=dilation, groups=l), mass


def conv_mix_pair(
    first: Tensor, second: Tensor, grid: tuple[int, int], k_first: Tensor, k_second: Tensor,
    padding: tuple[int, int], dilation: tuple[int, int],
) -> Tensor:
    """``Norm(T(k_first) first + T(k_second) second)``: one stride-1 conv over two label states side by side (a conv
    over concatenated channels, MobileViT's fusion), every row renormalised over both halves' in-grid taps.

    Args:
        first, second: ``(b, h*w, l)`` labels of the two channel groups, row-major over ``grid``.
        k_first, k_second: ``(kh, kw)`` non-negative, each group's share of the conv's label kernel
            (together a distribution over the taps).

    Returns:
        ``(b, h*w, l)`` fp32, rows summing to 1 where the inputs' do.
    """
    with fp32_labels(first.device):
        n = grid[0] * grid[1]
        if not depthwise_route(grid, first.device):
            kernel = (int(k_first.shape[0]), int(k_first.shape[1]))
            taps = tap_matrices_for(grid, kernel, (padding[0], padding[1]), (dilation[0], dilation[1]), first.device)
            (t1, m1), (t2, m2) = (_tap_parts(k.to(taps).reshape(1, -1) @ taps, (n, n)) for k in (k_first, k_second))
            return (t1 @ first.float() + t2 @ second.float()) / (m1 + m2)  # over both halves' in-grid tap weights
        if shifted_route(k_first, k_second):  # compiled: both halves' shifted sums, fused (see ``shifted_conv``)
            ones = _ones((1, 1, grid[0], grid[1]), first.device)
            k1, k2 = k_first.float(), k_second.float()
            mixed = (shifted_conv(as_grid(first.float(), grid), k1, padding, dilation)
                     + shifted_conv(as_grid(second.float(), grid), k2, padding, dilation))
            return as_tokens(mixed / (shifted_conv(ones, k1, padding, dilation) + shifted_conv(ones, k2, padding, dilation)))
        if eager_launch_routes(first.device):
            # where every operator is a launch: both states stacked position-major ``(b, n, l, two)``, which is a
            # channels-last ``(b, (l two), h, w)`` map as it lies (one copy, where a stack and the rearrangement's copy
            # took two), a group per label channel, and both halves' in-grid tap weight by one conv of the cached ones
            # over two channels (one operator, where ``ones_like``, a grouped conv and a sum took three). The CPU's
            # eager route keeps its own (its bits, which the targets digest holds: a two-channel conv adds the halves
            # in its own order)
            pair = torch.stack([first.float(), second.float()], dim=-1)  # b n l two
            b, _, l, _ = pair.shape
            h, w = grid
            y = pair.as_strided((b, 2 * l, h, w), (n * 2 * l, 1, w * 2 * l, 2 * l))  # b (l two) h w, channels-last
            k = torch.stack([k_first, k_second]).to(y).unsqueeze(0)  # 1 two kh kw
            mass = F.conv2d(_ones((1, 2, h, w), y.device), k, padding=padding, dilation=dilation)  # 1 1 h w
            mixed = F.conv2d(y, k.expand(l, -1, -1, -1), padding=padding, dilation=dilation, groups=l)  # b l h w
            return as_tokens(mixed.div_(mass))
        y = rearrange(torch.stack([first.float(), second.float()], dim=-1), "b (h w) l two -> 1 (b l two) h w", h=grid[0])
        k = rearrange(torch.stack([k_first, k_second]).to(y), "two kh kw -> two 1 kh kw")
        groups = y.shape[1] // 2
        mass = F.conv2d(torch.ones_like(y[:, :2]), k, padding=padding, dilation=dilation, groups=2).sum(1, keepdim=True)  # 1 1 h w
        mixed = F.conv2d(y, rearrange(k, "two 1 kh kw -> 1 two kh kw").expand(groups, -1, -1, -1), padding=padding,
                         dilation=dilation, groups=groups).div_(mass)  # 1 (b l) h w: each group sums its two halves
        return rearrange(mixed, "1 (b l) h w -> b (h w) l", b=first.shape[0])


def pool_labels(labels: Tensor, grid: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
    """Sum of the labels in every window (zero padding adds nothing): ``(b, n, l) -> (b, n', l)`` and the new grid."""
    return window_sums(labels, grid, kernel, stride, padding)


def mean_pool_merge(grid: tuple[int, int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int] = (0, 0)) -> tuple[Callable[[Tensor], Tensor], tuple[int, int]]:
    """The ``aggregate`` merge of a strided window over ``grid``, and the grid it produces. The merge averages the
    labels over each window's in-grid positions (``average_windows``: pooled where it can be), which keeps every row's
    sum: pass ``normalised=True`` to ``aggregate``."""
    h, w = axis_windows(kernel, stride, padding)

    def merge(labels: Tensor) -> Tensor:
        return window_means(labels, grid, kernel, stride, padding)[0]

    return merge, (axis_out(grid[0], h), axis_out(grid[1], w))


def conv_aggregate(tracker: LabelTracker, grid: tuple[int, int], conv: Any) -> tuple[int, int]:
    """The ``aggregate`` event of a strided conv (downsampling, a stem) over ``grid``: labels summed
    over each of its windows (averaged, rows kept). Returns the grid it produces."""
    merge, out = mean_pool_merge(grid, conv.kernel_size, conv.stride, conv.padding)
    tracker.aggregate(merge, normalised=True)
    return out


def start_on_windows(
    scheme: Scheme,
    label_map: TokenLabelMap,
    start: tuple[int, int],
    depth: int,
    windows: Sequence[tuple[AxisWindow, AxisWindow]],
    num_prefix: int = 0,
    class_token: bool = False,
) -> tuple[LabelTracker, tuple[int, int]]:
    """A tracker whose patch labels start as the pixels (grid ``start``) summed over a stem's chain of
    ``windows`` (each renormalised), and the grid that chain ends on.

    The same labels as starting on the pixels and aggregating window by window, without a per-pixel
    label map: the layout's ``pixel_windows`` let the mask weigh its boxes or cells under the windows
    directly (``TokenLabelMap.window_weights``). Token targets (annotator maps) start on the pixels.
    """
    if not windows:
        return scheme.start(label_map, TokenLayout(grid=start, num_prefix=num_prefix, depth=depth, class_token=class_token)), start
    rows, cols = chain_matrices(start, tuple(windows), True, label_map.device)
    grid = (int(rows.shape[0]), int(cols.shape[0]))
    if label_map.token_targets is None:
        layout = TokenLayout(grid=grid, num_prefix=num_prefix, depth=depth, class_token=class_token, pixel_windows=(rows, cols))
        return scheme.start(label_map, layout), grid
    tracker = scheme.start(label_map, TokenLayout(grid=start, num_prefix=num_prefix, depth=depth, class_token=class_token))
    p = num_prefix
    tracker.aggregate(lambda y: torch.cat([y[:, :p], apply_separable(y[:, p:], start, rows, cols)], dim=1))
    return tracker, grid


def conv_windows(conv: Any) -> tuple[AxisWindow, AxisWindow]:
    """A strided conv's windows (kernel, stride, static padding)."""
    return axis_windows(_pair(conv.kernel_size), _pair(conv.stride), _pair(conv.padding))


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def start_on_convs(
    scheme: Scheme,
    label_map: TokenLabelMap,
    start: tuple[int, int],
    grid: tuple[int, int],
    depth: int,
    convs: Sequence[Any],
    num_prefix: int = 0,
    class_token: bool = False,
) -> LabelTracker:
    """A tracker on ``grid``: for a token-space map (``start == grid``) the labels start there; else
    they are the pixels (``start``) summed over every window of the strided ``convs`` in turn."""
    if start == grid:
        return scheme.start(label_map, TokenLayout(grid=grid, num_prefix=num_prefix, depth=depth, class_token=class_token))
    tracker, end = start_on_windows(scheme, label_map, start, depth, [conv_windows(c) for c in convs], num_prefix, class_token)
    if end != grid:
        raise ValueError(f"the stem's windows make a {end} grid where the model made {grid}; this stem is not supported")
    return tracker


def start_on_stem(
    scheme: Scheme, label_map: TokenLabelMap, start: tuple[int, int], grid: tuple[int, int], depth: int, stem: Any
) -> LabelTracker:
    """A pooled pyramid model's tracker: labels start on ``start`` (the pixels, or the token grid for a
    token-space map) and, where that is the pixels, are summed over every window of the ``stem`` conv."""
    return start_on_convs(scheme, label_map, start, grid, depth, [stem])


def mix_token_space(x: Tensor, label_map: TokenLabelMap, channels_last: bool) -> Tensor:
    """MixToken on a patch-embedding map: ``(b, h, w, c)`` if ``channels_last`` else ``(b, c, h, w)``."""
    pattern = "b h w c" if channels_last else "b c h w"
    grid = (int(x.shape[1]), int(x.shape[2])) if channels_last else (int(x.shape[2]), int(x.shape[3]))
    flat = label_map.mix_tokens(rearrange(x, f"{pattern} -> b (h w) c"), grid)
    return rearrange(flat, f"b (h w) c -> {pattern}", h=grid[0])
