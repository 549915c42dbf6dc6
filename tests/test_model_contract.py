"""A ``patchhead_<arch>`` model is a drop-in timm model: each contract item is checked against the plain
``timm.create_model(arch)`` with the same weights, and skipped (saying why) only where the plain model itself
does not support it."""
import inspect
import re
import warnings

import pytest
import torch
import torch.nn as nn
import timm
from timm.data import resolve_model_data_config
from timm.layers import get_notrace_functions, get_notrace_modules
from timm.models import create_feature_extractor, get_graph_node_names, group_parameters
from timm.optim import param_groups_weight_decay
from torchvision.models.feature_extraction import create_feature_extractor as tv_create_feature_extractor

import timm_patchmix  # noqa: F401  registers patchhead_*
from timm_patchmix.models import PatchHeadModel
from timm_patchmix.models.patchhead import (PREFIX, PatchHead, _prefix_regex, patch_pool, pool_regions,
                                            region_weights)

pytestmark = pytest.mark.filterwarnings('ignore::FutureWarning', 'ignore::DeprecationWarning',
                                        'ignore::UserWarning')

SMALL_SWIN = dict(embed_dim=24, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4, img_size=128)
SMALL_VIT = dict(depth=1, embed_dim=64, num_heads=2)
# (arch, backbone kwargs, input size, patch grid, per_position); grids mix the block-mean and area-weighted paths
FAMILIES = [
    ('test_resnet', {}, 96, (2, 3), True),
    ('test_efficientnet', {}, 96, (3, 3), False),
    ('test_efficientnet_evos', {}, 96, (2, 3), False),
    ('test_efficientnet_gn', {}, 96, (3, 3), False),
    ('test_efficientnet_ln', {}, 96, (2, 3), False),
    ('test_convnext', {}, 96, (3, 3), False),
    ('test_convnext2', {}, 96, (2, 3), False),
    ('test_convnext3', {}, 96, (3, 3), True),
    ('test_byobnet', {}, 96, (2, 3), False),
    ('test_nfnet', {}, 96, (3, 3), False),
    ('test_mambaout', {}, 96, (2, 3), False),                  # NHWC
    ('test_coatnet', dict(img_size=96), 96, (3, 3), False),
    ('test_maxvit', dict(img_size=96), 96, (2, 3), False),
    ('test_vit', dict(img_size=96), 96, (2, 3), True),          # class token, dynamic image size
    ('test_vit2', dict(img_size=96), 96, (3, 3), False),
    ('test_vit3', dict(img_size=96), 96, (2, 3), False),        # attention pooling
    ('test_vit4', dict(img_size=96), 96, (3, 2), False),
    ('test_vit_relpos', dict(img_size=96), 96, (2, 3), False),  # no prefix token
    ('mobilenetv3_small_050', {}, 96, (3, 3), True),            # head_hidden_size != num_features
    ('deit_tiny_distilled_patch16_224', dict(depth=1, img_size=64), 64, (2, 2), False),  # 2 prefix tokens
    ('eva02_tiny_patch14_224', dict(depth=1, img_size=56), 56, (2, 2), False),          # rope
    ('vit_little_patch16_reg4_gap_256', dict(SMALL_VIT, img_size=64), 64, (2, 3), False),  # 4 reg tokens
    ('vit_small_patch14_reg4_dinov2', dict(SMALL_VIT, img_size=56, dynamic_img_size=True), 70, (2, 3),
     False),                                                    # class + 4 reg tokens, input off img_size
    ('swin_tiny_patch4_window7_224', SMALL_SWIN, 128, (2, 3), True),  # NHWC
    ('resnet32_cifar', {}, 32, (3, 3), False),                  # this package's CIFAR backbone
]
IDS = [f[0] for f in FAMILIES]
# tracing and scripting are the slow items: there, skip timm's test_* variants that differ from the one before them
# only in norm/act layers or block config, not in anything the wrapper touches (head, pooling, output layout)
VARIANTS = {'test_efficientnet_evos', 'test_efficientnet_gn', 'test_efficientnet_ln', 'test_convnext2',
            'test_convnext3', 'test_vit2', 'test_vit4'}
