"""StatePool (the layout of SGLang's MambaPool): slot allocation, fork rules, envelope views as
framework tensors updated in place by the ops, ReplaySSM rings and cursors, and the sizing
helpers, for numpy and torch."""

import numpy as np
import pytest

import deltastate as ds
import reference as ref
from cases import gate_params, materialize_packed, packed_data
from helpers import TOL_OUT, TOL_STATE, Fw, assert_close, bits, poison, to64, torch

FRAMEWORKS = ["numpy"] + (["torch"] if torch is not None else [])


def new_pool(framework, **kw):
    cfg = dict(layers=3, slots=5, HV=2, V=8, K=16)
    cfg.update(kw)
    return ds.StatePool(framework=framework, **cfg)


def fill(pool, layer, slot, value):
    v = pool.layer_state(layer)
    if isinstance(value, np.ndarray) and pool.framework == "torch":
        value = torch.from_numpy(value)
    v[slot] = value


@pytest.fixture(params=FRAMEWORKS)
def framework(request):
    return request.param


def test_allocate_free_exhaustion(framework):
    pool = new_pool(framework, slots=4)
    assert pool.num_free == 4
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]  # the lowest free slot first
    assert pool.num_free == 0 and all(pool.is_allocated(s) for s in range(4))
    with pytest.raises(ValueError) as e:
        pool.allocate()
    # No C++ API in the text (it names the method both languages have).
    assert str(e.value) == ("StatePool exhausted: all 4 slots are in use (free a slot, or size the "
                            "pool for a memory budget with slots_for_budget)")
    assert "::" not in str(e.value)
    pool.free(2)
    assert not pool.is_allocated(2) and pool.num_free == 1
    with pytest.raises(ValueError) as e:
        pool.free(2)
    assert str(e.value) == "StatePool.free: slot 2 is not allocated (double free?)"
    with pytest.raises(ValueError) as e:
        pool.free(7)
    assert str(e.value) == "StatePool.free: slot 7 is out of range for a pool of 4 slots"
    assert not pool.is_allocated(-1) and not pool.is_allocated(99)
    assert pool.allocate() == 2


@pytest.mark.parametrize("layout", ["per_layer", "envelope"])
def test_allocate_clears_every_layer_and_the_cursor(framework, layout):
    pool = new_pool(framework, layout=layout, replay_len=2, H=1)
    s = pool.allocate()
    other = pool.allocate()
    for layer in range(3):
        fill(pool, layer, s, 3.0)
        fill(pool, layer, other, 5.0)
    pool.set_cursor(s, 1)
    pool.free(s)
    assert pool.allocate(clear=False) == s  # keeps the data, resets the cursor
    assert pool.cursor(s) == 0
    assert all((to64(pool.layer_state(layer)[s]) == 3.0).all() for layer in range(3))
    pool.set_cursor(s, 1)
    pool.free(s)
    assert pool.allocate() == s
    assert pool.cursor(s) == 0
    for layer in range(3):
        assert (to64(pool.layer_state(layer)[s]) == 0).all()
        assert (to64(pool.layer_state(layer)[other]) == 5.0).all()  # neighbours untouched


