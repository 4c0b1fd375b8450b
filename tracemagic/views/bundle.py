"""Display bundles as IPython asks for them: only the MIME types ``include`` names (all when
None), none that ``exclude`` names, each computed only when it is sent."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

#: the MIME type of an ipywidgets view
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TEXT_MIME = "text/plain"


def wanted(mime: str, include: Collection[str] | None, exclude: Collection[str] | None) -> bool:
    """Whether a ``_repr_mimebundle_(include, exclude)`` call asks for ``mime``."""
    return (not include or mime in include) and (not exclude or mime not in exclude)


def select(bundle: dict[str, Any], include: Collection[str] | None, exclude: Collection[str] | None) -> dict[str, Any]:
    """``bundle`` less the MIME types ``include``/``exclude`` rule out."""
    return {mime: data for mime, data in bundle.items() if wanted(mime, include, exclude)}