CORE = [f for f in FAMILIES if f[0] not in VARIANTS]
CORE_IDS = [f[0] for f in CORE]
NUM_CLASSES = 5


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    """Tiny tensors: one intra-op thread is as fast, and far faster on a busy machine (no spinning workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(arch, kwargs, grid, per_position, num_classes=NUM_CLASSES):
    """The plain timm model and its patchhead_ twin, same seed and the plain weights in the twin's backbone."""
    torch.manual_seed(0)
    plain = timm.create_model(arch, pretrained=False, num_classes=num_classes, **kwargs).eval()
    torch.manual_seed(0)
    model = timm.create_model(PREFIX + arch, pretrained=False, num_classes=num_classes, grid=grid,
                              per_position=per_position, **kwargs).eval()
    assert isinstance(model, PatchHeadModel)
    model.backbone.load_state_dict(plain.state_dict())
    return plain, model


def images(size, batch=2):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def run(fn, *args, seed=2):
    """``fn(*args)`` without grad from a fixed RNG state, so train-mode dropout/drop-path draw the same masks."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return fn(*args)


def wrapped_or_skip(what, fn, plain_fn):
    """``fn()`` on the wrapped model; where it fails, a skip if the plain model fails too (``plain_fn()``), else the
    failure. (The plain model is only tried on failure: scripting and tracing are the slow part of this file.)"""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        plain_or_skip(what, plain_fn)
        raise


def plain_or_skip(what, fn):
    """``fn()`` on the plain model; the contract item does not apply where it fails there."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  any failure of the plain model is a reason to skip
        pytest.skip(f'the plain model does not support {what}: {type(e).__name__}: {str(e)[:150]}')


def assert_same(a, b, exact=True):
    """Same nested structure of tensors, bit-identical (or allclose 1e-6)."""
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, exact)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], exact)
    else:
        assert a == b


def check_outputs(model, plain, x):
    """Eval: the plain logits. Train: the plain logits and ``[B, cells, C]`` patch logits (their values against a
    hand computation: tests/test_models.py)."""
    model.eval(), plain.eval()
    assert_same(run(model, x), run(plain, x))
    model.train(), plain.train()
    logits, patch = run(model, x)
    assert_same(logits, run(plain, x))
    cells = model.grid[0] * model.grid[1]
    assert patch.shape == (x.shape[0], cells, model.num_classes or model.num_features)
    model.eval(), plain.eval()
    return patch


# --- 1. forward, forward_intermediates, prune_intermediate_layers --------------------------------------------------
@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_forward_matches_plain(arch, kwargs, size, grid, per_position):
    plain, model = build(arch, kwargs, grid, per_position)
    x = images(size)
    assert_same(run(model.forward_features, x), run(plain.forward_features, x))
    check_outputs(model, plain, x)


@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_forward_intermediates(arch, kwargs, size, grid, per_position):
    plain, model = build(arch, kwargs, grid, per_position)
    x = images(size)
    plain_or_skip('forward_intermediates', lambda: run(plain.forward_intermediates, x))
    variants = [{}, dict(indices=2, intermediates_only=True), dict(indices=[0], norm=True, stop_early=True),
                dict(output_fmt='NHWC', intermediates_only=True)]
    checked = 0
    for kw in variants:
        try:
            want = run(lambda t: plain.forward_intermediates(t, **kw), x)
        except Exception:  # noqa: BLE001  this family's signature lacks the option: nothing to compare
            continue
        assert_same(run(lambda t: model.forward_intermediates(t, **kw), x), want)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize('prune_head', [True, False])
@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_prune_intermediate_layers(arch, kwargs, size, grid, per_position, prune_head):
    plain, model = build(arch, kwargs, grid, per_position)
    x = images(size)
    want = plain_or_skip('prune_intermediate_layers',
                         lambda: plain.prune_intermediate_layers(indices=1, prune_head=prune_head))
    assert model.prune_intermediate_layers(indices=1, prune_head=prune_head) == want
    assert model.backbone.state_dict().keys() == plain.state_dict().keys()
    assert_same(run(lambda t: model.forward_intermediates(t, intermediates_only=True), x),
                run(lambda t: plain.forward_intermediates(t, intermediates_only=True), x))
    assert model.num_classes == plain.num_classes == model.patch_head.num_classes
    if prune_head:
        assert model.num_classes == 0 and isinstance(model.patch_head.fc, nn.Identity)
        assert 'patch_head.fc.weight' not in model.state_dict()
    else:
        assert model.num_classes == NUM_CLASSES and not isinstance(model.patch_head.fc, nn.Identity)
    assert_same(run(model, x), run(plain, x))


