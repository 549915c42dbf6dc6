"""FastCollatePatchMix equals the tensor mixer and plugs into timm's loader."""
import functools

import numpy as np
import pytest
import torch
from timm.data import FastCollateMixup, create_loader

from timm_patchmix import FastCollatePatchMix, PatchMix, PatchMixParams, split_target
from timm_patchmix.collate import FastCollateGuidedPatchMix
from timm_patchmix.data import PatchShapes
from timm_patchmix.guided import MaskTable


def make_batch(n, shape=(3, 10, 13), as_numpy=True, seed=0):
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    labels = rng.integers(0, 7, n).tolist()
    return [(imgs[i] if as_numpy else torch.from_numpy(imgs[i].copy()), labels[i]) for i in range(n)], imgs, labels


@pytest.mark.parametrize('mode', ['elem', 'pair', 'batch'])
@pytest.mark.parametrize('as_numpy', [True, False])
@pytest.mark.parametrize('n', [1, 5, 8])
def test_collate_equals_tensor_path(mode, as_numpy, n):
    batch, imgs, labels = make_batch(n, as_numpy=as_numpy)
    collate = FastCollatePatchMix(grid=(4, 3), mode=mode, label_smoothing=0.1, num_classes=7)
    assert isinstance(collate, FastCollateMixup)
    params = collate.sample(n, generator=torch.Generator().manual_seed(n))
    images, packed = collate.apply(batch, params)
    assert images.dtype == torch.uint8 and images.shape == (n, 3, 10, 13)

    mixer = PatchMix(grid=(4, 3), mode=mode, label_smoothing=0.1, num_classes=7)
    x = torch.from_numpy(imgs.copy())
    ref_images, ref_packed = mixer.apply(x, torch.tensor(labels), params)
    assert torch.equal(images, ref_images)
    assert torch.equal(packed, ref_packed)
    # the source arrays are never written
    assert np.array_equal(np.stack([np.asarray(b[0]) for b in batch]), imgs)


def test_collate_call_and_disable():
    batch, imgs, labels = make_batch(6)
    collate = FastCollatePatchMix(num_classes=7)
    images, packed = collate(batch)
    image_t, patch_t = split_target(packed, 4)
    assert image_t.shape == (6, 7) and patch_t.shape == (6, 16, 7)
    torch.testing.assert_close(image_t.sum(1), torch.ones(6))
    collate.mixup_enabled = False
    images, packed = collate(batch)
    assert torch.equal(images, torch.from_numpy(imgs))
    assert torch.equal(split_target(packed)[0].argmax(1), torch.tensor(labels))


def test_collate_errors():
    collate = FastCollatePatchMix(num_classes=7)
    with pytest.raises(ValueError, match='uint8'):
        collate([(np.zeros((3, 8, 8), np.float32), 0)])
    with pytest.raises(ValueError, match='image 1 has shape'):
        collate([(np.zeros((3, 8, 8), np.uint8), 0), (np.zeros((3, 9, 8), np.uint8), 1)])
    with pytest.raises(ValueError, match='labels must lie'):
        collate([(np.zeros((3, 8, 8), np.uint8), 9)])
    with pytest.raises(ValueError, match='does not fit'):
        collate([(np.zeros((3, 2, 8), np.uint8), 1)])


