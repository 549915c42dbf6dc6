"""Training with timm's flags plus PatchMix: the command line of the top-level ``train.py``.

    python train.py                                   # embedded data, resnet32_cifar, a short demo run
    python train.py --model patchhead_resnet32_cifar --patchmix
    python train.py --dataset fashion_mnist --model patchhead_preactresnet18_cifar --patchmix --recipe paper-cifar
    torchrun --nproc_per_node 2 train.py --patchmix   # DDP: NCCL on GPUs, gloo on CPU

This module parses flags into a :class:`~timm_patchmix.engine.TrainConfig`, runs
:func:`timm_patchmix.engine.train` and maps its errors to exit statuses: 2 for a usage error (a bad flag or
combination of flags, a resume with changed settings), 1 for a run that cannot start or that failed (a missing
dataset, a non-finite loss). The training itself lives in :mod:`timm_patchmix.engine`.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from typing import Any, Callable, Dict, List, Optional

from timm.utils import ParseKwargs as _TimmParseKwargs

from .checkpoint import WriteError
from .cli_types import optional_directory, optional_file
from .engine import ConfigError, NonFiniteLossError, StepEvent, TrainConfig, TrainSetupError, train
from .engine.config import (CHOICES, CLIP_MODES, LR_RULE, RECIPES, SCHEDULERS, TIMM_DEFAULTS, UNFLAGGED,
                            VALUE_TYPES, check_setting)
from .engine.model import model_arch
from .engine.records import RESUME_SETTINGS, resume_settings

__all__ = ['build_parser', 'parse_config', 'config_file_defaults', 'resolve_args', 'main', 'cli', 'NonFiniteLossError',
           'RECIPES',
           'TIMM_DEFAULTS', 'SCHEDULERS', 'RESUME_SETTINGS', 'resume_settings', 'model_arch']


class ParseKwargs(_TimmParseKwargs):
    """timm's ``--model-kwargs a=1 b=x`` parser (values as Python literals where they parse, else strings), with a
    usage error for an item that is not ``key=value``."""

    def __call__(self, parser, namespace, values, option_string=None):
        for v in values:
            if v and '=' not in v:
                parser.error(f'argument {option_string}: expects key=value pairs, got {v!r}')
        super().__call__(parser, namespace, values, option_string)


def _kwargs_value(text: str) -> Any:
    """A ``--model-kwargs``/``--opt-kwargs`` value as the flag reads it: a Python literal where it is one (YAML
    reads ``1e-8`` as a string), else the string."""
    import ast
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _dataset_flags(g) -> None:
    g.add_argument('data', nargs='?', metavar='DIR', type=optional_directory,
                   help='path to dataset (positional, as in timm)')
    g.add_argument('--data-dir', default=None, type=optional_directory, help='path to dataset root')
    g.add_argument('--dataset', default='', help="'' (embedded patchshapes, or an image folder with --data-dir), "
                   "'patchshapes', 'fashion_mnist' (IDX files on disk), 'sklearn_digits' (scikit-learn's 8x8 "
                   "digits: 1,297 train / 500 test, needs timm_patchmix[study]), or a timm name such as "
                   "torch/cifar10")
    g.add_argument('--train-split', default='train')
    g.add_argument('--val-split', default='validation',
                   help='the split every epoch is evaluated on; with --holdout, the test split, evaluated once at '
                        'the end')
    g.add_argument('--dataset-download', action='store_true', default=False)
    g.add_argument('--train-subset', type=VALUE_TYPES['train_subset'], default=None,
                   help='train on a fixed random subset of N images (with --holdout, of the images not held out)')
    g.add_argument('--val-subset', type=VALUE_TYPES['val_subset'], default=None,
                   help='validate on a fixed random subset of N images (with --holdout, of the held-out images)')
    g.add_argument('--holdout', type=VALUE_TYPES['holdout'], default=0.0, metavar='FRACTION',
                   help='hold out this fixed random fraction of the training split: it never trains, and every '
                        'epoch is evaluated on it (best epoch, --eval-metric); --val-split becomes the test split, '
                        'evaluated at the end (0: off, every epoch is evaluated on --val-split)')
    g.add_argument('--holdout-seed', type=VALUE_TYPES['holdout_seed'], default=0,
                   help='which images --holdout holds out')
    g.add_argument('--test-subset', type=VALUE_TYPES['test_subset'], default=None,
                   help='with --holdout, test on a fixed random subset of N images of --val-split (default: all)')


def _recipe_default(name: str, text: str = '') -> str:
    """``text`` and where the value of a flag left unset comes from: its ``--recipe``'s (one value where all agree;
    an lr without one: timm's rule)."""
    values = {r: dict(TIMM_DEFAULTS, **RECIPES[r]).get(name) for r in ('demo', 'timm', 'paper-cifar')}
    shown = {r: ('by the rule of --lr-base' if v is None and name == 'lr' else repr(v) if v == '' else str(v))
             for r, v in values.items()}
    if len(set(shown.values())) == 1:
        default = f'default: {next(iter(shown.values()))}'
    else:
        default = "default: the --recipe's, " + ', '.join(f'{r} {v}' for r, v in shown.items())
    return f'{text} ({default})' if text else default


