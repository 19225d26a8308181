"""Every notebook of the book runs under papermill at the `small` profile, without errors, and shows its figures."""

import base64
import re
import struct

import nbformat
import pytest
from conftest import ROOT

from lpfa.book import execute_notebook, profile_parameters, toc_notebooks

NOTEBOOKS = toc_notebooks(ROOT)
SMALL = profile_parameters(ROOT, "small")


def test_every_notebook_is_in_the_book_and_has_small_parameters():
    on_disk = sorted(p.name for d in ("book", "notebooks") for p in (ROOT / d).glob("*.ipynb"))
    assert sorted(p.name for p in NOTEBOOKS) == on_disk
    for nb in NOTEBOOKS:
        assert nb.stem in SMALL, f"notebooks/parameters.yml has no small profile for {nb.stem}"
        cells = nbformat.read(nb, as_version=4).cells
        assert any("parameters" in c.metadata.get("tags", []) for c in cells), f"{nb.name}: no 'parameters' cell"
        assert all(not c.get("outputs") for c in cells if c.cell_type == "code"), f"{nb.name} is stored with outputs"


def _png_size(b64: str) -> tuple[int, int]:
    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", raw[16:24])


def test_papermill_reads_every_parameter():
    """papermill parses each line of the parameters cell (else it warns 'Passed unknown parameter' on the build's
    console)."""
    import ast

    from papermill.translators import PythonTranslator

    for nb in NOTEBOOKS:
        cell = next(c for c in nbformat.read(nb, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
        names = {t.id for node in ast.parse(cell.source).body
                 if isinstance(node, ast.Assign) for t in ast.walk(node.targets[0])
                 if isinstance(t, ast.Name)}
        assert {p.name for p in PythonTranslator.inspect(cell)} == names, nb.name


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_small_parameters(nb, executed_notebook):
    done = nbformat.read(executed_notebook(nb), as_version=4)
    outputs = [o for c in done.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [o.data["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert pngs, f"{nb.name} produced no figure"
    for png in pngs:
        w, h = _png_size(png)
        assert w > 200 and h > 200


REPRS = ("<matplotlib", "<Axes", "Text(", "<Figure size")  # a plotting call's return value printed on the page


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_page_shows_no_log_and_no_repr(nb, executed_notebook):
    """No stderr box (training logs, progress bars, warnings) and no stray object repr on the rendered page: the
    notebook run by test_notebook_runs_with_small_parameters, checked here."""
    done = nbformat.read(executed_notebook(nb), as_version=4)
    for i, cell in enumerate(done.cells):
        for o in cell.get("outputs", []):
            assert not (o.output_type == "stream" and o.name == "stderr"), \
                f"{nb.name} (executed) cell {i} writes to stderr: {o.text[:200]!r}"
            data = o.get("data", {})
            if "text/plain" in data and "image/png" not in data:  # a figure's own text/plain sits beside its image
                assert not any(r in data["text/plain"] for r in REPRS), \
                    f"{nb.name} (executed) cell {i} shows {data['text/plain'][:100]!r}"


GLUE_REF = re.compile(r"\{glue(?::\w+)?\}`([^`]+)`|```\{glue(?::\w+)?\}\s+(\S+)")  # {glue:md}`name`, ```{glue:md} name


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_name_the_prose_shows_is_glued(nb, executed_notebook):
    """Each ``{glue:md}`name``` of a page's Markdown is glued by its code (a name a page-text dict lost would show
    as an empty span in the book)."""
    done = nbformat.read(executed_notebook(nb), as_version=4)
    shown = {a or b for c in done.cells if c.cell_type == "markdown" for a, b in GLUE_REF.findall(c.source)}
    glued = {o["metadata"]["scrapbook"]["name"] for c in done.cells if c.cell_type == "code"
             for o in c.get("outputs", []) if "scrapbook" in o.get("metadata", {})}
    assert shown <= glued, f"{nb.name}: not glued: {sorted(shown - glued)}"


# a verdict a page states on a figure of the paper: "Fig. 2 is partly reproduced", "**Fig. 3: reproduced.**"
STATED_VERDICT = re.compile(r"(Fig\. \d+[a-z]?)(?: is|:) (partly reproduced|not reproduced|reproduced|not run here)\b")


@pytest.fixture(scope="module")
def scorecard_card():
    from lpfa.pages.intro import scorecard

    return scorecard()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_pages_state_the_scorecards_verdicts(nb, executed_notebook, scorecard_card):
    """A page that the scorecard links to shows its rows (the glued ``scorecard_note``, with each row's verdict), and
    no page states a verdict on a figure of the paper that differs from the scorecard's."""
    from lpfa.pages import VERDICT_WORDS

    text = _text(executed_notebook(nb))
    rows = scorecard_card[scorecard_card.page == nb.stem]
    for row in rows.itertuples():
        assert f"{row.paper[0].upper() + row.paper[1:]}: {VERDICT_WORDS[row.verdict]}.**" in text, \
            f"{nb.name} does not show the scorecard's {row.paper} row"
    verdict_of = {row.paper: VERDICT_WORDS[row.verdict] for row in scorecard_card.itertuples()}
    for paper, said in STATED_VERDICT.findall(text):
        if paper in verdict_of:
            assert said == verdict_of[paper], f"{nb.name} says {paper} is {said}; the scorecard: {verdict_of[paper]}"


def test_bf16_notebook_reproduces_the_paper_example(executed_notebook):
    nb = ROOT / "notebooks" / "01_bf16_rounding.ipynb"
    out = executed_notebook(nb)  # at the small profile, which keeps the paper's operands
    text = _text(out) + "\n".join(str(o.get("data", {}).get("text/html", ""))  # the glued text too (its Markdown)
                                   for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"
                                   for o in c.outputs)
    assert "-4.703990459442139" in text and "-4.71875" in text and "-0.014759540557861328" in text
    assert "guard 1 | round 0 | sticky 1" in text
    assert "The significand overflowed (|a| and |b| both lie in [2, 4), and both are negative)" in text
    assert "paper's example" in text and "your operands" not in text


def test_papermill_parameters_override(tmp_path):
    nb = ROOT / "notebooks" / "01_bf16_rounding.ipynb"
    params = {**SMALL["01_bf16_rounding"], "a": -1.5, "b": -1.25}
    out = execute_notebook(nb, tmp_path / nb.name, params)
    text = str(nbformat.read(out, as_version=4).cells)
    assert "-2.75" in text  # -1.5 + -1.25, exact in BF16
    shown = _text(out)  # the generated text follows the operands given, not the paper's
    assert "The significand overflowed (|a| and |b| both lie in [1, 2), and both are negative)" in shown
    assert "the bits beyond BF16's precision are all zero: the sum is exact in BF16" in shown
    assert "your operands" in shown and "paper's example" not in shown and "[2, 4)" not in shown


def _text(nb_path) -> str:
    """The text a page's code cells put out, values glued for its Markdown (myst-nb glue: papermill.record mimes) and
    its tables (HTML: lpfa.plotting.format_table's Stylers have no text form) included."""
    return "\n".join(
        str(o.get("text", ""))
        + "".join(str(v) for k, v in o.get("data", {}).items() if k.endswith(("text/plain", "text/markdown",
                                                                               "text/html")))
        for c in nbformat.read(nb_path, as_version=4).cells if c.cell_type == "code" for o in c.outputs)


def test_isolation_and_seeds_pages(tmp_path, monkeypatch, executed_notebook):
    """Pages 10 and 11 on the committed results (the verdicts and the comparison with the paper are computed there),
    and their 'not run yet' branches on a stand-in results tree without them (LPFA_ROOT points the pages at it)."""
    iso = _text(executed_notebook(ROOT / "notebooks" / "10_isolation.ipynb"))  # small profile: the defaults
    assert "* **loss exploded**: `delta_o_exact` (step 1,995)" in iso
    assert "* **logits ran away**: `scores_fp32` (step 7,600)" in iso
    assert ("* **neither**: `bf16` (its logit apart from step 7,300), `fp32`, `bf16_only_layer1` (its logit apart "
            "from step 6,800)" in iso)
    assert "it reports `bf16`, `bf16_only_layer1` exploding, and here neither their loss exploded" in iso
    assert ("in every head' predicts that the logits run away or the loss explodes**: it fits 5 of 12 rows; not "
            "`bf16` (layer 1 scores bf16, neither)" in iso)
    assert "**The unchanged `bf16` row itself** neither exploded nor had its logits run away" in iso
    # a second launch
    assert "for `delta_o_fp32`, `o_fp32`, `scores_fp32` the `fp32` row of run `h200x4-2026-11-29`" in iso
    assert "**Running away without ties**: `scores_fp32` (at most 0.032, largest logit 2,226)" in iso
    # glued; the page's Markdown adds the full stop
    assert "the row neither exploded nor had its logits run away, as the paper reports" in iso
    assert "**Not run yet**: `bf16_tiled`." in iso
    seeds = _text(executed_notebook(ROOT / "notebooks" / "11_seeds.ipynb"))
    assert ("* **bf16**: of 5 runs, the loss exploded in 0 and the logits ran away in 3 (steps 6,400 to 7,600); the "
            "logit parted from the FP32 twin's, or worse, in 5" in seeds)
    assert ("* **fp32**: of 5 runs, the loss exploded in 0 and the logits ran away in 0; the logit parted from the "
            "FP32 twin's, or worse, in 0" in seeds)
    assert "Not run yet" not in seeds

    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    (root / "_toc.yml").write_text("format: jb-book\n")
    res = root / "results"
    res.mkdir()
    for exp in ("repro_pair", "repro_twins", "compile_throughput"):
        (res / exp).symlink_to(ROOT / "results" / exp)
    monkeypatch.setenv("LPFA_ROOT", str(root))
    iso = _text(execute_notebook(ROOT / "notebooks" / "10_isolation.ipynb", tmp_path / "10b.ipynb"))
    assert "**Not run yet**: `bf16`, `fp32`, `bf16_tiled`, `bf16_only_layer1`" in iso
    assert "Measured" not in iso.split("delta_formulas")[0]
    seeds = _text(execute_notebook(ROOT / "notebooks" / "11_seeds.ipynb", tmp_path / "11b.ipynb"))
    assert "**Not run yet**: only seed 1337 is in the table" in seeds
    assert "* **bf16**: of 1 run, the loss exploded in 0 and the logits ran away in 1" in seeds


def test_sfa_page_muon_and_sizes(tmp_path, monkeypatch, executed_notebook):
    """Page 09's Muon and second-size sections on the committed results (verdicts computed there), and their
    'not run yet' branch with its cost on a results tree without them."""
    sfa = _text(executed_notebook(ROOT / "notebooks" / "09_sfa.ipynb"))  # small profile: the defaults
    assert ("the BF16 run did not explode, but its layer-1 logits ran away from step 1,600; the FP32 run neither "
            "exploded nor had its logits run away; "
            "the SFA run neither exploded nor had its logits run away") in sfa
    assert "from step 1,400 with Muon against 7,300 with AdamW" in sfa
    assert "At β = 2 it silenced between 21.5% and 24.9% of layer 1's rows" in sfa
    assert ("the BF16 run exploded at step 1,296 (its logits ran away in layer 6 from step 800); the FP32 run exploded "
            "at step 1,609" in sfa)
    assert "Both precisions explode" in sfa and "Not run yet" not in sfa
    assert ("At Muon lr 0.05 (3,003–3,119 steps), the BF16 run exploded at step 932; the FP32 run exploded at step "
            "1,314" in sfa)
    # results/muon_long trained fewer steps than results/sfa_muon
    assert "a second realisation of the same twins" in sfa
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    (root / "_toc.yml").write_text("format: jb-book\n")
    (root / "results").mkdir()
    for exp in ("repro_pair", "repro_twins", "compile_throughput"):
        (root / "results" / exp).symlink_to(ROOT / "results" / exp)
    monkeypatch.setenv("LPFA_ROOT", str(root))
    sfa = _text(execute_notebook(ROOT / "notebooks" / "09_sfa.ipynb", tmp_path / "09b.ipynb"))
    assert "**Not run yet** (`sfa_muon`: `bf16_muon`, `fp32_muon`, `sfa_muon`)" in sfa
    assert "**Not run yet** (`sizes`" in sfa
    assert "With Muon** (" not in sfa
    assert "The Muon twins at lr 0.05 (`lpfa.experiments.MUON_LONG`) are not run yet." in sfa


def test_structure_page_on_committed_gpu_results(executed_notebook):
    """Page 05's GPU sections: the logged ties of the 30k twins, the replay's rank-1 similarity and the structure
    statistics of the GPU-trained checkpoints (results/structure, results/repro_runaway), computed on the page."""
    nb = ROOT / "notebooks" / "05_structure.ipynb"
    text = _text(executed_notebook(nb))
    assert ("`bf16` at step 30,100: 7.2% of rows tied on average over layers and heads, 83.4% in its most tied head "
            "(layer 1, head 6)" in text)
    # the replay from before the runaway
    assert "head 5: median 0.99 within a step, 0.98 across 6000→6499" in text
    assert "`structure/fp32` (`sdpa_fp32`) at step 4,179" in text
    assert "the median cosine similarity between tokens' rank-1 matrices is **0.29**" in text
    assert "`structure/fp32` at step 4,179: 18-fold (0.12% → 2.3% on average" in text and "Not run yet" not in text
    # the eager twins at step 6,500 (results/repro_runaway): the BF16-trained model against its FP32 twin
    assert "`repro_runaway/fp32` at step 6,500: 15-fold" in text
    assert "with BF16 scores 76% of the rows of its most tied head (layer 1, head 5) are tied" in text
    assert ("the FP32 twin at the same step: 7.1% in its most tied head and 0.40. In this pair of runs, training "
            "with BF16 attention built both" in text)


def test_tie_frequency_page_shows_v_sign_dominance(executed_notebook):
    """Page 08's V section on the committed eager twins (results/repro_runaway), which log it with their diagnostics."""
    nb = ROOT / "notebooks" / "08_tie_frequency.ipynb"
    text = _text(executed_notebook(nb))
    assert ("**bf16** at step 6,500: 1.9% of V's columns one-signed on average over layers and heads, 6.5% in layer "
            "1" in text)
    assert "5.9% over the run's second half" in text and "4.2% over the run's second half" in text
    assert "**fp32** at step 6,500: 1.6% of V's columns one-signed" in text
    assert ("over the second half of the runs, the BF16 run has 1.4 times the FP32 twin's share of one-signed V "
            "columns: within 1.5× of each other, too close in one run pair" in text)
    assert "Not logged" not in text


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_rendered_pages_hold_no_widget(nb, executed_notebook):
    """The book's kernels run static (lpfa.widgets): a page with a widget cell shows its figure drawn once and the line
    saying where the controls live, and embeds no widget state."""
    from lpfa.widgets import NOTE

    source = nbformat.read(nb, as_version=4)
    widget_cells = [c for c in source.cells if c.cell_type == "code" and re.search(r"explore[rs]?\(", c.source)]
    done = nbformat.read(executed_notebook(nb), as_version=4)
    outputs = [o for c in done.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert "widgets" not in done.metadata
    notes = [o for o in outputs if NOTE in o.get("data", {}).get("text/markdown", "")]
    assert len(notes) == len(widget_cells), nb.name
