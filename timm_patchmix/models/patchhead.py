"""``patchhead_<arch>``: any timm backbone with PatchMix's image head and patch head.

The image head is the backbone's own classifier. The patch head pools the backbone's final feature map over the
``rows x cols`` regions that match the mixer's cells and classifies each region. Cell edges come from
``timm_patchmix.grid.cell_bounds`` on the input image, mapped onto the feature map; each region is the
area-weighted mean of the feature pixels it covers, which is the plain mean of equal blocks when image and map
both divide by the grid.

The shape-dependent work (layout, prefix tokens, token grid, region pooling) lives in :func:`patch_pool`, a
TorchScript-compatible function that FX keeps as one leaf call, so the model traces, scripts and exports.
"""
from __future__ import annotations

import inspect
import math
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
import torch.fx
import torch.nn as nn
import timm

from ..grid import GridSpec, bounds_tensor, to_grid

try:
    from timm.layers import register_notrace_function
except ImportError:  # timm without FX helpers: torch.fx.wrap below still covers plain symbolic_trace
    def register_notrace_function(fn):
        return fn

__all__ = ['PatchHead', 'PatchHeadModel', 'PositionwiseLinear', 'create_patchhead', 'region_weights',
           'pool_regions', 'feature_map_nhwc', 'patch_pool', 'token_grid_size', 'image_token_grid', 'PREFIX']

PREFIX = 'patchhead_'


def region_weights(img_size: int, map_size: int, parts: int, device: Optional[torch.device] = None,
                   stride: int = 0) -> torch.Tensor:
    """Row-stochastic ``[parts, map_size]`` weights: part k averages the map pixels under image cell k, each pixel
    weighted by the length of its overlap with ``[b_k, b_{k+1})`` (image bounds of ``cell_bounds``).

    Where the map comes from a patch embedding of ``stride`` pixels (``stride > 0``), map pixel i covers the image
    pixels ``[i * stride, (i + 1) * stride)`` that exist: a token of padding past the image (timm's
    ``dynamic_img_pad``) counts only its image pixels, and the pixels past the last token, which such an embedding
    drops, belong to no token (a cell of those pixels alone takes the last token). Otherwise the map spans the image
    evenly (``map_size / img_size`` map pixels per image pixel); both rules agree where ``stride * map_size`` is
    ``img_size``.

    Made on ``device`` from ``arange`` arithmetic, so an accelerator never waits for a host copy in the forward."""
    # float64 tensor ops, exactly the Python float arithmetic of overlap = max(0, min(hi, i + 1) - max(lo, i))
    b = bounds_tensor(img_size, parts, device).to(torch.float64)
    i = torch.arange(map_size, dtype=torch.float64, device=device)[None]
    if stride > 0:
        lo, hi = b[:-1][:, None], b[1:][:, None]
        start = i * stride
        end = torch.clamp(start + stride, max=float(img_size))
        w = (torch.minimum(hi, end) - torch.maximum(lo, start)).clamp(min=0.0)
        last = (i == map_size - 1).to(torch.float64).expand(parts, map_size)
        w = torch.where(w.sum(1, keepdim=True) > 0, w, last)
    else:
        scale = map_size / img_size
        lo, hi = (b[:-1] * scale)[:, None], (b[1:] * scale)[:, None]
        w = (torch.minimum(hi, i + 1.0) - torch.maximum(lo, i)).clamp(min=0.0)
    return (w / w.sum(1, keepdim=True)).float()


