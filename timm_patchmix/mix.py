"""PatchMix: grid-mask mixing of image pairs with image- and patch-level targets.

Parameters are sampled apart from their application (``PatchMix.sample`` then ``PatchMix.apply``), so a run can
be replayed exactly and the guided mixer can apply masks of its own through the same code.
"""
from __future__ import annotations

import math
import numbers
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .grid import (GridSpec, _pixel_cells, cached_constant, cell_areas, cell_bounds, cell_mask_to_pixels,
                   check_grid_fits, to_grid)

__all__ = ['PatchMixParams', 'PatchMix', 'pack_target', 'split_target', 'soft_target', 'mix_cells_',
           'mix_select_', 'MIX_MODES']

MIX_MODES = ('elem', 'pair', 'batch')

# Packed target layout, one float32 row per sample:
#   [rows, cols, lam, y_self (C), y_partner (C), keep mask (rows*cols, 1.0 = cell from the sample itself)]
# The header lets ``split_target`` check the grid and recover C; the image and patch targets are rebuilt from
# two label rows instead of storing rows*cols of them, so the tensor stays 2C + rows*cols + 3 wide.
_HEADER = 3


@dataclass
class PatchMixParams:
    """Sampled mixing parameters for one batch.

    Attributes:
        partner: LongTensor ``[B]``; sample ``i`` takes its masked-out cells from sample ``partner[i]``.
        mask: BoolTensor ``[B, rows, cols]``; True means the cell is kept from the sample itself.
    """
    partner: torch.Tensor
    mask: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.partner.shape[0])

    @property
    def grid(self) -> Tuple[int, int]:
        return int(self.mask.shape[1]), int(self.mask.shape[2])

    def to(self, device) -> 'PatchMixParams':
        return PatchMixParams(self.partner.to(device), self.mask.to(device))

    @classmethod
    def identity(cls, batch_size: int, grid: GridSpec, device=None) -> 'PatchMixParams':
        """Params that leave every sample unmixed."""
        rows, cols = to_grid(grid)
        return cls(torch.arange(batch_size, device=device),
                   torch.ones(batch_size, rows, cols, dtype=torch.bool, device=device))

    def validate(self, batch_size: int, num_sources: Optional[int] = None) -> None:
        """Raise ``ValueError`` unless these params describe a batch of ``batch_size`` whose partners index
        ``num_sources`` images (default: the batch itself)."""
        n = batch_size if num_sources is None else num_sources
        for name in ('partner', 'mask'):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f'params.{name} must be a tensor, got {type(getattr(self, name)).__name__}')
        if self.partner.ndim != 1 or self.partner.shape[0] != batch_size:
            raise ValueError(f'params.partner must have shape [{batch_size}], got {list(self.partner.shape)}')
        if self.partner.dtype != torch.long:
            raise ValueError(f'params.partner must be int64, got {self.partner.dtype}')
        if self.mask.ndim != 3 or self.mask.shape[0] != batch_size:
            raise ValueError(f'params.mask must have shape [{batch_size}, rows, cols], got {list(self.mask.shape)}')
        if self.mask.dtype != torch.bool:
            raise ValueError(f'params.mask must be bool, got {self.mask.dtype}')
        if batch_size and (int(self.partner.min()) < 0 or int(self.partner.max()) >= n):
            raise ValueError(f'params.partner holds indices outside [0, {n})')