# --- 2. timm attributes and methods ---------------------------------------------------------------------------------
@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_attributes_and_pretrained_cfg(arch, kwargs, size, grid, per_position):
    plain, model = build(arch, kwargs, grid, per_position)
    assert model.num_features == plain.num_features and model.num_classes == plain.num_classes == NUM_CLASSES
    assert model.head_hidden_size == getattr(plain, 'head_hidden_size', plain.num_features)
    cfg, ref = model.pretrained_cfg, plain.pretrained_cfg
    assert model.default_cfg is cfg and set(cfg) >= set(ref)
    prefixed = {'classifier', 'first_conv', 'architecture'}
    assert {k: v for k, v in cfg.items() if k in ref and k not in prefixed} == \
        {k: v for k, v in ref.items() if k not in prefixed}
    heads = ref['classifier'] if isinstance(ref['classifier'], (tuple, list)) else (ref['classifier'],)
    assert tuple(cfg['classifier']) == tuple(f'backbone.{h}' for h in heads) + ('patch_head.fc',)
    for name in cfg['classifier']:
        model.get_submodule(name)  # every classifier name is a real module
    if ref.get('first_conv'):
        stems = (ref['first_conv'],) if isinstance(ref['first_conv'], str) else tuple(ref['first_conv'])
        got = (cfg['first_conv'],) if isinstance(cfg['first_conv'], str) else tuple(cfg['first_conv'])
        assert got == tuple(f'backbone.{s}' for s in stems)
        for name in got:
            assert isinstance(model.get_submodule(name), nn.Conv2d)
    assert cfg['architecture'] == PREFIX + ref['architecture']
    assert resolve_model_data_config(model) == resolve_model_data_config(plain)
    # get_classifier: the wrapped backbone's own classifier module(s), the ones the plain model returns
    got, want = model.get_classifier(), plain.get_classifier()
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    names = {id(m): n for n, m in plain.named_modules()}
    assert len(got) == len(want)
    assert all(g is model.get_submodule(f'backbone.{names[id(w)]}') for g, w in zip(got, want))
    assert model.get_patch_classifier() is model.patch_head.fc
    if getattr(plain, 'feature_info', None):
        assert [d['module'] for d in model.feature_info] == [f'backbone.{d["module"]}' for d in plain.feature_info]
        assert [d['num_chs'] for d in model.feature_info] == [d['num_chs'] for d in plain.feature_info]
        for d in model.feature_info:
            model.get_submodule(d['module'])


@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_reset_classifier_keeps_pooling(arch, kwargs, size, grid, per_position):
    plain, model = build(arch, kwargs, grid, per_position)
    x = images(size)
    # a non-default pooling first, where the plain model takes one; passed through when given
    pool = 'max'
    try:
        plain.reset_classifier(4, global_pool=pool)
    except Exception:  # noqa: BLE001  e.g. a ViT with attention pooling: keep the pooling it has
        pool = None
        plain.reset_classifier(4)
    model.reset_classifier(4, global_pool=pool) if pool else model.reset_classifier(4)
    old_patch_fc = model.patch_head.fc
    model.reset_classifier(3)  # no global_pool: the pooling stays as it is
    plain.reset_classifier(3, global_pool=pool) if pool else plain.reset_classifier(3)
    assert model.num_classes == plain.num_classes == model.patch_head.num_classes == 3
    assert model.patch_head.fc is not old_patch_fc
    fc = model.patch_head.fc
    assert fc.weight.shape == ((grid[0] * grid[1], 3, model.num_features) if per_position else (3, model.num_features))
    plain.load_state_dict(model.backbone.state_dict())  # the new random heads, to compare the pooling
    check_outputs(model, plain, x)
    model.reset_classifier(0)
    plain.reset_classifier(0, global_pool=pool) if pool else plain.reset_classifier(0)
    assert isinstance(model.patch_head.fc, nn.Identity) and model.num_classes == 0
    check_outputs(model, plain, x)


