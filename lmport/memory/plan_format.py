"""`lmport plan`'s report (``lmport.memory.plan.build_plan``) as the text the command prints."""
from __future__ import annotations

from lmport.units import fmt_bytes


def _windows_text(windows: list) -> str:
    """', sliding window W on n of N layers' (or on every layer), empty without one."""
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return ""
    where = "every layer" if len(sliding) == len(windows) else f"{len(sliding)} of {len(windows)} layers"
    return f", sliding window {max(sliding)} on {where}"


def _kinds_text(kinds: list) -> str:
    """'; paged latent (MLA) on 61 layers, 576 values a token a layer', empty where every layer caches K/V
    (the model row says its heads)."""
    if all(k["kind"] == "kv" for k in kinds):
        return ""
    names = {"kv": "paged K/V", "latent": "paged latent (MLA)"}
    return "; " + ", ".join(f"{names[k['kind']]} on {k['layers']} layers, {k['tensors'] * k['heads'] * k['head_dim']} "
                            f"values a token a layer" for k in kinds)


def _draft_text(d: dict) -> str:
    """The speculative draft model's row: its weights and its cache beside the target's."""
    cache = (f"; KV cache {d['num_blocks']:,} blocks (as many as the target's, mirroring them) x "
             f"{d['bytes_per_block']:,} B = {fmt_bytes(d['cache_bytes'])}" if d["cache_bytes"] is not None else "")
    return (f"{d['model']}: {d['model_type']}, {d['layers']} layers, {d['parameters'] / 1e6:.2f}M parameters, "
            f"weights {fmt_bytes(d['weight_bytes'])} ({d['weight_bytes']:,} B) on {d['runs_on']}{cache}")


def _vision_rows(v: dict | None) -> list[tuple[str, str]]:
    """A model with images: the vision tower's weights, the encoder's activation reserve and the encoder cache, each
    a row."""
    if not v:
        return []
    weights = v["weight_bytes"]
    return [("vision", f"tower and projector ({v['source']}): {fmt_bytes(weights)} ({weights:,} B)"),
            ("encoder", f"reserve {fmt_bytes(v['encoder_reserve_bytes'])} ({v['encoder_reserve_bytes']:,} B) for "
                        f"{v['patches_per_call']:,} patches in one call (the largest image "
                        f"{v['largest_image_patches']:,} patches; estimate)"),
            ("encoder cache", f"{fmt_bytes(v['encoder_cache_bytes'])} ({v['encoder_cache_bytes']:,} B) for "
                              f"{v['encoder_cache_rows']:,} image-token rows at most")]


