"""Training with timm's flags plus PatchMix: the engine behind the top-level ``train.py``.

    python train.py                                   # embedded data, resnet32_cifar, a short demo run
    python train.py --model patchhead_resnet32_cifar --patchmix
    python train.py --dataset fashion_mnist --model patchhead_preactresnet18_cifar --patchmix --recipe paper-cifar
    torchrun --nproc_per_node 2 train.py --patchmix   # DDP: NCCL on GPUs, gloo on CPU
"""
from __future__ import annotations

import argparse
import csv
import io
import logging
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from datetime import datetime
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml

from .cli_types import (fraction, nonneg_float, nonneg_int, optional_directory, optional_file, positive_float,
                        positive_int, probability)

_logger = logging.getLogger('train')

# Defaults of timm's train.py for the flags a recipe may change; a recipe fills only flags the user left unset.
TIMM_DEFAULTS = dict(model='resnet50', epochs=300, batch_size=128, opt='sgd', lr=None, momentum=0.9,
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
KILL_ENV = 'TIMM_PATCHMIX_KILL_AT_STEP'  # tests: SIGKILL this process after that many optimizer steps


class ParseKwargs(argparse.Action):
    """``--model-kwargs a=1 b=x`` as a dict, values parsed as Python literals where they can be."""

    def __call__(self, parser, namespace, values, option_string=None):
        import ast
        out = {}
        for v in values:
            if '=' not in v:
                parser.error(f'{option_string} expects key=value pairs, got {v!r}')
            k, val = v.split('=', 1)
            try:
                out[k] = ast.literal_eval(val)
            except (ValueError, SyntaxError):
                out[k] = val
        setattr(namespace, self.dest, out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description='timm-style training with PatchMix', add_help=True)
    g = p.add_argument_group('Dataset')
    g.add_argument('data', nargs='?', metavar='DIR', type=optional_directory,
                   help='path to dataset (positional, as in timm)')
    g.add_argument('--data-dir', default=None, type=optional_directory, help='path to dataset root')
    g.add_argument('--dataset', default='', help="'' (embedded patchshapes, or an image folder with --data-dir), "
                   "'patchshapes', 'fashion_mnist' (IDX files on disk), or a timm name such as torch/cifar10")
    g.add_argument('--train-split', default='train')
    g.add_argument('--val-split', default='validation')
    g.add_argument('--dataset-download', action='store_true', default=False)
    g.add_argument('--train-subset', type=positive_int, default=None, help='train on a fixed random subset of N images')
    g.add_argument('--val-subset', type=positive_int, default=None,
                   help='validate on a fixed random subset of N images')
    g = p.add_argument_group('Model')
    g.add_argument('--model', default=None, help='timm model name; patchhead_<arch> adds the patch head')
    g.add_argument('--pretrained', action='store_true', default=False)
    g.add_argument('--initial-checkpoint', default='', type=optional_file,
                   help='start from these weights (safetensors)')
    g.add_argument('--resume', default='', type=optional_file, help='resume from a training state (state.safetensors)')
    g.add_argument('--num-classes', type=positive_int, default=None)
    g.add_argument('--in-chans', type=positive_int, default=None)
    g.add_argument('--img-size', type=positive_int, default=None)
    g.add_argument('--input-size', type=positive_int, nargs=3, default=None, metavar='N')
    g.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs)
    g.add_argument('--drop', type=probability, default=0.0)
    g.add_argument('--drop-path', type=probability, default=None)
    g.add_argument('--grad-checkpointing', action='store_true', default=False)
    g.add_argument('--torchcompile', nargs='?', const='inductor', default=None)
    g = p.add_argument_group('Optimizer and schedule')
    g.add_argument('-b', '--batch-size', type=positive_int, default=None)
    g.add_argument('-vb', '--validation-batch-size', type=positive_int, default=None)
    g.add_argument('--opt', default=None)
    g.add_argument('--opt-eps', type=nonneg_float, default=None)
    g.add_argument('--opt-betas', type=fraction, nargs='+', default=None)
    g.add_argument('--momentum', type=nonneg_float, default=None)
    g.add_argument('--weight-decay', type=nonneg_float, default=None)
    g.add_argument('--clip-grad', type=nonneg_float, default=None, help='0: no clipping')
    g.add_argument('--clip-mode', default='norm', choices=('norm', 'value'))
    g.add_argument('--sched', default=None, choices=SCHEDULERS)
    g.add_argument('--sched-on-updates', action='store_true', default=False)
    g.add_argument('--lr', type=positive_float, default=None)
    g.add_argument('--lr-base', type=positive_float, default=0.1)
    g.add_argument('--lr-base-size', type=positive_int, default=256)
    g.add_argument('--lr-base-scale', default='', choices=('', 'linear', 'sqrt'))
    g.add_argument('--min-lr', type=nonneg_float, default=None)
    g.add_argument('--warmup-lr', type=nonneg_float, default=None)
    g.add_argument('--epochs', type=positive_int, default=None)
    g.add_argument('--warmup-epochs', type=nonneg_int, default=None)
    g.add_argument('--cooldown-epochs', type=nonneg_int, default=0)
    g.add_argument('--decay-epochs', type=positive_float, default=90)
    g.add_argument('--decay-rate', type=positive_float, default=0.1)
    g.add_argument('--recipe', choices=sorted(RECIPES), default=None,
                   help="defaults for unset flags: 'demo' (the default with the embedded data), 'timm' (timm's "
                        "train.py defaults, the default otherwise) or 'paper-cifar'")
    g = p.add_argument_group('Mixing and loss')
    g.add_argument('--mixup', type=nonneg_float, default=0.0)
    g.add_argument('--cutmix', type=nonneg_float, default=0.0)
    g.add_argument('--cutmix-minmax', type=probability, nargs=2, default=None, metavar=('MIN', 'MAX'))
    g.add_argument('--mixup-prob', type=probability, default=1.0)
    g.add_argument('--mixup-switch-prob', type=probability, default=0.5)
    g.add_argument('--mixup-mode', default='batch', choices=('batch', 'pair', 'elem', 'half'))
    g.add_argument('--mixup-off-epoch', type=nonneg_int, default=0, help='0: never')
    g.add_argument('--smoothing', type=fraction, default=None)
    g.add_argument('--patchmix', action='store_true', default=False, help='train with PatchMix and PatchMixLoss')
    g.add_argument('--patchmix-grid', type=positive_int, nargs='+', default=None,
                   help="P, or rows cols (default 4; a hf-hub:/local-dir: model's own grid)")
    g.add_argument('--patchmix-alpha', type=positive_float, default=1.0)
    g.add_argument('--patchmix-prob', type=probability, default=1.0)
    g.add_argument('--patchmix-mode', default='elem', choices=('elem', 'pair', 'batch'))
    g.add_argument('--patchmix-collate', action='store_true', default=False, help='mix at collate time')
    g.add_argument('--patchmix-off-epoch', type=nonneg_int, default=0, help='0: never')
    g.add_argument('--no-patch-loss', action='store_true', default=False)
    g.add_argument('--no-image-loss', action='store_true', default=False)
    g.add_argument('--patch-loss-weight', type=nonneg_float, default=1.0)
    g.add_argument('--per-position-head', action='store_true', default=False)
    g.add_argument('--patchmix-table', default='', type=optional_file,
                   help='mask table from search.py: train on guided samples')
    g.add_argument('--guided-prob', type=probability, default=1 / 3, help='fraction of each batch that is guided')
    g.add_argument('--random-prob', type=probability, default=1 / 3,
                   help='fraction of each batch mixed by random PatchMix when a table is given (the rest is clean)')
    g = p.add_argument_group('Running')
    g.add_argument('--amp', action='store_true', default=False)
    g.add_argument('--amp-dtype', default='float16', choices=('float16', 'bfloat16'))
    g.add_argument('--channels-last', action='store_true', default=False)
    g.add_argument('-j', '--workers', type=nonneg_int, default=None, help='0: load in the main process')
    g.add_argument('--pin-mem', action='store_true', default=False)
    g.add_argument('--no-prefetcher', action='store_true', default=False)
    g.add_argument('--device', default=None, help='default: cuda when available, else cpu')
    g.add_argument('--seed', type=int, default=42)
    g.add_argument('--output', default='', type=optional_directory)
    g.add_argument('--experiment', default='')
    g.add_argument('--log-interval', type=positive_int, default=50)
    g.add_argument('--eval-metric', default='top1', choices=('top1', 'top5', 'loss'))
    g.add_argument('--fgsm', type=nonneg_float, nargs='+', default=None, metavar='EPS',
                   help='after training, FGSM top-1 on the validation set for each eps (pixels in [0, 1])')
    g.add_argument('--no-progress', action='store_true', default=False)
    return p


