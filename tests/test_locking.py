"""One writer per output folder: a second training run, search, pipeline or study started on a folder that another
process is writing to stops at once with an error naming the folder and that process, and writes nothing; the lock
ends with its holder, however that ends."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from timm_patchmix import study
from timm_patchmix.locking import FolderBusyError, hold_folder, holder_pid
from timm_patchmix.pipeline import cli as pipeline_cli
from timm_patchmix.search import main as search_main
from timm_patchmix.train import main as train_main
from test_resume_settings import snapshot
from test_search import SMALL, make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get('PYTHONPATH')])),
           OMP_NUM_THREADS='1')
HOLD = """import sys, time
from timm_patchmix.locking import hold_folder
with hold_folder(sys.argv[1], 'test'):
    print('held', flush=True)
    time.sleep(600)
"""
TINY = ['--train-subset', '64', '--val-subset', '40', '-b', '16', '-j', '0', '--no-progress', '--epochs', '2']

pytestmark = pytest.mark.skipif(not sys.platform.startswith('linux'), reason='flock and /proc/locks: Linux')


@contextlib.contextmanager
def held(path):
    """Another process holding ``path`` as every command of the project does, until the block ends (SIGKILL)."""
    proc = subprocess.Popen([sys.executable, '-c', HOLD, str(path)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert proc.stdout.readline().strip() == 'held'
        yield proc
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_second_holder_is_refused_with_the_holders_pid_and_a_killed_holder_frees_the_folder(tmp_path):
    folder = tmp_path / 'out'
    with held(folder) as proc:
        assert os.listdir(folder) == []  # the lock leaves no file behind
        assert holder_pid(str(folder)) == proc.pid
        with pytest.raises(FolderBusyError) as e:
            with hold_folder(str(folder), 'training run'):
                pytest.fail('the block ran while another process held the folder')
        assert str(folder) in str(e.value) and f'process {proc.pid}' in str(e.value)
        assert 'give this training run another output folder' in str(e.value)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with hold_folder(str(folder), 'training run'):  # no stale lock after SIGKILL
        assert holder_pid(str(folder)) == os.getpid()
    assert holder_pid(str(folder)) is None
    assert os.listdir(folder) == []


def test_the_error_class_is_the_callers_and_one_process_cannot_hold_a_folder_twice(tmp_path):
    class Mine(RuntimeError):
        pass
    with hold_folder(str(tmp_path), 'search'):
        with pytest.raises(Mine, match='is in use') as e:
            with hold_folder(str(tmp_path), 'search', Mine):
                pass
    if os.path.exists('/proc/locks'):  # the holder is known: the message names this process, not "another"
        assert 'this process (another thread' in str(e.value) and 'another process' not in str(e.value)


def test_the_block_end_frees_the_folder_while_a_forked_process_that_shares_the_lock_lives(tmp_path):
    with hold_folder(str(tmp_path), 'training run'):
        pid = os.fork()  # a DataLoader worker, say
        if pid == 0:
            time.sleep(60)
            os._exit(0)
    try:
        with held(tmp_path):  # another process gets the folder while the fork lives
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


HOLD_AND_FORK = """import os, sys, time
from timm_patchmix.locking import hold_folder
with hold_folder(sys.argv[1], 'test'):
    child = os.fork()
    if child == 0:  # a DataLoader worker, say, that outlives its killed parent for a while
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
"""


def test_a_killed_holders_forked_child_does_not_keep_the_folder(tmp_path):
    proc = subprocess.Popen([sys.executable, '-c', HOLD_AND_FORK, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=ENV)
    child = int(proc.stdout.readline())
    try:
        assert holder_pid(str(tmp_path)) == proc.pid
        proc.kill()
        proc.wait()
        os.kill(child, 0)  # still alive, with the parent's descriptors but the locked one
        with hold_folder(str(tmp_path), 'training run'):
            assert holder_pid(str(tmp_path)) == os.getpid()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_train_on_a_folder_another_run_writes_stops_before_writing(tmp_path):
    """Two real runs: while this process trains into run/, train.py on the same folder exits 1 naming this
    process, and this run's files come out whole."""
    second = {}

    def on_step(ev):
        if not second:
            second['proc'] = subprocess.run(
                [sys.executable, 'train.py'] + TINY + ['--output', str(tmp_path), '--experiment', 'run'],
                cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    res = train_main(TINY + ['--output', str(tmp_path), '--experiment', 'run'], on_step=on_step)
    proc = second['proc']
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f'{tmp_path / "run"} is in use' in proc.stderr and f'process {os.getpid()}' in proc.stderr
    assert [r['epoch'] for r in res['rows']] == [0, 1]
    with open(tmp_path / 'run' / 'summary.csv') as f:
        assert len(f.read().splitlines()) == 3  # header and both epochs: the refused run wrote nothing

    # a resume refused while the folder is held changes no byte of it
    before = snapshot(tmp_path / 'run')
    resume = TINY + ['--epochs', '3', '--resume', str(tmp_path / 'run' / 'state.safetensors')]
    with held(tmp_path / 'run'):
        with pytest.raises(SystemExit, match='is in use'):
            train_main(resume)
    assert snapshot(tmp_path / 'run') == before
    assert [r['epoch'] for r in train_main(resume)['rows']] == [0, 1, 2]  # free again: it resumes


def test_search_on_a_held_folder_writes_nothing(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / 'ft.safetensors'))
    out = tmp_path / 'search'
    with held(out) as proc:
        with pytest.raises(SystemExit, match=f'is in use: another process is writing there now \\(process '
                                             f'{proc.pid}'):
            search_main(['--checkpoint', ckpt, '--output', str(out)] + SMALL)
    assert os.listdir(out) == []


