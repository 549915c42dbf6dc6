"""Files the project reads get strict types and ranges, exports never delete their inputs, killed writes leave no
temporaries, and the search's hall of fame and gene-score cache are exact."""
import copy
import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import timm_patchmix  # noqa: F401
from timm_patchmix import hub
from timm_patchmix.checkpoint import CheckpointError, atomic_write_text, load_state, save_state, save_weights
from timm_patchmix.checkpoint import tensors_digest as ckpt_digest
from timm_patchmix.data import PATCHSHAPES_CLASSES
from timm_patchmix.guided import MaskTable, MaskTableError, dataset_fingerprint
from timm_patchmix.search.genome import Individual, grid_to_bits
from timm_patchmix.search import Search, main as search_main, parse_config
from timm_patchmix.train import main as train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))
DATA = {'dataset': '', 'data_dir': '', 'val_split': 'validation', 'input_size': [3, 32, 32],
        'mean': [0.4914, 0.4822, 0.4465], 'std': [0.247, 0.2435, 0.2616]}
FP = dataset_fingerprint('', PATCHSHAPES_CLASSES)
TINY_SEARCH = ['--population', '4', '--generations', '1', '--k', '2', '--val-subset', '300', '--no-progress',
               '--no-plots', '--eval-batch-size', '64', '--seed', '1', '--device', 'cpu']


def make_checkpoint(path, grid=(4, 4), num_classes=10, class_names=PATCHSHAPES_CLASSES, data=DATA, **meta):
    torch.manual_seed(0)
    m = timm.create_model('patchhead_resnet32_cifar', num_classes=num_classes, grid=list(grid))
    doc = {'model': 'patchhead_resnet32_cifar', 'num_classes': num_classes, 'model_kwargs': {'grid': list(grid)},
           'class_names': list(class_names), 'data': data,
           'patchmix': {'enabled': True, 'grid': list(grid), 'table': None}, 'epoch': 0}
    save_weights(path, m.state_dict(), dict(doc, **meta))
    return path


def tamper(src, dst, meta_fn=None, tensors_fn=None):
    """Rewrite a safetensors file with its timm_patchmix metadata (and tensors) changed."""
    with safe_open(src, framework='pt') as f:
        md = dict(f.metadata())
    tensors = load_file(src)
    meta = json.loads(md['timm_patchmix'])
    if meta_fn:
        meta_fn(meta)
    if tensors_fn:
        tensors_fn(tensors)
    md['timm_patchmix'] = json.dumps(meta)
    if 'timm_patchmix.sha256' in md:  # re-signed: a well-formed file whose values the checks must catch
        md['timm_patchmix.sha256'] = ckpt_digest(tensors)
    if 'timm_patchmix.meta_sha256' in md:
        md['timm_patchmix.meta_sha256'] = hashlib.sha256(md['timm_patchmix'].encode('utf-8')).hexdigest()
    save_file(tensors, dst, metadata=md)
    return dst