def resolve_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # ranges of single values are checked by the argument types; these concern several flags together
    if args.patchmix_grid is not None and len(args.patchmix_grid) not in (1, 2):
        parser.error(f'argument --patchmix-grid: takes P or rows cols, got {len(args.patchmix_grid)} values '
                     f'{" ".join(map(str, args.patchmix_grid))}')
    if args.cutmix_minmax is not None and args.cutmix_minmax[0] > args.cutmix_minmax[1]:
        parser.error(f'argument --cutmix-minmax: MIN {args.cutmix_minmax[0]:g} is above MAX {args.cutmix_minmax[1]:g}')
    if args.no_patch_loss and args.no_image_loss:
        parser.error('--no-patch-loss and --no-image-loss together switch off the whole loss; keep one of the terms')
    if args.patchmix_table and args.guided_prob + args.random_prob > 1:
        parser.error(f'--guided-prob {args.guided_prob:g} and --random-prob {args.random_prob:g} are fractions of '
                     f'one batch and add up to {args.guided_prob + args.random_prob:g}; their sum must be at most 1')
    args.data_dir = args.data_dir or args.data or ''
    explicit_model = args.model is not None
    if args.recipe is None:
        args.recipe = 'demo' if args.dataset in ('', 'patchshapes') and not args.data_dir else 'timm'
    for k, v in dict(TIMM_DEFAULTS, **RECIPES[args.recipe]).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    from timm.optim import get_optimizer_info
    try:  # timm's factory reads 'lookahead_<name>' as <name> with Lookahead
        get_optimizer_info(args.opt.lower().split('_')[-1])
    except ValueError:
        parser.error(f'argument --opt: unknown optimizer {args.opt!r}; timm.optim.list_optimizers() names them')
    if args.patchmix and not explicit_model and not args.model.startswith('patchhead_') and not args.no_patch_loss:
        args.model = 'patchhead_' + args.model  # a recipe's backbone, with the head --patchmix needs
    args.grid_explicit = args.patchmix_grid is not None
    args.patchmix_grid = args.patchmix_grid or [4]
    args.grid = tuple(args.patchmix_grid * 2 if len(args.patchmix_grid) == 1 else args.patchmix_grid)
    return args


