"""The drift check: what a chapter does not teach stays byte-identical to its base chapter.

Each chapter's train_llm.py starts as a copy of its base chapter's and changes only what its lesson is about, so
that `diff BASE/train_llm.py CHAPTER/train_llm.py` shows the lesson and nothing else. This check compares the two
scripts statement by statement, the whole module: every top-level function, class and assignment, the imports, every
module-level call or assignment to an attribute, and every section comment must have the same source text in both,
to the byte (decorators, docstrings, comments inside and the comment lines right above it included), unless the
chapter's allowlist below names it and says why the lesson changes it; a statement in only one of the two scripts
must be allowlisted too. An allowlisted name that no longer differs fails, so the allowlist stays the exact list of
what the chapter changes, and the shared definitions must come in the same order, so that the diff stays short.
Inside an allowlisted definition, a hunk that replaces lines with others of the same code (a reflow, a reworded
comment) fails too, so that only the lesson's changes show in the diff; a chapter may add or remove comment lines.
"""

import ast
import difflib
import io
import tokenize

import pytest

from helpers import REPO, script

pytestmark = pytest.mark.quick  # static: every test reads files only

# (base chapter, chapter) -> {definition the chapter changes: why its lesson changes it}.
LINEAGE = {
    ("01", "02"): {
        "main": "one process per GPU: process group (with its timeout), DistributedDataParallel, ZeRO-1, "
                "rank-zero-first preparation, the checkpoint rank 0 finds, the loss averaged over ranks, and wandb, "
                "metrics and the progress bar on rank 0 only, and the ranks' vote to stop",
        "get_parser": "the --zero1 option, and --dist-timeout, the process group's timeout",
        "parse_args": "--dist-timeout must be at least 1 second too",
        "setup_logging": "every log line says which rank wrote it",
        "get_micro_batches": "each rank's micro-batches",
        "get_dataloader": "each rank reads its own share of each global batch: the epoch's order is cut at the global "
                          "data position, then dealt out by DistributedSampler, so a checkpoint resumes exactly on "
                          "another world size",
        "save_checkpoint": "rank 0 writes while the others wait at a barrier, ZeRO-1 gathers the optimizer state "
                           "first, and the save is timed; the writing itself moved, unchanged, to write_checkpoint",
        "get_device": "each process takes the GPU of its local rank",
        "rank_zero_first": "rank 0 prepares the data while the others wait",
        "find_latest_checkpoint_on_rank_zero": "every rank resumes from the checkpoint rank 0 finds",
        "write_checkpoint": "the writing save_checkpoint did, moved unchanged so that only rank 0 runs it",
        "explain_load_errors": "every rank that fails prints the line: one line per rank, not a traceback per rank",
        "load_checkpoint": "without map_location every rank would load onto cuda:0, where rank 0 saved from",
        "get_rng_state": "with a GPU per process, the state saved is that process's GPU's",
        "vote_to_stop": "every rank stops after the same step when any is signalled, without a host waiting in a step",
        "grad_accum_steps": "--global-batch-size keeps the global batch whatever the world size (an elastic restart)",
    },
    ("02", "03"): {
        "main": "the rank, world size and rendezvous come from whichever launcher started the process",
        "get_parser": "the --rdzv-timeout option, for launchers that start every process at once",
        "get_distributed_environment": "rank, world size and rendezvous from torchrun, srun or mpirun",
        "wait_for_rendezvous": "launchers that start every process at once wait for rank 0's endpoint",
        "find_free_port": "a launcher without torchrun picks the rendezvous port itself",
        "get_device": "srun binds one GPU to each task (Slurm's --gpus-per-task=1)",
    },
    ("03", "04"): {
        "main": "FSDP: the model built on the meta device and sharded over a 1-D device mesh of all ranks, filled "
                "with its pretrained weights or from the seed, with activation checkpointing and compiled layers as "
                "options; the optimizer over the shards, no autocast and no no_sync(), no DDP and no ZeRO-1, and the "
                "checkpoints' gloo groups (a second for --async-checkpoint's background thread)",
        "get_parser": "the --cpu-offload option, without --zero1, --ckpt-timeout, the checkpoints' own timeout, "
                      "--async-checkpoint, --activation-checkpointing and --compile",
        "parse_args": "--ckpt-timeout must be at least 1 second too",
        "init_weights": "each rank fills only its shard (a DTensor) of the full seeded value, named without the "
                        "activation checkpoint wrapper's part",
        "MODEL_FILES": "what a download of a pretrained model fetches",
        "SKIPPED_MODEL_FILES": "what it leaves out",
        "download_model": "pretrained weights from the hub",
        "parameters_on_meta": "the model built without memory: parameters on the meta device, buffers for real",
        "apply_activation_checkpointing": "the activation checkpointing option",
        "compile_layers": "the torch.compile option",
        "to_empty_keeping_buffers": "the sharded parameters allocated on the device, the buffers kept as built",
        "find_weight_files": "the safetensors files of a pretrained folder (a folder of pickled weights gets a "
                             "one-line error; a config-only folder trains from the seed)",
        "load_pretrained_weights": "each rank reads its own slices of the pretrained weights",
        "save_checkpoint": "every rank writes its own shards with torch.distributed.checkpoint, waiting on the "
                           "checkpoints' gloo group (terabytes take longer than --dist-timeout), or stages them for "
                           "a background write (--async-checkpoint), the small state taken at the step saved",
        "BackgroundSave": "--async-checkpoint: one save in flight, finished by rank 0 once every rank's shards are "
                          "written",
        "write_checkpoint": "only the small files are left to rank 0, the small state as save_checkpoint took it",
        "load_checkpoint": "each rank reads its own shards, resharding to the current world size, on the "
                           "checkpoints' gloo group",
        "shard_model": "FSDP: each layer, and the rest of the model, sharded as one group over the mesh",
        "log_memory_held": "each rank shows it holds 1/N of parameters, gradients and optimizer state",
    },
    ("04", "05"): {
        "main": "the attention option with flash attention's kwargs, fine-tuning data (answers labelled, examples "
                "packed), the loss per label token of the global batch, and evaluation",
        "get_parser": "the options of attention, splits and evaluation",
        "parse_args": "the evaluation options' rules",
        "shard_model": "separate FSDP groups for the embedding and the output head of a 405B model, prefetching, and "
                       "gradients summed (each rank's loss is its share of the global batch's)",
        "load_and_tokenize_dataset": "fine-tuning schemas, a held-out split, and a summary of the data",
        "load_raw_dataset": "a named split",
        "SCHEMAS": "the fine-tuning data's schemas",
        "ALPACA_PROMPTS": "alpaca's prompts",
        "find_schema": "the schema, from the columns",
        "tokenize_split": "plain text as in chapter 04, or examples labelled on their answers and packed",
        "tokenize_example": "an example's labels: its answer",
        "tokenize_conversation": "a conversation's labels: its assistant turns",
        "pack_examples": "examples packed into rows, positions restarting at each",
        "get_model_inputs": "a micro-batch's arguments: packed examples attend within themselves (a block-causal mask)",
        "count_label_tokens": "a micro-batch's label tokens, for the loss per token of the global batch",
        "evaluate": "the held-out loss",
        "log_metrics": "the eval loss in the log line",
        "attention_implementation": "the attention options: eager, SDPA, flash attention",
        "get_attention_kwargs": "the attention options: eager, SDPA, flash attention",
    },
    ("04", "06"): {
        "main": "tensor parallelism on a device mesh instead of FSDP, before activation checkpointing and compile, "
                "the loss from logits split along the vocabulary",
        "get_parser": "without --cpu-offload: tensor parallelism does not offload",
        "shard_model": "tensor parallelism replaces FSDP's sharding",
        "check_tensor_parallel_degree": "a degree that does not divide the model gets a one-line error",
        "parallelize_model": "the tensor-parallel plan",
        "layer_plan": "a decoder layer's plan, from the modules it has; a weight the plan cannot split gets a one-line "
                      "error",
        "vocab_parallel_loss": "the causal-LM loss of logits split along the vocabulary",
        "VocabParallelCrossEntropy": "its autograd function: two all-reduces, the largest logit, then the sum of "
                                     "exponentials and the label's logit of each token",
    },
    ("04", "08"): {
        "main": "pipeline parallelism on a (pp, dp) mesh: the model cut into stages, FSDP inside each stage (its "
                "layers kept gathered after forward with pp > 1: they run a forward for every micro-batch), one "
                "pipeline schedule per optimizer step (the micro-batches of all its --grad-accum batches), the loss "
                "on the last stage only, the gradient norm over all stages, and tokens counted once per pipeline",
        "get_parser": "the --pp, --pp-schedule, --pp-microbatches and --pp-stages-per-rank options",
        "shard_model": "a stage's layers are a dict (the model's names), not the model's list",
        "save_checkpoint": "each rank's optimizer holds its own stages only: the saved parameter group lists the "
                           "names of all stages, so the checkpoint loads at any --pp and in chapter 04",
        "PIPELINE_SCHEDULES": "the --pp-schedule choices",
        "check_pipeline_layout": "a layout that cannot be made gets a one-line error",
        "split_into_stages": "the model cut into stages",
        "DecoderStage": "one stage's forward, at the positions it is given",
        "# 6. The training loop: the pipeline": "the section of the pipeline's helpers",
        "get_loss_function": "the loss on the last stage",
        "build_pipeline_schedule": "one schedule per optimizer step",
        "FSDPPipelineStage": "the stage that can reduce-scatter its gradients in every backward",
        "clip_grad_norm_across_stages": "the gradient norm over all stages",
    },
    ("06", "07"): {
        "main": "a 2D device mesh: tensor parallelism inside a node (none at --tp 1), FSDP (optionally hybrid) "
                "across nodes, with chapter 04's --cpu-offload",
        "get_parser": "the --tp and --dp-replicate options, and chapter 04's --cpu-offload back: FSDP offloads",
        "get_device_mesh": "the 2D mesh",
        "shard_model": "chapter 04's FSDP, unchanged (COPIES), over the dp dimensions of the mesh",
    },
    ("04", "09"): {
        "main": "a (dp, cp) device mesh, the attention across the split registered with transformers, data parallel "
                "over the dp dimension only, each rank's share of the sequences with positions and labels cut "
                "before the split, and the loss as each rank's share of the global mean (summed, not averaged)",
        "get_parser": "the --cp, --cp-attention and --cp-load-balance options",
        "shard_model": "FSDP over the flattened (dp, cp) mesh, summing the gradients: each rank's loss is already "
                       "its share of the global mean",
        "get_device_mesh": "the (dp, cp) mesh",
        "check_context_parallel": "a split that cannot be made gets a one-line error",
        "register_context_parallel_attention": "the attention across the split registered with transformers",
        "# 1b. Attention across the split": "the section of the split attention",
        "get_token_indices": "each rank's tokens, load-balanced or not",
        "ring_attention": "ring attention",
        "RingAttention": "its autograd function",
        "ring_steps": "the ring's steps, the next block in flight while one computes",
        "start_ring_pass": "the ring's send and receive",
        "visible_block": "which blocks a causal query sees",
        "attention_block": "one block's attention",
        "attention_block_backward": "its backward",
        "repeat_key_value_heads": "the key/value heads the fp32 CUDA kernel needs",
        "merge_block": "blocks merged by their log-sum-exp",
        "all_to_all_attention": "all-to-all attention",
        "sequence_to_head_shards": "its first all-to-all",
        "head_to_sequence_shards": "its second",
        "AllToAll": "its autograd function",
        "get_model_inputs": "each rank's share of the sequences, positions and labels cut before the split",
        "compile_layers": "with --cp > 1 the attention across the split runs eager (c10d's sends and receives end a "
                          "graph); the layer's other modules compile",
    },
    ("04", "10"): {
        "main": "an (edp, ep) device mesh, the experts' forward registered with transformers, the load-balancing loss "
                "of the global batch added to the loss (and logged with the expert load), the selection biases moved "
                "after each step, the gradient norm over both meshes, and no refusal of output_router_logits",
        "get_parser": "the --ep and --expert-bias-rate options, and the tiny mixture-of-experts model as the default",
        "parse_args": "--ep must be at least 1 too",
        "shard_model": "each MoE layer's experts split over ep and FSDP-sharded over edp, in a group of their own; "
                       "the rest sharded over the (edp, ep) mesh flattened; each layer prefetches the next's "
                       "all-gathers ahead of its host sync",
        "shard_experts": "the experts' sharding and gradient reduction",
        "# 1b. Expert parallelism": "the section of expert parallelism",
        "get_device_mesh": "the (edp, ep) mesh, and a degree that cannot split the experts gets a one-line error",
        "experts_implementation": "the expert-parallel forward registered with transformers",
        "expert_parallel_experts": "the dispatch, the local experts and the combine",
        "LoadBalancing": "the load-balancing loss of the global batch, DeepSeek-V3's bias update, the expert load",
        "clip_grad_norm": "the gradient norm over the experts' mesh and the rest's",
        "get_flops_per_token": "MFU counts the active parameters: top-k of each layer's experts",
        "log_metrics": "the log line shows the auxiliary loss and the expert load",
        "compile_layers": "a MoE block runs eager (it reads its split sizes on the host, which ends a graph); the "
                          "other modules of its layer compile",
    },
    ("07", "11"): {
        "main": "a (dp, pp, cp, tp) mesh and its checks, the model parallelized by parallelize(), each rank's "
                "tokens and shifted labels, one pipeline schedule per optimizer step (none at --pp 1), the loss as "
                "each rank's share of the global mean, the gradient norm over all stages",
        "parallelize": "the composition, in torchtitan's order: tensor parallelism, the attention across the split "
                       "(chapter 09), activation checkpointing and compile, the pipeline split (chapter 08), FSDP "
                       "over dp and cp on each stage; a degree of 1 wraps nothing",
        "get_parser": "chapter 08's --pp options and chapter 09's --cp and --cp-load-balance (their definitions), without "
                      "--dp-replicate: hybrid sharding is left out of the 4D mesh",
        "get_device_mesh": "the 4D mesh, tp innermost, dp outermost (Llama 3's order)",
        "compile_layers": "chapter 09's, unchanged (COPIES): the ring attention runs eager",
        "shard_model": "chapter 08's FSDP per stage (its layers a dict), summing the gradients as chapter 09 does "
                       "(each rank's loss is its share of the global mean)",
        "save_checkpoint": "chapter 08's: the saved parameter group lists every stage's names",
        "PIPELINE_SCHEDULES": "chapter 08's, unchanged (COPIES)",
        "check_pipeline_layout": "chapter 08's, unchanged (COPIES)",
        "split_into_stages": "chapter 08's, unchanged (COPIES)",
        "DecoderStage": "chapter 08's, unchanged (COPIES)",
        "check_context_parallel": "chapter 09's checks of the ring (11 leaves chapter 09's all-to-all attention out)",
        "register_context_parallel_attention": "chapter 09's, the ring only",
        "# 1b. Attention across the split": "chapter 09's section of the split attention",
        "get_token_indices": "chapter 09's, unchanged (COPIES)",
        "ring_attention": "chapter 09's, unchanged (COPIES)",
        "RingAttention": "chapter 09's, unchanged (COPIES)",
        "ring_steps": "chapter 09's, unchanged (COPIES)",
        "start_ring_pass": "chapter 09's, unchanged (COPIES)",
        "visible_block": "chapter 09's, unchanged (COPIES)",
        "attention_block": "chapter 09's, unchanged (COPIES)",
        "attention_block_backward": "chapter 09's, unchanged (COPIES)",
        "repeat_key_value_heads": "chapter 09's, unchanged (COPIES)",
        "merge_block": "chapter 09's, unchanged (COPIES)",
        "# 6. The training loop: the pipeline": "chapter 08's section of the pipeline's helpers",
        "get_loss_function": "chapter 08's loss on the last stage, from labels shifted before the cp split, as "
                             "a share of the step's mean over every rank's labels (chapter 09's form)",
        "build_pipeline_schedule": "chapter 08's, unchanged (COPIES)",
        "FSDPPipelineStage": "chapter 08's, unchanged (COPIES)",
        "clip_grad_norm_across_stages": "chapter 08's, unchanged (COPIES)",
    },
}
for allowed in LINEAGE.values():
    allowed.update({"__doc__": "the chapter's own summary and commands", "imports": "what the chapter's code uses"})
