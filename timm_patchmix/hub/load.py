"""Loading from the Hub and from checkpoints: ``model_from_weights``, ``load_model`` with the checks a download
deserves, and the plain backbone of a patchhead model (``load_backbone``, ``export_backbone``)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import timm

from ..checkpoint import CheckpointError, load_weights, not_model_weights, save_weights
from ..data import DATA_CONFIG_KEYS, channel_matched
from ..validation import Fields, check_hub_config, check_tensor_kinds

__all__ = ['model_from_weights', 'load_model', 'load_backbone', 'backbone_state_dict', 'export_backbone']

_SOURCES = ('hf-hub:', 'local-dir:')


def model_from_weights(path: str, **overrides) -> Tuple[nn.Module, Dict[str, Any]]:
    """Build the model recorded in ``path``'s metadata, load its weights strictly, return ``(model, meta)``. The
    model's ``pretrained_cfg`` carries the data config the checkpoint was trained with (input size, mean, std,
    interpolation, crop_pct), so ``timm.data.resolve_model_data_config(model)`` gives its preprocessing."""
    state, meta = load_weights(path)
    arch = meta.get('model')
    if not arch and meta.get('kind') is not None:
        raise not_model_weights(path, str(meta['kind']))
    if not arch:
        raise CheckpointError(f'{path} carries no timm_patchmix metadata naming its model; build the model '
                              f'yourself and load the file with safetensors.torch.load_file')
    _check_registered(arch, path)
    kwargs = dict(meta.get('model_kwargs') or {})
    if overrides.get('num_classes', meta.get('num_classes')) != meta.get('num_classes'):
        raise CheckpointError(f'{path} holds weights for {meta.get("num_classes")} classes; num_classes='
                              f'{overrides["num_classes"]} cannot load them strictly. For a new head, build the '
                              f'model and load the trunk: hub.load_backbone(path, num_classes=...), or train.py '
                              f'--initial-checkpoint {path} --num-classes {overrides["num_classes"]} --reset-head')
    kwargs.update(overrides)
    kwargs['num_classes'] = meta.get('num_classes')
    try:
        model = timm.create_model(arch, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise CheckpointError(f'{path}: cannot build {arch} with the recorded num_classes and model_kwargs '
                              f'{kwargs}: {e}') from None
    # the model reports the data it was trained on (timm's resolve_model_data_config reads its pretrained cfg)
    # and the classes of these weights: not the names, license or source of a registered tag the architecture's
    # default cfg came from
    data = channel_matched({k: v for k, v in (meta.get('data') or {}).items()
                            if k in DATA_CONFIG_KEYS and v is not None})
    if isinstance(getattr(model, 'pretrained_cfg', None), dict):
        from ..models.registry import _WEIGHTS_IDENTITY
        cfg = {k: v for k, v in model.pretrained_cfg.items() if k not in _WEIGHTS_IDENTITY}
        cfg.update({k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
        cfg['num_classes'] = model.num_classes  # (the weights' class count, not the tag's)
        if meta.get('class_names'):
            cfg['label_names'] = tuple(meta['class_names'])
        if 'input_size' in data:  # the architecture's test-time size and crop belong to its own training size
            cfg.pop('test_input_size', None)
            cfg.pop('test_crop_pct', None)
        model.pretrained_cfg = cfg
        if 'default_cfg' in vars(model):  # timm's alias of the pretrained cfg, where it is a plain attribute
            model.default_cfg = model.pretrained_cfg
    check_tensor_kinds(state, model.state_dict(), path, CheckpointError)
    from ..models.registry import per_position_grid_problem, recorded_grid_of_file
    problem = per_position_grid_problem(model, state, recorded_grid_of_file(path, meta))
    if problem:  # (a grid= override of the same cell count)
        raise CheckpointError(f'{path} {problem}; leave grid to the file')
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # tensors of other shapes (another architecture or in_chans than the metadata says)
        raise CheckpointError(f'{path} does not fit {arch} as its metadata describes it: {e}') from None
    if missing or unexpected:
        raise CheckpointError(f'{path} does not fit {arch}: missing {list(missing)[:5]}, '
                              f'unexpected {list(unexpected)[:5]}')
    return model.eval(), meta


def _check_registered(arch: str, where: str) -> None:
    if timm.is_model(arch):
        return
    hint = (f'`import timm_patchmix` before creating the model (it registers patchhead_<arch> for every timm '
            f'architecture); if it is imported, {arch[len("patchhead_"):]!r} is not an architecture of the '
            f'installed timm {timm.__version__}' if arch.startswith('patchhead_') else
            'the installed timm does not know it (an older timm, or a model from another library)')
    raise CheckpointError(f'{where} names the architecture {arch!r}, which is not a registered timm model: {hint}')


# --- reading a Hub folder / repo config -------------------------------------------------------------------------
def _read_config(source: str, cache_dir=None) -> Dict[str, Any]:
    """``config.json`` of ``hf-hub:<repo>`` or ``local-dir:<folder>``, with a clear error when it is missing or bad."""
    kind, _, ident = source.partition(':')
    if kind == 'local-dir':
        path = os.path.join(ident, 'config.json')
        if not os.path.isfile(path):
            raise CheckpointError(f'{ident} has no config.json; a Hub folder from `python -m timm_patchmix.hub '
                                  f'export` holds config.json and model.safetensors')
    else:
        from huggingface_hub.errors import EntryNotFoundError
        from ..compat import download_from_hf
        from ..models.registry import _fetch_failure
        try:
            path = download_from_hf(ident, 'config.json', cache_dir=cache_dir)
        except EntryNotFoundError as e:
            raise CheckpointError(f'{source}: its config.json could not be fetched ({_fetch_failure(e)}); a Hub '
                                  f'repository from `timm-patchmix hub export` holds config.json and '
                                  f'model.safetensors') from None
    try:
        with open(path, encoding='utf-8') as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f'{source}: config.json is not readable JSON ({e})') from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get('architecture'), str):
        raise CheckpointError(f'{source}: config.json names no architecture; it is not a timm model config')
    check_hub_config(cfg, Fields(f'{source}: config.json', CheckpointError))
    return cfg


def source_name(name: str) -> str:
    """``name`` with its source prefix spelt ``hf-hub:``/``local-dir:``, as timm reads the others it takes (any
    letter case, the older ``hf_hub:``); other names unchanged."""
    head, sep, rest = str(name).partition(':')
    kind = 'hf-hub' if head == 'hf_hub' else head.lower()
    return f'{kind}:{rest}' if sep and f'{kind}:' in _SOURCES else name


def load_model(name: str, pretrained: bool = True, **kwargs) -> nn.Module:
    """``timm.create_model`` with the checks a downloaded model deserves: the config's architecture must be
    registered (else an error saying to ``import timm_patchmix``), and damaged weights give an error that says how
    to fetch them again. ``name``: ``hf-hub:<repo>``, ``local-dir:<folder>``, a tag such as
    ``patchhead_resnet50.gpm_in1k``, or any timm name."""
    name = source_name(name)
    if name.startswith(_SOURCES):
        cfg = _read_config(name, kwargs.get('cache_dir'))
        arch = cfg['architecture']
        _check_registered(arch, name)
        head_args = sorted(k for k in ('grid', 'per_position') if k in (cfg.get('model_args') or {}))
        if head_args and not arch.startswith('patchhead_'):  # timm would fail on them with a TypeError
            raise CheckpointError(f'{name}: config.json names the architecture {arch!r}, which has no patch head, '
                                  f'but its model_args carry {head_args}, arguments of a patchhead_ model; the '
                                  f'architecture a timm_patchmix export names is patchhead_{arch}')
        if pretrained and not arch.startswith('patchhead_'):  # (a patchhead_ model's loader reads safetensors only)
            _plain_safetensors_only(name, kwargs)
    return timm.create_model(name, pretrained=pretrained, **kwargs)


def _plain_safetensors_only(name: str, kwargs: Dict[str, Any]) -> None:
    """A plain architecture's ``hf-hub:``/``local-dir:`` weights read from ``model.safetensors`` only, where timm
    alone falls back to unpickling ``pytorch_model.bin``: a folder without it is refused, a Hub repo's is asked for
    by name (a repo without it: a CheckpointError)."""
    kind, _, ident = name.partition(':')
    if kind == 'local-dir':
        if not os.path.isfile(os.path.join(ident, 'model.safetensors')):
            raise CheckpointError(f'{ident} holds no model.safetensors: weights are read from safetensors only (a '
                                  f'pytorch_model.bin or other pickle file is never read)')
        return
    # (a Hub config's source comes before a file or state dict in the overlay: timm reads the repo whatever they say)
    overlay = dict(kwargs.get('pretrained_cfg_overlay') or {})
    from huggingface_hub.errors import EntryNotFoundError
    from ..compat import download_from_hf
    try:  # (fetched here, so that a repo without it is named; timm then reads the cached copy)
        download_from_hf(ident, 'model.safetensors', cache_dir=kwargs.get('cache_dir'))
    except EntryNotFoundError as e:
        from ..models.registry import _unfetched
        raise _unfetched(name, 'model.safetensors', e) from None
    kwargs['pretrained_cfg_overlay'] = dict(overlay, hf_hub_filename='model.safetensors')


# --- the plain backbone -----------------------------------------------------------------------------------------
def _patchhead(source, cache_dir=None) -> nn.Module:
    if isinstance(source, nn.Module):
        return source
    if os.path.isfile(source):
        return model_from_weights(source)[0]
    if ':' not in str(source) and (os.sep in str(source) or str(source).endswith(
            ('.safetensors', '.pth', '.pt', '.bin'))):  # a path, not a name or a source timm parses (hf-hub:, ...)
        raise FileNotFoundError(f'{source}: no such file (a source is a checkpoint file, hf-hub:<repo>, '
                                f'local-dir:<folder> or a registered tag)')
    return load_model(source, pretrained=True, **({'cache_dir': cache_dir} if cache_dir is not None else {}))


def backbone_state_dict(source, name: Optional[str] = None) -> Tuple[str, Dict[str, torch.Tensor], Dict[str, Any]]:
    """``(arch, state_dict, pretrained_cfg)`` of the trunk (and image head) of a patchhead model: the
    ``backbone.`` weights under the plain model's own names, the patch head left out. ``name``: what the source
    is called in an error (default: the source, or a model's class)."""
    model = _patchhead(source)
    from ..models import PatchHeadModel
    if not isinstance(model, PatchHeadModel):
        name = name or (f'a {type(source).__name__}' if isinstance(source, nn.Module) else str(source))
        raise CheckpointError(f'{name} is not a patchhead_ model')
    arch = model.pretrained_cfg['architecture'][len('patchhead_'):]
    state = {k[len('backbone.'):]: v for k, v in model.state_dict().items() if k.startswith('backbone.')}
    cfg = {k: model.pretrained_cfg.get(k) for k in DATA_CONFIG_KEYS if model.pretrained_cfg.get(k) is not None}
    cfg['num_classes'] = model.num_classes
    names = model.pretrained_cfg.get('label_names')
    if names and len(names) == model.num_classes:  # the class names of these weights' classifier
        cfg['label_names'] = tuple(names)
    return arch, state, cfg


def load_backbone(source, num_classes: Optional[int] = None, **kwargs) -> nn.Module:
    """A plain timm model (``resnet50``, not ``patchhead_resnet50``) with the PatchMix-trained trunk of ``source``
    (a patchhead model, a ``train.py`` checkpoint, ``hf-hub:``/``local-dir:`` or a registered tag).

    Loading goes through timm's ``pretrained_cfg_overlay``, so timm's own adaptation applies: a different
    ``num_classes`` re-initialises the classifier, ``in_chans`` adapts the stem. ``kwargs`` go to timm.
    """
    src = _patchhead(source, kwargs.get('cache_dir'))
    arch, state, cfg = backbone_state_dict(src, None if isinstance(source, nn.Module) else str(source))
    # the build arguments timm's factory recorded: the backbone's (a model made by create_patchhead or
    # PatchHeadModel has only those), then the whole model's
    built = dict(getattr(src.backbone, '_model_args', None) or {}, **(getattr(src, '_model_args', None) or {}))
    for k, v in built.items():
        if k not in ('grid', 'per_position', 'num_classes'):
            kwargs.setdefault(k, v)
    kwargs.pop('pretrained_model_args', None)
    if num_classes is not None and num_classes != cfg['num_classes']:
        cfg.pop('label_names', None)  # a fresh classifier: the names were those of the one left behind
    overlay = dict(cfg, state_dict=state, hf_hub_id=None, url=None, file=None)
    return timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=overlay,
                             num_classes=cfg['num_classes'] if num_classes is None else num_classes, **kwargs)


