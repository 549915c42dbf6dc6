"""Exact semantics of the PatchMix tensor mixer: pixels, labels, lambda, modes, dtypes and errors."""
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from timm_patchmix import PatchMix, PatchMixParams, cell_areas, cell_bounds, split_target, to_grid
from timm_patchmix.mix import pack_target


def reference_mix(x, partner, mask):
    """Pixel-by-pixel reference: every pixel looks up its cell with the floor(k*H/rows) rule directly."""
    b, _, h, w = x.shape
    rows, cols = mask.shape[1:]
    out = torch.empty_like(x)
    keep = torch.empty(b, h, w, dtype=torch.bool)
    row_of = [max(r for r in range(rows) if (r * h) // rows <= y) for y in range(h)]
    col_of = [max(c for c in range(cols) if (c * w) // cols <= xx) for xx in range(w)]
    for i in range(b):
        for y in range(h):
            for xx in range(w):
                k = bool(mask[i, row_of[y], col_of[xx]])
                keep[i, y, xx] = k
                out[i, :, y, xx] = x[i, :, y, xx] if k else x[partner[i], :, y, xx]
    return out, keep


def one_hot(y, c, smoothing=0.0):
    t = torch.zeros(len(y), c)
    t[torch.arange(len(y)), y] = 1.0
    return t * (1 - smoothing) + smoothing / c if smoothing else t


def test_cell_bounds_formula_and_errors():
    assert cell_bounds(32, 4) == (0, 8, 16, 24, 32)
    assert cell_bounds(10, 4) == (0, 2, 5, 7, 10)
    assert cell_bounds(7, 7) == tuple(range(8))
    for size in range(1, 30):
        for parts in range(1, size + 1):
            b = cell_bounds(size, parts)
            assert b == tuple(math.floor(k * size / parts) for k in range(parts + 1))
            assert all(b[k + 1] > b[k] for k in range(parts))
    with pytest.raises(ValueError, match='cannot split a length of 3 into 4'):
        cell_bounds(3, 4)
    assert to_grid(4) == (4, 4) and to_grid((2, 3)) == (2, 3)
    for bad in (0, (0, 2), (2,), 'ab', 2.5, True):
        with pytest.raises(ValueError, match='grid'):
            to_grid(bad)
    assert cell_areas(10, 7, (4, 3)).sum().item() == 70


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 7), h=st.integers(1, 13), w=st.integers(1, 13),
    rows=st.integers(1, 5), cols=st.integers(1, 5),
    mode=st.sampled_from(['elem', 'pair', 'batch']), prob=st.sampled_from([0.0, 0.5, 1.0]),
    smoothing=st.sampled_from([0.0, 0.1]), soft=st.booleans(), seed=st.integers(0, 2 ** 16),
)
def test_pixels_labels_and_lambda_exact(b, h, w, rows, cols, mode, prob, smoothing, soft, seed):
    h, w = max(h, rows), max(w, cols)
    c = 5
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, 2, h, w, generator=g)
    y = torch.randint(0, c, (b,), generator=g)
    target = torch.softmax(torch.randn(b, c, generator=g), 1) if soft else y
    mixer = PatchMix(grid=(rows, cols), prob=prob, mode=mode, label_smoothing=smoothing, num_classes=c)
    params = mixer.sample(b, generator=g)
    assert params.partner.dtype == torch.long and params.mask.dtype == torch.bool
    assert params.mask.shape == (b, rows, cols)
    out, packed = mixer.apply(x.clone(), target, params)

    ref, keep = reference_mix(x, params.partner, params.mask)
    assert torch.equal(out, ref)

    rows_t = (target if soft else one_hot(y, c)) * (1 - smoothing) + smoothing / c
    rows_t = rows_t.float()
    lam = keep.double().mean((1, 2)).float()  # fraction of pixels from the sample itself
    image_t, patch_t = split_target(packed, (rows, cols))
    assert packed.dtype == torch.float32 and image_t.dtype == torch.float32
    expected_image = lam[:, None] * rows_t + (1 - lam[:, None]) * rows_t[params.partner]
    torch.testing.assert_close(image_t, expected_image, rtol=0, atol=1e-6)
    assert patch_t.shape == (b, rows * cols, c)
    for i in range(b):
        for k in range(rows * cols):
            src = i if params.mask[i, k // cols, k % cols] else int(params.partner[i])
            assert torch.equal(patch_t[i, k], rows_t[src])

    # modes
    ar = torch.arange(b)
    if mode == 'pair':
        assert torch.equal(params.partner[params.partner], ar)
        assert torch.equal(params.mask[params.partner], params.mask)
    elif mode == 'batch' and prob == 1.0:
        assert (params.mask == params.mask[0]).all()
    if mode != 'pair' and b >= 2:
        assert not (params.partner == ar).any(), 'partners follow one cycle, no sample partners itself'
    assert params.mask[params.partner == ar].all(), 'a sample partnered with itself is unmixed'
    if prob == 0.0:
        assert torch.equal(out, x) and params.mask.all()
        torch.testing.assert_close(image_t, rows_t, rtol=0, atol=0)


def test_lambda_counts_pixels_for_uneven_cells():
    # 10x7 image, 4x3 grid: cells have unequal areas, so lam is not the fraction of cells kept
    mixer = PatchMix(grid=(4, 3), num_classes=3)
    mask = torch.zeros(1, 4, 3, dtype=torch.bool)
    mask[0, 1, 1] = True  # rows 2..5 (3 px), cols 2..4 (2 px) -> 6 of 70 pixels
    params = PatchMixParams(torch.tensor([0]), mask)
    x = torch.rand(1, 1, 10, 7)
    _, packed = mixer.apply(x, torch.tensor([2]), params)
    assert packed[0, 2].item() == pytest.approx(6 / 70, abs=1e-7)
    two = PatchMixParams(torch.tensor([1, 0]), mask.expand(2, 4, 3).clone())
    _, packed = mixer.apply(torch.rand(2, 1, 10, 7), torch.tensor([0, 2]), two)
    image_t, patch_t = split_target(packed)
    torch.testing.assert_close(image_t[0], torch.tensor([6 / 70, 0, 64 / 70]))
    assert torch.equal(patch_t[0, 4], torch.tensor([1.0, 0, 0])) and torch.equal(patch_t[0, 0], torch.tensor([0, 0, 1.0]))


def test_chain_partners_see_original_pixels():
    # 0 takes from 1, 1 takes from 2, 2 takes from 0: every cell must come from the original images
    x = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 4, 4).contiguous()
    params = PatchMixParams(torch.tensor([1, 2, 0]), torch.zeros(3, 2, 2, dtype=torch.bool))
    out, _ = PatchMix(grid=2, num_classes=3).apply(x, torch.tensor([0, 1, 2]), params)
    assert torch.equal(out[:, 0, 0, 0], torch.tensor([1.0, 2.0, 0.0]))


def test_mixes_in_place_and_keeps_nothing_between_calls():
    """timm's Mixup contract: the batch itself is mixed and returned; a later call never writes to an earlier
    output, so an output may be held (by a loader queue, a pinned copy, a worker's shared memory) for ever."""
    mixer = PatchMix(num_classes=3)
    params = mixer.sample(4, generator=torch.Generator().manual_seed(0))
    x1 = torch.rand(4, 3, 8, 8)
    ref1 = reference_mix(x1.clone(), params.partner, params.mask)[0]
    out1, _ = mixer.apply(x1, torch.tensor([0, 1, 2, 0]), params)
    assert out1 is x1 and torch.equal(out1, ref1)
    held = out1[1:]  # a view the caller keeps
    for _ in range(3):
        out2, _ = mixer(torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]))
        assert out2.data_ptr() != out1.data_ptr()
    assert torch.equal(held, ref1[1:]) and torch.equal(out1, ref1)


