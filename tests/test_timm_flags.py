"""timm's flags mean what they mean in timm: the plateau schedule on a loss waits for the loss to stop falling,
``--lr-base`` sets the lr even under a recipe that has one, ``--decay-milestones``/``--patience-epochs``/``--dr``
reach the scheduler, a Mixup setting PatchMix or the data path would ignore is refused, ``--pretrained`` without
weights is a one-line error, and a timm ``.pth``/``.pth.tar`` is named for what it is."""
import dataclasses
import os

import pytest
import timm
import torch

import timm_patchmix  # noqa: F401
from timm_patchmix import train as train_cli
from timm_patchmix.checkpoint import CheckpointError, load_state, load_weights, save_weights
from timm_patchmix.engine import ConfigError, TrainConfig, TrainSetupError
from timm_patchmix.engine.config import resolve, scaled_lr
from timm_patchmix.engine.model import build_model
from timm_patchmix.engine.run import _optimization


def _model():
    return timm.create_model('resnet8_cifar', num_classes=10)


def _resolved(**kw):
    m = _model()
    return resolve(TrainConfig(model='resnet8_cifar', **kw), model=m, num_classes=10,
                   data_config=timm.data.resolve_data_config({}, model=m)), m


def _lrs(cfg, model, metrics):
    """The lr of each epoch when the scheduler is stepped with ``metrics``, as the training loop steps it."""
    optimizer, scheduler, _ = _optimization(cfg, model, steps_per_epoch=1)
    out = []
    for epoch, metric in enumerate(metrics):
        out.append(optimizer.param_groups[0]['lr'])
        scheduler.step(epoch + 1, metric)
    return out


# --- the schedule -------------------------------------------------------------------------------------------------
def test_plateau_on_loss_decays_when_the_loss_stops_falling():
    cfg, m = _resolved(sched='plateau', eval_metric='loss', patience_epochs=2, lr=0.1, warmup_epochs=0)
    falling = [2.0 - 0.1 * k for k in range(8)]
    assert _lrs(cfg, m, falling) == [0.1] * 8  # a falling loss is progress: no decay
    decayed = pytest.approx([0.1] * 4 + [0.01] * 3 + [0.001])  # patience 2: a decay after 3 epochs without progress
    assert _lrs(cfg, m, [1.0] * 8) == decayed  # a loss that stops falling
    assert _lrs(cfg, m, [1.0 + 0.1 * k for k in range(8)]) == decayed  # or rises


def test_plateau_on_accuracy_decays_when_it_stops_rising():
    cfg, m = _resolved(sched='plateau', eval_metric='top1', patience_epochs=2, lr=0.1, warmup_epochs=0)
    assert _lrs(cfg, m, [10.0 + k for k in range(8)]) == [0.1] * 8
    assert _lrs(cfg, m, [10.0 - k for k in range(8)]) == pytest.approx([0.1] * 4 + [0.01] * 3 + [0.001])


def test_patience_epochs_reaches_the_scheduler():
    flat = [1.0] * 8
    first = []
    for patience in (1, 4):
        cfg, m = _resolved(sched='plateau', eval_metric='loss', patience_epochs=patience, lr=0.1, warmup_epochs=0)
        lrs = _lrs(cfg, m, flat)
        first.append(next(k for k, lr in enumerate(lrs) if lr < 0.1))
    assert first[0] < first[1]


def test_decay_milestones_reach_multistep():
    cfg, m = _resolved(sched='multistep', decay_milestones=(2, 4), decay_rate=0.5, lr=0.1, warmup_epochs=0,
                       epochs=6)
    # timm's multistep counts a milestone from 1: the lr of epoch index 1 is the first decayed one for milestone 2
    assert _lrs(cfg, m, [0.0] * 6) == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025, 0.025])
    cfg, m = _resolved(sched='multistep', decay_rate=0.5, lr=0.1, warmup_epochs=0, epochs=6)
    assert _lrs(cfg, m, [0.0] * 6) == [0.1] * 6  # timm's default milestones, 90, 180 and 270
    cli = train_cli.resolve_args(['--decay-milestones', '2', '4', '--dr', '0.5', '--patience-epochs', '3'])
    assert (cli.decay_milestones, cli.decay_rate, cli.patience_epochs) == ((2, 4), 0.5, 3)
    assert TrainConfig().decay_milestones == (90, 180, 270)  # timm's defaults
    with pytest.raises(ConfigError, match='decay_milestones'):
        TrainConfig(decay_milestones=(0, 3))


# --- the learning rate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize('recipe', [None, 'demo', 'paper-cifar', 'timm'])
def test_lr_base_wins_over_a_recipes_lr(recipe):
    cfg, _ = _resolved(recipe=recipe, lr_base=0.4, batch_size=32)
    assert cfg.lr == pytest.approx(0.4 * 32 / 256)
    cfg, _ = _resolved(recipe=recipe, lr_base_size=64, batch_size=32)  # timm's base lr 0.1 at another size
    assert cfg.lr == pytest.approx(0.1 * 32 / 64)
    cfg, _ = _resolved(recipe=recipe, lr=0.03, lr_base=0.4, batch_size=32)  # --lr given: it wins
    assert cfg.lr == 0.03


def test_recipe_lr_without_lr_base():
    assert _resolved()[0].lr == 0.1  # the demo recipe's
    assert _resolved(recipe='paper-cifar')[0].lr == 0.1
    cfg, _ = _resolved(recipe='timm', batch_size=64)
    assert cfg.lr == pytest.approx(0.1 * 64 / 256) and (cfg.lr_base, cfg.lr_base_size, cfg.lr_base_scale) == \
        (0.1, 256, '')
    cfg = TrainConfig(lr_base_scale='sqrt', batch_size=64, opt='sgd').with_recipe()
    assert cfg.lr is None and scaled_lr(cfg) == pytest.approx(0.1 * (64 / 256) ** 0.5)


