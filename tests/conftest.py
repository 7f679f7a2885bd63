"""Test setup: CPU backend with several host devices, fp32 matmuls (pyproject puts the repo on sys.path)."""

import os
import subprocess
import sys

# Before jax starts a backend: data-parallel tests need more than one device.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from nsa_jax.tools.aot import cuda_plugin_available  # noqa: E402 (XLA_FLAGS is read when a backend starts)

# The tests compile hundreds of small programs that then run for milliseconds, so on the CPU
# their time is XLA's compiles: without LLVM's optimizing passes the suite takes about a third
# less time, and with XLA:CPU's classic loop emitters in place of its newer MLIR fusion emitters
# a third less again where this jaxlib still has them (docs/lab/2026-11-28-test-compile-time.md);
# the same results either way, no fast-math in either. Not where jax's CUDA plugin is installed:
# there the aot tier compiles for the cards, and its register, spill and memory figures must be
# those of the default pipeline.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def fast_compile_flags() -> list[str]:
    """FAST_COMPILE_FLAGS that this jaxlib takes. jax 0.12 dropped the classic emitters and their flag,
    which XLA then refuses at start: a probe process says (about 2 s, once a run: workers inherit)."""
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS[1], "JAX_PLATFORMS": "cpu"}
    classic = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=300).returncode == 0
    return list(FAST_COMPILE_FLAGS[: 2 if classic else 1])


if os.environ["JAX_PLATFORMS"] == "cpu" and not cuda_plugin_available():
    if FAST_COMPILE_FLAGS[0] not in os.environ["XLA_FLAGS"]:  # a worker or subprocess of a run that has them
        os.environ["XLA_FLAGS"] += "".join(f" {f}" for f in fast_compile_flags())  # helpers.cpu_env passes them on

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Tests the fast tier (`-m "not slow"`) leaves to the full suite: each repeats, for another variant
# or at a larger size, what a cheaper test of the fast tier checks, and took 4-30 s in the
# `--durations` table; without them the fast tier keeps to about 4 minutes on 2 cores.
FULL_SUITE_ONLY = frozenset(
    [
        "tests/test_block_scores.py::test_fused_scores_and_selection_match_float64_reference[G16-T96-l16-d16-lp16-f32]",
        "tests/test_block_scores.py::test_fused_scores_and_selection_match_float64_reference[G6-T150-l16-d8-lp16-f32]",
        "tests/test_block_scores.py::test_fused_selection_exact_ties[G6-one-tie-group-f32]",
        "tests/test_block_scores.py::test_select_from_scores_equals_select_blocks[T64-lp16-n16-fewer-candidates]",
        "tests/test_benchmarks.py::test_profile_step_reads_a_saved_trace",
        "tests/test_context.py::test_two_devices_at_a_ragged_length_equal_one",
        "tests/test_convert.py::test_a_run_starts_from_the_folder_and_refuses_another_tokenizer",
        "tests/test_convert.py::test_converted_folders_give_the_dense_logits",
        "tests/test_export.py::test_drop_nsa_writes_the_selection_branch_as_the_attention_and_measures_it",
        "tests/test_inference.py::test_decode_matches_forward_at_every_position[G3K1n4minmax]",
        "tests/test_inference.py::test_decode_matches_forward_at_every_position[G3K1n4rescore]",
        "tests/test_kernels_pallas.py::test_reverse_index_segments_cover_every_entry[two-digits-one-chunk]",
        "tests/test_kernels_pallas.py::test_selection_dkv_skewed_blocks[1-bf16]",
        "tests/test_kernels_pallas.py::test_selection_dkv_skewed_blocks[16-bf16]",
        "tests/test_kernels_tpu.py::test_nsa_layer_on_the_tpu_plan_matches_the_reference",
        "tests/test_kernels_tpu.py::test_sorted_reverse_index_equals_the_counting_one",
        "tests/test_kernels_tpu.py::test_tpu_selection_matches_reference[G4-d64-T100-bs32-bf16]",
        "tests/test_kernels_tpu.py::test_tpu_selection_matches_reference[G6-d64-T70-f32]",
        "tests/test_kernels_xla.py::test_selection_matches_per_token_and_dense_grads[1-2-37-8-3-16-gather]",
        "tests/test_long_eval.py::test_the_same_command_skips_what_its_out_folder_holds",
        "tests/test_nsa_layer.py::test_layer_matches_reference_forward_and_indices[6-1-37-avg]",
        "tests/test_nsa_layer.py::test_matmul_parts_gradients_match_separate_matmuls",
        "tests/test_nsa_layer.py::test_pallas_layer_matches_reference_forward_and_indices[6-2-61-auto-cudnn]",
        "tests/test_nsa_layer.py::test_pallas_layer_with_the_key_scorers_matches_reference[rescore-pallas]",
        "tests/test_nsa_layer.py::test_scorers_match_reference_forward_and_indices[mix-0-2-2-53]",
        "tests/test_pallas_model.py::test_local_and_global_layers_run_the_pallas_kernels_inside_their_cond",
        "tests/test_pretrained.py::test_a_family_s_logits_and_greedy_text_are_transformers[gemma2]",
        "tests/test_pretrained.py::test_a_family_s_logits_and_greedy_text_are_transformers[llama2]",
        "tests/test_pretrained.py::test_a_family_s_logits_and_greedy_text_are_transformers[llama3]",
        "tests/test_pretrained.py::test_a_family_s_logits_and_greedy_text_are_transformers[mistral]",
        "tests/test_pretrained.py::test_a_family_s_logits_and_greedy_text_are_transformers[qwen2]",
        "tests/test_pretrained.py::test_gemma_s_local_and_global_layers_are_transformers_in_every_layout[unrolled-gemma2]",
        "tests/test_pretrained.py::test_gemma_s_local_and_global_layers_are_transformers_in_every_layout[unrolled-gemma3]",
        "tests/test_pretrained.py::test_smollm2_from_gguf_is_transformers_at_512_tokens",
    ]
)


