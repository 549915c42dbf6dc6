"""The paper's four phases end to end, with the baselines at the same budget, and a report.

    python -m timm_patchmix.pipeline                          # embedded data, smoke budget, a few minutes on a CPU
    python -m timm_patchmix.pipeline --budget small --seeds 0 1 2
    python -m timm_patchmix.pipeline --dataset fashion_mnist --model resnet32_cifar --budget small

Phases per seed: (1) Random PatchMix f_T, (2) the search with f_T as fitness, (3) a grid of guided samples from the
searched table, (4) the final model f_O on clean, random and guided samples. Base, Mixup and CutMix train at the
same budget. By default 10% of the training split is held out (``--holdout 0.1``): it selects every run's best epoch
and scores the search's genes, and the report's numbers are on the test split alone, evaluated once at the end of each
run. f_O trains on the image loss L_O alone by default (``--final-loss image``, the paper's text). Each finished
phase leaves ``done.json`` and is skipped on a rerun; an interrupted training or search resumes from its own state
file. Each phase records the settings it ran with in ``settings.json``: a rerun with other
settings (budget, dataset, model, ``--train-args``...) stops with exit status 2 and names each difference before it
writes anything, instead of reusing or resuming phases made with the old settings. The report (``report.md``,
``report.json``, ``fitness.png``, ``pairs.png``, ``guided_samples.png``, ``masks.json``) goes to ``--output``.
``--jobs N`` runs up to N phases at once, each in its own process (logs in ``<output>/logs/``), a phase once the
phases it reads are done; the report is the same as one process's.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .checkpoint import WriteError, atomic_write_bytes, atomic_write_text, read_meta
from .children import child_command, cores, follow_parent, run_children
from .cli_types import backbone_name, directory, fraction, nonneg_int, optional_directory, positive_int, seed_int
from .locking import FolderBusyError, hold_folder
from .settings import (INTERRUPTED, NUMBER, STRING, USAGE_ERROR, SettingsChangedError, check_settings, file_record,
                       foreign_output, read_record, read_settings, write_settings)
from .viz import GuidedSamplesError, render_guided_samples

BUDGETS: Dict[str, Dict[str, Any]] = {
    # flags for train.py, for train.py with a holdout (the test split), and for search.py
    # the paper's CIFAR optimiser (SGD Nesterov, lr 0.1, cosine, no warm-up) at short schedules
    'smoke': {'train': ['--recipe', 'paper-cifar', '--epochs', '2', '--train-subset', '1024', '--val-subset', '300',
                        '-b', '64', '-j', '0'],
              'test': ['--test-subset', '300'],  # numbers on 300 images, as the smoke budget had before the holdout
              'search': ['--population', '24', '--generations', '6', '--k', '4', '--val-subset', '300']},
    'small': {'train': ['--recipe', 'paper-cifar', '--epochs', '8', '-j', '1'], 'test': [],
              'search': ['--population', '100', '--generations', '30', '--k', '8']},
    'paper': {'train': ['--recipe', 'paper-cifar'], 'test': [],
              'search': ['--population', '500', '--generations', '250', '--k', '16']},
    # a GPU: the whole dataset on the device (small images), bf16 autocast, channels_last, batch 256 at lr 0.2
    'gpu': {'train': ['--recipe', 'paper-cifar', '--epochs', '30', '-b', '256', '--lr', '0.2', '--device-data', '--amp',
                      '--amp-dtype', 'bfloat16', '--channels-last', '-j', '4'], 'test': [],
            'search': ['--population', '500', '--generations', '250', '--k', '16', '--amp', '--channels-last',
                       '--eval-batch-size', '4096']},
}
METHODS = ('base', 'mixup', 'cutmix', 'random_pm', 'guided_pm')
FINAL_LOSSES = ('image', 'total')


DESCRIPTION = '''The paper's four phases end to end, with the baselines at the same budget, and a report.

Per seed: (1) Random PatchMix f_T, (2) the search with f_T as fitness, (3) a grid of guided samples, (4) the final
Guided PatchMix model f_O on clean, random and guided samples; Base, Mixup and CutMix train at the same budget.
A held-out part of the training split (--holdout) selects each run's best epoch and scores the search; the report's
numbers are on the test split only.
Finished phases are skipped on a rerun and an interrupted training or search resumes; a rerun with other settings
stops with exit status 2 before writing anything. The report (report.md, report.json, fitness.png, pairs.png,
masks.json, guided_samples.png) goes to --output.'''

EPILOG = '''budgets (every one uses the paper's CIFAR optimiser, --recipe paper-cifar):
  smoke   1,024 training images, 300 held-out validation images, 300 test images, 2 epochs;
          search: population 24, 6 generations, K = 4, on 300 held-out images
  small   the whole dataset, 8 epochs; search: population 100, 30 generations, K = 8
  paper   the recipe's 400 epochs; search: population 500, 250 generations, K = 16
  gpu     the whole dataset kept on the GPU (--device-data; images of at most 64x64), bf16 autocast,
          channels_last, batch 256 at lr 0.2, 30 epochs (--train-args --epochs N for more);
          search as paper's, scored under autocast
with --holdout F (default 0.1) the training images come from the 1 - F not held out; small and paper test on the
whole test split; with --holdout 0 there is no test split and "held-out" reads "validation split"

examples:
  {prog}                                   # embedded data, smoke budget, a few minutes on a CPU
  {prog} --budget small --seeds 0 1 2
  {prog} --dataset fashion_mnist --budget small --seeds 0 1 2 --train-args --train-subset 4000
  {prog} --budget gpu --dataset fashion_mnist --seeds 0 1 2 --jobs 3   # 3 phases at once, sharing a GPU
  {prog} --holdout 0                       # the old way, for comparison only'''


def build_parser() -> argparse.ArgumentParser:
    from .cli import HelpFormatter, prog_name
    prog = prog_name('timm_patchmix.pipeline')
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG.format(prog=prog),
                                formatter_class=HelpFormatter)
    p.add_argument('--budget', choices=sorted(BUDGETS), default='smoke',
                   help='training and search budget of every phase (see "budgets" below)')
    p.add_argument('--dataset', default='',
                   help="dataset: '' for the embedded patchshapes (no download), fashion_mnist (Debian's IDX "
                        "files), or a timm dataset name (default: '')")
    p.add_argument('--data-dir', default='', type=optional_directory,
                   help='where the dataset lives (default: the dataset\'s usual place)')
    p.add_argument('--model', default='resnet32_cifar', type=backbone_name,
                   help='timm backbone of every method; the PatchMix phases use patchhead_<model>')
    p.add_argument('--seeds', type=seed_int, nargs='+', default=[0],
                   help='one full run of every method per seed; mean and sample std over seeds in the report')
    p.add_argument('--methods', nargs='+', choices=METHODS, default=list(METHODS), metavar='METHOD',
                   help=f'which methods to run, of {", ".join(METHODS)} (guided_pm trains random_pm as f_T)')
    p.add_argument('--output', default='output/pipeline', type=directory,
                   help='folder for the report, the figures and the per-seed runs')
    p.add_argument('--holdout', type=fraction, default=0.1, metavar='FRACTION',
                   help='hold out this fixed random fraction of the training split in every run: it selects the best '
                        'epoch and scores the search, and the report\'s numbers are on the test split (the '
                        'dataset\'s validation/test split) alone; 0: the old way, the validation split does all '
                        'three')
    p.add_argument('--holdout-seed', type=nonneg_int, default=0, help='which images --holdout holds out')
    p.add_argument('--final-loss', choices=FINAL_LOSSES, default='image',
                   help="loss of the final Guided PatchMix model f_O: 'image', the image loss L_O alone (the "
                        "paper's text), or 'total', L_T = (L_O + L_P/P^2)/2 as f_T; Random PatchMix f_T always "
                        "trains on L_T")
    p.add_argument('--jobs', type=positive_int, default=1,
                   help='phases run at once, each in its own process (1: one after another in this process). '
                        'Runs of small models share one GPU this way, and on a CPU each takes --threads of the '
                        'cores; a phase starts once the phases it reads are done, f_T first')
    p.add_argument('--threads', type=nonneg_int, default=0,
                   help='torch threads of each phase (0: the cores / --jobs with --jobs > 1, torch\'s default with '
                        '--jobs 1)')
    p.add_argument('--run-phase', default=None, help=argparse.SUPPRESS)  # SEED:NAME, a child of --jobs N
    p.add_argument('--train-args', nargs=argparse.REMAINDER, default=[], metavar='FLAG',
                   help='extra train.py flags for every training run, e.g. --train-subset 4000 (last on the line); '
                        'the flags the pipeline sets itself (--seed, --model, --dataset, --output, --holdout, '
                        '--mixup, --patchmix...) are refused, naming the pipeline flag to give instead')
    return p


SETTINGS_FILE = 'settings.json'
# what a phase folder recorded before these settings existed ran with: no holdout, f_O on L_T
LEGACY_SETTINGS = {'--holdout': 0.0, '--holdout-seed': None, '--final-loss': 'total'}


def _holdout(args) -> float:
    return float(getattr(args, 'holdout', 0.0) or 0.0)


def _phase_settings(args, seed: int, inputs: Dict[str, Any] = None) -> Dict[str, Any]:
    """What a phase's outputs depend on; ``inputs`` adds files made by earlier phases, compared by content (and the
    final model's ``--final-loss``)."""
    return dict({'--budget': args.budget, '--dataset': args.dataset, '--data-dir': args.data_dir,
                 '--model': args.model, 'seed': seed, '--train-args': list(args.train_args),
                 '--holdout': _holdout(args), '--holdout-seed': args.holdout_seed if _holdout(args) else None},
                **(inputs or {}))