def test_reset_classifier_passes_current_pool_where_backbone_default_resets_it():
    class Net(nn.Module):  # an older timm signature: reset_classifier(..., global_pool='avg') resets pooling
        def __init__(self):
            super().__init__()
            self.num_features, self.num_classes = 8, 4
            self.conv = nn.Conv2d(3, 8, 3, stride=4)
            self.global_pool = timm.layers.SelectAdaptivePool2d(pool_type='max', flatten=True)
            self.fc = nn.Linear(8, 4)

        def reset_classifier(self, num_classes, global_pool='avg'):
            self.num_classes = num_classes
            self.global_pool = timm.layers.SelectAdaptivePool2d(pool_type=global_pool, flatten=True)
            self.fc = nn.Linear(8, num_classes)

        def forward_features(self, x):
            return self.conv(x)

        def forward_head(self, x, pre_logits: bool = False):
            x = self.global_pool(x)
            return x if pre_logits else self.fc(x)

    model = PatchHeadModel(Net(), grid=2)
    model.reset_classifier(3)
    assert model.backbone.global_pool.pool_type == 'max' and model.patch_head.num_classes == 3
    model.reset_classifier(3, 'avgmax')
    assert model.backbone.global_pool.pool_type == 'avgmax'


@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_grad_checkpointing(arch, kwargs, size, grid, per_position):
    plain, model = build(arch, kwargs, grid, per_position)
    x = images(size)
    model.train()
    want = run(model, x)
    plain_or_skip('set_grad_checkpointing', lambda: plain.set_grad_checkpointing(True))
    model.set_grad_checkpointing(True)
    flags = {n: m.grad_checkpointing for n, m in plain.named_modules() if hasattr(m, 'grad_checkpointing')}
    assert flags and any(flags.values())
    assert flags == {n: m.grad_checkpointing for n, m in model.backbone.named_modules()
                     if hasattr(m, 'grad_checkpointing')}
    assert_same(run(model, x), want, exact=False)
    torch.manual_seed(2)
    logits, patch = model(x)
    (logits.sum() + patch.sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.patch_head.parameters())


@pytest.mark.parametrize('coarse', [False, True])
@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_group_matcher_and_no_weight_decay(arch, kwargs, size, grid, per_position, coarse):
    plain, model = build(arch, kwargs, grid, per_position)
    want = group_parameters(plain, plain_or_skip('group_matcher', lambda: plain.group_matcher(coarse)), reverse=True)
    got = group_parameters(model, model.group_matcher(coarse), reverse=True)
    # timm's grouping of the wrapped names is the plain grouping; the patch head joins the last (head) group
    assert {n: got[f'backbone.{n}'] for n in want} == want
    assert set(got) == {n for n, _ in model.named_parameters()}
    assert all(got[n] >= max(want.values()) for n in got if n.startswith('patch_head.'))
    # in the classifier's own group, not one of its own after it (which would shift every layer-decay scale)
    heads = plain.get_classifier()
    head = {id(p) for h in (heads if isinstance(heads, tuple) else (heads,)) for p in h.parameters()}
    head_groups = {want[n] for n, p in plain.named_parameters() if id(p) in head}
    if head_groups:
        assert {got[n] for n in got if n.startswith('patch_head.')} == head_groups
        assert max(got.values()) == max(want.values())
    # no weight decay: the same parameters as in the plain model, plus the patch head's 1-d ones and biases
    nwd_plain = plain.no_weight_decay() if hasattr(plain, 'no_weight_decay') else set()
    assert no_decay_names(model, model.no_weight_decay()) == \
        {f'backbone.{n}' for n in no_decay_names(plain, nwd_plain)} | \
        {n for n, p in model.patch_head.named_parameters(prefix='patch_head') if p.ndim <= 1 or n.endswith('.bias')}


