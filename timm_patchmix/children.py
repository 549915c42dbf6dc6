"""Jobs that depend on each other, run a few at once in child processes: what ``pipeline --jobs N`` and
``study --jobs N`` share.

A job starts once the jobs it reads are settled: done, and neither they nor a job they read waiting to run or
running. Each child's console output goes to its own log. A job that fails stops nothing else; the jobs that read it
do not start. Stopping the parent (an exception, SIGTERM, Ctrl-C) stops the running children, and on Linux a child
also stops when the parent dies by SIGKILL (:func:`follow_parent`), so that no job of a killed run goes on beside
the rerun that resumes it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

__all__ = ['PARENT_ENV', 'child_command', 'cores', 'follow_parent', 'run_children']

PARENT_ENV = 'TIMM_PATCHMIX_PARENT'  # the pid of the process that started a child of run_children

# A child loads the very package its parent runs, from that package's folder, whatever the child's working directory
# and sys.path hold (``python -m`` would put the working directory first, where another copy may live); everything
# else it imports as the parent does.
_CHILD = """import importlib, importlib.util, sys
init, module = sys.argv.pop(1), sys.argv.pop(1)
spec = importlib.util.spec_from_file_location('timm_patchmix', init)
package = importlib.util.module_from_spec(spec)
sys.modules['timm_patchmix'] = package
spec.loader.exec_module(package)
raise SystemExit(importlib.import_module('timm_patchmix.' + module).cli())
"""


def child_command(module: str, argv: Sequence[str]) -> List[str]:
    """The command line that runs ``timm_patchmix.<module>.cli()`` with ``argv`` in a child, on the package this
    process runs."""
    import timm_patchmix
    return [sys.executable, '-c', _CHILD, os.path.abspath(timm_patchmix.__file__), module] + list(argv)


def cores() -> int:
    """The CPUs this process may run on (its affinity, where the platform says), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def follow_parent() -> None:
    """In a child of :func:`run_children` on Linux: get SIGTERM when the parent dies, also by SIGKILL; exit at once
    if it has died already. Elsewhere, and in a process no parent started this way, nothing."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith('linux'):
        return
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        print(f'warning: this process cannot ask to be stopped with its parent {parent} '
              f'(prctl: {os.strerror(ctypes.get_errno())}); if that process is killed, stop this one too', flush=True)
    if os.getppid() != int(parent):  # it died before the request was in place
        raise SystemExit(f'the process {parent} that started this one is gone')


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding='utf-8', errors='replace') as fh:
            return ''.join(fh.readlines()[-lines:])
    except OSError:
        return ''


def _print(*text) -> None:
    print(*text, flush=True)


def run_children(todo: Sequence[Hashable], reads: Dict[Hashable, Sequence[Hashable]], *, slots: int, threads: int,
                 command: Callable[[Hashable], List[str]], log_path: Callable[[Hashable], str],
                 label: Callable[[Hashable], str], is_done: Callable[[Hashable], bool], noun: str = 'job',
                 alone_first: bool = False, on_done: Callable[[Hashable], None] = None,
                 log: Callable[..., None] = _print) -> List[Hashable]:
    """Run the jobs ``todo`` (in the order they should start when ready) with at most ``slots`` at once, each as
    ``command(job)`` with ``threads`` torch threads and its output appended to ``log_path(job)``.

    ``reads`` maps every job, done ones included, to the jobs whose outputs it reads. A job counts as done when its
    process exits with status 0 and ``is_done(job)`` says so; then ``on_done(job)`` runs (it may raise to stop the
    whole run). With ``alone_first`` the first job runs alone (one process downloads a dataset, say). Returns the
    jobs that failed and those that did not start because a job they read failed."""
    todo = list(todo)
    failed: List[Hashable] = []
    running: Dict[Hashable, Tuple[subprocess.Popen, object, float]] = {}
    alone = alone_first
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED='1',
               **{PARENT_ENV: str(os.getpid())})

    def settled(job) -> bool:
        return job not in running and job not in todo and is_done(job) and all(settled(r) for r in reads[job])

    unset = object()
    previous = unset
    if sys.platform != 'win32' and threading.current_thread() is threading.main_thread():
        def stop(signum, frame):
            raise SystemExit(128 + signum)
        previous = signal.signal(signal.SIGTERM, stop)
    try:
        while todo or running:
            for job, (proc, logf, began) in list(running.items()):
                if proc.poll() is None:
                    continue
                logf.close()
                del running[job]
                if proc.returncode == 0 and is_done(job):
                    log(f'{label(job)} done ({time.monotonic() - began:.0f} s)')
                    alone = False
                    if on_done is not None:
                        on_done(job)
                    continue
                failed.append(job)
                log(f'{label(job)} FAILED (exit status {proc.returncode}); the end of {log_path(job)}:\n'
                    f'{_tail(log_path(job))}')
            for job in list(todo):
                if any(r in failed for r in reads[job]):
                    todo.remove(job)
                    failed.append(job)
                    log(f'{label(job)} not started: a {noun} it reads failed')
            ready = [job for job in todo if all(settled(r) for r in reads[job])]
            for job in ready[:max(0, (1 if alone else slots) - len(running))]:
                todo.remove(job)
                path = log_path(job)
                os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
                logf = open(path, 'a', encoding='utf-8')
                proc = subprocess.Popen(command(job), stdout=logf, stderr=subprocess.STDOUT, env=env)
                running[job] = (proc, logf, time.monotonic())
                log(f'{label(job)} started (log: {path})')
            if not running and todo:  # every job a job reads is one of these jobs, or done
                raise RuntimeError(f'no {noun} can start: {todo} read jobs that are neither done nor to run')
            if running:
                time.sleep(0.2)
    finally:
        try:
            for proc, _, _ in running.values():
                proc.terminate()
            for proc, _, _ in running.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            for _, logf, _ in running.values():
                logf.close()
            if previous is not unset:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    return failed
