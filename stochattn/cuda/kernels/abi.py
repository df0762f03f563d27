"""The kernels' contracts, read from the CUDA sources: the one declaration of each kernel.

A ``__global__`` kernel's signature in its ``.cu``/``.cuh`` file is the only place where its
name, template parameters and arguments (C types and names) are written. This module
parses those signatures (and the ``constexpr int`` constants and ``enum`` values that the
host shares with the device) from the family's expanded source, and derives from them:

- the NVRTC name expressions (:meth:`Kernel.expr`: ``expr(T="stochattn::f16", D=128,
  GMAX=4)`` -> ``"exact_decode_chunk<stochattn::f16, 128, 4>"``, every template parameter
  named, no other);
- the typed launch arguments (:meth:`Kernel.bind` for a packed launch, whose per-call
  arguments are named; :meth:`Kernel.args` for a one-off launch): every argument is
  converted to the NumPy scalar of its C type (pointers to ``uint64``), so no launch passes
  an untyped Python scalar and no argument is found by its position.

Nothing here imports CuPy; the sources are read once per family.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["Arg", "Kernel", "Bound", "kernel", "kernels", "constant", "enum"]

# C types of kernel arguments -> the NumPy scalar type of their launch value.
_SCALARS = {"int": np.int32, "unsigned": np.uint32, "unsigned int": np.uint32,
            "long long": np.int64, "unsigned long long": np.uint64, "float": np.float32,
            "double": np.float64}

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_KERNEL = re.compile(
    r"(?:template\s*<(?P<template>[^<>]*)>\s*)?__global__\s+void\s+"
    r"(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?"
    r"(?P<name>\w+)\s*\((?P<args>[^)]*)\)\s*\{")
_CONSTEXPR = re.compile(r"^constexpr\s+int\s+(\w+)\s*=\s*([^;]+);", re.M)
_ENUM = re.compile(r"\benum\s+(\w+)\s*(?::\s*[\w ]+)?\{([^}]*)\}")


@dataclass(frozen=True)
class Arg:
    """One kernel argument: its name, its C type as written (qualifiers dropped) and the
    NumPy scalar type its launch value takes (``uint64`` for every pointer)."""

    name: str
    ctype: str
    scalar: type

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


class Bound(NamedTuple):
    """A kernel's typed arguments with the positions of the per-call ones (in the order
    they are named), as :class:`stochattn.cuda.runtime.launch.Packed` takes them."""

    args: tuple
    variable: tuple


@dataclass(frozen=True)
class Kernel:
    """The declaration of one ``__global__`` kernel, as parsed from its source."""

    name: str
    template: tuple  # (kind, name) pairs: ("typename", "T"), ("int", "D"), ("bool", "QHAT")
    args: tuple  # Arg per parameter, in order
    defaults: tuple = ()  # (name, value) of the template parameters with a default

    @property
    def arg_names(self) -> tuple:
        return tuple(a.name for a in self.args)

    def expr(self, **params) -> str:
        """The NVRTC name expression of one instantiation: every template parameter by its
        name (``bool`` ones as Python bools, types as C type strings)."""
        names = [n for _, n in self.template]
        params = {**dict(self.defaults), **params}  # a defaulted parameter may be left out
        if set(params) != set(names):
            raise TypeError(f"{self.name} takes the template parameters {names}, got "
                            f"{sorted(params)}")
        if not names:
            return self.name
        vals = []
        for kind, n in self.template:
            v = params[n]
            if kind == "bool":
                if not isinstance(v, (bool, np.bool_)):
                    raise TypeError(f"{self.name}: template parameter {n} must be a bool, "
                                    f"got {v!r}")
                vals.append("true" if v else "false")
            elif kind in ("typename", "class"):
                if not isinstance(v, str):
                    raise TypeError(f"{self.name}: template parameter {n} must be a C type name, "
                                    f"got {v!r}")
                vals.append(v)
            else:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"{self.name}: template parameter {n} must be an integer, "
                                    f"got {v!r}")
                vals.append(str(int(v)))
        return f"{self.name}<{', '.join(vals)}>"

    def _typed(self, arg: Arg, value):
        if arg.pointer:
            return np.uint64(int(value))
        return arg.scalar(value)

    def args_of(self, **values) -> tuple:
        """Every argument by name, typed, in the kernel's order (one-off launches)."""
        self._check_names(values, ())
        return tuple(self._typed(a, values[a.name]) for a in self.args)

    def bind(self, variable=(), **fixed) -> Bound:
        """The arguments of a packed launch: ``fixed`` ones by name, the ``variable`` ones
        (named in the order the launch passes them) as zero placeholders of their type."""
        variable = tuple(variable)
        self._check_names(fixed, variable)
        index = {a.name: i for i, a in enumerate(self.args)}
        args = tuple(self._typed(a, 0) if a.name in variable else self._typed(a, fixed[a.name])
                     for a in self.args)
        return Bound(args, tuple(index[n] for n in variable))

    def _check_names(self, given, variable):
        names = set(self.arg_names)
        both = set(given) & set(variable)
        unknown = (set(given) | set(variable)) - names
        missing = names - set(given) - set(variable)
        if both or unknown or missing or len(set(variable)) != len(variable):
            raise TypeError(f"{self.name}({', '.join(self.arg_names)}): "
                            + "; ".join(f"{what} {sorted(s)}" for what, s in
                                        (("unknown", unknown), ("missing", missing),
                                         ("both fixed and variable", both)) if s)
                            + ("; a variable argument named twice"
                               if len(set(variable)) != len(variable) else ""))


