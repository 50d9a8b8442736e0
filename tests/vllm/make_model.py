"""Makes the tiny model the vLLM suite serves, from a fixed seed.

    python make_model.py DIR [--seed N] [--arch llama|deepseek_v2]

Nothing comes from a model hub: the config is written here, the weights are drawn from a
seeded generator and saved with `save_pretrained`, and the tokenizer is built offline.

- Architecture: `LlamaForCausalLM` (4 layers, hidden 256, 4 heads, 2 KV heads of 64), the
  one the suite serves; or `DeepseekV2ForCausalLM` with MLA attention (kv_lora_rank 512 +
  rope 64: the 576-wide latent the CPU MLA kernel takes) and dense MLPs, 4 layers.
- Tokenizer: one token per character of a fixed alphabet of 400 CJK characters, plus
  role markers and </s>. Text and token ids map one to one, so a test reads token ids
  back from any answer's text (`text_to_ids`), whichever way the text was streamed.
- Weights: drawn at a scale at which each answer depends strongly on the KV it attends
  to (large value and output projections against the residual; changing one early prompt
  token changes 16 of 20 answers) and logits are wide (a large output projection). With
  the Llama model vLLM's CPU prefill and decode paths give identical log-probabilities, so
  a single instance and a PD pair agree token by token unless the KV differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ALPHABET = [chr(0x4E00 + i) for i in range(400)]
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NUM_LAYERS = 4


def vocab() -> dict[str, int]:
    return {t: i for i, t in enumerate(SPECIALS + ALPHABET)}


def text_to_ids(text: str) -> list[int]:
    """The token ids of a text of the alphabet (what the model's tokenizer gives)."""
    v = vocab()
    return [v[c] for c in text]


def ids_to_text(ids: list[int]) -> str:
    inv = {i: t for t, i in vocab().items()}
    return "".join(inv[i] for i in ids)


def make_tokenizer(out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    fast.save_pretrained(out)


def common_config() -> dict:
    """What both architectures share: the vocabulary, the width, the depth, rope."""
    v = vocab()
    return dict(
        vocab_size=len(v),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        max_position_embeddings=4096,
        bos_token_id=v["<s>"],
        eos_token_id=v["</s>"],
        pad_token_id=v["<unk>"],
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(**common_config(), num_key_value_heads=2, head_dim=64)


def deepseek_v2_config():
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **common_config(),
        num_key_value_heads=4,
        kv_lora_rank=512,  # + qk_rope_head_dim: the 576-wide latent of the CPU MLA kernel
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        first_k_dense_replace=NUM_LAYERS,  # every MLP dense: no MoE layer
        n_routed_experts=4,  # declared, never built: first_k_dense_replace covers every layer
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
    )


ARCHITECTURES = {"llama": llama_config, "deepseek_v2": deepseek_v2_config}


def kv_bytes_per_token(arch: str = "llama", dtype_bytes: int = 4) -> int:
    """What the model's layers hold per token of KV cache: K and V per KV head (Llama), or
    MLA's latent plus its rope part (DeepSeek-V2)."""
    c = ARCHITECTURES[arch]()
    if arch == "deepseek_v2":
        per_layer = c.kv_lora_rank + c.qk_rope_head_dim
    else:
        per_layer = 2 * c.num_key_value_heads * c.head_dim
    return c.num_hidden_layers * per_layer * dtype_bytes


def make_model(out: Path, seed: int, arch: str = "llama") -> None:
    import torch
    from transformers import AutoModelForCausalLM

    v = vocab()
    config = ARCHITECTURES[arch]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
                continue
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            scale = 1.0 / fan_in**0.5
            if "embed_tokens" in name:
                scale = 1.0
            elif "lm_head" in name:
                scale = 4.0 / fan_in**0.5  # wide logits: no near-ties at temperature 0
            elif "o_proj" in name or "kv_b_proj" in name or "v_proj" in name:
                scale = 3.0 / fan_in**0.5  # attention outweighs the residual
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        # </s> is never the likeliest token, so every answer runs to max_tokens.
        model.lm_head.weight[v["</s>"]].zero_()
    model.save_pretrained(out, safe_serialization=True)
    # vLLM reads the architecture and dims from config.json; keep it minimal and explicit.
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(args.dir)
    make_model(args.dir, args.seed, args.arch)
    print(args.dir)


if __name__ == "__main__":
    main()
