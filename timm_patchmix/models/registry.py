"""Registration of ``patchhead_<arch>`` with timm, and where a ``patchhead_`` model's weights come from.

Every architecture timm lists gets a ``patchhead_`` entrypoint through ``timm.models.register_model``; the tags whose
weights hold the patch head (``pretrained.py``) come through this module's ``default_cfgs``, built with
``timm.models.generate_default_cfgs``, which ``register_model`` reads. So ``timm.list_pretrained('patchhead_*')`` and
``timm.is_model_pretrained`` report exactly the weights that ``pretrained=True`` loads with the patch head.

What ``timm.create_model('patchhead_<arch>[.tag]', pretrained=..., ...)`` builds:

- a tag of this package (``.gpm_fmnist``), or no tag where the architecture has one as its default, or a
  ``config.json`` of a Hub folder (``hf-hub:``/``local-dir:``): the patchhead model with those weights, both heads;
- a tag of the backbone (``patchhead_resnet50.a1_in1k``): the backbone's timm weights under a fresh patch head;
- no tag and no weights of its own: with ``pretrained=True`` an error that names the backbone's tags, unless
  ``pretrained_cfg_overlay`` gives the backbone a weights source (``file``, ``url``, ``state_dict``...);
- ``features_only=True``: the backbone's own timm feature extractor (``timm.create_model(arch, features_only=True)``),
  holding the trunk of whichever weights the rules above select.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Iterable, Optional

import timm
from safetensors import SafetensorError
from timm.models import PretrainedCfg, generate_default_cfgs, get_arch_pretrained_cfgs, get_pretrained_cfg
from timm.models import register_model

from ..grid import to_grid
from .patchhead import PREFIX, PatchHeadModel, check_per_position, create_patchhead
from .pretrained import PATCHHEAD_PRETRAINED, UNPUBLISHED, pretrained_cfgs

__all__ = ['register_patchhead_models', 'load_patchhead_weights', 'default_cfgs', 'PatchheadWeightsError',
           'per_position_grid_problem', 'recorded_grid_of_file']


class _Names(list):
    """This module's ``__all__``: ``register_model`` appends each entrypoint's name after checking it is not there;
    a list's check is linear, which makes ~1,400 registrations quadratic (~10 ms), so membership uses a set."""

    def __init__(self, names: Iterable[str] = ()):
        super().__init__(names)
        self._set = set(self)

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def append(self, name: str) -> None:
        super().append(name)
        self._set.add(name)


__all__ = _Names(__all__)

# read by timm's register_model for each patchhead_* entrypoint defined in this module
default_cfgs = generate_default_cfgs(pretrained_cfgs())

# the settings a feature extractor takes on top of the model's own arguments (timm's builder pops them)
_FEATURE_KWARGS = ('out_indices', 'feature_cls')
# pretrained cfg fields that are a source of weights
_SOURCES = ('state_dict', 'file', 'url', 'hf_hub_id')


class PatchheadWeightsError(ValueError):
    """A ``patchhead_`` name or tag whose weights do not exist."""


def _backbone_tags(arch: str) -> list:
    return sorted(n.split('.', 1)[1] for n in get_arch_pretrained_cfgs(arch) if '.' in n)


def _no_weights(name: str, arch: str, tag: Optional[str] = None) -> PatchheadWeightsError:
    full = f'{name}.{tag}' if tag else name
    if full in UNPUBLISHED:
        return PatchheadWeightsError(
            f'{full} ({UNPUBLISHED[full]}): these weights are not published. The recipe that trains them is in '
            f"timm_patchmix's docs/hub.md ('ImageNet weights'); timm.list_pretrained('patchhead_*') lists the "
            f'weights that exist')
    own = sorted(n.split('.', 1)[1] for n in PATCHHEAD_PRETRAINED if n.split('.', 1)[0] == name)
    tags = _backbone_tags(arch)
    hint = (f"; {name}.<tag> with a tag of {arch} loads timm's {arch} weights under a new patch head "
            f"({', '.join(tags[:6])}{', ...' if len(tags) > 6 else ''})" if tags
            else f'; {arch} has no timm weights either')
    if tag:
        return PatchheadWeightsError(
            f"{full}: no such tag. {name}'s own tags: {', '.join(own) or 'none'}{hint}")
    return PatchheadWeightsError(
        f"{name} has no weights with a patch head (timm.list_pretrained('patchhead_*') lists those that exist), so "
        f'pretrained=True has nothing to load{hint}; or pass the weights with pretrained_cfg_overlay=dict(file=...)')


