"""How well a searched table's hardness carries over to images the search did not score its genes on.

    from timm_patchmix.search.generalise import table_generalisation
    result = table_generalisation('output/train/rpm/best.safetensors', 'output/search/masks.json')
    result['mean']['retained']['patchmix']

    python -m timm_patchmix.search.generalise --checkpoint CK --table masks.json [--fresh-k 32] \\
        [--random-masks 16] [--seed 0] [--output result.json]

The search's scoring setup is rebuilt from the table's ``search_args`` and the checkpoint with the search's own code
(:meth:`Search.from_checkpoint <timm_patchmix.search.core.Search.from_checkpoint>`: the same images, the same K
image pairs per class pair, f_T in eval mode, the same score), and every gene of the table (an active class pair
and its mask) is scored

- on the search's own K image pairs (``chosen_search``; what the search computed, and checked against the score the
  table records, so a table searched with another checkpoint or on other images is refused);
- on ``fresh_k`` fresh image pairs of the same two classes (``chosen_fresh``, see :func:`table_generalisation` for
  where they come from);
- against ``random_masks`` random masks per class pair, on both sets of image pairs, of two kinds: ``patchmix``,
  masks drawn as Random PatchMix draws them (:meth:`PatchMix.sample <timm_patchmix.mix.PatchMix.sample>`, alpha 1:
  every cell a fair coin), and ``matched``, masks with as many partner cells as the gene's mask at random positions.

``gap = random - chosen`` is how much lower the chosen mask scores than a random one (how much harder, for the
paper's search: fitness ``'min'`` on patch accuracy; see :func:`~timm_patchmix.search.config.kept_genes`), and
``retained = gap_fresh / gap_search`` the share of that gap that survives on fresh images.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..checkpoint import CheckpointError, WriteError, atomic_write_text, load_weights
from ..cli_types import device_problem
from ..grid import mask_to_bits
from ..locking import folder_problem
from ..mix import PatchMix
from ..settings import file_record
from ..table import MaskTable, MaskTableError
from .config import RUNTIME_FIELDS, SearchConfig, kept_genes
from .core import Search
from .fitness import GeneScorer, aggregate, draw_image_pairs
from .inputs import SearchError, ValidationData, load_validation

__all__ = ['GeneralisationError', 'table_generalisation', 'build_parser', 'main']

KINDS = ('patchmix', 'matched')
OUTSIDE_SUBSET = 'outside_scored_subset'
UNUSED_BY_PAIR = 'unused_by_pair'
# search_args that this tool sets itself rather than from the record
_OWN_FIELDS = ('checkpoint', 'eval_batch_size', 'resume')


class GeneralisationError(ValueError):
    """A table and checkpoint that cannot be measured together: a table not written by the search, one whose
    recorded scores or scored images f_T does not reproduce, or too few images for the fresh pairs."""


@contextlib.contextmanager
def _quiet_inputs():
    """Silence the split warnings of :func:`load_validation` for the second and third reads of the same split."""
    log = logging.getLogger('timm_patchmix.search.inputs')
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was


def _config(checkpoint: str, table: MaskTable, where: str, device: str,
            eval_batch_size: Optional[int]) -> SearchConfig:
    """The search's config from the table's ``search_args``, with ``checkpoint`` and this run's device."""
    args = table.search_args or {}
    if 'k' not in args or 'seed' not in args:
        raise GeneralisationError(f'{where} records no search_args with the search\'s --k and --seed (a table not '
                                  f'written by search.py?); its image pairs cannot be rebuilt')
    names = {f.name for f in dataclasses.fields(SearchConfig)} - set(RUNTIME_FIELDS) - set(_OWN_FIELDS)
    kwargs = {k: v for k, v in args.items() if k in names}
    batch = eval_batch_size if eval_batch_size is not None else args.get('eval_batch_size', 512)
    try:
        return SearchConfig(checkpoint=checkpoint, output='.', device=device, eval_batch_size=batch, progress=False,
                            plots=False, **kwargs)
    except (TypeError, ValueError) as e:
        raise GeneralisationError(f'{where}: search_args cannot be read as search settings: {e}') from None


