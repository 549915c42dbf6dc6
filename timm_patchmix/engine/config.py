"""Every setting of a training run in one frozen :class:`TrainConfig`, resolved once.

A config comes from flags (``train.py`` parses them into one), is completed by its recipe
(:meth:`TrainConfig.with_recipe`) and, once the model is built, by :func:`resolve`: the grid is then the model's own
(``model.grid`` is the one source of truth), the learning rate is scaled to the global batch and timm's data config
is fixed. Nothing writes into a config after that; a derived config is a new one (``dataclasses.replace``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import ConfigError, TrainSetupError

__all__ = ['TIMM_DEFAULTS', 'RECIPES', 'SCHEDULERS', 'CLIP_MODES', 'DEFAULT_GRID', 'DataConfig', 'TrainConfig',
           'resolve', 'scaled_lr', 'normal_grid']

# Defaults of timm's train.py for the flags a recipe may change; a recipe fills only flags the user left unset.
TIMM_DEFAULTS: Dict[str, Any] = dict(model='resnet50', epochs=300, batch_size=128, opt='sgd', lr=None, momentum=0.9,
                                     weight_decay=2e-5, sched='cosine', warmup_epochs=5, warmup_lr=1e-5, min_lr=0.0,
                                     smoothing=0.1, workers=4)
RECIPES: Dict[str, Dict[str, Any]] = {
    'timm': {},
    # the embedded data at 32x32: a few minutes on two CPU cores
    'demo': dict(model='resnet32_cifar', epochs=4, batch_size=128, lr=0.1, weight_decay=5e-4, warmup_epochs=0,
                 smoothing=0.0, workers=2),
    # the paper's CIFAR recipe: 400 epochs, batch 100, SGD Nesterov 0.9, wd 5e-4, lr 0.1, cosine
    'paper-cifar': dict(model='preactresnet18_cifar', epochs=400, batch_size=100, opt='sgd', lr=0.1, momentum=0.9,
                        weight_decay=5e-4, sched='cosine', warmup_epochs=0, smoothing=0.0),
}
SCHEDULERS = ('cosine', 'tanh', 'step', 'multistep', 'plateau', 'poly', 'constant', 'rsqrt')  # timm's factory's
CLIP_MODES = ('norm', 'value', 'agc')  # timm.utils.dispatch_clip_grad's
DEFAULT_GRID = (4, 4)
# the values a setting with a fixed set of choices may take (the command line offers the same choices)
CHOICES: Dict[str, Tuple[Any, ...]] = {
    'clip_mode': CLIP_MODES, 'sched': SCHEDULERS, 'recipe': tuple(RECIPES), 'lr_base_scale': ('', 'linear', 'sqrt'),
    'mixup_mode': ('batch', 'pair', 'elem', 'half'), 'patchmix_mode': ('elem', 'pair', 'batch'),
    'amp_dtype': ('float16', 'bfloat16'), 'eval_metric': ('top1', 'top5', 'loss'),
    'dist_bn': ('', 'broadcast', 'reduce')}


def _flag(name: str) -> str:
    return '--patchmix-grid' if name == 'grid' else '--' + name.replace('_', '-')


def normal_grid(grid) -> Optional[Tuple[int, int]]:
    """``None``, ``P``, ``[P]`` or ``(rows, cols)`` as ``None`` or ``(rows, cols)``."""
    if grid is None:
        return None
    cells = [grid] if isinstance(grid, int) else list(grid)
    if len(cells) not in (1, 2):
        raise ConfigError(f'takes P or rows cols, got {len(cells)} values {" ".join(map(str, cells))}',
                          '--patchmix-grid')
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in cells):
        raise ConfigError(f'rows and cols must be integers >= 1, got {cells}', '--patchmix-grid')
    return (cells[0], cells[0]) if len(cells) == 1 else (cells[0], cells[1])


@dataclass(frozen=True)
class DataConfig:
    """timm's data config of the run (``timm.data.resolve_data_config``'s keys)."""
    input_size: Tuple[int, int, int]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    interpolation: str = 'bilinear'
    crop_pct: float = 1.0
    crop_mode: str = 'center'

    @classmethod
    def from_timm(cls, cfg: Mapping[str, Any]) -> 'DataConfig':
        return cls(tuple(cfg['input_size']), tuple(cfg['mean']), tuple(cfg['std']), cfg['interpolation'],
                   cfg['crop_pct'], cfg.get('crop_mode', 'center'))

    def as_timm(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TrainConfig:
    """The settings of one training run, named as ``train.py``'s flags (``grid`` is ``--patchmix-grid``).

    ``None`` means "the recipe's value" (:meth:`with_recipe`) or "resolved from the model" (``lr``, ``grid``,
    ``num_classes``, ``arch``, ``patch_head``, ``data_config``; see :func:`resolve`)."""
    # dataset
    dataset: str = ''
    data_dir: str = ''
    train_split: str = 'train'
    val_split: str = 'validation'
    dataset_download: bool = False
    train_subset: Optional[int] = None
    val_subset: Optional[int] = None
    # held-out validation: a fixed fraction of the training split selects the best epoch; --val-split is then the
    # test split, evaluated once at the end (see timm_patchmix.holdout)
    holdout: float = 0.0
    holdout_seed: int = 0
    test_subset: Optional[int] = None
    # model
    model: Optional[str] = None
    pretrained: bool = False
    initial_checkpoint: str = ''
    resume: str = ''
    # transfer: a fresh classifier after the weights are loaded; train the classifier only (see engine.model)
    reset_head: bool = False
    linear_probe: bool = False
    num_classes: Optional[int] = None
    in_chans: Optional[int] = None
    img_size: Optional[int] = None
    input_size: Optional[Tuple[int, int, int]] = None
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    drop: float = 0.0
    drop_path: Optional[float] = None
    grad_checkpointing: bool = False
    torchcompile: Optional[str] = None
    # optimizer and schedule
    batch_size: Optional[int] = None
    validation_batch_size: Optional[int] = None
    opt: Optional[str] = None
    opt_eps: Optional[float] = None
    opt_betas: Optional[Tuple[float, ...]] = None
    momentum: Optional[float] = None
    weight_decay: Optional[float] = None
    clip_grad: Optional[float] = None
    clip_mode: str = 'norm'
    sched: Optional[str] = None
    sched_on_updates: bool = False
    lr: Optional[float] = None
    lr_base: float = 0.1
    lr_base_size: int = 256
    lr_base_scale: str = ''
    min_lr: Optional[float] = None
    warmup_lr: Optional[float] = None
    epochs: Optional[int] = None
    warmup_epochs: Optional[int] = None
    cooldown_epochs: int = 0
    decay_epochs: float = 90
    decay_rate: float = 0.1
    recipe: Optional[str] = None
    # mixing and loss
    mixup: float = 0.0
    cutmix: float = 0.0
    cutmix_minmax: Optional[Tuple[float, float]] = None
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = 'batch'
    mixup_off_epoch: int = 0
    smoothing: Optional[float] = None
    patchmix: bool = False
    grid: Optional[Tuple[int, int]] = None
    patchmix_alpha: float = 1.0
    patchmix_prob: float = 1.0
    patchmix_mode: str = 'elem'
    patchmix_collate: bool = False
    patchmix_off_epoch: int = 0
    no_patch_loss: bool = False
    no_image_loss: bool = False
    patch_loss_weight: float = 1.0
    per_position_head: bool = False
    patchmix_table: str = ''
    guided_prob: float = 1 / 3
    random_prob: float = 1 / 3
    # running
    amp: bool = False
    amp_dtype: str = 'float16'
    channels_last: bool = False
    dist_bn: str = 'reduce'  # DDP: BatchNorm running stats made equal on every rank before each validation
    workers: Optional[int] = None
    pin_mem: bool = False
    no_prefetcher: bool = False
    device_data: bool = False  # the dataset whole on the device (see engine.device_data)
    device: Optional[str] = None
    seed: int = 42
    output: str = ''
    experiment: str = ''
    log_interval: int = 50
    eval_metric: str = 'top1'
    fgsm: Optional[Tuple[float, ...]] = None
    no_progress: bool = False
    command: str = ''  # the command line that started the run, recorded in the checkpoints
    # resolved from the model (see resolve)
    arch: Optional[str] = None
    patch_head: Optional[bool] = None
    data_config: Optional[DataConfig] = None

    def __post_init__(self):
        # sequences become tuples, so that no part of a config can change after it is made
        for name in ('input_size', 'opt_betas', 'cutmix_minmax', 'fgsm'):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, 'grid', normal_grid(self.grid))
        object.__setattr__(self, 'model_kwargs', dict(self.model_kwargs or {}))
        self._check()

    def _check(self) -> None:
        """Settings that contradict each other: usage errors (:class:`ConfigError`) first, then the combinations a
        run cannot train (:class:`TrainSetupError`)."""
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ConfigError(f'invalid choice: {value!r} (choose from {", ".join(map(repr, allowed))})',
                                  _flag(name))
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or \
                not 0.0 <= self.holdout < 1.0:
            raise ConfigError(f'must be a fraction in [0, 1), got {self.holdout!r}', '--holdout')
        if isinstance(self.holdout_seed, bool) or not isinstance(self.holdout_seed, int) or self.holdout_seed < 0:
            raise ConfigError(f'must be an integer >= 0, got {self.holdout_seed!r}', '--holdout-seed')
        if self.test_subset is not None and not self.holdout:
            raise ConfigError('--test-subset caps the test split of a run with --holdout; without --holdout every '
                              'epoch is evaluated on --val-split, which --val-subset caps')
        if self.holdout and self.val_split == self.train_split:
            raise ConfigError(f'with --holdout, --val-split names the test split, evaluated once at the end; it is '
                              f'the training split {self.train_split!r} here. Name the dataset\'s test split')
        if self.cutmix_minmax is not None and self.cutmix_minmax[0] > self.cutmix_minmax[1]:
            raise ConfigError(f'MIN {self.cutmix_minmax[0]:g} is above MAX {self.cutmix_minmax[1]:g}',
                              '--cutmix-minmax')
        if self.reset_head and not (self.pretrained or self.initial_checkpoint):
            raise ConfigError('--reset-head re-initialises the classifier of loaded weights; add --pretrained or '
                              '--initial-checkpoint (a model without them starts with a fresh classifier already)')
        if self.no_patch_loss and self.no_image_loss:
            raise ConfigError('--no-patch-loss and --no-image-loss together switch off the whole loss; keep one of '
                              'the terms')
        if self.patchmix_table and self.guided_prob + self.random_prob > 1:
            raise ConfigError(f'--guided-prob {self.guided_prob:g} and --random-prob {self.random_prob:g} are '
                              f'fractions of one batch and add up to {self.guided_prob + self.random_prob:g}; their '
                              f'sum must be at most 1')
        if self.patchmix_table and not self.patchmix:
            raise TrainSetupError('--patchmix-table trains on guided PatchMix samples; add --patchmix')
        if self.patchmix and self.mixup_active:
            raise TrainSetupError('--patchmix and --mixup/--cutmix are alternatives; choose one')
        if self.device_data and self.patchmix_collate:
            raise TrainSetupError('--device-data makes batches on the device, where PatchMix mixes them too; '
                                  '--patchmix-collate mixes in the data loader, which --device-data replaces. '
                                  'Drop one of them')
        if self.patchmix and self.patchmix_collate and self.no_prefetcher:
            raise TrainSetupError('--patchmix-collate mixes uint8 batches in the collate step and needs the '
                                  'prefetcher; drop --no-prefetcher or --patchmix-collate')

    @property
    def mixup_active(self) -> bool:
        """timm's Mixup/CutMix is on."""
        return self.mixup > 0 or self.cutmix > 0 or self.cutmix_minmax is not None

    @property
    def prefetch(self) -> bool:
        return not self.no_prefetcher

    @property
    def is_resolved(self) -> bool:
        return self.data_config is not None

    def with_recipe(self) -> 'TrainConfig':
        """The config with its recipe's values in the settings left ``None`` (the recipe itself defaults to
        ``'demo'`` on the embedded data and ``'timm'`` otherwise); ``--patchmix`` on a recipe's backbone selects
        its ``patchhead_`` model. A config that has them already comes back unchanged."""
        recipe = self.recipe or ('demo' if self.dataset in ('', 'patchshapes') and not self.data_dir else 'timm')
        changes: Dict[str, Any] = {'recipe': recipe}
        for name, value in dict(TIMM_DEFAULTS, **RECIPES[recipe]).items():
            if getattr(self, name) is None:
                changes[name] = value
        model = changes.get('model', self.model)
        if self.patchmix and self.model is None and not model.startswith('patchhead_') and not self.no_patch_loss:
            changes['model'] = 'patchhead_' + model  # a recipe's backbone, with the head --patchmix needs
        _check_optimizer(changes.get('opt', self.opt))
        return dataclasses.replace(self, **changes)

    def record(self) -> Dict[str, Any]:
        """The settings as plain data (tuples as lists), as ``args.yaml`` and the training state record them."""
        return _plain(dataclasses.asdict(self))


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _check_optimizer(opt: str) -> None:
    from timm.optim import get_optimizer_info
    try:  # timm's factory reads 'lookahead_<name>' as <name> with Lookahead
        get_optimizer_info(opt.lower().split('_')[-1])
    except ValueError:
        raise ConfigError(f'unknown optimizer {opt!r}; timm.optim.list_optimizers() names them', '--opt') from None


