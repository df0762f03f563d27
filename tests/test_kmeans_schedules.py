"""tools/kmeans_schedules.py on a small instance: every schedule runs, passes are counted as
documented, and more rounds never give a worse objective than the default stop."""

from __future__ import annotations

import json

from tools.kmeans_schedules import main


def test_kmeans_schedules_small(tmp_path, capsys):
    out = tmp_path / "s.json"
    main(["--tokens", "2048", "--heads", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 15
    tol = {r["tol"]: r for r in rows if r["kind"] == "tol"}
    # passes: whole rounds plus the final assignment; a tighter stop never stops sooner
    assert all(float(r["passes"]).is_integer() and r["passes"] >= 2 for r in tol.values())
    assert tol[0.02]["passes"] >= tol[0.05]["passes"] >= tol[0.1]["passes"]
    warm = [r for r in rows if r["kind"] == "warm"]
    assert all(r["passes"] > 1 for r in warm)
    assert all(r["objective_vs_10"] > -0.05 for r in rows)  # ten rounds are about the best
    assert "objective vs 10 rounds" in capsys.readouterr().out
