"""The evolutionary search: operators, exact memoised fitness, the core loop built in memory, the config and result
of search(), resume, DDP equality, errors, the mask table."""
import dataclasses
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import timm
from hypothesis import given, settings, strategies as st

import timm_patchmix  # noqa: F401
from timm_patchmix.checkpoint import save_weights
from timm_patchmix.data import PATCHSHAPES_CLASSES
from timm_patchmix.grid import bits_to_mask, mask_to_bits
from timm_patchmix.table import MaskTable, MaskTableError, dataset_fingerprint
from timm_patchmix.search import (Evolution, GeneScorer, Search, SearchConfig, SearchError, SearchResult,
                                  SearchUsageError, build_parser, draw_image_pairs, parse_config, search)
from timm_patchmix.search import main as search_main
from timm_patchmix.search.genome import MaskOps, Operators, PairSpace, bits_to_grid, fitness_class, grid_to_bits
from timm_patchmix.settings import SettingsChangedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # the tree first
DATA = {'dataset': '', 'data_dir': '', 'val_split': 'validation', 'input_size': [3, 32, 32],
        'mean': [0.4914, 0.4822, 0.4465], 'std': [0.247, 0.2435, 0.2616]}


def make_checkpoint(path, model='patchhead_resnet32_cifar', grid=(4, 4), seed=0):
    torch.manual_seed(seed)
    kwargs = {'grid': list(grid)} if model.startswith('patchhead_') else {}
    m = timm.create_model(model, num_classes=10, **kwargs)
    save_weights(path, m.state_dict(), {'model': model, 'num_classes': 10, 'model_kwargs': kwargs,
                                        'class_names': list(PATCHSHAPES_CLASSES), 'data': DATA})
    return path


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp('ft') / 'ft.safetensors'))


# CPU, also where a GPU is present: the exact-equality checks below compare evaluations done in different batch
# groupings, which are bit-identical on the CPU but need not be under cuDNN's batch-dependent kernels
SMALL = ['--population', '16', '--generations', '4', '--k', '4', '--val-subset', '300', '--no-progress',
         '--eval-batch-size', '64', '--seed', '3', '--device', 'cpu']


# --- genome ----------------------------------------------------------------------------------------------------
def test_mask_bits_and_ops():
    ops = MaskOps(4, 4)
    g = np.zeros((4, 4), bool)
    g[0, 1] = g[2, 3] = True
    m = grid_to_bits(g)
    assert np.array_equal(bits_to_grid(m, 4, 4), g)
    assert np.array_equal(bits_to_grid(int(ops.transpose(np.array([m]))[0]), 4, 4), g.T)
    assert np.array_equal(bits_to_grid(int(ops.invert(np.array([m]))[0]), 4, 4), ~g)
    a, b = np.array([grid_to_bits(np.ones((4, 4)))]), np.array([0])
    c1, c2 = ops.halves(a, b)
    left = np.zeros((4, 4), bool)
    left[:, :2] = True
    assert np.array_equal(bits_to_grid(int(c1[0]), 4, 4), left)
    assert np.array_equal(bits_to_grid(int(c2[0]), 4, 4), ~left)


@settings(max_examples=30, deadline=None)
@given(classes=st.integers(3, 12), seed=st.integers(0, 10 ** 6), same=st.booleans(), steps=st.integers(1, 20))
def test_operators_keep_invariants(classes, seed, same, steps):
    space = PairSpace(classes, same)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, space.num_cross + 1))
    ops = Operators(space, MaskOps(4, 4), n, rng, fitness_class('min'))
    a, b = ops.random_individual(), ops.random_individual()
    for _ in range(steps):
        before_a = a.masks.copy(), b.masks.copy()
        a, b = ops.mate(a, b)
        assert np.array_equal(a.masks, (before_a[0] & ops.ops.left) | (before_a[1] & ops.ops.right))
        active_before, masks_before = a.active.copy(), a.masks.copy()
        a, = ops.mutate(a)
        touched = np.flatnonzero(a.masks != masks_before)
        allowed = set(active_before.tolist()) | set(space.forced.tolist())
        assert set(touched.tolist()) <= allowed, 'mutations change only active (and forced) masks'
        for ind in (a, b):
            ops.check(ind)
            assert len(ind.active) == n


