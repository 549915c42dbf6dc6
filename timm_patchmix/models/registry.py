"""Registration of ``patchhead_<arch>`` with timm, and where a ``patchhead_`` model's weights come from."""
from __future__ import annotations

from typing import Any, Dict, Optional

import timm
from safetensors import SafetensorError
from timm.models import PretrainedCfg

from ..compat import registry as _registry
from .patchhead import PREFIX, PatchHeadModel, create_patchhead

_MODULE = 'patchhead'
_PATCHHEAD_TAGS = set()  # 'patchhead_<arch>.<tag>' names whose weights hold the patch head (see pretrained.py)


def _patchhead_cfg(name: str, pretrained_cfg, overlay) -> Optional[Dict[str, Any]]:
    """The pretrained cfg of ``name``'s own (patch-head) weights, or None when weights, if any, are the backbone's.

    Patch-head weights come from a ``config.json`` (``hf-hub:``/``local-dir:``, which timm hands over as a cfg whose
    architecture is ``patchhead_*``), or from a tag registered for ``name`` (``patchhead_resnet50.gpm_in1k``). Any
    other tag, and no tag, selects the backbone's timm weights under a fresh patch head.
    """
    if isinstance(pretrained_cfg, str):
        cfg = _registry._model_pretrained_cfgs.get(f'{name}.{pretrained_cfg}')
        if cfg is None or f'{name}.{pretrained_cfg}' not in _PATCHHEAD_TAGS:
            return None
        cfg = cfg.to_dict()
    elif isinstance(pretrained_cfg, PretrainedCfg):
        cfg = pretrained_cfg.to_dict()
    elif isinstance(pretrained_cfg, dict):
        cfg = dict(pretrained_cfg)
    else:
        return None
    # a config.json (timm drops its architecture from the cfg; it routed here because it names this model)
    from_config = cfg.get('source') in ('hf-hub', 'local-dir')
    if not from_config and not str(cfg.get('architecture') or '').startswith(PREFIX):
        return None
    cfg.update(overlay or {})
    cfg['architecture'] = name
    return cfg


def _check_config_fields(cfg: Dict[str, Any], model_args: Optional[Dict[str, Any]]) -> None:
    """A ``config.json``'s fields as timm hands them over (num_classes, label_names, input_size in the cfg; the
    model_args apart), checked for type and range; its model_args pass the allow-list of architectural arguments."""
    from ..checkpoint import CheckpointError
    from ..validation import Fields, check_hub_config
    where = cfg.get('file') or cfg.get('hf_hub_id') or 'the pretrained cfg'
    doc = {'architecture': cfg.get('architecture') or 'patchhead', 'num_classes': cfg.get('num_classes'),
           'label_names': cfg.get('label_names'), 'model_args': model_args or {},
           'pretrained_cfg': {'input_size': list(cfg['input_size']) if isinstance(cfg.get('input_size'), tuple)
                              else cfg.get('input_size')}}
    check_hub_config(doc, Fields(f'{where}: config.json', CheckpointError))


def _entrypoint(arch: str):
    name = PREFIX + arch

    def fn(pretrained: bool = False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None,
           **kwargs) -> PatchHeadModel:
        own = _patchhead_cfg(name, pretrained_cfg, pretrained_cfg_overlay)
        if own is None:
            return create_patchhead(arch, pretrained=pretrained, pretrained_cfg=pretrained_cfg,
                                    pretrained_cfg_overlay=pretrained_cfg_overlay, cache_dir=cache_dir, **kwargs)
        file_args = kwargs.pop('pretrained_model_args', None)
        if own.get('source') in ('hf-hub', 'local-dir'):
            _check_config_fields(own, file_args)
        model = create_patchhead(arch, pretrained=False, **kwargs)
        model.pretrained_cfg = dict(model.pretrained_cfg, **{k: v for k, v in own.items() if v is not None})
        model.pretrained_cfg['classifier'] = tuple(model.pretrained_cfg['classifier'])
        if pretrained:
            load_patchhead_weights(model, own, in_chans=kwargs.get('in_chans', 3), cache_dir=cache_dir)
        return model
    fn.__name__ = name
    fn.__qualname__ = fn.__name__
    fn.__module__ = __name__
    fn.__doc__ = f'{arch} with a PatchMix patch head (see timm_patchmix.models.create_patchhead).'
    return fn


def load_patchhead_weights(model: PatchHeadModel, cfg: Dict[str, Any], in_chans: int = 3, cache_dir=None) -> None:
    """Load a patchhead checkpoint through timm's own loader (Hub, local folder, file; both heads are dropped
    when ``model.num_classes`` differs from the checkpoint's), turning a bad file into an error that says what to
    do."""
    from timm.models import load_pretrained
    from ..checkpoint import CheckpointError
    where = cfg.get('file') or cfg.get('hf_hub_id') or cfg.get('url') or 'the pretrained cfg'
    try:
        load_pretrained(model, cfg, num_classes=model.num_classes, in_chans=in_chans, cache_dir=cache_dir)
    except SafetensorError as e:
        raise CheckpointError(
            f'the weights of {cfg.get("architecture")} at {where} are damaged or incomplete ({e}). Delete the file '
            f'(a Hub download: `hf cache delete`, or remove it under HF_HUB_CACHE) and fetch it again') from e
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f'could not load the weights of {cfg.get("architecture")} from {where}: {e}') from e


def register_patchhead_models() -> int:
    """Register ``patchhead_<arch>`` for every architecture timm lists now; never replaces an existing name.

    Entries go straight into timm's registry tables (what ``register_model`` does, less its per-call module
    bookkeeping), which keeps this to a few milliseconds for ~1,400 architectures. Returns how many were added.
    """
    entry = _registry._model_entrypoints
    added = 0
    for arch in timm.list_models():
        name = PREFIX + arch
        if arch.startswith(PREFIX) or name in entry:
            continue
        entry[name] = _entrypoint(arch)
        _registry._model_to_module[name] = _MODULE
        _registry._module_to_models[_MODULE].add(name)
        added += 1
    return added
