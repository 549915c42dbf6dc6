#!/usr/bin/env python3
"""Evolutionary search over class pairs and PatchMix masks. The logic lives in timm_patchmix.search; see
`python search.py --help`."""
import timm_patchmix  # noqa: F401  registers the patchhead_* models
from timm_patchmix.search import cli

if __name__ == '__main__':
    raise SystemExit(cli())