def _source_files(source) -> List[str]:
    """The local files the weights of ``source`` (a name :func:`load_backbone` takes) are read from, as far as the
    name tells: a checkpoint file, a ``local-dir:`` folder's ``model.safetensors`` (any spelling of the prefix), the
    Hub cache's copy of an ``hf-hub:`` repo's or a tag's (a tag shipped with the package: its file)."""
    from timm.models import get_pretrained_cfg
    from ..models.patchhead import PREFIX
    from ..models.registry import _hub_cached_file
    src = source_name(os.fspath(source))
    ident = src.partition(':')[2]
    if src.startswith('local-dir:'):
        return [os.path.join(ident, 'model.safetensors')]
    if src.startswith('hf-hub:'):
        hub_id = ident
    elif os.path.isfile(src):
        return [src]
    else:  # a tag: the patchhead model's own, or the backbone's under a fresh patch head
        try:  # (timm raises for an unknown tag of a known architecture: the load names it)
            cfg = get_pretrained_cfg(src) or (get_pretrained_cfg(src[len(PREFIX):]) if src.startswith(PREFIX)
                                              else None)
        except RuntimeError:
            cfg = None
        if cfg is None:
            return []
        if cfg.file:
            return [cfg.file]
        hub_id = cfg.hf_hub_id
    found = _hub_cached_file({'hf_hub_id': hub_id, 'hf_hub_filename': 'model.safetensors'})
    return [found] if found else []