def _parse_template(text: str) -> tuple:
    """``(((kind, name), ...), ((name, default), ...))``; a default is an integer literal
    (``template <int kOnDemand = 0>``: the kernels that would otherwise be compiled into
    every module of their family, see ``decode_common.cuh``)."""
    out, defaults = [], []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        decl, eq, default = part.partition("=")
        kind, name = decl.strip().rsplit(None, 1)
        out.append((kind.strip(), name))
        if eq:
            defaults.append((name, int(default.strip(), 0)))
    return tuple(out), tuple(defaults)


def _parse_args(kernel_name: str, text: str) -> tuple:
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.match(r"^(.*?)(\w+)$", part, re.S)
        if not m:
            raise ValueError(f"{kernel_name}: cannot parse the argument {part!r}")
        ctype = " ".join(t for t in m.group(1).replace("*", " * ").split()
                         if t not in ("const", "__restrict__", "volatile"))
        ctype = ctype.replace(" *", "*")
        if ctype.endswith("*"):
            scalar = np.uint64
        elif ctype in _SCALARS:
            scalar = _SCALARS[ctype]
        else:
            raise ValueError(f"{kernel_name}: argument {m.group(2)!r} has the type {ctype!r}, "
                             f"which has no launch type here")
        out.append(Arg(m.group(2), ctype, scalar))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _text(family: str) -> str:
    from . import source_text

    return _COMMENTS.sub(" ", source_text(family))


@functools.lru_cache(maxsize=None)
def kernels(family: str) -> dict:
    """``{name: Kernel}`` of every ``__global__`` kernel in the family's expanded source."""
    found = {}
    for m in _KERNEL.finditer(_text(family)):
        template, defaults = _parse_template(m.group("template") or "")
        k = Kernel(m.group("name"), template, _parse_args(m.group("name"), m.group("args")),
                   defaults)
        if found.setdefault(k.name, k) != k:
            raise ValueError(f"{family}: two different declarations of {k.name}")
    return found


def kernel(family: str, name: str) -> Kernel:
    """The declaration of kernel ``name`` in ``family``'s source."""
    try:
        return kernels(family)[name]
    except KeyError:
        raise KeyError(f"no __global__ kernel {name!r} in the {family!r} sources") from None


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: int(a / b)}  # C integer division


@functools.lru_cache(maxsize=None)
def constant(family: str, name: str) -> int:
    """The value of a namespace-level ``constexpr int name = ...;`` of the family's source
    (an integer expression of literals and earlier such constants), e.g. the threads per
    CTA a kernel's ``__launch_bounds__`` was compiled for."""
    defs = dict(_CONSTEXPR.findall(_text(family)))

    def value(n, depth=0):
        if n not in defs or depth > 16:
            raise KeyError(f"no constexpr int {n!r} with a literal value in the {family!r} sources")
        return ev(ast.parse(defs[n].strip(), mode="eval").body, depth)

    def ev(node, depth):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return value(node.id, depth + 1)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left, depth), ev(node.right, depth))
        raise ValueError(f"{family}: constexpr {name!r} is not a plain integer expression")

    return value(name)


@functools.lru_cache(maxsize=None)
def enum(family: str, name: str) -> dict:
    """``{enumerator: value}`` of ``enum name`` in the family's source (explicit values)."""
    for m in _ENUM.finditer(_text(family)):
        if m.group(1) == name:
            out = {}
            for item in (i.strip() for i in m.group(2).split(",") if i.strip()):
                key, val = (x.strip() for x in item.split("="))
                out[key] = int(val.rstrip("uU"), 0)
            return out
    raise KeyError(f"no enum {name!r} in the {family!r} sources")