def _check_table(table: MaskTable, path: Optional[str], where: str, search: Search) -> MaskTable:
    """The table checked against the rebuilt search's grid, classes and dataset (by ``MaskTable.load`` for a
    file)."""
    if path is not None:
        return MaskTable.load(path, grid=search.grid, num_classes=search.num_classes, fingerprint=search.fingerprint)
    if table.grid != search.grid:
        raise MaskTableError(f'{where} was searched for a {table.grid[0]}x{table.grid[1]} grid, the checkpoint has '
                             f'{search.grid[0]}x{search.grid[1]}')
    if table.num_classes != search.num_classes:
        raise MaskTableError(f'{where} is for {table.num_classes} classes, the checkpoint has {search.num_classes}')
    if table.fingerprint != search.fingerprint:
        raise MaskTableError(f'{where} was searched on another dataset (fingerprint {table.fingerprint}, the '
                             f'checkpoint\'s {search.fingerprint})')
    return table


def _seed(seed: int, pair: Tuple[int, int], stream: int) -> int:
    """A seed for one class pair and one use: draws for a pair do not depend on the other pairs of the table."""
    return int(np.random.SeedSequence([seed, pair[0], pair[1], stream]).generate_state(1)[0])


def _fresh_pairs(whole: ValidationData, pair: Tuple[int, int], fresh_k: int, seed: int, subset_pos: np.ndarray,
                 proper_subset: bool, used_pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray, str]:
    """``fresh_k`` image pairs of ``pair``'s classes as positions in ``whole``, and the pool they came from."""
    pools = []
    if proper_subset:
        pools.append((OUTSIDE_SUBSET, subset_pos))
    pools.append((UNUSED_BY_PAIR, used_pos))
    need = None
    for name, excluded in pools:
        labels = whole.labels.copy()
        labels[excluded] = -1  # no class
        try:
            a, b = draw_image_pairs(labels, np.array([pair]), fresh_k, _seed(seed, pair, 0))
            return a[0], b[0], name
        except ValueError:
            counts = [int((labels == c).sum()) for c in sorted(set(pair))]
            need = f'{" and ".join(map(str, counts))} such image(s) of class(es) {sorted(set(pair))}'
    raise GeneralisationError(
        f'class pair {pair}: too few images of split {whole.split!r} that the search did not use for the pair to '
        f'draw {fresh_k} fresh image pairs ({need}, {2 * fresh_k if pair[0] == pair[1] else fresh_k} needed per '
        f'class); lower --fresh-k')


def _patchmix_masks(grid: Tuple[int, int], num_classes: int, n: int, seed: int) -> np.ndarray:
    """``n`` masks as Random PatchMix draws them (``PatchMix.sample``, alpha 1, every pair mixed), as bits.
    A batch of at least two is drawn so that no sample is its own partner (which would leave it unmixed)."""
    gen = torch.Generator().manual_seed(seed)
    mask = PatchMix(grid, alpha=1.0, num_classes=num_classes).sample(max(n, 2), generator=gen).mask[:n]
    return np.asarray(mask_to_bits(mask.numpy()), dtype=np.int64).reshape(n)


def _matched_masks(grid: Tuple[int, int], partner_cells: int, n: int, seed: int) -> np.ndarray:
    """``n`` masks with exactly ``partner_cells`` cells from the second image, at uniformly random positions."""
    rng = np.random.default_rng(seed)
    cells = grid[0] * grid[1]
    keep = np.ones((n, cells), dtype=bool)
    for r in range(n):
        keep[r, rng.permutation(cells)[:partner_cells]] = False
    return np.asarray(mask_to_bits(keep.reshape(n, *grid)), dtype=np.int64).reshape(n)


def _finite(v: float) -> Optional[float]:
    return None if v is None or not math.isfinite(v) else float(v)


def _ratio(num: float, den: float) -> Optional[float]:
    return None if den == 0 or not math.isfinite(den) else float(num / den)


def _tolerance(cfg: SearchConfig, cells: int, tolerance: Optional[float]) -> float:
    if tolerance is not None:
        return float(tolerance)
    if cfg.score == 'accuracy':  # one patch decision of one image, as a different kernel's rounding can flip
        return 1.0 / (cfg.k * cells) + 1e-12
    return 1e-2 if cfg.amp else 1e-4


def _without_note(record: Any) -> Any:
    return {k: v for k, v in record.items() if k != 'note'} if isinstance(record, dict) else record


