"""The paper's four phases end to end, with the baselines at the same budget, and a report.

    python -m timm_patchmix.pipeline                          # embedded data, smoke budget, a few minutes on a CPU
    python -m timm_patchmix.pipeline --budget small --seeds 0 1 2
    python -m timm_patchmix.pipeline --dataset fashion_mnist --model resnet32_cifar --budget small

Phases per seed: (1) Random PatchMix f_T, (2) the search with f_T as fitness, (3) a grid of guided samples from the
searched table, (4) the final model f_O on clean, random and guided samples. Base, Mixup and CutMix train at the
same budget. Each finished phase leaves ``done.json`` and is skipped on a rerun; an interrupted training or search
resumes from its own state file. Each phase records the settings it ran with in ``settings.json``: a rerun with other
settings (budget, dataset, model, ``--train-args``...) stops with exit status 2 and names each difference before it
writes anything, instead of reusing or resuming phases made with the old settings. The report (``report.md``,
``report.json``, ``fitness.png``, ``pairs.png``, ``guided_samples.png``, ``masks.json``) goes to ``--output``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from .checkpoint import atomic_write_bytes, atomic_write_text
from .cli_types import directory, optional_directory
from .settings import USAGE_ERROR, SettingsChangedError, check_settings, file_record, read_settings, write_settings
from .viz import render_guided_samples

BUDGETS: Dict[str, Dict[str, Any]] = {
    # flags for train.py, and for search.py
    # the paper's CIFAR optimiser (SGD Nesterov, lr 0.1, cosine, no warm-up) at short schedules
    'smoke': {'train': ['--recipe', 'paper-cifar', '--epochs', '2', '--train-subset', '1024', '--val-subset', '300',
                        '-b', '64', '-j', '0'],
              'search': ['--population', '24', '--generations', '6', '--k', '4', '--val-subset', '300']},
    'small': {'train': ['--recipe', 'paper-cifar', '--epochs', '8', '-j', '1'],
              'search': ['--population', '100', '--generations', '30', '--k', '8']},
    'paper': {'train': ['--recipe', 'paper-cifar'],
              'search': ['--population', '500', '--generations', '250', '--k', '16']},
}
METHODS = ('base', 'mixup', 'cutmix', 'random_pm', 'guided_pm')


DESCRIPTION = '''The paper's four phases end to end, with the baselines at the same budget, and a report.

Per seed: (1) Random PatchMix f_T, (2) the search with f_T as fitness, (3) a grid of guided samples, (4) the final
Guided PatchMix model f_O on clean, random and guided samples; Base, Mixup and CutMix train at the same budget.
Finished phases are skipped on a rerun and an interrupted training or search resumes; a rerun with other settings
stops with exit status 2 before writing anything. The report (report.md, report.json, fitness.png, pairs.png,
masks.json, guided_samples.png) goes to --output.'''

EPILOG = '''budgets (every one uses the paper's CIFAR optimiser, --recipe paper-cifar):
  smoke   1,024 training images, 300 validation images, 2 epochs; search: population 24, 6 generations, K = 4
  small   the whole dataset, 8 epochs; search: population 100, 30 generations, K = 8
  paper   the recipe's 400 epochs; search: population 500, 250 generations, K = 16

examples:
  {prog}                                   # embedded data, smoke budget, a few minutes on a CPU
  {prog} --budget small --seeds 0 1 2
  {prog} --dataset fashion_mnist --budget small --seeds 0 1 2 --train-args --train-subset 4000'''


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
    p.add_argument('--model', default='resnet32_cifar',
                   help='timm backbone of every method; the PatchMix phases use patchhead_<model>')
    p.add_argument('--seeds', type=int, nargs='+', default=[0],
                   help='one full run of every method per seed; mean and std over seeds in the report')
    p.add_argument('--methods', nargs='+', choices=METHODS, default=list(METHODS), metavar='METHOD',
                   help=f'which methods to run, of {", ".join(METHODS)} (guided_pm trains random_pm as f_T)')
    p.add_argument('--output', default='output/pipeline', type=directory,
                   help='folder for the report, the figures and the per-seed runs')
    p.add_argument('--train-args', nargs=argparse.REMAINDER, default=[], metavar='FLAG',
                   help='extra train.py flags for every training run, e.g. --train-subset 4000 (last on the line)')
    return p


SETTINGS_FILE = 'settings.json'


def _phase_settings(args, seed: int, inputs: Dict[str, Any] = None) -> Dict[str, Any]:
    """What a phase's outputs depend on; ``inputs`` adds files made by earlier phases, compared by content."""
    return dict({'--budget': args.budget, '--dataset': args.dataset, '--data-dir': args.data_dir,
                 '--model': args.model, 'seed': seed, '--train-args': list(args.train_args)}, **(inputs or {}))


def _check_phase(args, folder: str, settings: Dict[str, Any]) -> bool:
    """Refuse a phase folder made with other settings (:class:`SettingsChangedError`); True when it has a record."""
    recorded = read_settings(os.path.join(folder, SETTINGS_FILE))
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


