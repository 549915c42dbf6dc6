"""The held-out validation split (issue #14): exact index sets, what each loader of a run sees, the test split
evaluated once at the end, the search scoring the held-out images, the errors, the resume refusal and the pipeline's
report of its splits."""
import argparse
import collections
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from hypothesis import given, settings, strategies as st

import timm_patchmix  # noqa: F401
from timm_patchmix.checkpoint import load_weights, save_weights
from timm_patchmix.data import PATCHSHAPES_CLASSES, PatchShapes, subset_indices
from timm_patchmix.engine import TrainConfig, train
from timm_patchmix.engine import run as run_module
from timm_patchmix.engine.loaders import build_datasets
from timm_patchmix.holdout import Holdout, HoldoutError, holdout_size, index_hash
from timm_patchmix.settings import SettingsChangedError
from timm_patchmix.train import main as train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))
MEAN, STD = [0.4914, 0.4822, 0.4465], [0.247, 0.2435, 0.2616]
N_TRAIN = 5000  # patchshapes' training split


@pytest.fixture(scope='module')
def base():
    return PatchShapes('train')


# --- the index sets ---------------------------------------------------------------------------------------------
def test_carve_exact_sets():
    h = Holdout.carve(N_TRAIN, 0.1, 0)
    held, rest = set(h.held), set(h.rest)
    assert len(h.held) == len(held) == 500 and len(h.rest) == len(rest) == 4500
    assert not held & rest and held | rest == set(range(N_TRAIN))
    assert list(h.held) == sorted(h.held) and list(h.rest) == sorted(h.rest)
    assert Holdout.carve(N_TRAIN, 0.1, 0) == h                      # deterministic
    other = Holdout.carve(N_TRAIN, 0.1, 1)
    assert len(set(other.held) & held) < 100                          # another seed, other images (~50 in common)
    assert h.record() == {'fraction': 0.1, 'seed': 0, 'split': 'train', 'split_images': 5000, 'images': 500,
                          'sha256': index_hash(h.held)}
    assert index_hash(reversed(h.held)) == h.sha256 != other.sha256  # a set's hash, whatever the order
    # the same images whatever the global seeds say
    for s in (0, 123):
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)
        assert Holdout.carve(N_TRAIN, 0.1, 0).held == h.held
    # the same images in another process
    code = ('from timm_patchmix.holdout import Holdout; import numpy, torch; numpy.random.seed(7); '
            'torch.manual_seed(7); print(Holdout.carve(5000, 0.1, 0).sha256)')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=PYPATH))
    assert out.stdout.strip() == h.sha256, out.stderr[-1000:]
    # a subset of the held-out images is nested in a larger one (one permutation, cut shorter)
    small, large = h.subsets(val_subset=40)[1], h.subsets(val_subset=300)[1]
    assert set(small) < set(large) < held and len(small) == 40 and len(large) == 300


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 3000), fraction=st.floats(0.001, 0.999), seed=st.integers(0, 2 ** 31),
       train_subset=st.one_of(st.none(), st.integers(1, 3000)))
def test_carve_properties(n, fraction, seed, train_subset):
    k = holdout_size(n, fraction)
    if not 1 <= k < n:
        with pytest.raises(HoldoutError, match='holds out no image|leaves no image'):
            Holdout.carve(n, fraction, seed)
        return
    h = Holdout.carve(n, fraction, seed)
    assert len(h.held) == k == int(np.floor(fraction * n + 0.5)) and len(h.rest) == n - k
    assert not set(h.held) & set(h.rest) and sorted(h.held + h.rest) == list(range(n))
    train_idx, val_idx = h.subsets(train_subset)
    assert val_idx == list(h.held)  # --train-subset never moves the held-out images
    assert set(train_idx) <= set(h.rest) and len(train_idx) == min(train_subset or n, n - k)
    assert Holdout.from_record(h.record(), n) == h


def test_holdout_record_mismatch_is_an_error():
    rec = Holdout.carve(N_TRAIN, 0.1, 0).record()
    with pytest.raises(HoldoutError, match='it has 4999 now'):
        Holdout.from_record(rec, 4999)
    with pytest.raises(HoldoutError, match='are not those'):
        Holdout.from_record(dict(rec, sha256='0' * 64), N_TRAIN)


