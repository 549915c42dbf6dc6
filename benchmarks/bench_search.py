"""Search cost: forward images saved by memoisation, bookkeeping time at CIFAR-100 scale, paper-scale wall time.

    python benchmarks/bench_search.py memo --checkpoint output/bench/ft-rpm/best.safetensors \
        [--population 100 --generations 40 --k 8] [--json benchmarks/results/search_memo.json]
    python benchmarks/bench_search.py bookkeeping [--generations 10] [--json benchmarks/results/search_bookkeeping.json]
    python benchmarks/bench_search.py paper --checkpoint ... [--generations 3] [--device cuda --amp --channels-last]
        [--json ...]

memo: one search on the embedded data; the memoised search forwards each distinct gene's K images once, a naive
search forwards every evaluated individual's genes (DEAP evaluates the individuals a generation changed; a
naiver one would evaluate all of them each generation: both counts are reported). Per-generation cache hit rates
come from the logbook.

bookkeeping: the search at CIFAR-100 scale (100 classes, 4,950 pairs, N=100, population 500, 4x4 grid) with the
model replaced by a stand-in that scores a gene by hashing it; the stand-in's time is subtracted, so what is left is
selection, variation, cloning, cache work and aggregation. Checkpoint writing is timed apart.

paper: a paper-scale search (10 classes, population 500, K=16, no early stop) with a CIFAR backbone; --generations
250 is the paper's full run. Time spent in the model (forwards) and outside it are reported apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
import timm_patchmix  # noqa: E402,F401
from timm_patchmix.checkpoint import atomic_write_text  # noqa: E402
from timm_patchmix.cli_types import int_range, nonneg_int, positive_int  # noqa: E402
from timm_patchmix.search import Evolution, GeneScorer, PairSpace, Search, SearchConfig  # noqa: E402


def save(path, doc):
    if path:
        atomic_write_text(path, json.dumps(doc, indent=1))
        print(f'saved {path}')


def run_search(checkpoint, population, generations, k, out, **extra):
    """A search as search.py runs it (state checkpointed every generation), timed; plots and table left out."""
    cfg = SearchConfig(checkpoint=checkpoint, output=out, population=population, generations=generations, k=k,
                       patience=0, progress=False, plots=False, **extra)
    s = Search.from_checkpoint(cfg)
    t0 = time.perf_counter()
    s.run(on_generation=lambda search, row: search.save_state())
    return s, time.perf_counter() - t0


def memo(a):
    with tempfile.TemporaryDirectory() as out:
        s, wall = run_search(a.checkpoint, a.population, a.generations, a.k, out)
    rows = s.logbook
    naive_changed = sum(r['gene_lookups'] for r in rows) * a.k
    genes_per_ind = s.n_active + len(s.space.forced)
    naive_all = (len(rows)) * a.population * genes_per_ind * a.k
    memo_imgs = s.scorer.forward_images
    doc = {'population': a.population, 'generations': len(rows) - 1, 'k': a.k, 'wall_s': wall,
           'forward_images_memoised': memo_imgs, 'forward_images_naive_changed': naive_changed,
           'forward_images_naive_all': naive_all, 'ratio_changed': naive_changed / memo_imgs,
           'ratio_all': naive_all / memo_imgs,
           'hit_rate_per_generation': [round(r['cache_hit_rate'], 4) for r in rows]}
    print(f"memoised search forwarded {memo_imgs:,} images; naive: {naive_changed:,} (changed individuals, "
          f"{doc['ratio_changed']:.1f}x) or {naive_all:,} (every individual, {doc['ratio_all']:.1f}x); "
          f"{len(rows) - 1} generations in {wall:.0f} s")
    print('cache hit rate per generation:', ' '.join(f'{h:.2f}' for h in doc['hit_rate_per_generation']))
    save(a.json, doc)


class StandInScorer(GeneScorer):
    """GeneScorer's cache and bookkeeping with the model replaced by a hash of the gene (no model, no images)."""

    def __init__(self, space, grid, k=16):
        no_pairs = np.zeros((len(space), k), dtype=np.int64)
        super().__init__(None, torch.empty(0, 3, 32, 32), space.pairs, no_pairs, no_pairs, grid)
        self.score_seconds = 0.0

    def score_genes(self, pair, mask):
        t0 = time.perf_counter()
        keys = self.key(pair, mask).astype(np.uint64)
        h = (keys * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
        out = (h % np.uint64(1_000_003)).astype(np.float64) / 1_000_003
        self.forward_images += len(pair) * self.k
        self.score_seconds += time.perf_counter() - t0
        return out


def bookkeeping(a):
    space = PairSpace(a.classes)
    stand_in = StandInScorer(space, (4, 4))
    s = Search(space, (4, 4), stand_in, Evolution(population=a.population, generations=a.generations, patience=0))
    per_gen, ckpt = [], []
    last = {'score_s': 0.0, 'end': 0.0}
    with tempfile.TemporaryDirectory() as out:
        def after(search, row):
            # the generation's time (since the last callback) less the stand-in's: selection, variation, cloning,
            # cache work, aggregation
            t0 = time.perf_counter()
            per_gen.append(t0 - last['end'] - (stand_in.score_seconds - last['score_s']))
            last['score_s'] = stand_in.score_seconds
            search.save_state(os.path.join(out, Search.STATE_FILE))
            ckpt.append(time.perf_counter() - t0)
            last['end'] = time.perf_counter()
        last['end'] = time.perf_counter()
        s.run(on_generation=after)
    gens = per_gen[1:]  # generation 0 is the initial population
    doc = {'classes': a.classes, 'pairs': len(s.space), 'n_active': s.n_active, 'population': a.population,
           'generations': len(gens), 'median_bookkeeping_s': statistics.median(gens), 'bookkeeping_s': gens,
           'median_checkpoint_s': statistics.median(ckpt[1:]), 'threads': torch.get_num_threads()}
    print(f"bookkeeping per generation at {a.classes} classes ({len(s.space)} pairs), N={s.n_active}, population "
          f"{a.population}: median {doc['median_bookkeeping_s']:.3f} s over {len(gens)} generations (model "
          f"stand-in excluded); checkpoint write median {doc['median_checkpoint_s']:.3f} s")
    save(a.json, doc)


def paper(a):
    with tempfile.TemporaryDirectory() as out:
        s, wall = run_search(a.checkpoint, a.population, a.generations, 16, out, eval_batch_size=a.eval_batch_size,
                             device=a.device, amp=a.amp, channels_last=a.channels_last)
    rows = s.logbook
    dev = s.scorer.images.device
    device = torch.cuda.get_device_name(dev) if dev.type == 'cuda' else f'cpu ({torch.get_num_threads()} threads)'
    doc = {'population': a.population, 'k': 16, 'generations_run': len(rows) - 1, 'wall_s': wall, 'device': device,
           'amp': a.amp, 'channels_last': a.channels_last, 'eval_batch_size': a.eval_batch_size,
           'best_fitness': rows[-1]['best'],
           'seconds_per_generation': [r['seconds'] for r in rows], 'new_genes': [r['new_genes'] for r in rows],
           'hit_rate': [round(r['cache_hit_rate'], 4) for r in rows], 'forward_images': s.scorer.forward_images,
           'model_seconds': s.scorer.model_seconds, 'outside_model_seconds': wall - s.scorer.model_seconds}
    print(f"paper scale (10 classes, population {a.population}, K=16): {len(rows) - 1} generations + the initial "
          f"population in {wall:.0f} s on {doc['device']} ({doc['model_seconds']:.0f} s in the model, "
          f"{doc['forward_images']:,} images); initial population {rows[0]['seconds']:.1f} s, later generations median "
          f"{statistics.median(doc['seconds_per_generation'][1:] or [0]):.2f} s; new genes {doc['new_genes'][:10]}...; "
          f"hit rate {doc['hit_rate'][:10]}...")
    save(a.json, doc)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('what', choices=('memo', 'bookkeeping', 'paper'))
    p.add_argument('--checkpoint', default=None)
    p.add_argument('--population', type=int_range(2), default=None)
    p.add_argument('--generations', type=nonneg_int, default=None,
                   help='memo, bookkeeping: 1 or more; paper: 0 times the first population alone')
    p.add_argument('--k', type=positive_int, default=8)
    p.add_argument('--classes', type=int_range(2), default=100)
    p.add_argument('--device', default=None, help='paper: the search device (default: cuda when available)')
    p.add_argument('--amp', action='store_true')
    p.add_argument('--channels-last', action='store_true')
    p.add_argument('--eval-batch-size', type=positive_int, default=512)
    p.add_argument('--json', default=None)
    a = p.parse_args()
    population, generations = {'memo': (100, 40), 'bookkeeping': (500, 10)}.get(a.what, (500, 3))
    a.population = population if a.population is None else a.population
    a.generations = generations if a.generations is None else a.generations
    if a.generations == 0 and a.what != 'paper':  # (a median per generation of none)
        p.error(f'argument --generations: {a.what} times generations: give 1 or more')
    {'memo': memo, 'bookkeeping': bookkeeping}.get(a.what, paper)(a)


if __name__ == '__main__':
    main()
