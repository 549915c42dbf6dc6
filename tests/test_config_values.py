"""Values given in Python are checked as the command line checks them: a :class:`TrainConfig` refuses a value of the
wrong type or outside its flag's range when it is built (a ``ConfigError`` naming the flag, the field, what it takes
and the value given), before anything is written; the command line and the config agree on every numeric bound
(one table, ``engine.config.VALUE_TYPES``); ``SearchConfig`` takes real bools; a negative subset is refused; and
``main(argv)`` leaves the caller's logging configuration alone while the command lines still print INFO lines."""
import dataclasses
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

import timm_patchmix  # noqa: F401
from timm_patchmix import train as train_cli
from timm_patchmix.cli_types import Bounds, bounds_of
from timm_patchmix.data import build_dataset, subset_indices
from timm_patchmix.engine import ConfigError, TrainConfig, TrainSetupError
from timm_patchmix.engine.config import PATHS, RECIPES, SEQUENCES, UNFLAGGED, VALUE_TYPES, DataConfig
from timm_patchmix.search import SearchConfig
from timm_patchmix.search import command as search_command
from timm_patchmix.search.config import VALUE_TYPES as SEARCH_VALUE_TYPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# settings another one must accompany (a combination check would refuse them alone)
CONTEXT = {'test_subset': dict(holdout=0.1), 'model_ema_decay': dict(model_ema=True),
           'bce_target_thresh': dict(bce_loss=True), 'bce_pos_weight': dict(bce_loss=True), 'recount': dict(reprob=0.5)}
CONTEXT_FLAGS = {'test_subset': ['--holdout', '0.1'], 'model_ema_decay': ['--model-ema'],
                 'bce_target_thresh': ['--bce-loss'], 'bce_pos_weight': ['--bce-loss'],
                 'recount': ['--reprob', '0.5']}  # (--recount at any value needs --reprob on the command line)


def flag_of(name):
    return '--patchmix-grid' if name == 'grid' else '--' + name.replace('_', '-')


def build(name, value):
    return TrainConfig(**dict(CONTEXT.get(name, {}), **{name: value}))


# --- bad values, each refused when the config is built --------------------------------------------------------------
# (field, value): the cases of the report, and more of each kind
NAMED_BAD = [
    ('epochs', -1), ('epochs', 0), ('epochs', 1.5), ('epochs', '1'), ('epochs', True),
    ('smoothing', 2.0), ('smoothing', 1.0), ('smoothing', -0.1), ('smoothing', '0.1'),
    ('img_size', '32'), ('img_size', 32.0), ('input_size', (3, 32)), ('input_size', (3, 32, 32, 32)),
    ('input_size', (3, 32.0, 32)), ('input_size', (3, 0, 32)), ('input_size', '3 32 32'), ('input_size', 32),
    ('lr', '0.1'), ('lr', 0.0), ('lr', -0.1), ('lr', float('nan')), ('lr', float('inf')), ('lr', False),
    ('momentum', '0.9'), ('weight_decay', '0'), ('weight_decay', -1e-4),
    ('train_subset', '64'), ('train_subset', -5), ('train_subset', 0), ('train_subset', 64.0),
    ('val_subset', -1), ('test_subset', 0), ('seed', '1'), ('seed', 1.0), ('seed', None), ('seed', True),
    ('log_interval', 0), ('drop', 2.0), ('drop', -0.5), ('drop_path', 1.5),
    ('patchmix', 'no'), ('patchmix', 1), ('patchmix', None), ('patchmix', np.bool_(True)),
    ('mixup', -1.0), ('cutmix', float('inf')), ('mixup_prob', 1.01), ('mixup_off_epoch', -1),
    ('fgsm', (-0.1,)), ('fgsm', ()), ('fgsm', 0.1), ('fgsm', ('0.1',)), ('fgsm', (0.1, float('nan'))),
    ('holdout', '0.1'), ('holdout', 1.0), ('holdout', -0.1), ('holdout_seed', -1), ('holdout_seed', '0'),
    ('patch_loss_weight', '1'), ('patch_loss_weight', -1.0), ('patchmix_alpha', 0), ('patchmix_prob', 2.0),
    ('opt_betas', (0.9, 1.0)), ('opt_betas', ()), ('opt_eps', -1e-8), ('clip_grad', -1.0),
    ('cutmix_minmax', (0.2,)), ('cutmix_minmax', (0.2, 1.5)), ('cutmix_minmax', (0.2, 0.5, 0.8)),
    ('grid', 4.0), ('grid', '4'), ('grid', (2, 3, 4)), ('grid', 0), ('grid', True), ('grid', (2, 0)),
    ('workers', -1), ('workers', 2.0), ('batch_size', 0), ('batch_size', '32'), ('validation_batch_size', -4),
    ('num_classes', 0), ('in_chans', 0), ('lr_base', 0.0), ('lr_base_size', 0), ('min_lr', -0.1),
    ('warmup_lr', -0.1), ('warmup_epochs', -1), ('cooldown_epochs', 1.5), ('decay_epochs', 0),
    ('decay_rate', 0), ('guided_prob', 1.5), ('random_prob', -0.1), ('patchmix_off_epoch', -2),
    ('mixup_switch_prob', 'half'),
    ('amp', 'no'), ('dataset_download', 'yes'), ('pretrained', 0), ('no_progress', 'false'),
    ('model', 5), ('dataset', None), ('output', 5), ('data_dir', None), ('resume', b'state'), ('device', 0),
    ('experiment', None), ('opt', 0.1), ('command', ['train.py']),
    ('model_kwargs', 'drop_rate=0.1'), ('model_kwargs', {1: 2}), ('model_kwargs', [('drop_rate', 0.1)]),
    ('data_config', {'input_size': (3, 32, 32)}), ('patch_head', 'yes'), ('arch', 1),
    ('clip_mode', 'l1'), ('sched', 5), ('amp_dtype', 'fp16'),
]


