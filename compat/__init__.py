"""Side-by-side conformance suite: trainbridge against a stock ``transformers.Trainer``.

``python -m compat`` runs every scenario (``compat.scenarios``) with both runners (``compat.runners``)
on 1 and 2 ranks, compares the recorded traces and artifacts (``compat.recorder``, ``compat.artifacts``,
``compat.diff``) and writes ``compat/REPORT.md`` (``compat.report``).  See ``compat/README.md``.
"""
