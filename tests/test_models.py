"""patchhead_* models: registration, layouts, exact region pooling, timm conventions, CIFAR backbones."""
import os
import re

import numpy as np
import pytest
import torch
import timm
from safetensors.torch import load_file, save_file

import timm_patchmix  # noqa: F401  registers patchhead_*
from timm_patchmix import PatchMix, PatchMixLoss, cell_bounds
from timm_patchmix.models import PatchHeadModel, register_patchhead_models
from timm_patchmix.models.patchhead import PatchHead

SMALL_SWIN = dict(embed_dim=24, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4, img_size=128)
ARCHS = [
    ('patchhead_test_resnet', {}, 128),
    ('patchhead_test_vit', {}, 160),
    ('patchhead_swin_tiny_patch4_window7_224', SMALL_SWIN, 128),
    ('patchhead_test_convnext', {}, 128),
    ('patchhead_test_efficientnet', {}, 128),
    ('patchhead_resnet32_cifar', {}, 32),
    ('patchhead_preactresnet18_cifar', {}, 32),
    ('patchhead_preactresnet56_cifar', {}, 32),
]


def test_registration_covers_timm_and_never_overwrites():
    archs = [a for a in timm.list_models() if not a.startswith('patchhead_')]
    heads = set(timm.list_models('patchhead_*'))
    assert {f'patchhead_{a}' for a in archs} <= heads
    assert timm.is_model('patchhead_convnext_tiny') and timm.is_model('patchhead_resnet32_cifar')
    assert timm.is_model('patchhead_resnet50.a1_in1k')
    before = dict(timm.models._registry._model_entrypoints)
    assert register_patchhead_models() == 0
    assert timm.models._registry._model_entrypoints == before
    with pytest.raises(RuntimeError, match='Unknown model'):
        timm.create_model('patchhead_no_such_backbone')


@pytest.mark.parametrize('name, kwargs, size', ARCHS)
def test_train_eval_outputs(name, kwargs, size):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **kwargs)
    assert isinstance(model, PatchHeadModel)
    x = torch.randn(2, 3, size, size)
    model.train()
    logits, patch = model(x)
    assert logits.shape == (2, 5) and patch.shape == (2, 16, 5)
    model.eval()
    with torch.no_grad():
        out = model(x)
        assert isinstance(out, torch.Tensor) and out.shape == (2, 5)
        assert torch.equal(out, model.backbone(x)), 'eval mode is the plain backbone classifier'
        assert model.forward_patches(x).shape == (2, 16, 5)
    # a PatchMix batch and loss run end to end with a backward pass
    model.train()
    mixer = PatchMix(num_classes=5)
    xm, target = mixer(x, torch.tensor([1, 4]))
    loss = PatchMixLoss()(model(xm), target)
    loss.backward()
    assert model.patch_head.fc.weight.grad is not None and torch.isfinite(loss)


