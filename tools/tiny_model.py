"""Write the tiny random-weight Inkling that vLLM serves on CPU through the port's own model code
(inkling_hpu, the CPU glue): config.json, safetensors weights and a byte-level BPE tokenizer trained
here on local text, with a chat template and Inkling's message markers. Nothing is downloaded. A
stand-in for serving tests: it answers nothing sensibly (semantic gates say so), but every serving
mechanism (chunked prefill, prefix caching, logprobs, streaming, metrics, parsers) runs.

Its config.json is in the checkpoint's own format (vLLM's `inkling_model`); its weights are
transformers' Inkling with seeded random weights under the TML checkpoint names (`model.llm.*`, two
shards and an index), next to vision and audio tower tensors and an `mtp.safetensors`, which the
port's text-only loader must leave unread. Its tokenizer has 1,023 ids beside 1,024 embedding rows, so
every prompt id vLLM admits has a row (the port's start-up guard checks it here too). `reference.json`
records the seed and config, so a test can rebuild the same model in transformers and compare tokens.

    <server venv>/bin/python tools/tiny_model.py OUT_DIR [--max-position 4096] [--experts 8 --top-k 2]

Run with the server venv's python (transformers, tokenizers, torch; for `inkling`, inkling_hpu on
the path). Deterministic: the same arguments give the same weights and tokenizer.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# A role without a marker is refused, as a real chat template refuses it (vLLM answers HTTP 400).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported message role ' ~ m['role'] ~ '; expected system, user, assistant or tool') }}"
    "{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] if m['content'] is string else '' }}</s>\n"
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


def build_tokenizer(out: Path, vocab_size: int, extra_specials: tuple[str, ...] = (), texts: list[str] | None = None,
                    split_digits: bool = False, chat_template: str = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer learned from `texts` (corpus() by default); `split_digits`: every digit a
    token of its own (numbers and codes are then read and written digit by digit)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + list(extra_specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus() if texts is None else texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


# The served Inkling: every block of the real architecture at toy widths. One KV spec for every layer
# (local and global layers share heads and head dim: one KV group), head dim 64 (vLLM's CPU attention
# supports 32, 64, 80 and up), the real 512-token window and 128-token blocks (a 5-block decode
# window), 3 local + 1 global layer, one dense and three MoE layers, 8 experts of which 2 per token.
INKLING = {
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 64,
    "sliding_window_size": 512, "d_rel": 8, "rel_extent": 1024, "log_scaling_n_floor": 512,
    "log_scaling_alpha": 0.1, "local_layer_ids": [0, 1, 2], "dense_mlp_idx": 1, "intermediate_size": 64,
    "dense_intermediate_size": 256, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "route_scale": 2.5, "logits_mup_width_multiplier": 2.0, "sconv_kernel_size": 4, "rms_norm_eps": 1e-6,
    "use_embed_norm": True,
}
VOCAB_ROWS = 1024   # embedding and head rows; the tokenizer has one id fewer

# Tensors of the multimodal checkpoint that the text-only loader must leave unread.
TOWERS = {"model.visual.blocks.0.attn.qkv.weight": (384, 128), "model.visual.merger.mlp.0.weight": (128, 512),
          "model.audio.encoder.layers.0.fc1.weight": (256, 128)}
MTP = {"model.mtp.layers.0.eh_proj.weight": (128, 256), "model.mtp.layers.0.norm.weight": (128,)}


def model_config_for(tok, **changes) -> dict:
    """The architecture config (transformers' keys) of a tiny Inkling with this tokenizer. The embedding and
    head have one row more than the tokenizer has ids, as a real checkpoint pads them: vLLM admits a prompt id
    up to the tokenizer's vocab_size, a size it counts as an id (vllm/tokenizers/hf.py:132), and every admitted
    id needs a row. transformers' config reads vocab_size as the rows and unpadded_vocab_size as the logits kept."""
    return dict(INKLING, **changes, vocab_size=VOCAB_ROWS, unpadded_vocab_size=len(tok), padded_vocab_size=VOCAB_ROWS)


def build_inkling(out: Path, max_position: int = 4096, seed: int = 0, experts: int | None = None,
                  top_k: int | None = None, winning_padding: int = 0) -> Path:
    """`winning_padding`: that many padding rows past the tokenizer's ids (instead of one), whose logits beat
    every real token's, in a config.json of the published config's shape (vocab_size = padded_vocab_size, the
    rows; unpadded_vocab_size the tokenizer's): a server that samples from the padded width returns them."""
    import torch

    from inkling_hpu import parity
    from inkling_hpu.parsers.inkling_py import MARKERS

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=VOCAB_ROWS - max(1, winning_padding), extra_specials=tuple(MARKERS))
    model_config = model_config_for(tok, n_routed_experts=experts or INKLING["n_routed_experts"],
                                    num_experts_per_tok=top_k or INKLING["num_experts_per_tok"])
    reference = parity.build_reference(model_config, seed, torch.float32)
    if winning_padding:
        make_padding_win(reference, len(tok))
    write_checkpoint(out, reference, model_config, tok, max_position, seed=seed + 1,
                     published_vocab_shape=bool(winning_padding))
    if not winning_padding:    # the padded model's weights are no seed's: tests read them back from the files
        (out / "reference.json").write_text(json.dumps({"seed": seed, "config": model_config}, indent=1))
    (out / "stand-in.json").write_text(json.dumps({"stand_in": True, "why": "random weights, for serving tests"}))
    return out


