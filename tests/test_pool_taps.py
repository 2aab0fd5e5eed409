"""The readout taps (`pool`, `pool_attn`) and what a model without a CLS token is rolled out from.

Every expected value is recomputed here from the timm module's own weights in float64 (the attention pool's
softmax, its output from that attention, the mean of the patch tokens), or from whole T x T rollout products, never
from vitscope's code."""

import numpy as np
import pytest
import torch

import vitscope as vs
import vitscope.analyses  # noqa: F401 - every analysis registered
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data import SyntheticShapes
from vitscope.metrics import mechanistic as M

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)

# name: (timm name, extra kwargs, readout in words, pooling the test recomputes)
MODELS = {
    "siglip": ("vit_base_patch16_siglip_224", {}, "attention pool", "map"),
    "siglip-cls-pool": ("vit_base_patch16_siglip_224", {"class_token": True, "reg_tokens": 2}, "attention pool",
                        "map"),  # a pool that does not see the prefix tokens (pool_include_prefix False)
    "pe": ("vit_pe_core_tiny_patch16_384", {}, "attention pool", "map"),  # an Eva whose pool sees every token
    "vit": ("vit_small_patch16_224", {}, "CLS token", "token"),
    "ijepa": ("vit_huge_patch14_gap_224", {}, "mean of patch tokens", "avg"),
    "vit-reg-gap": ("vit_small_patch16_224", {"class_token": False, "reg_tokens": 4, "global_pool": "avg"},
                    "mean of patch tokens", "avg"),
    "aimv2": ("aimv2_large_patch14_224", {}, "mean of patch tokens", "avg"),
    "beit": ("beit_base_patch16_224", {}, "mean of patch tokens", "avg"),
    "dinov3": ("vit_small_patch16_dinov3", {}, "mean of patch tokens", "avg"),
}


def build(kind: str):
    name, extra, _, _ = MODELS[kind]
    torch.manual_seed(0)
    vm = vs.load_model(name, pretrained=False, **TINY, **extra)
    for p in vm.model.parameters():  # random, not init-shaped, weights: a wrong pairing cannot agree by accident
        p.data.normal_(0, 0.3)
    return vm


def images(vm, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, *vm.img_size, generator=g)


