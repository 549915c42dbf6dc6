"""``--device-data``: pixels equal to the loader path's transforms (crop, hflip and vflip with their probabilities),
the sampler's order, resume and DDP."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import timm_patchmix  # noqa: F401
from timm_patchmix.engine import TrainConfig, TrainSetupError, train
from timm_patchmix.engine.device_data import (DeviceEvalLoader, DeviceImages, DeviceTrainLoader, crop_flip,
                                              normalise, sample_crop_flip)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))
TINY = dict(train_subset=64, val_subset=40, batch_size=16, workers=0, no_progress=True, device='cpu',
            log_interval=1000, patchmix=True)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.mark.parametrize('shape, pad', [((3, 32, 32), 4), ((1, 28, 28), 3), ((3, 9, 9), 8)])
def test_crop_flip_equals_torchvision_reflect_crop_and_flip(shape, pad):
    """Every offset and all four combinations of horizontal and vertical flip, pixel for pixel against torchvision's
    RandomCrop(reflect), then hflip, then vflip."""
    from torchvision.transforms import functional as TF
    g = torch.Generator().manual_seed(pad)
    images = torch.randint(0, 256, (5, *shape), generator=g, dtype=torch.uint8)
    h, w = shape[1:]
    offsets = [(t, c) for t in range(2 * pad + 1) for c in range(2 * pad + 1)]
    n = len(offsets)
    index = torch.arange(n) % 5
    top = torch.tensor([o[0] for o in offsets])
    left = torch.tensor([o[1] for o in offsets])
    seen = set()
    for combo in range(4):  # over the loop every offset meets all four (hflip, vflip) combinations
        flip = (torch.arange(n) + combo) % 4 >= 2
        vflip = (torch.arange(n) + combo) % 2 == 1
        for v in ((None, vflip) if combo == 0 else (vflip,)):
            got = crop_flip(images, index, top, left, flip, pad, v)
            assert got.dtype == torch.uint8 and got.shape == (n, *shape)
            for k in range(n):
                padded = TF.pad(images[index[k]], [pad, pad, pad, pad], padding_mode='reflect')
                want = TF.crop(padded, int(top[k]), int(left[k]), h, w)
                if flip[k]:
                    want = TF.hflip(want)
                if v is not None and v[k]:
                    want = TF.vflip(want)
                assert torch.equal(got[k], want), (k, offsets[k], bool(flip[k]), v is not None and bool(v[k]))
                seen.add((offsets[k], bool(flip[k]), v is not None and bool(v[k])))
    assert len(seen) == 4 * n
    # vflip=None reads exactly as an all-false mask
    flip = torch.arange(n) % 2 == 0
    assert torch.equal(crop_flip(images, index, top, left, flip, pad),
                       crop_flip(images, index, top, left, flip, pad, torch.zeros(n, dtype=torch.bool)))


def test_crop_offsets_and_flips_are_uniform():
    top, left, flip, vflip = sample_crop_flip(90_000, 4, 'cpu', torch.Generator().manual_seed(0))
    for off in (top, left):
        counts = torch.bincount(off, minlength=9).double() / off.numel()
        assert off.min() == 0 and off.max() == 8 and (counts - 1 / 9).abs().max() < 0.01
    assert abs(flip.double().mean().item() - 0.5) < 0.01
    assert vflip.dtype == torch.bool and vflip.shape == (90_000,) and not vflip.any()


@pytest.mark.parametrize('pad', [0, 2, 4])
def test_default_draws_are_bit_identical_to_crop_then_fair_coin(pad):
    """hflip=0.5, vflip=0 draws exactly what randint offsets then a fair coin drew before (the default stream)."""
    n = 1000
    g = torch.Generator().manual_seed(123)
    ref_off = torch.randint(0, 2 * pad + 1, (2, n), generator=g)
    ref_flip = torch.rand(n, generator=g) < 0.5
    ref_next = torch.rand(8, generator=g)  # the generator's state after the draws
    for kwargs in (dict(), dict(hflip=0.5, vflip=0.0)):
        g = torch.Generator().manual_seed(123)
        top, left, flip, vflip = sample_crop_flip(n, pad, 'cpu', g, **kwargs)
        assert torch.equal(top, ref_off[0]) and torch.equal(left, ref_off[1]) and torch.equal(flip, ref_flip)
        assert torch.equal(vflip, torch.zeros(n, dtype=torch.bool))
        assert torch.equal(torch.rand(8, generator=g), ref_next)  # no extra draw for vflip=0
    # the offsets do not depend on the probabilities, nor the hflip mask on vflip
    g = torch.Generator().manual_seed(123)
    top, left, flip, vflip = sample_crop_flip(n, pad, 'cpu', g, hflip=0.0, vflip=0.3)
    assert torch.equal(top, ref_off[0]) and torch.equal(left, ref_off[1]) and not flip.any()
    g = torch.Generator().manual_seed(123)
    assert torch.equal(sample_crop_flip(n, pad, 'cpu', g, hflip=0.5, vflip=0.3)[2], ref_flip)


@pytest.mark.parametrize('hflip, vflip', [(0.2, 0.7), (0.7, 0.2), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0)])
def test_flip_frequencies_follow_the_probabilities(hflip, vflip):
    n = 400_000  # binomial sd <= 0.0008; 0.004 is five of them
    g = torch.Generator().manual_seed(7)
    _, _, hmask, vmask = sample_crop_flip(n, 4, 'cpu', g, hflip=hflip, vflip=vflip)
    assert hmask.dtype == vmask.dtype == torch.bool
    assert abs(hmask.double().mean().item() - hflip) < 0.004
    assert abs(vmask.double().mean().item() - vflip) < 0.004
    assert abs((hmask & vmask).double().mean().item() - hflip * vflip) < 0.004  # drawn independently
    # the exact masks: thresholds on the same uniforms
    g = torch.Generator().manual_seed(7)
    torch.randint(0, 9, (2, n), generator=g)
    u = torch.rand(n, generator=g)
    assert torch.equal(hmask, u < hflip)
    if vflip > 0:
        assert torch.equal(vmask, torch.rand(n, generator=g) < vflip)
    else:
        assert not vmask.any()


def test_eval_batches_equal_the_prefetch_loader():
    """Validation on the device gives the loader path's normalised pixels bit for bit (timm's PrefetchLoader)."""
    from timm.data.loader import PrefetchLoader, fast_collate
    from timm_patchmix.data import build_dataset, small_image_transform
    ds = build_dataset('', '', 'validation', False, 48)
    tf = small_image_transform(32, False, 3, True, MEAN, STD)
    data = DeviceImages.from_dataset(ds, tf, torch.device('cpu'))
    assert data.images.dtype == torch.uint8 and data.images.shape == (48, 3, 32, 32) and len(data) == 48
    ds.transform = tf
    ref = PrefetchLoader(torch.utils.data.DataLoader(ds, batch_size=20, collate_fn=fast_collate), mean=MEAN, std=STD,
                         channels=3, device=torch.device('cpu'))
    mine = DeviceEvalLoader(data, range(48), 20, MEAN, STD)
    assert len(mine) == len(ref) == 3
    for (xa, ya), (xb, yb) in zip(mine, ref):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_train_batches_follow_the_sampler_and_augment_on_device():
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (40, 3, 16, 16), generator=g, dtype=torch.uint8)
    labels = torch.arange(40) % 7
    data = DeviceImages(images, labels)
    sampler = torch.utils.data.DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=3,
                                                  drop_last=True)
    sampler.set_epoch(2)
    loader = DeviceTrainLoader(data, sampler, 6, MEAN, STD, pad=2)
    order = list(iter(sampler))
    assert len(loader) == 20 // 6 == 3
    torch.manual_seed(9)
    batches = list(loader)
    torch.manual_seed(9)  # the same draws, replayed by hand
    mean = torch.tensor([m * 255 for m in MEAN]).view(1, 3, 1, 1)
    std = torch.tensor([s * 255 for s in STD]).view(1, 3, 1, 1)
    for k, (x, y) in enumerate(batches):
        index = torch.tensor(order[6 * k:6 * (k + 1)])
        assert torch.equal(y, labels[index])
        top, left, flip, vflip = sample_crop_flip(6, 2, 'cpu')
        assert not vflip.any()
        want = normalise(crop_flip(images, index, top, left, flip, 2), mean, std)
        assert x.dtype == torch.float32 and torch.equal(x, want)
    with pytest.raises(ValueError, match='crop padding 16 must be below the image side'):
        DeviceTrainLoader(data, sampler, 6, MEAN, STD, pad=16)


def _flip_loader_setup():
    g = torch.Generator().manual_seed(5)
    images = torch.randint(0, 256, (24, 3, 12, 12), generator=g, dtype=torch.uint8)
    data = DeviceImages(images, torch.arange(24) % 5)
    sampler = torch.utils.data.DistributedSampler(range(24), num_replicas=1, rank=0, shuffle=True, seed=1)
    sampler.set_epoch(0)
    mean = torch.tensor([m * 255 for m in MEAN]).view(1, 3, 1, 1)
    std = torch.tensor([s * 255 for s in STD]).view(1, 3, 1, 1)
    return images, data, sampler, list(iter(sampler)), mean, std


def test_train_loader_flip_probabilities_zero_and_one():
    """hflip=vflip=0: the batches are the pure crops; hflip=1 and/or vflip=1 flip every image; the offsets are the
    same draws whatever the probabilities."""
    from torchvision.transforms import functional as TF
    images, data, sampler, order, mean, std = _flip_loader_setup()
    for hflip, vflip in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)):
        loader = DeviceTrainLoader(data, sampler, 8, MEAN, STD, pad=3, hflip=hflip, vflip=vflip)
        assert len(loader) == 3
        torch.manual_seed(4)
        batches = list(loader)
        torch.manual_seed(4)
        for k, (x, y) in enumerate(batches):
            index = torch.tensor(order[8 * k:8 * (k + 1)])
            top = torch.randint(0, 7, (2, 8))
            torch.rand(8)  # the horizontal coin, always drawn
            if vflip > 0:
                torch.rand(8)
            crops = torch.stack([TF.crop(TF.pad(images[i], [3, 3, 3, 3], padding_mode='reflect'), t, c, 12, 12)
                                 for i, t, c in zip(index.tolist(), top[0].tolist(), top[1].tolist())])
            if hflip:
                crops = crops.flip(-1)
            if vflip:
                crops = crops.flip(-2)
            assert torch.equal(x, normalise(crops, mean, std)) and torch.equal(y, data.labels[index])


def test_train_loader_draws_vflip_from_the_device_generator():
    """A vflip between 0 and 1 flips what sample_crop_flip's vertical mask says, replayed from the same seed."""
    images, data, sampler, order, mean, std = _flip_loader_setup()
    loader = DeviceTrainLoader(data, sampler, 8, MEAN, STD, pad=2, hflip=0.3, vflip=0.6)
    torch.manual_seed(11)
    batches = list(loader)
    torch.manual_seed(11)
    flips = []
    for k, (x, _) in enumerate(batches):
        index = torch.tensor(order[8 * k:8 * (k + 1)])
        top, left, flip, vflip = sample_crop_flip(8, 2, 'cpu', hflip=0.3, vflip=0.6)
        flips.append(vflip)
        assert torch.equal(x, normalise(crop_flip(images, index, top, left, flip, 2, vflip), mean, std))
    assert torch.cat(flips).any() and not torch.cat(flips).all()  # this seed exercises both branches


