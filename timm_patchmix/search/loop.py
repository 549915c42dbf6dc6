"""The search's names where code and tests have imported them from: the loop now lives in :mod:`.core`, the command
line in :mod:`.command`, the whole file-to-file run in :mod:`.run`."""
from .command import build_parser, cli, main
from .core import Search, SearchError

__all__ = ['Search', 'SearchError', 'build_parser', 'main', 'cli']
