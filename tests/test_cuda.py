"""CUDA agrees with the CPU: the mixer bit for bit, the patch head and the search's gene scores to float tolerance.

Skipped where no GPU is present (CI); run on a GPU machine with ``python -m pytest tests/test_cuda.py``.
"""
import warnings

import numpy as np
import pytest
import torch

import timm
import timm_patchmix  # noqa: F401
from timm_patchmix import PatchMix, PatchMixParams
from timm_patchmix.search.fitness import GeneScorer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')


@pytest.mark.parametrize('mode', ['elem', 'pair', 'batch'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.uint8])
@pytest.mark.parametrize('channels_last', [False, True])
def test_mix_cuda_equals_cpu(mode, dtype, channels_last):
    x = torch.randint(0, 255, (9, 3, 37, 29)).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (9,))
    mixer = PatchMix(grid=4, mode=mode, num_classes=10)
    params = mixer.sample(9, generator=torch.Generator().manual_seed(3))
    xc, tc = mixer.apply(x.clone(), y, params)
    xg, tg = mixer.apply(x.cuda(), y.cuda(), params)
    assert xg.device.type == 'cuda' and tg.device.type == 'cuda'
    assert xg.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert torch.equal(xg.cpu(), xc)
    assert torch.equal(tg.cpu(), tc)


@pytest.mark.parametrize('mode', ['elem', 'pair', 'batch'])
@pytest.mark.parametrize('prob', [1.0, 0.7])
def test_mixer_never_waits_for_the_host(mode, prob):
    """Sampling, mixing and the packed target run on the device without one host synchronisation (the mode
    raises on any blocking copy, ``.item()`` or data-dependent shape), and give what the CPU gives for the
    same params."""
    x = torch.randint(0, 255, (16, 3, 40, 36), device='cuda').float().contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (16,), device='cuda')
    mixer = PatchMix(grid=4, mode=mode, prob=prob, num_classes=10, label_smoothing=0.1)
    mixer(x.clone(), y)  # first call: lazy CUDA initialisation outside the checked region
    gen = torch.Generator('cuda').manual_seed(4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        mixer(x.clone(), y)
        xg, tg = mixer(x.clone(), y, generator=gen)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    params = mixer.sample(16, generator=torch.Generator('cuda').manual_seed(4))
    xc, tc = mixer.apply(x.cpu(), y.cpu(), params.to('cpu'))
    assert torch.equal(xg.cpu(), xc) and torch.equal(tg.cpu(), tc)


def _draw_of(mixer, x):
    """The captured draw of ``x``'s batch shape, and a copy of the params its last replay drew."""
    b, _, h, w = x.shape
    draw = mixer._graphs[(b, h, w, x.device, mixer.mode, mixer.prob, mixer.grid)]
    assert draw is not None, 'the draw was not captured'
    return draw, PatchMixParams(draw.partner.clone(), draw.mask.clone())


@pytest.mark.parametrize('mode', ['elem', 'pair', 'batch'])
@pytest.mark.parametrize('prob', [1.0, 0.7])
@pytest.mark.parametrize('b', [16, 7, 1])
def test_graphed_draw_mixes_as_apply_does_with_its_params(mode, prob, b):
    """``mixer(x, y)`` on CUDA replays a captured draw: each call gives, bit for bit, what the CPU's ``apply``
    gives for the params that replay drew, and each replay draws anew (odd batches and a batch of one too)."""
    x = torch.randint(0, 255, (b, 3, 40, 36), device='cuda').float().contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (b,), device='cuda')
    mixer = PatchMix(grid=4, mode=mode, prob=prob, num_classes=10, label_smoothing=0.1)
    drawn = []
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for _ in range(3):
            xg, tg = mixer(x.clone(), y)
            _, params = _draw_of(mixer, x)
            xc, tc = mixer.apply(x.cpu(), y.cpu(), params.to('cpu'))
            assert torch.equal(xg.cpu(), xc) and torch.equal(tg.cpu(), tc)
            assert xg.is_contiguous(memory_format=torch.channels_last)
            drawn.append(params)
    assert len(mixer._graphs) == 1
    if b > 1:
        assert not all(torch.equal(drawn[0].partner, p.partner) and torch.equal(drawn[0].mask, p.mask)
                       for p in drawn[1:])
    else:
        assert drawn[0].mask.all() and drawn[0].partner.tolist() == [0]


