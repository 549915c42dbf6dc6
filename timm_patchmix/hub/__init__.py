"""Checkpoints out to the Hugging Face Hub and back: Hub folders, push, plain-backbone export, loading.

    python -m timm_patchmix.hub push --checkpoint output/train/gpm/best.safetensors --repo-id user/name [--dry-run]
    python -m timm_patchmix.hub export --checkpoint ... --output hub/my-model        # the Hub folder only
    python -m timm_patchmix.hub backbone SOURCE --output resnet50-gpm.safetensors     # a plain timm state dict

A Hub folder holds ``model.safetensors`` (the patchhead state dict), ``config.json`` in timm's format (architecture
``patchhead_<arch>``, num_classes, label names, ``model_args`` with the grid and head options, the data config of
training), a model card ``README.md`` and, for a guided model, the ``masks.json`` it trained with. After
``import timm_patchmix``, ``timm.create_model('hf-hub:<repo>' | 'local-dir:<folder>', pretrained=True)`` rebuilds the
model; a different ``num_classes`` re-initialises both heads. Nothing is unpickled on the way in.

This module writes folders and pushes them; ``hub.load`` loads (and extracts plain backbones), ``hub.card`` writes
the model card, ``hub.cli`` is the command line.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

from ..checkpoint import (SET_ASIDE, CheckpointError, WriteError, _umask, atomic_write_text, clean_stale_temps,
                          release_temp, save_weights, temp_dir)
from ..data import DATA_CONFIG_KEYS, channel_matched, dataset_label
from ..settings import file_record
from .card import model_card as _model_card, read_results as _results, read_summary as _summary, training_method
from .cli import main
from .load import (_SOURCES, _check_registered, _patchhead, _read_config,  # noqa: F401  (train.py reads _read_config)
                   backbone_state_dict, export_backbone, load_backbone, load_model, model_from_weights)

__all__ = ['model_from_weights', 'export_folder', 'push', 'UploadError', 'load_model', 'load_backbone',
           'backbone_state_dict', 'export_backbone', 'main']


def _repo_name(folder: str) -> str:
    """A name a Hub repository can have, from a folder's: runs of other characters, ``--`` and ``..`` as one ``-``,
    no ``-``/``.`` at the ends or ``.git`` ending, at most 64 characters (a user name and ``/`` fit in the Hub's
    96); ``model`` when nothing is left."""
    name = re.sub(r'[^A-Za-z0-9._-]+', '-', os.path.basename(os.path.normpath(folder)))
    name = re.sub(r'[-.]{2,}', '-', name)[:64].strip('-.')
    while name.endswith('.git'):
        name = name[:-4].rstrip('-.')
    return name or 'model'


class UploadError(RuntimeError):
    """The upload of an exported folder failed (the network, the Hub, a token without write access); the folder
    is ready, and the message says how to push it again. The command line exits 1 for it, as for a failed write."""


def export_folder(checkpoint: str, folder: str, repo_id: Optional[str] = None, table: Optional[str] = None,
                  overwrite: bool = False) -> str:
    """Write the Hub folder for a ``train.py`` checkpoint (see the module doc); returns ``folder``.

    ``table``: the mask table to ship; by default the one the checkpoint trained with, when it was guided. The
    folder is built beside its destination and moved into place at the end, so a failure leaves no half folder
    and an existing folder is replaced only with ``overwrite``.
    """
    from ..compat import save_config_for_hf
    from ..guided import MaskTable, MaskTableError, dataset_fingerprint
    if repo_id is not None:  # (the card's code names it: a model card that loads nothing otherwise)
        check_repo_id(repo_id)
    _check_destination(checkpoint, folder, table)
    if os.path.lexists(folder) and not overwrite:
        raise FileExistsError(f'{folder} exists; pass overwrite=True (--overwrite) to replace it')
    model, meta = model_from_weights(checkpoint)
    arch = meta['model']
    if not arch.startswith('patchhead_'):
        raise CheckpointError(f'{checkpoint} holds {arch!r}, not a patchhead_ model; export a PatchMix-trained '
                              f'patchhead checkpoint')
    repo_id = repo_id or '<user>/' + _repo_name(folder)  # (a placeholder the card's reader replaces)
    trained_with = (meta.get('patchmix') or {}).get('table') or None  # the table the model trained on, if any
    given = table
    table = table or trained_with
    data = meta.get('data') or {}
    recorded = (meta.get('patchmix') or {}).get('table_sha256')  # (recorded since the table's path may move)
    table_doc = table_sha = None
    if table:
        if not os.path.isfile(table):
            if given:
                raise CheckpointError(f'the mask table {table} given with --table (table=) '
                                      + ('is a folder, not a masks.json file' if os.path.isdir(table)
                                         else 'does not exist'))
            raise CheckpointError(f'{checkpoint} trained with the mask table {table}, which is not there; pass '
                                  f'--table with its path')
        _check_destination(checkpoint, folder, table)
        table_sha = file_record(table)['sha256']
        if not given and recorded and table_sha != recorded:
            # (a path recorded relative to the training's working folder can name another table from here)
            raise CheckpointError(f'{checkpoint} trained with the mask table {table}, and the file there now holds '
                                  f'another table (its SHA-256 differs from the one recorded); pass --table with the '
                                  f'table it trained on')
        names = meta.get('class_names')
        if not names:
            raise CheckpointError(f'{checkpoint} records no class names, so the mask table {table} cannot be '
                                  f'checked against the dataset the model was trained on; export without a table')
        try:
            loaded = MaskTable.load(table, grid=tuple(model.grid), num_classes=model.num_classes,
                                    fingerprint=dataset_fingerprint(data.get('dataset') or '', names))
        except MaskTableError as e:
            raise CheckpointError(f'the mask table does not belong to the model in {checkpoint} (dataset '
                                  f'{dataset_label(data.get("dataset") or "", data.get("data_dir") or "")}): '
                                  f'{e}') from None
        if loaded.class_names and loaded.class_names != list(names):
            raise CheckpointError(f'the mask table {table} names the classes {loaded.class_names}, the model in '
                                  f'{checkpoint} was trained on {list(names)}')
        with open(table, encoding='utf-8') as f:
            table_doc = json.load(f)
    # a table given with --table is the one the model trained on only where it has the recorded table's content
    digest = recorded
    if not digest and trained_with and os.path.isfile(trained_with):  # an older checkpoint: its table's content
        digest = table_sha if table == trained_with else file_record(trained_with)['sha256']
    trained_on_table = bool(trained_with) and table_doc is not None and (
        table_sha == digest if digest else table == trained_with)
    kwargs = dict(meta.get('model_kwargs') or {})
    model_args = dict(kwargs, grid=list(model.grid), per_position=bool(model.patch_head.per_position))
    data_config = channel_matched({k: data[k] for k in DATA_CONFIG_KEYS if data.get(k)})
    metrics, results = _summary(checkpoint), _results(checkpoint)
    model_config = {'timm_patchmix': {'method': training_method(meta),
                                      'grid': list(model.grid),
                                      'dataset': dataset_label(data.get('dataset') or '', data.get('data_dir') or ''),
                                      'metrics': metrics, 'test_metrics': results, 'command': meta.get('command'),
                                      'mask_table': 'masks.json' if table_doc else None,
                                      'note': 'import timm_patchmix before timm.create_model: it registers '
                                              'the patchhead_* architectures'}}
    if meta.get('class_names'):
        model_config['label_names'] = list(meta['class_names'])
    parent = os.path.dirname(os.path.abspath(folder))
    created = []  # the folders above the destination this export makes, removed again if it fails
    d = parent
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        created.append(d)
        d = os.path.dirname(d)
    tmp = old = None
    try:
        # every write of the folder: one error line for a folder without write permission, a read-only file
        # system, a full disk (timm's config writer, the table's copy...), a folder another program holds busy
        try:
            os.makedirs(parent, exist_ok=True)
            clean_stale_temps(parent)
            tmp = temp_dir(folder)
            save_weights(os.path.join(tmp, 'model.safetensors'), model.state_dict())
            save_config_for_hf(model, os.path.join(tmp, 'config.json'), model_config=model_config,
                               model_args=model_args, data_config=data_config)
            with open(os.path.join(tmp, 'config.json'), encoding='utf-8') as f:
                cfg = json.load(f)
            cfg['model_args'].pop('num_classes', None)  # the root num_classes is the checkpoint's; a load may change it
            for key in ('tag', 'origin_url'):  # they name the registered weights the architecture's cfg came from
                cfg['pretrained_cfg'].pop(key, None)
            atomic_write_text(os.path.join(tmp, 'config.json'), json.dumps(cfg, indent=2) + '\n')
            if table_doc is not None:
                shutil.copyfile(table, os.path.join(tmp, 'masks.json'))
            atomic_write_text(os.path.join(tmp, 'README.md'),
                              _model_card(repo_id, arch, meta, metrics, table_doc, results, trained_on_table))
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a folder gets os.makedirs' mode
            if os.path.lexists(folder):
                old = temp_dir(folder)
                os.replace(folder, os.path.join(old, SET_ASIDE))  # (a mount point, a busy folder: a WriteError)
                try:
                    os.replace(tmp, folder)
                except BaseException:
                    os.replace(os.path.join(old, SET_ASIDE), folder)  # put the existing folder back
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, folder)
        except WriteError:
            raise
        except OSError as e:
            raise WriteError(folder, e) from None
    except BaseException:
        for t in (tmp, old):
            if t is not None and not os.path.lexists(os.path.join(t, SET_ASIDE)):  # never the folder being replaced
                shutil.rmtree(t, ignore_errors=True)
        for d in created:  # deepest first; stop at the first that something else has filled meanwhile
            try:
                os.rmdir(d)
            except OSError:
                break
        raise
    finally:
        for t in (tmp, old):
            if t is not None:
                release_temp(t)
    return folder


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (symbolic links resolved)."""
    p, f = os.path.realpath(path), os.path.realpath(folder)
    return p == f or p.startswith(f.rstrip(os.sep) + os.sep)


