"""Where a CUDA mixer call spends its time: the tensor mixer taken apart, and two CUDA-graph prototypes.

    python benchmarks/bench_mix_cuda.py [--repeats 31] [--json benchmarks/results/mix_cuda_parts.json]

Needs a CUDA device. On float32 [128, 3, 224, 224] with 1000 classes, every case is timed two ways, interleaved
round-robin with the others, medians:

- ``latency_ms``: one call between two synchronisations (what ``bench_mix.py`` reports);
- ``host_ms`` and ``pipelined_ms``: ``--burst`` calls back to back with no synchronisation between them. ``host_ms``
  is the time the host takes to issue one call (measured before the closing synchronisation), ``pipelined_ms`` the
  time per call once the device has finished them all. A call whose ``host_ms`` is about its ``pipelined_ms`` is
  bound by the host (dispatch and kernel launches); one whose ``pipelined_ms`` is well above its ``host_ms`` by the
  device.

The cases: the copy floor, one tiny kernel (the per-launch floor), ``PatchMix`` 'elem' and its parts (``sample``;
``_apply`` on fixed params, that is the labels, the pixel mask, the select and the packed target; the select alone;
the packed target alone), timm's batch-mode CutMix, and ``lean``: the same aten calls as the library's accelerator
branch written out without its Python checks, to size the share of Python. The prototypes capture parts of a
PatchMix call in a CUDA graph, so that one replay issues what were many launches: ``graph_sample`` replays the
sampling (partners, masks) and runs the rest eagerly, ``graph_full`` replays the whole call on static buffers,
copying the batch in and out. A prototype that fails to capture is recorded with its error and skipped. The aten
calls one call dispatches (views included) are counted for the eager cases.
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
from bench_models import op_count  # noqa: E402  (the script beside this one; call counting only)
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from timm_patchmix.grid import _pixel_cells  # noqa: E402
from timm_patchmix.mix import PatchMix, _header, mix_select_, pack_target, soft_target  # noqa: E402


def capture(fn, warmup: int = 3):
    """A CUDA graph of ``fn()`` (warmed up on a side stream, as capture requires) and what the captured call
    returned: static tensors that every replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--repeats', type=int, default=31)
    p.add_argument('--burst', type=int, default=20, help='calls issued back to back for host_ms and pipelined_ms')
    p.add_argument('--batch', type=int, default=128)
    p.add_argument('--size', type=int, default=224)
    p.add_argument('--num-classes', type=int, default=1000)
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
    cut = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, mode='batch', label_smoothing=0.0, num_classes=nc)
    params = pm.sample(n, device=dev)
    pix_idx = _pixel_cells(s, s, 4, 4, dev)
    header = _header(4, 4, dev)

    def target_only():
        yy = soft_target(y, nc, 0.0, batch_size=n, device=dev)
        lam = torch.full((n,), 0.5, device=dev)
        return pack_target(yy, yy.index_select(0, params.partner), lam, params.mask)

    def lean():
        # the library's accelerator branch, aten call for aten call, without its checks and helpers
        order = torch.randperm(n, device=dev)
        partner = torch.empty_like(order).scatter_(0, order, order.roll(-1))
        mask = torch.rand(n, 4, 4, device=dev) < 0.5
        pix = mask.view(n, 16).index_select(1, pix_idx).view(n, 1, s, s)
        torch.where(pix, x, x.index_select(0, partner), out=x)
        lam = pix.sum((1, 2, 3), dtype=torch.float64) / (s * s)
        yy = torch.full((n, nc), 0.0, device=dev).scatter_(1, y.view(-1, 1), 1.0)
        return x, torch.cat([header.expand(n, 2), lam.view(n, 1).float(), yy, yy.index_select(0, partner),
                             mask.view(n, 16).float()], 1)

    cases = {
        'copy_floor': lambda: buf.copy_(x),
        'tiny_kernel': lambda: tiny.add_(1),
        'patchmix_elem': lambda: pm(x, y),
        'timm_cutmix_batch': lambda: cut(x, y),
        'patchmix_sample': lambda: pm.sample(n, device=dev),
        'patchmix_apply': lambda: pm._apply(x, y, params),
        'patchmix_select': lambda: mix_select_(x, params.partner, params.mask),
        'patchmix_target': target_only,
        'randperm': lambda: torch.randperm(n, device=dev),
        'lean': lean,
    }
    calls = {k: len(op_count(fn, every_call=True)) for k, fn in cases.items()}
    errors = {}

    try:
        g_sample, static_params = capture(lambda: pm.sample(n, device=dev))

        def graph_sample():
            g_sample.replay()
            return pm._apply(x, y, static_params)
        cases['graph_sample'] = graph_sample
    except Exception as e:  # a prototype that cannot be captured is reported, not fatal
        errors['graph_sample'] = f'{type(e).__name__}: {e}'
    try:
        xs, ys = x.clone(), y.clone()
        g_full, (_, t_static) = capture(lambda: pm(xs, ys))

        def graph_full():
            xs.copy_(x)
            ys.copy_(y)
            g_full.replay()
            x.copy_(xs)
            return x, t_static.clone()
        cases['graph_full'] = graph_full
    except Exception as e:
        errors['graph_full'] = f'{type(e).__name__}: {e}'
    torch.cuda.synchronize()

    for fn in cases.values():
        fn()
        fn()
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
    for k, e in errors.items():
        print(f'  {k}: not captured: {e}')
    if args.json:
        result = {'device': torch.cuda.get_device_name(), 'torch': torch.__version__, 'shape': [n, 3, s, s],
                  'num_classes': nc, 'repeats': args.repeats, 'burst': args.burst, 'aten_calls': calls,
                  'errors': errors, **med}
        atomic_write_text(args.json, json.dumps(result, indent=1))
        print(f'saved {args.json}')


if __name__ == '__main__':
    main()
