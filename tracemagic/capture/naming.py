"""Name the ``nn.Module: <Class>_<k>`` events of a Kineto trace by attribute path.

With ``with_stack=True`` torch's Python tracer names each module call
``nn.Module: <Class>_<k>`` (``<k>``: the instance's rank among its class, in order of first
call within one recording window; ``PythonIDVisitor`` in
``torch/csrc/autograd/profiler_python.cpp``). The tracer's own results keep, for each of
these calls, the module object's address (``id()``) and class: ``recorded_modules`` reads
them from the profiler once a window has stopped, ``resolve`` finds those objects among
the models reachable from the user's namespace, and ``module_map`` turns them into
attribute paths (``encoder.layers.0.self_attn``).

Nothing is installed while a window records. A global module hook (what this module used
to register) changes what runs: dynamo guards on global hooks, so a ``torch.compile``'d
model would re-trace inside the recorded window, and torch warns that the hooks fire an
extra time for its ``OptimizedModule``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: what a window's module calls resolve to: the module object, or its class name when the
#: object cannot be found any more (a module that died before the window was read)
Called = dict[str, "torch.nn.Module | str"]
#: the attribute dynamo's ``OptimizedModule`` (``torch.compile(module)``) keeps the model in
_ORIG_MOD = "_orig_mod"


def recorded_modules(profiler: Any) -> dict[str, tuple[int, str]]:
    """The modules called in the window a profiler just recorded, as torch names them.

    Args:
        profiler: the ``torch.autograd.profiler.profile`` of a stopped window
            (``torch.profiler.profile(...).profiler``), recorded with ``with_stack=True``.

    Returns:
        ``{"nn.Module: Linear_0": (id of the module, "Linear"), ...}`` in order of first
        call; empty when the window holds no Python tracer events.
    """
    results = getattr(profiler, "kineto_results", None)
    if results is None:
        return {}
    from torch._C._profiler import _EventType

    calls: list[tuple[int, str, int, str]] = []
    pending = list(results.experimental_event_tree())
    while pending:  # every event: module calls also run inside ops (backward recomputation)
        event = pending.pop()
        if event.tag == _EventType.PyCall:
            module = event.extra_fields.module
            if module is not None:
                calls.append((event.start_time_ns, event.name, module.self_ptr, module.cls_name))
        pending.extend(event.children)
    calls.sort()
    out: dict[str, tuple[int, str]] = {}
    for _, name, ptr, cls_name in calls:
        out.setdefault(name, (int(ptr), str(cls_name)))
    return out


def namespace_modules(namespace: Mapping[str, Any]) -> list[torch.nn.Module]:
    """The ``nn.Module`` values of a namespace (the models a cell or script holds)."""
    return [value for value in namespace.values() if isinstance(value, torch.nn.Module)]


def resolve(calls: Mapping[str, tuple[int, str]], models: Iterable[torch.nn.Module]) -> Called:
    """The module object behind each recorded call.

    Looked up among ``models`` and their submodules first, then (for what is left: a model
    held in no variable, a module dynamo made) among all live ``nn.Module`` objects. Must run
    while the window's modules are alive, i.e. right after the window.

    Args:
        calls: ``recorded_modules``'s answer.
        models: the models the user holds (``namespace_modules``).

    Returns:
        ``{"nn.Module: Linear_0": <the Linear>, ...}``; the class name instead of the object
        where no live module of that class has the recorded address.
    """
    wanted = {ptr: cls_name for ptr, cls_name in calls.values()}
    found: dict[int, torch.nn.Module] = {}
    for model in models:
        for sub in model.modules():
            if id(sub) in wanted and type(sub).__name__ == wanted[id(sub)]:
                found[id(sub)] = sub
    if len(found) < len(wanted):
        for obj in gc.get_objects():
            if id(obj) in wanted and id(obj) not in found and isinstance(obj, torch.nn.Module):
                if type(obj).__name__ == wanted[id(obj)]:
                    found[id(obj)] = obj
    return {name: found.get(ptr, cls_name) for name, (ptr, cls_name) in calls.items()}


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


def _compiled_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is dynamo's ``OptimizedModule`` (``torch.compile(model)``)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, _ORIG_MOD, None), torch.nn.Module)


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model a ``torch.compile`` wrapper runs (``module`` itself when it is none)."""
    while _compiled_wrapper(module):
        module = getattr(module, _ORIG_MOD)
    return module


def user_paths(root: torch.nn.Module) -> dict[int, str]:
    """``id(submodule)`` -> attribute path under ``root``, as the user writes it.

    The model inside a ``torch.compile(model)`` wrapper gets the wrapper's own path (no
    ``_orig_mod`` level): ``cm = torch.compile(m)`` names both ``cm``, and ``m.fc`` is
    ``cm.fc``'s path ``fc``.
    """
    named = dict(root.named_modules())
    out: dict[int, str] = {}
    for path, sub in named.items():
        parts = path.split(".") if path else []
        kept = [
            part for i, part in enumerate(parts)
            if not (part == _ORIG_MOD and _compiled_wrapper(named[".".join(parts[:i])]))
        ]
        out.setdefault(id(sub), ".".join(kept))
    return out


def module_map(window: Mapping[str, torch.nn.Module | str], roots: Iterable[torch.nn.Module], namespace: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Map one window's trace names to attribute paths.

    Args:
        window: the window's modules by trace name (``resolve``).
        roots: the top-level modules called during the capture (``find_roots``).
        namespace: the user namespace, to name each root after its variable.

    Returns:
        ``{"nn.Module: Linear_0": {"path": "encoder.0", "type": "Linear", "root": "model",
        "qualname": "model.encoder.0"}, ...}``. ``path`` is relative to the root (a root
        itself gets its variable name); ``qualname`` always starts with the root's name.
        A ``torch.compile(model)`` wrapper and its model share one path, and the wrapper's
        ``type`` is the model's class (the layer the user knows). A module that could not
        be found is named by its class.
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
        for sub, path in user_paths(root).items():
            where.setdefault(sub, (name, path))
    out: dict[str, dict[str, str]] = {}
    for trace_name, module in window.items():
        kind = module if isinstance(module, str) else type(_unwrapped(module)).__name__
        root_name, path = (kind, "") if isinstance(module, str) else where.get(id(module), (kind, ""))
        out[trace_name] = {
            "path": path or root_name,
            "type": kind,
            "root": root_name,
            "qualname": f"{root_name}.{path}" if path else root_name,
        }
    return out
