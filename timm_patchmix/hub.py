"""Checkpoints out to the Hugging Face Hub and back: Hub folders, push, plain-backbone export, loading.

    python -m timm_patchmix.hub push --checkpoint output/train/gpm/best.safetensors --repo-id user/name [--dry-run]
    python -m timm_patchmix.hub export --checkpoint ... --output hub/my-model        # the Hub folder only
    python -m timm_patchmix.hub backbone SOURCE --output resnet50-gpm.safetensors     # a plain timm state dict

A Hub folder holds ``model.safetensors`` (the patchhead state dict), ``config.json`` in timm's format (architecture
``patchhead_<arch>``, num_classes, label names, ``model_args`` with the grid and head options, the data config of
training), a model card ``README.md`` and, for a guided model, the ``masks.json`` it trained with. After
``import timm_patchmix``, ``timm.create_model('hf-hub:<repo>' | 'local-dir:<folder>', pretrained=True)`` rebuilds the
model; a different ``num_classes`` re-initialises both heads. Nothing is unpickled on the way in.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import timm

from .checkpoint import (CheckpointError, atomic_write_text, clean_stale_temps, load_weights, release_temp,
                         save_weights, temp_dir)
from .validation import Fields, check_hub_config
from .cli_types import directory, existing_file, file_or_name, new_file

__all__ = ['model_from_weights', 'export_folder', 'push', 'load_model', 'load_backbone', 'backbone_state_dict',
           'export_backbone', 'main']

_SOURCES = ('hf-hub:', 'local-dir:')


def model_from_weights(path: str, **overrides) -> Tuple[nn.Module, Dict[str, Any]]:
    """Build the model recorded in ``path``'s metadata, load its weights strictly, return ``(model, meta)``."""
    state, meta = load_weights(path)
    arch = meta.get('model')
    if not arch:
        raise CheckpointError(f'{path} carries no timm_patchmix metadata naming its model; build the model '
                              f'yourself and load the file with safetensors.torch.load_file')
    _check_registered(arch, path)
    kwargs = dict(meta.get('model_kwargs') or {})
    kwargs.update(num_classes=meta.get('num_classes'), **overrides)
    try:
        model = timm.create_model(arch, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:
        raise CheckpointError(f'{path}: cannot build {arch} with the recorded num_classes and model_kwargs '
                              f'{kwargs}: {e}') from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f'{path} does not fit {arch}: missing {list(missing)[:5]}, '
                              f'unexpected {list(unexpected)[:5]}')
    return model.eval(), meta


def _check_registered(arch: str, where: str) -> None:
    if timm.is_model(arch):
        return
    hint = (f'`import timm_patchmix` before creating the model (it registers patchhead_<arch> for every timm '
            f'architecture); if it is imported, {arch[len("patchhead_"):]!r} is not an architecture of the '
            f'installed timm {timm.__version__}' if arch.startswith('patchhead_') else
            'the installed timm does not know it (an older timm, or a model from another library)')
    raise CheckpointError(f'{where} names the architecture {arch!r}, which is not a registered timm model: {hint}')


# --- reading a Hub folder / repo config -------------------------------------------------------------------------
def _read_config(source: str, cache_dir=None) -> Dict[str, Any]:
    """``config.json`` of ``hf-hub:<repo>`` or ``local-dir:<folder>``, with a clear error when it is missing or bad."""
    kind, _, ident = source.partition(':')
    if kind == 'local-dir':
        path = os.path.join(ident, 'config.json')
        if not os.path.isfile(path):
            raise CheckpointError(f'{ident} has no config.json; a Hub folder from `python -m timm_patchmix.hub '
                                  f'export` holds config.json and model.safetensors')
    else:
        from timm.models._hub import download_from_hf
        path = download_from_hf(ident, 'config.json', cache_dir=cache_dir)
    try:
        with open(path, encoding='utf-8') as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f'{source}: config.json is not readable JSON ({e})') from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get('architecture'), str):
        raise CheckpointError(f'{source}: config.json names no architecture; it is not a timm model config')
    check_hub_config(cfg, Fields(f'{source}: config.json', CheckpointError))
    return cfg


