"""One writer per output folder: a training run, a search, a pipeline or a study holds an exclusive lock on its
folder while it writes there, so that a second command started on the same folder (a rerun typed while the first
still runs, a second terminal) stops at once with an error that names the folder, instead of both writing the same
checkpoints, ``summary.csv`` or search state.

The lock is ``flock`` on the folder itself: no file is left in the folder, and the operating system drops the lock
when the holder exits, however it ends (SIGKILL and power loss included), so a killed run never leaves a stale lock
behind and its rerun resumes at once. A process forked while a folder is held (a DataLoader worker) closes its copy
of the locked descriptor at once, so the lock belongs to the holder alone: a worker that outlives a killed holder
by a few seconds does not keep the folder. Where ``flock`` is unavailable (Windows) or refused (some network file
systems), a warning says so and the command runs without the lock.
"""
from __future__ import annotations

import contextlib
import errno
import os
import warnings
from typing import Iterator, Optional, Set, Tuple, Type

__all__ = ['FolderBusyError', 'hold_folder', 'holder_pid']


class FolderBusyError(RuntimeError):
    """Another process holds the output folder (:func:`hold_folder`)."""


class _Held:
    def __init__(self, fd: int):
        self.fd, self.pid = fd, os.getpid()


_HELD: Set[_Held] = set()  # the folders this process holds


def _forked() -> None:
    """In a child just forked: give up the parent's locked descriptors (closing a copy leaves the parent's lock)."""
    for held in list(_HELD):
        try:
            os.close(held.fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=_forked)


def holder_pid(path: str) -> Optional[int]:
    """The process that holds a ``flock`` on ``path``, read from Linux's ``/proc/locks``; ``None`` where that cannot
    be told. For the error message only: whether the folder is taken is decided by ``flock`` itself."""
    try:
        st = os.stat(path)
        with open('/proc/locks', encoding='ascii') as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line has "->" after the number
        if len(parts) < 6 or parts[1] != 'FLOCK' or parts[2] == '->':
            continue
        try:
            major, minor, inode = parts[5].split(':')
            if (int(major, 16), int(minor, 16), int(inode)) == want:
                return int(parts[4])
        except ValueError:
            continue
    return None


def _command_of(pid: int) -> str:
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as fh:
            args = fh.read().rstrip(b'\0').split(b'\0')
    except OSError:
        return ''
    text = ' '.join(a.decode('utf-8', 'replace') for a in args)
    return text if len(text) <= 200 else text[:197] + '...'


def folder_problem(path: str, locked: bool = False) -> Optional[Tuple[str, str]]:
    """Why ``path`` cannot be made or written in as a folder, as ``(where, what)`` (None: it can): a file or a link
    to nothing where it or a folder above it would be, or the nearest folder that exists not writable (root too: a
    read-only file system, an immutable folder); ``where`` is that path, absolute. Reads only, so every process of
    a run can ask before any work. ``locked``: the folder will be held (:func:`hold_folder`), so where it exists it
    must be readable too."""
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        if os.path.lexists(p):
            return p, ('is a link to nothing' if os.path.islink(p) and not os.path.exists(p) else
                       'is a file, not a folder')
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    if not os.access(p, os.W_OK | os.X_OK):
        return p, 'cannot be written in (no permission, or a read-only file system)'
    if locked and p == os.path.abspath(path) and not os.access(p, os.R_OK):  # (its lock needs it readable)
        return p, 'cannot be read (no read permission; its lock is held on a read descriptor)'
    return None


@contextlib.contextmanager
def hold_folder(path: str, what: str, error: Type[Exception] = FolderBusyError) -> Iterator[None]:
    """Create ``path`` if needed and hold an exclusive lock on it for the ``with`` block; ``what`` names the command
    in the message (``'training run'``, ``'search'``...). Raises ``error`` at once, before the block runs, when
    another process holds the folder, or it cannot be made or written in. Nothing is written to the folder.

    One process must not hold the same folder twice (a second ``hold_folder`` on it raises, as from another
    process). A process forked inside the block does not hold the folder (its copy of the descriptor is closed at
    the fork), and leaving the block there releases nothing."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a file where the folder or one above it would be, no permission...
        why = ('it is a link to nothing' if os.path.islink(path) and not os.path.exists(path) else
               'it is a file, not a folder' if os.path.lexists(path) else e.strerror or str(e))
        raise error(f'cannot make the {what} folder {path}: {why}') from None
    if not os.access(path, os.W_OK | os.X_OK):  # (root too: a read-only file system, an immutable folder)
        raise error(f'cannot write in the {what} folder {path}: no permission to write there, or a read-only file '
                    f'system; give another output folder')
    try:
        import fcntl
    except ImportError:  # Windows
        _unlocked(path, 'this platform has no flock')
        yield
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, 'O_DIRECTORY', 0))
    except OSError as e:  # (a folder that may be written in but not read: its lock is taken on a read descriptor)
        raise error(f'cannot use the {what} folder {path}: {e.strerror or e}; it must be readable too (its '
                    f'lock is held on it); give another output folder or make it readable') from None
    held = _Held(fd)
    _HELD.add(held)  # from here on a fork closes the child's copy
    try:
        locked = False
        try:
            fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                _unlocked(path, f'flock refused: {e.strerror}')
            else:
                pid = holder_pid(path)
                if pid == os.getpid():  # this process holds it already: another thread, or a run inside a run
                    raise error(f'{path} is in use: this process (another thread, or the call that started this '
                                f'one) is writing there now. Wait for that call to end, or give this {what} another '
                                f'output folder.') from None
                by = ''
                if pid is not None:
                    command = _command_of(pid)
                    by = f' (process {pid}' + (f': {command}' if command else '') + ')'
                raise error(f'{path} is in use: another process is writing there now{by}. Wait for it to end or '
                            f'stop it, or give this {what} another output folder.') from None
        yield
    finally:
        if held.pid == os.getpid():  # a forked child that leaves the block has closed its copy already
            _HELD.discard(held)
            if locked:
                fcntl.flock(held.fd, fcntl.LOCK_UN)
            os.close(held.fd)


def _unlocked(path: str, why: str) -> None:
    warnings.warn(f'{path}: {why}, so nothing stops a second command from writing to this folder at the same '
                  f'time; run one at a time there', RuntimeWarning, stacklevel=3)
