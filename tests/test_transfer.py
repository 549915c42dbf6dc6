"""Transfer studies through train.py: the sklearn_digits dataset, --reset-head and --linear-probe, on their own and
from a model exported with timm_patchmix.hub.export_folder (local-dir: --pretrained)."""
import dataclasses
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import timm
from sklearn import datasets as sklearn_datasets  # the test extra installs scikit-learn
import torch
import yaml

import timm_patchmix  # noqa: F401
from timm_patchmix.checkpoint import load_state, load_weights, save_weights
from timm_patchmix.data import SklearnDigits, build_dataset, digits_split, open_dataset
from timm_patchmix.engine import ConfigError, TrainSetupError, train
from timm_patchmix.engine.model import build_model, freeze_for_linear_probe, resolve_arch
from timm_patchmix.engine.runtime import seed_all
from timm_patchmix.settings import SettingsChangedError
from timm_patchmix.train import main as train_main, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ['--train-subset', '64', '--val-subset', '32', '-b', '32', '-j', '0', '--no-progress', '--device', 'cpu',
        '--log-interval', '1000']
TINY = BASE + ['--epochs', '1']
PROBE = ['--lr', '0.05', '--warmup-epochs', '0']  # timm's recipe would warm up from 1e-5 for 5 epochs
DIGITS = ['--dataset', 'sklearn_digits', '--num-classes', '10']
PATCHHEAD_HEADS = ('backbone.fc.weight', 'backbone.fc.bias', 'patch_head.fc.weight', 'patch_head.fc.bias')


def is_head(key):
    return key in PATCHHEAD_HEADS


# --- the dataset ------------------------------------------------------------------------------------------------
def test_digits_split_exact():
    targets = sklearn_datasets.load_digits().target
    train_idx, test_idx = digits_split(targets)
    assert len(train_idx) == 1297 and len(test_idx) == 500
    assert not set(train_idx.tolist()) & set(test_idx.tolist())
    assert sorted(train_idx.tolist() + test_idx.tolist()) == list(range(1797))
    assert list(train_idx) == sorted(train_idx) and list(test_idx) == sorted(test_idx)
    # stratified: 500 * n_c / 1797 per class, rounded down, the 4 images left to the largest remainders
    counts = np.bincount(targets, minlength=10)
    quota = 500 * counts / 1797
    per_class = np.bincount(targets[test_idx], minlength=10)
    assert per_class.sum() == 500 and np.all(per_class - np.floor(quota) <= 1) and np.all(per_class >= np.floor(quota))
    assert per_class.tolist() == [50, 51, 49, 51, 50, 51, 50, 50, 48, 50]
    again = digits_split(targets)
    assert np.array_equal(again[0], train_idx) and np.array_equal(again[1], test_idx)


def test_digits_datasets_deterministic_and_disjoint():
    a, b = SklearnDigits('train'), SklearnDigits('train')
    assert len(a) == 1297 and np.array_equal(a.indices, b.indices) and np.array_equal(a.images, b.images)
    for split in ('test', 'validation', 'val'):  # any evaluation split name gives the 500 other images
        ev = SklearnDigits(split)
        assert len(ev) == 500 and not set(ev.indices.tolist()) & set(a.indices.tolist())
    assert SklearnDigits('training').indices.tolist() == a.indices.tolist()
    # the same split in another process, whatever its global seeds
    code = ('import hashlib, numpy, torch; numpy.random.seed(3); torch.manual_seed(3); '
            'from timm_patchmix.data import SklearnDigits; '
            'print(hashlib.sha256(SklearnDigits("test").indices.astype("int64").tobytes()).hexdigest())')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')])))
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == hashlib.sha256(SklearnDigits('test').indices.astype('int64').tobytes()).hexdigest()


