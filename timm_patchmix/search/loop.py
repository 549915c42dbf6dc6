"""The evolutionary search (the paper's Algorithm 2) with DEAP, memoised fitness, checkpoints and outputs.

    python search.py --checkpoint output/train/<random-pm run>/best.safetensors --output output/search
"""
from __future__ import annotations

import argparse
import csv
import io
import logging
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist
from deap import algorithms, base, tools

from ..checkpoint import CheckpointError, atomic_write_bytes, atomic_write_text, load_bundle, save_bundle
from ..cli_types import (directory, existing_file, int_range, nonneg_int, optional_directory, positive_int,
                         probability)
from ..guided import MaskTable, dataset_fingerprint
from ..settings import USAGE_ERROR, SettingsChangedError, check_settings, file_record
from .fitness import GeneScorer, aggregate, draw_image_pairs
from .genome import Individual, MaskOps, Operators, PairSpace, bits_to_grid, fitness_class, same_phenotype
from .state import check_search_meta, check_search_tensors

_logger = logging.getLogger(__name__)
KILL_ENV = 'TIMM_PATCHMIX_KILL_AT_GEN'  # tests: SIGKILL the search right after checkpointing that generation


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description='Evolutionary search over class pairs and PatchMix masks (DEAP)')
    p.add_argument('--checkpoint', required=True, type=existing_file,
                   help='weights of a Random-PatchMix patchhead_ model (train.py)')
    p.add_argument('--output', default='output/search', type=directory,
                   help='folder for the table, logbook, plots, state')
    p.add_argument('--dataset', default=None, help="default: the checkpoint's dataset")
    p.add_argument('--data-dir', default=None, type=optional_directory)
    p.add_argument('--val-split', default=None, help="default: the checkpoint's validation split")
    p.add_argument('--val-subset', type=positive_int, default=None)
    p.add_argument('--grid', type=positive_int, nargs='+', default=None,
                   help="must match the model's grid (read from it)")
    p.add_argument('--num-classes', type=positive_int, default=None, help="must match the dataset's")
    p.add_argument('--population', type=int_range(2, name='population'), default=500)
    p.add_argument('--generations', type=nonneg_int, default=250)
    p.add_argument('--n-active', type=positive_int, default=None,
                   help='N, the most active pairs (default: num_classes)')
    p.add_argument('--k', type=positive_int, default=16, help='fixed validation image pairs per class pair')
    p.add_argument('--cxpb', type=probability, default=0.5)
    p.add_argument('--mutpb', type=probability, default=0.3)
    p.add_argument('--tournsize', type=positive_int, default=3)
    p.add_argument('--hof', type=positive_int, default=10, help='hall-of-fame size')
    p.add_argument('--patience', type=nonneg_int, default=50, help='stop after this many generations without a better '
                   'best (0: never)')
    p.add_argument('--fitness', choices=('min', 'max'), default='min', help="'min': hardest samples (the paper)")
    p.add_argument('--score', choices=('accuracy', 'loss'), default='accuracy',
                   help='per-gene score: patch accuracy (the paper) or patch cross-entropy')
    p.add_argument('--same-class-pairs', action='store_true', default=False,
                   help='also search masks for (c, c) pairs, always active')
    p.add_argument('--eval-batch-size', type=positive_int, default=512)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--device', default=None)
    p.add_argument('--amp', action='store_true', default=False)
    p.add_argument('--channels-last', action='store_true', default=False)
    p.add_argument('--resume', action='store_true', default=False, help='continue from OUTPUT/search_state')
    p.add_argument('--no-progress', action='store_true', default=False)
    p.add_argument('--no-plots', action='store_true', default=False)
    return p


def _load_images(ds, data_meta: Dict[str, Any], device) -> torch.Tensor:
    from timm.data.loader import adapt_to_chs
    from ..data import pixel_transform
    c = data_meta['input_size'][0]
    mean = torch.tensor(adapt_to_chs(data_meta['mean'], c))
    std = torch.tensor(adapt_to_chs(data_meta['std'], c))
    ds.transform = pixel_transform(*data_meta['input_size'])
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    return x.to(device)


