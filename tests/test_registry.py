"""patchhead_* registration through timm's public API, the pretrained tags and what pretrained=True loads,
features_only, in_chans, pretrained_cfg_overlay, checkpoint_path, and the weights shipped in the package."""
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch
import timm
from safetensors.torch import save_file

import timm_patchmix  # noqa: F401  registers patchhead_*
from timm_patchmix.models import PatchHeadModel, PatchheadWeightsError, register_patchhead_models
from timm_patchmix.models import registry
from timm_patchmix.models.pretrained import PATCHHEAD_PRETRAINED, UNPUBLISHED, WEIGHTS_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPM = 'patchhead_resnet32_cifar.gpm_fmnist'


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_registered_through_register_model_for_every_architecture():
    archs = [a for a in timm.list_models() if not a.startswith('patchhead_')]
    assert set(timm.list_models('patchhead_*')) == {f'patchhead_{a}' for a in archs}
    # register_model's bookkeeping: the entrypoint is an attribute of its module and named in __all__
    fn = timm.models.model_entrypoint('patchhead_convnext_tiny')
    assert fn.__module__ == registry.__name__ and getattr(registry, 'patchhead_convnext_tiny') is fn
    assert 'patchhead_convnext_tiny' in registry.__all__ and 'patchhead_convnext_tiny' in list(registry.__all__)
    assert 'patchhead_resnet50' in timm.list_models(module=registry.__name__.split('.')[-1])
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a second call neither re-registers nor warns about overwriting
        assert register_patchhead_models() == 0


def test_a_new_timm_architecture_gets_its_twin_on_the_next_call():
    @timm.models.register_model
    def registry_test_net(pretrained=False, **kwargs):
        return timm.create_model('test_resnet', pretrained=pretrained, **kwargs)
    try:
        assert not timm.is_model('patchhead_registry_test_net')
        assert register_patchhead_models() == 1
        assert isinstance(timm.create_model('patchhead_registry_test_net', num_classes=3), PatchHeadModel)
    finally:  # leave the registry as the other tests expect it
        from timm.models import _registry  # test clean-up only
        for name in ('registry_test_net', 'patchhead_registry_test_net'):
            _registry._clear_model_entries(name)
            _registry._model_entrypoints.pop(name, None)


def test_list_pretrained_and_is_model_pretrained_agree_with_pretrained_true():
    assert timm.list_pretrained('patchhead_*') == sorted(PATCHHEAD_PRETRAINED)
    for full in PATCHHEAD_PRETRAINED:
        assert timm.is_model_pretrained(full)
        m = timm.create_model(full, pretrained=True)
        ref = timm.create_model(f'local-dir:{os.path.join(WEIGHTS_DIR, full)}', pretrained=True)
        assert same_weights(m, ref), full
    # the architecture's default tag is the first one listed for it
    assert timm.is_model_pretrained('patchhead_resnet32_cifar')
    assert same_weights(timm.create_model('patchhead_resnet32_cifar', pretrained=True),
                        timm.create_model(GPM, pretrained=True))
    # no weights with a patch head: not pretrained, and pretrained=True says so instead of loading something else
    assert not timm.is_model_pretrained('patchhead_resnet50')
    with pytest.raises(PatchheadWeightsError, match=r'patchhead_resnet50 has no weights.*a1_in1k'):
        timm.create_model('patchhead_resnet50', pretrained=True)
    assert not timm.is_model_pretrained('patchhead_preactresnet18_cifar')
    with pytest.raises(PatchheadWeightsError, match='preactresnet18_cifar has no timm weights either'):
        timm.create_model('patchhead_preactresnet18_cifar', pretrained=True)
    # without pretrained=True the architecture builds as usual
    assert isinstance(timm.create_model('patchhead_test_resnet', num_classes=3), PatchHeadModel)


