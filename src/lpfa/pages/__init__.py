"""The book's own layer: one module per notebook, holding that page's tables, figures and sentences.

A notebook imports its page module and calls it: prose in Markdown, one call per figure or table, numbers glued
(:func:`glue_text`). Its first cell checks its papermill parameters against the page module's ``PARAMS``
(:func:`lpfa.params.check_params`).
The library below (:mod:`lpfa.run`, :mod:`lpfa.compare`, :mod:`lpfa.experiments`, the analyses) never imports this
package. The modules, in the book's reading order: :mod:`.intro` (the scorecard), :mod:`.bf16_rounding` (page 01),
:mod:`.delta_bias` (02), :mod:`.pktx_structure` (03), :mod:`.pv_error` (04), :mod:`.structure` (05),
:mod:`.loss_explosion` (06), :mod:`.spectral_norms` (07), :mod:`.tie_frequency` (08), :mod:`.sfa` (09),
:mod:`.isolation` (10), :mod:`.seeds` (11), :mod:`.kernels` (12), :mod:`.training` (13), :mod:`.scale` (14),
:mod:`.early_warning` (15), :mod:`.kernel_bias` (16), :mod:`.stabilisers` (17).
"""

from __future__ import annotations

import re

from lpfa.params import check_params  # noqa: F401  (a notebook checks its parameters with it, from here)
from lpfa.plotting import format_table  # noqa: F401  (and shows its tables with it)
from lpfa.results import load, what
from lpfa.train import PRESETS

# what fixes a preset's training, beyond the batch a GPU run chooses
_RECIPE_KEYS = ("model", "block_size", "lr", "min_lr", "lr_schedule", "warmup_steps")
_SETTINGS = {"gpt2-s-paper": "the paper's GPT-2 S recipe", "repro": "the `repro` preset"}
# where the book keeps the commands that rerun an experiment (book/rerun.md, by its title): a page names it, and
# states no command of its own
RERUN_PAGE = "the page *Reading, rerunning and changing the notebooks*"
# a scorecard verdict (lpfa.pages.intro.VERDICTS) as a page says it: "Fig. 2 is partly reproduced"
VERDICT_WORDS = {"reproduced": "reproduced", "partly": "partly reproduced", "not reproduced": "not reproduced",
                 "not run": "not run here", "shown": "shown", "not shown": "not shown"}


def and_join(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def gpu_name(device: str) -> str:
    """The GPU's model in a provenance's ``device`` ("NVIDIA H100 80GB HBM3", "2 x NVIDIA H200 (nvidia-h200-x2)"):
    "H100", "H200"; the string as it is where it names no NVIDIA model."""
    m = re.search(r"NVIDIA ([A-Z]+\d+)", device)
    return m.group(1) if m else device


def plural(n: int, noun: str) -> str:
    """``noun`` for one, ``noun`` + "s" for any other count (0 included): ``f"{n} {plural(n, 'seed')}"``."""
    return noun if n == 1 else noun + "s"


def capital(text: str) -> str:
    """``text`` with its first letter upper-cased (a clause that begins a sentence); the rest as it is."""
    return text[:1].upper() + text[1:]


def setting_of(train: dict) -> str:
    """The training setting of a run's TrainConfig (``config.json``'s ``"train"``) in words: the preset whose model,
    sequence length and learning-rate schedule it has ("the paper's GPT-2 S recipe", "the `repro` preset"), or
    its model's name when none matches."""
    for name, preset in PRESETS.items():
        if all(train.get(k) == preset[k] for k in _RECIPE_KEYS if k in preset):
            return _SETTINGS.get(name, f"the `{name}` preset")
    return f"a `{train.get('model', '?')}` model"


def provenance_line(experiment: str, folder) -> str:
    """What run folder ``folder`` of ``experiment`` is, where and from which commit it ran, from its
    ``provenance.json``: "<what>. <device>, commit `<git commit>`" (no final full stop; :func:`lpfa.results.what`)."""
    prov = load(experiment, "provenance.json", folder.name)
    return f"{what(prov).rstrip('. ')}. {prov['device']}, commit `{prov['git_commit']}`"


def glue_text(name: str, text) -> None:
    """Glue ``text`` as Markdown under ``name``, for the page's prose to show with ``{glue:md}`name```; nothing is
    displayed where the call is."""
    from IPython.display import Markdown  # the notebook's kernel only (the book extra): not needed to import the page
    from myst_nb import glue

    glue(name, Markdown(str(text)), display=False)


def glue_texts(texts: dict) -> None:
    """:func:`glue_text` for each ``{name: text}`` of ``texts``."""
    for name, text in texts.items():
        glue_text(name, text)