def test_source_images_supply_partners_outside_the_batch():
    mixer = PatchMix(grid=2, num_classes=4)
    x = torch.arange(2, dtype=torch.float32).view(2, 1, 1, 1).expand(2, 1, 4, 4).contiguous()
    extra = torch.full((1, 1, 4, 4), 7.0)
    source = (torch.cat([x, extra]), torch.tensor([0, 1, 3]))
    mask = torch.tensor([[[True, False], [True, True]], [[False, False], [False, False]]])
    out, packed = mixer.apply(x, torch.tensor([0, 1]), PatchMixParams(torch.tensor([2, 0]), mask), source=source)
    assert torch.equal(out[0, 0], torch.tensor([[0, 0, 7, 7], [0, 0, 7, 7], [0, 0, 0, 0], [0, 0, 0, 0.]]))
    assert torch.equal(out[1], torch.zeros(1, 4, 4)), 'partners are read from the source, not the mixed batch'
    image_t, patch_t = split_target(packed)
    assert torch.equal(image_t[0], torch.tensor([0.75, 0, 0, 0.25])) and torch.equal(image_t[1], torch.tensor([1.0, 0, 0, 0]))
    with pytest.raises(ValueError, match=r'outside \[0, 3\)'):
        mixer.apply(x, torch.tensor([0, 1]), PatchMixParams(torch.tensor([3, 0]), mask), source=source)
    with pytest.raises(ValueError, match='source images must have shape'):
        mixer.apply(x, torch.tensor([0, 1]), PatchMixParams(torch.tensor([1, 0]), mask), source=(extra[:, :, :2], source[1]))


def test_inference_mode_preview_leaves_later_training_intact():
    """A preview under inference_mode must not leave anything behind that makes later outputs inference
    tensors (backward through them would fail)."""
    from timm_patchmix.guided import GuidedPatchMix
    mixer = PatchMix(num_classes=3)
    table_mixer = GuidedPatchMix(_tiny_table(), guided_prob=0.5, random_prob=0.25)
    for m in (mixer, table_mixer):
        with torch.inference_mode():
            m(torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]))
        x, packed = m(torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 0]))
        assert not x.is_inference() and not packed.is_inference()
        w = torch.ones(1, requires_grad=True)
        ((x * w).sum() + (packed * w).sum()).backward()
        assert w.grad is not None


def _tiny_table():
    import numpy as np
    from timm_patchmix.guided import MaskTable
    return MaskTable((4, 4), 3, ['a', 'b', 'c'], 'fp', [(0, 1), (1, 2)],
                     [np.eye(4, dtype=bool), ~np.eye(4, dtype=bool)], [0.1, 0.2], 0.1)


def test_batch_size_one_and_odd_pair():
    mixer = PatchMix(num_classes=4, mode='pair')
    x = torch.rand(1, 3, 8, 8)
    out, packed = mixer(x.clone(), torch.tensor([3]))
    assert torch.equal(out, x)
    torch.testing.assert_close(split_target(packed)[0], torch.tensor([[0.0, 0, 0, 1]]))
    params = mixer.sample(5, generator=torch.Generator().manual_seed(0))
    lone = (params.partner == torch.arange(5)).nonzero().flatten()
    assert len(lone) == 1 and params.mask[lone].all()


