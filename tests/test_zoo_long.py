"""The zoo on another device and at the long budget: `--device`, `--budget long`, `zoo train --all` (resuming).

The long budget (20 x the shipped one) is far too long for the CPU, so its arithmetic is checked through
`make_plan` against the shipped cards (no training), and the resume logic of ``--all`` is exercised on a tiny
budget given with ``--budget-views`` (the same code path: `zoo_recipes` with an explicit number of views).
"""

import importlib
import json
import math
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitscope.cli import main
from vitscope.errors import VitscopeError
from vitscope.zoo import ZooArch, build_objective
from vitscope.zoo.base import Objective
from vitscope.zoo.data import ViewBatch, ViewStream
from vitscope.zoo.train import (
    STATE_FILE,
    ZOO_BUDGET_VIEWS,
    ZOO_LONG_FACTOR,
    TrainConfig,
    batch_to,
    budget_views,
    load_state,
    make_optimizer,
    make_plan,
    resolve_device,
    train,
    train_step,
    zoo_recipes,
)

TINY = ZooArch(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2)
WEIGHTS = Path(__file__).parents[1] / "src" / "vitscope" / "zoo" / "weights"
SHIPPED = {"supervised": "supervised", "dino": "dino", "mocov3": "mocov3", "mae": "mae", "simmim": "simmim",
           "hybrid": "hybrid", "finetune-cls": "random-ft-cls"}
NO_CUDA = not torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_thread")


def _views_per_image(name: str) -> float:
    kw = {"init": "zoo-random"} if name == "finetune" else {}
    return build_objective(name, TINY, 10, **kw).views.views_per_image()  # (a fine-tune takes its init's arch)


# -- the long budget: arithmetic only -----------------------------------------------------------------------

def test_the_recipes_of_all_are_the_shipped_models_and_long_is_20_times_their_budget():
    assert ZOO_LONG_FACTOR == 20
    default, long = zoo_recipes("z", "default"), zoo_recipes("z", "long")
    assert [label for label, _ in default] == list(SHIPPED)
    for (label, d), (_, lg) in zip(default, long, strict=True):
        card = json.loads((WEIGHTS / SHIPPED[label] / "card.json").read_text())
        vpi = _views_per_image(d["objective"])
        plan_d = make_plan(TrainConfig(**d), vpi, 50_000)
        plan_l = make_plan(TrainConfig(**lg), vpi, 50_000)
        # the default recipe is the shipped run's: budget, epochs, steps, monitor, fine-tune source and task
        assert card["budget"] == {"image_views": plan_d.budget_views, "views_per_image": vpi, "batch_size": 128,
                                  "steps": plan_d.total_steps, "epochs": plan_d.n_epochs,
                                  "epoch_views": plan_d.epoch_views}, label
        assert (card["final_knn"]["n_train"], card["final_knn"]["n_test"]) == (d["knn_train"], d["knn_test"])
        assert card["seed"] == TrainConfig(**d).seed == 0
        if label == "finetune-cls":
            assert card["hparams"]["init"] == d["objective_kwargs"]["init"] == "zoo-random"
            assert card["hparams"]["task"] == d["objective_kwargs"]["task"] == "classification"
        # long: exactly 20x the image-views, the same number of epochs; steps are ceil(views / views per step),
        # so 20x the default's steps up to the default's rounding (at most 20 steps fewer)
        assert plan_l.budget_views == 20 * plan_d.budget_views == budget_views("long", d["objective"])
        assert plan_l.n_epochs == plan_d.n_epochs and plan_l.epoch_views == 20 * plan_d.epoch_views
        assert plan_l.total_steps == math.ceil(plan_l.budget_views / plan_l.views_per_step)
        assert 20 * plan_d.total_steps - 20 < plan_l.total_steps <= 20 * plan_d.total_steps
    assert budget_views("default", "mae") == ZOO_BUDGET_VIEWS and budget_views("default", "finetune") == 80_000
    with pytest.raises(VitscopeError, match="default, long"):
        budget_views("longer", "mae")