# --- fitness ---------------------------------------------------------------------------------------------------
def test_memoised_fitness_equals_direct_evaluation(ckpt, tmp_path):
    cfg = parse_config(['--checkpoint', ckpt, '--output', str(tmp_path / 'out')] + SMALL)
    s = Search.from_checkpoint(cfg)
    table = s.run()
    assert not (tmp_path / 'out').exists(), 'the core loop writes nothing'
    assert s.scorer.forward_images < sum(r['gene_lookups'] for r in s.logbook) * cfg.k
    for ind in s.population + list(s.hof):
        assert s.evaluate_direct(ind) == ind.fitness.values[0]
    # the table's scores are the cached gene scores of the best individual, its fitness their mean
    assert table.best_fitness == s.hof[0].fitness.values[0]
    assert np.isclose(np.mean(table.scores), table.best_fitness, rtol=0, atol=1e-12)
    assert len(table.pairs) == 10 and all(m.shape == (4, 4) for m in table.masks)


def test_gene_score_counts_patches_by_hand(ckpt, tmp_path):
    s = Search.from_checkpoint(parse_config(['--checkpoint', ckpt, '--output', str(tmp_path)] + SMALL))
    scorer = s.scorer
    p, mask = 7, grid_to_bits(np.eye(4, dtype=bool))
    ci, cj = s.space.pairs[p]
    correct = 0
    for k in range(scorer.k):
        a, b = scorer.images[scorer.a_idx[p, k]], scorer.images[scorer.b_idx[p, k]]
        x = b.clone()
        for r in range(4):  # 32x32 image, 8x8 cells on the diagonal from image a
            x[:, r * 8:(r + 1) * 8, r * 8:(r + 1) * 8] = a[:, r * 8:(r + 1) * 8, r * 8:(r + 1) * 8]
        with torch.no_grad():
            pred = s.scorer.model.forward_patches(x[None])[0].argmax(-1)
        labels = torch.tensor([ci if r == c else cj for r in range(4) for c in range(4)])
        correct += int((pred == labels).sum())
    assert scorer.score_genes(np.array([p]), np.array([mask]))[0] == correct / (scorer.k * 16)
    assert torch.equal(scorer.images, s.scorer.images), 'scoring mixes copies, never the validation images'


# --- the core through its seams: no files, no flags ---------------------------------------------------------------
def tiny_scorer(classes=4, k=2, grid=(4, 4), seed=0):
    """A GeneScorer on a small random patch-head model and random images, built in memory."""
    torch.manual_seed(seed)
    model = timm.create_model('patchhead_resnet32_cifar', num_classes=classes, grid=list(grid)).eval()
    images = torch.randn(8 * classes, 3, 32, 32)
    labels = np.arange(8 * classes) % classes
    space = PairSpace(classes)
    a_idx, b_idx = draw_image_pairs(labels, space.pairs, k, seed)
    return space, GeneScorer(model, images, space.pairs, a_idx, b_idx, grid, batch_size=64)


def no_writes(monkeypatch):
    """Make every write of the package (they all go through checkpoint._atomic) fail the test."""
    from timm_patchmix import checkpoint

    def refuse(path, write):
        raise AssertionError(f'the core search wrote {path}')
    monkeypatch.setattr(checkpoint, '_atomic', refuse)


def test_core_search_runs_in_memory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    no_writes(monkeypatch)
    space, scorer = tiny_scorer()
    ev = Evolution(population=6, generations=2, patience=0, seed=1)
    s = Search(space, 4, scorer, ev)
    rows = []
    table = s.run(on_generation=lambda search_, row: rows.append((search_ is s, row['gen'])))
    assert rows == [(True, 0), (True, 1), (True, 2)] and s.gen == 2 and len(s.logbook) == 3
    assert os.listdir(tmp_path) == []
    for ind in s.population + list(s.hof):
        assert s.evaluate_direct(ind) == ind.fitness.values[0]
    assert table.grid == (4, 4) and len(table.pairs) == 4 == s.n_active and table.class_names == ['0', '1', '2', '3']
    assert table.best_fitness == s.hof[0].fitness.values[0] and table.search_args['population'] == 6
    # a generation limit stops a run; a later run goes on from there, as if it had not stopped
    s2 = Search(space, (4, 4), tiny_scorer()[1], ev)
    s2.run(generations=1)
    assert s2.gen == 1
    assert s2.run().to_json() == table.to_json()


def test_core_search_state_round_trip(tmp_path):
    """Save after generation 1, restore into a new search, finish: the same table as a run straight through."""
    space, scorer = tiny_scorer()
    ev = Evolution(population=6, generations=3, patience=0, seed=2)
    straight = Search(space, 4, scorer, ev).run()
    first = Search(space, 4, tiny_scorer()[1], ev)
    first.run(generations=1)
    first.save_state(str(tmp_path / 'state.safetensors'))
    random.seed(99)  # what happens in between does not matter: the state holds every generator
    second = Search(space, 4, tiny_scorer()[1], ev, state_path=str(tmp_path / 'state.safetensors'))
    second.load_state()
    assert second.gen == 1 and second.scorer.cache == first.scorer.cache
    assert second.run().to_json() == straight.to_json()
    # a search of other settings refuses the state
    other = Search(space, 4, tiny_scorer()[1], dataclasses.replace(ev, seed=3))
    with pytest.raises(SettingsChangedError, match="--seed: 2 before, 3 now"):
        other.load_state(str(tmp_path / 'state.safetensors'))


