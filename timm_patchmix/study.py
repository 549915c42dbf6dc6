"""The study behind docs/RESULTS.md: the main table, the paper's ablations, the search's K, FGSM and transfer.

    python -m timm_patchmix.study --output output/study --jobs 2     # Fashion-MNIST, ResNet-8, 60 epochs, 2 cores
    python -m timm_patchmix.study --quick --output /tmp/study        # every task at tiny size (embedded data)
    python -m timm_patchmix.study --output output/study_r32 --jobs 2 --model resnet32_cifar --epochs 12  # the
                                                                     # earlier budget (ResNet-32, 12 epochs)

Every run holds out a fixed, seeded 10% of the training split: its images select each run's best epoch and score the
search's genes; the numbers reported are on the test split alone, evaluated once at the end of each run.

Tasks (seeds ``main`` for the main table, ``ablation`` for the rest):

- the main table: Base, Mixup, CutMix, Random PatchMix (f_T), the search on f_T, Guided PatchMix (f_O on the image
  loss L_O); FGSM top-1 at each ``fgsm`` eps on the test split for these five;
- Random PatchMix ablations: grid 2x2 and 8x8, image loss only, patch loss only, ``--patchmix-prob 0.5``, the paper's
  ``batch`` mode; Guided PatchMix ablations: fitness ``max``, the clean-share control (``--guided-prob 0
  --random-prob 0.667``, the guided model's mixer without its searched share), f_O on L_T (``--final-loss total``);
- Base at other training-set sizes (the learning curve that places the budget);
- the search's K: searches at each K of ``k_sweep`` on the first main seed's f_T, and how far each table's hardness
  carries to fresh image pairs (:func:`timm_patchmix.search.generalise.table_generalisation`);
- transfer to scikit-learn's digits (``--dataset sklearn_digits``): the Base, Random and Guided PatchMix models of
  each main seed, exported as Hub folders and trained through ``--model local-dir:... --pretrained --reset-head``,
  as a linear probe (``--linear-probe``) and fully fine-tuned, beside the same network trained from scratch.

Each task writes ``done.json`` in its folder under ``--output``; a rerun skips finished tasks and an interrupted
training or search resumes from its state file. ``study.json`` records the study's settings: a rerun with others
stops with exit status 2 before anything runs. ``--jobs N`` runs N tasks at once in child processes with
``--threads`` threads each. ``report.md``, ``report.json`` and the figures (``curves.png``, ``ablations.png``,
``learning_curve.png``, ``k_sweep.png``, ``transfer.png``) are written at the end, or alone with ``--report``.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checkpoint import WriteError, atomic_write_text, clean_stale_temps, release_temp, temp_dir
from .cli_types import backbone_name, directory
from .locking import FolderBusyError, hold_folder
from .settings import (INTERRUPTED, INTEGER, NUMBER, OBJECT, USAGE_ERROR, SettingsChangedError, check_settings,
                       foreign_output, read_record, read_settings, write_settings)

__all__ = ['FULL', 'QUICK', 'Task', 'build_tasks', 'main', 'cli']

# The budget: 1,000 training images (of the 54,000 not held out), 60 epochs of the paper's CIFAR optimiser on
# ResNet-8 (He et al.'s CIFAR family at one block per stage), channels-last, two tasks at a time with one thread each.
# ResNet-8 costs about a quarter of ResNet-32 per image on a CPU, which buys the epochs: at 12 epochs ResNet-32 was
# still under-fitting (Base's training loss 0.52). Base's learning curve (``lc_sizes``) shows where this budget sits.
FULL: Dict[str, Any] = {
    'dataset': 'fashion_mnist', 'model': 'resnet8_cifar', 'holdout': 0.1, 'holdout_seed': 0,
    'train_subset': 1000, 'val_subset': 500, 'test_subset': 2000, 'epochs': 60, 'batch_size': 100, 'workers': 0,
    'main_seeds': [0, 1, 2], 'ablation_seeds': [0, 1],
    'search': {'population': 100, 'generations': 30, 'k': 8},
    'k_sweep': {'ks': [2, 8, 16], 'population': 100, 'generations': 30, 'fresh_k': 32, 'random_masks': 16},
    'fgsm': [0.1, 0.2, 0.3], 'lc_sizes': [250, 500, 2000],
    'transfer': {'dataset': 'sklearn_digits', 'epochs': 6, 'lr_probe': 0.1, 'lr_finetune': 0.01},
}
QUICK: Dict[str, Any] = {
    'dataset': '', 'model': 'resnet32_cifar', 'holdout': 0.1, 'holdout_seed': 0,
    'train_subset': 96, 'val_subset': 48, 'test_subset': 48, 'epochs': 1, 'batch_size': 32, 'workers': 0,
    'main_seeds': [0, 1], 'ablation_seeds': [0],
    'search': {'population': 6, 'generations': 2, 'k': 2},
    'k_sweep': {'ks': [1, 2], 'population': 6, 'generations': 2, 'fresh_k': 2, 'random_masks': 2},
    'fgsm': [0.1], 'lc_sizes': [48],
    'transfer': {'dataset': 'sklearn_digits', 'epochs': 1, 'lr_probe': 0.1, 'lr_finetune': 0.01,
                 'train_subset': 96, 'test_subset': 48},
}

MAIN = ('base', 'mixup', 'cutmix', 'random_pm', 'guided_pm')
RPM_ABLATIONS = {  # name: (label, extra train.py flags on top of Random PatchMix)
    'rpm_grid2': ('grid 2×2', ['--patchmix-grid', '2']),
    'rpm_grid8': ('grid 8×8', ['--patchmix-grid', '8']),
    'rpm_image_loss': ('image loss L_O only', ['--no-patch-loss']),
    'rpm_patch_loss': ('patch loss L_P only', ['--no-image-loss']),
    'rpm_prob05': ('--patchmix-prob 0.5', ['--patchmix-prob', '0.5']),
    'rpm_batch': ('batch mode (one mask per batch)', ['--patchmix-mode', 'batch']),
}
GPM_ABLATIONS = {  # name: (label, search task kind, extra flags)
    'gpm_max': ('fitness max (easiest samples)', 'search_max', []),
    'gpm_control': ('clean-share control (--guided-prob 0 --random-prob 0.667)', 'search',
                    ['--guided-prob', '0', '--random-prob', '0.667']),
    'gpm_total': ('f_O on L_T (--final-loss total)', 'search', None),
}
LABELS = {'base': 'Base', 'mixup': 'Mixup (α=1)', 'cutmix': 'CutMix (α=1)', 'random_pm': 'Random PatchMix',
          'guided_pm': 'Guided PatchMix'}
STUDY_FILE = 'study.json'


@dataclass
class Task:
    """One unit of the study: ``kind`` is ``train``, ``search``, ``export`` or ``generalise``; ``deps`` must be
    done first; ``spec`` says what to run."""
    name: str
    kind: str
    deps: List[str] = field(default_factory=list)
    spec: Dict[str, Any] = field(default_factory=dict)


def _train_flags(cfg: Dict[str, Any], seed: int, extra: Sequence[str], train_subset: Optional[int] = None,
                 epochs: Optional[int] = None) -> List[str]:
    flags = ['--dataset', cfg['dataset'], '--recipe', 'paper-cifar', '--seed', str(seed),
             '--holdout', repr(cfg['holdout']), '--holdout-seed', str(cfg['holdout_seed']),
             '--train-subset', str(train_subset or cfg['train_subset']), '--val-subset', str(cfg['val_subset']),
             '--test-subset', str(cfg['test_subset']), '--epochs', str(epochs or cfg['epochs']),
             '-b', str(cfg['batch_size']), '-j', str(cfg['workers']), '--channels-last']
    return flags + list(extra)


def _search_spec(cfg: Dict[str, Any], seed: int, k: int, fitness: str = 'min', population: Optional[int] = None,
                 generations: Optional[int] = None) -> Dict[str, Any]:
    s = cfg['search']
    return {'seed': seed, 'flags': ['--population', str(population or s['population']),
                                    '--generations', str(generations or s['generations']), '--k', str(k),
                                    '--fitness', fitness, '--val-split', 'holdout']}


def build_tasks(cfg: Dict[str, Any]) -> Dict[str, Task]:
    """Every task of the study with settings ``cfg`` (:data:`FULL` or :data:`QUICK`), in a runnable order."""
    model, head = cfg['model'], f'patchhead_{cfg["model"]}'
    fgsm = ['--fgsm'] + [repr(e) for e in cfg['fgsm']]
    tasks: List[Task] = []

    def train(name, seed, extra, deps=(), table_from=None, **kw):
        tasks.append(Task(f'{name}/s{seed}', 'train', list(deps) + ([table_from] if table_from else []),
                          {'method': name, 'seed': seed, 'flags': _train_flags(cfg, seed, extra, **kw),
                           'table_from': table_from}))

    rpm = ['--model', head, '--patchmix']
    guided = ['--model', head, '--patchmix']
    for s in cfg['main_seeds']:
        train('base', s, ['--model', model] + fgsm)
        train('mixup', s, ['--model', model, '--mixup', '1.0'] + fgsm)
        train('cutmix', s, ['--model', model, '--cutmix', '1.0'] + fgsm)
        train('random_pm', s, rpm + fgsm)
        tasks.append(Task(f'search/s{s}', 'search', [f'random_pm/s{s}'], _search_spec(cfg, s, cfg['search']['k'])))
        train('guided_pm', s, guided + ['--no-patch-loss'] + fgsm, table_from=f'search/s{s}')
    for s in cfg['ablation_seeds']:
        for name, (_, extra) in RPM_ABLATIONS.items():
            train(name, s, rpm + extra)
        tasks.append(Task(f'search_max/s{s}', 'search', [f'random_pm/s{s}'],
                          _search_spec(cfg, s, cfg['search']['k'], 'max')))
        for name, (_, search, extra) in GPM_ABLATIONS.items():
            flags = guided + (['--no-patch-loss'] + extra if extra is not None else [])
            train(name, s, flags, table_from=f'{search}/s{s}')
    s0 = cfg['main_seeds'][0]
    for n in cfg['lc_sizes']:
        if n != cfg['train_subset']:  # (that size is Base's own run, which the curve reads)
            train(f'base_n{n}', s0, ['--model', model], train_subset=n)
    ks = cfg['k_sweep']
    same = (ks['population'], ks['generations']) == (cfg['search']['population'], cfg['search']['generations'])
    for k in ks['ks']:
        search = f'search/s{s0}'  # the main table's search when it is this one
        if not (same and k == cfg['search']['k']):
            search = f'k_sweep/k{k}'
            tasks.append(Task(search, 'search', [f'random_pm/s{s0}'],
                              _search_spec(cfg, s0, k, population=ks['population'], generations=ks['generations'])))
        tasks.append(Task(f'k_sweep/k{k}_generalise', 'generalise', [search],
                          {'search': search, 'checkpoint_from': f'random_pm/s{s0}', 'seed': s0, 'k': k,
                           'fresh_k': ks['fresh_k'], 'random_masks': ks['random_masks']}))
    for s in cfg['main_seeds']:
        for source in ('base', 'random_pm', 'guided_pm'):
            trained = next(t for t in tasks if t.name == f'{source}/s{s}')
            tasks.append(Task(f'export/{source}_s{s}', 'export', [f'{source}/s{s}'],
                              {'from': f'{source}/s{s}', 'table_from': trained.spec.get('table_from')}))
            # a patchhead_ model trains on the image loss alone, as the plain model does: the same loss for every
            # source, so the sources alone differ
            image_only = ['--no-patch-loss'] if source != 'base' else []
            for mode in ('probe', 'finetune'):
                tasks.append(_transfer_task(cfg, f'transfer_{mode}/{source}_s{s}', s, mode,
                                            ['--pretrained', '--reset-head'] + image_only,
                                            export=f'export/{source}_s{s}'))
        tasks.append(_transfer_task(cfg, f'transfer_finetune/scratch_s{s}', s, 'finetune', ['--model', model]))
    return {t.name: t for t in tasks}


def _transfer_task(cfg, name, seed, mode, extra, export=None) -> Task:
    tr = cfg['transfer']
    flags = ['--dataset', tr['dataset'], '--recipe', 'paper-cifar', '--seed', str(seed),
             '--holdout', repr(cfg['holdout']), '--holdout-seed', str(cfg['holdout_seed']),
             '--epochs', str(tr['epochs']), '-b', str(cfg['batch_size']), '-j', str(cfg['workers']),
             '--num-classes', '10', '--channels-last',
             '--lr', repr(tr['lr_probe'] if mode == 'probe' else tr['lr_finetune'])]
    for key in ('train_subset', 'test_subset'):
        if key in tr:
            flags += [f'--{key.replace("_", "-")}', str(tr[key])]
    flags += (['--linear-probe'] if mode == 'probe' else []) + list(extra)
    return Task(name, 'train', [export] if export else [],
                {'method': name.split('/')[0], 'seed': seed, 'flags': flags, 'export_from': export})


# ---------------------------------------------------------------------------------------------------------------
# running one task

def _folder(out: str, name: str) -> str:
    return os.path.join(out, *name.split('/'))


class TaskRecordError(RuntimeError):
    """A finished task's ``done.json`` that cannot be read as its record (truncated, edited, another format), or a
    file a finished task made that a later task reads and that is gone: the message names the file and the task
    folder to delete so that a rerun runs that task again."""


# a train task's epoch rows as the report and figures read them: one or more, each with its loss and top-1
EPOCH_ROWS = (lambda v: isinstance(v, list) and len(v) > 0 and all(
    isinstance(r, dict) and NUMBER[0](r.get('train_loss')) and NUMBER[0](r.get('eval_top1')) for r in v),
    'a non-empty list of epoch rows, each with a number for train_loss and eval_top1')
# what the report reads from each kind of task's record, besides its wall time, and of which kind
RECORD_KEYS = {'train': {'final_top1': NUMBER, 'best_top1': NUMBER, 'rows': EPOCH_ROWS},
               'search': {'best_fitness': NUMBER}, 'generalise': {'mean': OBJECT, 'genes': INTEGER}, 'export': {}}


def _redo(out: str, name: str) -> str:
    return f'delete {_folder(out, name)} (and the folders of the tasks made from it) to run task {name} again'


def _done_record(out: str, name: str, kind: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """Task ``name``'s ``done.json`` record, None when it is not done. A record must be a JSON object, with the
    wall time and the keys :data:`RECORD_KEYS` gives for ``kind``, each of its kind; else :class:`TaskRecordError`."""
    path = os.path.join(_folder(out, name), 'done.json')
    if not os.path.lexists(path):  # (one that is no file is read, and named: a rerun could not write its own)
        return None
    need = {'wall_s': NUMBER, **RECORD_KEYS.get(kind, {})} if kind is not None else {}
    noun = f'record of a finished {kind} task' if kind else 'task record'
    return read_record(path, noun, _redo(out, name), TaskRecordError, need)


def _task_file(out: str, name: str, file: str) -> str:
    """``file`` in the folder of finished task ``name``, as a later task reads it: found through the study's own
    layout (``--output``/``name``), not the path its ``done.json`` recorded, so that a study run from another
    directory or moved elsewhere reads its own tasks' files; :class:`TaskRecordError` when it is gone."""
    path = os.path.join(_folder(out, name), file)
    if not os.path.exists(path):
        raise TaskRecordError(f'{path} is missing, though task {name} is marked done; restore it, or '
                              f'{_redo(out, name)}')
    return path


