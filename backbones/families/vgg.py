"""Adapter for timm's VGG (VGG-11/13/16/19, with or without batch norm); it takes ``vovnet``'s head check and
per-position head.

The label rules of ``backbones._convnet`` (both walks in its ``AdaptedConvNet``) on a plain conv net. VGG has no
shortcut: every unit forms each position from its windows alone, so its labels ``aggregate``. Units, in order:

- the first conv (the stem) from the pixels (a MixToken map starts on its grid);
- every other module of ``features`` by itself: a stride-1 3x3 conv (one layer each) mixes labels by its
  (out, in)-averaged normalised |kernel| (border-renormalised); a max pool aggregates over its windows; norms and
  activations are channel ops;
- ``pre_logits`` (``ConvMlp``): its ``fc1`` is a kxk conv without padding (7x7: a fully connected layer on a 7x7
  map), each output position reading the kxk positions below it, all inside the map: the conv rule with no border
  to renormalise. It is written as the same kernel with 'same' padding ``k // 2`` (whose rows away from the border
  are exactly those) then a crop of the ``k // 2`` border positions. A map smaller than the kernel is pooled up to
  it first (``adaptive_avg_pool2d``): a 1x1 map's one position is copied, so its labels stay; a larger map smaller
  than the kernel is refused at run time. ``fc2`` (1x1), activations and dropout are channel ops;
- readout: ``pool("mean", 0)``, timm's ``ClassifierHead`` with average pooling.

Shapes: ``b`` batch, ``c`` channels, ``h w`` grid, ``n`` positions.
"""

from __future__ import annotations

from typing import Any

from timm.models.vgg import VGG, ConvMlp
from torch import Tensor, nn

from mixlabels.backbones._convnet import AdaptedConvNet, KernelConv, Path, Window, path_of, path_refusal
from mixlabels.backbones._family import Family, tiny
from mixlabels.backbones.families.vovnet import classifier_head_positions, classifier_head_refusal

__all__ = ["AdaptedVGG", "VGG_FAMILY", "vgg_refusal"]

VGG_FAMILY = (
    "timm VGG (VGG-11/13/16/19, with or without batch norm): every position a token; no shortcut, so every conv and "
    "pool forms its positions from its windows: stride-1 3x3 convs mix labels by the (out, in)-averaged normalised "
    "|kernel| (border-renormalised), max pools aggregate over their windows, the head's unpadded 7x7 conv mixes them "
    "by its normalised |kernel| (a map of 1x1 or at least 7x7); norms, activations, 1x1 convs, dropout as channel "
    "ops; stem from the pixels; global average pooling"
)


def _keeps_grid(conv: nn.Conv2d) -> bool:
    """Whether a stride-1 conv's output has its input's grid (the padding covers the dilated kernel's reach)."""
    c: Any = conv  # padding is a pair here: path_refusal has refused a string
    return all(2 * int(p) == int(d) * (int(k) - 1) for p, d, k in zip(c.padding, c.dilation, c.kernel_size))


def _pre_logits_refusal(pre: nn.Module) -> str | None:
    if type(pre) is not ConvMlp:
        return f"pre_logits is {type(pre).__name__}, not timm's ConvMlp"
    p: Any = pre
    fc1, fc2 = p.fc1, p.fc2
    if type(fc1) is not nn.Conv2d or type(fc2) is not nn.Conv2d:
        return f"pre_logits' convs are {type(fc1).__name__} and {type(fc2).__name__}; only plain nn.Conv2d have a rule there"
    k = fc1.kernel_size
    if fc1.stride != (1, 1) or fc1.padding != (0, 0) or fc1.dilation != (1, 1) or k[0] % 2 == 0 or k[1] % 2 == 0:
        return f"pre_logits.fc1 (kernel {k}, stride {fc1.stride}, padding {fc1.padding}) is not an unpadded odd stride-1 conv"
    if fc1.padding_mode != "zeros" or tuple(k) != (p.input_kernel_size,) * 2:
        return "pre_logits.fc1's kernel is not the size ConvMlp pools small maps up to"
    if fc2.kernel_size != (1, 1) or fc2.stride != (1, 1):
        return "pre_logits.fc2 is not a 1x1 stride-1 conv"
    return path_refusal([p.act1, p.drop, p.act2], "pre_logits")


