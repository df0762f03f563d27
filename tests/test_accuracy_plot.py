"""benchmarks/plot_accuracy.py renders a sweep JSON (benchmarks/accuracy.py's format) to a PNG.

matplotlib comes with the ``eval`` extra, which CI installs: this test is not skipped
without it, it fails. No statistics here: the assertions are exact properties of the file.
"""

from __future__ import annotations

import json

from benchmarks.accuracy import combine
from benchmarks.plot_accuracy import main


def _run(label, family, estimator, options, losses, loss_exact, v_frac):
    """A minimal EvalResult-like dict as benchmarks.accuracy stores in ``runs``."""
    mean = sum(losses) / len(losses)
    return dict(label=label, family=family, play="hamlet", estimator=estimator,
                options=options, loss_exact=loss_exact, loss_per_seed=losses,
                delta_loss=mean - loss_exact, delta_loss_se_positions=0.01,
                delta_loss_se_seeds_pooled=0.002 if len(losses) > 1 else float("nan"),
                seconds_per_seed=[1.0] * len(losses),
                diagnostics=dict(k_read_fraction=1.0, v_read_fraction=v_frac,
                                 v_rows_read=v_frac * 1500))


def test_plot_two_rows(tmp_path):
    runs = [_run("santa-systematic-64", "SANTA prop systematic", "santa",
                 dict(budget=64, sampler="systematic", schedule="prop"), [3.51, 3.53], 3.50,
                 0.03),
            _run("topk-64", "oracle top-k", "topk", dict(budget=64), [3.60], 3.50, 0.05)]
    rows = combine(runs)
    assert [r["label"] for r in rows] == ["santa-systematic-64", "topk-64"]
    assert abs(rows[0]["delta_loss"] - 0.02) < 1e-12
    assert rows[0]["delta_loss_ci95"] > 0 and rows[1]["delta_loss_ci95"] is None
    data = dict(plays=["hamlet"], n_tokens=2048, n_positions=128, stride=8, runs=runs,
                rows=rows)
    src, out = tmp_path / "acc.json", tmp_path / "acc.png"
    src.write_text(json.dumps(data))
    assert main(["--json", str(src), "--out", str(out)]) == 0
    head = out.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # axes, two lines and labels, not an empty canvas