def _guided_settings(args, table: Optional[str] = None) -> Dict[str, Any]:
    out = {'--final-loss': args.final_loss}
    if table is not None:
        out['table'] = file_record(table)
    return out


def _check_phase(args, folder: str, settings: Dict[str, Any]) -> bool:
    """Refuse a phase folder made with other settings (:class:`SettingsChangedError`); True when it has a record.
    A folder that holds the record alone is a phase that stopped before it made anything (a setting its run
    refused once the model was built, say): it starts afresh under the new settings."""
    recorded = read_settings(os.path.join(folder, SETTINGS_FILE))
    if recorded is not None and sorted(os.listdir(folder)) == [SETTINGS_FILE]:
        return False
    if recorded is not None:
        for key, value in LEGACY_SETTINGS.items():
            if key in settings:
                recorded.setdefault(key, value)
        if isinstance(recorded.get('--train-args'), list) and isinstance(settings.get('--train-args'), list):
            recorded = dict(recorded, **{'--train-args': _train_args_compared(recorded['--train-args'])})
            settings = dict(settings, **{'--train-args': _train_args_compared(settings['--train-args'])})
    if recorded is None:
        if os.path.isdir(folder) and os.listdir(folder):
            raise SettingsChangedError(
                f'cannot reuse {folder}: it holds outputs without {SETTINGS_FILE}, the record of the settings they '
                f'were made with, so they may come from other settings. Choose another --output for this run (or '
                f'delete {folder} first).')
        return False
    check_settings(recorded, settings, f'cannot reuse {folder}: it was made',
                   f'Rerun with the settings it was made with, or choose another --output for the new settings (or '
                   f'delete {args.output} first).')
    return True


def _begin_phase(args, folder: str, settings: Dict[str, Any]) -> None:
    """Check a phase's folder against ``settings``, and record them when the phase starts afresh."""
    if not _check_phase(args, folder, settings):
        write_settings(os.path.join(folder, SETTINGS_FILE), settings)


class MissingPhaseOutputError(SettingsChangedError):
    """A phase marked done (``done.json``) lacks an output file that a later phase of this run reads: a rerun cannot
    reuse it as it is (exit status 2, as for a changed setting)."""


def _ft_checkpoint(folder: str) -> str:
    """f_T's weights, as the search reads them: ``best.safetensors`` in the ``random_pm`` phase folder that trained
    them (the folder itself, not the path its ``done.json`` recorded, so a study moved elsewhere still finds them)."""
    return os.path.join(folder, 'best.safetensors')


def _ft_data_config(args, seed: int) -> Optional[Dict[str, Any]]:
    """How evaluation made f_T's images (its checkpoint's ``data`` record), for drawing the guided samples at the
    model's input size; None where the record lacks the input size."""
    data = read_meta(_ft_checkpoint(_phase_folder(args, seed, 'random_pm'))).get('data') or {}
    return data if isinstance(data, dict) and data.get('input_size') else None


def _search_table(folder: str) -> str:
    """The mask table the search phase in ``folder`` writes and the guided phase reads."""
    return os.path.join(folder, 'masks.json')