MUST_EXIST = {("01", "02")}

# (base chapter, chapter) -> {a comment line the chapter rewords, inside an allowlisted definition, away from the code
# it is about: why the lesson rewords it}. Any other hunk of comments or formatting alone fails (find_reflows).
REWORDED = {
    ("03", "04"): {
        "# 1. The model: built empty, sharded, then filled with its pretrained weights (or from the seed if it has "
        "none).": "the model is built on the meta device, sharded, then loaded or seeded",
    },
    ("04", "05"): {
        "# 2. The data: examples labelled on their answers only, packed into rows of --seq-length, cached on disk.":
            "the section now prepares fine-tuning data",
        "# NOTE: each rank's loss is its share of the global batch's mean loss: their sum is the mean.":
            "the loss is divided by the global batch's label tokens: the division by the world size is gone a line "
            "on",
        "# NOTE: resharded after forward, but the last layer and the output group below, whose backward comes next.":
            "at 405B the norm and head are a group of their own that stays gathered; the root holds nothing",
    },
    ("04", "06"): {
        "# NOTE: the parameters are this rank's slices, so AdamW's moments are sliced too.":
            "tensor parallelism slices the parameters instead of sharding them",
    },
    ("04", "08"): {
        "# 1. The model: built empty, cut into stages, sharded, filled with its pretrained weights (or from the seed).":
            "the model is cut into stages",
        "# 6. The training loop, one pipeline schedule per optimizer step.": "the loop runs the pipeline's schedule",
        "# NOTE: last-stage ranks hold their share's mean, the others 0: the sum / dp is the global batch's loss.":
            "only the last stage computes a loss; it is divided by dp, not the world size, a few lines on",
    },
    ("04", "09"): {
        "# NOTE: each rank's loss is its share of the global batch's mean loss: their sum is the mean.":
            "the loss is summed, not averaged: the division by the world size is gone a line on",
        "# NOTE: each checkpoint holds a compiled forward, fully_shard wraps both: FSDP's collectives are neither":
            "the ring's sends run inside the checkpointed layers, eager, and again in the recompute",
    },
    ("04", "10"): {
        "# NOTE: each checkpoint holds a compiled forward, fully_shard wraps both: FSDP's collectives are neither":
            "the experts' all-to-alls run inside the checkpointed layers, and again in the recompute",
    },
    ("06", "07"): {
        "# NOTE: AdamW's moments are sliced as the parameters are (on the CPU with --cpu-offload).":
            "chapter 07 brings back chapter 04's --cpu-offload",
    },
    ("07", "11"): {
        "# 1. The model: built empty, parallelized in 4D, given its pretrained weights (or the seed's).":
            "parallelize() composes the four dimensions where chapter 07 composed two",
        "# 6. The training loop, one pipeline schedule per optimizer step.": "chapter 08's loop, the pipeline's "
                                                                              "schedule",
        "# NOTE: last-stage ranks hold their share (tp ranks alike), the others 0.":
            "chapter 08's loss of the last stage, which the tp ranks of a share hold alike",
    },
}

