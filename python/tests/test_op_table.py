"""The op table (deltastate._surface) and what is derived from it: the public signatures and
the torch schemas (the API, pinned here), the check of the table against the compiled binding,
the generated functions' names and sources, and the argument list in their docstrings."""

import dataclasses
import inspect

import pytest

import deltastate as ds
from deltastate import _derive
from deltastate._lib import lib
from deltastate._surface import BOOL, FLOAT, OPS, Arg

_FLASHINFER_RECURRENT = (
    "(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, "
    "output_final_state=False, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, "
    "lower_bound=None, cu_seqlens=None, ssm_state_indices=None, num_spec_tokens=None, "
    "num_accepted_tokens=None, output=None, initial_state_source=None, "
    "initial_state_indices=None, beta_is_logit=False, seq_order=None, prefill_workspace=None, "
    "state_checkpoints=None, checkpoint_cu_starts=None, checkpoint_every_n_tokens=0, *, "
    "backend='auto', round_beta=False, check_indices=None, state_scales=None, "
    "state_rounding=None, rounding_step=None, rounding_seed=0, rounding_layer=0, pdl=False)")
_CHUNK_POOL = (
    "*, {kw}transpose_state_layout=None, initial_state_indices=None, has_initial_state=None, "
    "output_state_indices=None, checkpoint_every_n_tokens=0, checkpoint_cu_starts=None, "
    "state_checkpoints=None, checkpoint_slot_indices=None, workspace=None, check_indices=None, "
    "state_scales=None, state_rounding=None, rounding_step=None, rounding_seed=0, "
    "rounding_layer=0, pdl=False)")
# The state format's keywords (quantized pools, stochastic rounding), after the peer's own.
_STATE_FORMAT_PUBLIC = ("state_scales=None, state_rounding=None, rounding_step=None, "
                        "rounding_seed=0, rounding_layer=0, pdl=False)")
_REPLAY_HEAD = ("(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, d_cache, k_cache, "
                "g_cache, out, ssm_state_indices, write_pos, force_flush=None, ")
