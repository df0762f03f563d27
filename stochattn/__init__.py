"""stochattn: fast approximate attention for long-context LLM decoding.

Layout everywhere: q (B, Hq, D); k, v (B, Hkv, N, D); seq_lens (B,). See docs/layout.md.
"""

from .diagnostics import Diagnostics
from .exact import exact_attention

__version__ = "0.1.0.dev0"

__all__ = ["Diagnostics", "exact_attention"]
