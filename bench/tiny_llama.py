"""A tiny Llama built on this machine: config, an offline word-level tokenizer and seeded random weights.

What a real vLLM CPU engine needs to generate without a model hub (tests and ``kvtier bench engine``):
``config.json`` (2 layers, hidden 256, 4 query heads, 2 KV heads, head_dim 64: vLLM's CPU attention wants
head_dim >= 64), ``tokenizer.json`` + ``tokenizer_config.json`` built with the ``tokenizers`` package (words
``w0`` .. ``w999``, one token each, so a prompt's token ids are known without running the tokenizer), and
``model.safetensors`` with weights drawn from ``torch.Generator().manual_seed(seed)``: two builds with one
seed are bit-identical, another seed gives other weights at the same path (the negative control).

    python -m kvtier.bench.tiny_llama DIR [--seed N] [--layers 2]

Runs in the engine's environment (needs ``tokenizers`` and ``safetensors``, which vLLM depends on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 1000
SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 4, 2, 64, 512


def word(token_id: int) -> str:
    """The text of one token: prompts are written as words so that text and token ids agree one to one."""
    return next((w for w, i in SPECIAL.items() if i == token_id), f"w{token_id}")


def build(directory: str | Path, seed: int = 0, layers: int = 2) -> Path:
    """Write the model into ``directory`` (created); returns it. Overwrites the weights of an earlier build."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": VOCAB, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": SPECIAL["<s>"], "eos_token_id": SPECIAL["</s>"], "hidden_act": "silu"}, indent=1))
    vocab = {word(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "add_bos_token": False, "model_max_length": 8192}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": SPECIAL["</s>"]}))

    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN, std=1.0), "lm_head.weight": rand(VOCAB, HIDDEN),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
            p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.tiny_llama", description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0, help="weights seed (another seed: other weights)")
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    print(build(args.directory, args.seed, args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