def test_run_datasets_are_the_carved_sets(base):
    """The index sets a run trains and evaluates on (build_datasets): the held-out images never train, do not move
    with --train-subset or the global seed, --val-subset caps them, and --val-split becomes the test split."""
    h = Holdout.carve(N_TRAIN, 0.1, 5)
    views = {}
    for train_subset, seed in ((None, 0), (64, 1), (1024, 2)):
        torch.manual_seed(seed)
        np.random.seed(seed)
        data = build_datasets(TrainConfig(holdout=0.1, holdout_seed=5, train_subset=train_subset, seed=seed))
        views[train_subset] = data
        assert data.val.indices == list(h.held)
        assert data.train.base is data.val.base and data.train.base.split == 'train'
        assert not set(data.train.indices) & set(data.val.indices)
        assert set(data.train.indices) <= set(h.rest)
        assert len(data.train) == (train_subset or 4500)
        assert data.test.base.split == 'validation' and len(data.test) == 1000
        assert data.holdout == h.record()
    assert views[64].train.indices == subset_indices(h.rest, 64)
    capped = build_datasets(TrainConfig(holdout=0.1, holdout_seed=5, val_subset=50, test_subset=30))
    assert capped.val.indices == subset_indices(h.held, 50) and len(capped.test) == 30
    # no holdout: today's datasets, the validation split evaluated every epoch, no test split
    old = build_datasets(TrainConfig(train_subset=64, val_subset=50))
    assert old.test is None and old.holdout is None and old.val.base.split == 'validation'
    assert old.train.indices == subset_indices(range(N_TRAIN), 64)


def _raw(img):
    return np.asarray(img)


def test_held_out_images_are_the_same_in_loader_workers(base):
    data = build_datasets(TrainConfig(holdout=0.1, val_subset=64))
    data.val.transform = _raw
    loader = torch.utils.data.DataLoader(data.val, batch_size=16, num_workers=2)
    xs, ys = zip(*loader)
    idx = data.val.indices
    assert torch.equal(torch.cat(xs), torch.from_numpy(base.images[idx]))
    assert torch.cat(ys).tolist() == [base.targets[i] for i in idx]


