"""PatchMixLoss against hand-computed values."""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from timm_patchmix import PatchMix, PatchMixLoss, PatchMixParams, split_target


def log_softmax(v):
    m = max(v)
    z = math.log(sum(math.exp(a - m) for a in v)) + m
    return [a - z for a in v]


def ce(logits, target):
    return -sum(t * l for t, l in zip(target, log_softmax(logits)))


@pytest.fixture
def example():
    """One sample of class 0 mixed with a sample of class 1 on a 1x2 grid of an 1x4 image (one cell each)."""
    mixer = PatchMix(grid=(1, 2), num_classes=3)
    params = PatchMixParams(torch.tensor([1, 0]), torch.tensor([[[True, False]], [[True, True]]]))
    _, packed = mixer.apply(torch.zeros(2, 1, 1, 4), torch.tensor([0, 1]), params)
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    patch = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 3.0, 1.0]], [[0.5, -0.5, 0.0], [2.0, 2.0, 2.0]]])
    return packed, logits, patch


def test_loss_matches_hand_computation(example):
    packed, logits, patch = example
    # sample 0: lam = 0.5 -> image target (0.5, 0.5, 0); cell 0 from itself (class 0), cell 1 from partner (class 1)
    # sample 1: unmixed, class 1 everywhere
    l_o = (ce([2.0, 0.5, -1.0], [0.5, 0.5, 0]) + ce([0.1, 0.2, 0.3], [0, 1, 0])) / 2
    l_p = ((ce([1.0, 0.0, 0.0], [1, 0, 0]) + ce([0.0, 3.0, 1.0], [0, 1, 0]))
           + (ce([0.5, -0.5, 0.0], [0, 1, 0]) + ce([2.0, 2.0, 2.0], [0, 1, 0]))) / 2
    loss = PatchMixLoss()((logits, patch), packed)
    assert loss.item() == pytest.approx((l_o + l_p / 2) / 2, rel=1e-6)
    assert PatchMixLoss(patch_loss=False)((logits, patch), packed).item() == pytest.approx(l_o, rel=1e-6)
    assert PatchMixLoss(image_loss=False)((logits, patch), packed).item() == pytest.approx(l_p / 2, rel=1e-6)
    assert PatchMixLoss(patch_weight=3.0)((logits, patch), packed).item() == pytest.approx((l_o + 3 * l_p / 2) / 2,
                                                                                          rel=1e-6)
    # a plain classifier output gives L_O alone
    assert PatchMixLoss()(logits, packed).item() == pytest.approx(l_o, rel=1e-6)


def test_int_target_is_cross_entropy_and_matches_unmixed_packed():
    torch.manual_seed(0)
    logits, patch = torch.randn(4, 5), torch.randn(4, 16, 5)
    y = torch.tensor([0, 4, 2, 2])
    assert torch.allclose(PatchMixLoss()(logits, y), F.cross_entropy(logits, y))
    mixer = PatchMix(num_classes=5)
    _, packed = mixer.apply(torch.rand(4, 3, 8, 8), y, PatchMixParams.identity(4, 4))
    torch.testing.assert_close(PatchMixLoss()((logits, patch), y), PatchMixLoss()((logits, patch), packed))
    expected = (F.cross_entropy(logits, y) + F.cross_entropy(patch.reshape(-1, 5), y.repeat_interleave(16))) / 2
    torch.testing.assert_close(PatchMixLoss()((logits, patch), y), expected)


def test_loss_gradients_flow_and_half_logits():
    logits = torch.randn(2, 3, requires_grad=True)
    patch = torch.randn(2, 4, 3, requires_grad=True)
    _, packed = PatchMix(grid=2, num_classes=3)(torch.rand(2, 3, 4, 4), torch.tensor([0, 2]))
    loss = PatchMixLoss()((logits.half(), patch.half()), packed)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.abs().sum() > 0 and patch.grad.abs().sum() > 0


