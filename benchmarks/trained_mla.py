"""A small DeepSeek-V3-shaped model (multi-head latent attention) trained here from scratch, so that quantizing the
latent cache can be measured on trained weights where no trained MLA model can be downloaded.

transformers' DeepseekV3ForCausalLM at a small size, its latent path as DeepSeek-V3's scaled down (a compressed
latent of ``--kv-lora-rank`` values and a rotary part of ``--rope-dim`` a token, cached as one), its MLPs dense,
SmolLM2's tokenizer; trained on three texts of the Canterbury corpus (lcet10.txt, plrabn12.txt, asyoulik.txt) and
alice29.txt after its first ``--held-out`` tokens, so that benchmarks/kv_first_token.py's perplexity on the first
4 x 1,024 tokens of alice29.txt is on text the model has not seen. Saved as a transformers directory (float32) with
the tokenizer beside it.

The texts come in the same PyPI sdist as alice29.txt (benchmarks/data/README.md):

    mkdir -p $HOME/.cache/lmport-files/canterbury && cd $HOME/.cache/lmport-files/canterbury
    pip download --no-deps --no-binary :all: brotli==1.2.1 && tar xzf brotli-1.2.1.tar.gz && cd -
    .venv/bin/python benchmarks/trained_mla.py --out $HOME/.cache/lmport-files/mla-trained \
        --corpus $HOME/.cache/lmport-files/canterbury/brotli-1.2.1/tests/testdata
    .venv/bin/python benchmarks/kv_first_token.py --model $HOME/.cache/lmport-files/mla-trained \
        --device-type cpu --max-prefill-tokens 64
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from kv_quant_eval import load_text

TEXTS = ("lcet10.txt", "plrabn12.txt", "asyoulik.txt")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="directory holding the Canterbury texts")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--held-out", type=int, default=8192, help="alice29.txt's first tokens, not trained on")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-lora-rank", type=int, default=128)
    ap.add_argument("--rope-dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from lmport.models.loader import load_tokenizer
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer("smollm2")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for name in TEXTS:
        ids += tokenizer.encode(load_text(args.corpus / name), add_special_tokens=False) + [eos]
    ids += tokenizer.encode(load_text(), add_special_tokens=False)[args.held_out:]   # alice29.txt
    data = torch.tensor(ids)
    print(f"{len(ids)} training tokens from {', '.join(TEXTS)} and alice29.txt after its first {args.held_out}",
          flush=True)

    head_dim = args.hidden // args.heads
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        q_lora_rank=None, kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim,
        qk_nope_head_dim=head_dim - args.rope_dim, v_head_dim=head_dim,
        first_k_dense_replace=args.layers,   # every MLP dense: the latent attention is what is measured
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=args.hidden,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos, pad_token_id=eos)
    model = DeepseekV3ForCausalLM(config).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:   # linear warm-up, then cosine to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        done = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))

    started = time.perf_counter()
    for step in range(args.steps):
        starts = [rng.randrange(len(ids) - args.seq) for _ in range(args.batch)]
        batch = torch.stack([data[s:s + args.seq] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss   # the model shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "training.json").write_text(json.dumps(
        {k: str(v) for k, v in vars(args).items()} | {"tokens": len(ids), "final_loss": loss.item()}, indent=1))
    print(f"saved to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