def hand_pool(fmap_nhwc, img_h, img_w, rows, cols):
    """Area-weighted region means, computed pixel by pixel from cell_bounds of the image."""
    b, h, w, f = fmap_nhwc.shape
    rb, cb = cell_bounds(img_h, rows), cell_bounds(img_w, cols)
    out = torch.zeros(b, rows * cols, f, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            y0, y1 = rb[r] * h / img_h, rb[r + 1] * h / img_h
            x0, x1 = cb[c] * w / img_w, cb[c + 1] * w / img_w
            acc, tot = 0, 0.0
            for i in range(h):
                oy = max(0.0, min(y1, i + 1) - max(y0, i))
                for j in range(w):
                    ox = max(0.0, min(x1, j + 1) - max(x0, j))
                    acc = acc + oy * ox * fmap_nhwc[:, i, j].double()
                    tot += oy * ox
            out[:, r * cols + c] = acc / tot
    return out


@pytest.mark.parametrize('name, kwargs, size, grid', [
    ('patchhead_resnet32_cifar', {}, 32, 4),             # 8x8 map, plain block means
    ('patchhead_resnet32_cifar', {}, 36, (4, 3)),        # 9x9 map: area-weighted
    ('patchhead_test_vit', {}, 160, 4),                  # tokens with a class token
    ('patchhead_swin_tiny_patch4_window7_224', SMALL_SWIN, 128, 4),  # NHWC
])
@pytest.mark.parametrize('per_position', [False, True])
def test_patch_logits_are_classifier_of_pooled_regions(name, kwargs, size, grid, per_position):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=3, grid=grid, per_position=per_position, **kwargs).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        feat = model.forward_features(x)
        if feat.ndim == 3:  # tokens: drop the prefix tokens, lay the rest out on the token grid
            n = model.backbone.num_prefix_tokens
            side = int((feat.shape[1] - n) ** 0.5)
            fmap = feat[:, n:].reshape(2, side, side, -1)
        elif getattr(model.backbone, 'output_fmt', 'NCHW') == 'NHWC':
            fmap = feat
        else:
            fmap = feat.permute(0, 2, 3, 1)
        rows, cols = model.grid
        pooled = hand_pool(fmap, size, size, rows, cols)
        fc = model.patch_head.fc
        if per_position:
            expected = torch.stack([pooled[:, k] @ fc.weight[k].double().T + fc.bias[k].double()
                                    for k in range(rows * cols)], 1)
        else:
            expected = pooled @ fc.weight.double().T + fc.bias.double()
        got = model.forward_patches(x)
    assert got.shape == (2, rows * cols, 3)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


def test_backbone_kwargs_pass_through():
    m = timm.create_model('patchhead_resnet18', num_classes=4, output_stride=8, drop_path_rate=0.1, in_chans=1)
    assert m.backbone.conv1.in_channels == 1
    assert m.forward_features(torch.randn(1, 1, 32, 32)).shape[-2:] == (4, 4)
    assert m.train()(torch.randn(2, 1, 32, 32))[1].shape == (2, 16, 4)
    v = timm.create_model('patchhead_test_vit', num_classes=4, img_size=96)
    assert v.train()(torch.randn(1, 3, 96, 96))[1].shape == (1, 16, 4)


def test_too_small_map_names_size_and_fix():
    m = timm.create_model('patchhead_resnet50', num_classes=10).train()
    with pytest.raises(ValueError, match=r'1x1.*4x4.*output_stride=8.*resnet32_cifar'):
        m(torch.randn(2, 3, 32, 32))


def test_timm_conventions_and_reset_classifier():
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=10)
    assert m.pretrained_cfg['classifier'] == ('backbone.fc', 'patch_head.fc')
    assert m.default_cfg is m.pretrained_cfg and m.pretrained_cfg['architecture'] == 'patchhead_resnet32_cifar'
    assert m.num_classes == 10 and m.num_features == 64 and m.get_classifier() is m.backbone.fc
    state = dict(m.state_dict())
    for name in m.pretrained_cfg['classifier']:
        assert f'{name}.weight' in state and f'{name}.bias' in state
    old_patch = m.patch_head.fc
    m.reset_classifier(3)
    assert m.num_classes == 3 and m.backbone.fc.out_features == 3
    assert m.patch_head.fc is not old_patch and m.patch_head.fc.out_features == 3
    m.reset_classifier(0)
    out = m.train()(torch.randn(2, 3, 32, 32))
    assert out[0].shape == (2, 64) and out[1].shape == (2, 16, 64)
    m.set_grad_checkpointing(True)
    assert m.backbone.grad_checkpointing


def test_safetensors_round_trip(tmp_path):
    torch.manual_seed(0)
    a = timm.create_model('patchhead_resnet32_cifar', num_classes=6, per_position=True).eval()
    path = os.path.join(tmp_path, 'model.safetensors')
    save_file(a.state_dict(), path)
    b = timm.create_model('patchhead_resnet32_cifar', num_classes=6, per_position=True).eval()
    b.load_state_dict(load_file(path))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a(x), b(x)) and torch.equal(a.forward_patches(x), b.forward_patches(x))


