"""Hub folders out, and back through timm's real loaders: local-dir:, hf-hub: from a local HF cache (offline),
registered tags, plain-backbone export, fine-tuning to a new num_classes, the push path, and damaged files."""
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import timm
import timm_patchmix  # noqa: F401
from timm_patchmix import hub
from timm_patchmix.checkpoint import CheckpointError, load_weights
from timm_patchmix.data import PATCHSHAPES_CLASSES, PatchShapes
from timm_patchmix.guided import MaskTable, dataset_fingerprint
from timm_patchmix.models.pretrained import HUB_NAMESPACE, PATCHHEAD_PRETRAINED
from timm_patchmix.train import main as train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # the tree first
EXAMPLES = os.path.join(ROOT, 'timm_patchmix', 'weights')
TINY = ['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress', '--epochs', '1']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A guided patchhead checkpoint (a table is needed for the mask-table file in the folder)."""
    tmp = tmp_path_factory.mktemp('trained')
    rng = np.random.default_rng(0)
    pairs = [(0, 1), (2, 5), (3, 9)]
    table = MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), dataset_fingerprint('', PATCHSHAPES_CLASSES), pairs,
                      [rng.random((4, 4)) < 0.5 for _ in pairs], [0.25, 0.5, 0.125], 0.2917)
    table.save(str(tmp / 'masks.json'))
    res = train_main(TINY + ['--output', str(tmp), '--experiment', 'gpm', '--patchmix',
                             '--patchmix-table', str(tmp / 'masks.json')])
    return os.path.join(res['output'], 'best.safetensors'), str(tmp / 'masks.json')


def images(n=6, seed=0):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_export_folder_file_by_file_and_local_dir_round_trip(trained, tmp_path):
    ckpt, table = trained
    folder = str(tmp_path / 'repo')
    hub.export_folder(ckpt, folder, repo_id='someone/gpm-test')
    assert sorted(os.listdir(folder)) == ['README.md', 'config.json', 'masks.json', 'model.safetensors']
    ref, meta = hub.model_from_weights(ckpt)
    # weights: the patchhead state dict, exactly
    state = load_file(os.path.join(folder, 'model.safetensors'))
    assert state.keys() == ref.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    # config: timm's format, with what a reload needs
    cfg = json.load(open(os.path.join(folder, 'config.json')))
    assert cfg['architecture'] == 'patchhead_resnet32_cifar' and cfg['num_classes'] == 10
    assert cfg['label_names'] == list(PATCHSHAPES_CLASSES)
    assert cfg['model_args'] == {'grid': [4, 4], 'per_position': False, 'in_chans': 3}  # timm adds in_chans
    assert cfg['pretrained_cfg']['classifier'] == ['backbone.fc', 'patch_head.fc']
    assert cfg['pretrained_cfg']['mean'] == meta['data']['mean'] and cfg['pretrained_cfg']['std'] == meta['data']['std']
    assert cfg['pretrained_cfg']['input_size'] == meta['data']['input_size']
    assert cfg['timm_patchmix']['method'] == 'guided' and cfg['timm_patchmix']['mask_table'] == 'masks.json'
    assert cfg['timm_patchmix']['metrics']['epochs'] == 1
    # the mask table, byte for byte; the card names method, citation, command, metrics and the pairs
    assert open(os.path.join(folder, 'masks.json'), 'rb').read() == open(table, 'rb').read()
    card = open(os.path.join(folder, 'README.md')).read()
    for needle in ('Guided PatchMix', "hf-hub:someone/gpm-test", '@inproceedings{cascante2021patchmix',
                   meta['command'], '| epochs | final top-1 | highest top-1 |', 'disc + square', 'library_name: timm'):
        assert needle in card, needle
    # back through timm's local-dir: source
    model = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    assert model.grid == (4, 4) and model.pretrained_cfg['label_names'] == list(PATCHSHAPES_CLASSES)
    with torch.no_grad():
        assert torch.equal(model(images()), ref(images()))
        assert torch.equal(model.forward_patches(images()), ref.forward_patches(images()))
    # an existing folder is kept unless overwrite is asked for
    with pytest.raises(FileExistsError, match='overwrite'):
        hub.export_folder(ckpt, folder)
    hub.export_folder(ckpt, folder, overwrite=True)
    assert [f for f in os.listdir(tmp_path) if f.startswith('.hub-')] == []


def test_new_num_classes_reinitialises_both_heads(trained, tmp_path):
    folder = hub.export_folder(trained[0], str(tmp_path / 'repo'))
    ref, _ = hub.model_from_weights(trained[0])
    model = timm.create_model(f'local-dir:{folder}', pretrained=True, num_classes=3)
    assert model.num_classes == 3
    assert model.backbone.fc.weight.shape == (3, 64) and model.patch_head.fc.weight.shape == (3, 64)
    trunk = {k: v for k, v in ref.state_dict().items() if not k.startswith(('backbone.fc.', 'patch_head.fc.'))}
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in trunk.items())


def test_fine_tune_with_train_py_from_a_hub_folder(trained, tmp_path):
    """--pretrained from local-dir: and --initial-checkpoint from its model.safetensors, to a 3-class folder set."""
    folder = hub.export_folder(trained[0], str(tmp_path / 'repo'))
    data = tmp_path / 'three'
    for split, n in (('train', 16), ('validation', 6)):
        ds = PatchShapes(split, transform=lambda im: im)
        seen = {}
        for i in range(len(ds)):
            img, y = ds[i]
            if y < 3 and seen.get(y, 0) < n:
                seen[y] = seen.get(y, 0) + 1
                os.makedirs(data / split / ds.classes[y], exist_ok=True)
                img.save(data / split / ds.classes[y] / f'{i}.png')
            if sum(seen.values()) == 3 * n:
                break
    common = ['--data-dir', str(data), '--num-classes', '3', '--patchmix', '-b', '8', '-j', '0', '--epochs', '1',
              '--no-progress', '--output', str(tmp_path / 'ft')]
    res = train_main(common + ['--model', f'local-dir:{folder}', '--pretrained', '--experiment', 'pre'])
    state, meta = load_weights(os.path.join(res['output'], 'best.safetensors'))
    assert meta['model'] == 'patchhead_resnet32_cifar' and meta['num_classes'] == 3
    assert meta['model_kwargs'] == {'grid': [4, 4], 'per_position': False, 'in_chans': 3, 'drop_rate': 0.0}
    assert state['patch_head.fc.weight'].shape == (3, 64)
    reloaded, _ = hub.model_from_weights(os.path.join(res['output'], 'best.safetensors'))
    assert reloaded.num_classes == 3
    res2 = train_main(common + ['--model', 'patchhead_resnet32_cifar', '--initial-checkpoint',
                                os.path.join(folder, 'model.safetensors'), '--experiment', 'init'])
    assert len(res2['rows']) == 1


def test_plain_backbone_export_has_the_same_trunk(trained, tmp_path, caplog):
    folder = hub.export_folder(trained[0], str(tmp_path / 'repo'))
    ph = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    with caplog.at_level(logging.WARNING):
        plain = hub.load_backbone(f'local-dir:{folder}').eval()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert type(plain).__name__ == 'CifarResNet' and not hasattr(plain, 'patch_head')
    x = images()
    with torch.no_grad():
        assert torch.equal(plain.forward_features(x), ph.backbone.forward_features(x))
        assert torch.equal(plain(x), ph(x))  # the image head comes along
    assert plain.pretrained_cfg['mean'] == ph.pretrained_cfg['mean']
    assert hub.load_backbone(trained[0], num_classes=7).fc.weight.shape == (7, 64)
    # timm's own file overlay, from the exported plain state dict
    path = hub.export_backbone(f'local-dir:{folder}', str(tmp_path / 'plain.safetensors'))
    assert not any(k.startswith(('backbone.', 'patch_head.')) for k in load_file(path))
    with caplog.at_level(logging.WARNING):
        via_file = timm.create_model('resnet32_cifar', pretrained=True,
                                     pretrained_cfg_overlay=dict(file=path, num_classes=10)).eval()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    with torch.no_grad():
        assert torch.equal(via_file(x), ph(x))


def test_registered_tags():
    assert timm.list_pretrained('patchhead_*') == sorted(PATCHHEAD_PRETRAINED)
    for full in PATCHHEAD_PRETRAINED:
        cfg = timm.models.get_pretrained_cfg(full)
        assert os.path.isfile(cfg.file) and cfg.hf_hub_id is None and cfg.num_classes == 10
        assert tuple(cfg.classifier) == ('backbone.fc', 'patch_head.fc')
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=4)
    assert m.pretrained_cfg['architecture'] == 'patchhead_resnet32_cifar'


def test_backbone_tag_loads_the_backbones_timm_weights_under_a_fresh_patch_head(tmp_path):
    """A tag that is not a patchhead tag names the backbone's own timm weights: its hub id, and on loading the
    backbone gets exactly those weights (served here from a local file) while both heads start fresh."""
    from safetensors.torch import save_file
    for tag in ('a1_in1k', 'tv_in1k'):
        m = timm.create_model(f'patchhead_resnet18.{tag}', num_classes=4)
        assert m.pretrained_cfg['hf_hub_id'] == f'timm/resnet18.{tag}' and m.pretrained_cfg['tag'] == tag
        assert tuple(m.pretrained_cfg['classifier']) == ('backbone.fc', 'patch_head.fc')
    src = timm.create_model('resnet18', num_classes=1000)
    path = str(tmp_path / 'resnet18.safetensors')
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, path)
    torch.manual_seed(0)
    m = timm.create_model('patchhead_resnet18.tv_in1k', pretrained=True, num_classes=4,
                          pretrained_cfg_overlay=dict(file=path))
    got = m.backbone.state_dict()
    body = [k for k in src.state_dict() if not k.startswith('fc.')]
    assert body and all(torch.equal(got[k], src.state_dict()[k]) for k in body)
    assert m.backbone.fc.out_features == 4 and m.patch_head.fc.out_features == 4


@pytest.mark.parametrize('name', sorted(PATCHHEAD_PRETRAINED))
def test_example_checkpoints_match_their_tags_and_work(name):
    folder = os.path.join(EXAMPLES, name)
    cfg = json.load(open(os.path.join(folder, 'config.json')))
    tag = timm.models.get_pretrained_cfg(name)
    assert cfg['architecture'] == name.split('.')[0]
    for key in ('num_classes', 'input_size', 'mean', 'std', 'interpolation', 'crop_pct', 'first_conv'):
        assert tuple(np.atleast_1d(cfg['pretrained_cfg'][key])) == tuple(np.atleast_1d(getattr(tag, key))), key
    assert tuple(cfg['pretrained_cfg']['classifier']) == tuple(tag.classifier)
    model = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    if cfg['timm_patchmix']['dataset'] == 'patchshapes':  # real weights: they classify the embedded data
        ds = PatchShapes('validation')
        x = torch.stack([ds[i][0] for i in range(200)]).float() / 255
        y = torch.tensor([ds[i][1] for i in range(200)])
        mean, std = (torch.tensor(cfg['pretrained_cfg'][k]).view(1, 3, 1, 1) for k in ('mean', 'std'))
        with torch.no_grad():
            acc = (model((x - mean) / std).argmax(1) == y).float().mean().item()
        assert acc > 0.9, acc


HUB_SCRIPT = r'''
import json, sys, torch, timm
import timm_patchmix
from timm_patchmix.models import PatchheadWeightsError
out = {}
name = sys.argv[1]
m = timm.create_model(f'hf-hub:{name}', pretrained=True).eval()
out['source'] = m.pretrained_cfg.get('source')
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
ref = timm.create_model(f'local-dir:{sys.argv[2]}', pretrained=True).eval()
out['same_as_local_dir'] = bool(torch.equal(m(x), ref(x)))
tag = name.split('/')[1]
t = timm.create_model(tag, pretrained=True, num_classes=5)
out['tag_heads'] = [list(t.backbone.fc.weight.shape), list(t.patch_head.fc.weight.shape)]
out['tag_trunk_equal'] = bool(torch.equal(t.backbone.conv1.weight, m.backbone.conv1.weight))
try:
    timm.create_model('patchhead_resnet50.gpm_in1k', pretrained=True)
    out['in1k'] = 'loaded'
except PatchheadWeightsError as e:
    out['in1k'] = str(e)
print(json.dumps(out))
'''


def fake_hf_cache(cache, repo_id, folder, commit='0' * 40):
    """The layout huggingface_hub reads: models--org--name/{refs/main, snapshots/<commit>/<files>}."""
    base = os.path.join(cache, 'models--' + repo_id.replace('/', '--'))
    os.makedirs(os.path.join(base, 'refs'))
    with open(os.path.join(base, 'refs', 'main'), 'w') as f:
        f.write(commit)
    shutil.copytree(folder, os.path.join(base, 'snapshots', commit))


def load_from_a_fake_hub(tmp_path, repo, folder, preamble=''):
    """``timm.create_model('hf-hub:<repo>', pretrained=True)`` in a fresh process, offline, from a local Hub cache
    holding ``folder`` (after ``preamble``); it prints ``refused: <message>`` for a CheckpointError."""
    fake_hf_cache(str(tmp_path / 'cache'), repo, folder)
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_HUB_CACHE=str(tmp_path / 'cache'), HF_HOME=str(tmp_path / 'home'),
               PYTHONPATH=PYPATH)
    script = ('import sys, timm, timm_patchmix\n' + preamble +
              'from timm_patchmix.checkpoint import CheckpointError\n'
              'try:\n'
              '    timm.create_model("hf-hub:" + sys.argv[1], pretrained=True)\n'
              'except CheckpointError as e:\n'
              '    print("refused:", e)\n')
    return subprocess.run([sys.executable, '-c', script, repo], env=env, capture_output=True, text=True, timeout=300)


def test_hf_hub_from_a_local_cache_offline(tmp_path):
    name = 'patchhead_resnet32_cifar.rpm_patchshapes'
    repo = f'{HUB_NAMESPACE}/{name}'
    fake_hf_cache(str(tmp_path / 'cache'), repo, os.path.join(EXAMPLES, name))
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_HUB_CACHE=str(tmp_path / 'cache'), HF_HOME=str(tmp_path / 'home'),
               PYTHONPATH=PYPATH)
    r = subprocess.run([sys.executable, '-c', HUB_SCRIPT, repo, os.path.join(EXAMPLES, name)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out['source'] == 'hf-hub' and out['same_as_local_dir']
    assert out['tag_heads'] == [[5, 64], [5, 64]] and out['tag_trunk_equal']
    # the ImageNet recipe's names have no weights: a clear error before any Hub lookup
    assert 'not published' in out['in1k'] and 'docs/hub.md' in out['in1k']


def test_push_up_to_the_upload_call(trained, tmp_path, monkeypatch):
    import huggingface_hub
    calls = {}

    class Repo:
        repo_id = 'someone/gpm-test'

    def create_repo(self, repo_id, **kw):
        calls['create'] = (repo_id, kw)
        return Repo()

    def upload_folder(self, **kw):
        calls['upload'] = kw
        calls['files'] = {f: open(os.path.join(kw['folder_path'], f), 'rb').read()
                          for f in os.listdir(kw['folder_path'])}
        return 'commit-url'

    monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, 'upload_folder', upload_folder)
    folder = str(tmp_path / 'push')
    assert hub.push(trained[0], 'someone/gpm-test', folder=folder, token='hf_x') == 'commit-url'
    assert calls['create'] == ('someone/gpm-test', {'private': False, 'exist_ok': True})
    assert calls['upload']['repo_id'] == 'someone/gpm-test' and calls['upload']['folder_path'] == folder
    assert sorted(calls['files']) == ['README.md', 'config.json', 'masks.json', 'model.safetensors']
    assert calls['files']['masks.json'] == open(trained[1], 'rb').read()
    # dry run: the folder only, no network; no token: a clear error, and the folder is still written
    calls.clear()
    assert hub.main(['push', '--checkpoint', trained[0], '--repo-id', 'someone/x', '--dry-run',
                     '--folder', str(tmp_path / 'dry')]) == 0
    assert not calls and os.path.isfile(tmp_path / 'dry' / 'model.safetensors')
    monkeypatch.setattr(huggingface_hub, 'get_token', lambda: None)
    with pytest.raises(RuntimeError, match='HF_TOKEN'):
        hub.push(trained[0], 'someone/x', folder=str(tmp_path / 'notoken'))
    assert os.path.isfile(tmp_path / 'notoken' / 'config.json')
    with pytest.raises(ValueError, match='user/name'):
        hub.push(trained[0], 'no-namespace', dry_run=True)


def test_damaged_files_and_unregistered_architectures(trained, tmp_path):
    folder = hub.export_folder(trained[0], str(tmp_path / 'repo'))
    weights = os.path.join(folder, 'model.safetensors')
    good = open(weights, 'rb').read()
    for damaged in (good[:len(good) // 2], good[:5], b'\xff' * 16 + good[16:]):
        with open(weights, 'wb') as f:
            f.write(damaged)
        with pytest.raises(CheckpointError, match='damaged or incomplete'):
            timm.create_model(f'local-dir:{folder}', pretrained=True)
    with open(weights, 'wb') as f:
        f.write(good)
    cfg_path = os.path.join(folder, 'config.json')
    cfg = json.load(open(cfg_path))
    json.dump(dict(cfg, architecture='patchhead_no_such_net'), open(cfg_path, 'w'))
    with pytest.raises(CheckpointError, match="'patchhead_no_such_net'.*not an architecture of the installed timm"):
        hub.load_model(f'local-dir:{folder}')
    with pytest.raises(SystemExit, match='unknown model .patchhead_no_such_net.'):
        train_main(TINY + ['--model', f'local-dir:{folder}', '--output', str(tmp_path / 'o')])
    for text in ('{"architecture": ', '{"architecture": ' + '[' * 200000 + ']' * 200000 + '}'):  # cut, too deep
        open(cfg_path, 'w').write(text)
        with pytest.raises(CheckpointError, match='not readable JSON'):
            hub.load_model(f'local-dir:{folder}')
    os.remove(cfg_path)
    with pytest.raises(CheckpointError, match='no config.json'):
        hub.load_model(f'local-dir:{folder}')


def test_without_import_timm_names_the_missing_architecture():
    """Without `import timm_patchmix` timm cannot know patchhead_*: its error names the architecture, and the
    folder's config.json carries the note that says what to import."""
    folder = os.path.join(EXAMPLES, 'patchhead_resnet32_cifar.rpm_patchshapes')
    code = f'import timm; timm.create_model("local-dir:{folder}", pretrained=True)'
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and 'patchhead_resnet32_cifar' in r.stderr
    assert 'import timm_patchmix' in json.load(open(os.path.join(folder, 'config.json')))['timm_patchmix']['note']