def tree(folder):
    """Every file under ``folder`` with its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, folder)] = open(p, 'rb').read()
    return out


@pytest.fixture(scope='module')
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp('ckpt') / 'best.safetensors'))


# --- masks.json ------------------------------------------------------------------------------------------------
def good_table_doc():
    t = MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), FP, [(0, 3), (2, 5)],
                  [np.eye(4, dtype=bool), ~np.eye(4, dtype=bool)], [0.1, 0.2], 0.15, {'seed': 1})
    return json.loads(t.to_json())


def _set(path, value):
    def change(doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return change


DELETE = object()
BAD_TABLES = {  # name: (change, the field the error names)
    'mask string "0"': (_set(['pairs', 0, 'mask', 0, 0], '0'), r'pairs\[0\]\.mask\[0\]\[0\]'),
    'mask string "1"': (_set(['pairs', 0, 'mask', 1, 2], '1'), r'pairs\[0\]\.mask\[1\]\[2\]'),
    'mask 2': (_set(['pairs', 1, 'mask', 3, 3], 2), r'pairs\[1\]\.mask\[3\]\[3\]'),
    'mask 0.5': (_set(['pairs', 0, 'mask', 0, 1], 0.5), r'pairs\[0\]\.mask\[0\]\[1\]'),
    'mask 1.0': (_set(['pairs', 0, 'mask', 0, 1], 1.0), r'pairs\[0\]\.mask\[0\]\[1\]'),
    'mask null': (_set(['pairs', 0, 'mask', 2, 0], None), r'pairs\[0\]\.mask\[2\]\[0\]'),
    'mask row short': (_set(['pairs', 0, 'mask', 1], [1, 0, 1]), r'pairs\[0\]\.mask\[1\]'),
    'mask rows missing': (_set(['pairs', 0, 'mask'], [[1, 0, 1, 0]]), r'pairs\[0\]\.mask'),
    'class bool': (_set(['pairs', 0, 'classes', 0], True), r'pairs\[0\]\.classes\[0\]'),
    'class float': (_set(['pairs', 0, 'classes', 1], 3.0), r'pairs\[0\]\.classes\[1\]'),
    'class string': (_set(['pairs', 0, 'classes', 0], '0'), r'pairs\[0\]\.classes\[0\]'),
    'class out of range': (_set(['pairs', 1, 'classes', 1], 10), r'pairs\[1\]\.classes\[1\].*\[0, 9\]'),
    'class negative': (_set(['pairs', 1, 'classes', 0], -1), r'pairs\[1\]\.classes\[0\]'),
    'classes of three': (_set(['pairs', 0, 'classes'], [0, 1, 2]), r'pairs\[0\]\.classes'),
    'pair repeated': (_set(['pairs', 1, 'classes'], [0, 3]), r'pairs\[1\] repeats .*pairs\[0\]'),
    'pair reversed': (_set(['pairs', 1, 'classes'], [3, 0]), r'pairs\[1\] repeats .*pairs\[0\]'),
    'grid zero': (_set(['grid'], [4, 0]), r': grid must be'),
    'grid float': (_set(['grid'], [4.0, 4]), r': grid must be'),
    'grid bool': (_set(['grid'], [True, 4]), r': grid must be'),
    'grid string': (_set(['grid'], '4x4'), r': grid must be'),
    'num_classes zero': (_set(['num_classes'], 0), r'num_classes must be an integer >= 1, got 0'),
    'num_classes string': (_set(['num_classes'], '10'), r"num_classes must be .*got '10'"),
    'num_classes float': (_set(['num_classes'], 10.0), r'num_classes must be .*got 10\.0'),
    'num_classes bool': (_set(['num_classes'], True), r'num_classes must be .*got True'),
    'class_names short': (_set(['class_names'], list(PATCHSHAPES_CLASSES[:9])), r'class_names must be a list of 10'),
    'class_names not strings': (_set(['class_names', 3], 3), r'class_names\[3\] must be a string'),
    'fingerprint number': (_set(['dataset_fingerprint'], 5), r'dataset_fingerprint must be'),
    'score string': (_set(['pairs', 0, 'score'], 'low'), r'pairs\[0\]\.score must be a finite number'),
    'best_fitness string': (_set(['best_fitness'], 'x'), r'best_fitness must be a finite number'),
    'score infinite': (_set(['pairs', 0, 'score'], float('inf')), r'pairs\[0\]\.score must be a finite number'),
    'best_fitness -infinite': (_set(['best_fitness'], -float('inf')), r'best_fitness must be a finite number'),
    'pair names': (_set(['pairs', 0, 'names'], ['square', 'disc']), r'pairs\[0\]\.names'),
    'pairs not a list': (_set(['pairs'], {'0': 1}), r'pairs must be a list'),
    'pair not an object': (_set(['pairs', 0], [0, 3]), r'pairs\[0\] must be an object'),
    'grid missing': (_set(['grid'], DELETE), r"field 'grid' is missing"),
    'search_args list': (_set(['search_args'], [1]), r'search_args must be an object'),
    'schema version true': (_set(['schema_version'], True), r'schema version True'),
}


@pytest.mark.parametrize('name', sorted(BAD_TABLES))
def test_bad_mask_table_names_the_field(name, tmp_path):
    change, field = BAD_TABLES[name]
    doc = good_table_doc()
    change(doc)
    path = str(tmp_path / 'masks.json')
    with open(path, 'w') as f:
        json.dump(doc, f)
    with pytest.raises(MaskTableError, match=field) as e:
        MaskTable.load(path)
    assert path in str(e.value)


def test_good_mask_table_variants_load(tmp_path):
    """Booleans and 0/1 integers are both masks; tables without names load; the shipped example loads."""
    doc = good_table_doc()
    doc['pairs'][0]['mask'] = [[bool(v) for v in row] for row in doc['pairs'][0]['mask']]
    doc['class_names'] = None
    for p in doc['pairs']:
        p['names'] = None
    path = str(tmp_path / 'masks.json')
    with open(path, 'w') as f:
        json.dump(doc, f)
    t = MaskTable.load(path, grid=(4, 4), num_classes=10, fingerprint=FP)
    assert t.class_names == [] and np.array_equal(t.masks[0], np.eye(4, dtype=bool))
    example = os.path.join(ROOT, 'timm_patchmix', 'weights', 'patchhead_resnet32_cifar.gpm_fmnist', 'masks.json')
    assert len(MaskTable.load(example).pairs) == 10


def test_unknown_scores_are_written_as_standard_json_null(tmp_path):
    """A score of NaN (unknown: a hand-written table, or the bare ``NaN`` older files hold) loads as NaN and is
    written as ``null``, so the file stays standard JSON; an infinite score cannot be saved."""
    doc = good_table_doc()
    doc['pairs'].append(dict(doc['pairs'][0], classes=[1, 4], names=[doc['class_names'][1], doc['class_names'][4]],
                             score=0.25))
    doc['pairs'][0]['score'] = None
    del doc['pairs'][1]['score']
    doc['best_fitness'] = float('nan')  # json.dump writes the bare NaN
    path = str(tmp_path / 'masks.json')
    with open(path, 'w') as f:
        json.dump(doc, f)
    t = MaskTable.load(path)
    assert math.isnan(t.scores[0]) and math.isnan(t.scores[1]) and math.isnan(t.best_fitness)
    assert t.scores[2] == 0.25
    out = str(tmp_path / 'again.json')
    t.save(out)

    def no_constants(name):
        raise AssertionError(f'{out} holds the non-standard JSON constant {name}')
    with open(out) as f:
        again = json.load(f, parse_constant=no_constants)
    assert again['best_fitness'] is None and again['pairs'][0]['score'] is None and again['pairs'][1]['score'] is None
    reloaded = MaskTable.load(out)
    assert math.isnan(reloaded.scores[1]) and reloaded.scores[2] == 0.25
    from timm_patchmix.hub.card import model_card  # the Hub card lists the table: an unknown score reads so
    card = model_card('user/repo', 'patchhead_resnet32_cifar', {'data': {}}, None, again, None)
    assert '(search fitness unknown)' in card and card.count('| unknown |') == 2, card
    assert '| 0.250 |' in card
    t.scores[0] = float('inf')
    with pytest.raises(MaskTableError, match='finite or unknown'):
        t.save(str(tmp_path / 'inf.json'))
    assert not os.path.exists(tmp_path / 'inf.json')


def test_deeply_nested_table_is_a_mask_table_error(tmp_path):
    path = tmp_path / 'masks.json'
    path.write_text('{"schema_version": 1, "pairs": ' + '[' * 200000 + ']' * 200000 + '}')
    with pytest.raises(MaskTableError, match='nests its JSON too deeply'):
        MaskTable.load(str(path))


# --- state.safetensors, checkpoint metadata, config.json -------------------------------------------------------
def _train_state(path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    rows = [{'epoch': e, 'train_loss': 1.0, 'eval_loss': 1.0, 'eval_top1': 50.0, 'eval_top5': 90.0, 'lr': 0.1,
             'img_s': 100.0} for e in range(2)]
    save_state(path, model.state_dict(), opt, {'epoch': 1, 'rows': rows, 'best': {'score': 50.0, 'epoch': 0,
                                                                                  'metric': 'top1'},
                                               'updates': 4, 'args': {'model': 'x'}, 'seed': 0})
    return path


BAD_STATES = {
    'epoch string': (lambda m: m.update(epoch='1'), r"epoch must be an integer >= 0, got '1'"),
    'epoch negative': (lambda m: m.update(epoch=-1), r'epoch must be an integer >= 0, got -1'),
    'epoch float': (lambda m: m.update(epoch=1.5), r'epoch must be an integer >= 0, got 1\.5'),
    'rows too few': (lambda m: m.update(rows=m['rows'][:1]), r'rows must be a list of 2'),
    'row epoch': (lambda m: m['rows'][1].update(epoch=7), r'rows\[1\]\.epoch must be an integer in \[1, 1\]'),
    'row top1 string': (lambda m: m['rows'][0].update(eval_top1='99'), r'rows\[0\]\.eval_top1 must be a number'),
    'best epoch': (lambda m: m['best'].update(epoch=5), r'best\.epoch must be an integer in \[0, 1\]'),
    'best metric': (lambda m: m['best'].update(metric='acc'), r'best\.metric'),
    'updates bool': (lambda m: m.update(updates=True), r'updates must be an integer'),
    'args list': (lambda m: m.update(args=[]), r'args must be an object'),
    'param index': (lambda m: m['optimizer']['param_groups'][0].update(params=['0']),
                    r'optimizer\.param_groups\[0\]\.params\[0\]'),
    'python rng short': (lambda m: m['rng']['python'][1].pop(), r'rng\.python\[1\] must be a list of 625'),
    'numpy rng pos': (lambda m: m['rng']['numpy'].__setitem__(1, 700), r'rng\.numpy\[1\]'),
}


def test_tied_weights_save_and_load_strictly(tmp_path):
    """A state dict naming one tensor twice (tied weights; timm's CoaT names its stage position encodings so):
    safetensors refuses shared memory, so training stopped after its first epoch with nothing saved. Each name is
    written with its values, and weights and state load back strictly."""
    from timm_patchmix.checkpoint import load_weights
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    model[2].weight = model[0].weight  # tied
    view = {'whole': torch.arange(6.0), 'half': torch.arange(6.0)[3:]}  # views of one storage, too
    view['half'] = view['whole'][3:]
    sd = model.state_dict()
    assert sd['0.weight'].data_ptr() == sd['2.weight'].data_ptr()
    save_weights(str(tmp_path / 'w.safetensors'), sd, {'epoch': 0})
    got, meta = load_weights(str(tmp_path / 'w.safetensors'))
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd) and meta['epoch'] == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    fresh[2].weight = fresh[0].weight
    fresh.load_state_dict(got, strict=True)
    assert torch.equal(fresh[2].weight, model[2].weight)
    save_weights(str(tmp_path / 'v.safetensors'), view)
    got, _ = load_weights(str(tmp_path / 'v.safetensors'))
    assert torch.equal(got['whole'], torch.arange(6.0)) and torch.equal(got['half'], torch.arange(3.0, 6.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_state(str(tmp_path / 's.safetensors'), model.state_dict(), opt, {'epoch': 0, 'rows': [{'epoch': 0}]})
    state = load_state(str(tmp_path / 's.safetensors'))
    assert all(torch.equal(state['model'][k], v) for k, v in model.state_dict().items())


def test_tampered_training_state_is_refused(tmp_path):
    good = _train_state(str(tmp_path / 'state.safetensors'))
    assert load_state(good)['meta']['epoch'] == 1
    for name, (change, message) in BAD_STATES.items():
        bad = tamper(good, str(tmp_path / 'bad.safetensors'), change)
        with pytest.raises(CheckpointError, match=message) as e:
            load_state(bad)
        assert 'bad.safetensors' in str(e.value), name
    # train.py turns it into an error line naming the file and field, before it trains anything
    bad = tamper(good, str(tmp_path / 'bad.safetensors'), BAD_STATES['epoch string'][0])
    with pytest.raises(SystemExit, match=r"cannot resume: .*bad\.safetensors: epoch must be an integer"):
        train_main(['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress',
                    '--epochs', '1', '--output', str(tmp_path / 'o'), '--resume', bad])


def _optimizer_steps(opt_name, model, steps, seed):
    from timm.optim import create_optimizer_v2
    opt = create_optimizer_v2(model, opt_name, lr=0.01, weight_decay=0.01)
    second = getattr(opt, 'is_second_order', False)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 6, generator=g)).pow(2).sum().backward(create_graph=second)
        opt.step()
    return opt


@pytest.mark.filterwarnings('ignore')  # Kron asks for opt_einsum; a double backward warns of its reference cycle
@pytest.mark.parametrize('opt_name, holds', [
    ('adafactorbv', 'a dtype in its groups'), ('kron', 'lists of tensors in its state, a generator state'),
    ('lamb', 'a tensor in its groups'), ('adahessian', 'second-order state'), ('adamw', 'plain tensors')])
def test_optimizer_state_round_trips_exactly(tmp_path, opt_name, holds):
    """Every kind of value timm's optimizers keep (dtypes, tuples, lists of tensors, tensors in param groups, a
    generator state beside them) is stored and given back: an optimizer loaded from the file steps to the same
    weights as one loaded from the saved optimizer's own state dict, and as the saved optimizer itself (but for
    AdaHessian, whose random probes come from a generator its state dict does not hold)."""
    from timm.optim import create_optimizer_v2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = _optimizer_steps(opt_name, model, 2, seed=1)
    path = str(tmp_path / 'state.safetensors')
    save_state(path, model.state_dict(), opt, {'epoch': 0, 'seed': 0})
    state = load_state(path)
    runs = [(model, opt)]
    for sd in (copy.deepcopy(opt.state_dict()), state['optimizer']):  # in memory; from the file
        twin = copy.deepcopy(model)
        twin.load_state_dict(state['model'])
        twin_opt = create_optimizer_v2(twin, opt_name, lr=0.01, weight_decay=0.01)
        twin_opt.load_state_dict(sd)
        runs.append((twin, twin_opt))
    saved, back = opt.state_dict(), runs[2][1].state_dict()
    assert saved.keys() == back.keys()
    for key in set(saved) - {'state', 'param_groups'}:  # Kron's generator state, its tuples kept
        assert saved[key] == back[key]
    for group, back_group in zip(saved['param_groups'], back['param_groups']):
        assert {k: type(v) for k, v in group.items()} == {k: type(v) for k, v in back_group.items()}
    for a, b in runs:  # two more steps on the same batches, from the same global generator (Kron draws from it)
        g = torch.Generator().manual_seed(2)
        torch.manual_seed(3)
        for _ in range(2):
            b.zero_grad(set_to_none=True)
            a(torch.randn(4, 6, generator=g)).pow(2).sum().backward(
                create_graph=getattr(b, 'is_second_order', False))
            b.step()
    (m0, _), (m1, _), (m2, _) = runs
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters())), holds
    if opt_name != 'adahessian':  # (timm's AdaHessian keeps its generator out of its state dict: it restarts)
        assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m2.parameters())), holds
    assert not torch.equal(m2[0].weight, state['model']['0.weight'])  # the steps moved the weights


def test_a_state_of_the_earlier_format_still_loads(tmp_path):
    """States written before values were tagged hold Adam's betas as a JSON list and no ``encoded`` record: they
    load as they are (betas a list, which the optimizer takes) and step as the saved optimizer does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = _optimizer_steps('adamw', model, 2, seed=1)
    path = str(tmp_path / 'state.safetensors')
    save_state(path, model.state_dict(), opt, {'epoch': 0, 'seed': 0})

    def earlier(meta):
        om = meta['optimizer']
        assert om.pop('encoded') == {'param_groups': {'0': ['betas'], '1': ['betas']}}  # decay / no decay
        for group in om['param_groups']:
            group['betas'] = group['betas']['tuple']
    old = tamper(path, str(tmp_path / 'old.safetensors'), earlier)
    state = load_state(old)
    assert state['optimizer']['param_groups'][0]['betas'] == [0.9, 0.999]
    from timm.optim import create_optimizer_v2
    twin = copy.deepcopy(model)
    twin_opt = create_optimizer_v2(twin, 'adamw', lr=0.01, weight_decay=0.01)
    twin_opt.load_state_dict(state['optimizer'])
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(torch.ones(2, 6)).sum().backward()
        o.step()
    assert torch.equal(model.weight, twin.weight)


