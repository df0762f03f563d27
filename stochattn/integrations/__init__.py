"""Framework integrations of the stochattn estimators.

- :mod:`stochattn.integrations.transformers`: stochattn as the decode attention of a Hugging
  Face transformers model (prefill stays exact, through torch SDPA). Needs PyTorch and
  transformers (``pip install "stochattn[integrations]"`` plus a PyTorch build for your
  machine); importing that module imports them.

Neither ``import stochattn`` nor ``import stochattn.integrations`` imports PyTorch or
transformers: the argument handling lives in the torch-free
:mod:`stochattn.integrations._config`. See docs/integrations.md.
"""

from ._config import ESTIMATORS, DecodeAttentionConfig, make_config

__all__ = ["ESTIMATORS", "DecodeAttentionConfig", "make_config"]
