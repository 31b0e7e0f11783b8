"""tools/plan_layout.py: the layouts it picks for the model sizes the READMEs train, commands every chapter parses,
its step model's arithmetic, and one line when nothing fits. Its memory is tools/estimate_memory.py's, which
tests/test_estimate_memory.py and tests/test_dry_run.py hold to measured and dry-run peaks."""

import re
import shlex
import sys

import pytest

from helpers import REPO, command_words, error_line, load_script, planned_layouts as plans, run

sys.path.insert(0, str(REPO / "tools"))
import plan_layout  # noqa: E402

CONFIGS = REPO / "data" / "configs"
pytestmark = pytest.mark.quick


def test_llama_8b_on_one_node_of_eight_gpus_gets_fsdp_alone():
    best, *others = plans("llama-3.1-8b", "--nnodes", "1", "--nproc-per-node", "8", "--seq-length", "4096")
    assert (best["chapter"], best["dp"], best["tp"], best["pp"], best["cp"]) == ("04", 8, 1, 1, 1)
    assert not best["activation_checkpointing"] and best["peak_gb"] <= 72
    assert best["command"].startswith("torchrun --standalone --nproc-per-node 8 04-fully-sharded-data-parallel/")
    assert all(plan["step_seconds"] >= best["step_seconds"] / 1.02 for plan in others)


def test_llama_405b_on_2048_nodes_at_8k_tokens_gets_tp_8_with_a_pipeline():
    best = plans("llama-3.1-405b", "--nnodes", "2048", "--nproc-per-node", "8", "--global-batch-size", "2048")[0]
    assert best["tp"] == 8 and best["pp"] > 1 and best["chapter"] == "11" and best["peak_gb"] <= 72
    # NOTE: with 2 stages per rank, interleaving halves the bubble; the sends double, a few MB a micro-batch.
    assert best["pp_schedule"] == "interleaved-1f1b" and "--pp-schedule interleaved-1f1b" in best["command"]
    assert best["command"].startswith("TRAIN_SCRIPT=11-4d-parallel/train_llm.py sbatch --nodes 2048 --gpus-per-node 8")


@pytest.mark.parametrize("model, cluster", [("llama-3.1-8b", ["--nnodes", "1"]), ("llama-3.1-70b", ["--nnodes", "8"]),
                                            ("llama-3.1-405b", ["--nnodes", "64", "--seq-length", "4096"]),
                                            ("qwen3-30b-a3b", ["--nnodes", "2", "--seq-length", "4096"])])
