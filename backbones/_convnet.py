"""Label rules of convolutional networks (ResNet, EfficientNet, RegNet), shared by their adapters.

A CNN has no tokens, but every position of a feature map is one (the paper's "beyond"):
the rules of TL-Align Table 10 and Appendix D apply to the layers a CNN is made of.

- a stride-1 ``kxk`` convolution (``k > 1``; full, grouped or depthwise) mixes labels
  spatially, ``Y <- Norm(T(K)) Y`` with ``K = mean_{o,i}(|K_oi| / sum|K_oi|)``: every
  (output, input) channel pair's kernel as a distribution over its taps (as an attention
  head's row is one over keys), averaged over the pairs (as heads are averaged), ``T`` the
  convolution's matrix on the grid with its padding and dilation, and every row
  renormalised over the taps inside the grid (``backbones._common.conv_mix``: a depthwise
  kernel is the case ``i = 1``);
- a strided convolution or any pooling window (max, average, blur) aggregates,
  ``Y <- Norm(sum_i Y_i)`` over the in-grid positions of each window (what a patch merge
  or a strided patch embedding does); padding, zero or reflected, adds no position;
- a ``1x1`` stride-1 convolution, a norm, an activation, a channel gate (squeeze-excite,
  ECA) and dropout (DropBlock too: a multiplicative mask) act on each position's channels
  and leave labels alone;
- branches run on the same map and joined (``Parallel``): a concatenation along channels gives
  every channel its branch's labels, so the join weighs each branch by its channel count (as
  the conv rule weighs every (out, in) channel pair alike: a conv over concatenated maps reads
  them so); a sum gives every channel all the branches' labels, so it weighs them equally (as
  the residual rule does). Every branch must end on the same grid. A ``MixedConv2d`` (MixNet) is
  not such a join: it equals one conv, its groups' kernels zero-padded centred to the largest,
  and takes that conv's rule (one renormalisation over the taps, not one per group).

A concatenation whose parts ran through residual layers (CSP's cross stage: the blocks run on one part of the
channels, the other waits) or a shortcut added to a part of the channels only (ReXNet's) is a fork and a join of
the tracker (``LabelTracker.fork``, ``join``): the labels at the split are kept, the residual events run on, and
the join weighs the kept labels (through the waiting part's own path, if any) by its channel count.

A block is a ``Path`` of such ops. A residual block ``x <- f(x) + s(x)`` gives, with
``Y = labels_for(layer)``: the shortcut ``s`` aggregates when it has a window (a
downsampling shortcut), else keeps the labels; the branch's labels ``Y_f = P_f Y`` join
them by the scheme's residual rule (``residual(layer, keep, mixed=Y_f)``: ``(P_s Y + Y_f) / 2``
for TL-Align, the shortcut's labels where drop-path dropped the branch). A block with no
shortcut forms every output position from its windows alone: its path ``aggregate``\\ s,
aligned layer or not, as a stem does.

Shapes: ``b`` batch, ``n`` positions (row-major over a grid ``h w``), ``l`` label channels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from timm.layers.blur_pool import BlurPool2d
from timm.layers.conv2d_same import Conv2dSame
from timm.layers.conv_bn_act import ConvNormAct
from timm.layers.drop import DropBlock2d
from timm.layers.eca import CecaModule, EcaModule
from timm.layers.evo_norm import (
    EvoNorm2dB0,
    EvoNorm2dB1,
    EvoNorm2dB2,
    EvoNorm2dS0,
    EvoNorm2dS1,
    EvoNorm2dS2,
)
from timm.layers.global_context import GlobalContext
from timm.layers.mixed_conv2d import MixedConv2d
from timm.layers.separable_conv import SeparableConvNormAct
from timm.layers.pool2d_same import AvgPool2dSame, MaxPool2dSame
from timm.layers.squeeze_excite import EffectiveSEModule, SEModule
from timm.layers.std_conv import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d
from torch import Tensor, nn

from mixlabels import AlignedOutput, LabelTracker, Scheme, TokenLabelMap, TokenLayout
from mixlabels._label_map import fp32_labels
from mixlabels._routes import eager_launch_routes, switched
from mixlabels._shape_cache import shape_cache
from mixlabels._trackers import CompactTracker
from mixlabels.backbones._checks import check_batch
from mixlabels.backbones._fsdp import is_sharded
from mixlabels.backbones._grid_plan import current_plan
from mixlabels.backbones._common import (
    AdaptedBase, _DENSE_LAUNCH_TOKENS, conv_chain, conv_steps_on_grid, conv_steps_undivided, tap_matrices_for, tap_mixes, depthwise_route, eager_cpu_routes, effective_weight,
    fold_route, keeps_grid, kernel_labels, label_kernels, labels_on_grids, mix_token_space, shifted_route, start_on_windows,
    tap_weights,
)
from mixlabels.backbones._dense import DenseRules, conv_matrix, kernel_reference, row_normalise
from mixlabels.backbones._windows import (
    AxisWindow, _window_kron, as_grid, as_tokens, average_windows, axis_out, axis_windows, is_position_major, mix_tokens, pool_on_grid, position_major,
    same_axis_windows, window_plan,
)
from mixlabels.backbones._joins import JoinShape, fused_join, fused_join_route, join_masses, join_shares, window_kernels
from mixlabels.backbones._reparam import Scales, scales_of

__all__ = [
    "Window",
    "Parallel",
    "CrossPart",
    "KernelConv",
    "KernelBatch",
    "window_axes",
    "Path",
    "path_convs",
    "path_of",
    "path_refusal",
    "path_grid",
    "CHANNEL_GATES",
    "apply_path",
    "walk_path",
    "kernel_labels",
    "Kernels",
    "path_kernels",
    "aggregate_path",
    "conv_weights",
    "block_kernels",
    "path_matrix",
    "merge_matrix",
    "block_labels",
    "fold_labels",
    "start_on_path",
    "start_before_path",
    "windows_into_stem",
    "block_labels_reference",
    "conv_norm_act_ops",
    "run_stem",
    "run_module_stem",
    "AdaptedConvNet",
]

CHANNEL_GATES: tuple[type[nn.Module], ...] = (SEModule, EffectiveSEModule, EcaModule, CecaModule)
"""Modules scaling each channel by a gate computed from the globally pooled features: channel ops."""

_CONVS = (nn.Conv2d, StdConv2d, ScaledStdConv2d)
"""Static convs: a weight-standardised one's label kernel is read from its standardised weight (``effective_weight``)."""
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
_EVO_NORMS = (EvoNorm2dB0, EvoNorm2dB1, EvoNorm2dB2, EvoNorm2dS0, EvoNorm2dS1, EvoNorm2dS2)
"""timm's EvoNorms (the S*a variants subclass S*): each position's channels scaled by statistics over the whole map
(S: per sample and channel group, as GroupNorm; B: the batch variance per channel, as BatchNorm, against the
sample's own map statistics), with a per-position activation; no position reads another's value: channel ops."""
_NOT_ELEMENTWISE = (nn.MultiheadAttention, nn.Softmax, nn.Softmin, nn.LogSoftmax)
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "timm.layers.activations", "timm.layers.activations_me")


@dataclass(frozen=True)
class Window:
    """A strided conv's or a pool's windows: labels summed over each window's in-grid positions.

    ``same``: TF 'same' padding (timm's ``Conv2dSame``, ``AvgPool2dSame``, ``MaxPool2dSame``), which pads each
    input by its size (``_windows.same_padding``, the odd unit after): ``padding`` is unused, and the windows are
    resolved from the grid they are applied to (``axes(grid)``).
    """

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    ceil_mode: bool = False
    same: bool = False

    def out_grid(self, grid: tuple[int, int]) -> tuple[int, int]:
        """PyTorch's output size on ``grid`` (``ceil_mode``'s rule: no window starts in the padding; 'same': ``ceil(i/s)``)."""
        h, w = self.axes(grid)
        return axis_out(grid[0], h), axis_out(grid[1], w)

    def axes(self, grid: tuple[int, int]) -> tuple[AxisWindow, AxisWindow]:
        """The two axes of the windows this window has on ``grid`` (static padding: the same on every grid)."""
        if self.same:
            return same_axis_windows(grid, self.kernel, self.stride)
        return axis_windows(self.kernel, self.stride, self.padding, self.ceil_mode)


@dataclass(frozen=True, eq=False)
class KernelBatch:
    """A ``KernelConv``'s kernel as one of many built in one pass: ``build(modules, scales)`` returns the kernels of
    several such modules (one family's reparameterised blocks) as ``kernel(scales)`` would, bit for bit (the same
    elementwise operations on their weights concatenated along output channels: a few operators for all of them,
    instead of several per conv). Convs whose ``key`` is equal (the builder, and what it needs alike: kernel shape,
    which norms fold, dtype, device) are built together."""

    key: tuple[Any, ...]
    module: nn.Module
    build: Callable[[Sequence[nn.Module], Scales], list[Tensor]]


@dataclass(frozen=True, eq=False)
class KernelConv:
    """A stride-1 conv whose kernel or static geometry no single ``nn.Conv2d`` holds: parallel branches summed at
    the same positions (RepVGG-style kxk, 1x1 and identity, each with its norm: one conv with the summed kernel, as
    timm's ``fuse`` writes it), or a conv built with ``padding='same'`` (its static padding computed)."""

    kernel: Callable[..., Tensor]
    """The ``(o, i, kh, kw)`` kernel, read at call time (the weights change every step): ``kernel(scales)``
    where ``norms`` names batch norms it folds in, else ``kernel()``."""
    padding: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)
    norms: tuple[nn.Module, ...] = ()
    """The batch norms whose fold scales the kernel reads (``_reparam.Scales``): ``Kernels`` computes those of all
    its convs in one pass. Their running statistics move in a training forward, in their own block only:
    ``AdaptedConvNet`` reads such kernels after the whole forward (what the reference reads right after each block),
    FastViT all of them before any of their blocks runs (each block's kernel is read before its forward there)."""
    batch: KernelBatch | None = None
    """How the kernel is built together with others alike (``conv_weights``); ``None``: alone."""

    @property
    def weight(self) -> Tensor:
        return self.kernel_with(scales_of(self.norms))

    def kernel_with(self, scales: Scales) -> Tensor:
        """The kernel, given fold scales holding at least this conv's ``norms``."""
        return self.kernel(scales) if self.norms else self.kernel()


@dataclass(frozen=True)
class Parallel:
    """Branches applied to the same labels and joined: ``Y <- sum_i w_i P_i Y`` with ``w`` the branches' weights
    normalised (a concatenation: their channel counts; a sum: equal weights). An empty branch is the identity
    (a concatenation that keeps its input, as VoVNet's or DenseNet's)."""

    branches: tuple[Path, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.branches) != len(self.weights) or not self.branches:
            raise ValueError(f"Parallel needs one weight per branch, got {len(self.branches)} branches and {len(self.weights)} weights")
        if min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(f"Parallel's weights must be non-negative with a positive sum, got {self.weights}")

    @classmethod
    def concat(cls, branches: Sequence[Path], channels: Sequence[int]) -> Parallel:
        """Branches concatenated along channels, ``channels[i]`` of them from branch ``i``."""
        return cls(tuple(branches), tuple(float(c) for c in channels))

    @classmethod
    def sum(cls, branches: Sequence[Path]) -> Parallel:
        """Branches summed: every channel carries every branch."""
        return cls(tuple(branches), (1.0,) * len(branches))

    def shares(self) -> list[float]:
        total = sum(self.weights)
        return [w / total for w in self.weights]

    def out_grid(self, grid: tuple[int, int]) -> tuple[int, int]:
        """The branches' common grid (a join of maps of different sizes is refused: PyTorch would refuse it too)."""
        grids = {path_grid(b, grid) for b in self.branches}
        if len(grids) != 1:
            raise ValueError(f"parallel branches end on different grids {sorted(grids)} from {grid}; they cannot be joined")
        return grids.pop()


@dataclass(frozen=True, eq=False)
class CrossPart:
    """Units run on one part of a map's channels while the other part waits, then both concatenated (a CSP cross
    stage): ``split(x) -> (waiting, running)``, ``units`` (an ``AdaptedConvNet``'s units: residual layers, others)
    run on the running part, ``cat(waiting, ran)`` is the concatenation. The labels fork at the split and join
    weighed by the waiting part's channel count (``LabelTracker.join``); the units must keep the grid."""

    split: Callable[[Tensor], tuple[Tensor, Tensor]]
    units: tuple[Any, ...]
    cat: Callable[[Tensor, Tensor], Tensor]


