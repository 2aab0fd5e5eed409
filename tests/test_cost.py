"""Cost before the run: `vitscope run --dry-run` reads no weights and writes nothing, counts the forwards a real
run makes (every call, the analyses' own and the pair stages' among them), and a real run prints the same paragraph
and refuses a batch whose captured taps do not fit."""

import re
from dataclasses import dataclass

import pytest
import torch

import vitscope.analyses  # noqa: F401 - every analysis registered
import vitscope.study.cost as cost
import vitscope.study.pool as pool
import vitscope.study.run as run
from vitscope.analyses.base import ANALYSES
from vitscope.capture.engine import Capture
from vitscope.cli import main
from vitscope.errors import ConfigError
from vitscope.study import load_config, run_study

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one torch thread is faster

TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"

STUDY = f"""
models:
  - {{name: vit_small_patch16_224, label: a, pretrained: false, seed: 1, kwargs: {TINY}}}
  - {{name: beit_base_patch16_224, label: b, pretrained: false, kwargs: {{img_size: 32, patch_size: 8, embed_dim: 48,
      depth: 2, num_heads: 3, init_values: 0.1}}}}
datasets:
  shapes: {{name: synthetic-shapes, n_images: 10}}
  photos: {{name: cifar10-test-1k, n_images: 12}}
analyses:
  seen_ids: {{views: ["test_shift:amount=0.3"]}}
  seen_labelled: {{dataset: photos}}
  attention_distance: {{}}
batch_size: 4
progress: false
"""



@pytest.fixture
def no_weights(monkeypatch):
    """Loading a model, or reading any checkpoint, fails the test."""
    import vitscope.models.checkpoints as ck

    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(ck, "read_checkpoint", lambda *a, **k: pytest.fail("a checkpoint was read"))