# (source chapter, chapter) -> the definitions a chapter takes from another chapter than its base (a second parent,
# or an ancestor whose definition the base drops): each must stay byte-identical to the source's (chapter 11 is
# chapter 07 with 08's pipeline and 09's split; chapter 07 brings back chapter 04's FSDP, which chapter 06 has not).
COPIES = {
    ("04", "07"): ["shard_model"],
    ("08", "11"): ["PIPELINE_SCHEDULES", "check_pipeline_layout", "split_into_stages", "DecoderStage",
                   "# 6. The training loop: the pipeline", "build_pipeline_schedule", "FSDPPipelineStage",
                   "clip_grad_norm_across_stages", "save_checkpoint"],
    ("09", "11"): ["compile_layers", "# 1b. Attention across the split", "get_token_indices", "ring_attention", "RingAttention",
                   "ring_steps", "start_ring_pass", "visible_block", "attention_block", "attention_block_backward",
                   "repeat_key_value_heads", "merge_block"],
}


def statement_name(node):
    """The name the drift check gives a top-level statement: a definition's name, "__doc__" for the module's
    docstring, "imports" for the imports, and the statement's own first line for any other (a module-level call,
    an assignment to an attribute, `if __name__ == "__main__":`)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign) and all(isinstance(target, ast.Name) for target in node.targets):
        return [target.id for target in node.targets]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return ["imports"]
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return ["__doc__"]
    return [ast.unparse(node).splitlines()[0]]


def top_level_definitions(source):
    """{name: source text} of every top-level statement of a module (statement_name), in the order of the file.

    The text of a statement is its whole lines, from its first decorator (or the comment lines right above it) to
    its last line; consecutive imports are one statement, "imports". A block of comment lines of its own (a
    section's title) is one too, named by its first line. Only blank lines between statements are left out.
    """
    lines = source.splitlines(keepends=True)
    definitions = {}
    previous_end, previous_name = 0, None
    for node in ast.parse(source).body:
        first_line = min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])
        while first_line - 1 > previous_end and lines[first_line - 2].lstrip().startswith("#"):
            first_line -= 1
        block = []
        for line in lines[previous_end:first_line - 1] + ["\n"]:
            if line.strip():
                block.append(line)
            elif block:
                definitions[block[0].strip()] = "".join(block)
                block, previous_name = [], None
        text = "".join(lines[first_line - 1:node.end_lineno])
        for name in statement_name(node):
            definitions[name] = definitions[name] + text if name == previous_name == "imports" else text
            previous_name = name
        previous_end = node.end_lineno
    return definitions


def code_tokens_by_line(text):
    """{line number: [token, ...]} of the code of a statement's text: comments, line breaks and indentation left out;
    a string over several lines (a docstring) is cut into its lines, each on its own."""
    tokens = {}
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skipped:
            for row, piece in enumerate(token.string.split("\n"), token.start[0]):
                tokens.setdefault(row, []).append(piece)
    return tokens


def find_reflows(base_text, chapter_text):
    """The hunks of a changed definition that replace lines with lines of the same code: only comments, line breaks
    or spacing differ. Each is the hunk's diff lines, "-" for the base's, "+" for the chapter's."""
    base_lines, chapter_lines = base_text.splitlines(), chapter_text.splitlines()
    base_tokens, chapter_tokens = code_tokens_by_line(base_text), code_tokens_by_line(chapter_text)
    matcher = difflib.SequenceMatcher(a=base_lines, b=chapter_lines, autojunk=False)
    reflows = []
    for operation, base_start, base_end, chapter_start, chapter_end in matcher.get_opcodes():
        base_code = [token for row in range(base_start + 1, base_end + 1) for token in base_tokens.get(row, [])]
        chapter_code = [token for row in range(chapter_start + 1, chapter_end + 1)
                        for token in chapter_tokens.get(row, [])]
        if operation == "replace" and base_code == chapter_code:
            reflows.append([f"-{line}" for line in base_lines[base_start:base_end]] +
                           [f"+{line}" for line in chapter_lines[chapter_start:chapter_end]])
    return reflows


def find_drift(base_source, chapter_source, allowed, base_name="base", chapter_name="chapter", reworded=()):
    """What breaks the drift check, one message per problem; an empty list when the chapter is clean."""
    base, chapter = top_level_definitions(base_source), top_level_definitions(chapter_source)
    shared = [name for name in base if name in chapter]
    problems, rewords_found = [], set()
    for name in shared:
        if name not in allowed and base[name] != chapter[name]:
            diff = list(difflib.unified_diff(base[name].splitlines(), chapter[name].splitlines(), base_name,
                                             chapter_name, n=1, lineterm=""))
            shown = "\n".join(diff[:30] + ([f"... ({len(diff) - 30} more lines)"] if len(diff) > 30 else []))
            problems.append(f"{name} drifted from the base chapter; make it identical again, or add it to the "
                            f"allowlist with the reason this chapter's lesson changes it:\n{shown}")
        elif name in allowed and base[name] != chapter[name]:
            for reflow in find_reflows(base[name], chapter[name]):
                new_lines = [line[1:].strip() for line in reflow if line.startswith("+")]
                if new_lines[0] in reworded:
                    rewords_found.add(new_lines[0])
                    continue
                problems.append(f"{name} changes only comments or formatting in these lines, which the lesson does not "
                                f"need; make them identical to {base_name}'s again, or change them with the code they "
                                "are about:\n" + "\n".join(reflow))
    for name in [*[name for name in base if name not in chapter], *[name for name in chapter if name not in base]]:
        if name not in allowed:
            where = chapter_name if name in chapter else base_name
            problems.append(f"{name} is in {where} only; make the scripts agree, or add it to the allowlist with the "
                            f"reason this chapter's lesson adds or removes it:\n{(chapter | base)[name][:2000]}")
    for name in allowed:
        if name not in base and name not in chapter:
            problems.append(f"the allowlisted {name} is in neither script: remove it from the allowlist")
        elif name in base and name in chapter and base[name] == chapter[name]:
            problems.append(f"the allowlisted {name} is identical in both scripts: remove it from the allowlist")
    for line in reworded:
        if line not in rewords_found:
            problems.append(f"the reworded comment {line!r} is not in a hunk of comments alone: remove it from "
                            "REWORDED")
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
                          base_name, chapter_name, REWORDED.get((base, chapter), {}))
    assert not problems, f"{chapter_name} vs its base {base_name}:\n\n" + "\n\n".join(problems)