def _check_all_phases(args) -> None:
    """Compare every phase folder this run would reuse with its settings before any phase runs, so a refused rerun
    writes nothing. Files that earlier phases make (f_T, the table) are compared when their phase starts."""
    for seed in args.seeds:
        root = os.path.join(args.output, f'seed{seed}')
        names = [m for m in ('base', 'mixup', 'cutmix') if m in args.methods]
        if 'random_pm' in args.methods or 'guided_pm' in args.methods:
            names.append('random_pm')
        if 'guided_pm' in args.methods:
            names += ['search', 'guided_pm']
        for name in names:
            _check_phase(args, os.path.join(root, name), _phase_settings(args, seed))


def _done(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, 'done.json'))


def _mark(folder: str, info: Dict[str, Any]) -> None:
    atomic_write_text(os.path.join(folder, 'done.json'), json.dumps(info, indent=1))


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


def _train(args, seed: int, name: str, flags: List[str], inputs: Dict[str, Any] = None,
           trainer: Optional[_Trainer] = None) -> Dict[str, Any]:
    """Train phase ``name`` (train.py's ``flags`` with the budget's and ``--train-args``) unless it is done; its
    ``done.json`` record."""
    from .train import parse_config
    root = os.path.join(args.output, f'seed{seed}')
    folder = os.path.join(root, name)
    _begin_phase(args, folder, _phase_settings(args, seed, inputs))
    if _done(folder):
        return json.load(open(os.path.join(folder, 'done.json')))
    common = ['--dataset', args.dataset, '--seed', str(seed), '--output', root, '--experiment', name,
              '--no-progress', '--log-interval', '1000000'] + BUDGETS[args.budget]['train']
    if args.data_dir:
        common += ['--data-dir', args.data_dir]
    state = os.path.join(folder, 'state.safetensors')
    if os.path.isfile(state):
        common += ['--resume', state]
    print(f'[seed {seed}] training {name}', flush=True)
    res = (trainer or _Trainer())(parse_config(common + flags + list(args.train_args)))
    info = {'method': name, 'seed': seed, 'final_top1': res.final_top1, 'best_top1': res.best_top1,
            'epochs': len(res.rows), 'output': folder}
    _mark(folder, info)
    return info


def _search(args, seed: int, checkpoint: str) -> str:
    from .search import parse_config, search
    folder = os.path.join(args.output, f'seed{seed}', 'search')
    table = os.path.join(folder, 'masks.json')
    _begin_phase(args, folder, _phase_settings(args, seed, {'f_T': file_record(checkpoint)}))
    if _done(folder):
        return table
    flags = ['--checkpoint', checkpoint, '--output', folder, '--seed', str(seed), '--no-progress']
    flags += BUDGETS[args.budget]['search']
    if os.path.isfile(os.path.join(folder, 'search_state.safetensors')):
        flags.append('--resume')
    print(f'[seed {seed}] searching class pairs and masks', flush=True)
    result = search(parse_config(flags))
    print(f'best fitness {result.best_fitness:.4f} with {len(result.table.pairs)} pairs; wrote {result.table_path}',
          flush=True)
    _mark(folder, {'table': table})
    return table


def _flag_values(flags: List[str]) -> Dict[str, str]:
    """``--name value`` pairs of a flag list (the last occurrence wins, as in argparse)."""
    return {f: v for f, v in zip(flags, flags[1:]) if f.startswith('-')}


