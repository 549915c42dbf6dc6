"""``--device-data``: pixels equal to the loader path's transforms, the sampler's order, resume and DDP."""
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
    """Every offset and both flips, pixel for pixel against torchvision's RandomCrop(reflect) + flip."""
    from torchvision.transforms import functional as TF
    g = torch.Generator().manual_seed(pad)
    images = torch.randint(0, 256, (5, *shape), generator=g, dtype=torch.uint8)
    h, w = shape[1:]
    offsets = [(t, c) for t in range(2 * pad + 1) for c in range(2 * pad + 1)]
    n = len(offsets)
    index = torch.arange(n) % 5
    top = torch.tensor([o[0] for o in offsets])
    left = torch.tensor([o[1] for o in offsets])
    for flip_all in (False, True):
        flip = torch.full((n,), flip_all) ^ (torch.arange(n) % 2 == 1)  # both flips at every offset over the loop
        got = crop_flip(images, index, top, left, flip, pad)
        assert got.dtype == torch.uint8 and got.shape == (n, *shape)
        for k in range(n):
            padded = TF.pad(images[index[k]], [pad, pad, pad, pad], padding_mode='reflect')
            want = TF.crop(padded, int(top[k]), int(left[k]), h, w)
            if flip[k]:
                want = TF.hflip(want)
            assert torch.equal(got[k], want), (k, offsets[k], bool(flip[k]))


def test_crop_offsets_and_flips_are_uniform():
    top, left, flip = sample_crop_flip(90_000, 4, 'cpu', torch.Generator().manual_seed(0))
    for off in (top, left):
        counts = torch.bincount(off, minlength=9).double() / off.numel()
        assert off.min() == 0 and off.max() == 8 and (counts - 1 / 9).abs().max() < 0.01
    assert abs(flip.double().mean().item() - 0.5) < 0.01


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
        top, left, flip = sample_crop_flip(6, 2, 'cpu')
        want = normalise(crop_flip(images, index, top, left, flip, 2), mean, std)
        assert x.dtype == torch.float32 and torch.equal(x, want)
    with pytest.raises(ValueError, match='crop padding 16 must be below the image side'):
        DeviceTrainLoader(data, sampler, 6, MEAN, STD, pad=16)


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