def _check_finished_inputs(args, seed: int) -> List[str]:
    """Check the files that a finished phase made and a later phase of this run reads (f_T's checkpoint, read by the
    search; the search's mask table, read by the guided model) before any phase runs: one that exists is compared
    with the reading phase's record, as when that phase starts (:class:`SettingsChangedError`); for one that is
    gone, a paragraph naming the file, the phase marked done without it and what to do."""
    if 'guided_pm' not in args.methods:
        return []
    root = os.path.join(args.output, f'seed{seed}')
    folders = {name: os.path.join(root, name) for name in ('random_pm', 'search', 'guided_pm')}

    def made_from(names):
        return [folders[n] for n in names if os.path.isdir(folders[n]) and os.listdir(folders[n])]

    def paragraph(phase, what, path, reader, later):
        folder = folders[phase]
        later = made_from(later)
        also = f' (and {" and ".join(later)}, made from it)' if later else ''
        return (f'cannot reuse {folder}: its done.json marks phase {phase} (seed {seed}) as finished, but {what} '
                f'{path} is missing, and phase {reader} reads it. Nothing was written. Restore {path} (a '
                f'study copied elsewhere needs its .safetensors and masks.json files), or delete {folder}{also} to '
                f'run {"them" if later else "it"} again.')

    problems = []
    if _done(folders['random_pm']):
        checkpoint = _ft_checkpoint(folders['random_pm'])
        if not os.path.isfile(checkpoint):
            problems.append(paragraph('random_pm', "f_T's checkpoint", checkpoint, 'search', ['search', 'guided_pm']))
        else:
            _check_phase(args, folders['search'], _phase_settings(args, seed, {'f_T': file_record(checkpoint)}))
    table = _search_table(folders['search'])
    if _done(folders['search']):
        if not os.path.isfile(table):
            problems.append(paragraph('search', 'its mask table', table, 'guided_pm', ['guided_pm']))
        else:
            try:
                _check_phase(args, folders['guided_pm'], _phase_settings(args, seed, _guided_settings(args, table)))
            except SettingsChangedError:
                _finished_table(table, seed)  # a damaged table is named as such, not as a changed setting
                raise
    return problems


def _finished_table(table: str, seed: int):
    """The mask table of seed ``seed``'s finished search, loaded; one that is not a valid table is a
    :class:`PhaseRecordError` naming it and the folder to delete."""
    from .table import MaskTable, MaskTableError
    try:
        return MaskTable.load(table)
    except MaskTableError as e:
        raise PhaseRecordError(f'{e}. It is the table of the finished search of seed {seed}, which Guided PatchMix '
                               f'trains on; {_redo(os.path.dirname(table))}') from None


def _check_all_phases(args) -> None:
    """Compare every phase folder this run would reuse with its settings before any phase runs, so a refused rerun
    writes nothing. Files that earlier phases make (f_T, the table) are compared by content here when those phases
    are finished (and again when the phase reading them starts); a finished phase that lacks such a file raises
    :class:`MissingPhaseOutputError`, one whose ``done.json`` cannot be read :class:`PhaseRecordError`."""
    for seed, name, _ in phases(args):
        _check_phase(args, _phase_folder(args, seed, name),
                     _phase_settings(args, seed, _guided_settings(args) if name == 'guided_pm' else None))
    missing = []
    for seed in args.seeds:
        missing += _check_finished_inputs(args, seed)
    if missing:
        raise MissingPhaseOutputError('\n'.join(missing))
    for seed, name, _ in phases(args):  # a finished phase's record that cannot be read stops the run here
        folder = _phase_folder(args, seed, name)
        if _done(folder) and name == 'search':
            _read_done(folder)
        elif _done(folder):
            _run_done(folder, name)


def _done(folder: str) -> bool:
    # (a done.json that is no file counts too: reading it names it, where a rerun would fail to write its own)
    return os.path.lexists(os.path.join(folder, 'done.json'))


def _mark(folder: str, info: Dict[str, Any]) -> None:
    atomic_write_text(os.path.join(folder, 'done.json'), json.dumps(info, indent=1))


class PhaseRecordError(RuntimeError):
    """A finished phase's ``done.json`` or mask table that cannot be read as one (truncated, edited, another
    format): the message names the file and the folder to delete so that a rerun runs that phase again."""


def _redo(folder: str) -> str:
    return f'delete {folder} (and the folders of the phases made from it) to run that phase again'


