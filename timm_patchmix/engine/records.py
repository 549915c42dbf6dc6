"""What a run writes (``args.yaml``, ``summary.csv``, ``best``/``last``/``state.safetensors``) and reads back to
resume, with the settings a resume must share with the run that wrote its state."""
from __future__ import annotations

import csv
import io
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import yaml

from .config import TrainConfig
from .errors import TrainSetupError

__all__ = ['RESUME_SETTINGS', 'ROW_KEYS', 'CHECKPOINT_NAME', 'improves', 'resume_settings', 'data_identity', 'csv_text',
           'weights_meta', 'ResumePoint', 'load_resume', 'checkpoint_history', 'scheduler_state',
           'clean_scheduled_lr', 'load_scheduler_state', 'write_args', 'write_start', 'save_epoch']

# what a resumed run must share with the run that wrote its state: the data, the model's shape (channels, input
# size, --model-kwargs), the grid, how batches are mixed and scored, which parameters train, and the optimizer
# settings its saved state brings back (loading an optimizer's state restores its weight decay, momentum, betas and
# eps, whatever the flags say), and what chooses the best epoch: the metric and the images it is measured on (the
# saved best is a score of that metric on those images), and --seed and -j (the epochs' random draws come from the
# seed, per loader worker: another value gives a run that args.yaml, recording one, cannot redo). The schedule,
# --epochs, --lr..., --checkpoint-hist may change on a resume; --model and the class count come from the state's
# args.
RESUME_SETTINGS = ('opt', 'weight_decay', 'momentum', 'opt_eps', 'opt_betas', 'opt_kwargs', 'layer_decay',
                   'dataset', 'train_split', 'in_chans', 'img_size', 'input_size', 'mean', 'std', 'crop_pct',
                   'interpolation', 'model_kwargs', 'train_subset',
                   'holdout', 'holdout_seed', 'grid', 'patchmix', 'patchmix_mode', 'patchmix_collate',
                   'patchmix_alpha', 'patchmix_prob', 'patchmix_off_epoch', 'guided_prob', 'random_prob', 'mixup',
                   'cutmix', 'cutmix_minmax', 'mixup_prob', 'mixup_switch_prob', 'mixup_mode', 'mixup_off_epoch',
                   'no_prefetcher', 'device_data', 'smoothing', 'no_patch_loss', 'no_image_loss',
                   'patch_loss_weight', 'per_position_head', 'reset_head', 'linear_probe', 'model_ema', 'no_aug',
                   'scale', 'ratio', 'hflip', 'vflip', 'color_jitter', 'aa', 'reprob', 'remode', 'recount',
                   'train_interpolation', 'gp', 'bn_momentum', 'bn_eps', 'bce_loss', 'bce_sum', 'bce_target_thresh',
                   'bce_pos_weight', 'aug_repeats', 'eval_metric', 'val_split', 'val_subset', 'seed', 'workers')


# the dropout rates of --model-kwargs (those --drop, --drop-path and --drop-block set, and the attention models'):
# rates of layers without weights, which may change on a resume as those flags may, so --model-kwargs is compared
# without them
RATE_KWARGS = ('drop_rate', 'drop_path_rate', 'drop_block_rate', 'attn_drop_rate', 'proj_drop_rate', 'pos_drop_rate',
               'patch_drop_rate')


def _without_rates(value: Any) -> Any:
    return {k: v for k, v in value.items() if k not in RATE_KWARGS} if isinstance(value, dict) else value


def resume_settings(run_args: Dict[str, Any], table: bool = True) -> Dict[str, Any]:
    """The :data:`RESUME_SETTINGS` of ``run_args`` (a run's settings as a dict) under their flag names
    (``--model-kwargs`` without the :data:`RATE_KWARGS`); with ``table``, ``--patchmix-table`` as the table's content
    (a path alone cannot tell an edited table from the same one)."""
    out = {('--patchmix-grid' if k == 'grid' else '--' + k.replace('_', '-')): run_args[k]
           for k in RESUME_SETTINGS if k in run_args}
    if '--model-kwargs' in out:
        out['--model-kwargs'] = _without_rates(out['--model-kwargs'])
    if '--holdout' in out and not out['--holdout']:
        out['--holdout-seed'] = None  # no holdout: its seed means nothing
    if table:
        from ..settings import file_record
        path = run_args.get('patchmix_table')
        out['--patchmix-table'] = file_record(path) if path else None
    return out


