"""Mix a batch of the embedded default dataset and save a PNG grid of the results with their labels.

    python -m timm_patchmix.demo --output output/demo
"""
from __future__ import annotations

import argparse
import io
import json
import os

import torch
from PIL import Image, ImageDraw

from .checkpoint import atomic_write_bytes, atomic_write_text
from .cli_types import directory, positive_int
from .data import PatchShapes
from .grid import cell_bounds
from .mix import PatchMix, split_target


def _tile(img: torch.Tensor, scale: int) -> Image.Image:
    arr = img.permute(1, 2, 0).numpy()
    return Image.fromarray(arr).resize((arr.shape[1] * scale, arr.shape[0] * scale), Image.NEAREST)


def render_grid(images, partners, mixed, mask, labels, image_t, classes, grid, scale: int = 4) -> Image.Image:
    """One row per sample: the image, its partner, the mix with cell lines and kept cells marked, and the label."""
    n, _, h, w = mixed.shape
    tw, th = w * scale, h * scale
    text_w = 190
    pad = 6
    canvas = Image.new('RGB', (3 * (tw + pad) + text_w, n * (th + pad) + 18), 'white')
    draw = ImageDraw.Draw(canvas)
    for j, head in enumerate(('image', 'partner', 'PatchMix')):
        draw.text((j * (tw + pad) + 2, 2), head, fill='black')
    draw.text((3 * (tw + pad) + 2, 2), 'label (lambda-weighted)', fill='black')
    rb, cb = cell_bounds(h, grid[0]), cell_bounds(w, grid[1])
    for i in range(n):
        y0 = 18 + i * (th + pad)
        canvas.paste(_tile(images[i], scale), (0, y0))
        canvas.paste(_tile(partners[i], scale), (tw + pad, y0))
        x0 = 2 * (tw + pad)
        canvas.paste(_tile(mixed[i], scale), (x0, y0))
        for r in range(grid[0]):
            for c in range(grid[1]):
                box = (x0 + cb[c] * scale, y0 + rb[r] * scale, x0 + cb[c + 1] * scale - 1, y0 + rb[r + 1] * scale - 1)
                draw.rectangle(box, outline=(255, 255, 255) if mask[i, r, c] else (0, 0, 0))
        top = torch.topk(image_t[i], k=min(2, image_t.shape[1]))
        parts = [f'{classes[int(k)]} {float(v):.3f}' for v, k in zip(top.values, top.indices) if float(v) > 0]
        draw.text((3 * (tw + pad) + 2, y0 + th // 2 - 12), ' + '.join(parts), fill='black')
        draw.text((3 * (tw + pad) + 2, y0 + th // 2 + 2), f'({classes[labels[i]]} kept: white cells)', fill='gray')
    return canvas


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--output', default='output/demo', type=directory,
                        help='folder for patchmix_samples.png and its JSON')
    parser.add_argument('--num', type=positive_int, default=8, help='number of mixed samples to show')
    parser.add_argument('--grid', type=positive_int, default=4, help='grid size P')
    parser.add_argument('--mode', default='elem', choices=('elem', 'pair', 'batch'))
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)

    ds = PatchShapes('train', num_samples=max(args.num, 2) * 4)
    size = ds[0][0].shape[-2:]
    if args.grid > min(size):
        parser.error(f'argument --grid: a {args.grid}x{args.grid} grid does not fit the {size[0]}x{size[1]} images '
                     f'(each cell needs a pixel); use at most {min(size)}')
    batch = torch.stack([ds[i][0] for i in range(args.num)])
    labels = torch.tensor([ds[i][1] for i in range(args.num)])
    mixer = PatchMix(grid=args.grid, mode=args.mode, num_classes=len(ds.classes))
    gen = torch.Generator().manual_seed(args.seed)
    params = mixer.sample(args.num, generator=gen)
    mixed, packed = mixer.apply(batch.clone(), labels, params)
    image_t, _ = split_target(packed)
    picture = render_grid(batch, batch[params.partner], mixed, params.mask, labels.tolist(), image_t,
                          ds.classes, mixer.grid)

    png = os.path.join(args.output, 'patchmix_samples.png')
    buf = io.BytesIO()
    picture.save(buf, format='PNG')
    atomic_write_bytes(png, buf.getvalue())
    record = {
        'grid': list(mixer.grid), 'mode': args.mode, 'seed': args.seed,
        'samples': [{'label': ds.classes[int(labels[i])], 'partner_label': ds.classes[int(labels[params.partner[i]])],
                     'mask': params.mask[i].int().tolist(),
                     'target': {ds.classes[k]: round(float(v), 6) for k, v in enumerate(image_t[i]) if v > 0}}
                    for i in range(args.num)],
    }
    atomic_write_text(os.path.join(args.output, 'patchmix_samples.json'), json.dumps(record, indent=1))
    print(f'wrote {png} ({args.num} samples, grid {mixer.grid[0]}x{mixer.grid[1]}, mode {args.mode})')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
