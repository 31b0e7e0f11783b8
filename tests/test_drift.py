"""The drift check: what a chapter does not teach stays byte-identical to its base chapter.

Each chapter's train_llm.py starts as a copy of its base chapter's and changes only what its lesson is about, so
that `diff BASE/train_llm.py CHAPTER/train_llm.py` shows the lesson and nothing else. This check compares the two
scripts definition by definition: every top-level function, class and assignment defined in both must have the
same source text, to the byte (decorators, docstrings, comments inside and the comment lines right above it
included), unless the chapter's allowlist below names it and says why the lesson changes it. An allowlisted name
that no longer differs fails too, so the allowlist stays the exact list of what the chapter changes, and the shared
definitions must come in the same order, so that the diff stays short.
"""

import ast
import difflib

import pytest

from helpers import REPO, script

# (base chapter, chapter) -> {definition the chapter changes: why its lesson changes it}.
LINEAGE = {
    ("01", "02"): {
        "main": "one process per GPU: process group (with its timeout), DistributedDataParallel, ZeRO-1, "
                "rank-zero-first preparation, the checkpoint rank 0 finds, the loss averaged over ranks, and wandb, "
                "metrics and the progress bar on rank 0 only",
        "get_parser": "the --zero1 option, and --dist-timeout, the process group's timeout",
        "parse_args": "--dist-timeout must be at least 1 second too",
        "setup_logging": "every log line says which rank wrote it",
        "get_dataloader": "each rank reads its own share of each global batch: the epoch's order is cut at the global "
                          "data position, then dealt out by DistributedSampler, so a checkpoint resumes exactly on "
                          "another world size",
        "save_checkpoint": "rank 0 writes while the others wait at a barrier, ZeRO-1 gathers the optimizer state "
                           "first, and the save is timed; the writing itself moved, unchanged, to write_checkpoint",
    },
    ("02", "03"): {
        "main": "the rank, world size and rendezvous come from whichever launcher started the process",
        "get_parser": "the --rdzv-timeout option, for launchers that start every process at once",
    },
    ("03", "04"): {
        "main": "FSDP: the model built on the meta device and sharded, the optimizer over the shards, no autocast "
                "and no no_sync(), no DDP and no ZeRO-1",
        "get_parser": "the --cpu-offload option, without --zero1",
        "init_weights": "each rank fills only its shard (a DTensor) of the full seeded value",
        "save_checkpoint": "every rank writes its own shards with torch.distributed.checkpoint",
        "write_checkpoint": "only the small files are left to rank 0",
        "load_checkpoint": "each rank reads its own shards, resharding to the current world size",
    },
    ("04", "05"): {
        "main": "pretrained weights (from a folder or the hub), activation checkpointing and torch.compile",
        "get_parser": "the options of activation checkpointing and compilation",
        "shard_model": "separate FSDP groups for the embedding and the output head of a 405B model, and prefetching",
        "init_weights": "parameter names without the activation checkpoint wrapper's part",
    },
    ("04", "06"): {
        "main": "tensor parallelism on a device mesh instead of FSDP, and loss_parallel()",
        "get_parser": "without --cpu-offload: tensor parallelism does not offload",
        "init_weights": "its comment: tensor parallelism splits each weight into slices, where FSDP shards it",
    },
    ("04", "08"): {
        "main": "pipeline parallelism on a (pp, dp) mesh: the model cut into stages, FSDP inside each stage, one "
                "pipeline schedule per micro-step, the loss on the last stage only, the gradient norm over all "
                "stages, tokens counted once per pipeline, and the pipeline's idle time logged; no --cpu-offload",
        "get_parser": "the --pp, --pp-schedule, --pp-microbatches and --pp-stages-per-rank options, without "
                      "--cpu-offload",
        "shard_model": "each stage sharded on its own over the dp ranks of the mesh, its layers kept gathered "
                       "after forward with pp > 1: they run a forward for every micro-batch",
        "save_checkpoint": "each rank's optimizer holds its own stages only: the saved parameter group lists the "
                           "names of all stages, so the checkpoint loads at any --pp and in chapter 04",
    },
    ("06", "07"): {
        "main": "a 2D device mesh: tensor parallelism inside a node, FSDP (optionally hybrid) across nodes",
        "get_parser": "the --tp and --dp-replicate options",
    },
    ("04", "09"): {
        "main": "a (dp, cp) device mesh, the attention across the split registered with transformers, data parallel "
                "over the dp dimension only, each rank's share of the sequences with positions and labels cut "
                "before the split, and the loss as each rank's share of the global mean (summed, not averaged)",
        "get_parser": "the --cp, --cp-attention and --cp-load-balance options",
        "shard_model": "FSDP over the flattened (dp, cp) mesh, summing the gradients: each rank's loss is already "
                       "its share of the global mean",
    },
}
MUST_EXIST = {("01", "02")}


