"""Bad input on every command line: out-of-range numbers, a folder for a file and a file for a folder, model
keyword arguments a backbone does not take (all exit 2 with argparse's usage message, naming the flag and the value),
and a training loss that stops being finite (a clear error; the checkpoints of earlier epochs stay as they were)."""
import argparse
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import timm_patchmix  # noqa: F401
from timm_patchmix import demo, hub, pipeline, robustness, train
from timm_patchmix.checkpoint import load_state, load_weights
from timm_patchmix.cli_types import (directory, existing_file, float_range, int_range, new_file, positive_float,
                                     probability)
from timm_patchmix.search import command as search


@pytest.fixture
def paths(tmp_path):
    """A file (it only needs to exist: parsing never reads it) and a folder."""
    f = tmp_path / 'weights.safetensors'
    f.write_bytes(b'not read while parsing')
    d = tmp_path / 'folder'
    d.mkdir()
    return str(f), str(d)


def _cli(name, f):
    """The entry point of each command line, with the arguments it needs besides the one under test."""
    return {
        'train': (train.cli, []),
        'search': (search.cli, ['--checkpoint', f]),
        'pipeline': (pipeline.cli, []),
        'robustness': (robustness.main, ['--checkpoint', f]),
        'demo': (demo.main, []),
    }[name]