def _generated_bad():
    """For every numeric field: each side of its range, a string, a bool; a float for an integer field, NaN and
    infinity for a float field."""
    cases = []
    for name, parse in VALUE_TYPES.items():
        b = bounds_of(parse)
        values = [str(b.lo if b.lo is not None else 1), True]
        if b.kind == 'int':
            values += [1.0]
            if b.lo is not None:
                values.append(int(b.lo) - 1)
            if b.hi is not None:
                values.append(int(b.hi) + 1)
        else:
            values += [float('nan'), float('inf'), -float('inf')]
            if b.lo is not None:
                values += [b.lo - 0.5] + ([b.lo] if b.lo_open else [])
            if b.hi is not None:
                values += [b.hi + 0.5] + ([b.hi] if b.hi_open else [])
        for v in values:
            cases.append((name, tuple([v] * SEQUENCES[name][0]) if name in SEQUENCES else v))
    return cases


def _ids(cases):
    return [f'{n}={v!r}' for n, v in cases]


def _expect_refused(name, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        TrainConfig(**dict(dict(CONTEXT.get(name, {}), output=str(tmp_path / 'out'), experiment='x'),
                           **{name: value}))
    err = e.value
    assert isinstance(err, ValueError) and not isinstance(err, (AssertionError, TypeError))
    text = str(err)
    assert f'TrainConfig.{name}' in text, text
    if name not in UNFLAGGED:
        assert err.flag == flag_of(name), text
        assert text.startswith(f'argument {flag_of(name)}: '), text
    if name != 'grid':  # the grid's messages name its cells
        assert repr(value) in text or repr(tuple(value) if isinstance(value, list) else value) in text, text
    assert 'must be' in text or 'invalid choice' in text or 'takes P or rows cols' in text, text
    assert list(tmp_path.iterdir()) == [], 'building a config wrote to disk'
    return text


@pytest.mark.parametrize('name, value', NAMED_BAD, ids=_ids(NAMED_BAD))
def test_bad_value_is_refused_when_built(name, value, tmp_path, monkeypatch):
    _expect_refused(name, value, tmp_path, monkeypatch)


GENERATED_BAD = _generated_bad()


@pytest.mark.parametrize('name, value', GENERATED_BAD, ids=_ids(GENERATED_BAD))
def test_every_numeric_bound_is_checked(name, value, tmp_path, monkeypatch):
    text = _expect_refused(name, value, tmp_path, monkeypatch)
    if name != 'grid':
        assert bounds_of(VALUE_TYPES[name]).want in text, text  # what the setting takes, as the flag says it


def test_messages_say_what_is_expected():
    with pytest.raises(ConfigError, match=r"^argument --epochs: must be an integer >= 1 or None, got -1 "
                                          r"\(TrainConfig\.epochs\)$"):
        TrainConfig(epochs=-1)
    with pytest.raises(ConfigError, match=r"argument --train-subset: must be an integer >= 1 or None, got -5"):
        TrainConfig(train_subset=-5)
    with pytest.raises(ConfigError, match=r"argument --patchmix: must be True or False, got 'no'"):
        TrainConfig(patchmix='no')
    with pytest.raises(ConfigError, match=r"argument --input-size: must be None or a sequence of 3 values, each an "
                                          r"integer >= 1, got \(3, 32\)"):
        TrainConfig(input_size=(3, 32))
    with pytest.raises(ConfigError, match=r"^TrainConfig\.patch_head must be True, False or None, got 'yes'$") as e:
        TrainConfig(patch_head='yes')
    assert e.value.flag is None  # no flag sets it


def test_a_derived_config_is_checked_too():
    cfg = TrainConfig()
    with pytest.raises(ConfigError, match='TrainConfig.epochs'):
        dataclasses.replace(cfg, epochs=0)
    with pytest.raises(ConfigError, match='TrainConfig.smoothing'):
        dataclasses.replace(cfg.with_recipe(), smoothing=1.0)


def test_bad_values_come_before_combinations():
    # a string --mixup with --patchmix is a bad value, not a TypeError in the combination check
    with pytest.raises(ConfigError, match='TrainConfig.mixup'):
        TrainConfig(patchmix=True, mixup='0.2')
    with pytest.raises(ConfigError, match='TrainConfig.guided_prob'):
        TrainConfig(patchmix=True, patchmix_table='masks.json', guided_prob='0.5')


# --- valid values -----------------------------------------------------------------------------------------------
def test_defaults_and_recipes_construct(tmp_path):
    cfg = TrainConfig()
    assert dataclasses.replace(cfg) == cfg
    for recipe in RECIPES:
        full = TrainConfig(recipe=recipe).with_recipe()
        assert dataclasses.replace(full) == full
        with_patchmix = TrainConfig(recipe=recipe, patchmix=True).with_recipe()
        assert with_patchmix.model.startswith('patchhead_')
    # every default of every field is valid, and so is None where None is the default
    for name, f in FIELDS.items():
        if f.default is not dataclasses.MISSING:
            TrainConfig(**{name: f.default})
    resolved = dataclasses.replace(cfg, arch='resnet32_cifar', patch_head=False, grid=(4, 4), num_classes=10,
                                   data_config=DataConfig((3, 32, 32), (0.5,) * 3, (0.5,) * 3))
    assert resolved.patch_head is False


def _boundary_values(name):
    """Values at the edges of a field's range that it takes."""
    b = bounds_of(VALUE_TYPES[name])
    out = []
    if b.lo is not None:
        out.append(b.lo + (1 if b.kind == 'int' else 1e-3) if b.lo_open else b.lo)
    if b.hi is not None:
        out.append(b.hi - 1e-3 if b.hi_open else b.hi)
    if b.lo is None and b.hi is None:
        out += [-1, 0, 1]
    return [int(v) if b.kind == 'int' else v for v in out]


@pytest.mark.parametrize('name', sorted(VALUE_TYPES))
def test_boundary_values_are_taken(name):
    for v in _boundary_values(name):
        value = tuple([v] * SEQUENCES[name][0]) if name in SEQUENCES else v
        cfg = build(name, value)
        assert getattr(cfg, name) == ((v, v) if name == 'grid' else value)
        if FIELDS[name].default is None:
            assert getattr(build(name, None), name) is None


def test_numpy_numbers_and_paths_are_taken_as_python_values(tmp_path):
    cfg = TrainConfig(epochs=np.int64(3), lr=np.float32(0.5), smoothing=np.float64(0.1),
                      input_size=np.array([3, 32, 32]), fgsm=[np.float32(0.1)], grid=np.int64(2),
                      output=tmp_path / 'out', data_dir=pathlib.Path('data'), model_kwargs=None)
    assert type(cfg.epochs) is int and type(cfg.lr) is float and type(cfg.input_size[0]) is int
    assert cfg.input_size == (3, 32, 32) and cfg.grid == (2, 2) and type(cfg.grid[0]) is int
    assert cfg.output == str(tmp_path / 'out') and cfg.data_dir == 'data' and cfg.model_kwargs == {}
    yaml.safe_dump(cfg.record())  # args.yaml can record it
    assert TrainConfig(lr=1).lr == 1 and TrainConfig(drop=0).drop == 0  # an int where a float goes


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, TrainSetupError) and issubclass(ConfigError, ValueError)


