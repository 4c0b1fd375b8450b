"""``_repr_mimebundle_(include, exclude)`` as IPython calls it: only the MIME types
``include`` names (all when None), none that ``exclude`` names, and what is not sent is not
computed (no widget built, no text summary made)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TRACES

import tracemagic
from tracemagic.views.dashboard import WIDGET_HINT, Dashboard
from tracemagic.views.text import summary

WIDGET = "application/vnd.jupyter.widget-view+json"
TEXT = "text/plain"


@pytest.fixture(scope="module")
def gpu() -> Any:
    return tracemagic.load(TRACES / "hta_control.json.gz", use_cache=False)


def test_the_dashboard_sends_only_what_is_asked(gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(Dashboard(gpu, force_widget=True)._repr_mimebundle_()) == {TEXT, WIDGET}
    text_only = Dashboard(gpu, force_widget=True)
    for kwargs in ({"include": {TEXT}}, {"exclude": {WIDGET}}, {"include": [TEXT, "text/html"], "exclude": ["image/png"]}):
        bundle = text_only._repr_mimebundle_(**kwargs)
        assert bundle == {TEXT: summary(gpu)}, kwargs  # no widget: no hint to run the cell again
    assert text_only._widget is None  # never built
    widget_only = Dashboard(gpu, force_widget=True)
    monkeypatch.setattr(widget_only, "text", lambda: pytest.fail("the text was computed, not sent"))
    for kwargs in ({"include": {WIDGET}}, {"exclude": {TEXT}}):
        bundle = widget_only._repr_mimebundle_(**kwargs)
        assert set(bundle) == {WIDGET} and bundle[WIDGET]["model_id"] == widget_only.widget.model_id, kwargs
    assert widget_only._repr_mimebundle_(exclude={TEXT, WIDGET}) == {}
    assert Dashboard(gpu, force_widget=True)._repr_mimebundle_(include={"image/png"}) == {}
    full = Dashboard(gpu, force_widget=True)._repr_mimebundle_(include={TEXT, WIDGET})
    assert full[TEXT] == f"{summary(gpu)}\n\n{WIDGET_HINT}"


def test_a_capture_sends_only_what_is_asked(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    with tracemagic.capture(wait=0, warmup=1, active=1, out=tmp_path) as cap:
        for _ in cap.steps(range(3)):
            model(torch.randn(2, 8)).sum().backward()
    result = cap.result
    text = result._repr_mimebundle_()[TEXT]
    assert text.startswith("chakra_trace complete: 1 step recorded") and str(result.dir) in text
    assert result._repr_mimebundle_(include={TEXT}) == {TEXT: text}
    assert result._repr_mimebundle_(exclude={TEXT}) == {}
    assert result._repr_mimebundle_(include={"text/html"}) == {}
