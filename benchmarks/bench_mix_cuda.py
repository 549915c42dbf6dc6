"""Where a CUDA mixer call spends its time: the tensor mixer taken apart, host against device time.

    python benchmarks/bench_mix_cuda.py [--repeats 31] [--json benchmarks/results/mix_cuda_parts.json]

Needs a CUDA device. On float32 [128, 3, 224, 224] with 1000 classes, every case is timed two ways, interleaved
round-robin with the others, medians:

- ``latency_ms``: one call between two synchronisations (what ``bench_mix.py`` reports);
- ``host_ms`` and ``pipelined_ms``: ``--burst`` calls back to back with no synchronisation between them. ``host_ms``
  is the time the host takes to issue one call (measured before the closing synchronisation), ``pipelined_ms`` the
  time per call once the device has finished them all. A call whose ``host_ms`` is about its ``pipelined_ms`` is
  bound by the host (dispatch and kernel launches); one whose ``pipelined_ms`` is well above its ``host_ms`` by the
  device. A training loop sees ``pipelined_ms``: the mixer's launches overlap the work queued before them.

The cases: the copy floor, one tiny kernel (the per-launch floor), ``PatchMix`` 'elem' as a training loop calls it
(its draw replayed from a captured CUDA graph), the same with ``cuda_graph=False`` (``patchmix_elem_eager_draw``),
timm's batch-mode CutMix, and the eager call's parts: ``sample`` (partners and masks), ``_apply`` on fixed params
(labels, pixel mask, lam, select and packed target), the select alone (``mix_select_``), the packed target alone
and ``torch.randperm``. The aten calls one call dispatches (views included) are counted; a graph replay is none.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from timm.data import Mixup

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
from bench_models import even_batch, op_count  # noqa: E402  (the script beside this one; call counting only)
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from timm_patchmix.cli_types import positive_int  # noqa: E402
from timm_patchmix.mix import PatchMix, mix_select_, pack_target, soft_target  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--repeats', type=positive_int, default=31)
    p.add_argument('--burst', type=positive_int, default=20,
                   help='calls issued back to back for host_ms and pipelined_ms')
    p.add_argument('--batch', type=even_batch, default=128)
    p.add_argument('--size', type=positive_int, default=224)
    p.add_argument('--num-classes', type=positive_int, default=1000)
    p.add_argument('--json', default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit('bench_mix_cuda.py needs a CUDA device')
    dev = torch.device('cuda')
    torch.manual_seed(0)
    n, s, nc = args.batch, args.size, args.num_classes
    x = torch.randn(n, 3, s, s, device=dev)
    y = torch.randint(0, nc, (n,), device=dev)
    buf = torch.empty_like(x)
    tiny = torch.zeros(1, device=dev)
    pm = PatchMix(grid=4, mode='elem', num_classes=nc)
    pm_eager = PatchMix(grid=4, mode='elem', num_classes=nc, cuda_graph=False)
    cut = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='batch', label_smoothing=0.0, num_classes=nc)
    params = pm.sample(n, device=dev)

    def target_only():
        yy = soft_target(y, nc, 0.0, batch_size=n, device=dev)
        lam = torch.full((n,), 0.5, device=dev)
        return pack_target(yy, yy.index_select(0, params.partner), lam, params.mask)

    cases = {
        'copy_floor': lambda: buf.copy_(x),
        'tiny_kernel': lambda: tiny.add_(1),
        'patchmix_elem': lambda: pm(x, y),
        'patchmix_elem_eager_draw': lambda: pm_eager(x, y),
        'timm_cutmix_batch': lambda: cut(x, y),
        'patchmix_sample': lambda: pm.sample(n, device=dev),
        'patchmix_apply': lambda: pm._apply(x, y, params),
        'patchmix_select': lambda: mix_select_(x, params.partner, params.mask),
        'patchmix_target': target_only,
        'randperm': lambda: torch.randperm(n, device=dev),
    }
    for fn in cases.values():  # warm-up: lazy initialisation, and the capture of PatchMix's draw
        fn()
        fn()
    calls = {k: len(op_count(fn, every_call=True)) for k, fn in cases.items()}
    torch.cuda.synchronize()
    lat, host, pipe = ({k: [] for k in cases} for _ in range(3))
    for _ in range(args.repeats):
        for k, fn in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            lat[k].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            for _ in range(args.burst):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host[k].append((t1 - t0) / args.burst * 1e3)
            pipe[k].append((t2 - t0) / args.burst * 1e3)
    med = {name: {k: statistics.median(v) for k, v in d.items()}
           for name, d in (('latency_ms', lat), ('host_ms', host), ('pipelined_ms', pipe))}
    base = med['latency_ms']['timm_cutmix_batch']
    print(f'CUDA mixer parts, float32 {n}x3x{s}x{s}, {nc} classes, on {torch.cuda.get_device_name()} '
          f'(medians of {args.repeats}; host and pipelined over bursts of {args.burst}):')
    print(f'  {"case":20s} {"aten":>5s} {"latency":>9s} {"host":>9s} {"pipelined":>10s}  latency vs timm batch CutMix')
    for k in cases:
        print(f'  {k:20s} {calls.get(k, "-"):>5} {med["latency_ms"][k]:7.3f}ms {med["host_ms"][k]:7.3f}ms '
              f'{med["pipelined_ms"][k]:8.3f}ms  {med["latency_ms"][k] / base:5.2f}x')
    if args.json:
        result = {'device': torch.cuda.get_device_name(), 'torch': torch.__version__, 'shape': [n, 3, s, s],
                  'num_classes': nc, 'repeats': args.repeats, 'burst': args.burst, 'aten_calls': calls,
                  **med}
        atomic_write_text(args.json, json.dumps(result, indent=1))
        print(f'saved {args.json}')


if __name__ == '__main__':
    main()