def _read_done(folder: str, need: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ``done.json`` record of the finished phase in ``folder``: a JSON object with the keys ``need``, each of
    its kind (see :func:`~timm_patchmix.settings.read_record`), else :class:`PhaseRecordError`."""
    return read_record(os.path.join(folder, 'done.json'), 'phase record', _redo(folder), PhaseRecordError, need or {})


# what the report reads from a training phase's record
RUN_RECORD_KEYS = {'method': STRING, 'final_top1': NUMBER, 'best_top1': NUMBER}


def _run_done(folder: str, name: str) -> Dict[str, Any]:
    """A finished training phase's record, checked (:func:`_read_done`); it must be phase ``name``'s."""
    rec = _read_done(folder, RUN_RECORD_KEYS)
    if rec['method'] != name:
        raise PhaseRecordError(f'{os.path.join(folder, "done.json")} is the record of method {rec["method"]!r}, '
                               f'not of phase {name}; {_redo(folder)}')
    return rec


class _Trainer:
    """Runs the training phases of one pipeline invocation with ``train(cfg)``: ``on_step`` goes to every run (see
    :class:`~timm_patchmix.engine.StepEvent`), and timm's data-config block is logged by the first run only."""

    def __init__(self, on_step=None):
        self.on_step, self.runs = on_step, 0

    def __call__(self, cfg):
        from .engine import train
        result = train(cfg, on_step=self.on_step, log_data_config=self.runs == 0)
        self.runs += 1
        return result


def _train_argv(args, seed: int, name: str, flags: List[str]) -> List[str]:
    """The train.py flags of phase ``name`` before ``--train-args``: the pipeline's own (dataset, seed, folder,
    holdout, resume, console output), the budget's and the method's ``flags``."""
    root = os.path.join(args.output, f'seed{seed}')
    common = ['--dataset', args.dataset, '--seed', str(seed), '--output', root, '--experiment', name,
              '--no-progress', '--log-interval', '1000000'] + BUDGETS[args.budget]['train']
    if args.data_dir:
        common += ['--data-dir', args.data_dir]
    if _holdout(args):
        common += ['--holdout', repr(_holdout(args)), '--holdout-seed', str(args.holdout_seed)]
        common += BUDGETS[args.budget]['test']
    state = os.path.join(root, name, 'state.safetensors')
    if os.path.isfile(state):
        common += ['--resume', state]
    return common + flags


def _train(args, seed: int, name: str, flags: List[str], inputs: Dict[str, Any] = None,
           trainer: Optional[_Trainer] = None, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Train phase ``name`` (train.py's ``flags`` with the budget's and ``--train-args``) unless it is done; its
    ``done.json`` record (with ``extra``)."""
    from .train import parse_config
    folder = _phase_folder(args, seed, name)
    _begin_phase(args, folder, _phase_settings(args, seed, inputs))
    if _done(folder):
        return _run_done(folder, name)
    print(f'[seed {seed}] training {name}', flush=True)
    res = (trainer or _Trainer())(parse_config(_train_argv(args, seed, name, flags) + list(args.train_args)))
    _mark(folder, dict(run_record(name, seed, folder, res), **(extra or {})))
    return _run_done(folder, name)


def run_record(name: str, seed: int, folder: str, res) -> Dict[str, Any]:
    """A training phase's ``done.json``: top-1 of the final and of the best epoch's weights on the split the report
    gives (``split``: the test split with a holdout, else the validation split), the held-out numbers that chose
    the best epoch, and the images of each split."""
    info = {'method': name, 'seed': seed, 'final_top1': res.final_top1, 'best_top1': res.best_top1,
            'epochs': len(res.rows), 'output': folder, 'best_epoch': res.best and res.best['epoch'],
            'split': res.config.val_split, 'splits': res.splits}
    if res.test is not None:
        info.update(final_top1=res.final_test_top1, best_top1=res.best_test_top1, split='test',
                    holdout_final_top1=res.final_top1, holdout_best_top1=res.best_top1, test=res.test)
    return info


def _search(args, seed: int, checkpoint: str) -> str:
    from .search import SearchError, TooFewScoredImagesError, parse_config, search
    folder = _phase_folder(args, seed, 'search')
    table = _search_table(folder)
    _begin_phase(args, folder, _phase_settings(args, seed, {'f_T': file_record(checkpoint)}))
    if _done(folder):
        _read_done(folder)
        return table
    flags = ['--checkpoint', checkpoint, '--output', folder, '--seed', str(seed), '--no-progress']
    flags += BUDGETS[args.budget]['search']
    if _holdout(args):  # the default for a checkpoint with a holdout; named so the record says it
        flags += ['--val-split', 'holdout']
    if os.path.isfile(os.path.join(folder, 'search_state.safetensors')):
        flags.append('--resume')
    print(f'[seed {seed}] searching class pairs and masks', flush=True)
    try:
        result = search(parse_config(flags))
    except TooFewScoredImagesError as e:  # the search's remedies are flags the pipeline sets itself
        more = (f'a larger --holdout (now {_holdout(args)}; in a new --output, since f_T trains on the images not '
                f'held out)' if _holdout(args) else 'a larger validation split')
        raise SearchError(f'class {e.class_name!r} has {e.have} {"held-out" if _holdout(args) else "validation"} '
                          f'images, fewer than the {e.need} that the {args.budget} budget\'s search (K={e.k}) '
                          f'needs: give it more with {more}, or add images of that class') from None
    print(f'best fitness {result.best_fitness:.4f} with {len(result.table.pairs)} pairs; wrote {result.table_path}',
          flush=True)
    _mark(folder, {'table': table})
    return table


def guided_flags(args, head: str, table: str) -> List[str]:
    """train.py flags of the final Guided PatchMix model f_O: with ``--final-loss image``, the image loss L_O alone
    (``--no-patch-loss``), as the paper's text has f_O minimise L_O; with ``total``, L_T as f_T."""
    flags = ['--model', head, '--patchmix', '--patchmix-table', table]
    return flags + (['--no-patch-loss'] if args.final_loss == 'image' else [])


def method_flags(args, name: str, table: str = '') -> List[str]:
    """train.py flags of training phase ``name``: the backbone and the mixing of that method (``table``: the
    search's mask table, for ``guided_pm``)."""
    head = f'patchhead_{args.model}'
    if name == 'guided_pm':
        return guided_flags(args, head, table)
    return {'base': ['--model', args.model], 'mixup': ['--model', args.model, '--mixup', '1.0'],
            'cutmix': ['--model', args.model, '--cutmix', '1.0'], 'random_pm': ['--model', head, '--patchmix']}[name]


def _flag_values(flags: List[str]) -> Dict[str, str]:
    """``--name value`` pairs of a flag list (the last occurrence wins, as in argparse)."""
    return {f: v for f, v in zip(flags, flags[1:]) if f.startswith('-')}


def budget_record(args, results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What the runs were given: training, validation and test images (the sizes in effect, as the runs' records
    count them, or the subset sizes asked for where no record counts them; ``None``: the whole split), the epochs the
    runs trained, and the search's population, generations and K. ``requested`` holds the subset sizes asked for
    where a split had fewer images, so that the run used all of them."""
    from .train import build_parser as train_parser
    test = BUDGETS[args.budget]['test'] if _holdout(args) else []
    t = train_parser().parse_args(BUDGETS[args.budget]['train'] + test + list(args.train_args))
    s = _flag_values(BUDGETS[args.budget]['search'])
    epochs = sorted({int(r['epochs']) for r in results if 'epochs' in r})
    asked = {'train_images': t.train_subset, 'val_images': t.val_subset, 'test_images': t.test_subset}
    counted = next((r['splits'] for r in results if isinstance(r.get('splits'), dict)), {})
    sizes, requested = {}, {}
    for key, want in asked.items():
        got = counted.get(key)
        sizes[key] = want
        if want and isinstance(got, int) and not isinstance(got, bool) and got < want:
            sizes[key], requested[key] = got, want  # a split smaller than its subset: the run used all of it
    out = dict({'budget': args.budget}, **sizes)
    out.update({'epochs': epochs[0] if len(epochs) == 1 else epochs, 'recipe': t.recipe,
                'search': ({'population': int(s['--population']), 'generations': int(s['--generations']),
                            'k': int(s['--k'])} if 'guided_pm' in args.methods else None),
                'holdout': _holdout(args)})
    if requested:
        out['requested'] = requested
    return out


def budget_text(b: Dict[str, Any]) -> str:
    requested = b.get('requested') or {}

    def images(key, split):
        n = b.get(key)
        if key in requested:
            return f'all {n:,} {split} images (fewer than the {requested[key]:,} asked for)'
        return f'{n:,} {split} images (a fixed random subset)' if n else f'the whole {split} split'
    epochs = b['epochs'] if not isinstance(b['epochs'], list) else '/'.join(map(str, b['epochs']))
    held = b.get('holdout')
    test = f'{images("test_images", "test")}, ' if held else ''
    text = (f'Budget `{b["budget"]}`: {images("train_images", "training")}, '
            f'{images("val_images", "held-out validation" if held else "validation")}, {test}{epochs} '
            f'epoch{"" if epochs == 1 else "s"} (recipe `{b["recipe"]}`)')
    if b['search']:
        text += (f'; search: population {b["search"]["population"]}, {b["search"]["generations"]} generations, '
                 f'K = {b["search"]["k"]}')
    return text + '.'


def splits_record(args, results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Which images did what: the holdout (fraction, seed, images, the SHA-256 of its indices), the split that chose
    each run's best epoch, the split the search scored its genes on, the split the report's numbers are on, the
    images of each as the runs counted them, and the losses of f_T and f_O."""
    holdout = _holdout(args)
    run = next((r for r in results if r.get('splits')), None)
    sp = run['splits'] if run else None
    val_split = next((r['split'] for r in results if r.get('split') and r['split'] != 'test'), None)
    if holdout:
        hold = dict(sp['holdout']) if sp and sp.get('holdout') else {'fraction': holdout, 'seed': args.holdout_seed}
        selection, test_split = 'holdout', (sp['test'] if sp else None)
        images = {'train': sp and sp['train_images'], 'holdout_evaluated': sp and sp['val_images'],
                  'test': sp and sp['test_images']}
    else:
        hold, selection, test_split = None, (sp['selection'] if sp else val_split) or 'validation', None
        images = {'train': sp and sp['train_images'], 'validation': sp and sp['val_images'], 'test': None}
    guided = 'guided_pm' in args.methods
    patch = guided or 'random_pm' in args.methods
    scored = next((r['search_scored_on'] for r in results if r.get('search_scored_on')), None)
    if guided:
        images['search'] = scored and scored.get('images')
    return {'holdout': hold, 'selection_split': selection,
            'search_split': ((scored or {}).get('split') or selection) if guided else None,
            'reported_split': 'test' if holdout else selection, 'test_split': test_split, 'images': images,
            'losses': {'random_pm': 'total' if patch else None,
                       'guided_pm': getattr(args, 'final_loss', 'total') if guided else None}}


def splits_text(sp: Dict[str, Any]) -> List[str]:
    """The report's lines on the splits and the losses."""
    def n(v):
        return f'{v:,} images' if isinstance(v, int) else 'images'
    im = sp['images']
    if sp['holdout']:
        h = sp['holdout']
        held = f', {n(h["images"])}' if h.get('images') else ''
        searched = ''
        if sp['search_split'] == 'holdout':
            searched = f'; the search scored its genes on {n(im.get("search"))} of it'
        elif sp['search_split']:
            searched = f'; the search scored its genes on split `{sp["search_split"]}`'
        lines = [f'Splits: a fixed {h["fraction"] * 100:g}% of the training split (seed {h["seed"]}{held}) is held out '
                 f'and never trained on; {n(im["holdout_evaluated"])} of it selected each run\'s best '
                 f'epoch{searched} (each a fixed random subset of the held-out images, the smaller inside the larger). '
                 f'The numbers below are on the test split alone (`{sp["test_split"]}`, {n(im["test"])}), evaluated '
                 f'once at the end of each run and used for no choice.']
    else:
        searched = ''
        if sp['search_split']:
            searched = f' (the search scored its genes on {n(im.get("search"))} of split `{sp["search_split"]}`)'
        lines = [f'Splits: no holdout (`--holdout 0`, the old way): the validation split (`{sp["selection_split"]}`, '
                 f'{n(im["validation"])}) selected each run\'s best epoch{searched} and gives the numbers below, so '
                 f'they are not held-out test numbers.']
    loss = sp['losses']
    if loss['guided_pm']:
        fo = ('the image loss L_O alone (`--final-loss image`, as the paper\'s text has f_O minimise L_O)'
              if loss['guided_pm'] == 'image' else 'L_T, as f_T (`--final-loss total`)')
        lines += ['', f'Losses: Random PatchMix f_T trains on L_T = (L_O + L_P/P²)/2; the final Guided PatchMix model '
                      f'f_O on {fo}.']
    return lines


def ranking_note(budget: str, seeds: List[int], summary: Dict[str, Dict[str, List[float]]]) -> Dict[str, Any]:
    """Whether the table can rank the methods. Not at the smoke budget, not with one seed (no spread to weigh a gap
    against), and not where two methods next to each other in the ranking are closer than the larger of their
    standard deviations over seeds. A rough reading, not a significance test."""
    reasons = []
    if budget == 'smoke':
        reasons.append('at the smoke budget the numbers are noise (it checks that the phases run)')
    if len(seeds) < 2:
        reasons.append('one seed gives no spread across seeds to weigh the gaps between methods against')
    close = []
    means = {m: (statistics.mean(v['final_top1']), statistics.stdev(v['final_top1']))
             for m, v in summary.items() if len(v['final_top1']) > 1}
    order = sorted(means, key=lambda m: -means[m][0])
    for hi, lo in zip(order, order[1:]):
        gap, spread = means[hi][0] - means[lo][0], max(means[hi][1], means[lo][1])
        if gap <= spread:
            close.append({'methods': [hi, lo], 'gap': round(gap, 4), 'std': round(spread, 4)})
    if close:
        reasons.append('the spread across seeds exceeds the gap between ' + '; '.join(
            f'{c["methods"][0]} and {c["methods"][1]} (gap {c["gap"]:.2f}, std {c["std"]:.2f})' for c in close))
    return {'can_rank': not reasons, 'reasons': reasons, 'close_pairs': close}


def report(args, results: List[Dict[str, Any]], wall_time_s: Optional[float] = None) -> str:
    """Write ``report.md`` and ``report.json`` to ``args.output`` and return the Markdown.

    ``report.md`` depends only on the runs' results and settings, so a resumed pipeline writes the same bytes as an
    uninterrupted one; the wall time of this invocation goes to ``report.json`` alone."""
    import timm
    from . import __version__
    by_method: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        by_method.setdefault(r['method'], []).append(r)
    summary = {}
    for m in METHODS:
        rs = by_method.get(m)
        if rs:
            summary[m] = {'final_top1': [r['final_top1'] for r in rs], 'best_top1': [r['best_top1'] for r in rs]}
    budget = budget_record(args, results)
    splits = splits_record(args, results)
    ranking = ranking_note(args.budget, list(args.seeds), summary)
    versions = {'timm_patchmix': __version__, 'torch': torch.__version__, 'timm': timm.__version__}
    seeds = ', '.join(str(s) for s in args.seeds)
    spread = ('mean ± sample std (n − 1) over seeds' if len(args.seeds) > 1
              else 'one seed, so single runs with no spread')
    where = ('the test split, with the weights of the final epoch (and of the best epoch on the held-out images)'
             if splits['holdout'] else 'the validation split, final epoch (and best epoch)')
    from .data import dataset_label
    data_dir = getattr(args, 'data_dir', '') or ''
    shown = dataset_label(args.dataset, data_dir) if args.dataset or data_dir else 'patchshapes (embedded)'
    lines = [f'# PatchMix pipeline: {shown}, {args.model}, budget {args.budget}',
             '', budget_text(budget), ''] + splits_text(splits) + [
             '', f'Seeds: {seeds}. Top-1 (%) on {where}; {spread}.', '',
             '| method | final top-1 | best top-1 | runs |', '|---|---|---|---|']

    def fmt(v):
        return f'{statistics.mean(v):.2f}' + (f' ± {statistics.stdev(v):.2f}' if len(v) > 1 else '')
    for m, v in summary.items():
        lines.append(f'| {m} | {fmt(v["final_top1"])} | {fmt(v["best_top1"])} | {len(v["final_top1"])} |')
    lines += ['']
    if ranking['can_rank']:
        lines += ['Each gap between methods next to each other in the ranking is larger than their spread across '
                  'seeds (a rough reading, not a significance test).']
    else:
        lines += ['**This budget is too small to rank the methods**: ' + '; '.join(ranking['reasons']) + '.']
    lines += ['', 'Versions: ' + ', '.join(f'{k} {v}' for k, v in versions.items()) + '.', '',
              'Files: ' + ', '.join(files_text(args)) + '.']
    text = '\n'.join(lines) + '\n'
    atomic_write_text(os.path.join(args.output, 'report.md'), text)
    atomic_write_text(os.path.join(args.output, 'report.json'), json.dumps(
        {'dataset': args.dataset, 'model': args.model, 'budget': args.budget, 'budget_detail': budget,
         'splits': splits, 'seeds': args.seeds, 'methods': summary, 'ranking': ranking, 'versions': versions,
         'wall_time_s': None if wall_time_s is None else round(wall_time_s, 1),
         'wall_time_note': 'this invocation only, from the start of its main() (the interpreter\'s start and the '
                           'imports of torch and timm before it, about 10 s on a 2-core CPU, are not in it): phases '
                           'finished by an earlier invocation were reused, not rerun',
         'runs': results}, indent=1))
    return text


# train.py flags that the pipeline sets itself for its runs (:func:`_train_argv`, :func:`method_flags`), by their
# argparse dest: the pipeline flag to give instead ('' where the pipeline alone decides) and what it sets. In
# --train-args they would come last and override the pipeline's value (argparse keeps the last one), so that the
# runs, settings.json and the report disagree; --train-args refuses them. The budget's flags (--epochs,
# --train-subset, -b...) stay open to --train-args, and so do --no-progress and --log-interval (console output only).
OWNED_TRAIN_FLAGS: Dict[str, Tuple[str, str]] = {
    'dataset': ('--dataset', 'the dataset of every run'),
    'data_dir': ('--data-dir', 'where the dataset lives'),
    'data': ('--data-dir', 'where the dataset lives'),
    'seed': ('--seeds', 'each run\'s seed'),
    'output': ('--output', 'where each phase writes'),
    'experiment': ('', 'each phase\'s folder, seed<S>/<method> under --output'),
    'resume': ('', 'the resume of an interrupted phase from its own state file'),
    'model': ('--model', 'the backbone of every method'),
    'holdout': ('--holdout', 'the held-out images, which its training runs, search and report share'),
    'holdout_seed': ('--holdout-seed', 'the held-out images, which its training runs, search and report share'),
    'mixup': ('--methods', 'the Mixup of the mixup method alone'),
    'cutmix': ('--methods', 'the CutMix of the cutmix method alone'),
    # (timm's Mixup takes a --cutmix-minmax as CutMix at alpha 1: the base and mixup runs would mix with CutMix)
    'cutmix_minmax': ('--methods', 'the CutMix of the cutmix method alone; --cutmix-minmax turns CutMix on'),
    'patchmix': ('--methods', 'PatchMix for the random_pm and guided_pm methods alone'),
    'patchmix_table': ('', 'the search\'s mask table for guided_pm'),
    'no_patch_loss': ('--final-loss', 'the losses of f_T and f_O'),
    # (the report states them: L_T for f_T, --final-loss's for f_O; a weight or a loss left out would be unsaid;
    # train.py trains with them alone)
    'no_image_loss': ('', 'the losses of f_T and f_O, which its report states (--final-loss chooses f_O\'s)'),
    'patch_loss_weight': ('', 'the losses of f_T and f_O, which its report states (--final-loss chooses f_O\'s)'),
}


# train.py flags of the console output alone, which a rerun may change (see OWNED_TRAIN_FLAGS)
CONSOLE_TRAIN_FLAGS = ('no_progress', 'log_interval')


def _train_args_compared(train_args: List[str]) -> List[str]:
    """``--train-args`` as a rerun compares them: each flag they set as ``'--flag value'`` under its long name, the
    last value of a flag given twice, in sorted order, the console flags left out; so ``--epochs 1 -b 16`` and
    ``--batch-size 16 --epochs 1 --no-progress`` are the same. Flags train.py no longer reads compare as given."""
    import contextlib
    import io
    from .train import build_parser as train_parser
    parser = train_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            given = _set_by(parser, list(train_args))
    except SystemExit:
        return list(train_args)
    out = []
    for action in parser._actions:
        if action.dest in given and action.dest not in CONSOLE_TRAIN_FLAGS:
            value = given[action.dest]
            flag = max(action.option_strings, key=len) if action.option_strings else action.dest
            shown = (' '.join(map(str, value)) if isinstance(value, (list, tuple)) else
                     '' if value is True and action.nargs == 0 else str(value))
            out.append(f'{flag} {shown}'.rstrip())
    return sorted(out)


def _set_by(parser: argparse.ArgumentParser, flags: List[str]) -> Dict[str, Any]:
    """``{dest: value}`` of the options that ``flags`` set, as ``parser`` (which this makes default-free) reads
    them; argparse's usage error (SystemExit) for flags it refuses."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # only what the flags set ends up in the namespace
    return vars(parser.parse_args(flags))


def _given_flags(parser: argparse.ArgumentParser, flags: List[str]) -> Dict[str, str]:
    """``{dest: option string}`` of each option in ``flags`` as ``parser`` resolves it (abbreviations and
    ``--flag=value`` included, as argparse reads them; a positional gets its metavar)."""
    given = _set_by(parser, flags)
    names = {}
    for action in parser._actions:
        if action.dest in given:
            names[action.dest] = max(action.option_strings, key=len) if action.option_strings else \
                f'the positional {action.metavar or action.dest}'
    return names


REPORT_FILES = (('fitness.png', 'search fitness per generation'), ('pairs.png', 'chosen pairs and masks'),
                ('masks.json', 'the searched mask table'), ('guided_samples.png', 'guided mixed samples'))


def files_text(args) -> List[str]:
    """The report's ``Files:`` entries: the search's figures and table that ``--output`` holds (when Guided PatchMix
    ran), and the per-run folders."""
    have = [f'`{f}` ({what})' for f, what in REPORT_FILES
            if 'guided_pm' in args.methods and os.path.isfile(os.path.join(args.output, f))]
    return have + ['per-run folders under `seed*/`']


def _check_train_args(parser: argparse.ArgumentParser, args) -> None:
    """Parse ``--train-args`` with train.py's own parser before any phase runs, so that an out-of-range value stops
    the pipeline at once (exit status 2, the flag and value named) rather than after the phases before it. A flag
    the pipeline sets itself (:data:`OWNED_TRAIN_FLAGS`) is refused, however it is spelt (an abbreviation such as
    ``--holdout-s`` included), naming the pipeline's flag to give instead; so is a combination that one of the
    training phases would refuse with its own flags and the budget's (``--device-data`` with ``--aa``...)."""
    from .train import build_parser as train_parser
    tp = train_parser()
    tp.prog = f'{parser.prog} --train-args'
    tp.parse_args(list(args.train_args))
    given = _given_flags(train_parser(), list(args.train_args))
    if 'config' in given:  # its keys would bypass this check, and the budget record reads the flags alone
        parser.error(f'{given["config"]} in --train-args: the pipeline\'s runs take their settings from its own '
                     f'flags and --train-args, which it checks and records; give the file\'s settings as flags in '
                     f'--train-args')
    for dest, (flag, what) in OWNED_TRAIN_FLAGS.items():
        if dest in given:
            words = [a.split('=', 1)[0] for a in args.train_args if a.startswith('-')]
            spelt = [w for w in words if w != given[dest] and len(w) > 2 and given[dest].startswith(w)]
            name = given[dest] + (f' (given as {spelt[0]})' if spelt else '')
            instead = f'give the pipeline\'s own {flag} instead' if flag else 'leave it out'
            parser.error(f'{name} in --train-args: the pipeline sets it for its runs ({what}); {instead}')
    # the flags together, as each training phase will take them: a contradiction stops here, before any phase
    # writes its folder (whose settings record would then refuse the corrected rerun)
    import tempfile
    from .engine import ConfigError
    from .train import parse_config
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, 'masks.json')  # the search's table, which the flags name but do not read
        open(table, 'w').close()
        for name in dict.fromkeys(n for _, n, _ in phases(args) if n != 'search'):
            try:
                cfg = parse_config(_train_argv(args, args.seeds[0], name, method_flags(args, name, table))
                                   + list(args.train_args))
            except ConfigError as e:  # (with no --train-args, the pipeline's own flags and budget are at fault)
                parser.error(f'{"--train-args in " if args.train_args else ""}the {name} runs: {e}')
            if name == 'random_pm' and 'guided_pm' in args.methods:  # f_T's grid, which the search must take
                from .engine.config import DEFAULT_GRID
                from .grid import to_grid
                from .search.genome import MaskOps
                try:
                    rows, cols = cfg.grid or to_grid(cfg.model_kwargs.get('grid') or DEFAULT_GRID)
                except ValueError as e:  # (--model-kwargs values are checked when the model is built)
                    parser.error(f'--train-args: --model-kwargs {e}')
                if rows * cols > MaskOps.MAX_CELLS:
                    parser.error(f'--train-args: the {rows}x{cols} grid has {rows * cols} cells, and the search of '
                                 f'guided_pm handles grids of up to {MaskOps.MAX_CELLS} cells; give a smaller '
                                 f'--patchmix-grid, or leave guided_pm out of --methods')


class PhaseFailedError(RuntimeError):
    """A phase run in a child process (``--jobs N``) failed; the phases that read its outputs did not start."""


# the order in which ready phases start with --jobs N: f_T and what reads it first (the longest chain), then the rest
_PRIORITY = ('search', 'guided_pm', 'random_pm', 'base', 'mixup', 'cutmix')


def phases(args) -> List[Tuple[int, str, Tuple[str, ...]]]:
    """``(seed, name, names it reads)`` of every phase the run needs, in the order one process runs them."""
    out = []
    for seed in args.seeds:
        out += [(seed, m, ()) for m in ('base', 'mixup', 'cutmix') if m in args.methods]
        if 'random_pm' in args.methods or 'guided_pm' in args.methods:
            out.append((seed, 'random_pm', ()))
        if 'guided_pm' in args.methods:
            out += [(seed, 'search', ('random_pm',)), (seed, 'guided_pm', ('search',))]
    return out


def _phase_folder(args, seed: int, name: str) -> str:
    return os.path.join(args.output, f'seed{seed}', name)


def run_phase(args, seed: int, name: str, trainer: Optional[_Trainer] = None):
    """Run one phase unless it is done: a training phase's ``done.json`` record, or the search's table path. The
    guided phase draws its sample figure from the table first."""
    if name in ('base', 'mixup', 'cutmix', 'random_pm'):
        return _train(args, seed, name, method_flags(args, name), trainer=trainer)
    table = _search_table(_phase_folder(args, seed, 'search'))
    if name == 'search':
        return _search(args, seed, _ft_checkpoint(_phase_folder(args, seed, 'random_pm')))
    if name != 'guided_pm':
        raise ValueError(f'no phase named {name!r}')
    guided = _guided_settings(args, table)  # checked before the samples are drawn from the table
    _check_phase(args, _phase_folder(args, seed, 'guided_pm'), _phase_settings(args, seed, guided))
    search_args = _finished_table(table, seed).search_args
    samples = os.path.join(os.path.dirname(table), 'guided_samples.png')
    if not os.path.isfile(samples):
        render_guided_samples(table, args.dataset, args.data_dir, samples, seed=seed,
                              data_config=_ft_data_config(args, seed))
    scored = {'search_scored_on': search_args.get('scored_on')}  # which images the search scored, for the report
    return _train(args, seed, 'guided_pm', method_flags(args, 'guided_pm', table), guided, trainer=trainer,
                  extra=scored)


def _phase_log(args, seed: int, name: str) -> str:
    return os.path.join(args.output, 'logs', f'seed{seed}_{name}.log')


def child_argv(argv: List[str], seed: int, name: str, threads: int) -> List[str]:
    """The pipeline flags of phase ``name`` of ``seed`` run as a child of ``--jobs N`` with ``argv``: its own flags
    first, since ``--train-args`` takes the rest of the line, and in the ``--flag=value`` form, which a value that
    starts with '-' (a negative seed) needs."""
    return [f'--run-phase={seed}:{name}', f'--threads={threads}'] + list(argv)


def _wants_download(args) -> bool:
    from .train import build_parser as train_parser
    return bool(train_parser().parse_args(list(args.train_args)).dataset_download)


def schedule(args, argv: List[str], threads: int) -> List[str]:
    """Run the phases that are not done with at most ``args.jobs`` at once, each in a child process with
    ``threads`` torch threads and its output in ``<output>/logs/`` (:func:`~timm_patchmix.children.run_children`):
    a phase starts once the phases it reads are done, f_T and what reads it first. With ``--dataset-download`` the
    first phase runs alone, so that one process downloads the dataset. A finished phase's outputs are checked
    against the records of the finished phases that read them, as the serial run checks them
    (:class:`SettingsChangedError`). Returns the phases that failed or did not start ("seed S NAME")."""
    graph = {(s, n): tuple((s, r) for r in reads) for s, n, reads in phases(args)}
    position = {job: i for i, job in enumerate(graph)}
    todo = sorted((job for job in graph if not _done(_phase_folder(args, *job))),
                  key=lambda job: (_PRIORITY.index(job[1]), position[job]))

    def check_inputs(job):
        missing = _check_finished_inputs(args, job[0])  # a retrained f_T that differs stops the run here
        if missing:
            raise MissingPhaseOutputError('\n'.join(missing))

    failed = run_children(todo, graph, slots=args.jobs, threads=threads,
                          command=lambda job: child_command('pipeline', child_argv(argv, *job, threads)),
                          log_path=lambda job: _phase_log(args, *job), label=lambda job: f'[seed {job[0]}] {job[1]}',
                          is_done=lambda job: _done(_phase_folder(args, *job)), noun='phase',
                          alone_first=_wants_download(args), on_done=check_inputs)
    return [f'seed {s} {n}' for s, n in failed]


def main(argv=None, *, on_train_step=None) -> str:
    """Run the pipeline as ``argv`` says; returns the report's text. ``on_train_step`` is called after every
    optimizer step of every training phase (a :class:`~timm_patchmix.engine.StepEvent`); it needs ``--jobs 1``,
    as the phases of ``--jobs N`` run in other processes."""
    started = time.monotonic()
    if on_train_step is not None and not callable(on_train_step):  # (before any phase writes)
        raise TypeError(f'on_train_step must be a callable taking a StepEvent, got {type(on_train_step).__name__}')
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    repeated = sorted({s for s in args.seeds if args.seeds.count(s) > 1})
    if repeated:
        parser.error(f'argument --seeds: seed {", ".join(map(str, repeated))} given more than once (each seed is '
                     f'one run of every method)')
    negative = [s for s in args.seeds if s < 0]
    if negative and any(n == 'search' for _, n, _ in phases(args)):  # (before any phase trains)
        parser.error(f'argument --seeds: the search of guided_pm takes seeds >= 0 (numpy\'s generator), got '
                     f'{", ".join(map(str, negative))}')
    threads = args.threads or (max(1, cores() // args.jobs) if args.jobs > 1 else 0)
    if args.run_phase is not None:  # a child of --jobs N: one phase, no report
        seed, _, name = args.run_phase.partition(':')
        if not any(f'{s}:{n}' == args.run_phase for s, n, _ in phases(args)):
            parser.error(f'--run-phase {args.run_phase!r} is not a phase of this run (SEED:NAME)')
        follow_parent()
        if threads:
            torch.set_num_threads(threads)
        run_phase(args, int(seed), name, _Trainer(on_train_step))
        return ''
    if args.jobs > 1 and on_train_step is not None:
        raise ValueError('on_train_step needs --jobs 1: with --jobs N the phases run in other processes')
    _check_train_args(parser, args)
    if not _holdout(args) and 'holdout_seed' in _set_by(build_parser(), argv):
        print(f'note: --holdout-seed {args.holdout_seed} sets the held-out images of --holdout, which is off: it '
              f'changes nothing (drop --holdout 0 to use it)', file=sys.stderr, flush=True)
    problem = foreign_output(args.output, own=('report.md',))  # (the root's fixed-name files would replace them)
    if problem:
        raise SettingsChangedError(problem)
    _check_all_phases(args)
    previous = torch.get_num_threads()
    try:
        with hold_folder(args.output, 'pipeline'):  # a second pipeline on this --output stops here
            return _run(args, argv, threads, on_train_step, started)
    finally:
        torch.set_num_threads(previous)  # --threads is for the pipeline's own work; the caller keeps its count


def _run(args, argv: List[str], threads: int, on_train_step, started: float) -> str:
    if args.jobs > 1:
        failed = schedule(args, argv, threads)
        if failed:
            raise PhaseFailedError(f'{len(failed)} phase(s) failed or could not start: {", ".join(failed)}. The '
                                   f'logs are in {os.path.join(args.output, "logs")}; a rerun of the same command '
                                   f'resumes them and reuses every finished phase.')
    elif threads:
        torch.set_num_threads(threads)
    # one after another in this process; with --jobs N every phase is done by now, and this only reads the records
    results = []
    trainer = _Trainer(on_train_step)
    for seed in args.seeds:
        for s, name, _ in phases(args):
            if s != seed:
                continue
            rec = run_phase(args, seed, name, trainer)
            if name in args.methods:
                results.append(rec)
        if 'guided_pm' in args.methods and seed == args.seeds[0]:
            search_dir = _phase_folder(args, seed, 'search')
            for f in ('fitness.png', 'pairs.png', 'masks.json', 'guided_samples.png'):
                src = os.path.join(search_dir, f)
                if os.path.isfile(src):
                    with open(src, 'rb') as fh:
                        atomic_write_bytes(os.path.join(args.output, f), fh.read())
    text = report(args, results, wall_time_s=time.monotonic() - started)
    print(text)
    return text


def cli(argv=None) -> int:
    from .cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    from .checkpoint import CheckpointError
    from .engine import ConfigError, NonFiniteLossError, TrainSetupError
    from .search import SearchError
    from .table import MaskTableError
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    try:
        main(argv)
    except (SettingsChangedError, ConfigError) as e:  # a rerun with changed settings; flags a training cannot use
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    # exit 1: a phase cannot start (a missing dataset...); another pipeline is writing to this --output; a training
    # phase diverged (a rerun resumes from its last finished epoch); --jobs N: a phase failed (its error is in its log);
    # a finished phase's done.json or mask table cannot be read; a file cannot be written (full disk, no permission);
    # the guided-samples picture finds no usable image of a class
    except (TrainSetupError, SearchError, CheckpointError, FolderBusyError, NonFiniteLossError,
            PhaseFailedError, PhaseRecordError, MaskTableError, WriteError, GuidedSamplesError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the phases started here were stopped with it
        print('interrupted: finished phases and the epochs and generations saved so far are kept; the same command '
              'goes on from there', file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == '__main__':
    raise SystemExit(cli())
