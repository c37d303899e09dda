"""What the op table (:mod:`deltastate._surface`) derives: the binding's argument order, the
public functions, the torch schemas and the torch implementations.

The functions are generated as Python source and compiled once at import, so that a call runs
straight-line code with the table's names (no ``*args`` / ``**kwargs`` handling, no signature
binding per call) and ``inspect.signature`` / ``help()`` show the real parameters. The source is
registered with :mod:`linecache`, so tracebacks and ``inspect.getsource`` show it.
"""

from __future__ import annotations

import inspect
import linecache
import re
from typing import Any, Dict, Mapping, Sequence, Tuple

from ._surface import BOOL, CHECK, FLOAT, INT64, OPT_FLOAT, REQUIRED, ROUNDING, Arg, Op


# ---- the binding ------------------------------------------------------------------------------
def binding_order(op: Op, signatures: Mapping[str, Sequence[str]]) -> Tuple[Arg, ...]:
    """The op's arguments in the order its binding takes them (``op_signatures()`` of the compiled
    module: "name:kind" per argument); ImportError when the table and the binding differ."""
    try:
        listed = [str(s).split(":", 1) for s in signatures[op.binding_name]]
    except KeyError:
        raise ImportError(f"deltastate: the compiled module has no binding for op "
                          f"`{op.binding_name}`; rebuild it (pip install .)") from None
    args = {a.name: a for a in op.op_args}
    table = sorted(f"{a.name}:{a.kind.name}" for a in args.values())
    if sorted(f"{n}:{k}" for n, k in listed) != table:
        raise ImportError(
            f"deltastate: op `{op.binding_name}` takes ({', '.join(table)}) in "
            "deltastate/_surface.py "
            f"but ({', '.join(sorted(':'.join(x) for x in listed))}) in the compiled module; "
            "rebuild the module (pip install .) or bring the two in line")
    return tuple(args[n] for n, _ in listed)


# ---- argument conversions ---------------------------------------------------------------------
def _convert(arg: Arg) -> str:
    """A statement normalizing a public argument's value to what the binding takes (the common
    values pass an identity or type check only), or "" for tensors."""
    x = arg.name
    if arg.kind is FLOAT:
        return f"{x} = {x} if type({x}) is float else _number({x}, {x!r})"
    if arg.kind is OPT_FLOAT:
        return f"{x} = {x} if {x} is None or type({x}) is float else _number_or_none({x}, {x!r})"
    if arg.kind is BOOL:
        if type(arg.default) is bool:
            return f"{x} = {x} if {x} is {arg.default!r} else bool({x})"
        return f"{x} = {x} if type({x}) is bool else bool({x})"
    if arg.kind is CHECK:
        return f"{x} = -1 if {x} is None else int(bool({x}))"
    if arg.kind is INT64:
        return f"{x} = {x} if type({x}) is int else _integer({x}, {x!r})"
    if arg.kind is ROUNDING:
        return f"{x} = _rounding({x})"
    return ""


def _op_value(arg: Arg, value: Any) -> Any:
    """A public default as the torch op / binding takes it."""
    if arg.kind is CHECK:
        return -1 if value is None else int(bool(value))
    if arg.kind is ROUNDING:
        return _rounding(value)
    return value


_ROUNDINGS = {None: 0, "nearest": 1, "stochastic": 2}


def _rounding(value) -> int:
    """state_rounding as the binding takes it (0: the format's default, 1 nearest, 2 stochastic);
    ints pass (the torch op's own calls)."""
    if type(value) is int and 0 <= value <= 2:
        return value
    if value not in _ROUNDINGS:
        raise ValueError(f"`state_rounding` must be None, 'nearest' or 'stochastic'; got {value!r}")
    return _ROUNDINGS[value]