def test_an_optimizer_value_a_state_cannot_hold_is_named(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # dicts (plain JSON, or holding tensors and tuples) are kept, as they are
    opt.param_groups[0]['plain'] = {'a': 1, 'b': [2.5, None]}
    opt.param_groups[0]['mixed'] = {'t': torch.arange(3), 'pair': (1, 2)}
    save_state(str(tmp_path / 'ok.safetensors'), model.state_dict(), opt, {'epoch': 0})
    group = load_state(str(tmp_path / 'ok.safetensors'))['optimizer']['param_groups'][0]
    assert group['plain'] == {'a': 1, 'b': [2.5, None]} and group['mixed']['pair'] == (1, 2)
    assert torch.equal(group['mixed']['t'], torch.arange(3))
    os.remove(tmp_path / 'ok.safetensors')
    del opt.param_groups[0]['plain'], opt.param_groups[0]['mixed']
    # two values that would share a tensor name in the file: refused, not one silently overwriting the other
    opt.param_groups[0]['Q'], opt.param_groups[0]['Q.0'] = [torch.ones(1)], torch.zeros(1)
    with pytest.raises(TypeError, match=r'two values of the optimizer would be stored as optim_group\.0\.Q\.0'):
        save_state(str(tmp_path / 's.safetensors'), model.state_dict(), opt, {'epoch': 0})
    del opt.param_groups[0]['Q'], opt.param_groups[0]['Q.0']
    opt.param_groups[0]['schedule'] = object()
    with pytest.raises(TypeError, match=r'the optimizer holds a object \(optim_group\.0\.schedule\), which a '
                                        r'training state cannot store'):
        save_state(str(tmp_path / 's.safetensors'), model.state_dict(), opt, {'epoch': 0})
    assert not os.listdir(tmp_path)


BAD_ENCODED = {
    'unknown tag': (lambda o: o['param_groups'][0].update(momentum_dtype={'float': 'x'}),
                    r"optimizer\.param_groups\.0\.momentum_dtype must be one of \{'tensor'"),
    'not a dtype': (lambda o: o['param_groups'][0].update(momentum_dtype={'dtype': 'Tensor'}),
                    r"optimizer\.param_groups\.0\.momentum_dtype\.dtype must be a torch dtype, got 'Tensor'"),
    'unknown group': (lambda o: o['encoded'].update(param_groups={'5': ['momentum_dtype']}),
                      r"optimizer\.encoded\.param_groups keys must be entries of optimizer\.param_groups, got '5'"),
    'unknown name': (lambda o: o['encoded']['param_groups'].update({'0': ['nope']}),
                     r"optimizer\.encoded\.param_groups\.0\[0\] must be a name of optimizer\.param_groups\.0"),
    'non-ascii index': (lambda o: o['encoded'].update(param_groups={'\u00b2': ['momentum_dtype']}),
                        r"optimizer\.encoded\.param_groups keys must be entries of optimizer\.param_groups"),
    'unknown part': (lambda o: o['encoded'].update(groups={}), r"optimizer\.encoded keys must be 'state' or"),
    'extra not encoded': (lambda o: o.update(extra={'rng_state': {'set': [1]}}),
                          r"optimizer\.extra\.rng_state must be one of"),
    'missing tensor': (lambda o: o['state']['0'].update(Q={'list': [{'tensor': 'optim.0.Q.9'}]}) or
                       o['encoded'].update(state={'0': ['Q']}), r"is incomplete: missing 'optim\.0\.Q\.9'"),
}


def test_tampered_encoded_optimizer_values_are_refused(tmp_path):
    """The JSON form of a dtype or a list of tensors is checked before a resume uses it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = _optimizer_steps('adafactorbv', model, 1, seed=1)
    good = str(tmp_path / 'state.safetensors')
    save_state(good, model.state_dict(), opt, {'epoch': 0, 'seed': 0})
    assert load_state(good)['optimizer']['param_groups'][0]['momentum_dtype'] == torch.bfloat16
    for name, (change, message) in BAD_ENCODED.items():
        bad = tamper(good, str(tmp_path / 'bad.safetensors'), lambda m: change(m['optimizer']))
        with pytest.raises(CheckpointError, match=message):
            load_state(bad)


BAD_META = {
    'num_classes string': (lambda m: m.update(num_classes='10'), r"num_classes must be an integer >= 1, got '10'"),
    'num_classes zero': (lambda m: m.update(num_classes=0), r'num_classes must be an integer >= 1'),
    'class_names short': (lambda m: m.update(class_names=m['class_names'][:9]), r'class_names must be a list of 10'),
    'class_names ints': (lambda m: m.update(class_names=list(range(10))), r'class_names\[0\] must be a string'),
    'input size': (lambda m: m['data'].update(input_size=[3, 32]), r'data\.input_size must be \[channels'),
    'input size float': (lambda m: m['data'].update(input_size=[3, 32.0, 32]), r'data\.input_size'),
    'std zero': (lambda m: m['data'].update(std=[0, 1, 1]), r'data\.std must be positive'),
    'interpolation': (lambda m: m['data'].update(interpolation='foo'),
                      r"data\.interpolation must be one of nearest, bilinear, .*got 'foo'"),
    'crop_pct zero': (lambda m: m['data'].update(crop_pct=0), r'data\.crop_pct must be a number > 0'),
    'crop_pct inf': (lambda m: m['data'].update(crop_pct=float('inf')), r'data\.crop_pct must be a finite number'),
    'grid': (lambda m: m['patchmix'].update(grid=[4, 0]), r'patchmix\.grid must be \[rows, cols\]'),
    'epoch': (lambda m: m.update(epoch=-3), r'epoch must be an integer >= 0, got -3'),
    'dataset': (lambda m: m['data'].update(dataset=7), r'data\.dataset must be a string'),
    'pretrained': (lambda m: m['model_kwargs'].update(pretrained=True), r"model_kwargs holds 'pretrained'"),
    'checkpoint_path': (lambda m: m['model_kwargs'].update(checkpoint_path='/tmp/x.pth'),
                        r"model_kwargs holds 'checkpoint_path'"),
    'pretrained_cfg_overlay': (lambda m: m['model_kwargs'].update(pretrained_cfg_overlay={'file': '/etc/passwd'}),
                               r"model_kwargs holds 'pretrained_cfg_overlay'"),
    'kwarg grid string': (lambda m: m['model_kwargs'].update(grid=[4, '4']), r'model_kwargs\.grid'),
    'kwarg drop rate': (lambda m: m['model_kwargs'].update(drop_rate=3.0), r'model_kwargs\.drop_rate'),
    'model_kwargs list': (lambda m: m.update(model_kwargs=['grid']), r'model_kwargs must be an object'),
}


def test_tampered_checkpoint_metadata_is_refused(ckpt, tmp_path):
    hub.model_from_weights(ckpt)
    for name, (change, message) in BAD_META.items():
        bad = tamper(ckpt, str(tmp_path / 'bad.safetensors'), change)
        with pytest.raises(CheckpointError, match=message) as e:
            hub.model_from_weights(bad)
        assert 'bad.safetensors' in str(e.value), name
    for text in ('{"kind": ', '{"kind": ' + '[' * 200000 + ']' * 200000 + '}'):  # cut, nested too deeply
        with safe_open(ckpt, framework='pt') as f:
            md = dict(f.metadata(), timm_patchmix=text)
        save_file(load_file(ckpt), str(tmp_path / 'bad.safetensors'), metadata=md)
        with pytest.raises(CheckpointError, match='bad.safetensors has corrupt metadata'):
            hub.model_from_weights(str(tmp_path / 'bad.safetensors'))
    # the search says so in one line
    bad = tamper(ckpt, str(tmp_path / 'bad.safetensors'), BAD_META['pretrained'][0])
    with pytest.raises(SystemExit, match="error: .*model_kwargs holds 'pretrained'"):
        search_main(['--checkpoint', bad, '--output', str(tmp_path / 's')] + TINY_SEARCH)


def test_config_json_with_download_or_bad_fields_is_refused(ckpt, tmp_path):
    folder = hub.export_folder(ckpt, str(tmp_path / 'repo'))
    cfg_path = os.path.join(folder, 'config.json')
    good = json.load(open(cfg_path))
    hub.load_model(f'local-dir:{folder}')

    def write(change):
        cfg = copy.deepcopy(good)
        change(cfg)
        with open(cfg_path, 'w') as f:
            json.dump(cfg, f)
    write(lambda c: c['model_args'].update(pretrained=True))
    with pytest.raises(CheckpointError, match=r"config\.json: model_args holds 'pretrained', which a file may not"):
        hub.load_model(f'local-dir:{folder}')
    with pytest.raises(SystemExit, match=r"model_args holds 'pretrained'"):
        train_main(['--model', f'local-dir:{folder}', '--output', str(tmp_path / 'o'), '--epochs', '1'])
    # timm's own loader reaches the patchhead factory, which checks the same fields
    write(lambda c: c['model_args'].update(checkpoint_path=os.path.join(folder, 'model.safetensors')))
    with pytest.raises(CheckpointError, match=r"model_args holds 'checkpoint_path'"):
        timm.create_model(f'local-dir:{folder}', pretrained=True)
    for change, message, via_timm in [
            (lambda c: c['model_args'].update(pretrained_cfg_overlay={'url': 'http://example.com/w.pth'}),
             r"model_args holds 'pretrained_cfg_overlay'", False),  # timm itself stops at a duplicate argument
            (lambda c: c['model_args'].update(per_position='no'), r'model_args\.per_position must be true or false',
             True),
            (lambda c: c.update(num_classes='10'), r"num_classes must be an integer >= 1, got '10'", True),
            (lambda c: c.update(label_names=c['label_names'][:3]), r'label_names must be a list of 10', True),
            (lambda c: c.update(model_args=[1]), r'model_args must be an object', False)]:
        write(change)
        with pytest.raises(CheckpointError, match=message):
            hub.load_model(f'local-dir:{folder}')
        if via_timm:
            with pytest.raises(CheckpointError, match=message):
                timm.create_model(f'local-dir:{folder}', pretrained=True)


# --- search_state.safetensors ----------------------------------------------------------------------------------
def test_tampered_search_state_is_refused(ckpt, tmp_path):
    out = tmp_path / 'search'
    search_main(['--checkpoint', ckpt, '--output', str(out)] + TINY_SEARCH)
    state = str(out / 'search_state.safetensors')
    good = open(state, 'rb').read()
    cases = [
        (lambda m: m.update(generation='1'), None, r"generation must be an integer >= 0, got '1'"),
        (lambda m: m.update(logbook=m['logbook'][:1]), None, r'logbook must be a list of 2'),
        (lambda m: m.update(forward_images=-5), None, r'forward_images must be an integer >= 0'),
        (lambda m: m.update(grid=[4, 4.0]), None, r'grid must be \[rows, cols\]'),
        (lambda m: m.update(settings=['--k']), None, r'settings must be an object'),
        (None, lambda t: t['pop.masks'].__setitem__((0, 3), 1 << 20), r'pop\.masks\[0\] must be masks in \[0, 65535\]'),
        (None, lambda t: t['pop.active'].__setitem__((1, 0), 45), r'pop\.active\[1\] must be sorted distinct'),
        (None, lambda t: t.update({'hof.fitness': t['hof.fitness'].float()}), r'hof\.fitness must be float64'),
        (None, lambda t: t['cache.pairs'].__setitem__(0, 999), r'cache\.pairs must be pair indices in \[0, 45\)'),
        (None, lambda t: t.update({'rng.torch': t['rng.torch'][:100]}), r'rng\.torch must be'),
        (None, lambda t: t.pop('cache.scores'), r"'cache\.scores' is missing"),
    ]
    for meta_fn, tensors_fn, message in cases:
        with open(state, 'wb') as f:
            f.write(good)
        tamper(state, state, meta_fn, tensors_fn)
        with pytest.raises(SystemExit, match=r'error: cannot resume the search: .*search_state\.safetensors: '
                           r'(the tensor )?' + message):
            search_main(['--checkpoint', ckpt, '--output', str(out), '--resume'] + TINY_SEARCH)
    # a state of the earlier layout (one int64 key per gene) still resumes where its keys were exact

    def legacy(t):
        t['cache.keys'] = t.pop('cache.pairs') * (1 << 16) + t.pop('cache.masks')
    with open(state, 'wb') as f:
        f.write(good)
    table = (out / 'masks.json').read_bytes()
    tamper(state, state, None, legacy)
    search_main(['--checkpoint', ckpt, '--output', str(out), '--resume'] + TINY_SEARCH)
    assert (out / 'masks.json').read_bytes() == table


# --- hub export: its inputs stay, the table must belong to the model, failures leave nothing ------------------
def _run_folder(tmp_path):
    run = tmp_path / 'runs' / 'rpm'
    run.mkdir(parents=True)
    best = make_checkpoint(str(run / 'best.safetensors'))
    _train_state(str(run / 'state.safetensors'))
    (run / 'last.safetensors').write_bytes(open(best, 'rb').read())
    (run / 'summary.csv').write_text('epoch,eval_top1,eval_top5\n0,50.0,90.0\n')
    (run / 'args.yaml').write_text('model: patchhead_resnet32_cifar\n')
    return str(run), best


def test_export_overwrite_never_deletes_the_run(tmp_path, capsys):
    run, best = _run_folder(tmp_path)
    before = tree(str(tmp_path))
    for dest, message in [(run, 'is the run folder'), (str(tmp_path / 'runs'), 'contains the run folder'),
                          (str(tmp_path), 'contains the run folder'), (best, 'is not a folder')]:
        try:
            rc = hub.main(['export', '--checkpoint', best, '--output', dest, '--overwrite'])
        except SystemExit as e:  # an argument check of the command line
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and 'Traceback' not in err, err
        assert message in err or dest == best, err
        with pytest.raises(FileExistsError, match=message):
            hub.export_folder(best, dest, overwrite=True)
        assert tree(str(tmp_path)) == before, dest
    # a destination inside the run folder is fine, and a table inside the destination is refused
    assert hub.main(['export', '--checkpoint', best, '--output', os.path.join(run, 'hub')]) == 0
    table = MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), FP, [(0, 1)], [np.eye(4, dtype=bool)], [0.1], 0.1)
    table.save(os.path.join(run, 'hub', 'masks-copy.json'))
    with pytest.raises(FileExistsError, match='contains the mask table'):
        hub.export_folder(best, os.path.join(run, 'hub'), table=os.path.join(run, 'hub', 'masks-copy.json'),
                          overwrite=True)
    assert {k: v for k, v in tree(str(tmp_path)).items() if not k.startswith(os.path.join('runs', 'rpm', 'hub'))} \
        == before


def test_export_into_the_current_folder_is_refused(tmp_path, capsys, monkeypatch):
    """`hub export --output . --overwrite` ended in a traceback (renaming the current folder); the current folder
    and a folder above it are refused as a destination, with one error line."""
    run, best = _run_folder(tmp_path)
    here = tmp_path / 'elsewhere' / 'inner'
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for dest, message in (('.', 'is the current folder'), ('..', 'contains the current folder')):
        assert hub.main(['export', '--checkpoint', best, '--output', dest, '--overwrite']) == 2
        err = capsys.readouterr().err
        assert f'refusing to export into {dest}: it {message}' in err and 'Traceback' not in err, err
    assert here.is_dir() and os.listdir(here) == []


def test_a_file_name_near_the_limit_is_written_atomically(tmp_path):
    """The temporary's name added about 30 characters to the target's, so a name the file system takes (222 to 255
    bytes) could not be written; the temporary's copy of the name is cut to fit."""
    for name in ('r' * 250 + '.json', '\u00e9' * 125 + '.json'):  # 255 bytes each (é is two bytes in UTF-8)
        path = tmp_path / name
        path.write_text('old')
        atomic_write_text(str(path), 'new')
        assert path.read_text() == 'new'
    assert sorted(os.listdir(tmp_path)) == sorted(['r' * 250 + '.json', '\u00e9' * 125 + '.json'])


def test_a_file_path_ending_in_a_separator_is_refused_before_the_work(tmp_path):
    """generalise --output gen/ ran the whole measurement and then failed to write; a path that names a folder is
    refused as the flag is read."""
    import argparse
    from timm_patchmix.cli_types import new_file
    with pytest.raises(argparse.ArgumentTypeError, match="expects a file path, got 'gen/', which ends in '/'"):
        new_file('gen/')
    assert new_file('gen.json') == 'gen.json'


def test_export_table_must_match_the_model(ckpt, tmp_path, capsys):
    pairs, masks = [(0, 1), (2, 3)], [np.eye(4, dtype=bool), ~np.eye(4, dtype=bool)]
    ours = MaskTable((4, 4), 10, list(PATCHSHAPES_CLASSES), FP, pairs, masks, [0.1, 0.2], 0.15)
    ours.save(str(tmp_path / 'ours.json'))
    hub.export_folder(ckpt, str(tmp_path / 'ok'), table=str(tmp_path / 'ours.json'))
    fmnist = ['T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle boot']
    other = MaskTable((4, 4), 10, fmnist, dataset_fingerprint('fashion_mnist', fmnist), pairs, masks, [0.1, 0.2], 0.15)
    other.save(str(tmp_path / 'other.json'))
    assert hub.main(['export', '--checkpoint', ckpt, '--output', str(tmp_path / 'x'), '--table',
                     str(tmp_path / 'other.json')]) == 2
    err = capsys.readouterr().err
    assert 'does not belong to the model' in err and 'another dataset' in err, err
    # the right fingerprint but other class names (edited by hand)
    renamed = copy.deepcopy(ours)
    renamed.class_names = list(reversed(PATCHSHAPES_CLASSES))
    renamed.save(str(tmp_path / 'renamed.json'))
    with pytest.raises(CheckpointError, match='names the classes'):
        hub.export_folder(ckpt, str(tmp_path / 'x'), table=str(tmp_path / 'renamed.json'))
    # a checkpoint without class names cannot vouch for any table
    bare = tamper(ckpt, str(tmp_path / 'bare.safetensors'), lambda m: m.pop('class_names'))
    with pytest.raises(CheckpointError, match='records no class names'):
        hub.export_folder(bare, str(tmp_path / 'x'), table=str(tmp_path / 'ours.json'))
    assert not (tmp_path / 'x').exists()


def test_failed_export_leaves_no_folder(ckpt, tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError('disk full')
    monkeypatch.setattr(hub, '_model_card', broken)
    dest = tmp_path / 'new' / 'deeper' / 'repo'
    with pytest.raises(RuntimeError, match='disk full'):
        hub.export_folder(str(ckpt), str(dest))
    assert os.listdir(tmp_path) == []
    # replacing an existing folder: the old one stays as it was
    (tmp_path / 'repo').mkdir()
    (tmp_path / 'repo' / 'keep.txt').write_text('old')
    with pytest.raises(RuntimeError, match='disk full'):
        hub.export_folder(str(ckpt), str(tmp_path / 'repo'), overwrite=True)
    assert os.listdir(tmp_path) == ['repo'] and os.listdir(tmp_path / 'repo') == ['keep.txt']


# --- killed writes ---------------------------------------------------------------------------------------------
KILLED_WRITER = '''
import os, signal, sys
from timm_patchmix.checkpoint import _atomic, temp_dir
def die(tmp):
    with open(tmp, 'wb') as f:
        f.write(b'half a state')
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == 'dir':
    temp_dir(sys.argv[1])
    os.kill(os.getpid(), signal.SIGKILL)
_atomic(sys.argv[1], die)
'''


@pytest.mark.slow
def test_stale_temporaries_are_cleaned_by_the_next_run(ckpt, tmp_path):
    run = tmp_path / 'run'
    run.mkdir()

    def killed(target, kind='file'):
        r = subprocess.run([sys.executable, '-c', KILLED_WRITER, str(target), kind], env=dict(os.environ,
                           PYTHONPATH=PYPATH), capture_output=True, timeout=120)
        assert r.returncode == -9, r.stderr.decode()[-2000:]
    killed(run / 'state.safetensors')
    stale = [f for f in os.listdir(run) if f.endswith('.tmp')]
    assert len(stale) == 1 and stale[0].startswith('.state.safetensors.patchmix-')
    killed(run / 'summary.csv')  # a next run, killed too: the first one's temporary is gone, its own is left
    stale = [f for f in os.listdir(run) if f.endswith('.tmp')]
    assert len(stale) == 1 and stale[0].startswith('.summary.csv.patchmix-')
    # a temporary of a process that is still running stays
    live = run / f'.last.safetensors.patchmix-{os.getppid()}-abc123.tmp'
    live.write_bytes(b'x')
    atomic_write_text(str(run / 'summary.csv'), 'epoch\n0\n')  # the next run's first write into the folder
    assert sorted(f for f in os.listdir(run) if f.endswith('.tmp')) == [live.name]
    live.unlink()
    # the same for a killed export: its build folder goes with the next export beside it
    (tmp_path / 'hub').mkdir()
    killed(tmp_path / 'hub' / 'repo', 'dir')
    assert len([f for f in os.listdir(tmp_path / 'hub') if f.endswith('.tmp')]) == 1
    hub.export_folder(ckpt, str(tmp_path / 'hub' / 'repo'))
    assert os.listdir(tmp_path / 'hub') == ['repo']


def test_a_folder_set_aside_by_a_killed_overwrite_gets_its_name_back(ckpt, tmp_path):
    """An export --overwrite moves the old folder into a temporary, then renames the new one in. Killed between
    the two renames, the next writer beside it puts the old folder back instead of deleting it."""
    from timm_patchmix.checkpoint import SET_ASIDE, clean_stale_temps
    parent = tmp_path / 'hub'
    folder = hub.export_folder(ckpt, str(parent / 'repo'))
    before = {n: open(os.path.join(folder, n), 'rb').read() for n in os.listdir(folder)}
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    aside = parent / f'.repo.patchmix-{int(dead.stdout)}-abc123.tmp'
    aside.mkdir()
    os.replace(folder, aside / SET_ASIDE)  # the state a SIGKILL between the renames leaves
    clean_stale_temps(str(parent))
    assert os.listdir(parent) == ['repo']
    assert {n: open(os.path.join(folder, n), 'rb').read() for n in os.listdir(folder)} == before


# --- the search: hall of fame with same-class pairs, exact gene-score cache keys ------------------------------
def image_folder(root, classes, per_class=3):
    rng = np.random.default_rng(0)
    for c in range(classes):
        d = os.path.join(root, 'validation', f'c{c:02d}')
        os.makedirs(d)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(os.path.join(d, f'{i}.png'))
    return root


@pytest.fixture(scope='module')
def wide_search(tmp_path_factory):
    """A search on a 7x8 grid over 24 classes (276 cross pairs + 24 same-class): pair indices past 2**7 do not
    fit beside 56 mask bits in an int64."""
    tmp = tmp_path_factory.mktemp('wide')
    names = [f'c{c:02d}' for c in range(24)]
    data = image_folder(str(tmp / 'data'), 24)
    ck = make_checkpoint(str(tmp / 'ft.safetensors'), grid=(7, 8), num_classes=24, class_names=names,
                         data=dict(DATA, data_dir=data))
    cfg = parse_config(['--checkpoint', ck, '--output', str(tmp / 'out'), '--population', '4',
                        '--generations', '2', '--k', '1', '--no-progress', '--no-plots',
                        '--same-class-pairs', '--device', 'cpu', '--seed', '2'])
    os.makedirs(cfg.output)
    search = Search.from_checkpoint(cfg)
    search.run()
    return search


def test_hall_of_fame_keeps_individuals_that_differ_in_same_class_masks(wide_search):
    s = wide_search
    forced = s.space.forced
    saved = list(s.hof.items), list(s.hof.keys)
    try:
        _check_hof(s, forced)
    finally:
        s.hof.items, s.hof.keys = saved


def _check_hof(s, forced):
    a = copy.deepcopy(s.hof[0])
    b = copy.deepcopy(a)
    b.masks[forced[0]] ^= 1  # only the first same-class pair's mask differs
    better = min if s.evolution.fitness == 'min' else max
    a.fitness.values = (0.5,)
    b.fitness.values = (better(0.4, 0.6),)
    s.hof.clear()
    s.hof.update([a])
    s.hof.update([b])
    assert len(s.hof) == 2 and s.hof[0] is not a
    assert np.array_equal(s.hof[0].masks, b.masks)
    # the table is the best individual's, same-class masks included
    s.scorer.ensure(*b.genes(forced))
    table = s.table()
    c0 = int(s.space.pairs[forced[0]][0])
    got = table.masks[table.pairs.index((c0, c0))]
    assert grid_to_bits(got) == int(b.masks[forced[0]])


def test_cache_keys_exact_on_a_7x8_grid(wide_search):
    s = wide_search
    sc = s.scorer
    full = (1 << 56) - 1
    n = len(s.space)
    pair = np.array([0, 3, 3 + 256, 127, 128, n - 1, n - 1, 259], dtype=np.int64)
    mask = np.array([full, 5, 5, full, full, 0, full, 6], dtype=np.int64)
    keys = sc.key(pair, mask).tolist()
    assert len(set(keys)) == len(keys)
    assert keys == [(int(p) << 56) | int(m) for p, m in zip(pair, mask)]
    # genes whose pair indices are 256 apart, with one mask, have different scores; the cache keeps them apart
    rng = np.random.default_rng(0)
    found = None
    for p in range(0, n - 256):
        m = int(rng.integers(0, full + 1))
        direct = sc.score_genes(np.array([p, p + 256]), np.array([m, m]))
        if direct[0] != direct[1]:
            found = (p, m, direct)
            break
    assert found is not None
    p, m, direct = found
    sc.ensure(np.array([p, p + 256]), np.array([m, m]))
    assert sc.lookup(np.array([p, p + 256]), np.array([m, m])).tolist() == direct.tolist()
    # every individual's memoised fitness is its direct one
    for ind in s.population + list(s.hof):
        assert s.evaluate_direct(ind) == ind.fitness.values[0]
    # the state file keeps the cache exactly, and a resume reads it back
    before = dict(sc.cache)
    assert max(before) > (1 << 63)
    s.save_state()
    sc.cache = {}
    s.load_state()
    assert sc.cache == before


def test_individual_genes_round_trip_big_masks():
    ind = Individual(np.array([1, 2]), np.array([0, (1 << 56) - 1, 1 << 55, 7]), None)
    idx, masks = ind.genes(np.array([3]))
    assert idx.tolist() == [1, 2, 3] and masks.tolist() == [(1 << 56) - 1, 1 << 55, 7]


def _file_size_limit(limit):
    """Writes past ``limit`` bytes fail with EFBIG (``ulimit -f``; Python ignores SIGXFSZ), for root too."""
    import resource
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, old)


@pytest.mark.skipif(os.name != 'posix', reason='a file-size limit (resource.RLIMIT_FSIZE)')
def test_a_write_that_fails_names_its_file_and_keeps_the_one_before(tmp_path):
    """A full disk (a file-size limit here) while writing: a WriteError naming the file written, not its
    temporary (a bare OSError or safetensors' SafetensorError named no file); the file before stays, no temporary
    is left."""
    from timm_patchmix.checkpoint import WriteError, load_weights
    text, weights = tmp_path / 'a.txt', tmp_path / 'w.safetensors'
    atomic_write_text(str(text), 'before')
    save_weights(str(weights), {'w': torch.zeros(4)}, {'epoch': 0})
    restore = _file_size_limit(4096)
    try:
        with pytest.raises(WriteError, match=rf'^cannot write {text}: File too large$'):
            atomic_write_text(str(text), 'x' * 10000)
        with pytest.raises(WriteError, match=rf'^cannot write {weights}: .*File too large'):
            save_weights(str(weights), {'w': torch.zeros(10000)}, {'epoch': 1})
    finally:
        restore()
    assert text.read_text() == 'before' and load_weights(str(weights))[1]['epoch'] == 0
    assert sorted(os.listdir(tmp_path)) == ['a.txt', 'w.safetensors']
    # an error reading atomic_copy's source is not one of the file written; a full disk while copying is
    from timm_patchmix.checkpoint import atomic_copy
    with pytest.raises(FileNotFoundError) as e:
        atomic_copy(str(tmp_path / 'none'), str(tmp_path / 'b'))
    assert not isinstance(e.value, WriteError)
    (tmp_path / 'big').write_bytes(b'x' * 10000)
    restore = _file_size_limit(4096)
    try:
        with pytest.raises(WriteError, match=rf'^cannot write {tmp_path / "b"}: File too large$'):
            atomic_copy(str(tmp_path / 'big'), str(tmp_path / 'b'))
    finally:
        restore()
    assert sorted(os.listdir(tmp_path)) == ['a.txt', 'big', 'w.safetensors']
    import pickle
    again = pickle.loads(pickle.dumps(e.value if isinstance(e.value, WriteError) else WriteError(
        str(text), OSError(28, 'No space left on device'))))
    assert isinstance(again, WriteError) and str(again) == f'cannot write {text}: No space left on device'
    assert again.errno == 28 and again.path == str(text)


@pytest.mark.skipif(os.name != 'posix', reason='a file-size limit (resource.RLIMIT_FSIZE)')
def test_train_py_stops_with_one_line_when_a_file_cannot_be_written(tmp_path):
    """train.py on a full disk (a file-size limit below the first epoch's state): exit 1 with one error line naming
    state.safetensors (it was a traceback naming a temporary), args.yaml whole, no temporary left."""
    import resource
    limit = 1 << 20

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--train-subset', '32', '--val-subset', '16',
                           '-b', '16', '-j', '0', '--no-progress', '--epochs', '1', '--output', str(tmp_path),
                           '--experiment', 'full'], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          preexec_fn=small_files, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == 1, proc.stderr[-2000:]
    state = tmp_path / 'full' / 'state.safetensors'
    assert proc.stderr.strip().splitlines()[-1].startswith(f'error: cannot write {state}: ')
    assert 'Traceback' not in proc.stderr and 'File too large' in proc.stderr
    assert sorted(os.listdir(tmp_path / 'full')) == ['args.yaml']
    assert 'epochs: 1' in (tmp_path / 'full' / 'args.yaml').read_text()


