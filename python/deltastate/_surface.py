"""Each op's Python surface, written once: the table ``OPS``.

An entry (:class:`Op`) lists the op's arguments in order, each with its kind, default, accepted
dtypes, whether the op writes it in place, and names what the public function returns. Derived
from it (:mod:`deltastate._derive`):

- the public function in :mod:`deltastate.ops`: its signature (``inspect.signature``, ``help()``),
  the conversion of Python scalars, the call of the tvm-ffi binding, and the error that names an
  argument the binding rejected by type;
- the torch custom op in :mod:`deltastate.torch_ops`: its schema, with ``Tensor(a!)`` on every
  tensor the op writes in place, its CPU/CUDA implementation and its fake implementation;
- the order of the binding's arguments: the compiled module lists each op's arguments by name and
  kind (``op_signatures()``, from the ``Binding`` of its args struct in python/src/module.cpp);
  calls are built from that list by name, and an entry that names other arguments or kinds than
  the binding fails the import.

Adding an op: its args struct (include/deltastate/ops.h), its ``Binding`` in module.cpp, and one
entry here.
"""

from __future__ import annotations

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
# anything is written; off for CUDA tensors, where it traps the kernel on an out-of-range index).
# The binding and the torch op take it as an int: -1 = the default, 0 = off, 1 = on.
CHECK = Kind("check", "int", "an int", "Optional[bool]")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of an argument the caller must give

# Accepted dtypes (what the core's validators take), for the generated documentation.
FLOATING = ("float32", "bfloat16", "float16")
INDEX = ("int32", "int64")
INT32 = ("int32",)
FLOAT32 = ("float32",)


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
    shown_as: Optional[str] = None  # the public argument an op-only one comes from (in errors)


@dataclass(frozen=True)
class Op:
    name: str  # the torch op (torch.ops.deltastate.<name>) and the binding's module function
    public: str  # the public function in deltastate
    doc: str  # its docstring (an argument list generated from `args` is appended)
    args: Tuple[Arg, ...]  # in the public function's order; op-only arguments in the op's order
    returns: Union[str, Tuple[str, ...]]  # what the public function returns: a name or a tuple
    # The torch op's argument order where it is not `args`' order.
    op_order: Optional[Tuple[str, ...]] = None
    # The first torch op argument with a default; by default the first of the trailing run of
    # arguments that have one.
    schema_defaults_from: Optional[str] = None
    # The op's own step before the scalar conversions and the call: a function of the op's
    # public name and of the arguments its parameters name, returning the values of `fills`.
    prepare: Optional[Callable[..., tuple]] = None
    fills: Tuple[str, ...] = ()

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


# ---- packed decode ----------------------------------------------------------------------------
def _packed(kda: bool) -> Op:
    gdn_doc = """GDN packed decode (T=1). Returns ``(out, initial_state)``, both updated in place.

    mixed_qkv [B, 2*H*K + HV*V]; a, b [B, HV]; A_log, dt_bias [HV]; initial_state: the pool
    [slots, HV, V, K] (any slot stride); out [B, 1, HV, V]; ssm_state_indices [B] (< 0: padded row).
    """
    kda_doc = """KDA packed decode (T=1). As the GDN op, with a [B, HV*K] and dt_bias [HV*K];
    ``lower_bound`` selects the safe gate. Returns ``(out, initial_state)``."""
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
            Arg("scale", FLOAT),
            Arg("initial_state", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("out", TENSOR, dtypes=FLOATING, mutated=True),
            Arg("ssm_state_indices", TENSOR, dtypes=INDEX),
            Arg("use_qk_l2norm_in_kernel", BOOL, True),
            Arg("lower_bound", OPT_FLOAT, None, public=kda),  # KDA: selects the safe gate
            Arg("round_beta", BOOL, False, keyword=True),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
        ),
        returns=("out", "initial_state"),
    )


# ---- recurrent (B,T and varlen) ---------------------------------------------------------------
def _new_like(op, ref, name, shape=None, float32=False):
    """A new array of `ref`'s framework and device (torch or numpy); `ref`'s shape by default."""
    if type(ref).__module__.startswith("torch"):
        import torch

        if shape is None:
            shape = tuple(ref.shape)
        return torch.empty(shape, dtype=torch.float32 if float32 else ref.dtype, device=ref.device)
    import numpy as np

    if not isinstance(ref, np.ndarray):
        raise TypeError(f"{op}: `{name}` must be a tensor (a numpy array or a torch tensor); got "
                        f"{type(ref).__name__}")
    if shape is None:
        shape = ref.shape
    return np.empty(shape, dtype=np.float32 if float32 else ref.dtype)


