"""A griffe extension for the API reference: fastload's docstrings cite code the Sphinx way
(``:class:`fastload.Dataset```, ``:func:`~fastload.convert```), which Markdown would print as
is. Each role becomes a code span of its target (``~`` keeps the last component, as Sphinx
does), so the reference reads as the source means it; nothing else in a docstring changes."""
from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`(~?)([^`]+)`")


def plain(text: str) -> str:
    """``:class:`~a.b.C``` -> `` `C` ``; ``:mod:`a.b``` -> `` `a.b` ``."""
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class RstRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
