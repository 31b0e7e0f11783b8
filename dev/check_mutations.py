"""Break the chapters on purpose and check that the test suite notices: each mutation is a bug that once was, or
easily could be, in a chapter; each must make its catching test fail.

    python dev/check_mutations.py            every mutation, one after the other (about 4 minutes on 2 cores)
    python dev/check_mutations.py --list     the mutations and the tests that must catch them
    python dev/check_mutations.py 04-fsdp-sum

Each mutation runs in a scratch copy of the repository's tracked files (the checkout itself is never touched): the
edit is applied, then only the catching test runs. A mutation whose test passes is a hole in the proof: exit 1.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name: (file, text to replace (exactly once), replacement, the test that must fail)
MUTATIONS = {
    "04-fsdp-sum": (
        "04-fully-sharded-data-parallel/train_llm.py",
        "    fully_shard(model, **fsdp_config, reshard_after_forward=False)\n",
        "    fully_shard(model, **fsdp_config, reshard_after_forward=False)\n"
        "    for module in [*layers, model]:\n        module.set_gradient_divide_factor(1.0)\n"
        "        module.set_force_sum_reduction_for_comms(True)\n",
        "tests/test_04_fully_sharded_data_parallel.py::test_fsdp_reproduces_chapter_01_losses[2]"),
    "09-half-gradients": (
        "09-context-parallel/train_llm.py",
        "        module.set_gradient_divide_factor(1.0)\n",
        "        module.set_gradient_divide_factor(2.0)\n",
        "tests/test_09_context_parallel.py::test_context_parallel_reproduces_chapter_01_losses[cp2-ring]"),
    "04-fp32-param-dtype": (
        "04-fully-sharded-data-parallel/train_llm.py",
        "mp_policy=MixedPrecisionPolicy(param_dtype=dtype,",
        "mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32,",
        "tests/test_gpu_properties.py::test_a_step_has_no_host_sync_only_bf16_matmuls_and_counts_each_token_once"
        "[04 dp2]"),
    "05-discarded-compile": (
        "05-training-llama-405b/train_llm.py",
        "        layer.forward = torch.compile(layer.forward, fullgraph=True)\n",
        "        torch.compile(layer.forward, fullgraph=True)\n",
        "tests/test_compile.py::test_compiled_checkpointed_layers_train_as_chapter_01_and_resume_exactly[05]"),
    "04-module-level-tf32": (
        "04-fully-sharded-data-parallel/train_llm.py",
        "\nLOGGER = ",
        "\ntorch.backends.cuda.matmul.allow_tf32 = True\nLOGGER = ",
        "tests/test_drift.py::test_a_chapter_changes_only_what_it_teaches[03-to-04]"),
    "04-blocking-vote": (
        "04-fully-sharded-data-parallel/train_llm.py",
        "    vote = dist.all_reduce(votes, group=stop_group, async_op=True)\n",
        "    dist.all_reduce(votes, group=stop_group)\n"
        "    vote = dist.all_reduce(votes, group=stop_group, async_op=True)\n",
        "tests/test_gpu_properties.py::test_a_step_has_no_host_sync_only_bf16_matmuls_and_counts_each_token_once"
        "[04 dp2]"),
    "07-wrapped-at-tp-1": (
        "07-2d-parallel/train_llm.py",
        "    if tp_degree > 1:\n        parallelize_model(model, mesh[\"tp\"])\n",
        "    parallelize_model(model, mesh[\"tp\"])\n",
        "tests/test_gpu_properties.py::test_a_degree_of_1_wraps_nothing"),
    "01-kv-cache": (
        "01-single-gpu/train_llm.py",
        ", use_cache=False)",
        ")",
        "tests/test_repo.py::test_every_training_forward_builds_no_kv_cache[01]"),
    "10-per-rank-aux-loss": (
        "10-expert-parallel/train_llm.py",
        "        dist.all_reduce(counts)\n",
        "",
        "tests/test_10_expert_parallel.py::test_the_load_balancing_loss_is_the_global_batchs_not_a_mean_of_per_rank_"
        "losses"),
    "11-no-gradient-sum": (
        "11-4d-parallel/train_llm.py",
        "        module.set_gradient_divide_factor(1.0)\n",
        "",
        "tests/test_11_4d_parallel.py::test_every_layout_matches_one_process_with_the_same_global_batch[pp2-cp2]"),
    "07-tokens-per-tp-rank": (
        "07-2d-parallel/train_llm.py",
        "        tokens_since_log += samples_per_step * args.seq_length\n",
        "        tokens_since_log += samples_per_step * args.seq_length * tp_degree\n",
        "tests/test_gpu_properties.py::test_a_step_has_no_host_sync_only_bf16_matmuls_and_counts_each_token_once"
        "[07 tp2 dp1]"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", choices=[[], *MUTATIONS], metavar="NAME",
                        help=f"the mutations to check (default: all): {', '.join(MUTATIONS)}")
    parser.add_argument("--list", action="store_true", help="print the mutations and their catching tests")
    args = parser.parse_args()
    names = args.names or list(MUTATIONS)
    if args.list:
        for name in names:
            print(f"{name}: {MUTATIONS[name][0]} -> {MUTATIONS[name][3]}")
        return
    holes = [name for name in names if not caught(name)]
    if holes:
        raise SystemExit(f"error: not caught: {', '.join(holes)}; the proof has a hole")


def caught(name):
    path, old, new, test = MUTATIONS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutation-{name}-") as scratch:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        for relative in filter(None, files.decode().split("\0")):
            if (REPO / relative).is_file():
                (Path(scratch) / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / relative, Path(scratch) / relative)
        source = (Path(scratch) / path).read_text()
        if source.count(old) != 1:
            raise SystemExit(f"error: {name}: {old!r} is in {path} {source.count(old)} times, not once; update the "
                             "mutation to the chapter's code")
        (Path(scratch) / path).write_text(source.replace(old, new))
        started = time.perf_counter()
        # NOTE: -n 0: under pytest-xdist, -x ends the run as interrupted (exit 2), which is no verdict.
        result = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-x", "-q", "-p", "no:cacheprovider", test],
                                cwd=scratch, capture_output=True, text=True)
        failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        verdict = "caught" if result.returncode == 1 and failed else "NOT CAUGHT"
        print(f"{name}: {verdict} by {test} ({time.perf_counter() - started:.0f} s)", flush=True)
        if result.returncode not in (0, 1):
            print(result.stdout[-3000:], result.stderr[-3000:])
        return verdict == "caught"


if __name__ == "__main__":
    main()
