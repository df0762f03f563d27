"""Attention implementations that only the end-to-end benchmark needs (benchmarks/e2e_decode.py).

- :class:`FlashInferDecode`: FlashInfer 0.6.0's batch decode as a transformers attention
  function, reading transformers' StaticCache in place. A StaticCache layer holds K and V as
  (B, Hkv, max_len, D) tensors; FlashInfer's paged cache in the ``HND`` layout is
  (pages, Hkv, page_size, D), so with one page of ``max_len`` rows per sequence the cache
  *is* a paged cache (page b = sequence b) and nothing is copied. The plan (FlashInfer's
  split-KV schedule, computed on the host from the sequence lengths) is made once per decode
  step, on the first layer's call, from the attention mask: one synchronisation per step,
  as the stochattn integration's mask check. The price of reading in place: FlashInfer
  splits its work by pages, and one page per sequence leaves it one thread block per
  (sequence, KV head), no split-KV (1.4 ms per layer at batch 1 / 32k on the H200, against
  51 us in its own paged layout with 16-row pages): this measures FlashInfer on
  transformers' cache, not FlashInfer at its best.
- :class:`CalibratedQuery`: wraps an attention function so that every decode call sees a
  fixed query (the calibrated generator's, matched to the calibrated keys in the cache)
  instead of the random-weight model's. The model's own query would be unrelated to the
  cache's keys, and its attention would be flat: the speed of Double-P, whose cost grows
  with the number of clusters its top-p selects, would then be measured on the wrong
  attention. SANTA's and the exact kernels' costs do not depend on the query.
"""

from __future__ import annotations

import weakref

__all__ = ["CalibratedQuery", "FlashInferDecode"]


class FlashInferDecode:
    """FlashInfer batch decode over a StaticCache, in place (see the module docstring).

    Prefill calls (more than one query row) go to transformers' SDPA attention.
    ``use_tensor_cores=False``: the faster FlashInfer decode variant for GQA group 4 in
    benchmarks/bench_decode.py's measurements on the H200.
    """

    def __init__(self, workspace_mb=256, use_tensor_cores=False):
        import flashinfer
        import torch
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self._torch, self._sdpa = torch, sdpa_attention_forward
        self._ws = torch.empty(workspace_mb << 20, dtype=torch.uint8, device="cuda")
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._ws, kv_layout="HND", use_tensor_cores=use_tensor_cores)
        self._memo = None  # (mask ref, shape, scaling) of the mask the plan was made for

    def reset(self):
        self._memo = None

    def _plan(self, query, key, mask, scaling):
        torch = self._torch
        B, Hq, _, D = query.shape
        Hkv, N = key.shape[1], key.shape[2]
        memo = (None if mask is None else weakref.ref(mask), (B, Hq, Hkv, N, D), scaling)
        old = self._memo
        if old is not None and old[1:] == memo[1:] and (
                (mask is None and old[0] is None) or (old[0] is not None and old[0]() is mask)):
            return
        dev = query.device
        if mask is None:
            lens = torch.full((B,), N, dtype=torch.int32, device=dev)
        else:  # bool (B or 1, 1, q_len, N), True = attend: the length is the count of keys kept
            row = mask[:, 0, -1, :]
            keep = row if row.dtype == torch.bool else row == 0
            lens = keep.sum(-1, dtype=torch.int32).expand(B).contiguous()
        idx = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self._wrapper.plan(idx, idx[:B].contiguous(), lens, Hq, Hkv, D, N,
                           pos_encoding_mode="NONE", q_data_type=query.dtype,
                           kv_data_type=key.dtype, sm_scale=scaling)
        self._memo = memo

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 **kwargs):
        if query.shape[2] != 1:
            return self._sdpa(module, query, key, value, attention_mask, dropout=dropout,
                              scaling=scaling, **kwargs)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        self._plan(query, key, attention_mask, scaling)
        out = self._wrapper.run(query[:, :, 0], (key, value))  # (B, Hq, D)
        return out.unsqueeze(1), None


class CalibratedQuery:
    """An attention function whose decode calls see ``self.query`` (B, Hq, 1, D) in place
    of the model's query, when set (see the module docstring); prefill calls and an unset
    query pass through."""

    def __init__(self, fn):
        self.fn = fn
        self.query = None

    def reset(self):
        if hasattr(self.fn, "reset"):
            self.fn.reset()

    def __call__(self, module, query, *args, **kwargs):
        q = self.query
        if q is not None and query.shape[2] == 1:
            if q.shape != query.shape:
                raise ValueError(f"calibrated query of shape {tuple(q.shape)} for a model query "
                                 f"of shape {tuple(query.shape)}")
            query = q
        return self.fn(module, query, *args, **kwargs)
