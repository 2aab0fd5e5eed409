"""Models: the registry of named models, checkpoint converters, loading, and the ViT adapter."""

from vitscope.models.adapter import ViTModel
from vitscope.models.load import load_model, save_checkpoint
from vitscope.models.registry import REGISTRY, ModelSpec, Preprocessing, WeightSource, get_spec, list_specs

__all__ = ["REGISTRY", "ModelSpec", "Preprocessing", "ViTModel", "WeightSource", "get_spec", "list_specs",
           "load_model", "save_checkpoint"]
