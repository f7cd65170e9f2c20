"""The web app in a real browser: Debian's headless Chromium driven by Playwright.

Opens the page served on 127.0.0.1, uploads a real test image, runs it, reads each model's
predicted label from the page, checks that the stability plot and the thumbnails rendered,
draws a stroke on the Draw tab and runs that, clicks a gallery image with the Draw tab still
open (one click shows it on the Upload tab and runs it), and checks that every request the
page made went to 127.0.0.1; opens /docs and /redoc. The screenshot is left in
``$RSTCNN_ARTIFACTS`` (default ``tests/artifacts``). Chromium comes from ``scripts/setup.sh``
(``apt-get install chromium``); Playwright never downloads a browser here.
"""

from __future__ import annotations

import shutil
from urllib.parse import urlparse

import httpx
import pytest
from serving import artifacts_dir, gallery, live_server, tiny_onnx_models

from rstcnn.serve.app import build_app
from rstcnn.serve.stability import SweepSpec

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [  # what headless Chromium needs on these machines (no GPU, no sandbox, no network)
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",
]
SPEC = SweepSpec(rotation_steps=24, scale_steps=8, deformation_steps=6)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    samples = gallery(base)
    assert samples, "no real test images: install dataset-fashion-mnist (scripts/setup.sh)"
    app = build_app(tiny_onnx_models(base), samples_dir=samples[0].path.parent, spec=SPEC)
    with live_server(app) as url:
        yield url, samples


def test_page_classifies_an_uploaded_test_image(server, tmp_path):
    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM), "chromium is missing: run scripts/setup.sh as root"
    url, samples = server
    image = samples[3].path
    expected = _api_labels(url, image)
    expected_gallery = _api_labels(url, samples[2].path)
    swept = httpx.post(f"{url}/v1/stability", files={"image": ("x.png", image.read_bytes())})
    changes = [m["changes"]["rotation"] for m in swept.json()["models"]]
    requested: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("request", lambda request: requested.append(request.url))
            page.goto(url + "/", wait_until="load")
            page.wait_for_selector("#run", timeout=30_000)
            page.set_input_files("#input-image input[type=file]", str(image))
            page.wait_for_selector("#input-image img", timeout=30_000)
            page.click("#run")
            page.wait_for_function("document.querySelector('#run').disabled", timeout=10_000)
            page.wait_for_selector("#stability-plot img", timeout=60_000)  # the rotation sweep's
            page.wait_for_function(
                "document.querySelector('#status').innerText.includes('one batch per model')",
                timeout=60_000,
            )
            page.wait_for_function(  # the last stage's thumbnails, decoded
                "[...document.querySelectorAll('#sweep-gallery img')]"
                ".filter(i => i.complete && i.naturalWidth > 0).length >= 18",
                timeout=30_000,
            )
            shown = _shown_labels(page)
            plot_width = page.eval_on_selector("#stability-plot img", "img => img.naturalWidth")
            thumbs = page.eval_on_selector_all(
                "#sweep-gallery img", "imgs => imgs.filter(i => i.naturalWidth > 0).length"
            )
            status = page.inner_text("#status")
            summary = page.inner_text("#summary")
            page.screenshot(path=str(artifacts_dir() / "web_app.png"), full_page=True)
            page.wait_for_function("!document.querySelector('#run').disabled", timeout=10_000)
            re_ranked = _re_rank(page)
            drawn_status = _draw_and_run(page)
            gallery_labels = _click_gallery_image(page, 2)  # with the Draw tab still open
            error_page = _run_a_bad_file(page, tmp_path)
        finally:
            browser.close()

    assert shown == expected
    assert plot_width > 600  # the matplotlib panel arrived as a decoded picture
    assert thumbs >= 18
    assert f"x {SPEC.batch_size} images, one batch per model" in status
    assert "Stability" in summary and expected[0] in summary
    assert all(sentence in summary for sentence in changes), (changes, summary)
    hosts = {urlparse(u).hostname for u in requested if not u.startswith(("data:", "blob:"))}
    assert hosts == {"127.0.0.1"}, f"the page fetched from {hosts}"
    assert (artifacts_dir() / "web_app.png").stat().st_size > 10_000
    rows, k, same_status = re_ranked  # the slider re-ranks the labels without a new sweep
    assert rows == [k, k] and k > 3 and same_status
    assert "280x280" in drawn_status and "(inverted)" in drawn_status
    assert gallery_labels == expected_gallery  # one click ran the gallery image
    status, plots, badges = error_page  # an error clears the old results and stays written
    assert "This file cannot be classified" in status and "not an image" in status
    assert plots == 0 and badges == 0