def test_every_field_is_checked():
    """Each field is a number of the table, a switch, a string, or one of the three others; a new numeric field
    must join the table (and so its flag's type)."""
    from timm_patchmix.engine import config
    numeric = {n for n, f in FIELDS.items() if f.type.replace('Optional[', '').rstrip(']') in ('int', 'float')
               or f.type.startswith(('Tuple', 'Optional[Tuple'))}
    assert numeric == set(VALUE_TYPES)
    rest = set(FIELDS) - set(VALUE_TYPES) - set(config._BOOLS) - set(config._STRINGS)
    assert rest == {'model_kwargs', 'opt_kwargs', 'data_config'} and set(config.KWARGS) == rest - {'data_config'}
    for name in config.KWARGS:  # keyword arguments by name, checked as such
        flag = '--' + name.replace('_', '-')
        with pytest.raises(ConfigError, match=f'argument {flag}: must be a dict of keyword arguments by name'):
            TrainConfig(**{name: [('a', 1)]})
        with pytest.raises(ConfigError, match=f'argument {flag}: must be a dict'):
            TrainConfig(**{name: {1: 2}})
        assert getattr(TrainConfig(**{name: {'a': 1}}), name) == {'a': 1}
    assert set(PATHS) <= set(config._STRINGS) and set(UNFLAGGED) <= set(FIELDS)


