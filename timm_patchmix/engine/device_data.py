"""``--device-data``: a small dataset kept whole on the device as uint8, augmented and normalised there.

For datasets of small images (CIFAR-size, Fashion-MNIST, the embedded set) a data loader costs more than the model:
decoding, per-image transforms and a host-to-device copy of every batch. With ``--device-data`` the images go
through the evaluation transform once (resize and centre crop, uint8), stay on the device, and each training batch
is made there by one gather: the random crop with reflect padding of the CIFAR-style transform
(:func:`timm_patchmix.data.small_image_transform`) and the horizontal and vertical flips, each with its own probability
(timm's ``--hflip``, default 0.5, and ``--vflip``, default 0), become index arithmetic, and normalisation is timm's
``PrefetchLoader`` formula. Batches come in the order of the same ``DistributedSampler`` as the loader path, and
the crops and flips are drawn from the device's default generator, which the epoch loop seeds per epoch and rank,
so a resumed run replays its epochs and every DDP rank trains on its own share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import torch

__all__ = ['DeviceImages', 'crop_flip', 'sample_crop_flip', 'normalise', 'DeviceTrainLoader', 'DeviceEvalLoader',
           'MAX_DEVICE_SIZE']

MAX_DEVICE_SIZE = 64  # the largest input side that takes the small-image (CIFAR-style) transform


@dataclass
class DeviceImages:
    """uint8 images ``[N, C, H, W]`` and int64 labels ``[N]``, both on one device."""
    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @classmethod
    def from_dataset(cls, dataset, transform, device: torch.device, workers: int = 0,
                     batch_size: int = 1024) -> 'DeviceImages':
        """Run ``transform`` (ending in uint8 CHW numpy, the prefetcher form) over ``dataset`` once and keep the
        result on ``device``. Raises ``MemoryError`` naming the sizes when the set would take more than half of the
        device's free memory."""
        from timm.data.loader import fast_collate
        own = dataset.transform
        dataset.transform = transform
        try:
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                                 collate_fn=fast_collate)
            parts = list(loader)
        finally:
            dataset.transform = own
        images = torch.cat([p[0] for p in parts])
        labels = torch.cat([p[1] for p in parts]).to(torch.long)
        need = images.numel() * images.element_size() + labels.numel() * 8
        if device.type == 'cuda':
            free, _ = torch.cuda.mem_get_info(device)
            if need > free // 2:
                raise MemoryError(f'--device-data: the {len(labels)} images of {list(images.shape[1:])} take '
                                  f'{need / 2 ** 20:.0f} MiB, more than half of the {free / 2 ** 20:.0f} MiB free on '
                                  f'{device}; drop --device-data to stream them through the data loader')
        return cls(images.to(device), labels.to(device))


def _reflect(pos: torch.Tensor, size: int) -> torch.Tensor:
    """Positions outside ``[0, size)`` mirrored back in without repeating the edge (numpy's 'reflect', as
    torchvision's ``padding_mode='reflect'``); valid for overshoots below ``size``."""
    pos = pos.abs()
    return torch.where(pos > size - 1, 2 * (size - 1) - pos, pos)