def test_digits_pixels_and_classes():
    digits = sklearn_datasets.load_digits()
    ds = SklearnDigits('test')
    for i in (0, 1, 499):
        img, label = ds[i]
        src = int(ds.indices[i])
        assert img.mode == 'L' and img.size == (8, 8)
        expect = digits.images[src].astype(np.int64) * 255 // 16
        assert np.array_equal(np.asarray(img), expect.astype(np.uint8))
        assert label == int(digits.target[src])
    assert np.asarray(ds[0][0]).max() <= 255
    assert {0, 255} <= set(np.unique(ds.images).tolist())  # 0 -> 0 and 16 -> 255
    assert 127 in set(np.unique(ds.images).tolist())       # 8 -> 127 (floor of 127.5)
    base, classes = open_dataset('sklearn_digits', split='validation')
    assert classes == [str(d) for d in range(10)] and len(base) == 500
    view = build_dataset('sklearn_digits', split='train', subset=64)
    assert len(view) == 64 and view.classes == classes


def test_digits_without_sklearn_is_a_dataset_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, 'sklearn', None)
    monkeypatch.setitem(sys.modules, 'sklearn.datasets', None)
    with pytest.raises(FileNotFoundError, match=r"pip install 'timm_patchmix\[study\]'"):
        SklearnDigits('train')
    with pytest.raises(SystemExit) as info:
        train_main(TINY + DIGITS + ['--model', 'resnet32_cifar', '--output', str(tmp_path)])
    msg = str(info.value.code)
    assert msg.startswith('error: --dataset sklearn_digits') and "pip install 'timm_patchmix[study]'" in msg
    assert os.listdir(tmp_path) == []


# --- a source model and its export --------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def source(tmp_path_factory):
    """A patchhead_resnet32_cifar trained one epoch on the embedded patchshapes data (10 classes), and its Hub
    folder."""
    from timm_patchmix.hub import export_folder
    root = tmp_path_factory.mktemp('source')
    train_main(TINY + ['--dataset', '', '--model', 'patchhead_resnet32_cifar', '--patchmix', '--output', str(root),
                       '--experiment', 'src'])
    ckpt = str(root / 'src' / 'last.safetensors')
    folder = export_folder(ckpt, str(root / 'hub'))
    return ckpt, folder, load_weights(ckpt)[0]


def built(argv):
    cfg = parse_config(argv)
    cfg = dataclasses.replace(cfg, arch=resolve_arch(cfg.model))
    seed_all(cfg.seed)
    model, _ = build_model(cfg, 10)
    return model


@pytest.mark.parametrize('how', ['initial-checkpoint', 'local-dir'])
def test_reset_head_changes_only_the_heads(source, how):
    ckpt, folder, weights = source
    argv = DIGITS + (['--model', 'patchhead_resnet32_cifar', '--initial-checkpoint', ckpt] if how != 'local-dir'
                     else ['--model', f'local-dir:{folder}', '--pretrained'])
    kept = built(argv).state_dict()  # the same class count: timm keeps the loaded head
    assert kept.keys() == weights.keys() and all(torch.equal(kept[k], weights[k]) for k in weights)
    reset = built(argv + ['--reset-head']).state_dict()
    assert reset.keys() == weights.keys()
    for k in weights:
        if is_head(k):
            assert not torch.equal(reset[k], weights[k]), k
        else:
            assert torch.equal(reset[k], weights[k]), k


def test_reset_head_needs_loaded_weights():
    with pytest.raises(ConfigError, match='--reset-head'):
        parse_config(DIGITS + ['--model', 'resnet32_cifar', '--reset-head'])