@pytest.mark.parametrize('command', ['train', 'search', 'pipeline', 'study'])
def test_an_output_folder_that_cannot_be_written_in_is_refused_first(tmp_path, monkeypatch, capsys, command):
    """An existing output folder without write permission (or on a read-only file system): one error line before
    any work (it was a PermissionError traceback naming a temporary, after the data and model were built)."""
    import timm_patchmix.locking
    from timm_patchmix import pipeline, study
    from timm_patchmix.engine import run as engine_run
    from timm_patchmix.search import command as search_command
    from timm_patchmix.train import cli as train_cli
    out = tmp_path / 'ro'
    out.mkdir()
    real = os.access

    def access(path, mode, *a, **k):  # (root writes anywhere: the permission is what the check reads)
        return False if os.path.abspath(path) == str(out) and mode & os.W_OK else real(path, mode, *a, **k)
    for module in (timm_patchmix.locking.os, engine_run.os):
        monkeypatch.setattr(module, 'access', access)
    if command == 'train':
        with pytest.raises(SystemExit) as e:
            train_cli(['--epochs', '1', '--output', str(out), '--experiment', 'x'])
        err = str(e.value.code)
        assert f'{out} cannot be written in (no permission, or a read-only file system)' in err
    else:
        ckpt = str(tmp_path / 'c.safetensors')
        argv = {'search': ['--checkpoint', ckpt, '--output', str(out)], 'pipeline': ['--output', str(out)],
                'study': ['--quick', '--output', str(out)]}[command]
        if command == 'search':
            from test_search import make_checkpoint
            from timm_patchmix.search import core
            make_checkpoint(ckpt, model='patchhead_resnet8_cifar')

            def loaded(*a, **k):
                raise AssertionError('the checkpoint and the images were loaded before the folder was checked')
            monkeypatch.setattr(core.Search, 'from_checkpoint', classmethod(loaded))
        cli = {'search': search_command.cli, 'pipeline': pipeline.cli, 'study': study.cli}[command]
        try:
            rc, err = cli(argv), capsys.readouterr().err
        except SystemExit as e:  # (the search's errors exit with their message)
            rc, err = (1 if isinstance(e.code, str) else e.code), str(e.code)
        assert rc == 1 and 'Traceback' not in err
        if command == 'search':  # (checked on every process, before f_T and the images are loaded)
            assert f'error: cannot make the search folder {out}: it cannot be written in (no permission' in err
        else:
            assert f'error: cannot write in the {command} folder {out}: no permission' in err
    assert os.listdir(out) == []


