"""Datasets. The embedded default, ``patchshapes``, is generated deterministically and needs no download."""
from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ['PatchShapes', 'PATCHSHAPES_CLASSES', 'make_patchshapes', 'FashionMNISTFiles', 'SklearnDigits',
           'digits_split', 'PILView', 'build_dataset',
           'open_dataset', 'is_train_split', 'has_fixed_splits', 'split_name_problem', 'subset_indices', 'make_view',
           'dataset_num_classes', 'channel_matched', 'view_labels',
           'Augment', 'default_crop_padding', 'small_image_transform', 'image_transform', 'pixel_transform', 'read_idx',
           'DatasetError',
           'shared_files']

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
    w = (yy[None, :, :, None] * rng.uniform(0, 1, (n, 1, 1, 1))
         + xx[None, :, :, None] * rng.uniform(0, 1, (n, 1, 1, 1))) / 2
    img = c0 * (1 - w) + c1 * w
    img += rng.normal(0, 12, img.shape).astype(np.float32)

    colour = _BASE_RGB[labels] + rng.normal(0, 18, (n, 3)).astype(np.float32)
    d_colour = 0.6 * _BASE_RGB[d_label] + rng.normal(0, 18, (n, 3)).astype(np.float32)
    img = np.where(fg[..., None], colour[:, None, None, :] + rng.normal(0, 8, img.shape).astype(np.float32), img)
    img = np.where(dist[..., None], d_colour[:, None, None, :], img)
    return np.clip(img, 0, 255).round().astype(np.uint8), labels


class _LabelledImages(Dataset):
    """Images in a numpy array with ``targets`` and ``classes``."""
    classes: Tuple[str, ...] = ()
    targets: list

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.targets)


class PatchShapes(_LabelledImages):
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

    def __getitem__(self, index: int):
        img, target = self.images[index], self.targets[index]
        if self.transform is not None:
            from PIL import Image
            return self.transform(Image.fromarray(img)), target
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), target


# --------------------------------------------------------------------------------------------------------------
# Fashion-MNIST from IDX files on disk (Debian's dataset-fashion-mnist puts them in /usr/share/datasets)

FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_CLASSES = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag',
                         'Ankle boot')