def test_generator_determinism_and_prob_rate():
    mixer = PatchMix(num_classes=10, prob=0.3)
    p1 = mixer.sample(64, generator=torch.Generator().manual_seed(7))
    p2 = mixer.sample(64, generator=torch.Generator().manual_seed(7))
    p3 = mixer.sample(64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(p1.partner, p2.partner) and torch.equal(p1.mask, p2.mask)
    assert not (torch.equal(p1.partner, p3.partner) and torch.equal(p1.mask, p3.mask))
    g = torch.Generator().manual_seed(0)
    big = mixer.sample(20000, generator=g)
    unmixed = big.mask.flatten(1).all(1).float().mean().item()
    # unmixed = not chosen (0.7) + chosen with an all-keep mask (0.3 / 2**16)
    assert abs(unmixed - 0.7) < 0.02


@pytest.mark.parametrize('alpha', [0.2, 1.0, 5.0])
def test_mask_entries_are_fair_coins(alpha):
    params = PatchMix(num_classes=2, alpha=alpha).sample(4000, generator=torch.Generator().manual_seed(1))
    bits = params.mask.float()
    assert abs(bits.mean().item() - 0.5) < 0.01
    # independent entries: neighbouring cells agree half the time, and the number of kept cells per sample has the
    # Binomial(16, 1/2) variance of 4
    assert abs((bits[:, :, 1:] == bits[:, :, :-1]).float().mean().item() - 0.5) < 0.01
    assert abs(bits.flatten(1).sum(1).var().item() - 4.0) < 0.3


def test_disabled_mixer_is_identity():
    mixer = PatchMix(num_classes=3)
    mixer.mixup_enabled = False
    x = torch.rand(4, 3, 8, 8)
    out, packed = mixer(x.clone(), torch.tensor([0, 1, 2, 1]))
    assert torch.equal(out, x)
    assert torch.equal(split_target(packed)[0], one_hot(torch.tensor([0, 1, 2, 1]), 3))


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.uint8])
def test_low_precision_images_give_float32_targets(dtype):
    x = (torch.rand(6, 3, 16, 16) * 200).to(dtype)
    mixer = PatchMix(num_classes=5)
    params = mixer.sample(6, generator=torch.Generator().manual_seed(3))
    out, packed = mixer.apply(x.clone(), torch.tensor([0, 1, 2, 3, 4, 0]), params)
    assert out.dtype == dtype and packed.dtype == torch.float32
    assert torch.equal(out, reference_mix(x, params.partner, params.mask)[0])


def test_channels_last_stays_channels_last():
    x = torch.rand(4, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    ref_x = x.contiguous()
    mixer = PatchMix(num_classes=3)
    params = mixer.sample(4, generator=torch.Generator().manual_seed(0))
    out, _ = mixer.apply(x, torch.tensor([0, 1, 2, 0]), params)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out, reference_mix(ref_x, params.partner, params.mask)[0])


def test_packed_target_stays_on_device_of_x():
    x = torch.rand(2, 3, 8, 8)
    _, packed = PatchMix(num_classes=3)(x, torch.tensor([0, 1]))
    assert packed.device == x.device and packed.shape == (2, 3 + 2 * 3 + 16)


@pytest.mark.parametrize('call, message', [
    (lambda m: m(torch.rand(2, 3, 8, 8), torch.tensor([0, 5])), r'labels must lie in \[0, 5\)'),
    (lambda m: m(torch.rand(2, 3, 8, 8), torch.tensor([-1, 0])), 'labels must lie'),
    (lambda m: m(torch.rand(2, 3, 8, 8), torch.rand(2, 4)), 'target has 4 classes .* num_classes=5'),
    (lambda m: m(torch.rand(3, 8, 8), torch.tensor([0, 1, 2])), '4-D image batch'),
    (lambda m: m(torch.rand(3, 3, 8, 8), torch.tensor([0, 1])), 'target batch size 2 does not match .* 3'),
    (lambda m: m(torch.rand(2, 3, 3, 8), torch.tensor([0, 1])), 'grid 4x4 does not fit an image of 3x8'),
    (lambda m: m(torch.rand(2, 3, 8, 8), torch.tensor([0.0, 1.0])), 'integer class indices'),
    (lambda m: m.apply(torch.rand(2, 3, 8, 8), torch.tensor([0, 1]),
                       PatchMixParams(torch.tensor([0, 1]), torch.ones(2, 2, 2, dtype=torch.bool))), '2x2 grid'),
    (lambda m: m.apply(torch.rand(2, 3, 8, 8), torch.tensor([0, 1]),
                       PatchMixParams(torch.tensor([0, 2]), torch.ones(2, 4, 4, dtype=torch.bool))), 'outside'),
    (lambda m: m.apply(torch.rand(2, 3, 8, 8), torch.tensor([0, 1]),
                       PatchMixParams([1, 0], torch.ones(2, 4, 4, dtype=torch.bool))), 'params.partner must be a tensor'),
    # (a None target was torch's 'Could not infer dtype of NoneType'; an image batch in [B, H, W, C] got no hint)
    (lambda m: m(torch.rand(2, 3, 8, 8), None), 'target must be class indices .* got None'),
    (lambda m: m(torch.rand(2, 32, 32, 3), torch.tensor([0, 1])),
     r'grid 4x4 does not fit an image of 32x3.*\(x has shape \[2, 32, 32, 3\]: if that is \[B, H, W, C\], permute'),
])
def test_bad_inputs_raise_named_errors(call, message):
    x_seen = []
    with pytest.raises(ValueError, match=message):
        call(_Recording(PatchMix(num_classes=5), x_seen))
    if x_seen:  # nothing was mixed before the error
        assert torch.equal(x_seen[0][0], x_seen[0][1])


