"""``train(cfg)``: a whole training run, from a :class:`TrainConfig` to its files and a :class:`TrainResult`."""
from __future__ import annotations

import dataclasses
import math
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..locking import hold_folder
from .config import TrainConfig, resolve
from .errors import ConfigError, NonFiniteLossError, TrainSetupError
from .loaders import Datasets, Loaders, build_datasets, build_loaders, resolve_data
from .loop import StepEvent, Stepper, amp_setup, train_one_epoch, updates_per_epoch, validate
from .model import build_model, check_model_fits, freeze_for_linear_probe, resolve_arch
from .records import (CHECKPOINT_NAME, ENDED_FILES, ResumePoint, checkpoint_history, clean_scheduled_lr,
                      data_identity, improves, load_resume, load_scheduler_state, restore_weights_files,
                      resume_settings, save_epoch, scheduler_state, weights_meta, write_args, write_start)
from .runtime import Runtime, epoch_seed, init_runtime, release_runtime, seed_all

__all__ = ['TrainResult', 'train']

METRIC_KEYS = {'top1': 'eval_top1', 'top5': 'eval_top5', 'loss': 'eval_loss'}


@dataclass(frozen=True)
class TrainResult:
    """A finished run: its resolved config, its folder and files, the per-epoch rows (as in ``summary.csv``), the
    best epoch by ``--eval-metric`` and the top-1 of the final epoch and of that best epoch (``best_top1``: the
    weights in ``best_path``, whichever metric chose them) on the split the epochs were evaluated on (the
    held-out images with ``--holdout``); ``fgsm`` with ``--fgsm``.

    With ``--holdout``, ``test`` holds the test split's numbers (``--val-split``, evaluated once at the end):
    ``{'final': {'epoch', 'test_loss', 'test_top1', 'test_top5'}, 'best': {...}}``, ``best`` for the weights of the
    best epoch (the same numbers as ``final`` when that is the last epoch). ``splits`` says which images selected
    the best epoch and which are the test split, with their numbers and the holdout's record."""
    config: TrainConfig
    output: str
    best_path: str
    last_path: str
    state_path: str
    summary_path: str
    rows: Tuple[Dict[str, Any], ...]
    best: Optional[Dict[str, Any]]
    final_top1: Optional[float]
    best_top1: Optional[float]
    fgsm: Optional[Dict[float, float]] = None
    test: Optional[Dict[str, Dict[str, Any]]] = None
    splits: Optional[Dict[str, Any]] = None

    @property
    def final_test_top1(self) -> Optional[float]:
        return self.test['final']['test_top1'] if self.test else None

    @property
    def best_test_top1(self) -> Optional[float]:
        return self.test['best']['test_top1'] if self.test else None

    def as_dict(self) -> Dict[str, Any]:
        """``{'output', 'rows', 'best'}`` (and ``'fgsm'``, ``'test'``), as ``timm_patchmix.train.main`` returns
        it."""
        out = {'output': self.output, 'rows': list(self.rows), 'best': self.best}
        if self.fgsm is not None:
            out['fgsm'] = self.fgsm
        if self.test is not None:
            out['test'] = self.test
        return out


def train(cfg: TrainConfig, *, on_step: Optional[Callable[[StepEvent], None]] = None,
          log_data_config: bool = True) -> TrainResult:
    """Train as ``cfg`` says, writing ``args.yaml``, ``summary.csv`` and the ``best``/``last``/``state``
    checkpoints to ``<output>/<experiment>`` (the state's folder when resuming without ``--experiment``).

    ``on_step`` is called after every training batch with a :class:`StepEvent` (its ``updates`` grows at the last
    batch of each ``grad_accum_steps`` group); ``log_data_config`` logs timm's
    data config block (a caller training several models logs it for the first only). Raises
    :class:`TrainSetupError` (:class:`ConfigError` for flags) before anything is written when the run cannot start,
    :class:`~timm_patchmix.settings.SettingsChangedError` for a resume with other settings, and
    :class:`NonFiniteLossError` when the training loss, or an epoch's evaluation loss, is not finite (earlier epochs'
    files stay as they were). The global generators of Python, NumPy and torch are the caller's again on return."""
    from ..checkpoint import kept_rng_state
    if on_step is not None and not callable(on_step):  # (it would fail at the first batch, after args.yaml)
        raise TypeError(f'on_step must be a callable taking a StepEvent, got {type(on_step).__name__}')
    cfg = cfg.with_recipe()
    with kept_rng_state():  # the run seeds the global generators; the caller gets its own back
        rt = init_runtime(cfg.device)
        finished = False
        try:
            result = _train(cfg, rt, on_step, log_data_config)
            finished = True
            return result
        finally:
            release_runtime(rt, finished)


