"""``train.py -c FILE``: a YAML file of settings (a run's ``args.yaml``) in place of the defaults, as in timm. A run's
``args.yaml`` reruns it exactly; the flags given win over the file; a bad file is a usage error that names it."""
import csv
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file

import timm_patchmix  # noqa: F401
from timm_patchmix.engine import ConfigError
from timm_patchmix.train import build_parser, main, parse_config, resolve_args

TINY = ['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress', '--epochs', '1']


def _file(tmp_path, text, name='cfg.yaml'):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _rows(path):
    with open(path) as f:
        return [{k: v for k, v in r.items() if k != 'img_s'} for r in csv.DictReader(f)]


def _record(cfg):
    return {k: v for k, v in cfg.record().items() if k != 'command'}


def test_a_runs_args_yaml_reruns_it_exactly(tmp_path):
    # settings away from every default and recipe value, so that a file that lost one would train another run
    first = main(TINY + ['--patchmix', '--patchmix-grid', '2', '--lr', '0.05', '--seed', '3', '--smoothing', '0.1',
                         '--output', str(tmp_path), '--experiment', 'first'])
    args_yaml = os.path.join(first['output'], 'args.yaml')
    again = main(['-c', args_yaml, '--experiment', 'again'])
    assert again['output'] == os.path.join(str(tmp_path), 'again')
    with open(args_yaml) as f:
        before = yaml.safe_load(f)
    with open(os.path.join(again['output'], 'args.yaml')) as f:
        after = yaml.safe_load(f)
    assert after.pop('command') == f'train.py -c {args_yaml} --experiment again'
    assert before.pop('command').startswith('train.py --train-subset 64')
    assert (before.pop('experiment'), after.pop('experiment')) == ('first', 'again')
    assert after == before
    assert after['grid'] == [2, 2] and after['lr'] == 0.05 and after['seed'] == 3 and after['smoothing'] == 0.1
    # the same training: losses, accuracies and every weight
    assert _rows(os.path.join(again['output'], 'summary.csv')) == _rows(os.path.join(first['output'], 'summary.csv'))
    w1 = load_file(os.path.join(first['output'], 'last.safetensors'))
    w2 = load_file(os.path.join(again['output'], 'last.safetensors'))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_an_lr_from_timms_rule_or_the_recipe_is_set_again_by_it(tmp_path, caplog):
    """A run records where its lr came from. From its args.yaml the rule (--lr-base x global batch / --lr-base-size)
    or the recipe sets the lr again: to the same value, or, with -b, --grad-accum-steps or --lr-base given with the
    file, to the value they give without one. An lr given by --lr is read as it is."""
    import logging
    from timm_patchmix.engine import scaled_lr
    res = main(TINY + ['--lr-base', '0.4', '--output', str(tmp_path), '--experiment', 'rule'])
    rule_yaml = os.path.join(res['output'], 'args.yaml')
    with open(rule_yaml) as f:
        recorded = yaml.safe_load(f)
    assert recorded['lr'] == pytest.approx(0.025) and recorded['lr_source'] == 'rule'  # 0.4 x 16 / 256
    assert res['rows'][0]['lr'] == pytest.approx(0.025)
    with caplog.at_level(logging.INFO, logger='timm_patchmix.train'):
        for flags, lr in (([], 0.025), (['-b', '32'], 0.05), (['--grad-accum-steps', '4'], 0.1),
                          (['--lr-base', '0.8'], 0.05), (['--lr', '0.3'], 0.3)):
            assert scaled_lr(parse_config(['-c', rule_yaml] + flags)) == pytest.approx(lr), flags
    assert 'lr 0.025 not read from the file (lr_source: rule)' in caplog.text
    # the demo recipe's lr 0.1: set again by the recipe, and --lr-base wins over it as without a file
    recipe = main(TINY + ['--output', str(tmp_path), '--experiment', 'recipe'])
    recipe_yaml = os.path.join(recipe['output'], 'args.yaml')
    with open(recipe_yaml) as f:
        assert yaml.safe_load(f)['lr_source'] == 'recipe'
    for flags in ([], ['--lr-base', '0.4'], ['--lr-base', '0.4', '-b', '32']):
        alone = scaled_lr(parse_config(TINY + flags))
        assert scaled_lr(parse_config(['-c', recipe_yaml] + flags)) == pytest.approx(alone), flags
    assert scaled_lr(parse_config(['-c', recipe_yaml, '--lr-base', '0.4'])) == pytest.approx(0.025)
    # the timm recipe has no lr of its own: timm's rule sets it, and the record says so
    assert [parse_config(['--recipe', r]).lr_source for r in ('timm', 'demo', 'paper-cifar')] == \
        ['rule', 'recipe', 'recipe']
    given = main(TINY + ['--lr', '0.07', '--output', str(tmp_path), '--experiment', 'given'])
    with open(os.path.join(given['output'], 'args.yaml')) as f:
        assert yaml.safe_load(f)['lr_source'] == 'flag'
    cfg = parse_config(['-c', os.path.join(given['output'], 'args.yaml'), '-b', '32', '--lr-base', '0.4'])
    assert cfg.lr == 0.07 and scaled_lr(cfg) == 0.07


