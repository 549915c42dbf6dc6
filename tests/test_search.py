"""The evolutionary search: operators, exact memoised fitness, resume, DDP equality, errors, the mask table."""
import json
import os
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
from timm_patchmix.guided import MaskTable, MaskTableError, dataset_fingerprint
from timm_patchmix.search.genome import MaskOps, Operators, PairSpace, bits_to_grid, fitness_class, grid_to_bits
from timm_patchmix.search.loop import KILL_ENV, Search, build_parser, main as search_main

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
    args = build_parser().parse_args(['--checkpoint', ckpt, '--output', str(tmp_path)] + SMALL)
    search = Search(args)
    table = search.run()
    assert search.scorer.forward_images < sum(r['gene_lookups'] for r in search.logbook) * args.k
    for ind in search.population + list(search.hof):
        assert search.evaluate_direct(ind) == ind.fitness.values[0]
    # the table's scores are the cached gene scores of the best individual, its fitness their mean
    assert table.best_fitness == search.hof[0].fitness.values[0]
    assert np.isclose(np.mean(table.scores), table.best_fitness, rtol=0, atol=1e-12)
    assert len(table.pairs) == 10 and all(m.shape == (4, 4) for m in table.masks)


def test_gene_score_counts_patches_by_hand(ckpt, tmp_path):
    args = build_parser().parse_args(['--checkpoint', ckpt, '--output', str(tmp_path)] + SMALL)
    search = Search(args)
    scorer = search.scorer
    p, mask = 7, grid_to_bits(np.eye(4, dtype=bool))
    ci, cj = search.space.pairs[p]
    correct = 0
    for k in range(args.k):
        a, b = scorer.images[scorer.a_idx[p, k]], scorer.images[scorer.b_idx[p, k]]
        x = b.clone()
        for r in range(4):  # 32x32 image, 8x8 cells on the diagonal from image a
            x[:, r * 8:(r + 1) * 8, r * 8:(r + 1) * 8] = a[:, r * 8:(r + 1) * 8, r * 8:(r + 1) * 8]
        with torch.no_grad():
            pred = search.scorer.model.forward_patches(x[None])[0].argmax(-1)
        labels = torch.tensor([ci if r == c else cj for r in range(4) for c in range(4)])
        correct += int((pred == labels).sum())
    assert scorer.score_genes(np.array([p]), np.array([mask]))[0] == correct / (args.k * 16)


# --- resume and distributed ------------------------------------------------------------------------------------
def run_cli(args, env=None, torchrun=False):
    cmd = ([os.path.join(os.path.dirname(sys.executable), 'torchrun'), '--standalone', '--nproc_per_node', '2']
           if torchrun else [sys.executable]) + ['search.py'] + args
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1', **(env or {})))


def test_resume_after_kill_gives_identical_table(ckpt, tmp_path):
    base = ['--checkpoint', ckpt] + SMALL + ['--generations', '6']
    full = run_cli(base + ['--output', str(tmp_path / 'full')])
    assert full.returncode == 0, full.stderr[-2000:]
    killed = run_cli(base + ['--output', str(tmp_path / 'killed')], env={KILL_ENV: '3'})
    assert killed.returncode == -9
    assert not (tmp_path / 'killed' / 'masks.json').exists()
    resumed = run_cli(base + ['--output', str(tmp_path / 'killed'), '--resume'])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (tmp_path / 'full' / 'masks.json').read_bytes() == (tmp_path / 'killed' / 'masks.json').read_bytes()
    assert (tmp_path / 'full' / 'logbook.csv').read_text().count('\n') == 8  # header + generations 0..6


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
    err(['--grid', '2'], r'--grid 2x2 differs from the 4x4 grid')
    err(['--num-classes', '7'], '--num-classes 7 differs from the 10 classes')
    err(['--n-active', '46'], 'N=46 active pairs, but 10 classes have only 45 pairs')
    err(['--k', '31'], 'fewer than the 31 that K=31 needs')
    corrupt = tmp_path / 'corrupt.safetensors'
    corrupt.write_bytes(open(ckpt, 'rb').read()[:5000])
    err([], 'not a readable safetensors file', str(corrupt))
    out = tmp_path / 'r'
    out.mkdir()
    (out / 'search_state.safetensors').write_bytes(b'\x00' * 100)
    with pytest.raises(SystemExit, match='cannot resume the search'):
        search_main(['--checkpoint', ckpt, '--output', str(out), '--resume'] + SMALL)


# --- mask table ------------------------------------------------------------------------------------------------
def test_mask_table_round_trip_and_validation(tmp_path):
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