def expect_usage_error(capsys, fn, argv, *names, flag=None):
    """``fn(argv)`` exits 2 with argparse's usage message; its error names ``flag`` (alone or with its other
    spelling, ``argument -b/--batch-size: ...``) and contains each of ``names``."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert 'usage:' in err and 'error:' in err and 'Traceback' not in err
    if flag is not None:
        assert re.search(r'error: argument (\S+/)?' + re.escape(flag) + r'(/\S+)?: ', err), err
    for n in names:
        assert n in err, f'{n!r} not in {err!r}'
    return err


RANGE_CASES = [
    # train.py
    ('train', ['--epochs', '0']), ('train', ['--epochs', '-3']), ('train', ['--log-interval', '0']),
    ('train', ['-b', '0']), ('train', ['--batch-size', '-8']), ('train', ['-vb', '0']),
    ('train', ['--validation-batch-size', '0']), ('train', ['--lr', '0']), ('train', ['--lr', '-0.1']),
    ('train', ['--lr', 'nan']), ('train', ['--lr', 'inf']), ('train', ['--lr-base', '0']),
    ('train', ['--patchmix-grid', '0']), ('train', ['--patchmix-grid', '4', '0']),
    ('train', ['--patchmix-prob', '1.5']), ('train', ['--patchmix-prob', '-0.1']), ('train', ['--smoothing', '1.2']),
    ('train', ['--smoothing', '-0.1']), ('train', ['--smoothing', '1']), ('train', ['--guided-prob', '2']),
    ('train', ['--random-prob', '-1']), ('train', ['--mixup-prob', '1.01']), ('train', ['--mixup-switch-prob', '3']),
    ('train', ['--patch-loss-weight', '-1']), ('train', ['--train-subset', '0']), ('train', ['--val-subset', '0']),
    ('train', ['--warmup-epochs', '-1']), ('train', ['--cooldown-epochs', '-2']), ('train', ['--fgsm', '0.1', '-0.1']),
    ('train', ['--fgsm', 'nan']), ('train', ['-j', '-1']), ('train', ['--drop', '1.5']),
    ('train', ['--drop-path', '-1']),
    ('train', ['--momentum', '-0.9']), ('train', ['--weight-decay', '-1']), ('train', ['--input-size', '3', '32', '0']),
    ('train', ['--img-size', '0']), ('train', ['--num-classes', '0']), ('train', ['--in-chans', '0']),
    ('train', ['--mixup', '-1']), ('train', ['--cutmix', 'inf']), ('train', ['--patchmix-alpha', '0']),
    ('train', ['--opt-betas', '0.9', '1.0']), ('train', ['--clip-grad', '-1']), ('train', ['--min-lr', '-0.00001']),
    ('train', ['--mixup-off-epoch', '-1']), ('train', ['--patchmix-off-epoch', '-1']), ('train', ['--epochs', 'two']),
    # search.py
    ('search', ['--k', '0']), ('search', ['--population', '1']), ('search', ['--population', '0']),
    ('search', ['--tournsize', '0']), ('search', ['--hof', '0']), ('search', ['--n-active', '0']),
    ('search', ['--cxpb', '1.5']), ('search', ['--mutpb', '-0.1']), ('search', ['--cxpb', 'nan']),
    ('search', ['--generations', '-1']), ('search', ['--patience', '-1']), ('search', ['--eval-batch-size', '0']),
    ('search', ['--val-subset', '0']), ('search', ['--grid', '0']), ('search', ['--num-classes', '0']),
    # robustness, pipeline (its --train-args go through train.py's parser first), demo
    ('robustness', ['--eps', '-0.1']), ('robustness', ['--eps', '0.1', 'inf']), ('robustness', ['-b', '0']),
    ('robustness', ['--val-subset', '0']),
    ('pipeline', ['--train-args', '--epochs', '0']), ('pipeline', ['--train-args', '-b', '16', '--lr', 'nan']),
    ('demo', ['--num', '0']), ('demo', ['--grid', '0']),
]


@pytest.mark.parametrize('cli, argv', RANGE_CASES, ids=[f'{c}:{" ".join(a)}' for c, a in RANGE_CASES])
def test_out_of_range_numbers_exit_2_naming_flag_and_value(capsys, paths, cli, argv):
    fn, base = _cli(cli, paths[0])
    flag = next(a for a in reversed(argv) if re.match(r'-{1,2}[a-z]', a))
    expect_usage_error(capsys, fn, base + argv, repr(argv[-1]), flag=flag)


@pytest.mark.parametrize('cli, argv, names', [
    ('train', ['--patchmix-grid', '2', '3', '4'], ['--patchmix-grid', '2 3 4']),
    ('train', ['--cutmix-minmax', '0.8', '0.2'], ['--cutmix-minmax', '0.8', '0.2']),
    ('train', ['--no-patch-loss', '--no-image-loss'], ['--no-patch-loss', '--no-image-loss']),
    ('search', ['--grid', '2', '3', '4'], ['--grid', '2 3 4']),
    ('demo', ['--grid', '40'], ['--grid', '40x40', '32x32']),
    ('train', ['--opt', 'no_such_opt'], ['argument --opt', "'no_such_opt'"]),
    ('train', ['--sched', 'no_such_sched'], ['argument --sched', "'no_such_sched'"]),
    ('train', ['--clip-mode', 'no_such_mode'], ['argument --clip-mode', "'no_such_mode'"]),
    # a split name of a two-split dataset that is a typo (it opened the evaluation split), or training on the
    # evaluation split
    ('train', ['--train-split', 'trian'], ["argument --train-split: 'trian' is not a split of patchshapes"]),
    ('train', ['--val-split', 'bogus'], ["argument --val-split: 'bogus' is not a split of patchshapes"]),
    ('train', ['--train-split', 'test'], ["argument --train-split: 'test' names the evaluation split of patchshapes"]),
    ('train', ['--dataset', 'fashion_mnist', '--train-split', 'validation'],
     ["'validation' names the evaluation split of fashion_mnist"]),
    ('train', ['--dataset', 'torch/cifar10', '--val-split', 'tst'], ["'tst' is not a split of torch/cifar10"]),
    ('train', ['--holdout', '0.2', '--val-split', 'training'], ["--val-split names the test split",
                                                                "the training split 'train' here"]),
])
def test_flag_combinations_exit_2(capsys, paths, cli, argv, names):
    fn, base = _cli(cli, paths[0])
    expect_usage_error(capsys, fn, base + argv, *names)


def test_guided_and_random_prob_must_share_one_batch(capsys, paths):
    table = paths[0]
    expect_usage_error(capsys, train.cli, ['--patchmix', '--patchmix-table', table, '--guided-prob', '0.7',
                                           '--random-prob', '0.5'], '--guided-prob 0.7', '--random-prob 0.5', '1.2')


@pytest.mark.parametrize('argv', [
    ['-j', '0'], ['--warmup-epochs', '0'], ['--smoothing', '0'], ['--patchmix-prob', '0'], ['--patchmix-prob', '1'],
    ['--patch-loss-weight', '0'], ['--clip-grad', '0'], ['--mixup-off-epoch', '0'], ['--guided-prob', '1'],
    ['--random-prob', '0'], ['--lr', '1e-6'], ['--cutmix-minmax', '0.2', '0.8'], ['--patchmix-grid', '2', '4'],
    ['--fgsm', '0', '0.3'], ['--drop-path', '0'], ['--seed', '-1'], ['--opt', 'adamw'], ['--opt', 'lookahead_sgd'],
    ['--sched', 'step'], ['--clip-mode', 'value'], ['--clip-mode', 'agc', '--clip-grad', '0.01'],
])
def test_meaningful_values_stay_valid(argv):
    train.resolve_args(argv)


@pytest.mark.parametrize('argv', [['--generations', '0'], ['--patience', '0'], ['--population', '2'],
                                  ['--cxpb', '0', '--mutpb', '1'], ['--tournsize', '1', '--hof', '1']])
def test_meaningful_search_values_stay_valid(paths, argv):
    search.build_parser().parse_args(['--checkpoint', paths[0]] + argv)


# --- paths --------------------------------------------------------------------------------------------------------
def _path_cases():
    # (entry point, argv with F = an existing file, D = an existing folder, flag named in the error, value)
    return [
        (train.cli, ['--resume', 'D'], '--resume', 'D'),
        (train.cli, ['--initial-checkpoint', 'D'], '--initial-checkpoint', 'D'),
        (train.cli, ['--patchmix', '--patchmix-table', 'D'], '--patchmix-table', 'D'),
        (train.cli, ['--resume', 'D/missing.safetensors'], '--resume', 'D/missing.safetensors'),
        (train.cli, ['--output', 'F'], '--output', 'F'),
        (train.cli, ['--output', 'F/sub'], '--output', 'F/sub'),
        (train.cli, ['--data-dir', 'F'], '--data-dir', 'F'),
        (train.cli, ['F'], 'DIR', 'F'),
        (search.cli, ['--checkpoint', 'D'], '--checkpoint', 'D'),
        (search.cli, ['--checkpoint', 'F', '--output', 'F'], '--output', 'F'),
        (search.cli, ['--checkpoint', 'F', '--data-dir', 'F'], '--data-dir', 'F'),
        (robustness.main, ['--checkpoint', 'D'], '--checkpoint', 'D'),
        (robustness.main, ['--checkpoint', 'F', '--output', 'F'], '--output', 'F'),
        (robustness.main, ['--checkpoint', 'F', '--data-dir', 'F'], '--data-dir', 'F'),
        (pipeline.cli, ['--output', 'F'], '--output', 'F'),
        (pipeline.cli, ['--data-dir', 'F'], '--data-dir', 'F'),
        (pipeline.cli, ['--train-args', '--resume', 'D'], '--resume', 'D'),
        (demo.main, ['--output', 'F'], '--output', 'F'),
        (hub.main, ['export', '--checkpoint', 'D', '--output', 'D/new'], '--checkpoint', 'D'),
        (hub.main, ['export', '--checkpoint', 'F', '--output', 'F'], '--output', 'F'),
        (hub.main, ['export', '--checkpoint', 'F', '--table', 'D', '--output', 'D/new'], '--table', 'D'),
        (hub.main, ['push', '--checkpoint', 'F', '--repo-id', 'u/n', '--dry-run', '--folder', 'F'], '--folder', 'F'),
        (hub.main, ['backbone', 'D', '--output', 'D/b.safetensors'], 'source', 'D'),
        (hub.main, ['backbone', 'F', '--output', 'D'], '--output', 'D'),
    ]


@pytest.mark.parametrize('case', range(len(_path_cases())))
def test_folder_for_file_and_file_for_folder(capsys, paths, case):
    fn, argv, flag, value = _path_cases()[case]
    f, d = paths

    def sub(a):
        return a.replace('F', f, 1) if a.startswith('F') else a.replace('D', d, 1) if a.startswith('D') else a
    err = expect_usage_error(capsys, fn, [sub(a) for a in argv], repr(sub(value)), flag=flag)
    assert ('the folder' in err or 'does not exist' in err) if value.startswith('D') else 'the file' in err


def test_path_types_directly(tmp_path):
    f = tmp_path / 'f'
    f.write_text('x')
    assert existing_file(str(f)) == str(f) and new_file(str(tmp_path / 'new')) == str(tmp_path / 'new')
    assert directory(str(tmp_path)) == str(tmp_path) and directory(str(tmp_path / 'a' / 'b')) == str(tmp_path / 'a/b')
    for fn, arg in [(existing_file, tmp_path), (existing_file, tmp_path / 'missing'), (existing_file, ''),
                    (new_file, tmp_path), (directory, f), (directory, f / 'below'), (directory, '')]:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(str(arg))


def test_number_types_directly():
    assert int_range(2)('2') == 2 and positive_float('1e-30') == 1e-30 and probability('1') == 1.0
    assert float_range(0, 1, hi_open=True)('0') == 0.0
    for fn, text in [(int_range(2), '1'), (int_range(0, 3), '4'), (int_range(1), '1.5'), (positive_float, '0'),
                     (positive_float, '-inf'), (positive_float, 'nan'), (probability, 'nan'), (probability, '1.0001'),
                     (float_range(0, 1, hi_open=True), '1')]:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text).replace('.', r'\.')):
            fn(text)


# --- model keyword arguments --------------------------------------------------------------------------------------
TINY = ['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress', '--device', 'cpu']


@pytest.mark.parametrize('extra, names', [
    (['--model-kwargs', 'patch_size=4'], ['argument --model-kwargs', 'patch_size=4', 'resnet32_cifar']),
    (['--model', 'patchhead_resnet32_cifar', '--model-kwargs', 'patch_size=4'],
     ['argument --model-kwargs', 'patch_size', 'patchhead_resnet32_cifar']),
    (['--model-kwargs', 'not_a_kwarg=3'], ['argument --model-kwargs', 'not_a_kwarg', 'cannot be recorded']),
    (['--model-kwargs', 'pretrained_cfg_overlay=3'], ['argument --model-kwargs', 'pretrained_cfg_overlay']),
    (['--model-kwargs', 'num_classes=3'], ['argument --model-kwargs', 'num_classes', '--num-classes']),
])
def test_model_kwargs_a_backbone_does_not_take(capsys, tmp_path, extra, names):
    expect_usage_error(capsys, train.cli, TINY + ['--output', str(tmp_path), '--experiment', 'kw'] + extra, *names)
    assert not os.path.exists(tmp_path / 'kw'), 'stopped before the run folder is made'


@pytest.mark.parametrize('extra, flag, names', [
    # a key of --model-kwargs that a flag given beside it sets to another value (timm's create_model refuses both)
    (['--drop', '0.1', '--model-kwargs', 'drop_rate=0.2'], '--model-kwargs', ['drop_rate=0.2 differs from --drop 0.1']),
    (['--drop-path', '0.1', '--model-kwargs', 'drop_path_rate=0.2'], '--model-kwargs',
     ['drop_path_rate=0.2 differs from --drop-path 0.1']),
    (['--model', 'patchhead_resnet8_cifar', '--patchmix-grid', '2', '--model-kwargs', 'grid=4'], '--model-kwargs',
     ['grid=4 differs from --patchmix-grid 2 2']),
    (['--model', 'patchhead_resnet8_cifar', '--per-position-head', '--model-kwargs', 'per_position=False'],
     '--model-kwargs', ['per_position=False differs from --per-position-head,']),
    (['--drop-block', '0.1', '--model-kwargs', 'drop_block_rate=0.2'], '--model-kwargs',
     ['drop_block_rate=0.2 differs from --drop-block 0.1']),
    # the data's channels follow --in-chans/--input-size: in_chans=1 in --model-kwargs alone gave a 1-channel
    # stem 3-channel images (a RuntimeError at the first forward)
    (['--model-kwargs', 'in_chans=1'], '--model-kwargs',
     ['in_chans=1 differs from the 3 channels', 'give --in-chans 1']),
    (['--in-chans', '1', '--input-size', '3', '32', '32'], '--in-chans',
     ['--in-chans 1 and --input-size 3 32 32 name different channel counts']),
    # images load as greyscale or RGB: 4 (or 2) channels passed every check and failed mid-epoch (a broadcast error)
    (['--in-chans', '4'], '--in-chans', ['images load as greyscale (1 channel) or RGB (3)', 'cannot have 4 channels']),
    (['--input-size', '2', '32', '32'], '--input-size', ['cannot have 2 channels']),
    # a built-in dataset reads no folder: --data-dir went unused (and chose timm's recipe: resnet50, 300 epochs)
    (['--dataset', 'patchshapes', '--data-dir', '.'], '--data-dir',
     ['--dataset patchshapes is built in and reads no folder, so --data-dir . would go unused']),
    (['--dataset', 'sklearn_digits', '--data-dir', '.'], '--data-dir', ['--dataset sklearn_digits is built in']),
    # a builder's assertion without a message (timm's ResNet: assert output_stride in (8, 16, 32))
    (['--model', 'resnet18', '--model-kwargs', 'output_stride=7'], '--model-kwargs',
     ['model resnet18 cannot be built with output_stride=7', 'assert output_stride in (8, 16, 32)']),
    (['--model', 'patchhead_resnet18', '--model-kwargs', 'output_stride=7'], '--model-kwargs',
     ['model patchhead_resnet18 cannot be built with output_stride=7', 'AssertionError']),
    # a ViT of a fixed size: timm's assertion at the first batch (the patch head's check let it through as well)
    (['--model', 'test_vit3', '--img-size', '32'], '--img-size',
     ["test_vit3 cannot take an input of 32x32 (AssertionError: Input height (32) doesn't match model (160).)",
      '--model-kwargs img_size=32']),
    (['--model', 'patchhead_test_vit3', '--input-size', '3', '32', '32'], '--input-size',
     ['patchhead_test_vit3 cannot take an input of 32x32']),
])
def test_model_settings_that_contradict_or_cannot_build(capsys, tmp_path, extra, flag, names):
    expect_usage_error(capsys, train.cli, TINY + ['--output', str(tmp_path), '--experiment', 'kw'] + extra, *names,
                       flag=flag)
    assert not os.path.exists(tmp_path / 'kw'), 'stopped before the run folder is made'


def test_a_model_of_other_input_channels_is_refused_before_the_run(tmp_path, capsys):
    """A local-dir: model built for 4-channel inputs, with no flag naming channels: its data config asks for 4,
    which images cannot give (it failed mid-epoch); one error line, no run folder."""
    import timm
    from timm.models import save_for_hf
    m = timm.create_model('resnet8_cifar', in_chans=4, num_classes=10)
    m.pretrained_cfg = dict(m.pretrained_cfg, input_size=(4, 32, 32))
    save_for_hf(m, str(tmp_path / 'four'), model_args={'in_chans': 4}, safe_serialization=True)
    with pytest.raises(SystemExit) as e:
        train.cli(TINY + ['--model', f'local-dir:{tmp_path / "four"}', '--pretrained', '--output', str(tmp_path),
                          '--experiment', 'run'])
    assert 'takes 4-channel inputs, and images load as greyscale (1 channel) or RGB (3); give --in-chans 1 or 3' in \
        str(e.value.code)
    assert 'Traceback' not in capsys.readouterr().err and not os.path.exists(tmp_path / 'run')


def test_model_kwargs_without_the_flag_still_reach_the_model():
    # the refusal is of a key given twice: alone, --model-kwargs sets it (with --drop at its default of 0)
    from timm_patchmix.engine import TrainConfig
    from timm_patchmix.engine.model import build_model
    model, kwargs = build_model(TrainConfig(model='resnet8_cifar', model_kwargs={'drop_rate': 0.2}), 10)
    assert model.drop_rate == 0.2 and kwargs['drop_rate'] == 0.2
    model, kwargs = build_model(TrainConfig(model='patchhead_resnet8_cifar', model_kwargs={'grid': 2}), 10)
    assert tuple(model.grid) == (2, 2) and kwargs['grid'] == 2


def test_the_same_value_in_both_places_is_one_setting(tmp_path):
    # equal values are the same run; among them a run's args.yaml, whose grid is the --model-kwargs grid it came
    # from, rerun with -c
    from timm_patchmix.engine import TrainConfig, train as run
    from timm_patchmix.train import parse_config
    for argv in (['--drop', '0.2', '--model-kwargs', 'drop_rate=0.2'], ['--patchmix-grid', '2', '--model-kwargs',
                 'grid=(2, 2)'], ['--input-size', '1', '32', '32', '--model-kwargs', 'in_chans=1'],
                 ['--in-chans', '1', '--model-kwargs', 'in_chans=1'], ['--model-kwargs', 'in_chans=3'],
                 ['--per-position-head', '--model-kwargs', 'per_position=True'], ['--gp', 'max', '--model-kwargs',
                 'global_pool=max']):
        parse_config(argv)
    res = run(TrainConfig(model='patchhead_resnet8_cifar', patchmix=True, model_kwargs={'grid': 2}, epochs=1,
                          output=str(tmp_path), experiment='kw', train_subset=32, val_subset=16, batch_size=16,
                          workers=0, no_progress=True, device='cpu'))
    cfg = parse_config(['-c', os.path.join(res.output, 'args.yaml'), '--seed', '1'])
    assert cfg.grid == (2, 2) and cfg.model_kwargs == {'grid': 2} and cfg.seed == 1


def test_input_size_channels_build_the_model_as_timm_does(tmp_path):
    # timm's train.py builds the model with in_chans = --input-size's first value when --in-chans is not given;
    # before, the model kept 3 channels and the first forward of the 1-channel data failed
    from timm_patchmix.engine import TrainConfig, train as run
    cfg = TrainConfig(model='resnet8_cifar', input_size=(1, 32, 32), epochs=1, output=str(tmp_path),
                      experiment='one', train_subset=32, val_subset=16, batch_size=16, workers=0, no_progress=True,
                      device='cpu')
    result = run(cfg)
    state, meta = load_weights(os.path.join(result.output, 'last.safetensors'))
    assert meta['model_kwargs']['in_chans'] == 1 and meta['data']['input_size'] == [1, 32, 32]
    assert state['conv1.weight'].shape[1] == 1


@pytest.mark.parametrize('model, names', [
    ('patchhead_resnet50', ['patchhead_resnet50 has no weights', 'a1_in1k']),
    ('patchhead_resnet50.gpm_in1k', ['not published', 'docs/hub.md']),
])
def test_pretrained_without_weights_stops_before_the_run_folder(capsys, tmp_path, model, names):
    with pytest.raises(SystemExit) as e:
        train.cli(TINY + ['--model', model, '--pretrained', '--output', str(tmp_path), '--experiment', 'pt'])
    assert all(n in str(e.value) for n in names), e.value
    assert not os.path.exists(tmp_path / 'pt')


# --- a non-finite loss --------------------------------------------------------------------------------------------
def test_non_finite_loss_stops_the_run_and_keeps_earlier_checkpoints(capsys, tmp_path):
    # epoch 0 trains at the warm-up lr 0.01 and is saved; epoch 1 jumps to lr ~1e30, so its first update makes the
    # weights explode and the loss of step 2 is not finite
    argv = TINY + ['--epochs', '2', '--warmup-epochs', '1', '--warmup-lr', '0.01', '--lr', '1e30',
                   '--output', str(tmp_path), '--experiment', 'nan']
    assert train.cli(argv) == 1
    err = capsys.readouterr().err
    assert 'non-finite training loss' in err and 'at epoch 1, step 2 of 2' in err, err
    assert 'Traceback' not in err
    out = tmp_path / 'nan'
    with open(out / 'summary.csv') as f:
        assert [line.split(',')[0] for line in f.read().splitlines()[1:]] == ['0']
    for name in ('best.safetensors', 'last.safetensors'):
        weights, meta = load_weights(str(out / name))
        assert meta['epoch'] == 0
        assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    # best and last were both written at the end of epoch 0, and nothing after: the same weights and metadata
    # (not compared as bytes: safetensors does not fix the order of metadata keys)
    (wb, mb), (wl, ml) = load_weights(str(out / 'best.safetensors')), load_weights(str(out / 'last.safetensors'))
    assert mb == ml and wb.keys() == wl.keys() and all(torch.equal(wb[k], wl[k]) for k in wb)
    assert load_state(str(out / 'state.safetensors'))['meta']['epoch'] == 0


def test_a_diverged_last_update_stops_the_run_instead_of_saving_it(capsys, tmp_path):
    # one batch an epoch: epoch 1's training loss is computed before its only update (finite), and that update at lr
    # ~1e30 makes the weights explode, so the epoch's evaluation loss is not finite. The run saved that epoch as
    # last/state and exited 0; it now stops before saving it, as for a non-finite training loss.
    argv = TINY + ['--epochs', '2', '--warmup-epochs', '1', '--warmup-lr', '0.01', '--lr', '1e30', '--train-subset',
                   '16', '--output', str(tmp_path), '--experiment', 'nan']
    assert train.cli(argv) == 1
    err = capsys.readouterr().err
    assert 'non-finite evaluation loss' in err and 'at the end of epoch 1' in err and 'Traceback' not in err, err
    out = tmp_path / 'nan'
    with open(out / 'summary.csv') as f:
        rows = f.read().splitlines()[1:]
    assert [line.split(',')[0] for line in rows] == ['0']
    for name in ('best.safetensors', 'last.safetensors'):
        weights, meta = load_weights(str(out / name))
        assert meta['epoch'] == 0
    assert load_state(str(out / 'state.safetensors'))['meta']['epoch'] == 0


def test_non_finite_loss_error_message():
    e = train.NonFiniteLossError(3, 17, 40, math.nan)
    assert 'epoch 3, step 17 of 40' in str(e) and 'nan' in str(e) and isinstance(e, RuntimeError)
    e = train.NonFiniteLossError(0, 1, 5, 2.5, bad_ranks=1, world_size=2)
    assert 'on 1 of 2 processes at epoch 0, step 1 of 5' in str(e)
    e = train.NonFiniteLossError(2, 5, 5, math.inf, evaluation=True)
    assert 'non-finite evaluation loss (inf) at the end of epoch 2' in str(e) and e.evaluation


def test_robustness_errors_are_one_line_not_tracebacks(capsys, tmp_path):
    """A file that is not a training checkpoint, a missing dataset or an unknown device: `error: ...` and exit 1
    (exit 2 for the device flag), before any data is attacked; never a traceback."""
    from timm_patchmix.checkpoint import save_weights
    not_ckpt = tmp_path / 'table.json'
    not_ckpt.write_text('{"pairs": []}')
    bare = tmp_path / 'bare.safetensors'  # weights without the metadata naming a model
    save_weights(str(bare), {'w': torch.zeros(2)})
    for path, message in (not_ckpt, 'not a readable safetensors file'), (bare, 'carries no timm_patchmix'):
        assert robustness.main(['--checkpoint', str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith('error: ') and message in err and 'Traceback' not in err, err
    ck = tmp_path / 'tiny'
    res = train.main(['--epochs', '1', '-b', '16', '-j', '0', '--train-subset', '32', '--val-subset', '16',
                      '--no-progress', '--output', str(ck)])
    best = os.path.join(res['output'], 'best.safetensors')
    assert robustness.main(['--checkpoint', best, '--dataset', 'fashion_mnist', '--data-dir', str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith('error: ') and 'Traceback' not in err, err
    expect_usage_error(capsys, robustness.main, ['--checkpoint', best, '--device', 'foo'], "'foo'", flag='--device')
    from timm_patchmix.search import main as search_main
    # (mps and xpu: torch's RuntimeError at the first tensor moved there, a traceback)
    for device, message in (('foo', "not a torch device: 'foo'"), ('meta', 'holds no data'),
                            *((('cuda', 'names a CUDA device, and this machine has none'),)
                              if not torch.cuda.is_available() else ()),
                            *((('mps', 'names an Apple MPS device, and this machine or this torch build has none'),)
                              if not torch.backends.mps.is_available() else ()),
                            *((('xpu:0', 'names an Intel XPU device'),)
                              if not (hasattr(torch, 'xpu') and torch.xpu.is_available()) else ())):
        expect_usage_error(capsys, search_main, ['--checkpoint', best, '--device', device], message, flag='--device')
        if device != 'cuda':  # train.py: one error line, before anything is written (its CUDA case is its own test)
            with pytest.raises(SystemExit, match=f'--device {device}: .*' + re.escape(message)):
                train.main(['--epochs', '1', '--output', str(tmp_path / 'd'), '--device', device])
            assert not (tmp_path / 'd').exists()
    expect_usage_error(capsys, robustness.main, ['--checkpoint', best, '--val-split', 'nosuch'],
                       "'nosuch' is not a split of patchshapes", flag='--val-split')


def test_split_names_of_two_split_datasets():
    """Every known name opens one of the two fixed splits; another name is refused (it opened the evaluation
    split); an image folder or another timm dataset names its own splits, which its loader checks."""
    from types import SimpleNamespace
    from timm_patchmix.data import split_name_problem
    from timm_patchmix.search.inputs import SearchUsageError, _scored_split
    for name in ('train', 'training', 'validation', 'val', 'test', 'eval'):
        assert split_name_problem('fashion_mnist', '', name) is None
    assert split_name_problem('', '', 'validation', training=True) is not None
    assert split_name_problem('', 'my_images', 'trian', training=True) is None      # an image folder's own name
    assert split_name_problem('torch/imagenet', '', 'custom') is None
    cfg = SimpleNamespace(val_split='vaildation', checkpoint='ft.safetensors')
    with pytest.raises(SearchUsageError, match=r"--val-split vaildation: 'vaildation' is not a split of patchshapes"):
        _scored_split(cfg, {'val_split': 'validation'}, '', '')
    cfg = SimpleNamespace(val_split='val', checkpoint='ft.safetensors')
    assert _scored_split(cfg, {'val_split': 'validation'}, '', '') == 'val'


def test_an_unknown_pooling_is_a_usage_error_under_python_O(tmp_path):
    """timm asserts the pool type; under `python -O` the assert is gone and `--gp bogus` ended in an AttributeError
    traceback from the model's first forward. It is the same usage error as without -O, before any file."""
    r = subprocess.run([sys.executable, '-O', '-m', 'timm_patchmix.train', '--gp', 'bogus', '--epochs', '1',
                        '--output', str(tmp_path)] + TINY, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert "error: argument --gp: resnet32_cifar with the global pooling 'bogus' gives no logits" in r.stderr
    assert os.listdir(tmp_path) == []