def _recurrent_prepare(op, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens,
                       ssm_state_indices, output):
    """The state given as a pool (with ssm_state_indices: updated in place and returned) or as a
    start state (only read; output_final_state returns a new float32 final state), and the
    output allocated when not given."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t is None:
            raise TypeError(f"{op}: `{name}` is required (got None)")
    pooled = ssm_state_indices is not None
    if pooled and initial_state is None:
        raise ValueError("`ssm_state_indices` index a state pool, but no `initial_state` pool was "
                         "given")
    if output is None:
        output = _new_like(op, v, "v")
    if pooled:
        return output, None, initial_state, None, initial_state
    final_state = None
    if output_final_state:
        qs, vs = getattr(q, "shape", ()), getattr(v, "shape", ())
        if len(qs) == 4 and len(vs) == 4:  # otherwise the core rejects q / v first
            n = (len(cu_seqlens) - 1) if cu_seqlens is not None else qs[0]
            final_state = _new_like(op, q, "q", (n, vs[2], vs[3], qs[3]), float32=True)
    return output, initial_state, None, final_state, final_state


def _recurrent(kda: bool) -> Op:
    kda_doc = """Recurrent KDA over a pool: q, k [B,T,H,K] (or [1,T_total,H,K] with cu_seqlens
    [N+1]), v [B,T,HV,V], g [B,T,HV,K] (log decay; the raw gate input with use_gate_in_kernel),
    beta [B,T,HV]. With ssm_state_indices the pool initial_state [slots,HV,V,K] is updated in
    place and returned; without them initial_state [N,HV,V,K] is only read, and
    output_final_state returns a new float32 [N,HV,V,K]. The pool must meet the compiled stride
    contract (slot stride a multiple of 16 elements, base 32-byte aligned). Returns
    ``(o, final_state)``."""
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
            # The start state, only read; with ssm_state_indices the pool (op: `state_pool`).
            Arg("initial_state", OPT_TENSOR, None, dtypes=FLOATING),
            Arg("output_final_state", BOOL, False, op=False),
            Arg("use_qk_l2norm_in_kernel", BOOL, True),
            Arg("use_gate_in_kernel", BOOL, False),
            Arg("lower_bound", OPT_FLOAT, None),
            Arg("cu_seqlens", OPT_TENSOR, None, dtypes=INDEX),
            Arg("ssm_state_indices", OPT_TENSOR, None, dtypes=INDEX),
            Arg("output", TENSOR, None, dtypes=FLOATING, mutated=True),  # None: allocated
            Arg("beta_is_logit", BOOL, False),
            Arg("check_indices", CHECK, None, keyword=True),
            Arg("pdl", BOOL, False, keyword=True),
            # The pool that ssm_state_indices index, updated in place.
            Arg("state_pool", OPT_TENSOR, dtypes=FLOATING, mutated=True, public=False,
                shown_as="initial_state"),
            Arg("final_state", OPT_TENSOR, dtypes=FLOATING, mutated=True, public=False),
        ),
        returns=("output", "returned_state"),
        op_order=("q", "k", "v", "g", "beta", "output", "A_log", "dt_bias", "use_gate_in_kernel",
                  "lower_bound", "beta_is_logit", "scale", "initial_state", "state_pool",
                  "ssm_state_indices", "cu_seqlens", "final_state", "use_qk_l2norm_in_kernel",
                  "check_indices", "pdl"),
        schema_defaults_from="check_indices",
        prepare=_recurrent_prepare,
        fills=("output", "initial_state", "state_pool", "final_state", "returned_state"),
    )


# ---- ReplaySSM --------------------------------------------------------------------------------
_REPLAY = Op(
    name="replayssm_decode",
    public="fused_recurrent_linear_replayssm_decode",
    doc="""ReplaySSM buffered decode (T=1), GDN or KDA (``is_kda``). The checkpoint pool
    initial_state is written only on a flush (write_pos == L-1 or force_flush != 0); otherwise the
    record (d, k, g) is appended to the rings at write_pos. With ``advance_write_pos`` each live
    row's cursor advances on the device (``wp = flushed ? 0 : wp + 1``). Returns ``out``.""",
    args=(
        Arg("mixed_qkv", TENSOR, dtypes=FLOATING),
        Arg("a", TENSOR, dtypes=FLOATING),
        Arg("b", TENSOR, dtypes=FLOATING),
        Arg("A_log", TENSOR, dtypes=FLOATING),
        Arg("dt_bias", TENSOR, dtypes=FLOATING),
        Arg("scale", FLOAT),
        Arg("initial_state", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("d_cache", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("k_cache", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("g_cache", TENSOR, dtypes=FLOAT32, mutated=True),
        Arg("out", TENSOR, dtypes=FLOATING, mutated=True),
        Arg("ssm_state_indices", TENSOR, dtypes=INT32),
        Arg("write_pos", TENSOR, dtypes=INT32, mutated=True),
        Arg("force_flush", OPT_TENSOR, None, dtypes=INT32),
        Arg("is_kda", BOOL, False, keyword=True),
        Arg("use_qk_l2norm_in_kernel", BOOL, True, keyword=True),
        Arg("lower_bound", OPT_FLOAT, None, keyword=True),
        Arg("advance_write_pos", BOOL, False, keyword=True),
        Arg("check_indices", CHECK, None, keyword=True),
        Arg("pdl", BOOL, False, keyword=True),
    ),
    returns="out",
    schema_defaults_from="is_kda",  # the torch op takes force_flush positionally
)

OPS: Tuple[Op, ...] = (_packed(False), _packed(True), _recurrent(True), _recurrent(False), _REPLAY)
