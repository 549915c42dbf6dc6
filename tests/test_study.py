"""The study runner: its task graph, a whole --quick study, a rerun that reuses every task, refused settings, and
tasks in child processes (--jobs 2)."""
import json
import os
import subprocess
import sys

import pytest
import timm
import torch

from timm_patchmix import study
from timm_patchmix.settings import SettingsChangedError
from timm_patchmix.train import parse_config


def _count(tasks, prefix):
    return sorted(n for n in tasks if n.split('/')[0] == prefix)


def test_full_task_graph_matches_the_study_design():
    cfg = study.FULL
    tasks = study.build_tasks(cfg)
    main, abl = cfg['main_seeds'], cfg['ablation_seeds']
    assert len(main) == 3 and len(abl) >= 2
    for m in study.MAIN:
        assert _count(tasks, m) == [f'{m}/s{s}' for s in main]
    for name in list(study.RPM_ABLATIONS) + list(study.GPM_ABLATIONS):
        assert _count(tasks, name) == [f'{name}/s{s}' for s in abl]
    # dependencies: f_O on the table of the search on the same seed's f_T
    for s in main:
        assert tasks[f'search/s{s}'].deps == [f'random_pm/s{s}']
        assert tasks[f'guided_pm/s{s}'].spec['table_from'] == f'search/s{s}'
    for s in abl:
        assert tasks[f'gpm_max/s{s}'].spec['table_from'] == f'search_max/s{s}'
        assert '--fitness' in tasks[f'search_max/s{s}'].spec['flags']
        flags = tasks[f'search_max/s{s}'].spec['flags']
        assert flags[flags.index('--fitness') + 1] == 'max'
    # the K sweep reuses the main search where it is the same search
    k_main = cfg['search']['k']
    assert tasks[f'k_sweep/k{k_main}_generalise'].spec['search'] == f'search/s{main[0]}'
    assert f'k_sweep/k{k_main}' not in tasks
    for k in cfg['k_sweep']['ks']:
        if k != k_main:
            flags = tasks[f'k_sweep/k{k}'].spec['flags']
            assert flags[flags.index('--k') + 1] == str(k)
    # every dependency comes earlier in the order the tasks are listed
    order = list(tasks)
    for n, t in tasks.items():
        assert all(order.index(d) < order.index(n) for d in t.deps), n
    # every training task's flags parse with train.py's own parser, and say what the design says
    for n, t in tasks.items():
        if t.kind != 'train':
            continue
        flags = list(t.spec['flags'])
        if t.spec.get('export_from'):
            flags += ['--model', 'local-dir:/nowhere']
        c = parse_config(flags + ['--output', '/tmp/x'])
        assert c.seed == t.spec['seed']
        if n.startswith('transfer_'):
            assert c.dataset == 'sklearn_digits' and c.holdout == cfg['holdout']
            assert c.linear_probe == n.startswith('transfer_probe/')
            if t.spec.get('export_from'):
                assert c.pretrained and c.reset_head
                # every source trains on the image loss alone, as the plain model does
                assert c.no_patch_loss == ('/base_' not in n)
            continue
        assert (c.dataset, c.holdout, c.epochs, c.batch_size) == ('fashion_mnist', 0.1, cfg['epochs'], 100)
        assert c.recipe == 'paper-cifar' and c.test_subset == cfg['test_subset']
        method = n.split('/')[0]
        assert bool(c.fgsm) == (method in study.MAIN)
        if method in ('random_pm', 'guided_pm') or method.startswith(('rpm_', 'gpm_')):
            assert c.patchmix and c.model == f'patchhead_{cfg["model"]}'
        if method in ('guided_pm', 'gpm_max', 'gpm_control'):
            assert c.no_patch_loss  # f_O on L_O
        if method == 'gpm_total':
            assert not c.no_patch_loss
        if method == 'gpm_control':
            assert (c.guided_prob, c.random_prob) == (0.0, 0.667)
    assert tasks['rpm_grid2/s0'].spec['flags'][-2:] == ['--patchmix-grid', '2']
    assert tasks['rpm_batch/s0'].spec['flags'][-2:] == ['--patchmix-mode', 'batch']


