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

__all__ = ['StepEvent', 'Stepper', 'amp_setup', 'clip_parameters', 'train_step', 'train_one_epoch', 'validate',
           'PatchVote', 'predictor']


@dataclass(frozen=True)
class StepEvent:
    """What ``on_step`` hears after each optimizer step: the epoch, the step in it (1-based) of ``steps``, the
    run's update count (continued across a resume) and the step's loss."""
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


def train_step(s: Stepper, x: torch.Tensor, target: torch.Tensor) -> float:
    """One optimizer step on a batch: move it to the device, mix it (``s.mixer``), forward, loss, backward, clip
    (``timm.utils.dispatch_clip_grad``) and step. Returns the loss (not checked for finiteness here)."""
    from timm.utils import dispatch_clip_grad
    cfg = s.cfg
    if not isinstance(x, torch.Tensor) or x.device != s.device:
        x, target = x.to(s.device), target.to(s.device)
    if s.mixer is not None:
        x, target = s.mixer(x, target)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with s.autocast():
        loss = s.criterion(s.model(x), target)
    s.optimizer.zero_grad(set_to_none=True)
    clip = cfg.clip_grad or None
    params = clip_parameters(s.model, cfg.clip_mode) if clip else None
    if s.scaler is not None:
        s.scaler(loss, s.optimizer, clip_grad=clip, clip_mode=cfg.clip_mode, parameters=params)
    else:
        loss.backward()
        if clip:
            dispatch_clip_grad(params, clip, mode=cfg.clip_mode)
        s.optimizer.step()
    s.updates += 1
    if cfg.sched_on_updates and s.scheduler is not None:
        s.scheduler.step_update(num_updates=s.updates)
    return float(loss.detach())  # the step's one host sync


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
    for i, (x, target) in enumerate(bar):
        loss = train_step(s, x, target)
        _check_finite(loss, epoch, i + 1, steps, rt)
        losses.update(loss, x.shape[0])
        if rt.primary:
            rate = losses.count * rt.world_size / (time.perf_counter() - t0)
            bar.set_postfix(loss=f'{losses.avg:.4f}', img_s=f'{rate:.0f}')
            if cfg.no_progress and (i % cfg.log_interval == 0 or i == steps - 1):
                print(f'train {epoch} [{i + 1}/{steps}] loss {losses.avg:.4f} {rate:.0f} img/s', flush=True)
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