def window_run(path: Path, start: int) -> tuple[list[Window], int]:
    """The run of consecutive windows of ``path`` from ``start`` (a window) and the index after it."""
    end = start
    while end < len(path) and isinstance(path[end], Window):
        end += 1
    return [w for w in path[start:end] if isinstance(w, Window)], end


def window_axes(windows: Sequence[Window], grid: tuple[int, int]) -> tuple[tuple[AxisWindow, AxisWindow], ...]:
    """The axes of a chain of ``windows`` applied to ``grid`` in order, each resolved on the grid it receives."""
    axes = []
    for w in windows:
        axes.append(w.axes(grid))
        grid = w.out_grid(grid)
    return tuple(axes)


Op = Window | nn.Conv2d | KernelConv | Parallel
"""One spatial op of a path: a ``Window``, a stride-1 ``kxk`` conv (an ``nn.Conv2d`` or a ``KernelConv``, its
kernel read at call time), or ``Parallel`` branches."""
Path = tuple[Op, ...]


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _is_global_context_gate(module: nn.Module) -> bool:
    """timm's ``GlobalContext`` used as a gate only (``'gc'``): ``x * sigmoid(mlp(context))``, the context pooled
    over every position, scales each channel alike everywhere as squeeze-excite does. With ``fuse_add`` (``'gca'``)
    it adds the pooled context to every position: content moves between positions, so that form is refused."""
    return isinstance(module, GlobalContext) and module.mlp_add is None


def _is_channel_op(module: nn.Module) -> bool:
    if isinstance(module, (nn.Identity, nn.Dropout, DropBlock2d, *_NORMS, *_EVO_NORMS, *CHANNEL_GATES)):
        return True
    if _is_global_context_gate(module):
        return True
    return type(module).__module__ in _ACTIVATION_MODULES and not isinstance(module, _NOT_ELEMENTWISE)


def _op_refusal(module: nn.Module, where: str, gates: tuple[type[nn.Module], ...]) -> str | None:
    """Why ``module`` has no rule here (``None``: it is a spatial op or a channel op)."""
    if isinstance(module, gates) or _is_channel_op(module):
        return None
    if isinstance(module, GlobalContext):
        return (f"{where} is GlobalContext with fuse_add ('gca'): it adds a context pooled over all positions to "
                "every position, which moves content between positions and has no label rule here; build the model "
                "with attn_layer='gc' (a gate only) or 'se'")
    if type(module) is MixedConv2d:
        return _mixed_conv_refusal(module, where)
    if type(module) is Conv2dSame:
        conv: Any = module
        if conv.stride == (1, 1):  # timm builds this only where 'same' is asymmetric: an even (dilated) kernel
            if conv.dilation != (1, 1):
                return (f"{where} is a stride-1 dilated Conv2dSame with kernel {tuple(conv.kernel_size)}: TF 'same' padding "
                        "pads one side more, which no label rule here follows; use an odd kernel (a static nn.Conv2d) or pad_type=''")
            return None  # its padding is the same on every grid: a static conv with one zero tap before (_same_kernel_conv)
        if conv.dilation != (1, 1):
            return f"{where} is a strided dilated Conv2dSame; only undilated strided convolutions aggregate here"
        return None
    if type(module) in (AvgPool2dSame, MaxPool2dSame):
        same: Any = module
        if same.ceil_mode or _pair(getattr(same, "dilation", 1)) != (1, 1):
            return f"{where} is a {type(module).__name__} with ceil_mode or dilation; only plain 'same' pooling windows have a rule"
        return None
    if type(module) is ScaledStdConv2dSame:  # NFNet's dm_nfnet_*: a static conv where 'same' is symmetric
        scaled: Any = module
        if not scaled.same_pad:
            return None if module.padding_mode == "zeros" else f"{where} (ScaledStdConv2dSame) pads by {module.padding_mode!r}; only zero padding has a label rule"
        if module.stride == (1, 1) or module.dilation != (1, 1):  # dynamic: pad_same before the conv, as Conv2dSame
            return (f"{where} is a ScaledStdConv2dSame with kernel {tuple(module.kernel_size)}, stride {tuple(module.stride)} and "
                    f"dilation {tuple(module.dilation)}: its TF 'same' padding pads one side more, which has a label rule only "
                    "for undilated strided convolutions (windows); build the model with same_padding=False")
        return None
    if type(module).__name__ in ("StdConv2dSame", "ScaledStdConv2dSame"):
        return (f"{where} is {type(module).__name__}: TF 'same' padding, decided per input size, has no static windows; "
                "build the model with static padding (NFNet: same_padding=False)")
    if type(module) in _CONVS:
        if isinstance(module.padding, str) or module.padding_mode != "zeros":
            return f"{where} ({type(module).__name__}) uses padding {module.padding!r} ({module.padding_mode}); only static zero padding has a label rule"
        if module.stride != (1, 1) and module.dilation != (1, 1):
            return f"{where} is a strided dilated convolution; only undilated strided convolutions aggregate here"
        static: Any = module
        kernel, padding, dilation = _pair(static.kernel_size), _pair(static.padding), _pair(static.dilation)
        if static.stride == (1, 1) and any(2 * p != d * (k - 1) for p, d, k in zip(padding, dilation, kernel)):
            # the conv rule maps a grid to itself (every output position centred on its input position)
            return (f"{where} is a stride-1 {kernel} conv with padding {padding} (dilation {dilation}): it changes the "
                    "grid, which no stride-1 label rule here follows; pad by dilation * (kernel - 1) / 2")
        return None
    if type(module) in (nn.MaxPool2d, nn.AvgPool2d):
        pool: Any = module
        if _pair(getattr(pool, "dilation", 1)) != (1, 1):
            return f"{where} is a dilated pooling window"
        return None
    if type(module) is BlurPool2d:
        blur: Any = module
        if blur.pad_mode not in ("reflect", "constant", "replicate"):
            return f"{where} pads by {blur.pad_mode!r}; only reflect, replicate or zero padding stays inside its window"
        return None
    return f"{where} is {type(module).__name__}, which has no label rule here (a conv, pool, norm, activation or channel gate)"