@pytest.mark.parametrize("layout", ["per_layer", "envelope"])
def test_fork_rules(framework, layout, rng):
    L = 3
    pool = new_pool(framework, layout=layout, replay_len=L, H=1, envelope_extra_bytes=40
                    if layout == "envelope" else 0)
    src, dst, bystander = pool.allocate(), pool.allocate(), pool.allocate()
    for layer in range(3):
        fill(pool, layer, src, rng.standard_normal((2, 8, 16)).astype(np.float32))
        fill(pool, layer, dst, 9.0)
        fill(pool, layer, bystander, 7.0)
        pool.d_cache(layer)[src] = 1.0
        pool.d_cache(layer)[dst] = 2.0
    pool.set_cursor(dst, 2)

    # A source whose records cannot be read is refused; nothing changes. (A source with pending
    # records is materialized: test_pool_fork_replay.py.)
    before = bits(pool.storage)
    pool.set_cursor(src, 2)
    with pytest.raises(ValueError) as e:
        pool.fork(src, dst, cache_base=L)
    assert str(e.value) == f"StatePool.fork: cache_base={L} is outside the ring [0, L-1={L - 1}]"
    pool.set_cursor(src, L)
    with pytest.raises(ValueError) as e:
        pool.fork(src, dst)
    assert str(e.value) == (f"StatePool.fork: the cursor of src {src} is {L}, outside the ring "
                            f"[0, L-1={L - 1}]")
    pool.set_cursor(src, 0)
    pool.set_cursor(dst, 2)
    np.testing.assert_array_equal(bits(pool.storage), before)
    bare = new_pool(framework, layout=layout)  # no rings: SGLang's copy_from rule
    a, b = bare.allocate(), bare.allocate()
    bare.set_cursor(a, 2)
    with pytest.raises(ValueError) as e:
        bare.fork(a, b)
    assert str(e.value) == ("copy_from requires a fully-flushed ReplaySSM source (write_pos==0), "
                            f"got 2 for src {a}")

    pool.set_cursor(src, 0)
    pool.fork(src, dst)
    assert pool.cursor(dst) == 0  # the destination's cursor is reset
    for layer in range(3):
        np.testing.assert_array_equal(bits(pool.layer_state(layer)[dst]),
                                      bits(pool.layer_state(layer)[src]))
        assert (to64(pool.layer_state(layer)[bystander]) == 7.0).all()
        assert (to64(pool.d_cache(layer)[dst]) == 2.0).all()  # rings are not copied

    free_slot = pool.allocate()
    pool.free(free_slot)
    for a, b, msg in [
        (src, free_slot, f"StatePool.fork: both slots must be allocated (src {src} is allocated, "
                         f"dst {free_slot} is free)"),
        (src, src, f"StatePool.fork: src and dst are the same slot {src}"),
        (src, 99, "StatePool.fork: slot 99 is out of range for a pool of 5 slots"),
    ]:
        with pytest.raises(ValueError) as e:
            pool.fork(a, b)
        assert str(e.value) == msg