def _model_flags(g) -> None:
    g.add_argument('--model', default=None,
                   help=_recipe_default('model', 'timm model name; patchhead_<arch> adds the patch head'))
    g.add_argument('--pretrained', action='store_true', default=False)
    g.add_argument('--initial-checkpoint', default='', type=optional_file,
                   help='start from these weights (safetensors)')
    g.add_argument('--resume', default='', type=optional_file, help='resume from a training state (state.safetensors)')
    g.add_argument('--reset-head', action='store_true', default=False,
                   help='after --pretrained/--initial-checkpoint weights are loaded, re-initialise the classifier '
                        '(and a patchhead_ model\'s patch head) for the dataset\'s classes, even when their number '
                        'is the same')
    g.add_argument('--linear-probe', action='store_true', default=False,
                   help='train only the classifier (and a patchhead_ model\'s patch classifier while the patch loss '
                        'is on); the rest of the model is frozen and stays in eval mode. Does not reset the head: '
                        'add --reset-head for a fresh one')
    g.add_argument('--num-classes', type=VALUE_TYPES['num_classes'], default=None)
    g.add_argument('--in-chans', type=VALUE_TYPES['in_chans'], default=None)
    g.add_argument('--img-size', type=VALUE_TYPES['img_size'], default=None)
    g.add_argument('--input-size', type=VALUE_TYPES['input_size'], nargs=3, default=None, metavar='N')
    g.add_argument('--mean', type=VALUE_TYPES['mean'], nargs='+', default=None, metavar='MEAN',
                   help="normalisation mean in place of the model's (one value, or one per channel)")
    g.add_argument('--std', type=VALUE_TYPES['std'], nargs='+', default=None, metavar='STD',
                   help="normalisation std in place of the model's (one value, or one per channel)")
    g.add_argument('--crop-pct', type=VALUE_TYPES['crop_pct'], default=None,
                   help="evaluation centre-crop fraction in place of the model's (any input but a square one of at "
                        "most 64 px)")
    g.add_argument('--interpolation', default=None, choices=CHOICES['interpolation'],
                   help="resize interpolation in place of the model's (any input but a square one of at most "
                        "64 px)")
    g.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs)
    g.add_argument('--drop', type=VALUE_TYPES['drop'], default=0.0)
    g.add_argument('--drop-path', type=VALUE_TYPES['drop_path'], default=None)
    g.add_argument('--drop-block', type=VALUE_TYPES['drop_block'], default=None,
                   help='DropBlock rate (models whose builders take drop_block_rate, e.g. resnet50)')
    g.add_argument('--gp', default=None, metavar='POOL',
                   help="global pooling in place of the model's: fast, avg, max, avgmax, catavgmax")
    g.add_argument('--bn-momentum', type=VALUE_TYPES['bn_momentum'], default=None,
                   help="BatchNorm momentum in place of the model's (models whose builders take it, e.g. "
                        "efficientnet_b0)")
    g.add_argument('--bn-eps', type=VALUE_TYPES['bn_eps'], default=None,
                   help="BatchNorm epsilon in place of the model's (as --bn-momentum)")
    g.add_argument('--head-init-scale', type=VALUE_TYPES['head_init_scale'], default=None,
                   help="multiply the classifier's initial weight and bias (and a patchhead_ model's patch "
                        "classifier's) by this, after --pretrained/--initial-checkpoint weights are in")
    g.add_argument('--head-init-bias', type=VALUE_TYPES['head_init_bias'], default=None,
                   help="set the classifier's initial bias (and the patch classifier's) to this")
    g.add_argument('--grad-checkpointing', action='store_true', default=False)
    g.add_argument('--torchcompile', nargs='?', const='inductor', default=None)
    g.add_argument('--model-ema', action='store_true', default=False,
                   help="keep timm's exponential moving average of the weights (ModelEmaV3), updated after each "
                        "optimizer update: it is what each epoch evaluates, what --eval-metric selects and what "
                        "best/last.safetensors hold")
    g.add_argument('--model-ema-decay', type=VALUE_TYPES['model_ema_decay'], default=0.9998,
                   help='the average\'s decay per update')
    g.add_argument('--model-ema-warmup', action='store_true', default=False,
                   help="timm's decay warm-up: a lower decay over the first updates, rising to --model-ema-decay")