class _Recording:
    """A mixer whose call keeps the image batch and a copy of it, to check a refused call left it as it was."""

    def __init__(self, mixer, seen):
        self.mixer, self.seen = mixer, seen

    def __call__(self, x, y):
        self.seen.append((x, x.clone()))
        return self.mixer(x, y)

    def apply(self, x, y, params):
        self.seen.append((x, x.clone()))
        return self.mixer.apply(x, y, params)


@pytest.mark.parametrize('kwargs, message', [
    (dict(), 'num_classes'), (dict(num_classes=0), 'num_classes'), (dict(num_classes=3, alpha=0), 'alpha'),
    (dict(num_classes=3, prob=1.5), 'prob'), (dict(num_classes=3, mode='half'), 'mode'),
    (dict(num_classes=3, label_smoothing=1.0), 'label_smoothing'), (dict(num_classes=3, grid=(4, 0)), 'grid'),
    (dict(num_classes=3, cuda_graph=1), 'cuda_graph'),
    (dict(num_classes=3, prob='0.5'), r"prob must be a finite number in \[0, 1\], got '0.5'"),
    (dict(num_classes=3, prob=float('nan')), 'prob must be a finite number'),
    (dict(num_classes=3, label_smoothing='0.1'), r'label_smoothing must be a finite number in \[0, 1\)'),
    (dict(num_classes=3, alpha='1'), 'alpha must be a finite number > 0'),
    (dict(num_classes=2.5), 'num_classes must be a positive int'), (dict(num_classes=True), 'num_classes'),
])
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PatchMix(**kwargs)


def test_numpy_numbers_are_accepted_as_arguments():
    """numpy's scalars (an argparse value through numpy, a config loaded by numpy) work as Python's do, as they do
    for timm's Mixup."""
    m = PatchMix(grid=np.int64(4), num_classes=np.int64(5), prob=np.float32(0.5), alpha=np.float64(1.0),
                 label_smoothing=np.float32(0.25))
    assert m.grid == (4, 4) and m.num_classes == 5 and type(m.num_classes) is int
    assert m.prob == 0.5 and m.label_smoothing == 0.25
    assert PatchMix(grid=(np.int32(2), np.int64(3)), num_classes=3).grid == (2, 3)
    x = torch.rand(4, 3, 8, 12)
    _, packed = m(x, torch.tensor([0, 1, 2, 3]))
    assert packed.shape == (4, 3 + 2 * 5 + 16)


def _differentiable_reference(a, partner, mask):
    """The mix by autograd's own ops: each pixel the image's own or its partner's, per the pixel mask."""
    keep = reference_mix(a.detach(), partner, mask)[1]
    return torch.where(keep.unsqueeze(1), a, a.index_select(0, partner))


@pytest.mark.parametrize('accelerator_branch', [False, True])
@pytest.mark.parametrize('fresh', [False, True])
@pytest.mark.parametrize('dtype, hw', [
    (torch.float32, (32, 32)),   # cell rows of 32 bytes: the copy would move them as 16-byte words
    (torch.float32, (8, 16)),    # 16-byte rows
    (torch.float16, (16, 16)),   # 8-byte rows
    (torch.float64, (12, 20)),   # 40-byte rows
    (torch.float32, (18, 19)),   # unequal widths: element copies
])
def test_gradients_reach_the_pixels_each_cell_came_from(monkeypatch, accelerator_branch, fresh, dtype, hw):
    """A batch that autograd follows is mixed as torch's own in-place ops would mix it: the output's gradient goes
    to the pixel each cell was taken from (the image's own, or its partner's), whatever the image width, dtype or
    branch. Compared exactly with the gradient through a select, upstream gradients being small integers."""
    import timm_patchmix.mix as mix_mod
    if accelerator_branch:
        monkeypatch.setattr(mix_mod, '_per_cell', lambda device: False)
    g = torch.Generator().manual_seed(hw[0] * 100 + hw[1])
    b = 6
    a = torch.randn(b, 3, *hw, generator=g).to(dtype).requires_grad_()
    upstream = torch.randint(-4, 5, (b, 3, *hw), generator=g).to(dtype)
    mixer = PatchMix(grid=4, num_classes=4)
    params = mixer.sample(b, generator=g)
    assert not params.mask.all(1).all(1).any()  # every sample takes cells from its partner
    x = a * 1
    out, packed = mixer.apply(x, torch.arange(b) % 4, params, fresh=fresh)
    assert out is x and out.grad_fn is not None and not packed.requires_grad
    (out * upstream).sum().backward()
    a2 = a.detach().clone().requires_grad_()
    want = _differentiable_reference(a2, params.partner, params.mask)
    assert torch.equal(out.detach(), want.detach())
    (want * upstream).sum().backward()
    assert torch.equal(a.grad, a2.grad)
    assert not torch.equal(a.grad, upstream)  # the mix moved gradient: a copy that autograd missed would not


@pytest.mark.parametrize('accelerator_branch', [False, True])
@pytest.mark.parametrize('hw', [(32, 32), (18, 19)])
def test_leaf_and_inference_tensors_get_torchs_errors_at_every_width(monkeypatch, accelerator_branch, hw):
    """An in-place mix of a leaf that requires grad (torch's own error), or of an inference tensor outside
    inference mode (which torch would refuse only after writing it), raises at every image width and leaves the
    tensor as it was; inside inference mode the inference tensor is mixed."""
    import timm_patchmix.mix as mix_mod
    if accelerator_branch:
        monkeypatch.setattr(mix_mod, '_per_cell', lambda device: False)
    mixer = PatchMix(grid=4, num_classes=4)
    params = mixer.sample(4, generator=torch.Generator().manual_seed(0))
    y = torch.arange(4)
    for fresh in (False, True):
        leaf = torch.rand(4, 3, *hw, requires_grad=True)
        before = leaf.detach().clone()
        with pytest.raises(RuntimeError, match='leaf Variable that requires grad'):
            mixer.apply(leaf, y, params, fresh=fresh)
        assert torch.equal(leaf.detach(), before)
        with torch.inference_mode():
            inf = torch.rand(4, 3, *hw)
        before = inf.clone()
        with pytest.raises(RuntimeError, match='x is an inference tensor .* outside inference mode'):
            mixer.apply(inf, y, params, fresh=fresh)
        assert torch.equal(inf, before)
        with torch.inference_mode():
            out, _ = mixer.apply(inf, y, params, fresh=fresh)
        assert torch.equal(out, reference_mix(before, params.partner, params.mask)[0])