def _own_cfg(name: str, pretrained_cfg, overlay) -> Optional[Dict[str, Any]]:
    """The pretrained cfg of ``name``'s own (patch-head) weights, or None when weights, if any, are the backbone's.

    Patch-head weights come from a ``config.json`` (``hf-hub:``/``local-dir:``, which timm hands over as a cfg whose
    source is set; it was routed here because it names this model), from a cfg whose architecture is a patchhead
    name, or from this package's tags (named, or the architecture's default).
    """
    if pretrained_cfg is None:
        if not timm.is_model_pretrained(name):
            return None
        cfg = get_pretrained_cfg(name).to_dict()
    elif isinstance(pretrained_cfg, str):
        full = f'{name}.{pretrained_cfg}'
        if full not in PATCHHEAD_PRETRAINED:
            return None
        cfg = get_pretrained_cfg(full).to_dict()
    elif isinstance(pretrained_cfg, PretrainedCfg):
        cfg = pretrained_cfg.to_dict()
    elif isinstance(pretrained_cfg, dict):
        cfg = dict(pretrained_cfg)
    else:
        return None
    from_config = cfg.get('source') in ('hf-hub', 'local-dir')
    if not from_config and not str(cfg.get('architecture') or '').startswith(PREFIX):
        return None
    cfg.update(overlay or {})
    cfg['architecture'] = name
    return cfg


# the pretrained cfg fields of a config.json that check_pretrained_cfg checks (as timm hands them over: tuples or lists)
_CHECKED_CFG = ('num_classes', 'classifier', 'first_conv', 'input_size', 'test_input_size', 'min_input_size', 'mean',
                'std', 'crop_pct', 'interpolation', 'crop_mode', 'label_offset', 'fixed_input_size', 'custom_load')


def _check_config_fields(cfg: Dict[str, Any], model_args: Optional[Dict[str, Any]]) -> None:
    """A ``config.json``'s fields as timm hands them over (num_classes, label_names and the pretrained cfg fields
    in one dict; the model_args apart), checked for type and range; its model_args pass the allow-list of
    architectural arguments."""
    from ..checkpoint import CheckpointError
    from ..validation import Fields, check_hub_config
    where = cfg.get('file') or cfg.get('hf_hub_id') or 'the pretrained cfg'
    pcfg = {k: list(cfg[k]) if isinstance(cfg[k], tuple) else cfg[k] for k in _CHECKED_CFG if k in cfg}
    pcfg.pop('num_classes', None)  # the root num_classes, checked below
    doc = {'architecture': cfg.get('architecture') or 'patchhead', 'num_classes': cfg.get('num_classes'),
           'label_names': cfg.get('label_names'), 'model_args': model_args or {}, 'pretrained_cfg': pcfg}
    check_hub_config(doc, Fields(f'{where}: config.json', CheckpointError))


def _heads(names) -> tuple:
    return (names,) if isinstance(names, str) else tuple(names or ())


def _with_own_weights(name: str, arch: str, own: Dict[str, Any], pretrained: bool, cache_dir,
                      kwargs: Dict[str, Any], head_kept: bool = True) -> PatchHeadModel:
    """``head_kept=False``: the caller keeps the trunk only (``features_only``), so the grid of a per-position
    patch head is not compared."""
    from ..checkpoint import CheckpointError
    from ..validation import is_int
    file_args = kwargs.pop('pretrained_model_args', None)
    if own.get('source') in ('hf-hub', 'local-dir'):
        _check_config_fields(own, file_args)
    n = own.get('num_classes')
    if is_int(n) and n >= 0:  # timm's rule: the weights' class count, unless the call asks for another
        kwargs.setdefault('num_classes', n)
    model = create_patchhead(arch, pretrained=False, **kwargs)
    heads = _heads(model.pretrained_cfg['classifier'])
    named = own.get('classifier')
    if named is not None and sorted(_heads(named)) != sorted(heads):
        where = own.get('file') or own.get('hf_hub_id') or 'the pretrained cfg'
        where += ': config.json' if own.get('source') in ('hf-hub', 'local-dir') else ''
        raise CheckpointError(f'{where}: pretrained_cfg.classifier names {list(_heads(named))}, and the classifier '
                              f'heads of {name} are {list(heads)}: the weights are not of this model')
    model.pretrained_cfg = dict(model.pretrained_cfg, **{k: v for k, v in own.items() if v is not None})
    model.pretrained_cfg['classifier'] = heads
    if pretrained:
        load_patchhead_weights(model, own, in_chans=kwargs.get('in_chans', 3), cache_dir=cache_dir,
                               grid=_recorded_grid(own, file_args) if head_kept else None)
    return model