class Search:
    """State and steps of one search; ``run()`` does the generations, checkpointing after each."""

    def __init__(self, args: argparse.Namespace):
        from ..data import build_dataset, dataset_num_classes
        from ..hub import model_from_weights
        from ..models import PatchHeadModel

        self.args = args
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = torch.device(args.device or ('cuda' if torch.cuda.is_available() else 'cpu'))
        try:
            model, meta = model_from_weights(args.checkpoint)
        except CheckpointError as e:
            raise SystemExit(f'error: {e}') from None
        if not isinstance(model, PatchHeadModel):
            raise SystemExit(f'error: {args.checkpoint} holds {meta.get("model")!r}, which has no patch head; the '
                             f'search scores patches, so train f_T with --model patchhead_<arch> --patchmix')
        self.grid = tuple(model.grid)
        if self.grid[0] * self.grid[1] > MaskOps.MAX_CELLS:
            raise SystemExit(f'error: the model in {args.checkpoint} has a {self.grid[0]}x{self.grid[1]} grid, '
                             f'{self.grid[0] * self.grid[1]} cells; the search handles grids of up to '
                             f'{MaskOps.MAX_CELLS} cells')
        if args.grid is not None:
            want = tuple(args.grid * 2 if len(args.grid) == 1 else args.grid)
            if want != self.grid:
                raise SystemExit(f'error: --grid {want[0]}x{want[1]} differs from the {self.grid[0]}x{self.grid[1]} '
                                 f'grid of the model in {args.checkpoint}; leave --grid unset to use the model\'s')
        data = meta.get('data', {})
        self.dataset = args.dataset if args.dataset is not None else data.get('dataset', '')
        data_dir = args.data_dir if args.data_dir is not None else data.get('data_dir', '')
        split = args.val_split or data.get('val_split', 'validation')
        try:
            ds = build_dataset(self.dataset, data_dir, split, subset=args.val_subset)
        except FileNotFoundError as e:
            raise SystemExit(f'error: {e}') from None
        self.num_classes = dataset_num_classes(ds)
        if args.num_classes is not None and args.num_classes != self.num_classes:
            raise SystemExit(f'error: --num-classes {args.num_classes} differs from the {self.num_classes} classes '
                             f'of dataset {self.dataset or "patchshapes"}')
        if model.num_classes != self.num_classes:
            raise SystemExit(f'error: the model in {args.checkpoint} has {model.num_classes} classes, dataset '
                             f'{self.dataset or "patchshapes"} has {self.num_classes}')
        self.class_names = list(ds.classes) or [str(i) for i in range(self.num_classes)]
        self.space = PairSpace(self.num_classes, args.same_class_pairs)
        self.n_active = args.n_active or self.num_classes
        if not 1 <= self.n_active <= self.space.num_cross:
            raise SystemExit(f'error: N={self.n_active} active pairs, but {self.num_classes} classes have only '
                             f'{self.space.num_cross} pairs')
        labels = np.array([ds.base.targets[i] for i in ds.indices]) if hasattr(ds.base, 'targets') else \
            np.array([ds[i][1] for i in range(len(ds))])
        try:
            a_idx, b_idx = draw_image_pairs(labels, self.space.pairs, args.k, args.seed)
        except ValueError as e:
            raise SystemExit(f'error: {e}') from None
        model = model.to(self.device).eval()
        if args.channels_last:
            model = model.to(memory_format=torch.channels_last)
        images = _load_images(ds, data, self.device)
        scorer = GeneScorer(model, images, self.space.pairs, a_idx, b_idx, self.grid, args.score,
                            args.eval_batch_size, amp=args.amp, channels_last=args.channels_last)
        self._init_ga(scorer)
        self.fingerprint = dataset_fingerprint(self.dataset, self.class_names)
        # what the population and the cached gene scores mean: a resume must have the same (generations and
        # patience only say when to stop, so a resume may change them)
        self.settings = {
            '--checkpoint': file_record(args.checkpoint), '--dataset': self.dataset, '--data-dir': data_dir,
            '--val-split': split, '--val-subset': args.val_subset, '--grid': list(self.grid),
            '--population': args.population, '--n-active': self.n_active, '--k': args.k, '--seed': args.seed,
            '--fitness': args.fitness, '--score': args.score, '--same-class-pairs': args.same_class_pairs,
            '--cxpb': args.cxpb, '--mutpb': args.mutpb, '--tournsize': args.tournsize, '--hof': args.hof}

    def _init_ga(self, scorer) -> None:
        """The search machinery over ``self.space`` and ``self.grid``, scoring genes with ``scorer``."""
        args = self.args
        self.scorer = scorer
        self.mops = MaskOps(*self.grid)
        self.fitness_cls = fitness_class(args.fitness)
        self.rng = np.random.default_rng(args.seed)
        self.ops = Operators(self.space, self.mops, self.n_active, self.rng, self.fitness_cls)
        self.toolbox = base.Toolbox()
        self.toolbox.register('mate', self.ops.mate)
        self.toolbox.register('mutate', self.ops.mutate)
        self.toolbox.register('select', tools.selTournament, tournsize=args.tournsize)
        self.hof = tools.HallOfFame(args.hof, similar=same_phenotype(self.space.forced))  # forced masks count too
        self.logbook: List[Dict[str, Any]] = []
        self.gen = 0
        self.population: List[Individual] = []
        self.best_history: List[float] = []

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

    # --- state -----------------------------------------------------------------------------------------------
    def _pack(self, inds: List[Individual], prefix: str) -> Dict[str, torch.Tensor]:
        if not inds:
            return {}
        n = self.n_active
        active = np.full((len(inds), n), -1, dtype=np.int64)
        for r, ind in enumerate(inds):
            active[r, :len(ind.active)] = ind.active
        return {f'{prefix}.active': torch.from_numpy(active),
                f'{prefix}.masks': torch.from_numpy(np.stack([ind.masks for ind in inds])),
                f'{prefix}.fitness': torch.tensor([ind.fitness.values[0] if ind.fitness.valid else float('nan')
                                                   for ind in inds], dtype=torch.float64)}

    def _unpack(self, t: Dict[str, torch.Tensor], prefix: str) -> List[Individual]:
        if f'{prefix}.active' not in t:
            return []
        out = []
        for a, m, f in zip(t[f'{prefix}.active'].numpy(), t[f'{prefix}.masks'].numpy(), t[f'{prefix}.fitness'].numpy()):
            ind = Individual(a[a >= 0].copy(), m.copy(), self.fitness_cls())
            if not np.isnan(f):
                ind.fitness.values = (float(f),)
            out.append(ind)
        return out

    @property
    def state_path(self) -> str:
        return os.path.join(self.args.output, 'search_state.safetensors')

    def save_state(self) -> None:
        pairs, masks, vals = self.scorer.cache_arrays()  # two columns: exact for every grid
        tensors = dict(self._pack(self.population, 'pop'), **self._pack(list(self.hof), 'hof'))
        tensors['cache.pairs'] = torch.from_numpy(pairs)
        tensors['cache.masks'] = torch.from_numpy(masks)
        tensors['cache.scores'] = torch.from_numpy(vals)
        tensors['rng.torch'] = torch.get_rng_state()
        py = random.getstate()
        meta = {'generation': self.gen, 'logbook': self.logbook, 'best_history': self.best_history,
                'rng_numpy': self.rng.bit_generator.state, 'rng_python': [py[0], list(py[1]), py[2]],
                'forward_images': self.scorer.forward_images, 'args': _jsonable(vars(self.args)),
                'fingerprint': self.fingerprint, 'grid': list(self.grid), 'num_classes': self.num_classes,
                'settings': self.settings}
        save_bundle(self.state_path, tensors, meta, kind='search_state')

    def load_state(self) -> None:
        try:
            t, meta = load_bundle(self.state_path, 'search_state')
        except CheckpointError as e:
            raise SystemExit(f'error: cannot resume the search: {e}') from None
        try:
            check_search_meta(self.state_path, meta)
        except CheckpointError as e:
            raise SystemExit(f'error: cannot resume the search: {e}') from None
        check_settings(meta.get('settings') or {}, self.settings,
                       f'cannot resume the search in {self.args.output}: {self.state_path} was written',
                       f'Resume with the settings it was started with, or run the new settings with another '
                       f'--output (or delete {self.args.output} first).')
        if meta.get('fingerprint') != self.fingerprint or tuple(meta.get('grid', ())) != self.grid:
            raise SystemExit(f'error: {self.state_path} belongs to a search on another dataset or grid')
        try:
            cache = check_search_tensors(self.state_path, t, grid=self.grid, n_pairs=len(self.space),
                                         num_cross=self.space.num_cross, n_active=self.n_active, hof_size=self.args.hof)
        except CheckpointError as e:
            raise SystemExit(f'error: cannot resume the search: {e}') from None
        try:
            self.population = self._unpack(t, 'pop')
            # set the hall of fame's lists as saved: re-inserting would reorder individuals of equal fitness
            self.hof.clear()
            self.hof.items = self._unpack(t, 'hof')
            self.hof.keys = [ind.fitness for ind in reversed(self.hof.items)]
            self.scorer.set_cache(*cache)
            torch.set_rng_state(t['rng.torch'])
            self.rng.bit_generator.state = meta['rng_numpy']
            v, internal, g = meta['rng_python']
            random.setstate((v, tuple(internal), g))
            self.gen = int(meta['generation'])
            self.logbook = list(meta['logbook'])
            self.best_history = list(meta['best_history'])
            self.scorer.forward_images = int(meta['forward_images'])
        except (KeyError, ValueError, TypeError) as e:
            raise SystemExit(f'error: {self.state_path} is incomplete or corrupt: {e!r}') from None

    # --- the loop --------------------------------------------------------------------------------------------
    def _record(self, evals: Dict[str, int], n_invalid: int, t_gen: float) -> Dict[str, Any]:
        fits = np.array([ind.fitness.values[0] for ind in self.population])
        best = float(fits.min() if self.args.fitness == 'min' else fits.max())
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

    def _stalled(self) -> bool:
        p = self.args.patience
        if not p or len(self.best_history) <= p:
            return False
        return self.best_history[-1] == self.best_history[-1 - p]

    def run(self) -> MaskTable:
        from tqdm import tqdm
        args = self.args
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        if args.resume and os.path.exists(self.state_path):
            self.load_state()
        elif args.resume:
            raise SystemExit(f'error: --resume given but {self.state_path} does not exist')
        if not self.population:
            t0 = time.perf_counter()
            self.population = [self.ops.random_individual() for _ in range(args.population)]
            evals = self.evaluate(self.population)
            self.hof.update(self.population)
            self._record(evals, len(self.population), time.perf_counter() - t0)
            self._checkpoint()
        bar = tqdm(total=args.generations, initial=self.gen, desc='search', unit='gen',
                   disable=self.rank != 0 or args.no_progress, dynamic_ncols=True)
        kill_at = int(os.environ.get(KILL_ENV, '0'))
        while self.gen < args.generations and not self._stalled():
            t0 = time.perf_counter()
            offspring = self.toolbox.select(self.population, len(self.population))
            offspring = algorithms.varAnd(offspring, self.toolbox, args.cxpb, args.mutpb)
            invalid = [ind for ind in offspring if not ind.fitness.valid]
            evals = self.evaluate(invalid)
            self.hof.update(offspring)
            self.population[:] = offspring
            self.gen += 1
            row = self._record(evals, len(invalid), time.perf_counter() - t0)
            self._checkpoint()
            bar.update(1)
            bar.set_postfix(best=f"{row['hof_best']:.4f}", mean=f"{row['mean']:.4f}",
                            hit=f"{row['cache_hit_rate']:.2f}")
            if args.no_progress and self.rank == 0:
                print(f"gen {self.gen}: best {row['hof_best']:.4f} mean {row['mean']:.4f} new genes "
                      f"{row['new_genes']} hit rate {row['cache_hit_rate']:.3f}", flush=True)
            if kill_at and self.gen >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        bar.close()
        table = self.table()
        if self.rank == 0:
            self.write_outputs(table)
        return table

    def _checkpoint(self) -> None:
        if self.rank == 0:
            self.save_state()

    def table(self) -> MaskTable:
        best = self.hof[0]
        idx, masks = best.genes(self.space.forced)
        scores = self.scorer.lookup(idx, masks)
        order = np.argsort(scores, kind='stable') if self.args.fitness == 'min' else np.argsort(-scores, kind='stable')
        r, c = self.grid
        return MaskTable(
            grid=self.grid, num_classes=self.num_classes, class_names=self.class_names,
            fingerprint=self.fingerprint,
            pairs=[tuple(int(v) for v in self.space.pairs[idx[o]]) for o in order],
            masks=[bits_to_grid(masks[o], r, c) for o in order], scores=[float(scores[o]) for o in order],
            best_fitness=float(best.fitness.values[0]), search_args=_jsonable(vars(self.args)))

    def write_outputs(self, table: MaskTable) -> None:
        out = self.args.output
        table.save(os.path.join(out, 'masks.json'))
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(self.logbook[0].keys()), lineterminator='\n')
        w.writeheader()
        w.writerows(self.logbook)
        atomic_write_text(os.path.join(out, 'logbook.csv'), buf.getvalue())
        if not self.args.no_plots:
            plot_fitness(self.logbook, os.path.join(out, 'fitness.png'), self.args.fitness, self.args.score)
            plot_pairs(table, os.path.join(out, 'pairs.png'))


