"""The training engine through its seams: the config resolved once, one step, one epoch, clipping, errors."""
import csv
import dataclasses
import logging
import math
import os
from contextlib import nullcontext

import pytest
import timm
import torch

import timm_patchmix  # noqa: F401
from timm_patchmix.engine import (ConfigError, StepEvent, TrainConfig, TrainResult, TrainSetupError, resolve,
                                  scaled_lr, train)
from timm_patchmix.engine.loaders import build_mixing, resolve_data
from timm_patchmix.engine.loop import Stepper, clip_parameters, train_step
from timm_patchmix.loss import PatchMixLoss
from timm_patchmix.mix import PatchMix, split_target
from timm_patchmix.train import parse_config, resolve_args

TINY = dict(train_subset=32, val_subset=16, batch_size=16, workers=0, epochs=1, no_progress=True, device='cpu',
            log_interval=1000)


def tiny_model(grid=(4, 4), name='patchhead_resnet32_cifar'):
    torch.manual_seed(0)
    kwargs = {'grid': grid} if name.startswith('patchhead_') else {}
    return timm.create_model(name, num_classes=10, **kwargs)


def resolved(cfg, model, world_size=1):
    return resolve(cfg, model=model, num_classes=10, data_config=resolve_data(cfg.with_recipe(), model),
                   world_size=world_size)


# --- the config ---------------------------------------------------------------------------------------------------
def test_config_resolved_from_recipe():
    # timm's recipe: its defaults fill the unset flags; the lr is scaled to the global batch once the run knows it
    cfg = TrainConfig(recipe='timm', patchmix=True, batch_size=64, grid=(4, 4))
    r = cfg.with_recipe()
    assert r.model == 'patchhead_resnet50'  # --patchmix on the recipe's backbone: its patch-head model
    assert (r.epochs, r.warmup_epochs, r.warmup_lr, r.min_lr, r.sched, r.opt) == (300, 5, 1e-5, 0.0, 'cosine', 'sgd')
    assert (r.momentum, r.weight_decay, r.smoothing, r.workers, r.batch_size) == (0.9, 2e-5, 0.1, 4, 64)
    assert r.lr is None and not r.is_resolved
    assert r.with_recipe() == r  # resolving twice changes nothing
    # the model is the one source of the grid: a 2x4 model wins over the config's 4x4
    model = tiny_model(grid=(2, 4))
    done = resolved(r, model, world_size=2)
    assert done.grid == (2, 4) and model.grid == (2, 4) and done.patch_head is True
    assert done.lr == 0.1 * 64 * 2 / 256 == 0.05  # timm's linear rule: lr_base * global batch / lr_base_size
    assert done.num_classes == 10 and done.is_resolved
    dc = done.data_config
    assert (dc.input_size, dc.mean, dc.std, dc.interpolation, dc.crop_pct) == (
        (3, 32, 32), (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616), 'bilinear', 1.0)
    assert (done.epochs, done.warmup_epochs, done.warmup_lr) == (300, 5, 1e-5)
    assert cfg.lr is None and cfg.grid == (4, 4) and cfg.model is None  # the original is untouched

    # the demo recipe on the embedded data, and the paper's CIFAR recipe
    demo = TrainConfig().with_recipe()
    assert (demo.recipe, demo.model, demo.epochs, demo.batch_size, demo.lr, demo.warmup_epochs, demo.smoothing,
            demo.weight_decay, demo.workers) == ('demo', 'resnet32_cifar', 4, 128, 0.1, 0, 0.0, 5e-4, 2)
    paper = TrainConfig(recipe='paper-cifar', epochs=3).with_recipe()
    assert (paper.model, paper.epochs, paper.batch_size, paper.lr, paper.warmup_epochs) == (
        'preactresnet18_cifar', 3, 100, 0.1, 0)  # a flag the user set wins over the recipe
    assert TrainConfig(dataset='torch/cifar10', data_dir='/x').with_recipe().recipe == 'timm'
    # a plain backbone with image-level PatchMix keeps the flags' grid (4x4 by default)
    plain = resolved(TrainConfig(patchmix=True, no_patch_loss=True, model='resnet32_cifar'),
                     tiny_model(name='resnet32_cifar'))
    assert plain.grid == (4, 4) and plain.patch_head is False and plain.lr == 0.1
    # the square-root rule for Ada*/LAMB optimizers
    ada = TrainConfig(recipe='timm', opt='adamw', batch_size=128).with_recipe()
    assert scaled_lr(ada, world_size=1) == pytest.approx(0.1 * math.sqrt(128 / 256))


