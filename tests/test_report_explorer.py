"""The report's interactive layer in a real headless browser (chromium + chromedriver, skipped where they are not
installed; .ci/run installs them): no console error and no request, a clicked patch shows exactly the attention
row the model computes for that query (to the stated 8-bit quantisation), one model toggle hides the model on
every chart, a hover shows the table's value, and the page works on a one-model study of a model without a CLS
token (registers and an attention pool's query instead). With ``VITSCOPE_SCREENSHOT=PATH`` set, the explorer's
screenshot is written there, of ``VITSCOPE_SCREENSHOT_REPORT`` (a report.html; the README's is the default
study's) or else of the two-model study's page."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from study_fixtures import TWO_TINY_MODELS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="chromium and chromedriver are not installed")

TWO_MODELS_STUDY = TWO_TINY_MODELS + """\
dataset: {name: synthetic-shapes, n_images: 12}
analyses:
  attention_distance: {}
  cka: {batch_size: 6, views: [gap]}
  aligned_attention_maps: {}
  attention_explorer: {keep_images: 2}
batch_size: 6
progress: false
"""

NO_CLS_STUDY = """\
models:
  - name: vit_small_patch16_224
    label: no-cls
    pretrained: false
    kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, class_token: false,
             reg_tokens: 2, global_pool: map, no_embed_class: true}
dataset: {name: synthetic-shapes, n_images: 6}
analyses:
  attention_distance: {}
  attention_explorer: {keep_images: 1}
batch_size: 6
progress: false
"""


def _study(tmp: Path, text: str) -> tuple[Path, object]:
    from vitscope.study import load_config, run_study

    cfg_file = tmp / "study.yaml"
    cfg_file.write_text(text)
    cfg = load_config(cfg_file, [f"output_dir={tmp / 'run'}"])
    return run_study(cfg), cfg


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("profile")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    driver.set_window_size(1200, 1000)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    return _study(tmp_path_factory.mktemp("two"), TWO_MODELS_STUDY)


@pytest.fixture(scope="module")
def no_cls(tmp_path_factory):
    return _study(tmp_path_factory.mktemp("nocls"), NO_CLS_STUDY)


def _open(driver, report: Path) -> None:
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get_log("performance")
    driver.get(report.resolve().as_uri())
    assert driver.execute_script("return window.vitscope && window.vitscope.ready") is True


def _requests(driver) -> list[str]:
    """Every URL the page asked for (the DevTools network log) and every resource the page loaded."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg.get("method") == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    urls += driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return urls


def _attention(cfg, label: str, image: int, taps: list[str]) -> dict[str, np.ndarray]:
    """The taps of one image as `vitscope.extract` gives them for the study's model (same weights: the study's
    seeded random init) and the dataset's image through the model's own preprocessing."""
    import vitscope as vs
    from vitscope.data.catalog import build_dataset

    mc = next(m for m in cfg.models if m.label == label)
    vm = vs.load_model(mc.name, pretrained=False, seed=mc.seed, **mc.kwargs)
    ds = build_dataset(cfg.dataset if getattr(cfg, "dataset", None) is not None else next(iter(cfg.datasets.values())))
    batch = next(ds.batches(1, vm.preprocessing, indices=[image]))
    return {k: v[0].double().numpy() for k, v in vs.extract(vm, batch.images, taps).items()}


def _canvas(driver, model: str) -> dict:
    return driver.execute_script(
        "const c = document.querySelector(`canvas.vs-ex-map[data-model='${arguments[0]}']`);"
        "return {values: c.dataset.values ? JSON.parse(c.dataset.values) : null, token: Number(c.dataset.token),"
        " block: Number(c.dataset.block), head: c.dataset.head,"
        " prefix: c.dataset.prefixValues ? JSON.parse(c.dataset.prefixValues) : null,"
        " w: c.getBoundingClientRect().width, h: c.getBoundingClientRect().height};", model)


def _click_cell(driver, model: str, row: int, col: int, grid: tuple[int, int]) -> None:
    """Click the centre of a patch cell of a model's map (Selenium offsets are from the element's centre)."""
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = driver.find_element("css selector", f"canvas.vs-ex-map[data-model='{model}']")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    box = _canvas(driver, model)
    x = (col + 0.5) * box["w"] / grid[1] - box["w"] / 2
    y = (row + 0.5) * box["h"] / grid[0] - box["h"] / 2
    ActionChains(driver).move_to_element_with_offset(canvas, int(round(x)), int(round(y))).click().perform()