@pytest.mark.parametrize('name, params, tol', [
    ('resnet8_cifar', 0.078e6, 0.002e6), ('resnet20_cifar', 0.27e6, 0.01e6), ('resnet32_cifar', 0.46e6, 0.02e6),
    ('resnet56_cifar', 0.85e6, 0.02e6),
    ('preactresnet56_cifar', 0.85e6, 0.02e6), ('preactresnet164_cifar', 1.70e6, 0.05e6),
    ('preactresnet18_cifar', 2.78e6, 0.05e6),
])
def test_cifar_backbones_param_counts_and_8x8_maps(name, params, tol):
    m = timm.create_model(name, num_classes=10)
    n = sum(p.numel() for p in m.parameters())
    print(f'{name}: {n / 1e6:.3f}M parameters')
    assert abs(n - params) <= tol
    assert m.forward_features(torch.randn(1, 3, 32, 32)).shape[-2:] == (8, 8)
    assert timm.is_model(f'patchhead_{name}')


def test_torch_compile():
    torch.manual_seed(0)
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=4).train()
    compiled = torch.compile(m, backend='aot_eager')
    x = torch.randn(2, 3, 32, 32)
    logits, patch = compiled(x)
    ref_logits, ref_patch = m(x)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(patch, ref_patch)
    (logits.sum() + patch.sum()).backward()


def test_grid_by_aspect_is_the_one_factorisation_nearest_the_image_shape():
    """Token counts without a patch embed that says their grid: the factorisation nearest the image's shape, none
    where two are equally near or the nearest is off by more than a factor of two."""
    from timm_patchmix.models.patchhead import grid_by_aspect
    assert grid_by_aspect(196, [224, 224]) == (14, 14)
    assert grid_by_aspect(140, [224, 160]) == (14, 10) and grid_by_aspect(140, [160, 224]) == (10, 14)
    assert grid_by_aspect(35, [224, 160]) == (7, 5)      # stride 32
    assert grid_by_aspect(96, [128, 192]) == (8, 12)
    assert grid_by_aspect(48, [225, 161]) == (8, 6)      # ceil-mode map of an odd size
    assert grid_by_aspect(1, [32, 32]) == (1, 1)
    assert grid_by_aspect(12, [100, 100]) == (0, 0)      # 3x4 and 4x3 equally near a square
    assert grid_by_aspect(37, [224, 160]) == (0, 0)      # a prime count: only 1x37 and 37x1
    scripted = torch.jit.script(grid_by_aspect)
    assert scripted(140, [224, 160]) == (14, 10) and scripted(12, [100, 100]) == (0, 0)


@pytest.mark.parametrize('arch, kwargs, hw', [
    ('xcit_nano_12_p16_224', {}, (224, 160)),            # tokens and a class token, no dynamic patch embed
    ('twins_svt_small', {}, (160, 224)),                 # tokens at stride 32, no class token
    ('volo_d1_224', {}, (224, 224)),                     # a class token that the backbone does not count
    ('coat_lite_tiny', {'img_size': (224, 160)}, (224, 160)),  # one class token per stage (cls_token1..4), uncounted
])
def test_token_backbones_lay_out_tokens_on_their_own_grid(arch, kwargs, hw):
    """Backbones whose tokens no patch embed lays out: the patch head's map has the spatial shape of the
    backbone's own last intermediate map, for non-square inputs too, and training runs."""
    torch.manual_seed(0)
    model = timm.create_model('patchhead_' + arch, num_classes=3, **kwargs).train()
    x = torch.randn(1, 3, *hw)
    with torch.no_grad():
        feat = model.forward_features(x)
        fmap = model.feature_map_nhwc(feat, list(hw))
        last = model.backbone.forward_intermediates(x, intermediates_only=True)[-1]
    assert fmap.shape[1:3] == last.shape[-2:]
    logits, patch = model(x)
    assert logits.shape == (1, 3) and patch.shape == (1, 16, 3)


@pytest.mark.parametrize('arch, size, message', [
    ('coat_tiny', 224, r'forward_features returns a list \(\[1, 785, 152\], \[1, 197, 152\], \[1, 50, 152\]\), '
                       r'not one feature map'),
    ('pit_xs_224', 224, r'shape \[1, 1, 384\] holds 1 token\(s\), no more than the backbone\'s 1 prefix'),
])
def test_backbones_without_one_spatial_map_get_a_named_error(arch, size, message):
    model = timm.create_model('patchhead_' + arch, num_classes=3).train()
    x = torch.randn(1, 3, size, size)
    with pytest.raises(ValueError, match=message):
        model(x)
    with pytest.raises(ValueError, match=message):
        model.forward_patches(x)
    model.eval()
    assert model(x).shape == (1, 3)  # the plain classifier is untouched


