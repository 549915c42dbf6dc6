"""The mask table a search writes and guided training reads: its JSON schema, the dataset fingerprint that ties it to
a label set, an atomic save and a load that checks every field (errors name the file and the field)."""
from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .checkpoint import atomic_write_text
from .grid import GridSpec, to_grid
from .validation import Fields, is_int, is_number

__all__ = ['MaskTable', 'MaskTableError', 'dataset_fingerprint', 'SCHEMA_VERSION']

SCHEMA_VERSION = 1


def _plain(value: Any) -> Any:
    """A numpy or torch value as the JSON value it stands for (``json.dumps``'s ``default``)."""
    if hasattr(value, 'tolist'):
        return value.tolist()
    raise TypeError(f'{type(value).__name__} {value!r}')


class MaskTableError(ValueError):
    """A mask table that is corrupt, of another schema, or made for another grid, label set or dataset."""


def dataset_fingerprint(dataset: str, class_names: Sequence[str]) -> str:
    """A short hash naming a dataset by its name and ordered class names (the same for every split)."""
    doc = json.dumps({'dataset': dataset or 'patchshapes', 'classes': list(class_names)}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def _finite_or_none(value: float) -> Optional[float]:
    """A score as standard JSON: a number, or ``null`` for an unknown (NaN) one."""
    value = float(value)
    if math.isnan(value):
        return None
    if not math.isfinite(value):
        raise MaskTableError(f'a mask table score must be finite or unknown (NaN), got {value}')
    return value


def _score(f: Fields, value: Any, field: str) -> float:
    """A finite score, or NaN for an unknown one (``null``, a missing field, or the ``NaN`` older files hold)."""
    if value is None or (is_number(value) and math.isnan(value)):
        return float('nan')
    return float(f.number(value, field, finite=True))


def check_run_values(num_classes: Any, fingerprint: Any) -> None:
    """The run's values a table is compared with, each ``None`` or of its kind (a ``ValueError`` naming it, as
    :class:`~timm_patchmix.mix.PatchMix` names a ``num_classes`` of another kind): a ``3.0`` or ``'3'`` compared
    equal or unequal to a table's 3 and gave no such error."""
    if num_classes is not None and (not isinstance(num_classes, numbers.Integral)
                                    or isinstance(num_classes, (bool, np.bool_)) or num_classes < 1):
        raise ValueError(f'num_classes must be a positive int, got {num_classes!r}')
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
        raise ValueError(f'fingerprint must be a non-empty str (dataset_fingerprint gives it), got {fingerprint!r}')


@dataclass(eq=False)
class MaskTable:
    """Searched class pairs and their ``rows x cols`` masks (True: the cell comes from the first class's image).

    Two tables are equal when every field is, the masks compared element by element (the dataclass's own ``==``
    would ask a numpy array for one truth value and raise)."""
    grid: Tuple[int, int]
    num_classes: int
    class_names: List[str]
    fingerprint: str
    pairs: List[Tuple[int, int]]
    masks: List[np.ndarray]
    scores: List[float]
    best_fitness: float
    search_args: Dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MaskTable):
            return NotImplemented
        plain = ('num_classes', 'fingerprint', 'best_fitness', 'search_args', 'schema_version')
        return (all(getattr(self, k) == getattr(other, k) for k in plain)
                and all(list(getattr(self, k)) == list(getattr(other, k)) for k in ('grid', 'class_names', 'scores'))
                and [tuple(map(int, p)) for p in self.pairs] == [tuple(map(int, p)) for p in other.pairs]
                and len(self.masks) == len(other.masks)
                and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(self.masks, other.masks)))

    __hash__ = None  # (mutable, as the dataclass's own)

    def to_json(self) -> str:
        doc = {
            'schema_version': self.schema_version,
            'grid': list(self.grid),
            'num_classes': self.num_classes,
            'class_names': list(self.class_names),
            'dataset_fingerprint': self.fingerprint,
            'best_fitness': _finite_or_none(self.best_fitness),
            'pairs': [{'classes': [int(i), int(j)],
                       'names': [self.class_names[i], self.class_names[j]] if self.class_names else None,
                       'mask': np.asarray(m, dtype=int).tolist(), 'score': _finite_or_none(s)}
                      for (i, j), m, s in zip(self.pairs, self.masks, self.scores)],
            'search_args': self.search_args,
        }
        return json.dumps(doc, indent=1, allow_nan=False)

    def save(self, path: str) -> None:
        atomic_write_text(path, self.to_json())

    @classmethod
    def _from_doc(cls, doc: Dict[str, Any], f: Fields) -> 'MaskTable':
        """A table from its JSON document, every field checked for type and range (errors name the field)."""
        for key in ('grid', 'num_classes', 'dataset_fingerprint', 'pairs'):
            if key not in doc:
                raise f.error(f'{f.where}: the field {key!r} is missing')
        rows, cols = f.grid(doc['grid'], 'grid')
        n = f.int(doc['num_classes'], 'num_classes', lo=1)
        names = doc.get('class_names')
        names = [] if names is None or names == [] else list(f.str_list(names, 'class_names', n))
        fingerprint = f.str(doc['dataset_fingerprint'], 'dataset_fingerprint', nonempty=True)
        entries = f.list(doc['pairs'], 'pairs')
        if not entries:
            raise f.error(f'{f.where} holds no pairs')
        pairs, masks, scores, seen = [], [], [], {}
        for k, e in enumerate(entries):
            field_k = f'pairs[{k}]'
            f.dict(e, field_k)
            if 'classes' not in e or 'mask' not in e:
                raise f.error(f'{f.where}: {field_k} needs the fields "classes" and "mask", got {sorted(e)}')
            ij = f.list(e['classes'], f'{field_k}.classes', 2)
            i, j = (f.int(v, f'{field_k}.classes[{q}]', lo=0, hi=n - 1) for q, v in enumerate(ij))
            key = (min(i, j), max(i, j))
            if key in seen:
                raise f.error(f'{f.where}: {field_k} repeats the class pair of pairs[{seen[key]}] ({i}, {j}); '
                              f'each pair may appear once')
            seen[key] = k
            mask = f.list(e['mask'], f'{field_k}.mask', rows)
            for r, row in enumerate(mask):
                f.list(row, f'{field_k}.mask[{r}]', cols)
                for c, v in enumerate(row):
                    if not (isinstance(v, bool) or (is_int(v) and v in (0, 1))):
                        f.fail(f'{field_k}.mask[{r}][{c}]', '0 or 1 (an integer or a boolean)', v)
            pair_names = e.get('names')
            if pair_names is not None and names:
                if pair_names != [names[i], names[j]]:
                    f.fail(f'{field_k}.names', f'the class names of ({i}, {j}), {[names[i], names[j]]!r}', pair_names)
            pairs.append((i, j))
            masks.append(np.array(mask, dtype=bool).reshape(rows, cols))
            scores.append(_score(f, e.get('score'), f'{field_k}.score'))
        best = _score(f, doc.get('best_fitness'), 'best_fitness')
        search_args = doc.get('search_args')
        search_args = {} if search_args is None else dict(f.dict(search_args, 'search_args'))
        return cls((rows, cols), n, names, fingerprint, pairs, masks, scores, best, search_args)

    def checked(self) -> 'MaskTable':
        """This table checked field by field as :meth:`load` checks a file (a table built in Python: errors name
        the field), returned as a new table of plain Python values: ``pairs``, ``masks`` and ``scores`` are lists
        (or numpy arrays) of one length, whose numpy or torch values become ints, floats and bool arrays. What a
        file may not hold, such a table may not either: no pairs, an empty fingerprint, a pair given twice."""
        if not all(isinstance(v, (list, tuple, np.ndarray)) for v in (self.pairs, self.masks, self.scores)) or not (
                len(self.pairs) == len(self.masks) == len(self.scores)):
            raise MaskTableError('mask table: pairs, masks and scores must be lists of one length, got '
                                 + ', '.join(f'{type(v).__name__} of {len(v)}' if hasattr(v, '__len__')
                                             else type(v).__name__ for v in (self.pairs, self.masks, self.scores)))
        doc = {'grid': self.grid, 'num_classes': self.num_classes, 'class_names': self.class_names,
               'dataset_fingerprint': self.fingerprint, 'best_fitness': self.best_fitness,
               'pairs': [{'classes': p, 'mask': m, 'score': s} for p, m, s in zip(self.pairs, self.masks, self.scores)],
               'search_args': self.search_args}
        try:
            doc = json.loads(json.dumps(doc, default=_plain))
        except (TypeError, ValueError) as e:
            raise MaskTableError(f'mask table: a field holds a value that is not a number, string, list or '
                                 f'array: {e}') from None
        return self._from_doc(doc, Fields('mask table', MaskTableError))

    @classmethod
    def load(cls, path: str, *, grid: Optional[GridSpec] = None, num_classes: Optional[int] = None,
             fingerprint: Optional[str] = None) -> 'MaskTable':
        """Read and validate a table; the keyword arguments are the run's values it must match (``grid`` as
        everywhere: ``P`` or ``(rows, cols)``)."""
        grid = None if grid is None else to_grid(grid)
        check_run_values(num_classes, fingerprint)
        try:
            with open(path, encoding='utf-8') as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise MaskTableError(f'mask table {path} does not exist') from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MaskTableError(f'mask table {path} is not valid JSON (truncated or corrupt?): {e}') from None
        except RecursionError:
            raise MaskTableError(f'mask table {path} nests its JSON too deeply to be a mask table') from None
        except OSError as e:
            raise MaskTableError(f'mask table {path} cannot be read: {e}') from None
        got = doc.get('schema_version') if isinstance(doc, dict) else None
        if not is_int(got) or got != SCHEMA_VERSION:
            raise MaskTableError(f'mask table {path} has schema version {got!r}; this version of timm_patchmix '
                                 f'reads version {SCHEMA_VERSION}')
        table = cls._from_doc(doc, Fields(f'mask table {path}', MaskTableError))
        if grid is not None and grid != table.grid:
            raise MaskTableError(f'mask table {path} was searched for a {table.grid[0]}x{table.grid[1]} grid, '
                                 f'this run uses {grid[0]}x{grid[1]}')
        if num_classes is not None and num_classes != table.num_classes:
            raise MaskTableError(f'mask table {path} is for {table.num_classes} classes, this run has {num_classes}')
        if fingerprint is not None and fingerprint != table.fingerprint:
            raise MaskTableError(f'mask table {path} was searched on another dataset (fingerprint '
                                 f'{table.fingerprint}, this run {fingerprint})')
        return table
