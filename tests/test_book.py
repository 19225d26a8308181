"""The book builds from the executed notebooks, and its notebook page shows its figure in a real browser."""

import re
import shutil

import pytest
from conftest import ROOT

from lpfa.book import toc_files

pytestmark = pytest.mark.slow


def test_book_contains_every_toc_page(built_book):
    for f in toc_files(ROOT):
        assert (built_book / f"{f}.html").is_file(), f
    page = (built_book / "notebooks" / "01_bf16_rounding.html").read_text()
    assert "BF16 rounding, bit by bit" in page
    assert "-4.71875" in page
    imgs = re.findall(r'<img[^>]+src="([^"]+\.png)"', page)
    assert imgs, "the notebook page has no figure"
    for src in imgs:
        png = (built_book / "notebooks" / src).resolve()
        assert png.is_file() and png.stat().st_size > 10_000


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("no Chromium found: `make browser` (or `apt-get install chromium`) installs Debian's")


def test_figure_renders_in_headless_chromium(built_book, tmp_path):
    from playwright.sync_api import sync_playwright

    page_path = built_book / "notebooks" / "01_bf16_rounding.html"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=_chromium(),
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(page_path.as_uri(), wait_until="load")
            imgs = page.locator("main img")
            assert imgs.count() >= 1
            for i in range(imgs.count()):
                img = imgs.nth(i)
                img.scroll_into_view_if_needed()
                natural = img.evaluate("el => [el.complete, el.naturalWidth, el.naturalHeight]")
                assert natural[0] and natural[1] > 200 and natural[2] > 200, natural
                box = img.bounding_box()
                assert box and box["width"] > 200 and box["height"] > 100, box
            shot = tmp_path / "figure.png"
            imgs.first.screenshot(path=str(shot))
            assert shot.stat().st_size > 5_000
            assert "BF16 rounding, bit by bit" in page.title()
        finally:
            browser.close()


def test_intro_scorecard_and_figure_widths_in_chromium(built_book):
    """The intro opens with the computed scorecard (a row per claim, each with a verdict and a link to its page), and
    every figure of every page renders at least 600 px wide in a 1280 px window (legible at page width)."""
    from playwright.sync_api import sync_playwright

    from lpfa.pages.intro import VERDICTS

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto((built_book / "book" / "intro.html").as_uri(), wait_until="load")
            rows = page.locator("table.scorecard tbody tr")
            assert rows.count() >= 8
            for i in range(rows.count()):
                cells = rows.nth(i).locator("td")
                assert cells.nth(3).inner_text().strip() in VERDICTS
                href = cells.nth(4).locator("a").get_attribute("href")
                assert (built_book / "book" / href).resolve().is_file(), href
            narrow = []
            for f in toc_files(ROOT):
                page.goto((built_book / f"{f}.html").as_uri(), wait_until="load")
                imgs = page.locator("main img")
                for i in range(imgs.count()):
                    imgs.nth(i).scroll_into_view_if_needed()
                    box = imgs.nth(i).bounding_box()
                    if box is None or box["width"] < 600:
                        narrow.append((f, i, box and round(box["width"])))
            assert not narrow, f"figures narrower than 600 px at a 1280 px window: {narrow}"
        finally:
            browser.close()


def test_notebook_page_has_launch_buttons_for_that_notebook(built_book):
    """A notebook page's rocket menu opens on click and offers Binder (JupyterLab), JupyterHub and Colab, each a link
    to that very notebook in _config.yml's repository (the one value); the setup cell is not on the page."""
    import urllib.parse

    import yaml
    from playwright.sync_api import sync_playwright

    from lpfa.publish import CLONE_DIR, github_parts, repository

    url, branch = repository(ROOT)
    owner, name = github_parts(url)
    launch = yaml.safe_load((ROOT / "_config.yml").read_text())["launch_buttons"]
    nb = "notebooks/01_bf16_rounding.ipynb"
    expected = {
        "Binder": f"{launch['binderhub_url']}/v2/gh/{owner}/{name}/{branch}?urlpath=lab/tree/{nb}",
        "Colab": f"{launch['colab_url']}/github/{owner}/{name}/blob/{branch}/{nb}",
    }
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto((built_book / nb.replace(".ipynb", ".html")).as_uri(), wait_until="load")
            menu = page.locator(".dropdown-launch-buttons")
            menu.locator("button").click()
            links = {}
            for i in range(menu.locator("a").count()):
                a = menu.locator("a").nth(i)
                assert a.is_visible()
                links[a.inner_text().strip()] = a.get_attribute("href")
            assert set(links) == {"Binder", "JupyterHub", "Colab"}, links
            for kind, href in expected.items():
                assert links[kind] == href, (kind, links[kind])
            hub = urllib.parse.urlsplit(links["JupyterHub"])
            query = urllib.parse.parse_qs(hub.query)
            assert f"{hub.scheme}://{hub.netloc}" == launch["jupyterhub_url"].rstrip("/")
            assert query == {"repo": [url], "branch": [branch], "urlpath": [f"lab/tree/{name}/{nb}"]}, query
            assert CLONE_DIR not in page.content()  # the setup cell is tagged remove-cell
        finally:
            browser.close()