def test_a_learning_curve_size_of_the_training_subset_is_bases_own_run(tmp_path):
    """lc_sizes holding --train-subset: no base_n<size> task (it trained a second Base run the report never read);
    the curve's row for that size is Base's."""
    cfg = dict(study.QUICK, lc_sizes=[48, study.QUICK['train_subset']])
    tasks = study.build_tasks(cfg)
    assert [n for n in tasks if n.startswith('base_n')] == ['base_n48/s0']
    out = str(tmp_path / 'study')
    for name, top1 in (('base/s0', 30.0), ('base_n48/s0', 20.0)):
        _record(out, name, method=name.split('/')[0], seed=0, final_top1=top1, best_top1=top1,
                rows=[{'epoch': 0, 'train_loss': top1 / 10, 'eval_loss': 1.0, 'eval_top1': top1}])
    text = study.report(out, cfg, tasks, quick=True)
    assert '| 48 | 20.00 | 0.00 | 2.000 |' in text and '| 96 | 30.00 | 0.00 | 3.000 |' in text


def _read(path):
    with open(path, encoding='utf-8') as f:
        return f.read()


@pytest.mark.slow
def test_quick_study_runs_every_task_reports_and_reuses(tmp_path, capsys):
    out = str(tmp_path / 'study')
    # part of it first: the transfer of seed 0's guided model and what it needs
    assert study.main(['--quick', '--output', out, '--tasks', 'transfer_probe/guided_pm_s0']) == 0
    done = [n for n in study.build_tasks(study.QUICK) if os.path.isfile(os.path.join(out, n, 'done.json'))]
    assert sorted(done) == sorted(['random_pm/s0', 'search/s0', 'guided_pm/s0', 'export/guided_pm_s0',
                                   'transfer_probe/guided_pm_s0'])
    capsys.readouterr()
    assert study.main(['--quick', '--output', out]) == 0
    log = capsys.readouterr().out
    assert 'running guided_pm/s0' not in log  # finished tasks are reused
    tasks = study.build_tasks(study.QUICK)
    for n in tasks:
        assert os.path.isfile(os.path.join(out, n, 'done.json')), n
    rep = json.loads(_read(os.path.join(out, 'report.json')))
    # the report's numbers are the runs' own test numbers
    for m in study.MAIN:
        want = [json.loads(_read(os.path.join(out, m, f's{s}', 'done.json')))['final_top1']
                for s in study.QUICK['main_seeds']]
        assert rep['tables']['main'][m]['final_top1'] == want
        assert all(rec['split'] == 'test' for rec in [json.loads(_read(os.path.join(out, m, 's0', 'done.json')))])
    rec = json.loads(_read(os.path.join(out, 'base', 's0', 'done.json')))
    assert set(rec['fgsm']) == {'0.0'} | {repr(float(e)) for e in study.QUICK['fgsm']}
    # clean FGSM is the final weights' test top-1 (which the record rounds to 4 decimals)
    assert rec['fgsm']['0.0'] == pytest.approx(rec['test']['final']['test_top1'], abs=1e-4)
    assert rep['tables']['ablations']['rpm_grid2']['final_top1']
    assert set(rep['tables']['k_sweep']) == {str(k) for k in study.QUICK['k_sweep']['ks']}
    for source in ('scratch', 'base', 'random_pm', 'guided_pm'):
        assert rep['tables']['transfer'][source]['finetune'], source
    for source in ('base', 'random_pm', 'guided_pm'):
        assert rep['tables']['transfer'][source]['probe'], source
    # exported folders load through local-dir: and carry no tag of other weights
    cfg = json.loads(_read(os.path.join(out, 'export', 'guided_pm_s0', 'hub', 'config.json')))
    assert 'tag' not in cfg['pretrained_cfg'] and 'origin_url' not in cfg['pretrained_cfg']
    for fig in ('curves.png', 'ablations.png', 'learning_curve.png', 'k_sweep.png', 'transfer.png'):
        with open(os.path.join(out, fig), 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n', fig
    report_md = _read(os.path.join(out, 'report.md'))
    assert '## Main table' in report_md and '## Transfer' in report_md
    # a rerun runs nothing and writes the same report
    capsys.readouterr()
    assert study.main(['--quick', '--output', out]) == 0
    assert '[study] running' not in capsys.readouterr().out
    assert _read(os.path.join(out, 'report.md')) == report_md


def test_study_refuses_other_settings_before_running(tmp_path):
    out = str(tmp_path / 'study')
    os.makedirs(out)
    with open(os.path.join(out, study.STUDY_FILE), 'w', encoding='utf-8') as f:
        json.dump({'quick': True, 'settings': dict(study.QUICK, epochs=3)}, f)
    with pytest.raises(SettingsChangedError, match='epochs'):
        study.main(['--quick', '--output', out])
    assert os.listdir(out) == [study.STUDY_FILE]
    assert study.cli(['--output', out]) == 2  # the full study in a quick study's folder
    assert os.listdir(out) == [study.STUDY_FILE]


@pytest.mark.parametrize('flags', [['--jobs', '0'], ['--epochs', '0'], ['--train-subset', '-3'], ['--threads', '-1'],
                                   ['--model', 'nope'], ['--model', 'patchhead_resnet8_cifar']])
def test_out_of_range_flags_exit_2_naming_the_flag(tmp_path, flags, capsys):
    with pytest.raises(SystemExit) as e:
        study.main(['--quick', '--output', str(tmp_path / 's')] + flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err
    assert not os.path.exists(tmp_path / 's')


def test_unknown_task_pattern_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match='no task matches'):
        study.main(['--quick', '--output', str(tmp_path / 's'), '--tasks', 'nothing*'])


@pytest.mark.slow
def test_jobs_run_tasks_in_child_processes_with_the_studys_budget(tmp_path):
    out = str(tmp_path / 'study')
    argv = ['--quick', '--output', out, '--jobs', '2', '--tasks', 'base/*', '--epochs', '2']
    assert study.main(argv, log=lambda *a: None) == 0
    for s in study.QUICK['main_seeds']:
        rec = json.loads(_read(os.path.join(out, 'base', f's{s}', 'done.json')))
        assert rec['split'] == 'test' and rec['epochs'] == 2  # the children ran with the parent's --epochs
        assert 'epoch 1' in _read(os.path.join(out, 'base', f's{s}', 'log.txt'))
    assert json.loads(_read(os.path.join(out, study.STUDY_FILE)))['settings']['epochs'] == 2
    assert study.cli(['--quick', '--output', out, '--tasks', 'base/*']) == 2  # another budget: refused


@pytest.mark.slow
def test_export_of_a_plain_model_replaces_leftovers_of_a_killed_export(tmp_path):
    from timm_patchmix.engine import train
    from timm_patchmix.train import parse_config
    out = str(tmp_path / 'study')
    train(parse_config(['--model', 'resnet20_cifar', '--train-subset', '32', '--val-subset', '16', '-b', '16',
                        '--epochs', '1', '-j', '0', '--no-progress', '--device', 'cpu',
                        '--output', os.path.join(out, 'base'), '--experiment', 's0']))  # base/s0's folder
    study._mark(out, 'base/s0', {'output': os.path.join(out, 'base', 's0')})
    folder = os.path.join(out, 'export', 'base_s0')
    os.makedirs(os.path.join(folder, 'hub'))
    with open(os.path.join(folder, 'hub', 'config.json'), 'w') as f:
        f.write('{')  # what a run killed after its rename but before done.json might leave
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    stale = os.path.join(folder, f'.hub.patchmix-{dead.pid}-abc.tmp')
    os.makedirs(stale)
    task = study.build_tasks(study.QUICK)['export/base_s0']
    info = study.run_task(out, task)
    assert sorted(os.listdir(folder)) == ['done.json', 'hub']  # the dead writer's temporary is gone
    assert info['model'] == 'resnet20_cifar' and info['folder'] == os.path.join(folder, 'hub')
    from timm_patchmix.hub.load import model_from_weights
    want, _ = model_from_weights(info['checkpoint'])
    got = timm.create_model('local-dir:' + info['folder'], pretrained=True)
    w, g = want.state_dict(), got.state_dict()
    assert w.keys() == g.keys() and all(torch.equal(w[k], g[k]) for k in w)


class _Stop(Exception):
    """Raised by a stand-in for training, search, export or measurement, with the inputs it was given."""


def _record(out, name, **rec):
    study._mark(out, name, dict({'wall_s': 1.0}, **rec))


def test_tasks_read_earlier_tasks_files_from_the_studys_own_folders(tmp_path, monkeypatch):
    """A task finds the files of the tasks it reads in their folders under --output, not through the paths their
    done.json recorded (which name another study after a move, or a relative --output run from elsewhere)."""
    import timm_patchmix.engine
    import timm_patchmix.hub.load
    import timm_patchmix.search
    import timm_patchmix.search.generalise
    import timm_patchmix.train
    out, other = str(tmp_path / 'study'), str(tmp_path / 'other')
    tasks = study.build_tasks(study.QUICK)
    for name, files in (('random_pm/s0', ['best.safetensors']), ('search/s0', ['masks.json']),
                        ('export/base_s0', ['hub/config.json'])):
        for f in files:
            for root in (out, other):
                os.makedirs(os.path.dirname(os.path.join(root, name, f)), exist_ok=True)
                with open(os.path.join(root, name, f), 'w') as fh:
                    fh.write('{}')
        elsewhere = os.path.join(other, name)  # what a study run from another directory recorded
        _record(out, name, output=elsewhere, table=os.path.join(elsewhere, 'masks.json'),
                folder=os.path.join(elsewhere, 'hub'), final_top1=1.0, best_top1=1.0, rows=[], best_fitness=0.0)
    seen = {}

    def stop(key):
        def fn(*a, **k):
            seen[key] = a[0]
            raise _Stop
        return fn
    monkeypatch.setattr(timm_patchmix.train, 'parse_config', stop('train'))
    monkeypatch.setattr(timm_patchmix.search, 'parse_config', stop('search'))
    monkeypatch.setattr(timm_patchmix.hub.load, 'model_from_weights', stop('export'))
    monkeypatch.setattr(timm_patchmix.search.generalise, 'table_generalisation', lambda ck, table, **k: stop(
        'generalise')((ck, table)))
    for name in ('guided_pm/s0', 'search_max/s0', 'export/random_pm_s0',
                 f'k_sweep/k{study.QUICK["search"]["k"]}_generalise'):  # on search/s0
        with pytest.raises(_Stop):
            study.run_task(out, tasks[name])
    flags = seen['train']
    assert flags[flags.index('--patchmix-table') + 1] == os.path.join(out, 'search', 's0', 'masks.json')
    assert seen['search'][seen['search'].index('--checkpoint') + 1] == os.path.join(out, 'random_pm', 's0',
                                                                                    'best.safetensors')
    assert seen['export'] == os.path.join(out, 'random_pm', 's0', 'best.safetensors')
    assert seen['generalise'][0] == os.path.join(out, 'random_pm', 's0', 'best.safetensors')
    assert seen['generalise'][1] == os.path.join(out, 'search', 's0', 'masks.json')
    monkeypatch.setattr(timm_patchmix.train, 'parse_config', stop('transfer'))
    with pytest.raises(_Stop):
        study.run_task(out, tasks['transfer_probe/base_s0'])
    assert 'local-dir:' + os.path.join(out, 'export', 'base_s0', 'hub') in seen['transfer']


def test_a_task_whose_flags_are_refused_fails_alone(tmp_path):
    """A task whose train.py flags their parser refuses (argparse's exit status 2) is reported FAILED with the
    parser's message, and the other tasks go on."""
    out = str(tmp_path / 'study')
    tasks = {'bad/s0': study.Task('bad/s0', 'train', [], {'method': 'bad', 'seed': 0, 'flags': ['--epochs', '0']}),
             'ok/s0': study.Task('ok/s0', 'export', [], {})}
    logged = []
    ran = []
    import unittest.mock
    with unittest.mock.patch.object(study, '_run_export', lambda out, task, folder: ran.append(task.name) or {}):
        failed = study.schedule(out, tasks, list(tasks), 1, 1, [], logged.append)
    assert failed == ['bad/s0'] and ran == ['ok/s0']
    line = next(ln for ln in logged if 'FAILED' in ln)
    assert line.startswith('[study] FAILED bad/s0: TaskConfigError: train.py refused the task\'s flags: ')
    assert "argument --epochs: must be an integer >= 1, got '0'" in line


def test_a_task_missing_an_earlier_tasks_file_fails_and_the_study_reports(tmp_path, capsys):
    """A search whose f_T task is marked done but whose checkpoint is gone fails with a FAILED line naming the file;
    the study still writes its report and exits 1, and gives the caller back its torch thread count."""
    out = str(tmp_path / 'study')
    _record(out, 'random_pm/s0', method='random_pm', seed=0, final_top1=10.0, best_top1=10.0,
            rows=[{'epoch': 0, 'train_loss': 1.0, 'eval_loss': 1.0, 'eval_top1': 10.0}])
    import torch
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert study.main(['--quick', '--output', out, '--tasks', 'search/s0', '--threads', '1']) == 1
        assert torch.get_num_threads() == 3  # --threads was the study's; the caller keeps its own (as the pipeline)
    finally:
        torch.set_num_threads(previous)
    log = capsys.readouterr().out
    missing = os.path.join(out, 'random_pm', 's0', 'best.safetensors')
    assert f'[study] FAILED search/s0: TaskRecordError: {missing} is missing, though task random_pm/s0 is marked ' \
           f'done' in log
    assert '1 task(s) failed or were skipped: search/s0' in log
    assert os.path.isfile(os.path.join(out, 'report.md'))


def test_a_pipeline_or_a_search_folder_is_not_made_a_study(tmp_path, capsys):
    """A study wrote study.json and its report.md/report.json into any folder, replacing a pipeline's report.
    A folder without study.json that holds another command's output is refused before anything is written."""
    from test_resume_settings import snapshot
    for marker, whose in (('report.md', 'a pipeline or a study'), ('search_state.safetensors', 'a search')):
        out = tmp_path / marker.replace('.', '_')
        out.mkdir()
        (out / marker).write_text('theirs')
        before = snapshot(str(out))
        assert study.cli(['--quick', '--output', str(out), '--tasks', 'base/s0']) == 2
        assert f'cannot use {out}: it holds the output of {whose}' in capsys.readouterr().err
        assert snapshot(str(out)) == before


def test_the_report_states_the_images_the_runs_used(tmp_path):
    """The header stated the subsets asked for; a split with fewer images trains on all it has, and the header now
    gives the number the runs' records give, the asked one beside it (and in report.json)."""
    out = str(tmp_path / 'study')
    cfg = dict(study.QUICK, train_subset=4600)
    tasks = study.build_tasks(cfg)
    text = study.report(out, cfg, tasks, quick=True)
    assert '4,600 training images' in text and '48 of its images' in text  # nothing finished: the asked sizes
    splits = {'selection': 'holdout', 'test': 'validation', 'holdout': {'fraction': 0.1, 'seed': 0},
              'train_images': 4500, 'val_images': 48, 'test_images': 30}
    _record(out, 'base/s0', method='base', seed=0, final_top1=10.0, best_top1=10.0, splits=splits,
            rows=[{'epoch': 0, 'train_loss': 1.0, 'eval_loss': 1.0, 'eval_top1': 10.0}])
    text = study.report(out, cfg, tasks, quick=True)
    assert '4,500 (of 4,600 asked: all the split has) training images' in text
    assert ', 48 of its images select' in text and 'on 30 (of 48 asked: all the split has) test images' in text
    images = json.loads(_read(os.path.join(out, 'report.json')))['images']
    assert images == {'train': {'asked': 4600, 'used': 4500}, 'val': {'asked': 48, 'used': 48},
                      'test': {'asked': 48, 'used': 30}}


@pytest.mark.parametrize('content, why', [
    ('{"final_top1": 1', 'not valid JSON'), ('[]', 'a JSON list, not an object'),
    ('{"wall_s": 1}', 'no final_top1, best_top1, rows'),
    # the keys there, of another type: the report computed with them and failed with a traceback
    ('{"wall_s": 1, "final_top1": "8.3", "best_top1": 1, "rows": []}', "final_top1 must be a number, got '8.3'"),
    ('{"wall_s": 1, "final_top1": 1, "best_top1": null, "rows": []}', 'best_top1 must be a number, got None'),
    ('{"wall_s": 1, "final_top1": 1, "best_top1": 1, "rows": 5}', 'rows must be a non-empty list of epoch rows'),
    # no rows, or rows without a loss: the report read the last row's train_loss (IndexError, KeyError)
    ('{"wall_s": 1, "final_top1": 1, "best_top1": 1, "rows": []}',
     'rows must be a non-empty list of epoch rows, each with a number for train_loss and eval_top1, got []'),
    ('{"wall_s": 1, "final_top1": 1, "best_top1": 1, "rows": [{"eval_top1": 1}]}',
     'rows must be a non-empty list of epoch rows'),
    ('{"wall_s": "x", "final_top1": 1, "best_top1": 1, "rows": []}', "wall_s must be a number, got 'x'")])
@pytest.mark.parametrize('flags', [['--list'], ['--report'], ['--tasks', 'base/s0']])
def test_unreadable_done_json_is_one_error_line(tmp_path, capsys, content, why, flags):
    """A finished task's done.json that is truncated, not an object or lacks what the report reads: exit status 1
    and one error line naming the file and the task folder to delete, before any task runs."""
    out = tmp_path / 'study'
    (out / 'base' / 's0').mkdir(parents=True)
    (out / study.STUDY_FILE).write_text(json.dumps({'quick': True, 'settings': study.QUICK}))
    done = out / 'base' / 's0' / 'done.json'
    done.write_text(content)
    assert study.cli(['--quick', '--output', str(out)] + flags) == 1
    err = capsys.readouterr().err
    assert err.startswith('error: ') and err.count('\n') == 1
    assert f'{done} is not ' in err and why in err and f'delete {out / "base" / "s0"}' in err
    assert sorted(os.listdir(out)) == ['base', study.STUDY_FILE]


def test_list_and_report_read_the_budget_the_study_records(tmp_path, capsys):
    """--report and --list compared the command line with study.json, so a study run with --quick (or --epochs 12)
    refused both unless its flags were given again; without budget flags they read the recorded ones. Flags that
    contradict the record are still refused."""
    out = tmp_path / 'study'
    out.mkdir()
    (out / study.STUDY_FILE).write_text(json.dumps({'quick': True, 'settings': dict(study.QUICK, epochs=3)}))
    _record(str(out), 'base/s0', method='base', seed=0, final_top1=10.0, best_top1=10.0,
            rows=[{'epoch': 0, 'train_loss': 1.0, 'eval_loss': 1.0, 'eval_top1': 10.0}])
    assert study.cli(['--output', str(out), '--list']) == 0
    listed = capsys.readouterr().out
    assert 'done  base/s0' in listed and 'random_pm/s0' in listed
    assert study.cli(['--output', str(out), '--report']) == 0
    assert (out / 'report.md').is_file()
    capsys.readouterr()
    assert study.cli(['--output', str(out), '--report', '--epochs', '4']) == 2
    assert 'epochs' in capsys.readouterr().err


def test_output_is_a_folder_and_report_reads_an_existing_study(tmp_path, capsys):
    """--output naming a file is a usage error; --report on a folder that holds no study.json is refused and
    writes nothing (no folder, no study.json)."""
    f = tmp_path / 'file'
    f.write_text('x')
    with pytest.raises(SystemExit) as e:
        study.main(['--quick', '--output', str(f)])
    assert e.value.code == 2 and f"argument --output: expects a folder, got the file '{f}'" in capsys.readouterr().err
    for out in (tmp_path / 'none', tmp_path / 'empty'):
        if out.name == 'empty':
            out.mkdir()
        with pytest.raises(SystemExit) as e:
            study.main(['--quick', '--output', str(out), '--report'])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f'--report: {out} holds no study ({study.STUDY_FILE} is missing)' in err
        assert out.exists() == (out.name == 'empty') and not (out / study.STUDY_FILE).exists()


def test_the_export_of_a_guided_model_names_its_table_through_the_studys_layout(tmp_path, monkeypatch):
    """A moved study could not export its guided models: the export took the table from the path the weights
    recorded, which named the old place. It now passes the table of the task the model trained on, found under
    --output like every other file a task reads."""
    import timm_patchmix.hub
    import timm_patchmix.hub.load
    out = str(tmp_path / 'moved')
    tasks = study.build_tasks(study.QUICK)
    for name, f in (('guided_pm/s0', 'best.safetensors'), ('search/s0', 'masks.json'),
                    ('random_pm/s0', 'best.safetensors')):
        os.makedirs(os.path.join(out, name), exist_ok=True)
        open(os.path.join(out, name, f), 'w').write('{}')
    seen = {}
    monkeypatch.setattr(timm_patchmix.hub.load, 'model_from_weights', lambda ck: (None, {'model': 'patchhead_x'}))

    def export(ck, dest, **kw):
        seen[ck] = kw
        raise _Stop
    monkeypatch.setattr(timm_patchmix.hub, 'export_folder', export)
    for name in ('export/guided_pm_s0', 'export/random_pm_s0'):
        with pytest.raises(_Stop):
            study.run_task(out, tasks[name])
    assert seen[os.path.join(out, 'guided_pm', 's0', 'best.safetensors')]['table'] == os.path.join(
        out, 'search', 's0', 'masks.json')
    assert seen[os.path.join(out, 'random_pm', 's0', 'best.safetensors')]['table'] is None