def test_study_on_a_held_folder_exits_1_and_writes_nothing_while_list_still_reads(tmp_path, capsys):
    out = str(tmp_path / 'study')
    with held(out):
        assert study.cli(['--quick', '--output', out]) == 1
        assert 'is in use' in capsys.readouterr().err
        assert os.listdir(out) == []
        assert study.main(['--quick', '--output', out, '--list']) == 0  # reading is not writing


def test_a_second_pipeline_on_one_output_exits_1_naming_the_first(tmp_path, capsys):
    out = tmp_path / 'p'
    first = subprocess.Popen([sys.executable, '-m', 'timm_patchmix.pipeline', '--output', str(out)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 240
        while holder_pid(str(out)) != first.pid:  # the pipeline holds its --output before any phase begins
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert pipeline_cli(['--output', str(out)]) == 1
        err = capsys.readouterr().err
        assert f'{out} is in use' in err and f'process {first.pid}' in err and 'timm_patchmix.pipeline' in err
    finally:
        first.kill()
        first.wait()


def test_a_seed_given_twice_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        pipeline_cli(['--output', str(tmp_path / 'p'), '--seeds', '0', '1', '0'])
    assert e.value.code == 2
    assert 'argument --seeds: seed 0 given more than once' in capsys.readouterr().err
    assert not os.path.exists(tmp_path / 'p')


def test_a_folder_that_cannot_be_made_is_the_callers_error_naming_it(tmp_path):
    """A file where the folder (or one above it) would be: the caller's error naming the folder and why (it was
    the OSError of makedirs), for a search's or a pipeline's output as for a training run's; the file is kept."""
    from timm_patchmix.search import SearchError
    afile = tmp_path / 'afile'
    afile.write_text('kept')
    for path, why in ((afile, 'it is a file, not a folder'), (afile / 'below', 'Not a directory')):
        for error in (FolderBusyError, SearchError):
            with pytest.raises(error, match=f'^cannot make the search folder {path}: {why}$'):
                with hold_folder(str(path), 'search', error):
                    pytest.fail('the block ran')
    assert afile.read_text() == 'kept'
    from timm_patchmix.search import SearchConfig, search
    ckpt = make_checkpoint(str(tmp_path / 'ckpt.safetensors'))
    with pytest.raises(SearchError, match=f'cannot make the search folder {afile}: it is a file, not a folder'):
        search(SearchConfig(checkpoint=ckpt, output=str(afile), population=16, generations=2, k=4, val_subset=300,
                            device='cpu'))
    assert afile.read_text() == 'kept'


def test_runs_started_in_the_same_second_get_their_own_dated_folders(tmp_path, monkeypatch):
    """Without --experiment a run's folder is named by its start time to the second, so two runs started in the same
    second (two seeds launched together, a script of short runs) chose the same folder: the second was refused as
    in use, or, once the first had ended, took over its folder. Like timm's get_outdir(inc=True), the later one
    now gets ``<name>-1``, ``<name>-2``...; the earlier run's files stay as they were."""
    import datetime as dt
    from timm_patchmix.engine import run as engine_run

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)
    monkeypatch.setattr(engine_run, 'datetime', Frozen)
    argv = TINY[:-1] + ['1', '--output', str(tmp_path)]
    first = train_main(argv)['output']
    assert os.path.basename(first) == '20260102-030405-resnet32_cifar-base'
    before = snapshot(first)
    second = train_main(argv + ['--seed', '1'])['output']
    assert second == first + '-1' and snapshot(first) == before
    with held(first + '-2'):  # (a folder another process made and holds: skipped too)
        third = train_main(argv)['output']
    assert third == first + '-3'
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(f) for f in (first, second, first + '-2', third)]


def test_a_folder_that_can_be_written_but_not_read_is_one_error_line(tmp_path, monkeypatch, capsys):
    """A run folder with write but no read permission (mode 0333) passed the checks and then failed on the lock's
    read descriptor with a PermissionError traceback; it is named (train.py before any work, hold_folder itself
    when asked directly). Root reads anything, so the permission is what the checks are told."""
    import timm_patchmix.locking as locking
    from timm_patchmix.train import cli as train_cli
    out = tmp_path / 'wx'
    out.mkdir()
    real_access, real_open = os.access, os.open

    def access(path, mode, *a, **k):
        return False if os.path.abspath(path) == str(out) and mode & os.R_OK else real_access(path, mode, *a, **k)

    def open_(path, flags, *a, **k):
        if os.path.abspath(path) == str(out):
            raise PermissionError(13, 'Permission denied')
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(locking.os, 'open', open_)
    with pytest.raises(FolderBusyError, match=re.escape(f'cannot use the search folder {out}: Permission denied; it '
                                                        f'must be readable too')):
        with hold_folder(str(out), 'search'):
            pass
    monkeypatch.setattr(locking.os, 'access', access)
    with pytest.raises(SystemExit) as e:
        train_cli(TINY + ['--output', str(tmp_path), '--experiment', 'wx'])
    assert f'{out} cannot be read (no read permission' in str(e.value.code)
    assert os.listdir(out) == []
    assert locking.folder_problem(str(out)) is None  # (a folder only written into need not be read)
