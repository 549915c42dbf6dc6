"""``--bce-loss`` (timm's ``BinaryCrossEntropy``, with ``--bce-sum``, ``--bce-target-thresh``, ``--bce-pos-weight``):
timm's loss itself for the baselines, and in ``PatchMixLoss`` the same BCE for the image row and each cell's row, so
that each term equals timm's loss on that row and the patch term is their mean over the cells."""
import pytest
import torch
from timm.loss import BinaryCrossEntropy

import timm_patchmix  # noqa: F401
from timm_patchmix import PatchMix, PatchMixLoss
from timm_patchmix import train as train_cli
from timm_patchmix.engine import ConfigError
from timm_patchmix.engine.run import _criterion
from timm_patchmix.mix import split_target

OPTIONS = [dict(), dict(bce_target_thresh=0.2), dict(bce_sum=True), dict(bce_pos_weight=3.0),
           dict(bce_target_thresh=0.5, bce_sum=True, bce_pos_weight=0.5)]


def _timm(smoothing=0.0, bce_target_thresh=None, bce_sum=False, bce_pos_weight=None):
    return BinaryCrossEntropy(smoothing=smoothing, target_threshold=bce_target_thresh, sum_classes=bce_sum,
                              pos_weight=bce_pos_weight)


@pytest.mark.parametrize('options', OPTIONS)
@pytest.mark.parametrize('smoothing', [0.0, 0.1])
def test_image_term_of_class_indices_is_timms_bce(options, smoothing):
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(6, 5, generator=g), torch.randint(0, 5, (6,), generator=g)
    ours = PatchMixLoss(patch_loss=False, smoothing=smoothing, bce=True, **options)(logits, y)
    torch.testing.assert_close(ours, _timm(smoothing, **options)(logits, y), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('options', OPTIONS)
@pytest.mark.parametrize('weight', [1.0, 0.5])
def test_patchmix_bce_is_timms_bce_on_the_image_and_the_mean_over_the_cells(options, weight):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,), generator=g)
    torch.manual_seed(0)
    _, packed = PatchMix(grid=4, num_classes=5, label_smoothing=0.1)(x, y)
    logits, patch_logits = torch.randn(8, 5, generator=g), torch.randn(8, 16, 5, generator=g)
    image_t, patch_t = split_target(packed)
    timm_bce = _timm(**options)  # dense targets: used as given, as the mixer smoothed them
    want = (timm_bce(logits, image_t) + weight * torch.stack(
        [timm_bce(patch_logits[:, k], patch_t[:, k]) for k in range(16)]).mean()) / 2
    loss = PatchMixLoss(patch_weight=weight, bce=True, **options)
    torch.testing.assert_close(loss((logits, patch_logits), packed), want, rtol=1e-6, atol=1e-7)
    # class indices: every cell's target is the image's
    idx_want = (_timm(**options)(logits, y) + weight * torch.stack(
        [_timm(**options)(patch_logits[:, k], y) for k in range(16)]).mean()) / 2
    torch.testing.assert_close(loss((logits, patch_logits), y), idx_want, rtol=1e-6, atol=1e-7)
    patch_only = PatchMixLoss(image_loss=False, patch_weight=weight, bce=True, **options)((logits, patch_logits), y)
    torch.testing.assert_close(patch_only, weight * torch.stack(
        [_timm(**options)(patch_logits[:, k], y) for k in range(16)]).mean(), rtol=1e-6, atol=1e-7)


def test_bce_differs_from_the_cross_entropy_and_its_options_need_it():
    g = torch.Generator().manual_seed(2)
    logits, patch_logits, y = torch.randn(4, 5, generator=g), torch.randn(4, 4, 5, generator=g), torch.arange(4)
    assert not torch.isclose(PatchMixLoss(bce=True)((logits, patch_logits), y),
                             PatchMixLoss()((logits, patch_logits), y))
    with pytest.raises(ValueError, match='bce_target_thresh, bce_sum and bce_pos_weight set the BCE of bce=True'):
        PatchMixLoss(bce_sum=True)
    with pytest.raises(ValueError, match='bce_pos_weight must be a finite number >= 0'):
        PatchMixLoss(bce=True, bce_pos_weight=-1.0)


def _cfg(argv):
    return train_cli.parse_config(['--model', 'resnet8_cifar'] + argv)


def test_the_criterion_of_each_kind_of_run():
    crit = _criterion(_cfg(['--bce-loss', '--cutmix', '1.0', '--bce-pos-weight', '2']))
    assert isinstance(crit, BinaryCrossEntropy) and crit.smoothing == 0.0 and float(crit.pos_weight) == 2.0
    crit = _criterion(_cfg(['--bce-loss', '--smoothing', '0.1', '--bce-target-thresh', '0.3', '--bce-sum']))
    assert isinstance(crit, BinaryCrossEntropy) and crit.smoothing == 0.1 and crit.target_threshold == 0.3
    assert crit.sum_classes
    crit = _criterion(_cfg(['--bce-loss', '--smoothing', '0']))  # timm would fall back to the cross-entropy
    assert isinstance(crit, BinaryCrossEntropy) and crit.smoothing == 0.0
    crit = _criterion(train_cli.parse_config(['--patchmix', '--bce-loss', '--bce-sum']))
    assert isinstance(crit, PatchMixLoss) and crit.bce and crit.bce_sum and crit.bce_pos_weight is None


@pytest.mark.parametrize('argv, message', [
    (['--bce-sum'], '--bce-sum sets the binary cross-entropy of --bce-loss, which is off'),
    (['--bce-target-thresh', '0.2', '--bce-pos-weight', '2'], '--bce-target-thresh and --bce-pos-weight set'),
])
def test_bce_options_without_bce_loss_are_usage_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(argv)


@pytest.mark.parametrize('argv', [['--patchmix', '--bce-loss', '--bce-target-thresh', '0.2'],
                                  ['--model', 'resnet8_cifar', '--cutmix', '1.0', '--bce-loss', '--bce-pos-weight',
                                   '2']])
def test_a_bce_run_trains(tmp_path, argv):
    res = train_cli.main(['--train-subset', '32', '--val-subset', '16', '-b', '8', '-j', '0', '--epochs', '1',
                          '--device', 'cpu', '--no-progress', '--output', str(tmp_path)] + argv)
    assert [r['epoch'] for r in res['rows']] == [0] and res['rows'][0]['train_loss'] > 0