@pytest.mark.parametrize('edit, message', [
    (lambda t, m: t['pop.fitness'].__setitem__(0, 0.0), "an individual's recorded fitness 0.0 is not the mean"),
    (lambda t, m: t['cache.scores'].__setitem__(slice(None), -5.0), 'is not the mean of its genes'),
    (lambda t, m: t.update({k: v.flip(0).contiguous() for k, v in t.items() if k.startswith('hof.')}),
     'hall of fame is not in order of fitness'),  # (each item with its own fitness: the order alone is wrong)
    (lambda t, m: t.__setitem__('rng.torch', torch.zeros_like(t['rng.torch'])), 'RuntimeError('),
])
def test_a_state_whose_parts_disagree_is_refused(tmp_path, edit, message):
    """A search state re-written with valid digests but parts that disagree (a fitness that is not its genes' cached
    mean, a hall of fame out of order) resumed into a table whose best_fitness was not its best individual's; a
    torch RNG state torch refuses ended in a traceback. Each is now a SearchError naming the file."""
    from timm_patchmix.checkpoint import load_bundle, save_bundle
    space, scorer = tiny_scorer()
    ev = Evolution(population=6, generations=3, patience=0, seed=2)
    first = Search(space, 4, scorer, ev)
    first.run(generations=1)
    path = str(tmp_path / 'state.safetensors')
    first.save_state(path)
    tensors, meta = load_bundle(path, 'search_state')
    meta.pop('kind', None)
    edit(tensors, meta)
    save_bundle(path, tensors, meta, 'search_state')
    with pytest.raises(SearchError, match=f'^{re.escape(path)} is (inconsistent|incomplete or corrupt): '
                                          f'.*{re.escape(message)}'):
        Search(space, 4, tiny_scorer()[1], ev, state_path=path).load_state()


def test_core_search_checks_its_parts():
    space, scorer = tiny_scorer()
    with pytest.raises(ValueError, match='2x2 grid, the search is for 4x4|4x4 grid, the search is for 2x2'):
        Search(space, 2, scorer)
    with pytest.raises(ValueError, match='image pairs for 6 class pairs, the pair space 15'):
        Search(PairSpace(6), 4, scorer)
    with pytest.raises(SearchError, match='N=7 active pairs, but 4 classes have only 6 pairs'):
        Search(space, 4, scorer, Evolution(n_active=7))
    with pytest.raises(ValueError, match='3 class names for 4 classes'):
        Search(space, 4, scorer, class_names=['a', 'b', 'c'])
    with pytest.raises(RuntimeError, match='has not run yet'):
        Search(space, 4, scorer).table()


def test_search_config_is_frozen_and_checked(ckpt):
    cfg = SearchConfig(checkpoint=ckpt, grid=4)
    assert cfg.grid == (4, 4) and cfg.population == 500 and cfg.evolution() == Evolution()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.population = 3
    assert cfg.replace(population=3).population == 3 and cfg.population == 500
    for bad, message in [({'population': 1}, 'population must be an integer >= 2'),
                         ({'cxpb': 1.5}, r'cxpb must be a finite number in \[0, 1\]'),
                         ({'fitness': 'best'}, "fitness must be one of 'min', 'max'"),
                         ({'score': 'f1'}, "score must be one of 'accuracy', 'loss'"),
                         ({'k': 0}, 'k must be an integer >= 1'), ({'grid': (4, 0)}, 'grid must be at least 1x1'),
                         ({'checkpoint': ''}, 'checkpoint must be the path'), ({'seed': -1}, 'seed must be')]:
        with pytest.raises(ValueError, match=message):
            SearchConfig(**dict({'checkpoint': ckpt}, **bad))
    # flags and fields are one-to-one; the record leaves out how the search ran
    flags = parse_config(['--checkpoint', ckpt, '--grid', '4', '--no-plots', '--seed', '5'])
    assert flags == SearchConfig(checkpoint=ckpt, grid=(4, 4), plots=False, seed=5)
    rec = flags.record()
    assert rec['grid'] == [4, 4] and rec['seed'] == 5
    assert not {'output', 'device', 'resume', 'progress', 'plots'} & set(rec)


