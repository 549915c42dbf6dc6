"""patchhead_X against plain X in the same run: training-step time, parameters, and import cost.

    python benchmarks/bench_models.py [--repeats 15] [--json benchmarks/results/models_cpu.json]

Training step = forward + backward + SGD step at identical settings; the plain model trains with cross-entropy,
the patchhead model with PatchMixLoss on a PatchMix batch of the same images (mixing itself excluded: it is
measured in bench_mix.py). Steps of the two models alternate so drift hits both alike; medians are reported.
Import cost: the time ``import timm_patchmix`` takes right after ``import timm``, in fresh interpreters.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import timm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
from timm_patchmix import PatchMix, PatchMixLoss  # noqa: E402
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402


def step_time(arch: str, batch: int, size: int, repeats: int, num_classes: int, device) -> dict:
    torch.manual_seed(0)
    plain = timm.create_model(arch, num_classes=num_classes).to(device).train()
    head = timm.create_model(f'patchhead_{arch}', num_classes=num_classes).to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, num_classes, (batch,), device=device)
    xm, packed = PatchMix(num_classes=num_classes)(x, y)
    crit = PatchMixLoss()
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    opt_h = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)

    def run_plain():
        opt_p.zero_grad(set_to_none=True)
        F.cross_entropy(plain(xm), y).backward()
        opt_p.step()

    def run_head():
        opt_h.zero_grad(set_to_none=True)
        crit(head(xm), packed).backward()
        opt_h.step()

    for fn in (run_plain, run_head, run_plain, run_head):
        fn()
    t_plain, t_head = [], []
    for _ in range(repeats):
        for fn, acc in ((run_plain, t_plain), (run_head, t_head)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            acc.append((time.perf_counter() - t0) * 1e3)
    n_plain = sum(p.numel() for p in plain.parameters())
    n_head = sum(p.numel() for p in head.parameters())
    mp, mh = statistics.median(t_plain), statistics.median(t_head)
    return {'arch': arch, 'batch': batch, 'size': size, 'num_classes': num_classes,
            'median_ms_plain': mp, 'median_ms_patchhead': mh, 'step_overhead': mh / mp - 1,
            'params_plain': n_plain, 'params_patchhead': n_head, 'param_overhead': n_head / n_plain - 1}


def import_cost(repeats: int) -> dict:
    """What ``import timm_patchmix`` adds after ``import timm``, timed inside fresh interpreters (process start and
    timm's own import, seconds of disk-bound noise on a shared machine, stay outside the measurement)."""
    root = os.path.join(os.path.dirname(__file__), '..')
    code = ('import time, timm; t = time.perf_counter(); import timm_patchmix; '
            'print((time.perf_counter() - t) * 1e3)')
    added = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, '-c', code], check=True, cwd=root, capture_output=True, text=True)
        added.append(float(out.stdout.strip().splitlines()[-1]))
    return {'median_ms_added_by_import': statistics.median(added), 'samples_ms': added}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--repeats', type=int, default=15)
    parser.add_argument('--import-repeats', type=int, default=15)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--json', default=None)
    parser.add_argument('--only-import', action='store_true')
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(torch.get_num_threads())
    results = {'device': str(device), 'torch': torch.__version__, 'timm': timm.__version__, 'steps': []}
    cases = () if args.only_import else (('preactresnet56_cifar', 64, 32, 10), ('resnet50', 8, 224, 1000))
    for arch, batch, size, nc in cases:
        r = step_time(arch, batch, size, args.repeats, nc, device)
        results['steps'].append(r)
        print(f"{arch} batch {batch} at {size}: plain {r['median_ms_plain']:.1f} ms, patchhead "
              f"{r['median_ms_patchhead']:.1f} ms per step ({100 * r['step_overhead']:+.1f}%); params "
              f"{r['params_plain'] / 1e6:.2f}M -> {r['params_patchhead'] / 1e6:.2f}M "
              f"({100 * r['param_overhead']:+.1f}%)")
    imp = import_cost(args.import_repeats)
    results['import'] = imp
    print(f"import timm_patchmix after import timm: {imp['median_ms_added_by_import']:.1f} ms (median of "
          f"{len(imp['samples_ms'])}; benchmarks/bench_import.py has the full measurement)")
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1))
        print(f'saved {args.json}')


if __name__ == '__main__':
    main()