@pytest.mark.parametrize('kwargs, name', [(dict(hflip=1.5), 'hflip'), (dict(hflip=-0.1), 'hflip'),
                                          (dict(vflip=1.5), 'vflip'), (dict(vflip=float('nan')), 'vflip')])
def test_flip_probabilities_out_of_range_are_refused(kwargs, name):
    _, data, sampler, _, _, _ = _flip_loader_setup()
    with pytest.raises(ValueError, match=f'{name} must be a probability in \\[0, 1\\]'):
        DeviceTrainLoader(data, sampler, 8, MEAN, STD, pad=2, **kwargs)
    with pytest.raises(ValueError, match=f'{name} must be a probability'):
        sample_crop_flip(4, 2, 'cpu', **kwargs)


def test_device_data_run_resumes_bit_exactly(tmp_path):
    """Three epochs straight, and one epoch then a resume to three, end on identical weights and rows."""
    full = train(TrainConfig(device_data=True, epochs=3, output=str(tmp_path), experiment='full', **TINY))
    assert [r['epoch'] for r in full.rows] == [0, 1, 2] and full.rows[-1]['eval_top1'] >= 0
    train(TrainConfig(device_data=True, epochs=1, output=str(tmp_path), experiment='part', **TINY))
    part = os.path.join(tmp_path, 'part', 'state.safetensors')
    resumed = train(TrainConfig(device_data=True, epochs=3, resume=part, **TINY))
    assert [dict(r, img_s=0) for r in resumed.rows] == [dict(r, img_s=0) for r in full.rows]
    a, b = load_file(full.last_path), load_file(resumed.last_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_device_data_validation_equals_the_loader_path(tmp_path):
    """With the same weights, the device path's validation scores the run's held-out images exactly as the loader
    path does, and as the run's own summary row recorded."""
    import dataclasses
    import timm
    from timm_patchmix.checkpoint import load_weights
    from timm_patchmix.engine.loaders import build_datasets, build_loaders
    from timm_patchmix.engine.loop import validate
    from timm_patchmix.engine.runtime import Runtime
    res = train(TrainConfig(device_data=True, epochs=1, output=str(tmp_path), experiment='d', **TINY))
    cfg, rt = res.config, Runtime(torch.device('cpu'))
    model = timm.create_model(cfg.model, num_classes=10)
    model.load_state_dict(load_weights(res.last_path)[0])
    plain = dataclasses.replace(cfg, device_data=False)
    ev_loader = validate(model, build_loaders(plain, build_datasets(plain), rt).val, plain, rt.device)
    loaders = build_loaders(cfg, build_datasets(cfg), rt)
    assert isinstance(loaders.val, DeviceEvalLoader) and isinstance(loaders.train, DeviceTrainLoader)
    ev_device = validate(model, loaders.val, cfg, rt.device)
    assert ev_device == ev_loader
    assert ev_device['eval_top1'] == pytest.approx(res.rows[0]['eval_top1'], abs=1e-4)


def test_device_data_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(TrainSetupError, match='--device-data makes batches on the device'):
        TrainConfig(device_data=True, patchmix_collate=True, patchmix=True)
    with pytest.raises(TrainSetupError, match='at most 64x64 on the device'):
        train(TrainConfig(device_data=True, epochs=1, img_size=96, output=str(tmp_path), experiment='big', **TINY))
    assert not os.path.exists(tmp_path / 'big' / 'state.safetensors')


@pytest.mark.slow
def test_two_process_ddp_gloo_device_data(tmp_path):
    """Each rank keeps the set and trains on its DistributedSampler share; validation counts each image once."""
    torchrun = os.path.join(os.path.dirname(sys.executable), 'torchrun')
    cmd = [torchrun, '--standalone', '--nproc_per_node', '2', 'train.py', '--train-subset', '64', '--val-subset', '40',
           '-b', '16', '-j', '0', '--no-progress', '--epochs', '2', '--patchmix', '--device-data', '--device', 'cpu',
           '--output', str(tmp_path), '--experiment', 'ddp']
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import csv
    with open(os.path.join(tmp_path, 'ddp', 'summary.csv')) as f:
        rows = list(csv.DictReader(f))
    assert [r['epoch'] for r in rows] == ['0', '1']
    for r in rows:
        assert float(r['eval_top1']) * 40 / 100 == pytest.approx(round(float(r['eval_top1']) * 40 / 100))
    assert np.isfinite(float(rows[-1]['train_loss']))