def _recorded_grid(own: Dict[str, Any], file_args: Optional[Dict[str, Any]]):
    """The grid the weights' patch head was trained on, where the weights record it: a Hub folder's config.json
    ``model_args``, a ``.safetensors`` file's metadata (``model_kwargs``, as train.py writes it); else None."""
    if own.get('source') in ('hf-hub', 'local-dir'):
        return (file_args or {}).get('grid')
    named = own.get('file')
    if own.get('state_dict') is not None or not named:
        return None
    return recorded_grid_of_file(str(named))


def recorded_grid_of_file(path: str, meta: Optional[Dict[str, Any]] = None):
    """The grid a ``.safetensors`` file's patch head was trained on: its metadata's ``model_kwargs`` (``meta``,
    where the caller has read it), as train.py writes it, or for a Hub folder's ``model.safetensors`` (which carries
    none) the ``model_args`` of the ``config.json`` beside it; None where neither records one."""
    import json
    from ..checkpoint import CheckpointError, read_meta
    if not path.endswith('.safetensors') or not os.path.isfile(path):
        return None
    if meta is None:
        try:
            meta = read_meta(path)
        except CheckpointError:
            return None  # (the loader names the file)
    kwargs = meta.get('model_kwargs')
    if isinstance(kwargs, dict) and kwargs.get('grid') is not None:
        return kwargs['grid']
    config = os.path.join(os.path.dirname(path), 'config.json')
    if os.path.basename(path) != 'model.safetensors' or not os.path.isfile(config):
        return None
    try:
        with open(config, encoding='utf-8') as f:
            args = json.load(f).get('model_args')
    except (OSError, ValueError, AttributeError):
        return None
    return args.get('grid') if isinstance(args, dict) else None


def _features(name: str, arch: str, own: Optional[Dict[str, Any]], pretrained: bool, pretrained_cfg, overlay,
              cache_dir, kwargs: Dict[str, Any]):
    """The backbone's timm feature extractor; with the patchhead weights' trunk when those are selected."""
    # the patch head's own arguments (a Hub folder's model_args carry them) belong to the whole model only
    head_args = {k: kwargs.pop(k) for k in ('grid', 'per_position') if k in kwargs}
    # ... but a bad value is still the caller's mistake, named as it would be for the whole model
    if 'grid' in head_args:
        to_grid(head_args['grid'])
    if 'per_position' in head_args:
        check_per_position(head_args['per_position'])
    if own is None or not pretrained:
        if own is not None:  # the architecture's own cfg, no weights: the plain backbone's cfg
            pretrained_cfg = overlay = None
        with _backbone_file_errors(pretrained_cfg, overlay, arch):
            return timm.create_model(arch, features_only=True, pretrained=pretrained, pretrained_cfg=pretrained_cfg,
                                     pretrained_cfg_overlay=overlay, cache_dir=cache_dir, **kwargs)
    feature_args = {k: kwargs.pop(k) for k in _FEATURE_KWARGS if k in kwargs}
    whole = _with_own_weights(name, arch, own, True, cache_dir, dict(kwargs, **head_args), head_kept=False)
    state = whole.backbone.state_dict()
    kwargs.pop('pretrained_model_args', None)
    kwargs['num_classes'] = whole.num_classes
    source = dict(state_dict=state, file=None, url=None, hf_hub_id=None, num_classes=whole.num_classes)
    return timm.create_model(arch, features_only=True, pretrained=True, pretrained_cfg_overlay=source,
                             **feature_args, **kwargs)


def _named_file(pretrained_cfg, overlay) -> Optional[str]:
    """The file or URL a caller's pretrained cfg/overlay makes timm read for the backbone (None: none, or a state
    dict, which is read before them)."""
    cfg: Dict[str, Any] = {}
    if isinstance(pretrained_cfg, PretrainedCfg):
        cfg = pretrained_cfg.to_dict()
    elif isinstance(pretrained_cfg, dict):
        cfg = dict(pretrained_cfg)
    cfg.update(overlay or {})
    if cfg.get('state_dict') is not None or cfg.get('source') in ('hf-hub', 'local-dir'):
        return None
    return cfg.get('file') or cfg.get('url') or None