def test_search_from_checkpoint_reads_and_writes_nothing(ckpt, tmp_path, monkeypatch):
    no_writes(monkeypatch)
    s = Search.from_checkpoint(SearchConfig(checkpoint=ckpt, output=str(tmp_path / 'out'), k=2, val_subset=300,
                                            device='cpu', population=4, n_active=3))
    assert (s.num_classes, len(s.space), s.n_active, s.grid) == (10, 45, 3, (4, 4))
    assert s.class_names == list(PATCHSHAPES_CLASSES) and s.fingerprint == dataset_fingerprint('', PATCHSHAPES_CLASSES)
    assert s.scorer.images.shape[1:] == (3, 32, 32) and s.scorer.k == 2
    assert s.state_path == str(tmp_path / 'out' / 'search_state.safetensors') and not (tmp_path / 'out').exists()
    assert s.settings['--checkpoint']['path'] == ckpt and s.settings['--n-active'] == 3
    with pytest.raises(SearchError, match='--resume given but .* does not exist'):
        Search.from_checkpoint(SearchConfig(checkpoint=ckpt, output=str(tmp_path / 'out'), resume=True, k=2,
                                            val_subset=300, device='cpu'))


def test_search_returns_its_result(ckpt, tmp_path):
    cfg = parse_config(['--checkpoint', ckpt, '--output', str(tmp_path)] + SMALL + ['--generations', '2'])
    gens = []
    result = search(cfg, on_generation=lambda s, row: gens.append(os.path.isfile(s.state_path)))
    assert gens == [True, True, True], 'the callback runs after the state is saved'
    assert isinstance(result, SearchResult) and result.generations == 2 and not result.stopped_early
    assert [r['gen'] for r in result.logbook] == [0, 1, 2] and result.output == str(tmp_path)
    assert result.table_path == str(tmp_path / 'masks.json')
    assert MaskTable.load(result.table_path).to_json() == result.table.to_json()
    assert result.best_fitness == result.table.best_fitness and result.forward_images > 0
    for f in ('logbook.csv', 'fitness.png', 'pairs.png', 'search_state.safetensors'):
        assert (tmp_path / f).is_file(), f
    # a second search there without --resume replaced this one from generation 0: refused, nothing touched
    from test_resume_settings import snapshot
    before = snapshot(tmp_path)
    with pytest.raises(SearchUsageError, match=f'{tmp_path} holds a search already .*; give --resume to continue '
                                               f'it, or start afresh in another --output'):
        search(cfg)
    assert snapshot(tmp_path) == before
    Search.from_checkpoint(cfg)  # what only reads (the generalisation tool) still builds the search there


def test_a_device_or_callback_it_cannot_use_is_refused_before_anything_is_written(ckpt, tmp_path):
    """From Python a SearchConfig's device was used unchecked (the meta device made the folder, then failed in
    torch; an unknown name was torch's raw error), and an on_generation that cannot be called failed after the
    first state was written, which then blocked a corrected rerun without resume. Both are refused first now, as
    search.py's --device is."""
    out = tmp_path / 'out'
    for device, message in (('meta', "device: 'meta' holds no data to compute with"),
                            ('bogus', "device: not a torch device: 'bogus'")):
        cfg = SearchConfig(checkpoint=ckpt, output=str(out), device=device, k=2, val_subset=300, population=4,
                           generations=1)
        with pytest.raises(SearchError, match=re.escape(message)):
            search(cfg)
        with pytest.raises(SearchError, match=re.escape(message)):
            Search.from_checkpoint(cfg)
    if not torch.cuda.is_available():
        with pytest.raises(SearchError, match="device: 'cuda' names a CUDA device, and this machine has none"):
            search(SearchConfig(checkpoint=ckpt, output=str(out), device='cuda', k=2, val_subset=300))
    with pytest.raises(TypeError, match=r'on_generation must be a callable taking \(search, row\), got int'):
        search(SearchConfig(checkpoint=ckpt, output=str(out), device='cpu', k=2, val_subset=300, population=4,
                            generations=1), on_generation=5)
    assert not out.exists()


@pytest.mark.parametrize('marker', ['report.md', 'model.safetensors', 'study.json'])
def test_a_search_into_another_commands_folder_is_refused(ckpt, tmp_path, marker):
    """search.py replaced a pipeline's (or a Hub folder's) masks.json and plots without a word; such a folder is
    a usage error before anything is written, as for the pipeline and the study."""
    from test_resume_settings import snapshot
    (tmp_path / marker).write_text('theirs')
    (tmp_path / 'masks.json').write_text('their table')
    before = snapshot(str(tmp_path))
    with pytest.raises(SearchUsageError, match=f'cannot use {re.escape(str(tmp_path))}: it holds the output of '):
        search(parse_config(['--checkpoint', ckpt, '--output', str(tmp_path)] + SMALL))
    assert snapshot(str(tmp_path)) == before