PUBLIC = {
    "chunk_gated_delta_rule":
        "(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, "
        "state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, "
        "cp_context=None, "
        + _CHUNK_POOL.format(kw="use_gate_in_kernel=False, A_log=None, dt_bias=None, "
                                "chunk_size=64, "),
    "chunk_kda":
        "(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, "
        "use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False, "
        "return_intermediate_states=False, state_v_first=False, cu_seqlens=None, "
        "cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, "
        + _CHUNK_POOL.format(kw="A_log=None, dt_bias=None, chunk_size=64, "),
    "fused_recurrent_gated_delta_rule_packed_decode":
        "(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, "
        "use_qk_l2norm_in_kernel=False, *, round_beta=False, check_indices=None, "
        + _STATE_FORMAT_PUBLIC,
    "fused_recurrent_kda_packed_decode":
        "(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, "
        "use_qk_l2norm_in_kernel=False, lower_bound=None, *, round_beta=False, "
        "check_indices=None, " + _STATE_FORMAT_PUBLIC,
    "recurrent_kda": _FLASHINFER_RECURRENT,
    "recurrent_gated_delta_rule": _FLASHINFER_RECURRENT,
    "fused_recurrent_gated_delta_rule":
        "(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None, "
        "output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, "
        "A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, "
        "state_v_first=False, cu_seqlens=None, *, transpose_state_layout=None, round_beta=False, "
        "check_indices=None, pdl=False)",
    "fused_recurrent_kda":
        "(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, "
        "output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, "
        "use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, "
        "state_v_first=False, cu_seqlens=None, *, transpose_state_layout=None, round_beta=False, "
        "check_indices=None, pdl=False)",
    "fused_recurrent_linear_replayssm_decode": _REPLAY_HEAD + (
        "lower_bound=None, use_qk_l2norm_in_kernel=False, is_kda=False, block_v=None, "
        "num_warps=1, num_stages=3, nk=2, cache_base=None, circular_replay=False, "
        "prefix_gate_cache=False, predecayed_k_cache=False, *, round_beta=False, "
        "advance_write_pos=False, check_indices=None, " + _STATE_FORMAT_PUBLIC),
    "helion_fused_recurrent_kda_replayssm_decode": _REPLAY_HEAD + (
        "use_qk_l2norm_in_kernel=False, lower_bound=None, *, round_beta=False, "
        "advance_write_pos=False, check_indices=None, " + _STATE_FORMAT_PUBLIC),
    # speculative verify and its commit
    "verify":
        '(q, k, v, g, beta, output, state, state_indices=None, A_log=None, dt_bias=None, scale=None, is_kda=False, use_gate_in_kernel=True, lower_bound=None, beta_is_logit=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None, update_state=True, output_state_indices=None, intermediate_states=None, intermediate_state_indices=None, parent_tokens=None, token_state_indices=None, num_accepted_tokens=None, source_state=None, source_state_indices=None, ring_v=None, ring_k=None, ring_g=None, ring_beta=None, *, keep_padded_outputs=False, state_scales=None, state_rounding=None, rounding_step=None, rounding_seed=0, rounding_layer=0, intermediate_state_scales=None, round_beta=False, check_indices=None, pdl=False)',
    "fused_sigmoid_gating_delta_rule_update":
        '(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source, initial_state_indices, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=False, lower_bound=None, disable_state_update=False, intermediate_states_buffer=None, intermediate_state_indices=None, cache_steps=None, retrieve_parent_token=None, cache_ring=False, replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None, replayssm_beta=None, *, round_beta=False, check_indices=None, pdl=False)',
    "gated_delta_rule_mtp":
        '(q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale=None, output=None, intermediate_states_buffer=None, ssm_state_indices=None, disable_state_update=None, use_qk_l2norm=True, output_state_indices=None, *, round_beta=False, check_indices=None, pdl=False)',
    "update_state_after_verify":
        '(state, intermediate_states, state_indices, accepted, intermediate_state_indices=None, accepted_is_step=False, *, check_indices=None, state_scales=None, state_rounding=None, rounding_step=None, rounding_seed=0, rounding_layer=0, intermediate_state_scales=None, pdl=False)',
    "fused_mamba_state_scatter_with_mask":
        '(dst, src, dst_indices_raw, step_indices_raw, *, check_indices=None, pdl=False)',
    "update_conv_state_after_verify":
        '(conv_state, intermediate_conv_window, state_indices, accepted, intermediate_state_indices=None, accepted_is_step=False, *, check_indices=None, pdl=False)',
    "fused_conv_window_scatter_with_mask":
        '(dst, src, dst_indices_raw, step_indices_raw, *, check_indices=None, pdl=False)',
    # ReplaySSM speculative verify and its cursor commit
    'replayssm_verify':
        '(q, k, v, g, beta, output, checkpoint_state, state_indices, d_cache, k_cache, g_cache, write_pos, cache_base, is_flush, A_log=None, dt_bias=None, scale=None, is_kda=False, use_gate_in_kernel=True, lower_bound=None, beta_is_logit=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None, null_block_id=-1, replay_indices=None, rawv_cache=None, rawk_cache=None, beta_cache=None, rows=0, *, state_scales=None, state_rounding=None, rounding_step=None, rounding_seed=0, rounding_layer=0, round_beta=False, check_indices=None, pdl=False)',
    'gdn_replayssm_spec_decode':
        "(q, k, v, a, b, A_log, dt_bias, checkpoint_state, d_cache, k_cache, g_cache, rawv_cache, rawk_cache, beta_cache, out, query_start_loc, ssm_state_indices, replay_indices, write_pos, cache_base, is_flush, max_cache_len, max_spec_len, scale=None, use_qk_l2norm_in_kernel=True, null_block_id=0, block_v=64, num_warps=1, num_stages=2, nk=2, bs_min=4, block_v_flush=64, num_warps_flush=1, num_stages_flush=2, nk_flush=2, launch_mode='both', dot_precision='tf32', *, round_beta=False, check_indices=None, pdl=False)",
    'replayssm_commit':
        '(write_pos, cache_base, is_flush, num_accepted, state_indices, max_cache_len, max_spec_len, cache_buf_len=0, fold_every_commit=False, null_block_id=-1, *, check_indices=None, pdl=False)',
    'commit_gdn_replayssm_spec':
        '(write_pos, cache_base, is_flush, num_accepted, replay_indices, max_cache_len, max_spec_len, fold_every_commit=False, cache_buf_len=None, null_block_id=0, *, check_indices=None, pdl=False)',
    'replayssm_reset_cursors':
        '(write_pos, cache_base, is_flush, do_reset, state_indices, max_cache_len, max_spec_len, null_block_id=-1, *, check_indices=None, pdl=False)',
    'reset_gdn_replayssm_spec_cursors':
        '(write_pos, cache_base, is_flush, do_reset, state_batch_indices, max_cache_len, max_spec_len, null_block_id=0, *, check_indices=None, pdl=False)',
    # fold-every-commit
    'replayssm_fold_commit':
        '(state, rawv, rawk, g, beta, state_indices, accept_lens, track_indices=None, steps_to_track=None, is_kda=False, use_qk_l2norm_in_kernel=True, null_block_id=-1, *, check_indices=None, pdl=False)',
    'commit_gdn_replayssm_fold_all_layers':
        '(checkpoint_state, rawv_cache, rawk_cache, g_cache, beta_cache, ssm_state_indices, accept_lens, max_cache_len, num_k_heads, mamba_track_indices=None, mamba_steps_to_track=None, use_qk_l2norm_in_kernel=True, null_block_id=-1, *, check_indices=None, pdl=False)',
    'commit_kda_replayssm_spec':
        '(checkpoint_state, rawv_cache, rawk_cache, gk_cache, beta_cache, ssm_state_indices, accept_lens, max_cache_len, num_k_heads, mamba_track_indices=None, mamba_steps_to_track=None, use_qk_l2norm_in_kernel=True, null_block_id=0, *, check_indices=None, pdl=False)',
    'commit_kda_replayssm_spec_all_layers':
        '(checkpoint_state, rawv_cache, rawk_cache, gk_cache, beta_cache, ssm_state_indices, accept_lens, max_cache_len, num_k_heads, mamba_track_indices=None, mamba_steps_to_track=None, use_qk_l2norm_in_kernel=True, null_block_id=0, *, check_indices=None, pdl=False)',
    # the compact circular commit
    'replayssm_circular_commit':
        '(state, d_cache, k_cache, g_cache, state_indices, replay_indices, write_pos, cache_base, is_flush, accept_lens, d_residual=None, k_residual=None, track_indices=None, steps_to_track=None, null_block_id=-1, *, check_indices=None, pdl=False)',
    'commit_gdn_replayssm_circular':
        '(*, checkpoint_state, d_cache, k_cache, g_cache, d_residual_cache, k_residual_cache, state_batch_indices, replay_indices, write_pos, cache_base, is_flush, accept_lens, mamba_track_indices=None, mamba_steps_to_track=None, null_block_id=-1, check_indices=None, pdl=False)',
}

