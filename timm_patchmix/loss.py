"""PatchMixLoss: the image-level and patch-level objective of PatchMix (equation 4 of the paper)."""
from __future__ import annotations

from typing import Optional, Set, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .grid import GridSpec, to_grid
from .mix import _HEADER, _number, _packed_class_count, is_packed_target, soft_target, split_target

__all__ = ['PatchMixLoss', 'packed_loss', 'soft_cross_entropy', 'binary_cross_entropy']

ModelOutput = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``-sum(target * log_softmax(logits))`` over the last dim, computed in float32; no reduction."""
    return -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def binary_cross_entropy(logits: torch.Tensor, target: torch.Tensor, threshold: Optional[float] = None,
                         sum_classes: bool = False, pos_weight: Optional[float] = None) -> torch.Tensor:
    """timm's ``BinaryCrossEntropy`` per row: each class a sigmoid against its target (made 0 or 1 above
    ``threshold`` when given), the positive term weighted by ``pos_weight``; averaged over the last dim, or summed
    with ``sum_classes``. Computed in float32; no reduction over the other dims."""
    x, y = logits.float(), target.float()
    if threshold is not None:
        y = y.gt(threshold).float()
    if pos_weight is None:
        loss = F.binary_cross_entropy_with_logits(x, y, reduction='none')
    else:  # torch's pos_weight term, with a plain number (no tensor to move to the device each step)
        loss = -(pos_weight * y * F.logsigmoid(x) + (1 - y) * F.logsigmoid(-x))
    return loss.sum(-1) if sum_classes else loss.mean(-1)


class PatchMixLoss(nn.Module):
    """L_T = (L_O + w * L_P / P^2) / 2 for a patch-head model; L_O alone for a plain classifier.

    L_O is the soft cross-entropy of the image logits ``[B, C]`` against the mixed image target, and L_P the sum
    over the ``P^2 = rows*cols`` cells of the soft cross-entropy of the patch logits ``[B, rows*cols, C]`` against
    each cell's source label; both are averaged over the batch.

    Targets may be a packed PatchMix target, a soft ``[B, C]`` target (image loss only) or class indices ``[B]``
    (unmixed: cross-entropy, and every cell's target is the image label).

    Args:
        image_loss: include L_O.
        patch_loss: include L_P. With only one of the two on, the loss is that term alone (L_O, or w * L_P / P^2).
        patch_weight: ``w``, the weight of the patch term.
        smoothing: label smoothing of class-index targets, for the image and every cell alike (timm's
            ``LabelSmoothingCrossEntropy``: ``y * (1 - s) + s / C``). Packed and soft targets carry their own
            smoothing (``PatchMix(label_smoothing=...)``, timm's ``Mixup``) and are used as given.
        bce: score each row (the image, each cell) by timm's ``BinaryCrossEntropy`` (:func:`binary_cross_entropy`)
            instead of the soft cross-entropy, against the same targets; L_P is then the mean over the cells of
            the cells' BCE, as L_P / P^2 is of their cross-entropy.
        bce_target_thresh, bce_sum, bce_pos_weight: timm's ``target_threshold``, ``sum_classes`` and
            ``pos_weight`` of the BCE.
        grid: the model's grid (``model.grid``), when known: a packed target of another grid with as many cells
            (a transposed 3x4 for a 4x3 model) is then refused, not scored against the wrong regions. Without
            it the header's cell count is checked, which cannot tell such grids apart. ``train.py`` passes it.
    """

    def __init__(self, image_loss: bool = True, patch_loss: bool = True, patch_weight: float = 1.0,
                 smoothing: float = 0.0, bce: bool = False, bce_target_thresh: Optional[float] = None,
                 bce_sum: bool = False, bce_pos_weight: Optional[float] = None, grid: Optional[GridSpec] = None):
        super().__init__()
        for name, value in (('image_loss', image_loss), ('patch_loss', patch_loss), ('bce', bce),
                            ('bce_sum', bce_sum)):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f'{name} must be True or False, got {value!r}')
        image_loss, patch_loss, bce, bce_sum = bool(image_loss), bool(patch_loss), bool(bce), bool(bce_sum)
        if not (image_loss or patch_loss):
            raise ValueError('PatchMixLoss needs image_loss or patch_loss (or both) switched on')
        self.image_loss = image_loss
        self.patch_loss = patch_loss
        self.patch_weight = _number(patch_weight, 'patch_weight', 0.0)
        self.smoothing = _number(smoothing, 'smoothing', 0.0, 1.0, high_open=True)
        self.bce = bool(bce)
        self.bce_target_thresh = (None if bce_target_thresh is None
                                  else _number(bce_target_thresh, 'bce_target_thresh', 0.0, 1.0, high_open=True))
        self.bce_sum = bool(bce_sum)
        self.bce_pos_weight = None if bce_pos_weight is None else _number(bce_pos_weight, 'bce_pos_weight', 0.0)
        if not self.bce and (self.bce_target_thresh is not None or self.bce_sum or self.bce_pos_weight is not None):
            raise ValueError('bce_target_thresh, bce_sum and bce_pos_weight set the BCE of bce=True')
        self.grid = None if grid is None else to_grid(grid)
        # the target layouts whose packed header was read on an accelerator (see _check_header)
        self._headers_read: Set[tuple] = set()

    def extra_repr(self) -> str:
        text = (f'image_loss={self.image_loss}, patch_loss={self.patch_loss}, patch_weight={self.patch_weight}, '
                f'smoothing={self.smoothing}')
        if self.grid is not None:
            text += f', grid={self.grid}'
        if self.bce:
            text += (f', bce=True, bce_target_thresh={self.bce_target_thresh}, bce_sum={self.bce_sum}, '
                     f'bce_pos_weight={self.bce_pos_weight}')
        return text

    def _check_header(self, target: torch.Tensor, c: int, ncell: int) -> None:
        """A packed target of the width that ``c`` classes and ``ncell`` cells give was packed for them: its
        header's grid has ``ncell`` cells (another grid and class count can give the same width, 3 + 2C + cells,
        and would be scored with its columns misread). On the CPU every call reads it; on an accelerator, where
        the read waits for the device, the first call of each target width and device does, so later steps run
        without a host synchronisation. Nothing is read while ``torch.compile`` or ``torch.jit.trace`` traces, while
        a CUDA graph captures, or from a meta tensor or a tensor subclass (a fake tensor has no values)."""
        key = (target.device, target.shape[1], c, ncell)
        if not self._to_read(target, key):
            return
        rows, cols = (int(v) for v in target[0, :2].tolist())
        if self.grid is not None and (rows, cols) != self.grid and rows * cols == ncell:
            raise ValueError(f'packed target was built for a {rows}x{cols} grid, but the loss is for the model\'s '
                             f'{self.grid[0]}x{self.grid[1]} grid: its cells would be scored against other regions; '
                             f'mix with the grid of the model')
        if rows * cols != ncell:
            packed_c = (target.shape[1] - _HEADER - rows * cols) / 2
            raise ValueError(f'packed target was built for a {rows}x{cols} grid ({rows * cols} cells) and '
                             f'{packed_c:g} classes, but the model gives {ncell} patch logits of {c} classes; mix with '
                             f'the grid and num_classes of the model')
        self._read(target, key)

    def _to_read(self, target: torch.Tensor, key: tuple) -> bool:
        """Whether a check reads ``target``'s values for the layout ``key``: every call on the CPU, the first
        of each layout on an accelerator (where the read waits for the device), never while tracing or capturing or
        where no values are there to read (a meta tensor, a subclass such as a fake tensor)."""
        if (target.shape[0] == 0 or torch.compiler.is_compiling() or torch.jit.is_tracing()
                or target.device.type == 'meta' or type(target) is not torch.Tensor):
            return False
        return target.device.type == 'cpu' or not (
            key in self._headers_read or (target.is_cuda and torch.cuda.is_current_stream_capturing()))

    def _read(self, target: torch.Tensor, key: tuple) -> None:
        """Record that ``target``'s layout ``key`` passed its check (on an accelerator, it is not read again)."""
        if target.device.type != 'cpu':
            self._headers_read.add(key)

    def _check_not_packed(self, target: torch.Tensor, c: int) -> None:
        """A ``[B, c]`` target has the width of a packed target of fewer classes where ``3 + 2k + cells == c``
        (one mixed for another ``num_classes``): scored as a soft target, its header, lam and cell masks would be
        read as class probabilities. It is read (when ``_to_read`` says) and refused where every row holds a packed
        target's fields: one integer grid header, lam in [0, 1] that is 1 exactly where every cell is kept and 0
        where none is, two label rows that each sum to 1, and 0/1 cells. A soft target of ``c`` classes (its rows
        sum to 1) cannot hold them all, and multi-hot BCE targets would have to hold them in every row."""
        key = ('soft', target.device, c)
        if not self._to_read(target, key):
            return
        t = target.detach().double().cpu()
        rows, cols = float(t[0, 0]), float(t[0, 1])
        k = (_packed_class_count(c, int(rows), int(cols))
             if rows.is_integer() and cols.is_integer() and rows >= 1 and cols >= 1 else None)
        if k is not None:
            lam, keep = t[:, 2], t[:, _HEADER + 2 * k:]
            labels = (t[:, _HEADER:_HEADER + k], t[:, _HEADER + k:_HEADER + 2 * k])
            if (bool((t[:, :2] == t[:1, :2]).all()) and bool(((lam >= 0) & (lam <= 1)).all())
                    and all(bool(((y.sum(1) - 1).abs() < 1e-4).all()) for y in labels)
                    and bool(((keep == 0) | (keep == 1)).all())
                    and bool(((lam == 1) == (keep == 1).all(1)).all())
                    and bool(((lam == 0) == (keep == 0).all(1)).all())):
                raise ValueError(f'packed target holds {k} classes (a {int(rows)}x{int(cols)} grid) but the model '
                                 f'has {c}; mix with num_classes={c}')
        self._read(target, key)

    def _rows(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of each row (over the last dim): the soft cross-entropy, or the BCE with ``bce``."""
        if self.bce:
            return binary_cross_entropy(logits, target, self.bce_target_thresh, self.bce_sum, self.bce_pos_weight)
        return soft_cross_entropy(logits, target)

    def forward(self, output: ModelOutput, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, (tuple, list)):
            if len(output) != 2:
                raise ValueError(f'expected (logits, patch_logits), got a sequence of {len(output)}')
            logits, patch_logits = output
        else:
            logits, patch_logits = output, None
        if logits.ndim != 2:
            raise ValueError(f'logits must be [B, C], got {list(logits.shape)}')
        b, c = logits.shape
        if patch_logits is not None and (patch_logits.ndim != 3 or patch_logits.shape[0] != b
                                         or patch_logits.shape[2] != c):
            raise ValueError(f'patch_logits must be [B, cells, C] = [{b}, cells, {c}], got {list(patch_logits.shape)}')
        if not isinstance(target, torch.Tensor):  # a list or numpy array of class indices, as the mixers take
            target = torch.as_tensor(target, device=logits.device)
        if target.ndim == 0:
            raise ValueError('target must be class indices [B], a soft target [B, C] or a packed target, got a '
                             'scalar')
        if target.shape[0] != b:
            raise ValueError(f'target batch size {target.shape[0]} does not match the logits batch size {b}')
        if b == 0:  # (a mean over no samples: timm's losses give nan)
            raise ValueError('PatchMixLoss got an empty batch (0 samples), whose mean loss is undefined')

        use_patch = patch_logits is not None and self.patch_loss
        if use_patch and self.image_loss and not self.bce and is_packed_target(target, c, patch_logits.shape[1]):
            self._check_header(target, c, patch_logits.shape[1])
            return packed_loss(logits, patch_logits, target, self.patch_weight)
        if target.ndim == 1:
            image_t = soft_target(target, c, self.smoothing, device=logits.device)
            patch_t = image_t.unsqueeze(1) if use_patch else None
        elif target.ndim == 2 and target.shape[1] == c:
            self._check_not_packed(target, c)
            if use_patch:
                raise ValueError('a soft [B, C] target has no per-cell labels for the patch loss; pass a packed '
                                 'PatchMix target or class indices, or use PatchMixLoss(patch_loss=False)')
            image_t, patch_t = target.float(), None
        else:
            ncell = patch_logits.shape[1] if patch_logits is not None else None
            fits = ncell is not None and is_packed_target(target, c, ncell)
            # (the header is read only where the width alone does not settle it; split_target reads it anyway)
            k = None if fits or target.ndim != 2 else _packed_classes(target)
            if not (fits or (ncell is None and k == c)):
                if k is not None and k != c:
                    raise ValueError(f'packed target holds {k} classes but the model has {c}; mix with '
                                     f'num_classes={c}')
                if k == c:  # a packed target of another grid: the header check names both grids
                    self._check_header(target, c, ncell)
                # (e.g. a soft target of timm's Mixup made for another num_classes)
                cells = f' and {ncell} cells' if ncell is not None else ''
                raise ValueError(f'target of shape {list(target.shape)} is neither class indices, a [B, {c}] '
                                 f'soft target for the model\'s {c} classes, nor a packed target for {c} classes'
                                 f'{cells}; make the targets for num_classes={c}')
            image_t, patch_t = split_target(target, self.grid)  # (a given grid is checked on plain logits too)
            if image_t.shape[1] != c:  # a packed target of another grid and class count but the same width
                raise ValueError(f'packed target holds {image_t.shape[1]} classes but the model has {c}; mix with '
                                 f'num_classes={c}')

        if not use_patch:
            return self._rows(logits, image_t).mean()
        ncell = patch_logits.shape[1]
        if patch_t.shape[1] not in (1, ncell):
            raise ValueError(f'packed target has {patch_t.shape[1]} cells but the model gives {ncell} patch logits')
        if patch_t.shape[1] == 1 and self.bce:  # the BCE's threshold and pos weight take rows of the full shape
            patch_t = patch_t.expand(-1, ncell, -1)
        l_p = self._rows(patch_logits, patch_t).sum(1).mean()
        patch_term = self.patch_weight * l_p / ncell
        if not self.image_loss:
            return patch_term
        l_o = self._rows(logits, image_t).mean()
        return (l_o + patch_term) / 2


def _packed_classes(target: torch.Tensor) -> Optional[int]:
    """The class count of ``target`` (2-D, at least one row) read as a packed target: the width its header's grid
    leaves for the two class blocks, halved; None when the header and width make no packed target (reads the
    header: a sync on an accelerator, as splitting the target does anyway)."""
    rows, cols = (int(v) for v in target[0, :2].tolist()) if target.shape[1] >= 2 else (0, 0)
    return _packed_class_count(target.shape[1], rows, cols)


def packed_loss(logits: torch.Tensor, patch_logits: torch.Tensor, packed: torch.Tensor,
                patch_weight: float = 1.0) -> torch.Tensor:
    """L_T = (L_O + w * L_P / K) / 2 for logits ``[B, C]``, patch logits ``[B, K, C]`` and a packed target, in one
    pass over the ``1 + K`` rows of each sample.

    The image row and the K cell rows share one log-softmax, and their targets are one interpolation between the
    two label rows of the packed target: ``lam`` for the image row, the 0/1 keep mask for a cell (the packed
    layout of :func:`~timm_patchmix.mix.pack_target`). The per-row weights (``1 / 2B`` for the image row and
    ``w / 2KB`` for each cell) fold the batch mean and the ``/ 2`` into one dot product. About a third of the
    kernels of scoring the two terms apart, and no value leaves the device: the packed header is not read, the
    widths alone locate its fields. Computed in float32.
    """
    b, k, c = patch_logits.shape
    rows = torch.cat([logits.unsqueeze(1), patch_logits], 1).float()  # [B, 1 + K, C]: image row, then the cells
    packed = packed.float()
    y_self = packed[:, _HEADER:_HEADER + c].unsqueeze(1)
    y_partner = packed[:, _HEADER + c:_HEADER + 2 * c].unsqueeze(1)
    share = torch.cat([packed[:, 2:3], packed[:, _HEADER + 2 * c:]], 1).unsqueeze(2)  # lam, then keep per cell
    target = torch.lerp(y_partner, y_self, share)  # exactly y_self or y_partner where share is 1 or 0
    per_row = (target * F.log_softmax(rows, dim=-1)).sum((0, 2))  # [1 + K]: minus each row's CE, summed over B
    weights = torch.cat([per_row.new_full((1,), -0.5 / b), per_row.new_full((k,), -float(patch_weight) / (2 * k * b))])
    return torch.dot(per_row, weights)