def test_mixer_pickles_without_its_process_state():
    """A mixer goes to DataLoader workers by pickle: its settings travel, its captured CUDA draws and their lock
    (this process's) do not, and the copy mixes as the original does."""
    import copy
    import pickle
    mixer = PatchMix(grid=(2, 3), mode='pair', prob=0.7, label_smoothing=0.1, num_classes=5, cuda_graph=False)
    mixer._graphs[('a shape',)] = None  # stands for a captured draw, which is no more picklable than the lock
    x, y = torch.rand(6, 3, 8, 9), torch.tensor([0, 1, 2, 3, 4, 0])
    for other in (pickle.loads(pickle.dumps(mixer)), copy.deepcopy(mixer)):
        assert repr(other) == repr(mixer) and other.cuda_graph is False and other._graphs == {}
        assert other._graph_lock is not mixer._graph_lock and mixer._graphs  # the original keeps its own
        a = mixer(x.clone(), y, generator=torch.Generator().manual_seed(2))
        b = other(x.clone(), y, generator=torch.Generator().manual_seed(2))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_split_target_checks_grid_and_shape():
    y = one_hot(torch.tensor([0, 1]), 3)
    packed = pack_target(y, y.flip(0), torch.tensor([0.5, 0.5]), torch.ones(2, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match='4x4 grid, not 2x2'):
        split_target(packed, 2)
    with pytest.raises(ValueError, match='packed PatchMix target'):
        split_target(torch.zeros(2, 3))
    with pytest.raises(ValueError, match='not a packed PatchMix target'):
        split_target(packed[:, :-1])


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.uint8, torch.int16])
def test_strided_and_word_aligned_inputs(dtype):
    # wide-word copies apply to aligned contiguous rows; offsets, odd strides and steps fall back to elements
    base = (torch.rand(5, 3, 20, 34) * 100).to(dtype)
    for x in (base[:, :, :, :32], base[:, :, :16, 1:33], base[:, :, ::2, ::2], base[1:].contiguous()):
        mixer = PatchMix(num_classes=3)
        params = mixer.sample(x.shape[0], generator=torch.Generator().manual_seed(1))
        ref = reference_mix(x.clone(), params.partner, params.mask)[0]
        out, _ = mixer.apply(x, torch.zeros(x.shape[0], dtype=torch.long), params)
        assert out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
        assert torch.equal(out, ref)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 6), h=st.integers(4, 23), w=st.integers(4, 23), rows=st.integers(1, 4),
       cols=st.integers(1, 4), seed=st.integers(0, 2 ** 16),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.uint8]),
       channels_last=st.booleans())
def test_select_path_equals_cell_path(b, h, w, rows, cols, seed, dtype, channels_last):
    """The GPU's whole-batch path (gather + per-pixel select) gives the CPU's per-cell result exactly, with
    partners from the batch itself or from a separate source."""
    from timm_patchmix.mix import mix_cells_, mix_select_
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 255, (b, 3, h, w), generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    partner = torch.randperm(b, generator=g)
    mask = torch.rand(b, rows, cols, generator=g) < 0.5
    ref = reference_mix(x, partner, mask)[0]
    a = mix_cells_(x.clone(), partner, mask)
    s = mix_select_(x.clone(), partner, mask)
    f = mix_cells_(x.clone(), partner, mask, fresh=True)  # numpy's segment views where they exist
    assert torch.equal(a, ref) and torch.equal(s, ref) and torch.equal(f, ref)
    src = torch.cat([x, x.flip(0)])
    far = partner + b  # every partner lies outside the batch
    a = mix_cells_(x.clone(), far, mask, src)
    s = mix_select_(x.clone(), far, mask, src)
    f = mix_cells_(x.clone(), far, mask, src, fresh=True)
    assert torch.equal(a, s) and torch.equal(a, f)
    assert torch.equal(a, reference_mix(src, torch.cat([far, far]), torch.cat([mask, mask]))[0][:b])


@pytest.mark.parametrize('dtype, bits', [(torch.float32, torch.int32), (torch.float64, torch.int64),
                                         (torch.float16, torch.int16), (torch.bfloat16, torch.int16)])
@pytest.mark.parametrize('offset', [0, 1, 2])
def test_mixing_is_bitwise_for_every_float_pattern(dtype, bits, offset):
    """Rows are moved as wide words (up to 16 bytes): NaN payloads (signalling too), -0.0, infinities and
    subnormals must come out bit for bit, aligned or not."""
    g = torch.Generator().manual_seed(offset)
    n = 6 * 3 * 16 * (32 + offset)
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(bits)
    x = raw.view(dtype).view(6, 3, 16, 32 + offset)[..., offset:]  # offset columns: unaligned starts
    assert torch.isnan(x).any(), 'the random bit patterns include NaNs'
    mixer = PatchMix(num_classes=2)
    params = mixer.sample(6, generator=g)
    expect = reference_mix(x.view(bits).clone(), params.partner, params.mask)[0]
    fresh = raw.clone().view(dtype).view(6, 3, 16, 32 + offset)[..., offset:]  # the same strided layout
    out, _ = mixer.apply(x, torch.zeros(6, dtype=torch.long), params)
    assert torch.equal(out.view(bits), expect)
    out, _ = mixer.apply(fresh, torch.zeros(6, dtype=torch.long), params, fresh=True)
    assert torch.equal(out.view(bits), expect)


