"""tools/compare_revisions.py: the CPU half (extracting revisions, parsing cases)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tools.compare_revisions import ROOT, parse_cases, prepare


def test_parse_cases():
    assert parse_cases("8:32768,1:131072") == [(8, 32768), (1, 131072)]
    with pytest.raises(ValueError, match="cases"):
        parse_cases("8")


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="not a git checkout")
def test_prepare_extracts_the_revision(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    shas = prepare(["HEAD"], str(tmp_path))
    assert shas == [head]
    assert (tmp_path / "revs.txt").read_text().split() == [head]
    tracked = subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD", "stochattn"],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    got = sorted(str(p.relative_to(tmp_path / head)) for p in (tmp_path / head).rglob("*")
                 if p.is_file())
    assert got == sorted(tracked)
    committed = subprocess.run(["git", "show", "HEAD:stochattn/__init__.py"], cwd=ROOT,
                               check=True, capture_output=True, text=True).stdout
    assert (tmp_path / head / "stochattn" / "__init__.py").read_text() == committed


class _FakeChild:
    """A child process whose output is given: rows streamed, then the final record."""

    outputs: list = []

    def __init__(self, argv, **kwargs):
        self.stdout, self.rc = _FakeChild.outputs.pop(0)

    def wait(self):
        return self.rc


def test_time_revisions_streams_rows_and_keeps_failures(tmp_path, monkeypatch, capsys):
    import json

    import tools.compare_revisions as cr

    (tmp_path / "revs.txt").write_text("aaaaaaa\nbbbbbbb\n")
    row = {"batch": 1, "context": 32768, "us": 40.0, "sdpa_us": 38.0, "floor_us": 31.6,
           "err": 1e-3}
    final = {"copy_Bps": 4.2e12, "kernel": "tc", "rows": [row]}
    _FakeChild.outputs = [
        ([cr.ROW_MARK + json.dumps(row) + "\n", cr.MARK + json.dumps(final) + "\n"], 0),
        (["Traceback: boom\n"], 1),  # revision b fails
        ([cr.ROW_MARK + json.dumps(row) + "\n", cr.MARK + json.dumps(final) + "\n"], 0),
    ]
    monkeypatch.setattr(cr.subprocess, "Popen", _FakeChild)
    out_json = tmp_path / "r.json"
    res = cr.time_revisions([(1, 32768)], revs_dir=str(tmp_path), json_path=str(out_json))
    assert [r["rev"] for r in res] == ["aaaaaaa", "bbbbbbb", "aaaaaaa"]  # A B A
    assert res[1]["failed"] and "boom" in res[1]["output"]
    assert res[0]["rows"] == [row] and res[2]["kernel"] == "tc"
    assert json.loads(out_json.read_text()) == res
    printed = capsys.readouterr().out
    assert "aaaaaaa B=1 N=32768: 40.0 us (79% of floor), SDPA 38.0 us" in printed
