"""What a search is asked to do (:class:`SearchConfig`, resolved once from flags or built in code), how its
population evolves (:class:`Evolution`, all the core loop needs), and what it returns (:class:`SearchResult`).

Both settings classes are frozen and check their values when built, so a bad value fails where it is given with a
``ValueError`` that names the field, not generations later.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from ..cli_types import bounds_of, int_range, nonneg_int, nonneg_seed, positive_int, probability
from ..grid import GridSpec, to_grid
from ..table import MaskTable

__all__ = ['Evolution', 'SearchConfig', 'SearchResult', 'VALUE_TYPES']

FITNESS = ('min', 'max')
SCORES = ('accuracy', 'loss')


# The range of every numeric setting: the argument type its flag parses each value with (timm_patchmix.cli_types),
# whose bounds the configs also check a value given in Python against: one table for both (search.py's flags take
# their types from it). An int setting takes an integer (not a bool, a float or a string; numpy's integers count),
# a float setting a finite int or float; a setting whose default is None also takes None.
VALUE_TYPES: Dict[str, Callable[[str], Any]] = {
    'val_subset': positive_int, 'num_classes': positive_int, 'population': int_range(2, name='population'),
    'generations': nonneg_int, 'n_active': positive_int, 'k': positive_int, 'cxpb': probability,
    'mutpb': probability, 'tournsize': positive_int, 'hof': positive_int, 'patience': nonneg_int,
    'eval_batch_size': positive_int, 'seed': nonneg_seed,
}


def _number(obj: Any, name: str, optional: bool = False) -> None:
    """Checks field ``name`` of the frozen dataclass ``obj`` against :data:`VALUE_TYPES` and keeps it as Python's
    own int or float (a numpy scalar would not go into the JSON record)."""
    value = getattr(obj, name)
    if optional and value is None:
        return
    bounds = bounds_of(VALUE_TYPES[name])
    if not bounds.accepts(value):
        raise ValueError(f'{name} must be {bounds.want}{" or None" if optional else ""}, got {value!r}')
    object.__setattr__(obj, name, int(value) if bounds.kind == 'int' else float(value))


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f'{name} must be True or False, got {value!r}')


def _optional_str(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f'{name} must be a string or None, got {value!r}')


def _choice(name: str, value: Any, choices: Tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f'{name} must be one of {", ".join(map(repr, choices))}, got {value!r}')


def score_words(score: str) -> Tuple[str, str]:
    """What a gene score is, and which way is harder: ``('patch accuracy', 'lower')`` or
    ``('patch cross-entropy', 'higher')``."""
    return ('patch accuracy', 'lower') if score == 'accuracy' else ('patch cross-entropy', 'higher')


def kept_genes(fitness: str, score: str) -> str:
    """Which genes a search with ``fitness`` and ``score`` keeps: ``'hardest'`` or ``'easiest'``. ``'min'`` keeps
    the lowest scores, ``'max'`` the highest; a lower patch accuracy is harder (the paper's fitness: ``'min'``
    with ``'accuracy'``), a higher patch cross-entropy is (``'max'`` with ``'loss'``)."""
    return 'hardest' if (fitness == 'min') == (score == 'accuracy') else 'easiest'


@dataclass(frozen=True)
class Evolution:
    """How the population evolves (the paper's Algorithm 2 with DEAP).

    Attributes:
        population: individuals per generation.
        generations: the last generation (0 is the initial population).
        n_active: N, the most active pairs of an individual (None: the number of classes, at most the number of
            class pairs).
        cxpb, mutpb: crossover and mutation probabilities of DEAP's ``varAnd``.
        tournsize: tournament size of the selection.
        hof: hall-of-fame size.
        patience: stop after this many generations without a better best (0: never).
        fitness: ``'min'`` keeps the lowest gene scores, ``'max'`` the highest: with the patch accuracy score the
            hardest and the easiest samples (the paper: ``'min'``); see :func:`kept_genes`.
        seed: seeds the operators, the selection and the initial population.
    """
    population: int = 500
    generations: int = 250
    n_active: Optional[int] = None
    cxpb: float = 0.5
    mutpb: float = 0.3
    tournsize: int = 3
    hof: int = 10
    patience: int = 50
    fitness: str = 'min'
    seed: int = 0

    def __post_init__(self):
        for name in ('population', 'generations', 'cxpb', 'mutpb', 'tournsize', 'hof', 'patience', 'seed'):
            _number(self, name)
        _number(self, 'n_active', optional=True)
        _choice('fitness', self.fitness, FITNESS)


_E = Evolution()
# how a search runs rather than what it searches: left out of the record in the table and state
RUNTIME_FIELDS = ('output', 'device', 'resume', 'progress', 'plots')


@dataclass(frozen=True)
class SearchConfig:
    """One search, as ``search.py``'s flags give it (each field is the flag of the same name).

    ``None`` means "the checkpoint's" for dataset, data_dir, val_split, grid and num_classes (a given grid or
    number of classes is checked against the model's), "the number of classes" for n_active and "CUDA when
    available" for device. ``grid`` takes ``P`` or ``(rows, cols)`` and is kept as ``(rows, cols)``.
    """
    checkpoint: str
    output: str = 'output/search'
    dataset: Optional[str] = None
    data_dir: Optional[str] = None
    val_split: Optional[str] = None
    val_subset: Optional[int] = None
    grid: Optional[GridSpec] = None
    num_classes: Optional[int] = None
    population: int = _E.population
    generations: int = _E.generations
    n_active: Optional[int] = _E.n_active
    k: int = 16
    cxpb: float = _E.cxpb
    mutpb: float = _E.mutpb
    tournsize: int = _E.tournsize
    hof: int = _E.hof
    patience: int = _E.patience
    fitness: str = _E.fitness
    score: str = 'accuracy'
    same_class_pairs: bool = False
    eval_batch_size: int = 512
    seed: int = _E.seed
    device: Optional[str] = None
    amp: bool = False
    channels_last: bool = False
    resume: bool = False
    progress: bool = True
    plots: bool = True

    def __post_init__(self):
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ValueError(f'checkpoint must be the path of a patch-head model, got {self.checkpoint!r}')
        if not isinstance(self.output, str) or not self.output:
            raise ValueError(f'output must be a folder path, got {self.output!r}')
        if self.grid is not None:
            object.__setattr__(self, 'grid', to_grid(self.grid, 'grid'))
        for name in ('val_subset', 'num_classes'):
            _number(self, name, optional=True)
        for name in ('k', 'eval_batch_size'):
            _number(self, name)
        _choice('score', self.score, SCORES)
        for name in ('dataset', 'data_dir', 'val_split', 'device'):
            _optional_str(name, getattr(self, name))
        for name in ('same_class_pairs', 'amp', 'channels_last', 'resume', 'progress', 'plots'):
            _bool(name, getattr(self, name))
        evolution = self.evolution()  # checks the fields it takes
        for f in dataclasses.fields(Evolution):  # kept as the checked Python numbers
            object.__setattr__(self, f.name, getattr(evolution, f.name))

    def evolution(self) -> Evolution:
        """The settings of the core loop."""
        return Evolution(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Evolution)})

    def replace(self, **changes) -> 'SearchConfig':
        """A copy with ``changes`` (checked like a new config)."""
        return dataclasses.replace(self, **changes)

    def record(self) -> Dict[str, Any]:
        """What was searched, as JSON values: the ``search_args`` of the table and the state (runtime fields,
        such as the output folder, left out)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name not in RUNTIME_FIELDS:
                v = getattr(self, f.name)
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class SearchResult:
    """What :func:`~timm_patchmix.search.search` returns.

    Attributes:
        table: the mask table of the best individual (also saved at ``table_path``).
        table_path: ``<output>/masks.json``.
        output: the folder of the table, logbook, plots and state.
        best_fitness: the best individual's fitness.
        generations: the last generation run (0: only the initial population).
        stopped_early: True when ``patience`` generations passed without a better best.
        logbook: one row per generation, 0 first (the columns of ``logbook.csv``).
        forward_images: images the model scored in the whole search, resumed parts included.
    """
    table: MaskTable
    table_path: str
    output: str
    best_fitness: float
    generations: int
    stopped_early: bool
    logbook: Tuple[Dict[str, Any], ...]
    forward_images: int