@pytest.mark.parametrize('name', ['resnet32_cifar', 'preactresnet56_cifar', 'patchhead_resnet32_cifar'])
def test_cifar_backbones_report_in_chans(name):
    assert timm.create_model(name).in_chans == 3
    assert timm.create_model(name, in_chans=1).in_chans == 1


@pytest.mark.parametrize('name', ['resnet8_cifar', 'preactresnet18_cifar', 'patchhead_resnet8_cifar', 'resnet18',
                                  'patchhead_resnet18'])
def test_reset_classifier_keeps_dtype_mode_and_reports_the_pooled_width(name):
    """As timm's ResNet: a new classifier in the model's dtype (bf16 here) and train/eval mode, and
    ``head_hidden_size`` the width ``forward_head(pre_logits=True)`` gives (twice the features for
    ``catavgmax``), at creation and after a reset that changes the pooling."""
    m = timm.create_model(name, num_classes=3, global_pool='catavgmax')
    x = torch.randn(2, 3, 32, 32)
    assert m.head_hidden_size == 2 * m.num_features
    assert m.eval().forward_head(m.forward_features(x), pre_logits=True).shape[1] == m.head_hidden_size
    m = m.to(torch.bfloat16).eval()
    m.reset_classifier(4)
    out = m(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4)
    assert not any(mod.training for mod in m.modules())
    m.reset_classifier(5, 'avg')
    assert m.head_hidden_size == m.num_features
    assert m.forward_head(m.forward_features(x.to(torch.bfloat16)), pre_logits=True).shape[1] == m.num_features
    assert m(x.to(torch.bfloat16)).shape == (2, 5)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


@pytest.mark.parametrize('name', ['resnet8_cifar', 'preactresnet18_cifar', 'patchhead_resnet8_cifar', 'resnet18',
                                  'patchhead_resnet18'])
def test_no_pooling_leaves_the_feature_map_as_timm_does(name):
    """``num_classes=0, global_pool=''`` (at creation, by ``reset_classifier(0, '')``, or by timm's
    ``prune_intermediate_layers``) gives the unpooled NCHW map, as timm's ResNet does; the CIFAR backbones flattened
    it to ``[B, C*H*W]`` while ``head_hidden_size`` still said C."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    m = timm.create_model(name, num_classes=0, global_pool='').eval()
    f = m.forward_features(x)
    assert f.ndim == 4 and f.shape[1] == m.num_features == m.head_hidden_size
    assert torch.equal(m(x), f) and torch.equal(m.forward_head(f, pre_logits=True), f)
    m = timm.create_model(name, num_classes=5).eval()
    m.reset_classifier(0, '')
    assert torch.equal(m(x), m.forward_features(x))
    m.reset_classifier(3, 'avg')  # pooling back: flattened for the classifier again
    assert m(x).shape == (2, 3) and m.forward_head(m.forward_features(x), pre_logits=True).shape == (2, m.num_features)
    m = timm.create_model(name, num_classes=5).eval()
    m.prune_intermediate_layers(indices=1)
    assert m(x).ndim == 4


@pytest.mark.parametrize('name', ['patchhead_resnet8_cifar', 'patchhead_resnet18'])
def test_factory_device_and_dtype_reach_the_patch_head(name):
    """timm's create_model takes device=/dtype= factory arguments; they reached the backbone only, so a float64
    (or bf16) model's train-mode forward failed in the float32 patch head, and device='meta' left the patch head in
    real memory. The patch head now follows the backbone's parameters."""
    m = timm.create_model(name, num_classes=3, grid=2, dtype=torch.float64).train()
    assert {p.dtype for p in m.parameters()} == {torch.float64}
    logits, patches = m(torch.randn(2, 3, 64, 64, dtype=torch.float64))
    assert logits.dtype == patches.dtype == torch.float64 and patches.shape == (2, 4, 3)
    meta = timm.create_model(name, num_classes=3, grid=2, device='meta')
    assert {t.device.type for t in meta.state_dict().values()} == {'meta'}


