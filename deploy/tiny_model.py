"""Save a tiny random-weight Llama for the cpu profile: python3 tiny_model.py DIR.

No model hub is needed: 2 layers, hidden 128, 4 heads, 2 KV heads, a
1024-token vocabulary, weights drawn with std 0.25 (so greedy decoding does
not collapse into repeats), seeded, so every build makes the same model.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    model.to(torch.bfloat16).save_pretrained(path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py DIR")
    main(Path(sys.argv[1]))
