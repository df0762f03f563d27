"""tools/sass_stats.py: parsing nvdisasm's output into functions and loops (no GPU, no
nvdisasm needed: a hand-written listing in nvdisasm's format)."""

from __future__ import annotations

import collections

from tools.sass_stats import loops, opcode, parse_sass

_LISTING = """\
\t.section\t.text._Z1kPf,"ax",@progbits
_Z1kPf:
.text._Z1kPf:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
.L_x_1:
        /*0020*/                   FFMA R3, R2, R2, R3 ;
        /*0030*/               @P1 BRA `(.L_x_1) ;
        /*0040*/              @!P0 BRA `(.L_x_0) ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0060*/                   EXIT ;
\t.section\t.text._Z1gv,"ax",@progbits
.text._Z1gv:
        /*0000*/                   EXIT ;
"""


def test_parse_functions_and_labels():
    funcs = parse_sass(_LISTING)
    assert list(funcs) == ["_Z1kPf", "_Z1gv"]
    k = funcs["_Z1kPf"]
    assert len(k) == 7 and len(funcs["_Z1gv"]) == 1
    assert [lab for lab, _ in k] == [None, ".L_x_0", ".L_x_1", None, None, None, ".L_x_2"]
    assert [opcode(t) for _, t in k] == ["LDC", "LDG", "FFMA", "BRA", "BRA", "BRA", "EXIT"]


def test_loops_are_backward_branches_outermost_first():
    k = parse_sass(_LISTING)["_Z1kPf"]
    assert loops(k) == [(1, 4), (2, 3)]  # the forward BRA to .L_x_2 is no loop
    ops = collections.Counter(opcode(t) for _, t in k[1:5])
    assert ops == {"LDG": 1, "FFMA": 1, "BRA": 2}