def test_every_pick_is_a_command_its_chapter_accepts_with_the_picked_layout(model, cluster):
    """Each pick's flags through its chapter's parser and the checks its main() makes before the first step."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(CONFIGS / model)
    picked = plans(model, *cluster)
    world_size = int(cluster[1]) * 8
    assert picked and {plan["chapter"] for plan in picked} <= {"02", "04", "06", "07", "08", "09", "10", "11"}
    for plan in picked:
        chapter, script, flags = command_words(plan["command"])
        module = load_script(chapter)
        args = module.get_parser().parse_args(flags)
        assert chapter == plan["chapter"] and script == f"{plan_layout.CHAPTERS[chapter].name}/train_llm.py"
        assert args.global_batch_size == plan["dp"] * plan["grad_accum"] and args.batch_size == 1
        # NOTE: chapter 06 splits every layer over all its ranks: no --tp.
        tp = world_size if chapter == "06" else getattr(args, "tp", None) or 1
        assert [tp, *(getattr(args, name, None) or 1 for name in ["pp", "cp", "ep"])] == \
            [plan[name] for name in ["tp", "pp", "cp", "ep"]], plan
        assert bool(getattr(args, "activation_checkpointing", False)) == plan["activation_checkpointing"]
        assert getattr(args, "zero1", False) == plan["zero1"]
        assert getattr(args, "pp_grad_reduce", "microbatch") == plan["pp_grad_reduce"]
        assert getattr(args, "pp_schedule", "1f1b") == plan["pp_schedule"]
        if tp > 1:
            module.check_tensor_parallel_degree(tp, config, args.seq_length)
        if chapter in ("08", "11"):
            args.grad_accum = module.grad_accum_steps(args, plan["dp"])
            module.check_pipeline_layout(args, config)
        if chapter in ("09", "11"):
            module.check_context_parallel(args, config)


def test_the_step_model_is_the_arithmetic_its_docstring_gives():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    best = plans("llama-3.1-8b", "--nnodes", "1", "--seq-length", "4096", "--mfu", "0.5")[0]
    # 4M tokens a step on 8 GPUs, at the FLOPs per token the chapters count for their MFU.
    config = AutoConfig.from_pretrained(CONFIGS / "llama-3.1-8b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    flops_per_token = load_script("11").get_flops_per_token(model, config, 4096)
    assert best["compute_seconds"] == pytest.approx(1024 * 4096 / 8 * flops_per_token / (989e12 * 0.5))
    assert best["step_seconds"] == max(best["compute_seconds"] + best["bubble_seconds"] + best["exposed_seconds"],
                                       best["overlapped_seconds"])
    piped = [plan for plan in plans("llama-3.1-70b", "--nnodes", "8") if plan["pp"] > 1]
    for schedule, chunks in [("1f1b", 1), ("interleaved-1f1b", 2)]:
        plan = next(plan for plan in piped if plan["pp_schedule"] == schedule)
        share = (plan["pp"] - 1) / (chunks * plan["grad_accum"] + plan["pp"] - 1)
        assert plan["bubble_seconds"] == pytest.approx(plan["compute_seconds"] * share / (1 - share))


def test_a_cluster_too_small_for_the_model_gets_one_line(env):
    result = run([sys.executable, REPO / "tools" / "plan_layout.py", "-m", CONFIGS / "llama-3.1-405b", "--nnodes", "1"],
                 env, REPO, timeout=300, check=False)
    assert result.returncode == 1 and error_line(result) == \
        "error: no layout fits; add GPUs, shorten --seq-length, or see chapter 05's --cpu-offload"


@pytest.mark.parametrize("flag", ["--nnodes", "--seq-length", "--mfu"])
def test_a_size_of_zero_gets_one_line(env, flag):
    result = run([sys.executable, REPO / "tools" / "plan_layout.py", "-m", CONFIGS / "llama-3.1-8b", flag, "0"],
                 env, REPO, timeout=300, check=False)
    assert result.returncode == 1 and error_line(result) == f"error: {flag} must be positive, got 0"


def test_the_layout_page_prints_what_the_tool_prints(env):
    """related-topics/choosing-a-layout.md's command, run as written, prints the lines the page shows."""
    page = (REPO / "related-topics" / "choosing-a-layout.md").read_text()
    command = re.search(r"```bash\n(python tools/plan_layout.py [^\n]+)\n```", page).group(1)
    shown = re.search(r"```\n(\d+ of \d+ layouts.*?)\n```", page, re.DOTALL).group(1)
    printed = run([sys.executable, *shlex.split(command)[1:]], env, REPO, timeout=300).stdout
    assert printed.startswith(shown + "\n"), printed[:600]


# The page's table: each row's cluster, and its pick as the tool describes it, with the estimated peak.
PAGE_ROWS = {"llama-3.1-8b": ["--nnodes", "1", "--seq-length", "4096"], "llama-3.1-70b": ["--nnodes", "8"],
             "llama-3.1-405b": ["--nnodes", "2048", "--global-batch-size", "2048"]}


@pytest.mark.parametrize("model", PAGE_ROWS)
def test_the_layout_page_s_table_gives_the_tool_s_picks(model):
    page = (REPO / "related-topics" / "choosing-a-layout.md").read_text()
    best = plan_layout.Plan(**{name: value for name, value in plans(model, *PAGE_ROWS[model])[0].items()
                               if name != "step_seconds"})
    assert f"| {best.describe().split('; peak')[0]} | {best.peak_gb:.1f} GB |" in page, best.describe()