def test_timm_create_loader_and_prefetcher_switch():
    ds = PatchShapes('train', num_samples=16)
    collate = FastCollatePatchMix(num_classes=ds.num_classes)
    loader = create_loader(ds, input_size=(3, 32, 32), batch_size=8, is_training=True, collate_fn=collate,
                           device=torch.device('cpu'), num_workers=0, persistent_workers=False, hflip=0.0,
                           color_jitter=0.0, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    x, packed = next(iter(loader))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    image_t, _ = split_target(packed)
    assert (image_t.max(1).values < 1).any(), 'some samples are mixed'
    loader.mixup_enabled = False
    assert collate.mixup_enabled is False
    _, packed = next(iter(loader))
    assert (split_target(packed)[0].max(1).values == 1).all()


class _Reporting:
    """A collate_fn that runs ``fn(batch) -> (images, packed)`` and also reports whether the batch was made in
    shared memory and whether it ran in a DataLoader worker."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, batch):
        images, packed = self.fn(batch)
        return images, packed, images.is_shared(), torch.utils.data.get_worker_info() is not None


def test_collate_in_worker_stacks_into_shared_memory():
    """In a DataLoader worker the batch is stacked straight into shared memory (sending it then copies nothing);
    in the main process it is private. Pixels and targets are the same either way."""
    n = 8
    batch, imgs, _ = make_batch(n)
    collate = FastCollatePatchMix(grid=(4, 3), num_classes=7)
    params = collate.sample(n, generator=torch.Generator().manual_seed(3))
    fn = _Reporting(functools.partial(collate.apply, params=params))
    ref_images, ref_packed, ref_shared, ref_worker = fn(batch)
    assert not ref_worker and not ref_shared
    assert (ref_images != torch.from_numpy(imgs)).any(), 'the params mix some cells'

    loader = torch.utils.data.DataLoader(batch, batch_size=n, num_workers=1, collate_fn=fn)
    images, packed, shared, in_worker = next(iter(loader))
    assert in_worker and shared
    assert torch.equal(images, ref_images) and torch.equal(packed, ref_packed)


def test_guided_collate_in_worker_stacks_into_shared_memory():
    """The guided collate stacks the same way: private in the main process, shared in a worker."""
    n = 8
    batch, _, _ = make_batch(n)
    rng = np.random.default_rng(0)
    table = MaskTable((4, 3), 7, [str(c) for c in range(7)], 'fp', [(0, 1)], [rng.random((4, 3)) < 0.5], [0.1], 0.1)
    fn = _Reporting(FastCollateGuidedPatchMix(table, num_classes=7))
    _, _, ref_shared, ref_worker = fn(batch)
    assert not ref_worker and not ref_shared
    loader = torch.utils.data.DataLoader(batch, batch_size=n, num_workers=1, collate_fn=fn)
    x, packed, shared, in_worker = next(iter(loader))
    assert in_worker and shared and x.shape == (n, 3, 10, 13) and packed.shape[0] == n


def test_guided_collate_does_not_draw_params_apart_from_the_batch():
    """The guided collate inherited sample/apply from the random collate, so `col.apply(batch, col.sample(B))`
    gave Random PatchMix batches without a word; guided params come from the batch's labels and the class memory,
    so both are now a TypeError that says how to get guided batches, and the call stays guided."""
    n = 8
    batch, _, _ = make_batch(n)
    table = MaskTable((4, 3), 7, [str(c) for c in range(7)], 'fp', [(0, 1)], [np.ones((4, 3), bool)], [0.1], 0.1)
    col = FastCollateGuidedPatchMix(table, num_classes=7, guided_prob=0.0, random_prob=0.0)
    for call in (lambda: col.sample(n), lambda: col.apply(batch, PatchMixParams.identity(n, (4, 3)))):
        with pytest.raises(TypeError, match=r'a guided batch\'s params come from its labels and the class memory'):
            call()
    images, packed = col(batch)  # no guided or random share: every sample clean
    clean, _ = FastCollatePatchMix(grid=(4, 3), num_classes=7, prob=0.0)(batch)
    assert torch.equal(images, clean)


def test_labels_that_are_no_class_indices_are_named():
    """String or None labels ended in torch's 'too many dimensions' or dtype errors that name no label."""
    batch, _, _ = make_batch(3)
    for bad in ('cat', None):
        labelled = [(img, bad if i == 1 else y) for i, (img, y) in enumerate(batch)]
        with pytest.raises(ValueError, match=f'collate expects class-index labels, got {type(bad).__name__} '
                                             f'{bad!r} at index 1'):
            FastCollatePatchMix(num_classes=7)(labelled)


def test_samples_with_further_fields_collate_as_timm_reads_them():
    """timm's collates read a sample's first two fields (a dataset may append an index or a path); the collate-mixer
    took only (image, label) pairs and failed with Python's unpacking error."""
    batch, imgs, labels = make_batch(4)
    extended = [(img, y, f'path{i}', i) for i, (img, y) in enumerate(batch)]
    collate = FastCollatePatchMix(grid=2, num_classes=7)
    params = collate.sample(4, generator=torch.Generator().manual_seed(3))
    images, packed = collate.apply(extended, params)
    ref_images, ref_packed = collate.apply(batch, params)
    assert torch.equal(images, ref_images) and torch.equal(packed, ref_packed)
    assert torch.equal(FastCollateMixup(mixup_alpha=1.0, num_classes=7, prob=0.0)(extended)[0],
                       torch.from_numpy(imgs))  # timm's reads the same batch
    for bad, what in (([(imgs[0],)], 'a tuple of 1'), ([imgs[0]], 'ndarray'), (['ab'], 'str')):
        with pytest.raises(ValueError, match=f'collate expects \\(image, label, ...\\) samples, got {what} at index 0'):
            collate(bad)
    with pytest.raises(ValueError, match='collate expects CHW numpy arrays or tensors, got tuple at index 0'):
        collate([((imgs[0], imgs[1]), 0)])  # e.g. a split of augmented views, which this collate does not take


def test_timm_settings_changed_on_the_collate_take_effect():
    """timm's FastCollateMixup reads mode, mix_prob, label_smoothing and num_classes at every call; the collate-mixer
    set them on itself at construction and then ignored them (only mixup_enabled reached the mixer), so a changed
    setting silently gave the old mix. They are now the mixer's, checked when set."""
    batch, _, _ = make_batch(6)
    col = FastCollatePatchMix(grid=(4, 3), num_classes=7, mode='elem', prob=1.0)
    assert (col.mode, col.mix_prob, col.label_smoothing, col.num_classes) == ('elem', 1.0, 0.0, 7)
    col.mode, col.mix_prob, col.label_smoothing = 'pair', 0.5, 0.3
    ref = FastCollatePatchMix(grid=(4, 3), num_classes=7, mode='pair', prob=0.5, label_smoothing=0.3)
    params = col.sample(6, generator=torch.Generator().manual_seed(1))
    ref_params = ref.sample(6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(params.partner, ref_params.partner) and torch.equal(params.mask, ref_params.mask)
    images, packed = col.apply(batch, params)
    ref_images, ref_packed = ref.apply(batch, ref_params)
    assert torch.equal(images, ref_images) and torch.equal(packed, ref_packed)
    assert split_target(packed)[0].min() > 0  # smoothed: no class has probability 0

    col.mix_prob = 0.0
    images, packed = col(batch)
    assert torch.equal(images, torch.from_numpy(np.stack([b[0] for b in batch])))
    assert torch.equal(packed[:, 2], torch.ones(6))  # lam 1: nothing mixed

    col.num_classes = 9
    assert split_target(col(batch)[1])[0].shape == (6, 9)
    for name, bad, words in (('mode', 'bogus', 'mode must be one of'), ('mix_prob', 1.5, 'prob must be a finite'),
                             ('label_smoothing', 1.0, 'label_smoothing must be'),
                             ('num_classes', 0, 'num_classes must be a positive int')):
        before = getattr(col, name)
        with pytest.raises(ValueError, match=words):
            setattr(col, name, bad)
        assert getattr(col, name) == before  # the mixer keeps its setting


def test_mixer_settings_are_checked_when_changed():
    """Setting PatchMix.mode to an unknown value ran pair mode without a word; every setting the constructor
    checks is now checked when changed."""
    mixer = PatchMix(grid=2, num_classes=3)
    for name, bad in (('mode', 'Elem'), ('prob', -0.1), ('label_smoothing', float('nan')), ('num_classes', 2.5)):
        with pytest.raises(ValueError, match=f'{name} must be'):
            setattr(mixer, name, bad)
    assert (mixer.mode, mixer.prob, mixer.label_smoothing, mixer.num_classes) == ('elem', 1.0, 0.0, 3)
    mixer.mode, mixer.prob = 'batch', 0.25
    assert repr(mixer) == ("PatchMix(grid=(2, 2), alpha=1.0, prob=0.25, mode='batch', label_smoothing=0.0, "
                           "num_classes=3)")


def test_guided_collate_settings_are_its_guided_mixers():
    """On the guided collate, label_smoothing smooths every sample's labels (those of the guided mixer, which makes
    the batch); num_classes is the mask table's."""
    batch, _, _ = make_batch(8)
    table = MaskTable((4, 3), 7, [str(c) for c in range(7)], 'fp', [(0, 1)], [np.ones((4, 3), bool)], [0.1], 0.1)
    col = FastCollateGuidedPatchMix(table, num_classes=7, guided_prob=0.0, random_prob=0.0)
    assert (col.mode, col.mix_prob, col.label_smoothing, col.num_classes) == ('elem', 1.0, 0.0, 7)
    _, packed = col(batch)
    assert split_target(packed)[0].max() == 1.0
    col.label_smoothing = 0.7
    _, packed = col(batch)
    assert torch.allclose(split_target(packed)[0].max(1).values, torch.full((8,), 0.3 + 0.7 / 7))
    assert col.guided.mixer.label_smoothing == 0.7
    with pytest.raises(ValueError, match=r'num_classes is that of the mask table \(7\), got 9'):
        col.num_classes = 9
    col.num_classes = 7


def test_numpy_views_with_negative_strides_collate():
    """A flipped numpy view (negative strides, as np.flip gives) was refused by torch.from_numpy; timm's collates
    copy it."""
    batch, imgs, _ = make_batch(3)
    flipped = [(np.flip(img, 2), y) for img, y in batch]
    col = FastCollatePatchMix(grid=2, num_classes=7)
    params = col.sample(3, generator=torch.Generator().manual_seed(0))
    images, packed = col.apply(flipped, params)
    ref, ref_packed = col.apply([(img[:, :, ::-1].copy(), y) for img, y in batch], params)
    assert torch.equal(images, ref) and torch.equal(packed, ref_packed)
    assert torch.equal(col.stack(flipped)[0], torch.from_numpy(imgs[:, :, :, ::-1].copy()))
