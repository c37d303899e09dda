"""FLA's chunk_gated_delta_rule / chunk_kda over deltastate's chunked prefill: FLA's signature,
the fp64 reference recurrence (reference.py) on numpy and torch CPU tensors (varlen lengths 1, 63,
64, 65, 200, a padded sequence, has_initial_state 0, a pool updated in place, a dense start and
final state, checkpoints dense and into pool slots), the layout rule, torch.compile, and CUDA
tensors routed to the same op (skipped without a GPU or while the CUDA kernel is missing)."""

import inspect

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from helpers import Fw, torch

H, HV, K, V = 2, 4, 16, 16
TOL = 2e-4

# ---- FLA's signatures (fla/ops/gated_delta_rule/chunk.py, fla/ops/kda/chunk.py): the head of ours
_R = inspect.Parameter.empty
FLA_CHUNK_GDN = [
    ("q", _R), ("k", _R), ("v", _R), ("g", _R), ("beta", _R), ("scale", None),
    ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
    ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("state_v_first", False),
    ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("chunk_indices", None), ("cp_context", None),
]
FLA_CHUNK_KDA = [
    ("q", _R), ("k", _R), ("v", _R), ("g", _R), ("beta", _R), ("scale", None),
    ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
    ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False), ("safe_gate", False), ("lower_bound", None),
    ("disable_recompute", False), ("return_intermediate_states", False),
    ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None),
    ("cp_context", None), ("use_graph", False), ("max_num_seqs", None),
]
POOL_KEYWORDS = ["initial_state_indices", "has_initial_state", "output_state_indices",
                 "checkpoint_every_n_tokens", "checkpoint_cu_starts", "state_checkpoints",
                 "checkpoint_slot_indices", "workspace", "pdl"]


@pytest.mark.parametrize("fn, fla", [(ds.chunk_gated_delta_rule, FLA_CHUNK_GDN),
                                     (ds.chunk_kda, FLA_CHUNK_KDA)])
def test_signature_matches_fla(fn, fla):
    params = list(inspect.signature(fn).parameters.values())
    head = [(p.name, p.default) for p in params[:len(fla)]]
    assert head == fla
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:len(fla)])
    rest = params[len(fla):]
    assert all(p.kind is p.KEYWORD_ONLY for p in rest)  # FLA's **kwargs ones and ours
    assert set(POOL_KEYWORDS) <= {p.name for p in rest}
    assert {"A_log", "dt_bias", "chunk_size"} <= {p.name for p in rest}


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "chunk_kda"])
def test_positional_parameters_are_flas_installed(name):
    """The same head read from the installed fla-core (0.6.0), when it is there."""
    pytest.importorskip("fla")
    import fla.ops.gated_delta_rule.chunk as gdn
    import fla.ops.kda.chunk as kda

    theirs = inspect.signature(getattr(kda if name == "chunk_kda" else gdn, name)).parameters
    theirs = [(p.name, p.default) for p in theirs.values() if p.kind is not p.VAR_KEYWORD]
    ours = list(inspect.signature(getattr(ds, name)).parameters.values())[:len(theirs)]
    assert [(p.name, p.default) for p in ours] == theirs


# ---- data ---------------------------------------------------------------------------------------
def make(rng, lengths, kda):
    T = sum(lengths)
    d = {
        "q": rng.standard_normal((1, T, H, K)), "k": rng.standard_normal((1, T, H, K)),
        "v": rng.standard_normal((1, T, HV, V)),
        "beta": rng.standard_normal((1, T, HV)),  # logits
        "cu": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }
    if kda:  # the raw gate, the safe gate in the kernel
        d["g"] = rng.standard_normal((1, T, HV, K))
        d["A_log"] = rng.uniform(-1.0, 0.5, HV)
        d["dt_bias"] = rng.standard_normal(HV * K) * 0.3
    else:  # log decay
        d["g"] = -rng.uniform(0.0, 0.3, (1, T, HV))
    return d


