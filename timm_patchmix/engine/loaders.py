"""The data of a run: datasets, timm's data config, transforms, the mixer or mixing collate, and the loaders."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
import torch

from .config import DataConfig, TrainConfig
from .errors import ConfigError, TrainSetupError
from .runtime import Runtime, StridedSampler

__all__ = ['Datasets', 'Loaders', 'build_datasets', 'resolve_data', 'augment', 'build_mixing', 'build_loaders']


@dataclass
class Datasets:
    """The images of a run. ``val`` is what every epoch evaluates (the best epoch is chosen on it): the held-out
    part of the training split with ``--holdout``, else ``--val-split``. ``test`` is ``--val-split`` with
    ``--holdout`` (evaluated once at the end), else None; ``holdout`` is then the holdout's record."""
    train: Any
    val: Any
    num_classes: int
    test: Optional[Any] = None
    holdout: Optional[Dict[str, Any]] = None

    @property
    def class_names(self):
        return list(self.train.classes)

    def splits(self, cfg: TrainConfig) -> Dict[str, Any]:
        """Which images selected the best epoch and which are the test split, with their numbers, as the run's
        records state them."""
        if self.holdout is None:
            return {'selection': cfg.val_split, 'test': None, 'holdout': None, 'train_images': len(self.train),
                    'val_images': len(self.val), 'test_images': 0}
        return {'selection': 'holdout', 'test': cfg.val_split, 'holdout': dict(self.holdout),
                'train_images': len(self.train), 'val_images': len(self.val), 'test_images': len(self.test)}


@dataclass
class Loaders:
    """The loaders of a run, with what the epoch loop seeds and switches: the sampler, the generator of the train
    loader, and the mixer (on the device) or the mixing collate (in the loader); ``test`` with ``--holdout``."""
    train: Any
    val: Any
    sampler: torch.utils.data.DistributedSampler
    generator: torch.Generator
    mixer: Optional[Any] = None
    collate: Optional[Any] = None
    test: Optional[Any] = None

    @property
    def mixing(self) -> Optional[Any]:
        """The object whose ``mixup_enabled`` switches mixing off (``--patchmix-off-epoch``, ``--mixup-off-epoch``)."""
        return self.collate if self.collate is not None and hasattr(self.collate, 'mixup_enabled') else self.mixer

    def new_epoch(self) -> None:
        """Empty the class memory of a guided mixer that lives in this process (the tensor mixer, or the collate
        mixer with ``-j 0``), as loader workers, started afresh every epoch, empty theirs. An epoch's batches then
        depend only on the epoch's seed, so ``--resume`` redoes an epoch exactly, and every rank of a DDP run alike."""
        from ..collate import FastCollateGuidedPatchMix
        from ..guided import GuidedPatchMix
        for mixer in (self.mixer, self.collate.guided if isinstance(self.collate, FastCollateGuidedPatchMix) else None):
            if isinstance(mixer, GuidedPatchMix):
                mixer.memory.clear()


def build_datasets(cfg: TrainConfig) -> Datasets:
    """The train, validation (and, with ``--holdout``, test) sets of ``cfg``, and their class count (checked against
    ``cfg.num_classes``).

    With ``--holdout F``, a fixed random ``F`` of the whole training split (``--holdout-seed``; see
    :mod:`timm_patchmix.holdout`) is held out first; ``--train-subset`` is drawn from the rest and ``--val-subset``
    caps the held-out part, so the held-out images do not change with the subset sizes. ``--val-split`` becomes the
    test split (``--test-subset`` caps it)."""
    from ..data import DatasetError, build_dataset, dataset_num_classes, make_view, open_dataset
    from ..holdout import Holdout, HoldoutError
    test = holdout = None
    try:
        if cfg.holdout:
            base, classes = open_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, cfg.dataset_download)
            try:
                hold = Holdout.carve(len(base), cfg.holdout, cfg.holdout_seed, cfg.train_split)
            except HoldoutError as e:
                raise ConfigError(str(e)) from None
            train_idx, val_idx = hold.subsets(cfg.train_subset, cfg.val_subset)
            train, val, holdout = make_view(base, classes, train_idx), make_view(base, classes, val_idx), hold.record()
            test = build_dataset(cfg.dataset, cfg.data_dir, cfg.val_split, cfg.dataset_download, cfg.test_subset,
                                 class_names=classes or None)
            _check_disjoint(cfg, base, test.base, 'test')
        else:
            train = build_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, cfg.dataset_download, cfg.train_subset)
            val = build_dataset(cfg.dataset, cfg.data_dir, cfg.val_split, cfg.dataset_download, cfg.val_subset,
                                class_names=train.classes or None)
            _check_disjoint(cfg, train.base, val.base, 'validation')
        n = dataset_num_classes(train, cfg.num_classes)
    except (FileNotFoundError, DatasetError) as e:
        raise TrainSetupError(str(e)) from None
    if cfg.num_classes is not None and cfg.num_classes != n:
        where = (f'dataset {cfg.dataset}' if cfg.dataset else
                 f'the image folder {cfg.data_dir}' if cfg.data_dir else 'dataset patchshapes')
        raise TrainSetupError(f'--num-classes {cfg.num_classes} does not match the {n} classes of {where}')
    return Datasets(train, val, n, test, holdout)


