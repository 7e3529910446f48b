#!/usr/bin/env python3
"""Makes examples/kjv/, the README's main job: a small public-domain corpus, a tokenizer for
it and a small GPT exported for training.

- chapters.jsonl: the King James Version's books Genesis to Ruth (public domain: the
  translation was made in 1611), a chapter per line ({"text": ...}, verses joined), from
  Debian's bible-kjv package (`apt-get install bible-kjv`, its `bible` command);
- tokenizer.json: a byte-level BPE of 2048 ids trained on those chapters by the `tokenizers`
  package (`<|endoftext|>` id 0 ends each document);
- model.onnx and config.json: a GPT-2 of 4 layers, width 128, 4 heads, 256 positions, tied
  embeddings, seeded, saved as a Hugging Face model and exported by scripts/export_hf.py.

    apt-get install bible-kjv && cargo build --release
    HF_HUB_OFFLINE=1 /tmp/fxvenv/bin/python examples/kjv/make_example.py
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import tokenizers
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BOOKS = "gen1:1-ruth4:22"
VOCAB = 2048
EOT = "<|endoftext|>"


def chapters():
    """Each chapter's text ("Genesis 1. In the beginning ..."), verse numbers dropped."""
    text = subprocess.run(["bible", BOOKS], check=True, capture_output=True, text=True).stdout
    documents, title, verses = [], None, []
    for line in text.splitlines():
        heading = re.fullmatch(r"([1-3]?\s?[A-Z][a-zA-Z ]+ \d+)", line.strip())
        if heading:
            if title:
                documents.append(f"{title}. " + " ".join(verses))
            title, verses = heading.group(1), []
        elif line.strip():
            verse = re.sub(r"^\s*\d+\s+", "", line) if re.match(r"^\s+\d+ ", line) else line
            verses.append(verse.strip())
    documents.append(f"{title}. " + " ".join(verses))
    return [" ".join(d.split()) for d in documents]


def tokenizer(documents):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOT], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT, unk_token=EOT)


def gpt():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def main():
    documents = chapters()
    with open(os.path.join(HERE, "chapters.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in documents)
    with tempfile.TemporaryDirectory() as model_dir:
        gpt().save_pretrained(model_dir)
        tokenizer(documents).save_pretrained(model_dir)
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "export_hf.py"), model_dir, "--out", HERE],
                       check=True)
    print(f"{len(documents)} chapters, {sum(map(len, documents))} characters")


if __name__ == "__main__":
    main()