def test_loss_errors():
    logits, patch = torch.randn(2, 3), torch.randn(2, 4, 3)
    soft = torch.softmax(torch.randn(2, 3), 1)
    with pytest.raises(ValueError, match='no per-cell labels'):
        PatchMixLoss()((logits, patch), soft)
    assert PatchMixLoss(patch_loss=False)((logits, patch), soft).item() > 0
    _, packed16 = PatchMix(grid=4, num_classes=3)(torch.rand(2, 3, 8, 8), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r'built for a 4x4 grid \(16 cells\) and 3 classes, but the model gives 4 '):
        PatchMixLoss()((logits, patch), packed16)
    with pytest.raises(ValueError, match='target batch size 3'):
        PatchMixLoss()(logits, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match='image_loss or patch_loss'):
        PatchMixLoss(image_loss=False, patch_loss=False)


def reference_loss(logits, patch_logits, packed, patch_weight):
    """The two terms scored apart, straight from the paper's formula on ``split_target``'s targets."""
    from timm_patchmix import split_target
    from timm_patchmix.loss import soft_cross_entropy
    image_t, patch_t = split_target(packed)
    l_o = soft_cross_entropy(logits, image_t).mean()
    l_p = soft_cross_entropy(patch_logits, patch_t).sum(1).mean()
    return (l_o + patch_weight * l_p / patch_logits.shape[1]) / 2


@pytest.mark.parametrize('grid, hw', [((4, 4), (32, 32)), ((2, 3), (37, 29)), ((1, 1), (8, 8))])
@pytest.mark.parametrize('smoothing', [0.0, 0.1])
@pytest.mark.parametrize('patch_weight', [1.0, 0.25])
@pytest.mark.parametrize('prob', [1.0, 0.5])
def test_one_pass_loss_and_gradients_equal_the_two_terms(grid, hw, smoothing, patch_weight, prob):
    """PatchMixLoss scores image and cell rows in one pass; value and gradients equal the two-term formula."""
    g = torch.Generator().manual_seed(sum(grid) + int(10 * smoothing) + int(4 * patch_weight) + int(2 * prob))
    b, c = 12, 7
    k = grid[0] * grid[1]
    mixer = PatchMix(grid=grid, num_classes=c, label_smoothing=smoothing, prob=prob)
    _, packed = mixer(torch.rand(b, 3, *hw, generator=g), torch.randint(0, c, (b,), generator=g), generator=g)
    logits = (3 * torch.randn(b, c, generator=g)).requires_grad_()
    patch = (3 * torch.randn(b, k, c, generator=g)).requires_grad_()
    fused = PatchMixLoss(patch_weight=patch_weight)((logits, patch), packed)
    gf = torch.autograd.grad(fused, (logits, patch))
    ref = reference_loss(logits, patch, packed, patch_weight)
    gr = torch.autograd.grad(ref, (logits, patch))
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)
    for a, r in zip(gf, gr):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)


def test_one_pass_loss_under_bfloat16_logits_is_float32():
    g = torch.Generator().manual_seed(0)
    _, packed = PatchMix(num_classes=5)(torch.rand(6, 3, 16, 16, generator=g), torch.arange(6) % 5, generator=g)
    logits, patch = torch.randn(6, 5, generator=g), torch.randn(6, 16, 5, generator=g)
    fused = PatchMixLoss()((logits.bfloat16(), patch.bfloat16()), packed)
    assert fused.dtype == torch.float32
    ref = reference_loss(logits.bfloat16(), patch.bfloat16(), packed, 1.0)
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)


