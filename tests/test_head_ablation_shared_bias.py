"""head_ablation on a BEiT whose blocks share one relative position bias (SimMIM, BEiT pretraining checkpoints):
the rerun from a block's cached input passes each block the shared table, as timm's forward does, so every ablated
output equals a full forward of the model with the same heads silenced by a hook (the recipes park-2023 and
wang-2023 ablate SimMIM's heads)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny
from vitscope.analyses.mechanistic.ablation import HeadAblation

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(m: torch.nn.Module, images: torch.Tensor, layer: int, head: int | None, num_heads: int) -> torch.Tensor:
    """The model's logits with ``head`` (None: all) of block ``layer`` zeroed at its attention projection's input,
    from a full forward (timm's own, shared bias and all)."""
    def silence(module, args):
        h = args[0].clone()
        d = h.shape[-1] // num_heads
        if head is None:
            h[...] = 0
        else:
            h[..., head * d:(head + 1) * d] = 0
        return (h, *args[1:])

    handle = m.blocks[layer].attn.proj.register_forward_pre_hook(silence)
    try:
        with torch.no_grad():
            return m(images)
    finally:
        handle.remove()


@pytest.mark.parametrize("heads", ["each", "all"])
def test_shared_bias_beit_heads_ablated_as_a_full_forward(images, heads):
    vm = tiny("beit_shared", num_classes=7)
    m = vm.model.eval()
    assert m.rel_pos_bias is not None
    layer = 1
    seen = {}
    handle = m.blocks[layer - 1].register_forward_hook(lambda mod, a, out: seen.setdefault("x", out.detach()))
    with torch.no_grad():
        clean = m(images)
    handle.remove()
    a = HeadAblation(vm, layers=[layer], heads=heads)
    out = a._ablated(seen["x"], layer)  # (G, B, C)
    H = vm.num_heads
    sets = list(range(H)) if heads == "each" else [None]
    assert out.shape == (len(sets), len(images), 7)
    for g, head in enumerate(sets):
        ref = _reference(m, images, layer, head, H)
        torch.testing.assert_close(out[g], ref, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(ref, clean)  # the silenced heads changed the output