# The release tier: slow tests the README's command (and so CI) skips, saying so, unless `--release`
# is given. Most repeat a check the suite keeps for another variant, process count, card or length;
# five (added 2026-12-07, to bring CI toward 30 minutes) check a behaviour beside one the suite keeps
# end to end. The value names what the suite keeps. Together about 16 minutes of the full suite's 54
# on one core, and 5 of the aot tier's 27 tests (the `--durations` tables of
# docs/lab/2026-11-28-test-compile-time.md). Run them before a release and after changing
# nsa_jax/parallel, the checkpoint's layout or the kernels: `python -m pytest -q -n 2 --release`.
RELEASE_ONLY = dict(
    [
        (
            "tests/test_pretrained.py::test_smollm2_from_gguf_is_transformers_at_2048_tokens_and_greedy",
            "SmolLM2 at 512 tokens; the families' 16 greedy tokens through the decode cache",
        ),
        (
            "tests/test_pretrained.py::test_gemma_s_gradient_is_the_same_through_the_traced_and_the_static_layer_kinds[dense]",
            "the same test with NSA's global layers",
        ),
        (
            "tests/test_context.py::test_four_devices_equal_one_with_data_and_seq",
            "C = 2 against one device; data 2 x seq 2 and C = 4 in the resume test",
        ),
        (
            "tests/test_context.py::test_checkpoints_cross_between_fsdp_with_context_and_dp_on_one_device_per_row",
            "a checkpoint resumed across context degrees; across strategies in test_strategies.py",
        ),
        (
            "tests/test_context.py::test_the_pallas_kernels_under_two_devices_equal_one",
            "each kernel at a query offset (test_kernels_offset.py); C = 2 against one device on the XLA path",
        ),
        (
            "tests/test_context.py::test_zero1_under_context_parallelism_steps_as_dp_with_the_moments_split",
            "zero1 on 2 devices (test_strategies.py); fsdp under C = 2 (the chunked-loss test)",
        ),
        (
            "tests/test_context.py::test_the_scorers_under_two_devices_equal_one[mix]",
            "the same test with rescore",
        ),
        (
            "tests/test_context.py::test_one_device_noise_floor",
            "the tolerances it calibrated, in every C = 2 test",
        ),
        (
            "tests/test_elastic.py::test_resume_on_another_layout_trains_on_the_same_rows[2proc-1proc]",
            "the same test from 1 process to 2, and from 2 devices to 1",
        ),
        (
            "tests/test_elastic.py::test_resume_on_another_layout_trains_on_the_same_rows[1dev-4dev]",
            "the same test from 2 devices to 1; test_context.py's resume at C = 4",
        ),
        (
            "tests/test_elastic.py::test_tokenized_resume_on_another_process_count_trains_on_the_same_rows[2proc-1proc]",
            "the same test from 1 process to 2",
        ),
        (
            "tests/test_kernels_tpu.py::test_nsa_layer_on_the_tpu_plan_under_context_parallelism_equals_one_device",
            "the TPU plan's layer against the reference; the tpu tier's compiles",
        ),
        (
            "tests/test_learning_options.py::test_phases_on_two_devices_match_one_device[dp]",
            "the same test under fsdp",
        ),
        (
            "tests/test_strategies.py::test_rows_with_their_own_weights_train_alike_under_every_strategy[pmap]",
            "pmap against the reference (test_two_devices_match_single_device_reference)",
        ),
        (
            "tests/test_reviews.py::test_the_fine_tune_trains_alike_under_every_strategy",
            "every strategy against the one-device reference (test_strategies.py)",
        ),
        (
            "tests/test_learning_options.py::test_phases_on_two_devices_match_one_device[fsdp]",
            "the phases on one device (test_dense_warmup_and_distill_steps_train_each_phase_model); fsdp against "
            "the reference (test_strategies.py)",
        ),
        (
            "tests/test_pretrained.py::test_gemma_s_gradient_is_the_same_through_the_traced_and_the_static_layer_kinds[nsa]",
            "Gemma's layer kinds, traced and static, against transformers in every layout; NSA's gradients "
            "against the float64 references",
        ),
        (
            "tests/test_kernel_guard.py::test_guard_under_context_parallelism_checks_the_kernels_at_a_query_offset",
            "the guard on one device; each kernel at a query offset (test_kernels_offset.py)",
        ),
        (
            "tests/test_elastic.py::test_resume_on_another_layout_trains_on_the_same_rows[1proc-2proc]",
            "the same test from 2 devices to 1; the tokenized resume from 1 process to 2",
        ),
        (
            "tests/test_strategies.py::test_rows_with_their_own_weights_train_alike_under_every_strategy[gspmd]",
            "the same test under dp; gspmd against the reference (test_two_devices_match_single_device_reference)",
        ),
        (
            "tests/test_model.py::test_a_chunked_loss_equals_the_loss_of_whole_logits[True]",
            "the same test with untied embeddings; the chunked loss under C = 2 (test_context.py)",
        ),
        (
            "tests/test_model.py::test_model_is_causal[minmax]",
            "the same test with cmp; each scorer's layer against its float64 reference (test_nsa_layer.py)",
        ),
        (
            "tests/test_model.py::test_model_is_causal[mix]",
            "the same test with cmp; each scorer's layer against its float64 reference (test_nsa_layer.py)",
        ),
        (
            "tests/test_kernel_guard.py::test_guard_checks_the_key_scoring_kernel_with_the_compressed_branch"
            "[minmax-minmax_pallas (nsa_minmax_select)]",
            "the same test with rescore; the minmax kernel against its float64 reference (test_scorers.py)",
        ),
        (
            "tests/test_experiments.py::test_selection_recall_cli_reads_a_checkpoint",
            "the needle_selection CLI on a checkpoint; selection_recall's measure against loops",
        ),
        (
            "tests/test_experiments.py::test_selection_locality_cli_reads_a_checkpoint",
            "the needle_selection CLI on a checkpoint; selection_locality's count of loaded blocks",
        ),
        (
            "tests/test_experiments.py::test_kv_recall_ablation_cli_variant_overrides",
            "launch.train with --set overrides (test_train_cli.py); kv_recall's loss on the answers (test_evaluate.py)",
        ),
        (
            "tests/test_benchmarks.py::test_bench_attention_times_nsa_variants_beside_the_config",
            "bench_attention's CLI and JSON (test_bench_attention_cli_writes_json)",
        ),
        (
            "tests/test_benchmarks.py::test_profile_step_cli_writes_json",
            "profile_step's reading of a saved trace (test_profile_step_reads_a_saved_trace)",
        ),
        (
            "tests/test_interrupts.py::test_a_second_ctrl_c_quits_at_once_and_keeps_the_last_checkpoint",
            "the first Ctrl-C end to end; a second signal quitting at once (test_first_signal_sets_the_flag...)",
        ),
        (
            "tests/test_checkpoint.py::test_a_run_file_the_full_disk_refuses_stops_the_run_like_a_failed_save",
            "a full disk end to end (test_quiet_stops.py); a failed background save stopping the run",
        ),
        (
            "tests/test_kernel_guard.py::test_evaluation_runs_the_branches_the_guard_moved_to_xla_there_too",
            "the guard's per-branch fallback (test_guard_falls_back_per_branch_on_compile_error_and_wrong_result)",
        ),
        (
            "tests/test_checkpoint.py::test_a_stage_that_trains_the_new_parts_alone_resumes_with_every_parameter_training",
            "train.trainable's freezing (test_train.py); an exact resume after SIGTERM and a kill (test_checkpoint.py)",
        ),
        (
            "tests/test_benchmarks.py::test_bench_train_times_each_setting_once_and_a_failing_one_costs_no_other_row",
            "bench_strategies' and bench_kernels' CLIs and their JSON",
        ),
        (
            "tests/test_interrupts.py::test_a_stop_during_a_long_step_waits_for_that_step_only_and_long_waits_say_so",
            "the first Ctrl-C end to end (test_ctrl_c_saves_says_how_to_resume_and_the_same_command_resumes)",
        ),
        (
            "tests/test_spawn.py::test_a_full_disk_on_process_0_stops_every_process_at_the_same_step",
            "a full disk end to end on one process (test_quiet_stops.py); processes agreeing on the stop step "
            "(test_checkpoint.py)",
        ),
        # The aot tier (`-m aot` with the cuda12 extra):
        (
            "tests/test_aot.py::test_pallas_kernels_compile_without_spills[a100-40-T2048]",
            "the same kernels at T = 3000 (no tile divides it), 8192 and 65536; the a100_pcie step at its T",
        ),
        (
            "tests/test_aot.py::test_pallas_kernels_compile_without_spills[h100-T2048]",
            "the same kernels at T = 3000 (no tile divides it), 8192 and 65536",
        ),
        (
            "tests/test_aot.py::test_kernels_under_a_traced_query_offset_compile_without_spills[h100]",
            "the same test for sm_80; sm_90's kernels without an offset (test_pallas_kernels_compile_without_spills)",
        ),
        (
            "tests/test_aot.py::test_layer_with_cudnn_compressed_attention_compiles_within_budget[h100]",
            "the same test for sm_80; sm_90's flash kernels at 64k (test_pallas_kernels_compile_without_spills)",
        ),
        (
            "tests/test_aot.py::test_info_target_prints_progress_and_the_fit",
            "the fit check's compile and answer (test_a100_pcie_step_fits_a100_40gb); the heartbeat's lines "
            "(test_heartbeat_logs_while_the_block_runs)",
        ),
    ]
)


