"""Ablated model variants (`ablate:` on a study's model entry, vitscope/models/ablation.py): the same weights with
write-hooks on the ablated heads, run by every analysis like any model, cached and resumable."""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from vitscope.capture.engine import Capture
from vitscope.data.catalog import build_dataset
from vitscope.errors import ConfigError
from vitscope.models import load_model
from vitscope.models.ablation import parse_spec, resolve
from vitscope.study import load_config, run_study
from vitscope.study.config import DatasetConfig

KW = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)
TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
TAPS = ["block0.out", "block1.heads", "block1.out", "logits"]


def tiny(family="vit"):
    if family == "beit":
        return load_model("beit_base_patch16_224", pretrained=False, **KW, init_values=0.1)
    return load_model("vit_small_patch16_224", pretrained=False, **KW)


def first_images(vm, n_total=8):
    ds = build_dataset(DatasetConfig(name="synthetic-shapes", n_images=n_total))
    return lambda n: ds.batches(4, vm.preprocessing, indices=list(range(min(n, len(ds)))))


def images(vm):
    return torch.cat([b.images for b in first_images(vm)(8)])


def features(vm, x, taps=TAPS):
    with Capture(vm, taps) as cap:
        return {k: v.clone() for k, v in cap(x).items()}


class _Proj(torch.nn.Module):
    """A projection whose input slices [start, stop) are replaced by ``fill`` (T, width) before the product."""

    def __init__(self, proj, cols, fill):
        super().__init__()
        self.proj, self.cols, self.fill = proj, cols, fill

    def forward(self, x):
        x = x.clone()
        for a, b in self.cols:
            x[..., a:b] = self.fill[:, a:b].to(x.dtype)
        return self.proj(x)


