"""The book's build, without building it: the default profile trains nothing (pages 05 and 13 read the committed CPU
run), the kernels get their share of the cores, the progress bar names the notebooks running, and a failed notebook
leaves its log."""

import pytest
from conftest import ROOT

from lpfa import book


def test_running_postfix_names_each_running_notebook_longest_first():
    assert book.running_postfix({"05_structure": 100.0, "13_training": 10.0}, now=161.0) == \
        "13_training 2:31, 05_structure 1:01"
    assert book.running_postfix({}, now=5.0) == ""
    assert book.running_postfix({"intro": 0.0}, now=3_725.9) == "intro 62:05"


def test_kernel_threads_share_the_cores():
    assert book.kernel_threads(jobs=2, cores=2) == 1  # two kernels on two cores: one thread each, not two
    assert book.kernel_threads(jobs=2, cores=16) == 8
    assert book.kernel_threads(jobs=4, cores=2) == 1  # never 0
    assert 1 <= book.cpu_cores() <= (__import__("os").cpu_count() or 1)


def test_limit_threads_sets_what_torch_and_blas_read(monkeypatch):
    for var in book.THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    book._limit_threads(3)
    import os

    assert {os.environ[v] for v in book.THREAD_VARS} == {"3"} and "OMP_NUM_THREADS" in book.THREAD_VARS


def test_a_failed_notebook_keeps_its_log_and_partial_copy(tmp_path, monkeypatch):
    src, dst = ROOT / "notebooks" / "13_training.ipynb", tmp_path / "stage" / "13.ipynb"
    log = tmp_path / "logs" / "x.log"

    def fails(s, d, parameters=None):
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_text("{}")  # what papermill leaves: the copy executed up to the failing cell
        raise ValueError("max_steps=0: expected an int >= 1")

    monkeypatch.setattr(book, "execute_notebook", fails)
    with pytest.raises(RuntimeError, match=r"13_training.ipynb failed: ValueError: max_steps=0") as e:
        book._execute_logged(src, dst, {"max_steps": 0}, log)
    assert str(log) in str(e.value)
    text = log.read_text()
    assert "parameters {'max_steps': 0}" in text and "ValueError: max_steps=0" in text and "Traceback" in text
    assert log.with_suffix(".ipynb").read_text() == "{}"


def test_default_profile_trains_nothing_on_pages_05_and_13(monkeypatch):
    """The default parameters of pages 05 and 13 select the committed CPU run (results/cpu_smoke): the page modules
    called as the book calls them, with training made to fail, read it; with train=True they would train."""
    from lpfa.pages import structure as ps
    from lpfa.pages import training as tr

    def no_training(*a, **k):
        raise AssertionError("the default profile trained a model")

    monkeypatch.setattr(tr, "train_smoke", no_training)
    monkeypatch.setattr(ps, "load_model", no_training)
    p13 = book.notebook_parameters(ROOT / "notebooks" / "13_training.ipynb")
    assert p13["train"] is False
    out, summary, where = tr.smoke_run(p13["train"], p13["preset"], p13["max_steps"], p13["attn_policy"],
                                       p13["diag_interval"], p13["out_dir"])
    assert out == tr.committed_smoke() and summary["steps"] == p13["max_steps"]  # the run page 13 would train
    prov = __import__("json").loads((out.parent / "provenance.json").read_text())
    assert f"committed run `{out.parent.name}`" in where and f"{prov['torch_threads']} torch thread" in where
    p05 = book.notebook_parameters(ROOT / "notebooks" / "05_structure.ipynb")
    assert not (p05["hf_gpt2"] or p05["checkpoint"] or p05["train"])
    summary, texts = ps.model_summary(p05["hf_gpt2"], p05["checkpoint"], p05["train"], p05["train_steps"],
                                      p05["n_seqs"], p05["seq_len"], p05["eps"], p05["seed"])
    assert summary["batch"] == [p05["n_seqs"], p05["seq_len"]] and "committed run" in texts["model_source"]
    with pytest.raises(AssertionError, match="trained a model"):  # the switch does train
        tr.smoke_run(True)
    with pytest.raises(AssertionError, match="trained a model"):
        ps.model_summary(train=True)
    small = book.notebook_parameters(ROOT / "notebooks" / "13_training.ipynb", "small")
    assert small["train"] is True  # the tests' small profile still trains on the CPU, briefly