# the pretrained cfg fields that name a tag's own weights rather than how to feed the model (left out when a file
# of the caller's is read instead)
_WEIGHTS_IDENTITY = ('tag', 'label_names', 'label_descriptions', 'origin_url', 'license', 'hf_hub_id',
                     'hf_hub_filename', 'url', 'notes', 'paper_ids', 'paper_name', 'description', 'source',
                     'state_dict')


def _cfg_dict(pretrained_cfg) -> Dict[str, Any]:
    """A caller's pretrained cfg as a dict (a tag name or None: none)."""
    if isinstance(pretrained_cfg, PretrainedCfg):
        return pretrained_cfg.to_dict()
    return dict(pretrained_cfg) if isinstance(pretrained_cfg, dict) else {}


def _named_file_kind(named: str) -> Optional[Dict[str, Any]]:
    """For the local ``.safetensors`` file ``named`` a caller names (:func:`_named_file`) that holds a
    whole ``patchhead_`` model, every tensor under ``backbone.`` or ``patch_head.`` (a ``model.state_dict()`` of
    one, or the project's weights): ``{'whole': True, 'num_classes': the file's class count}``; for one that holds
    other tensors (a plain backbone's weights): ``{'whole': False}``; None for a URL, or a file that cannot be read
    (the loader names it).

    The file's tensor names decide whether it is read as the whole model's or the backbone's, whatever tags the
    architecture has: timm would give a whole model's file to the backbone, which, under another class count,
    loads it non-strictly, that is not at all, with a logged warning only."""
    if not str(named).endswith('.safetensors') or not os.path.isfile(named):
        return None
    try:
        from safetensors import safe_open
        with safe_open(named, framework='pt') as f:
            keys = list(f.keys())
            head = f.get_slice('patch_head.fc.weight').get_shape() if 'patch_head.fc.weight' in keys else None
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None
    from ..checkpoint import not_model_weights, read_meta
    kind = read_meta(named).get('kind')  # (this project's metadata; none in another writer's file)
    if kind is not None:  # a training or search state: no model's weights under timm's names
        raise not_model_weights(named, kind)
    if not keys:  # (timm would end in its missing-keys error for the backbone)
        from ..checkpoint import CheckpointError
        raise CheckpointError(f'{named} holds no tensors: it is not the weights of a model or of its backbone')
    if not all(k.startswith(('backbone.', 'patch_head.')) for k in keys):
        return {'whole': False}
    # (a per-position head's weight is [cells, C, D]; num_classes=0 leaves no classifier tensors)
    return {'whole': True, 'num_classes': int(head[-2]) if head is not None and len(head) >= 2 else 0}


def per_position_grid_problem(model, state: Dict[str, Any], grid) -> Optional[str]:
    """Why ``state``'s patch head cannot load into ``model``'s (None where it can, or where it cannot be told):
    both per-position (one classifier per cell) and ``grid``, the grid the weights record, is another than the
    model's, of the same cell count too, since cell k would be another region of the image."""
    head = state.get('patch_head.fc.weight')
    if grid is None or head is None or head.dim() != 3 or not isinstance(model, PatchHeadModel) \
            or not model.patch_head.per_position:
        return None
    try:
        trained_on = to_grid(grid)
    except ValueError:
        return None  # (a record that is not a grid: the shapes decide)
    if trained_on == tuple(model.grid):
        return None
    return (f'holds a per-position patch head trained on a {trained_on[0]}x{trained_on[1]} grid (grid='
            f'{trained_on}), and the model has a {model.grid[0]}x{model.grid[1]} grid: its classifier of cell k would '
            f'classify another region of the image')


def _check_backbone_file(pretrained_cfg, overlay) -> None:
    """The backbone's weights a caller names (``pretrained_cfg_overlay=dict(file=...)``) are read from safetensors
    only, as the patch-head weights are: timm alone would unpickle a .pth/.bin."""
    from ..checkpoint import CheckpointError
    named = _named_file(pretrained_cfg, overlay)
    if named and not str(named).endswith('.safetensors'):
        raise CheckpointError(f'{named} is not a .safetensors file: weights are read from safetensors only (a pickle '
                              f'file such as .pth or .bin is never read)')


# timm's Hub file names of pickled weights and the safetensors file it would try first in their place
_SAFE_NAMES = {'pytorch_model.bin': 'model.safetensors', 'open_clip_pytorch_model.bin': 'open_clip_model.safetensors'}


