"""Every notebook of the book runs under papermill at the `small` profile, without errors, and shows its figures."""

import base64
import struct

import nbformat
import pytest

from lpfa.book import execute_notebook, profile_parameters, toc_notebooks

from conftest import ROOT

NOTEBOOKS = toc_notebooks(ROOT)
SMALL = profile_parameters(ROOT, "small")


def test_every_notebook_is_in_the_book_and_has_small_parameters():
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
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


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_small_parameters(nb, tmp_path):
    out = execute_notebook(nb, tmp_path / nb.name, SMALL.get(nb.stem))
    done = nbformat.read(out, as_version=4)
    outputs = [o for c in done.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [o.data["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert pngs, f"{nb.name} produced no figure"
    for png in pngs:
        w, h = _png_size(png)
        assert w > 200 and h > 200


def test_bf16_notebook_reproduces_the_paper_example(tmp_path):
    nb = ROOT / "notebooks" / "01_bf16_rounding.ipynb"
    out = execute_notebook(nb, tmp_path / nb.name, SMALL["01_bf16_rounding"])
    text = "\n".join(
        str(o.get("text", "")) + "".join(str(o.get("data", {}).get(k, "")) for k in ("text/plain", "text/html", "text/markdown"))
        for c in nbformat.read(out, as_version=4).cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert "-4.703990459442139" in text and "-4.71875" in text and "-0.014759540557861328" in text
    assert "guard 1 | round 0 | sticky 1" in text


def test_papermill_parameters_override(tmp_path):
    nb = ROOT / "notebooks" / "01_bf16_rounding.ipynb"
    params = {**SMALL["01_bf16_rounding"], "a": -1.5, "b": -1.25}
    out = execute_notebook(nb, tmp_path / nb.name, params)
    text = str(nbformat.read(out, as_version=4).cells)
    assert "-2.75" in text  # -1.5 + -1.25, exact in BF16


def _text(nb_path) -> str:
    return "\n".join(
        str(o.get("text", "")) + "".join(str(o.get("data", {}).get(k, "")) for k in ("text/plain", "text/markdown"))
        for c in nbformat.read(nb_path, as_version=4).cells if c.cell_type == "code" for o in c.outputs)


def test_isolation_and_seeds_pages_with_results(tmp_path, monkeypatch):
    """Pages 14 and 15 render their results branch once an experiment folder exists (here a stand-in built
    from the committed twins: LPFA_ROOT points the pages at it)."""
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    (root / "_toc.yml").write_text("format: jb-book\n")
    res = root / "results"
    res.mkdir()
    for exp in ("repro_pair", "repro_twins", "compile_throughput"):
        (res / exp).symlink_to(ROOT / "results" / exp)
    pair, twins = ROOT / "results/repro_pair/h200x2-2026-11-29", ROOT / "results/repro_twins/h200-2026-11-29"
    for exp, rows in {"isolation": {"bf16": pair / "bf16", "fp32": pair / "fp32", "pv_fp32": twins / "sfa"},
                      "seeds": {"bf16_s1": twins / "bf16", "fp32_s1": twins / "fp32"}}.items():
        d = res / exp / "h200-test"
        d.mkdir(parents=True)
        for label, src in rows.items():
            (d / label).symlink_to(src)
    monkeypatch.setenv("LPFA_ROOT", str(root))
    iso = _text(execute_notebook(ROOT / "notebooks" / "14_isolation.ipynb", tmp_path / "14.ipynb"))
    assert "Not run yet" not in iso and "Precursors at step 7,300" in iso
    assert "ran away" in iso and "pv_fp32" in iso and "P̄V accumulated and kept in FP32" in iso
    seeds = _text(execute_notebook(ROOT / "notebooks" / "15_seeds.ipynb", tmp_path / "15.ipynb"))
    assert "Not run yet" not in seeds and "bf16_s1" in seeds
    assert "**bf16**: 2 of 2 seeds ran away (steps 6,400 to 6,400), 0 exploded" in seeds
    assert "**fp32**: 0 of 2 seeds ran away" in seeds
