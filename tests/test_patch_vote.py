"""A model trained with the patch loss alone (--no-image-loss) is evaluated by its patch head: the mean of the patch
logits over the cells, not the image classifier that never trained."""
import dataclasses

import timm
import torch

import timm_patchmix  # noqa: F401  (registers patchhead_*)
from timm_patchmix.engine.loop import PatchVote, predictor, validate
from timm_patchmix.train import parse_config


def _cfg(*flags):
    cfg = parse_config(['--model', 'patchhead_resnet32_cifar', '--patchmix', '--output', '/tmp/unused'] + list(flags))
    return dataclasses.replace(cfg, patch_head=True, num_classes=10, channels_last=False)


def test_validate_uses_the_patch_vote_without_the_image_loss():
    torch.manual_seed(0)
    model = timm.create_model('patchhead_resnet32_cifar', num_classes=10).eval()
    x = torch.randn(24, 3, 32, 32)
    with torch.no_grad():
        vote = model.forward_patches(x).mean(1)
        image = model(x)
    y = vote.argmax(1)  # labels the patch vote gets right, every one
    assert not torch.equal(image.argmax(1), y)  # the image classifier disagrees somewhere
    loader = [(x[:12], y[:12]), (x[12:], y[12:])]
    patch_only = _cfg('--no-image-loss')
    assert isinstance(predictor(model, patch_only), PatchVote)
    with torch.no_grad():
        res = validate(model, loader, patch_only, torch.device('cpu'))
    assert res['eval_top1'] == 100.0
    assert abs(res['eval_loss'] - float(torch.nn.functional.cross_entropy(vote, y))) < 1e-5
    with torch.no_grad():
        res = validate(model, loader, _cfg(), torch.device('cpu'))  # both losses: the image classifier
    assert predictor(model, _cfg()) is model
    assert res['eval_top1'] == 100.0 * float((image.argmax(1) == y).float().mean())