def export_backbone(source, path: str, overwrite: bool = False) -> str:
    """Write the plain backbone's state dict as safetensors (atomically), for timm's documented file overlay:
    ``timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=dict(file=path, num_classes=C))``. Its
    metadata records the architecture, the class count and names and the data config. An existing file at ``path``
    is replaced only with ``overwrite``, and never when it is the file the source's weights are read from."""
    if os.path.isdir(path):
        raise FileExistsError(f'{path} is a folder; the backbone is written to a .safetensors file, so name one')
    if isinstance(source, (str, os.PathLike)) and os.path.exists(path):
        for read in _source_files(source):
            if os.path.exists(read) and os.path.samefile(read, path):  # it would replace the weights it came from
                raise CheckpointError(f'{path} is the checkpoint the backbone is read from ({source}); write it to '
                                      f'another file')
    if os.path.lexists(path) and not overwrite:  # (a run's state or checkpoint, another export: not replaced unasked)
        raise FileExistsError(f'{path} exists; pass overwrite=True (--overwrite) to replace it')
    arch, state, cfg = backbone_state_dict(source)
    names = cfg.pop('label_names', None)
    save_weights(path, state, {'model': arch, 'num_classes': cfg['num_classes'], 'data': cfg,
                               **({'class_names': list(names)} if names else {}),
                               'exported_from': str(source) if not isinstance(source, nn.Module) else None})
    return path
