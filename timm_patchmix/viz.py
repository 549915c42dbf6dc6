"""Every figure the package draws: the search's fitness curve (``fitness.png``) and chosen pairs (``pairs.png``), the
grid of mixed samples of the demo (``patchmix_samples.png``) and of the pipeline (``guided_samples.png``).

PNGs are written atomically. matplotlib is imported when a plot is drawn, not with this module.
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageDraw

from .checkpoint import atomic_write_bytes
from .grid import cell_bounds

__all__ = ['GuidedSamplesError', 'plot_fitness', 'plot_pairs', 'render_grid', 'render_guided_samples', 'save_figure',
           'save_image']


def save_figure(fig, path: str) -> None:
    """A matplotlib figure as a PNG at ``path`` (atomically)."""
    buf = io.BytesIO()
    fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
    atomic_write_bytes(path, buf.getvalue())


def save_image(picture: Image.Image, path: str) -> None:
    """A PIL image as a PNG at ``path`` (atomically)."""
    buf = io.BytesIO()
    picture.save(buf, format='PNG')
    atomic_write_bytes(path, buf.getvalue())


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


# --- the search ------------------------------------------------------------------------------------------------
def plot_fitness(logbook: List[Dict[str, Any]], path: str, direction: str, score: str = 'accuracy') -> None:
    """Best and mean fitness per generation (the paper's Figure 5)."""
    plt = _pyplot()
    gens = [r['gen'] for r in logbook]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(gens, [r['hof_best'] for r in logbook], label='best (hall of fame)')
    ax.plot(gens, [r['mean'] for r in logbook], label='population mean')
    ax.set_xlabel('generation')
    from .search.config import score_words
    what, _ = score_words(score)
    ax.set_ylabel(f'fitness: {what} of f_T (' + ('lower' if direction == 'min' else 'higher') + ' is selected)')
    ax.set_title('Search fitness per generation')
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)


def plot_pairs(table, path: str, max_pairs: int = 40) -> None:
    """The chosen class pairs of a :class:`~timm_patchmix.table.MaskTable` with their masks and scores, in the
    table's order, with a title and a legend saying what the colours and numbers mean."""
    from matplotlib.patches import Patch
    if isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 1:
        raise ValueError(f'plot_pairs: max_pairs must be an integer >= 1, got {max_pairs!r}')
    if not table.pairs:
        raise ValueError('plot_pairs: the table holds no class pairs to plot')
    plt = _pyplot()
    n = min(len(table.pairs), max_pairs)
    cols = min(n, 8)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.9 * rows + 0.9), squeeze=False)
    names = table.class_names or [str(i) for i in range(table.num_classes)]
    args = table.search_args or {}
    direction, score = args.get('fitness', 'min'), args.get('score', 'accuracy')
    from .search.config import kept_genes, score_words
    what, harder = score_words(score)
    for a in axes.flat[n:]:
        a.axis('off')
    for k in range(n):
        a = axes.flat[k]
        i, j = table.pairs[k]
        # cells outlined in grey, so white cells show against the page
        a.pcolormesh(np.asarray(table.masks[k], dtype=float), cmap='gray', vmin=0, vmax=1, edgecolors='0.6',
                     linewidth=0.5)
        a.set_aspect('equal')
        a.invert_yaxis()  # row 0 on top, as in the image
        a.set_xticks([])
        a.set_yticks([])
        a.set_title(f'{names[i][:10]}\n+ {names[j][:10]}', fontsize=7)
        a.set_xlabel(f'{table.scores[k]:.3f}', fontsize=7)
    order = kept_genes(direction, score)
    shown = f'{n} of {len(table.pairs)}' if n < len(table.pairs) else f'{n}'
    fig.suptitle(f'Searched class pairs and masks ({shown} pairs, {order} first; grid {table.grid[0]}x'
                 f'{table.grid[1]})', fontsize=9)
    handles = [Patch(facecolor='white', edgecolor='black', label="cell from the first class's image"),
               Patch(facecolor='black', edgecolor='black', label="cell from the second class's image")]
    fig.legend(handles=handles, loc='lower center', ncol=2, fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, -0.02),
               title=f"number under a pair: its score, f_T's {what} on the pair's mixed validation images "
                     f'({harder} is harder)', title_fontsize=7)
    save_figure(fig, path)
    plt.close(fig)


# --- grids of mixed samples ------------------------------------------------------------------------------------
def _tile(img: torch.Tensor, scale: int) -> Image.Image:
    arr = img.permute(1, 2, 0).numpy()
    if arr.shape[2] == 1:  # greyscale
        arr = arr[:, :, 0]
    return Image.fromarray(arr).resize((arr.shape[1] * scale, arr.shape[0] * scale), Image.NEAREST)


