"""timm's augmentation flags (``--no-aug``, ``--scale``, ``--ratio``, ``--hflip``, ``--vflip``, ``--color-jitter``,
``--aa``, ``--reprob``/``--remode``/``--recount``, ``--train-interpolation``) on both transforms: the CIFAR-style one
of small square inputs, whose default stays the padded crop and a fair flip, and timm's own; random erasing on the
prefetched batch or at the end of the tensor transform; what cannot apply is a usage error."""
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torchvision import transforms as T
from torchvision.transforms import functional as TF

import timm_patchmix  # noqa: F401
from timm_patchmix import train as train_cli
from timm_patchmix.data import Augment, small_image_transform
from timm_patchmix.engine import ConfigError
from timm_patchmix.engine.records import _older_settings

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _image(size=16, mode='RGB', seed=0):
    """An image whose every pixel differs, so that a crop window and a flip are told apart exactly."""
    rng = np.random.default_rng(seed)
    shape = (size, size, 3) if mode == 'RGB' else (size, size)
    return Image.fromarray(rng.permutation(np.arange(np.prod(shape)) % 251).reshape(shape).astype(np.uint8), mode)


def _windows(img, pad):
    """Every crop window of the reflect-padded image, CHW uint8 arrays by offset."""
    padded = np.asarray(TF.pad(img, pad, padding_mode='reflect'))
    if padded.ndim == 2:  # greyscale
        padded = padded[:, :, None]
    h, w = img.size[1], img.size[0]
    return {(t, s): np.ascontiguousarray(padded[t:t + h, s:s + w].transpose(2, 0, 1))
            for t in range(2 * pad + 1) for s in range(2 * pad + 1)}


def _which(out, windows):
    """``(offset, hflip, vflip)`` that makes ``out`` from the padded image; None when none does."""
    found = []
    for off, win in windows.items():
        for hf in (False, True):
            for vf in (False, True):
                w = win[:, :, ::-1] if hf else win
                w = w[:, ::-1, :] if vf else w
                if np.array_equal(out, w):
                    found.append((off, hf, vf))
    assert len(found) <= 1
    return found[0] if found else None


def _setup(argv):
    from timm_patchmix.engine.run import _setup as setup
    from timm_patchmix.engine.runtime import Runtime
    flags = ['--train-subset', '32', '--val-subset', '8', '-b', '8', '-j', '0', '--device', 'cpu'] + argv
    cfg, _, _, _, loaders, _ = setup(train_cli.parse_config(flags), Runtime(torch.device('cpu')), False)
    return cfg, loaders


# --- the CIFAR-style transform -------------------------------------------------------------------------------------
def test_the_default_small_transform_is_the_padded_crop_and_a_fair_flip_as_before():
    """Bit for bit the transform of earlier versions: RandomCrop(reflect) then RandomHorizontalFlip(0.5), drawing
    the same random numbers, so runs and their resumes keep their batches."""
    img = _image()
    ours = small_image_transform(16, True, 3, True, MEAN, STD)
    before = T.Compose([T.Resize(16), T.CenterCrop(16), T.RandomCrop(16, padding=2, padding_mode='reflect'),
                        T.RandomHorizontalFlip()])
    for k in range(40):
        torch.manual_seed(k)
        a = ours(img)
        torch.manual_seed(k)
        b = np.asarray(before(img)).transpose(2, 0, 1)
        assert np.array_equal(a, b)


@pytest.mark.parametrize('hflip, vflip', [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)])
def test_flip_probabilities_on_the_small_transform(hflip, vflip):
    img = _image()
    windows = _windows(img, 2)
    t = small_image_transform(16, True, 3, True, MEAN, STD, augment=Augment(hflip=hflip, vflip=vflip))
    torch.manual_seed(0)
    seen = {_which(t(img), windows) for _ in range(60)}
    assert None not in seen  # every output is a window of the padded image, flipped as asked
    assert {(hf, vf) for _, hf, vf in seen} == {(bool(hflip), bool(vflip))}
    assert len({off for off, _, _ in seen}) > 10  # the crop still moves


def test_flip_frequencies_follow_the_probabilities():
    img = _image()
    t = small_image_transform(16, True, 3, True, MEAN, STD, crop_padding=0, augment=Augment(hflip=0.2, vflip=0.7))
    plain = np.asarray(img).transpose(2, 0, 1)
    torch.manual_seed(0)
    h = v = 0
    n = 4000
    for _ in range(n):
        out = t(img)
        hf, vf = next((hf, vf) for hf in (0, 1) for vf in (0, 1)
                      if np.array_equal(out, plain[:, ::-1 if vf else 1, ::-1 if hf else 1]))
        h, v = h + hf, v + vf
    assert abs(h / n - 0.2) < 0.025 and abs(v / n - 0.7) < 0.025