def test_an_lr_set_through_the_python_api_after_the_recipe_or_rule_is_recorded_as_given(tmp_path):
    """dataclasses.replace(parse_config(...), lr=...) kept the recipe's lr_source: the run trained at the new lr,
    and its args.yaml, loaded with -c, set the recipe's (or the rule's) lr again, silently."""
    import dataclasses
    from timm_patchmix.engine import scaled_lr, train
    cfg = dataclasses.replace(parse_config(TINY + ['--output', str(tmp_path), '--experiment', 'api']), lr=0.01)
    res = train(cfg)
    assert res.rows[0]['lr'] == pytest.approx(0.01)
    with open(os.path.join(res.output, 'args.yaml')) as f:
        recorded = yaml.safe_load(f)
    assert recorded['lr'] == 0.01 and recorded['lr_source'] == 'flag'
    assert parse_config(['-c', os.path.join(res.output, 'args.yaml')]).lr == 0.01
    rule = dataclasses.replace(parse_config(['--lr-base', '0.4']), lr=0.01).with_recipe()
    assert rule.lr_source == 'flag' and scaled_lr(rule) == 0.01
    # unchanged lrs keep their source (the recipe's, the rule's)
    assert dataclasses.replace(parse_config(TINY), epochs=2).with_recipe().lr_source == 'recipe'
    assert dataclasses.replace(parse_config(['--lr-base', '0.4']), epochs=2).with_recipe().lr_source == 'rule'


def test_a_run_folder_and_its_resume_are_not_read_from_the_file(tmp_path, caplog):
    """A rerun from a named run's args.yaml gets a new folder (it would write over that run's files), and one from a
    resumed run's args.yaml does not resume its state."""
    import logging
    path = _file(tmp_path, f"experiment: first\nresume: {tmp_path / 'cfg.yaml'}\nepochs: 3\n")
    with caplog.at_level(logging.INFO, logger='timm_patchmix.train'):
        cfg = parse_config(['-c', path])
    assert (cfg.experiment, cfg.resume, cfg.epochs) == ('', '', 3)
    assert "experiment 'first' and resume" in caplog.text and 'not read from the file' in caplog.text
    cfg = parse_config(['-c', path, '--experiment', 'second'])
    assert cfg.experiment == 'second'


def test_a_data_folder_on_the_command_line_wins_over_the_files(tmp_path):
    a, b = tmp_path / 'a', tmp_path / 'b'
    a.mkdir(), b.mkdir()
    path = _file(tmp_path, f'data_dir: {a}\n')
    assert parse_config(['-c', path]).data_dir == str(a)
    assert parse_config(['-c', path, str(b)]).data_dir == str(b)
    assert parse_config(['-c', path, '--data-dir', str(b)]).data_dir == str(b)