def test_docs_state_the_long_runs_steps_as_make_plan_computes_them():
    text = (Path(__file__).parents[1] / "docs" / "ZOO.md").read_text()
    section = text[text.index("### Training on a GPU, longer"):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    for label, fields in zoo_recipes("z", "long"):
        steps = make_plan(TrainConfig(**fields), _views_per_image(fields["objective"]), 50_000).total_steps
        row = next(line for line in section.splitlines() if line.startswith(f"| {label} "))
        assert f"{steps:,}" in row and f"{fields['budget_views']:,}" in row, (label, row)
    assert "vitscope zoo train --all --device cuda --budget long --out" in section
    assert re.search(r"not (been )?trained yet", section)


def test_the_cli_names_the_long_budget_as_image_views(tmp_path, monkeypatch):
    seen = {}

    def fake_train(cfg, **kw):  # what the command asks for, without training
        seen["cfg"] = cfg
        return {"status": "stopped", "step": 0, "total_steps": 1, "out": str(cfg.out)}

    monkeypatch.setattr(importlib.import_module("vitscope.zoo.train"), "train", fake_train)  # the module
    assert main(["zoo", "train", "--objective", "mae", "--budget", "long", "--out", str(tmp_path / "m")]) == 0
    assert seen.pop("cfg").budget_views == 20 * ZOO_BUDGET_VIEWS
    assert main(["zoo", "train", "--objective", "finetune", "--init", "zoo-random", "--budget", "long",
                 "--out", str(tmp_path / "f")]) == 0
    assert seen.pop("cfg").budget_views == 20 * 80_000
    assert main(["zoo", "train", "--objective", "mae", "--out", str(tmp_path / "n")]) == 0
    assert seen.pop("cfg").budget_views is None  # no budget given: the zoo budget, as before


# -- --all ----------------------------------------------------------------------------------------------

# every run of the zoo on 32 image-views in batches of 8 (4 steps of one view, 2 of 2 or 2.5), one epoch
ALL_TINY = ["zoo", "train", "--all", "--data", "synthetic", "--synthetic-n", "16", "10", "--batch-size", "8",
            "--budget-views", "32", "--epoch-views", "32", "--knn-train", "16", "--knn-test", "10",
            "--arch", "img_size=16", "embed_dim=32", "depth=2", "num_heads=2", "--no-progress"]


def _encoders(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {label: load_file(root / label / "encoder.safetensors") for label in SHIPPED}


def test_all_resumed_after_a_stop_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, capsys):
    assert main([*ALL_TINY, "--out", str(tmp_path / "a")]) == 0  # uninterrupted
    capsys.readouterr()
    b = tmp_path / "b"
    assert main([*ALL_TINY, "--out", str(b), "--stop-after-steps", "1"]) == 0  # as if killed after 1 step each
    out = capsys.readouterr().out
    assert out.count(": started (") == 7 and out.count("stopped at step 1 of") == 7
    assert not any((b / label / "encoder.safetensors").exists() for label in SHIPPED)
    assert main([*ALL_TINY, "--out", str(b)]) == 0  # the same command again continues every run
    lines = capsys.readouterr().out.splitlines()
    # steps: 32 image-views over 8 x views per image each: 4 (one view), 2 (dino 2.5, mocov3 and hybrid 2)
    for label, n in (("supervised", 4), ("dino", 2), ("mocov3", 2), ("mae", 4), ("simmim", 4), ("hybrid", 2),
                     ("finetune-cls", 4)):
        assert any(line.startswith("[") and f"] {label} ->" in line and line.endswith(f"resumed at step 1 of {n}")
                   for line in lines), (label, lines)
    ea, eb = _encoders(tmp_path / "a"), _encoders(b)
    for label in SHIPPED:
        assert ea[label].keys() == eb[label].keys()
        assert all(torch.equal(ea[label][k], eb[label][k]) for k in ea[label]), label
        assert load_state(b / label / STATE_FILE)["step"] == load_state(tmp_path / "a" / label / STATE_FILE)["step"]
    card = json.loads((b / "finetune-cls" / "card.json").read_text())
    assert card["hparams"] == {"init": "zoo-random", "task": "classification", "source": "zoo-random"}
    assert len(list((b / "finetune-cls" / "checkpoints").iterdir())) == 2  # a fine-tune keeps every epoch: 0, 1
    # a third time: everything is done, nothing is trained again
    stamp = {label: (b / label / "encoder.safetensors").stat().st_mtime_ns for label in SHIPPED}
    assert main([*ALL_TINY, "--out", str(b)]) == 0
    assert capsys.readouterr().out.count(": done\n") == 7
    assert stamp == {label: (b / label / "encoder.safetensors").stat().st_mtime_ns for label in SHIPPED}


@pytest.mark.parametrize(("extra", "message"), [
    (["--objective", "mae"], "exactly one of --objective"),
    (["--lam", "0.3"], "--lam cannot be given with --all"),
    (["--init", "zoo-random", "--task", "classification"], "--init, --task cannot be given with --all"),
    (["--set", "momentum=0.9"], "--set cannot be given with --all"),
])
def test_all_refuses_one_runs_options_in_one_sentence(tmp_path, capsys, extra, message):
    assert main(["zoo", "train", "--all", *extra, "--out", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "z").exists()


def test_neither_objective_nor_all_is_one_sentence(tmp_path, capsys):
    assert main(["zoo", "train", "--out", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err.strip()
    assert "exactly one of --objective" in err and len(err.splitlines()) == 1


# -- the device -----------------------------------------------------------------------------------------

@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
@pytest.mark.parametrize("which", [["--objective", "supervised"], ["--all"]])
def test_cuda_on_a_machine_without_one_is_one_sentence_before_any_work(tmp_path, capsys, which):
    out = tmp_path / "z"
    assert main(["zoo", "train", *which, "--device", "cuda", "--budget", "long", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "0 usable CUDA GPU(s); use --device cpu" in err
    assert not out.exists()


def test_resolve_device_accepts_only_the_gpus_there_are(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(VitscopeError, match="not a device torch knows"):
        resolve_device("banana")
    with pytest.raises(VitscopeError, match="cpu or cuda"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda").type == "cuda"
    with pytest.raises(VitscopeError, match=r"'cuda:2' was asked for but this machine has 2 usable CUDA GPU\(s\); "
                                            r"use --device cpu or cuda:0 to cuda:1"):
        resolve_device("cuda:2")


class _Probe(Objective):
    """Records where the forward runs: the autocast device type, and where tensors made inside it land."""

    name = "probe"

    def __init__(self):
        super().__init__(TINY)
        self.w = torch.nn.Parameter(torch.ones(3))
        self.seen: dict[str, object] = {}

    def forward(self, batch):
        self.seen["view"] = batch.global_views[0].device
        return (self.w ** 2).sum(), {}


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_train_step_runs_the_forward_on_the_batchs_device(monkeypatch, device):
    """A meta batch stands in for a GPU's: autocast must be asked for its device type, and the forward sees the
    batch where it is."""
    asked = []

    class Autocast:
        def __init__(self, device_type, **kw):
            asked.append((device_type, kw.get("enabled")))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch, "autocast", Autocast)
    obj = _Probe()
    opt = torch.optim.AdamW(obj.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    views = torch.zeros(2, 3, 16, 16, device=device)
    batch = ViewBatch([views], [], torch.zeros(2, dtype=torch.long), torch.arange(2),
                      torch.Generator().manual_seed(0), 2.0)
    train_step(obj, opt, sched, batch, 0, 10, 3.0, "bf16")
    assert asked == [(device, True)]
    assert obj.seen == {"view": torch.device(device)}
    assert not torch.equal(obj.w.detach(), torch.ones(3))  # the step was taken


def test_batch_to_moves_views_and_labels_and_keeps_the_cpu_batch_itself():
    obj = build_objective("dino", TINY, 10, out_dim=64, hidden=32, bottleneck=16)
    from vitscope.zoo.data import Augment, synthetic_set

    data = synthetic_set(32, 0, 16)
    pre = obj.preprocessing
    stream = ViewStream(data, obj.views, 8, 0, Augment(obj.views, 16, pre.mean, pre.std, 4))
    b = stream.batch(0)
    assert batch_to(b, torch.device("cpu")) is b
    m = batch_to(b, torch.device("meta"))
    assert [v.device.type for v in m.global_views + m.local_views] == ["meta"] * 4
    assert m.labels.device.type == "meta" and m.generator is b.generator and m.image_views == b.image_views


def _tiny_cfg(out, **kw):
    return TrainConfig(**{**dict(objective="supervised", out=out, data="synthetic", arch=asdict(TINY),
                                 synthetic_n=(48, 24), batch_size=16, knn_train=20, knn_test=10, progress=False,
                                 budget_views=16 * 6, epoch_views=32), **kw})


def test_the_device_is_not_a_setting_a_resumed_run_must_match(tmp_path):
    """A run stopped on one device resumes on another (here cpu, then cpu:0, which torch tells apart) with its
    state: bit for bit the weights of an uninterrupted run on the CPU, the devices listed in the card; the state
    holds CPU tensors only."""
    straight = train(_tiny_cfg(tmp_path / "a"))
    assert straight["devices"] == ["cpu"]
    assert train(_tiny_cfg(tmp_path / "b"), stop_after_steps=3)["step"] == 3
    st = load_state(tmp_path / "b" / STATE_FILE)
    tensors = [t for t in [*st["objective"].values(), *(v for s in st["optimizer"]["state"].values()
                                                          for v in s.values())] if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert st["total_steps"] == 6 and st["devices"] == ["cpu"]
    resumed = train(_tiny_cfg(tmp_path / "b", device="cpu:0"), resume=True)
    assert resumed["devices"] == ["cpu", "cpu:0"]
    ea, eb = (load_file(tmp_path / d / "encoder.safetensors") for d in "ab")
    assert all(torch.equal(ea[k], eb[k]) for k in ea)


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["supervised", "dino", "mocov3", "mae", "simmim", "hybrid"])
def test_cuda_first_step_loss_is_the_cpus_and_training_moves_on(name):
    """The same network, views and masks on the GPU as on the CPU: the first loss agrees within 1e-3 relative."""
    from vitscope.zoo.data import Augment, synthetic_set

    small = {"dino": {"out_dim": 256, "hidden": 64, "bottleneck": 32}, "mocov3": {"hidden": 64, "out_dim": 32},
             "hybrid": {"hidden": 64, "out_dim": 32}, "mae": {"decoder_dim": 32, "decoder_depth": 1,
                                                              "decoder_heads": 2}}.get(name, {})
    data = synthetic_set(64, 0, 16)
    losses = {}
    for dev in ("cpu", "cuda"):
        obj = build_objective(name, TINY, len(data.classes), seed=0, **small).to(dev)
        pre = obj.preprocessing
        stream = ViewStream(data, obj.views, 16, 0, Augment(obj.views, 16, pre.mean, pre.std, 4))
        cfg = TrainConfig(objective=name, out="unused")
        opt, sched = make_optimizer(obj, cfg, 10)
        losses[dev] = [float(train_step(obj, opt, sched, batch_to(stream.batch(s), torch.device(dev)), s, 10, 3.0)[0])
                       for s in range(3)]
        assert all(p.device.type == dev for p in obj.parameters())
    assert losses["cuda"][0] == pytest.approx(losses["cpu"][0], rel=1e-3)
    assert all(math.isfinite(x) for x in losses["cuda"])


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU")
def test_cuda_run_writes_a_cpu_state_and_resumes_on_the_cpu(tmp_path):
    assert train(_tiny_cfg(tmp_path / "g", device="cuda"), stop_after_steps=3)["step"] == 3
    st = load_state(tmp_path / "g" / STATE_FILE)
    assert all(t.device.type == "cpu" for t in st["objective"].values())
    card = train(_tiny_cfg(tmp_path / "g"), resume=True)  # continued on the CPU
    assert card["devices"][0].startswith("cuda:0 (") and card["devices"][1:] == ["cpu"]
    assert card["final_knn"]["cls"] is not None


def test_masks_come_from_the_steps_cpu_generator_and_land_on_the_views_device():
    """The masked objectives draw from the step's CPU generator (the same masks on every device) and hand the
    masks to their views' device (a meta device stands in for a GPU)."""
    from vitscope.zoo.base import block_mask, random_keep

    keep, mask = random_keep(4, 16, 0.75, torch.Generator().manual_seed(3))
    k_cpu, m_cpu = random_keep(4, 16, 0.75, torch.Generator().manual_seed(3), "cpu")
    k_meta, m_meta = random_keep(4, 16, 0.75, torch.Generator().manual_seed(3), "meta")
    assert torch.equal(keep, k_cpu) and torch.equal(mask, m_cpu)
    assert k_meta.device.type == m_meta.device.type == "meta" and k_meta.shape == keep.shape
    b = block_mask(4, 8, 0.6, 2, torch.Generator().manual_seed(3))
    assert torch.equal(b, block_mask(4, 8, 0.6, 2, torch.Generator().manual_seed(3), "cpu"))
    assert block_mask(4, 8, 0.6, 2, torch.Generator().manual_seed(3), "meta").device.type == "meta"
