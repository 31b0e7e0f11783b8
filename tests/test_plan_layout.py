"""tools/plan_layout.py: the layouts it picks for the model sizes the READMEs train, commands every chapter parses,
its step model's arithmetic, and one line when nothing fits. Its memory is tools/estimate_memory.py's, which
tests/test_estimate_memory.py and tests/test_dry_run.py hold to measured and dry-run peaks."""

import contextlib
import io
import json
import re
import shlex
import sys

import pytest

from helpers import REPO, error_line, load_script, run

sys.path.insert(0, str(REPO / "tools"))
import plan_layout  # noqa: E402

CONFIGS = REPO / "data" / "configs"
pytestmark = pytest.mark.quick


def plans(model, *args):
    """The tool's layouts for data/configs/MODEL, best first (its --json list, in this process)."""
    sys.argv = ["plan_layout.py", "-m", str(CONFIGS / model), *args, "--json", "--top", "100"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        plan_layout.main()
    return json.loads(printed.getvalue())


def command_words(command):
    """(the chapter, its train_llm.py's flags) of a torchrun or sbatch command."""
    words = shlex.split(command)
    if words[0].startswith("TRAIN_SCRIPT="):
        script, flags = words[0].split("=", 1)[1], words[words.index("03-job-launchers/job.sbatch") + 1:]
    else:
        script = next(word for word in words if word.endswith("/train_llm.py"))
        flags = words[words.index(script) + 1:]
    return script[:2], script, flags


def test_llama_8b_on_one_node_of_eight_gpus_gets_fsdp_alone():
    best, *others = plans("llama-3.1-8b", "--nnodes", "1", "--nproc-per-node", "8", "--seq-length", "4096")
    assert (best["chapter"], best["dp"], best["tp"], best["pp"], best["cp"]) == ("04", 8, 1, 1, 1)
    assert not best["activation_checkpointing"] and best["peak_gb"] <= 72
    assert best["command"].startswith("torchrun --standalone --nproc-per-node 8 04-fully-sharded-data-parallel/")
    assert all(plan["step_seconds"] >= best["step_seconds"] / 1.02 for plan in others)


def test_llama_405b_on_2048_nodes_at_8k_tokens_gets_tp_8_with_a_pipeline():
    best = plans("llama-3.1-405b", "--nnodes", "2048", "--nproc-per-node", "8", "--global-batch-size", "2048")[0]
    assert best["tp"] == 8 and best["pp"] > 1 and best["chapter"] == "11" and best["peak_gb"] <= 72
    assert best["command"].startswith("TRAIN_SCRIPT=11-4d-parallel/train_llm.py sbatch --nodes 2048 --gpus-per-node 8")


@pytest.mark.parametrize("model, cluster", [("llama-3.1-8b", ["--nnodes", "1"]), ("llama-3.1-70b", ["--nnodes", "8"]),
                                            ("llama-3.1-405b", ["--nnodes", "64", "--seq-length", "4096"]),
                                            ("qwen3-30b-a3b", ["--nnodes", "2", "--seq-length", "4096"])])
def test_every_pick_is_a_command_its_chapter_parses_with_the_picked_layout(model, cluster):
    picked = plans(model, *cluster)
    assert picked and {plan["chapter"] for plan in picked} <= set(plan_layout.CHAPTERS)
    for plan in picked:
        chapter, script, flags = command_words(plan["command"])
        args = load_script(chapter).get_parser().parse_args(flags)
        assert chapter == plan["chapter"] and script == f"{plan_layout.CHAPTERS[chapter]}/train_llm.py"
        assert args.global_batch_size == plan["dp"] * plan["grad_accum"] and args.batch_size == 1
        for name in ["tp", "pp", "cp", "ep"]:
            # NOTE: chapter 06 splits every layer over all its ranks: no --tp.
            expected = plan["tp"] if chapter == "06" and name == "tp" else getattr(args, name, None) or 1
            assert expected == plan[name] and (chapter != "06" or plan["dp"] == 1), (name, plan)
        assert bool(getattr(args, "activation_checkpointing", False)) == plan["activation_checkpointing"]
        assert getattr(args, "zero1", False) == plan["zero1"]


def test_the_step_model_is_the_arithmetic_its_docstring_gives():
    best = plans("llama-3.1-8b", "--nnodes", "1", "--seq-length", "4096", "--mfu", "0.5")[0]
    # 4M tokens a step on 8 GPUs, 6 x 8.03B parameters + 6 x 32 layers x 4096 hidden x 4096 tokens a token.
    tokens_per_gpu = 1024 * 4096 / 8
    flops_per_token = 6 * 8_030_261_248 + 6 * 32 * 4096 * 4096
    assert best["compute_seconds"] == pytest.approx(tokens_per_gpu * flops_per_token / (989e12 * 0.5))
    assert best["step_seconds"] == max(best["compute_seconds"] + best["bubble_seconds"] + best["exposed_seconds"],
                                       best["overlapped_seconds"])
    piped = [plan for plan in plans("llama-3.1-70b", "--nnodes", "8") if plan["pp"] > 1][0]
    share = (piped["pp"] - 1) / (piped["grad_accum"] + piped["pp"] - 1)
    assert piped["bubble_seconds"] == pytest.approx(piped["compute_seconds"] * share / (1 - share))


def test_a_cluster_too_small_for_the_model_gets_one_line(env):
    result = run([sys.executable, REPO / "tools" / "plan_layout.py", "-m", CONFIGS / "llama-3.1-405b", "--nnodes", "1"],
                 env, REPO, timeout=300, check=False)
    assert result.returncode == 1 and error_line(result) == \
        "error: no layout fits; add GPUs, shorten --seq-length, or see chapter 05's --cpu-offload"


def test_the_layout_page_prints_what_the_tool_prints(env):
    """related-topics/choosing-a-layout.md's command, run as written, prints the lines the page shows."""
    page = (REPO / "related-topics" / "choosing-a-layout.md").read_text()
    command = re.search(r"```bash\n(python tools/plan_layout.py [^\n]+)\n```", page).group(1)
    shown = re.search(r"```\n(\d+ of \d+ layouts.*?)\n```", page, re.DOTALL).group(1)
    printed = run([sys.executable, *shlex.split(command)[1:]], env, REPO, timeout=300).stdout
    assert printed.startswith(shown + "\n"), printed[:600]