@pytest.mark.parametrize('size', range(1, 70))
def test_cell_index_and_sizes_follow_cell_bounds(size):
    """The device-built pixel-to-cell map and cell lengths agree with ``cell_bounds`` for every split."""
    from timm_patchmix.grid import cell_index, cell_sizes
    for parts in range(1, min(size, 9) + 1):
        bounds = cell_bounds(size, parts)
        want = [max(k for k in range(parts) if bounds[k] <= p) for p in range(size)]
        assert cell_index(size, parts).tolist() == want
        assert cell_sizes(size, parts).tolist() == [bounds[k + 1] - bounds[k] for k in range(parts)]
    with pytest.raises(ValueError, match='cannot split'):
        cell_index(size, size + 1)


def test_random_cycle_is_one_cycle_without_fixed_points():
    from timm_patchmix.mix import _random_cycle
    for n in range(2, 40):
        partner = _random_cycle(n, torch.Generator().manual_seed(n), 'cpu')
        seen, i = [], 0
        for _ in range(n):
            seen.append(i)
            i = int(partner[i])
        assert i == 0 and sorted(seen) == list(range(n))  # back at the start after n steps, every index visited


@pytest.mark.parametrize('mode', ['elem', 'pair', 'batch'])
@pytest.mark.parametrize('prob', [1.0, 0.6])
@pytest.mark.parametrize('hw', [(32, 32), (37, 29)])
def test_accelerator_path_equals_cpu_path(monkeypatch, mode, prob, hw):
    """The branch accelerators take (pixel mask by indexing, one select, lam from the pixel count) gives the CPU
    branch's pixels and packed target bit for bit; forced here on the CPU, where both can run."""
    import timm_patchmix.mix as mix_mod
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 255, (11, 3, *hw), generator=g).to(torch.float32)
    y = torch.randint(0, 5, (11,), generator=g)
    mixer = PatchMix(grid=4, mode=mode, prob=prob, num_classes=5, label_smoothing=0.1)
    params = mixer.sample(11, generator=torch.Generator().manual_seed(1))
    xc, tc = mixer.apply(x.clone(), y, params)
    monkeypatch.setattr(mix_mod, '_per_cell', lambda device: False)
    xs, ts = mixer.apply(x.clone(), y, params)
    assert torch.equal(xs, xc) and torch.equal(ts, tc)
    assert not torch.equal(xc, x) or mode == 'batch'  # something was mixed (batch mode may draw one all-keep mask)


def test_sampling_happens_on_the_requested_device():
    """With no generator the params are drawn on ``device`` from its default generator; with one, on the
    generator's device. Both replay from the seed."""
    mixer = PatchMix(grid=4, num_classes=3)
    torch.manual_seed(5)
    a = mixer.sample(8, device='cpu')
    torch.manual_seed(5)
    b = mixer.sample(8, device=torch.device('cpu'))
    c = mixer.sample(8, generator=torch.Generator().manual_seed(5))
    assert a.partner.device.type == 'cpu' and a.mask.device.type == 'cpu'
    assert torch.equal(a.partner, b.partner) and torch.equal(a.mask, b.mask)
    assert torch.equal(a.partner, c.partner) and torch.equal(a.mask, c.mask)


@pytest.mark.parametrize('grid', [1, 2, 4, (3, 5), (7, 2)])
def test_cell_mask_to_pixels_paints_each_cell_of_cell_bounds(grid):
    """The one-gather pixel mask equals painting every cell's rectangle of ``grid_bounds``, for sizes the grid
    divides and sizes it does not; the cached pixel-to-cell map is reused across calls and batch sizes."""
    from timm_patchmix.grid import cell_mask_to_pixels, grid_bounds
    rows, cols = to_grid(grid)
    g = torch.Generator().manual_seed(rows * 10 + cols)
    for h, w in [(8, 8), (37, 29), (rows, cols), (224, 224), (33, 64)]:
        if h < rows or w < cols:
            continue
        rb, cb = grid_bounds(h, w, (rows, cols))
        for b in (1, 5):
            mask = torch.rand(b, rows, cols, generator=g) < 0.5
            want = torch.empty(b, h, w, dtype=torch.bool)
            for r in range(rows):
                for c in range(cols):
                    want[:, rb[r]:rb[r + 1], cb[c]:cb[c + 1]] = mask[:, r, c].view(b, 1, 1)
            got = cell_mask_to_pixels(mask, h, w)
            assert got.dtype == torch.bool and got.shape == (b, h, w) and torch.equal(got, want)


