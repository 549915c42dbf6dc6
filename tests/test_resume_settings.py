"""A resume or rerun with other settings is refused, naming each changed setting with its old and new value, and
leaves every existing file as it was; the same settings still resume."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch

import timm_patchmix  # noqa: F401
from timm_patchmix.checkpoint import save_weights
from timm_patchmix.data import PATCHSHAPES_CLASSES
from timm_patchmix.guided import MaskTable, dataset_fingerprint
from timm_patchmix.pipeline import SETTINGS_FILE, _guided_settings, _phase_settings, build_parser as pipeline_parser
from timm_patchmix.pipeline import main as pipeline_main
from timm_patchmix.search import main as search_main
from timm_patchmix.settings import SettingsChangedError, file_record, write_settings
from timm_patchmix.train import main as train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # the tree first
ENV = dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1')
DATA = {'dataset': '', 'data_dir': '', 'val_split': 'validation', 'input_size': [3, 32, 32],
        'mean': [0.4914, 0.4822, 0.4465], 'std': [0.247, 0.2435, 0.2616]}


def snapshot(folder):
    """Every file under ``folder`` with its bytes and modification time."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(d, f)
            with open(p, 'rb') as fh:
                out[os.path.relpath(p, folder)] = (fh.read(), os.stat(p).st_mtime_ns)
    return out


def refused(call, *names_and_values):
    """Run ``call``, expect a SettingsChangedError, and check the message names each ``(setting, old, new)``."""
    with pytest.raises(SettingsChangedError) as info:
        call()
    msg = str(info.value)
    for setting, old, new in names_and_values:
        assert f'{setting}: {old} before, {new} now' in msg, msg
    return msg


# --- train.py --resume -----------------------------------------------------------------------------------------
TINY = ['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress', '--device', 'cpu',
        '--log-interval', '1000']


def write_table(path, seed):
    rng = np.random.default_rng(seed)
    pairs = [(i, i + 1) for i in range(0, 10, 2)]
    MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), dataset_fingerprint('', PATCHSHAPES_CLASSES), pairs,
              [rng.random((4, 4)) < 0.5 for _ in pairs], [0.1] * len(pairs), 0.1).save(str(path))
    return str(path)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """One-epoch runs to resume: Random PatchMix, Guided PatchMix with a table, and Mixup."""
    root = tmp_path_factory.mktemp('train')
    table = write_table(tmp_path_factory.mktemp('table') / 'masks.json', seed=0)  # outside the runs' snapshots
    runs = {'pm': ['--model', 'patchhead_resnet32_cifar', '--patchmix'],
            'gpm': ['--model', 'patchhead_resnet32_cifar', '--patchmix', '--patchmix-table', table],
            'mixup': ['--model', 'resnet32_cifar', '--mixup', '0.2']}
    for name, flags in runs.items():
        train_main(TINY + ['--epochs', '1', '--output', str(root), '--experiment', name] + flags)
    return root, runs


def resume_train(root, name, flags, epochs=2):
    return train_main(TINY + ['--epochs', str(epochs), '--output', str(root), '--experiment', name,
                              '--resume', str(root / name / 'state.safetensors')] + flags)


