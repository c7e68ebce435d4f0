"""The ablation's configuration: data, model, recipe, one run, and the whole job.

Everything that changes a result lives in ``RunConfig`` and is hashed into the
run's key (``run_key``); what only changes where or how fast it runs (cache
directory, workers, output directory, progress bars, threads) lives in
``AblationConfig`` and is not hashed, so a rerun with other paths still resumes.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Annotated, Any, Literal

import torch
from pydantic import BeforeValidator, Field, model_validator
from torch import nn

from mixlabels import Config
from mixlabels._scheme_config import SchemeConfig
from mixlabels.score_maps import Fill
from mixlabels.strategies import MixerConfig

__all__ = ["DataConfig", "ModelConfig", "RecipeConfig", "AnnotatorConfig", "RunConfig", "AblationConfig", "run_key",
           "keyed_dump"]

PositiveInt = Annotated[int, Field(ge=1)]


def _none_is_unset(value: object) -> object:
    """``'none'`` (any case) or ``''`` is unset, as the other flags take it: one spelling, one run key."""
    return None if isinstance(value, str) and value.strip().lower() in ("none", "") else value


class DataConfig(Config[None]):
    """Which images, which subset, and how they are loaded."""

    source: Annotated[
        str,
        Field(description="'cifar10', 'imagenette', or a path to an ImageFolder directory or a .tar/.tar.gz of one"),
    ] = "cifar10"
    loader: Annotated[
        Literal["tensor", "folder"],
        Field(description="tensor: decode once into a uint8 tensor cache and augment whole batches "
              "(small images); folder: a DataLoader with timm transforms and workers"),
    ] = "tensor"
    img_size: Annotated[int, Field(ge=8, description="side of the (square) training and test images")] = 32
    subset: Annotated[int | None, Field(ge=2, description="train on this many images (a fixed random subset)")] = 7500
    test_subset: Annotated[int | None, Field(ge=1, description="evaluate on this many images (fixed subset)")] = 2000
    crop_padding: Annotated[int, Field(ge=0, description="tensor loader: random crop after zero padding by this")] = 4
    hflip: Annotated[float, Field(ge=0.0, le=1.0, description="probability of a horizontal flip")] = 0.5
    auto_augment: Annotated[
        str | None,
        BeforeValidator(_none_is_unset),
        Field(description="folder loader: timm auto-augment policy (e.g. rand-m9-mstd0.5-inc1); 'none': no auto-augment"),
    ] = None
    mean: Annotated[tuple[float, float, float], Field(description="per-channel mean the images are normalised by")] = (
        0.4914, 0.4822, 0.4465)
    std: Annotated[tuple[float, float, float], Field(description="per-channel std the images are normalised by")] = (
        0.2470, 0.2435, 0.2616)


class ModelConfig(Config[nn.Module]):
    """A timm model (``pretrained=False``); unset fields keep the timm factory's values."""

    name: Annotated[str, Field(description="timm model name")] = "deit_tiny_patch16_224"
    img_size: Annotated[int | None, Field(description="timm's img_size (the job sets it to the data's)")] = 32
    patch_size: Annotated[int | None, Field(description="timm's patch_size: pixels per token side")] = 4
    embed_dim: Annotated[int | None, Field(description="timm's embed_dim: token width")] = 64
    depth: Annotated[int | None, Field(description="timm's depth: transformer blocks")] = 6
    num_heads: Annotated[int | None, Field(description="timm's num_heads: attention heads per block")] = 2
    mlp_ratio: Annotated[float | None, Field(description="timm's mlp_ratio: MLP hidden width over embed_dim")] = None
    drop_path: Annotated[float, Field(ge=0.0, lt=1.0, description="stochastic depth rate")] = 0.1
    class_token: Annotated[bool | None, Field(description="timm's class_token (False for a pooled annotator)")] = None
    global_pool: Annotated[str | None, Field(description="timm's global_pool ('token', 'avg', ...)")] = None
    pretrained: Annotated[
        bool, Field(description="start from timm's hub weights (network, or the local hub cache)")
    ] = False
    init: Annotated[
        str | None,
        Field(description="start from this file (fine-tuning): a state dict or timm checkpoint (.pth/.safetensors; "
              "{'state_dict': ...}, {'model': ...} or {'state_dict_ema': ...} as timm's train.py writes), loaded strictly"),
    ] = None

    @model_validator(mode="after")
    def _one_start(self) -> ModelConfig:
        if self.pretrained and self.init is not None:
            raise ValueError("pass --init PATH or --pretrained, not both: --init would overwrite the hub weights")
        return self

    def build(self, num_classes: int) -> nn.Module:
        """The timm architecture with ``num_classes`` outputs, randomly initialised (``initialised`` loads weights)."""
        return self._create(num_classes, pretrained=False)

    def initialised(self, num_classes: int) -> nn.Module:
        """The model a run starts from: ``build``, or timm's hub weights (``pretrained``), or ``init``'s file."""
        from benchmarks._init import load_init, pretrained_model

        if self.pretrained:
            model = pretrained_model(self.name, lambda: self._create(num_classes, pretrained=True))
        else:
            model = self.build(num_classes)
        if self.init is not None:
            load_init(model, self.init, name=f"{self.name} with {num_classes} classes")
        return model

    def _create(self, num_classes: int, pretrained: bool) -> nn.Module:
        import timm  # imports torchvision: keep it off the import path of the CLI's --help

        overrides: dict[str, Any] = {
            k: v
            for k, v in {
                "img_size": self.img_size,
                "patch_size": self.patch_size,
                "embed_dim": self.embed_dim,
                "depth": self.depth,
                "num_heads": self.num_heads,
                "mlp_ratio": self.mlp_ratio,
                "class_token": self.class_token,
                "global_pool": self.global_pool,
            }.items()
            if v is not None
        }
        if not timm.is_model(self.name):
            raise ValueError(f"unknown timm model {self.name!r}; list them with timm.list_models('deit*') or 'vit*'")
        try:
            model: nn.Module = timm.create_model(
                self.name, pretrained=pretrained, num_classes=num_classes, drop_path_rate=self.drop_path, **overrides
            )
        except TypeError as e:
            raise ValueError(
                f"model {self.name!r} does not take the ablation's ViT arguments {sorted(overrides)} ({e}). The "
                "ablation trains timm ViT/DeiT models (vit_*, deit_*): its tables cut images into "
                "patch-size cells and align labels through transformer blocks, so a CNN such as ResNet has no "
                "place in them. Pick e.g. --model deit_tiny_patch16_224"
            ) from e
        return model

    def resolved_depth(self) -> int:
        """The number of transformer blocks the built model has."""
        if self.depth is not None:
            return self.depth
        model = self.build(num_classes=2)
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.Sequential):
            raise ValueError(f"cannot tell the depth of {self.name}: no 'blocks'; set ModelConfig.depth")
        return len(blocks)