def test_mask_tables_compare_by_value(tmp_path):
    """The dataclass's own == asked a numpy mask for one truth value and raised (so did comparing two
    SearchResults); tables compare field by field, masks element by element."""
    rng = np.random.default_rng(0)
    masks = [rng.random((4, 4)) < 0.5 for _ in range(2)]
    a = MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), dataset_fingerprint('', PATCHSHAPES_CLASSES),
                  [(0, 1), (2, 5)], masks, [0.25, 0.5], 0.375)
    a.save(str(tmp_path / 'masks.json'))
    b = MaskTable.load(str(tmp_path / 'masks.json'))
    assert a == b and not (a != b)
    flipped = [m.copy() for m in masks]
    flipped[1][0, 0] = not flipped[1][0, 0]
    assert a != dataclasses.replace(a, masks=flipped)
    assert a != dataclasses.replace(a, masks=masks[:1], pairs=[(0, 1)], scores=[0.25])
    assert a != dataclasses.replace(a, pairs=[(0, 1), (2, 6)]) and a != dataclasses.replace(a, scores=[0.25, 0.4])
    assert (a == 'masks.json') is False


def _draws():
    import random
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_search_leaves_the_callers_generators_and_a_drawing_callback_changes_nothing(ckpt, tmp_path):
    """search() seeds Python's, NumPy's and torch's global generators (DEAP draws from Python's): the caller gets
    its streams back, and a callback that draws from them does not change the table."""
    import random
    cfg = parse_config(['--checkpoint', ckpt, '--output', str(tmp_path / 'a')] + SMALL + ['--generations', '2'])
    quiet = search(cfg).table.to_json()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    expected = _draws()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    drawn = search(cfg.replace(output=str(tmp_path / 'b')), on_generation=lambda s, row: _draws())
    assert _draws() == expected
    assert drawn.table.to_json() == quiet


def test_which_genes_a_search_keeps_is_named(ckpt, tmp_path, capsys):
    """--fitness min keeps the lowest scores: the hardest genes for patch accuracy (the paper), the easiest for
    patch cross-entropy, where the help said 'min selects the hardest' whatever the score. A search that keeps the
    easiest genes now says so in a note; the paper's and the loss score's 'max' do not."""
    from timm_patchmix.search.config import kept_genes
    assert [kept_genes(f, s) for f, s in (('min', 'accuracy'), ('max', 'accuracy'), ('min', 'loss'),
                                          ('max', 'loss'))] == ['hardest', 'easiest', 'easiest', 'hardest']
    for fitness, score, noted in (('min', 'loss', 'the lowest patch cross-entropy'), ('max', 'loss', None),
                                  ('min', 'accuracy', None), ('max', 'accuracy', 'the highest patch accuracy')):
        out = tmp_path / f'{fitness}_{score}'
        cfg = parse_config(['--checkpoint', ckpt, '--output', str(out)] + SMALL +
                           ['--generations', '1', '--fitness', fitness, '--score', score, '--no-plots'])
        result = search(cfg)
        err = capsys.readouterr().err
        assert ('keeps the easiest genes' in err) == (noted is not None), (fitness, score, err)
        if noted:
            other = 'max' if fitness == 'min' else 'min'
            assert (f'note: --fitness {fitness} with --score {score} keeps the easiest genes ({noted}); '
                    f'--fitness {other} keeps the hardest') in err
        # the table lists the genes it was chosen for first: lowest score first for 'min', highest for 'max'
        scores = result.table.scores
        assert scores == sorted(scores, reverse=fitness == 'max')
    assert "'min' keeps the individuals of lowest mean score" in ' '.join(build_parser().format_help().split())


def test_help_names_every_flag_with_defaults():
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, action.option_strings
    assert '(default: 500)' in text and '(default: output/search)' in text and 'examples:' in text
    assert text.count('--checkpoint') >= 3  # usage, the flag, the examples