def _say(rt: Runtime, text: str) -> None:
    if rt.primary:
        print(text, flush=True)


def _setup(cfg: TrainConfig, rt: Runtime, log_data_config: bool):
    """Datasets, model and loaders, the config resolved from them, and the modules ``--linear-probe`` froze."""
    seed_all(cfg.seed + rt.rank)
    data = build_datasets(cfg)
    cfg = dataclasses.replace(cfg, arch=resolve_arch(cfg.model))
    model, model_kwargs = build_model(cfg, data.num_classes)
    model.to(rt.device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    data_config = resolve_data(cfg, model, verbose=log_data_config and rt.primary)
    cfg = resolve(cfg, model=model, num_classes=data.num_classes, data_config=data_config, world_size=rt.world_size)
    if cfg.amp and cfg.amp_dtype != 'bfloat16' and rt.device.type != 'cuda':  # what amp_setup autocasts in
        _say(rt, f'--amp on {rt.device.type}: autocast in bfloat16 (float16 autocast and loss scaling are for CUDA)')
        cfg = dataclasses.replace(cfg, amp_dtype='bfloat16')
    check_model_fits(cfg, model, rt.device)
    frozen = freeze_for_linear_probe(cfg, model) if cfg.linear_probe else ()
    return cfg, data, model, model_kwargs, build_loaders(cfg, data, rt), frozen


def _criterion(cfg: TrainConfig) -> nn.Module:
    """The training loss: :class:`~timm_patchmix.loss.PatchMixLoss` for PatchMix and patch-head models, else timm's
    choice in its train.py (``SoftTargetCrossEntropy`` with Mixup/CutMix, ``LabelSmoothingCrossEntropy`` with
    ``--smoothing``, ``BinaryCrossEntropy`` with ``--bce-loss``, which here applies also without either)."""
    from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from ..loss import PatchMixLoss
    bce = dict(bce_target_thresh=cfg.bce_target_thresh, bce_sum=cfg.bce_sum, bce_pos_weight=cfg.bce_pos_weight)
    if cfg.patchmix or cfg.patch_head:
        return PatchMixLoss(image_loss=not cfg.no_image_loss, patch_loss=not cfg.no_patch_loss,
                            patch_weight=cfg.patch_loss_weight, smoothing=cfg.smoothing or 0.0, bce=cfg.bce_loss,
                            grid=cfg.grid if cfg.patch_head else None, **(bce if cfg.bce_loss else {}))
    if cfg.bce_loss:  # Mixup/CutMix targets come smoothed; index targets are smoothed by the loss
        return BinaryCrossEntropy(smoothing=0.0 if cfg.mixup_active else cfg.smoothing or 0.0,
                                  target_threshold=cfg.bce_target_thresh, sum_classes=cfg.bce_sum,
                                  pos_weight=cfg.bce_pos_weight)
    if cfg.mixup_active:
        return SoftTargetCrossEntropy()
    if cfg.smoothing:
        return LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
    return nn.CrossEntropyLoss()


def _optimization(cfg: TrainConfig, model: nn.Module, steps_per_epoch: int):
    """timm's optimizer and scheduler for a resolved ``cfg``, ``steps_per_epoch`` its optimizer updates per epoch
    (:func:`~timm_patchmix.engine.loop.updates_per_epoch`); returns them with the number of epochs."""
    from timm.optim import create_optimizer_v2
    opt_kwargs = dict(momentum=cfg.momentum)
    if cfg.opt_eps is not None:
        opt_kwargs['eps'] = cfg.opt_eps
    if cfg.opt_betas is not None:
        opt_kwargs['betas'] = cfg.opt_betas
    if cfg.layer_decay is not None:
        opt_kwargs['layer_decay'] = cfg.layer_decay
    clash = sorted(set(cfg.opt_kwargs) & (set(opt_kwargs) | {'lr', 'weight_decay', 'opt', 'model_or_params'}))
    if clash:
        flags = {'eps': '--opt-eps', 'betas': '--opt-betas', 'layer_decay': '--layer-decay', 'lr': '--lr',
                 'weight_decay': '--weight-decay', 'momentum': '--momentum', 'opt': '--opt'}
        raise ConfigError(f'{clash[0]} is set by {flags.get(clash[0], "train.py itself")}; leave it out of '
                          f'--opt-kwargs', '--opt-kwargs')
    try:
        optimizer = create_optimizer_v2(model, opt=cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                        **opt_kwargs, **cfg.opt_kwargs)
    except TypeError as e:
        if not cfg.opt_kwargs or 'keyword argument' not in str(e):
            raise
        given = ', '.join(f'{k}={v!r}' for k, v in cfg.opt_kwargs.items())
        raise ConfigError(f'optimizer {cfg.opt} does not take {given} ({e})', '--opt-kwargs') from None
    except (IndexError, ValueError) as e:  # torch's checks of betas too short, or out of range
        if cfg.opt_betas is None or (isinstance(e, ValueError) and 'beta' not in str(e).lower()):
            raise
        raise ConfigError(f'optimizer {cfg.opt} does not take betas {list(cfg.opt_betas)} ({e})',
                          '--opt-betas') from None
    if cfg.opt_betas is not None and not _has_betas(cfg.opt):  # (timm's factory drops them)
        raise ConfigError(f'optimizer {cfg.opt} takes no betas, got {list(cfg.opt_betas)}', '--opt-betas')
    if cfg.opt_betas is not None:  # a longer list is taken without a word, then unused or failing at a step
        own = _default_betas(cfg.opt)
        if own is not None and len(own) != len(cfg.opt_betas):
            raise ConfigError(f'optimizer {cfg.opt} takes {len(own)} betas, got {len(cfg.opt_betas)}: '
                              f'{list(cfg.opt_betas)}', '--opt-betas')
    try:
        scheduler, num_epochs = _scheduler(cfg, optimizer, steps_per_epoch)
    except ValueError as e:  # (timm's checks of a schedule's lengths, counted in updates here)
        raise ConfigError(f'{e}' + (f' (counted in optimizer updates, {steps_per_epoch} an epoch, under '
                                    f'--sched-on-updates)' if cfg.sched_on_updates else ''), '--sched') from None
    return optimizer, scheduler, num_epochs


def _scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """timm's scheduler factory on ``cfg``'s schedule flags: ``(scheduler, epochs)``."""
    from timm.scheduler import create_scheduler_v2
    return create_scheduler_v2(
        optimizer, sched=cfg.sched, num_epochs=cfg.epochs, decay_epochs=cfg.decay_epochs, decay_rate=cfg.decay_rate,
        cooldown_epochs=cfg.cooldown_epochs, min_lr=cfg.min_lr, warmup_lr=cfg.warmup_lr,
        warmup_epochs=cfg.warmup_epochs, step_on_epochs=not cfg.sched_on_updates, updates_per_epoch=steps_per_epoch,
        decay_milestones=list(cfg.decay_milestones), patience_epochs=cfg.patience_epochs,
        warmup_prefix=cfg.warmup_prefix, noise=list(cfg.lr_noise) if cfg.lr_noise else None,
        noise_pct=cfg.lr_noise_pct, noise_std=cfg.lr_noise_std, noise_seed=cfg.seed, cycle_mul=cfg.lr_cycle_mul,
        cycle_decay=cfg.lr_cycle_decay, cycle_limit=cfg.lr_cycle_limit, k_decay=cfg.lr_k_decay,
        plateau_mode='min' if cfg.eval_metric == 'loss' else 'max')  # plateau: a lower loss is the better one


def _check_second_order(cfg: TrainConfig, rt: Runtime, optimizer: torch.optim.Optimizer) -> None:
    """A second-order optimizer (timm's AdaHessian differentiates the gradients again) where that cannot work: the
    float16 loss scaler (its graph is of the scaled loss, so the Hessian estimate comes out scaled by it and the
    steps shrink to nothing), DDP (its reducer does not support a kept graph) and torch.compile (AOT autograd has
    no double backward)."""
    if not getattr(optimizer, 'is_second_order', False):
        return
    if cfg.amp and rt.device.type == 'cuda' and cfg.amp_dtype != 'bfloat16':
        raise ConfigError(f'--opt {cfg.opt} differentiates the gradients again, which the float16 loss scaler '
                          f'distorts; use --amp-dtype bfloat16', '--amp-dtype')
    if rt.distributed:
        raise TrainSetupError(f'--opt {cfg.opt} differentiates the gradients again, which DistributedDataParallel '
                              f'does not support; train it in one process')
    if cfg.torchcompile:
        raise ConfigError(f'--opt {cfg.opt} differentiates the gradients again, which torch.compile cannot; '
                          f'train it without --torchcompile', '--torchcompile')


def _has_betas(opt: str) -> bool:
    """Whether timm's optimizer registry says ``opt`` takes betas (``lookahead_<name>`` as ``<name>``)."""
    from timm.optim import get_optimizer_info
    return bool(get_optimizer_info(opt.lower().split('_')[-1]).has_betas)


def _default_betas(opt: str) -> Optional[tuple]:
    """The betas ``opt`` has when none are given (None: it has none, or it cannot be made here)."""
    from timm.optim import create_optimizer_v2
    try:
        probe = create_optimizer_v2([nn.Parameter(torch.zeros(1))], opt=opt, lr=0.1)
    except Exception:  # (an optimizer that needs CUDA or a package this machine lacks: left to the real one)
        return None
    betas = probe.defaults.get('betas')
    return tuple(betas) if isinstance(betas, (list, tuple)) else None


def _kind(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return repr(value) if value is None else 'bool'
    if isinstance(value, (int, float)):
        return 'number'
    if isinstance(value, (list, tuple)):
        return 'sequence of ' + ', '.join(_kind(v) for v in value)
    return type(value).__name__


# optimizer state entries that hold one value per element of their parameter (SGD's momentum, Adam's moments,
# RMSprop's and Adagrad's sums...); others have shapes of their own (Adafactor's row and column statistics)
PER_ELEMENT_STATE = ('momentum_buffer', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'square_avg', 'grad_avg',
                     'acc_delta', 'sum', 'exp_inf')


def _check_optimizer_state(optimizer: torch.optim.Optimizer, fresh: List[Dict[str, Any]]) -> None:
    """A loaded optimizer state that the optimizer could step with: each setting of each group of the kind this
    run's optimizer made it (a number, a flag, ``None``...), and each per-element tensor
    (:data:`PER_ELEMENT_STATE`) of its parameter's shape (``load_state_dict`` checks neither, and the first step
    would fail deep in torch). ``ValueError`` naming what differs."""
    for i, (group, made) in enumerate(zip(optimizer.param_groups, fresh)):
        for key, value in made.items():
            # (a setting this torch leaves unset, None, may come back set by the torch that saved the state)
            if key in group and value is not None and _kind(group[key]) != _kind(value):
                raise ValueError(f'optimizer group {i} holds {key}={group[key]!r}, where this optimizer takes '
                                 f'a {_kind(value)} ({value!r})')
        for p in group['params']:
            for key, value in optimizer.state.get(p, {}).items():
                if key in PER_ELEMENT_STATE and isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ValueError(f'optimizer state {key!r} of a parameter of shape {list(p.shape)} has shape '
                                     f'{list(value.shape)}')


def _out_dir(cfg: TrainConfig) -> str:
    import timm
    if cfg.resume and not cfg.experiment:
        return os.path.dirname(os.path.abspath(cfg.resume))
    exp = cfg.experiment or '-'.join([datetime.now().strftime('%Y%m%d-%H%M%S'),
                                      timm.models.get_arch_name(cfg.arch).replace('/', '_'),
                                      'patchmix' if cfg.patchmix else 'base'])
    return os.path.join(cfg.output or os.path.join('.', 'output', 'train'), exp)


def _model_ema(cfg: TrainConfig, model: nn.Module, start: ResumePoint):
    """``--model-ema``: timm's ``ModelEmaV3`` of ``model`` (before any DDP or compile wrapper), holding a resumed
    state's average; ``None`` without the flag."""
    if not cfg.model_ema:
        return None
    from timm.utils import ModelEmaV3
    ema = ModelEmaV3(model, decay=cfg.model_ema_decay, use_warmup=cfg.model_ema_warmup)
    if start.ema_state is not None:
        try:
            ema.module.load_state_dict(start.ema_state)
        except (RuntimeError, ValueError, KeyError) as e:
            raise TrainSetupError(f'cannot resume from {cfg.resume}: its weight average does not fit the model of '
                                  f'this run: {e}') from None
    return ema


def _wrap(cfg: TrainConfig, model: nn.Module, rt: Runtime) -> nn.Module:
    """The module that trains: compiled with ``--torchcompile``, in DDP over several processes."""
    if cfg.torchcompile:
        model = torch.compile(model, backend=cfg.torchcompile)
    if rt.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[rt.device.index] if rt.device.type == 'cuda' else None,
                    find_unused_parameters=bool(cfg.no_patch_loss or cfg.no_image_loss))
    return model


def _check_out_dir(cfg: TrainConfig) -> None:
    """A run folder that cannot be made because a file stands where it or a folder above it would be, or that
    cannot be written in (the folder, or the nearest one above it that exists; on a resume without
    ``--experiment``, the state's folder): a :class:`TrainSetupError` naming it, before the data and the model are
    built."""
    from ..locking import folder_problem
    if cfg.resume and not cfg.experiment:  # the state's own folder goes on
        folder = os.path.dirname(os.path.abspath(cfg.resume))
        # (a missing state: named later)
        problem = folder_problem(folder, locked=True) if os.path.isdir(folder) else None
        if problem:
            raise TrainSetupError(f'cannot write in the run folder of --resume {cfg.resume}: {" ".join(problem)}; '
                                  f'give --experiment (and --output) to go on in another folder')
        return
    base = cfg.output or os.path.join('.', 'output', 'train')
    problem = folder_problem(os.path.join(base, cfg.experiment), locked=True) if cfg.experiment else \
        folder_problem(base)
    if problem:
        raise TrainSetupError(f'cannot make the run folder under --output {base}'
                              + (f' --experiment {cfg.experiment}' if cfg.experiment else '')
                              + f': {" ".join(problem)}; give another --output or --experiment')


def _train(cfg: TrainConfig, rt: Runtime, on_step, log_data_config: bool) -> TrainResult:
    _check_out_dir(cfg)
    cfg, data, model, model_kwargs, loaders, frozen = _setup(cfg, rt, log_data_config)
    per_epoch = updates_per_epoch(len(loaders.train), cfg.grad_accum_steps)  # optimizer updates in an epoch
    optimizer, scheduler, num_epochs = _optimization(cfg, model, per_epoch)
    _check_second_order(cfg, rt, optimizer)
    settings = dict(resume_settings(cfg.record()), **data_identity(data))
    start = load_resume(cfg, settings)
    if start.model_state is not None:
        try:
            model.load_state_dict(start.model_state)
            if start.optimizer_state is not None:
                fresh = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
                optimizer.load_state_dict(start.optimizer_state)
                _check_optimizer_state(optimizer, fresh)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # tensors or groups that do not fit this model
            raise TrainSetupError(f'cannot resume from {cfg.resume}: its saved state does not fit the model and '
                                  f'optimizer of this run: {e}') from None
        _say(rt, f'resuming from {cfg.resume} at epoch {start.start_epoch}')
        if start.start_epoch >= num_epochs:  # (its files are copied or kept as they are; nothing is trained)
            _say(rt, f'note: {cfg.resume} has trained {start.start_epoch} epochs, and this schedule has '
                     f'{num_epochs}: no epoch is left to train (give a larger --epochs to train on)')
    if start.start_epoch > 0:  # as timm's train.py: a per-update schedule at the resumed epoch's first update
        if cfg.sched_on_updates:
            scheduler.step_update(start.start_epoch * per_epoch)
        else:
            clean_scheduled_lr(scheduler, optimizer, start.scheduler_state)  # (--lr-noise on a plateau schedule)
            scheduler.step(start.start_epoch)
        load_scheduler_state(scheduler, start.scheduler_state)
    ema = _model_ema(cfg, model, start)
    evaluated = ema.module if ema is not None else model  # what each epoch evaluates and the weights files hold
    autocast, scaler = amp_setup(cfg, rt.device)
    if scaler is not None and start.scaler_state is not None:  # (a state of a run without it: a fresh scale)
        try:
            scaler.load_state_dict(start.scaler_state)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise TrainSetupError(f'cannot resume from {cfg.resume}: its loss scaler state does not load: {e}') \
                from None
    stepper = Stepper(_wrap(cfg, model, rt), optimizer, _criterion(cfg).to(rt.device), cfg, rt.device, scheduler,
                      loaders.mixer, autocast, scaler, start.updates, frozen, ema)
    args_pending = False
    meta = weights_meta(cfg, model_kwargs, data.class_names, data.holdout)  # of every weights file the run writes
    # one process writes a run folder at a time: a second run on it stops here, on every rank, before it writes
    with _hold_run_folder(_out_dir(cfg), rt, dated=not (cfg.experiment or cfg.resume)) as out_dir:
        if cfg.resume:
            _restore_weights_files(cfg, rt, out_dir, start, meta, needs_best=data.test is not None)
        if rt.primary:
            args_pending = write_start(out_dir, cfg, start.rows)
            n_params = sum(p.numel() for p in model.parameters())
            if cfg.linear_probe:
                n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
                _say(rt, f'--linear-probe: {n_train} of {n_params} parameters train, the rest of the model is frozen '
                         f'in eval mode')
            images = (f'{len(data.train)} train / {len(data.val)} held-out val ({cfg.holdout:g} of split '
                      f'{cfg.train_split!r}, seed {cfg.holdout_seed}) / {len(data.test)} test images'
                      if data.test is not None else f'{len(data.train)} train / {len(data.val)} val images')
            accum = f' x {cfg.grad_accum_steps} accumulated' if cfg.grad_accum_steps > 1 else ''
            for line in cfg.unused_settings():
                _say(rt, f'note: {line}')
            _say(rt, f'{cfg.model}: {n_params / 1e6:.2f}M params, {cfg.num_classes} classes, {images}, {num_epochs} '
                     f'epochs, batch {cfg.batch_size} x {rt.world_size}{accum}, lr {cfg.lr:g}, output {out_dir}')
        writer = _EpochWriter(cfg, rt, out_dir, model, optimizer, meta, settings, stepper,
                              args_pending=args_pending, checkpoints=list(start.checkpoints))
        rows, best = _epochs(cfg, rt, stepper, model, loaders, start, num_epochs, per_epoch, writer, on_step)
        test = None
        if loaders.test is not None:  # the test split, once: the final weights first
            test = {'final': _test_row(rows[-1]['epoch'] if rows else None,
                                       validate(evaluated, loaders.test, cfg, rt.device, stepper.autocast))}
        fgsm = _fgsm(cfg, evaluated, data, rt, out_dir) if cfg.fgsm and rt.primary else None
        if test is not None:
            test['best'] = _test_best(cfg, rt, evaluated, loaders, stepper, out_dir, best, test['final'])
        splits = data.splits(cfg)
        if test is not None and rt.primary:
            _write_results(out_dir, cfg, splits, test, best)
            _say(rt, f"test split {cfg.val_split!r} ({splits['test_images']} images): final top1 "
                     f"{test['final']['test_top1']:.2f}, best epoch ({test['best']['epoch']}) top1 "
                     f"{test['best']['test_top1']:.2f}")
        return _result(cfg, out_dir, rows, best, fgsm, test, splits)


def _restore_weights_files(cfg: TrainConfig, rt: Runtime, out_dir: str, start: ResumePoint, meta: Dict[str, Any],
                           needs_best: bool) -> None:
    """A resume's ``best``/``last`` files as its state names them (:func:`restore_weights_files`, on rank 0). Best
    weights that are nowhere to be had stop a ``--holdout`` run, which tests them at its end, on every rank before
    anything else is written; otherwise a note says so."""
    problems, failed = [], None
    if rt.primary:
        try:
            problems = restore_weights_files(out_dir, cfg.resume, start, meta, stop_if_lost=needs_best,
                                             prune=bool(cfg.checkpoint_hist))
        except OSError as e:  # (told to every rank, which would otherwise wait for rank 0 forever)
            failed = f'cannot resume from {cfg.resume}: restoring its weights files in {out_dir} failed: {e}'
    if rt.distributed:
        import torch.distributed as dist
        shared = [problems, failed]
        dist.broadcast_object_list(shared, src=0, device=rt.device if rt.device.type == 'cuda' else None)
        problems, failed = shared
    if failed:
        raise TrainSetupError(failed)
    for problem in problems:
        if needs_best:
            raise TrainSetupError(f'cannot resume from {cfg.resume}: {problem}; --holdout tests those weights at '
                                  f'the end: put them back, or resume in the folder that has them')
        _say(rt, f'note: {problem}; it will hold the next epoch that scores better')


def _new_dated_folder(out_dir: str) -> str:
    """A dated run name (no ``--experiment``) made unique as timm's ``get_outdir(inc=True)`` does: runs started in
    the same second (two seeds launched together, a script of short runs) get ``<name>-1``, ``<name>-2``... The
    folder is made here, exclusively, so two processes never choose the same one; a folder that cannot be made
    for another reason is left to :func:`~timm_patchmix.locking.hold_folder` to name."""
    for i in range(10000):
        candidate = out_dir if i == 0 else f'{out_dir}-{i}'
        try:
            os.makedirs(os.path.dirname(candidate) or '.', exist_ok=True)
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError:
            return candidate
    return out_dir


@contextmanager
def _hold_run_folder(out_dir: str, rt: Runtime, dated: bool = False) -> Iterator[str]:
    """Rank 0 holds the run folder for the block (see :func:`~timm_patchmix.locking.hold_folder`); under DDP every
    rank learns rank 0's folder (a dated name can differ between ranks by a second) and whether it got it, so that
    every rank stops with the same error when another run holds it. ``dated``: the name is the run's start time,
    made unique (:func:`_new_dated_folder`). Yields the folder."""
    with ExitStack() as stack:
        busy = None
        if rt.primary:
            if dated:
                out_dir = _new_dated_folder(out_dir)
            try:
                stack.enter_context(hold_folder(out_dir, 'training run', TrainSetupError))
            except TrainSetupError as e:
                busy = e
        if rt.distributed:
            import torch.distributed as dist
            shared = [out_dir, None if busy is None else str(busy)]
            dist.broadcast_object_list(shared, src=0, device=rt.device if rt.device.type == 'cuda' else None)
            out_dir, message = shared
            if busy is None and message is not None:
                raise TrainSetupError(message)
        if busy is not None:
            raise busy
        yield out_dir


def _test_row(epoch: Optional[int], ev: Dict[str, float]) -> Dict[str, Any]:
    return {'epoch': epoch, 'test_loss': round(ev['eval_loss'], 6), 'test_top1': round(ev['eval_top1'], 4),
            'test_top5': round(ev['eval_top5'], 4)}


def _test_best(cfg: TrainConfig, rt: Runtime, model: nn.Module, loaders: Loaders, stepper: Stepper, out_dir: str,
               best: Optional[Dict[str, Any]], final: Dict[str, Any]) -> Dict[str, Any]:
    """The test split's numbers for the weights of the best epoch: those of ``final`` when it is the last epoch,
    else ``best.safetensors`` evaluated (every process loads it once rank 0 has written it). The model keeps the
    best weights afterwards."""
    from ..checkpoint import load_weights
    if best is None or best['epoch'] == final['epoch']:
        return dict(final)
    if rt.distributed:
        import torch.distributed as dist
        dist.barrier()
    state, _ = load_weights(os.path.join(out_dir, 'best.safetensors'))
    model.load_state_dict(state)
    return _test_row(best['epoch'], validate(model, loaders.test, cfg, rt.device, stepper.autocast))


def _write_results(out_dir: str, cfg: TrainConfig, splits: Dict[str, Any], test: Dict[str, Dict[str, Any]],
                   best: Optional[Dict[str, Any]]) -> None:
    """``results.json``: which images selected the best epoch (the holdout) and the test split's numbers for the
    final and the best epoch's weights."""
    import json
    from ..checkpoint import atomic_write_text
    doc = {'selection': {'split': 'holdout', 'metric': cfg.eval_metric, 'best_epoch': best and best['epoch'],
                         'holdout': splits['holdout'], 'images': splits['val_images']},
           'test': {'split': cfg.val_split, 'images': splits['test_images'], 'final': test['final'],
                    'best': test['best']},
           'train_images': splits['train_images']}
    atomic_write_text(os.path.join(out_dir, 'results.json'), json.dumps(doc, indent=1) + '\n')


def _epochs(cfg, rt, stepper: Stepper, model, loaders: Loaders, start: ResumePoint, num_epochs: int,
            per_epoch: int, save, on_step) -> Tuple[List[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """Train and validate from ``start.start_epoch`` to ``num_epochs`` (``per_epoch`` optimizer updates each);
    ``save`` writes each epoch's files."""
    rows, best = list(start.rows), start.best
    metric_key = METRIC_KEYS[cfg.eval_metric]
    off = cfg.patchmix_off_epoch if cfg.patchmix else cfg.mixup_off_epoch
    for epoch in range(start.start_epoch, num_epochs):
        seed_all(epoch_seed(cfg.seed, rt.rank, epoch))
        loaders.generator.manual_seed(epoch_seed(cfg.seed, rt.rank, epoch))
        loaders.sampler.set_epoch(epoch)
        loaders.new_epoch()
        if loaders.mixing is not None and (cfg.patchmix or not cfg.patch_head) and off and epoch >= off:
            loaders.mixing.mixup_enabled = False
        # the updates before this epoch, as timm counts them: a resume with another -b or --grad-accum-steps
        # continues a per-update schedule (--sched-on-updates) where its epoch begins
        stepper.updates = epoch * per_epoch
        tr = train_one_epoch(stepper, loaders.train, epoch, rt, on_step)
        evaluated = stepper.ema.module if stepper.ema is not None else model
        if rt.distributed and cfg.dist_bn:  # every rank validates, and rank 0 saves, the same BatchNorm stats
            from timm.utils import distribute_bn
            distribute_bn(model, rt.world_size, reduce=cfg.dist_bn == 'reduce')
            if stepper.ema is not None:  # its stats average each rank's own
                distribute_bn(stepper.ema.module, rt.world_size, reduce=cfg.dist_bn == 'reduce')
        ev = validate(evaluated, loaders.val, cfg, rt.device, stepper.autocast)
        if not math.isfinite(ev['eval_loss']):  # (the same sum on every process) the last updates diverged
            raise NonFiniteLossError(epoch, len(loaders.train), len(loaders.train), ev['eval_loss'], evaluation=True)
        groups = stepper.optimizer.param_groups  # their mean, as timm's train.py logs it (--layer-decay varies it)
        lr = sum(g['lr'] for g in groups) / len(groups)
        stepper.scheduler.step(epoch + 1, ev[metric_key])
        row = {'epoch': epoch, 'train_loss': round(tr['train_loss'], 6), 'eval_loss': round(ev['eval_loss'], 6),
               'eval_top1': round(ev['eval_top1'], 4), 'eval_top5': round(ev['eval_top5'], 4), 'lr': lr,
               'img_s': round(tr['img_s'], 1)}
        rows.append(row)
        score = ev[metric_key]
        improved = improves(score, best, cfg.eval_metric)
        if improved:
            best = {'score': score, 'epoch': epoch, 'metric': cfg.eval_metric}
        save(epoch, row, improved, rows, best)
    return rows, best


@dataclass
class _EpochWriter:
    """Writes each finished epoch's files (on rank 0) and prints its line."""
    cfg: TrainConfig
    rt: Runtime
    out_dir: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    meta: Dict[str, Any]
    settings: Dict[str, Any]
    stepper: Stepper
    args_pending: bool = False  # a resume's args.yaml, written with its first saved epoch
    checkpoints: List[int] = field(default_factory=list)  # --checkpoint-hist: the epochs whose files are kept
    ended_cleared: bool = False  # an earlier run's end-of-run files are gone

    def __call__(self, epoch: int, row: Dict[str, Any], improved: bool, rows: List[Dict[str, Any]],
                 best: Dict[str, Any]) -> None:
        if not self.rt.primary:
            return
        cfg = self.cfg
        history = None
        if cfg.checkpoint_hist:
            history = checkpoint_history(rows, self.checkpoints, epoch, cfg.checkpoint_hist, cfg.eval_metric,
                                         lambda e: os.path.isfile(os.path.join(self.out_dir,
                                                                               CHECKPOINT_NAME.format(e))))
        save_epoch(self.out_dir, self.model, self.optimizer, dict(self.meta, epoch=epoch, metrics=row),
                   {'epoch': epoch, 'rows': rows, 'best': best, 'updates': self.stepper.updates,
                    'args': cfg.record(), 'seed': cfg.seed, 'settings': self.settings,
                    'scheduler': scheduler_state(self.stepper.scheduler), 'checkpoints': self.checkpoints,
                    **({'scaler': self.stepper.scaler.state_dict()} if self.stepper.scaler is not None else {})},
                   improved,
                   self.stepper.ema.module if self.stepper.ema is not None else None, history,
                   # results.json and fgsm.json describe the best and final weights of a run that ended in this
                   # folder (an earlier run, or the one this resumes); the weights change with this epoch's state,
                   # and this run writes its own at its end. Left, they would pass for this run's (the model card
                   # reads results.json)
                   clear=() if self.ended_cleared else ENDED_FILES)
        self.ended_cleared = True
        if history is not None:
            self.checkpoints = history[0]
        if self.args_pending:
            write_args(self.out_dir, cfg)
            self.args_pending = False
        print(f"epoch {epoch}: train_loss {row['train_loss']:.4f} eval_loss {row['eval_loss']:.4f} top1 "
              f"{row['eval_top1']:.2f} top5 {row['eval_top5']:.2f} lr {row['lr']:.4g} {row['img_s']:.0f} img/s",
              flush=True)


def _fgsm(cfg: TrainConfig, model, data: Datasets, rt: Runtime, out_dir: str) -> Dict[float, float]:
    """FGSM top-1 of the final weights for each ``--fgsm`` eps (and 0) on the validation set (the test split with
    ``--holdout``), written beside the run's files."""
    from ..data import pixel_transform
    from ..robustness import fgsm_accuracy, report
    dc = cfg.data_config
    images = data.test if data.test is not None else data.val
    transform, images.transform = images.transform, pixel_transform(*dc.input_size, dc.interpolation, dc.crop_pct)
    try:
        loader = torch.utils.data.DataLoader(images, batch_size=cfg.validation_batch_size or cfg.batch_size)
        from .loop import predictor
        res = fgsm_accuracy(predictor(model, cfg), loader, [0.0] + list(cfg.fgsm), dc.mean, dc.std, rt.device)
    finally:
        images.transform = transform  # the test loader evaluates the best epoch's weights after this
    report(res, out_dir)
    return res


def _result(cfg: TrainConfig, out_dir: str, rows, best, fgsm, test=None, splits=None) -> TrainResult:
    top1 = [float(r['eval_top1']) for r in rows]
    # the best epoch's top-1 (the weights in best.safetensors), which --eval-metric top5 or loss picks by another
    # number than top-1; the highest top-1 over the epochs where no epoch was chosen
    chosen = [float(r['eval_top1']) for r in rows if best is not None and r['epoch'] == best['epoch']]
    return TrainResult(cfg, out_dir, os.path.join(out_dir, 'best.safetensors'),
                       os.path.join(out_dir, 'last.safetensors'), os.path.join(out_dir, 'state.safetensors'),
                       os.path.join(out_dir, 'summary.csv'), tuple(rows), best, top1[-1] if top1 else None,
                       chosen[0] if chosen else (max(top1) if top1 else None), fgsm, test, splits)
