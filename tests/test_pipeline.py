"""The four-phase pipeline end to end at a tiny budget, and its phase-level resume."""
import json
import os
import subprocess
import sys

import pytest
import yaml

import timm_patchmix  # noqa: F401
from timm_patchmix.guided import MaskTable
from timm_patchmix.holdout import Holdout, index_hash
from timm_patchmix.pipeline import main as pipeline_main
from test_resume_settings import snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPATH = os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')]))  # the tree first
KILL_TRAIN = os.path.join(ROOT, 'tests', 'kill_after_steps.py')  # the pipeline, SIGKILLed by a training on_step

TINY_TRAIN = ['--train-args', '--train-subset', '64', '--val-subset', '40', '-b', '16', '--epochs', '1']

# the pipeline's command line, its search SIGKILLed right after the state of generation argv[1] is saved: the
# search's own per-generation callback, wrapped here (the production loop has no kill hook)
KILL_SEARCH = """
import os, signal, sys
from timm_patchmix import pipeline
from timm_patchmix.search import Search
at, run = int(sys.argv[1]), Search.run

def run_then_kill(self, generations=None, on_generation=None):
    def after(search, row):
        if on_generation is not None:
            on_generation(search, row)
        if row['gen'] >= at:
            os.kill(os.getpid(), signal.SIGKILL)
    return run(self, generations, after)
Search.run = run_then_kill
sys.exit(pipeline.cli(sys.argv[2:]))
"""


@pytest.mark.slow
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
    # the report states its budget and versions, and says that one seed at the smoke budget cannot rank methods
    assert rep['budget_detail'] == {'budget': 'smoke', 'train_images': 64, 'val_images': 40, 'epochs': 1,
                                    'recipe': 'paper-cifar', 'search': {'population': 24, 'generations': 6, 'k': 4},
                                    'holdout': 0.1, 'test_images': 300}
    assert '64 training images' in text and '40 held-out validation images' in text and '1 epoch (' in text
    assert '300 test images (a fixed random subset)' in text
    # by default: 10% of the training split held out; it chose the best epochs and fed the search; the numbers are
    # the test split's alone; f_O trained on the image loss only, f_T on L_T
    hold = Holdout.carve(5000, 0.1, 0)
    sp = rep['splits']
    assert sp['holdout'] == hold.record() and sp['reported_split'] == 'test' and sp['test_split'] == 'validation'
    assert (sp['selection_split'], sp['search_split']) == ('holdout', 'holdout')
    assert sp['images'] == {'train': 64, 'holdout_evaluated': 40, 'test': 300, 'search': 300}
    assert sp['losses'] == {'random_pm': 'total', 'guided_pm': 'image'}
    assert 'held out and never trained on' in text and '(`validation`, 300 images)' in text
    assert '`--final-loss image`' in text
    for run in rep['runs']:  # each run's numbers: the test split's, with the held-out ones beside them
        assert run['split'] == 'test' and run['final_top1'] == run['test']['final']['test_top1']
        assert run['best_epoch'] == 0 and 0 <= run['holdout_final_top1'] <= 100
        assert run['splits']['holdout'] == hold.record()
    args = {m: yaml.safe_load(open(os.path.join(out, 'seed0', m, 'args.yaml'))) for m in rep['methods']}
    assert all((a['holdout'], a['holdout_seed']) == (0.1, 0) for a in args.values())
    assert args['guided_pm']['no_patch_loss'] and not args['random_pm']['no_patch_loss']
    scored = table.search_args['scored_on']
    assert scored['split'] == 'holdout' and scored['sha256'] == index_hash(hold.subsets(val_subset=300)[1])
    assert 'population 24, 6 generations, K = 4' in text
    assert 'too small to rank' in text and not rep['ranking']['can_rank'] and len(rep['ranking']['reasons']) == 2
    assert '±' not in text  # one seed: single numbers
    import timm
    import torch
    assert rep['versions'] == {'timm_patchmix': timm_patchmix.__version__, 'torch': torch.__version__,
                               'timm': timm.__version__}
    assert f'torch {torch.__version__}' in text
    assert rep['wall_time_s'] > 0 and 'wall' not in text  # the wall time goes to report.json only
    # a rerun finds every phase done and only rewrites the report
    stamp = os.path.getmtime(os.path.join(out, 'seed0', 'guided_pm', 'last.safetensors'))
    threads = torch.get_num_threads()
    again = pipeline_main(['--output', out, '--methods', 'base', 'random_pm', 'guided_pm', '--threads',
                           str(threads + 1)] + TINY_TRAIN)
    assert again == text
    assert torch.get_num_threads() == threads  # --threads was the pipeline's; the caller keeps its own
    assert os.path.getmtime(os.path.join(out, 'seed0', 'guided_pm', 'last.safetensors')) == stamp


