"""Training throughput of train.py: --patchmix on patchhead_X against --cutmix on X, back to back.

    python benchmarks/bench_train.py [--model resnet32_cifar] [--repeats 3] [--json benchmarks/results/train_cpu.json]

Each repeat runs one epoch of each configuration on the embedded data (same subset, batch, workers and seed), in
alternating order; the images/s of an epoch comes from train.py's own summary row. Medians are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
import timm_patchmix  # noqa: E402,F401
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from timm_patchmix.cli_types import nonneg_int, positive_int  # noqa: E402
from timm_patchmix.train import main as train_main  # noqa: E402


def one(model: str, flags, common, out: str) -> float:
    res = train_main(common + ['--model', model, '--output', out, '--experiment', f'{model}-{len(os.listdir(out))}']
                     + flags)
    return float(res['rows'][-1]['img_s'])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='resnet32_cifar')
    p.add_argument('--repeats', type=positive_int, default=3)
    p.add_argument('--train-subset', type=positive_int, default=2560)
    p.add_argument('-b', '--batch-size', type=positive_int, default=128)
    p.add_argument('-j', '--workers', type=nonneg_int, default=0)
    p.add_argument('--json', default=None)
    args = p.parse_args()
    common = ['--epochs', '1', '--train-subset', str(args.train_subset), '--val-subset', '128', '-b',
              str(args.batch_size), '-j', str(args.workers), '--no-progress', '--log-interval', '1000000']
    with tempfile.TemporaryDirectory() as out:
        cut, pm = [], []
        for r in range(args.repeats):
            order = [('cut', args.model, ['--cutmix', '1.0']), ('pm', f'patchhead_{args.model}', ['--patchmix'])]
            for name, model, flags in (order if r % 2 == 0 else order[::-1]):
                (cut if name == 'cut' else pm).append(one(model, flags, common, out))
    mc, mp = statistics.median(cut), statistics.median(pm)
    res = {'model': args.model, 'train_subset': args.train_subset, 'batch_size': args.batch_size,
           'workers': args.workers, 'cutmix_img_s': cut, 'patchmix_img_s': pm, 'median_cutmix_img_s': mc,
           'median_patchmix_img_s': mp, 'ratio': mp / mc}
    print(f'--cutmix on {args.model}: {mc:.1f} img/s; --patchmix on patchhead_{args.model}: {mp:.1f} img/s; '
          f'ratio {mp / mc:.3f} (median of {args.repeats})')
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=1))


if __name__ == '__main__':
    main()