_PACKED_SCHEMA = (
    "Tensor mixed_qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, float? scale, "
    "Tensor(a!) initial_state, Tensor(b!) out, Tensor ssm_state_indices, "
    "bool use_qk_l2norm_in_kernel=False, float? lower_bound=None, bool round_beta=False, "
    "int check_indices=-1, Tensor(c!)? state_scales=None, int state_rounding=0, "
    "Tensor(d!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, bool pdl=False")
_RECURRENT_SCHEMA = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, Tensor? A_log, "
    "Tensor? dt_bias, bool use_gate_in_kernel, float? lower_bound, bool beta_is_logit, "
    "bool round_beta, float? scale, Tensor? initial_state, Tensor(b!)? state_pool, "
    "Tensor? ssm_state_indices, Tensor? cu_seqlens, Tensor(c!)? final_state, bool state_v_first, "
    "bool stride_contract, bool use_qk_l2norm_in_kernel, int check_indices=-1, "
    "Tensor(d!)? state_scales=None, int state_rounding=0, Tensor(e!)? rounding_step=None, "
    "int rounding_seed=0, int rounding_layer=0, bool pdl=False")


def _replay_schema(name, kda, helion):
    return (f"{name}(Tensor mixed_qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, "
            "float? scale, Tensor(a!) initial_state, Tensor(b!) d_cache, Tensor(c!) k_cache, "
            "Tensor(d!) g_cache, Tensor(e!) out, Tensor ssm_state_indices, Tensor(f!) write_pos, "
            "Tensor? force_flush, float? lower_bound=None, bool use_qk_l2norm_in_kernel=False, "
            f"bool is_kda={kda}, bool round_beta=False, bool advance_write_pos=False, "
            f"bool helion={helion}, int check_indices=-1, Tensor(g!)? state_scales=None, "
            "int state_rounding=0, Tensor(h!)? rounding_step=None, int rounding_seed=0, "
            "int rounding_layer=0, Tensor(i!)? cache_base=None, bool circular_replay=False, "
            "bool prefix_gate_cache=False, bool predecayed_k_cache=False, bool pdl=False) -> ()")


