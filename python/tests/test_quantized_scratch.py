"""A quantized verify scratch (issue #36): speculative verify on a quantized pool with
`intermediate_states` in float8_e4m3fn / int8 and its fp32 `intermediate_state_scales`, then the
state commit from it, on the CPU backend.

Each entry must be the pool's rule applied to the state after its token (tools/state_accuracy.py's
emulation, bit for bit: fresh per-row scales, the pool's rounding, the stochastic key (seed,
2^64 - 1 - (row * T_alloc + step), layer, step)); a tree token whose parent is not the previous
token starts from the parent's entry dequantized. The reference runs the tokens one at a time on
an fp32 pool: each token from the state the rule says (the start slot dequantized, the previous
token's fp32 state, or the op's own parent entry dequantized), so outputs and entries are checked
bit for bit. The commit copies an entry of the pool's dtype (codes and scales) and requantizes one
of the other dtype (the emulation, the slot's key). Unused rows and steps keep their sentinels,
the pool is untouched by a verify without write-back, the step counters advance once per call.
The contract's errors: python/tests/test_errors.py."""

import numpy as np
import pytest

import deltastate as ds
from helpers import bits, poison, to64, torch
from test_state_format import (FORMATS, SENTINEL_CODE, SENTINEL_SCALE, codes_of, dequantize,
                               emulate, fill_sentinels, fw_assign, sa, state_bits, write_slot)

SCRATCH = [pytest.param("float8_e4m3fn", id="scratch-fp8"), pytest.param("int8", id="scratch-int8")]


def quantized_scratch(fw, shape, dtype):
    """(codes, scales) of a quantized scratch [.., HV, V, K] / [.., HV, V], sentinel-filled."""
    if fw.name == "torch":
        codes = torch.full(shape, SENTINEL_CODE, dtype=torch.uint8)
        codes = codes.view(torch.float8_e4m3fn if dtype == "float8_e4m3fn" else torch.int8)
    else:
        codes = np.full(shape, SENTINEL_CODE, np.uint8)
        if dtype == "int8":
            codes = codes.view(np.int8)
    return codes, fw.full(shape[:-1], float(SENTINEL_SCALE), "float32")


def scratch_key(seed, row, step, t_alloc, layer, call_step):
    """The stochastic key of scratch entry (row, step): its slot field 2^64 - 1 - entry."""
    return sa.sr_key(seed, (1 << 64) - 1 - (row * t_alloc + step), layer, call_step)