# --- a run: what each split's loader saw ------------------------------------------------------------------------
def test_best_epoch_reads_the_holdout_and_the_test_split_is_seen_at_the_end(tmp_path, monkeypatch, base):
    """Two epochs; the held-out score is made to peak at epoch 0, so the best weights (epoch 0) differ from the
    final ones (epoch 1). Every epoch evaluates exactly the held-out images; the test split is evaluated twice, both
    after the last epoch: the final weights, then the best epoch's."""
    calls, trained = [], []
    real_validate, real_epoch = run_module.validate, run_module.train_one_epoch

    def spy_epoch(s, loader, epoch, rt, on_step=None):
        trained.append(list(loader.dataset.indices))
        return real_epoch(s, loader, epoch, rt, on_step)

    def spy_validate(model, loader, cfg, device, autocast=None):
        ds = loader.dataset
        labels = torch.cat([y for _, y in loader]).tolist()  # what the loader hands out
        weights = float(sum(p.detach().double().sum() for p in model.parameters()))
        kind = 'val' if ds.base.split == 'train' else 'test'
        calls.append({'kind': kind, 'indices': list(ds.indices), 'labels': labels, 'weights': weights,
                      'after_epochs': len(trained)})
        ev = real_validate(model, loader, cfg, device, autocast)
        if kind == 'val':  # epoch 0 scores best on the held-out images
            ev = dict(ev, eval_top1=100.0 - 50 * (len(trained) - 1))
        return ev

    monkeypatch.setattr(run_module, 'validate', spy_validate)
    monkeypatch.setattr(run_module, 'train_one_epoch', spy_epoch)
    cfg = TrainConfig(model='patchhead_resnet32_cifar', patchmix=True, holdout=0.1, holdout_seed=2, train_subset=32,
                      val_subset=24, test_subset=30, batch_size=16, workers=0, epochs=2, no_progress=True,
                      device='cpu', log_interval=1000, output=str(tmp_path), experiment='run', fgsm=(0.1,))
    res = train(cfg)
    h = Holdout.carve(N_TRAIN, 0.1, 2)
    train_idx, val_idx = h.subsets(32, 24)
    test = PatchShapes('validation')
    test_idx = subset_indices(range(1000), 30)
    assert [c['kind'] for c in calls] == ['val', 'val', 'test', 'test']
    assert [c['after_epochs'] for c in calls] == [1, 2, 2, 2]
    assert trained == [train_idx, train_idx] and not set(train_idx) & set(h.held)
    for c in calls[:2]:
        assert c['indices'] == val_idx and len(c['labels']) == 24
        assert collections.Counter(c['labels']) == collections.Counter(base.targets[i] for i in val_idx)
    for c in calls[2:]:
        assert c['indices'] == test_idx and c['labels'] == [test.targets[i] for i in test_idx]
    # the final weights, then the best epoch's (epoch 0's, loaded from best.safetensors)
    assert calls[2]['weights'] == calls[1]['weights'] != calls[0]['weights'] == calls[3]['weights']
    assert res.best['epoch'] == 0 and [r['eval_top1'] for r in res.rows] == [100.0, 50.0]
    assert res.test['final']['epoch'] == 1 and res.test['best']['epoch'] == 0
    assert res.final_test_top1 == res.test['final']['test_top1'] and res.best_test_top1 == res.test['best']['test_top1']
    assert res.splits == {'selection': 'holdout', 'test': 'validation', 'holdout': h.record(), 'train_images': 32,
                          'val_images': 24, 'test_images': 30}
    assert set(res.fgsm) == {0.0, 0.1}  # on the test split, with the final weights, before the best were loaded
    doc = json.load(open(tmp_path / 'run' / 'results.json'))
    assert doc['test'] == {'split': 'validation', 'images': 30, 'final': res.test['final'], 'best': res.test['best']}
    assert doc['selection'] == {'split': 'holdout', 'metric': 'top1', 'best_epoch': 0, 'holdout': h.record(),
                                'images': 24}
    _, meta = load_weights(str(tmp_path / 'run' / 'best.safetensors'))
    assert meta['epoch'] == 0 and meta['data']['holdout'] == h.record() and meta['data']['train_split'] == 'train'
    summary = (tmp_path / 'run' / 'summary.csv').read_text().splitlines()
    assert len(summary) == 3 and 'test' not in summary[0]  # one row per epoch, held-out numbers only


def test_no_holdout_run_is_unchanged(tmp_path):
    res = train(TrainConfig(holdout=0.0, train_subset=32, val_subset=16, batch_size=16, workers=0, epochs=1,
                            no_progress=True, device='cpu', output=str(tmp_path), experiment='old'))
    assert res.test is None and res.final_test_top1 is None and res.splits['selection'] == 'validation'
    assert not (tmp_path / 'old' / 'results.json').exists()
    _, meta = load_weights(str(tmp_path / 'old' / 'last.safetensors'))
    assert meta['data']['holdout'] is None and meta['data']['val_split'] == 'validation'


TINY = ['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress', '--device', 'cpu',
        '--log-interval', '1000']


@pytest.mark.parametrize('flags, message', [
    (['--holdout', '1'], r'argument --holdout: must be a finite number in \[0, 1\)'),
    (['--holdout', '0.00005'], 'holds out no image; raise --holdout'),
    (['--holdout', '0.99999999'], r'--holdout 0\.99999999 of the \d+ images .* leaves no image'),  # (was '1')
    (['--holdout', '0.1', '--val-split', 'train'], 'names the test split'),
    (['--test-subset', '5'], '--test-subset caps the test split of a run with --holdout'),
])
def test_train_holdout_usage_errors(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as info:
        train_main(TINY + ['--epochs', '1', '--output', str(tmp_path)] + flags)
    assert info.value.code == 2
    import re
    assert re.search(message, capsys.readouterr().err)
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_resume_with_another_holdout_is_refused(tmp_path):
    train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'h', '--holdout', '0.1',
                       '--test-subset', '20'])
    state = str(tmp_path / 'h' / 'state.safetensors')
    before = {f: (tmp_path / 'h' / f).read_bytes() for f in os.listdir(tmp_path / 'h')}
    for change, expect in ((['--holdout', '0.2'], '--holdout: 0.1 before, 0.2 now'),
                           (['--holdout', '0.1', '--holdout-seed', '1'], '--holdout-seed: 0 before, 1 now'),
                           ([], '--holdout: 0.1 before, 0.0 now')):
        with pytest.raises(SettingsChangedError) as info:
            train_main(TINY + ['--epochs', '2', '--output', str(tmp_path), '--experiment', 'h', '--resume', state]
                       + change)
        assert expect in str(info.value)
    assert {f: (tmp_path / 'h' / f).read_bytes() for f in os.listdir(tmp_path / 'h')} == before
    res = train_main(TINY + ['--epochs', '2', '--output', str(tmp_path), '--experiment', 'h', '--resume', state,
                             '--holdout', '0.1', '--test-subset', '20'])
    assert len(res['rows']) == 2 and res['test']['final']['epoch'] == 1


