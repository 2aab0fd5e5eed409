"""The accumulator protocol every analysis honours, and the registry of analyses by name.

An analysis is created per model, declares the taps it needs, and sees each batch once:

    a = AttentionDistance(vm, layers=[0, 5])
    a.required_taps()            -> ["block0.attn", "block5.attn"]
    a.update(feats, batch)       # feats: {tap: tensor} for this batch only
    a.merge(other)               # same analysis, other images (a shard or a resumed part)
    a.state_dict() / a.load_state_dict(state)   # tensors and plain values only: cached, resumable
    a.finalize() -> pandas.DataFrame             # tidy: model, analysis, metric, layer, head, token_view, value
    a.empty_reason() -> str                      # why finalize gave no rows (the study says it, never silent)

Memory must not grow with the number of images: keep sums, small per-batch statistics, or a bounded
number of pooled vectors.

What data it needs is declared, so the study planner can match analyses with datasets at config time:
``needs`` (capabilities of its main dataset, `vitscope.data.catalog.CAPABILITIES`), ``inputs`` (further named
datasets, e.g. ``{"train": frozenset({"labels"})}``, chosen with the parameter ``train_dataset``) and
``views(params)`` (the perturbed views of its main dataset it wants besides the clean one). Each batch says
which pass it belongs to (``batch.dataset``, ``batch.view``); the planner sets ``self.datasets``
(slot -> dataset name), ``self.finetuned_from`` and ``self.epoch`` for related models.

`PairAnalysis` is the same protocol over two models at once (both loaded, gradients allowed), for lenses such
as representation inversion that cannot be computed from one model's activations.

Forward calls an analysis makes itself, beside the passes the study streams (a statistics pass in ``prepare``, a
forward and backward per batch, inversions, reruns of later blocks), are declared by ``own_forwards`` (a list
of `Forwards`, computed from its parameters, the model's architecture and the sizes of its data, `DataSizes`),
so the estimate before a run (`vitscope.study.cost`) counts them without running anything; a pair analysis
declares every forward of its stage.
"""

from __future__ import annotations

import inspect
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
import torch

from vitscope.analyses_listing import PLANNER_KEYS, check_parameter_names, planner_key  # noqa: F401 - its old home
from vitscope.bounds import check_value
from vitscope.errors import VitscopeError, unknown_name

if TYPE_CHECKING:
    from pathlib import Path

    from vitscope.data.base import Batch
    from vitscope.models.adapter import ModelInfo, ViTModel

COLUMNS = ["model", "analysis", "metric", "layer", "head", "token_view", "value"]
PAIR_COLUMNS = ["model_b", "layer_b"]


@dataclass(frozen=True)
class Forwards:
    """Forward calls an analysis makes itself, beside the passes the study streams (`Analysis.own_forwards`,
    `PairAnalysis.own_forwards`), as the estimate before a run counts them (`vitscope.study.cost`).

    ``calls`` forward calls of ``images`` images in all (the rows of every call together); ``gradients``: each
    call is followed by a backward (about two forwards' work more). ``blocks``: the block passes (images x
    blocks) of all of them, where fewer than every image through every block (rows that leave after an earlier
    block, a pass that stops after its deepest tap, a rerun from a later block); None: every block. ``model``:
    in a pair analysis the model that runs them, ``"a"`` or ``"b"`` (an analysis of one model: ``""``).
    ``once``: a name for products kept in the study cache and read back by every later stage that asks for
    them (model A's inversions, which every pair (A, B) shares): calls with the same ``once`` of the same model,
    analysis and dataset are made once per run."""

    calls: int
    images: int
    gradients: bool = False
    blocks: int | None = None
    model: str = ""
    once: str = ""


@dataclass(frozen=True)
class DataSizes:
    """What the estimate before a run knows of an analysis's main dataset without reading an image: the images
    of each batch of a pass over it (``batches``, the study's chunks), how many images are selected
    (``selected``), the study's ``batch_size``, and ``classes``: how many classes its labels name (0 where the
    dataset does not say), None for a dataset without labels."""

    batches: tuple[int, ...]
    selected: int
    batch_size: int
    classes: int | None = None

    def first(self, n: int) -> list[int]:
        """The images of each batch ``first_images(n)`` yields (`Analysis.prepare`): the first ``n`` selected
        images (all of them when fewer are selected) in batches of ``batch_size``."""
        k, size = min(int(n), self.selected), max(int(self.batch_size), 1)
        return [min(size, k - s) for s in range(0, k, size)]


