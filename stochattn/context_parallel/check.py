"""R processes against one: context-parallel decode over ``torch.distributed`` equals the
same ranks simulated in one process, bit for bit (docs/context_parallel.md).

Each rank makes the same inputs from ``--seed``, keeps only its own shard of the cache,
runs exact, S²ANTA-prop (both exchanges), S²ANTA-flash and Double-P (centroid, sampled,
and sampled after appends) over
:class:`~stochattn.context_parallel.dist.TorchCollectives`, and compares every output with
:class:`~stochattn.context_parallel.core.SimulatedCollectives` driving all R ranks in this
process. Rank 0 prints one line per algorithm and, with ``--out``, writes the JSON.

    torchrun --standalone --nproc-per-node 4 -m stochattn.context_parallel.check
    torchrun --standalone --nproc-per-node 2 -m stochattn.context_parallel.check --backend gloo

The cache is NumPy on every backend (the reference's phases): under NCCL only the
collectives' payloads go through the GPUs. :func:`run_rank` is the same check for a
launcher that passes the rank and an ``init_method`` (the tests spawn it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

from . import core, santa
from .dist import TorchCollectives
from .doublep import build_shard_indexes, cp_doublep_append, cp_doublep_attention

ALGORITHMS = ("exact", "prop-tiles", "prop-totals", "flash", "doublep", "doublep-sample",
              "doublep-append")


def default_config(**over) -> dict:
    cfg = dict(batch=2, kv_heads=2, group=4, tokens=1000, head_dim=32, tile=32, budget=64,
               sampler="systematic", seed=3, offset=5, scale=0.2, clusters=8, n_sink=4,
               window=32, p1=0.9, p2=0.6, short_last=True, grow=40)
    cfg.update(over)
    return cfg


def make_inputs(cfg):
    """(q, k, v, seq_lens) of the check: Gaussian, the last sequence cut short (so a late
    rank holds no live token of it) when ``short_last``."""
    rng = np.random.default_rng(cfg["seed"])
    B, Hkv, G, N, D = (cfg[x] for x in ("batch", "kv_heads", "group", "tokens", "head_dim"))
    q = 2.0 * rng.standard_normal((B, Hkv * G, D))
    k = rng.standard_normal((B, Hkv, N, D))
    v = rng.standard_normal((B, Hkv, N, D))
    lens = np.full(B, N, dtype=np.int64)
    if cfg["short_last"] and B > 1:
        lens[-1] = N // 3
    return q, k, v, lens


def run_all(q, shards, comm, cfg) -> dict:
    """Every algorithm over ``comm``: {name: (out, diagnostics or None)} of the first local
    rank; ``shards`` holds at least the ranks ``comm`` drives."""
    kw = dict(budget=cfg["budget"], sampler=cfg["sampler"], tile_size=cfg["tile"],
              seed=cfg["seed"], offset=cfg["offset"])
    res = {"exact": core.cp_exact_attention(q, shards, comm, cfg["scale"]),
           "prop-tiles": santa.cp_prop_attention(q, shards, comm, cfg["scale"], **kw),
           "prop-totals": santa.cp_prop_attention(q, shards, comm, cfg["scale"],
                                                  exchange="totals", **kw),
           "flash": santa.cp_flash_attention(q, shards, comm, cfg["scale"], **kw)}
    mine = [s for s in shards if s.rank in comm.local_ranks]
    dp = dict(n_sink=cfg["n_sink"], window=cfg["window"])
    build = dict(n_clusters=cfg["clusters"], iterations=4, seed=cfg["seed"], **dp)
    ixs = build_shard_indexes(mine, **build)
    dp.update(p1=cfg["p1"], p2=cfg["p2"])
    sample = dict(approx="sample", budget=cfg["budget"], sampler=cfg["sampler"],
                  seed=cfg["seed"], offset=cfg["offset"])
    res["doublep"] = cp_doublep_attention(q, mine, ixs, comm, cfg["scale"], **dp)
    res["doublep-sample"] = cp_doublep_attention(q, mine, ixs, comm, cfg["scale"], **dp,
                                                 **sample)
    # Decode growth: the indexes built ``grow`` tokens earlier, the tokens appended since.
    earlier = [_at_lengths(s, np.maximum(s.seq_lens - cfg["grow"], 0)) for s in mine]
    grown = build_shard_indexes(earlier, **build)
    cp_doublep_append(mine, grown, n_sink=cfg["n_sink"], window=cfg["window"])
    res["doublep-append"] = cp_doublep_attention(q, mine, grown, comm, cfg["scale"], **dp,
                                                 **sample)
    return {name: (r.out, r.diagnostics) for name, r in res.items()}


def _at_lengths(s: core.Shard, seq_lens) -> core.Shard:
    """The shard of the same cache at other (global) lengths."""
    return dataclasses.replace(s, lens=np.clip(seq_lens - s.start, 0, s.end - s.start),
                               seq_lens=seq_lens)


def _shards(cfg, k, v, lens, world):
    bounds = core.shard_bounds(cfg["tokens"], world, align=cfg["tile"])
    return core.split_cache(k, v, lens, bounds)


def compare(cfg, world: int, rank: int, comm) -> dict:
    """This rank's outputs over ``comm`` against the simulation's: per algorithm whether
    the outputs (and Double-P's diagnostics) are equal bit for bit, and the max |diff|."""
    q, k, v, lens = make_inputs(cfg)
    shards = _shards(cfg, k, v, lens, world)
    got = run_all(q, [shards[rank]], comm, cfg)
    sim = core.SimulatedCollectives(world)
    want = run_all(q, shards, sim, cfg)
    report = {}
    for name in ALGORITHMS:
        (o, d), (w, dw) = got[name], want[name]
        same = bool(np.array_equal(o, w, equal_nan=True))
        report[name] = dict(bitwise=same, max_abs_diff=float(np.nanmax(np.abs(o - w)))
                            if o.size else 0.0)
        if d is not None:  # Double-P: the selection is global, the exact tokens per rank
            report[name]["bitwise"] = same and all(
                np.array_equal(d[key], dw[key]) for key in d if key != "tokens_exact")
            report[name].update(tokens_exact_local=d["tokens_exact"].tolist(),
                                tokens_exact_all=dw["tokens_exact"].tolist())
    return report


def summary_ok(reports) -> bool:
    """Every rank bit for bit on every algorithm, and the ranks' exact Double-P tokens
    adding up to the simulation's count over all ranks."""
    bitwise = all(r[name]["bitwise"] for r in reports for name in ALGORITHMS)
    counts = all(np.array_equal(np.sum([r[name]["tokens_exact_local"] for r in reports], axis=0),
                                reports[0][name]["tokens_exact_all"])
                 for name in ALGORITHMS if "tokens_exact_local" in reports[0][name])
    return bitwise and counts


def run_rank(rank: int, world: int, init_method: str, backend: str, out_dir: str,
             cfg: dict | None = None, collectives=TorchCollectives) -> None:
    """Initialise the process group, run :func:`compare` over ``collectives()``, write
    ``rank<r>.json`` to ``out_dir`` (for launchers that spawn functions, e.g.
    ``torch.multiprocessing``)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        report = compare(cfg or default_config(), world, rank, collectives())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default=None, help="nccl (default with CUDA) or gloo")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--out", default=None, help="rank 0 writes the JSON report here")
    args = ap.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    cfg = default_config(**({} if args.tokens is None else {"tokens": args.tokens}))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        report = compare(cfg, world, rank, TorchCollectives())
        everyone = [None] * world
        dist.all_gather_object(everyone, report)
    finally:
        dist.destroy_process_group()
    ok = summary_ok(everyone)
    if rank == 0:
        for name in ALGORITHMS:
            same = all(r[name]["bitwise"] for r in everyone)
            diff = max(r[name]["max_abs_diff"] for r in everyone)
            print(f"{name:14s} {world} ranks ({backend}) vs simulated: "
                  f"{'bit for bit' if same else f'DIFFERENT (max |diff| {diff:.3g})'}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(backend=backend, world_size=world, config=cfg, ranks=everyone,
                               ok=ok), f, indent=1)
        print("all equal" if ok else "NOT EQUAL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
