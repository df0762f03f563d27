"""bench/compare_revisions.py: the CPU half (extracting revisions, parsing cases)."""

from __future__ import annotations

import os
import subprocess

import pytest

from bench.compare_revisions import ROOT, parse_cases, prepare


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