# ---------------------------------------------------------------------------------------------------------------
def init_distributed(args):
    args.world_size = int(os.environ.get('WORLD_SIZE', '1'))
    args.rank = int(os.environ.get('RANK', '0'))
    args.local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    args.distributed = args.world_size > 1
    if args.device is None:
        args.device = f'cuda:{args.local_rank}' if torch.cuda.is_available() else 'cpu'
    device = torch.device(args.device)
    if device.type == 'cuda':
        torch.cuda.set_device(device)
    if args.distributed and not dist.is_initialized():
        dist.init_process_group(backend='nccl' if device.type == 'cuda' else 'gloo')
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def epoch_seed(args, epoch: int) -> int:
    # each epoch's augmentation and mixing streams derive from (seed, rank, epoch), so a resumed run replays them
    return (args.seed * 1_000_003 + args.rank * 10_007 + epoch) % (2 ** 63)


class StridedSampler(torch.utils.data.Sampler):
    """Rank r gets items r, r + W, r + 2W...: no padding, so reduced metrics count each image once."""

    def __init__(self, n: int, rank: int, world: int):
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def _reduce(values: List[float], device) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------------------------------------------------------
SOURCES = ('hf-hub:', 'local-dir:')


def model_arch(model: str) -> str:
    """The architecture ``--model`` builds: the name itself, or the one a ``hf-hub:``/``local-dir:`` config names."""
    if model.startswith(SOURCES):
        from .hub import _read_config
        return _read_config(model)['architecture']
    return model


def build_model(args, num_classes: int):
    import timm
    from .models import PatchHeadModel
    from .validation import MODEL_KWARGS
    unknown = sorted(set(args.model_kwargs) - set(MODEL_KWARGS))
    if unknown:  # the checkpoint records them, and loading refuses what is outside the allow-list
        build_parser().error(f'argument --model-kwargs: {", ".join(unknown)} cannot be recorded in a checkpoint '
                             f'(the architectural arguments it may hold are {", ".join(sorted(MODEL_KWARGS))})')
    kwargs = dict(args.model_kwargs)
    from_source = args.model.startswith(SOURCES)
    if args.arch.startswith('patchhead_') and (args.grid_explicit or not from_source):
        kwargs.setdefault('grid', args.grid)
        if args.per_position_head:
            kwargs['per_position'] = True
    if args.in_chans is not None:
        kwargs['in_chans'] = args.in_chans
    if args.drop_path is not None:
        kwargs['drop_path_rate'] = args.drop_path
    if args.drop:
        kwargs['drop_rate'] = args.drop
    try:
        model = timm.create_model(args.model, pretrained=args.pretrained, num_classes=num_classes, **kwargs)
    except TypeError as e:
        model_kwargs_error(args, e)
        raise
    if from_source:  # the config's model_args, as the factory applied them
        kwargs = {k: v for k, v in (getattr(model, '_model_args', None) or {}).items()
                  if k not in ('num_classes', 'pretrained_model_args')}
    args.model_kwargs_used = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
    if isinstance(model, PatchHeadModel):
        args.grid = tuple(model.grid)  # a hub model without --patchmix-grid brings its own
    if args.initial_checkpoint:
        load_initial_checkpoint(model, args.initial_checkpoint)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(True)
    is_patchhead = isinstance(model, PatchHeadModel)
    return model, is_patchhead


KWARG_FLAGS = {'drop_path_rate': '--drop-path', 'drop_rate': '--drop', 'in_chans': '--in-chans',
               'grid': '--patchmix-grid', 'per_position': '--per-position-head', 'num_classes': '--num-classes',
               'pretrained': '--pretrained'}


