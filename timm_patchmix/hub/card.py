"""The model card (``README.md``) of a Hub folder, and the metrics it quotes from the run's ``summary.csv`` and, for a
run with a held-out split, its ``results.json`` (the test split's numbers and the protocol)."""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Dict, Optional

from ..checkpoint import CheckpointError

__all__ = ['model_card', 'read_summary', 'read_results', 'training_method']


def read_summary(checkpoint: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), 'summary.csv')
    if not os.path.isfile(path):
        return None
    try:
        with open(path, newline='', encoding='utf-8') as f:
            rows = list(csv.DictReader(f))
        if not rows:
            return None
        scored = [(float(r['eval_top1']), int(r['epoch']) if r.get('epoch') else k)
                  for k, r in enumerate(rows) if r.get('eval_top1')]
        # the highest top-1 and its epoch (max keeps the first of a tie): --eval-metric may have chosen another
        best, best_epoch = max(scored, key=lambda s: s[0]) if scored else (None, None)
        out = {'epochs': len(rows), 'final_top1': scored[-1][0] if scored else None, 'best_top1': best,
               'best_top1_epoch': best_epoch}
        if rows[-1].get('eval_top5'):
            out['final_top5'] = float(rows[-1]['eval_top5'])
    except (OSError, UnicodeDecodeError, csv.Error, ValueError, TypeError) as e:
        raise CheckpointError(f'{path}: eval_top1/eval_top5 must be numbers in a readable CSV ({e})') from None
    return out