def no_decay_names(model, no_weight_decay):
    """Parameter names in the no-weight-decay group of timm's ``param_groups_weight_decay``."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups_weight_decay(model, 1e-4, no_weight_decay_list=no_weight_decay)
    return {names[id(p)] for g in groups if g['weight_decay'] == 0.0 for p in g['params']}


@pytest.mark.parametrize('pattern', [r'^cls_token|pos_embed|patch_embed', r'^norm|^aligner', r'^layer(\d+)\.(\d+)',
                                     r'stem', r'^stages\.(\d+)\.[^.]+\.(\d+)', r'^[\^a]b|c\^', r'^(a|^b)x$'])
def test_prefixed_regex_keeps_meaning(pattern):
    names = ['cls_token', 'pos_embed', 'patch_embed.proj.weight', 'norm.weight', 'aligner.bias', 'layer2.1.conv',
             'stem.conv', 'stages.3.blocks.2.w', 'ab', '^b', 'c^', 'xc^', 'ax', 'bx', 'bxx', 'head.fc.weight', 'xnorm']
    prefixed = _prefix_regex(pattern)
    for n in names:
        a, b = re.match(pattern, n), re.match(prefixed, f'backbone.{n}')
        assert (a is None) == (b is None), (pattern, n)
        if a:
            assert a.groups() == b.groups()
    assert all(re.match(prefixed, n) is None for n in names)  # never the unprefixed names


@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_optional_methods_exist_exactly_where_the_backbone_has_them(arch, kwargs, size, grid, per_position):
    """``hasattr(model, name)`` answers as for the plain model, so code that asks before it calls works alike."""
    plain, model = build(arch, kwargs, grid, per_position)
    for name in ('set_input_size', 'forward_intermediates', 'prune_intermediate_layers', 'group_matcher'):
        assert hasattr(model, name) == hasattr(plain, name), name


def test_layer_decay_of_a_backbone_without_a_group_matcher_groups_as_timm_does():
    """The wrapper always had group_matcher, so timm's layer decay called it on MetaFormer (and CSATv2, PiT) where
    the plain model has none and timm groups by its own rule: AttributeError. Now present where the backbone has it."""
    from timm.optim import create_optimizer_v2
    torch.manual_seed(0)
    plain = timm.create_model('poolformer_s12', num_classes=3)
    model = timm.create_model('patchhead_poolformer_s12', num_classes=3)
    assert not hasattr(model, 'group_matcher')

    def scales(m, prefix=''):
        names = {id(p): n for n, p in m.named_parameters()}
        opt = create_optimizer_v2(m, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
        return {names[id(p)][len(prefix):]: g['lr_scale'] for g in opt.param_groups for p in g['params']}
    want, got = scales(plain), scales(model)
    assert {n: got['backbone.' + n] for n in want} == want
    assert {n for n in got if not n.startswith('backbone.')} == {'patch_head.fc.weight', 'patch_head.fc.bias'}
    assert got['patch_head.fc.weight'] == want['head.fc.weight'] == 1.0  # the classifier's group


def test_layer_decay_of_a_backbone_whose_matcher_groups_the_classifier():
    """iFormer's fine matcher puts its classifier in the last block's group (``(r'^head', (99999,))``); the patch
    head left unmatched formed a group of its own after it, so timm's layer decay scaled every parameter one step
    lower than on the plain model (the classifier 0.75 instead of 1.0)."""
    from timm.optim import create_optimizer_v2
    torch.manual_seed(0)
    plain = timm.create_model('iformer_t', num_classes=3)
    model = timm.create_model('patchhead_iformer_t', num_classes=3)

    def scales(m, prefix=''):  # (timm's layer decay groups by the fine matcher)
        names = {id(p): n for n, p in m.named_parameters()}
        opt = create_optimizer_v2(m, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.75)
        return {names[id(p)][len(prefix):]: g['lr_scale'] for g in opt.param_groups for p in g['params']}
    want, got = scales(plain), scales(model)
    assert {n: got['backbone.' + n] for n in want} == want
    assert got['patch_head.fc.weight'] == got['patch_head.fc.bias'] == want['head.head.l.weight'] == 1.0
    assert isinstance(model.group_matcher(False), dict) and isinstance(model.group_matcher(True), dict)


def test_patch_head_group_left_alone_where_the_classifier_ordinal_comes_from_its_name():
    """A matcher entry with capture groups gives the classifier an ordinal read from its name; the patch head's
    names cannot repeat it, so the matcher is returned unchanged and the patch head stays unmatched."""
    from timm_patchmix.models.patchhead import _join_classifier_group
    matcher = {'blocks': [(r'^backbone\.(?:blocks\.(\d+))', None), (r'^backbone\.(?:head)\.(\d+)', (99999,))]}
    assert _join_classifier_group(matcher, ['backbone.head.0.weight']) is matcher
    plain = {'stem': r'^backbone\.(?:stem)', 'head': r'^backbone\.(?:head)'}
    joined = _join_classifier_group(plain, ['backbone.head.weight'])
    assert joined['head'] == [(r'^backbone\.(?:head)', None), (r'^patch_head\.', None)]
    assert joined['stem'] == plain['stem'] and plain['head'] == r'^backbone\.(?:head)'  # the input is not changed
    assert _join_classifier_group(plain, []) is plain  # num_classes=0: no classifier, no patch-head parameters


def test_default_cfg_is_assignable_as_on_timm_models():
    model = timm.create_model('patchhead_resnet8_cifar', num_classes=3)
    model.default_cfg = dict(model.default_cfg, crop_pct=0.5)  # timm's builders assign it so
    assert model.pretrained_cfg['crop_pct'] == 0.5 and model.default_cfg is model.pretrained_cfg


@pytest.mark.parametrize('arch, kwargs, message', [
    ('vit_tiny_patch16_224', dict(patch_drop_rate=0.5), 'VisionTransformer with patch_drop_rate=0.5 drops its tokens'),
    ('hiera_tiny_224', dict(patch_drop_rate=0.48), 'Hiera with patch_drop_rate=0.48 drops its tokens'),
    ('hiera_tiny_224', dict(q_pool=2), 'Hiera with q_pool=2 leaves 1 of its unroll steps unconsumed'),
    ('eva02_tiny_patch14_224', dict(patch_drop_rate=0.5, depth=1, img_size=56),  # timm's PatchDropoutWithIndices
     'Eva with patch_drop_rate=0.5 drops its tokens'),
])
def test_backbones_whose_tokens_are_not_the_image_grid_are_refused(arch, kwargs, message):
    """Tokens dropped at random, or left in Hiera's unrolled order, were laid out and pooled as the image grid
    (scrambled regions, no error) or failed naming the input's shape."""
    with pytest.raises(ValueError, match=message):
        timm.create_model(f'patchhead_{arch}', num_classes=5, grid=2, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in ('patch_drop_rate', 'q_pool')}
    timm.create_model(f'patchhead_{arch}', num_classes=5, grid=2, **rest)  # their defaults keep the grid