def _check_disjoint(cfg: TrainConfig, train, other, role: str) -> None:
    """An image folder without a subfolder for ``--val-split`` gives timm's reader the whole folder for both splits:
    refused, since the evaluation would score training images."""
    from ..data import DatasetError, shared_files
    n = shared_files(train, other)
    if n:
        raise DatasetError(
            f'the {role} split {cfg.val_split!r} of {cfg.data_dir or cfg.dataset} shares {n} image files with the '
            f'training split {cfg.train_split!r} (a folder without a subfolder for each split is read whole for '
            f'both): give it a train/ and a validation/ subfolder, or name them with --train-split/--val-split '
            f'(--holdout does not help: the test split would still score training images)')


def resolve_data(cfg: TrainConfig, model, verbose: bool = False) -> DataConfig:
    """timm's data config for ``model`` and the size flags of ``cfg``, with ``--mean``/``--std`` (one value, or one
    per channel), ``--crop-pct`` and ``--interpolation`` in place of the model's; ``verbose`` logs timm's block.
    A mean or std of another length than the channels, or a crop or interpolation for an input that the
    CIFAR-style transform takes (square, at most 64 px: it neither crops by a fraction nor resizes but bilinearly),
    is a :class:`ConfigError`."""
    from timm.data import resolve_data_config
    flags = {'in_chans': cfg.in_chans, 'img_size': cfg.img_size, 'input_size': cfg.input_size}
    size = resolve_data_config(flags, model=model)['input_size']
    chans = cfg.channels if cfg.channels is not None else size[0]
    for name in ('mean', 'std'):
        value = getattr(cfg, name)
        if value is None:
            continue
        if len(value) not in (1, chans):
            raise ConfigError(f'takes one value or one per channel of the {chans}-channel input, got {len(value)}: '
                              f'{" ".join(f"{v:g}" for v in value)}', '--' + name)
        flags[name] = tuple(value) * (chans if len(value) == 1 else 1)
    unused = [flag for flag, value in (('--crop-pct', cfg.crop_pct), ('--interpolation', cfg.interpolation),
                                       ('--scale', cfg.scale), ('--ratio', cfg.ratio),
                                       ('--train-interpolation', cfg.train_interpolation)) if value]
    if unused and size[1] == size[2] and size[1] <= 64:
        raise ConfigError(f'the {size[1]}x{size[2]} input takes the CIFAR-style transform, which neither crops by a '
                          f'fraction nor resizes but bilinearly (its training crop is a padded random crop); '
                          f'{" and ".join(unused)} would be unused', unused[0])
    flags.update({k: v for k, v in (('crop_pct', cfg.crop_pct), ('interpolation', cfg.interpolation)) if v})
    data_config = resolve_data_config(flags, model=model, verbose=verbose)
    if cfg.channels is not None:  # for --in-chans alone, whose model cfg's input_size names 3 channels
        data_config['input_size'] = (cfg.channels, *data_config['input_size'][1:])
    from timm.data.loader import adapt_to_chs
    for name in ('mean', 'std'):  # (a model's RGB values for greyscale input: what the normalisation uses, recorded)
        data_config[name] = tuple(adapt_to_chs(tuple(data_config[name]), data_config['input_size'][0]))
    return DataConfig.from_timm(data_config)


def augment(cfg: TrainConfig):
    """The training augmentation of ``cfg``'s flags (:class:`~timm_patchmix.data.Augment`)."""
    from ..data import Augment
    return Augment(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Augment)})


def _transforms(cfg: TrainConfig):
    """The training and evaluation transforms of a resolved ``cfg`` (:func:`~timm_patchmix.data.image_transform`)."""
    from ..data import image_transform
    dc = cfg.data_config
    return tuple(image_transform(dc.input_size, training, cfg.prefetch, dc.mean, dc.std, dc.interpolation,
                                 dc.crop_pct, augment(cfg) if training else None) for training in (True, False))


