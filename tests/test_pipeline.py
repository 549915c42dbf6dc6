"""The four-phase pipeline end to end at a tiny budget, and its phase-level resume."""
import json
import os

import timm_patchmix  # noqa: F401
from timm_patchmix.guided import MaskTable
from timm_patchmix.pipeline import main as pipeline_main

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
