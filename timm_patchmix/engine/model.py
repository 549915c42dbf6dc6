"""The model of a run: its architecture, built through timm's factory, and the checks that it fits the run."""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from .config import DEFAULT_GRID, KWARG_FLAGS, TrainConfig
from .errors import ConfigError, TrainSetupError

__all__ = ['SOURCES', 'model_arch', 'resolve_arch', 'build_model', 'init_heads', 'load_initial_checkpoint',
           'check_model_fits',
           'probe_heads', 'freeze_for_linear_probe']

_logger = logging.getLogger(__name__)
SOURCES = ('hf-hub:', 'local-dir:')
# the keyword arguments of timm.create_model that timm's model flags (KWARG_FLAGS) set when given
_FLAG_KWARGS = ('drop_block_rate', 'global_pool', 'bn_momentum', 'bn_eps')


def model_arch(model: str) -> str:
    """The architecture ``--model`` builds: the name itself, or the one a ``hf-hub:``/``local-dir:`` config names."""
    if model.startswith(SOURCES):
        from ..hub import _read_config
        return _read_config(model)['architecture']
    return model


def resolve_arch(model: str) -> str:
    """:func:`model_arch`, checked to be a registered timm architecture (:class:`TrainSetupError` otherwise)."""
    import timm
    from ..checkpoint import CheckpointError
    try:
        arch = model_arch(model)
    except (CheckpointError, OSError) as e:
        raise TrainSetupError(f'--model {model}: {e}') from None
    if not timm.is_model(arch):
        named = f' (named by {model})' if arch != model else ''
        raise TrainSetupError(f'unknown model {arch!r}{named}; see timm.list_models() (patchhead_<arch> exists for '
                              f'every timm architecture)')
    return arch


def _model_kwargs(cfg: TrainConfig) -> Dict[str, Any]:
    from ..validation import MODEL_KWARGS
    unknown = sorted(set(cfg.model_kwargs) - set(MODEL_KWARGS))
    if unknown:  # the checkpoint records them, and loading refuses what is outside the allow-list
        raise ConfigError(f'{", ".join(unknown)} cannot be recorded in a checkpoint (the architectural arguments it '
                          f'may hold are {", ".join(sorted(MODEL_KWARGS))})', '--model-kwargs')
    kwargs = dict(cfg.model_kwargs)
    patchhead = (cfg.arch or cfg.model).startswith('patchhead_')
    if patchhead and (cfg.grid is not None or not cfg.model.startswith(SOURCES)):
        kwargs.setdefault('grid', cfg.grid or DEFAULT_GRID)  # a hub model without --patchmix-grid brings its own
    if patchhead and cfg.per_position_head:  # (a hub model's too: its config's own head is a shared one)
        kwargs['per_position'] = True
    if cfg.channels is not None:  # --in-chans, or as timm's train.py the channels of --input-size
        kwargs['in_chans'] = cfg.channels
    if cfg.drop_path is not None:
        kwargs['drop_path_rate'] = cfg.drop_path
    if cfg.drop:
        kwargs['drop_rate'] = cfg.drop
    elif cfg.model.startswith(SOURCES):
        # timm's train.py passes --drop always: its default, 0, replaces a rate that the folder's config records
        # (the model's own default elsewhere is 0 too, for the builders that would refuse the argument)
        kwargs.setdefault('drop_rate', 0.0)
    for key in _FLAG_KWARGS:  # the same key in --model-kwargs is refused by TrainConfig
        value = getattr(cfg, KWARG_FLAGS[key][2:].replace('-', '_'))  # the TrainConfig field of the flag
        if value is not None:
            kwargs[key] = value
    return kwargs


def init_heads(model: nn.Module, scale: Optional[float], bias: Optional[float]) -> None:
    """timm's ``--head-init-scale``/``--head-init-bias``: the classifier's weight and bias times ``scale``, then
    its bias set to ``bias``; a ``patchhead_`` model's patch classifier alike. A head without a weight and a bias
    (a model built with no classes) is a :class:`ConfigError`."""
    if scale is None and bias is None:
        return
    heads = [model.get_classifier()]
    if hasattr(model, 'get_patch_classifier'):
        heads.append(model.get_patch_classifier())
    flag = '--head-init-scale' if scale is not None else '--head-init-bias'
    for head in heads:
        if not (isinstance(getattr(head, 'weight', None), torch.Tensor)
                and isinstance(getattr(head, 'bias', None), torch.Tensor)):
            raise ConfigError(f'the classifier of this model ({type(head).__name__}) has no weight and bias to '
                              f'initialise', flag)
        with torch.no_grad():
            if scale is not None:
                head.weight.mul_(scale)
                head.bias.mul_(scale)
            if bias is not None:
                head.bias.fill_(bias)