@pytest.mark.slow
def test_killed_pipeline_resumes_to_the_same_report(tmp_path):
    """SIGKILL in the middle of a training phase, then in the middle of the search; each rerun of the same command
    resumes where it stopped, and the final report and table equal an uninterrupted run's byte for byte."""
    args = ['--methods', 'random_pm', 'guided_pm'] + TINY_TRAIN + ['--epochs', '2', '-j', '0']

    def run(out, kill_search_at=None, kill_train_at=None, **env):
        cmd = ['-m', 'timm_patchmix.pipeline'] if kill_search_at is None else ['-c', KILL_SEARCH, str(kill_search_at)]
        if kill_train_at is not None:
            cmd = [KILL_TRAIN, str(kill_train_at), 'pipeline']
        return subprocess.run([sys.executable] + cmd + ['--output', str(out)] + args,
                              cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1', **env))

    ref = run(tmp_path / 'ref')
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / 'killed'
    first = run(out, kill_train_at=6)                  # 4 steps an epoch: dies inside f_T's 2nd epoch
    assert first.returncode == -9
    assert (out / 'seed0' / 'random_pm' / 'state.safetensors').exists()   # epoch 0's state, to resume from
    assert (out / 'seed0' / 'random_pm' / 'summary.csv').read_text().count('\n') == 2  # header + epoch 0
    assert not (out / 'seed0' / 'random_pm' / 'done.json').exists()
    second = run(out, kill_search_at=2)                # f_T resumes and finishes, the search dies at gen 2
    assert second.returncode == -9
    assert (out / 'seed0' / 'random_pm' / 'done.json').exists()
    assert (out / 'seed0' / 'search' / 'search_state.safetensors').exists()
    assert not (out / 'seed0' / 'search' / 'done.json').exists()
    third = run(out)                                    # the search resumes, the guided model trains
    assert third.returncode == 0, third.stderr[-2000:]
    assert (out / 'report.md').read_bytes() == (tmp_path / 'ref' / 'report.md').read_bytes()
    tables = [json.loads((d / 'masks.json').read_text()) for d in (out, tmp_path / 'ref')]
    for t in tables:  # the f_T path names each run's own folder: the only difference allowed
        assert t['search_args'].pop('checkpoint').startswith(str(tmp_path))
    assert tables[0] == tables[1]


def _fake_runs(values):
    return [{'method': m, 'seed': i, 'final_top1': v, 'best_top1': v, 'epochs': 8}
            for m, vs in values.items() for i, v in enumerate(vs)]


def test_too_few_held_out_images_for_the_search_name_the_pipelines_remedy(tmp_path):
    """The search's message for a class with fewer held-out images than K needs offered `--k` and "a larger
    validation split", which the pipeline does not take, and named the class by its index; it names the class and
    the pipeline's own flag now, and f_T's finished phase stays for a rerun."""
    from timm_patchmix.search import SearchError
    out = str(tmp_path / 'pipe')
    with pytest.raises(SearchError, match=r"^class '\w+' has [0-3] held-out images, fewer than the 4 that the smoke "
                                          r"budget's search \(K=4\) needs: give it more with a larger --holdout "
                                          r"\(now 0\.004; in a new --output"):
        pipeline_main(['--output', out, '--methods', 'random_pm', 'guided_pm', '--holdout', '0.004'] + TINY_TRAIN)
    assert os.path.isfile(os.path.join(out, 'seed0', 'random_pm', 'done.json'))


def test_report_says_when_the_spread_exceeds_the_gaps(tmp_path):
    """With three seeds at the small budget, methods far apart can be ranked; two methods closer than their spread
    across seeds are named, and the report says the budget is too small to rank them."""
    import argparse
    from timm_patchmix.pipeline import report
    args = argparse.Namespace(dataset='', model='resnet32_cifar', budget='small', seeds=[0, 1, 2],
                              methods=['base', 'random_pm'], output=str(tmp_path), train_args=[])
    apart = report(args, _fake_runs({'base': [70.0, 71.0, 72.0], 'random_pm': [80.0, 81.0, 82.0]}), wall_time_s=3.0)
    rep = json.load(open(tmp_path / 'report.json'))
    assert rep['ranking']['can_rank'] and 'too small' not in apart and '81.00 ± 1.00' in apart
    assert 'the whole training split' in apart and 'population' not in apart  # no guided_pm, no search
    assert rep['wall_time_s'] == 3.0
    close = report(args, _fake_runs({'base': [70.0, 75.0, 80.0], 'random_pm': [71.0, 76.0, 81.0]}))
    rep = json.load(open(tmp_path / 'report.json'))
    assert not rep['ranking']['can_rank'] and rep['ranking']['close_pairs'][0]['methods'] == ['random_pm', 'base']
    assert 'too small to rank' in close and 'random_pm and base (gap 1.00, std 5.00)' in close
    assert close.startswith('# PatchMix pipeline: patchshapes (embedded), resnet32_cifar')
    # an image folder given with --data-dir (no --dataset) is named, not called the embedded set
    folder = report(argparse.Namespace(**dict(vars(args), data_dir='/data/shapes')),
                    _fake_runs({'base': [70.0, 71.0, 72.0], 'random_pm': [80.0, 81.0, 82.0]}))
    assert folder.startswith('# PatchMix pipeline: the image folder /data/shapes, resnet32_cifar')


@pytest.mark.parametrize('budget', sorted(__import__('timm_patchmix.pipeline', fromlist=['BUDGETS']).BUDGETS))
def test_every_budget_parses_into_train_and_search_configs(budget, tmp_path):
    """Each budget's flags are flags train.py and search.py accept; the gpu budget keeps the data on the device."""
    from timm_patchmix.pipeline import BUDGETS
    from timm_patchmix.search.command import parse_config as search_config
    from timm_patchmix.train import parse_config as train_config
    flags = BUDGETS[budget]
    cfg = train_config(flags['train'] + ['--patchmix', '--model', 'patchhead_resnet32_cifar'])
    assert cfg.recipe == 'paper-cifar' and cfg.patchmix
    (tmp_path / 'f_T.safetensors').write_bytes(b'')  # the parser checks that the file exists, nothing more
    scfg = search_config(['--checkpoint', str(tmp_path / 'f_T.safetensors')] + flags['search'])
    assert scfg.population > 0 and scfg.generations > 0
    if budget == 'gpu':
        assert cfg.device_data and cfg.amp and cfg.amp_dtype == 'bfloat16' and cfg.channels_last
        assert (cfg.epochs, cfg.batch_size, cfg.lr) == (30, 256, 0.2)
        assert scfg.amp and scfg.channels_last and (scfg.population, scfg.generations) == (500, 250)


def _finished_phases(out, argv):
    """A pipeline folder whose f_T, search and guided phases are marked done, as a run with ``argv`` leaves them (the
    files stand in for the real ones: only their presence and content are compared); the f_T checkpoint and the
    search's table."""
    from timm_patchmix.pipeline import SETTINGS_FILE, _guided_settings, _phase_settings, build_parser
    from timm_patchmix.settings import file_record, write_settings
    args = build_parser().parse_args(argv)
    seed = out / 'seed0'
    for name in ('random_pm', 'search', 'guided_pm'):
        (seed / name).mkdir(parents=True)
    ft, table = seed / 'random_pm' / 'best.safetensors', seed / 'search' / 'masks.json'
    ft.write_bytes(b'f_T weights')
    table.write_text('{"pairs": []}\n')
    write_settings(str(seed / 'random_pm' / SETTINGS_FILE), _phase_settings(args, 0))
    write_settings(str(seed / 'search' / SETTINGS_FILE), _phase_settings(args, 0, {'f_T': file_record(str(ft))}))
    write_settings(str(seed / 'guided_pm' / SETTINGS_FILE),
                   _phase_settings(args, 0, _guided_settings(args, str(table))))
    run = {'seed': 0, 'final_top1': 1.0, 'best_top1': 1.0, 'epochs': 1}
    (seed / 'random_pm' / 'done.json').write_text(json.dumps(dict(run, method='random_pm',
                                                                  output=str(seed / 'random_pm'))))
    (seed / 'search' / 'done.json').write_text(json.dumps({'table': str(table)}))
    (seed / 'guided_pm' / 'done.json').write_text(json.dumps(dict(run, method='guided_pm',
                                                                  output=str(seed / 'guided_pm'))))
    return ft, table


@pytest.mark.parametrize('missing, phase, reader', [('f_T', 'random_pm', 'search'),
                                                    ('table', 'search', 'guided_pm')])
def test_rerun_refuses_a_finished_phase_without_its_output(tmp_path, capsys, missing, phase, reader):
    """A phase marked done whose output a later phase reads (f_T's best.safetensors for the search, the search's
    masks.json for the guided model) but which is gone (a study copied without its checkpoints): the rerun stops
    with exit status 2 before writing anything, naming the missing file, the phase and what to do."""
    from timm_patchmix.pipeline import cli
    out = tmp_path / 'out'
    argv = ['--output', str(out), '--methods', 'random_pm', 'guided_pm'] + TINY_TRAIN
    ft, table = _finished_phases(out, argv)
    gone = {'f_T': ft, 'table': table}[missing]
    gone.unlink()
    before = snapshot(out)
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert 'Traceback' not in err and err.startswith('error: ')
    msg = err[len('error: '):].strip()
    assert '\n' not in msg, msg  # one paragraph
    assert str(gone) in msg and str(out / 'seed0' / phase) in msg and 'done.json' in msg
    assert 'Restore' in msg and f'delete {out / "seed0" / phase}' in msg
    assert str(out / 'seed0' / reader) in msg  # the phase made from the missing file, to delete with it
    assert snapshot(out) == before  # nothing written: no report, no guided samples, no settings
    # a run that does not need the missing file still reuses the finished phase
    if missing == 'f_T':
        assert cli(['--output', str(out), '--methods', 'random_pm'] + TINY_TRAIN) == 0
        assert (out / 'report.md').is_file() and not ft.exists()


# --jobs N: the phases in child processes

JOBS_ARGS = ['--methods', 'base', 'random_pm', 'guided_pm', '--threads', '1'] + TINY_TRAIN


def _pipeline(out, *flags, timeout=900):
    return subprocess.run([sys.executable, '-m', 'timm_patchmix.pipeline', '--output', str(out)] + list(flags)
                          + JOBS_ARGS, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'))


def _table(path):
    t = json.loads(path.read_text())
    t['search_args'].pop('checkpoint')  # the f_T path names each run's own folder
    return t


@pytest.fixture(scope='module')
def serial_run(tmp_path_factory):
    """The folder of the --jobs tests' pipeline run one phase after another in one process."""
    ref = tmp_path_factory.mktemp('serial') / 'ref'
    res = _pipeline(ref)
    assert res.returncode == 0, res.stderr[-2000:]
    return ref


@pytest.mark.slow
def test_jobs_runs_each_phase_in_a_child_to_the_same_report(tmp_path, serial_run):
    """--jobs 2 runs every phase in its own process (f_T and a baseline side by side, the search once f_T is done,
    the guided model once the search is done), each logging to logs/; the report, the table and every run's numbers
    equal those of the same phases run one after another in one process."""
    out = tmp_path / 'jobs'
    res = _pipeline(out, '--jobs', '2')
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / 'report.md').read_bytes() == (serial_run / 'report.md').read_bytes()
    assert _table(out / 'masks.json') == _table(serial_run / 'masks.json')
    for f in ('fitness.png', 'pairs.png', 'guided_samples.png'):
        assert (out / f).is_file(), f
    runs = [json.loads((d / 'report.json').read_text())['runs'] for d in (out, serial_run)]
    keep = ('method', 'seed', 'final_top1', 'best_top1', 'holdout_final_top1', 'holdout_best_top1', 'best_epoch')
    assert [{k: r[k] for k in keep} for r in runs[0]] == [{k: r[k] for k in keep} for r in runs[1]]
    assert sorted(p.name for p in (out / 'logs').iterdir()) == [
        'seed0_base.log', 'seed0_guided_pm.log', 'seed0_random_pm.log', 'seed0_search.log']
    assert 'training random_pm' in (out / 'logs' / 'seed0_random_pm.log').read_text()
    lines = res.stdout.splitlines()
    started = [ln for ln in lines if 'started' in ln]
    assert started[:2] == [f'[seed 0] random_pm started (log: {out / "logs" / "seed0_random_pm.log"})',
                           f'[seed 0] base started (log: {out / "logs" / "seed0_base.log"})']  # f_T first

    def at(text):
        return next(i for i, ln in enumerate(lines) if text in ln)
    assert at('random_pm done') < at('search started') < at('search done') < at('guided_pm started')
    assert at('base started') < at('random_pm done')  # side by side
    # a rerun with --jobs finds every phase done: nothing starts, the same report
    again = _pipeline(out, '--jobs', '2')
    assert again.returncode == 0 and 'started' not in again.stdout
    assert (out / 'report.md').read_bytes() == (serial_run / 'report.md').read_bytes()


@pytest.mark.slow
def test_jobs_reports_a_failed_phase_and_a_rerun_resumes(tmp_path):
    """A phase that fails in its child (f_T resuming from a corrupt state file) stops nothing else: the baseline
    finishes, the search and the guided model do not start, and the pipeline exits 1 naming the failed phases and
    the logs, the log's end on its output. After the bad file is gone, a rerun keeps the finished baseline."""
    from timm_patchmix.pipeline import SETTINGS_FILE, _phase_settings, build_parser
    from timm_patchmix.settings import write_settings
    out = tmp_path / 'out'
    args = build_parser().parse_args(['--output', str(out)] + JOBS_ARGS)
    ft = out / 'seed0' / 'random_pm'
    ft.mkdir(parents=True)
    write_settings(str(ft / SETTINGS_FILE), _phase_settings(args, 0))
    (ft / 'state.safetensors').write_bytes(b'not a checkpoint')
    res = _pipeline(out, '--jobs', '2')
    assert res.returncode == 1
    err = res.stderr.strip()
    assert err.startswith('error: 3 phase(s) failed or could not start: seed 0 random_pm, seed 0 search, '
                          'seed 0 guided_pm.') and str(out / 'logs') in err and 'Traceback' not in err
    assert 'random_pm FAILED (exit status 1)' in res.stdout and 'state.safetensors' in res.stdout  # the log's end
    assert '[seed 0] search not started: a phase it reads failed' in res.stdout
    assert (out / 'seed0' / 'base' / 'done.json').is_file()
    assert not (out / 'seed0' / 'search').exists() and not (out / 'report.md').exists()
    stamp = (out / 'seed0' / 'base' / 'done.json').stat().st_mtime_ns
    (ft / 'state.safetensors').unlink()
    again = _pipeline(out, '--jobs', '2')
    assert again.returncode == 0, again.stderr[-2000:]
    assert 'base started' not in again.stdout and (out / 'report.md').is_file()
    assert (out / 'seed0' / 'base' / 'done.json').stat().st_mtime_ns == stamp


def _children(parent: int):
    """The pids of live processes started by pipeline process ``parent`` for its phases (Linux)."""
    from timm_patchmix.children import PARENT_ENV
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
            state = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]
        except OSError:
            continue
        if f'{PARENT_ENV}={parent}'.encode() in env and state != 'Z':
            found.append(int(pid))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='the children follow their parent on Linux')
