"""Context-parallel decode: one sequence's KV cache split along the tokens over R ranks.

NumPy reference of issue 35 (docs/context_parallel.md; modules ``core``: shards, collectives,
merge, exact; ``santa``: prop, flash; ``doublep``), float64, ranks simulated in one
process. Rank r holds the tokens ``[bounds[r], bounds[r + 1])`` of every sequence (a
contiguous shard; shards may be empty, and with ``seq_lens`` shorter than the cache a rank
may hold no live token). Every algorithm is written as phases: a local phase per rank, a
collective, a local phase per rank. ``comm.local_ranks`` are the ranks this process drives:
all of them in :class:`SimulatedCollectives`, one in a torch.distributed / NCCL
implementation (:class:`~stochattn.context_parallel.dist.TorchCollectives`, over
``torch.distributed``: NCCL or Gloo), so the same code runs in both, with the same bits
(``python -m stochattn.context_parallel.check`` under torchrun checks it).

- :func:`cp_exact_attention`: per rank the split-KV partial (max m, sum l, weighted sum
  acc) over its shard, one all-gather, :func:`merge_partials`.
- :func:`cp_prop_attention`: S²ANTA-prop. Per rank pass 1 over its tiles
  (``reference.santa.tile_stats`` on the shard), one all-gather of the tile (m_t, l_t),
  every rank runs the reducer (W, C, Z) over all T tiles in tile order and the same global
  points (stream 0), keeps the points that fall in its own tiles, inverts them tile-locally
  and gathers its V rows; one all-reduce of the (B, Hq, D) partial sums, divided by S.
- :func:`cp_flash_attention`: S²ANTA-flash. Per rank the flash tiles of its shard (stream =
  global tile index, S_t = ceil(S / T_L) from the global length), combined into one partial
  per rank; one all-gather and :func:`merge_partials`.
- :func:`cp_doublep_attention`: Double-P over per-rank indexes
  (:func:`build_shard_indexes`); one all-gather of the (B, Hq, C) cluster scores, the
  global stage 1 / stage 2 selection by ``reference.doublep.select_clusters`` over the
  rank-major concatenation, partials per rank, one all-gather and :func:`merge_partials`.
  ``approx="centroid"``: C_approx as pseudo-tokens. ``approx="sample"``: one more
  all-gather of each rank's C_approx total (3 floats per (b, h)); every rank draws the
  reference's points on the ranks' prefix and inverts its own in its local CDF (prop's
  ``exchange="totals"``).
- :func:`cp_doublep_append`: decode growth, no collective; each rank absorbs the tokens
  that left the window and that it holds into its own index by the single-device append
  rule (``reference.kmeans.append_tokens``): a token joins only its own rank's clusters.

prop and flash need shard boundaries on multiples of ``tile_size`` (the tiles of the
single-device reference then never straddle a shard); a ``ValueError`` says so otherwise.
"""

from __future__ import annotations

from .core import (Collectives, CPResult, Shard, SimulatedCollectives, combine_partials,
                   cp_exact_attention, merge_partials, reduce_tiles, shard_bounds, split_cache)
from .doublep import (RANK_SEED_STEP, build_shard_indexes, cp_doublep_append,
                      cp_doublep_attention, union_index)
from .santa import cp_flash_attention, cp_prop_attention

__all__ = [
    "Shard",
    "shard_bounds",
    "split_cache",
    "Collectives",
    "SimulatedCollectives",
    "combine_partials",
    "merge_partials",
    "reduce_tiles",
    "CPResult",
    "cp_exact_attention",
    "cp_prop_attention",
    "cp_flash_attention",
    "build_shard_indexes",
    "union_index",
    "cp_doublep_attention",
    "cp_doublep_append",
    "RANK_SEED_STEP",
]