def call(fn, fw, d, kda, **kw):
    f = lambda a: fw.from64(d[a])  # noqa: E731
    extra = dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=f("A_log"),
                 dt_bias=f("dt_bias")) if kda else {}
    return fn(f("q"), f("k"), f("v"), f("g"), f("beta"), use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, cu_seqlens=fw.idx(d["cu"], "int64"), **extra, **kw)


def expect(d, kda, **kw):
    extra = dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=d["A_log"],
                 dt_bias=d["dt_bias"]) if kda else {}
    return ref.recurrent(d["q"], d["k"], d["v"], d["g"], d["beta"], kda=kda, beta_is_logit=True,
                         use_qk_l2norm=True, **extra, **kw)


def fn_of(kda):
    return ds.chunk_kda if kda else ds.chunk_gated_delta_rule


def close(actual, expected, what):
    np.testing.assert_allclose(Fw("numpy").to64(actual) if isinstance(actual, np.ndarray)
                               else Fw("torch").to64(actual), expected, rtol=TOL, atol=TOL,
                               err_msg=what)


# ---- the pool: varlen, padding, has_initial_state, in place -------------------------------------
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_pool_varlen(fw, rng, kda):
    lengths = [1, 63, 64, 10, 65, 200]
    d = make(rng, lengths, kda)
    slots = 8
    pool64 = rng.standard_normal((slots, HV, V, K)) * 0.3
    idx = np.array([5, 0, 2, -1, 7, 3])  # sequence 3 padded
    has = np.array([1, 1, 0, 1, 1, 1], dtype=bool)  # sequence 2 starts from zero
    pool = fw.from64(pool64)
    has_t = torch.from_numpy(has) if fw.name == "torch" else has  # bool: converted to int32
    o, final = call(fn_of(kda), fw, d, kda, initial_state=pool, output_final_state=True,
                    state_v_first=True, initial_state_indices=fw.idx(idx), has_initial_state=has_t)
    start = pool64.copy()
    start[2] = 0.0  # has_initial_state 0: the reference starts it from zero
    eo, efinal, epool = expect(d, kda, initial_state=start, ssm_state_indices=idx,
                               cu_seqlens=d["cu"])
    close(o, eo, "output")
    close(final, efinal, "final_state")
    close(pool, epool, "pool (updated in place)")
    t0, t1 = d["cu"][3], d["cu"][4]
    assert not fw.to64(o)[0, t0:t1].any()  # the padded sequence's output is zero
    np.testing.assert_array_equal(fw.to64(pool)[[1, 4, 6]], fw.to64(fw.from64(pool64[[1, 4, 6]])))