def test_smoothing_of_class_indices_is_timms_and_the_idle_mixers():
    """PatchMixLoss(smoothing=s) on class indices: by hand, timm's LabelSmoothingCrossEntropy for the image term and
    for every cell, and the loss of the idle mixer's packed target smoothed by s; packed targets are left as given."""
    from timm.loss import LabelSmoothingCrossEntropy
    g = torch.Generator().manual_seed(3)
    logits, patch = torch.randn(4, 5, generator=g), torch.randn(4, 16, 5, generator=g)
    y = torch.tensor([0, 4, 2, 2])
    s = 0.1
    # by hand: the smoothed row puts 1 - s + s/C on the label and s/C elsewhere
    rows = [[s / 5 + (1 - s) * (k == int(label)) for k in range(5)] for label in y]
    by_hand = sum(ce(logits[i].tolist(), rows[i]) for i in range(4)) / 4
    assert PatchMixLoss(smoothing=s)(logits, y).item() == pytest.approx(by_hand, rel=1e-6)
    timm_ls = LabelSmoothingCrossEntropy(smoothing=s)
    torch.testing.assert_close(PatchMixLoss(smoothing=s)(logits, y), timm_ls(logits, y))
    expected = (timm_ls(logits, y) + timm_ls(patch.reshape(-1, 5), y.repeat_interleave(16))) / 2
    torch.testing.assert_close(PatchMixLoss(smoothing=s)((logits, patch), y), expected)
    unsmoothed = PatchMixLoss()((logits, patch), y).item()
    assert PatchMixLoss(smoothing=s)((logits, patch), y).item() != pytest.approx(unsmoothed, rel=1e-3)
    # the idle mixer's packed target, smoothed by the mixer: the same loss; the loss does not smooth it again
    idle = PatchMix(num_classes=5, label_smoothing=s)
    _, packed = idle.apply(torch.rand(4, 3, 8, 8), y, PatchMixParams.identity(4, 4))
    for loss in (PatchMixLoss(), PatchMixLoss(smoothing=s), PatchMixLoss(smoothing=0.3)):
        torch.testing.assert_close(loss((logits, patch), packed), expected)


@pytest.mark.parametrize('smoothing', [-0.1, 1.0, float('nan'), '0.1', True])
def test_bad_smoothing_is_refused_by_name(smoothing):
    with pytest.raises(ValueError, match=r'smoothing must be a finite number in \[0, 1\)'):
        PatchMixLoss(smoothing=smoothing)


@pytest.mark.parametrize('weight', [-1.0, float('nan'), float('inf'), '1', True])
def test_bad_patch_weight_is_refused_by_name(weight):
    """A weight that would make every loss NaN (or negative, or not a number) is refused when the loss is made."""
    with pytest.raises(ValueError, match='patch_weight must be a finite number >= 0'):
        PatchMixLoss(patch_weight=weight)


def test_a_packed_target_of_another_grid_and_class_count_but_the_same_width_is_refused():
    """3 + 2C + cells: a 2x3 grid of 7 classes packs as wide as 4 cells of 8 classes. The header says which; the
    loss reads it and names both layouts instead of misreading the columns."""
    mixer = PatchMix(grid=(2, 3), num_classes=7)
    _, packed = mixer(torch.rand(4, 3, 8, 9), torch.randint(0, 7, (4,)))
    assert packed.shape[1] == 3 + 2 * 8 + 4
    with pytest.raises(ValueError, match=r'packed target was built for a 2x3 grid \(6 cells\) and 7 classes, but '
                                         r'the model gives 4 patch logits of 8 classes'):
        PatchMixLoss()((torch.randn(4, 8), torch.randn(4, 4, 8)), packed)
    logits, patch = torch.randn(4, 7), torch.randn(4, 6, 7)
    image_t, patch_t = split_target(packed)
    expected = (F.cross_entropy(logits, image_t) + F.cross_entropy(patch.flatten(0, 1), patch_t.flatten(0, 1))) / 2
    assert torch.allclose(PatchMixLoss()((logits, patch), packed), expected, atol=1e-6)