# the data's own record in a state's settings (not a flag: the data may move, --data-dir with it)
DATA_CLASSES, DATA_IMAGES = 'the data: class names', 'the data: images in its splits (train, val, test)'


def data_identity(data) -> Dict[str, Any]:
    """What a resume checks of the data itself, beside the flags that choose it: the class names and the number of
    images in each whole split, before any ``--*-subset`` (of a :class:`~timm_patchmix.engine.loaders.Datasets`;
    the test split is ``--val-split`` under ``--holdout``, else 0). A folder that moved (another ``--data-dir``)
    resumes; another dataset, or one with classes or images added or removed, is refused."""
    def whole(split) -> int:
        return 0 if split is None else len(getattr(split, 'base', split))
    return {DATA_CLASSES: list(data.class_names), DATA_IMAGES: [whole(data.train), whole(data.val), whole(data.test)]}


def csv_text(rows: List[Dict[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator='\n')
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


def weights_meta(cfg: TrainConfig, model_kwargs: Dict[str, Any], class_names: List[str],
                 holdout: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The metadata of ``best``/``last.safetensors`` for a resolved ``cfg`` (the epoch and metrics are added per
    epoch). ``data.holdout`` is the holdout's record (:meth:`~timm_patchmix.holdout.Holdout.record`) when the epochs
    were evaluated on held-out training images; ``data.val_split`` is then the test split."""
    import timm
    from ..settings import file_record
    dc = cfg.data_config
    return {
        'model': timm.models.get_arch_name(cfg.arch), 'num_classes': cfg.num_classes, 'model_kwargs': model_kwargs,
        'class_names': list(class_names),
        'data': {'dataset': cfg.dataset, 'data_dir': cfg.data_dir, 'train_split': cfg.train_split,
                 'val_split': cfg.val_split, 'holdout': holdout,
                 'input_size': list(dc.input_size), 'mean': list(dc.mean), 'std': list(dc.std),
                 'interpolation': dc.interpolation, 'crop_pct': dc.crop_pct},
        # (the table's path made absolute: a relative one named a file in the working folder of a later reader)
        'patchmix': {'enabled': cfg.patchmix, 'grid': list(cfg.grid),
                     'table': os.path.abspath(cfg.patchmix_table) if cfg.patchmix_table else None,
                     'image_loss': not cfg.no_image_loss,
                     # whether the patch head trained (--no-patch-loss, or a weight of 0, leaves it untrained)
                     'patch_loss': not cfg.no_patch_loss and cfg.patch_loss_weight > 0,
                     # the table's content, which still names it where its path has moved
                     **({'table_sha256': file_record(cfg.patchmix_table)['sha256']} if cfg.patchmix_table else {})}
        if cfg.patch_head or cfg.patchmix else None,
        'command': cfg.command or None,
        **({'model_ema': {'decay': cfg.model_ema_decay, 'warmup': cfg.model_ema_warmup}} if cfg.model_ema else {}),
    }


@dataclass
class ResumePoint:
    """Where a run starts: epoch 0 with nothing, or the epoch after a saved state's, with its rows, best score,
    update count, weights and optimizer state."""
    start_epoch: int = 0
    rows: List[Dict[str, Any]] = field(default_factory=list)
    best: Optional[Dict[str, Any]] = None
    updates: int = 0
    model_state: Optional[Dict[str, torch.Tensor]] = None
    optimizer_state: Optional[Dict[str, Any]] = None
    scheduler_state: Optional[Dict[str, Any]] = None
    ema_state: Optional[Dict[str, torch.Tensor]] = None  # --model-ema's weights
    checkpoints: List[int] = field(default_factory=list)  # --checkpoint-hist: the epochs whose files it kept
    scaler_state: Optional[Dict[str, Any]] = None  # the float16 loss scaler's (--amp on CUDA), as timm saves it


_DEFAULTS = TrainConfig().record()

# the prefix of --model-ema's weights among a training state's extra tensors
EMA_PREFIX = 'ema.'

# the columns of summary.csv, one row per epoch
ROW_KEYS = ('epoch', 'train_loss', 'eval_loss', 'eval_top1', 'eval_top5', 'lr', 'img_s')
# the weights of an epoch that --checkpoint-hist keeps, beside best and last
CHECKPOINT_NAME = 'checkpoint-{}.safetensors'
_HISTORY_FILE = re.compile(r'checkpoint-(0|[1-9][0-9]*)\.safetensors\Z', re.ASCII)  # CHECKPOINT_NAME's files


def _rank_key(score: float, metric: str) -> Tuple[bool, float]:
    """A sort key, best first: higher scores first but for the loss; a score that is not a finite number (an
    evaluation loss that overflowed) after every finite one."""
    finite = math.isfinite(score)
    return (not finite, (score if metric == 'loss' else -score) if finite else 0.0)


def improves(score: float, best: Optional[Dict[str, Any]], metric: str) -> bool:
    """Whether an epoch of evaluation ``score`` becomes the best epoch after ``best`` (None before the first):
    strictly better by ``metric`` (lower for the loss), as timm's ``CheckpointSaver`` has it; a non-finite score
    ranks below every finite one, so an evaluation loss of NaN neither beats a number nor stays best after one."""
    return best is None or _rank_key(score, metric) < _rank_key(best['score'], metric)


def checkpoint_history(rows: List[Dict[str, Any]], kept: List[int], epoch: int, n: int, metric: str,
                       exists=lambda e: True) -> Tuple[List[int], List[int]]:
    """timm's checkpoint history (``--checkpoint-hist n``) once ``epoch`` is done: the epochs whose weights files
    to keep, best first, and those of ``kept`` (the history after the epoch before) to remove. Epochs rank by
    ``metric`` as ``rows`` (summary.csv) give it, higher first but for the loss; of equal scores the earlier epoch
    ranks first, so a new epoch displaces the worst kept one only when it is strictly better, as in timm's
    ``CheckpointSaver`` (a non-finite score ranks last, see :func:`improves`). An epoch of ``kept`` whose file
    ``exists`` no longer (removed by hand, or by a version that removed files before saving the state) drops out."""
    if n == 0:
        return [], []
    column = f'eval_{metric}'
    candidates = [e for e in kept if e < epoch and exists(e)] + [epoch]
    order = sorted(candidates, key=lambda e: (_rank_key(rows[e][column], metric), e))
    return order[:n], [e for e in order[n:] if e != epoch]


def _older_settings(saved: Dict[str, Any]) -> Dict[str, Any]:
    """The :data:`RESUME_SETTINGS` that the args of an older version's state lack, as that version trained: the
    defaults, but for ``train_interpolation``, which before its flag was the model's interpolation on inputs that
    take timm's transform (other than a square of at most 64 px)."""
    fill = {k: _DEFAULTS[k] for k in RESUME_SETTINGS if k not in saved}
    data = saved.get('data_config')
    if 'train_interpolation' in fill and isinstance(data, dict):
        size = data.get('input_size')
        if isinstance(size, (list, tuple)) and len(size) == 3 and not (size[1] == size[2] and size[1] <= 64):
            fill['train_interpolation'] = data.get('interpolation')
    return fill


def load_resume(cfg: TrainConfig, settings: Dict[str, Any]) -> ResumePoint:
    """The state ``cfg.resume`` names, after checking that it was trained with this model, class count and
    ``settings`` (:class:`~timm_patchmix.settings.SettingsChangedError` naming each difference otherwise)."""
    from ..checkpoint import CheckpointError, load_state
    from ..settings import check_settings
    if not cfg.resume:
        return ResumePoint()
    try:
        st = load_state(cfg.resume)
    except CheckpointError as e:
        raise TrainSetupError(f'cannot resume: {e}') from None
    saved = st['meta'].get('args', {})
    if isinstance(saved, dict) and saved:  # a setting its version did not have: that version's only behaviour
        saved = dict(_older_settings(saved), **saved)
    # a state from before settings were recorded: its args, without the table's content
    recorded = st['meta'].get('settings') or resume_settings(saved, table=False)
    if isinstance(recorded, dict) and isinstance(saved, dict):  # settings a state of an older version did not list
        recorded = dict(resume_settings(saved, table=False), **recorded)
    if isinstance(recorded, dict):  # the model and class count, compared and named with the other settings
        recorded, settings = dict(recorded), dict(settings)
        if '--model-kwargs' in recorded:  # a state of a version that compared the rates too
            recorded['--model-kwargs'] = _without_rates(recorded['--model-kwargs'])
        for key, flag, have in (('model', '--model', cfg.model), ('num_classes', '--num-classes', cfg.num_classes)):
            if saved.get(key) is not None:
                recorded[flag], settings[flag] = saved[key], have
    check_settings(recorded, settings,
                   f'cannot resume from {cfg.resume}: it was trained',
                   'Resume with the settings it was trained with, or train the new settings afresh (without '
                   '--resume) under another --output/--experiment.')
    meta = st['meta']
    rows = list(meta.get('rows', []))
    for k, row in enumerate(rows):
        if set(row) != set(ROW_KEYS):
            raise TrainSetupError(f'cannot resume: {cfg.resume}: rows[{k}] has the columns {sorted(row)}, not those '
                                  f'of summary.csv ({", ".join(ROW_KEYS)})')
    sched = meta.get('scheduler')
    if sched is not None and not (isinstance(sched, dict) and all(
            isinstance(sched.get(k), (int, float)) and not isinstance(sched.get(k), bool) for k in SCHEDULER_KEYS)):
        raise TrainSetupError(f'cannot resume: {cfg.resume}: scheduler must hold the numbers '
                              f'{", ".join(SCHEDULER_KEYS)}, got {sched!r}')
    clean = (sched or {}).get('restore_lr')
    if clean is not None and not (isinstance(clean, list) and clean and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in clean)):
        raise TrainSetupError(f'cannot resume: {cfg.resume}: scheduler restore_lr must be null or a list of '
                              f'learning rates, got {clean!r}')
    scaler = meta.get('scaler')
    if scaler is not None and not (isinstance(scaler, dict) and scaler and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in scaler.values())):
        raise TrainSetupError(f'cannot resume: {cfg.resume}: scaler must hold the loss scaler\'s numbers, got '
                              f'{scaler!r}')
    ema = {k[len(EMA_PREFIX):]: v for k, v in st['extra'].items() if k.startswith(EMA_PREFIX)}
    if cfg.model_ema and not ema:
        raise TrainSetupError(f'cannot resume from {cfg.resume} with --model-ema: it holds no weight average (it '
                              f'was trained without --model-ema)')
    return ResumePoint(int(meta['epoch']) + 1, rows, meta.get('best'), int(meta.get('updates', 0)), st['model'],
                       st['optimizer'], sched, ema or None, list(meta.get('checkpoints') or []), scaler)


# what a plateau schedule counts between epochs (torch's ReduceLROnPlateau inside timm's PlateauLRScheduler), saved
# with the state so that a resumed run drops its rate at the epoch the uninterrupted run does
SCHEDULER_KEYS = ('best', 'num_bad_epochs', 'cooldown_counter', 'last_epoch')


def scheduler_state(scheduler) -> Optional[Dict[str, Any]]:
    """The counters of a plateau schedule (``None`` for schedules that are a function of the epoch alone), and
    ``restore_lr``: the rates before ``--lr-noise`` (timm's ``PlateauLRScheduler`` adds the noise to the
    optimizer's rates and keeps the clean ones there; the optimizer's state holds the noisy ones)."""
    inner = getattr(scheduler, 'lr_scheduler', None)
    if not isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    state = {k: getattr(inner, k) for k in SCHEDULER_KEYS}
    clean = getattr(scheduler, 'restore_lr', None)
    state['restore_lr'] = None if clean is None else [float(v) for v in clean]
    return state


def clean_scheduled_lr(scheduler, optimizer, state: Optional[Dict[str, Any]]) -> None:
    """Before a resumed plateau schedule steps to its first epoch: the optimizer's rates back to those before the
    noise of the epoch the state was saved for, so that the step adds that epoch's noise to them once, as the
    uninterrupted run did (on the restored noisy rates it added the noise a second time)."""
    clean = (state or {}).get('restore_lr')
    inner = getattr(scheduler, 'lr_scheduler', None)
    if clean is None or not isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return
    if len(clean) != len(optimizer.param_groups):
        raise TrainSetupError(f'cannot resume: the saved schedule holds {len(clean)} learning rates for '
                              f'{len(optimizer.param_groups)} parameter groups')
    for group, lr in zip(optimizer.param_groups, clean):
        group['lr'] = lr


def load_scheduler_state(scheduler, state: Optional[Dict[str, Any]]) -> None:
    inner = getattr(scheduler, 'lr_scheduler', None)
    if state is not None and isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau):
        for k in SCHEDULER_KEYS:
            setattr(inner, k, state[k])