def vgg_refusal(model: nn.Module) -> str | None:
    """Why ``model`` is not a timm VGG this adapter carries labels through (``None``: it is)."""
    if type(model) is not VGG:
        return f"{type(model).__name__} is not a timm VGG"
    m: Any = model
    why = classifier_head_refusal(m.head) or _pre_logits_refusal(m.pre_logits)
    why = why or path_refusal(list(m.features), "features")
    if why is not None:
        return why
    if not m.features or type(m.features[0]) is not nn.Conv2d:
        return "features does not start with a conv"
    for i, module in enumerate(m.features):
        if isinstance(module, nn.Conv2d) and (module.stride != (1, 1) or not _keeps_grid(module)):
            return f"features module {i} is a conv that changes the grid ({module}); only grid-keeping stride-1 convs have a rule here"
    return None


class AdaptedVGG(AdaptedConvNet):
    """A timm VGG returning the scheme's aligned targets (pooled readout, labels per position)."""

    family = VGG_FAMILY
    refusal = staticmethod(vgg_refusal)
    _pre_logits_grid: tuple[int, int] = (0, 0)

    def _stem_modules(self) -> list[nn.Module]:
        m: Any = self.model
        return [m.features[0]]

    def _blocks(self) -> list[nn.Module]:
        m: Any = self.model
        return [*list(m.features)[1:], m.pre_logits]

    def _is_layer(self, blk: Any) -> bool:
        return type(blk) is nn.Conv2d

    def _block(self, blk: Any, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The unit as itself; ``pre_logits``' input grid is kept for its path (``_paths`` follows on the same unit)."""
        if type(blk) is ConvMlp:
            grid, k = (int(x.shape[2]), int(x.shape[3])), int(blk.input_kernel_size)
            if grid != (1, 1) and min(grid) < k:
                raise ValueError(
                    f"VGG's pre_logits pools the {grid} map up to {k}x{k} before its {k}x{k} conv, which has no label "
                    f"rule here; use images whose last map is 1x1 or at least {k}x{k} (224 px gives 7x7)"
                )
            self._pre_logits_grid = grid
        return blk(x), None

    _fresh_paths = True  # pre_logits' path depends on the map size its block saw (``_pre_logits_grid``)

    def _paths(self, blk: Any) -> tuple[Path, Path | None]:
        if type(blk) is not ConvMlp:
            return path_of([blk]), None
        if self._pre_logits_grid == (1, 1):
            return (), None  # the one position copied to every tap: the labels stay
        fc1: Any = blk.fc1
        half = (fc1.kernel_size[0] // 2, fc1.kernel_size[1] // 2)
        crop = Window((1, 1), (1, 1), (-half[0], -half[1]))  # one position per window, starting `half` inside
        return (KernelConv(lambda: fc1.weight.detach(), half), crop), None

    def _logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return m.head(x)  # type: ignore[no-any-return]

    def _position_logits(self, x: Tensor) -> Tensor:
        m: Any = self.model
        return classifier_head_positions(m.head, x)


TINY_CFG: list[Any] = [8, "M", 16, "M", 16]
"""Two max pools on a 32x32 image: an 8x8 map, which pre_logits' 7x7 conv takes to 2x2."""

FAMILY = Family(
    name="vgg",
    description=VGG_FAMILY,
    refusal=AdaptedVGG.refusal,
    build=AdaptedVGG,
    example=tiny(VGG, cfg=TINY_CFG, mlp_ratio=1 / 256),
    timm_modules=("vgg",),
    speed_model="vgg11",
)
