"""The controlled zoo's trainers, on a tiny ViT (16 px, 4 px patches, 2 blocks, dim 32) and generated shapes."""

import json
import math
from dataclasses import asdict

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

import vitscope as vs
from vitscope.cli import main
from vitscope.errors import VitscopeError
from vitscope.zoo import ZooArch, build_objective, encode
from vitscope.zoo.arch import CIFAR_MEAN, patchify, unpatchify
from vitscope.zoo.base import block_mask, random_keep
from vitscope.zoo.data import Augment, ViewBatch, ViewSpec, ViewStream, synthetic_set
from vitscope.zoo.knn import knn_accuracy
from vitscope.zoo.train import STATE_FILE, TrainConfig, load_state, make_optimizer, make_plan, train, train_step

TINY = ZooArch(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
SMALL_HEADS = {
    "dino": {"out_dim": 256, "hidden": 64, "bottleneck": 32},
    "mocov3": {"hidden": 64, "out_dim": 32},
    "hybrid": {"hidden": 64, "out_dim": 32},
    "mae": {"decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2},
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shapes():
    return synthetic_set(64, 0, TINY.img_size)


def _stream(obj, data, batch_size=32, seed=0):
    pre = obj.preprocessing
    return ViewStream(data, obj.views, batch_size, seed, Augment(obj.views, obj.img_size, pre.mean, pre.std,
                                                                 obj.patch_size))


def _tiny_cfg(tmp_path, objective, **kw):
    base = dict(objective=objective, out=tmp_path / objective, data="synthetic", arch=asdict(TINY),
                synthetic_n=(96, 48), batch_size=16, knn_train=48, knn_test=24, progress=False,
                objective_kwargs=dict(SMALL_HEADS.get(objective, {})))
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory):
    """A zoo checkpoint of the tiny architecture (random init), for fine-tuning."""
    from vitscope.models import save_checkpoint
    from vitscope.models.registry import ModelSpec, WeightSource
    from vitscope.zoo.arch import TIMM_ARCH, build_encoder, zoo_preprocessing

    torch.manual_seed(0)
    spec = ModelSpec("tiny", TIMM_ARCH, "none", "none", WeightSource("none"), zoo_preprocessing(16), TINY.kwargs(0))
    return save_checkpoint(build_encoder(TINY, 0), tmp_path_factory.mktemp("init") / "init.safetensors", spec,
                           half=True)


# -- the architecture -----------------------------------------------------------------------------------

def test_encode_is_forward_features_without_masks():
    obj = build_objective("supervised", TINY, 10, seed=0)
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(encode(obj.encoder, x), obj.encoder.forward_features(x), rtol=0, atol=1e-6)


def test_patchify_roundtrip_and_layout():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    p = patchify(x, 4)
    assert p.shape == (2, 4, 48)
    # patch 1 is the top-right 4x4 square; pixel (0, 0) channel 0 of it is x[:, 0, 0, 4]
    assert torch.equal(p[:, 1, 0], x[:, 0, 0, 4])
    assert torch.equal(unpatchify(p, 4), x)


# -- data -------------------------------------------------------------------------------------------------

def test_views_are_deterministic_per_step_and_sized(shapes):
    obj = build_objective("dino", TINY, 12, seed=0, **SMALL_HEADS["dino"])
    s1, s2 = _stream(obj, shapes), _stream(obj, shapes)
    a, b, c = s1.batch(3), s2.batch(3), s1.batch(4)
    assert all(torch.equal(x, y) for x, y in zip(a.global_views + a.local_views, b.global_views + b.local_views,
                                                  strict=True))
    assert not torch.equal(a.global_views[0], c.global_views[0])
    assert [v.shape[-1] for v in a.global_views] == [16, 16]
    assert [v.shape[-1] for v in a.local_views] == [8] * obj.n_local
    assert not torch.equal(a.global_views[0], a.global_views[1])  # two different crops of the same images
    # each pass over the data visits every image once
    seen = torch.cat([s1.batch(i).index for i in range(s1.steps_per_pass)])
    assert len(set(seen.tolist())) == len(seen) == s1.steps_per_pass * 32


def test_view_accounting_weighs_pixels():
    assert ViewSpec(n_global=2, n_local=6, local_ratio=0.5).views_per_image() == 2 + 6 * 0.25
    assert ViewSpec(n_global=1).views_per_image() == 1
    cfg = TrainConfig("dino", "unused", budget_views=1000, batch_size=10)
    plan = make_plan(cfg, 3.5, n_train=200)
    assert plan.total_steps == 29  # ceil(1000 / 35)
    assert plan.n_epochs == 5 and plan.epoch_end[29] == 5 and plan.epoch_end[6] == 1  # ceil(200 / 35) = 6
    with pytest.raises(VitscopeError):
        make_plan(TrainConfig("dino", "unused", budget_views=10, epochs=1), 1, 100)


def test_knn_weighted_vote():
    train_f = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    train_y = torch.tensor([0, 0, 1, 1])
    test_f = torch.tensor([[1.0, 0.05], [0.05, 1.0]])
    assert knn_accuracy(train_f, train_y, test_f, torch.tensor([0, 1]), k=4) == 1.0
    assert knn_accuracy(train_f, train_y, test_f, torch.tensor([1, 0]), k=4) == 0.0


# -- each objective learns ----------------------------------------------------------------------------------

LEARNERS = ["supervised", "dino", "mocov3", "mae", "simmim", "hybrid", "finetune-classification",
            "finetune-reconstruction"]


@pytest.mark.parametrize("name", LEARNERS)
def test_loss_decreases_on_a_fixed_batch(name, shapes, tiny_init):
    objective, _, task = name.partition("-")
    kw = {"init": tiny_init, "task": task} if objective == "finetune" else SMALL_HEADS.get(objective, {})
    obj = build_objective(objective, TINY, len(shapes.classes), seed=0, **kw)
    stream = _stream(obj, shapes)
    n = 30
    opt, sched = make_optimizer(obj, TrainConfig(objective, "unused", lr=1e-3, warmup_frac=0.05), n)
    obj.train()
    curve = []
    for s in range(n):
        loss, metrics = train_step(obj, opt, sched, stream.batch(0), s, n, 3.0)  # the same views and masks
        # DINO's cross-entropy also holds the teacher's entropy, which centring raises on purpose at the
        # start; what the student minimises is the KL divergence to the teacher.
        curve.append(metrics["kl"] if objective == "dino" else float(loss))
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert last < 0.9 * first, curve


def test_mae_encoder_never_sees_masked_patches(shapes):
    obj = build_objective("mae", TINY, 12, seed=0, **SMALL_HEADS["mae"]).eval()
    x = _stream(obj, shapes).batch(0).global_views[0][:8]
    n = TINY.num_patches
    _, mask = random_keep(8, n, 0.75, torch.Generator().manual_seed(5))  # what MAE.forward will draw first
    assert int((~mask).sum(1)[0]) == round(n * 0.25)
    noise = torch.randn(8, n, 48) * 3
    x_hidden = unpatchify(torch.where(mask.unsqueeze(-1), noise, patchify(x, 4)), 4)  # masked patches changed
    x_visible = unpatchify(torch.where(~mask.unsqueeze(-1), noise, patchify(x, 4)), 4)  # visible ones changed

    seen = []
    hook = obj.encoder.norm.register_forward_hook(lambda m, i, o: seen.append((i[0].shape[1], o.detach())))

    def run(img):
        batch = ViewBatch([img], [], torch.zeros(8, dtype=torch.long), torch.arange(8),
                          torch.Generator().manual_seed(5), 8.0)
        return obj(batch)[0]

    with torch.no_grad():
        loss_x, loss_hidden, _ = run(x), run(x_hidden), run(x_visible)
    hook.remove()
    assert seen[0][0] == 1 + round(n * 0.25)  # CLS + the visible tokens only
    assert torch.equal(seen[0][1], seen[1][1])  # masked pixels changed: encoder output identical
    assert not torch.allclose(seen[0][1], seen[2][1])  # visible pixels changed: it is not
    assert not torch.isclose(loss_x, loss_hidden)  # the masked pixels are the decoder's targets


def test_simmim_replaces_masked_patches_by_the_mask_token(shapes):
    obj = build_objective("simmim", TINY, 12, seed=0).eval()
    x = torch.randn(4, 3, 16, 16)
    mask = block_mask(4, TINY.grid, 0.6, 2, torch.Generator().manual_seed(1))
    assert int(mask[0].sum()) == 12  # ceil(0.6 * 4) blocks of 2x2 patches on the 4x4 grid
    x2 = unpatchify(torch.where(mask.unsqueeze(-1), torch.randn(4, 16, 48), patchify(x, 4)), 4)
    with torch.no_grad():
        a = encode(obj.encoder, x, mask=mask, mask_token=obj.mim.mask_token)
        b = encode(obj.encoder, x2, mask=mask, mask_token=obj.mim.mask_token)
        c = encode(obj.encoder, x2)
    assert a.shape[1] == 1 + TINY.num_patches  # every token goes through the encoder
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.allclose(b, c)


@pytest.mark.parametrize("name", ["dino", "mocov3", "hybrid"])
def test_ema_teacher_moves_and_gets_no_gradients(name, shapes):
    obj = build_objective(name, TINY, 12, seed=0, **SMALL_HEADS[name])
    teacher = obj.teacher if name == "dino" else obj.moco.momentum_encoder
    t0 = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert all(torch.equal(t0[k], v) for k, v in obj.encoder.state_dict().items())  # starts as the student
    stream = _stream(obj, shapes)
    opt, sched = make_optimizer(obj, TrainConfig(name, "unused", lr=1e-3), 10)
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not teacher_ids & {id(p) for g in opt.param_groups for p in g["params"]}
    for s in range(3):
        train_step(obj, opt, sched, stream.batch(s), s, 10, 3.0)
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    moved = [k for k, v in teacher.state_dict().items() if not torch.equal(v, t0[k])]
    assert "blocks.0.attn.qkv.weight" in moved
    student = obj.encoder.state_dict()
    assert not torch.equal(teacher.state_dict()["blocks.0.attn.qkv.weight"], student["blocks.0.attn.qkv.weight"])
    # the teacher sits between its start and the student: an average, not a copy
    k = "blocks.0.attn.qkv.weight"
    assert (teacher.state_dict()[k] - t0[k]).norm() < (student[k] - t0[k]).norm()
    assert obj.export() is (teacher if name == "dino" else obj.encoder)  # DINO ships its teacher


def test_same_seed_same_init_other_seed_other_init():
    a = build_objective("hybrid", TINY, 12, seed=3, **SMALL_HEADS["hybrid"]).state_dict()
    b = build_objective("hybrid", TINY, 12, seed=3, **SMALL_HEADS["hybrid"]).state_dict()
    c = build_objective("hybrid", TINY, 12, seed=4, **SMALL_HEADS["hybrid"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["encoder.blocks.0.mlp.fc1.weight"], c["encoder.blocks.0.mlp.fc1.weight"])


# -- the training loop -------------------------------------------------------------------------------------

def _final_state(out):
    return load_state(out / STATE_FILE)


@pytest.mark.parametrize("name", ["dino", "hybrid"])
def test_resume_continues_bit_identically_and_seed_reproduces(name, tmp_path):
    # 96 images, batch 16: an epoch (96 views) ends every 96 / (16 x views per image) steps
    budget = dict(budget_views=int(16 * 14 * build_objective(name, TINY, 12, **SMALL_HEADS[name])
                                   .views.views_per_image()))  # 14 steps
    straight = train(_tiny_cfg(tmp_path, name, **budget, out=tmp_path / "a"))
    train(_tiny_cfg(tmp_path, name, **budget, out=tmp_path / "c"))  # same seed, from scratch
    cfg_b = _tiny_cfg(tmp_path, name, **budget, out=tmp_path / "b")
    stopped = train(cfg_b, stop_after_steps=8)  # mid-epoch for both (epochs end at steps 7, 9 / 6, 9)
    assert stopped["status"] == "stopped" and stopped["step"] == 8
    with pytest.raises(VitscopeError, match="resume"):
        train(cfg_b)  # an existing state is never overwritten silently
    resumed = train(cfg_b, resume=True)
    assert straight["budget"]["steps"] == resumed["budget"]["steps"] == 14
    assert train(cfg_b, resume=True) == resumed  # a finished run is not trained again

    sa, sb, sc = (_final_state(tmp_path / d) for d in "abc")
    assert sa["step"] == sb["step"] == 14
    for k, v in sa["objective"].items():  # every weight, teacher, centre and BN statistic
        assert torch.equal(v, sb["objective"][k]), k
        assert torch.equal(v, sc["objective"][k]), k
    ea, eb = load_file(tmp_path / "a" / "encoder.safetensors"), load_file(tmp_path / "b" / "encoder.safetensors")
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    la, lb = pd.read_csv(tmp_path / "a" / "log.csv"), pd.read_csv(tmp_path / "b" / "log.csv")
    pd.testing.assert_series_equal(la["loss"], lb["loss"])
    # a resumed run refuses other settings
    with pytest.raises(VitscopeError, match="seed"):
        train(_tiny_cfg(tmp_path, name, **budget, out=tmp_path / "b", seed=1), resume=True)


def test_export_loads_with_load_model_and_extract_works(tmp_path):
    card = train(_tiny_cfg(tmp_path, "simmim", epochs=2))
    out = tmp_path / "simmim"
    assert json.loads((out / "card.json").read_text()) == card
    assert card["image_views"] == card["budget"]["steps"] * 16 and card["budget"]["image_views"] == 2 * 96
    assert card["data"]["name"] == "synthetic-shapes" and card["objective"] == "simmim"
    log = pd.read_csv(card["log"])
    assert log["epoch"].tolist() == [0, 1, 2]  # epoch 0: the initialisation
    assert log["knn_cls"].between(0, 1).all() and log["loss"].iloc[1:].notna().all()
    assert card["final_knn"]["cls"] == log["knn_cls"].iloc[-1]

    vm = vs.load_model(out / "encoder.safetensors")
    assert (vm.depth, vm.embed_dim, vm.patch_size, vm.img_size) == (2, 32, 4, (16, 16))
    assert vm.spec.family == "reconstructive" and vm.preprocessing.mean == CIFAR_MEAN
    x = torch.randn(3, 3, 16, 16)
    feats = vs.extract(vm, x, ["block1.out", "block0.attn"])
    assert feats["block1.out"].shape == (3, 17, 32) and feats["block0.attn"].shape == (3, 2, 17, 17)
    # the weights are the trained encoder's, rounded to half precision
    state = _final_state(out)["objective"]
    enc = {k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")}
    torch.testing.assert_close(vm.model.state_dict()["blocks.1.mlp.fc2.weight"],
                               enc["blocks.1.mlp.fc2.weight"].half().float(), rtol=0, atol=0)


def test_cli_zoo_list_and_finetune_saves_chosen_epochs(tmp_path, tiny_init, capsys):
    assert main(["zoo", "list"]) == 0
    listing = capsys.readouterr().out
    assert all(o in listing for o in ("supervised", "dino", "mocov3", "mae", "simmim", "hybrid", "finetune"))

    out = tmp_path / "ft"
    args = ["zoo", "train", "--objective", "finetune", "--init", str(tiny_init), "--task", "reconstruction",
            "--data", "synthetic", "--synthetic-n", "64", "32", "--epochs", "2", "--batch-size", "16",
            "--knn-train", "24", "--knn-test", "12", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"encoder_epoch{e:03d}.safetensors" for e in range(3)]
    init, ep0 = load_file(tiny_init), load_file(out / "checkpoints" / "encoder_epoch000.safetensors")
    assert all(torch.equal(init[k], ep0[k]) for k in init)  # epoch 0 is the checkpoint fine-tuned from
    ep2 = load_file(out / "checkpoints" / "encoder_epoch002.safetensors")
    assert not torch.equal(ep0["blocks.1.attn.proj.weight"], ep2["blocks.1.attn.proj.weight"])
    card = json.loads((out / "card.json").read_text())
    assert card["hparams"]["task"] == "reconstruction" and card["supervision"].endswith("ft-reconstruction")

    # options that do not apply to the objective are refused, not ignored
    assert main(["zoo", "train", "--objective", "mae", "--lam", "0.3", "--out", str(tmp_path / "x")]) == 2
    assert "--lam applies to hybrid" in capsys.readouterr().err


def test_evaluate_writes_knn_and_probe_to_the_card_and_they_match_a_direct_computation(tmp_path, tiny_init, capsys):
    from vitscope.zoo.data import load_data

    run = tmp_path / "run"
    run.mkdir()
    (run / "encoder.safetensors").write_bytes(tiny_init.read_bytes())
    (run / "card.json").write_text(json.dumps({"name": "tiny", "final_knn": {}}))
    assert main(["zoo", "evaluate", str(run), "--data", "synthetic", "--synthetic-n", "240", "120"]) == 0
    e = json.loads((run / "card.json").read_text())["eval"]
    assert e["data"] == "synthetic-shapes" and "20-NN CLS" in capsys.readouterr().out
    # independently: the model's final-norm CLS tokens of the same generated train / test images, k-NN by hand
    vm = vs.load_model(run / "encoder.safetensors")
    ds = load_data("synthetic", size=vm.preprocessing.input_size, synthetic_n=(240, 120))
    assert (e["n_train"], e["n_test"]) == (len(ds.train), len(ds.test))

    def cls(images):
        x = (images.float() / 255 - torch.tensor(vm.preprocessing.mean)[:, None, None]) \
            / torch.tensor(vm.preprocessing.std)[:, None, None]
        t = vs.extract(vm, x, ["final_norm"], batch_size=500)["final_norm"]
        return torch.nn.functional.normalize(t[:, 0], dim=1)

    tr, te = cls(ds.train.images), cls(ds.test.images)
    sim = te @ tr.T
    top, idx = sim.topk(20, dim=1)
    rows = torch.arange(len(te))[:, None].expand_as(idx)
    votes = torch.zeros(len(te), 12).index_put_((rows, ds.train.labels[idx]), (top / 0.07).exp(), accumulate=True)
    assert e["knn20_cls"] == pytest.approx(float((votes.argmax(1) == ds.test.labels).double().mean()), abs=1e-9)
    assert 0 <= e["probe_cls"] <= 1 and 0 <= e["probe_gap"] <= 1
    assert "blocks" in e and len(e["blocks"]["knn20_cls"]) == vm.depth  # every block, for the bar
    # --final-only (a fine-tuned model: no bar): the same final numbers, no per-block evaluation
    args = ["zoo", "evaluate", str(run), "--data", "synthetic", "--synthetic-n", "240", "120"]
    assert main([*args, "--final-only"]) == 0
    f = json.loads((run / "card.json").read_text())["eval"]
    assert "blocks" not in f and f["knn20_cls"] == e["knn20_cls"] and f["probe_cls"] == e["probe_cls"]


def _balanced_cifar(root, split, per_class):
    """The first ``per_class`` files of each class in sorted order (the training monitor's subset), decoded."""
    import numpy as np
    from PIL import Image

    images, labels = [], []
    for c, d in enumerate(sorted(p for p in (root / split).iterdir() if p.is_dir())):
        for f in sorted(d.iterdir())[:per_class]:
            with Image.open(f) as im:
                images.append(np.asarray(im.convert("RGB")))
            labels.append(c)
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2), torch.tensor(labels)


SHIPPED = [n for n, s in vs.models.registry.REGISTRY.items() if n.startswith("zoo-") and s.weights.kind == "file"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_zoo_models_give_the_accuracy_their_card_states(name):
    """Through the registry, on the card's small fixed class-balanced CIFAR-10 subset (500 train / 200 test):
    the 20-NN accuracy of the final CLS token equals the one `vitscope zoo evaluate` wrote into the card."""
    from vitscope.models.load import package_file
    from vitscope.zoo.data import find_cifar

    weights = package_file(vs.models.registry.REGISTRY[name].weights.location)
    root = find_cifar(None)
    if not weights.is_file() or root is None:
        pytest.skip("not trained yet" if not weights.is_file() else "no CIFAR-10 in ../shared/data")
    card = json.loads((weights.parent / "card.json").read_text())
    knn = {**card["eval"]["subset"], "k": card["eval"]["k"]}
    vm = vs.load_model(name)
    feats = []
    for split, n in (("train", knn["n_train"]), ("test", knn["n_test"])):
        x, y = _balanced_cifar(root, split, n // 10)
        x = (x.float() / 255 - torch.tensor(vm.preprocessing.mean)[:, None, None]) \
            / torch.tensor(vm.preprocessing.std)[:, None, None]
        t = vs.extract(vm, x, ["final_norm"], batch_size=500)["final_norm"][:, 0]
        feats.append((torch.nn.functional.normalize(t, dim=1), y))
    (tr, ytr), (te, yte) = feats
    top, idx = (te @ tr.T).topk(knn["k"], dim=1)
    rows = torch.arange(len(te))[:, None].expand_as(idx)
    votes = torch.zeros(len(te), 10).index_put_((rows, ytr[idx]), (top / 0.07).exp(), accumulate=True)
    assert float((votes.argmax(1) == yte).double().mean()) == pytest.approx(knn[f"knn{knn['k']}_cls"], abs=0.011)


def test_findings_compare_the_groups_means_and_decide_only_beyond_their_uncertainty(tmp_path, capsys):
    from vitscope.zoo.findings import check

    fam = {"c1": "contrastive", "c2": "contrastive", "m1": "reconstructive", "m2": "reconstructive", "r": "none"}
    (tmp_path / "results").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"models": {m: {"objective_family": f, "depth": 6} for m, f in fam.items()}}))
    rng = torch.Generator().manual_seed(0)
    rows, expected = [], {}
    for m in fam:  # attention distance: layers 0..5, 2 heads; late layers = 4, 5; a small stderr
        vals = torch.rand(6, 2, generator=rng) * 10 + (0 if m == "r" else 20)  # r: far below both groups
        expected[m] = vals[4:].mean().item()
        rows += [{"model": m, "metric": "distance_px", "layer": layer, "head": h, "value": vals[layer, h].item(),
                  "stderr": 0.01} for layer in range(6) for h in range(2)]
    # NMI: the groups differ by 0.01 with standard errors of 0.05 each: within noise, inconclusive
    rows_nmi = [{"model": m, "metric": "nmi", "layer": layer, "head": 0,
                 "value": 0.5 + (0.01 if fam[m] == "reconstructive" else 0.0), "stderr": 0.05}
                for m in fam for layer in range(6)]
    pd.DataFrame(rows).to_parquet(tmp_path / "results" / "attention_distance.parquet")
    pd.DataFrame(rows_nmi).to_parquet(tmp_path / "results" / "attention_nmi.parquet")
    knn = {"c1": [.2, .3, .5, .6, .7, .8], "c2": [.2, .3, .4, .5, .6, .9], "m1": [.3, .6, .5, .4, .4, .3],
           "m2": [.3, .5, .7, .5, .4, .4], "r": [.1] * 6}
    sem = [{"model": m, "metric": "knn20_top1", "layer": i, "token_view": "cls", "value": v, "stderr": 0.02}
           for m, vs_ in knn.items() for i, v in enumerate(vs_)]
    pd.DataFrame(sem).to_parquet(tmp_path / "results" / "semantics.parquet")
    cka = {("c1", "c2"): 0.9, ("c1", "m1"): 0.2, ("c1", "m2"): 0.4, ("c2", "m1"): 0.3, ("m2", "c2"): 0.5}
    pd.DataFrame([{"model": a, "model_b": b, "metric": "cka_minibatch", "token_view": "cls", "layer": 5, "layer_b": 5,
                   "value": v} for (a, b), v in cka.items()]).to_parquet(tmp_path / "results" / "cka.parquet")
    t = check(tmp_path).set_index("measure")
    dist = t.loc["mean attention distance (px), late layers"]
    assert dist.contrastive == pytest.approx((expected["c1"] + expected["c2"]) / 2)
    assert dist.mim == pytest.approx((expected["m1"] + expected["m2"]) / 2)
    # the difference's interval: one shared deviate per model, se 0.01 each -> se of the difference 0.01
    assert dist.difference_hi - dist.difference_lo == pytest.approx(2 * 1.96 * 0.01, rel=0.1)
    assert dist.verdict == ("holds" if dist.contrastive > dist.mim else "contradicted")
    nmi = t.loc["attention NMI(query, key), late layers"]
    assert nmi.difference == pytest.approx(-0.01) and nmi.verdict == "inconclusive" and nmi.holds is None
    assert nmi.difference_lo < 0 < nmi.difference_hi
    last = t.loc["20-NN top-1 (CLS), last block"]
    assert (last.contrastive, last.mim, last.verdict, last.holds) == (pytest.approx(.85), pytest.approx(.35), "holds",
                                                                    True)
    peak = t.loc["block of the best 20-NN top-1 (CLS)"]
    assert (peak.contrastive, peak.mim, peak.verdict) == (5, 1.5, "holds")
    sim = t.iloc[-1]  # the CKA table has no stderr column: no verdict
    assert (sim.contrastive, sim.mim, sim.verdict, sim.holds) == (pytest.approx(.9), pytest.approx(.35),
                                                                  "no uncertainty", None)
    assert main(["zoo", "findings", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| contrastive models have the better last-layer k-NN † [Walmer et al. 2023]" in out
    assert "| inconclusive |" in out and "seed" not in out
    # the k-NN findings rest on MIM semantics (the zoo's budget caveat); the attention ones do not
    assert last.semantic and peak.semantic and not dist.semantic and not nmi.semantic


def _attention_run(root, distance: dict[str, float], se: float = 0.05, untrained: bool = True):
    fam = {"c1": "contrastive", "c2": "contrastive", "m1": "reconstructive", "m2": "reconstructive"}
    if untrained:
        fam["r"] = "none"
    (root / "results").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(
        {"models": {m: {"objective_family": f, "depth": 6, "supervision": "random init" if f == "none" else f}
                    for m, f in fam.items()}}))
    pd.DataFrame([{"model": m, "metric": "distance_px", "layer": layer, "head": 0, "value": distance[m],
                   "stderr": se} for m in fam for layer in range(6)]).to_parquet(
        root / "results" / "attention_distance.parquet")
    return root


def test_a_finding_holds_only_when_its_group_moved_away_from_the_untrained_network(tmp_path):
    """The contrastive models attend exactly as globally as the untrained one; MIM made attention local: CL > MIM
    by far, yet "contrastive models attend more globally" is inconclusive, and the reason says MIM moved."""
    from vitscope.zoo.findings import check

    t = check(_attention_run(tmp_path / "a", {"c1": 15.0, "c2": 15.0, "m1": 8.0, "m2": 8.0, "r": 15.0}))
    row = t.set_index("measure").loc["mean attention distance (px), late layers"]
    assert row.difference_lo > 6.5  # the groups differ far beyond their interval ...
    assert (row.verdict, row.holds) == ("inconclusive", None)  # ... but the contrastive models did not move
    assert "contrastive within noise of the untrained network" in row.reason
    assert "MIM below the untrained network" in row.reason
    assert row.untrained == pytest.approx(15.0) and row.cl_vs_untrained == pytest.approx(0.0)
    assert row.mim_vs_untrained_hi < 0 < row.cl_vs_untrained_hi and row.cl_vs_untrained_lo < 0
    # the contrastive models moved away too (beyond their interval): it holds, and the reason says who moved more
    t = check(_attention_run(tmp_path / "b", {"c1": 16.0, "c2": 16.0, "m1": 8.0, "m2": 8.0, "r": 15.0}))
    row = t.set_index("measure").loc["mean attention distance (px), late layers"]
    assert row.verdict == "holds" and "most of the difference is the departure of MIM" in row.reason
    # the report's table says why
    from vitscope.report.html import _findings
    from vitscope.report.run import load_run

    html = "".join(_findings(load_run(tmp_path / "a")))
    assert "<th>untrained</th>" in html and "<th>why</th>" in html
    assert "contrastive within noise of the untrained network" in html
    # no untrained model in the study: nothing to judge the departure by
    t = check(_attention_run(tmp_path / "c", {"c1": 16.0, "c2": 16.0, "m1": 8.0, "m2": 8.0}, untrained=False))
    row = t.set_index("measure").loc["mean attention distance (px), late layers"]
    assert row.verdict == "inconclusive" and "no untrained model" in row.reason


def test_the_budget_caveat_states_the_mim_zoo_models_margins_from_their_cards():
    from vitscope.zoo.evaluate import SEED_SD, random_card, shipped_card
    from vitscope.zoo.findings import budget_caveat

    said = budget_caveat({"zoo-dino": {"source": "zoo-dino"}, "mae": {"source": "zoo-mae"},
                          "zoo-simmim": {"source": "zoo-simmim"}})
    for label, name in (("mae", "zoo-mae"), ("zoo-simmim", "zoo-simmim")):
        a, b = shipped_card(name)["eval"]["best_knn20"], random_card()["eval"]["best_knn20"]
        half = 1.959964 * math.sqrt(2 * SEED_SD["knn20"] ** 2 + (a * (1 - a) + b * (1 - b)) / 10_000)
        assert f"{label} {a - b:+.3f} [{a - b - half:+.3f}, {a - b + half:+.3f}]" in said
    assert "zoo-dino" not in said and "attention findings are not affected" in said
    assert f"{shipped_card('zoo-mae')['image_views']:,} image-views" in said
    assert budget_caveat({"zoo-dino": {"source": "zoo-dino"}, "x": {"source": "vit_small_patch16_224"}}) is None


def test_head_types_of_the_shipped_zoo_on_its_8x8_grid():
    """The head-type rules against the shipped zoo's aligned maps (8x8 grid, 64 CIFAR-10 test photographs), where
    the objectives differ as the sources report (Walmer et al. 2023; Park et al. 2023): zoo-mae (masked image
    modelling) has no global head in blocks 1-7 and strictly local heads in most of them (measured: 6 of the
    7 blocks); zoo-dino (self-
    distillation) turns global, with every head of its last two blocks global; zoo-random (the mimetic
    initialisation, untrained) has softly local heads but no strictly local one, so locality at init is not what
    MAE shows."""
    from vitscope.analyses import get_analysis
    from vitscope.capture import stream
    from vitscope.data.formats.shipped import Cifar10Test1k

    data = Cifar10Test1k()
    types = {}
    for name in ("zoo-mae", "zoo-dino", "zoo-random"):
        vm = vs.load_model(name)
        assert vm.grid_size == (8, 8)
        a = get_analysis("aligned_attention_maps")(vm)
        stream(vm, data.batches(64, vm.preprocessing, indices=list(range(0, 1000, 16))), [a], progress=False)
        df = a.finalize()
        types[name] = df[df.metric == "head_type"].set_index(["layer", "head"])["type"]
    mae, dino, rnd = types["zoo-mae"], types["zoo-dino"], types["zoo-random"]
    mid = mae[mae.index.get_level_values("layer") >= 1]
    assert (mid != "global").all(), mid.tolist()
    assert (mid == "strict_local").sum() >= 5, mid.tolist()
    late = dino[dino.index.get_level_values("layer") >= 6]
    assert (late == "global").all(), late.tolist()
    assert (rnd == "soft_local").sum() >= 8 and not (rnd == "strict_local").any(), rnd.tolist()


ZOO_ENTRIES = [n for n in vs.models.registry.REGISTRY if n.startswith("zoo-")]


@pytest.mark.parametrize("name", ZOO_ENTRIES)
def test_timm_data_config_of_every_zoo_entry_is_vitscopes_preprocessing(name):
    """A user who builds timm's data config from a zoo model gets the input vitscope feeds it: CIFAR-10
    statistics (from the images, not from the code), 32 px, no resize or crop."""
    import timm.data

    vm = vs.load_model(name, pretrained=False)
    pre = vm.preprocessing
    cfg = timm.data.resolve_data_config(model=vm.model)
    assert tuple(cfg["mean"]) == pytest.approx(pre.mean) and tuple(cfg["std"]) == pytest.approx(pre.std)
    assert tuple(cfg["input_size"]) == (3, pre.input_size, pre.input_size) == (3, 32, 32)
    assert cfg["crop_pct"] == pre.crop_pct == 1.0 and cfg["interpolation"] == pre.interpolation
    assert vm.model.pretrained_cfg["url"] == "" and vm.model.pretrained_cfg["hf_hub_id"] == ""
    # CIFAR-10's per-channel training-set statistics (Krizhevsky 2009), rounded: what the zoo trains with
    assert pre.mean == pytest.approx((0.491, 0.482, 0.447), abs=1e-3)
    assert pre.std == pytest.approx((0.247, 0.243, 0.262), abs=1e-3)
    # the transform timm builds from it leaves a 32-px image's pixels where vitscope's normalisation puts them
    img = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    from PIL import Image

    x = timm.data.create_transform(**cfg)(Image.fromarray(img.numpy()))
    ref = (img.permute(2, 0, 1).float() / 255 - torch.tensor(pre.mean)[:, None, None]) \
        / torch.tensor(pre.std)[:, None, None]
    assert torch.allclose(x, ref, atol=1e-5)


def test_models_listing_shows_the_zoo_architecture(capsys):
    assert main(["models"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("zoo-")]
    assert len(lines) == len(ZOO_ENTRIES)
    for ln in lines:
        assert "8 blocks x 96" in ln and "patch 4" in ln and "32 px" in ln


def test_exported_zoo_checkpoint_carries_the_data_config(tmp_path):
    cfg = _tiny_cfg(tmp_path, "supervised", budget_views=32, knn_every=99)
    card = train(cfg)
    vm = vs.load_model(card["weights"])
    import timm.data

    dc = timm.data.resolve_data_config(model=vm.model)
    assert tuple(dc["mean"]) == pytest.approx(CIFAR_MEAN) and tuple(dc["input_size"]) == (3, 16, 16)


@pytest.mark.parametrize("name", LEARNERS)
def test_bf16_step_gives_the_fp32_loss_within_tolerance(name, shapes, tiny_init):
    """The same batch from the same weights: the loss of a bf16-autocast step is within 2% of the fp32
    step's (bfloat16 keeps 8 bits of mantissa: each matmul is exact to about 0.4%), and both steps leave
    finite fp32 weights."""
    objective, _, task = name.partition("-")
    kw = {"init": tiny_init, "task": task} if objective == "finetune" else SMALL_HEADS.get(objective, {})
    losses, params = {}, {}
    for precision in ("fp32", "bf16"):
        obj = build_objective(objective, TINY, len(shapes.classes), seed=0, **kw)
        opt, sched = make_optimizer(obj, TrainConfig(objective, "unused"), 10)
        obj.train()
        loss, _ = train_step(obj, opt, sched, _stream(obj, shapes).batch(0), 0, 10, 3.0, precision)
        losses[precision] = float(loss)
        params[precision] = [p.detach().clone() for p in obj.parameters()]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.02), losses
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params["bf16"])
    assert any(not torch.equal(a, b) for a, b in zip(params["fp32"], params["bf16"], strict=True))


def _teacher_entropies(n_steps: int, **kw: object) -> tuple[list[float], list[float]]:
    """Per-image and batch entropy of the DINO teacher over ``n_steps`` training steps on 256 generated shapes
    (batch 32, the tiny ViT, heads scaled down; ``kw`` overrides the objective's defaults)."""
    data = synthetic_set(256, 0, TINY.img_size)
    obj = build_objective("dino", TINY, len(data.classes), seed=0, **{**SMALL_HEADS["dino"], **kw})
    opt, sched = make_optimizer(obj, TrainConfig("dino", "unused"), n_steps)
    stream = _stream(obj, data)
    obj.train()
    got = [train_step(obj, opt, sched, stream.batch(s), s, n_steps, 3.0)[1] for s in range(n_steps)]
    return [g["teacher_entropy"] for g in got], [g["teacher_batch_entropy"] for g in got]


def test_dino_recipe_keeps_the_teacher_sharp_without_collapse_on_tiny_data():
    """The shipped DINO recipe (batch norm in the head) lowers the teacher's entropy far below uniform where the
    first zoo recipe (no batch norm: the teacher of the first zoo-dino stayed at 7.2 of log 4096 = 8.3) does not,
    without collapsing onto a few prototypes: over steps 20-59 of 60 (after centring, momentum 0.9, has caught up
    with the teacher's output), per-image entropy at most 0.55 log K and the entropy of the batch's mean output at
    least 0.75 log K (Caron et al. 2021, Sec. 5.3: uniform collapse puts the first at log K, one-hot collapse
    the second near 0); without batch norm the per-image entropy stays above 0.7 log K."""
    log_k = math.log(SMALL_HEADS["dino"]["out_dim"])
    ent, batch = _teacher_entropies(60)
    assert sum(ent[20:]) / 40 <= 0.55 * log_k, [round(e, 2) for e in ent]
    assert sum(batch[20:]) / 40 >= 0.75 * log_k, [round(e, 2) for e in batch]
    ent_first, _ = _teacher_entropies(60, use_bn=False)
    assert sum(ent_first[20:]) / 40 >= 0.7 * log_k, [round(e, 2) for e in ent_first]


def _card(objective, best_knn=0.40, best_probe=0.45, recon=None, name="zoo-x"):
    ev = {"best_knn20": best_knn, "best_probe": best_probe, "blocks": {"attn_dist": [0.45, 0.40]}}
    if recon is not None:
        ev["reconstruction"] = recon
    return {"name": name, "objective": objective, "eval": ev}


RANDOM_CARD = {"name": "zoo-random", "objective": "none",
               "eval": {"best_knn20": 0.38, "best_probe": 0.45, "blocks": {"attn_dist": [0.47, 0.47]}}}


@pytest.mark.parametrize("objective, family, margin", [("supervised", "supervised", 0.15),
                                                      ("dino", "contrastive", 0.08), ("mocov3", "contrastive", 0.08),
                                                      ("hybrid", "contrastive", 0.08)])
def test_the_accuracy_bars_judge_best_block_knn_over_zoo_random_only(objective, family, margin):
    """Supervised: best-block 20-NN >= zoo-random + 0.15; contrastive and hybrid: + 0.08. The probe is a finding,
    not a condition: a model with a poor probe still passes on its k-NN."""
    from vitscope.zoo.evaluate import judge

    ok = judge(_card(objective, best_knn=0.38 + margin + 0.005, best_probe=0.40), RANDOM_CARD)
    short = judge(_card(objective, best_knn=0.38 + margin - 0.005), RANDOM_CARD)
    assert ok.family == short.family == family
    assert ok.passes and not short.passes
    assert f"+{margin:g}" in short.reason and "below" in short.reason and "20-NN" in short.reason
    assert ok.lo < ok.value < ok.hi and ok.value == pytest.approx(margin + 0.005)


def test_a_margins_interval_combines_the_seed_spread_and_the_binomial_error():
    from vitscope.zoo.evaluate import N_EVAL, SEED_SD, margin

    a, b = 0.52, 0.38
    m, lo, hi = margin(_card("dino", best_knn=a), RANDOM_CARD, "knn20")
    var = 2 * SEED_SD["knn20"] ** 2 + a * (1 - a) / N_EVAL + b * (1 - b) / N_EVAL
    assert m == pytest.approx(a - b)
    assert (hi - lo) / 2 == pytest.approx(1.959964 * math.sqrt(var), rel=1e-6)


def _recon(ratio=0.6, curve=(1.0, 0.7, 0.5), hi=None):
    return {"loss": "L1 on the masked pixels", "trivial": "visible mean", "ratio": ratio, "ratio_lo": ratio - 0.01,
            "ratio_hi": hi if hi is not None else ratio + 0.01, "train_loss": list(curve)}


@pytest.mark.parametrize("objective", ["mae", "simmim"])
def test_the_masked_modelling_bar_judges_its_own_loss_not_its_features(objective):
    """MIM: held-out loss <= 0.8 x the trivial predictor's and a falling training loss; k-NN plays no part."""
    from vitscope.zoo.evaluate import judge

    weak_features = dict(best_knn=0.381, best_probe=0.44)  # barely above zoo-random: no matter
    assert judge(_card(objective, recon=_recon(0.6), **weak_features), RANDOM_CARD).passes
    high = judge(_card(objective, recon=_recon(0.85), **weak_features), RANDOM_CARD)
    assert not high.passes and "above the masked-modelling bar 0.8x" in high.reason
    flat = judge(_card(objective, recon=_recon(0.6, curve=(0.5, 0.6)), **weak_features), RANDOM_CARD)
    assert not flat.passes and "did not fall" in flat.reason
    strong_features = judge(_card(objective, best_knn=0.9, recon=_recon(0.9)), RANDOM_CARD)
    assert not strong_features.passes


@pytest.mark.parametrize("objective, field", [("mae", "eval.reconstruction"), ("dino", "eval.best_knn20"),
                                              ("supervised", "eval")])
def test_a_card_without_its_familys_numbers_is_one_sentence_naming_the_field_and_the_command(objective, field):
    from vitscope.zoo.evaluate import CardError, bar_failures, judge

    card = _card(objective)
    if field == "eval":
        del card["eval"]
    elif field == "eval.best_knn20":
        del card["eval"]["best_knn20"]
    with pytest.raises(CardError) as e:
        judge(card, RANDOM_CARD)
    msg = str(e.value)
    assert f"has no {field}" in msg and "vitscope zoo evaluate" in msg and "\n" not in msg
    assert bar_failures(card) == [f"the zoo's bar cannot judge it: {msg}"]


def test_fine_tuned_models_and_zoo_random_are_not_judged():
    from vitscope.zoo.evaluate import judge

    assert judge({"objective": "finetune"}, RANDOM_CARD) is None
    assert judge({"objective": "none"}, RANDOM_CARD) is None


def test_margins_report_probe_and_per_block_attention_change_with_intervals():
    from vitscope.zoo.evaluate import SEED_SD, margins

    got = margins(_card("mae", best_knn=0.40, best_probe=0.47), RANDOM_CARD)
    assert got["knn20"]["margin"] == pytest.approx(0.02) and got["probe"]["margin"] == pytest.approx(0.02)
    assert got["attn_dist_change"]["per_block"] == pytest.approx([-0.02, -0.07])
    assert got["attn_dist_change"]["half_width"] == pytest.approx(1.959964 * math.sqrt(2) * SEED_SD["attn_dist"],
                                                                  abs=1e-4)


def _slow_trivial(objective, x, mask, p):
    """The trivial predictor's loss, pixel by pixel: MAE (normalised targets) predicts 0 for each normalised patch;
    SimMIM fills each masked pixel with the mean of the image's visible pixels of that channel."""
    b, c, h, w = x.shape
    g = w // p
    out = []
    for i in range(b):
        losses = []
        if objective == "simmim":
            vis = [[] for _ in range(c)]
            for k in range(g * g):
                if not mask[i, k]:
                    r, q = divmod(k, g)
                    for ch in range(c):
                        vis[ch] += x[i, ch, r * p:(r + 1) * p, q * p:(q + 1) * p].flatten().tolist()
            fill = [sum(v) / len(v) for v in vis]
        for k in range(g * g):
            if not mask[i, k]:
                continue
            r, q = divmod(k, g)
            patch = x[i, :, r * p:(r + 1) * p, q * p:(q + 1) * p].double()
            if objective == "mae":
                flat = patch.flatten()
                mu = float(flat.mean())
                var = float(((flat - mu) ** 2).sum()) / (flat.numel() - 1)
                losses.append(sum(((v - mu) / math.sqrt(var + 1e-6)) ** 2 for v in flat.tolist()) / flat.numel())
            else:
                total = sum(abs(float(patch[ch, u, v]) - fill[ch]) for ch in range(c) for u in range(p)
                            for v in range(p))
                losses.append(total / patch.numel())
        out.append(sum(losses) / len(losses))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("objective", ["mae", "simmim"])
def test_the_trivial_predictors_loss_equals_a_pixel_by_pixel_loop(objective):
    from vitscope.zoo.evaluate import trivial_loss

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 3, 16, 16, generator=g) * 1.5 + 0.3
    mask = random_keep(3, 16, 0.75, g)[1] if objective == "mae" else block_mask(3, 4, 0.6, 2, g)
    got = trivial_loss(objective, x, mask, 4).double()
    torch.testing.assert_close(got, _slow_trivial(objective, x, mask, 4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("objective", ["mae", "simmim"])
def test_the_held_out_loss_is_the_training_loss_under_the_same_mask(objective, shapes):
    """`model_loss` averaged over a batch is what the objective's forward returns as its loss for the same mask
    draw (per-image means weigh alike: every image has the same number of masked patches)."""
    from vitscope.zoo.evaluate import model_loss

    obj = build_objective(objective, TINY, 12, seed=0, **SMALL_HEADS.get(objective, {})).eval()
    x = _stream(obj, shapes).batch(0).global_views[0][:6]
    batch = ViewBatch([x], [], torch.zeros(6, dtype=torch.long), torch.arange(6), torch.Generator().manual_seed(9), 6.)
    with torch.no_grad():
        want = obj(batch)[0]
        g = torch.Generator().manual_seed(9)
        if objective == "mae":
            keep, mask = random_keep(6, TINY.num_patches, obj.mask_ratio, g)
        else:
            keep, mask = None, obj.mim.mask(6, g)
        got = model_loss(obj, x, mask, keep).mean()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_trained_mim_runs_decoder_is_written_and_its_reconstruction_evaluated(tmp_path):
    """Training writes the decoder; `reconstruction` rebuilds the objective from the run directory and reports the
    ratio per mask draw (draws differ), its interval, and the training loss per epoch from the log."""
    from vitscope.zoo.evaluate import load_objective, reconstruction
    from vitscope.zoo.train import DECODER_FILE

    cfg = _tiny_cfg(tmp_path, "simmim", budget_views=96, epoch_views=48, knn_every=2)
    train(cfg)
    assert (cfg.out / DECODER_FILE).is_file()
    obj = load_objective(cfg.out)
    assert obj.mim.head.weight.abs().sum() > 0
    rec = reconstruction(cfg.out, data="synthetic", draws=3, synthetic_n=(96, 48))
    assert rec["n_images"] == 48 and len(rec["ratio_per_draw"]) == 3 and len(set(rec["ratio_per_draw"])) == 3
    assert rec["ratio_lo"] < rec["ratio"] < rec["ratio_hi"]
    assert len(rec["train_loss"]) == 2 and rec["ratio"] == pytest.approx(rec["model"] / rec["trivial_loss"], rel=0.05)
    # a fresh decoder fitted on the frozen encoder learns with more steps
    from vitscope.zoo.evaluate import refit_decoder

    short = refit_decoder(cfg.out, cfg.out / "encoder.safetensors", steps=1, data="synthetic", draws=2,
                          synthetic_n=(96, 48))
    longer = refit_decoder(cfg.out, cfg.out / "encoder.safetensors", steps=12, data="synthetic", draws=2,
                           synthetic_n=(96, 48))
    assert longer["ratio"] < short["ratio"] and longer["steps"] == 12
    # a run without its trained decoder (a model shipped before training wrote it): the bar's evidence comes from a
    # decoder re-fitted on the frozen encoder, and the record says so; the untrained network of the run's seed and
    # architecture gets the same re-fit budget
    from vitscope.zoo.evaluate import mim_evidence
    from vitscope.zoo.train import STATE_FILE

    (cfg.out / DECODER_FILE).unlink()
    (cfg.out / STATE_FILE).unlink()
    got = mim_evidence(cfg.out, data="synthetic", synthetic_n=(96, 48), steps=4)
    rec, refit = got["reconstruction"], got["reconstruction_refit"]
    assert rec["decoder"].startswith("re-fitted on the frozen encoder (4 steps")
    assert rec["ratio"] == refit["encoder"]["ratio"] and len(rec["train_loss"]) == 2
    assert refit["untrained"]["network"] == "untrained, seed 0" and refit["untrained"]["ratio"] != rec["ratio"]


def test_mimetic_init_sets_the_attention_products_through_timms_own_layers():
    """W_q^T W_k = 0.7 Z1 + 0.7 I and W_v^T W_proj^T = 0.4 Z2 - 0.4 I (Trockman & Kolter 2023), read through
    timm's qkv and proj layers on random tokens (summed over heads), against the same Z drawn here."""
    from vitscope.zoo.arch import build_encoder

    arch = ZooArch(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, init="mimetic")
    torch.manual_seed(3)
    vit = build_encoder(arch, 0)
    torch.manual_seed(3)
    timm_init = build_encoder(ZooArch(**{**asdict(arch), "init": "timm"}), 0)  # timm's draws, then the Z's:
    d, hd = 32, 16
    zs = [torch.randn(d, d) / d**0.5 for _ in range(2 * arch.depth)]  # per block: Z1 (q-k), Z2 (v-proj)
    x = torch.randn(5, d)
    for i, blk in enumerate(vit.blocks):
        m_qk = 0.7 * zs[2 * i] + 0.7 * torch.eye(d)
        m_vo = 0.4 * zs[2 * i + 1] - 0.4 * torch.eye(d)
        qkv = blk.attn.qkv(x) - blk.attn.qkv.bias
        q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
        summed = sum(q[:, h * hd:(h + 1) * hd] @ k[:, h * hd:(h + 1) * hd].t() for h in range(blk.attn.num_heads))
        torch.testing.assert_close(summed, x @ m_qk @ x.t(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(blk.attn.proj(v) - blk.attn.proj.bias, x @ m_vo, rtol=1e-4, atol=1e-4)
        # everything but the attention weights is timm's init
        torch.testing.assert_close(blk.mlp.fc1.weight, timm_init.blocks[i].mlp.fc1.weight, rtol=0, atol=0)
        assert not torch.equal(blk.attn.qkv.weight, timm_init.blocks[i].attn.qkv.weight)


def _attention_maps(vit, x):
    """Each block's attention probabilities softmax(q k^T / sqrt(d_head)), from the block's input."""
    maps = []

    def hook(m, inp):
        b, n, c = inp[0].shape
        qkv = m.qkv(inp[0]).reshape(b, n, 3, m.num_heads, c // m.num_heads).permute(2, 0, 3, 1, 4)
        maps.append((qkv[0] @ qkv[1].transpose(-2, -1) / (c // m.num_heads) ** 0.5).softmax(-1))

    hs = [blk.attn.register_forward_pre_hook(hook) for blk in vit.blocks]
    with torch.no_grad():
        encode(vit, x)
    for h in hs:
        h.remove()
    return maps


def test_mimetic_init_makes_untrained_attention_local_and_timm_init_does_not(shapes):
    """At initialisation, timm's init attends uniformly (mean distance on the 4x4 grid's unit square = the
    uniform value); the mimetic init attends closer than uniform in every block."""
    from vitscope.metrics.attention import attention_distance
    from vitscope.zoo.arch import build_encoder

    pos = torch.stack(torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(-1, 2) / 3
    uniform = float(torch.cdist(pos, pos).mean())  # every query, every key alike
    x = Augment(ViewSpec(), 16, CIFAR_MEAN, (0.25, 0.25, 0.25), 4).plain(shapes.images[:16])
    for init in ("timm", "mimetic"):
        torch.manual_seed(0)
        vit = build_encoder(ZooArch(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, init=init), 0)
        for a in _attention_maps(vit, x):
            dist = float(attention_distance(a, (4, 4), 1).mean())
            if init == "mimetic":
                assert dist < uniform - 0.05, (init, dist, uniform)
            else:
                assert abs(dist - uniform) < 0.01, (init, dist, uniform)


def test_dino_norm_last_layer_decides_whether_the_prototype_norms_train(shapes):
    for fixed in (True, False):
        obj = build_objective("dino", TINY, 12, norm_last_layer=fixed, **SMALL_HEADS["dino"])
        assert obj.head.last_layer.weight_g.requires_grad is not fixed
        assert obj.hparams()["norm_last_layer"] is fixed
        names = [n for n, _ in obj.trainable_named_parameters()]
        assert ("head.last_layer.weight_g" in names) is not fixed
        assert "teacher_head.last_layer.weight_g" not in names  # the teacher never trains


def test_dino_batch_entropy_is_the_entropy_of_the_mean_teacher_output(shapes):
    """teacher_batch_entropy = H(mean over the batch of the teacher's distributions), recomputed here from
    the teacher's logits and the centre as they were before the step's centre update."""
    import torch.nn.functional as F

    obj = build_objective("dino", TINY, 12, **SMALL_HEADS["dino"])
    batch = _stream(obj, shapes).batch(0)
    centre = obj.center.clone()
    with torch.no_grad():
        t_raw = obj.teacher_head(encode(obj.teacher, torch.cat(batch.global_views))[:, 0])
        p = F.softmax((t_raw - centre) / obj.current_teacher_temp, dim=-1)
        _, m = obj(batch)
    p_bar = p.mean(0)
    per_image = float((-(p * p.log()).sum(-1)).mean())
    assert m["teacher_entropy"] == pytest.approx(per_image, rel=1e-5)
    assert m["teacher_batch_entropy"] == pytest.approx(float(-(p_bar * p_bar.log()).sum()), rel=1e-5)
    assert per_image <= m["teacher_batch_entropy"] <= torch.log(torch.tensor(256.0)) + 1e-6  # concavity, log K


def test_cli_stop_after_steps_is_a_probe_that_resume_completes(tmp_path, capsys):
    out = tmp_path / "sup"
    args = ["zoo", "train", "--objective", "supervised", "--data", "synthetic", "--synthetic-n", "64", "32",
            "--budget-views", "128", "--epoch-views", "32", "--batch-size", "16",
            "--knn-train", "24", "--knn-test", "12",
            "--arch", "img_size=16", "embed_dim=32", "depth=2", "num_heads=2", "--out", str(out),
            "--no-progress", "--threads", "1"]
    assert main([*args, "--stop-after-steps", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3
    assert load_state(out / STATE_FILE)["step"] == 3 and not (out / "encoder.safetensors").exists()
    assert pd.read_csv(out / "log.csv")["step"].tolist() == [0, 2]  # epochs of 32 views end at steps 2, 4, 6, 8
    assert main([*args, "--resume"]) == 0
    assert load_state(out / STATE_FILE)["step"] == 8 and (out / "encoder.safetensors").exists()
    assert pd.read_csv(out / "log.csv")["step"].tolist() == [0, 2, 4, 6, 8]


def test_a_state_written_before_an_architecture_field_existed_resumes_with_its_default(tmp_path):
    cfg = _tiny_cfg(tmp_path, "supervised", budget_views=16 * 4)
    train(cfg, stop_after_steps=2)
    path = tmp_path / "supervised" / STATE_FILE
    st = load_state(path)
    del st["config"]["arch"]["init"]  # as written before ZooArch.init existed
    torch.save(st, path)
    assert train(cfg, resume=True)["budget"]["steps"] == 4
    train(cfg2 := _tiny_cfg(tmp_path, "supervised", budget_views=16 * 4, out=tmp_path / "m"), stop_after_steps=2)
    st = load_state(tmp_path / "m" / STATE_FILE)
    del st["config"]["arch"]["init"]
    torch.save(st, tmp_path / "m" / STATE_FILE)
    with pytest.raises(VitscopeError, match="arch"):  # a missing field means the default, not anything
        train(_tiny_cfg(tmp_path, "supervised", budget_views=16 * 4, out=tmp_path / "m",
                        arch={**asdict(TINY), "init": "mimetic"}), resume=True)
    assert cfg2.arch["init"] == "timm"


def test_zoo_random_is_the_encoder_every_objective_starts_from():
    """zoo-random (a shipped file since the zoo initialises mimetically with fixed sin-cos positions) holds, to
    float16 rounding, the encoder a self-supervised objective builds at seed 0, and it is not timm's default init.
    The attention weights come from an SVD (`arch._factor`), whose last bits depend on the CPU's LAPACK kernels:
    they agree to 5e-4 absolute (the differences seen are 1e-4 to 2e-4 on weights of scale 0.1), as does mlp.fc1
    (whose values can sit on a float16 rounding boundary); every other tensor is equal exactly."""
    from vitscope.zoo import ZOO_ARCH

    assert (ZOO_ARCH.init, ZOO_ARCH.pos_embed) == ("mimetic", "sincos")
    shipped = vs.load_model("zoo-random").model.state_dict()
    for objective in ("mae", "dino"):
        start = build_objective(objective, ZOO_ARCH, seed=0).encoder.state_dict()
        assert set(start) == set(shipped)
        for k, v in start.items():
            svd = k.endswith(("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight"))
            torch.testing.assert_close(shipped[k].float(), v.half().float(), rtol=0, atol=5e-4 if svd else 0,
                                       msg=k)
    timm_init = build_objective("mae", ZooArch(**{**asdict(ZOO_ARCH), "init": "timm", "pos_embed": "learned"}),
                                seed=0).encoder.state_dict()
    assert not torch.allclose(timm_init["blocks.0.attn.qkv.weight"].half().float(),
                              shipped["blocks.0.attn.qkv.weight"].float())


def test_the_default_study_leaves_out_models_below_the_bar_and_their_fine_tunes(monkeypatch):
    """A shipped zoo model whose card records a failed bar is not in the embedded study, nor is a model fine-tuned
    from it; each is named with its reason. An explicit config keeps every model it lists."""
    import vitscope.zoo.evaluate as ev
    from vitscope.errors import ResultWarning
    from vitscope.study import load_config
    from vitscope.study.config import default_config_path

    models = load_config(default_config_path()).models
    all_models = [m.name for m in models]
    pt, ft = next((m.finetuned_from, m.name) for m in models if m.finetuned_from)  # the study's pair
    reasons = {pt: ["best-block knn20 0.350 is +0.020 over zoo-random's 0.330 (bar +0.08)"]}
    monkeypatch.setattr(ev, "shipped_bar_failures", lambda name: reasons.get(name, []))
    with pytest.warns(ResultWarning) as got:
        kept = [m.name for m in load_config().models]
    assert kept == [m for m in all_models if m not in (pt, ft)]
    said = " | ".join(str(w.message) for w in got)
    assert f"{pt} is left out" in said and "+0.020 over zoo-random" in said
    assert f"{ft} is left out" in said and f"fine-tuned from {pt}" in said
    assert [m.name for m in load_config(default_config_path()).models] == all_models


def test_a_shipped_card_that_fails_its_bar_keeps_the_model_out_with_the_reason(monkeypatch):
    """The whole path from a card's numbers: zoo-dino's card with its 20-NN lowered below the contrastive bar, and
    zoo-mae's without its reconstruction loss, are left out of the embedded study, each with its reason."""
    import copy

    import vitscope.zoo.evaluate as ev
    from vitscope.errors import ResultWarning
    from vitscope.study import load_config

    real = ev.shipped_card

    def card(name):
        c = copy.deepcopy(real(name))
        if name == "zoo-dino":
            c["eval"]["best_knn20"] = real("zoo-random")["eval"]["best_knn20"] + 0.05
        if name == "zoo-mae":
            c["eval"].pop("reconstruction", None)
        return c

    monkeypatch.setattr(ev, "shipped_card", card)
    with pytest.warns(ResultWarning) as got:
        kept = {m.name for m in load_config().models}
    assert "zoo-dino" not in kept and "zoo-mae" not in kept and "zoo-mocov3" in kept
    said = " | ".join(str(w.message) for w in got)
    assert "zoo-dino is left out of the default study: it fails the zoo's bar: best-block 20-NN" in said
    assert "+0.050" in said and "below the contrastive bar +0.08" in said
    assert "zoo-mae is left out of the default study: the zoo's bar cannot judge it" in said
    assert "eval.reconstruction" in said and "vitscope zoo evaluate" in said


def test_the_default_config_lists_all_six_trained_zoo_models_beside_zoo_random():
    from vitscope.models.registry import REGISTRY
    from vitscope.study import load_config
    from vitscope.study.config import default_config_path
    from vitscope.zoo.evaluate import FAMILY, shipped_card

    listed = {m.name for m in load_config(default_config_path()).models}
    trained = {n for n in REGISTRY if n.startswith("zoo-") and "-ft-" not in n and n != "zoo-random"}
    assert {shipped_card(n)["objective"] for n in trained} == set(FAMILY)  # one shipped model per objective
    assert trained | {"zoo-random"} <= listed


def test_every_shipped_zoo_card_records_the_bars_verdict_and_the_default_study_follows_it():
    """Each shipped zoo model (not the fine-tuned ones, not zoo-random) carries the verdict of the bar as it stands
    (`judge` on the card's own numbers gives the recorded one) and its margins; the embedded study holds exactly
    those that pass."""
    import warnings

    from vitscope.models.load import package_file
    from vitscope.models.registry import REGISTRY
    from vitscope.study import load_config
    from vitscope.zoo.evaluate import judge, margins, random_card

    base = [n for n, s in REGISTRY.items() if n.startswith("zoo-") and "-ft-" not in n and n != "zoo-random"
            and s.weights.kind == "file"]
    passing = set()
    for name in base:
        card = json.loads((package_file(REGISTRY[name].weights.location).parent / "card.json").read_text())
        verdict = judge(card, random_card())
        assert card["bar"] == verdict.record(), name
        assert card["margins"] == margins(card, random_card()), name
        if verdict.passes:
            passing.add(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {m.name for m in load_config().models}
    assert {m for m in models if m in base} == passing
