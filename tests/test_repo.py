"""Repository-wide checks: every script answers --help, every command in a README points at files that exist
and passes only flags its script accepts, every torch.load says where its tensors go, and no chapter's training
forward builds a KV cache."""

import ast
import re
import sys

import pytest

from helpers import CHAPTERS, REPO, run, script

EXISTING_CHAPTERS = [chapter for chapter in CHAPTERS if script(chapter).exists()]
READMES = sorted(REPO.glob("*.md")) + sorted(REPO.glob("*/README.md"))
REPO_PATH = re.compile(r"(?<![\w/.-])((?:\d\d-[a-z0-9-]+|diagnosing-errors|tools|data|tests|\.ci)/[\w./-]*[\w])")
# A script that is run, not named as a value (TRAIN_SCRIPT=07-2d-parallel/train_llm.py sbatch ...).
SCRIPT_CALL = re.compile(r"(?<![=\w/.-])(\d\d-[a-z0-9-]+)/train_llm\.py((?:\s+[^|;&#]+)?)")


@pytest.mark.parametrize("chapter", EXISTING_CHAPTERS)
def test_every_chapter_script_answers_help(env, tmp_path, chapter):
    result = run([sys.executable, script(chapter), "--help"], env, tmp_path, timeout=120)
    assert result.stdout.startswith("usage: ") and "--model-name" in result.stdout


def shell_lines(readme):
    """The commands in a README's fenced code blocks, with backslash-continued lines joined."""
    lines, in_block = [], False
    for line in readme.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
        elif in_block:
            lines.append(line)
    return re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()


@pytest.mark.parametrize("readme", READMES, ids=lambda path: str(path.relative_to(REPO)))
def test_readme_commands_name_files_that_exist(readme):
    missing = sorted({path for line in shell_lines(readme) for path in REPO_PATH.findall(line)
                      if not (REPO / path).exists() and "outputs/" not in path and "logs/" not in path})
    assert not missing, f"{readme.relative_to(REPO)} names files that do not exist: {missing}"


@pytest.mark.parametrize("readme", READMES, ids=lambda path: str(path.relative_to(REPO)))
def test_readme_commands_pass_only_flags_the_script_accepts(readme):
    unknown = []
    for line in shell_lines(readme):
        for chapter_dir, arguments in SCRIPT_CALL.findall(line):
            script_path = REPO / chapter_dir / "train_llm.py"
            if not script_path.exists():
                continue
            source = script_path.read_text()
            for flag in re.findall(r"(?<!\S)(--?[a-zA-Z][\w-]*)", arguments):
                if f'"{flag}"' not in source:
                    unknown.append(f"{chapter_dir}/train_llm.py {flag}")
    assert not unknown, f"{readme.relative_to(REPO)} passes flags the scripts do not have: {sorted(set(unknown))}"


def test_every_torch_load_names_its_device_and_loads_weights_only():
    # NOTE: without map_location a tensor returns to the device it was saved from: a checkpoint written by rank 0
    # of a GPU job would be restored onto GPU 0 by every rank of the node. weights_only=True: no code runs on load.
    calls, unsafe = 0, []
    for path in sorted(REPO.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(REPO).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                calls += 1
                keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in node.keywords}
                if "map_location" not in keywords or keywords.get("weights_only") != "True":
                    unsafe.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert calls >= 10 and not unsafe, f"torch.load without map_location or weights_only=True: {sorted(unsafe)}"


@pytest.mark.parametrize("chapter", EXISTING_CHAPTERS)
def test_every_training_forward_builds_no_kv_cache(chapter):
    # NOTE: a Hugging Face model builds a KV cache in every forward pass unless told use_cache=False (the config's
    # default is True). test_01_single_gpu.py shows it on a real run; this checks every chapter's call of the model.
    # Chapter 08 runs the decoder layers itself, stage by stage: there each layer(..., position_embeddings=...) call
    # is the forward, and model.loss_function(..., labels=...) is not one.
    def is_forward(call):
        keywords = {keyword.arg for keyword in call.keywords}
        if ast.unparse(call.func).endswith("loss_function"):
            return False
        return "labels" in keywords or "position_embeddings" in keywords

    forwards = [node for node in ast.walk(ast.parse(script(chapter).read_text()))
                if isinstance(node, ast.Call) and is_forward(node)]
    assert forwards, f"no model(..., labels=...) call in {script(chapter).relative_to(REPO)}"
    for call in forwards:
        keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords}
        assert keywords.get("use_cache") == "False", f"line {call.lineno}: {ast.unparse(call)}"


ALL_READMES = sorted(path for path in REPO.rglob("*.md") if not any(
    part.startswith(".") or part in ("outputs", "logs") for part in path.relative_to(REPO).parts))
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)[^)]*\)|<img[^>]*\ssrc=\"([^\"]+)\"")
TOOLS_WITH_HELP = ["plot_runs.py", "make_figures.py", "estimate_memory.py", "measure_step.py", "generate.py"]


@pytest.mark.parametrize("readme", ALL_READMES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_image_link_resolves(readme):
    links = [markdown or html for markdown, html in IMAGE_LINK.findall(readme.read_text())]
    missing = [link for link in links if not link.startswith(("http://", "https://"))
               and not (readme.parent / link).is_file()]
    assert not missing, f"{readme.relative_to(REPO)} shows images that do not exist: {missing}"


def test_the_readme_tables_are_what_the_estimator_computes():
    sys.path.insert(0, str(REPO / "tools"))
    import make_figures

    stale = [str(path.relative_to(REPO)) for path, text in make_figures.readme_tables().items()
             if path.read_text() != text]
    assert not stale, f"tables in {stale} differ from tools/estimate_memory.py: run python tools/make_figures.py --tables"


@pytest.mark.parametrize("tool", TOOLS_WITH_HELP)
def test_every_tool_answers_help(env, tmp_path, tool):
    result = run([sys.executable, REPO / "tools" / tool, "--help"], env, tmp_path, timeout=120)
    assert result.stdout.startswith("usage: ")