def _shown_labels(page) -> list[str]:
    """Each model's top-1 label as the page shows it."""
    return [
        page.inner_text(f"#label-{i} [data-testid=label-output-value]").strip() for i in range(2)
    ]


def _api_labels(url: str, image) -> list[str]:
    return [
        httpx.post(
            f"{url}/v1/classify",
            files={"image": ("x.png", image.read_bytes(), "image/png")},
            data={"model": name},
        ).json()["predictions"][0]["label"]
        for name in ("rst_cnn_fb", "cnn")
    ]


def _run_a_bad_file(page, tmp_path) -> tuple[str, int, int]:
    """Run a file that is not an image after a result is shown: the status line, how many
    plot images and how many "Error" badges the page then shows."""
    bad = tmp_path / "not-an-image.png"
    bad.write_bytes(b"this is text, not a picture")
    page.set_input_files("#input-image input[type=file]", str(bad))
    page.wait_for_timeout(500)
    page.click("#run")
    page.wait_for_function(
        "document.querySelector('#status').innerText.includes('cannot be classified')",
        timeout=30_000,
    )
    plots = page.eval_on_selector_all("#stability-plot img", "imgs => imgs.length")
    badges = page.locator("text=/^Error$/").count()
    return page.inner_text("#status"), plots, badges


def _re_rank(page) -> tuple[list[int], int, bool]:
    """Move the top-k slider: each label's rows, the new k, and whether the status line
    (which names each sweep's run time) stayed as it was."""
    status = page.inner_text("#status")
    box = page.locator("#top-k input[type=range]").bounding_box()
    page.mouse.click(box["x"] + 0.6 * box["width"], box["y"] + box["height"] / 2)
    k = int(page.input_value("#top-k input[type=number]"))
    page.wait_for_function(
        f"document.querySelectorAll('#label-0 .confidence-set').length == {k}", timeout=10_000
    )
    rows = [page.locator(f"#label-{i} .confidence-set").count() for i in range(2)]
    return rows, k, page.inner_text("#status") == status


def _click_gallery_image(page, index: int) -> list[str]:
    """One click on a gallery image: the page shows it on the Upload tab and runs it."""
    page.locator("#samples button.thumbnail-item").nth(index).click()
    page.wait_for_function(
        "document.querySelector('#status').innerText.includes('56x56')"
        " && document.querySelector('#status').innerText.includes('one batch per model')",
        timeout=60_000,
    )
    selected = page.inner_text("[role=tab][aria-selected=true]").strip()
    assert selected == "Upload", selected
    return _shown_labels(page)


def _draw_and_run(page) -> str:
    """Open the Draw tab and draw one stroke at once (the page picks the brush), run,
    and return the status line."""
    page.get_by_role("tab", name="Draw").click()
    page.wait_for_selector("#sketch button[aria-label='Brush'].highlight", timeout=10_000)
    box = page.locator("#sketch canvas").first.bounding_box()
    x, y = box["x"] + 0.35 * box["width"], box["y"] + 0.3 * box["height"]
    page.mouse.move(x, y)
    page.mouse.down()
    for step in range(1, 16):
        page.mouse.move(x + 6 * step, y + 8 * step)
    page.mouse.up()
    page.click("#run")
    page.wait_for_function(
        "document.querySelector('#status').innerText.includes('280x280')"
        " && document.querySelector('#status').innerText.includes('one batch per model')",
        timeout=60_000,
    )
    return page.inner_text("#status")