@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', FAMILIES, ids=IDS)
def test_set_input_size(arch, kwargs, size, grid, per_position):
    plain, model = build(arch, kwargs, grid, per_position)
    new = 2 * size
    plain_or_skip('set_input_size', lambda: plain.set_input_size(img_size=(new, new)))
    model.set_input_size(img_size=(new, new))
    assert_same(model.backbone.state_dict(), plain.state_dict())
    assert resolve_model_data_config(model) == resolve_model_data_config(plain)
    pe = getattr(model.backbone, 'patch_embed', None)
    if getattr(pe, 'grid_size', None) is not None:
        assert model.patch_head.token_grid == tuple(pe.grid_size)
    x = images(new)
    patch = check_outputs(model, plain, x)
    # the patch head follows the new size: region means of the new token grid / map
    model.train()
    feat = run(model.forward_features, x)
    fmap = model.feature_map_nhwc(feat, [new, new])
    if feat.ndim == 3:
        assert fmap.shape[1:3] == tuple(pe.grid_size)
    pooled = pool_regions(fmap, [new, new], model.grid)
    torch.testing.assert_close(patch, model.patch_head.fc(pooled))


# --- 3. FX ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('mode', ['eval', 'train'])
@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', CORE, ids=CORE_IDS)
def test_fx_symbolic_trace(arch, kwargs, size, grid, per_position, mode):
    plain, model = build(arch, kwargs, grid, per_position)
    x = images(size)
    getattr(plain, mode)(), getattr(model, mode)()
    gm = wrapped_or_skip(f'torch.fx.symbolic_trace in {mode} mode', lambda: torch.fx.symbolic_trace(model),
                         lambda: torch.fx.symbolic_trace(plain))
    leaves = [n for n in gm.graph.nodes if n.op == 'call_function' and n.target is patch_pool]
    assert len(leaves) == (1 if mode == 'train' else 0)
    assert_same(run(gm, x), run(model, x), exact=False)


