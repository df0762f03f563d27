"""What an estimator reports about one call when asked (``return_diagnostics=True``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

__all__ = ["Diagnostics"]


@dataclass(frozen=True)
class Diagnostics:
    """Per-call statistics. Arrays are NumPy; fields an estimator does not produce are None.

    Attributes
    ----------
    seq_lens : ndarray of int64, shape (B,)
        Tokens in each sequence.
    k_rows_read, v_rows_read : ndarray of int64, shape (B, Hkv)
        Distinct K (V) rows read per KV head: the union over the query heads of its GQA
        group, since that is what crosses the memory bus.
    samples_per_tile : ndarray of int64, shape (B, Hq, T), optional
        Sample points that fell into (prop) or were drawn in (flash) each tile.
    sample_waste : ndarray of float64, shape (B, Hq), optional
        Flash schedule: the fraction of drawn samples in excess of each tile's proportional
        share, ``sum_t max(0, S_t - S W_t / Z) / sum_t S_t``; 0 for the prop schedule.
    k_feature_fraction : ndarray of float64, shape (B, Hq), optional
        Bernoulli scores: fraction of the D key features read (some draw non-zero).
    clusters_selected, clusters_exact : ndarray of int64, shape (B, Hq), optional
        Double-P and cluster baselines: clusters kept by stage 1, and among them those
        computed token by token.
    tokens_exact : ndarray of int64, shape (B, Hq), optional
        Tokens whose logits and values are computed exactly (sinks and window included).
    estimated_mass : ndarray of float64, shape (B, Hq), optional
        The mass the method believes it covers (for Double-P: centroid-estimated mass of
        the selected clusters).
    true_mass : ndarray of float64, shape (B, Hq), optional
        True softmax mass of the tokens the method computes or samples, under exact
        attention over the whole sequence.
    budget : ndarray of int64, shape (B, Hq), optional
        Error-targeted budgets: the S chosen per head (pilot draws not included).
    budget_capped : ndarray of bool, shape (B, Hq), optional
        Heads whose S hit ``max_budget``: no guarantee there.
    error_bound : ndarray of float64, shape (B, Hq), optional
        The relative tolerance the chosen S guarantees at ``delta`` (inf if |o| could not
        be bounded).
    budget_pilot : ndarray of int64, shape (B, Hq), optional
        Error-targeted budgets: the pilot draws each head made to choose its S (the
        plan's ``pilot`` on every head that draws; per head under Double-P's
        ``budget_norm="auto"``, 0 where it took no pilot). A head's draws are
        ``budget + budget_pilot``.
    """

    seq_lens: np.ndarray
    k_rows_read: np.ndarray
    v_rows_read: np.ndarray
    samples_per_tile: np.ndarray | None = None
    sample_waste: np.ndarray | None = None
    k_feature_fraction: np.ndarray | None = None
    clusters_selected: np.ndarray | None = None
    clusters_exact: np.ndarray | None = None
    tokens_exact: np.ndarray | None = None
    estimated_mass: np.ndarray | None = None
    true_mass: np.ndarray | None = None
    budget: np.ndarray | None = None
    budget_capped: np.ndarray | None = None
    error_bound: np.ndarray | None = None
    budget_pilot: np.ndarray | None = None

    @property
    def k_read_fraction(self) -> np.ndarray:
        """``k_rows_read / seq_len`` per (B, Hkv); 0 for empty sequences."""
        return self.k_rows_read / np.maximum(self.seq_lens, 1)[:, None]

    @property
    def v_read_fraction(self) -> np.ndarray:
        """``v_rows_read / seq_len`` per (B, Hkv); 0 for empty sequences."""
        return self.v_rows_read / np.maximum(self.seq_lens, 1)[:, None]

    def summary(self) -> dict:
        """Scalar means of every field that is present, for printing and JSON."""
        out = {
            "k_read_fraction": float(self.k_read_fraction.mean()),
            "v_read_fraction": float(self.v_read_fraction.mean()),
        }
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("seq_lens", "k_rows_read", "v_rows_read", "samples_per_tile"):
                continue
            out[f.name] = float(np.mean(value))
        return out
