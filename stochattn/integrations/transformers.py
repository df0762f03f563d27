"""stochattn as the decode attention of a Hugging Face transformers model.

>>> import torch
>>> from transformers import AutoModelForCausalLM
>>> from stochattn.integrations.transformers import register
>>> attn = register("stochattn_santa", estimator="santa", budget=256, seed=0)  # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(
...     path, dtype=torch.bfloat16, attn_implementation=attn.name).cuda()  # doctest: +SKIP
>>> model.generate(input_ids, max_new_tokens=128, do_sample=False)  # doctest: +SKIP

(or ``model.set_attn_implementation(attn.name)`` on a loaded model). :func:`register` adds
a callable to transformers' ``AttentionInterface`` and SDPA's mask builder to its
``AttentionMaskInterface`` under the same name, so the model builds the masks it builds
for ``"sdpa"``. Then, in every attention call of the model:

- **prefill** (more than one query token, or a sliding-window layer): transformers' own SDPA
  attention, exact. With ``estimator="doublep"`` the layer's cluster index is built from the
  cache at the end of it.
- **decode** (one query token): the chosen estimator on ``q = query[:, :, 0]`` (B, Hq, D)
  and the cache tensors ``key``, ``value`` (B, Hkv, N, D) as transformers hands them over
  (after its cache update), GQA heads not repeated. On a CUDA tensor the kernels read
  those tensors in place (raw device pointers, torch's current stream, no copy, no host
  synchronisation unless a mask has to be checked); float16 and bfloat16, head dim 64 or
  128, at most 8 query heads per KV head. On a CPU tensor the NumPy reference runs, on
  copies (``.numpy()``; bfloat16 goes through float32): slow, for tests and small models.

Sequence lengths come from the attention mask: none in decode (DynamicCache without
padding) means every key of the cache; a mask (StaticCache, padding) must keep a prefix
``0 .. L-1`` of each sequence's keys and gives ``seq_lens = L`` (so a StaticCache
preallocated to its maximum length is read in place, never sliced). Left padding hides
the *first* keys of a sequence, which ``seq_lens`` cannot express: it is rejected with a
``ValueError``. Checking a mask reads it (one synchronisation per forward step, shared by
all layers); ``check_mask=False`` skips the check and trusts the mask to be a prefix.

Random streams: the call of layer ``l`` at the ``t``-th decode step since the last
prefill uses ``seed`` and ``offset = (t * n_layers + l) mod 2**32``.

``torch.compile`` never traces the registered function (``torch.compiler.disable``): in a
compiled decode forward (transformers' generate compiles one by itself with a StaticCache
on a GPU) the estimator runs eagerly between the compiled pieces. Not supported (errors
say so): dropout in decode, logit soft-capping, attention sinks (``s_aux``), position
biases. Importing this module imports neither PyTorch nor transformers;
:func:`register` does.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import numpy as np

from ..doublep import build_doublep_index, doublep_attention
from ..exact import exact_attention
from ..santa import santa_attention
from ._config import DecodeAttentionConfig, check_name, default_clusters, make_config, rng_offset

__all__ = ["DecodeAttention", "register", "registered"]

_DEPS = None


def _deps():
    """PyTorch and the transformers pieces used here, imported on first use (importing this
    module needs neither; :func:`register` says what to install when they are missing)."""
    global _DEPS
    if _DEPS is None:
        try:
            import torch
            from transformers import AttentionInterface
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        except ImportError as e:
            raise ImportError(
                "stochattn.integrations.transformers needs PyTorch and transformers >= 4.53 "
                "(pip install \"stochattn[integrations]\" and a PyTorch build for your machine)"
            ) from e
        _DEPS = SimpleNamespace(torch=torch, AttentionInterface=AttentionInterface,
                                AttentionMaskInterface=AttentionMaskInterface,
                                sdpa_attention_forward=sdpa_attention_forward, sdpa_mask=sdpa_mask)
    return _DEPS


_REGISTRY: dict = {}
# Per-call arguments of transformers' attention functions that the estimators cannot honour.
_UNSUPPORTED = {"softcap": "logit soft-capping", "s_aux": "attention sinks (s_aux)",
                "position_bias": "an additive position bias"}
_DEFAULT_LAYERS = 1024  # layer count for the RNG offset when the config does not say


class _LayerState:
    """What one attention layer keeps between calls: decode steps since the last prefill and
    the Double-P index."""

    __slots__ = ("step", "index")

    def __init__(self):
        self.step = 0
        self.index = None


class DecodeAttention:
    """The attention function registered with transformers, and its per-layer state.

    Built by :func:`register`; transformers calls it as
    ``fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)``
    with query (B, Hq, Lq, D) and key, value (B, Hkv, N, D) and expects
    ``(attn_output (B, Lq, Hq, D), attn_weights or None)``.

    Attributes
    ----------
    name : str
        The implementation name (``attn_implementation=attn.name``).
    config : DecodeAttentionConfig
        Estimator and parameters.
    """

    def __init__(self, name: str, config: DecodeAttentionConfig):
        self.name = name
        self.config = config
        self._layers = weakref.WeakKeyDictionary()  # attention module -> _LayerState
        self._mask_memo = None  # (mask ref, (B, N), lens) of the last mask: one per forward step

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config.parameters.items())
        return f"DecodeAttention(name={self.name!r}, {params})"

    # ---- state ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every layer's state (decode steps, Double-P indexes). A prefill does this
        for its layer anyway; call it to drop the indexes of a finished generation."""
        self._layers = weakref.WeakKeyDictionary()
        self._mask_memo = None

    def decode_step(self, module) -> int:
        """Decode steps ``module`` has run since its last prefill (the ``t`` of the offset)."""
        state = self._layers.get(module)
        return 0 if state is None else state.step

    def index(self, module):
        """The :class:`~stochattn.DoublePIndex` of ``module``'s cache, or None."""
        state = self._layers.get(module)
        return None if state is None else state.index

    def _state(self, module) -> _LayerState:
        state = self._layers.get(module)
        if state is None:
            state = self._layers[module] = _LayerState()
        return state

    # ---- the call -------------------------------------------------------------------------

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 **kwargs):
        sliding = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if query.shape[2] != 1 or sliding is not None:
            return self._prefill(module, query, key, value, attention_mask, dropout, scaling,
                                 sliding is None, kwargs)
        return self._decode(module, query, key, value, attention_mask, dropout, scaling, kwargs)

    def _prefill(self, module, query, key, value, mask, dropout, scaling, full, kwargs):
        out = _deps().sdpa_attention_forward(module, query, key, value, mask,
                                             dropout=dropout, scaling=scaling, **kwargs)
        if full and query.shape[2] > 1:
            state = self._state(module)
            state.step, state.index = 0, None
            if self.config.estimator == "doublep":
                lens = self._prefill_lengths(mask, query, key)
                state.index = self._build_index(key, value, lens)
        return out

    def _decode(self, module, query, key, value, mask, dropout, scaling, kwargs):
        if dropout:
            raise ValueError(f"`dropout` must be 0 in decode with {self.name!r} (model.eval()), "
                             f"got {dropout}")
        for arg, what in _UNSUPPORTED.items():
            if kwargs.get(arg) is not None:
                raise ValueError(f"`{arg}` is not supported by {self.name!r}: the stochattn "
                                 f"estimators have no {what}")
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(f"`module` must have a `layer_idx` (the layer number), got a "
                             f"{type(module).__name__} without one")
        config = getattr(module, "config", None)
        n_layers = getattr(config, "num_hidden_layers", None) or _DEFAULT_LAYERS
        state = self._state(module)
        offset = rng_offset(state.step, n_layers, layer)
        lens = self._mask_lengths(mask, query.shape[0], key.shape[2])
        q = query.select(2, 0)  # (B, Hq, D): a view, contiguous for transformers' layouts
        if q.is_cuda:  # zero copy: the kernels read these tensors in place
            out = self._estimate(q, key, value, lens, scaling, offset, state)
        else:  # the NumPy reference, on copies
            torch = _deps().torch
            out = self._estimate(_host(q), _host(key), _host(value),
                                 None if lens is None else lens.numpy(), scaling, offset, state)
            out = torch.from_numpy(np.ascontiguousarray(out)).to(query.dtype)
        state.step += 1
        return out.unsqueeze(1), None  # (B, 1, Hq, D)

    def _estimate(self, q, k, v, lens, scale, offset, state):
        """One estimator call on q (B, Hq, D), k, v (B, Hkv, N, D): torch CUDA or NumPy."""
        c = self.config
        if c.estimator == "exact" or (c.estimator == "santa" and c.exact_fallback
                                      and k.shape[2] <= c.budget):
            return exact_attention(q, k, v, lens, softmax_scale=scale)
        if c.estimator == "santa":
            return santa_attention(q, k, v, lens, budget=c.budget, sampler=c.sampler,
                                   schedule=c.schedule, tile_size=c.tile_size, seed=c.seed,
                                   offset=offset, softmax_scale=scale)
        # Double-P: the index grows with every decoded token (or is built here if the
        # prefill did not go through this attention).
        if state.index is None:
            state.index = self._build_index(k, v, lens)
        else:
            state.index.append(k, v, lens)
        return doublep_attention(q, k, v, lens, index=state.index, p1=c.p1, p2=c.p2,
                                 approx=c.approx, budget=c.budget, sampler=c.sampler,
                                 seed=c.seed, offset=offset, softmax_scale=scale)

    def _build_index(self, k, v, lens):
        """Double-P index of a cache: torch tensors (CUDA: the GPU build) or, for CPU
        tensors, NumPy copies for the reference."""
        if isinstance(k, _deps().torch.Tensor) and not k.is_cuda:
            k, v = _host(k), _host(v)
            lens = None if lens is None else lens.numpy()
        tokens = int(k.shape[2])
        longest = tokens if lens is None else int(lens.max())  # a sync on the GPU, once
        c = self.config
        return build_doublep_index(k, v, lens, n_clusters=default_clusters(c, longest, tokens),
                                   iterations=c.iterations, n_sink=c.n_sink, window=c.window,
                                   seed=c.seed)

    # ---- sequence lengths from the mask ---------------------------------------------------

    def _prefill_lengths(self, mask, query, key):
        """Valid keys per sequence after a prefill. Without a mask SDPA ran causally over
        the first Lq keys: the whole cache, or an empty StaticCache's first Lq rows."""
        if mask is not None:
            return self._mask_lengths(mask, query.shape[0], key.shape[2])
        Lq, N = int(query.shape[2]), int(key.shape[2])
        if N == Lq:
            return None
        torch = _deps().torch
        return torch.full((int(query.shape[0]),), Lq, dtype=torch.int32, device=key.device)

    def _mask_lengths(self, mask, batch: int, n_keys: int):
        """int32 (B,) lengths L with mask row = keys [0, L), from the last query row of a 4-D
        mask (bool: True = attend; float: 0 = attend, very negative = masked); None for no
        mask. Memoised for the mask object: one check per forward step."""
        if mask is None:
            return None
        memo = self._mask_memo
        if memo is not None and memo[0]() is mask and memo[1] == (batch, n_keys):
            return memo[2]
        torch = _deps().torch
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"`attention_mask` must be a torch.Tensor or None with {self.name!r}, "
                            f"got {type(mask).__name__}")
        shape = tuple(mask.shape)
        if mask.dim() != 4 or shape[-1] != n_keys or shape[0] not in (1, batch):
            raise ValueError(f"`attention_mask` must have shape ({batch}, heads, q_len, {n_keys}), "
                             f"got {shape}")
        row = mask[:, :, -1, :]  # the last query's view of the keys: (B or 1, heads, N)
        if mask.dtype == torch.bool:
            valid, clean = row, None
        elif mask.dtype.is_floating_point:
            valid = row == 0
            clean = valid | (row <= torch.finfo(row.dtype).min / 2)  # 0 or "minus infinity"
        else:
            raise TypeError(f"`attention_mask` must be bool or floating point, got {mask.dtype}")
        lens = valid[:, 0, :].sum(-1, dtype=torch.int32)
        if self.config.check_mask:
            prefix = torch.arange(n_keys, device=mask.device)[None, :] < lens[:, None]
            ok = (valid == prefix[:, None, :]).all()
            if clean is not None:
                ok = ok & clean.all()
            if not bool(ok):  # the one synchronisation of the check
                raise ValueError(
                    "`attention_mask` must keep a prefix of every sequence's keys (keys "
                    "0 .. L-1, as a cache without padding or a StaticCache gives) with "
                    f"{self.name!r}: the estimators take per-sequence lengths, which cannot "
                    "express left padding (padding at the start of a sequence), sliding "
                    "windows or additive biases. Generate unpadded prompts (batch 1, or "
                    "prompts of one length)"
                )
        if lens.shape[0] != batch:
            lens = lens.expand(batch).contiguous()
        self._mask_memo = (weakref.ref(mask), (batch, n_keys), lens)
        return lens


