"""The op table (deltastate._surface) and what is derived from it: the public signatures and
the torch schemas (the API, pinned here), the check of the table against the compiled binding,
the generated functions' names and sources, and the argument list in their docstrings."""

import dataclasses
import inspect

import pytest

import deltastate as ds
from deltastate import _derive
from deltastate._lib import lib
from deltastate._surface import BOOL, OPS, OPT_FLOAT, Arg

PUBLIC = {
    "fused_recurrent_gated_delta_rule_packed_decode":
        "(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, "
        "use_qk_l2norm_in_kernel=True, *, round_beta=False, check_indices=None, pdl=False)",
    "fused_recurrent_kda_packed_decode":
        "(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, "
        "use_qk_l2norm_in_kernel=True, lower_bound=None, *, round_beta=False, "
        "check_indices=None, pdl=False)",
    "recurrent_kda":
        "(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, "
        "output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, "
        "lower_bound=None, cu_seqlens=None, ssm_state_indices=None, output=None, "
        "beta_is_logit=False, *, check_indices=None, pdl=False)",
    "recurrent_gated_delta_rule":
        "(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, "
        "output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, "
        "lower_bound=None, cu_seqlens=None, ssm_state_indices=None, output=None, "
        "beta_is_logit=False, *, check_indices=None, pdl=False)",
    "fused_recurrent_linear_replayssm_decode":
        "(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, g_cache, out, "
        "ssm_state_indices, write_pos, force_flush=None, *, is_kda=False, "
        "use_qk_l2norm_in_kernel=True, lower_bound=None, advance_write_pos=False, "
        "check_indices=None, pdl=False)",
}

_PACKED_SCHEMA = (
    "Tensor mixed_qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, float scale, "
    "Tensor(a!) initial_state, Tensor(b!) out, Tensor ssm_state_indices, "
    "bool use_qk_l2norm_in_kernel=True, float? lower_bound=None, bool round_beta=False, "
    "int check_indices=-1, bool pdl=False")
_RECURRENT_SCHEMA = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, Tensor? A_log, "
    "Tensor? dt_bias, bool use_gate_in_kernel, float? lower_bound, bool beta_is_logit, "
    "float? scale, Tensor? initial_state, Tensor(b!)? state_pool, Tensor? ssm_state_indices, "
    "Tensor? cu_seqlens, Tensor(c!)? final_state, bool use_qk_l2norm_in_kernel, "
    "int check_indices=-1, bool pdl=False")
SCHEMAS = {
    "gdn_packed_decode": f"gdn_packed_decode({_PACKED_SCHEMA}) -> ()",
    "kda_packed_decode": f"kda_packed_decode({_PACKED_SCHEMA}) -> ()",
    "recurrent_gated_delta_rule": f"recurrent_gated_delta_rule({_RECURRENT_SCHEMA}) -> ()",
    "recurrent_kda": f"recurrent_kda({_RECURRENT_SCHEMA}) -> ()",
    "replayssm_decode":
        "replayssm_decode(Tensor mixed_qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, "
        "float scale, Tensor(a!) initial_state, Tensor(b!) d_cache, Tensor(c!) k_cache, "
        "Tensor(d!) g_cache, Tensor(e!) out, Tensor ssm_state_indices, Tensor(f!) write_pos, "
        "Tensor? force_flush, bool is_kda=False, bool use_qk_l2norm_in_kernel=True, "
        "float? lower_bound=None, bool advance_write_pos=False, int check_indices=-1, "
        "bool pdl=False) -> ()",
}


def plain(fn):
    """`fn`'s signature without annotations: names, order, defaults, keyword-only marker."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_signature(name):
    fn = getattr(ds, name)
    assert plain(fn) == PUBLIC[name]
    assert fn.__name__ == fn.__qualname__ == name and fn.__module__ == "deltastate.ops"
    assert name in ds.__all__
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'bogus'"):
        fn(bogus=1)


def test_alias():
    assert ds.fused_recurrent_gdn_replayssm_decode is ds.fused_recurrent_linear_replayssm_decode


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_schema(op):
    assert _derive.schema(op) == SCHEMAS[op.name]


def test_every_binding_has_an_entry():
    assert sorted(lib.op_signatures()) == sorted(op.name for op in OPS)
    for op in OPS:
        names = [a.name for a in _derive.binding_order(op, lib.op_signatures())]
        assert sorted(names) == sorted(a.name for a in op.op_args)


def test_table_and_binding_must_match():
    """An entry naming an argument the binding lacks, or giving one another kind, fails the
    import with both lists, instead of passing arguments to the wrong fields."""
    op = OPS[0]
    extra = dataclasses.replace(op, args=op.args + (Arg("extra", BOOL, False),))
    with pytest.raises(ImportError, match=r"op `gdn_packed_decode` takes .*extra:bool"):
        _derive.binding_order(extra, lib.op_signatures())
    retyped = dataclasses.replace(
        op, args=tuple(dataclasses.replace(a, kind=OPT_FLOAT) if a.name == "scale" else a
                       for a in op.args))
    with pytest.raises(ImportError, match=r"scale:float\?.* but .*scale:float[,)]"):
        _derive.binding_order(retyped, lib.op_signatures())
    with pytest.raises(ImportError, match="no binding for op `nope`"):
        _derive.binding_order(dataclasses.replace(op, name="nope"), lib.op_signatures())


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_generated_function_documents_its_arguments(op):
    fn = getattr(ds, op.public)
    doc = inspect.getdoc(fn)
    assert doc.startswith(inspect.cleandoc(op.doc))
    listed = doc.split("Arguments:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == [a.name for a in op.public_args]
    for line, a in zip(listed, op.public_args):
        assert all(d in line for d in a.dtypes), line
        assert line.endswith("written in place") == a.mutated, line
    assert f"def {op.public}(" in inspect.getsource(fn)  # the generated source is registered