def _check_destination(checkpoint: str, folder: str, table: Optional[str]) -> None:
    """Refuse an export destination that replacing would delete inputs with: the checkpoint, its run folder (its
    state, last and best checkpoints, summary.csv...) or the mask table."""
    if not os.path.lexists(folder):
        return
    if not os.path.isdir(folder):
        raise FileExistsError(f'{folder} exists and is not a folder; an export writes a folder there, so choose '
                              f'another --output')
    run = os.path.dirname(os.path.abspath(checkpoint))
    what = None
    if _within(os.getcwd(), folder):  # (replacing it would leave this process and the caller's shell nowhere)
        what = ('is the current folder' if os.path.realpath(os.getcwd()) == os.path.realpath(folder)
                else 'contains the current folder')
    elif _within(run, folder):
        what = (f'is the run folder of {checkpoint}' if os.path.realpath(run) == os.path.realpath(folder)
                else f'contains the run folder {run} of {checkpoint}')
        what += ' (its checkpoints, state.safetensors, summary.csv)'
    elif _within(checkpoint, folder):
        what = f'contains the checkpoint {checkpoint}'
    elif table and _within(table, folder):
        what = f'contains the mask table {table}'
    if what:
        raise FileExistsError(f'refusing to export into {folder}: it {what}, which replacing it would delete; '
                              f'choose another --output')


