"""Cost before the run: `vitscope run --dry-run` reads no weights and writes nothing, counts the forwards a real
run makes, and a real run prints the same paragraph and refuses a batch whose captured taps do not fit."""

import re

import pytest

import vitscope.study.cost as cost
import vitscope.study.pool as pool
import vitscope.study.run as run
from vitscope.capture.engine import Capture
from vitscope.cli import main
from vitscope.errors import ConfigError
from vitscope.study import load_config, run_study

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
