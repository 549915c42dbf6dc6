"""The tensors of a ``search_state.safetensors`` (individuals as padded arrays) and the checks before a resume uses
one: types and ranges of its metadata, shapes, dtypes and ranges of its tensors. Errors are
:class:`~timm_patchmix.checkpoint.CheckpointError`s naming the file, the field and the bad value."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..checkpoint import CheckpointError
from ..validation import Fields, check_python_rng, is_int
from .genome import Individual

__all__ = ['pack_individuals', 'unpack_individuals', 'check_search_meta', 'check_search_tensors']


def pack_individuals(inds: List[Individual], prefix: str, n_active: int) -> Dict[str, torch.Tensor]:
    """``<prefix>.active`` (pair indices padded with -1 to ``n_active``), ``.masks`` and ``.fitness`` (NaN where
    not evaluated) of ``inds``; nothing for none."""
    if not inds:
        return {}
    active = np.full((len(inds), n_active), -1, dtype=np.int64)
    for r, ind in enumerate(inds):
        active[r, :len(ind.active)] = ind.active
    return {f'{prefix}.active': torch.from_numpy(active),
            f'{prefix}.masks': torch.from_numpy(np.stack([ind.masks for ind in inds])),
            f'{prefix}.fitness': torch.tensor([ind.fitness.values[0] if ind.fitness.valid else float('nan')
                                               for ind in inds], dtype=torch.float64)}


def unpack_individuals(t: Dict[str, torch.Tensor], prefix: str, fitness_cls) -> List[Individual]:
    """The individuals :func:`pack_individuals` wrote under ``prefix`` (none when absent)."""
    if f'{prefix}.active' not in t:
        return []
    out = []
    for a, m, f in zip(t[f'{prefix}.active'].numpy(), t[f'{prefix}.masks'].numpy(), t[f'{prefix}.fitness'].numpy()):
        ind = Individual(a[a >= 0].copy(), m.copy(), fitness_cls())
        if not np.isnan(f):
            ind.fitness.values = (float(f),)
        out.append(ind)
    return out


def check_search_meta(path: str, meta: Dict[str, Any]) -> None:
    """The metadata fields a resume reads: generation, logbook, best history, RNG states, counters, grid."""
    f = Fields(path, CheckpointError)
    gen = f.int(meta.get('generation'), 'generation', lo=0)
    for k, row in enumerate(f.list(meta.get('logbook'), 'logbook', gen + 1)):
        f.dict(row, f'logbook[{k}]')
        if row.get('gen') != k or not is_int(row.get('gen')):
            f.fail(f'logbook[{k}].gen', f'{k}', row.get('gen'))
    for k, v in enumerate(f.list(meta.get('best_history'), 'best_history', gen + 1)):
        f.number(v, f'best_history[{k}]', finite=True)
    f.int(meta.get('forward_images'), 'forward_images', lo=0)
    f.grid(meta.get('grid'), 'grid')
    f.int(meta.get('num_classes'), 'num_classes', lo=1)
    f.str(meta.get('fingerprint'), 'fingerprint', nonempty=True)
    f.dict(meta.get('rng_numpy'), 'rng_numpy')
    check_python_rng(f, meta.get('rng_python'), 'rng_python')
    for key in ('args', 'settings'):
        if meta.get(key) is not None:
            f.dict(meta[key], key)


def _tensor(f: Fields, t: Dict[str, torch.Tensor], name: str, dtype: torch.dtype, shape: Tuple[Optional[int], ...]
            ) -> np.ndarray:
    if name not in t:
        raise f.error(f'{f.where}: the tensor {name!r} is missing')
    x = t[name]
    if x.dtype != dtype or x.ndim != len(shape) or any(s is not None and s != n for s, n in zip(shape, x.shape)):
        want = 'x'.join('N' if s is None else str(s) for s in shape)
        raise f.error(f'{f.where}: the tensor {name} must be {str(dtype).replace("torch.", "")} of shape [{want}], '
                      f'got {str(x.dtype).replace("torch.", "")} of shape {list(x.shape)}')
    return x.numpy()


def _individuals(f: Fields, t: Dict[str, torch.Tensor], prefix: str, n_active: int, num_cross: int, n_pairs: int,
                 full: int, at_least: int, at_most: Optional[int]) -> None:
    if f'{prefix}.active' not in t and at_least == 0:
        return
    active = _tensor(f, t, f'{prefix}.active', torch.int64, (None, n_active))
    p = len(active)
    if p < at_least or (at_most is not None and p > at_most):
        f.fail(f'{prefix}.active', f'{at_least} to {at_most if at_most is not None else "any number of"} '
                                   f'individuals', f'{p} individuals')
    masks = _tensor(f, t, f'{prefix}.masks', torch.int64, (p, n_pairs))
    fitness = _tensor(f, t, f'{prefix}.fitness', torch.float64, (p,))
    for r, row in enumerate(active):
        a = row[row >= 0]
        if (row < -1).any() or (a >= num_cross).any() or len(a) == 0 or (np.diff(a) <= 0).any() \
                or (row[len(a):] != -1).any():
            f.fail(f'{prefix}.active[{r}]', f'sorted distinct pair indices in [0, {num_cross}) padded with -1',
                   row.tolist())
    if (masks < 0).any() or (masks > full).any():
        r = int(np.flatnonzero(((masks < 0) | (masks > full)).any(1))[0])
        f.fail(f'{prefix}.masks[{r}]', f'masks in [0, {full}] (the grid\'s cells)', masks[r].tolist())
    if not np.isfinite(fitness).all():
        f.fail(f'{prefix}.fitness', 'finite numbers', fitness.tolist())


def check_search_tensors(path: str, t: Dict[str, torch.Tensor], *, grid: Tuple[int, int], n_pairs: int,
                         num_cross: int, n_active: int, hof_size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Population, hall of fame, gene-score cache and RNG tensors; returns the cache as ``(pair indices, masks,
    scores)`` (a state of an earlier version, with one int64 key per gene, is read where its keys were exact)."""
    f = Fields(path, CheckpointError)
    cells = grid[0] * grid[1]
    full = (1 << cells) - 1
    _individuals(f, t, 'pop', n_active, num_cross, n_pairs, full, 1, None)
    _individuals(f, t, 'hof', n_active, num_cross, n_pairs, full, 0, hof_size)
    scores = _tensor(f, t, 'cache.scores', torch.float64, (None,))
    n = len(scores)
    if 'cache.pairs' in t:
        pairs = _tensor(f, t, 'cache.pairs', torch.int64, (n,))
        masks = _tensor(f, t, 'cache.masks', torch.int64, (n,))
    else:  # one key per gene, pair * 2**cells + mask, exact only where the largest fits in 63 bits
        keys = _tensor(f, t, 'cache.keys', torch.int64, (n,))
        if (n_pairs - 1) >= (1 << (63 - cells)):
            raise f.error(f'{f.where} was written by an earlier version whose gene-score cache keys overflow for a '
                          f'{grid[0]}x{grid[1]} grid with {n_pairs} pairs; start this search afresh (without '
                          f'--resume, or in another --output)')
        if (keys < 0).any():
            f.fail('cache.keys', 'non-negative keys', keys[keys < 0][:5].tolist())
        pairs, masks = keys >> cells, keys & full
    if ((pairs < 0) | (pairs >= n_pairs)).any():
        f.fail('cache.pairs', f'pair indices in [0, {n_pairs})', pairs[(pairs < 0) | (pairs >= n_pairs)][:5].tolist())
    if ((masks < 0) | (masks > full)).any():
        f.fail('cache.masks', f'masks in [0, {full}]', masks[(masks < 0) | (masks > full)][:5].tolist())
    if not np.isfinite(scores).all():
        f.fail('cache.scores', 'finite numbers', scores[~np.isfinite(scores)][:5].tolist())
    if len(np.unique(np.stack([pairs, masks], 1), axis=0)) != n:
        raise f.error(f'{f.where}: the gene-score cache holds a gene twice')
    rng = _tensor(f, t, 'rng.torch', torch.uint8, (None,))
    if len(rng) != torch.get_rng_state().numel():
        f.fail('rng.torch', f'{torch.get_rng_state().numel()} bytes of torch RNG state', f'{len(rng)} bytes')
    return pairs, masks, scores