def _safetensors_only(model: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` for ``timm.create_model(model, pretrained=True)`` that read a plain (not ``patchhead_``) model's
    Hub weights from safetensors only, as a ``patchhead_`` model's are: a timm tag's repo (its
    ``model.safetensors``, never the ``pytorch_model.bin`` timm alone falls back to; a tag whose weights are a
    pickled URL is refused) and an ``hf-hub:``/``local-dir:`` folder of a plain architecture (a CheckpointError
    where it holds no ``model.safetensors``)."""
    import timm
    from timm.models import split_model_name_tag
    from ..hub.load import _plain_safetensors_only, _read_config, source_name
    from ..models.registry import _safe_backbone_overlay
    name = source_name(model)
    if name.startswith(SOURCES):
        if _read_config(name, kwargs.get('cache_dir'))['architecture'].startswith('patchhead_'):
            return kwargs  # (its own loader reads safetensors only)
        out = dict(kwargs)
        _plain_safetensors_only(name, out)
        return out
    arch, tag = split_model_name_tag(model)
    if arch.startswith('patchhead_') or not timm.is_model(arch):  # (timm names an unknown model)
        return kwargs
    overlay = _safe_backbone_overlay(arch, tag or None, kwargs.get('pretrained_cfg_overlay'))
    return dict(kwargs, pretrained_cfg_overlay=overlay) if overlay is not None else kwargs


def build_model(cfg: TrainConfig, num_classes: int) -> Tuple[nn.Module, Dict[str, Any]]:
    """The model ``cfg`` names with ``num_classes`` outputs, and the keyword arguments it was built with (as a
    checkpoint records them). A keyword argument the model does not take is a :class:`ConfigError`. With
    ``--reset-head``, ``model.reset_classifier(num_classes)`` runs once the ``--pretrained`` and
    ``--initial-checkpoint`` weights are in (a ``patchhead_`` model's resets its patch head too)."""
    import timm
    from ..checkpoint import CheckpointError
    from ..models import PatchheadWeightsError
    kwargs = _model_kwargs(cfg)
    try:
        create = _safetensors_only(cfg.model, kwargs) if cfg.pretrained else kwargs
        model = timm.create_model(cfg.model, pretrained=cfg.pretrained, num_classes=num_classes, **create)
    except (PatchheadWeightsError, CheckpointError) as e:  # no weights; or weights that do not fit the model
        raise TrainSetupError(f'--model {cfg.model}{" --pretrained" if cfg.pretrained else ""}: {e}') from None
    except TypeError as e:
        usage = model_kwargs_error(cfg, e)
        if usage is not None:
            raise usage from None
        raise
    except (AssertionError, ValueError, KeyError) as e:  # timm's pooling factories assert on an unknown type
        if isinstance(e, TrainSetupError):
            raise
        if cfg.gp is not None and _builds_without(cfg, num_classes, kwargs, ('global_pool',)):
            raise ConfigError(f'model {cfg.model} has no global pooling {cfg.gp!r}: {_failure(e)}', '--gp') from None
        if cfg.model_kwargs and _builds_without(cfg, num_classes, kwargs, tuple(cfg.model_kwargs)):
            given = ' '.join(f'{k}={v!r}' for k, v in cfg.model_kwargs.items())
            raise ConfigError(f'model {cfg.model} cannot be built with {given}: {_failure(e)}',
                              '--model-kwargs') from None
        if not isinstance(e, AssertionError):
            raise
        raise TrainSetupError(f'model {cfg.model} cannot be built with these settings: {_failure(e)}') from None
    except (OSError, RuntimeError) as e:  # no weights for the model (timm's RuntimeError), no file or no network
        if not cfg.pretrained or (isinstance(e, RuntimeError) and 'pretrained' not in str(e).lower()):
            raise
        from huggingface_hub.errors import EntryNotFoundError
        safe = (' (a Hub repository\'s weights are read from its model.safetensors only, never from a pickle file '
                'such as pytorch_model.bin)' if isinstance(e, EntryNotFoundError) else '')
        raise TrainSetupError(f'--model {cfg.model} --pretrained: its pretrained weights cannot be loaded: '
                              f'{type(e).__name__}: {str(e).rstrip()}{safe}') from None
    if cfg.model.startswith(SOURCES):  # the config's model_args, as the factory applied them
        kwargs = {k: v for k, v in (getattr(model, '_model_args', None) or {}).items()
                  if k not in ('num_classes', 'pretrained_model_args')}
    if cfg.initial_checkpoint:
        try:
            load_initial_checkpoint(model, cfg.initial_checkpoint)
        except CheckpointError as e:
            raise TrainSetupError(f'--initial-checkpoint: {e}') from None
    if cfg.reset_head:  # after every load: a fresh head even when the class count matches the loaded one
        model.reset_classifier(num_classes)
        _logger.info('--reset-head: re-initialised the classifier%s for %d classes',
                     ' and the patch head' if hasattr(model, 'patch_head') else '', num_classes)
    init_heads(model, cfg.head_init_scale, cfg.head_init_bias)  # after the loads, as timm's train.py
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model, {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}


def _builds_without(cfg: TrainConfig, num_classes: int, kwargs: Dict[str, Any], keys: Tuple[str, ...]) -> bool:
    """Whether the model ``cfg`` names builds, without weights, once the keyword arguments ``keys`` are left out:
    then they are what it could not take (a checkpoint that does not fit, or another keyword argument, is not)."""
    import timm
    rest = {k: v for k, v in kwargs.items() if k not in keys}
    try:
        timm.create_model(cfg.model, pretrained=False, num_classes=num_classes, **rest)
    except Exception:  # any failure without them: not theirs
        return False
    return not cfg.pretrained  # with weights, a failure may be theirs (a classifier of another width)


def _failure(error: BaseException) -> str:
    """``error`` in words: its type and message, or for an assertion without a message the failing line."""
    text = str(error)
    if not text and isinstance(error, AssertionError):
        import traceback
        frames = traceback.extract_tb(error.__traceback__)
        text = (frames[-1].line or '').strip() if frames else ''
    return f'{type(error).__name__}: {text}' if text else type(error).__name__


def model_kwargs_error(cfg: TrainConfig, error: TypeError) -> Optional[ConfigError]:
    """The usage error for ``error`` (from ``timm.create_model``) when it is a keyword argument the model does not
    take, or one given twice; ``None`` for any other TypeError."""
    m = re.search(r"(unexpected|multiple values for) keyword argument '(\w+)'", str(error))
    if not m:
        return None
    key = m.group(2)
    if m.group(1) == 'multiple values for':
        return ConfigError(f'{key} is set by {KWARG_FLAGS.get(key, "train.py itself")}; leave it out of '
                           f'--model-kwargs', '--model-kwargs')
    if key in cfg.model_kwargs:
        return ConfigError(f'model {cfg.model} does not take the keyword argument {key}={cfg.model_kwargs[key]!r} '
                           f'({error})', '--model-kwargs')
    flag = KWARG_FLAGS.get(key, '--model')
    if key == 'in_chans' and cfg.in_chans is None:  # passed for --input-size's channels, as timm's train.py does
        flag = '--input-size'
    return ConfigError(f'model {cfg.model} does not take {key!r}, which {flag} sets ({error})', flag)


def load_initial_checkpoint(model: nn.Module, path: str) -> None:
    """Load weights, dropping classifier tensors whose shapes differ (a new num_classes re-initialises them). A
    tensor of another kind than the model's (an integer or boolean tensor for a float parameter) is refused.

    A ``patchhead_`` model also takes a plain timm model's weights (no name under ``backbone.`` or
    ``patch_head.``): they load into the backbone under the same rules, and the patch head starts fresh."""
    from ..checkpoint import load_weights
    from ..models.patchhead import PatchHeadModel, holds_plain_backbone
    from ..models.registry import per_position_grid_problem, recorded_grid_of_file
    state, meta = load_weights(path)
    if isinstance(model, PatchHeadModel) and holds_plain_backbone(state, model.backbone):
        _load_into(model.backbone, state, path)
        _logger.info('initial checkpoint: %s holds a plain model\'s weights; loaded them into the backbone, the '
                     'patch head starts fresh', path)
        return
    problem = per_position_grid_problem(model, state, recorded_grid_of_file(path, meta))
    if problem:  # another head, as one of another shape: it starts fresh
        for k in [k for k in state if k.startswith('patch_head.fc.')]:
            state.pop(k)
        _load_into(model, state, path, fresh=('patch_head.fc',))
        _logger.info('initial checkpoint: %s %s; the patch head starts fresh', path, problem)
        return
    _load_into(model, state, path)


def _load_into(model: nn.Module, state: Dict[str, torch.Tensor], path: str, fresh: Tuple[str, ...] = ()) -> None:
    from ..checkpoint import CheckpointError
    from ..validation import check_tensor_kinds
    own = model.state_dict()
    heads = getattr(model, 'pretrained_cfg', {}).get('classifier') or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    dropped = []
    for h in heads:
        for suffix in ('.weight', '.bias'):
            k = h + suffix
            if k in state and k in own and state[k].shape != own[k].shape:
                dropped.append(state.pop(k))
    check_tensor_kinds(state, own, path, CheckpointError)
    shapes = [f'{k} is {list(v.shape)} in the file and {list(own[k].shape)} in the model' for k, v in state.items()
              if k in own and v.shape != own[k].shape]
    if shapes:  # (torch's size-mismatch error, which strict=False does not spare)
        raise CheckpointError(f'{path} does not fit the model: {shapes[0]}'
                              + (f' ({len(shapes)} tensors differ)' if len(shapes) > 1 else '')
                              + '; it holds weights of another architecture, --in-chans or input size')
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not any(k.startswith(h + '.') for h in heads)] if dropped else missing
    missing = [k for k in missing if not any(k.startswith(h + '.') for h in fresh)]  # (left out by the caller)
    if missing or unexpected:
        raise CheckpointError(f'{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}')
    if dropped:
        _logger.info('initial checkpoint: re-initialised the classifier heads whose shapes differ from the file\'s '
                     '(another class count, or a per-position patch head for a shared one)')


def check_model_fits(cfg: TrainConfig, model: nn.Module, device) -> None:
    """The model of a resolved ``cfg`` can train as asked: a patch head where PatchMix's patch loss needs one, none
    where Mixup/CutMix give no per-cell labels, and a final feature map the grid can divide."""
    if cfg.patchmix and not cfg.patch_head and not cfg.no_patch_loss:
        raise TrainSetupError(f'--patchmix trains a patch head, and {cfg.model} has none: use --model '
                              f'patchhead_{cfg.model}, or --no-patch-loss for image-level PatchMix only')
    if cfg.patch_head and cfg.mixup_active:
        raise TrainSetupError(f'--mixup/--cutmix give no per-cell labels for the patch head of {cfg.model}; train '
                              f'the plain backbone for those baselines')
    input_size = cfg.data_config.input_size
    if input_size[0] not in (1, 3):  # (a model whose data config asks for other channels, with no flag naming them)
        raise TrainSetupError(f'{cfg.model} takes {input_size[0]}-channel inputs, and images load as greyscale (1 '
                              f'channel) or RGB (3); give --in-chans 1 or 3')
    if cfg.img_size is not None or cfg.input_size is not None:  # (before --gp's check, which would blame the pooling)
        _check_input_size(cfg, model, input_size, device)
    if cfg.gp is not None:
        _check_pooling(cfg, model, input_size, device)
    if cfg.patchmix:  # the mixer's cells, also where no patch head sees them (image-level PatchMix)
        from ..grid import cell_bounds
        try:
            cell_bounds(input_size[1], cfg.grid[0]), cell_bounds(input_size[2], cfg.grid[1])
        except ValueError as e:
            raise TrainSetupError(f'--patchmix-grid {cfg.grid[0]}x{cfg.grid[1]} does not fit the input '
                                  f'{input_size[1]}x{input_size[2]}: {e}') from None
    if not cfg.patch_head:
        return
    try:
        _eval_output(model, input_size, device, 'forward_patches')
    except ValueError as e:
        raise TrainSetupError(f'--patchmix-grid {cfg.grid[0]}x{cfg.grid[1]} on {cfg.model} at input '
                              f'{input_size[1]}x{input_size[2]}: {e}') from None


def _eval_output(model: nn.Module, input_size, device, method: str = 'forward'):
    """``model.<method>`` in eval mode on one zero image of ``input_size`` (the model's mode restored after)."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return getattr(model, method)(torch.zeros(1, *input_size, device=device))
    finally:
        model.train(was)


def _check_input_size(cfg: TrainConfig, model: nn.Module, input_size, device) -> None:
    """``--img-size``/``--input-size``: the model takes an input of that size (a ViT of a fixed size asserts its
    own at the first batch, after the run's files are written). The features alone, so a pooling of --gp that
    fails is named by its own check."""
    try:
        _eval_output(model, input_size, device, 'forward_features')
    except (AssertionError, RuntimeError, ValueError) as e:
        raise ConfigError(f'{cfg.model} cannot take an input of {input_size[1]}x{input_size[2]} '
                          f'({type(e).__name__}: {e}); a model of a fixed input size is built for another with '
                          f'--model-kwargs img_size={input_size[1]} where its builder takes img_size (or '
                          f'dynamic_img_size=True)', '--input-size' if cfg.input_size is not None else '--img-size'
                          ) from None


def _check_pooling(cfg: TrainConfig, model: nn.Module, input_size, device) -> None:
    """``--gp``: the model gives one row of logits per image (a pooling of ``''`` leaves timm's CNNs a feature
    map their classifier cannot take)."""
    try:
        out = _eval_output(model, input_size, device)
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        problem = None if shape == (1, cfg.num_classes) else f'it gives outputs of shape {shape}'
    except (RuntimeError, AssertionError, ValueError, AttributeError, KeyError, TypeError) as e:
        # (timm asserts the pool type; under python -O the unknown type fails later, as a missing attribute)
        problem = f'{type(e).__name__}: {e}'
    if problem is not None:
        raise ConfigError(f'{cfg.model} with the global pooling {cfg.gp!r} gives no logits of '
                          f'{cfg.num_classes} classes per image ({problem})', '--gp')


def probe_heads(cfg: TrainConfig, model: nn.Module) -> Tuple[nn.Module, ...]:
    """The modules ``--linear-probe`` trains in a resolved ``cfg``: ``model.get_classifier()``, and a ``patchhead_``
    model's ``get_patch_classifier()``; a head whose loss term is off (``--no-image-loss``, ``--no-patch-loss``)
    gets no gradient and is left out."""
    heads = []
    if not (cfg.patch_head and cfg.no_image_loss):
        heads.append(model.get_classifier())
    if cfg.patch_head and not cfg.no_patch_loss:
        heads.append(model.get_patch_classifier())
    return tuple(heads)


def freeze_for_linear_probe(cfg: TrainConfig, model: nn.Module) -> Tuple[nn.Module, ...]:
    """``--linear-probe``: every parameter outside :func:`probe_heads` gets ``requires_grad=False``. Returns the
    frozen modules to put back in eval mode after each ``model.train()`` (the largest modules that are neither in a
    head nor contain one), so that BatchNorm running statistics, dropout and drop-path of the trunk stay as in
    evaluation. A module that contains a head (the model itself, a backbone) keeps its training flag."""
    heads = probe_heads(cfg, model)
    head_params = {id(p) for h in heads for p in h.parameters()}
    if not head_params:
        raise TrainSetupError(f'--linear-probe trains the classifier of {cfg.model}, which has no parameters')
    for p in model.parameters():
        p.requires_grad_(id(p) in head_params)
    inside = {id(m) for h in heads for m in h.modules()}
    names = dict(model.named_modules())
    holders = {''}  # the modules that contain a head: the root and every ancestor of a head
    for name, m in names.items():
        if id(m) in inside and name:
            parts = name.split('.')
            holders.update('.'.join(parts[:i]) for i in range(1, len(parts)))
    frozen = []
    for name, m in names.items():
        if not name or name in holders or id(m) in inside or _head_dropout(name, m, holders):
            continue
        parent = name.rpartition('.')[0]
        if parent in holders:  # the largest frozen modules: their children follow them into eval mode
            frozen.append(m)
    return tuple(frozen)


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _head_dropout(name: str, module: nn.Module, holders) -> bool:
    """``module`` is the dropout of the classifier's input (``--drop``) as a module of its own beside the head, by
    timm's names (ViT's ``head_drop``, ConvNeXt's ``head.drop``): it stays with the head in training mode, as the
    dropout a model applies itself in its ``forward_head`` (timm's ResNets) does."""
    parent, _, last = name.rpartition('.')
    return isinstance(module, _DROPOUTS) and parent in holders and (
        last.startswith('head') or parent.rpartition('.')[2].startswith('head'))