# train.py under torchrun with the held-out score made to peak at epoch 0, as in the test above
DDP_DRIVER = '''
import sys
from timm_patchmix.engine import run as r
real, seen = r.validate, []
def fake(model, loader, cfg, device, autocast=None):
    ev = real(model, loader, cfg, device, autocast)
    if loader.dataset.base.split == 'train':
        seen.append(1)
        ev = dict(ev, eval_top1=100.0 - 50 * (len(seen) - 1))
    return ev
r.validate = fake
from timm_patchmix.train import cli
sys.exit(cli(sys.argv[1:]))
'''


@pytest.mark.slow
def test_two_process_ddp_evaluates_the_test_split_once_per_weights(tmp_path):
    """Under DDP every rank loads best.safetensors after rank 0 wrote it, and each test image counts once."""
    driver = tmp_path / 'driver.py'
    driver.write_text(DDP_DRIVER)
    torchrun = os.path.join(os.path.dirname(sys.executable), 'torchrun')
    cmd = [torchrun, '--standalone', '--nproc_per_node', '2', str(driver), *TINY, '--epochs', '2', '--holdout', '0.1',
           '--test-subset', '30', '--output', str(tmp_path), '--experiment', 'ddp']
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.load(open(tmp_path / 'ddp' / 'results.json'))
    assert doc['selection']['best_epoch'] == 0 and doc['test']['images'] == 30
    assert doc['test']['final']['epoch'] == 1 and doc['test']['best']['epoch'] == 0
    for which in ('final', 'best'):
        top1 = doc['test'][which]['test_top1']  # rounded to 4 decimals
        assert top1 * 30 / 100 == pytest.approx(round(top1 * 30 / 100), abs=1e-3)
    assert proc.stdout.count("test split 'validation'") == 1, 'only rank 0 reports'


# --- the search ---------------------------------------------------------------------------------------------------
def make_checkpoint(path, holdout=None):
    torch.manual_seed(0)
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=10, grid=[4, 4])
    data = {'dataset': '', 'data_dir': '', 'train_split': 'train', 'val_split': 'validation', 'holdout': holdout,
            'input_size': [3, 32, 32], 'mean': MEAN, 'std': STD}
    save_weights(str(path), m.state_dict(), {'model': 'patchhead_resnet32_cifar', 'num_classes': 10,
                                             'model_kwargs': {'grid': [4, 4]},
                                             'class_names': list(PATCHSHAPES_CLASSES), 'data': data})
    return str(path)


SEARCH = ['--population', '4', '--generations', '1', '--k', '2', '--no-progress', '--no-plots', '--device', 'cpu']


