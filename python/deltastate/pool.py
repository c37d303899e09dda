"""StatePool: slot-indexed recurrent state for many layers, as tensors of the caller's framework.

The framework (torch or numpy) allocates one zeroed byte buffer; the C++ StatePool lays the
states, ReplaySSM rings and cursors out in it and keeps the slot bookkeeping. Views are plain
torch tensors / numpy arrays aliasing that buffer, ready to pass to the ops:

    pool = StatePool(layers=36, slots=256, HV=32, V=128, K=128, layout="envelope", device="cuda")
    s = pool.allocate()
    fused_recurrent_gated_delta_rule_packed_decode(..., pool.layer_state(3), out, indices)

Without torch installed the pool is numpy (``framework="numpy"``, CPU), its buffer 256-byte
aligned so that its views meet every op's alignment contract (a plain ``np.zeros`` state is only
16-byte aligned and ``recurrent_kda`` rejects it when its base is not 32-byte aligned).

SGLang's layout, slot 0 a reserved null slot that padded rows may target:

    pool = StatePool.sglang(layers=36, size=256, HV=32, V=128, K=128, device="cuda")
    pool.layer_state(3).shape  # (257, 32, 128, 128); pool.allocate() returns 1..256
"""

from __future__ import annotations

import contextlib
from typing import Optional

from ._lib import lib

_ALIGN = 256
_TORCH_DTYPES = ("float32", "bfloat16", "float16")
# The 1-byte state formats with fp32 scales (docs/STATE_FORMATS.md); state_dtype only.
_QUANTIZED = ("float8_e4m3fn", "int8")
_ROUNDINGS = {None: 0, "nearest": 1, "stochastic": 2}


def _dtype_name(dtype, quantized_ok: bool = False) -> str:
    name = str(dtype).replace("torch.", "")
    allowed = _TORCH_DTYPES + (_QUANTIZED if quantized_ok else ())
    if name not in allowed and not isinstance(dtype, str):
        try:  # numpy dtypes and scalar types (np.float32, np.dtype("float16"))
            import numpy as np

            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in allowed:
        if quantized_ok:
            raise ValueError("StatePool state_dtype must be float32, bfloat16, float16, "
                             f"float8_e4m3fn or int8; got {dtype}")
        raise ValueError(f"StatePool dtypes must be float32, bfloat16 or float16; got {dtype}")
    return name


def _rounding_code(state_rounding) -> int:
    if state_rounding not in _ROUNDINGS:
        raise ValueError("StatePool state_rounding must be None (the format's default: "
                         "stochastic for float8_e4m3fn, nearest otherwise), 'nearest' or "
                         f"'stochastic'; got {state_rounding!r}")
    return _ROUNDINGS[state_rounding]


def _ints(**values) -> None:
    import operator

    for name, v in values.items():
        if isinstance(v, bool):
            raise TypeError(f"StatePool: `{name}` must be an int (got bool)")
        try:
            operator.index(v)
        except TypeError:
            raise TypeError(f"StatePool: `{name}` must be an int (got {type(v).__name__})") from None


_CONV_LAYOUTS = ("sglang", "vllm")


def _conv_args(conv_dim, conv_width, conv_dtype, conv_layout, conv_split_qkv):
    """The conv-window part of a configuration (module order)."""
    _ints(conv_dim=conv_dim, conv_width=conv_width)
    if conv_layout not in _CONV_LAYOUTS:
        raise ValueError(f"StatePool conv_layout must be 'sglang' (window contiguous) or 'vllm' "
                         f"(dim contiguous); got {conv_layout!r}")
    return (int(conv_dim), int(conv_width), _dtype_name(conv_dtype), conv_layout == "vllm",
            bool(conv_split_qkv))


def _config(layers, HV, V, K, state_dtype, layout, envelope_extra_bytes, replay_len, H,
            ring_k_dtype, kda, slots=1, null_slot=False, conv=(0, 4, "float32", False, False),
            spec=(0, 0), rounding=(None, 0)):
    """The argument tuple the C++ module takes for a pool configuration."""
    _ints(spec_rows=spec[0], spec_steps=spec[1], rounding_seed=rounding[1])
    return (layers, slots, HV, V, K, _dtype_name(state_dtype, quantized_ok=True),
            layout == "envelope", envelope_extra_bytes, replay_len, H, _dtype_name(ring_k_dtype),
            bool(kda), bool(null_slot)) + tuple(conv) + (int(spec[0]), int(spec[1]),
                                                          _rounding_code(rounding[0]),
                                                          int(rounding[1]))


