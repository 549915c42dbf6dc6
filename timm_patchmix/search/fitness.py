"""Retraining-free fitness: f_T's patch-level accuracy (or loss) on validation images mixed by a gene.

A gene is ``(pair, mask)``. Pair ``p = (c_i, c_j)`` owns K fixed validation image pairs ``(A[p, k], B[p, k])``, drawn
once from the seed (common random numbers). Its score is the mean over the K mixed images and their cells of
"f_T's patch prediction is the label of the image the cell came from" (or of the patch cross-entropy). Scores are
exact functions of the gene, so they are cached: an individual's fitness is the mean of its genes' cached scores,
and every gene is forwarded once in the whole search.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..grid import bits_to_mask, cell_mask_to_pixels
from ..mix import mix_cells_, mix_select_

__all__ = ['GeneScorer', 'TooFewImagesError', 'draw_image_pairs', 'cell_mask_to_pixels']


class TooFewImagesError(ValueError):
    """A class with fewer images than K image pairs need: ``label`` has ``have`` images, ``need`` are needed."""

    def __init__(self, label: int, have: int, need: int, k: int):
        self.label, self.have, self.need, self.k = int(label), int(have), int(need), int(k)
        super().__init__(f'class {label} has {have} validation images, fewer than the {need} that K={k} needs; '
                         f'lower --k or use a larger validation split')


def draw_image_pairs(labels: np.ndarray, pairs: np.ndarray, k: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """For each pair ``(c_i, c_j)``: K distinct images of c_i and K distinct of c_j (2K distinct when i == j);
    :class:`TooFewImagesError` for a class with fewer."""
    rng = np.random.default_rng(seed)
    by_class = {c: np.flatnonzero(labels == c) for c in np.unique(pairs)}
    for c, idx in by_class.items():
        need = 2 * k if any(i == j == c for i, j in pairs) else k
        if len(idx) < need:
            raise TooFewImagesError(c, len(idx), need, k)
    a = np.empty((len(pairs), k), dtype=np.int64)
    b = np.empty((len(pairs), k), dtype=np.int64)
    for p, (i, j) in enumerate(pairs):
        if i == j:
            pick = rng.choice(by_class[i], size=2 * k, replace=False)
            a[p], b[p] = pick[:k], pick[k:]
        else:
            a[p] = rng.choice(by_class[i], size=k, replace=False)
            b[p] = rng.choice(by_class[j], size=k, replace=False)
    return a, b


class GeneScorer:
    """Scores genes in large batched forward passes, memoised; shards new genes across ranks under torchrun.

    Args:
        model: a patch-head model (``forward_patches``), eval mode.
        images: normalised validation images ``[N, C, H, W]`` on the scoring device.
        labels: their classes ``[N]``.
        pairs: ``[P, 2]`` class pairs; a_idx/b_idx: ``[P, K]`` image indices per pair.
        grid: ``(rows, cols)``.
        score: ``'accuracy'`` (patch accuracy) or ``'loss'`` (patch cross-entropy).
        batch_size: images per forward pass.
    """

    def __init__(self, model, images: torch.Tensor, pairs: np.ndarray, a_idx: np.ndarray, b_idx: np.ndarray,
                 grid: Tuple[int, int], score: str = 'accuracy', batch_size: int = 512, amp: bool = False,
                 channels_last: bool = False):
        if score not in ('accuracy', 'loss'):
            raise ValueError(f"score must be 'accuracy' or 'loss', got {score!r}")
        self.model, self.images = model, images
        self.pairs = torch.as_tensor(pairs, dtype=torch.long)
        self.a_idx, self.b_idx = torch.as_tensor(a_idx), torch.as_tensor(b_idx)
        self.k = a_idx.shape[1]
        self.grid = grid
        self.score = score
        self.batch_size = batch_size
        self.amp = amp and images.device.type == 'cuda'
        self.channels_last = channels_last
        self.cache: Dict[int, float] = {}
        self.forward_images = 0
        self.model_seconds = 0.0  # wall time spent scoring new genes (the batches end in a host copy, so it is synced)
        self.bits = 1 << (grid[0] * grid[1])

    def key(self, pair: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Cache keys ``pair * 2**cells + mask``, exact for every grid: int64 while the largest key fits in 63
        bits, else Python ints in an object array (a 7x8 grid leaves 7 bits for the pair index). Both forms give
        the same Python ints in the cache."""
        pair = np.asarray(pair, dtype=np.int64)
        mask = np.asarray(mask, dtype=np.int64)
        cells = self.bits.bit_length() - 1
        if not len(pair) or int(pair.max()) < (1 << (63 - cells)):
            return pair * self.bits + mask
        return np.array([(p << cells) | m for p, m in zip(pair.tolist(), mask.tolist())], dtype=object)

    def cache_arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cache as columns for a state file: ``(pair indices, masks, scores)``, int64, int64, float64."""
        cells = self.bits.bit_length() - 1
        n = len(self.cache)
        scores = np.fromiter(self.cache.values(), dtype=np.float64, count=n)
        try:
            keys = np.fromiter(self.cache.keys(), dtype=np.int64, count=n)
            return keys >> cells, keys & (self.bits - 1), scores
        except OverflowError:
            keys = list(self.cache.keys())
            return (np.array([k >> cells for k in keys], dtype=np.int64),
                    np.array([k & (self.bits - 1) for k in keys], dtype=np.int64), scores)

    def set_cache(self, pairs: np.ndarray, masks: np.ndarray, scores: np.ndarray) -> None:
        """Replace the cache by the columns of :meth:`cache_arrays`."""
        self.cache = dict(zip(self.key(pairs, masks).tolist(), np.asarray(scores, dtype=np.float64).tolist()))

    @torch.inference_mode()
    def score_genes(self, pair: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Score genes directly (no cache): float64 ``[G]``; every gene's K images go through the model."""
        out = np.empty(len(pair), dtype=np.float64)
        if len(pair) == 0:
            return out
        dev = self.images.device
        rows, cols = self.grid
        # the mixer's own in-place functions, chosen for the device as PatchMix.apply chooses
        mix_ = mix_select_ if dev.type == 'cuda' else partial(mix_cells_, fresh=True)
        per = max(1, self.batch_size // self.k)
        pair_t = torch.as_tensor(pair, dtype=torch.long)
        mask_t = torch.as_tensor(mask, dtype=torch.long)
        for s in range(0, len(pair), per):
            gp, gm = pair_t[s:s + per], mask_t[s:s + per]
            g = len(gp)
            keep_k = bits_to_mask(gm, rows, cols).repeat_interleave(self.k, 0).to(dev)  # [g*K, R, C]
            ia, ib = self.a_idx[gp].reshape(-1).to(dev), self.b_idx[gp].reshape(-1).to(dev)
            # a copy of the first images (indexing copies: a fresh tensor), their dropped cells taken from the second
            x = mix_(self.images[ia], ib, keep_k, source=self.images)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(dev.type, enabled=self.amp):
                logits = self.model.forward_patches(x)
            logits = logits.float()                                                    # [g*K, cells, classes]
            ci, cj = self.pairs[gp, 0].to(dev), self.pairs[gp, 1].to(dev)
            target = torch.where(keep_k.view(g * self.k, -1), ci.repeat_interleave(self.k)[:, None],
                                 cj.repeat_interleave(self.k)[:, None])                 # [g*K, cells]
            if self.score == 'accuracy':
                per_cell = (logits.argmax(-1) == target).to(torch.float64)
            else:
                per_cell = F.cross_entropy(logits.transpose(1, 2), target, reduction='none').to(torch.float64)
            out[s:s + g] = per_cell.view(g, -1).mean(1).cpu().numpy()
            self.forward_images += g * self.k
        return out

    def ensure(self, pair: np.ndarray, mask: np.ndarray) -> Tuple[int, int]:
        """Score and cache every gene not cached yet; returns ``(genes looked up, genes newly scored)``.

        Under torch.distributed, rank r scores new genes r, r + W, ... and the scores are all-gathered, so every
        rank ends with the same cache as a single process.
        """
        keys = self.key(pair, mask)
        uniq, first = np.unique(keys, return_index=True)
        new = np.array([k not in self.cache for k in uniq.tolist()], dtype=bool)
        todo = first[new]
        if len(todo):
            t0 = time.perf_counter()
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                scores = self._score_sharded(pair[todo], mask[todo])
            else:
                scores = self.score_genes(pair[todo], mask[todo])
            for k, v in zip(uniq[new].tolist(), scores.tolist()):
                self.cache[k] = v
            self.model_seconds += time.perf_counter() - t0
        return len(keys), int(new.sum())

    def _score_sharded(self, pair: np.ndarray, mask: np.ndarray) -> np.ndarray:
        world, rank = dist.get_world_size(), dist.get_rank()
        mine = self.score_genes(pair[rank::world], mask[rank::world])
        n = len(pair)
        size = -(-n // world)
        dev = self.images.device if dist.get_backend() == 'nccl' else torch.device('cpu')
        buf = torch.full((size,), float('nan'), dtype=torch.float64, device=dev)
        buf[:len(mine)] = torch.from_numpy(mine)
        gathered = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(gathered, buf)
        out = np.empty(n, dtype=np.float64)
        for r in range(world):
            part = gathered[r].cpu().numpy()
            cnt = len(range(r, n, world))
            out[r::world] = part[:cnt]
        return out

    def lookup(self, pair: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.array([self.cache[k] for k in self.key(pair, mask).tolist()], dtype=np.float64)


def aggregate(scores: np.ndarray) -> float:
    """An individual's fitness from its gene scores, summed in a fixed order so every path gives the same float."""
    return float(np.sum(scores) / len(scores)) if len(scores) else float('nan')