def test_envelope_views(framework):
    HV, V, K, layers, extra = 2, 8, 16, 3, 100
    pool = new_pool(framework, layout="envelope", envelope_extra_bytes=extra, layers=layers)
    itemsize = 4
    views = [pool.layer_state(layer) for layer in range(layers)]
    for layer, v in enumerate(views):
        assert tuple(v.shape) == (5, HV, V, K)
        strides = v.strides if framework == "numpy" else tuple(s * itemsize for s in v.stride())
        assert strides[1:] == (V * K * itemsize, K * itemsize, itemsize)  # compact inner dims
        assert strides[0] > HV * V * K * itemsize  # slot stride: the whole entry
        assert strides[0] % 256 == 0 and strides[0] >= 256 + layers * HV * V * K * itemsize
        assert strides[0] == (views[0].strides[0] if framework == "numpy"
                              else views[0].stride(0) * itemsize)
    # The views alias the storage: a write through layer 1, slot 2 lands at entry 2, after the
    # extra bytes (rounded up to 256) and layer 0's state.
    views[1][2, 1, 3, 5] = 42.0
    entry = (views[0].strides[0] if framework == "numpy" else views[0].stride(0) * itemsize)
    off = 2 * entry + 256 + HV * V * K * itemsize + (1 * V * K + 3 * K + 5) * itemsize
    raw = bytes(bits(pool.storage).astype(np.uint8))
    assert np.frombuffer(raw[off:off + 4], dtype=np.float32)[0] == 42.0
    # The same view is handed out again, and a fresh one sees the write.
    assert pool.layer_state(1) is views[1]
    assert to64(pool.layer_state(1))[2, 1, 3, 5] == 42.0


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("layout", ["per_layer", "envelope"])
def test_ops_update_pool_views_in_place(framework, rng, kda, layout):
    """Packed decode and recurrent on a pool's layer view: results match the reference, visible
    through the pool, and every other byte of the pool (other layers, other slots, the envelope's
    extra bytes) is untouched."""
    fw = Fw(framework)
    H, HV, V, K = 1, 2, 8, 16
    pool = new_pool(framework, layout=layout, envelope_extra_bytes=64 if layout == "envelope" else 0)
    slots = [pool.allocate() for _ in range(4)]
    for layer in range(3):
        for s in slots:
            fill(pool, layer, s, (rng.standard_normal((HV, V, K)) * 0.5).astype(np.float32))
    view = pool.layer_state(1)
    start = to64(view)
    before = bits(pool.storage)
    indices = [slots[2], -1, slots[0]]
    d = packed_data(rng, kda=kda, B=3, H=H, HV=HV, K=K, V=V)
    x = materialize_packed(fw, d, "float32")
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    out = poison(fw, (3, 1, HV, V), "float32")
    op = (ds.fused_recurrent_kda_packed_decode if kda
          else ds.fused_recurrent_gated_delta_rule_packed_decode)
    op(x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log), fw.from64(dt_bias), K ** -0.5, view, out,
       fw.idx(indices), True)
    want_out, want = ref.packed_decode(to64(x["mixed_qkv"]), to64(x["a"]), to64(x["b"]), A_log,
                                       dt_bias, K ** -0.5, start, indices, kda=kda)
    assert_close(to64(out), want_out, TOL_OUT, "float32", "out")
    got = to64(pool.layer_state(1))
    for s in (slots[2], slots[0]):
        assert_close(got[s], want[s], TOL_STATE["float32"], "float32", f"state[{s}]")
    # Only the two slots' layer-1 states changed.
    changed = np.zeros(pool.nbytes, dtype=bool)
    after = bits(pool.storage)
    diff = np.flatnonzero(after != before)
    base = (view.ctypes.data if framework == "numpy" else view.data_ptr()) - \
        (pool.storage.ctypes.data if framework == "numpy" else pool.storage.data_ptr())
    slot_stride = view.strides[0] if framework == "numpy" else view.stride(0) * 4
    for s in (slots[2], slots[0]):
        lo = base + s * slot_stride
        changed[lo:lo + HV * V * K * 4] = True
    assert changed[diff].all(), "the op wrote outside the indexed slots of its layer"

    # recurrent on layer 2 through the pool (the pool meets recurrent_kda's stride contract).
    rop = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    q = fw.from64(rng.standard_normal((2, 3, H, K)))
    k = fw.from64(rng.standard_normal((2, 3, H, K)))
    v = fw.from64(rng.standard_normal((2, 3, HV, V)))
    g = fw.from64(-rng.uniform(0.05, 1, (2, 3, HV, K) if kda else (2, 3, HV)))
    beta = fw.from64(rng.uniform(0.1, 0.9, (2, 3, HV)))
    start = to64(pool.layer_state(2))
    layer0 = bits(pool.layer_state(0))
    o, ret = rop(q, k, v, g, beta, initial_state=pool.layer_state(2),
                 ssm_state_indices=fw.idx([slots[3], slots[1]]))
    assert ret is None  # FlashInfer's rule: output_final_state=False
    want_o, _, want_pool = ref.recurrent(to64(q), to64(k), to64(v), to64(g), to64(beta), kda=kda,
                                         initial_state=start,
                                         ssm_state_indices=[slots[3], slots[1]])
    assert_close(to64(o), want_o, TOL_OUT, "float32", "o")
    for s in (slots[3], slots[1]):
        assert_close(to64(pool.layer_state(2))[s], want_pool[s], TOL_STATE["float32"], "float32",
                     f"layer 2 state[{s}]")
    np.testing.assert_array_equal(bits(pool.layer_state(0)), layer0)  # other layers untouched


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_replayssm_through_pool_rings(framework, rng, kda):
    """ReplaySSM over a pool's checkpoint views and rings for every layer of a forward, with the
    per-slot cursors gathered per row, advanced once per forward (by the last layer's call) and
    scattered back, as a serving engine does (SGLang's caller protocol for ReplaySSM cursors)."""
    fw = Fw(framework)
    H, HV, V, K, L, layers = 1, 2, 8, 16, 3, 2
    k_dtype = "float32"
    pool = ds.StatePool(layers=layers, slots=4, HV=HV, V=V, K=K, layout="envelope",
                        replay_len=L, H=H, kda=kda, ring_k_dtype=k_dtype, framework=framework)
    slots = [pool.allocate() for _ in range(3)]
    for layer in range(layers):
        for s in slots:
            fill(pool, layer, s, (rng.standard_normal((HV, V, K)) * 0.5).astype(np.float32))
    assert tuple(pool.d_cache(0).shape) == (4, HV, L, V)
    assert tuple(pool.k_cache(0).shape) == (4, H, L, K)
    assert tuple(pool.g_cache(0).shape) == ((4, HV, L, K) if kda else (4, HV, L))
    assert tuple(pool.write_pos().shape) == (4,) and "int32" in str(pool.write_pos().dtype)
    params = [gate_params(rng, HV, K, kda) for _ in range(layers)]
    mems = [ref.ReplayMemory(to64(pool.layer_state(l)), to64(pool.d_cache(l)), to64(pool.k_cache(l)),
                             to64(pool.g_cache(l)), state_dtype="float32", d_dtype="float32",
                             k_dtype=k_dtype) for l in range(layers)]
    rows = np.array([slots[2], slots[0], -1])
    cursors = pool.write_pos()
    for step in range(2 * L + 1):
        wp_rows = fw.idx([int(to64(cursors)[s]) if s >= 0 else 0 for s in rows])
        snapshot_wp = to64(wp_rows)
        for layer in range(layers):
            d = packed_data(rng, kda=kda, B=3, H=H, HV=HV, K=K, V=V)
            x = materialize_packed(fw, d, "float32")
            out = poison(fw, (3, 1, HV, V), "float32")
            A_log, dt_bias = params[layer]
            last = layer == layers - 1
            ds.fused_recurrent_linear_replayssm_decode(
                x["mixed_qkv"], x["a"], x["b"], fw.from64(A_log), fw.from64(dt_bias), K ** -0.5,
                pool.layer_state(layer), pool.d_cache(layer), pool.k_cache(layer),
                pool.g_cache(layer), out, fw.idx(rows), wp_rows, None, is_kda=kda,
                use_qk_l2norm_in_kernel=True, advance_write_pos=last)
            want, _, new_wp = ref.replayssm_decode(
                mems[layer], to64(x["mixed_qkv"]), to64(x["a"]), to64(x["b"]), A_log, dt_bias,
                K ** -0.5, rows, snapshot_wp, None, kda=kda, b_dtype="float32")
            assert_close(to64(out), want, (5e-4, 1e-2) if kda else (1e-4, 1e-3), "float32",
                         f"layer {layer} out, step {step}")
        np.testing.assert_array_equal(to64(wp_rows)[rows >= 0], new_wp[rows >= 0])
        for n, s in enumerate(rows):  # scatter the advanced cursors back to the pool
            if s >= 0:
                pool.set_cursor(int(s), int(to64(wp_rows)[n]))
    assert pool.cursor(slots[2]) == (2 * L + 1) % L


