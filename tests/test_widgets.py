"""The book's widgets (lpfa.widgets): drawn once with a one-line note on a static page (the book build, the notebook
tests), an ipywidgets control over the same update function where a reader has a kernel; and each page's update
function called directly on the committed data: a figure or text for a good value, a one-line error naming a bad one."""

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from lpfa.experiments import MECHANISM_REPLAY
from lpfa.widgets import NOTE, STATIC_ENV, interactive_or_static, is_static  # noqa: E402


@pytest.fixture
def shown(monkeypatch):
    """What reaches the page: ("figure", its line count) per plt.show, ("display", object) per display call."""
    import IPython.display

    out = []
    monkeypatch.setattr(plt, "show", lambda *a, **k: out.append(("figure", len(plt.gca().get_lines()))))
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **k: out.extend(("display", o) for o in objs))
    yield out
    plt.close("all")


def _line(x):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, x])
    return fig


def test_static_branch_draws_once_and_shows_the_note_without_a_widget(monkeypatch, shown):
    monkeypatch.setenv(STATIC_ENV, "1")
    assert is_static()
    calls = []

    def controls():
        raise AssertionError("no widget may be created on a static page")

    def update(x):
        calls.append(x)
        return _line(x), "a **sentence**"

    assert interactive_or_static(update, controls, {"x": 3}) is None
    assert calls == [3]
    assert shown[0] == ("figure", 1)
    assert [o.data for kind, o in shown[1:]] == ["a **sentence**", f"*{NOTE}*"]
    assert "make lab" in NOTE and len(NOTE.splitlines()) == 1


def test_static_branch_without_static_args_shows_only_the_note(monkeypatch, shown):
    monkeypatch.setenv(STATIC_ENV, "1")
    assert interactive_or_static(lambda x: pytest.fail("drawn"), {}, None) is None
    assert [o.data for _, o in shown] == [f"*{NOTE}*"]


def test_live_branch_returns_a_widget_whose_update_draws(monkeypatch, shown):
    import ipywidgets as w

    monkeypatch.delenv(STATIC_ENV, raising=False)
    assert not is_static()
    monkeypatch.setenv(STATIC_ENV, "0")
    assert not is_static()
    widget = interactive_or_static(_line, lambda: {"x": w.IntSlider(value=2, min=0, max=5)}, {"x": 2})
    assert isinstance(widget, w.interactive) and widget.children[0].description == "x"
    shown.clear()
    widget.children[0].value = 4
    assert shown == [("figure", 1)]
    with pytest.raises(ValueError, match=r"static_args \['y'\]"):
        interactive_or_static(_line, lambda: {"x": w.IntSlider()}, {"y": 1})


def test_explorer_is_static_in_the_book(tmp_path, monkeypatch, shown):
    from conftest import write_diag_run

    from lpfa.compare import explorer

    monkeypatch.setenv(STATIC_ENV, "1")
    runs = {"bf16": write_diag_run(tmp_path, "bf16", [1.0, 5.0, 9.0], [0.0] * 3, [1.0, 2.0, 3.0])}
    assert explorer(runs, "wq_spectral_norm") is None
    assert shown[0] == ("figure", 3) and shown[-1][1].data == f"*{NOTE}*"


def test_book_kernels_run_static(tmp_path):
    """The book build's kernels (lpfa.book.execute_notebook) see STATIC_ENV: their pages get static figures."""
    import nbformat

    from lpfa.book import execute_notebook

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from lpfa.widgets import is_static\nprint('static', is_static())")])
    src = tmp_path / "probe.ipynb"
    nbformat.write(nb, src)
    out = nbformat.read(execute_notebook(src, tmp_path / "out.ipynb", timeout_s=120), as_version=4)
    assert "static True" in out.cells[0].outputs[0]["text"]


# ---------------------------------------------------------------------------------------------------------------
# each page's update function


def test_addition_view_explains_the_readers_operands():
    from lpfa.pages import bf16_rounding as br

    r, text = br.addition_view(1.0, 2.0**-9)
    assert r.result == 1.0 and "rounded down" in text
    r, text = br.addition_view(-2.4071154594421387, -2.296875)
    assert r.result == -4.71875 and "rounded **up**" in text
    with pytest.raises(ValueError, match=r"^a='x': expected") as e:
        br.addition_view("x", 1.0)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^b=1e\+39"):
        br.addition_view(1.0, 1e39)


