"""What ``import timm_patchmix`` costs on top of ``import timm``, in fresh interpreters.

    python benchmarks/bench_import.py --repeats 15 --json benchmarks/results/import_cpu.json

Three measurements, each a median over fresh ``python`` processes run in alternating order:

- ``added_ms``: ``import timm_patchmix`` timed inside the process right after ``import timm`` (process start and
  timm's own import stay outside the measurement, so this is the least noisy figure);
- ``process_ms``: the wall time of ``python -c 'import timm'`` and of ``python -c 'import timm, timm_patchmix'``,
  and their difference (start-up and disk noise included);
- ``lazy_ms``: the first access of each name the package loads on demand (``timm_patchmix.hub``,
  ``GuidedPatchMix``, ``MaskTable``), each in its own process, timed after ``import timm_patchmix``.

It also lists the ``timm_patchmix`` modules a bare ``import timm_patchmix`` loads. ``--added-only`` skips
``process_ms`` and ``lazy_ms`` (each fresh process with torch costs seconds on a small machine).

Which tree is imported: every child runs from an empty temporary folder with ``PYTHONSAFEPATH=1``, so neither the
current directory nor this checkout comes before ``PYTHONPATH`` (``python -c`` puts the current directory first on
``sys.path``; the children used to run from this checkout, so ``--tree`` and ``--baseline`` imported this checkout
whatever they named). Each child reports ``timm_patchmix.__file__``, and the script stops (exit 1, no figures) if a
child imported the package from anywhere but the tree it was meant to measure.

Bytecode: by default every process reads compiled bytecode from a cache in a temporary folder (filled by a warm-up
run first), as an installed package or any second import does; ``--no-bytecode-cache`` compiles every source on
every import instead, which is what a process pays with ``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__``
beside the sources: it measures a copy of each tree's package without its ``__pycache__`` folders (Python reads
those whatever ``PYTHONDONTWRITEBYTECODE`` says; torch's and timm's own bytecode is read as installed).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ)
# the children's working directory, made empty by main(): the '' entry that `python -c` puts first on sys.path then
# finds nothing (PYTHONSAFEPATH=1 drops that entry altogether on Python 3.11+)
CWD = None


def _tree_env(tree: str) -> dict:
    """An environment whose processes import timm_patchmix from ``tree`` (a checkout or an export of one)."""
    return dict(os.environ, PYTHONSAFEPATH='1',
                PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get('PYTHONPATH')])))


def _use_tree(tree: str) -> None:
    """Import timm_patchmix from ``tree`` in every process started from here on with ``ENV``."""
    ENV.clear()
    ENV.update(_tree_env(tree))
    ENV['BENCH_IMPORT_TREE'] = tree


# every child that imports timm_patchmix prints, on its last line, a JSON list: [figure, timm_patchmix.__file__,
# timm_patchmix.__version__]; _python checks the file against the tree the child was meant to import
_REPORT = 'print(json.dumps([{}, timm_patchmix.__file__, getattr(timm_patchmix, "__version__", None)]))'
ADDED = ('import json, time, timm; t = time.perf_counter(); import timm_patchmix; '
         + _REPORT.format('(time.perf_counter() - t) * 1e3'))
LAZY = ('import json, sys, time, timm, timm_patchmix; t = time.perf_counter(); getattr(timm_patchmix, sys.argv[1]); '
        + _REPORT.format('(time.perf_counter() - t) * 1e3'))
MODULES = ('import sys, json, timm; before = set(sys.modules); import timm_patchmix; '
           + _REPORT.format('sorted(m for m in set(sys.modules) - before if m.startswith("timm_patchmix"))'))
LAZY_NAMES = ('hub', 'GuidedPatchMix', 'MaskTable')
SEEN = {}  # tree -> (timm_patchmix.__file__, __version__) as its children reported them


def _check(tree: str, file: str, version) -> None:
    """Stop unless ``file`` (a child's timm_patchmix.__file__) lies inside ``tree``."""
    root = os.path.realpath(tree)
    path = os.path.realpath(file or '')
    if os.path.commonpath([root, path]) != root:
        raise SystemExit(f'bench_import.py: a child meant to import timm_patchmix from {tree} imported '
                         f'{file}; no figures reported')
    SEEN.setdefault(tree, (path, version))


def _python(code: str, *args: str, env=None):
    env = env or ENV
    out = subprocess.run([sys.executable, '-c', code, *args], check=True, cwd=CWD, env=env,
                         capture_output=True, text=True)
    value, file, version = json.loads(out.stdout.strip().splitlines()[-1])
    _check(env['BENCH_IMPORT_TREE'], file, version)
    return value


def _wall(code: str) -> float:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, '-c', code], check=True, cwd=CWD, env=ENV, capture_output=True, text=True)
    ms = (time.perf_counter() - t) * 1e3
    if 'timm_patchmix' in code:
        _check(ENV['BENCH_IMPORT_TREE'], out.stdout.strip().splitlines()[-1], None)
    return ms


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be an integer >= 1, got {text!r}')
    return value