def test_freeze_for_linear_probe_modes():
    from timm_patchmix.engine.loop import Stepper
    cfg = parse_config(['--model', 'patchhead_resnet32_cifar', '--linear-probe'])
    cfg = dataclasses.replace(cfg, patch_head=True)
    model = timm.create_model('patchhead_resnet32_cifar', num_classes=10)
    frozen = freeze_for_linear_probe(cfg, model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(PATCHHEAD_HEADS)
    s = Stepper(model, None, None, cfg, torch.device('cpu'), frozen=frozen)
    s.train_mode()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and not any(m.training for m in bns)
    assert model.training and model.backbone.training and model.get_classifier().training
    assert model.get_patch_classifier().training
    # without the patch loss, the patch classifier gets no gradient and stays frozen
    model = timm.create_model('patchhead_resnet32_cifar', num_classes=10)
    freeze_for_linear_probe(dataclasses.replace(cfg, no_patch_loss=True), model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(PATCHHEAD_HEADS[:2])
    # the optimizer holds the trainable parameters only
    from timm_patchmix.engine.run import _optimization
    full = dataclasses.replace(cfg.with_recipe(), lr=0.1)
    optimizer, _, _ = _optimization(full, model, 2)
    held = {id(p) for g in optimizer.param_groups for p in g['params']}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}


def test_a_per_position_head_is_built_for_a_hub_model_too(source):
    """--per-position-head with a local-dir: model was dropped (the run recorded it, the model had a shared head):
    the folder's shared head then does not fit, named as one error line; --initial-checkpoint of its weights loads
    the rest and starts the per-position head fresh."""
    from timm_patchmix.engine.model import _model_kwargs
    ckpt, folder, weights = source
    cfg = parse_config(DIGITS + ['--model', f'local-dir:{folder}', '--pretrained', '--per-position-head'])
    assert _model_kwargs(dataclasses.replace(cfg, arch=resolve_arch(cfg.model)))['per_position'] is True
    with pytest.raises(TrainSetupError, match=r'^--model local-dir:.* --pretrained: .*model\.safetensors does not '
                                              r'fit .*the classifier heads differ'):
        built(DIGITS + ['--model', f'local-dir:{folder}', '--pretrained', '--per-position-head'])
    model = built(DIGITS + ['--model', 'patchhead_resnet32_cifar', '--per-position-head', '--initial-checkpoint',
                            os.path.join(folder, 'model.safetensors')])
    assert model.patch_head.per_position
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items() if not k.startswith('patch_head.'))


def test_an_initial_checkpoint_of_another_shape_is_one_error_line(tmp_path):
    """A trunk of another --in-chans: torch's size-mismatch traceback (strict=False does not spare it) is now an
    error naming the file and the tensor."""
    path = str(tmp_path / 'grey.safetensors')
    save_weights(path, timm.create_model('patchhead_resnet8_cifar', num_classes=10, in_chans=1).state_dict())
    with pytest.raises(TrainSetupError, match=r'^--initial-checkpoint: .*grey\.safetensors does not fit the model: '
                                              r'backbone\.conv1\.weight is \[16, 1, 3, 3\] in the file and '
                                              r'\[16, 3, 3, 3\] in the model'):
        built(DIGITS + ['--model', 'patchhead_resnet8_cifar', '--initial-checkpoint', path])


@pytest.mark.parametrize('name', ['resnet8_cifar', 'test_vit', 'test_convnext'])
def test_a_linear_probe_keeps_the_dropout_of_the_classifiers_input(name):
    """--drop under --linear-probe: the classifier's input dropout fires in training, whether the model applies it
    itself (timm's ResNets) or has a module for it beside the head (ViT's head_drop, ConvNeXt's head.drop, which
    were frozen with the trunk); the trunk's own dropout (ViT's pos_drop) does not."""
    from timm_patchmix.engine.loop import Stepper
    kwargs = dict(pos_drop_rate=0.5) if 'vit' in name else {}
    model = timm.create_model(name, num_classes=10, drop_rate=0.5, **kwargs)
    cfg = parse_config(['--model', name, '--linear-probe', '--drop', '0.5'])
    Stepper(model, None, None, cfg, torch.device('cpu'), frozen=freeze_for_linear_probe(cfg, model)).train_mode()
    torch.manual_seed(0)
    feats = model.forward_features(torch.randn(2, 3, *model.pretrained_cfg['input_size'][1:]))
    assert not torch.equal(model.forward_head(feats), model.forward_head(feats))  # the input dropout fires
    if 'vit' in name:
        assert not model.pos_drop.training and model.head_drop.training