def test_card_of_a_held_out_run_states_the_protocol_and_the_test_numbers(tmp_path):
    res = train_main(TINY + ['--output', str(tmp_path), '--experiment', 'rpm', '--patchmix', '--holdout', '0.1',
                             '--test-subset', '30'])
    ckpt = os.path.join(res['output'], 'best.safetensors')
    results = json.load(open(os.path.join(res['output'], 'results.json')))
    folder = hub.export_folder(ckpt, str(tmp_path / 'repo'), repo_id='someone/rpm-test')
    card = open(os.path.join(folder, 'README.md')).read()
    test = results['test']
    assert 'Protocol: a fixed 10% of the training split (seed 0) was held out' in card
    assert f'{results["selection"]["images"]:,} of its images chose the best epoch' in card
    assert f'(`{test["split"]}`, {test["images"]:,} images)' in card
    assert (f'| 1 | {test["final"]["test_top1"]:.2f} | {test["best"]["test_top1"]:.2f} '
            f'(epoch {test["best"]["epoch"]}) |') in card
    assert "These weights are the best epoch's (epoch 0)." in card
    assert '| test top-1, final epoch (these weights) | test top-1, best held-out epoch (these weights) |' in card
    assert '| epochs | final top-1 | highest top-1 |' not in card
    cfg = json.load(open(os.path.join(folder, 'config.json')))
    assert cfg['timm_patchmix']['test_metrics']['final']['top1'] == test['final']['test_top1']
    assert 'tag' not in cfg['pretrained_cfg'] and 'origin_url' not in cfg['pretrained_cfg']
    # a damaged results.json is an error naming it, and nothing is exported
    with open(os.path.join(res['output'], 'results.json'), 'w') as f:
        f.write('{"selection": {"split": "holdout"}, "test": {"split": 3}}')
    from timm_patchmix.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match='results.json'):
        hub.export_folder(ckpt, str(tmp_path / 'repo2'))
    assert not os.path.exists(tmp_path / 'repo2')
    # held-out weights whose run has not written results.json yet (it has not ended): the protocol, no numbers
    os.remove(os.path.join(res['output'], 'results.json'))
    card = open(os.path.join(hub.export_folder(ckpt, str(tmp_path / 'repo_pending')), 'README.md')).read()
    assert 'was held out and never trained on, and chose the best epoch' in card
    assert 'has not written its test-split numbers' in card and 'no held-out split' not in card
    assert "These weights are epoch 0's." in card
    # a fresh run without --holdout into the same folder: the earlier run's results.json goes with its weights,
    # so the card of the new weights claims no held-out protocol
    (tmp_path / 'rpm' / 'results.json').write_text(json.dumps(results))
    (tmp_path / 'rpm' / 'fgsm.json').write_text('{}')
    train_main(TINY + ['--output', str(tmp_path), '--experiment', 'rpm', '--patchmix'])
    assert not (tmp_path / 'rpm' / 'results.json').exists() and not (tmp_path / 'rpm' / 'fgsm.json').exists()
    card = open(os.path.join(hub.export_folder(ckpt, str(tmp_path / 'repo3')), 'README.md')).read()
    assert 'Protocol: no held-out split' in card and 'was held out' not in card