@pytest.mark.parametrize('mode', ['elem', 'pair', 'batch'])
@pytest.mark.parametrize('prob', [1.0, 0.7])
def test_graphed_draw_is_the_eager_draw_for_the_same_generator_state(mode, prob):
    """From the same seed, the captured draw (its capturing call included) gives exactly the batches that
    ``apply(x, y, sample(...))`` gives, call after call, and leaves the generator where the eager calls do."""
    x = torch.randn(12, 3, 32, 32, device='cuda')
    y = torch.randint(0, 10, (12,), device='cuda')
    mixer = PatchMix(mode=mode, prob=prob, num_classes=10)
    torch.cuda.manual_seed(11)
    eager = [mixer.apply(x.clone(), y, mixer.sample(12, device='cuda')) for _ in range(3)]
    eager_state = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(11)
    graphed = [mixer(x.clone(), y) for _ in range(3)]
    assert len(mixer._graphs) == 1 and torch.equal(torch.cuda.get_rng_state(), eager_state)
    for (xe, te), (xg, tg) in zip(eager, graphed):
        assert torch.equal(xe, xg) and torch.equal(te, tg)
    assert not torch.equal(graphed[0][0], graphed[1][0])


def test_graphed_draw_replays_from_the_seed():
    """Seeding the device replays the captured draws, the first call's (which captures) included: capturing
    consumes no random numbers, and a replay advances the generator as far every time."""
    x = torch.randn(12, 3, 32, 32, device='cuda')
    y = torch.randint(0, 10, (12,), device='cuda')
    mixer = PatchMix(num_classes=10)
    runs, states = [], []
    for _ in range(2):
        torch.cuda.manual_seed(11)
        runs.append([mixer(x.clone(), y) for _ in range(2)])
        states.append(torch.cuda.get_rng_state())
    for (xa, ta), (xb, tb) in zip(*runs):
        assert torch.equal(xa, xb) and torch.equal(ta, tb)
    assert torch.equal(states[0], states[1])
    assert not torch.equal(runs[0][0][0], runs[0][1][0])


def test_graphed_draw_waits_for_the_readers_of_the_last_one(monkeypatch):
    """Two calls on two streams, issued back to back with nothing ordering the streams: the second call's replay
    rewrites the graph's outputs, so it must wait until the first call's kernels have read them. The first call's
    readers are held back on the device (a sleep kernel between copying its params and using them); each call's
    output must still be the CPU's ``apply`` of its own params."""
    import timm_patchmix.mix as mix
    finish = mix._finish
    seen = []

    def slow_finish(x, y, y_src, partner, pix, head, keep, source):
        seen.append(PatchMixParams(partner.clone(), (keep > 0.5).view(-1, 4, 4).clone()))
        torch.cuda._sleep(200_000_000)  # about 0.1 s of device time, enough for the other stream's replay
        return finish(x, y, y_src, partner, pix, head, keep, source)

    x = torch.randint(0, 255, (64, 3, 32, 32), device='cuda').float()
    y = torch.randint(0, 10, (64,), device='cuda')
    mixer = PatchMix(num_classes=10)
    mixer(x.clone(), y)  # capture outside the timed part
    inputs = [x.clone(), x.clone()]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    monkeypatch.setattr(mix, '_finish', slow_finish)
    outs = []
    for xi, s in zip(inputs, streams):
        with torch.cuda.stream(s):
            outs.append(mixer(xi, y))
    torch.cuda.synchronize()
    for (xg, tg), params in zip(outs, seen):
        xc, tc = mixer.apply(x.cpu(), y.cpu(), params.to('cpu'))
        assert torch.equal(xg.cpu(), xc) and torch.equal(tg.cpu(), tc)
    assert not torch.equal(seen[0].mask, seen[1].mask)


