"""Datasets. The embedded default, ``patchshapes``, is generated deterministically and needs no download."""
from __future__ import annotations

import logging
from typing import Callable, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ['PatchShapes', 'PATCHSHAPES_CLASSES', 'make_patchshapes']

_logger = logging.getLogger(__name__)

PATCHSHAPES_CLASSES = (
    'disc', 'square', 'triangle', 'cross', 'ring', 'diamond', 'hbars', 'vbars', 'saltire', 'corner',
)
# A typical hue per class; per-image jitter keeps colour a cue but not the whole story.
_BASE_RGB = np.array([
    [230, 60, 50], [40, 120, 230], [240, 200, 40], [60, 190, 80], [200, 70, 210],
    [250, 140, 30], [40, 200, 200], [150, 100, 60], [230, 230, 230], [110, 110, 250],
], dtype=np.float32)


def _shape_masks(label: np.ndarray, cy: np.ndarray, cx: np.ndarray, rad: np.ndarray, size: int) -> np.ndarray:
    """Boolean foreground masks ``[n, size, size]`` of each image's shape, fully vectorised."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    dy = yy[None] - cy[:, None, None]
    dx = xx[None] - cx[:, None, None]
    r = rad[:, None, None]
    ady, adx = np.abs(dy), np.abs(dx)
    t = np.maximum(1.5, r / 3.5)
    shapes = np.stack([
        dy ** 2 + dx ** 2 <= r ** 2,                                            # disc
        (ady <= r * 0.85) & (adx <= r * 0.85),                                  # square
        (dy <= r * 0.8) & (dy >= -r) & (adx <= (dy + r) * 0.55),                # triangle
        ((ady <= t) & (adx <= r)) | ((adx <= t) & (ady <= r)),                  # cross
        (np.abs(np.sqrt(dy ** 2 + dx ** 2) - r * 0.75) <= t * 0.8),             # ring
        (ady + adx <= r),                                                       # diamond
        (adx <= r) & (ady <= r) & (np.floor((dy + r) / t) % 2 == 0),            # horizontal bars
        (adx <= r) & (ady <= r) & (np.floor((dx + r) / t) % 2 == 0),            # vertical bars
        ((np.abs(dy - dx) <= t) | (np.abs(dy + dx) <= t)) & (ady <= r) & (adx <= r),  # saltire
        (((ady <= t) & (dx >= -r) & (dx <= r)) | ((adx <= t) & (dy >= -r) & (dy <= 0))) & (ady <= r),  # corner
    ], axis=1)
    return shapes[np.arange(len(label)), label]


def make_patchshapes(num_samples: int, seed: int, size: int = 32) -> Tuple[np.ndarray, np.ndarray]:
    """Generate ``num_samples`` images ``uint8 [n, size, size, 3]`` and labels ``int64 [n]`` from ``seed``.

    Each image shows one class shape, in a jittered class colour, at a random place and scale over a
    textured background with a second, smaller distractor shape of another class. Which shape sits where is
    what a classifier must read, so a cell of one image pasted into another carries that image's evidence.
    """
    if num_samples < 0:
        raise ValueError(f'num_samples must be >= 0, got {num_samples}')
    if size < 16:
        raise ValueError(f'size must be at least 16, got {size}')
    rng = np.random.default_rng(seed)
    n, k = num_samples, len(PATCHSHAPES_CLASSES)
    labels = np.arange(n, dtype=np.int64) % k
    rng.shuffle(labels)
    s = size / 32.0
    rad = rng.uniform(7.0, 11.0, n).astype(np.float32) * s
    cy = rng.uniform(10.0, 22.0, n).astype(np.float32) * s
    cx = rng.uniform(10.0, 22.0, n).astype(np.float32) * s
    fg = _shape_masks(labels, cy, cx, rad, size)

    # distractor: another class's shape, small, dim, in a random corner region
    d_label = (labels + rng.integers(1, k, n)) % k
    d_rad = rng.uniform(3.0, 4.5, n).astype(np.float32) * s
    d_cy = np.where(rng.random(n) < 0.5, 4.5, 27.5).astype(np.float32) * s
    d_cx = np.where(rng.random(n) < 0.5, 4.5, 27.5).astype(np.float32) * s
    dist = _shape_masks(d_label, d_cy, d_cx, d_rad, size) & ~fg

    # background: smooth colour gradient plus pixel noise
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    c0 = rng.uniform(20, 110, (n, 1, 1, 3)).astype(np.float32)
    c1 = rng.uniform(20, 110, (n, 1, 1, 3)).astype(np.float32)
    w = (yy[None, :, :, None] * rng.uniform(0, 1, (n, 1, 1, 1)) + xx[None, :, :, None] * rng.uniform(0, 1, (n, 1, 1, 1))) / 2
    img = c0 * (1 - w) + c1 * w
    img += rng.normal(0, 12, img.shape).astype(np.float32)

    colour = _BASE_RGB[labels] + rng.normal(0, 18, (n, 3)).astype(np.float32)
    d_colour = 0.6 * _BASE_RGB[d_label] + rng.normal(0, 18, (n, 3)).astype(np.float32)
    img = np.where(fg[..., None], colour[:, None, None, :] + rng.normal(0, 8, img.shape).astype(np.float32), img)
    img = np.where(dist[..., None], d_colour[:, None, None, :], img)
    return np.clip(img, 0, 255).round().astype(np.uint8), labels


class PatchShapes(Dataset):
    """The embedded default dataset: 10 classes of coloured shapes, 32x32 RGB, generated from a seed.

    ``split='train'`` holds 5,000 images and ``'validation'`` 1,000 by default, with disjoint seeds. Items are
    ``(PIL.Image, label)`` through ``transform`` when one is given, else ``(uint8 tensor [3, H, W], label)``.
    """
    classes = PATCHSHAPES_CLASSES
    _seeds = {'train': 1234, 'validation': 4321, 'test': 9876}

    def __init__(self, split: str = 'train', num_samples: Optional[int] = None, size: int = 32,
                 transform: Optional[Callable] = None):
        if split == 'val':
            split = 'validation'
        if split not in self._seeds:
            raise ValueError(f'split must be one of {sorted(self._seeds)}, got {split!r}')
        if num_samples is None:
            num_samples = 5000 if split == 'train' else 1000
        self.split = split
        self.transform = transform
        self.images, targets = make_patchshapes(num_samples, self._seeds[split], size)
        self.targets = targets.tolist()
        _logger.debug('generated patchshapes/%s: %d images of %dx%d', split, num_samples, size, size)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        img, target = self.images[index], self.targets[index]
        if self.transform is not None:
            from PIL import Image
            return self.transform(Image.fromarray(img)), target
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), target