@pytest.mark.parametrize('sig', ['SIGKILL', 'SIGTERM'])
def test_killed_jobs_pipeline_stops_its_phases_and_resumes(tmp_path, sig, serial_run):
    """Killing the pipeline while its phases run (SIGKILL, or SIGTERM as a scheduler sends it) stops their
    processes too, so none goes on to finish beside a rerun; the rerun resumes to the uninterrupted report."""
    import signal
    import time
    out = tmp_path / 'out'
    proc = subprocess.Popen([sys.executable, '-m', 'timm_patchmix.pipeline', '--output', str(out), '--jobs', '2']
                            + JOBS_ARGS, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=PYPATH, OMP_NUM_THREADS='1'))
    try:
        deadline = time.monotonic() + 300
        logs = [out / 'logs' / f'seed0_{n}.log' for n in ('random_pm', 'base')]
        # f_T and the baseline training: past their start-up, where a child whose pipeline has already died
        # exits by itself, so that only the request to be stopped with the pipeline can stop them now
        while not all(f.exists() and 'training' in f.read_text() for f in logs) or len(_children(proc.pid)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        children = _children(proc.pid)
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(timeout=60) == (-9 if sig == 'SIGKILL' else 128 + signal.SIGTERM)
        deadline = time.monotonic() + 60
        while any(p in _children(proc.pid) for p in children):
            assert time.monotonic() < deadline, f'phases still running: {_children(proc.pid)}'
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    # stopped, not finished: a phase that went on would have marked itself done by now
    assert not any((out / 'seed0' / n / 'done.json').exists() for n in ('base', 'random_pm'))
    assert not (out / 'report.md').exists()
    res = _pipeline(out, '--jobs', '2')
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / 'report.md').read_bytes() == (serial_run / 'report.md').read_bytes()


