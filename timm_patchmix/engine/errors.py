"""What a training run raises when it cannot start or cannot go on; the command line maps each to an exit status."""
from __future__ import annotations

import math
from typing import Optional

__all__ = ['TrainSetupError', 'ConfigError', 'NonFiniteLossError']


class TrainSetupError(ValueError):
    """The run cannot start as configured (a missing dataset, a model without the head PatchMix needs, a resume from
    a damaged state...). The message says what to change; nothing has been trained or written."""


class ConfigError(TrainSetupError):
    """A flag, or a combination of flags, has a value the run cannot use: a usage error (exit status 2 on the
    command line). ``flag`` names the flag when one alone is at fault."""

    def __init__(self, message: str, flag: Optional[str] = None):
        self.flag, self.message = flag, message
        super().__init__(f'argument {flag}: {message}' if flag else message)


class NonFiniteLossError(RuntimeError):
    """The training loss, or the evaluation loss at an epoch's end, became NaN or infinite: the run stops there,
    before the epoch's weights are saved, so ``best.safetensors``, ``last.safetensors`` and ``state.safetensors``
    keep the last finished epoch's. ``evaluation``: it was the evaluation loss (the weights after the epoch's last
    updates give non-finite logits; ``step`` and ``steps`` are then the epoch's batches)."""

    def __init__(self, epoch: int, step: int, steps: int, loss: float, bad_ranks: int = 1, world_size: int = 1,
                 evaluation: bool = False):
        self.epoch, self.step, self.steps, self.loss, self.evaluation = epoch, step, steps, loss, evaluation
        value = f' ({loss})' if not math.isfinite(loss) else ''
        if evaluation:
            what = (f'non-finite evaluation loss{value} at the end of epoch {epoch}: the weights its updates made give '
                    f'non-finite logits on the evaluation images (under --amp-dtype float16 also logits beyond its '
                    f'range), so training stopped')
        else:
            where = f' on {bad_ranks} of {world_size} processes' if world_size > 1 else ''
            what = f'non-finite training loss{value}{where} at epoch {epoch}, step {step} of {steps}: training stopped'
        super().__init__(
            f'{what}. Checkpoints of earlier epochs (best.safetensors, last.safetensors, state.safetensors) are left '
            f'as they were; this epoch saved nothing. A lower --lr, --clip-grad or a warm-up (--warmup-epochs) may '
            f'keep the loss finite.')
