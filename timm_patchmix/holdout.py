"""The held-out validation split: a fixed, seeded fraction of the training split that never trains.

Model selection (the best epoch, ``best.safetensors``, ``--eval-metric``, a plateau schedule) and the search's
fitness read these images, so neither sees the test split. The images are a pure function of the training split's
size, the fraction and the seed::

    hold = Holdout.carve(num_images=5000, fraction=0.1, seed=0)
    hold.held        # 500 sorted indices into the training split, never trained on
    hold.rest        # the 4,500 others, which --train-subset draws from
    hold.record()    # {'fraction', 'seed', 'split', 'split_images', 'images', 'sha256'}, as checkpoints record it

The permutation comes from its own numpy generator (``default_rng([HOLDOUT_STREAM, seed])``), never the global seed,
so the same fraction and seed give the same images in every process and DataLoader worker, whatever ``--seed`` is.
``sha256`` is the hash of the sorted held-out indices as little-endian int64: a reader that rebuilds the split (the
search) checks it, so a dataset that changed under a checkpoint is an error rather than other images.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

__all__ = ['HOLDOUT_STREAM', 'Holdout', 'HoldoutError', 'index_hash', 'holdout_size']

HOLDOUT_STREAM = 0x686F6C64  # 'hold': keeps this generator apart from every other use of the same small seed


class HoldoutError(ValueError):
    """A holdout that cannot be carved (no image held out, or none left to train on) or that no longer matches its
    record."""


def index_hash(indices) -> str:
    """SHA-256 of ``indices`` sorted, as little-endian int64: the identity of an index set."""
    arr = np.sort(np.asarray(list(indices), dtype='<i8'))
    return hashlib.sha256(arr.tobytes()).hexdigest()


def holdout_size(num_images: int, fraction: float) -> int:
    """Images held out of ``num_images``: ``fraction * num_images`` rounded half up, in binary floating point (a
    product that is .5 in decimals may fall just below: 0.29 of 50 is 14). Kept as it is: every recorded holdout
    (a checkpoint's, a search's) was carved by it."""
    return int(np.floor(fraction * num_images + 0.5))


@dataclass(frozen=True)
class Holdout:
    """A carved training split: ``held`` (sorted) and ``rest`` (sorted), disjoint, together ``range(split_images)``."""
    fraction: float
    seed: int
    split: str
    split_images: int
    held: Tuple[int, ...]
    rest: Tuple[int, ...]

    @classmethod
    def carve(cls, num_images: int, fraction: float, seed: int = 0, split: str = 'train') -> 'Holdout':
        """Hold out ``fraction`` of ``num_images`` (0 < fraction < 1) with ``seed``; :class:`HoldoutError` when
        that is no image or all of them."""
        if not 0.0 < fraction < 1.0:
            raise HoldoutError(f'--holdout must be in (0, 1) to carve a held-out split, got {fraction!r}')
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise HoldoutError(f'--holdout-seed must be an integer >= 0, got {seed!r}')
        n = holdout_size(num_images, fraction)
        if n < 1:
            raise HoldoutError(f'--holdout {fraction} of the {num_images} images of split {split!r} holds out no '
                               f'image; raise --holdout')
        if n >= num_images:
            raise HoldoutError(f'--holdout {fraction} of the {num_images} images of split {split!r} leaves no '
                               f'image to train on; lower --holdout')
        perm = np.random.default_rng([HOLDOUT_STREAM, int(seed)]).permutation(num_images)
        return cls(float(fraction), int(seed), split, int(num_images), tuple(sorted(perm[:n].tolist())),
                   tuple(sorted(perm[n:].tolist())))

    @property
    def sha256(self) -> str:
        return index_hash(self.held)

    def record(self) -> Dict[str, Any]:
        """The holdout as checkpoints and run records keep it (JSON values)."""
        return {'fraction': self.fraction, 'seed': self.seed, 'split': self.split,
                'split_images': self.split_images, 'images': len(self.held), 'sha256': self.sha256}

    @classmethod
    def from_record(cls, record: Dict[str, Any], num_images: int, where: str = 'the checkpoint') -> 'Holdout':
        """Carve again the holdout ``record`` describes from a split of ``num_images`` images, checking that it is
        the same index set (:class:`HoldoutError` naming what differs otherwise)."""
        split = record.get('split', 'train')
        if record.get('split_images') is not None and record['split_images'] != num_images:
            raise HoldoutError(f'{where} held out images of split {split!r} when it had {record["split_images"]} '
                               f'images; it has {num_images} now, so the held-out images cannot be found again')
        hold = cls.carve(num_images, float(record['fraction']), int(record['seed']), split)
        if record.get('sha256') is not None and record['sha256'] != hold.sha256:
            raise HoldoutError(f'the held-out images of split {split!r} carved again with fraction '
                               f'{hold.fraction:g} and seed {hold.seed} are not those {where} records (sha256 '
                               f'{hold.sha256[:12]}, recorded {str(record["sha256"])[:12]})')
        return hold

    def subsets(self, train_subset: Optional[int] = None, val_subset: Optional[int] = None,
                subset_seed: int = 0) -> Tuple[list, list]:
        """``(train indices, held-out indices)``: ``--train-subset`` drawn from ``rest``, ``--val-subset`` from
        ``held``, each by the rule of every subset flag (:func:`~timm_patchmix.data.subset_indices`)."""
        from .data import subset_indices
        return subset_indices(self.rest, train_subset, subset_seed), subset_indices(self.held, val_subset, subset_seed)
