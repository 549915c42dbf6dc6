"""Patch-grid geometry shared by the mixer, the collate-mixer, the patch head, the search and every command line.

A grid of ``rows x cols`` cells over an ``H x W`` plane has row boundaries ``floor(k * H / rows)`` for
``k = 0..rows`` and column boundaries ``floor(k * W / cols)``. Every component that needs to know where a
cell starts and ends calls :func:`cell_bounds` (or :func:`grid_bounds`), so pixels of the mixer and regions of
the patch head can never disagree. :func:`to_grid` is the one parser of a grid (an API argument or a ``--grid``
flag), and :func:`bits_to_mask` / :func:`mask_to_bits` the one conversion between a cell mask and the integer the
search keeps it as.
"""
from __future__ import annotations

import numbers
from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

GridSpec = Union[int, Sequence[int]]

__all__ = ['GridSpec', 'to_grid', 'grid_from_flag', 'cell_bounds', 'grid_bounds', 'check_grid_fits', 'cell_areas',
           'cell_mask_to_pixels', 'cell_index', 'cell_sizes', 'bounds_tensor',
           'bits_to_mask', 'mask_to_bits']


def to_grid(grid: GridSpec, name: str = 'grid') -> Tuple[int, int]:
    """Normalise an int ``P`` or a ``(rows, cols)`` pair to ``(rows, cols)``; raise ``ValueError`` if invalid."""
    if isinstance(grid, (bool, np.bool_)):
        raise ValueError(f'{name} must be an int or a (rows, cols) pair, got {grid!r}')
    if isinstance(grid, numbers.Integral):  # numpy's integers too
        rows = cols = int(grid)
    else:
        try:
            rows, cols = (int(v) for v in grid)
        except (TypeError, ValueError):
            raise ValueError(f'{name} must be an int or a (rows, cols) pair, got {grid!r}') from None
        if any(isinstance(v, bool) or int(v) != v for v in grid):
            raise ValueError(f'{name} must hold integers, got {grid!r}')
    if rows < 1 or cols < 1:
        raise ValueError(f'{name} must be at least 1x1, got {rows}x{cols}')
    return rows, cols


def grid_from_flag(values: Sequence[int], flag: str = '--grid') -> Tuple[int, int]:
    """The ``(rows, cols)`` of a command-line grid flag given as ``P`` or ``rows cols`` (``nargs='+'``)."""
    values = list(values)
    if len(values) not in (1, 2):
        raise ValueError(f'{flag} takes P or rows cols, got {len(values)} values {" ".join(map(str, values))}')
    return to_grid(values[0] if len(values) == 1 else values, flag)