def _mark(out: str, name: str, info: Dict[str, Any]) -> None:
    atomic_write_text(os.path.join(_folder(out, name), 'done.json'), json.dumps(info, indent=1))


def run_task(out: str, task: Task) -> Dict[str, Any]:
    """Run ``task`` (its dependencies done) unless it is done; its ``done.json`` record."""
    done = _done_record(out, task.name, task.kind)
    if done is not None:
        return done
    folder = _folder(out, task.name)
    os.makedirs(folder, exist_ok=True)
    started = time.monotonic()
    info = {'train': _run_train, 'search': _run_search, 'export': _run_export,
            'generalise': _run_generalise}[task.kind](out, task, folder)
    info.update(task=task.name, kind=task.kind, wall_s=round(time.monotonic() - started, 1))
    _mark(out, task.name, info)
    return info


class TaskConfigError(RuntimeError):
    """A task's train.py or search.py flags that their parser refuses (its message)."""


def _parse(parse_config, flags: List[str], what: str):
    """``parse_config(flags)``, with the usage error argparse would exit with (status 2) raised as
    :class:`TaskConfigError` and its message, so that one task's refused flags fail that task alone."""
    import contextlib
    import io
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = parse_config(flags)
    except SystemExit as e:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        why = lines[-1] if lines else f'exit status {e.code}'
        raise TaskConfigError(f'{what} refused the task\'s flags: {why}') from None
    except BaseException:
        sys.stderr.write(err.getvalue())
        raise
    sys.stderr.write(err.getvalue())
    return cfg