class DatasetError(ValueError):
    """Dataset files that cannot be used as they are: damaged, inconsistent, or splits that do not fit together."""


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a numpy array (:class:`DatasetError` for a damaged file)."""
    import gzip
    import zlib
    opener = gzip.open if path.endswith('.gz') else open
    try:
        with opener(path, 'rb') as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DatasetError(f'{path} is damaged (truncated or not gzip data: {e}); fetch the file again') from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DatasetError(f'{path} is not an unsigned-byte IDX file')
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise DatasetError(f'{path} is truncated: its header names {ndim} dimensions, but the file ends after '
                           f'{len(data)} bytes; fetch the file again')
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big') for i in range(ndim)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DatasetError(f'{path} is truncated: header says {dims}, found {body.size} values')
    return body.reshape(dims)


class FashionMNISTFiles(_LabelledImages):
    """Fashion-MNIST read from its original IDX files (``.gz`` or not) under ``root``; no network.

    Items are ``(PIL.Image 'L' 28x28, label)``, through ``transform`` when set.
    """
    classes = FASHION_MNIST_CLASSES
    _files = {'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
              'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte')}

    def __init__(self, root: Optional[str] = None, split: str = 'train', transform: Optional[Callable] = None):
        import os
        root = root or FASHION_MNIST_DIR
        key = 'train' if split in ('train', 'training') else 'test'
        paths = []
        for stem in self._files[key]:
            cands = [os.path.join(d, stem + ext) for d in (root, os.path.join(root, 'FashionMNIST', 'raw'))
                     for ext in ('', '.gz')]
            found = next((p for p in cands if os.path.isfile(p)), None)
            if found is None:
                raise FileNotFoundError(
                    f'Fashion-MNIST file {stem}[.gz] not found in {root} (or {root}/FashionMNIST/raw). '
                    f'Install it with `apt-get install -y dataset-fashion-mnist` (files go to {FASHION_MNIST_DIR}), '
                    f'or pass --data-dir pointing to a folder with the IDX files')
            paths.append(found)
        images, labels = read_idx(paths[0]), read_idx(paths[1])
        if images.ndim != 3 or labels.ndim != 1:
            raise DatasetError(f'{paths[0]} and {paths[1]} must hold images [N, H, W] and labels [N], got shapes '
                               f'{list(images.shape)} and {list(labels.shape)}')
        if len(images) != len(labels):
            raise DatasetError(f'{paths[0]} holds {len(images)} images and {paths[1]} {len(labels)} labels: the '
                               f'files come from different splits or one is damaged')
        if labels.size and int(labels.max()) >= len(self.classes):
            raise DatasetError(f'{paths[1]} holds the label {int(labels.max())}; Fashion-MNIST has '
                               f'{len(self.classes)} classes (0 to {len(self.classes) - 1})')
        self.images = images
        self.targets = labels.astype(np.int64).tolist()
        self.transform = transform
        self.split = key

    def __getitem__(self, index: int):
        from PIL import Image
        img = Image.fromarray(self.images[index], mode='L')
        return (self.transform(img) if self.transform is not None else img), self.targets[index]


# --------------------------------------------------------------------------------------------------------------
# scikit-learn's handwritten digits (sklearn.datasets.load_digits: 1,797 real 8x8 greyscale images, 10 classes)

DIGITS_CLASSES = tuple(str(d) for d in range(10))
DIGITS_TEST_IMAGES = 500
DIGITS_SPLIT_SEED = 0
DIGITS_FIX = "pip install 'timm_patchmix[study]'"


def _load_digits():
    """``(images uint8 [1797, 8, 8], targets int64 [1797])``: the digits with their 0..16 values scaled to 0..255 as
    ``v * 255 // 16`` (integer floor: 0 -> 0, 8 -> 127, 16 -> 255). FileNotFoundError without scikit-learn (the
    data ships inside it), which the entry points report as they report any missing dataset."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise FileNotFoundError(f'--dataset sklearn_digits reads the digits bundled with scikit-learn, which is not '
                                f'installed; install it with `{DIGITS_FIX}` (or `pip install scikit-learn`)') from None
    d = load_digits()
    values = np.rint(d.images).astype(np.int64)
    if values.min() < 0 or values.max() > 16 or not np.array_equal(values, d.images):
        raise ValueError('scikit-learn\'s digits are not integers in 0..16')
    return (values * 255 // 16).astype(np.uint8), np.asarray(d.target, dtype=np.int64)


def digits_split(targets, test_images: int = DIGITS_TEST_IMAGES, seed: int = DIGITS_SPLIT_SEED):
    """``(train, test)``: sorted index arrays of a fixed split of ``targets``, stratified per class.

    Class ``c`` with ``n_c`` of the ``N`` images gives ``test_images * n_c / N`` test images, rounded down, and the
    images still missing from ``test_images`` go one each to the classes with the largest remainders (ties to the
    lower class). Which images of a class are tested comes from one ``numpy.random.default_rng(seed)`` that
    permutes each class's indices in class order, so the split is the same in every process and run."""
    targets = np.asarray(targets, dtype=np.int64)
    classes, counts = np.unique(targets, return_counts=True)
    quota = test_images * counts / len(targets)
    take = np.floor(quota).astype(np.int64)
    order = sorted(range(len(classes)), key=lambda i: (-(quota[i] - take[i]), i))
    take[order[:test_images - int(take.sum())]] += 1
    rng = np.random.default_rng(seed)
    test = []
    for c, k in zip(classes, take):
        idx = np.flatnonzero(targets == c)
        test.append(idx[rng.permutation(len(idx))[:k]])
    test = np.sort(np.concatenate(test))
    train = np.setdiff1d(np.arange(len(targets)), test)
    return train, test


class SklearnDigits(_LabelledImages):
    """scikit-learn's handwritten digits (``sklearn.datasets.load_digits``): 1,797 real 8x8 greyscale images of the
    digits 0..9, classes ``'0'``..``'9'``; needs scikit-learn (``pip install 'timm_patchmix[study]'``).

    ``split='train'`` holds 1,297 images and any evaluation split (``'test'``, ``'validation'``...) the other 500,
    a fixed split stratified per class (:func:`digits_split`, seed 0). Pixels are scaled from 0..16 to 0..255 as
    ``v * 255 // 16``. Items are ``(PIL.Image 'L' 8x8, label)``, through ``transform`` when set.
    """
    classes = DIGITS_CLASSES

    def __init__(self, split: str = 'train', transform: Optional[Callable] = None):
        images, targets = _load_digits()
        train, test = digits_split(targets)
        self.split = 'train' if is_train_split(split) else 'test'
        self.indices = train if self.split == 'train' else test
        self.images = images[self.indices]
        self.targets = targets[self.indices].tolist()
        self.transform = transform

    def __getitem__(self, index: int):
        from PIL import Image
        img = Image.fromarray(self.images[index])  # uint8 [8, 8]: mode 'L'
        return (self.transform(img) if self.transform is not None else img), self.targets[index]


class PILView(Dataset):
    """Items of a dataset as ``(PIL image, label)`` passed through ``transform``, over an optional index subset."""

    def __init__(self, base: Dataset, indices=None, transform: Optional[Callable] = None):
        self.base = base
        self.indices = list(range(len(base))) if indices is None else list(indices)
        self.transform = transform
        self.classes = list(getattr(base, 'classes', None) or [])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        img, target = self.base[self.indices[i]]
        if isinstance(img, torch.Tensor):  # the embedded dataset without a transform gives CHW uint8
            from PIL import Image
            img = Image.fromarray(img.permute(1, 2, 0).numpy())
        return (self.transform(img) if self.transform is not None else img), int(target)


def view_labels(ds: 'PILView') -> List[int]:
    """The label of each item of ``ds``, read from its base's ``targets`` or its image reader's ``samples`` (timm's
    and torchvision's image folders) where it has them, so that no image is decoded; else from the items."""
    base = ds.base
    targets = getattr(base, 'targets', None)
    if targets is None:
        samples = getattr(getattr(base, 'reader', None), 'samples', None)
        samples = samples if samples is not None else getattr(base, 'samples', None)
        if isinstance(samples, (list, tuple)) and getattr(base, 'target_transform', None) is None and all(
                isinstance(s, (list, tuple)) and len(s) == 2 for s in samples):
            targets = [s[1] for s in samples]
    if targets is None:
        return [int(ds[q][1]) for q in range(len(ds))]
    return [int(targets[q]) for q in ds.indices]


def labelled_image(ds: 'PILView', pos: int, label: int):
    """The image of item ``pos`` of ``ds``, checked to come with ``label`` (its label as :func:`view_labels` read
    it). timm's image dataset answers a file it cannot open with the next item, image and label both, so code that
    takes labels from :func:`view_labels` and images from the items would pair one class's label with another's
    image: that is a :class:`DatasetError` naming the file."""
    img, target = ds[pos]
    if int(target) != int(label):
        files = _image_files(ds.base)
        name = files[ds.indices[pos]] if files is not None else f'item {ds.indices[pos]}'
        raise DatasetError(f'{name} (class {label}) could not be read as an image: the dataset gave another '
                           f'class\'s image ({target}) in its place. Remove or replace the file')
    return img


def open_dataset(name: str, root: str = '', split: str = 'train', download: bool = False,
                 class_names: Optional[Sequence[str]] = None,
                 classes_of: str = 'the training split') -> Tuple[Dataset, list]:
    """The whole ``split`` of dataset ``name`` and its class names (see :func:`build_dataset` for the names).

    ``class_names``: the classes the labels must follow, in order (the training split's, or those a checkpoint's
    model was trained on; ``classes_of`` says which, for the error). An image folder labels its class subfolders
    by their sorted names, split by split, so a validation folder that lacks a class would shift the labels after
    it: such a split is opened with the given class map instead, and one with a class outside it is a
    :class:`DatasetError`."""
    base, classes = _open_dataset(name, root, split, download)
    if class_names is None or not classes or list(classes) == list(class_names):
        return base, classes
    where = f'split {split!r} of {root or dataset_label(name)}'
    extra = [c for c in classes if c not in class_names]
    if extra or not hasattr(getattr(base, 'reader', None), 'class_to_idx'):
        raise DatasetError(f'the {where} has the classes {list(classes)}; {classes_of} has {list(class_names)}'
                           + (f': {extra} are not among them' if extra else '')
                           + f'. A split needs the classes of {classes_of}, in their order')
    from timm.data import create_dataset
    base = create_dataset(name, root=root, split=split, is_training=is_train_split(split), download=download,
                          class_map={c: i for i, c in enumerate(class_names)})
    return base, list(class_names)


def _image_files(ds: Dataset) -> Optional[list]:
    """The image files a dataset reads: a timm image folder's ``filenames``, a torchvision ``DatasetFolder``'s (as
    ``torch/folder`` and ``torch/image_folder`` open) ``samples``; None for a dataset of neither kind."""
    files = getattr(ds, 'filenames', None)
    if callable(files):
        return list(files(absolute=True))
    from torchvision.datasets import DatasetFolder
    if isinstance(ds, DatasetFolder):
        return [path for path, _ in ds.samples]
    return None


def shared_files(a: Dataset, b: Dataset) -> int:
    """How many image files datasets ``a`` and ``b`` (timm's or torchvision's image folders) both read; 0 for
    other datasets."""
    fa, fb = _image_files(a), _image_files(b)
    if fa is None or fb is None:
        return 0
    import os
    small, large = sorted((fa, fb), key=len)
    seen = {os.path.abspath(f) for f in small}  # string work only: an ImageNet-size folder costs about a second
    return sum(os.path.abspath(f) in seen for f in large)


def _open_dataset(name: str, root: str, split: str, download: bool) -> Tuple[Dataset, list]:
    import os
    eval_split = not is_train_split(split)
    if name in ('', 'patchshapes') and not (name == '' and root):
        base = PatchShapes('validation' if eval_split else 'train')
    elif name == 'fashion_mnist':
        base = FashionMNISTFiles(root or None, 'test' if eval_split else 'train')
    elif name == 'sklearn_digits':
        base = SklearnDigits(split)
    else:
        from timm.data import create_dataset
        if name == '' and not os.path.isdir(root):
            raise FileNotFoundError(f'--data-dir {root} is not a folder of images')
        try:
            base = create_dataset(name, root=root, split=split, is_training=not eval_split, download=download)
        except (RuntimeError, FileNotFoundError, OSError, AssertionError) as e:
            where = root or '(no --data-dir given)'
            raise FileNotFoundError(
                f'could not open dataset {name!r} split {split!r} at {where}: {e}. Put the data there, download '
                f'it with train.py --dataset-download where a network is available, use --dataset fashion_mnist '
                f'for the IDX files of Debian\'s dataset-fashion-mnist, or leave --dataset unset for the embedded '
                f'patchshapes data') from None
    classes = list(getattr(base, 'classes', None) or [])
    if not classes:
        reader = getattr(base, 'reader', None)
        class_to_idx = getattr(reader, 'class_to_idx', None)
        if class_to_idx:
            classes = [c for c, _ in sorted(class_to_idx.items(), key=lambda kv: kv[1])]
    return base, classes


TRAIN_SPLITS = ('train', 'training')
EVAL_SPLITS = ('validation', 'val', 'valid', 'eval', 'evaluation', 'test')
# datasets of two fixed splits, opened by whether a name is a training one: the embedded data, the IDX files,
# scikit-learn's digits, and the torchvision sets timm opens with a train flag
FIXED_SPLIT_DATASETS = ('patchshapes', 'fashion_mnist', 'sklearn_digits')
FIXED_SPLIT_TORCH = ('cifar10', 'cifar100', 'mnist', 'kmnist', 'fashion_mnist')


def is_train_split(split: str) -> bool:
    """``split`` names a training split (``'train'``, ``'training'``); any other name is an evaluation split."""
    return split in TRAIN_SPLITS


def has_fixed_splits(dataset: str, data_dir: str) -> bool:
    """Whether ``dataset`` (at ``data_dir``) has two fixed splits, a training one and an evaluation one, that every
    split name opens one of (:data:`FIXED_SPLIT_DATASETS`, ``torch/`` sets of :data:`FIXED_SPLIT_TORCH`)."""
    prefix, sep, rest = dataset.partition('/')
    return (dataset in FIXED_SPLIT_DATASETS or (dataset == '' and not data_dir)
            or (bool(sep) and prefix.lower() == 'torch' and rest.lower() in FIXED_SPLIT_TORCH))


def split_name_problem(dataset: str, data_dir: str, split: str, training: bool = False) -> Optional[str]:
    """Why ``split`` cannot name the split a flag wants of a dataset of fixed splits (:func:`has_fixed_splits`),
    or ``None``: a name outside :data:`TRAIN_SPLITS` and :data:`EVAL_SPLITS` (a typo would open the evaluation
    split), or with ``training`` an evaluation name (the images every epoch is evaluated on would be trained on).
    Other datasets name their own splits, which their loaders check."""
    if not has_fixed_splits(dataset, data_dir):
        return None
    name = dataset or 'patchshapes'
    if split not in TRAIN_SPLITS + EVAL_SPLITS:
        return (f'{split!r} is not a split of {name}, which has a training split ({", ".join(TRAIN_SPLITS)}) and '
                f'an evaluation split ({", ".join(EVAL_SPLITS)})')
    if training and not is_train_split(split):
        return (f'{split!r} names the evaluation split of {name}, the images it is evaluated and tested on; train '
                f'on its training split ({", ".join(TRAIN_SPLITS)})')
    return None


def _check_subset(subset) -> None:
    """``subset`` is None or an integer >= 0 (a negative one would slice all but that many images off the end)."""
    if subset is not None and (isinstance(subset, bool) or not isinstance(subset, numbers.Integral) or subset < 0):
        raise ValueError(f'subset must be an integer >= 0 or None (the number of images to keep), got {subset!r}')


def subset_indices(indices, subset: Optional[int], seed: int = 0) -> list:
    """A fixed random ``subset`` of ``indices`` (all of them, in order, when ``subset`` is None or not smaller):
    ``indices[permutation(len(indices), seed)[:subset]]``, the rule of every ``--*-subset`` flag. A ``subset``
    that is not an integer >= 0 is a ``ValueError``."""
    _check_subset(subset)
    indices = list(indices)
    if subset is None or subset >= len(indices):
        return indices
    pick = np.random.default_rng(seed).permutation(len(indices))[:subset]
    return [indices[i] for i in pick.tolist()]


def make_view(base: Dataset, classes, indices=None) -> 'PILView':
    view = PILView(base, indices)
    view.classes = list(classes)
    return view


def build_dataset(name: str, root: str = '', split: str = 'train', download: bool = False,
                  subset: Optional[int] = None, subset_seed: int = 0,
                  class_names: Optional[Sequence[str]] = None, classes_of: str = 'the training split') -> PILView:
    """Open a dataset as a :class:`PILView` with ``classes`` set.

    ``name``: ``''`` or ``'patchshapes'`` (embedded default; with ``''`` and a ``root``, an image folder as in
    timm), ``'fashion_mnist'`` (IDX files from ``root`` or Debian's folder), ``'sklearn_digits'``
    (:class:`SklearnDigits`, from scikit-learn; ``root`` is not used), or any timm dataset name
    (``torch/cifar10``, ``torch/fashion_mnist``, ``hfds/...``, a folder...). ``subset`` keeps a fixed random
    ``subset`` of the items (:func:`subset_indices`). ``class_names``: the training split's classes (or a
    checkpoint's, named by ``classes_of``), which the labels of an evaluation split must follow (see
    :func:`open_dataset`). A ``subset`` that is not an integer
    >= 0 is a ``ValueError``, before the dataset is opened.
    """
    _check_subset(subset)
    base, classes = open_dataset(name, root, split, download, class_names, classes_of)
    indices = None
    if subset is not None and subset < len(base):
        indices = subset_indices(range(len(base)), subset, subset_seed)
    return make_view(base, classes, indices)


def dataset_num_classes(ds: PILView, given: Optional[int] = None) -> int:
    """The number of classes of ``ds``: its class names', or its base's ``num_classes``; for a dataset that tells
    neither (torchvision's INaturalist, timm's hfds/tfds/wds readers without a class map), ``given`` (the
    ``--num-classes`` flag, as timm's train.py takes it), else a :class:`DatasetError` asking for it."""
    if ds.classes:
        return len(ds.classes)
    if hasattr(ds.base, 'num_classes'):
        return int(ds.base.num_classes)
    if given is not None:
        return int(given)
    raise DatasetError('cannot tell the number of classes of this dataset (it has no class names); pass '
                       '--num-classes')


def default_crop_padding(img_size: int) -> int:
    """The reflect padding of the small-image random crop: an eighth of the side (4 at 32x32, as for CIFAR)."""
    return img_size // 8


@dataclass(frozen=True)
class Augment:
    """The training augmentation of timm's flags (``--no-aug``, ``--scale``, ``--ratio``, ``--hflip``, ``--vflip``,
    ``--color-jitter``, ``--aa``, ``--reprob``/``--remode``/``--recount``, ``--train-interpolation``), with
    timm's train.py defaults (:class:`~timm_patchmix.engine.TrainConfig` takes its fields and defaults from here).
    ``None`` is timm's value on timm's transform (``scale`` (0.08, 1), ``ratio`` (3/4, 4/3), ``color_jitter`` 0.4,
    ``train_interpolation`` 'random') and off on the CIFAR-style one. Random erasing belongs to the tensor
    transform without the prefetcher; with it, to timm's ``PrefetchLoader`` (:meth:`prefetch_erasing`)."""
    no_aug: bool = False
    scale: Optional[Tuple[float, float]] = None
    ratio: Optional[Tuple[float, float]] = None
    hflip: float = 0.5
    vflip: float = 0.0
    color_jitter: Optional[float] = None
    aa: Optional[str] = None
    reprob: float = 0.0
    remode: str = 'pixel'
    recount: int = 1
    train_interpolation: Optional[str] = None

    def prefetch_erasing(self) -> dict:
        """The random-erasing arguments of timm's ``PrefetchLoader`` for the training loader (none with
        ``no_aug``, as timm's ``create_loader``)."""
        return dict(re_prob=0.0 if self.no_aug else self.reprob, re_mode=self.remode, re_count=self.recount)


def small_image_transform(img_size: int, is_training: bool, in_chans: int, use_prefetcher: bool,
                          mean, std, crop_padding: Optional[int] = None, augment: Optional[Augment] = None):
    """CIFAR-style transform for small images: resize to ``img_size`` if needed, then (training) a random crop
    with reflect padding, the flips, timm's AutoAugment/RandAugment/AugMix policy (``--aa``) and colour jitter
    when ``augment`` asks for them (by default the crop and a horizontal flip of probability 0.5; none with
    ``no_aug``). Ends in uint8 CHW numpy for the prefetcher, or a normalised tensor (then randomly erased when
    ``augment.reprob``)."""
    from torchvision import transforms as T
    from timm.data.loader import adapt_to_chs
    from timm.data.transforms import ToNumpy
    aug = augment or Augment()
    ops = [T.Lambda(_ImageMode(in_chans))]
    ops.append(T.Resize(img_size, interpolation=T.InterpolationMode.BILINEAR))
    ops.append(T.CenterCrop(img_size))
    training = is_training and not aug.no_aug
    if training:
        pad = default_crop_padding(img_size) if crop_padding is None else crop_padding
        ops.append(T.RandomCrop(img_size, padding=pad, padding_mode='reflect'))
        if aug.hflip > 0:
            ops.append(T.RandomHorizontalFlip(aug.hflip))
        if aug.vflip > 0:
            ops.append(T.RandomVerticalFlip(aug.vflip))
        if aug.aa:  # its geometric ops interpolate as timm's default (bilinear or bicubic at random)
            ops.append(_policy(aug.aa, img_size, adapt_to_chs(mean, in_chans)))
        if aug.color_jitter and not (aug.aa and '3a' not in aug.aa):  # timm's rule: no jitter beside a policy
            ops.append(T.ColorJitter(*(float(aug.color_jitter),) * 3))
    if use_prefetcher:
        ops.append(ToNumpy())
    else:
        ops += [T.ToTensor(), T.Normalize(adapt_to_chs(mean, in_chans), adapt_to_chs(std, in_chans))]
        if training and aug.reprob > 0:
            from timm.data.random_erasing import RandomErasing
            ops.append(RandomErasing(aug.reprob, mode=aug.remode, max_count=aug.recount, device='cpu'))
    return T.Compose(ops)


def _policy(aa: str, img_size: int, mean):
    """timm's transform for the policy string ``aa``, with the parameters timm's ``create_transform`` gives it
    under its default 'random' interpolation (translation up to 0.45 of the side, the mean colour as fill)."""
    from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
    params = dict(translate_const=int(img_size * 0.45), img_mean=tuple(min(255, round(255 * m)) for m in mean))
    if aa.startswith('rand'):
        return rand_augment_transform(aa, params)
    if aa.startswith('augmix'):
        return augment_and_mix_transform(aa, dict(params, translate_pct=0.3))
    return auto_augment_transform(aa, params)


class _ImageMode:
    """PIL image -> 'L' for one channel, 'RGB' otherwise (a picklable transform step for loader workers)."""

    def __init__(self, in_chans: int):
        self.mode = 'L' if in_chans == 1 else 'RGB'

    def __call__(self, img):
        return img.convert(self.mode)


def image_transform(input_size, is_training: bool, use_prefetcher: bool, mean, std,
                    interpolation: str = 'bilinear', crop_pct: Optional[float] = None,
                    augment: Optional[Augment] = None):
    """The transform ``train.py`` gives images of ``input_size`` ``(C, H, W)``: for a square input of at most 64 px
    the CIFAR-style :func:`small_image_transform`, else timm's ``create_transform`` (``crop_pct`` and
    ``interpolation`` as the model's data config says; in training, ``augment``'s flags with timm's defaults and
    timm's ``--train-interpolation`` rule), after the image is made greyscale or RGB for ``C``."""
    in_chans, h, w = input_size
    if max(h, w) <= 64 and h == w:  # the CIFAR-style crop and flip is square; other shapes get timm's transforms
        return small_image_transform(h, is_training, in_chans, use_prefetcher, mean, std, augment=augment)
    from timm.data import create_transform
    from timm.data.loader import adapt_to_chs
    from torchvision import transforms as T
    mean, std = adapt_to_chs(mean, in_chans), adapt_to_chs(std, in_chans)  # (a model's 3 values, 1-channel data)
    if is_training:
        aug = augment or Augment()
        # timm's train.py: the training interpolation is 'random' unless given, the model's with --no-aug
        train_interp = interpolation if aug.no_aug else (aug.train_interpolation or 'random')
        extra = dict(no_aug=aug.no_aug, scale=aug.scale, ratio=aug.ratio, hflip=aug.hflip, vflip=aug.vflip,
                     color_jitter=0.4 if aug.color_jitter is None else aug.color_jitter, auto_augment=aug.aa,
                     re_prob=aug.reprob, re_mode=aug.remode, re_count=aug.recount, interpolation=train_interp)
    else:
        extra = dict(crop_pct=crop_pct, interpolation=interpolation)
    return T.Compose([_ImageMode(in_chans),
                      create_transform(tuple(input_size), is_training=is_training, use_prefetcher=use_prefetcher,
                                       mean=mean, std=std, **extra)])


# the data config a checkpoint records and a model's pretrained cfg carries, as timm names it
DATA_CONFIG_KEYS = ('input_size', 'mean', 'std', 'interpolation', 'crop_pct')


def recorded_data_config(data: dict, model: torch.nn.Module) -> dict:
    """A checkpoint's ``data`` record with its ``input_size``, ``mean``, ``std``, ``interpolation`` and ``crop_pct``
    completed from ``model``'s data config, as ``train.py`` took them, for checkpoints written before all of these
    were recorded. Evaluation outside ``train.py`` (FGSM, the search) makes its pixels with these."""
    from timm.data import resolve_data_config
    cfg = resolve_data_config({}, model=model)
    return channel_matched(dict(data, **{k: data.get(k) or cfg[k] for k in DATA_CONFIG_KEYS}))


def channel_matched(data: dict) -> dict:
    """A data config (a checkpoint's ``data`` record) whose ``mean`` and ``std`` have one value per channel of its
    ``input_size``, by timm's loader's rule (``adapt_to_chs``: another count averaged): files of greyscale runs
    written before train.py recorded the values it normalised with hold the model's three."""
    from timm.data.loader import adapt_to_chs
    if not data.get('input_size'):
        return dict(data)
    chans = int(data['input_size'][0])
    return dict(data, **{k: [float(v) for v in adapt_to_chs(tuple(data[k]), chans)]
                         for k in ('mean', 'std') if data.get(k)})


def pixel_transform(in_chans: int, height: int, width: int, interpolation: str = 'bilinear',
                    crop_pct: Optional[float] = None):
    """PIL image -> float tensor ``[in_chans, height, width]`` in [0, 1]: the evaluation transform of
    :func:`image_transform` without its normalisation, so ``(pixels - mean) / std`` is what validation feeds the
    model (FGSM perturbs these pixels; the search scores them)."""
    return image_transform((in_chans, height, width), False, False, (0.0,) * in_chans, (1.0,) * in_chans,
                           interpolation, crop_pct)


def dataset_label(dataset: str, data_dir: str = '') -> str:
    """The data a run used, in words: the dataset's name, ``the image folder <dir>`` for a folder read with no
    ``--dataset``, or ``patchshapes`` (the embedded set) for neither."""
    if dataset:
        return dataset
    return f'the image folder {data_dir}' if data_dir else 'patchshapes'