@pytest.mark.parametrize('prune_head', [True, False])
def test_a_pruned_backbones_narrower_map_gets_a_patch_head_of_its_width(prune_head):
    """After prune_intermediate_layers dropped the last stages, the feature map is narrower (64 -> 32 here); the
    patch head kept the old width, so reset_classifier built it at 64 and the train-mode forward failed where the
    plain model's works. It now takes the pruned map's width, as the backbone's num_features says."""
    plain = timm.create_model('resnet8_cifar', num_classes=10)
    m = timm.create_model('patchhead_resnet8_cifar', num_classes=10, grid=2)
    assert m.prune_intermediate_layers([0, 2], prune_head=prune_head) == \
        plain.prune_intermediate_layers([0, 2], prune_head=prune_head)
    assert m.num_features == plain.num_features == m.patch_head.num_features == 32
    m.reset_classifier(5, global_pool='avg')
    plain.reset_classifier(5, global_pool='avg')
    x = torch.randn(2, 3, 32, 32)
    assert plain.train()(x).shape == (2, 5)
    logits, patches = m.train()(x)
    assert logits.shape == (2, 5) and patches.shape == (2, 4, 5) and m.patch_head.fc.in_features == 32


@pytest.mark.parametrize('value', ['no', 'False', 2, 1, 0.0])
def test_per_position_takes_only_a_bool(value):
    """A truthy string or number silently built a classifier per cell; only True/False are taken."""
    with pytest.raises(ValueError, match=rf'per_position must be True or False, got {re.escape(repr(value))}'):
        timm.create_model('patchhead_resnet8_cifar', per_position=value)
    with pytest.raises(ValueError, match='per_position must be True or False'):
        PatchHead(8, 3, 2, per_position=value)
    assert timm.create_model('patchhead_resnet8_cifar', per_position=np.bool_(True)).patch_head.per_position is True


def test_plain_checkpoint_into_a_patchhead_model(tmp_path):
    """timm's ``checkpoint_path=`` (a strict load) with a plain model's checkpoint ended in torch's list of every
    name missing and unexpected; it now names the routes that take it. ``--initial-checkpoint`` (the engine's
    loader) is one: it loads a plain model's weights into the backbone, under the usual classifier rule, and the
    patch head starts fresh."""
    from timm_patchmix.engine.model import load_initial_checkpoint
    torch.manual_seed(0)
    plain = timm.create_model('resnet8_cifar', num_classes=10)
    path = str(tmp_path / 'plain.safetensors')
    save_file(plain.state_dict(), path)
    with pytest.raises(RuntimeError, match=r'plain CifarResNet model.s weights .*load them into model\.backbone.*'
                                           r'pretrained_cfg_overlay=dict\(file='):
        timm.create_model('patchhead_resnet8_cifar', checkpoint_path=path)
    for n in (10, 5):
        torch.manual_seed(1)
        model = timm.create_model('patchhead_resnet8_cifar', num_classes=n)
        fresh_head = {k: v.clone() for k, v in model.patch_head.state_dict().items()}
        load_initial_checkpoint(model, path)
        got = model.backbone.state_dict()
        assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items() if n == 10 or not k.startswith('fc.'))
        assert all(torch.equal(model.patch_head.state_dict()[k], v) for k, v in fresh_head.items())
        if n == 5:
            assert got['fc.weight'].shape == (5, plain.num_features)
    # a whole patchhead_ model's state dict still loads strictly, by checkpoint_path too
    whole = str(tmp_path / 'whole.safetensors')
    save_file(model.state_dict(), whole)
    again = timm.create_model('patchhead_resnet8_cifar', num_classes=5, checkpoint_path=whole)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    # non-strict loads keep torch's behaviour (nothing matched, every name reported)
    missing, unexpected = timm.create_model('patchhead_resnet8_cifar').load_state_dict(plain.state_dict(),
                                                                                       strict=False)
    assert len(unexpected) == len(plain.state_dict())
