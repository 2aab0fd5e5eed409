"""Study configuration: YAML + ``key=value`` overrides, validated by OmegaConf against these dataclasses
before any model is loaded."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vitscope.errors import ConfigError, VitscopeError, close_matches
from vitscope.study.slots import (  # also imported from here
    DatasetConfig,
    analysis_models,
    check_dataset_formats,
    study_datasets,
)

DEVICE_TYPES = ("cpu", "cuda", "mps")  # where a study can run its models (torch knows more: meta, xla, ...)
#: the forward passes' precisions a study may name (`vitscope.capture.engine.DTYPES` maps them to torch's; a test
#: keeps the two the same), here so that `check` refuses a wrong one before torch is imported
DTYPE_NAMES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


@dataclass
class ModelConfig:
    name: str = ""                         # registry name, timm name, or checkpoint file
    label: str | None = None               # name in results (defaults to `name`)
    weights: str | None = None             # local checkpoint or URL
    pretrained: bool = True                # fetch the entry's weights; false = random init (seeded), no file
    checkpoint_format: str = "auto"        # auto, timm, mocov3, dino, mae, beit, simmim, dinov3 or open_clip
    seed: int = 0                          # random init (pretrained: false)
    kwargs: dict[str, Any] = field(default_factory=dict)   # timm.create_model arguments
    finetuned_from: str | None = None      # label of the model this one was fine-tuned from (pair stages)
    checkpoints: Any = None                # list of checkpoint files, or a run directory: one model per epoch
    epoch: int | None = None               # the fine-tuning epoch of this checkpoint (set by `checkpoints`)
    ablate: dict[str, Any] | None = None   # heads / MLPs ablated by write-hooks (see "Ablated variants" below)
    decoder: bool = False                  # MAE: its pixel decoder's blocks after the encoder's, on all tokens


@dataclass
class StudyConfig:
    models: list[ModelConfig] = field(default_factory=list)  # the models to compare (see ModelConfig)
    dataset: DatasetConfig | None = None   # shorthand for one dataset, named after its format
    datasets: dict[str, DatasetConfig] = field(default_factory=dict)  # named datasets (see DatasetConfig)
    analyses: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> params, `dataset`, `models`, `pairs`
    #                                       (`vitscope analyses` lists names and parameters); besides its parameters
    #                                       an entry takes the planner's keys: `dataset: NAME` picks its dataset,
    #                                       `models: [LABEL, ...]` runs it on those models only (labels as `label`
    #                                       or name; default every model; not for pair analyses), `pairs: [[A, B]]`
    #                                       names a pair analysis's model pairs
    batch_size: int = 32                   # images per forward pass (and per id chunk: the unit of resume)
    device: str = "cpu"                    # cpu, cuda, cuda:1, ...
    dtype: str = "fp32"                    # fp32, bf16 or fp16 forward passes
    seed: int = 0                          # seeds views (perturbations) and random choices of analyses
    output_dir: str = "vitscope-runs/study"  # the run directory: results/, manifest.json, config.yaml, report.html
    cache_dir: str | None = None           # shared across studies and jobs; default: per user (cache.default_cache_dir)
    save_every: int = 10                   # save partial states every N batches, and every 10 s (resume after a kill)
    num_workers: int | None = None         # image-reading processes; null: usable cores - 1 for files, 0 in memory
    progress: bool = True                  # progress bars
    published: list[dict[str, Any]] = field(default_factory=list)  # a paper's numbers shown beside this run's in the
    #                                       report: {analysis, model, metric, layer (int or 'best'), value, source}
    #                                       each, + selector columns (e.g. token_view) and `scale` (docs/recipes)


def default_config_path() -> Path:
    return Path(str(resources.files("vitscope") / "configs" / "default.yaml"))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                early: Callable[[StudyConfig], None] | None = None) -> StudyConfig:
    """Merge the YAML file (the embedded default if None) and dotlist overrides into a validated config.

    Overrides are ``key=value`` (OmegaConf dotlist, e.g. ``analyses.cka.views=[gap]``) or ``~key`` to remove
    an entry (e.g. ``~analyses.cka``). Every error is one ConfigError sentence; nothing is loaded.

    ``early(cfg)``: called once the checks that import nothing heavy have passed (`check`), before the others
    import torch (`vitscope run` makes its own refusals there: `early_refusals`)."""
    embedded = path is None
    overrides = list(overrides or [])
    recipe = recipe_name(path)
    if recipe is not None:
        path = recipe_path(recipe)
        roots, overrides = split_roots(overrides)
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    removals = [o[1:] for o in overrides if o.startswith("~")]
    try:
        schema = OmegaConf.structured(StudyConfig)
        loaded = _yaml(lambda: OmegaConf.load(path), path.name)
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"{path.name} must hold a mapping of settings (models, dataset, analyses, ...)")
        if recipe is not None:
            loaded = resolve_recipe(recipe, loaded, roots)
        cfg = OmegaConf.merge(schema, loaded)
        for o in overrides:  # one at a time, by path, so list items can be set too (models.0.weights=...)
            if o.startswith("~"):
                continue
            key, eq, raw = o.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"override {o!r} is not of the form key=value (or ~key to remove an entry)")
            _refuse_resolvers(raw, path.name, key.strip())
            value = OmegaConf.select(_yaml(lambda o=o: OmegaConf.from_dotlist([o]), "the overrides"), key.strip())
            OmegaConf.update(cfg, key.strip(), value, merge=True)
        _refuse_resolvers(OmegaConf.to_container(cfg, resolve=False), path.name)
        for key in removals:  # Hydra-style `~analyses.cka` removes an entry
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if node is None or leaf not in node:
                raise ConfigError(f"cannot remove {key!r}: the config has no such entry")
            node.pop(leaf)
        obj: StudyConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(omegaconf_sentence(e)) from None
    check(obj)
    if early is not None:
        early(obj)
    _check_with_torch(obj)  # `validate`, `check` done
    if embedded:
        obj.models = _zoo_models_that_pass_the_bar(obj.models)
    return obj


#: how a field's annotation reads in an error ("batch_size must be an integer")
_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "str | None": "a string (or null)", "int | None": "an integer (or null)",
               "dict[str, Any]": "a mapping", "list[ModelConfig]": "a list of models ({name: ...} each)",
               "DatasetConfig | None": "a dataset ({name: ..., n_images: ...})",
               "dict[str, DatasetConfig]": "a mapping of names to datasets ({name: ..., n_images: ...} each)",
               "dict[str, dict[str, Any]]": "a mapping of analysis names to their parameters"}


def omegaconf_sentence(e: OmegaConfBaseException) -> str:
    """OmegaConf's error as one sentence naming the key: an unknown key with its close match ("datasets.photos:
    unknown key 'n_image'; did you mean 'n_images'?"), a value of the wrong type with the type the key takes
    ("batch_size must be an integer, not 'abc'"); OmegaConf's own first line otherwise, never its
    full_key / reference_type / object_type lines."""
    import dataclasses

    full_key, key = str(getattr(e, "full_key", None) or ""), getattr(e, "key", None)
    owner = getattr(e, "object_type", None)
    fields = {f.name: f.type for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
    first = (getattr(e, "msg", None) or str(e)).strip().splitlines()[0]
    if fields and key is not None and key not in fields:  # a misspelt or unknown key
        where = full_key[:-len(str(key))].rstrip(".") or "the study config"
        hint = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
        return (f"{where}: unknown key {str(key)!r}; "
                + (f"did you mean {hint[0]!r}?" if hint else f"the keys are {', '.join(fields)}"))
    if fields and key in fields:  # a value of the wrong type
        want = str(fields[key])
        got = re.match(r"Value '(.*?)' (?:of type|is not)", first) or re.search(r"value: (.*)$", first)
        return f"{full_key} must be {_TYPE_WORDS.get(want, want)}" + (f", not {got.group(1)!r}" if got else "")
    return f"{full_key}: {first}" if full_key and full_key not in first else first


def _zoo_models_that_pass_the_bar(models: list[ModelConfig]) -> list[ModelConfig]:
    """The embedded study's models without the shipped zoo models the zoo's bar keeps out (a model that has not
    learned its objective is no basis for a finding: `vitscope.zoo.evaluate.judge`), nor the models fine-tuned
    from them; each one left out is named with the reason, as a ResultWarning."""
    import warnings

    from vitscope.errors import ResultWarning
    from vitscope.zoo.evaluate import shipped_bar_failures

    dropped: dict[str, str] = {}
    for m in models:
        why = shipped_bar_failures(m.name)
        if why:
            dropped[m.label or m.name] = "; ".join(why)
    for m in models:
        if m.finetuned_from in dropped and (m.label or m.name) not in dropped:
            dropped[m.label or m.name] = f"it was fine-tuned from {m.finetuned_from}, which is left out"
    for name, why in dropped.items():
        warnings.warn(f"{name} is left out of the default study: {why} (docs/ZOO.md)", ResultWarning, stacklevel=3)
    if dropped:
        them = "it" if len(dropped) == 1 else "them"
        warnings.warn(f"to run {them} anyway, add {', '.join(dropped)} to the models of a study of your own "
                      "(the run directory's config.yaml is one to start from) and `vitscope run STUDY.yaml`",
                      ResultWarning, stacklevel=3)
    return [m for m in models if (m.label or m.name) not in dropped]


_RESOLVER = re.compile(r"\$\{\s*[\w.-]+\s*:")


def _refuse_resolvers(node: Any, what: str, key: str = "") -> None:
    """OmegaConf resolvers (``${oc.env:HOME}``, ``${oc.decode:...}``) are off: the value they produce would be
    written into config.yaml and the report; plain references (``${datasets.a.root}``) stay allowed."""
    if isinstance(node, dict):
        for k, v in node.items():
            _refuse_resolvers(v, what, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _refuse_resolvers(v, what, f"{key}.{i}")
    elif isinstance(node, str) and _RESOLVER.search(node):
        raise ConfigError(f"{key} in {what} (or its overrides) calls a resolver ({node!r}); vitscope reads no "
                          "environment or resolver values into a study: write the value itself")


def _yaml(load: Any, what: str) -> Any:
    """``load()``, a YAML syntax error turned into one sentence saying where."""
    try:
        return load()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not a text (YAML) file: byte {e.start} is not {e.encoding}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"invalid YAML in {what}{where}: {problem}") from None


# load_model's own arguments: a study sets them through the model's fields, or not at all (trust_checkpoint
# unpickles arbitrary objects: only a program may ask for that, never a config file)
_LOAD_ARGS = {"weights": "weights", "pretrained": "pretrained", "checkpoint_format": "checkpoint_format",
              "seed": "seed", "device": "the top-level `device`", "trust_checkpoint": None, "strict": None,
              "checkpoint_key": None, "name_or_path": "name", "decoder": "decoder"}


def validate(cfg: StudyConfig) -> None:
    """The checks that need nothing but the config (`load_config` runs them; so does `preflight`, for configs
    built in code): ConfigError in one sentence. Those that import nothing heavy come first (`check`)."""
    check(cfg)
    _check_with_torch(cfg)


def check(cfg: StudyConfig) -> None:
    """`validate`'s checks that import neither torch nor an analysis, which `vitscope run` makes before it imports
    them (`load_config`'s ``early``): the models listed (checkpoint lists expanded), their labels distinct, their
    architecture sizes and kwargs; every count and range of the top level and of the datasets; the analyses'
    names and their parameters' names (`vitscope.analyses_listing.check_study_analysis`: the shipped snapshot
    where this process has not imported the analyses). ConfigError in one sentence."""
    if not cfg.models:
        raise ConfigError("the config lists no models: add at least one under `models:`")
    cfg.models = expand_models(cfg.models)
    for m in cfg.models:  # the decoder model beside the encoder alone: two labels, unless the entry gives one
        if m.decoder is True and m.label is None:
            m.label = f"{m.name} + decoder"
    if all(m.ablate is None for m in cfg.models):  # else labels are final once the ablations are read
        _check_labels(cfg)
    from vitscope.bounds import Range, check_arch
    from vitscope.models.names import file_given, random_init_takes_no_file

    for i, m in enumerate(cfg.models):
        check_arch(m.kwargs or {}, f"models[{i}].kwargs")
        _check_decoder(m, i)
        file = file_given(m.name, m.weights) if not m.pretrained else None
        if file:
            raise ConfigError(f"models[{i}] ({m.label or m.name}): {random_init_takes_no_file(file)}")
        for key in m.kwargs or {}:
            if key in _LOAD_ARGS:
                field_ = _LOAD_ARGS[key]
                raise ConfigError(f"models[{i}].kwargs.{key}: kwargs are timm.create_model arguments; "
                                  + (f"set {field_} instead" if field_ else f"{key} cannot be set from a study "
                                     "config (call vitscope.load_model in code for that)"))
    from vitscope.data.catalog import check_counts

    Range(1).check(cfg.batch_size, "batch_size")
    for name, d in study_datasets(cfg).items():
        check_counts("dataset" if d is cfg.dataset else f"datasets.{name}", d)
    check_dataset_formats(cfg)
    if cfg.num_workers is not None and (isinstance(cfg.num_workers, bool) or not isinstance(cfg.num_workers, int)
                                        or cfg.num_workers < 0):
        raise ConfigError(f"num_workers must be a whole number of processes, 0 or more (0 reads images in the "
                          f"study's process; null: the usable cores minus one where images are read from files); got "
                          f"{cfg.num_workers!r}")
    from vitscope.threads import usable_cores

    cores = usable_cores()
    if cfg.num_workers is not None and cfg.num_workers > cores:  # more would only wait for each other
        import warnings

        from vitscope.errors import ResultWarning

        warnings.warn(f"num_workers {cfg.num_workers} is more than the {cores} cores this process may use: {cores} "
                      "image-reading processes are started", ResultWarning, stacklevel=2)
        cfg.num_workers = cores
    if cfg.save_every < 1:
        raise ConfigError(f"save_every must be at least 1 (partial states are saved every save_every batches); "
                          f"got {cfg.save_every}")
    _check_dtype_and_device(cfg)
    from vitscope.analyses_listing import analysis_names, check_study_analysis, data_needs

    if not cfg.analyses:
        raise ConfigError(f"the config lists no analyses; available: {', '.join(sorted(analysis_names()))}")
    from vitscope.study.slots import match_slots

    datasets = study_datasets(cfg)
    labels = [m.label or m.name for m in cfg.models]
    labels_final = all(m.ablate is None or m.label for m in cfg.models)
    used: list[tuple[list[str], Any]] = []  # per analysis: its datasets and its models (None: every model)
    for name, params in cfg.analyses.items():
        try:
            check_study_analysis(name, params or {})
        except VitscopeError as e:
            raise ConfigError(f"analyses.{name}: {e}") from None
        needs, inputs = data_needs(name)
        slots = match_slots(name, needs, inputs, params or {}, datasets)  # the planner's matching, before torch
        given = (params or {}).get("models")
        if labels_final:  # else ablated variants are named later: `make_plan` checks them then
            given = analysis_models(name, given, labels)  # the labels, a checkpoint list's epochs included
        used.append((list(slots.values()), given))
    _check_whole_frames(cfg, used)
    _check_cls_views(cfg)
    check_published(cfg)


def _check_whole_frames(cfg: StudyConfig, used: list[tuple[list[str], Any]]) -> None:
    """A model known before torch to take its own input size only (BEiT's relative position bias; `known_fixed_size`)
    that an analysis runs on (``used``: per analysis its datasets and its ``models``, None: all) with a dataset
    whose images reach it whole (`whole_frames`): one sentence naming both and the fix, before any model loads
    (else found at that model's first pass, after the other models' passes). Other models (timm names, files)
    are checked when they load (`vitscope.study.passes.check_frames`)."""
    from vitscope.data.catalog import whole_frames
    from vitscope.models.names import known_fixed_size, whole_frames_refused

    dcs = study_datasets(cfg)
    for names, given in used:
        frames = [n for n in names if whole_frames(dcs[n])]
        wanted = {given} if isinstance(given, str) else None if given is None or isinstance(given, dict) \
            or not hasattr(given, "__iter__") else {str(g) for g in given}  # a bad value: said by analysis_models
        for m in cfg.models if frames else []:
            label = m.label or str(m.name)
            why = known_fixed_size(m.name, m.kwargs, m.decoder is True)
            if why is not None and (wanted is None or label in wanted):
                raise ConfigError(whole_frames_refused(label, frames[0], why))


#: parameters that name one token view, which an analysis cannot do without (the lists of views, `views`, drop
#: 'cls' on a model without one, with a warning where nothing is left)
_ONE_VIEW = ("view", "match_view", "token_view")


def _check_cls_views(cfg: StudyConfig) -> None:
    """'cls' asked as the one token view of an analysis, for a model known before torch to have no CLS token (a
    registry entry whose shipped taps listing says so, or a model built with ``class_token: false``): one sentence
    naming the views it gives. Other models (timm names, files) are checked when they load."""
    asked = [(name, key) for name, params in cfg.analyses.items() for key in _ONE_VIEW
             if (params or {}).get(key) == "cls"]
    if not asked:
        return
    from vitscope.models.names import listed_without_cls
    from vitscope.models.registry import REGISTRY

    for i, m in enumerate(cfg.models):
        kw = m.kwargs or {}
        if "class_token" in kw:
            has_cls = bool(kw["class_token"])
        elif m.name in REGISTRY:
            has_cls = not listed_without_cls(m.name)
        else:
            continue
        if not has_cls:
            name, key = asked[0]
            raise ConfigError(f"analyses.{name}.{key}: models[{i}] ({m.label or m.name}) has no CLS token; the token "
                              "views it gives are 'spatial', 'gap', 'gap_spatial'")


def _check_dtype_and_device(cfg: StudyConfig) -> None:
    """``dtype`` one of `DTYPE_NAMES`; ``device`` a device vitscope runs on (`DEVICE_TYPES`, ``cuda:1`` picking a
    GPU), read as torch reads ``type[:index]`` without importing it (whether that GPU exists is known when the
    first model loads)."""
    if cfg.dtype not in DTYPE_NAMES:
        hint = close_matches(str(cfg.dtype), DTYPE_NAMES, n=2)
        raise ConfigError(f"unknown dtype {cfg.dtype!r}" + (f"; did you mean {', '.join(hint)}?" if hint else "")
                          + f" Choose one of {', '.join(DTYPE_NAMES)}.")
    m = re.fullmatch(r"([a-z_]+)(?::(\d+))?", str(cfg.device))
    if m is None:
        said = str(cfg.device).lower()
        hint = ["cuda"] if said.startswith(("gpu", "nvidia")) else close_matches(said, DEVICE_TYPES, n=1)
        raise ConfigError(f"device {cfg.device!r} is not a device name (cpu, cuda, cuda:1, mps, ...)"
                          + (f"; did you mean {hint[0]}?" if hint else ""))
    if m.group(1) not in DEVICE_TYPES:
        raise ConfigError(f"device {cfg.device!r}: vitscope runs studies on {', '.join(DEVICE_TYPES)} (cuda:1 picks a "
                          f"GPU), not on {m.group(1)}")
    if m.group(1) == "cuda" and not _gpu_driver():
        raise ConfigError(f"device {cfg.device!r} was asked for but this machine has no GPU driver (no /dev/nvidia*, "
                          "/dev/kfd or /dev/dxg); set device=cpu")


def _gpu_driver() -> bool:
    """Whether a GPU driver torch's ``cuda`` could use may be present (NVIDIA, ROCm's /dev/kfd, WSL's /dev/dxg),
    known without importing torch; True off Linux and inside a container that hides /dev, where only torch can
    tell (`preflight` asks it)."""
    import sys
    from pathlib import Path

    if not sys.platform.startswith("linux") or not Path("/dev").is_dir() or not os.listdir("/dev"):
        return True
    dev = Path("/dev")
    return any(dev.glob("nvidia*")) or (dev / "kfd").exists() or (dev / "dxg").exists() \
        or Path("/proc/driver/nvidia").exists()


def _check_labels(cfg: StudyConfig) -> None:
    labels = [m.label or m.name for m in cfg.models]
    dupes = {x for x in labels if labels.count(x) > 1}
    if dupes:
        raise ConfigError(f"two models share the label {sorted(dupes)}: give each a distinct `label`")


def _check_with_torch(cfg: StudyConfig) -> None:
    """`validate`'s checks after `check`: those whose rules live beside torch code (ablations, the analyses'
    parameter types and ranges off the live classes, the plan)."""
    _check_ablations(cfg)
    _check_labels(cfg)
    from vitscope.analyses import get_analysis
    from vitscope.analyses.base import validate_params

    for name, params in cfg.analyses.items():
        try:
            validate_params(get_analysis(name), params or {})
        except VitscopeError as e:
            raise ConfigError(f"analyses.{name}: {e}") from None
    from vitscope.study.plan import make_plan

    make_plan(cfg)  # datasets matched with analyses, views and relations checked: before any model loads


def _check_decoder(m: ModelConfig, i: int) -> None:
    """``decoder: true`` reads MAE's pixel decoder from a checkpoint (`vitscope.models.mae_decoder`): an entry that
    loads no file (random init, timm's own weights, which keep the encoder alone) is one ConfigError sentence naming
    the model, before any model loads; a file without a decoder is refused when it loads, before any pass."""
    from vitscope.models.names import file_given, no_decoder
    from vitscope.models.registry import REGISTRY

    if not isinstance(m.decoder, bool):
        raise ConfigError(f"models[{i}] ({m.label or m.name}): decoder must be true or false, got {m.decoder!r}")
    if "decoder_num_heads" in (m.kwargs or {}) and not m.decoder:
        raise ConfigError(f"models[{i}] ({m.label or m.name}): kwargs.decoder_num_heads is for an MAE decoder; "
                          "set decoder: true or remove it")
    if not m.decoder:
        return
    entry = REGISTRY.get(m.name)
    if not m.pretrained:
        why = "a random init (pretrained: false) has no checkpoint"
    elif m.weights or file_given(m.name, None) or (entry is not None and entry.weights.kind in ("url", "file")):
        return
    else:
        why = "it loads no checkpoint file (pass weights: /path/to/mae_visualize_vit_*.pth)"
    raise ConfigError(f"models[{i}]: " + no_decoder(m.label or m.name, why))


def _check_ablations(cfg: StudyConfig) -> None:
    """Each ``ablate:`` entry parsed (`vitscope.models.ablation.parse_spec`), its statistics dataset named in the
    study, its blocks and heads within the model where the entry's kwargs give depth and num_heads (else when it
    loads); the variant labelled after the model and the ablation when the entry gives no label."""
    from vitscope.models.ablation import check_bounds, default_label, parse_spec

    names = None
    for i, m in enumerate(cfg.models):
        if m.ablate is None:
            continue
        where = f"models[{i}].ablate"
        spec = parse_spec(m.ablate, where)
        if spec.dataset is not None:
            names = names if names is not None else list(study_datasets(cfg))
            if spec.dataset not in names:
                hint = close_matches(spec.dataset, names)
                raise ConfigError(f"{where}.dataset: no dataset named {spec.dataset!r} in the study"
                                  + (f"; did you mean {', '.join(hint)}?" if hint else ";")
                                  + f" its datasets: {', '.join(names)}")
        kw = m.kwargs or {}
        if isinstance(kw.get("depth"), int) and isinstance(kw.get("num_heads"), int):
            check_bounds(spec, kw["depth"], kw["num_heads"], where)
        if m.label is None:
            m.label = default_label(m.name, spec)


#: the DatasetConfig fields that name a folder, and those that name a file, of the formats that read them
_DATA_FOLDERS, _DATA_FILES = ("root", "test_root"), ("annotations", "classes")


def check_data_folders(cfg: StudyConfig) -> None:
    """Every folder a dataset of the study reads from (``root``, ``test_root``) is a folder that holds something,
    and every file it names (``annotations``, ``classes``) exists, where its format reads that field: one
    ConfigError sentence naming the key and the format otherwise (`preflight`; `vitscope run` before it imports
    torch). The format's own loader checks what the folder must hold when the dataset is built."""
    from vitscope.data.catalog import FORMATS

    for name, d in study_datasets(cfg).items():
        fmt = FORMATS.get(d.name)
        if fmt is None:  # an unknown format: the plan's sentence
            continue
        where = "dataset" if d is cfg.dataset else f"datasets.{name}"
        reads = f"({fmt.name}: {fmt.description})"
        for key in (*_DATA_FOLDERS, *_DATA_FILES):
            value = getattr(d, key, None)
            if key not in fmt.options or value is None:
                continue
            p = Path(str(value))
            if not p.exists():
                raise ConfigError(f"{where}.{key} {str(p)!r} does not exist {reads}")
            if key in _DATA_FILES:
                if not p.is_file():
                    raise ConfigError(f"{where}.{key} {str(p)!r} is a folder, not a file {reads}")
                continue
            if not p.is_dir():
                raise ConfigError(f"{where}.{key} {str(p)!r} is a file, not a folder {reads}")
            if not any(not q.name.startswith(".") for q in p.iterdir()):
                raise ConfigError(f"{where}.{key} {str(p)!r} is an empty folder {reads}")