# --- settings another part of the run would ignore ----------------------------------------------------------------
def test_mixup_off_epoch_with_patchmix_is_refused():
    with pytest.raises(ConfigError, match='give --patchmix-off-epoch 3 instead') as e:
        TrainConfig(patchmix=True, mixup_off_epoch=3)
    assert e.value.flag == '--mixup-off-epoch'
    assert TrainConfig(patchmix=True, patchmix_off_epoch=3).patchmix_off_epoch == 3
    assert TrainConfig(mixup=0.2, mixup_off_epoch=3).mixup_off_epoch == 3


@pytest.mark.parametrize('path', [dict(device_data=True), dict(no_prefetcher=True)])
def test_half_mixup_mode_off_the_collate_path_is_refused(path):
    with pytest.raises(ConfigError, match='half is a mode of the loader') as e:
        TrainConfig(mixup=0.2, mixup_mode='half', **path)
    assert e.value.flag == '--mixup-mode'
    assert TrainConfig(mixup=0.2, mixup_mode='elem', **path).mixup_mode == 'elem'
    assert TrainConfig(mixup=0.2, mixup_mode='half').mixup_mode == 'half'  # the loader's collate mixer has it


@pytest.mark.parametrize('mixing', [dict(mixup=0.2), dict(cutmix=1.0), dict(cutmix=1.0, mixup_mode='pair')])
def test_an_odd_batch_with_timms_mixup_is_a_usage_error(mixing):
    """timm's Mixup and FastCollateMixup assert an even batch at the first one: a traceback after the data and the
    model were built. PatchMix takes odd batches (pair mode leaves the odd one out)."""
    with pytest.raises(ConfigError, match="15 is odd, and timm's Mixup/CutMix") as e:
        TrainConfig(batch_size=15, **mixing)
    assert e.value.flag == '-b/--batch-size'
    assert TrainConfig(batch_size=16, **mixing).batch_size == 16
    assert TrainConfig(batch_size=15, patchmix=True, patchmix_mode='pair').batch_size == 15


def test_contradicting_flags_exit_2(capsys):
    for argv in (['--patchmix', '--mixup', '0.2'], ['--patchmix', '--mixup-off-epoch', '1'],
                 ['--mixup', '0.2', '--mixup-mode', 'half', '--no-prefetcher'],
                 ['--patchmix-table', 'masks.json'], ['--cutmix', '1', '-b', '7']):
        with pytest.raises(SystemExit) as e:
            train_cli.resolve_args(argv)
        assert e.value.code == 2, argv
    assert 'Traceback' not in capsys.readouterr().err


# --- weights --------------------------------------------------------------------------------------------------
def test_pretrained_without_weights_is_a_setup_error():
    cfg = dataclasses.replace(TrainConfig(model='resnet8_cifar', pretrained=True).with_recipe(), pretrained=True)
    with pytest.raises(TrainSetupError, match='--model resnet8_cifar --pretrained: its pretrained weights cannot be '
                                              'loaded: RuntimeError: No pretrained weights exist'):
        build_model(cfg, 10)


def test_pretrained_download_failure_is_a_setup_error(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*a, **kw):
        raise LocalEntryNotFoundError('cannot find the requested files in the local cache')
    monkeypatch.setattr(timm, 'create_model', offline)
    with pytest.raises(TrainSetupError, match='LocalEntryNotFoundError: cannot find the requested files'):
        build_model(TrainConfig(model='resnet18', pretrained=True).with_recipe(), 10)
    # without --pretrained, or an error that is not about weights, the error is the model's own
    with pytest.raises(LocalEntryNotFoundError):
        build_model(TrainConfig(model='resnet18').with_recipe(), 10)

    def broken(*a, **kw):
        raise RuntimeError('shape mismatch in block 3')
    monkeypatch.setattr(timm, 'create_model', broken)
    with pytest.raises(RuntimeError, match='shape mismatch in block 3'):
        build_model(TrainConfig(model='resnet18', pretrained=True).with_recipe(), 10)


@pytest.mark.parametrize('zipped', [True, False])
def test_a_torch_save_file_is_named_and_never_unpickled(tmp_path, monkeypatch, zipped):
    path = str(tmp_path / 'model_best.pth.tar')
    torch.save({'state_dict': _model().state_dict()}, path, _use_new_zipfile_serialization=zipped)

    def no_load(*a, **kw):
        raise AssertionError('torch.load was called')
    monkeypatch.setattr(torch, 'load', no_load)
    for read in (load_weights, load_state):
        with pytest.raises(CheckpointError) as e:
            read(path)
        msg = str(e.value)
        assert 'not a safetensors file' in msg and 'reads only safetensors' in msg and 'corrupt' not in msg
        assert ('torch.save zip archive' if zipped else 'a pickle') in msg
    open(path, 'wb').write(b'\x00\x01garbage')  # neither: still called what it may be
    with pytest.raises(CheckpointError, match=r'truncated or corrupt\?'):
        load_weights(path)


def test_resume_from_weights_names_the_state_beside_them(tmp_path):
    weights = str(tmp_path / 'last.safetensors')
    save_weights(weights, _model().state_dict(), {'model': 'resnet8_cifar'})
    with pytest.raises(CheckpointError) as e:
        load_state(weights)
    assert 'use --initial-checkpoint' in str(e.value) and 'state.safetensors' not in str(e.value)
    open(os.path.join(tmp_path, 'state.safetensors'), 'wb').close()  # a run folder: the state is beside the weights
    with pytest.raises(CheckpointError, match=r'resume from .*state\.safetensors, the training state train\.py '
                                              r'writes beside it, or use --initial-checkpoint'):
        load_state(weights)


# --- the timm flags docs/training.md lists as not offered --------------------------------------------------------
def _not_offered():
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, 'docs', 'training.md'), encoding='utf-8').read()
    block = text.split('<!-- not-offered -->')[1].split('<!-- /not-offered -->')[0]
    return re.findall(r'`(-[-\w]+)`', block)