def views_with_cls(analysis: Any, views: str | Iterable[str]) -> list[str]:
    """``views`` (a token view or several) less ``cls`` on a model without a CLS token (token 0 of a model with
    registers is a register, never read as CLS); when that leaves none, one ResultWarning says so, so an
    analysis that would compute nothing never does so silently."""
    import warnings

    from vitscope.errors import ResultWarning

    asked = [views] if isinstance(views, str) else list(views)
    kept = [v for v in asked if v != "cls" or analysis.has_cls_token]
    if asked and not kept:
        analysis.no_rows_because = ("the model has no CLS token and the only token view asked for is 'cls' (ask for "
                                    "'gap' or 'gap_spatial' too)")
        warnings.warn(f"{analysis.name}: model {analysis.model_name!r} has no CLS token, and the only token view "
                      "asked for is 'cls', so it computes nothing for this model; ask for 'gap' or 'gap_spatial' too",
                      ResultWarning, stacklevel=3)
    return kept


class _Lifecycle(ABC):
    """What the study engine needs of every analysis, of one model (`Analysis`) or of a pair (`PairAnalysis`):
    what data it is fed, and a state that merges (resume, shards), saves, loads and finalizes into a table."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: raised when the meaning or layout of ``state_dict`` changes: part of the cache key, so states written
    #: by an older version are recomputed instead of misread
    state_version: ClassVar[int] = 1
    #: capabilities its main dataset must provide (`vitscope.data.catalog.CAPABILITIES`)
    needs: ClassVar[frozenset[str]] = frozenset()
    #: further named datasets and what each must provide; chosen with the parameter ``<slot>_dataset``
    inputs: ClassVar[dict[str, frozenset[str]]] = {}
    #: listed in the embedded default study (configs/default.yaml); False for lenses a study names itself
    in_default_study: ClassVar[bool] = True
    #: parameters an earlier version took: name -> the sentence saying what replaced it and why
    replaced: ClassVar[dict[str, str]] = {}

    @classmethod
    def views(cls, params: Mapping[str, Any]) -> list[str]:
        """The views of the main dataset this analysis is fed (`vitscope.data.views` specs), clean first."""
        return ["clean"]

    @abstractmethod
    def merge(self, other: Any) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def finalize(self) -> pd.DataFrame: ...

    #: why this analysis computes nothing for its model, known when it is built (`views_with_cls`): the reason
    #: `empty_reason` gives first; set in ``__init__``, so a state read back from the cache says it too
    no_rows_because: str | None = None

    def empty_reason(self) -> str:
        """Why `finalize` gave no rows, as one sentence without the analysis's or the model's name (the study
        adds both: `explain_empty`), so no analysis ever returns nothing silently. Read after `finalize`, also on a
        state loaded from the cache, so it must be derived from the state (never remembered from ``update`` alone).
        Default: ``no_rows_because``, else what it was fed against what it needs; analyses with sharper reasons
        (no image had two classes, every mask was empty) override it."""
        if self.no_rows_because:
            return self.no_rows_because
        data = self.datasets.get("data")
        where = f"dataset {data!r}" if data else "its dataset"
        n = int(getattr(self, "n_images", 0) or 0)
        if not n:
            return f"{where} gave it no images (an empty selection, or none of them could be read)"
        if self.needs:
            return (f"none of the {n} images of {where} gave what it needs ({', '.join(sorted(self.needs))}): check "
                    "that the dataset provides it for these images")
        return f"none of the {n} images of {where} gave anything it measures with these parameters"

    @classmethod
    def cross(cls, analyses: list[Any]) -> pd.DataFrame | None:
        """Results across models (one finished analysis per model), e.g. CKA of model A vs model B.
        None when the analysis has no cross-model part."""
        return None

    @classmethod
    def cross_empty_reason(cls, analyses: list[Any]) -> str:
        """Why `cross` gave a table without rows (one sentence, as `empty_reason`). Default: how many models it had
        and how many of them were fed images."""
        fed = sum(1 for a in analyses if getattr(a, "n_images", 0))
        return (f"its cross-model part found nothing to compare among {len(analyses)} model(s), {fed} of which were "
                "fed images")


class Analysis(_Lifecycle):
    def __init__(self, vm: ViTModel, **params: Any):
        self.model_name = vm.name
        self.depth = vm.depth
        self.num_heads = vm.num_heads
        self.embed_dim = getattr(vm, "embed_dim", None)  # None on stand-ins that lack it (tests)
        self.grid_size = vm.grid_size
        self.patch_size = vm.patch_size
        self.num_prefix_tokens = vm.num_prefix_tokens
        self.has_cls_token = vm.has_cls_token
        self.decoder_from = getattr(vm, "decoder_from", None)  # MAE decoder blocks from here on (`tidy` labels)
        self.n_images = 0
        self.datasets: dict[str, str] = {}
        self.finetuned_from: str | None = None
        self.epoch: int | None = None
        #: where the large finalize steps compute (k-NN, probes): the model's device, set by the study (and
        #: `run_passes`), so a part resumed or read from the cache finalizes where an uninterrupted run does
        self.device = torch.device("cpu")

    def grid_of(self, batch: Any) -> tuple[int, int]:
        """The token grid of a batch's images (one size per batch; a tiled batch's: the tile's), which may
        differ from the model's native ``grid_size`` when a dataset keeps whole frames (rectangular inputs).
        A batch without (B, C, H, W) images (features fed by hand) is on the native grid."""
        images = getattr(batch, "images", None)
        if images is None or images.ndim != 4:
            return tuple(self.grid_size)
        h, w = images.shape[-2:]
        return int(h) // self.patch_size, int(w) // self.patch_size

    def pass_grid(self, batch: Any) -> tuple[int, int]:
        """For analyses whose state has the token grid's shape (maps, spectra, token Grams): the batch's grid,
        adopted as ``self.grid_size`` on the first batch (`on_grid` reallocates the state), the same for every
        later batch; images of another size are one sentence (a sum of maps needs one grid)."""
        g = self.grid_of(batch)
        if g != tuple(self.grid_size):
            if self.n_images or getattr(self, "_grid_fixed", False):
                raise VitscopeError(f"{self.name} sums maps of one token grid; this pass has images on a {g[0]}x{g[1]} "
                                    f"and a {self.grid_size[0]}x{self.grid_size[1]} grid (whole frames of different "
                                    "sizes): give the dataset one image size, or the option crop: center")
            self.grid_size = g
            self.on_grid(g)
        self._grid_fixed = True
        return g

    def on_grid(self, grid: tuple[int, int]) -> None:
        """Reallocate grid-shaped state for a new token grid (before any image was added); default: nothing."""
        return None

    def _check_grid_merge(self, other: Any) -> None:
        if other.n_images and self.n_images and tuple(other.grid_size) != tuple(self.grid_size):
            raise VitscopeError(f"{self.name}: cannot merge parts computed on token grids {tuple(self.grid_size)} "
                                f"and {tuple(other.grid_size)}")
        if not self.n_images and other.n_images and tuple(other.grid_size) != tuple(self.grid_size):
            self.grid_size = tuple(other.grid_size)
            self.on_grid(self.grid_size)

    def layers_param(self, layers: Any) -> list[int]:
        """``None``/'all' -> every block; negative indices count from the end."""
        if layers is None or layers == "all":
            return list(range(self.depth))
        out = []
        for i in ([layers] if isinstance(layers, int) else list(layers)):
            j = i + self.depth if i < 0 else i
            if not 0 <= j < self.depth:
                raise VitscopeError(f"{self.name}: layer {i} is out of range for a {self.depth}-block model")
            out.append(j)
        return out

    def configure(self, dataset_classes: Mapping[str, Any] | None = None) -> None:
        """Called by the study before the first pass with each input's class names (``{slot: classes}``), so
        decisions that depend on the data (e.g. which readout can score it) fail at once; a no-op by default."""
        return None

    def prepare(self, vm: ViTModel, first_images: Callable[[int], Iterable[Batch]]) -> None:
        """Called by the study (and `vitscope.analyses._drive.run_passes`) with the loaded model before the
        analysis's first pass, also when it resumes from a saved part: ``first_images(n)`` yields the clean
        batches of the first ``n`` images of its main dataset's selection, in dataset order and the same on every
        rank, for a statistic the passes need before they start (head_ablation's mean). Default: nothing."""
        return None

    @abstractmethod
    def required_taps(self) -> list[str]: ...

    def state_bytes(self, n_images: int) -> int:
        """About how many bytes its cache entry takes after ``n_images`` images, for the estimate before a run
        (`study/cost.py`). Default: sums per layer and head and the table, 256 KiB (the default study's such entries
        take 10-800 KiB, 250 KiB on average); analyses that keep per-image data say theirs."""
        return 1 << 18

    def superlinear(self, n_images: int) -> list[str]:
        """Its finalize steps that grow faster than linearly in the images, each with its size (`study/cost.py`)."""
        return []

    def own_forwards(self, vm: ViTModel, data: DataSizes) -> list[Forwards]:
        """The forward calls it makes itself on ``vm`` (the architecture; its weights are never read), beside the
        streamed passes, when its passes run over ``data`` (`Forwards`; the statistics pass of ``prepare`` among
        them), for the estimate before a run (`study/cost.py`). Default: none."""
        return []

    @abstractmethod
    def update(self, feats: Mapping[str, torch.Tensor], batch: Batch) -> None: ...

    def tidy(self, rows: list[dict[str, Any]]) -> pd.DataFrame:
        """The rows as a tidy table; on a model with its MAE decoder (``decoder: true``) with ``block_label``
        ('block 3', 'decoder 2': `vitscope.models.adapter.block_label`), which the figures put on their block
        axis."""
        df = tidy_frame(rows, self.model_name, self.name)
        if self.decoder_from is not None and len(df):
            from vitscope.models.adapter import block_label

            df["block_label"] = [None if pd.isna(v) else block_label(self, int(v)) for v in df["layer"]]
        return df


#: ``DataFrame.attrs`` keys of a table without rows (`explain_empty`): why it has none, and of which model (or
#: pair, or the cross-model stage), carried with the table to the run's ``results/summary/empty.parquet``
EMPTY_REASON, EMPTY_MODEL = "vitscope_empty_reason", "vitscope_empty_model"


def explain_empty(analysis: Any, frame: pd.DataFrame | None, model: str) -> pd.DataFrame | None:
    """``frame`` unchanged where it has rows (None stays None only then); else an empty table (``frame``'s columns,
    or the tidy ones) carrying why in its ``attrs`` (`EMPTY_REASON`, `EMPTY_MODEL`), the reason from the analysis's
    `empty_reason` (a generic sentence where that gives none or fails: an empty table is never silent)."""
    if frame is not None and len(frame):
        return frame
    try:
        reason = str(analysis.empty_reason() or "").strip().rstrip(".")
    except Exception as e:  # noqa: BLE001 - the reason must not cost the run; the failure is the reason then
        reason = f"its empty_reason failed ({type(e).__name__}: {e})"
    if not reason:
        reason = f"{type(analysis).__name__}.empty_reason gave no reason"
    out = frame.copy() if frame is not None else tidy_frame([], model, getattr(analysis, "name", "?"))
    out.attrs[EMPTY_REASON], out.attrs[EMPTY_MODEL] = reason, model
    return out


def has_cross(cls: type[Any]) -> bool:
    """Whether an analysis class has a cross-model part (overrides `cross`): a model's rows may come from there
    (similarity's pairs of models), so an empty table of that model alone is judged after the cross-model stage."""
    return getattr(cls.cross, "__func__", None) is not _Lifecycle.cross.__func__


def tidy_frame(rows: list[dict[str, Any]], model: str, analysis: str) -> pd.DataFrame:
    """Rows -> a table with the tidy columns first (missing ones None), ``model`` and ``analysis`` set."""
    df = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = None
    df["model"] = model
    df["analysis"] = analysis
    extra = [c for c in df.columns if c not in COLUMNS]
    return df[COLUMNS + extra]


class PairAnalysis(_Lifecycle):
    """An analysis of two models at once (A, B), e.g. B's view of A's inversions. Same life cycle as `Analysis`,
    but ``update`` gets both loaded models and may use gradients; states are cached per (A, B, dataset,
    parameters), resumable per batch and merged across shards like any other state.

    Which pairs: every (A, B) where B is declared ``finetuned_from: A`` in the study, unless the parameter
    ``pairs: [[A, B], ...]`` names them. ``self.store(key)`` is a cache directory for products of model A
    reusable by every B (e.g. inversions), keyed by A, the dataset and ``key``.
    """

    pair: ClassVar[bool] = True

    def __init__(self, info_a: ModelInfo, info_b: ModelInfo, **params: Any):
        self.model_a, self.model_b = info_a.name, info_b.name
        self.info_a, self.info_b = info_a, info_b
        self.n_images = 0
        self.datasets: dict[str, str] = {}
        self.epoch: int | None = None  # of model B, for checkpoint lists
        self._store: Callable[[str], Path] | None = None

    def store(self, key: str) -> Path:
        """A cache directory for reusable products of model A (set by the planner; a temporary one otherwise)."""
        if self._store is None:
            import shutil
            import tempfile
            import weakref
            from pathlib import Path

            if getattr(self, "_tmp", None) is None:  # removed with the analysis (it was left in /tmp before)
                self._tmp = tempfile.mkdtemp(prefix="vitscope-store-")
                weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)
            d = Path(self._tmp) / key
            d.mkdir(parents=True, exist_ok=True)
            return d
        return self._store(key)

    @abstractmethod
    def update(self, vm_a: ViTModel, vm_b: ViTModel, batch: Batch) -> None: ...

    def own_forwards(self, vm_a: ViTModel, vm_b: ViTModel, data: DataSizes) -> list[Forwards]:
        """Every forward call of its stage over ``data`` (the stage's pass over its main dataset, clean: one
        ``update`` per batch of ``data.batches``) on ``vm_a`` and ``vm_b`` (the architectures; their weights are
        never read), for the estimate before a run (`study/cost.py`): `Forwards` with ``model`` ``"a"`` or
        ``"b"``. Default: none."""
        return []

    def tidy(self, rows: list[dict[str, Any]]) -> pd.DataFrame:
        df = tidy_frame(rows, self.model_a, self.name)
        if "model_b" not in df.columns or df["model_b"].isna().all():
            df["model_b"] = self.model_b
        return df