def early_refusals(cfg: StudyConfig, names: bool = True, lock: bool = True) -> None:
    """What `vitscope run` refuses before it imports torch, besides the config itself (`check`): with ``names``,
    a model name nothing knows (`vitscope.models.names.check_name`, in the sentence the model's loading gives),
    a dataset folder that is missing or empty (`check_data_folders`) and, with ``lock``, a run directory
    another run is writing into (`rundir.check_free`). ConfigError in one sentence; the full checks follow
    (`preflight`)."""
    from vitscope.models.names import check_name

    for i, m in enumerate(cfg.models if names else []):
        try:
            check_name(m.name)
        except VitscopeError as e:
            raise ConfigError(f"models[{i}] ({m.label or m.name}): {e}") from None
    check_data_folders(cfg)
    if lock:
        from vitscope.study.rundir import check_free

        check_free(Path(cfg.output_dir))


def preflight(cfg: StudyConfig, dry_run: bool = False) -> list[str]:
    """What can be checked about the machine before any model loads (`run_study` calls it first): the config
    itself (`validate`), the device, every model name and local checkpoint file, and that the output and
    cache directories can be written to (both are created). ConfigError in one sentence.

    ``dry_run`` (`vitscope run --dry-run`): nothing is created, and a weights file or checkpoint that is not
    there is not an error but one of the notes returned."""
    validate(cfg)
    check_data_folders(cfg)
    notes: list[str] = []
    import torch

    dev = torch.device(cfg.device)
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ConfigError(f"device {cfg.device!r} was asked for but this machine has {n} usable CUDA GPU(s); "
                          "set device=cpu" + (f" or cuda:0..{n - 1}" if n else ""))
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {cfg.device!r} was asked for but MPS is not available here; set device=cpu")
    from vitscope.models import checkpoints as ck
    from vitscope.models import hf
    from vitscope.models.load import check_build, resolve_spec

    for i, m in enumerate(cfg.models):
        try:
            for f in (m.name, m.weights):
                if f and "://" not in str(f) and Path(str(f)).is_file():
                    ck.check_checkpoint_file(f)
                elif f and m.pretrained and hf.is_model_dir(f):  # its config's sizes against its weights' shapes
                    hf.check_sizes(f, hf.read_config(f))
            if m.weights and "://" not in m.weights and not Path(m.weights).is_file():
                raise ConfigError(f"weights file {m.weights!r} does not exist")
            resolve_spec(m.name)
            check_build(m)  # built on the meta device: arguments timm refuses, parameters beyond memory
        except VitscopeError as e:
            if not dry_run:
                raise ConfigError(f"models[{i}] ({m.label or m.name}): {e}") from None
            notes.append(f"models[{i}] ({m.label or m.name}): {e} (a real run stops there)")
    from vitscope.study.cache import default_cache_dir

    out = Path(cfg.output_dir)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(out)
    if dry_run:
        would_be_writable(out, "output_dir")
        would_be_writable(cache, "the cache directory")
        return notes
    check_writable(out, "output_dir")
    check_writable(cache, "the cache directory", mode=0o700)
    if cache.stat().st_mode & 0o002:
        import warnings

        warnings.warn(f"the cache directory {str(cache)!r} is writable by every user: entries others put there "
                      "would be read as results (never run); prefer a private cache_dir", stacklevel=2)
    return notes