def test_bits_and_masks_convert_one_way():
    rng = np.random.default_rng(0)
    for rows, cols in ((1, 1), (4, 4), (3, 5), (7, 8)):
        m = rng.random((6, rows, cols)) < 0.5
        bits = mask_to_bits(m)
        assert bits.dtype == np.int64 and bits.tolist() == [mask_to_bits(x) for x in m]
        assert np.array_equal(bits_to_mask(bits, rows, cols), m)
        assert torch.equal(bits_to_mask(torch.from_numpy(bits), rows, cols), torch.from_numpy(m))
        assert all(np.array_equal(bits_to_grid(int(b), rows, cols), x) for b, x in zip(bits, m))
    big = np.ones((8, 8), dtype=bool)  # one mask wider than int64 still converts
    assert mask_to_bits(big) == (1 << 64) - 1 and bits_to_mask((1 << 64) - 1, 8, 8).all()


# --- resume and distributed ------------------------------------------------------------------------------------
def run_cli(args, env=None, torchrun=False):
    cmd = ([os.path.join(os.path.dirname(sys.executable), 'torchrun'), '--standalone', '--nproc_per_node', '2']
           if torchrun else [sys.executable]) + ['search.py'] + args
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1', **(env or {})))


# search.py's flags, SIGKILLed by the search's per-generation callback once generation argv[1] is checkpointed
KILL_AT = """
import os, signal, sys
import timm_patchmix
from timm_patchmix.search import parse_config, search
at = int(sys.argv[1])

def kill(s, row):
    if row['gen'] >= at:
        os.kill(os.getpid(), signal.SIGKILL)
search(parse_config(sys.argv[2:]), on_generation=kill)
"""