@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', CORE, ids=CORE_IDS)
def test_fx_feature_extraction(arch, kwargs, size, grid, per_position):
    # no drop-path: graphs traced with timm's leaf modules draw train-mode randomness unlike eager, plain or not
    plain, model = build(arch, dict(kwargs, drop_path_rate=0.0), grid, per_position)
    x = images(size)
    # the second-to-last feature_info module and the classifier: module names, each giving its last node; the
    # same set everywhere, so in-place ops after a node act alike
    if getattr(plain, 'feature_info', None):
        i = max(0, len(plain.feature_info) - 2)
        mid, wrapped_mid = plain.feature_info[i]['module'], model.feature_info[i]['module']
    else:
        _, plain_eval = plain_or_skip('FX feature extraction', lambda: get_graph_node_names(plain))
        mid = [n for n in plain_eval if n in dict(plain.named_modules())][len(plain_eval) // 2]
        wrapped_mid = f'backbone.{mid}'
    head = plain.pretrained_cfg['classifier']
    picked = [mid, head if isinstance(head, str) else head[0]]
    nodes = {wrapped_mid: mid, f'backbone.{picked[1]}': picked[1]}
    plain_fe = plain_or_skip('FX feature extraction', lambda: create_feature_extractor(plain, picked))
    # timm's extractor: the backbone's nodes keep their names under backbone. (feature_info says so too)
    fe = create_feature_extractor(model, nodes)
    assert_same(run(fe.eval(), x), run(plain_fe.eval(), x), exact=False)
    # train mode last (batch-norm statistics move; train-mode outputs use the batch's own)
    assert_same(run(fe.train(), x), run(plain_fe.train(), x), exact=False)


REGION_LAYOUTS = ('test_resnet', 'test_mambaout', 'test_vit', 'deit_tiny_distilled_patch16_224',
                  'swin_tiny_patch4_window7_224')  # NCHW, NHWC, tokens, 2 prefix tokens, NHWC


@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', [f for f in FAMILIES if f[0] in REGION_LAYOUTS],
                         ids=[f[0] for f in FAMILIES if f[0] in REGION_LAYOUTS])
def test_fx_extraction_of_patch_regions(arch, kwargs, size, grid, per_position):
    _, model = build(arch, dict(kwargs, drop_path_rate=0.0), grid, per_position)
    x = images(size)
    # torchvision's extractor with timm's leaf modules and no-trace functions: the pooled regions are one leaf call
    # (patch_pool) in the train graph; the eval graph has no patch head, its backbone's last node is the logits
    tv = tv_create_feature_extractor(
        model, train_return_nodes={'patch_head.patch_pool': 'regions'}, eval_return_nodes={'backbone': 'logits'},
        tracer_kwargs=dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions()))
    assert_same(run(tv.eval(), x)['logits'], run(model.eval(), x), exact=False)
    regions = run(tv.train(), x)['regions']
    model.train()
    assert regions.shape == (x.shape[0], grid[0] * grid[1], model.num_features)
    assert_same(run(model.patch_head.fc, regions), run(model, x)[1], exact=False)


def test_pool_functions_are_fx_leaves_and_registered_with_timm():
    assert {patch_pool, pool_regions} <= set(get_notrace_functions())
    head = PatchHead(8, 3, grid=(2, 3))
    gm = torch.fx.symbolic_trace(head, concrete_args=None)
    assert [n.target for n in gm.graph.nodes if n.op == 'call_function'] == [patch_pool]
    feat = torch.randn(2, 4, 6, 8)
    torch.testing.assert_close(gm(feat, [32, 48]), head(feat, [32, 48]), rtol=0, atol=0)


# --- 4. TorchScript -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('arch, kwargs, size, grid, per_position', CORE, ids=CORE_IDS)
def test_torchscript(arch, kwargs, size, grid, per_position):
    plain, model = build(arch, kwargs, grid, per_position)
    x = images(size)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        scripted = wrapped_or_skip('torch.jit.script', lambda: torch.jit.script(model), lambda: torch.jit.script(plain))
    assert_same(run(scripted.eval(), x), run(model.eval(), x), exact=False)
    # the Union return: a (logits, patch_logits) tuple in train mode, the pooling scripted too
    got, want = run(scripted.train(), x), run(model.train(), x)
    assert isinstance(got, tuple) and len(got) == 2
    assert_same(got, want, exact=False)
    # forward_patches is a method of the scripted model too (a patch-loss-only model predicts with it)
    with torch.no_grad():
        assert_same(scripted.eval().forward_patches(x), model.eval().forward_patches(x), exact=False)


def test_scripted_region_weights_equal_eager():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        scripted = torch.jit.script(region_weights)
    for img, fmap, parts in [(32, 8, 4), (36, 9, 4), (36, 9, 3), (70, 5, 3), (97, 7, 4), (224, 7, 7), (13, 3, 2)]:
        assert torch.equal(scripted(img, fmap, parts), region_weights(img, fmap, parts))
    for img, fmap, parts, stride in [(72, 5, 2, 16), (72, 4, 2, 16), (79, 4, 8, 16), (224, 14, 3, 16)]:
        assert torch.equal(scripted(img, fmap, parts, None, stride), region_weights(img, fmap, parts, None, stride))