def _augment_flags(g) -> None:
    g.add_argument('--no-aug', action='store_true', default=False,
                   help="no training augmentation: a square input of at most 64 px trains on its evaluation "
                        "transform, others on timm's no-aug transform (resized to the input size)")
    g.add_argument('--scale', type=VALUE_TYPES['scale'], nargs=2, default=None, metavar=('MIN', 'MAX'),
                   help="random-resized-crop area range (default 0.08 1; inputs other than a square of at most "
                        "64 px, whose CIFAR-style crop is a padded random crop)")
    g.add_argument('--ratio', type=VALUE_TYPES['ratio'], nargs=2, default=None, metavar=('MIN', 'MAX'),
                   help="random-resized-crop aspect range (default 3/4 4/3; as --scale)")
    g.add_argument('--hflip', type=VALUE_TYPES['hflip'], default=0.5, help='horizontal flip probability')
    g.add_argument('--vflip', type=VALUE_TYPES['vflip'], default=0.0, help='vertical flip probability')
    g.add_argument('--color-jitter', type=VALUE_TYPES['color_jitter'], default=None, metavar='PCT',
                   help="colour jitter factor (default: timm's 0.4 on timm's transform, none on the CIFAR-style "
                        "one). timm leaves it out beside an --aa policy other than 3a, so it is refused there")
    g.add_argument('--aa', default=None, metavar='POLICY',
                   help="timm's AutoAugment/RandAugment/AugMix policy, e.g. rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, "
                        "original, v0, 3a")
    g.add_argument('--reprob', type=VALUE_TYPES['reprob'], default=0.0,
                   help='random erasing probability (after normalisation; with the prefetcher, on the batch)')
    g.add_argument('--remode', default='pixel', choices=CHOICES['remode'], help='random erasing fill')
    g.add_argument('--recount', type=VALUE_TYPES['recount'], default=1, help='random erasing count')
    g.add_argument('--train-interpolation', default=None, choices=CHOICES['train_interpolation'],
                   help="training resize interpolation (default random; as --scale)")
    g.add_argument('--aug-repeats', type=VALUE_TYPES['aug_repeats'], default=0, metavar='N',
                   help="repeated augmentation (timm's RepeatAugSampler, as in DeiT): each image drawn comes N times, "
                        "each copy augmented on its own, the epoch as long as without (so about 1/N of the images "
                        "an epoch; 0: off; N >= 1)")


