"""``--grad-accum-steps N``, as in timm's train.py: the gradients of N batches add up to one optimizer update (the loss
of each divided by N, the clip on their sum), an epoch's last group may be shorter, the schedule counts updates, and
timm's lr rule scales to the batch of one update."""
import copy

import pytest
import torch
import torch.nn as nn

import timm_patchmix  # noqa: F401
from timm_patchmix.engine import TrainConfig, scaled_lr
from timm_patchmix.engine.loop import Stepper, accumulation, train_one_epoch, train_step, updates_per_epoch
from timm_patchmix.engine.runtime import Runtime
from timm_patchmix.train import main, parse_config

TINY = ['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress']


def test_groups_of_an_epoch():
    # (the loss's divisor, the group's first batch, its last: the update)
    assert accumulation(5, 2) == [(2, True, False), (2, False, True), (2, True, False), (2, False, True),
                                  (1, True, True)]
    assert accumulation(4, 2) == [(2, True, False), (2, False, True), (2, True, False), (2, False, True)]
    assert accumulation(4, 3) == [(3, True, False), (3, False, False), (3, False, True), (1, True, True)]
    assert accumulation(3, 1) == [(1, True, True)] * 3
    assert accumulation(2, 5) == [(2, True, False), (2, False, True)]  # fewer batches than N: one update of all
    assert [updates_per_epoch(s, a) for s, a in ((5, 2), (4, 2), (4, 3), (3, 1), (2, 5), (0, 2))] == [3, 2, 2, 3, 1, 0]


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))  # no BatchNorm: a batch's split leaves the math alone


def _stepper(model, scaler=None, **cfg):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
    return Stepper(model, opt, nn.CrossEntropyLoss(), TrainConfig(**cfg), torch.device('cpu'), scaler=scaler)


def _batches(n, size=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 4, 4, generator=g), torch.randint(0, 5, (size,), generator=g)) for _ in range(n)]


def _close(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize('clip', [None, 0.05])
def test_an_accumulated_update_is_the_update_of_the_whole_batch(clip):
    (x1, y1), (x2, y2) = _batches(2)
    whole, parts = _model(), _model()
    s_whole, s_parts = _stepper(whole, clip_grad=clip), _stepper(parts, clip_grad=clip)
    before = copy.deepcopy(parts.state_dict())
    for _ in range(2):  # two updates, so that the momentum buffer of the first reaches the second
        train_step(s_whole, torch.cat([x1, x2]), torch.cat([y1, y2]))
        loss = train_step(s_parts, x1, y1, accum=2, first=True, update=False)
        if s_parts.updates == 0:  # the group's first batch leaves the weights and the update count alone
            assert all(torch.equal(v, before[k]) for k, v in parts.state_dict().items())
            assert all(p.grad is not None for p in parts.parameters())
            assert loss == pytest.approx(nn.functional.cross_entropy(parts(x1), y1).item(), rel=1e-6)  # undivided
        train_step(s_parts, x2, y2, accum=2, first=False, update=True)
    assert s_whole.updates == s_parts.updates == 2
    _close(whole, parts)
    if clip:  # the clip binds (unclipped weights differ), so equal weights mean that it clipped the group's sum
        free = _model()
        s_free = _stepper(free)
        for _ in range(2):
            train_step(s_free, torch.cat([x1, x2]), torch.cat([y1, y2]))
        with pytest.raises(AssertionError):
            _close(whole, free)


def test_the_loss_scaler_accumulates_alike():
    """timm's NativeScaler (float16 CUDA autocast's) steps only at the group's last batch (need_update)."""
    from timm.utils import NativeScaler
    (x1, y1), (x2, y2) = _batches(2, seed=4)
    plain, scaled = _model(), _model()
    s_plain, s_scaled = _stepper(plain, clip_grad=0.05), _stepper(scaled, NativeScaler('cpu'), clip_grad=0.05)
    for s in (s_plain, s_scaled):
        train_step(s, x1, y1, accum=2, first=True, update=False)
        train_step(s, x2, y2, accum=2, first=False, update=True)
    assert s_plain.updates == s_scaled.updates == 1
    _close(plain, scaled)


def test_an_epochs_last_group_may_be_shorter():
    """5 batches, N = 2: updates after batches 2, 4 and 5; the last update is batch 5's alone, its loss undivided."""
    batches = _batches(5, seed=7)
    epoch, ref = _model(), _model()
    s_epoch, s_ref = _stepper(epoch, grad_accum_steps=2, no_progress=True), _stepper(ref)
    seen = []
    train_one_epoch(s_epoch, batches, 0, Runtime(torch.device('cpu')), on_step=lambda e: seen.append(
        (e.step, e.steps, e.updates)))
    assert seen == [(1, 5, 0), (2, 5, 1), (3, 5, 1), (4, 5, 2), (5, 5, 3)]
    for i in (0, 2):
        train_step(s_ref, torch.cat([batches[i][0], batches[i + 1][0]]), torch.cat([batches[i][1], batches[i + 1][1]]))
    train_step(s_ref, *batches[4])
    _close(ref, epoch)


def test_log_lines_come_every_log_interval_updates_with_the_updates_lr(capsys):
    """--no-progress: as timm's train.py logs, a line at every --log-interval-th update of the epoch (counted in
    updates, not batches) and at the last batch, with the lr the update trained at."""
    batches = _batches(9, seed=3)  # N = 2: updates 0..4 at batches 2, 4, 6, 8 and 9
    model = _model()
    s = _stepper(model, grad_accum_steps=2, no_progress=True, log_interval=2)
    lrs = []

    def lower_the_lr(event):  # a schedule stand-in: each update lowers the lr for the next
        if event.step % 2 == 0:
            lrs.append(s.optimizer.param_groups[0]['lr'])
            s.optimizer.param_groups[0]['lr'] *= 0.5
    train_one_epoch(s, batches, 0, Runtime(torch.device('cpu')), on_step=lower_the_lr)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith('train 0 ')]
    assert [ln.split()[2] for ln in lines] == ['[2/9]', '[6/9]', '[9/9]']
    assert [float(ln.split()[6]) for ln in lines] == pytest.approx([lrs[0], lrs[2], lrs[3] * 0.5], rel=1e-3)


