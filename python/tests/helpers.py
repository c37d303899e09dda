"""Test helpers: arrays of either framework (numpy, torch CPU/CUDA) built from float64 data,
sentinel-filled envelope pools as `as_strided` views, bitwise snapshots, and tolerance checks.

Tolerances are those of SGLang's tests of these kernels. When a kernel stores a result in a
reduced-precision dtype (bf16/fp16 output, state or ring), the comparison against the unrounded
float64 reference adds that dtype's unit roundoff (half an ulp, relative) to rtol: the rounding
on store that the ops prescribe, and nothing else.
"""

from __future__ import annotations

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover - the numpy-only tests still run
    torch = None

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
UNIT_ROUNDOFF = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
SENTINEL = 1e30  # unused slots and envelope gaps


def sentinel_for(dtype: str) -> float:
    """1e30 where the dtype holds it; float16 (max 65504) gets inf."""
    return float("inf") if dtype == "float16" else SENTINEL

# (atol, rtol) as SGLang's kernel tests use them.
TOL_OUT = (1e-4, 1e-4)
TOL_STATE = {"float32": (1e-5, 1e-4), "bfloat16": (2e-3, 1e-4), "float16": (5e-4, 1e-4)}
TOL_REPLAY_GDN_OUT = {"float32": (1e-4, 1e-3), "low": (1e-3, 1e-2)}
TOL_REPLAY_GDN_FLUSH = {"float32": (1.5e-3, 1e-3), "low": (3e-3, 1e-2)}
TOL_REPLAY_KDA_OUT = (5e-4, 1e-2)
TOL_REPLAY_KDA_FLUSH = (4e-3, 1e-2)
TOL_REPLAY_RING = (2e-3, 1e-2)
TOL_REPLAY_G = (1e-5, 1e-4)
TOL_REPLAY_L1 = (2e-6, 1e-5)


class Fw:
    """One framework/device: numpy (CPU) or torch on `device`."""

    def __init__(self, name: str, device: str = "cpu"):
        self.name = name
        self.device = device
        if name == "torch" and torch is None:
            raise RuntimeError("torch is not installed")

    def __repr__(self):
        return f"{self.name}:{self.device}"

    def supports(self, dtype: str) -> bool:
        return self.name == "torch" or dtype != "bfloat16"

    def dt(self, dtype: str):
        if self.name == "torch":
            return getattr(torch, dtype)
        return np.dtype(dtype)

    # ---- creation ----
    def from64(self, arr, dtype: str = "float32"):
        """A new array holding `arr` (float64 or ints) converted to `dtype` (round to nearest)."""
        arr = np.asarray(arr)
        if self.name == "numpy":
            return np.ascontiguousarray(arr.astype(np.float32).astype(dtype) if dtype in FLOAT_DTYPES
                                        else arr.astype(dtype))
        if dtype in FLOAT_DTYPES:
            t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(getattr(torch, dtype))
        else:
            t = torch.from_numpy(np.ascontiguousarray(arr.astype(dtype)))
        return t.to(self.device)

    def idx(self, values, dtype: str = "int32"):
        return self.from64(np.asarray(values, dtype=np.int64), dtype)

    def full(self, shape, value, dtype: str = "float32"):
        if self.name == "numpy":
            return np.full(shape, value, dtype=np.float32).astype(dtype)
        return torch.full(shape, value, dtype=torch.float32, device=self.device).to(self.dt(dtype))

    def flat(self, n: int, dtype: str, fill: float, align_bytes: int = 256):
        """A 1-D buffer of n elements whose first element is `align_bytes`-aligned."""
        item = 4 if dtype in ("float32", "int32") else 2
        pad_elems = align_bytes // item
        if self.name == "numpy":
            raw = np.full(n + pad_elems, fill, dtype=np.float32).astype(dtype)
            off = ((-raw.ctypes.data) % align_bytes) // item
            return raw[off:off + n]
        raw = torch.full((n + pad_elems,), fill, dtype=torch.float32, device=self.device).to(self.dt(dtype))
        off = ((-raw.data_ptr()) % align_bytes) // item
        return raw[off:off + n]

    def aligned(self, arr64, dtype: str = "float32", align_bytes: int = 256):
        """Like from64, in a buffer whose start is `align_bytes`-aligned."""
        arr64 = np.asarray(arr64)
        t = self.flat(arr64.size, dtype, 0.0, align_bytes).reshape(arr64.shape)
        self.assign(t, arr64, dtype)
        return t

    def as_strided(self, flat, shape, strides, offset: int = 0):
        """A view of the 1-D `flat` with element strides, starting `offset` elements in (numpy:
        np.lib.stride_tricks.as_strided; torch: torch.as_strided)."""
        if self.name == "numpy":
            item = flat.dtype.itemsize
            return np.lib.stride_tricks.as_strided(flat[offset:], shape=shape,
                                                   strides=[s * item for s in strides])
        return torch.as_strided(flat, shape, strides, flat.storage_offset() + offset)

    def assign(self, dst, src64, dtype: str):
        """dst[...] = src64 (rounded to dtype), in place."""
        if self.name == "numpy":
            dst[...] = np.asarray(src64, dtype=np.float32).astype(dtype)
        else:
            dst.copy_(self.from64(src64, dtype))

    # ---- reading back ----
    def to64(self, x) -> np.ndarray:
        if self.name == "numpy" or isinstance(x, np.ndarray):
            x = np.asarray(x)
            return x.astype(np.int64) if x.dtype.kind in "iu" else x.astype(np.float64)
        x = x.detach().cpu()
        if x.is_floating_point():
            return x.to(torch.float64).numpy()
        return x.to(torch.int64).numpy()