def _optimizer_flags(g) -> None:
    g.add_argument('-b', '--batch-size', type=VALUE_TYPES['batch_size'], default=None,
                   help=_recipe_default('batch_size'))
    g.add_argument('-vb', '--validation-batch-size', type=VALUE_TYPES['validation_batch_size'], default=None)
    g.add_argument('--grad-accum-steps', type=VALUE_TYPES['grad_accum_steps'], default=1, metavar='N',
                   help="add up the gradients of N batches for each optimizer update (timm's): an update's batch is "
                        "-b x N x processes, which timm's lr rule (--lr-base) scales to")
    g.add_argument('--opt', default=None, help=_recipe_default('opt'))
    g.add_argument('--opt-eps', type=VALUE_TYPES['opt_eps'], default=None)
    g.add_argument('--opt-betas', type=VALUE_TYPES['opt_betas'], nargs='+', default=None)
    g.add_argument('--momentum', type=VALUE_TYPES['momentum'], default=None, help=_recipe_default('momentum'))
    g.add_argument('--weight-decay', type=VALUE_TYPES['weight_decay'], default=None,
                   help=_recipe_default('weight_decay'))
    g.add_argument('--opt-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                   help="extra keyword arguments of the optimizer (timm's), e.g. amsgrad=True")
    g.add_argument('--layer-decay', type=VALUE_TYPES['layer_decay'], default=None,
                   help="layer-wise lr decay (timm's): each layer group's lr this times the next one's, by the "
                        "model's group_matcher (the classifier and a patch head at the full lr)")
    g.add_argument('--clip-grad', type=VALUE_TYPES['clip_grad'], default=None, help='0: no clipping')
    g.add_argument('--clip-mode', default='norm', choices=CLIP_MODES,
                   help="timm's dispatch_clip_grad: 'norm', 'value' or 'agc' (adaptive, --clip-grad is the ratio)")
    g.add_argument('--sched', default=None, choices=SCHEDULERS, help=_recipe_default('sched'))
    g.add_argument('--sched-on-updates', action='store_true', default=False)
    g.add_argument('--lr', type=VALUE_TYPES['lr'], default=None, help=_recipe_default('lr'))
    g.add_argument('--lr-base', type=VALUE_TYPES['lr_base'], default=None,
                   help="without --lr: the lr is this times the global batch over --lr-base-size (timm's rule; "
                        "default: 0.1). Given, it wins over a recipe's lr")
    g.add_argument('--lr-base-size', type=VALUE_TYPES['lr_base_size'], default=None,
                   help=_recipe_default('lr_base_size'))
    g.add_argument('--lr-base-scale', default=None, choices=('', 'linear', 'sqrt'),
                   help='default: sqrt for Ada*/LAMB optimizers, else linear')
    g.add_argument('--min-lr', type=VALUE_TYPES['min_lr'], default=None, help=_recipe_default('min_lr'))
    g.add_argument('--warmup-lr', type=VALUE_TYPES['warmup_lr'], default=None, help=_recipe_default('warmup_lr'))
    g.add_argument('--epochs', type=VALUE_TYPES['epochs'], default=None, help=_recipe_default('epochs'))
    g.add_argument('--warmup-epochs', type=VALUE_TYPES['warmup_epochs'], default=None,
                   help=_recipe_default('warmup_epochs'))
    g.add_argument('--cooldown-epochs', type=VALUE_TYPES['cooldown_epochs'], default=0)
    g.add_argument('--decay-epochs', type=VALUE_TYPES['decay_epochs'], default=90)
    g.add_argument('--decay-milestones', type=VALUE_TYPES['decay_milestones'], nargs='+', default=(90, 180, 270),
                   metavar='EPOCH', help='the epochs at which --sched multistep decays the lr')
    g.add_argument('--decay-rate', '--dr', type=VALUE_TYPES['decay_rate'], default=0.1)
    g.add_argument('--patience-epochs', type=VALUE_TYPES['patience_epochs'], default=10,
                   help='--sched plateau: epochs without a better --eval-metric before the lr decays')
    g.add_argument('--warmup-prefix', action='store_true', default=False,
                   help='the schedule starts after the warm-up epochs instead of counting them')
    g.add_argument('--lr-noise', type=VALUE_TYPES['lr_noise'], nargs='+', default=None, metavar='FRACTION',
                   help='noise on the lr from this fraction of the epochs on (or between two fractions)')
    g.add_argument('--lr-noise-pct', type=VALUE_TYPES['lr_noise_pct'], default=0.67,
                   help="--lr-noise's bound, a fraction of the lr")
    g.add_argument('--lr-noise-std', type=VALUE_TYPES['lr_noise_std'], default=1.0, help="--lr-noise's std-dev")
    g.add_argument('--lr-cycle-mul', type=VALUE_TYPES['lr_cycle_mul'], default=1.0,
                   help='cosine/tanh/poly: each cycle this many times as long as the one before')
    g.add_argument('--lr-cycle-decay', type=VALUE_TYPES['lr_cycle_decay'], default=0.5,
                   help="cosine/tanh/poly: each cycle's peak lr this times the one before")
    g.add_argument('--lr-cycle-limit', type=VALUE_TYPES['lr_cycle_limit'], default=1,
                   help='cosine/tanh/poly: cycles (restarts when > 1; the run trains --epochs per cycle, as in '
                        'timm)')
    g.add_argument('--lr-k-decay', type=VALUE_TYPES['lr_k_decay'], default=1.0, help='cosine/poly: k-decay')
    g.add_argument('--recipe', choices=sorted(RECIPES), default=None,
                   help="defaults for unset flags: 'demo' (the default with the embedded data), 'timm' (timm's "
                        "train.py defaults, the default otherwise) or 'paper-cifar'")


