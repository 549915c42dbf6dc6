"""What ``import timm_patchmix`` costs on top of ``import timm``, in fresh interpreters.

    python benchmarks/bench_import.py --repeats 15 --json benchmarks/results/import_cpu.json

Three measurements, each a median over fresh ``python`` processes run in alternating order:

- ``added_ms``: ``import timm_patchmix`` timed inside the process right after ``import timm`` (process start and
  timm's own import stay outside the measurement, so this is the least noisy figure);
- ``process_ms``: the wall time of ``python -c 'import timm'`` and of ``python -c 'import timm, timm_patchmix'``,
  and their difference (start-up and disk noise included);
- ``lazy_ms``: the first access of each name the package loads on demand (``timm_patchmix.hub``,
  ``GuidedPatchMix``, ``MaskTable``), each in its own process, timed after ``import timm_patchmix``.

It also lists the ``timm_patchmix`` modules a bare ``import timm_patchmix`` loads.

Bytecode: by default every process reads compiled bytecode from a cache in a temporary folder (filled by a warm-up
run first), as an installed package or any second import does; ``--no-bytecode-cache`` compiles every source on
every import instead, which is what a process pays with ``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__``
beside the sources.
"""
from __future__ import annotations

import argparse
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


def _use_tree(tree: str) -> None:
    """Import timm_patchmix from ``tree`` (a checkout) in every process started from here on."""
    ENV['PYTHONPATH'] = os.pathsep.join(filter(None, [tree, os.environ.get('PYTHONPATH')]))


ADDED = ('import time, timm; t = time.perf_counter(); import timm_patchmix; '
         'print((time.perf_counter() - t) * 1e3)')
LAZY = ('import sys, time, timm, timm_patchmix; t = time.perf_counter(); getattr(timm_patchmix, sys.argv[1]); '
        'print((time.perf_counter() - t) * 1e3)')
MODULES = ('import sys, json, timm; before = set(sys.modules); import timm_patchmix; '
           'print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith("timm_patchmix"))))')
LAZY_NAMES = ('hub', 'GuidedPatchMix', 'MaskTable')


def _python(code: str, *args: str, env=None) -> str:
    out = subprocess.run([sys.executable, '-c', code, *args], check=True, cwd=ROOT, env=env or ENV,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _wall(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT, env=ENV, capture_output=True)
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--repeats', type=int, default=15, help='fresh processes per measurement')
    parser.add_argument('--tree', default=ROOT, help='the checkout to import timm_patchmix from')
    parser.add_argument('--baseline', default=None,
                        help='another checkout (e.g. an export of an earlier commit): its added_ms is measured too, '
                             'alternating with the tree under test')
    parser.add_argument('--no-bytecode-cache', action='store_true',
                        help='compile every source on every import (PYTHONDONTWRITEBYTECODE=1, no cache)')
    parser.add_argument('--json', default=None, help='write the results here')
    args = parser.parse_args(argv)
    _use_tree(os.path.abspath(args.tree))
    base_env = None
    if args.baseline:
        base_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.abspath(args.baseline),
                                                                             os.environ.get('PYTHONPATH')])))
    cache = None
    for env in filter(None, (ENV, base_env)):
        if args.no_bytecode_cache:
            env['PYTHONDONTWRITEBYTECODE'] = '1'
            env.pop('PYTHONPYCACHEPREFIX', None)
        else:
            cache = cache or tempfile.mkdtemp(prefix='bench-import-pycache-')
            env.pop('PYTHONDONTWRITEBYTECODE', None)
            env['PYTHONPYCACHEPREFIX'] = cache  # one cache for both trees: it is keyed by the source's path

    for env in filter(None, (ENV, base_env)):  # warm the file cache and fill the bytecode cache once
        _python('import timm, timm_patchmix; print(0)', env=env)
    for name in LAZY_NAMES:
        _python(LAZY, name)
    added, baseline, plain, both, lazy = [], [], [], [], {n: [] for n in LAZY_NAMES}
    for i in range(args.repeats):
        added.append(float(_python(ADDED)))
        if base_env:
            baseline.append(float(_python(ADDED, env=base_env)))
        pair = [('plain', 'import timm'), ('both', 'import timm, timm_patchmix')]
        for name, code in (pair if i % 2 == 0 else pair[::-1]):
            (plain if name == 'plain' else both).append(_wall(code))
        for name in LAZY_NAMES:  # each in its own process: a name loaded for another one would cost nothing
            lazy[name].append(float(_python(LAZY, name)))
    med = statistics.median
    import torch
    import timm
    import timm_patchmix
    res = {
        'command': 'python benchmarks/bench_import.py ' + ' '.join(sys.argv[1:] if argv is None else argv),
        'repeats': args.repeats, 'python': sys.version.split()[0], 'torch': torch.__version__,
        'timm': timm.__version__, 'timm_patchmix': timm_patchmix.__version__, 'cpus': os.cpu_count(),
        'tree': os.path.abspath(args.tree), 'load_average_at_end': list(os.getloadavg()),
        'bytecode': 'compiled on every import' if args.no_bytecode_cache else 'read from a warm cache',
        'added_ms': {'median': med(added), 'min': min(added), 'samples': added},
        'process_ms': {'import timm': med(plain), 'import timm, timm_patchmix': med(both),
                       'difference_of_medians': med(both) - med(plain), 'samples_timm': plain,
                       'samples_timm_patchmix': both},
        'lazy_ms': {n: {'median': med(v), 'samples': v} for n, v in lazy.items()},
        'modules_loaded_by_import': json.loads(_python(MODULES)),
    }
    if base_env:
        res['baseline'] = {'tree': os.path.abspath(args.baseline),
                           'added_ms': {'median': med(baseline), 'min': min(baseline), 'samples': baseline}}
    print(f"import timm_patchmix after import timm: {res['added_ms']['median']:.1f} ms (median of {args.repeats}, "
          f"min {min(added):.1f} ms; bytecode {res['bytecode']})")
    if base_env:
        print(f"baseline {args.baseline}: {med(baseline):.1f} ms (median of {args.repeats}, "
              f"min {min(baseline):.1f} ms)")
    print(f"whole process: import timm {med(plain):.0f} ms, import timm, timm_patchmix {med(both):.0f} ms, "
          f"difference {med(both) - med(plain):.1f} ms")
    print('first access: ' + ', '.join(f"{n} {res['lazy_ms'][n]['median']:.1f} ms" for n in LAZY_NAMES))
    print('loaded by the import: ' + ', '.join(res['modules_loaded_by_import']))
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    if args.json:
        from timm_patchmix.checkpoint import atomic_write_text
        atomic_write_text(args.json, json.dumps(res, indent=1) + '\n')
    return res


if __name__ == '__main__':
    main()