def test_jobs_flags_are_checked(tmp_path, capsys):
    from timm_patchmix.pipeline import build_parser, main, phases
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(['--jobs', '0'])
    assert e.value.code == 2 and "--jobs: must be an integer >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(['--output', str(tmp_path), '--run-phase', '0:search', '--methods', 'base'])
    assert e.value.code == 2 and "--run-phase '0:search' is not a phase of this run" in capsys.readouterr().err
    with pytest.raises(ValueError, match='on_train_step needs --jobs 1'):
        main(['--output', str(tmp_path / 'o'), '--jobs', '2'], on_train_step=lambda event: None)
    assert not (tmp_path / 'o').exists()  # refused before anything is written
    from timm_patchmix.pipeline import _wants_download  # then the first phase runs alone
    assert _wants_download(build_parser().parse_args(['--train-args', '--dataset-download']))
    assert not _wants_download(build_parser().parse_args([]))
    args = build_parser().parse_args(['--seeds', '3', '4', '--methods', 'mixup', 'guided_pm'])
    assert phases(args) == [(3, 'mixup', ()), (3, 'random_pm', ()), (3, 'search', ('random_pm',)),
                            (3, 'guided_pm', ('search',)), (4, 'mixup', ()), (4, 'random_pm', ()),
                            (4, 'search', ('random_pm',)), (4, 'guided_pm', ('search',))]


