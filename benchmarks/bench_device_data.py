"""Training throughput of --device-data against the same loop on synthetic on-device batches and on timm's loader.

    python benchmarks/bench_device_data.py --device cuda --dataset fashion_mnist --data-dir data/fmnist \\
        --batch-size 512 --amp --channels-last [--compile] [--json benchmarks/results/device_data_cuda.json]

Three ways to feed the engine's own training step (mix on the device, forward, PatchMixLoss, backward, SGD) for
``patchhead_resnet32_cifar`` with Random PatchMix, in the same process and alternating so drift hits all alike:
  device     --device-data: the whole uint8 set on the device, crop/flip/normalise by one gather per batch;
  synthetic  the same step on pre-made normalised batches already on the device (the ceiling for any input path);
  loader     timm's DataLoader + PrefetchLoader with -j workers (the default path).
img/s per segment of --steps steps (synchronised at both ends); medians over --repeats segments.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
import timm_patchmix  # noqa: E402,F401
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from timm_patchmix.cli_types import nonneg_int, positive_int  # noqa: E402
from timm_patchmix.engine import TrainConfig  # noqa: E402
from timm_patchmix.engine.loop import Stepper, amp_setup, train_step  # noqa: E402
from timm_patchmix.engine.run import _criterion, _optimization, _setup, _wrap  # noqa: E402
from timm_patchmix.engine.runtime import init_runtime  # noqa: E402


def _endless(loader):
    while True:
        for batch in loader:
            yield batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default=None)
    p.add_argument('--dataset', default='')
    p.add_argument('--data-dir', default='')
    p.add_argument('--model', default='patchhead_resnet32_cifar')
    p.add_argument('-b', '--batch-size', type=positive_int, default=512)
    p.add_argument('-j', '--workers', type=nonneg_int, default=4, help='workers of the loader path')
    p.add_argument('--amp', action='store_true')
    p.add_argument('--channels-last', action='store_true')
    p.add_argument('--compile', action='store_true', help='torch.compile the model (inductor)')
    p.add_argument('--steps', type=positive_int, default=30)
    p.add_argument('--repeats', type=positive_int, default=5)
    p.add_argument('--skip-loader', action='store_true')
    p.add_argument('--json', default=None)
    args = p.parse_args()
    rt = init_runtime(args.device)
    base = TrainConfig(dataset=args.dataset, data_dir=args.data_dir, model=args.model, patchmix=True,
                       recipe='paper-cifar', batch_size=args.batch_size, workers=args.workers, amp=args.amp,
                       amp_dtype='bfloat16', channels_last=args.channels_last, no_progress=True,
                       torchcompile='inductor' if args.compile else None, device=args.device).with_recipe()
    sync = (lambda: torch.cuda.synchronize(rt.device)) if rt.device.type == 'cuda' else (lambda: None)
    feeds, steppers = {}, {}
    t0 = time.perf_counter()
    for name, device_data in (('device', True), ('loader', False)):
        if name == 'loader' and args.skip_loader:
            continue
        cfg, data, model, _, loaders, _ = _setup(dataclasses.replace(base, device_data=device_data), rt, False)
        optimizer, scheduler, _ = _optimization(cfg, model, len(loaders.train))
        autocast, scaler = amp_setup(cfg, rt.device)
        stepper = Stepper(_wrap(cfg, model, rt), optimizer, _criterion(cfg), cfg, rt.device, scheduler,
                          loaders.mixer, autocast, scaler)
        stepper.train_mode()
        loaders.sampler.set_epoch(0)
        feeds[name], steppers[name] = _endless(loaders.train), stepper
        if name == 'device':
            x0, y0 = next(iter(loaders.train))
            pool = [(torch.randn_like(x0), torch.randint(0, cfg.num_classes, y0.shape, device=rt.device))
                    for _ in range(8)]
            feeds['synthetic'] = _endless(pool)
            # its own model and optimizer, so the two runs do not share weights
            cfg2, _, model2, _, loaders2, _ = _setup(dataclasses.replace(base, device_data=True), rt, False)
            opt2, sched2, _ = _optimization(cfg2, model2, len(loaders2.train))
            steppers['synthetic'] = Stepper(_wrap(cfg2, model2, rt), opt2, _criterion(cfg2), cfg2, rt.device,
                                            sched2, loaders2.mixer, autocast, scaler)
            steppers['synthetic'].train_mode()
    setup_s = time.perf_counter() - t0
    for name in feeds:  # warm-up: allocator, cudnn autotune, compilation
        for _ in range(5):
            train_step(steppers[name], *next(feeds[name]))
    samples = {k: [] for k in feeds}
    for _ in range(args.repeats):
        for name in feeds:
            sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                train_step(steppers[name], *next(feeds[name]))
            sync()
            samples[name].append(args.steps * args.batch_size / (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in samples.items()}
    res = {'device': str(rt.device), 'name': torch.cuda.get_device_name(rt.device) if rt.device.type == 'cuda' else
           'cpu', 'torch': torch.__version__, 'model': args.model, 'dataset': args.dataset or 'patchshapes',
           'batch_size': args.batch_size, 'amp': args.amp, 'channels_last': args.channels_last,
           'compile': args.compile, 'workers': args.workers, 'steps': args.steps, 'repeats': args.repeats,
           'setup_s': setup_s, 'img_s': samples, 'median_img_s': med,
           'device_over_synthetic': med['device'] / med['synthetic']}
    if 'loader' in med:
        res['loader_over_synthetic'] = med['loader'] / med['synthetic']
    print(f"{args.model} batch {args.batch_size} on {res['name']} (amp {args.amp}, channels_last "
          f"{args.channels_last}, compile {args.compile}); median img/s of {args.repeats} x {args.steps} steps:")
    for k, v in med.items():
        print(f'  {k:10s} {v:10.0f} img/s  {v / med["synthetic"]:.3f} of synthetic')
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=1))
        print(f'saved {args.json}')


if __name__ == '__main__':
    main()