def _run_train(out: str, task: Task, folder: str) -> Dict[str, Any]:
    from .engine import train
    from .pipeline import run_record
    from .train import parse_config
    spec = task.spec
    flags = list(spec['flags']) + ['--output', os.path.dirname(folder), '--experiment', os.path.basename(folder),
                                   '--no-progress', '--log-interval', '1000000']
    if spec.get('table_from'):
        flags += ['--patchmix-table', _task_file(out, spec['table_from'], 'masks.json')]
    if spec.get('export_from'):
        flags += ['--model', 'local-dir:' + _task_file(out, spec['export_from'], 'hub')]
    state = os.path.join(folder, 'state.safetensors')
    if os.path.isfile(state):
        flags += ['--resume', state]
    res = train(_parse(parse_config, flags, 'train.py'), log_data_config=False)
    info = run_record(spec['method'], spec['seed'], folder, res)
    info['rows'] = [{k: r.get(k) for k in ('epoch', 'train_loss', 'eval_loss', 'eval_top1')} for r in res.rows]
    if res.fgsm is not None:
        info['fgsm'] = {repr(float(k)): v for k, v in res.fgsm.items()}
    return info


def _run_search(out: str, task: Task, folder: str) -> Dict[str, Any]:
    from .search import parse_config, search
    ck = _task_file(out, task.deps[0], 'best.safetensors')
    flags = ['--checkpoint', ck, '--output', folder, '--seed', str(task.spec['seed']), '--no-progress']
    flags += task.spec['flags']
    if os.path.isfile(os.path.join(folder, 'search_state.safetensors')):
        flags.append('--resume')
    res = search(_parse(parse_config, flags, 'search.py'))
    return {'table': os.path.join(folder, 'masks.json'), 'best_fitness': res.best_fitness,
            'pairs': len(res.table.pairs), 'checkpoint': ck}


