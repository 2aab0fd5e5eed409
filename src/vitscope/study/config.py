"""Study configuration: YAML + ``key=value`` overrides, validated by OmegaConf against these dataclasses
before any model is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vitscope.errors import ConfigError, VitscopeError


@dataclass
class ModelConfig:
    name: str = "???"                      # registry name, timm name, or checkpoint file
    label: str | None = None               # name in results (defaults to `name`)
    weights: str | None = None             # local checkpoint or URL
    pretrained: bool = True
    checkpoint_format: str = "auto"
    seed: int = 0                          # random init (pretrained: false)
    kwargs: dict[str, Any] = field(default_factory=dict)   # timm.create_model arguments


@dataclass
class DatasetConfig:
    name: str = "synthetic-shapes"         # synthetic-shapes[-textured], synthetic-cue-conflict, imagefolder
    n_images: int = 256                    # generated images, or at most this many of a real dataset
    seed: int = 0
    size: int | None = None                # None = each model's input size
    root: str | None = None                # imagefolder: root/<class>/<image>
    classes: str | None = None             # imagefolder: class-list file (e.g. the ImageNet-50 ids)
    per_class: int | None = None           # imagefolder: first N sorted files per class
    test_root: str | None = None           # imagefolder: same classes, the test split (default root/test|val)


@dataclass
class StudyConfig:
    models: list[ModelConfig] = field(default_factory=list)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    analyses: dict[str, dict[str, Any]] = field(default_factory=dict)
    batch_size: int = 32
    device: str = "cpu"
    dtype: str = "fp32"
    seed: int = 0
    output_dir: str = "vitscope-runs/study"
    cache_dir: str | None = None           # shared across studies; default: per user (cache.default_cache_dir)
    save_every: int = 10                   # save partial states every N batches (resume after a kill)
    progress: bool = True


def default_config_path() -> Path:
    return Path(str(resources.files("vitscope") / "configs" / "default.yaml"))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> StudyConfig:
    """Merge the YAML file (the embedded default if None) and dotlist overrides into a validated config.

    Overrides are ``key=value`` (OmegaConf dotlist, e.g. ``analyses.cka.views=[gap]``) or ``~key`` to remove
    an entry (e.g. ``~analyses.cka``)."""
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        overrides = list(overrides or [])
        removals = [o[1:] for o in overrides if o.startswith("~")]
        schema = OmegaConf.structured(StudyConfig)
        cfg = OmegaConf.merge(schema, OmegaConf.load(path),
                              OmegaConf.from_dotlist([o for o in overrides if not o.startswith("~")]))
        for key in removals:  # Hydra-style `~analyses.cka` removes an entry
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if node is None or leaf not in node:
                raise ConfigError(f"cannot remove {key!r}: the config has no such entry")
            node.pop(leaf)
        obj: StudyConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config {path.name}: {e}".replace("\n", "; ")) from e
    if not obj.models:
        raise ConfigError("the config lists no models: add at least one under `models:`")
    labels = [m.label or m.name for m in obj.models]
    dupes = {x for x in labels if labels.count(x) > 1}
    if dupes:
        raise ConfigError(f"two models share the label {sorted(dupes)}: give each a distinct `label`")
    if obj.batch_size < 1 or obj.dataset.n_images < 1:
        raise ConfigError("batch_size and dataset.n_images must be at least 1")
    from vitscope.analyses import ANALYSES, get_analysis

    if not obj.analyses:
        raise ConfigError(f"the config lists no analyses; available: {', '.join(sorted(ANALYSES))}")
    for name in obj.analyses:
        try:
            get_analysis(name)
        except VitscopeError as e:
            raise ConfigError(f"analyses.{name}: {e}") from None
    return obj


def to_yaml(cfg: StudyConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
