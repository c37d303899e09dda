"""Each op's Python surface, written once: the table ``OPS``.

An entry (:class:`Op`) lists the op's arguments in order, each with its kind, default, accepted
dtypes, whether the op writes it in place, and names what the public function returns. Derived
from it (:mod:`deltastate._derive`):

- the public function in :mod:`deltastate.ops`: its signature (``inspect.signature``, ``help()``),
  the conversion of Python scalars, the rejection of a peer's option deltastate does not implement,
  the call of the tvm-ffi binding, and the error that names an argument the binding rejected by
  type;
- the torch custom op in :mod:`deltastate.torch_ops`: its schema, with ``Tensor(a!)`` on every
  tensor the op writes in place, its CPU/CUDA implementation and its fake implementation;
- the order of the binding's arguments: the compiled module lists each binding's arguments by name
  and kind (``op_signatures()``, from the ``Binding`` of its args struct in python/src/module.cpp);
  calls are built from that list by name, and an entry that names other arguments or kinds than
  the binding fails the import.

Several public functions may share one binding (``Op.binding``): the peers' names for one core op
(FLA's ``fused_recurrent_kda`` and FlashInfer's ``recurrent_kda``), each with its own arguments,
defaults and torch op. Arguments of the public function only (``op=False``) are read by the
entry's ``prepare`` step, which maps the peer's surface onto the binding's arguments.

Adding an op: its args struct (include/deltastate/ops.h), its ``Binding`` in module.cpp, and one
entry here.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union


@dataclass(frozen=True)
class Kind:
    """How an argument crosses the binding."""

    name: str  # as the binding reports it (module.cpp's Kind<T>::name)
    schema: str  # its torch schema type
    expected: str  # "`x` must be <expected>" when the binding rejects a value
    annotation: Optional[str]  # the public function's annotation (None: none)


TENSOR = Kind("tensor", "Tensor", "a tensor (a numpy array or a torch tensor)", None)
OPT_TENSOR = Kind("tensor?", "Tensor?", "a tensor (a numpy array or a torch tensor) or None", None)
FLOAT = Kind("float", "float", "a number", "float")
OPT_FLOAT = Kind("float?", "float?", "a number or None", "Optional[float]")
BOOL = Kind("bool", "bool", "a bool", "bool")
# Bounds-check slot indices: None = the backend default (on for CPU tensors, checked before
# anything is written; off for CUDA tensors, whose kernels skip a row with an out-of-range index
# and record it for check_errors; on there, the op synchronizes and raises after its launch).
# The binding and the torch op take it as an int: -1 = the default, 0 = off, 1 = on.
CHECK = Kind("check", "int", "an int", "Optional[bool]")
INT64 = Kind("int64", "int", "an int", "int")  # an integer count (module.cpp's Kind<int64_t>)
# How a stored state is rounded: None (the format's default), "nearest" or "stochastic"; the
# binding and the torch op take it as an int (0, 1, 2; module.cpp's Kind<StateRounding>).
ROUNDING = Kind("rounding", "int", "None, 'nearest' or 'stochastic'", "Optional[str]")
# Kinds of public-only arguments (never passed to the binding; read by `Op.prepare` or ignored).
OPT_BOOL = Kind("bool?", "", "a bool or None", "Optional[bool]")
INT = Kind("int", "", "an int", "int")
OPT_INT = Kind("int?", "", "an int or None", "Optional[int]")
STR = Kind("str", "", "a str", "str")
ANY = Kind("any", "", "anything", None)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of an argument the caller must give

# Accepted dtypes (what the core's validators take), for the generated documentation.
FLOATING = ("float32", "bfloat16", "float16")
INDEX = ("int32", "int64")
INT32 = ("int32",)
FLAGS = ("int32", "int8")  # a ReplaySSM is_flush table (SGLang's is int8)
FLOAT32 = ("float32",)
# A state pool's dtypes: the float ones, and the quantized ones of the ops that take them (a
# numpy pool's float8 codes come as uint8).
STATE = FLOATING + ("float8_e4m3fn", "int8", "uint8 (float8_e4m3fn codes)")
INT64_DT = ("int64",)


def _state_format_args() -> Tuple["Arg", ...]:
    """The state format's keyword arguments (ops.h StateFormatArgs; StatePool.state_format(l)
    gives them for a pool's layer), last in every op that takes them."""
    return (
        Arg("state_scales", OPT_TENSOR, None, dtypes=FLOAT32, mutated=True, keyword=True),
        Arg("state_rounding", ROUNDING, None, keyword=True),
        Arg("rounding_step", OPT_TENSOR, None, dtypes=INT64_DT, mutated=True, keyword=True),
        Arg("rounding_seed", INT64, 0, keyword=True),
        Arg("rounding_layer", INT64, 0, keyword=True),
    )


def _scratch_scales_arg(mutated: bool) -> "Arg":
    """The fp32 scales of a quantized verify scratch (``intermediate_states`` in float8_e4m3fn /
    int8), a keyword after the state format's: written by verify, read by the commit."""
    return Arg("intermediate_state_scales", OPT_TENSOR, None, dtypes=FLOAT32, mutated=mutated,
               keyword=True)


@dataclass(frozen=True)
class Arg:
    name: str
    kind: Kind
    default: Any = REQUIRED
    dtypes: Tuple[str, ...] = ()
    mutated: bool = False  # the op writes it in place (`Tensor(a!)` in the torch schema)
    keyword: bool = False  # keyword-only in the public function
    public: bool = True  # False: an argument of the op only (torch schema and binding), which
    #                      the public function passes as its default or `Op.prepare` fills
    op: bool = True  # False: an argument of the public function only, read by `Op.prepare`
    #                  (or accepted and ignored)
    shown_as: Optional[str] = None  # the public argument an op-only one comes from (in errors)
    # A peer's option deltastate does not implement: any value other than the default raises
    # NotImplementedError with this text (after "<function>: `<name>`=<value> ").
    unsupported: Optional[str] = None


@dataclass(frozen=True)
class Op:
    name: str  # the torch op (torch.ops.deltastate.<name>)
    public: str  # the public function in deltastate
    doc: str  # its docstring (an argument list generated from `args` is appended)
    args: Tuple[Arg, ...]  # in the public function's order; op-only arguments in the op's order
    returns: Union[str, Tuple[str, ...]]  # what the public function returns: a name or a tuple
    # The binding's module function (python/src/module.cpp); by default `name`.
    binding: Optional[str] = None
    # The torch op's argument order where it is not `args`' order.
    op_order: Optional[Tuple[str, ...]] = None
    # The first torch op argument with a default; by default the first of the trailing run of
    # arguments that have one.
    schema_defaults_from: Optional[str] = None
    # The op's own step before the scalar conversions and the call: a function of the op's
    # public name and of the arguments its parameters name, returning the values of `fills`.
    prepare: Optional[Callable[..., tuple]] = None
    fills: Tuple[str, ...] = ()
    # The torch op's own step in its real implementation (outside the torch.compile trace): a
    # function of the op arguments its parameters name, returning the values of `impl_fills`.
    impl_prepare: Optional[Callable[..., tuple]] = None
    impl_fills: Tuple[str, ...] = ()
    # The op's own dispatch to another public function, after `prepare`: a function of the op's
    # public name and of the public arguments its parameters name, returning None (the call goes
    # on to this op's binding) or ``(args, kwargs)``: the call goes to the public function
    # `route_to` with them instead, and returns what this op returns.
    route: Optional[Callable[..., Optional[Tuple[tuple, dict]]]] = None
    route_to: Optional[str] = None

    @property
    def binding_name(self) -> str:
        return self.binding or self.name

    @property
    def public_args(self) -> Tuple[Arg, ...]:
        return tuple(a for a in self.args if a.public)

    @property
    def op_args(self) -> Tuple[Arg, ...]:
        args = {a.name: a for a in self.args if a.op}
        if self.op_order is None:
            return tuple(args.values())
        assert sorted(self.op_order) == sorted(args), f"{self.name}: op_order names other args"
        return tuple(args[n] for n in self.op_order)


# ---- arrays of the caller's framework (prepare steps only; never on a decode op's path) ---------
def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _check_tensor(op, name, x):
    if x is None:
        raise TypeError(f"{op}: `{name}` is required (got None)")
    if not (_is_torch(x) or type(x).__module__ == "numpy"):
        raise TypeError(f"{op}: `{name}` must be a tensor (a numpy array or a torch tensor); got "
                        f"{type(x).__name__}")


def _empty(ref, shape, dtype=None):
    """A new uninitialized array of `ref`'s framework and device; `dtype` a name ("float32") or
    None for `ref`'s dtype."""
    if _is_torch(ref):
        import torch

        return torch.empty(tuple(shape), dtype=getattr(torch, dtype) if dtype else ref.dtype,
                           device=ref.device)
    import numpy as np

    return np.empty(tuple(shape), dtype=np.dtype(dtype) if dtype else ref.dtype)


def _empty_like(ref):
    """A new uninitialized array with `ref`'s shape, dtype, device and (dense) layout."""
    if _is_torch(ref):
        import torch

        return torch.empty_like(ref)
    import numpy as np

    return np.empty_like(ref)


def _zeros_state(ref, shape):
    """A new zero state of `ref`'s framework and device, as FlashInfer allocates one: bfloat16
    (float32 for numpy, which has no bfloat16), its base 256-byte aligned (recurrent_kda's stride
    contract)."""
    if _is_torch(ref):
        import torch

        return torch.zeros(tuple(shape), dtype=torch.bfloat16, device=ref.device)
    import numpy as np

    n = int(np.prod(shape))
    raw = np.zeros(n + 64, dtype=np.float32)
    off = ((-raw.ctypes.data) % 256) // 4
    return raw[off:off + n].reshape(shape)


def _filled(ref, shape, value):
    """A float32 array of `shape` holding `value` everywhere, as a broadcast view of one element
    (strides 0): FLA's `g=None` (no decay) and `beta=None` (ones) without an array of their size."""
    if _is_torch(ref):
        import torch

        return torch.full((1,), value, dtype=torch.float32, device=ref.device).expand(*shape)
    import numpy as np

    return np.lib.stride_tricks.as_strided(np.full(1, value, dtype=np.float32), tuple(shape),
                                           (0,) * len(shape))


def _sigmoid2(x):
    """2 * sigmoid(x) in float32 (FLA's allow_neg_eigval), in `x`'s framework."""
    if _is_torch(x):
        import torch

        return 2.0 * torch.sigmoid(x.float())
    import numpy as np

    return (2.0 / (1.0 + np.exp(-x.astype(np.float32)))).astype(np.float32)


def _per_k(g, gk):
    """FLA's g and gk together: the per-K log decay g[..., None] + gk, in float32."""
    if _is_torch(gk):
        return g.float().unsqueeze(-1) + gk.float()
    import numpy as np

    return g.astype(np.float32)[..., None] + gk.astype(np.float32)


def _shape(x):
    return tuple(getattr(x, "shape", ()))


