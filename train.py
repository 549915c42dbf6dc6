#!/usr/bin/env python3
"""timm-style training with PatchMix. The logic lives in timm_patchmix.train; see `python train.py --help`."""
import timm_patchmix  # noqa: F401  registers the patchhead_* models
from timm_patchmix.train import cli

if __name__ == '__main__':
    raise SystemExit(cli())