def _default_framework() -> str:
    """torch when it can be imported, else numpy."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


def _sizes(cfg, budget_bytes: int = 0):
    """[required bytes, bytes per slot, slots that fit budget_bytes, speculative-scratch bytes]
    of a configuration."""
    return [int(x) for x in lib.pool_sizes(*cfg, int(budget_bytes))]


_DEVICES = "'cpu', 'cuda' or 'cuda:N' (a str or a torch.device)"


def _pool_device(torch, device):
    """`device` as a torch.device deltastate can run on, checked before anything is allocated:
    else a ValueError naming StatePool, `device` and what it accepts (not torch's own error)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"StatePool: `device` must be {_DEVICES}; got {device!r}") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"StatePool: `device` must be {_DEVICES}; got {device!r} (deltastate "
                         "runs on the CPU and on CUDA devices)")
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"StatePool: `device`={device!r}, but torch finds no CUDA device "
                             "here; use device='cpu'")
        if d.index is not None and d.index >= count:
            raise ValueError(f"StatePool: `device`={device!r}, but torch finds {count} CUDA "
                             f"device(s) here (cuda:0 .. cuda:{count - 1})")
    return d


class StatePool:
    """A pool of ``slots`` recurrent states [HV, V, K] for ``layers`` layers.

    layout: "per_layer" (state [layers, slots, HV, V, K]) or "envelope" (one entry per slot holds
    every layer, after ``envelope_extra_bytes`` of other per-slot data; layer views then have a
    slot stride larger than HV*V*K). ``replay_len`` > 0 adds the ReplaySSM rings (d: state dtype,
    k: ``ring_k_dtype`` with ``H`` key heads, g: float32, [.., L, K] when ``kda``) and per-slot
    cursors. The op stores each normalized key rounded to ``ring_k_dtype``: the default float32
    is exact whatever the activations; the activation dtype (bfloat16, SGLang's choice for bf16
    activations) halves the k ring's bytes at about 1e-3 relative output error with fp32
    activations.
    ``framework``: "torch" (any torch device) or "numpy" (CPU only); by default torch when it is
    installed, else numpy. Either way the buffer is 256-byte aligned.

    ``null_slot``: reserve slot 0 as a null slot (SGLang's MambaPool layout; see
    :meth:`StatePool.sglang`). ``slots`` stays the capacity, the number of requests the pool
    holds: every view then has ``physical_slots = slots + 1`` rows, slot 0 is zeroed and never
    allocated (``allocate()`` returns 1..slots), so padded rows aimed at index 0 never touch a live
    request; ``nbytes`` and the sizing helpers count the extra row.

    Conv windows (``conv_dim`` > 0): per (layer, slot) the window of the short causal conv
    before the delta rule, ``conv_dim`` channels of ``conv_width - 1`` entries of ``conv_dtype``
    (GDN: conv_dim = 2*H*K + HV*V). ``conv_layout``: "sglang" ([layers, slots, conv_dim, W-1],
    each window contiguous) or "vllm" (stride 1 along dim); ``conv_split_qkv``: three windows
    q [H*K], k [H*K], v [HV*V] (Kimi-Linear; needs H), else one packed window. In the envelope
    layout a slot's entry holds the windows and states of every layer. ``allocate`` zeroes the
    windows, ``fork`` copies them, the accounting counts them. Views: :meth:`conv_state`.

    Speculative-verify scratch (``spec_rows`` and ``spec_steps`` >= 1; SGLang's
    SpeculativeState): ``spec_rows`` rows (one per batch row of a verify) of ``spec_steps``
    draft positions, per layer the state after each draft and, with conv windows, the window
    after each draft: :meth:`intermediate_states`, :meth:`intermediate_conv_window` (the verify
    op's ``intermediate_states`` and causal_conv1d_update's ``intermediate_conv_window``).
    One block, not per slot (``spec_nbytes``; ``nbytes`` includes it), untouched by allocate and
    fork. :meth:`states` and :meth:`conv_states` view every layer at once, for the commits.

    Quantized states (``state_dtype`` "float8_e4m3fn" or "int8"; docs/STATE_FORMATS.md): 1-byte
    codes with one fp32 scale per (slot, head, V row), both in the slot's block (so allocate,
    fork and the envelope layout keep them together; ``nbytes`` counts them).
    :meth:`layer_state` is a torch ``float8_e4m3fn`` / ``int8`` tensor; numpy has no float8, so a
    numpy pool's float8 view is the codes as ``uint8`` (the ops take a uint8 state as
    float8_e4m3fn codes). :meth:`layer_scales` is the fp32 scales [slots, HV, V].
    ``state_rounding``: None (the format's default: stochastic for float8_e4m3fn, nearest
    otherwise), "nearest" or "stochastic" (bfloat16 / float16 too). Stochastic rounding draws its
    bits from a generator keyed by (``rounding_seed``, slot, layer, step); the pool keeps each
    layer's step counter (:meth:`rounding_step`), which the ops advance on the device.
    :meth:`state_format` gives the keyword arguments an op needs for a layer. A quantized pool's
    ReplaySSM d ring is float32 (the rings stay float); it has no speculative scratch yet; the
    ops that take quantized states are listed in docs/STATE_FORMATS.md.
    """

    def __init__(self, layers: int, slots: int, HV: int, V: int, K: int, *,
                 state_dtype="float32", layout: str = "per_layer", envelope_extra_bytes: int = 0,
                 replay_len: int = 0, H: int = 0, ring_k_dtype="float32", kda: bool = False,
                 device="cpu", framework: Optional[str] = None, null_slot: bool = False,
                 conv_dim: int = 0, conv_width: int = 4, conv_dtype="float32",
                 conv_layout: str = "sglang", conv_split_qkv: bool = False,
                 spec_rows: int = 0, spec_steps: int = 0, state_rounding: Optional[str] = None,
                 rounding_seed: int = 0):
        _ints(layers=layers, slots=slots, HV=HV, V=V, K=K,
              envelope_extra_bytes=envelope_extra_bytes, replay_len=replay_len, H=H)
        layers, slots, HV, V, K = int(layers), int(slots), int(HV), int(V), int(K)
        envelope_extra_bytes, replay_len, H = int(envelope_extra_bytes), int(replay_len), int(H)
        if framework is None:
            framework = _default_framework()
            if framework == "numpy" and str(device) != "cpu":
                raise ValueError(f"StatePool on device {str(device)!r} needs torch, which is not "
                                 "installed (numpy pools live on the CPU)")
        if layout not in ("per_layer", "envelope"):
            raise ValueError(f"StatePool layout must be 'per_layer' or 'envelope'; got {layout!r}")
        if framework not in ("torch", "numpy"):
            raise ValueError(f"StatePool framework must be 'torch' or 'numpy'; got {framework!r}")
        self.layers, self.slots, self.HV, self.V, self.K = layers, slots, HV, V, K
        self.null_slot = bool(null_slot)
        self.physical_slots = slots + int(self.null_slot)  # rows of every view
        self.state_dtype = _dtype_name(state_dtype, quantized_ok=True)
        self.quantized = self.state_dtype in _QUANTIZED
        _rounding_code(state_rounding)
        self.state_rounding = state_rounding
        self.rounding_seed = rounding_seed
        self.ring_k_dtype = _dtype_name(ring_k_dtype)
        self.layout = layout
        self.replay_len = replay_len
        self.framework = framework
        conv = _conv_args(conv_dim, conv_width, conv_dtype, conv_layout, conv_split_qkv)
        self.conv_dim, self.conv_width, self.conv_dtype = conv[0], conv[1], conv[2]
        self.conv_layout, self.conv_split_qkv = conv_layout, conv[4]
        self._cfg = _config(layers, HV, V, K, self.state_dtype, layout, envelope_extra_bytes,
                            replay_len, H, self.ring_k_dtype, kda, slots=slots,
                            null_slot=self.null_slot, conv=conv, spec=(spec_rows, spec_steps),
                            rounding=(state_rounding, rounding_seed))
        self.stochastic = state_rounding == "stochastic" or (
            state_rounding is None and self.state_dtype == "float8_e4m3fn")
        self.spec_rows, self.spec_steps = int(spec_rows), int(spec_steps)
        sizes = _sizes(self._cfg)
        nbytes = sizes[0]
        self.nbytes = nbytes
        self.spec_nbytes = sizes[3]
        if framework == "torch":
            try:
                import torch
            except ImportError:
                raise ImportError("StatePool(framework='torch') needs torch, which is not "
                                  "installed; use framework='numpy' (CPU)") from None

            raw = torch.zeros(nbytes + _ALIGN, dtype=torch.uint8,
                              device=_pool_device(torch, device))
            pad = (-raw.data_ptr()) % _ALIGN
        else:
            import numpy as np

            if str(device) != "cpu":
                raise ValueError("StatePool with framework='numpy' lives on the CPU")
            raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
            pad = (-raw.ctypes.data) % _ALIGN
        self._raw = raw
        self.storage = raw[pad:pad + nbytes]
        self.device = raw.device if framework == "torch" else "cpu"
        self._cuda = framework == "torch" and raw.device.type == "cuda"
        self._m = lib.pool_new(self.storage, *self._cfg)
        self._views = {}

    @classmethod
    def sglang(cls, layers: int, size: int, HV: int, V: int, K: int, **kwargs) -> "StatePool":
        """SGLang's MambaPool layout: ``size`` requests, state [layers, size + 1, HV, V, K]
        (``layer_state(l)`` is SGLang's ``temporal[l]``), slot 0 the reserved dummy/null slot that
        padded rows may target (SGLang's ``clamp(min=0)``, FlashInfer's "index 0 is null"), and
        ``allocate()`` handing out 1..size like SGLang's ``MambaSlotAllocator``. Other keywords
        as :class:`StatePool` (state_dtype, replay_len, H, ring_k_dtype, kda, device, ...)."""
        if "null_slot" in kwargs or "slots" in kwargs:
            raise TypeError("StatePool.sglang: pass `size` (the capacity); the null slot is implied")
        return cls(layers, size, HV, V, K, null_slot=True, **kwargs)

    # Slot operations that touch device memory (allocate's clear, fork's copy, set_cursor) run on
    # the stream tvm-ffi reports for the device. A call without tensor arguments does not set it
    # from torch, so for a CUDA pool set it to torch's current stream around the call.
    def _on_torch_stream(self):
        if not self._cuda:
            return contextlib.nullcontext()
        import torch
        import tvm_ffi

        stream = torch.cuda.current_stream(self.device)
        return tvm_ffi.use_raw_stream(tvm_ffi.device(str(self.device)), stream.cuda_stream)

    # ---- slots ------------------------------------------------------------------------------
    def allocate(self, clear: bool = True) -> int:
        """Take a free slot (state zeroed in every layer when ``clear``, cursor reset)."""
        with self._on_torch_stream():
            return int(self._m["allocate"](bool(clear)))

    def free(self, slot: int) -> None:
        self._m["free"](int(slot))

    def is_allocated(self, slot: int) -> bool:
        return bool(self._m["is_allocated"](int(slot)))

    @property
    def num_free(self) -> int:
        return int(self._m["num_free"]())

    def fork(self, src: int, dst: int, *, cache_base: int = 0, prefix_gate_cache: bool = False,
             predecayed_k_cache: bool = False) -> None:
        """Prefix caching: copy every layer's state (and conv windows) of ``src`` into ``dst`` and
        reset ``dst``'s cursor to 0 (in circular mode its cache_base is the caller's: 0). A
        source with pending ReplaySSM records (cursor m > 0) is materialized: ``dst``'s
        checkpoint becomes the state after them, computed as a ReplaySSM fold rebuilds it (a
        fold of the next token on ``src`` and on ``dst`` then gives the same bits on the CPU with
        fp32). ``cache_base``, ``prefix_gate_cache``, ``predecayed_k_cache``: the ring mode
        ``src``'s decode ran with (``cache_base``: src's circular base). ``src`` and the rings are
        not written. A quantized or stochastically rounded pool rebuilds in fp32 from ``dst``'s
        dequantized copy and stores each row with a fresh scale, rounded with ``src``'s key at the
        layer's step (the step counter unchanged): the bytes ``src``'s history checkpoint at that
        step would hold. CUDA pools: a kernel."""
        with self._on_torch_stream():
            self._m["fork"](int(src), int(dst), int(cache_base), bool(prefix_gate_cache),
                            bool(predecayed_k_cache))

    def cursor(self, slot: int) -> int:
        """The slot's ReplaySSM cursor. For CUDA pools a blocking read, ordered after the work
        already queued on torch's current stream."""
        with self._on_torch_stream():
            return int(self._m["cursor"](int(slot)))

    def set_cursor(self, slot: int, value: int) -> None:
        with self._on_torch_stream():
            self._m["set_cursor"](int(slot), int(value))

    # ---- views ------------------------------------------------------------------------------
    def layer_state(self, layer: int):
        """[slots, HV, V, K] view of one layer's states (slot stride per the layout)."""
        return self._view("state", layer, self.state_dtype)

    def layer_scales(self, layer: int):
        """[slots, HV, V] float32 scales of a quantized pool's layer (one per state row; the
        state's slot stride)."""
        return self._view("scales", layer, "float32")

    def rounding_step(self, layer: int):
        """[1] int64: the layer's stochastic-rounding step counter (the ops add 1 per call)."""
        return self._view("rounding_step", layer, "int64")

    def rounding_steps(self):
        """[layers] int64: every layer's step counter (the commit after a verify)."""
        return self._view("rounding_steps", 0, "int64")

    def scales(self):
        """[layers, slots, HV, V] float32: every layer's scales (the commit's, with
        :meth:`states`)."""
        return self._view("all_scales", 0, "float32")

    def state_format(self, layer: Optional[int] = None) -> dict:
        """The keyword arguments an op needs for this pool's layer ``layer``: ``state_scales``
        (quantized pools) and, with stochastic rounding, ``state_rounding``, ``rounding_step``,
        ``rounding_seed`` and ``rounding_layer``. Empty for a float pool rounded to nearest.
        ``layer`` None: every layer's (:meth:`scales`, :meth:`rounding_steps`), for the commit
        over :meth:`states`."""
        kw = {}
        if self.quantized:
            kw["state_scales"] = self.scales() if layer is None else self.layer_scales(layer)
        if self.state_rounding is not None:
            kw["state_rounding"] = self.state_rounding
        if self.stochastic:
            kw.update(rounding_step=(self.rounding_steps() if layer is None
                                     else self.rounding_step(layer)),
                      rounding_seed=self.rounding_seed,
                      rounding_layer=0 if layer is None else int(layer))
        return kw

    def d_cache(self, layer: int):
        """[slots, HV, L, V]: the state dtype (float32 for a quantized pool)."""
        return self._view("d_cache", layer, "float32" if self.quantized else self.state_dtype)

    def k_cache(self, layer: int):
        return self._view("k_cache", layer, self.ring_k_dtype)

    def g_cache(self, layer: int):
        return self._view("g_cache", layer, "float32")

    def write_pos(self):
        """[slots] int32 cursors, one per slot, shared by all layers."""
        return self._view("write_pos", 0, "int32")

    def conv_state(self, layer: int, part: Optional[str] = None):
        """[slots, dim, conv_width - 1] conv windows of one layer: ``part`` None the packed
        window (dim = conv_dim), "q" / "k" / "v" one part's window (of a packed window, its
        channel slice). Strides per ``conv_layout``; envelope pools: the entry's slot stride."""
        names = {None: "conv_state", "q": "conv_q", "k": "conv_k", "v": "conv_v"}
        if part not in names:
            raise ValueError(f"StatePool.conv_state: part must be None, 'q', 'k' or 'v'; got "
                             f"{part!r}")
        return self._view(names[part], layer, self.conv_dtype)

    def states(self):
        """[layers, slots, HV, V, K]: every layer's states (the commit's ``state``)."""
        return self._view("states", 0, self.state_dtype)

    def conv_states(self, part: Optional[str] = None):
        """[layers, slots, dim, conv_width - 1]: every layer's conv windows (``part`` as in
        :meth:`conv_state`)."""
        return self._view("conv_states" + self._conv_suffix(part), 0, self.conv_dtype)

    def intermediate_states(self, layer: Optional[int] = None):
        """[spec_rows, spec_steps, HV, V, K] scratch states of one layer, or with ``layer``
        None every layer's, [layers, spec_rows, spec_steps, HV, V, K]."""
        return self._view("inter_states", -1 if layer is None else int(layer), self.state_dtype)

    def intermediate_conv_window(self, layer: Optional[int] = None, part: Optional[str] = None):
        """[spec_rows, spec_steps, dim, conv_width - 1] scratch conv windows of one layer (the
        pool's conv layout; ``part`` as in :meth:`conv_state`), or with ``layer`` None every
        layer's, [layers, spec_rows, spec_steps, dim, conv_width - 1]."""
        return self._view("inter_conv" + self._conv_suffix(part), -1 if layer is None else
                          int(layer), self.conv_dtype)

    @staticmethod
    def _conv_suffix(part: Optional[str]) -> str:
        suffixes = {None: "", "q": "_q", "k": "_k", "v": "_v"}
        if part not in suffixes:
            raise ValueError(f"StatePool: conv part must be None, 'q', 'k' or 'v'; got {part!r}")
        return suffixes[part]

    def _view(self, what: str, layer: int, dtype: str):
        key = (what, layer)
        v = self._views.get(key)
        if v is None:
            desc = [int(x) for x in self._m["view"](what, int(layer))]
            offset, nd = desc[0], (len(desc) - 1) // 2
            shape, strides = desc[1:1 + nd], desc[1 + nd:]
            v = self._make_view(offset, shape, strides, dtype)
            self._views[key] = v
        return v

    def _make_view(self, offset, shape, strides, dtype):
        if self.framework == "torch":
            import torch

            tdt = getattr(torch, dtype)
            typed = self.storage.view(tdt)
            itemsize = typed.element_size()
            return torch.as_strided(typed, shape, strides, typed.storage_offset() + offset // itemsize)
        import numpy as np

        if dtype == "bfloat16":
            raise ValueError("numpy has no bfloat16: use framework='torch' for bfloat16 pools")
        # numpy has no float8: the codes as uint8, which the ops read as float8_e4m3fn
        ndt = np.dtype("uint8" if dtype == "float8_e4m3fn" else dtype)
        typed = self.storage.view(ndt)
        return np.lib.stride_tricks.as_strided(typed[offset // ndt.itemsize:], shape,
                                               [s * ndt.itemsize for s in strides])

    # ---- accounting -------------------------------------------------------------------------
    @staticmethod
    def bytes_per_slot(layers: int, HV: int, V: int, K: int, *, state_dtype="float32",
                       layout: str = "per_layer", envelope_extra_bytes: int = 0,
                       replay_len: int = 0, H: int = 0, ring_k_dtype="float32",
                       kda: bool = False, conv_dim: int = 0, conv_width: int = 4,
                       conv_dtype="float32", conv_layout: str = "sglang",
                       conv_split_qkv: bool = False) -> int:
        """Bytes one slot adds (state and conv windows in every layer, rings, cursor); a null
        slot's row costs the same."""
        _ints(layers=layers, HV=HV, V=V, K=K, envelope_extra_bytes=envelope_extra_bytes,
              replay_len=replay_len, H=H)
        conv = _conv_args(conv_dim, conv_width, conv_dtype, conv_layout, conv_split_qkv)
        return _sizes(_config(layers, HV, V, K, state_dtype, layout, envelope_extra_bytes,
                              replay_len, H, ring_k_dtype, kda, conv=conv))[1]

    @staticmethod
    def slots_for_budget(budget_bytes: int, layers: int, HV: int, V: int, K: int, *,
                         state_dtype="float32", layout: str = "per_layer",
                         envelope_extra_bytes: int = 0, replay_len: int = 0, H: int = 0,
                         ring_k_dtype="float32", kda: bool = False,
                         null_slot: bool = False, conv_dim: int = 0, conv_width: int = 4,
                         conv_dtype="float32", conv_layout: str = "sglang",
                         conv_split_qkv: bool = False, spec_rows: int = 0,
                         spec_steps: int = 0) -> int:
        """How many slots (the ``slots`` argument of a pool) fit in ``budget_bytes``, the whole
        pool counted: alignment, with ``null_slot`` the null slot's row, and the speculative
        scratch."""
        _ints(budget_bytes=budget_bytes, layers=layers, HV=HV, V=V, K=K,
              envelope_extra_bytes=envelope_extra_bytes, replay_len=replay_len, H=H)
        conv = _conv_args(conv_dim, conv_width, conv_dtype, conv_layout, conv_split_qkv)
        return _sizes(_config(layers, HV, V, K, state_dtype, layout, envelope_extra_bytes,
                              replay_len, H, ring_k_dtype, kda, null_slot=null_slot, conv=conv,
                              spec=(spec_rows, spec_steps)),
                      budget_bytes)[2]
