"""Adapter for timm's ConvMixer (``convmixer_*``).

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on ConvMixer's parts.
Events, ``layer`` counting every block:

- the stem (a ``p x p`` stride-``p`` patch conv, then activation and batch norm): patch tokens, the
  labels start as the exact area fractions of its cells (a MixToken map starts on its grid);
- a block, ``Residual(depthwise kxk conv, act, BN)`` then a 1x1 conv, act, BN: the depthwise conv
  mixes labels by its channel-averaged normalised |kernel| (border-renormalised) and the branch's
  labels join by the residual rule (``residual(layer, None, mixed=P Y)``: no stochastic depth); the
  1x1 conv, activations and norms are channel ops. timm builds the depthwise conv with
  ``padding='same'``: for a stride-1 conv with an odd (dilated) kernel that is the static symmetric
  padding ``dilation * (k - 1) / 2``, which its label rule uses (an even kernel pads unevenly: refused);
- readout: ``pool("mean", 0)`` (global average pooling; no class token: TransMix refuses).

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions, ``k`` classes.
"""

from __future__ import annotations

from typing import Any

from einops import rearrange
from timm.models.convmixer import ConvMixer, Residual
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, KernelConv, Op, Path, Window, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny

__all__ = ["AdaptedConvMixer", "CONVMIXER_FAMILY", "convmixer_refusal", "static_padding"]

CONVMIXER_FAMILY = (
    "timm ConvMixer (convmixer_*): patch tokens from the patch stem; a block's depthwise conv ('same' padding, odd "
    "kernel) mixes labels by the channel-averaged normalised |kernel| (border-renormalised) and its labels join by "
    "the residual rule; 1x1 convs, batch norms and activations as channel ops; global average pooling"
)


def static_padding(conv: nn.Conv2d) -> tuple[int, int] | str:
    """The static zero padding ``(ph, pw)`` a stride-1 conv pads each side with (its ``padding='same'`` or
    ``'valid'`` resolved as PyTorch resolves it), or why it has none."""
    if not isinstance(conv.padding, str):
        return int(conv.padding[0]), int(conv.padding[1])
    if conv.padding == "valid":
        return 0, 0
    totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]  # 'same': split, the extra at the end
    if any(t % 2 for t in totals):
        return f"padding='same' with kernel {tuple(conv.kernel_size)} (dilation {tuple(conv.dilation)}) pads one side more than the other; use an odd kernel"
    return totals[0] // 2, totals[1] // 2


def _conv_op(conv: nn.Conv2d) -> KernelConv:
    """A stride-1 conv with a string padding as the op of its static padding (its kernel read at call time)."""
    padding = static_padding(conv)
    assert not isinstance(padding, str), padding  # the refusal has ruled this out
    return KernelConv(lambda: conv.weight, padding, (int(conv.dilation[0]), int(conv.dilation[1])))


def _branch_path(modules: list[nn.Module]) -> Path:
    """``path_of`` with string-padded stride-1 convs at their static padding."""
    ops: list[Op] = []
    for module in modules:
        if type(module) is nn.Conv2d and isinstance(module.padding, str):
            ops += [_conv_op(module)] if module.kernel_size != (1, 1) else []  # a 1x1: a channel op
        else:
            ops += path_of([module])
    return tuple(ops)


def _conv_refusal(conv: nn.Module, where: str) -> str | None:
    if type(conv) is not nn.Conv2d or not isinstance(conv.padding, str):
        return path_refusal([conv], where)
    if conv.padding_mode != "zeros" or conv.stride != (1, 1):
        return f"{where} (stride {tuple(conv.stride)}, {conv.padding_mode!r} padding {conv.padding!r}): only stride-1 zero padding has a label rule"
    padding = static_padding(conv)
    return f"{where}: {padding}" if isinstance(padding, str) else None


def convmixer_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm ConvMixer this adapter carries labels through (``None``: it is)."""
    if type(model) is not ConvMixer:
        return f"{type(model).__name__} is not a timm ConvMixer"
    m: Any = model
    if m.global_pool.pool_type != "avg":
        return f"global_pool={m.global_pool.pool_type!r} has no label readout; use 'avg'"
    patch = m.stem[0]
    if type(patch) is not nn.Conv2d or patch.kernel_size != patch.stride or patch.padding != (0, 0):
        return "the stem is not a patch conv (kernel == stride, no padding): only patch stems are supported"
    why = path_refusal(list(m.stem), "the stem")
    for i, blk in enumerate(m.blocks):
        where = f"block {i}"
        if why is not None:
            return why
        if type(blk) is not nn.Sequential or type(blk[0]) is not Residual or type(blk[0].fn) is not nn.Sequential:
            return f"{where} is not timm's ConvMixer block (Residual(Sequential(...)), then channel ops)"
        branch = list(blk[0].fn)
        for j, module in enumerate(branch):
            why = why or _conv_refusal(module, f"{where}'s branch module {j}")
        if why is None and any(isinstance(op, Window) for op in _branch_path(branch)):
            why = f"{where}'s branch changes the grid: its residual has no shortcut to match"
        after = list(blk)[1:]
        why = why or path_refusal(after, f"{where} (after the residual)")
        if why is None and path_of(after):
            why = f"{where} mixes positions after its residual: only 1x1 stride-1 convs, norms and activations are supported there"
    return why


class AdaptedConvMixer(AdaptedConvNet):
    """A timm ConvMixer returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = CONVMIXER_FAMILY
    refusal = staticmethod(convmixer_refusal)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return list(m.stem)

    def _blocks(self) -> list[nn.Module]:
        m: Any = self.model
        return list(m.blocks)

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """timm's block forward (no stochastic depth: every branch kept)."""
        return blk(x), None

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        return _branch_path(list(blk[0].fn)), ()  # the channel ops after the sum move no labels

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.forward_head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        """The classifier on every final position ``(b, h*w, k)`` (timm's head without the pooling)."""
        m: Any = self.model
        return m.head(m.head_drop(rearrange(x, "b c h w -> b (h w) c")))  # type: ignore[no-any-return]


FAMILY = Family(
    name="convmixer",
    description=CONVMIXER_FAMILY,
    refusal=AdaptedConvMixer.refusal,
    build=AdaptedConvMixer,
    example=tiny(ConvMixer, dim=16, depth=2, kernel_size=5, patch_size=4),
    timm_modules=("convmixer",),
    speed_model="convmixer_768_32",
)