# ---- generated functions ----------------------------------------------------------------------
def _compile(name: str, params: str, body: Sequence[str], closure: Dict[str, Any],
             namespace: Dict[str, Any], tag: str):
    """`def name(params): body` with `closure`'s names bound, its globals `namespace`."""
    lines = ["from __future__ import annotations", f"def _make({', '.join(closure)}):",
             f"    def {name}({params}):"]
    lines += [f"        {line}" for line in body]
    lines += [f"    return {name}", ""]
    source = "\n".join(lines)
    filename = f"<deltastate {tag} {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = compile(source, filename, "exec")
    scope: Dict[str, Any] = {}
    exec(code, namespace, scope)
    fn = scope["_make"](**closure)
    fn.__qualname__ = name  # not "_make.<locals>.name", in reprs and in Python's own TypeErrors
    if hasattr(fn.__code__, "co_qualname"):  # Python >= 3.11 takes the latter from the code
        fn.__code__ = fn.__code__.replace(co_qualname=name)
    return fn


def _params(args: Sequence[Arg], defaults: Dict[str, Any], public: bool) -> str:
    """A parameter list; the public function's with annotations and keyword-only arguments."""
    out, keyword = [], False
    for a in args:
        if public and a.keyword and not keyword:
            out.append("*")
            keyword = True
        p = a.name
        if public and a.kind.annotation:
            p += f": {a.kind.annotation}"
        d = defaults.get(a.name, REQUIRED)
        if d is not REQUIRED:
            assert d is None or type(d) in (bool, int, float, str), f"{a.name}: default {d!r}"
            p += f"={d!r}"
        out.append(p)
    return ", ".join(out)


def _arg_list(op: Op) -> str:
    """The generated part of a public function's docstring: each argument's kind and dtypes."""
    args = op.public_args
    width = max(len(a.name) for a in args)
    lines = ["Arguments:"]
    for a in args:
        what = a.kind.annotation or a.kind.name
        if a.dtypes:
            what += f" ({', '.join(a.dtypes)})"
        if a.mutated:
            what += ", written in place"
        lines.append(f"  {a.name:<{width}}  {what}")
    return "\n".join(lines)


def _unsupported(a: Arg) -> str:
    """The test that `a` (an option deltastate does not implement) has a value other than its
    default."""
    x, d = a.name, a.default
    if d is None:
        return f"{x} is not None"
    if type(d) is bool:
        return f"{x} is not {d!r} and bool({x}) != {d!r}"
    return f"{x} != {d!r}"


def public_function(op: Op, ffi, binding: Sequence[Arg], namespace: Dict[str, Any]):
    """The public function of `op`: the table's signature; the rejection of unsupported options;
    `op.prepare` (if any); `op.route` (if any: a call it routes goes to the public function
    `op.route_to`); the scalars converted; then, while torch.compile traces, the torch custom op
    (``_tops.ops.<name>``), else the binding `ffi`, whose type errors are re-raised naming the
    public argument and whose messages print dtypes as the arguments' framework does.

    `namespace` (the globals of :mod:`deltastate.ops`) provides ``_is_compiling``, ``_tops``,
    ``_number``, ``_number_or_none``, ``_arg_error``, ``_spelled`` and ``_not_implemented``."""
    public = op.public_args
    closure: Dict[str, Any] = {"_ffi": ffi, "_op": op.public,
                               "_shown": tuple((a.shown_as or a.name, a.kind.expected)
                                               for a in binding),
                               "_dtypes": dtype_table(binding),
                               "_renames": shown_names(binding)}
    body = []
    for a in public:
        if a.unsupported is not None:
            body += [f"if {_unsupported(a)}:",
                     f"    raise _not_implemented(_op, {a.name!r}, {a.name}, {a.unsupported!r})"]
    if op.prepare is not None:
        inputs = list(inspect.signature(op.prepare).parameters)[1:]
        call_prepare = f"_prepare(_op, {', '.join(inputs)})"
        body.append(f"{', '.join(op.fills)}, = {call_prepare}" if op.fills else call_prepare)
        closure["_prepare"] = op.prepare
    returns = op.returns if isinstance(op.returns, str) else ", ".join(op.returns)
    if op.route is not None:  # the target is a global of the namespace, resolved at call time
        assert op.route_to, f"{op.name}: a route needs route_to"
        inputs = list(inspect.signature(op.route).parameters)[1:]
        body += [f"_routed = _route(_op, {', '.join(inputs)})",
                 "if _routed is not None:",
                 f"    {op.route_to}(*_routed[0], **_routed[1])",
                 f"    return {returns}"]
        closure["_route"] = op.route
    body += [s for s in (_convert(a) for a in public if a.op) if s]
    body += [f"{a.name} = {_op_value(a, a.default)!r}" for a in op.op_args
             if not a.public and a.name not in op.fills]
    call = ", ".join(a.name for a in binding)
    body += [
        "if _is_compiling():",
        f"    _tops.ops.{op.name}({', '.join(a.name for a in op.op_args)})",
        f"    return {returns}",
        "try:",
        f"    _ffi({call})",
        "except (TypeError, BufferError) as e:",
        f"    raise _arg_error(_op, _shown, ({call},), e) from None",
        "except Exception as e:",
        f"    raise _spelled(e, ({call},), _dtypes, _renames) from None",
        f"return {returns}",
    ]
    defaults = {a.name: a.default for a in public}
    fn = _compile(op.public, _params(public, defaults, public=True), body, closure, namespace,
                  "public")
    fn.__doc__ = f"{inspect.cleandoc(op.doc)}\n\n{_arg_list(op)}"
    return fn