def _select(driver, css: str, value: str) -> None:
    driver.execute_script("const s = document.querySelector(arguments[0]); s.value = arguments[1];"
                          "s.dispatchEvent(new Event(arguments[2]));", css, value,
                          "input" if "block" in css else "change")


def _assert_row(shown: list[float], expected: np.ndarray) -> None:
    """Equal to the model's row within the quantisation: each weight within 1/510 of the row's maximum."""
    scale = expected.max()
    np.testing.assert_allclose(np.asarray(shown), expected, rtol=0, atol=scale / 510 + 1e-6)


def test_page_has_no_console_error_and_makes_no_request(browser, two_models):
    out, _ = two_models
    _open(browser, out / "report.html")
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR", "WARNING")]
    own = (out / "report.html").resolve().as_uri()
    foreign = [u for u in _requests(browser) if u != own and not u.startswith("data:")]
    assert errors == []
    assert foreign == []
    counts = browser.execute_script("return [window.vitscope.charts.length, window.vitscope.grids.length,"
                                    " document.querySelectorAll('canvas.vs-ex-map').length]")
    assert counts[0] >= 2 and counts[1] == 1 and counts[2] == 2  # distance, CKA diagonal; CKA grid; two maps


def test_a_clicked_patch_shows_the_models_attention_row(browser, two_models):
    out, cfg = two_models
    _open(browser, out / "report.html")
    grid, prefix = (4, 4), 1  # 32 px at patch 8; CLS
    before = _canvas(browser, "tiny-vit")
    _select(browser, ".vs-ex-block", "1")
    _select(browser, ".vs-ex-head", "2")
    _click_cell(browser, "tiny-vit", 3, 1, grid)
    shown = _canvas(browser, "tiny-vit")
    assert shown["token"] == prefix + 3 * grid[1] + 1 and shown["block"] == 1 and shown["head"] == "2"
    assert shown["values"] != before["values"]
    image = int(pd.read_parquet(out / "results" / "attention_explorer.parquet").image.dropna().min())
    attn = _attention(cfg, "tiny-vit", image, ["block1.attn"])["block1.attn"]  # (heads, T, T)
    _assert_row(shown["values"], attn[2, shown["token"], prefix:])
    _assert_row(shown["prefix"], attn[2, shown["token"], :prefix])
    # the mean of the heads, and the CLS query, at block 0
    _select(browser, ".vs-ex-head", "mean")
    _select(browser, ".vs-ex-block", "0")
    _select(browser, ".vs-ex-query", "cls")
    cls = _canvas(browser, "tiny-vit")
    attn0 = _attention(cfg, "tiny-vit", image, ["block0.attn"])["block0.attn"]
    assert cls["token"] == 0 and cls["head"] == "mean"
    _assert_row(cls["values"], attn0.mean(0)[0, prefix:])


def test_hiding_a_model_in_one_chart_hides_it_everywhere(browser, two_models):
    out, _ = two_models
    _open(browser, out / "report.html")
    legend = browser.find_elements("css selector", f"#{_first_chart(browser)} .u-legend .u-series")
    entry = next(e for e in legend if e.text.startswith("tiny-beit"))
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", entry)
    entry.click()
    state = browser.execute_script(
        "return window.vitscope.charts.map(c => c.names.map((n, k) => [n, c.u.series[k + 1].show]))")
    shown = {(i, n): on for i, chart in enumerate(state) for n, on in chart}
    assert any(n == "tiny-beit" for _, n in shown) and all(on is (n != "tiny-beit") for (_, n), on in shown.items())
    panel = browser.execute_script("return getComputedStyle(document.querySelector("
                                   "\".vs-ex-panel[data-model='tiny-beit']\")).display")
    box = browser.find_element("css selector", "#vs-models input[data-model='tiny-beit']")
    assert panel == "none" and not box.is_selected()
    box.click()  # the model bar brings it back on every chart
    back = browser.execute_script("return window.vitscope.charts.every(c => c.names.every((n, k) =>"
                                  " c.u.series[k + 1].show))")
    assert back is True


def _first_chart(driver) -> str:
    return driver.execute_script("return window.vitscope.charts[0].id")