def budget_record(args, results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What the runs were given: training and validation images (the subset sizes, or the whole split), the epochs
    the runs trained, and the search's population, generations and K."""
    from .train import build_parser as train_parser
    t = train_parser().parse_args(BUDGETS[args.budget]['train'] + list(args.train_args))
    s = _flag_values(BUDGETS[args.budget]['search'])
    epochs = sorted({int(r['epochs']) for r in results if 'epochs' in r})
    return {'budget': args.budget, 'train_images': t.train_subset, 'val_images': t.val_subset,
            'epochs': epochs[0] if len(epochs) == 1 else epochs, 'recipe': t.recipe,
            'search': ({'population': int(s['--population']), 'generations': int(s['--generations']),
                        'k': int(s['--k'])} if 'guided_pm' in args.methods else None)}


def budget_text(b: Dict[str, Any]) -> str:
    def images(n, split):
        return f'{n:,} {split} images (a fixed random subset)' if n else f'the whole {split} split'
    epochs = b['epochs'] if not isinstance(b['epochs'], list) else '/'.join(map(str, b['epochs']))
    text = (f'Budget `{b["budget"]}`: {images(b["train_images"], "training")}, '
            f'{images(b["val_images"], "validation")}, {epochs} epoch{"" if epochs == 1 else "s"} '
            f'(recipe `{b["recipe"]}`)')
    if b['search']:
        text += (f'; search: population {b["search"]["population"]}, {b["search"]["generations"]} generations, '
                 f'K = {b["search"]["k"]}')
    return text + '.'


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
    ranking = ranking_note(args.budget, list(args.seeds), summary)
    versions = {'timm_patchmix': __version__, 'torch': torch.__version__, 'timm': timm.__version__}
    seeds = ', '.join(str(s) for s in args.seeds)
    spread = 'mean ± std over seeds' if len(args.seeds) > 1 else 'one seed, so single runs with no spread'
    lines = [f'# PatchMix pipeline: {args.dataset or "patchshapes (embedded)"}, {args.model}, budget {args.budget}',
             '', budget_text(budget), '',
             f'Seeds: {seeds}. Top-1 (%) on the validation split, final epoch (and best epoch); {spread}.', '',
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
              'Files: `fitness.png` (search fitness per generation), `pairs.png` and `masks.json` (chosen pairs and '
              'masks), `guided_samples.png` (guided mixed samples), per-run folders under `seed*/`.']
    text = '\n'.join(lines) + '\n'
    atomic_write_text(os.path.join(args.output, 'report.md'), text)
    atomic_write_text(os.path.join(args.output, 'report.json'), json.dumps(
        {'dataset': args.dataset, 'model': args.model, 'budget': args.budget, 'budget_detail': budget,
         'seeds': args.seeds, 'methods': summary, 'ranking': ranking, 'versions': versions,
         'wall_time_s': None if wall_time_s is None else round(wall_time_s, 1),
         'wall_time_note': 'this invocation only: phases finished by an earlier invocation were reused, not rerun',
         'runs': results}, indent=1))
    return text


def _check_train_args(parser: argparse.ArgumentParser, args) -> None:
    """Parse ``--train-args`` with train.py's own parser before any phase runs, so that an out-of-range value stops
    the pipeline at once (exit status 2, the flag and value named) rather than after the phases before it."""
    from .train import build_parser as train_parser
    tp = train_parser()
    tp.prog = f'{parser.prog} --train-args'
    tp.parse_args(list(args.train_args))


def main(argv=None, *, on_train_step=None) -> str:
    """Run the pipeline as ``argv`` says; returns the report's text. ``on_train_step`` is called after every
    optimizer step of every training phase (a :class:`~timm_patchmix.engine.StepEvent`)."""
    started = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_train_args(parser, args)
    _check_all_phases(args)
    os.makedirs(args.output, exist_ok=True)
    head = f'patchhead_{args.model}'
    results = []
    trainer = _Trainer(on_train_step)
    for seed in args.seeds:
        if 'base' in args.methods:
            results.append(_train(args, seed, 'base', ['--model', args.model], trainer=trainer))
        if 'mixup' in args.methods:
            results.append(_train(args, seed, 'mixup', ['--model', args.model, '--mixup', '1.0'], trainer=trainer))
        if 'cutmix' in args.methods:
            results.append(_train(args, seed, 'cutmix', ['--model', args.model, '--cutmix', '1.0'], trainer=trainer))
        needs_ft = 'random_pm' in args.methods or 'guided_pm' in args.methods
        if needs_ft:
            ft = _train(args, seed, 'random_pm', ['--model', head, '--patchmix'], trainer=trainer)
            if 'random_pm' in args.methods:
                results.append(ft)
        if 'guided_pm' in args.methods:
            table = _search(args, seed, os.path.join(ft['output'], 'best.safetensors'))
            search_dir = os.path.dirname(table)
            guided = {'table': file_record(table)}  # checked before the samples are drawn from the table
            _check_phase(args, os.path.join(args.output, f'seed{seed}', 'guided_pm'),
                         _phase_settings(args, seed, guided))
            samples = os.path.join(search_dir, 'guided_samples.png')
            if not os.path.isfile(samples):
                render_guided_samples(table, args.dataset, args.data_dir, samples, seed=seed)
            results.append(_train(args, seed, 'guided_pm', ['--model', head, '--patchmix', '--patchmix-table', table],
                                  guided, trainer=trainer))
            if seed == args.seeds[0]:
                for f in ('fitness.png', 'pairs.png', 'masks.json', 'guided_samples.png'):
                    src = os.path.join(search_dir, f)
                    if os.path.isfile(src):
                        with open(src, 'rb') as fh:
                            atomic_write_bytes(os.path.join(args.output, f), fh.read())
    text = report(args, results, wall_time_s=time.monotonic() - started)
    print(text)
    return text


def cli(argv=None) -> int:
    from .checkpoint import CheckpointError
    from .engine import ConfigError, NonFiniteLossError, TrainSetupError
    from .search import SearchError
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    try:
        main(argv)
    except (SettingsChangedError, ConfigError) as e:  # a rerun with changed settings; flags a training cannot use
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    except (TrainSetupError, SearchError, CheckpointError) as e:  # a phase cannot start (a missing dataset...)
        print(f'error: {e}', file=sys.stderr)
        return 1
    except NonFiniteLossError as e:  # a training phase diverged; rerunning resumes from its last finished epoch
        print(f'error: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(cli())