def _mixing_flags(g) -> None:
    g.add_argument('--mixup', type=VALUE_TYPES['mixup'], default=0.0)
    g.add_argument('--cutmix', type=VALUE_TYPES['cutmix'], default=0.0)
    g.add_argument('--cutmix-minmax', type=VALUE_TYPES['cutmix_minmax'], nargs=2, default=None, metavar=('MIN', 'MAX'))
    g.add_argument('--mixup-prob', type=VALUE_TYPES['mixup_prob'], default=1.0)
    g.add_argument('--mixup-switch-prob', type=VALUE_TYPES['mixup_switch_prob'], default=0.5)
    g.add_argument('--mixup-mode', default='batch', choices=('batch', 'pair', 'elem', 'half'))
    g.add_argument('--mixup-off-epoch', type=VALUE_TYPES['mixup_off_epoch'], default=0, help='0: never')
    g.add_argument('--smoothing', type=VALUE_TYPES['smoothing'], default=None, help=_recipe_default('smoothing'))
    g.add_argument('--bce-loss', action='store_true', default=False,
                   help="timm's binary cross-entropy in place of the cross-entropy (the image's and each cell's)")
    g.add_argument('--bce-sum', action='store_true', default=False, help='--bce-loss: sum over the classes')
    g.add_argument('--bce-target-thresh', type=VALUE_TYPES['bce_target_thresh'], default=None,
                   help='--bce-loss: targets above this become 1, the rest 0')
    g.add_argument('--bce-pos-weight', type=VALUE_TYPES['bce_pos_weight'], default=None,
                   help="--bce-loss: the weight of each class's positive term")
    g.add_argument('--patchmix', action='store_true', default=False, help='train with PatchMix and PatchMixLoss')
    g.add_argument('--patchmix-grid', type=VALUE_TYPES['grid'], nargs='+', default=None,
                   help="P, or rows cols (default 4; a hf-hub:/local-dir: model's own grid)")
    g.add_argument('--patchmix-alpha', type=VALUE_TYPES['patchmix_alpha'], default=1.0)
    g.add_argument('--patchmix-prob', type=VALUE_TYPES['patchmix_prob'], default=1.0)
    g.add_argument('--patchmix-mode', default='elem', choices=('elem', 'pair', 'batch'))
    g.add_argument('--patchmix-collate', action='store_true', default=False, help='mix at collate time')
    g.add_argument('--patchmix-off-epoch', type=VALUE_TYPES['patchmix_off_epoch'], default=0, help='0: never')
    g.add_argument('--no-patch-loss', action='store_true', default=False)
    g.add_argument('--no-image-loss', action='store_true', default=False)
    g.add_argument('--patch-loss-weight', type=VALUE_TYPES['patch_loss_weight'], default=1.0)
    g.add_argument('--per-position-head', action='store_true', default=False)
    g.add_argument('--patchmix-table', default='', type=optional_file,
                   help='mask table from search.py: train on guided samples')
    g.add_argument('--guided-prob', type=VALUE_TYPES['guided_prob'], default=1 / 3,
                   help='fraction of each batch that is guided')
    g.add_argument('--random-prob', type=VALUE_TYPES['random_prob'], default=1 / 3,
                   help='fraction of each batch mixed by random PatchMix when a table is given (the rest is clean)')


