"""``python -m timm_patchmix.hub``: see ``python -m timm_patchmix.hub --help``."""
import sys

from .cli import main

if __name__ == '__main__':
    sys.exit(main())