def would_be_writable(d: Path, what: str) -> None:
    """`check_writable` without creating or writing anything (a dry run): the directory, or the nearest folder
    that exists above it, can be written to."""
    import os

    if d.exists() and not d.is_dir():
        raise ConfigError(f"{what} {str(d)!r} is a file, not a directory; choose another path")
    here = d
    while not here.exists() and here.parent != here:
        here = here.parent
    if not here.is_dir() or not os.access(here, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(d)!r} cannot be written to ({str(here)!r} is not writable); choose a "
                          "writable directory")


def check_writable(d: Path, what: str, mode: int = 0o777) -> None:
    """Create ``d`` if needed and write (then remove) a file in it: ConfigError in one sentence if that fails."""
    import os

    if d.exists() and not d.is_dir():
        raise ConfigError(f"{what} {str(d)!r} is a file, not a directory; choose another path")
    probe = d / f".vitscope-write-check-{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True, mode=mode)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"{what} {str(d)!r} cannot be written to ({reason}); choose a writable directory"
                          ) from None


def parse_models_slice(text: str) -> tuple[int, int]:
    """``--models K/N``: the K-th of N slices (1-based). ConfigError in one sentence for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if m is None:
        raise ConfigError(f"--models {text!r} is not K/N (the K-th of N slices of the study's models, e.g. 1/4)")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1:
        raise ConfigError(f"--models {k}/{n}: N is the number of slices the models are cut into, so at least 1")
    if not 1 <= k <= n:
        raise ConfigError(f"--models {k}/{n}: K counts the slices from 1 to N, so it must be between 1 and {n}")
    return k, n


def slice_models(models: list[ModelConfig], k: int, n: int) -> list[ModelConfig]:
    """The models of slice ``k`` of ``n`` (`parse_models_slice`): round-robin over the config's models (checkpoint
    lists expanded), i.e. positions k-1, k-1+n, ...; ConfigError when the slice holds none."""
    got = list(models)[k - 1::n]
    if not got:
        raise ConfigError(f"--models {k}/{n}: the study has {len(models)} model(s), so slice {k} of {n} holds none; "
                          f"cut it into at most {len(models)} slices")
    return got


_EPOCH = re.compile(r"epoch[_-]?(\d+)", re.IGNORECASE)
CHECKPOINT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def expand_models(models: list[ModelConfig]) -> list[ModelConfig]:
    """Entries with ``checkpoints`` (a list of files or a run directory) -> one entry per checkpoint, labelled
    ``<label>@<epoch>`` with ``epoch`` from the file name (``..epoch012..``) or the position in the list."""
    out: list[ModelConfig] = []
    for m in models:
        if m.checkpoints is None:
            if not m.name:
                raise ConfigError("a model entry needs `name` (registry / timm name or a checkpoint file)")
            out.append(m)
            continue
        files = _checkpoint_files(m.checkpoints)
        base = m.label or m.name or Path(str(m.checkpoints)).name
        epochs = []
        for k, f in enumerate(files):
            found = _EPOCH.search(Path(f).stem)
            epoch = int(found.group(1)) if found else k
            epochs.append(epoch)
            out.append(replace(m, name=m.name or f, weights=f if m.name else m.weights, checkpoints=None,
                               label=f"{base}@{epoch}", epoch=epoch))
        if any(_EPOCH.search(Path(f).stem) is None for f in files):
            import warnings

            from vitscope.errors import ResultWarning, preview

            order = ("in the natural order of their names" if isinstance(m.checkpoints, str)
                     else "in the order listed")
            warnings.warn(f"checkpoints of {base}: not every file name says its epoch (..epoch012..), so epochs "
                          f"follow the files {order}: " + preview([f"{Path(f).name} -> {base}@{e}"
                                                                  for f, e in zip(files, epochs, strict=True)]),
                          ResultWarning, stacklevel=3)
    return out


def natural_key(name: str) -> list[Any]:
    """Sort key of names by the numbers in them: step2 < step10 < step100 (plain sorting gives 10, 100, 2)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t.lower()) for t in re.split(r"(\d+)", name)]


