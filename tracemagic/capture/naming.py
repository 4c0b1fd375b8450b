"""Name the ``nn.Module: <Class>_<k>`` events of a Kineto trace by attribute path.

With ``with_stack=True`` torch's Python tracer names each module call
``nn.Module: <Class>_<k>``. ``<k>`` is assigned when a recording window is post-processed
(``PythonIDVisitor`` in ``torch/csrc/autograd/profiler_python.cpp``): the tracer's events
are sorted by start time, and each module instance gets, per class, the number of
distinct instances of that class seen before it. So ``<k>`` is the instance's rank, among
its class, in order of first call within one recording window (one schedule cycle).

``ModuleRecorder`` reproduces that order with a global forward pre-hook that is
registered only while a window records, and ``module_map`` turns it into attribute
paths (``encoder.layers.0.self_attn``) from the models the cell actually called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle


class ModuleRecorder:
    """Records the modules called during each recording window, in first-call order."""

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._seen: dict[int, torch.nn.Module] = {}
        self.windows: list[list[torch.nn.Module]] = []

    @property
    def active(self) -> bool:
        """Whether the hook is registered right now."""
        return self._handle is not None

    def start(self) -> None:
        """Register the hook for a new recording window."""
        self.stop()
        self._seen = {}
        self._handle = register_module_forward_pre_hook(self._on_call)

    def _on_call(self, module: torch.nn.Module, args: Any) -> None:
        # dict keeps first-insertion order; called for every module call, so keep it tiny
        self._seen[id(module)] = module

    def stop(self) -> list[torch.nn.Module] | None:
        """Remove the hook; return (and keep) the window's modules in first-call order."""
        if self._handle is None:
            return None
        self._handle.remove()
        self._handle = None
        window = list(self._seen.values())
        self._seen = {}
        self.windows.append(window)
        return window


def trace_names(window: Iterable[torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """``nn.Module: <Class>_<k>`` for each module of one window, as torch numbers them."""
    counts: dict[type, int] = {}
    names: dict[str, torch.nn.Module] = {}
    for module in window:
        cls = type(module)
        k = counts.get(cls, 0)
        counts[cls] = k + 1
        names[f"nn.Module: {cls.__name__}_{k}"] = module
    return names


def find_roots(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The called modules that are not a submodule of another called module."""
    modules = list({id(m): m for m in modules}.values())
    inside: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if sub is not module:
                inside.add(id(sub))
    return [m for m in modules if id(m) not in inside]


def _root_name(root: torch.nn.Module, namespace: Mapping[str, Any]) -> str:
    """The user's variable holding ``root`` (public names first), else its class name."""
    candidates = [name for name, value in namespace.items() if value is root]
    public = sorted(n for n in candidates if not n.startswith("_"))
    if public:
        return public[0]
    return sorted(candidates)[0] if candidates else type(root).__name__


def module_map(
    window: Iterable[torch.nn.Module], roots: Iterable[torch.nn.Module], namespace: Mapping[str, Any]
) -> dict[str, dict[str, str]]:
    """Map one window's trace names to attribute paths.

    Args:
        window: the window's modules in first-call order (from ``ModuleRecorder``).
        roots: the top-level modules called during the capture (``find_roots``).
        namespace: the user namespace, to name each root after its variable.

    Returns:
        ``{"nn.Module: Linear_0": {"path": "encoder.0", "type": "Linear", "root": "model",
        "qualname": "model.encoder.0"}, ...}``. ``path`` is relative to the root (a root
        itself gets its variable name); ``qualname`` always starts with the root's name.
    """
    where: dict[int, tuple[str, str]] = {}
    taken: set[str] = set()
    for root in roots:
        name = _root_name(root, namespace)
        base, n = name, 1
        while name in taken:  # two roots in no variable, same class
            n += 1
            name = f"{base}{n}"
        taken.add(name)
        for path, sub in root.named_modules():
            where.setdefault(id(sub), (name, path))
    out: dict[str, dict[str, str]] = {}
    for trace_name, module in trace_names(window).items():
        root_name, path = where.get(id(module), (type(module).__name__, ""))
        out[trace_name] = {
            "path": path or root_name,
            "type": type(module).__name__,
            "root": root_name,
            "qualname": f"{root_name}.{path}" if path else root_name,
        }
    return out
