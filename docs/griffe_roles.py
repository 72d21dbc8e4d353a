"""Griffe extension for the API reference: the docstrings' reST roles (``:class:`~a.b.C``` and the like, as Sphinx
writes them) rendered as code (``C``), since mkdocstrings shows Markdown, not reST."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class ReSTRoles(Extension):
    """Rewrite each object's docstring roles once it is loaded."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_plain, obj.docstring.value)
