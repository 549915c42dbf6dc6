"""Mix a batch of the embedded default dataset and save a PNG grid of the results with their labels.

    python -m timm_patchmix.demo --output output/demo
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .checkpoint import WriteError, atomic_write_text
from .cli_types import directory, int_range, positive_int, seed_int
from .data import PatchShapes
from .grid import grid_from_flag
from .locking import folder_problem
from .mix import PatchMix, split_target
from .viz import render_grid, save_image

__all__ = ['build_parser', 'main', 'render_grid']


# a picture of mixed samples, one row each (the images, partners and masks are built in memory at once)
MAX_SAMPLES = 256


def build_parser() -> argparse.ArgumentParser:
    from .cli import HelpFormatter, prog_name
    prog = prog_name('timm_patchmix.demo')
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description='Mix a batch of the embedded default dataset (patchshapes) with PatchMix and save a PNG grid:\n'
                    'each image, its partner, the mix with its cells marked, and the lambda-weighted label.',
        epilog=f'examples:\n  {prog}                          # output/demo/patchmix_samples.png and .json\n'
               f'  {prog} --grid 2 --mode pair --num 4')
    parser.add_argument('--output', default='output/demo', type=directory,
                        help='folder for patchmix_samples.png and patchmix_samples.json')
    parser.add_argument('--num', type=int_range(1, MAX_SAMPLES), default=8,
                        help=f'number of mixed samples to show, one row of the picture each (at most {MAX_SAMPLES})')
    parser.add_argument('--grid', type=positive_int, nargs='+', default=[4], metavar='N',
                        help='P (a P x P grid of cells) or rows cols')
    parser.add_argument('--mode', default='elem', choices=('elem', 'pair', 'batch'),
                        help='elem: a mask per sample; pair: pairs swap the same cells; batch: one mask for all')
    parser.add_argument('--seed', type=seed_int, default=0, help='seed of the masks and partners')
    return parser


def main(argv=None) -> int:
    from .cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = folder_problem(args.output)
    if problem:  # (before any work)
        print(f'error: cannot write in --output {args.output}: {" ".join(problem)}', file=sys.stderr)
        return 1

    ds = PatchShapes('train', num_samples=max(args.num, 2) * 4)
    size = ds[0][0].shape[-2:]
    try:
        rows, cols = grid_from_flag(args.grid, '--grid')
    except ValueError as e:
        parser.error(str(e))
    if rows > size[0] or cols > size[1]:
        parser.error(f'argument --grid: a {rows}x{cols} grid does not fit the {size[0]}x{size[1]} images '
                     f'(each cell needs a pixel); use at most {size[0]} rows and {size[1]} columns')
    batch = torch.stack([ds[i][0] for i in range(args.num)])
    labels = torch.tensor([ds[i][1] for i in range(args.num)])
    mixer = PatchMix(grid=(rows, cols), mode=args.mode, num_classes=len(ds.classes))
    gen = torch.Generator().manual_seed(args.seed)
    params = mixer.sample(args.num, generator=gen)
    mixed, packed = mixer.apply(batch.clone(), labels, params)
    image_t, _ = split_target(packed)
    picture = render_grid(batch, batch[params.partner], mixed, params.mask, labels.tolist(),
                          labels[params.partner].tolist(), image_t, ds.classes, mixer.grid)

    png = os.path.join(args.output, 'patchmix_samples.png')
    record = {
        'grid': list(mixer.grid), 'mode': args.mode, 'seed': args.seed,
        'samples': [{'label': ds.classes[int(labels[i])], 'partner_label': ds.classes[int(labels[params.partner[i]])],
                     'mask': params.mask[i].int().tolist(),
                     'target': {ds.classes[k]: round(float(v), 6) for k, v in enumerate(image_t[i]) if v > 0}}
                    for i in range(args.num)],
    }
    try:
        save_image(picture, png)
        atomic_write_text(os.path.join(args.output, 'patchmix_samples.json'), json.dumps(record, indent=1))
    except WriteError as e:  # a full disk, a folder made read-only meanwhile
        print(f'error: {e}', file=sys.stderr)
        return 1
    print(f'wrote {png} ({args.num} samples, grid {mixer.grid[0]}x{mixer.grid[1]}, mode {args.mode})')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