def test_no_aug_trains_on_the_evaluation_transform():
    cfg, loaders = _setup(['--no-aug'])
    train_t, val_t = loaders.train.loader.dataset.transform, loaders.val.loader.dataset.transform
    img = _image(32)
    for k in range(5):
        torch.manual_seed(k)
        assert np.array_equal(train_t(img), val_t(img))
    assert loaders.train.random_erasing is None


@pytest.mark.parametrize('mode', ['RGB', 'L'])
@pytest.mark.parametrize('policy', ['rand-m9-mstd0.5-inc1', 'augmix-m5-w4-d2', 'original', 'v0', '3a'])
def test_timm_policies_run_on_rgb_and_greyscale_images(policy, mode):
    """Every kind of timm policy on the small transform, many draws (``v0`` and ``-inc1`` reach a posterize to
    0 bits now and then: the Pillow the project installs takes it); each changes some images beyond the crop."""
    img = _image(28, mode)
    chans = 3 if mode == 'RGB' else 1
    t = small_image_transform(28, True, chans, True, MEAN[:chans], STD[:chans], augment=Augment(aa=policy))
    windows = _windows(img, 3)
    random.seed(0)
    torch.manual_seed(0)
    outs = [t(img) for _ in range(300)]
    assert all(o.shape == (chans, 28, 28) and o.dtype == np.uint8 for o in outs)
    assert sum(_which(o, windows) is None for o in outs) > 30  # the policy changed these beyond a crop and flip


def test_pillow_posterizes_to_zero_bits():
    """timm's ``v0`` policy asks for a posterize to 0 bits, a black image; Pillow 13 refuses it (hence
    ``pillow<13``)."""
    img = _image(8)
    assert np.asarray(ImageOps.posterize(img, 0)).max() == 0


def test_colour_jitter_only_where_asked_and_not_beside_a_policy():
    def ops(augment):
        return [type(op).__name__ for op in small_image_transform(16, True, 3, True, MEAN, STD,
                                                                  augment=augment).transforms]
    assert 'ColorJitter' not in ops(Augment())  # the CIFAR-style default
    t = small_image_transform(16, True, 3, True, MEAN, STD, augment=Augment(color_jitter=0.3))
    jitter = next(op for op in t.transforms if isinstance(op, T.ColorJitter))
    assert jitter.brightness == jitter.contrast == jitter.saturation == (0.7, 1.3) and jitter.hue is None
    assert 'ColorJitter' not in ops(Augment(color_jitter=0.3, aa='rand-m9'))  # timm's rule
    assert 'ColorJitter' in ops(Augment(color_jitter=0.3, aa='3a'))


# --- random erasing -------------------------------------------------------------------------------------------------
def _first_batch(loaders):
    from timm_patchmix.engine.runtime import seed_all
    seed_all(0)
    loaders.generator.manual_seed(0)
    loaders.sampler.set_epoch(0)
    return next(iter(loaders.train))[0]


def test_random_erasing_on_the_prefetched_batch():
    """``--reprob 1 --remode const``: the same batch as without, but for one rectangle per image set to 0 after
    normalisation (timm's PrefetchLoader erases the normalised batch)."""
    _, base = _setup(['--model', 'resnet8_cifar'])
    _, erased = _setup(['--model', 'resnet8_cifar', '--reprob', '1', '--remode', 'const'])
    x0, x = _first_batch(base), _first_batch(erased)
    changed = 0
    for a, b in zip(x0, x):
        diff = (a != b).any(0)
        if not diff.any():
            continue
        changed += 1
        rows, cols = diff.any(1).nonzero()[:, 0], diff.any(0).nonzero()[:, 0]
        box = (slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1))
        assert diff[box].all() and int(diff.sum()) == diff[box].numel()  # one rectangle
        assert torch.equal(b[:, box[0], box[1]], torch.zeros_like(b[:, box[0], box[1]]))
    assert changed >= 6  # of 8: timm gives up on a box after ten draws that do not fit


def test_random_erasing_ends_the_tensor_transform_without_the_prefetcher():
    from timm.data.random_erasing import RandomErasing
    _, loaders = _setup(['--model', 'resnet8_cifar', '--no-prefetcher', '--reprob', '0.5', '--recount', '2'])
    t = loaders.train.dataset.transform.transforms
    assert isinstance(t[-1], RandomErasing) and t[-1].probability == 0.5 and t[-1].max_count == 2
    assert not any(isinstance(op, RandomErasing) for op in loaders.val.dataset.transform.transforms)