@lru_cache(maxsize=256)
def cell_bounds(size: int, parts: int) -> Tuple[int, ...]:
    """Boundaries ``(b_0=0, ..., b_parts=size)`` with ``b_k = floor(k * size / parts)``.

    Cell ``k`` spans ``[b_k, b_{k+1})``. Requires ``1 <= parts <= size`` so that every cell is non-empty.
    """
    _check_split(size, parts)
    return tuple((k * size) // parts for k in range(parts + 1))


def _check_split(size: int, parts: int) -> None:
    if parts < 1 or size < parts:
        raise ValueError(f'cannot split a length of {size} into {parts} non-empty cells')


def check_grid_fits(height: int, width: int, rows: int, cols: int, what: str = 'an image') -> None:
    """Raise a ``ValueError`` naming the sizes when a ``rows x cols`` grid does not fit an ``H x W`` plane."""
    if rows > height or cols > width:
        raise ValueError(
            f'grid {rows}x{cols} does not fit {what} of {height}x{width}: '
            f'each of the {rows}x{cols} cells needs at least one pixel')


def grid_bounds(height: int, width: int, grid: GridSpec) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Row and column boundaries of ``grid`` over an ``H x W`` plane."""
    rows, cols = to_grid(grid)
    check_grid_fits(height, width, rows, cols)
    return cell_bounds(height, rows), cell_bounds(width, cols)


def cell_areas(height: int, width: int, grid: GridSpec, device=None) -> torch.Tensor:
    """Pixel count of every cell as a float64 tensor ``[rows, cols]``; sums to ``H * W``.

    Built with ``arange`` arithmetic on ``device``, so no host list is copied to an accelerator."""
    rows, cols = to_grid(grid)
    check_grid_fits(height, width, rows, cols)
    return (cell_sizes(height, rows, device)[:, None] * cell_sizes(width, cols, device)[None, :]).to(torch.float64)


def cell_sizes(size: int, parts: int, device=None) -> torch.Tensor:
    """Lengths ``b_{k+1} - b_k`` of the ``parts`` cells of :func:`cell_bounds`, an int64 tensor ``[parts]``."""
    _check_split(size, parts)
    bounds = bounds_tensor(size, parts, device)
    return bounds[1:] - bounds[:-1]


def bounds_tensor(size: int, parts: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """:func:`cell_bounds` as an int64 tensor ``[parts + 1]`` made on ``device`` by ``arange`` arithmetic (no host
    list crosses to an accelerator); TorchScript-compatible, for the patch head's region weights."""
    return torch.arange(0, (parts + 1) * size, size, device=device) // parts  # b_k = floor(k * size / parts)


def cell_index(size: int, parts: int, device=None) -> torch.Tensor:
    """The cell of every position ``0..size-1`` under :func:`cell_bounds`, an int64 tensor ``[size]``.

    Position ``p`` lies in the last cell ``k`` with ``floor(k * size / parts) <= p``, which is
    ``floor(((p + 1) * parts - 1) / size)``: one ``arange`` and one division on ``device``, no host copy.
    """
    _check_split(size, parts)
    return torch.arange(parts - 1, parts * size, parts, device=device) // size


@lru_cache(maxsize=32)
def _pixel_cells(height: int, width: int, rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The flat cell ``r * cols + c`` of every pixel of an ``H x W`` plane in row-major order, an int64 tensor
    ``[H * W]`` on ``device``, from :func:`cell_index` of the rows and of the columns.

    A pure function of its arguments, built once per key with ``arange`` arithmetic on ``device`` (no host copy)
    and kept as a read-only constant, so that turning cell masks into pixel masks is one ``index_select``. It is
    built outside autograd and inference mode, so it is an ordinary tensor wherever it is used next; treat it
    as read-only.
    """
    with torch.inference_mode(False), torch.no_grad():
        ri = cell_index(height, rows, device)
        ci = cell_index(width, cols, device)
        return (ri[:, None] * cols + ci[None, :]).reshape(-1)


def cached_constant(fn, *args):
    """``fn(*args)`` for an ``lru_cache`` function ``fn`` that makes a constant tensor: from its cache in eager
    code, and built in the graph (the wrapped function, the same tensor) while ``torch.compile`` traces, so
    that dynamo does not trace a cache."""
    return (fn.__wrapped__ if torch.compiler.is_compiling() else fn)(*args)


def cell_mask_to_pixels(mask: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Cell masks ``[B, rows, cols]`` -> pixel masks ``[B, H, W]`` on the cells of :func:`cell_bounds`.

    One ``index_select`` of the flattened masks with :func:`_pixel_cells` on the mask's device: no output size
    depends on the data and nothing crosses from the host, so an accelerator never waits.
    """
    b, rows, cols = mask.shape
    idx = cached_constant(_pixel_cells, height, width, rows, cols, mask.device)
    return mask.reshape(b, rows * cols).index_select(1, idx).view(b, height, width)


def bits_to_mask(bits, rows: int, cols: int):
    """Integer masks -> bool cell masks ``[..., rows, cols]``; bit ``k = r * cols + c`` is cell (r, c).

    ``bits`` is an int or a numpy integer array (the result is a numpy array) or an int64 tensor (a tensor on its
    device). A set bit is True: in PatchMix's convention, the cell is kept from the image itself.
    """
    cells = rows * cols
    if isinstance(bits, torch.Tensor):
        weights = 1 << torch.arange(cells, dtype=torch.long, device=bits.device)
        return ((bits[..., None] & weights) != 0).view(*bits.shape, rows, cols)
    if isinstance(bits, int) and bits >= 1 << 63:  # wider than int64: one mask, bit by bit
        return np.array([(bits >> k) & 1 for k in range(cells)], dtype=bool).reshape(rows, cols)
    b = np.asarray(bits, dtype=np.int64)
    return ((b[..., None] >> np.arange(cells, dtype=np.int64)) & 1).astype(bool).reshape(*b.shape, rows, cols)


def mask_to_bits(mask):
    """Bool cell masks ``[..., rows, cols]`` -> integer masks, the inverse of :func:`bits_to_mask`: an int for one
    ``[rows, cols]`` mask (any size), an int64 array for a stack of masks of at most 63 cells."""
    m = np.asarray(mask, dtype=bool)
    rows, cols = m.shape[-2:]
    flat = m.reshape(*m.shape[:-2], rows * cols)
    if flat.ndim == 1:
        return int(sum(1 << int(k) for k in np.flatnonzero(flat)))
    if rows * cols > 63:
        raise ValueError(f'a stack of {rows}x{cols} masks does not fit int64 integers; convert one mask at a time')
    return (flat.astype(np.int64) << np.arange(rows * cols, dtype=np.int64)).sum(-1)