def test_cached_constants_survive_inference_mode_and_caller_edits():
    """The pixel-to-cell map and the packed header are built once per key and kept. Built first inside
    ``inference_mode`` they are still ordinary tensors, so training after an inference-mode preview can mix a
    batch that autograd follows; and a caller editing a packed target in place changes no later target."""
    from timm_patchmix.grid import _pixel_cells, cell_mask_to_pixels
    from timm_patchmix.mix import _header
    _pixel_cells.cache_clear()
    _header.cache_clear()
    mask = torch.rand(3, 4, 4) < 0.5
    with torch.inference_mode():
        pix_inf = cell_mask_to_pixels(mask, 12, 12)
        pack_target(torch.eye(3), torch.eye(3), torch.ones(3), mask)
    assert not _pixel_cells(12, 12, 4, 4, torch.device('cpu')).is_inference()
    assert not _header(4, 4, torch.device('cpu')).is_inference()
    pix = cell_mask_to_pixels(mask, 12, 12)
    assert torch.equal(pix, pix_inf)
    a = torch.rand(3, 1, 12, 12, requires_grad=True)
    torch.where(pix.unsqueeze(1), a, torch.zeros(())).sum().backward()
    assert torch.equal(a.grad, pix.unsqueeze(1).float())
    packed = pack_target(torch.eye(3), torch.eye(3), torch.ones(3), mask)
    packed[:, :2] = -1.0  # a caller's in-place edit of its own target
    again = pack_target(torch.eye(3), torch.eye(3), torch.ones(3), mask)
    assert again[:, 0].eq(4).all() and again[:, 1].eq(4).all()
    rect = pack_target(torch.eye(2), torch.eye(2), torch.ones(2), torch.ones(2, 3, 5, dtype=torch.bool))
    assert rect[:, 0].eq(3).all() and rect[:, 1].eq(5).all()


@pytest.mark.parametrize('mode', ['elem', 'batch'])
def test_cycle_modes_never_pair_a_sample_with_itself(mode):
    """elem and batch draw partners along one random cycle, which has no fixed point for two or more samples, so
    the sampler needs no self-partner fix-up; a batch of one is still unmixed with lam 1."""
    mixer = PatchMix(grid=4, mode=mode, num_classes=3)
    for n in range(2, 30):
        p = mixer.sample(n, generator=torch.Generator().manual_seed(n))
        assert not (p.partner == torch.arange(n)).any()
    one = mixer.sample(1, generator=torch.Generator().manual_seed(0))
    assert one.partner.tolist() == [0] and one.mask.all()


def test_fresh_tensors_take_the_numpy_segment_path_only_where_it_exists(monkeypatch):
    """``fresh=True`` writes through numpy's segment views exactly where they exist (a CPU tensor with
    contiguous rows, equal cell widths, no grad), in or out of inference mode, and gives the torch path's
    pixels; everywhere else the torch path runs whatever ``fresh`` says."""
    import timm_patchmix.mix as mix
    taken = []
    real = mix._mix_segments
    monkeypatch.setattr(mix, '_mix_segments', lambda *a: taken.append(1) or real(*a))
    g = torch.Generator().manual_seed(3)

    def check(x, fresh, expect_numpy, grid=4):
        taken.clear()
        mixer = PatchMix(grid=grid, num_classes=2)
        params = mixer.sample(x.shape[0], generator=g)
        ref = reference_mix(x.detach().clone(), params.partner, params.mask)[0]
        out, _ = mixer.apply(x, torch.zeros(x.shape[0], dtype=torch.long), params, fresh=fresh)
        assert torch.equal(out, ref)
        assert bool(taken) == expect_numpy

    img = torch.randint(0, 255, (5, 3, 18, 20), generator=g, dtype=torch.uint8)
    check(img.clone(), True, True)
    check(img.clone(), False, False)
    check(img.float(), True, True)
    check(img.to(torch.bfloat16), True, True)                  # no numpy dtype: moved as raw bytes
    check(img.clone(), True, True, grid=(4, 5))                # rows of unequal heights (18 / 4)
    check(img.clone(), True, False, grid=(3, 3))               # columns of unequal widths (20 / 3)
    check(img.float().contiguous(memory_format=torch.channels_last), True, False)
    check(img.clone()[:, :, :, 2:18], True, True)              # contiguous rows, not a contiguous tensor
    check(img.clone()[:, :, :, ::2], True, False)              # rows with a step
    with torch.inference_mode():
        check(img.clone(), True, True)
    with pytest.raises(RuntimeError, match='leaf Variable that requires grad'):
        check(img.float().requires_grad_(), True, False)       # the torch path's own refusal, not a silent write


@pytest.mark.parametrize('accelerator_branch', [False, True])
def test_compiled_mixer_keeps_the_semantics(monkeypatch, accelerator_branch):
    """``torch.compile`` (dynamo and AOT autograd) of whole mixer calls, sampling included, on the CPU's per-cell
    branch and on the accelerator's select branch: x is mixed in place, each cell is its own image's or the one
    partner's, the packed target says which (labels, keep mask, lam by area), and every call draws anew."""
    import timm_patchmix.mix as mix
    from timm_patchmix.mix import _unpack
    if accelerator_branch:
        monkeypatch.setattr(mix, '_per_cell', lambda dev: False)
    torch._dynamo.reset()
    b, h, w = 6, 18, 20  # rows of unequal heights (4, 5, 4, 5)
    labels = torch.tensor([3, 1, 4, 1, 5, 9])
    mixer = PatchMix(grid=4, num_classes=10, label_smoothing=0.1)
    compiled = torch.compile(mixer, backend='aot_eager')
    rb, cb = cell_bounds(h, 4), cell_bounds(w, 4)
    areas = cell_areas(h, w, 4)
    seen = []
    for _ in range(2):
        x = torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 3, h, w).clone()  # image i is all i
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            out, packed = compiled(x, labels)
        # the accelerator branch's constants (pixel-to-cell map, header, smoothed one-hot values) are not traced
        # through a cache, so dynamo has nothing to warn about; the CPU branch's cell bounds still are
        assert not (accelerator_branch and [str(m.message) for m in caught if 'lru_cache' in str(m.message)])
        assert torch.equal(out, x)  # in place
        _, lam, y_self, y_partner, keep = _unpack(packed, 4)
        for i in range(b):
            src = torch.tensor([[float(x[i, 0, rb[r], cb[c]]) for c in range(4)] for r in range(4)])
            for r in range(4):
                for c in range(4):
                    assert (x[i, :, rb[r]:rb[r + 1], cb[c]:cb[c + 1]] == src[r, c]).all()
            kept = src == i
            partners = set(src[~kept].long().tolist())
            assert len(partners) <= 1
            p = partners.pop() if partners else i
            assert torch.equal(keep[i], kept.flatten())
            assert torch.equal(y_self[i], one_hot(labels[i:i + 1], 10, 0.1)[0])
            if not kept.all():
                assert torch.equal(y_partner[i], one_hot(labels[p:p + 1], 10, 0.1)[0])
            assert float(lam[i]) == pytest.approx(float((areas * kept).sum() / (h * w)), abs=1e-7)
        seen.append(keep.clone())
    assert not torch.equal(seen[0], seen[1])  # the draws are not baked into the compiled graph