# --- timm's transform (inputs other than a square of at most 64 px) -------------------------------------------------
def _timm_ops(argv):
    _, loaders = _setup(['--model', 'resnet8_cifar', '--img-size', '72', '--no-prefetcher'] + argv)
    return loaders.train.dataset.transform.transforms[1].transforms


def test_timm_transform_takes_timms_defaults():
    from timm.data.transforms import RandomResizedCropAndInterpolation
    ops = _timm_ops([])
    rrc = ops[0]
    assert isinstance(rrc, RandomResizedCropAndInterpolation)
    assert rrc.scale == (0.08, 1.0) and rrc.ratio == (3 / 4, 4 / 3)
    assert set(rrc.interpolation) == {T.InterpolationMode.BILINEAR, T.InterpolationMode.BICUBIC}  # 'random'
    assert [op.p for op in ops if isinstance(op, T.RandomHorizontalFlip)] == [0.5]
    assert not any(isinstance(op, T.RandomVerticalFlip) for op in ops)
    assert next(op for op in ops if isinstance(op, T.ColorJitter)).brightness == (0.6, 1.4)  # timm's 0.4


def test_timm_transform_takes_the_flags():
    from timm.data.auto_augment import RandAugment
    from timm.data.random_erasing import RandomErasing
    ops = _timm_ops(['--scale', '0.5', '1', '--ratio', '0.9', '1.1', '--train-interpolation', 'bicubic', '--hflip',
                     '0', '--vflip', '0.3', '--aa', 'rand-m7', '--reprob', '0.4', '--remode', 'rand'])
    rrc = ops[0]
    assert rrc.scale == (0.5, 1.0) and rrc.ratio == (0.9, 1.1)
    assert rrc.interpolation == T.InterpolationMode.BICUBIC
    assert not any(isinstance(op, T.RandomHorizontalFlip) for op in ops)
    assert [op.p for op in ops if isinstance(op, T.RandomVerticalFlip)] == [0.3]
    assert any(isinstance(op, RandAugment) for op in ops) and not any(isinstance(op, T.ColorJitter) for op in ops)
    erase = ops[-1]
    assert isinstance(erase, RandomErasing) and erase.probability == 0.4 and erase.mode == 'rand'


def test_no_aug_on_timms_transform_is_timms_no_aug_transform():
    from timm.data.transforms import RandomResizedCropAndInterpolation
    ops = _timm_ops(['--no-aug'])
    assert not any(isinstance(op, (RandomResizedCropAndInterpolation, T.RandomHorizontalFlip, T.ColorJitter))
                   for op in ops)
    resize = next(op for op in ops if isinstance(op, T.Resize))
    assert tuple(resize.size) == (72, 72)  # timm's: resized to the input, no crop_pct


def test_device_data_takes_the_flips_and_no_aug():
    from timm_patchmix.engine.device_data import DeviceTrainLoader
    _, loaders = _setup(['--device-data', '--hflip', '0', '--vflip', '0.25'])
    assert isinstance(loaders.train, DeviceTrainLoader)
    assert (loaders.train.pad, loaders.train.hflip, loaders.train.vflip) == (4, 0.0, 0.25)
    _, loaders = _setup(['--device-data', '--no-aug'])
    assert (loaders.train.pad, loaders.train.hflip, loaders.train.vflip) == (0, 0.0, 0.0)
    x, y = next(iter(loaders.train))  # no crop, no flip: the validation transform's pixels of those images
    images = loaders.train.data
    order = torch.as_tensor(list(iter(loaders.sampler)))[:x.shape[0]]
    from timm_patchmix.engine.device_data import normalise
    torch.testing.assert_close(x, normalise(images.images[order], loaders.train.mean, loaders.train.std))
    assert torch.equal(y, images.labels[order])


def test_older_states_trained_timms_transform_with_the_models_interpolation():
    big = {'data_config': {'input_size': [3, 224, 224], 'interpolation': 'bicubic'}}
    small = {'data_config': {'input_size': [3, 32, 32], 'interpolation': 'bilinear'}}
    assert _older_settings(big)['train_interpolation'] == 'bicubic'
    assert _older_settings(small)['train_interpolation'] is None
    fill = _older_settings(dict(small, reprob=0.5))
    assert 'reprob' not in fill and fill['aa'] is None and fill['hflip'] == 0.5