def _without_bytecode(tree: str) -> str:
    """A temporary copy of ``tree``'s ``timm_patchmix`` package without its ``__pycache__`` folders: with
    ``PYTHONDONTWRITEBYTECODE=1`` Python still reads the bytecode beside the sources (a checkout where tests ran
    has it), so only a tree without it compiles every source on every import."""
    copy = tempfile.mkdtemp(prefix='bench-import-src-')
    atexit.register(shutil.rmtree, copy, True)
    shutil.copytree(os.path.join(tree, 'timm_patchmix'), os.path.join(copy, 'timm_patchmix'),
                    ignore=shutil.ignore_patterns('__pycache__'))
    return copy


def main(argv=None) -> dict:
    global CWD
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--repeats', type=_positive, default=15, help='fresh processes per measurement')
    parser.add_argument('--tree', default=ROOT, help='the checkout to import timm_patchmix from')
    parser.add_argument('--baseline', default=None,
                        help='another checkout (e.g. an export of an earlier commit): its added_ms is measured too, '
                             'alternating with the tree under test')
    parser.add_argument('--added-only', action='store_true',
                        help='measure added_ms (and the baseline\'s) only: no process_ms, no lazy_ms')
    parser.add_argument('--no-bytecode-cache', action='store_true',
                        help='compile every source on every import (PYTHONDONTWRITEBYTECODE=1, no cache)')
    parser.add_argument('--json', default=None, help='write the results here')
    args = parser.parse_args(argv)
    tree = os.path.abspath(args.tree)
    for path in filter(None, (tree, args.baseline)):
        if not os.path.isfile(os.path.join(path, 'timm_patchmix', '__init__.py')):
            parser.error(f'{path} holds no timm_patchmix/__init__.py')
    CWD = tempfile.mkdtemp(prefix='bench-import-cwd-')
    atexit.register(shutil.rmtree, CWD, True)  # also when a child imported the wrong tree (SystemExit)
    base_tree = os.path.abspath(args.baseline) if args.baseline else None
    if base_tree and os.path.realpath(base_tree) == os.path.realpath(tree):
        parser.error('--baseline names the tree under test')
    sources = {'tree': tree, 'baseline': base_tree}  # (the trees named; with --no-bytecode-cache, copies are run)
    if args.no_bytecode_cache:  # the package's sources without a __pycache__ beside them, which Python would read
        tree = _without_bytecode(tree)
        base_tree = _without_bytecode(base_tree) if base_tree else None
    _use_tree(tree)
    base_env = None
    if base_tree:
        base_env = dict(_tree_env(base_tree), BENCH_IMPORT_TREE=base_tree)
    cache = None
    for env in filter(None, (ENV, base_env)):
        if args.no_bytecode_cache:
            env['PYTHONDONTWRITEBYTECODE'] = '1'
            env.pop('PYTHONPYCACHEPREFIX', None)
        else:
            if cache is None:
                cache = tempfile.mkdtemp(prefix='bench-import-pycache-')
                atexit.register(shutil.rmtree, cache, True)
            env.pop('PYTHONDONTWRITEBYTECODE', None)
            env['PYTHONPYCACHEPREFIX'] = cache  # one cache for both trees: it is keyed by the source's path

    for env in filter(None, (ENV, base_env)):  # warm the file cache and fill the bytecode cache once
        _python('import json, timm, timm_patchmix; ' + _REPORT.format(0), env=env)
    lazy_names = () if args.added_only else LAZY_NAMES
    for name in lazy_names:
        _python(LAZY, name)
    added, baseline, plain, both, lazy = [], [], [], [], {n: [] for n in lazy_names}
    for i in range(args.repeats):
        # alternating which tree goes first, so that drift on a shared machine hits both alike
        order = [(added, None), (baseline, base_env)] if base_env else [(added, None)]
        for samples, env in (order if i % 2 == 0 else order[::-1]):
            samples.append(float(_python(ADDED, env=env)))
        if not args.added_only:
            pair = [('plain', 'import timm'),
                    ('both', 'import timm, timm_patchmix; print(timm_patchmix.__file__)')]
            for name, code in (pair if i % 2 == 0 else pair[::-1]):
                (plain if name == 'plain' else both).append(_wall(code))
        for name in lazy_names:  # each in its own process: a name loaded for another one would cost nothing
            lazy[name].append(float(_python(LAZY, name)))
    med = statistics.median
    import torch
    import timm
    res = {
        'command': 'python benchmarks/bench_import.py ' + ' '.join(sys.argv[1:] if argv is None else argv),
        'repeats': args.repeats, 'python': sys.version.split()[0], 'torch': torch.__version__,
        'timm': timm.__version__, 'timm_patchmix': SEEN[tree][1], 'cpus': os.cpu_count(),
        'tree': sources['tree'], 'timm_patchmix_file': SEEN[tree][0], 'load_average_at_end': list(os.getloadavg()),
        'bytecode': 'compiled on every import' if args.no_bytecode_cache else 'read from a warm cache',
        'added_ms': {'median': med(added), 'min': min(added), 'samples': added},
        'modules_loaded_by_import': _python(MODULES),
    }
    if not args.added_only:
        res['process_ms'] = {'import timm': med(plain), 'import timm, timm_patchmix': med(both),
                             'difference_of_medians': med(both) - med(plain), 'samples_timm': plain,
                             'samples_timm_patchmix': both}
        res['lazy_ms'] = {n: {'median': med(v), 'samples': v} for n, v in lazy.items()}
    if base_env:
        btree = base_env['BENCH_IMPORT_TREE']
        res['baseline'] = {'tree': sources['baseline'], 'timm_patchmix_file': SEEN[btree][0],
                           'added_ms': {'median': med(baseline), 'min': min(baseline), 'samples': baseline}}
        res['added_ms_ratio_to_baseline'] = med(added) / med(baseline)
    print(f"import timm_patchmix after import timm, from {SEEN[tree][0]}: {med(added):.1f} ms "
          f"(median of {args.repeats}, min {min(added):.1f} ms; bytecode {res['bytecode']})")
    if base_env:
        print(f"baseline, from {SEEN[btree][0]}: {med(baseline):.1f} ms (median of {args.repeats}, "
              f"min {min(baseline):.1f} ms); tree / baseline {res['added_ms_ratio_to_baseline']:.2f}x")
    if not args.added_only:
        print(f"whole process: import timm {med(plain):.0f} ms, import timm, timm_patchmix {med(both):.0f} ms, "
              f"difference {med(both) - med(plain):.1f} ms")
        print('first access: ' + ', '.join(f"{n} {res['lazy_ms'][n]['median']:.1f} ms" for n in LAZY_NAMES))
    print('loaded by the import: ' + ', '.join(res['modules_loaded_by_import']))
    if args.json:
        from timm_patchmix.checkpoint import atomic_write_text
        atomic_write_text(args.json, json.dumps(res, indent=1) + '\n')
    return res


if __name__ == '__main__':
    main()