def test_region_weights_of_a_patch_embedding_follow_its_patches():
    """A ViT's tokens cover whole patches: padded past the image (dynamic_img_pad) or stopping short of it (an input
    no multiple of the patch). The weights spread the map over the image evenly, so a cell's weights were off by
    up to a token (72 px, 5 padded tokens of 16 px: cell 0 took [0.4, 0.4, 0.2] for [16, 16, 4] pixels)."""
    def exact(img, n, parts, stride):  # pixel overlaps, in Python integers
        bounds = [k * img // parts for k in range(parts + 1)]
        rows = []
        for lo, hi in zip(bounds, bounds[1:]):
            w = [max(0, min(hi, (i + 1) * stride, img) - max(lo, i * stride)) for i in range(n)]
            w = w if sum(w) else [0] * (n - 1) + [1]  # only pixels past the last token: that token
            rows.append([v / sum(w) for v in w])
        return torch.tensor(rows)
    for img, n, parts, stride in [(72, 5, 2, 16), (72, 4, 2, 16), (79, 4, 8, 16), (56, 4, 2, 16), (30, 3, 3, 14)]:
        torch.testing.assert_close(region_weights(img, n, parts, stride=stride), exact(img, n, parts, stride))
    assert region_weights(72, 5, 2, stride=16)[0].tolist()[:3] == pytest.approx([16 / 36, 16 / 36, 4 / 36])
    assert region_weights(79, 4, 8, stride=16)[7].tolist() == [0, 0, 0, 1]
    for img, n, parts in [(64, 4, 2), (224, 14, 3), (224, 14, 4), (48, 3, 2)]:  # whole patches: both rules agree
        torch.testing.assert_close(region_weights(img, n, parts, stride=img // n), region_weights(img, n, parts))
    torch.manual_seed(0)
    model = timm.create_model('patchhead_vit_tiny_patch16_224', num_classes=3, grid=2, depth=1, img_size=64,
                              dynamic_img_size=True, dynamic_img_pad=True).train()
    for size in (72, 56):  # 5x5 tokens of which the last row and column are part padding; 4x4 in the block path
        x = torch.randn(2, 3, size, size)
        fmap = model.feature_map_nhwc(model.forward_features(x), [size, size])
        w = exact(size, fmap.shape[1], 2, 16)
        want = torch.einsum('rh,cw,bhwf->brcf', w.double(), w.double(), fmap.double()).reshape(2, 4, -1)
        torch.testing.assert_close(model.forward_patches(x), model.patch_head.fc(want.float()))


# --- 5. ONNX --------------------------------------------------------------------------------------------------------
class _LogitsAndPatches(nn.Module):
    """The eval model's logits and its patch logits, as one exported graph."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        feat = self.model.forward_features(x)
        return self.model.forward_head(feat), self.model.patch_logits(feat, x.shape[-2:])


@pytest.mark.parametrize('arch, kwargs, size, grid, dynamo', [
    ('test_resnet', {}, 96, (2, 3), True),                # area-weighted regions (3x3 map, 2x3 grid)
    ('test_vit', dict(img_size=96), 96, (3, 3), False),   # prefix token dropped, block means
], ids=['test_resnet-dynamo', 'test_vit-torchscript_exporter'])
def test_onnx_export_runs_in_onnxruntime(arch, kwargs, size, grid, dynamo, tmp_path):
    pytest.importorskip('onnx')
    ort = pytest.importorskip('onnxruntime')
    if dynamo:
        pytest.importorskip('onnxscript')
    if 'dynamo' not in inspect.signature(torch.onnx.export).parameters and not dynamo:
        pytest.skip('this torch has no TorchScript-based ONNX exporter')
    _, model = build(arch, kwargs, grid, per_position=False)
    x = images(size)
    model.eval()
    want = run(model, x), run(model.forward_patches, x)
    path = str(tmp_path / 'model.onnx')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torch.onnx.export(_LogitsAndPatches(model).eval(), (x,), path, dynamo=dynamo, input_names=['x'])
    sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    assert len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(g), w, rtol=1e-4, atol=1e-4)