def test_dose_view_picks_out_the_runs_and_the_prediction_at_k():
    from lpfa.dose import predict
    from lpfa.pages import loss_explosion as le

    _, table, fits = le.dose_ladder()
    fit = fits["explosion step"]
    fig, text = le.dose_view(table, fit, 64)
    assert isinstance(fig, Figure) and fig.axes[0].get_title() == "dose k = 64"
    n64 = int((table["k"] == 64).sum())
    assert f"{n64} runs: " in text and "bias_x64_s1" in text and "within its doses" in text
    assert f"step {predict(fit, 64)[0]:,.0f}" in text
    _, text = le.dose_view(table, fit, 1.0)
    assert "extrapolated beyond" in text and "its loss did not explode by step" in text
    for bad in (0, -1.0, float("nan"), "64", True):
        with pytest.raises(ValueError, match=r"^k=.*: expected a positive dose"):
            le.dose_view(table, fit, bad)
    assert le.dose_explorer(None, None) is None
    plt.close("all")


def test_beta_view_shows_the_chosen_betas_shares():
    from lpfa.pages import sfa

    runs = sfa.twin_runs("repro_twins", None, {"bf16": "bf16", "sfa": "sfa", "fp32": "fp32"})
    frames = sfa.sweep_frames(sfa.sweeps_of(runs))
    fig, styler = sfa.beta_view(frames, 1, 2)
    assert len(fig.axes) == len(frames) and "β = 2" in fig.axes[0].get_title()
    assert all(len(ax.get_lines()) == len(sfa.SWEPT) for ax in fig.axes)
    last = sfa.last_sweep_table(frames, 1).xs(2.0, level="beta")
    html = styler.to_html()  # the chosen β's last-checkpoint shares, as the page's one formatter shows them
    assert all(f"{v:.1%}" in html for v in last.to_numpy().ravel())
    with pytest.raises(ValueError, match=r"^beta=3\.0: expected a β of the sweeps, one of 1\.5, 2, 4, 8$"):
        sfa.beta_view(frames, 1, 3.0)
    with pytest.raises(ValueError, match=r"^layer=99"):
        sfa.beta_view(frames, 99, 2.0)
    assert sfa.beta_explorer({}, 1) is None
    plt.close("all")


@pytest.fixture(scope="module")
def replay():
    from lpfa.pages.delta_bias import open_replay

    _, result, arrays = open_replay("mechanism", None, MECHANISM_REPLAY)
    return result, arrays


def test_replay_step_views_draw_any_detail_step(replay):
    from lpfa.pages import delta_bias as db
    from lpfa.pages import pktx_structure as pk
    from lpfa.pages import pv_error as pv
    from lpfa.replay import detail_steps

    result, arrays = replay
    head = int(result["heads"][-1])
    step = detail_steps(arrays, head)[-1]
    for view in (db.worst_token_view, pk.rank1_view, pv.pv_error_view):
        fig = view(result, arrays, head, step)
        assert isinstance(fig, Figure) and f"head {head}, step {step}" in fig.texts[0].get_text(), view.__name__
        with pytest.raises(ValueError, match=r"^head=999: expected a head this replay measured"):
            view(result, arrays, 999, step)
        with pytest.raises(ValueError, match=rf"^head {head}, step=1: expected a step this replay measured"):
            view(result, arrays, head, 1)
        plt.close("all")


def test_step_explorer_static_and_live(replay, monkeypatch, shown):
    from lpfa.pages import delta_bias as db
    from lpfa.replay import detail_steps

    result, arrays = replay
    drawn = []

    def view(result_, arrays_, head, step):
        drawn.append((head, step))

    monkeypatch.setenv(STATIC_ENV, "1")
    first = int(result["heads"][0])
    assert db.step_explorer(result, arrays, view) is None
    assert drawn == [(first, detail_steps(arrays, first)[-1])]
    assert db.step_explorer(result, arrays, view, static=False) is None and len(drawn) == 1
    monkeypatch.delenv(STATIC_ENV)
    widget = db.step_explorer(result, arrays, view)
    head_menu, slider = widget.children[:2]
    assert list(head_menu.options) == [int(h) for h in result["heads"]]
    slider.value = slider.options[0]
    assert drawn[-1] == (first, detail_steps(arrays, first)[0])