def pytest_addoption(parser):
    parser.addoption("--release", action="store_true", help="also run the release tier (conftest.py RELEASE_ONLY)")
    parser.addoption(
        "--one-case-each",
        action="store_true",
        help="run only the first selected case of each parametrized test (CI's tier on the newest jax: every "
        "test function, so every code path, on that jax, without each shape and variant again)",
    )


class OneCaseEach:
    """`--one-case-each`: keeps the first case of each test function among those `-m` and `-k` leave."""

    @pytest.hookimpl(trylast=True)  # after the mark plugin's deselection
    def pytest_collection_modifyitems(self, config, items):
        seen, kept, dropped = set(), [], []
        for item in items:
            function = item.nodeid.split("[")[0]
            (dropped if function in seen else kept).append(item)
            seen.add(function)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


def pytest_configure(config):
    if config.getoption("one_case_each"):
        config.pluginmanager.register(OneCaseEach(), "one_case_each")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    modules = {item.nodeid.split("::")[0]: item.module for item in items if hasattr(item, "module")}
    listed = [("FULL_SUITE_ONLY", n) for n in FULL_SUITE_ONLY] + [("RELEASE_ONLY", n) for n in RELEASE_ONLY]
    collected = {item.nodeid for item in items}
    functions = {nodeid.split("[")[0] for nodeid in collected}
    whole_files = not any("::" in arg for arg in config.args)  # no test picked by id: every case is collected
    for where, nodeid in listed:
        path, name = nodeid.split("::")
        gone = path in modules and not hasattr(modules[path], name.split("[")[0])
        # A case whose function is collected but not the case itself: a parameter id that changed.
        gone = gone or (whole_files and nodeid.split("[")[0] in functions and nodeid not in collected)
        if gone:
            raise pytest.UsageError(f"tests/conftest.py {where} names {nodeid}, which no longer exists")
    release = config.getoption("release")
    for item in items:
        if item.nodeid in FULL_SUITE_ONLY or item.nodeid in RELEASE_ONLY:
            item.add_marker(pytest.mark.slow)
        if item.nodeid in RELEASE_ONLY and not release:
            keeps = RELEASE_ONLY[item.nodeid]
            item.add_marker(pytest.mark.skip(reason=f"release tier (--release runs it); the suite keeps {keeps}"))
