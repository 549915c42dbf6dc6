"""Strict checks of the values the project reads from files: mask tables, checkpoint metadata, training and search
states, Hub ``config.json``.

A :class:`Fields` object checks the fields of one file and raises that file's error class (``MaskTableError``,
``CheckpointError``...) with a message naming the file, the field and the bad value. Integers are ``int`` and never
``bool``; numbers are ``int`` or ``float`` and never ``bool``. ``model_kwargs`` read from a file pass an allow-list
of architectural arguments: a file can never ask for a download, another file or another pretrained cfg.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Type

__all__ = ['Fields', 'is_int', 'is_number', 'MODEL_KWARGS', 'check_model_kwargs', 'check_weights_meta',
           'check_holdout_record', 'check_hub_config', 'check_python_rng', 'check_tensor_kinds']


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v: Any, limit: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + '...'


class Fields:
    """Checks for the fields of one file; each method returns the value it accepted."""

    def __init__(self, where: str, error: Type[Exception] = ValueError):
        self.where, self.error = where, error

    def fail(self, field: str, what: str, value: Any):
        raise self.error(f'{self.where}: {field} must be {what}, got {_show(value)}')

    def int(self, value: Any, field: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
        """An integer in ``[lo, hi]`` (either bound optional)."""
        if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = (f' in [{lo}, {hi}]' if lo is not None and hi is not None else f' >= {lo}' if lo is not None
                   else f' <= {hi}' if hi is not None else '')
            self.fail(field, f'an integer{rng}', value)
        return value

    def number(self, value: Any, field: str, lo: Optional[float] = None, hi: Optional[float] = None,
               finite: bool = False) -> float:
        """A number (NaN allowed unless ``finite`` or bounded), in ``[lo, hi]`` when given."""
        ok = is_number(value)
        if ok and (finite or lo is not None or hi is not None) and not math.isfinite(value):
            ok = False
        if ok and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            ok = False
        if not ok:
            rng = f' in [{lo}, {hi}]' if lo is not None and hi is not None else f' >= {lo}' if lo is not None else ''
            self.fail(field, f'a {"finite " if finite else ""}number{rng}', value)
        return value

    def bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, 'true or false', value)
        return value

    def str(self, value: Any, field: str, nonempty: bool = False) -> str:
        if not isinstance(value, str) or (nonempty and not value):
            self.fail(field, 'a non-empty string' if nonempty else 'a string', value)
        return value

    def dict(self, value: Any, field: str) -> dict:
        if not isinstance(value, dict):
            self.fail(field, 'an object (a dict)', value)
        return value

    def list(self, value: Any, field: str, length: Optional[int] = None) -> list:
        if not isinstance(value, list):
            self.fail(field, 'a list' if length is None else f'a list of {length}', value)
        if length is not None and len(value) != length:
            self.fail(field, f'a list of {length}', value)
        return value

    def str_list(self, value: Any, field: str, length: Optional[int] = None) -> list:
        self.list(value, field)
        if length is not None and len(value) != length:
            self.fail(field, f'a list of {length} strings', value)
        for k, v in enumerate(value):
            self.str(v, f'{field}[{k}]')
        return value

    def number_list(self, value: Any, field: str) -> list:
        self.list(value, field)
        for k, v in enumerate(value):
            self.number(v, f'{field}[{k}]', finite=True)
        return value

    def grid(self, value: Any, field: str) -> list:
        """``[rows, cols]``, positive integers."""
        if not isinstance(value, list) or len(value) != 2 or not all(is_int(v) and v >= 1 for v in value):
            self.fail(field, '[rows, cols] with positive integers', value)
        return value

    def input_size(self, value: Any, field: str) -> list:
        """``[channels, height, width]``, positive integers."""
        if not isinstance(value, list) or len(value) != 3 or not all(is_int(v) and v >= 1 for v in value):
            self.fail(field, '[channels, height, width] with positive integers', value)
        return value


# --- model_kwargs from a file: architectural arguments only -----------------------------------------------------
def _size_arg(f: Fields, v: Any, field: str) -> None:
    """A positive integer or a pair of them (a grid, an image or patch size)."""
    if is_int(v):
        f.int(v, field, lo=1)
    else:
        f.grid(v, field)


def _rate(f: Fields, v: Any, field: str) -> None:
    f.number(v, field, lo=0.0, hi=1.0)


def _positive(f: Fields, v: Any, field: str) -> None:
    if f.number(v, field, lo=0.0) == 0:
        f.fail(field, 'a number > 0', v)


# what train.py writes (grid, per_position, in_chans, drop rates, --model-kwargs of architecture) and what timm's
# backbones take for their shape; nothing that names weights, a pretrained cfg, a file or a download
MODEL_KWARGS: Dict[str, Callable[[Fields, Any, str], None]] = {
    'grid': _size_arg,
    'per_position': lambda f, v, k: f.bool(v, k),
    'in_chans': lambda f, v, k: f.int(v, k, lo=1),
    'drop_rate': _rate, 'drop_path_rate': _rate, 'drop_block_rate': _rate, 'proj_drop_rate': _rate,
    'attn_drop_rate': _rate, 'pos_drop_rate': _rate, 'patch_drop_rate': _rate,
    'output_stride': lambda f, v, k: f.int(v, k, lo=1),
    'img_size': _size_arg,
    'patch_size': _size_arg,
    'global_pool': lambda f, v, k: f.str(v, k),
    'dynamic_img_size': lambda f, v, k: f.bool(v, k),
    'dynamic_img_pad': lambda f, v, k: f.bool(v, k),
    'class_token': lambda f, v, k: f.bool(v, k),
    'reg_tokens': lambda f, v, k: f.int(v, k, lo=0),
    'bn_momentum': _rate,
    'bn_eps': lambda f, v, k: _positive(f, v, k),
}


def check_model_kwargs(value: Any, f: Fields, field: str = 'model_kwargs') -> Dict[str, Any]:
    """``value`` (None or a dict) against :data:`MODEL_KWARGS`; returns it as a dict."""
    if value is None:
        return {}
    f.dict(value, field)
    for k, v in value.items():
        if k not in MODEL_KWARGS:
            raise f.error(f'{f.where}: {field} holds {k!r}, which a file may not set (only the architectural '
                          f'arguments {", ".join(sorted(MODEL_KWARGS))}); got {k}={_show(v)}')
        MODEL_KWARGS[k](f, v, f'{field}.{k}')
    return value


# --- checkpoint metadata ----------------------------------------------------------------------------------------
# the resize modes of timm's evaluation transform (``timm.data.create_transform``)
INTERPOLATIONS = ('nearest', 'bilinear', 'bicubic', 'box', 'hamming', 'lanczos')


def check_weights_meta(meta: Dict[str, Any], f: Fields) -> Dict[str, Any]:
    """The metadata ``train.py`` (and ``hub backbone``) write beside weights: every field present is checked."""
    if meta.get('model') is not None:
        f.str(meta['model'], 'model', nonempty=True)
    n = meta.get('num_classes')
    if n is not None:
        f.int(n, 'num_classes', lo=1)
    if 'model_kwargs' in meta:
        check_model_kwargs(meta['model_kwargs'], f)
    if meta.get('class_names') is not None:
        f.str_list(meta['class_names'], 'class_names', n)
    if meta.get('epoch') is not None:
        f.int(meta['epoch'], 'epoch', lo=0)
    for key in ('metrics', 'patchmix', 'data'):
        if meta.get(key) is not None:
            f.dict(meta[key], key)
    data = meta.get('data') or {}
    for key in ('dataset', 'data_dir', 'train_split', 'val_split', 'interpolation'):
        if data.get(key) is not None:
            f.str(data[key], f'data.{key}')
    if data.get('holdout') is not None:
        check_holdout_record(data['holdout'], f, 'data.holdout')
    check_data_fields(data, f, 'data')
    pm = meta.get('patchmix') or {}
    if pm.get('enabled') is not None:
        f.bool(pm['enabled'], 'patchmix.enabled')
    if pm.get('grid') is not None:
        f.grid(pm['grid'], 'patchmix.grid')
    if pm.get('table') is not None:
        f.str(pm['table'], 'patchmix.table', nonempty=True)
    for key in ('image_loss', 'patch_loss'):
        if pm.get(key) is not None:
            f.bool(pm[key], f'patchmix.{key}')
    if pm.get('table_sha256') is not None:
        f.str(pm['table_sha256'], 'patchmix.table_sha256', nonempty=True)
    if meta.get('command') is not None:
        f.str(meta['command'], 'command')
    return meta


def check_holdout_record(rec: Any, f: Fields, field: str = 'holdout') -> Dict[str, Any]:
    """A holdout record (:meth:`timm_patchmix.holdout.Holdout.record`): fraction in (0, 1), seed, split, sizes and
    the SHA-256 of the held-out indices."""
    f.dict(rec, field)
    fraction = rec.get('fraction')
    if not is_number(fraction) or not 0.0 < fraction < 1.0:
        f.fail(f'{field}.fraction', 'a number in (0, 1)', fraction)
    f.int(rec.get('seed'), f'{field}.seed', lo=0)
    if rec.get('split') is not None:
        f.str(rec['split'], f'{field}.split', nonempty=True)
    for key in ('split_images', 'images'):
        if rec.get(key) is not None:
            f.int(rec[key], f'{field}.{key}', lo=1)
    sha = rec.get('sha256')
    if sha is not None and not (isinstance(sha, str) and len(sha) == 64 and all(c in '0123456789abcdef' for c in sha)):
        f.fail(f'{field}.sha256', 'a SHA-256 as 64 hexadecimal digits', sha)
    return rec


# --- Hub config.json --------------------------------------------------------------------------------------------
def _names(f: Fields, value: Any, field: str) -> None:
    """A module name or a non-empty list of them (``classifier``, ``first_conv``)."""
    if isinstance(value, str):
        f.str(value, field, nonempty=True)
        return
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        f.fail(field, 'a module name or a non-empty list of module names', value)


def check_data_fields(d: Dict[str, Any], f: Fields, field: str) -> None:
    """The input and resize fields a checkpoint's ``data`` record and a ``config.json``'s ``pretrained_cfg`` share,
    each checked when present and not null: ``input_size``, ``mean``/``std`` (non-empty lists of finite numbers,
    ``std`` positive), ``crop_pct`` (> 0) and ``interpolation`` (a resize mode of timm's transforms)."""
    if d.get('input_size') is not None:
        f.input_size(d['input_size'], f'{field}.input_size')
    for key in ('mean', 'std'):
        if d.get(key) is not None:
            value = d[key]
            if not isinstance(value, list) or not value:
                f.fail(f'{field}.{key}', 'a non-empty list of numbers', value)
            f.number_list(value, f'{field}.{key}')
    if d.get('std') is not None and any(v <= 0 for v in d['std']):
        f.fail(f'{field}.std', 'positive numbers', d['std'])
    if d.get('crop_pct') is not None:
        f.number(d['crop_pct'], f'{field}.crop_pct', lo=0.0, finite=True)
        if d['crop_pct'] == 0:
            f.fail(f'{field}.crop_pct', 'a number > 0', d['crop_pct'])
    if d.get('interpolation') is not None and d['interpolation'] not in INTERPOLATIONS:
        f.fail(f'{field}.interpolation', 'one of ' + ', '.join(INTERPOLATIONS), d['interpolation'])


def check_pretrained_cfg(pcfg: Any, f: Fields, field: str = 'pretrained_cfg') -> Dict[str, Any]:
    """The ``pretrained_cfg`` of a ``config.json``: the fields timm and this package read, each checked when present
    and not null (the weights' class count, classifier heads, input size, normalisation, resize)."""
    f.dict(pcfg, field)
    if pcfg.get('num_classes') is not None:
        f.int(pcfg['num_classes'], f'{field}.num_classes', lo=1)
    for key in ('classifier', 'first_conv'):
        if pcfg.get(key) is not None:
            _names(f, pcfg[key], f'{field}.{key}')
    for key in ('test_input_size', 'min_input_size'):
        if pcfg.get(key) is not None:
            f.input_size(pcfg[key], f'{field}.{key}')
    check_data_fields(pcfg, f, field)
    if pcfg.get('crop_mode') is not None:
        f.str(pcfg['crop_mode'], f'{field}.crop_mode', nonempty=True)
    if pcfg.get('label_offset') is not None:
        f.int(pcfg['label_offset'], f'{field}.label_offset', lo=0)
    if pcfg.get('fixed_input_size') is not None:
        f.bool(pcfg['fixed_input_size'], f'{field}.fixed_input_size')
    if pcfg.get('custom_load') not in (None, False):  # timm would hand the file to model.load_pretrained
        f.fail(f'{field}.custom_load', 'false (the weights are a plain safetensors state dict)', pcfg['custom_load'])
    return pcfg


def check_hub_config(cfg: Dict[str, Any], f: Fields) -> Dict[str, Any]:
    """A timm ``config.json`` of a Hub folder: architecture, num_classes, label_names, model_args, pretrained_cfg.

    ``model_args`` and ``pretrained_cfg``, where present, are objects (``null`` is refused: timm's reader would
    fail on it with an AttributeError)."""
    f.str(cfg.get('architecture'), 'architecture', nonempty=True)
    n = cfg.get('num_classes')
    if n is not None:
        f.int(n, 'num_classes', lo=1)
    if cfg.get('label_names') is not None:
        f.str_list(cfg['label_names'], 'label_names', n)
    if 'model_args' in cfg:
        args = f.dict(cfg['model_args'], 'model_args')
        if 'num_classes' in args:  # timm's save_for_hf/push_to_hf_hub write it there too
            f.int(args['num_classes'], 'model_args.num_classes', lo=1)
            if n is not None and args['num_classes'] != n:
                raise f.error(f'{f.where}: model_args.num_classes {args["num_classes"]} differs from num_classes {n}')
            args = {k: v for k, v in args.items() if k != 'num_classes'}
        check_model_kwargs(args, f, 'model_args')
    if 'pretrained_cfg' in cfg:
        check_pretrained_cfg(cfg['pretrained_cfg'], f)
    return cfg


# --- tensors read into a model ----------------------------------------------------------------------------------
def _kind(t: Any) -> str:
    if t.is_floating_point():
        return 'floating-point'
    if t.is_complex():
        return 'complex'
    return 'boolean' if str(t.dtype) == 'torch.bool' else 'integer'


def check_tensor_kinds(state: Dict[str, Any], own: Dict[str, Any], where: str, error: Type[Exception]) -> None:
    """Each tensor of ``state`` is of the kind (floating-point, integer, boolean, complex) of the model's tensor of
    the same name in ``own``: ``load_state_dict`` would cast an integer or boolean tensor into a float parameter
    (and a float into an integer buffer such as ``num_batches_tracked``) without a word. Float to float (any
    width) passes, as does integer to integer."""
    for k, v in state.items():
        t = own.get(k)
        if t is None or not hasattr(v, 'dtype') or not hasattr(t, 'dtype'):
            continue
        if _kind(v) != _kind(t):
            raise error(f'{where}: the tensor {k} is {str(v.dtype).replace("torch.", "")}, and the model\'s {k} '
                        f'is {str(t.dtype).replace("torch.", "")}: {_kind(t)} values cannot be loaded from {_kind(v)} '
                        f'ones (the file is damaged, or holds no weights of this model)')


def check_python_rng(f: 'Fields', value: Any, field: str) -> None:
    """``value`` as ``random.getstate()`` returns it (version, 625 Mersenne Twister words, gauss_next), from JSON."""
    py = f.list(value, field, 3)
    f.int(py[0], f'{field}[0]')
    internal = f.list(py[1], f'{field}[1]', 625)
    if not all(is_int(v) and 0 <= v <= 0xFFFFFFFF for v in internal):
        f.fail(f'{field}[1]', '625 integers of the Mersenne Twister state', internal)
    if py[2] is not None:
        f.number(py[2], f'{field}[2]')