def test_the_documented_missing_timm_flags_are_refused(capsys):
    flags = _not_offered()
    assert len(flags) == 25 and len(set(flags)) == len(flags)
    options = {o for a in train_cli.build_parser()._actions for o in a.option_strings}
    assert not set(flags) & options  # a flag added to train.py leaves the list
    for flag in flags:
        with pytest.raises(SystemExit) as e:
            train_cli.resolve_args([flag, '1'] if flag != '-d' else [flag, 'x'])
        assert e.value.code == 2
        assert f'unrecognized arguments: {flag}' in capsys.readouterr().err, flag


# --- timm's scheduler options -------------------------------------------------------------------------------------
def _resolved_flags(argv, model_name='resnet8_cifar'):
    """``train.py``'s flags ``argv`` as a config resolved on ``model_name``, and the model."""
    m = timm.create_model(model_name, num_classes=10)
    cfg = train_cli.parse_config(['--model', model_name] + argv)
    return resolve(cfg, model=m, num_classes=10, data_config=timm.data.resolve_data_config({}, model=m)), m


def _epoch_lrs(argv, epochs):
    """The lr of each epoch under ``train.py``'s flags ``argv`` (on resnet8_cifar), stepped as the loop steps the
    scheduler, and the number of epochs timm's factory makes of them."""
    cfg, m = _resolved_flags(['--lr', '0.1', '--min-lr', '0', '--warmup-lr', '0.01', '--sched', 'cosine'] + argv)
    return _lrs(cfg, m, [0.0] * epochs), _optimization(cfg, m, steps_per_epoch=1)[2]


def _cosine(t, span, peak, k=1.0):
    import math
    return 0.5 * peak * (1 + math.cos(math.pi * t ** k / span ** k))


def test_cycles_restart_the_cosine_and_lengthen_the_run():
    lrs, epochs = _epoch_lrs(['--epochs', '4', '--warmup-epochs', '0', '--lr-cycle-limit', '2'], 8)
    assert epochs == 8  # timm's train.py: --epochs per cycle
    assert lrs == pytest.approx([_cosine(t, 4, 0.1) for t in range(4)] + [_cosine(t, 4, 0.05) for t in range(4)])
    lrs, epochs = _epoch_lrs(['--epochs', '4', '--warmup-epochs', '0', '--lr-cycle-limit', '2', '--lr-cycle-decay',
                              '1.0', '--lr-cycle-mul', '2'], 12)
    assert epochs == 12  # cycles of 4 and 8 epochs
    assert lrs == pytest.approx([_cosine(t, 4, 0.1) for t in range(4)] + [_cosine(t, 8, 0.1) for t in range(8)])
    lrs, epochs = _epoch_lrs(['--epochs', '4', '--warmup-epochs', '0'], 4)
    assert epochs == 4 and lrs == pytest.approx([_cosine(t, 4, 0.1) for t in range(4)])  # the default: one cycle


def test_k_decay_and_warmup_prefix_shape_the_schedule():
    lrs, _ = _epoch_lrs(['--epochs', '4', '--warmup-epochs', '0', '--lr-k-decay', '2'], 4)
    assert lrs == pytest.approx([_cosine(t, 4, 0.1, k=2) for t in range(4)])
    # warm-up 2 epochs from 0.01: without the prefix the 6 epochs of the cosine count them; with it the whole cosine
    # follows them, and the run is 2 epochs longer (timm's)
    counted, n_counted = _epoch_lrs(['--epochs', '6', '--warmup-epochs', '2'], 6)
    prefixed, n_prefixed = _epoch_lrs(['--epochs', '6', '--warmup-epochs', '2', '--warmup-prefix'], 8)
    assert (n_counted, n_prefixed) == (6, 8)
    assert counted[:2] == prefixed[:2] == pytest.approx([0.01, 0.055])
    assert counted[2:] == pytest.approx([_cosine(t, 6, 0.1) for t in range(2, 6)])
    assert prefixed[2:] == pytest.approx([_cosine(t, 6, 0.1) for t in range(6)])


def test_lr_noise_is_bounded_seeded_and_only_where_asked():
    base = ['--epochs', '10', '--warmup-epochs', '0']
    clean, _ = _epoch_lrs(base, 10)
    noisy, _ = _epoch_lrs(base + ['--lr-noise', '0.5', '--lr-noise-pct', '0.2'], 10)
    again, _ = _epoch_lrs(base + ['--lr-noise', '0.5', '--lr-noise-pct', '0.2'], 10)
    other, _ = _epoch_lrs(base + ['--lr-noise', '0.5', '--lr-noise-pct', '0.2', '--seed', '7'], 10)
    assert noisy == again and noisy != other  # seeded by --seed, as in timm: a resume replays it
    assert noisy[:5] == pytest.approx(clean[:5])  # from half the epochs on
    assert any(abs(n / c - 1) > 1e-3 for n, c in zip(noisy[5:-1], clean[5:-1]))
    assert all(abs(n / c - 1) <= 0.2 + 1e-9 for n, c in zip(noisy[5:-1], clean[5:-1]))
    window, _ = _epoch_lrs(base + ['--lr-noise', '0.2', '0.5'], 10)  # between two fractions
    assert window[:2] == pytest.approx(clean[:2]) and window[5:] == pytest.approx(clean[5:])