@pytest.mark.parametrize('full', sorted(UNPUBLISHED))
def test_unpublished_names_fail_at_once_without_the_network(full, monkeypatch):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError('no Hub call expected')
    monkeypatch.setattr(huggingface_hub, 'hf_hub_download', no_network)
    assert not timm.is_model_pretrained(full) and full not in timm.list_pretrained('patchhead_*')
    t = time.perf_counter()
    with pytest.raises(PatchheadWeightsError, match=r'not published.*docs/hub\.md'):
        timm.create_model(full, pretrained=True)
    assert time.perf_counter() - t < 1.0


def test_an_unknown_tag_names_the_tags_that_exist():
    with pytest.raises(PatchheadWeightsError, match=r"patchhead_resnet32_cifar\.nope: no such tag.*gpm_fmnist"):
        timm.create_model('patchhead_resnet32_cifar.nope')
    with pytest.raises(PatchheadWeightsError, match=r'patchhead_resnet18\.nope: no such tag.*a1_in1k'):
        timm.create_model('patchhead_resnet18.nope', pretrained=True)


def test_own_weights_with_overlay_in_chans_and_checkpoint_path(tmp_path):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    m = timm.create_model(GPM, pretrained=True).eval()
    # pretrained_cfg_overlay: fields land in the model's cfg; a file overlay loads that file instead
    m2 = timm.create_model(GPM, pretrained=True, pretrained_cfg_overlay=dict(crop_pct=0.5))
    assert m2.pretrained_cfg['crop_pct'] == 0.5 and same_weights(m, m2)
    other = timm.create_model('patchhead_resnet32_cifar', num_classes=10)
    path = str(tmp_path / 'other.safetensors')
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, path)
    m3 = timm.create_model(GPM, pretrained=True, pretrained_cfg_overlay=dict(file=path))
    assert same_weights(m3, other)
    # in_chans: timm's stem adaptation on the patchhead model's first conv (1 channel: the sum over RGB)
    grey = timm.create_model(GPM, pretrained=True, in_chans=1)
    assert torch.equal(grey.backbone.conv1.weight, m.backbone.conv1.weight.sum(1, keepdim=True))
    assert same_weights(grey.patch_head, m.patch_head)
    # checkpoint_path: timm loads a patchhead state dict after building the model
    path = str(tmp_path / 'ckpt.safetensors')
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, path)
    m4 = timm.create_model('patchhead_resnet32_cifar', num_classes=10, checkpoint_path=path).eval()
    with torch.no_grad():
        assert torch.equal(m4(x), m(x))
    # a new num_classes re-initialises both heads and keeps the trunk
    ft = timm.create_model(GPM, pretrained=True, num_classes=3)
    assert ft.backbone.fc.out_features == 3 and ft.patch_head.fc.out_features == 3
    assert torch.equal(ft.backbone.conv1.weight, m.backbone.conv1.weight)