# --- the command line and the config agree -------------------------------------------------------------------------
def _actions(parser):
    return {a.dest: a for a in parser._actions if a.option_strings}


def test_numeric_flags_take_their_types_from_the_table():
    actions = _actions(train_cli.build_parser())
    numeric = {}
    for dest, a in actions.items():
        if bounds_of(a.type) is not None:
            numeric['grid' if dest == 'patchmix_grid' else dest] = a
    assert set(numeric) == set(VALUE_TYPES)
    for name, a in numeric.items():
        assert a.type is VALUE_TYPES[name], name
        assert flag_of(name) in a.option_strings
        nargs = {None: None, 3: (3, 3), 2: (2, 2), '+': (1, None)}[a.nargs]
        # argparse has no "1 to 2": for these two, the config checks the upper bound (a usage error too)
        assert nargs == (None if name not in SEQUENCES else (1, None) if name in ('grid', 'lr_noise')
                         else SEQUENCES[name]), name
    # every other field but the unflagged ones has a flag of its name
    for name in set(FIELDS) - set(UNFLAGGED) - {'grid'}:
        assert name in actions, name


def _texts(name, types=VALUE_TYPES):
    """Values as text at and around the edges of the range of ``types[name]``, and some within it."""
    b = bounds_of(types[name])
    vals = {'-1', '0', '1', '1.5', '0.5', 'nan', 'inf', '2', '3'}
    for edge in (b.lo, b.hi):
        if edge is not None:
            for d in ((-1, 0, 1) if b.kind == 'int' else (-0.5, -0.001, 0, 0.001, 0.5)):
                vals.add(repr(edge + d) if b.kind != 'int' else str(int(edge) + d))
    return sorted(vals)