# ---- packed decode ----------------------------------------------------------------------------
def _packed(kda: bool) -> Op:
    gdn_doc = """GDN packed decode (T=1), SGLang's ``fused_recurrent_gated_delta_rule_packed_decode``.
    Returns ``(out, initial_state)``, both updated in place.

    mixed_qkv [B, 2*H*K + HV*V]; a, b [B, HV]; A_log, dt_bias [HV]; initial_state: the pool
    [slots, HV, V, K] (any slot stride); out [B, 1, HV, V]; ssm_state_indices [B] (< 0: padded
    row; any stride). ``scale`` None: K^-0.5. ``round_beta``: round sigmoid(b) to b's dtype (off:
    fp32 beta, as SGLang).

    Quantized pools (CPU and CUDA; docs/STATE_FORMATS.md): a float8_e4m3fn or int8
    ``initial_state`` with its fp32 ``state_scales`` [slots, HV, V], both updated in place: each live row's state is
    dequantized, stepped in fp32 and requantized with a fresh per-row scale. ``state_rounding``
    None (the format's default: stochastic for float8_e4m3fn), "nearest" or "stochastic" (also
    for bfloat16 / float16 states); stochastic rounding needs ``rounding_step`` (int64 [1], the
    key's step, advanced by one per call), ``rounding_seed`` and ``rounding_layer``.
    ``**pool.state_format(layer)`` passes them for a StatePool layer.
    """
    kda_doc = """KDA packed decode (T=1), SGLang's ``fused_recurrent_kda_packed_decode``. As the GDN
    op, with a [B, HV*K] and dt_bias [HV*K]; ``lower_bound`` selects the safe gate. Returns
    ``(out, initial_state)``."""
    return Op(
        name="kda_packed_decode" if kda else "gdn_packed_decode",
        public=("fused_recurrent_kda_packed_decode" if kda
                else "fused_recurrent_gated_delta_rule_packed_decode"),
        doc=kda_doc if kda else gdn_doc,
        args=(
            Arg("mixed_qkv", TENSOR, dtypes=FLOATING),
            Arg("a", TENSOR, dtypes=FLOATING),
            Arg("b", TENSOR, dtypes=FLOATING),
            Arg("A_log", TENSOR, dtypes=FLOATING),
            Arg("dt_bias", TENSOR, dtypes=FLOATING),
            Arg("scale", OPT_FLOAT),  # None: K^-0.5
            Arg("initial_state", TENSOR, dtypes=STATE, mutated=True),
            Arg("out", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("ssm_state_indices", TENSOR, dtypes=INDEX),
            Arg("use_qk_l2norm_in_kernel", BOOL, False),
            Arg("lower_bound", OPT_FLOAT, None, public=kda),  # KDA: selects the safe gate
            Arg("round_beta", BOOL, False, keyword=True),
            Arg("check_indices", CHECK, None, keyword=True),
        ) + _state_format_args() + (
            Arg("pdl", BOOL, False, keyword=True),
        ),
        returns=("out", "initial_state"),
    )


# ---- recurrent (B,T and varlen): FlashInfer's recurrent_kda surface ----------------------------
_FLASHINFER_BACKENDS = ("auto", "cute-dsl", "cake")
_PREFILL = "(a FlashInfer prefill-backend option) is not implemented in deltastate; pass None"


def _flashinfer_prepare(op, q, k, v, g, beta, A_log, initial_state, output_final_state,
                        use_gate_in_kernel, lower_bound, cu_seqlens, ssm_state_indices, output,
                        backend, num_spec_tokens):
    """FlashInfer's recurrent_kda rules: the state is updated in place (with ssm_state_indices the
    pool's rows); returned when output_final_state: the pool, or without cu_seqlens but with
    indices the gathered [N, HV, V, K] rows; `initial_state=None` allocates a zero bfloat16 state
    as FlashInfer does; the output is allocated in q's dtype when not given."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_tensor(op, name, t)
    if backend not in _FLASHINFER_BACKENDS:
        raise ValueError(f"backend must be 'auto', 'cute-dsl', or 'cake', got {backend!r}")
    if use_gate_in_kernel and A_log is None:
        raise ValueError("A_log is required when use_gate_in_kernel=True")
    if lower_bound is not None:
        if not use_gate_in_kernel:
            raise ValueError("lower_bound requires use_gate_in_kernel=True")
        try:
            nonnegative = float(lower_bound) >= 0
        except (TypeError, ValueError):
            nonnegative = False  # the conversion names the argument
        if nonnegative:
            raise ValueError("lower_bound must be negative")
    qs, vs = _shape(q), _shape(v)
    if output is None:
        output = _empty(q, vs)  # q's dtype, as FlashInfer
    pool = initial_state
    if num_spec_tokens is not None:  # the pool receives every draft's state (_spec_route)
        if pool is None and len(qs) == 4 and len(vs) == 4:
            if ssm_state_indices is not None:
                live = [int(i) for i in _flat_ints(ssm_state_indices) if int(i) >= 0]
                n = max(live) + 1 if live else 1
            else:  # the batched shim's slots 0 .. B*T-1
                n = qs[0] * qs[1]
            pool = _zeros_state(q, (n, vs[2], vs[3], qs[3]))
        return output, None, pool, ssm_state_indices, None, pool if output_final_state else None
    if pool is None and len(qs) == 4 and len(vs) == 4:  # otherwise the core rejects q / v
        shape_tail = (vs[2], vs[3], qs[3])
        if cu_seqlens is not None:
            n = len(cu_seqlens) - 1
            if ssm_state_indices is not None:
                live = [int(i) for i in ssm_state_indices.tolist() if int(i) >= 0]
                n = max(live) + 1 if live else 1
            pool = _zeros_state(q, (n,) + shape_tail)
        else:  # FlashInfer: a [B, HV, V, K] state; the indices are then not used
            pool = _zeros_state(q, (qs[0],) + shape_tail)
            ssm_state_indices = None
    final = None
    if not output_final_state:
        returned = None
    elif ssm_state_indices is not None and cu_seqlens is None and pool is not None:
        n = qs[0] if len(qs) == 4 else 0
        final = _empty(pool, (n,) + tuple(_shape(pool)[1:]))  # the gathered rows
        returned = final
    else:
        returned = pool
    return output, None, pool, ssm_state_indices, final, returned


def _flat_ints(t):
    """The entries of an index tensor or array as a flat Python list."""
    return t.reshape(-1).tolist()


def _check_source(op, q, v, state_pool, initial_state_source, initial_state_indices):
    """FlashInfer's checks of initial_state_source / initial_state_indices, its texts, in its
    order; the dtype rule is deltastate's: any floating dtype, the pool's (FlashInfer: bfloat16,
    as every one of its states)."""
    if (initial_state_source is None) != (initial_state_indices is None):
        raise ValueError("initial_state_source and initial_state_indices must be provided "
                         "together")
    if initial_state_source is None:
        return
    ii = _shape(initial_state_indices)
    if len(ii) != 1:
        raise ValueError(f"initial_state_indices must be 1D, got shape {list(ii)}")
    _check_tensor(op, "initial_state_source", initial_state_source)
    if state_pool is not None and initial_state_source.dtype != state_pool.dtype:
        raise ValueError(f"initial_state_source must have the dtype of initial_state "
                         f"({state_pool.dtype}), got {initial_state_source.dtype}")
    qs, vs, ss = _shape(q), _shape(v), _shape(initial_state_source)
    want = (vs[2], vs[3], qs[3]) if len(qs) == 4 and len(vs) == 4 else None
    if want is not None and tuple(ss[1:]) != want:
        raise ValueError(f"initial_state_source must have trailing shape "
                         f"[{want[0]}, {want[1]}, {want[2]}], got {list(ss)}")


def _spec_route(op: str, q, k, v, g, beta, output, A_log, dt_bias, scale, state_pool,
                use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, cu_seqlens,
                ssm_state_indices, num_spec_tokens, num_accepted_tokens, initial_state_source,
                initial_state_indices, beta_is_logit, round_beta, check_indices, pdl):
    """FlashInfer's speculative decode (num_spec_tokens = S: 1 + S tokens per sequence) on
    deltastate's verify: the start state from slot ssm_state_indices[n, num_accepted - 1]
    (column 0 without num_accepted_tokens; values clamped to [1, 1 + S] as FlashInfer's kernel
    does), or with initial_state_source from its row initial_state_indices[n] (the verify op's
    read-only source_state; num_accepted_tokens is then not read, as in FlashInfer's kernel);
    the state after token t into slot ssm_state_indices[n, t], the pool updated in place.
    Batched calls without cu_seqlens and without indices use slots arange(B * (1 + S)), as
    FlashInfer's shim. FlashInfer's checks and texts, in its order."""
    _check_source(op, q, v, state_pool, initial_state_source, initial_state_indices)
    if num_spec_tokens is None:
        if initial_state_source is not None:
            raise NotImplementedError(
                f"{op}: `initial_state_source` outside speculative decode (num_spec_tokens=None) "
                "is not implemented in deltastate; it is supported with num_spec_tokens set")
        return None
    S = int(num_spec_tokens)
    qs = _shape(q)
    if cu_seqlens is not None and ssm_state_indices is None:
        raise ValueError("ssm_state_indices is required when num_spec_tokens is set with "
                         "cu_seqlens")
    T = 1 + S
    torch_in = _is_torch(q)
    if cu_seqlens is None and len(qs) == 4:
        if T != qs[1]:
            raise ValueError(f"q.shape[1]={qs[1]} must equal 1+num_spec_tokens={T} when "
                             f"cu_seqlens is not provided")
        B = qs[0]
        if ssm_state_indices is None:
            if _shape(state_pool)[0] < B * T:
                raise ValueError("initial_state must have at least B*(1+num_spec_tokens) slots "
                                 "when batched spec decode auto-generates ssm_state_indices")
            if torch_in:
                import torch

                ssm_state_indices = torch.arange(B * T, dtype=torch.int32,
                                                 device=q.device).reshape(B, T)
            else:
                import numpy as np

                ssm_state_indices = np.arange(B * T, dtype=np.int32).reshape(B, T)
        N = B
    else:
        if len(qs) == 4 and qs[0] != 1:
            raise ValueError(f"Batch size must be 1 with cu_seqlens, got B={qs[0]}")
        N = _shape(cu_seqlens)[0] - 1
    if S <= 0:
        raise ValueError(f"num_spec_tokens must be >= 1, got {S}. Use num_spec_tokens=None for "
                         f"standard decode.")
    si = _shape(ssm_state_indices)
    if len(si) != 2 or si[1] != T:
        raise ValueError(f"ssm_state_indices must be 2D [N, {T}] in spec mode, got shape "
                         f"{list(si)}")
    if si[0] != N:
        raise ValueError(f"ssm_state_indices.shape[0]={si[0]} must equal N={N} "
                         f"(cu_seqlens.shape[0]-1)")
    kw = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, is_kda=op == "recurrent_kda",
              use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound,
              beta_is_logit=beta_is_logit, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
              cu_seqlens=cu_seqlens, token_state_indices=ssm_state_indices,
              round_beta=round_beta, check_indices=check_indices, pdl=pdl)
    if initial_state_source is not None:
        n_idx = _shape(initial_state_indices)[0]
        if n_idx < N:
            raise ValueError(f"initial_state_indices must contain one entry per sequence, got "
                             f"{n_idx} entries for N={N}")
        kw["source_state"] = initial_state_source
        kw["source_state_indices"] = initial_state_indices[:N]
    elif num_accepted_tokens is None:
        kw["state_indices"] = ssm_state_indices[:, 0]
    elif torch_in:
        kw["num_accepted_tokens"] = num_accepted_tokens.clamp(1, T)
    else:
        import numpy as np

        kw["num_accepted_tokens"] = np.clip(num_accepted_tokens, 1, T)
    return (q, k, v, g, beta, output, state_pool), kw


def _recurrent(kda: bool) -> Op:
    kda_doc = """Recurrent KDA over a pool, FlashInfer's ``recurrent_kda``: q, k [B,T,H,K] (or
    [1,T_total,H,K] with cu_seqlens [N+1]), v [B,T,HV,V], g [B,T,HV,K] (log decay; the raw gate
    input with use_gate_in_kernel), beta [B,T,HV]. The state [.., HV, V, K] is updated in place:
    with ssm_state_indices (any stride; < 0: padded) the rows of the pool initial_state, without
    them initial_state[n] for sequence n. Returns ``(output, final_state)``: final_state is None
    unless output_final_state; then it is the pool itself, or, with ssm_state_indices and without
    cu_seqlens, a new [N, HV, V, K] array of the updated rows (FlashInfer's gathered states;
    zeros for padded rows). ``initial_state=None`` allocates a zero bfloat16 state (numpy:
    float32) as FlashInfer does: [max(index)+1, HV, V, K] with cu_seqlens, else [B, HV, V, K].
    The output, allocated when not given, has q's dtype and v's shape. The state must meet the
    compiled stride contract (slot stride a multiple of 16 elements, base 32-byte aligned).

    Speculative decode (num_spec_tokens = S, FlashInfer's rules): 1 + S tokens per sequence
    ([B, 1+S, ...], or [1, N*(1+S), ...] with cu_seqlens), ssm_state_indices [N, 1+S] (batched
    without it: slots arange(B*(1+S))): sequence n starts from slot ssm_state_indices[n,
    num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens; values clamped to
    [1, 1+S]) and the state after token t is written to slot ssm_state_indices[n, t] (< 0:
    skipped; a row starting at < 0 is padded, output zero); runs deltastate.verify.
    initial_state_source [N0, HV, V, K] with initial_state_indices [>= N] (int32/int64, any
    stride; FlashInfer's read-only committed pool): token 0 starts from row
    initial_state_indices[n] of it instead (num_accepted_tokens is then not read, as in
    FlashInfer's kernel); it is never written. Beyond FlashInfer (bfloat16 only): any floating
    dtype, initial_state's. Differences: a row < 0 marks a padded sequence (output zero, nothing
    written; FlashInfer reads row 0), and the source outside speculative decode
    (num_spec_tokens=None, which FlashInfer also takes) raises NotImplementedError.

    Not implemented, rejected with NotImplementedError when not None: FlashInfer's
    prefill-backend options (seq_order, prefill_workspace, state_checkpoints,
    checkpoint_cu_starts, checkpoint_every_n_tokens != 0).
    ``backend`` is checked against FlashInfer's names and otherwise ignored (one backend here).
    ``round_beta``: round beta to its input dtype (off: fp32, as every op).

    Quantized pools (CPU and CUDA; docs/STATE_FORMATS.md): a float8_e4m3fn or int8 pool
    initial_state with ssm_state_indices (V-first, updated in place, output_final_state False) and the state-format
    keywords of fused_recurrent_gated_delta_rule_packed_decode (``**pool.state_format(layer)``);
    a multi-token sequence keeps its state in fp32 and stores it once."""
    gdn_doc = """Recurrent GDN: as :func:`recurrent_kda` with g [B,T,HV] (one decay per value
    head)."""
    return Op(
        name="recurrent_kda" if kda else "recurrent_gated_delta_rule",
        public="recurrent_kda" if kda else "recurrent_gated_delta_rule",
        doc=kda_doc if kda else gdn_doc,
        args=(
            Arg("q", TENSOR, dtypes=FLOATING),
            Arg("k", TENSOR, dtypes=FLOATING),
            Arg("v", TENSOR, dtypes=FLOATING),
            Arg("g", TENSOR, dtypes=FLOATING),
            Arg("beta", TENSOR, dtypes=FLOATING),
            Arg("A_log", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("dt_bias", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("scale", OPT_FLOAT, None),  # None: K^-0.5
            # The state, updated in place (op: `state_pool`); the op's read-only start state
            # `initial_state` is then None.
            Arg("initial_state", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("output_final_state", BOOL, False, op=False),
            Arg("use_qk_l2norm_in_kernel", BOOL, True),
            Arg("use_gate_in_kernel", BOOL, False),
            Arg("lower_bound", OPT_FLOAT, None),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
            Arg("ssm_state_indices", OPT_TENSOR, None, dtypes=INDEX),
            Arg("num_spec_tokens", OPT_INT, None, op=False),
            Arg("num_accepted_tokens", ANY, None, op=False),
            Arg("output", TENSOR, None, dtypes=FLOATING, mutated=True),  # None: allocated
            Arg("initial_state_source", ANY, None, op=False),
            Arg("initial_state_indices", ANY, None, op=False),
            Arg("beta_is_logit", BOOL, False),
            Arg("seq_order", ANY, None, op=False, unsupported=_PREFILL),
            Arg("prefill_workspace", ANY, None, op=False, unsupported=_PREFILL),
            Arg("state_checkpoints", ANY, None, op=False, unsupported=_PREFILL),
            Arg("checkpoint_cu_starts", ANY, None, op=False, unsupported=_PREFILL),
            Arg("checkpoint_every_n_tokens", INT, 0, op=False,
                unsupported="(FlashInfer's prefill state checkpoints) is not implemented in "
                "deltastate; pass 0"),
            Arg("backend", STR, "auto", keyword=True, op=False),
            Arg("round_beta", BOOL, False, keyword=True),
            Arg("check_indices", CHECK, None, keyword=True),
        ) + _state_format_args() + (
            Arg("pdl", BOOL, False, keyword=True),
            # The pool, updated in place.
            Arg("state_pool", OPT_TENSOR, dtypes=FLOATING, mutated=True, public=False,
                shown_as="initial_state"),
            Arg("final_state", OPT_TENSOR, dtypes=FLOATING, mutated=True, public=False),
            Arg("state_v_first", BOOL, True, public=False),
            Arg("stride_contract", BOOL, True, public=False),
        ),
        returns=("output", "returned_state"),
        op_order=_RECURRENT_OP_ORDER,
        schema_defaults_from="check_indices",
        prepare=_flashinfer_prepare,
        fills=("output", "initial_state", "state_pool", "ssm_state_indices", "final_state",
               "returned_state"),
        route=_spec_route,
        route_to="verify",
    )


_RECURRENT_OP_ORDER = ("q", "k", "v", "g", "beta", "output", "A_log", "dt_bias",
                       "use_gate_in_kernel", "lower_bound", "beta_is_logit", "round_beta", "scale",
                       "initial_state", "state_pool", "ssm_state_indices", "cu_seqlens",
                       "final_state", "state_v_first", "stride_contract",
                       "use_qk_l2norm_in_kernel", "check_indices", "state_scales",
                       "state_rounding", "rounding_step", "rounding_seed", "rounding_layer",
                       "pdl")


# ---- FLA's fused-recurrent functions ----------------------------------------------------------
def _fla_layout(state_v_first, transpose_state_layout):
    """FLA's `state_v_first` with its deprecated alias `transpose_state_layout`."""
    if transpose_state_layout is not None:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated "
                             "`transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=4)
        state_v_first = bool(transpose_state_layout)
    return bool(state_v_first)


def _fla_common(op, q, k, v, beta, initial_state, output_final_state, use_beta_sigmoid_in_kernel,
                allow_neg_eigval, state_v_first, transpose_state_layout, cu_seqlens):
    """What FLA's two functions share: the layout, beta (None: ones; logits with
    use_beta_sigmoid_in_kernel; allow_neg_eigval: 2 * sigmoid), the output like v, the new
    float32 final state in the requested layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(op, name, t)
    v_first = _fla_layout(state_v_first, transpose_state_layout)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    qs, vs = _shape(q), _shape(v)
    beta_is_logit = bool(use_beta_sigmoid_in_kernel)
    if beta is None:
        beta = _filled(v, vs[:3], 1.0)
        beta_is_logit = False
    else:
        _check_tensor(op, "beta", beta)
        if len(_shape(beta)) == len(vs) == 4:
            raise NotImplementedError(
                f"{op}: a per-value-channel `beta` [B, T, HV, V] is not supported by deltastate "
                "(beta is one scalar per token and value head: [B, T, HV])")
        if allow_neg_eigval:  # [B, T, HV] only: a small float32 temporary
            beta, beta_is_logit = _sigmoid2(beta), False
    output = _empty(v, vs)
    final = None
    if output_final_state and len(qs) == 4 and len(vs) == 4:
        n = (len(cu_seqlens) - 1) if cu_seqlens is not None else qs[0]
        tail = (vs[2], vs[3], qs[3]) if v_first else (vs[2], qs[3], vs[3])
        final = _empty(q, (n,) + tail, "float32")
    return v_first, beta, beta_is_logit, output, final


def _fla_gdn_prepare(op, q, k, v, g, gk, gv, beta, initial_state, output_final_state,
                     use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                     allow_neg_eigval, state_v_first, transpose_state_layout, cu_seqlens):
    v_first, beta, beta_is_logit, output, final = _fla_common(
        op, q, k, v, beta, initial_state, output_final_state, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, state_v_first, transpose_state_layout, cu_seqlens)
    if gv is not None:
        raise NotImplementedError(
            f"{op}: `gv` (a per-value-channel decay) is not supported by deltastate: the state "
            "decays along K only (`g` per value head, `gk` per key channel); pass gv=None")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError("`g` (raw pre-activation) must be provided when "
                             "`use_gate_in_kernel=True`.")
        if gk is not None:
            raise NotImplementedError(
                f"{op}: `gk` with use_gate_in_kernel=True is not supported by deltastate (the "
                "in-kernel gate applies to `g` alone); pass the whole per-K log decay as `gk` "
                "with use_gate_in_kernel=False")
    else:
        A_log = dt_bias = None  # FLA ignores them without the in-kernel gate
        if gk is not None:  # GDN with a per-K decay: KDA's gate, through the GDN entry
            g = gk if g is None else _per_k(g, gk)
        elif g is None:
            g = _filled(v, _shape(v)[:3], 0.0)  # no decay
    return g, beta, beta_is_logit, A_log, dt_bias, output, initial_state, final, v_first, final


def _fla_kda_prepare(op, q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state,
                     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                     lower_bound, state_v_first, transpose_state_layout, cu_seqlens):
    _check_tensor(op, "g", g)
    v_first, beta, beta_is_logit, output, final = _fla_common(
        op, q, k, v, beta, initial_state, output_final_state, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, state_v_first, transpose_state_layout, cu_seqlens)
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None  # FLA ignores them without the in-kernel gate
    elif A_log is None and lower_bound is None:
        raise NotImplementedError(
            f"{op}: use_gate_in_kernel=True without `A_log` is supported with `lower_bound` (the "
            "safe gate lower_bound * sigmoid(g + dt_bias)); pass `A_log` for the standard gate")
    return (beta, beta_is_logit, A_log, dt_bias, lower_bound, output, initial_state, final,
            v_first, final)


def _fla_doc(kda: bool) -> str:
    if kda:
        head = """KDA, FLA's ``fused_recurrent_kda``: q, k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K]
    (log decay; with use_gate_in_kernel the raw gate: -exp(A_log) * softplus(g + dt_bias), or
    with lower_bound lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), A_log=None meaning the
    factor 1 there), beta [B,T,HV]."""
    else:
        head = """GDN, FLA's ``fused_recurrent_gated_delta_rule``: q, k [B,T,H,K], v [B,T,HV,V],
    g [B,T,HV] (log decay; None: none; with use_gate_in_kernel the raw gate, -exp(A_log) *
    softplus(g + dt_bias)), gk [B,T,HV,K] a per-key-channel log decay (applied with g: KDA's
    math; not with use_gate_in_kernel), gv: not supported (NotImplementedError), beta [B,T,HV]
    (None: ones)."""
    return head + """ With cu_seqlens [N+1]: B = 1, sequence n is tokens [cu[n], cu[n+1]).

    initial_state [N, HV, K, V] (FLA's default K-first layout) or, with state_v_first=True,
    [N, HV, V, K]; only read. Returns ``(o, final_state)``: o like v, final_state a new float32
    state in the same layout when output_final_state, else None. The CPU backend runs both
    layouts; on CUDA a K-first state is rejected (NotImplementedError): deltastate never
    transposes or copies a state behind the caller's back. With K = V (Qwen3-Next, Kimi-Linear)
    the two layouts have one shape and cannot be told apart: state_v_first must say how the
    state was written, or it is read transposed without an error.

    use_beta_sigmoid_in_kernel: beta holds logits; allow_neg_eigval (needs it): beta = 2 *
    sigmoid(beta). A_log / dt_bias / lower_bound are ignored without use_gate_in_kernel, as FLA
    does. ``transpose_state_layout``: FLA's deprecated name of state_v_first (DeprecationWarning).
    Unlike FLA (which swallows them in ``**kwargs``), other keywords raise TypeError.
    ``round_beta``: round beta to its input dtype (off: fp32, as every op)."""


def _fla(kda: bool) -> Op:
    tail = (
        Arg("transpose_state_layout", OPT_BOOL, None, keyword=True, op=False),
        Arg("round_beta", BOOL, False, keyword=True),
        Arg("check_indices", CHECK, None, keyword=True),
        Arg("pdl", BOOL, False, keyword=True),
        # Op-only: the read-only start state is `initial_state`; no pool, no indices.
        Arg("output", TENSOR, dtypes=FLOATING, mutated=True, public=False),
        Arg("beta_is_logit", BOOL, False, public=False),
        Arg("state_pool", OPT_TENSOR, None, dtypes=FLOATING, mutated=True, public=False),
        Arg("ssm_state_indices", OPT_TENSOR, None, dtypes=INDEX, public=False),
        Arg("final_state", OPT_TENSOR, dtypes=FLOATING, mutated=True, public=False),
        Arg("stride_contract", BOOL, False, public=False),
        # FLA's functions take no pool: a float state, rounded to nearest.
    ) + tuple(dataclasses.replace(a, public=False, keyword=False) for a in _state_format_args())
    common_head = (
        Arg("q", TENSOR, dtypes=FLOATING),
        Arg("k", TENSOR, dtypes=FLOATING),
        Arg("v", TENSOR, dtypes=FLOATING),
    )
    state_args = (
        Arg("scale", OPT_FLOAT, None),
        Arg("initial_state", OPT_TENSOR, None, dtypes=FLOATING),
        Arg("output_final_state", BOOL, False, op=False),
        Arg("use_qk_l2norm_in_kernel", BOOL, False),
        Arg("use_gate_in_kernel", BOOL, False),
    )
    if kda:
        args = common_head + (
            Arg("g", TENSOR, dtypes=FLOATING),
            Arg("beta", TENSOR, dtypes=FLOATING),
            Arg("A_log", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("dt_bias", OPT_TENSOR, None, dtypes=FLOATING),
        ) + state_args + (
            Arg("use_beta_sigmoid_in_kernel", BOOL, False, op=False),
            Arg("allow_neg_eigval", BOOL, False, op=False),
            Arg("lower_bound", OPT_FLOAT, None),
            Arg("state_v_first", BOOL, False),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
        ) + tail
        fills = ("beta", "beta_is_logit", "A_log", "dt_bias", "lower_bound", "output",
                 "initial_state", "final_state", "state_v_first", "returned_state")
        prepare = _fla_kda_prepare
    else:
        args = common_head + (
            Arg("g", TENSOR, None, dtypes=FLOATING),  # None: no decay
            Arg("gk", OPT_TENSOR, None, dtypes=FLOATING, op=False),
            Arg("gv", OPT_TENSOR, None, dtypes=FLOATING, op=False),
            Arg("beta", TENSOR, None, dtypes=FLOATING),  # None: ones
        ) + state_args + (
            Arg("A_log", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("dt_bias", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("use_beta_sigmoid_in_kernel", BOOL, False, op=False),
            Arg("allow_neg_eigval", BOOL, False, op=False),
            Arg("state_v_first", BOOL, False),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
        ) + tail + (Arg("lower_bound", OPT_FLOAT, None, public=False),)
        fills = ("g", "beta", "beta_is_logit", "A_log", "dt_bias", "output", "initial_state",
                 "final_state", "state_v_first", "returned_state")
        prepare = _fla_gdn_prepare
    return Op(
        name="fla_kda" if kda else "fla_gated_delta_rule",
        public="fused_recurrent_kda" if kda else "fused_recurrent_gated_delta_rule",
        binding="recurrent_kda" if kda else "recurrent_gated_delta_rule",
        doc=_fla_doc(kda),
        args=args,
        returns=("output", "returned_state"),
        op_order=_RECURRENT_OP_ORDER,
        schema_defaults_from="check_indices",
        prepare=prepare,
        fills=fills,
    )


# ---- ReplaySSM --------------------------------------------------------------------------------
_REPLAY_DOC = """ReplaySSM buffered decode (T=1), GDN or KDA (``is_kda``): SGLang's
    ``fused_recurrent_linear_replayssm_decode``, its arguments in its order. The checkpoint pool
    initial_state is written only on a flush (write_pos == L-1 or force_flush != 0); otherwise the
    record (d, k, g) is appended to the rings at write_pos, each stored rounded to its ring's
    dtype (a float32 k ring is exact). Returns ``(out, initial_state)``. The kernel does not move
    write_pos (the caller's rule: ``wp = flushed ? 0 : wp + 1``) unless ``advance_write_pos``,
    which advances each live row's cursor on the device.

    SGLang's Triton tuning keywords ``block_v``, ``num_warps``, ``num_stages`` and ``nk`` are
    accepted and ignored (deltastate picks its own launch; SGLang's nk/BKT checks are not
    reproduced). ``scale`` None: K^-0.5. ``round_beta``: round sigmoid(b) to b's dtype, SGLang's
    rule at 03a70bf outside predecay mode (off: fp32 beta, the rule of every deltastate op;
    ignored with predecayed_k_cache).

    SGLang's ring modes (CPU backend; CUDA: a generic kernel):
    ``circular_replay`` with ``cache_base`` [B] int32: record j of a row lies at ring position
    (cache_base + j) mod L; a natural flush (write_pos == L-1, not forced, L > 1) stores the state
    before the token as the checkpoint and still appends the token's record; a forced flush (or
    any flush at L = 1) folds the token in and appends nothing. The caller advances: forced ->
    cache_base 0, write_pos 0; natural -> cache_base (cache_base + write_pos) mod L, write_pos 1;
    otherwise write_pos + 1; ``advance_write_pos`` applies that rule to write_pos and
    cache_base in the kernel (both are then written).
    ``prefix_gate_cache`` (KDA; SGLang's GDN path ignores it): the g ring holds the cumulative
    gate since the checkpoint. ``predecayed_k_cache`` (KDA, circular, prefix gates, H == HV, a
    float32 checkpoint, a finite negative lower_bound): the k ring holds k / exp(G_j).

    Quantized checkpoints (CPU; docs/STATE_FORMATS.md): a float8_e4m3fn or int8 initial_state
    with the state-format keywords of fused_recurrent_gated_delta_rule_packed_decode
    (``**pool.state_format(layer)``): the checkpoint is loaded dequantized every step and stored
    with fresh scales on a flush; the rings keep their float dtypes."""

_HELION_DOC = """ReplaySSM buffered decode for KDA, SGLang's Helion
    ``helion_fused_recurrent_kda_replayssm_decode``: its arguments in its order, its argument
    forms (a [B, HV*K] or [B, HV, K]; dt_bias [HV*K] or [HV, K]) and its error texts. Otherwise as
    :func:`fused_recurrent_linear_replayssm_decode` with is_kda=True. Returns
    ``(out, initial_state)``."""


def _replay_head() -> Tuple[Arg, ...]:
    return (
        Arg("mixed_qkv", TENSOR, dtypes=FLOATING),
        Arg("a", TENSOR, dtypes=FLOATING),
        Arg("b", TENSOR, dtypes=FLOATING),
        Arg("A_log", TENSOR, dtypes=FLOATING),
        Arg("dt_bias", TENSOR, dtypes=FLOATING),
        Arg("scale", OPT_FLOAT),  # None: K^-0.5
        Arg("initial_state", TENSOR, dtypes=STATE, mutated=True),
        Arg("d_cache", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("k_cache", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("g_cache", TENSOR, dtypes=FLOAT32, mutated=True),
        Arg("out", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("ssm_state_indices", TENSOR, dtypes=INT32),
        Arg("write_pos", TENSOR, dtypes=INT32, mutated=True),
        Arg("force_flush", OPT_TENSOR, None, dtypes=INT32),
    )


def _replay_tail(helion: bool) -> Tuple[Arg, ...]:
    return (
        Arg("round_beta", BOOL, False, keyword=True),
        Arg("advance_write_pos", BOOL, False, keyword=True),
        Arg("helion", BOOL, helion, public=False),
        Arg("check_indices", CHECK, None, keyword=True),
    ) + _state_format_args() + (
        Arg("pdl", BOOL, False, keyword=True),
    )


_REPLAY_OP_ORDER = ("mixed_qkv", "a", "b", "A_log", "dt_bias", "scale", "initial_state", "d_cache",
                    "k_cache", "g_cache", "out", "ssm_state_indices", "write_pos", "force_flush",
                    "lower_bound", "use_qk_l2norm_in_kernel", "is_kda", "round_beta",
                    "advance_write_pos", "helion", "check_indices", "state_scales",
                    "state_rounding", "rounding_step", "rounding_seed", "rounding_layer",
                    "cache_base", "circular_replay", "prefix_gate_cache", "predecayed_k_cache",
                    "pdl")

_REPLAY = Op(
    name="replayssm_decode",
    public="fused_recurrent_linear_replayssm_decode",
    doc=_REPLAY_DOC,
    args=_replay_head() + (
        Arg("lower_bound", OPT_FLOAT, None),
        Arg("use_qk_l2norm_in_kernel", BOOL, False),
        Arg("is_kda", BOOL, False),
        Arg("block_v", OPT_INT, None, op=False),  # Triton tuning: accepted, ignored
        Arg("num_warps", INT, 1, op=False),
        Arg("num_stages", INT, 3, op=False),
        Arg("nk", INT, 2, op=False),
        Arg("cache_base", OPT_TENSOR, None, dtypes=INT32, mutated=True),  # advance_write_pos
        Arg("circular_replay", BOOL, False),
        Arg("prefix_gate_cache", BOOL, False),
        Arg("predecayed_k_cache", BOOL, False),
    ) + _replay_tail(False),
    returns=("out", "initial_state"),
    op_order=_REPLAY_OP_ORDER,
    schema_defaults_from="lower_bound",
)

_HELION_REPLAY = Op(
    name="helion_kda_replayssm_decode",
    public="helion_fused_recurrent_kda_replayssm_decode",
    binding="replayssm_decode",
    doc=_HELION_DOC,
    args=_replay_head() + (
        Arg("use_qk_l2norm_in_kernel", BOOL, False),
        Arg("lower_bound", OPT_FLOAT, None),
        Arg("is_kda", BOOL, True, public=False),
        # The Helion twin has the basic ring only.
        Arg("cache_base", OPT_TENSOR, None, dtypes=INT32, mutated=True, public=False),
        Arg("circular_replay", BOOL, False, public=False),
        Arg("prefix_gate_cache", BOOL, False, public=False),
        Arg("predecayed_k_cache", BOOL, False, public=False),
    ) + _replay_tail(True),
    returns=("out", "initial_state"),
    op_order=_REPLAY_OP_ORDER,
    schema_defaults_from="lower_bound",
)


# ---- chunked prefill: FLA's chunk_gated_delta_rule and chunk_kda over the pool -----------------
_CHUNK_LAYOUT = ("the chunked prefill takes states V-first only ([.., HV, V, K], the pool's "
                 "layout); pass state_v_first=True (deltastate never transposes or copies a "
                 "state behind the caller's back)")


def _workspace_bytes(q, v, kda, cu_seqlens):
    """chunk_prefill_workspace_bytes from the shapes and the device alone (fake tensors too):
    N sequences (cu_seqlens' length - 1, else q's batch) of v's HV heads over q's B * T tokens."""
    from ._lib import lib

    dev = getattr(q, "device", None)
    cuda = -1
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        cuda = dev.index if dev.index is not None else 0
    n = int(_shape(cu_seqlens)[0]) - 1 if cu_seqlens is not None else int(_shape(q)[0])
    tokens = int(_shape(q)[0]) * int(_shape(q)[1])
    return int(lib.chunk_prefill_workspace_bytes(int(_shape(q)[3]), int(_shape(v)[3]), max(n, 0),
                                                 int(_shape(v)[2]), bool(kda), cuda, tokens))


def _chunk_workspace(q, v, kda, cu_seqlens):
    """A new workspace for the call, in q's framework and device (float32 elements: the binding
    takes no uint8)."""
    return _empty(q, ((_workspace_bytes(q, v, kda, cu_seqlens) + 3) // 4,), "float32")


def _compiling(x) -> bool:
    """Whether torch.compile is tracing (then the workspace is allocated by the torch op's
    implementation, outside the trace, as the size comes from the compiled module)."""
    if not _is_torch(x):
        return False
    import torch

    return torch.compiler.is_compiling()


def _chunk_impl_gdn(q, v, cu_seqlens, workspace):
    return (_chunk_workspace(q, v, False, cu_seqlens) if workspace is None else workspace),


def _chunk_impl_kda(q, v, cu_seqlens, workspace):
    return (_chunk_workspace(q, v, True, cu_seqlens) if workspace is None else workspace),


def _as_index(x):
    """`has_initial_state` as the core takes it: a bool tensor becomes int32 (one [N] copy);
    int32/int64 pass as they are."""
    if x is None:
        return None
    dt = str(getattr(x, "dtype", ""))
    if dt in ("torch.bool", "bool"):
        if _is_torch(x):
            import torch

            return x.to(torch.int32)
        import numpy as np

        return x.astype(np.int32)
    return x


def _chunk_prepare(op, kda, q, k, v, g, beta, scale, initial_state, output_final_state,
                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                   state_v_first, transpose_state_layout, cu_seqlens, A_log, dt_bias,
                   has_initial_state, state_checkpoints, workspace):
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        _check_tensor(op, name, t)
    v_first = _fla_layout(state_v_first, transpose_state_layout)
    if not v_first and (initial_state is not None or output_final_state
                        or state_checkpoints is not None):
        raise NotImplementedError(f"{op}: state_v_first=False (FLA's K-first [N, HV, K, V] "
                                  f"state): {_CHUNK_LAYOUT}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    beta_is_logit = bool(use_beta_sigmoid_in_kernel)
    if beta is None:
        beta = _filled(v, _shape(v)[:3], 1.0)
        beta_is_logit = False
    else:
        _check_tensor(op, "beta", beta)
        if allow_neg_eigval:
            beta, beta_is_logit = _sigmoid2(beta), False
    if scale is not None and not isinstance(scale, (bool, str, bytes)):
        try:
            if float(scale) == 0.0:
                scale = None  # FlashInfer's default: K^-0.5
        except (TypeError, ValueError):
            pass  # the conversion names the argument
    if use_gate_in_kernel and A_log is None:  # FLA's texts: GDN asserts, KDA raises
        if not kda:
            raise AssertionError("A_log must be provided when use_gate_in_kernel=True.")
        if lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and "
                             "`lower_bound` is not set.")
    if not use_gate_in_kernel:
        A_log = dt_bias = lower_bound = None  # FLA ignores them without the in-kernel gate
    qs, vs = _shape(q), _shape(v)
    output = _empty(q, vs)  # FLA's chunk functions return o in q's dtype
    final = None
    if output_final_state and len(qs) == 4 and len(vs) == 4:
        n = (len(cu_seqlens) - 1) if cu_seqlens is not None else qs[0]
        final = _empty(q, (n, vs[2], vs[3], qs[3]), "float32")
    if workspace is None and len(qs) == 4 and len(vs) == 4 and not _compiling(q):
        workspace = _chunk_workspace(q, v, kda, cu_seqlens)
    return (beta, beta_is_logit, scale, A_log, dt_bias, lower_bound, _as_index(has_initial_state),
            output, final, workspace, final)


def _chunk_gdn_prepare(op, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                       transpose_state_layout, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
                       chunk_size, has_initial_state, state_checkpoints, workspace):
    qs, vs = _shape(q), _shape(v)
    if len(qs) == 4 and len(_shape(k)) == 4 and len(vs) == 4:  # FLA's head checks and texts
        if qs[2] != _shape(k)[2]:
            raise ValueError(f"q and k must have the same number of heads, but got "
                             f"q.shape[2]={qs[2]} and k.shape[2]={_shape(k)[2]}")
        if qs[2] > 0 and vs[2] % qs[2] != 0:
            raise ValueError(f"For GVA, num_v_heads (HV={vs[2]}) must be evenly divisible by "
                             f"num_heads (H={qs[2]}), but got HV % H = {vs[2] % qs[2]}")
    if chunk_size not in (16, 32, 64):  # FLA's check and text
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got "
                         f"{chunk_size}.")
    out = _chunk_prepare(op, False, q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, None,
                         state_v_first, transpose_state_layout, cu_seqlens, A_log, dt_bias,
                         has_initial_state, state_checkpoints, workspace)
    return out[:5] + out[6:]  # no lower_bound on the GDN surface


def _chunk_kda_prepare(op, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                       lower_bound, state_v_first, transpose_state_layout, cu_seqlens, A_log,
                       dt_bias, chunk_size, has_initial_state, state_checkpoints, workspace):
    if chunk_size not in (32, 64):  # FLA's check and text
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and "
                             "`use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    out = _chunk_prepare(op, True, q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                         lower_bound, state_v_first, transpose_state_layout, cu_seqlens, A_log,
                         dt_bias, has_initial_state, state_checkpoints, workspace)
    qs, vs = _shape(q), _shape(v)
    if len(qs) == 4 and len(vs) == 4:  # FLA's asserts and texts
        B, T, H, K = qs
        HV = vs[2]
        assert qs == _shape(k), (f"q and k must have the same shape, got q={q.shape} vs "
                                 f"k={k.shape}")
        assert K <= 256, f"Currently we only support key headdim <=256 for KDA, got {K}."
        assert H > 0 and HV % H == 0, (f"For GVA, num_v_heads (HV={HV}) must be evenly "
                                       f"divisible by num_qk_heads (H={H}), but got HV % H = "
                                       f"{HV % H if H else HV}")
        assert _shape(g) == (B, T, HV, K), (f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, "
                                            f"got {list(_shape(g))}")
        if beta is not None:
            assert _shape(beta) == (B, T, HV), (f"beta must have shape [B, T, HV]="
                                                f"{[B, T, HV]}, got {list(_shape(beta))}")
    return out


_CHUNK_OP_ORDER = ("q", "k", "v", "g", "beta", "output", "A_log", "dt_bias", "use_gate_in_kernel",
                   "lower_bound", "beta_is_logit", "scale", "use_qk_l2norm_in_kernel",
                   "cu_seqlens", "initial_state", "initial_state_indices", "has_initial_state",
                   "output_state_indices", "final_state", "checkpoint_every_n_tokens",
                   "checkpoint_cu_starts", "state_checkpoints", "checkpoint_slot_indices",
                   "workspace", "check_indices", "state_scales", "state_rounding",
                   "rounding_step", "rounding_seed", "rounding_layer", "pdl")

_CHUNK_DOC = """Chunked prefill ({what}), FLA's ``{fla}``: its arguments in its order and
    its defaults, returning ``(o, final_state)``; then deltastate's pool arguments (keyword-only).
    q, k [B,T,H,K]; v [B,T,HV,V]; g {g}; beta [B,T,HV]. With cu_seqlens [N+1] B = 1 and sequence
    n is tokens [cu[n], cu[n+1]). ``scale`` None or 0: K^-0.5.

    States are V-first [.., HV, V, K] only: any state (initial_state, output_final_state,
    state_checkpoints) needs ``state_v_first=True``; FLA's default K-first layout raises
    NotImplementedError naming ``state_v_first`` (never a silent transpose). With K = V
    (Qwen3-Next, Kimi-Linear) the two layouts have one shape and cannot be told apart: a state
    written K-first and passed with ``state_v_first=True`` is read transposed without an error.
    initial_state [N, HV, V, K] is read only; with ``initial_state_indices`` [N] it is the pool
    [slots, HV, V, K] (index < 0: padded sequence, zero output), whose rows are updated in place,
    or whose final states go to ``output_state_indices`` (< 0: not stored). ``has_initial_state``
    [N] (int32/int64, or bool: converted to int32, one [N] copy): 0 starts that sequence from
    zero. final_state (output_final_state): a new float32 [N, HV, V, K] array (zeros for padded
    sequences). Checkpoints every ``checkpoint_every_n_tokens`` tokens (a multiple of 64), at
    ``checkpoint_cu_starts`` [N+1], into ``state_checkpoints`` or the pool slots
    ``checkpoint_slot_indices``. ``workspace``: scratch of chunk_prefill_workspace_bytes; when
    None it is allocated in q's framework and device for the call.

    use_beta_sigmoid_in_kernel: beta holds logits; allow_neg_eigval (needs it): beta = 2 *
    sigmoid(beta). With use_gate_in_kernel g is the raw gate, -exp(A_log) * softplus(g +
    dt_bias){safe}. ``transpose_state_layout``: FLA's deprecated name of state_v_first.

    FLA's host-side hints ({hints}) are taken in FLA's positions and not needed: on CUDA
    deltastate launches one CTA per (sequence, head), N from cu_seqlens' length, and each CTA
    reads its sequence's bounds and walks its chunks on the device, so it needs neither a host
    copy of cu_seqlens nor a precomputed chunk list{graph}. ``chunk_size`` (FLA's **kwargs,
    default 64) is checked as FLA checks it ({sizes}, FLA's ValueError) and the result computed
    with 64-token chunks: every chunk size gives the same recurrence, up to rounding.
    ``cp_context`` (context parallelism) other than None raises NotImplementedError.

    Quantized pools (CPU and CUDA; docs/STATE_FORMATS.md): a float8_e4m3fn or int8 initial_state
    pool (with initial_state_indices) and the state-format keywords of
    fused_recurrent_gated_delta_rule_packed_decode (``**pool.state_format(layer)``): the initial
    states are read dequantized, the final states and the pool's checkpoint slots stored with fresh
    scales; final_state and state_checkpoints stay float."""
_CP = "(FLA's context parallelism) is not implemented in deltastate; pass None"


def _chunk(kda: bool) -> Op:
    head = (
        Arg("q", TENSOR, dtypes=FLOATING),
        Arg("k", TENSOR, dtypes=FLOATING),
        Arg("v", TENSOR, dtypes=FLOATING),
        Arg("g", TENSOR, dtypes=FLOATING),
        Arg("beta", TENSOR, dtypes=FLOATING),
        Arg("scale", OPT_FLOAT, None),
        Arg("initial_state", OPT_TENSOR, None, dtypes=STATE, mutated=True),
        Arg("output_final_state", BOOL, False, op=False),
        Arg("use_qk_l2norm_in_kernel", BOOL, False),
    )
    if kda:
        fla = (
            Arg("use_gate_in_kernel", BOOL, False),
            Arg("use_beta_sigmoid_in_kernel", BOOL, False, op=False),
            Arg("allow_neg_eigval", BOOL, False, op=False),
            Arg("safe_gate", BOOL, False, op=False),
            Arg("lower_bound", OPT_FLOAT, None),
            Arg("disable_recompute", BOOL, False, op=False),  # training only: ignored
            Arg("return_intermediate_states", BOOL, False, op=False,
                unsupported="(FLA's per-chunk states h) is not implemented in deltastate; use "
                "the checkpoints (checkpoint_every_n_tokens)"),
            Arg("state_v_first", BOOL, False, op=False),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
            Arg("cu_seqlens_cpu", ANY, None, op=False),  # a host hint: not needed
            Arg("cp_context", ANY, None, op=False, unsupported=_CP),
            Arg("use_graph", BOOL, False, op=False),  # a host hint: not needed
            Arg("max_num_seqs", OPT_INT, None, op=False),  # use_graph's bound: not needed
            # FLA takes these from **kwargs: keyword-only here.
            Arg("A_log", OPT_TENSOR, None, dtypes=FLOATING, keyword=True),
            Arg("dt_bias", OPT_TENSOR, None, dtypes=FLOATING, keyword=True),
            Arg("chunk_size", INT, 64, keyword=True, op=False),
        )
    else:
        fla = (
            Arg("use_beta_sigmoid_in_kernel", BOOL, False, op=False),
            Arg("allow_neg_eigval", BOOL, False, op=False),
            Arg("state_v_first", BOOL, False, op=False),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
            Arg("cu_seqlens_cpu", ANY, None, op=False),  # a host hint: not needed
            Arg("chunk_indices", ANY, None, op=False),  # a host hint: not needed
            Arg("cp_context", ANY, None, op=False, unsupported=_CP),
            # FLA takes these from **kwargs: keyword-only here.
            Arg("use_gate_in_kernel", BOOL, False, keyword=True),
            Arg("A_log", OPT_TENSOR, None, dtypes=FLOATING, keyword=True),
            Arg("dt_bias", OPT_TENSOR, None, dtypes=FLOATING, keyword=True),
            Arg("chunk_size", INT, 64, keyword=True, op=False),
        )
    pool = (
        Arg("transpose_state_layout", OPT_BOOL, None, keyword=True, op=False),
        Arg("initial_state_indices", OPT_TENSOR, None, dtypes=INDEX, keyword=True),
        Arg("has_initial_state", OPT_TENSOR, None, dtypes=INDEX + ("bool",), keyword=True),
        Arg("output_state_indices", OPT_TENSOR, None, dtypes=INDEX, keyword=True),
        Arg("checkpoint_every_n_tokens", INT64, 0, keyword=True),
        Arg("checkpoint_cu_starts", OPT_TENSOR, None, dtypes=INDEX, keyword=True),
        Arg("state_checkpoints", OPT_TENSOR, None, dtypes=FLOATING, mutated=True, keyword=True),
        Arg("checkpoint_slot_indices", OPT_TENSOR, None, dtypes=INDEX, keyword=True),
        Arg("workspace", OPT_TENSOR, None, mutated=True, keyword=True),
        Arg("check_indices", CHECK, None, keyword=True),
    ) + _state_format_args() + (
        Arg("pdl", BOOL, False, keyword=True),
        Arg("output", TENSOR, dtypes=FLOATING, mutated=True, public=False),
        Arg("beta_is_logit", BOOL, False, public=False),
        Arg("final_state", OPT_TENSOR, dtypes=FLOATING, mutated=True, public=False),
    )
    if kda:
        extra = ()
        fills = ("beta", "beta_is_logit", "scale", "A_log", "dt_bias", "lower_bound",
                 "has_initial_state", "output", "final_state", "workspace", "returned_state")
    else:
        extra = (Arg("lower_bound", OPT_FLOAT, None, public=False),)
        fills = ("beta", "beta_is_logit", "scale", "A_log", "dt_bias", "has_initial_state",
                 "output", "final_state", "workspace", "returned_state")
    doc = _CHUNK_DOC.format(
        what="KDA" if kda else "GDN", fla="chunk_kda" if kda else "chunk_gated_delta_rule",
        g="[B,T,HV,K] (log decay per key channel)" if kda else "[B,T,HV] (log decay)",
        safe=("; with lower_bound the safe gate lower_bound * sigmoid(exp(A_log) * (g + "
              "dt_bias)), A_log=None meaning the factor 1 there (safe_gate only checks FLA's "
              "range [-5, 0))") if kda else "",
        hints=("cu_seqlens_cpu, use_graph, max_num_seqs" if kda
               else "cu_seqlens_cpu, chunk_indices"),
        graph=(", and the launch is CUDA-graph capturable as it is (what FLA's use_graph and "
               "max_num_seqs prepare a fixed-shape chunk list for)") if kda else "",
        sizes="32 or 64" if kda else "16, 32 or 64")
    return Op(
        name="chunk_kda" if kda else "chunk_gated_delta_rule",
        public="chunk_kda" if kda else "chunk_gated_delta_rule",
        doc=doc,
        args=head + fla + pool + extra,
        returns=("output", "returned_state"),
        op_order=_CHUNK_OP_ORDER,
        schema_defaults_from="check_indices",
        prepare=_chunk_kda_prepare if kda else _chunk_gdn_prepare,
        fills=fills,
        impl_prepare=_chunk_impl_kda if kda else _chunk_impl_gdn,
        impl_fills=("workspace",),
    )

# ---- the conv update and the fused decode layer step ------------------------------------------
_CONV_DOC = """causal-conv1d's ``causal_conv1d_update`` (the package's signature and semantics):
    x [batch, dim] or [batch, dim, seqlen]; conv_state [batch, dim, state_len] (state_len >=
    width - 1; x's dtype; any strides: SGLang's and vLLM's layouts), updated in place; weight
    [dim, width] (width 2..4); bias [dim] or None; activation None, "silu" or "swish";
    cache_seqlens [batch] int32 (circular buffer) or None; conv_state_indices [batch] int32 or
    None (< 0: padded row, output zeros, window untouched). Returns the output, x's shape and
    dtype, accumulated in fp32 as causal-conv1d's CUDA kernel does.

    SGLang's speculative-verify arguments, in its order (x holds seqlen = T draft tokens per row):
    num_accept_tokens [batch] (conv_state holds width - 2 older entries and the previous step's
    drafts, state_len >= width - 2 + T; the window is entries a-1 .. a+width-3, a =
    num_accept_tokens[b]); intermediate_conv_window [N_scr, >= T, dim, width - 1] with
    intermediate_state_indices [batch] (None: row b; < 0: none): the window after each draft
    token, for update_conv_state_after_verify; retrieve_next_token, retrieve_next_sibling [batch,
    >= T] (an EAGLE tree) with retrieve_parent_token [batch, >= T], written with each token's
    parent: token t convolves its path through the tree. pad_slot_id must be -1 (every index < 0
    pads); metadata and validate_data are accepted and unused (every call is validated)."""


def _conv_prepare(op, x, activation):
    _check_tensor(op, "x", x)
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    # out like x (causal-conv1d's and SGLang's torch.empty_like(x)): a transposed [B, T, dim]
    # x gives an out whose transpose back is contiguous again, as SGLang's verify path views it
    return activation in ("silu", "swish"), _empty_like(x)


_CONV_UPDATE = Op(
    name="causal_conv1d_update",
    public="causal_conv1d_update",
    doc=_CONV_DOC,
    args=(
        Arg("x", TENSOR, dtypes=FLOATING),
        Arg("conv_state", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("weight", TENSOR, dtypes=FLOATING),
        Arg("bias", OPT_TENSOR, None, dtypes=FLOATING),
        Arg("activation", ANY, None, op=False),
        Arg("cache_seqlens", OPT_TENSOR, None, dtypes=INT32),
        Arg("conv_state_indices", OPT_TENSOR, None, dtypes=INT32),
        Arg("num_accept_tokens", OPT_TENSOR, None, dtypes=INDEX),
        Arg("intermediate_conv_window", OPT_TENSOR, None, dtypes=FLOATING, mutated=True),
        Arg("intermediate_state_indices", OPT_TENSOR, None, dtypes=INDEX),
        Arg("retrieve_next_token", OPT_TENSOR, None, dtypes=INDEX),
        Arg("retrieve_next_sibling", OPT_TENSOR, None, dtypes=INDEX),
        Arg("retrieve_parent_token", OPT_TENSOR, None, dtypes=INDEX, mutated=True),
        Arg("pad_slot_id", ANY, -1, op=False,
            unsupported="(SGLang's pad marker) must be -1: every index < 0 pads a row"),
        Arg("metadata", ANY, None, op=False),
        Arg("validate_data", ANY, False, op=False),
        Arg("check_indices", CHECK, None, keyword=True),
        Arg("pdl", BOOL, False, keyword=True),
        Arg("out", TENSOR, dtypes=FLOATING, mutated=True, public=False),
        Arg("silu", BOOL, False, public=False),
    ),
    returns="out",
    op_order=("x", "conv_state", "weight", "out", "bias", "silu", "cache_seqlens",
              "conv_state_indices", "num_accept_tokens", "intermediate_conv_window",
              "intermediate_state_indices", "retrieve_next_token", "retrieve_next_sibling",
              "retrieve_parent_token", "check_indices", "pdl"),
    prepare=_conv_prepare,
    fills=("silu", "out"),
)

_FUSED_DOC = """One decode step of a {what} layer's recurrent half in one launch: the conv update
    of the projected row (SiLU when ``conv_silu``), q/k/v split, gates and beta, the q/k L2 norm,
    the delta rule in place on ``initial_state``, and with ``norm_weight`` and ``z`` the gated
    RMSNorm of Qwen3-Next (``Qwen3NextRMSNormGated``: per value head over V, ``norm_eps``,
    weight, silu(z)). The same math as causal_conv1d_update -> {packed} -> the norm, every
    intermediate rounded where that chain stores it. Returns ``(out, initial_state)``.

    mixed_qkv [B, 2*H*K + HV*V] before the conv; conv_weight [conv_dim, width]; conv_bias
    [conv_dim] or None; conv_state [slots, conv_dim, state_len] (any strides), or the q window
    [slots, H*K, .] with conv_state_k [slots, H*K, .] and conv_state_v [slots, HV*V, .]; a{a};
    b [B, HV]; A_log [HV]; dt_bias{dt}; initial_state [slots, HV, V, K]; ssm_state_indices [B]
    (one slot for windows and state; < 0: padded row, nothing read or written, output zeros); z
    [B, HV, V]; norm_weight [V]; out [B, HV, V] (the activation dtype). ``workspace``: scratch
    of fused_decode_step_workspace_bytes on the state's device (on CUDA the batches the cluster
    kernel does not take run the conv, packed decode and norm kernels in sequence through it);
    when None and the call needs one, it is allocated in mixed_qkv's framework and device.

    ReplaySSM (keyword-only, all of d_cache, k_cache, g_cache and write_pos): initial_state is
    the checkpoint pool and the step is causal_conv1d_update -> replayssm_decode -> the norm, with
    replayssm_decode's rings d_cache [slots, HV, L, V], k_cache [slots, H, L, K], g_cache
    [slots, HV, L] (GDN) or [slots, HV, L, K] (KDA) float32, write_pos [B] int32, force_flush [B]
    int32 or None, advance_write_pos and SGLang's ring modes (cache_base, circular_replay,
    prefix_gate_cache, predecayed_k_cache; on CUDA they run that chain through ``workspace``, not
    yet run on a GPU); ssm_state_indices must then be int32
    (on CUDA the conv, replayssm_decode and norm kernels in sequence through ``workspace``; one
    launch without one, or under DELTASTATE_CUDA_FUSED=cta).

    Quantized and stochastically rounded pools (docs/STATE_FORMATS.md): the state-format
    keywords of {packed} (``state_scales``, ``state_rounding``, ``rounding_step``,
    ``rounding_seed``, ``rounding_layer``; ``**pool.state_format(layer)``); with ReplaySSM the
    checkpoint is loaded and stored (on a flush) as replayssm_decode stores it. On CUDA they run
    the chain plan (ReplaySSM: its chain) through ``workspace`` (allocated when None), the step
    counter advanced once per call."""


def _fused_workspace(mixed_qkv, initial_state, d_cache=None, state_rounding=None):
    """A new workspace for the fused step's plan, in mixed_qkv's framework and device (float32
    elements: the binding takes no uint8), or None where the plan needs none (the CPU, the
    cluster kernel's batches, ReplaySSM's one-launch kernel where it is forced). Reads the
    shapes, dtypes and device only, of d_cache only whether it is given (fake tensors too), and
    state_rounding (a quantized or stochastically rounded pool runs the chain plan on CUDA)."""
    from ._derive import _rounding
    from ._lib import lib
    from .pool import _dtype_name

    xs, ss = _shape(mixed_qkv), _shape(initial_state)
    if len(xs) != 2 or len(ss) != 4:
        return None  # the op's validator names the shape
    dev = getattr(initial_state, "device", None)
    if dev is None or getattr(dev, "type", "cpu") != "cuda":
        return None
    cuda = dev.index if dev.index is not None else 0
    nbytes = int(lib.fused_decode_step_workspace_bytes(
        int(xs[0]), int(xs[1]), int(ss[1]), int(ss[2]), int(ss[3]),
        _dtype_name(mixed_qkv.dtype), _dtype_name(initial_state.dtype, quantized_ok=True), cuda,
        d_cache is not None, _rounding(state_rounding)))
    return _empty(mixed_qkv, ((nbytes + 3) // 4,), "float32") if nbytes > 0 else None


# The query decides for ReplaySSM calls too (d_cache given): the ReplaySSM chain's bytes, 0
# where DELTASTATE_CUDA_FUSED=cta or =cluster forces the one-launch kernel.
def _fused_prepare(op, mixed_qkv, initial_state, workspace, d_cache, state_rounding=None):
    if workspace is None and not _compiling(mixed_qkv):
        workspace = _fused_workspace(mixed_qkv, initial_state, d_cache, state_rounding)
    return workspace,


def _fused_impl(mixed_qkv, initial_state, workspace, d_cache, state_rounding=None):
    if workspace is None:
        workspace = _fused_workspace(mixed_qkv, initial_state, d_cache, state_rounding)
    return workspace,


# The torch op's arguments: the public order with `pdl` last, as every op takes it.
_FUSED_OP_ORDER = ("mixed_qkv", "conv_weight", "conv_state", "a", "b", "A_log", "dt_bias",
                   "initial_state", "out", "ssm_state_indices", "conv_bias", "conv_silu", "scale",
                   "norm_weight", "z", "norm_eps", "use_qk_l2norm_in_kernel", "lower_bound",
                   "conv_state_k", "conv_state_v", "round_beta", "check_indices", "d_cache",
                   "k_cache", "g_cache", "write_pos", "force_flush", "advance_write_pos",
                   "cache_base", "circular_replay", "prefix_gate_cache", "predecayed_k_cache",
                   "workspace", "state_scales", "state_rounding", "rounding_step",
                   "rounding_seed", "rounding_layer", "pdl")


def _fused(kda: bool) -> Op:
    return Op(
        name="kda_fused_decode_step" if kda else "gdn_fused_decode_step",
        public="kda_fused_decode_step" if kda else "gdn_fused_decode_step",
        doc=_FUSED_DOC.format(
            what="KDA (Kimi-Linear)" if kda else "GDN (Qwen3-Next)",
            packed=("fused_recurrent_kda_packed_decode" if kda
                    else "fused_recurrent_gated_delta_rule_packed_decode"),
            a=" [B, HV*K]" if kda else " [B, HV]", dt=" [HV*K]" if kda else " [HV]"),
        args=(
            Arg("mixed_qkv", TENSOR, dtypes=FLOATING),
            Arg("conv_weight", TENSOR, dtypes=FLOATING),
            Arg("conv_state", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("a", TENSOR, dtypes=FLOATING),
            Arg("b", TENSOR, dtypes=FLOATING),
            Arg("A_log", TENSOR, dtypes=FLOATING),
            Arg("dt_bias", TENSOR, dtypes=FLOATING),
            Arg("initial_state", TENSOR, dtypes=STATE, mutated=True),
            Arg("out", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("ssm_state_indices", TENSOR, dtypes=INDEX),
            Arg("conv_bias", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("conv_silu", BOOL, True),
            Arg("scale", OPT_FLOAT, None),  # None: K^-0.5
            Arg("norm_weight", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("z", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("norm_eps", FLOAT, 1e-6),
            Arg("use_qk_l2norm_in_kernel", BOOL, True),
            Arg("lower_bound", OPT_FLOAT, None, public=kda),  # KDA: selects the safe gate
            Arg("conv_state_k", OPT_TENSOR, None, dtypes=FLOATING, mutated=True, keyword=True),
            Arg("conv_state_v", OPT_TENSOR, None, dtypes=FLOATING, mutated=True, keyword=True),
            Arg("round_beta", BOOL, False, keyword=True),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            # ReplaySSM: initial_state is the checkpoint pool (replayssm_decode's rings)
            Arg("d_cache", OPT_TENSOR, None, dtypes=FLOATING, mutated=True, keyword=True),
            Arg("k_cache", OPT_TENSOR, None, dtypes=FLOATING, mutated=True, keyword=True),
            Arg("g_cache", OPT_TENSOR, None, dtypes=FLOAT32, mutated=True, keyword=True),
            Arg("write_pos", OPT_TENSOR, None, dtypes=INT32, mutated=True, keyword=True),
            Arg("force_flush", OPT_TENSOR, None, dtypes=INT32, keyword=True),
            Arg("advance_write_pos", BOOL, False, keyword=True),
            # SGLang's ring modes, as replayssm_decode's (CUDA: the chain through the workspace)
            Arg("cache_base", OPT_TENSOR, None, dtypes=INT32, mutated=True, keyword=True),
            Arg("circular_replay", BOOL, False, keyword=True),
            Arg("prefix_gate_cache", BOOL, False, keyword=True),
            Arg("predecayed_k_cache", BOOL, False, keyword=True),
        ) + _state_format_args() + (
            Arg("workspace", OPT_TENSOR, None, mutated=True, keyword=True),
        ),
        returns=("out", "initial_state"),
        op_order=_FUSED_OP_ORDER,
        prepare=_fused_prepare,
        fills=("workspace",),
        impl_prepare=_fused_impl,
        impl_fills=("workspace",),
    )


# ---- speculative verify and its commit ----------------------------------------------------------
# The binding's arguments (python/src/module.cpp `verify`), in its order.
_VERIFY_OP_ORDER = ("q", "k", "v", "g", "beta", "output", "is_kda", "A_log", "dt_bias",
                    "use_gate_in_kernel", "lower_bound", "beta_is_logit", "round_beta", "scale",
                    "use_qk_l2norm_in_kernel", "cu_seqlens", "state", "state_indices",
                    "output_state_indices", "update_state", "intermediate_states",
                    "intermediate_state_indices", "parent_tokens", "token_state_indices",
                    "num_accepted_tokens", "source_state", "source_state_indices",
                    "ring_v", "ring_k", "ring_g", "ring_beta", "keep_padded_outputs", "check_indices",
                    "state_scales", "state_rounding", "rounding_step",
                    "rounding_seed", "rounding_layer", "intermediate_state_scales", "pdl")
_KEYWORDS = (Arg("round_beta", BOOL, False, keyword=True),
             Arg("check_indices", CHECK, None, keyword=True),
             Arg("pdl", BOOL, False, keyword=True))

_VERIFY_DOC = """Speculative verify (deltastate's own surface of the op behind SGLang's, FlashInfer's
    and vLLM's verify functions): T draft tokens per sequence through the recurrent math, every
    token's state kept for a later commit. q, k [B,T,H,K] (or [1,T_total,H,K] with cu_seqlens
    [N+1]); v, output [B,T,HV,V]; g [B,T,HV] (GDN) or [B,T,HV,K] (KDA): the raw gate input with
    use_gate_in_kernel (A_log, dt_bias), else the log decay; beta [B,T,HV] (a logit with
    beta_is_logit). state: the pool [slots, HV, V, K] (any slot stride); state_indices [N] the
    slots the sequences start from (< 0: padded: output zero, nothing read or written); the final
    state is stored (update_state) at output_state_indices [N] (< 0: not stored) or in place.
    intermediate_states [N_scr, T_alloc, HV, V, K] receives the state after token t at row
    intermediate_state_indices[n] (absent: row n), step t; parent_tokens [N, >= T] makes the
    sequence an EAGLE tree (token t starts from the state after its parent; < 0: the initial
    state). token_state_indices [N, >= T] stores the state after token t in pool slot [n, t] (the
    final write-back is then skipped); with num_accepted_tokens [N] the start slot is
    token_state_indices[n, num_accepted[n] - 1] (vLLM). source_state [N0, HV, V, K] (state's
    dtype, or any float dtype for a quantized or stochastically rounded pool; any slot stride;
    FlashInfer's initial_state_source) with source_state_indices [N]: a
    read-only pool the start states come from instead, sequence n from row
    source_state_indices[n] (< 0: padded; not with num_accepted_tokens); the pool is then only
    written (per-token slots, output_state_indices, else in place at state_indices, absent:
    slot n). Returns ``output``.

    A quantized pool ``state`` (docs/STATE_FORMATS.md) with the state-format keywords
    (``**pool.state_format(layer)``): the start states read dequantized, per-token slots and final
    states stored with fresh scales; intermediate_states is then a float scratch of the caller's
    dtype, or a quantized one (float8_e4m3fn / int8) with its fp32 ``intermediate_state_scales``
    [N_scr, T_alloc, HV, V]: each entry stored as the pool stores a slot (fresh row scales, the
    pool's rounding), a tree token's parent reloaded dequantized. source_state with such a pool
    is the caller's float pool (float32, bfloat16 or float16, read as it is); the states written
    go to ``state`` through its format."""


# Every argument of the verify binding, as the public functions take them; `_hidden` makes the
# op-only ones of a peer's surface from it (filled by the entry's prepare step or defaulted).
_VERIFY_ARGS = {a.name: a for a in (
    Arg("q", TENSOR, dtypes=FLOATING),
    Arg("k", TENSOR, dtypes=FLOATING),
    Arg("v", TENSOR, dtypes=FLOATING),
    Arg("g", TENSOR, dtypes=FLOATING),
    Arg("beta", TENSOR, dtypes=FLOATING),
    Arg("output", TENSOR, dtypes=FLOATING, mutated=True),
    Arg("state", TENSOR, dtypes=STATE, mutated=True),
    Arg("state_indices", OPT_TENSOR, None, dtypes=INDEX),
    Arg("A_log", OPT_TENSOR, None, dtypes=FLOATING),
    Arg("dt_bias", OPT_TENSOR, None, dtypes=FLOATING),
    Arg("scale", OPT_FLOAT, None),
    Arg("is_kda", BOOL, False),
    Arg("use_gate_in_kernel", BOOL, True),
    Arg("lower_bound", OPT_FLOAT, None),
    Arg("beta_is_logit", BOOL, True),
    Arg("use_qk_l2norm_in_kernel", BOOL, True),
    Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
    Arg("update_state", BOOL, True),
    Arg("output_state_indices", OPT_TENSOR, None, dtypes=INDEX),
    Arg("intermediate_states", OPT_TENSOR, None, dtypes=STATE, mutated=True),
    Arg("intermediate_state_indices", OPT_TENSOR, None, dtypes=INDEX),
    Arg("parent_tokens", OPT_TENSOR, None, dtypes=INDEX),
    Arg("token_state_indices", OPT_TENSOR, None, dtypes=INDEX),
    Arg("num_accepted_tokens", OPT_TENSOR, None, dtypes=INDEX),
    Arg("source_state", OPT_TENSOR, None, dtypes=FLOATING),
    Arg("source_state_indices", OPT_TENSOR, None, dtypes=INDEX),
    Arg("ring_v", OPT_TENSOR, None, dtypes=FLOATING, mutated=True),
    Arg("ring_k", OPT_TENSOR, None, dtypes=FLOATING, mutated=True),
    Arg("ring_g", OPT_TENSOR, None, dtypes=FLOAT32, mutated=True),
    Arg("ring_beta", OPT_TENSOR, None, dtypes=FLOAT32, mutated=True),
    Arg("keep_padded_outputs", BOOL, False, keyword=True),
) + _state_format_args() + (_scratch_scales_arg(mutated=True),)}


def _hidden(public_op_args, shown_as=(), **defaults) -> Tuple[Arg, ...]:
    """The verify binding's arguments a peer's surface does not take itself, op-only: each with
    the public argument it comes from (`shown_as`, in errors) and its default (`defaults`)."""
    shown = dict(shown_as)
    return tuple(dataclasses.replace(a, public=False, shown_as=shown.get(a.name),
                                     default=defaults.get(a.name, a.default))
                 for a in _VERIFY_ARGS.values() if a.name not in public_op_args)


def _verify_core() -> Op:
    return Op(
        name="verify",
        public="verify",
        doc=_VERIFY_DOC,
        args=tuple(_VERIFY_ARGS.values()) + _KEYWORDS,
        returns="output",
        op_order=_VERIFY_OP_ORDER,
        schema_defaults_from="state_indices",
    )


def _gate_view(x, B, T, kda, K, name):
    """SGLang's `a` / `b` as the core's [B, T, HV(, K)]: 2-D [B*T, ...] or 3-D [B, T, ...] rows
    (KDA's a [.., HV*K] split into [HV, K]); a reshape, a view of every contiguous input."""
    shape = _shape(x)
    width = shape[-1] if shape else 0
    if kda and name == "a":
        if len(shape) == 4:
            return x
        return x.reshape(B, T, width // K, K)
    return x.reshape(B, T, width)


def _sglang_verify_prepare(op, a, softplus_beta, softplus_threshold, q, k, v, b,
                           initial_state_source, initial_state_indices, scale, cu_seqlens, is_kda,
                           disable_state_update, intermediate_states_buffer, cache_steps,
                           retrieve_parent_token, cache_ring, replayssm_rawv, replayssm_rawk,
                           replayssm_g, replayssm_beta):
    """SGLang's fused_sigmoid_gating_delta_rule_update onto the verify op: the gate inputs as
    [B, T, ...] views, a new output o (q's dtype, v's shape), the scratch buffer viewed as
    [N_scr, cache_steps, HV, V, K], no initial state: zeros, nothing stored."""
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        _check_tensor(op, name, t)
    if float(softplus_beta) != 1.0 or float(softplus_threshold) != 20.0:
        raise NotImplementedError(
            f"{op}: softplus_beta={softplus_beta}, softplus_threshold={softplus_threshold}: only "
            "the gate's softplus with beta 1 and threshold 20 (what SGLang passes) is implemented")
    if scale is not None and not float(scale) > 0:
        raise AssertionError("scale must be positive")
    qs, vs = _shape(q), _shape(v)
    B, T, K = (qs[0], qs[1], qs[3]) if len(qs) == 4 else (0, 0, 1)
    g = _gate_view(a, B, T, is_kda, K, "a")
    beta = _gate_view(b, B, T, False, K, "b")
    output = _empty(q, vs)
    state, indices, update = initial_state_source, initial_state_indices, not disable_state_update
    if state is None and len(vs) == 4:  # no initial state: every sequence from zeros, none stored
        n = len(cu_seqlens) - 1 if cu_seqlens is not None else B
        state = _zeros_state(q, (max(n, 1), vs[2], vs[3], K))
        indices, update = None, False
    inter = intermediate_states_buffer
    if inter is not None and len(_shape(inter)) != 5:  # a flat [N_scr * cache_steps, HV, V, K]
        # SGLang's per-request pitch is the buffer's allocated steps (shape[1]) when it has that
        # dim; a flat buffer is cut into rows of cache_steps.
        inter = inter.reshape(-1, int(cache_steps or 1), *_shape(inter)[-3:])
    rings = (None, None, None, None)
    if cache_ring:  # the gate ring: per K column for KDA, a scalar per head for GDN
        assert (len(_shape(replayssm_rawv)) == 4 and len(_shape(replayssm_rawk)) == 4
                and len(_shape(replayssm_g)) == (4 if is_kda else 3)
                and len(_shape(replayssm_beta)) == 3), "cache_ring expects per-layer ring views"
        rings = (replayssm_rawv, replayssm_rawk, replayssm_g, replayssm_beta)
    return (g, beta, output, state, indices, update, inter, retrieve_parent_token) + rings


def _sglang_verify() -> Op:
    doc = """SGLang's ``fused_sigmoid_gating_delta_rule_update`` (decode, varlen and target
    verify, GDN and KDA) on the verify op. Returns a new ``o`` [B, T, HV, V] (q's dtype); the
    pool ``initial_state_source`` is updated in place unless disable_state_update;
    intermediate_states_buffer [N_scr, T_alloc, HV, V, K] receives the state after each token at
    row intermediate_state_indices[n] (< 0: none), step t (the row pitch is T_alloc, as SGLang's;
    cache_steps only cuts a flat [N_scr * cache_steps, HV, V, K] buffer); retrieve_parent_token
    [N, T] makes
    each sequence an EAGLE tree. Differences: a sequence whose index is < 0 gets a zero output
    (SGLang computes one from a zero state); a parent < 0 at t > 0 starts from the initial state;
    softplus_beta / softplus_threshold other than 1 / 20 raise NotImplementedError.
    lower_bound: the safe gate lower_bound * sigmoid(exp(A_log) * (a + dt_bias)) in place of
    -exp(A_log) * softplus(a + dt_bias), GDN or KDA, as SGLang's.
    cache_ring (fold-every-commit): each sequence's steps t < L also record their raw v, raw
    (pre-norm) k, fp32 g and fp32 beta at its slot of the per-layer rings replayssm_rawv [S, HV,
    L, V], replayssm_rawk [S, H, L, K], replayssm_g [S, HV, L] (KDA: [S, HV, L, K]),
    replayssm_beta [S, HV, L] (:func:`commit_gdn_replayssm_fold_all_layers`,
    :func:`commit_kda_replayssm_spec` replay them; CUDA: the generic kernel)."""
    return Op(
        name="sglang_verify",
        public="fused_sigmoid_gating_delta_rule_update",
        binding="verify",
        doc=doc,
        args=(
            Arg("A_log", OPT_TENSOR, dtypes=FLOATING),
            Arg("a", ANY, op=False),
            Arg("dt_bias", OPT_TENSOR, dtypes=FLOATING),
            Arg("softplus_beta", ANY, op=False),
            Arg("softplus_threshold", ANY, op=False),
            Arg("q", TENSOR, dtypes=FLOATING),
            Arg("k", TENSOR, dtypes=FLOATING),
            Arg("v", TENSOR, dtypes=FLOATING),
            Arg("b", ANY, op=False),
            Arg("initial_state_source", ANY, op=False),
            Arg("initial_state_indices", ANY, op=False),
            Arg("scale", OPT_FLOAT, None),
            Arg("use_qk_l2norm_in_kernel", BOOL, False),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
            Arg("is_kda", BOOL, False),
            Arg("lower_bound", OPT_FLOAT, None),
            Arg("disable_state_update", BOOL, False, op=False),
            Arg("intermediate_states_buffer", ANY, None, op=False),
            Arg("intermediate_state_indices", OPT_TENSOR, None, dtypes=INDEX),
            Arg("cache_steps", ANY, None, op=False),
            Arg("retrieve_parent_token", ANY, None, op=False),
            Arg("cache_ring", BOOL, False, op=False),
            Arg("replayssm_rawv", ANY, None, op=False),
            Arg("replayssm_rawk", ANY, None, op=False),
            Arg("replayssm_g", ANY, None, op=False),
            Arg("replayssm_beta", ANY, None, op=False),
        ) + _KEYWORDS + _hidden(
            ("A_log", "dt_bias", "q", "k", "v", "scale", "use_qk_l2norm_in_kernel", "cu_seqlens",
             "is_kda", "lower_bound", "intermediate_state_indices"),
            shown_as=(("g", "a"), ("beta", "b"), ("state", "initial_state_source"),
                      ("state_indices", "initial_state_indices"),
                      ("intermediate_states", "intermediate_states_buffer"),
                      ("parent_tokens", "retrieve_parent_token"), ("ring_v", "replayssm_rawv"),
                      ("ring_k", "replayssm_rawk"), ("ring_g", "replayssm_g"),
                      ("ring_beta", "replayssm_beta"))),
        returns="output",
        op_order=_VERIFY_OP_ORDER,
        schema_defaults_from="state_indices",
        prepare=_sglang_verify_prepare,
        fills=("g", "beta", "output", "state", "state_indices", "update_state",
               "intermediate_states", "parent_tokens", "ring_v", "ring_k", "ring_g", "ring_beta"),
    )


def _flashinfer_mtp_prepare(op, q, v, initial_state, initial_state_indices, a, b, output,
                            intermediate_states_buffer, ssm_state_indices, disable_state_update,
                            use_qk_l2norm):
    """FlashInfer's gated_delta_rule_mtp onto the verify op: its asserts on the speculative
    arguments, the deprecated default of disable_state_update (True, with a warning), the output
    allocated as zeros in q's dtype when not given."""
    qs = _shape(q)
    B, T = (qs[0], qs[1]) if len(qs) == 4 else (0, 0)
    if disable_state_update is None:
        warnings.warn(
            "gated_delta_rule_mtp(): the 'disable_state_update' parameter currently defaults to "
            "True, but this default will change to False in FlashInfer 0.7.0. Please pass "
            "disable_state_update=True or disable_state_update=False explicitly to suppress this "
            "warning.", stacklevel=3)
        disable_state_update = True
    if intermediate_states_buffer is not None:
        shape = _shape(intermediate_states_buffer)
        assert shape[0] >= B, (
            f"intermediate_states_buffer first dim ({shape[0]}) must be at least B={B}: the "
            f"kernel indexes it by batch (i_n in [0, B)), so a smaller buffer causes "
            f"out-of-bounds writes.")
        assert shape[1] >= T, (
            f"intermediate_states_buffer second dimension (cache_steps={shape[1]}) must be at "
            f"least T={T} to prevent out-of-bounds indexing")
    if ssm_state_indices is not None:
        assert intermediate_states_buffer is None, (
            "ssm_state_indices and intermediate_states_buffer are mutually exclusive")
        assert not disable_state_update, (
            "ssm_state_indices requires state writes; disable_state_update must be False")
        assert T >= 2, f"ssm_state_indices requires T >= 2 (got T={T})"
        assert tuple(_shape(ssm_state_indices)) == (B, T), (
            f"ssm_state_indices must have shape [B={B}, T={T}], got "
            f"{tuple(_shape(ssm_state_indices))}")
    if output is None:
        output = _empty(q, _shape(v))
        output[...] = 0
    return (a, b, output, initial_state, initial_state_indices, not disable_state_update,
            intermediate_states_buffer, ssm_state_indices, bool(use_qk_l2norm))


def _flashinfer_mtp() -> Op:
    doc = """FlashInfer's ``gated_delta_rule_mtp`` (multi-token verify, GDN) on the verify op:
    q, k [B,T,H,K], v [B,T,HV,V], a, b [B,T,HV]; the pool initial_state [pool, HV, V, K] read at
    initial_state_indices [B] (< 0: padded: its output rows are not written, as FlashInfer's;
    zeros when the output is allocated here). intermediate_states_buffer [>= B, >= T,
    HV, V, K] receives the state after token t at [b, t]; ssm_state_indices [B, T] stores it in
    pool slot [b, t] instead (no final write-back); output_state_indices [B] sends the final
    state elsewhere (< 0: not stored). Returns ``(output, initial_state)``. Looser than FlashInfer:
    any float dtypes and K, V (FlashInfer: fp16/bf16 inputs, fp32 state and buffer, K, V >= 128)."""
    return Op(
        name="flashinfer_mtp",
        public="gated_delta_rule_mtp",
        binding="verify",
        doc=doc,
        args=(
            Arg("q", TENSOR, dtypes=FLOATING),
            Arg("k", TENSOR, dtypes=FLOATING),
            Arg("v", TENSOR, dtypes=FLOATING),
            Arg("initial_state", ANY, op=False),
            Arg("initial_state_indices", ANY, op=False),
            Arg("A_log", OPT_TENSOR, dtypes=FLOATING),
            Arg("a", ANY, op=False),
            Arg("dt_bias", OPT_TENSOR, dtypes=FLOATING),
            Arg("b", ANY, op=False),
            Arg("scale", OPT_FLOAT, None),
            Arg("output", TENSOR, None, dtypes=FLOATING, mutated=True),
            Arg("intermediate_states_buffer", ANY, None, op=False),
            Arg("ssm_state_indices", ANY, None, op=False),
            Arg("disable_state_update", OPT_BOOL, None, op=False),
            Arg("use_qk_l2norm", BOOL, True, op=False),
            Arg("output_state_indices", OPT_TENSOR, None, dtypes=INDEX),
        ) + _KEYWORDS + _hidden(
            ("q", "k", "v", "A_log", "dt_bias", "scale", "output", "output_state_indices"),
            shown_as=(("g", "a"), ("beta", "b"), ("state", "initial_state"),
                      ("state_indices", "initial_state_indices"),
                      ("intermediate_states", "intermediate_states_buffer"),
                      ("token_state_indices", "ssm_state_indices")),
            keep_padded_outputs=True),  # FlashInfer leaves a padded row's output as given
        returns=("output", "state"),
        op_order=_VERIFY_OP_ORDER,
        schema_defaults_from="state_indices",
        prepare=_flashinfer_mtp_prepare,
        fills=("g", "beta", "output", "state", "state_indices", "update_state",
               "intermediate_states", "token_state_indices", "use_qk_l2norm_in_kernel"),
    )


_COMMIT_OP_ORDER = ("state", "intermediate_states", "state_indices", "accepted",
                    "intermediate_state_indices", "accepted_is_step", "check_indices", "pdl")
_FORMAT_NAMES = ("state_scales", "state_rounding", "rounding_step", "rounding_seed",
                 "rounding_layer", "intermediate_state_scales")
# The state commit's binding: the format's arguments before pdl.
_STATE_COMMIT_OP_ORDER = _COMMIT_OP_ORDER[:-1] + _FORMAT_NAMES + ("pdl",)


def _commit_op(name: str, pool: str, scratch: str, doc: str,
               extra: Tuple["Arg", ...] = ()) -> Op:
    """The plain commit op over `pool` [layers?, slots, ...] from `scratch` [layers?, N_scr,
    T_alloc, ...]: the states' and the conv windows' share every argument but those two."""
    return Op(
        name=name,
        public=name,
        doc=doc,
        args=(
            Arg(pool, TENSOR, dtypes=STATE if extra else FLOATING, mutated=True),
            Arg(scratch, TENSOR, dtypes=STATE if extra else FLOATING),
            Arg("state_indices", TENSOR, dtypes=INDEX),
            Arg("accepted", TENSOR, dtypes=INDEX),
            Arg("intermediate_state_indices", OPT_TENSOR, None, dtypes=INDEX),
            Arg("accepted_is_step", BOOL, False),
            Arg("check_indices", CHECK, None, keyword=True),
        ) + extra + (
            Arg("pdl", BOOL, False, keyword=True),
        ),
        returns=pool,
        op_order=(pool, scratch) + (_STATE_COMMIT_OP_ORDER if extra else _COMMIT_OP_ORDER)[2:],
    )


_COMMIT_DOC = """The commit after a verify: for each request b with accepted[b] = a > 0, copies
    intermediate_states[:, row_b, a - 1] into state[:, state_indices[b]] (every layer, one
    launch); row_b = intermediate_state_indices[b] (absent: b). state [layers, slots, HV, V, K]
    or [slots, HV, V, K] (any layer and slot strides); intermediate_states [layers, N_scr,
    T_alloc, HV, V, K] or [N_scr, T_alloc, HV, V, K] of state's dtype. Index < 0: skipped. With
    accepted_is_step, accepted holds the last accepted step (a - 1; < 0: none). Returns ``state``.

    A quantized state (docs/STATE_FORMATS.md) takes a float intermediate_states (any float
    dtype) and the state-format keywords with its scales [layers, slots, HV, V] (or [slots, HV,
    V]) and, for stochastic rounding, one step counter per layer (``**pool.state_format()``: every
    layer's): each accepted state is requantized into its slot with fresh scales. A quantized
    intermediate_states (verify's quantized scratch) comes with its fp32
    ``intermediate_state_scales`` [layers, N_scr, T_alloc, HV, V]: of the state's dtype, each
    accepted entry's codes and scales are copied; of the other, it is dequantized and
    requantized."""


def _commit() -> Op:
    return _commit_op("update_state_after_verify", "state", "intermediate_states", _COMMIT_DOC,
                      _state_format_args() + (_scratch_scales_arg(mutated=False),))


def _scatter_indices(dst_indices_raw, step_indices_raw):
    """SGLang's checks of the scatters' index vectors, with its texts."""
    di, si = _shape(dst_indices_raw), _shape(step_indices_raw)
    if len(di) != 1 or len(si) != 1:
        raise ValueError(f"indices must be 1D: dst_indices_raw.shape={di} "
                         f"step_indices_raw.shape={si}")
    if di[0] != si[0]:
        raise ValueError(f"indices length mismatch: dst_indices_raw.shape[0]={di[0]} vs "
                         f"step_indices_raw.shape[0]={si[0]}")


def _scatter_prepare(op, dst, src, dst_indices_raw, step_indices_raw):
    """SGLang's checks of fused_mamba_state_scatter_with_mask, with its texts."""
    ds_, ss_ = _shape(dst), _shape(src)
    if len(ds_) < 2 or len(ss_) < 3:
        raise ValueError(f"Unexpected tensor ranks: dst.ndim={len(ds_)} src.ndim={len(ss_)}")
    if ds_[0] != ss_[0]:
        raise ValueError(f"Layer dimension mismatch: dst.shape[0]={ds_[0]} vs "
                         f"src.shape[0]={ss_[0]}")
    if tuple(ds_[2:]) != tuple(ss_[3:]):
        raise ValueError(f"Trailing dims mismatch: dst.shape[2:]={tuple(ds_[2:])} vs "
                         f"src.shape[3:]={tuple(ss_[3:])}")
    _scatter_indices(dst_indices_raw, step_indices_raw)
    return dst, src, dst_indices_raw, step_indices_raw


def _scatter_route(op, dst, src, dst_indices_raw, step_indices_raw, check_indices, pdl):
    """SGLang's scatter copies each entry's trailing dims whatever their rank; the state commit
    takes [layers, slots, HV, V, K] states. Conv windows (a 4-D dst [layers, slots, dim, W1]) and
    flat entries (a 3-D dst [layers, slots, E], viewed as windows of one row) go to the conv
    commit, SGLang's fused_conv_window_scatter_with_mask."""
    nd, ns = len(_shape(dst)), len(_shape(src))
    if (nd, ns) == (4, 5):
        views = (dst, src)
    elif (nd, ns) == (3, 4):
        views = (dst[:, :, None], src[:, :, :, None])
    else:
        return None
    return (views + (dst_indices_raw, step_indices_raw),
            {"check_indices": check_indices, "pdl": pdl})


def _sglang_scatter() -> Op:
    doc = """SGLang's ``fused_mamba_state_scatter_with_mask`` (the commit behind its
    update_mamba_state_after_mtp_verify) on the commit ops: for each request i with
    step_indices_raw[i] >= 0, dst[:, dst_indices_raw[i]] = src[:, i, step_indices_raw[i]]. dst
    [num_layers, cache_size, HV, V, K], src [num_layers, spec_size, draft_tokens, HV, V, K]: the
    state commit; dst [num_layers, cache_size, dim, W1] (conv windows) or [num_layers,
    cache_size, E], src [num_layers, spec_size, draft_tokens, <dst's trailing dims>]: the conv
    commit (:func:`fused_conv_window_scatter_with_mask`, any strides). Returns None. Differences:
    strided (envelope) dst and src are taken (SGLang: contiguous only), CPU tensors too; an
    out-of-range index is an error (CPU) or a recorded, skipped row (CUDA, check_errors) where
    SGLang skips it silently."""
    return Op(
        name="sglang_state_scatter",
        public="fused_mamba_state_scatter_with_mask",
        binding="update_state_after_verify",
        doc=doc,
        args=(
            Arg("dst", TENSOR, dtypes=FLOATING, mutated=True, op=False),
            Arg("src", TENSOR, dtypes=FLOATING, op=False),
            Arg("dst_indices_raw", TENSOR, dtypes=INDEX, op=False),
            Arg("step_indices_raw", TENSOR, dtypes=INDEX, op=False),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            Arg("state", TENSOR, dtypes=FLOATING, mutated=True, public=False, shown_as="dst"),
            Arg("intermediate_states", TENSOR, dtypes=FLOATING, public=False, shown_as="src"),
            Arg("state_indices", TENSOR, dtypes=INDEX, public=False, shown_as="dst_indices_raw"),
            Arg("accepted", TENSOR, dtypes=INDEX, public=False, shown_as="step_indices_raw"),
            Arg("intermediate_state_indices", OPT_TENSOR, None, public=False),
            Arg("accepted_is_step", BOOL, True, public=False),
        ) + tuple(dataclasses.replace(a, public=False, keyword=False)
                  for a in _state_format_args() + (_scratch_scales_arg(mutated=False),)),
        returns=(),
        op_order=_STATE_COMMIT_OP_ORDER,
        schema_defaults_from="intermediate_state_indices",
        prepare=_scatter_prepare,
        fills=("state", "intermediate_states", "state_indices", "accepted"),
        route=_scatter_route,
        route_to="fused_conv_window_scatter_with_mask",
    )


# The conv windows' commit: the binding's arguments (python/src/module.cpp
# `update_conv_state_after_verify`), in its order.
_CONV_COMMIT_OP_ORDER = ("conv_state", "intermediate_conv_window") + _COMMIT_OP_ORDER[2:]


_CONV_COMMIT_DOC = """The commit of the conv windows after a verify, the windows' twin of
    :func:`update_state_after_verify` with its index conventions: for each request b with
    accepted[b] = a > 0, copies intermediate_conv_window[:, row_b, a - 1] into
    conv_state[:, state_indices[b]] (every layer, one launch); row_b =
    intermediate_state_indices[b] (absent: b). conv_state [layers, slots, dim, W1] or [slots,
    dim, W1], any strides (window- or dim-contiguous windows, envelope slots);
    intermediate_conv_window [layers, N_scr, T_alloc, dim, W1] or [N_scr, T_alloc, dim, W1] of
    conv_state's dtype, any strides (SGLang's overlapping, deduplicated view too: it is only
    read). Index < 0: skipped. With accepted_is_step, accepted holds the last accepted step
    (a - 1; < 0: none). Returns ``conv_state``."""


def _conv_commit() -> Op:
    return _commit_op("update_conv_state_after_verify", "conv_state", "intermediate_conv_window",
                      _CONV_COMMIT_DOC)


def _conv_scatter_prepare(op, dst, src, dst_indices_raw, step_indices_raw):
    """SGLang's checks of fused_conv_window_scatter_with_mask, with its texts."""
    ds_, ss_ = _shape(dst), _shape(src)
    if len(ds_) != 4 or len(ss_) != 5:
        raise ValueError(f"Unexpected ranks: dst.ndim={len(ds_)} (want 4) "
                         f"src.ndim={len(ss_)} (want 5)")
    if ds_[0] != ss_[0]:
        raise ValueError(f"Layer dim mismatch: dst.shape[0]={ds_[0]} vs src.shape[0]={ss_[0]}")
    if tuple(ds_[2:]) != tuple(ss_[3:]):
        raise ValueError(f"Window dims mismatch: dst.shape[2:]={tuple(ds_[2:])} vs "
                         f"src.shape[3:]={tuple(ss_[3:])}")
    _scatter_indices(dst_indices_raw, step_indices_raw)
    return dst, src, dst_indices_raw, step_indices_raw


def _sglang_conv_scatter() -> Op:
    doc = """SGLang's ``fused_conv_window_scatter_with_mask`` (the conv windows' commit after a
    verify, for its deduplicated sliding-window scratch) on :func:`update_conv_state_after_verify`:
    for each request i with step_indices_raw[i] >= 0, dst[:, dst_indices_raw[i]] = src[:, i,
    step_indices_raw[i]]. dst: the conv windows [num_layers, cache_size, dim, W1]; src [num_layers,
    spec_size, draft_tokens, dim, W1], read through its strides (the overlapping as_strided view
    over one [dim, draft_tokens + W1 - 1] buffer per request, or a dense scratch). Returns None.
    Differences: dst with any strides is taken (SGLang: contiguous windows), CPU tensors too; an
    out-of-range index is an error (CPU) or a recorded, skipped row (CUDA, check_errors) where
    SGLang skips it silently."""
    return Op(
        name="sglang_conv_window_scatter",
        public="fused_conv_window_scatter_with_mask",
        binding="update_conv_state_after_verify",
        doc=doc,
        args=(
            Arg("dst", TENSOR, dtypes=FLOATING, mutated=True, op=False),
            Arg("src", TENSOR, dtypes=FLOATING, op=False),
            Arg("dst_indices_raw", TENSOR, dtypes=INDEX, op=False),
            Arg("step_indices_raw", TENSOR, dtypes=INDEX, op=False),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            Arg("conv_state", TENSOR, dtypes=FLOATING, mutated=True, public=False,
                shown_as="dst"),
            Arg("intermediate_conv_window", TENSOR, dtypes=FLOATING, public=False,
                shown_as="src"),
            Arg("state_indices", TENSOR, dtypes=INDEX, public=False, shown_as="dst_indices_raw"),
            Arg("accepted", TENSOR, dtypes=INDEX, public=False, shown_as="step_indices_raw"),
            Arg("intermediate_state_indices", OPT_TENSOR, None, public=False),
            Arg("accepted_is_step", BOOL, True, public=False),
        ),
        returns=(),
        op_order=_CONV_COMMIT_OP_ORDER,
        schema_defaults_from="intermediate_state_indices",
        prepare=_conv_scatter_prepare,
        fills=("conv_state", "intermediate_conv_window", "state_indices", "accepted"),
    )


# ---- ReplaySSM speculative verify and its cursor commit ----------------------------------------
# The binding's arguments (python/src/module.cpp `replayssm_verify`), in its order.
_REPLAY_VERIFY_OP_ORDER = ("q", "k", "v", "g", "beta", "output", "A_log", "dt_bias",
                           "checkpoint_state", "state_indices", "d_cache", "k_cache", "g_cache",
                           "write_pos", "cache_base", "is_flush", "replay_indices", "rawv_cache",
                           "rawk_cache", "beta_cache", "rows", "is_kda", "use_gate_in_kernel",
                           "lower_bound", "beta_is_logit", "round_beta", "scale",
                           "use_qk_l2norm_in_kernel", "cu_seqlens", "null_block_id",
                           "check_indices", "state_scales", "state_rounding", "rounding_step",
                           "rounding_seed", "rounding_layer", "pdl")

_REPLAY_VERIFY_DOC = """ReplaySSM speculative verify (linear chains): the draft tokens of each
    sequence verified from the checkpoint and the ring alone, no state written. q, k [B,T,H,K]
    (or [1,T_total,H,K] with cu_seqlens [N+1]); v, output [B,T,HV,V]; g [B,T,HV] (GDN) or
    [B,T,HV,K] (KDA): the raw gate input with use_gate_in_kernel (A_log, dt_bias), else the log
    decay; beta [B,T,HV]. checkpoint_state [slots, HV, V, K] (any slot stride); state_indices [N]
    (<= null_block_id: padded, output zero); rings d_cache [slots, HV, L, V], k_cache [slots, H,
    L, K], g_cache [slots, HV, L(, K)] float32, circular from cache_base; write_pos, cache_base
    [slots] int32, is_flush [slots] int32 or int8, keyed by slot (or by replay_indices [N], the
    ring and cursor row of each sequence, when given). The state after the write_pos[s]
    committed records is rebuilt by replaying them in the recurrent op's order, the drafts run
    from it (their records appended at write_pos + t; records past the ring are dropped), and
    with is_flush[s] != 0 the rebuilt state is first folded into the checkpoint. With float32
    rings the outputs and the folded checkpoint equal the recurrent op over the same tokens bit
    for bit. rawv_cache [R, HV, L, V], rawk_cache [R, H, L, K], beta_cache [R, HV, L] float32
    (CPU): the exact-raw ring (each draft's raw v, raw k and beta recorded too, a fold replays
    them through the recurrent step: the folded checkpoint is exact whatever the d/k rings'
    dtype); rawv and rawk without beta_cache: the hi/lo residual ring (what d_cache's and
    k_cache's dtypes round off d and the normalized k). rows: 0 every sequence, 1 those not
    folding, 2 the folding ones only (SGLang's launch_mode 'both', 'verify', 'flush'). Move the
    cursors with :func:`replayssm_commit`. CUDA tensors: a bad slot or cursor is skipped, its
    outputs NaN, and recorded for check_errors. A checkpoint pool in its storage format
    (float8_e4m3fn / int8 with ``state_scales``, or a stochastically rounded 16-bit one; the
    keywords of StatePool.state_format(layer)): its rows are loaded dequantized, and a fold
    stores them with fresh row scales (stochastic bits keyed by the slot) and the drafts run
    from the checkpoint as stored; the step counter advances once per call with rows 0 or 2.
    Returns ``output``."""


def _replay_verify_core() -> Op:
    return Op(
        name="replayssm_verify",
        public="replayssm_verify",
        doc=_REPLAY_VERIFY_DOC,
        args=tuple(_VERIFY_ARGS[n] for n in ("q", "k", "v", "g", "beta", "output")) + (
            Arg("checkpoint_state", TENSOR, dtypes=STATE, mutated=True),
            Arg("state_indices", TENSOR, dtypes=INDEX),
            Arg("d_cache", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("k_cache", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("g_cache", TENSOR, dtypes=FLOAT32, mutated=True),
            Arg("write_pos", TENSOR, dtypes=INT32),
            Arg("cache_base", TENSOR, dtypes=INT32),
            Arg("is_flush", TENSOR, dtypes=FLAGS),
        ) + tuple(_VERIFY_ARGS[n] for n in (
            "A_log", "dt_bias", "scale", "is_kda", "use_gate_in_kernel", "lower_bound",
            "beta_is_logit", "use_qk_l2norm_in_kernel", "cu_seqlens")) + (
            Arg("null_block_id", INT64, -1),
            Arg("replay_indices", OPT_TENSOR, None, dtypes=INDEX),
            Arg("rawv_cache", OPT_TENSOR, None, dtypes=FLOATING, mutated=True),
            Arg("rawk_cache", OPT_TENSOR, None, dtypes=FLOATING, mutated=True),
            Arg("beta_cache", OPT_TENSOR, None, dtypes=FLOAT32, mutated=True),
            Arg("rows", INT64, 0),
        ) + _state_format_args() + _KEYWORDS,
        returns="output",
        op_order=_REPLAY_VERIFY_OP_ORDER,
        schema_defaults_from="is_kda",
    )


# SGLang's Triton tuning keywords with its defaults: accepted, ignored.
_SPEC_TUNING = (("block_v", 64), ("num_warps", 1), ("num_stages", 2), ("nk", 2), ("bs_min", 4),
                ("block_v_flush", 64), ("num_warps_flush", 1), ("num_stages_flush", 2),
                ("nk_flush", 2))


def _gdn_spec_prepare(op, q, k, v, a, b, checkpoint_state, d_cache, rawv_cache, rawk_cache,
                      beta_cache, out, query_start_loc, ssm_state_indices, max_cache_len,
                      max_spec_len, launch_mode):
    """SGLang's gdn_replayssm_spec_decode onto the verify op: its asserts and errors, the packed
    [T, ...] token tensors as [1, T, ...] views, out viewed as the op's output, launch_mode as the
    rows the call serves."""
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("out", out)):
        _check_tensor(op, name, t)
    rows = _LAUNCH_ROWS.get(launch_mode)
    if rows is None:
        raise ValueError(f"{op}: `launch_mode` must be one of 'both', 'verify', 'flush' "
                         f"(got {launch_mode!r})")
    L = int(max_cache_len)
    assert L & (L - 1) == 0, "circular cache requires power-of-two max_cache_len"
    assert _shape(d_cache)[2] == L
    if rows != 1 and (rawv_cache is None or rawk_cache is None or beta_cache is None):
        raise ValueError("raw replay buffers are required for exact-fold launch")
    if 2 * int(max_spec_len) > L:
        raise ValueError(f"max_spec_len={max_spec_len} needs max_cache_len >= 2 * max_spec_len "
                         f"(got {L})")
    T = _shape(q)[0]
    view = lambda x: x.reshape(1, T, *_shape(x)[1:])  # noqa: E731
    return (view(q), view(k), view(v), view(a), view(b), view(out), query_start_loc,
            ssm_state_indices, rows)


# SGLang's launch_mode as the verify op's rows (0 all, 1 those not folding, 2 the folding ones).
_LAUNCH_ROWS = {"both": 0, "verify": 1, "flush": 2}


def _gdn_spec() -> Op:
    doc = """SGLang's ``gdn_replayssm_spec_decode`` (GDN, split q/k/v varlen, circular ring) on
    :func:`replayssm_verify`: its arguments in its order. q, k [T_total, H, K]; v [T_total, HV,
    V]; a, b [T_total, HV] (the raw gate and beta logits); checkpoint_state [slots, HV, V, K];
    d_cache [R, HV, L, V], k_cache [R, H, L, K], g_cache [R, HV, L] float32; rawv_cache [R, HV,
    L, V], rawk_cache [R, H, L, K], beta_cache [R, HV, L] float32 (all three: the exact-raw ring,
    which launch_mode 'both' and 'flush' need; rawv and rawk alone: the hi/lo residual ring);
    out [T_total, HV, V]; query_start_loc [B+1]; ssm_state_indices [B] (checkpoint slots, <=
    null_block_id: padded); replay_indices [B] (the ring and cursor rows); write_pos, cache_base
    [R] int32, is_flush [R] int8 or int32. launch_mode: 'both' (every row), 'verify' (the rows
    not folding; padded rows get zero outputs), 'flush' (the folding rows: the exact fold from
    the raw ring, then their outputs). Records past the ring are dropped. Returns ``out``. The
    Triton tuning keywords and dot_precision are accepted and ignored. Differences: one pass per
    row does the fold and the verify; the verify's history and drafts run the recurrent op's
    order in fp32 (SGLang forms the window's WY system on tensor cores, TF32 by default), so the
    outputs equal the recurrent op over the same tokens with fp32 rings."""
    return Op(
        name="gdn_replayssm_spec_decode",
        public="gdn_replayssm_spec_decode",
        binding="replayssm_verify",
        doc=doc,
        args=(
            Arg("q", TENSOR, dtypes=FLOATING),
            Arg("k", TENSOR, dtypes=FLOATING),
            Arg("v", TENSOR, dtypes=FLOATING),
            Arg("a", ANY, op=False),
            Arg("b", ANY, op=False),
            Arg("A_log", OPT_TENSOR, dtypes=FLOATING),
            Arg("dt_bias", OPT_TENSOR, dtypes=FLOATING),
            Arg("checkpoint_state", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("d_cache", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("k_cache", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("g_cache", TENSOR, dtypes=FLOAT32, mutated=True),
            Arg("rawv_cache", OPT_TENSOR, dtypes=FLOATING, mutated=True),
            Arg("rawk_cache", OPT_TENSOR, dtypes=FLOATING, mutated=True),
            Arg("beta_cache", OPT_TENSOR, dtypes=FLOAT32, mutated=True),
            Arg("out", ANY, op=False),
            Arg("query_start_loc", ANY, op=False),
            Arg("ssm_state_indices", ANY, op=False),
            Arg("replay_indices", OPT_TENSOR, dtypes=INDEX),
            Arg("write_pos", TENSOR, dtypes=INT32),
            Arg("cache_base", TENSOR, dtypes=INT32),
            Arg("is_flush", TENSOR, dtypes=FLAGS),
            Arg("max_cache_len", INT, op=False),
            Arg("max_spec_len", INT, op=False),
            Arg("scale", OPT_FLOAT, None),
            Arg("use_qk_l2norm_in_kernel", BOOL, True),
            Arg("null_block_id", INT64, 0),
        ) + tuple(Arg(n, ANY, d, op=False) for n, d in _SPEC_TUNING) + (
            Arg("launch_mode", STR, "both", op=False),
            Arg("dot_precision", ANY, "tf32", op=False),
        ) + _KEYWORDS + (
            Arg("g", TENSOR, dtypes=FLOATING, public=False, shown_as="a"),
            Arg("beta", TENSOR, dtypes=FLOATING, public=False, shown_as="b"),
            Arg("output", TENSOR, dtypes=FLOATING, mutated=True, public=False, shown_as="out"),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX, public=False,
                shown_as="query_start_loc"),
            Arg("state_indices", TENSOR, dtypes=INDEX, public=False,
                shown_as="ssm_state_indices"),
            Arg("rows", INT64, 0, public=False, shown_as="launch_mode"),
            Arg("is_kda", BOOL, False, public=False),
            Arg("use_gate_in_kernel", BOOL, True, public=False),
            Arg("lower_bound", OPT_FLOAT, None, public=False),
            Arg("beta_is_logit", BOOL, True, public=False),
        ) + tuple(dataclasses.replace(a, public=False, keyword=False)
                  for a in _state_format_args()),
        returns="out",
        op_order=_REPLAY_VERIFY_OP_ORDER,
        schema_defaults_from="is_kda",
        prepare=_gdn_spec_prepare,
        fills=("q", "k", "v", "g", "beta", "output", "cu_seqlens", "state_indices", "rows"),
    )


# The commit's cursor tables (written in place) and accepted counts, as both surfaces take them.
_CURSORS = (Arg("write_pos", TENSOR, dtypes=INT32, mutated=True),
            Arg("cache_base", TENSOR, dtypes=INT32, mutated=True),
            Arg("is_flush", TENSOR, dtypes=FLAGS, mutated=True),
            Arg("num_accepted", TENSOR, dtypes=INDEX))
_REPLAY_COMMIT_OP_ORDER = ("write_pos", "cache_base", "is_flush", "num_accepted", "state_indices",
                           "max_cache_len", "max_spec_len", "cache_buf_len", "fold_every_commit",
                           "null_block_id", "check_indices", "pdl")


def _replay_commit() -> Op:
    doc = """The commit after :func:`replayssm_verify`, a cursor move (no state is copied): for
    each row b with live slot s = state_indices[b] (> null_block_id) and a = num_accepted[b] (the
    bonus token included): after a fold (is_flush[s] != 0) write_pos[s] = a and, when a > 0,
    cache_base[s] += write_pos[s] (mod cache_buf_len, the rings' length; 0: max_cache_len);
    otherwise write_pos[s] += a; then is_flush[s] = write_pos[s] + 2 * max_spec_len >
    max_cache_len, or with fold_every_commit write_pos[s] > 0. Rejected drafts stay behind the
    cursor. write_pos, cache_base [slots] int32, is_flush [slots] int32 or int8; num_accepted,
    state_indices [B] int32/int64. On CUDA the cursors move on the device (graph-safe). Returns
    ``write_pos``."""
    return Op(
        name="replayssm_commit",
        public="replayssm_commit",
        doc=doc,
        args=(
            *_CURSORS,
            Arg("state_indices", TENSOR, dtypes=INDEX),
            Arg("max_cache_len", INT64),
            Arg("max_spec_len", INT64),
            Arg("cache_buf_len", INT64, 0),
            Arg("fold_every_commit", BOOL, False),
            Arg("null_block_id", INT64, -1),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
        ),
        returns="write_pos",
        op_order=_REPLAY_COMMIT_OP_ORDER,
    )


def _spec_commit_prepare(op, cache_buf_len, replay_indices):
    return (0 if cache_buf_len is None else int(cache_buf_len), replay_indices)


def _gdn_spec_commit() -> Op:
    doc = """SGLang's ``commit_gdn_replayssm_spec`` on :func:`replayssm_commit`: its arguments in
    its order; the request-keyed cursors (rows replay_indices) advanced by num_accepted (the bonus
    token included); fold_every_commit: is_flush = write_pos > 0 (the fold-every-commit scheme);
    cache_buf_len (None: max_cache_len): the rings' length, where cache_base wraps. Returns
    None."""
    return Op(
        name="commit_gdn_replayssm_spec",
        public="commit_gdn_replayssm_spec",
        binding="replayssm_commit",
        doc=doc,
        args=(
            *_CURSORS,
            Arg("replay_indices", ANY, op=False),
            Arg("max_cache_len", INT64),
            Arg("max_spec_len", INT64),
            Arg("fold_every_commit", BOOL, False),
            Arg("cache_buf_len", ANY, None, op=False),
            Arg("null_block_id", INT64, 0),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            Arg("state_indices", TENSOR, dtypes=INDEX, public=False, shown_as="replay_indices"),
            Arg("cache_buf_len", INT64, 0, public=False),
        ),
        returns=(),
        op_order=_REPLAY_COMMIT_OP_ORDER,
        prepare=_spec_commit_prepare,
        fills=("cache_buf_len", "state_indices"),
    )


# ---- the cursors of rows that start decoding -----------------------------------------------------
_REPLAY_RESET_OP_ORDER = ("write_pos", "cache_base", "is_flush", "do_reset", "state_indices",
                          "max_cache_len", "max_spec_len", "null_block_id", "check_indices", "pdl")


def _reset_flags(op, do_reset):
    """A bool do_reset as the int8 flags the op reads: its own bytes, a view (no copy)."""
    dt = str(getattr(do_reset, "dtype", ""))
    if dt == "torch.bool":
        import torch

        return do_reset.view(torch.int8)
    if dt == "bool":
        import numpy as np

        return do_reset.view(np.int8)
    return do_reset


def _reset_prepare(op, do_reset):
    return (_reset_flags(op, do_reset),)


def _sglang_reset_prepare(op, do_reset, state_batch_indices):
    return (_reset_flags(op, do_reset), state_batch_indices)


_RESET_FLAGS = ("bool", "int8", "int32", "int64")


def _replay_reset() -> Op:
    doc = """The cursors of rows that start decoding (the prefill -> decode handoff): for each
    row b with live slot s = state_indices[b] (> null_block_id) and do_reset[b] != 0,
    write_pos[s] = cache_base[s] = 0 and is_flush[s] = 2 * max_spec_len > max_cache_len (the
    commit's early-fold rule at write_pos 0); other rows' cursors are untouched. write_pos,
    cache_base [slots] int32, is_flush [slots] int32 or int8; do_reset [B] bool, int8, int32 or
    int64; state_indices [B] int32/int64. On CUDA on the device (graph-safe). Returns
    ``write_pos``."""
    return Op(
        name="replayssm_reset_cursors",
        public="replayssm_reset_cursors",
        doc=doc,
        args=(
            *_CURSORS[:3],
            Arg("do_reset", TENSOR, dtypes=_RESET_FLAGS),
            Arg("state_indices", TENSOR, dtypes=INDEX),
            Arg("max_cache_len", INT64),
            Arg("max_spec_len", INT64),
            Arg("null_block_id", INT64, -1),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
        ),
        returns="write_pos",
        op_order=_REPLAY_RESET_OP_ORDER,
        prepare=_reset_prepare,
        fills=("do_reset",),
    )


def _sglang_reset() -> Op:
    doc = """SGLang's ``reset_gdn_replayssm_spec_cursors`` on :func:`replayssm_reset_cursors`:
    its arguments in its order (the rows' blocks ``state_batch_indices``). Returns None."""
    return Op(
        name="reset_gdn_replayssm_spec_cursors",
        public="reset_gdn_replayssm_spec_cursors",
        binding="replayssm_reset_cursors",
        doc=doc,
        args=(
            *_CURSORS[:3],
            Arg("do_reset", TENSOR, dtypes=_RESET_FLAGS),
            Arg("state_batch_indices", ANY, op=False),
            Arg("max_cache_len", INT64),
            Arg("max_spec_len", INT64),
            Arg("null_block_id", INT64, 0),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            Arg("state_indices", TENSOR, dtypes=INDEX, public=False,
                shown_as="state_batch_indices"),
        ),
        returns=(),
        op_order=_REPLAY_RESET_OP_ORDER,
        prepare=_sglang_reset_prepare,
        fills=("do_reset", "state_indices"),
    )


# ---- fold-every-commit: the commit replays the accepted raw records into the checkpoint -------
_FOLD_OP_ORDER = ("state", "rawv", "rawk", "g", "beta", "state_indices", "accept_lens",
                  "track_indices", "steps_to_track", "is_kda", "use_qk_l2norm_in_kernel",
                  "null_block_id", "check_indices", "pdl")

_FOLD_DOC = """The commit of the fold-every-commit scheme: the verify recorded each draft's raw
    inputs (verify's ring_v, ring_k, ring_g, ring_beta; SGLang's cache_ring) at positions 0..T-1,
    and for each layer and live row b (slot s = state_indices[b] > null_block_id, a =
    accept_lens[b] > 0) the checkpoint state[layer, s] runs the recurrent step over the records
    t < a in the recurrent op's order (CPU: the recurrent op's state after the accepted tokens
    bit for bit); with track_indices / steps_to_track, the state after step steps_to_track[b] (>=
    0) also goes to slot track_indices[b] (> null_block_id). state [layers, slots, HV, V, K] (or
    one layer [slots, HV, V, K]); rawv [.., slots, HV, L, V], rawk [.., slots, H, L, K], g [..,
    slots, HV, L] (GDN) / [.., slots, HV, L, K] (KDA) float32, beta [.., slots, HV, L] float32,
    any layer and slot strides. Every layer in one call. Returns None."""


def _fold_core() -> Op:
    return Op(
        name="replayssm_fold_commit",
        public="replayssm_fold_commit",
        doc=_FOLD_DOC,
        args=(
            Arg("state", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("rawv", TENSOR, dtypes=FLOATING),
            Arg("rawk", TENSOR, dtypes=FLOATING),
            Arg("g", TENSOR, dtypes=FLOAT32),
            Arg("beta", TENSOR, dtypes=FLOAT32),
            Arg("state_indices", TENSOR, dtypes=INDEX),
            Arg("accept_lens", TENSOR, dtypes=INDEX),
            Arg("track_indices", OPT_TENSOR, None, dtypes=INDEX),
            Arg("steps_to_track", OPT_TENSOR, None, dtypes=INDEX),
            Arg("is_kda", BOOL, False),
            Arg("use_qk_l2norm_in_kernel", BOOL, True),
            Arg("null_block_id", INT64, -1),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
        ),
        returns=(),
        op_order=_FOLD_OP_ORDER,
    )


def _sglang_fold(name: str, kda: bool, null_block_id: int, sglang_doc: str) -> Op:
    """SGLang's fold-every-commit commits: its argument names and order, onto the core op.
    max_cache_len and num_k_heads are SGLang's launch constants (the ring's length and key heads,
    read here from the rings' shapes and checked against them)."""
    g_name = "gk_cache" if kda else "g_cache"

    def check(op, rawv_cache, rawk_cache, max_cache_len, num_k_heads):
        L, H = _shape(rawv_cache)[-2], _shape(rawk_cache)[-3]
        if int(max_cache_len) != L:
            raise ValueError(f"{op}: max_cache_len={max_cache_len} must be the rings' length "
                             f"({L})")
        if int(num_k_heads) != H:
            raise ValueError(f"{op}: num_k_heads={num_k_heads} must be rawk_cache's key heads "
                             f"({H})")

    if kda:
        def prepare(op, checkpoint_state, rawv_cache, rawk_cache, gk_cache, beta_cache,
                    ssm_state_indices, max_cache_len, num_k_heads, mamba_track_indices,
                    mamba_steps_to_track):
            check(op, rawv_cache, rawk_cache, max_cache_len, num_k_heads)
            return (checkpoint_state, rawv_cache, rawk_cache, gk_cache, beta_cache,
                    ssm_state_indices, mamba_track_indices, mamba_steps_to_track)
    else:
        def prepare(op, checkpoint_state, rawv_cache, rawk_cache, g_cache, beta_cache,
                    ssm_state_indices, max_cache_len, num_k_heads, mamba_track_indices,
                    mamba_steps_to_track):
            check(op, rawv_cache, rawk_cache, max_cache_len, num_k_heads)
            return (checkpoint_state, rawv_cache, rawk_cache, g_cache, beta_cache,
                    ssm_state_indices, mamba_track_indices, mamba_steps_to_track)

    return Op(
        name=name,
        public=name,
        binding="replayssm_fold_commit",
        doc=sglang_doc,
        args=(
            Arg("checkpoint_state", ANY, op=False),
            Arg("rawv_cache", ANY, op=False),
            Arg("rawk_cache", ANY, op=False),
            Arg(g_name, ANY, op=False),
            Arg("beta_cache", ANY, op=False),
            Arg("ssm_state_indices", ANY, op=False),
            Arg("accept_lens", TENSOR, dtypes=INDEX),
            Arg("max_cache_len", INT, op=False),
            Arg("num_k_heads", INT, op=False),
            Arg("mamba_track_indices", ANY, None, op=False),
            Arg("mamba_steps_to_track", ANY, None, op=False),
            Arg("use_qk_l2norm_in_kernel", BOOL, True),
            Arg("null_block_id", INT64, null_block_id),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            Arg("state", TENSOR, dtypes=FLOATING, mutated=True, public=False,
                shown_as="checkpoint_state"),
            Arg("rawv", TENSOR, dtypes=FLOATING, public=False, shown_as="rawv_cache"),
            Arg("rawk", TENSOR, dtypes=FLOATING, public=False, shown_as="rawk_cache"),
            Arg("g", TENSOR, dtypes=FLOAT32, public=False, shown_as=g_name),
            Arg("beta", TENSOR, dtypes=FLOAT32, public=False, shown_as="beta_cache"),
            Arg("state_indices", TENSOR, dtypes=INDEX, public=False,
                shown_as="ssm_state_indices"),
            Arg("track_indices", OPT_TENSOR, None, dtypes=INDEX, public=False,
                shown_as="mamba_track_indices"),
            Arg("steps_to_track", OPT_TENSOR, None, dtypes=INDEX, public=False,
                shown_as="mamba_steps_to_track"),
            Arg("is_kda", BOOL, kda, public=False),
        ),
        returns=(),
        op_order=_FOLD_OP_ORDER,
        prepare=prepare,
        fills=("state", "rawv", "rawk", "g", "beta", "state_indices", "track_indices",
               "steps_to_track"),
    )


_FOLD_SGLANG_DOC = """SGLang's ``{name}`` (fold-every-commit, {what}) on :func:`replayssm_fold_commit`:
    its arguments in its order. checkpoint_state {shape}, updated in place; rawv_cache, rawk_cache,
    {g} and beta_cache the rings its verify wrote ({ring}); ssm_state_indices, accept_lens (the
    bonus token included) [B]; mamba_track_indices / mamba_steps_to_track [B]: the track slot
    that also receives the state after that step. max_cache_len and num_k_heads must be the
    rings' length and key heads. Returns None. Difference: on CPU tensors a bad row (a slot past
    the pool, accept_lens > max_cache_len) is a ValueError, where SGLang's kernel reads past the
    ring."""


def _sglang_folds() -> Tuple[Op, ...]:
    def doc(name, what, shape, g, ring):
        return _FOLD_SGLANG_DOC.format(name=name, what=what, shape=shape, g=g, ring=ring)
    layered = "[num_layers, slots, HV, V, K]"
    return (
        _sglang_fold("commit_gdn_replayssm_fold_all_layers", False, -1,
                     doc("commit_gdn_replayssm_fold_all_layers", "GDN, every layer in one call",
                         layered, "g_cache", "fused_sigmoid_gating_delta_rule_update's "
                         "cache_ring")),
        _sglang_fold("commit_kda_replayssm_spec", True, 0,
                     doc("commit_kda_replayssm_spec", "KDA, one layer",
                         "[slots, HV, V, K]", "gk_cache (per K column)", "the KDA verify's "
                         "raw ring: verify(..., ring_v=, ring_k=, ring_g=, ring_beta=)")),
        _sglang_fold("commit_kda_replayssm_spec_all_layers", True, 0,
                     doc("commit_kda_replayssm_spec_all_layers", "KDA, every layer in one call",
                         layered, "gk_cache (per K column)", "the KDA verify's raw ring")),
    )


# ---- the compact circular commit --------------------------------------------------------------
_CIRC_OP_ORDER = ("state", "d_cache", "k_cache", "g_cache", "state_indices", "replay_indices",
                  "write_pos", "cache_base", "is_flush", "accept_lens", "d_residual",
                  "k_residual", "track_indices", "steps_to_track", "null_block_id",
                  "check_indices", "pdl")

_CIRC_DOC = """The compact circular commit (GDN), after :func:`replayssm_commit`: where needed, the
    circular history becomes a state, every layer in one call. For each layer and live row b
    (slot s = state_indices[b] > null_block_id, ring row r = replay_indices[b], n =
    write_pos[r], already advanced by accept_lens[b]): when is_flush[r] != 0 the checkpoint
    becomes the state after the n records (e^{G} state + the records' decayed d k^T, d and k
    plus their residuals when given, fp32), and with track_indices[b] > null_block_id and
    steps_to_track[b] >= 0 the state after the first n - accept_lens[b] + steps_to_track[b] + 1
    records goes to slot track_indices[b]; then each folded row's cache_base moves by n (mod L),
    its write_pos and is_flush become 0. state [layers, slots, HV, V, K] (or one layer); d_cache
    [.., R, HV, L, V], k_cache [.., R, H, L, K], g_cache [.., R, HV, L] float32, d_residual /
    k_residual like d / k (optional, together); write_pos, cache_base [R] int32, is_flush [R]
    int32 or int8. Returns None."""


def _circular_core() -> Op:
    return Op(
        name="replayssm_circular_commit",
        public="replayssm_circular_commit",
        doc=_CIRC_DOC,
        args=(
            Arg("state", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("d_cache", TENSOR, dtypes=FLOATING),
            Arg("k_cache", TENSOR, dtypes=FLOATING),
            Arg("g_cache", TENSOR, dtypes=FLOAT32),
            Arg("state_indices", TENSOR, dtypes=INDEX),
            Arg("replay_indices", TENSOR, dtypes=INDEX),
            Arg("write_pos", TENSOR, dtypes=INT32, mutated=True),
            Arg("cache_base", TENSOR, dtypes=INT32, mutated=True),
            Arg("is_flush", TENSOR, dtypes=FLAGS, mutated=True),
            Arg("accept_lens", TENSOR, dtypes=INDEX),
            Arg("d_residual", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("k_residual", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("track_indices", OPT_TENSOR, None, dtypes=INDEX),
            Arg("steps_to_track", OPT_TENSOR, None, dtypes=INDEX),
            Arg("null_block_id", INT64, -1),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
        ),
        returns=(),
        op_order=_CIRC_OP_ORDER,
        schema_defaults_from="d_residual",
    )


def _circular_prepare(op, checkpoint_state, d_cache, k_cache, g_cache, d_residual_cache,
                      k_residual_cache, state_batch_indices, replay_indices, mamba_track_indices,
                      mamba_steps_to_track):
    return (checkpoint_state, d_cache, k_cache, g_cache, d_residual_cache, k_residual_cache,
            state_batch_indices, replay_indices, mamba_track_indices, mamba_steps_to_track)


def _sglang_circular() -> Op:
    doc = """SGLang's ``commit_gdn_replayssm_circular`` (keyword-only, as SGLang's) on
    :func:`replayssm_circular_commit`: materialize the circular history only for capacity
    (is_flush) and track rows, after commit_gdn_replayssm_spec advanced write_pos by the accepted
    length. checkpoint_state [num_layers, slots, HV, V, K]; d_cache, k_cache, g_cache and the
    optional d_residual_cache / k_residual_cache (the hi/lo residual ring of
    gdn_replayssm_spec_decode) [num_layers, R, ...]; state_batch_indices, replay_indices,
    accept_lens [B]; write_pos, cache_base, is_flush [R]; mamba_track_indices /
    mamba_steps_to_track [B] (optional). Returns None. Differences: the history term is an fp32
    sum over the records (SGLang: tensor-core dots of hi/lo bf16 parts); only the records that
    count are read (SGLang's masks zero the others' weights); on CPU tensors a bad row is a
    ValueError."""
    return Op(
        name="commit_gdn_replayssm_circular",
        public="commit_gdn_replayssm_circular",
        binding="replayssm_circular_commit",
        doc=doc,
        args=(
            Arg("checkpoint_state", ANY, keyword=True, op=False),
            Arg("d_cache", ANY, keyword=True, op=False),
            Arg("k_cache", ANY, keyword=True, op=False),
            Arg("g_cache", ANY, keyword=True, op=False),
            Arg("d_residual_cache", ANY, keyword=True, op=False),
            Arg("k_residual_cache", ANY, keyword=True, op=False),
            Arg("state_batch_indices", ANY, keyword=True, op=False),
            Arg("replay_indices", ANY, keyword=True, op=False),
            Arg("write_pos", TENSOR, dtypes=INT32, mutated=True, keyword=True),
            Arg("cache_base", TENSOR, dtypes=INT32, mutated=True, keyword=True),
            Arg("is_flush", TENSOR, dtypes=FLAGS, mutated=True, keyword=True),
            Arg("accept_lens", TENSOR, dtypes=INDEX, keyword=True),
            Arg("mamba_track_indices", ANY, None, keyword=True, op=False),
            Arg("mamba_steps_to_track", ANY, None, keyword=True, op=False),
            Arg("null_block_id", INT64, -1, keyword=True),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            Arg("state", TENSOR, dtypes=FLOATING, mutated=True, public=False,
                shown_as="checkpoint_state"),
            Arg("d_cache", TENSOR, dtypes=FLOATING, public=False, shown_as="d_cache"),
            Arg("k_cache", TENSOR, dtypes=FLOATING, public=False, shown_as="k_cache"),
            Arg("g_cache", TENSOR, dtypes=FLOAT32, public=False, shown_as="g_cache"),
            Arg("d_residual", OPT_TENSOR, None, dtypes=FLOATING, public=False,
                shown_as="d_residual_cache"),
            Arg("k_residual", OPT_TENSOR, None, dtypes=FLOATING, public=False,
                shown_as="k_residual_cache"),
            Arg("state_indices", TENSOR, dtypes=INDEX, public=False,
                shown_as="state_batch_indices"),
            Arg("replay_indices", TENSOR, dtypes=INDEX, public=False, shown_as="replay_indices"),
            Arg("track_indices", OPT_TENSOR, None, dtypes=INDEX, public=False,
                shown_as="mamba_track_indices"),
            Arg("steps_to_track", OPT_TENSOR, None, dtypes=INDEX, public=False,
                shown_as="mamba_steps_to_track"),
        ),
        returns=(),
        op_order=_CIRC_OP_ORDER,
        schema_defaults_from="d_residual",
        prepare=_circular_prepare,
        fills=("state", "d_cache", "k_cache", "g_cache", "d_residual", "k_residual",
               "state_indices", "replay_indices", "track_indices", "steps_to_track"),
    )


OPS: Tuple[Op, ...] = (_packed(False), _packed(True), _recurrent(True), _recurrent(False),
                       _fla(False), _fla(True), _REPLAY, _HELION_REPLAY,
                       _chunk(False), _chunk(True),
                       _CONV_UPDATE, _fused(False), _fused(True),
                       _verify_core(), _sglang_verify(), _flashinfer_mtp(), _commit(),
                       _sglang_scatter(), _conv_commit(), _sglang_conv_scatter(),
                       _replay_verify_core(), _gdn_spec(), _replay_commit(), _gdn_spec_commit(),
                       _replay_reset(), _sglang_reset(),
                       _fold_core(), _circular_core(), _sglang_circular()) + _sglang_folds()
