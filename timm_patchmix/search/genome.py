"""The search's genome: class pairs, masks as integers, individuals and the paper's operators.

A mask over a ``rows x cols`` grid is an integer whose bit ``k = r * cols + c`` is set when cell (r, c) comes from
the first class's image (the same convention as ``PatchMix``: True keeps the cell from the image itself). An
individual carries an active set of at most N pair indices plus a mask for every pair (the paper's head and tail):
masks of inactive pairs keep evolving and matter again once flip-heads activates their pair. Arrays are numpy, so
an individual for 100 classes (4,950 pairs) is two small arrays rather than a list of Python ints.
"""
from __future__ import annotations

import copy
import itertools
from typing import Optional, Tuple

import numpy as np
from deap import base, creator

from ..grid import bits_to_mask, mask_to_bits

__all__ = ['PairSpace', 'Individual', 'MaskOps', 'fitness_class', 'bits_to_grid', 'grid_to_bits',
           'same_phenotype']


def fitness_class(direction: str):
    """DEAP fitness class: ``'min'`` (lowest score first; the paper's, with patch accuracy) or ``'max'``."""
    name = {'min': 'PatchMixFitnessMin', 'max': 'PatchMixFitnessMax'}[direction]
    if not hasattr(creator, name):
        creator.create(name, base.Fitness, weights=(-1.0,) if direction == 'min' else (1.0,))
    return getattr(creator, name)


# the grid module's conversion under the names the search has always used
bits_to_grid = bits_to_mask
grid_to_bits = mask_to_bits


class PairSpace:
    """The class pairs a search ranges over: all ``(i, j)`` with ``i < j``, then optionally ``(i, i)``."""

    def __init__(self, num_classes: int, same_class_pairs: bool = False):
        self.num_classes = num_classes
        self.cross = list(itertools.combinations(range(num_classes), 2))
        self.same = [(i, i) for i in range(num_classes)] if same_class_pairs else []
        self.pairs = np.array(self.cross + self.same, dtype=np.int64).reshape(-1, 2)
        self.num_cross = len(self.cross)
        self.forced = np.arange(self.num_cross, len(self.pairs), dtype=np.int64)  # same-class: always active

    def __len__(self) -> int:
        return len(self.pairs)


