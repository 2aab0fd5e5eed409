"""Models: the registry of named models, checkpoint converters, loading, and the ViT adapter. The names are
imported on first use (the registry alone needs neither torch nor timm: `vitscope models` lists it)."""

from vitscope._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "ViTModel": "vitscope.models.adapter", "load_model": "vitscope.models.load",
    "save_checkpoint": "vitscope.models.load",
    **{n: "vitscope.models.registry" for n in ("REGISTRY", "ModelSpec", "Preprocessing", "WeightSource",
                                                 "get_spec", "list_specs")},
})

__all__ = ["REGISTRY", "ModelSpec", "Preprocessing", "ViTModel", "WeightSource", "get_spec", "list_specs",
           "load_model", "save_checkpoint"]