def scaled_lr(cfg: TrainConfig, world_size: int = 1) -> float:
    """``cfg.lr``, or timm's rule when it is ``None``: ``lr_base`` scaled by the global batch over ``lr_base_size``,
    linearly (square root for Ada*/LAMB optimizers, unless ``lr_base_scale`` says otherwise)."""
    if cfg.lr is not None:
        return cfg.lr
    scale = cfg.lr_base_scale or ('sqrt' if any(o in cfg.opt.lower() for o in ('ada', 'lamb')) else 'linear')
    ratio = cfg.batch_size * world_size / cfg.lr_base_size
    return cfg.lr_base * (math.sqrt(ratio) if scale == 'sqrt' else ratio)


def resolve(cfg: TrainConfig, *, model, num_classes: int, data_config: Mapping[str, Any],
            world_size: int = 1) -> TrainConfig:
    """The config of a run whose ``model`` is built: the grid is the model's own (a patch-head model's
    ``model.grid``; the flags' or 4x4 for image-level PatchMix on a plain model), the learning rate is scaled to the
    global batch of ``world_size`` processes, and ``num_classes``, ``patch_head`` and ``data_config`` are set."""
    from ..models import PatchHeadModel
    cfg = cfg.with_recipe()
    patch_head = isinstance(model, PatchHeadModel)
    grid = tuple(model.grid) if patch_head else (cfg.grid or DEFAULT_GRID)
    data = data_config if isinstance(data_config, DataConfig) else DataConfig.from_timm(data_config)
    return dataclasses.replace(cfg, grid=grid, patch_head=patch_head, num_classes=num_classes,
                               lr=scaled_lr(cfg, world_size), data_config=data)