def _safe_hub_name(name: Optional[str]) -> Optional[str]:
    """The safetensors file to read from a Hub repo in place of ``name`` (timm's ``hf_hub_filename``; None:
    timm's default, ``pytorch_model.bin``); None when there is none to read in its place."""
    name = name or 'pytorch_model.bin'
    if name.endswith('.safetensors'):
        return name
    return _SAFE_NAMES.get(name) or (name[:-4] + '.safetensors' if name.endswith('.bin') else None)


def _not_safetensors(what: str) -> Exception:
    from ..checkpoint import CheckpointError
    return CheckpointError(f'{what}: weights are read from safetensors only (a pickle file such as .pth or .bin is '
                           f'never read)')


def _caller_hub_file(pretrained_cfg, overlay, cache_dir) -> Optional[Dict[str, Any]]:
    """An ``hf_hub_id`` the caller names (in ``pretrained_cfg_overlay`` or a dict/PretrainedCfg, with no
    ``state_dict`` or ``file`` before it, not a Hub folder's config.json): the overlay with ``file`` set to the
    repo's safetensors, fetched (or found in the cache), so that it is read as a ``file=`` is, by its tensors'
    names (the whole model's or the backbone's), above the weights a tag names. None otherwise."""
    cfg = _cfg_dict(pretrained_cfg)
    cfg.update(overlay or {})
    hub_id = cfg.get('hf_hub_id')
    if not hub_id or cfg.get('state_dict') is not None or cfg.get('file') \
            or cfg.get('source') in ('hf-hub', 'local-dir'):
        return None
    name = _safe_hub_name(cfg.get('hf_hub_filename'))
    if name is None:
        raise _not_safetensors(f'{hub_id}: hf_hub_filename {cfg.get("hf_hub_filename")!r} is not a .safetensors file')
    from huggingface_hub.errors import EntryNotFoundError
    from ..compat import download_from_hf
    try:
        path = download_from_hf(hub_id, name, cache_dir=cache_dir)
    except EntryNotFoundError as e:
        raise _unfetched(f'{hub_id}', name, e) from None
    return dict(overlay or {}, file=path, hf_hub_filename=name)


def _fetch_failure(e: Exception) -> str:
    """Why a Hub file could not be had, in words (huggingface_hub's ``EntryNotFoundError`` or its subclass for a
    file neither in the cache nor reachable)."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    return ('it is not in the local cache and the Hub could not be reached' if isinstance(e, LocalEntryNotFoundError)
            else 'the repository has no such file')


def _unfetched(where: str, name: str, e: Exception) -> Exception:
    """A Hub repo's safetensors file that could not be had: not in the cache while the Hub cannot be reached, or
    the repo holds none (timm alone would have read its pickle file then)."""
    return _not_safetensors(f'{where}: its {name} could not be fetched ({_fetch_failure(e)})')


def _backbone_cfg(arch: str, pretrained_cfg, overlay) -> Dict[str, Any]:
    """The pretrained cfg timm resolves for ``arch``'s weights: a tag's (a name; None: the architecture's
    default), or the caller's cfg, with the overlay on top."""
    if isinstance(pretrained_cfg, str):
        base = get_pretrained_cfg(f'{arch}.{pretrained_cfg}')
    elif pretrained_cfg is None:
        base = get_pretrained_cfg(arch)
    else:
        base = pretrained_cfg
    cfg = _cfg_dict(base)
    cfg.update(overlay or {})
    return cfg


