"""MLP ablation in ablated variants (`ablate: {mlp: ...}`, vitscope/models/ablation.py): each ablated block's MLP
output (before layer scale) replaced by 0 or by the clean model's mean per token position, checked against hooks
written here on the ``mlp`` module itself, in ViT, BEiT and timm's Eva."""

import copy
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from vitscope.capture.engine import Capture
from vitscope.data.catalog import build_dataset
from vitscope.errors import ConfigError
from vitscope.models import load_model
from vitscope.models.ablation import default_label, parse_spec, resolve
from vitscope.study import load_config, run_study
from vitscope.study.config import DatasetConfig, ModelConfig

KW = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)
TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
ARCHS = {"vit": ("vit_small_patch16_224", {}), "beit": ("beit_base_patch16_224", {"init_values": 0.1}),
         "eva02": ("eva02_tiny_patch14_224", {}), "dinov3": ("vit_small_patch16_dinov3", {})}
TAPS = ["block0.out", "block1.fc2", "block1.out", "logits"]


def tiny(family="vit"):
    name, extra = ARCHS[family]
    return load_model(name, pretrained=False, **KW, **extra)


def first_images(vm, n_total=8):
    ds = build_dataset(DatasetConfig(name="synthetic-shapes", n_images=n_total))
    return lambda n: ds.batches(4, vm.preprocessing, indices=list(range(min(n, len(ds)))))


def images(vm):
    return torch.cat([b.images for b in first_images(vm)(8)])


def features(vm, x, taps=TAPS):
    with Capture(vm, taps) as cap:
        return {k: v.clone() for k, v in cap(x).items()}


def replace_mlp_output(vm, fills):
    """The test's own write-hooks: a forward hook on each named block's ``mlp`` module returning ``fill(out)``."""
    return [vm.model.blocks[i].mlp.register_forward_hook(lambda m, a, out, f=f: f(out)) for i, f in fills.items()]


@pytest.mark.parametrize("family", list(ARCHS))
def test_zero_mlp_ablation_equals_a_hook_zeroing_the_mlp_output(family):
    vm = tiny(family)
    x = images(vm)
    clean = features(vm, x)
    handles = replace_mlp_output(vm, {1: torch.zeros_like})
    want = features(vm, x, ["block1.out", "logits"])
    for h in handles:
        h.remove()
    ab = resolve(vm, parse_spec({"mlp": [1]}, "t"), None, "t").install(vm)
    assert ab.mlp == [1] and ab.heads == {} and ab.meta["mlp"] == [1]
    got = features(vm, x)
    torch.testing.assert_close(got["block1.out"], want["block1.out"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-5)
    assert not torch.allclose(got["logits"], clean["logits"])  # the ablation matters
    assert torch.equal(got["block0.out"], clean["block0.out"])  # the block before it is untouched
    assert (got["block1.fc2"] == 0).all()  # the fc2 tap reads the ablated output
    ab.remove()
    assert all(torch.equal(a, b) for a, b in zip(features(vm, x).values(), clean.values(), strict=True))


@pytest.mark.parametrize("family", ["vit", "eva02"])
def test_mean_mlp_ablation_equals_a_hook_writing_the_mean_computed_here(family):
    vm = tiny(family)
    x = images(vm)
    seen = {}
    with torch.no_grad():  # the clean MLP outputs of the 6 first images, read off the mlp modules by hand
        hs = [vm.model.blocks[i].mlp.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(i, out.double().clone())) for i in range(2)]
        vm.model(x[:6])
        for h in hs:
            h.remove()
    means = {i: torch.stack([seen[i][b] for b in range(6)]).sum(0) / 6 for i in range(2)}  # (T, D)
    handles = replace_mlp_output(vm, {i: (lambda out, m=m: m.to(out.dtype).expand(out.shape).clone())
                                      for i, m in means.items()})
    want = features(vm, x, ["logits"])["logits"]
    for h in handles:
        h.remove()
    ab = resolve(vm, parse_spec({"mlp": "all", "mode": "mean", "images": 6}, "t"), first_images(vm), "t")
    assert ab.mlp == [0, 1] and ab.meta["statistics_images"] == 6
    for i in range(2):
        torch.testing.assert_close(ab.mlp_means[i], means[i], rtol=0, atol=1e-6)  # fp32 forwards in other batches
    ab.install(vm)
    got = features(vm, x, ["block1.fc2", "logits"])
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["block1.fc2"][3].double(), means[1], rtol=0, atol=1e-6)
    ab.remove()


def test_heads_and_mlps_ablated_together_equal_both_hand_edits():
    vm = tiny()
    x = images(vm)
    edited = copy.deepcopy(vm)
    with torch.no_grad():  # head 1 of block 0 (dims 16..32): its columns of the projection zeroed
        edited.model.blocks[0].attn.proj.weight[:, 16:32] = 0
    replace_mlp_output(edited, {1: torch.zeros_like})
    want = features(edited, x, ["logits"])["logits"]
    ab = resolve(vm, parse_spec({"heads": [[0, 1]], "mlp": [1]}, "t"), None, "t").install(vm)
    assert ab.heads == {0: [1]} and ab.mlp == [1]
    torch.testing.assert_close(features(vm, x, ["logits"])["logits"], want, rtol=0, atol=1e-5)
    ab.remove()


