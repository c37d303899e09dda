"""torch integration: the ops as torch custom ops (torch.ops.deltastate.*) with fake
implementations, torch.compile(fullgraph=True) over the public functions giving the eager results
bit for bit, and the package importing and working without torch."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltastate as ds  # noqa: E402
from deltastate import torch_ops  # noqa: E402
from cases import gate_params, materialize_packed, packed_data  # noqa: E402
from helpers import Fw  # noqa: E402

H, HV, K, V, B = 2, 4, 16, 8, 3


def backend_or_skip(name):
    dynamo = pytest.importorskip("torch._dynamo")
    if hasattr(dynamo, "is_dynamo_supported") and not dynamo.is_dynamo_supported():
        pytest.skip("torch.compile is not supported on this Python/torch")
    if name not in dynamo.list_backends(exclude_tags=()):
        pytest.skip(f"torch.compile backend {name!r} is not available")


def make_inputs(rng):
    fw = Fw("torch")
    d = packed_data(rng, kda=False, B=B, H=H, HV=HV, K=K, V=V)
    x = materialize_packed(fw, d, "float32")
    A_log, dt_bias = gate_params(rng, HV, K, False)
    A_log_k, dt_bias_k = gate_params(rng, HV, K, True)
    T = 5
    # torch-allocated (64-byte aligned: recurrent_kda requires a 32-byte aligned state)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32)).clone()  # noqa: E731
    return {
        "mixed_qkv": x["mixed_qkv"], "a": x["a"], "b": x["b"],
        "A_log": t(A_log), "dt_bias": t(dt_bias),
        "pool": t(rng.standard_normal((6, HV, V, K)) * 0.5),
        "out": torch.full((B, 1, HV, V), float("nan")),
        "idx": torch.tensor([4, -1, 1], dtype=torch.int32),
        "q": t(rng.standard_normal((1, T, H, K))), "k": t(rng.standard_normal((1, T, H, K))),
        "v": t(rng.standard_normal((1, T, HV, V))), "g": t(rng.standard_normal((1, T, HV, K))),
        "beta": t(rng.standard_normal((1, T, HV))),
        "A_log_k": t(A_log_k), "dt_bias_k": t(dt_bias_k),
        "kpool": t(rng.standard_normal((5, HV, V, K)) * 0.5),
        "cu": torch.tensor([0, 2, 5], dtype=torch.int64),
        "kidx": torch.tensor([3, 0], dtype=torch.int32),
        "init": t(rng.standard_normal((2, HV, V, K)) * 0.5),
    }


def model(i, pdl=False):
    """A small "layer": GDN packed decode into a pool, KDA prefill (varlen, in-pool, gate in the
    kernel, beta logits), and a KDA call from a start state returning its final state."""
    out, pool = ds.fused_recurrent_gated_delta_rule_packed_decode(
        i["mixed_qkv"], i["a"], i["b"], i["A_log"], i["dt_bias"], K ** -0.5, i["pool"], i["out"],
        i["idx"], pdl=pdl)
    o, kpool = ds.recurrent_kda(i["q"], i["k"], i["v"], i["g"], i["beta"], A_log=i["A_log_k"],
                                dt_bias=i["dt_bias_k"], initial_state=i["kpool"],
                                use_gate_in_kernel=True, lower_bound=-5.0, cu_seqlens=i["cu"],
                                ssm_state_indices=i["kidx"], beta_is_logit=True, pdl=pdl)
    o2, final = ds.recurrent_kda(i["q"], i["k"], i["v"], -torch.sigmoid(i["g"]),
                                 torch.sigmoid(i["beta"]), initial_state=i["init"],
                                 output_final_state=True, cu_seqlens=i["cu"], pdl=pdl)
    return out.sum(dim=1) * 2.0, o + 1.0, o2, final


def model_pdl(i):
    return model(i, pdl=True)


def clone(i):
    return {k: v.clone() for k, v in i.items()}


def assert_same(eager_out, compiled_out, eager_in, compiled_in):
    for e, c in zip(eager_out, compiled_out):
        assert torch.equal(e, c)
    for name in eager_in:  # in-place updates (pools, out) identical too
        assert torch.equal(eager_in[name].nan_to_num(7.0), compiled_in[name].nan_to_num(7.0)), name


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(rng, backend):
    backend_or_skip(backend)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for _ in range(2):  # the second call reuses the graph with new inputs
        inputs = make_inputs(rng)
        e_in, c_in = clone(inputs), clone(inputs)
        e_out = model(e_in)
        c_out = compiled(c_in)
        assert_same(e_out, c_out, e_in, c_in)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_pdl_matches_eager(rng, backend):
    """pdl=True through the custom ops (traced with the rest of the graph) gives the eager
    pdl=False results bit for bit (on the CPU the flag is ignored)."""
    backend_or_skip(backend)
    torch._dynamo.reset()
    compiled = torch.compile(model_pdl, fullgraph=True, backend=backend)
    for _ in range(2):
        inputs = make_inputs(rng)
        e_in, c_in = clone(inputs), clone(inputs)
        e_out = model(e_in)
        c_out = compiled(c_in)
        assert_same(e_out, c_out, e_in, c_in)


@pytest.mark.parametrize("pdl", [False, True], ids=["nopdl", "pdl"])
def test_compile_replayssm(rng, pdl):
    """ReplaySSM under torch.compile: the checkpoint, rings, out and the advanced cursors (the
    compiled step with pdl as given, the eager one without)."""
    backend_or_skip("aot_eager")
    torch._dynamo.reset()
    L = 3
    fw = Fw("torch")
    A_log, dt_bias = (torch.from_numpy(x.astype(np.float32)) for x in gate_params(rng, HV, K, True))
    dt_bias = dt_bias.reshape(HV, K)

    def step(x, a, b, state, d_c, k_c, g_c, out, idx, wp, pdl=False):
        ds.fused_recurrent_linear_replayssm_decode(x, a, b, A_log, dt_bias, K ** -0.5, state, d_c,
                                                   k_c, g_c, out, idx, wp, None, -5.0, True, True,
                                                   nk=1, advance_write_pos=True, pdl=pdl)
        return out * 1.0

    compiled = torch.compile(lambda *args: step(*args, pdl=pdl), fullgraph=True,
                             backend="aot_eager")
    mem = {
        "state": torch.from_numpy((rng.standard_normal((4, HV, V, K)) * 0.5).astype(np.float32)),
        "d_c": torch.zeros(4, HV, L, V), "k_c": torch.zeros(4, H, L, K),
        "g_c": torch.zeros(4, HV, L, K), "wp": torch.zeros(B, dtype=torch.int32),
    }
    e_mem, c_mem = clone(mem), clone(mem)
    for _ in range(2 * L):
        d = packed_data(rng, kda=True, B=B, H=H, HV=HV, K=K, V=V)
        x = materialize_packed(fw, d, "float32")
        a = x["a"].reshape(B, HV, K)
        idx = torch.tensor([2, -1, 0], dtype=torch.int32)
        outs = []
        for m in (e_mem, c_mem):
            out = torch.full((B, 1, HV, V), float("nan"))
            fn = step if m is e_mem else compiled
            outs.append(fn(x["mixed_qkv"], a, x["b"], m["state"], m["d_c"], m["k_c"], m["g_c"],
                           out, idx, m["wp"]))
        assert torch.equal(outs[0], outs[1])
        for name in mem:
            assert torch.equal(e_mem[name], c_mem[name]), name
    assert e_mem["wp"].tolist() == [0, 0, 0]  # 2L steps with flushes at L-1: back to 0


def test_compile_fla_names(rng):
    """FLA's functions under torch.compile(fullgraph=True): the K-first start state, a new final
    state, beta=None (a broadcast view of ones) and g=None (no decay) traced with the rest."""
    backend_or_skip("aot_eager")
    torch._dynamo.reset()
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    q, k, v = t(1, 5, H, K), t(1, 5, H, K), t(1, 5, HV, V)
    g, beta, h0 = -torch.sigmoid(t(1, 5, HV, K)), torch.sigmoid(t(1, 5, HV)), t(2, HV, K, V)
    cu = torch.tensor([0, 2, 5])

    def f(q, k, v, g, beta, h0):
        o, ht = ds.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu)
        o2, ht2 = ds.fused_recurrent_gated_delta_rule(q, k, v, initial_state=h0,
                                                      output_final_state=True, cu_seqlens=cu,
                                                      use_qk_l2norm_in_kernel=True)
        return o * 1.0, ht * 1.0, o2 * 1.0, ht2 * 1.0

    eager = f(q, k, v, g, beta, h0)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, h0)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_compile_conv_commit(rng):
    """The conv windows' commit under torch.compile(fullgraph=True): SGLang's conv scatter and its
    state scatter routed to the conv commit (4-D windows), over SGLang's deduplicated scratch (an
    overlapping as_strided view), and the core op on dim-contiguous windows: eager's bits."""
    backend_or_skip("aot_eager")
    torch._dynamo.reset()
    L, C, dim, W1, R, D = 2, 6, 5, 3, 3, 4
    shared = torch.from_numpy(rng.standard_normal((L, R, dim, D + W1 - 1)).astype(np.float32))
    src = shared.as_strided((L, R, D, dim, W1),
                            (shared.stride(0), shared.stride(1), 1, shared.stride(2), 1))
    idx, steps = torch.tensor([4, 1, 0], dtype=torch.int32), torch.tensor([3, -1, 0])

    def f(a, b, c, src):
        ds.fused_conv_window_scatter_with_mask(a, src, idx, steps)
        ds.fused_mamba_state_scatter_with_mask(b, src, idx, steps)
        ds.update_conv_state_after_verify(c.transpose(2, 3), src, idx, steps + 1)
        return a * 1.0, b * 1.0, c * 1.0

    def pools():
        return (torch.full((L, C, dim, W1), 1e30), torch.full((L, C, dim, W1), 1e30),
                torch.full((L, C, W1, dim), 1e30))

    eager = f(*pools(), src)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*pools(), src)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    assert torch.equal(eager[0][:, 4], src[:, 0, 3]) and torch.equal(eager[1], eager[0])
    assert torch.equal(eager[2].transpose(2, 3), eager[0])