def test_the_flags_given_win_over_the_file_and_the_recipe_fills_the_rest(tmp_path):
    path = _file(tmp_path, 'epochs: 5\nlr: 0.05\npatchmix: true\nbatch_size: 16\nseed: 7\n')
    spellings = (['-c', path], ['--config', path], [f'--config={path}'], [f'-c{path}'])
    for argv in [spelt + ['--epochs', '2'] for spelt in spellings] + [['--epochs', '2', '-c', path]]:
        cfg = parse_config(argv)
        assert (cfg.epochs, cfg.lr, cfg.patchmix, cfg.batch_size, cfg.seed) == (2, 0.05, True, 16, 7), argv
        # what neither sets: the demo recipe's (embedded data), and --patchmix's patch-head model
        assert (cfg.recipe, cfg.model, cfg.weight_decay, cfg.warmup_epochs) == \
            ('demo', 'patchhead_resnet32_cifar', 5e-4, 0)
    plain = parse_config(['--epochs', '2'])
    assert (plain.lr, plain.patchmix, plain.batch_size, plain.seed) == (0.1, False, 128, 42)  # no file: defaults


def test_an_empty_file_changes_nothing(tmp_path):
    assert _record(parse_config(['-c', _file(tmp_path, '')])) == _record(parse_config([]))


def test_strings_are_read_as_the_flag_reads_them(tmp_path):
    text = "lr: 1e-3\nopt_betas: ['0.9', 0.99]\nseed: '5'\ngrid: 2\nfgsm: 0.1\ndecay_milestones: '30'\n"
    assert isinstance(yaml.safe_load(text)['lr'], str)  # YAML 1.1 reads 1e-3 (no dot) as a string
    cfg = parse_config(['-c', _file(tmp_path, text), '--patchmix'])
    assert cfg.lr == 0.001 and type(cfg.lr) is float
    assert cfg.opt_betas == (0.9, 0.99) and cfg.seed == 5 and cfg.grid == (2, 2)
    # one value of a flag that takes several, as on the command line
    assert cfg.fgsm == (0.1,) and cfg.decay_milestones == (30,)
    # the values of --model-kwargs / --opt-kwargs as KEY=VALUE reads them (1e-1 reached torch's dropout as a string)
    text = "model_kwargs: {drop_rate: 1e-1, act_layer: relu, x: '[1, 2]'}\nopt: adamw\nopt_kwargs: {eps: 1e-8}\n"
    cfg = parse_config(['-c', _file(tmp_path, text)])
    assert cfg.model_kwargs == parse_config(['--model-kwargs', 'drop_rate=1e-1', 'act_layer=relu', 'x=[1, 2]'
                                             ]).model_kwargs == {'drop_rate': 0.1, 'act_layer': 'relu', 'x': [1, 2]}
    assert cfg.opt_kwargs == {'eps': 1e-8} and type(cfg.opt_kwargs['eps']) is float


def test_what_a_run_resolves_is_left_out(tmp_path):
    text = ('command: train.py --model vit_base_patch16_224\narch: vit_base_patch16_224\npatch_head: true\n'
            'data_config: {input_size: [3, 224, 224]}\nepochs: 3\n')
    cfg = parse_config(['-c', _file(tmp_path, text)])
    assert cfg.epochs == 3 and cfg.arch is None and cfg.patch_head is None and cfg.data_config is None
    assert cfg.model == 'resnet32_cifar' and cfg.command == f'train.py -c {tmp_path / "cfg.yaml"}'


