"""Run by ``test_fsdp.py`` under ``torchrun --nproc-per-node 2`` (gloo, CPU); prints rank 0's findings as JSON.

Every run splits a CutMix batch of 4 in two: rank ``r`` takes samples ``2r, 2r+1`` (partners
paired inside each half, so each half is a batch of its own) and compares, after each step,
the gathered gradients and parameters with one process that trains a copy on the whole batch
(mean loss: FSDP averages the ranks' gradients, so the two agree). Then every other family whose
adapter names ``fsdp_units()``, sharded per block, in the same loop (``per_block_families``). The adapter compiled
after sharding, and DDP of the compiled adapter, against one compiled process. Then the orders and combinations
that cannot work, each caught with its message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from _dist_teardown import finish

import mixlabels
from mixlabels import AlignedOutput, TokenLabelMap
from mixlabels._align import register_output_tree
from mixlabels.backbones import FAMILIES, adapt
from mixlabels.backbones._common import AdaptedBase
from mixlabels.backbones.families import resnet as _resnet
from mixlabels.backbones.families import vit as _vit

B, C = 4, 10


def example(name: str, draws: bool = True) -> nn.Module:
    """The family's tiny example; ``draws=False``: its dropout and stochastic depth off (some examples have them)."""
    model = next(f for f in FAMILIES if f.name == name).example()
    for m in model.modules() if not draws else ():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0
    return model


def cutmix(seed: int, rank: int) -> tuple[Tensor, TokenLabelMap, Tensor, TokenLabelMap]:
    """The whole mixed batch and its map, then this rank's half and the half's own map."""
    g = torch.Generator().manual_seed(seed)
    images, labels = torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, C, (B,), generator=g)
    mask = torch.ones(B, 32, 32)
    for i in range(B):  # one box of 4 to 19 pixels a side per sample, from its partner
        y, x, h, w = (int(v) for v in torch.randint(0, 16, (4,), generator=g))
        mask[i, y : y + h + 4, x : x + w + 4] = 0.0
    whole = TokenLabelMap.from_mask(mask, torch.tensor([1, 0, 3, 2]), labels, num_classes=C)
    mixed = whole.mix_pixels(images)
    half = slice(2 * rank, 2 * rank + 2)
    part = TokenLabelMap.from_mask(mask[half], torch.tensor([1, 0]), labels[half], num_classes=C)
    return mixed, whole, mixed[half], part