def test_the_card_names_the_epoch_of_the_exported_weights(tmp_path):
    """The card says whose weights the folder holds: best.safetensors the best epoch's, last.safetensors the final
    epoch's (it said "the best epoch's" of whatever file was exported), each marked in the table's column."""
    from timm_patchmix.checkpoint import save_weights
    res = train_main(TINY[:-1] + ['2', '--output', str(tmp_path), '--experiment', 'ho', '--patchmix', '--holdout',
                                  '0.1', '--test-subset', '30'])
    results = json.load(open(os.path.join(res['output'], 'results.json')))
    best_epoch = results['test']['best']['epoch']
    cards = {}
    for name in ('best', 'last'):
        folder = hub.export_folder(os.path.join(res['output'], f'{name}.safetensors'), str(tmp_path / name))
        cards[name] = open(os.path.join(folder, 'README.md')).read()
    assert f"These weights are the best epoch's (epoch {best_epoch})." in cards['best']
    if best_epoch != 1:
        assert "These weights are the final epoch's (epoch 1)." in cards['last']
        assert '| test top-1, final epoch (these weights) | test top-1, best held-out epoch |' in cards['last']
        assert '| test top-1, final epoch | test top-1, best held-out epoch (these weights) |' in cards['best']
    # weights of another epoch (a --checkpoint-hist file): named, and neither column marked
    state, meta = load_weights(os.path.join(res['output'], 'last.safetensors'))
    other = str(tmp_path / 'ho' / 'checkpoint-7.safetensors')
    save_weights(other, state, dict(meta, epoch=7))
    card = open(os.path.join(hub.export_folder(other, str(tmp_path / 'other')), 'README.md')).read()
    assert "These weights are epoch 7's, neither the best nor the final one." in card and 'these weights)' not in card


def test_a_card_without_a_holdout_names_the_highest_top1_and_its_epoch(tmp_path):
    """Without a held-out split the card quotes summary.csv: the final epoch's top-1 and the highest one, with its
    epoch (it was headed "best top-1", though --eval-metric loss or top5 chooses the best epoch by other numbers)."""
    from timm_patchmix.hub.card import protocol_lines, read_summary
    rows = 'epoch,train_loss,eval_loss,eval_top1,eval_top5\n0,2,1.0,40.5,90\n1,1,0.8,61.25,95\n2,1,0.7,58.0,96\n'
    (tmp_path / 'summary.csv').write_text(rows)
    metrics = read_summary(str(tmp_path / 'best.safetensors'))
    assert metrics == {'epochs': 3, 'final_top1': 58.0, 'best_top1': 61.25, 'best_top1_epoch': 1, 'final_top5': 96.0}
    text = '\n'.join(protocol_lines(metrics, None, epoch=2))
    assert '| epochs | final top-1 | highest top-1 |' in text and '| 3 | 58.00 | 61.25 (epoch 1) |' in text
    assert "These weights are the final epoch's (epoch 2)." in text


def test_a_folder_written_by_timms_save_for_hf_loads_through_local_dir(tmp_path):
    ref = timm.create_model('resnet32_cifar', num_classes=7).eval()
    timm.models.save_for_hf(ref, str(tmp_path / 'plain'), safe_serialization=True)
    cfg = json.load(open(tmp_path / 'plain' / 'config.json'))
    assert cfg['model_args']['num_classes'] == 7  # timm writes it there too
    model = timm.create_model(f'local-dir:{tmp_path / "plain"}', pretrained=True).eval()
    with torch.no_grad():
        assert torch.equal(model(images()), ref(images()))
    cfg['model_args']['num_classes'] = 5  # disagrees with the root num_classes
    with open(tmp_path / 'plain' / 'config.json', 'w') as f:
        json.dump(cfg, f)
    from timm_patchmix.checkpoint import CheckpointError
    from timm_patchmix.engine.model import model_arch
    with pytest.raises(CheckpointError, match='model_args.num_classes 5 differs from num_classes 7'):
        model_arch(f'local-dir:{tmp_path / "plain"}')


def test_features_only_from_a_hub_folder_holds_its_trunk():
    """``features_only=True`` through ``local-dir:`` (whose config.json's model_args carry the patch head's grid)
    is the backbone's timm feature extractor with the folder's trunk, as through the tag."""
    folder = os.path.join(EXAMPLES, 'patchhead_resnet32_cifar.rpm_patchshapes')
    feats = timm.create_model(f'local-dir:{folder}', pretrained=True, features_only=True).eval()
    whole = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    fresh = timm.create_model('patchhead_resnet32_cifar', features_only=True).eval()
    x = images(2)
    with torch.no_grad():
        assert torch.equal(feats(x)[-1], whole.forward_features(x))  # the folder's trunk, tap by tap
        assert not torch.equal(fresh(x)[-1], feats(x)[-1])


def test_weights_are_read_from_safetensors_only(tmp_path, monkeypatch):
    """A folder, a Hub repo or a file that holds the weights only in a pickle format is refused by name; nothing
    is unpickled (timm's own loaders would fall back to pytorch_model.bin or torch.load a .pth)."""
    name = 'patchhead_resnet32_cifar.rpm_patchshapes'
    folder = tmp_path / 'pickled'
    shutil.copytree(os.path.join(EXAMPLES, name), folder)
    state = load_file(str(folder / 'model.safetensors'))
    os.remove(folder / 'model.safetensors')
    torch.save(state, folder / 'pytorch_model.bin')
    torch.save(state, tmp_path / 'weights.pth')

    def no_unpickling(*args, **kwargs):
        raise AssertionError(f'torch.load({args}, {kwargs}) was called')
    monkeypatch.setattr(torch, 'load', no_unpickling)
    with pytest.raises(CheckpointError, match='holds no model.safetensors: weights are read from safetensors only'):
        timm.create_model(f'local-dir:{folder}', pretrained=True)
    with pytest.raises(CheckpointError, match='holds no model.safetensors'):
        timm.create_model(f'local-dir:{folder}', pretrained=True, features_only=True)
    with pytest.raises(CheckpointError, match=r'weights.pth is not a .safetensors file'):
        timm.create_model('patchhead_resnet32_cifar', pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / 'weights.pth')))
    # a Hub repo (from a local cache, offline) whose only weights are pytorch_model.bin
    r = load_from_a_fake_hub(tmp_path, f'{HUB_NAMESPACE}/pickled-only', str(folder),
                             'import torch\ntorch.load = lambda *a, **k: sys.exit("torch.load was called")\n')
    assert r.returncode == 0 and (  # (huggingface_hub's own words, which asked to check the connection, before)
        f'refused: {HUB_NAMESPACE}/pickled-only: its model.safetensors could not be fetched (it is not in the local '
        f'cache and the Hub could not be reached): weights are read from safetensors only' in r.stdout), \
        r.stdout + r.stderr[-2000:]


def test_a_checkpoint_whose_shapes_do_not_fit_its_metadata_is_a_checkpoint_error(trained, tmp_path):
    state, meta = load_weights(trained[0])
    meta['model_kwargs'] = dict(meta.get('model_kwargs') or {}, in_chans=1)  # the stem was trained on 3 channels
    bad = str(tmp_path / 'bad.safetensors')
    from timm_patchmix.checkpoint import save_weights
    save_weights(bad, state, meta)
    with pytest.raises(CheckpointError, match=r'(?s)bad.safetensors does not fit patchhead_resnet32_cifar as its '
                                              r'metadata describes it: .*size mismatch for backbone.conv1.weight'):
        hub.model_from_weights(bad)


# --- class counts, strict fine-tuning loads, tensor kinds, backbone overlays, config.json fields ------------------
def small_folder(tmp_path, arch='patchhead_resnet8_cifar', num_classes=7, name='repo'):
    """A correct export of an untrained ``arch`` with ``num_classes`` classes: (model, checkpoint, folder)."""
    from timm_patchmix.checkpoint import save_weights
    torch.manual_seed(0)
    model = timm.create_model(arch, num_classes=num_classes).eval()
    os.makedirs(tmp_path / f'{name}-run', exist_ok=True)
    ckpt = str(tmp_path / f'{name}-run' / 'best.safetensors')
    save_weights(ckpt, model.state_dict(), {'model': arch, 'num_classes': num_classes,
                                            'model_kwargs': {'grid': [4, 4]}})
    return model, ckpt, hub.export_folder(ckpt, str(tmp_path / name))


def same_state(got, ref):
    return got.keys() == ref.keys() and all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in ref.items())


@pytest.mark.parametrize('arch,num_classes', [('patchhead_resnet8_cifar', 7), ('patchhead_resnet18', 10)])
def test_a_folder_whose_class_count_is_not_the_architectures_default_loads_its_trained_heads(tmp_path, arch,
                                                                                             num_classes):
    """The config.json's num_classes with the exported heads, bit for bit, through every loader (as plain timm does
    for its own local-dir folders); an explicit other num_classes is the fine-tune path: trunk loaded, heads fresh."""
    ref, _, folder = small_folder(tmp_path, arch, num_classes)
    src = f'local-dir:{folder}'
    for model in (timm.create_model(src, pretrained=True), hub.load_model(src)):
        assert model.num_classes == num_classes and model.patch_head.fc.out_features == num_classes
        assert same_state(model.state_dict(), ref.state_dict())
    plain = hub.load_backbone(src)
    assert plain.num_classes == num_classes and same_state(plain.state_dict(), ref.backbone.state_dict())
    path = hub.export_backbone(src, str(tmp_path / 'plain.safetensors'))
    state, meta = load_weights(path)
    assert meta['num_classes'] == num_classes and same_state(state, ref.backbone.state_dict())
    feats = timm.create_model(src, pretrained=True, features_only=True).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(feats(x)[-1], ref.forward_features(x))
    heads = ('backbone.fc.', 'patch_head.fc.')
    trunk = {k: v for k, v in ref.state_dict().items() if not k.startswith(heads)}
    tuned = timm.create_model(src, pretrained=True, num_classes=3)
    got = tuned.state_dict()
    assert tuned.num_classes == 3 and got['backbone.fc.weight'].shape[0] == got['patch_head.fc.weight'].shape[0] == 3
    assert same_state({k: v for k, v in got.items() if not k.startswith(heads)}, trunk)


def test_fine_tuning_refuses_a_weights_file_that_is_not_the_models(tmp_path):
    """On the new-num_classes path only the two classifier heads may be absent: a file missing any other tensor,
    or holding tensors the model lacks, is a CheckpointError naming the file and the keys."""
    ref, _, folder = small_folder(tmp_path)
    weights = os.path.join(folder, 'model.safetensors')
    good = load_file(weights)
    from safetensors.torch import save_file
    other = timm.create_model('patchhead_resnet20_cifar', num_classes=7).state_dict()
    for label, state, needle in (
            ('x only', {'x': torch.zeros(3)}, r"missing 54 tensors \['backbone.conv1.weight'.*unexpected 1 tensors "
                                              r"\['x'\]"),
            ('heads only', {k: v for k, v in good.items() if k.startswith(('backbone.fc.', 'patch_head.fc.'))},
             r"missing 54 tensors \['backbone.conv1.weight'"),
            ('another architecture', other, r"missing 0 tensors \[\], unexpected 72 tensors \['backbone.stages.0.1."),
            ('one trunk tensor less', {k: v for k, v in good.items() if k != 'backbone.bn1.running_var'},
             r"missing 1 tensors \['backbone.bn1.running_var'\], unexpected 0")):
        save_file({k: v.contiguous() for k, v in state.items()}, weights)
        for load in (lambda: timm.create_model(f'local-dir:{folder}', pretrained=True, num_classes=5),
                     lambda: hub.load_model(f'local-dir:{folder}', num_classes=5)):
            with pytest.raises(CheckpointError, match=rf'(?s){weights} does not fit patchhead_resnet8_cifar '
                                                      rf'\(fine-tuning to 5 classes.*{needle}'):
                load()
    # the trunk alone is a valid fine-tuning source, and loads exactly; with the file's class count it is not
    save_file({k: v for k, v in good.items() if not k.startswith(('backbone.fc.', 'patch_head.fc.'))}, weights)
    tuned = timm.create_model(f'local-dir:{folder}', pretrained=True, num_classes=5)
    trunk = {k: v for k, v in good.items() if not k.startswith(('backbone.fc.', 'patch_head.fc.'))}
    assert all(torch.equal(tuned.state_dict()[k], v) for k, v in trunk.items())
    with pytest.raises(CheckpointError, match=r"missing 4 tensors \['backbone.fc.weight'"):
        timm.create_model(f'local-dir:{folder}', pretrained=True)


