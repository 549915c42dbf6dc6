"""The paper's CIFAR backbones, registered as ordinary timm models.

All have a 3x3 stem at 32x32 and three stages (strides 1, 2, 2), so a 32x32 input gives an 8x8 final map, which a
2x2, 4x4 or 8x8 grid divides evenly.

- ``resnet8_cifar`` / ``resnet20_cifar`` / ``resnet32_cifar`` / ``resnet56_cifar``: He et al. (2016) CIFAR ResNets
  (6n+2 layers), basic blocks, widths 16-32-64.
- ``preactresnet56_cifar`` / ``preactresnet164_cifar``: pre-activation ResNets (He et al., "Identity Mappings"),
  basic blocks (56) or bottlenecks with 4x expansion (164), widths 16-32-64.
- ``preactresnet18_cifar``: pre-activation basic blocks [2, 2, 2] with widths 64-128-256.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Type, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import SelectAdaptivePool2d
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, register_model

__all__ = ['CifarResNet']


class BasicBlock(nn.Module):
    """Post-activation basic block; a strided or widening block uses a 1x1 projection shortcut."""
    expansion = 1

    def __init__(self, in_chs: int, chs: int, stride: int = 1, drop_path: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(in_chs, chs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(chs)
        self.conv2 = nn.Conv2d(chs, chs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(chs)
        self.shortcut = nn.Identity() if stride == 1 and in_chs == chs else nn.Sequential(
            nn.Conv2d(in_chs, chs, 1, stride, bias=False), nn.BatchNorm2d(chs))
        self.drop_path = drop_path

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(_drop_path(out, self.drop_path, self.training) + self.shortcut(x))


class PreActBasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_chs: int, chs: int, stride: int = 1, drop_path: float = 0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_chs)
        self.conv1 = nn.Conv2d(in_chs, chs, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(chs)
        self.conv2 = nn.Conv2d(chs, chs, 3, 1, 1, bias=False)
        self.shortcut = None if stride == 1 and in_chs == chs else nn.Conv2d(in_chs, chs, 1, stride, bias=False)
        self.drop_path = drop_path

    def forward(self, x):
        pre = F.relu(self.bn1(x))
        sc = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.bn2(out)))
        return _drop_path(out, self.drop_path, self.training) + sc


class PreActBottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_chs: int, chs: int, stride: int = 1, drop_path: float = 0.0):
        super().__init__()
        out_chs = chs * self.expansion
        self.bn1 = nn.BatchNorm2d(in_chs)
        self.conv1 = nn.Conv2d(in_chs, chs, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(chs)
        self.conv2 = nn.Conv2d(chs, chs, 3, stride, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(chs)
        self.conv3 = nn.Conv2d(chs, out_chs, 1, bias=False)
        self.shortcut = None if stride == 1 and in_chs == out_chs else nn.Conv2d(in_chs, out_chs, 1, stride, bias=False)
        self.drop_path = drop_path

    def forward(self, x):
        pre = F.relu(self.bn1(x))
        sc = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return _drop_path(out, self.drop_path, self.training) + sc


def _pool(global_pool: str) -> SelectAdaptivePool2d:
    """The global pooling for ``global_pool``, flattened for the linear classifier; ``''`` (no pooling) leaves the
    NCHW map as it is, as timm's classifier factory does (``num_classes=0, global_pool=''`` gives the unpooled map)."""
    return SelectAdaptivePool2d(pool_type=global_pool, flatten=bool(global_pool))


