"""The data path end to end: constant-colour images of known class through timm's ``create_loader`` with
DataLoader workers, checked cell by cell: every cell's pixels must show the class its patch label names.

Nothing is trained. A batch whose memory is reused while the main process still reads it shows up here as cells
whose colour contradicts their label.
"""
import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_loader

from timm_patchmix import FastCollatePatchMix, PatchMix, cell_bounds, split_target
from timm_patchmix.collate import FastCollateGuidedPatchMix
from timm_patchmix.guided import GuidedPatchMix, MaskTable

NUM_CLASSES, SIZE, GRID = 10, 32, 4
COLOUR = [(20 * c + 7, 250 - 20 * c, 11 * c) for c in range(NUM_CLASSES)]  # distinct per channel


class ConstantColours(torch.utils.data.Dataset):
    """Image ``i`` is one flat colour, that of its class ``i % 10``; ``transform`` is set by ``create_loader``."""

    def __init__(self, n: int):
        self.n, self.transform = n, None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        c = i % NUM_CLASSES
        img = Image.fromarray(np.full((SIZE, SIZE, 3), COLOUR[c], dtype=np.uint8))
        return (self.transform(img) if self.transform is not None else img), c


def _table():
    rng = np.random.default_rng(0)
    pairs = [(c, (c + 3) % NUM_CLASSES) for c in range(NUM_CLASSES)]
    return MaskTable((GRID, GRID), NUM_CLASSES, [str(c) for c in range(NUM_CLASSES)], 'fp', pairs,
                     [rng.random((GRID, GRID)) < 0.5 for _ in pairs], [0.1] * len(pairs), 0.1)


def _loader(collate, workers, persistent, pin):
    return create_loader(
        ConstantColours(320), input_size=(3, SIZE, SIZE), batch_size=16, is_training=True, collate_fn=collate,
        device=torch.device('cpu'), num_workers=workers, persistent_workers=persistent, pin_memory=pin,
        mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), hflip=0.5, color_jitter=0.0, scale=(0.5, 1.0))


def _check_cells(x, packed, y=None):
    """Every cell is flat and of the colour of its patch label's class; return the number of mixed cells."""
    colours = torch.tensor(COLOUR, dtype=torch.float32) / 255.0  # the prefetcher scales uint8 by 1/255
    image_t, patch_t = split_target(packed, GRID)
    label = patch_t.argmax(2).view(-1, GRID, GRID)  # [B, rows, cols]
    rb = cell_bounds(SIZE, GRID)
    sizes = torch.tensor([rb[k + 1] - rb[k] for k in range(GRID)])
    pixel_label = label.repeat_interleave(sizes, 1).repeat_interleave(sizes, 2)  # [B, H, W]
    expect = colours[pixel_label].permute(0, 3, 1, 2)
    bad = ((x - expect).abs() > 1e-6).any(1)
    if bad.any():
        i, r, c = bad.nonzero()[0].tolist()
        raise AssertionError(f'{int(bad.sum())} pixels contradict their patch label, first: sample {i}, '
                             f'pixel ({r}, {c}) labelled class {int(pixel_label[i, r, c])}')
    owner = image_t.argmax(1) if y is None else y
    return int((label != owner.view(-1, 1, 1)).sum())


def _run(loader, mixer=None, epochs=2):
    mixed = 0
    for _ in range(epochs):
        for x, target in loader:
            y = None
            if mixer is not None:
                y = target.clone()
                x, target = mixer(x, target)
            mixed += _check_cells(x, target, y)
    assert mixed > 0, 'the loader mixed nothing: the check would be empty'


@pytest.mark.parametrize('workers, persistent, pin', [(0, False, False), (1, False, False), (2, False, True),
                                                      (2, True, False), (4, False, False)])
def test_collate_mixer_cells_match_labels_with_workers(workers, persistent, pin):
    collate = FastCollatePatchMix(grid=GRID, num_classes=NUM_CLASSES)
    _run(_loader(collate, workers, persistent, pin))


@pytest.mark.parametrize('workers, persistent', [(0, False), (2, False), (2, True)])
def test_guided_collate_mixer_cells_match_labels_with_workers(workers, persistent):
    collate = FastCollateGuidedPatchMix(_table(), guided_prob=0.5, random_prob=0.25, grid=GRID)
    _run(_loader(collate, workers, persistent, False))


@pytest.mark.parametrize('make', [lambda: PatchMix(grid=GRID, num_classes=NUM_CLASSES),
                                  lambda: PatchMix(grid=GRID, num_classes=NUM_CLASSES, mode='pair'),
                                  lambda: GuidedPatchMix(_table(), guided_prob=0.5, random_prob=0.25)],
                         ids=['patchmix', 'patchmix-pair', 'guided'])
def test_tensor_mixers_on_worker_batches(make):
    _run(_loader(None, 2, False, False), mixer=make())


def _ddp_rank(rank, world, init_file, results):
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    try:
        collate = FastCollatePatchMix(grid=GRID, num_classes=NUM_CLASSES)
        loader = create_loader(
            ConstantColours(160), input_size=(3, SIZE, SIZE), batch_size=16, is_training=True, collate_fn=collate,
            device=torch.device('cpu'), num_workers=1, distributed=True, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
            hflip=0.5, color_jitter=0.0, scale=(0.5, 1.0))
        _run(loader, epochs=1)
        seen = torch.tensor([sum(x.shape[0] for x, _ in loader)])
        dist.all_reduce(seen)
        results[rank] = int(seen)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_collate_mixer_under_ddp_two_ranks(tmp_path):
    """Two gloo ranks, each with a loader worker and its share of the data (DistributedSampler)."""
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    mp.spawn(_ddp_rank, args=(2, str(tmp_path / 'init'), results), nprocs=2)
    assert dict(results) == {0: 160, 1: 160}