def test_integer_or_boolean_tensors_are_not_cast_into_float_parameters(tmp_path):
    """A weights file whose float parameter is stored as an integer or boolean tensor is refused, naming the file,
    the tensor and its dtype, by every load path; float16 into float32 passes, integer buffers stay integer."""
    from safetensors.torch import save_file
    from timm_patchmix.engine.model import load_initial_checkpoint
    ref, ckpt, folder = small_folder(tmp_path)
    weights = os.path.join(folder, 'model.safetensors')
    good = load_file(weights)
    state, meta = load_weights(ckpt)
    from timm_patchmix.checkpoint import save_weights
    for dtype in (torch.int32, torch.bool):
        bad = dict(good, **{'backbone.conv1.weight': good['backbone.conv1.weight'].to(dtype)})
        save_file(bad, weights)
        what = str(dtype).replace('torch.', '')
        needle = rf'{{}}: the tensor backbone.conv1.weight is {what}, and the model.s backbone.conv1.weight is float32'
        for kw in ({}, {'num_classes': 5}):
            with pytest.raises(CheckpointError, match=needle.format(weights)):
                timm.create_model(f'local-dir:{folder}', pretrained=True, **kw)
        path = str(tmp_path / f'bad-{what}.safetensors')
        save_weights(path, dict(state, **{'backbone.conv1.weight': state['backbone.conv1.weight'].to(dtype)}), meta)
        with pytest.raises(CheckpointError, match=needle.format(path)):
            hub.model_from_weights(path)
        with pytest.raises(CheckpointError, match=needle.format(path)):
            load_initial_checkpoint(timm.create_model('patchhead_resnet8_cifar', num_classes=7), path)
    # a float num_batches_tracked would be truncated into the integer buffer: refused as well
    save_file(dict(good, **{'backbone.bn1.num_batches_tracked': torch.tensor(1.5)}), weights)
    with pytest.raises(CheckpointError, match='backbone.bn1.num_batches_tracked is float32, and the model.s '
                                              'backbone.bn1.num_batches_tracked is int64'):
        timm.create_model(f'local-dir:{folder}', pretrained=True)
    # float16 weights widen into float32; the integer buffers stay integer
    save_file({k: v.half() if v.is_floating_point() else v for k, v in good.items()}, weights)
    model = timm.create_model(f'local-dir:{folder}', pretrained=True)
    got = model.state_dict()
    assert all(torch.equal(got[k], v.half().float()) for k, v in good.items() if v.is_floating_point())
    assert got['backbone.bn1.num_batches_tracked'].dtype == torch.int64


def test_a_backbone_weights_file_named_in_the_overlay_is_read_from_safetensors_only(tmp_path, monkeypatch):
    """``patchhead_<arch>`` with no weights of its own and a ``file`` in the overlay: a .pth is refused without
    unpickling it, and a damaged .safetensors is a CheckpointError naming it (features_only alike)."""
    plain = timm.create_model('resnet8_cifar', num_classes=10)
    torch.save(plain.state_dict(), str(tmp_path / 'backbone.pth'))
    from safetensors.torch import save_file
    save_file(plain.state_dict(), str(tmp_path / 'backbone.safetensors'))
    data = open(tmp_path / 'backbone.safetensors', 'rb').read()
    with open(tmp_path / 'cut.safetensors', 'wb') as f:
        f.write(data[:len(data) // 2])

    def no_unpickling(*args, **kwargs):
        raise AssertionError(f'torch.load({args}, {kwargs}) was called')
    monkeypatch.setattr(torch, 'load', no_unpickling)
    for extra in ({}, {'features_only': True}):
        for name in ('patchhead_resnet8_cifar', 'patchhead_resnet18.a1_in1k'):
            with pytest.raises(CheckpointError, match=r'backbone.pth is not a .safetensors file: weights are read '
                                                      r'from safetensors only'):
                timm.create_model(name, pretrained=True, **extra,
                                  pretrained_cfg_overlay=dict(file=str(tmp_path / 'backbone.pth'), num_classes=10))
        with pytest.raises(CheckpointError, match=rf'{tmp_path / "cut.safetensors"} are damaged or incomplete'):
            timm.create_model('patchhead_resnet8_cifar', pretrained=True, **extra,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'cut.safetensors'), num_classes=10))
    m = timm.create_model('patchhead_resnet8_cifar', pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / 'backbone.safetensors'), num_classes=10))
    assert same_state(m.backbone.state_dict(), plain.state_dict())


@pytest.mark.parametrize('field,value,message', [
    ('model_args', None, 'model_args must be an object (a dict), got None'),
    ('pretrained_cfg', None, 'pretrained_cfg must be an object (a dict), got None'),
    ('pretrained_cfg.classifier', 5, 'pretrained_cfg.classifier must be a module name or a non-empty list of module '
                                     'names, got 5'),
    ('pretrained_cfg.mean', 'abc', "pretrained_cfg.mean must be a non-empty list of numbers, got 'abc'"),
    ('pretrained_cfg.std', [0.2, 0, 0.2], 'pretrained_cfg.std must be positive numbers, got [0.2, 0, 0.2]'),
    ('pretrained_cfg.std', [], 'pretrained_cfg.std must be a non-empty list of numbers, got []'),
    ('pretrained_cfg.input_size', [3, 32], 'pretrained_cfg.input_size must be [channels, height, width]'),
    ('pretrained_cfg.crop_pct', 'full', "pretrained_cfg.crop_pct must be a finite number >= 0.0, got 'full'"),
    ('pretrained_cfg.interpolation', 'foo', "pretrained_cfg.interpolation must be one of nearest, bilinear, bicubic, "
                                            "box, hamming, lanczos, got 'foo'"),
    ('pretrained_cfg.custom_load', True, 'pretrained_cfg.custom_load must be false'),
])
def test_bad_config_fields_are_checkpoint_errors_naming_the_field(tmp_path, field, value, message):
    """Through hub.load_model and train.py's --model local-dir: (engine.model.resolve_arch), and timm.create_model
    wherever the package's code runs first (timm's own reader fails on a null model_args/pretrained_cfg before)."""
    import re
    from timm_patchmix.engine.errors import TrainSetupError
    from timm_patchmix.engine.model import resolve_arch
    _, _, folder = small_folder(tmp_path, num_classes=10)
    path = os.path.join(folder, 'config.json')
    cfg = json.load(open(path))
    top, _, sub = field.partition('.')
    if sub:
        cfg[top][sub] = value
    else:
        cfg[top] = value
    json.dump(cfg, open(path, 'w'))
    expected = re.escape(f'{folder}: config.json: {message}')
    with pytest.raises(CheckpointError, match=expected):
        hub.load_model(f'local-dir:{folder}')
    with pytest.raises(TrainSetupError, match=expected):
        resolve_arch(f'local-dir:{folder}')
    if sub:
        with pytest.raises(CheckpointError, match=expected):
            timm.create_model(f'local-dir:{folder}', pretrained=True)


def test_a_checkpoint_loads_with_the_data_config_it_was_trained_with(tmp_path):
    """``model_from_weights`` (and so ``load_backbone``, ``export_backbone`` and every tool that loads a
    checkpoint) gives the model the input size and normalisation its checkpoint records, so timm's
    ``resolve_model_data_config`` preprocesses as the training did (it gave the architecture's defaults)."""
    from timm.data import resolve_model_data_config
    from timm_patchmix.checkpoint import save_weights
    model = timm.create_model('patchhead_resnet8_cifar', num_classes=10)
    data = {'dataset': '', 'input_size': [3, 48, 48], 'mean': [0.5, 0.5, 0.5], 'std': [0.25, 0.25, 0.25],
            'interpolation': 'bicubic', 'crop_pct': 1.0}
    path = str(tmp_path / 'best.safetensors')
    save_weights(path, model.state_dict(), {'model': 'patchhead_resnet8_cifar', 'num_classes': 10,
                                            'model_kwargs': {}, 'data': data})
    want = {'input_size': (3, 48, 48), 'mean': (0.5, 0.5, 0.5), 'std': (0.25, 0.25, 0.25),
            'interpolation': 'bicubic', 'crop_pct': 1.0}
    loaded, _ = hub.model_from_weights(path)
    plain = hub.load_backbone(path)
    for m in (loaded, plain):
        got = resolve_model_data_config(m)
        assert {k: got[k] for k in want} == want
    assert loaded.pretrained_cfg['architecture'] == 'patchhead_resnet8_cifar'  # the rest of the cfg stays
    out = hub.export_backbone(path, str(tmp_path / 'plain.safetensors'))
    assert {k: load_weights(out)[1]['data'][k] for k in ('input_size', 'mean', 'std')} == \
        {'input_size': [3, 48, 48], 'mean': [0.5] * 3, 'std': [0.25] * 3}
    # the Hub folder says the same, so a model from it resolves alike
    folder = hub.export_folder(path, str(tmp_path / 'repo'))
    got = resolve_model_data_config(timm.create_model(f'local-dir:{folder}', pretrained=True))
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in got.items() if k in want} == want


def test_weights_name_their_own_classes_and_a_greyscale_runs_normalisation(tmp_path):
    """patchhead_resnet32_cifar's default cfg is its registered Fashion-MNIST tag's: a model from other weights
    (here 4 patchshapes classes, greyscale) reported the tag's class names and count, license and source, and the
    folder's config.json said both. And a greyscale run's file, which recorded the model's three means and stds (it
    normalised with their averages), made an export fail in timm's data config check."""
    from timm.data import resolve_model_data_config
    from timm_patchmix.checkpoint import save_weights
    model = timm.create_model('patchhead_resnet32_cifar', num_classes=4, in_chans=1)
    mean, std = [0.4914, 0.4822, 0.4465], [0.247, 0.2435, 0.2616]
    data = {'dataset': '', 'input_size': [1, 32, 32], 'mean': mean, 'std': std, 'interpolation': 'bilinear',
            'crop_pct': 1.0}
    path = str(tmp_path / 'best.safetensors')
    names = tuple(PATCHSHAPES_CLASSES[:4])
    save_weights(path, model.state_dict(), {'model': 'patchhead_resnet32_cifar', 'num_classes': 4,
                                            'model_kwargs': {'in_chans': 1}, 'data': data,
                                            'class_names': list(names)})
    loaded, _ = hub.model_from_weights(path)
    assert loaded.pretrained_cfg['label_names'] == names and loaded.pretrained_cfg['num_classes'] == 4
    assert not {'tag', 'license', 'origin_url', 'hf_hub_id'} & set(loaded.pretrained_cfg)
    got = resolve_model_data_config(loaded)
    assert got['mean'] == pytest.approx((sum(mean) / 3,)) and got['std'] == pytest.approx((sum(std) / 3,))
    folder = hub.export_folder(path, str(tmp_path / 'repo'))
    with open(os.path.join(folder, 'config.json')) as f:
        config = json.load(f)
    assert config['label_names'] == list(names) and config['pretrained_cfg']['label_names'] == list(names)
    assert config['num_classes'] == config['pretrained_cfg']['num_classes'] == 4
    card = open(os.path.join(folder, 'README.md')).read()  # the card says the same normalisation
    assert f'mean [{sum(mean) / 3}]' in card
    assert config['pretrained_cfg']['mean'] == pytest.approx([sum(mean) / 3]) and 'license' not in \
        config['pretrained_cfg']
    again = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(x), loaded(x))
    assert tuple(again.pretrained_cfg['label_names']) == names
    assert resolve_model_data_config(again)['mean'] == pytest.approx((sum(mean) / 3,))


