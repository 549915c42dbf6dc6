"""Run train.py's or the pipeline's command line in this process and SIGKILL it after N optimizer steps: a crash at
a known point, for the resume tests. The engine's ``on_step`` callback does it; nothing in the package reads a test
switch.

    python tests/kill_after_steps.py N train ARGS...       # timm_patchmix.train.main(ARGS)
    python tests/kill_after_steps.py N pipeline ARGS...    # timm_patchmix.pipeline.main(ARGS)

N counts the run's updates, which a resumed run continues from its state.
"""
import os
import signal
import sys

import timm_patchmix  # noqa: F401  registers the patchhead_* models


def kill_after(n: int):
    """An ``on_step`` callback that SIGKILLs this process once the run has made ``n`` optimizer steps."""
    def on_step(event):
        if event.updates >= n:
            os.kill(os.getpid(), signal.SIGKILL)
    return on_step


if __name__ == '__main__':
    steps, command, *argv = sys.argv[1:]
    if command == 'train':
        from timm_patchmix.train import main
        main(argv, on_step=kill_after(int(steps)))
    elif command == 'pipeline':
        from timm_patchmix.pipeline import main
        main(argv, on_train_step=kill_after(int(steps)))
    else:
        raise SystemExit(f'usage: {sys.argv[0]} N train|pipeline ARGS...')