def find_copy_drift(source_source, chapter_source, names, source_name="source", chapter_name="chapter"):
    """What breaks the copies check, one message per problem: a name missing from either script (a stale entry), or
    a copy whose text differs from its source's."""
    source, chapter = top_level_definitions(source_source), top_level_definitions(chapter_source)
    problems = []
    for name in names:
        missing = [where for where, definitions in ((source_name, source), (chapter_name, chapter))
                   if name not in definitions]
        if missing:
            problems.append(f"the copied {name} is not in {' or '.join(missing)}: remove it from COPIES")
        elif source[name] != chapter[name]:
            diff = difflib.unified_diff(source[name].splitlines(), chapter[name].splitlines(), source_name,
                                        chapter_name, n=1, lineterm="")
            problems.append(f"{name} drifted from its source; copy it again, or make it the chapter's own (out of "
                            f"COPIES, allowlisted with the reason):\n" + "\n".join(list(diff)[:30]))
    return problems


@pytest.mark.parametrize("source, chapter", COPIES, ids=[f"{source}-in-{chapter}" for source, chapter in COPIES])
def test_what_a_chapter_copies_from_another_parent_stays_identical(source, chapter):
    if not (script(source).exists() and script(chapter).exists()):
        pytest.skip(f"no {script(source).relative_to(REPO)} or {script(chapter).relative_to(REPO)} yet")
    source_name, chapter_name = (str(script(name).relative_to(REPO)) for name in (source, chapter))
    problems = find_copy_drift(script(source).read_text(), script(chapter).read_text(), COPIES[source, chapter],
                               source_name, chapter_name)
    assert not problems, f"{chapter_name}'s copies from {source_name}:\n\n" + "\n\n".join(problems)


