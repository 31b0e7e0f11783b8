#!/usr/bin/env bash
# Every chapter's CPU smoke tests under other torch and transformers releases (not part of CI).
#
#     bash dev/check_versions.sh TORCH_VERSION TRANSFORMERS_VERSION    e.g. 2.11.0 5.17.0
#
#     bash dev/check_versions.sh 2.15.0 5.24.0 -k "08 or 09"           further arguments go to pytest
#
# Builds a virtual environment in $CHECK_VERSIONS_DIR (default ~/.cache/check_versions; pip's cache
# beside it) with those two releases from PyPI and requirements-dev.txt's other pins, then runs in it each
# chapter's parity test at its smallest layout (01: resume; 02 DDP, 03 two torchrun agents, 04 FSDP, 06 TP and 07
# dp1-tp2 at 2 ranks; 05 the pretrained loss and flash attention's kwargs; 08 1f1b and interleaved at pp 2; 09
# the split attention module by module and cp2-ring; 10 ep2; 11 tp2-pp2), the resumes that lean on torch's
# checkpointing (04, 08 at pp 2, 09, 10 from ep 2 to ep 4, 11), and the bf16 parity of 08 and 09 (pipelining and
# DTensor are where releases differ most).
# PyPI's torch wheels other than the CPU build are CUDA builds: the first build downloads about 4 GB.
set -euo pipefail
[ $# -ge 2 ] || { echo "error: usage: bash dev/check_versions.sh TORCH_VERSION TRANSFORMERS_VERSION [PYTEST_ARGS]" >&2
                  exit 2; }
torch_version=$1 transformers_version=$2
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${CHECK_VERSIONS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/check_versions}
venv=$root/torch$torch_version-transformers$transformers_version
started=$(date +%s)
mkdir -p "$root"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
    python3 -m venv "$venv"
    grep -h -v -E '^(torch|transformers)==|^-r|^#|^$' "$repo/requirements.txt" "$repo/requirements-dev.txt" \
        > "$venv/other-pins.txt"
    # NOTE: an empty constraints file lifts any machine-wide cap on torch's version.
    : > "$venv/no-constraints.txt"
    PIP_CONSTRAINT=$venv/no-constraints.txt "$venv/bin/pip" install -q --cache-dir "$root/pip-cache" \
        "torch==$torch_version" "transformers==$transformers_version" -r "$venv/other-pins.txt"
fi
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', \
transformers.__version__)"
installed=$(date +%s)
cd "$repo"
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" \
    "tests/test_01_single_gpu.py::test_resume_is_exact" \
    "tests/test_02_distributed_data_parallel.py::test_two_ranks_match_one_process_with_the_same_global_batch[ddp]" \
    "tests/test_03_job_launchers.py::test_two_torchrun_agents_act_as_two_nodes_and_match_chapter_02" \
    "tests/test_04_fully_sharded_data_parallel.py::test_fsdp_reproduces_chapter_01_losses[2]" \
    "tests/test_04_fully_sharded_data_parallel.py::test_resume_at_the_same_world_size_is_exact_and_survives_a_crash_during_a_save" \
    "tests/test_05_training_llama_405b.py::test_pretrained_weights_give_the_loss_transformers_computes" \
    "tests/test_05_training_llama_405b.py::test_flash_attention_at_batch_size_1_reads_nothing_on_the_host_in_the_layers" \
    "tests/test_06_tensor_parallel.py::test_tensor_parallel_matches_one_process_on_the_same_batch[2]" \
    "tests/test_07_2d_parallel.py::test_every_layout_matches_one_process_with_the_same_global_batch[dp1-tp2]" \
    "tests/test_08_pipeline_parallel.py::test_every_schedule_and_layout_matches_one_process_with_the_same_global_batch[pp2-1f1b]" \
    "tests/test_08_pipeline_parallel.py::test_every_schedule_and_layout_matches_one_process_with_the_same_global_batch[pp2-interleaved-1f1b]" \
    "tests/test_08_pipeline_parallel.py::test_a_checkpoint_resumes_exactly_at_the_same_layout_at_another_pp_and_in_chapter_04[pp2-1f1b]" \
    "tests/test_09_context_parallel.py::test_the_split_attention_equals_full_causal_attention_module_by_module" \
    "tests/test_09_context_parallel.py::test_context_parallel_reproduces_chapter_01_losses[cp2-ring]" \
    "tests/test_09_context_parallel.py::test_resume_is_exact" \
    "tests/test_10_expert_parallel.py::test_expert_parallelism_reproduces_chapter_01_losses[ep2]" \
    "tests/test_10_expert_parallel.py::test_resume_at_another_ep_reshards_the_experts" \
    "tests/test_11_4d_parallel.py::test_every_layout_matches_one_process_with_the_same_global_batch[tp2-pp2]" \
    "tests/test_11_4d_parallel.py::test_resume_in_the_same_4d_layout_is_exact" \
    "tests/test_bf16_parity.py::test_bf16_losses_stay_close_to_chapter_01[08]" \
    "tests/test_bf16_parity.py::test_bf16_losses_stay_close_to_chapter_01[09]" || status=$?
finished=$(date +%s)
echo "check_versions: torch $torch_version, transformers $transformers_version: environment $((installed - started)) s," \
    "tests $((finished - installed)) s, exit $status"
exit $status