@pytest.mark.parametrize('flags, message', [
    (['--lr-noise', '0.1', '0.2', '0.3'], 'a sequence of 1 to 2 values'),
    (['--lr-cycle-limit', '0'], 'must be an integer >= 1'),
    (['--lr-cycle-mul', '0'], 'must be a finite number > 0'),
    (['--lr-k-decay', '-1'], 'must be a finite number > 0'),
    (['--lr-noise-pct', '-0.1'], 'must be a finite number >= 0'),
    # ranges that add noise to no epoch (timm takes fractions of the schedule), and milestones out of order (timm
    # bisects them: both decays came at the first)
    (['--lr-noise', '0.8', '0.2'], 'START < END, got [0.8, 0.2]: this range adds noise to no epoch'),
    (['--sched', 'multistep', '--decay-milestones', '3', '1'],
     'milestones must be epochs in increasing order, got [3, 1]'),
    # rsqrt: the default --decay-epochs 90 longer than the run, and no warmup to take its timescale from (timm's
    # factory raised these once the data and the model were built)
    (['--sched', 'rsqrt', '--epochs', '20', '--warmup-epochs', '2'],
     '--decay-epochs (90) of the 18 epochs after the warmup'),
    (['--sched', 'rsqrt', '--epochs', '20', '--warmup-epochs', '2', '--decay-epochs', '21', '--warmup-prefix'],
     '--decay-epochs (21) of the 20 epochs after the warmup'),
    (['--sched', 'rsqrt', '--epochs', '300', '--warmup-epochs', '0'], 'give --warmup-epochs of 1 or more'),
    (['--sched', 'rsqrt', '--epochs', '3', '--warmup-epochs', '1', '--decay-epochs', '0.2'],
     '(0.2 of 2, 0 epochs) of the 2 epochs after the warmup'),  # (timm rounds a fraction to whole epochs)
    (['--sched', 'rsqrt', '--epochs', '5', '--warmup-epochs', '5'], 'leaves no epochs after the warmup'),
    # plateau steps on the eval metric once an epoch (timm's factory asserted it once the data and model were built)
    (['--sched', 'plateau', '--sched-on-updates'], '--sched plateau steps once an epoch'),
    (['--sched', 'rsqrt', '--epochs', '5', '--warmup-epochs', '1', '--decay-epochs', '4.6'],
     'it must come to between 1 and 4 whole epochs'),
])
def test_bad_scheduler_options_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_cli.resolve_args(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize('flags', [['--decay-epochs', '18'], ['--decay-epochs', '0.25'],
                                   ['--decay-epochs', '20', '--warmup-prefix'], ['--decay-epochs', '18.4']])
def test_rsqrt_that_fits_runs_timms_schedule(flags):
    """The rsqrt runs the check lets through are timm's own schedule, epoch by epoch."""
    from timm.scheduler import create_scheduler_v2
    argv = ['--sched', 'rsqrt', '--epochs', '20', '--warmup-epochs', '2'] + flags
    lrs, epochs = _epoch_lrs(argv, 20)  # (lr 0.1, warmup from 0.01, min 0)
    peer = torch.optim.SGD(_model().parameters(), lr=0.1)
    theirs, their_epochs = create_scheduler_v2(peer, sched='rsqrt', num_epochs=20, warmup_epochs=2, warmup_lr=0.01,
                                               decay_epochs=float(flags[1]), warmup_prefix='--warmup-prefix' in flags,
                                               min_lr=0.0)
    expected = []
    for e in range(20):
        expected.append(peer.param_groups[0]['lr'])
        theirs.step(e + 1)
    assert epochs == their_epochs and lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[1] < lrs[2] and lrs[5] < lrs[3]  # a warmup, then the falling lr


def test_a_per_update_rsqrt_whose_decay_rounds_to_no_update_is_a_usage_error(tmp_path, capsys):
    """Per update, timm's factory rounds the decay in updates once the batches are known: its error is a usage
    error naming --sched (it was a traceback), and nothing is written."""
    with pytest.raises(SystemExit) as e:
        train_cli.cli(['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress',
                       '--sched', 'rsqrt', '--epochs', '2', '--warmup-epochs', '1', '--decay-epochs', '0.01',
                       '--sched-on-updates', '--output', str(tmp_path), '--experiment', 'x'])
    assert e.value.code == 2 and 'argument --sched: rsqrt schedule requires 0 < decay_epochs' in capsys.readouterr().err
    assert not (tmp_path / 'x').exists()


def test_a_cycled_run_trains_every_cycle(tmp_path):
    res = train_cli.main(['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress',
                          '--epochs', '1', '--lr-cycle-limit', '2', '--lr-cycle-decay', '0.5', '--lr', '0.1',
                          '--output', str(tmp_path), '--experiment', 'cycles'])
    assert [r['epoch'] for r in res['rows']] == [0, 1]
    assert [r['lr'] for r in res['rows']] == pytest.approx([0.1, 0.05])  # each cycle one epoch at its peak


# --- timm's optimizer options -------------------------------------------------------------------------------------
def _optimizer(argv, model_name='resnet8_cifar'):
    cfg, m = _resolved_flags(argv, model_name)
    return _optimization(cfg, m, steps_per_epoch=1)[0], m


def test_opt_kwargs_reach_the_optimizer():
    opt, _ = _optimizer(['--opt', 'adamw', '--opt-kwargs', 'amsgrad=True', 'maximize=False'])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults['amsgrad'] is True
    opt, _ = _optimizer(['--opt', 'adamw'])
    assert opt.defaults['amsgrad'] is False


@pytest.mark.parametrize('argv, message', [
    (['--opt', 'adamw', '--opt-kwargs', 'foo=1'], "optimizer adamw does not take foo=1"),
    (['--opt', 'adamw', '--opt-eps', '1e-6', '--opt-kwargs', 'eps=1e-3'], 'eps is set by --opt-eps'),
    (['--opt-kwargs', 'lr=1.0'], 'lr is set by --lr'),
    (['--opt-kwargs', 'momentum=0.5'], 'momentum is set by --momentum'),
])
def test_bad_opt_kwargs_are_usage_errors_before_anything_is_written(argv, message, tmp_path, capsys):
    with pytest.raises(ConfigError, match=message) as e:
        _optimizer(argv)
    assert e.value.flag == '--opt-kwargs'
    with pytest.raises(SystemExit) as e:  # on the command line: exit 2, and no run folder
        train_cli.main(argv + ['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--output',
                               str(tmp_path), '--experiment', 'x'])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / 'x').exists()