# the files a run writes when it ends, of its best and final weights
ENDED_FILES = ('results.json', 'fgsm.json')


def write_args(out_dir: str, cfg: TrainConfig) -> None:
    """``args.yaml``: the resolved settings of the run whose files the folder holds."""
    from ..checkpoint import atomic_write_text
    atomic_write_text(os.path.join(out_dir, 'args.yaml'), yaml.safe_dump(cfg.record(), sort_keys=False))


def write_start(out_dir: str, cfg: TrainConfig, rows: List[Dict[str, Any]]) -> bool:
    """``args.yaml`` (the resolved settings), and ``summary.csv`` when resuming with rows. A run into a folder that
    already has an ``args.yaml`` (a resume, or a rerun over an earlier run's files) keeps it until its first epoch
    is saved (``write_args``), so a run that fails before then leaves the record of the files already there;
    returns whether ``args.yaml`` is still to write."""
    from ..checkpoint import atomic_write_text
    os.makedirs(out_dir, exist_ok=True)
    pending = os.path.isfile(os.path.join(out_dir, 'args.yaml'))
    if not pending:
        write_args(out_dir, cfg)
    if rows:
        atomic_write_text(os.path.join(out_dir, 'summary.csv'), csv_text(rows))
    return pending


def save_epoch(out_dir: str, model: torch.nn.Module, optimizer, meta: Dict[str, Any], state_meta: Dict[str, Any],
               improved: bool, ema: Optional[torch.nn.Module] = None,
               history: Optional[Tuple[List[int], List[int]]] = None, clear: Sequence[str] = ()) -> None:
    """An epoch's files, each written atomically: ``state.safetensors`` (to resume from) first, then
    ``best.safetensors`` when it improved and ``last.safetensors`` (a resume restores them from the state, see
    :func:`restore_weights_files`), and ``summary.csv`` (``state_meta['rows']``). With ``ema`` (``--model-ema``'s
    averaged model), the weights files hold its weights, the ones evaluated, and the state holds both.

    Nothing in the folder changes before the state is written, so a save that fails there (a full disk) or a run
    stopped before it leaves every file as it was, an earlier run's in the folder included. After it, ``clear``
    (names of files that describe the weights of a run that ended in the folder) are removed.

    ``history``: ``--checkpoint-hist``'s epochs to keep and to remove (:func:`checkpoint_history`). After the state
    that lists the kept epochs, the epoch's ``checkpoint-<epoch>.safetensors`` (last's content) is written when
    kept, else a file of that name is removed, and then the history files the state does not list (displaced
    epochs, and those of an earlier run in the folder or of a stopped run's epoch redone): with the flag, the
    folder's history files are the state's. A run stopped before its epoch's file is written resumes with it
    written from the state, and one stopped before the removals with them done (:func:`restore_weights_files`).
    Without the flag, the state lists ``state_meta['checkpoints']`` as given (a resume without
    ``--checkpoint-hist`` carries the kept epochs on, touching none of their files)."""
    from ..checkpoint import atomic_write_text, save_state, save_weights
    sd = model.state_dict()
    weights = ema.state_dict() if ema is not None else sd
    if history is not None:
        state_meta = dict(state_meta, checkpoints=list(history[0]))
    extra = {EMA_PREFIX + k: v for k, v in weights.items()} if ema is not None else None
    save_state(os.path.join(out_dir, 'state.safetensors'), sd, optimizer, state_meta, extra)
    for name in clear:
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    if history is not None:
        own = os.path.join(out_dir, CHECKPOINT_NAME.format(meta['epoch']))
        if meta['epoch'] in history[0]:
            save_weights(own, weights, meta)
        prune_history(out_dir, history[0])
    # best and last after the state that names their epoch: a run stopped before them left files the state can
    # restore (restore_weights_files), never a best.safetensors of an epoch its state does not know
    if improved:
        save_weights(os.path.join(out_dir, 'best.safetensors'), weights, meta)
    save_weights(os.path.join(out_dir, 'last.safetensors'), weights, meta)
    atomic_write_text(os.path.join(out_dir, 'summary.csv'), csv_text(state_meta['rows']))


