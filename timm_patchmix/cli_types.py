"""Argument types shared by the command lines (train.py, search.py, pipeline, hub, robustness, demo).

Each one parses a single value or raises ``argparse.ArgumentTypeError`` with a message that names the value, so
argparse prints ``usage: ...`` and ``error: argument --epochs: must be an integer >= 1, got '0'`` and exits with
status 2 before any data or model is built::

    p.add_argument('--epochs', type=positive_int)
    p.add_argument('--smoothing', type=fraction)          # [0, 1)
    p.add_argument('--resume', type=optional_file)        # '' (unset) or an existing file, never a folder
"""
from __future__ import annotations

import argparse
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ['Bounds', 'bounds_of', 'int_range', 'float_range', 'positive_int', 'nonneg_int', 'seed_int', 'nonneg_seed',
           'positive_float', 'nonneg_float', 'probability', 'fraction', 'existing_file', 'optional_file', 'new_file',
           'directory', 'optional_directory', 'file_or_name', 'backbone_name', 'device_name', 'device_problem']


def _int_words(v: int) -> str:
    """An integer as a bound reads best: small ones in digits, large ones near a power of two as one
    (``-2**63``, ``2**63 - 1``, ``2**64 - 2**32``)."""
    if abs(v) < 2 ** 32:
        return str(v)
    a = abs(v)
    for p in (a.bit_length() - 1, a.bit_length()):
        r = a - 2 ** p
        m = abs(r)
        rest = '' if r == 0 else f'2**{m.bit_length() - 1}' if m & (m - 1) == 0 and m > 1024 else \
            str(m) if m <= 1024 else None
        if rest == '':
            return f'{"-" if v < 0 else ""}2**{p}'
        if rest is not None and v > 0:
            return f'2**{p} {"+" if r > 0 else "-"} {rest}'
    return str(v)


def _describe(lo, hi, lo_open: bool, hi_open: bool, kind: str) -> str:
    def num(v) -> str:  # (an integer bound exactly: a seed's 2**64 - 2**32 is no 1.84467e+19)
        return _int_words(v) if isinstance(v, int) else f'{v:g}'
    if lo is not None and hi is not None:
        return f'{kind} in {"(" if lo_open else "["}{num(lo)}, {num(hi)}{")" if hi_open else "]"}'
    if lo is not None:
        return f'{kind} {">" if lo_open else ">="} {num(lo)}'
    if hi is not None:
        return f'{kind} {"<" if hi_open else "<="} {num(hi)}'
    return kind


@dataclass(frozen=True)
class Bounds:
    """The range of a numeric flag, which also checks a value given in Python (``TrainConfig``): one rule for both.

    ``kind`` is ``'int'`` (an integer; not a bool, a float or a string) or ``'float'`` (a finite int or float; not a
    bool or a string). ``want`` is the phrase of the error messages: ``'an integer >= 1'``."""
    kind: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    @property
    def want(self) -> str:
        return _describe(self.lo, self.hi, self.lo_open, self.hi_open,
                         'an integer' if self.kind == 'int' else 'a finite number')

    def in_range(self, value) -> bool:
        """``value`` (a number) lies within the bounds."""
        lo, hi = self.lo, self.hi
        return not ((lo is not None and (value <= lo if self.lo_open else value < lo))
                    or (hi is not None and (value >= hi if self.hi_open else value > hi)))

    def accepts(self, value: Any) -> bool:
        """``value``, a Python value, is of the kind and within the bounds (numpy's numbers count as numbers)."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.kind == 'int':
            if not isinstance(value, numbers.Integral):
                return False
        elif not math.isfinite(value):
            return False
        return self.in_range(value)


def bounds_of(parse: Callable[[str], Any]) -> Optional[Bounds]:
    """The :class:`Bounds` of an argument type made by :func:`int_range` or :func:`float_range`; ``Bounds('int')``
    for the builtin ``int`` (any integer); ``None`` for any other type."""
    if parse is int:
        return Bounds('int')
    return getattr(parse, 'bounds', None)


def int_range(lo: Optional[int] = None, hi: Optional[int] = None, name: Optional[str] = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (either bound may be None). The type's ``bounds`` (:class:`Bounds`) is its range."""
    bounds = Bounds('int', lo, hi)
    want = bounds.want

    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f'must be {want}, got {text!r}') from None
        if not bounds.in_range(value):
            raise argparse.ArgumentTypeError(f'must be {want}, got {text!r}')
        return value

    parse.__name__ = name or f'int_range_{lo}_{hi}'
    parse.bounds = bounds  # type: ignore[attr-defined]
    return parse