def crop_flip(images: torch.Tensor, index: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor,
              pad: int, vflip: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``images[index]`` reflect-padded by ``pad``, cropped back to ``H x W`` at ``(top, left)`` of the padded
    image (each in ``[0, 2 * pad]``), flipped left-right where ``flip`` and upside down where ``vflip`` (bool
    ``[B]``; ``None``: no vertical flips): one gather, dtype kept.

    Pixel for pixel what ``RandomCrop(size, padding=pad, padding_mode='reflect')``, then ``hflip`` where ``flip``,
    then ``vflip`` where ``vflip`` give for the same offsets and flips (timm's order; the two flips commute)."""
    _, c, h, w = images.shape
    dev = images.device
    i = torch.arange(h, device=dev)
    if vflip is not None:
        i = torch.where(vflip[:, None], (h - 1) - i, i)  # a vertical flip reads the crop's rows backwards
    rows = _reflect(top[:, None] + i - pad, h)  # [B, H] source rows
    j = torch.arange(w, device=dev)
    j = torch.where(flip[:, None], (w - 1) - j, j)  # a flip reads the crop's columns backwards
    cols = _reflect(left[:, None] + j - pad, w)  # [B, W] source columns
    chans = torch.arange(c, device=dev)
    return images[index[:, None, None, None], chans[None, :, None, None], rows[:, None, :, None],
                  cols[:, None, None, :]]


def _check_probability(name: str, p: float) -> float:
    if not 0.0 <= p <= 1.0:  # also refuses NaN
        raise ValueError(f'{name} must be a probability in [0, 1], got {p}')
    return float(p)


def sample_crop_flip(n: int, pad: int, device, generator: Optional[torch.Generator] = None, hflip: float = 0.5,
                     vflip: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Crop offsets ``top, left`` uniform in ``[0, 2 * pad]`` (as ``RandomCrop`` draws them), a horizontal flip
    mask true with probability ``hflip`` and a vertical one true with probability ``vflip``, all drawn on ``device``
    without a host sync. Returns ``(top, left, hflip_mask, vflip_mask)``.

    The offsets and the horizontal mask are always drawn, in that order (so the stream does not depend on
    ``hflip``); the vertical mask takes a draw of its own only when ``vflip > 0`` and is all false otherwise, which
    leaves the default ``hflip=0.5, vflip=0`` stream that of a plain crop and fair-coin flip."""
    hflip, vflip = _check_probability('hflip', hflip), _check_probability('vflip', vflip)
    off = torch.randint(0, 2 * pad + 1, (2, n), device=device, generator=generator)
    hmask = torch.rand(n, device=device, generator=generator) < hflip
    if vflip > 0:
        vmask = torch.rand(n, device=device, generator=generator) < vflip
    else:
        vmask = torch.zeros(n, dtype=torch.bool, device=device)
    return off[0], off[1], hmask, vmask


def normalise(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 ``(x - 255 * mean) / (255 * std)``, timm's ``PrefetchLoader`` arithmetic."""
    return x.float().sub_(mean).div_(std)


def _scaled(values: Sequence[float], channels: int, device) -> torch.Tensor:
    from timm.data.loader import adapt_to_chs
    return torch.tensor([v * 255 for v in adapt_to_chs(values, channels)], device=device).view(1, channels, 1, 1)


class DeviceTrainLoader:
    """Training batches ``(float32 [B, C, H, W] normalised, int64 [B])`` made on the device, whole batches only.

    ``sampler`` gives this process's indices of each epoch (the epoch loop calls its ``set_epoch``); ``pad`` is the
    crop padding (0: no crop); each image is flipped left-right with probability ``hflip`` and upside down with
    probability ``vflip`` (timm's ``--hflip`` and ``--vflip``)."""

    def __init__(self, data: DeviceImages, sampler, batch_size: int, mean, std, pad: int, hflip: float = 0.5,
                 vflip: float = 0.0):
        h, w = data.images.shape[-2:]
        if pad >= min(h, w):
            raise ValueError(f'crop padding {pad} must be below the image side ({h}x{w}) for reflect padding')
        self.data, self.sampler, self.batch_size = data, sampler, batch_size
        self.pad = pad
        self.hflip, self.vflip = _check_probability('hflip', hflip), _check_probability('vflip', vflip)
        dev, c = data.images.device, data.images.shape[1]
        self.mean, self.std = _scaled(mean, c, dev), _scaled(std, c, dev)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        dev = self.data.images.device
        order = torch.as_tensor(list(iter(self.sampler)), dtype=torch.long).to(dev)  # once per epoch
        for k in range(len(self)):
            index = order[k * self.batch_size:(k + 1) * self.batch_size]
            top, left, flip, vflip = sample_crop_flip(index.shape[0], self.pad, dev, hflip=self.hflip,
                                                      vflip=self.vflip)
            x = crop_flip(self.data.images, index, top, left, flip, self.pad, vflip if self.vflip > 0 else None)
            yield normalise(x, self.mean, self.std), self.data.labels[index]


class DeviceEvalLoader:
    """Evaluation batches of the images at ``indices`` (this process's share), in order, normalised."""

    def __init__(self, data: DeviceImages, indices: Sequence[int], batch_size: int, mean, std):
        self.data, self.batch_size = data, batch_size
        self.indices = torch.as_tensor(list(indices), dtype=torch.long).to(data.images.device)
        c = data.images.shape[1]
        self.mean, self.std = _scaled(mean, c, data.images.device), _scaled(std, c, data.images.device)

    def __len__(self) -> int:
        return (self.indices.shape[0] + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for k in range(len(self)):
            index = self.indices[k * self.batch_size:(k + 1) * self.batch_size]
            yield normalise(self.data.images[index], self.mean, self.std), self.data.labels[index]
