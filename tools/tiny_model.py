"""Write a tiny random-weight Llama checkpoint that vLLM serves on CPU: config.json, safetensors
weights and a byte-level BPE tokenizer trained here on local text, with a chat template. Nothing is
downloaded. A stand-in for serving tests: it answers nothing sensibly (semantic gates say so), but
every serving mechanism (chunked prefill, prefix caching, logprobs, streaming, metrics) runs.

    <server venv>/bin/python tools/tiny_model.py OUT_DIR [--max-position 4096]

Run with the server venv's python (transformers, tokenizers, torch). Deterministic: the same
arguments give the same weights and tokenizer.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] if m['content'] is string else '' }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


def corpus() -> list[str]:
    """Local training text for the tokenizer: the gates' kind of prompts, digits, JSON."""
    lines = ["The committee reviewed the quarterly figures, noted the weather in the northern valley, "
                  "and moved on to the next item on a long and uneventful agenda. ",
             "What is the secret code of Aldebaran? Answer with the six digits only.",
             "Write one sentence about the number 12. Count slowly from 1 upwards, story 3.",
             " ".join(str(i) for i in range(2000)), '{"a": 1, "b": 2} [true, false, null]']
    return lines * 20


def build_tokenizer(out: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build(out: Path, max_position: int = 4096, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=1024)
    # head_dim 64: vLLM's CPU attention supports 32, 64, 80 and up (16 crashes at the first request)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=max_position, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                         torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "stand-in.json").write_text(json.dumps({"stand_in": True, "why": "random weights, for serving tests"}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-position", type=int, default=4096)
    args = parser.parse_args(argv)
    print(build(args.out, args.max_position))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