def test_the_copies_check_names_an_edited_copy_and_a_stale_name():
    chapter_source = script("11").read_text()
    old = "    everything = slice(None)\n"
    assert chapter_source.count(old) == 1
    problems = find_copy_drift(script("09").read_text(), chapter_source.replace(old, "    everything = slice(0)\n"),
                               [*COPIES["09", "11"], "no_such_function"])
    assert len(problems) == 2 and problems[0].startswith("visible_block drifted from its source"), problems
    assert problems[1] == "the copied no_such_function is not in source or chapter: remove it from COPIES"
    assert find_copy_drift(script("09").read_text(), chapter_source, COPIES["09", "11"]) == []


# The check itself: each edit below, made to chapter 01 alone (against 02), or to the first chapter of a pair given
# (against the second), must be caught and named.
EDITS = {
    "code": ("cut_into_chunks", "range(0, len(stream) - seq_length + 1, seq_length)",
             "range(0, len(stream) - seq_length, seq_length)"),
    "comment": ("find_latest_checkpoint", "# NOTE: a folder is named \"checkpoint-*\" only once complete",
                "# NOTE: a checkpoint folder is renamed when complete"),
    "decorator": ("init_weights", "@torch.no_grad()\ndef init_weights", "def init_weights"),
    "constant": ("PEAK_BF16_FLOPS", '"H200": 989e12', '"H200": 990e12'),
    "method": ("FSDPPipelineStage", "self.submod.set_is_last_backward(False)", "self.submod.set_is_last_backward(True)",
               ("08", "08")),
}


