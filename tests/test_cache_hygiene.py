"""Cache hygiene: `vitscope cache` lists the cache by model and analysis (without torch), `prune` removes entries
by age or down to a size (least recently used first), reading an entry counts as a use, tests never write into
the user's own cache, and bad sizes, ages and read-only caches are one sentence."""

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vitscope.cli import main
from vitscope.errors import ConfigError, VitscopeError
from vitscope.study import load_config, run_study
from vitscope.study.cache import parse_age, parse_size, prune, units, user_cache_root

TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def study(tmp_path, seeds=(1, 2), cache=True):
    models = "".join(f"  - {{name: vit_small_patch16_224, label: m{s}, pretrained: false, seed: {s}, "
                     f"kwargs: {TINY}}}\n" for s in seeds)
    text = (f"models:\n{models}dataset: {{name: synthetic-shapes, n_images: 8}}\n"
            "analyses: {cka: {views: [gap]}, fourier: {}}\nbatch_size: 4\nprogress: false\n")
    cfg = tmp_path / "study.yaml"
    cfg.write_text(text)
    over = [f"output_dir={tmp_path / 'run'}"] + ([f"cache_dir={tmp_path / 'cache'}"] if cache else [])
    return cfg, over


def age(paths, days):
    t = time.time() - days * 86400
    for p in paths:
        os.utime(p, (t, t))


def test_a_study_with_the_default_cache_leaves_the_user_s_own_cache_alone(tmp_path, user_cache):
    cfg, over = study(tmp_path, seeds=(9173,), cache=False)
    run_study(load_config(cfg, over))
    here = user_cache_root() / "states"
    assert str(here).startswith(str(tmp_path))  # the per-test folder, inside the session's temporary one
    keys = [d.name for d in here.iterdir() if d.is_dir()]
    assert keys  # the study did write its states: into the temporary folder
    if user_cache is not None:
        assert not any((user_cache / "states" / k).exists() for k in keys)


def test_listing_names_models_and_analyses_and_imports_no_torch(tmp_path):
    cfg, over = study(tmp_path)
    run_study(load_config(cfg, over))
    code = ("import sys\nfrom vitscope.cli import main\nrc = main(sys.argv[1:])\n"
            "print('HEAVY', [m for m in ('torch', 'timm') if m in sys.modules], 'RC', rc)")
    p = subprocess.run([sys.executable, "-c", code, "cache", str(tmp_path / "cache")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC})
    lines = p.stdout.strip().splitlines()
    assert lines[-1] == "HEAVY [] RC 0", p.stderr[-2000:]
    rows = [ln.split() for ln in lines[1:] if ln.strip() and not ln.startswith(("cache", "HEAVY"))]
    assert {r[0] for r in rows if r[0] in ("m1", "m2")} == {"m1", "m2"}
    assert {"cka", "fourier"} <= {w for r in rows for w in r}
    total = sum(u.size for u in units(tmp_path / "cache"))
    assert total > 0 and f"{len(units(tmp_path / 'cache'))} entries of 2 models" in lines[-2]


def test_the_variable_and_the_config_key_name_the_same_cache_for_vitscope_cache(tmp_path, capsys, monkeypatch):
    """Issue 42: `cache_dir: X` fills X itself, $VITSCOPE_CACHE_DIR=X names vitscope's folder (states in X/states):
    `VITSCOPE_CACHE_DIR=X vitscope cache` listed an empty X/states after a study with `cache_dir: X`."""
    cfg, over = study(tmp_path)
    run_study(load_config(cfg, over))  # cache_dir = tmp_path / "cache"
    listed = []
    for how in ("variable", "argument"):
        if how == "variable":
            monkeypatch.setenv("VITSCOPE_CACHE_DIR", str(tmp_path / "cache"))
            assert main(["cache"]) == 0
        else:
            monkeypatch.delenv("VITSCOPE_CACHE_DIR")
            assert main(["cache", str(tmp_path / "cache")]) == 0
        out = capsys.readouterr().out
        assert "empty" not in out and f"cache {tmp_path / 'cache'}:" in out, out
        listed.append(out)
    assert listed[0] == listed[1]