def test_child_command_parses_back_to_the_run(tmp_path):
    """A --jobs child's command line gives the pipeline's own flags back, with a negative seed and --train-args
    flags in the --flag=value form; it loads the package the pipeline process runs."""
    import timm_patchmix.children as children
    import timm_patchmix.pipeline as pipeline
    argv = ['--output', str(tmp_path), '--seeds', '-1', '3', '--jobs', '2', '--train-args', '--epochs=3', '-b', '8']
    cmd = children.child_command('pipeline', pipeline.child_argv(argv, -1, 'base', 1))
    assert cmd[:2] == [sys.executable, '-c'] and cmd[3:5] == [os.path.abspath(timm_patchmix.__file__), 'pipeline']
    args = pipeline.build_parser().parse_args(cmd[5:])
    assert (args.run_phase, args.threads, args.seeds) == ('-1:base', 1, [-1, 3])
    assert args.train_args == ['--epochs=3', '-b', '8'] and args.output == str(tmp_path)
    # the child runs that package, even from a folder holding another timm_patchmix
    shadow = tmp_path / 'timm_patchmix'
    shadow.mkdir()
    (shadow / '__init__.py').write_text('raise ImportError("the copy in the working directory")\n')
    (tmp_path / 'probe.py').write_text('import timm_patchmix.pipeline as p\nprint(p.__file__)\n')
    probe = children.child_command('pipeline', [])
    probe[2] = probe[2].replace("raise SystemExit(importlib.import_module('timm_patchmix.' + module).cli())",
                                "__import__(module)")
    assert probe[2].endswith('__import__(module)\n')
    res = subprocess.run(probe[:4] + ['probe'], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == os.path.abspath(pipeline.__file__)
    plain = subprocess.run([sys.executable, '-c', '__import__("probe")'], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert 'the copy in the working directory' in plain.stderr  # what python -m or a bare import would run


# --train-args: the flags the pipeline sets itself

@pytest.mark.parametrize('flags, named, instead', [
    (['--seed', '7'], '--seed', "give the pipeline's own --seeds"),
    (['--see=7'], '--seed (given as --see)', "give the pipeline's own --seeds"),
    (['--experiment', 'shared'], '--experiment', 'leave it out'),
    (['--holdout-s', '5'], '--holdout-seed (given as --holdout-s)', "give the pipeline's own --holdout-seed"),
    (['--output', 'elsewhere'], '--output', "give the pipeline's own --output"),
    (['--model', 'resnet20_cifar'], '--model', "give the pipeline's own --model"),
    (['--dataset', 'fashion_mnist'], '--dataset', "give the pipeline's own --dataset"),
    (['--mixup', '1.0'], '--mixup', "give the pipeline's own --methods"),
    (['--patchmix'], '--patchmix', "give the pipeline's own --methods"),
    # (timm's Mixup turns CutMix on for it: the base and mixup runs mixed with CutMix under their own names)
    (['--cutmix-minmax', '0.3', '0.7'], '--cutmix-minmax', "give the pipeline's own --methods"),
    (['--no-patch'], '--no-patch-loss (given as --no-patch)', "give the pipeline's own --final-loss"),
    # (the report said L_T for runs that trained on the patch loss alone, or on another weighting)
    (['--no-image-loss'], '--no-image-loss', 'which its report states (--final-loss chooses'),
    (['--patch-loss-weight', '0.5'], '--patch-loss-weight', 'which its report states (--final-loss chooses'),
])
def test_train_args_refuse_the_flags_the_pipeline_sets(tmp_path, capsys, monkeypatch, flags, named, instead):
    """A flag the pipeline sets for its runs would override its value from --train-args (argparse keeps the last):
    refused with exit status 2 however it is spelt, naming it and the pipeline's flag, before anything is written."""
    import timm_patchmix.pipeline as pipeline
    monkeypatch.setattr(pipeline, '_run', lambda *a, **k: pytest.fail('the phases ran'))
    out = tmp_path / 'p'
    with pytest.raises(SystemExit) as e:
        pipeline_main(['--output', str(out), '--train-args', '--epochs', '1'] + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f'error: {named} in --train-args: the pipeline sets it' in err and instead in err
    assert not out.exists()


@pytest.mark.parametrize('model', ['patchhead_resnet8_cifar', 'no_such_net'])
def test_a_model_that_is_no_plain_backbone_is_refused_before_any_phase(tmp_path, capsys, monkeypatch, model):
    """--model patchhead_X trained Base as a patch-head model, then stopped at patchhead_patchhead_X."""
    import timm_patchmix.pipeline as pipeline
    monkeypatch.setattr(pipeline, '_run', lambda *a, **k: pytest.fail('the phases ran'))
    out = tmp_path / 'p'
    with pytest.raises(SystemExit) as e:
        pipeline_main(['--output', str(out), '--model', model])
    assert e.value.code == 2 and f"argument --model: '{model}' is not a timm model name (give the plain backbone" \
        in capsys.readouterr().err
    assert not out.exists()


def test_seeds_are_those_every_phase_takes(tmp_path, capsys, monkeypatch):
    """A seed torch's generators cannot take is refused by the parser, a negative one before any phase where the
    search runs (numpy's generator refuses it: -1 trained Base, Mixup, CutMix and f_T, then stopped there)."""
    import timm_patchmix.pipeline as pipeline
    with pytest.raises(SystemExit) as e:
        pipeline.build_parser().parse_args(['--seeds', '0', str(2 ** 64)])
    assert e.value.code == 2 and 'argument --seeds: must be an integer in [-2**63, 2**64 - 2**32]' in \
        capsys.readouterr().err
    assert pipeline.build_parser().parse_args(['--seeds', '-1', str(2 ** 63)]).seeds == [-1, 2 ** 63]
    monkeypatch.setattr(pipeline, '_run', lambda *a, **k: pytest.fail('the phases ran'))
    with pytest.raises(SystemExit) as e:
        pipeline_main(['--output', str(tmp_path / 'p'), '--seeds', '0', '-1'])
    assert e.value.code == 2 and 'the search of guided_pm takes seeds >= 0' in capsys.readouterr().err
    assert not (tmp_path / 'p').exists()


@pytest.mark.parametrize('flags', [['-c', 'cfg.yaml'], ['--config=cfg.yaml']])
def test_train_args_refuse_a_config_file(tmp_path, capsys, monkeypatch, flags):
    """train.py's -c file would set what the pipeline sets (its keys pass no flag check) and what its budget record
    reads: refused with exit status 2 before anything is written."""
    import timm_patchmix.pipeline as pipeline
    monkeypatch.setattr(pipeline, '_run', lambda *a, **k: pytest.fail('the phases ran'))
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'cfg.yaml').write_text('patchmix: true\nseed: 5\n')
    out = tmp_path / 'p'
    with pytest.raises(SystemExit) as e:
        pipeline_main(['--output', str(out), '--train-args', '--epochs', '1'] + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and 'error: --config in --train-args: the pipeline\'s runs take their settings' in err
    assert not out.exists()


@pytest.mark.parametrize('budget, flags, named', [
    ('gpu', ['--aa', 'v0'], 'error: --train-args in the base runs: --device-data crops, flips and normalises'),
    ('smoke', ['--remode', 'const'], 'error: --train-args in the base runs: --remode sets the random erasing'),
    ('smoke', ['--mixup-mode', 'half', '--no-prefetcher'],
     'error: --train-args in the mixup runs: argument --mixup-mode: half is a mode'),
    ('smoke', ['--guided-prob', '0.9', '--random-prob', '0.5'],
     'error: --train-args in the guided_pm runs: --guided-prob 0.9 and --random-prob 0.5 are fractions'),
    # f_T's grid beyond the search's 62 cells: found when the search started, after f_T had trained
    ('smoke', ['--patchmix-grid', '8', '8'], 'error: --train-args: the 8x8 grid has 64 cells, and the search of '
                                             'guided_pm handles grids of up to 62 cells'),
    ('smoke', ['--model-kwargs', 'grid=(7, 9)'], 'error: --train-args: the 7x9 grid has 63 cells'),
    ('smoke', ['--model-kwargs', 'grid=(0, 3)'], 'error: --train-args: --model-kwargs grid must be at least 1x1'),
])
def test_train_args_that_a_phase_would_refuse_stop_before_anything_is_written(tmp_path, capsys, monkeypatch, budget,
                                                                              flags, named):
    """A contradiction between --train-args and a phase's own or the budget's flags is a usage error before the
    first phase writes its folder (whose settings record would refuse the corrected rerun)."""
    import timm_patchmix.pipeline as pipeline
    monkeypatch.setattr(pipeline, '_run', lambda *a, **k: pytest.fail('the phases ran'))
    out = tmp_path / 'p'
    with pytest.raises(SystemExit) as e:
        pipeline_main(['--output', str(out), '--budget', budget, '--train-args'] + flags)
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize('marker, whose', [('search_state.safetensors', 'a search (search.py)'),
                                           ('args.yaml', 'a training run (train.py)'), ('study.json', 'a study'),
                                           ('model.safetensors', 'a Hub export (hub export)')])
def test_a_folder_of_another_commands_output_is_refused(tmp_path, capsys, monkeypatch, marker, whose):
    """The pipeline wrote its fixed-name files (masks.json, fitness.png, pairs.png, report.md) into any folder,
    replacing a search's table and plots, or a study's report. A root that holds another command's output is a
    usage error before anything is written; the pipeline's own folder is still reused."""
    import timm_patchmix.pipeline as pipeline
    out = tmp_path / 'p'
    out.mkdir()
    (out / marker).write_text('theirs')
    (out / 'masks.json').write_text('their table')
    before = snapshot(str(out))
    assert pipeline.cli(['--output', str(out)]) == 2
    assert f'cannot use {out}: it holds the output of {whose} ({marker})' in capsys.readouterr().err
    assert snapshot(str(out)) == before
    ran = []
    monkeypatch.setattr(pipeline, '_run', lambda *a, **k: ran.append(1) or '')
    (out / marker).unlink()
    (out / 'report.md').write_text('an earlier pipeline report')
    pipeline_main(['--output', str(out)])
    assert ran == [1]


def test_a_phase_refused_once_its_model_is_built_restarts_under_corrected_train_args(tmp_path):
    """--drop-block on the CIFAR ResNet is refused when the model is built, after the phase recorded its settings:
    the folder holds that record alone, and the corrected rerun starts the phase afresh."""
    from timm_patchmix.engine import ConfigError
    out = str(tmp_path / 'p')
    with pytest.raises(ConfigError, match='argument --drop-block: model resnet32_cifar does not take'):
        pipeline_main(['--output', out, '--methods', 'base'] + TINY_TRAIN + ['--drop-block', '0.1'])
    assert os.listdir(os.path.join(out, 'seed0', 'base')) == ['settings.json']
    pipeline_main(['--output', out, '--methods', 'base'] + TINY_TRAIN)
    assert os.path.isfile(os.path.join(out, 'seed0', 'base', 'done.json'))


def test_train_args_keep_the_budget_flags_open(tmp_path):
    """The budget's flags, abbreviated or not, and the console flags pass the check."""
    from timm_patchmix.pipeline import _check_train_args, build_parser
    parser = build_parser()
    args = parser.parse_args(['--train-args', '--epochs', '3', '--train-sub', '100', '--val-subset=50', '-b16',
                              '--log-interval', '5', '--no-progress', '--dataset-download'])
    _check_train_args(parser, args)


@pytest.mark.parametrize('budget', ['smoke', 'gpu'])
def test_owned_train_flags_cover_what_the_pipeline_sets(budget, tmp_path):
    """Every train.py flag the pipeline passes to a training phase is either the budget's (open to --train-args), a
    console flag, or one of OWNED_TRAIN_FLAGS (refused in --train-args); no budget flag is refused."""
    from timm_patchmix.pipeline import (BUDGETS, OWNED_TRAIN_FLAGS, _given_flags, _train_argv, build_parser,
                                        method_flags)
    from timm_patchmix.train import build_parser as train_parser
    table = tmp_path / 'masks.json'
    table.write_text('{}')
    budget_dests = set(_given_flags(train_parser(), BUDGETS[budget]['train'] + BUDGETS[budget]['test']))
    assert not budget_dests & set(OWNED_TRAIN_FLAGS)
    args = build_parser().parse_args(['--output', str(tmp_path), '--budget', budget, '--data-dir', str(tmp_path)])
    state = tmp_path / 'seed0' / 'guided_pm' / 'state.safetensors'  # a phase to resume: --resume too
    state.parent.mkdir(parents=True)
    state.write_bytes(b'')
    for name in ('base', 'mixup', 'cutmix', 'random_pm', 'guided_pm'):
        argv = _train_argv(args, 0, name, method_flags(args, name, str(table)))
        dests = set(_given_flags(train_parser(), argv)) - budget_dests - {'no_progress', 'log_interval'}
        assert dests <= set(OWNED_TRAIN_FLAGS), (name, dests - set(OWNED_TRAIN_FLAGS))


@pytest.mark.parametrize('flags, noted', [(['--holdout', '0', '--holdout-seed', '3'], True),
                                          (['--holdout', '0', '--holdout-s=3'], True),
                                          (['--holdout', '0'], False), (['--holdout-seed', '3'], False),
                                          (['--holdout', '0', '--holdout-seed', '0'], True)])
def test_holdout_seed_without_a_holdout_is_a_note(tmp_path, capsys, monkeypatch, flags, noted):
    """--holdout 0 with --holdout-seed N ran without a word about the seed, which then changes nothing (train.py
    says so in a note); the pipeline now says so too, once, before any phase runs."""
    import timm_patchmix.pipeline as pipeline
    monkeypatch.setattr(pipeline, '_run', lambda *a, **k: 'report')
    assert pipeline.main(['--output', str(tmp_path / 'out')] + flags) == 'report'
    err = capsys.readouterr().err
    assert ('note: --holdout-seed' in err) == noted
    if noted:
        assert err.count('note:') == 1 and 'sets the held-out images of --holdout, which is off' in err


# finished phases whose records cannot be read

@pytest.mark.parametrize('phase, content, why', [('random_pm', '{"method": "random_pm", "fin', 'not valid JSON'),
                                                 ('random_pm', '[]', 'a JSON list, not an object'),
                                                 ('guided_pm', '{"method": "guided_pm"}', 'no final_top1'),
                                                 ('search', '"table"', 'a JSON str, not an object'),
                                                 ('random_pm', '{"method": "random_pm", "final_top1": "8.3", '
                                                  '"best_top1": 1}', "final_top1 must be a number, got '8.3'"),
                                                 ('guided_pm', '{"method": "guided_pm", "final_top1": 1, '
                                                  '"best_top1": NaN}', 'best_top1 must be a number, got nan'),
                                                 ('guided_pm', '{"method": 3, "final_top1": 1, "best_top1": 1}',
                                                  'method must be a string, got 3')])
def test_unreadable_done_json_is_one_error_line(tmp_path, capsys, phase, content, why):
    """A finished phase's done.json that is truncated, not an object or lacks what the report reads stops the rerun
    with exit status 1 and one error line naming the file and the folder to delete, before any phase runs."""
    from timm_patchmix.pipeline import cli
    out = tmp_path / 'out'
    argv = ['--output', str(out), '--methods', 'random_pm', 'guided_pm'] + TINY_TRAIN
    _finished_phases(out, argv)
    done = out / 'seed0' / phase / 'done.json'
    done.write_text(content)
    before = snapshot(out)
    assert cli(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith('error: ') and err.count('\n') == 1 and 'Traceback' not in err
    assert f'{done} is not a phase record ({why}' in err and f'delete {out / "seed0" / phase}' in err
    assert snapshot(out) == before


def test_a_done_json_that_is_a_folder_is_one_error_line(tmp_path, capsys):
    """A phase folder whose done.json is a folder: the phase was taken as unfinished, retrained, and the pipeline
    ended in a traceback writing its record; it is now one error line before any phase runs."""
    from timm_patchmix.pipeline import cli
    out = tmp_path / 'out'
    argv = ['--output', str(out), '--methods', 'random_pm', 'guided_pm'] + TINY_TRAIN
    _finished_phases(out, argv)
    done = out / 'seed0' / 'guided_pm' / 'done.json'
    done.unlink()
    done.mkdir()
    before = snapshot(out)
    assert cli(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f'error: {done} cannot be read (') and err.count('\n') == 1
    assert f'delete {out / "seed0" / "guided_pm"}' in err and snapshot(out) == before


def test_corrupt_mask_table_of_a_finished_search_is_one_error_line(tmp_path, capsys):
    """The finished search's masks.json that is not a mask table (corrupt, or an edited file) stops the guided phase
    with exit status 1 and one error line naming the table and the search folder to delete."""
    from timm_patchmix.pipeline import cli
    import shutil
    out = tmp_path / 'out'
    argv = ['--output', str(out), '--methods', 'random_pm', 'guided_pm'] + TINY_TRAIN
    _, table = _finished_phases(out, argv)
    good = table.read_text()
    # the guided phase finished too: the damaged table is named as such (it was called a changed setting, exit 2)
    for text in ('{"schema_version": 1, "pai', '{"pairs": []}\n'):
        table.write_text(text)
        assert cli(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith('error: mask table ') and err.count('\n') == 1 and str(table) in err
        assert f'delete {out / "seed0" / "search"}' in err and 'other settings' not in err
    table.write_text(good)
    shutil.rmtree(out / 'seed0' / 'guided_pm')  # not started yet: it reads the table now
    for text in ('{"schema_version": 1, "pai', '{"pairs": []}\n'):
        table.write_text(text)
        assert cli(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith('error: mask table ') and err.count('\n') == 1 and str(table) in err
        assert f'delete {out / "seed0" / "search"}' in err
        assert not (out / 'seed0' / 'search' / 'guided_samples.png').exists()


def test_report_budget_gives_the_sizes_in_effect_and_the_files_that_exist(tmp_path):
    """A split smaller than its --*-subset is used whole: the budget line gives the images the runs counted ("all N,
    fewer than the M asked for"), as the Splits line does; Files lists only the files --output holds."""
    import argparse
    from timm_patchmix.pipeline import report
    splits = {'selection': 'holdout', 'test': 'validation', 'train_images': 1024, 'val_images': 200,
              'test_images': 250, 'holdout': {'fraction': 0.1, 'seed': 0, 'images': 200}}
    runs = [dict(r, splits=splits, split='test') for r in _fake_runs({'base': [70.0], 'random_pm': [80.0]})]
    args = argparse.Namespace(dataset='', model='resnet32_cifar', budget='smoke', seeds=[0], holdout=0.1,
                              holdout_seed=0, final_loss='image', methods=['base', 'random_pm'],
                              output=str(tmp_path), train_args=[])
    text = report(args, runs)
    rep = json.load(open(tmp_path / 'report.json'))
    assert ('1,024 training images (a fixed random subset), all 200 held-out validation images (fewer than the 300 '
            'asked for), all 250 test images (fewer than the 300 asked for)') in text
    assert (rep['budget_detail']['val_images'], rep['budget_detail']['test_images']) == (200, 250)
    assert rep['budget_detail']['requested'] == {'val_images': 300, 'test_images': 300}
    assert '(`validation`, 250 images)' in text  # the Splits line agrees
    assert 'Files: per-run folders under `seed*/`.' in text and 'fitness.png' not in text
    args.methods = ['random_pm', 'guided_pm']
    (tmp_path / 'masks.json').write_text('{}')
    text = report(args, [dict(r, method=m) for r, m in zip(runs, args.methods)])
    assert 'Files: `masks.json` (the searched mask table), per-run folders under `seed*/`.' in text