def _running_flags(g) -> None:
    g.add_argument('--amp', action='store_true', default=False)
    g.add_argument('--amp-dtype', default='float16', choices=('float16', 'bfloat16'))
    g.add_argument('--channels-last', action='store_true', default=False)
    g.add_argument('--dist-bn', default='reduce', choices=('', 'broadcast', 'reduce'),
                   help='with several processes, before each validation: average the BatchNorm running stats over '
                        'the processes (reduce), take rank 0\'s (broadcast), or leave each its own (\'\')')
    g.add_argument('-j', '--workers', type=VALUE_TYPES['workers'], default=None,
                   help=_recipe_default('workers', '0: load in the main process'))
    g.add_argument('--pin-mem', action='store_true', default=False)
    g.add_argument('--no-prefetcher', action='store_true', default=False)
    g.add_argument('--device-data', action='store_true', default=False,
                   help='keep a small-image dataset (sides <= 64) whole on the device as uint8 and crop, flip, '
                        'normalise and mix its batches there, instead of streaming it through the data loader')
    g.add_argument('--device', default=None, help='default: cuda when available, else cpu')
    g.add_argument('--seed', type=VALUE_TYPES['seed'], default=42)
    g.add_argument('--output', default='', type=optional_directory,
                   help='the folder of the run folders (default: output/train)')
    g.add_argument('--experiment', default='',
                   help='the run folder\'s name (default: <YYYYMMDD-HHMMSS>-<model>-<patchmix|base>, -1, -2... '
                        'added for a run started in the same second as another)')
    g.add_argument('--log-interval', type=VALUE_TYPES['log_interval'], default=50, metavar='N',
                   help='with --no-progress, a line (loss, lr, images/s) at every N-th optimizer update of an epoch '
                        'and at its end, as timm logs; without it the progress bar shows them')
    g.add_argument('--eval-metric', default='top1', choices=('top1', 'top5', 'loss'))
    g.add_argument('--checkpoint-hist', type=VALUE_TYPES['checkpoint_hist'], default=0, metavar='N',
                   help='keep the weights of the N best epochs by --eval-metric (as summary.csv gives it) as '
                        'checkpoint-<epoch>.safetensors, timm\'s checkpoint history (timm keeps 10 by default; 0: '
                        'none, only best, last and state)')
    g.add_argument('--fgsm', type=VALUE_TYPES['fgsm'], nargs='+', default=None, metavar='EPS',
                   help='after training, FGSM top-1 on the validation set for each eps (pixels in [0, 1])')
    g.add_argument('--no-progress', action='store_true', default=False)


def _config_flag(g) -> None:
    g.add_argument('-c', '--config', default='', metavar='FILE',
                   help="YAML file of settings by name (a run's args.yaml, or some of its keys): they replace the "
                        "defaults, the flags given here win over them, and the recipe fills what neither sets")


EPILOG = '''examples:
  {prog} --patchmix                          # Random PatchMix on the embedded data (demo recipe)
  {prog} --patchmix --patchmix-table output/search/masks.json   # Guided PatchMix with a searched table
  {prog} --model resnet32_cifar --cutmix 1.0  # a baseline with timm's CutMix
  {prog} --dataset fashion_mnist --holdout 0.1 --model patchhead_resnet32_cifar --patchmix
  {prog} <the run's flags> --resume output/train/<run>/state.safetensors   # continue a killed run
  {prog} -c output/train/<run>/args.yaml --seed 1   # that run's settings, another seed
  torchrun --nproc_per_node 2 -m timm_patchmix.train --patchmix   # DDP (from a checkout: torchrun ... train.py)'''


def build_parser() -> argparse.ArgumentParser:
    from .cli import HelpFormatter, prog_name
    prog = prog_name('timm_patchmix.train')
    p = argparse.ArgumentParser(prog=prog, description='timm-style training with PatchMix: timm\'s training flags, '
                                '--patchmix and its options. A flag without a default shown takes the recipe\'s '
                                'value\nor one resolved from the model (--recipe, docs/training.md).',
                                formatter_class=HelpFormatter, epilog=EPILOG.format(prog=prog), add_help=True)
    _config_flag(p)
    _dataset_flags(p.add_argument_group('Dataset'))
    _model_flags(p.add_argument_group('Model'))
    _augment_flags(p.add_argument_group('Augmentation'))
    _optimizer_flags(p.add_argument_group('Optimizer and schedule'))
    _mixing_flags(p.add_argument_group('Mixing and loss'))
    _running_flags(p.add_argument_group('Running'))
    return p


def _config(ns: argparse.Namespace, argv: Optional[List[str]]) -> TrainConfig:
    flags = vars(ns).copy()
    flags.pop('config')
    positional = flags.pop('data')
    flags['data_dir'] = flags['data_dir'] or positional or ''
    flags['grid'] = flags.pop('patchmix_grid')
    words = list(argv) if argv is not None else sys.argv[1:]
    flags['command'] = shlex.join(['train.py'] + words)  # as a shell reads it back (--dataset '' included)
    cfg = TrainConfig(**flags).with_recipe()
    cfg.check_flags_given(_given_dests(words))
    return cfg