@pytest.mark.slow
def test_resume_after_kill_gives_identical_table(ckpt, tmp_path):
    base = ['--checkpoint', ckpt] + SMALL + ['--generations', '6']
    full = run_cli(base + ['--output', str(tmp_path / 'full')])
    assert full.returncode == 0, full.stderr[-2000:]
    killed = subprocess.run([sys.executable, '-c', KILL_AT, '3'] + base + ['--output', str(tmp_path / 'killed')],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'))
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert 'gen 3:' in killed.stdout and 'gen 4:' not in killed.stdout
    assert not (tmp_path / 'killed' / 'masks.json').exists()
    resumed = run_cli(base + ['--output', str(tmp_path / 'killed'), '--resume'])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (tmp_path / 'full' / 'masks.json').read_bytes() == (tmp_path / 'killed' / 'masks.json').read_bytes()
    assert (tmp_path / 'full' / 'logbook.csv').read_text().count('\n') == 8  # header + generations 0..6


@pytest.mark.slow
def test_two_gloo_processes_match_one(ckpt, tmp_path):
    base = ['--checkpoint', ckpt] + SMALL
    one = run_cli(base + ['--output', str(tmp_path / 'one')])
    assert one.returncode == 0, one.stderr[-2000:]
    two = run_cli(base + ['--output', str(tmp_path / 'two')], torchrun=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / 'one' / 'masks.json').read_bytes() == (tmp_path / 'two' / 'masks.json').read_bytes()


# --- errors ----------------------------------------------------------------------------------------------------
def test_errors(ckpt, tmp_path):
    def err(extra, message, checkpoint=ckpt):
        with pytest.raises(SystemExit, match=message):
            search_main(['--checkpoint', checkpoint, '--output', str(tmp_path / 'e')] + SMALL + extra)
    plain = make_checkpoint(str(tmp_path / 'plain.safetensors'), model='resnet32_cifar')
    err([], 'has no patch head', plain)
    # a patch head that never trained (--no-patch-loss, as the pipeline's f_O): its scores would mean nothing
    from timm_patchmix.checkpoint import load_weights
    state, meta = load_weights(ckpt)
    untrained = str(tmp_path / 'untrained.safetensors')
    save_weights(untrained, state, dict(meta, patchmix={'enabled': True, 'grid': [4, 4], 'table': None,
                                                        'image_loss': True, 'patch_loss': False}))
    err([], r'untrained\.safetensors was trained without the patch loss \(--no-patch-loss, or --patch-loss-weight '
            r'0\): its patch head never trained', untrained)
    err(['--grid', '2'], r'--grid 2x2 differs from the 4x4 grid')
    err(['--num-classes', '7'], '--num-classes 7 differs from the 10 classes')
    err(['--n-active', '46'], 'N=46 active pairs, but 10 classes have only 45 pairs')
    # named by the class's name and the split the genes are scored on, with what gives more images
    err(['--k', '31'], r"class '\w+' has \d+ images in split 'validation', fewer than the 31 that K=31 needs; lower "
                       r"--k or score the genes on a larger split \(--val-split\)")
    # a dataset of other classes: named as the model's, not as a training split's
    err(['--dataset', 'sklearn_digits'],
        r"sklearn_digits has the classes \['0', .*; the model in .*ft\.safetensors has \['disc', .*are not among them")
    corrupt = tmp_path / 'corrupt.safetensors'
    corrupt.write_bytes(open(ckpt, 'rb').read()[:5000])
    err([], 'not a readable safetensors file', str(corrupt))
    out = tmp_path / 'r'
    out.mkdir()
    (out / 'search_state.safetensors').write_bytes(b'\x00' * 100)
    with pytest.raises(SystemExit, match='cannot resume the search'):
        search_main(['--checkpoint', ckpt, '--output', str(out), '--resume'] + SMALL)
    # a checkpoint of other class names on the embedded data: the split is named by its dataset
    from timm_patchmix.checkpoint import load_weights
    state, meta = load_weights(ckpt)
    other = str(tmp_path / 'other.safetensors')
    save_weights(other, state, dict(meta, class_names=[f'c{i}' for i in range(10)]))
    err([], r"the split 'validation' of patchshapes has the classes \['disc', .*; the model in .*other\.safetensors "
            r"has \['c0'", other)


def test_a_resume_keeps_what_the_cached_scores_were_computed_with(ckpt, tmp_path):
    """--channels-last, --amp and the device change the gene scores' rounding (AMP far more): a resume that changed
    them filled one cache with scores of two kinds, and the table recorded the last invocation's flags."""
    out = str(tmp_path / 's')
    args = ['--checkpoint', ckpt, '--output', out] + SMALL
    search_main(args + ['--generations', '1'])
    with pytest.raises(SettingsChangedError, match=r'--channels-last: False before, True now'):
        search_main(args + ['--resume', '--channels-last'])
    from timm_patchmix.checkpoint import load_bundle
    _, meta = load_bundle(os.path.join(out, 'search_state.safetensors'), 'search_state')
    settings = meta['settings']
    assert (settings['--device'], settings['--amp'], settings['--channels-last']) == ('cpu', False, False)
    assert search_main(args + ['--resume']).search_args['generations'] == 4  # the same flags resume


# --- mask table ------------------------------------------------------------------------------------------------
def test_mask_table_round_trip_and_validation(tmp_path):
    from timm_patchmix import guided
    assert (guided.MaskTable, guided.MaskTableError, guided.dataset_fingerprint) == \
        (MaskTable, MaskTableError, dataset_fingerprint), 'the guided mixer reads the one table type'
    fp = dataset_fingerprint('', PATCHSHAPES_CLASSES)
    t = MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), fp, [(0, 3), (2, 5)],
                  [np.eye(4, dtype=bool), ~np.eye(4, dtype=bool)], [0.1, 0.2], 0.15, {'seed': 1})
    path = str(tmp_path / 'masks.json')
    t.save(path)
    back = MaskTable.load(path, grid=(4, 4), num_classes=10, fingerprint=fp)
    assert back.pairs == t.pairs and all(np.array_equal(a, b) for a, b in zip(back.masks, t.masks))
    with pytest.raises(MaskTableError, match='4x4 grid, this run uses 2x2'):
        MaskTable.load(path, grid=(2, 2))
    with pytest.raises(MaskTableError, match='for 10 classes, this run has 100'):
        MaskTable.load(path, num_classes=100)
    with pytest.raises(MaskTableError, match='another dataset'):
        MaskTable.load(path, fingerprint=dataset_fingerprint('fashion_mnist', PATCHSHAPES_CLASSES))
    doc = json.load(open(path))
    doc['schema_version'] = 99
    json.dump(doc, open(path, 'w'))
    with pytest.raises(MaskTableError, match='schema version 99'):
        MaskTable.load(path)
    open(path, 'w').write('{"schema_version": 1, "grid": [4, 4')
    with pytest.raises(MaskTableError, match='not valid JSON'):
        MaskTable.load(path)


def test_each_rank_takes_its_gpu_also_where_a_group_is_up(monkeypatch, ckpt):
    """A second search.py main() in one torchrun process (the group the first started still up) got no device and
    ran every rank on the current GPU, cuda:0; now LOCAL_RANK's, as train() takes it, unless --device names one.
    (CUDA and the group stood in for: what is checked is the device chosen and set.)"""
    import torch.distributed as dist
    from timm_patchmix.search import command
    set_to = []
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'set_device', set_to.append)
    monkeypatch.setattr(dist, 'is_initialized', lambda: True)
    monkeypatch.setenv('LOCAL_RANK', '1')
    monkeypatch.setenv('WORLD_SIZE', '2')
    cfg = parse_config(['--checkpoint', ckpt])
    assert command._distributed(cfg).device == 'cuda:1' and set_to == ['cuda:1']
    assert command._distributed(cfg.replace(device='cuda')).device == 'cuda:1'
    assert command._distributed(cfg.replace(device='cuda:0')).device == 'cuda:0'  # named: kept
    assert command._distributed(cfg.replace(device='cpu')).device == 'cpu'


