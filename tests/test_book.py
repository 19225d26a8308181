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
