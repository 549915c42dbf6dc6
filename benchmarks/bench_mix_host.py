"""The mixer's host cost per call: aten calls dispatched and host time, against timm's batch-mode CutMix.

    python benchmarks/bench_mix_host.py [--repeats 300] [--num-classes 1000] \
        [--json benchmarks/results/mix_host_cpu.json]

At the sizes a GPU trains on, a mixer call is bound by the host, not by memory: every dispatched aten call (a
kernel launch, or a view's bookkeeping) costs host time whatever the tensor's size. This benchmark measures that
part on the CPU, where no GPU is needed: it runs PatchMix's accelerator branch (the one select on a pixel mask that
``PatchMix`` takes on every device but the CPU) on a tiny float32 batch [128, 3, 8, 8], so that the arithmetic is
negligible, and counts the aten calls of one call (views included) with a dispatch mode. timm's
``Mixup(cutmix_alpha=1, mode='batch')`` runs beside it on the same tensors. Both run again with label smoothing
0.1 (the ``_ls0.1`` cases), as timm's training defaults set it. Each case's ratio is against timm's batch CutMix
with the same label smoothing, timed in the same run (``timm_cutmix_batch_ls0.1`` for the ``_ls0.1`` cases,
``timm_cutmix_batch`` for the others); the JSON records each case's peer and ratio. With ``--device cuda`` it runs
on the GPU as is (no branch forced) and times with a synchronize after each call; there the PatchMix cases draw their
params by replaying a captured CUDA graph (whose kernels the aten count does not see), and
``patchmix_elem_eager_draw`` is ``elem`` drawing them eagerly.

On the CPU the labels are range-checked on the host (``soft_target``), which adds four calls (``min``, ``max`` and
their two reads) that a GPU batch does not make.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from timm.data import Mixup

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
import timm_patchmix.mix as mix  # noqa: E402
from bench_models import op_count  # noqa: E402  (the script beside this one; call counting only)
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from timm_patchmix.cli_types import positive_int  # noqa: E402


def _timm_peer(case: str) -> str:
    """The timm case a case is compared with: timm's batch CutMix with the same label smoothing."""
    return 'timm_cutmix_batch_ls0.1' if case.endswith('_ls0.1') else 'timm_cutmix_batch'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--repeats', type=positive_int, default=300)
    p.add_argument('--device', default='cpu')
    p.add_argument('--num-classes', type=positive_int, default=1000,
                   help='label width; on the CPU the label rows cost kernel time at 1000, little at 10')
    p.add_argument('--json', default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == 'cpu':
        mix._per_cell = lambda dev: False  # this benchmark measures the accelerator branch, on the CPU
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    torch.manual_seed(0)
    x = torch.randn(128, 3, 8, 8, device=device)
    y = torch.randint(0, args.num_classes, (128,), device=device)
    # one mixer per case, made once and called again and again, as a training loop does (on CUDA its first call
    # of a batch shape captures the draw, in the warm-up below)
    mixers = {m: mix.PatchMix(grid=4, mode=m, num_classes=args.num_classes) for m in mix.MIX_MODES}
    cases = {f'patchmix_{m}': (lambda m=m: mixers[m](x, y)) for m in mix.MIX_MODES}
    cut = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='batch', label_smoothing=0.0, num_classes=args.num_classes)
    if device.type == 'cuda':  # the draw without its captured CUDA graph (the same on every other device)
        eager = mix.PatchMix(grid=4, mode='elem', num_classes=args.num_classes, cuda_graph=False)
        cases['patchmix_elem_eager_draw'] = lambda: eager(x, y)
    cases['timm_cutmix_batch'] = lambda: cut(x, y)
    # with label smoothing 0.1, as timm's training defaults (train.py's `timm` recipe) set it
    pm_ls = mix.PatchMix(grid=4, mode='elem', num_classes=args.num_classes, label_smoothing=0.1)
    cut_ls = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='batch', label_smoothing=0.1, num_classes=args.num_classes)
    cases['patchmix_elem_ls0.1'] = lambda: pm_ls(x, y)
    cases['timm_cutmix_batch_ls0.1'] = lambda: cut_ls(x, y)
    assert all(_timm_peer(k) in cases for k in cases), 'every case needs its timm peer timed in the same run'
    for fn in cases.values():  # warm-up, and any one-time constants built
        fn()
        fn()
    calls = {k: op_count(fn, every_call=True) for k, fn in cases.items()}
    samples = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every case alike
        for k, fn in cases.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[k].append((time.perf_counter() - t0) * 1e6)
    med = {k: statistics.median(v) for k, v in samples.items()}
    peer = {k: _timm_peer(k) for k in cases}  # the timm case with the same label smoothing
    ratio = {k: med[k] / med[peer[k]] for k in cases}
    print(f'host cost per mixer call, float32 128x3x8x8 on {device}, median of {args.repeats}; '
          'ratio to timm batch CutMix with the same label smoothing:')
    for k in cases:
        print(f'  {k:24s} {len(calls[k]):3d} aten calls  {med[k]:7.0f} us  {ratio[k]:5.2f}x {peer[k]}')
    for k in ('patchmix_elem', 'patchmix_elem_ls0.1'):
        print(f'  {k} calls:', ' '.join(calls[k]))
    if args.json:
        result = {'device': str(device), 'torch': torch.__version__, 'shape': [128, 3, 8, 8],
                  'name': torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor(),
                  'repeats': args.repeats, 'num_classes': args.num_classes, 'median_us': med,
                  'ratio_to_timm_peer': ratio, 'timm_peer': peer,
                  'aten_calls': {k: len(v) for k, v in calls.items()},
                  'calls': calls}
        atomic_write_text(args.json, json.dumps(result, indent=1))
        print(f'saved {args.json}')


if __name__ == '__main__':
    main()