def _run_export(out: str, task: Task, folder: str) -> Dict[str, Any]:
    """The source model as a Hub folder (``config.json`` + ``model.safetensors``) that ``local-dir:`` loads: a
    ``patchhead_`` model through the Hub export, a plain model through timm's ``save_for_hf``."""
    import timm.models
    from .hub import export_folder
    from .hub.load import model_from_weights
    ck = _task_file(out, task.spec['from'], 'best.safetensors')
    dest = os.path.join(folder, 'hub')
    model, meta = model_from_weights(ck)
    if meta['model'].startswith('patchhead_'):
        # the table it trained on, through the study's own layout (the path its weights recorded is gone once the
        # study has moved)
        table = _task_file(out, task.spec['table_from'], 'masks.json') if task.spec.get('table_from') else None
        export_folder(ck, dest, overwrite=True, table=table)
    else:
        # built in a temporary folder of the project's own naming, so a killed export leaves nothing that a
        # rerun takes for the result, and the rerun's clean_stale_temps removes it
        clean_stale_temps(folder)
        tmp = temp_dir(dest)
        try:
            timm.models.save_for_hf(model, tmp, safe_serialization=True)
            if os.path.isdir(dest):  # a run killed between this rename and its done.json
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            release_temp(tmp)
    return {'folder': dest, 'checkpoint': ck, 'model': meta['model']}


def _run_generalise(out: str, task: Task, folder: str) -> Dict[str, Any]:
    from .search.generalise import table_generalisation
    spec = task.spec
    table = _task_file(out, spec['search'], 'masks.json')
    ck = _task_file(out, spec['checkpoint_from'], 'best.safetensors')
    res = table_generalisation(ck, table, fresh_k=spec['fresh_k'], random_masks=spec['random_masks'],
                               seed=spec['seed'])
    atomic_write_text(os.path.join(folder, 'generalise.json'), json.dumps(res, indent=1))
    return {'mean': res['mean'], 'genes': len(res['genes']), 'k': res['k'], 'fresh_from': res['fresh_from'],
            'seconds': res['seconds']}


# ---------------------------------------------------------------------------------------------------------------
# scheduling

def _needed(tasks: Dict[str, Task], patterns: Optional[Sequence[str]]) -> List[str]:
    """Task names to run, in order: those matching ``patterns`` (all without) and their dependencies."""
    want = [n for n in tasks if not patterns or any(fnmatch.fnmatch(n, p) for p in patterns)]
    need, stack = set(), list(want)
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(tasks[n].deps)
    return [n for n in tasks if n in need]


