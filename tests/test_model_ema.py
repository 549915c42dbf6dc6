"""``--model-ema``, as in timm's train.py: timm's ``ModelEmaV3`` of the weights, updated after each optimizer update
(by hand: the first update copies, later ones average with the decay), is what each epoch evaluates, what
``--eval-metric`` selects and what ``best``/``last.safetensors`` hold; the training state holds both."""
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import timm_patchmix  # noqa: F401
from timm_patchmix.checkpoint import load_state, load_weights
from timm_patchmix.engine import TrainConfig
from timm_patchmix.engine.loop import Stepper, train_step
from timm_patchmix.train import main, parse_config

from test_train import _evaluate_alone

TINY = ['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress', '--device', 'cpu']


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 5, (4,), generator=g)


@pytest.mark.parametrize('warmup', [False, True])
def test_the_average_by_hand(warmup):
    from timm.utils import ModelEmaV3
    model = _model()
    ema = ModelEmaV3(model, decay=0.9, use_warmup=warmup)
    s = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(),
                TrainConfig(grad_accum_steps=2), torch.device('cpu'), ema=ema)
    expected = None
    for update in range(1, 4):
        train_step(s, *_batch(2 * update), accum=2, first=True, update=False)  # no update: the average waits
        if expected is not None:
            torch.testing.assert_close(ema.module[1].weight, expected)
        train_step(s, *_batch(2 * update + 1), accum=2, first=False, update=True)
        w = model[1].weight.detach().clone()
        if update == 1:
            decay = 0.0  # timm's: the first update copies the weights
        else:  # timm's warm-up: 1 - (1 + k)^(-2/3) after k updates past the first, at most the decay
            decay = min(1 - (1 + (update - 1)) ** (-2 / 3), 0.9) if warmup else 0.9
        expected = w.clone() if update == 1 else decay * expected + (1 - decay) * w
        torch.testing.assert_close(ema.module[1].weight, expected)
    assert s.updates == 3
    assert not torch.equal(ema.module[1].weight, model[1].weight)


def test_a_run_evaluates_selects_and_saves_the_average(tmp_path):
    res = main(TINY + ['--epochs', '2', '--patchmix', '--model-ema', '--model-ema-decay', '0.5', '--output',
                       str(tmp_path), '--experiment', 'ema'])
    out = res['output']
    state = load_state(os.path.join(out, 'state.safetensors'))
    average = {k[len('ema.'):]: v for k, v in state['extra'].items() if k.startswith('ema.')}
    last, meta = load_weights(os.path.join(out, 'last.safetensors'))
    assert last.keys() == average.keys() == state['model'].keys()
    assert all(torch.equal(last[k], average[k]) for k in last)  # the weights files hold the average
    assert any(not torch.equal(last[k], state['model'][k]) for k in last)  # which is not the trained weights
    assert meta['model_ema'] == {'decay': 0.5, 'warmup': False}
    # the summary's numbers are the average's: evaluated alone, its weights give them
    ev = _evaluate_alone(os.path.join(out, 'last.safetensors'), TINY + ['--patchmix'])
    assert round(ev['eval_top1'], 4) == res['rows'][-1]['eval_top1']
    assert ev['eval_loss'] == pytest.approx(res['rows'][-1]['eval_loss'], abs=2e-6)
    # best.safetensors: the average of the best epoch, which gives that epoch's numbers
    best_epoch = res['best']['epoch']
    ev = _evaluate_alone(os.path.join(out, 'best.safetensors'), TINY + ['--patchmix'])
    assert round(ev['eval_top1'], 4) == res['rows'][best_epoch]['eval_top1']
    assert ev['eval_loss'] == pytest.approx(res['rows'][best_epoch]['eval_loss'], abs=2e-6)
    if best_epoch == 1:
        best = load_file(os.path.join(out, 'best.safetensors'))
        assert all(torch.equal(best[k], last[k]) for k in last)


@pytest.mark.parametrize('flags, message', [
    (['--model-ema-decay', '0.5'], '--model-ema-decay sets the weight average of --model-ema, which is off'),
    # at its default value too: given on the command line, it asks for an average that would not be kept
    (['--model-ema-decay', '0.9998'], '--model-ema-decay sets the weight average of --model-ema, which is off'),
    (['--model-ema-warmup'], '--model-ema-warmup sets the weight average of --model-ema, which is off'),
    (['--model-ema', '--model-ema-decay', '1.0'], 'argument --model-ema-decay: must be a finite number in [0, 1)'),
])
def test_usage_errors(flags, message, capsys):
    from timm_patchmix.train import resolve_args
    with pytest.raises(SystemExit) as e:
        resolve_args(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert parse_config(['--model-ema', '--model-ema-decay', '0.5', '--model-ema-warmup']).model_ema_decay == 0.5
    assert parse_config(['--model-ema', '--model-ema-decay', '0.9998']).model_ema_decay == 0.9998
