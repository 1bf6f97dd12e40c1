"""Shared fixtures (evaluation fixtures are prefixed `eval_`) and the one list of slow tests.

`python -m pytest -m "not slow"` is the fast loop (about 1,480 tests in 82 s on 2 cores, `--durations`); CI runs
everything."""

import os

# Triton decides at its first import whether to interpret kernels on the CPU, and `import kvpack`
# can import it indirectly (transformers -> a peer -> torch.compile): set the switch before anything.
# KVPACK_TEST_DEVICE=cuda runs the Triton tests compiled on a GPU instead (tests/triton_device.py).
if os.environ.get("KVPACK_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fnmatch  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests left out of the fast loop, as node-id patterns (fnmatch). Besides the tests marked `slow` where they are
# defined (those that load a real model), these were the longest of the suite on 2 cores (`--durations`, with
# --junitxml for per-test sums): every method through a tiny model's generate in each mode, a fresh Python process
# importing torch and transformers, a peer's kernels compiled on first use, 40K-token segments, property searches,
# coverage simulations, torch.library's opcheck over every op. The fast loop keeps each codec's and kernel's unit
# tests and the compressed attention against its reference; CI runs everything.
SLOW = (
    "tests/test_cli.py::test_compare_writes_rows_and_plot",  # hf-quanto compiles its kernels on first use
    "tests/test_metrics.py::test_core_and_collect_need_no_prometheus_client",  # subprocess
    "tests/test_validation.py::test_core_imports_and_runs_without_the_eval_extras",  # subprocess
    "tests/test_bounded.py::test_torch_paths_allocate_at_most_one_chunk_of_a_40k_segment*",
    "tests/test_bounded.py::test_torch_paths_run_on_another_device_with_state_copied_once*",
    "tests/test_budget.py::*",  # a tiny model generating under a byte budget, per method
    "tests/test_properties.py::*",  # hypothesis searches
    "tests/test_eval_stats.py::test_95_interval_covers_the_true_ratio_about_95_percent_of_the_time*",
    "tests/test_eval_stats.py::test_block_bootstrap_keeps_coverage_on_autocorrelated_tokens_where_iid_loses_it",
    "tests/test_eval_stats.py::test_interval_shrinks_as_one_over_sqrt_tokens",
    "tests/test_eval_stats.py::test_wilson_at_the_edges_and_against_scipy",
    "tests/test_eval_stats.py::test_wilson_coverage_is_near_nominal_by_exact_binomial_sums",
    "tests/test_ops.py::test_opcheck*",
    "tests/test_ops.py::test_torch_compile_fullgraph",
    "tests/test_readme.py::test_readme_and_docs_are_built_from_their_parts",  # subprocess; CI runs the build check too
    "tests/test_bounded.py::test_chunked_scores_and_weighted_sums_equal_decode_then_matmul*",
    "tests/test_codecs.py::test_qjl_unbiased_with_bounded_variance*",
    "tests/test_codecs.py::test_turboquant_prod_unbiased_with_bounded_variance*",
    "tests/test_cache.py::test_turning_mean_keys_decode_fused_and_through_ops_as_over_the_dequantized_cache*",
    "tests/test_heads.py::test_every_attention_path_equals_attention_over_the_dequantized_cache*",
    "tests/test_heads.py::test_the_decode_benchmark_runs_auto_methods_from_their_configs",
    "tests/test_eval_perplexity.py::test_runner_rows_carry_the_interval_and_the_needle_summary_as_json",
    "tests/test_eval_needle.py::test_grid_has_every_cell_kind_and_trial_with_distinct_needles_paired_across_runs",
    "tests/test_tracker.py::test_adaptive_bench_moves_the_boundary_on_a_model_and_records_its_path",
    "tests/test_auto.py::test_fisher_diagonal_is_the_exact_fisher_of_the_scored_tokens",
    "tests/test_cli.py::test_eval_writes_table_and_json",
    "tests/test_cli.py::test_demo_runs_and_summarizes",
    "tests/test_cli.py::test_compare_saves_rows_after_every_method",
    # Every method through a tiny model's generate, per mode: the cache against DynamicCache end to end.
    "tests/test_padding.py::test_padded_row_matches_its_unbatched_run*",
    "tests/test_serialize.py::test_round_trip_is_bit_exact_and_generation_continues_identically*",
    "tests/test_serialize.py::test_round_trip_without_kvpack_attention*",
    "tests/test_cache.py::test_lossless_methods_reproduce_dynamic_cache_greedy*",
    "tests/test_cache.py::test_left_padded_batch_matches_dynamic_cache*",
    "tests/test_cache.py::test_beam_search_matches_dynamic_cache*",
    "tests/test_cache.py::test_sampling_matches_dynamic_cache_with_same_seed*",
    "tests/test_cache.py::test_assisted_generation_crops_correctly",
    "tests/test_cache.py::test_fused_decode_equals_reference_over_dequantized_cache*",
    "tests/test_cache.py::test_device_decode_path_through_custom_ops*",
    "tests/test_cache.py::test_shard_rank_comes_from_the_prompts_real_queries_under_kvpack_attention*",
    "tests/test_serve_blocks.py::test_turboquant_relative_mse_at_the_lloyd_max_distortion*",
    "tests/test_serve_blocks.py::test_file_round_trip_adds_nothing_to_the_codecs_error*",
    "tests/test_tiers.py::test_tokens_older_than_the_boundary_are_archived_in_whole_blocks*",
    "tests/test_tiers.py::test_turboquant_tiers_demote_4_to_3_and_2_bits_with_little_extra_error",
    "tests/test_triton_shard.py::test_segments_cover_the_layouts",
    "tests/test_triton_kernels.py::test_trellis_encode*",
    # Searches and fits that take seconds each: trellis training, Shard's rank search and byte target.
    "tests/test_trellis.py::test_symbols_round_trip_to_the_searched_states",
    "tests/test_trellis.py::test_trained_trellis_beats_the_scalar_optimum_at_two_bits",
    "tests/test_shard_codecs.py::test_shard_byte_target_holds_the_cache_measured",
    "tests/test_shard_codecs.py::test_pca_rank_from_queries_is_the_smallest_within_the_score_error*",
    "tests/test_shard_codecs.py::test_pca_scores_equal_dequantize_rope_matmul*",
    "tests/test_serialize.py::test_byte_target_shard_round_trip",
    "tests/test_tracker.py::test_decode_estimates_are_probability_masses_and_fall_as_the_boundary_rises",
    "tests/test_tracker.py::test_archive_bits_move_only_once_attention_reaches_the_archive",
    "tests/test_tracker.py::test_archive_bits_apply_to_new_blocks_and_the_old_ones_round_trip_through_a_file",
    "tests/test_cli.py::test_a_method_that_fails_mid_run_keeps_every_row_and_exits_1",
    "tests/test_codecs.py::test_turboquant_properties",
    "tests/test_codecs.py::test_turboquant_mse_matches_numerical_optimum*",
    "tests/test_codecs.py::test_qjl_outlier_channels_are_found_and_cut_the_error",
    "tests/test_codecs.py::test_turboquant_mse_large_dim_matches_published",
    "tests/test_eval_perplexity.py::test_chunked_uncompressed_matches_full_forward*",
    "tests/test_bench_device.py::test_batched_decode_with_random_weights_reports_tokens_and_bytes",
    "tests/test_triton_shard.py::test_pca_vq_attention*",
    "tests/test_triton_shard.py::test_reference_matches_codec_path*",
    "tests/test_metrics.py::test_tiered_cache_bytes_are_the_bytes_its_tensors_hold",
    "tests/test_metrics.py::test_endpoint_serves_the_bytes_counted_from_the_tensors",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_layer_left_pending():
    """Tests that drive a layer by hand (update with kvpack attention 'on', no attention call) leave it waiting
    on this thread; the next test's model must not inherit that."""
    yield
    from kvpack.cache.layer import PENDING

    PENDING.layer = None


@pytest.fixture(scope="session")
def eval_tiny():
    """(model, tokenizer): a 2-layer random Llama (hidden 64, 4 heads of dim 64, 2 kv heads) and a byte tokenizer."""
    from kvpack.models import tiny_random_model

    return tiny_random_model(seed=0)


@pytest.fixture(scope="session")
def eval_tiny_ids():
    """600 reproducible token ids in the tiny model's vocabulary."""
    return torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def eval_smollm2():
    """(model, tokenizer): the real default model, fp32 (converted once into the kvpack cache dir)."""
    from kvpack.models import load_model

    return load_model("smollm2-135m")
