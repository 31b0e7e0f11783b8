"""The tools that show what the chapters do: plot_runs.py draws metrics.jsonl, generate.py samples from any
chapter's checkpoint, dev/make_figures.py draws every figure the READMEs show (here in its fast mode)."""

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from helpers import (CHAPTERS, REPO, TINY_MODEL, checkpoint_weights, error_line, load_script,
                     model_without_chat_template, run, train)

sys.path.insert(0, str(REPO / "tools"))
TOOLS = REPO / "tools"
MAKE_FIGURES = REPO / "dev" / "make_figures.py"
ONE_STEP = ["--max-steps", "1", "--wandb-mode", "disabled"]


def write_metrics(folder, losses, repeated_step=None):
    folder.mkdir(parents=True)
    records = [{"step": step, "epoch": 0, "loss": loss, "lr": 1e-3 * step / len(losses), "grad_norm": 1.0,
                "tokens_per_second": 1000.0 + step, "mfu": None, "memory_rss_gb": 1.1}
               for step, loss in enumerate(losses, 1)]
    if repeated_step:
        # NOTE: logged before a crash, then again by the resumed run, whose line comes later and counts.
        records.insert(repeated_step - 1, {**records[repeated_step - 1], "loss": 99.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def test_plot_runs_draws_png_and_svg(env, tmp_path):
    first = write_metrics(tmp_path / "outputs" / "a", [8.0, 7.0, 6.5, 6.0])
    second = write_metrics(tmp_path / "outputs" / "b", [8.0, 7.0 + 1e-6, 6.5, 6.0 + 1e-3], repeated_step=2)
    for suffix, magic in [(".png", b"\x89PNG"), (".svg", b"<?xml")]:
        output = tmp_path / f"runs{suffix}"
        run([sys.executable, TOOLS / "plot_runs.py", first, second / "metrics.jsonl", "-o", output], env, tmp_path)
        assert output.read_bytes().startswith(magic) and output.stat().st_size > 5000
    import plot_runs

    # A step logged twice counts with its last record, as the scripts' own readers do.
    assert [r["loss"] for r in plot_runs.read_metrics(second)] == [8.0, 7.0 + 1e-6, 6.5, 6.0 + 1e-3]


def test_plot_runs_names_a_missing_folder_in_one_line(env, tmp_path):
    result = run([sys.executable, TOOLS / "plot_runs.py", tmp_path / "nowhere"], env, tmp_path, check=False)
    assert result.returncode != 0 and error_line(result).startswith("error: no metrics file at")


# NOTE: checked before any work: a figure format matplotlib lacks, an empty prompt (no token to continue).
@pytest.mark.parametrize("command, expected", [
    (["plot_runs.py", "nowhere", "-o", "runs.pdfx"], "error: -o runs.pdfx: write a .png or a .svg"),
    (["generate.py", "--untrained", "--prompt", ""],
     'error: --prompt is empty; give text to continue, e.g. --prompt "ROMEO:"'),
], ids=["plot-format", "empty-prompt"])
def test_a_tool_names_bad_input_in_one_line(env, tmp_path, command, expected):
    result = run([sys.executable, TOOLS / command[0], *command[1:]], env, tmp_path, check=False)
    assert result.returncode == 1 and error_line(result) == expected, result.stderr[-2000:]


@pytest.mark.parametrize("chapter, nproc", [("01", None), ("04", 2)])
def test_generate_loads_the_latest_checkpoint_and_continues_the_prompt(env, tmp_path, chapter, nproc):
    # Chapter 01 writes model.pt, chapter 04 the DCP shards of 2 ranks: generate.py must hold the trained weights.
    # NOTE: in the folder the top-level README's command reads, chapter 01's default experiment.
    _, experiment = train(chapter, env, tmp_path, *ONE_STEP, nproc=nproc, experiment=CHAPTERS["01"])
    import generate

    checkpoint = generate.find_checkpoint(experiment)
    assert checkpoint.name == "checkpoint-00000001"
    loaded = generate.load_model(checkpoint).state_dict()
    saved = checkpoint_weights(checkpoint, tmp_path)
    assert saved.keys() <= loaded.keys() and all(torch.equal(loaded[name], saved[name]) for name in saved)
    command = [sys.executable, TOOLS / "generate.py", experiment, "--prompt", "ROMEO:", "--max-new-tokens", "12",
               "--temperature", "0"]
    first, second = (run(command, env, tmp_path).stdout for _ in range(2))
    assert first.startswith("ROMEO:") and len(first) > len("ROMEO:") + 5 and first == second
    # The top-level README's command, as written, from the folder that holds outputs/01-single-gpu.
    readme_command = next(line for line in (REPO / "README.md").read_text().splitlines()
                          if line.startswith("python tools/generate.py "))
    words = shlex.split(readme_command)
    result = run([sys.executable, TOOLS / "generate.py", *words[2:]], env, tmp_path)
    assert result.stdout.startswith("ROMEO:") and "checkpoint-00000001" in result.stderr


def test_generate_untrained_uses_the_weights_every_chapter_starts_from(env, tmp_path):
    import generate

    model = generate.untrained_model(TINY_MODEL, seed=0)
    chapter01 = load_script("01")
    reference = generate.build_model(model.config)
    chapter01.init_weights(reference, 0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    result = run([sys.executable, TOOLS / "generate.py", tmp_path], env, tmp_path, check=False)
    assert result.returncode != 0 and error_line(result).startswith("error: no checkpoint in")


# NOTE: long: every figure is drawn from real runs (8 short ones), as dev/make_figures.py draws them for the READMEs.
@pytest.mark.timeout(1800)  # NOTE: 8 short runs; on 2 busy cores that can take more than the usual 900 s
def test_make_figures_fast_writes_every_figure_the_readmes_show(env, tmp_path):
    # Every picture a README shows: the shared ones in docs/figures/ and the ones next to their chapter.
    shown = {}
    for readme in REPO.rglob("*.md"):
        if any(part.startswith(".") for part in readme.relative_to(REPO).parts):
            continue
        for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", readme.read_text()):
            shown[Path(link).name] = (readme.parent / link).resolve()
    assert {"parity.png", "memory_per_rank.png", "lr_schedule.png", "activation_checkpointing.png",
            "pipeline-schedules.png", "load-balanced-layout.png"} <= shown.keys()
    out_dir = tmp_path / "figures"
    run([sys.executable, MAKE_FIGURES, "--fast", "--out-dir", out_dir, "--work-dir", tmp_path / "work"],
        env, tmp_path, timeout=1800)
    for name, committed in sorted(shown.items()):
        assert (out_dir / name).read_bytes().startswith(b"\x89PNG"), f"make_figures.py did not draw {name}"
        assert committed.is_file(), f"{committed.relative_to(REPO)} is not committed"


def test_generate_chat_asks_in_the_chat_template_and_prints_the_answer_only(env, tmp_path):
    """--chat renders the prompt as a user's turn and the start of an answer, as chapter 05 fine-tunes on: greedy, it
    prints what plain continuation of that rendered text adds; without a chat template it stops with one line."""
    import generate

    model = generate.untrained_model(TINY_MODEL, seed=0).eval()
    tokenizer = generate.load_tokenizer(TINY_MODEL)
    prompt = "Which play has this line?\n\nTo be, or not to be"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n") and prompt in rendered
    answer = generate.sample(model, tokenizer, prompt, 8, 0, 50, torch.device("cpu"), chat=True)
    continued = generate.sample(model, tokenizer, rendered, 8, 0, 50, torch.device("cpu"))
    assert answer and continued == tokenizer.decode(tokenizer(rendered).input_ids, skip_special_tokens=True) + answer
    no_template = model_without_chat_template(tmp_path)
    result = run([sys.executable, TOOLS / "generate.py", "--untrained", "--chat", "-m", no_template], env, tmp_path,
                 check=False)
    assert result.returncode == 1 and error_line(result) == (
        f"error: the tokenizer of {no_template} has no chat template; drop --chat, or pass -m a model that has one")