_CHUNK_SCHEMA = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, Tensor? A_log, "
    "Tensor? dt_bias, bool use_gate_in_kernel, float? lower_bound, bool beta_is_logit, "
    "float? scale, bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens, Tensor(b!)? initial_state, "
    "Tensor? initial_state_indices, Tensor? has_initial_state, Tensor? output_state_indices, "
    "Tensor(c!)? final_state, int checkpoint_every_n_tokens, Tensor? checkpoint_cu_starts, "
    "Tensor(d!)? state_checkpoints, Tensor? checkpoint_slot_indices, Tensor(e!)? workspace, "
    "int check_indices=-1, Tensor(f!)? state_scales=None, int state_rounding=0, "
    "Tensor(g!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, bool pdl=False")

SCHEMAS = {
    "chunk_gated_delta_rule": f"chunk_gated_delta_rule({_CHUNK_SCHEMA}) -> ()",
    "chunk_kda": f"chunk_kda({_CHUNK_SCHEMA}) -> ()",
    "gdn_packed_decode": f"gdn_packed_decode({_PACKED_SCHEMA}) -> ()",
    "kda_packed_decode": f"kda_packed_decode({_PACKED_SCHEMA}) -> ()",
    "recurrent_gated_delta_rule": f"recurrent_gated_delta_rule({_RECURRENT_SCHEMA}) -> ()",
    "recurrent_kda": f"recurrent_kda({_RECURRENT_SCHEMA}) -> ()",
    "fla_gated_delta_rule": f"fla_gated_delta_rule({_RECURRENT_SCHEMA}) -> ()",
    "fla_kda": f"fla_kda({_RECURRENT_SCHEMA}) -> ()",
    "replayssm_decode": _replay_schema("replayssm_decode", False, False),
    "helion_kda_replayssm_decode": _replay_schema("helion_kda_replayssm_decode", True, True),
    # speculative verify and its commit
    "verify":
        'verify(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, bool is_kda, Tensor? A_log, Tensor? dt_bias, bool use_gate_in_kernel, float? lower_bound, bool beta_is_logit, bool round_beta, float? scale, bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens, Tensor(b!) state, Tensor? state_indices=None, Tensor? output_state_indices=None, bool update_state=True, Tensor(c!)? intermediate_states=None, Tensor? intermediate_state_indices=None, Tensor? parent_tokens=None, Tensor? token_state_indices=None, Tensor? num_accepted_tokens=None, Tensor? source_state=None, Tensor? source_state_indices=None, Tensor(d!)? ring_v=None, Tensor(e!)? ring_k=None, Tensor(f!)? ring_g=None, Tensor(g!)? ring_beta=None, bool keep_padded_outputs=False, int check_indices=-1, Tensor(h!)? state_scales=None, int state_rounding=0, Tensor(i!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, Tensor(j!)? intermediate_state_scales=None, bool pdl=False) -> ()',
    "sglang_verify":
        'sglang_verify(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, bool is_kda, Tensor? A_log, Tensor? dt_bias, bool use_gate_in_kernel, float? lower_bound, bool beta_is_logit, bool round_beta, float? scale, bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens, Tensor(b!) state, Tensor? state_indices=None, Tensor? output_state_indices=None, bool update_state=True, Tensor(c!)? intermediate_states=None, Tensor? intermediate_state_indices=None, Tensor? parent_tokens=None, Tensor? token_state_indices=None, Tensor? num_accepted_tokens=None, Tensor? source_state=None, Tensor? source_state_indices=None, Tensor(d!)? ring_v=None, Tensor(e!)? ring_k=None, Tensor(f!)? ring_g=None, Tensor(g!)? ring_beta=None, bool keep_padded_outputs=False, int check_indices=-1, Tensor(h!)? state_scales=None, int state_rounding=0, Tensor(i!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, Tensor(j!)? intermediate_state_scales=None, bool pdl=False) -> ()',
    "flashinfer_mtp":
        'flashinfer_mtp(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, bool is_kda, Tensor? A_log, Tensor? dt_bias, bool use_gate_in_kernel, float? lower_bound, bool beta_is_logit, bool round_beta, float? scale, bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens, Tensor(b!) state, Tensor? state_indices=None, Tensor? output_state_indices=None, bool update_state=True, Tensor(c!)? intermediate_states=None, Tensor? intermediate_state_indices=None, Tensor? parent_tokens=None, Tensor? token_state_indices=None, Tensor? num_accepted_tokens=None, Tensor? source_state=None, Tensor? source_state_indices=None, Tensor(d!)? ring_v=None, Tensor(e!)? ring_k=None, Tensor(f!)? ring_g=None, Tensor(g!)? ring_beta=None, bool keep_padded_outputs=True, int check_indices=-1, Tensor(h!)? state_scales=None, int state_rounding=0, Tensor(i!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, Tensor(j!)? intermediate_state_scales=None, bool pdl=False) -> ()',
    "update_state_after_verify":
        'update_state_after_verify(Tensor(a!) state, Tensor intermediate_states, Tensor state_indices, Tensor accepted, Tensor? intermediate_state_indices=None, bool accepted_is_step=False, int check_indices=-1, Tensor(b!)? state_scales=None, int state_rounding=0, Tensor(c!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, Tensor? intermediate_state_scales=None, bool pdl=False) -> ()',
    "sglang_state_scatter":
        'sglang_state_scatter(Tensor(a!) state, Tensor intermediate_states, Tensor state_indices, Tensor accepted, Tensor? intermediate_state_indices=None, bool accepted_is_step=True, int check_indices=-1, Tensor(b!)? state_scales=None, int state_rounding=0, Tensor(c!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, Tensor? intermediate_state_scales=None, bool pdl=False) -> ()',
    "update_conv_state_after_verify":
        'update_conv_state_after_verify(Tensor(a!) conv_state, Tensor intermediate_conv_window, Tensor state_indices, Tensor accepted, Tensor? intermediate_state_indices=None, bool accepted_is_step=False, int check_indices=-1, bool pdl=False) -> ()',
    "sglang_conv_window_scatter":
        'sglang_conv_window_scatter(Tensor(a!) conv_state, Tensor intermediate_conv_window, Tensor state_indices, Tensor accepted, Tensor? intermediate_state_indices=None, bool accepted_is_step=True, int check_indices=-1, bool pdl=False) -> ()',
    # ReplaySSM speculative verify and its cursor commit
    'replayssm_verify':
        'replayssm_verify(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, Tensor? A_log, Tensor? dt_bias, Tensor(b!) checkpoint_state, Tensor state_indices, Tensor(c!) d_cache, Tensor(d!) k_cache, Tensor(e!) g_cache, Tensor write_pos, Tensor cache_base, Tensor is_flush, Tensor? replay_indices, Tensor(f!)? rawv_cache, Tensor(g!)? rawk_cache, Tensor(h!)? beta_cache, int rows, bool is_kda=False, bool use_gate_in_kernel=True, float? lower_bound=None, bool beta_is_logit=True, bool round_beta=False, float? scale=None, bool use_qk_l2norm_in_kernel=True, Tensor? cu_seqlens=None, int null_block_id=-1, int check_indices=-1, Tensor(i!)? state_scales=None, int state_rounding=0, Tensor(j!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, bool pdl=False) -> ()',
    'gdn_replayssm_spec_decode':
        'gdn_replayssm_spec_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) output, Tensor? A_log, Tensor? dt_bias, Tensor(b!) checkpoint_state, Tensor state_indices, Tensor(c!) d_cache, Tensor(d!) k_cache, Tensor(e!) g_cache, Tensor write_pos, Tensor cache_base, Tensor is_flush, Tensor? replay_indices, Tensor(f!)? rawv_cache, Tensor(g!)? rawk_cache, Tensor(h!)? beta_cache, int rows, bool is_kda=False, bool use_gate_in_kernel=True, float? lower_bound=None, bool beta_is_logit=True, bool round_beta=False, float? scale=None, bool use_qk_l2norm_in_kernel=True, Tensor? cu_seqlens=None, int null_block_id=0, int check_indices=-1, Tensor(i!)? state_scales=None, int state_rounding=0, Tensor(j!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, bool pdl=False) -> ()',
    'replayssm_commit':
        'replayssm_commit(Tensor(a!) write_pos, Tensor(b!) cache_base, Tensor(c!) is_flush, Tensor num_accepted, Tensor state_indices, int max_cache_len, int max_spec_len, int cache_buf_len=0, bool fold_every_commit=False, int null_block_id=-1, int check_indices=-1, bool pdl=False) -> ()',
    'commit_gdn_replayssm_spec':
        'commit_gdn_replayssm_spec(Tensor(a!) write_pos, Tensor(b!) cache_base, Tensor(c!) is_flush, Tensor num_accepted, Tensor state_indices, int max_cache_len, int max_spec_len, int cache_buf_len=0, bool fold_every_commit=False, int null_block_id=0, int check_indices=-1, bool pdl=False) -> ()',
    'replayssm_reset_cursors':
        'replayssm_reset_cursors(Tensor(a!) write_pos, Tensor(b!) cache_base, Tensor(c!) is_flush, Tensor do_reset, Tensor state_indices, int max_cache_len, int max_spec_len, int null_block_id=-1, int check_indices=-1, bool pdl=False) -> ()',
    'reset_gdn_replayssm_spec_cursors':
        'reset_gdn_replayssm_spec_cursors(Tensor(a!) write_pos, Tensor(b!) cache_base, Tensor(c!) is_flush, Tensor do_reset, Tensor state_indices, int max_cache_len, int max_spec_len, int null_block_id=0, int check_indices=-1, bool pdl=False) -> ()',
    # fold-every-commit
    'replayssm_fold_commit':
        'replayssm_fold_commit(Tensor(a!) state, Tensor rawv, Tensor rawk, Tensor g, Tensor beta, Tensor state_indices, Tensor accept_lens, Tensor? track_indices=None, Tensor? steps_to_track=None, bool is_kda=False, bool use_qk_l2norm_in_kernel=True, int null_block_id=-1, int check_indices=-1, bool pdl=False) -> ()',
    'commit_gdn_replayssm_fold_all_layers':
        'commit_gdn_replayssm_fold_all_layers(Tensor(a!) state, Tensor rawv, Tensor rawk, Tensor g, Tensor beta, Tensor state_indices, Tensor accept_lens, Tensor? track_indices=None, Tensor? steps_to_track=None, bool is_kda=False, bool use_qk_l2norm_in_kernel=True, int null_block_id=-1, int check_indices=-1, bool pdl=False) -> ()',
    'commit_kda_replayssm_spec':
        'commit_kda_replayssm_spec(Tensor(a!) state, Tensor rawv, Tensor rawk, Tensor g, Tensor beta, Tensor state_indices, Tensor accept_lens, Tensor? track_indices=None, Tensor? steps_to_track=None, bool is_kda=True, bool use_qk_l2norm_in_kernel=True, int null_block_id=0, int check_indices=-1, bool pdl=False) -> ()',
    'commit_kda_replayssm_spec_all_layers':
        'commit_kda_replayssm_spec_all_layers(Tensor(a!) state, Tensor rawv, Tensor rawk, Tensor g, Tensor beta, Tensor state_indices, Tensor accept_lens, Tensor? track_indices=None, Tensor? steps_to_track=None, bool is_kda=True, bool use_qk_l2norm_in_kernel=True, int null_block_id=0, int check_indices=-1, bool pdl=False) -> ()',
    # the compact circular commit
    'replayssm_circular_commit':
        'replayssm_circular_commit(Tensor(a!) state, Tensor d_cache, Tensor k_cache, Tensor g_cache, Tensor state_indices, Tensor replay_indices, Tensor(b!) write_pos, Tensor(c!) cache_base, Tensor(d!) is_flush, Tensor accept_lens, Tensor? d_residual=None, Tensor? k_residual=None, Tensor? track_indices=None, Tensor? steps_to_track=None, int null_block_id=-1, int check_indices=-1, bool pdl=False) -> ()',
    'commit_gdn_replayssm_circular':
        'commit_gdn_replayssm_circular(Tensor(a!) state, Tensor d_cache, Tensor k_cache, Tensor g_cache, Tensor state_indices, Tensor replay_indices, Tensor(b!) write_pos, Tensor(c!) cache_base, Tensor(d!) is_flush, Tensor accept_lens, Tensor? d_residual=None, Tensor? k_residual=None, Tensor? track_indices=None, Tensor? steps_to_track=None, int null_block_id=-1, int check_indices=-1, bool pdl=False) -> ()',
}


