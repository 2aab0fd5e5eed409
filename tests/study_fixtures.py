"""Test-only analyses and a view, registered by `register()`: analyses that record which images of which dataset and
view they were fed, so the planner's routing can be checked from the tables (also under torchrun, where
tests/run_with_fixtures.py imports this module before the CLI runs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vitscope.analyses.base import ANALYSES, Analysis, PairAnalysis, register_analysis
from vitscope.data.views import VIEW_KINDS, image_generator, register_view

# the models: block of the tiny two-model studies (a ViT and a BEiT, random, 2 blocks at 32 px)
TWO_TINY_MODELS = """\
models:
  - name: vit_small_patch16_224
    label: tiny-vit
    pretrained: false
    kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}
  - name: beit_base_patch16_224
    label: tiny-beit
    pretrained: false
    kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, init_values: 0.1}
"""


#: the kwargs of that ViT as YAML
TINY_STUDY_KW = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"


def tiny_study_yaml(depth: int = 2) -> str:
    """A one-model study (a random tiny ViT of ``depth`` blocks, 8 generated images, CKA on the mean token): the
    smallest config a study accepts, for tests of what happens before and around it."""
    kw = TINY_STUDY_KW.replace("depth: 2", f"depth: {depth}")
    return f"""
models:
  - name: vit_small_patch16_224
    label: tiny
    pretrained: false
    kwargs: {kw}
dataset: {{name: synthetic-shapes, n_images: 8}}
analyses:
  cka: {{batch_size: 4, views: [gap]}}