def test_cursor_views(framework):
    pool = new_pool(framework, replay_len=4, H=2, layers=1, slots=3, HV=2)
    wp = pool.write_pos()
    pool.set_cursor(1, 3)
    assert int(to64(wp)[1]) == 3
    wp[2] = 2
    assert pool.cursor(2) == 2
    with pytest.raises(ValueError) as e:
        pool.cursor(3)
    assert str(e.value) == "StatePool.cursor: slot 3 is out of range for a pool of 3 slots"


@pytest.mark.parametrize("layout", ["per_layer", "envelope"])
@pytest.mark.parametrize("replay_len", [0, 4])
def test_bytes_per_slot_and_slots_for_budget(layout, replay_len):
    cfg = dict(layers=4, HV=4, V=16, K=32, layout=layout, replay_len=replay_len, H=2,
               state_dtype="bfloat16", ring_k_dtype="float16",
               envelope_extra_bytes=300 if layout == "envelope" else 0)
    per = ds.StatePool.bytes_per_slot(**cfg)
    state = 4 * 4 * 16 * 32 * 2
    rings = 4 * (4 * replay_len * 16 * 2 + 2 * replay_len * 32 * 2 + 4 * replay_len * 4)
    if layout == "per_layer":
        assert per == state + rings + 4
    else:  # the envelope entry holds the extra bytes too, padded to 256
        assert per >= state + 300 + rings + 4 and (per - rings - 4) % 256 == 0
    for budget in (10_000, 123_457, 1_000_000):
        n = ds.StatePool.slots_for_budget(budget, **cfg)
        if n == 0:
            assert ds.StatePool(slots=1, framework="numpy", **cfg).nbytes > budget
            continue
        assert ds.StatePool(slots=n, framework="numpy", **cfg).nbytes <= budget
        assert ds.StatePool(slots=n + 1, framework="numpy", **cfg).nbytes > budget
        assert n <= budget // per