@pytest.mark.parametrize('argv, message', [
    (['--opt', 'adamw', '--opt-betas', '0.9'], r'optimizer adamw does not take betas \[0.9\]'),  # torch's IndexError
    (['--opt', 'adamw', '--opt-betas', '0.9', '0.99', '0.5'], 'optimizer adamw takes 2 betas, got 3'),  # ignored
    (['--opt', 'lamb', '--opt-betas', '0.9', '0.99', '0.5'], 'optimizer lamb takes 2 betas, got 3'),  # failed a step
    (['--opt', 'sgd', '--opt-betas', '0.9', '0.99'], r'optimizer sgd takes no betas, got \[0.9, 0.99\]'),  # dropped
])
def test_opt_betas_of_another_count_than_the_optimizers_are_usage_errors(argv, message, tmp_path, capsys):
    with pytest.raises(ConfigError, match=message) as e:
        _optimizer(argv)
    assert e.value.flag == '--opt-betas'
    with pytest.raises(SystemExit) as e:
        train_cli.main(argv + ['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--output',
                               str(tmp_path), '--experiment', 'x'])
    assert e.value.code == 2 and 'argument --opt-betas' in capsys.readouterr().err
    assert not (tmp_path / 'x').exists()
    for good in (['--opt', 'adamw', '--opt-betas', '0.8', '0.9'],
                 ['--opt', 'adan', '--opt-betas', '0.9', '0.9', '0.99'],
                 ['--opt', 'lookahead_adamw', '--opt-betas', '0.8', '0.9']):
        assert tuple(_optimizer(good)[0].defaults['betas']) == tuple(float(v) for v in good[3:])
    # timm's Adafactor takes betas (its beta1 from the first), though it keeps none under that name
    assert _optimizer(['--opt', 'adafactor', '--opt-betas', '0.9', '0.999'])[0].defaults['beta1'] == 0.9


def test_the_lr_column_is_the_mean_over_the_groups_as_timm_logs_it(tmp_path):
    """With --layer-decay the groups' rates differ: summary.csv's lr is their mean, as timm's train.py logs it
    (it was the first group's, the stem's, 1/16 of the head's here)."""
    res = train_cli.main(['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress',
                          '--epochs', '1', '--lr', '0.1', '--sched', 'step', '--decay-epochs', '10', '--warmup-epochs',
                          '0', '--layer-decay', '0.5', '--model', 'resnet8_cifar', '--output', str(tmp_path),
                          '--experiment', 'ld'])
    opt, _ = _optimizer(['--layer-decay', '0.5', '--lr', '0.1'])
    want = sum(0.1 * g['lr_scale'] for g in opt.param_groups) / len(opt.param_groups)
    assert res['rows'][0]['lr'] == pytest.approx(want) and want > 0.1 / 16


def test_layer_decay_scales_each_layer_and_keeps_the_patch_head_at_the_full_lr():
    def scales(opt, model):
        names = {id(p): n for n, p in model.named_parameters()}
        return {names[id(p)]: g['lr_scale'] for g in opt.param_groups for p in g['params']}
    plain = scales(*_optimizer(['--layer-decay', '0.5']))
    assert plain['conv1.weight'] == pytest.approx(0.5 ** 4) and plain['fc.weight'] == 1.0
    assert sorted(set(plain.values())) == pytest.approx([0.0625, 0.125, 0.25, 0.5, 1.0])  # stem, 3 stages, head
    head = scales(*_optimizer(['--layer-decay', '0.5'], 'patchhead_resnet8_cifar'))
    # the backbone's layers as in the plain model, the patch head with the classifier
    assert {n[len('backbone.'):]: v for n, v in head.items() if n.startswith('backbone.')} == plain
    patch = {n: v for n, v in head.items() if not n.startswith('backbone.')}
    assert patch and all(n.startswith('patch_head.') for n in patch) and set(patch.values()) == {1.0}
    opt, _ = _optimizer([])
    assert all('lr_scale' not in g for g in opt.param_groups)  # off by default


# --- timm's data config flags -------------------------------------------------------------------------------------
def _setup(argv):
    from timm_patchmix.engine.run import _setup as setup
    from timm_patchmix.engine.runtime import Runtime
    flags = ['--train-subset', '16', '--val-subset', '8', '-b', '8', '-j', '0', '--device', 'cpu'] + argv
    cfg, _, _, _, loaders, _ = setup(train_cli.parse_config(flags), Runtime(torch.device('cpu')), False)
    return cfg, loaders


@pytest.mark.parametrize('path', [[], ['--no-prefetcher'], ['--device-data']])
def test_mean_and_std_normalise_the_batches(path):
    base, base_loaders = _setup(path)
    cfg, loaders = _setup(path + ['--mean', '0.5', '--std', '0.25'])
    assert (cfg.data_config.mean, cfg.data_config.std) == ((0.5,) * 3, (0.25,) * 3)
    x0, _ = next(iter(base_loaders.val))
    x, _ = next(iter(loaders.val))
    m0 = torch.tensor(base.data_config.mean).view(1, 3, 1, 1)
    s0 = torch.tensor(base.data_config.std).view(1, 3, 1, 1)
    pixels = x0.float() * s0 + m0  # the same images, as [0, 1] pixels
    torch.testing.assert_close(x.float(), (pixels - 0.5) / 0.25, rtol=1e-5, atol=1e-5)
    cfg, _ = _setup(path + ['--mean', '0.1', '0.2', '0.3'])  # one per channel
    assert cfg.data_config.mean == (0.1, 0.2, 0.3)


@pytest.mark.parametrize('argv, flag, message', [
    (['--mean', '0.5', '0.5'], '--mean', 'takes one value or one per channel of the 3-channel input, got 2'),
    (['--std', '0.2', '0.2', '0.2', '0.2'], '--std', 'one per channel of the 3-channel input, got 4'),
    (['--crop-pct', '0.8'], '--crop-pct', 'the 32x32 input takes the CIFAR-style transform'),
    (['--interpolation', 'bicubic'], '--interpolation', '--interpolation would be unused'),
])
def test_data_config_flags_that_do_not_fit_are_usage_errors(argv, flag, message):
    with pytest.raises(ConfigError, match=message) as e:
        _setup(argv)
    assert e.value.flag == flag