batch_size: 4
progress: false
"""


def with_models(text: str, name: str, extra: Mapping[str, Any]) -> str:
    """A study ``text`` of tiny ``vit_small_patch16_224`` models (test_cost's studies) with every one made a tiny
    ``name`` built with ``extra`` beside its own kwargs."""
    kw = "".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}, " for k, v in extra.items())
    out = text.replace("name: vit_small_patch16_224", f"name: {name}").replace("kwargs: {img_size",
                                                                             "kwargs: {" + kw + "img_size")
    assert out.count(f"name: {name}") == text.count("name: vit_small_patch16_224") > 0
    return out


def run_study_text(tmp_path: Any, text: str) -> tuple[dict[str, Any], list[str]]:
    """Run the study ``text`` in ``tmp_path``: its tables by analysis and the warnings it gave."""
    import warnings

    import pandas as pd

    from vitscope.study import load_config, run_study

    (tmp_path / "study.yaml").write_text(text)
    cfg = load_config(tmp_path / "study.yaml", [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_study(cfg)
    return ({p.stem: pd.read_parquet(p) for p in (out / "results").glob("*.parquet")},
            [str(w.message) for w in caught])


def shapes_batches(vm: Any, n: int = 5, bs: int = 2, indices: list[int] | None = None) -> list[Any]:
    """``n`` generated shapes (seed 3) in batches of ``bs`` for ``vm`` (or the images of ``indices``, in that order)."""
    from vitscope.data import SyntheticShapes

    return list(SyntheticShapes(n=n, seed=3).batches(bs, vm.preprocessing, indices=indices))


def run_analysis(name: str, vm: Any, batches: list[Any], **params: Any) -> Analysis:
    """Analysis ``name`` with ``params`` streamed over ``batches`` (one pass, no progress bar)."""
    from vitscope.analyses import get_analysis
    from vitscope.capture import stream

    a = get_analysis(name)(vm, **params)
    stream(vm, batches, [a], progress=False)
    return a


def fed_by_hand(name: str, vm: Any, batches: list[Any], **params: Any) -> Analysis:
    """Analysis ``name`` updated batch by batch from `vitscope.Capture` (no stream: the batches in the given order,
    as a shard or a resumed run may see them)."""
    import vitscope as vs
    from vitscope.analyses import get_analysis

    a = get_analysis(name)(vm, **params)
    for b in batches:
        with vs.Capture(vm, a.required_taps()) as cap:
            a.update(cap(b.images), b)
    return a


def one_line_error(capsys, argv: list[str]) -> str:
    """The command fails with exit status 2 and one line on stderr, no traceback; returns that line."""
    from vitscope.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitscope: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def shift(x01: torch.Tensor, index: torch.Tensor, seed: int, *, amount: float = 0.1) -> torch.Tensor:
    """Adds uniform noise in [0, amount) per pixel, drawn per (image, view, seed)."""
    key = f"test_shift:amount={amount}"
    noise = torch.stack([torch.rand(x01.shape[1:], generator=image_generator(seed, key, int(i))) for i in index])
    return x01 + amount * noise.to(x01.dtype)


class SeenIds(Analysis):
    """Records (dataset, view, image id, mean of block 0's output) for every image it is fed."""

    name = "seen_ids"
    description = "test: which images of which pass were fed"

    @classmethod
    def views(cls, params: Mapping[str, Any]) -> list[str]:
        return ["clean", *params.get("views", [])]

    def __init__(self, vm: Any, views: Any = ()):
        super().__init__(vm)
        self.rows: list[tuple[str, str, int, float]] = []

    def required_taps(self) -> list[str]:
        return ["block0.out"]

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        m = feats["block0.out"].double().mean(dim=(1, 2))
        for i, v in zip(batch.index.tolist(), m.tolist(), strict=True):
            self.rows.append((batch.dataset, batch.view, int(i), float(v)))
        self.n_images += len(batch)

    def merge(self, other: Analysis) -> None:
        self.rows += other.rows
        self.n_images += other.n_images

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [list(r) for r in self.rows], "n_images": self.n_images}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rows = [tuple(r) for r in state["rows"]]
        self.n_images = int(state["n_images"])

    def finalize(self) -> Any:
        return self.tidy([{"metric": "seen", "token_view": f"{d}|{v}", "layer": i, "value": x}
                          for d, v, i, x in sorted(self.rows)])


class SeenLabelled(SeenIds):
    name = "seen_labelled"
    needs = frozenset({"labels"})


class SeenMasked(SeenIds):
    name = "seen_masked"
    needs = frozenset({"masks"})


class PairSeen(PairAnalysis):
    """Records, per image, B's output mean minus A's and the norm of a gradient through A (gradients are on);
    keeps one file per image of A in its store, so reuse across B models can be counted."""

    name = "pair_seen"
    description = "test: pair stage"

    def __init__(self, info_a: Any, info_b: Any, scale: float = 1.0):
        super().__init__(info_a, info_b)
        self.rows: list[tuple[int, float, float, bool]] = []

    def update(self, vm_a: Any, vm_b: Any, batch: Any) -> None:
        from safetensors.torch import save_file

        store = self.store("products")
        x = batch.images.clone().requires_grad_(True)
        ya = vm_a.model.forward_features(x).mean(dim=(1, 2))
        ya.sum().backward()
        g = x.grad.flatten(1).norm(dim=1)
        with torch.no_grad():
            yb = vm_b.model.forward_features(batch.images).mean(dim=(1, 2))
        for k, i in enumerate(batch.index.tolist()):
            f = store / f"{i}.safetensors"
            reused = f.is_file()
            if not reused:
                save_file({"y": ya[k:k + 1].detach()}, str(f))
            self.rows.append((int(i), float(yb[k] - ya[k].detach()), float(g[k]), reused))
        self.n_images += len(batch)

    def merge(self, other: Any) -> None:
        self.rows += other.rows

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [list(r) for r in self.rows]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rows = [tuple(r) for r in state["rows"]]

    def finalize(self) -> Any:
        rows = []
        for i, d, g, reused in sorted(self.rows):
            rows += [{"metric": "diff", "layer": i, "value": d}, {"metric": "grad", "layer": i, "value": g},
                     {"metric": "reused", "layer": i, "value": float(reused)}]
        return self.tidy(rows)


TEST_ANALYSES = (SeenIds, SeenLabelled, SeenMasked, PairSeen)


def register() -> None:
    for cls in TEST_ANALYSES:
        if cls.name not in ANALYSES:
            register_analysis(cls)
    if "test_shift" not in VIEW_KINDS:
        register_view("test_shift")(shift)


def unregister() -> None:
    for cls in TEST_ANALYSES:
        ANALYSES.pop(cls.name, None)
    VIEW_KINDS.pop("test_shift", None)