@pytest.mark.parametrize("scratch_dtype", SCRATCH)
@pytest.mark.parametrize("dtype,rounding", FORMATS)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_verify_tree_and_commit_with_a_quantized_scratch(fw, rng, kda, dtype, rounding,
                                                         scratch_dtype):
    H, HV, K, V, layers, slots, seed = 1, 2, 16, 8, 2, 7, 5
    N, T, R, TA = 3, 4, 3, 5  # sequences, tokens, scratch rows, allocated steps
    pool = ds.StatePool(layers=layers, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, framework=fw.name)
    stochastic = pool.stochastic
    for layer in range(layers):
        fill_sentinels(pool, layer)
        for s in (4, 1):
            codes, sc = emulate((rng.standard_normal((HV, V, K)) * 0.5).astype(np.float32),
                                dtype, False)
            write_slot(pool, layer, s, codes, sc)
    codes, scales = quantized_scratch(fw, (layers, R, TA, HV, V, K), scratch_dtype)
    indices = [4, -1, 1]
    rows = [2, 0, 1]  # the padded sequence's row 0 stays untouched
    # token t > 0 starts from the state after parents[n, t]: the previous token (registers), the
    # initial state (< 0) or an earlier entry (reloaded dequantized)
    parents = np.array([[0, 0, -1, 1], [0, 0, 1, 2], [0, 0, 1, 1]])
    gshape = (N, T, HV, K) if kda else (N, T, HV)
    f = lambda x: fw.from64(x, "float32")  # noqa: E731
    pool_before = [state_bits(pool, layer) for layer in range(layers)]
    for layer in range(layers):
        q, k = rng.standard_normal((N, T, H, K)), rng.standard_normal((N, T, H, K))
        v, beta = rng.standard_normal((N, T, HV, V)), rng.uniform(0.05, 0.95, (N, T, HV))
        g = -rng.uniform(0.0, 0.3, gshape)
        out = poison(fw, (N, T, HV, V), "float32")
        step0 = int(to64(pool.rounding_step(layer))[0]) if stochastic else 0
        ds.verify(f(q), f(k), f(v), f(g), f(beta), out, pool.layer_state(layer),
                  fw.idx(indices), is_kda=kda, use_gate_in_kernel=False, beta_is_logit=False,
                  update_state=False, intermediate_states=codes[layer],
                  intermediate_state_indices=fw.idx(rows), parent_tokens=fw.idx(parents),
                  intermediate_state_scales=scales[layer], **pool.state_format(layer))
        if stochastic:
            assert int(to64(pool.rounding_step(layer))[0]) == step0 + 1
        c_all, s_all = codes_of(codes[layer]), bits(scales[layer]).view(np.float32)
        c0, sc0 = state_bits(pool, layer)
        start32 = dequantize(c0, sc0.view(np.float32), dtype)
        # the reference, token by token on the fp32 twin (slot n's state: sequence n's)
        prev = {}
        for t in range(T):
            for n, slot in enumerate(indices):
                if slot < 0:
                    continue
                p = parents[n, t]
                if t == 0 or p < 0:
                    s32 = start32[slot]
                elif p == t - 1:
                    s32 = prev[n]
                else:
                    s32 = dequantize(c_all[rows[n], p], s_all[rows[n], p], scratch_dtype)
                fw_assign(fw, twin.layer_state(0)[slot], s32)
            o1 = poison(fw, (N, 1, HV, V), "float32")
            ds.verify(f(q[:, t:t + 1]), f(k[:, t:t + 1]), f(v[:, t:t + 1]), f(g[:, t:t + 1]),
                      f(beta[:, t:t + 1]), o1, twin.layer_state(0), fw.idx(indices), is_kda=kda,
                      use_gate_in_kernel=False, beta_is_logit=False)
            np.testing.assert_array_equal(bits(out)[:, t], bits(o1)[:, 0],
                                          err_msg=f"layer {layer} token {t}")
            after = to64(twin.layer_state(0)).astype(np.float32)
            for n, slot in enumerate(indices):
                if slot < 0:
                    continue
                prev[n] = after[slot]
                key = (scratch_key(seed, rows[n], t, TA, layer, step0) if stochastic else None)
                want_c, want_s = emulate(after[slot], scratch_dtype, stochastic, key)
                np.testing.assert_array_equal(c_all[rows[n], t], want_c,
                                              err_msg=f"entry ({rows[n]}, {t})")
                np.testing.assert_array_equal(s_all[rows[n], t].view(np.uint32),
                                              want_s.view(np.uint32))
        assert np.all(c_all[0] == SENTINEL_CODE)  # the padded sequence's row
        assert np.all(c_all[:, T:] == SENTINEL_CODE)  # steps past T
        assert np.all(s_all[0] == SENTINEL_SCALE) and np.all(s_all[:, T:] == SENTINEL_SCALE)
        c1, s1 = state_bits(pool, layer)  # no write-back: the pool as it was
        np.testing.assert_array_equal(c1, pool_before[layer][0])
        np.testing.assert_array_equal(s1, pool_before[layer][1])

    # the commit of every layer: request 0 accepted 3 tokens (row 2, step 2) into slot 4,
    # request 1 is padded, request 2 accepted 4 (row 1, step 3) into the fresh slot 6
    steps0 = to64(pool.rounding_steps()).copy() if stochastic else None
    before = [state_bits(pool, layer) for layer in range(layers)]
    ds.update_state_after_verify(pool.states(), codes, fw.idx([4, -1, 6]), fw.idx([3, 1, 4]),
                                 fw.idx(rows), intermediate_state_scales=scales,
                                 **pool.state_format())
    for layer in range(layers):
        c1, s1 = state_bits(pool, layer)
        c_all, s_all = codes_of(codes[layer]), bits(scales[layer]).view(np.float32)
        for slot, row, step in ((4, 2, 2), (6, 1, 3)):
            if scratch_dtype == dtype:  # copied: codes and scales
                want_c, want_s = c_all[row, step], s_all[row, step]
            else:  # dequantized, requantized with the slot's key
                key = sa.sr_key(seed, slot, layer, int(steps0[layer])) if stochastic else None
                want_c, want_s = emulate(dequantize(c_all[row, step], s_all[row, step],
                                                    scratch_dtype), dtype, stochastic, key)
            np.testing.assert_array_equal(c1[slot], want_c, err_msg=f"layer {layer} slot {slot}")
            np.testing.assert_array_equal(s1[slot], want_s.view(np.uint32))
        for s in (0, 1, 2, 3, 5):
            np.testing.assert_array_equal(c1[s], before[layer][0][s])
            np.testing.assert_array_equal(s1[s], before[layer][1][s])
    if stochastic:
        np.testing.assert_array_equal(to64(pool.rounding_steps()), steps0 + 1)