def _host(t):
    """A CPU tensor as NumPy (bfloat16, which NumPy lacks, through a float32 copy)."""
    t = t.detach()
    if t.dtype == _deps().torch.bfloat16:
        t = t.float()
    return t.numpy()


def register(name: str = "stochattn", *, estimator: str, **params) -> DecodeAttention:
    """Register a stochattn estimator as a transformers attention implementation.

    Parameters
    ----------
    name : str
        The implementation name, used as ``attn_implementation=name`` (at load) or
        ``model.set_attn_implementation(name)``. Letters, digits and underscores; not one of
        transformers' own names. Registering a name again replaces its configuration (and
        starts from a fresh state); models already set to that name use the new one.
    estimator : {"exact", "santa", "doublep"}
        The decode estimator; the prefill is always transformers' exact SDPA attention.
    **params
        The estimator's parameters, checked now: see
        :func:`stochattn.integrations.make_config` (``budget``, ``sampler``, ``schedule``,
        ``tile_size``, ``exact_fallback`` for SANTA; ``p1``, ``p2``, ``approx``,
        ``n_clusters``, ... for Double-P; ``seed`` and ``check_mask`` for all).

    Returns
    -------
    DecodeAttention
        The registered callable: ``.name``, ``.config``, ``.reset()``, ``.index(module)``.

    Raises
    ------
    TypeError, ValueError
        A bad name, estimator or parameter (named in the message).

    Examples
    --------
    >>> from stochattn.integrations.transformers import register
    >>> attn = register("stochattn_exact", estimator="exact")
    >>> attn.name
    'stochattn_exact'
    """
    name = check_name(name)
    attn = DecodeAttention(name, make_config(estimator, **params))
    deps = _deps()
    # Never traced by torch.compile (transformers' generate compiles the decode forward by
    # itself with a StaticCache on a GPU): the estimator runs eagerly between the compiled
    # pieces, one graph break per layer.
    deps.AttentionInterface.register(name, deps.torch.compiler.disable(attn.__call__))
    deps.AttentionMaskInterface.register(name, deps.sdpa_mask)
    _REGISTRY[name] = attn
    return attn


def registered(name: str) -> DecodeAttention:
    """The :class:`DecodeAttention` registered under ``name`` by :func:`register`."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"`name` must be a name registered with register(), one of "
                         f"{sorted(_REGISTRY)}, got {name!r}") from None
