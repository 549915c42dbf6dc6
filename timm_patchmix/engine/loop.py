"""One optimizer step, one training epoch and one validation pass."""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import TrainConfig
from .errors import NonFiniteLossError
from .runtime import Runtime, reduce_sum

__all__ = ['StepEvent', 'Stepper', 'amp_setup', 'clip_parameters', 'train_step', 'accumulation', 'updates_per_epoch',
           'train_one_epoch', 'validate', 'PatchVote', 'predictor']


@dataclass(frozen=True)
class StepEvent:
    """What ``on_step`` hears after each training batch: the epoch, the step (batch) in it (1-based) of ``steps``,
    the run's optimizer-update count (continued across a resume; with ``--grad-accum-steps N`` it grows at the last
    batch of each group of N) and the batch's loss."""
    epoch: int
    step: int
    steps: int
    updates: int
    loss: float


@dataclass
class Stepper:
    """What a training step uses. ``model`` is the module that trains (DDP- or compile-wrapped); ``scaler`` is
    ``timm.utils.NativeScaler`` under float16 CUDA autocast, else ``None``; ``updates`` counts optimizer steps;
    ``frozen`` are the modules ``--linear-probe`` keeps in eval mode while the model trains."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    cfg: TrainConfig
    device: torch.device
    scheduler: Any = None
    mixer: Optional[Callable] = None
    autocast: Callable = nullcontext
    scaler: Any = None
    updates: int = 0
    frozen: Tuple[nn.Module, ...] = ()
    ema: Any = None  # --model-ema: timm's ModelEmaV3 of the unwrapped model, updated after each optimizer update

    def train_mode(self) -> None:
        """The model in training mode, except the frozen modules, which stay in eval mode."""
        self.model.train()
        for m in self.frozen:
            m.eval()


def amp_setup(cfg: TrainConfig, device: torch.device):
    """``(autocast factory, scaler)``: with ``--amp``, autocast in ``--amp-dtype`` (bfloat16 off CUDA) and timm's
    NativeScaler for float16; without, no autocast and no scaler."""
    if not cfg.amp:
        return nullcontext, None
    from timm.utils import NativeScaler
    dtype = torch.bfloat16 if cfg.amp_dtype == 'bfloat16' or device.type != 'cuda' else torch.float16
    scaler = NativeScaler(device.type) if dtype == torch.float16 else None
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler


def clip_parameters(model: nn.Module, mode: str) -> List[nn.Parameter]:
    """The parameters ``--clip-grad`` clips: all of them, except under ``agc``, where the classifier heads the
    model's pretrained cfg names are left out (as in the NFNet recipe and timm's train.py)."""
    from timm.utils import unwrap_model
    params = list(model.parameters())
    if mode != 'agc':
        return params
    inner = unwrap_model(model)
    heads = (getattr(inner, 'pretrained_cfg', None) or {}).get('classifier') or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    keep = [p for n, p in inner.named_parameters() if not any(n == h or n.startswith(h + '.') for h in heads)]
    if not heads or len(keep) == len(params):
        from timm.models import model_parameters
        return list(model_parameters(inner, exclude_head=True))
    return keep


def train_step(s: Stepper, x: torch.Tensor, target: torch.Tensor, *, accum: int = 1, first: bool = True,
               update: bool = True) -> float:
    """One batch: move it to the device, mix it (``s.mixer``), forward, loss and backward; with ``update``, then clip
    (``timm.utils.dispatch_clip_grad``) and step the optimizer. Under gradient accumulation the batch is one of
    ``accum`` whose gradients add up to an update, as in timm's train.py: the loss is divided by ``accum`` before
    its backward, the gradients are cleared before the backward of the group's ``first`` batch (and kept after the
    update, as without accumulation), ``update`` is true for the group's last batch alone, and the others run
    under DDP's ``no_sync`` (their gradients reduce with the last one's). Returns the batch's loss, undivided (not
    checked for finiteness here)."""
    from timm.utils import dispatch_clip_grad
    cfg = s.cfg
    if not isinstance(x, torch.Tensor) or x.device != s.device:
        x, target = x.to(s.device), target.to(s.device)
    if s.mixer is not None:
        x, target = s.mixer(x, target)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    no_sync = getattr(s.model, 'no_sync', None)  # DDP's: no gradient reduction before the group's last batch
    with nullcontext() if update or no_sync is None else no_sync():
        with s.autocast():
            loss = s.criterion(s.model(x), target)
        part = loss / accum if accum > 1 else loss
        if first:
            s.optimizer.zero_grad(set_to_none=True)
        clip = cfg.clip_grad or None
        params = clip_parameters(s.model, cfg.clip_mode) if clip and update else None
        # a second-order optimizer (timm's AdaHessian) differentiates the gradients again: their graph is kept
        second_order = bool(getattr(s.optimizer, 'is_second_order', False))
        if s.scaler is not None:
            s.scaler(part, s.optimizer, clip_grad=clip, clip_mode=cfg.clip_mode, parameters=params,
                     create_graph=second_order, need_update=update)
        else:
            part.backward(create_graph=second_order)
            if update:
                if clip:
                    dispatch_clip_grad(params, clip, mode=cfg.clip_mode)
                s.optimizer.step()
    if update:
        s.updates += 1
        if s.ema is not None:  # timm's order: after the update, with the update count
            from timm.utils import unwrap_model
            s.ema.update(unwrap_model(s.model), step=s.updates)
        if cfg.sched_on_updates and s.scheduler is not None:
            s.scheduler.step_update(num_updates=s.updates)
    return float(loss.detach())  # the step's one host sync


def accumulation(steps: int, accum: int) -> List[Tuple[int, bool, bool]]:
    """``(accum, first, update)`` for each of an epoch's ``steps`` batches under ``--grad-accum-steps accum``
    (:func:`train_step`'s arguments): groups of ``accum`` batches, each ending in an update; a last group of fewer
    batches (``steps`` not a multiple of ``accum``) divides its loss by its own size and updates at the epoch's last
    batch, as timm's train.py does."""
    out = []
    for i in range(steps):
        start = i - i % accum
        size = min(accum, steps - start)
        out.append((size, i == start, i == start + size - 1))
    return out


def updates_per_epoch(steps: int, accum: int) -> int:
    """The optimizer updates of an epoch of ``steps`` batches: one per group of ``accum`` batches."""
    return -(-steps // accum)


def _check_finite(loss: float, epoch: int, step: int, steps: int, rt: Runtime) -> None:
    bad_ranks = 0 if math.isfinite(loss) else 1
    if dist.is_initialized():  # every rank stops at the same step, whichever rank's loss it was
        bad_ranks = int(reduce_sum([bad_ranks], rt.device)[0])
    if bad_ranks:  # stop before this epoch's weights reach any file
        raise NonFiniteLossError(epoch, step, steps, loss, bad_ranks, rt.world_size)


def train_one_epoch(s: Stepper, loader: Iterable, epoch: int, rt: Runtime,
                    on_step: Optional[Callable[[StepEvent], None]] = None) -> Dict[str, float]:
    """Train one epoch; ``{'train_loss', 'img_s'}`` summed over the processes. ``on_step`` is called after every
    step with a :class:`StepEvent`. A non-finite loss raises :class:`NonFiniteLossError` on every rank."""
    from timm.utils import AverageMeter
    from tqdm import tqdm
    cfg = s.cfg
    s.train_mode()
    losses = AverageMeter()
    steps = len(loader)
    t0 = time.perf_counter()
    bar = tqdm(loader, desc=f'train {epoch}', disable=not rt.primary or cfg.no_progress, leave=False, unit='batch',
               dynamic_ncols=True)
    groups = accumulation(steps, cfg.grad_accum_steps)
    for i, (x, target) in enumerate(bar):
        accum, first, update = groups[i]
        if cfg.no_progress and rt.primary:  # (the lr this update trains at, for the log line)
            lr = sum(g['lr'] for g in s.optimizer.param_groups) / len(s.optimizer.param_groups)
        loss = train_step(s, x, target, accum=accum, first=first, update=update)
        _check_finite(loss, epoch, i + 1, steps, rt)
        losses.update(loss, x.shape[0])
        # as timm's train.py: a line at every --log-interval-th optimizer update of the epoch and at its last batch,
        # with the loss so far over every process (the same batches on each: each joins the reduction) and the
        # update's lr, the mean over the groups (with the progress bar, the bar shows the rest)
        index = i // cfg.grad_accum_steps  # (the update this batch belongs to)
        line = cfg.no_progress and ((update and index % cfg.log_interval == 0) or i == steps - 1)
        if line and dist.is_initialized():
            total, n = reduce_sum([losses.sum, losses.count], s.device)
            mean = total / max(n, 1)
        else:
            mean = losses.avg
        if rt.primary:
            rate = losses.count * rt.world_size / (time.perf_counter() - t0)
            bar.set_postfix(loss=f'{losses.avg:.4f}', img_s=f'{rate:.0f}')
            if line:
                print(f'train {epoch} [{i + 1}/{steps}] loss {mean:.4f} lr {lr:.3e} {rate:.0f} img/s', flush=True)
        if on_step is not None:
            from ..checkpoint import kept_rng_state
            with kept_rng_state():  # what the callback draws does not shift the run's streams
                on_step(StepEvent(epoch, i + 1, steps, s.updates, loss))
    if s.device.type == 'cuda':
        torch.cuda.synchronize(s.device)
    elapsed = time.perf_counter() - t0
    total_loss, total_n = reduce_sum([losses.sum, losses.count], s.device)
    return {'train_loss': total_loss / max(total_n, 1), 'img_s': total_n / max(elapsed, 1e-9)}


class PatchVote(nn.Module):
    """A ``patchhead_`` model's patch head as an image classifier: the mean of its patch logits over the cells. The
    prediction of a model trained with the patch loss alone (``--no-image-loss``), whose image classifier never
    trained."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from timm.utils import unwrap_model
        return unwrap_model(self.model).forward_patches(x).mean(1)


def predictor(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """What evaluates ``model`` as ``cfg`` trained it: :class:`PatchVote` for a ``patchhead_`` model trained
    without the image loss, else the model itself."""
    return PatchVote(model) if cfg.patch_head and cfg.no_image_loss else model


@torch.no_grad()
def validate(model: nn.Module, loader: Iterable, cfg: TrainConfig, device: torch.device,
             autocast: Callable = nullcontext) -> Dict[str, float]:
    """Loss, top-1 and top-5 (``timm.utils.accuracy``; top-k for fewer than 5 classes) over the validation set,
    each image counted once over all processes. A model trained without the image loss is evaluated by its patch
    head (:func:`predictor`)."""
    from timm.utils import AverageMeter, accuracy
    model.eval()
    net = predictor(model, cfg)
    k5 = min(5, cfg.num_classes)
    losses, correct1, correct5 = AverageMeter(), 0, 0
    for x, y in loader:
        if x.device != device:
            x, y = x.to(device), y.to(device)
        if cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast():
            logits = net(x)
        logits = logits.float()
        b = y.shape[0]
        losses.update(float(nn.functional.cross_entropy(logits, y)), b)
        acc1, acc5 = accuracy(logits, y, topk=(1, k5))
        # percentages back to counts of correct images, which add up exactly over batches and processes
        correct1 += round(float(acc1) * b / 100)
        correct5 += round(float(acc5) * b / 100)
    loss_sum, c1, c5, n = reduce_sum([losses.sum, correct1, correct5, losses.count], device)
    n = max(n, 1)
    return {'eval_loss': loss_sum / n, 'eval_top1': 100 * c1 / n, 'eval_top5': 100 * c5 / n}