def test_crop_pct_and_interpolation_reach_the_evaluation_transform_of_a_larger_input():
    from torchvision import transforms as T
    cfg, loaders = _setup(['--img-size', '72', '--crop-pct', '0.8', '--interpolation', 'bicubic'])
    assert (cfg.data_config.crop_pct, cfg.data_config.interpolation) == (0.8, 'bicubic')
    ops = loaders.val.dataset.transform.transforms[1].transforms
    resize = next(op for op in ops if isinstance(op, T.Resize))
    crop = next(op for op in ops if isinstance(op, T.CenterCrop))
    assert resize.size == 90 and resize.interpolation == T.InterpolationMode.BICUBIC  # 72 / 0.8
    assert list(crop.size) == [72, 72]


# --- timm's model flags -------------------------------------------------------------------------------------------
def _built(argv):
    """The run's resolved config and model for ``argv``, as ``train.py`` builds them."""
    from timm_patchmix.engine.run import _setup as setup
    from timm_patchmix.engine.runtime import Runtime
    flags = ['--train-subset', '16', '--val-subset', '8', '-b', '8', '-j', '0', '--device', 'cpu'] + argv
    cfg, _, model, kwargs, _, _ = setup(train_cli.parse_config(flags), Runtime(torch.device('cpu')), False)
    return cfg, model, kwargs


def test_drop_block_gp_and_batchnorm_flags_reach_the_model():
    from timm.layers import DropBlock2d
    _, model, kwargs = _built(['--model', 'resnet18', '--drop-block', '0.1', '--gp', 'avgmax'])
    blocks = [m for m in model.modules() if isinstance(m, DropBlock2d)]
    assert blocks and all(m.drop_prob == 0.1 for m in blocks)
    assert model.global_pool.pool_type == 'avgmax'
    assert kwargs['drop_block_rate'] == 0.1 and kwargs['global_pool'] == 'avgmax'  # recorded in the weights files
    _, model, kwargs = _built(['--model', 'patchhead_efficientnet_b0', '--patchmix', '--bn-momentum', '0.01',
                               '--bn-eps', '0.001'])
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(m.momentum == 0.01 and m.eps == 0.001 for m in bns)
    assert (kwargs['bn_momentum'], kwargs['bn_eps']) == (0.01, 0.001)


@pytest.mark.parametrize('model', ['resnet32_cifar', 'patchhead_resnet32_cifar'])
def test_catavgmax_widens_the_classifier_of_the_cifar_resnets(model):
    """The pooled features of ``catavgmax`` are twice as wide (timm's ResNet sizes its classifier so): the CIFAR
    ResNets' classifier too, also after a reset."""
    m = timm.create_model(model, num_classes=10, global_pool='catavgmax').eval()
    assert m.get_classifier().in_features == 2 * m.num_features
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    m.reset_classifier(5)
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 5)
    _, built, _ = _built(['--model', model, '--gp', 'catavgmax'] + (['--patchmix'] if 'patchhead' in model else []))
    assert built.get_classifier().in_features == 2 * built.num_features


def test_head_init_scales_both_heads_after_the_weights_are_in():
    plain_cfg, plain, _ = _built(['--model', 'patchhead_resnet8_cifar', '--patchmix'])
    _, scaled, _ = _built(['--model', 'patchhead_resnet8_cifar', '--patchmix', '--head-init-scale', '0.5'])
    _, biased, _ = _built(['--model', 'patchhead_resnet8_cifar', '--patchmix', '--head-init-scale', '0.5',
                           '--head-init-bias', '-0.25'])
    for get in ('get_classifier', 'get_patch_classifier'):
        h0, h1, h2 = (getattr(m, get)() for m in (plain, scaled, biased))
        assert torch.equal(h1.weight, h0.weight * 0.5) and torch.equal(h1.bias, h0.bias * 0.5)
        assert torch.equal(h2.weight, h0.weight * 0.5) and torch.equal(h2.bias, torch.full_like(h0.bias, -0.25))
    body = [k for k in plain.state_dict() if 'fc' not in k]
    assert all(torch.equal(plain.state_dict()[k], scaled.state_dict()[k]) for k in body)  # only the heads change


def test_head_init_applies_to_the_loaded_heads(tmp_path):
    """As timm's train.py (which loads --initial-checkpoint inside create_model): the loaded classifier scaled."""
    g = torch.Generator().manual_seed(3)
    donor = timm.create_model('patchhead_resnet8_cifar', num_classes=10)
    with torch.no_grad():
        for p in donor.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    path = str(tmp_path / 'w.safetensors')
    save_weights(path, donor.state_dict())
    _, loaded, _ = _built(['--model', 'patchhead_resnet8_cifar', '--patchmix', '--initial-checkpoint', path,
                           '--head-init-scale', '0.5', '--head-init-bias', '0.125'])
    for get in ('get_classifier', 'get_patch_classifier'):
        h0, h1 = getattr(donor, get)(), getattr(loaded, get)()
        assert torch.equal(h1.weight, h0.weight * 0.5) and torch.equal(h1.bias, torch.full_like(h0.bias, 0.125))
    assert torch.equal(loaded.backbone.conv1.weight, donor.backbone.conv1.weight)


def test_checkpoints_record_only_a_positive_bn_eps():
    from timm_patchmix.validation import Fields, check_model_kwargs
    assert check_model_kwargs({'bn_eps': 1e-3, 'bn_momentum': 0.01}, Fields('w')) == {'bn_eps': 1e-3,
                                                                                      'bn_momentum': 0.01}
    for bad in ({'bn_eps': 0.0}, {'bn_eps': -1e-3}, {'bn_momentum': 1.5}):
        with pytest.raises(ValueError, match='must be a number'):
            check_model_kwargs(bad, Fields('w'))