def _given_dests(words: List[str]) -> set:
    """The destinations the command line ``words`` sets, at any value (a default given explicitly included), as
    the parser reads them: a parser whose options have no defaults leaves only those in its namespace."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(words)))


# the keys of a config file that name no flag: what args.yaml records besides the flags (the command line, and what
# is resolved from the model and the batch), left out; TrainConfig's name of --patchmix-grid
_RECORDED_ONLY = frozenset(UNFLAGGED)
_FIELD_OF = {'patchmix_grid': 'grid', 'data': 'data_dir'}
# keys that name a run's folder and the state it resumed from rather than how it trains: a run's args.yaml holds
# them, and a rerun from it must neither write into that run's folder nor resume its state; left out too
_RUN_ONLY = ('experiment', 'resume')
_logger = logging.getLogger(__name__)


def config_file_defaults(path: str, parser: argparse.ArgumentParser) -> Dict[str, Any]:
    """The settings of the YAML file ``path`` (``-c/--config``) as defaults of ``parser``'s flags, by destination.

    The file maps settings by name, as ``args.yaml`` records them (``grid`` is ``--patchmix-grid``; ``command``,
    ``arch``, ``patch_head``, ``data_config`` and ``lr_source``, which a run resolves, are left out, and so are
    ``experiment`` and ``resume``, which name a run's folder and state). The ``lr`` is read only where it was a
    flag's (``lr_source: flag``, or no ``lr_source``): the recipe's or timm's rule's is set again by them, so that
    ``--lr-base``, ``-b`` or ``--grad-accum-steps`` given with the file change it as without one. A string
    is read as the flag reads it (``lr: 1e-3``, which YAML leaves a string, is 0.001); a flag that takes several
    values also takes one (``fgsm: 0.1``). Each value is checked as the flag's; an unknown key, a value a flag would
    refuse, or a file that is no mapping is a :class:`ConfigError` naming the file."""
    import yaml

    def fail(message: str) -> ConfigError:
        return ConfigError(f'{path}: {message}', '-c/--config')

    if not os.path.isfile(path):
        raise fail('no such file' if not os.path.exists(path) else 'not a file')
    try:
        with open(path, encoding='utf-8') as f:
            data = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise fail(f'not a readable YAML file: {" ".join(str(e).split())}') from None
    except OSError as e:
        raise fail(f'cannot be read: {e.strerror or e}') from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise fail(f'must map setting names to values (as a run\'s args.yaml does), got a {type(data).__name__}')
    actions = {a.dest: a for a in parser._actions if a.dest not in ('help', 'config')}
    named = {'grid': 'patchmix_grid'}
    both = [k for k in named if k in data and named[k] in data]
    if both:
        raise fail(f'gives both {both[0]} and {named[both[0]]}, which are one setting; keep one')
    unknown = [k for k in data if named.get(k, k) not in actions and k not in _RECORDED_ONLY]
    if unknown:
        raise fail(f'unknown setting{"s" if len(unknown) > 1 else ""} {", ".join(unknown)}: not flags of train.py '
                   f'(its flags, with - as _; timm flags it does not offer are listed in docs/training.md)')
    run_only = {k: data[k] for k in _RUN_ONLY if data.get(k)}
    if run_only:
        _logger.info('%s: %s not read from the file: a run\'s folder and the state it resumes are given on the '
                     'command line (%s)', path, ' and '.join(f'{k} {v!r}' for k, v in run_only.items()),
                     ', '.join('--' + k for k in run_only))
    derived = data.get('lr_source') in ('recipe', 'rule')  # an lr the recipe or timm's rule set
    if derived and data.get('lr') is not None:
        _logger.info('%s: lr %s not read from the file (lr_source: %s): the %s sets it again; give --lr to fix it',
                     path, data['lr'], data['lr_source'], 'recipe' if data['lr_source'] == 'recipe' else 'rule')
    skip = set(_RECORDED_ONLY) | set(_RUN_ONLY) | ({'lr'} if derived else set())
    if data.get('lr_source') == 'recipe':  # then --lr-base and its kin were timm's defaults, filled in, not given
        skip |= set(LR_RULE)
    out: Dict[str, Any] = {}
    for key, value in data.items():
        if key in skip:
            continue
        dest = named.get(key, key)
        action = actions[dest]
        if action.nargs == '+' and value is not None and not isinstance(value, (list, dict)):
            value = [value]  # one value of a flag that takes several, as the command line gives it
        if isinstance(action, ParseKwargs) and isinstance(value, dict):  # each string value as KEY=VALUE reads it
            value = {k: _kwargs_value(v) if isinstance(v, str) else v for k, v in value.items()}
        try:
            if action.type is not None:
                if isinstance(value, str):
                    value = action.type(value)
                elif isinstance(value, list):
                    value = [action.type(v) if isinstance(v, str) else v for v in value]
            check_setting(_FIELD_OF.get(dest, dest), value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            message = e.message if isinstance(e, ConfigError) else str(e)
            raise fail(f'{key}: {message}') from None
        out[dest] = value
    return out


def _parse(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> argparse.Namespace:
    """``argv`` parsed, a ``-c/--config`` file's settings (:func:`config_file_defaults`) taking the place of the
    defaults: the flags given win over the file (a positional data folder over the file's ``data_dir`` too)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument('-c', '--config', default='')
    known, _ = pre.parse_known_args(argv)
    given = {}
    if known.config:
        given = config_file_defaults(known.config, parser)
        parser.set_defaults(**given)
    ns = parser.parse_args(argv)
    if ns.config != known.config:  # an abbreviation of --config, which the first pass does not read
        parser.error('argument -c/--config: write the flag in full (-c FILE or --config FILE)')
    if 'data_dir' in given and ns.data_dir == given['data_dir'] and ns.data and ns.data != given.get('data'):
        ns.data_dir = ns.data  # DIR on the command line, data_dir in the file
    return ns


def parse_config(argv: Optional[List[str]] = None) -> TrainConfig:
    """``train.py``'s flags as a config, with a ``-c/--config`` file's settings in place of the defaults and the
    recipe's values filled in. A value outside its flag's range exits 2 through argparse; a contradiction between
    flags, or a bad config file, raises :class:`ConfigError` (or :class:`TrainSetupError`)."""
    return _config(_parse(build_parser(), argv), argv)


def resolve_args(argv: Optional[List[str]] = None) -> TrainConfig:
    """:func:`parse_config`, with a usage error (exit status 2, argparse's message) for contradicting flags."""
    try:
        return parse_config(argv)
    except ConfigError as e:
        build_parser().error(str(e))


def main(argv: Optional[List[str]] = None, *, on_step: Optional[Callable[[StepEvent], None]] = None
         ) -> Dict[str, Any]:
    """Train as ``argv`` says; returns ``{'output', 'rows', 'best'}`` (and ``'fgsm'``).

    A usage error exits 2 (argparse's message); a run that cannot start exits with an ``error: ...`` line
    (SystemExit); :class:`~timm_patchmix.settings.SettingsChangedError` and :class:`NonFiniteLossError` propagate
    (:func:`cli` maps them). ``on_step`` is passed to :func:`timm_patchmix.engine.train`. The logging configuration
    is the caller's (:func:`cli`, the command line, prints INFO lines)."""
    try:
        return train(resolve_args(argv), on_step=on_step).as_dict()
    except ConfigError as e:
        build_parser().error(str(e))
    except TrainSetupError as e:
        raise SystemExit(f'error: {e}') from None


def cli(argv: Optional[List[str]] = None) -> int:
    """``train.py``'s exit status: 0, 2 for a resume with changed settings, 1 for a non-finite loss (usage errors
    and runs that cannot start exit through argparse or SystemExit). As a command line, it prints the run's INFO
    lines (rank 0's; warnings only from the other ranks) unless logging is configured already."""
    from .cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    from timm.utils import world_info_from_env

    from .settings import INTERRUPTED, USAGE_ERROR, SettingsChangedError
    rank = world_info_from_env()[1]
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format='%(message)s')
    try:
        main(argv)
    except SettingsChangedError as e:  # a resume with other settings than its state's
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:  # Ctrl-C: every file is written atomically, so the last saved epoch is whole
        print('interrupted: the epochs finished so far are saved in the run folder (none if the first had not '
              'ended); go on from the last one with the same command and --resume <run folder>/state.safetensors',
              file=sys.stderr)
        return INTERRUPTED
    except NonFiniteLossError as e:  # the run diverged: a failed run, not a usage error
        print(f'error: {e}', file=sys.stderr)
        return 1
    except WriteError as e:  # a full disk, a folder made read-only: the epochs saved before stay as they were
        print(f'error: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(cli())
