"""Tiny models built on this machine: config, an offline word-level tokenizer and seeded random weights.

What a real vLLM CPU engine needs to generate without a model hub (tests and ``kvtier bench engine``):
``config.json``, ``tokenizer.json`` + ``tokenizer_config.json`` built with the ``tokenizers`` package (words
``w0`` .. ``w<vocab-1>``, one token each, so a prompt's token ids are known without running the tokenizer), and
``model.safetensors`` with weights drawn from a seeded generator: two builds with one seed are bit-identical,
another seed gives other weights at the same path (the negative control).

Two kinds:
- the tiny Llama (default): 2 layers, hidden 256, 4 query heads, 2 KV heads, head_dim 64 (vLLM's CPU attention
  wants head_dim >= 64), weights drawn here from ``torch.Generator().manual_seed(seed)``;
- any architecture of a Hugging Face ``config.json`` (``--config``: e.g. the hybrid Gemma3 / Qwen3-Next configs
  of tests/engine/hybrid/): the model is instantiated by ``transformers`` from the config under
  ``torch.manual_seed(seed)`` and saved with ``save_pretrained`` (the checkpoint layout engines load, whatever
  the architecture), every matrix redrawn as the tiny Llama's are. Not ``load_format="dummy"``: vLLM's dummy
  weights make every greedy token the same, so a test could not tell loaded state from recomputed state.

    python -m kvtier.bench.tiny_llama DIR [--seed N] [--layers 2] [--config CONFIG.json]

Runs in the engine's environment (needs ``tokenizers``, ``safetensors`` and, for ``--config``,
``transformers``: vLLM depends on all three).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

VOCAB = 1000
SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 4, 2, 64, 512


def word(token_id: int) -> str:
    """The text of one token: prompts are written as words so that text and token ids agree one to one."""
    return next((w for w, i in SPECIAL.items() if i == token_id), f"w{token_id}")


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """The word-level tokenizer of ``vocab_size`` tokens (ids 0..2 special) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "add_bos_token": False, "model_max_length": 8192}, indent=1))


def build(directory: str | Path, seed: int = 0, layers: int = 2) -> Path:
    """Write the tiny Llama into ``directory`` (created); returns it. Overwrites the weights of an earlier build."""
    import torch
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": layers, "vocab_size": VOCAB, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": SPECIAL["<s>"], "eos_token_id": SPECIAL["</s>"], "hidden_act": "silu"}, indent=1))
    write_tokenizer(out, VOCAB)
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


def build_from_config(config: dict[str, Any], directory: str | Path, seed: int = 0) -> Path:
    """Write a model of the architecture ``config`` describes (a Hugging Face config.json's content) with random
    weights drawn under ``seed`` into ``directory`` (created); returns it. transformers instantiates and saves it,
    so every architecture it knows gets the checkpoint layout the engines load (per-expert MoE weights, ...)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, config.get("torch_dtype", "bfloat16")))
    # transformers' own initialiser (std 0.02, zero norm offsets) gives a Gemma3 nearly uniform logits and one
    # greedy token repeated; every matrix is redrawn as the tiny Llama's are (input embedding std 1, the others
    # 0.05), vectors (norms, biases, A_log, dt_bias) keep the architecture's own initial values.
    g = torch.Generator().manual_seed(seed)
    embedding = model.get_input_embeddings().weight
    # A tied embedding is the output head too: the current token's own row (scaled up by Gemma's sqrt(hidden))
    # then dominates the logits and the model repeats its input token; at std 0.01 it no longer does (seen:
    # at 1 and 0.05 one token repeated, at 0.01 the tokens vary).
    embedding_std = 0.01 if model.get_output_embeddings().weight is embedding else 1.0
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                std = embedding_std if param is embedding else 0.05
                param.copy_(torch.randn(param.shape, generator=g) * std)
    model.save_pretrained(str(out))  # config.json, generation_config.json, model.safetensors
    write_tokenizer(out, int(config["vocab_size"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.tiny_llama", description=__doc__.split("\n")[0])
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0, help="weights seed (another seed: other weights)")
    p.add_argument("--layers", type=int, default=2, help="layers of the tiny Llama")
    p.add_argument("--config", default=None,
                   help="a Hugging Face config.json: build that architecture instead of the tiny Llama")
    args = p.parse_args(argv)
    if args.config:
        print(build_from_config(json.loads(Path(args.config).read_text()), args.directory, args.seed))
    else:
        print(build(args.directory, args.seed, args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