_RUNTIME_ARGS = ('output', 'resume', 'no_progress', 'no_plots', 'device')  # how a search ran, not what it searched


def _jsonable(d: Dict[str, Any]) -> Dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()
            if k not in _RUNTIME_ARGS and isinstance(v, (int, float, str, bool, list, tuple, type(None)))}


def _save_fig(fig, path: str) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
    atomic_write_bytes(path, buf.getvalue())


def plot_fitness(logbook: List[Dict[str, Any]], path: str, direction: str, score: str = 'accuracy') -> None:
    """Best and mean fitness per generation (the paper's Figure 5)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    gens = [r['gen'] for r in logbook]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(gens, [r['hof_best'] for r in logbook], label='best (hall of fame)')
    ax.plot(gens, [r['mean'] for r in logbook], label='population mean')
    ax.set_xlabel('generation')
    what = 'patch accuracy' if score == 'accuracy' else 'patch cross-entropy'
    ax.set_ylabel(f'fitness: {what} of f_T (' + ('lower' if direction == 'min' else 'higher') + ' is selected)')
    ax.legend()
    ax.grid(alpha=0.3)
    _save_fig(fig, path)
    plt.close(fig)


def plot_pairs(table: MaskTable, path: str, max_pairs: int = 40) -> None:
    """The chosen class pairs with their masks (dark cells come from the second class)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    n = min(len(table.pairs), max_pairs)
    cols = min(n, 8)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.9 * rows), squeeze=False)
    names = table.class_names or [str(i) for i in range(table.num_classes)]
    for a in axes.flat:
        a.axis('off')
    for k in range(n):
        a = axes.flat[k]
        i, j = table.pairs[k]
        a.imshow(table.masks[k], cmap='gray', vmin=0, vmax=1)
        a.set_title(f'{names[i][:10]}\n+ {names[j][:10]}\n{table.scores[k]:.3f}', fontsize=7)
    _save_fig(fig, path)
    plt.close(fig)


def main(argv=None) -> MaskTable:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.grid is not None and len(args.grid) not in (1, 2):
        parser.error(f'argument --grid: takes P or rows cols, got {len(args.grid)} values '
                     f'{" ".join(map(str, args.grid))}')
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    if int(os.environ.get('WORLD_SIZE', '1')) > 1 and not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and (args.device or 'cuda').startswith('cuda')
        dist.init_process_group(backend='nccl' if use_cuda else 'gloo')
        if use_cuda:
            args.device = f'cuda:{int(os.environ.get("LOCAL_RANK", "0"))}'
    search = Search(args)
    if search.rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f'search: {search.num_classes} classes, {len(search.space)} pairs, N={search.n_active}, K={args.k}, '
              f'population {args.population}, {args.generations} generations, grid {search.grid[0]}x'
              f'{search.grid[1]}, fitness {args.fitness} {args.score}')
    table = search.run()
    if search.rank == 0:
        print(f'best fitness {table.best_fitness:.4f} with {len(table.pairs)} pairs; wrote '
              f'{os.path.join(args.output, "masks.json")}')
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return table


def cli(argv=None) -> int:
    try:
        main(argv)
    except SettingsChangedError as e:
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    return 0