def _safe_backbone_overlay(arch: str, pretrained_cfg, overlay) -> Optional[Dict[str, Any]]:
    """The overlay under which timm reads the backbone's weights from safetensors only: where the cfg it resolves
    (a tag of ``arch``, or its default, with the caller's cfg and overlay) names a Hub repo, the repo's
    ``model.safetensors`` (or the safetensors twin of the file it names), never the pickle file timm would fall back
    to, and never the tag's ``url`` (which ``TIMM_USE_OLD_CACHE`` reads first once it is cached); a tag whose weights
    are a pickled URL alone is refused. A loader of the tag's own (``custom_load``: ``'hf'`` for a Hub repo, any for
    a file or URL; they read .npz files) is left to it: timm applies a ``custom_load`` of ``True`` to a file or URL
    only, and reads a Hub repo's weights as any other's then."""
    cfg = _backbone_cfg(arch, pretrained_cfg, overlay)
    if cfg.get('state_dict') is not None or cfg.get('file') or cfg.get('source') == 'local-dir':
        return overlay
    if cfg.get('hf_hub_id'):
        if cfg.get('custom_load') == 'hf':
            return overlay
        name = _safe_hub_name(cfg.get('hf_hub_filename'))
        if name is None:
            raise _not_safetensors(f'the weights of {arch} at {cfg["hf_hub_id"]} ({cfg.get("hf_hub_filename")})')
        return dict(overlay or {}, hf_hub_filename=name, **({'url': None} if cfg.get('url') else {}))
    url = cfg.get('url')
    if url and not cfg.get('custom_load') and not str(url).split('?')[0].endswith('.safetensors'):
        raise _not_safetensors(f'the weights of {arch} at {url} are a pickle file; load them with timm alone, '
                               f'save the state dict with safetensors and pass pretrained_cfg_overlay=dict(file=...)')
    return overlay


class _backbone_file_errors:
    """A damaged safetensors file named for the backbone, or a Hub repo's safetensors file that could not be had: a
    CheckpointError naming it, not safetensors' or huggingface_hub's own."""

    def __init__(self, pretrained_cfg, overlay, arch: str):
        self.named = _named_file(pretrained_cfg, overlay)
        cfg = _backbone_cfg(arch, pretrained_cfg, overlay)
        self.hub, self.hub_file = cfg.get('hf_hub_id'), cfg.get('hf_hub_filename') or 'model.safetensors'

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        from huggingface_hub.errors import EntryNotFoundError
        if kind is not None and issubclass(kind, EntryNotFoundError):  # (the safetensors file a Hub repo lacks)
            raise _unfetched(self.hub or 'the Hub repository of the pretrained cfg', self.hub_file, e) from None
        if kind is not None and issubclass(kind, SafetensorError):
            from ..checkpoint import CheckpointError
            raise CheckpointError(f'the weights at {self.named or "the pretrained cfg"} are damaged or incomplete '
                                  f'({e}); fetch or write the file again') from e
        return False


def _entrypoint(arch: str):
    name = PREFIX + arch

    def fn(pretrained: bool = False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None, **kwargs):
        features_only = kwargs.pop('features_only', False)
        tag = pretrained_cfg if isinstance(pretrained_cfg, str) else None
        if tag is not None and f'{name}.{tag}' not in PATCHHEAD_PRETRAINED and tag not in _backbone_tags(arch):
            raise _no_weights(name, arch, tag)
        if pretrained:  # a Hub repo the caller names: its safetensors, read as a file= is
            pretrained_cfg_overlay = _caller_hub_file(pretrained_cfg, pretrained_cfg_overlay, cache_dir) \
                or pretrained_cfg_overlay
        own = _own_cfg(name, pretrained_cfg, pretrained_cfg_overlay)
        named = _named_file(pretrained_cfg, pretrained_cfg_overlay)
        if pretrained and named and (own is None or own.get('source') not in ('hf-hub', 'local-dir')):
            kind = _named_file_kind(named)
            overlay = dict(pretrained_cfg_overlay or {})
            if kind is not None and kind['whole']:  # the file holds the whole model: read as its own weights
                # a tag's data config stays, not what names the tag's own weights (their classes, source, card)
                base = own if own is not None else _cfg_dict(pretrained_cfg)
                own = {k: v for k, v in base.items() if k not in _WEIGHTS_IDENTITY}
                own.update(overlay, architecture=name)
                if 'num_classes' not in overlay and not (isinstance(pretrained_cfg, dict)
                                                         and 'num_classes' in pretrained_cfg):
                    own['num_classes'] = kind['num_classes']  # the file's, not a tag's or the architecture's
            elif kind is not None and own is not None:  # a backbone's file beside this model's own cfg or tag
                overlay = {k: v for k, v in overlay.items() if k not in ('architecture', 'classifier', 'first_conv')}
                overlay['file'] = named
                own = tag = None  # (the cfg names this model's heads and stem: the backbone takes its own)
                pretrained_cfg, pretrained_cfg_overlay = None, overlay
        if own is None and pretrained and tag is None and not isinstance(pretrained_cfg, (dict, PretrainedCfg)) \
                and not any((pretrained_cfg_overlay or {}).get(k) for k in _SOURCES):
            raise _no_weights(name, arch)
        if own is None and pretrained:
            _check_backbone_file(pretrained_cfg, pretrained_cfg_overlay)
            pretrained_cfg_overlay = _safe_backbone_overlay(arch, pretrained_cfg, pretrained_cfg_overlay)
        if features_only:
            return _features(name, arch, own, pretrained, pretrained_cfg, pretrained_cfg_overlay, cache_dir, kwargs)
        if own is None:
            with _backbone_file_errors(pretrained_cfg, pretrained_cfg_overlay, arch):
                return create_patchhead(arch, pretrained=pretrained, pretrained_cfg=pretrained_cfg,
                                        pretrained_cfg_overlay=pretrained_cfg_overlay, cache_dir=cache_dir, **kwargs)
        return _with_own_weights(name, arch, own, pretrained, cache_dir, kwargs)

    fn.__name__ = name
    fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = f'{arch} with a PatchMix patch head (see timm_patchmix.models.create_patchhead).'
    return fn