def schedule(out: str, tasks: Dict[str, Task], names: List[str], jobs: int, threads: int, study_args: List[str],
             log=print) -> List[str]:
    """Run ``names`` with at most ``jobs`` at once (in this process when 1; child processes get ``study_args``,
    the flags that chose the study's settings, see :func:`~timm_patchmix.children.run_children`); the names that
    failed (with those that depend on them)."""
    pending = [n for n in names if _done_record(out, n, tasks[n].kind) is None]
    if jobs > 1:
        from .children import child_command, run_children
        return run_children(
            pending, {n: t.deps for n, t in tasks.items()}, slots=jobs, threads=threads,
            command=lambda n: child_command('study', ['--output', out, '--run-task', n, '--threads', str(threads)]
                                            + list(study_args)),
            log_path=lambda n: os.path.join(_folder(out, n), 'log.txt'), label=lambda n: f'[study] {n}',
            is_done=lambda n: _done_record(out, n, tasks[n].kind) is not None, noun='task', log=log)
    failed: List[str] = []
    while pending:
        blocked = [n for n in pending if any(d in failed for d in tasks[n].deps)]
        for n in blocked:
            pending.remove(n)
            failed.append(n)
            log(f'[study] skipped {n}: a task it needs failed')
        ready = [n for n in pending if all(_done_record(out, d, tasks[d].kind) is not None for d in tasks[n].deps)]
        if not ready:
            break
        n = ready[0]
        pending.remove(n)
        log(f'[study] running {n}')
        try:
            info = run_task(out, tasks[n])
            log(f'[study] done {n} ({info["wall_s"]:.0f} s)')
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- one task's failure must not stop the others
            failed.append(n)
            log(f'[study] FAILED {n}: {type(e).__name__}: {e}')
    return failed


# ---------------------------------------------------------------------------------------------------------------
# the report

def _mean_std(v: List[float]) -> Tuple[float, Optional[float]]:
    return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else None)


def _fmt(v: List[float]) -> str:
    if not v:
        return '–'
    m, s = _mean_std(v)
    return f'{m:.2f} ± {s:.2f}' if s is not None else f'{m:.2f}'


def collect(out: str, tasks: Dict[str, Task]) -> Dict[str, Any]:
    """The finished tasks' records grouped for the report: ``runs[method][seed]``, ``searches``, ``generalise``."""
    runs: Dict[str, Dict[int, Dict[str, Any]]] = {}
    other: Dict[str, Dict[str, Any]] = {}
    for n, t in tasks.items():
        rec = _done_record(out, n, t.kind)
        if rec is None:
            continue
        if t.kind == 'train':
            key = n.split('/')[0]
            if key.startswith('transfer_'):
                key = n.rsplit('_s', 1)[0]
            runs.setdefault(key, {})[t.spec['seed']] = rec
        else:
            other[n] = rec
    return {'runs': {k: v for k, v in runs.items() if v}, 'other': other}


def _values(runs, key, field_='final_top1', seeds=None) -> List[float]:
    return [r[field_] for s, r in sorted(runs.get(key, {}).items())
            if (seeds is None or s in seeds) and r.get(field_) is not None]


def _images(runs, cfg: Dict[str, Any]) -> Dict[str, Dict[str, Optional[int]]]:
    """The training, held-out and test images of the main runs: ``asked`` (the study's subsets) and ``used``, what
    the first finished main run's record gives (None while none has finished): a split with fewer images than the
    subset asked for trains or scores on all it has."""
    used = next((r['splits'] for m in MAIN for _, r in sorted(runs.get(m, {}).items())
                 if isinstance(r.get('splits'), dict) and r['splits'].get('holdout') is not None), {})
    out: Dict[str, Dict[str, Optional[int]]] = {}
    for key in ('train', 'val', 'test'):
        n = used.get(f'{key}_images')
        out[key] = {'asked': cfg[f'{key}_subset'],
                    'used': n if isinstance(n, int) and not isinstance(n, bool) else None}
    return out


def _size_words(size: Dict[str, Optional[int]]) -> str:
    used, asked = size['used'], size['asked']
    if used is None or used == asked:
        return f'{asked:,}'
    return f'{used:,} (of {asked:,} asked: all the split has)' if used < asked else f'{used:,} ({asked:,} asked)'


