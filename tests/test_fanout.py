"""Fan-out over jobs: `vitscope run --models K/N` computes slice K of N of the models into a shared cache (two
processes at once), and a final plain run writes the tables of one plain run; bad slices are one sentence."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from vitscope.cli import main
from vitscope.errors import ConfigError
from vitscope.study import load_config, run_study
from vitscope.study.config import parse_models_slice, slice_models

TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"

STUDY = f"""
models:
  - {{name: vit_small_patch16_224, label: pt, pretrained: false, seed: 1, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, label: ft, pretrained: false, seed: 2, finetuned_from: pt, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, label: other, pretrained: false, seed: 3, kwargs: {TINY}}}
dataset: {{name: synthetic-shapes, n_images: 12}}
analyses:
  seen_ids: {{}}
  cka: {{views: [gap]}}
  pair_seen: {{}}
batch_size: 4
progress: false
"""



def tables(run_dir: Path) -> dict[str, pd.DataFrame]:
    return {p.stem: pd.read_parquet(p) for p in sorted((run_dir / "results").glob("*.parquet"))}


def test_slices_are_round_robin_and_cover_every_model_once():
    models = list("abcde")
    got = [slice_models(models, k, 3) for k in (1, 2, 3)]
    assert got == [["a", "d"], ["b", "e"], ["c"]]
    assert sorted(sum(got, [])) == models


@pytest.mark.parametrize("text, words", [("3/2", "between 1 and 2"), ("0/2", "between 1 and 2"),
                                         ("1/0", "N is the number of slices .* at least 1"), ("a/b", "is not K/N"),
                                         ("2", "is not K/N"), ("-1/2", "is not K/N")])
def test_a_bad_slice_is_one_sentence(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_models_slice(text)


def test_bad_slices_on_the_command_line_are_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import vitscope.study.pool as pool

    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY.split("analyses:")[0] + "analyses: {cka: {}}\n")
    for arg, words in (("3/2", "between 1 and 2"), ("0/2", "between 1 and 2"), ("4/4", "holds none"),
                       ("-1/2", "'-1/2' is not K/N"), ("1/0", "N is the number of slices")):
        assert main(["run", str(cfg), "--models", arg, f"output_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and err.count("\n") == 0, err


def test_two_slice_jobs_at_once_then_a_final_run_equal_one_plain_run(fixtures, tmp_path):
    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY)
    shared = tmp_path / "shared-cache"
    script = str(Path(__file__).parent / "run_with_fixtures.py")
    jobs = [subprocess.Popen([sys.executable, script, "--quiet", "run", str(cfg), "--models", f"{k}/2",
                              f"output_dir={tmp_path / 'fanned'}", f"cache_dir={shared}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in (1, 2)]
    for job in jobs:  # both write into the one cache at the same time
        _out, err = job.communicate(timeout=300)
        assert job.returncode == 0, err.decode()
    fanned = tmp_path / "fanned"
    assert not (fanned / "results").exists() and not (fanned / "report.html").exists()  # slices write no tables
    calls: list[str] = []
    run_study(load_config(cfg, [f"output_dir={fanned}", f"cache_dir={shared}"]),
              on_batch=lambda m, b: calls.append(m))
    assert calls == ["pt->ft"] * 3  # the final run computes only the pair stage: every model came from the slices
    plain = run_study(load_config(cfg, [f"output_dir={tmp_path / 'plain'}", f"cache_dir={tmp_path / 'own'}"]))
    a, b = tables(fanned), tables(plain)
    assert set(a) == set(b) == {"seen_ids", "cka", "pair_seen"}
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name])


def test_a_slice_takes_no_lock_on_the_run_directory_and_writes_nothing_there(fixtures, tmp_path):
    from vitscope.study import rundir

    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY.replace("  pair_seen: {}\n", ""))
    out = tmp_path / "run"
    out.mkdir()
    over = [f"output_dir={out}", f"cache_dir={tmp_path / 'cache'}"]
    lock = rundir.hold(out)  # another run is writing into the directory
    try:
        run_study(load_config(cfg, over), models=(2, 3))  # a slice goes ahead
        with pytest.raises(ConfigError, match="another vitscope run is writing"):
            run_study(load_config(cfg, over))
    finally:
        lock.release()
    assert sorted(p.name for p in out.iterdir()) == [rundir.LOCK]
    calls: list[str] = []
    run_study(load_config(cfg, over), on_batch=lambda m, b: calls.append(m))
    assert sorted(set(calls)) == ["other", "pt"]  # "ft" (slice 2 of 3) came from the cache


@pytest.mark.slow  # slices and torchrun each tested apart in CI
def test_a_slice_under_torchrun_fills_the_cache_as_one_process_does(fixtures, tmp_path):
    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY.replace("  pair_seen: {}\n", ""))
    shared, script = tmp_path / "shared-cache", str(Path(__file__).parent / "run_with_fixtures.py")
    over = [f"output_dir={tmp_path / 'fanned'}", f"cache_dir={shared}"]
    subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", script, "--quiet", "run", str(cfg),
                    "--models", "1/2", *over], check=True, timeout=300, capture_output=True)
    calls: list[str] = []
    run_study(load_config(cfg, over), on_batch=lambda m, b: calls.append(m))
    assert sorted(set(calls)) == ["ft"]  # slice 1 of 2 (pt, other) came from the sharded job
    plain = run_study(load_config(cfg, [f"output_dir={tmp_path / 'plain'}", f"cache_dir={tmp_path / 'own'}"]))
    a, b = tables(tmp_path / "fanned"), tables(plain)
    assert set(a) == set(b) == {"seen_ids", "cka"}
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], check_exact=False, rtol=1e-6, atol=1e-9)


def test_the_cost_of_a_slice_counts_its_models_alone_and_no_pair_stage(fixtures, tmp_path):
    from vitscope.study.cost import dry_run

    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY)
    over = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    whole = dry_run(load_config(cfg, over))
    parts = [dry_run(load_config(cfg, over), models=(k, 2)) for k in (1, 2)]
    assert [p.n_models for p in parts] == [2, 1]
    assert sum(p.forwards for p in parts) == whole.forwards > 0
    assert whole.pairs and not any(p.pairs for p in parts)  # pair stages are the final run's
