"""The command line of ``timm_patchmix.hub`` (``python -m timm_patchmix.hub`` or ``timm-patchmix hub``)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..checkpoint import CheckpointError, WriteError
from ..cli import HelpFormatter, prog_name
from ..cli_types import directory, existing_file, file_or_name, new_file

__all__ = ['build_parser', 'main']

DESCRIPTION = '''Checkpoints out to the Hugging Face Hub and back.

  push      write the Hub folder of a train.py checkpoint and upload it (huggingface_hub)
  export    write the Hub folder only, anywhere
  backbone  write the plain timm backbone of a patchhead model as safetensors

A Hub folder holds model.safetensors, config.json in timm's format, a model card README.md and, for a Guided
PatchMix model, the masks.json it trained with. After `import timm_patchmix`,
timm.create_model('hf-hub:<repo>' or 'local-dir:<folder>', pretrained=True) rebuilds the model.'''

EPILOG = '''examples:
  {prog} push --checkpoint output/train/gpm/best.safetensors --repo-id user/name --dry-run
  {prog} push --checkpoint output/train/gpm/best.safetensors --repo-id user/name   # HF_TOKEN or `hf auth login`
  {prog} export --checkpoint output/train/gpm/best.safetensors --output hub/my-model
  {prog} backbone hf-hub:user/name --output resnet50-gpm.safetensors'''


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    prog = prog or prog_name('timm_patchmix.hub')
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG.format(prog=prog),
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True, metavar='{push,export,backbone}')
    helps = {'push': 'write the Hub folder of a checkpoint and upload it',
             'export': 'write the Hub folder of a checkpoint, upload nothing'}
    for name in ('push', 'export'):
        example = ('--checkpoint output/train/gpm/best.safetensors --repo-id user/name --dry-run' if name == 'push'
                   else '--checkpoint output/train/gpm/best.safetensors --output hub/my-model')
        q = sub.add_parser(name, help=helps[name], description=helps[name] + '.', formatter_class=HelpFormatter,
                           epilog=f'example:\n  {prog} {name} {example}')
        q.add_argument('--checkpoint', required=True, type=existing_file,
                       help='a train.py checkpoint of a patchhead_ model (best.safetensors or last.safetensors)')
        q.add_argument('--table', default=None, type=existing_file,
                       help='the mask table to ship (default: the one the checkpoint trained with, if guided)')
        q.add_argument('--overwrite', action='store_true', help='replace an existing folder at the destination')
        if name == 'push':
            q.add_argument('--repo-id', required=True, help='the Hub repository, "user/name" or "org/name"')
            q.add_argument('--dry-run', action='store_true', help='write the folder, upload nothing')
            q.add_argument('--folder', default=None, type=directory,
                           help='where to write the folder (default: output/hub/<name of the repo>)')
            q.add_argument('--private', action='store_true', help='create the repository as private')
            q.add_argument('--revision', default=None, help='the branch to upload to (default: main)')
            q.add_argument('--token', default=None,
                           help='a Hugging Face token (default: HF_TOKEN or the stored `hf auth login`)')
        else:
            q.add_argument('--output', required=True, type=directory, help='the folder to write')
            q.add_argument('--repo-id', default=None,
                           help='the repository id the model card names (default: <user>/<folder name>)')
    q = sub.add_parser('backbone', help='write the plain timm backbone of a patchhead model as safetensors',
                       description='Write the trunk and image head of a patchhead_ model under the plain timm '
                                   "model's own names\n(the patch head left out), for timm's file overlay.",
                       formatter_class=HelpFormatter,
                       epilog=f'example:\n  {prog} backbone hf-hub:user/name --output resnet50-gpm.safetensors')
    q.add_argument('source', type=file_or_name,
                   help='checkpoint file, hf-hub:<repo>, local-dir:<folder> or a registered tag')
    q.add_argument('--output', required=True, type=new_file, help='the .safetensors file to write')
    q.add_argument('--overwrite', action='store_true', help='replace an existing file at the destination')
    return p


def main(argv=None, prog: Optional[str] = None) -> int:
    """Run the command line; returns 0, 2 with ``error: ...`` on stderr for a usage or input error, 1 for a write
    or an upload that failed (a full disk, the network)."""
    from ..cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    from . import UploadError, export_backbone, export_folder, push
    a = build_parser(prog).parse_args(argv)
    try:
        if a.cmd == 'export':
            print(export_folder(a.checkpoint, a.output, repo_id=a.repo_id, table=a.table, overwrite=a.overwrite))
        elif a.cmd == 'push':
            out = push(a.checkpoint, a.repo_id, dry_run=a.dry_run, folder=a.folder, table=a.table, token=a.token,
                       private=a.private, revision=a.revision, overwrite=a.overwrite)
            print(out if a.dry_run else f'pushed to {a.repo_id}: {out}')
        else:
            print(export_backbone(a.source, a.output, overwrite=a.overwrite))
    except (WriteError, UploadError) as e:  # the inputs were good; writing or uploading failed
        print(f'error: {e}', file=sys.stderr)
        return 1
    except (CheckpointError, FileExistsError, FileNotFoundError, RuntimeError, ValueError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    return 0