ANALYSES: dict[str, type[Analysis] | type[PairAnalysis]] = {}


def register_analysis(cls: type[Any]) -> type[Any]:
    if cls.name in ANALYSES:
        raise ValueError(f"analysis {cls.name!r} is registered twice")
    ANALYSES[cls.name] = cls
    return cls


def get_analysis(name: str) -> type[Any]:
    if name not in ANALYSES:
        raise unknown_name("analysis", name, ANALYSES)
    return ANALYSES[name]


# -- parameters: what a study config may pass to an analysis --------------------------------------------

# the planner's keys (`PLANNER_KEYS`: which dataset an analysis runs on; not arguments) and the rule for parameter
# names live in vitscope.analyses_listing, which `vitscope run` reads before it imports torch


def analysis_parameters(cls: type[Analysis]) -> dict[str, inspect.Parameter]:
    """The parameters ``cls`` takes (its ``__init__`` after ``vm``), annotations resolved where they can be,
    in signature order: ``{name: inspect.Parameter}`` (``.default``, ``.annotation``)."""
    out: dict[str, inspect.Parameter] = {}
    skip = 3 if getattr(cls, "pair", False) else 2  # self and the model (a pair analysis: both models)
    # ``**kw`` handed on to the parent class's __init__ (band_noise -> the probe's parameters): the parent's
    # parameters are this one's too, up to the protocol's own open-ended base classes
    for klass in [k for k in cls.__mro__ if "__init__" in vars(k) and k not in (Analysis, PairAnalysis, object)]:
        init = vars(klass)["__init__"]
        hints = _type_hints(init)
        var_kw = None
        for i, (name, p) in enumerate(inspect.signature(init).parameters.items()):
            if i < skip or p.kind is inspect.Parameter.VAR_POSITIONAL or name in out:
                continue
            if p.kind is p.VAR_KEYWORD:
                var_kw = p
                continue
            out[name] = p.replace(annotation=hints.get(name, Any))
        if var_kw is None:
            return out
    out["**"] = inspect.Parameter("params", inspect.Parameter.VAR_KEYWORD)
    return out