def _hub_cached_file(cfg: Dict[str, Any], cache_dir=None) -> Optional[str]:
    """The Hub cache's copy of the ``model.safetensors`` that timm has just read for ``cfg`` (None where the
    weights did not come from the Hub, or the cache does not say)."""
    hub_id = cfg.get('hf_hub_id')
    if cfg.get('hf_hub_filename') != 'model.safetensors' or not isinstance(hub_id, str):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    repo, _, revision = hub_id.partition('@')  # timm's 'org/name@revision'
    found = try_to_load_from_cache(repo, 'model.safetensors', cache_dir=cache_dir, revision=revision or None)
    return found if isinstance(found, str) else None


def load_patchhead_weights(model: PatchHeadModel, cfg: Dict[str, Any], in_chans: int = 3, cache_dir=None,
                           grid=None) -> None:
    """Load a patchhead checkpoint through timm's own loader (Hub, local folder, file), turning a bad file into an
    error that says what to do.

    ``grid``: the grid the file's patch head was trained on, where the file records it. A per-position head (one
    classifier per cell) is refused on another grid, of the same cell count too: its cell k would classify another
    region of the image.

    With the checkpoint's class count every tensor of the model must be in the file and nothing else (a strict
    load). With another ``model.num_classes`` (fine-tuning) both classifier heads (``model.pretrained_cfg
    ['classifier']``: the backbone's classifier and ``patch_head.fc``) start fresh, and every other tensor must be
    in the file: a file that misses any, or holds tensors the model does not have, is a CheckpointError naming
    them. A tensor of another kind than the model's (an integer or boolean tensor for a float parameter) is one too.
    """
    from huggingface_hub.errors import EntryNotFoundError
    from timm.models import load_pretrained
    from ..checkpoint import CheckpointError, check_file_digest
    from ..validation import check_tensor_kinds
    where = cfg.get('file') or cfg.get('hf_hub_id') or cfg.get('url') or 'the pretrained cfg'
    local = None  # the file timm reads, where it is known: its tensors are checked against its header's digest
    # safetensors only: timm's loaders would fall back to pickle files (pytorch_model.bin, .pth) where a folder,
    # a Hub repo or a file holds no safetensors. The branches follow the order in which load_pretrained picks
    # its source.
    source = cfg.get('source')
    if source == 'local-dir':
        if not os.path.isfile(os.path.join(cfg.get('file') or '', 'model.safetensors')):
            raise CheckpointError(f'{where} holds no model.safetensors: weights are read from safetensors only (a '
                                  f'pytorch_model.bin or other pickle file is never read); `timm-patchmix hub export` '
                                  f'writes such a folder')
        where = local = os.path.join(cfg['file'], 'model.safetensors')
    elif source == 'hf-hub' or (cfg.get('state_dict') is None and not cfg.get('file') and cfg.get('hf_hub_id')):
        cfg = dict(cfg, hf_hub_filename='model.safetensors')  # a repo without it fails; no .bin is tried
        where = f'{where} (its model.safetensors: weights are read from safetensors only)'
    elif cfg.get('state_dict') is None:
        named = cfg.get('file') or cfg.get('url')
        if named and not str(named).endswith('.safetensors'):
            raise CheckpointError(f'{where} is not a .safetensors file: weights are read from safetensors only (a '
                                  f'pickle file such as .pth or .bin is never read)')
        local = cfg.get('file') or None
    heads = _heads(model.pretrained_cfg.get('classifier'))
    cfg = dict(cfg, classifier=heads)  # the model's own heads, whatever a cfg names
    fresh = model.num_classes != cfg.get('num_classes')  # load_pretrained drops both heads then

    def check(state, _model=None):
        path = local or _hub_cached_file(cfg, cache_dir)
        if path and os.path.isfile(path):
            check_file_digest(path, state, 'delete the file (a Hub download: `hf cache delete`, or remove it under '
                                           'HF_HUB_CACHE) and fetch it again')
        own = model.state_dict()

        def is_head(k: str) -> bool:
            return any(k.startswith(h + '.') for h in heads)
        in_head = is_head if fresh else (lambda k: False)  # the heads that may be absent
        missing = [k for k in own if k not in state and not in_head(k)]
        unexpected = [k for k in state if k not in own and not in_head(k)]
        if missing or unexpected:
            heads_note = (f' (fine-tuning to {model.num_classes} classes: only the classifier heads '
                          f'{", ".join(heads)} may be left out)' if fresh else '')
            raise CheckpointError(f'{where} does not fit {cfg.get("architecture")}{heads_note}: missing '
                                  f'{len(missing)} tensors {missing[:8]}, unexpected {len(unexpected)} tensors '
                                  f'{unexpected[:8]}')
        check_tensor_kinds(state, own, where, CheckpointError)
        problem = None if fresh else per_position_grid_problem(model, state, grid)
        if problem:
            raise CheckpointError(f'{where} {problem}. Create the model with that grid, or with another num_classes '
                                  f'for both heads to start fresh')
        # (timm resamples a backbone's position embedding in that backbone's own filter, which the whole model's
        # weights do not pass through: a tensor of another shape is named, with the way that works)
        stems = _heads(model.pretrained_cfg.get('first_conv'))  # (timm adapts these to in_chans after the filter)
        other = [k for k in state if k in own and not in_head(k) and tuple(state[k].shape) != tuple(own[k].shape)
                 and not any(k.startswith(f'{c}.') for c in stems)]
        if other:
            k = other[0]
            trunk = [n for n in other if not is_head(n)]
            if trunk:
                k = trunk[0]
                resize = (' and change the input size afterwards with model.set_input_size(...), which resamples '
                          'it' if hasattr(model, 'set_input_size') else '')
                fix = (f'the weights were made with other model arguments (an input or patch size, say): create the '
                       f'model with those (its config.json model_args){resize}')
            else:  # the classifier heads alone: another class count, or a per-position head for a shared one
                fix = ("the classifier heads differ: create the model with the file's head (its num_classes, and "
                       'per_position and grid as it was trained), or with another num_classes for both heads to '
                       'start fresh')
            raise CheckpointError(f'{where} does not fit {cfg.get("architecture")} as created: {k} is '
                                  f'{list(state[k].shape)} in the file and {list(own[k].shape)} in the model'
                                  f'{f" ({len(other)} tensors differ)" if len(other) > 1 else ""}; {fix}')
        return state
    try:
        load_pretrained(model, cfg, num_classes=model.num_classes, in_chans=in_chans, filter_fn=check,
                        cache_dir=cache_dir)
    except CheckpointError:
        raise
    except EntryNotFoundError as e:  # (a Hub repo's model.safetensors, in neither the cache nor the repo)
        raise _unfetched(cfg.get('hf_hub_id') or where, cfg.get('hf_hub_filename') or 'model.safetensors', e) \
            from None
    except SafetensorError as e:
        raise CheckpointError(
            f'the weights of {cfg.get("architecture")} at {where} are damaged or incomplete ({e}). Delete the file '
            f'(a Hub download: `hf cache delete`, or remove it under HF_HUB_CACHE) and fetch it again') from e
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f'could not load the weights of {cfg.get("architecture")} from {where}: {e}') from e


def register_patchhead_models() -> int:
    """Register ``patchhead_<arch>`` with ``timm.models.register_model`` for every architecture timm lists now
    (and the tags in ``pretrained.py`` with them); never replaces an existing name. Returns how many were added.

    Call it again after registering new timm architectures to give them a ``patchhead_`` twin.
    """
    module = sys.modules[__name__]
    added = 0
    for arch in timm.list_models():
        name = PREFIX + arch
        if arch.startswith(PREFIX) or timm.is_model(name):
            continue
        fn = _entrypoint(arch)
        setattr(module, name, fn)  # a real attribute for each name register_model adds to __all__
        register_model(fn)
        added += 1
    return added
