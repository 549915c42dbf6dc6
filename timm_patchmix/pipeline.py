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
import io
import json
import os
import statistics
import sys
from typing import Any, Dict, List

import numpy as np
import torch

from .checkpoint import atomic_write_bytes, atomic_write_text
from .cli_types import directory, optional_directory
from .settings import USAGE_ERROR, SettingsChangedError, check_settings, file_record, read_settings, write_settings

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--budget', choices=sorted(BUDGETS), default='smoke')
    p.add_argument('--dataset', default='', help="'' (embedded patchshapes), fashion_mnist, or a timm dataset")
    p.add_argument('--data-dir', default='', type=optional_directory)
    p.add_argument('--model', default='resnet32_cifar', help='backbone; the PatchMix phases use patchhead_<model>')
    p.add_argument('--seeds', type=int, nargs='+', default=[0])
    p.add_argument('--methods', nargs='+', choices=METHODS, default=list(METHODS))
    p.add_argument('--output', default='output/pipeline', type=directory)
    p.add_argument('--train-args', nargs=argparse.REMAINDER, default=[],
                   help='extra train.py flags for every training run (last on the line)')
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


def _train(args, seed: int, name: str, flags: List[str], inputs: Dict[str, Any] = None) -> Dict[str, Any]:
    from .train import main as train_main
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
    res = train_main(common + flags + list(args.train_args))
    rows = res['rows']
    info = {'method': name, 'seed': seed, 'final_top1': float(rows[-1]['eval_top1']),
            'best_top1': max(float(r['eval_top1']) for r in rows), 'epochs': len(rows), 'output': folder}
    _mark(folder, info)
    return info


def _search(args, seed: int, checkpoint: str) -> str:
    from .search.loop import main as search_main
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
    search_main(flags)
    _mark(folder, {'table': table})
    return table


def render_guided_samples(table_path: str, dataset: str, data_dir: str, path: str, n: int = 8, seed: int = 0):
    """A PNG of guided samples: for the table's first pairs, an image of each class, their mix under the pair's
    mask, and the lambda-weighted label."""
    from torchvision.transforms.functional import pil_to_tensor
    from .data import build_dataset
    from .demo import render_grid
    from .guided import MaskTable
    from .mix import PatchMix, PatchMixParams, split_target
    table = MaskTable.load(table_path)
    ds = build_dataset(dataset, data_dir, 'validation')
    labels = [int(ds.base.targets[q]) for q in ds.indices] if hasattr(ds.base, 'targets') else \
        [int(ds[q][1]) for q in range(len(ds))]
    by_class: Dict[int, List[int]] = {}
    for pos, c in enumerate(labels):
        by_class.setdefault(c, []).append(pos)
    gen = torch.Generator().manual_seed(seed)
    pairs = table.pairs[:n]
    m = len(pairs)

    def image_of(c):
        pos = by_class[c][int(torch.randint(len(by_class[c]), (1,), generator=gen))]
        return pil_to_tensor(ds[pos][0].convert('RGB'))
    x = torch.stack([image_of(a) for a, _ in pairs] + [image_of(b) for _, b in pairs])
    y = torch.tensor([a for a, _ in pairs] + [b for _, b in pairs])
    masks = torch.stack([torch.as_tensor(np.asarray(table.masks[k], dtype=bool)) for k in range(m)])
    params = PatchMixParams(torch.cat([torch.arange(m, 2 * m), torch.arange(m, 2 * m)]),
                            torch.cat([masks, torch.ones_like(masks)]))
    mixed, packed = PatchMix(grid=table.grid, num_classes=table.num_classes).apply(x.clone(), y, params)
    image_t, _ = split_target(packed)
    names = table.class_names or [str(c) for c in range(table.num_classes)]
    picture = render_grid(x[:m], x[m:], mixed[:m], masks, y[:m].tolist(), image_t[:m], names, table.grid)
    buf = io.BytesIO()
    picture.save(buf, format='PNG')
    atomic_write_bytes(path, buf.getvalue())


def report(args, results: List[Dict[str, Any]]) -> str:
    by_method: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        by_method.setdefault(r['method'], []).append(r)
    lines = [f'# PatchMix pipeline: {args.dataset or "patchshapes (embedded)"}, {args.model}, budget {args.budget}',
             '', f'Seeds: {", ".join(str(s) for s in args.seeds)}. Top-1 (%) on the validation split, final epoch '
             '(and best epoch); mean ± std over seeds.', '', '| method | final top-1 | best top-1 | runs |',
             '|---|---|---|---|']
    summary = {}
    for m in METHODS:
        rs = by_method.get(m)
        if not rs:
            continue
        f = [r['final_top1'] for r in rs]
        b = [r['best_top1'] for r in rs]

        def fmt(v):
            return f'{statistics.mean(v):.2f}' + (f' ± {statistics.stdev(v):.2f}' if len(v) > 1 else '')
        lines.append(f'| {m} | {fmt(f)} | {fmt(b)} | {len(rs)} |')
        summary[m] = {'final_top1': f, 'best_top1': b}
    lines += ['', 'Files: `fitness.png` (search fitness per generation), `pairs.png` and `masks.json` (chosen pairs and '
              'masks), `guided_samples.png` (guided mixed samples), per-run folders under `seed*/`.']
    text = '\n'.join(lines) + '\n'
    atomic_write_text(os.path.join(args.output, 'report.md'), text)
    atomic_write_text(os.path.join(args.output, 'report.json'), json.dumps(
        {'dataset': args.dataset, 'model': args.model, 'budget': args.budget, 'seeds': args.seeds,
         'methods': summary, 'runs': results}, indent=1))
    return text


def _check_train_args(parser: argparse.ArgumentParser, args) -> None:
    """Parse ``--train-args`` with train.py's own parser before any phase runs, so that an out-of-range value stops
    the pipeline at once (exit status 2, the flag and value named) rather than after the phases before it."""
    from .train import build_parser as train_parser
    tp = train_parser()
    tp.prog = f'{parser.prog} --train-args'
    tp.parse_args(list(args.train_args))


def main(argv=None) -> str:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_train_args(parser, args)
    _check_all_phases(args)
    os.makedirs(args.output, exist_ok=True)
    head = f'patchhead_{args.model}'
    results = []
    for seed in args.seeds:
        if 'base' in args.methods:
            results.append(_train(args, seed, 'base', ['--model', args.model]))
        if 'mixup' in args.methods:
            results.append(_train(args, seed, 'mixup', ['--model', args.model, '--mixup', '1.0']))
        if 'cutmix' in args.methods:
            results.append(_train(args, seed, 'cutmix', ['--model', args.model, '--cutmix', '1.0']))
        needs_ft = 'random_pm' in args.methods or 'guided_pm' in args.methods
        if needs_ft:
            ft = _train(args, seed, 'random_pm', ['--model', head, '--patchmix'])
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
                                  guided))
            if seed == args.seeds[0]:
                for f in ('fitness.png', 'pairs.png', 'masks.json', 'guided_samples.png'):
                    src = os.path.join(search_dir, f)
                    if os.path.isfile(src):
                        with open(src, 'rb') as fh:
                            atomic_write_bytes(os.path.join(args.output, f), fh.read())
    text = report(args, results)
    print(text)
    return text


def cli(argv=None) -> int:
    from .train import NonFiniteLossError
    try:
        main(argv)
    except SettingsChangedError as e:
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    except NonFiniteLossError as e:  # a training phase diverged; rerunning resumes from its last finished epoch
        print(f'error: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(cli())