@pytest.mark.parametrize('bce, image_loss', [(False, True), (True, True), (False, False)])
def test_a_packed_target_of_a_transposed_grid_is_refused_when_the_loss_knows_the_models_grid(bce, image_loss):
    """A 4x3 grid packs as wide as a 3x4 one (same cells, same classes): with ``grid`` the loss refuses a target
    of the other one (each cell would be scored against another region), on the one-pass path and on the split
    path (BCE, patch term alone); with the model's own grid it scores as without ``grid``; without ``grid`` only
    the cell count can be checked (as before)."""
    _, packed = PatchMix(grid=(4, 3), num_classes=5)(torch.rand(4, 3, 12, 12), torch.randint(0, 5, (4,)))
    out = (torch.randn(4, 5), torch.randn(4, 12, 5))
    kw = dict(bce=bce, image_loss=image_loss)
    with pytest.raises(ValueError, match=r'packed target was built for a 4x3 grid, (but the loss is for the model\'s '
                                         r'3x4 grid|not 3x4)'):
        PatchMixLoss(grid=(3, 4), **kw)(out, packed)
    assert torch.equal(PatchMixLoss(grid=(4, 3), **kw)(out, packed), PatchMixLoss(**kw)(out, packed))
    assert 'grid=(4, 3)' in repr(PatchMixLoss(grid=(4, 3)))
    with pytest.raises(ValueError, match='grid'):
        PatchMixLoss(grid=(0, 3))


def test_train_py_gives_the_loss_the_models_grid():
    import timm
    import timm_patchmix  # noqa: F401
    from timm_patchmix.engine.config import TrainConfig, resolve
    from timm_patchmix.engine.run import _criterion
    for name, grid in (('patchhead_resnet8_cifar', (4, 3)), ('resnet8_cifar', None)):
        model = timm.create_model(name, num_classes=10, **({'grid': grid} if grid else {}))
        cfg = resolve(TrainConfig(model=name, patchmix=True).with_recipe(), model=model, num_classes=10,
                      data_config=timm.data.resolve_data_config({}, model=model))
        assert _criterion(cfg).grid == grid  # a plain model gives no patch logits: no grid to check


def test_switches_must_be_bools_and_targets_may_be_lists():
    for name in ('image_loss', 'patch_loss', 'bce', 'bce_sum'):
        with pytest.raises(ValueError, match=rf"^{name} must be True or False, got 'no'$"):
            PatchMixLoss(**{name: 'no'})
    assert PatchMixLoss(patch_loss=np.bool_(False)).patch_loss is False
    logits = torch.randn(3, 4)
    assert torch.equal(PatchMixLoss()(logits, [0, 3, 1]), PatchMixLoss()(logits, torch.tensor([0, 3, 1])))
    assert torch.equal(PatchMixLoss()(logits, np.array([0, 3, 1])), F.cross_entropy(logits, torch.tensor([0, 3, 1])))
    with pytest.raises(ValueError, match='got a scalar'):
        PatchMixLoss()(logits, torch.tensor(1))