@pytest.mark.parametrize('text, message', [
    ('jsd_loss: true\nepochs: 2\nsync_bn: true\n', 'unknown settings jsd_loss, sync_bn: not flags of train.py'),
    ('config: other.yaml\n', 'unknown setting config: not flags of train.py'),
    ('batch-size: 16\n', 'unknown setting batch-size'),
    ('epochs: 0\n', 'epochs: must be an integer >= 1'),
    ("epochs: '0'\n", 'epochs: must be an integer >= 1'),
    ('epochs: 2.5\n', 'epochs: must be an integer >= 1 or None, got 2.5'),
    ('smoothing: 1.0\n', 'smoothing: must be a finite number in [0, 1)'),
    ("lr: fast\n", 'lr: must be a finite number > 0'),
    ('patchmix: "on"\n', "patchmix: must be True or False, got 'on'"),
    ('sched: fancy\n', "sched: invalid choice: 'fancy'"),
    ('opt_betas: {a: 1}\n', 'opt_betas: must be None or a sequence of one or more values'),
    ("fgsm: [0.1, '-1']\n", 'fgsm: must be a finite number >= 0'),
    ('cutmix_minmax: [0.2]\n', 'cutmix_minmax: must be None or a sequence of 2 values'),
    ('grid: [2, 2, 2]\n', 'grid: takes P or rows cols, got 3 values'),
    ('grid: 2\npatchmix_grid: 2\n', 'gives both grid and patchmix_grid'),
    ('model_kwargs: [1, 2]\n', 'model_kwargs: must be a dict of keyword arguments by name'),
    ('initial_checkpoint: missing.safetensors\n', "initial_checkpoint: file 'missing.safetensors' does not exist"),
    ('model: 7\n', 'model: must be a string or None, got 7'),
    ('- epochs\n- 2\n', "must map setting names to values (as a run's args.yaml does), got a list"),
    ('epochs: [1\n', 'not a readable YAML file'),
    ('1: 2\n', 'must map setting names to values'),
])
def test_a_bad_file_is_named_with_what_is_wrong(tmp_path, text, message):
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        parse_config(['-c', path])
    assert e.value.flag == '-c/--config'
    assert e.value.message.startswith(f'{path}: ') and message in e.value.message, e.value.message


@pytest.mark.parametrize('make, message', [(lambda p: p / 'nothing.yaml', 'no such file'),
                                           (lambda p: p, 'not a file')])
def test_a_missing_file_is_named(tmp_path, make, message):
    path = str(make(tmp_path))
    with pytest.raises(ConfigError, match=f'{path}: {message}'):
        parse_config(['-c', path])


def test_on_the_command_line_a_bad_file_is_a_usage_error(tmp_path, capsys):
    path = _file(tmp_path, 'sync_bn: true\n')
    with pytest.raises(SystemExit) as e:
        resolve_args(['-c', path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f'error: argument -c/--config: {path}: unknown setting sync_bn' in err
    with pytest.raises(SystemExit) as e:
        main(['-c', path, '--output', str(tmp_path / 'out')])
    assert e.value.code == 2 and not os.path.exists(tmp_path / 'out')  # nothing is written


def test_an_abbreviated_config_flag_is_refused(tmp_path, capsys):
    path = _file(tmp_path, 'epochs: 3\n')
    with pytest.raises(SystemExit) as e:
        parse_config(['--conf', path])
    assert e.value.code == 2 and 'write the flag in full' in capsys.readouterr().err


def test_the_help_offers_it():
    text = build_parser().format_help()
    assert '-c FILE, --config FILE' in text and "-c output/train/<run>/args.yaml" in text


def test_a_run_config_derived_with_another_batch_records_the_lr_it_trains_at(tmp_path):
    """A run's resolved config (TrainResult.config: the rule's lr filled in, lr_source 'rule') derived with
    dataclasses.replace trained at its lr but recorded lr_source 'rule', so -c args.yaml set the rule's lr for the
    new batch size (or dropped an lr the caller set): the rerun trained at another lr. Where the rule gives the
    derived config another lr, the lr is now recorded as given; an unchanged batch keeps the rule."""
    import dataclasses
    from timm_patchmix.engine import train
    first = train(parse_config(TINY + ['--lr-base', '0.4', '--output', str(tmp_path), '--experiment', 'a']))
    assert first.config.lr == pytest.approx(0.025) and first.config.lr_source == 'rule'  # 0.4 x 16 / 256
    for name, change, lr, source in (('b', dict(batch_size=32), 0.025, 'flag'), ('c', dict(lr=0.5), 0.5, 'flag'),
                                     ('d', dict(epochs=2), 0.025, 'rule')):
        res = train(dataclasses.replace(first.config, experiment=name, **change))
        assert res.rows[0]['lr'] == pytest.approx(lr) and res.config.lr_source == source, name
        path = os.path.join(res.output, 'args.yaml')
        with open(path) as f:
            recorded = yaml.safe_load(f)
        assert recorded['lr'] == pytest.approx(lr) and recorded['lr_source'] == source, name
        rerun = parse_config(['-c', path])
        assert rerun.batch_size == res.config.batch_size
        assert (rerun.lr == pytest.approx(lr)) if source == 'flag' else (rerun.lr is None and rerun.lr_base == 0.4)
