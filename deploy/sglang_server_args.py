"""The fields of SGLang's ServerArgs in the pinned release (0.5.23, pyproject.toml's `sglang`
extra), with the types of those whose annotation admits only scalars, so that the config can refuse
a misspelt `throughput.sglang_args` key, or a value of the wrong type (`chunked_prefill_size: 4k`),
when it is read, without importing SGLang (not installed where the app is built, often): either
would otherwise fail only once `sglang.Engine(**kwargs)` starts on a GPU replica, or later (ServerArgs
converts nothing).

tests/deploy/test_sglang_server_args.py checks these lists against ServerArgs in the pinned wheel;
update them with the pin.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
# The Python types of the annotations' scalar type names (bool is an int to Python, not to ServerArgs).
SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,), "int": (int,), "float": (float, int), "str": (str,), "None": (type(None),),
}
# Fields whose annotation admits scalars only, by the type names it admits.
SCALAR_FIELDS: dict[tuple[str, ...], frozenset[str]] = {
    ("bool",): frozenset({
        "_radix_eviction_policy_explicitly_set", "abort_on_priority_when_disabled", "allow_auto_truncate",
        "checkpoint_engine_wait_weights_before_ready", "constrained_json_disable_any_whitespace",
        "debug_cuda_graph", "delete_ckpt_after_loading", "disable_aiter_allreduce_fusion_in_decode",
        "disable_aiter_allreduce_fusion_in_prefill", "disable_attn_tp_gather", "disable_chunked_prefix_cache",
        "disable_cuda_graph", "disable_cuda_graph_padding", "disable_custom_all_reduce",
        "disable_decode_cuda_graph", "disable_fast_image_processor", "disable_flashinfer_autotune",
        "disable_flashinfer_cutlass_moe_fp4_allgather", "disable_hybrid_swa_memory", "disable_outlines_disk_cache",
        "disable_overlap_schedule", "disable_prefill_cuda_graph", "disable_priority_preemption",
        "disable_radix_cache", "disable_shared_experts_fusion", "disable_tokenizer_batch_decode",
        "disaggregation_decode_enable_offload_kvcache", "disaggregation_decode_enable_radix_cache",
        "disaggregation_enable_kv_checksum", "dllm_fdfo", "enable_adaptive_dispatch_to_encoder",
        "enable_aiter_allreduce_fusion", "enable_amd_monokernel", "enable_attn_tp_input_scattered",
        "enable_broadcast_mm_inputs_process", "enable_cache_report", "enable_cp_decode_attn_tp",
        "enable_cp_tp_group_sharing", "enable_cudagraph_gc", "enable_custom_logit_processor",
        "enable_deepseek_v4_fp4_indexer", "enable_dense_mlp_attn_tp", "enable_deterministic_inference",
        "enable_dp_attention", "enable_dp_attention_local_control_broadcast", "enable_dp_lm_head",
        "enable_draft_weights_cpu_backup", "enable_dsa_cache_layer_split", "enable_dynamic_batch_tokenizer",
        "enable_dynamic_chunking", "enable_elastic_expert_backup", "enable_encoder_swa_bounded_replay",
        "enable_eplb", "enable_flashinfer_allreduce_fusion", "enable_flexkv", "enable_forward_pass_metrics",
        "enable_fp32_lm_head", "enable_fused_moe_sum_all_reduce", "enable_hierarchical_cache", "enable_hisparse",
        "enable_http2", "enable_http_worker_reuseport", "enable_int8_mamba_checkpoint", "enable_kv_cache_sharding",
        "enable_layernorm_sp", "enable_layerwise_nvtx_marker", "enable_linear_replayssm",
        "enable_linear_replayssm_spec", "enable_linker_mla_dedup", "enable_lmcache",
        "enable_mamba_cache_stochastic_rounding", "enable_megamoe_for_layernorm_sp", "enable_memory_saver",
        "enable_metrics", "enable_metrics_for_all_schedulers", "enable_mfu_metrics", "enable_mis",
        "enable_mixed_chunk", "enable_mm_global_cache", "enable_mscclpp", "enable_multi_layer_eagle",
        "enable_nccl_nvls", "enable_nvidia_megakernel", "enable_p2p_check", "enable_page_major_kv_layout",
        "enable_paged_experts", "enable_pd_role_switch", "enable_pdmux", "enable_precise_embedding_interpolation",
        "enable_prefill_cp", "enable_prefill_delayer", "enable_prefix_mm_cache", "enable_priority_scheduling",
        "enable_profile_cuda_graph", "enable_request_time_stats_logging", "enable_response_store",
        "enable_return_aux_hidden_states", "enable_return_hidden_states", "enable_return_indexer_topk",
        "enable_return_routed_experts", "enable_scattered_sconv", "enable_session_radix_cache",
        "enable_shared_experts_attn_tp", "enable_single_batch_overlap", "enable_ssl_refresh",
        "enable_streaming_session", "enable_strict_thinking", "enable_symm_mem", "enable_tokenizer_batch_encode",
        "enable_torch_compile", "enable_torch_compile_debug_mode", "enable_torch_symm_mem", "enable_trace",
        "enable_two_batch_overlap", "enable_unified_cache_external_linker", "enable_unified_memory",
        "enable_w4a4_mxfp4_megamoe", "enable_waterfill", "enable_watermark", "enable_weights_cpu_backup",
        "encoder_only", "enforce_disable_flashinfer_allreduce_fusion", "enforce_shared_experts_fusion",
        "export_metrics_to_file", "flashinfer_mla_disable_ragged", "grpc_mode", "incremental_streaming_output",
        "is_embedding", "language_model_only", "language_only", "log_requests", "lora_strict_loading",
        "lora_use_virtual_experts", "mlx_enable_sampling", "pre_warm_nccl", "prefill_only_disable_kv_cache",
        "quantize_and_serve", "remote_instance_weight_loader_start_seed_via_transfer_engine", "return_input_ids",
        "return_output_ids", "schedule_low_priority_values_first", "show_time_cost", "skip_server_warmup",
        "skip_tokenizer_init", "sleep_on_idle", "smg_grpc_mode", "speculative_adaptive",
        "speculative_dspark_align_verify_tokens_to_graph_tier", "speculative_use_block_verification",
        "speculative_use_rejection_sampling", "stream_response_default_include_usage", "strip_thinking_cache",
        "triton_attention_reduce_in_fp32", "trust_mm_content_hashes", "trust_remote_code",
        "trust_request_chat_template", "use_ray", "uses_mamba_radix_cache", "watermark_default_enabled",
        "watermark_enforce_all", "weight_loader_disable_mmap", "weight_loader_drop_cache_after_load",
        "weight_loader_prefetch_checkpoints",
    }),
    ("None", "str"): frozenset({
        "admin_api_key", "api_key", "attention_backend", "aux_hidden_state_capture", "chat_template",
        "completion_template", "constrained_json_whitespace_pattern", "cp_strategy", "crash_dump_folder",
        "dcp_comm_backend", "debug_tensor_dump_input_file", "debug_tensor_dump_output_folder",
        "decode_attention_backend", "decoupled_spec_bind_endpoint", "decrypted_config_file",
        "decrypted_draft_config_file", "deepep_config", "device", "disaggregation_decode_retraction_backup",
        "disaggregation_ib_device", "dist_init_addr", "dllm_algorithm", "dllm_algorithm_config", "download_dir",
        "dsa_decode_backend", "dsa_prefill_backend", "export_metrics_to_file_dir", "file_storage_path",
        "flexkv_config_file", "forward_pass_metrics_ipc_name", "grammar_backend", "hf_chat_template_name",
        "hicache_storage_backend", "hicache_storage_backend_extra_config", "hisparse_config", "kt_weight_path",
        "kv_events_config", "linear_attn_decode_backend", "linear_attn_prefill_backend",
        "linear_attn_verify_backend", "lmcache_config_file", "load_publish_endpoint", "log_level_http",
        "mamba_ssm_dtype", "mm_attention_backend", "model_checksum", "modelexpress_config",
        "modelopt_checkpoint_restore_path", "modelopt_checkpoint_save_path", "modelopt_export_path",
        "mooncake_ib_device", "msprobe_dump_config", "otlp_service_name", "pdmux_config_path", "ple_offload_dir",
        "preferred_sampling_params", "prefill_attention_backend", "quantization", "quantization_param_path",
        "radix_cache_backend", "reasoning_parser", "remote_instance_weight_loader_seed_instance_ip",
        "return_hidden_states_mode", "revision", "rl_on_policy_target", "rl_quant_profile", "sampling_backend",
        "served_model_name", "sidecar", "spec_trace_dir", "speculative_adaptive_config", "speculative_algorithm",
        "speculative_draft_attention_backend", "speculative_draft_kv_cache_dtype", "speculative_draft_load_format",
        "speculative_draft_model_path", "speculative_draft_model_quantization", "speculative_draft_model_revision",
        "speculative_dspark_confidence_sts_path", "speculative_dspark_sps_table_path",
        "speculative_moe_a2a_backend", "speculative_moe_runner_backend", "speculative_ngram_external_corpus_path",
        "speculative_token_map", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_keyfile_password",
        "tokenizer_path", "tool_call_parser", "tool_server", "uno_lora_path", "warmups", "watermark_config",
        "watermark_key", "watermark_key_b", "weight_cache_socket",
    }),
    ("int",): frozenset({
        "asr_max_buffer_seconds", "asr_max_concurrent_sessions", "attn_cp_size", "attn_dp_size", "base_gpu_id",
        "batch_notify_size", "c128_page_size", "cpu_offload_gb", "dcp_size", "decode_log_interval",
        "detokenizer_worker_num", "disaggregation_bootstrap_port", "disaggregation_decode_polling_interval",
        "dp_size", "dsa_triton_union", "dwdp_size", "dynamic_batch_tokenizer_batch_size", "encoder_bootstrap_port",
        "engine_info_bootstrap_port", "ep_join_rank_offset", "ep_num_redundant_experts", "ep_size",
        "eplb_rebalance_num_iterations", "gpu_id_step", "grpc_response_timeout_secs", "hicache_size",
        "hicache_storage_prefetch_retry_max_attempts", "hicache_storage_prefetch_retry_poll_interval",
        "http2_initial_connection_window_size", "http2_max_concurrent_streams", "kt_threadpool_count",
        "kv_canary_sweep_interval", "linear_replayssm_cache_len", "load_snapshot_publish_interval",
        "log_requests_level", "mamba_cache_philox_rounds", "mamba_max_states_per_path", "mamba_track_interval",
        "max_loras_per_batch", "max_prefill_tokens", "media_url_max_file_size_mb", "mm_io_worker_num",
        "mm_processor_worker_num", "moe_dp_size", "nnodes", "node_rank", "num_continuous_decode_steps",
        "num_reserved_decode_tokens", "offload_group_size", "offload_num_in_group", "offload_prefetch_step",
        "optimistic_prefill_attempts", "port", "pp_async_batch_depth", "pp_size", "prefill_decode_interval_min_bs",
        "prefill_delayer_max_delay_passes", "priority_scheduling_preemption_threshold", "sampling_mask_max_tokens",
        "scheduler_recv_interval", "sm_group_num", "speculative_domino_candidate_pool_size",
        "speculative_ngram_capacity", "speculative_ngram_external_corpus_max_tokens",
        "speculative_ngram_external_sam_budget", "speculative_ngram_max_bfs_breadth",
        "speculative_ngram_max_trie_depth", "speculative_ngram_min_bfs_breadth", "stream_interval",
        "tokenizer_worker_num", "torch_compile_max_bs", "tp_size", "triton_attention_num_kv_splits",
        "watermark_context_window", "weight_cache_timeout", "weight_loader_prefetch_num_threads",
    }),
    ("str",): frozenset({
        "bf16_gemm_backend", "disaggregation_transfer_backend", "dsa_paged_mqa_logits_backend", "dsa_topk_backend",
        "dsv4_attn_backend", "dsv4_prefill_backend", "dtype", "encoder_transfer_backend", "eplb_algorithm",
        "fastapi_root_path", "forward_pass_metrics_worker_id", "fp4_gemm_runner_backend", "fp8_gemm_runner_backend",
        "hicache_host_memory_mode", "hicache_io_backend", "hicache_mem_layout", "hicache_storage_prefetch_policy",
        "hicache_write_policy", "host", "init_expert_location", "json_model_override_args", "kt_method",
        "kv_cache_dtype", "kv_canary", "kv_canary_real_data", "linear_attn_backend", "load_balance_method",
        "load_format", "log_level", "log_requests_format", "lora_backend", "lora_eviction_policy", "mamba_backend",
        "mamba_radix_cache_strategy", "mm_global_cache_backend", "model_config_parser", "model_impl",
        "model_loader_extra_config", "model_path", "moe_runner_backend", "offload_mode", "otlp_traces_endpoint",
        "ple_offload_backend", "prefill_kv_cache_dequant_dtype", "qsa_indexer_dtype", "radix_eviction_policy",
        "retraction_policy", "sampling_defaults", "schedule_policy", "speculative_attention_mode",
        "speculative_dsa_topk_backend", "tokenizer_backend", "tokenizer_metrics_custom_labels_header",
        "tokenizer_mode", "trace_modules", "unified_cache_external_linker_backend", "weight_cache_mode",
        "weight_version",
    }),
    ("None", "int"): frozenset({
        "chunked_prefill_size", "constrained_json_max_whitespace_cnt", "context_length", "cuda_graph_max_bs_decode",
        "cuda_graph_max_bs_prefill", "cuda_graph_max_seq_len_prefill", "cuda_graph_prefill_max_context",
        "decoupled_spec_rank", "default_priority_value", "disaggregation_decode_extra_slots", "dist_timeout",
        "elastic_ep_initial_size", "eplb_rebalance_layers_per_chunk", "expert_distribution_recorder_buffer_size",
        "gated_launch_port", "grpc_port", "grpc_worker_threads", "int8_mamba_ckpt_size", "kt_cpuinfer",
        "kt_max_deferred_experts_per_token", "kt_num_gpu_experts", "max_ep_size", "max_loaded_loras",
        "max_lora_chunk_size", "max_lora_rank", "max_mamba_cache_size", "max_queued_requests",
        "max_running_requests", "max_total_tokens", "min_free_slots_delay", "mm_preprocess_cache_size_mb",
        "moe_dense_tp_size", "nccl_port", "page_size", "paged_experts_num_resident", "pp_max_micro_batch_size",
        "prefill_decode_interval", "prefill_max_requests", "random_seed",
        "remote_instance_weight_loader_seed_instance_service_port", "shared_experts_tp_size",
        "smg_http_sidecar_port", "speculative_dflash_block_size", "speculative_draft_sink_size",
        "speculative_draft_window_size", "speculative_dspark_block_size", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "speculative_num_steps", "swa_prefix_tails",
        "triton_attention_split_tile_size",
    }),
    ("None", "bool"): frozenset({
        "_speculative_draft_quantization_explicitly_set", "_swa_full_tokens_ratio_explicitly_set",
        "dcp_replicate_q_proj", "enable_decoder_swa_bounded_replay", "enable_dsa_fused_indexer",
        "enable_fused_qk_norm_rope", "enable_lean_attention", "enable_lora", "enable_lora_overlap_loading",
        "enable_multimodal", "enable_quant_communications", "enable_tf32_matmul", "enable_tp_lm_head_all_to_all",
        "experts_shared_outer_loras", "mm_enable_dp_encoder", "ple_offload_embedding",
        "speculative_enable_w4a4_mxfp4_megamoe",
    }),
    ("float",): frozenset({
        "disaggregation_decode_host_receive_threshold", "dynamic_batch_tokenizer_batch_timeout",
        "elastic_ep_scale_timeout", "eplb_min_rebalancing_utilization_threshold", "gc_warning_threshold_secs",
        "lora_drain_wait_threshold", "schedule_conservativeness", "speculative_accept_threshold_acc",
        "speculative_accept_threshold_single", "tbo_token_distribution_threshold", "watchdog_timeout",
        "watermark_max_probability", "watermark_mixing_probability",
    }),
    ("None", "float"): frozenset({
        "hicache_host_memory_fraction", "hicache_ratio", "mamba_full_memory_ratio", "mem_fraction_static",
        "prefill_delayer_max_delay_ms", "prefill_delayer_queue_min_ratio",
        "prefill_delayer_token_usage_low_watermark", "soft_watchdog_timeout", "swa_full_tokens_ratio",
    }),
}
# The others (lists, dicts, Literal choices, classes): their values are for SGLang to check.
UNCHECKED_FIELDS = frozenset({
    "allowed_media_domains", "boundary_reduction", "bucket_e2e_request_latency", "bucket_inter_token_latency",
    "bucket_time_to_first_token", "cuda_graph_backend_decode", "cuda_graph_backend_prefill", "cuda_graph_bs_decode",
    "cuda_graph_bs_prefill", "cuda_graph_config", "custom_sigquit_handler", "custom_weight_loader",
    "debug_tensor_dump_layers", "decoupled_spec_connect_endpoints", "decoupled_spec_role",
    "deepep_dispatcher_output_dtype", "deepep_mode", "deepep_v2_mode", "default_chat_template_kwargs",
    "disaggregation_decode_allocation_policy", "disaggregation_mode", "elastic_ep_backend", "encoder_register_urls",
    "encoder_urls", "ep_dispatch_algorithm", "ep_join_mode", "expert_balancedness_report_mode",
    "expert_distribution_recorder_mode", "extra_metric_labels", "flashinfer_a2a_dispatch_type",
    "flashinfer_allreduce_fusion_backend", "flashinfer_autotune_skip_ops", "flashinfer_mxfp4_moe_precision",
    "forward_hooks", "fuseep_mode", "gc_threshold", "generation_tokens_buckets", "image_processor_backend",
    "limit_mm_data_per_request", "log_requests_target", "lora_paths", "lora_target_modules", "mm_feature_transport",
    "mm_process_config", "modelopt_quant", "moe_a2a_backend", "numa_node", "prefill_delayer_forward_passes_buckets",
    "prefill_delayer_wait_seconds_buckets", "prompt_tokens_buckets", "radix_eviction_policy_config",
    "remote_instance_weight_loader_backend", "remote_instance_weight_loader_send_weights_group_ports",
    "return_aux_hidden_state_layer_ids", "sidecar_args", "speculative_boundary_reduction",
    "speculative_ngram_match_type", "startup_weight_load_mode", "stat_loggers",
    "tokenizer_metrics_allowed_custom_labels", "unified_cache_external_linker_config",
    "uvicorn_access_log_exclude_prefixes",
})
SERVER_ARGS_FIELDS = UNCHECKED_FIELDS.union(*SCALAR_FIELDS.values())


def server_arg_type_problem(key: str, value: object) -> str | None:
    """What is wrong with the type of `value` for the ServerArgs field `key`, or None."""
    for type_names, keys in SCALAR_FIELDS.items():
        if key in keys:
            accepted = [name for name in type_names if isinstance(value, SCALAR_TYPES[name])
                        and (name == "bool" or not isinstance(value, bool))]
            if accepted:
                return None
            spelled = [name for name in type_names if name != "None"] + ["null"] * ("None" in type_names)
            return f"{key!r} must be {' or '.join(spelled)}, got {value!r}"
    return None