def _type_hints(fn: Any) -> dict[str, Any]:
    """``fn``'s annotations resolved (``Annotated`` kept); one that cannot be (a name imported only for type
    checkers) is left out, and so unchecked, instead of losing the others."""
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # noqa: BLE001
        out = {}
        for name, ann in getattr(fn, "__annotations__", {}).items():
            try:
                out[name] = eval(ann, fn.__globals__) if isinstance(ann, str) else ann  # noqa: S307 # safe: an annotation string of the analysis class's own source, never config or file text
            except Exception:  # noqa: BLE001
                continue
        return out


def validate_params(cls: type[Analysis], params: Mapping[str, Any] | None) -> None:
    """Check ``params`` (as a study config gives them) against what ``cls`` takes, without a model: every name
    is a parameter of its ``__init__`` (the closest ones suggested otherwise) and every value has the
    annotated type (ints for ``int``, numbers for ``float``, lists for ``Sequence[...]``; ``Any`` is not
    checked). The planner's own keys (``dataset``, ``*_dataset``) are let through. Raises ConfigError in
    one sentence; values that only a model can judge (a layer out of range) are checked when it is built."""
    accepted = analysis_parameters(cls)
    # the names: a rule `vitscope run` also checks before torch, against the shipped snapshot (analyses_listing)
    check_parameter_names(cls.name, params or {}, tuple(accepted), cls.replaced)
    for key, value in (params or {}).items():
        if planner_key(str(key)) or key not in accepted:  # the planner's, or taken by a **kw
            continue
        check_value(value, accepted[key].annotation, f"parameter {key!r} of analysis {cls.name!r}")

