"""The package as a newcomer meets it: the console commands, what `import timm_patchmix` loads and gives, the help of
every command line this page covers, the metadata files, and the links of the front page and docs."""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import yaml

import timm_patchmix
from timm_patchmix import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # the tree first
ENV = dict(os.environ, PYTHONPATH=PYPATH, COLUMNS='120')
SCRIPTS = ('timm-patchmix', 'timm-patchmix-train', 'timm-patchmix-search', 'timm-patchmix-pipeline')


def script(name):
    """The installed console script (next to this interpreter, else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    path = here if os.path.isfile(here) else shutil.which(name)
    if path is None:
        pytest.fail(f'{name} is not installed: run pip install -e . to create the console scripts')
    return path


def run(*argv, timeout=300):
    return subprocess.run(list(argv), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


# --- console scripts ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_console_scripts_run():
    top = run(script('timm-patchmix'), '--help')
    assert top.returncode == 0, top.stderr
    for name in cli.COMMANDS:
        assert name in top.stdout
    bad = run(script('timm-patchmix'), 'train', '--no-such-flag')
    assert bad.returncode == 2 and 'unrecognized arguments: --no-such-flag' in bad.stderr
    unknown = run(script('timm-patchmix'), 'nonsense')
    assert unknown.returncode == 2 and "invalid choice: 'nonsense'" in unknown.stderr


def test_entry_points_name_the_commands():
    eps = {ep.name: ep for ep in entry_points(group='console_scripts') if ep.name.startswith('timm-patchmix')}
    assert set(eps) == set(SCRIPTS), 'reinstall (pip install -e .) after changing setup.cfg'
    for ep in eps.values():
        assert ep.value.startswith('timm_patchmix.cli:') and callable(ep.load())


@pytest.mark.parametrize('command', list(cli.COMMANDS))
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, '--help'])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f'usage: timm-patchmix {command}')


@pytest.mark.parametrize('alias, command', [(cli.train, 'train'), (cli.search, 'search'),
                                            (cli.pipeline, 'pipeline')])
def test_aliases_run_the_same_command(alias, command, capsys):
    with pytest.raises(SystemExit) as e:
        alias(['--help'])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f'usage: timm-patchmix-{command}')


def test_unknown_or_missing_command_is_a_usage_error(capsys):
    for argv in ([], ['bogus'], ['--bogus']):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert 'usage: timm-patchmix' in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(['--version'])
    assert e.value.code == 0 and timm_patchmix.__version__ in capsys.readouterr().out


def test_subcommand_exit_status_passes_through(tmp_path, capsys):
    """A subcommand's own status comes back unchanged: 0 for a demo run, 2 for a flag it refuses."""
    assert cli.main(['demo', '--output', str(tmp_path), '--num', '2']) == 0
    assert (tmp_path / 'patchmix_samples.png').is_file()
    with pytest.raises(SystemExit) as e:
        cli.main(['demo', '--num', '0'])
    assert e.value.code == 2 and 'argument --num' in capsys.readouterr().err


# --- help text --------------------------------------------------------------------------------------------------
def _parsers():
    from timm_patchmix import demo, pipeline, robustness
    from timm_patchmix.hub.cli import build_parser as hub_parser
    out = {'pipeline': pipeline.build_parser(), 'demo': demo.build_parser(),
           'robustness': robustness.build_parser(), 'hub': hub_parser()}
    for action in out['hub']._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update({f'hub {k}': v for k, v in action.choices.items()})
    return out


@pytest.mark.parametrize('name', ['pipeline', 'demo', 'robustness', 'hub', 'hub push', 'hub export', 'hub backbone'])
def test_help_names_every_flag_its_default_and_an_example(name):
    parser = _parsers()[name]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help and action.help.strip(), f'{name}: {action.option_strings or action.dest} has no help'
    text = parser.format_help()
    assert 'example' in text
    formatter = parser._get_formatter()
    for action in parser._actions:  # a default that means something is shown
        if action.option_strings and action.default not in (None, False, '', [], argparse.SUPPRESS):
            assert 'default' in formatter._get_help_string(action), f'{name}: {action.option_strings} hides its default'
    if name == 'pipeline':
        assert '(default: smoke)' in text and 'population 24, 6 generations, K = 4' in text


def test_train_help_shows_every_default_also_of_flags_without_help_text():
    """train.py's help says a flag without a default shown takes the recipe's value or one resolved from the model:
    flags without help text of their own (--seed, --eval-metric, --patchmix-alpha...) showed none either."""
    from timm_patchmix.train import build_parser
    parser = build_parser()
    formatter = parser._get_formatter()
    shown = 0
    for action in parser._actions:  # (by identity and type: 0 and 0.0 are defaults to show, unlike False)
        d = action.default
        if action.option_strings and not (d is None or d is False or d is argparse.SUPPRESS
                                          or (isinstance(d, (str, list, dict)) and not d)):
            assert f'(default: {action.default}' in ' '.join(formatter._format_action(action).split()), \
                action.option_strings
            shown += 1
    assert shown >= 40 and '--seed SEED           (default: 42)' in parser.format_help()


