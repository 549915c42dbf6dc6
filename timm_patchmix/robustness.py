"""FGSM white-box robustness: top-1 on validation images perturbed by eps * sign(grad of the loss).

    python -m timm_patchmix.robustness --checkpoint output/train/run/best.safetensors --eps 0.1 0.2 0.3

Perturbations are in pixel space with pixels in [0, 1] (the paper's eps = 0.1, 0.2, 0.3); the model sees the
perturbed image after its own mean/std normalisation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Iterable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cli_types import device_name, directory, existing_file, nonneg_float, optional_directory, positive_int

__all__ = ['fgsm_accuracy', 'build_parser', 'main']


class Normalized(nn.Module):
    """``model((x - mean) / std)`` for pixel-space inputs in [0, 1] with ``chans`` channels (statistics given for
    another channel count are adapted as timm's loaders do)."""

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float], chans: int):
        from timm.data.loader import adapt_to_chs
        super().__init__()
        self.model = model
        for name, values in (('mean', mean), ('std', std)):
            stats = torch.tensor(adapt_to_chs(tuple(values), chans), dtype=torch.float32)
            self.register_buffer(name, stats.view(1, -1, 1, 1))

    def forward(self, x):
        return self.model((x - self.mean) / self.std)


def fgsm_accuracy(model: nn.Module, loader: Iterable, eps_list: Sequence[float], mean, std,
                  device=torch.device('cpu')) -> Dict[float, float]:
    """Top-1 accuracy (%) for each eps on ``loader``'s ``(x in [0, 1], y)`` batches; eps 0 is clean accuracy."""
    net = None
    correct = {float(e): 0 for e in eps_list}
    total = 0
    for x, y in loader:
        x, y = x.to(device).float(), y.to(device)
        if net is None:
            net = Normalized(model, mean, std, x.shape[1]).to(device).eval()
        x.requires_grad_(True)
        loss = F.cross_entropy(net(x), y)
        grad, = torch.autograd.grad(loss, x)
        sign = grad.sign()
        with torch.no_grad():
            for e in correct:
                adv = (x + e * sign).clamp_(0.0, 1.0)
                correct[e] += int((net(adv).argmax(1) == y).sum())
        total += y.shape[0]
    return {e: 100.0 * c / max(total, 1) for e, c in correct.items()}


def report(results: Dict[float, float], out_dir: Optional[str] = None) -> None:
    """Print the accuracies and, with ``out_dir``, write them to ``out_dir/fgsm.json`` (atomically)."""
    from .checkpoint import atomic_write_text
    for e, acc in results.items():
        print(f'FGSM eps={e:g}: top-1 {acc:.2f}%')
    if out_dir:
        atomic_write_text(os.path.join(out_dir, 'fgsm.json'),
                          json.dumps({str(k): v for k, v in results.items()}, indent=1))


def build_parser() -> argparse.ArgumentParser:
    from .cli import HelpFormatter, prog_name
    prog = prog_name('timm_patchmix.robustness')
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=HelpFormatter,
        description='FGSM white-box robustness of a saved checkpoint: top-1 on validation images perturbed by\n'
                    'eps * sign(grad of the loss), pixels in [0, 1] (the paper\'s eps = 0.1, 0.2, 0.3); the model '
                    'sees\nthe perturbed image after its own mean/std normalisation. eps 0 (clean) is always added.',
        epilog=f'examples:\n  {prog} --checkpoint output/train/run/best.safetensors\n'
               f'  {prog} --checkpoint output/train/run/best.safetensors --eps 0.05 0.1 --val-subset 1000 '
               f'--output output/train/run')
    parser.add_argument('--checkpoint', required=True, type=existing_file,
                        help='weights written by train.py (last/best.safetensors)')
    parser.add_argument('--eps', type=nonneg_float, nargs='+', default=[0.1, 0.2, 0.3],
                        help='perturbation sizes in pixel units (pixels in [0, 1])')
    parser.add_argument('--dataset', default=None,
                        help='dataset to attack (default: the dataset the checkpoint was trained on)')
    parser.add_argument('--data-dir', default=None, type=optional_directory,
                        help="where the dataset lives (default: the checkpoint's)")
    parser.add_argument('--val-split', default=None,
                        help="the split to evaluate (default: the checkpoint's validation split)")
    parser.add_argument('--val-subset', type=positive_int, default=None,
                        help='evaluate a fixed random subset of this many images (default: the whole split)')
    parser.add_argument('-b', '--batch-size', type=positive_int, default=128, help='images per batch')
    parser.add_argument('--device', default='cpu', type=device_name, help='torch device, e.g. cpu or cuda')
    parser.add_argument('--output', default=None, type=directory,
                        help='write fgsm.json to this folder (default: print only)')
    return parser


def main(argv=None) -> int:
    from .cli import tolerant_stdout
    tolerant_stdout()  # (first: a non-ASCII path or name never fails a print)
    from .data import build_dataset, pixel_transform, recorded_data_config
    from .hub import model_from_weights

    from .checkpoint import CheckpointError, WriteError
    from .locking import folder_problem

    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)  # (checked by its type)
    problem = folder_problem(args.output) if args.output else None
    if problem:  # (before the evaluation, not after it)
        print(f'error: cannot write fgsm.json in --output {args.output}: {" ".join(problem)}', file=sys.stderr)
        return 1
    try:
        model, meta = model_from_weights(args.checkpoint)
        data = meta.get('data', {})
        if args.val_split:
            from .data import split_name_problem
            problem = split_name_problem(args.dataset if args.dataset is not None else data.get('dataset', ''),
                                         args.data_dir if args.data_dir is not None else data.get('data_dir', ''),
                                         args.val_split)
            if problem:
                parser.error(f'argument --val-split: {problem}')
        ds = build_dataset(args.dataset if args.dataset is not None else data.get('dataset', ''),
                           args.data_dir if args.data_dir is not None else data.get('data_dir', ''),
                           args.val_split or data.get('val_split', 'validation'),
                           subset=args.val_subset, class_names=meta.get('class_names') or None,
                           classes_of=f'the model in {args.checkpoint}')
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # a file or dataset it cannot use: exit 1
        print(f'error: {e}', file=sys.stderr)
        return 1
    data = recorded_data_config(data, model)
    if (meta.get('patchmix') or {}).get('image_loss') is False:  # trained without the image loss: as train.py
        from .engine.loop import PatchVote  # evaluates it, by its patch head (its image classifier never trained)
        model = PatchVote(model).eval()
        print(f'{args.checkpoint} was trained without the image loss: evaluating its patch head (the mean of its '
              f'cell logits), as train.py does')
    ds.transform = pixel_transform(*data['input_size'], data['interpolation'], data['crop_pct'])  # as validation
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=False)
    res = fgsm_accuracy(model, loader, [0.0] + list(args.eps), data['mean'], data['std'], device)
    try:
        report(res, args.output)
    except WriteError as e:  # a full disk, a folder made read-only meanwhile (the accuracies are printed)
        print(f'error: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