@pytest.mark.parametrize('smoothing', [0.0, 0.01, 0.1, 0.123456789, 1 / 3, 0.9])
@pytest.mark.parametrize('num_classes', [2, 3, 7, 10, 100, 1000, 21843])
def test_smoothed_labels_are_the_formula_of_their_one_hot_rows_bit_for_bit(smoothing, num_classes):
    """Class indices become smoothed rows by a fill and a scatter of two precomputed values, no arithmetic on the
    device; those rows equal ``one_hot * (1 - s) + s / C`` computed by torch in float32, the formula that soft
    rows get, bit for bit."""
    from timm_patchmix.mix import soft_target
    y = torch.arange(num_classes).roll(1)
    rows = soft_target(y, num_classes, smoothing)
    formula = one_hot(y, num_classes) * (1.0 - smoothing) + smoothing / num_classes
    assert rows.dtype == torch.float32 and torch.equal(rows, formula)
    assert torch.equal(soft_target(one_hot(y, num_classes), num_classes, smoothing), formula)
    assert torch.equal(soft_target(y[:0], num_classes, smoothing), formula[:0])


@pytest.mark.parametrize('mode', ['grad', 'no_grad', 'inference_mode'])
def test_the_mix_advances_the_batchs_version_counter_in_every_grad_mode(mode):
    """As for any in-place op: a tensor autograd saved and the mixer then overwrote makes backward() fail, rather
    than give a gradient of the mixed pixels."""
    ctx = {'grad': torch.enable_grad, 'no_grad': torch.no_grad, 'inference_mode': torch.inference_mode}[mode]
    mixer = PatchMix(grid=4, num_classes=10)
    w = torch.ones(8, 3, 32, 32, requires_grad=True)
    x = torch.rand(8, 3, 32, 32)
    out = (w * x).sum()  # saves x for dL/dw
    version = x._version
    with ctx():
        mixer(x, torch.arange(8), generator=torch.Generator().manual_seed(0))
    assert x._version > version
    with pytest.raises(RuntimeError, match='modified by an inplace operation'):
        out.backward()


@pytest.mark.parametrize('dtype', [torch.float64, torch.float16, torch.uint8])
def test_a_source_of_another_dtype_is_refused_not_reinterpreted(dtype):
    """Cells are copied as they are: a source of another dtype than the batch is an error naming both dtypes, on
    the per-cell (CPU) and the select (accelerator) way alike, and the batch is left as it was."""
    from timm_patchmix.mix import mix_cells_, mix_select_
    m = PatchMix(grid=4, num_classes=10)
    x = torch.rand(4, 3, 16, 16)
    before = x.clone()
    params = PatchMixParams(torch.tensor([4, 5, 6, 7]), torch.zeros(4, 4, 4, dtype=torch.bool))
    src = (torch.rand(8, 3, 16, 16) * 255).to(dtype)
    with pytest.raises(ValueError, match=rf'source images must have the dtype of the batch they are mixed into '
                                         rf'\(torch.float32\), got {dtype}'):
        m.apply(x, torch.arange(4), params, (src, torch.arange(8)))
    for mix_ in (mix_cells_, mix_select_):
        with pytest.raises(ValueError, match='source images must have the dtype'):
            mix_(x, params.partner, params.mask, src)
    assert torch.equal(x, before)
    out, _ = m.apply(x, torch.arange(4), params, (src.to(torch.float32), torch.arange(8)))
    assert torch.equal(out, src[4:].to(torch.float32))  # every cell from the source, converted by the caller


def test_apply_and_call_name_wrong_kinds_of_argument():
    m = PatchMix(grid=2, num_classes=4)
    x, y = torch.rand(2, 3, 8, 8), torch.arange(2)
    p = m.sample(2)
    with pytest.raises(ValueError, match=r'params must be PatchMixParams \(from PatchMix.sample\), got tuple'):
        m.apply(x, y, (p.partner, p.mask))
    with pytest.raises(ValueError, match=r'generator must be a torch.Generator or None, got int'):
        m(x, y, generator=0)
    with pytest.raises(ValueError, match=r'generator must be a torch.Generator or None, got int'):
        m.sample(2, generator=0)
    with pytest.raises(ValueError, match=r'source targets are missing'):
        m.apply(x, y, p, (x.clone(), None))
    with pytest.raises(ValueError, match=r'source must be a pair \(images \[N, C, H, W\], targets \[N\]\), got Tensor'):
        m.apply(x, y, p, x.clone())
    with pytest.raises(ValueError, match=r'source must be a pair .* got a sequence of 3'):
        m.apply(x, y, p, (x.clone(), y, y))
    a = m.sample(np.int64(3), generator=torch.Generator().manual_seed(0))  # a numpy integer, as num_classes takes
    b = m.sample(3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.partner, b.partner) and torch.equal(a.mask, b.mask)
    with pytest.raises(ValueError, match='batch_size must be a non-negative int'):
        m.sample(np.bool_(True))