# ---- the conv update and the fused decode layer step ----------------------------------------
# causal-conv1d's signature, SGLang's speculative arguments after it in SGLang's order,
# deltastate's options keyword-only.
PUBLIC["causal_conv1d_update"] = (
    "(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, "
    "conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None, "
    "intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None, "
    "retrieve_parent_token=None, pad_slot_id=-1, metadata=None, validate_data=False, *, "
    "check_indices=None, pdl=False)")
_FUSED_PUBLIC = (
    "(mixed_qkv, conv_weight, conv_state, a, b, A_log, dt_bias, initial_state, out, "
    "ssm_state_indices, conv_bias=None, conv_silu=True, scale=None, norm_weight=None, z=None, "
    "norm_eps=1e-06, use_qk_l2norm_in_kernel=True, {lb}*, conv_state_k=None, conv_state_v=None, "
    "round_beta=False, check_indices=None, pdl=False, d_cache=None, k_cache=None, g_cache=None, "
    "write_pos=None, force_flush=None, advance_write_pos=False, cache_base=None, "
    "circular_replay=False, prefix_gate_cache=False, predecayed_k_cache=False, "
    "state_scales=None, state_rounding=None, rounding_step=None, rounding_seed=0, "
    "rounding_layer=0, workspace=None)")
PUBLIC["gdn_fused_decode_step"] = _FUSED_PUBLIC.format(lb="")
PUBLIC["kda_fused_decode_step"] = _FUSED_PUBLIC.format(lb="lower_bound=None, ")
SCHEMAS["causal_conv1d_update"] = (
    "causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor(b!) out, "
    "Tensor? bias=None, bool silu=False, Tensor? cache_seqlens=None, "
    "Tensor? conv_state_indices=None, Tensor? num_accept_tokens=None, "
    "Tensor(c!)? intermediate_conv_window=None, Tensor? intermediate_state_indices=None, "
    "Tensor? retrieve_next_token=None, Tensor? retrieve_next_sibling=None, "
    "Tensor(d!)? retrieve_parent_token=None, int check_indices=-1, bool pdl=False) -> ()")