class RecipeConfig(Config[None]):
    """DeiT's recipe, built through timm's factories; schedules are counted in steps."""

    epochs: Annotated[float, Field(gt=0.0, description="passes over the (sub)set; fractions allowed")] = 2.0
    max_steps: Annotated[int | None, Field(ge=1, description="cap the number of optimizer steps")] = None
    batch_size: Annotated[int, Field(ge=2, description="global batch size (split over ranks)")] = 64
    opt: Annotated[str, Field(description="timm optimizer name")] = "adamw"
    lr: Annotated[float, Field(gt=0.0, description="peak learning rate (absolute, not scaled)")] = 1e-3
    weight_decay: Annotated[float, Field(ge=0.0, description="AdamW's decoupled weight decay")] = 0.05
    warmup: Annotated[float, Field(ge=0.0, lt=1.0, description="fraction of the steps in linear warmup")] = 0.05
    warmup_lr: Annotated[float, Field(ge=0.0, description="learning rate at the first warmup step")] = 1e-6
    min_lr: Annotated[float, Field(ge=0.0, description="learning rate the cosine schedule ends at")] = 1e-5
    clip_grad: Annotated[float | None, Field(gt=0.0, description="clip the gradient norm to this")] = None
    label_smoothing: Annotated[float, Field(ge=0.0, lt=1.0, description="label smoothing of the targets")] = 0.1
    reprob: Annotated[float, Field(ge=0.0, le=1.0, description="random erasing probability")] = 0.25
    remode: Annotated[Literal["const", "rand", "pixel"], Field(description="random erasing fill (timm's mode)")] = "pixel"
    mix_prob: Annotated[float, Field(ge=0.0, le=1.0, description="probability that a batch is mixed")] = 1.0


class AnnotatorConfig(Config[None]):
    """Where a run's dense token labels come from: the score maps of a teacher run (Token Labeling)."""

    teacher: Annotated[str, Field(description="run key of the teacher run whose checkpoint scores the images")]
    k: Annotated[int, Field(ge=1, description="scores kept per map cell (top-k, fp16/int16)")] = 5
    fill: Annotated[Fill, Field(description="how the mass beyond the top-k is restored")] = "renormalize"


