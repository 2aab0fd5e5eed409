"""What `vitscope run` tells the user beside the per-model bars: how much came from the cache, and the
cross-model and report stages."""

import re

from vitscope.cli import main

STUDY = """models:
  - {name: vit_small_patch16_224, label: a, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
  - {name: vit_small_patch16_224, label: b, pretrained: false, seed: 1,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
dataset: {name: synthetic-shapes, n_images: 8}
analyses: {attention_distance: {}, cka: {batch_size: 4, views: [gap]}}
batch_size: 4
"""


def test_rerun_says_what_came_from_the_cache(tmp_path, capsys):
    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY)
    out = f"output_dir={tmp_path / 'run'}"
    assert main(["run", str(cfg), out]) == 0
    err = capsys.readouterr().err
    assert "0 of 4 analyses (models x analyses) read from the cache\n" in err
    assert "cross-model stage and tables: 2 analyses" in err and "report: 2 tables" in err

    assert main(["run", str(cfg), out]) == 0  # the same study again: everything read back, nothing redrawn
    err = capsys.readouterr().err
    assert "4 of 4 analyses (models x analyses) read from the cache" in err
    # a whole sentence (issue 41: it ended "... holds this study's")
    assert re.search(r"results and report unchanged: .+ already holds this study's tables and report\n", err), err
    assert "report:" not in err

    assert main(["run", str(cfg), out, "analyses.tsne.n_images=2", "--overwrite"]) == 0  # one new analysis a model
    err = capsys.readouterr().err
    assert "4 of 6 analyses" in err and "report: 3 tables" in err

    assert main(["run", "-q", str(cfg), out, "--overwrite"]) == 0  # quiet: none of it
    assert "read from the cache" not in capsys.readouterr().err