def make_padding_win(reference, real_ids: int, margin: float = 2.0) -> None:
    """Every embedding row carries a large hidden channel 0, which the residual stream keeps (the layers' random
    outputs are small beside it) and the final norm makes the largest channel; the head's padding rows read
    +margin from it, the real rows -margin: each padding logit beats every real token's by about twice the
    normed channel 0 times the margin, over the μP divisor (about 4.6 nats on the tiny Inkling)."""
    import torch

    with torch.no_grad():
        embed, head = reference.get_input_embeddings().weight, reference.get_output_embeddings().weight
        embed[:, 0] = 50.0 * embed[:, 1:].abs().max()
        head[:, 0] = -margin
        head[real_ids:] = 0.0
        head[real_ids:, 0] = margin


def write_checkpoint(out: Path, reference, model_config: dict, tok, max_position: int, seed: int,
                     published_vocab_shape: bool = False) -> None:
    """transformers' Inkling `reference` in the checkpoint's layout: its text tensors under the TML names in two
    shards with an index, beside seeded random tower tensors and an mtp.safetensors, and config.json in the
    checkpoint's own format (`published_vocab_shape`: its vocabulary stated as the published config states it)."""
    import torch
    from safetensors.torch import save_file

    from inkling_hpu import parity, vllm_model

    text = {name: t.contiguous() for name, t in parity.reference_to_checkpoint(reference).items()}
    generator = torch.Generator().manual_seed(seed)
    towers = {name: torch.randn(shape, generator=generator) for name, shape in TOWERS.items()}
    names = sorted(text)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for i, (file, members) in enumerate(shards.items()):
        tensors = {n: text[n] for n in members}
        if i == 0:
            tensors.update(towers)               # towers share a shard with text tensors, as in the checkpoint
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
    save_file({n: torch.randn(s, generator=generator) for n, s in MTP.items()}, str(out / "mtp.safetensors"),
              metadata={"format": "pt"})
    weight_map.update({n: "mtp.safetensors" for n in MTP})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    # The checkpoint's own format (vLLM's InklingModelConfig), whose defaults differ from the architecture
    # for these fields: a real config.json states them.
    # vLLM's InklingModelConfig reads vocab_size as the logits kept when padded_vocab_size is stated (it then sets
    # unpadded_vocab_size to it), and checks prompt, logit-bias and stop ids against it.
    # The published config states vocab_size as the rows (201,024), as padded_vocab_size, beside unpadded_vocab_size.
    config = dict(model_config, vocab_size=VOCAB_ROWS if published_vocab_shape else len(tok), model_type="inkling_model", architectures=["InklingForCausalLM"],
                  max_position_embeddings=max_position, tie_word_embeddings=False, torch_dtype="float32",
                  use_sconv=True, use_gate_bias=True, shared_expert_sink=True, norm_after_topk=True,
                  gate_activation="sigmoid", hidden_act="silu", inference_moe_w13_interleaved=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if parity.InklingPortConfig.from_dict(config) != parity.InklingPortConfig.from_dict(model_config):
        raise AssertionError("config.json describes another model than the reference's config")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    vllm_model.check_checkpoint_token_ids(out)   # the port's start-up guard: every id vLLM admits has a row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-position", type=int, default=4096)
    parser.add_argument("--experts", type=int, help=f"routed experts (default {INKLING['n_routed_experts']})")
    parser.add_argument("--top-k", type=int, help=f"experts per token (default {INKLING['num_experts_per_tok']})")
    parser.add_argument("--winning-padding", type=int, default=0, metavar="N",
                        help="N padding rows whose logits beat every real token's, the vocabulary stated as the "
                             "published config states it (the padded-vocabulary fix's test)")
    args = parser.parse_args(argv)
    print(build_inkling(args.out, args.max_position, experts=args.experts, top_k=args.top_k,
                        winning_padding=args.winning_padding))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