def test_resuming_in_an_unwritable_run_folder_and_the_other_commands_outputs_are_refused_first(
        tmp_path, monkeypatch, capsys):
    """train.py --resume without --experiment goes on in the state's folder: one that cannot be written in was
    refused only after the data, the model and the state were loaded. robustness, demo and generalise checked
    nothing before their work, and a write that failed after it was a WriteError traceback."""
    import resource
    import timm_patchmix.locking
    from timm_patchmix import demo, robustness
    from timm_patchmix.engine import run as engine_run
    from timm_patchmix.locking import folder_problem
    from timm_patchmix.search import generalise
    from timm_patchmix.train import cli as train_cli
    ro = tmp_path / 'ro'
    ro.mkdir()
    real = os.access

    def access(path, mode, *a, **k):  # (root writes anywhere: the permission is what the check reads)
        return False if os.path.abspath(path) == str(ro) and mode & os.W_OK else real(path, mode, *a, **k)
    monkeypatch.setattr(timm_patchmix.locking.os, 'access', access)

    def built(*a, **k):
        raise AssertionError('the data and the model were built before the folder was checked')
    monkeypatch.setattr(engine_run, '_setup', built)
    (ro / 'state.safetensors').write_bytes(b'x')
    with pytest.raises(SystemExit) as e:
        train_cli(['--resume', str(ro / 'state.safetensors'), '--output', str(tmp_path / 'runs')])
    assert f'cannot write in the run folder of --resume {ro / "state.safetensors"}: {ro} cannot be written in ' \
           f'(no permission' in str(e.value.code)
    ckpt = make_checkpoint(str(tmp_path / 'w.safetensors'))

    def evaluated(*a, **k):
        raise AssertionError('evaluated before the folder was checked')
    monkeypatch.setattr(robustness, 'fgsm_accuracy', evaluated)
    monkeypatch.setattr(generalise, 'table_generalisation', evaluated)
    assert robustness.main(['--checkpoint', ckpt, '--output', str(ro)]) == 1
    assert f'error: cannot write fgsm.json in --output {ro}: {ro} cannot be written in' in capsys.readouterr().err
    assert demo.main(['--output', str(ro / 'demo')]) == 1
    assert f'error: cannot write in --output {ro / "demo"}: {ro} cannot be written in' in capsys.readouterr().err
    with pytest.raises(SystemExit, match=f'error: cannot write --output {ro / "g.json"}: {ro} cannot be written in'):
        generalise.main(['--checkpoint', ckpt, '--table', ckpt, '--output', str(ro / 'g.json')])
    assert os.listdir(ro) == ['state.safetensors']
    (tmp_path / 'afile').write_text('x')  # a link to a file: not "a link to nothing"
    os.symlink(tmp_path / 'afile', tmp_path / 'link')
    os.symlink(tmp_path / 'nowhere', tmp_path / 'dangling')
    assert folder_problem(str(tmp_path / 'link')) == (str(tmp_path / 'link'), 'is a file, not a folder')
    assert folder_problem(str(tmp_path / 'dangling')) == (str(tmp_path / 'dangling'), 'is a link to nothing')
    # a write that fails after the work (a file-size limit): one error line, not a traceback
    monkeypatch.undo()
    out = tmp_path / 'out'
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))
    try:
        rc_demo, err_demo = demo.main(['--output', str(out), '--num', '2']), capsys.readouterr().err
        rc_rob = robustness.main(['--checkpoint', ckpt, '--val-subset', '4', '--eps', '0.1', '--output', str(out)])
        err_rob = capsys.readouterr().err
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert rc_demo == 1 and f'error: cannot write {out / "patchmix_samples.png"}: File too large' in err_demo
    assert rc_rob == 1 and f'error: cannot write {out / "fgsm.json"}: File too large' in err_rob
    assert os.listdir(out) == []