def config(tmp_path, text=STUDY, extra=()):
    f = tmp_path / "study.yaml"
    f.write_text(text)
    return load_config(f, [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}", *extra])


def test_the_dry_run_counts_the_forwards_of_the_real_run_which_prints_the_same_paragraph(fixtures, tmp_path,
                                                                                       monkeypatch, capsys):
    est = cost.dry_run(config(tmp_path))
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # a dry run writes nothing
    forwards = []
    real_call = Capture.__call__
    monkeypatch.setattr(Capture, "__call__", lambda self, x: forwards.append(len(x)) or real_call(self, x))
    cfg = config(tmp_path)
    cfg.progress = True
    run_study(cfg)
    assert est.forwards == len(forwards) > 0
    assert est.text() in capsys.readouterr().err  # printed before the first forward
    assert sum(est.images.values()) * 2 == sum(forwards)  # every model, every pass, every image once
    assert est.tap_bytes > 0 and "attention" not in est.largest
    rerun = cost.dry_run(config(tmp_path))
    assert rerun.forwards == 0 and rerun.cached == rerun.total == 6  # 2 models x 3 analyses, all cached


def test_the_largest_batch_s_taps_follow_the_architecture(fixtures, tmp_path):
    small = cost.dry_run(config(tmp_path)).tap_bytes
    wide = cost.dry_run(config(tmp_path, STUDY.replace("embed_dim: 48", "embed_dim: 96"))).tap_bytes
    big_batch = cost.dry_run(config(tmp_path, extra=["batch_size=8"])).tap_bytes
    assert big_batch == 2 * small  # batch 4 -> 8 (both datasets hold at least 8 images)
    assert small < wide < 2 * small  # attention maps (B x heads x T x T) do not grow with the width


def test_a_dry_run_reads_no_weights_and_notes_a_missing_checkpoint(tmp_path, no_weights, capsys):
    text = STUDY.split("datasets:")[0].replace("seed: 1, ", "seed: 1, weights: /nowhere/a.pth, ").replace(
        "pretrained: false, seed: 1", "seed: 1") + "dataset: {name: synthetic-shapes, n_images: 8}\n" \
        "analyses: {attention_distance: {}}\nbatch_size: 4\n"
    (tmp_path / "study.yaml").write_text(text)
    argv = ["run", str(tmp_path / "study.yaml"), "--dry-run", f"output_dir={tmp_path / 'run'}",
            f"cache_dir={tmp_path / 'cache'}"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and out.startswith("cost: 2 passes")
    assert "'/nowhere/a.pth' does not exist (a real run stops there)" in out
    assert int(re.search(r"(\d+) forwards", out).group(1)) == 2 * 2  # 8 images in batches of 4, two models
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    assert main(argv[:2] + argv[3:]) == 2  # the real run: one sentence about the file
    assert "does not exist" in capsys.readouterr().err


def test_a_run_whose_batch_of_taps_does_not_fit_is_refused_before_any_model_loads(fixtures, tmp_path, monkeypatch,
                                                                                  no_weights):
    need = cost.dry_run(config(tmp_path)).tap_bytes
    # the tiny model's parameters (452 KiB) take more than its batch of taps (40 KiB): their own check, tested in
    # test_reliability_round2, is left out here so the free memory can fall just below the taps
    monkeypatch.setattr("vitscope.models.load.check_build", lambda mc: None)
    monkeypatch.setattr(cost, "free_memory", lambda device: need - 1)
    with pytest.raises(ConfigError, match=r"captured taps .* more than the .* free on cpu: lower batch_size"):
        run_study(config(tmp_path))
    assert "a real run refuses this" in cost.dry_run(config(tmp_path)).text()
    monkeypatch.setattr(cost, "free_memory", lambda device: need)

    class Passed(Exception):
        pass

    def first_model(*a, **k):
        raise Passed

    monkeypatch.setattr(run, "_run_model", first_model)
    with pytest.raises(Passed):  # exactly enough memory: the run goes on to its first model
        run_study(config(tmp_path))


def test_free_memory_on_the_cpu_is_a_positive_number():
    free = cost.free_memory("cpu")
    assert free is None or free > 0


def test_the_scale_example_in_the_cluster_docs_is_a_valid_study_of_its_stated_size():
    """docs/CLUSTER.md's table quotes docs/scale-003.yaml: 20 ViT-B/16 and 69,227 images per model."""
    from pathlib import Path

    from vitscope.study import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "docs" / "scale-003.yaml")
    assert len(cfg.models) == 20 and {m.name for m in cfg.models} == {"vit_base_patch16_224"}
    assert cfg.datasets["images"].n_images == 50_000


# ------------------------------------------------------------------------- every forward call, per analysis


class Counter:
    """The forward calls of every model a study loads, counted by hooks on the model: a call of the model (its
    images: the call's rows, whatever leaves it early), and a run of its blocks that does not start at block 0
    or continue the one before (a rerun from a later block, as head_ablation makes); ``gradients``: the calls
    made with gradients enabled; ``blocks``: block passes (rows entering a block) without and with gradients."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = self.images = self.gradients = 0
        self.blocks = {False: 0, True: 0}

    def _call(self, rows: int) -> None:
        self.calls += 1
        self.images += rows
        self.gradients += int(torch.is_grad_enabled())

    def watch(self, vm):
        at = {"next": None}  # the block a call of the model reaches next

        def call(module, args):
            self._call(len(args[0]))
            at["next"] = 0

        def block(k):
            def enter(module, args):
                if at["next"] != k:
                    self._call(len(args[0]))
                at["next"] = k + 1
                self.blocks[torch.is_grad_enabled()] += len(args[0])
            return enter

        vm.model.register_forward_pre_hook(call)
        for k, b in enumerate(vm.model.blocks):
            b.register_forward_pre_hook(block(k))
        return vm


@pytest.fixture
def counted(monkeypatch):
    """A `Counter` on every model the study loads (in this process: ``on_batch`` keeps a helper process away)."""
    counter = Counter()
    real = pool.load_model
    monkeypatch.setattr(pool, "load_model", lambda *a, **k: counter.watch(real(*a, **k)))
    return counter


def model(label, extra="", depth=2):
    """A tiny random ViT's entry in a study's ``models:`` list (``extra``: further keys)."""
    return (f"  - {{name: vit_small_patch16_224, label: {label}, pretrained: false, {extra}"
            f"kwargs: {TINY.replace('depth: 2', f'depth: {depth}')}}}\n")


def study(analysis, params="{}", data="shapes: {name: synthetic-shapes, n_images: 8}", models=None):
    """A study of one analysis on ``data`` (8 images, batches of 4) by one tiny model, or ``models``."""
    models = models or model("a", "seed: 1, ")
    return (f"models:\n{models}datasets:\n  {data}\nanalyses:\n  {analysis}: {params}\nbatch_size: 4\n"
            "progress: false\n")


@dataclass
class Case:
    analysis: str
    study: str
    name: str = ""  # the test id, where an analysis has several cases


PAIR = model("a", "seed: 1, ") + model("b", "seed: 2, finetuned_from: a, ")
CHECKPOINTS = (model("a", "seed: 1, ", depth=3) + model("b1", "seed: 2, finetuned_from: a, ", depth=3)
               + model("b2", "seed: 3, finetuned_from: a, ", depth=3))
SILHOUETTES = ("conflict: {name: synthetic-silhouette-conflict, n_images: 8}\n"
               "  train: {name: synthetic-silhouettes, n_images: 8}")
CASES = [
    Case("stir", study("stir", "{iterations: 2}", models=PAIR)),
    # A's inversions made once for both checkpoints; 2 repeats; rows in chunks of 4 (max_rows); 2 of 3 blocks
    Case("stir", study("stir", "{iterations: 2, repeats: 2, max_rows: 6, layers: [0, 1], corruptions: none}",
                       models=CHECKPOINTS), name="stir-checkpoints"),
    Case("head_agreement", study("head_agreement", "{ks: [3]}", models=PAIR)),
    Case("gradient_rollout", study("gradient_rollout")),
    Case("attention_distance", study("attention_distance")),
    Case("head_ablation", study("head_ablation", "{mode: mean, mean_images: 6}"), name="head_ablation-mean"),
    Case("head_ablation", study("head_ablation", "{heads: all, layers: [1]}")),
    Case("high_norm_tokens", study("high_norm_tokens", "{rule: bimodal, threshold_images: 6}"),
         name="high_norm_tokens-bimodal"),
    Case("high_norm_tokens", study("high_norm_tokens")),
    Case("attention_nmi", study("attention_nmi")),
    Case("cls_attention_maps", study("cls_attention_maps", "{keep_images: 1}")),
    Case("query_attention_maps", study("query_attention_maps", "{keep_images: 2, queries: [centre, [0, 1]]}")),
    Case("attention_explorer", study("attention_explorer", "{keep_images: 2}")),
    Case("aligned_attention_maps", study("aligned_attention_maps")),
    Case("block_updates", study("block_updates", "{keep_images: 1}")),
    Case("saliency_iou", study("saliency_iou")),
    Case("propagation", study("propagation", data="videos: {name: synthetic-videos, n_images: 8, "
                                                  "options: {n_frames: 4}}")),
    Case("correspondence", study("correspondence", data="pairs: {name: synthetic-pairs, n_images: 8}")),
    Case("retrieval", study("retrieval", data="split: {name: synthetic-retrieval, options: {n_queries: 2, views: 2, "
                                              "n_distractors: 2}}")),
    Case("svd_volume", study("svd_volume")),
    Case("fourier", study("fourier")),
    Case("tsne", study("tsne", "{n_images: 2, max_iter: 250}")),
    Case("attention_rollout", study("attention_rollout")),
    Case("logit_lens", study("logit_lens")),
    Case("shape_bias", study("shape_bias", "{dataset: conflict, train_dataset: train}", data=SILHOUETTES)),
    Case("band_noise", study("band_noise")),
    Case("corruptions", study("corruptions", "{corruptions: noise, severities: [1, 3]}")),
    Case("semantics", study("semantics", "{ks: [3], test_every: 3}")),
    Case("cka", study("cka", "{batch_size: 4}")),
    Case("residual_cka", study("residual_cka", "{batch_size: 4}")),
    Case("diversity", study("diversity", "{batch_size: 4}")),
    Case("similarity", study("similarity")),
]


def test_every_registered_analysis_has_a_counted_case():
    assert {c.analysis for c in CASES} == set(ANALYSES)


@pytest.mark.filterwarnings("ignore")  # tiny random models: chance-level results and their warnings
@pytest.mark.parametrize("case", [pytest.param(c, id=c.name or c.analysis) for c in CASES])
def test_the_dry_run_counts_every_forward_call_and_image_of_the_real_run(case, tmp_path, counted):
    est = cost.dry_run(config(tmp_path, case.study))
    run_study(config(tmp_path, case.study), on_batch=lambda label, batch: None)
    assert counted.calls > 0
    assert est.forwards == counted.calls
    assert (est.forward_images, est.gradients) == (counted.images, counted.gradients)
    rerun = cost.dry_run(config(tmp_path, case.study))  # everything in the cache, the pair stages too
    assert rerun.forwards == rerun.forward_images == rerun.flops == 0
    assert all(p.endswith(": in the cache") for p in rerun.pairs)


def test_a_new_checkpoint_s_stage_counts_no_inversion_of_a_which_the_cache_kept(tmp_path, counted):
    params = "{iterations: 2, layers: [0, 1], corruptions: none}"
    first = study("stir", params, models=CHECKPOINTS.rsplit("  - ", 1)[0])  # a and b1
    run_study(config(tmp_path, first), on_batch=lambda label, batch: None)
    counted.reset()
    added = study("stir", params, models=CHECKPOINTS)  # b2 added
    est = cost.dry_run(config(tmp_path, added))
    run_study(config(tmp_path, added), on_batch=lambda label, batch: None, overwrite=True)
    assert est.pairs[0].endswith("b1 on the 8 images of shapes: in the cache")
    assert (est.forwards, est.forward_images, est.gradients) == (counted.calls, counted.images, counted.gradients)
    assert est.gradients == counted.gradients == 2 * 2  # b2 inverted (2 steps per batch), a not


def test_a_pair_stage_is_said_in_forward_calls_and_its_flops_follow_the_blocks_its_rows_pass(tmp_path, counted):
    """stir on 8 images in batches of 4, 2 taps, 2 iterations; per batch: each model reads it (2 calls, 8 images);
    each model is inverted (its targets: 1 call of 4 images; 2 steps with gradients and a last one: 3 calls of
    8 rows) and its inversions measured by both (2 calls of 8 images); B's accuracy on the clean images and 6
    corruptions (1 call of 28 images): 15 calls and 124 images per batch."""
    text = study("stir", "{iterations: 2}", models=PAIR)
    est = cost.dry_run(config(tmp_path, text))
    assert est.passes == 0 and est.pairs == ["stir a -> b on the 8 images of shapes: 30 forward calls over 248 "
                                             "images, 8 of them with gradients"]
    assert "pair stages (after both models' passes): stir a -> b" in est.text()
    assert est.text().count("\n") == 0
    # depth 3, taps at blocks 0 and 1: the rows leave the forward after their block, a measure after block 1
    text = study("stir", "{iterations: 2, layers: [0, 1]}",
                 models=model("a", "seed: 1, ", depth=3) + model("b", "seed: 2, finetuned_from: a, ", depth=3))
    est = cost.dry_run(config(tmp_path, text))
    run_study(config(tmp_path, text), on_batch=lambda label, batch: None)
    vm = cost.architecture(config(tmp_path, text).models[0])
    per_block = cost.forward_flops(vm) // vm.depth
    assert est.flops == per_block * (counted.blocks[False] + (1 + cost.BACKWARD) * counted.blocks[True]) > 0


def test_a_study_whose_pair_stage_alone_runs_beyond_the_hours_is_warned_about(tmp_path, monkeypatch, capsys):
    text = study("stir", "{iterations: 2}", models=PAIR)  # no analysis of one model: no pass, the pair stage only
    est = cost.dry_run(config(tmp_path, text))
    assert est.passes == 0 and est.flops > 0 and est.warning() is None
    monkeypatch.setitem(cost.FLOPS_PER_SECOND, "cpu", est.flops / (2 * cost.MAX_HOURS * 3600))
    assert est.hours == pytest.approx(2 * cost.MAX_HOURS)
    assert f"more than {cost.MAX_HOURS} hours" in est.warning() and "Warning: this run is estimated" in est.text()
    run_study(config(tmp_path, text))  # progress off: the warning alone, before the run starts
    assert capsys.readouterr().err.startswith("vitscope: warning: this run is estimated at about 48 hours")


def test_the_stir_study_of_the_bug_report_is_estimated_at_its_226_forward_calls(tmp_path, no_weights):
    """Two ViT-B/16 (B fine-tuned from A), 64 images in batches of 32, stir with its defaults (50 iterations, every
    block) beside an analysis of one model: the passes make 4 forwards and the pair stage 222 (per batch: 2 reads,
    2 x (a target, 50 steps with gradients, a last step, 2 measures), 1 accuracy), as the real run did."""
    text = ("models:\n  - {name: vit_base_patch16_224, label: a, pretrained: false}\n"
            "  - {name: vit_base_patch16_224, label: b, pretrained: false, finetuned_from: a}\n"
            "dataset: {name: cifar10-test-1k, n_images: 64}\nanalyses:\n  stir: {}\n  attention_distance: {}\n"
            "progress: false\n")
    est = cost.dry_run(config(tmp_path, text))
    assert est.forwards == 4 + 222 and est.gradients == 2 * 2 * 50
    assert "stir a -> b on the 64 images of cifar10-test-1k: 222 forward calls over 82,112 images" in est.text()
    assert est.hours > 100 * cost.Estimate(flops=4 * 32 * cost.forward_flops(cost.architecture(
        config(tmp_path, text).models[0])), device="cpu").hours  # the passes are a small share of it