def model_kwargs_error(args, error: TypeError) -> None:
    """Exit with status 2 and a usage message when ``error`` (from ``timm.create_model``) is a keyword argument the
    model does not take, or one given twice; return otherwise (the caller re-raises)."""
    import re
    m = re.search(r"(unexpected|multiple values for) keyword argument '(\w+)'", str(error))
    if not m:
        return
    key = m.group(2)
    if m.group(1) == 'multiple values for':
        message = (f'argument --model-kwargs: {key} is set by {KWARG_FLAGS.get(key, "train.py itself")}; leave it '
                   f'out of --model-kwargs')
    elif key in args.model_kwargs:
        message = (f'argument --model-kwargs: model {args.model} does not take the keyword argument '
                   f'{key}={args.model_kwargs[key]!r} ({error})')
    else:
        flag = KWARG_FLAGS.get(key, '--model')
        message = f'argument {flag}: model {args.model} does not take {key!r}, which {flag} sets ({error})'
    build_parser().error(message)


def load_initial_checkpoint(model: nn.Module, path: str) -> None:
    """Load weights, dropping classifier tensors whose shapes differ (a new num_classes re-initialises them)."""
    from .checkpoint import CheckpointError, load_weights
    state, _ = load_weights(path)
    own = model.state_dict()
    heads = getattr(model, 'pretrained_cfg', {}).get('classifier') or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    dropped = []
    for h in heads:
        for suffix in ('.weight', '.bias'):
            k = h + suffix
            if k in state and k in own and state[k].shape != own[k].shape:
                dropped.append(state.pop(k))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not any(k.startswith(h + '.') for h in heads)] if dropped else missing
    if missing or unexpected:
        raise CheckpointError(f'{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}')
    if dropped:
        _logger.info('initial checkpoint: re-initialised classifier heads for the new number of classes')


def check_grid_fits_model(model, is_patchhead: bool, input_size, device) -> None:
    if not is_patchhead:
        return
    was = model.training
    model.eval()
    with torch.no_grad():
        model.forward_patches(torch.zeros(1, *input_size, device=device))
    model.train(was)


# ---------------------------------------------------------------------------------------------------------------
def build_loaders(args, train_ds, val_ds, model, num_classes: int, device):
    from timm.data import FastCollateMixup, create_transform, resolve_data_config
    from timm.data.loader import PrefetchLoader, fast_collate
    from .collate import FastCollatePatchMix
    from .data import small_image_transform

    data_config = resolve_data_config(vars(args), model=model, verbose=args.rank == 0)
    if args.in_chans is not None and args.input_size is None:  # the model cfg's input_size names 3 channels
        data_config['input_size'] = (args.in_chans, *data_config['input_size'][1:])
    in_chans = data_config['input_size'][0]
    size = data_config['input_size'][-1]
    prefetch = not args.no_prefetcher
    if max(data_config['input_size'][1:]) <= 64:
        train_tf = small_image_transform(size, True, in_chans, prefetch, data_config['mean'], data_config['std'])
        val_tf = small_image_transform(size, False, in_chans, prefetch, data_config['mean'], data_config['std'])
    else:
        train_tf = create_transform(data_config['input_size'], is_training=True, use_prefetcher=prefetch,
                                    mean=data_config['mean'], std=data_config['std'],
                                    interpolation=data_config['interpolation'])
        val_tf = create_transform(data_config['input_size'], is_training=False, use_prefetcher=prefetch,
                                  mean=data_config['mean'], std=data_config['std'],
                                  interpolation=data_config['interpolation'], crop_pct=data_config['crop_pct'])
    train_ds.transform, val_ds.transform = train_tf, val_tf

    mixup_active = args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None
    collate, mixer = None, None
    if mixup_active:
        from timm.data import Mixup
        margs = dict(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                     prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                     label_smoothing=args.smoothing, num_classes=num_classes)
        if prefetch:
            collate = FastCollateMixup(**margs)
        else:
            mixer = Mixup(**margs)
    elif args.patchmix or args.is_patchhead:
        from .mix import PatchMix
        pargs = dict(grid=args.grid, alpha=args.patchmix_alpha, prob=args.patchmix_prob, mode=args.patchmix_mode,
                     label_smoothing=args.smoothing, num_classes=num_classes)
        if args.patchmix and args.patchmix_collate and not prefetch:
            raise SystemExit('--patchmix-collate mixes uint8 batches in the collate step and needs the '
                             'prefetcher; drop --no-prefetcher or --patchmix-collate')
        if args.patchmix and args.patchmix_table:
            from .collate import FastCollateGuidedPatchMix
            from .guided import GuidedPatchMix, MaskTableError, dataset_fingerprint
            gargs = dict(guided_prob=args.guided_prob, random_prob=args.random_prob, num_classes=num_classes,
                         label_smoothing=args.smoothing, grid=args.grid,
                         fingerprint=dataset_fingerprint(args.dataset, train_ds.classes))
            try:
                if args.patchmix_collate:
                    collate = FastCollateGuidedPatchMix(args.patchmix_table, **gargs)
                else:
                    mixer = GuidedPatchMix(args.patchmix_table, **gargs)
            except (MaskTableError, ValueError) as e:
                raise SystemExit(f'error: {e}') from None
        elif args.patchmix and args.patchmix_collate:
            collate = FastCollatePatchMix(**pargs)
        else:
            mixer = PatchMix(**pargs)
            # a patch-head model without --patchmix trains on unmixed packed targets (per-cell labels = image label)
            mixer.mixup_enabled = bool(args.patchmix)
    if collate is None and prefetch:
        collate = fast_collate

    train_sampler = torch.utils.data.DistributedSampler(train_ds, num_replicas=args.world_size, rank=args.rank,
                                                        shuffle=True, seed=args.seed, drop_last=True)
    workers = max(0, args.workers)

    def worker_init(worker_id):
        s = torch.initial_seed() % (2 ** 32)
        random.seed(s)
        np.random.seed(s)

    loader_gen = torch.Generator()
    train_loader = torch.utils.data.DataLoader(
        train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=workers, collate_fn=collate,
        drop_last=True, pin_memory=args.pin_mem, worker_init_fn=worker_init, generator=loader_gen,
        persistent_workers=False)
    vbs = args.validation_batch_size or args.batch_size
    val_loader = torch.utils.data.DataLoader(
        val_ds, batch_size=vbs, sampler=StridedSampler(len(val_ds), args.rank, args.world_size),
        num_workers=workers, collate_fn=fast_collate if prefetch else None, pin_memory=args.pin_mem)
    if len(train_loader) == 0:
        raise SystemExit(f'the training set has {len(train_ds)} images, fewer than one batch of '
                         f'{args.batch_size} per process; lower --batch-size')
    if prefetch:
        train_loader = PrefetchLoader(train_loader, mean=data_config['mean'], std=data_config['std'],
                                      channels=in_chans, device=device)
        val_loader = PrefetchLoader(val_loader, mean=data_config['mean'], std=data_config['std'],
                                    channels=in_chans, device=device)
    return train_loader, val_loader, train_sampler, loader_gen, mixer, collate, data_config


