"""Which estimator a framework integration runs at decode, with which parameters (no torch).

:func:`make_config` checks everything a user passes to an integration (for example
:func:`stochattn.integrations.transformers.register`) before any model runs, and returns a
frozen :class:`DecodeAttentionConfig`. It imports neither PyTorch nor transformers, so the
argument handling is tested where neither is installed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from .. import _validation as val
from ..doublep import DoublePPlan
from ..reference.samplers import SAMPLERS
from ..reference.santa import SCHEDULES

__all__ = ["ESTIMATORS", "DecodeAttentionConfig", "make_config", "check_name",
           "default_clusters", "rng_offset"]

ESTIMATORS = ("exact", "santa", "doublep")

# Parameters each estimator takes, besides the common ones.
_COMMON = ("seed", "check_mask")
_PARAMS = {
    "exact": (),
    "santa": ("budget", "sampler", "schedule", "tile_size", "exact_fallback"),
    "doublep": ("p1", "p2", "approx", "budget", "sampler", "n_clusters", "tokens_per_cluster",
                "iterations", "n_sink", "window"),
}

# Attention implementations that transformers itself defines: an integration never
# replaces them under their own name.
RESERVED_NAMES = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4",
                  "flex_attention", "paged_attention", "sdpa_paged", "eager_paged")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class DecodeAttentionConfig:
    """One decode estimator and its parameters, checked (build it with :func:`make_config`).

    Attributes
    ----------
    estimator : {"exact", "santa", "doublep"}
    seed : int
        Seed of the counter-based generator, in [0, 2**64); the per-call offset is
        ``(decode_step * n_layers + layer) mod 2**32`` (:func:`rng_offset`).
    check_mask : bool
        Check that an attention mask keeps a prefix of every sequence's keys (one device
        synchronisation per forward step, shared by all layers).
    budget : int or None
        SANTA: S, points per query head. Double-P: points of ``approx="sample"``.
    sampler, schedule : str
        SANTA sampler and kernel schedule; Double-P uses ``sampler`` with ``"sample"``.
    tile_size : int
        SANTA tile of the prop and flash schedules.
    exact_fallback : bool
        SANTA: exact attention when the cache tensor has at most ``budget`` rows (a
        preallocated cache counts its capacity).
    p1, p2 : float
        Double-P thresholds, with ``p2 <= p1`` or ``p2 = 1`` (:func:`make_config` clamps a
        larger p2 to p1).
    approx : {"centroid", "sample"}
        Double-P: how the approximated clusters enter.
    n_clusters : int or None
        Double-P clusters per (sequence, KV head); None: :func:`default_clusters`.
    tokens_per_cluster : int
        Double-P: tokens per cluster of the default cluster count.
    iterations, n_sink, window : int
        Double-P k-means iterations, sink tokens and exact window.
    """

    estimator: str
    seed: int = 0
    check_mask: bool = True
    budget: int | None = None
    sampler: str = "systematic"
    schedule: str = "prop"
    tile_size: int = 64
    exact_fallback: bool = True
    p1: float = 0.95
    p2: float = 0.7
    approx: str = "centroid"
    n_clusters: int | None = None
    tokens_per_cluster: int = 32
    iterations: int = 10
    n_sink: int = 4
    window: int = 64

    @property
    def parameters(self) -> dict:
        """The parameters that apply to this estimator, by name (for logs and result files)."""
        names = ("estimator",) + _COMMON + _PARAMS[self.estimator]
        return {name: getattr(self, name) for name in names}


def make_config(estimator, **params) -> DecodeAttentionConfig:
    """Check an estimator choice and its parameters.

    Parameters
    ----------
    estimator : {"exact", "santa", "doublep"}
        ``"exact"``: :func:`stochattn.exact_attention`. ``"santa"``:
        :func:`stochattn.santa_attention`. ``"doublep"``: :func:`stochattn.doublep_attention`
        with an index built at the end of prefill and grown with every decoded token.
    **params
        Common: ``seed`` (int in [0, 2**64), default 0), ``check_mask`` (bool, default True).

        ``"santa"``: ``budget`` (int >= 1, required), ``sampler`` ("systematic",
        "stratified" or "iid"; default "systematic"), ``schedule`` ("prop", "global" or
        "flash"; default "prop", the one the GPU has), ``tile_size`` (int >= 1, default 64;
        the GPU takes 32, 64, 128 or 256), ``exact_fallback`` (bool, default True: exact
        attention while the cache tensor has at most ``budget`` rows, where sampling would
        read no fewer rows).

        ``"doublep"``: ``p1``, ``p2`` (each a real number in (0, 1]; default 0.95 and 0.7;
        p2 in (p1, 1) cannot be reached and is clamped to p1 with a ``UserWarning`` naming
        `p2`, as :func:`stochattn.doublep_attention` does), ``approx``
        ("centroid" or "sample"), ``budget`` (required with "sample", None with "centroid"),
        ``sampler`` (with "sample"), ``n_clusters`` (int >= 1 or None: one cluster per
        ``tokens_per_cluster`` tokens of the longest prompt, default 32; capped at the
        cache length), ``iterations`` (>= 0, default 10), ``n_sink`` (>= 0, default 4),
        ``window`` (>= 0, default 64).

    Returns
    -------
    DecodeAttentionConfig

    Raises
    ------
    TypeError
        A parameter the estimator does not take, or a value of the wrong type.
    ValueError
        An unknown estimator, a missing ``budget``, a value out of range (NaN included).

    Warns
    -----
    UserWarning
        Double-P ``p2`` above ``p1`` (and below 1), clamped to ``p1``.

    Examples
    --------
    >>> from stochattn.integrations import make_config
    >>> make_config("santa", budget=256, sampler="stratified").parameters["budget"]
    256
    >>> make_config("doublep", p1=0.99, p2=0.8).parameters["approx"]
    'centroid'
    """
    val.check_choice("estimator", estimator, ESTIMATORS)
    allowed = _COMMON + _PARAMS[estimator]
    for name in params:
        if name not in allowed:
            owner = [e for e in ESTIMATORS if name in _PARAMS[e]]
            hint = f" (a parameter of {', '.join(map(repr, owner))})" if owner else ""
            raise TypeError(
                f"`{name}` is not a parameter of estimator={estimator!r}{hint}; it takes "
                f"{', '.join(allowed)}"
            )
    defaults = {f.name: f.default for f in dataclasses.fields(DecodeAttentionConfig)}
    get = lambda name: params.get(name, defaults[name])  # noqa: E731
    fields = {"estimator": estimator}
    fields["seed"], _ = val.check_seed_offset(get("seed"), 0)
    fields["check_mask"] = val.check_bool("check_mask", get("check_mask"))
    if estimator == "santa":
        if get("budget") is None:
            raise ValueError("`budget` is required with estimator='santa' (an integer >= 1), "
                             "got None")
        fields["budget"] = val.check_budget("budget", get("budget"))
        fields["sampler"] = val.check_choice("sampler", get("sampler"), SAMPLERS)
        fields["schedule"] = val.check_choice("schedule", get("schedule"), SCHEDULES)
        fields["tile_size"] = val.check_positive_int("tile_size", get("tile_size"))
        fields["exact_fallback"] = val.check_bool("exact_fallback", get("exact_fallback"))
    elif estimator == "doublep":
        # The decode options go through the plan the integration will run, so that they
        # follow the library's rules with its messages, not a second copy of them: p1 and
        # p2 each a real number in (0, 1] (TypeError / ValueError naming it; NaN fails),
        # p2 in (p1, 1) clamped to p1 with a UserWarning naming `p2` (DoublePPlan), and
        # approx, budget, sampler.
        plan = DoublePPlan(p1=get("p1"), p2=get("p2"), approx=get("approx"),
                           budget=get("budget"), sampler=get("sampler"))
        for name in ("p1", "p2", "approx", "budget", "sampler"):
            fields[name] = getattr(plan, name)
        n_clusters = get("n_clusters")
        if n_clusters is not None:
            fields["n_clusters"] = val.check_positive_int("n_clusters", n_clusters)
        fields["tokens_per_cluster"] = val.check_positive_int("tokens_per_cluster",
                                                              get("tokens_per_cluster"))
        for name in ("iterations", "n_sink", "window"):
            fields[name] = val.check_nonnegative_int(name, get(name))
    return DecodeAttentionConfig(**fields)


def check_name(name) -> str:
    """The name an attention implementation is registered under: letters, digits and
    underscores, starting with a letter, without "flash" (transformers 5.24 treats such
    names as flash-attention kernels), and not one of transformers' own names."""
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str, got {type(name).__name__}")
    if not _NAME.match(name):
        raise ValueError(
            "`name` must be letters, digits and underscores starting with a letter (a name "
            f"with '/' or '|' means something else to transformers), got {name!r}"
        )
    if "flash" in name.lower():
        raise ValueError(
            "`name` must not contain 'flash': transformers takes any such name for a "
            f"flash-attention kernel and refuses to set it, got {name!r}"
        )
    if name in RESERVED_NAMES:
        raise ValueError(
            f"`name` must not be one of transformers' own attention implementations "
            f"({', '.join(RESERVED_NAMES)}), got {name!r}"
        )
    return name


def default_clusters(config: DecodeAttentionConfig, longest: int, tokens: int) -> int:
    """Double-P cluster count for a prompt whose longest sequence has ``longest`` tokens in a
    cache of ``tokens`` rows: ``config.n_clusters`` or ``ceil(longest / tokens_per_cluster)``,
    at least 1 and at most ``tokens`` (build_doublep_index's bound)."""
    wanted = config.n_clusters
    if wanted is None:
        wanted = math.ceil(max(longest, 1) / config.tokens_per_cluster)
    return max(1, min(wanted, tokens))


def rng_offset(decode_step: int, n_layers: int, layer: int) -> int:
    """Per-call counter of the random streams: ``(decode_step * n_layers + layer) mod 2**32``
    (docs/conventions.md), so that every layer and decode step draws fresh points."""
    return (int(decode_step) * int(n_layers) + int(layer)) % 2**32
