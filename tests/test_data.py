"""The dataset readers and the training engine's data path: damaged or mismatched IDX files, image folders whose
splits disagree on their classes or share their images, and input sizes the transforms must give exactly."""
import dataclasses
import gzip
import os

import numpy as np
import pytest
import torch
from PIL import Image

import timm_patchmix  # noqa: F401
from timm_patchmix.data import DatasetError, FashionMNISTFiles, build_dataset, read_idx
from timm_patchmix.engine import DataConfig, TrainSetupError
from timm_patchmix.engine.loaders import _transforms, build_datasets
from timm_patchmix.train import cli, parse_config

TINY = ['--train-subset', '16', '--val-subset', '8', '-b', '8', '-j', '0', '--no-progress', '--epochs', '1']


def write_idx(path, array, gz=True):
    array = np.asarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b''.join(int(d).to_bytes(4, 'big') for d in array.shape)
    with (gzip.open if gz else open)(path, 'wb') as f:
        f.write(header + array.tobytes())


def fmnist(folder, n_images=12, n_labels=12, labels=None):
    """Fashion-MNIST-shaped IDX files: image k is filled with the value k, its label k % 10."""
    os.makedirs(folder, exist_ok=True)
    images = np.stack([np.full((28, 28), k, dtype=np.uint8) for k in range(n_images)])
    labels = np.arange(n_labels) % 10 if labels is None else np.asarray(labels)
    for split, stem in (('train', 'train'), ('test', 't10k')):
        write_idx(os.path.join(folder, f'{stem}-images-idx3-ubyte.gz'), images)
        write_idx(os.path.join(folder, f'{stem}-labels-idx1-ubyte.gz'), labels)
    return str(folder)


def test_fashion_mnist_files_are_read_exactly(tmp_path):
    ds = FashionMNISTFiles(fmnist(tmp_path / 'ok'), 'train')
    assert len(ds) == 12 and ds.targets == [k % 10 for k in range(12)]
    img, label = ds[7]
    assert label == 7 and np.array_equal(np.asarray(img), np.full((28, 28), 7, dtype=np.uint8))