def test_graphed_draw_in_inference_mode_and_after_its_constants_leave_the_cache():
    """A capture inside ``inference_mode`` works, and a captured draw keeps the constants it reads: after the
    caches drop theirs and their memory is handed out again, replays still mix as ``apply`` does."""
    import gc
    from timm_patchmix.grid import _pixel_cells
    from timm_patchmix.mix import _areas, _header
    x = torch.randint(0, 255, (16, 3, 36, 36), device='cuda').float()
    y = torch.randint(0, 10, (16,), device='cuda')
    mixer = PatchMix(num_classes=10)
    with torch.inference_mode():
        xg, tg = mixer(x.clone(), y)
        _, params = _draw_of(mixer, x)
    xc, tc = mixer.apply(x.cpu(), y.cpu(), params.to('cpu'))
    assert torch.equal(xg.cpu(), xc) and torch.equal(tg.cpu(), tc)
    for cache in (_pixel_cells, _header, _areas):
        cache.cache_clear()
    gc.collect()
    junk = [torch.zeros(36 * 36, dtype=torch.long, device='cuda'), torch.zeros(1, 2, device='cuda'),
            torch.zeros(4, 4, dtype=torch.float64, device='cuda'), torch.zeros((), dtype=torch.float64, device='cuda')]
    for _ in range(2):
        xg, tg = mixer(x.clone(), y)
        _, params = _draw_of(mixer, x)
        xc, tc = mixer.apply(x.cpu(), y.cpu(), params.to('cpu'))
        assert torch.equal(xg.cpu(), xc) and torch.equal(tg.cpu(), tc)
    del junk


def test_graphed_draw_follows_the_mixers_settings():
    """Changing ``prob``, ``mode`` or the switch timm's loop uses (``mixup_enabled``) after a capture: a new
    setting gets a draw of its own, and a disabled mixer leaves the batch as it is (lam 1)."""
    from timm_patchmix.mix import _unpack
    x = torch.randint(0, 255, (10, 3, 32, 32), device='cuda').float()
    y = torch.randint(0, 10, (10,), device='cuda')
    mixer = PatchMix(num_classes=10)
    mixer(x.clone(), y)
    for attr, value in (('prob', 0.0), ('mode', 'pair')):
        setattr(mixer, attr, value)
        xg, tg = mixer(x.clone(), y)
        _, params = _draw_of(mixer, x)
        xc, tc = mixer.apply(x.cpu(), y.cpu(), params.to('cpu'))
        assert torch.equal(xg.cpu(), xc) and torch.equal(tg.cpu(), tc)
        if attr == 'prob':
            assert torch.equal(xg, x) and params.mask.all()  # prob 0 mixes nothing
    assert len(mixer._graphs) == 3
    mixer.mixup_enabled = False
    xg, tg = mixer(x.clone(), y)
    assert torch.equal(xg, x) and bool((_unpack(tg)[1] == 1).all()) and len(mixer._graphs) == 3


def test_eager_draw_where_no_graph_is_taken():
    """``cuda_graph=False``, an explicit generator and shapes beyond the captured ones draw eagerly: the call is
    ``apply(x, y, sample(...))`` from the same generator state."""
    y = torch.randint(0, 10, (64,), device='cuda')
    plain = PatchMix(num_classes=10, cuda_graph=False)
    graphed = PatchMix(num_classes=10)
    for b in range(2, 12):  # ten batch shapes: the first eight are captured, the last two draw eagerly
        x = torch.randn(b, 3, 16, 16, device='cuda')
        graphed(x.clone(), y[:b])
        for mixer in ([plain, graphed] if b >= 10 else [plain]):
            torch.cuda.manual_seed(b)
            out = mixer(x.clone(), y[:b])
            torch.cuda.manual_seed(b)
            ref = mixer.apply(x.clone(), y[:b], mixer.sample(b, device='cuda'))
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        gen_out = graphed(x.clone(), y[:b], generator=torch.Generator('cuda').manual_seed(1))
        ref = graphed.apply(x.clone(), y[:b], graphed.sample(b, generator=torch.Generator('cuda').manual_seed(1)))
        assert torch.equal(gen_out[0], ref[0]) and torch.equal(gen_out[1], ref[1])
    assert plain._graphs == {} and len(graphed._graphs) == 8 and all(graphed._graphs.values())