@pytest.mark.parametrize('run, drop, change, expect', [
    ('pm', None, ['--patchmix-grid', '2'], [('--patchmix-grid', '[4, 4]', '[2, 2]')]),
    ('pm', None, ['--patchmix-mode', 'pair'], [('--patchmix-mode', "'elem'", "'pair'")]),
    ('pm', None, ['--patchmix-collate'], [('--patchmix-collate', 'False', 'True')]),
    ('pm', None, ['--patchmix-alpha', '0.5'], [('--patchmix-alpha', '1.0', '0.5')]),
    ('pm', '--patchmix', [], [('--patchmix', 'True', 'False')]),
    ('mixup', None, ['--mixup', '0.5', '--cutmix', '1.0'], [('--mixup', '0.2', '0.5'), ('--cutmix', '0.0', '1.0')]),
    ('mixup', None, ['--mixup-mode', 'pair'], [('--mixup-mode', "'batch'", "'pair'")]),
    # what the optimizer's saved state brings back, whatever the flags say
    ('mixup', None, ['--weight-decay', '0.05'], [('--weight-decay', '0.0005', '0.05')]),
    ('mixup', None, ['--opt', 'adamw'], [('--opt', "'sgd'", "'adamw'")]),
    ('mixup', None, ['--momentum', '0.5'], [('--momentum', '0.9', '0.5')]),
    ('mixup', None, ['--opt-eps', '1e-6'], [('--opt-eps', 'None', '1e-06')]),
    ('mixup', None, ['--opt-kwargs', 'dampening=0.0'], [('--opt-kwargs', '{}', "{'dampening': 0.0}")]),
    ('mixup', None, ['--layer-decay', '0.75'], [('--layer-decay', 'None', '0.75')]),
    ('mixup', None, ['--model-ema'], [('--model-ema', 'False', 'True')]),
    # the normalisation is part of the data
    ('mixup', None, ['--mean', '0.5', '--std', '0.25'], [('--mean', 'None', '[0.5]'), ('--std', 'None', '[0.25]')]),
    # and so is its augmentation, and the model's pooling and BatchNorm
    ('mixup', None, ['--gp', 'max'], [('--gp', 'None', "'max'")]),
    ('mixup', None, ['--bce-loss'], [('--bce-loss', 'False', 'True')]),
    ('mixup', None, ['--reprob', '0.25'], [('--reprob', '0.0', '0.25')]),
    ('mixup', None, ['--aa', 'v0', '--hflip', '0'], [('--aa', 'None', "'v0'"), ('--hflip', '0.5', '0.0')]),
    # what chooses the best epoch: the saved best is a score of one metric on one set of images
    ('mixup', None, ['--eval-metric', 'loss'], [('--eval-metric', "'top1'", "'loss'")]),
    ('mixup', None, ['--val-subset', '8'], [('--val-subset', '16', '8')]),
    ('mixup', None, ['--val-split', 'train'], [('--val-split', "'validation'", "'train'")]),
    # the seed and the loader workers draw every epoch's augmentation and mixing
    ('mixup', None, ['--seed', '7'], [('--seed', '42', '7')]),
    ('pm', None, ['-j', '1'], [('--workers', '0', '1')]),
])
def test_train_resume_refuses_changed_mixing(trained, run, drop, change, expect):
    root, runs = trained
    flags = [f for f in runs[run] if f != drop]
    before = snapshot(root)
    msg = refused(lambda: resume_train(root, run, flags + change), *expect)
    assert msg.startswith(f'cannot resume from {root / run / "state.safetensors"}')
    assert snapshot(root) == before


def _rewrite_meta(path, edit):
    import json
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(path, framework='pt') as f:
        md = f.metadata()
    meta = json.loads(md['timm_patchmix'])
    tensors = load_file(path)
    edit(meta, tensors)
    md = dict(md, timm_patchmix=json.dumps(meta))
    if 'timm_patchmix.sha256' in md:  # re-signed: a well-formed file whose values the checks must catch
        from timm_patchmix.checkpoint import tensors_digest
        md['timm_patchmix.sha256'] = tensors_digest(tensors)
    if 'timm_patchmix.meta_sha256' in md:
        import hashlib
        md['timm_patchmix.meta_sha256'] = hashlib.sha256(md['timm_patchmix'].encode('utf-8')).hexdigest()
    save_file(tensors, path, metadata=md)


def test_train_resume_of_an_older_state_compares_its_args(trained, tmp_path):
    """A state written before the optimizer's settings were in its settings record: they are taken from its args,
    so a changed --weight-decay is still named rather than silently undone by the optimizer's saved state."""
    root, runs = trained
    old_root = tmp_path / 'old'
    shutil.copytree(root / 'mixup', old_root / 'mixup')

    def older(meta, tensors):
        for flag in ('--opt', '--weight-decay', '--momentum', '--opt-eps', '--opt-betas'):
            del meta['settings'][flag]
        assert meta['args']['weight_decay'] == 0.0005
    _rewrite_meta(str(old_root / 'mixup' / 'state.safetensors'), older)
    before = snapshot(old_root)
    refused(lambda: resume_train(old_root, 'mixup', runs['mixup'] + ['--weight-decay', '0.05']),
            ('--weight-decay', '0.0005', '0.05'))
    assert snapshot(old_root) == before
    res = resume_train(old_root, 'mixup', runs['mixup'])  # its own settings still resume
    assert [r['epoch'] for r in res['rows']] == [0, 1]