@pytest.mark.parametrize("edit", EDITS)
def test_the_check_names_a_definition_edited_in_one_chapter_only(edit):
    name, old, new, *pair = EDITS[edit]
    base, chapter = pair[0] if pair else ("01", "02")
    base_source = script(base).read_text()
    assert base_source.count(old) == 1
    problems = find_drift(base_source.replace(old, new), script(chapter).read_text(), LINEAGE.get((base, chapter), {}))
    assert len(problems) == 1 and problems[0].startswith(f"{name} drifted"), problems
    assert "--- base\n+++ chapter\n@@" in problems[0]
    # The diff goes from the edited base to the chapter, which still has the text the edit replaced.
    assert any(line.startswith("+") and old.splitlines()[0].strip() in line for line in problems[0].splitlines())


def test_the_check_fails_a_stale_allowlist_entry():
    allowed = {**LINEAGE["01", "02"], "require": "no reason", "no_such_function": "no reason"}
    problems = find_drift(script("01").read_text(), script("02").read_text(), allowed)
    assert problems == ["the allowlisted require is identical in both scripts: remove it from the allowlist",
                        "the allowlisted no_such_function is in neither script: remove it from the allowlist"]


def test_the_check_fails_a_moved_definition():
    chapter_source = script("02").read_text()
    moved = top_level_definitions(chapter_source)["cut_into_chunks"]
    chapter_source = chapter_source.replace(moved, "") + "\n\n" + moved
    problems = find_drift(script("01").read_text(), chapter_source, LINEAGE["01", "02"])
    assert problems == ["shared definitions moved: cut_into_chunks; keep them in the base chapter's order"]


