"""patchhead_X against plain X in the same run: training-step time, parameters, and import cost.

    python benchmarks/bench_models.py [--repeats 15] [--json benchmarks/results/models_cpu.json]
    python benchmarks/bench_models.py --device cuda --amp bf16 --channels-last --cifar-batch 128 --imagenet-batch 128

Training step = forward + backward + SGD step at identical settings; the plain model trains with cross-entropy,
the patchhead model with PatchMixLoss on a PatchMix batch of the same images (mixing itself excluded: it is
measured in bench_mix.py). Steps of the two models alternate so drift hits both alike; medians are reported.
Each step's operator count (aten ops dispatched in a whole step: zero_grad, forward, backward and the SGD step,
views left out) is reported beside it:
on an accelerator every op is at least one kernel launch, so the count is what a launch-bound step pays for.
Import cost: the time ``import timm_patchmix`` takes right after ``import timm``, in fresh interpreters.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
import timm
from torch.utils._python_dispatch import TorchDispatchMode  # op counting only; no result depends on it

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
from timm_patchmix import PatchMix, PatchMixLoss  # noqa: E402
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from timm_patchmix.cli_types import positive_int  # noqa: E402


def even_batch(text: str) -> int:
    """A batch size for timm's Mixup/CutMix, the peer of the mixer benchmarks: a positive even integer (timm asserts
    an even batch)."""
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f'must be an even integer >= 2 (timm\'s Mixup mixes pairs), got {value}')
    return value


class _OpCount(TorchDispatchMode):
    """Records the aten ops that reach the kernels (views and allocations left out), or with ``every_call`` every
    aten call that reaches dispatch, views included (each costs host time)."""
    SKIP = {'detach', 'empty', 'empty_strided', 'empty_like', 'lift_fresh', '_unsafe_view'}

    def __init__(self, every_call: bool = False):
        super().__init__()
        self.every_call = every_call
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.every_call or (not func.is_view and name not in self.SKIP):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def op_count(fn, every_call: bool = False) -> list:
    """The names of the aten ops one call of ``fn`` dispatches (see :class:`_OpCount`)."""
    counter = _OpCount(every_call)
    with counter:
        fn()
    return counter.ops


def step_time(arch: str, batch: int, size: int, repeats: int, num_classes: int, device, amp: str = 'none',
              channels_last: bool = False) -> dict:
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    plain = timm.create_model(arch, num_classes=num_classes).to(device, memory_format=fmt).train()
    head = timm.create_model(f'patchhead_{arch}', num_classes=num_classes).to(device, memory_format=fmt).train()
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, num_classes, (batch,), device=device)
    xm, packed = PatchMix(num_classes=num_classes)(x, y)
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp)
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else nullcontext
    scaler = torch.amp.GradScaler(device.type) if amp == 'fp16' else None
    crit = PatchMixLoss()
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    opt_h = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)

    def backward_step(loss, opt):
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    def run_plain():
        opt_p.zero_grad(set_to_none=True)
        with autocast():
            loss = F.cross_entropy(plain(xm), y)
        backward_step(loss, opt_p)

    def run_head():
        opt_h.zero_grad(set_to_none=True)
        with autocast():
            loss = crit(head(xm), packed)
        backward_step(loss, opt_h)

    for fn in (run_plain, run_head, run_plain, run_head):
        fn()
    ops_plain, ops_head = len(op_count(run_plain)), len(op_count(run_head))
    if not repeats:  # --ops-only
        return {'arch': arch, 'batch': batch, 'size': size, 'amp': amp, 'channels_last': channels_last,
                'ops_plain': ops_plain, 'ops_patchhead': ops_head}
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
    return {'arch': arch, 'batch': batch, 'size': size, 'num_classes': num_classes, 'amp': amp,
            'channels_last': channels_last, 'ops_plain': ops_plain, 'ops_patchhead': ops_head,
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
    parser.add_argument('--repeats', type=positive_int, default=15)
    parser.add_argument('--import-repeats', type=positive_int, default=15)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--json', default=None)
    parser.add_argument('--amp', choices=('none', 'bf16', 'fp16'), default='none', help='autocast dtype of the step')
    parser.add_argument('--channels-last', action='store_true', help='models and batches in channels_last')
    parser.add_argument('--cifar-batch', type=positive_int, default=64,
                        help='batch of the 32x32 preactresnet56_cifar case')
    parser.add_argument('--imagenet-batch', type=positive_int, default=8, help='batch of the 224x224 resnet50 case')
    parser.add_argument('--only-import', action='store_true')
    parser.add_argument('--ops-only', action='store_true', help='count the ops of each step; no timing')
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(torch.get_num_threads())
    results = {'device': str(device), 'torch': torch.__version__, 'timm': timm.__version__, 'steps': [],
               'name': torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor()}
    cases = () if args.only_import else (('preactresnet56_cifar', args.cifar_batch, 32, 10),
                                         ('resnet50', args.imagenet_batch, 224, 1000))
    for arch, batch, size, nc in cases:
        r = step_time(arch, batch, size, 0 if args.ops_only else args.repeats, nc, device, args.amp,
                      args.channels_last)
        results['steps'].append(r)
        if args.ops_only:
            print(f"{arch} batch {batch} at {size} (amp {args.amp}): ops per step, plain {r['ops_plain']}, "
                  f"patchhead {r['ops_patchhead']} ({r['ops_patchhead'] - r['ops_plain']:+d})")
            continue
        print(f"{arch} batch {batch} at {size} (amp {args.amp}, channels_last {args.channels_last}): plain "
              f"{r['median_ms_plain']:.2f} ms, patchhead {r['median_ms_patchhead']:.2f} ms per step "
              f"({100 * r['step_overhead']:+.1f}%); ops {r['ops_plain']} -> {r['ops_patchhead']}; params "
              f"{r['params_plain'] / 1e6:.2f}M -> {r['params_patchhead'] / 1e6:.2f}M "
              f"({100 * r['param_overhead']:+.1f}%)")
    if args.ops_only:
        args.import_repeats = 1
    imp = import_cost(args.import_repeats)
    results['import'] = imp
    print(f"import timm_patchmix after import timm: {imp['median_ms_added_by_import']:.1f} ms (median of "
          f"{len(imp['samples_ms'])}; benchmarks/bench_import.py has the full measurement)")
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1))
        print(f'saved {args.json}')


if __name__ == '__main__':
    main()