class RunConfig(Config[None]):
    """One training run: everything its result depends on (the run's key hashes it)."""

    data: DataConfig
    model: ModelConfig
    recipe: RecipeConfig
    mixer: Annotated[MixerConfig | None, Field(description="None: no mixing, plain label-smoothed CE")] = None
    scheme: Annotated[SchemeConfig | None, Field(description="alignment scheme for mixed batches")] = None
    annotator: Annotated[
        AnnotatorConfig | None, Field(description="token labels from a teacher's score maps (needs TokenLabeling)")
    ] = None
    init_sha256: Annotated[
        str | None, Field(description="sha256 of model.init's file: the key follows the checkpoint's content")
    ] = None
    base: Annotated[
        str | None, Field(description="run key of the base run whose trained weights this run fine-tunes")
    ] = None
    seed: int = 0
    device_type: Annotated[str, Field(description="'cpu' or 'cuda' (bf16 autocast changes numerics)")] = "cpu"
    bf16: bool = False


# Fields added after runs were cached, at the value that reproduces those runs: left out of the
# key there, so old run files still resume; any other value enters the key (it changes results).
_UNKEYED_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("scheme", "drop_path"): "follow",
    ("model", "pretrained"): False,
    ("model", "init"): None,
    ("init_sha256",): None,
    ("base",): None,
}


def keyed_dump(run: RunConfig | dict[str, Any]) -> dict[str, Any]:
    """A run's JSON dump as its key sees it: fields added later left out where at their old-result default.

    Also applied to the dump stored in a run file, so files written before a field existed still match.
    """
    dump = copy.deepcopy(run if isinstance(run, dict) else run.model_dump(mode="json"))
    for path, default in _UNKEYED_DEFAULTS.items():
        parent: Any = dump
        for name in path[:-1]:
            parent = parent.get(name) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and path[-1] in parent and parent[path[-1]] == default:
            del parent[path[-1]]
    return dump


def run_key(run: RunConfig) -> str:
    """A short stable hash of a run's configuration: the name of its result file."""
    canonical = json.dumps(keyed_dump(run), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class AblationConfig(Config[None]):
    """The whole job: which table, which seeds, and every run's shared settings."""

    table: Annotated[
        Literal[7, 8, "tokenlabel"],
        Field(description="7: mixers x TL-Align; 8: TL-Align operations; tokenlabel: Token Labeling's Table 2 rows"),
    ] = 7
    rows: Annotated[tuple[str, ...] | None, Field(description="only these row ids (default: all)")] = None
    seeds: Annotated[tuple[int, ...], Field(min_length=1, description="one run per seed and cell")] = (0, 1)
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    recipe: RecipeConfig = RecipeConfig()
    device: Annotated[str, Field(description="'cpu', 'cuda' or 'cuda:N'; under torchrun cuda uses LOCAL_RANK")] = "cpu"
    bf16: Annotated[bool | None, Field(description="bf16 autocast; default: on for cuda, off for cpu")] = None
    out: Annotated[str | None, Field(description="output directory (default runs/ablation/table<N>-<data>-<model>)")] = None
    data_root: Annotated[
        str | None, Field(description="directory holding the named archives (default <project>/../shared/data)")
    ] = None
    cache_dir: Annotated[str | None, Field(description="extraction cache (default $MIXLABELS_CACHE or ~/.cache/mixlabels)")] = None
    download: Annotated[
        bool,
        Field(description="cifar10 without the bundled archive: torchvision may download CIFAR-10 into the cache"),
    ] = True
    workers: Annotated[int, Field(ge=0, description="folder loader: DataLoader workers per rank")] = 4
    threads: Annotated[
        int | None, Field(ge=1, description="torch threads per rank (default: the idle cores, from the load average)")
    ] = None
    eval_batch_size: Annotated[PositiveInt, Field(description="images per evaluation batch (per rank)")] = 500
    quiet: Annotated[bool, Field(description="no progress bars")] = False
    save_checkpoints: Annotated[
        bool, Field(description="keep every trained model as <out>/checkpoints/<run key>.pth (state dict)")
    ] = False
    teacher_epochs: Annotated[
        float | None,
        Field(gt=0.0, description="tokenlabel table: the annotator's training epochs (default: twice the recipe's)"),
    ] = None
    profile: Annotated[
        Literal["scratch", "finetune"],
        Field(description="scratch: every run from its initialisation; finetune: train one base model on base_data "
              "first (cached), then fine-tune every cell from it"),
    ] = "scratch"
    base_data: Annotated[
        str | None,
        Field(description="finetune: the base model's data set (default: imagenette for a cifar10 job, else cifar10), "
              "decoded at the job's image size, all its training images"),
    ] = None
    base_epochs: Annotated[
        float | None, Field(gt=0.0, description="finetune: the base model's training epochs (default: 4x the recipe's)")
    ] = None

    def base_source(self) -> str:
        """The finetune profile's base data set: ``base_data``, else imagenette for a cifar10 job, else cifar10."""
        return self.base_data or ("imagenette" if self.data.source == "cifar10" else "cifar10")

    def use_bf16(self) -> bool:
        """bf16 autocast as asked, else on for CUDA and off for the CPU."""
        return self.bf16 if self.bf16 is not None else torch.device(self.device).type == "cuda"