def pool_regions(feat: torch.Tensor, img_size: List[int], grid: Tuple[int, int],
                 stride: Tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Area-weighted region means of ``feat [B, h, w, F]`` for an input of ``img_size``: ``[B, rows*cols, F]``.
    ``stride``: the image pixels per map pixel of a patch embedding, by rows and columns (see
    :func:`region_weights`; ``(0, 0)``: the map spans the image evenly)."""
    b, h, w, f = feat.shape
    rows, cols = grid
    if h < rows or w < cols:
        raise ValueError(
            f'the final feature map is {h}x{w}, smaller than the {rows}x{cols} patch grid, so some cells get '
            f'no feature region of their own. Use a larger input, a backbone with a larger final map '
            f"(for example output_stride=8, as in create_model('patchhead_resnet50', output_stride=8)), or one "
            f"of the CIFAR backbones such as 'patchhead_resnet32_cifar' (8x8 at 32x32)")
    H, W = img_size[0], img_size[1]
    spans = (stride[0] == 0 or stride[0] * h == H) and (stride[1] == 0 or stride[1] * w == W)
    if spans and H % rows == 0 and W % cols == 0 and h % rows == 0 and w % cols == 0:
        # image and map both split into equal blocks: the weights reduce to plain block means
        out = feat.reshape(b, rows, h // rows, cols, w // cols, f).mean((2, 4))
    else:
        # one [cells, h*w] pooling matrix (outer product of the row and column weights), one batched matmul
        wr = region_weights(H, h, rows, feat.device, stride[0])
        wc = wr if (W, w, cols, stride[1]) == (H, h, rows, stride[0]) else \
            region_weights(W, w, cols, feat.device, stride[1])
        pool = (wr[:, None, :, None] * wc[None, :, None, :]).reshape(rows * cols, h * w).to(feat.dtype)
        out = torch.matmul(pool, feat.reshape(b, h * w, f))
    return out.reshape(b, rows * cols, f)


def image_token_grid(img_size: List[int], patch_size: Tuple[int, int], feature_ratio: Tuple[int, int],
                     dynamic_pad: bool) -> Tuple[int, int]:
    """The token grid of a patch embedding for an input of ``img_size`` (timm's ``dynamic_feat_size``)."""
    fh, fw = img_size[0] // feature_ratio[0], img_size[1] // feature_ratio[1]
    if dynamic_pad:  # padded to whole patches: ceil, in integers
        return (fh + patch_size[0] - 1) // patch_size[0], (fw + patch_size[1] - 1) // patch_size[1]
    return fh // patch_size[0], fw // patch_size[1]


def grid_by_aspect(n_tokens: int, img_size: List[int]) -> Tuple[int, int]:
    """The ``h x w = n_tokens`` grid whose shape is nearest the image's (``h / w`` against ``H / W``), or
    ``(0, 0)`` where two are equally near or none is within a factor of two of it. For a square image and a square
    count this is the square root; for a backbone at one stride it is the grid at that stride (224x160 at stride
    16: 14x10). Integers only, so it runs alike in eager, TorchScript and FX."""
    big_h, big_w = int(img_size[0]), int(img_size[1])
    heights: List[int] = []  # every divisor of the count, each once
    d = 1
    while d * d <= n_tokens:
        if n_tokens % d == 0:
            heights.append(d)
            if d * d != n_tokens:
                heights.append(n_tokens // d)
        d += 1
    best_h, best_num, best_den, tie = 0, 0, 1, False
    for h in heights:
        a, b = h * big_w, (n_tokens // h) * big_h  # h / w against H / W, as the ratio max(a, b) / min(a, b)
        num, den = max(a, b), min(a, b)
        if best_h == 0 or num * best_den < best_num * den:
            best_h, best_num, best_den, tie = h, num, den, False
        elif num * best_den == best_num * den:
            tie = True
    if best_h == 0 or tie or best_num > 2 * best_den:
        return 0, 0
    return best_h, n_tokens // best_h


def token_grid_size(n_tokens: int, img_size: List[int], patch_size: Tuple[int, int], feature_ratio: Tuple[int, int],
                    dynamic_pad: bool, token_grid: Tuple[int, int]) -> Tuple[int, int]:
    """The ``h x w`` grid of ``n_tokens`` spatial tokens: from the image size when ``patch_size`` is set (as
    timm's ``PatchEmbed.dynamic_feat_size``), else the fixed ``token_grid`` where the count fits it, else the
    factorisation of the count nearest the image's shape (:func:`grid_by_aspect`)."""
    if patch_size[0] > 0:
        h, w = image_token_grid(img_size, patch_size, feature_ratio, dynamic_pad)
        if h * w != n_tokens:
            raise ValueError(f'{n_tokens} spatial tokens do not form the {h}x{w} token grid expected for an input '
                             f'of {img_size[0]}x{img_size[1]}')
        return h, w
    if token_grid[0] > 0 and token_grid[0] * token_grid[1] == n_tokens:
        return token_grid[0], token_grid[1]
    h, w = grid_by_aspect(n_tokens, img_size)
    if h == 0:
        raise ValueError(f'{n_tokens} spatial tokens form no token grid of the shape of an input of '
                         f'{img_size[0]}x{img_size[1]} (its rows and columns would have to be {n_tokens} split '
                         f'into two factors whose ratio is nearest {img_size[0]}:{img_size[1]}, and one such '
                         f'split alone)')
    return h, w


def feature_map_nhwc(feat: torch.Tensor, img_size: List[int], output_fmt: str = 'NHWC', num_features: int = 0,
                     num_prefix_tokens: int = 0, patch_size: Tuple[int, int] = (0, 0),
                     feature_ratio: Tuple[int, int] = (1, 1), dynamic_pad: bool = False,
                     token_grid: Tuple[int, int] = (0, 0)) -> torch.Tensor:
    """A ``forward_features`` output as ``[B, h, w, F]``: NLC tokens lose their ``num_prefix_tokens`` and go on
    their token grid; a 4-d map is NHWC or NCHW by ``output_fmt`` ('' guesses from ``num_features``)."""
    if not torch.jit.is_scripting():
        if not isinstance(feat, torch.Tensor):
            shapes = ', '.join(str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                               for t in feat) if isinstance(feat, (list, tuple)) else type(feat).__name__
            raise ValueError(f'forward_features returns a {type(feat).__name__} ({shapes}), not one feature map: '
                             f'the patch head pools the regions of a single final map, which this backbone does '
                             f'not give')
    if feat.dim() == 3:
        if feat.shape[1] <= num_prefix_tokens:
            raise ValueError(f'forward_features output of shape {list(feat.shape)} holds {feat.shape[1]} token(s), '
                             f'no more than the backbone\'s {num_prefix_tokens} prefix (class) token(s): it keeps '
                             f'no spatial tokens for the patch head to pool')
        tokens = feat[:, num_prefix_tokens:]
        h, w = token_grid_size(tokens.shape[1], img_size, patch_size, feature_ratio, dynamic_pad, token_grid)
        return tokens.reshape(feat.shape[0], h, w, feat.shape[2])
    if feat.dim() != 4:
        raise ValueError(f'cannot find a spatial map in forward_features output of shape {list(feat.shape)}')
    if output_fmt == 'NHWC' or (output_fmt == '' and feat.shape[3] == num_features and feat.shape[1] != num_features):
        return feat
    return feat.permute(0, 2, 3, 1)


def patch_pool(feat: torch.Tensor, img_size: List[int], grid: Tuple[int, int], output_fmt: str = 'NHWC',
               num_features: int = 0, num_prefix_tokens: int = 0, patch_size: Tuple[int, int] = (0, 0),
               feature_ratio: Tuple[int, int] = (1, 1), dynamic_pad: bool = False,
               token_grid: Tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Region features ``[B, rows*cols, F]`` of a ``forward_features`` output (see :func:`feature_map_nhwc`)."""
    fmap = feature_map_nhwc(feat, img_size, output_fmt, num_features, num_prefix_tokens, patch_size,
                            feature_ratio, dynamic_pad, token_grid)
    # a map on the patch embedding's grid (a ViT's tokens, SAM-ViT's 4-d map) covers whole patches: where the input is
    # no multiple of them, not the image evenly; a map at a stride of its own (a CNN's, Swin's after its merges) does
    stride = (0, 0)
    if patch_size[0] > 0:
        on_grid = image_token_grid(img_size, patch_size, feature_ratio, dynamic_pad)
        if fmap.shape[1] == on_grid[0] and fmap.shape[2] == on_grid[1]:
            stride = (patch_size[0] * feature_ratio[0], patch_size[1] * feature_ratio[1])
    return pool_regions(fmap, img_size, grid, stride)


# FX leaves: shapes decide the layout and the pooling, which a symbolic trace cannot branch on
for _fn in (pool_regions, feature_map_nhwc, patch_pool):
    register_notrace_function(_fn)
del _fn
torch.fx.wrap('pool_regions')
torch.fx.wrap('feature_map_nhwc')
torch.fx.wrap('patch_pool')


class PatchHead(nn.Module):
    """Pools a feature map into ``rows x cols`` regions and classifies each.

    The input is NHWC ``[B, h, w, F]`` by default; :meth:`set_layout` sets another backbone layout (NCHW, or NLC
    tokens with prefix tokens). Returns ``[B, rows*cols, num_classes]`` (cells in row-major order, as the mixer's
    mask), or the pooled region features ``[B, rows*cols, F]`` when ``num_classes == 0``. One linear classifier is
    shared across positions, or with ``per_position=True`` each position has its own.
    """

    def __init__(self, num_features: int, num_classes: int, grid: GridSpec = 4, per_position: bool = False):
        super().__init__()
        self.grid = to_grid(grid)
        self.num_features = num_features
        self.per_position = check_per_position(per_position)
        self.set_layout()
        self.reset(num_classes)

    def set_layout(self, output_fmt: str = 'NHWC', num_prefix_tokens: int = 0, patch_size: Tuple[int, int] = (0, 0),
                   feature_ratio: Tuple[int, int] = (1, 1), dynamic_pad: bool = False,
                   token_grid: Tuple[int, int] = (0, 0)) -> None:
        """The static layout of the input, as plain constants (arguments of :func:`feature_map_nhwc`)."""
        self.output_fmt = str(output_fmt).upper()
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.feature_ratio = (int(feature_ratio[0]), int(feature_ratio[1]))
        self.dynamic_pad = bool(dynamic_pad)
        self.token_grid = (int(token_grid[0]), int(token_grid[1]))

    def reset(self, num_classes: int) -> None:
        self.num_classes = num_classes
        cells = self.grid[0] * self.grid[1]
        if num_classes <= 0:
            self.fc = nn.Identity()
        elif not self.per_position:
            self.fc = nn.Linear(self.num_features, num_classes)
        else:
            self.fc = PositionwiseLinear(cells, self.num_features, num_classes)

    def pool(self, feat: torch.Tensor, img_size: List[int]) -> torch.Tensor:
        """Area-weighted region means of ``feat [B, h, w, F]`` for an input of ``img_size``: ``[B, rows*cols, F]``."""
        return pool_regions(feat, img_size, self.grid)

    def forward(self, feat: torch.Tensor, img_size: List[int]) -> torch.Tensor:
        return self.fc(patch_pool(feat, img_size, self.grid, self.output_fmt, self.num_features,
                                  self.num_prefix_tokens, self.patch_size, self.feature_ratio, self.dynamic_pad,
                                  self.token_grid))


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
        return torch.einsum('bkf,kcf->bkc', [x, self.weight]) + self.bias


class PatchHeadModel(nn.Module):
    """A timm backbone plus a PatchMix patch head.

    ``train()`` forward returns ``(logits [B, C], patch_logits [B, rows*cols, C])`` for ``PatchMixLoss``;
    ``eval()`` forward returns logits only, like the plain backbone. ``forward_patches`` works in both modes.
    timm's model interface (intermediates, pruning, classifier reset, input size, grouping) passes through to the
    backbone, with parameter names prefixed ``backbone.``.
    """
    # computed in Python from the backbone, not part of the scripted forward
    __jit_unused_properties__ = ['default_cfg', 'num_classes', 'num_features', 'head_hidden_size', 'feature_info',
                                 'in_chans', '_traits', 'set_input_size', 'forward_intermediates',
                                 'prune_intermediate_layers', 'group_matcher']

    def __init__(self, backbone: nn.Module, grid: GridSpec = 4, per_position: bool = False):
        super().__init__()
        _check_token_order(backbone)
        self.backbone = backbone
        self.grid = to_grid(grid)
        self.patch_head = PatchHead(backbone.num_features, backbone.num_classes, self.grid, per_position)
        self._follow_backbone()  # (a backbone made with timm's device=/dtype= factory arguments)
        self._sync_layout()
        cfg = dict(getattr(backbone, 'pretrained_cfg', None) or {})
        classifier = cfg.get('classifier') or 'fc'
        heads = classifier if isinstance(classifier, (tuple, list)) else (classifier,)
        cfg['classifier'] = tuple(f'backbone.{c}' for c in heads) + ('patch_head.fc',)
        if cfg.get('first_conv'):
            cfg['first_conv'] = _prefix_names(cfg['first_conv'])
        cfg['architecture'] = PREFIX + cfg.get('architecture', type(backbone).__name__.lower())
        self.pretrained_cfg = cfg

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a plain timm model's state dict (no name under ``backbone.`` or
        ``patch_head.``, as timm's ``checkpoint_path=`` or ``load_checkpoint`` pass a plain checkpoint) is refused
        under ``strict`` with the routes that take it, where torch would list every name as missing and
        unexpected."""
        if strict and holds_plain_backbone(state_dict, self.backbone):
            raise RuntimeError(
                f'the state dict holds a plain {type(self.backbone).__name__} model\'s weights (no name under '
                f'"backbone." or "patch_head."), not a patchhead_ model\'s: load them into model.backbone, or create '
                f'the model with pretrained=True, pretrained_cfg_overlay=dict(file=<the .safetensors file>) (the '
                f'patch head starts fresh; train.py: --initial-checkpoint <the file>)')
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _sync_layout(self) -> None:
        """Read the backbone's output layout into the patch head (again after anything that changes it)."""
        self.patch_head.set_layout(**_backbone_layout(self.backbone))

    # --- timm's interface ---------------------------------------------------------------------------------------
    @property
    def default_cfg(self) -> Dict[str, Any]:
        return self.pretrained_cfg

    @default_cfg.setter
    def default_cfg(self, cfg: Dict[str, Any]) -> None:  # timm's builders assign both names, as on any timm model
        self.pretrained_cfg = cfg

    @property
    def num_classes(self) -> int:
        return self.backbone.num_classes

    @property
    def num_features(self) -> int:
        return self.backbone.num_features

    @property
    def head_hidden_size(self) -> int:
        size = getattr(self.backbone, 'head_hidden_size', None)
        return self.num_features if size is None else size

    @property
    def feature_info(self):
        """The backbone's ``feature_info``, its module names prefixed ``backbone.`` (for FX/hook feature nets)."""
        info = getattr(self.backbone, 'feature_info', None)
        if isinstance(info, (list, tuple)):
            return [dict(d, module=f'backbone.{d["module"]}') if d.get('module') else dict(d) for d in info]
        return info

    @property
    def in_chans(self) -> int:
        return self.backbone.in_chans

    @property
    def _traits(self) -> Dict[str, Any]:
        # timm's current-input traits (timm.data.resolve_model_data_config), with the stem renamed like first_conv
        traits = dict(getattr(self.backbone, '_traits', None) or {})
        if traits.get('first_conv'):
            traits['first_conv'] = _prefix_names(traits['first_conv'])
        return traits

    @_traits.setter
    def _traits(self, traits: Dict[str, Any]) -> None:
        traits = dict(traits)
        if traits.get('first_conv'):
            traits['first_conv'] = _unprefix_names(traits['first_conv'])
        self.backbone._traits = traits

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.backbone.get_classifier()

    @torch.jit.ignore
    def get_patch_classifier(self) -> nn.Module:
        return self.patch_head.fc

    @torch.jit.ignore
    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None, **kwargs) -> None:
        """Re-initialise both heads for ``num_classes`` (0 gives pooled features from each). The pooling stays as it
        is unless ``global_pool`` is given."""
        if global_pool is None and _pool_default(self.backbone) not in (None, inspect.Parameter.empty):
            global_pool = _global_pool_type(self.backbone)  # this backbone would reset it to its default
        if global_pool is None:
            self.backbone.reset_classifier(num_classes, **kwargs)
        else:
            self.backbone.reset_classifier(num_classes, global_pool, **kwargs)
        self.patch_head.num_features = self.backbone.num_features  # (a pruned backbone's feature map is narrower)
        self.patch_head.reset(num_classes)
        self._follow_backbone(**{k: kwargs[k] for k in ('device', 'dtype') if kwargs.get(k) is not None})
        self.patch_head.train(self.training)  # a model in eval mode keeps its new head in eval mode, as timm's ResNet

    def _follow_backbone(self, **given) -> None:
        """Put the patch head's classifier on the device and in the floating dtype of the backbone's parameters
        (or those ``given``, as timm's ``reset_classifier`` takes them)."""
        ref = next((p for p in self.backbone.parameters() if p.is_floating_point()), None)
        dd = {} if ref is None else dict(device=ref.device, dtype=ref.dtype)
        dd.update(given)
        if dd:
            self.patch_head.fc.to(**dd)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.backbone.set_grad_checkpointing(enable)

    @property
    def group_matcher(self) -> Callable[..., Any]:
        """The backbone's ``group_matcher`` over the wrapped names (the patch head joins the classifier's group),
        present exactly where the backbone has one: timm's layer decay asks ``hasattr(model, 'group_matcher')`` and
        groups a model without one by its own rule, which the plain model's classifier names serve here too."""
        method = self.backbone.group_matcher

        def group_matcher(coarse: bool = False):
            inner = method(coarse)
            if callable(inner) and not isinstance(inner, dict):
                return _prefix_callable_matcher(inner)
            return _join_classifier_group({k: _prefix_matcher(v) for k, v in inner.items()},
                                          self._classifier_param_names())
        return group_matcher

    def _classifier_param_names(self) -> List[str]:
        """The wrapped names of the backbone classifier's parameters (none for ``num_classes=0``)."""
        head = self.backbone.get_classifier() if hasattr(self.backbone, 'get_classifier') else None
        heads = head if isinstance(head, (tuple, list)) else (head,)  # (a distilled DeiT's two heads)
        ids = {id(p) for h in heads if isinstance(h, nn.Module) for p in h.parameters()}
        return [f'backbone.{n}' for n, p in self.backbone.named_parameters() if id(p) in ids]

    @torch.jit.ignore
    def no_weight_decay(self):
        inner = self.backbone.no_weight_decay() if hasattr(self.backbone, 'no_weight_decay') else set()
        return {f'backbone.{n}' for n in inner}

    # The three below (and group_matcher above) exist exactly where the backbone has them: each is a property whose
    # lookup of the backbone's method raises AttributeError where it has none, so ``hasattr(model, 'set_input_size')``
    # answers as for the plain model.
    @property
    def set_input_size(self) -> Callable[..., None]:
        """The backbone's ``set_input_size``; the patch head follows the new token grid."""
        inner = self.backbone.set_input_size

        def set_input_size(*args, **kwargs) -> None:
            inner(*args, **kwargs)
            self._sync_layout()
        return set_input_size

    @property
    def forward_intermediates(self) -> Callable[..., Any]:
        """The backbone's ``forward_intermediates``, unchanged."""
        return self.backbone.forward_intermediates

    @property
    def prune_intermediate_layers(self) -> Callable[..., Any]:
        """The backbone's ``prune_intermediate_layers``; when it drops the backbone's classifier, the patch head
        drops its own too (``num_classes == 0`` for both); the patch head takes the width of the pruned feature
        map, so a later ``reset_classifier`` builds both heads for it."""
        inner = self.backbone.prune_intermediate_layers

        def prune_intermediate_layers(*args, **kwargs):
            taken = inner(*args, **kwargs)
            narrower = self.patch_head.num_features != self.backbone.num_features  # later stages dropped
            self.patch_head.num_features = self.backbone.num_features
            if self.backbone.num_classes == 0 and self.patch_head.num_classes != 0:
                self.patch_head.reset(0)
            elif narrower and self.patch_head.num_classes != 0:  # a classifier of the old width cannot be kept
                self.patch_head.reset(self.patch_head.num_classes)
                self._follow_backbone()
            self._sync_layout()
            return taken
        return prune_intermediate_layers

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            if isinstance(x, torch.fx.Proxy):
                return self._traced_backbone_call('forward_features', x)
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if not torch.jit.is_scripting():
            if isinstance(x, torch.fx.Proxy):
                return self._traced_backbone_call('forward_head', x, pre_logits=pre_logits)
        return self.backbone.forward_head(x, pre_logits=pre_logits)

    @torch.jit.ignore
    def _traced_backbone_call(self, method: str, x, **kwargs):
        """``backbone.<method>(x)`` under FX, made through ``nn.Module.__call__``.

        A tracer wraps timm's registered no-trace functions only in the source module of a module it sees called,
        and scopes node names by module calls; a plain method call would leave the backbone's functions traced
        (failing where the plain model traces) and its nodes unprefixed. So the method stands in for the
        backbone's ``forward`` for this one call.
        """
        backbone = self.backbone
        if x.tracer.is_leaf_module(backbone, 'backbone'):  # a leaf call would run the backbone's real forward
            return getattr(backbone, method)(x, **kwargs)
        own = backbone.__dict__.get('forward')
        backbone.forward = getattr(backbone, method)
        try:
            return backbone(x, **kwargs)
        finally:
            del backbone.forward
            if own is not None:
                backbone.forward = own

    # --- the patch head -----------------------------------------------------------------------------------------
    def feature_map_nhwc(self, feat: torch.Tensor, img_size: List[int]) -> torch.Tensor:
        """The final feature map of ``forward_features`` as ``[B, h, w, F]``, whatever the backbone's layout."""
        p = self.patch_head
        return feature_map_nhwc(feat, img_size, p.output_fmt, p.num_features, p.num_prefix_tokens, p.patch_size,
                                p.feature_ratio, p.dynamic_pad, p.token_grid)

    def patch_logits(self, feat: torch.Tensor, img_size: List[int]) -> torch.Tensor:
        """Patch logits ``[B, rows*cols, C]`` from a ``forward_features`` output for an input of ``img_size``."""
        return self.patch_head(feat, img_size)

    @torch.jit.export  # a method of a scripted model too (the prediction of a model trained on the patch loss)
    def forward_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Patch logits ``[B, rows*cols, C]`` for images ``x``, in train or eval mode."""
        return self.patch_logits(self.forward_features(x), x.shape[-2:])

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        feat = self.forward_features(x)
        logits = self.forward_head(feat)
        if not self.training:
            return logits
        return logits, self.patch_logits(feat, x.shape[-2:])


def _pair(v) -> Tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _backbone_layout(backbone: nn.Module) -> Dict[str, Any]:
    """The static facts :func:`feature_map_nhwc` needs about ``backbone``'s ``forward_features`` output."""
    fmt = getattr(backbone, 'output_fmt', None)
    fmt = getattr(fmt, 'value', fmt)  # timm's Format enum or a string
    prefix = getattr(backbone, 'num_prefix_tokens', None)
    if prefix is None:  # a class token put before the patch tokens without a count of them (VOLO, PiT)
        cls_token = getattr(backbone, 'cls_token', None)
        if cls_token is None:  # one per stage (CoaT-Lite: cls_token1..4), the last stage's before the final tokens
            staged = sorted((int(k[len('cls_token'):]), v) for k, v in vars(backbone).get('_parameters', {}).items()
                            if k[len('cls_token'):].isdigit() and k.startswith('cls_token'))
            cls_token = staged[-1][1] if staged else None
        prefix = cls_token.shape[1] if isinstance(cls_token, torch.Tensor) and cls_token.dim() == 3 else 0
    layout = dict(output_fmt=str(fmt or ''), num_prefix_tokens=int(prefix or 0))
    pe = getattr(backbone, 'patch_embed', None)
    grid = getattr(pe, 'grid_size', None)
    if grid is not None:
        layout['token_grid'] = _pair(grid)
    if pe is not None and hasattr(pe, 'dynamic_feat_size') and getattr(pe, 'patch_size', None) is not None:
        geom = dict(patch_size=_pair(pe.patch_size), feature_ratio=_pair(getattr(pe, 'feature_ratio', 1)),
                    dynamic_pad=bool(getattr(pe, 'dynamic_img_pad', False)))
        # use the image-size rule only where it reproduces the patch embed's own dynamic_feat_size
        step = geom['patch_size'][0] * geom['feature_ratio'][0], geom['patch_size'][1] * geom['feature_ratio'][1]
        sizes = [getattr(pe, 'img_size', None) or (4 * step[0], 4 * step[1]),
                 (5 * step[0] + 1, 3 * step[1] + step[1] // 2 + 1)]
        try:
            same = all(_pair(pe.dynamic_feat_size(tuple(s))) == image_token_grid(list(s), **geom) for s in sizes)
        except Exception:  # a patch embed of another kind: keep its fixed grid
            same = False
        if same:
            layout.update(geom)
    return layout


def _check_token_order(backbone: nn.Module) -> None:
    """Refuse a backbone whose final tokens are not its image grid in reading order, which the patch head lays out
    and pools by position: patch dropout (tokens dropped at random in training, timm's ``patch_drop_rate``), and a
    Hiera whose ``q_pool`` leaves unroll steps unconsumed (its ``forward_features`` tokens stay in unrolled order)."""
    from timm.layers import PatchDropout, PatchDropoutWithIndices
    arch = type(backbone).__name__
    rate = float(getattr(backbone, 'patch_drop_rate', 0.0) or 0.0)
    rate = max([rate] + [float(m.prob) for m in backbone.modules()
                         if isinstance(m, (PatchDropout, PatchDropoutWithIndices))])
    if rate > 0:
        raise ValueError(f'{arch} with patch_drop_rate={rate:g} drops its tokens at random in training, so its final '
                         f'map holds no image grid for the patch head to pool by region; build it with '
                         f'patch_drop_rate=0')
    reroll, ends = getattr(backbone, 'reroll', None), getattr(backbone, 'stage_ends', None)
    schedule = getattr(reroll, 'schedule', None)
    if isinstance(schedule, dict) and ends and ends[-1] in schedule and len(schedule[ends[-1]][0]) > 0:
        raise ValueError(f'{arch} with q_pool={getattr(backbone, "q_pool", "?")} leaves {len(schedule[ends[-1]][0])} '
                         f'of its unroll steps unconsumed, so its final tokens are not in image order and the patch '
                         f'head cannot pool them by region; use a q_pool that pools at every stage end but the last '
                         f'(the default, 3, for the 4-stage Hiera models)')


def _pool_default(backbone: nn.Module):
    """The default of ``global_pool`` in the backbone's ``reset_classifier`` (``Parameter.empty`` if none)."""
    try:
        param = inspect.signature(backbone.reset_classifier).parameters.get('global_pool')
    except (TypeError, ValueError):
        return inspect.Parameter.empty
    return inspect.Parameter.empty if param is None else param.default


def _global_pool_type(backbone: nn.Module) -> Optional[str]:
    """The backbone's current pooling type, read from the module that pools (as timm does for its exports)."""
    head = getattr(backbone, 'head', None)
    for pool in (getattr(head, 'global_pool', None), getattr(head, 'pool_type', None),
                 getattr(backbone, 'global_pool', None)):
        pool = getattr(pool, 'pool_type', pool)
        if isinstance(pool, str):
            return pool
    return None


def _prefix_names(names):
    if isinstance(names, (tuple, list)):
        return type(names)(f'backbone.{n}' for n in names)
    return f'backbone.{names}'


def _unprefix_names(names):
    if isinstance(names, (tuple, list)):
        return type(names)(_unprefix_names(n) for n in names)
    return names[len('backbone.'):] if names.startswith('backbone.') else names


_ANCHOR = r'(?<=^backbone\.)'  # where the backbone's own names start inside the wrapped model's names


def _prefix_regex(pattern: str) -> str:
    """``pattern`` (matched with ``re.match`` against backbone names) rewritten for ``backbone.``-prefixed names.

    Every alternative of a timm matcher is anchored at the name's start (``re.match``), so the whole pattern goes
    into a group after ``^backbone\\.``; its own ``^`` anchors (``r'^norm|^aligner'``) become a look-behind on that
    prefix, keeping their meaning. ``^`` inside a character class and escaped characters are left alone.
    """
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == '\\':
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == ']' and not (pattern[i - 1] == '[' or pattern[i - 2:i] == '[^'):
                in_class = False
            out.append(c)
        elif c == '[':
            in_class = True
            out.append(c)
        elif c == '^':
            out.append(_ANCHOR)
        else:
            out.append(c)
        i += 1
    return '^backbone\\.(?:' + ''.join(out) + ')'


def _prefix_matcher(v):
    if isinstance(v, str):
        return _prefix_regex(v)
    if isinstance(v, (list, tuple)):
        return [(_prefix_matcher(p[0]),) + tuple(p[1:]) if isinstance(p, (list, tuple)) else _prefix_matcher(p)
                for p in v]
    return v


def _join_classifier_group(matcher: Dict[str, Any], classifier_names: List[str]) -> Dict[str, Any]:
    """Put the patch head in the classifier's group of a (prefixed) dict matcher.

    Most backbones leave the classifier unmatched, and timm sorts unmatched names, the patch head's too, into one
    last group. Some match it (iFormer: ``(r'^head', (99999,))``, which joins the last block's group): there the
    patch head gets the entry and suffix that matched the classifier, so it lands in the same group rather than a
    group of its own after it, which would shift every layer-decay scale by one step. An entry with capture groups
    gives the classifier an ordinal read from its name, which the patch head's names cannot repeat; it is left
    unmatched there."""
    for name in classifier_names[:1]:
        for key, spec in matcher.items():
            if spec is None:
                continue
            entries = list(spec) if isinstance(spec, (list, tuple)) else [(spec, None)]
            for regex, suffix in entries:
                if re.match(regex, name):
                    if re.compile(regex).groups:
                        return matcher
                    out = dict(matcher)
                    out[key] = entries + [(r'^patch_head\.', suffix)]
                    return out
    return matcher


def _prefix_callable_matcher(fn):
    def matcher(name: str):
        if name.startswith('backbone.'):
            return fn(name[len('backbone.'):])
        return float('inf')  # the patch head goes with the classifier, after every backbone group
    return matcher


def holds_plain_backbone(state_dict: Mapping[str, Any], backbone: nn.Module) -> bool:
    """Whether ``state_dict`` is a plain model's for ``backbone``: no name under ``backbone.`` or ``patch_head.``,
    and some of the backbone's own names."""
    keys = list(state_dict.keys())
    if not keys or any(str(k).startswith(('backbone.', 'patch_head.')) for k in keys):
        return False
    own = set(backbone.state_dict().keys())
    return any(k in own for k in keys)


def check_per_position(per_position: Any) -> bool:
    """``per_position`` as a bool; anything but True or False (a string such as ``'no'``, an int) is a
    ``ValueError``, where a truthy value would otherwise silently build a classifier per cell."""
    if not isinstance(per_position, (bool, np.bool_)):
        raise ValueError(f'per_position must be True or False, got {per_position!r}')
    return bool(per_position)


def create_patchhead(arch: str, pretrained: bool = False, grid: GridSpec = 4, per_position: bool = False,
                     **kwargs) -> PatchHeadModel:
    """Build ``timm.create_model(arch, pretrained, **kwargs)`` and add a patch head for ``grid``.

    Backbone keyword arguments (``num_classes``, ``drop_path_rate``, ``output_stride``, ``img_size``,
    ``in_chans``, ``pretrained_cfg``...) pass through to timm.
    """
    grid = to_grid(grid)
    per_position = check_per_position(per_position)  # (before the backbone is built)
    backbone = timm.create_model(arch, pretrained=pretrained, **kwargs)
    if not hasattr(backbone, 'forward_features') or not hasattr(backbone, 'num_features'):
        raise ValueError(f'{arch} has no forward_features/num_features, which the patch head needs')
    return PatchHeadModel(backbone, grid=grid, per_position=per_position)