def report(out: str, cfg: Dict[str, Any], tasks: Dict[str, Task], quick: bool) -> str:
    """Write ``report.md``, ``report.json`` and the figures to ``out``; returns the Markdown."""
    data = collect(out, tasks)
    runs, other = data['runs'], data['other']
    main_seeds, abl_seeds = cfg['main_seeds'], cfg['ablation_seeds']
    images = _images(runs, cfg)
    lines = [f'# PatchMix study{" (--quick: tiny sizes, the numbers are noise)" if quick else ""}', '',
             f'Dataset `{cfg["dataset"] or "patchshapes"}`, `{cfg["model"]}`, {_size_words(images["train"])} training '
             f'images, {cfg["epochs"]} epochs (`--recipe paper-cifar`, batch {cfg["batch_size"]}); '
             f'{cfg["holdout"] * 100:g}% of the training split held out (seed {cfg["holdout_seed"]}), '
             f'{_size_words(images["val"])} of its images select the best epoch and score the search; top-1 (%) on '
             f'{_size_words(images["test"])} test images, final epoch, mean ± sample std (n − 1) over seeds.', '']
    fg = [repr(float(e)) for e in cfg['fgsm']]
    lines += ['## Main table', '', f'Seeds {main_seeds}. FGSM: top-1 under FGSM at ε (pixels in [0, 1]).', '',
              '| method | test top-1 (final) | test top-1 (best held-out epoch) | ' +
              ' | '.join(f'FGSM ε={e}' for e in fg) + ' | runs |',
              '|---|---|---|' + '---|' * len(fg) + '---|']
    table: Dict[str, Any] = {'main': {}, 'ablations': {}, 'learning_curve': {}, 'k_sweep': {}, 'transfer': {}}
    for m in MAIN:
        final, best = _values(runs, m), _values(runs, m, 'best_top1')
        fgsm = {e: [r['fgsm'][e] for r in runs.get(m, {}).values() if r.get('fgsm') and e in r['fgsm']] for e in fg}
        table['main'][m] = {'final_top1': final, 'best_top1': best, 'fgsm': fgsm}
        lines.append(f'| {LABELS[m]} | {_fmt(final)} | {_fmt(best)} | ' +
                     ' | '.join(_fmt(fgsm[e]) for e in fg) + f' | {len(final)} |')
    lines += ['', f'## Ablations (seeds {abl_seeds}; each row beside its reference on the same seeds)', '',
              '| variant | test top-1 | reference | difference (mean of per-seed differences) |', '|---|---|---|---|']
    for name, label, ref in ([(n, v[0], 'random_pm') for n, v in RPM_ABLATIONS.items()] +
                             [(n, v[0], 'guided_pm') for n, v in GPM_ABLATIONS.items()]):
        v = _values(runs, name, seeds=abl_seeds)
        r = _values(runs, ref, seeds=abl_seeds)
        pairs = [(runs[name][s]['final_top1'] - runs[ref][s]['final_top1']) for s in abl_seeds
                 if s in runs.get(name, {}) and s in runs.get(ref, {})]
        table['ablations'][name] = {'label': label, 'reference': ref, 'final_top1': v, 'reference_top1': r,
                                    'differences': pairs}
        lines.append(f'| {label} | {_fmt(v)} | {LABELS[ref]} {_fmt(r)} | {_fmt(pairs)} |')
    lines += ['', '## Base learning curve (seed %d)' % main_seeds[0], '', '| training images | test top-1 | '
              'best held-out top-1 | final train loss |', '|---|---|---|---|']
    sizes = sorted(set(cfg['lc_sizes']) | {cfg['train_subset']})
    for n in sizes:
        key = 'base' if n == cfg['train_subset'] else f'base_n{n}'
        rec = runs.get(key, {}).get(main_seeds[0])
        if rec:
            table['learning_curve'][n] = {'final_top1': rec['final_top1'], 'holdout_best': rec.get('holdout_best_top1'),
                                          'train_loss': rec['rows'][-1]['train_loss']}
            lines.append(f'| {n:,} | {rec["final_top1"]:.2f} | {rec.get("holdout_best_top1") or 0:.2f} | '
                         f'{rec["rows"][-1]["train_loss"]:.3f} |')
    lines += ['', f'## The search\'s K (f_T of seed {main_seeds[0]})', '',
              'Mean score (patch accuracy, lower = harder) over the table\'s genes of the chosen masks and of random '
              'masks of the same class pairs, on the search\'s own K image pairs and on fresh pairs; gap = random − '
              'chosen; retained = fresh gap / search gap. Random masks as Random PatchMix draws them, and (matched) '
              'with the chosen mask\'s number of partner cells at random positions. Search wall s: the invocation that '
              'finished the search.', '',
              '| K | genes | chosen (search) | chosen (fresh) | random (search) | random (fresh) | gap search | '
              'gap fresh | retained | matched: gap fresh | matched: retained | search wall s |',
              '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for k in cfg['k_sweep']['ks']:
        g = other.get(f'k_sweep/k{k}_generalise')
        s = g and other.get(tasks[f'k_sweep/k{k}_generalise'].spec['search'])
        if not (s and g):
            continue
        m = g['mean']
        table['k_sweep'][k] = {'mean': m, 'best_fitness': s['best_fitness'], 'search_wall_s': s['wall_s'],
                               'genes': g['genes']}

        def f(v):
            return '–' if v is None else f'{v:.3f}'
        pm, mt = 'patchmix', 'matched'
        lines.append(f'| {k} | {g["genes"]} | {f(m["chosen_search"])} | {f(m["chosen_fresh"])} | '
                     f'{f(m["random_search"][pm])} | {f(m["random_fresh"][pm])} | {f(m["gap_search"][pm])} | '
                     f'{f(m["gap_fresh"][pm])} | {f(m["retained"][pm])} | {f(m["gap_fresh"][mt])} | '
                     f'{f(m["retained"][mt])} | {s["wall_s"]:.0f} |')
    lines += ['', f'## Transfer to `{cfg["transfer"]["dataset"]}` (seeds {main_seeds}; source model of the same seed)',
              '', '| source | linear probe | full fine-tune |', '|---|---|---|']
    for source in ('scratch', 'base', 'random_pm', 'guided_pm'):
        lp = _values(runs, f'transfer_probe/{source}')
        ft = _values(runs, f'transfer_finetune/{source}')
        table['transfer'][source] = {'probe': lp, 'finetune': ft}
        label = 'none (from scratch)' if source == 'scratch' else LABELS[source]
        lines.append(f'| {label} | {_fmt(lp)} | {_fmt(ft)} |')
    walls = [r['wall_s'] for v in runs.values() for r in v.values()] + [r['wall_s'] for r in other.values()]
    lines += ['', f'Tasks finished: {sum(len(v) for v in runs.values()) + len(other)} of {len(tasks)}; their wall '
              f'times add up to {sum(walls) / 60:.1f} min (tasks run side by side with --jobs overlap; a task '
              f'stopped and resumed counts from its resume).']
    text = '\n'.join(lines) + '\n'
    figures(out, cfg, runs, table)
    atomic_write_text(os.path.join(out, 'report.md'), text)
    atomic_write_text(os.path.join(out, 'report.json'), json.dumps(
        {'settings': cfg, 'quick': quick, 'tables': table, 'images': images,
         'wall_s': dict({n: r['wall_s'] for n, r in other.items()},
                        **{f'{k}/s{s}': r['wall_s'] for k, v in runs.items() for s, r in v.items()})},
        indent=1, default=str))
    return text


def figures(out: str, cfg: Dict[str, Any], runs, table) -> None:
    """``curves.png`` (held-out top-1 per epoch, mean over the main seeds), ``ablations.png`` (mean ± std test
    top-1 of each ablation beside its reference), ``learning_curve.png``, ``k_sweep.png`` and ``transfer.png``."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from .checkpoint import atomic_write_bytes
    import io

    def save(fig, name):
        buf = io.BytesIO()
        fig.savefig(buf, format='png', dpi=110, bbox_inches='tight')
        plt.close(fig)
        atomic_write_bytes(os.path.join(out, name), buf.getvalue())

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in MAIN:
        curves = [[row['eval_top1'] for row in r['rows']] for r in runs.get(m, {}).values()]
        if curves:
            n = min(len(c) for c in curves)
            ax.plot(range(1, n + 1), [statistics.mean(c[i] for c in curves) for i in range(n)], label=LABELS[m])
    ax.set_xlabel('epoch')
    ax.set_ylabel('held-out top-1 (%)')
    ax.set_title('Held-out top-1 per epoch (mean over seeds)')
    ax.legend()
    save(fig, 'curves.png')

    rows = [(LABELS[m], table['main'][m]['final_top1']) for m in MAIN]
    rows += [(v['label'], v['final_top1']) for v in table['ablations'].values()]
    rows = [(label, v) for label, v in rows if v]
    fig, ax = plt.subplots(figsize=(7, 0.35 * max(len(rows), 1) + 1))
    for i, (label, v) in enumerate(rows):
        m, s = _mean_std(v)
        ax.barh(i, m, xerr=s or 0, color='tab:blue' if i < len(MAIN) else 'tab:orange')
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    lo = min((min(v) for _, v in rows), default=0)
    ax.set_xlim(max(0, lo - 5), 100)
    ax.set_xlabel('test top-1 (%), mean ± sample std over seeds')
    save(fig, 'ablations.png')

    lc = table['learning_curve']
    fig, ax = plt.subplots(figsize=(5, 3.5))
    if lc:
        ns = sorted(lc)
        ax.plot(ns, [lc[n]['final_top1'] for n in ns], 'o-')
        ax.set_xscale('log')
    ax.set_xlabel('training images')
    ax.set_ylabel('Base test top-1 (%)')
    save(fig, 'learning_curve.png')

    ks = table['k_sweep']
    fig, ax = plt.subplots(figsize=(5, 3.5))
    if ks:
        kk = sorted(ks)
        for key, label in (('gap_search', 'gap on the search pairs'), ('gap_fresh', 'gap on fresh pairs')):
            ax.plot(kk, [ks[k]['mean'][key]['patchmix'] for k in kk], 'o-', label=label)
        ax.set_xscale('log', base=2)
        ax.legend()
    ax.set_xlabel('K (image pairs per class pair)')
    ax.set_ylabel('random − chosen score')
    save(fig, 'k_sweep.png')

    fig, ax = plt.subplots(figsize=(6, 3.5))
    tr = table['transfer']
    names = [s for s in tr if tr[s]['probe'] or tr[s]['finetune']]
    for j, mode in enumerate(('probe', 'finetune')):
        for i, s in enumerate(names):
            if tr[s][mode]:
                m, sd = _mean_std(tr[s][mode])
                ax.bar(i + 0.4 * j, m, 0.4, yerr=sd or 0, color=('tab:green', 'tab:purple')[j],
                       label=('linear probe', 'full fine-tune')[j] if i == 0 or not tr[names[0]][mode] else None)
    ax.set_xticks([i + 0.2 for i in range(len(names))])
    ax.set_xticklabels(['scratch' if s == 'scratch' else LABELS[s] for s in names], fontsize=8)
    ax.set_ylabel('test top-1 (%)')
    if names:
        ax.legend()
    save(fig, 'transfer.png')


# ---------------------------------------------------------------------------------------------------------------
# command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m timm_patchmix.study', description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--output', default='output/study', type=directory,
                   help='folder of the study (default: output/study)')
    p.add_argument('--quick', action='store_true', help='every task at tiny size on the embedded data (a check '
                   'that the study runs; its numbers are noise)')
    p.add_argument('--epochs', type=int,
                   help=f'epochs of every Fashion-MNIST training (default: {FULL["epochs"]}, {QUICK["epochs"]} with '
                        '--quick); a longer budget for a machine with more time, recorded in study.json')
    p.add_argument('--model', type=backbone_name,
                   help=f'the backbone of every Fashion-MNIST training (default: {FULL["model"]}, {QUICK["model"]} '
                        'with --quick; its patchhead_ version for the PatchMix runs), recorded in study.json')
    p.add_argument('--train-subset', type=int,
                   help=f'training images of every Fashion-MNIST training (default: {FULL["train_subset"]:,}, '
                        f'{QUICK["train_subset"]} with --quick)')
    p.add_argument('--jobs', type=int, default=1, help='tasks run at once, each in its own process (default: 1, '
                   'in this process)')
    p.add_argument('--threads', type=int, default=0, help='torch threads per task (default: the cores / --jobs)')
    p.add_argument('--tasks', nargs='+', metavar='PATTERN', help='run only the tasks matching these glob '
                   'patterns (and what they need), e.g. "transfer_*" or "base/*"')
    p.add_argument('--list', action='store_true', help='list the tasks, whether done, and exit')
    p.add_argument('--report', action='store_true', help='write the report from the finished tasks and exit')
    p.add_argument('--run-task', help=argparse.SUPPRESS)
    return p


def _settings(cfg: Dict[str, Any], quick: bool) -> Dict[str, Any]:
    return {'quick': quick, 'settings': cfg}


def main(argv=None, log=print) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ('jobs', 'epochs', 'train_subset'):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f'--{flag.replace("_", "-")} must be >= 1, got {getattr(args, flag)}')
    if args.threads < 0:
        parser.error(f'--threads must be >= 0 (0: the cores / --jobs), got {args.threads}')
    overrides = {k: v for k, v in (('epochs', args.epochs), ('train_subset', args.train_subset),
                                   ('model', args.model)) if v is not None}
    cfg = dict(QUICK if args.quick else FULL, **overrides)
    tasks = build_tasks(cfg)
    budget_args = [a for k, v in overrides.items() for a in (f'--{k.replace("_", "-")}', str(v))]
    from .children import cores
    threads = args.threads or max(1, cores() // args.jobs)
    if args.run_task:  # a child of --jobs N
        from .children import follow_parent
        follow_parent()
        import torch
        torch.set_num_threads(threads)
        run_task(args.output, tasks[args.run_task])
        return 0
    record = os.path.join(args.output, STUDY_FILE)
    recorded = read_settings(record)
    if (args.report or args.list) and recorded is not None and not args.quick and not overrides:
        # the modes that only read take the study's budget from its record, so its flags need not be given again
        try:
            cfg, args.quick = dict(recorded['settings']), recorded['quick']
            tasks = build_tasks(cfg)
        except (KeyError, TypeError, ValueError) as e:
            raise SettingsChangedError(f'{record} does not record a study\'s settings ({type(e).__name__}: {e}); '
                                       f'give the study\'s flags (--quick, --epochs...) with --report') from None
    if args.report and recorded is None:  # --report reads a study; it writes its report, not its settings
        parser.error(f'--report: {args.output} holds no study ({STUDY_FILE} is missing); give the --output of a '
                     f'study')
    now = json.loads(json.dumps(_settings(cfg, args.quick)))
    if recorded is None and not args.list:  # (a study's own folder has its record; a pipeline's has report.md)
        problem = foreign_output(args.output)
        if problem:
            raise SettingsChangedError(problem)
    if recorded is not None:
        check_settings(recorded, now, f'cannot reuse {args.output}: it was made',
                       'Rerun with the settings it was made with (--quick or not), or choose another --output.')
        if recorded != now:
            raise SettingsChangedError(f'cannot reuse {args.output}: its {STUDY_FILE} records other settings; '
                                       f'choose another --output')
    if args.list:
        for n, t in tasks.items():
            log(f'{"done" if _done_record(args.output, n, t.kind) else "    "}  {n}  ({t.kind})')
        return 0
    if args.tasks and not _needed(tasks, args.tasks):
        raise SystemExit(f'no task matches {args.tasks}; see --list')
    failed = []
    # one study runs its tasks in a folder at a time (a second one stops here); --report only reads the tasks (and
    # writes the report), in the folder of a study that exists
    with hold_folder(args.output, 'study') if not args.report else nullcontext():
        if recorded is None:
            os.makedirs(args.output, exist_ok=True)
            write_settings(record, now)
        if not args.report:
            import torch
            previous = torch.get_num_threads()
            try:
                if args.jobs == 1:
                    torch.set_num_threads(threads)
                started = time.monotonic()
                failed = schedule(args.output, tasks, _needed(tasks, args.tasks), args.jobs, threads,
                                  (['--quick'] if args.quick else []) + budget_args, log)
            finally:
                torch.set_num_threads(previous)  # --threads is for the study's own work; the caller keeps its count
            log(f'[study] this invocation: {(time.monotonic() - started) / 60:.1f} min')
        text = report(args.output, cfg, tasks, args.quick)
    log(text)
    if failed:
        log(f'[study] {len(failed)} task(s) failed or were skipped: {", ".join(failed)}; rerun to retry them')
        return 1
    return 0


def cli(argv=None) -> int:
    from .cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    import logging
    logging.basicConfig(level=logging.WARNING, format='%(message)s')
    try:
        return main(argv)
    except SettingsChangedError as e:
        print(f'error: {e}', file=sys.stderr)
        return USAGE_ERROR
    # another study writes there; a finished task's record is bad; a task's flags refused (a --run-task child); a
    # file cannot be written (full disk, no permission)
    except (FolderBusyError, TaskRecordError, TaskConfigError, WriteError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the tasks started here were stopped with it
        print('interrupted: finished tasks and the epochs and generations saved so far are kept; the same command '
              'goes on from there', file=sys.stderr)
        return INTERRUPTED


if __name__ == '__main__':
    raise SystemExit(cli())