def load_model(name: str, pretrained: bool = True, **kwargs) -> nn.Module:
    """``timm.create_model`` with the checks a downloaded model deserves: the config's architecture must be
    registered (else an error saying to ``import timm_patchmix``), and damaged weights give an error that says how
    to fetch them again. ``name``: ``hf-hub:<repo>``, ``local-dir:<folder>``, a tag such as
    ``patchhead_resnet50.gpm_in1k``, or any timm name."""
    if name.startswith(_SOURCES):
        _check_registered(_read_config(name, kwargs.get('cache_dir'))['architecture'], name)
    return timm.create_model(name, pretrained=pretrained, **kwargs)


# --- writing a Hub folder ---------------------------------------------------------------------------------------
def _summary(checkpoint: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), 'summary.csv')
    if not os.path.isfile(path):
        return None
    try:
        with open(path, newline='', encoding='utf-8') as f:
            rows = list(csv.DictReader(f))
        if not rows:
            return None
        top1 = [float(r['eval_top1']) for r in rows if r.get('eval_top1')]
        out = {'epochs': len(rows), 'final_top1': top1[-1] if top1 else None,
               'best_top1': max(top1) if top1 else None}
        if rows[-1].get('eval_top5'):
            out['final_top5'] = float(rows[-1]['eval_top5'])
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, TypeError) as e:
        raise CheckpointError(f'{path}: eval_top1/eval_top5 must be numbers in a readable CSV ({e})') from None
    return out


def _model_card(repo_id: str, arch: str, meta: Dict[str, Any], metrics: Optional[Dict[str, Any]],
                table: Optional[Dict[str, Any]]) -> str:
    data = meta.get('data') or {}
    dataset = data.get('dataset') or 'patchshapes'
    patchmix = bool((meta.get('patchmix') or {}).get('enabled'))
    method = 'Guided PatchMix' if table is not None else ('Random PatchMix' if patchmix else 'no PatchMix')
    lines = [
        '---', 'library_name: timm', 'license: apache-2.0', 'pipeline_tag: image-classification',
        'tags:', '- image-classification', '- timm', '- timm_patchmix', '- patchmix', '---', '',
        f'# {repo_id.split("/")[-1]}', '',
        f'`{arch}`: a timm `{arch[len("patchhead_"):]}` with a PatchMix patch head, trained with {method} on '
        f'{dataset} ({meta.get("num_classes")} classes). PatchMix (Cascante-Bonilla et al., BMVC 2021) mixes '
        'images cell by cell on a grid, labels each mix by the fraction of each source, and classifies the '
        'backbone\'s last feature map as a whole and region by region; Guided PatchMix trains on the class '
        'pairs and masks a genetic search found hardest for a Random-PatchMix model.', '',
        '## Use', '', '```python', 'import timm', 'import timm_patchmix  # registers patchhead_* models', '',
        f"model = timm.create_model('hf-hub:{repo_id}', pretrained=True).eval()",
        f"finetune = timm.create_model('hf-hub:{repo_id}', pretrained=True, num_classes=200)  # both heads new",
        f"plain = timm_patchmix.hub.load_backbone('hf-hub:{repo_id}')  # a plain timm model, same trunk",
        '```', '',
        'Fine-tune with the project\'s trainer: `python train.py --model hf-hub:' + repo_id +
        ' --pretrained --num-classes N --dataset ... --patchmix`.', '',
        '## Training', '',
        f'- grid: {"x".join(str(g) for g in (meta.get("patchmix") or {}).get("grid") or [4, 4])}',
        f'- data: {dataset}, input size {data.get("input_size")}, mean {data.get("mean")}, std {data.get("std")}',
    ]
    if meta.get('command'):
        lines += [f'- command: `{meta["command"]}`']
    if metrics and metrics.get("final_top1") is not None:
        lines += ['', '## Metrics', '', '| epochs | final top-1 | best top-1 |', '|---|---|---|',
                  f'| {metrics["epochs"]} | {metrics["final_top1"]:.2f} | {metrics["best_top1"]:.2f} |']
    if table:
        names = table.get('class_names') or [str(i) for i in range(int(table.get('num_classes', 0)))]
        lines += ['', '## Mask table', '', f'`masks.json` (search fitness {table.get("best_fitness")}): the class '
                  'pairs and cell masks this model trained on; 1 = the cell comes from the first class.', '',
                  '| pair | mask (rows) | score |', '|---|---|---|']
        for p in table.get('pairs', []):
            mask = ' / '.join(''.join(str(int(b)) for b in row) for row in p['mask'])
            a, b = p['classes']
            lines.append(f'| {names[a]} + {names[b]} | `{mask}` | {p.get("score", float("nan")):.3f} |')
    lines += ['', '## Citation', '', '```bibtex', '@inproceedings{cascante2021patchmix,',
              '  title     = {Evolving Image Compositions for Feature Representation Learning},',
              '  author    = {Cascante-Bonilla, Paola and Sekhon, Arshdeep and Qi, Yanjun and Ordonez, Vicente},',
              '  booktitle = {British Machine Vision Conference (BMVC)},', '  year      = {2021}', '}', '```', '']
    return '\n'.join(lines)