# --- what cannot apply ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize('argv, flag, message', [
    (['--scale', '0.5', '1'], '--scale', 'the 32x32 input takes the CIFAR-style transform'),
    (['--ratio', '0.9', '1.1'], '--ratio', '--ratio would be unused'),
    (['--train-interpolation', 'bicubic'], '--train-interpolation', '--train-interpolation would be unused'),
    (['--scale', '0.9', '0.1'], '--scale', 'MIN 0.9 is above MAX 0.1'),
    (['--no-aug', '--reprob', '0.2', '--vflip', '0.1'], None, '--vflip and --reprob would be unused'),
    (['--remode', 'const'], None, '--remode sets the random erasing of --reprob, which is 0'),
    (['--recount', '3'], None, '--recount sets the random erasing of --reprob'),
    (['--device-data', '--aa', 'v0'], None, '--device-data crops, flips and normalises on the device; --aa is a'),
    (['--aa', 'bogus'], '--aa', "timm has no augmentation policy 'bogus'"),
    (['--aa', 'rand-m9', '--color-jitter', '0.3'], None, 'timm leaves colour jitter out beside an --aa policy'),
    (['--device-data', '--scale', '0.5', '1'], '--scale', 'the 32x32 input takes the CIFAR-style transform'),
])
def test_augmentation_that_cannot_apply_is_a_usage_error(argv, flag, message):
    with pytest.raises(ConfigError, match=message) as e:
        _setup(argv)
    assert e.value.flag == flag


@pytest.mark.parametrize('argv, message', [
    (['--no-aug', '--hflip', '0.5'], '--no-aug switches training augmentation off; --hflip would be unused'),
    (['--no-aug', '--vflip', '0', '--reprob', '0'], '--vflip and --reprob would be unused'),
    (['--remode', 'pixel'], '--remode sets the random erasing of --reprob, which is 0'),
    (['--recount', '1'], '--recount sets the random erasing of --reprob, which is 0'),
])
def test_a_flag_given_at_its_default_value_is_refused_alike(argv, message):
    """A flag given explicitly at its default value read as not given, so `--no-aug --hflip 0.5` silently dropped
    the flip asked for, and `--remode pixel` without --reprob passed; the command line's flags are counted as
    given whatever their value (in Python a config cannot tell, and compares with the defaults)."""
    with pytest.raises(ConfigError, match=message):
        train_cli.parse_config(argv)
    assert train_cli.parse_config(['--no-aug']).no_aug and train_cli.parse_config(['--reprob', '0.2', '--remode',
                                                                                   'pixel']).remode == 'pixel'


def test_no_colour_jitter_beside_a_policy_is_no_contradiction():
    cfg = train_cli.parse_config(['--aa', 'rand-m9', '--color-jitter', '0'])
    assert (cfg.aa, cfg.color_jitter) == ('rand-m9', 0.0)
    assert train_cli.parse_config(['--aa', '3a', '--color-jitter', '0.3']).color_jitter == 0.3


def test_a_config_file_sets_the_augmentation(tmp_path, capsys):
    path = tmp_path / 'aug.yaml'
    path.write_text('aa: v0\nreprob: 0.3\nremode: const\nvflip: 0.25\nscale: [0.5, 1.0]\n')
    cfg = train_cli.resolve_args(['-c', str(path), '--hflip', '0'])
    got = (cfg.aa, cfg.reprob, cfg.remode, cfg.vflip, cfg.hflip, cfg.scale)
    assert got == ('v0', 0.3, 'const', 0.25, 0.0, (0.5, 1.0))
    path.write_text('remode: bogus\n')
    with pytest.raises(SystemExit) as e:
        train_cli.resolve_args(['-c', str(path)])
    assert e.value.code == 2 and "remode: invalid choice: 'bogus'" in capsys.readouterr().err


def test_the_cli_exits_2_before_writing_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_cli.main(['--aa', 'bogus', '--output', str(tmp_path / 'out')])
    assert e.value.code == 2 and "argument --aa: timm has no augmentation policy 'bogus'" in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()


def test_a_run_with_every_augmentation_trains_in_loader_workers(tmp_path):
    """Workers pickle the transform: timm's 3-augment policy, jitter and flips there, erasing on the batch."""
    res = train_cli.main(['--train-subset', '32', '--val-subset', '16', '-b', '8', '-j', '2', '--epochs', '1',
                          '--device', 'cpu', '--no-progress', '--patchmix', '--output', str(tmp_path),
                          '--aa', '3a', '--color-jitter', '0.2', '--vflip', '0.1', '--reprob', '0.3'])
    assert [r['epoch'] for r in res['rows']] == [0]
    import os
    import yaml
    with open(os.path.join(res['output'], 'args.yaml'), encoding='utf-8') as f:
        args = yaml.safe_load(f)
    assert (args['aa'], args['color_jitter'], args['vflip'], args['reprob']) == ('3a', 0.2, 0.1, 0.3)
