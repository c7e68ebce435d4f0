"""CollateMixer: timm's FastCollateMixup parity (uint8), the post-loader mixer for the same draws, per-worker
draws, mixup_enabled through timm's PrefetchLoader and persistent workers, timm's create_loader path."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import timm.data.mixup as timm_mixup
import torch
from PIL import Image
from timm.data import create_dataset, create_loader
from timm.data.loader import PrefetchLoader
from torch.testing import assert_close
from torch.utils.data import DataLoader, Dataset

from mixlabels import TokenLabelMap
from mixlabels.strategies import CollateMixer, MixUp, timm_collate_mixup
from mixlabels.strategies import timm_mixup as mixup_from_timm_args
from tests.test_strategies_timm import NC, TIMM_ARGS, _force


def samples(b: int, hh: int = 16, ww: int = 20, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (b, 3, hh, ww), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, NC, (b,), generator=g)
    return [(images[i].numpy(), int(labels[i])) for i in range(b)]


class Uint8Images(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], i % 10


@pytest.mark.parametrize(("args", "kind"), TIMM_ARGS)
def test_collate_equals_timm_fast_collate_mixup(monkeypatch: pytest.MonkeyPatch, args: dict[str, Any], kind: type) -> None:
    batch = samples(8, seed=len(str(args)))
    collate = timm_collate_mixup(**args, num_classes=NC)
    assert type(collate.mixer) is kind
    images, labels = torch.stack([torch.from_numpy(x) for x, _ in batch]), torch.tensor([y for _, y in batch])
    p = collate.mixer.sample(tuple(images.shape), generator=torch.Generator().manual_seed(3))
    out, lm = collate.mix(images, labels, p)
    ref = timm_mixup.FastCollateMixup(**args, num_classes=NC)
    _force(monkeypatch, ref, p, 8, args.get("mode", "batch"))
    ref_x, ref_t = ref(copy.deepcopy(batch))  # timm writes into the samples of pair-mode boxes
    assert out.dtype == torch.uint8 and torch.equal(out, ref_x)  # bit-exact, blends rounded as timm rounds
    assert_close(lm.image_targets(), ref_t)


def test_collate_equals_the_post_loader_mixer_for_the_same_draws() -> None:
    batch = samples(6)
    mixer = mixup_from_timm_args(mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem", num_classes=NC)
    collate = CollateMixer(mixer, seed=7)
    out, lm = collate(batch)  # main process: the generator is seeded with `seed` itself
    images, labels = torch.stack([torch.from_numpy(x) for x, _ in batch]), torch.tensor([y for _, y in batch])
    p = mixer.sample(tuple(images.shape), generator=torch.Generator().manual_seed(7))
    after, lm_after = mixer(images.float(), labels, params=p)  # the same draws, mixed after the loader in float
    assert torch.equal(out, torch.round(after).to(torch.uint8))
    assert not torch.equal(out, images)
    for a, b in [(lm.sources, lm_after.sources), (lm.mask.dense(), lm_after.mask.dense()), (lm.image_weights, lm_after.image_weights)]:
        assert torch.equal(a, b)


def _lams(loader: Any) -> list[torch.Tensor]:
    return [lm.image_weights[:, 0].clone() for _, lm in loader]


def test_two_workers_draw_differently_and_reproducibly() -> None:
    collate = CollateMixer(MixUp(10, mode="elem", generator=torch.Generator().manual_seed(0)), seed=1)
    loader = DataLoader(Uint8Images(), batch_size=4, num_workers=2, collate_fn=collate)
    torch.manual_seed(0)
    first = _lams(loader)  # batches 0, 2 from worker 0; 1, 3 from worker 1
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(first, _lams(loader)))  # reproducible from the seeds
    torch.manual_seed(1)
    assert not torch.equal(first[0], _lams(loader)[0])  # a new epoch's worker seeds: new draws

    def naive(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, TokenLabelMap]:
        images, labels = torch.stack([x for x, _ in batch]), torch.tensor([y for _, y in batch])
        p = collate.mixer.sample(tuple(images.shape), generator=collate.mixer.generator)  # the copied generator
        return collate.mix(images, labels, p)

    copied = _lams(DataLoader(Uint8Images(), batch_size=4, num_workers=2, collate_fn=naive))
    assert torch.equal(copied[0], copied[1])  # negative control: a seeded generator copied into workers repeats


def test_a_seeded_mixer_called_in_a_worker_is_refused() -> None:
    mixer = MixUp(10, generator=torch.Generator().manual_seed(0))

    def collate(batch: list[tuple[torch.Tensor, int]]) -> Any:
        return mixer(torch.stack([x for x, _ in batch]).float(), torch.tensor([y for _, y in batch]))

    with pytest.raises(RuntimeError, match="CollateMixer"):
        next(iter(DataLoader(Uint8Images(), batch_size=4, num_workers=1, collate_fn=collate)))


def test_mixup_off_reaches_persistent_workers_through_timm_s_prefetch_loader() -> None:
    collate = timm_collate_mixup(mixup_alpha=0.8, num_classes=10, seed=0)
    loader = DataLoader(Uint8Images(), batch_size=4, num_workers=2, collate_fn=collate, persistent_workers=True)
    prefetch = PrefetchLoader(loader, mean=(0.5,) * 3, std=(0.5,) * 3, device=torch.device("cpu"))
    epoch = list(prefetch)
    assert all(isinstance(lm, TokenLabelMap) and lm.num_sources == 2 for _, lm in epoch)
    assert epoch[0][0].dtype == torch.float32  # normalised on the "device" by the prefetcher
    assert prefetch.mixup_enabled
    prefetch.mixup_enabled = False  # what train.py does at --mixup-off-epoch
    assert not collate.mixup_enabled
    unmixed = list(prefetch)
    assert all(lm.num_sources == 1 for _, lm in unmixed)
    expected = (Uint8Images().images[:4].float() - 127.5) / 127.5
    assert_close(unmixed[0][0], expected)
    assert_close(unmixed[0][1].image_targets()[0].sum(), torch.tensor(1.0))


def test_timm_create_loader_with_the_prefetcher(tmp_path: Path) -> None:
    g = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / f"class{c}").mkdir()
        for i in range(4):
            Image.fromarray(g.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(tmp_path / f"class{c}" / f"{i}.png")
    dataset = create_dataset("", root=str(tmp_path), is_training=True)
    collate = timm_collate_mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=2, seed=0)
    loader = create_loader(dataset, input_size=(3, 32, 32), batch_size=4, is_training=True, collate_fn=collate,
                           num_workers=2, device=torch.device("cpu"), use_prefetcher=True)  # fmt: skip
    images, lm = next(iter(loader))
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.float32
    assert isinstance(lm, TokenLabelMap) and lm.image_size == (32, 32) and lm.num_classes == 2
    lm.check()


def test_collate_refusals() -> None:
    collate = CollateMixer(MixUp(10))
    with pytest.raises(ValueError, match="uint8"):
        collate([(torch.rand(3, 8, 8), 0), (torch.rand(3, 8, 8), 1)])
    hwc = np.asarray(Image.new("RGB", (16, 12)))  # PIL to numpy: (height, width, channels)
    with pytest.raises(ValueError, match=r"channels-last \(12, 16, 3\).*permute\(2, 0, 1\)"):
        collate([(hwc, 0), (hwc, 1)])
    grey = torch.zeros(1, 8, 8, dtype=torch.uint8)  # channels first, one channel: accepted
    assert collate([(grey, 0), (grey, 1)])[0].shape == (2, 1, 8, 8)
    with pytest.raises(ValueError, match="aug-splits"):
        collate([((torch.zeros(3, 8, 8, dtype=torch.uint8),) * 2, 0)] * 2)
    with pytest.raises(TypeError, match="mixlabels mixer"):
        CollateMixer(timm_mixup.Mixup())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory and non_blocking copies need CUDA")
def test_label_map_pins_and_moves_without_blocking() -> None:
    batch = samples(4, 16, 16)
    _, lm = timm_collate_mixup(cutmix_alpha=1.0, mixup_alpha=0.0, num_classes=NC, seed=0)(batch)
    pinned = lm.pin_memory()
    assert pinned.sources.is_pinned() and pinned.labels.is_pinned()
    moved = pinned.to(torch.device("cuda"), non_blocking=True)
    torch.cuda.synchronize()
    assert moved.device.type == "cuda"
    assert_close(moved.image_targets().cpu(), lm.image_targets())
    assert_close(moved.token_weights((4, 4)).cpu(), lm.token_weights((4, 4)))
    loader = DataLoader(Uint8Images(), batch_size=4, num_workers=1, pin_memory=True,
                        collate_fn=timm_collate_mixup(cutmix_alpha=1.0, mixup_alpha=0.0, num_classes=10))  # fmt: skip
    _, lm2 = next(iter(loader))
    assert lm2.sources.is_pinned()


def test_cutmix_box_maps_cross_the_worker_boundary() -> None:
    from mixlabels.strategies import CutMix

    loader = DataLoader(Uint8Images(), batch_size=4, num_workers=1, collate_fn=CollateMixer(CutMix(10), seed=0))
    images, lm = next(iter(loader))
    assert type(lm.mask).__name__ == "BoxMask"  # the boxes travel as boxes
    lm.check()
    assert torch.equal(lm.mix_pixels(Uint8Images().images[:4].float()).round().to(torch.uint8), images)