def _py(text):
    try:
        return int(text)
    except ValueError:
        return float(text)


def _cli_takes(argv, capsys):
    try:
        cfg = train_cli.resolve_args(argv)
    except SystemExit as e:
        assert e.code == 2
        capsys.readouterr()
        return None
    return cfg


@pytest.mark.parametrize('name', sorted(VALUE_TYPES))
def test_cli_and_config_agree_on_bounds(name, capsys):
    """Each value at and around the edges of a field's range: the command line takes it (as text) exactly when the
    config takes it (as a number), and both keep the same value."""
    count = SEQUENCES.get(name, (1, 1))[0]
    for text in _texts(name):
        value = _py(text)
        cli = _cli_takes(CONTEXT_FLAGS.get(name, []) + [flag_of(name)] + [text] * count, capsys)
        try:
            cfg = build(name, tuple([value] * count) if name in SEQUENCES else value)
        except ConfigError:
            cfg = None
        assert (cli is None) == (cfg is None), f'{flag_of(name)} {text}: command line {cli is not None}, ' \
                                               f'config {cfg is not None}'
        if cli is not None:
            a, b = getattr(cli, name), getattr(cfg, name)
            assert a == b or (isinstance(a, float) and math.isclose(a, b)), (name, text, a, b)


@pytest.mark.parametrize('name', sorted(SEQUENCES))
def test_cli_and_config_agree_on_lengths(name, capsys, tmp_path):
    v = '0.5' if bounds_of(VALUE_TYPES[name]).kind == 'float' else '2'
    for n in range(0, 5):
        # the positional DIR first, so that a value too many is one the command line cannot place
        cli = _cli_takes([str(tmp_path), flag_of(name)] + [v] * n, capsys)
        try:
            cfg = build(name, tuple([_py(v)] * n))
        except ConfigError:
            cfg = None
        assert (cli is None) == (cfg is None), (name, n)


def test_cli_messages_unchanged(capsys):
    with pytest.raises(SystemExit):
        train_cli.resolve_args(['--epochs', '0'])
    assert "error: argument --epochs: must be an integer >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_cli.resolve_args(['--seed', 'x'])
    assert "error: argument --seed: must be an integer in [-2**63, 2**64 - 2**32], got 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (torch's generators overflowed at the first epoch)
        train_cli.resolve_args(['--seed', str(2 ** 64)])
    assert f"error: argument --seed: must be an integer in [-2**63, 2**64 - 2**32], got '{2 ** 64}'" \
        in capsys.readouterr().err
    assert train_cli.resolve_args(['--seed', str(2 ** 63)]).seed == 2 ** 63  # (such seeds trained before: kept)


def test_bounds_check_python_values():
    b = Bounds('float', 0.0, 1.0, hi_open=True)
    assert b.accepts(0) and b.accepts(0.5) and not b.accepts(1.0) and not b.accepts(True)
    assert not b.accepts('0.5') and not b.accepts(float('nan')) and b.want == 'a finite number in [0, 1)'
    i = Bounds('int', 1)
    assert i.accepts(np.int32(3)) and not i.accepts(3.0) and not i.accepts(0) and not i.accepts(False)
    assert bounds_of(int) == Bounds('int') and bounds_of(str) is None


# --- SearchConfig ------------------------------------------------------------------------------------------------
SEARCH_BOOLS = ('same_class_pairs', 'amp', 'channels_last', 'resume', 'progress', 'plots')


@pytest.mark.parametrize('name', SEARCH_BOOLS)
@pytest.mark.parametrize('value', ['no', 'yes', 1, 0, None, np.bool_(True)])
def test_search_config_takes_real_bools(name, value):
    with pytest.raises(ValueError, match=rf'^{name} must be True or False, got {value!r}$'):
        SearchConfig(checkpoint='ft.safetensors', **{name: value})


@pytest.mark.parametrize('name', ['dataset', 'data_dir', 'val_split', 'device'])
def test_search_config_names_are_strings(name):
    with pytest.raises(ValueError, match=rf'^{name} must be a string or None, got 5$'):
        SearchConfig(checkpoint='ft.safetensors', **{name: 5})