# --- import ---------------------------------------------------------------------------------------------------------
LAZY_CHECK = r'''
import json, sys
import timm_patchmix
eager = sorted(m for m in sys.modules if m.startswith('timm_patchmix'))
names = {n: hasattr(timm_patchmix, n) for n in ('GuidedPatchMix', 'MaskTable', 'MaskTableError', 'hub')}
print(json.dumps({'eager': eager, 'names': names, 'after': sorted(m for m in sys.modules
                                                                  if m.startswith('timm_patchmix'))}))
'''


def test_import_is_lazy_and_the_lazy_names_resolve():
    r = run(sys.executable, '-c', LAZY_CHECK)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for heavy in ('hub', 'search', 'train', 'engine', 'pipeline', 'guided', 'table', 'cli'):
        assert not any(m == f'timm_patchmix.{heavy}' or m.startswith(f'timm_patchmix.{heavy}.')
                       for m in out['eager']), f'import timm_patchmix loads timm_patchmix.{heavy}: {out["eager"]}'
    assert all(out['names'].values()), out['names']
    assert 'timm_patchmix.hub' in out['after'] and 'timm_patchmix.guided' in out['after']


def test_lazy_names_in_process():
    from timm_patchmix import guided
    from timm_patchmix import hub
    assert timm_patchmix.GuidedPatchMix is guided.GuidedPatchMix
    assert timm_patchmix.MaskTable is guided.MaskTable and timm_patchmix.MaskTableError is guided.MaskTableError
    assert timm_patchmix.hub is hub and callable(timm_patchmix.hub.load_backbone)
    listed = dir(timm_patchmix)
    for name in ('GuidedPatchMix', 'MaskTable', 'MaskTableError', 'hub', 'PatchMix', 'PatchMixLoss'):
        assert name in listed and name in timm_patchmix.__all__
    with pytest.raises(AttributeError, match='no attribute'):
        timm_patchmix.no_such_name


def test_hub_split_keeps_its_names_and_module_entry():
    from timm_patchmix import hub
    for name in hub.__all__ + ['_read_config', '_check_registered', '_model_card', '_summary']:
        assert hasattr(hub, name), name
    r = run(sys.executable, '-m', 'timm_patchmix.hub', '--help')
    assert r.returncode == 0 and r.stdout.startswith('usage: python -m timm_patchmix.hub'), r.stderr
    for path in os.listdir(os.path.join(ROOT, 'timm_patchmix', 'hub')):
        if path.endswith('.py'):
            with open(os.path.join(ROOT, 'timm_patchmix', 'hub', path), encoding='utf-8') as f:
                assert sum(1 for _ in f) <= 400, path


# --- metadata files -------------------------------------------------------------------------------------------------
def test_license_citation_and_typing_marker():
    with open(os.path.join(ROOT, 'LICENSE'), encoding='utf-8') as f:
        text = f.read()
    assert 'Apache License' in text and 'Version 2.0, January 2004' in text and 'END OF TERMS AND CONDITIONS' in text
    with open(os.path.join(ROOT, 'CITATION.cff'), encoding='utf-8') as f:
        cff = yaml.safe_load(f)
    assert cff['cff-version'] == '1.2.0' and cff['license'] == 'Apache-2.0'
    paper = cff['preferred-citation']
    assert paper['title'] == 'Evolving Image Compositions for Feature Representation Learning' and paper['year'] == 2021
    assert [f'{a["given-names"]} {a["family-names"]}' for a in paper['authors']] == [
        'Paola Cascante-Bonilla', 'Arshdeep Sekhon', 'Yanjun Qi', 'Vicente Ordonez']
    assert cff['version'] == timm_patchmix.__version__
    assert os.path.isfile(os.path.join(ROOT, 'timm_patchmix', 'py.typed'))
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, 'setup.cfg'))
    assert 'py.typed' in cfg['options.package_data']['timm_patchmix']
    assert cfg['metadata']['license'] == 'Apache-2.0' and 'LICENSE' in cfg['metadata']['license_files']


def test_gitignore_ignores_no_tracked_file():
    if not os.path.isdir(os.path.join(ROOT, '.git')) or shutil.which('git') is None:
        pytest.skip('not a git checkout')
    r = subprocess.run(['git', 'ls-files', '-ci', '--exclude-standard'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == '', r.stdout


# --- front page and docs --------------------------------------------------------------------------------------------
def _read(path):
    with open(os.path.join(ROOT, path), encoding='utf-8') as f:
        return f.read()


def test_readme_test_command_is_what_ci_runs():
    ci = [line for line in _read('.ci/run').splitlines() if line.startswith('python3 -m venv')]
    assert len(ci) == 1 and f'```bash\n{ci[0]}\n```' in _read('README.md')
    assert ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.14.1 torchvision==0.29.1 && '
            'pip install -e . && python -m timm_patchmix.pipeline') in _read('README.md')


def test_relative_links_resolve():
    pages = ['README.md', 'CHANGELOG.md'] + [os.path.join('docs', f) for f in os.listdir(os.path.join(ROOT, 'docs'))
                                             if f.endswith('.md')]
    for page in pages:
        if not os.path.isfile(os.path.join(ROOT, page)):
            continue
        for target in re.findall(r'\]\(([^)\s]+)\)', _read(page)):
            if re.match(r'[a-z]+:', target) or target.startswith('#'):
                continue
            path = target.split('#')[0]
            assert os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path))), \
                f'{page} links to {target}, which does not exist'