def to64(x) -> np.ndarray:
    """float64 (or int64) numpy copy of a numpy array or torch tensor."""
    if isinstance(x, np.ndarray):
        return x.astype(np.int64) if x.dtype.kind in "iu" else x.astype(np.float64)
    x = x.detach().cpu()
    return (x.to(torch.float64) if x.is_floating_point() else x.to(torch.int64)).numpy()


def bits(x) -> np.ndarray:
    """The raw bits of every element of x (any layout) as an integer numpy array."""
    if isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x)
        return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]).copy()
    x = x.detach().cpu().contiguous()
    size = x.element_size()
    if size == 1:
        return x.view(torch.uint8).numpy().copy()
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).numpy().copy()


def snapshot(*arrays):
    return [None if a is None else bits(a) for a in arrays]


def assert_unchanged(before, *arrays, what="argument"):
    for i, (b, a) in enumerate(zip(before, arrays)):
        if a is None:
            continue
        after = bits(a)
        assert after.shape == b.shape and np.array_equal(after, b), f"{what} #{i} was modified"


def dtype_name(x) -> str:
    if isinstance(x, np.ndarray):
        return x.dtype.name
    return str(x.dtype).replace("torch.", "")


def assert_close(actual, expected, tol, dtype: str = "float32", what: str = ""):
    """|actual - expected| <= atol + (rtol + u_dtype) * |expected| elementwise (NaN fails)."""
    atol, rtol = tol
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    lim = atol + (rtol + UNIT_ROUNDOFF[dtype]) * np.abs(e)
    err = np.abs(a - e)
    ok = err <= lim
    if not ok.all():
        bad = np.argwhere(~ok)
        i = tuple(bad[0])
        worst = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err / lim)), err.shape)
        raise AssertionError(
            f"{what}: {len(bad)} of {a.size} elements out of tolerance (atol={atol}, rtol={rtol}, "
            f"dtype={dtype}); first at {i}: got {a[i]!r}, want {e[i]!r}; worst at {worst}: got "
            f"{a[worst]!r}, want {e[worst]!r}")


class PoolBuf:
    """A state pool [slots, HV, V, K] of `dtype` as a strided view over a 1-D buffer filled with
    the sentinel. Envelope layout: each slot's entry is `extra` elements of other data, the state,
    then `tail` more elements, so the slot stride exceeds HV*V*K (both multiples of 16 elements,
    the view's base 32-byte aligned, as recurrent_kda's stride contract requires). `live` slots
    hold random states; everything else stays at the sentinel."""

    def __init__(self, fw: Fw, slots, HV, V, K, dtype, rng, live, *, envelope=True, scale=0.5,
                 extra=16, tail=32):
        self.fw, self.dtype = fw, dtype
        self.shape = (slots, HV, V, K)
        inner = HV * V * K
        self.extra = extra if envelope else 0
        self.stride = inner + (extra + tail if envelope else 0)
        self.flat = fw.flat(slots * self.stride, dtype, sentinel_for(dtype))
        self.view = fw.as_strided(self.flat, self.shape, (self.stride, V * K, K, 1), self.extra)
        self.live = list(live)
        for s in self.live:
            fw.assign(self.view[s], rng.standard_normal((HV, V, K)) * scale, dtype)

    def state64(self) -> np.ndarray:
        return to64(self.view)

    def bits(self) -> np.ndarray:
        return bits(self.flat)

    def mask(self, slots) -> np.ndarray:
        """Elements of `flat` that belong to the states of `slots`."""
        m = np.zeros(self.flat.shape[0], dtype=bool)
        inner = int(np.prod(self.shape[1:]))
        for s in slots:
            start = s * self.stride + self.extra
            m[start:start + inner] = True
        return m

    def assert_untouched_outside(self, before_bits, slots, what="pool"):
        """Every element outside the states of `slots` (other slots, envelope gaps, sentinels) is
        bit-identical to `before_bits`."""
        keep = ~self.mask(slots)
        after = self.bits()
        changed = np.flatnonzero(keep & (after != before_bits))
        assert changed.size == 0, (
            f"{what}: {changed.size} elements outside the live slots changed (first flat index "
            f"{changed[0]}, slot {changed[0] // self.stride})")


def poison(fw: Fw, shape, dtype):
    """An output buffer filled with NaN, so an element the op forgets to write shows."""
    return fw.full(shape, float("nan"), dtype)



def eagle_tree(rng, T: int):
    """A random tree over T draft tokens in token order (parent < child), with EAGLE's tables:
    (parent [T] int64 with parent[0] = 0, first child [T] int32, next sibling [T] int32; -1: none)."""
    parent = np.zeros(T, dtype=np.int64)
    for t in range(1, T):
        parent[t] = rng.integers(0, t)
    nxt = np.full(T, -1, dtype=np.int32)
    sib = np.full(T, -1, dtype=np.int32)
    for p in range(T):
        kids = [c for c in range(1, T) if parent[c] == p]
        if kids:
            nxt[p] = kids[0]
            for a, b in zip(kids, kids[1:]):
                sib[a] = b
    return parent, nxt, sib