def test_search_numeric_flags_take_their_types_from_the_table():
    actions = _actions(search_command.build_parser())
    numeric = {dest for dest, a in actions.items() if bounds_of(a.type) is not None} - {'grid'}
    assert numeric == set(SEARCH_VALUE_TYPES)
    for name in numeric:
        assert actions[name].type is SEARCH_VALUE_TYPES[name], name
        assert '--' + name.replace('_', '-') in actions[name].option_strings


@pytest.mark.parametrize('name', sorted(SEARCH_VALUE_TYPES))
def test_search_cli_and_config_agree_on_bounds(name, capsys):
    """As for train.py: search.py's flag takes a value (as text) exactly when SearchConfig takes it (as a number),
    and both keep the same value of Python's own type."""
    for text in _texts(name, SEARCH_VALUE_TYPES):
        value = _py(text)
        try:
            cli = search_command.parse_config(['--checkpoint', __file__, '--' + name.replace('_', '-'), text])
        except SystemExit as e:
            assert e.code == 2
            capsys.readouterr()
            cli = None
        try:
            cfg = SearchConfig(checkpoint=__file__, **{name: value})
        except ValueError as e:
            assert str(e).startswith(f'{name} must be {bounds_of(SEARCH_VALUE_TYPES[name]).want}'), str(e)
            cfg = None
        took = f'command line {cli is not None}, config {cfg is not None}'
        assert (cli is None) == (cfg is None), f'--{name} {text}: {took}'
        if cli is not None:
            assert getattr(cli, name) == getattr(cfg, name) and type(getattr(cli, name)) is type(getattr(cfg, name))


KEPT = [('population', np.int64(8), 8), ('k', np.int32(3), 3), ('cxpb', np.float32(0.25), 0.25), ('mutpb', 1, 1.0),
        ('n_active', np.int16(2), 2)]


@pytest.mark.parametrize('name, value, want', KEPT)
def test_search_config_keeps_python_numbers(name, value, want):
    cfg = SearchConfig(checkpoint='ft.safetensors', **{name: value})
    got = getattr(cfg, name)
    assert got == want and type(got) is type(want)
    assert type(getattr(cfg.evolution(), name, want)) is type(want)
    json.dumps(cfg.record())  # numpy scalars would not go into the table's JSON


@pytest.mark.parametrize('name, value', [('population', 3.0), ('k', '4'), ('cxpb', float('nan')), ('seed', True),
                                         ('n_active', 0), ('val_subset', -5), ('hof', np.float64(2.0))])
def test_search_config_refuses(name, value):
    with pytest.raises(ValueError, match=rf'^{name} must be '):
        SearchConfig(checkpoint='ft.safetensors', **{name: value})


def test_search_config_defaults_construct():
    cfg = SearchConfig(checkpoint='ft.safetensors')
    for name in SEARCH_BOOLS:
        assert cfg.replace(**{name: not getattr(cfg, name)})
    assert cfg.replace(dataset='patchshapes', data_dir='', val_split='holdout', device='cpu')


# --- subsets -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('subset', [-5, -1, 1.5, '3', True])
def test_a_negative_subset_is_refused(subset):
    with pytest.raises(ValueError, match=r'subset must be an integer >= 0 or None'):
        subset_indices(range(10), subset)
    with pytest.raises(ValueError, match=r'subset must be an integer >= 0 or None'):
        build_dataset('no_such_dataset_opened', subset=subset)  # before the dataset is opened


def test_subsets_keep_their_rule():
    assert subset_indices(range(10), None) == list(range(10)) and subset_indices(range(3), 10) == [0, 1, 2]
    assert subset_indices(range(10), 0) == [] and len(subset_indices(range(10), np.int64(4))) == 4