def test_pool_config_errors(framework):
    with pytest.raises(ValueError, match="layout must be 'per_layer' or 'envelope'"):
        new_pool(framework, layout="paged")
    with pytest.raises(ValueError, match="framework must be 'torch' or 'numpy'"):
        ds.StatePool(1, 1, 1, 1, 1, framework="jax")
    with pytest.raises(ValueError) as e:
        new_pool(framework, state_dtype="float64")
    assert str(e.value) == ("StatePool state_dtype must be float32, bfloat16, float16, "
                            "float8_e4m3fn or int8; got float64")
    with pytest.raises(ValueError) as e:
        new_pool(framework, conv_dim=8, conv_dtype="int8")
    assert str(e.value) == "StatePool dtypes must be float32, bfloat16 or float16; got int8"
    with pytest.raises(ValueError) as e:
        new_pool(framework, state_rounding="up")
    assert str(e.value) == ("StatePool state_rounding must be None (the format's default: "
                            "stochastic for float8_e4m3fn, nearest otherwise), 'nearest' or "
                            "'stochastic'; got 'up'")
    with pytest.raises(ValueError) as e:
        new_pool(framework, layers=0)
    assert str(e.value) == ("StatePool needs layers, slots, HV, V, K >= 1; got layers=0, slots=5, "
                            "HV=2, V=8, K=16")
    with pytest.raises(ValueError) as e:
        new_pool(framework, replay_len=2, H=3)
    assert str(e.value) == ("StatePool with ReplaySSM rings needs the key-head count H (HV a "
                            "multiple of H); got H=3, HV=2")
    with pytest.raises(TypeError) as e:
        new_pool(framework, layers="2")
    assert str(e.value) == "StatePool: `layers` must be an int (got str)"
    with pytest.raises(TypeError):
        new_pool(framework, slots=2.5)
    pool = new_pool(framework)
    with pytest.raises(ValueError) as e:
        pool.layer_state(3)
    assert str(e.value) == "StatePool: layer 3 is out of range for a pool of 3 layers"
    with pytest.raises(ValueError) as e:
        pool.d_cache(0)
    assert str(e.value) == "StatePool has no ReplaySSM rings (configure replay_len >= 1 to create them)"


