"""``--aug-repeats N``: timm's repeated-augmentation sampler, seeded by ``--seed`` and the epoch; each copy of an
image augmented on its own."""
import os

import pytest
import torch
from timm.data.distributed_sampler import RepeatAugSampler

import timm_patchmix  # noqa: F401
from timm_patchmix.engine import TrainConfig, train
from timm_patchmix.engine.loaders import SeededRepeatAugSampler
from timm_patchmix.engine.run import _setup
from timm_patchmix.engine.runtime import Runtime
from timm_patchmix.settings import SettingsChangedError
from timm_patchmix import train as train_cli
from timm_patchmix.train import parse_config

from test_cli_errors import expect_usage_error


def _timm(n, world, rank, repeats, epoch):
    s = RepeatAugSampler(list(range(n)), num_replicas=world, rank=rank, num_repeats=repeats)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize('n', [100, 300, 1000])
@pytest.mark.parametrize('repeats', [1, 2, 3, 2.5])
@pytest.mark.parametrize('world', [1, 2, 3])
def test_seed_zero_gives_timms_indices_and_a_seed_shifts_the_epoch(n, repeats, world):
    for rank in range(world):
        ours = SeededRepeatAugSampler(list(range(n)), world, rank, repeats, seed=0)
        seeded = SeededRepeatAugSampler(list(range(n)), world, rank, repeats, seed=7)
        assert len(ours) == len(_timm(n, world, rank, repeats, 0))
        for epoch in range(3):
            ours.set_epoch(epoch)
            seeded.set_epoch(epoch)
            assert list(ours) == _timm(n, world, rank, repeats, epoch)
            assert list(seeded) == _timm(n, world, rank, repeats, 7 + epoch)
            assert list(seeded) != list(ours)


def test_one_process_draws_each_image_in_runs_of_repeats():
    s = SeededRepeatAugSampler(list(range(512)), 1, 0, 3, seed=1)
    s.set_epoch(4)
    order = list(s)
    assert len(order) == 512  # an epoch as long as without repeats (a multiple of 256: timm's rounding)
    runs = [order[i:i + 3] for i in range(0, 510, 3)]
    assert all(r[0] == r[1] == r[2] for r in runs) and len({r[0] for r in runs}) == 170
    s2 = SeededRepeatAugSampler(list(range(512)), 1, 0, 3, seed=1)
    s2.set_epoch(4)
    assert list(s2) == order, 'a resumed run draws the same epoch'


def _first_batch(argv):
    cfg = parse_config(['--model', 'resnet8_cifar', '--train-subset', '256', '--val-subset', '16', '-b', '12',
                        '-j', '0', '--device', 'cpu', '--epochs', '1'] + argv)
    cfg, _, _, _, loaders, _ = _setup(cfg, Runtime(torch.device('cpu')), False)
    loaders.sampler.set_epoch(0)
    return next(iter(loaders.train))


@pytest.mark.parametrize('extra', [[], ['--no-prefetcher'], ['-j', '2']], ids=['prefetcher', 'tensors', 'workers'])
def test_each_copy_is_augmented_on_its_own(extra):
    images, targets = _first_batch(['--aug-repeats', '3'] + extra)
    assert images.shape[0] == 12
    same_source = [images[i:i + 3] for i in range(0, 12, 3)]
    assert all(len(set(targets[i:i + 3].tolist())) == 1 for i in range(0, 12, 3))
    # the padded random crop and the flip drawn per copy: some copies differ ...
    assert any(not torch.equal(t[0], t[1]) or not torch.equal(t[0], t[2]) for t in same_source)
    # ... and without augmentation the copies are the same pixels
    plain, _ = _first_batch(['--aug-repeats', '3', '--no-aug'] + extra)
    assert all(torch.equal(plain[i], plain[i + 1]) and torch.equal(plain[i], plain[i + 2]) for i in range(0, 12, 3))
    # without --aug-repeats, twelve different images
    alone, _ = _first_batch(['--no-aug'] + extra)
    assert len({tuple(x.flatten()[:64].tolist()) for x in alone}) == 12


def test_device_data_takes_the_repeats_too():
    images, targets = _first_batch(['--aug-repeats', '3', '--device-data', '--no-aug'])
    assert all(torch.equal(images[i], images[i + 1]) and torch.equal(images[i], images[i + 2])
               for i in range(0, 12, 3))


def test_flag_values_and_resume(tmp_path, capsys):
    out = str(tmp_path / 'refused')
    # (a huge N passed the checks and overflowed timm's sampler with a traceback, after writing args.yaml)
    for value, names in (('0.5', ['from 1 to 64', '0.5']), ('-1', ['-1']), ('65', ['from 1 to 64', '65']),
                         ('1e20', ['from 1 to 64', '1e+20']), ('1e308', ['from 1 to 64', '1e+308'])):
        expect_usage_error(capsys, train_cli.cli, ['--aug-repeats', value, '--output', out], *names,
                           flag='--aug-repeats')
    assert not os.path.exists(out)
    tiny = dict(model='resnet8_cifar', train_subset=256, val_subset=16, batch_size=64, workers=0, no_progress=True,
                device='cpu', output=str(tmp_path), experiment='ar')
    res = train(TrainConfig(epochs=1, aug_repeats=3, **tiny))
    assert len(res.rows) == 1
    state = os.path.join(res.output, 'state.safetensors')
    with pytest.raises(SettingsChangedError, match='--aug-repeats'):  # another epoch composition: named
        train(TrainConfig(epochs=2, resume=state, **tiny))
    assert len(train(TrainConfig(epochs=2, aug_repeats=3, resume=state, **tiny)).rows) == 2
