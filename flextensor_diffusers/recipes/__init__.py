"""Runnable recipes: load CPU-first, enable offload, profile once, generate, write an mp4, report.

`models` builds the supported pipelines from the configs in ``assets/`` (tiny or full, random weights) or loads
a local folder; each recipe is a console script (``flextensor-wan22-t2v`` and the like, see pyproject.toml)."""