@pytest.mark.parametrize('argv, flag, message', [
    (['--model', 'resnet8_cifar', '--bn-eps', '0.001'], '--bn-eps', "does not take 'bn_eps', which --bn-eps sets"),
    (['--model', 'resnet8_cifar', '--drop-block', '0.1'], '--drop-block', "does not take 'drop_block_rate'"),
    (['--model', 'resnet8_cifar', '--gp', 'bogus'], '--gp', "has no global pooling 'bogus'"),
    (['--model', 'resnet8_cifar', '--gp', ''], '--gp', "with the global pooling '' gives no logits of 10 classes"),
    (['--model', 'resnet8_cifar', '--gp', 'max', '--model-kwargs', 'global_pool=avg'], '--model-kwargs',
     'global_pool=.avg. differs from --gp max'),
])
def test_model_flags_a_model_cannot_take_are_usage_errors(argv, flag, message):
    with pytest.raises(ConfigError, match=message) as e:
        _built(argv)
    assert e.value.flag == flag


def test_settings_of_a_mixer_that_is_off_are_named_not_silently_dropped(tmp_path, capsys):
    """``--guided-prob`` without a table, PatchMix settings without ``--patchmix``, Mixup settings without
    ``--mixup``/``--cutmix``: each changes nothing, and the run says so in a ``note:`` line (not refused: the
    pipeline gives --train-args to every method's run). Settings of a mixer that is on, or left at their
    defaults, are no note."""
    assert TrainConfig().unused_settings() == []
    assert TrainConfig(patchmix=True, patchmix_mode='batch').unused_settings() == []
    # --patchmix-alpha with --patchmix: the rounded Beta(a, a) draw is a fair coin at every a (test_mix.py)
    assert TrainConfig(patchmix=True, patchmix_alpha=0.5).unused_settings() == [
        '--patchmix-alpha 0.5 changes nothing: each mask cell is round(Beta(a, a)) as the paper draws it, 0 or 1 '
        'with probability 1/2 for every a, so the masks are the same at any value (it is recorded only)']
    assert TrainConfig(mixup=0.2, mixup_prob=0.5).unused_settings() == []
    lines = TrainConfig(patchmix=True, guided_prob=0.9).unused_settings()
    assert lines == ['--guided-prob 0.9 sets the guided batches of --patchmix-table, which is off in this run: it '
                     'changes nothing (add --patchmix-table with a search\'s masks.json to use it)']
    assert TrainConfig(holdout_seed=3).unused_settings() == [
        '--holdout-seed 3 sets the held-out images of --holdout, which is off in this run: it changes nothing (add '
        '--holdout F to use it)']
    assert TrainConfig(holdout=0.1, holdout_seed=3).unused_settings() == []
    # a patch-loss weight beside --no-patch-loss weighs nothing (on a plain model, one line names both)
    assert TrainConfig(no_patch_loss=True, patch_loss_weight=0.5, patch_head=True).unused_settings() == [
        '--patch-loss-weight 0.5 sets the weight of the patch loss, which --no-patch-loss switches off: it changes '
        'nothing (drop --no-patch-loss to use it)']
    assert TrainConfig(patch_loss_weight=0.5, patch_head=True).unused_settings() == []
    # --clip-mode without --clip-grad (or with 0): no clipping; a note (a rerun of an older run's args.yaml with -c
    # may hold it, so not refused)
    assert TrainConfig(clip_mode='agc').unused_settings() == [
        '--clip-mode agc sets how --clip-grad clips the gradients, which is off in this run (no --clip-grad): it '
        'changes nothing (add --clip-grad to use it)']
    assert TrainConfig(clip_mode='value', clip_grad=0.0).unused_settings()[0].startswith(
        '--clip-mode value sets how --clip-grad clips the gradients, which is off in this run (--clip-grad 0)')
    assert TrainConfig(clip_mode='agc', clip_grad=0.01).unused_settings() == []
    assert len(TrainConfig(no_patch_loss=True, patch_loss_weight=0.5, patch_head=False).unused_settings()) == 1
    lines = TrainConfig(patchmix_alpha=0.5, patchmix_collate=True, mixup_mode='pair').unused_settings()
    assert lines[0].startswith('--patchmix-alpha 0.5 and --patchmix-collate set how --patchmix mixes')
    assert lines[1].startswith("--mixup-mode pair sets timm's Mixup/CutMix of --mixup/--cutmix") and len(lines) == 2
    from timm_patchmix.train import main
    main(['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress', '--epochs', '1',
          '--output', str(tmp_path), '--patchmix', '--random-prob', '0.5'])
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith('note: --random-prob 0.5 sets the guided batches of --patchmix-table') for line in out)


def _table(path):
    import numpy as np
    from timm_patchmix.data import PATCHSHAPES_CLASSES
    from timm_patchmix.guided import MaskTable, dataset_fingerprint
    rng = np.random.default_rng(0)
    pairs = [(i, i + 1) for i in range(0, 10, 2)]
    MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), dataset_fingerprint('', PATCHSHAPES_CLASSES), pairs,
              [rng.random((4, 4)) < 0.5 for _ in pairs], [0.1] * len(pairs), 0.1).save(str(path))
    return str(path)


@pytest.mark.parametrize('collate', [False, True])
def test_guided_patchmix_takes_the_alpha_and_names_the_settings_it_does_not_use(tmp_path, collate):
    """With --patchmix-table the random part of each batch draws its masks with --patchmix-alpha (it used the
    default 1.0 whatever the flag said); --patchmix-prob and --patchmix-mode, which only Random PatchMix without a
    table reads, are named in a note."""
    from timm_patchmix.collate import FastCollateGuidedPatchMix
    from timm_patchmix.data import PATCHSHAPES_CLASSES
    from timm_patchmix.engine.loaders import build_mixing
    from timm_patchmix.guided import GuidedPatchMix
    table = _table(tmp_path / 'masks.json')
    cfg = TrainConfig(patchmix=True, patchmix_table=table, patchmix_alpha=0.3, patchmix_collate=collate,
                      patchmix_prob=0.5, patchmix_mode='pair').with_recipe()
    mixer, collate_fn = build_mixing(dataclasses.replace(cfg, num_classes=10, grid=(4, 4)), PATCHSHAPES_CLASSES)
    guided = collate_fn.guided if collate else mixer
    assert isinstance(guided, GuidedPatchMix) and isinstance(collate_fn, FastCollateGuidedPatchMix) == collate
    assert guided.mixer.alpha == 0.3
    alpha = ('--patchmix-alpha 0.3 changes nothing: each mask cell is round(Beta(a, a)) as the paper draws it, 0 or '
             '1 with probability 1/2 for every a, so the masks are the same at any value (it is recorded only)')
    assert cfg.unused_settings() == [
        "--patchmix-prob 0.5 and --patchmix-mode pair set Random PatchMix's batches without --patchmix-table; with "
        "the table, --guided-prob and --random-prob share out each batch, whose random part mixes element-wise, "
        "each cell a fair coin: they change nothing (drop --patchmix-table to use them)", alpha]
    assert TrainConfig(patchmix=True, patchmix_table=table, patchmix_alpha=0.3).unused_settings() == [alpha]
    assert TrainConfig(patchmix=True, patchmix_table=table).unused_settings() == []