def format_plan(r: dict) -> str:
    m, d, w, a, kv, cache = r["model"], r["device"], r["weights"], r["activation_reserve"], r["kv"], r["cache"]
    cfg = r["config"]
    rows = [
        ("model", f"{m['name']}: {m['model_type']}, {m['layers']} layers, hidden {m['hidden_size']}, "
                  f"{m['attention_heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}, "
                  f"vocab {m['vocab_size']}, "
                  f"context {m['max_position_embeddings']}" + _windows_text(m["layer_windows"])),
        ("device", f"{d['type']}: {fmt_bytes(d['memory_bytes'])} ({d['memory_source']})"),
        ("weights", f"{w['parameters'] / 1e6:.2f}M parameters: "
                    + ", ".join(f"{dt} {fmt_bytes(n)} ({n:,} B)" for dt, n in w["bytes_by_dtype"].items())
                    + (f" on each of {cfg['tp']} devices" if cfg["tp"] > 1 else "")),
        *([("LoRA", f"{r['lora']['max_loras']} adapter slots of rank <= {r['lora']['max_lora_rank']}: "
                    f"{fmt_bytes(r['lora']['bytes'])} ({r['lora']['bytes']:,} B)")] if r["lora"]["bytes"] else []),
        *([("draft", _draft_text(r["draft"]))] if r.get("draft") else []),
        *_vision_rows(r.get("vision")),
        ("activation", f"reserve {fmt_bytes(a['bytes'])} for max_prefill_token_num={a['max_prefill_token_num']} "
                       f"({a['source']}; {a['note']})"),
        ("free", f"{fmt_bytes(r['free_after_weights_bytes'])} after weights"
                 f"{' and the vision tower' if r.get('vision') else ''}"
                 f"{' and LoRA slots' if r['lora']['bytes'] else ''}{' and the draft' if r.get('draft') else ''}, "
                 f"{fmt_bytes(r['usable_for_cache_bytes'])} after the activation reserve"
                 f"{'s (text and encoder)' if r.get('vision') else ''}"
                 f"{' and the recurrent-state slots' if r.get('state') else ''}"),
        ("KV cache", f"quant_policy {kv['quant_policy']}: {kv['bytes_per_block']:,} B a block of {kv['block_size']} "
                     f"tokens = {kv['bytes_per_token']:,.6g} B a token" + _kinds_text(kv.get("kinds") or [])),
    ]
    if r.get("state"):
        s = r["state"]
        rows.append(("state", f"recurrent state on {s['layers']} linear-attention layers (conv window "
                              f"{s['conv_bytes_per_layer']:,} B + state {s['state_bytes_per_layer']:,} B a layer) = "
                              f"{s['bytes_per_sequence']:,} B a sequence x {s['slots']} slots (max_batch_size) = "
                              f"{fmt_bytes(s['bytes'])}, beside the KV cache"))
    if cache:
        rows += [
            ("", f"cache_max_entry_count {cache['cache_max_entry_count']} ({cache['meaning']}): "
                 f"{fmt_bytes(cache['bytes'])} = {cache['num_blocks']:,} blocks = {cache['num_tokens']:,} tokens"),
            ("session_len", f"{cache['session_len']} " + (
                "(asked)" if cfg["session_len"] else
                f"= min(model limit {m['max_position_embeddings']}, cache {cache['num_tokens']:,} tokens)"
                if cache["window_blocks"] is None else
                f"= model limit (a sequence holds at most {cache['blocks_per_sequence']} blocks: those "
                f"behind the sliding window are freed)")),
            ("sequences", f"{cache['max_concurrent_sequences']} at once at session_len {cache['session_len']}: "
                          f"the cache holds {cache['sequences_that_fit']:,} sequences of "
                          f"{cache['blocks_per_sequence']} blocks, max_batch_size is {cfg['max_batch_size']}"),
        ]
    if r["ranks"] and len(r["ranks"]) > 1:
        rows += [(f"rank {x['rank']}", f"weights {fmt_bytes(x['weight_bytes'])} ({x['weight_bytes']:,} B), reserve "
                                       f"{fmt_bytes(x['reserve_bytes'])}, cache {x['num_blocks']:,} blocks = "
                                       f"{fmt_bytes(x['cache_bytes'])} ({x['cache_bytes']:,} B)") for x in r["ranks"]]
    place = r.get("placement")
    if place and (place["dp"] > 1 or place["executor"] == "ray"):
        rows.append(("placement", f"{place['dp']} replica(s) x tp={place['tp']} = {place['devices']} devices, "
                                  f"executor {place['executor']}, one placement-group bundle a rank "
                                  f"{place['bundles'][0]}" + (f"; router: {place['router']}" if place["router"]
                                                              else "")))
        for rep in place["replicas"]:
            ranks = ", ".join(f"rank {x['rank']} in {x['runs_in']}" for x in rep["ranks"])
            rows.append((f"replica {rep['replica']}", f"{ranks}; cache {rep['num_blocks']:,} blocks = "
                                                       f"{fmt_bytes(rep['cache_bytes'])} = {rep['num_tokens']:,} "
                                                       f"tokens of its own"))
    rows += [("config", " ".join(f"{k}={v}" for k, v in cfg.items())),
             ("adjustments", "; ".join(f"{a['field']}: {a['asked']!r} -> {a['used']!r} ({a['reason']})"
                                       for a in r["adjustments"]) or "none")]
    text = "\n".join(f"{name:<12} {value}".rstrip() for name, value in rows)
    if r["error"]:
        text += "\n\nerror: the KV cache does not fit: " + r["error"]
    return text