def test_the_lr_rule_scales_to_the_batch_of_an_update():
    base = dict(lr_base=0.1, lr_base_size=256, opt='sgd', batch_size=64)
    assert scaled_lr(TrainConfig(**base, grad_accum_steps=4)) == pytest.approx(0.1)
    assert scaled_lr(TrainConfig(**base, grad_accum_steps=2), world_size=2) == pytest.approx(0.1)
    assert scaled_lr(TrainConfig(**base)) == pytest.approx(0.025)
    assert scaled_lr(TrainConfig(**dict(base, opt='adamw', batch_size=16), grad_accum_steps=4)) == pytest.approx(0.05)
    cfg = parse_config(['--dataset', 'fashion_mnist', '--lr-base', '0.1', '-b', '64', '--grad-accum-steps', '4'])
    assert cfg.lr is None and scaled_lr(cfg) == pytest.approx(0.1)  # from the command line, before the model


def test_a_run_counts_updates_and_its_schedule_follows_them(tmp_path):
    """64 images, batch 16: 4 batches an epoch, N = 3 makes 2 updates (3 batches, then 1). A per-update cosine over
    2 epochs then spans 4 updates: half of it is done at the end of epoch 0 (lr 0.05 of 0.1); a schedule told of 4
    updates an epoch would stand at a quarter (0.0854)."""
    seen = []
    res = main(TINY + ['--epochs', '2', '--grad-accum-steps', '3', '--sched-on-updates', '--lr', '0.1', '--output',
                       str(tmp_path), '--experiment', 'accum'], on_step=lambda e: seen.append((e.epoch, e.updates)))
    assert seen == [(0, 0), (0, 0), (0, 1), (0, 2), (1, 2), (1, 2), (1, 3), (1, 4)]
    assert res['rows'][0]['lr'] == pytest.approx(0.05)
    with open(f'{res["output"]}/args.yaml') as f:
        assert 'grad_accum_steps: 3\n' in f.read()


@pytest.mark.parametrize('value', ['0', '-1', '1.5', 'two'])
def test_a_bad_count_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(['--grad-accum-steps', value])
    assert e.value.code == 2 and 'argument --grad-accum-steps: must be an integer >= 1' in capsys.readouterr().err


def test_a_resume_with_another_n_continues_the_per_update_schedule_where_its_epoch_begins(tmp_path, monkeypatch):
    """Epoch 0 with N = 1 (4 updates), then a resume with N = 2 (2 updates an epoch): the resumed epoch starts at
    update 2, as timm counts (epoch x updates per epoch), and every one of its updates trains at the lr of a run
    with N = 2 throughout."""
    import timm_patchmix.engine.loop as loop
    real, lrs = loop.train_step, []

    def recording(s, *args, **kwargs):  # the lr each update trains at
        if kwargs.get('update', True):
            lrs.append(s.optimizer.param_groups[0]['lr'])
        return real(s, *args, **kwargs)
    monkeypatch.setattr(loop, 'train_step', recording)
    flags = TINY + ['--sched-on-updates', '--lr', '0.1', '--output', str(tmp_path)]
    main(flags + ['--epochs', '3', '--grad-accum-steps', '2', '--experiment', 'whole'])
    whole, lrs[:] = list(lrs), []
    main(flags + ['--epochs', '1', '--experiment', 'changed'])
    lrs[:] = []
    seen = []
    main(flags + ['--epochs', '3', '--grad-accum-steps', '2', '--experiment', 'changed', '--resume',
                  str(tmp_path / 'changed' / 'state.safetensors')], on_step=lambda e: seen.append((e.epoch, e.updates)))
    assert seen[:4] == [(1, 2), (1, 3), (1, 3), (1, 4)]
    assert len(whole) == 6 and lrs == pytest.approx(whole[2:])
    assert whole[2] == pytest.approx(0.075)  # a third of the way: 0.05 x (1 + cos(pi / 3))
