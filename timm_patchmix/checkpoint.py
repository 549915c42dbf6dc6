"""Atomic, pickle-free checkpoints: model weights and full training state in safetensors with JSON metadata.

A training-state file is one safetensors file: tensors under ``model.*``, ``optim.*`` and ``rng.*`` and a JSON
document (epoch, args, optimizer hyper-parameters, RNG scalars, summary rows...) in the header metadata. One file
means one atomic rename, so a kill can never pair weights of one epoch with state of another.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .validation import Fields, check_python_rng, check_weights_meta

__all__ = ['WriteError', 'atomic_write_bytes', 'atomic_write_text', 'atomic_copy', 'save_weights', 'load_weights',
           'save_state', 'load_state', 'CheckpointError', 'rng_state', 'set_rng_state', 'save_bundle', 'load_bundle',
           'clean_stale_temps', 'temp_dir', 'release_temp', 'tensors_digest', 'check_file_digest']

_META_KEY = 'timm_patchmix'
# the SHA-256 of a file's tensors (names, dtypes, shapes and bytes), beside its metadata: safetensors checks the
# header and the sizes, not the bytes, so a damaged copy would otherwise load as other weights
_DIGEST_KEY = 'timm_patchmix.sha256'
# the SHA-256 of the metadata's JSON text as written: a flipped bit in a number of it (an epoch, a learning rate,
# an RNG state) keeps it valid JSON of another value
_META_DIGEST_KEY = 'timm_patchmix.meta_sha256'


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, tampered with or of the wrong kind."""


class WriteError(OSError):
    """A file could not be written (no permission, a read-only file system, a full disk): the message names the
    file and the reason. Writes are atomic, so the file is as it was before."""

    def __init__(self, path: str, cause: BaseException):
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        super().__init__(f'cannot write {path}: {why}')
        self.path, self.errno = path, getattr(cause, 'errno', None)

    def __reduce__(self):  # (pickled as its message: the cause is not kept)
        return _write_error, (self.path, str(self), self.errno)


def _write_error(path: str, message: str, errno_: Optional[int]) -> WriteError:
    e = WriteError.__new__(WriteError)
    OSError.__init__(e, message)
    e.path, e.errno = path, errno_
    return e


# A temporary file or folder of this project's writers: ``.<target name>.patchmix-<pid>-<random>.tmp`` beside its
# target. A writer killed before its rename leaves one behind; the next write into that folder removes those whose
# process is gone (see clean_stale_temps).
_TEMP_NAME = re.compile(r'^\.(.+)\.patchmix-(\d+)-[A-Za-z0-9_]+\.tmp$')
SET_ASIDE = 'x'  # in a temporary folder: the folder an overwrite moved out of the way before renaming its own in
_ACTIVE: Set[str] = set()  # this process's temporaries in flight


_NAME_MAX = 255  # bytes in one file name (Linux, macOS and Windows file systems alike)


def temp_prefix(path: str, shorten: bool = False) -> str:
    """The name prefix of the temporaries for ``path`` (the suffix is ``.tmp``). With ``shorten`` (a file's
    temporary, whose name nothing reads back) the target's name is cut so that the temporary's name fits in
    ``_NAME_MAX`` bytes wherever the target's does; a folder's keeps it whole (a killed overwrite's clean-up puts the
    set-aside folder back under it)."""
    base, tail = os.path.basename(os.path.normpath(path)), f'.patchmix-{os.getpid()}-'
    if shorten:  # ('.', tempfile's random part with room to spare, '.tmp')
        room = _NAME_MAX - len(os.fsencode(tail)) - 1 - 16 - len('.tmp')
        while len(os.fsencode(base)) > room:
            base = base[:-1]
    return f'.{base}{tail}'


def _process_gone(pid: int) -> bool:
    if pid == os.getpid() or os.name != 'posix':
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def clean_stale_temps(folder: str) -> List[str]:
    """Remove the temporaries that killed writers of this project left in ``folder``: those of a process that no
    longer exists, and this process's own that are not in flight. Returns the paths removed. A folder that an
    overwrite had set aside (killed between its two renames) goes back to its name when that name is free."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _TEMP_NAME.match(name)
        if not m:
            continue
        path = os.path.join(folder, name)
        pid = int(m.group(2))
        if path in _ACTIVE or not (_process_gone(pid) or pid == os.getpid()):
            continue
        aside, target = os.path.join(path, SET_ASIDE), os.path.join(folder, m.group(1))
        if os.path.lexists(aside) and not os.path.lexists(target):
            os.replace(aside, target)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def temp_dir(path: str) -> str:
    """A new temporary folder beside ``path`` (for a folder built then renamed into place); call
    :func:`release_temp` once it is renamed or removed."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = tempfile.mkdtemp(prefix=temp_prefix(path), suffix='.tmp', dir=folder)
    _ACTIVE.add(tmp)
    return tmp


