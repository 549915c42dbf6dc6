"""``python -m timm_patchmix.search``: the search's command line (the same as ``search.py``)."""
import sys

import timm_patchmix  # noqa: F401  registers the patchhead_* models
from timm_patchmix.search import cli

if __name__ == '__main__':
    sys.exit(cli())