def test_train_resume_of_an_older_state_takes_a_new_setting_as_its_default(trained, tmp_path):
    """A state from before --opt-kwargs, --layer-decay and --model-ema existed trained without them: a resume that
    adds one is refused, naming it, rather than silently keeping the old optimizer or starting a fresh average."""
    root, runs = trained
    old_root = tmp_path / 'old'
    shutil.copytree(root / 'mixup', old_root / 'mixup')
    path = str(old_root / 'mixup' / 'state.safetensors')

    def older(meta, tensors):
        for key, flag in (('opt_kwargs', '--opt-kwargs'), ('layer_decay', '--layer-decay'),
                          ('model_ema', '--model-ema')):
            del meta['settings'][flag], meta['args'][key]
    _rewrite_meta(path, older)
    before = snapshot(old_root)
    for flags, change in ((['--model-ema'], ('--model-ema', 'False', 'True')),
                          (['--opt-kwargs', 'dampening=0.0'], ('--opt-kwargs', '{}', "{'dampening': 0.0}"))):
        refused(lambda: resume_train(old_root, 'mixup', runs['mixup'] + flags), change)
    assert snapshot(old_root) == before
    res = resume_train(old_root, 'mixup', runs['mixup'])  # its own settings still resume
    assert [r['epoch'] for r in res['rows']] == [0, 1]


def test_train_resume_of_a_state_from_before_the_augmentation_flags(trained, tmp_path):
    """A state without the augmentation, model and BCE settings trained with their defaults (a 32 px input: the
    CIFAR-style transform, which --train-interpolation never reached): its own flags resume it, a new one is named."""
    from timm_patchmix.engine.records import RESUME_SETTINGS
    root, runs = trained
    old_root = tmp_path / 'old'
    shutil.copytree(root / 'mixup', old_root / 'mixup')
    path = str(old_root / 'mixup' / 'state.safetensors')
    new = RESUME_SETTINGS[RESUME_SETTINGS.index('no_aug'):RESUME_SETTINGS.index('aug_repeats') + 1]
    assert 'train_interpolation' in new and 'bce_pos_weight' in new
    # settings compared since, of flags the older version had: its args hold them, its settings record does not
    compared_since = RESUME_SETTINGS[RESUME_SETTINGS.index('aug_repeats') + 1:]
    assert compared_since == ('eval_metric', 'val_split', 'val_subset', 'seed', 'workers')

    def older(meta, tensors):
        for key in new:
            del meta['args'][key], meta['settings']['--' + key.replace('_', '-')]
        for key in compared_since:
            del meta['settings']['--' + key.replace('_', '-')]
    _rewrite_meta(path, older)
    refused(lambda: resume_train(old_root, 'mixup', runs['mixup'] + ['--val-subset', '8']), ('--val-subset', '16', '8'))
    refused(lambda: resume_train(old_root, 'mixup', runs['mixup'] + ['--seed', '7']), ('--seed', '42', '7'))
    before = snapshot(old_root)
    refused(lambda: resume_train(old_root, 'mixup', runs['mixup'] + ['--reprob', '0.2']), ('--reprob', '0.0', '0.2'))
    assert snapshot(old_root) == before
    res = resume_train(old_root, 'mixup', runs['mixup'])
    assert [r['epoch'] for r in res['rows']] == [0, 1]


def test_train_resume_of_a_state_without_its_average(tmp_path):
    """A --model-ema state whose average is gone (its tensors stripped): a one-line error, nothing written."""
    flags = ['--model', 'resnet32_cifar', '--model-ema']
    train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'ema'] + flags)
    path = str(tmp_path / 'ema' / 'state.safetensors')

    def strip(meta, tensors):
        for k in [k for k in tensors if k.startswith('extra.ema.')]:
            del tensors[k]
    _rewrite_meta(path, strip)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        resume_train(tmp_path, 'ema', flags)
    assert str(e.value).startswith(f'error: cannot resume from {path} with --model-ema: it holds no weight average')
    assert snapshot(tmp_path) == before


def test_train_resume_compares_the_table_by_content(trained, tmp_path):
    root, runs = trained
    flags = runs['gpm']
    table = flags[-1]
    old = file_record(table)
    before = snapshot(root)
    write_table(table, seed=1)  # the same path, other masks
    new = file_record(table)
    try:
        refused(lambda: resume_train(root, 'gpm', flags),
                ('--patchmix-table', f"{table!r} (sha256 {old['sha256'][:12]})",
                 f"{table!r} (sha256 {new['sha256'][:12]})"))
    finally:
        write_table(table, seed=0)
    assert snapshot(root) == before
    # a table added to a Random PatchMix run
    refused(lambda: resume_train(root, 'pm', runs['pm'] + ['--patchmix-table', table]),
            ('--patchmix-table', 'None', f"{table!r} (sha256 {old['sha256'][:12]})"))
    assert snapshot(root) == before


