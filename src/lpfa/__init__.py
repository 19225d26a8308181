"""lpfa: why low-precision (BF16) flash-attention training fails — an executable reproduction.

Modules, one per concept:

* :mod:`lpfa.bf16` — BF16 rounding made visible (paper Sec. 3.3.2) and the accumulation-bias statistic.
* :mod:`lpfa.attention` — precision-policy flash attention: policies and presets, the exact PyTorch
  reference, Triton forward/backward kernels, the ``torch.library`` op.
* :mod:`lpfa.model` — GPT-2 (nanoGPT semantics) with attention precision chosen per layer.
* :mod:`lpfa.data` — tokenizers, nanoGPT token files, deterministic batches and replay logs.
* :mod:`lpfa.train` — the training loop and CLI; :mod:`lpfa.params` — typed checks of config fields and notebook
  parameters.
* :mod:`lpfa.experiments` — the book's experiments as one table (each run's overrides, description, the paper's
  outcome, its reference run); :mod:`lpfa.launch` — detached runs on time-boxed GPUs.
* :mod:`lpfa.checkpoints` — our checkpoints, nanoGPT ``ckpt.pt`` and Hugging Face GPT-2 loaders.
* :mod:`lpfa.diagnostics` — W_Q spectral norms, tie frequency, max logits during training.
* :mod:`lpfa.mechanism` — δ error, rank-1 structure and P̄V rounding error on tensors (Figs. 4–6).
* :mod:`lpfa.run` — one run folder (``Run``): config, metrics, verdict, checkpoints; :mod:`lpfa.explosion` — the
  explosion criterion; :mod:`lpfa.survival` — how often runs fail (Kaplan–Meier, exact intervals);
  :mod:`lpfa.compare` — tables and figures across runs (per-head diagnostics, the precursors,
  the experiment tables).
* :mod:`lpfa.doctor` — ``lpfa doctor CHECKPOINT``: every link of the failure chain measured per layer and head of one
  checkpoint (ours, nanoGPT's, Hugging Face GPT-2) on a probe batch, a verdict per head and a report;
  :mod:`lpfa.alarms` — the verdicts' thresholds, learnt from the committed runs with their error rates
  (``python -m lpfa.alarms --write``) into the committed file the monitor and the doctor read.
* :mod:`lpfa.monitor` — ``AttentionMonitor``: per-head max logit, BF16 ties and W_Q growth inside any training loop,
  warning when a head crosses those thresholds.
* :mod:`lpfa.audit` — is your attention kernel biased? Signed errors of O, δ and dQ·u against float64 per kernel.
* :mod:`lpfa.dose` — the dose-response test: δ's error × k, biased against control, fit and extrapolation.
* :mod:`lpfa.pages` — the book's own layer: one module per notebook (its tables, figures and sentences);
  :mod:`lpfa.pages.intro` — each claim of the paper, our committed result and a verdict (the intro's table).
* :mod:`lpfa.scaling` — DDP agreement, throughput and the cost of runs at scale.
* :mod:`lpfa.results`, :mod:`lpfa.provenance` — the results store and its provenance records.
* :mod:`lpfa.plotting` — the one figure style of the book; :mod:`lpfa.paths` — where things live.
* :mod:`lpfa.book` — execute the notebooks with papermill and build the Jupyter Book.
* :mod:`lpfa.publish` — the book's one repository value: its GitHub Pages address and each notebook's setup cell
  (lpfa installed from the repository where it is missing: Colab, a JupyterHub).
* :mod:`lpfa.cli` — the ``lpfa`` command: one verb per tool (``lpfa --help`` lists them).
"""

__version__ = "0.1.0"