def build_criterion(args):
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from .loss import PatchMixLoss
    if args.patchmix or args.is_patchhead:
        return PatchMixLoss(image_loss=not args.no_image_loss, patch_loss=not args.no_patch_loss,
                            patch_weight=args.patch_loss_weight)
    if args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None:
        return SoftTargetCrossEntropy()
    if args.smoothing:
        return LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    return nn.CrossEntropyLoss()


def resolve_lr(args) -> None:
    if args.lr is not None:
        return
    global_batch = args.batch_size * args.world_size
    scale = args.lr_base_scale or ('sqrt' if any(o in args.opt.lower() for o in ('ada', 'lamb')) else 'linear')
    ratio = global_batch / args.lr_base_size
    args.lr = args.lr_base * (math.sqrt(ratio) if scale == 'sqrt' else ratio)


# ---------------------------------------------------------------------------------------------------------------
class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite: the run stops at that step, before the epoch's weights are saved, so
    ``best.safetensors``, ``last.safetensors`` and ``state.safetensors`` keep the last finished epoch's."""

    def __init__(self, epoch: int, step: int, steps: int, loss: float, bad_ranks: int = 1, world_size: int = 1):
        self.epoch, self.step, self.steps, self.loss = epoch, step, steps, loss
        where = f' on {bad_ranks} of {world_size} processes' if world_size > 1 else ''
        value = f' ({loss})' if not math.isfinite(loss) else ''
        super().__init__(
            f'non-finite training loss{value}{where} at epoch {epoch}, step {step} of {steps}: training stopped. '
            f'Checkpoints of earlier epochs (best.safetensors, last.safetensors, state.safetensors) are left as they '
            f'were; this epoch saved nothing. A lower --lr, --clip-grad or a warm-up (--warmup-epochs) may keep the '
            f'loss finite.')


def train_one_epoch(epoch, model, loader, optimizer, criterion, scheduler, args, device, mixer, amp_ctx, scaler,
                    state) -> Dict[str, float]:
    from tqdm import tqdm
    model.train()
    loss_sum, n_seen = 0.0, 0
    t0 = time.perf_counter()
    kill_at = int(os.environ.get(KILL_ENV, '0'))
    bar = tqdm(loader, desc=f'train {epoch}', disable=args.rank != 0 or args.no_progress, leave=False,
               unit='batch', dynamic_ncols=True)
    updates_per_epoch = len(loader)
    for i, (x, target) in enumerate(bar):
        if not isinstance(x, torch.Tensor) or x.device != device:
            x, target = x.to(device), target.to(device)
        if mixer is not None:
            x, target = mixer(x, target)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with amp_ctx():
            output = model(x)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            if args.clip_grad:
                scaler.unscale_(optimizer)
                _clip(model, args)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if args.clip_grad:
                _clip(model, args)
            optimizer.step()
        state['updates'] += 1
        if args.sched_on_updates:
            scheduler.step_update(num_updates=state['updates'])
        b = x.shape[0]
        loss_value = float(loss.detach())  # the step's one host sync, as before
        bad_ranks = 0 if math.isfinite(loss_value) else 1
        if dist.is_initialized():  # every rank stops at the same step, whichever rank's loss it was
            bad_ranks = int(_reduce([bad_ranks], device)[0])
        if bad_ranks:  # stop before this epoch's weights reach any file
            raise NonFiniteLossError(epoch, i + 1, updates_per_epoch, loss_value, bad_ranks, args.world_size)
        loss_sum += loss_value * b
        n_seen += b
        elapsed = time.perf_counter() - t0
        if args.rank == 0:
            bar.set_postfix(loss=f'{loss_sum / n_seen:.4f}', img_s=f'{n_seen * args.world_size / elapsed:.0f}')
            if args.no_progress and (i % args.log_interval == 0 or i == updates_per_epoch - 1):
                print(f'train {epoch} [{i + 1}/{updates_per_epoch}] loss {loss_sum / n_seen:.4f} '
                      f'{n_seen * args.world_size / elapsed:.0f} img/s', flush=True)
        if kill_at and state['updates'] >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    total_loss, total_n = _reduce([loss_sum, n_seen], device)
    return {'train_loss': total_loss / max(total_n, 1), 'img_s': total_n / max(elapsed, 1e-9)}