def pool_reference(pool, x: torch.Tensor, skipped: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention (B, H, Q, T) with 0 for the ``skipped`` prefix tokens, pooled output (B, D)) of timm's
    AttentionPoolLatent on ``x``, in float64, from its weights alone."""
    d = {k: v.detach().double() for k, v in pool.state_dict().items()}
    x = x.double()[:, skipped:]
    B, N, D = x.shape
    H = pool.num_heads
    hd = D // H
    q = d["latent"].expand(B, -1, -1) @ d["q.weight"].T + d["q.bias"]  # (B, Q, D)
    kv = x @ d["kv.weight"].T + d["kv.bias"]
    k, v = kv[..., :D], kv[..., D:]
    heads = lambda t: t.reshape(B, t.shape[1], H, hd).permute(0, 2, 1, 3)  # noqa: E731
    q, k, v = heads(q), heads(k), heads(v)
    logits = np.einsum("bhqd,bhtd->bhqt", q.numpy(), k.numpy()) / np.sqrt(hd)
    attn = torch.from_numpy(np.exp(logits - logits.max(-1, keepdims=True)))
    attn = attn / attn.sum(-1, keepdim=True)
    out = (attn @ v).permute(0, 2, 1, 3).reshape(B, -1, D) @ d["proj.weight"].T + d["proj.bias"]
    normed = torch.nn.functional.layer_norm(out, (D,), d["norm.weight"], d["norm.bias"], eps=pool.norm.eps)
    hidden = torch.nn.functional.gelu(normed @ d["mlp.fc1.weight"].T + d["mlp.fc1.bias"])
    out = out + hidden @ d["mlp.fc2.weight"].T + d["mlp.fc2.bias"]
    assert pool.pool == "token"
    return torch.nn.functional.pad(attn, (skipped, 0)), out[:, 0]


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_pool_tap_is_what_the_head_reads(kind):
    vm = build(kind)
    _, _, readout, pooling = MODELS[kind]
    assert vm.readout == readout
    x = images(vm)
    taps = ["final_norm", "pool"] + (["pool_attn"] if pooling == "map" else [])
    assert set(taps) <= set(vm.taps)
    out = vs.extract(vm, x, taps)
    final, pool = out["final_norm"].double(), out["pool"].double()
    p = vm.num_prefix_tokens
    if pooling == "token":
        expected = final[:, 0]
    elif pooling == "avg":
        expected = final[:, p:].mean(1)
    else:
        skipped = 0 if getattr(vm.model, "pool_include_prefix", True) else p
        attn, expected = pool_reference(vm.model.attn_pool, final, skipped)
        assert out["pool_attn"].shape == (len(x), vm.model.attn_pool.num_heads, 1, vm.num_tokens)
        torch.testing.assert_close(out["pool_attn"].double(), attn, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["pool_attn"].sum(-1), torch.ones(len(x), vm.model.attn_pool.num_heads, 1))
        if skipped:
            assert not out["pool_attn"][..., :skipped].any()
    torch.testing.assert_close(pool, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and it is what the model's own head reads, through fc_norm
        head_in = vm.model.forward_head(vm.model.forward_features(x), pre_logits=True)
    torch.testing.assert_close(vm.model.fc_norm(out["pool"]), head_in, rtol=1e-5, atol=1e-5)


def test_a_model_without_an_attention_pool_has_no_pool_attn_tap_and_a_distilled_deit_no_pool_tap():
    assert "pool_attn" not in build("vit").taps
    vm = vs.load_model("deit_base_distilled_patch16_224", pretrained=False, **TINY)
    assert "pool" not in vm.taps and vm.readout.startswith("CLS and distillation")
    with pytest.raises(vs.errors.UnknownTapError):
        vs.extract(vm, images(vm), ["pool"])


def full_rollout_rows(attns: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """``w^T R_l`` per block with R_l = F_l ... F_0 formed as whole T x T products (float64, heads averaged,
    0.5 A + 0.5 I, rows renormalised): the slow reference."""
    T = attns[0].shape[-1]
    rows, R = [], None
    for a in attns:
        f = 0.5 * a.double().mean(1) + 0.5 * torch.eye(T, dtype=torch.float64)
        f = f / f.sum(-1, keepdim=True)
        R = f if R is None else f @ R
        rows.append(torch.einsum("bt,bts->bs", w.double(), R))
    return torch.stack(rows, 1)


def test_rollout_from_query_weights_equals_the_whole_product():
    g = torch.Generator().manual_seed(3)
    attns = [torch.rand(2, 3, 7, 7, generator=g).softmax(-1) for _ in range(4)]
    w = torch.rand(2, 7, generator=g)
    w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(M.attention_rollout(attns, query=w).double(), full_rollout_rows(attns, w))
    e0 = torch.zeros(2, 7)
    e0[:, 0] = 1
    torch.testing.assert_close(M.attention_rollout(attns, query=e0).double(),
                               M.attention_rollout(attns).double())


@pytest.mark.parametrize("kind, query", [("siglip", "attention pool"), ("siglip-cls-pool", "cls"),
                                         ("ijepa", "mean of patch tokens"), ("vit-reg-gap", "mean of patch tokens"),
                                         ("vit", "cls")])
def test_a_model_without_a_cls_token_is_rolled_out_from_its_readout(kind, query):
    vm = build(kind)
    a = get_analysis("attention_rollout")(vm)
    batches = list(SyntheticShapes(n=4, seed=1).batches(4, vm.preprocessing))
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    assert set(df["query"]) == {query}
    own = "iou_cls_attention" if query == "cls" else "iou_query_attention"
    assert own in set(df.metric) and {"iou_cls_attention", "iou_query_attention"} - {own} not in set(df.metric)
    # the mean map of the last block, recomputed from whole products with the query this model reads
    p, T = vm.num_prefix_tokens, vm.num_tokens
    taps = [f"block{i}.attn" for i in range(vm.depth)] + (["pool_attn"] if query == "attention pool" else [])
    feats = vs.extract(vm, batches[0].images, taps)
    B = len(batches[0].images)
    if query == "cls":
        w = torch.zeros(B, T)
        w[:, 0] = 1
    elif query == "attention pool":
        w = feats["pool_attn"].double().mean((1, 2))
    else:
        w = torch.zeros(B, T)
        w[:, p:] = 1 / (T - p)
    rows = full_rollout_rows([feats[f"block{i}.attn"] for i in range(vm.depth)], w)[:, -1, p:]
    expected = (rows / rows.sum(-1, keepdim=True)).mean(0).reshape(vm.grid_size)
    m = df[(df.metric == "rollout_map") & (df.layer == vm.depth - 1)].sort_values(["row", "col"])
    np.testing.assert_allclose(m["value"].to_numpy().reshape(vm.grid_size), expected.numpy(), rtol=1e-5, atol=1e-7)


def test_the_report_says_each_models_readout_and_labels_models_by_it_where_they_differ(tmp_path):
    from matplotlib import pyplot as plt

    from vitscope.report.figures._common import model_label
    from vitscope.report.run import load_run
    from vitscope.study import load_config, run_study

    kw = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
    (tmp_path / "study.yaml").write_text(f"""models:
  - {{name: vit_small_patch16_224, label: vit, pretrained: false, kwargs: {kw}}}
  - {{name: vit_base_patch16_siglip_224, label: siglip, pretrained: false, kwargs: {kw}}}
datasets:
  shapes: {{name: synthetic-shapes, n_images: 8}}
analyses:
  attention_rollout: {{}}
batch_size: 4
progress: false
""")
    cfg = load_config(tmp_path / "study.yaml", [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])
    run_study(cfg)
    html = (tmp_path / "run" / "report.html").read_text()
    models = html[html.index("id='models'"):]
    assert "<td>vit, 1 prefix token (CLS first)</td><td>CLS token</td>" in models
    assert "<td>vit, 0 prefix tokens</td><td>attention pool</td>" in models
    run = load_run(tmp_path / "run")
    with run.figure_context():
        assert model_label("siglip") == "siglip [attention pool] (untrained)"
        assert model_label("vit") == "vit [CLS token] (untrained)"
    (caption, fig), *_ = run.figures("attention_rollout")
    assert "without a CLS token, the row of the model's readout" in caption and "siglip (attention pool)" in caption
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert "siglip [attention pool] (untrained)" in labels
    plt.close("all")