def _drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if p == 0.0 or not training:
        return x
    keep = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class CifarResNet(nn.Module):
    """A three-stage CIFAR ResNet with timm's model interface.

    Args:
        block: ``'basic'``, ``'preact_basic'`` or ``'preact_bottleneck'``.
        depths: blocks per stage.
        widths: base widths per stage (bottlenecks output 4x).
        stem_width: channels of the 3x3 stem.
        device, dtype: timm's factory arguments: where and in which floating dtype the model is made.
    """

    def __init__(self, block: str = 'basic', depths=(5, 5, 5), widths=(16, 32, 64), stem_width: int = 16,
                 num_classes: int = 10, in_chans: int = 3, global_pool: str = 'avg', drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, device=None, dtype=None):
        super().__init__()
        blocks = {'basic': BasicBlock, 'preact_basic': PreActBasicBlock, 'preact_bottleneck': PreActBottleneck}
        if block not in blocks:
            raise ValueError(f'block must be one of {sorted(blocks)}, got {block!r}')
        block_cls: Type[nn.Module] = blocks[block]
        self.preact = block.startswith('preact')
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False
        self.conv1 = nn.Conv2d(in_chans, stem_width, 3, 1, 1, bias=False)
        self.bn1 = nn.Identity() if self.preact else nn.BatchNorm2d(stem_width)
        self.act1 = nn.Identity() if self.preact else nn.ReLU()
        total = sum(depths)
        dpr = [drop_path_rate * i / max(total - 1, 1) for i in range(total)]
        stages: List[nn.Module] = []
        in_chs, idx = stem_width, 0
        # modules, not functional calls, at every tap: timm's feature extractors run the children in order
        self.feature_info = [dict(num_chs=stem_width, reduction=1, module='act1')]
        for s, (d, w) in enumerate(zip(depths, widths)):
            layers = []
            for i in range(d):
                layers.append(block_cls(in_chs, w, 2 if (i == 0 and s > 0) else 1, dpr[idx]))
                in_chs = w * block_cls.expansion
                idx += 1
            stages.append(nn.Sequential(*layers))
            self.feature_info.append(dict(num_chs=in_chs, reduction=2 ** s, module=f'stages.{s}'))
        self.stages = nn.Sequential(*stages)
        # pre-activation nets end with BN-ReLU so the final map is normalised like a post-activation one
        self.final_norm = nn.BatchNorm2d(in_chs) if self.preact else nn.Identity()
        self.final_act = nn.ReLU() if self.preact else nn.Identity()
        if self.preact:
            self.feature_info[-1]['module'] = 'final_act'
        self.num_features = in_chs
        self.global_pool = _pool(global_pool)
        self.fc = self._classifier(num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if device is not None or dtype is not None:  # timm's factory arguments, as its own models take them
            self.to(device=device, dtype=dtype)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        return dict(stem=r'^conv1|bn1', blocks=r'^stages\.(\d+)' if coarse else r'^stages\.(\d+)\.(\d+)')

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True):
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None):
        """A new classifier for ``num_classes`` (0: none) on the device and in the dtype of the model's weights,
        in the model's train or eval mode; ``global_pool`` replaces the pooling when given."""
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = _pool(global_pool)
        weight = self.conv1.weight
        self.fc = self._classifier(num_classes).to(device=weight.device, dtype=weight.dtype)
        self.global_pool.train(self.training)
        self.fc.train(self.training)

    def _classifier(self, num_classes: int) -> nn.Module:
        """The classifier on the pooled features, ``head_hidden_size`` wide: ``num_features`` times the pooling's
        multiplier (2 for ``catavgmax``, as in timm's ResNet)."""
        self.head_hidden_size = self.num_features * self.global_pool.feat_mult()
        return nn.Linear(self.head_hidden_size, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.stages, x)
        else:
            x = self.stages(x)
        return self.final_act(self.final_norm(x))

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW',
                              intermediates_only: bool = False
                              ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """timm's intermediate-feature API: the stem (0) and each stage (1..3) as ``feature_info`` lists them;
        ``indices`` an int takes the last n, a list those indices (negative from the end). ``norm`` applies the
        pre-activation nets' final BN-ReLU to the last stage, as ``forward_features`` does."""
        if output_fmt != 'NCHW':
            raise ValueError(f"output_fmt must be 'NCHW' for {type(self).__name__}, got {output_fmt!r}")
        take, last = _take_indices(len(self.feature_info), indices)
        out: List[torch.Tensor] = []
        x = self.act1(self.bn1(self.conv1(x)))
        if 0 in take:
            out.append(x)
        stages = len(self.stages) if not stop_early else last
        for i in range(stages):
            x = self.stages[i](x)
            if i + 1 in take:
                out.append(self.final_act(self.final_norm(x)) if norm and i + 1 == len(self.stages) else x)
        if intermediates_only:
            return out
        if stages == len(self.stages):
            x = self.final_act(self.final_norm(x))
        return x, out

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the stages after the last index kept (and the final norm, the head on request); returns the kept
        indices."""
        take, last = _take_indices(len(self.feature_info), indices)
        for i in range(last, len(self.stages)):
            self.stages[i] = nn.Sequential()  # empty, so the indices keep their meaning
        if last < len(self.feature_info) - 1 or prune_norm:
            self.final_norm, self.final_act = nn.Identity(), nn.Identity()
        if last < len(self.feature_info) - 1:
            self.num_features = self.feature_info[last]['num_chs']  # head_hidden_size: reset_classifier
            prune_head = True
        if prune_head:
            self.reset_classifier(0, '')
        return take

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.global_pool(x)
        if self.drop_rate:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return x if pre_logits else self.fc(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _take_indices(n: int, indices: Optional[Union[int, List[int]]]) -> Tuple[List[int], int]:
    """``(sorted indices to take, the largest)`` out of ``n`` taps: None = all, an int = the last that many."""
    if indices is None:
        take = list(range(n))
    elif isinstance(indices, int):
        if not 0 < indices <= n:
            raise ValueError(f'indices={indices}: take between 1 and {n} of the last taps')
        take = list(range(n - indices, n))
    else:
        take = []
        for i in indices:
            if not -n <= i < n:
                raise ValueError(f'index {i} out of range for {n} taps')
            take.append(i % n)
    return sorted(take), max(take)


def _cfg(**kwargs):
    return dict(url='', num_classes=10, input_size=(3, 32, 32), pool_size=(8, 8), crop_pct=1.0,
                interpolation='bilinear', mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
                first_conv='conv1', classifier='fc', license='apache-2.0', **kwargs)


default_cfgs = generate_default_cfgs({
    'resnet8_cifar': _cfg(),
    'resnet20_cifar': _cfg(),
    'resnet32_cifar': _cfg(),
    'resnet56_cifar': _cfg(),
    'preactresnet18_cifar': _cfg(),
    'preactresnet56_cifar': _cfg(),
    'preactresnet164_cifar': _cfg(),
})


def _create(variant: str, pretrained: bool = False, **kwargs) -> CifarResNet:
    return build_model_with_cfg(CifarResNet, variant, pretrained,
                                feature_cfg=dict(flatten_sequential=True, out_indices=(0, 1, 2, 3)), **kwargs)


@register_model
def resnet8_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """ResNet-8 for CIFAR (He et al.'s 6n+2 family at n=1): one basic block per stage, widths 16-32-64, about
    0.08M params."""
    return _create('resnet8_cifar', pretrained, **dict(dict(block='basic', depths=(1, 1, 1)), **kwargs))


@register_model
def resnet20_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """ResNet-20 for CIFAR (He et al. 2016): 3 stages of 3 basic blocks, widths 16-32-64, about 0.27M params."""
    return _create('resnet20_cifar', pretrained, **dict(dict(block='basic', depths=(3, 3, 3)), **kwargs))


@register_model
def resnet32_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """ResNet-32 for CIFAR (He et al. 2016): 3 stages of 5 basic blocks, widths 16-32-64, about 0.46M params."""
    return _create('resnet32_cifar', pretrained, **dict(dict(block='basic', depths=(5, 5, 5)), **kwargs))


@register_model
def resnet56_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """ResNet-56 for CIFAR: 3 stages of 9 basic blocks, widths 16-32-64, about 0.85M params."""
    return _create('resnet56_cifar', pretrained, **dict(dict(block='basic', depths=(9, 9, 9)), **kwargs))


@register_model
def preactresnet18_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """Pre-activation ResNet-18 variant for CIFAR: [2, 2, 2] basic blocks, widths 64-128-256, about 2.8M params."""
    args = dict(block='preact_basic', depths=(2, 2, 2), widths=(64, 128, 256), stem_width=64)
    return _create('preactresnet18_cifar', pretrained, **dict(args, **kwargs))


@register_model
def preactresnet56_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """Pre-activation ResNet-56 for CIFAR: 3 stages of 9 basic blocks, widths 16-32-64, about 0.85M params."""
    return _create('preactresnet56_cifar', pretrained, **dict(dict(block='preact_basic', depths=(9, 9, 9)), **kwargs))


@register_model
def preactresnet164_cifar(pretrained: bool = False, **kwargs) -> CifarResNet:
    """Pre-activation ResNet-164 for CIFAR: 3 stages of 18 bottlenecks, outputs 64-128-256, about 1.7M params."""
    args = dict(block='preact_bottleneck', depths=(18, 18, 18))
    return _create('preactresnet164_cifar', pretrained, **dict(args, **kwargs))