@pytest.mark.parametrize('size', [32, 56])  # 56: a 14x14 map, so the area-weighted (matmul) pooling runs
def test_patchhead_train_step_never_waits_for_the_host(size):
    """Mix, forward under bf16 autocast, PatchMixLoss and backward of a patchhead model: no host sync anywhere
    (region weights are made on the device; the loss reads the packed header on the first step only)."""
    from timm_patchmix import PatchMixLoss
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=10).cuda().train()
    m = m.to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, size, size, device='cuda').contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (8,), device='cuda')
    mixer, crit = PatchMix(num_classes=10), PatchMixLoss()

    def step():
        xm, t = mixer(x.clone(), y)
        with torch.autocast('cuda', dtype=torch.bfloat16):
            out = m(xm)
        crit(out, t).backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_patchhead_cuda_matches_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 convolutions are not float32-exact
    torch.manual_seed(0)
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=10).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        pc = m.forward_patches(x)
        pg = m.cuda().forward_patches(x.cuda()).cpu()
    torch.testing.assert_close(pg, pc, rtol=1e-3, atol=1e-3)


def test_gene_scores_cuda_match_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=4).eval()
    images = torch.randn(40, 3, 32, 32)
    labels = torch.arange(40) % 4
    from timm_patchmix.search.fitness import draw_image_pairs
    pairs = np.array([[0, 1], [2, 3], [1, 3]])
    a_idx, b_idx = draw_image_pairs(labels.numpy(), pairs, k=4, seed=0)
    pair = np.array([0, 1, 2, 0])
    mask = np.array([0x00FF, 0x0F0F, 0xFFFF, 0x1234])
    cpu = GeneScorer(m, images, pairs, a_idx, b_idx, (4, 4), score='loss').score_genes(pair, mask)
    gpu = GeneScorer(m.cuda(), images.cuda(), pairs, a_idx, b_idx, (4, 4), score='loss').score_genes(pair, mask)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-3, atol=1e-4)


def test_cuda_gradients_reach_the_pixels_each_cell_came_from():
    """A CUDA batch that autograd follows is mixed in place as on the CPU: by given params (the eager select) the
    gradient equals the CPU's exactly, and by the captured draw each output pixel's gradient reaches exactly one
    source pixel (integer upstream gradients, so sums are exact)."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(6, 3, 32, 32, generator=g)
    upstream = torch.randint(-4, 5, (6, 3, 32, 32), generator=g).float()
    y = torch.arange(6) % 4
    mixer = PatchMix(grid=4, num_classes=4)
    params = mixer.sample(6, generator=g)
    grads = []
    for dev in ('cpu', 'cuda'):
        leaf = a.to(dev).requires_grad_()
        out, _ = mixer.apply(leaf * 1, y.to(dev), params)
        assert out.grad_fn is not None
        (out * upstream.to(dev)).sum().backward()
        grads.append(leaf.grad.cpu())
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], upstream)
    leaf = a.cuda().requires_grad_()
    for _ in range(2):  # the first call captures the draw, the second replays it
        leaf.grad = None
        out, _ = mixer(leaf * 1, y.cuda())
        (out * upstream.cuda()).sum().backward()
        assert leaf.grad.sum().item() == upstream.sum().item() and not torch.equal(leaf.grad.cpu(), upstream)


def test_a_cuda_target_of_another_grid_is_refused_on_the_first_step():
    """On the device the loss reads the packed header on the first step of each target width: a target packed
    for a 2x3 grid of 7 classes, as wide as one of 4 cells and 8 classes, is refused there; the right layout then
    steps without reading it again."""
    from timm_patchmix import PatchMixLoss
    x, y = torch.rand(4, 3, 8, 9, device='cuda'), torch.randint(0, 7, (4,), device='cuda')
    _, wrong = PatchMix(grid=(2, 3), num_classes=7)(x, y)
    crit = PatchMixLoss()
    with pytest.raises(ValueError, match=r'packed target was built for a 2x3 grid \(6 cells\) and 7 classes'):
        crit((torch.randn(4, 8, device='cuda'), torch.randn(4, 4, 8, device='cuda')), wrong)
    x, y = torch.rand(4, 3, 8, 8, device='cuda'), torch.randint(0, 8, (4,), device='cuda')
    _, right = PatchMix(grid=2, num_classes=8)(x, y)
    out = (torch.randn(4, 8, device='cuda'), torch.randn(4, 4, 8, device='cuda'))
    crit(out, right)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        crit(out, right)
    finally:
        torch.cuda.set_sync_debug_mode(0)