def test_api_docs_render_offline(server):
    """/docs (Swagger UI) and /redoc render from the server's own files and show the API's
    title and its /v1 endpoints. Nothing leaves loopback: the one off-loopback address in
    them, ReDoc's "powered by" logo, is refused by the page's Content-Security-Policy in the
    browser, before any connection."""
    from playwright.sync_api import sync_playwright

    url, _ = server
    requested: list[str] = []
    failed: dict[str, str] = {}
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.on("request", lambda request: requested.append(request.url))
            page.on("requestfailed", lambda r: failed.update({r.url: r.failure or ""}))
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url + "/docs", wait_until="load")
            page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            page.wait_for_selector(".opblock-summary-path", timeout=30_000)
            title = page.inner_text(".swagger-ui .info .title")
            paths = page.eval_on_selector_all(
                ".opblock-summary-path", "els => els.map(e => e.innerText)"
            )
            page.screenshot(path=str(artifacts_dir() / "api_docs.png"))
            page.goto(url + "/redoc", wait_until="networkidle")
            page.wait_for_selector("h1", timeout=30_000)
            redoc_title = page.inner_text("h1")
        finally:
            browser.close()
    assert "rstcnn" in title and "rstcnn" in redoc_title
    assert any("/v1/classify" in p for p in paths) and any("/v1/stability" in p for p in paths)
    assert not errors, errors
    outside = [u for u in requested if urlparse(u).hostname not in ("127.0.0.1", None)]
    outside = [u for u in outside if not u.startswith(("data:", "blob:"))]
    assert all(failed.get(u) == "csp" for u in outside), (outside, failed)  # refused by the CSP
    assert len(outside) <= 1  # only ReDoc's logo


def test_a_link_runs_its_gallery_image_and_the_result_downloads_as_json(server):
    """/?sample=N opens the page on the N-th gallery image's result; the JSON file the page
    offers is the API's answer for that image."""
    from playwright.sync_api import sync_playwright

    url, samples = server
    expected = _api_labels(url, samples[2].path)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/?sample=3", wait_until="load")
            page.wait_for_function(
                "document.querySelector('#status')"
                " && document.querySelector('#status').innerText.includes('one batch per model')",
                timeout=90_000,
            )
            shown = _shown_labels(page)
            page.wait_for_selector("#sweep-json a[href]", timeout=30_000)
            href = page.eval_on_selector("#sweep-json a[href]", "a => a.href")
            plain = browser.new_page()
            plain.goto(url + "/?sample=99", wait_until="load")  # out of range: nothing runs
            plain.wait_for_selector("#run", timeout=30_000)
            plain.wait_for_timeout(1500)
            idle_status = plain.inner_text("#status")
        finally:
            browser.close()
    assert shown == expected
    body = httpx.get(href).json()
    assert [m["label"] for m in body["models"]] == expected
    assert body["batch_size"] == SPEC.batch_size
    assert "one batch per model" not in idle_status


def test_a_phone_sized_page_stacks_the_stability_panel(server):
    """At 390x844 the stacked panel replaces the wide one, fills the width, and the two
    models' labels do not overlap."""
    from playwright.sync_api import sync_playwright

    url, _ = server
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 390, "height": 844})
            page.goto(url + "/?sample=1", wait_until="load")
            page.wait_for_selector("#stability-plot-narrow img", state="visible", timeout=90_000)
            wide_visible = page.is_visible("#stability-plot")
            img = page.locator("#stability-plot-narrow img")
            natural = img.evaluate("i => [i.naturalWidth, i.naturalHeight]")
            shown = img.bounding_box()
            boxes = [page.locator(f"#label-{i}").bounding_box() for i in range(2)]
            page.wait_for_selector("#summary table", timeout=30_000)
            words = page.eval_on_selector_all(  # table cells on one line each, none broken
                "#summary th, #summary td",
                "cells => cells.filter(c => c.innerText.trim() && c.getClientRects().length"
                " && c.getBoundingClientRect().height > 2.2 * parseFloat(getComputedStyle(c)"
                ".lineHeight || 16)).length",
            )
            page.screenshot(path=str(artifacts_dir() / "web_app_390px.png"), full_page=True)
        finally:
            browser.close()
    assert not wide_visible
    assert words == 0  # no cell wraps onto a third line
    assert natural[1] > natural[0]  # three panels one above the other
    assert 250 <= shown["width"] <= 390
    first, second = boxes
    apart = (
        first["y"] + first["height"] <= second["y"] + 1
        or second["y"] + second["height"] <= first["y"] + 1
        or first["x"] + first["width"] <= second["x"] + 1
        or second["x"] + second["width"] <= first["x"] + 1
    )
    assert apart, boxes