def test_train_cli_exits_2_naming_the_change(trained):
    root, runs = trained
    before = snapshot(root)
    state = str(root / 'pm' / 'state.safetensors')
    proc = subprocess.run([sys.executable, 'train.py'] + TINY + [
        '--epochs', '2', '--output', str(root), '--experiment', 'pm', '--resume', state,
        '--patchmix-mode', 'batch'] + runs['pm'], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: cannot resume from" in proc.stderr and "--patchmix-mode: 'elem' before, 'batch' now" in proc.stderr
    assert 'Traceback' not in proc.stderr
    assert snapshot(root) == before


def test_train_same_settings_resume(trained, tmp_path):
    root, runs = trained
    # the table moved, same content: still the same settings; the schedule may change on a resume
    copy = str(tmp_path / 'moved.json')
    shutil.copyfile(runs['gpm'][-1], copy)
    work = tmp_path / 'work'
    shutil.copytree(root / 'gpm', work / 'gpm')
    res = resume_train(work, 'gpm', runs['gpm'][:-1] + [copy], epochs=2)
    assert [r['epoch'] for r in res['rows']] == [0, 1]


# --- search.py --resume ----------------------------------------------------------------------------------------
SEARCH = ['--population', '8', '--generations', '1', '--k', '4', '--val-subset', '200', '--no-progress',
          '--eval-batch-size', '64', '--seed', '3', '--device', 'cpu', '--no-plots']


def make_checkpoint(path, seed):
    torch.manual_seed(seed)
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=10, grid=[4, 4])
    save_weights(str(path), m.state_dict(), {'model': 'patchhead_resnet32_cifar', 'num_classes': 10,
                                             'model_kwargs': {'grid': [4, 4]},
                                             'class_names': list(PATCHSHAPES_CLASSES), 'data': DATA})
    return str(path)


@pytest.fixture(scope='module')
def searched(tmp_path_factory):
    root = tmp_path_factory.mktemp('search')
    ckpt = make_checkpoint(root / 'ft.safetensors', seed=0)
    search_main(['--checkpoint', ckpt, '--output', str(root / 's')] + SEARCH)
    return root, ckpt


@pytest.mark.parametrize('change, expect', [
    (['--score', 'loss'], [('--score', "'accuracy'", "'loss'")]),
    (['--fitness', 'max'], [('--fitness', "'min'", "'max'")]),
    (['--k', '2'], [('--k', '4', '2')]),
    (['--seed', '4'], [('--seed', '3', '4')]),
    (['--n-active', '5'], [('--n-active', '10', '5')]),
    (['--population', '6'], [('--population', '8', '6')]),
    (['--val-subset', '100', '--val-split', 'train'], [('--val-subset', '200', '100'),
                                                       ('--val-split', "'validation'", "'train'")]),
    (['--same-class-pairs'], [('--same-class-pairs', 'False', 'True')]),
    (['--tournsize', '2'], [('--tournsize', '3', '2')]),
])
def test_search_resume_refuses_changed_settings(searched, change, expect):
    root, ckpt = searched
    before = snapshot(root)
    msg = refused(lambda: search_main(['--checkpoint', ckpt, '--output', str(root / 's'), '--resume'] + SEARCH +
                                      change), *expect)
    assert msg.startswith(f'cannot resume the search in {root / "s"}')
    assert 'another --output' in msg
    assert snapshot(root) == before