def top_level_definitions(source):
    """{name: source text} of a module's top-level functions, classes and assignments, in the order of the file.

    The text of a definition is its whole lines, from its first decorator (or the comment lines right above it)
    to its last line: ast.get_source_segment's text, plus decorators and comments.
    """
    lines = source.splitlines(keepends=True)
    definitions = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            continue
        first_line = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        while first_line > 1 and lines[first_line - 2].lstrip().startswith("#"):
            first_line -= 1
        for name in names:
            definitions[name] = "".join(lines[first_line - 1:node.end_lineno])
    return definitions


def find_drift(base_source, chapter_source, allowed, base_name="base", chapter_name="chapter"):
    """What breaks the drift check, one message per problem; an empty list when the chapter is clean."""
    base, chapter = top_level_definitions(base_source), top_level_definitions(chapter_source)
    shared = [name for name in base if name in chapter]
    problems = []
    for name in shared:
        if name not in allowed and base[name] != chapter[name]:
            diff = list(difflib.unified_diff(base[name].splitlines(), chapter[name].splitlines(), base_name,
                                             chapter_name, n=1, lineterm=""))
            shown = "\n".join(diff[:30] + ([f"... ({len(diff) - 30} more lines)"] if len(diff) > 30 else []))
            problems.append(f"{name} drifted from the base chapter; make it identical again, or add it to the "
                            f"allowlist with the reason this chapter's lesson changes it:\n{shown}")
    for name in allowed:
        if name not in shared:
            problems.append(f"the allowlisted {name} is not defined in both scripts: remove it from the allowlist")
        elif base[name] == chapter[name]:
            problems.append(f"the allowlisted {name} is identical in both scripts: remove it from the allowlist")
    chapter_order = [name for name in chapter if name in base]
    if chapter_order != shared:
        matcher = difflib.SequenceMatcher(a=shared, b=chapter_order, autojunk=False)
        in_place = {name for block in matcher.get_matching_blocks() for name in shared[block.a:block.a + block.size]}
        moved = [name for name in shared if name not in in_place]
        problems.append(f"shared definitions moved: {', '.join(moved)}; keep them in the base chapter's order")
    return problems


@pytest.mark.parametrize("base, chapter", LINEAGE, ids=[f"{base}-to-{chapter}" for base, chapter in LINEAGE])
def test_a_chapter_changes_only_what_it_teaches(base, chapter):
    if (base, chapter) not in MUST_EXIST and not (script(base).exists() and script(chapter).exists()):
        pytest.skip(f"no {script(base).relative_to(REPO)} or {script(chapter).relative_to(REPO)} yet")
    base_name, chapter_name = (str(script(name).relative_to(REPO)) for name in (base, chapter))
    problems = find_drift(script(base).read_text(), script(chapter).read_text(), LINEAGE[base, chapter],
                          base_name, chapter_name)
    assert not problems, f"{chapter_name} vs its base {base_name}:\n\n" + "\n\n".join(problems)


# The check itself: each edit below, made to chapter 01 alone, must be caught and named.
EDITS = {
    "code": ("cut_into_chunks", "range(0, len(stream) - seq_length + 1, seq_length)",
             "range(0, len(stream) - seq_length, seq_length)"),
    "comment": ("find_latest_checkpoint", "# NOTE: a checkpoint folder gets its final name only once it is complete",
                "# NOTE: a checkpoint folder is renamed when complete"),
    "decorator": ("init_weights", "@torch.no_grad()\ndef init_weights", "def init_weights"),
    "constant": ("PEAK_BF16_FLOPS", '"H200": 989e12', '"H200": 990e12'),
    "method": ("StepTimer", "self.spans = []\n\n    @contextlib", "self.spans.clear()\n\n    @contextlib"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_the_check_names_a_definition_edited_in_one_chapter_only(edit):
    name, old, new = EDITS[edit]
    base_source = script("01").read_text()
    assert base_source.count(old) == 1
    problems = find_drift(base_source.replace(old, new), script("02").read_text(), LINEAGE["01", "02"])
    assert len(problems) == 1 and problems[0].startswith(f"{name} drifted"), problems
    assert "--- base\n+++ chapter\n@@" in problems[0]
    # The diff goes from the edited base to the chapter, which still has the text the edit replaced.
    assert any(line.startswith("+") and old.splitlines()[0].strip() in line for line in problems[0].splitlines())


def test_the_check_fails_a_stale_allowlist_entry():
    allowed = {**LINEAGE["01", "02"], "fail": "no reason", "no_such_function": "no reason"}
    problems = find_drift(script("01").read_text(), script("02").read_text(), allowed)
    assert problems == ["the allowlisted fail is identical in both scripts: remove it from the allowlist",
                        "the allowlisted no_such_function is not defined in both scripts: remove it from the allowlist"]


def test_the_check_fails_a_moved_definition():
    chapter_source = script("02").read_text()
    moved = top_level_definitions(chapter_source)["cut_into_chunks"]
    chapter_source = chapter_source.replace(moved, "") + "\n\n" + moved
    problems = find_drift(script("01").read_text(), chapter_source, LINEAGE["01", "02"])
    assert problems == ["shared definitions moved: cut_into_chunks; keep them in the base chapter's order"]