def export_folder(checkpoint: str, folder: str, repo_id: Optional[str] = None, table: Optional[str] = None,
                  overwrite: bool = False) -> str:
    """Write the Hub folder for a ``train.py`` checkpoint (see the module doc); returns ``folder``.

    ``table``: the mask table to ship; by default the one the checkpoint trained with, when it was guided. The
    folder is built beside its destination and moved into place at the end, so a failure leaves no half folder
    and an existing folder is replaced only with ``overwrite``.
    """
    from timm.models._hub import save_config_for_hf
    from .guided import MaskTable, MaskTableError, dataset_fingerprint
    _check_destination(checkpoint, folder, table)
    if os.path.lexists(folder) and not overwrite:
        raise FileExistsError(f'{folder} exists; pass overwrite=True (--overwrite) to replace it')
    model, meta = model_from_weights(checkpoint)
    arch = meta['model']
    if not arch.startswith('patchhead_'):
        raise CheckpointError(f'{checkpoint} holds {arch!r}, not a patchhead_ model; export a PatchMix-trained '
                              f'patchhead checkpoint')
    repo_id = repo_id or f'<user>/{os.path.basename(os.path.normpath(folder))}'
    table = table or (meta.get('patchmix') or {}).get('table') or None
    data = meta.get('data') or {}
    table_doc = None
    if table:
        if not os.path.isfile(table):
            raise CheckpointError(f'{checkpoint} trained with the mask table {table}, which is not there; pass '
                                  f'--table with its path')
        _check_destination(checkpoint, folder, table)
        names = meta.get('class_names')
        if not names:
            raise CheckpointError(f'{checkpoint} records no class names, so the mask table {table} cannot be '
                                  f'checked against the dataset the model was trained on; export without a table')
        try:
            loaded = MaskTable.load(table, grid=tuple(model.grid), num_classes=model.num_classes,
                                    fingerprint=dataset_fingerprint(data.get('dataset') or '', names))
        except MaskTableError as e:
            raise CheckpointError(f'the mask table does not belong to the model in {checkpoint} (dataset '
                                  f'{data.get("dataset") or "patchshapes"}): {e}') from None
        if loaded.class_names and loaded.class_names != list(names):
            raise CheckpointError(f'the mask table {table} names the classes {loaded.class_names}, the model in '
                                  f'{checkpoint} was trained on {list(names)}')
        with open(table, encoding='utf-8') as f:
            table_doc = json.load(f)
    kwargs = dict(meta.get('model_kwargs') or {})
    model_args = dict(kwargs, grid=list(model.grid), per_position=bool(model.patch_head.per_position))
    data_config = {k: data[k] for k in ('input_size', 'mean', 'std', 'interpolation', 'crop_pct') if data.get(k)}
    metrics = _summary(checkpoint)
    model_config = {'timm_patchmix': {'method': 'guided' if table_doc else 'random',
                                      'grid': list(model.grid), 'dataset': data.get('dataset') or 'patchshapes',
                                      'metrics': metrics, 'command': meta.get('command'),
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
        os.makedirs(parent, exist_ok=True)
        clean_stale_temps(parent)
        tmp = temp_dir(folder)
        save_weights(os.path.join(tmp, 'model.safetensors'), model.state_dict())
        save_config_for_hf(model, os.path.join(tmp, 'config.json'), model_config=model_config,
                           model_args=model_args, data_config=data_config)
        with open(os.path.join(tmp, 'config.json'), encoding='utf-8') as f:
            cfg = json.load(f)
        cfg['model_args'].pop('num_classes', None)  # the root num_classes is the checkpoint's; a load may change it
        atomic_write_text(os.path.join(tmp, 'config.json'), json.dumps(cfg, indent=2) + '\n')
        if table_doc is not None:
            shutil.copyfile(table, os.path.join(tmp, 'masks.json'))
        atomic_write_text(os.path.join(tmp, 'README.md'),
                          _model_card(repo_id, arch, meta, metrics, table_doc))
        os.chmod(tmp, 0o755)
        if os.path.lexists(folder):
            old = temp_dir(folder)
            os.replace(folder, os.path.join(old, 'x'))
            try:
                os.replace(tmp, folder)
            except BaseException:
                os.replace(os.path.join(old, 'x'), folder)  # put the existing folder back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        for t in (tmp, old):
            if t is not None and not os.path.lexists(os.path.join(t, 'x')):  # never the folder being replaced
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
    if _within(run, folder):
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


def push(checkpoint: str, repo_id: str, dry_run: bool = False, folder: Optional[str] = None,
         table: Optional[str] = None, token: Optional[str] = None, private: bool = False,
         revision: Optional[str] = None, commit_message: str = 'Add timm_patchmix model', overwrite: bool = False):
    """Export the Hub folder and upload it with huggingface_hub (token: ``token``, else ``HF_TOKEN`` or a
    ``hf auth login``). ``dry_run`` writes the folder only (to ``folder``, default ``output/hub/<repo name>``)
    and returns its path; otherwise returns the upload's commit info."""
    if '/' not in repo_id:
        raise ValueError(f'repo_id must be "user/name" or "org/name", got {repo_id!r}')
    folder = folder or os.path.join('output', 'hub', repo_id.split('/')[-1])
    export_folder(checkpoint, folder, repo_id=repo_id, table=table, overwrite=overwrite)
    if dry_run:
        return folder
    from huggingface_hub import HfApi, get_token
    token = token or get_token()
    if not token:
        raise RuntimeError(f'no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again (the '
                           f'folder is ready in {folder}; --dry-run only writes it)')
    api = HfApi(token=token, library_name='timm_patchmix')
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, commit_message=commit_message)


# --- the plain backbone -----------------------------------------------------------------------------------------
def _patchhead(source) -> nn.Module:
    if isinstance(source, nn.Module):
        return source
    if os.path.isfile(source):
        return model_from_weights(source)[0]
    return load_model(source, pretrained=True)


def backbone_state_dict(source) -> Tuple[str, Dict[str, torch.Tensor], Dict[str, Any]]:
    """``(arch, state_dict, pretrained_cfg)`` of the trunk (and image head) of a patchhead model: the
    ``backbone.`` weights under the plain model's own names, the patch head left out."""
    model = _patchhead(source)
    from .models import PatchHeadModel
    if not isinstance(model, PatchHeadModel):
        raise CheckpointError(f'{source} is not a patchhead_ model')
    arch = model.pretrained_cfg['architecture'][len('patchhead_'):]
    state = {k[len('backbone.'):]: v for k, v in model.state_dict().items() if k.startswith('backbone.')}
    cfg = {k: model.pretrained_cfg.get(k) for k in ('input_size', 'mean', 'std', 'interpolation', 'crop_pct')
           if model.pretrained_cfg.get(k) is not None}
    cfg['num_classes'] = model.num_classes
    return arch, state, cfg


def load_backbone(source, num_classes: Optional[int] = None, **kwargs) -> nn.Module:
    """A plain timm model (``resnet50``, not ``patchhead_resnet50``) with the PatchMix-trained trunk of ``source``
    (a patchhead model, a ``train.py`` checkpoint, ``hf-hub:``/``local-dir:`` or a registered tag).

    Loading goes through timm's ``pretrained_cfg_overlay``, so timm's own adaptation applies: a different
    ``num_classes`` re-initialises the classifier, ``in_chans`` adapts the stem. ``kwargs`` go to timm.
    """
    src = _patchhead(source)
    arch, state, cfg = backbone_state_dict(src)
    for k, v in (getattr(src, '_model_args', None) or {}).items():
        if k not in ('grid', 'per_position', 'num_classes'):
            kwargs.setdefault(k, v)
    kwargs.pop('pretrained_model_args', None)
    overlay = dict(cfg, state_dict=state, hf_hub_id=None, url=None, file=None)
    return timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=overlay,
                             num_classes=cfg['num_classes'] if num_classes is None else num_classes, **kwargs)


