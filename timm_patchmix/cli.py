"""The ``timm-patchmix`` command: one entry point for every command line of the package.

    timm-patchmix train --patchmix                      # = python train.py --patchmix
    timm-patchmix search --checkpoint output/train/rpm/best.safetensors --output output/search
    timm-patchmix pipeline --budget small --seeds 0 1 2 # = python -m timm_patchmix.pipeline ...
    timm-patchmix hub export --checkpoint ... --output hub/my-model
    timm-patchmix demo                                  # = python -m timm_patchmix.demo
    timm-patchmix robustness --checkpoint best.safetensors --eps 0.1 0.2 0.3

Each subcommand takes exactly the flags of the module it runs (``timm-patchmix <command> --help``) and returns its
exit status: 0 on success, 2 for a usage error (a bad flag, or a resume/rerun with changed settings), 1 for a run
that failed (e.g. a non-finite training loss). The module behind a subcommand is imported only when it runs.
``timm-patchmix-train``, ``timm-patchmix-search`` and ``timm-patchmix-pipeline`` are the same as the subcommands.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ['COMMANDS', 'HelpFormatter', 'main', 'prog_name', 'run', 'train', 'search', 'pipeline',
           'tolerant_stdout']

# subcommand -> (module, function, one-line help); the function takes argv and returns an exit status
COMMANDS: Dict[str, Tuple[str, str, str]] = {
    'train': ('timm_patchmix.train', 'cli', 'train a timm model, with PatchMix or a baseline (train.py)'),
    'search': ('timm_patchmix.search', 'cli', 'search class pairs and masks with a Random-PatchMix model (search.py)'),
    'pipeline': ('timm_patchmix.pipeline', 'cli', "the paper's four phases and the baselines, with a report"),
    'hub': ('timm_patchmix.hub', 'main', 'export, push or load Hugging Face Hub folders; plain-backbone export'),
    'demo': ('timm_patchmix.demo', 'main', 'draw a grid of PatchMix samples of the embedded dataset'),
    'robustness': ('timm_patchmix.robustness', 'main', 'FGSM top-1 of a saved checkpoint'),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and appends ``(default: ...)`` to each flag's help where a default means
    something (not for required flags, switches that default to off, or flags with no default)."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        default = action.default
        return not (default is argparse.SUPPRESS or default is None or default is False or action.required
                    or (not action.option_strings and action.nargs not in ('?', '*')) or default == []
                    or default == '' or default == {})

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ''
        if '%(default)' in text or not self._shows_default(action):
            return text
        return text + ' (default: %(default)s)'

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):  # (argparse formats no help line for a flag without)
            action = copy.copy(action)
            action.help = '(default: %(default)s)'
        return super()._format_action(action)


def prog_name(module: str) -> str:
    """The program name a module's parser shows: ``python -m <module>`` when it runs as a file or module,
    otherwise the command that runs it (``timm-patchmix hub``, ``timm-patchmix-pipeline``)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ''
    if not argv0 or argv0.endswith('.py') or argv0 == '-c':
        return f'python -m {module}'
    return os.path.basename(argv0)


def _load(command: str) -> Callable[[Optional[List[str]]], int]:
    module, attr, _ = COMMANDS[command]
    return getattr(importlib.import_module(module), attr)


def run(command: str, argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """Run one subcommand with ``argv``; its parser names itself ``prog`` (default: ``timm-patchmix <command>``)."""
    func = _load(command)
    saved = sys.argv[0] if sys.argv else None
    if sys.argv:
        sys.argv[0] = prog or f'timm-patchmix {command}'
    else:
        sys.argv.append(prog or f'timm-patchmix {command}')
    try:
        status = func(list(sys.argv[1:] if argv is None else argv))
    finally:
        if saved is not None:
            sys.argv[0] = saved
    return int(status or 0)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    commands = '\n'.join(f'  {name:<11} {info[2]}' for name, info in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog='timm-patchmix', formatter_class=HelpFormatter,
        description='PatchMix (Cascante-Bonilla et al., BMVC 2021) for timm: one command, six subcommands.',
        usage='timm-patchmix [-h] [--version] COMMAND [ARGS ...]',
        epilog=f'commands:\n{commands}\n\n'
               'examples:\n'
               '  timm-patchmix pipeline                      # the main job, embedded data, smoke budget\n'
               '  timm-patchmix train --patchmix              # Random PatchMix on the embedded data\n'
               '  timm-patchmix train --help                  # the flags of one command\n')
    p.add_argument('--version', action='version', version=f'timm_patchmix {__version__}')
    p.add_argument('command', metavar='COMMAND', choices=list(COMMANDS), help='one of: ' + ', '.join(COMMANDS))
    p.add_argument('args', nargs=argparse.REMAINDER, metavar='ARGS', help="the command's own flags")
    return p


_ESCAPES = 'timm_patchmix.escapes'


def _escapes(e: UnicodeError):
    """An encoding error handler: the bytes a lone surrogate stands for (a path or name Python read undecodable,
    as ``surrogateescape`` writes it back), any other letter as a backslash escape (``backslashreplace``)."""
    if not isinstance(e, UnicodeEncodeError):
        raise e
    out = bytearray()
    for ch in e.object[e.start:e.end]:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(code - 0xDC00)
        else:
            out += ch.encode('ascii', 'backslashreplace')
    return bytes(out), e.end


def tolerant_stdout() -> None:
    """Let standard output show what its encoding cannot (a path or class name with non-ASCII letters, the
    report's ``P²``) as backslash escapes, as Python's standard error does, instead of failing a finished command
    at its last line (``PYTHONIOENCODING=ascii``; a C locale with ``PYTHONUTF8=0``, whose ``surrogateescape``
    handler still writes back the bytes of undecodable paths), and the bytes of such a path as they were read on
    any stream, a strict UTF-8 one too (``PYTHONIOENCODING=utf-8``, a path with Latin-1 bytes). A stream given
    another handler is left as it is. Every command line calls it first."""
    import codecs
    stream = sys.stdout
    if getattr(stream, 'errors', None) not in ('strict', 'surrogateescape') or not hasattr(stream, 'reconfigure'):
        return
    try:
        codecs.lookup_error(_ESCAPES)
    except LookupError:
        codecs.register_error(_ESCAPES, _escapes)
    try:
        stream.reconfigure(errors=_ESCAPES)
    except (ValueError, OSError, AttributeError):  # (a stream that cannot change it: it stays as it was)
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``timm-patchmix COMMAND [ARGS ...]``: returns the command's exit status (2 for an unknown command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:  # the command's flags go to it untouched, --help included
        return run(argv[0], argv[1:])
    parser = build_parser()
    if not argv:
        parser.error('a COMMAND is required, one of: ' + ', '.join(COMMANDS))
    parser.parse_args(argv)  # -h, --version, or an error naming the commands; all exit
    return 2


def train(argv: Optional[Sequence[str]] = None) -> int:
    """``timm-patchmix-train``: the same as ``timm-patchmix train``."""
    return run('train', argv, prog='timm-patchmix-train')


def search(argv: Optional[Sequence[str]] = None) -> int:
    """``timm-patchmix-search``: the same as ``timm-patchmix search``."""
    return run('search', argv, prog='timm-patchmix-search')


def pipeline(argv: Optional[Sequence[str]] = None) -> int:
    """``timm-patchmix-pipeline``: the same as ``timm-patchmix pipeline``."""
    return run('pipeline', argv, prog='timm-patchmix-pipeline')


if __name__ == '__main__':
    sys.exit(main())