def test_numpy_pool_specifics(rng):
    with pytest.raises(ValueError, match="numpy has no bfloat16"):
        new_pool("numpy", state_dtype="bfloat16").layer_state(0)
    with pytest.raises(ValueError, match="lives on the CPU"):
        new_pool("numpy", device="cuda")
    p = new_pool("numpy", state_dtype=np.float16, replay_len=2, H=1)
    assert isinstance(p.layer_state(0), np.ndarray) and p.layer_state(0).dtype == np.float16
    assert p.k_cache(0).dtype == np.float32  # the default ring_k_dtype: exact
    assert new_pool("numpy", replay_len=2, H=1, ring_k_dtype="float16").k_cache(0).dtype == np.float16


def test_torch_pool_specifics():
    if torch is None:
        pytest.skip("needs torch")
    p = new_pool("torch", state_dtype=torch.bfloat16, replay_len=2, H=1)
    assert isinstance(p.layer_state(0), torch.Tensor) and p.layer_state(0).dtype == torch.bfloat16
    assert p.k_cache(0).dtype == torch.float32 and p.g_cache(0).dtype == torch.float32
    assert new_pool("torch", replay_len=2, H=1, ring_k_dtype=torch.bfloat16).k_cache(0).dtype \
        == torch.bfloat16
    assert p.d_cache(0).dtype == torch.bfloat16 and p.write_pos().dtype == torch.int32
    assert p.layer_state(0).device.type == "cpu"


@pytest.mark.parametrize("device", ["mps", "meta", "gpu", "cuda:x", 3.5, None])
def test_torch_pool_bad_device(device):
    """A device deltastate cannot run on: one ValueError naming StatePool, `device` and what it
    accepts, raised before anything is allocated (not torch's own error)."""
    if torch is None:
        pytest.skip("needs torch")
    with pytest.raises(ValueError) as e:
        new_pool("torch", device=device)
    assert str(e.value).startswith(f"StatePool: `device` must be 'cpu', 'cuda' or 'cuda:N' (a str "
                                   f"or a torch.device); got {device!r}")
    assert "\n" not in str(e.value)


def test_torch_pool_unavailable_cuda_device():
    if torch is None:
        pytest.skip("needs torch")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError) as e:
        new_pool("torch", device=f"cuda:{count}")
    if count == 0:
        assert str(e.value) == ("StatePool: `device`='cuda:0', but torch finds no CUDA device here; "
                                "use device='cpu'")
    else:
        assert str(e.value) == (f"StatePool: `device`='cuda:{count}', but torch finds {count} CUDA "
                                f"device(s) here (cuda:0 .. cuda:{count - 1})")


