"""The mask table written by ``search.py``: schema, fingerprint, atomic save, validated load."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .checkpoint import atomic_write_text

__all__ = ['MaskTable', 'MaskTableError', 'dataset_fingerprint', 'SCHEMA_VERSION']

SCHEMA_VERSION = 1


class MaskTableError(ValueError):
    """A mask table that is corrupt, of another schema, or made for another grid, label set or dataset."""


def dataset_fingerprint(dataset: str, class_names: Sequence[str]) -> str:
    """A short hash naming a dataset by its name and ordered class names (the same for every split)."""
    doc = json.dumps({'dataset': dataset or 'patchshapes', 'classes': list(class_names)}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


@dataclass
class MaskTable:
    """Searched class pairs and their ``rows x cols`` masks (True: the cell comes from the first class's image)."""
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

    def to_json(self) -> str:
        doc = {
            'schema_version': self.schema_version,
            'grid': list(self.grid),
            'num_classes': self.num_classes,
            'class_names': list(self.class_names),
            'dataset_fingerprint': self.fingerprint,
            'best_fitness': self.best_fitness,
            'pairs': [{'classes': [int(i), int(j)],
                       'names': [self.class_names[i], self.class_names[j]] if self.class_names else None,
                       'mask': np.asarray(m, dtype=int).tolist(), 'score': float(s)}
                      for (i, j), m, s in zip(self.pairs, self.masks, self.scores)],
            'search_args': self.search_args,
        }
        return json.dumps(doc, indent=1)

    def save(self, path: str) -> None:
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str, *, grid: Optional[Tuple[int, int]] = None, num_classes: Optional[int] = None,
             fingerprint: Optional[str] = None) -> 'MaskTable':
        """Read and validate a table; the keyword arguments are the run's values it must match."""
        try:
            with open(path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise MaskTableError(f'mask table {path} does not exist') from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MaskTableError(f'mask table {path} is not valid JSON (truncated or corrupt?): {e}') from None
        if not isinstance(doc, dict) or doc.get('schema_version') != SCHEMA_VERSION:
            got = doc.get('schema_version') if isinstance(doc, dict) else None
            raise MaskTableError(f'mask table {path} has schema version {got!r}; this version of timm_patchmix '
                                 f'reads version {SCHEMA_VERSION}')
        try:
            t_grid = tuple(int(v) for v in doc['grid'])
            t_classes = int(doc['num_classes'])
            names = list(doc.get('class_names') or [])
            pairs, masks, scores = [], [], []
            for e in doc['pairs']:
                i, j = (int(v) for v in e['classes'])
                m = np.asarray(e['mask'], dtype=bool)
                if m.shape != t_grid:
                    raise MaskTableError(f'{path}: mask of pair ({i}, {j}) has shape {list(m.shape)}, the table '
                                         f'grid is {t_grid[0]}x{t_grid[1]}')
                if not (0 <= i < t_classes and 0 <= j < t_classes):
                    raise MaskTableError(f'{path}: pair ({i}, {j}) is outside the {t_classes} classes')
                pairs.append((i, j))
                masks.append(m)
                scores.append(float(e.get('score', float('nan'))))
            table = cls(t_grid, t_classes, names, str(doc['dataset_fingerprint']), pairs, masks, scores,
                        float(doc.get('best_fitness', float('nan'))), dict(doc.get('search_args') or {}))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, MaskTableError):
                raise
            raise MaskTableError(f'mask table {path} is missing or has malformed fields: {e!r}') from None
        if not table.pairs:
            raise MaskTableError(f'mask table {path} holds no pairs')
        if grid is not None and tuple(grid) != table.grid:
            raise MaskTableError(f'mask table {path} was searched for a {table.grid[0]}x{table.grid[1]} grid, '
                                 f'this run uses {grid[0]}x{grid[1]}')
        if num_classes is not None and num_classes != table.num_classes:
            raise MaskTableError(f'mask table {path} is for {table.num_classes} classes, this run has {num_classes}')
        if fingerprint is not None and fingerprint != table.fingerprint:
            raise MaskTableError(f'mask table {path} was searched on another dataset (fingerprint '
                                 f'{table.fingerprint}, this run {fingerprint})')
        return table