def release_temp(tmp: str) -> None:
    _ACTIVE.discard(tmp)


def _read_umask() -> int:
    umask = os.umask(0)  # the only portable way to read it sets it: done once, at import
    os.umask(umask)
    return umask


_IMPORT_UMASK = _read_umask()


def _umask() -> int:
    """The process's umask, read without setting it where the system allows (Linux's ``/proc/self/status``), so
    that another thread never creates a file while the umask is briefly 0; elsewhere the umask at import."""
    try:
        with open('/proc/self/status', encoding='ascii') as f:
            for line in f:
                if line.startswith('Umask:'):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORT_UMASK


def _atomic(path: str, write) -> None:
    """Write ``path`` through ``write(tmp)`` on a temporary beside it, renamed over it once whole; a failure of the
    file system (:class:`WriteError`) or of ``write`` leaves ``path`` as it was and no temporary."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # (a file where the folder or one above it would be: named, not the file's "File exists")
        from .locking import folder_problem
        problem = folder_problem(folder)
        raise WriteError(path, OSError(e.errno, ' '.join(problem)) if problem else e) from None
    try:
        clean_stale_temps(folder)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, shorten=True), suffix='.tmp', dir=folder)
        os.close(fd)
    except OSError as e:
        raise WriteError(path, e) from None
    _ACTIVE.add(tmp)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 (and a writer may recreate the file); use open()'s mode
        with open(tmp, 'rb+') as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            if os.path.exists(tmp):
                os.unlink(tmp)
        except OSError:
            pass  # (a folder made read-only meanwhile: the next write there removes it, see clean_stale_temps)
        of_file = isinstance(e, SafetensorError) or (isinstance(e, OSError) and not isinstance(e, WriteError) and (
            getattr(e, 'filename', None) in (None, tmp, path) or getattr(e, 'filename2', None) in (tmp, path)))
        if of_file:  # an I/O error of the file written (not one of a file read, such as atomic_copy's source)
            raise WriteError(path, e) from e
        raise
    finally:
        _ACTIVE.discard(tmp)


def atomic_write_bytes(path: str, data: bytes) -> None:
    def write(tmp):
        with open(tmp, 'wb') as f:
            f.write(data)
    _atomic(path, write)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode('utf-8'))


def atomic_copy(src: str, path: str) -> None:
    """Copy the file ``src`` to ``path`` atomically, streamed (not read into memory whole)."""
    _atomic(path, lambda tmp: shutil.copyfile(src, tmp))


def _contiguous(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The tensors on the CPU, each contiguous and in memory of its own: a tensor that shares its storage with an
    earlier one (a model's tied weights, e.g. timm's CoaT, whose state dict names one tensor twice) is copied, as
    safetensors writes no shared memory; every name keeps its values, so the file loads strictly."""
    out, seen = {}, set()
    for k, v in tensors.items():
        t = v.detach().cpu().contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(ptr)
        out[k] = t
    return out


def tensors_digest(tensors: Dict[str, torch.Tensor]) -> str:
    """The SHA-256 of named tensors as a file holds them: each name, dtype, shape and the bytes of its values, in
    name order (the same for the tensors written and those read back)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f'{name}\0{str(t.dtype)}\0{list(t.shape)}\0'.encode('utf-8'))
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _write(path: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> None:
    """``tensors`` and the JSON ``meta`` as one safetensors file, with the tensors' digest, atomically."""
    tensors = _contiguous(tensors)
    text = json.dumps(meta)
    md = {_META_KEY: text, 'format': 'pt', _DIGEST_KEY: tensors_digest(tensors), _META_DIGEST_KEY: _text_digest(text)}
    _atomic(path, lambda tmp: save_file(tensors, tmp, metadata=md))


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode('utf-8')).hexdigest()