def _checkpoint_files(spec: Any) -> list[str]:
    if isinstance(spec, str):
        root = Path(spec)
        if not root.is_dir():
            raise ConfigError(f"checkpoints: {spec!r} is not a directory; give a run directory or a list of files")
        folder = root / "checkpoints" if (root / "checkpoints").is_dir() else root
        files = sorted((str(p) for p in folder.iterdir() if p.suffix in CHECKPOINT_SUFFIXES), key=natural_key)
        if not files:
            raise ConfigError(f"checkpoints: no checkpoint files ({', '.join(CHECKPOINT_SUFFIXES)}) in {str(folder)!r}")
        return files
    files = [str(f) for f in spec]
    if not files:
        raise ConfigError("checkpoints: the list is empty")
    return files


def to_yaml(cfg: StudyConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def schema_markdown() -> str:
    """Every key of a study YAML with its type, default and meaning, read off the dataclasses above (the
    comment beside each field is its documentation): docs/CONFIG.md is this text, checked by a test."""
    import dataclasses
    import inspect

    out = ["# Study configuration", "",
           "Every key of a study YAML (`vitscope run study.yaml key=value ...`), generated from the dataclasses in "
           "`src/vitscope/study/config.py` (`DatasetConfig`: `study/slots.py`; `python tools/config_schema.py > "
           "docs/CONFIG.md`; a test keeps the two equal). Analysis parameters are listed by `vitscope analyses`; "
           "dataset formats by `vitscope datasets`.",
           "",
           "Beside the keys, `vitscope run` takes `--dry-run` (what the run would cost: passes, forwards, cache "
           "growth, the memory of the largest batch's captured taps, superlinear finalize steps, the hours of "
           "forwards at an order-of-magnitude throughput per device type; no weights read, nothing written; a run "
           "estimated beyond 24 hours (`vitscope.study.cost.MAX_HOURS`) is warned about, here and before it "
           "starts, and still runs), `--models K/N` (slice K of N of the models, round-robin, into the cache only: "
           "docs/CLUSTER.md) and `--overwrite`. `vitscope cache [DIR]` lists `cache_dir`; `vitscope cache prune "
           "--older-than 30d --max-size 2GB` empties it, least recently used first.",
           ""]
    for cls, where in ((StudyConfig, "top level"), (ModelConfig, "each entry of `models:`"),
                       (DatasetConfig, "`dataset:` and each entry of `datasets:`")):
        comments = {}
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): .*?#\s*(.*)$", line)
            if m:
                comments[m.group(1)] = m.group(2)
        default = cls()
        out += [f"## {cls.__name__} ({where})", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            value = getattr(default, f.name)
            shown = "required" if value in ("", "???") and f.name == "name" and cls is ModelConfig else repr(value)
            typ = str(f.type).replace("|", "or")
            out.append(f"| `{f.name}` | {typ} | `{shown}` | {comments.get(f.name, '').replace('|', 'or')} |")
        out.append("")
    out += ["## Ablated variants (`ablate:` of a model entry)", "", ABLATE_DOC, ""]
    return "\n".join(out)


ABLATE_DOC = (
    "An entry with `ablate:` is the same weights with a forward pre-hook (a write-hook) on the output projection "
    "of each ablated block's attention, replacing the chosen heads' outputs (`block{i}.heads` slices) by 0 "
    "(`mode: zero`, the default) or by their mean per token position (`mode: mean`: over the first `images` images "
    "of the statistics dataset, the clean model's heads, as the `head_ablation` analysis averages them). `heads:` "
    "is `all` (every head of `layers`, default every block), a list of `[layer, head]` pairs, a list of heads with "
    "`layers: [...]`, or a head type (`local` = strict_local, soft_local, axial or offset_local; or one of "
    "strict_local, soft_local, axial, offset_local, global, mixed; optionally within `layers`), resolved per model "
    "by the rule of `aligned_attention_maps` (default thresholds) on the first `images` (default 500) images of "
    "`dataset` (default: the study's first dataset), clean, in selection order. Every analysis runs on the variant "
    "as on any model (cached, resumable, sharded); the cache key holds the spec and the statistics images, the "
    "manifest the resolved `[layer, head]` list (`models.<label>.ablation`), and the variant is labelled "
    "`<name> \u2212 <what> (<mode>)` unless `label` is given. `mlp: all` or `mlp: [blocks]` (alone or beside "
    "`heads`; `layers` picks the blocks of `heads` only) replaces those blocks' MLP outputs (`block{i}.fc2`, before "
    "layer scale) by 0 or by the clean model's mean per token position, from the same statistics pass "
    "(Park et al.: attention matters in CL, MLPs in MIM). Nothing is written to the weights; the hooks come off "
    "when the study is done with the model. Cost: one forward per image per variant, like any model, plus one "
    "statistics pass of `images` forwards when `mode` is mean or `heads` a type (the attention maps unfused then). "
    "Example: `models: [{name: zoo-dino}, {name: zoo-dino, ablate: {heads: local, mode: mean}}]`.")



# ---------------------------------------------------------------- recipes: a source paper's study in one command

#: `vitscope run recipe:NAME data_root=/data`: the config argument that names a shipped recipe
RECIPE_PREFIX = "recipe:"
#: the placeholders a recipe writes its paths with (``${data_root}/coco/...``, ``${ckpt_root}/...``), given on the
#: command line as ``data_root=/path``; ``${shipped}`` is the package's folder of shipped data files (class lists)
ROOT_KEYS = ("data_root", "ckpt_root")
#: what each root holds, for the sentence that asks for it
_ROOT_HOLDS = {"data_root": "the folder holding imagenet/, coco/, davis/, ... as docs/recipes/README.md lays out",
               "ckpt_root": "the folder holding the recipe's checkpoint files, as its comments name them"}


def recipes_dir() -> Path:
    """The shipped recipes' folder (``vitscope/configs/recipes``): one full study per source paper."""
    return Path(str(resources.files("vitscope") / "configs" / "recipes"))


def recipe_names() -> list[str]:
    """The shipped recipes' names, sorted (``recipe:NAME``)."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def recipe_name(config: str | Path | None) -> str | None:
    """``NAME`` of a ``recipe:NAME`` config argument; None for a file (or the embedded default)."""
    if isinstance(config, str) and config.startswith(RECIPE_PREFIX):
        return config[len(RECIPE_PREFIX):].strip()
    return None


def recipe_path(name: str) -> Path:
    """The YAML file of recipe ``name``; an unknown name is one ConfigError sentence with the close matches."""
    names = recipe_names()
    if name not in names:
        hint = close_matches(name, names)
        raise ConfigError(f"unknown recipe {name!r}" + (f" (did you mean {', '.join(hint)}?)" if hint else "")
                          + f"; the recipes are {', '.join(names)} (`vitscope recipes` lists them)")
    return recipes_dir() / f"{name}.yaml"


def split_roots(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """(``{data_root: ..., ckpt_root: ...}``, the other overrides): a recipe's roots are placeholders of its
    YAML, not keys of the study config, so they are taken out of the overrides before those are applied."""
    roots, rest = {}, []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and key.strip() in ROOT_KEYS:
            if not value.strip():
                raise ConfigError(f"{key.strip()}= is empty: pass {key.strip()}=/path ({_ROOT_HOLDS[key.strip()]})")
            roots[key.strip()] = str(Path(value.strip()).expanduser())
        else:
            rest.append(o)
    return roots, rest


def _placeholders(node: Any) -> set[str]:
    """The ``${name}`` placeholders the strings of a YAML tree use."""
    if isinstance(node, dict):
        return set().union(*(_placeholders(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_placeholders(v) for v in node)) if node else set()
    return set(re.findall(r"\$\{\s*([\w-]+)\s*\}", node)) if isinstance(node, str) else set()


def resolve_recipe(name: str, loaded: DictConfig, roots: dict[str, str]) -> DictConfig:
    """Recipe ``name``'s YAML with its ``${data_root}``, ``${ckpt_root}`` and ``${shipped}`` placeholders
    replaced, and its ``recipe:`` description (read by `vitscope recipes`) taken out: a study config. A root the
    recipe uses and the command line does not give is one ConfigError sentence saying to pass it."""
    raw = OmegaConf.to_container(loaded, resolve=False)
    raw.pop("recipe", None)
    used = _placeholders(raw)
    for key in ROOT_KEYS:
        if key in used and key not in roots:
            raise ConfigError(f"recipe {name!r} reads its files under {key}: pass {key}=/path ({_ROOT_HOLDS[key]})")
    shipped = str(resources.files("vitscope") / "data" / "shipped")
    node = OmegaConf.create({**raw, **roots, "shipped": shipped})
    OmegaConf.resolve(node)
    for key in (*ROOT_KEYS, "shipped"):
        node.pop(key, None)
    return node


def recipe_summaries() -> list[dict[str, Any]]:
    """Each shipped recipe read as plain YAML (no validation, no torch): name, paper, models, datasets, analyses,
    published numbers; what `vitscope recipes` lists."""
    out = []
    for name in recipe_names():
        raw = yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text(encoding="utf-8")) or {}
        about = raw.get("recipe") or {}
        models = []
        for m in raw.get("models") or []:
            label = m.get("label") or m.get("name")
            n = len(m["checkpoints"]) if isinstance(m.get("checkpoints"), list) else 1
            models.append(label if n == 1 else f"{label} x{n} checkpoints")
        out.append({"name": name, "paper": about.get("paper", ""), "models": models,
                    "datasets": list(raw.get("datasets") or {}), "analyses": list(raw.get("analyses") or {}),
                    "published": len(raw.get("published") or [])})
    return out


def format_recipes() -> str:
    """`vitscope recipes`: one line per recipe (name, paper, models, datasets, the number of analyses)."""
    lines = []
    for r in recipe_summaries():
        shown = ", ".join(r["models"][:4]) + (f", ... ({len(r['models'])} models)" if len(r["models"]) > 4 else "")
        lines.append(f"{r['name']:<17} {r['paper']} | models: {shown} | datasets: {', '.join(r['datasets'])} | "
                     f"{len(r['analyses'])} analyses, {r['published']} published numbers")
    lines += ["", "Run one: vitscope run recipe:NAME data_root=/data [ckpt_root=/ckpts] [key=value ...] (--dry-run: "
              "its cost first); the files: " + str(recipes_dir()) + " (docs/recipes/README.md)"]
    return "\n".join(lines) + "\n"


#: the keys every `published:` entry gives; `scale` (optional) takes the table's value to the paper's units (100:
#: the paper prints percent); any other key selects rows by that column of the analysis's table (token_view: cls)
PUBLISHED_KEYS = ("analysis", "model", "metric", "layer", "value", "source")


def check_published(cfg: StudyConfig) -> None:
    """Each ``published:`` entry a mapping with `PUBLISHED_KEYS`, naming an analysis vitscope has and a model
    of the study (its label), a layer that is a block index or 'best', a number as its value: one ConfigError
    sentence otherwise. The numbers are references shown in the report, never a test of the run."""
    if not cfg.published:
        return
    from vitscope.analyses_listing import analysis_names

    names = analysis_names()
    labels = [m.label or m.name for m in cfg.models]
    labels_final = all(m.ablate is None or m.label for m in cfg.models)  # else ablated variants are named later
    for i, p in enumerate(cfg.published):
        where = f"published[{i}]"
        if not isinstance(p, dict):
            raise ConfigError(f"{where} must be a mapping ({{analysis, model, metric, layer, value, source}}), "
                              f"not {p!r}")
        missing = [k for k in PUBLISHED_KEYS if k not in p]
        if missing:
            raise ConfigError(f"{where} lacks {', '.join(missing)}; each entry gives {', '.join(PUBLISHED_KEYS)}")
        if p["analysis"] not in names:
            hint = close_matches(str(p["analysis"]), names)
            raise ConfigError(f"{where}.analysis: unknown analysis {p['analysis']!r}"
                              + (f"; did you mean {', '.join(hint)}?" if hint else " (`vitscope analyses` lists them)"))
        if labels_final and p["model"] not in labels:
            hint = close_matches(str(p["model"]), labels)
            raise ConfigError(f"{where}.model: no model labelled {p['model']!r} in the study"
                              + (f"; did you mean {', '.join(hint)}?" if hint else f"; its models: {', '.join(labels)}")
                              )
        layer = p["layer"]
        if not (layer is None or layer == "best" or (isinstance(layer, int) and not isinstance(layer, bool))):
            raise ConfigError(f"{where}.layer must be a block index (0 = the first block), 'best' or null (a row "
                              f"without a layer), not {layer!r}")
        for key in ("value", "scale"):
            v = p.get(key, 1.0)
            if isinstance(v, bool) or not isinstance(v, int | float) or (key == "scale" and v <= 0):
                raise ConfigError(f"{where}.{key} must be a {'positive ' if key == 'scale' else ''}number, not {v!r}")
        if not isinstance(p["source"], str) or not p["source"].strip():
            raise ConfigError(f"{where}.source must say where the number is printed (e.g. 'Walmer et al. 2023, "
                              "Table 1')")