def table_generalisation(checkpoint: Union[str, os.PathLike], table: Union[str, os.PathLike, MaskTable],
                         fresh_k: int = 32, random_masks: int = 16, seed: int = 0, device: str = 'cpu',
                         eval_batch_size: Optional[int] = None, tolerance: Optional[float] = None) -> Dict[str, Any]:
    """How the hardness of ``table``'s genes, searched with f_T ``checkpoint``, carries over to fresh images.

    Args:
        checkpoint: f_T, the checkpoint the table was searched with.
        table: ``masks.json`` (a path) or a :class:`~timm_patchmix.table.MaskTable`; its ``search_args`` say how
            the search scored genes (split, ``val_subset``, K, seed, score...).
        fresh_k: fresh image pairs per class pair.
        random_masks: random masks of each kind per class pair.
        seed: seeds the fresh pairs and the random masks, per class pair (``SeedSequence([seed, i, j, use])``), so
            a class pair gets the same draws whatever else the table holds.
        device: where f_T runs. Scores equal the search's exactly on the CPU; another device can move a score by
            a rounding step (see ``tolerance``).
        eval_batch_size: images per forward pass (default: the search's).
        tolerance: the largest difference between a gene's recomputed and recorded score before the table is
            refused as not searched with this checkpoint on these images. Default: one patch decision of one
            image, ``1 / (K * cells)``, for the accuracy score; 1e-4 (1e-2 with AMP) for the loss.

    Fresh image pairs of class pair (c_i, c_j) are drawn from the split the search scored (its ``scored_on``):
    when the search scored a fixed subset of it (``--val-subset``), from the split's images outside that subset
    (pool ``outside_scored_subset``: none of them scored any gene); when the search scored the whole split, or the
    images outside the subset have too few of a class, from the split's images other than the pair's own 2K search
    images (pool ``unused_by_pair``: disjoint from the pair's search pairs, though other class pairs' genes may
    have been scored on them). Within a pool, the search's own rule draws them (:func:`draw_image_pairs`: distinct
    images of c_i and of c_j, 2 * fresh_k distinct ones for c_i == c_j). Too few images in both pools is an error.

    Returns a JSON-ready dict: the settings, ``genes`` (one entry per table gene, in table order: classes, mask,
    ``partner_cells``, the recorded score, ``chosen_search``, ``chosen_fresh``, ``random_search`` and
    ``random_fresh`` by kind (the mean over the random masks), ``gap_search = random_search - chosen_search`` and
    ``gap_fresh`` by kind, ``retained = gap_fresh / gap_search`` (None where ``gap_search`` is 0), the fresh pool, the
    search and fresh image pairs as dataset indices of the split, and the random masks as integers, bit
    ``r * cols + c`` set where cell (r, c) comes from the first image) and ``mean`` (the mean of each over the
    genes; its ``retained`` is the ratio of the mean gaps). A table searched with fitness ``'max'``, or one that
    keeps the easiest genes (``'min'`` on the loss score), says so in ``note``, with the same definitions.

    Raises :class:`GeneralisationError`, :class:`~timm_patchmix.table.MaskTableError` (a table for another grid,
    label set or dataset), ``SearchError`` or ``CheckpointError``, each naming what does not fit.
    """
    for name, v, lo in (('fresh_k', fresh_k, 1), ('random_masks', random_masks, 1), ('seed', seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f'{name} must be an integer >= {lo}, got {v!r}')
    # the caller's own arguments, checked as such (in the search config they would read as the table's fault)
    if eval_batch_size is not None and (isinstance(eval_batch_size, bool) or not isinstance(eval_batch_size, int)
                                        or eval_batch_size < 1):
        raise ValueError(f'eval_batch_size must be an integer >= 1, got {eval_batch_size!r}')
    problem = device_problem(device) if isinstance(device, str) else f'must be a device name, got {device!r}'
    if problem is not None:
        raise ValueError(f'device: {problem}')
    t0 = time.perf_counter()
    checkpoint = os.fspath(checkpoint)  # (a pathlib.Path as the string the search config takes)
    path = os.fspath(table) if isinstance(table, (str, os.PathLike)) else None
    where = f'mask table {path}' if path is not None else 'the mask table'
    tab = MaskTable.load(path) if path is not None else table
    cfg = _config(checkpoint, tab, where, device, eval_batch_size)
    search = Search.from_checkpoint(cfg)
    tab = _check_table(tab, path, where, search)
    scorer = search.scorer
    grid, cells = search.grid, search.grid[0] * search.grid[1]

    # the images: the search's (its scored set) within the whole split it was drawn from
    meta = load_weights(checkpoint)[1]
    with _quiet_inputs():
        data = load_validation(cfg, scorer.model, meta)
        whole = load_validation(cfg.replace(val_subset=None), scorer.model, meta)
    scored_on = data.record()
    recorded_on = (tab.search_args or {}).get('scored_on')
    # (the note says what the images are to f_T, in words a version may change: the images are the rest)
    if recorded_on is not None and _without_note(recorded_on) != _without_note(scored_on):
        raise GeneralisationError(
            f'{where} was scored on other images than {checkpoint} gives for its search_args (recorded '
            f'{_describe(recorded_on)}, now {_describe(scored_on)}): a table searched with another checkpoint, or a '
            f'dataset that changed; pass the checkpoint and data it was searched with')
    position = {idx: n for n, idx in enumerate(whole.indices)}
    subset_pos = np.array([position[i] for i in data.indices], dtype=np.int64)
    proper_subset = len(data.indices) < len(whole.indices)

    # the genes of the table, as the search's pair indices
    index = {tuple(int(v) for v in p): n for n, p in enumerate(search.space.pairs)}
    pidx = []
    for g, pair in enumerate(tab.pairs):
        if tuple(pair) not in index:
            raise GeneralisationError(f'{where}: pairs[{g}] {tuple(pair)} is not a class pair the search scores '
                                      f'(pairs are (i, j) with i < j, or (i, i) with --same-class-pairs)')
        pidx.append(index[tuple(pair)])
    pidx = np.array(pidx, dtype=np.int64)
    genes = np.array([mask_to_bits(m) for m in tab.masks], dtype=np.int64)
    n_genes = len(genes)
    partner = np.array([cells - int(np.count_nonzero(m)) for m in tab.masks], dtype=np.int64)

    # fresh image pairs and random masks, per class pair
    fa, fb, pools, pm_masks, mt_masks = [], [], [], [], []
    for g, pair in enumerate(tab.pairs):
        p = pidx[g]
        used = subset_pos[np.concatenate([scorer.a_idx[p].numpy(), scorer.b_idx[p].numpy()])]
        a, b, pool = _fresh_pairs(whole, tuple(pair), fresh_k, seed, subset_pos, proper_subset, used)
        fa.append(a)
        fb.append(b)
        pools.append(pool)
        pm_masks.append(_patchmix_masks(grid, search.num_classes, random_masks, _seed(seed, pair, 1)))
        mt_masks.append(_matched_masks(grid, int(partner[g]), random_masks, _seed(seed, pair, 2)))
    fa, fb = np.stack(fa), np.stack(fb)
    pm_masks, mt_masks = np.stack(pm_masks), np.stack(mt_masks)

    # the fresh images alone are loaded, normalised as the search's are
    uniq = np.unique(np.concatenate([fa.ravel(), fb.ravel()]))
    from ..data import make_view
    view = make_view(whole.ds.base, whole.ds.classes, [whole.indices[u] for u in uniq.tolist()])
    fresh_data = dataclasses.replace(whole, labels=whole.labels[uniq], ds=view)
    fresh = GeneScorer(scorer.model, fresh_data.images(scorer.images.device), np.array(tab.pairs, dtype=np.int64),
                       np.searchsorted(uniq, fa), np.searchsorted(uniq, fb), grid, cfg.score, cfg.eval_batch_size,
                       amp=scorer.amp, channels_last=scorer.channels_last)

    # every score in one batched pass per set of image pairs: chosen, then the random masks of each kind
    r = random_masks
    masks = np.concatenate([genes, pm_masks.ravel(), mt_masks.ravel()])
    on_search = scorer.score_genes(np.concatenate([pidx, np.repeat(pidx, r), np.repeat(pidx, r)]), masks)
    rows = np.arange(n_genes, dtype=np.int64)
    on_fresh = fresh.score_genes(np.concatenate([rows, np.repeat(rows, r), np.repeat(rows, r)]), masks)

    def split(scores: np.ndarray) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        chosen = scores[:n_genes]
        rand = scores[n_genes:].reshape(2, n_genes, r)
        return chosen, {kind: np.array([aggregate(rand[q, g]) for g in range(n_genes)]) for q, kind in
                        enumerate(KINDS)}
    chosen_s, random_s = split(on_search)
    chosen_f, random_f = split(on_fresh)

    # the search's scores must come back: the table's recorded ones, within the kernel-rounding tolerance
    recorded = np.array(tab.scores, dtype=np.float64)
    known = np.isfinite(recorded)
    diff = np.abs(chosen_s[known] - recorded[known])
    tol = _tolerance(cfg, cells, tolerance)
    if known.any() and float(diff.max()) > tol:
        g = int(np.flatnonzero(known)[int(diff.argmax())])
        raise GeneralisationError(
            f'{where} was not searched with {checkpoint}: f_T scores the genes on the search\'s own image pairs '
            f'differently from the scores the table records (gene {tuple(tab.pairs[g])}: recorded '
            f'{recorded[g]:.6g}, now {chosen_s[g]:.6g}; largest difference {float(diff.max()):.4g}, more than the '
            f'{tol:.4g} a different device\'s rounding allows). The table names the checkpoint '
            f'{(tab.search_args or {}).get("checkpoint")!r}; pass the checkpoint it was searched with')

    out_genes = []
    for g, pair in enumerate(tab.pairs):
        p = pidx[g]
        gs = {k: float(random_s[k][g] - chosen_s[g]) for k in KINDS}
        gf = {k: float(random_f[k][g] - chosen_f[g]) for k in KINDS}
        out_genes.append({
            'classes': [int(pair[0]), int(pair[1])],
            'names': [tab.class_names[pair[0]], tab.class_names[pair[1]]] if tab.class_names else None,
            'mask': np.asarray(tab.masks[g], dtype=int).tolist(), 'partner_cells': int(partner[g]),
            'recorded_score': _finite(float(recorded[g])),
            'chosen_search': float(chosen_s[g]), 'chosen_fresh': float(chosen_f[g]),
            'random_search': {k: float(random_s[k][g]) for k in KINDS},
            'random_fresh': {k: float(random_f[k][g]) for k in KINDS},
            'gap_search': gs, 'gap_fresh': gf, 'retained': {k: _ratio(gf[k], gs[k]) for k in KINDS},
            'fresh_pool': pools[g],
            'search_pairs': {'a': [data.indices[i] for i in scorer.a_idx[p].tolist()],
                             'b': [data.indices[i] for i in scorer.b_idx[p].tolist()]},
            'fresh_pairs': {'a': [whole.indices[i] for i in fa[g].tolist()],
                            'b': [whole.indices[i] for i in fb[g].tolist()]},
            'random_masks': {'patchmix': pm_masks[g].tolist(), 'matched': mt_masks[g].tolist()},
        })

    def mean(key: str, kind: Optional[str] = None) -> float:
        return aggregate(np.array([e[key] if kind is None else e[key][kind] for e in out_genes]))
    means = {'chosen_search': mean('chosen_search'), 'chosen_fresh': mean('chosen_fresh')}
    for key in ('random_search', 'random_fresh', 'gap_search', 'gap_fresh'):
        means[key] = {k: mean(key, k) for k in KINDS}
    means['retained'] = {k: _ratio(means['gap_fresh'][k], means['gap_search'][k]) for k in KINDS}

    args = tab.search_args or {}
    result = {
        'table': path, 'checkpoint': file_record(checkpoint), 'searched_with': args.get('checkpoint'),
        'fitness': cfg.fitness, 'score': cfg.score, 'grid': list(grid), 'k': cfg.k, 'search_seed': cfg.seed,
        'fresh_k': fresh_k, 'random_masks': random_masks, 'seed': seed, 'device': str(scorer.images.device),
        'scored_on': scored_on,
        'fresh_from': {'split': whole.split, 'images': len(whole.indices),
                       'scored_subset': len(data.indices) if proper_subset else None,
                       'pools': {name: pools.count(name) for name in (OUTSIDE_SUBSET, UNUSED_BY_PAIR)}},
        'recorded': {'genes_checked': int(known.sum()), 'exact': bool(np.array_equal(chosen_s[known], recorded[known])),
                     'max_abs_diff': float(diff.max()) if known.any() else None, 'tolerance': tol},
        'genes': out_genes, 'mean': means,
        'forward_images': scorer.forward_images + fresh.forward_images,
        'seconds': round(time.perf_counter() - t0, 3),
    }
    kept = kept_genes(cfg.fitness, cfg.score)
    if cfg.fitness == 'max' or kept == 'easiest':
        lowest = cfg.fitness == 'min'
        result['note'] = (f"the table was searched with fitness {cfg.fitness!r} and the {cfg.score} score: it keeps "
                          f"the {'lowest' if lowest else 'highest'} scores, the {kept} genes. The definitions are the "
                          f"same, so " + ("a positive gap says the chosen masks score lower than random ones: "
                                          f"{'harder' if kept == 'hardest' else 'easier'}" if lowest else
                                          "there the chosen masks are meant to score higher than random ones and "
                                          "the gaps are negative"))
    return result


def _describe(on: Dict[str, Any]) -> str:
    if not isinstance(on, dict):
        return repr(on)
    return f"{on.get('images')} images of split {on.get('split')!r}, sha256 {str(on.get('sha256'))[:12]}"


# --- command line ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from ..cli import HelpFormatter
    from ..cli_types import device_name, existing_file, new_file, nonneg_int, positive_int
    p = argparse.ArgumentParser(
        prog='python -m timm_patchmix.search.generalise', formatter_class=HelpFormatter,
        description='How well a searched table\'s hardness generalises: every gene scored on the search\'s own '
                    'image pairs and on\nfresh ones, against random masks (Random PatchMix draws and masks with '
                    'the gene\'s partner-cell count).')
    p.add_argument('--checkpoint', required=True, type=existing_file, help='f_T, the checkpoint the table was '
                   'searched with')
    p.add_argument('--table', required=True, type=existing_file, help='masks.json written by search.py')
    p.add_argument('--fresh-k', type=positive_int, default=32, help='fresh image pairs per class pair')
    p.add_argument('--random-masks', type=positive_int, default=16, help='random masks of each kind per class pair')
    p.add_argument('--seed', type=nonneg_int, default=0, help='seed of the fresh pairs and the random masks')
    p.add_argument('--device', default='cpu', type=device_name,
                   help='device of f_T (the CPU reproduces the search\'s scores exactly)')
    p.add_argument('--eval-batch-size', type=positive_int, default=None,
                   help='images per forward pass (default: the search\'s)')
    p.add_argument('--output', type=new_file, default=None, help='write the result as JSON here')
    return p


def _fmt(v: Optional[float]) -> str:
    return 'n/a' if v is None else f'{v:.4f}'


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Measure, print a summary, write ``--output``; a table that does not fit exits 1 with an ``error:`` line."""
    from ..cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    for name in ('checkpoint', 'table'):  # the result would replace an input
        if args.output and os.path.exists(args.output) and os.path.samefile(args.output, getattr(args, name)):
            parser.error(f'argument --output: {args.output} is the --{name} this reads; write the result elsewhere')
    problem = folder_problem(os.path.dirname(os.path.abspath(args.output))) if args.output else None
    if problem:  # (before the measurement, not after it)
        raise SystemExit(f'error: cannot write --output {args.output}: {" ".join(problem)}')
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    try:
        res = table_generalisation(args.checkpoint, args.table, fresh_k=args.fresh_k, random_masks=args.random_masks,
                                   seed=args.seed, device=args.device, eval_batch_size=args.eval_batch_size)
    except (GeneralisationError, MaskTableError, SearchError, CheckpointError) as e:
        raise SystemExit(f'error: {e}') from None
    m = res['mean']
    lines: List[str] = [f"{len(res['genes'])} genes, fitness {res['fitness']} {res['score']}, K={res['k']} search "
                        f"pairs, {res['fresh_k']} fresh pairs, {res['random_masks']} random masks of each kind"]
    if res.get('note'):
        lines.append(f"note: {res['note']}")
    lines.append(f"chosen: search {_fmt(m['chosen_search'])}, fresh {_fmt(m['chosen_fresh'])}")
    for k in KINDS:
        lines.append(f"random {k}: search {_fmt(m['random_search'][k])}, fresh {_fmt(m['random_fresh'][k])}; gap "
                     f"search {_fmt(m['gap_search'][k])}, fresh {_fmt(m['gap_fresh'][k])}, retained "
                     f"{_fmt(m['retained'][k])}")
    print('\n'.join(lines))
    if args.output:
        try:
            atomic_write_text(args.output, json.dumps(res, indent=1))
        except WriteError as e:  # a full disk, a folder made read-only meanwhile (the summary is printed)
            raise SystemExit(f'error: {e}') from None
        print(f'wrote {args.output}')
    return res


if __name__ == '__main__':
    main()