def build_mixing(cfg: TrainConfig, class_names):
    """``(mixer, collate)`` of a resolved ``cfg``: timm's Mixup/CutMix, Random or Guided PatchMix, on the device
    (mixer) or in the loader (collate); a patch-head model without ``--patchmix`` gets an idle PatchMix, which
    packs unmixed targets (every cell labelled as its image)."""
    from timm.data import FastCollateMixup, Mixup
    from timm.data.loader import fast_collate
    from ..collate import FastCollateGuidedPatchMix, FastCollatePatchMix
    from ..mix import PatchMix
    collate, mixer = None, None
    common = dict(label_smoothing=cfg.smoothing, num_classes=cfg.num_classes)
    if cfg.mixup_active:
        margs = dict(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, cutmix_minmax=cfg.cutmix_minmax,
                     prob=cfg.mixup_prob, switch_prob=cfg.mixup_switch_prob, mode=cfg.mixup_mode, **common)
        in_loader = cfg.prefetch and not cfg.device_data  # device batches are mixed on the device
        collate, mixer = (FastCollateMixup(**margs), None) if in_loader else (None, Mixup(**margs))
    elif cfg.patchmix and cfg.patchmix_table:
        from ..guided import GuidedPatchMix, MaskTableError, dataset_fingerprint
        gargs = dict(guided_prob=cfg.guided_prob, random_prob=cfg.random_prob, grid=cfg.grid, alpha=cfg.patchmix_alpha,
                     fingerprint=dataset_fingerprint(cfg.dataset, class_names), **common)
        try:
            if cfg.patchmix_collate:
                collate = FastCollateGuidedPatchMix(cfg.patchmix_table, **gargs)
            else:
                mixer = GuidedPatchMix(cfg.patchmix_table, **gargs)
        except (MaskTableError, ValueError) as e:
            raise TrainSetupError(str(e)) from None
    elif cfg.patchmix or cfg.patch_head:
        pargs = dict(grid=cfg.grid, alpha=cfg.patchmix_alpha, prob=cfg.patchmix_prob, mode=cfg.patchmix_mode,
                     **common)
        if cfg.patchmix and cfg.patchmix_collate:
            collate = FastCollatePatchMix(**pargs)
        else:
            mixer = PatchMix(**pargs)
            mixer.mixup_enabled = bool(cfg.patchmix)
    if collate is None and cfg.prefetch and not cfg.device_data:
        collate = fast_collate
    return mixer, collate


def _seed_worker(worker_id: int) -> None:
    s = torch.initial_seed() % (2 ** 32)
    random.seed(s)
    np.random.seed(s)


def build_loaders(cfg: TrainConfig, data: Datasets, rt: Runtime) -> Loaders:
    """The train loader (a DistributedSampler over the ranks, whole batches only), the validation loader and, with
    ``--holdout``, the test loader (each image on one rank), behind timm's PrefetchLoader unless
    ``--no-prefetcher``."""
    from timm.data.loader import PrefetchLoader
    if cfg.device_data:
        return _device_loaders(cfg, data, rt)
    data.train.transform, data.val.transform = _transforms(cfg)
    if data.test is not None:
        data.test.transform = data.val.transform
    mixer, collate = build_mixing(cfg, data.class_names)
    sampler = _train_sampler(cfg, data, rt)
    generator = torch.Generator()
    train = torch.utils.data.DataLoader(
        data.train, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers, collate_fn=collate,
        drop_last=True, pin_memory=cfg.pin_mem, worker_init_fn=_seed_worker, generator=generator,
        persistent_workers=False)
    _non_empty(train, cfg, data)
    val = _eval_loader(cfg, data.val, rt)
    test = _eval_loader(cfg, data.test, rt) if data.test is not None else None
    if cfg.prefetch:
        dc = cfg.data_config
        train = PrefetchLoader(train, mean=dc.mean, std=dc.std, channels=dc.input_size[0], device=rt.device,
                               **augment(cfg).prefetch_erasing())
    return Loaders(train, val, sampler, generator, mixer, collate, test)


