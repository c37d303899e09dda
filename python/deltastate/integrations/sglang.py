"""Kernel objects with the surface of SGLang's ``LinearAttnKernelBase``, backed by deltastate.

SGLang's GDN and KDA attention backends (``python/sglang/srt/layers/attention/linear/
gdn_backend.py``, ``kda_backend.py``) call one kernel object per mode through their kernel
dispatcher: ``packed_decode`` (when ``supports_packed_decode``) or ``decode`` for a decode
batch, ``extend`` for prefill, ``target_verify`` for speculative decoding. The classes here take
exactly those calls, with SGLang's keyword arguments and conventions:

* the pool ``ssm_states`` is SGLang's ``[slots, HV, V, K]`` (V-first) per layer, updated in
  place; ``cache_indices`` are its slot indices; slot 0 is SGLang's reserved dummy slot (never
  read or written unless a row points at it); an index of -1 pads a CUDA-graph batch: its
  output is zero, its state untouched;
* ``decode``: q, k ``[1, B, H, K]``, v ``[1, B, HV, V]`` (views of the split ``mixed_qkv``),
  ``a`` / ``b`` the raw gate and beta logits (GDN ``[B, HV]``; KDA ``a`` ``[B, HV*K]``), the gate
  ``-exp(A_log) * softplus(a + dt_bias)`` (KDA with ``lower_bound``: the safe gate), beta
  ``sigmoid(b)``, q/k L2-normalized, scale ``K**-0.5``; returns ``[1, B, HV, V]``;
* ``packed_decode``: ``mixed_qkv [B, 2*H*K + HV*V]`` straight from the conv, deltastate's
  SGLang-named packed decode (or, with SGLang's ``replayssm_*`` keywords, ReplaySSM decode);
  returns ``[1, B, HV, V]``;
* ``extend``: varlen ``[1, T, ...]`` with ``query_start_loc`` ``[N+1]``, each sequence starting
  from its pool row and ending there (GDN: ``g``, ``beta`` already gated by SGLang's
  ``fused_gdn_gating``; KDA: ``g`` the raw gate with ``A_log`` / ``dt_bias`` / ``lower_bound``,
  ``beta`` a probability, or its logit with ``beta_is_raw=True``). GDN returns SGLang's triple
  ``(o, None, None)`` (the state is updated in place; ``inplace_update=False`` leaves the pool
  unchanged), KDA returns ``o``.
* ``target_verify``: speculative decoding's verify, as ``TritonGDNKernel`` /
  ``TritonKDAKernel.target_verify`` (SGLang's ``fused_sigmoid_gating_delta_rule_update`` with
  ``disable_state_update=True``): q, k ``[1, B*T, H, K]``, v ``[1, B*T, HV, V]``, raw ``a`` /
  ``b`` as in ``decode``, ``query_start_loc`` ``[B+1]`` (T = ``cache_steps`` draft tokens per
  request); each request reads its pool row (-1: padded, output zero, nothing read or written),
  writes the state after draft token t to ``intermediate_states_buffer[intermediate_state_indices
  [b], t]`` (SGLang's per-layer ``intermediate_ssm`` ``[spec, draft, HV, V, K]``) and leaves the
  pool unchanged; ``retrieve_parent_token`` ``[B, T]`` (None: a chain) makes each request an
  EAGLE tree; ``lower_bound`` (KDA) the safe gate; ``cache_ring=True`` with
  ``replayssm_rawv`` / ``rawk`` / ``g`` / ``beta`` also records each draft's raw inputs in those
  per-layer rings for SGLang's fold-every-commit commits (GDN and KDA). Returns
  ``[1, B*T, HV, V]``. The commit of the accepted step stays SGLang's
  ``update_mamba_state_after_mtp_verify``, whose ``fused_mamba_state_scatter_with_mask`` is
  ``deltastate.fused_mamba_state_scatter_with_mask``.

Selecting it in SGLang: SGLang's ``GDNKernelDispatcher`` / ``KDAKernelDispatcher`` choose the
kernel with an if/elif over ``--linear-attn-decode-backend`` / ``--linear-attn-prefill-backend``
(``LinearAttnKernelBackend``); docs/INTEGRATION.md shows the branch to add
(``elif decode_backend.is_deltastate(): self.decode_kernel = DeltastateGDNKernel()``).
"""

from __future__ import annotations

from typing import Optional

try:  # the real base class when SGLang is installed, so isinstance checks hold
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import (
        LinearAttnKernelBase as _Base,
    )
except Exception:  # SGLang absent (or not importable on this machine)
    _Base = object


def _ds():
    import deltastate

    return deltastate