def test_search_scores_the_held_out_images(tmp_path, base):
    from timm_patchmix.search import Search, SearchConfig, search
    from timm_patchmix.search.inputs import load_model, load_validation
    h = Holdout.carve(N_TRAIN, 0.1, 3)
    ckpt = make_checkpoint(tmp_path / 'ft.safetensors', h.record())
    cfg = SearchConfig(checkpoint=ckpt, output=str(tmp_path / 's'), val_subset=50, population=4, generations=1, k=2,
                       device='cpu', progress=False, plots=False)
    model, meta = load_model(cfg)
    data = load_validation(cfg, model, meta)
    want = h.subsets(val_subset=50)[1]  # the images train.py --val-subset 50 evaluates each epoch
    assert data.split == 'holdout' and data.indices == want and set(want) < set(h.held)
    assert data.ds.base.split == 'train' and data.labels.tolist() == [base.targets[i] for i in want]
    whole = load_validation(cfg.replace(val_subset=None), model, meta)
    assert whole.indices == list(h.held)
    s = Search.from_checkpoint(cfg)
    expect = torch.from_numpy(base.images[want]).permute(0, 3, 1, 2).float() / 255
    expect = (expect - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.allclose(s.scorer.images, expect, atol=1e-6)
    res = search(cfg)
    scored = res.table.search_args['scored_on']
    assert scored == {'split': 'holdout', 'dataset': '', 'images': 50, 'sha256': index_hash(want),
                      'holdout': h.record()}
    assert json.load(open(res.table_path))['search_args']['scored_on'] == scored


def test_search_split_errors(tmp_path, capsys, caplog):
    from timm_patchmix.search import SearchConfig, main as search_main
    from timm_patchmix.search.inputs import load_model, load_validation
    plain = make_checkpoint(tmp_path / 'plain.safetensors')
    held = make_checkpoint(tmp_path / 'held.safetensors', Holdout.carve(N_TRAIN, 0.1, 0).record())
    for ckpt, split, message in ((plain, 'holdout', 'was trained without --holdout'),
                                 (held, 'validation', 'the search must not see the test split'),
                                 (held, 'test', 'the search must not see the test split')):
        with pytest.raises(SystemExit) as info:
            search_main(['--checkpoint', ckpt, '--output', str(tmp_path / 'x'), '--val-split', split] + SEARCH)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and f'--val-split {split}' in err
    assert not (tmp_path / 'x').exists()
    # a checkpoint whose held-out images cannot be found again: a search that cannot run (exit 1)
    bad = make_checkpoint(tmp_path / 'bad.safetensors', dict(Holdout.carve(N_TRAIN, 0.1, 0).record(), seed=1))
    with pytest.raises(SystemExit, match='are not those'):
        search_main(['--checkpoint', bad, '--output', str(tmp_path / 'y')] + SEARCH)
    # without a holdout the search keeps the checkpoint's validation split, with a warning
    cfg = SearchConfig(checkpoint=plain, output=str(tmp_path / 'z'))
    model, meta = load_model(cfg)
    with caplog.at_level('WARNING'):
        data = load_validation(cfg, model, meta)
    assert data.split == 'validation' and data.ds.base.split == 'validation'
    assert 'trained without --holdout' in caplog.text
    assert data.record()['note'] == ("the checkpoint was trained without --holdout: these are its evaluation split's "
                                     "images, the split it was also evaluated on")
    # the training split itself may be named (it is not the test split), with a warning, and the record says what
    # it is: it said 'trained without --holdout: its evaluation split' of every split but the holdout
    for hold, extra in (({'fraction': 0.1, 'seed': 0}, ' and its held-out ones'), (None, '')):
        caplog.clear()
        with caplog.at_level('WARNING'):
            data = load_validation(cfg.replace(checkpoint=held, val_split='train', val_subset=20), model,
                                   meta={'data': dict(meta['data'], holdout=hold)})
        assert data.split == 'train' and 'scoring the genes on the split that' in caplog.text
        assert data.record()['note'] == f'the split the checkpoint trained on: its training images among them{extra}'


# --- the pipeline ---------------------------------------------------------------------------------------------
def _args(**kw):
    d = dict(dataset='', data_dir='', model='resnet32_cifar', budget='smoke', seeds=[0],
             methods=['base', 'random_pm', 'guided_pm'], output='', train_args=[], holdout=0.1, holdout_seed=0,
             final_loss='image')
    d.update(kw)
    return argparse.Namespace(**d)


def _runs(holdout=True):
    rec = Holdout.carve(N_TRAIN, 0.1, 0).record()
    splits = ({'selection': 'holdout', 'test': 'validation', 'holdout': rec, 'train_images': 1024,
               'val_images': 300, 'test_images': 1000} if holdout else
              {'selection': 'validation', 'test': None, 'holdout': None, 'train_images': 1024, 'val_images': 300,
               'test_images': 0})
    out = []
    for m, v in (('base', 50.0), ('random_pm', 55.0), ('guided_pm', 60.0)):
        r = {'method': m, 'seed': 0, 'final_top1': v, 'best_top1': v, 'epochs': 2, 'splits': splits,
             'split': 'test' if holdout else 'validation'}
        if m == 'guided_pm':
            r['search_scored_on'] = {'split': 'holdout' if holdout else 'validation', 'images': 300}
        out.append(r)
    return out


def test_pipeline_report_states_the_splits_and_losses(tmp_path):
    from timm_patchmix.pipeline import report
    text = report(_args(output=str(tmp_path)), _runs())
    rep = json.load(open(tmp_path / 'report.json'))
    sp = rep['splits']
    assert sp['holdout'] == Holdout.carve(N_TRAIN, 0.1, 0).record()
    assert (sp['selection_split'], sp['search_split'], sp['reported_split'], sp['test_split']) == (
        'holdout', 'holdout', 'test', 'validation')
    assert sp['images'] == {'train': 1024, 'holdout_evaluated': 300, 'test': 1000, 'search': 300}
    assert sp['losses'] == {'random_pm': 'total', 'guided_pm': 'image'}
    assert rep['budget_detail']['holdout'] == 0.1 and rep['budget_detail']['test_images'] == 300
    assert ('a fixed 10% of the training split (seed 0, 500 images) is held out and never trained on; 300 images of '
            "it selected each run's best epoch; the search scored its genes on 300 images of it") in text
    assert 'The numbers below are on the test split alone (`validation`, 1,000 images)' in text
    assert 'Top-1 (%) on the test split' in text and '300 held-out validation images' in text
    assert '300 test images (a fixed random subset)' in text
    assert 'f_O on the image loss L_O alone (`--final-loss image`' in text
    # f_O on L_T, and the old way
    old = report(_args(output=str(tmp_path), holdout=0.0, final_loss='total'), _runs(holdout=False))
    rep = json.load(open(tmp_path / 'report.json'))
    assert rep['splits']['holdout'] is None and rep['splits']['reported_split'] == 'validation'
    assert rep['splits']['search_split'] == 'validation' and rep['splits']['losses']['guided_pm'] == 'total'
    assert 'no holdout (`--holdout 0`, the old way)' in old and 'not held-out test numbers' in old
    assert rep['budget_detail']['test_images'] is None and 'test images' not in old
    assert 'L_T, as f_T (`--final-loss total`)' in old and 'Top-1 (%) on the validation split' in old


def test_pipeline_flags_for_the_final_loss_and_the_holdout(tmp_path, capsys):
    from timm_patchmix.pipeline import build_parser, guided_flags, main as pipeline_main
    args = build_parser().parse_args([])
    assert (args.holdout, args.holdout_seed, args.final_loss) == (0.1, 0, 'image')
    assert guided_flags(args, 'patchhead_x', 't.json')[-1] == '--no-patch-loss'
    assert '--no-patch-loss' not in guided_flags(_args(final_loss='total'), 'patchhead_x', 't.json')
    with pytest.raises(SystemExit) as info:
        pipeline_main(['--output', str(tmp_path / 'p'), '--train-args', '--holdout', '0.2'])
    assert info.value.code == 2 and "give the pipeline's own --holdout" in capsys.readouterr().err
    assert not (tmp_path / 'p').exists()


def test_pipeline_refuses_a_phase_made_before_the_holdout(tmp_path):
    """A phase folder recorded before --holdout existed was made without one: the default holdout does not reuse it
    (nor a guided model trained before --final-loss, which trained on L_T)."""
    from timm_patchmix.pipeline import SETTINGS_FILE, _phase_settings, main as pipeline_main
    from timm_patchmix.settings import write_settings
    out = tmp_path / 'out'
    args = _args(output=str(out), methods=['base'], train_args=['--train-subset', '32'])
    old = {k: v for k, v in _phase_settings(args, 0).items() if not k.startswith('--holdout')}
    (out / 'seed0' / 'base').mkdir(parents=True)
    write_settings(str(out / 'seed0' / 'base' / SETTINGS_FILE), old)
    (out / 'seed0' / 'base' / 'summary.csv').write_text('epoch\n0\n')  # what it made (a record alone: a fresh start)
    with pytest.raises(SettingsChangedError, match=r'--holdout: 0.0 before, 0.1 now'):
        pipeline_main(['--output', str(out), '--methods', 'base', '--train-args', '--train-subset', '32'])


@pytest.mark.parametrize('dataset, data_dir, split, test_split, same', [
    ('sklearn_digits', '', 'validation', 'test', True),   # SklearnDigits opens one evaluation split by any name
    ('torch/cifar10', 'data', 'validation', 'test', True),  # timm opens torchvision's train=False for any name
    ('torch/Fashion_MNIST', 'data', 'val', 'validation', True),
    ('fashion_mnist', '', 'validation', 'test', True),
    ('', '', 'validation', 'test', True),                 # the embedded data
    ('', 'my_images', 'validation', 'test', False),       # an image folder: split names are folders
    ('torch/image_folder', 'data', 'validation', 'test', False),
    ('sklearn_digits', '', 'train', 'test', False),
])
def test_which_split_names_open_the_test_split(dataset, data_dir, split, test_split, same):
    from timm_patchmix.search.inputs import _is_test_split
    assert _is_test_split(dataset, data_dir, split, test_split) is same


def test_sklearn_digits_evaluation_names_open_one_split():
    from timm_patchmix.data import SklearnDigits
    val, test, train = (list(SklearnDigits(s).indices) for s in ('validation', 'test', 'train'))
    assert val == test and len(val) == 500 and not set(val) & set(train)


def test_a_resume_into_another_runs_folder_replaces_that_runs_records(tmp_path):
    """Resuming run a's state under --experiment b, a folder holding run b's files, copied a's state and weights in
    and kept b's args.yaml, results.json and --checkpoint-hist files (b's --holdout and test numbers, which a model
    card would then describe for a's model): for the whole first epoch, and for good when no epoch was left. The
    folder's records are a's now; numbers a's run has not produced are not there."""
    import yaml
    a_flags = TINY + ['--epochs', '1', '--output', str(tmp_path)]
    train_main(a_flags + ['--experiment', 'a'])
    train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'b', '--holdout', '0.25',
                       '--test-subset', '16', '--seed', '5', '--checkpoint-hist', '2'])
    b = tmp_path / 'b'
    assert (b / 'results.json').is_file() and yaml.safe_load((b / 'args.yaml').read_text())['seed'] == 5
    assert (b / 'checkpoint-0.safetensors').is_file()
    state = str(tmp_path / 'a' / 'state.safetensors')
    train_main(a_flags + ['--experiment', 'b', '--resume', state])  # no epoch left to train
    assert (b / 'state.safetensors').read_bytes() == (tmp_path / 'a' / 'state.safetensors').read_bytes()
    got, want = (yaml.safe_load((f / 'args.yaml').read_text()) for f in (b, tmp_path / 'a'))
    assert got['seed'] == want['seed'] == 42 and got['holdout'] == want['holdout'] == 0.0
    assert {k: v for k, v in got.items() if k not in ('experiment', 'resume', 'command')} == \
        {k: v for k, v in want.items() if k not in ('experiment', 'resume', 'command')}
    assert not (b / 'results.json').exists() and not (b / 'checkpoint-0.safetensors').exists()  # (b's history)
    assert (b / 'summary.csv').read_text() == (tmp_path / 'a' / 'summary.csv').read_text()


