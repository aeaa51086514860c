"""Parity verification on real and tiny HF models: how far does a backend move a checkpoint?

Each module runs as ``python -m model_tests.<name> --help``; ``hfab verify --report DIR`` runs them all and
writes report.md, report.json and PNG plots (:mod:`model_tests.report`).

- :mod:`model_tests.metrics`: the metric and gate functions (pure, on tensors).
- :mod:`model_tests.layers`: per-layer, teacher-forced attention and residual-stream parity.
- :mod:`model_tests.outputs`: output parity (KL, top-k, perplexity / embedding cosine) and the exact-backend
  envelope gates.
- :mod:`model_tests.behaviour`: causality leak, padding invariance, batched vs per-sample generate(), full
  forward vs incremental decode.
- :mod:`model_tests.sweeps`: quality against the backends' knobs and against sequence length.
- :mod:`model_tests.common`: model and text loading shared by the scripts.

Conventions: ``mask`` is (B, N) bool, True = real token; metrics are taken over real tokens only.
"""