@pytest.mark.skipif(not os.path.exists('/proc/self/status'), reason='reads the umask from /proc (Linux)')
def test_atomic_writes_take_the_umask_without_setting_it(tmp_path, monkeypatch):
    """A written file gets open()'s mode under the current umask, read without os.umask(), which would set the
    umask to 0 for an instant in which another thread's new file would be world-writable."""
    old = os.umask(0o027)
    try:
        def no_umask(mask):
            raise AssertionError('os.umask called while writing')
        monkeypatch.setattr(os, 'umask', no_umask)
        atomic_write_text(str(tmp_path / 'a.txt'), 'x')
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert (tmp_path / 'a.txt').stat().st_mode & 0o777 == 0o640


def test_a_training_state_given_as_weights_is_named_as_such(tmp_path):
    state = _train_state(str(tmp_path / 'state.safetensors'))
    with pytest.raises(CheckpointError, match=r'state\.safetensors is a training state \(to --resume from\), not '
                                              r'model weights: give the run\'s best\.safetensors'):
        hub.model_from_weights(state)


def _flip_a_value_byte(path):
    """Flip one bit of the last tensor byte of a safetensors file (its header and sizes stay valid)."""
    data = bytearray(open(path, 'rb').read())
    data[-1] ^= 0x10
    with open(path, 'wb') as f:
        f.write(bytes(data))