def test_search_resume_compares_the_checkpoint_by_content(searched, tmp_path):
    root, ckpt = searched
    other = make_checkpoint(tmp_path / 'other.safetensors', seed=1)
    before = snapshot(root)
    refused(lambda: search_main(['--checkpoint', other, '--output', str(root / 's'), '--resume'] + SEARCH),
            ('--checkpoint', f"{ckpt!r} (sha256 {file_record(ckpt)['sha256'][:12]})",
             f"{other!r} (sha256 {file_record(other)['sha256'][:12]})"))
    assert snapshot(root) == before
    proc = subprocess.run([sys.executable, 'search.py', '--checkpoint', other, '--output', str(root / 's'),
                           '--resume'] + SEARCH, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert 'error: cannot resume the search' in proc.stderr and '--checkpoint: ' in proc.stderr
    assert 'Traceback' not in proc.stderr
    assert snapshot(root) == before


def test_search_same_settings_resume(searched, tmp_path):
    root, ckpt = searched
    moved = str(tmp_path / 'moved.safetensors')  # the same weights elsewhere: the same settings
    shutil.copyfile(ckpt, moved)
    shutil.copytree(root / 's', tmp_path / 's')
    table = search_main(['--checkpoint', moved, '--output', str(tmp_path / 's'), '--resume'] + SEARCH +
                        ['--generations', '2'])  # when to stop may change
    assert table.search_args['generations'] == 2
    assert (tmp_path / 's' / 'logbook.csv').read_text().count('\n') == 4  # header + generations 0..2
    assert table.search_args['generations_run'] == 2  # the generation reached, whatever the last call asked for
    table = search_main(['--checkpoint', moved, '--output', str(tmp_path / 's'), '--resume'] + SEARCH +
                        ['--generations', '1'])  # already past it: nothing more to run
    assert table.search_args['generations'] == 1 and table.search_args['generations_run'] == 2


# --- the pipeline ----------------------------------------------------------------------------------------------
PIPE_TRAIN = ['--train-args', '--train-subset', '32', '--val-subset', '16', '-b', '16', '--epochs', '1',
              '--device', 'cpu']


@pytest.fixture(scope='module')
def piped(tmp_path_factory):
    out = str(tmp_path_factory.mktemp('pipe') / 'out')
    text = pipeline_main(['--output', out, '--methods', 'base'] + PIPE_TRAIN)
    return out, text


@pytest.mark.parametrize('change, expect', [
    (['--budget', 'small'], [('--budget', "'smoke'", "'small'")]),
    (['--model', 'preactresnet18_cifar'], [('--model', "'resnet32_cifar'", "'preactresnet18_cifar'")]),
    (['--dataset', 'fashion_mnist'], [('--dataset', "''", "'fashion_mnist'")]),
    (['--data-dir', '/elsewhere'], [('--data-dir', "''", "'/elsewhere'")]),
])
def test_pipeline_refuses_changed_settings(piped, change, expect):
    out, _ = piped
    before = snapshot(out)
    msg = refused(lambda: pipeline_main(['--output', out, '--methods', 'base'] + change + PIPE_TRAIN), *expect)
    assert msg.startswith(f'cannot reuse {os.path.join(out, "seed0", "base")}')
    assert 'another --output' in msg
    assert snapshot(out) == before


def test_pipeline_refuses_changed_train_args_from_the_cli(piped):
    out, _ = piped
    before = snapshot(out)
    changed = [a if a != '32' else '48' for a in PIPE_TRAIN]
    proc = subprocess.run([sys.executable, '-m', 'timm_patchmix.pipeline', '--output', out, '--methods', 'base',
                           'mixup'] + changed, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    old = ['--batch-size 16', '--device cpu', '--epochs 1', '--train-subset 32', '--val-subset 16']
    new = [a.replace('32', '48') for a in old]
    assert f'--train-args: {old!r} before, {new!r} now' in proc.stderr, proc.stderr
    assert 'Traceback' not in proc.stderr
    assert snapshot(out) == before  # not even the new mixup phase started


def test_pipeline_same_settings_reuse(piped):
    out, text = piped
    stamp = os.stat(os.path.join(out, 'seed0', 'base', 'last.safetensors')).st_mtime_ns
    assert pipeline_main(['--output', out, '--methods', 'base'] + PIPE_TRAIN) == text
    assert os.stat(os.path.join(out, 'seed0', 'base', 'last.safetensors')).st_mtime_ns == stamp
    # the same --train-args in another order, spelt otherwise, with a console flag: the same settings
    same = ['--train-args', '--epochs', '1', '--batch-size', '16', '--no-progress', '--log-interval', '5',
            '--device', 'cpu', '--val-subset', '16', '--train-subset', '32']
    assert pipeline_main(['--output', out, '--methods', 'base'] + same) == text
    assert os.stat(os.path.join(out, 'seed0', 'base', 'last.safetensors')).st_mtime_ns == stamp


def test_pipeline_refuses_unrecorded_and_changed_inputs(tmp_path):
    """A phase folder without its settings record is not reused; nor is a finished search whose f_T, or a guided
    model whose table, has other content than when the phase ran."""
    out = tmp_path / 'out'
    (out / 'seed0' / 'base').mkdir(parents=True)
    (out / 'seed0' / 'base' / 'done.json').write_text('{}')
    with pytest.raises(SettingsChangedError, match=f'without {SETTINGS_FILE}'):
        pipeline_main(['--output', str(out), '--methods', 'base'] + PIPE_TRAIN)
    assert os.listdir(out) == ['seed0'] and os.listdir(out / 'seed0' / 'base') == ['done.json']

    # finished f_T and search phases, made from files whose content then changed
    argv = ['--output', str(tmp_path / 'g'), '--methods', 'guided_pm'] + PIPE_TRAIN
    args = pipeline_parser().parse_args(argv)
    seed = tmp_path / 'g' / 'seed0'
    ft = make_checkpoint(seed / 'random_pm' / 'best.safetensors', seed=0)
    write_settings(str(seed / 'random_pm' / SETTINGS_FILE), _phase_settings(args, 0))
    (seed / 'random_pm' / 'done.json').write_text(
        '{"method": "random_pm", "seed": 0, "final_top1": 1.0, "best_top1": 1.0, "epochs": 1, "output": "%s"}'
        % (seed / 'random_pm'))
    write_settings(str(seed / 'search' / SETTINGS_FILE), _phase_settings(args, 0, {'f_T': file_record(ft)}))
    (seed / 'search' / 'done.json').write_text('{}')
    old = file_record(ft)
    make_checkpoint(ft, seed=1)  # f_T replaced after the search used it
    before = snapshot(tmp_path / 'g')
    msg = refused(lambda: pipeline_main(argv), ('f_T', f"{ft!r} (sha256 {old['sha256'][:12]})",
                                                f"{ft!r} (sha256 {file_record(ft)['sha256'][:12]})"))
    assert msg.startswith(f'cannot reuse {seed / "search"}')
    assert snapshot(tmp_path / 'g') == before

    # the search finished with this f_T; the guided model was trained on a table that has since changed
    write_settings(str(seed / 'search' / SETTINGS_FILE), _phase_settings(args, 0, {'f_T': file_record(ft)}))
    table = write_table(seed / 'search' / 'masks.json', seed=0)
    write_settings(str(seed / 'guided_pm' / SETTINGS_FILE), _phase_settings(args, 0, _guided_settings(args, table)))
    (seed / 'guided_pm' / 'done.json').write_text('{}')
    old = file_record(table)
    write_table(table, seed=1)
    before = snapshot(tmp_path / 'g')
    msg = refused(lambda: pipeline_main(argv), ('table', f"{table!r} (sha256 {old['sha256'][:12]})",
                                                f"{table!r} (sha256 {file_record(table)['sha256'][:12]})"))
    assert msg.startswith(f'cannot reuse {seed / "guided_pm"}')
    assert snapshot(tmp_path / 'g') == before  # no guided samples drawn from the changed table either


@pytest.mark.parametrize('edit, message', [
    (lambda meta, t: t.__setitem__('optim.0.momentum_buffer', torch.zeros(3)),
     r"optimizer state 'momentum_buffer' of a parameter of shape \[16\] has shape \[3\]"),  # a BN weight
    (lambda meta, t: meta['optimizer']['param_groups'][0].__setitem__('momentum', 'x'),
     r"optimizer group 0 holds momentum='x', where this optimizer takes a number \(0.9\)"),
    (lambda meta, t: meta['optimizer']['param_groups'][0].__setitem__('weight_decay', None),
     r'optimizer group 0 holds weight_decay=None, where this optimizer takes a number'),
])
def test_train_resume_of_an_optimizer_state_it_could_not_step_with(trained, tmp_path, edit, message):
    """An optimizer state whose tensors or settings the optimizer cannot use (torch's load_state_dict checks
    neither, and the first step failed deep in torch): ``cannot resume`` naming it, before anything is written."""
    root, runs = trained
    shutil.copytree(root / 'mixup', tmp_path / 'mixup')
    path = str(tmp_path / 'mixup' / 'state.safetensors')
    _rewrite_meta(path, edit)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit, match=r'^error: cannot resume from .*does not fit the model and optimizer of this '
                                         r'run: ' + message):
        resume_train(tmp_path, 'mixup', runs['mixup'])
    assert snapshot(tmp_path) == before


def test_train_resume_of_an_adafactor_state(tmp_path):
    """Adafactor's row and column statistics have shapes of their own: its state resumes (the shape check covers
    the per-element entries only)."""
    flags = ['--model', 'resnet8_cifar', '--opt', 'adafactor', '--lr', '0.01']
    train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'af'] + flags)
    res = resume_train(tmp_path, 'af', flags)
    assert [r['epoch'] for r in res['rows']] == [0, 1]