def test_the_label_names_the_mlp_ablation():
    assert default_label("zoo-mae", parse_spec({"mlp": [3, 2, 2]}, "t")) == "zoo-mae \u2212 MLPs of blocks 2, 3 (zero)"
    assert default_label("zoo-mae", parse_spec({"mlp": "all", "mode": "mean"}, "t")) == \
        "zoo-mae \u2212 MLPs of every block (mean)"
    assert parse_spec({"heads": [[0, 1]], "mlp": [0]}, "t").describe() == "heads 0.1 + MLP of block 0 (zero)"
    assert parse_spec({"heads": "all"}, "t").describe() == "all heads of every block (zero)"  # as before


def test_cache_keys_differ_between_no_heads_mlp_and_both_and_a_heads_spec_keeps_its_canonical_form():
    from vitscope.study.keys import model_key

    def key(ablate):
        return model_key(ModelConfig(name="vit_small_patch16_224", pretrained=False, kwargs=dict(KW),
                                     ablate=ablate))[1]

    keys = [key(None), key({"heads": "all"}), key({"mlp": "all"}), key({"mlp": [0, 1]}), key({"mlp": [1]}),
            key({"heads": "all", "mlp": [1]}), key({"mlp": [0]})]
    assert len(set(keys)) == len(keys)
    assert key({"mlp": [1, 1]}) == key({"mlp": [1]})  # the parsed canonical form, not the raw entry
    assert "mlp" not in parse_spec({"heads": "all"}, "t").as_dict()  # heads-only specs keep their old keys


STUDY = f"""
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, pretrained: false, kwargs: {TINY}, ablate: {{mlp: [0, 1], mode: zero}}}}
  - {{name: vit_small_patch16_224, label: tiny-mlp-mean, pretrained: false, kwargs: {TINY},
     ablate: {{mlp: [1], mode: mean, images: 8}}}}
dataset: {{name: synthetic-shapes, n_images: 16}}
analyses:
  semantics: {{layers: [1], views: [cls], ks: [5], kmeans: false, probe: false}}
batch_size: 4
progress: false
"""
ABLATED = "vit_small_patch16_224 \u2212 MLPs of blocks 0, 1 (zero)"


def write(tmp_path, text):
    p = tmp_path / "study.yaml"
    p.write_text(text)
    return p


def test_a_study_runs_mlp_variants_records_them_and_reads_them_back_from_the_cache(tmp_path, monkeypatch):
    import vitscope.study.pool as pool

    cfg = write(tmp_path, STUDY)
    over = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    with _no_result_warning():
        out = run_study(load_config(cfg, over))
    df = pd.read_parquet(Path(out) / "results" / "semantics.parquet")
    assert set(df.model) == {"tiny", ABLATED, "tiny-mlp-mean"}
    models = json.loads((out / "manifest.json").read_text())["models"]
    assert models[ABLATED]["ablation"]["mlp"] == [0, 1] and models[ABLATED]["ablation"]["heads"] == []
    assert models["tiny-mlp-mean"]["ablation"]["statistics_images"] == 8
    assert len({m["model_key"] for m in models.values()}) == 3
    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    again = run_study(load_config(cfg, over))
    pd.testing.assert_frame_equal(pd.read_parquet(again / "results" / "semantics.parquet"), df)


class _no_result_warning:
    """No "resolves to no head" warning for an MLP-only variant (it ablates something)."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.seen = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self.seen if "resolves to no head" in str(w.message)]


@pytest.mark.parametrize("ablate, message", [
    ("{mpl: [0]}", r"models\[1\].ablate: unknown key 'mpl'; did you mean 'mlp'\?"),
    ("{mlp: [2]}", r"models\[1\].ablate: block 2 is out of range: the model has 2 blocks \(0..1\)"),
    ("{mlp: every}", r"models\[1\].ablate.mlp: 'every' is not `all`; give `all` or a list of block numbers"),
    ("{mlp: [-1]}", r"models\[1\].ablate.mlp must be a non-empty list of block or head numbers"),
    ("{mlp: []}", r"models\[1\].ablate.mlp must be a non-empty list"),
    ("{mlp: [0], layers: [1]}", r"`layers` picks the blocks of `heads`, and no `heads` is given"),
    ("{mode: mean}", r"needs `heads` .* or `mlp` \(all or a list of blocks\)"),
])
def test_a_bad_mlp_spec_is_one_sentence_before_any_model_loads(tmp_path, monkeypatch, ablate, message):
    import vitscope.study.pool as pool

    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    text = STUDY.replace("{mlp: [0, 1], mode: zero}", ablate)
    with pytest.raises(ConfigError, match=message) as e:
        run_study(load_config(write(tmp_path, text), [f"output_dir={tmp_path / 'run'}"]))
    assert "\n" not in str(e.value)