def test_compile_conv_verify_and_spec_recurrent_kda(rng):
    """torch.compile(fullgraph=True) over causal_conv1d_update with SGLang's speculative
    arguments (per-draft windows, an EAGLE tree, the parents it writes) and over recurrent_kda's
    speculative route (num_spec_tokens, num_accepted_tokens on verify): eager's bits."""
    backend_or_skip("aot_eager")
    torch._dynamo.reset()
    Bc, dim, T, W = 3, 10, 4, 4
    x = torch.from_numpy(rng.standard_normal((Bc, dim, T)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((dim, W)).astype(np.float32))
    win0 = torch.from_numpy(rng.standard_normal((5, dim, W - 1)).astype(np.float32))
    idx = torch.tensor([4, -1, 1], dtype=torch.int32)
    nxt = torch.tensor([[1, 3, -1, -1]] * Bc, dtype=torch.int32)
    sib = torch.tensor([[-1, 2, -1, -1]] * Bc, dtype=torch.int32)

    def conv(win, inter, parents):
        y = ds.causal_conv1d_update(x, win, w, None, "silu", None, idx, None, inter, None, nxt,
                                    sib, parents)
        return y * 1.0, win * 1.0, inter * 1.0, parents * 1

    def conv_args():
        return (win0.clone(), torch.full((Bc, T, dim, W - 1), 1e30),
                torch.zeros(Bc, T, dtype=torch.int32))

    eager = conv(*conv_args())
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")(*conv_args())
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    assert eager[3][0].tolist() == [0, 0, 0, 1]

    Ns, S = 2, 2
    Ts = 1 + S
    q = torch.from_numpy(rng.standard_normal((Ns, Ts, H, K)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((Ns, Ts, H, K)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((Ns, Ts, HV, V)).astype(np.float32))
    g = -torch.rand(Ns, Ts, HV, K)
    beta = torch.rand(Ns, Ts, HV)
    table = torch.arange(Ns * Ts, dtype=torch.int32).reshape(Ns, Ts)
    nat = torch.tensor([2, 5], dtype=torch.int32)  # 5 clamps to 1 + S
    pool0 = torch.rand(Ns * Ts, HV, V, K) * 0.1

    def spec(pool):
        o, _ = ds.recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool,
                                ssm_state_indices=table, num_spec_tokens=S,
                                num_accepted_tokens=nat)
        return o * 1.0, pool * 1.0

    eager = spec(pool0.clone())
    compiled = torch.compile(spec, fullgraph=True, backend="aot_eager")(pool0.clone())
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_custom_ops_opcheck(rng):
    """torch.library.opcheck: schemas (mutation annotations), fake tensors, AOT dispatch."""
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    i = make_inputs(rng)
    o = torch.empty_like(i["v"])
    fs = torch.empty(2, HV, V, K)
    d = packed_data(rng, kda=True, B=B, H=H, HV=HV, K=K, V=V)
    xk = materialize_packed(Fw("torch"), d, "float32")
    cases = [
        (torch.ops.deltastate.gdn_packed_decode.default,
         (i["mixed_qkv"], i["a"], i["b"], i["A_log"], i["dt_bias"], 0.25, i["pool"], i["out"],
          i["idx"])),
        (torch.ops.deltastate.kda_packed_decode.default,
         (xk["mixed_qkv"], xk["a"], xk["b"], i["A_log_k"], i["dt_bias_k"], 0.25, i["pool"],
          i["out"], i["idx"], True, -5.0)),
        (torch.ops.deltastate.recurrent_kda.default,
         (i["q"], i["k"], i["v"], i["g"], i["beta"], o, i["A_log_k"], i["dt_bias_k"], True, None,
          True, False, None, None, i["kpool"], i["kidx"], i["cu"], None, True, True, True)),
        (torch.ops.deltastate.recurrent_gated_delta_rule.default,
         (i["q"], i["k"], i["v"], -torch.rand(1, 5, HV), torch.rand(1, 5, HV), o, None, None,
          False, None, False, False, 0.3, i["init"], None, None, i["cu"], fs, True, True, True)),
        (torch.ops.deltastate.fla_kda.default,  # K-first read-only start state, K-first final
         (i["q"], i["k"], i["v"], -torch.rand(1, 5, HV, K), torch.rand(1, 5, HV), o, None, None,
          False, None, False, False, None, torch.rand(2, HV, K, V), None, None, i["cu"],
          torch.empty(2, HV, K, V), False, False, False)),
        (torch.ops.deltastate.replayssm_decode.default,
         (xk["mixed_qkv"], xk["a"], xk["b"], i["A_log_k"], i["dt_bias_k"], 0.25, i["pool"],
          torch.zeros(6, HV, 2, V), torch.zeros(6, H, 2, K), torch.zeros(6, HV, 2, K), i["out"],
          i["idx"], torch.zeros(B, dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32),
          None, True, True, False, True)),
        (torch.ops.deltastate.helion_kda_replayssm_decode.default,
         (xk["mixed_qkv"], xk["a"], xk["b"], i["A_log_k"], i["dt_bias_k"], 0.25, i["pool"],
          torch.zeros(6, HV, 2, V), torch.zeros(6, H, 2, K), torch.zeros(6, HV, 2, K), i["out"],
          i["idx"], torch.zeros(B, dtype=torch.int32), None, -5.0, True)),
        (torch.ops.deltastate.update_conv_state_after_verify.default,
         (torch.zeros(2, 6, 5, 3).transpose(2, 3), torch.rand(2, 3, 4, 3, 5), i["idx"],
          torch.tensor([2, 0, 4]))),
        (torch.ops.deltastate.causal_conv1d_update.default,  # per-draft windows of a tree
         (torch.rand(3, 8, 4), torch.rand(5, 8, 3), torch.rand(8, 4), torch.empty(3, 8, 4), None,
          True, None, i["idx"], None, torch.zeros(3, 4, 8, 3), None,
          torch.tensor([[1, 3, -1, -1]] * 3, dtype=torch.int32),
          torch.tensor([[-1, 2, -1, -1]] * 3, dtype=torch.int32),
          torch.zeros(3, 4, dtype=torch.int32))),
        (torch.ops.deltastate.sglang_conv_window_scatter.default,
         (torch.zeros(2, 6, 5, 3), torch.rand(2, 3, 4, 5, 3), i["idx"], torch.tensor([1, 0, 3]))),
    ]
    for op, args in cases:
        for kwargs in ({}, {"pdl": True}):
            result = torch.library.opcheck(op, args, kwargs)
            assert all(v == "SUCCESS" for v in result.values()), (op, kwargs, result)


def test_custom_op_registration():
    for name in torch_ops.SCHEMAS:
        op = getattr(torch.ops.deltastate, name).default
        mutated = [a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write]
        assert mutated, name
    assert [a.name for a in torch.ops.deltastate.gdn_packed_decode.default._schema.arguments
            if a.alias_info and a.alias_info.is_write] == ["initial_state", "out", "state_scales",
                                                            "rounding_step"]
    # Every op takes `pdl` last, a bool defaulting to False (the public functions' keyword).
    for name in torch_ops.SCHEMAS:
        last = getattr(torch.ops.deltastate, name).default._schema.arguments[-1]
        assert (last.name, str(last.type), last.default_value) == ("pdl", "bool", False), name
    # Eager calls take the direct path; the custom op only while compiling.
    assert ds.ops._is_compiling is torch.compiler.is_compiling
    assert ds.ops._is_compiling() is False


def test_package_imports_and_runs_without_torch():
    """With torch unimportable the package still imports and the numpy path works."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # make `import torch` fail
        import numpy as np
        import deltastate as ds
        assert "deltastate.torch_ops" not in sys.modules
        assert ds.ops._is_compiling() is False
        B, H, HV, K, V = 2, 1, 2, 8, 8
        x = np.random.default_rng(0).standard_normal((B, 2 * H * K + HV * V)).astype(np.float32)
        ab = np.zeros((B, HV), np.float32)
        st = np.zeros((3, HV, V, K), np.float32)
        out = np.full((B, 1, HV, V), np.nan, np.float32)
        ds.fused_recurrent_gated_delta_rule_packed_decode(
            x, ab, ab, np.zeros(HV, np.float32), np.zeros(HV, np.float32), 0.3, st, out,
            np.array([2, -1], np.int32))
        assert np.isfinite(out).all() and (out[1] == 0).all() and st[2].any()
        pool = ds.StatePool(1, 2, HV, V, K, framework="numpy")
        assert pool.allocate() == 0
        print("ok")
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