def _train_sampler(cfg: TrainConfig, data: Datasets, rt: Runtime) -> torch.utils.data.Sampler:
    """This process's share of the training images, reshuffled per epoch from ``--seed`` and the epoch (the loader
    keeps whole batches only); with ``--aug-repeats``, timm's repeated-augmentation sampler
    (:class:`SeededRepeatAugSampler`)."""
    if cfg.aug_repeats:
        return SeededRepeatAugSampler(data.train, rt.world_size, rt.rank, cfg.aug_repeats, cfg.seed)
    return torch.utils.data.DistributedSampler(data.train, num_replicas=rt.world_size, rank=rt.rank, shuffle=True,
                                               seed=cfg.seed, drop_last=True)


class SeededRepeatAugSampler(torch.utils.data.Sampler):
    """timm's ``RepeatAugSampler`` (DeiT's repeated augmentation: each image ``num_repeats`` times in a row of the
    shuffled order, the copies dealt to the processes in turn, an epoch of about the dataset's length), with its
    shuffle drawn from ``seed + epoch`` as ``DistributedSampler``'s is, where timm's draws from the epoch alone:
    runs of other seeds see other orders. With ``seed`` 0 it gives timm's indices (through timm's sampler and its
    public ``set_epoch``)."""

    def __init__(self, dataset, num_replicas: int, rank: int, num_repeats: float, seed: int):
        from timm.data.distributed_sampler import RepeatAugSampler
        self.sampler = RepeatAugSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True,
                                        num_repeats=num_repeats)
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(self.seed + epoch)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def _non_empty(train, cfg: TrainConfig, data: Datasets):
    """``train``, unless it has no batch at all."""
    if len(train) == 0:
        raise TrainSetupError(f'the training set has {len(data.train)} images, fewer than one batch of '
                              f'{cfg.batch_size} per process; lower --batch-size')
    return train


def _device_loaders(cfg: TrainConfig, data: Datasets, rt: Runtime) -> Loaders:
    """``--device-data``: every split decoded once to uint8 on the device; batches made there (see
    :mod:`.device_data`). The same DistributedSampler orders the training images as on the loader path."""
    from ..data import default_crop_padding, small_image_transform
    from .device_data import MAX_DEVICE_SIZE, DeviceEvalLoader, DeviceImages, DeviceTrainLoader
    dc = cfg.data_config
    in_chans, h, w = dc.input_size
    if max(h, w) > MAX_DEVICE_SIZE or h != w:
        raise TrainSetupError(f'--device-data keeps square images of at most {MAX_DEVICE_SIZE}x{MAX_DEVICE_SIZE} '
                              f'on the device (the CIFAR-style crop and flip); this model takes {h}x{w}. Drop '
                              f'--device-data to use the data loader and its transforms')
    mixer, _ = build_mixing(cfg, data.class_names)
    uint8 = small_image_transform(h, False, in_chans, True, dc.mean, dc.std)  # resize and centre crop, no aug
    pad = 0 if cfg.no_aug else default_crop_padding(h)
    try:
        images = {name: DeviceImages.from_dataset(ds, uint8, rt.device, cfg.workers or 0)
                  for name, ds in (('train', data.train), ('val', data.val), ('test', data.test)) if ds is not None}
    except MemoryError as e:
        raise TrainSetupError(str(e)) from None
    sampler = _train_sampler(cfg, data, rt)
    flips = dict(hflip=0.0, vflip=0.0) if cfg.no_aug else dict(hflip=cfg.hflip, vflip=cfg.vflip)
    train = _non_empty(DeviceTrainLoader(images['train'], sampler, cfg.batch_size, dc.mean, dc.std, pad, **flips),
                       cfg, data)
    vb = cfg.validation_batch_size or cfg.batch_size

    def evaluation(name):
        n = len(images[name])
        return DeviceEvalLoader(images[name], list(StridedSampler(n, rt.rank, rt.world_size)), vb, dc.mean, dc.std)

    test = evaluation('test') if 'test' in images else None
    return Loaders(train, evaluation('val'), sampler, torch.Generator(), mixer, None, test)


def _eval_loader(cfg: TrainConfig, dataset, rt: Runtime):
    """A loader that evaluates ``dataset`` once over the processes (each image on one rank)."""
    from timm.data.loader import PrefetchLoader, fast_collate
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=cfg.validation_batch_size or cfg.batch_size,
        sampler=StridedSampler(len(dataset), rt.rank, rt.world_size), num_workers=cfg.workers,
        collate_fn=fast_collate if cfg.prefetch else None, pin_memory=cfg.pin_mem)
    if cfg.prefetch:
        dc = cfg.data_config
        loader = PrefetchLoader(loader, mean=dc.mean, std=dc.std, channels=dc.input_size[0], device=rt.device)
    return loader
