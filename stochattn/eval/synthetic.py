"""Synthetic decode inputs whose attention is peaked like a real LLM's (docs/llm_eval.md).

On random Gaussian q and k attention is flat and no sparse method can win, so benchmarks
and the demo use this generator instead. It is a simple, documented model, not a trace.
Logits are built in units of logits at the default scale ``1 / sqrt(D)``.

- **Topics.** Per (sequence, KV head), ``n_centres`` = 256 cluster centres of about unit norm
  lie in a (D - 2)-dim content subspace; the cache is a sequence of topic runs
  (geometric lengths, mean ``run_length`` = 16 tokens, like sentences), and every key of a
  run is its centre plus isotropic noise (``key_noise`` = 0.5 of the centre norm). A
  topic's tokens are thus spread over the sequence but locally contiguous, as in text
  (this is what lets page-level methods such as Quest work at all).
- **Queries.** Each query head looks for 1 to 6 topics (``targets``) present in the
  sequence, half of them shared by its GQA group (the heads of a group read one cache),
  with a per-head inverse temperature ``beta`` drawn log-uniformly from ``beta_range`` =
  (8, 28): the target topics' tokens sit about ``beta / sqrt(#targets)`` logits above
  the bulk, whose logits spread by about ``0.14 beta``. Small beta or many targets give
  the diffuse heads of early layers, large beta the sharp retrieval heads.
- **Sinks.** The first ``n_sink`` = 4 tokens have a key along a "sink" direction that
  every query also holds; their logit is set ``sink_offset`` (drawn per head in (1, 5))
  above the target-topic logit, so that they take from a few percent to most of the mass
  (quartiles about 7-55%, median about 25%), as the first tokens do from layer 12 on in
  SmolLM2 (20-77%).
- **Recency.** The last ``window`` = 64 tokens get a bonus along a "recency" direction,
  decaying as ``exp(-age / 16)`` from the target-topic logit plus ``recency_offset``
  (drawn per head in (-2, 1)) at age 0.
- **Values.** A value is its topic's value centre (entries N(0, 0.7^2)) plus unit
  Gaussian noise, so that per-cluster means of V carry information (what Double-P's
  centroid approximation relies on); sink values are scaled by 0.1, since attention
  sinks in real models have small value norms (they act as a "no-op" slot).

With the defaults at N = 4096 and D = 64, the fraction of keys that holds 95% of a head's
softmax mass has a median of about 1.2% and quartiles of about 0.5-4% over 256 heads (the
real-model figures: median 1.3%, quartiles 0.3-5.9%; 99% of the mass in a median of
about 2.5% of the keys here, 6.5% in SmolLM2, so the tail is lighter than a real
model's). ``python -m stochattn.eval.synthetic`` prints these figures.

Known limits: keys are isotropic in the content subspace (real keys have a few outlier
channels) and topics are independent draws, so per-page min/max bounds are loose here and
Quest's numbers on this generator are pessimistic; real traces (docs/llm_eval.md) decide.
All randomness comes from ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["make_decode_inputs", "keys_for_mass"]


def _topic_runs(rng, tokens: int, n_centres: int, run_length: float) -> np.ndarray:
    """Topic id of each token: runs of geometric length (mean ``run_length``)."""
    z = np.empty(tokens, dtype=np.int64)
    pos = 0
    while pos < tokens:
        n = int(rng.geometric(1.0 / run_length))
        z[pos:pos + n] = rng.integers(n_centres)
        pos += n
    return z


def make_decode_inputs(batch, q_heads, kv_heads, tokens, head_dim, *, seed, dtype=np.float32,
                       n_centres=256, run_length=16.0, key_noise=0.5, targets=(1, 6),
                       beta_range=(8.0, 28.0), n_sink=4, sink_offset=(1.0, 5.0), window=64,
                       recency_offset=(-2.0, 1.0)):
    """One decode step of peaked, LLM-like attention: ``(q, k, v)``.

    Parameters
    ----------
    batch, q_heads, kv_heads, tokens, head_dim : int
        Shapes: q (batch, q_heads, head_dim); k, v (batch, kv_heads, tokens, head_dim).
        ``q_heads`` must be a multiple of ``kv_heads``; ``head_dim`` >= 4.
    seed : int
        Seed of ``numpy.random.default_rng``; same seed, same arrays.
    dtype : numpy dtype
        Output dtype (generated in float64, then cast).
    n_centres, run_length, key_noise, targets, beta_range, n_sink, sink_offset, window,
    recency_offset
        Model parameters, see the module docstring.

    Returns
    -------
    q : ndarray, shape (batch, q_heads, head_dim)
    k, v : ndarray, shape (batch, kv_heads, tokens, head_dim)

    Notes
    -----
    The logits use the default scale ``1 / sqrt(head_dim)``: keys are built with norm
    ``sqrt(head_dim)`` per unit of "logit direction", so ``scale * q . k`` is in logits.
    """
    if q_heads % kv_heads:
        raise ValueError(f"`q_heads` must be a multiple of `kv_heads`, got {q_heads} and {kv_heads}")
    if head_dim < 4:
        raise ValueError(f"`head_dim` must be >= 4, got {head_dim}")
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, N, D = batch, q_heads, kv_heads, tokens, head_dim
    G = Hq // Hkv
    q = np.zeros((B, Hq, D))
    k = np.zeros((B, Hkv, N, D))
    v = np.zeros((B, Hkv, N, D))
    root = np.sqrt(D)
    age = np.arange(N)[::-1]  # age 0 = the newest token
    for b in range(B):
        for g in range(Hkv):
            # Orthonormal frame: e_sink, e_recent, then a (D - 2)-dim content subspace.
            frame, _ = np.linalg.qr(rng.standard_normal((D, D)))
            e_sink, e_recent, content = frame[:, 0], frame[:, 1], frame[:, 2:]
            centres = rng.standard_normal((n_centres, D - 2)) / np.sqrt(D - 2) @ content.T
            z = _topic_runs(rng, N, n_centres, run_length)
            noise = rng.standard_normal((N, D - 2)) / np.sqrt(D - 2) @ content.T
            unit_keys = centres[z] + key_noise * noise  # logit = q_unit . unit_key
            unit_keys[:n_sink] = 0.2 * noise[:n_sink] + e_sink
            recent = np.where(age < window, np.exp(-age / 16.0), 0.0)
            unit_keys += recent[:, None] * e_recent
            k[b, g] = root * unit_keys
            value_centres = 0.7 * rng.standard_normal((n_centres, D))
            v[b, g] = value_centres[z] + rng.standard_normal((N, D))
            v[b, g, :n_sink] *= 0.1
            present = np.unique(z[n_sink:]) if N > n_sink else np.unique(z)
            shared = rng.choice(present, size=targets[1])  # the group's common interest
            for h in range(g * G, (g + 1) * G):
                beta = np.exp(rng.uniform(*np.log(beta_range)))
                t = int(rng.integers(targets[0], targets[1] + 1))
                own = rng.choice(present, size=t)
                pick = np.where(rng.random(t) < 0.5, shared[:t], own)
                direction = centres[pick].sum(axis=0)
                direction /= np.linalg.norm(direction)
                top = beta * float(np.mean(centres[pick] @ direction))  # target-topic logit
                sink_logit = top + rng.uniform(*sink_offset)
                recent_logit = top + rng.uniform(*recency_offset)  # bonus at age 0
                q[b, h] = beta * direction + sink_logit * e_sink + recent_logit * e_recent
    # scale * q . k = (1 / sqrt(D)) * q . (sqrt(D) unit_key) = q . unit_key, in logits.
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def keys_for_mass(q, k, seq_lens=None, fraction=0.95):
    """Fraction of the keys that hold ``fraction`` of the softmax mass, per (b, h).

    The fewest keys by descending weight whose mass reaches ``fraction``, divided by the
    sequence length. Returns float64 (B, Hq).
    """
    from stochattn.reference.exact import attention_weights

    B, Hq, D = q.shape
    N = k.shape[2]
    lens = np.full(B, N) if seq_lens is None else np.asarray(seq_lens)
    A = attention_weights(q, k, seq_lens, 1.0 / np.sqrt(D))
    c = np.cumsum(-np.sort(-A, axis=-1), axis=-1)
    count = (c < fraction * c[..., -1:]).sum(axis=-1) + 1
    return count / np.maximum(lens, 1)[:, None]


def main():  # pragma: no cover - a printout
    from stochattn.reference.exact import attention_weights

    def line(label, f):
        lo, med, hi = np.percentile(f, [25, 50, 75])
        return (f"{label}: median {med:.2f}%, quartiles {lo:.2f}-{hi:.2f}%, "
                f"range {f.min():.2f}-{f.max():.2f}%")

    q, k, _ = make_decode_inputs(1, 8, 2, 4096, 64, seed=0)
    print("demo instance (B=1, Hq=8, Hkv=2, N=4096, D=64, seed=0), % of keys for 95% of the "
          "mass per head:", np.round(keys_for_mass(q, k).ravel() * 100, 2).tolist())
    q, k, _ = make_decode_inputs(32, 8, 2, 4096, 64, seed=1)
    print(f"population of {q.shape[0] * q.shape[1]} heads (N=4096, D=64, seed=1):")
    print("  " + line("keys for 95% of the mass", keys_for_mass(q, k).ravel() * 100))
    print("  " + line("keys for 99% of the mass", keys_for_mass(q, k, fraction=0.99).ravel() * 100))
    sinks = attention_weights(q, k, None, 1 / 8)[..., :4].sum(axis=-1).ravel() * 100
    print("  " + line("mass of the 4 sink tokens", sinks))
    print("  (real model, SmolLM2 at 8k: 95% in median 1.3%, quartiles 0.3-5.9%; 99% in 6.5%)")


if __name__ == "__main__":  # pragma: no cover
    main()