@pytest.mark.parametrize('case, message', [
    ('fewer labels', r'holds 12 images and .*10 labels: the files come from different splits'),
    ('more labels', r'holds 12 images and .*14 labels'),
    ('label 10', r'holds the label 10; Fashion-MNIST has 10 classes'),
    ('truncated gzip', r'is damaged \(truncated or not gzip data'),
    ('not gzip', r'is damaged \(truncated or not gzip data'),
    ('not idx', r'is not an unsigned-byte IDX file'),
    ('header cut short', r'is truncated: its header names 3 dimensions, but the file ends after 6 bytes'),
    ('labels 2-d', r'must hold images \[N, H, W\] and labels \[N\]'),
])
def test_damaged_or_mismatched_fashion_mnist_files_are_named(tmp_path, case, message, capsys):
    root = tmp_path / 'fm'
    if case == 'fewer labels':
        fmnist(root, n_labels=10)
    elif case == 'more labels':
        fmnist(root, n_labels=14)
    elif case == 'label 10':
        fmnist(root, labels=[10] + [0] * 11)
    elif case == 'labels 2-d':
        fmnist(root)
        write_idx(root / 'train-labels-idx1-ubyte.gz', np.zeros((12, 1)))
    else:
        fmnist(root)
        path = root / 'train-images-idx3-ubyte.gz'
        data = path.read_bytes()
        path.write_bytes({'truncated gzip': data[:len(data) // 2], 'not gzip': b'plain bytes, not gzip',
                          'not idx': gzip.compress(b'\x01\x02\x03\x04' + data[4:]),
                          'header cut short': gzip.compress(b'\x00\x00\x08\x03\x00\x00')}[case])
    with pytest.raises(DatasetError, match=message):
        FashionMNISTFiles(str(root), 'train')
    # train.py: one error line and exit 1, and no run folder
    with pytest.raises(SystemExit) as e:
        cli(TINY + ['--dataset', 'fashion_mnist', '--data-dir', str(root), '--output', str(tmp_path / 'out'),
                    '--experiment', 'x'])
    assert str(e.value).startswith('error: ') and 'Traceback' not in capsys.readouterr().err
    assert not os.path.exists(tmp_path / 'out' / 'x')


def test_read_idx_reads_plain_and_gzipped_files(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / 'a', a, gz=False)
    write_idx(tmp_path / 'a.gz', a)
    assert np.array_equal(read_idx(str(tmp_path / 'a')), a) and np.array_equal(read_idx(str(tmp_path / 'a.gz')), a)


def image_folder(root, splits):
    """``splits``: {split: [class names]}, two images per class; an image's pixel value names its class."""
    value = {}
    for split, classes in splits.items():
        for c in classes:
            d = os.path.join(root, split, c) if split else os.path.join(root, c)
            os.makedirs(d, exist_ok=True)
            v = value.setdefault(c, 40 * (len(value) + 1))
            for i in range(2):
                Image.new('RGB', (8, 8), (v, v, v)).save(os.path.join(d, f'{i}.png'))
    return str(root), value


def test_a_validation_folder_missing_a_class_keeps_the_training_labels(tmp_path):
    root, value = image_folder(tmp_path / 'f', {'train': ['ant', 'bee', 'cat'], 'validation': ['ant', 'cat']})
    data = build_datasets(parse_config(['--data-dir', root]))
    assert data.train.classes == ['ant', 'bee', 'cat'] and data.val.classes == ['ant', 'bee', 'cat']
    names = data.train.classes
    for ds in (data.train, data.val):  # every image's label names the class its pixels say
        for k in range(len(ds)):
            img, label = ds[k]
            assert np.asarray(img)[0, 0, 0] == value[names[label]]
    assert sorted(data.val[k][1] for k in range(len(data.val))) == [0, 0, 2, 2]
    # the same for a split opened by name with the training classes (search, robustness)
    val = build_dataset('', root, 'validation', class_names=names)
    assert sorted(val[k][1] for k in range(len(val))) == [0, 0, 2, 2]


def test_a_validation_class_the_training_split_lacks_is_refused(tmp_path, capsys):
    root, _ = image_folder(tmp_path / 'f', {'train': ['ant', 'cat'], 'validation': ['ant', 'bee', 'cat']})
    with pytest.raises(TrainSetupError,
                       match=r"split 'validation' .*; the training split has .*\['bee'\] are not among them"):
        build_datasets(parse_config(['--data-dir', root]))


def test_a_dataset_without_class_names_takes_num_classes(tmp_path):
    """torchvision's INaturalist names no classes: --num-classes gives their number, as in timm's train.py;
    without it, one error asking for it."""
    kinds = ['00000_Animalia_Chordata_Aves_O_F_G_alpha', '00001_Plantae_Tracheophyta_M_O_F_G_beta']
    root, value = image_folder(tmp_path / 'inat', {'2021_train': kinds, '2021_valid': kinds})
    args = ['--dataset', 'torch/inaturalist', '--data-dir', root]
    with pytest.raises(TrainSetupError, match=r'cannot tell the number of classes .*; pass --num-classes'):
        build_datasets(parse_config(args))
    data = build_datasets(parse_config(args + ['--num-classes', '2']))
    assert data.num_classes == 2 and len(data.train) == 4 and len(data.val) == 4
    for ds in (data.train, data.val):  # each label is its folder's
        assert sorted((ds[k][1], np.asarray(ds[k][0])[0, 0, 0]) for k in range(4)) == \
            [(0, value[kinds[0]])] * 2 + [(1, value[kinds[1]])] * 2


@pytest.mark.parametrize('dataset', ['', 'torch/folder', 'torch/image_folder'])
@pytest.mark.parametrize('holdout', [False, True])
def test_a_folder_without_split_subfolders_is_not_its_own_validation_set(tmp_path, holdout, dataset):
    """timm's image folder and torchvision's (``torch/folder``), read whole for each split."""
    root, _ = image_folder(tmp_path / 'flat', {'': ['ant', 'bee']})
    args = ['--data-dir', root, '--dataset', dataset] + (['--holdout', '0.5', '--val-split', 'test'] if holdout else [])
    with pytest.raises(TrainSetupError, match=r'shares 4 image files with the training split') as e:
        build_datasets(parse_config(args))
    # (--holdout was offered as a remedy; its test split, the folder again, is refused alike)
    assert '--holdout F' not in str(e.value) and '--holdout does not help' in str(e.value)
    # with split subfolders the splits are disjoint and accepted
    root, _ = image_folder(tmp_path / 'split', {'train': ['ant', 'bee'], 'validation': ['ant', 'bee']})
    data = build_datasets(parse_config(['--data-dir', root, '--dataset', dataset]))
    assert len(data.train) == 4 and len(data.val) == 4


@pytest.mark.parametrize('input_size', [(3, 32, 48), (3, 48, 32), (3, 32, 32), (3, 72, 72), (1, 30, 20)])
@pytest.mark.parametrize('prefetch', [True, False])
def test_transforms_give_the_input_size_of_the_data_config(input_size, prefetch):
    """Training and evaluation images come out at exactly the (channels, height, width) the run records, for a
    greyscale source too; a square input of at most 64 px takes the CIFAR-style path, any other timm's."""
    cfg = parse_config([] if prefetch else ['--no-prefetcher'])
    c = input_size[0]
    cfg = dataclasses.replace(cfg, data_config=DataConfig(input_size, (0.5,) * c, (0.25,) * c, 'bilinear', 0.875))
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8), mode='L')
    for t in _transforms(cfg):
        out = np.asarray(t(img))
        assert out.shape == input_size, (t, out.shape)