def _same_kernel_conv(conv: Conv2dSame) -> KernelConv:
    """An undilated stride-1 ``Conv2dSame`` as the static conv it equals on every grid: TF 'same' pads ``k - 1`` in
    all, ``(k - 1) // 2`` before (an even ``k``: one less than after, as the s2d blocks' 2x2 depthwise conv); one
    zero tap put before the kernel on such an axis makes it odd and its padding symmetric, ``k // 2`` each side."""
    extra = tuple(1 - int(k) % 2 for k in conv.kernel_size)  # 1 on an axis with an even kernel

    def kernel() -> Tensor:
        return F.pad(effective_weight(conv), (extra[1], 0, extra[0], 0))

    return KernelConv(kernel, (int(conv.kernel_size[0]) // 2, int(conv.kernel_size[1]) // 2))


def _mixed_groups(module: MixedConv2d) -> list[Any]:
    return list(module.values())


def _mixed_conv_refusal(module: MixedConv2d, where: str) -> str | None:
    """Why a ``MixedConv2d`` is not the one conv its groups make, kernels zero-padded (centred) to the largest.

    Its channel groups each run a conv of their own kernel size on their split and are concatenated: with odd
    kernels, one stride and dilation, and each group's padding centred on the largest kernel's (static
    ``(k-1)d/2``, or all TF 'same': its extra ``k``-``K`` padding splits evenly), that is exactly one block-diagonal
    conv whose smaller kernels are zero-padded, and the conv rule (or a strided conv's windows) applies to it.
    """
    groups = _mixed_groups(module)
    kinds = {type(g) for g in groups}
    if not kinds <= {nn.Conv2d, Conv2dSame} or len(kinds) != 1:
        return f"{where} is a MixedConv2d of {sorted(k.__name__ for k in kinds)}; only all nn.Conv2d or all Conv2dSame groups have a rule"
    if len({(g.stride, g.dilation) for g in groups}) != 1 or any(g.padding_mode != "zeros" for g in groups):
        return f"{where} is a MixedConv2d whose groups differ in stride or dilation, or pad by other than zeros; it is not one conv"
    if any(k % 2 == 0 for g in groups for k in g.kernel_size):
        return f"{where} is a MixedConv2d with an even kernel: it cannot be centred in the largest one, so it is not one conv"
    stride, dilation = groups[0].stride, groups[0].dilation
    if kinds == {Conv2dSame}:
        if stride == (1, 1) or dilation != (1, 1):
            return f"{where} is a MixedConv2d of Conv2dSame groups with stride {stride}, dilation {dilation}: only strided undilated ones aggregate"
        return None
    if stride != (1, 1) and dilation != (1, 1):
        return f"{where} is a strided dilated MixedConv2d; only undilated strided convolutions aggregate here"
    big = tuple(max(int(g.kernel_size[a]) for g in groups) for a in (0, 1))
    for g in groups:
        if isinstance(g.padding, str) or any(
            int(g.padding[a]) != (int(g.kernel_size[a]) - 1) * dilation[a] // 2 for a in (0, 1)
        ):  # odd kernels: centred in the largest exactly when each pads (k-1)d/2
            return (f"{where} is a MixedConv2d whose group of kernel {tuple(g.kernel_size)} pads {g.padding!r}, not centred on "
                    f"its largest kernel {big}: it is not one conv, and has no label rule here")
    return None


def _mixed_conv_ops(module: MixedConv2d) -> list[Op]:
    """A ``MixedConv2d`` (``_mixed_conv_refusal``: none) as the one conv it is: a stride-1 one's kernel is every
    group's ``(out, in)`` pairs, each zero-padded centred to the largest kernel (the conv rule weighs every pair
    alike: a group's weight is its pair count); a strided one's windows are the largest kernel's."""
    groups = _mixed_groups(module)
    first = groups[0]
    big = (max(int(g.kernel_size[0]) for g in groups), max(int(g.kernel_size[1]) for g in groups))
    dilation = _pair(first.dilation)
    pad = ((big[0] - 1) * dilation[0] // 2, (big[1] - 1) * dilation[1] // 2)
    if first.stride != (1, 1):
        same = type(first) is Conv2dSame
        return [Window(big, _pair(first.stride), (0, 0) if same else pad, same=same)]
    if big == (1, 1):
        return []  # 1x1 groups: a channel op

    def kernel() -> Tensor:
        def centred(w: Tensor) -> Tensor:
            dh, dw = big[0] - int(w.shape[-2]), big[1] - int(w.shape[-1])
            flat = rearrange(w, "o i kh kw -> (o i) 1 kh kw")  # one row per (out, in) pair the group connects
            return F.pad(flat, (dw // 2, dw // 2, dh // 2, dh // 2))

        return torch.cat([centred(effective_weight(g)) for g in groups])

    return [KernelConv(kernel, pad, dilation)]


def path_refusal(modules: Sequence[nn.Module], where: str, gates: tuple[type[nn.Module], ...] = ()) -> str | None:
    """Why a sequence of a block's modules has no label rule (``None``: every module has one)."""
    for i, module in enumerate(modules):
        why = _op_refusal(module, f"{where} module {i}", gates)
        if why is not None:
            return why
    return None


def path_of(modules: Sequence[nn.Module]) -> Path:
    """The spatial ops of ``modules`` in order (channel ops dropped); checked by ``path_refusal`` first."""
    ops: list[Op] = []
    for module in modules:
        mod: Any = module
        if type(module) is MixedConv2d:
            ops.extend(_mixed_conv_ops(module))
        elif type(module) is Conv2dSame and mod.stride == (1, 1):
            ops.append(_same_kernel_conv(mod))
        elif type(module) is ScaledStdConv2dSame and not mod.same_pad:  # its 'same' padding static: a plain conv
            if module.stride != (1, 1):
                ops.append(Window(_pair(mod.kernel_size), _pair(mod.stride), _pair(mod.padding)))
            elif module.kernel_size != (1, 1):
                ops.append(module)
        elif type(module) in (Conv2dSame, AvgPool2dSame, MaxPool2dSame, ScaledStdConv2dSame):  # strided (path_refusal), pools:
            ops.append(Window(_pair(mod.kernel_size), _pair(mod.stride), (0, 0), same=True))  # resolved on each grid
        elif isinstance(module, nn.Conv2d) and type(module) in _CONVS:
            if module.stride != (1, 1):
                ops.append(Window(_pair(mod.kernel_size), _pair(mod.stride), _pair(mod.padding)))
            elif module.kernel_size != (1, 1):
                ops.append(module)
        elif type(module) in (nn.MaxPool2d, nn.AvgPool2d):
            ops.append(Window(_pair(mod.kernel_size), _pair(mod.stride or mod.kernel_size), _pair(mod.padding), bool(mod.ceil_mode)))
        elif type(module) is BlurPool2d:
            pad = int(mod.padding[0])
            ops.append(Window(_pair(mod.filt_size), _pair(mod.stride), (pad, pad)))
    return tuple(ops)


def path_grid(path: Path, grid: tuple[int, int]) -> tuple[int, int]:
    """The grid ``path`` maps ``grid`` to (only windows change it)."""
    for op in path:
        if isinstance(op, (Window, Parallel)):
            grid = op.out_grid(grid)
    return grid


def path_convs(path: Path) -> Iterator[nn.Conv2d | KernelConv]:
    """The stride-1 convs of ``path`` (``KernelConv``\\ s too), those inside ``Parallel`` branches included."""
    for op in path:
        if isinstance(op, Parallel):
            for b in op.branches:
                yield from path_convs(b)
        elif isinstance(op, (nn.Conv2d, KernelConv)):
            yield op


_Groups = tuple[
    dict[tuple[int, ...], list[nn.Module | KernelConv]],
    dict[tuple[Any, ...], list[nn.Module | KernelConv]],
    dict[nn.Module | KernelConv, tuple[tuple[int, int], tuple[int, int]]],
]
"""``Kernels._groups``: the convs by kernel shape, by kernel shape and geometry, and each conv's geometry."""


def path_joins(path: Path) -> Iterator[Parallel]:
    """The ``Parallel`` joins of ``path``, those inside branches included."""
    for op in path:
        if isinstance(op, Parallel):
            yield op
            for b in op.branches:
                yield from path_joins(b)


@dataclass
class _FusedJoins:
    """``Kernels.join``'s work for the joins of one ``JoinShape``: their centred kernels, unscaled ``(j, r, kh, kw)``
    (the tap weights' convolution reads them) and scaled by the branches' shares (or by a residual's folded shares:
    ``folded_shares``), the grouped conv weights per label channel count and the tap weights per grid, each made on
    its first ask for all the joins at once."""

    joins: list[Parallel]
    """The joins, in row order (held: ``index`` is keyed by their ids)."""
    index: dict[int, int]
    """``id`` of each join -> its row."""
    unscaled: Tensor
    flat: Tensor
    """``unscaled`` viewed ``(j r, 1, kh, kw)``: the tap weights' convolution's weight on every grid."""
    scaled: dict[float | None, Tensor]
    """By the residual share folded in (``None``: the join alone)."""
    weights: dict[tuple[int, float | None], tuple[Tensor, ...]]
    masses: dict[tuple[int, int], tuple[Tensor, ...]]


def folded_shares(shares: Sequence[float], shape: JoinShape, residual: float) -> tuple[float, ...]:
    """A join's branch shares with a residual's mean folded in: ``lerp(y, sum_i s_i M_i y, r)`` is the join with shares
    ``r s_i``, its (first) identity branch's raised by ``1 - r``; they still sum to 1. ``shape`` must hold an identity."""
    first = shape.index(None)
    return tuple(residual * s + (1.0 - residual if i == first else 0.0) for i, s in enumerate(shares))


class Kernels:
    """The label kernels ``(kh, kw)`` of a forward's stride-1 convs, by conv, computed together (``label_kernels``)
    on the first read: once per forward rather than a few operators per conv as each block is reached, and not at
    all where no path is applied (``NoAlign``). ``joins``: the forward's ``Parallel`` joins, whose fused weights
    (``join``) are made together too."""

    def __init__(self, convs: Iterable[nn.Conv2d | KernelConv], joins: Iterable[Parallel] = ()) -> None:
        self._convs = list(dict.fromkeys(convs))
        # the running forward's plan of grids to build together (``GridPlan``; None: each grid as it is asked), and
        # this object's place in it (a forward's ``Kernels`` in the order they are made: one conv group's asks are
        # not read as another's)
        self._plan = current_plan()
        self._scope = self._plan.scope() if self._plan is not None else 0
        self._joins = list({id(op): op for op in joins}.values())  # by identity: a join's branches may hold unhashable ops
        self._fused: dict[Any, _FusedJoins] = {}
        # ``id`` of a join -> the join (held, so that its id is not reused while this lives) and its ``join_shape``
        self._shapes: dict[int, tuple[Parallel, JoinShape | None]] = {}
        self._kernels: dict[nn.Module | KernelConv, Tensor] | None = None
        self._wide: dict[tuple[nn.Module | KernelConv, int], Tensor] = {}
        self._mass: dict[tuple[nn.Module | KernelConv, tuple[int, int]], Tensor] = {}
        self._matrix: dict[tuple[nn.Module | KernelConv, tuple[int, int]], Tensor] = {}
        # a stack's key and a grid -> its convs and their matrices (g, n, n) on the grid (``_matrices``)
        self._matrices: dict[tuple[tuple[Any, ...], tuple[int, int]], tuple[list[nn.Module | KernelConv], Tensor]] = {}
        self._residual: dict[tuple[nn.Module | KernelConv, tuple[int, int], float, int], Tensor] = {}
        self._stacked_residual: dict[tuple[nn.Module | KernelConv, tuple[int, int], float], Tensor] = {}  # (g, n, n)
        self._tap_rows: dict[tuple[Any, ...], Tensor] = {}  # a stack's key -> its kernels as rows (g, kh kw)
        self._stacks: dict[tuple[Any, ...], tuple[list[nn.Module | KernelConv], Tensor | None]] = {}
        self._grouped: _Groups | None = None

    def get(self, conv: nn.Module | KernelConv) -> Tensor | None:
        if self._kernels is None:
            with torch.no_grad():  # labels carry no gradient: the weights are read without a detach each
                self._kernels = dict(zip(self._convs, label_kernels(conv_weights(self._convs))))
        return self._kernels.get(conv)

    def label_kernel(self, conv: nn.Conv2d | KernelConv) -> Tensor:
        """``conv``'s label kernel ``(kh, kw)``: the one computed together where this holds it, else the conv's own."""
        kernel = self.get(conv)
        return kernel_labels(_op_weight(conv)) if kernel is None else kernel

    def _stack(self, key: tuple[Any, ...], members: list[nn.Module | KernelConv]) -> tuple[list[nn.Module | KernelConv], Tensor | None]:
        """The kernels of ``members`` stacked ``(g, 1, kh, kw)`` (a stack and a view, once per forward and ``key``), or
        ``None`` where they are fewer than ``_WIDE_GROUP`` (then one operator per conv costs less)."""
        if key not in self._stacks:
            assert self._kernels is not None
            stacked = self._rows_of(members) if len(members) >= _WIDE_GROUP else None
            self._stacks[key] = (members, stacked)
        return self._stacks[key]

    def _rows_of(self, members: list[nn.Module | KernelConv], channel: bool = True) -> Tensor:
        """The kernels of ``members`` stacked ``(g, 1, kh, kw)`` (``(g, kh, kw)`` without ``channel``): in eager mode a
        view of the memory they lie in where they are consecutive rows of one tensor, in order (``label_kernels``
        unbinds each tap count's kernels from one tensor, and both keep the forward's order of a shape's convs, as a
        rule), else a stack of them (a copy)."""
        assert self._kernels is not None
        kernels = [self._kernels[c] for c in members]
        first = kernels[0]
        if not torch.compiler.is_compiling() and first._base is not None and all(
            k._base is first._base and k.is_contiguous() and k.shape == first.shape
            and k.storage_offset() == first.storage_offset() + j * first.numel() for j, k in enumerate(kernels)
        ):  # the same memory, row after row: the rows as they lie (one view, whichever shape)
            kh, kw = int(first.shape[-2]), int(first.shape[-1])
            if not channel:
                return first.as_strided((len(kernels), kh, kw), (kh * kw, kw, 1))
            return first.as_strided((len(kernels), 1, kh, kw), (kh * kw, kh * kw, kw, 1))
        return torch.stack(kernels).unsqueeze(1) if channel else torch.stack(kernels)

    def _alike(self, kernel: Tensor, conv: nn.Module | KernelConv, geometry: bool) -> tuple[tuple[Any, ...], list[nn.Module | KernelConv]]:
        """The convs whose kernels have ``kernel``'s shape (and, with ``geometry``, ``conv``'s padding and dilation),
        and the key of their stack: one stack serves both where all of a shape share their geometry. The groups are
        made once a forward (``_groups``), not by a scan of every conv per ask (asked per conv and grid: a scan
        each made the asks quadratic, 0.5 ms a forward of GhostNet's 34 convs in Python)."""
        by_shape, by_geometry, geometry_of = self._groups()
        shape = tuple(kernel.shape)
        same = by_shape[shape]
        if geometry:
            key = (shape, geometry_of[conv])
            alike = by_geometry[key]
            if len(alike) < len(same):
                return key, alike
        return (shape,), same

    def _groups(self) -> _Groups:
        """The convs by kernel shape, by kernel shape and geometry (each in the forward's order), and each conv's
        geometry (``_geometry``), made on the first ask."""
        if self._grouped is None:
            assert self._kernels is not None
            by_shape: dict[tuple[int, ...], list[nn.Module | KernelConv]] = {}
            by_geometry: dict[tuple[Any, ...], list[nn.Module | KernelConv]] = {}
            geometry_of = {c: _geometry(c) for c in self._kernels}
            for c, k in self._kernels.items():
                by_shape.setdefault(tuple(k.shape), []).append(c)
                by_geometry.setdefault((tuple(k.shape), geometry_of[c]), []).append(c)
            self._grouped = (by_shape, by_geometry, geometry_of)
        return self._grouped

    def wide(self, conv: nn.Module | KernelConv, channels: int) -> Tensor | None:
        """``get(conv)`` expanded to the depthwise weight ``(channels, 1, kh, kw)`` ``conv_steps_on_grid`` convolves
        labels with.

        Kernels of one shape are expanded together (a stack and a view shared with ``mass``, an expand and an
        unbind: not one operator per conv), where a shape has at least ``_WIDE_GROUP`` convs.
        """
        kernel = self.get(conv)
        if kernel is None:
            return None
        if (conv, channels) not in self._wide:
            kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
            same, stacked = self._stack(*self._alike(kernel, conv, geometry=False))
            if stacked is None:
                return kernel.expand(channels, 1, kh, kw)
            expanded = stacked.unsqueeze(1).expand(-1, channels, -1, -1, -1)  # g channels 1 kh kw
            self._wide.update(((c, channels), k) for c, k in zip(same, expanded.unbind(0)))
        return self._wide[(conv, channels)]

    def join_shape(self, op: Parallel) -> JoinShape | None:
        """``op``'s ``JoinShape`` where it fuses (``fused_join``): every branch the identity or one stride-1 'same' conv
        of dilation 1 whose label kernel this holds, at least two of them convs; else ``None``."""
        if id(op) not in self._shapes:
            self._shapes[id(op)] = (op, self._join_shape(op))
        return self._shapes[id(op)][1]

    def _join_shape(self, op: Parallel) -> JoinShape | None:
        shape: list[tuple[int, int] | None] = []
        for branch in op.branches:
            if not branch:
                shape.append(None)
                continue
            conv = branch[0]
            if len(branch) != 1 or not isinstance(conv, (nn.Conv2d, KernelConv)):
                return None
            kernel = self.get(conv)
            if kernel is None or kernel.dim() != 2:
                return None
            kh, kw = int(kernel.shape[0]), int(kernel.shape[1])
            if _geometry(conv) != ((kh // 2, kw // 2), (1, 1)) or kh % 2 == 0 or kw % 2 == 0:
                return None
            shape.append((kh, kw))
        return tuple(shape) if sum(k is not None for k in shape) >= 2 else None

    def join(
        self, op: Parallel, grid: tuple[int, int], channels: int, residual: float | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """``op``'s fused weight ``(channels r, 1, kh, kw)`` and tap weights ``(r, h, w)`` on ``grid``
        (``fused_join``), made on the first ask for every join of its ``JoinShape`` this holds (``joins``): a few
        operators a forward, not a few per join; ``None`` where ``op`` does not fuse (``join_shape``), or where
        ``residual`` is given and ``op`` has no identity branch. ``residual``: a residual's share ``r`` folded in
        (``folded_shares``): the weight then mixes ``lerp(y, join(y), r)``."""
        shape = self.join_shape(op)
        if shape is None or (residual is not None and None not in shape):
            return None
        held = any(p is op for p in self._joins)
        key: Any = shape if held else (shape, id(op))  # a join not held here: made alone
        fused = self._fused.get(key)
        if fused is None:
            members = [p for p in self._joins if self.join_shape(p) == shape] if held else [op]
            branches = [None if k is None else self._rows_of([_only_conv(p.branches[i]) for p in members], channel=False)
                        for i, k in enumerate(shape)]
            device = next(b for b in branches if b is not None).device
            unscaled = window_kernels(shape, branches, len(members), device)  # j r kh kw
            j, r, kh, kw = (int(s) for s in unscaled.shape)
            flat = unscaled.view(j * r, 1, kh, kw)
            fused = self._fused[key] = _FusedJoins(members, {id(p): i for i, p in enumerate(members)}, unscaled, flat, {}, {}, {})
        if residual not in fused.scaled:
            shares = tuple(tuple(p.shares()) if residual is None else folded_shares(p.shares(), shape, residual) for p in fused.joins)
            fused.scaled[residual] = fused.unscaled * join_shares(shares, fused.unscaled.device)
        if (channels, residual) not in fused.weights:  # every label channel's r kernels: (j, l r, 1, kh, kw), one copy
            scaled = fused.scaled[residual]
            j, r, kh, kw = (int(s) for s in scaled.shape)
            wide = scaled.unsqueeze(1).expand(j, channels, r, kh, kw).reshape(j, channels * r, 1, kh, kw)
            fused.weights[(channels, residual)] = wide.unbind(0)
        if grid not in fused.masses:
            fused.masses[grid] = join_masses(fused.unscaled, grid, fused.flat).unbind(0)
        i = fused.index[id(op)]
        return fused.weights[(channels, residual)][i], fused.masses[grid][i]

    def mass(self, conv: nn.Module | KernelConv, grid: tuple[int, int]) -> Tensor | None:
        """``conv``'s in-grid tap weight ``(1, h, w)`` on ``grid`` (each position's sum of the label kernel's taps that
        fall inside the grid), computed for every conv of its kernel shape, padding and dilation on that grid in
        one call (``tap_weights``: a conv of ones, or on the CPU's eager route two small products; then an unbind per
        grid: where a shape has at least ``_WIDE_GROUP`` convs, fewer operators than one per step), and with a
        ``GridPlan`` on every grid the last forward asked for at once, with the group's matrices on its small grids
        (``_planned_build``); ``None``: not held here, or too few alike (``conv_steps_on_grid`` then computes it per
        step)."""
        kernel = self.get(conv)
        if kernel is None:
            return None
        key, alike = self._alike(kernel, conv, geometry=True)
        if self._plan is not None:
            self._plan.ask("mass", (self._scope, key), grid)
        if (conv, grid) not in self._mass:
            same, stacked = self._stack(key, alike)
            if stacked is None:
                return None
            padding, dilation = _geometry(conv)
            if not self._planned_build(key, same, stacked, conv, "mass", grid):
                built = tap_weights(stacked, grid, padding, dilation).unbind(1)  # 1 g h w -> (1 h w) each
                self._mass.update(((c, grid), t) for c, t in zip(same, built, strict=True))
        return self._mass[(conv, grid)]

    def matrix(self, conv: nn.Module | KernelConv, grid: tuple[int, int]) -> Tensor | None:
        """``conv``'s label mix ``Norm(T(kernel))`` ``(n, n)`` on a small ``grid`` (the dense route, where
        ``depthwise_route`` is false), built for every conv of its kernel shape, padding and dilation on that grid
        together (``tap_mixes`` of their stacked kernels: one product, one sum and one division per grid and shape,
        where ``conv_chain`` spends three operators per block). ``None``: not held here, or too few alike
        (``_WIDE_GROUP``; ``conv_chain`` then builds it)."""
        if (conv, grid) not in self._matrix:
            built = self._matrices_of(conv, grid)
            if built is None:
                return None
            same, matrices = built
            self._matrix.update(((c, grid), m) for c, m in zip(same, matrices.unbind(0), strict=True))
        return self._matrix[(conv, grid)]

    def has_matrix(self, conv: nn.Module | KernelConv, grid: tuple[int, int]) -> bool:
        """Whether ``matrix`` (and ``residual``) answer for ``conv`` on ``grid``; builds the grid's matrices (cached)."""
        return self._matrices_of(conv, grid) is not None

    def residual(self, conv: nn.Module | KernelConv, grid: tuple[int, int], share: float, batch: int) -> Tensor | None:
        """The labels' map ``lerp(I, M, share)`` ``(n, n)``, expanded ``(batch, n, n)``, of a residual whose branch is
        ``conv`` alone on a small ``grid`` (``M = matrix(conv, grid)``; ``share``: ``Rules.residual_share``): the
        branch's mix and the residual's mean in one matrix, so that such a block's labels are one product
        (``residual_labels``), not a product and a ``lerp``. Made for every conv of the shape on the grid together,
        from their matrices: one ``lerp`` per grid and shape. Expanded as ``mix_tokens``' batched product reads it:
        one strided view and an unbind per grid, shape and batch, where an expand per block dispatches one each.
        ``None`` where ``matrix`` is."""
        if (conv, grid, share, batch) not in self._residual:
            built = self._matrices_of(conv, grid)
            if built is None:
                return None
            same, matrices = built
            n = grid[0] * grid[1]
            if (conv, grid, share) not in self._stacked_residual:
                maps = torch.lerp(_identity(n, matrices.device), matrices, share)  # g n n, the identity broadcast
                self._stacked_residual.update(((c, grid, share), maps) for c in same)
            maps = self._stacked_residual[(conv, grid, share)]  # a fresh lerp's: contiguous
            maps = maps.as_strided((len(same), batch, n, n), (n * n, 0, n, 1))
            self._residual.update(((c, grid, share, batch), m) for c, m in zip(same, maps.unbind(0), strict=True))
        return self._residual[(conv, grid, share, batch)]

    def _matrices_of(self, conv: nn.Module | KernelConv, grid: tuple[int, int]) -> tuple[list[nn.Module | KernelConv], Tensor] | None:
        """The convs of ``conv``'s kernel shape, padding and dilation and their matrices ``Norm(T(kernel))``
        ``(g, n, n)`` on ``grid``, built once a forward and grid; ``None``: not held here, or too few alike."""
        kernel = self.get(conv)
        if kernel is None:
            return None
        key, alike = self._alike(kernel, conv, geometry=True)
        same, stacked = self._stack(key, alike)
        if stacked is None:
            return None
        if self._plan is not None:
            self._plan.ask("matrix", (self._scope, key), grid)
        if (key, grid) not in self._matrices and not self._planned_build(key, same, stacked, conv, "matrix", grid):
            g, shape, n = int(stacked.shape[0]), (int(stacked.shape[-2]), int(stacked.shape[-1])), grid[0] * grid[1]
            taps = tap_matrices_for(grid, shape, *_geometry(conv), stacked.device)
            self._matrices[(key, grid)] = (same, tap_mixes(self._rows_of_stack(key, stacked), taps, (g, n, n)))
        return self._matrices[(key, grid)]

    def _rows_of_stack(self, key: tuple[Any, ...], stacked: Tensor) -> Tensor:
        """The stack of ``key`` as rows of taps ``(g, kh kw)``: one view for every grid it is asked on."""
        if key not in self._tap_rows:
            self._tap_rows[key] = stacked.view(int(stacked.shape[0]), -1)
        return self._tap_rows[key]

    def _planned_build(
        self, key: tuple[Any, ...], same: list[nn.Module | KernelConv], stacked: Tensor, conv: nn.Module | KernelConv,
        what: str, grid: tuple[int, int],
    ) -> bool:
        """At a group's ask for its ``what`` (``"mass"`` or ``"matrix"``) on ``grid``, with a ``GridPlan``: its masses
        on every large grid and its matrices on every small grid the last forward asked for (``grid`` among them, or
        with them), in one product and one division (``labels_on_grids``), where each grid took its own call and a
        group's masses and its matrices one each. Whether it built; not where the plan holds ``grid`` alone or the
        conv changes its grid (then the ask builds its own)."""
        plan = self._plan
        if plan is None:
            return False
        padding, dilation = _geometry(conv)
        shape = (int(stacked.shape[-2]), int(stacked.shape[-1]))
        if not keeps_grid(shape, padding, dilation):
            return False
        scoped = (self._scope, key)

        def grids_of(kind: str) -> tuple[tuple[int, int], ...]:  # the asked kind's plan holds ``grid``; the other's as it is
            return plan.planned(kind, scoped, grid) if kind == what else plan.last.get((kind, scoped), ())

        masses = [x for x in grids_of("mass") if (same[0], x) not in self._mass]
        matrices = [x for x in grids_of("matrix") if (key, x) not in self._matrices]
        if len(masses) + len(matrices) < 2:
            return False
        built_matrices, built_masses = labels_on_grids(self._rows_of_stack(key, stacked), matrices, masses, shape, padding, dilation)
        self._matrices.update(((key, x), (same, m)) for x, m in zip(matrices, built_matrices, strict=True))
        for x, per_conv in zip(masses, built_masses, strict=True):
            self._mass.update(((c, x), t) for c, t in zip(same, per_conv, strict=True))
        return True


@shape_cache(maxsize=16)
def _identity(n: int, device: torch.device) -> Tensor:
    """``(n, n)`` fp32 identity (a constant of the grid: cached)."""
    return torch.eye(n, device=device)


_FOLDED = [True]
"""Whether a GPU's eager walk folds residuals into their branch's matrices (``folded_residuals``)."""


def folded_residuals(on: bool) -> AbstractContextManager[None]:
    """Inside, a GPU's eager walk folds a residual's mean into its branch's conv matrices (``on``, the default:
    ``residual_labels``), and a downsampling block's shortcut and branch into one matrix (``projected_route``), or
    mixes the branch's labels, aggregates the shortcut's and takes the ``lerp`` (the CPU's route, the tested
    fallback): ``benchmarks/gpu_suite.py --family-mode eager --family-routes residuals=lerp`` times both on a GPU."""
    return switched(_FOLDED, on)


def residual_route(tracker: LabelTracker, branch: Path, grid: tuple[int, int], labels: Tensor) -> bool:
    """Whether ``residual_labels`` folds the residual's mean into the branch's matrices (``Kernels.residual``): a
    branch of stride-1 convs alone on a small grid, on a GPU's eager route (and the CPU's under ``launch_routes``;
    not the CPU's eager walk, nor a compiled graph, which fuses the ``lerp``), for the fast path's tracker, unless
    ``folded_residuals(False)``. One product a block instead of a product a conv and a ``lerp``."""
    return (_FOLDED[0] and isinstance(tracker, CompactTracker) and len(branch) > 0
            and all(isinstance(op, (nn.Conv2d, KernelConv)) for op in branch) and not eager_cpu_routes(labels.device)
            and not torch.compiler.is_compiling() and not depthwise_route(grid, labels.device))


_PROJECTED_POSITIONS = 4 * _DENSE_LAUNCH_TOKENS
"""The most positions a grid of a projected block's paths may have for ``projected_route`` to fold it into one matrix:
a stride-2 block into a 14x14 grid reads a 28x28 one (its window's matrix ``(196, 784)``, 600 KiB, cached)."""


def projected_route(tracker: LabelTracker, labels: Tensor, keep: Tensor | None) -> bool:
    """Whether ``block_labels`` may fold a block with a projection shortcut (a downsampling block: its branch's windows
    and convs, its shortcut's window) into one matrix (``projected_map``): on a GPU's eager route (the CPU's under
    ``launch_routes``; not the CPU's eager walk, whose bits the targets digest holds, nor a compiled graph, which
    fuses the pools and the ``lerp``), for the fast path's tracker, where no sample dropped the branch (``keep``
    ``None``: the aggregated labels are not needed apart), unless ``folded_residuals(False)``."""
    return _FOLDED[0] and isinstance(tracker, CompactTracker) and keep is None and eager_launch_routes(labels.device)


def path_maps(path: Path, grid: tuple[int, int], kernels: Kernels, device: torch.device) -> tuple[list[Tensor], tuple[int, int]] | None:
    """The ``(n', n)`` fp32 matrices of ``path``'s ops in order, a run of windows as one (``_window_kron``, cached),
    a stride-1 conv as its ``Kernels.matrix``, and the grid the path ends on; ``None`` where an op has none here: a
    ``Parallel``, a conv on a grid of the depthwise route or without a forward's matrix, a grid over
    ``_PROJECTED_POSITIONS``."""
    maps: list[Tensor] = []
    i = 0
    while i < len(path):
        if grid[0] * grid[1] > _PROJECTED_POSITIONS:
            return None
        op = path[i]
        if isinstance(op, Window):
            run, i = window_run(path, i)
            maps.append(_window_kron(grid, window_axes(run, grid), device))
            grid = path_grid(tuple(run), grid)
        elif isinstance(op, (nn.Conv2d, KernelConv)):
            m = None if depthwise_route(grid, device) else kernels.matrix(op, grid)
            if m is None:
                return None
            maps.append(m)
            i += 1
        else:
            return None
    return (maps, grid) if grid[0] * grid[1] <= _PROJECTED_POSITIONS else None


def projected_map(branch: list[Tensor], shortcut: list[Tensor], share: float, scale: float = 1.0) -> Tensor:
    """``lerp(S, B, share)`` ``(n', n)``: the labels' map of a block whose branch's ops have the matrices ``branch``
    (``B`` their product) and whose shortcut's have ``shortcut`` (``S``), the residual's mean (``Rules.residual_share``)
    of the two. Built by ``addmm`` with the branch's first matrix last (one operator where the branch has two ops: a
    ResNet's strided window and conv), by ``lerp`` where the branch is one op (windows alone: a Bottleneck's). Times
    ``scale`` (``CompactTracker.projected_by``'s): ``addmm``'s own factors, a multiplication after the ``lerp``."""
    short = shortcut[0]
    for m in shortcut[1:]:
        short = m @ short
    *later, first = reversed(branch)
    if not later:
        mean = torch.lerp(short, first, share)
        return mean if scale == 1.0 else mean * scale
    rest = later[0]
    for m in later[1:]:
        rest = rest @ m
    return torch.addmm(short, rest, first, beta=(1.0 - share) * scale, alpha=share * scale)


def _residual_join(tracker: LabelTracker, branch: Path, kernels: Kernels, labels: Tensor, grid: tuple[int, int]) -> Parallel | None:
    """The join of a branch that is one fusable ``Parallel`` with an identity branch (InceptionNeXt's token mixer), on
    a GPU's route (``fused_join_route``) with the fast path's tracker, unless ``folded_residuals(False)``: the
    residual's mean then folds into the join's shares (``folded_shares``), one ``lerp`` fewer a block."""
    if not (_FOLDED[0] and isinstance(tracker, CompactTracker) and len(branch) == 1 and isinstance(branch[0], Parallel)
            and fused_join_route(labels.device, grid)):
        return None
    shape = kernels.join_shape(branch[0])
    return branch[0] if shape is not None and None in shape else None


def partial_branch(branch: Path) -> tuple[Path, float] | None:
    """A branch that is one ``Parallel`` of a chain of stride-1 convs and the identity (a partial conv: FasterNet's
    PConv convolves a quarter of the channels and passes the rest), as that chain and its share ``p``; ``None``
    otherwise. Its labels are ``lerp(y, C y, p)``, so a residual around it is ``lerp(y, C y, s p)``: one ``lerp`` (or
    one matrix, ``residual_labels``) where the concatenation's and the residual's took two."""
    if len(branch) != 1 or not isinstance(branch[0], Parallel) or len(branch[0].branches) != 2:
        return None
    (first, second), shares = branch[0].branches, branch[0].shares()
    if bool(first) == bool(second):
        return None  # not exactly one empty branch
    chain, share = (first, shares[0]) if first else (second, shares[1])
    if not all(isinstance(op, (nn.Conv2d, KernelConv)) for op in chain):
        return None
    return chain, share


def residual_labels(
    tracker: LabelTracker, layer: int, keep: Tensor | None, labels: Tensor | None, branch: Path, grid: tuple[int, int],
    kernels: Kernels | None,
) -> None:
    """``tracker.residual`` of a block whose shortcut is the identity and whose branch's labels are ``branch``'s map of
    ``labels`` (``labels_for(layer)``; ``None``: the layer is not aligned).

    Where ``residual_route`` holds and ``kernels`` has every conv's matrix ``M_i`` on the grid, the residual's labels
    are one product with ``lerp(I, M_k ... M_1, share)``: for one conv ``Kernels.residual`` (every such block's made
    together, one ``lerp`` per grid and shape), for a chain its product and the mean in ``k - 1`` matrix products
    of the block's own (an ``addmm`` last). Else the branch's labels and the residual's ``lerp``. A partial conv's
    branch (``partial_branch``: the chain's share ``p`` of the channels) folds its concatenation in too, off the CPU's
    eager route: the residual's share becomes ``share * p`` of the chain's map (one ``lerp`` where the fold does not
    apply)."""
    # a partial conv's branch: its conv chain, by share ``p`` of the residual's (not on the CPU's eager route, whose
    # two ``lerp``\ s keep their bits, nor under ``folded_residuals(False)``; a GPU launches one operator fewer a
    # block, two where the fold below applies)
    compact = isinstance(tracker, CompactTracker)  # ``residual_by``: the fast path's tracker (a dense one mixes its own way)
    partial = partial_branch(branch) if labels is not None and compact and _FOLDED[0] and not eager_cpu_routes(labels.device) else None
    chain, p = partial if partial is not None else (branch, 1.0)
    if labels is not None and kernels is not None and residual_route(tracker, chain, grid, labels):
        assert isinstance(tracker, CompactTracker)
        convs = [op for op in chain if isinstance(op, (nn.Conv2d, KernelConv))]
        with fp32_labels(labels.device):  # the matrices' products in fp32 under a caller's autocast, as apply_path's
            # one conv: its folded map alone is read (``Kernels.residual``), not its matrix (an unbind per grid)
            held = all(kernels.has_matrix(c, grid) for c in convs)  # ``matrix`` answers exactly where this holds
            matrices = [kernels.matrix(c, grid) for c in convs] if held and len(convs) > 1 else []
        if held:
            def mix(y: Tensor, residual_share: float) -> Tensor:
                share = residual_share * p
                if len(convs) == 1:
                    folded = kernels.residual(convs[0], grid, share, int(y.shape[0]))
                else:  # (1 - s) I + s M_k ... M_2 M_1, the products' rows each summing to 1
                    *rest, first = [m for m in reversed(matrices) if m is not None]
                    later = rest[0]
                    for m in rest[1:]:
                        later = later @ m
                    folded = torch.addmm(_identity(grid[0] * grid[1], y.device), later, first, beta=1.0 - share, alpha=share)
                assert folded is not None  # ``matrix`` answered for these convs and grid
                return mix_tokens(folded, y.float())

            tracker.residual_by(layer, keep, mix)  # which calls ``mix`` in an fp32 region
            return
    if labels is not None and partial is not None:
        assert isinstance(tracker, CompactTracker)
        tracker.residual_by(layer, keep, lambda y, share: torch.lerp(y, apply_path(chain, y, grid, kernels)[0], share * p))
        return
    if labels is not None and kernels is not None and (join := _residual_join(tracker, branch, kernels, labels, grid)) is not None:
        def joined(y: Tensor, share: float) -> Tensor:
            fused = kernels.join(join, grid, int(y.shape[-1]), residual=share)
            assert fused is not None  # _residual_join checked that it fuses with an identity branch
            return as_tokens(fused_join(as_grid(y, grid), *fused))

        assert isinstance(tracker, CompactTracker)  # _residual_join checked it
        tracker.residual_by(layer, keep, joined)
        return
    if labels is not None and branch:
        _residual_of(tracker, layer, keep, labels, branch, grid, kernels)
    else:
        tracker.residual(layer, keep, mixed=None)


def _only_conv(branch: Path) -> nn.Module | KernelConv:
    """The one conv of a fused join's conv branch (``Kernels.join_shape`` checked it)."""
    (conv,) = branch
    assert isinstance(conv, (nn.Conv2d, KernelConv))
    return conv


def _geometry(conv: nn.Module | KernelConv) -> tuple[tuple[int, int], tuple[int, int]]:
    """A stride-1 conv's padding and dilation."""
    c: Any = conv
    return _pair(c.padding), _pair(c.dilation)


_WIDE_GROUP = 5
"""Convs of one kernel shape (and geometry) from which ``Kernels.wide`` expands them and ``Kernels.mass`` computes their
tap weights together (a few operators per shape, against one per conv)."""


def conv_weights(convs: Sequence[nn.Conv2d | KernelConv]) -> list[Tensor]:
    """The weights ``convs`` convolve with (``effective_weight``; a ``KernelConv``'s kernel), the fold scales of
    every ``KernelConv``'s norms computed together, and ``KernelConv`` objects of one ``KernelBatch`` key built together."""
    scales = scales_of(n for c in convs if isinstance(c, KernelConv) for n in c.norms)
    batches: dict[tuple[Any, ...], list[int]] = {}
    for i, c in enumerate(convs):
        if isinstance(c, KernelConv) and c.batch is not None:
            batches.setdefault(c.batch.key, []).append(i)
    built: dict[int, Tensor] = {}
    for members in batches.values():
        if len(members) > 1:
            first = convs[members[0]]
            assert isinstance(first, KernelConv) and first.batch is not None
            modules = [c.batch.module for c in (convs[i] for i in members) if isinstance(c, KernelConv) and c.batch is not None]
            built.update(zip(members, first.batch.build(modules, scales), strict=True))
    return [built[i] if i in built else c.kernel_with(scales) if isinstance(c, KernelConv) else effective_weight(c)
            for i, c in enumerate(convs)]


def path_kernels(paths: Iterable[Path]) -> Kernels:
    """The ``Kernels`` of every stride-1 conv and join in ``paths``."""
    paths = list(paths)
    return Kernels((conv for path in paths for conv in path_convs(path)), (op for path in paths for op in path_joins(path)))


def block_kernels(tracker: LabelTracker, blocks: Sequence[tuple[Path, Path | None]], *more: Path) -> Kernels:
    """``path_kernels`` of the paths ``block_labels`` will apply: every shortcut, a branch where its layer's
    labels are read (``labels_for``) or the block has no shortcut, and ``more`` (a stem's)."""
    used = [b for layer, (b, s) in enumerate(blocks) if s is None or tracker.labels_for(layer) is not None]
    return path_kernels([*more, *used, *(s for _, s in blocks if s)])


def read_kernels(
    blocks: Sequence[nn.Module], tracker: LabelTracker, convs_of: Callable[[Any], Iterable[nn.Conv2d | KernelConv]]
) -> Kernels | None:
    """The ``Kernels`` of ``convs_of(block)`` for every block whose layer's labels are read (block ``i`` is layer
    ``i``), computed together on the first read (a few operators for all of them, not five per conv); ``None`` under
    FSDP2's per-block sharding, where a block's parameters are whole only inside its own hooked call (``apply_path``
    then computes each conv's kernel there)."""
    if any(is_sharded(blk) for blk in blocks):
        return None
    return Kernels(c for layer, blk in enumerate(blocks) if tracker.labels_for(layer) is not None for c in convs_of(blk))


def apply_path(path: Path, labels: Tensor, grid: tuple[int, int], kernels: Kernels | None = None) -> tuple[Tensor, tuple[int, int]]:
    """Labels ``(b, n, l)`` through ``path`` (fp32), rows normalised op by op; and the grid it ends on.

    A run of consecutive windows is pooled (one ``avg_pool2d`` a window), or one dense matrix, or one pair of
    per-axis matrices (``backbones._windows``: a pixel-grid stem's conv and pool windows cost two small matrix
    products together), as ``window_route`` chooses by size and device. A conv's
    label kernel is read from ``kernels`` where it holds one, else the path's own are computed together here
    (``path_kernels``: a stem's convs, a block's under FSDP2's per-block sharding).
    """
    y, on_grid, grid = walk_path(path, labels, grid, kernels)
    return (as_tokens(y) if on_grid else y), grid


def walk_path(
    path: Path, labels: Tensor, grid: tuple[int, int], kernels: Kernels | None = None, *, on_grid: bool = False,
) -> tuple[Tensor, bool, tuple[int, int]]:
    """``apply_path`` leaving the labels in whichever layout its last op did: ``(labels, on_grid, grid)``, the labels
    ``(b, l, h, w)`` (``as_grid``'s view) where ``on_grid``, else ``(b, n, l)``. ``on_grid``: ``labels`` are given in
    the grid layout. A caller that goes on with several paths on one grid (FocalNet's levels) changes the layout
    once, not twice a path."""
    if kernels is None:
        kernels = path_kernels([path])
    with fp32_labels(labels.device):
        y, grid = _walk(path, _Labels(labels.float(), on_grid), grid, kernels, {})
        return y.y, y.on_grid, grid


def walk_summed(path: Path, labels: Tensor, grid: tuple[int, int], kernels: Kernels) -> tuple[Tensor, Tensor | None]:
    """``apply_path`` for a residual's branch whose labels ``CompactTracker.residual_sum`` sums: ``(mixed, mass)``.
    Where the path ends with a label conv on a large grid, that conv is left undivided, ``mixed`` ``(b, l, h, w)`` and
    ``mass`` its in-grid tap weights ``(1, h, w)``; else ``mixed`` is the path's labels ``(b, n, l)``, ``mass`` ``None``."""
    with fp32_labels(labels.device):
        y, _ = _walk(path, _Labels(labels.float(), False), grid, kernels, {}, defer=True)
    return (y.y, y.mass) if y.mass is not None else (y.tokens(), None)


def _unit_convs(paths: dict[nn.Module, tuple[Path, Path | None]]) -> Iterator[nn.Conv2d | KernelConv]:
    """``path_convs`` of every unit's branch and shortcut in ``paths`` (``_all_paths``)."""
    return (op for pair in paths.values() for p in pair if p for op in path_convs(p))


def _unit_joins(paths: dict[nn.Module, tuple[Path, Path | None]]) -> Iterator[Parallel]:
    """``path_joins`` of every unit's branch and shortcut in ``paths``."""
    return (op for pair in paths.values() for p in pair if p for op in path_joins(p))


def _reads_statistics(paths: dict[nn.Module, tuple[Path, Path | None]]) -> bool:
    """Whether a label kernel of ``paths`` reads batch norms' running statistics (a ``KernelConv`` folding norms),
    which a training forward moves: then the kernels are read after the whole forward."""
    return any(isinstance(op, KernelConv) and op.norms for op in _unit_convs(paths))


@dataclass(frozen=True)
class _Labels:
    """Labels inside ``apply_path``: ``(b, n, l)``, or viewed ``(b, l, h, w)`` where ``on_grid`` (pooling and depthwise
    convs read them so). Consecutive ops of one layout share a pair of layout views, taken only where the layout
    changes: a view is an operator dispatched (no kernel, no copy)."""

    y: Tensor
    on_grid: bool
    mass: Tensor | None = None  # ``walk_summed``'s last conv left undivided: its in-grid tap weights (1, h, w)

    def grid_view(self, grid: tuple[int, int]) -> Tensor:
        return self.y if self.on_grid else as_grid(self.y, grid)

    def tokens(self) -> Tensor:
        return as_tokens(self.y) if self.on_grid else self.y


_Walked = dict[tuple[int, int], tuple[Path, "_Labels", "_Labels", tuple[int, int]]]
"""The branches one path's walk has walked: ``(id(branch), id(labels))`` -> the branch, its labels in, its labels and grid
out (holding the keys' objects, so that no id is reused while the walk lasts)."""


def _walk(
    path: Path, labels: _Labels, grid: tuple[int, int], kernels: Kernels, walked: _Walked, *, defer: bool = False,
) -> tuple[_Labels, tuple[int, int]]:
    """``apply_path``'s walk, in whichever layout its ops leave the labels; ``defer``: a last conv on a large grid left
    undivided, its in-grid tap weights in ``_Labels.mass`` (``walk_summed``)."""
    i = 0
    while i < len(path):
        op = path[i]
        if isinstance(op, Window):
            run, i = window_run(path, i)
            axes = window_axes(run, grid)
            plan = window_plan(int(labels.y.shape[0]), grid, axes, labels.y.device)
            route, ceil_modes, out = plan
            if route == "pooled" and ceil_modes is not None:  # in the grid layout, as depthwise label convs
                labels = _Labels(pool_on_grid(labels.grid_view(grid), axes, ceil_modes), True)
            else:
                labels = _Labels(average_windows(labels.tokens(), grid, axes, plan)[0], False)
            grid = out
        elif isinstance(op, Parallel):
            out = op.out_grid(grid)
            fused = (kernels.join(op, grid, int(labels.y.shape[1 if labels.on_grid else -1]))
                     if fused_join_route(labels.y.device, grid) else None)  # the label channels: their layout's axis
            if fused is not None:  # one grouped convolution for all the branches (``backbones._joins``)
                labels, grid = _Labels(fused_join(labels.grid_view(grid), *fused), True), out
                i += 1
                continue
            if depthwise_route(grid, labels.y.device) and not labels.on_grid:  # one layout view for all the branches' convs
                labels = _Labels(labels.grid_view(grid), True)
            parts = _branch_labels(op.branches, labels, grid, kernels, walked)
            on_grid = any(p.on_grid for p in parts)  # the sum on the grid where a branch ends there (the others: a view each)
            labels = _Labels(_weighted_sum([(s, p.grid_view(out) if on_grid else p.tokens()) for s, p in zip(op.shares(), parts)]), on_grid)
            grid = out
            i += 1
        else:  # a run of stride-1 convs on one grid
            end = i
            while end < len(path) and not isinstance(path[end], (Window, Parallel)):
                end += 1
            convs = [c for c in path[i:end] if isinstance(c, (nn.Conv2d, KernelConv))]  # all of them
            i = end
            if depthwise_route(grid, labels.y.device):  # expanded kernels, tap weights computed together where they are
                y = labels.grid_view(grid)
                if fold_route(y, len(convs)):
                    y = position_major(y)
                channels = int(y.shape[1]) * (int(y.shape[0]) if is_position_major(y) else 1)  # folded: b * l
                steps = [(_label_kernel(c, kernels, channels), *_geometry(c)) for c in convs]
                # compiled, the tap weights come with the shifted sums (``shifted_route``): none built to go unread
                masses = None if shifted_route(*(k for k, _, _ in steps)) else [kernels.mass(c, grid) for c in convs]
                if defer and i == len(path) and masses is not None and not is_position_major(y):
                    raw, mass = conv_steps_undivided(y, steps, masses)
                    labels = _Labels(raw, True, mass)
                else:
                    labels = _Labels(conv_steps_on_grid(y, steps, masses), True)
            else:  # small grids: the explicit matrices, built for the whole forward where ``kernels`` can
                matrices = [m for m in (kernels.matrix(c, grid) for c in convs) if m is not None]
                if len(matrices) == len(convs):
                    y = labels.tokens()
                    for t in matrices:
                        y = mix_tokens(t, y)
                    labels = _Labels(y, False)
                else:
                    steps = [(_label_kernel(c, kernels), *_geometry(c)) for c in convs]
                    labels = _Labels(conv_chain(labels.tokens(), grid, steps), False)
    return labels, grid


def _branch_labels(branches: Sequence[Path], labels: _Labels, grid: tuple[int, int], kernels: Kernels, walked: _Walked) -> list[_Labels]:
    """Each branch's labels (``_walk``). A branch that extends an earlier one (its ops first, the same modules)
    continues from that branch's labels: where a block joins every intermediate output of one chain (SelecSLS,
    VoVNet's OSA, HGNet's aggregation) the chain's convs run once, not once per output. A branch this walk has
    already walked from the same labels (``walked``) is not walked again: Res2Net's group ``i`` reads group
    ``i - 1``'s output, which the block's concatenation also joins, so each group's convs ran ``scale - i`` times."""
    done: list[tuple[Path, _Labels, tuple[int, int]]] = []
    for branch in branches:
        if (key := (id(branch), id(labels))) in walked:
            _, _, y, out = walked[key]
        else:
            shared = [d for d in done if len(d[0]) <= len(branch) and all(a is b for a, b in zip(d[0], branch))]
            base = max(shared, key=lambda d: len(d[0]), default=((), labels, grid))
            y, out = _walk(branch[len(base[0]) :], base[1], base[2], kernels, walked)
            walked[key] = (branch, labels, y, out)
        done.append((branch, y, out))
    return [y for _, y, _ in done]


def _weighted_sum(terms: Sequence[tuple[float, Tensor]]) -> Tensor:
    """``sum_i s_i y_i`` (shares summing to 1) by one ``lerp`` per further term: the running mean of the terms so
    far moves towards the next by that term's share of the shares so far (two terms: ``y_0 + s_1 (y_1 - y_0)``,
    a DenseNet layer's join)."""
    (total, y), *rest = terms
    for s, term in rest:
        total += s
        y = torch.lerp(y, term, s / total)
    return y


def _label_kernel(op: Any, kernels: Kernels, channels: int | None = None) -> Tensor:
    """The label kernel of a path's stride-1 conv: from ``kernels`` (``(channels, 1, kh, kw)`` where ``channels`` is
    given: ``Kernels.wide``), else ``(kh, kw)`` computed here (``Kernels.label_kernel``: a ``KernelConv`` that folds
    batch norms, or one made after the forward's kernels)."""
    if channels is not None and (wide := kernels.wide(op, channels)) is not None:
        return wide
    return kernels.label_kernel(op)


def _op_weight(op: nn.Conv2d | KernelConv) -> Tensor:
    """The weight a path's stride-1 conv convolves with (``effective_weight``: standardised where the conv is)."""
    return effective_weight(op) if isinstance(op, nn.Conv2d) else op.weight.detach()

def merge_matrix(grid: tuple[int, int], w: Window) -> tuple[Tensor, tuple[int, int]]:
    """The 0/1 ``(n', n)`` matrix of ``w``'s windows written out position by position (float64)."""
    (h, wd), (oh, ow) = grid, w.out_grid(grid)
    (_, _, top, _, _), (_, _, left, _, _) = w.axes(grid)  # the padding before the first row and column
    m = torch.zeros(oh * ow, h * wd, dtype=torch.float64)
    for oy in range(oh):
        for ox in range(ow):
            y0, x0 = oy * w.stride[0] - top, ox * w.stride[1] - left
            for iy in range(max(y0, 0), min(y0 + w.kernel[0], h)):
                for ix in range(max(x0, 0), min(x0 + w.kernel[1], wd)):
                    m[oy * ow + ox, iy * wd + ix] = 1.0
    return m, (oh, ow)


def path_matrix(path: Path, grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
    """The explicit ``(n', n)`` float64 matrix of ``path`` (product of row-normalised op matrices)."""
    total = torch.eye(grid[0] * grid[1], dtype=torch.float64)
    for op in path:
        if isinstance(op, Window):
            m, grid = merge_matrix(grid, op)
        elif isinstance(op, Parallel):
            out = op.out_grid(grid)
            m = sum((s * path_matrix(b, grid)[0] for s, b in zip(op.shares(), op.branches)), torch.zeros(1, dtype=torch.float64))
            grid = out
        else:
            k = kernel_reference(_op_weight(op))
            m, _ = conv_matrix(grid, k, padding=_pair(op.padding), dilation=_pair(op.dilation))
        total = row_normalise(m) @ total
    return total, grid


def start_on_path(
    scheme: Scheme, label_map: TokenLabelMap, start: tuple[int, int], grid: tuple[int, int], depth: int, stem: Path
) -> LabelTracker:
    """A pooled CNN's tracker: on ``grid`` for a token-space map; else the pixel labels (grid ``start``) through the
    stem's path: its leading windows weigh the mask directly (``start_on_windows``), the rest of the path is one
    ``aggregate``."""
    tracker, rest, mid = start_before_path(scheme, label_map, start, grid, depth, stem)
    if rest:
        aggregate_path(tracker, rest, mid)
    return tracker


def start_before_path(
    scheme: Scheme, label_map: TokenLabelMap, start: tuple[int, int], grid: tuple[int, int], depth: int, stem: Path
) -> tuple[LabelTracker, Path, tuple[int, int]]:
    """``start_on_path`` up to the stem's ops after its leading windows: the tracker, those ops (still to apply, as
    one ``aggregate``), and the grid they start on.

    A token-space map starts on the stem's ``grid``, the stem left out (MixToken mixed its output). Any other map
    starts on the pixels, whose grid a stem of stride 1 keeps (VGG's first conv): that ``start == grid`` does not
    make it a token-space map, and its convs still mix the labels."""
    if label_map.token_space:
        return scheme.start(label_map, TokenLayout(grid=grid, num_prefix=0, depth=depth, class_token=False)), (), grid
    lead = 0
    while lead < len(stem) and isinstance(stem[lead], Window):
        lead += 1
    windows = window_axes([w for w in stem[:lead] if isinstance(w, Window)], start)
    tracker, mid = start_on_windows(scheme, label_map, start, depth, windows)
    return tracker, stem[lead:], mid


def _summing(tracker: LabelTracker) -> bool:
    """Whether a residual's labels go through ``CompactTracker.residual_sum`` (a branch's last large-grid conv divided
    within the residual's ``addcdiv``): the fast path's tracker on a GPU's eager route (the CPU's under
    ``launch_routes``; not the CPU's eager route, whose bits the targets digest holds, nor a compiled graph, which
    fuses the division and the ``lerp``), unless ``folded_residuals(False)``."""
    return _FOLDED[0] and isinstance(tracker, CompactTracker) and tracker.on_launch_routes()


def _residual_of(
    tracker: LabelTracker, layer: int, keep: Tensor | None, labels: Tensor, branch: Path, grid: tuple[int, int],
    kernels: Kernels | None, shortcut: Path = (),
) -> None:
    """The residual of ``branch``'s labels of ``labels`` (read from ``tracker`` with no event since, but a linear
    ``aggregate``): by ``residual_sum`` where ``_summing``, else ``residual``. ``shortcut``: a downsampling block's
    shortcut path, not yet applied to the tracker's labels: aggregated first, or, where it only subsamples them
    (``_subsampling``) and the sum takes the branch's last conv, read by the sum as a strided view (the pool of
    1x1 windows it stands for copies them: one kernel fewer a block, the same bits)."""
    if _summing(tracker):
        assert isinstance(tracker, CompactTracker)
        mixed, mass = walk_summed(branch, labels, grid, path_kernels([branch]) if kernels is None else kernels)
        stride = _subsampling(shortcut, grid) if mass is not None else None
        if shortcut and stride is None:
            aggregate_path(tracker, shortcut, grid, kernels)
        if mass is None:
            tracker.residual_sum(layer, keep, lambda: mixed, None)
            return
        out = path_grid(branch, grid)

        def held(y: Tensor) -> Tensor:  # the labels' grid view (and back below): one view each, channels-last memory
            return as_grid(y, out) if stride is None else as_grid(y, grid)[:, :, :: stride[0], :: stride[1]]

        tracker.residual_sum(
            layer, keep, lambda: as_tokens(mixed / mass), lambda y: as_tokens(torch.addcdiv(held(y), mixed, mass)),
            shortcut=None if stride is None else lambda y: apply_path(shortcut, y, grid, kernels)[0],
        )
        return
    if shortcut:
        aggregate_path(tracker, shortcut, grid, kernels)
    tracker.residual(layer, keep, mixed=apply_path(branch, labels, grid, kernels)[0])


def _subsampling(shortcut: Path, grid: tuple[int, int]) -> tuple[int, int] | None:
    """The strides ``(sh, sw)`` where ``shortcut`` is one window of 1x1 windows without padding on ``grid`` (a
    ResNet's strided 1x1 projection): its labels are the grid's every ``sh``-th row and ``sw``-th column, each a
    window's mean over one position (exact); else ``None``."""
    if len(shortcut) != 1 or not isinstance(shortcut[0], Window):
        return None
    axes = shortcut[0].axes(grid)
    if any(k != 1 or before or after for k, _, before, after, _ in axes):
        return None
    sh, sw = axes[0][1], axes[1][1]
    if shortcut[0].out_grid(grid) != (len(range(0, grid[0], sh)), len(range(0, grid[1], sw))):
        return None  # not the slices' grid (no such window is known): pooled as it is
    return sh, sw


def aggregate_path(tracker: LabelTracker, path: Path, grid: tuple[int, int], kernels: Kernels | None = None) -> None:
    """``tracker.aggregate`` of the labels through ``path`` (``apply_path``: a row-normalised linear map), which takes
    the fast path's labels at the scale summed residuals left them at and keeps it (``CompactTracker.residual_sum``)."""
    def through(y: Tensor) -> Tensor:
        return apply_path(path, y, grid, kernels)[0]

    if isinstance(tracker, CompactTracker):
        tracker.aggregate(through, normalised=True, linear=True)
    else:
        tracker.aggregate(through, normalised=True)


def fold_labels(tracker: LabelTracker, layer: int, grid: tuple[int, int]) -> Tensor | None:
    """``tracker.labels_for(layer)`` for a residual branch that convolves them on ``grid``: where ``fold_route`` says
    a lasting copy pays, the tracker's own labels are first copied position-major (a layout ``aggregate``). The
    branch's copy alone would not last: the residual's ``lerp`` keeps the tracker's layout, its first input's, and
    every block would copy again; the tracker's copy lasts through the blocks after it (one copy a forward)."""
    if _summing(tracker):  # a GPU's eager route: the labels as the tracker holds them, for ``residual_sum``
        assert isinstance(tracker, CompactTracker)
        return tracker.labels_at_scale(layer)
    labels = tracker.labels_for(layer)
    if labels is None or not (eager_cpu_routes(labels.device) and depthwise_route(grid, labels.device)):
        return labels  # no view dispatched: a GPU's count of operators, or a compiled graph, is as without the fold
    if fold_route(as_grid(labels, grid), 1, lasting=True):
        tracker.aggregate(lambda y: as_tokens(position_major(as_grid(y, grid))), normalised=True)
        labels = tracker.labels_for(layer)
    return labels


def block_labels(
    tracker: LabelTracker, layer: int, grid: tuple[int, int], branch: Path, shortcut: Path | None, keep: Tensor | None,
    kernels: Kernels | None = None, plain: float = 0.0,
) -> tuple[int, int]:
    """The events of one block (``shortcut=None``: no shortcut, the block aggregates); returns its grid.
    ``kernels``: the forward's label kernels (``block_kernels``), else each conv's is computed here. ``plain``: the
    fraction of the output channels the shortcut does not reach (ReXNet's partial shortcut): they carry the branch
    alone, so the block forks before its residual and joins the branch's labels by that share."""
    if shortcut is None:
        if not branch:
            return grid  # channel ops only
        aggregate_path(tracker, branch, grid, kernels)
        return path_grid(branch, grid)
    fork = tracker.fork() if plain else None
    labels = fold_labels(tracker, layer, grid) if branch else tracker.labels_for(layer)
    if not shortcut and fork is None:  # the identity: the residual's mean may fold into the branch's matrix
        residual_labels(tracker, layer, keep, labels, branch, grid, kernels)
        return grid
    if fork is None and labels is not None and branch and shortcut and kernels is not None and projected_route(tracker, labels, keep):
        assert isinstance(tracker, CompactTracker)  # projected_route checked it
        with fp32_labels(labels.device):  # the matrices' products in fp32 under a caller's autocast, as apply_path's
            maps = path_maps(branch, grid, kernels, labels.device), path_maps(shortcut, grid, kernels, labels.device)
        if maps[0] is not None and maps[1] is not None and maps[0][1] == maps[1][1]:
            (b_maps, _), (s_maps, out) = maps[0], maps[1]
            tracker.projected_by(
                layer, lambda y: apply_path(shortcut, y, grid, kernels)[0],
                lambda y, share, scale: mix_tokens(projected_map(b_maps, s_maps, share, scale), y.float()),
            )
            return out
    if labels is not None and branch:
        _residual_of(tracker, layer, keep, labels, branch, grid, kernels, shortcut)  # which aggregates the shortcut
    else:
        if shortcut:
            aggregate_path(tracker, shortcut, grid, kernels)
        tracker.residual(layer, keep, mixed=None)
    if fork is not None:  # the plain channels: the branch alone, aggregating as a block without shortcut does
        tracker.join(fork, plain, merge=lambda y: apply_path(branch, y, grid, kernels)[0], keep=keep, normalised=True)
    return path_grid(shortcut, grid)


def block_labels_reference(
    rules: DenseRules, layer: int, grid: tuple[int, int], branch: Path, shortcut: Path | None, keep: Tensor | None,
    plain: float = 0.0,
) -> tuple[int, int]:
    """``block_labels`` with explicit matrices on dense labels."""
    matrix, out = path_matrix(branch, grid)
    if shortcut is None:
        if branch:
            rules.aggregate(matrix)
        return out
    fork = rules.fork() if plain else None
    mixed = matrix @ rules.y if rules.rules.wants_labels(layer) else None
    if shortcut:
        merge, out = path_matrix(shortcut, grid)
        rules.aggregate(merge)
    if mixed is not None:
        rules.y = rules.rules.residual(rules.y, mixed, keep)
    if fork is not None:
        rules.join(fork, plain, matrix, keep)
    return out


def conv_norm_act_ops(module: nn.Module | None) -> list[nn.Module]:
    """A module as the ops its forward runs in order: a ``Sequential``'s children in turn, a ``ConvNormAct`` as its
    conv, norm-act and anti-aliasing; anything else as itself (``path_refusal`` then says whether it has a rule)."""
    if module is None:
        return []
    if isinstance(module, nn.Sequential):
        return [op for child in module for op in conv_norm_act_ops(child)]
    if type(module) is SeparableConvNormAct:  # depthwise kxk, pointwise 1x1, then its norm-act
        sep: Any = module
        return [sep.conv_dw, sep.conv_pw, sep.bn]
    if type(module) is ConvNormAct:
        cna: Any = module
        return [cna.conv, cna.bn] + ([cna.aa] if getattr(cna, "aa", None) is not None else [])
    return [module]


def run_stem(
    stem: Callable[[Tensor], Tensor], path: Path, images: Tensor, label_map: TokenLabelMap
) -> tuple[Tensor, tuple[int, int], tuple[int, int]]:
    """A pooled CNN's stem on ``images``: its output ``(b, c, h, w)`` (MixToken-mixed for a token-space map), its
    grid, and the grid the labels start on (the pixels; the stem's grid for a token-space map). ``path`` is the
    stem's spatial ops: its windows must make the grid the stem made, else the stem is refused."""
    stride = (1, 1)
    for op in path:
        if isinstance(op, Window):
            stride = (stride[0] * op.stride[0], stride[1] * op.stride[1])
    pixels = check_batch(images, label_map, stride if label_map.token_space else (1, 1))
    x = stem(images)
    grid, start = (int(x.shape[2]), int(x.shape[3])), (int(images.shape[2]), int(images.shape[3]))
    if path_grid(path, start) != grid:
        raise ValueError(f"the stem made a {grid} grid where its windows give {path_grid(path, start)}; this stem is not supported")
    if label_map.token_space:
        if pixels != grid:
            raise ValueError(f"MixToken needs the stem's {grid} grid to tile the image ({pixels}); use an image size divisible by {stride[0]}")
        return mix_token_space(x, label_map, channels_last=False), grid, grid
    return x, grid, start


def run_module_stem(stem: nn.Module, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
    """``run_stem`` of a stem module whose ops ``conv_norm_act_ops`` lists: output, path, grid, start grid."""
    path = path_of(conv_norm_act_ops(stem))
    x, grid, start = run_stem(stem, path, images, label_map)
    return x, path, grid, start


class _Pending:
    """Consecutive units without shortcut, held back and applied as one ``aggregate`` of their joined paths."""

    def __init__(self, tracker: LabelTracker, kernels: Kernels, *, by_unit: bool = False) -> None:
        self._tracker, self._kernels = tracker, kernels
        self.by_unit = by_unit
        """Whether the events run unit by unit, each after its forward (``aligned_forward``): then a run also ends at a
        unit that shrinks the grid (``_events``)."""
        self._path: list[Any] = []
        self._grid: tuple[int, int] | None = None

    def add(self, path: Path, grid: tuple[int, int]) -> None:
        if not path:
            return  # channel ops only
        if self._grid is None:
            self._grid = grid
        self._path.extend(path)

    def flush(self) -> None:
        if self._grid is None:
            return
        path, grid, kernels = tuple(self._path), self._grid, self._kernels
        aggregate_path(self._tracker, path, grid, kernels)
        self._path, self._grid = [], None


def windows_into_stem(
    stem: Path, first: tuple[Path, Path | None], grid: tuple[int, int]
) -> tuple[Path, tuple[Path, Path | None], tuple[int, int]]:
    """A stem of windows alone followed by a unit without shortcut whose branch starts with windows (MobileNetV3's and
    StarNet's strided depthwise conv after a strided stem conv): that unit's leading windows moved into the stem's
    path. Returns the stem's path, the first unit's ``(branch, shortcut)`` after the move and the grid the moved
    windows end on (``grid``: the stem's); all three as given where nothing moves (the stem convolves, the unit has a
    shortcut or starts otherwise).

    The labels then start after those windows (``start_on_windows`` weighs the mask under the whole chain at once,
    on the smaller grid) instead of on the stem's grid and then averaged over the unit's windows again: the same rows
    up to rounding (a chain of renormalised window sums is one linear map either way), and on MobileNetV3-Small at
    224 px the work of a 112x112 grid's labels left out. A token-space map starts on the stem's grid, after it:
    callers leave it alone."""
    if first[1] is not None or not all(isinstance(op, Window) for op in stem):
        return stem, first, grid
    branch = first[0]
    lead = 0
    while lead < len(branch) and isinstance(branch[lead], Window):
        lead += 1
    return (*stem, *branch[:lead]), (branch[lead:], None), path_grid(branch[:lead], grid)


class AdaptedConvNet(AdaptedBase):
    """A pooled CNN of blocks, both walks written once: ``block_labels`` events per block (fast path),
    ``block_labels_reference``'s explicit matrices (reference path), the readout ``pool("mean", 0)``.

    A family supplies its model's parts: ``_stem_modules`` (run in order, from the pixels),
    ``_blocks`` (every unit after the stem, in order; a ``CrossPart`` runs its own units on a part of the
    channels), ``_block`` (a unit's forward and who kept its branch), ``_paths`` (its branch's and shortcut's spatial ops; shortcut ``None``: the unit has
    none and aggregates), ``_is_layer`` (whether the unit is a residual layer the scheme counts),
    ``_logits`` (the head on the last map) and ``_position_logits`` (the head on every position).
    """

    _fresh_paths = False
    """Whether a unit's ``_paths`` depend on what the forward computed before it (VGG's ``pre_logits`` reads its
    map's size): the walk then asks for them as it reaches the unit, not from the table made before it."""

    def _stem_modules(self) -> list[nn.Module]:
        raise NotImplementedError

    def _blocks(self) -> Sequence[nn.Module | CrossPart]:
        raise NotImplementedError

    def _plain(self, blk: Any) -> float:
        """The fraction of ``blk``'s output channels its shortcut does not reach (``block_labels``' ``plain``)."""
        return 0.0

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        raise NotImplementedError

    def _is_layer(self, blk: Any) -> bool:
        return True

    def _logits(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        raise NotImplementedError

    def _class_logits(self, output: Tensor | tuple[Tensor, ...]) -> Tensor:
        """The logits the loss reads: the head's output (a distilled head in distilled training returns two:
        the class head's first)."""
        return output[0] if isinstance(output, tuple) else output

    def _position_logits(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def _stem(self, images: Tensor, label_map: TokenLabelMap) -> tuple[Tensor, Path, tuple[int, int], tuple[int, int]]:
        modules = self._stem_modules()

        def run(x: Tensor) -> Tensor:
            for module in modules:
                x = module(x)
            return x

        path = path_of(modules)
        x, grid, start = run_stem(run, path, images, label_map)
        return x, path, grid, start

    def _head(self, x: Tensor) -> tuple[Tensor | tuple[Tensor, ...], Tensor | None]:
        logits = self._logits(x)  # first, as the model's forward: a dropout in the head draws as it does
        return logits, (self._position_logits(x) if self.scheme.needs_token_logits else None)

    def _depth(self, units: Sequence[nn.Module | CrossPart]) -> int:
        return sum(self._depth(u.units) if isinstance(u, CrossPart) else self._is_layer(u) for u in units)

    def _walk(
        self, units: Sequence[nn.Module | CrossPart], x: Tensor, grid: tuple[int, int], layer: int, rules: DenseRules,
    ) -> tuple[Tensor, tuple[int, int], int]:
        """The reference path from ``layer`` on: every unit's forward, then its explicit matrices; the map, its grid,
        the next layer."""
        for blk in units:
            if isinstance(blk, CrossPart):
                waiting, x = blk.split(x)
                fork = rules.fork()
                x, grid, layer = self._walk(blk.units, x, grid, layer, rules)
                x = blk.cat(waiting, x)
                rules.join(fork, int(waiting.shape[1]) / int(x.shape[1]))
                continue
            x, keep = self._block(blk, x)
            grid = block_labels_reference(rules, layer, grid, *self._paths(blk), keep, plain=self._plain(blk))
            layer += self._is_layer(blk)
        return x, grid, layer

    def _run(self, units: Sequence[nn.Module | CrossPart], x: Tensor) -> tuple[Tensor, list[Any]]:
        """The fast path's forward of ``units``, before any label event: the map, and what the events need of it
        in order, ``(unit, keep)`` per unit (who kept its branch) and ``(cross part, its units' record, the waiting
        part's share of the channels)``."""
        ran: list[Any] = []
        for blk in units:
            if isinstance(blk, CrossPart):
                waiting, running = blk.split(x)
                running, inner = self._run(blk.units, running)
                x = blk.cat(waiting, running)
                ran.append((blk, inner, int(waiting.shape[1]) / int(x.shape[1])))
            else:
                x, keep = self._block(blk, x)
                ran.append((blk, keep))
        return x, ran

    def _events(
        self, ran: list[Any], grid: tuple[int, int], layer: int, tracker: LabelTracker, kernels: Kernels, pending: _Pending,
        paths: dict[nn.Module, tuple[Path, Path | None]] | None,
    ) -> tuple[tuple[int, int], int]:
        """The label events of the units ``_run`` ran, from ``layer`` on; the grid they end on, the next layer.

        A run of units without shortcut (each aggregates) is one ``aggregate`` of their paths (``_Pending``): their
        maps are row-stochastic, so the renormalisation between them changes nothing but rounding, and a run of
        convs or windows costs one layout change. Run unit by unit (``_Pending.by_unit``), a run also ends at a unit
        that shrinks the grid: a network of such units (SelecSLS) would otherwise walk its pixel-grid labels after
        its whole forward, their temporaries on top of the forward's saved activations."""
        for item in ran:
            if isinstance(item[0], CrossPart):
                _, inner, share = item
                pending.flush()
                fork = tracker.fork()
                grid, layer = self._events(inner, grid, layer, tracker, kernels, pending, paths)
                pending.flush()
                tracker.join(fork, share, normalised=True)  # the fork's own rows: no merge
                continue
            blk, keep = item
            branch, shortcut = self._paths(blk) if paths is None else paths[blk]
            if shortcut is None:
                pending.add(branch, grid)
                shrunk = path_grid(branch, grid)
                if shrunk != grid and pending.by_unit:  # the run ends: its large-grid label work runs before the
                    pending.flush()  # forward goes on to its peak (SelecSLS has no shortcut: otherwise one run)
                grid = shrunk
            else:
                pending.flush()
                grid = block_labels(tracker, layer, grid, branch, shortcut, keep, kernels, plain=self._plain(blk))
            layer += self._is_layer(blk)
        return grid, layer

    def _all_paths(self, units: Sequence[nn.Module | CrossPart]) -> dict[nn.Module, tuple[Path, Path | None]]:
        """Every unit's ``_paths``, made once per forward: the kernels computed together are keyed by the very
        ops (a ``KernelConv`` too) the walk then applies."""
        out: dict[nn.Module, tuple[Path, Path | None]] = {}
        for blk in units:
            if isinstance(blk, CrossPart):
                out.update(self._all_paths(blk.units))
            else:
                out[blk] = self._paths(blk)
        return out

    def aligned_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        x, stem, grid, start = self._stem(images, label_map)
        blocks = self._blocks()
        paths = None if self._fresh_paths else self._all_paths(blocks)  # fresh: asked for per unit, the forward done
        if paths is not None and not label_map.token_space and blocks and not isinstance(blocks[0], CrossPart):
            # the label walk starts where the moved windows end; the first unit walks the rest of its branch
            stem, paths[blocks[0]], grid = windows_into_stem(stem, paths[blocks[0]], grid)
        # the stem's ops after its leading windows join the first run of units without shortcut (VGG: all of them)
        tracker, rest, mid = start_before_path(self.scheme, label_map, start, grid, self._depth(blocks), stem)
        if paths is not None and not _reads_statistics(paths):
            # each unit's label events right after its forward: their temporaries (labels on a pixel grid are
            # megabytes) come and go before the forward's saved activations peak, not on top of them. The label
            # kernels read weights alone, so all of them are still computed together, at the first event
            kernels = Kernels([*path_convs(rest), *_unit_convs(paths)], [*path_joins(rest), *_unit_joins(paths)])
            pending, layer = _Pending(tracker, kernels, by_unit=True), 0
            pending.add(rest, mid)
            for blk in blocks:
                x, ran = self._run([blk], x)
                grid, layer = self._events(ran, grid, layer, tracker, kernels, pending, paths)
            return self._finish(x, tracker, pending)
        # every unit's forward first, then the label events: a KernelConv that folds batch norms reads their running
        # statistics, which a training forward moves in the norms' own block only, so after the whole forward they
        # are what the reference reads right after that block; all the label kernels are then computed together
        x, ran = self._run(blocks, x)
        every = paths or self._all_paths(blocks)
        kernels = Kernels([*path_convs(rest), *(op for op in _unit_convs(every)
                                                if not (self._fresh_paths and isinstance(op, KernelConv)))],  # a fresh path's KernelConv is new
                          [*path_joins(rest), *([] if self._fresh_paths else _unit_joins(every))])
        pending = _Pending(tracker, kernels)
        pending.add(rest, mid)
        self._events(ran, grid, 0, tracker, kernels, pending, paths)
        return self._finish(x, tracker, pending)

    def _finish(self, x: Tensor, tracker: LabelTracker, pending: _Pending) -> AlignedOutput:
        """The last events (a pending aggregate, the readout), the head, and the targets."""
        pending.flush()
        tracker.pool("mean", 0)
        output, token_logits = self._head(x)
        t = tracker.finish()
        return AlignedOutput(output, self._class_logits(output), t.target, t.weights, token_logits, t.token_target, t.token_loss_weight)

    def reference_forward(self, images: Tensor, label_map: TokenLabelMap) -> AlignedOutput:
        """Explicit matrices of every path on dense labels."""
        x, stem, grid, start = self._stem(images, label_map)
        blocks = self._blocks()
        rules = DenseRules(self.scheme, label_map, start, 0, self._depth(blocks))
        if not label_map.token_space:  # from the pixels, a stride-1 stem's convs too (``start_before_path``)
            rules.aggregate(path_matrix(stem, start)[0])
        x, grid, _ = self._walk(blocks, x, grid, 0, rules)
        output, token_logits = self._head(x)
        return rules.result(output, self._class_logits(output), "mean", token_logits)