def test_train_resume_of_a_lamb_state(tmp_path):
    """timm's Lamb keeps its step count as a tensor in its parameter group: the state stores it as a tensor of the
    file (JSON cannot hold it) and a resume gives it back, equal to the saved one."""
    from timm_patchmix.checkpoint import load_state
    flags = ['--model', 'resnet8_cifar', '--opt', 'lamb', '--lr', '0.01']
    train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'lamb'] + flags)
    state = load_state(str(tmp_path / 'lamb' / 'state.safetensors'))
    step = state['optimizer']['param_groups'][0]['step']
    assert isinstance(step, torch.Tensor) and float(step) == 2.0  # 32 images in batches of 16: 2 updates
    res = resume_train(tmp_path, 'lamb', flags)
    assert [r['epoch'] for r in res['rows']] == [0, 1]
    again = load_state(str(tmp_path / 'lamb' / 'state.safetensors'))
    assert float(again['optimizer']['param_groups'][0]['step']) == 4.0
    # stored in the one tagged form of values JSON cannot hold
    from timm_patchmix.checkpoint import read_meta
    om = read_meta(str(tmp_path / 'lamb' / 'state.safetensors'))['optimizer']
    n_groups = len(om['param_groups'])
    assert 'group_tensors' not in om and om['encoded']['param_groups'] == {str(k): ['betas', 'step']
                                                                           for k in range(n_groups)}
    assert om['param_groups'][0]['step'] == {'tensor': 'optim_group.0.step'}

    def earlier(meta, t):  # the layout of earlier versions: the group's tensors named in group_tensors
        o = meta['optimizer']
        for g in o['param_groups']:
            g['step'] = None
        o['encoded']['param_groups'] = {str(k): ['betas'] for k in range(n_groups)}
        o['group_tensors'] = {str(k): ['step'] for k in range(n_groups)}
    shutil.copytree(tmp_path / 'lamb', tmp_path / 'old')
    _rewrite_meta(str(tmp_path / 'old' / 'state.safetensors'), earlier)
    old = load_state(str(tmp_path / 'old' / 'state.safetensors'))
    assert all(torch.equal(g['step'], h['step'])
               for g, h in zip(old['optimizer']['param_groups'], again['optimizer']['param_groups']))
    res = resume_train(tmp_path, 'old', flags, epochs=3)
    assert [r['epoch'] for r in res['rows']] == [0, 1, 2]
    # a record naming a group the state does not have is refused before anything is loaded
    _rewrite_meta(str(tmp_path / 'lamb' / 'state.safetensors'),
                  lambda meta, t: meta['optimizer'].__setitem__('group_tensors', {'7': ['step']}))
    with pytest.raises(SystemExit, match=r"optimizer.group_tensors keys must be group indices below \d+, got '7'"):
        resume_train(tmp_path, 'lamb', flags, epochs=3)