# Each addition below, made to chapter 02 alone outside its allowlisted definitions, must be caught and named.
ADDITIONS = {
    "attribute assignment": ("\nfrom tqdm import tqdm\n",
                             "\nfrom tqdm import tqdm\ntorch.backends.cuda.matmul.allow_tf32 = True\n",
                             "torch.backends.cuda.matmul.allow_tf32 = True is in chapter only"),
    "module-level call": ("\nfrom tqdm import tqdm\n",
                          "\nfrom tqdm import tqdm\ntorch.set_float32_matmul_precision('high')\n",
                          "torch.set_float32_matmul_precision('high') is in chapter only"),
    "definition": ("\ndef main():", "\ndef helper():\n    pass\n\n\ndef main():", "helper is in chapter only"),
}


@pytest.mark.parametrize("addition", ADDITIONS)
def test_the_check_names_what_a_chapter_adds_outside_its_definitions(addition):
    old, new, expected = ADDITIONS[addition]
    chapter_source = script("02").read_text()
    assert chapter_source.count(old) == 1
    problems = find_drift(script("01").read_text(), chapter_source.replace(old, new), LINEAGE["01", "02"])
    assert len(problems) == 1 and problems[0].startswith(expected), problems


# Each edit below, made to chapter 02 alone inside its allowlisted main(), changes no code: it must be caught and named.
FUSED_NOTE = "    # NOTE: fused=True: one kernel per group of tensors."
REFLOWS = {
    "reflow": ("    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(\n"
               "        optimizer, lambda step: warmup_cosine_lr_factor(step, args.warmup_steps, max_steps))",
               "    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,\n"
               "        lambda step: warmup_cosine_lr_factor(step, args.warmup_steps, max_steps))"),
    "reworded comment": (FUSED_NOTE, FUSED_NOTE.replace("one kernel per group", "a kernel for each group")),
}