@pytest.mark.parametrize('arch', ['resnet20_cifar', 'resnet32_cifar', 'resnet18'])
def test_a_file_overlay_is_read_by_what_it_holds_whatever_tags_the_architecture_has(tmp_path, arch):
    """A whole patchhead_ model's file in pretrained_cfg_overlay=dict(file=...) went to the plain backbone on an
    architecture without a patchhead_ tag, which, under a class count other than its cfg's, loaded it
    non-strictly: not at all, the model random, with a logged warning only; and a backbone's file was refused on
    one with a tag. The file's tensor names now decide: a whole model's loads as the model's own weights (strict,
    its class count read from the file, the tensor digest checked), a backbone's under a fresh patch head."""
    from timm_patchmix.checkpoint import CheckpointError, save_weights
    src = timm.create_model('patchhead_' + arch, num_classes=7)
    path = str(tmp_path / 'whole.safetensors')
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, path)
    same = timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg_overlay=dict(file=path),
                             num_classes=7)
    assert same_weights(same, src)  # the heads too: the file's class count, not a tag's or the cfg's
    assert timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg_overlay=dict(file=path)
                             ).num_classes == 7
    ft = timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg_overlay=dict(file=path),
                           num_classes=3)
    trunk = {k: v for k, v in src.state_dict().items() if not k.startswith(('backbone.fc.', 'patch_head.'))}
    assert all(torch.equal(ft.state_dict()[k], v) for k, v in trunk.items())
    assert ft.patch_head.fc.out_features == 3 and ft.backbone.state_dict()['fc.weight'].shape[0] == 3
    # a backbone's file: the trunk under a fresh patch head, tag or none
    plain = timm.create_model(arch, num_classes=7)
    bpath = str(tmp_path / 'plain.safetensors')
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, bpath)
    under = timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg_overlay=dict(file=bpath),
                              num_classes=7)
    assert all(torch.equal(under.backbone.state_dict()[k], v) for k, v in plain.state_dict().items()
               if not k.startswith('fc.'))  # (timm's rule: a class count other than the cfg's drops the head)
    # beside a patchhead_ model's own cfg (which names its heads and stem as the whole model's): the backbone's
    own_cfg = dict(same.pretrained_cfg, file=bpath, num_classes=7)
    beside = timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg=own_cfg, num_classes=3)
    assert all(torch.equal(beside.backbone.state_dict()[k], v) for k, v in plain.state_dict().items()
               if not k.startswith('fc.')) and beside.num_classes == 3
    # the file named through pretrained_cfg (a dict, a PretrainedCfg), or with the overlay naming the architecture
    from timm.models import PretrainedCfg
    for how in (dict(pretrained_cfg=dict(file=path)), dict(pretrained_cfg=PretrainedCfg(file=path)),
                dict(pretrained_cfg_overlay=dict(file=path, architecture='patchhead_' + arch))):
        got = timm.create_model('patchhead_' + arch, pretrained=True, **how)
        assert same_weights(got, src) and got.num_classes == 7, how
        assert got.pretrained_cfg.get('label_names') is None  # not a shipped tag's class names
    # the heads of another class count than the model asks for (not fine-tuning): named as the heads
    with pytest.raises(CheckpointError, match=r'backbone\.fc\.bias is \[7\] in the file and \[10\] in the model '
                                              r'\(4 tensors differ\); the classifier heads differ'):
        timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg_overlay=dict(file=path, num_classes=10),
                          num_classes=10)
    # the project's weights file of a whole model: its digest is checked on this path too
    signed = str(tmp_path / 'signed.safetensors')
    save_weights(signed, src.state_dict())
    data = bytearray(open(signed, 'rb').read())
    data[-1] ^= 0x10
    open(signed, 'wb').write(bytes(data))
    with pytest.raises(CheckpointError, match='is corrupt'):
        timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg_overlay=dict(file=signed))
    # a file without tensors: named (it went to the backbone, and timm's missing-keys error)
    empty = str(tmp_path / 'empty.safetensors')
    save_file({}, empty)
    with pytest.raises(CheckpointError, match='empty.safetensors holds no tensors'):
        timm.create_model('patchhead_' + arch, pretrained=True, pretrained_cfg_overlay=dict(file=empty))


FEATURE_ARCHS = [
    ('test_resnet', {}, 64),
    ('resnet18', {}, 64),
    ('test_efficientnet', {}, 64),
    ('mobilenetv3_small_050', {}, 64),
    ('test_convnext', {}, 64),
    ('test_vit', {}, 160),
    ('swin_tiny_patch4_window7_224',
     dict(embed_dim=24, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4, img_size=128), 128),
    ('test_nfnet', {}, 64),
    ('test_byobnet', {}, 64),
    ('resnet32_cifar', {}, 32),
]


