"""The four-phase pipeline end to end at a tiny budget, and its phase-level resume."""
import json
import os
import subprocess
import sys

import timm_patchmix  # noqa: F401
from timm_patchmix.guided import MaskTable
from timm_patchmix.pipeline import main as pipeline_main
from timm_patchmix.search.loop import KILL_ENV as KILL_AT_GEN
from timm_patchmix.train import KILL_ENV as KILL_AT_STEP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # the tree first

TINY_TRAIN = ['--train-args', '--train-subset', '64', '--val-subset', '40', '-b', '16', '--epochs', '1']


def test_pipeline_runs_phases_and_skips_finished_ones(tmp_path):
    out = str(tmp_path / 'pipe')
    text = pipeline_main(['--output', out, '--methods', 'base', 'random_pm', 'guided_pm'] + TINY_TRAIN)
    for f in ('report.md', 'report.json', 'fitness.png', 'pairs.png', 'masks.json', 'guided_samples.png'):
        assert os.path.isfile(os.path.join(out, f)), f
    rep = json.load(open(os.path.join(out, 'report.json')))
    assert set(rep['methods']) == {'base', 'random_pm', 'guided_pm'}
    assert '| guided_pm |' in text and '| random_pm |' in text
    table = MaskTable.load(os.path.join(out, 'masks.json'), grid=(4, 4), num_classes=10)
    assert len(table.pairs) == 10
    guided_meta = json.load(open(os.path.join(out, 'seed0', 'guided_pm', 'done.json')))
    assert guided_meta['epochs'] == 1
    # a rerun finds every phase done and only rewrites the report
    stamp = os.path.getmtime(os.path.join(out, 'seed0', 'guided_pm', 'last.safetensors'))
    again = pipeline_main(['--output', out, '--methods', 'base', 'random_pm', 'guided_pm'] + TINY_TRAIN)
    assert again == text
    assert os.path.getmtime(os.path.join(out, 'seed0', 'guided_pm', 'last.safetensors')) == stamp


def test_killed_pipeline_resumes_to_the_same_report(tmp_path):
    """SIGKILL in the middle of a training phase, then in the middle of the search; each rerun of the same command
    resumes where it stopped, and the final report and table equal an uninterrupted run's byte for byte."""
    args = ['--methods', 'base', 'random_pm', 'guided_pm'] + TINY_TRAIN + ['--epochs', '2', '-j', '0']

    def run(out, **env):
        return subprocess.run([sys.executable, '-m', 'timm_patchmix.pipeline', '--output', str(out)] + args,
                              cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1', **env))

    ref = run(tmp_path / 'ref')
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / 'killed'
    first = run(out, **{KILL_AT_STEP: '6'})            # 4 steps an epoch: dies inside the base model's 2nd epoch
    assert first.returncode == -9
    assert (out / 'seed0' / 'base' / 'state.safetensors').exists()   # epoch 0's state, to resume from
    assert (out / 'seed0' / 'base' / 'summary.csv').read_text().count('\n') == 2  # header + epoch 0
    assert not (out / 'seed0' / 'base' / 'done.json').exists()
    second = run(out, **{KILL_AT_GEN: '2'})            # base resumes, f_T trains, the search dies at gen 2
    assert second.returncode == -9
    assert (out / 'seed0' / 'base' / 'done.json').exists() and (out / 'seed0' / 'random_pm' / 'done.json').exists()
    assert (out / 'seed0' / 'search' / 'search_state.safetensors').exists()
    assert not (out / 'seed0' / 'search' / 'done.json').exists()
    third = run(out)                                    # the search resumes, the guided model trains
    assert third.returncode == 0, third.stderr[-2000:]
    assert (out / 'report.md').read_bytes() == (tmp_path / 'ref' / 'report.md').read_bytes()
    tables = [json.loads((d / 'masks.json').read_text()) for d in (out, tmp_path / 'ref')]
    for t in tables:  # the f_T path names each run's own folder: the only difference allowed
        assert t['search_args'].pop('checkpoint').startswith(str(tmp_path))
    assert tables[0] == tables[1]
