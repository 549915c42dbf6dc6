"""Mixer speed against its peers, measured in the same run; medians, printed as ratios and saved as JSON.

    python benchmarks/bench_mix.py [--repeats 21] [--device cpu|cuda] [--json benchmarks/results/mix_cpu.json]

Tensor mixer: PatchMix 'elem' on float32 [128, 3, 224, 224] against the copy floor ``buf.copy_(x)`` (one read and one
write of the batch into a preallocated buffer) and timm ``Mixup(mixup_alpha=0, cutmix_alpha=1)`` in 'batch' and
'elem' modes; on CUDA also PatchMix with ``cuda_graph=False`` (``patchmix_elem_eager_draw``: partners and masks
drawn by eager kernels rather than by replaying a captured graph). With ``--compile``, also
``torch.compile(PatchMix)`` (compiled once before timing; it draws eagerly inside the compiled code).

Collate mixer: ``FastCollatePatchMix`` on 256 uint8 [3, 224, 224] images against timm's ``fast_collate`` and
``FastCollateMixup`` (CutMix, 'elem'), plus ``FastCollatePatchMix.stack`` (the same collate without mixing), so that
the mixing share is the difference, and the same collate mixed by the torch per-cell path instead of numpy's segment
views (``patchmix_collate_torch_cells``). It runs twice, both in the main process: with torch's threads as they
are (a loader with ``num_workers=0`` collates like this) and with one thread, the thread count of a DataLoader
worker (torch sets one thread in each), saved as ``collate_worker``. That is not a worker's path: in a worker the
collate-mixer stacks into shared memory (``collate_loader`` below measures what a loader with workers pays).

Collate mixer in a DataLoader (``collate_loader``, skipped with ``--loader-workers 0``): the same three collates as
``collate_fn`` of real DataLoaders with ``--loader-workers`` persistent workers over an in-memory dataset of uint8
[3, 224, 224] arrays, batch 256, timed in the main process per batch received (one epoch of ``--loader-batches``
batches per timing, the loaders taking turns). This is the cost a training loop sees: a worker also sends its batch
to the main process through shared memory, and a batch in private memory is copied there first.
``patchmix_collate_private`` is ``FastCollatePatchMix`` made to build its batch in private memory in the worker too,
as it did before it stacked straight into shared memory there.

``--no-thp`` switches transparent huge pages off for the benchmark's process and its workers (Linux
``prctl(PR_SET_THP_DISABLE)``), to see the collates as on a host that gives none: there every new page of a fresh
batch costs a 4 KiB fault, which numpy's large arrays otherwise largely avoid.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
from timm.data import FastCollateMixup, Mixup
from timm.data.loader import fast_collate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
import timm_patchmix.collate as collate_module  # noqa: E402
from timm_patchmix import FastCollatePatchMix, PatchMix  # noqa: E402
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from bench_models import even_batch  # noqa: E402  (the script beside this one)
from timm_patchmix.cli_types import int_range, positive_int  # noqa: E402


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def run(cases: dict, repeats: int, sync) -> dict:
    """Interleave the cases round-robin so drift on a shared machine hits them alike; return medians in ms."""
    for fn in cases.values():  # warm-up: allocator, thread pools, lazy init
        fn()
        fn()
    samples = {k: [] for k in cases}
    for _ in range(repeats):
        for k, fn in cases.items():
            samples[k].append(timed(fn, sync) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


class _Images(torch.utils.data.Dataset):
    """``n`` samples ``(uint8 [3, s, s] array, label)`` drawn from 64 fixed random images."""

    def __init__(self, n: int, s: int):
        rng = np.random.default_rng(0)
        self.images = [rng.integers(0, 256, (3, s, s), dtype=np.uint8) for _ in range(64)]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.images[i % 64], i % 1000


class _PrivateBatch:
    """``FastCollatePatchMix`` building its batch in private memory even in a worker. It switches the worker check
    off in the process it runs in, which is its own loader's worker process alone."""

    def __init__(self, fcp: FastCollatePatchMix):
        self.fcp = fcp

    def __call__(self, batch):
        collate_module.get_worker_info = lambda: None
        return self.fcp(batch)