def test_the_backbone_of_a_model_built_with_create_patchhead_keeps_its_build_arguments():
    """``load_backbone`` of a model made by ``create_patchhead`` (timm records the build arguments on its
    backbone only) builds the plain model with them: the same pooling, the same logits (it fell back to the
    architecture's defaults)."""
    from timm_patchmix import create_patchhead
    torch.manual_seed(0)
    model = create_patchhead('resnet8_cifar', num_classes=5, global_pool='max').eval()
    plain = hub.load_backbone(model).eval()
    assert plain.global_pool.pool_type == 'max'
    with torch.no_grad():
        x = images()
        assert torch.equal(plain(x), model(x))


def test_a_bit_flipped_in_a_hub_folders_weights_is_named_through_timms_loaders(trained, tmp_path):
    """model.safetensors carries the SHA-256 of its tensors: a copy with one flipped bit of a weight (valid as
    safetensors, so timm loaded it as other weights) is a CheckpointError naming the file, through local-dir:,
    hf-hub: (from a local cache, offline) and hub.model_from_weights; the intact folder loads."""
    folder = hub.export_folder(trained[0], str(tmp_path / 'repo'))
    weights = os.path.join(folder, 'model.safetensors')
    timm.create_model(f'local-dir:{folder}', pretrained=True)
    data = bytearray(open(weights, 'rb').read())
    data[-1] ^= 0x10
    with open(weights, 'wb') as f:
        f.write(bytes(data))
    with pytest.raises(CheckpointError, match=r'model\.safetensors is corrupt: its tensors differ .* and fetch it '
                                              r'again'):
        timm.create_model(f'local-dir:{folder}', pretrained=True)
    with pytest.raises(CheckpointError, match=r'model\.safetensors is corrupt'):
        hub.model_from_weights(weights)
    r = load_from_a_fake_hub(tmp_path, f'{HUB_NAMESPACE}/flipped', folder)
    assert r.returncode == 0 and 'refused: ' in r.stdout and 'model.safetensors is corrupt' in r.stdout, \
        r.stdout + r.stderr[-2000:]
    assert 'hf cache delete' in r.stdout


def test_export_and_push_say_what_ran_and_never_overwrite_their_input(trained, tmp_path, monkeypatch, capsys):
    """A Random PatchMix checkpoint exported with a table is still Random PatchMix (the card and config.json said
    Guided, and that it trained on the table); an image-folder run is named as such (it was called patchshapes);
    `hub backbone --output <its own source>` is refused (it replaced the checkpoint); a failed upload is one
    line naming the ready folder (a traceback)."""
    from timm_patchmix.checkpoint import load_weights, save_weights
    state, meta = load_weights(trained[0])
    rpm = str(tmp_path / 'rpm.safetensors')
    save_weights(rpm, state, dict(meta, patchmix=dict(meta['patchmix'], table=None),
                                  data=dict(meta['data'], dataset='', data_dir='/data/shapes')))
    folder = hub.export_folder(rpm, str(tmp_path / 'rpm_hub'), table=trained[1])
    card = open(os.path.join(folder, 'README.md')).read()
    cfg = json.load(open(os.path.join(folder, 'config.json')))
    assert 'trained with Random PatchMix on the image folder /data/shapes' in card
    assert 'trained with Guided PatchMix' not in card
    assert 'which it did not train on' in card and 'this model trained on' not in card
    assert cfg['timm_patchmix']['method'] == 'random' and cfg['timm_patchmix']['mask_table'] == 'masks.json'
    assert cfg['timm_patchmix']['dataset'] == 'the image folder /data/shapes'
    guided = hub.export_folder(trained[0], str(tmp_path / 'gpm_hub'))  # its own table: trained on it
    assert 'this model trained on' in open(os.path.join(guided, 'README.md')).read()
    # a copy of that table elsewhere (its recorded path moved) is known by its content; an edited one is not it
    doc = json.load(open(trained[1]))
    copy, edited = str(tmp_path / 'copy.json'), str(tmp_path / 'edited.json')
    shutil.copyfile(trained[1], copy)
    doc['pairs'][0]['score'] = 0.75
    json.dump(doc, open(edited, 'w'))
    assert load_weights(trained[0])[1]['patchmix']['table_sha256']
    moved = hub.export_folder(trained[0], str(tmp_path / 'moved_hub'), table=copy)
    assert 'this model trained on' in open(os.path.join(moved, 'README.md')).read()
    other = open(os.path.join(hub.export_folder(trained[0], str(tmp_path / 'edit_hub'), table=edited),
                              'README.md')).read()
    assert 'trained with Guided PatchMix' in other and 'which it did not train on (the table it trained on ' \
        'differs)' in other
    # the backbone onto its own source
    before = open(rpm, 'rb').read()
    assert hub.main(['backbone', rpm, '--output', rpm]) == 2
    assert 'is the checkpoint the backbone is read from' in capsys.readouterr().err
    assert open(rpm, 'rb').read() == before
    # an upload that fails
    import huggingface_hub

    def offline(self, repo_id, **kw):
        raise huggingface_hub.errors.OfflineModeIsEnabled('offline')
    monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', offline)
    assert hub.main(['push', '--checkpoint', trained[0], '--repo-id', 'someone/x', '--token', 'hf_x',
                     '--folder', str(tmp_path / 'up')]) == 1  # (the inputs were good: a failed run)
    err = capsys.readouterr().err
    assert 'error: the upload to someone/x failed (OfflineModeIsEnabled: offline); the folder is ready in ' in err
    assert os.path.isfile(tmp_path / 'up' / 'model.safetensors')


def test_export_checks_the_repo_id_its_card_names_and_backbone_names_a_missing_file(trained, tmp_path, capsys):
    """export took any --repo-id (the card's code then read hf-hub:not a repo), and its placeholder kept a folder
    name's spaces; backbone with a mistyped file path reached timm ("Unknown model", or a local-dir: hint)."""
    for bad in ('not a repo', 'me/a b', 'me/'):
        with pytest.raises(ValueError, match='repo_id'):
            hub.export_folder(trained[0], str(tmp_path / 'x'), repo_id=bad)
        assert not os.path.exists(tmp_path / 'x')
    assert hub.main(['export', '--checkpoint', trained[0], '--output', str(tmp_path / 'x'),
                     '--repo-id', 'not a repo']) == 2
    assert "error: repo_id must be \"user/name\"" in capsys.readouterr().err
    folder = hub.export_folder(trained[0], str(tmp_path / 'card model'))
    card = open(os.path.join(folder, 'README.md')).read()
    assert "hf-hub:<user>/card-model'" in card and 'card model' not in card.split('---')[1]
    for missing in ('runs/pm/bset.safetensors', 'nope.safetensors'):
        assert hub.main(['backbone', missing, '--output', str(tmp_path / 'b.safetensors')]) == 2
        err = capsys.readouterr().err
        assert f'error: {missing}: no such file (a source is a checkpoint file, hf-hub:<repo>' in err, err
    assert not os.path.exists(tmp_path / 'b.safetensors')
    (tmp_path / 'afile').write_text('x')  # an --output under a file: one error line (a WriteError traceback)
    assert hub.main(['backbone', trained[0], '--output', str(tmp_path / 'afile' / 'b.safetensors')]) == 1
    assert f'error: cannot write {tmp_path / "afile" / "b.safetensors"}: {tmp_path / "afile"} is a file, not a ' \
        f'folder' in capsys.readouterr().err  # (it said "File exists", of a file that was not there)


def test_the_placeholder_repo_id_is_one_the_hub_takes():
    """A folder name with "--", "..", a ".git" ending or over 96 characters made a placeholder push refuses."""
    from huggingface_hub.utils import validate_repo_id
    names = {'my model - v2': 'my-model-v2', 'a..b': 'a-b', 'repo.git': 'repo', 'a.git.git': 'a', '...': 'model',
             'hub/my-model/': 'my-model', 'x' * 120: 'x' * 64, 'a.-b_c': 'a-b_c'}
    for folder, name in names.items():
        assert hub._repo_name(folder) == name
        validate_repo_id('some-user/' + name)


def test_hub_fixes_method_repo_id_num_classes_and_a_plain_architecture(trained, tmp_path, monkeypatch):
    """config.json called a model trained without --patchmix "random" (its card: no PatchMix); push took 'me/' as a
    repo id and with --overwrite replaced output/hub itself, other exports in it; model_from_weights(num_classes=)
    failed in dict.update; a failed push said "push again" where the same command stops at the existing folder; a
    config.json of a plain architecture with a patch head's model_args ended in timm's TypeError."""
    res = train_main(TINY + ['--output', str(tmp_path), '--experiment', 'plain', '--model', 'patchhead_resnet8_cifar'])
    plain = os.path.join(res['output'], 'best.safetensors')
    folder = hub.export_folder(plain, str(tmp_path / 'plain_hub'))
    assert json.load(open(os.path.join(folder, 'config.json')))['timm_patchmix']['method'] == 'none'
    assert 'trained with no PatchMix' in open(os.path.join(folder, 'README.md')).read()

    monkeypatch.chdir(tmp_path)
    keep = hub.push(trained[0], 'me/keep', dry_run=True)
    for bad in ('me/', '/x', 'me/x/y', 'me/..', 'me/a b'):
        with pytest.raises(ValueError, match='repo_id'):
            hub.push(trained[0], bad, dry_run=True, overwrite=True)
        assert os.path.isfile(os.path.join(keep, 'model.safetensors')), bad  # the other export is untouched
    assert hub.main(['push', '--checkpoint', trained[0], '--repo-id', 'me/', '--dry-run', '--overwrite']) == 2
    assert sorted(os.listdir(tmp_path / 'output' / 'hub')) == ['keep']

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, 'get_token', lambda: None)
    with pytest.raises(RuntimeError, match='push again with --overwrite'):
        hub.push(trained[0], 'me/keep', overwrite=True)
    with pytest.raises(FileExistsError, match='--overwrite'):  # what the message says is needed
        hub.push(trained[0], 'me/keep')

    model, meta = hub.model_from_weights(trained[0], num_classes=10)
    assert model.num_classes == 10
    with pytest.raises(CheckpointError, match=r'weights for 10 classes; num_classes=5 cannot load them'):
        hub.model_from_weights(trained[0], num_classes=5)

    cfg_path = os.path.join(folder, 'config.json')
    cfg = json.load(open(cfg_path))
    json.dump(dict(cfg, architecture='resnet8_cifar'), open(cfg_path, 'w'))
    with pytest.raises(CheckpointError, match=r"names the architecture 'resnet8_cifar', which has no patch head, "
                                              r"but its model_args carry \['grid', 'per_position'\]"):
        hub.load_model(f'local-dir:{folder}')
    assert hub.main(['backbone', f'local-dir:{folder}', '--output', str(tmp_path / 'b.safetensors')]) == 2


