"""The cluster mass study's bookkeeping (stochattn.eval.mass_study): labels, the paired
rows against paper at the same cluster count, the table. The study itself runs the model
(tools/gpu/run_mass_study_gpu.sh); its estimators are tested in test_cluster_mass.py and
test_mass_batched.py."""

import math

import numpy as np
import pytest

from stochattn.eval import mass_study as ms


def _play(play, configs, rng, n=40):
    exact = rng.uniform(0, 5, n)
    res = dict(play=play, loss_exact=exact.tolist(), mass_error={}, configs={})
    for c, shift in configs:
        diag = dict(k_read=0.2, v_read=0.2, k_read_all=0.3, v_read_all=0.25,
                    estimated_mass=0.9, cluster_true_mass=0.9, true_mass=0.95,
                    approx_log_mass_error=0.0, clusters_selected=10.0, clusters_exact=3.0)
        res["configs"][c["label"]] = dict(c, losses=(exact + shift).tolist(), diagnostics=diag)
    return res


def _cfg(mass, value, ratio=16):
    return dict(label=ms._label(mass, value, 1.0, 0.95, 0.7, ratio), mass=mass, value=value,
                alpha=1.0, p1=0.95, p2=0.7, cluster_ratio=ratio)


def test_rows_pair_with_paper_at_the_same_cluster_count():
    rng = np.random.default_rng(0)
    configs = [(_cfg("paper", "mean"), 0.04), (_cfg("paper", "mean", 8), 0.02),
               (_cfg("sub", "tilt", 8), 0.015), (_cfg("sub", "tilt", 64), 0.03)]
    per = [_play("a", configs, rng), _play("b", configs, rng)]
    rows = {r["label"]: r for r in ms.combine(per, ["a", "b"])[0]}
    assert set(rows) == {"paper-0.95-0.7", "paper-0.95-0.7-r8", "sub+v-tilt-0.95-0.7-r8",
                         "sub+v-tilt-0.95-0.7-r64"}
    # constant shifts: exact differences (paired with paper at r8; r64 has none: default)
    assert math.isclose(rows["sub+v-tilt-0.95-0.7-r8"]["vs_paper"], 0.015 - 0.02, abs_tol=1e-12)
    assert math.isclose(rows["sub+v-tilt-0.95-0.7-r64"]["vs_paper"], 0.03 - 0.04, abs_tol=1e-12)
    assert rows["paper-0.95-0.7-r8"]["cluster_ratio"] == 8
    assert math.isclose(rows["paper-0.95-0.7"]["delta_loss"], 0.04, abs_tol=1e-12)
    table = ms.markdown_table(list(rows.values()))
    assert "prompt / 64" in table and "30.0% / 25.0%" in table
    old = dict(rows["paper-0.95-0.7"])
    del old["k_read_all"], old["v_read_all"]
    assert "n/a" in ms.markdown_table([old])


def test_reference_path_refuses_a_second_cluster_count():
    with pytest.raises(ValueError, match="configs"):
        ms.run_play("hamlet", configs=[_cfg("paper", "mean", 8)])


@pytest.mark.parametrize("grid", ["8k", "8k-sub"])
def test_grid_labels_are_unique_and_each_row_has_its_paper(grid):
    labels = [c["label"] for c in ms.GRIDS[grid]]
    assert len(labels) == len(set(labels))
    for c in ms.GRIDS[grid]:
        assert ms._label("paper", "mean", 1.0, c["p1"], c["p2"]) in labels


def _split(run, labels):
    """The part of `run` holding only `labels` (a later `--only` call)."""
    return dict(run, configs={k: v for k, v in run["configs"].items() if k in labels})


def test_join_runs_unites_parts_of_one_play_and_seed():
    rng = np.random.default_rng(1)
    configs = [(_cfg("paper", "mean"), 0.04), (_cfg("sub", "mean"), 0.02),
               (_cfg("sub-near", "mean"), 0.01)]
    full = [dict(_play(p, configs, rng), seed=0, positions=[1, 2]) for p in ("a", "b")]
    near = ["sub-near-0.95-0.7"]
    parts = ([_split(r, {"paper-0.95-0.7", "sub-0.95-0.7"}) for r in full]
             + [_split(r, near) for r in full])
    joined = ms.join_runs(parts)
    assert [(r["play"], sorted(r["configs"])) for r in joined] == [
        (p, sorted(full[0]["configs"])) for p in ("a", "b")]
    rows = {r["label"]: r for r in ms.combine(joined, ["a", "b"])[0]}
    assert math.isclose(rows["sub-near-0.95-0.7"]["vs_paper"], 0.01 - 0.04, abs_tol=1e-12)
    # the parts are not changed in place
    assert set(parts[0]["configs"]) == {"paper-0.95-0.7", "sub-0.95-0.7"}


def test_join_runs_refuses_mismatched_or_doubled_parts():
    rng = np.random.default_rng(2)
    run = dict(_play("a", [(_cfg("paper", "mean"), 0.04)], rng), seed=0, positions=[1, 2])
    with pytest.raises(ValueError, match="in two parts"):
        ms.join_runs([run, run])
    other = dict(run, configs={}, loss_exact=[x + 0.1 for x in run["loss_exact"]])
    with pytest.raises(ValueError, match="positions or exact losses"):
        ms.join_runs([run, other])
    # another seed is another run, not a part
    assert len(ms.join_runs([run, dict(run, seed=1)])) == 2


def test_combine_leaves_out_a_configuration_some_run_lacks():
    rng = np.random.default_rng(3)
    configs = [(_cfg("paper", "mean"), 0.04), (_cfg("sub", "mean"), 0.02)]
    a = dict(_play("a", configs, rng), seed=0)
    b = _split(dict(_play("b", configs, rng), seed=0), {"paper-0.95-0.7"})
    rows = ms.combine([a, b], ["a", "b"])[0]
    assert [r["label"] for r in rows] == ["paper-0.95-0.7"]
    # two seeds of one play, the second without "sub": seed means over the common labels
    a1 = _split(dict(a, seed=1), {"paper-0.95-0.7"})
    rows = ms.combine([a, a1], ["a"])[0]
    assert [r["label"] for r in rows] == ["paper-0.95-0.7"]


def test_rows_without_paper_have_no_paired_difference():
    """An --only part without paper at its setting (tools/gpu/run_mass_study_gpu.sh ONLY=):
    its table prints, with NaN where the paired difference would be."""
    rng = np.random.default_rng(4)
    per = [dict(_play("a", [(_cfg("sub-near", "mean"), 0.01)], rng), seed=0)]
    rows = ms.combine(per, ["a"])[0]
    assert math.isnan(rows[0]["vs_paper"]) and math.isclose(rows[0]["delta_loss"], 0.01)
    assert "nan" in ms.markdown_table(rows)