def _thp_setting() -> str:
    try:
        with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
            return f.read().strip()
    except OSError:
        return 'unknown'


def disable_thp() -> None:
    """Switch transparent huge pages off for this process and the processes it forks (Linux)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_thp_disable, pr_get_thp_disable = 41, 42  # from <linux/prctl.h>
    if libc.prctl(pr_set_thp_disable, 1, 0, 0, 0) != 0 or libc.prctl(pr_get_thp_disable, 0, 0, 0, 0) != 1:
        raise OSError(ctypes.get_errno(), 'prctl(PR_SET_THP_DISABLE) failed: --no-thp needs Linux 3.15 or later')


def run_loaders(collates: dict, workers: int, batch_size: int, batches: int, s: int, repeats: int) -> dict:
    """Median ms per batch received from a DataLoader per collate, the loaders taking turns epoch by epoch."""
    loaders = {k: torch.utils.data.DataLoader(_Images(batch_size * batches, s), batch_size=batch_size,
                                              num_workers=workers, collate_fn=c, persistent_workers=True)
               for k, c in collates.items()}
    samples = {k: [] for k in collates}
    for rep in range(repeats + 1):  # the first round starts the workers and is not counted
        for k, loader in loaders.items():
            t0 = time.perf_counter()
            for _ in loader:
                pass
            if rep:
                samples[k].append((time.perf_counter() - t0) / batches * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def profile(fn, device, calls: int = 10, rows: int = 15) -> str:
    """torch.profiler's table of the top ``rows`` ops over ``calls`` calls of ``fn`` (after a warm-up call), by
    self device time on an accelerator and self CPU time on the CPU; printed and returned."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    fn()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if device.type == 'cuda':
            torch.cuda.synchronize()
    key = 'self_device_time_total' if device.type == 'cuda' else 'self_cpu_time_total'
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    print(f'profile of {calls} calls, by {key}:')
    print(table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--repeats', type=positive_int, default=21)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--batch', type=even_batch, default=128)
    parser.add_argument('--collate-batch', type=even_batch, default=256)
    parser.add_argument('--size', type=positive_int, default=224)
    parser.add_argument('--skip-collate', action='store_true')
    parser.add_argument('--compile', action='store_true', help='also time torch.compile(PatchMix) (compiled first)')
    parser.add_argument('--profile', action='store_true',
                        help='also profile 10 calls of the PatchMix and timm batch CutMix tensor cases; the tables '
                             'of their top ops by self device time (self CPU time on the CPU) go into the JSON')
    parser.add_argument('--loader-workers', type=int_range(0), default=1,
                        help='DataLoader workers of the collate_loader cases (0: skip them)')
    parser.add_argument('--loader-batches', type=int_range(1), default=8, help='batches per timed loader epoch')
    parser.add_argument('--loader-repeats', type=int_range(1), default=7, help='timed epochs per loader')
    parser.add_argument('--no-thp', action='store_true',
                        help='switch transparent huge pages off for this process and its workers (Linux)')
    parser.add_argument('--json', default=None, help='where to save the results (default: print only)')
    args = parser.parse_args()
    if args.no_thp:
        disable_thp()

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    torch.manual_seed(0)
    n, s = args.batch, args.size
    x = torch.randn(n, 3, s, s, device=device)
    y = torch.randint(0, 1000, (n,), device=device)
    buf = torch.empty_like(x)
    pm = PatchMix(grid=4, mode='elem', num_classes=1000)
    cut_batch = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='batch', label_smoothing=0.0, num_classes=1000)
    cut_elem = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', label_smoothing=0.0, num_classes=1000)
    cases = {
        'copy_floor': lambda: buf.copy_(x),
        'patchmix_elem': lambda: pm(x, y),
        'timm_cutmix_batch': lambda: cut_batch(x, y),
        'timm_cutmix_elem': lambda: cut_elem(x, y),
    }
    if device.type == 'cuda':  # the draw without its captured CUDA graph (the same on every other device)
        pm_eager = PatchMix(grid=4, mode='elem', num_classes=1000, cuda_graph=False)
        cases['patchmix_elem_eager_draw'] = lambda: pm_eager(x, y)
    if args.compile:
        compiled = torch.compile(pm)
        t0 = time.perf_counter()
        compiled(x, y)
        sync()
        print(f'torch.compile(PatchMix): first call (compilation) {time.perf_counter() - t0:.1f} s')
        cases['patchmix_elem_compiled'] = lambda: compiled(x, y)
    tensor = run(cases, args.repeats, sync)
    floor = tensor['copy_floor']
    result = {
        'device': str(device), 'torch': torch.__version__, 'threads': torch.get_num_threads(),
        'name': torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor(),
        'machine': platform.processor() or platform.machine(), 'repeats': args.repeats,
        'transparent_huge_pages': 'off (--no-thp)' if args.no_thp else _thp_setting(),
        'tensor': {'shape': [n, 3, s, s], 'median_ms': tensor,
                   'ratio_to_copy_floor': {k: v / floor for k, v in tensor.items()}},
    }
    print(f'tensor mixer, float32 {n}x3x{s}x{s} on {device} (median of {args.repeats}):')
    for k, v in tensor.items():
        print(f'  {k:24s} {v:8.2f} ms  {v / floor:5.2f}x copy floor')

    if args.profile:
        result['profile'] = {k: profile(cases[k], device) for k in ('patchmix_elem', 'timm_cutmix_batch')}

    if not args.skip_collate:
        rng = np.random.default_rng(0)
        m = args.collate_batch
        imgs = rng.integers(0, 256, (m, 3, s, s), dtype=np.uint8)
        batch = [(imgs[i], int(rng.integers(0, 1000))) for i in range(m)]
        fcm = FastCollateMixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', label_smoothing=0.0, num_classes=1000)
        fcp = FastCollatePatchMix(grid=4, mode='elem', num_classes=1000)
        collate_cases = {
            'fast_collate': lambda: fast_collate(batch),
            'patchmix_collate': lambda: fcp(batch),
            'patchmix_stack': lambda: fcp.stack(batch),  # the same collate without mixing
            # the same collate mixed by the torch per-cell path (what a tensor that is not fresh gets)
            'patchmix_collate_torch_cells': lambda: fcp.mixer.apply(*fcp.stack(batch), fcp.sample(m)),
            'timm_cutmix_collate_elem': lambda: fcm(batch),
        }
        threads = torch.get_num_threads()
        for key, nthreads in (('collate', threads), ('collate_worker', 1)):
            torch.set_num_threads(nthreads)
            try:
                coll = run(collate_cases, args.repeats, lambda: None)
            finally:
                torch.set_num_threads(threads)
            base = coll['fast_collate']
            result[key] = {'shape': [m, 3, s, s], 'threads': nthreads, 'median_ms': coll,
                           'mixing_ms': coll['patchmix_collate'] - coll['patchmix_stack'],
                           'ratio_to_fast_collate': {k: v / base for k, v in coll.items()}}
            print(f'collate mixer, {m} uint8 3x{s}x{s} images, {nthreads} torch thread(s) (median of {args.repeats}):')
            for k, v in coll.items():
                print(f'  {k:28s} {v:8.2f} ms  {v / base:5.2f}x fast_collate')
        if args.loader_workers > 0:
            collates = {'fast_collate': fast_collate, 'patchmix_collate': fcp,
                        'patchmix_collate_private': _PrivateBatch(fcp), 'timm_cutmix_collate_elem': fcm}
            coll = run_loaders(collates, args.loader_workers, m, args.loader_batches, s, args.loader_repeats)
            base = coll['fast_collate']
            result['collate_loader'] = {'shape': [m, 3, s, s], 'workers': args.loader_workers,
                                        'batches_per_epoch': args.loader_batches, 'repeats': args.loader_repeats,
                                        'median_ms_per_batch': coll,
                                        'ratio_to_fast_collate': {k: v / base for k, v in coll.items()}}
            print(f'collate mixer in a DataLoader, {args.loader_workers} worker(s), batches of {m} uint8 3x{s}x{s} '
                  f'(median of {args.loader_repeats} epochs of {args.loader_batches} batches):')
            for k, v in coll.items():
                print(f'  {k:28s} {v:8.2f} ms  {v / base:5.2f}x fast_collate')

    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1))
        print(f'saved {args.json}')


if __name__ == '__main__':
    main()