def prune_history(out_dir: str, keep: Sequence[int]) -> None:
    """Remove the ``checkpoint-<epoch>.safetensors`` files of ``out_dir`` whose epoch is not in ``keep``."""
    for m in map(_HISTORY_FILE.match, sorted(os.listdir(out_dir))):
        if m and int(m.group(1)) not in keep:
            path = os.path.join(out_dir, m.group(0))
            if os.path.isfile(path):
                os.remove(path)


def _epoch_of(path: str) -> Optional[int]:
    """The epoch a weights file's metadata names (None: no file, or none readable)."""
    return _record_of(path)[0]


def _record_of(path: str) -> Tuple[Optional[int], Optional[Dict[str, Any]]]:
    """``(epoch, metrics)`` of a weights file's metadata: the epoch and its summary row (Nones where unreadable)."""
    from ..checkpoint import CheckpointError, read_meta
    try:
        meta = read_meta(path)
    except CheckpointError:  # missing, truncated or not safetensors: not the epoch's file either way
        return None, None
    epoch = meta.get('epoch')
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        return None, None
    return epoch, meta.get('metrics') if isinstance(meta.get('metrics'), dict) else None


def restore_weights_files(out_dir: str, resume: str, start: ResumePoint, meta: Dict[str, Any],
                          stop_if_lost: bool = False, prune: bool = False) -> List[str]:
    """Before a resumed run trains: ``last.safetensors`` and ``best.safetensors`` in ``out_dir`` hold the epochs
    the state names. Those of the state's own epoch are written from the state's weights (``meta``: the run's
    weights metadata), as is its ``--checkpoint-hist`` file when the state keeps one; a best epoch before it is
    kept where the file's record (its epoch and summary row) is that epoch's, else copied from the state's folder
    when its file is (a resume under another ``--experiment``), as are the other kept ``--checkpoint-hist`` files
    and the state file itself. So a run stopped between its state and its weights files, or another run's files in
    the folder, never pass for this run's. With ``prune`` (a resume with ``--checkpoint-hist``), the history files
    the state does not list are removed, as a saved epoch removes them (:func:`save_epoch`). Returns what cannot be
    restored (the best epoch's weights, in neither folder), decided before anything is written: with
    ``stop_if_lost`` nothing is then written at all."""
    from ..checkpoint import atomic_copy, save_weights
    # the run's own folder however it is spelt (a link in the path resolved; the state file itself is not followed)
    source = os.path.realpath(os.path.dirname(os.path.abspath(resume)))
    same = os.path.realpath(out_dir) == source
    epoch = start.start_epoch - 1
    weights = start.ema_state if start.ema_state is not None else start.model_state

    def row(e: int) -> Optional[Dict[str, Any]]:
        return start.rows[e] if 0 <= e < len(start.rows) else None

    def holds(folder: str, name: str, e: int) -> bool:
        # (a state or file without the summary row, from an early version, is matched by its epoch alone)
        held, metrics = _record_of(os.path.join(folder, name))
        return held == e and (metrics is None or row(e) is None or metrics == row(e))

    own = dict(meta, epoch=epoch, metrics=row(epoch)) if row(epoch) is not None else dict(meta, epoch=epoch)
    wanted = [('last.safetensors', epoch)]
    if start.best is not None:
        wanted.append(('best.safetensors', start.best['epoch']))
    history = [(CHECKPOINT_NAME.format(e), e) for e in start.checkpoints]
    # (in place, a history file of the state's epoch is written only where missing or another's: without
    # --checkpoint-hist a resume touches none that its run wrote)
    wanted += [(name, e) for name, e in history if not same or (e == epoch and not holds(out_dir, name, e))]
    plan, lost = [], []
    for name, e in wanted:
        if e == epoch and weights is not None:
            plan.append((name, 'write'))
        elif holds(out_dir, name, e):
            continue
        elif not same and holds(source, name, e):
            plan.append((name, 'copy'))
        elif name == 'best.safetensors':
            path = os.path.join(out_dir, name)
            held = _epoch_of(path)
            found = f'holds other weights (epoch {held})' if held is not None else 'is missing or unreadable'
            lost.append(f'{path} should hold epoch {e}, the best epoch the state records, and {found}'
                        f'{"" if same else " (as in " + source + ")"}')
    if lost and stop_if_lost:
        return lost
    if not same:
        # the folder's records of another run (its settings, its end-of-run numbers, its --checkpoint-hist files)
        # would pass for this one's beside the state and weights copied in: removed, and args.yaml written anew
        # (write_start)
        for name in ENDED_FILES + ('args.yaml',):
            path = os.path.join(out_dir, name)
            if os.path.isfile(path):
                os.remove(path)
        prune_history(out_dir, start.checkpoints)  # (that run's checkpoint-<epoch> files; the state's come next)
    for name, how in plan:
        if how == 'write':
            save_weights(os.path.join(out_dir, name), weights, own)
        else:
            atomic_copy(os.path.join(source, name), os.path.join(out_dir, name))
    if not same:  # the state itself, last, so that the new folder resumes once it holds every file the state names
        # (a finished run's saves no epoch there; a kill before this leaves the resume to be run again from there)
        atomic_copy(resume, os.path.join(out_dir, 'state.safetensors'))
    if prune:
        prune_history(out_dir, start.checkpoints)
    return lost