def full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def spread(adapted: nn.Module) -> float:
    """Largest difference of any (gathered) parameter between the two ranks."""
    flat = torch.cat([full(p).detach().flatten() for p in adapted.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return float((gathered[0] - gathered[1]).abs().max())


def rel_error(adapted: nn.Module, ref: nn.Module, grads: bool) -> float:
    """``max |a - r| / max |r|`` over every gathered gradient (or parameter) against one process's."""
    worst = 0.0
    for (name, p), (ref_name, q) in zip(adapted.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name, (name, ref_name)
        if grads:
            if q.grad is None:  # a parameter the forward never reads (GC ViT's first global query: no block uses it)
                assert p.grad is None or not full(p.grad).any(), name  # FSDP2 reduces its zeros
                continue
            assert p.grad is not None and q.grad is not None, name
            a, r = full(p.grad), q.grad
        else:
            a, r = full(p).detach(), q.detach()
        worst = max(worst, float((a.float() - r).abs().max() / r.abs().max().clamp_min(1e-12)))
    return worst


def train(
    family: str, shard: Callable[[nn.Module], None], rank: int, steps: int, bf16: bool = False, halves: bool = False,
    scheme: mixlabels.Scheme | None = None, draws: bool = True, kernels_in_blocks: bool = False,
    compiled: str | None = None, ddp: bool = False,
) -> dict[str, Any]:
    """``steps`` SGD steps of an adapted model sharded by ``shard`` beside one process on the whole batch.

    ``halves``: the one process runs the two halves separately and averages (BatchNorm normalises by
    each rank's own half, so one forward of the whole batch is not the same computation). ``draws=False``:
    the example's dropout and stochastic depth off (each rank draws its own, the one process others).
    ``kernels_in_blocks``: the one process computes each block's label kernels in the block, as a block sharded
    per block does (a ResNet's ``block_kernels`` off), not all of them together. The two round differently (up to
    6e-8 in the targets), and on an Intel Xeon the ResNet example's second step carried that to 2.3e-4 of its
    gradients (its batch norms see two samples, one position each in the last stage); computed alike, the sharded
    run and the one process agree to the bit, as they do with NoAlign.
    ``compiled``: a ``torch.compile`` backend; the sharded adapter is compiled after sharding, as a user's script
    compiles its model last, and the one process is compiled alike (a compiled label path rounds otherwise than the
    eager one, which the small examples' steps carry far: 0.25 of ResNet's gradients by the fourth SGD step).
    ``ddp``: the (compiled) adapter wrapped in ``DistributedDataParallel`` instead of sharded (``shard`` does nothing).
    """
    scheme = scheme or mixlabels.TLAlign()
    torch.manual_seed(0)
    ref: Any = adapt(example(family, draws), scheme)
    ref.check_distributed = False  # one process, its own model on purpose
    adapted: Any = adapt(example(family, draws), scheme)
    shard(adapted)
    if compiled is not None:
        torch._dynamo.reset()
    run_ref: Any = ref if compiled is None else torch.compile(ref, backend=compiled)
    run: Any = adapted if compiled is None else torch.compile(adapted, backend=compiled)
    if ddp:
        run = torch.nn.parallel.DistributedDataParallel(run)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(adapted.parameters(), lr=0.5)
    grads, params, losses = [], [], []
    for step in range(steps):
        images, whole, mine, part = cutmix(step, rank)
        opt_ref.zero_grad()
        if halves:
            for r in range(2):
                _, _, x, lm = cutmix(step, r)
                with mock.patch.object(_resnet, "block_kernels", lambda *_: None) if kernels_in_blocks else contextlib.nullcontext():
                    (run_ref(x, lm).loss() / 2).backward()
        else:
            run_ref(images, whole).loss().backward()
        opt.zero_grad()
        out = run(mine.bfloat16() if bf16 else mine, part)
        # the blocks' forward hooks ran: their parameters are freed (sharded again) before the backward
        units = adapted.fsdp_units()
        resharded = bool(units) and all(isinstance(p, DTensor) for u in units for p in u.parameters())
        out.loss().backward()
        losses.append(float(out.loss().detach()))
        grads.append(rel_error(adapted, ref, grads=True))
        opt_ref.step()
        opt.step()
        params.append(rel_error(adapted, ref, grads=False))
    kinds = sorted({type(m).__name__ for m in adapted.modules() if type(m).__name__.startswith("FSDP")})
    return {
        "grads": grads, "params": params, "spread": spread(adapted), "losses": losses, "sharded": kinds,
        "resharded_after_forward": resharded,
        "logits": str(out.logits.dtype), "target": str(out.target.dtype),
        "param_dtype": str(next(adapted.parameters()).dtype),
    }  # fmt: skip


def attempt(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s report, or its error (both ranks fail alike), so that one case failing leaves the others' reports."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001  # reported, and the test of this case fails on it
        return {"error": f"{type(e).__name__}: {str(e)[:1500]}"}


def per_block(policy: MixedPrecisionPolicy, root: MixedPrecisionPolicy) -> Callable[[nn.Module], None]:
    def shard(adapted: nn.Module) -> None:
        for unit in adapted.fsdp_units():  # type: ignore[operator]  # adapt returns an nn.Module
            fully_shard(unit, mp_policy=policy)
        fully_shard(adapted, mp_policy=root)

    return shard


def root_only(adapted: nn.Module) -> None:
    fully_shard(adapted)


@contextlib.contextmanager
def outputs_found_by_pytree(unregistered: bool = False) -> Any:
    """FSDP2 as torch up to 2.11 finds a sharded module's outputs to hook its pre-backward on: ``tree_flatten``'s leaves
    (torch 2.12 and later look into dataclasses themselves; there the lookup is patched to the old one). ``unregistered``:
    the adapter's output unknown to pytree meanwhile, as it was before ``register_output_tree`` (the negative control)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    def leaves(output: Any) -> tuple[Tensor, ...]:
        return tuple(t for t in pytree.tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad)

    old = hasattr(_fsdp_state, "collect_grad_tensors")
    with mock.patch.object(_fsdp_state, "collect_grad_tensors", leaves) if old else contextlib.nullcontext():
        if unregistered:
            pytree._deregister_pytree_node(AlignedOutput)
        try:
            yield
        finally:
            if unregistered:
                register_output_tree()


def root_found_by_pytree(rank: int, unregistered: bool = False) -> dict[str, Any]:
    """The ViT sharded at the root alone, trained where FSDP2 finds its outputs by pytree (``outputs_found_by_pytree``)."""
    with outputs_found_by_pytree(unregistered):
        return train("vit", root_only, rank, steps=2)


def refusal(run: Callable[[], object]) -> str | None:
    try:
        run()
    except (RuntimeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def refusals(rank: int) -> dict[str, str | None]:
    _, _, x, lm = cutmix(0, rank)
    out: dict[str, str | None] = {}
    adapted: Any  # timm is untyped: .model.blocks

    model: Any = example("vit")  # fully_shard before adapt
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    out["shard_then_adapt"] = refusal(lambda: adapt(model, mixlabels.TLAlign()))

    adapted = adapt(example("vit"), mixlabels.TLAlign())  # the timm model as the root, not the adapter
    for blk in adapted.model.blocks:
        fully_shard(blk)
    fully_shard(adapted.model)
    out["model_as_root"] = refusal(lambda: adapted(x, lm))

    adapted = adapt(example("vit"), mixlabels.TLAlign())  # a module inside a block: its hooks never run
    for blk in adapted.model.blocks:
        fully_shard(blk.attn)
    fully_shard(adapted)
    out["inside_block"] = refusal(lambda: adapted(x, lm))

    adapted = adapt(example("mlp_mixer"), mixlabels.TLAlign())  # a family whose walk enters no block's hooks
    for blk in adapted.model.blocks:
        fully_shard(blk)
    fully_shard(adapted)
    out["family_without_units"] = refusal(lambda: adapted(x, lm))

    adapted = adapt(example("vit"), mixlabels.TLAlign(), reference=True)  # the reference walks blocks too
    per_block(MixedPrecisionPolicy(), MixedPrecisionPolicy())(adapted)
    out["reference"] = refusal(lambda: adapted(x, lm))

    adapted = adapt(example("vit"), mixlabels.TLAlign())  # the root's input cast would round the label map
    per_block(MixedPrecisionPolicy(param_dtype=torch.bfloat16), MixedPrecisionPolicy(param_dtype=torch.bfloat16))(adapted)
    out["root_casts_map"] = refusal(lambda: adapted(x, lm))

    adapted = adapt(example("vit"), mixlabels.TLAlign())  # the root's output cast would round the targets
    fully_shard(adapted, mp_policy=MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    out["root_casts_output"] = refusal(lambda: adapted(x, lm))

    adapted = adapt(example("vit"), mixlabels.TLAlign())  # float32 output (logits up-cast for the loss): allowed
    fully_shard(adapted, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32,
                                                        cast_forward_inputs=False))
    fp32_out = adapted(x.bfloat16(), lm)
    out["root_output_fp32"] = f"{fp32_out.logits.dtype} {fp32_out.target.dtype}"

    adapted = adapt(example("vit"), mixlabels.TLAlign())  # not sharded, not DDP: the distributed guard
    out["unsharded"] = refusal(lambda: adapted(x, lm))

    # negative control: the same sharding, the blocks walked without their hooks (what the adapter did before)
    adapted = adapt(example("vit"), mixlabels.TLAlign())
    per_block(MixedPrecisionPolicy(), MixedPrecisionPolicy())(adapted)
    with mock.patch.object(_vit, "through_hooks", lambda module, fn, *tensors: fn(*tensors)):
        out["control_no_hooks"] = refusal(lambda: adapted(x, lm))
    return out


def per_block_families(rank: int, fp32: MixedPrecisionPolicy) -> dict[str, dict[str, Any]]:
    """Every other family whose adapter names units, sharded per block: two float32 steps each.

    The one process runs the whole batch as the two ranks' halves (the mean loss of the whole batch is the
    mean of the halves' means), so each rank's forward and backward are its own computations exactly and
    the comparison measures the sharding alone: a whole-batch forward sums in another order, which moves
    a gradient that is zero but for rounding (a key or position-MLP bias under the softmax) by far more than
    its own size. BatchNorm (LeViT, XCiT's LPI) needs the halves anyway.
    """
    adapters = [f for f in FAMILIES if isinstance(f.build, type) and issubclass(f.build, AdaptedBase)]
    names = [f.name for f in adapters if f.build.fsdp_units is not AdaptedBase.fsdp_units and f.name not in ("vit", "resnet")]
    return {name: train(name, per_block(fp32, fp32), rank, steps=2, halves=True, draws=False) for name in names}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fp32 = MixedPrecisionPolicy()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16_root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    report: dict[str, Any] = {
        "vit_blocks": train("vit", per_block(fp32, fp32), rank, steps=3),
        "vit_root": train("vit", root_only, rank, steps=2),
        "vit_bf16": train("vit", per_block(bf16, bf16_root), rank, steps=2, bf16=True),
        "resnet_blocks": train("resnet", per_block(fp32, fp32), rank, steps=2, halves=True, kernels_in_blocks=True),
        # compiled after sharding per block (dynamo runs FSDP2's hooks eagerly, breaking the graph at each unit)
        "vit_root_compiled": attempt(lambda: train("vit", root_only, rank, steps=2, compiled="aot_eager")),
        "vit_blocks_compiled": attempt(lambda: train("vit", per_block(fp32, fp32), rank, steps=3, compiled="aot_eager")),
        # DDP of the compiled adapter (timm's train.py --torchcompile under torchrun): as one compiled process
        "vit_ddp_compiled": attempt(lambda: train("vit", lambda adapted: None, rank, steps=3, compiled="aot_eager", ddp=True)),
        "resnet_ddp_compiled": attempt(lambda: train("resnet", lambda adapted: None, rank, steps=3, halves=True,
                                                     compiled="aot_eager", ddp=True)),
        "resnet_blocks_compiled": attempt(lambda: train("resnet", per_block(fp32, fp32), rank, steps=3, halves=True,
                                                        kernels_in_blocks=True, compiled="aot_eager")),
        # a torchvision family, and any nn.Module with NoAlign (the README's table): the adapted root alone
        "tv_resnet_root": train("tv_resnet", root_only, rank, steps=2, halves=True),
        "any_root": train("any", root_only, rank, steps=2, halves=True, scheme=mixlabels.NoAlign()),
        # the adapted root alone where FSDP2 finds its outputs by pytree (torch <= 2.11), and that without the output's
        # registration: no pre-backward hook, the gradients never reduced
        "vit_root_pytree": attempt(lambda: root_found_by_pytree(rank)),
        "vit_root_pytree_control": attempt(lambda: root_found_by_pytree(rank, unregistered=True)),
        "families_blocks": per_block_families(rank, fp32),
        "refusals": refusals(rank),
    }
    finish(report)


if __name__ == "__main__":
    main()
