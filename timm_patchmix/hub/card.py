"""The model card (``README.md``) of a Hub folder, and the metrics it quotes from the run's ``summary.csv``."""
from __future__ import annotations

import csv
import os
from typing import Any, Dict, Optional

from ..checkpoint import CheckpointError

__all__ = ['model_card', 'read_summary']


def read_summary(checkpoint: str) -> Optional[Dict[str, Any]]:
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


def model_card(repo_id: str, arch: str, meta: Dict[str, Any], metrics: Optional[Dict[str, Any]],
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