@pytest.mark.parametrize('arch, kwargs, size', FEATURE_ARCHS)
@pytest.mark.parametrize('extra', [{}, dict(out_indices=(1, 2)), dict(feature_cls='hook')], ids=['all', 'idx', 'hook'])
def test_features_only_is_the_backbones_feature_extractor(arch, kwargs, size, extra):
    torch.manual_seed(0)
    try:
        plain = timm.create_model(arch, features_only=True, **kwargs, **extra).eval()
    except Exception as e:  # noqa: BLE001  the plain model decides what the contract can ask
        pytest.skip(f'{arch} has no features_only{" with " + str(extra) if extra else ""} in timm either: {e}')
    torch.manual_seed(0)
    feat = timm.create_model(f'patchhead_{arch}', features_only=True, **kwargs, **extra).eval()
    assert type(feat) is type(plain)
    assert feat.feature_info.channels() == plain.feature_info.channels()
    assert feat.feature_info.reduction() == plain.feature_info.reduction()
    assert feat.feature_info.module_name() == plain.feature_info.module_name()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = feat(x), plain(x)
    a, b = (list(a.values()), list(b.values())) if isinstance(a, dict) else (a, b)
    assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize('bad, match', [(dict(grid=0), '^grid must be at least 1x1'),
                                        (dict(grid='4'), '^grid must be an int'),
                                        (dict(per_position='no'), "^per_position must be True or False, got 'no'")])
@pytest.mark.parametrize('pretrained', [False, True])
def test_features_only_checks_the_patch_head_arguments(bad, match, pretrained):
    """``features_only`` drops ``grid``/``per_position`` (they shape only the patch head), but a bad value is still
    refused as it is for the whole model, not ignored."""
    name = GPM if pretrained else 'patchhead_resnet8_cifar'
    with pytest.raises(ValueError, match=match):
        timm.create_model(name, pretrained=pretrained, features_only=True, **bad)
    feat = timm.create_model(name, pretrained=pretrained, features_only=True, grid=(2, 3), per_position=False)
    assert feat.feature_info.channels()  # good values are still accepted and dropped


def test_features_only_from_patchhead_weights_holds_their_trunk():
    m = timm.create_model(GPM, pretrained=True).eval()
    feat = timm.create_model(GPM, pretrained=True, features_only=True, out_indices=(1, 2, 3)).eval()
    assert feat.feature_info.channels() == [16, 32, 64]
    seen = []
    hook = m.backbone.stages[2].register_forward_hook(lambda mod, i, o: seen.append(o))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(x)
        out = feat(x)
    hook.remove()
    assert torch.equal(out[-1], seen[0])
    with pytest.raises(PatchheadWeightsError):
        timm.create_model('patchhead_resnet50', pretrained=True, features_only=True)


def test_backbone_tags_and_the_pretrained_cfg():
    for tag in ('a1_in1k', 'tv_in1k'):
        m = timm.create_model(f'patchhead_resnet18.{tag}', num_classes=4)
        plain = timm.create_model(f'resnet18.{tag}', num_classes=4)
        assert m.pretrained_cfg['hf_hub_id'] == plain.pretrained_cfg['hf_hub_id'] == f'timm/resnet18.{tag}'
        assert m.pretrained_cfg['tag'] == tag
    own = timm.create_model(GPM).pretrained_cfg
    for key in ('input_size', 'mean', 'std', 'crop_pct', 'crop_mode', 'interpolation', 'first_conv', 'classifier',
                'license', 'num_classes', 'file', 'architecture', 'tag'):
        assert own.get(key) is not None, key
    assert own['tag'] == 'gpm_fmnist' and own['architecture'] == 'patchhead_resnet32_cifar'


def test_model_cards_name_the_call_that_loads_them():
    for full in PATCHHEAD_PRETRAINED:
        card = open(os.path.join(WEIGHTS_DIR, full, 'README.md')).read()
        assert f"timm.create_model('{full}', pretrained=True)" in card
        assert 'hf-hub:' not in card