def test_a_hover_shows_the_tables_value(browser, two_models):
    out, _ = two_models
    _open(browser, out / "report.html")
    cka = pd.read_parquet(out / "results" / "cka.parquet")
    # the CKA diagonal chart: its first panel is against the first model; hover block 1
    found = browser.execute_script(
        "const c = window.vitscope.charts.find(c => c.chart.title.startsWith('CKA between the same block'));"
        "c.u.setCursor({left: c.u.valToPos(1, 'x'), top: 10});"
        "const k = c.names.indexOf('tiny-beit') + 1;"
        "const row = c.u.root.querySelectorAll('.u-legend .u-series')[k];"
        "return [c.chart.panels[c.panel].label, row.querySelector('.u-value').textContent];")
    label, text = found
    assert label.startswith("vs tiny-vit")
    rows = cka[(cka.metric == "cka_minibatch") & (cka.layer == 1) & (cka.layer_b == 1)
               & (((cka.model == "tiny-vit") & (cka.model_b == "tiny-beit"))
                  | ((cka.model == "tiny-beit") & (cka.model_b == "tiny-vit")))]
    assert len(rows) == 1
    value, lo, hi = (float(x) for x in text.replace("[", " ").replace("]", " ").replace(",", " ").split())
    r = rows.iloc[0]
    assert value == pytest.approx(r.value, rel=5e-4, abs=1e-6)  # shown to 4 significant digits
    assert lo == pytest.approx(r.value_lo, rel=5e-4, abs=1e-6) and hi == pytest.approx(r.value_hi, rel=5e-4, abs=1e-6)
    # and a CKA grid cell under the mouse reads the same row
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = browser.find_element("css selector", "canvas.vs-heat")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    size = canvas.size
    layers = int(cka.layer.max()) + 1  # block i of A (rows, 0 at the bottom) x block j of B
    x, y = (1.5 / layers - 0.5) * size["width"], (0.5 - 1.5 / layers) * size["height"]
    ActionChains(browser).move_to_element_with_offset(canvas, int(x), int(y)).perform()
    tip = browser.find_element("css selector", ".vs-grid .vs-tip").get_attribute("data-value")
    assert float(tip) == pytest.approx(r.value, rel=1e-5)


def test_one_model_without_cls_token(browser, no_cls):
    out, cfg = no_cls
    _open(browser, out / "report.html")
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR", "WARNING")] == []
    options = browser.execute_script(
        "return Array.from(document.querySelectorAll('.vs-ex-query option')).map(o => o.value)")
    assert "cls" not in options and {"reg0", "reg1", "pool"} <= set(options)
    grid, prefix = (4, 4), 2
    _click_cell(browser, "no-cls", 0, 3, grid)
    shown = _canvas(browser, "no-cls")
    assert shown["token"] == prefix + 3
    image = int(pd.read_parquet(out / "results" / "attention_explorer.parquet").image.dropna().min())
    taps = _attention(cfg, "no-cls", image, ["block0.attn", "pool_attn"])
    _assert_row(shown["values"], taps["block0.attn"].mean(0)[shown["token"], prefix:])
    _select(browser, ".vs-ex-query", "reg1")
    reg = _canvas(browser, "no-cls")
    assert reg["token"] == 1
    _assert_row(reg["values"], taps["block0.attn"].mean(0)[1, prefix:])
    _select(browser, ".vs-ex-query", "pool")
    pool = _canvas(browser, "no-cls")
    _assert_row(pool["values"], taps["pool_attn"].mean(0)[0, prefix:])


@pytest.mark.skipif(not os.environ.get("VITSCOPE_SCREENSHOT"), reason="VITSCOPE_SCREENSHOT is not set")
def test_explorer_screenshot(browser, two_models):
    """The explorer after a click on a patch of the first model's map, at block 3 (or the last), as a PNG."""
    report = Path(os.environ.get("VITSCOPE_SCREENSHOT_REPORT") or two_models[0] / "report.html")
    _open(browser, report)
    first = browser.execute_script("return Object.keys(window.vitscope.explorer.panels)[0]")
    layers = browser.execute_script("return window.vitscope.explorer.panels[arguments[0]].model.layers.length", first)
    grid = browser.execute_script("return window.vitscope.explorer.panels[arguments[0]].model.grid", first)
    _select(browser, ".vs-ex-block", str(min(3, layers - 1)))
    _click_cell(browser, first, grid[0] // 3, grid[1] // 2, tuple(grid))
    section = browser.find_element("id", "vs-explorer")
    browser.execute_script("arguments[0].scrollIntoView(); window.scrollBy(0, -document.getElementById('vs-models')"
                           ".offsetHeight - 8)", section)
    assert _canvas(browser, first)["values"] is not None
    section.screenshot(os.environ["VITSCOPE_SCREENSHOT"])
