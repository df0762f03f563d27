"""benchmarks/bench_budgets.py's launch breakdown (``--launches``) on a stand-in plan: each
measurement runs exactly one launch of the targeted call, in call order, and the plan's
launches are restored afterwards (also when a measurement fails). No GPU: the plan's
launches are recorders, ``measure`` runs the call and returns what it launched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import bench_budgets as bb
from benchmarks import bench_decode as bd


def _plan(log, *, tiles=True, pilot_sets=2):
    def rec(name):
        return lambda *a, **kw: log.append(name)

    base = SimpleNamespace(logits=rec("pass1_logits"), tiles=rec("pass1_tiles") if tiles else None)
    return SimpleNamespace(base=base,
                           pilot_launches=tuple(rec(f"pilot_{i}") for i in range(pilot_sets)),
                           moment_launch=rec("moment"), budgets_launch=rec("budgets"),
                           main_launch=rec("main"))


def _run(plan):
    """The targeted call's launch order (stochattn.cuda.santa._TargetedPlan.run)."""
    plan.base.logits()
    if plan.base.tiles is not None:
        plan.base.tiles()
    for launch in plan.pilot_launches:
        launch()
    plan.moment_launch()
    plan.budgets_launch()
    plan.main_launch()


@pytest.mark.parametrize("tiles, sets", [(True, 2), (False, 1)])
def test_each_measurement_runs_one_launch_and_the_plan_is_restored(tiles, sets):
    log = []
    plan = _plan(log, tiles=tiles, pilot_sets=sets)
    before = (plan.base.logits, plan.base.tiles, plan.pilot_launches, plan.moment_launch,
              plan.budgets_launch, plan.main_launch)
    slots = bb.launch_slots(plan)
    names = [s[0] for s in slots]
    assert names == (["pass1_logits"] + (["pass1_tiles"] if tiles else [])
                     + [f"pilot_{i}" for i in range(sets)] + ["moment", "budgets", "main"])

    def measure():
        del log[:]
        _run(plan)
        return list(log)

    alone = bd.launches_alone(measure, slots)
    assert alone == {n: [n] for n in names}
    assert (plan.base.logits, plan.base.tiles, plan.pilot_launches, plan.moment_launch,
            plan.budgets_launch, plan.main_launch) == before
    assert type(plan.pilot_launches) is tuple
    del log[:]
    _run(plan)
    assert log == names  # restored: the whole call again


def test_restored_after_a_failing_measurement():
    log = []
    plan = _plan(log)
    main = plan.main_launch
    with pytest.raises(RuntimeError):
        bd.launches_alone(lambda: (_ for _ in ()).throw(RuntimeError("x")), bb.launch_slots(plan))
    assert plan.main_launch is main and len(plan.pilot_launches) == 2


def test_plan_of_catches_the_plan_cache_answer(monkeypatch):
    from stochattn.cuda.runtime import inputs

    built = object()
    monkeypatch.setattr(inputs, "cached_plan", lambda key, build: build())
    assert bd.plan_of(lambda: inputs.cached_plan("k", lambda: built)) is built
    assert inputs.cached_plan("k", lambda: 3) == 3  # the spy is gone
    with pytest.raises(RuntimeError, match="no GPU plan"):
        bd.plan_of(lambda: None)


def _doublep_plan(log, *, pilot=True, merge=True):
    def rec(name):
        return lambda *a, **kw: log.append(name)

    names = dict(bb.DOUBLEP_LAUNCHES)
    plan = SimpleNamespace(targeted=object(), **{attr: rec(name) for name, attr in names.items()})
    if not pilot:
        plan.split_pilot = None
    if not merge:
        plan.merge = None
    return plan


def _doublep_run(plan):
    """The targeted Double-P call's launch order (stochattn.cuda.doublep._DoublePPlan.run)."""
    for name, attr in bb.DOUBLEP_LAUNCHES:
        launch = getattr(plan, attr)
        if launch is not None:
            launch()


@pytest.mark.parametrize("pilot, merge", [(True, True), (False, True), (True, False)])
def test_doublep_slots_each_measurement_runs_one_launch(pilot, merge):
    log = []
    plan = _doublep_plan(log, pilot=pilot, merge=merge)
    slots = bb.doublep_launch_slots(plan)
    want = [n for n, a in bb.DOUBLEP_LAUNCHES
            if not (a == "split_pilot" and not pilot) and not (a == "merge" and not merge)]
    assert [s[0] for s in slots] == want

    def measure():
        del log[:]
        _doublep_run(plan)
        return list(log)

    assert bd.launches_alone(measure, slots) == {n: [n] for n in want}
    del log[:]
    _doublep_run(plan)
    assert log == want  # restored


def test_doublep_slots_need_a_targeted_plan():
    with pytest.raises(ValueError, match="`plan`"):
        bb.doublep_launch_slots(SimpleNamespace(targeted=None))