def test_drop_zero_applies_to_a_hub_model_whose_config_records_a_rate(tmp_path):
    """timm's train.py passes --drop always; here a hub folder's recorded drop_rate (0.4) stayed at --drop 0 (the
    default), while args.yaml said 0.0."""
    res = train_main(TINY + ['--output', str(tmp_path), '--experiment', 'dr', '--model', 'patchhead_resnet8_cifar',
                             '--patchmix', '--drop', '0.4'])
    folder = hub.export_folder(os.path.join(res['output'], 'best.safetensors'), str(tmp_path / 'hub'))
    assert json.load(open(os.path.join(folder, 'config.json')))['model_args']['drop_rate'] == 0.4
    for extra, want in (([], 0.0), (['--drop', '0'], 0.0), (['--drop', '0.3'], 0.3),
                        (['--model-kwargs', 'drop_rate=0.2'], 0.2)):
        out = train_main(TINY + ['--output', str(tmp_path), '--experiment', f'ft{len(extra)}{want}', '--model',
                                 f'local-dir:{folder}', '--pretrained', '--patchmix'] + extra)
        _, meta = load_weights(os.path.join(out['output'], 'last.safetensors'))
        assert meta['model_kwargs']['drop_rate'] == want, extra


HUB_PICKLE_SCRIPT = r'''
import json, os, sys
import torch, timm, timm_patchmix
from safetensors.torch import load_file, save_file
from timm.models._hub import save_for_hf
from timm_patchmix.checkpoint import CheckpointError

pickles, safe = sys.argv[1], sys.argv[2]  # two Hub caches: repos with pickled weights only / with safetensors


def put(cache, repo, files):
    base = os.path.join(cache, 'models--' + repo.replace('/', '--'))
    snap = os.path.join(base, 'snapshots', '0' * 40)
    os.makedirs(snap)
    os.makedirs(os.path.join(base, 'refs'))
    open(os.path.join(base, 'refs', 'main'), 'w').write('0' * 40)
    for name, write in files.items():
        write(os.path.join(snap, name))


torch.manual_seed(0)
whole = timm.create_model('patchhead_resnet32_cifar', num_classes=7)
with torch.no_grad():
    for p in whole.parameters():
        p.fill_(0.25)
trunk = timm.create_model('resnet32_cifar', num_classes=10)
tiny = timm.create_model('test_resnet')
plain = timm.create_model('resnet8_cifar', num_classes=10)
vit = timm.create_model('vit_tiny_patch16_224', num_classes=21843)  # a tag with custom_load (an .npz url too)
r10 = timm.create_model('resnet10t')  # a tag with a pickled url beside its Hub repo
put(pickles, 'me/whole', {'pytorch_model.bin': lambda p: torch.save(whole.state_dict(), p)})
writers = ((pickles, lambda sd: (lambda p: torch.save(sd, p))), (safe, lambda sd: (lambda p: save_file(sd, p))))
for cache, write in writers:
    name = 'pytorch_model.bin' if cache == pickles else 'model.safetensors'
    put(cache, 'timm/test_resnet.r160_in1k', {name: write(tiny.state_dict())})
    put(cache, 'timm/vit_tiny_patch16_224.augreg_in21k', {name: write(vit.state_dict())})
    put(cache, 'timm/resnet10t.c3_in1k', {name: write(r10.state_dict())})
    save_for_hf(plain, os.path.join(cache, 'plain'), safe_serialization=cache == safe)  # config.json and weights
    put(cache, 'me/plain', {n: (lambda p, n=n: os.replace(os.path.join(cache, 'plain', n), p))
                            for n in ('config.json', name)})
put(safe, 'me/whole', {'model.safetensors': lambda p: save_file(whole.state_dict(), p)})
put(safe, 'me/trunk', {'model.safetensors': lambda p: save_file(trunk.state_dict(), p)})
save_file(plain.state_dict(), os.path.join(safe, 'plain.safetensors'))


def unpickled(*a, **k):
    sys.exit('torch.load was called')
torch.load = unpickled
out = {}
calls = {
    'overlay': lambda c: timm.create_model('patchhead_resnet32_cifar', pretrained=True, cache_dir=c,
                                           pretrained_cfg_overlay=dict(hf_hub_id='me/whole')),
    'cfg': lambda c: timm.create_model('patchhead_resnet8_cifar', pretrained=True, cache_dir=c,
                                       pretrained_cfg=dict(hf_hub_id='me/whole')),
    'tag': lambda c: timm.create_model('patchhead_test_resnet.r160_in1k', pretrained=True, cache_dir=c),
    'tag_features': lambda c: timm.create_model('patchhead_test_resnet.r160_in1k', pretrained=True,
                                                features_only=True, cache_dir=c),
    'load_model': lambda c: timm_patchmix.hub.load_model('hf-hub:me/plain', cache_dir=c),
    # (timm reads the Hub repo whatever file or state dict an overlay names; timm's other spellings of the prefix)
    'load_model_overlay': lambda c: timm_patchmix.hub.load_model('hf-hub:me/plain', cache_dir=c,
                                                                 pretrained_cfg_overlay=dict(file=os.path.join(
                                                                     safe, 'plain.safetensors'))),
    'load_model_hf_hub': lambda c: timm_patchmix.hub.load_model('hf_hub:me/plain', cache_dir=c),
    'load_model_upper': lambda c: timm_patchmix.hub.load_model('HF-HUB:me/plain', cache_dir=c),
    'load_backbone_hf_hub': lambda c: timm_patchmix.hub.load_backbone('hf_hub:me/plain', cache_dir=c),
    # a timm tag with custom_load=True: timm reads its Hub repo as any other's
    'custom_tag': lambda c: timm.create_model('patchhead_vit_tiny_patch16_224.augreg_in21k', pretrained=True,
                                              cache_dir=c),
}
for name, call in calls.items():
    try:
        call(pickles)
        out[name] = 'loaded'
    except CheckpointError as e:
        out[name] = str(e)
m = calls['overlay'](safe)  # a tagged architecture: the repo the caller names, not the tag's weights
out['overlay_whole'] = all(torch.equal(v, whole.state_dict()[k]) for k, v in m.state_dict().items())
out['overlay_classes'] = m.num_classes
m = timm.create_model('patchhead_resnet32_cifar', pretrained=True, cache_dir=safe,
                      pretrained_cfg_overlay=dict(hf_hub_id='me/trunk', num_classes=10))
out['trunk'] = all(torch.equal(v, trunk.state_dict()[k]) for k, v in m.backbone.state_dict().items())
m = calls['tag'](safe)
out['tag_loaded'] = all(torch.equal(v, tiny.state_dict()[k]) for k, v in m.backbone.state_dict().items())
out['tag_file'] = m.pretrained_cfg.get('hf_hub_filename')
m = calls['custom_tag'](safe)
out['custom_loaded'] = all(torch.equal(v, vit.state_dict()[k]) for k, v in m.backbone.state_dict().items())
print(json.dumps(out))
'''