def save_weights(path: str, state_dict: Dict[str, torch.Tensor], meta: Optional[Dict[str, Any]] = None) -> None:
    """Write a model ``state_dict`` as safetensors, atomically, with optional JSON metadata."""
    _write(path, state_dict, meta or {})


def _pickle_kind(path: str) -> Optional[str]:
    """What a file that is not safetensors looks like from its first bytes, without unpickling it: a
    ``torch.save`` zip archive or a raw pickle (timm's ``.pth``/``.pth.tar``); ``None`` for anything else."""
    try:
        with open(path, 'rb') as f:
            head = f.read(4)
    except OSError:
        return None
    if head == b'PK\x03\x04':
        return 'a PyTorch checkpoint (a torch.save zip archive, like timm\'s .pth/.pth.tar)'
    if head[:1] == b'\x80' and head[1:2] in (b'\x02', b'\x03', b'\x04', b'\x05'):
        return 'a pickle (a legacy torch.save file, like timm\'s .pth/.pth.tar)'
    return None


def _unreadable(path: str, e: Exception) -> CheckpointError:
    kind = _pickle_kind(path)
    if kind:
        return CheckpointError(f'{path} is {kind}, not a safetensors file; timm_patchmix reads only safetensors '
                               f'(unpickling a file can run code). If you trust the file, load it with torch.load '
                               f'and save its state dict with safetensors.torch.save_file')
    return CheckpointError(f'{path} is not a readable safetensors file (truncated or corrupt?): {e}')


def not_model_weights(path: str, kind: str) -> CheckpointError:
    """The error for a file of this project's that holds no model weights to load (``kind``: its metadata's)."""
    if kind == 'train_state':
        return CheckpointError(f'{path} is a training state (to --resume from), not model weights: give the run\'s '
                               f'best.safetensors or last.safetensors beside it')
    if kind == 'search_state':
        return CheckpointError(f'{path} is a search state (to resume search.py from), not model weights: give the '
                               f'checkpoint the search scored with, or a run\'s best.safetensors')
    return CheckpointError(f'{path} is a {kind.replace("_", " ")} file of timm_patchmix, not model weights')


def read_meta(path: str) -> Dict[str, Any]:
    """The JSON metadata of a file this project wrote, without reading its tensors (``CheckpointError`` for a
    missing, unreadable or pickled file and for metadata that is not a JSON object)."""
    return _read_header(path)[0]


def _read_header(path: str) -> Tuple[Dict[str, Any], Optional[str]]:
    """:func:`read_meta`'s metadata and the tensors' digest the file was written with (None: a file of another
    writer, or of a version before the digest)."""
    if os.path.isdir(path):
        inside = [n for n in ('state.safetensors', 'best.safetensors', 'last.safetensors')
                  if os.path.isfile(os.path.join(path, n))]
        raise CheckpointError(f'checkpoint {path} is a folder, not a file'
                              + (f' (it holds {", ".join(inside)}: name one of them)' if inside else ''))
    if not os.path.isfile(path):
        raise CheckpointError(f'checkpoint {path} does not exist')
    try:
        from safetensors import safe_open
        with safe_open(path, framework='pt') as f:
            md = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unreadable(path, e) from None
    try:
        meta = json.loads(md.get(_META_KEY, '{}'))
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f'{path} has corrupt metadata: {e}') from None
    if not isinstance(meta, dict):
        raise CheckpointError(f'{path}: the {_META_KEY} metadata must be a JSON object, got {type(meta).__name__}')
    signed = md.get(_META_DIGEST_KEY)  # (none in a file of another writer or an earlier version: unchecked)
    if isinstance(signed, str) and _text_digest(md.get(_META_KEY, '')) != signed:
        raise CheckpointError(f'{path} is corrupt: its metadata differ from what it was written with (their SHA-256 '
                              f'does not match the one in its header), a damaged copy or download; restore it from '
                              f'where it came from')
    if meta.get('kind') is not None and not isinstance(meta['kind'], str):
        raise CheckpointError(f'{path}: metadata kind must be a string, got {meta["kind"]!r}')
    digest = md.get(_DIGEST_KEY)
    return meta, digest if isinstance(digest, str) else None