@pytest.mark.parametrize("family", ["vit", "beit"])
def test_zero_ablation_equals_a_model_with_those_projection_columns_zeroed(family):
    vm = tiny(family)
    x = images(vm)
    clean = features(vm, x)
    edited = copy.deepcopy(vm)
    with torch.no_grad():  # heads 0 and 2 of block 1 (16 dims each): their columns of the projection zeroed
        edited.model.blocks[1].attn.proj.weight[:, 0:16] = 0
        edited.model.blocks[1].attn.proj.weight[:, 32:48] = 0
    want = features(edited, x, ["block1.out", "logits"])
    ab = resolve(vm, parse_spec({"heads": [[1, 0], [1, 2]]}, "t"), None, "t").install(vm)
    got = features(vm, x)
    torch.testing.assert_close(got["block1.out"], want["block1.out"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-5)
    assert not torch.allclose(got["logits"], clean["logits"])  # the ablation matters
    assert torch.equal(got["block0.out"], clean["block0.out"])  # the blocks before it are untouched
    assert (got["block1.heads"][..., 0:16] == 0).all() and torch.equal(got["block1.heads"][..., 16:32],
                                                                        clean["block1.heads"][..., 16:32])
    ab.remove()
    assert all(torch.equal(a, b) for a, b in zip(features(vm, x).values(), clean.values(), strict=True))


def test_mean_ablation_equals_a_hand_edited_model_with_the_independently_computed_mean():
    vm = tiny()
    x = images(vm)
    with torch.no_grad():  # the mean of block 1's heads per token position over the 6 first images, by hand
        heads = vm.model.blocks[1].attn.proj
        seen = []
        h = heads.register_forward_pre_hook(lambda m, a: seen.append(a[0].double()))
        vm.model(x[:6])
        h.remove()
        mean = seen[0].mean(0)  # (T, D)
    edited = copy.deepcopy(vm)
    edited.model.blocks[1].attn.proj = _Proj(edited.model.blocks[1].attn.proj, [(16, 32)], mean)
    want = features(edited, x, ["logits"])["logits"]
    ab = resolve(vm, parse_spec({"layers": [1], "heads": [1], "mode": "mean", "images": 6}, "t"),
                 first_images(vm), "t")
    assert ab.heads == {1: [1]} and ab.meta["statistics_images"] == 6
    torch.testing.assert_close(ab.means[1], mean, rtol=0, atol=1e-6)  # fp32 forwards in other batches
    ab.install(vm)
    torch.testing.assert_close(features(vm, x, ["logits"])["logits"], want, rtol=0, atol=1e-5)
    ab.remove()


def test_an_ablation_that_resolves_to_no_head_is_the_clean_model_bit_for_bit(monkeypatch):
    import vitscope.metrics.attention as A

    vm = tiny()
    x = images(vm)
    clean = features(vm, x)
    real = A.head_types
    monkeypatch.setattr(A, "head_types", lambda aaam, **k: [{**t, "type": "global"} for t in real(aaam, **k)])
    ab = resolve(vm, parse_spec({"heads": "local", "mode": "mean", "images": 8}, "t"), first_images(vm), "t")
    assert ab.heads == {} and ab.meta["heads"] == []
    ab.install(vm)
    got = features(vm, x)
    assert all(torch.equal(got[k], clean[k]) for k in TAPS)


def test_a_head_type_resolves_to_exactly_the_heads_of_that_type(monkeypatch):
    import vitscope.metrics.attention as A

    vm = tiny()
    forced = ["strict_local", "global", "axial"]  # per head, in every block
    calls = []

    def fake(aaam, distance=None, thresholds=None):
        calls.append(aaam.shape)
        return [{"head": h, "type": forced[h], "direction": None, "offset": 0.0, "statistic": "x", "value": 0.0}
                for h in range(aaam.shape[0])]

    monkeypatch.setattr(A, "head_types", fake)
    first = first_images(vm)
    assert resolve(vm, parse_spec({"heads": "local"}, "t"), first, "t").heads == {0: [0, 2], 1: [0, 2]}
    assert resolve(vm, parse_spec({"heads": "global"}, "t"), first, "t").heads == {0: [1], 1: [1]}
    assert resolve(vm, parse_spec({"heads": "axial", "layers": [1]}, "t"), first, "t").heads == {1: [2]}
    assert resolve(vm, parse_spec({"heads": "mixed"}, "t"), first, "t").heads == {}
    fed = [s for s in calls if tuple(s) != (1, 1, 1)]  # (1, 1, 1): the analysis's check of its thresholds
    assert len(fed) == 7 and all(tuple(s) == (3, 7, 7) for s in fed)  # per block typed: 2 + 2 + 1 + 2


def test_a_head_forced_to_attend_uniformly_is_resolved_as_global_by_the_aligned_maps_rule():
    from vitscope.analyses import get_analysis

    vm = tiny()
    with torch.no_grad():  # head 1 of block 0: q and k zero, so its attention is uniform (a global head)
        qkv = vm.model.blocks[0].attn.qkv
        for rows in (slice(16, 32), slice(48 + 16, 48 + 32)):
            qkv.weight[rows] = 0
            qkv.bias[rows] = 0
    ab = resolve(vm, parse_spec({"heads": "global", "images": 8}, "t"), first_images(vm), "t")
    assert 1 in ab.heads.get(0, [])
    aam = get_analysis("aligned_attention_maps")(vm)  # the analysis itself, on the same images
    with Capture(vm, aam.required_taps()) as cap:
        for b in first_images(vm)(8):
            aam.update(cap(b.images), b)
    df = aam.finalize()
    types = df[df.metric == "head_type"]
    want = {(int(r.layer), int(r.head)) for r in types.itertuples() if r.type == "global"}
    assert {(i, h) for i, hs in ab.heads.items() for h in hs} == want
    assert ab.meta["head_types"]["0.1"] == "global"


STUDY = f"""
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, pretrained: false, kwargs: {TINY}, ablate: {{heads: all, mode: zero}}}}
  - {{name: vit_small_patch16_224, label: tiny-mean, pretrained: false, kwargs: {TINY},
     ablate: {{heads: [[0, 1], [1, 0]], mode: mean, images: 8}}}}
dataset: {{name: synthetic-shapes, n_images: 24}}
analyses:
  semantics: {{layers: [1], views: [cls, gap], ks: [5], kmeans: false, probe: false}}
batch_size: 4
progress: false
"""
ABLATED = "vit_small_patch16_224 \u2212 all heads of every block (zero)"


def write(tmp_path, text):
    p = tmp_path / "study.yaml"
    p.write_text(text)
    return p


def table(out):
    return pd.read_parquet(Path(out) / "results" / "semantics.parquet")


def test_a_study_runs_the_variant_beside_the_clean_model_caches_it_and_keeps_the_weights(tmp_path, monkeypatch):
    import vitscope.study.pool as pool

    loaded = {}
    real_load = pool.load_model

    def load(*a, **k):
        vm = real_load(*a, **k)
        loaded[len(loaded)] = (vm, copy.deepcopy(vm.model.state_dict()))
        return vm

    monkeypatch.setattr(pool, "load_model", load)
    cfg = write(tmp_path, STUDY)
    over = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    out = run_study(load_config(cfg, over))
    df = table(out)
    assert set(df.model) == {"tiny", ABLATED, "tiny-mean"}
    knn = df[df.metric == "knn5_top1"].set_index(["model", "token_view"]).value
    # every head zeroed: the CLS token never sees a patch, so its k-NN falls to chance
    assert knn[(ABLATED, "cls")] != knn[("tiny", "cls")]
    manifest = json.loads((out / "manifest.json").read_text())
    ab = manifest["models"][ABLATED]["ablation"]
    assert ab["heads"] == [[i, h] for i in range(2) for h in range(3)] and ab["spec"]["mode"] == "zero"
    assert manifest["models"]["tiny-mean"]["ablation"]["heads"] == [[0, 1], [1, 0]]
    assert manifest["models"]["tiny-mean"]["ablation"]["statistics_images"] == 8
    assert len({m["model_key"] for m in manifest["models"].values()}) == 3
    for vm, before in loaded.values():  # nothing written to the weights, every hook off
        after = vm.model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        assert all(not m._forward_pre_hooks for m in vm.model.modules())
    assert "tiny-mean" in (out / "report.html").read_text()
    # a rerun reads every model back from the cache: no model is loaded, no forward runs
    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    calls = []
    again = run_study(load_config(cfg, over), on_batch=lambda m, b: calls.append(m))
    assert calls == [] and json.loads((again / "manifest.json").read_text())["analyses_read_from_cache"] == [3, 3]
    assert json.loads((again / "manifest.json").read_text())["models"][ABLATED]["ablation"]["heads"] == ab["heads"]
    pd.testing.assert_frame_equal(table(again), df)
    # another head set is another model: only that variant runs again
    monkeypatch.setattr(pool, "load_model", real_load)
    other = STUDY.replace("[[0, 1], [1, 0]]", "[[0, 1]]")
    over[0] = f"output_dir={tmp_path / 'run2'}"
    run_study(load_config(write(tmp_path, other), over), on_batch=lambda m, b: calls.append(m))
    assert set(calls) == {"tiny-mean"}


def test_a_killed_ablation_pass_resumes_to_identical_tables(tmp_path):
    cfg = write(tmp_path, STUDY)
    ref = run_study(load_config(cfg, [f"output_dir={tmp_path / 'ref'}", f"cache_dir={tmp_path / 'c-ref'}"]))

    class Killed(Exception):
        pass

    fed = []

    def kill(model, b):
        fed.append((model, b))
        if model == "tiny-mean" and b == 2:
            raise Killed

    over = [f"output_dir={tmp_path / 'run'}", "save_every=1", f"cache_dir={tmp_path / 'c-run'}"]
    with pytest.raises(Killed):
        run_study(load_config(cfg, over), on_batch=kill)
    fed.clear()
    out = run_study(load_config(cfg, over), on_batch=lambda m, b: fed.append((m, b)))
    assert fed == [("tiny-mean", b) for b in (3, 4, 5)]  # the rest of the variant's pass only
    pd.testing.assert_frame_equal(table(out), table(ref))


@pytest.mark.parametrize("ablate, message", [
    ("{heads: all, mdoe: mean}", r"models\[1\].ablate: unknown key 'mdoe'; did you mean 'mode'\?"),
    ("{heads: [[1, 5]]}", r"models\[1\].ablate: head 5 is out of range: the model has 3 heads per block \(0..2\)"),
    ("{heads: all, layers: [2]}", r"block 2 is out of range: the model has 2 blocks"),
    ("{heads: locl}", r"models\[1\].ablate.heads: 'locl' is neither `all` nor a head type; did you mean local"),
    ("{heads: all, mode: half}", r"mode 'half' does not exist; choose zero or mean"),
    ("{heads: [0, 1]}", r"a list of heads needs `layers`"),
    ("{heads: [[0, 1]], layers: [0]}", r"either \[layer, head\] pairs in `heads` or `layers`"),
    ("{heads: local, dataset: shapes}", r"no dataset named 'shapes' in the study; did you mean synthetic-shapes\?"),
    ("{heads: local, dataset: xyz}", r"no dataset named 'xyz' in the study; its datasets: synthetic-shapes"),
])
def test_a_bad_ablation_spec_is_one_sentence_before_any_model_loads(tmp_path, monkeypatch, ablate, message):
    import vitscope.study.pool as pool

    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    text = STUDY.replace("{heads: all, mode: zero}", ablate)
    with pytest.raises(ConfigError, match=message) as e:
        run_study(load_config(write(tmp_path, text), [f"output_dir={tmp_path / 'run'}"]))
    assert "\n" not in str(e.value)


def test_a_head_out_of_range_of_a_model_whose_size_the_config_does_not_say_stops_at_load(tmp_path):
    text = STUDY.replace(f"kwargs: {TINY}, ablate: {{heads: all, mode: zero}}",
                         "kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2}, ablate: {heads: [[0, 7]]}")
    with pytest.raises(ConfigError, match=r"head 7 is out of range: the model has 6 heads per block"):
        run_study(load_config(write(tmp_path, text), [f"output_dir={tmp_path / 'run'}"]))


def test_the_dry_run_counts_the_statistics_pass_of_a_variant(tmp_path, monkeypatch):
    from vitscope.study import cost

    over = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    est = cost.dry_run(load_config(write(tmp_path, STUDY), over))
    forwards = []
    real_call = Capture.__call__
    monkeypatch.setattr(Capture, "__call__", lambda self, x: forwards.append(len(x)) or real_call(self, x))
    run_study(load_config(write(tmp_path, STUDY), over))
    assert est.forwards == len(forwards) == 3 * 6 + 2  # 24 images in batches of 4 per model; 8 statistics images


VIDEOS = f"""
models:
  - {{name: vit_small_patch16_224, label: tiny, pretrained: false, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, label: tiny-abl, pretrained: false, kwargs: {TINY},
     ablate: {{heads: global, mode: mean, images: 8}}}}
dataset: {{name: synthetic-videos, n_images: 16, options: {{n_frames: 8}}}}
analyses:
  propagation: {{}}
batch_size: 4
progress: false
"""


def test_propagation_is_re_measured_on_a_variant_whose_global_heads_are_mean_ablated(tmp_path):
    out = run_study(load_config(write(tmp_path, VIDEOS), [f"output_dir={tmp_path / 'run'}",
                                                         f"cache_dir={tmp_path / 'cache'}"]))
    df = pd.read_parquet(out / "results" / "propagation.parquet")
    jf = df[df.metric == "JF"].set_index(["model", "layer"]).value
    ablated = json.loads((out / "manifest.json").read_text())["models"]["tiny-abl"]["ablation"]["heads"]
    assert ablated and min(i for i, _ in ablated) == 0  # the random tiny ViT's heads are global, block 0's too
    assert jf[("tiny-abl", 0)] == jf[("tiny", 0)]  # the embedding, before any ablated head
    assert jf[("tiny-abl", 2)] != jf[("tiny", 2)]  # the last block's features propagate other masks


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_a_variant_sharded_by_torchrun_equals_one_process(tmp_path):
    cfg = write(tmp_path, STUDY.replace("semantics: {layers: [1], views: [cls, gap], ks: [5], kmeans: false, "
                                        "probe: false}", "cka: {batch_size: 4, views: [gap]}"))
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "vitscope", "--quiet", "run", str(cfg),
                    f"output_dir={sharded}", f"cache_dir={tmp_path / 'c2'}"], check=True, timeout=240)
    subprocess.run([sys.executable, "-m", "vitscope", "--quiet", "run", str(cfg), f"output_dir={single}",
                    f"cache_dir={tmp_path / 'c1'}"], check=True, timeout=240)
    a = pd.read_parquet(sharded / "results" / "cka.parquet")
    b = pd.read_parquet(single / "results" / "cka.parquet")
    assert len(a) == len(b) > 0 and set(a.model) == {"tiny", ABLATED, "tiny-mean"}
    # abs: cka_divergence (1 - CKA) rounds to ~1e-9 in the clean model too
    assert a.value.to_numpy() == pytest.approx(b.value.to_numpy(), rel=1e-6, abs=1e-8)
    for run_dir in (sharded, single):
        models = json.loads((run_dir / "manifest.json").read_text())["models"]
        assert models["tiny-mean"]["ablation"]["heads"] == [[0, 1], [1, 0]]
