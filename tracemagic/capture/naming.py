"""Name the ``nn.Module: <Class>_<k>`` events of a Kineto trace by attribute path.

With ``with_stack=True`` torch's Python tracer names each module call
``nn.Module: <Class>_<k>`` (``<k>``: the instance's rank among its class, in order of first
call within one recording window; ``PythonIDVisitor`` in
``torch/csrc/autograd/profiler_python.cpp``). The tracer's own results keep, for each of
these calls, the module object's address (``id()``) and class: ``recorded_modules`` reads
them from the profiler once a window has stopped, ``resolve`` finds those objects among
the models reachable from the user's namespace, and ``module_map`` turns them into
attribute paths (``encoder.layers.0.self_attn``). Each root is named after the user's
variable holding it, unless that name is also an attribute path under a root
(``bert = BertForMaskedLM(...)``, whose ``.bert`` is a ``BertModel``): that root is the
layer ``bert (BertForMaskedLM)``, so every layer has a name of its own.

Nothing is installed while a window records. A global module hook (what this module used
to register) changes what runs: dynamo guards on global hooks, so a ``torch.compile``'d
model would re-trace inside the recorded window, and torch warns that the hooks fire an
extra time for its ``OptimizedModule``.

Both look-ups cost time inside the profiled loop, so both are kept cheap:

- ``recorded_modules`` searches the event tree only until it has found every module name
  the exported trace holds (``module_event_names``), and the inside of ``aten::`` ops, C
  functions and torch's own optimizer/autograd code (most of a window's events) only when
  a name is still unfound outside them: a module called from inside them (backward
  recomputation, a compiled region) is still found.
- ``resolve`` remembers the modules it found (``ModuleCache``, held by weak reference), so
  a later window of the same model finds them without searching. A model seen for the
  first time is looked for among the namespace's values and what they hold (a closure's
  ``model``, ``trainer.model``: ``held_modules``); the walk over every live object
  (``gc.get_objects()``, tens of ms in a notebook) runs only for what that leaves. What
  that walk did not find either (a module made and dropped inside ``forward``, dead once
  the window is written) is remembered too, so a window whose only unknown modules are
  those again searches no further than the models already known.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import mmap
import os
import types
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from tracemagic.trace import layout

#: what a window's module calls resolve to: the module object, or its class name when the
#: object cannot be found any more (a module that died before the window was read)
Called = dict[str, "torch.nn.Module | str"]
#: the attribute dynamo's ``OptimizedModule`` (``torch.compile(module)``) keeps the model in
_ORIG_MOD = "_orig_mod"


#: the name torch's Python tracer gives a module call (``nn.Module: Linear_0``)
MODULE_EVENT = "nn.Module: "
#: how a module call's name is spelled in the Kineto JSON torch exports
_TRACE_KEY = b'"name": "nn.Module: '
#: events whose inside is searched only when the module calls outside them leave a name of
#: the trace's unfound: ``aten::`` ops, C functions (``<built-in method linear ...>``),
#: allocations, torch's own Python that calls no model (optimizer steps, autograd, the
#: profiler) and the magic's. Most of a window's events are there.
_OPAQUE = (
    "aten::",
    "<built-in",
    "[memory]",
    "torch/optim/",
    "torch/autograd/",
    "torch/_tensor.py",
    "torch/_ops.py",
    "torch/profiler/",
    "torch/_jit_internal.py",
    "typing.py",
    "tracemagic/capture/",  # the magic's own step(), run between the user's iterations
)


def recorded_modules(
    profiler: Any, trace: str | os.PathLike[str] | None = None, *, names: set[str] | None = None
) -> dict[str, tuple[int, str]]:
    """The modules called in the window a profiler just recorded, as torch names them.

    Args:
        profiler: the ``torch.autograd.profiler.profile`` of a stopped window
            (``torch.profiler.profile(...).profiler``), recorded with ``with_stack=True``.
        trace: the window's Kineto JSON, just exported (plain, not gzip). With it, the
            event tree is searched only until every module name the trace holds
            (``module_event_names``) has been found, and the inside of ``aten::`` ops, C
            functions and torch's optimizer/autograd code only when the events outside them
            leave a name unfound; without it, every event is searched.
        names: the trace's module names, already read (``module_event_names_in``):
            used instead of reading ``trace``.

    Returns:
        ``{"nn.Module: Linear_0": (id of the module, "Linear"), ...}``, in order of the
        earliest call found; empty when the window holds no Python tracer events.
    """
    results = getattr(profiler, "kineto_results", None)
    if results is None:
        return {}
    wanted = names if names is not None else module_event_names(trace) if trace is not None else None
    calls = _module_calls(results.experimental_event_tree(), wanted)
    calls.sort()
    out: dict[str, tuple[int, str]] = {}
    for _, name, ptr, cls_name in calls:
        out.setdefault(name, (int(ptr), str(cls_name)))
    return out


def _module_calls(roots: Iterable[Any], wanted: set[str] | None) -> list[tuple[int, str, int, str]]:
    """Module calls under ``roots``: ``(start ns, name, id, class)``, at least one per name.

    Module calls also run inside ops and C functions (backward recomputation, a compiled
    region, ``autograd.Function.apply``), so every event may hold one. The events outside
    ``_OPAQUE`` ones are searched first, telling module calls by their name (cheaper than
    their tag); the opaque ones' insides are then searched only while a name of ``wanted``
    (the trace's) is still unfound: not at all in the usual case, all of them when
    ``wanted`` is None. Either search stops as soon as every wanted name is found: torch
    names a call after its module (``<Class>_<k>``, one ``k`` per instance in the window),
    so one call of each name gives the same map as all of them, and the latest calls
    (searched first: the stack pops the last child) hold every module a loop calls.
    """
    from torch._C._profiler import _EventType

    py_call = _EventType.PyCall
    calls: list[tuple[int, str, int, str]] = []
    left = set(wanted) if wanted is not None else None
    if left is not None and not left:
        return calls
    deferred: list[Any] = []
    pending = list(roots)
    pop, extend = pending.pop, pending.extend
    while pending:
        event = pop()
        name = event.name
        if name.startswith(MODULE_EVENT):
            if event.tag == py_call:
                module = event.extra_fields.module
                if module is not None:
                    calls.append((event.start_time_ns, name, module.self_ptr, module.cls_name))
                    if left is not None:
                        left.discard(name)
                        if not left:
                            return calls
        elif name.startswith(_OPAQUE):
            deferred.append(event)
            continue
        extend(event.children)
    pending = [child for event in deferred for child in event.children]
    pop, extend = pending.pop, pending.extend
    while pending:
        event = pop()
        if event.tag == py_call:
            module = event.extra_fields.module
            if module is not None:
                name = event.name
                calls.append((event.start_time_ns, name, module.self_ptr, module.cls_name))
                if left is not None:
                    left.discard(name)
                    if not left:
                        return calls
        extend(event.children)
    return calls


def module_event_names(trace: str | os.PathLike[str], chunk: int = 1 << 22) -> set[str] | None:
    """The names of the module-call events (``"name": "nn.Module: ...``) a Kineto JSON file
    holds, read in chunks; None where it cannot be read."""
    key = _TRACE_KEY
    prefix = len(key) - len(MODULE_EVENT)
    names: set[bytes] = set()
    tail = b""
    try:
        with open(trace, "rb", buffering=0) as fh:
            if os.fstat(fh.fileno()).st_size <= chunk:  # the usual window: one read, no chunk buffer
                return module_event_names_in(fh.readall())
            while block := fh.read(chunk):
                data = tail + block
                pos, carry = 0, None
                while (at := data.find(key, pos)) >= 0:
                    end = data.find(b'"', at + len(key))
                    if end < 0:  # its name goes on in the next chunk
                        carry = at
                        break
                    names.add(data[at + prefix : end])
                    pos = end + 1
                if carry is None:  # a key may begin at the end of this chunk
                    carry = max(pos, len(data) - len(key) + 1)
                tail = data[carry:]
    except OSError:
        return None
    return {name.decode("utf-8", "replace") for name in names}


#: the byte ``module_event_names_in`` looks for first (``memchr``): the key's rarest in a trace
_ANCHOR = b"M"
#: the anchor's offset in the key
_AT = _TRACE_KEY.index(_ANCHOR)


def module_event_names_in(data: bytes | mmap.mmap) -> set[str]:
    """``module_event_names`` of a whole Kineto JSON file's bytes, already read or mapped (a
    capture maps its trace once, for these names and its ``traceName``).

    Each ``M`` is found first (one ``memchr`` each, several times faster than searching for
    the whole key, whose last byte, a space, is everywhere in JSON) and the key checked
    around it; past a budget of ``M``s that are not the key (a trace full of ``Memcpy``,
    ``MmBackward0``), the rest is searched for the key itself.
    """
    key = _TRACE_KEY
    prefix = len(key) - len(MODULE_EVENT)
    names: set[bytes] = set()
    find = data.find
    size = len(key)
    pos = _AT
    budget = 256 + (len(data) >> 12)  # misses allowed before the plain search
    while budget > 0:
        at = find(_ANCHOR, pos)
        if at < 0:
            return {name.decode("utf-8", "replace") for name in names}
        begin = at - _AT
        if data[begin : begin + size] != key:
            budget -= 1
            pos = at + 1
            continue
        end = find(b'"', begin + len(key))
        if end < 0:  # a cut file: its last name is not whole
            return {name.decode("utf-8", "replace") for name in names}
        names.add(data[begin + prefix : end])
        pos = end + 1 + _AT
    pos -= _AT  # no key begins before here that was not seen
    while (at := find(key, pos)) >= 0:
        end = find(b'"', at + len(key))
        if end < 0:
            break
        names.add(data[at + prefix : end])
        pos = end + 1
    return {name.decode("utf-8", "replace") for name in names}


def namespace_modules(namespace: Mapping[str, Any]) -> Iterator[torch.nn.Module]:
    """The ``nn.Module`` values of a namespace (the models a cell or script holds), then the
    modules its values hold (``held_modules``; public names' values first, then private ones
    such as IPython's ``_``, ``_oh``), lazily: a caller that finds what it looks for in the
    first ones searches no further."""
    items = list(namespace.items())
    values = [v for k, v in items if not k.startswith("_")] + [v for k, v in items if k.startswith("_")]
    direct = [value for value in values if isinstance(value, torch.nn.Module)]
    yield from direct
    yield from held_modules(values, skip={id(m) for m in direct})


#: objects ``held_modules`` looks at, at most (a search that stops short ends in the gc walk)
_HELD_BUDGET = 20_000
#: items of one list, tuple, set or dict it looks at, at most (a dataset is no model holder)
_HELD_ITEMS = 256
_LEAVES = (str, bytes, int, float, complex, bool, type, types.ModuleType, torch.Tensor)


def held_modules(
    values: Iterable[Any], skip: set[int] | None = None, budget: int = _HELD_BUDGET
) -> Iterator[torch.nn.Module]:
    """The modules held by ``values``, nearest first: through function closures and
    defaults, bound methods, ``functools.partial``, lists, tuples, sets, dicts and instance
    attributes (``model`` in ``def train_step`` made by a function, ``trainer.model``).

    Modules are not entered (their submodules are the caller's), nor types, module objects
    or tensors. The search stops after ``budget`` objects; what it cannot reach is left to
    the walk over every live object.
    """
    seen = set(skip or ())
    queue: deque[Any] = deque(values)
    while queue and budget > 0:
        obj = queue.popleft()
        if id(obj) in seen or obj is None or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        budget -= 1
        if isinstance(obj, torch.nn.Module):
            yield obj
            continue
        try:
            if isinstance(obj, types.FunctionType):
                for cell in obj.__closure__ or ():
                    with contextlib.suppress(ValueError):  # an empty cell
                        queue.append(cell.cell_contents)
                queue.extend(obj.__defaults__ or ())
                queue.extend((obj.__kwdefaults__ or {}).values())
            elif isinstance(obj, types.MethodType):
                queue.extend((obj.__self__, obj.__func__))
            elif isinstance(obj, functools.partial):
                queue.extend((obj.func, *obj.args, *obj.keywords.values()))
            elif isinstance(obj, dict):
                queue.extend(itertools.islice(obj.values(), _HELD_ITEMS))
            elif isinstance(obj, (list, tuple, set, frozenset, deque)):
                queue.extend(itertools.islice(obj, _HELD_ITEMS))
            else:
                attrs = getattr(obj, "__dict__", None)
                if isinstance(attrs, dict):
                    queue.extend(itertools.islice(attrs.values(), _HELD_ITEMS))
        except Exception:  # noqa: BLE001 - an odd object is skipped, never a failed capture
            continue


class ModuleCache:
    """The modules earlier windows resolved, by ``id``, held by weak reference.

    An entry goes when its module is garbage-collected, and a hit counts only while the
    object under that ``id`` is alive and of the recorded class (an ``id`` is reused once its
    object is gone). The roots of the found modules are kept too, so a module added to a
    known model later (``model.head = nn.Linear(...)``) is found among their submodules
    without walking every live object.
    """

    def __init__(self) -> None:
        self._modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
        self._roots: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
        #: the classes of which the last walk over every live object found none it looked for
        self._not_alive: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self._modules)

    def get(self, ptr: int, cls_name: str) -> torch.nn.Module | None:
        """The live module with this ``id`` and class name, if one was found before."""
        module = self._modules.get(ptr)
        if module is not None and id(module) == ptr and type(module).__name__ == cls_name:
            return module
        return None

    def roots(self) -> list[torch.nn.Module]:
        """The live roots of the modules found before."""
        return list(self._roots.values())

    def searched_in_vain(self, missing: Mapping[int, str]) -> bool:
        """Whether the last walk over every live object looked for modules of each class of
        ``missing`` (``{id: class name}``) and found none of that class: the modules a loop
        makes and drops inside ``forward`` (``nn.ReLU()(x)``), dead once the window is
        written, at new addresses each window. Walking again (tens of ms) would find them no
        more; they keep their class name. A live module of such a class that nothing the
        namespace reaches holds, and that no known model holds, would keep its class name
        too, and only while every other module of its window is known."""
        return bool(missing) and self._not_alive.issuperset(missing.values())

    def not_alive(self, missing: Mapping[int, str], found: Iterable[torch.nn.Module]) -> None:
        """Note a walk over every live object: it looked for ``missing`` (``{id: class
        name}``) and found ``found``; the classes it found none of, for ``searched_in_vain``."""
        self._not_alive = frozenset(missing.values()) - {type(module).__name__ for module in found}

    def remember(self, modules: Iterable[torch.nn.Module]) -> None:
        """Keep ``modules`` (and their roots) for the next windows."""
        modules = list(modules)
        for module in modules:
            with contextlib.suppress(TypeError):  # a module that takes no weak reference
                self._modules[id(module)] = module
        for root in find_roots(modules):
            with contextlib.suppress(TypeError):
                self._roots[id(root)] = root


#: the process's cache, shared by every capture (``resolve``'s default)
MODULES = ModuleCache()


def resolve(
    calls: Mapping[str, tuple[int, str]], models: Iterable[torch.nn.Module], cache: ModuleCache | None = None
) -> Called:
    """The module object behind each recorded call.

    Looked up in ``cache`` first (the modules found by earlier windows), then among the
    cached roots with their submodules, then among ``models`` with theirs, then (for what
    is left: a model nothing reachable holds, seen for the first time; a module dynamo
    made) among all live ``nn.Module`` objects; the last two are skipped where the last
    walk over all live objects found no module of any of the classes still missing
    (``ModuleCache.searched_in_vain``). What is found is remembered in ``cache``. Must run
    while the window's modules are alive, i.e. right after the window.

    Args:
        calls: ``recorded_modules``'s answer.
        models: the models the user holds (``namespace_modules``); iterated only as far as
            the cache leaves modules to find.
        cache: where found modules are kept between windows (default: the process's,
            ``MODULES``).

    Returns:
        ``{"nn.Module: Linear_0": <the Linear>, ...}``; the class name instead of the object
        where no live module of that class has the recorded address.
    """
    cache = MODULES if cache is None else cache
    wanted = {ptr: cls_name for ptr, cls_name in calls.values()}
    found: dict[int, torch.nn.Module] = {}
    for ptr, cls_name in wanted.items():
        module = cache.get(ptr, cls_name)
        if module is not None:
            found[ptr] = module
    hits = len(found)
    searched: set[int] = set()
    _search_models(cache.roots(), wanted, found, searched)  # the known models (a new submodule)
    missing = {ptr: cls_name for ptr, cls_name in wanted.items() if ptr not in found}
    if missing and not cache.searched_in_vain(missing):
        _search_models(models, wanted, found, searched)
        missing = {ptr: cls_name for ptr, cls_name in missing.items() if ptr not in found}
        if missing:
            for obj in [obj for obj in gc.get_objects() if id(obj) in missing]:
                if isinstance(obj, torch.nn.Module) and type(obj).__name__ == missing[id(obj)]:
                    found[id(obj)] = obj
            cache.not_alive(missing, (found[ptr] for ptr in missing if ptr in found))
    if len(found) > hits:
        cache.remember(module for module in found.values() if cache.get(id(module), type(module).__name__) is None)
    return {name: found.get(ptr, cls_name) for name, (ptr, cls_name) in calls.items()}


def _search_models(
    models: Iterable[torch.nn.Module], wanted: Mapping[int, str], found: dict[int, torch.nn.Module], searched: set[int]
) -> None:
    """Add to ``found`` the modules of ``wanted`` (``{id: class name}``) among ``models`` and
    their submodules, skipping those in ``searched`` (and adding to it). ``models`` is asked
    for its next model only while one is still wanted: it may be lazy, and finding its first
    one can search the whole namespace (``namespace_modules``)."""
    left = iter(models)
    while len(found) < len(wanted) and (model := next(left, None)) is not None:
        if id(model) in searched:
            continue
        for sub in model.modules():
            searched.add(id(sub))
            if id(sub) in wanted and type(sub).__name__ == wanted[id(sub)]:
                found[id(sub)] = sub


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
            part
            for i, part in enumerate(parts)
            if not (part == _ORIG_MOD and _compiled_wrapper(named[".".join(parts[:i])]))
        ]
        out.setdefault(id(sub), ".".join(kept))
    return out


def module_map(
    window: Mapping[str, torch.nn.Module | str], roots: Iterable[torch.nn.Module], namespace: Mapping[str, Any]
) -> dict[str, dict[str, str]]:
    """Map one window's trace names to attribute paths.

    Args:
        window: the window's modules by trace name (``resolve``).
        roots: the top-level modules called during the capture (``find_roots``).
        namespace: the user namespace, to name each root after its variable.

    Returns:
        ``{"nn.Module: Linear_0": {"path": "encoder.0", "type": "Linear", "root": "model",
        "qualname": "model.encoder.0"}, ...}``. ``path`` (the layer's name) is relative to
        the root, or the ``qualname`` where another root called in the capture has a
        submodule at the same path (``gen.fc`` and ``disc.fc``: ``layout.clashing_roots``);
        a root itself gets its variable name, or ``bert (BertForMaskedLM)`` where
        that name is also a path (``bert = BertForMaskedLM(...)``, whose ``.bert`` is a
        ``BertModel``: ``layout.root_layer``), so no two layers share a name. ``root`` is the
        variable's name and ``qualname`` always starts with it (``bert.bert.embeddings``).
        A ``torch.compile(model)`` wrapper and its model share one path, and the wrapper's
        ``type`` is the model's class (the layer the user knows). A module that could not
        be found is named by its class.
    """
    named: list[tuple[torch.nn.Module, str, dict[int, str]]] = []
    taken: set[str] = set()
    for root in roots:
        name = _root_name(root, namespace)
        base, n = name, 1
        while name in taken:  # two roots in no variable, same class
            n += 1
            name = f"{base}{n}"
        taken.add(name)
        named.append((root, name, user_paths(root)))
    # two models with a submodule at one path (``gen.fc``, ``disc.fc``): theirs are qualified
    clashing = layout.clashing_roots({name: [p for p in subs.values() if p] for _, name, subs in named})
    named = [
        (root, name, {sub: f"{name}.{p}" if p and name in clashing else p for sub, p in subs.items()})
        for root, name, subs in named
    ]
    # a root whose name is also a path (``bert = BertForMaskedLM(...)`` and its ``.bert``)
    # is the layer ``bert (BertForMaskedLM)``: every layer keeps a name of its own
    paths = {path for _, _, subs in named for path in subs.values() if path}
    where: dict[int, tuple[str, str, str]] = {}
    for root, name, subs in named:
        label = layout.root_layer(name, type(_unwrapped(root)).__name__) if name in paths else name
        for sub, path in subs.items():
            where.setdefault(sub, (name, label, path))
    out: dict[str, dict[str, str]] = {}
    for trace_name, module in window.items():
        kind = module if isinstance(module, str) else type(_unwrapped(module)).__name__
        found = (kind, kind, "") if isinstance(module, str) else where.get(id(module), (kind, kind, ""))
        root_name, label, path = found
        out[trace_name] = {
            "path": path or label,
            "type": kind,
            "root": root_name,
            "qualname": (path if root_name in clashing else f"{root_name}.{path}") if path else root_name,
        }
    return out