def test_a_bit_flipped_in_the_tensor_data_is_named_by_every_reader(tmp_path):
    """safetensors checks a file's header and sizes, not its bytes: one flipped bit of a weight loaded as other
    weights. Weights, training states and search states now carry the SHA-256 of their tensors, and every reader
    (load_weights, load_state, the hub, train.py --resume / --initial-checkpoint) names a file whose tensors differ;
    a file without the digest (an earlier version's, another writer's) loads as before."""
    from timm_patchmix.checkpoint import load_bundle, load_weights, save_bundle
    ckpt = make_checkpoint(str(tmp_path / 'w.safetensors'))
    with safe_open(ckpt, framework='pt') as f:
        recorded = f.metadata()['timm_patchmix.sha256']
    assert recorded == ckpt_digest(load_file(ckpt))  # the digest of the tensors as read back
    good = open(ckpt, 'rb').read()
    _flip_a_value_byte(ckpt)
    corrupt = r'w\.safetensors is corrupt: its tensors differ from those it was written with'
    for read in (load_weights, hub.model_from_weights):
        with pytest.raises(CheckpointError, match=corrupt):
            read(ckpt)
    with pytest.raises(SystemExit, match='error: .*' + corrupt):
        train_main(['--initial-checkpoint', ckpt, '--model', 'patchhead_resnet32_cifar', '--epochs', '1',
                    '--output', str(tmp_path / 'runs'), '--train-subset', '16', '--val-subset', '16', '-b', '16',
                    '-j', '0', '--no-progress'])
    # a file without the digest: not checked
    with open(ckpt, 'wb') as f:
        f.write(good)
    with safe_open(ckpt, framework='pt') as f:
        md = {k: v for k, v in f.metadata().items() if k != 'timm_patchmix.sha256'}
    save_file(load_file(ckpt), ckpt, metadata=md)
    _flip_a_value_byte(ckpt)
    load_weights(ckpt)
    # a training state and a search state
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = str(tmp_path / 'state.safetensors')
    save_state(state, model.state_dict(), opt, {'epoch': 0, 'seed': 0})
    load_state(state)
    _flip_a_value_byte(state)
    with pytest.raises(CheckpointError, match=r'state\.safetensors is corrupt'):
        load_state(state)
    bundle = str(tmp_path / 'bundle.safetensors')
    save_bundle(bundle, {'x': torch.arange(10)}, {'a': 1}, 'search_state')
    assert torch.equal(load_bundle(bundle, 'search_state')[0]['x'], torch.arange(10))
    _flip_a_value_byte(bundle)
    with pytest.raises(CheckpointError, match=r'bundle\.safetensors is corrupt'):
        load_bundle(bundle, 'search_state')