class Individual:
    """Active pair indices (sorted, unique, cross pairs only) and one integer mask per pair of the space."""
    __slots__ = ('active', 'masks', 'fitness')

    def __init__(self, active: np.ndarray, masks: np.ndarray, fitness):
        self.active = np.asarray(active, dtype=np.int64)
        self.masks = np.asarray(masks, dtype=np.int64)
        self.fitness = fitness

    def __deepcopy__(self, memo):
        return Individual(self.active.copy(), self.masks.copy(), copy.deepcopy(self.fitness, memo))

    def genes(self, forced: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """``(pair indices, masks)`` of every gene that counts: the active pairs and the forced ones."""
        idx = np.concatenate([self.active, forced]) if len(forced) else self.active
        return idx, self.masks[idx]

    def __eq__(self, other) -> bool:  # same active pairs and masks (the search's hall of fame: same_phenotype)
        return (isinstance(other, Individual) and np.array_equal(self.active, other.active)
                and np.array_equal(self.masks[self.active], other.masks[other.active]))

    def __len__(self) -> int:
        return len(self.active)


def same_phenotype(forced: np.ndarray):
    """The hall of fame's similarity for a pair space with ``forced`` (always active) pairs: two individuals are
    the same when every gene that counts is, the active pairs with their masks and the forced pairs' masks."""
    forced = np.asarray(forced, dtype=np.int64)

    def similar(a: Individual, b: Individual) -> bool:
        return a == b and np.array_equal(a.masks[forced], b.masks[forced])
    return similar


class MaskOps:
    """Bit-level operations on integer masks for one grid, vectorised over arrays."""
    MAX_CELLS = 62  # masks are int64, and the bit operations keep clear of the sign bit

    def __init__(self, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        self.cells = rows * cols
        if self.cells > self.MAX_CELLS:
            raise ValueError(f'a {rows}x{cols} grid has {self.cells} cells; masks are held in {self.MAX_CELLS} bits')
        self.full = (1 << self.cells) - 1
        left = np.zeros((rows, cols), dtype=bool)
        left[:, :cols // 2] = True
        self.left = mask_to_bits(left)
        self.right = self.full & ~self.left
        self.square = rows == cols

    def invert(self, m: np.ndarray) -> np.ndarray:
        return np.bitwise_xor(m, self.full)

    def transpose(self, m: np.ndarray) -> np.ndarray:
        """Masks of a square grid mirrored about the diagonal."""
        if not len(m):
            return np.asarray(m, dtype=np.int64).copy()
        return mask_to_bits(np.swapaxes(bits_to_mask(m, self.rows, self.cols), -1, -2))

    def halves(self, a: np.ndarray, b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Children from the left half of one parent and the right half of the other."""
        return (a & self.left) | (b & self.right), (b & self.left) | (a & self.right)

    def flip_bits(self, m: np.ndarray, rng: np.random.Generator, p: float) -> np.ndarray:
        flips = rng.random((len(m), self.cells)) < p
        return np.bitwise_xor(m, mask_to_bits(flips.reshape(len(m), self.rows, self.cols)))


class Operators:
    """The paper's initialisation, crossover and mutations over a :class:`PairSpace`, with an N cap.

    Randomness comes from ``rng`` (numpy) for array work and from DEAP's use of Python's ``random`` for selection
    and the crossover/mutation coin flips, both seeded and checkpointed by the search.
    """
    MUTATIONS = ('flip_tails', 'transpose', 'flip_heads', 'random_tails')

    def __init__(self, space: PairSpace, ops: MaskOps, n_active: int, rng: np.random.Generator, fitness_cls,
                 indpb: Optional[float] = None, head_swap_p: float = 0.1):
        self.space, self.ops, self.n_active, self.rng = space, ops, n_active, rng
        self.fitness_cls = fitness_cls
        self.indpb = 1.0 / ops.cells if indpb is None else indpb
        self.head_swap_p = head_swap_p
        self.mutations = [m for m in self.MUTATIONS if m != 'transpose' or ops.square]

    def random_individual(self) -> Individual:
        active = np.sort(self.rng.choice(self.space.num_cross, size=self.n_active, replace=False))
        masks = self.rng.integers(0, self.ops.full + 1, size=len(self.space), dtype=np.int64)
        return Individual(active, masks, self.fitness_cls())

    def mate(self, a: Individual, b: Individual):
        a.masks, b.masks = self.ops.halves(a.masks, b.masks)
        return a, b

    def mutate(self, ind: Individual):
        kind = self.mutations[int(self.rng.integers(len(self.mutations)))]
        idx = np.concatenate([ind.active, self.space.forced])
        if kind == 'flip_tails':
            ind.masks[idx] = self.ops.invert(ind.masks[idx])
        elif kind == 'transpose':
            ind.masks[idx] = self.ops.transpose(ind.masks[idx])
        elif kind == 'random_tails':
            ind.masks[idx] = self.ops.flip_bits(ind.masks[idx], self.rng, self.indpb)
        else:  # flip_heads: swap some active pairs for inactive ones, at least one
            inactive = np.setdiff1d(np.arange(self.space.num_cross), ind.active, assume_unique=True)
            if len(inactive):
                swap = self.rng.random(len(ind.active)) < self.head_swap_p
                if not swap.any():
                    swap[int(self.rng.integers(len(ind.active)))] = True
                n = min(int(swap.sum()), len(inactive))
                out_pos = np.flatnonzero(swap)[:n]
                new = self.rng.choice(inactive, size=n, replace=False)
                active = ind.active.copy()
                active[out_pos] = new
                ind.active = np.sort(active)
        return ind,

    def check(self, ind: Individual) -> None:
        """The invariants every operator keeps: at most N unique cross pairs, masks within the grid."""
        a = ind.active
        if len(a) > self.n_active or len(np.unique(a)) != len(a) or (len(a) and (a.min() < 0 or
                                                                                 a.max() >= self.space.num_cross)):
            raise AssertionError(f'invalid active set {a}')
        if (ind.masks < 0).any() or (ind.masks > self.ops.full).any():
            raise AssertionError('mask outside the grid')
