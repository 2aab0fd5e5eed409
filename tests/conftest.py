import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub on test machines: fail fast, never retry

import pytest  # noqa: E402
import torch  # noqa: E402

import vitscope as vs  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3)


def tiny(kind: str = "vit", **kw) -> vs.ViTModel:
    """Tiny random models of each supported family (3 blocks, 4x4 grid)."""
    args = {**TINY, **kw}
    if kind == "vit":
        return vs.load_model("vit_small_patch16_224", pretrained=False, **args)
    if kind == "reg":
        return vs.load_model("vit_small_patch14_reg4_dinov2", pretrained=False, **{**args, "init_values": 0.1})
    if kind == "beit":
        return vs.load_model("beit_base_patch16_224", pretrained=False, **{**args, "init_values": 0.1})
    if kind == "beit_shared":
        return vs.load_model("beit_base_patch16_224", pretrained=False, use_shared_rel_pos_bias=True,
                             use_rel_pos_bias=False, **{**args, "init_values": 0.1})
    raise ValueError(kind)


@pytest.fixture(params=["vit", "reg", "beit"])
def any_tiny(request):
    return tiny(request.param)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one torch thread is faster, and steadier on a shared machine (a module's tests ask for it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def images():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 3, 32, 32, generator=g)


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """The whole session writes no state into the user's own cache: ``VITSCOPE_CACHE_DIR`` and ``XDG_CACHE_HOME``
    point into a temporary folder (also for subprocesses, which inherit them). Yields the user's real cache
    directory (tests/test_cache_hygiene.py checks that a study leaves it alone)."""
    from vitscope.study.cache import user_cache_root

    real = user_cache_root()
    saved = {k: os.environ.get(k) for k in ("VITSCOPE_CACHE_DIR", "XDG_CACHE_HOME")}
    tmp = tmp_path_factory.mktemp("session-cache")
    os.environ["VITSCOPE_CACHE_DIR"] = str(tmp / "vitscope")
    os.environ["XDG_CACHE_HOME"] = str(tmp / "xdg")
    yield real
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Each test its own study cache (the default one is per user and shared by every study)."""
    monkeypatch.setenv("VITSCOPE_CACHE_DIR", str(tmp_path / "user-cache"))


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: the error under test must come before one."""
    import vitscope.study.pool as pool_mod

    def refuse(*a, **k):
        raise AssertionError("the error must come before any model loads")

    monkeypatch.setattr(pool_mod, "load_model", refuse)


@pytest.fixture
def fixtures():
    """The test-only analyses and view of `study_fixtures` registered for one test (they record what they saw)."""
    import study_fixtures

    study_fixtures.register()
    yield
    study_fixtures.unregister()