def test_prune_older_than_removes_only_old_entries_and_a_rerun_recomputes_only_them(tmp_path, capsys):
    cfg, over = study(tmp_path)
    run_study(load_config(cfg, over))
    found = units(tmp_path / "cache")
    first = found[0].model_dir
    age([u.path for u in found if u.model_dir == first], days=40)
    # the options before the folder, as `vitscope cache prune --older-than 30d DIR` is written too
    assert main(["cache", "prune", "--older-than", "30d", str(tmp_path / "cache")]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert not first.exists()
    assert {u.path for u in units(tmp_path / "cache")} == {u.path for u in found if u.model_dir != first}
    calls: list[str] = []
    run_study(load_config(cfg, over), on_batch=lambda m, b: calls.append(m))
    assert len(set(calls)) == 1  # the pruned model alone is computed again


def test_prune_never_removes_a_file_vitscope_did_not_write(tmp_path):
    """A model folder whose entries are all pruned goes only when nothing but vitscope's own files is left in it:
    a file someone else put there stays, with its folder; a folder of vitscope's files alone goes."""
    cfg, over = study(tmp_path)
    run_study(load_config(cfg, over))
    found = units(tmp_path / "cache")
    kept, gone = sorted({u.model_dir for u in found})
    (kept / "notes.txt").write_text("mine")
    removed, left = prune(tmp_path / "cache", older_than=-1)  # every entry is older than that
    assert {u.path for u in removed} == {u.path for u in found} and left == 0
    assert (kept / "notes.txt").read_text() == "mine" and sorted(p.name for p in kept.iterdir())[-1] == "notes.txt"
    assert not gone.exists()


def test_prune_max_size_removes_the_least_recently_used_first_and_a_read_counts_as_a_use(tmp_path):
    cfg, over = study(tmp_path, seeds=(1, 2, 3))
    run_study(load_config(cfg, over))
    found = units(tmp_path / "cache")
    for days, u in enumerate(found):  # the first entry the most recent ... the last the oldest
        age([u.path], days=days + 1)
    run_study(load_config(cfg, over))  # reads every entry back: each is used now
    assert all(time.time() - u.last_use < 3600 for u in units(tmp_path / "cache"))
    for days, u in enumerate(found):
        age([u.path], days=days + 1)
    total = sum(u.size for u in found)
    limit = total - found[-1].size - 1  # the oldest alone does not free enough: the two oldest go
    removed, left = prune(tmp_path / "cache", max_size=limit)
    assert [u.path for u in removed] == [found[-1].path, found[-2].path]
    assert left == total - found[-1].size - found[-2].size <= limit


@pytest.mark.parametrize("text, want", [("2GB", 2 * 10**9), ("2GiB", 2 * 2**30), ("2G", 2 * 2**30),
                                        ("500 MB", 500 * 10**6), ("1.5kB", 1500), ("123", 123)])
def test_sizes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text, want", [("30d", 30 * 86400), ("12h", 12 * 3600), ("90min", 5400), ("2w", 14 * 86400)])
def test_ages(text, want):
    assert parse_age(text) == want


@pytest.mark.parametrize("argv, words", [
    (["cache", "prune", "--max-size", "2XB"], "is not a size"),
    (["cache", "prune", "--max-size", "GB"], "is not a size"),
    (["cache", "prune", "--older-than", "30"], "is not an age"),
    (["cache", "prune", "--older-than", "thirty days"], "is not an age"),
    (["cache", "--older-than", "30d"], "options of `vitscope cache prune`"),
    (["cache", "prune"], "needs --older-than"),
])
def test_bad_prune_arguments_are_one_sentence(argv, words, tmp_path, capsys):
    assert main([*argv[:2], str(tmp_path), *argv[2:]] if argv[1] == "prune" else [*argv, str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and err.count("\n") == 0, err


def test_a_read_only_cache_is_one_sentence_for_prune_and_for_a_run_before_any_model_loads(tmp_path, monkeypatch,
                                                                                          capsys):
    cfg, over = study(tmp_path)
    run_study(load_config(cfg, over))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if mode & os.W_OK else real_access(p, mode, **k))
    with pytest.raises(VitscopeError, match="cannot be written to"):
        prune(tmp_path / "cache", older_than=0)
    from vitscope.study.cost import dry_run

    with pytest.raises(ConfigError, match="cannot be written to"):  # a dry run tells without writing
        dry_run(load_config(cfg, [f"output_dir={tmp_path / 'run3'}", f"cache_dir={tmp_path / 'cache'}"]))
    monkeypatch.setattr(os, "access", real_access)
    import vitscope.study.pool as pool

    monkeypatch.setattr(pool, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    real_write = Path.write_bytes

    def read_only(self, data):
        if str(self).startswith(str(tmp_path / "ro-cache")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(ConfigError, match="the cache directory .* cannot be written to .Read-only file system"):
        run_study(load_config(cfg, [f"output_dir={tmp_path / 'run2'}", f"cache_dir={tmp_path / 'ro-cache'}"]))


def test_prune_and_the_listing_know_vitscope_s_files_by_its_record_never_by_their_names(tmp_path, capsys):
    """Issue 42: prune removed anything under <model key>/store/ and any *-<16 hex>.pt in a 16-hex folder, and
    `--max-size 0` left a .lock in a folder it had not made. Now only what vitscope recorded writing goes."""
    from vitscope.study.cache import Cache

    cfg, over = study(tmp_path)
    run_study(load_config(cfg, over))
    root = tmp_path / "cache"
    ours = units(root)
    mkey = ours[0].model_dir.name
    stored = Cache(root).store_dir(mkey, "inversions")  # an analysis's product folder: vitscope's
    (stored / "x.safetensors").write_bytes(b"0" * 10)
    theirs = [root / mkey / "store" / "my_file.txt", root / mkey / "store" / "my_results" / "keep.txt",
              root / mkey / "notes-0123456789abcdef.pt", root / "0123456789abcdef" / "mine-fedcba9876543210.pt"]
    for p in theirs:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("mine")
    assert main(["cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert "notes" not in out and "mine" not in out and "my_" not in out
    assert "1 file(s) named like entries in folders with no record" in out  # the foreign 16-hex folder's file
    removed, left = prune(root, max_size=0)
    assert {u.path for u in removed} == {u.path for u in ours} | {stored} and left == 0
    assert all(p.read_text() == "mine" for p in theirs)
    assert sorted(p.name for p in (root / "0123456789abcdef").iterdir()) == ["mine-fedcba9876543210.pt"]  # no .lock


def test_entries_of_a_cache_from_before_the_record_are_kept_until_a_study_reads_them(tmp_path, capsys):
    cfg, over = study(tmp_path)
    run_study(load_config(cfg, over))
    root = tmp_path / "cache"
    n = len(units(root))
    for d in root.iterdir():
        (d / ".written").unlink()  # as an older vitscope left them
    assert units(root) == [] and prune(root, max_size=0) == ([], 0)
    assert main(["cache", str(root)]) == 0
    assert f"{n} file(s) named like entries in folders with no record" in capsys.readouterr().out
    run_study(load_config(cfg, over))  # reads every entry back: each is checked as vitscope's and recorded
    assert len(units(root)) == n