# ---- the null slot (SGLang's layout) ------------------------------------------------------------
def test_sglang_pool_null_slot_is_never_allocated(framework, rng):
    """StatePool.sglang(size=4): SGLang's MambaPool, 4 requests over 5 rows; slot 0 is never
    handed out, whatever the order of frees, and free/fork refuse it."""
    pool = ds.StatePool.sglang(3, 4, 2, 8, 16, framework=framework)
    assert pool.null_slot and pool.slots == 4 and pool.physical_slots == 5
    assert tuple(pool.layer_state(0).shape) == (5, 2, 8, 16)
    assert tuple(pool.write_pos().shape) == (5,)
    assert pool.num_free == 4 and not pool.is_allocated(0)
    assert [pool.allocate() for _ in range(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError) as e:
        pool.allocate()
    assert str(e.value).startswith("StatePool exhausted: all 4 slots are in use")
    with pytest.raises(ValueError) as e:
        pool.free(0)
    assert str(e.value) == "StatePool.free: slot 0 is the null slot of this pool (never allocated)"
    with pytest.raises(ValueError) as e:
        pool.free(5)
    assert str(e.value) == ("StatePool.free: slot 5 is out of range for a pool of 4 slots (1..4; "
                            "slot 0 is the null slot)")
    with pytest.raises(ValueError) as e:
        pool.fork(0, 1)
    assert str(e.value) == ("StatePool.fork: both slots must be allocated (src 0 is the null slot, "
                            "dst 1 is allocated)")
    live = [1, 2, 3, 4]
    for _ in range(200):
        if live and (pool.num_free == 0 or rng.random() < 0.5):
            pool.free(live.pop(int(rng.integers(len(live)))))
        else:
            s = pool.allocate()
            assert 1 <= s <= 4
            live.append(s)
        assert pool.num_free == 4 - len(live) and not pool.is_allocated(0)
    with pytest.raises(TypeError, match="pass `size`"):
        ds.StatePool.sglang(3, 4, 2, 8, 16, null_slot=False)


@pytest.mark.parametrize("layout", ["per_layer", "envelope"])
def test_null_slot_accounting_and_fork(framework, layout, rng):
    cfg = dict(layers=3, HV=2, V=8, K=16, layout=layout, replay_len=2, H=1,
               envelope_extra_bytes=40 if layout == "envelope" else 0)
    pool = ds.StatePool(slots=3, null_slot=True, framework=framework, **cfg)
    rows = ds.StatePool(slots=4, framework=framework, **cfg)
    assert pool.nbytes == rows.nbytes > ds.StatePool(slots=3, framework=framework, **cfg).nbytes
    assert not bits(pool.storage).any()  # zero-initialized, slot 0 included
    for layer in range(3):
        for what in ("layer_state", "d_cache", "k_cache", "g_cache"):
            a, b = getattr(pool, what)(layer), getattr(rows, what)(layer)
            assert tuple(a.shape) == tuple(b.shape) and a.shape[0] == 4
    for n in (1, 3, 10):  # slots_for_budget counts the null row against the budget
        need = ds.StatePool(slots=n, null_slot=True, framework="numpy", **cfg).nbytes
        assert need == ds.StatePool(slots=n + 1, framework="numpy", **cfg).nbytes
        assert ds.StatePool.slots_for_budget(need, null_slot=True, **cfg) == n
        assert ds.StatePool.slots_for_budget(need - 1, null_slot=True, **cfg) == n - 1
        assert ds.StatePool.slots_for_budget(need, **cfg) == n + 1

    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (1, 2)
    for layer in range(3):
        fill(pool, layer, 0, 4.0)  # a caller's padded row left garbage in the null slot
        fill(pool, layer, a, rng.standard_normal((2, 8, 16)).astype(np.float32))
    pool.fork(a, b)
    for layer in range(3):
        np.testing.assert_array_equal(bits(pool.layer_state(layer)[b]),
                                      bits(pool.layer_state(layer)[a]))
    pool.free(b)
    assert pool.allocate() == b  # cleared again; the null slot is never cleared or handed out
    for layer in range(3):
        assert (to64(pool.layer_state(layer)[b]) == 0).all()
        assert (to64(pool.layer_state(layer)[0]) == 4.0).all()


def _zero_slot0(pool):
    for layer in range(pool.layers):
        for what in ("layer_state", "d_cache", "k_cache", "g_cache"):
            getattr(pool, what)(layer)[0] = 0
    pool.write_pos()[0] = 0


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_padded_row_at_null_slot_never_touches_live_slots(framework, rng, kda):
    """A caller aiming a padded row at index 0 (SGLang's clamp(min=0), FlashInfer's "0 is null")
    over an SGLang pool: packed decode, recurrent and ReplaySSM leave every live slot (states,
    rings, cursors) and every live row's output bit-identical to the same calls with that row
    padded (-1); only slot 0 differs."""
    fw = Fw(framework)
    H, HV, V, K, L = 1, 2, 8, 16, 3
    mk = dict(replay_len=L, H=H, kda=kda, ring_k_dtype="float32", framework=framework)
    pa, pb = ds.StatePool.sglang(2, 4, HV, V, K, **mk), ds.StatePool.sglang(2, 4, HV, V, K, **mk)
    live = [pa.allocate() for _ in range(4)]
    assert live == [pb.allocate() for _ in range(4)]
    for layer in range(2):
        for s in live:
            x = (rng.standard_normal((HV, V, K)) * 0.5).astype(np.float32)
            fill(pa, layer, s, x)
            fill(pb, layer, s, x)
    for s in live:
        pa.set_cursor(s, s % L)
        pb.set_cursor(s, s % L)
    aimed, padded = [live[2], 0, live[1], -1, live[3]], [live[2], -1, live[1], -1, live[3]]
    live_rows = [0, 2, 4]
    A_log, dt_bias = gate_params(rng, HV, K, kda)
    A_log, dt_bias = fw.from64(A_log), fw.from64(dt_bias)
    packed = (ds.fused_recurrent_kda_packed_decode if kda
              else ds.fused_recurrent_gated_delta_rule_packed_decode)
    rec = ds.recurrent_kda if kda else ds.recurrent_gated_delta_rule
    x = materialize_packed(fw, packed_data(rng, kda=kda, B=5, H=H, HV=HV, K=K, V=V), "float32")
    xr = materialize_packed(fw, packed_data(rng, kda=kda, B=5, H=H, HV=HV, K=K, V=V), "float32")
    q, k = fw.from64(rng.standard_normal((5, 2, H, K))), fw.from64(rng.standard_normal((5, 2, H, K)))
    v = fw.from64(rng.standard_normal((5, 2, HV, V)))
    g = fw.from64(-rng.uniform(0.05, 1, (5, 2, HV, K) if kda else (5, 2, HV)))
    beta = fw.from64(rng.uniform(0.1, 0.9, (5, 2, HV)))
    outs = []
    for pool, rows in ((pa, aimed), (pb, padded)):
        out = poison(fw, (5, 1, HV, V), "float32")
        packed(x["mixed_qkv"], x["a"], x["b"], A_log, dt_bias, K ** -0.5, pool.layer_state(0),
               out, fw.idx(rows))
        o, _ = rec(q, k, v, g, beta, initial_state=pool.layer_state(0),
                   ssm_state_indices=fw.idx(rows))
        wp = fw.idx([int(to64(pool.write_pos())[s]) if s >= 0 else 0 for s in rows])
        ro = poison(fw, (5, 1, HV, V), "float32")
        ds.fused_recurrent_linear_replayssm_decode(
            xr["mixed_qkv"], xr["a"], xr["b"], A_log, dt_bias, K ** -0.5, pool.layer_state(1),
            pool.d_cache(1), pool.k_cache(1), pool.g_cache(1), ro, fw.idx(rows), wp, None,
            is_kda=kda, advance_write_pos=True)
        outs.append([bits(t)[live_rows] for t in (out, o, ro, wp)])
    for got, want, what in zip(outs[0], outs[1], ("packed out", "recurrent o", "ReplaySSM out",
                                                  "cursors")):
        np.testing.assert_array_equal(got, want, err_msg=what)
    for layer in range(2):
        for what in ("layer_state", "d_cache", "k_cache", "g_cache"):
            for s in live:
                np.testing.assert_array_equal(bits(getattr(pa, what)(layer)[s]),
                                              bits(getattr(pb, what)(layer)[s]),
                                              err_msg=f"{what}({layer}) of live slot {s}")
    np.testing.assert_array_equal(bits(pa.write_pos())[live], bits(pb.write_pos())[live])
    assert (to64(pa.layer_state(0)[0]) != 0).any(), "the aimed row wrote the null slot"
    assert not bits(pb.layer_state(0)[0]).any()
    assert live == [1, 2, 3, 4]
    _zero_slot0(pa)
    _zero_slot0(pb)
    np.testing.assert_array_equal(bits(pa.storage), bits(pb.storage))  # nothing else differs