@pytest.mark.parametrize("dtype,rounding", FORMATS)
def test_quantized_scratch_by_batch_row_with_write_back(fw, rng, dtype, rounding):
    """FlashInfer's convention with a quantized scratch of the pool's dtype: the scratch indexed
    by batch row, a chain, the final state written back in place. Outputs against an fp32 pool
    with an fp32 scratch bit for bit; each entry and each final slot the emulation's rounding of
    the fp32 state (an entry's key or the slot's); to nearest, the last entry and the final
    slot hold the same codes (one rule, one state)."""
    H, HV, K, V, slots, seed, N, T = 1, 2, 16, 8, 5, 9, 2, 3
    pool = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, state_dtype=dtype,
                        state_rounding=rounding, rounding_seed=seed, framework=fw.name)
    twin = ds.StatePool(layers=1, slots=slots, HV=HV, V=V, K=K, framework=fw.name)
    fill_sentinels(pool, 0)
    for s in (0, 3):
        c, sc = emulate((rng.standard_normal((HV, V, K)) * 0.5).astype(np.float32), dtype, False)
        write_slot(pool, 0, s, c, sc)
    c0, sc0 = state_bits(pool, 0)
    for s in (0, 3):
        fw_assign(fw, twin.layer_state(0)[s], dequantize(c0, sc0.view(np.float32), dtype)[s])
    f = lambda x: fw.from64(x, "float32")  # noqa: E731
    q, k = f(rng.standard_normal((N, T, H, K))), f(rng.standard_normal((N, T, H, K)))
    v, beta = f(rng.standard_normal((N, T, HV, V))), f(rng.uniform(0.05, 0.95, (N, T, HV)))
    g = f(-rng.uniform(0.0, 0.3, (N, T, HV)))
    codes, scales = quantized_scratch(fw, (N, T, HV, V, K), dtype)
    fscratch = fw.full((N, T, HV, V, K), 7.0, "float32")
    outs = []
    for p, kw in ((pool, dict(pool.state_format(0), intermediate_states=codes,
                              intermediate_state_scales=scales)),
                  (twin, dict(intermediate_states=fscratch))):
        out = poison(fw, (N, T, HV, V), "float32")
        ds.verify(q, k, v, g, beta, out, p.layer_state(0), fw.idx([3, 0]),
                  use_gate_in_kernel=False, beta_is_logit=False, **kw)
        outs.append(bits(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    want32 = to64(fscratch).astype(np.float32)
    c_all, s_all = codes_of(codes), bits(scales).view(np.float32)
    stochastic = pool.stochastic
    for n in range(N):
        for t in range(T):
            key = scratch_key(seed, n, t, T, 0, 0) if stochastic else None
            want_c, want_s = emulate(want32[n, t], dtype, stochastic, key)
            np.testing.assert_array_equal(c_all[n, t], want_c)
            np.testing.assert_array_equal(s_all[n, t], want_s)
    c1, s1 = state_bits(pool, 0)
    for n, slot in enumerate((3, 0)):  # the final state, stored with the slot's key
        key = sa.sr_key(seed, slot, 0, 0) if stochastic else None
        want_c, want_s = emulate(want32[n, T - 1], dtype, stochastic, key)
        np.testing.assert_array_equal(c1[slot], want_c)
        np.testing.assert_array_equal(s1[slot], want_s.view(np.uint32))
        if not stochastic:  # one rule, one state: the entry and the slot agree
            np.testing.assert_array_equal(c1[slot], c_all[n, T - 1])
    for s in (1, 2, 4):
        assert np.all(c1[s] == SENTINEL_CODE)
        assert np.all(s1[s] == SENTINEL_SCALE.view(np.uint32))