def test_hub_repos_are_read_from_safetensors_only_and_a_named_repo_is_read(tmp_path):
    """An hf_hub_id a caller names (overlay or cfg), a timm tag's repo behind patchhead_<arch>.<tag> and a plain
    architecture's hf-hub: repo were read through timm, which unpickles pytorch_model.bin where a repo holds no
    safetensors; an overlay's hf_hub_id on an architecture with a tag of this package was ignored (the tag's file
    came first) while the model's cfg named the repo."""
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_HOME=str(tmp_path / 'home'), PYTHONPATH=PYPATH)
    r = subprocess.run([sys.executable, '-c', HUB_PICKLE_SCRIPT, str(tmp_path / 'pickles'), str(tmp_path / 'safe')],
                       env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    offline = ('its model.safetensors could not be fetched (it is not in the local cache and the Hub could not be '
               'reached): weights are read from safetensors only')
    for name, where in (('overlay', 'me/whole'), ('cfg', 'me/whole'), ('tag', 'timm/test_resnet.r160_in1k'),
                        ('tag_features', 'timm/test_resnet.r160_in1k'), ('load_model', 'hf-hub:me/plain'),
                        ('load_model_overlay', 'hf-hub:me/plain'), ('load_model_hf_hub', 'hf-hub:me/plain'),
                        ('load_model_upper', 'hf-hub:me/plain'), ('load_backbone_hf_hub', 'hf-hub:me/plain'),
                        ('custom_tag', 'timm/vit_tiny_patch16_224.augreg_in21k')):
        assert out[name] == f'{where}: {offline} (a pickle file such as .pth or .bin is never read)', (name, out)
    assert out['overlay_whole'] and out['overlay_classes'] == 7 and out['trunk']
    assert out['tag_loaded'] and out['tag_file'] == 'model.safetensors' and out['custom_loaded']
    # train.py --pretrained on a plain model: a timm tag (one with a pickled url beside its repo, one with
    # custom_load) and a plain hf-hub: folder; refused from the pickles, loaded from safetensors, under
    # TIMM_USE_OLD_CACHE too (which reads a cached url first: a url is never read now)
    for cache, old in (('pickles', '0'), ('safe', '1')):
        r = subprocess.run([sys.executable, '-c', BUILD_SCRIPT], capture_output=True, text=True, timeout=300,
                           cwd=str(tmp_path), env=dict(env, HF_HUB_CACHE=str(tmp_path / cache),
                                                       TIMM_USE_OLD_CACHE=old))
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        built = json.loads(r.stdout.strip().splitlines()[-1])
        if cache == 'safe':
            assert set(built.values()) == {'built'}, built
        else:
            for name, text in built.items():
                assert text.endswith(('weights are read from safetensors only (a pickle file such as .pth or .bin is '
                                      'never read)', "(a Hub repository's weights are read from its "
                                      'model.safetensors only, never from a pickle file such as pytorch_model.bin)')), \
                    (name, text)


BUILD_SCRIPT = r'''
import json, sys, torch, timm, timm_patchmix
from timm_patchmix.engine import TrainConfig, TrainSetupError
from timm_patchmix.engine.model import build_model


def unpickled(*a, **k):
    sys.exit('torch.load was called')
torch.load = unpickled
out = {}
for name in ('resnet10t.c3_in1k', 'vit_tiny_patch16_224.augreg_in21k', 'hf-hub:me/plain'):
    try:
        build_model(TrainConfig(model=name, pretrained=True).with_recipe(), 10)
        out[name] = 'built'
    except TrainSetupError as e:
        out[name] = str(e)
try:
    timm.create_model('patchhead_resnet10t.c3_in1k', pretrained=True)
    out['patchhead_resnet10t.c3_in1k'] = 'built'
except Exception as e:
    out['patchhead_resnet10t.c3_in1k'] = str(e)
print(json.dumps(out))
'''


def test_the_shipped_cards_say_which_head_never_trained():
    """The default tag's card showed a command with --no-patch-loss and said nothing of its patch head, which never
    trained (chance-level predictions through forward_patches); every shipped card says it as an export's does."""
    import re
    for name in sorted(os.listdir(EXAMPLES)):
        card = open(os.path.join(EXAMPLES, name, 'README.md'), encoding='utf-8').read()
        command = re.search(r'- command: `([^`]*)`', card).group(1).split()
        no_patch = '--no-patch-loss' in command or ('--patch-loss-weight' in command and float(
            command[command.index('--patch-loss-weight') + 1]) == 0)
        assert ('**Trained without the patch loss**' in card) == no_patch, name
        assert ('**Trained without the image loss**' in card) == ('--no-image-loss' in command), name
    assert '**Trained without the patch loss**' in open(os.path.join(
        EXAMPLES, 'patchhead_resnet32_cifar.gpm_fmnist', 'README.md'), encoding='utf-8').read()


def test_backbone_output_may_not_be_its_source_under_any_name(trained, tmp_path, capsys):
    """`hub backbone --output` onto its own source was refused for a file and an exact `local-dir:` only: named as
    `Local-Dir:`, an `hf-hub:` repo (its cached file) or a tag, the source's weights were replaced by the plain
    backbone's. Every name the source can have is resolved to the file it is read from now."""
    from timm_patchmix.hub.load import _source_files
    folder = hub.export_folder(trained[0], str(tmp_path / 'repo'))
    weights = os.path.join(folder, 'model.safetensors')
    before = open(weights, 'rb').read()
    for name in (f'Local-Dir:{folder}', f'LOCAL-DIR:{folder}'):
        assert hub.main(['backbone', name, '--output', weights]) == 2
        assert 'is the checkpoint the backbone is read from' in capsys.readouterr().err
        assert open(weights, 'rb').read() == before
    # a tag: the file shipped with the package (not written to here: the check is of the name's file)
    shipped = os.path.join(EXAMPLES, 'patchhead_resnet32_cifar.gpm_fmnist', 'model.safetensors')
    for tag in ('patchhead_resnet32_cifar.gpm_fmnist', 'patchhead_resnet32_cifar'):
        assert [os.path.realpath(p) for p in _source_files(tag)] == [os.path.realpath(shipped)]
    assert _source_files('patchhead_resnet10t.no_such_tag') == [] and _source_files(trained[0]) == [trained[0]]
    # an hf-hub: repo, from a local cache, offline: its cached model.safetensors
    fake_hf_cache(str(tmp_path / 'cache'), 'user/victim', folder)
    cached = os.path.join(tmp_path, 'cache', 'models--user--victim', 'snapshots', '0' * 40, 'model.safetensors')
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_HUB_CACHE=str(tmp_path / 'cache'), HF_HOME=str(tmp_path / 'home'),
               PYTHONPATH=PYPATH)
    for name in ('hf-hub:user/victim', 'hf_hub:user/victim'):
        r = subprocess.run([sys.executable, '-m', 'timm_patchmix.hub', 'backbone', name, '--output', cached],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and 'is the checkpoint the backbone is read from' in r.stderr, r.stderr[-2000:]
        assert open(cached, 'rb').read() == before
    r = subprocess.run([sys.executable, '-m', 'timm_patchmix.hub', 'backbone', 'hf-hub:user/victim', '--output',
                        str(tmp_path / 'plain.safetensors')], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and os.path.isfile(tmp_path / 'plain.safetensors'), r.stderr[-2000:]


def test_the_plain_backbone_keeps_the_class_names_of_its_classifier(trained, tmp_path):
    """load_backbone and `hub backbone` dropped the checkpoint's class names (docs/hub.md says a model loaded
    through them carries its own as label_names); a new class count starts a classifier without them."""
    from timm_patchmix.checkpoint import load_weights
    names = tuple(PATCHSHAPES_CLASSES)
    assert hub.model_from_weights(trained[0])[0].pretrained_cfg['label_names'] == names
    folder = hub.export_folder(trained[0], str(tmp_path / 'repo'))
    for source in (trained[0], f'local-dir:{folder}'):
        plain = hub.load_backbone(source)
        assert tuple(plain.pretrained_cfg['label_names']) == names and plain.num_classes == 10
        assert hub.load_backbone(source, num_classes=10).pretrained_cfg['label_names'] == names
        assert 'label_names' not in hub.load_backbone(source, num_classes=7).pretrained_cfg
    path = hub.export_backbone(trained[0], str(tmp_path / 'plain.safetensors'))
    meta = load_weights(path)[1]
    assert meta['class_names'] == list(names) and meta['num_classes'] == 10 and 'label_names' not in meta['data']


def test_a_search_state_is_named_as_such_by_every_loader(tmp_path):
    """A search state given to resume from was called model weights (and --initial-checkpoint, which that error
    advised, then listed the search cache's tensors as unexpected); the hub loaders said it carries no metadata.
    Each names it a search state now."""
    from timm_patchmix.checkpoint import load_state, save_bundle
    from timm_patchmix.engine.model import load_initial_checkpoint
    path = str(tmp_path / 'search_state.safetensors')
    save_bundle(path, {'cache.masks': torch.zeros(3, dtype=torch.int64)}, {'generation': 0}, kind='search_state')
    weights = re.escape(f'{path} is a search state (to resume search.py from), not model weights')
    with pytest.raises(CheckpointError, match=re.escape(f'{path} is a search state (to resume search.py from), '
                                                        f'not a training state to resume train.py from')):
        load_state(path)
    with pytest.raises(CheckpointError, match=weights):
        load_initial_checkpoint(timm.create_model('patchhead_resnet8_cifar', num_classes=7), path)
    for load in (hub.model_from_weights, hub.load_backbone):
        with pytest.raises(CheckpointError, match=weights):
            load(path)
    with pytest.raises(CheckpointError, match=weights):
        hub.export_backbone(path, str(tmp_path / 'plain.safetensors'))
    assert not os.path.exists(tmp_path / 'plain.safetensors')


def test_a_missing_table_given_to_export_is_named_as_the_callers(tmp_path):
    """A --table that does not exist was reported as the table the checkpoint trained with."""
    _, ckpt, _ = small_folder(tmp_path)
    missing = str(tmp_path / 'nowhere.json')
    with pytest.raises(CheckpointError, match=re.escape(f'the mask table {missing} given with --table (table=) '
                                                        f'does not exist')):
        hub.export_folder(ckpt, str(tmp_path / 'out'), table=missing)
    with pytest.raises(CheckpointError, match='given with --table .table=. is a folder, not a masks.json file'):
        hub.export_folder(ckpt, str(tmp_path / 'out'), table=str(tmp_path))
    assert not os.path.exists(tmp_path / 'out')


def test_backbone_export_replaces_an_existing_file_only_when_asked(tmp_path, capsys):
    """`export_backbone` replaced whatever file it was given without a word, a run's own state.safetensors or
    last.safetensors included (the resume then failed). An existing file is replaced only with overwrite=True
    (`--overwrite`), as `export` treats its folder; a folder is refused."""
    from timm_patchmix.checkpoint import load_weights, save_weights
    _, ckpt, _ = small_folder(tmp_path)
    run = os.path.dirname(ckpt)
    state = os.path.join(run, 'state.safetensors')
    save_weights(state, {'x': torch.zeros(2)}, {'kind': 'train_state'})
    before = open(state, 'rb').read()
    with pytest.raises(FileExistsError, match=re.escape(f'{state} exists; pass overwrite=True (--overwrite)')):
        hub.export_backbone(ckpt, state)
    assert hub.main(['backbone', ckpt, '--output', state]) == 2
    assert f'error: {state} exists; pass overwrite=True (--overwrite)' in capsys.readouterr().err
    assert open(state, 'rb').read() == before
    with pytest.raises(FileExistsError, match='is a folder; the backbone is written to a .safetensors file'):
        hub.export_backbone(ckpt, run)
    out = str(tmp_path / 'plain.safetensors')
    assert hub.main(['backbone', ckpt, '--output', out]) == 0
    assert hub.main(['backbone', ckpt, '--output', out]) == 2 and 'exists' in capsys.readouterr().err
    assert hub.main(['backbone', ckpt, '--output', out, '--overwrite']) == 0
    assert load_weights(out)[1]['model'] == 'resnet8_cifar'
    # overwrite never reaches the source itself
    with pytest.raises(CheckpointError, match='is the checkpoint the backbone is read from'):
        hub.export_backbone(ckpt, ckpt, overwrite=True)


@pytest.mark.parametrize('num_classes', [None, 5])
def test_a_training_state_named_as_the_weights_file_is_refused(trained, num_classes):
    """A run's state.safetensors given as `file=` loaded nothing (a logged warning of unexpected keys) under another
    class count, and was timm's raw error otherwise: it is no model's weights, and is named as a training state."""
    state = os.path.join(os.path.dirname(trained[0]), 'state.safetensors')
    kw = {} if num_classes is None else {'num_classes': num_classes}
    with pytest.raises(CheckpointError, match=re.escape(f'{state} is a training state (to --resume from), not model '
                                                        "weights: give the run's best.safetensors")):
        timm.create_model('patchhead_resnet32_cifar', pretrained=True, pretrained_cfg_overlay=dict(file=state), **kw)
    with pytest.raises(CheckpointError, match='is a training state'):
        hub.model_from_weights(state)


def test_a_search_state_named_as_the_weights_file_is_refused(tmp_path):
    from timm_patchmix.checkpoint import save_bundle
    path = str(tmp_path / 'search_state.safetensors')
    save_bundle(path, {'population': torch.zeros(4, 16)}, {'generation': 1}, kind='search_state')
    with pytest.raises(CheckpointError, match=re.escape(f'{path} is a search state (to resume search.py from), not '
                                                        'model weights')):
        timm.create_model('patchhead_resnet32_cifar', pretrained=True, pretrained_cfg_overlay=dict(file=path))


def test_a_per_position_head_is_refused_on_another_grid_of_as_many_cells(tmp_path, caplog):
    """A per-position patch head (one classifier per cell) of a 2x3 grid loaded into a 3x2 or 6x1 model, since only
    shapes were compared: cell k then classified another region of the image, silently. Every route that reads
    the recorded grid refuses it now, naming both grids; --initial-checkpoint starts that head fresh and says so
    (as it does a head of another shape); the same grid, or another class count, loads as before."""
    from timm_patchmix.checkpoint import save_weights
    from timm_patchmix.engine.model import load_initial_checkpoint
    torch.manual_seed(0)
    model = timm.create_model('patchhead_resnet8_cifar', num_classes=7, grid=(2, 3), per_position=True).eval()
    ckpt = str(tmp_path / 'best.safetensors')
    save_weights(ckpt, model.state_dict(), {'model': 'patchhead_resnet8_cifar', 'num_classes': 7,
                                            'model_kwargs': {'grid': [2, 3], 'per_position': True}})
    folder = hub.export_folder(ckpt, str(tmp_path / 'repo'))
    refused = r'holds a per-position patch head trained on a 2x3 grid \(grid=\(2, 3\)\), and the model has a {}x{} grid'
    for rows, cols in ((3, 2), (6, 1), (3, 3)):
        with pytest.raises(CheckpointError, match=r'^.*repo.model\.safetensors ' + refused.format(rows, cols)):
            timm.create_model(f'local-dir:{folder}', pretrained=True, grid=(rows, cols))
        with pytest.raises(CheckpointError, match=r'^.*best\.safetensors ' + refused.format(rows, cols)):
            timm.create_model('patchhead_resnet8_cifar', pretrained=True, per_position=True, grid=(rows, cols),
                              pretrained_cfg_overlay=dict(file=ckpt))
        # the folder's model.safetensors named as a file: it carries no metadata, its config.json the grid
        with pytest.raises(CheckpointError, match=r'^.*repo.model\.safetensors ' + refused.format(rows, cols)):
            timm.create_model('patchhead_resnet8_cifar', pretrained=True, per_position=True, grid=(rows, cols),
                              pretrained_cfg_overlay=dict(file=os.path.join(folder, 'model.safetensors')))
    with pytest.raises(CheckpointError, match=r'^.*best\.safetensors ' + refused.format(3, 2) + '.*leave grid to'):
        hub.model_from_weights(ckpt, grid=(3, 2))
    want = model.state_dict()
    for got in (timm.create_model(f'local-dir:{folder}', pretrained=True),
                timm.create_model('patchhead_resnet8_cifar', pretrained=True, per_position=True, grid=(2, 3),
                                  pretrained_cfg_overlay=dict(file=ckpt)),
                hub.model_from_weights(ckpt)[0]):
        assert got.grid == (2, 3) and all(torch.equal(got.state_dict()[k], v) for k, v in want.items())
    # features_only keeps the trunk alone: the head's grid does not matter there
    for feats in (timm.create_model(f'local-dir:{folder}', pretrained=True, features_only=True, grid=(3, 2)),
                  timm.create_model('patchhead_resnet8_cifar', pretrained=True, per_position=True, grid=(3, 2),
                                    features_only=True, pretrained_cfg_overlay=dict(file=ckpt))):
        assert feats.feature_info.channels() == [16, 16, 32, 64]
        trunk = [v for k, v in want.items() if k.startswith('backbone.') and not k.startswith('backbone.fc.')]
        got = list(feats.state_dict().values())  # (the extractor's names join a module path with '_')
        assert len(got) == len(trunk) and all(torch.equal(a, b) for a, b in zip(got, trunk))
    # another class count: both heads start fresh, so the grid may change with them
    assert timm.create_model(f'local-dir:{folder}', pretrained=True, grid=(3, 2), num_classes=4).grid == (3, 2)
    # --initial-checkpoint: the head of another grid starts fresh, the rest loads
    for path in (ckpt, os.path.join(folder, 'model.safetensors')):
        torch.manual_seed(1)
        other = timm.create_model('patchhead_resnet8_cifar', num_classes=7, grid=(3, 2), per_position=True)
        fresh_head = other.patch_head.fc.weight.detach().clone()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            load_initial_checkpoint(other, path)
        assert 'trained on a 2x3 grid' in caplog.text and 'the patch head starts fresh' in caplog.text
        assert torch.equal(other.patch_head.fc.weight, fresh_head)
        assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items()
                   if not k.startswith('patch_head.fc.'))


def test_export_ships_the_table_the_model_trained_on_not_a_namesake(tmp_path, monkeypatch):
    """A guided run given a relative --patchmix-table recorded the path as typed, so an export from another working
    folder shipped whatever masks.json lay there (another search's table), card and all. The path is now recorded
    absolute, and a recorded table whose content is not the one trained on (edited in place) is refused, not
    shipped."""
    rng = np.random.default_rng(1)
    pairs = [(0, 1), (4, 7)]
    tables = [MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), dataset_fingerprint('', PATCHSHAPES_CLASSES), pairs,
                        [rng.random((4, 4)) < 0.5 for _ in pairs], [score, 0.5], 0.3) for score in (0.25, 0.75)]
    (tmp_path / 'a').mkdir()
    (tmp_path / 'b').mkdir()
    tables[0].save(str(tmp_path / 'a' / 'masks.json'))
    tables[1].save(str(tmp_path / 'b' / 'masks.json'))  # another table of the same dataset, under the same name
    monkeypatch.chdir(tmp_path / 'a')
    res = train_main(TINY + ['--output', str(tmp_path / 'runs'), '--experiment', 'gpm', '--patchmix',
                             '--patchmix-table', 'masks.json'])
    ckpt = os.path.join(res['output'], 'best.safetensors')
    assert load_weights(ckpt)[1]['patchmix']['table'] == str(tmp_path / 'a' / 'masks.json')
    monkeypatch.chdir(tmp_path / 'b')
    folder = hub.export_folder(ckpt, str(tmp_path / 'hub'))
    assert open(os.path.join(folder, 'masks.json'), 'rb').read() == (tmp_path / 'a' / 'masks.json').read_bytes()
    assert 'this model trained on' in open(os.path.join(folder, 'README.md')).read()
    # the trained-on file replaced by another table: refused, naming the recorded digest; nothing written
    tables[1].save(str(tmp_path / 'a' / 'masks.json'))
    with pytest.raises(CheckpointError, match=re.escape(f'{ckpt} trained with the mask table '
                                                        f'{tmp_path / "a" / "masks.json"}, and the file there now '
                                                        f'holds another table')):
        hub.export_folder(ckpt, str(tmp_path / 'hub2'))
    assert not os.path.exists(tmp_path / 'hub2')
    # given explicitly, another table is the caller's choice: shipped, and the card says it is not the trained one
    card = open(os.path.join(hub.export_folder(ckpt, str(tmp_path / 'hub3'), table='masks.json'),
                             'README.md')).read()
    assert 'which it did not train on (the table it trained on differs)' in card