def test_config_is_frozen_and_checked():
    cfg = TrainConfig(grid=[2], input_size=[3, 32, 32], fgsm=[0.1], model_kwargs={'drop_rate': 0.1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.grid = (8, 8)
    assert cfg.grid == (2, 2) and cfg.input_size == (3, 32, 32) and cfg.fgsm == (0.1,)  # sequences as tuples
    other = dataclasses.replace(cfg, lr=0.5)
    assert other.lr == 0.5 and cfg.lr is None
    assert cfg.record()['grid'] == [2, 2] and cfg.record()['data_config'] is None
    with pytest.raises(ConfigError, match='argument --patchmix-grid: takes P or rows cols, got 3 values 2 3 4'):
        TrainConfig(grid=[2, 3, 4])
    with pytest.raises(ConfigError, match="argument --clip-mode: invalid choice: 'l1'") as e:
        TrainConfig(clip_mode='l1')
    assert e.value.flag == '--clip-mode'
    with pytest.raises(ConfigError, match='switch off the whole loss'):
        TrainConfig(no_patch_loss=True, no_image_loss=True)
    with pytest.raises(ConfigError, match='argument --opt: unknown optimizer'):
        TrainConfig(opt='no_such_opt').with_recipe()
    with pytest.raises(TrainSetupError, match='add --patchmix'):
        TrainConfig(patchmix_table='masks.json')
    with pytest.raises(TrainSetupError, match='alternatives'):
        dataclasses.replace(TrainConfig(patchmix=True), mixup=0.2)  # a derived config is checked too


def test_flags_to_config(tmp_path):
    cfg = parse_config(['--patchmix', '--patchmix-grid', '2', '4', '--clip-mode', 'agc', '--clip-grad', '0.01',
                        '--model-kwargs', 'drop_rate=0.1', 'act=relu', 'sizes=(1, 2)', 'flag=True', 'empty='])
    assert cfg.grid == (2, 4) and cfg.clip_mode == 'agc' and cfg.clip_grad == 0.01
    assert cfg.model == 'patchhead_resnet32_cifar' and cfg.recipe == 'demo'
    # timm's ParseKwargs: Python literals where they parse, strings otherwise
    assert cfg.model_kwargs == {'drop_rate': 0.1, 'act': 'relu', 'sizes': (1, 2), 'flag': True, 'empty': ''}
    assert cfg.command.startswith('train.py --patchmix --patchmix-grid 2 4')
    positional = parse_config([str(tmp_path)])  # timm's positional DIR, a dataset folder: timm's recipe
    assert positional.data_dir == str(tmp_path) and positional.recipe == 'timm' and positional.model == 'resnet50'


def test_model_kwargs_without_equals_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        resolve_args(['--model-kwargs', 'drop_rate'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --model-kwargs: expects key=value pairs, got 'drop_rate'" in err


# --- one step ----------------------------------------------------------------------------------------------------
class Recording(PatchMixLoss):
    """PatchMixLoss that keeps the target it was given."""

    def forward(self, output, target):
        self.seen = target.clone()
        return super().forward(output, target)


def stepper(cfg, model, mixer, criterion=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Stepper(model, opt, criterion or Recording(), cfg, torch.device('cpu'), mixer=mixer)


def batch(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.arange(n) % 10


def test_one_training_step_mixes_and_updates():
    model = tiny_model()
    cfg = resolved(TrainConfig(patchmix=True, model='patchhead_resnet32_cifar'), model)
    mixer, collate = build_mixing(cfg, [str(c) for c in range(10)])
    assert isinstance(mixer, PatchMix) and mixer.mixup_enabled and mixer.grid == (4, 4)
    s = stepper(cfg, model, mixer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batch()
    torch.manual_seed(7)
    expected_x, expected_target = PatchMix(grid=(4, 4), num_classes=10)(x.clone(), y)
    torch.manual_seed(7)
    loss = train_step(s, x.clone(), y)
    assert math.isfinite(loss) and loss > 0 and s.updates == 1
    # the criterion saw exactly the packed target of the mixer's draw, for the mixed images
    assert torch.equal(s.criterion.seen, expected_target)
    image_t, patch_t = split_target(s.criterion.seen)
    assert image_t.shape == (8, 10) and patch_t.shape == (8, 16, 10)
    assert torch.allclose(image_t.sum(1), torch.ones(8)) and not torch.equal(image_t, torch.eye(10)[y])
    changed = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert any(k.startswith('patch_head.') for k in changed) and any(k.startswith('backbone.') for k in changed)


def test_patch_head_without_patchmix_trains_on_unmixed_targets():
    model = tiny_model()
    cfg = resolved(TrainConfig(model='patchhead_resnet32_cifar'), model)
    mixer, _ = build_mixing(cfg, [str(c) for c in range(10)])
    assert isinstance(mixer, PatchMix) and not mixer.mixup_enabled
    s = stepper(cfg, model, mixer)
    x, y = batch()
    train_step(s, x.clone(), y)
    image_t, patch_t = split_target(s.criterion.seen)
    assert torch.equal(image_t, torch.eye(10)[y])  # each image its own label, every cell labelled as its image
    assert torch.equal(patch_t, torch.eye(10)[y][:, None, :].expand(8, 16, 10))


def test_clip_mode_agc_uses_timms_adaptive_clipping(monkeypatch):
    import timm.utils.clip_grad as clip_grad
    calls = []
    real = clip_grad.adaptive_clip_grad

    def recording(parameters, clip_factor, **kw):
        parameters = list(parameters)
        calls.append((parameters, clip_factor))
        return real(parameters, clip_factor, **kw)
    monkeypatch.setattr(clip_grad, 'adaptive_clip_grad', recording)
    model = tiny_model()
    cfg = resolved(TrainConfig(patchmix=True, model='patchhead_resnet32_cifar', clip_grad=0.001, clip_mode='agc'),
                   model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch()
    torch.manual_seed(3)
    train_step(stepper(cfg, model, None, PatchMixLoss()), x, y)
    assert len(calls) == 1 and calls[0][1] == 0.001
    names = {id(p): n for n, p in model.named_parameters()}
    clipped = [names[id(p)] for p in calls[0][0]]
    heads = {'backbone.fc.weight', 'backbone.fc.bias', 'patch_head.fc.weight', 'patch_head.fc.bias'}
    assert not heads & set(clipped) and set(clipped) == set(names.values()) - heads  # the heads are left out
    assert [names[id(p)] for p in clip_parameters(model, 'agc')] == clipped
    # after clipping, each unit's gradient norm is at most 0.001 of its weight norm (timm's unitwise rule)
    from timm.utils.agc import unitwise_norm
    for n, p in model.named_parameters():
        if n in clipped:
            limit = unitwise_norm(weights[n]).clamp(min=1e-3) * 0.001
            assert (unitwise_norm(p.grad) <= limit * (1 + 1e-5)).all(), n
    # without clipping the same step's gradients are far above that bound
    model2 = tiny_model()
    cfg2 = dataclasses.replace(cfg, clip_grad=None, clip_mode='norm')
    torch.manual_seed(3)
    train_step(stepper(cfg2, model2, None, PatchMixLoss()), x, y)
    conv = dict(model2.named_parameters())['backbone.conv1.weight']
    assert (unitwise_norm(conv.grad) > unitwise_norm(weights['backbone.conv1.weight']) * 0.001).any()
    assert len(calls) == 1


def test_amp_uses_timms_native_scaler_and_clips_through_it(monkeypatch):
    from timm.utils import NativeScaler
    from timm_patchmix.engine.loop import amp_setup
    autocast, scaler = amp_setup(TrainConfig(amp=True), torch.device('cpu'))
    assert scaler is None  # bfloat16 autocast off CUDA needs no loss scaling
    with autocast():
        assert torch.get_autocast_dtype('cpu') == torch.bfloat16 and torch.is_autocast_enabled('cpu')
    assert amp_setup(TrainConfig(), torch.device('cpu')) == (nullcontext, None)  # no --amp: neither
    # the scaler path of a step (float16 on CUDA), run here with a CPU GradScaler: scale, unscale, clip, step
    import timm.utils.cuda as timm_cuda
    clips = []
    real = timm_cuda.dispatch_clip_grad
    monkeypatch.setattr(timm_cuda, 'dispatch_clip_grad', lambda p, v, mode: clips.append((v, mode)) or real(p, v, mode))
    model = tiny_model()
    cfg = resolved(TrainConfig(patchmix=True, model='patchhead_resnet32_cifar', clip_grad=1.0), model)
    s = stepper(cfg, model, None, PatchMixLoss())
    s.scaler = NativeScaler('cpu')
    before = model.backbone.conv1.weight.detach().clone()
    x, y = batch()
    assert math.isfinite(train_step(s, x, y)) and s.updates == 1
    assert clips == [(1.0, 'norm')] and not torch.equal(model.backbone.conv1.weight, before)


# --- a whole run -------------------------------------------------------------------------------------------------
def test_one_epoch_on_a_tiny_set(tmp_path, caplog):
    events = []
    cfg = TrainConfig(patchmix=True, output=str(tmp_path), experiment='e', **TINY)
    with caplog.at_level(logging.INFO):
        res = train(cfg, on_step=events.append, log_data_config=False)
    assert 'Data processing configuration' not in caplog.text
    assert isinstance(res, TrainResult) and res.output == str(tmp_path / 'e')
    for path, name in ((res.best_path, 'best'), (res.last_path, 'last'), (res.state_path, 'state')):
        assert path == str(tmp_path / 'e' / f'{name}.safetensors') and os.path.isfile(path)
    with open(res.summary_path) as f:
        rows = list(csv.DictReader(f))
    assert [r['epoch'] for r in rows] == ['0'] and len(res.rows) == 1 and res.rows[0]['epoch'] == 0
    assert res.final_top1 == res.best_top1 == res.rows[0]['eval_top1'] == float(rows[0]['eval_top1'])
    assert res.best == {'score': res.rows[0]['eval_top1'], 'epoch': 0, 'metric': 'top1'} and res.fgsm is None
    assert res.final_top1 * 16 / 100 == pytest.approx(round(res.final_top1 * 16 / 100))
    # the resolved config of the run
    c = res.config
    assert c.model == 'patchhead_resnet32_cifar' and c.grid == (4, 4) and c.lr == 0.1 and c.num_classes == 10
    assert c.is_resolved and cfg.lr is None and not cfg.is_resolved
    # 32 images in batches of 16: two steps, each heard by on_step
    assert events == [StepEvent(0, 1, 2, 1, events[0].loss), StepEvent(0, 2, 2, 2, events[1].loss)]
    assert all(math.isfinite(e.loss) for e in events)
    assert sorted(os.listdir(res.output)) == ['args.yaml', 'best.safetensors', 'last.safetensors',
                                              'state.safetensors', 'summary.csv']
    assert res.as_dict() == {'output': res.output, 'rows': list(res.rows), 'best': res.best}


def test_data_config_is_logged_when_asked(caplog):
    model = tiny_model()
    with caplog.at_level(logging.INFO):
        resolve_data(TrainConfig(), model, verbose=False)
    assert 'Data processing configuration' not in caplog.text
    with caplog.at_level(logging.INFO):
        resolve_data(TrainConfig(), model, verbose=True)
    assert caplog.text.count('Data processing configuration') == 1


def test_pipeline_logs_the_data_config_for_its_first_training_only(monkeypatch):
    import timm_patchmix.engine as engine
    from timm_patchmix.pipeline import _Trainer
    seen = []
    monkeypatch.setattr(engine, 'train', lambda cfg, on_step=None, log_data_config=True: seen.append(
        (cfg, on_step, log_data_config)))
    hook = object()
    trainer = _Trainer(hook)
    for _ in range(3):
        trainer(TrainConfig())
    assert [s[2] for s in seen] == [True, False, False] and all(s[1] is hook for s in seen)


def test_errors_are_plain_exceptions_and_write_nothing(tmp_path):
    with pytest.raises(TrainSetupError, match="unknown model 'no_such_model'"):
        train(TrainConfig(model='no_such_model', output=str(tmp_path), experiment='a', **TINY))
    with pytest.raises(ConfigError, match='argument --model-kwargs: not_a_kwarg cannot be recorded') as e:
        train(TrainConfig(model_kwargs={'not_a_kwarg': 1}, output=str(tmp_path), experiment='b', **TINY))
    assert e.value.flag == '--model-kwargs'
    with pytest.raises(TrainSetupError, match='use --model patchhead_resnet32_cifar'):
        train(TrainConfig(model='resnet32_cifar', patchmix=True, output=str(tmp_path), experiment='c', **TINY))
    # a callback that cannot be called failed at the first batch, after args.yaml was written
    with pytest.raises(TypeError, match='on_step must be a callable taking a StepEvent, got int'):
        train(TrainConfig(output=str(tmp_path), experiment='d', **TINY), on_step=5)
    assert os.listdir(tmp_path) == []


def test_a_file_in_the_way_of_the_run_folder_and_a_folder_to_resume_are_named(tmp_path, monkeypatch):
    """``output`` (or ``output/experiment``, or a folder above them) that is a file: a TrainSetupError naming it
    before the data and the model are built (it was an OSError of makedirs after them); ``resume`` naming a run
    folder rather than its state file says so (it said the folder did not exist)."""
    import timm_patchmix.engine.run as run_mod
    afile = tmp_path / 'afile'
    afile.write_text('kept')
    built = []
    monkeypatch.setattr(run_mod, '_setup', lambda *a: built.append(a) or pytest.fail('built before the check'))
    for output, experiment in ((afile, 'x'), (tmp_path, 'afile'), (afile / 'below', 'x'), (afile, '')):
        with pytest.raises(TrainSetupError, match=f'cannot make the run folder under --output .*: {afile} is a '
                                                  f'file, not a folder; give another --output or --experiment'):
            train(TrainConfig(output=str(output), experiment=experiment, **TINY))
    assert afile.read_text() == 'kept' and built == [] and sorted(os.listdir(tmp_path)) == ['afile']
    monkeypatch.undo()
    run = train(TrainConfig(output=str(tmp_path), experiment='run', **TINY)).output
    with pytest.raises(TrainSetupError, match=f'checkpoint {run} is a folder, not a file; resume from '
                                              f'{run}/state.safetensors, the training state in it'):
        train(TrainConfig(output=str(tmp_path), experiment='again', resume=run, **TINY))
    os.symlink(tmp_path / 'nowhere', tmp_path / 'dangling')
    with pytest.raises(TrainSetupError, match=f'{tmp_path}/dangling is a link to nothing; give another'):
        train(TrainConfig(output=str(tmp_path), experiment='dangling', **TINY))


def test_best_top1_is_the_best_epochs_whatever_the_metric():
    """TrainResult.best_top1 was the highest top-1 over the epochs, while best_path holds the epoch --eval-metric
    chose: with top5 or loss those are other epochs, and the number did not belong to the weights beside it. It is
    now the chosen epoch's top-1 (the same number for the default top1 metric)."""
    from timm_patchmix.engine.run import _result
    rows = [{'epoch': 0, 'eval_top1': 14.0625, 'eval_top5': 60.9375},
            {'epoch': 1, 'eval_top1': 23.4375, 'eval_top5': 56.25}]
    cfg = TrainConfig(eval_metric='top5')
    res = _result(cfg, '/nowhere', rows, {'score': 60.9375, 'epoch': 0, 'metric': 'top5'}, None)
    assert res.best_top1 == 14.0625 and res.final_top1 == 23.4375
    res = _result(TrainConfig(), '/nowhere', rows, {'score': 23.4375, 'epoch': 1, 'metric': 'top1'}, None)
    assert res.best_top1 == 23.4375  # the default metric: the highest top-1, as before
    assert _result(TrainConfig(), '/nowhere', [], None, None).best_top1 is None


def test_an_unknown_torchcompile_backend_is_a_usage_error():
    """A backend torch does not know was named by torch only when the first batch was traced, in a traceback after
    the data and model were built; it is a ConfigError naming the flag now, and a known one is taken."""
    with pytest.raises(ConfigError, match=r"argument --torchcompile: 'nonexistent_backend' is not a torch\.compile "
                                          r"backend here; one of .*inductor"):
        TrainConfig(torchcompile='nonexistent_backend')
    assert TrainConfig(torchcompile='aot_eager').torchcompile == 'aot_eager'