# ---- torch ------------------------------------------------------------------------------------
def _schema_defaults(op: Op) -> Dict[str, Any]:
    """The torch op's defaults: every argument from `op.schema_defaults_from` on (by default the
    trailing run of arguments with a default the op's kind can take)."""
    args = op.op_args

    def has_default(a: Arg) -> bool:
        return a.default is not REQUIRED and (a.default is not None or a.kind.schema.endswith("?")
                                               or a.kind is CHECK or a.kind is ROUNDING)

    if op.schema_defaults_from is not None:
        start = [a.name for a in args].index(op.schema_defaults_from)
    else:
        start = len(args)
        while start > 0 and has_default(args[start - 1]):
            start -= 1
    assert all(has_default(a) for a in args[start:]), f"{op.name}: an argument has no default"
    return {a.name: _op_value(a, a.default) for a in args[start:]}


def schema(op: Op) -> str:
    """The torch custom-op schema: the op's arguments in order, `Tensor(a!)` (`Tensor(b!)?`, ...)
    on the ones it writes in place, returning nothing."""
    defaults = _schema_defaults(op)
    parts, alias = [], iter("abcdefghijklmnopqrstuvwxyz")
    for a in op.op_args:
        t = a.kind.schema
        if a.mutated:
            base, opt = (t[:-1], "?") if t.endswith("?") else (t, "")
            t = f"{base}({next(alias)}!){opt}"
        p = f"{t} {a.name}"
        if a.name in defaults:
            p += f"={defaults[a.name]!r}"
        parts.append(p)
    return f"{op.name}({', '.join(parts)}) -> ()"


def torch_impl(op: Op, ffi, binding: Sequence[Arg]):
    """The torch op's real implementation (CPU and CUDA dispatch keys): the schema's arguments,
    defaults included (the dispatcher passes only those given), after `op.impl_prepare` (if any),
    handed to the binding."""
    params = _params(op.op_args, _schema_defaults(op), public=False)
    call = ", ".join(a.name for a in binding)
    closure: Dict[str, Any] = {"_ffi": ffi, "_spelled": spelled, "_dtypes": dtype_table(binding)}
    body = []
    if op.impl_prepare is not None:  # e.g. the workspace the trace left to the implementation
        inputs = ", ".join(inspect.signature(op.impl_prepare).parameters)
        body.append(f"{', '.join(op.impl_fills)}, = _impl_prepare({inputs})")
        closure["_impl_prepare"] = op.impl_prepare
    body += ["try:", f"    _ffi({call})", "except Exception as e:",
             f"    raise _spelled(e, ({call},), _dtypes) from None"]
    return _compile(op.name, params, body, closure, {}, "torch")


