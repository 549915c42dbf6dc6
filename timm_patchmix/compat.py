"""The private timm APIs this package cannot do without, each with the reason; nothing else imports a private timm
or torch module. Everything else comes from timm's public namespaces (``timm.models.load_pretrained``,
``timm.models.PretrainedCfg``, ``timm.models.checkpoint_seq``, ``timm.utils.*``...).
"""
# timm's Hub helpers for one file of a repo and for config.json in timm's format. ``timm.models`` exports
# ``load_model_config_from_hf`` (which also resolves a pretrained cfg, for a model timm knows before the config is
# read) and ``save_for_hf`` (which writes the weights too, by its own rules); the Hub-folder code needs the config.json
# alone, read before any model exists and written beside weights saved atomically by this package.
from timm.models._hub import download_from_hf, save_config_for_hf  # noqa: F401

__all__ = ['download_from_hf', 'save_config_for_hf']