def test_the_header_is_not_read_where_there_are_no_values_or_a_trace_runs():
    """A meta target, a fake tensor and a ``torch.compile(fullgraph=True)`` trace have no header values to read:
    the loss is built without reading it (and is the eager value when compiled)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, packed = PatchMix(grid=2, num_classes=3)(torch.rand(4, 3, 8, 8), torch.randint(0, 3, (4,)))
    out = (torch.randn(4, 3), torch.randn(4, 4, 3))
    compiled = torch.compile(PatchMixLoss(), backend='aot_eager', fullgraph=True)
    assert torch.allclose(compiled(out, packed), PatchMixLoss()(out, packed), atol=1e-6)
    meta = PatchMixLoss()((out[0].to('meta'), out[1].to('meta')), packed.to('meta'))
    assert meta.device.type == 'meta' and meta.shape == ()
    with FakeTensorMode():
        assert PatchMixLoss()((torch.randn(4, 3), torch.randn(4, 4, 3)), torch.randn(*packed.shape)).shape == ()


def test_an_empty_batch_and_a_plain_logits_target_of_another_grid_are_named():
    """An empty batch (which the mixers and models pass through) is a ValueError naming it, not a division by zero
    or a request for the grid the loss was given; on plain logits (a patch head in eval mode) a loss that knows
    the model's grid checks a packed target's grid too, and scores one of its grid as without ``grid``."""
    x, t = PatchMix(grid=4, num_classes=10)(torch.rand(0, 3, 32, 32), torch.zeros(0, dtype=torch.long))
    for out in (torch.randn(0, 10), (torch.randn(0, 10), torch.randn(0, 16, 10))):
        for loss in (PatchMixLoss(), PatchMixLoss(grid=4), PatchMixLoss(bce=True)):
            with pytest.raises(ValueError, match=r'PatchMixLoss got an empty batch \(0 samples\)'):
                loss(out, t)
    with pytest.raises(ValueError, match='empty batch'):
        PatchMixLoss()(torch.randn(0, 10), torch.zeros(0, dtype=torch.long))
    _, packed = PatchMix(grid=(4, 3), num_classes=5)(torch.rand(4, 3, 12, 12), torch.randint(0, 5, (4,)))
    logits = torch.randn(4, 5)
    with pytest.raises(ValueError, match='packed target was built for a 4x3 grid, not 3x4'):
        PatchMixLoss(grid=(3, 4))(logits, packed)
    assert torch.equal(PatchMixLoss(grid=(4, 3))(logits, packed), PatchMixLoss()(logits, packed))


@pytest.mark.parametrize('patch_head', [False, True])
def test_targets_for_another_class_count_are_named(patch_head):
    """A soft target of timm's Mixup made for 10 classes, given to a 5-class model, was read as a packed target and
    refused as one 'with a grid of 0x0'; a packed target of another class count on plain logits was split first.
    Both are now named for what they are, with the model's class count."""
    from timm.data import Mixup
    out = (torch.randn(4, 5), torch.randn(4, 16, 5)) if patch_head else torch.randn(4, 5)
    _, soft10 = Mixup(mixup_alpha=1.0, num_classes=10)(torch.rand(4, 3, 8, 8), torch.arange(4))
    cells = ' and 16 cells' if patch_head else ''
    with pytest.raises(ValueError, match=re.escape(
            f"target of shape [4, 10] is neither class indices, a [B, 5] soft target for the model's 5 classes, "
            f"nor a packed target for 5 classes{cells}; make the targets for num_classes=5")):
        PatchMixLoss()(out, soft10)
    _, packed6 = PatchMix(grid=4, num_classes=6)(torch.rand(4, 3, 8, 8), torch.arange(4))
    with pytest.raises(ValueError, match='packed target holds 6 classes but the model has 5; mix with num_classes=5'):
        PatchMixLoss()(out, packed6)
    _, packed5 = PatchMix(grid=4, num_classes=5)(torch.rand(4, 3, 8, 8), torch.arange(4))
    assert torch.isfinite(PatchMixLoss()(out, packed5))


@pytest.mark.parametrize('kw', [dict(patch_loss=False), dict(bce=True, patch_loss=False), dict(bce=True),
                                dict(image_loss=False)])
def test_a_packed_target_of_another_class_count_and_the_same_width_is_refused_off_the_fast_path(kw):
    """A 2x3 grid of 7 classes and 4 cells of 8 give the same packed width (3 + 2C + cells): off the one-pass path
    (BCE, one of the two losses) such a target must be refused by its class count, not fail in torch's shape
    arithmetic; and a target of three or more dims is named, not a TypeError."""
    _, packed = PatchMix(grid=(2, 3), num_classes=7)(torch.rand(4, 3, 12, 12), torch.arange(4))
    out = (torch.randn(4, 8), torch.randn(4, 4, 8))
    with pytest.raises(ValueError, match='packed target holds 7 classes but the model has 8; mix with num_classes=8'):
        PatchMixLoss(**kw)(out, packed)
    for target in (torch.zeros(4, 3, 8), torch.zeros(4, 2, 8, 8)):
        with pytest.raises(ValueError, match=re.escape(f'target of shape {list(target.shape)} is neither class '
                                                       f'indices')):
            PatchMixLoss(**kw)(out, target)