def test_a_bit_flipped_in_the_metadata_is_named(tmp_path):
    """The tensors' digest left the JSON metadata unchecked: one flipped bit of a digit in it (an epoch '7' that
    reads '5', a learning rate) kept it valid JSON of another value, which loaded. Every file the project writes
    now carries the SHA-256 of its metadata text too, which the readers check; a file without it (an earlier
    version's, another writer's) loads as before."""
    from timm_patchmix.checkpoint import load_weights
    ckpt = make_checkpoint(str(tmp_path / 'w.safetensors'), epoch=7)
    assert load_weights(ckpt)[1]['epoch'] == 7
    data = bytearray(open(ckpt, 'rb').read())
    at = bytes(data).index(b'\\"epoch\\": 7')  # the metadata is JSON text inside the header's JSON
    data[at + len(b'\\"epoch\\": ')] ^= 0x02  # '7' -> '5': one bit
    open(ckpt, 'wb').write(bytes(data))
    with safe_open(ckpt, framework='pt') as f:
        assert json.loads(f.metadata()['timm_patchmix'])['epoch'] == 5  # still valid, of another value
    for read in (load_weights, hub.model_from_weights):
        with pytest.raises(CheckpointError, match=r'w\.safetensors is corrupt: its metadata differ from what it '
                                                  r'was written with'):
            read(ckpt)
    # a file without the metadata digest: not checked
    with safe_open(ckpt, framework='pt') as f:
        md = {k: v for k, v in f.metadata().items() if k != 'timm_patchmix.meta_sha256'}
    save_file(load_file(ckpt), ckpt, metadata=md)
    assert load_weights(ckpt)[1]['epoch'] == 5


@pytest.mark.skipif(not os.path.exists('/proc/self/maps'), reason='reads the process\'s memory maps (Linux)')
def test_loaded_tensors_do_not_map_their_file(tmp_path):
    """The readers returned tensors that mapped the file; a resume's optimizer (or a search's cache) keeps them,
    so a state file replaced on the next save held its disk space until the process ended, and a resume on a
    nearly full disk failed for want of room for two states. They are copies in memory now: once read, the file
    is not mapped, and a kept tensor is the same when the file is replaced."""
    import gc
    from timm_patchmix.checkpoint import load_bundle, load_weights, save_bundle
    w = torch.randn(300, 300, generator=torch.Generator().manual_seed(0))
    for name, save, load in (('w.safetensors', lambda p, t: save_weights(p, t), load_weights),
                             ('s.safetensors', lambda p, t: save_bundle(p, t, {'generation': 0}, 'search_state'),
                              lambda p: load_bundle(p, 'search_state'))):
        path = str(tmp_path / name)
        save(path, {'w': w})
        kept = load(path)[0]['w']
        gc.collect()
        with open('/proc/self/maps') as f:
            assert path not in f.read()
        save(path, {'w': torch.zeros(300, 300)})  # (replaced atomically, as the next epoch's state is)
        assert torch.equal(kept, w)
        kept.add_(1)  # owned memory: an optimizer's in-place update
        assert torch.equal(load(path)[0]['w'], torch.zeros(300, 300))