def test_export_into_a_folder_it_cannot_write_is_one_error_line_and_follows_the_umask(
        trained, tmp_path, monkeypatch, capsys):
    """An export (or `push --dry-run`) into a folder without write permission was a PermissionError traceback; it
    is one `error: cannot write ...` line. The exported folder was 0755 whatever the umask (0700 files in a 0755
    folder under umask 077); it now takes the umask, as os.makedirs would."""
    import timm_patchmix.checkpoint as checkpoint_module
    real = checkpoint_module.tempfile.mkdtemp

    def denied(*a, **k):  # (root writes anywhere: the refusal is what the file system would say)
        raise PermissionError(13, 'Permission denied')
    monkeypatch.setattr(checkpoint_module.tempfile, 'mkdtemp', denied)
    for argv in (['export', '--checkpoint', trained[0], '--output', str(tmp_path / 'h')],
                 ['push', '--checkpoint', trained[0], '--repo-id', 'u/n', '--dry-run', '--folder',
                  str(tmp_path / 'p' / 'q')]):
        assert hub.main(argv) == 1  # (a write that failed, as for every command; 2 is for bad flags and inputs)
        err = capsys.readouterr().err
        assert err.startswith(f'error: cannot write {argv[-1]}: Permission denied') and 'Traceback' not in err, err
    assert sorted(os.listdir(tmp_path)) == []  # (the folders made above the destination are removed again)
    monkeypatch.setattr(checkpoint_module.tempfile, 'mkdtemp', real)
    # a full disk in a write the project does not make itself (timm's config.json writer): the same one line
    import errno
    import timm_patchmix.compat as compat

    def full(*a, **k):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(compat, 'save_config_for_hf', full)
    assert hub.main(['export', '--checkpoint', trained[0], '--output', str(tmp_path / 'h')]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f'error: cannot write {tmp_path / "h"}: No space left on device') and 'Traceback' not in err
    assert sorted(os.listdir(tmp_path)) == []  # (its temporary folder removed)
    monkeypatch.undo()
    for umask, mode in ((0o077, 0o700), (0o002, 0o775)):
        old = os.umask(umask)
        try:
            folder = hub.export_folder(trained[0], str(tmp_path / f'hub{umask:o}'))
        finally:
            os.umask(old)
        assert os.stat(folder).st_mode & 0o777 == mode
        assert {os.stat(os.path.join(folder, f)).st_mode & 0o777 for f in os.listdir(folder)} == {mode & 0o666}


def test_commands_print_non_ascii_paths_on_an_ascii_stdout(tmp_path):
    """With an ASCII standard output (PYTHONIOENCODING=ascii, a C locale with PYTHONUTF8=0) a command that had
    done its work failed at its last print of a non-ASCII path: `hub export` wrote the folder and then said
    `error: 'ascii' codec can't encode...` with exit 2 (the pipeline's report, with its `P²`, failed every rerun).
    Standard output now shows such letters as backslash escapes, as standard error does (and the bytes of an
    undecodable path as they were read)."""
    import io
    from timm_patchmix.cli import tolerant_stdout
    _, ckpt, _ = small_folder(tmp_path)
    dest = str(tmp_path / 'modèle')
    r = subprocess.run([sys.executable, '-m', 'timm_patchmix.hub', 'export', '--checkpoint', ckpt, '--output', dest],
                       capture_output=True, timeout=300, env=dict(os.environ, PYTHONIOENCODING='ascii'))
    assert r.returncode == 0, r.stderr.decode('ascii', 'replace')[-2000:]
    assert r.stdout.decode('ascii').strip() == dest.encode('ascii', 'backslashreplace').decode('ascii')
    assert os.path.isfile(os.path.join(dest, 'model.safetensors'))
    # a C locale: stdout is ASCII with surrogateescape, which failed on a real letter; letters are escaped now,
    # and an undecodable path's bytes still come back as they were read
    script = tmp_path / 'say.py'
    script.write_text('from timm_patchmix.cli import tolerant_stdout\ntolerant_stdout()\n'
                      'print("P\\u00b2 \\u00b1 caf\\udcc3\\udca9")\n', encoding='ascii')
    r = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=300,
                       env=dict(os.environ, LC_ALL='C', PYTHONUTF8='0', PYTHONIOENCODING=''))
    assert r.returncode == 0 and r.stdout == b'P\\xb2 \\xb1 caf\xc3\xa9\n', (r.stdout, r.stderr[-2000:])
    # a strict UTF-8 stdout and a path with undecodable (Latin-1) bytes: the bytes are written back as read
    r = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=300,
                       env=dict(os.environ, PYTHONIOENCODING='utf-8'))
    assert r.returncode == 0 and r.stdout == 'P\u00b2 \u00b1 caf'.encode() + b'\xc3\xa9\n', (r.stdout, r.stderr[-2000:])
    # the helper itself: a strict or surrogateescape stream learns the escapes; one given a handler is left alone
    from timm_patchmix.cli import _ESCAPES
    old = sys.stdout
    try:
        for encoding, errors, want in (('ascii', 'strict', _ESCAPES), ('ascii', 'surrogateescape', _ESCAPES),
                                       ('utf-8', 'strict', _ESCAPES), ('ascii', 'replace', 'replace'),
                                       ('utf-8', 'backslashreplace', 'backslashreplace')):
            sys.stdout = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors=errors)
            tolerant_stdout()
            assert sys.stdout.errors == want
    finally:
        sys.stdout = old
