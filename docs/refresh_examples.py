"""Replace a shipped example checkpoint (``timm_patchmix/weights/<tag>``) with a new ``train.py`` checkpoint.

    python docs/refresh_examples.py --tag patchhead_resnet32_cifar.gpm_fmnist \\
        --checkpoint output/study/guided_pm/s0/best.safetensors --made-by "python -m timm_patchmix.study (seed 0)"

The folder is the Hub export (``timm_patchmix.hub.export_folder``: weights, ``config.json``, the mask table of a
guided model, a model card that states the protocol) with the card's calls naming the tag, as the package ships it.
The new folder is written beside the old one and swapped in at the end.
"""
import argparse
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--tag', required=True, help='a registered example tag, e.g. patchhead_resnet32_cifar.gpm_fmnist')
    p.add_argument('--checkpoint', required=True, help='train.py checkpoint (best.safetensors)')
    p.add_argument('--made-by', default='', help='how the checkpoint was made, for the card (a command)')
    args = p.parse_args(argv)
    from timm_patchmix.hub import export_folder
    from timm_patchmix.models.pretrained import PATCHHEAD_PRETRAINED, WEIGHTS_DIR
    if args.tag not in PATCHHEAD_PRETRAINED:
        p.error(f'{args.tag} is not a registered example tag ({", ".join(PATCHHEAD_PRETRAINED)})')
    dest = os.path.join(WEIGHTS_DIR, args.tag)
    new = dest + '.new'
    shutil.rmtree(new, ignore_errors=True)
    repo = f'timm-patchmix/{args.tag}'
    export_folder(args.checkpoint, new, repo_id=repo)
    card_path = os.path.join(new, 'README.md')
    with open(card_path, encoding='utf-8') as f:
        card = f.read()
    card = card.replace(f'hf-hub:{repo}', args.tag)
    card = card.replace('```\n\nFine-tune with', '```\n\nThe weights ship inside the `timm_patchmix` package, so these '
                        'calls work offline, from a wheel or a source install.\n\nFine-tune with', 1)
    if args.made_by:
        card = card.replace('## Training\n', f'## Training\n\n- made by: `{args.made_by}`', 1)
    with open(card_path, 'w', encoding='utf-8') as f:
        f.write(card)
    old = dest + '.old'
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(dest):
        os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)
    print(f'wrote {dest}')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