def test_patch_loss_settings_of_a_plain_model_are_named(tmp_path, capsys):
    """--no-image-loss, --patch-loss-weight and --per-position-head act on a patch head: with a plain model they
    changed nothing silently; now a note says so. A patch-head model, or a config whose model is not resolved yet,
    has no such note."""
    flags = dict(no_image_loss=True, patch_loss_weight=0.3, per_position_head=True)
    assert TrainConfig(model='resnet8_cifar', **flags).unused_settings() == []  # not resolved: unknown
    assert TrainConfig(model='patchhead_resnet8_cifar', patch_head=True, **flags).unused_settings() == []
    line = ('--no-image-loss and --patch-loss-weight 0.3 and --per-position-head set the loss terms of a patch '
            'head, which resnet8_cifar does not have (its loss is on its image logits alone): they change nothing '
            '(train a patchhead_ model to use them)')
    assert TrainConfig(model='resnet8_cifar', patch_head=False, **flags).unused_settings() == [line]
    # without --patchmix, --no-patch-loss and the grid go unused too; with it they set image-level PatchMix
    assert TrainConfig(model='resnet8_cifar', patch_head=False, no_patch_loss=True, grid=(2, 2)).unused_settings() \
        == ['--no-patch-loss and --patchmix-grid 2 2 set the loss terms of a patch head, which resnet8_cifar does '
            'not have (its loss is on its image logits alone): they change nothing (train a patchhead_ model to use '
            'them)']
    assert TrainConfig(model='resnet8_cifar', patch_head=False, grid=(4, 4)).unused_settings() == []  # the default
    assert TrainConfig(model='resnet8_cifar', patch_head=False, patchmix=True, no_patch_loss=True,
                       grid=(2, 2)).unused_settings() == []
    from timm_patchmix.train import main
    main(['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress', '--epochs', '1',
          '--output', str(tmp_path), '--model', 'resnet8_cifar', '--patchmix', '--no-patch-loss',
          '--patch-loss-weight', '0.5'])
    out = capsys.readouterr().out.splitlines()
    line = ('note: --patch-loss-weight 0.5 sets the loss terms of a patch head, which resnet8_cifar does not have '
            '(its loss is on its image logits alone): it changes nothing (train a patchhead_ model to use it)')
    assert line in out, out


def test_a_loss_weighed_to_nothing_is_refused_and_the_patch_loss_is_recorded(tmp_path):
    """--no-image-loss with --patch-loss-weight 0 trained on a loss of 0 (only weight decay moved the weights):
    refused like --no-patch-loss --no-image-loss. The weights files record whether the patch loss trained the
    patch head (the search refuses a head that never trained)."""
    with pytest.raises(ConfigError, match='it would train on a loss of 0'):
        TrainConfig(model='patchhead_resnet8_cifar', patchmix=True, no_image_loss=True, patch_loss_weight=0.0)
    from timm_patchmix.train import main
    for flags, patch_loss in (([], True), (['--no-patch-loss'], False), (['--patch-loss-weight', '0'], False)):
        res = main(['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress',
                    '--epochs', '1', '--output', str(tmp_path), '--model', 'patchhead_resnet8_cifar', '--patchmix']
                   + flags)
        _, meta = load_weights(os.path.join(res['output'], 'best.safetensors'))
        assert meta['patchmix']['patch_loss'] is patch_loss and meta['patchmix']['image_loss'] is True


def test_the_recorded_command_reads_back_as_the_flags_it_ran_with():
    """The command in args.yaml, the weights files and the Hub card was the words joined by spaces: `--dataset ''`
    (every pipeline run on the embedded data) came back as `--dataset  --seed 0`, which train.py cannot parse.
    It is now quoted as a shell reads it."""
    import shlex
    from timm_patchmix.train import parse_config
    argv = ['--dataset', '', '--experiment', 'a b', '--seed', '0']
    cfg = parse_config(argv)
    assert shlex.split(cfg.command) == ['train.py'] + argv
    assert parse_config(shlex.split(cfg.command)[1:]).experiment == 'a b'


def test_help_names_where_each_recipe_filled_flag_gets_its_value():
    """README: `--help` lists every flag with its default. The flags a --recipe fills (--lr, --epochs, -b, --model...)
    and --output/--experiment showed none; their help now names each recipe's value, or the one they share."""
    from timm_patchmix.engine.config import TIMM_DEFAULTS
    parser = train_cli.build_parser()
    helps = {a.dest: a.help or '' for a in parser._actions if a.option_strings}
    missing = [name for name in list(TIMM_DEFAULTS) + ['output', 'experiment'] if 'default:' not in helps[name]]
    assert not missing
    text = ' '.join(parser.format_help().split())
    assert "--epochs EPOCHS default: the --recipe's, demo 4, timm 300, paper-cifar 400" in text
    assert "--lr LR default: the --recipe's, demo 0.1, timm by the rule of --lr-base, paper-cifar 0.1" in text
    assert '--opt OPT default: sgd' in text and '(default: output/train)' in text