@pytest.mark.parametrize('kw', [dict(), dict(grid=2), dict(patch_loss=False), dict(bce=True), dict(image_loss=False)])
@pytest.mark.parametrize('prob,smoothing', [(1.0, 0.0), (0.0, 0.0), (0.5, 0.1)])
def test_a_packed_target_as_wide_as_the_models_classes_is_refused(kw, prob, smoothing):
    """A packed target of 4 classes on a 2x2 grid is 3 + 8 + 4 = 15 columns wide: for a 15-class model it has the
    width of a soft target and was scored as one (its header, lam and cell masks read as class probabilities),
    without a word. It is now refused by its class count; soft targets of 15 classes still score."""
    from timm.data import Mixup
    _, packed = PatchMix(grid=2, num_classes=4, prob=prob, label_smoothing=smoothing)(
        torch.rand(3, 3, 8, 8), torch.tensor([0, 1, 2]))
    assert packed.shape == (3, 15)
    for out in (torch.randn(3, 15), (torch.randn(3, 15), torch.randn(3, 4, 15))):
        with pytest.raises(ValueError, match=re.escape('packed target holds 4 classes (a 2x2 grid) but the model '
                                                       'has 15; mix with num_classes=15')):
            PatchMixLoss(**kw)(out, packed)
    logits = torch.randn(4, 15)
    for mixup in (Mixup(mixup_alpha=1.0, num_classes=15, label_smoothing=0.0),
                  Mixup(mixup_alpha=1.0, cutmix_alpha=1.0, num_classes=15, label_smoothing=0.1)):
        _, soft = mixup(torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 14]))
        loss = PatchMixLoss(**{k: v for k, v in kw.items() if k not in ('image_loss', 'patch_loss')}, patch_loss=False)
        ref = (F.binary_cross_entropy_with_logits(logits, soft, reduction='none').mean(1) if kw.get('bce')
               else -(soft * F.log_softmax(logits, -1)).sum(1))
        assert torch.allclose(loss(logits, soft), ref.mean())


def test_multi_hot_bce_targets_that_begin_like_a_packed_header_still_score():
    """A multi-hot target whose first row starts 1, 1 (the header of a 1x1 grid), with one positive in each of the
    next blocks, was refused as a packed target by the check above; a packed target's fields must hold in every
    row, lam agreeing with its cells, which such targets do not."""
    from timm.loss import BinaryCrossEntropy
    t = torch.tensor([[1, 1, 0, 1, 0, 0, 0, 1, 0, 1.]] * 2)  # classes 0, 1, 3, 7, 9: lam 0, but its one cell kept
    logits = torch.randn(2, 10)
    assert torch.allclose(PatchMixLoss(bce=True, patch_loss=False)(logits, t), BinaryCrossEntropy()(logits, t))
    rows = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 1, 0, 1.], [1, 1, 0, 1, 0, 0, 0, 1, 0, 1.]])  # lam 1 and 0, cell kept
    assert torch.allclose(PatchMixLoss(bce=True, patch_loss=False)(logits, rows), BinaryCrossEntropy()(logits, rows))
    # the same layout as a packed target of 3 classes on a 1x1 grid: refused
    _, packed = PatchMix(grid=1, num_classes=3)(torch.rand(2, 3, 4, 4), torch.tensor([0, 2]))
    assert packed.shape == (2, 10)
    with pytest.raises(ValueError, match=r'packed target holds 3 classes \(a 1x1 grid\) but the model has 10'):
        PatchMixLoss(bce=True, patch_loss=False)(logits, packed)


def test_a_mixer_pickled_before_its_settings_were_checked_loads():
    """PatchMix keeps prob, mode, label_smoothing and num_classes behind checked properties: a mixer pickled
    before (its settings as plain attributes) loads with them."""
    import pickle
    mixer = PatchMix(grid=2, num_classes=3, prob=0.5, mode='pair', label_smoothing=0.1)
    state = mixer.__getstate__()
    old = {(k[1:] if k in ('_prob', '_mode', '_label_smoothing', '_num_classes') else k): v for k, v in state.items()}
    old.pop('cuda_graph')
    again = PatchMix.__new__(PatchMix)
    again.__setstate__(old)
    assert (again.prob, again.mode, again.label_smoothing, again.num_classes, again.cuda_graph) == \
        (0.5, 'pair', 0.1, 3, True)
    assert repr(pickle.loads(pickle.dumps(mixer))) == repr(mixer) == repr(again)
