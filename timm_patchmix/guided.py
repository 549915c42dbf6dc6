"""Guided PatchMix: the mixer that trains on a searched mask table (the paper's fourth phase).

The table itself (schema, fingerprint, validated load) lives in :mod:`timm_patchmix.table`; its names are imported
here too, where earlier versions defined them."""
from __future__ import annotations

import os
from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from .grid import GridSpec, to_grid
from .mix import PatchMix, PatchMixParams, _number
from .table import SCHEMA_VERSION, MaskTable, MaskTableError, check_run_values, dataset_fingerprint

__all__ = ['MaskTable', 'MaskTableError', 'dataset_fingerprint', 'SCHEMA_VERSION', 'GuidedPatchMix', 'ClassMemory']


class ClassMemory:
    """The last ``size`` images seen of every class, so a guided sample finds a partner of the class it needs
    even when the batch holds none (a batch of 128 from 100 classes usually misses the partner class)."""

    def __init__(self, num_classes: int, size: int = 4):
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f'memory_size must be a positive int, got {size!r}')
        size = int(size)
        self.num_classes, self.size = num_classes, size
        self.images: Optional[torch.Tensor] = None  # [num_classes, size, C, H, W]
        self.count = torch.zeros(num_classes, dtype=torch.long)
        self.next = torch.zeros(num_classes, dtype=torch.long)

    def update(self, x: torch.Tensor, labels: torch.Tensor) -> None:
        """Remember the last ``size`` images of each class in ``x [B, C, H, W]`` (copies)."""
        self.commit(self.take(x, labels))

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the remembered images have the image shape, dtype and device of the batch ``x [B, C, H, W]``."""
        return (self.images is not None and self.images.shape[2:] == x.shape[1:] and self.images.device == x.device
                and self.images.dtype == x.dtype)

    def take(self, x: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the images :meth:`update` remembers from ``x``, with their classes and ranks, for a later
        :meth:`commit`; the memory itself is not changed (a caller that fails between the two leaves it as it was)."""
        # the memory outlives this call: never let it become an inference tensor that a later call, outside
        # inference_mode, could not write to
        with torch.inference_mode(False):
            lab = labels.cpu().long()
            n = len(lab)
            order = torch.sort(lab, stable=True).indices                      # samples grouped by class, in order
            sorted_lab = lab[order]
            counts = torch.bincount(lab, minlength=self.num_classes)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(n) - starts[sorted_lab]                         # position within its class
            keep = rank >= counts[sorted_lab] - self.size                       # the last `size` of each class
            cls = sorted_lab[keep]
            rank = rank[keep] - (counts[cls] - self.size).clamp(min=0)
            # (without the batch's autograd history: a later batch mixed with these images must not reach it)
            return cls, rank, x[order[keep].to(x.device)].detach()

    def commit(self, taken: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Remember the images of a :meth:`take`."""
        cls, rank, images = taken
        with torch.inference_mode(False):
            if not self.fits(images):
                self.images = torch.empty((self.num_classes, self.size, *images.shape[1:]), dtype=images.dtype,
                                          device=images.device)
                self.count.zero_()
                self.next.zero_()
            slots = (self.next[cls] + rank) % self.size
            dev = images.device
            self.images[cls.to(dev), slots.to(dev)] = images
            added = torch.bincount(cls, minlength=self.num_classes)
            self.next = (self.next + added) % self.size
            self.count = torch.clamp(self.count + added, max=self.size)

    def clear(self) -> None:
        """Forget every image (a new epoch starts with an empty memory, as in a fresh loader worker)."""
        self.images = None
        self.count.zero_()
        self.next.zero_()

    def has(self, c: int) -> bool:
        return bool(self.count[c] > 0)

    def pick(self, c: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        k = int(torch.randint(int(self.count[c]), (1,), generator=generator))
        return self.images[c, k]


class GuidedPatchMix:
    """Mix a batch into clean, random-PatchMix and guided samples, used like ``PatchMix``.

    A guided sample of class c takes a searched pair (c, d) or (d, c) from the mask table, a partner image of class d
    (from the batch, else from a per-class memory of recent images) and that pair's mask. Eligible samples (a class in
    the table and a partner available) are chosen with probability ``min(1, guided_prob * B / eligible)`` so that the
    guided fraction of the batch meets ``guided_prob`` even when some classes have no pair, as long as the batch holds
    that many eligible samples; when it holds fewer (a table that covers few of the batch's classes), all of them
    are chosen and the fraction falls short, without a warning. ``random_prob`` of the batch gets
    random PatchMix; the rest stays clean. Targets are packed like ``PatchMix``'s (see ``split_target``).

    Defaults: a third each, the paper's three sources of training samples (originals, random masks, searched
    masks) given equal weight.
    """

    def __init__(self, table: Union[MaskTable, str, os.PathLike], guided_prob: float = 1 / 3,
                 random_prob: float = 1 / 3,
                 num_classes: Optional[int] = None, label_smoothing: float = 0.0, grid: Optional[GridSpec] = None,
                 fingerprint: Optional[str] = None, memory_size: int = 4, alpha: float = 1.0):
        check_run_values(num_classes, fingerprint)
        if isinstance(table, (str, os.PathLike)):
            table = MaskTable.load(os.fspath(table), grid=to_grid(grid) if grid is not None else None,
                                   num_classes=num_classes, fingerprint=fingerprint)
        elif not isinstance(table, MaskTable):
            raise ValueError(f'table must be a MaskTable or the path of a mask table file, got {type(table).__name__}')
        else:
            table = table.checked()  # built in Python: checked as a loaded table is
            if grid is not None and to_grid(grid) != table.grid:
                raise MaskTableError(f'mask table grid {table.grid} differs from the run grid {to_grid(grid)}')
            if num_classes is not None and num_classes != table.num_classes:
                raise MaskTableError(f'mask table is for {table.num_classes} classes, this run has {num_classes}')
            if fingerprint is not None and fingerprint != table.fingerprint:
                raise MaskTableError(f'mask table was searched on another dataset (fingerprint {table.fingerprint}, '
                                     f'this run {fingerprint})')
        guided_prob = _number(guided_prob, 'guided_prob', 0.0, 1.0)
        random_prob = _number(random_prob, 'random_prob', 0.0, 1.0)
        if guided_prob + random_prob > 1:
            raise ValueError(f'guided_prob ({guided_prob}) and random_prob ({random_prob}) must sum to at most 1')
        self.table = table
        self.guided_prob, self.random_prob = guided_prob, random_prob
        self.num_classes = table.num_classes
        self.mixer = PatchMix(grid=table.grid, alpha=alpha, prob=1.0, mode='elem', label_smoothing=label_smoothing,
                              num_classes=self.num_classes)
        self.memory = ClassMemory(self.num_classes, memory_size)
        # for every class, the table entries it takes part in, as (partner class, keep mask for this class)
        self.options: List[List[Tuple[int, torch.Tensor]]] = [[] for _ in range(self.num_classes)]
        for (i, j), m in zip(table.pairs, table.masks):
            mt = torch.as_tensor(np.asarray(m, dtype=bool))
            self.options[i].append((j, mt))
            if i != j:
                self.options[j].append((i, ~mt))
        # the same options flat, grouped by owner class in that order, for the vectorised draw in ``sample``
        flat = [(c, d, m) for c in range(self.num_classes) for d, m in self.options[c]]
        rows, cols = table.grid
        self._opt_owner = torch.tensor([o[0] for o in flat], dtype=torch.long)
        self._opt_partner = torch.tensor([o[1] for o in flat], dtype=torch.long)
        self._opt_mask = (torch.stack([o[2] for o in flat]) if flat
                          else torch.zeros(0, rows, cols, dtype=torch.bool))
        self.mixup_enabled = True
        self.last_counts = {'clean': 0, 'random': 0, 'guided': 0}

    @property
    def grid(self) -> Tuple[int, int]:
        return self.table.grid

    def sample(self, labels: torch.Tensor, *, generator: Optional[torch.Generator] = None
               ) -> Tuple[PatchMixParams, torch.Tensor, List[int]]:
        """Params for a batch with class ``labels [B]``: ``(params over B, guided flags [B], memory classes)``.

        Partners with index >= B refer to extra images appended after the batch from the class memory, in the
        order of the returned class list.
        """
        # one copy to the host (a sync on an accelerator), then every check and draw there
        lab = self._check_labels(labels.cpu() if isinstance(labels, torch.Tensor) else labels).long()
        b = len(lab)
        base = self.mixer.sample(b, generator=generator)
        partner, mask = base.partner.clone(), base.mask.clone()
        guided = torch.zeros(b, dtype=torch.bool)
        if not self.mixup_enabled:
            return PatchMixParams.identity(b, self.grid), guided, []
        c = self.num_classes
        count = torch.bincount(lab, minlength=c)
        # an option (c, d) is open when an image of class d is in the batch (for d == c that may be the sample
        # itself, which then finds no partner and stays unguided) or in the memory
        is_open = ((count > 0) | (self.memory.count > 0))[self._opt_partner]
        open_per_class = torch.zeros(c, dtype=torch.long).index_add_(0, self._opt_owner, is_open.long())
        n_open = open_per_class[lab]
        eligible = n_open > 0
        n_eligible = int(eligible.sum())
        u = torch.rand(b, generator=generator)
        p_guided = min(1.0, self.guided_prob * b / n_eligible) if n_eligible else 0.0
        chosen = (eligible & (u < p_guided)).nonzero().flatten()
        extra: List[int] = []
        if len(chosen):
            # each chosen sample: a uniform open option of its class, then a uniform partner of that option's class
            # from the batch (not itself), else from the memory
            v_option, v_partner = torch.rand(2, len(chosen), generator=generator)
            open_rank = torch.cumsum(is_open.long(), 0) - 1
            rank_in_class = open_rank - (torch.cumsum(open_per_class, 0) - open_per_class)[self._opt_owner]
            by_rank = torch.full((c, int(open_per_class.max())), -1, dtype=torch.long)
            k_open = is_open.nonzero().flatten()
            by_rank[self._opt_owner[k_open], rank_in_class[k_open]] = k_open
            own = lab[chosen]
            pick = torch.minimum((v_option * n_open[chosen]).long(), n_open[chosen] - 1)
            option = by_rank[own, pick]
            d = self._opt_partner[option]
            same = (d == own).long()
            choices = count[d] - same
            order = torch.sort(lab, stable=True).indices  # the batch grouped by class, in index order
            start = torch.cumsum(count, 0) - count
            place = torch.empty(b, dtype=torch.long)
            place[order] = torch.arange(b)
            r = torch.minimum((v_partner * choices).long(), (choices - 1).clamp(min=0))
            r = r + same * (r >= place[chosen] - start[own]).long()  # step over the sample itself
            in_batch = choices > 0
            from_memory = ~in_batch & (self.memory.count[d] > 0)
            take = in_batch | from_memory
            slot = torch.cumsum(from_memory.long(), 0) - 1
            new_partner = torch.where(in_batch, order[(start[d] + r).clamp(max=b - 1)], b + slot)
            rows = chosen[take]
            partner[rows] = new_partner[take]
            mask[rows] = self._opt_mask[option[take]]
            guided[rows] = True
            extra = d[from_memory].tolist()
        # the rest: random PatchMix with random_prob of the whole batch, clean otherwise
        rest = (~guided).nonzero().flatten()
        if len(rest):
            p_random = min(1.0, self.random_prob * b / len(rest))
            clean = rest[torch.rand(len(rest), generator=generator) >= p_random]
            partner[clean] = clean
            mask[clean] = True
        return PatchMixParams(partner, mask), guided, extra

    def _check_labels(self, labels) -> torch.Tensor:
        if labels is None:
            raise ValueError('GuidedPatchMix needs class-index targets [B] to find partners by class, got None')
        if not isinstance(labels, torch.Tensor):  # a list or numpy array of class indices, as PatchMix takes
            labels = torch.as_tensor(labels)
        if labels.ndim != 1:
            raise ValueError('GuidedPatchMix needs class-index targets [B] to find partners by class')
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f'GuidedPatchMix targets must be integer class indices, got dtype {labels.dtype}')
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f'target labels must lie in [0, {self.num_classes}) for num_classes={self.num_classes}, '
                             f'got min {int(labels.min())} and max {int(labels.max())}')
        return labels

    def __call__(self, x: torch.Tensor, target: torch.Tensor, generator: Optional[torch.Generator] = None, *,
                 fresh: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Mix ``x [B, C, H, W]`` with class-index ``target [B]`` in place, as ``PatchMix`` does; returns
        ``(x, packed_target)``. ``fresh`` is :meth:`PatchMix.apply`'s."""
        self.mixer._check_image(x)
        if target is None:
            self._check_labels(target)  # (names it)
        if not isinstance(target, torch.Tensor):  # a list or numpy array of class indices, as PatchMix takes
            target = torch.as_tensor(target)
        if target.ndim == 1 and target.shape[0] != x.shape[0]:
            # checked before anything is drawn or remembered: a failed call leaves the class memory as it was
            raise ValueError(f'target batch size {target.shape[0]} does not match the image batch size {x.shape[0]}')
        kept = None
        if self.memory.images is not None and not self.memory.fits(x):
            # remembered images of another size or dtype than this batch's are no partners for it, and sample
            # reads the memory's counts: this call starts from an empty memory, which replaces the old one once the
            # mix succeeds (a failed call leaves the old one in place)
            kept, self.memory = self.memory, ClassMemory(self.num_classes, self.memory.size)
        try:
            params, guided, extra = self.sample(target, generator=generator)
            source = None
            if extra:
                mem = torch.stack([self.memory.pick(c, generator) for c in extra]).to(x.device)
                source = (torch.cat([x, mem]),
                          torch.cat([target, torch.tensor(extra, dtype=target.dtype, device=target.device)]))
            taken = self.memory.take(x, target)  # the clean images, before x is mixed; kept once the mix succeeds
            # params made here, valid by construction: _apply skips the value checks that read them back
            src_x, src_t = (None, None) if source is None else source
            mixed, packed = self.mixer._apply(x, target, params.to(x.device), src_x, src_t, fresh=fresh)
        except BaseException:
            if kept is not None:
                self.memory = kept
            raise
        self.memory.commit(taken)
        n_guided = int(guided.sum())
        n_clean = int((params.mask.flatten(1).all(1) & ~guided).sum())
        self.last_counts = {'guided': n_guided, 'clean': n_clean, 'random': len(guided) - n_guided - n_clean}
        return mixed, packed