_FUSED_SCHEMA = (
    "Tensor mixed_qkv, Tensor conv_weight, Tensor(a!) conv_state, Tensor a, Tensor b, "
    "Tensor A_log, Tensor dt_bias, Tensor(b!) initial_state, Tensor(c!) out, "
    "Tensor ssm_state_indices, Tensor? conv_bias=None, bool conv_silu=True, float? scale=None, "
    "Tensor? norm_weight=None, Tensor? z=None, float norm_eps=1e-06, "
    "bool use_qk_l2norm_in_kernel=True, float? lower_bound=None, Tensor(d!)? conv_state_k=None, "
    "Tensor(e!)? conv_state_v=None, bool round_beta=False, int check_indices=-1, "
    "Tensor(f!)? d_cache=None, Tensor(g!)? k_cache=None, Tensor(h!)? g_cache=None, "
    "Tensor(i!)? write_pos=None, Tensor? force_flush=None, bool advance_write_pos=False, "
    "Tensor(j!)? cache_base=None, bool circular_replay=False, bool prefix_gate_cache=False, "
    "bool predecayed_k_cache=False, Tensor(k!)? workspace=None, Tensor(l!)? state_scales=None, "
    "int state_rounding=0, "
    "Tensor(m!)? rounding_step=None, int rounding_seed=0, int rounding_layer=0, bool pdl=False")
SCHEMAS["gdn_fused_decode_step"] = f"gdn_fused_decode_step({_FUSED_SCHEMA}) -> ()"
SCHEMAS["kda_fused_decode_step"] = f"kda_fused_decode_step({_FUSED_SCHEMA}) -> ()"


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
    assert ds.fused_recurrent_gdn is ds.fused_recurrent_gated_delta_rule  # FLA's aliases
    assert ds.chunk_gdn is ds.chunk_gated_delta_rule


@pytest.mark.parametrize("op", OPS, ids=[op.name for op in OPS])
def test_schema(op):
    assert _derive.schema(op) == SCHEMAS[op.name]


def test_every_binding_has_an_entry():
    """Every binding is used, every public function and torch op has its own name."""
    assert sorted(lib.op_signatures()) == sorted({op.binding_name for op in OPS})
    assert len({op.name for op in OPS}) == len({op.public for op in OPS}) == len(OPS)
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
        op, args=tuple(dataclasses.replace(a, kind=FLOAT) if a.name == "scale" else a
                       for a in op.args))
    with pytest.raises(ImportError, match=r"scale:float[,)].* but .*scale:float\?"):
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