def test_a_resume_into_its_own_folder_spelt_through_a_link_keeps_its_records(tmp_path):
    """Its own folder reached through a symbolic link in the --resume path read as another folder, and the resume
    removed the run's fgsm.json and results.json (which a resume without --fgsm never writes again)."""
    real = tmp_path / 'real'
    flags = TINY + ['--epochs', '1', '--output', str(real), '--experiment', 'a', '--fgsm', '0.01']
    train_main(flags)
    (tmp_path / 'link').symlink_to(real, target_is_directory=True)
    before = {n: (real / 'a' / n).read_bytes() for n in ('fgsm.json', 'args.yaml')}
    train_main(flags + ['--resume', str(tmp_path / 'link' / 'a' / 'state.safetensors')])  # no epoch left
    assert {n: (real / 'a' / n).read_bytes() for n in ('fgsm.json', 'args.yaml')} == before


def test_holdout_size_is_the_documented_float_rounding():
    """docs/training.md: F × the split's size rounded half up in binary floating point, which search.py and every
    recorded holdout share: 0.29 × 50 is 14.499999... there, so 14; exact halves round up."""
    assert holdout_size(50, 0.29) == 14 and holdout_size(50, 0.3) == 15 and holdout_size(10, 0.25) == 3
    assert holdout_size(90, 0.35) == 31 and holdout_size(4, 0.125) == 1
