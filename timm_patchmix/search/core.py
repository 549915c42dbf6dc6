"""The evolutionary search (the paper's Algorithm 2) with DEAP and memoised fitness, as an object that does no I/O.

A :class:`Search` is built from its pair space, grid, gene scorer and :class:`~.config.Evolution` settings, so code
and tests can run one in memory; :meth:`Search.from_checkpoint` builds one from files (f_T, the validation split and,
on a resume, the state). ``run()`` evolves and returns the mask table; a callback after each generation is where a
caller checkpoints (:meth:`Search.save_state`), reports progress or stops a run.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from deap import algorithms, base, tools

from ..checkpoint import CheckpointError, load_bundle, save_bundle
from ..cli_types import device_problem
from ..grid import GridSpec, bits_to_mask, to_grid
from ..settings import check_settings
from ..table import MaskTable, dataset_fingerprint
from .config import Evolution, SearchConfig
from .fitness import GeneScorer, TooFewImagesError, aggregate, draw_image_pairs
from .genome import Individual, MaskOps, Operators, PairSpace, fitness_class, same_phenotype
from .inputs import SearchError, load_model, load_validation, resume_settings, too_few_images
from .state import check_search_meta, check_search_tensors, pack_individuals, unpack_individuals

__all__ = ['Search', 'SearchError', 'GenerationCallback']

GenerationCallback = Callable[['Search', Dict[str, Any]], None]


def default_n_active(space: PairSpace) -> int:
    """N, the most active pairs of an individual, where ``--n-active`` is not given: the number of classes, at most
    the number of cross-class pairs (a 2-class dataset has one)."""
    return min(space.num_classes, space.num_cross)


def search_device(cfg: SearchConfig) -> torch.device:
    """The device ``cfg`` asks for (default: CUDA where there is one); ``SearchError`` naming the field for a name
    torch cannot parse, the meta device or an accelerator this machine lacks, as search.py's --device is checked
    (a config is a plain record and may be made on another machine, so this is checked where the search runs)."""
    if cfg.device is None:
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    problem = device_problem(cfg.device)
    if problem is not None:
        raise SearchError(f'device: {problem}')
    return torch.device(cfg.device)


class Search:
    """One search over the class pairs of ``space`` with masks on ``grid``, its genes scored by ``scorer``.

    Args:
        space: the class pairs (``PairSpace(num_classes, same_class_pairs)``).
        grid: ``P`` or ``(rows, cols)``, the scorer's grid.
        scorer: a :class:`~.fitness.GeneScorer` over ``space.pairs`` (or an object with its methods).
        evolution: population, generations, operators' probabilities, seed...
        class_names: names of the classes, for the table (default ``'0'``, ``'1'``...).
        fingerprint: the dataset's (:func:`~timm_patchmix.table.dataset_fingerprint`); default: of the names.
        record: what the table and state record as the search's arguments (default: the evolution settings).
        settings: what a resume must share, by flag (default: the evolution settings and the pair space).
        state_path: the default file of :meth:`save_state` and :meth:`load_state`.

    After ``run()``: ``population``, ``hof`` (hall of fame), ``logbook`` (one row per generation), ``gen``.
    """
    STATE_FILE = 'search_state.safetensors'

    def __init__(self, space: PairSpace, grid: GridSpec, scorer: GeneScorer, evolution: Evolution = Evolution(), *,
                 class_names: Optional[Sequence[str]] = None, fingerprint: Optional[str] = None,
                 record: Optional[Dict[str, Any]] = None, settings: Optional[Dict[str, Any]] = None,
                 state_path: Optional[str] = None):
        self.space, self.grid, self.scorer, self.evolution = space, to_grid(grid), scorer, evolution
        self.num_classes = space.num_classes
        if tuple(scorer.grid) != self.grid:
            raise ValueError(f'the scorer scores masks on a {scorer.grid[0]}x{scorer.grid[1]} grid, the search is '
                             f'for {self.grid[0]}x{self.grid[1]}')
        if len(scorer.pairs) != len(space):
            raise ValueError(f'the scorer has image pairs for {len(scorer.pairs)} class pairs, the pair space '
                             f'{len(space)}')
        self.n_active = evolution.n_active or default_n_active(space)
        if space.num_cross == 0:
            raise SearchError(f'{self.num_classes} class has no pair of classes to search masks for; the search '
                              f'needs at least 2 classes')
        if not 1 <= self.n_active <= space.num_cross:
            raise SearchError(f'N={self.n_active} active pairs, but {self.num_classes} classes have only '
                              f'{space.num_cross} pairs; lower --n-active')
        self.class_names = [str(i) for i in range(self.num_classes)] if class_names is None else list(class_names)
        if len(self.class_names) != self.num_classes:
            raise ValueError(f'{len(self.class_names)} class names for {self.num_classes} classes')
        self.fingerprint = fingerprint or dataset_fingerprint('in-memory', self.class_names)
        self.record = dataclasses.asdict(evolution) if record is None else dict(record)
        self.settings = self._default_settings() if settings is None else dict(settings)
        self.state_path = state_path
        self.mops = MaskOps(*self.grid)
        self.fitness_cls = fitness_class(evolution.fitness)
        self.rng = np.random.default_rng(evolution.seed)
        self.ops = Operators(space, self.mops, self.n_active, self.rng, self.fitness_cls)
        self.toolbox = base.Toolbox()
        self.toolbox.register('mate', self.ops.mate)
        self.toolbox.register('mutate', self.ops.mutate)
        self.toolbox.register('select', tools.selTournament, tournsize=evolution.tournsize)
        self.hof = tools.HallOfFame(evolution.hof, similar=same_phenotype(space.forced))  # forced masks count too
        self.logbook: List[Dict[str, Any]] = []
        self.gen = 0
        self.population: List[Individual] = []
        self.best_history: List[float] = []

    def _default_settings(self) -> Dict[str, Any]:
        ev = self.evolution
        return {'--grid': list(self.grid), '--population': ev.population, '--n-active': self.n_active,
                '--seed': ev.seed, '--fitness': ev.fitness, '--same-class-pairs': len(self.space.forced) > 0,
                '--cxpb': ev.cxpb, '--mutpb': ev.mutpb, '--tournsize': ev.tournsize, '--hof': ev.hof}

    @classmethod
    def from_checkpoint(cls, cfg: SearchConfig) -> 'Search':
        """The search ``cfg`` asks for: f_T from ``cfg.checkpoint``, K image pairs per class pair drawn from the
        split it is scored on (its held-out training images when it was trained with ``--holdout``), and, with
        ``cfg.resume``, the state in ``cfg.output``. Raises ``SearchError``,
        ``CheckpointError`` or ``SettingsChangedError`` (a resume with other settings), naming what to change."""
        device = search_device(cfg)
        model, meta = load_model(cfg)
        grid = tuple(model.grid)
        data = load_validation(cfg, model, meta)
        space = PairSpace(data.num_classes, cfg.same_class_pairs)
        try:
            a_idx, b_idx = draw_image_pairs(data.labels, space.pairs, cfg.k, cfg.seed)
        except TooFewImagesError as e:
            raise too_few_images(e, data) from None
        model = model.to(device).eval()
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        scorer = GeneScorer(model, data.images(device), space.pairs, a_idx, b_idx, grid, cfg.score,
                            cfg.eval_batch_size, amp=cfg.amp, channels_last=cfg.channels_last)
        n_active = cfg.n_active or default_n_active(space)
        search = cls(space, grid, scorer, cfg.evolution(), class_names=data.class_names,
                     fingerprint=dataset_fingerprint(data.dataset, data.class_names),
                     record=dict(cfg.record(), scored_on=data.record()),
                     settings=resume_settings(cfg, data, grid, n_active, device),
                     state_path=os.path.join(cfg.output, cls.STATE_FILE))
        if cfg.resume:
            if not os.path.exists(search.state_path):
                raise SearchError(f'--resume given but {search.state_path} does not exist; leave --resume out to '
                                  f'start the search afresh')
            search.load_state()
        return search

    # --- fitness ---------------------------------------------------------------------------------------------
    def evaluate(self, individuals: List[Individual]) -> Dict[str, int]:
        """Fill the fitness of ``individuals``: score their uncached genes in one batched pass, then average."""
        if not individuals:
            return {'lookups': 0, 'new_genes': 0}
        genes = [ind.genes(self.space.forced) for ind in individuals]
        pair = np.concatenate([g[0] for g in genes])
        mask = np.concatenate([g[1] for g in genes])
        lookups, new = self.scorer.ensure(pair, mask)
        for ind, (p, m) in zip(individuals, genes):
            ind.fitness.values = (aggregate(self.scorer.lookup(p, m)),)
        return {'lookups': lookups, 'new_genes': new}

    def evaluate_direct(self, ind: Individual) -> float:
        """The individual's fitness from a fresh forward pass of all its genes' images, bypassing the cache."""
        p, m = ind.genes(self.space.forced)
        return aggregate(self.scorer.score_genes(p, m))

    # --- the loop --------------------------------------------------------------------------------------------
    def run(self, generations: Optional[int] = None, on_generation: Optional[GenerationCallback] = None
            ) -> MaskTable:
        """Evolve up to generation ``generations`` (default: the settings') or until the best has not improved for
        ``patience`` generations, and return the table of the best individual.

        ``on_generation(search, row)`` runs after every generation, the initial population (generation 0) included
        when this call makes it; ``row`` is the generation's logbook row. A search resumed from a state, or one
        stopped earlier at a lower ``generations``, goes on where it stopped.
        """
        last = self.evolution.generations if generations is None else generations
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise ValueError(f'generations must be an integer >= 0, got {last!r}')
        if not self.population:
            row = self.start()
            if on_generation is not None:
                on_generation(self, row)
        while self.gen < last and not self.stalled():
            row = self.step()
            if on_generation is not None:
                on_generation(self, row)
        return self.table()

    def start(self) -> Dict[str, Any]:
        """Generation 0: seed DEAP's and torch's generators, draw and score the initial population."""
        if self.population:
            raise RuntimeError('the search has a population already; start() makes the first one')
        random.seed(self.evolution.seed)
        torch.manual_seed(self.evolution.seed)
        t0 = time.perf_counter()
        self.population = [self.ops.random_individual() for _ in range(self.evolution.population)]
        evals = self.evaluate(self.population)
        self.hof.update(self.population)
        return self._record(evals, len(self.population), time.perf_counter() - t0)

    def step(self) -> Dict[str, Any]:
        """One generation: select, vary, score the changed individuals, update the hall of fame."""
        if not self.population:
            raise RuntimeError('the search has no population yet; call start() (or run()) first')
        ev = self.evolution
        t0 = time.perf_counter()
        offspring = self.toolbox.select(self.population, len(self.population))
        offspring = algorithms.varAnd(offspring, self.toolbox, ev.cxpb, ev.mutpb)
        invalid = [ind for ind in offspring if not ind.fitness.valid]
        evals = self.evaluate(invalid)
        self.hof.update(offspring)
        self.population[:] = offspring
        self.gen += 1
        return self._record(evals, len(invalid), time.perf_counter() - t0)

    def _record(self, evals: Dict[str, int], n_invalid: int, t_gen: float) -> Dict[str, Any]:
        fits = np.array([ind.fitness.values[0] for ind in self.population])
        best = float(fits.min() if self.evolution.fitness == 'min' else fits.max())
        row = {'gen': self.gen, 'evals': n_invalid, 'best': best, 'mean': float(fits.mean()),
               'std': float(fits.std()), 'min': float(fits.min()), 'max': float(fits.max()),
               'hof_best': float(self.hof[0].fitness.values[0]), 'gene_lookups': evals['lookups'],
               'new_genes': evals['new_genes'],
               'cache_hit_rate': 1.0 - evals['new_genes'] / max(evals['lookups'], 1),
               'forward_images': self.scorer.forward_images, 'cache_size': len(self.scorer.cache),
               'seconds': round(t_gen, 3)}
        self.logbook.append(row)
        self.best_history.append(row['hof_best'])
        return row

    def stalled(self) -> bool:
        """Whether the best has not improved for ``patience`` generations (never with patience 0)."""
        p = self.evolution.patience
        if not p or len(self.best_history) <= p:
            return False
        return self.best_history[-1] == self.best_history[-1 - p]

    def table(self) -> MaskTable:
        """The best individual's pairs and masks, the genes it was chosen for first: lowest score first for fitness
        'min', highest for 'max' (see :func:`~.config.kept_genes`)."""
        if not len(self.hof):
            raise RuntimeError('the search has not run yet: no best individual to make a table of')
        best = self.hof[0]
        idx, masks = best.genes(self.space.forced)
        scores = self.scorer.lookup(idx, masks)
        order = np.argsort(scores if self.evolution.fitness == 'min' else -scores, kind='stable')
        rows, cols = self.grid
        return MaskTable(
            grid=self.grid, num_classes=self.num_classes, class_names=self.class_names,
            fingerprint=self.fingerprint,
            pairs=[tuple(int(v) for v in self.space.pairs[idx[o]]) for o in order],
            masks=[bits_to_mask(int(masks[o]), rows, cols) for o in order], scores=[float(scores[o]) for o in order],
            best_fitness=float(best.fitness.values[0]),
            # the record is of the last invocation (a resume may give another --generations or --patience): the
            # generation the search reached says how long it ran
            search_args=dict(self.record, generations_run=self.gen))

    # --- state -----------------------------------------------------------------------------------------------
    def state(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """Everything a resume needs, as ``(tensors, metadata)``: population, hall of fame, gene-score cache,
        random generators, logbook, and the settings and dataset the search was made for."""
        pairs, masks, vals = self.scorer.cache_arrays()  # two columns: exact for every grid
        tensors = dict(pack_individuals(self.population, 'pop', self.n_active),
                       **pack_individuals(list(self.hof), 'hof', self.n_active))
        tensors['cache.pairs'] = torch.from_numpy(pairs)
        tensors['cache.masks'] = torch.from_numpy(masks)
        tensors['cache.scores'] = torch.from_numpy(vals)
        tensors['rng.torch'] = torch.get_rng_state()
        py = random.getstate()
        meta = {'generation': self.gen, 'logbook': self.logbook, 'best_history': self.best_history,
                'rng_numpy': self.rng.bit_generator.state, 'rng_python': [py[0], list(py[1]), py[2]],
                'forward_images': self.scorer.forward_images, 'args': self.record,
                'fingerprint': self.fingerprint, 'grid': list(self.grid), 'num_classes': self.num_classes,
                'settings': self.settings}
        return tensors, meta

    def _path(self, path: Optional[str]) -> str:
        path = path or self.state_path
        if not path:
            raise ValueError('no state file: pass a path, or build the search with state_path')
        return path

    def save_state(self, path: Optional[str] = None) -> None:
        """Write :meth:`state` to ``path`` (default: ``state_path``) atomically."""
        save_bundle(self._path(path), *self.state(), kind='search_state')

    def load_state(self, path: Optional[str] = None) -> None:
        """Continue from the state in ``path`` (default: ``state_path``), refused with a ``SettingsChangedError``
        when it was written with other settings and a ``SearchError`` when it is damaged or for other data."""
        path = self._path(path)
        try:
            tensors, meta = load_bundle(path, 'search_state')
            check_search_meta(path, meta)
        except CheckpointError as e:
            raise SearchError(f'cannot resume the search: {e}') from None
        folder = os.path.dirname(path) or '.'
        check_settings(meta.get('settings') or {}, self.settings,
                       f'cannot resume the search in {folder}: {path} was written',
                       f'Resume with the settings it was started with, or run the new settings with another '
                       f'--output (or delete {folder} first).')
        if meta.get('fingerprint') != self.fingerprint or tuple(meta.get('grid', ())) != self.grid:
            raise SearchError(f'{path} belongs to a search on another dataset or grid; resume it with the checkpoint '
                              f'and data it was started with, or start afresh in another --output')
        self.restore(tensors, meta, path)

    def restore(self, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], where: str = 'the state') -> None:
        """Set the search to a :meth:`state` (checked first; ``where`` names it in errors)."""
        try:
            cache = check_search_tensors(where, tensors, grid=self.grid, n_pairs=len(self.space),
                                         num_cross=self.space.num_cross, n_active=self.n_active,
                                         hof_size=self.evolution.hof)
        except CheckpointError as e:
            raise SearchError(f'cannot resume the search: {e}') from None
        try:
            self.population = unpack_individuals(tensors, 'pop', self.fitness_cls)
            # set the hall of fame's lists as saved: re-inserting would reorder individuals of equal fitness
            self.hof.clear()
            self.hof.items = unpack_individuals(tensors, 'hof', self.fitness_cls)
            self.hof.keys = [ind.fitness for ind in reversed(self.hof.items)]
            self.scorer.set_cache(*cache)
            torch.set_rng_state(tensors['rng.torch'])
            self.rng.bit_generator.state = meta['rng_numpy']
            v, internal, g = meta['rng_python']
            random.setstate((v, tuple(internal), g))
            self.gen = int(meta['generation'])
            self.logbook = list(meta['logbook'])
            self.best_history = list(meta['best_history'])
            self.scorer.forward_images = int(meta['forward_images'])
            cached = [(ind.fitness.values[0], aggregate(self.scorer.lookup(*ind.genes(self.space.forced))))
                      for ind in list(self.population) + list(self.hof.items) if ind.fitness.valid]
        except (KeyError, ValueError, TypeError, RuntimeError) as e:  # (RuntimeError: an RNG state torch refuses)
            raise SearchError(f'{where} is incomplete or corrupt: {e!r}; start the search afresh (without --resume, '
                              f'or in another --output)') from None
        self._check_restored(where, cached)

    def _check_restored(self, where: str, cached: List[Tuple[float, float]]) -> None:
        """The restored fitnesses are those of the restored cache (``cached``: each individual's recorded fitness
        and the mean of its genes' cached scores, as :meth:`evaluate` makes it) and the hall of fame is in order,
        best first; else :class:`SearchError` (a state whose parts disagree, which its digests cannot tell)."""
        for got, want in cached:
            if not (want == got or (math.isnan(want) and math.isnan(got))):
                raise SearchError(f'{where} is inconsistent: an individual\'s recorded fitness {got!r} is not the '
                                  f'mean of its genes\' cached scores ({want!r}); start the search afresh (without '
                                  f'--resume, or in another --output)')
        items = self.hof.items
        if any(items[i + 1].fitness > items[i].fitness for i in range(len(items) - 1)):
            raise SearchError(f'{where} is inconsistent: its hall of fame is not in order of fitness, best first; '
                              f'start the search afresh (without --resume, or in another --output)')