def _clip(model, args):
    if args.clip_mode == 'value':
        torch.nn.utils.clip_grad_value_(model.parameters(), args.clip_grad)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)


@torch.no_grad()
def validate(model, loader, args, device, amp_ctx, num_classes: int) -> Dict[str, float]:
    model.eval()
    k5 = min(5, num_classes)
    loss_sum, c1, c5, n = 0.0, 0, 0, 0
    for x, y in loader:
        if x.device != device:
            x, y = x.to(device), y.to(device)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with amp_ctx():
            logits = model(x)
        logits = logits.float()
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction='sum'))
        top = logits.topk(k5, 1).indices
        c1 += int((top[:, 0] == y).sum())
        c5 += int((top == y[:, None]).any(1).sum())
        n += y.shape[0]
    loss_sum, c1, c5, n = _reduce([loss_sum, c1, c5, n], device)
    return {'eval_loss': loss_sum / max(n, 1), 'eval_top1': 100 * c1 / max(n, 1), 'eval_top5': 100 * c5 / max(n, 1)}


def _csv_text(rows: List[Dict[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator='\n')
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


# what a resumed run must share with the run that wrote its state: the data, the grid, and how batches are mixed and
# scored (the schedule, --epochs, --lr..., may change on a resume; --model and the class count are checked apart)
RESUME_SETTINGS = ('dataset', 'train_split', 'train_subset', 'grid', 'patchmix', 'patchmix_mode', 'patchmix_collate',
                   'patchmix_alpha', 'patchmix_prob', 'patchmix_off_epoch', 'guided_prob', 'random_prob', 'mixup',
                   'cutmix', 'cutmix_minmax', 'mixup_prob', 'mixup_switch_prob', 'mixup_mode', 'mixup_off_epoch',
                   'no_prefetcher', 'smoothing', 'no_patch_loss', 'no_image_loss', 'patch_loss_weight',
                   'per_position_head')


def resume_settings(run_args: Dict[str, Any], table: bool = True) -> Dict[str, Any]:
    """The :data:`RESUME_SETTINGS` of ``run_args`` (a run's args as a dict) under their flag names; with ``table``,
    ``--patchmix-table`` as the table's content (a path alone cannot tell an edited table from the same one)."""
    out = {('--patchmix-grid' if k == 'grid' else '--' + k.replace('_', '-')): run_args[k]
           for k in RESUME_SETTINGS if k in run_args}
    if table:
        from .settings import file_record
        path = run_args.get('patchmix_table')
        out['--patchmix-table'] = file_record(path) if path else None
    return out


# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> Dict[str, Any]:
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from .checkpoint import atomic_write_text, load_state, save_state, save_weights
    from .data import build_dataset, dataset_num_classes

    args = resolve_args(argv)
    logging.basicConfig(level=logging.INFO if int(os.environ.get('RANK', '0')) == 0 else logging.WARNING,
                        format='%(message)s')
    device = init_distributed(args)
    seed_everything(args.seed + args.rank)

    if args.patchmix_table and not args.patchmix:
        raise SystemExit('error: --patchmix-table trains on guided PatchMix samples; add --patchmix')
    if args.patchmix and (args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None):
        raise SystemExit('--patchmix and --mixup/--cutmix are alternatives; choose one')
    try:
        train_ds = build_dataset(args.dataset, args.data_dir, args.train_split, args.dataset_download,
                                 args.train_subset)
        val_ds = build_dataset(args.dataset, args.data_dir, args.val_split, args.dataset_download, args.val_subset)
    except FileNotFoundError as e:
        raise SystemExit(f'error: {e}') from None
    ds_classes = dataset_num_classes(train_ds)
    if args.num_classes is not None and args.num_classes != ds_classes:
        raise SystemExit(f'error: --num-classes {args.num_classes} does not match the {ds_classes} classes of '
                         f'dataset {args.dataset or "patchshapes"}')
    num_classes = ds_classes
    import timm
    from .checkpoint import CheckpointError
    try:
        args.arch = model_arch(args.model)
    except (CheckpointError, OSError) as e:
        raise SystemExit(f'error: --model {args.model}: {e}') from None
    if not timm.is_model(args.arch):
        raise SystemExit(f'error: unknown model {args.arch!r}' + (f' (named by {args.model})' if args.arch !=
                         args.model else '') + '; see timm.list_models() (patchhead_<arch> exists for every timm '
                         'architecture)')
    model, args.is_patchhead = build_model(args, num_classes)
    if args.patchmix and not args.is_patchhead and not args.no_patch_loss:
        raise SystemExit(f'error: --patchmix trains a patch head, and {args.model} has none: use '
                         f'--model patchhead_{args.model}, or --no-patch-loss for image-level PatchMix only')
    if args.is_patchhead and (args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None):
        raise SystemExit(f'error: --mixup/--cutmix give no per-cell labels for the patch head of {args.model}; '
                         f'train the plain backbone for those baselines')
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)

    train_loader, val_loader, train_sampler, loader_gen, mixer, collate, data_config = build_loaders(
        args, train_ds, val_ds, model, num_classes, device)
    try:
        check_grid_fits_model(model, args.is_patchhead, data_config['input_size'], device)
    except ValueError as e:
        raise SystemExit(f'error: --patchmix-grid {args.grid[0]}x{args.grid[1]} on {args.model} at input '
                         f'{data_config["input_size"][1]}x{data_config["input_size"][2]}: {e}') from None
    criterion = build_criterion(args)
    resolve_lr(args)
    opt_kwargs = dict(momentum=args.momentum)
    if args.opt_eps is not None:
        opt_kwargs['eps'] = args.opt_eps
    if args.opt_betas is not None:
        opt_kwargs['betas'] = args.opt_betas
    optimizer = create_optimizer_v2(model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay, **opt_kwargs)
    scheduler, num_epochs = create_scheduler_v2(
        optimizer, sched=args.sched, num_epochs=args.epochs, decay_epochs=args.decay_epochs,
        decay_rate=args.decay_rate, cooldown_epochs=args.cooldown_epochs, min_lr=args.min_lr,
        warmup_lr=args.warmup_lr, warmup_epochs=args.warmup_epochs, step_on_epochs=not args.sched_on_updates,
        updates_per_epoch=len(train_loader))

    amp_dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' or device.type != 'cuda' else torch.float16
    amp_ctx = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if args.amp else nullcontext
    scaler = torch.amp.GradScaler('cuda') if args.amp and device.type == 'cuda' and amp_dtype == torch.float16 \
        else None

    exp = args.experiment or '-'.join([datetime.now().strftime('%Y%m%d-%H%M%S'),
                                       timm.models.get_arch_name(args.arch).replace('/', '_'),
                                       'patchmix' if args.patchmix else 'base'])
    out_dir = os.path.join(args.output or os.path.join('.', 'output', 'train'), exp)

    start_epoch, rows, best = 0, [], None
    state = {'updates': 0}
    run_settings = resume_settings(vars(args))
    if args.resume:
        from .checkpoint import CheckpointError
        from .settings import check_settings
        try:
            st = load_state(args.resume)
        except CheckpointError as e:
            raise SystemExit(f'error: cannot resume: {e}') from None
        saved = st['meta'].get('args', {})
        for key in ('model', 'num_classes'):
            have = args.model if key == 'model' else num_classes
            if saved.get(key) is not None and saved.get(key) != have:
                raise SystemExit(f'error: {args.resume} was trained with {key}={saved.get(key)!r}, this run has '
                                 f'{have!r}')
        # a state from before settings were recorded: its args, without the table's content
        check_settings(st['meta'].get('settings') or resume_settings(saved, table=False), run_settings,
                       f'cannot resume from {args.resume}: it was trained',
                       'Resume with the settings it was trained with, or train the new settings afresh (without '
                       '--resume) under another --output/--experiment.')
        model.load_state_dict(st['model'])
        if st['optimizer'] is not None:
            optimizer.load_state_dict(st['optimizer'])
        start_epoch = int(st['meta']['epoch']) + 1
        rows = list(st['meta'].get('rows', []))
        best = st['meta'].get('best')
        state['updates'] = int(st['meta'].get('updates', 0))
        if not args.experiment:
            out_dir = os.path.dirname(os.path.abspath(args.resume))
        if args.rank == 0:
            print(f'resuming from {args.resume} at epoch {start_epoch}')
    if start_epoch > 0:
        scheduler.step(start_epoch)

    train_model = model
    if args.torchcompile:
        train_model = torch.compile(model, backend=args.torchcompile)
    if args.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_model = DDP(train_model, device_ids=[device.index] if device.type == 'cuda' else None,
                          find_unused_parameters=bool(args.no_patch_loss or args.no_image_loss))

    record_args = {k: v for k, v in vars(args).items() if k not in ('data',)}
    record_args['num_classes'] = num_classes
    weights_meta = {
        'model': timm.models.get_arch_name(args.arch), 'num_classes': num_classes,
        'model_kwargs': args.model_kwargs_used,
        'class_names': list(train_ds.classes),
        'data': {'dataset': args.dataset, 'data_dir': args.data_dir, 'val_split': args.val_split,
                 'input_size': list(data_config['input_size']), 'mean': list(data_config['mean']),
                 'std': list(data_config['std'])},
        'patchmix': {'enabled': args.patchmix, 'grid': list(args.grid), 'table': args.patchmix_table or None}
        if args.is_patchhead or args.patchmix
        else None,
        'command': ' '.join(['train.py'] + (list(argv) if argv is not None else sys.argv[1:])),
    }
    if args.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        atomic_write_text(os.path.join(out_dir, 'args.yaml'), yaml.safe_dump(
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in record_args.items()}, sort_keys=False))
        if rows:
            atomic_write_text(os.path.join(out_dir, 'summary.csv'), _csv_text(rows))
        n_params = sum(p.numel() for p in model.parameters())
        print(f'{args.model}: {n_params / 1e6:.2f}M params, {num_classes} classes, {len(train_ds)} train / '
              f'{len(val_ds)} val images, {num_epochs} epochs, batch {args.batch_size} x {args.world_size}, '
              f'lr {args.lr:g}, output {out_dir}')

    metric_key = {'top1': 'eval_top1', 'top5': 'eval_top5', 'loss': 'eval_loss'}[args.eval_metric]
    for epoch in range(start_epoch, num_epochs):
        seed_everything(epoch_seed(args, epoch))
        loader_gen.manual_seed(epoch_seed(args, epoch))
        train_sampler.set_epoch(epoch)
        mix_target = collate if collate is not None and hasattr(collate, 'mixup_enabled') else mixer
        off = args.patchmix_off_epoch if args.patchmix else args.mixup_off_epoch
        if mix_target is not None and (args.patchmix or not args.is_patchhead) and off and epoch >= off:
            mix_target.mixup_enabled = False
        tr = train_one_epoch(epoch, train_model, train_loader, optimizer, criterion, scheduler, args, device,
                             mixer, amp_ctx, scaler, state)
        ev = validate(model, val_loader, args, device, amp_ctx, num_classes)
        lr = optimizer.param_groups[0]['lr']
        scheduler.step(epoch + 1, ev[metric_key])
        row = {'epoch': epoch, 'train_loss': round(tr['train_loss'], 6), 'eval_loss': round(ev['eval_loss'], 6),
               'eval_top1': round(ev['eval_top1'], 4), 'eval_top5': round(ev['eval_top5'], 4), 'lr': lr,
               'img_s': round(tr['img_s'], 1)}
        rows.append(row)
        score = ev[metric_key]
        improved = best is None or (score < best['score'] if args.eval_metric == 'loss' else score > best['score'])
        if improved:
            best = {'score': score, 'epoch': epoch, 'metric': args.eval_metric}
        if args.rank == 0:
            sd = model.state_dict()
            meta = dict(weights_meta, epoch=epoch, metrics=row)
            if improved:
                save_weights(os.path.join(out_dir, 'best.safetensors'), sd, meta)
            save_weights(os.path.join(out_dir, 'last.safetensors'), sd, meta)
            save_state(os.path.join(out_dir, 'state.safetensors'), sd, optimizer,
                       {'epoch': epoch, 'rows': rows, 'best': best, 'updates': state['updates'],
                        'args': record_args, 'seed': args.seed, 'settings': run_settings})
            atomic_write_text(os.path.join(out_dir, 'summary.csv'), _csv_text(rows))
            print(f"epoch {epoch}: train_loss {row['train_loss']:.4f} eval_loss {row['eval_loss']:.4f} top1 "
                  f"{row['eval_top1']:.2f} top5 {row['eval_top5']:.2f} lr {lr:.4g} {row['img_s']:.0f} img/s",
                  flush=True)

    result = {'output': out_dir, 'rows': rows, 'best': best}
    if args.fgsm and args.rank == 0:
        result['fgsm'] = run_fgsm(args, model, val_ds, data_config, device, out_dir)
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return result


def run_fgsm(args, model, val_ds, data_config, device, out_dir) -> Dict[str, float]:
    from .data import pixel_transform
    from .robustness import fgsm_accuracy, report
    val_ds.transform = pixel_transform(*data_config['input_size'])
    loader = torch.utils.data.DataLoader(val_ds, batch_size=args.validation_batch_size or args.batch_size)
    res = fgsm_accuracy(model, loader, [0.0] + list(args.fgsm), data_config['mean'], data_config['std'], device)
    report(res, out_dir)
    return res


def cli(argv=None) -> int:
    from .settings import USAGE_ERROR, SettingsChangedError
    try:
        main(argv)
    except SettingsChangedError as e:  # a resume with other settings than its state's
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    except NonFiniteLossError as e:  # the run diverged: a failed run, not a usage error
        print(f'error: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(cli())
