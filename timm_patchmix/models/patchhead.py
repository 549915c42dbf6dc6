"""``patchhead_<arch>``: any timm backbone with PatchMix's image head and patch head.

The image head is the backbone's own classifier. The patch head pools the backbone's final feature map over the
``rows x cols`` regions that match the mixer's cells and classifies each region. Cell edges come from
``timm_patchmix.grid.cell_bounds`` on the input image, mapped onto the feature map; each region is the
area-weighted mean of the feature pixels it covers, which is the plain mean of equal blocks when image and map
both divide by the grid.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Tuple, Union

import torch
import torch.nn as nn
import timm

from ..grid import GridSpec, cell_bounds, to_grid

__all__ = ['PatchHead', 'PatchHeadModel', 'create_patchhead', 'PREFIX']

PREFIX = 'patchhead_'


def region_weights(img_size: int, map_size: int, parts: int) -> torch.Tensor:
    """Row-stochastic ``[parts, map_size]`` weights: part k averages the map pixels under image cell k, each pixel
    weighted by the length of its overlap with ``[b_k, b_{k+1})`` (image bounds from ``cell_bounds``)."""
    bounds = cell_bounds(img_size, parts)
    scale = map_size / img_size
    rows = []
    for k in range(parts):
        lo, hi = bounds[k] * scale, bounds[k + 1] * scale
        rows.append([max(0.0, min(hi, i + 1.0) - max(lo, float(i))) for i in range(map_size)])
    w = torch.tensor(rows, dtype=torch.float64)
    return (w / w.sum(1, keepdim=True)).float()


class PatchHead(nn.Module):
    """Pools an NHWC feature map ``[B, h, w, F]`` into ``rows x cols`` regions and classifies each.

    Returns ``[B, rows*cols, num_classes]`` (cells in row-major order, as the mixer's mask), or the pooled region
    features ``[B, rows*cols, F]`` when ``num_classes == 0``. One linear classifier is shared across positions,
    or with ``per_position=True`` each position has its own.
    """

    def __init__(self, num_features: int, num_classes: int, grid: GridSpec = 4, per_position: bool = False):
        super().__init__()
        self.grid = to_grid(grid)
        self.num_features = num_features
        self.per_position = per_position
        self.reset(num_classes)

    def reset(self, num_classes: int) -> None:
        self.num_classes = num_classes
        cells = self.grid[0] * self.grid[1]
        if num_classes <= 0:
            self.fc = nn.Identity()
        elif not self.per_position:
            self.fc = nn.Linear(self.num_features, num_classes)
        else:
            self.fc = PositionwiseLinear(cells, self.num_features, num_classes)

    def pool(self, feat: torch.Tensor, img_size: Tuple[int, int]) -> torch.Tensor:
        """Area-weighted region means of ``feat [B, h, w, F]`` for an input of ``img_size``: ``[B, rows*cols, F]``."""
        b, h, w, f = feat.shape
        rows, cols = self.grid
        if h < rows or w < cols:
            raise ValueError(
                f'the final feature map is {h}x{w}, smaller than the {rows}x{cols} patch grid, so some cells get '
                f'no feature region of their own. Use a larger input, a backbone with a larger final map '
                f"(for example output_stride=8, as in create_model('patchhead_resnet50', output_stride=8)), or one "
                f"of the CIFAR backbones such as 'patchhead_resnet32_cifar' (8x8 at 32x32)")
        H, W = img_size
        if H % rows == 0 and W % cols == 0 and h % rows == 0 and w % cols == 0:
            # image and map both split into equal blocks: the weights reduce to plain block means
            out = feat.reshape(b, rows, h // rows, cols, w // cols, f).mean((2, 4))
        else:
            wr = region_weights(H, h, rows).to(device=feat.device, dtype=feat.dtype)
            wc = region_weights(W, w, cols).to(device=feat.device, dtype=feat.dtype)
            out = torch.einsum('rh,bhwf,cw->brcf', wr, feat, wc)
        return out.reshape(b, rows * cols, f)

    def forward(self, feat: torch.Tensor, img_size: Tuple[int, int]) -> torch.Tensor:
        return self.fc(self.pool(feat, img_size))


class PositionwiseLinear(nn.Module):
    """One linear classifier per cell: ``[B, cells, F] -> [B, cells, C]``."""

    def __init__(self, cells: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cells, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(cells, out_features))
        bound = 1.0 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum('bkf,kcf->bkc', x, self.weight) + self.bias


class PatchHeadModel(nn.Module):
    """A timm backbone plus a PatchMix patch head.

    ``train()`` forward returns ``(logits [B, C], patch_logits [B, rows*cols, C])`` for ``PatchMixLoss``;
    ``eval()`` forward returns logits only, like the plain backbone. ``forward_patches`` works in both modes.
    """

    def __init__(self, backbone: nn.Module, grid: GridSpec = 4, per_position: bool = False):
        super().__init__()
        self.backbone = backbone
        self.grid = to_grid(grid)
        self.patch_head = PatchHead(backbone.num_features, backbone.num_classes, self.grid, per_position)
        cfg = dict(getattr(backbone, 'pretrained_cfg', None) or {})
        classifier = cfg.get('classifier') or 'fc'
        heads = classifier if isinstance(classifier, (tuple, list)) else (classifier,)
        cfg['classifier'] = tuple(f'backbone.{c}' for c in heads) + ('patch_head.fc',)
        if cfg.get('first_conv'):
            cfg['first_conv'] = f'backbone.{cfg["first_conv"]}'
        cfg['architecture'] = PREFIX + cfg.get('architecture', type(backbone).__name__.lower())
        self.pretrained_cfg = cfg

    # --- timm's interface ---------------------------------------------------------------------------------------
    @property
    def default_cfg(self) -> Dict[str, Any]:
        return self.pretrained_cfg

    @property
    def num_classes(self) -> int:
        return self.backbone.num_classes

    @property
    def num_features(self) -> int:
        return self.backbone.num_features

    @property
    def feature_info(self):
        return getattr(self.backbone, 'feature_info', None)

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.backbone.get_classifier()

    @torch.jit.ignore
    def get_patch_classifier(self) -> nn.Module:
        return self.patch_head.fc

    def reset_classifier(self, num_classes: int, *args, **kwargs) -> None:
        """Re-initialise both heads for ``num_classes`` (0 gives pooled features from each)."""
        self.backbone.reset_classifier(num_classes, *args, **kwargs)
        self.patch_head.reset(num_classes)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        inner = self.backbone.group_matcher(coarse)
        return {k: _prefix_matcher(v) for k, v in inner.items()}

    @torch.jit.ignore
    def no_weight_decay(self):
        inner = self.backbone.no_weight_decay() if hasattr(self.backbone, 'no_weight_decay') else set()
        return {f'backbone.{n}' for n in inner}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.backbone.forward_head(x, pre_logits=pre_logits)

    # --- the patch head -----------------------------------------------------------------------------------------
    def feature_map_nhwc(self, feat: torch.Tensor, img_size: Tuple[int, int]) -> torch.Tensor:
        """The final feature map of ``forward_features`` as ``[B, h, w, F]``, whatever the backbone's layout."""
        f = self.backbone.num_features
        if feat.ndim == 3:  # NLC tokens, maybe with class/register tokens first
            n_prefix = int(getattr(self.backbone, 'num_prefix_tokens', 0))
            tokens = feat[:, n_prefix:]
            h, w = self._token_grid(tokens.shape[1], img_size)
            return tokens.reshape(feat.shape[0], h, w, feat.shape[2])
        if feat.ndim != 4:
            raise ValueError(f'cannot find a spatial map in forward_features output of shape {list(feat.shape)}')
        fmt = str(getattr(self.backbone, 'output_fmt', '') or '')
        if fmt.upper() == 'NHWC' or (fmt == '' and feat.shape[3] == f and feat.shape[1] != f):
            return feat
        return feat.permute(0, 2, 3, 1)

    def _token_grid(self, n_tokens: int, img_size: Tuple[int, int]) -> Tuple[int, int]:
        pe = getattr(self.backbone, 'patch_embed', None)
        if pe is not None and hasattr(pe, 'dynamic_feat_size'):
            h, w = pe.dynamic_feat_size(img_size)
        elif pe is not None and getattr(pe, 'grid_size', None) is not None:
            h, w = pe.grid_size
        else:
            h = w = int(round(math.sqrt(n_tokens)))
        if h * w != n_tokens:
            raise ValueError(f'{n_tokens} spatial tokens do not form the {h}x{w} token grid expected for an input '
                             f'of {img_size[0]}x{img_size[1]}')
        return int(h), int(w)

    def patch_logits(self, feat: torch.Tensor, img_size: Tuple[int, int]) -> torch.Tensor:
        """Patch logits ``[B, rows*cols, C]`` from a ``forward_features`` output for an input of ``img_size``."""
        return self.patch_head(self.feature_map_nhwc(feat, img_size), img_size)

    def forward_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Patch logits ``[B, rows*cols, C]`` for images ``x``, in train or eval mode."""
        return self.patch_logits(self.forward_features(x), tuple(x.shape[-2:]))

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        feat = self.forward_features(x)
        logits = self.forward_head(feat)
        if not self.training:
            return logits
        return logits, self.patch_logits(feat, tuple(x.shape[-2:]))


def _prefix_matcher(v):
    if isinstance(v, str):
        return '^backbone\\.' + v.lstrip('^') if v.startswith('^') else v
    if isinstance(v, (list, tuple)):
        return [(_prefix_matcher(p[0]),) + tuple(p[1:]) if isinstance(p, (list, tuple)) else _prefix_matcher(p)
                for p in v]
    return v


def create_patchhead(arch: str, pretrained: bool = False, grid: GridSpec = 4, per_position: bool = False,
                     **kwargs) -> PatchHeadModel:
    """Build ``timm.create_model(arch, pretrained, **kwargs)`` and add a patch head for ``grid``.

    Backbone keyword arguments (``num_classes``, ``drop_path_rate``, ``output_stride``, ``img_size``,
    ``in_chans``, ``pretrained_cfg``...) pass through to timm.
    """
    grid = to_grid(grid)
    backbone = timm.create_model(arch, pretrained=pretrained, **kwargs)
    if not hasattr(backbone, 'forward_features') or not hasattr(backbone, 'num_features'):
        raise ValueError(f'{arch} has no forward_features/num_features, which the patch head needs')
    return PatchHeadModel(backbone, grid=grid, per_position=per_position)