# --- logging -----------------------------------------------------------------------------------------------------
@pytest.fixture
def bare_root(monkeypatch):
    """Makes the root logger as a Python program that configured nothing has it, and returns it: pytest's own
    capture handlers (added at the start of each test phase) out of the way, so that a ``logging.basicConfig``
    would take effect. Restored afterwards."""
    root = logging.getLogger()
    level = root.level
    monkeypatch.setattr(root, 'handlers', [])

    def bare():
        root.handlers.clear()
        root.setLevel(logging.WARNING)
        return root

    yield bare
    root.setLevel(level)


TINY = ['--train-subset', '32', '--val-subset', '16', '-b', '16', '-j', '0', '--no-progress', '--device', 'cpu',
        '--epochs', '1']


def test_train_main_leaves_the_callers_logging_alone(bare_root, tmp_path):
    root = bare_root()
    result = train_cli.main(TINY + ['--output', str(tmp_path), '--experiment', 'e'])
    assert result['rows']
    assert root.handlers == [] and root.level == logging.WARNING


def _fake_search(cfg):
    logging.getLogger('timm_patchmix.search.fake').info('an INFO line of the search')
    table = SimpleNamespace(pairs=[(0, 1)])
    return SimpleNamespace(best_fitness=0.5, table=table, table_path=os.path.join(cfg.output, 'masks.json'))


def test_search_main_leaves_the_callers_logging_alone(bare_root, tmp_path, monkeypatch):
    ckpt = tmp_path / 'ft.safetensors'
    ckpt.write_bytes(b'not read')
    monkeypatch.setattr(search_command, 'search', _fake_search)
    root = bare_root()
    search_command.main(['--checkpoint', str(ckpt), '--output', str(tmp_path / 'out')])
    assert root.handlers == [] and root.level == logging.WARNING


def test_the_command_lines_print_info_lines(bare_root, tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / 'ft.safetensors'
    ckpt.write_bytes(b'not read')
    monkeypatch.setattr(search_command, 'search', _fake_search)
    root = bare_root()
    assert search_command.cli(['--checkpoint', str(ckpt), '--output', str(tmp_path / 'out')]) == 0
    assert 'an INFO line of the search\n' in capsys.readouterr().err  # '%(message)s', as before
    assert root.level == logging.INFO and len(root.handlers) == 1

    def fake_train(cfg, on_step=None):
        logging.getLogger('timm_patchmix.engine.fake').info('an INFO line of the run')
        return SimpleNamespace(as_dict=lambda: {})

    root = bare_root()
    monkeypatch.setattr(train_cli, 'train', fake_train)
    assert train_cli.cli(TINY + ['--output', str(tmp_path)]) == 0
    assert 'an INFO line of the run\n' in capsys.readouterr().err
    assert root.level == logging.INFO


def test_train_py_prints_info_lines(tmp_path):
    proc = subprocess.run([sys.executable, 'train.py', *TINY, '--output', str(tmp_path), '--experiment', 'e'],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.startswith('Data processing configuration for current model + dataset:\n'), proc.stderr
    assert 'epoch 0:' in proc.stdout


def test_channels_come_from_one_rule():
    """The data's channels, which the model, the normalisation and the ``--model-kwargs`` check share: ``--in-chans``,
    else the first value of ``--input-size``, else the model's own (None here)."""
    assert TrainConfig().channels is None
    assert TrainConfig(in_chans=1).channels == 1
    assert TrainConfig(input_size=(1, 28, 28)).channels == 1
    assert TrainConfig(in_chans=3, input_size=(3, 32, 32)).channels == 3
    with pytest.raises(ConfigError, match=r'images load as greyscale \(1 channel\) or RGB \(3\), so the data cannot '
                                          r'have 4 channels'):  # (any other count failed mid-epoch)
        TrainConfig(in_chans=4, input_size=(4, 32, 32))
    with pytest.raises(ConfigError, match=r'--in-chans 1 and --input-size 3 32 32 name different channel counts'):
        TrainConfig(in_chans=1, input_size=(3, 32, 32))
    with pytest.raises(ConfigError, match=r'in_chans=1 differs from the 3 channels'):
        TrainConfig(model_kwargs={'in_chans': 1})
    assert TrainConfig(input_size=(1, 28, 28), model_kwargs={'in_chans': 1}).channels == 1