def _number(value, name: str, low: float, high: float = math.inf, *, low_open: bool = False,
            high_open: bool = False) -> float:
    """``value`` as a float, or a ``ValueError`` naming it unless it is a finite real number (numpy's included,
    not a bool) in ``[low, high]`` (an end excluded with ``low_open`` / ``high_open``)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value) \
        and (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
    if not ok:
        if high == math.inf:
            span = f'{">" if low_open else ">="} {low:g}'
        else:
            span = f'in {"(" if low_open else "["}{low:g}, {high:g}{")" if high_open else "]"}'
        raise ValueError(f'{name} must be a finite number {span}, got {value!r}')
    return float(value)


def soft_target(target: torch.Tensor, num_classes: int, smoothing: float = 0.0,
                batch_size: Optional[int] = None, device=None) -> torch.Tensor:
    """Class indices ``[B]`` or one-hot/soft targets ``[B, C]`` as smoothed float32 rows ``[B, C]``.

    Smoothing maps a row ``y`` (for indices, the one-hot row) to ``y * (1 - s) + s / C``.

    Class indices are range-checked where they live on the host. On an accelerator that check would stall the
    device every batch, so there an out-of-range index fails in the one-hot scatter's own device-side bounds
    check instead (as it does for timm's ``Mixup``). ``train.py`` takes num_classes from the dataset's own classes.
    """
    if target is None:
        raise ValueError('target must be class indices [B] or a one-hot/soft target [B, C], got None')
    if not isinstance(target, torch.Tensor):
        target = torch.as_tensor(target)
    if batch_size is not None and (target.ndim == 0 or target.shape[0] != batch_size):
        got = 'a scalar' if target.ndim == 0 else f'{target.shape[0]}'
        raise ValueError(f'target batch size {got} does not match the image batch size {batch_size}')
    if target.ndim == 1:
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            raise ValueError(f'1-D targets must be integer class indices, got dtype {target.dtype}')
        if target.device.type == 'cpu' and target.numel() and (
                int(target.min()) < 0 or int(target.max()) >= num_classes):
            raise ValueError(
                f'target labels must lie in [0, {num_classes}) for num_classes={num_classes}, '
                f'got min {int(target.min())} and max {int(target.max())}')
        # the smoothed one-hot row in two kernels, fill and scatter: its two values are the floats that the
        # formula below gives a one-hot row's 0 and 1, so indices and their one-hot rows still agree bit for bit
        off, on = _one_hot_values(float(smoothing), num_classes) if smoothing else (0.0, 1.0)
        out = torch.full((target.shape[0], num_classes), off, dtype=torch.float32, device=device)
        return out.scatter_(1, target.to(device=device, dtype=torch.long).view(-1, 1), on)
    elif target.ndim == 2:
        if target.shape[1] != num_classes:
            raise ValueError(
                f'target has {target.shape[1]} classes (shape {list(target.shape)}) but num_classes={num_classes}')
        out = target.to(device=device, dtype=torch.float32)
    else:
        raise ValueError(f'target must be class indices [B] or a [B, C] soft target, got shape {list(target.shape)}')
    # the formula whose values _one_hot_values gives for indices, so a label and its one-hot row smooth alike
    if smoothing:
        out = out * (1.0 - smoothing) + smoothing / num_classes
    return out


_ONE_HOT_VALUES: Dict[Tuple[float, int], Tuple[float, float]] = {}


@torch.compiler.assume_constant_result
def _one_hot_values(smoothing: float, num_classes: int) -> Tuple[float, float]:
    """``(off, on)``: the float32 values of a one-hot row's 0 and 1 after smoothing, made by the formula of
    :func:`soft_target` itself on a float32 pair on the CPU. The formula rounds its product and its sum to float32
    on every device, so these are the values it gives there too. Kept per key in a plain dict, not ``lru_cache``,
    so that a compiled caller takes them as constants without tracing a cache."""
    key = (smoothing, num_classes)
    values = _ONE_HOT_VALUES.get(key)
    if values is None:
        pair = torch.tensor([0.0, 1.0], dtype=torch.float32) * (1.0 - smoothing) + smoothing / num_classes
        values = _ONE_HOT_VALUES[key] = tuple(pair.tolist())
    return values


def pack_target(y_self: torch.Tensor, y_partner: torch.Tensor, lam: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pack label rows ``[B, C]``, ``lam [B]`` and keep mask ``[B, rows, cols]`` into one float32 tensor."""
    b, rows, cols = mask.shape
    lam = lam.to(device=y_self.device, dtype=torch.float32).view(b, 1)
    return torch.cat([cached_constant(_header, rows, cols, y_self.device).expand(b, 2), lam, y_self, y_partner,
                      mask.reshape(b, rows * cols).to(device=y_self.device, dtype=torch.float32)], dim=1)


@lru_cache(maxsize=32)
def _header(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """The packed target's grid header ``[[rows, cols]]`` as float32 on ``device``: a read-only constant, filled
    on the device once per key (``torch.tensor`` from a host list would be a blocking copy to an accelerator in
    every call) and built outside autograd and inference mode."""
    with torch.inference_mode(False), torch.no_grad():
        return (torch.arange(2, dtype=torch.float32, device=device) * (cols - rows) + rows).view(1, 2)


def _packed_class_count(width: int, rows: int, cols: int) -> Optional[int]:
    """The class count a packed target ``width`` columns wide holds under a ``rows x cols`` header (the header, the
    two class blocks, one column per cell); None where no class count fits."""
    rest = width - _HEADER - rows * cols
    return rest // 2 if rows >= 1 and cols >= 1 and rest >= 2 and rest % 2 == 0 else None


def _unpack(packed: torch.Tensor, grid: Optional[GridSpec] = None):
    if not isinstance(packed, torch.Tensor) or packed.ndim != 2 or packed.shape[1] < _HEADER + 3:
        shape = list(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f'expected a packed PatchMix target [B, 2C + rows*cols + 3], got {shape}')
    if packed.shape[0] == 0:
        if grid is None:
            raise ValueError('cannot read the grid of an empty packed target; pass grid')
        rows, cols = to_grid(grid)
    else:
        rows, cols = (int(v) for v in packed[0, :2].tolist())  # one read of the header (a sync on a device)
        if grid is not None and to_grid(grid) != (rows, cols):
            g = to_grid(grid)
            raise ValueError(f'packed target was built for a {rows}x{cols} grid, not {g[0]}x{g[1]}')
    c = _packed_class_count(packed.shape[1], rows, cols)
    if c is None:
        raise ValueError(f'tensor of shape {list(packed.shape)} is not a packed PatchMix target '
                         f'(header says grid {rows}x{cols})')
    packed = packed.float()
    lam = packed[:, 2:3]
    y_self = packed[:, _HEADER:_HEADER + c]
    y_partner = packed[:, _HEADER + c:_HEADER + 2 * c]
    keep = packed[:, _HEADER + 2 * c:] > 0.5
    return (rows, cols), lam, y_self, y_partner, keep


def split_target(packed: torch.Tensor, grid: Optional[GridSpec] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split a packed target into ``(image_target [B, C], patch_target [B, rows*cols, C])``, both float32.

    ``grid``, when given, is checked against the grid recorded in the packed tensor.
    """
    _, lam, y_self, y_partner, keep = _unpack(packed, grid)
    image = lam * y_self + (1.0 - lam) * y_partner
    patch = torch.where(keep.unsqueeze(-1), y_self.unsqueeze(1), y_partner.unsqueeze(1))
    return image, patch


def is_packed_target(target: torch.Tensor, num_classes: int, num_cells: int) -> bool:
    """Whether ``target`` has the width of a packed target for ``num_classes`` and ``num_cells``."""
    return target.ndim == 2 and target.shape[1] == _HEADER + 2 * num_classes + num_cells


def _random_cycle(n: int, generator: Optional[torch.Generator], device) -> torch.Tensor:
    """Partner indices along one random cycle over the batch: a permutation with no fixed point for n >= 2."""
    order = torch.randperm(n, generator=generator, device=device)
    return torch.empty_like(order).scatter_(0, order, order.roll(-1))  # partner[order[k]] = order[k + 1]


# word sizes for bitwise copies, widest first; complex128 serves as a 16-byte word (copies do no arithmetic on it)
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def _word_size(t: torch.Tensor, col_bounds: Tuple[int, ...]) -> int:
    """The widest word that every row segment of ``t`` between ``col_bounds`` starts on and spans whole (address
    included), or ``t``'s element size."""
    item = t.element_size()
    if t.stride(3) != 1:
        return item
    for word, _ in _WORDS:
        if word <= item:
            break
        if (all((b * item) % word == 0 for b in col_bounds)
                and all((t.stride(d) * item) % word == 0 for d in range(3))
                and (t.storage_offset() * item) % word == 0 and t.data_ptr() % word == 0):
            return word
    return item


def _as_words(t: torch.Tensor, col_bounds: Tuple[int, ...], word: int):
    item = t.element_size()
    if word == item:
        return t, col_bounds
    return t.view(dict(_WORDS)[word]), tuple(b * item // word for b in col_bounds)


def _same_words(a: torch.Tensor, b: torch.Tensor, col_bounds: Tuple[int, ...]):
    """Views of ``a`` and ``b`` (same dtype) as the widest word both allow, with the column bounds in words.
    Copies between them are bitwise, and wider words mean fewer elements for the strided copy kernels to walk."""
    word = min(_word_size(a, col_bounds), _word_size(b, col_bounds))
    av, wcb = _as_words(a, col_bounds, word)
    bv, _ = _as_words(b, col_bounds, word)
    return av, bv, wcb


def _segment_arrays(x: torch.Tensor, src: torch.Tensor, cols: int):
    """numpy views of ``x`` and ``src`` ``[B, C, H, W]`` as ``[B, C, H, cols]`` arrays whose elements are whole
    cell-row segments (``W / cols`` pixels as one opaque item), or ``None`` where such views do not exist: not both
    on the CPU, a row that is not contiguous, or cells of unequal widths."""
    w = x.shape[-1]
    for t in (x, src):
        if t.device.type != 'cpu' or t.is_complex() or t.is_neg() or t.stride(-1) != 1:
            return None
    if w % cols or src.dtype != x.dtype:
        return None
    seg = np.dtype((np.void, (w // cols) * x.element_size()))
    xa = x.view(torch.uint8).numpy().view(seg)
    return xa, (xa if src is x else src.view(torch.uint8).numpy().view(seg))


def _mix_segments(xa: np.ndarray, sa: np.ndarray, partner: torch.Tensor, mask: torch.Tensor) -> None:
    """:func:`mix_cells_` on the segment views of :func:`_segment_arrays`: per grid row, one gather of the changed
    cells' segments from their partners and one scatter into ``xa``."""
    rows = mask.shape[1]
    rb = cell_bounds(xa.shape[2], rows)
    part = partner.numpy()
    bi, ri, ci = np.nonzero(~mask.numpy())
    for r in range(rows):
        sel = ri == r
        if not sel.any():
            continue
        b, c, ys = bi[sel], ci[sel], slice(rb[r], rb[r + 1])
        xa[b, :, ys, c] = sa[part[b], :, ys, c]  # the right side is gathered in full before anything is written


def _tracked(x: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether autograd follows an in-place write of ``src``'s pixels into ``x`` (either requires grad): such a
    write must use torch ops in ``x``'s own dtype, since one through a view of another dtype, or through numpy,
    is not recorded (nor refused on a leaf)."""
    return x.requires_grad or src.requires_grad


def _check_writable(x: torch.Tensor) -> None:
    """Refuse, before anything is written, a batch that torch refuses to change in place only after changing it:
    an inference tensor outside inference mode."""
    if not torch.compiler.is_compiling() and x.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError('x is an inference tensor (made under torch.inference_mode()), which cannot be mixed in '
                           'place outside inference mode; mix it under torch.inference_mode(), or mix x.clone()')


def _check_generator(generator) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f'generator must be a torch.Generator or None, got {type(generator).__name__} '
                         f'(for a seed, pass torch.Generator().manual_seed(seed))')


def _check_source_dtype(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``source`` when its images have ``x``'s dtype; cells are copied as they are, never converted, so a source of
    another dtype (float64 images into a float32 batch, uint8 into float) is an error rather than other values."""
    if source.dtype != x.dtype:
        raise ValueError(f'source images must have the dtype of the batch they are mixed into ({x.dtype}), got '
                         f'{source.dtype}; convert them first (source.to({x.dtype}))')
    return source


def mix_cells_(x: torch.Tensor, partner: torch.Tensor, mask: torch.Tensor,
               source: Optional[torch.Tensor] = None, *, fresh: bool = False) -> torch.Tensor:
    """Mix ``x [B, C, H, W]`` in place and return it: where ``mask[i, r, c]`` is False, cell (r, c) of ``x[i]``
    becomes that cell of ``source[partner[i]]``.

    ``source`` defaults to ``x`` itself. Each cell is gathered into a temporary before it is written, and cells
    do not overlap, so chains and swaps of partners always read the original pixels. Only the cells that change
    are touched: about half the batch for fair-coin masks.

    ``fresh=True`` says that ``x`` is a tensor the caller has just made and that nothing else has seen: no
    autograd graph saved it and no other tensor views it (the collate-mixer's new batch, the search's indexed
    copy). Such a CPU tensor is then written through numpy's view of its memory, whole cell-row segments at a
    time, which is about twice as fast; the pixels are the same. Those writes do not advance torch's version
    counter, which is why only a fresh tensor takes this way. Tensors that require grad, rows that are not
    contiguous and cells of unequal widths take the torch way whatever ``fresh`` says.

    Where autograd follows the write (``x`` or ``source`` requires grad), the torch way copies in ``x``'s own
    dtype, so the mixed batch's gradient reaches each cell's source; a leaf that requires grad, or an inference
    tensor outside inference mode, gets an error and is left as it was.
    """
    _check_writable(x)
    src = x if source is None else _check_source_dtype(x, source)
    h, w = x.shape[-2:]
    rows, cols = mask.shape[1:]
    tracked = _tracked(x, src)
    if fresh and not tracked and mask.device.type == 'cpu' and partner.device.type == 'cpu':
        arrays = _segment_arrays(x, src, cols)
        if arrays is not None:
            _mix_segments(*arrays, partner, mask)
            return x
    rb, cb = cell_bounds(h, rows), cell_bounds(w, cols)
    take = (~mask).permute(1, 2, 0).contiguous()  # [rows, cols, B]: the samples that change, cell by cell
    # wider words move the same bytes in fewer elements, but autograd does not record a write through a view of
    # another dtype, and a view of another dtype made under inference_mode shares no version counter with ``x``
    # (a tensor autograd saved would be overwritten unseen)
    plain = tracked or torch.is_inference_mode_enabled()
    xv, sv, wcb = (x, src, cb) if plain else _same_words(x, src, cb)
    for r in range(rows):
        for c in range(cols):
            idx = take[r, c].nonzero().flatten()
            if idx.numel() == 0:
                continue
            region = (slice(None), slice(None), slice(rb[r], rb[r + 1]), slice(wcb[c], wcb[c + 1]))
            xv[region].index_copy_(0, idx, sv[region].index_select(0, partner[idx]))
    return x


def mix_select_(x: torch.Tensor, partner: torch.Tensor, mask: torch.Tensor,
                source: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same in-place mix as :func:`mix_cells_` in two whole-batch kernels: gather the partners into a new
    tensor, then select per pixel into ``x``. It moves more bytes but launches no per-cell kernels and needs no
    device sync, which is what a GPU prefers."""
    _select(x, partner, cell_mask_to_pixels(mask, x.shape[-2], x.shape[-1]).unsqueeze(1), source)
    return x


def _per_cell(device: torch.device) -> bool:
    """Whether a batch on ``device`` is mixed cell by cell (:func:`mix_cells_`, the CPU) rather than by one
    select (:func:`mix_select_`, accelerators, where each kernel launch costs and a sync stalls the device)."""
    return device.type == 'cpu'


def _select(x: torch.Tensor, partner: torch.Tensor, pix: torch.Tensor, source: Optional[torch.Tensor]) -> None:
    """Where the pixel mask ``pix [B, 1, H, W]`` is False, ``x`` takes ``source[partner]``'s pixel (``source``
    defaults to ``x``): one gather of the partners, then one select into ``x``."""
    _check_writable(x)
    src = x if source is None else _check_source_dtype(x, source)
    if torch.is_grad_enabled() and _tracked(x, src):
        # out= is not differentiable: select into a new tensor and copy it in, which autograd records
        x.copy_(torch.where(pix, x, src.index_select(0, partner)))
    else:
        torch.where(pix, x, src.index_select(0, partner), out=x)


@lru_cache(maxsize=32)
def _areas(height: int, width: int, rows: int, cols: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`cell_areas` and the plane's pixel count ``H * W`` as read-only float64 constants on ``device`` (the
    count 0-dimensional), built once per key outside autograd and inference mode (see
    :func:`timm_patchmix.grid._pixel_cells`)."""
    with torch.inference_mode(False), torch.no_grad():
        return (cell_areas(height, width, (rows, cols), device),
                torch.full((), height * width, dtype=torch.float64, device=device))


def _mask_constants(height: int, width: int, rows: int, cols: int, device: torch.device) -> tuple:
    """The constants :func:`_mask_parts` reads: the pixel-to-cell map, the packed header, the cell areas and the
    pixel count."""
    return (cached_constant(_pixel_cells, height, width, rows, cols, device),
            cached_constant(_header, rows, cols, device), *cached_constant(_areas, height, width, rows, cols, device))


def _mask_parts(mask: torch.Tensor, height: int, width: int,
                constants: Optional[tuple] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the accelerator branch derives from keep masks ``[B, rows, cols]`` alone: the pixel mask
    ``[B, 1, H, W]`` of the select, the packed target's head ``[B, 3]`` (rows, cols, lam) and its keep columns
    ``[B, rows * cols]`` as float32. ``constants`` are :func:`_mask_constants`' (looked up when not given).

    lam is the CPU branch's formula: kept pixels by cell area, summed in float64 (sums of integers, exact in any
    order) and divided by ``H * W`` in float64, then rounded to float32. The divisor is a tensor on the mask's
    device, not a Python number: CUDA divides by a host scalar by multiplying with its reciprocal, which is not
    always the correctly rounded quotient that the CPU's division gives. So both branches give the same float32 lam
    bit for bit. Nothing here reads the images or the labels, which is what lets :class:`PatchMix` draw a batch's
    params and these tensors in one captured CUDA graph."""
    b, rows, cols = mask.shape
    cells, header, areas, pixels = (constants if constants is not None
                                    else _mask_constants(height, width, rows, cols, mask.device))
    lam = (mask.to(torch.float64) * areas).sum((1, 2)) / pixels
    head = torch.cat([header.expand(b, 2), lam.to(torch.float32).view(b, 1)], dim=1)
    flat = mask.reshape(b, rows * cols)
    # the pixel mask by one index_select with the pixel-to-cell map, as cell_mask_to_pixels makes it
    return flat.index_select(1, cells).view(b, 1, height, width), head, flat.to(torch.float32)


def _finish(x: torch.Tensor, y: torch.Tensor, y_src: torch.Tensor, partner: torch.Tensor, pix: torch.Tensor,
            head: torch.Tensor, keep: torch.Tensor,
            source: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The accelerator branch's work on the batch itself, given :func:`_mask_parts`: one partner gather and one
    per-pixel select into ``x``, and the packed target (the layout of :func:`pack_target`) in one ``cat``."""
    _select(x, partner, pix, source)
    # index_select rather than y_src[partner]: the same gather, without advanced indexing's host-side parsing
    return x, torch.cat([head, y, y_src.index_select(0, partner), keep], dim=1)


_MAX_DRAW_GRAPHS = 8  # captured draws kept per mixer (batch shapes, devices and settings); beyond, calls draw eagerly


class _DrawGraph:
    """One CUDA graph that draws a mixer's params for one batch shape on one device and derives from them what the
    select and the packed target need (:func:`_mask_parts`). Every replay rewrites the same output tensors. The
    graph reads the constants by address, so they are kept here: a cache may drop its own reference to them."""
    __slots__ = ('graph', 'constants', 'partner', 'mask', 'pix', 'head', 'keep')

    def __init__(self, graph, constants, partner, mask, pix, head, keep):
        self.graph, self.constants = graph, constants
        self.partner, self.mask, self.pix, self.head, self.keep = partner, mask, pix, head, keep


def _capture_draw(mixer: 'PatchMix', batch_size: int, height: int, width: int, device: torch.device) -> _DrawGraph:
    """Capture ``mixer.sample`` and :func:`_mask_parts` for ``[batch_size, *, height, width]`` batches on the CUDA
    ``device`` (the current device), drawing from its default generator.

    The constants the draw reads are fetched first, on the current stream and outside the graph's memory pool, and
    passed in, so that nothing is looked up or built during the capture. The same kernels run once before the
    capture on a generator of their own (lazy initialisation happens outside the capture, and the default
    generator is not touched). The capture itself draws nothing: each replay draws from the default generator and
    advances it, as the eager kernels would. A capture that fails raises: after a failed capture the allocator and
    the generator cannot be relied on, so no eager fallback is attempted."""
    rows, cols = mixer.grid
    constants = _mask_constants(height, width, rows, cols, device)

    def draw(generator=None):
        params = mixer.sample(batch_size, generator=generator, device=device)
        return (params.partner, params.mask, *_mask_parts(params.mask, height, width, constants))

    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side), torch.inference_mode(False), torch.no_grad():
            draw(torch.Generator(device).manual_seed(0))
            # thread_local: other threads of the process may allocate meanwhile (a capture in 'global' mode fails)
            graph.capture_begin(capture_error_mode='thread_local')
            try:
                out = draw()
            finally:
                graph.capture_end()
    except RuntimeError as e:
        raise RuntimeError(f'PatchMix could not capture the draw of a batch of {batch_size}x{height}x{width} on '
                           f'{device} in a CUDA graph: {e}. PatchMix(..., cuda_graph=False) draws eagerly.') from e
    finally:
        current.wait_stream(side)
    return _DrawGraph(graph, constants, *out)


class PatchMix:
    """Random PatchMix, used where timm's ``Mixup`` is: ``x, target = mixer(x, target)``.

    Each image is split into a ``rows x cols`` grid; every cell comes from the image itself or from a partner
    image, chosen by a binary mask. The returned target is one packed float32 tensor (see ``split_target``)
    holding the image target ``lam * y_i + (1 - lam) * y_partner`` (``lam`` = fraction of pixels kept, from the
    mask actually used) and the per-cell targets.

    Args:
        grid: ``P`` or ``(rows, cols)``.
        alpha: Beta(alpha, alpha) parameter of each mask entry, rounded to {0, 1} (the paper's pseudo-code). The
            rounded draw is 0 or 1 with probability 1/2 for every ``alpha`` (the distribution is symmetric about
            1/2), so the masks do not depend on it; it is kept for the paper's notation.
        prob: probability that a sample (``elem``), a pair (``pair``) or the batch (``batch``) is mixed.
        mode: ``'elem'`` (own mask and partner per sample), ``'pair'`` (partners swap the same cells, as timm's
            pair mode) or ``'batch'`` (one mask for the whole batch).
        label_smoothing: smoothing applied alike to image and patch targets.
        num_classes: number of classes of the targets.
        cuda_graph: on a CUDA batch, draw the params through a captured CUDA graph (below). ``False`` draws them
            eagerly, as on every other device.

    Like timm's ``Mixup``, the batch is mixed **in place**: ``x`` itself is returned, holding the mixed images
    (clone it first to keep the originals). No batch data is kept between calls, so the mixer is safe wherever its
    output goes: DataLoader workers, pinned or shared memory, ``inference_mode``.

    On a CUDA batch a call is bound by the host: a dozen small kernels to draw partners and masks, each costing a
    launch. So ``mixer(x, target)`` draws them, with the pixel mask, lam and the target's keep columns, by replaying
    a CUDA graph captured at the first call of each batch shape (up to eight per mixer; further shapes draw
    eagerly), and launches only the select and the labels' kernels itself. A replay draws from the device's default
    generator with the eager draw's kernels, so it gives the batch that ``apply(x, target, sample(...))`` gives from
    the same generator state (tested), and capturing draws nothing. Every replay waits for the kernels that read the
    one before, on whatever stream they ran. An explicit ``generator``, ``torch.compile`` or ``torch.jit`` tracing,
    a stream that is itself capturing a graph and ``cuda_graph=False`` take the eager draw; a capture that fails
    raises, naming ``cuda_graph=False``. The first call of a shape captures, which costs a few milliseconds: make
    one mixer and keep it, as with timm's ``Mixup``.
    """

    def __init__(self, grid: GridSpec = 4, alpha: float = 1.0, prob: float = 1.0, mode: str = 'elem',
                 label_smoothing: float = 0.0, num_classes: Optional[int] = None, cuda_graph: bool = True):
        self.grid = to_grid(grid)
        alpha = _number(alpha, 'alpha', 0.0, low_open=True)
        if not isinstance(cuda_graph, bool):
            raise ValueError(f'cuda_graph must be True or False, got {cuda_graph!r}')
        self.cuda_graph = cuda_graph
        self._graphs: Dict[tuple, _DrawGraph] = {}
        self._replayed: Dict[torch.device, torch.cuda.Event] = {}  # per device, after the last replay's readers
        self._graph_lock = threading.Lock()
        self.alpha = float(alpha)
        self.prob, self.mode, self.label_smoothing, self.num_classes = prob, mode, label_smoothing, num_classes
        self.mixup_enabled = True  # timm's train loop switches mixing off through this flag

    # The settings below may change between calls, as timm's Mixup attributes may: each is checked when set, so a
    # bad value is an error naming it, not a silently different mix at the next batch.
    @property
    def prob(self) -> float:
        return self._prob

    @prob.setter
    def prob(self, value: float) -> None:
        self._prob = _number(value, 'prob', 0.0, 1.0)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MIX_MODES:
            raise ValueError(f'mode must be one of {MIX_MODES}, got {value!r}')
        self._mode = value

    @property
    def label_smoothing(self) -> float:
        return self._label_smoothing

    @label_smoothing.setter
    def label_smoothing(self, value: float) -> None:
        self._label_smoothing = _number(value, 'label_smoothing', 0.0, 1.0, high_open=True)

    @property
    def num_classes(self) -> int:
        return self._num_classes

    @num_classes.setter
    def num_classes(self, value: int) -> None:
        if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) or value < 1:
            raise ValueError(f'num_classes must be a positive int, got {value!r}')
        self._num_classes = int(value)

    @property
    def num_cells(self) -> int:
        return self.grid[0] * self.grid[1]

    def __getstate__(self) -> dict:
        # captured graphs, their event and the lock belong to this process (a pickled mixer goes to workers)
        state = self.__dict__.copy()
        for name in ('_graphs', '_replayed', '_graph_lock'):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault('cuda_graph', True)
        for name in ('prob', 'mode', 'label_smoothing', 'num_classes'):  # a mixer pickled before these were checked
            if name in state:
                state['_' + name] = state.pop(name)
        self.__dict__.update(state)
        self._graphs, self._replayed, self._graph_lock = {}, {}, threading.Lock()

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(grid={self.grid}, alpha={self.alpha}, prob={self.prob}, mode={self.mode!r}, '
                f'label_smoothing={self.label_smoothing}, num_classes={self.num_classes})')

    def _mask_bits(self, shape, generator, dev) -> torch.Tensor:
        # round(Beta(a, a)) is 1 exactly when the draw exceeds 1/2. Beta(a, a) is symmetric about 1/2, so that
        # event has probability 1/2 for every a > 0: the rounded entry is a fair coin, drawn here directly so that
        # a torch.Generator controls it.
        return torch.rand(shape, generator=generator, device=dev) < 0.5

    def _masks(self, n: int, rows: int, cols: int, generator, dev) -> torch.Tensor:
        """``n`` keep masks; each is all True (unmixed) with probability ``1 - prob``."""
        mask = self._mask_bits((n, rows, cols), generator, dev)
        if self.prob < 1.0:
            mask |= (torch.rand(n, generator=generator, device=dev) >= self.prob).view(-1, 1, 1)
        return mask

    def sample(self, batch_size: int, *, generator: Optional[torch.Generator] = None,
               device=None) -> PatchMixParams:
        """Draw partners and keep masks for a batch of ``batch_size`` on ``device`` (default: the CPU).

        The draws are made on ``generator``'s device, or on ``device`` when no generator is given. Drawn on an
        accelerator, nothing waits for the host: the params are sampled where the batch lives.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 0:
            raise ValueError(f'batch_size must be a non-negative int, got {batch_size!r}')
        batch_size = int(batch_size)  # a numpy integer too, as grid and num_classes take
        _check_generator(generator)
        rows, cols = self.grid
        gdev = generator.device if generator is not None else torch.device('cpu' if device is None else device)
        if not self.mixup_enabled or batch_size == 0:
            return PatchMixParams.identity(batch_size, self.grid, device=device)
        if self.mode == 'elem':
            partner = _random_cycle(batch_size, generator, gdev)
            mask = self._masks(batch_size, rows, cols, generator, gdev)
        elif self.mode == 'batch':
            partner = _random_cycle(batch_size, generator, gdev)
            mask = self._masks(1, rows, cols, generator, gdev).expand(batch_size, rows, cols).clone()
        else:  # pair: samples a and b of a pair swap the same cells; an odd one out stays unmixed
            order = torch.randperm(batch_size, generator=generator, device=gdev)
            npair = batch_size // 2
            a, b = order[0:2 * npair:2], order[1:2 * npair:2]
            partner = torch.arange(batch_size, device=gdev)
            partner[a], partner[b] = b, a
            pair_mask = self._masks(npair, rows, cols, generator, gdev)
            mask = torch.ones(batch_size, rows, cols, dtype=torch.bool, device=gdev)
            mask[a], mask[b] = pair_mask, pair_mask
        # a sample partnered with itself is unmixed, so its lam is 1. Only a batch of one has such a sample in elem
        # and batch mode (a random cycle over two or more has no fixed point); pair mode's odd one out already has
        # an all-keep mask. So no per-sample check is needed, and none is dispatched.
        if batch_size == 1:
            mask.fill_(True)
        return PatchMixParams(partner.to(device), mask.to(device))

    def _check_image(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f'x must be a 4-D image batch [B, C, H, W], got {shape}')
        try:
            check_grid_fits(x.shape[2], x.shape[3], *self.grid)
        except ValueError as e:
            if x.shape[3] in (1, 3, 4) and x.shape[1] > 4:  # channels last in the shape, as images on disk are
                raise ValueError(f'{e} (x has shape {list(x.shape)}: if that is [B, H, W, C], permute it to '
                                 f'[B, C, H, W]; channels_last memory keeps the shape [B, C, H, W])') from None
            raise

    def apply(self, x: torch.Tensor, target: torch.Tensor, params: PatchMixParams,
              source: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, *,
              fresh: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Mix ``x [B, C, H, W]`` in place with ``params`` and return ``(x, packed_target)``.

        ``target`` is class indices ``[B]`` or a one-hot/soft ``[B, num_classes]``. The packed target is float32
        on ``x``'s device whatever the image dtype. ``source``, when given, is ``(images [N, C, H, W], targets [N])``
        that ``params.partner`` indexes instead of the batch itself (the guided mixer appends remembered images to
        a copy of the batch this way). ``fresh=True`` says that ``x`` was just made by the caller and nothing else
        has seen it, which lets a CPU write it faster (see :func:`mix_cells_`); the collate-mixer passes it.
        """
        self._check_image(x)
        b, _, h, w = x.shape
        if not isinstance(params, PatchMixParams):
            raise ValueError(f'params must be PatchMixParams (from PatchMix.sample), got {type(params).__name__}')
        if source is not None and (not isinstance(source, (tuple, list)) or len(source) != 2):
            got = f'a sequence of {len(source)}' if isinstance(source, (tuple, list)) else type(source).__name__
            raise ValueError(f'source must be a pair (images [N, C, H, W], targets [N]), got {got}')
        src_x, src_t = (None, None) if source is None else source
        if src_x is not None and (not isinstance(src_x, torch.Tensor) or src_x.shape[1:] != x.shape[1:]):
            got = list(src_x.shape) if isinstance(src_x, torch.Tensor) else type(src_x).__name__
            raise ValueError(f'source images must have shape [N, {", ".join(map(str, x.shape[1:]))}], got {got}')
        # (a source of another dtype is refused where cells are copied, in mix_cells_ and _select, before any write)
        if src_x is not None and src_t is None:
            raise ValueError('source targets are missing: source must be (images [N, C, H, W], targets [N])')
        params.validate(b, None if src_x is None else src_x.shape[0])
        if params.grid != self.grid:
            raise ValueError(f'params are for a {params.grid[0]}x{params.grid[1]} grid but this mixer uses '
                             f'{self.grid[0]}x{self.grid[1]}')
        return self._apply(x, target, params, src_x, src_t, fresh=fresh)

    def _apply(self, x: torch.Tensor, target: torch.Tensor, params: PatchMixParams,
               src_x: Optional[torch.Tensor] = None, src_t: Optional[torch.Tensor] = None, *, fresh: bool = False):
        """:meth:`apply` on checked inputs. On an accelerator it launches a fixed sequence of kernels with no
        host synchronisation: partner gather and one select on a pixel mask made by indexing."""
        b, _, h, w = x.shape
        y = soft_target(target, self.num_classes, self.label_smoothing, batch_size=b, device=x.device)
        y_src = y if src_x is None else soft_target(src_t, self.num_classes, self.label_smoothing,
                                                    batch_size=src_x.shape[0], device=x.device)
        partner = params.partner.to(x.device)
        mask = params.mask.to(x.device)
        source = None if src_x is None else src_x.to(x.device)
        if not _per_cell(x.device):
            return _finish(x, y, y_src, partner, *_mask_parts(mask, h, w), source)
        # per-cell copies of only the cells that change: fewer bytes, and a CPU pays nothing per kernel
        mix_cells_(x, partner, mask, source, fresh=fresh)
        lam = (mask.to(torch.float64) * cell_areas(h, w, self.grid)).sum((1, 2)) / (h * w)
        # index_select rather than y_src[partner]: the same gather, without advanced indexing's host-side parsing
        # (and the CPU's index kernel is several times slower for rows of many classes)
        return x, pack_target(y, y_src.index_select(0, partner), lam, mask)

    def __call__(self, x: torch.Tensor, target: torch.Tensor,
                 generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sample params for ``x``'s batch on its device (or ``generator``'s), then apply them. The params are
        this mixer's own, so only their shapes need checking: on an accelerator the whole call runs without a
        host synchronisation (after a CUDA batch shape's first call, which captures its draw; see the class)."""
        self._check_image(x)
        _check_generator(generator)
        if (generator is None and x.is_cuda and self.cuda_graph and self.mixup_enabled and x.shape[0] > 0
                and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
                and not torch.cuda.is_current_stream_capturing()):
            out = self._call_graphed(x, target)
            if out is not None:
                return out
        return self._apply(x, target, self.sample(x.shape[0], generator=generator, device=x.device))

    def _call_graphed(self, x: torch.Tensor, target: torch.Tensor):
        """A call on the captured draw of ``x``'s batch shape; ``None`` where it is to draw eagerly (this mixer
        already holds its most captured draws)."""
        b, _, h, w = x.shape
        dev = x.device
        key = (b, h, w, dev, self.mode, self.prob, self.grid)
        with self._graph_lock, (nullcontext() if dev.index == torch.cuda.current_device() else torch.cuda.device(dev)):
            draw = self._graphs.get(key)
            if draw is None:
                if len(self._graphs) >= _MAX_DRAW_GRAPHS:
                    return None
                draw = self._graphs[key] = _capture_draw(self, b, h, w, dev)
            # the labels first: a bad target raises before anything is replayed
            y = soft_target(target, self.num_classes, self.label_smoothing, batch_size=b, device=dev)
            replayed = self._replayed.get(dev)
            if replayed is None:
                replayed = self._replayed[dev] = torch.cuda.Event()
            stream = torch.cuda.current_stream()
            # every replay on this device waits for the kernels that read the one before, on whatever stream they
            # ran: a replay rewrites its graph's outputs, and graphs that draw from one generator share its state
            stream.wait_event(replayed)
            draw.graph.replay()
            try:
                return _finish(x, y, y, draw.partner, draw.pix, draw.head, draw.keep, None)
            finally:
                replayed.record(stream)