def export_backbone(source, path: str) -> str:
    """Write the plain backbone's state dict as safetensors (atomically), for timm's documented file overlay:
    ``timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=dict(file=path, num_classes=C))``."""
    arch, state, cfg = backbone_state_dict(source)
    save_weights(path, state, {'model': arch, 'num_classes': cfg['num_classes'], 'data': cfg,
                               'exported_from': str(source) if not isinstance(source, nn.Module) else None})
    return path


# --- command line -----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog='python -m timm_patchmix.hub', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True)
    for name in ('push', 'export'):
        q = sub.add_parser(name)
        q.add_argument('--checkpoint', required=True, type=existing_file,
                       help='a train.py checkpoint (best.safetensors)')
        q.add_argument('--table', default=None, type=existing_file,
                       help='the mask table (default: the one the checkpoint trained with)')
        q.add_argument('--overwrite', action='store_true', help='replace an existing folder')
        if name == 'push':
            q.add_argument('--repo-id', required=True)
            q.add_argument('--dry-run', action='store_true', help='write the folder, upload nothing')
            q.add_argument('--folder', default=None, type=directory,
                           help='where to write the folder (default output/hub/<name>)')
            q.add_argument('--private', action='store_true')
            q.add_argument('--revision', default=None)
            q.add_argument('--token', default=None, help='default: HF_TOKEN or the stored login')
        else:
            q.add_argument('--output', required=True, type=directory)
            q.add_argument('--repo-id', default=None, help='the repo id the model card names')
    q = sub.add_parser('backbone', help='write the plain timm backbone of a patchhead model as safetensors')
    q.add_argument('source', type=file_or_name,
                   help='checkpoint file, hf-hub:<repo>, local-dir:<folder> or a registered tag')
    q.add_argument('--output', required=True, type=new_file)
    a = p.parse_args(argv)
    try:
        if a.cmd == 'export':
            print(export_folder(a.checkpoint, a.output, repo_id=a.repo_id, table=a.table, overwrite=a.overwrite))
        elif a.cmd == 'push':
            out = push(a.checkpoint, a.repo_id, dry_run=a.dry_run, folder=a.folder, table=a.table, token=a.token,
                       private=a.private, revision=a.revision, overwrite=a.overwrite)
            print(out if a.dry_run else f'pushed to {a.repo_id}: {out}')
        else:
            print(export_backbone(a.source, a.output))
    except (CheckpointError, FileExistsError, FileNotFoundError, RuntimeError, ValueError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