def test_output_state_indices_and_scale_zero(fw, rng):
    d = make(rng, [65, 3], False)
    pool64 = rng.standard_normal((4, HV, V, K)) * 0.3
    pool = fw.from64(pool64)
    before = fw.to64(pool)
    o, final = call(ds.chunk_gated_delta_rule, fw, d, False, initial_state=pool, scale=0,
                    state_v_first=True, initial_state_indices=fw.idx([0, 1]),
                    output_state_indices=fw.idx([2, -1]))
    assert final is None
    eo, efinal, _ = expect(d, False, initial_state=pool64, ssm_state_indices=[0, 1],
                           cu_seqlens=d["cu"])
    close(o, eo, "output (scale=0: K^-0.5)")
    after = fw.to64(pool)
    np.testing.assert_array_equal(after[[0, 1, 3]], before[[0, 1, 3]])  # read slots untouched
    np.testing.assert_allclose(after[2], efinal[0], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_output_is_in_qs_dtype(rng, kda):
    """FLA's chunk functions return o in q's dtype (GDN `o.to(q.dtype)`, KDA `o.type_as(q)`),
    whatever v's: float32 q and k with bfloat16 v give a float32 o, the float32 call's values
    to bfloat16 v's rounding."""
    pytest.importorskip("torch")
    d = make(rng, [70], kda)
    tw = Fw("torch")
    mixed = dict(d, v=tw.to64(tw.from64(d["v"]).to(torch.bfloat16)))
    f = lambda a: torch.from_numpy(mixed[a]).float()  # noqa: E731
    extra = dict(use_gate_in_kernel=True, lower_bound=-5.0, A_log=f("A_log"),
                 dt_bias=f("dt_bias")) if kda else {}
    o, _ = fn_of(kda)(f("q"), f("k"), f("v").to(torch.bfloat16), f("g"), f("beta"),
                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      cu_seqlens=torch.from_numpy(mixed["cu"]), **extra)
    assert o.dtype == torch.float32
    eo, _, _ = expect(mixed, kda, cu_seqlens=mixed["cu"])
    close(o, eo, "output")


# ---- dense start and final states ---------------------------------------------------------------
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_dense_states(fw, rng, kda):
    d = make(rng, [65, 64], kda)
    h0 = rng.standard_normal((2, HV, V, K)) * 0.3
    h0_t = fw.from64(h0)
    o, final = call(fn_of(kda), fw, d, kda, initial_state=h0_t, output_final_state=True,
                    state_v_first=True)
    eo, efinal, _ = expect(d, kda, initial_state=h0, cu_seqlens=d["cu"])
    close(o, eo, "output")
    close(final, efinal, "final_state")
    assert str(final.dtype).endswith("float32") and tuple(final.shape) == (2, HV, V, K)
    np.testing.assert_array_equal(fw.to64(h0_t), fw.to64(fw.from64(h0)))  # only read
    # no state at all: FLA's default layout is fine, the start is zero
    o0, none = call(fn_of(kda), fw, d, kda)
    assert none is None
    close(o0, expect(d, kda, cu_seqlens=d["cu"])[0], "output from zero")


# ---- checkpoints --------------------------------------------------------------------------------
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_checkpoints(fw, rng, kda):
    lengths = [130, 64, 10]
    d = make(rng, lengths, kda)
    cs = np.array([0, 2, 3, 3])  # 130 // 64, 64 // 64, 10 // 64 checkpoints
    ck = fw.from64(np.zeros((3, HV, V, K)))
    pool64 = np.zeros((6, HV, V, K))
    pool = fw.from64(pool64)
    o, final = call(fn_of(kda), fw, d, kda, output_final_state=True, state_v_first=True,
                    checkpoint_every_n_tokens=64, checkpoint_cu_starts=fw.idx(cs),
                    state_checkpoints=ck)
    want = []
    for n, (begin, count) in enumerate([(0, 2), (130, 1)]):
        for j in range(count):
            cu = np.array([begin, begin + (j + 1) * 64])
            want.append(expect(d, kda, cu_seqlens=cu)[1][0])
    close(ck, np.stack(want), "state_checkpoints")
    close(o, expect(d, kda, cu_seqlens=d["cu"])[0], "output")
    # the same checkpoints into pool slots (one not stored)
    _, _ = call(fn_of(kda), fw, d, kda, state_v_first=True, checkpoint_every_n_tokens=64,
                checkpoint_cu_starts=fw.idx(cs), checkpoint_slot_indices=fw.idx([4, -1, 1]),
                initial_state=pool, initial_state_indices=fw.idx([0, 2, 3]),
                has_initial_state=fw.idx([0, 0, 0]))
    got = fw.to64(pool)
    np.testing.assert_allclose(got[4], want[0], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got[1], want[2], rtol=TOL, atol=TOL)
    assert not got[5].any()


# ---- FLA's host hints, chunk_size and cp_context -------------------------------------------------
@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_host_hints_and_chunk_size_give_the_same_result(rng, kda):
    """cu_seqlens_cpu / chunk_indices (GDN) / use_graph, max_num_seqs (KDA) are accepted and not
    needed; every chunk size FLA accepts gives the result of the default (64-token chunks)."""
    fw = Fw("torch")
    d = make(rng, [5, 70], kda)
    o0, _ = call(fn_of(kda), fw, d, kda)
    cu_cpu = fw.idx(d["cu"], "int64")
    hints = (dict(cu_seqlens_cpu=cu_cpu, use_graph=True, max_num_seqs=2) if kda
             else dict(cu_seqlens_cpu=cu_cpu, chunk_indices=torch.zeros(3, 2, dtype=torch.int64)))
    for size in (32, 64) if kda else (16, 32, 64):
        o, _ = call(fn_of(kda), fw, d, kda, chunk_size=size, **hints)
        assert torch.equal(o, o0), size


@pytest.mark.parametrize("kda, size, text", [
    (False, 128, r"^`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got 128\.$"),
    (False, 8, r"^`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got 8\.$"),
    (True, 16, r"^`chunk_size` must be either 32 or 64 for KDA, got 16\.$"),
    (True, 128, r"^`chunk_size` must be either 32 or 64 for KDA, got 128\.$"),
], ids=["gdn-128", "gdn-8", "kda-16", "kda-128"])
def test_chunk_size_outside_flas_set_is_flas_error(fw, rng, kda, size, text):
    with pytest.raises(ValueError, match=text):
        call(fn_of(kda), fw, make(rng, [5], kda), kda, chunk_size=size)


def test_flas_shape_and_gate_errors(fw, rng):
    """FLA's own checks of the chunk functions, their exception types and texts
    (fla-core 0.6.0: GDN's ValueErrors and A_log assert, KDA's asserts), before anything runs."""
    d = make(rng, [5], False)
    f = lambda a: fw.from64(d[a])  # noqa: E731
    q, k, v, g, beta = f("q"), f("k"), f("v"), f("g"), f("beta")
    k3 = fw.from64(d["k"][:, :, :1])
    with pytest.raises(ValueError, match=r"^q and k must have the same number of heads, but got "
                                         r"q.shape\[2\]=2 and k.shape\[2\]=1$"):
        ds.chunk_gated_delta_rule(q, k3, v, g, beta)
    v3 = fw.from64(d["v"][:, :, :3])
    with pytest.raises(ValueError, match=r"^For GVA, num_v_heads \(HV=3\) must be evenly "
                                         r"divisible by num_heads \(H=2\), but got HV % H = 1$"):
        ds.chunk_gated_delta_rule(q, k, v3, f("g")[:, :, :3], f("beta")[:, :, :3])
    with pytest.raises(AssertionError,
                       match=r"^A_log must be provided when use_gate_in_kernel=True\.$"):
        ds.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True)
    dk = make(rng, [5], True)
    f = lambda a: fw.from64(dk[a])  # noqa: E731
    q, k, v, g, beta = f("q"), f("k"), f("v"), f("g"), f("beta")
    with pytest.raises(AssertionError, match=r"^q and k must have the same shape, got q="):
        ds.chunk_kda(q, fw.from64(dk["k"][:, :4]), v, g, beta)
    with pytest.raises(AssertionError, match=r"^For GVA, num_v_heads \(HV=3\) must be evenly "
                                             r"divisible by num_qk_heads \(H=2\), but got "
                                             r"HV % H = 1$"):
        ds.chunk_kda(q, k, fw.from64(dk["v"][:, :, :3]), f("g")[:, :, :3], f("beta")[:, :, :3])
    with pytest.raises(AssertionError, match=r"^g must have shape \[B, T, HV, K\]=\[1, 5, 4, 16\], "
                                             r"got \[1, 5, 4, 8\]$"):
        ds.chunk_kda(q, k, v, f("g")[..., :8], beta)
    with pytest.raises(AssertionError, match=r"^beta must have shape \[B, T, HV\]=\[1, 5, 4\], "
                                             r"got \[1, 5, 2\]$"):
        ds.chunk_kda(q, k, v, g, f("beta")[..., :2])
    wide = np.zeros((1, 5, 2, 320))
    with pytest.raises(AssertionError,
                       match=r"^Currently we only support key headdim <=256 for KDA, got 320\.$"):
        ds.chunk_kda(fw.from64(wide), fw.from64(wide), v, fw.from64(np.zeros((1, 5, 4, 320))),
                     beta)
    with pytest.raises(ValueError, match=r"^`A_log` must be provided when `use_gate_in_kernel="
                                         r"True` and `lower_bound` is not set\.$"):
        ds.chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_cp_context_is_not_implemented(fw, rng, kda):
    class FLACPContext:
        def __repr__(self):
            return "FLACPContext()"

    name = "chunk_kda" if kda else "chunk_gated_delta_rule"
    with pytest.raises(NotImplementedError, match=(
            rf"^{name}: `cp_context`=FLACPContext\(\) \(FLA's context parallelism\) is not "
            r"implemented in deltastate; pass None$")):
        call(fn_of(kda), fw, make(rng, [5], kda), kda, cp_context=FLACPContext())


