"""What `vitscope taps NAME` prints: the model, each tap point with its shape for one image, the token views.

For a registry entry (and no ``--weights``) the text is fixed by the entry and the code, so the command prints
the shipped snapshot (`taps_listing.json`) and imports neither torch nor timm (seconds); any other model (a timm
name, a file, a transformers checkpoint, a registry entry with other weights) is built and run on one blank
image. A test keeps the snapshot equal to what building each entry prints
(``python -m vitscope.taps_listing > src/vitscope/taps_listing.json`` regenerates it)."""

from __future__ import annotations

from pathlib import Path

from vitscope.models.names import taps_snapshot as snapshot  # `vitscope taps` and the tests read it from here


def live_text(model: str, weights: str | None = None) -> str:
    """Build ``model`` (random init unless ``weights``), run one blank image through it and list every tap."""
    import torch

    from vitscope.capture import extract
    from vitscope.models import load_model

    # the architecture alone gives the shapes (a random init), except a checkpoint file, which is its weights
    vm = load_model(model, weights=weights, pretrained=weights is not None or Path(model).is_file())
    h, w = vm.img_size
    feats = extract(vm, torch.zeros(1, 3, h, w), vm.taps)
    lines = [repr(vm), *(f"  {tap:<22} {tuple(feats[tap].shape)}" for tap in vm.taps),
             _views_line(vm.num_prefix_tokens, vm.has_cls_token)]
    return "\n".join(lines) + "\n"


def _views_line(num_prefix_tokens: int, has_cls_token: bool) -> str:
    """The token views a model gives: 'cls' only for a model with a CLS token (token 0 of a model with registers
    and no CLS token is a register, not a CLS token)."""
    if has_cls_token and num_prefix_tokens > 0:
        return f"token views: cls, spatial, gap, gap_spatial (prefix tokens: {num_prefix_tokens})"
    return f"token views: spatial, gap, gap_spatial (prefix tokens: {num_prefix_tokens}, no CLS token)"


def text(model: str, weights: str | None = None) -> str:
    """What `vitscope taps` prints: the snapshot's text for a registry entry without other weights, else live."""
    if weights is None:
        shipped = snapshot().get(model)
        if shipped is not None:
            return shipped
    return live_text(model, weights)


def generate(names: list[str] | None = None) -> dict[str, str]:
    """The snapshot: `live_text` of every registry entry (or of ``names``)."""
    from vitscope.models.registry import REGISTRY

    return {name: live_text(name) for name in (names or REGISTRY)}


if __name__ == "__main__":
    import json
    import sys

    sys.stdout.write(json.dumps(generate(), indent=1) + "\n")
