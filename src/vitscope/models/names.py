"""Model names without torch or timm: the refusal of a name no registry entry, timm model, file or hub id has,
in the one sentence `vitscope.models.load.resolve_spec` gives, decided before `vitscope run` imports torch.

timm's model names are read off its sources (``timm/models/*.py``, where each model is a function under
``@register_model`` and each renamed one a string of a deprecation map) instead of importing timm (which imports
torch: seconds). The light check refuses only what it is sure of: a name that appears nowhere in those sources
(whole, as an identifier) and is neither a path, a hub id nor a checkpoint file name; anything else is left to
`resolve_spec`, which imports timm and decides (a test keeps every name timm knows known here).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path

from vitscope.errors import UnknownModelError, close_matches
from vitscope.models.registry import REGISTRY

#: names `resolve_spec` reads as checkpoint files (a missing one is its own sentence there)
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".tar", ".safetensors", ".bin")
_WORD = re.compile(r"[A-Za-z0-9_.-]+")
_IDENT = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def unknown_model(name: str, timm_names: Iterable[str]) -> UnknownModelError:
    """The sentence for a model name nothing knows: the closest registry entries and timm ViT names
    (``timm_names``: timm's models, in `timm.list_models` order), and what else a name may be."""
    vit_names = [n for n in timm_names if "vit" in n or "beit" in n]
    hint = close_matches(name, list(REGISTRY) + vit_names, n=5)
    return UnknownModelError(
        f"unknown model {name!r}" + (f"; did you mean {', '.join(hint)}?" if hint else ".")
        + " `vitscope models` lists the registry; any timm ViT name, a local checkpoint or a transformers "
          "checkpoint (directory or hub id) works too.")


@functools.cache
def _timm_sources() -> str | None:
    """The text of the installed timm's model sources, found without importing timm; None without them."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("timm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "models"
    try:
        text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in sorted(root.rglob("*.py")))
    except OSError:
        return None
    return text if "@register_model" in text else None  # a layout this reading does not know: decide nothing


def _natural_key(name: str) -> list[int | str]:
    """timm's order of `list_models` (its ``_natural_key``)."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name.lower())]


def timm_models() -> list[str] | None:
    """The model names of the installed timm as `timm.list_models` gives them (its ``@register_model``
    functions, in its order), read off its sources; None where they cannot be read."""
    text = _timm_sources()
    if text is None:
        return None
    return sorted(set(re.findall(r"@register_model(?:\([^)]*\))?\s*\n\s*def (\w+)\(", text)), key=_natural_key)


def _in_timm_sources(arch: str, text: str) -> bool:
    """``arch`` occurs in ``text`` as a whole identifier (a function, a deprecated name in quotes, a tag's arch)."""
    start = text.find(arch)
    while start >= 0:
        end = start + len(arch)
        if (start == 0 or text[start - 1] not in _IDENT) and (end == len(text) or text[end] not in _IDENT):
            return True
        start = text.find(arch, start + 1)
    return False


def check_name(name: str) -> None:
    """Refuse, without torch or timm, a model name `resolve_spec` would refuse as unknown (`unknown_model`), where
    that is certain: not a registry entry, not a path that exists, not a hub id or checkpoint file name, and
    nowhere in timm's sources. Any other name passes here (`resolve_spec` decides it when the model loads)."""
    name = str(name)
    if not name or name in REGISTRY or not _WORD.fullmatch(name) or name.endswith(CHECKPOINT_SUFFIXES):
        return
    if Path(name).exists():
        return
    text = _timm_sources()
    if text is None or _in_timm_sources(name.partition(".")[0], text):
        return
    raise unknown_model(name, timm_models() or [])


#: the file that makes a directory a transformers model (`vitscope.models.hf`)
HF_CONFIG = "config.json"


def is_model_dir(path: str | Path) -> bool:
    """A directory holding a transformers ``config.json``."""
    p = Path(str(path))
    return p.is_dir() and (p / HF_CONFIG).is_file()


def file_given(name_or_path: str | Path, weights: str | Path | None) -> str | None:
    """The local weights a model entry names: ``weights`` (a file or a transformers directory), else the name
    when it is a checkpoint file (a transformers directory as the name also gives its architecture, which a
    random init can use), or None."""
    if weights and "://" not in str(weights) and (Path(str(weights)).is_file() or is_model_dir(weights)):
        return str(weights)
    return str(name_or_path) if name_or_path and Path(str(name_or_path)).is_file() else None


def no_decoder(name: str, why: str) -> str:
    """The sentence for ``decoder: true`` on a model without an MAE decoder (`vitscope.models.mae_decoder`): the
    study's config check and the loader say the same."""
    return (f"model {name!r}: decoder: true needs an MAE checkpoint that keeps its pixel decoder (decoder_embed, "
            f"decoder_blocks.*, decoder_pred: MAE's 'visualize' files), and {why}")


def random_init_takes_no_file(file: str) -> str:
    """The sentence for ``pretrained: false`` beside a file: a file is weights, a random init takes none (the
    model would be the file's trained network recorded as untrained)."""
    return (f"{file!r} is a weights file, and pretrained: false asks for a random init, which takes no file; "
            "drop pretrained: false to load the file, or name the architecture (a timm or registry name) with "
            "pretrained: false for a random init")


#: the shipped `vitscope taps` listing of every registry entry (`vitscope.taps_listing` writes and prints it)
TAPS_SNAPSHOT = Path(__file__).resolve().parents[1] / "taps_listing.json"


@functools.cache
def taps_snapshot() -> dict[str, str]:
    """Registry name -> the text `vitscope taps NAME` prints, as shipped (no torch; read once per process)."""
    import json

    return json.loads(TAPS_SNAPSHOT.read_text(encoding="utf-8"))


def listed_without_cls(name: str) -> bool:
    """Whether the shipped taps listing of registry entry ``name`` says it has no CLS token (its last line, the token
    views; False for a name it does not list)."""
    listing = taps_snapshot().get(name, "").strip()
    return bool(listing) and "no CLS token" in listing.splitlines()[-1]



def listed_family(name: str) -> str | None:
    """The model family (vit, beit, eva) the shipped taps listing gives registry entry ``name`` (its first line,
    ``ViTModel('name', family, ...)``), or None for a name it does not list."""
    listing = taps_snapshot().get(name, "").strip()
    m = re.match(r"ViTModel\('[^']*', (\w+),", listing)
    return m.group(1) if m else None


def fixed_size_reason(family: str | None, dynamic_img_size: bool | None = None, decoder: bool = False) -> str | None:
    """Why a model of ``family`` takes its own input size only (the words `vitscope.models.adapter.ViTModel`'s
    ``any_size`` explains), or None where it takes other sizes or that is not known: BEiT's relative position
    bias, an Eva built without ``dynamic_img_size`` (False; None: not known), an MAE decoder's position
    embedding (``decoder``)."""
    if decoder:
        return "its MAE decoder's position embedding is built for one token grid"
    if family == "beit":
        return "its relative position bias tables are built for one token window"
    if family == "eva" and dynamic_img_size is False:
        return "its rotary position embedding is built for one token grid (it was built without dynamic_img_size)"
    return None


def known_fixed_size(name: str, kwargs: dict | None = None, decoder: bool = False) -> str | None:
    """`fixed_size_reason` for a study's model entry, known without torch: a registry entry's family from the
    shipped taps listing (its ``dynamic_img_size`` from ``kwargs`` or the entry's), a timm BEiT name
    (``beit_*``), ``decoder: true``; None where only the loaded model tells."""
    kw = dict(kwargs or {})
    name = str(name)
    if name in REGISTRY:
        family = listed_family(name)
        dynamic = kw.get("dynamic_img_size", REGISTRY[name].model_kwargs.get("dynamic_img_size"))
    else:
        family = "beit" if name.partition(".")[0].startswith("beit") else None
        dynamic = kw.get("dynamic_img_size")
    return fixed_size_reason(family, None if dynamic is None else bool(dynamic), bool(decoder))


def whole_frames_refused(model: str, dataset: str, why: str) -> str:
    """The one sentence for a model that cannot take a dataset's whole frames (images at sizes other than its
    input): the study's config check (before any model loads) and the load of a model (before any pass) say it
    alike, naming the model, the dataset and the fix."""
    return (f"model {model!r} cannot take the whole frames of dataset {dataset!r} (images of other sizes than its "
            f"input): {why}; give the dataset the option tiling: true (its tiles are the model's input size) or "
            "crop: center")