def test_a_greyscale_runs_data_config_holds_the_values_it_normalises_with():
    """--in-chans 1 on a model with three means and stds: the resolved data config (which args.yaml and the weights
    files record, and which timm's data config check reads back) holds their averages, one per channel."""
    import timm
    from timm_patchmix.engine.loaders import resolve_data
    model = timm.create_model('resnet8_cifar', in_chans=1)
    mean, std = model.pretrained_cfg['mean'], model.pretrained_cfg['std']
    dc = resolve_data(parse_config(['--model', 'resnet8_cifar', '--in-chans', '1']), model)
    assert dc.input_size == (1, 32, 32)
    assert dc.mean == pytest.approx((sum(mean) / 3,)) and dc.std == pytest.approx((sum(std) / 3,))
    dc = resolve_data(parse_config(['--model', 'resnet8_cifar', '--in-chans', '1', '--mean', '0.5']), model)
    assert dc.mean == (0.5,)


@pytest.mark.parametrize('input_size', [(1, 72, 72), (1, 32, 48), (1, 32, 32)])
@pytest.mark.parametrize('is_training', [False, True])
def test_greyscale_inputs_take_the_mean_of_the_models_three_values_on_every_path(input_size, is_training):
    """--in-chans 1 on a model whose data config has 3 means and stds: each transform without the prefetcher
    normalises the one channel by their averages (the prefetcher and the small-image path did already; timm's
    transform failed on the shapes)."""
    from timm_patchmix.data import Augment, image_transform
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 52), dtype=np.uint8), mode='L')
    aug = Augment(no_aug=True)  # (no random crop or flip: the pixels of each call are the same)
    out = image_transform(input_size, is_training, False, mean, std, crop_pct=1.0, augment=aug)(img)
    pixels = image_transform(input_size, is_training, False, (0.0,), (1.0,), crop_pct=1.0, augment=aug)(img)
    assert out.shape == input_size
    torch.testing.assert_close(out, (pixels - np.mean(mean)) / np.mean(std), rtol=0, atol=1e-5)


@pytest.mark.parametrize('input_size, interpolation, crop_pct', [
    ((3, 32, 32), 'bilinear', 1.0), ((3, 32, 48), 'bicubic', 0.9), ((3, 96, 96), 'bicubic', 0.875),
    ((1, 80, 64), 'bilinear', 0.95)])
def test_pixels_of_fgsm_and_search_are_validation_pixels_before_normalisation(input_size, interpolation, crop_pct):
    """FGSM perturbs, and the search scores, ``pixel_transform``'s pixels: normalised, they must be exactly what
    validation feeds the model, at every size and shape (a non-square 120x160 source image here)."""
    from timm_patchmix.data import image_transform, pixel_transform
    c = input_size[0]
    mean, std = (0.2, 0.4, 0.6)[:c], (0.3, 0.2, 0.25)[:c]
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    val = image_transform(input_size, False, False, mean, std, interpolation, crop_pct)(img)
    pixels = pixel_transform(*input_size, interpolation, crop_pct)(img)
    assert pixels.shape == input_size and 0 <= pixels.min() and pixels.max() <= 1
    normalised = (pixels - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)
    assert torch.allclose(normalised, val, rtol=0, atol=1e-6), (normalised - val).abs().max()


def test_a_checkpoint_without_a_resize_record_takes_the_models_data_config():
    """FGSM and the search make their pixels from one helper: what the checkpoint records, else the model's config."""
    import timm
    from timm_patchmix.data import recorded_data_config
    model = timm.create_model('patchhead_resnet18', num_classes=3, pretrained_cfg_overlay=dict(
        interpolation='bicubic', crop_pct=0.8, input_size=(3, 40, 40), mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2)))
    old = recorded_data_config({'dataset': 'x'}, model)
    assert (old['dataset'], tuple(old['input_size']), old['interpolation'], old['crop_pct']) == (
        'x', (3, 40, 40), 'bicubic', 0.8)
    assert tuple(old['mean']) == (0.5, 0.5, 0.5) and tuple(old['std']) == (0.2, 0.2, 0.2)
    rec = {'input_size': [1, 28, 28], 'mean': [0.3], 'std': [0.4], 'interpolation': 'bilinear', 'crop_pct': 1.0}
    assert recorded_data_config(rec, model) == rec


def test_view_labels_read_the_folder_readers_without_decoding_an_image(tmp_path, monkeypatch):
    """The labels of a view (a subset, a validation folder labelled with the training classes) from the image
    reader's samples, equal to the items' own, with no image decoded (the guided-samples figure read every
    training image of an image folder one by one)."""
    from PIL import Image
    from timm_patchmix.data import PILView, build_dataset, view_labels
    for split, classes in (('train', 'abc'), ('validation', 'ac')):
        for c in classes:
            os.makedirs(tmp_path / split / c)
            for i in range(3):
                Image.new('RGB', (4, 4), (i, 0, 0)).save(tmp_path / split / c / f'{i}.png')
    train = build_dataset('', str(tmp_path), 'train', subset=5, subset_seed=1)
    val = build_dataset('', str(tmp_path), 'validation', class_names=train.classes)
    want = [[int(ds[q][1]) for q in range(len(ds))] for ds in (train, val)]
    assert sorted(set(want[1])) == [0, 2]

    def decoded(self, i):
        raise AssertionError('an image was decoded')
    monkeypatch.setattr(PILView, '__getitem__', decoded)
    assert [view_labels(train), view_labels(val)] == want
