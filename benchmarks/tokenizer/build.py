"""Build the small tokenizer that tests, the demo and the benchmarks use in precise mode.

Precise routing tokenizes prompts exactly as the model server does, which needs the model's
``tokenizer.json`` and chat template. Nothing here may download a model, so the project ships
its own: a byte-level BPE vocabulary trained with the ``tokenizers`` library on text this script
generates (seeded, so a rebuild gives the same text), and a ChatML chat template in
``tokenizer_config.json``, the two files a Hugging Face model directory holds. Simulated endpoints
started with ``--tokenizer benchmarks/tokenizer`` tokenize with the same files, so their KV-event
blocks match the picker's request blocks.

The output is committed; rebuild with ``python -m kv_picker_bench.tokenizer.build``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 3000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style ChatML: every message is framed by <|im_start|>role\n ... <|im_end|>\n, and the
# generation prompt opens the assistant turn. Earlier turns render identically, so a
# conversation's later requests share their leading tokens with the earlier ones.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORD_TEXT = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an had they you were their one all we can her has there been if more when will would who so
no what up out about into than them only other new some could time these two may then do first
any my now such like our over man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state
good very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used
take three system question answer request response model server cache block token prefix route
pick queue batch decode prefill memory tensor layer head weight kernel stream event index score
policy load pool shard replica gateway envoy endpoint latency throughput context window user
assistant message document summary report table value number price order customer account data
alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa
quebec romeo sierra tango uniform victor whiskey xray yankee zulu group shared asks session turn
"""
_WORDS = _WORD_TEXT.split()
_PUNCTUATION = [".", ",", "?", "!", ":", ";", " -", "'s", "(", ")", '"']


def corpus(seed: int, sentences: int) -> Iterator[str]:
    """Seeded sentences of common English, domain words, numbers, punctuation and code."""
    rng = random.Random(seed)
    for i in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        text = " ".join(words)
        if rng.random() < 0.5:
            text = text.capitalize()
        text += rng.choice(_PUNCTUATION[:4])
        if rng.random() < 0.1:
            name = rng.choice(_WORDS)
            text += f"\ndef {name}_{i % 97}(x):\n    return x + {rng.randint(0, 9)}\n"
        yield text


def build(out_dir: Path, seed: int = 0, sentences: int = 40_000) -> None:
    """Train the tokenizer and write ``tokenizer.json`` and ``tokenizer_config.json``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed, sentences), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output directory (this one)")
    args = parser.parse_args()
    build(args.out)
    print(f"wrote {args.out / 'tokenizer.json'} and tokenizer_config.json")


if __name__ == "__main__":
    main()
