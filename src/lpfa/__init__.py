"""lpfa: why low-precision (BF16) flash-attention training fails — an executable reproduction.

Modules, one per concept:

* :mod:`lpfa.bf16` — BF16 rounding made visible (paper Sec. 3.3.2) and the accumulation-bias statistic.
* :mod:`lpfa.data` — tokenizers and nanoGPT-format token files (``train.bin`` / ``val.bin``).
* :mod:`lpfa.plotting` — the one figure style of the book.
* :mod:`lpfa.paths` — where the repository, the embedded corpus and the results live.
* :mod:`lpfa.book` — execute the notebooks with papermill and build the Jupyter Book.
"""

__version__ = "0.1.0"