def _label_text(classes: Sequence[str], label: int, partner_label: int, image_t: torch.Tensor) -> str:
    """The lambda-weighted label, the image's class first and the partner's second."""
    if label == partner_label:
        return f'{classes[label]} {float(image_t[label]):.3f}'
    return f'{classes[label]} {float(image_t[label]):.3f} + {classes[partner_label]} {float(image_t[partner_label]):.3f}'


def render_grid(images, partners, mixed, mask, labels: Sequence[int], partner_labels: Sequence[int], image_t,
                classes: Sequence[str], grid: Tuple[int, int], scale: int = 4, title: Optional[str] = None,
                heads: Sequence[str] = ('image', 'partner', 'PatchMix')) -> Image.Image:
    """One row per sample: the image, its partner, the mix with its cell lines (white: the cell is the image's,
    black: the partner's) and the lambda-weighted label naming the image's class, then the partner's.

    ``images``, ``partners``, ``mixed``: uint8 ``[N, C, H, W]`` with C 1 (greyscale) or 3; ``mask``: bool
    ``[N, rows, cols]``; ``image_t``: the image targets ``[N, num_classes]``; ``title``: lines above the grid.
    """
    for name, t in (('images', images), ('partners', partners), ('mixed', mixed)):
        if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[1] not in (1, 3) or t.shape != mixed.shape:
            raise ValueError(f'render_grid: {name} must be uint8 [N, 1 or 3, H, W] like mixed {tuple(mixed.shape)}, '
                             f'got {t.dtype} {tuple(t.shape)}')
    n, _, h, w = mixed.shape
    if tuple(mask.shape) != (n, *grid):
        raise ValueError(f'render_grid: mask must be [N, rows, cols] = {[n, *grid]}, got {list(mask.shape)}')
    tw, th, pad = w * scale, h * scale, 6
    texts = [_label_text(classes, int(labels[i]), int(partner_labels[i]), image_t[i]) for i in range(n)]
    notes = [f'(white cells: from the {classes[int(labels[i])]} image)' for i in range(n)]
    measure = ImageDraw.Draw(Image.new('RGB', (1, 1)))
    label_head = 'label: image + partner (lambda-weighted)'
    text_w = int(max([190] + [measure.textlength(t) + 8 for t in texts + notes + [label_head]]))
    title_lines = title.split('\n') if title else []
    top = 18 + 14 * len(title_lines)
    canvas = Image.new('RGB', (3 * (tw + pad) + text_w, n * (th + pad) + top), 'white')
    draw = ImageDraw.Draw(canvas)
    for q, line in enumerate(title_lines):
        draw.text((2, 2 + 14 * q), line, fill='black')
    for j, head in enumerate(heads):
        draw.text((j * (tw + pad) + 2, top - 16), head, fill='black')
    draw.text((3 * (tw + pad) + 2, top - 16), label_head, fill='black')
    rb, cb = cell_bounds(h, grid[0]), cell_bounds(w, grid[1])
    for i in range(n):
        y0 = top + i * (th + pad)
        canvas.paste(_tile(images[i], scale), (0, y0))
        canvas.paste(_tile(partners[i], scale), (tw + pad, y0))
        x0 = 2 * (tw + pad)
        canvas.paste(_tile(mixed[i], scale), (x0, y0))
        for r in range(grid[0]):
            for c in range(grid[1]):
                box = (x0 + cb[c] * scale, y0 + rb[r] * scale, x0 + cb[c + 1] * scale - 1, y0 + rb[r + 1] * scale - 1)
                draw.rectangle(box, outline=(255, 255, 255) if mask[i, r, c] else (0, 0, 0))
        draw.text((3 * (tw + pad) + 2, y0 + th // 2 - 12), texts[i], fill='black')
        draw.text((3 * (tw + pad) + 2, y0 + th // 2 + 2), notes[i], fill='gray')
    return canvas


def _positions_by_class(ds) -> Dict[int, List[int]]:
    """The positions in ``ds`` of each class's images."""
    from .data import view_labels
    by_class: Dict[int, List[int]] = {}
    for pos, c in enumerate(view_labels(ds)):
        by_class.setdefault(c, []).append(pos)
    return by_class


class GuidedSamplesError(ValueError):
    """Data the guided-samples picture cannot be drawn from: no image of a class the table pairs, an image file
    that cannot be read, images of several sizes without a data config."""


def render_guided_samples(table_path: str, dataset: str, data_dir: str, path: str, n: int = 8, seed: int = 0,
                          data_config: Optional[Dict[str, Any]] = None) -> None:
    """A PNG of guided samples: for the table's first ``n`` pairs, a validation image of each class (a training
    image for a class the validation split lacks), their mix under the pair's mask (the first class's image kept
    where the mask is white), and the lambda-weighted label.

    ``data_config`` (a checkpoint's ``data`` record: ``input_size``, ``interpolation``, ``crop_pct``) makes the
    images as evaluation makes the model's (resized and centre-cropped to ``input_size``), which an image folder of
    images of several sizes needs; without it the images are drawn as stored, and must share one size."""
    from torchvision.transforms.functional import pil_to_tensor
    from .data import DatasetError, build_dataset, labelled_image, pixel_transform
    from .mix import PatchMix, PatchMixParams, split_target
    from .table import MaskTable, dataset_fingerprint
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f'render_guided_samples: n must be an integer >= 1, got {n!r}')
    # a table of another dataset is refused, as train.py refuses it (its captions would name other classes): the
    # table's fingerprint is of the dataset's name and the training split's classes, which it names; the validation
    # split is labelled with them (a split with a class outside them is refused)
    names = MaskTable.load(table_path).class_names or None
    if names:
        table = MaskTable.load(table_path, num_classes=len(names), fingerprint=dataset_fingerprint(dataset, names))
    ds = build_dataset(dataset, data_dir, 'validation', class_names=names)
    if not names:  # (a table that names no classes: checked against the validation split's)
        table = MaskTable.load(table_path, num_classes=len(ds.classes) if ds.classes else None,
                               fingerprint=dataset_fingerprint(dataset, ds.classes) if ds.classes else None)
    gen = torch.Generator().manual_seed(seed)
    pairs = table.pairs[:n]
    m = len(pairs)
    sources = [(ds, _positions_by_class(ds))]
    need = {c for pair in pairs for c in pair}
    if need - set(sources[0][1]):  # a class the validation split lacks (the search may score the training split)
        train = build_dataset(dataset, data_dir, 'train', class_names=names or ds.classes)
        sources.append((train, _positions_by_class(train)))
    missing = sorted(need - {c for _, by_class in sources for c in by_class})
    if missing:
        named = [table.class_names[c] if table.class_names else c for c in missing]
        raise GuidedSamplesError(f'render_guided_samples: the table pairs class(es) {named}, which neither the '
                                 f'validation nor the training split of {dataset or data_dir or "patchshapes"!r} has '
                                 f'an image of')

    sized = None
    if data_config is not None:
        if not isinstance(data_config, dict) or len(data_config.get('input_size') or ()) != 3:
            raise ValueError(f'render_guided_samples: data_config must be a dict with input_size (C, H, W), got '
                             f'{data_config!r}')
        _, h, w = data_config['input_size']
        sized = pixel_transform(3, int(h), int(w), data_config.get('interpolation') or 'bilinear',
                                data_config.get('crop_pct'))

    def image_of(c):
        source, by_class = next((d, b) for d, b in sources if c in b)
        pos = by_class[c][int(torch.randint(len(by_class[c]), (1,), generator=gen))]
        img = labelled_image(source, pos, c).convert('RGB')  # the image of the class the caption names
        if sized is None:
            return pil_to_tensor(img)
        return (sized(img) * 255).round().clamp(0, 255).to(torch.uint8)
    try:
        picked = [image_of(a) for a, _ in pairs] + [image_of(b) for _, b in pairs]
    except DatasetError as e:
        raise GuidedSamplesError(f'render_guided_samples: {e}') from None
    sizes = sorted({tuple(t.shape[1:]) for t in picked})
    if len(sizes) > 1:
        raise GuidedSamplesError(f'render_guided_samples: the images drawn are of {len(sizes)} sizes ('
                                 f'{", ".join(f"{a}x{b}" for a, b in sizes)}); pass data_config (a checkpoint\'s '
                                 f'data record, with input_size) to draw them at one size')
    x = torch.stack(picked)
    y = torch.tensor([a for a, _ in pairs] + [b for _, b in pairs])
    masks = torch.stack([torch.as_tensor(np.asarray(table.masks[k], dtype=bool)) for k in range(m)])
    params = PatchMixParams(torch.cat([torch.arange(m, 2 * m), torch.arange(m, 2 * m)]),
                            torch.cat([masks, torch.ones_like(masks)]))
    mixed, packed = PatchMix(grid=table.grid, num_classes=table.num_classes).apply(x.clone(), y, params)
    image_t, _ = split_target(packed)
    names = table.class_names or [str(c) for c in range(table.num_classes)]
    title = (f'Guided PatchMix samples: the first {m} pairs of the searched table. Each row: an image of the pair\'s '
             f'first class,\nan image of its second class (the partner), their mix under the pair\'s searched mask, '
             f'and the label.')
    picture = render_grid(x[:m], x[m:], mixed[:m], masks, y[:m].tolist(), y[m:].tolist(), image_t[:m], names,
                          table.grid, title=title, heads=('image (1st class)', 'partner (2nd class)', 'guided mix'))
    save_image(picture, path)