def read_results(checkpoint: str) -> Optional[Dict[str, Any]]:
    """The run's ``results.json`` beside ``checkpoint`` when it has a held-out selection split and test numbers:
    ``{'holdout': {...}, 'selection_images', 'test_split', 'test_images', 'final': {...}, 'best': {...}}``; None for
    a run without them (one made without ``--holdout``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), 'results.json')
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding='utf-8') as f:
            doc = json.load(f)
        sel, test = doc.get('selection') or {}, doc.get('test')
        if sel.get('split') != 'holdout' or not test:
            return None
        out = {'holdout': dict(sel['holdout']), 'selection_images': int(sel['images']),
               'test_split': str(test['split']), 'test_images': int(test['images']),
               'final': {'epoch': int(test['final']['epoch']), 'top1': float(test['final']['test_top1'])},
               'best': {'epoch': int(test['best']['epoch']), 'top1': float(test['best']['test_top1'])}}
        out['holdout']['fraction'] = float(out['holdout']['fraction'])
        out['holdout']['seed'] = int(out['holdout']['seed'])
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f'{path}: not a results.json as train.py writes it ({type(e).__name__}: {e})') from None
    return out


def training_method(meta: Dict[str, Any]) -> str:
    """``'guided'``, ``'random'`` or ``'none'``: how the checkpoint of ``meta`` trained (a mask table it recorded
    makes it Guided PatchMix, whatever table is shipped with it; ``--patchmix`` without one, Random PatchMix)."""
    pm = meta.get('patchmix') or {}
    return 'guided' if pm.get('table') else ('random' if pm.get('enabled') else 'none')


def _whose(epoch: Optional[int], best: Optional[int], final: Optional[int]) -> str:
    """Which epoch's weights the card's folder holds, said in one sentence."""
    if epoch is None:
        return ''
    if epoch == best:
        return f' These weights are the best epoch\'s (epoch {epoch}).'
    if epoch == final:
        return f' These weights are the final epoch\'s (epoch {epoch}).'
    if best is None:  # (no held-out selection: the card names no best epoch)
        return f' These weights are epoch {epoch}\'s.'
    return f' These weights are epoch {epoch}\'s, neither the best nor the final one.'


def protocol_lines(metrics: Optional[Dict[str, Any]], results: Optional[Dict[str, Any]],
                   holdout: Optional[Dict[str, Any]] = None, epoch: Optional[int] = None) -> list:
    """The card's "Metrics" section: with a held-out split, the test split's numbers and how the best epoch was
    chosen; without, the numbers of the split the epochs were evaluated on, said to be no held-out test number.
    ``holdout`` (the weights' record of their held-out split) without ``results`` is a run that has not written
    its test numbers (it has not ended): the section says so, and gives no number as a test number. ``epoch``: the
    epoch of the exported weights (best, last or a ``checkpoint-<e>`` file), which the section names."""
    if results is None and holdout:
        return ['', '## Metrics', '',
                f'Protocol: a fixed {float(holdout.get("fraction", 0)) * 100:g}% of the training split (seed '
                f'{holdout.get("seed")}) was held out and never trained on, and chose the best epoch. The run that '
                'made these weights has not written its test-split numbers (`results.json`, written when a run '
                'ends), so this card gives none.' + _whose(epoch, None, None)]

    def mark(e: int) -> str:
        return ' (these weights)' if epoch == e else ''

    if results is not None:
        h = results['holdout']
        return ['', '## Metrics', '',
                f'Protocol: a fixed {h["fraction"] * 100:g}% of the training split (seed {h["seed"]}) was held out '
                f'and never trained on; {results["selection_images"]:,} of its images chose the best epoch. Top-1 on '
                f'the test split (`{results["test_split"]}`, {results["test_images"]:,} images), evaluated once at '
                'the end and used for no choice.' + _whose(epoch, results['best']['epoch'], results['final']['epoch']),
                '',
                f'| epochs | test top-1, final epoch{mark(results["final"]["epoch"])} | test top-1, best held-out '
                f'epoch{mark(results["best"]["epoch"])} |',
                '|---|---|---|',
                f'| {results["final"]["epoch"] + 1} | {results["final"]["top1"]:.2f} | '
                f'{results["best"]["top1"]:.2f} (epoch {results["best"]["epoch"]}) |']
    if metrics and metrics.get('final_top1') is not None:
        return ['', '## Metrics', '',
                'Protocol: no held-out split; the numbers are on the split each epoch was evaluated on, which also '
                'chose the best epoch, so they are not held-out test numbers.'
                + _whose(epoch, None, metrics['epochs'] - 1), '',
                '| epochs | final top-1 | highest top-1 |', '|---|---|---|',
                f'| {metrics["epochs"]} | {metrics["final_top1"]:.2f} | {metrics["best_top1"]:.2f}'
                + (f' (epoch {metrics["best_top1_epoch"]})' if metrics.get('best_top1_epoch') is not None else '')
                + ' |']
    return []


def _score(value: Any, digits: Optional[int] = None) -> str:
    """A table score for the card: ``unknown`` where the table has none (``null``, or NaN in older files)."""
    if value is None or value != value:
        return 'unknown'
    return f'{value:.{digits}f}' if digits is not None else str(value)


def model_card(repo_id: str, arch: str, meta: Dict[str, Any], metrics: Optional[Dict[str, Any]],
               table: Optional[Dict[str, Any]], results: Optional[Dict[str, Any]] = None,
               trained_on_table: Optional[bool] = None) -> str:
    """The card of a Hub folder. ``table``: the ``masks.json`` shipped with the model; ``trained_on_table``:
    whether it is the table the model trained on (default: whether the checkpoint records one)."""
    from ..data import channel_matched, dataset_label
    data = channel_matched(meta.get('data') or {})  # (the values a greyscale run normalised with, as config.json)
    dataset = dataset_label(data.get('dataset') or '', data.get('data_dir') or '')
    pm = meta.get('patchmix') or {}
    kind = training_method(meta)  # the checkpoint's, whatever table is shipped with it
    guided = kind == 'guided'
    if trained_on_table is None:
        trained_on_table = guided
    method = {'guided': 'Guided PatchMix', 'random': 'Random PatchMix', 'none': 'no PatchMix'}[kind]
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
    ]
    if pm.get('image_loss') is False:
        lines += ['**Trained without the image loss** (`--no-image-loss`): the image classifier, which `model(x)` '
                  'returns, never trained. Predict with the patch head, the mean of the cell logits: '
                  '`model.forward_patches(x).mean(1)`, as the trainer evaluated it.', '']
    if pm.get('patch_loss') is False:
        lines += ['**Trained without the patch loss** (`--no-patch-loss` or `--patch-loss-weight 0`): the patch '
                  'head, which `model.forward_patches(x)` returns, never trained; predict with `model(x)`.', '']
    lines += [
        '## Training', '',
        f'- grid: {"x".join(str(g) for g in pm.get("grid") or [4, 4])}',
        f'- data: {dataset}, input size {data.get("input_size")}, mean {data.get("mean")}, std {data.get("std")}',
    ]
    if meta.get('command'):
        lines += [f'- command: `{meta["command"]}`']
    lines += protocol_lines(metrics, results, data.get('holdout'), meta.get('epoch'))
    if table:
        names = table.get('class_names') or [str(i) for i in range(int(table.get('num_classes', 0)))]
        best = table.get('best_fitness')
        what = ('the class pairs and cell masks this model trained on' if trained_on_table and table is not None else
                'the class pairs and cell masks of a search shipped with this model, which it did not train on'
                + (' (the table it trained on differs)' if guided else ''))
        lines += ['', '## Mask table', '', f'`masks.json` (search fitness {_score(best)}): {what}; 1 = the cell comes '
                  'from the first class.', '',
                  '| pair | mask (rows) | score |', '|---|---|---|']
        for p in table.get('pairs', []):
            mask = ' / '.join(''.join(str(int(b)) for b in row) for row in p['mask'])
            a, b = p['classes']
            lines.append(f'| {names[a]} + {names[b]} | `{mask}` | {_score(p.get("score"), 3)} |')
    lines += ['', '## Citation', '', '```bibtex', '@inproceedings{cascante2021patchmix,',
              '  title     = {Evolving Image Compositions for Feature Representation Learning},',
              '  author    = {Cascante-Bonilla, Paola and Sekhon, Arshdeep and Qi, Yanjun and Ordonez, Vicente},',
              '  booktitle = {British Machine Vision Conference (BMVC)},', '  year      = {2021}', '}', '```', '']
    return '\n'.join(lines)
