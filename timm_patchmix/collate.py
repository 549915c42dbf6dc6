"""FastCollatePatchMix: PatchMix applied while collating uint8 images, a drop-in timm ``FastCollateMixup``."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from timm.data import FastCollateMixup
from torch.utils.data import default_collate, get_worker_info

from .grid import GridSpec
from .mix import PatchMix, PatchMixParams

__all__ = ['FastCollatePatchMix', 'FastCollateGuidedPatchMix']


def _mixer_setting(name: str) -> property:
    """A collate-mixer attribute that is the setting ``name`` of its batch mixer (``_batch_mixer()``)."""
    return property(lambda self: getattr(self._batch_mixer(), name),
                    lambda self, value: setattr(self._batch_mixer(), name, value),
                    doc=f"the batch mixer's ``{name}``")


class FastCollatePatchMix(FastCollateMixup):
    """Collate ``[(uint8 CHW image, label), ...]`` into ``(uint8 [B, C, H, W], packed target)`` with PatchMix.

    Pass it as ``collate_fn`` to timm's ``create_loader``; ``PrefetchLoader.mixup_enabled`` switches mixing on
    and off as it does for ``FastCollateMixup``. For the same params, pixels and targets equal those of
    :class:`~timm_patchmix.PatchMix` applied to the same uint8 batch. Arguments are those of ``PatchMix``.

    Every call returns a new batch tensor, as timm's ``fast_collate`` does, and keeps nothing between calls: a
    DataLoader worker hands its batch to the main process and never touches that memory again. In a worker the
    batch is made in shared memory (as ``default_collate`` makes it there), so sending it copies nothing.
    """

    def __init__(self, grid: GridSpec = 4, alpha: float = 1.0, prob: float = 1.0, mode: str = 'elem',
                 label_smoothing: float = 0.0, num_classes: Optional[int] = None):
        self.mixer = PatchMix(grid=grid, alpha=alpha, prob=prob, mode=mode, label_smoothing=label_smoothing,
                              num_classes=num_classes)
        # timm's attributes, so code that inspects a FastCollateMixup sees consistent values; mode, mix_prob,
        # label_smoothing, num_classes and mixup_enabled are the mixer's own (the properties below)
        super().__init__(mixup_alpha=0.0, cutmix_alpha=0.0, prob=prob, mode=mode,
                         label_smoothing=label_smoothing, num_classes=num_classes)

    def _switched(self):
        """The mixers that ``mixup_enabled`` switches on and off."""
        return [self.mixer]

    def _batch_mixer(self) -> PatchMix:
        """The mixer whose settings timm's ``mode``, ``mix_prob`` and ``label_smoothing`` are."""
        return self.mixer

    # timm's FastCollateMixup reads these at every call, so a change takes effect at the next batch; here they are
    # the mixer's settings, checked as the mixer checks them (a bad value is an error naming it)
    mode = _mixer_setting('mode')
    mix_prob = _mixer_setting('prob')
    label_smoothing = _mixer_setting('label_smoothing')

    @property
    def num_classes(self) -> int:
        return self._batch_mixer().num_classes

    @num_classes.setter
    def num_classes(self, value: int) -> None:
        self._set_num_classes(value)

    def _set_num_classes(self, value: int) -> None:
        self.mixer.num_classes = value

    @property
    def mixup_enabled(self) -> bool:
        return self.mixer.mixup_enabled

    @mixup_enabled.setter
    def mixup_enabled(self, value: bool) -> None:
        for m in self._switched():
            m.mixup_enabled = bool(value)

    @property
    def grid(self) -> Tuple[int, int]:
        return self.mixer.grid

    def sample(self, batch_size: int, *, generator: Optional[torch.Generator] = None) -> PatchMixParams:
        """Draw params for a batch of ``batch_size`` (see ``PatchMix.sample``)."""
        return self.mixer.sample(batch_size, generator=generator)

    def stack(self, batch: Sequence[Tuple[object, object]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Copy the images of ``batch`` into a new uint8 ``[B, C, H, W]`` tensor; collate the labels into
        class indices ``[B]``."""
        if len(batch) == 0:
            raise ValueError('cannot collate an empty batch')
        for i, b in enumerate(batch):
            # timm's collates read a sample's first two fields and leave any further ones (an index, a path)
            if isinstance(b, (str, bytes)) or not isinstance(b, Sequence) or len(b) < 2:
                what = f'a {type(b).__name__} of {len(b)}' if isinstance(b, (tuple, list)) else type(b).__name__
                raise ValueError(f'collate expects (image, label, ...) samples, got {what} at index {i}')
        first = batch[0][0]
        shape = getattr(first, 'shape', None)
        if shape is None:
            raise ValueError(f'collate expects CHW numpy arrays or tensors, got {type(first).__name__} at index 0')
        shape = tuple(shape)
        if len(shape) != 3:
            raise ValueError(f'collate expects CHW images, got an image of shape {list(shape)}')
        images = []
        for i, b in enumerate(batch):
            img = b[0]
            # (a flipped view has negative strides, which torch.from_numpy refuses: copied, as timm's collates do)
            t = torch.from_numpy(np.ascontiguousarray(img)) if isinstance(img, np.ndarray) else img
            if not isinstance(t, torch.Tensor):
                raise ValueError(f'collate expects numpy arrays or tensors, got {type(img).__name__} at index {i}')
            if t.dtype != torch.uint8:
                raise ValueError(f'collate expects uint8 images, got {t.dtype} at index {i}')
            if tuple(t.shape) != shape:
                raise ValueError(f'image {i} has shape {list(t.shape)}, image 0 has {list(shape)}')
            images.append(t)
        if get_worker_info() is not None and all(t.device.type == 'cpu' for t in images):
            # In a DataLoader worker the batch reaches the main process through shared memory. A private tensor
            # is copied there when the worker sends it; default_collate stacks straight into a new
            # shared-memory tensor instead, which spares that copy of the whole batch.
            out = default_collate(images)
        else:
            # a new array on every call; numpy asks the kernel for transparent huge pages for large arrays, which
            # makes the first touch of a fresh batch several times cheaper than 4 KiB pages (torch.empty's)
            out = torch.from_numpy(np.empty((len(batch), *shape), dtype=np.uint8))
            for i, t in enumerate(images):
                out[i].copy_(t)
        labels = [b[1] for b in batch]
        for i, y in enumerate(labels):
            if isinstance(y, (str, bytes)) or y is None:  # (torch's own words for these name no label)
                raise ValueError(f'collate expects class-index labels, got {type(y).__name__} {y!r} at index {i}')
        target = default_collate(labels)
        if not isinstance(target, torch.Tensor):
            target = torch.as_tensor(target)
        return out, target

    def apply(self, batch: Sequence[Tuple[object, object]], params: PatchMixParams) -> Tuple[torch.Tensor, torch.Tensor]:
        """Collate ``batch`` into a new uint8 batch and mix it in place with ``params``."""
        images, target = self.stack(batch)  # a new batch that nothing else has seen yet
        return self.mixer.apply(images, target, params, fresh=True)

    def __call__(self, batch: List[Tuple[object, object]], _=None) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.apply(batch, self.sample(len(batch)))


class FastCollateGuidedPatchMix(FastCollatePatchMix):
    """The collate form of :class:`~timm_patchmix.guided.GuidedPatchMix`: uint8 batches of clean, random-PatchMix
    and guided samples. Each loader worker keeps its own per-class memory of recent images."""

    def __init__(self, table, guided_prob: float = 1 / 3, random_prob: float = 1 / 3,
                 num_classes: Optional[int] = None, label_smoothing: float = 0.0, grid: Optional[GridSpec] = None,
                 fingerprint: Optional[str] = None, memory_size: int = 4, alpha: float = 1.0):
        from .guided import GuidedPatchMix
        self.guided = GuidedPatchMix(table, guided_prob=guided_prob, random_prob=random_prob,
                                     num_classes=num_classes, label_smoothing=label_smoothing, grid=grid,
                                     fingerprint=fingerprint, memory_size=memory_size, alpha=alpha)
        super().__init__(grid=self.guided.grid, num_classes=self.guided.num_classes, label_smoothing=label_smoothing)

    def _switched(self):
        return [self.mixer, self.guided]

    def _batch_mixer(self) -> PatchMix:
        return self.guided.mixer  # the draw of the random-PatchMix samples, and every sample's label smoothing

    def _set_num_classes(self, value: int) -> None:
        if value != self.guided.num_classes:
            raise ValueError(f'num_classes is that of the mask table ({self.guided.num_classes}), got {value!r}')

    def _apart(self, what: str):
        # the inherited sample/apply use the random mixer alone: a replay through them would be Random PatchMix
        raise TypeError(f'FastCollateGuidedPatchMix.{what}: a guided batch\'s params come from its labels and the '
                        f'class memory, which the call updates, so they are not drawn apart from the batch; call '
                        f'it on the batch (collate(batch)), or use GuidedPatchMix.sample(labels) on a tensor batch')

    def sample(self, batch_size: int, *, generator: Optional[torch.Generator] = None) -> PatchMixParams:
        """Not offered (a :class:`TypeError`): guided params depend on the batch's labels and the class memory."""
        self._apart('sample')

    def apply(self, batch: Sequence[Tuple[object, object]],
              params: PatchMixParams) -> Tuple[torch.Tensor, torch.Tensor]:
        """Not offered (a :class:`TypeError`): guided params depend on the batch's labels and the class memory."""
        self._apart('apply')

    def __call__(self, batch: List[Tuple[object, object]], _=None) -> Tuple[torch.Tensor, torch.Tensor]:
        images, target = self.stack(batch)
        return self.guided(images, target, fresh=True)