def check_repo_id(repo_id: str) -> None:
    """A ``ValueError`` unless ``repo_id`` is a Hub model repository id, ``"user/name"`` or ``"org/name"``
    (``huggingface_hub``'s ``validate_repo_id``)."""
    owner, slash, name = repo_id.partition('/') if isinstance(repo_id, str) else ('', '', '')
    if not slash or not owner or not name or '/' in name:
        raise ValueError(f'repo_id must be "user/name" or "org/name", got {repo_id!r}')
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f'repo_id {repo_id!r} is not a Hub repository id: {e}') from None


def push(checkpoint: str, repo_id: str, dry_run: bool = False, folder: Optional[str] = None,
         table: Optional[str] = None, token: Optional[str] = None, private: bool = False,
         revision: Optional[str] = None, commit_message: str = 'Add timm_patchmix model', overwrite: bool = False):
    """Export the Hub folder and upload it with huggingface_hub (token: ``token``, else ``HF_TOKEN`` or a
    ``hf auth login``). ``dry_run`` writes the folder only (to ``folder``, default ``output/hub/<repo name>``)
    and returns its path; otherwise returns the upload's commit info."""
    check_repo_id(repo_id)  # (before anything is written: the folder's name comes from it)
    folder = folder or os.path.join('output', 'hub', repo_id.split('/')[-1])
    export_folder(checkpoint, folder, repo_id=repo_id, table=table, overwrite=overwrite)
    if dry_run:
        return folder
    from huggingface_hub import HfApi, get_token
    token = token or get_token()
    if not token:
        raise RuntimeError(f'no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again with '
                           f'--overwrite (overwrite=True), which writes the folder {folder} anew (--dry-run only '
                           f'writes it)')
    api = HfApi(token=token, library_name='timm_patchmix')
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision,
                                 commit_message=commit_message)
    except Exception as e:  # the Hub's, or the network's, errors: many kinds, one message
        raise UploadError(f'the upload to {repo_id} failed ({type(e).__name__}: {e}); the folder is ready in '
                          f'{folder}: push again later with --overwrite (overwrite=True), which writes it anew, '
                          f'or upload it with huggingface_hub') from e