def float_range(lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False, hi_open: bool = False,
                name: Optional[str] = None) -> Callable[[str], float]:
    """A finite float in the interval from lo to hi (closed unless ``lo_open``/``hi_open``); NaN and inf are refused.
    The type's ``bounds`` (:class:`Bounds`) is its range."""
    bounds = Bounds('float', lo, hi, lo_open, hi_open)
    want = bounds.want

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f'must be {want}, got {text!r}') from None
        if not math.isfinite(value) or not bounds.in_range(value):
            raise argparse.ArgumentTypeError(f'must be {want}, got {text!r}')
        return value

    parse.__name__ = name or f'float_range_{lo}_{hi}'
    parse.bounds = bounds  # type: ignore[attr-defined]
    return parse


positive_int = int_range(1, name='positive_int')                      # sizes, counts, epochs, grid cells
nonneg_int = int_range(0, name='nonneg_int')                          # 0 with a meaning: no workers, never, ...
positive_float = float_range(0.0, lo_open=True, name='positive_float')  # learning rates, Beta alphas
nonneg_float = float_range(0.0, name='nonneg_float')                  # weights, decays, eps; 0 often means off
probability = float_range(0.0, 1.0, name='probability')               # [0, 1]
fraction = float_range(0.0, 1.0, hi_open=True, name='fraction')       # [0, 1): label smoothing, Adam betas
# seeds: torch's generators take [-2**63, 2**64); 2**32 left for the epoch or step a run adds to its seed
seed_int = int_range(-(2 ** 63), 2 ** 64 - 2 ** 32, name='seed_int')
nonneg_seed = int_range(0, 2 ** 64 - 2 ** 32, name='nonneg_seed')      # those numpy's default_rng takes too


# --- paths --------------------------------------------------------------------------------------------------------
def _not_a_folder(text: str, what: str, empty: str) -> str:
    """``text`` unless it is empty or names an existing folder (errors say ``expects <what>``)."""
    if not text:
        raise argparse.ArgumentTypeError(f'expects {what}, got an empty {empty}')
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f'expects {what}, got the folder {text!r}')
    return text


def existing_file(text: str) -> str:
    """A file that exists; a folder or a missing path is refused."""
    _not_a_folder(text, 'a file', 'path')
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f'file {text!r} does not exist')
    return text


def optional_file(text: str) -> str:
    """``''`` (the flag's "unset" default) or an existing file."""
    return text if text == '' else existing_file(text)


def new_file(text: str) -> str:
    """A file to write (it may exist and is then replaced); a folder, or a path ending in a separator (a folder's
    name, which the write would find only after the work), is refused."""
    _not_a_folder(text, 'a file path', 'path')
    if text.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        raise argparse.ArgumentTypeError(f'expects a file path, got {text!r}, which ends in {text[-1]!r} as a '
                                         f'folder does')
    return text


def directory(text: str) -> str:
    """A folder, existing or to be created; an existing file (or a path through one) is refused."""
    if not text:
        raise argparse.ArgumentTypeError('expects a folder, got an empty path')
    path = os.path.abspath(text)
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if os.path.exists(path) and not os.path.isdir(path):
        what = 'the file' if path == os.path.abspath(text) else f'a path through the file {path!r}:'
        raise argparse.ArgumentTypeError(f'expects a folder, got {what} {text!r}')
    return text


def optional_directory(text: str) -> str:
    """``''`` (the flag's "unset" default) or a folder, as for :func:`directory`."""
    return text if text == '' else directory(text)


def file_or_name(text: str) -> str:
    """A file or a name that is not a path (``hf-hub:<repo>``, a registered tag); an existing folder is refused."""
    return _not_a_folder(text, 'a file or a name', 'string')


def backbone_name(text: str) -> str:
    """A timm architecture to run plain and as its ``patchhead_`` version (the pipeline's and the study's
    ``--model``): a registered name, not a ``patchhead_`` one."""
    import timm
    if not timm.is_model(text) or text.startswith('patchhead_'):
        raise argparse.ArgumentTypeError(f'{text!r} is not a timm model name (give the plain backbone; the PatchMix '
                                         'runs use its patchhead_ version)')
    return text


def device_problem(text: str) -> Optional[str]:
    """What is wrong with a ``--device`` name (None: nothing): torch cannot parse it, it is the meta device, which
    holds no data, or a CUDA (MPS, XPU) device on a machine without one."""
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError) as e:
        return f'not a torch device: {text!r} ({e})'
    if dev.type == 'meta':
        return f"{text!r} holds no data to compute with; give 'cpu' or 'cuda'"
    if dev.type == 'cuda' and not torch.cuda.is_available():
        return f'{text!r} names a CUDA device, and this machine has none; give cpu'
    others = {'mps': ('an Apple MPS', lambda: torch.backends.mps.is_available()),
              'xpu': ('an Intel XPU', lambda: hasattr(torch, 'xpu') and torch.xpu.is_available())}
    if dev.type in others and not others[dev.type][1]():  # (torch's error came at the first tensor moved there)
        return f'{text!r} names {others[dev.type][0]} device, and this machine or this torch build has none; give cpu'
    return None


def device_name(text: str) -> str:
    """A ``--device`` of :func:`device_problem`'s checks."""
    problem = device_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text