@pytest.fixture(scope='module')
def probe(source, tmp_path_factory):
    """One epoch of --linear-probe --reset-head on the digits, from the exported folder."""
    ckpt, folder, weights = source
    root = tmp_path_factory.mktemp('probe')
    flags = DIGITS + PROBE + ['--model', f'local-dir:{folder}', '--pretrained', '--reset-head', '--linear-probe']
    res = train(parse_config(TINY + flags + ['--output', str(root), '--experiment', 'p']))
    return root, flags, res


def test_linear_probe_trains_only_the_heads(source, probe):
    ckpt, folder, weights = source
    root, flags, res = probe
    assert res.config.data_config.input_size == (3, 32, 32)  # the 8x8 digits at the model's size, 3 channels
    after, meta = load_weights(res.last_path)
    assert meta['class_names'] == [str(d) for d in range(10)] and meta['data']['dataset'] == 'sklearn_digits'
    assert after.keys() == weights.keys()
    # every trunk tensor, BatchNorm running statistics and counters included, as exported
    for k in weights:
        if not is_head(k):
            assert torch.equal(after[k], weights[k]), k
    assert any(k.endswith('running_mean') for k in weights)
    # the heads are fresh (--reset-head) and trained: neither the source's nor their initial values
    start = built(TINY + flags).state_dict()
    for k in PATCHHEAD_HEADS:
        assert not torch.equal(after[k], weights[k]), k
        assert not torch.equal(after[k], start[k]), k
    for k in weights:
        if not is_head(k):
            assert torch.equal(start[k], weights[k]), k
    # the optimizer state covers the trainable heads only (SGD momentum buffers: 4 tensors)
    state = load_state(res.state_path)
    assert len(state['optimizer']['state']) == 4
    args = yaml.safe_load(open(os.path.join(res.output, 'args.yaml')))
    assert args['linear_probe'] is True and args['reset_head'] is True


def test_linear_probe_plain_model_keeps_batchnorm(tmp_path):
    """A plain model (no patch head), weights from --initial-checkpoint with non-trivial BatchNorm statistics."""
    torch.manual_seed(0)
    m = timm.create_model('resnet32_cifar', num_classes=10)
    sd = m.state_dict()
    for k, v in sd.items():
        if k.endswith('running_mean'):
            sd[k] = torch.randn_like(v) * 0.1
        elif k.endswith('running_var'):
            sd[k] = torch.rand_like(v) + 0.5
    init = str(tmp_path / 'init.safetensors')
    save_weights(init, sd, {})
    flags = ['--model', 'resnet32_cifar', '--initial-checkpoint', init, '--linear-probe', '--drop-path', '0.2',
             '--output', str(tmp_path), '--experiment', 'plain']
    res = train(parse_config(TINY + DIGITS + PROBE + flags))
    after, _ = load_weights(res.last_path)
    heads = ('fc.weight', 'fc.bias')
    for k in sd:
        if k in heads:
            assert not torch.equal(after[k], sd[k]), k
        else:
            assert torch.equal(after[k], sd[k]), k


@pytest.mark.parametrize('drop, expect', [
    ('--linear-probe', ('--linear-probe', 'True', 'False')),
    ('--reset-head', ('--reset-head', 'True', 'False')),
])
def test_resume_refuses_changed_transfer_flags(probe, drop, expect):
    root, flags, res = probe
    before = {f: open(os.path.join(res.output, f), 'rb').read() for f in sorted(os.listdir(res.output))}
    argv = BASE + ['--epochs', '2', '--resume', res.state_path] + [f for f in flags if f != drop]
    with pytest.raises(SettingsChangedError) as info:
        train_main(argv)
    assert f'{expect[0]}: {expect[1]} before, {expect[2]} now' in str(info.value)
    assert {f: open(os.path.join(res.output, f), 'rb').read() for f in sorted(os.listdir(res.output))} == before


def test_linear_probe_without_classifier_parameters():
    cfg = dataclasses.replace(parse_config(['--model', 'resnet32_cifar', '--linear-probe']), patch_head=False)
    with pytest.raises(TrainSetupError, match='--linear-probe'):
        freeze_for_linear_probe(cfg, timm.create_model('resnet32_cifar', num_classes=0))