def _read(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    meta, digest = _read_header(path)
    try:
        # copies in memory: load_file's tensors map the file, and one an optimizer or a search keeps (a resume's
        # state) would hold a replaced file's disk space until the process ends (the next write needs room for two)
        tensors = {k: v.clone() for k, v in load_file(path).items()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _unreadable(path, e) from None
    _check_digest(path, tensors, digest)
    return tensors, meta


def _check_digest(path: str, tensors: Dict[str, torch.Tensor], digest: Optional[str],
                  remedy: str = 'restore it from where it came from') -> None:
    if digest is not None and tensors_digest(tensors) != digest:
        raise CheckpointError(f'{path} is corrupt: its tensors differ from those it was written with (their '
                              f'SHA-256 does not match the one in its header), a damaged copy or download; {remedy}')


def check_file_digest(path: str, tensors: Dict[str, torch.Tensor], remedy: str = 'restore it from where it came '
                      'from') -> None:
    """``tensors``, read from ``path`` by another loader (timm's), against the digest in the file's header (none
    there, from another writer or an earlier version: nothing to check); ``CheckpointError`` ending in ``remedy``
    when they differ."""
    _check_digest(path, tensors, _read_header(path)[1], remedy)


def _index(key: str) -> bool:
    """An index written as ASCII digits (``str.isdigit`` also takes '²', which ``int`` refuses)."""
    return key.isascii() and key.isdigit()


def _check_train_meta(path: str, meta: Dict[str, Any]) -> None:
    """Types and ranges of a training state's metadata, before a resume uses any of it."""
    f = Fields(path, CheckpointError)
    epoch = f.int(meta.get('epoch'), 'epoch', lo=0)
    if meta.get('rows') is not None:
        rows = f.list(meta['rows'], 'rows', epoch + 1)
        for k, row in enumerate(rows):
            f.dict(row, f'rows[{k}]')
            for key, v in row.items():
                if key == 'epoch':
                    f.int(v, f'rows[{k}].epoch', lo=k, hi=k)
                else:
                    f.number(v, f'rows[{k}].{key}')
    best = meta.get('best')
    if best is not None:
        f.dict(best, 'best')
        f.number(best.get('score'), 'best.score')
        f.int(best.get('epoch'), 'best.epoch', lo=0, hi=epoch)
        if best.get('metric') not in ('top1', 'top5', 'loss'):
            f.fail('best.metric', "'top1', 'top5' or 'loss'", best.get('metric'))
    if meta.get('updates') is not None:
        f.int(meta['updates'], 'updates', lo=0)
    if meta.get('checkpoints') is not None:  # --checkpoint-hist's kept epochs
        kept = f.list(meta['checkpoints'], 'checkpoints')
        for k, e in enumerate(kept):
            f.int(e, f'checkpoints[{k}]', lo=0, hi=epoch)
        if len(set(kept)) != len(kept):
            f.fail('checkpoints', 'distinct epochs', kept)
    if meta.get('seed') is not None:
        f.int(meta['seed'], 'seed')
    for key in ('args', 'settings'):
        if meta.get(key) is not None:
            f.dict(meta[key], key)
    if meta.get('optimizer') is not None:
        om = f.dict(meta['optimizer'], 'optimizer')
        for idx, entry in f.dict(om.get('state'), 'optimizer.state').items():
            if not _index(idx):
                f.fail('optimizer.state keys', 'parameter indices', idx)
            f.dict(entry, f'optimizer.state.{idx}')
        groups = f.list(om.get('param_groups'), 'optimizer.param_groups')
        for k, group in enumerate(groups):
            f.dict(group, f'optimizer.param_groups[{k}]')
            for j, p in enumerate(f.list(group.get('params'), f'optimizer.param_groups[{k}].params')):
                f.int(p, f'optimizer.param_groups[{k}].params[{j}]', lo=0)
        if om.get('group_tensors') is not None:
            for k, names in f.dict(om['group_tensors'], 'optimizer.group_tensors').items():
                if not _index(k) or int(k) >= len(groups):
                    f.fail('optimizer.group_tensors keys', f'group indices below {len(groups)}', k)
                for j, name in enumerate(f.list(names, f'optimizer.group_tensors.{k}')):
                    if f.str(name, f'optimizer.group_tensors.{k}[{j}]') not in groups[int(k)]:
                        f.fail(f'optimizer.group_tensors.{k}[{j}]', 'a setting of its group', name)
        for key, v in f.dict(om.get('extra', {}), 'optimizer.extra').items():
            if key in ('state', 'param_groups'):
                f.fail('optimizer.extra keys', 'names other than state and param_groups', key)
            _check_encoded(f, v, f'optimizer.extra.{key}')
        if om.get('encoded') is not None:
            enc = f.dict(om['encoded'], 'optimizer.encoded')
            for where in enc:
                if where not in ('state', 'param_groups'):
                    f.fail('optimizer.encoded keys', "'state' or 'param_groups'", where)
            for where, entries in (('state', om['state']), ('param_groups', dict(enumerate(groups)))):
                for k, names in f.dict(enc.get(where, {}), f'optimizer.encoded.{where}').items():
                    entry = entries.get(int(k) if where == 'param_groups' and _index(k) else k)
                    if entry is None:
                        f.fail(f'optimizer.encoded.{where} keys', f'entries of optimizer.{where}', k)
                    for j, name in enumerate(f.list(names, f'optimizer.encoded.{where}.{k}')):
                        if f.str(name, f'optimizer.encoded.{where}.{k}[{j}]') not in entry:
                            f.fail(f'optimizer.encoded.{where}.{k}[{j}]', f'a name of optimizer.{where}.{k}', name)
                        _check_encoded(f, entry[name], f'optimizer.{where}.{k}.{name}')
    rng = f.dict(meta.get('rng'), 'rng')
    np_state = f.list(rng.get('numpy'), 'rng.numpy', 4)
    f.str(np_state[0], 'rng.numpy[0]')
    f.int(np_state[1], 'rng.numpy[1]', lo=0, hi=624)
    f.int(np_state[2], 'rng.numpy[2]', lo=0, hi=1)
    f.number(np_state[3], 'rng.numpy[3]')
    check_python_rng(f, rng.get('python'), 'rng.python')


def load_weights(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Read weights written by :func:`save_weights` (or any safetensors state dict): ``(state_dict, meta)``.
    The metadata's fields are checked (types and ranges) before they are returned."""
    tensors, meta = _read(path)
    if meta.get('kind') == 'train_state':
        _check_train_meta(path, meta)
    elif meta.get('kind') is not None:  # a search state: no model's tensors (it would load as a model that fits none)
        raise not_model_weights(path, str(meta['kind']))
    else:
        check_weights_meta(meta, Fields(path, CheckpointError))
    return {k[len('model.'):] if meta.get('kind') == 'train_state' else k: v for k, v in tensors.items()
            if meta.get('kind') != 'train_state' or k.startswith('model.')}, meta


def rng_state() -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Python, numpy and torch (CPU and CUDA) RNG states as tensors plus JSON."""
    tensors = {'rng.torch': torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f'rng.cuda.{i}'] = s
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors['rng.numpy'] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    py = random.getstate()
    meta = {'numpy': [name, int(pos), int(has_gauss), float(gauss)], 'python': [py[0], list(py[1]), py[2]]}
    return tensors, meta


@contextmanager
def kept_rng_state() -> Iterator[None]:
    """The global generators of Python, NumPy and torch (the CPU's, and every CUDA device's once CUDA is
    initialised) as they were before the block, whatever it draws or seeds: ``train()`` and ``search()`` leave their
    caller's streams as they found them, and a callback cannot shift a run's. The generators are global, so two
    calls at once in two threads still draw from the same ones."""
    py, numpy_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def set_rng_state(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> None:
    torch.set_rng_state(tensors['rng.torch'])
    cuda = sorted(k for k in tensors if k.startswith('rng.cuda.'))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda][:torch.cuda.device_count()])
    name, pos, has_gauss, gauss = meta['numpy']
    np.random.set_state((name, tensors['rng.numpy'].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = meta['python']
    random.setstate((version, tuple(internal), gauss_next))


_JSON_SCALARS = (type(None), bool, int, float, str)


def _is_json(v: Any) -> bool:
    """A value JSON gives back as it was (a tuple would come back a list)."""
    if isinstance(v, list):
        return all(_is_json(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json(x) for k, x in v.items())
    return isinstance(v, _JSON_SCALARS)


def _put(tensors: Dict[str, torch.Tensor], name: str, v: torch.Tensor) -> None:
    if name in tensors:  # ('Q.0' beside a list 'Q', say): one would overwrite the other
        raise TypeError(f'two values of the optimizer would be stored as {name}; a training state cannot hold both')
    tensors[name] = v


def _encode(v: Any, name: str, tensors: Dict[str, torch.Tensor]) -> Any:
    """An optimizer value JSON cannot hold, as JSON: a tensor becomes ``{'tensor': <its name in the file>}`` (added to
    ``tensors``), a dtype ``{'dtype': 'bfloat16'}``, a list or tuple ``{'list'|'tuple': [items]}``, a dict with
    string keys ``{'dict': {key: item}}``; scalars stay."""
    if isinstance(v, torch.Tensor):
        _put(tensors, name, v)
        return {'tensor': name}
    if isinstance(v, torch.dtype):
        return {'dtype': str(v).replace('torch.', '')}
    if isinstance(v, (list, tuple)):
        return {type(v).__name__: [_encode(x, f'{name}.{i}', tensors) for i, x in enumerate(v)]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {'dict': {k: _encode(x, f'{name}.{k}', tensors) for k, x in v.items()}}
    if isinstance(v, _JSON_SCALARS):
        return v
    raise TypeError(f'the optimizer holds a {type(v).__name__} ({name}), which a training state cannot store')


def _decode(v: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if not isinstance(v, dict):
        return v
    (kind, value), = v.items()
    if kind == 'tensor':
        return tensors[value]
    if kind == 'dtype':
        return getattr(torch, value)
    if kind == 'dict':
        return {k: _decode(x, tensors) for k, x in value.items()}
    items = [_decode(x, tensors) for x in value]
    return tuple(items) if kind == 'tuple' else items


def _check_encoded(f: Fields, v: Any, name: str) -> None:
    """An :func:`_encode`-d value of a state's metadata, well formed (the tensors it names are looked up on load)."""
    if isinstance(v, _JSON_SCALARS):
        return
    d = f.dict(v, name)
    if len(d) != 1 or next(iter(d)) not in ('tensor', 'dtype', 'list', 'tuple', 'dict'):
        f.fail(name, "one of {'tensor': name}, {'dtype': name}, {'list': [...]}, {'tuple': [...]}, {'dict': {...}}", v)
    (kind, value), = d.items()
    if kind == 'dict':
        for k, x in f.dict(value, f'{name}.dict').items():
            _check_encoded(f, x, f'{name}.dict.{k}')
    elif kind == 'tensor':
        f.str(value, f'{name}.tensor')
    elif kind == 'dtype':
        if not isinstance(getattr(torch, f.str(value, f'{name}.dtype'), None), torch.dtype):
            f.fail(f'{name}.dtype', 'a torch dtype', value)
    else:
        for i, x in enumerate(f.list(value, f'{name}.{kind}')):
            _check_encoded(f, x, f'{name}.{kind}[{i}]')


def _split_optimizer(sd: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """An optimizer's state dict as file tensors plus JSON. A tensor of a parameter's state is the file's
    ``optim.<index>.<name>`` (None in the JSON); any other value JSON cannot hold as it is (a tensor setting of a
    group: timm's Lamb counts its steps in one, stored as ``optim_group.<group>.<name>``; a tuple: Adam's betas; a
    dtype: timm's big-vision Adafactor; a list of tensors: timm's Kron) is :func:`_encode`-d and named in
    ``encoded`` (states of earlier versions name a group's tensors in ``group_tensors`` instead, still read);
    entries of the state dict besides ``state`` and ``param_groups`` (Kron's random generator
    state) are ``extra``, encoded."""
    tensors: Dict[str, torch.Tensor] = {}
    state_meta: Dict[str, Any] = {}
    encoded: Dict[str, Dict[str, List[str]]] = {'state': {}, 'param_groups': {}}

    def plain(v: Any, where: str, key: str, name: str, prefix: str) -> Any:
        if _is_json(v):
            return v
        encoded[where].setdefault(key, []).append(name)
        return _encode(v, f'{prefix}.{key}.{name}', tensors)

    for idx, st in sd['state'].items():
        entry = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                _put(tensors, f'optim.{idx}.{name}', v)
                entry[name] = None
            else:
                entry[name] = plain(v, 'state', str(idx), name, 'optim')
        state_meta[str(idx)] = entry
    groups = [{name: plain(v, 'param_groups', str(k), name, 'optim_group') for name, v in group.items()}
              for k, group in enumerate(sd['param_groups'])]
    out: Dict[str, Any] = {'state': state_meta, 'param_groups': groups}
    extra = {key: _encode(v, f'optim_extra.{key}', tensors) for key, v in sd.items()
             if key not in ('state', 'param_groups')}
    if extra:
        out['extra'] = extra
    if encoded['state'] or encoded['param_groups']:
        out['encoded'] = {k: v for k, v in encoded.items() if v}
    return tensors, out


def _join_optimizer(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> Dict[str, Any]:
    state = {}
    for idx, entry in meta['state'].items():
        state[int(idx)] = {name: tensors[f'optim.{idx}.{name}'] if v is None else v for name, v in entry.items()}
    groups = [dict(g) for g in meta['param_groups']]
    for k, names in (meta.get('group_tensors') or {}).items():
        for name in names:
            groups[int(k)][name] = tensors[f'optim_group.{k}.{name}']
    encoded = meta.get('encoded') or {}
    for idx, names in (encoded.get('state') or {}).items():
        for name in names:
            state[int(idx)][name] = _decode(state[int(idx)][name], tensors)
    for k, names in (encoded.get('param_groups') or {}).items():
        for name in names:
            groups[int(k)][name] = _decode(groups[int(k)][name], tensors)
    out = {'state': state, 'param_groups': groups}
    out.update({key: _decode(v, tensors) for key, v in (meta.get('extra') or {}).items()})
    return out


def save_state(path: str, model_state: Dict[str, torch.Tensor], optimizer: Optional[torch.optim.Optimizer],
               meta: Dict[str, Any], extra_tensors: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Write a resumable training state (model, optimizer, RNG, ``meta``) as one atomic safetensors file."""
    tensors = {f'model.{k}': v for k, v in model_state.items()}
    meta = dict(meta, kind='train_state')
    if optimizer is not None:
        ot, om = _split_optimizer(optimizer.state_dict())
        tensors.update(ot)
        meta['optimizer'] = om
    rt, rm = rng_state()
    tensors.update(rt)
    meta['rng'] = rm
    if extra_tensors:
        tensors.update({f'extra.{k}': v for k, v in extra_tensors.items()})
    _write(path, tensors, meta)


def load_state(path: str) -> Dict[str, Any]:
    """Read a file written by :func:`save_state`: dict with ``model`` (state dict), ``optimizer`` (state dict or
    None), ``rng`` (tensors, meta) for :func:`set_rng_state`, ``extra`` tensors and ``meta``."""
    if os.path.isdir(path):  # (read_meta would name the weights files too, which are no state to resume from)
        inside = os.path.join(path, 'state.safetensors')
        raise CheckpointError(f'checkpoint {path} is a folder, not a file'
                              + (f'; resume from {inside}, the training state in it' if os.path.isfile(inside) else ''))
    tensors, meta = _read(path)
    if meta.get('kind') == 'search_state':
        raise CheckpointError(f'{path} is a search state (to resume search.py from), not a training state to resume '
                              f'train.py from: give the run\'s state.safetensors')
    if meta.get('kind') != 'train_state':
        beside = os.path.join(os.path.dirname(path), 'state.safetensors')
        hint = f'resume from {beside}, the training state train.py writes beside it, or ' \
            if os.path.isfile(beside) and os.path.abspath(beside) != os.path.abspath(path) else ''
        raise CheckpointError(f'{path} holds model weights only, not a training state to resume from; '
                              f'{hint}use --initial-checkpoint to start from these weights')
    _check_train_meta(path, meta)
    try:
        model = {k[len('model.'):]: v for k, v in tensors.items() if k.startswith('model.')}
        extra = {k[len('extra.'):]: v for k, v in tensors.items() if k.startswith('extra.')}
        optim = _join_optimizer(tensors, meta['optimizer']) if 'optimizer' in meta else None
        rng = ({k: v for k, v in tensors.items() if k.startswith('rng.')}, meta['rng'])
    except KeyError as e:
        raise CheckpointError(f'{path} is incomplete: missing {e}') from None
    return {'model': model, 'optimizer': optim, 'rng': rng, 'extra': extra, 'meta': meta}


def save_bundle(path: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], kind: str) -> None:
    """Write named tensors and a JSON document as one atomic safetensors file tagged with ``kind``."""
    _write(path, tensors, dict(meta, kind=kind))


def load_bundle(path: str, kind: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Read a file written by :func:`save_bundle`, checking its ``kind``."""
    tensors, meta = _read(path)
    if meta.get('kind') != kind:
        raise CheckpointError(f'{path} is a {meta.get("kind") or "plain safetensors"} file, not a {kind}')
    return tensors, meta
