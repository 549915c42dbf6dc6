"""``search(cfg)``: a whole search from files to files. It builds the search from the checkpoint (resuming when asked),
checkpoints after every generation, and writes ``masks.json``, ``logbook.csv`` and the plots to ``cfg.output``.

Under ``torchrun`` (an initialised process group) every rank scores its share of the new genes; rank 0 alone writes.
"""
from __future__ import annotations

import csv
import io
import os
import sys
from contextlib import nullcontext
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from ..checkpoint import atomic_write_text
from ..locking import folder_problem, hold_folder
from ..settings import foreign_output
from .config import SearchConfig, SearchResult, kept_genes, score_words
from .core import GenerationCallback, Search, SearchError, search_device
from .inputs import SearchUsageError

__all__ = ['search', 'write_logbook']


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def search(cfg: SearchConfig, *, on_generation: Optional[GenerationCallback] = None) -> SearchResult:
    """Run the search ``cfg`` describes and return its result; the files go to ``cfg.output``.

    ``on_generation(search, row)`` runs after each generation's state is saved (generation 0, the initial
    population, included), so a caller can watch the run or stop it there and resume it later with
    ``cfg.replace(resume=True)``. Raises ``SearchError``, ``CheckpointError`` or ``SettingsChangedError`` (a resume
    with other settings) before anything is written. The global generators of Python, NumPy and torch, which the
    search seeds and DEAP draws from, are the caller's again on return, and what ``on_generation`` draws from them
    does not change the search.
    """
    from ..checkpoint import kept_rng_state
    if on_generation is not None and not callable(on_generation):  # (it would fail after the first state write)
        raise TypeError(f'on_generation must be a callable taking (search, row), got '
                        f'{type(on_generation).__name__}')
    with kept_rng_state():
        return _search(cfg, on_generation)


def _search(cfg: SearchConfig, on_generation: Optional[GenerationCallback]) -> SearchResult:
    from tqdm import tqdm
    from ..checkpoint import kept_rng_state
    state_path = os.path.join(cfg.output, Search.STATE_FILE)
    if not cfg.resume and os.path.exists(state_path):  # another search's work, which this one would replace
        raise SearchUsageError(f'{cfg.output} holds a search already ({state_path}); give --resume to continue it, '
                               f'or start afresh in another --output (or delete that folder first)')
    search_device(cfg)  # (a device it cannot run on: before the folder is made)
    # (its masks.json and plots would replace a pipeline's, a study's, a Hub folder's; a training run's folder
    # holds none of them, and a search may write beside the run it scores)
    foreign = foreign_output(cfg.output, own=('search_state.safetensors', 'logbook.csv', 'args.yaml',
                                              'state.safetensors'))
    if foreign:
        raise SearchUsageError(foreign)
    problem = folder_problem(cfg.output, locked=True)  # (on every process, before the model and the images are loaded)
    if problem:  # (worded as hold_folder words it, "it" where the folder itself is at fault)
        where, what = problem
        raise SearchError(f'cannot make the search folder {cfg.output}: '
                          f'{"it" if where == os.path.abspath(cfg.output) else where} {what}; give another --output')
    s = Search.from_checkpoint(cfg)
    rank = _rank()
    # one process writes a search folder at a time: a second search on it stops here, before it writes anything
    with hold_folder(cfg.output, 'search', SearchError) if rank == 0 else nullcontext():
        if rank == 0:
            print(f'search: {s.num_classes} classes, {len(s.space)} pairs, N={s.n_active}, K={cfg.k}, population '
                  f'{cfg.population}, {cfg.generations} generations, grid {s.grid[0]}x{s.grid[1]}, fitness '
                  f'{cfg.fitness} {cfg.score}, scored on {_scored_on(s.record)}', flush=True)
            if kept_genes(cfg.fitness, cfg.score) == 'easiest':
                other, end = ('max', 'lowest') if cfg.fitness == 'min' else ('min', 'highest')
                print(f'note: --fitness {cfg.fitness} with --score {cfg.score} keeps the easiest genes (the {end} '
                      f'{score_words(cfg.score)[0]}); --fitness {other} keeps the hardest', file=sys.stderr,
                      flush=True)
        bar = tqdm(total=cfg.generations, initial=s.gen, desc='search', unit='gen',
                   disable=rank != 0 or not cfg.progress, dynamic_ncols=True)

        def after(search_: Search, row: Dict[str, Any]) -> None:
            if rank == 0:
                search_.save_state()
            if row['gen'] > 0:  # generation 0 is the initial population, before the bar's first step
                bar.update(1)
                bar.set_postfix(best=f"{row['hof_best']:.4f}", mean=f"{row['mean']:.4f}",
                                hit=f"{row['cache_hit_rate']:.2f}")
                if not cfg.progress and rank == 0:
                    print(f"gen {row['gen']}: best {row['hof_best']:.4f} mean {row['mean']:.4f} new genes "
                          f"{row['new_genes']} hit rate {row['cache_hit_rate']:.3f}", flush=True)
            if on_generation is not None:
                with kept_rng_state():
                    on_generation(search_, row)
        try:
            table = s.run(on_generation=after)
        finally:
            bar.close()
        path = os.path.join(cfg.output, 'masks.json')
        if rank == 0:
            table.save(path)
            write_logbook(s.logbook, os.path.join(cfg.output, 'logbook.csv'))
            if cfg.plots:
                from ..viz import plot_fitness, plot_pairs
                plot_fitness(s.logbook, os.path.join(cfg.output, 'fitness.png'), cfg.fitness, cfg.score)
                plot_pairs(table, os.path.join(cfg.output, 'pairs.png'))
        return SearchResult(table=table, table_path=path, output=cfg.output, best_fitness=table.best_fitness,
                            generations=s.gen, stopped_early=s.gen < cfg.generations, logbook=tuple(s.logbook),
                            forward_images=s.scorer.forward_images)


def _scored_on(record: Dict[str, Any]) -> str:
    on = record.get('scored_on') or {}
    if not on:
        return 'the validation split'
    if on.get('holdout'):
        h = on['holdout']
        return (f"{on['images']} held-out images of split {h.get('split', 'train')!r} ({h['fraction']:g}, seed "
                f"{h['seed']})")
    return f"{on['images']} images of split {on['split']!r}"


def write_logbook(rows: List[Dict[str, Any]], path: str) -> None:
    """The logbook as CSV, one row per generation (atomically)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator='\n')
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())