@pytest.mark.parametrize("edit", REFLOWS)
def test_the_check_names_a_reflow_inside_an_allowlisted_definition(edit):
    old, new = REFLOWS[edit]
    base_source, chapter_source = script("01").read_text(), script("02").read_text()
    assert chapter_source.count(old) == 1
    problems = find_drift(base_source, chapter_source.replace(old, new), LINEAGE["01", "02"])
    assert len(problems) == 1 and problems[0].startswith("main changes only comments or formatting"), problems
    assert problems[0].endswith("\n".join([*(f"-{line}" for line in old.splitlines()),
                                           *(f"+{line}" for line in new.splitlines())]))
    # Justified in REWORDED, the same hunk passes; a justification that matches no hunk is named.
    reworded = {new.splitlines()[0].strip(): "a reason"}
    assert find_drift(base_source, chapter_source.replace(old, new), LINEAGE["01", "02"], reworded=reworded) == []
    assert find_drift(base_source, chapter_source, LINEAGE["01", "02"], reworded=reworded) == [
        f"the reworded comment {new.splitlines()[0].strip()!r} is not in a hunk of comments alone: remove it from "
        "REWORDED"]


def test_the_check_lets_a_chapter_add_a_comment_line_or_reword_one_with_its_code():
    base_source, chapter_source = script("01").read_text(), script("02").read_text()
    assert chapter_source.count(FUSED_NOTE + "\n") == 1
    added = chapter_source.replace(FUSED_NOTE + "\n", FUSED_NOTE + "\n    # NOTE: a sentence this chapter adds.\n")
    assert find_drift(base_source, added, LINEAGE["01", "02"]) == []
    old = FUSED_NOTE + "\n    adamw_options = dict(lr=args.lr, betas=(0.9, 0.95),"
    assert chapter_source.count(old) == 1
    changed = chapter_source.replace(old, "    # NOTE: another beta.\n"
                                          "    adamw_options = dict(lr=args.lr, betas=(0.9, 0.99),")
    assert find_drift(base_source, changed, LINEAGE["01", "02"]) == []
