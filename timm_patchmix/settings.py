"""Settings records: what a resumed or rerun step compares with the run that wrote its files.

A training state, a search state and each phase of the pipeline record the settings they ran with. A resume or rerun
with other settings raises :class:`SettingsChangedError`, naming each differing setting with its recorded and its
new value, before anything is written; the command-line entry points turn it into exit status 2. Files given as
settings (a mask table, a checkpoint) are compared by content, so a moved file with the same bytes still matches.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .checkpoint import atomic_write_text

__all__ = ['SettingsChangedError', 'file_record', 'differences', 'check_settings', 'read_settings', 'read_record',
           'write_settings', 'USAGE_ERROR', 'NUMBER', 'INTEGER', 'STRING', 'OBJECT', 'OBJECTS']

USAGE_ERROR = 2  # exit status of a refused resume or rerun, as for other usage errors
INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT, as a shell reports a process SIGINT stopped)


class SettingsChangedError(ValueError):
    """A resume or rerun asks for other settings than those its existing files were made with."""


# files that mark a folder as another command's output: a root folder of the pipeline, the study or a search that
# holds one is refused (their fixed-name files, masks.json, report.md..., would replace that command's or mix with
# them)
OUTPUT_MARKERS = {'state.safetensors': 'a training run (train.py)', 'args.yaml': 'a training run (train.py)',
                  'search_state.safetensors': 'a search (search.py)', 'logbook.csv': 'a search (search.py)',
                  'study.json': 'a study', 'report.md': 'a pipeline or a study',
                  'model.safetensors': 'a Hub export (hub export)'}


def foreign_output(folder: str, own: Sequence[str] = ()) -> Optional[str]:
    """The error text for a ``folder`` that holds another command's output (a file of :data:`OUTPUT_MARKERS`
    not in ``own``), or None."""
    found = [n for n in OUTPUT_MARKERS if n not in own and os.path.isfile(os.path.join(folder, n))]
    if not found:
        return None
    return (f'cannot use {folder}: it holds the output of {OUTPUT_MARKERS[found[0]]} ({found[0]}), which this '
            f'command\'s files would mix with or replace. Choose another --output (or delete {folder} first).')


def file_record(path: str) -> Dict[str, str]:
    """A file as a setting: its path and the SHA-256 of its content (what comparisons use)."""
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return {'path': path, 'sha256': h.hexdigest()}


def _is_file(v: Any) -> bool:
    return isinstance(v, dict) and set(v) == {'path', 'sha256'}


def _normal(v: Any) -> Any:
    """The value as compared: a file by its content, tuples as lists (as they come back from JSON)."""
    if _is_file(v):
        return v['sha256']
    if isinstance(v, (tuple, list)):
        return [_normal(x) for x in v]
    return v


def _show(v: Any) -> str:
    if _is_file(v):
        return f"{v['path']!r} (sha256 {v['sha256'][:12]})"
    if isinstance(v, tuple):
        v = list(v)
    return repr(v)


def differences(recorded: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    """``'<setting>: <recorded> before, <now> now'`` for each setting present in both records that differs.

    A setting that either record lacks (one written by an older version) is not compared."""
    out = []
    for key, new in now.items():
        if key not in recorded:
            continue
        old = recorded[key]
        if _normal(old) != _normal(new):
            out.append(f'{key}: {_show(old)} before, {_show(new)} now')
    return out


def check_settings(recorded: Dict[str, Any], now: Dict[str, Any], what: str, remedy: str) -> None:
    """Raise :class:`SettingsChangedError` listing every difference between ``recorded`` and ``now``.

    ``what`` names the existing files (e.g. ``"cannot resume from out/state.safetensors: it was written"``),
    ``remedy`` says what the user can do."""
    if not isinstance(recorded, dict):
        raise SettingsChangedError(f'{what} with a settings record that cannot be read ({type(recorded).__name__} '
                                   f'instead of a mapping), so whether this run matches is unknown.\n{remedy}')
    diff = differences(recorded, now)
    if diff:
        raise SettingsChangedError(f'{what} with other settings than this run:\n  ' + '\n  '.join(diff) +
                                   f'\n{remedy}')


def read_settings(path: str) -> Optional[Dict[str, Any]]:
    """The settings recorded at ``path`` (JSON), or ``None`` when there is no record."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding='utf-8') as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise SettingsChangedError(f'{path} cannot be read ({e}), so the settings its folder was made with are '
                                   f'unknown; delete the folder to start it again') from None
    if not isinstance(doc, dict):
        raise SettingsChangedError(f'{path} is not a settings record; delete its folder to start it again')
    return doc


# what a value in a record must be, for read_record's ``need``: a test, and the words the error uses for it
Kind = Tuple[Callable[[Any], bool], str]
NUMBER: Kind = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                'a number')
INTEGER: Kind = (lambda v: isinstance(v, int) and not isinstance(v, bool), 'an integer')
STRING: Kind = (lambda v: isinstance(v, str), 'a string')
OBJECT: Kind = (lambda v: isinstance(v, dict), 'an object')
OBJECTS: Kind = (lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), 'a list of objects')


def read_record(path: str, noun: str, remedy: str, error: type,
                need: Union[Sequence[str], Mapping[str, Optional[Kind]]] = ()) -> Dict[str, Any]:
    """The JSON object at ``path`` (a finished phase's or task's ``done.json``) holding the keys ``need``, each of
    the :data:`Kind` it maps to (a sequence of keys, or a key mapped to None, is checked only to be there); else
    ``error`` with a message naming the file, what it is not (``noun``), why, and ``remedy``."""
    try:
        with open(path, encoding='utf-8') as f:
            rec = json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f'{path} is not a {noun} (not valid JSON: {e}); {remedy}') from None
    except OSError as e:
        raise error(f'{path} cannot be read ({e}); {remedy}') from None
    if not isinstance(rec, dict):
        raise error(f'{path} is not a {noun} (a JSON {type(rec).__name__}, not an object); {remedy}')
    missing = [k for k in need if k not in rec]
    if missing:
        raise error(f'{path} is not a {noun} (no {", ".join(missing)}); {remedy}')
    kinds = need.items() if isinstance(need, Mapping) else ()
    for key, kind in kinds:
        if kind is not None and not kind[0](rec[key]):
            raise error(f'{path} is not a {noun} ({key} must be {kind[1]}, got {rec[key]!r}); {remedy}')
    return rec


def write_settings(path: str, settings: Dict[str, Any]) -> None:
    """Record ``settings`` at ``path`` as JSON, atomically."""
    atomic_write_text(path, json.dumps(settings, indent=1, sort_keys=True) + '\n')
