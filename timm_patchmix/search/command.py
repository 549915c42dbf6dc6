"""The search's command line (``search.py``, ``python -m timm_patchmix.search``, ``timm-patchmix search``): flags into
a :class:`~.config.SearchConfig`, :func:`~.run.search`, errors into exit statuses.

Exit statuses: 0 done; 2 a usage error (a bad flag value, a ``--val-split`` the checkpoint cannot give, or a resume
with changed settings, each difference named);
1 a search that cannot run (a checkpoint, dataset or state that does not fit), with a one-line ``error:`` message.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError, WriteError
from ..cli_types import device_name, directory, existing_file, optional_directory, positive_int
from ..grid import grid_from_flag
from ..settings import INTERRUPTED, USAGE_ERROR, SettingsChangedError
from ..table import MaskTable
from .config import FITNESS, SCORES, VALUE_TYPES, SearchConfig
from .inputs import SearchError, SearchUsageError
from .run import search

__all__ = ['build_parser', 'parse_config', 'config_from_args', 'main', 'cli']

EPILOG = '''examples:
  # the paper's settings, f_T from train.py --model patchhead_resnet32_cifar --patchmix --holdout 0.1
  # (genes scored on f_T's held-out training images)
  {prog} --checkpoint output/train/rpm/best.safetensors --output output/search
  # a short search; then the same command with --resume continues an interrupted one
  {prog} --checkpoint ft.safetensors --population 100 --generations 30 --k 8
  # new genes scored on two processes
  torchrun --nproc_per_node 2 -m timm_patchmix.search --checkpoint ft.safetensors'''


def build_parser() -> argparse.ArgumentParser:
    from ..cli import HelpFormatter, prog_name
    prog = prog_name('timm_patchmix.search')
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter, epilog=EPILOG.format(prog=prog),
        description='Evolutionary search (DEAP) over class pairs and PatchMix masks, scored by a Random-PatchMix '
                    'model f_T\nwithout retraining. Writes masks.json (for train.py --patchmix-table), logbook.csv, '
                    'fitness.png,\npairs.png and search_state.safetensors (to --resume from) to --output.')
    p.add_argument('--checkpoint', required=True, type=existing_file,
                   help='weights of a Random-PatchMix patchhead_ model (train.py --model patchhead_<arch> --patchmix)')
    p.add_argument('--output', default='output/search', type=directory,
                   help='folder for the table, logbook, plots and state')
    d = p.add_argument_group('data (default: as the checkpoint was trained)')
    d.add_argument('--dataset', default=None, help="dataset name (default: the checkpoint's)")
    d.add_argument('--data-dir', default=None, type=optional_directory,
                   help="dataset folder (default: the checkpoint's)")
    d.add_argument('--val-split', default=None,
                   help="split the genes are scored on: 'holdout' (the held-out images of the checkpoint's training "
                        "split, the default when it was trained with --holdout; never its test split) or a split "
                        "name (default without a holdout: the checkpoint's validation split)")
    d.add_argument('--val-subset', type=VALUE_TYPES['val_subset'], default=None,
                   help='score on a fixed random subset of this many images (default: the whole split)')
    d.add_argument('--grid', type=positive_int, nargs='+', default=None, metavar='N',
                   help="P or rows cols; must match the model's grid (default: the model's)")
    d.add_argument('--num-classes', type=VALUE_TYPES['num_classes'], default=None,
                   help="must match the dataset's number of classes (default: the dataset's)")
    g = p.add_argument_group('evolution (the paper\'s Algorithm 2)')
    g.add_argument('--population', type=VALUE_TYPES['population'], default=500, help='individuals')
    g.add_argument('--generations', type=VALUE_TYPES['generations'], default=250,
                   help='generations after the initial population')
    g.add_argument('--n-active', type=VALUE_TYPES['n_active'], default=None,
                   help='N, the most active pairs of an individual (default: the number of classes, at most the '
                        'number of class pairs)')
    g.add_argument('--k', type=VALUE_TYPES['k'], default=16, help='fixed validation image pairs per class pair')
    g.add_argument('--cxpb', type=VALUE_TYPES['cxpb'], default=0.5, help='crossover probability')
    g.add_argument('--mutpb', type=VALUE_TYPES['mutpb'], default=0.3, help='mutation probability')
    g.add_argument('--tournsize', type=VALUE_TYPES['tournsize'], default=3, help='tournament size of the selection')
    g.add_argument('--hof', type=VALUE_TYPES['hof'], default=10, help='hall-of-fame size')
    g.add_argument('--patience', type=VALUE_TYPES['patience'], default=50,
                   help='stop after this many generations without a better best (0: never)')
    g.add_argument('--fitness', choices=FITNESS, default='min',
                   help="'min' keeps the individuals of lowest mean score, 'max' of highest: with --score accuracy "
                        "the hardest samples (the paper) and the easiest; with --score loss the easiest and the "
                        "hardest")
    g.add_argument('--score', choices=SCORES, default='accuracy',
                   help='per-gene score: patch accuracy of f_T (the paper) or patch cross-entropy')
    g.add_argument('--same-class-pairs', action='store_true', default=False,
                   help='also search masks for (c, c) pairs, always active')
    g.add_argument('--seed', type=VALUE_TYPES['seed'], default=0, help='seed of the image pairs and of the evolution')
    r = p.add_argument_group('running')
    r.add_argument('--eval-batch-size', type=VALUE_TYPES['eval_batch_size'], default=512,
                   help='images per forward pass of f_T')
    r.add_argument('--device', default=None, type=device_name,
                   help='device of f_T (default: cuda when available, else cpu)')
    r.add_argument('--amp', action='store_true', default=False, help='score in mixed precision (CUDA)')
    r.add_argument('--channels-last', action='store_true', default=False, help='channels-last memory format')
    r.add_argument('--resume', action='store_true', default=False,
                   help='continue from OUTPUT/search_state.safetensors (the settings must be the same)')
    r.add_argument('--no-progress', action='store_true', default=False,
                   help='a line per generation instead of a progress bar')
    r.add_argument('--no-plots', action='store_true', default=False, help='skip fitness.png and pairs.png')
    return p


def config_from_args(args: argparse.Namespace) -> SearchConfig:
    """The config of parsed flags (``ValueError`` for values no flag type rules out, e.g. ``--grid 2 3 4``)."""
    return SearchConfig(
        checkpoint=args.checkpoint, output=args.output, dataset=args.dataset, data_dir=args.data_dir,
        val_split=args.val_split, val_subset=args.val_subset,
        grid=None if args.grid is None else grid_from_flag(args.grid, '--grid'), num_classes=args.num_classes,
        population=args.population, generations=args.generations, n_active=args.n_active, k=args.k,
        cxpb=args.cxpb, mutpb=args.mutpb, tournsize=args.tournsize, hof=args.hof, patience=args.patience,
        fitness=args.fitness, score=args.score, same_class_pairs=args.same_class_pairs,
        eval_batch_size=args.eval_batch_size, seed=args.seed, device=args.device, amp=args.amp,
        channels_last=args.channels_last, resume=args.resume, progress=not args.no_progress,
        plots=not args.no_plots)


def parse_config(argv: Optional[Sequence[str]] = None) -> SearchConfig:
    """Flags -> config; a bad value exits 2 with the usage message, as argparse does."""
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        return config_from_args(args)
    except ValueError as e:
        parser.error(str(e))


def _distributed(cfg: SearchConfig) -> SearchConfig:
    """Under torchrun (WORLD_SIZE > 1), join the process group (started here if none is up, and then ended when
    the process exits); on CUDA each rank takes its LOCAL_RANK device unless ``--device`` names one, also where a
    group is up already (an earlier call's, or the caller's), as ``train()`` does."""
    if int(os.environ.get('WORLD_SIZE', '1')) <= 1 and not dist.is_initialized():
        return cfg
    from ..engine.runtime import end_group_at_exit
    use_cuda = torch.cuda.is_available() and (cfg.device or 'cuda').startswith('cuda')
    if not dist.is_initialized():
        dist.init_process_group(backend='nccl' if use_cuda else 'gloo')
        end_group_at_exit()  # kept for the process's later searches and runs, as train() keeps the one it starts
    if not use_cuda or (cfg.device and ':' in cfg.device):
        return cfg
    # (a group up already, from an earlier call or the caller: each rank still takes its own GPU)
    device = f'cuda:{int(os.environ.get("LOCAL_RANK", "0"))}'
    torch.cuda.set_device(device)
    return cfg.replace(device=device)


def main(argv: Optional[List[str]] = None) -> MaskTable:
    """Run the search of these flags and return its table. A search that cannot run exits with its one-line
    ``error:`` message (``SystemExit``); a resume with changed settings raises ``SettingsChangedError``. The logging
    configuration is the caller's (:func:`cli`, the command line, prints INFO lines)."""
    cfg = _distributed(parse_config(argv))
    try:
        result = search(cfg)
    except SearchUsageError as e:  # a --val-split the checkpoint cannot give: a usage error
        print(f'error: {e}', file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    except (SearchError, CheckpointError) as e:
        raise SystemExit(f'error: {e}') from None
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f'best fitness {result.best_fitness:.4f} with {len(result.table.pairs)} pairs; wrote '
              f'{result.table_path}')
    if dist.is_initialized():
        dist.barrier()
    return result.table


def cli(argv: Optional[List[str]] = None) -> int:
    """The command line's exit status: 0 done, 2 for changed settings on a resume (exits 2 or 1 on other errors).
    As a command line, it prints INFO lines unless logging is configured already."""
    from ..cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    try:
        main(argv)
    except SettingsChangedError as e:
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    except WriteError as e:  # a full disk, a folder made read-only: the last generation's state stays
        print(f'error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the state is written atomically after each generation
        print('interrupted: the generations finished so far are saved in --output; go on from the last one with '
              'the same command and --resume', file=sys.stderr)
        return INTERRUPTED
    return 0