# ---- the layout rule and the workspace ----------------------------------------------------------
@pytest.mark.parametrize("kw", [{"output_final_state": True}, {"initial_state": "dense"}])
def test_k_first_is_an_error(fw, rng, kw):
    d = make(rng, [5], False)
    if kw.get("initial_state") == "dense":
        kw = {"initial_state": fw.from64(np.zeros((1, HV, K, V)))}
    with pytest.raises(NotImplementedError, match="state_v_first=True"):
        call(ds.chunk_gated_delta_rule, fw, d, False, **kw)


def test_workspace(fw, rng):
    d = make(rng, [70], True)
    from deltastate._surface import _workspace_bytes

    nbytes = _workspace_bytes(fw.from64(d["q"]), fw.from64(d["v"]), True, None)
    assert nbytes > 0
    ws = fw.from64(np.zeros(nbytes // 4 + 1), "float32")
    o, _ = call(ds.chunk_kda, fw, d, True, workspace=ws)
    o2, _ = call(ds.chunk_kda, fw, d, True)
    np.testing.assert_array_equal(fw.to64(o), fw.to64(o2))
    with pytest.raises(ValueError, match="workspace"):
        call(ds.chunk_kda, fw, d, True, workspace=fw.from64(np.zeros(4), "float32"))


# ---- torch.compile and CUDA ---------------------------------------------------------------------
def test_torch_compile(rng):
    if torch is None:
        pytest.skip("torch is not installed")
    dynamo = pytest.importorskip("torch._dynamo")
    if hasattr(dynamo, "is_dynamo_supported") and not dynamo.is_dynamo_supported():
        pytest.skip("torch.compile is not supported on this Python/torch")
    fw = Fw("torch")
    d = make(rng, [65, 3], True)
    pool = fw.from64(rng.standard_normal((3, HV, V, K)) * 0.3)
    idx = fw.idx([2, 0])

    def layer(pool):
        return call(ds.chunk_kda, fw, d, True, initial_state=pool, state_v_first=True,
                    initial_state_indices=idx, output_final_state=True)

    p_eager, p_comp = pool.clone(), pool.clone()
    o, f = layer(p_eager)
    o2, f2 = torch.compile(layer, fullgraph=True, backend="eager")(p_comp)
    assert torch.equal(o, o2) and torch.equal(f, f2) and torch.equal(p_eager, p_comp)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_cuda(rng, kda):
    if torch is None or not ds.cuda_available() or not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fw = Fw("torch", "cuda")
    d = make(rng, [1, 63, 64, 65, 200], kda)
    pool64 = rng.standard_normal((6, HV, V, K)) * 0.3
    pool = fw.from64(pool64)
    idx = np.array([0, 1, 2, -1, 4])
    try:
        o, final = call(fn_of(kda), fw, d, kda, initial_state=pool, state_v_first=True,
                        initial_state_indices=fw.idx(idx), output_final_state=True)
    except NotImplementedError as e:
        if "CUDA" not in str(e):
            raise
        pytest.skip(f"the CUDA chunked prefill is not built yet: {e}")
    eo, efinal, epool = expect(d, kda, initial_state=pool64, ssm_state_indices=idx,
                               cu_seqlens=d["cu"])
    close(o, eo, "output")
    close(final, efinal, "final_state")
    close(pool, epool, "pool")
