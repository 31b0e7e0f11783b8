"""Sample a continuation of a prompt from the latest checkpoint of any chapter's experiment.

    python tools/generate.py outputs/01-single-gpu --prompt "ROMEO:" --max-new-tokens 60
    python tools/generate.py outputs/llama-8b-fsdp -m meta-llama/Llama-3.1-8B --prompt "The capital of France is"
    python tools/generate.py --untrained --prompt "ROMEO:"        # the seeded weights the CPU runs start from
    python tools/generate.py outputs/05-training-llama-405b --chat --prompt "Which play has this line?

    To be, or not to be: that is the question:"                      # a fine-tuned model, asked in its chat template

EXPERIMENT_DIR is an experiment folder (its latest checkpoint-* is used) or one checkpoint folder. Chapters 01-03
write model.pt; chapters 04-07 write DCP shards, which this one process reads whole, whatever the number of ranks
that wrote them. The model is built from the checkpoint's model_config.json; the tokenizer comes from -m, which
must be the -m the run trained with (default: the bundled tiny Llama). With --chat the prompt is a user's turn in the
tokenizer's chat template, followed by the template's start of an answer, and only the answer is printed.
"""

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(
        description="Print a sampled continuation of a prompt from the latest checkpoint of an experiment.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("experiment_dir", nargs="?", help="outputs/NAME, or one of its checkpoint-* folders")
    parser.add_argument("-m", "--model-name", default=str(REPO_ROOT / "data" / "tiny-llama"),
                        help="where the tokenizer is: the -m the experiment was trained with")
    parser.add_argument("--prompt", default="ROMEO:", help="the text to continue")
    parser.add_argument("--chat", action="store_true", help="ask the prompt as a user's turn of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=60, help="how many tokens to add")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 picks the likeliest")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (and of --untrained's weights)")
    parser.add_argument("--untrained", action="store_true",
                        help="no checkpoint: the weights chapter 01 initializes from --seed on a CPU, before any step")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.prompt:
        fail('--prompt is empty; give text to continue, e.g. --prompt "ROMEO:"')
    if (args.experiment_dir is None) == (not args.untrained):
        fail("give an experiment folder (e.g. outputs/01-single-gpu), or --untrained for the initial weights")

    import torch

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model_name)
    if args.untrained:
        model = untrained_model(args.model_name, args.seed)
        source = f"the untrained weights of seed {args.seed}"
    else:
        checkpoint_dir = find_checkpoint(Path(args.experiment_dir))
        model = load_model(checkpoint_dir)
        source = str(checkpoint_dir)
    if args.chat and not tokenizer.chat_template:
        fail(f"the tokenizer of {args.model_name} has no chat template; drop --chat, or pass -m a model that has one")
    if len(tokenizer) > model.config.vocab_size:
        fail(f"the tokenizer of {args.model_name} has {len(tokenizer)} tokens, the model {model.config.vocab_size}; "
             "pass -m the model folder the experiment was trained with")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    print(f"{source}:", file=sys.stderr)
    print(sample(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, device, args.chat))


def fail(message):
    raise SystemExit(f"error: {message}")


def load_tokenizer(model_name):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError) as error:
        fail(f"cannot load a tokenizer from {model_name!r} ({str(error).strip().splitlines()[0]}); pass -m the "
             "model folder or hub name the experiment was trained with")


def find_checkpoint(path):
    """The folder itself if it is a checkpoint, else the experiment's latest checkpoint-* (complete by construction:
    the scripts rename a checkpoint folder only once every file is written)."""
    if (path / "model_config.json").exists():
        return path
    checkpoints = sorted(path.glob("checkpoint-*"))
    if not checkpoints:
        fail(f"no checkpoint in {path}; train first (python 01-single-gpu/train_llm.py writes outputs/01-single-gpu), "
             "or pass a checkpoint-* folder")
    return checkpoints[-1]


def build_model(config):
    """The model of a config on the CPU, in fp32, built on the meta device and allocated without initializing: the
    weights come from a checkpoint, only the rotary frequencies (a buffer no state dict holds) are computed."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            for name, buffer in type(module)(module.config).named_buffers():
                module.register_buffer(name, buffer, persistent=False)
    return model


def load_model(checkpoint_dir):
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint_dir / "model_config.json")
    model = build_model(config)
    if (checkpoint_dir / "model.pt").exists():
        state_dict = torch.load(checkpoint_dir / "model.pt", map_location="cpu", weights_only=True)
    else:
        # NOTE: without a process group, dcp.load() reads into this one process; asked for whole tensors, it
        # stitches every rank's shards together. Asking for "model" only skips the optimizer state.
        state_dict = model.state_dict()
        dcp.load({"model": state_dict}, checkpoint_id=checkpoint_dir)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if unexpected or [name for name in missing if not name.endswith("lm_head.weight") or not config.tie_word_embeddings]:
        fail(f"{checkpoint_dir} does not match its model_config.json (missing {missing[:3]}, unexpected "
             f"{unexpected[:3]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def untrained_model(model_name, seed):
    """The weights every chapter starts from, made by chapter 01's own init_weights() (seeded by parameter name)."""
    import importlib.util

    from transformers import AutoConfig

    spec = importlib.util.spec_from_file_location("train_llm_01", REPO_ROOT / "01-single-gpu" / "train_llm.py")
    chapter01 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter01)
    model = build_model(AutoConfig.from_pretrained(model_name))
    chapter01.init_weights(model, seed)
    return model


def sample(model, tokenizer, prompt, max_new_tokens, temperature, top_k, device, chat=False):
    import torch

    if chat:
        # NOTE: the template adds the special tokens itself, as chapter 05's fine-tuning saw them.
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                                top_k=top_k if temperature > 0 else None, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0, input_ids.shape[1]:] if chat else output[0], skip_special_tokens=True)


if __name__ == "__main__":
    main()