@pytest.mark.slow
def test_the_shipped_weights_load_from_a_wheel(tmp_path):
    """Build a wheel from the sources, install it on its own, and load each tag from it offline."""
    src = tmp_path / 'src'
    src.mkdir()
    for f in ('setup.cfg', 'pyproject.toml', 'README.md', 'LICENSE'):
        shutil.copy(os.path.join(ROOT, f), src / f)
    shutil.copytree(os.path.join(ROOT, 'timm_patchmix'), src / 'timm_patchmix',
                    ignore=shutil.ignore_patterns('__pycache__'))
    env = dict(os.environ, HF_HUB_OFFLINE='1', PIP_NO_INDEX='1', PIP_DISABLE_PIP_VERSION_CHECK='1')
    run = dict(env=env, capture_output=True, text=True, timeout=600)
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-w',
                        str(tmp_path / 'dist'), str(src)], **run)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = [f for f in os.listdir(tmp_path / 'dist') if f.endswith('.whl')]
    r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-deps', '--target', str(tmp_path / 'site'),
                        str(tmp_path / 'dist' / wheel[0])], **run)
    assert r.returncode == 0, r.stderr[-3000:]
    code = ('import sys, timm, timm_patchmix; assert timm_patchmix.__file__.startswith(sys.argv[1]), '
            'timm_patchmix.__file__\n'
            'for n in sys.argv[2:]:\n'
            '    m = timm.create_model(n, pretrained=True)\n'
            '    assert m.pretrained_cfg["file"].startswith(sys.argv[1]), m.pretrained_cfg["file"]\n'
            'print("ok")')
    site = str(tmp_path / 'site')
    r = subprocess.run([sys.executable, '-c', code, site, *sorted(PATCHHEAD_PRETRAINED)], cwd=str(tmp_path),
                       **dict(run, env=dict(env, PYTHONPATH=site)))
    assert r.returncode == 0 and r.stdout.strip().endswith('ok'), r.stderr[-3000:]


def test_own_weights_of_another_input_size_name_the_tensor_and_the_way_that_works(tmp_path):
    """A whole model's weights do not pass through the backbone's own checkpoint filter (which resamples a ViT's
    position embedding to the input size asked for): at another img_size the load failed with torch's size-mismatch
    text. It is now a CheckpointError naming the tensor, both shapes and what works: create the model as the
    weights were made, then set_input_size, which resamples it."""
    from timm_patchmix.checkpoint import CheckpointError
    arch = 'patchhead_vit_tiny_patch16_224'
    src = timm.create_model(arch, img_size=64, grid=2, num_classes=4)
    path = str(tmp_path / 'vit64.safetensors')
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, path)
    with pytest.raises(CheckpointError, match=re.escape(
            'backbone.pos_embed is [1, 17, 192] in the file and [1, 37, 192] in the model; the weights were made '
            'with other model arguments (an input or patch size, say): create the model with those (its '
            'config.json model_args) and change the input size afterwards with model.set_input_size(...)')):
        timm.create_model(arch, img_size=96, grid=2, pretrained=True, pretrained_cfg_overlay=dict(file=path))
    m = timm.create_model(arch, img_size=64, grid=2, pretrained=True, pretrained_cfg_overlay=dict(file=path))
    assert same_weights(m, src)
    m.set_input_size(img_size=96)
    logits, patches = m.train()(torch.randn(2, 3, 96, 96))
    assert logits.shape == (2, 4) and patches.shape == (2, 4, 4)


@pytest.mark.parametrize('tag', sorted(PATCHHEAD_PRETRAINED))
def test_a_tag_carries_the_class_names_of_its_folder(tag):
    """A tag's pretrained_cfg had label_names None, though the same weights through local-dir: carry the class
    names of the folder's config.json; the tag now carries them too."""
    import json
    with open(os.path.join(WEIGHTS_DIR, tag, 'config.json'), encoding='utf-8') as f:
        names = json.load(f)['label_names']
    assert len(names) == 10
    by_tag = timm.create_model(tag, pretrained=True)
    by_dir = timm.create_model('local-dir:' + os.path.join(WEIGHTS_DIR, tag), pretrained=True)
    assert list(by_tag.pretrained_cfg['label_names']) == list(by_dir.pretrained_cfg['label_names']) == names