def test_a_folder_split_named_another_way_is_still_the_test_split(tmp_path, caplog):
    """The guard that keeps the search off the test split of a checkpoint trained with --holdout compared split
    names as strings: for a dataset in a folder, `--val-split validation/` (or ./validation) scored the genes on the
    test split, and `train/` on the training split without the warning that `train` gives."""
    from types import SimpleNamespace
    from timm_patchmix.search.inputs import SearchUsageError, _scored_note, _scored_split
    for split in ('train', 'validation'):
        os.makedirs(tmp_path / 'data' / split / 'c0')
    data_dir = str(tmp_path / 'data')
    data = {'holdout': {'fraction': 0.5}, 'val_split': 'validation', 'train_split': 'train'}
    for name in ('validation', 'validation/', './validation', 'validation//', os.path.join('..', 'data', 'validation')):
        with pytest.raises(SearchUsageError, match=f'--val-split {re.escape(name)}: .* the search must not see the '
                                                   'test split'):
            _scored_split(SimpleNamespace(val_split=name, checkpoint='ft.safetensors'), data, '', data_dir)
    cfg = SimpleNamespace(val_split='train/', checkpoint='ft.safetensors')
    assert _scored_split(cfg, data, '', data_dir) == 'train/'
    with caplog.at_level('WARNING'):
        note = _scored_note(cfg, data, '', data_dir, 'train/')
    assert note.startswith('the split the checkpoint trained on') and 'whose accuracy its training flatters' in \
        caplog.text
    assert _scored_note(SimpleNamespace(val_split='other', checkpoint='ft.safetensors'), data, '', data_dir,
                        'other') is None


def test_a_two_class_search_runs_with_the_default_number_of_active_pairs():
    """N defaulted to the number of classes, more than the one pair 2 classes have: the search failed, telling the
    user to lower an --n-active they never gave. The default is at most the number of pairs now."""
    space, scorer = tiny_scorer(classes=2)
    s = Search(space, 4, scorer, Evolution(population=4, generations=1, patience=0, seed=0))
    assert s.n_active == 1 and len(s.run().pairs) == 1
    with pytest.raises(SearchError, match='N=2 active pairs, but 2 classes have only 1 pairs; lower --n-active'):
        Search(space, 4, scorer, Evolution(population=4, generations=1, patience=0, seed=0, n_active=2))
    one_space, one = tiny_scorer(classes=1)
    with pytest.raises(SearchError, match='1 class has no pair of classes to search masks for'):
        Search(one_space, 4, one, Evolution(population=4, generations=1, patience=0, seed=0))


def test_the_scored_images_come_with_the_labels_the_genes_are_scored_against(tmp_path):
    """The search reads labels from the image folder's file list and took only the image of each item; timm's image
    dataset answers a file it cannot open with the next item, so another class's image was scored under this
    file's label, silently. It is a SearchError naming the file; readable files give their own pixels."""
    from PIL import Image
    from timm_patchmix.data import build_dataset, view_labels
    from timm_patchmix.search.inputs import ValidationData
    for c, colour in (('a', (200, 0, 0)), ('b', (0, 200, 0))):
        os.makedirs(tmp_path / 'data' / 'validation' / c)
        for i in range(2):
            Image.new('RGB', (4, 4), colour).save(tmp_path / 'data' / 'validation' / c / f'{i}.png')
    meta = {'input_size': (3, 4, 4), 'mean': (0.0,) * 3, 'std': (1.0,) * 3, 'interpolation': 'bilinear',
            'crop_pct': 1.0}

    def scored():
        ds = build_dataset('', str(tmp_path / 'data'), 'validation')
        return ValidationData('', str(tmp_path / 'data'), 'validation', ['a', 'b'], np.array(view_labels(ds)), ds,
                              meta)
    x = scored().images('cpu')
    assert torch.equal(x[:, 0, 0, 0], torch.tensor([200, 200, 0, 0]) / 255)  # a, a, b, b
    (tmp_path / 'data' / 'validation' / 'a' / '1.png').write_text('not an image')
    data = scored()
    assert data.labels.tolist() == [0, 0, 1, 1]
    with pytest.raises(SearchError, match=r"^the validation images of .*data: .*validation/a/1\.png \(class 0\) could "
                                          r"not be read as an image: the dataset gave another class's image \(1\)"):
        data.images('cpu')