def test_train_resume_of_a_big_vision_adafactor_state_is_bit_exact(tmp_path):
    """timm's big-vision Adafactor keeps a dtype in its parameter group: the state stores it (it could not save at
    all before) and a resume ends where an uninterrupted run does."""
    from safetensors.torch import load_file
    from timm_patchmix.checkpoint import load_state
    flags = ['--model', 'resnet8_cifar', '--opt', 'adafactorbv', '--lr', '0.01']
    full = train_main(TINY + ['--epochs', '2', '--output', str(tmp_path), '--experiment', 'full'] + flags)
    train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'part'] + flags)
    group = load_state(str(tmp_path / 'part' / 'state.safetensors'))['optimizer']['param_groups'][0]
    assert group['momentum_dtype'] == torch.bfloat16
    res = resume_train(tmp_path, 'part', flags)
    assert [dict(r, img_s=0) for r in res['rows']] == [dict(r, img_s=0) for r in full['rows']]
    a, b = (load_file(str(tmp_path / name / 'last.safetensors')) for name in ('full', 'part'))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings('ignore:Using backward\\(\\) with create_graph=True')
def test_train_with_a_second_order_optimizer(tmp_path, capsys):
    """timm's AdaHessian differentiates the gradients again: the step keeps their graph (create_graph, as timm's
    train.py does), the run trains and resumes."""
    flags = ['--model', 'resnet8_cifar', '--opt', 'adahessian', '--lr', '0.01']
    res = train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'ah'] + flags)
    assert np.isfinite(res['rows'][0]['train_loss'])
    res = resume_train(tmp_path, 'ah', flags)
    assert [r['epoch'] for r in res['rows']] == [0, 1] and np.isfinite(res['rows'][1]['train_loss'])
    # torch.compile has no double backward: refused before anything is written, not a traceback at the first step
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_main(TINY + ['--epochs', '1', '--output', str(tmp_path), '--experiment', 'c', '--torchcompile',
                           'aot_eager'] + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and 'argument --torchcompile: --opt adahessian differentiates the gradients again, ' \
        'which torch.compile cannot' in err, err
    assert not (tmp_path / 'c').exists()


def test_train_resume_checks_the_data_not_its_path(tmp_path):
    """--data-dir may change on a resume (the data moved); other data behind it may not: other class names, or
    images added to a split, are named with their old and new values, and nothing is written."""
    from PIL import Image

    def folder(root, classes=('ant', 'bee', 'cat'), extra=0):
        for split in ('train', 'validation'):
            for k, c in enumerate(classes):
                os.makedirs(root / split / c, exist_ok=True)
                for i in range(4 + (extra if split == 'train' and k == 0 else 0)):
                    Image.new('RGB', (8, 8), (40 * k + 10 * i, 0, 0)).save(root / split / c / f'{i}.png')
        return str(root)

    out = tmp_path / 'out'
    flags = ['-b', '4', '-j', '0', '--no-progress', '--device', 'cpu', '--model', 'patchhead_resnet32_cifar',
             '--img-size', '32', '--patchmix', '--output', str(out), '--experiment', 'run']
    train_main(flags + ['--data-dir', folder(tmp_path / 'data'), '--epochs', '1'])
    state = str(out / 'run' / 'state.safetensors')
    before = snapshot(out)
    refused(lambda: train_main(flags + ['--data-dir', folder(tmp_path / 'more', extra=2), '--epochs', '2',
                                        '--resume', state]),
            ('the data: images in its splits (train, val, test)', '[12, 12, 0]', '[14, 12, 0]'))
    refused(lambda: train_main(flags + ['--data-dir', folder(tmp_path / 'other', ('ant', 'bee', 'dog')),
                                        '--epochs', '2', '--resume', state]),
            ('the data: class names', "['ant', 'bee', 'cat']", "['ant', 'bee', 'dog']"))
    assert snapshot(out) == before
    shutil.move(str(tmp_path / 'data'), str(tmp_path / 'moved'))  # the same data elsewhere resumes
    res = train_main(flags + ['--data-dir', str(tmp_path / 'moved'), '--epochs', '2', '--resume', state])
    assert [r['epoch'] for r in res['rows']] == [0, 1]


def test_train_resume_may_change_the_drop_rates_in_model_kwargs_too(tmp_path):
    """--drop, --drop-path and --drop-block may change on a resume; so may the same rates given in --model-kwargs
    (also against a state of a version that recorded them there), while its other keys are still compared."""
    out = tmp_path / 'out'
    flags = ['--model', 'resnet32_cifar', '--mixup', '0.2']
    train_main(TINY + ['--epochs', '1', '--output', str(out), '--experiment', 'run', '--model-kwargs',
                       'drop_rate=0.1'] + flags)
    state = out / 'run' / 'state.safetensors'

    def older(meta, tensors):  # as an earlier version recorded it
        meta['settings']['--model-kwargs'] = {'drop_rate': 0.1}
    _rewrite_meta(str(state), older)
    before = snapshot(out)
    refused(lambda: resume_train(out, 'run', flags + ['--model-kwargs', 'drop_rate=0.3', 'global_pool=max']),
            ('--model-kwargs', '{}', "{'global_pool': 'max'}"))
    assert snapshot(out) == before
    res = resume_train(out, 'run', flags + ['--model-kwargs', 'drop_rate=0.3'])
    assert [r['epoch'] for r in res['rows']] == [0, 1]
    import yaml
    with open(out / 'run' / 'args.yaml') as f:
        assert yaml.safe_load(f)['model_kwargs'] == {'drop_rate': 0.3}
