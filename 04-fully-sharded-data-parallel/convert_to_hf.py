"""Turn a sharded checkpoint of train_llm.py into a Hugging Face model folder that from_pretrained() loads.

A checkpoint of this chapter is one file of shards per rank, written by torch.distributed.checkpoint (DCP). This
script reads the weights (not the optimizer state) into one whole model, in a single process, and saves them with
save_pretrained(): config.json, model.safetensors, and the tokenizer of the model the run started from (the -m the
checkpoint records in model_source.json).

    python 04-fully-sharded-data-parallel/convert_to_hf.py outputs/04-fully-sharded-data-parallel
    python 04-fully-sharded-data-parallel/convert_to_hf.py outputs/llama-8b-fsdp/checkpoint-00000200 \\
        -o llama-8b-trained --dtype bfloat16

It needs the whole model in CPU memory: 4 bytes per parameter in float32, 2 in bfloat16.
"""

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def main():
    args = get_parser().parse_args()
    checkpoint_dir = find_checkpoint(Path(args.checkpoint))
    output_dir = Path(args.output_dir or checkpoint_dir.parent / f"hf-{checkpoint_dir.name}")
    tokenizer = load_tokenizer(args.model_name or recorded_model_name(checkpoint_dir))

    # NOTE: the architecture comes from the checkpoint itself, so the weights and their shapes always agree. The
    # model is built on the meta device (no memory, no random initialization) and then given empty CPU storage
    # that dcp.load() fills.
    config = AutoConfig.from_pretrained(checkpoint_dir / "model_config.json")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.to_empty(device="cpu")

    # NOTE: dcp.load() fills the tensors it is given, in place, by name: here the whole model's, so it reads every
    # rank's shards and stitches them together, whatever the world size that wrote them. Asking only for "model"
    # skips the optimizer state (twice the model's size). Without a process group it loads in this one process.
    state_dict = model.state_dict()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        dcp.load({"model": state_dict}, checkpoint_id=checkpoint_dir)
    except CheckpointException as error:
        # NOTE: DCP wraps each rank's exception, traceback included; its last line is the cause.
        cause = str(error).strip().splitlines()[-1]
        fail(f"cannot read the weights of {checkpoint_dir} ({cause}); its files are damaged, or do not match its "
             "model_config.json")
    # NOTE: to_empty() gave a tied head (tie_word_embeddings) a tensor of its own, which dcp.load() filled from the
    # checkpoint's copy of the matrix. Tied again, save_pretrained() writes the matrix once, as Hugging Face stores
    # tied models. A checkpoint whose two matrices differ was trained untied: both are saved, and from_pretrained()
    # loads them untied, with a warning.
    if config.tie_word_embeddings and torch.equal(model.get_input_embeddings().weight,
                                                  model.get_output_embeddings().weight):
        model.tie_weights()

    # NOTE: save_pretrained() skips non-persistent buffers (the rotary inv_freq that to_empty() left empty), and
    # from_pretrained() computes them afresh, so only trained weights go into the file.
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    print(f"saved {output_dir}: load it with AutoModelForCausalLM.from_pretrained({str(output_dir)!r})")


def get_parser():
    parser = argparse.ArgumentParser(
        description="Convert a sharded (DCP) checkpoint of train_llm.py into a Hugging Face model folder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("checkpoint",
                        help="a checkpoint folder (outputs/EXPERIMENT/checkpoint-XXXXXXXX), or an experiment folder "
                             "(outputs/EXPERIMENT) to convert its latest checkpoint")
    parser.add_argument("-m", "--model-name", default=None,
                        help="where the tokenizer saved next to the weights comes from (default: the -m the run was "
                             "trained with, recorded in the checkpoint's model_source.json)")
    parser.add_argument("-o", "--output-dir", default=None,
                        help="where to save the model, if not next to the checkpoint as hf-checkpoint-XXXXXXXX")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the saved weights (training keeps float32 master weights)")
    return parser


def fail(message):
    raise SystemExit(f"error: {message}")


def find_checkpoint(path):
    """The checkpoint folder itself, or the latest one of an experiment folder; fails unless it is complete."""
    if not path.is_dir():
        fail(f"{path} is not a folder; pass a checkpoint folder (outputs/EXPERIMENT/checkpoint-XXXXXXXX) or an "
             "experiment folder (outputs/EXPERIMENT)")
    checkpoints = sorted(path.glob("checkpoint-*"))
    if checkpoints:
        path = checkpoints[-1]
    # NOTE: train_llm.py renames a checkpoint folder only once every rank has written its shards; a tmp-checkpoint
    # folder is a save that was cut short. DCP writes .metadata (the index of all shards) last.
    missing = [name for name in [".metadata", "model_config.json"] if not (path / name).is_file()]
    if (path / "model.pt").is_file():
        fail(f"{path} holds model.pt, a checkpoint of chapters 01 to 03, not a sharded one of this chapter")
    if len(missing) == 2 and "checkpoint-" not in path.name:
        fail(f"{path} holds no checkpoint-XXXXXXXX folder; pass a checkpoint folder or an experiment folder "
             "(outputs/EXPERIMENT) of a run that saved one")
    if missing:
        fail(f"{path} is not a complete checkpoint (no {' or '.join(missing)}); pass a checkpoint-XXXXXXXX folder "
             "that train_llm.py finished writing, or its experiment folder")
    return path


def recorded_model_name(checkpoint_dir):
    source_file = checkpoint_dir / "model_source.json"
    if not source_file.is_file():
        fail(f"{checkpoint_dir} does not record the model it was trained from (no model_source.json, an older "
             "checkpoint); pass -m the model the run was trained with")
    return json.loads(source_file.read_text())["model_name"]


def load_tokenizer(model_name):
    try:
        return AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        fail(f"cannot load a tokenizer from {model_name!r} ({first_line}); pass -m the model the run trained")


if __name__ == "__main__":
    main()