def _rows(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class _DeltastateKernel(_Base):
    uses_state_checkpoints: bool = False
    supports_packed_decode: bool = True
    kda: bool = False

    def packed_decode(self, mixed_qkv, a, b, *, A_log, dt_bias, scale, ssm_states,
                      cache_indices, num_v_heads, head_v_dim, **kwargs):
        ds = _ds()
        B = mixed_qkv.shape[0]
        out = mixed_qkv.new_empty(B, 1, num_v_heads, head_v_dim)
        lower_bound = kwargs.get("lower_bound")
        rings = [kwargs.get(n) for n in ("replayssm_d", "replayssm_k", "replayssm_g",
                                         "replayssm_write_pos")]
        if all(r is not None for r in rings):
            d, k_ring, g_ring, write_pos = rings
            if self.kda:  # SGLang's KDA kernel flattens its backend's [B, 1, ...] gate inputs
                K = ssm_states.shape[-1]
                a, b = a.reshape(B, num_v_heads, K), b.reshape(B, num_v_heads)
                A_log, dt_bias = A_log.reshape(-1), dt_bias.reshape(num_v_heads, K)
            ds.fused_recurrent_linear_replayssm_decode(
                mixed_qkv, a, b, A_log, dt_bias, scale, ssm_states, d, k_ring, g_ring, out,
                cache_indices, write_pos, kwargs.get("replayssm_force_flush"),
                lower_bound=lower_bound, use_qk_l2norm_in_kernel=True, is_kda=self.kda)
        elif self.kda:
            ds.fused_recurrent_kda_packed_decode(
                mixed_qkv, a.reshape(B, -1), b.reshape(B, -1), A_log.reshape(-1),
                dt_bias.reshape(-1), scale, ssm_states, out, cache_indices,
                use_qk_l2norm_in_kernel=True, lower_bound=lower_bound)
        else:
            ds.fused_recurrent_gated_delta_rule_packed_decode(
                mixed_qkv, a, b, A_log, dt_bias, scale, ssm_states, out, cache_indices,
                use_qk_l2norm_in_kernel=True)
        return out.transpose(0, 1)  # [B, 1, HV, V] -> SGLang's [1, B, HV, V], a view

    def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices,
               query_start_loc, **kwargs):
        ds = _ds()
        T, HV = v.shape[1], v.shape[2]
        K = q.shape[-1]
        fn = ds.recurrent_kda if self.kda else ds.recurrent_gated_delta_rule
        g = a.reshape(1, T, HV, K) if self.kda else a.reshape(1, T, HV)
        dt_bias = dt_bias.reshape(HV, K) if self.kda else dt_bias.reshape(-1)
        o, _ = fn(_rows(q), _rows(k), _rows(v), _rows(g), _rows(b.reshape(1, T, HV)),
                  A_log=A_log.reshape(-1), dt_bias=dt_bias, initial_state=ssm_states,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  lower_bound=kwargs.get("lower_bound"), cu_seqlens=query_start_loc,
                  ssm_state_indices=cache_indices, beta_is_logit=True)
        return o

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices,
                      query_start_loc, intermediate_states_buffer, intermediate_state_indices,
                      cache_steps, retrieve_parent_token, lower_bound=None, cache_ring=False,
                      replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None,
                      replayssm_beta=None, **kwargs):
        ds = _ds()
        T, HV, V = v.shape[1], v.shape[2], v.shape[3]
        K = q.shape[-1]
        g = a.reshape(1, T, HV, K) if self.kda else a.reshape(1, T, HV)
        dt_bias = dt_bias.reshape(HV, K) if self.kda else dt_bias.reshape(-1)
        inter = intermediate_states_buffer
        if inter is not None and inter.dim() != 5:
            # SGLang's kernel cuts a flat [spec * cache_steps, HV, V, K] scratch into rows of
            # cache_steps; a 5-D buffer keeps its allocated pitch (shape[1]).
            inter = inter.reshape(-1, int(cache_steps), HV, V, K)
        # cache_ring (fold-every-commit): the drafts' raw inputs into the per-layer rings that
        # SGLang's commit_*_replayssm_* replays; the rings come as a set or not at all.
        rings = {}
        if cache_ring:
            rings = dict(ring_v=replayssm_rawv, ring_k=replayssm_rawk, ring_g=replayssm_g,
                         ring_beta=replayssm_beta)
        return ds.verify(
            _rows(q), _rows(k), _rows(v), _rows(g), _rows(b.reshape(1, T, HV)),
            q.new_empty(v.shape), ssm_states, cache_indices, A_log=A_log.reshape(-1),
            dt_bias=dt_bias, is_kda=self.kda, use_gate_in_kernel=True,
            lower_bound=lower_bound, beta_is_logit=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=query_start_loc, update_state=False,
            intermediate_states=inter, intermediate_state_indices=intermediate_state_indices,
            parent_tokens=retrieve_parent_token, **rings)


class DeltastateGDNKernel(_DeltastateKernel):
    """GDN (Qwen3-Next) on deltastate with the surface of SGLang's ``TritonGDNKernel``."""

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc,
               inplace_update: bool = True, **kwargs) -> tuple:
        ds = _ds()
        keep = None
        if not inplace_update:  # multi-item scoring: read the pool, store nothing
            keep = cache_indices.new_full(cache_indices.shape, -1)
        o, _ = ds.chunk_gated_delta_rule(
            _rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), initial_state=ssm_states,
            use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=query_start_loc,
            initial_state_indices=cache_indices, output_state_indices=keep)
        return o, None, None


class DeltastateKDAKernel(_DeltastateKernel):
    """KDA (Kimi-Linear) on deltastate with the surface of SGLang's ``TritonKDAKernel``."""

    kda = True

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc,
               A_log: Optional[object] = None, dt_bias: Optional[object] = None,
               lower_bound: Optional[float] = None, beta_is_raw: bool = False,
               return_intermediate_states: bool = False, **kwargs):
        if return_intermediate_states:
            raise NotImplementedError(
                "DeltastateKDAKernel.extend: return_intermediate_states (SGLang's per-chunk "
                "states h for prefix-cache tracking) is not implemented in deltastate")
        ds = _ds()
        gate = A_log is not None or lower_bound is not None
        HV, K = v.shape[2], q.shape[-1]
        o, _ = ds.chunk_kda(
            _rows(q), _rows(k), _rows(v), _rows(g.reshape(1, -1, HV, K)),
            _rows(beta.reshape(1, -1, HV)),
            initial_state=ssm_states, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate,
            use_beta_sigmoid_in_kernel=beta_is_raw, lower_bound=lower_bound,
            state_v_first=True, cu_seqlens=query_start_loc,
            A_log=None if A_log is None else A_log.reshape(-1),
            dt_bias=None if dt_bias is None else dt_bias.reshape(HV, K),
            initial_state_indices=cache_indices)
        return o
