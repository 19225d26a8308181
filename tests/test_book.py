"""The book builds from the executed notebooks, and its notebook page shows its figure in a real browser."""

import json
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
    imgs = [src for src in re.findall(r'<img[^>]+src="([^"]+\.png)"', page)
            if "/_static/" not in src]  # the page's figures, not the theme's logos (launch buttons)
    assert imgs, "the notebook page has no figure"
    for src in imgs:
        png = (built_book / "notebooks" / src).resolve()
        assert png.is_file() and png.stat().st_size > 10_000


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("no Chromium found: `make browser` (or `apt-get install chromium`) installs Debian's")


# per page, in the browser: the text column's width, every table's width and body rows, every figure's rendered and
# natural width, and rendered text that still holds Markdown or MyST syntax (code spans left out)
_PAGE_JS = r"""() => {
  const article = document.querySelector('main article') || document.querySelector('main');
  const para = [...article.querySelectorAll('p')].find(p => p.getBoundingClientRect().width > 0);
  const column = para ? para.getBoundingClientRect().width : article.clientWidth;
  const tables = [...article.querySelectorAll('table')].map(t => ({
      width: t.getBoundingClientRect().width, rows: t.querySelectorAll('tbody tr').length,
      classes: t.className, head: (t.querySelector('thead') || t).innerText.slice(0, 60).replace(/\s+/g, ' ')}));
  const figures = [...article.querySelectorAll('img')].map(i => ({
      src: i.getAttribute('src'), width: i.getBoundingClientRect().width, natural: i.naturalWidth,
      complete: i.complete, height: i.getBoundingClientRect().height}));
  const texts = [...article.querySelectorAll('p, li, dd, dt, td, th, h1, h2, h3, h4, caption')].map(el => {
      const copy = el.cloneNode(true);
      copy.querySelectorAll('code, pre, .math, mjx-container').forEach(c => c.remove());
      return [el.tagName, copy.textContent.trim()];
  });
  return {column, tables, figures, texts};
}"""


def _png_text_px(png, rendered_width: float) -> float | None:
    """The smallest text of a figure as the page renders it, in CSS px: its size in pt (the PNG's
    :data:`lpfa.plotting.PNG_TEXT_KEY`, written when the notebook drew it) × its dpi / 72 (pixels of the PNG) × the
    rendered width over the PNG's width. None for a PNG without that key (not drawn through lpfa's style)."""
    from PIL import Image

    from lpfa.plotting import PNG_TEXT_KEY

    with Image.open(png) as im:
        if PNG_TEXT_KEY not in im.info:
            return None
        return float(im.info[PNG_TEXT_KEY]) * float(im.info["lpfa:dpi"]) / 72 * rendered_width / im.width


def _png_figure_problems(png) -> list[str]:
    """What :func:`lpfa.plotting.figure_problems` found in a figure when the notebook drew it (a repeated colour in a
    panel, fractional ticks on a whole-number axis), from the PNG's :data:`lpfa.plotting.PNG_PROBLEMS_KEY`."""
    from PIL import Image

    from lpfa.plotting import PNG_PROBLEMS_KEY

    with Image.open(png) as im:
        return json.loads(im.info.get(PNG_PROBLEMS_KEY, '["drawn without lpfa.plotting\'s checks"]'))


MIN_FIGURE_PX = 600  # a figure renders at least this wide at a 1280 px window
MIN_TEXT_PX = 12  # and its smallest text at least this tall, in CSS px: 9 pt (lpfa.plotting.MIN_TEXT_PT)
MAX_BODY_ROWS = 20  # lpfa.plotting.MAX_ROWS: a longer table is a summary with a CSV beside it


def test_every_page_in_chromium(built_book, tmp_path):
    """One Chromium session at a 1280 px window over every page of the book: the intro's scorecard has a row per claim
    with a verdict and a link to its page; on every page no rendered text holds a literal `{doc}`, `{glue`, `**` or a
    paragraph starting "* " (Markdown that did not render); every table went through lpfa.plotting.format_table, fits
    the text column and has at most MAX_BODY_ROWS body rows; every figure loads, renders at least MIN_FIGURE_PX wide
    and its smallest text at least MIN_TEXT_PX tall (:func:`_png_text_px`); no panel repeats a colour in its legend
    and no whole-number axis has fractional ticks (:func:`_png_figure_problems`)."""
    from playwright.sync_api import sync_playwright

    from lpfa.pages.intro import VERDICTS
    from lpfa.plotting import MAX_ROWS, TABLE_CLASS

    assert MAX_ROWS == MAX_BODY_ROWS
    problems, n_tables, n_figures, widest, tallest = [], 0, 0, 0.0, 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run",
                                          "--disable-quic"])
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
            for f in toc_files(ROOT):
                html = built_book / f"{f}.html"
                page.goto(html.as_uri(), wait_until="load")
                page.evaluate("window.scrollTo(0, document.body.scrollHeight)")  # lazy images load
                page.wait_for_load_state("load")
                r = page.evaluate(_PAGE_JS)
                for tag, text in r["texts"]:
                    for bad in ("{doc}", "{glue", "**"):
                        if bad in text:
                            problems.append(f"{f}: {tag} holds {bad!r}: {text[:80]!r}")
                    if tag == "P" and text.startswith("* "):
                        problems.append(f"{f}: a paragraph starts with '* ': {text[:80]!r}")
                for t in r["tables"]:
                    n_tables += 1
                    widest, tallest = max(widest, t["width"]), max(tallest, t["rows"])
                    if TABLE_CLASS not in t["classes"].split():
                        problems.append(f"{f}: table {t['head']!r} did not go through format_table")
                    if t["width"] > r["column"] + 1:
                        problems.append(f"{f}: table {t['head']!r} is {t['width']:.0f} px wide, the column "
                                        f"{r['column']:.0f}")
                    if t["rows"] > MAX_BODY_ROWS:
                        problems.append(f"{f}: table {t['head']!r} has {t['rows']} body rows")
                for g in r["figures"]:
                    n_figures += 1
                    if not (g["complete"] and g["natural"] > 200 and g["height"] > 100):
                        problems.append(f"{f}: figure {g['src']} did not load ({g})")
                        continue
                    if g["width"] < MIN_FIGURE_PX:
                        problems.append(f"{f}: figure {g['src']} renders {g['width']:.0f} px wide")
                    png = (html.parent / g["src"]).resolve()
                    text_px = _png_text_px(png, g["width"])
                    if text_px is None or text_px < MIN_TEXT_PX:
                        problems.append(f"{f}: figure {g['src']}'s smallest text renders at "
                                        f"{text_px and round(text_px, 1)} px")
                    problems += [f"{f}: figure {g['src']}, {p}" for p in _png_figure_problems(png)]
            first = page.locator("main article img").first  # the last page's first figure, as a reader sees it
            first.scroll_into_view_if_needed()
            shot = tmp_path / "figure.png"
            first.screenshot(path=str(shot))
            assert shot.stat().st_size > 5_000
        finally:
            browser.close()
    assert n_tables >= 30 and n_figures >= 30, (n_tables, n_figures)
    assert not problems, (f"{len(problems)} problems (widest table {widest:.0f} px, longest {tallest} rows):\n"
                          + "\n".join(problems))


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