# ---- error texts ------------------------------------------------------------------------------
DTYPE_MARK = "\x1f"  # the core marks the dtype names of its messages (include/deltastate/error.h)
_MARKED = re.compile(DTYPE_MARK + "([^" + DTYPE_MARK + "]*)" + DTYPE_MARK)
_NAMED = re.compile(r"`(\w+)`")
# The binding's text for a dtype it cannot pass on (python/src/module.cpp, to_dtype).
_UNTAKEN = re.compile(r"^`(\w+)` has dtype " + DTYPE_MARK + "[^" + DTYPE_MARK + "]*" + DTYPE_MARK +
                      ", which deltastate does not take$")


def dtype_table(binding: Sequence[Arg]) -> Tuple[Tuple[str, Tuple[str, ...]], ...]:
    """Per binding position: the argument's name in the binding's messages and the dtypes the
    table says it takes (for :func:`spelled`)."""
    return tuple((a.name, a.dtypes) for a in binding)


def _framework(value: Any) -> str:
    """"torch", "numpy" or "" (not an array)."""
    module = type(value).__module__
    if module.startswith("torch"):
        return "torch"
    return "numpy" if module.startswith("numpy") else ""


def shown_names(binding: Sequence[Arg]) -> Dict[str, str]:
    """The op arguments a surface shows under its own names (`Arg.shown_as`): core name -> the
    public argument's, for the messages of that surface."""
    return {a.name: a.shown_as for a in binding if a.shown_as and a.shown_as != a.name}


def spelled(exc: BaseException, args, dtypes=(), renames=None) -> BaseException:
    """`exc` (raised by the binding; error path only) with the dtype names it marks printed as
    the caller's framework prints them: ``torch.float16`` for a torch tensor, ``float16`` (numpy's
    spelling) for a numpy array. Each marked name is spelled for the argument the message names
    last before it (`dtypes`, per binding position: the name and the dtypes the op table lists;
    `args`: the values passed); a name no argument claims, as torch prints it when any argument is
    a torch tensor. The binding's rejection of a dtype it has no type for gets the dtypes that
    argument takes appended. A name in backquotes that the surface shows under another name
    (`renames`, shown_names) is printed as the surface's. Other exceptions are returned as they
    are."""
    msg = str(exc)
    frameworks = {name: _framework(a) for (name, _), a in zip(dtypes, args)}
    untaken = _UNTAKEN.match(msg)
    if untaken:
        takes = dict(dtypes).get(untaken.group(1))
        if takes:
            marked = [DTYPE_MARK + d + DTYPE_MARK for d in takes]
            listed = marked[0] if len(marked) == 1 else ", ".join(marked[:-1]) + " or " + marked[-1]
            msg += f"; `{untaken.group(1)}` takes {listed}"
    if DTYPE_MARK not in msg:
        return _renamed(exc, msg, renames)
    any_torch = any(_framework(a) == "torch" for a in args)
    names = [(m.end(), m.group(1)) for m in _NAMED.finditer(msg)]

    def spell(m: "re.Match[str]") -> str:
        named = [n for end, n in names if end <= m.start() and frameworks.get(n)]
        torch_spelling = frameworks[named[-1]] == "torch" if named else any_torch
        return ("torch." if torch_spelling else "") + m.group(1)

    return _renamed(exc, _MARKED.sub(spell, msg), renames)


def _renamed(exc: BaseException, text: str, renames) -> BaseException:
    """`exc` with message `text`, each backquoted name `renames` maps printed as its surface's
    (the dtypes are spelled first: they follow the core names)."""
    if renames:
        text = _NAMED.sub(lambda m: "`" + renames.get(m.group(1), m.group(1)) + "`", text)
    if text == str(exc):
        return exc
    try:
        return type(exc)(text)
    except Exception:  # an exception class that does not take a message
        return RuntimeError(text)


def torch_fake(*args, **kwargs):
    """The fake (meta) implementation of every op: an op only writes tensors it was given, so
    under FakeTensor tracing there is nothing to produce; the schema's (a!) annotations tell the
    compiler which inputs change."""
    return None
