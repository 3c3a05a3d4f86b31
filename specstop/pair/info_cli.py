"""``specstop info``: what a pair is made of (models, tokenizer, vocabulary handling, cache)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from specstop.pair.registry import KNOWN_PAIRS, converted_pair_dir, is_converted, resolve_pair
from specstop.pair.settings import PairSettings
from specstop.paths import cache_dir


@dataclass
class InfoSettings(PairSettings):
    """Which pair `specstop info` loads and describes."""

    device: str | None = "cpu"
    """Where to load the models."""


def command():
    """The parser: the pair settings and ``--json``."""
    from specstop.config_cli import TypedCommand

    cmd = TypedCommand(InfoSettings, prog="specstop info",
                       description="print a pair's models, tokenizer, parameter counts and cache location "
                                   f"(known pairs: {', '.join(KNOWN_PAIRS)})")
    cmd.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return cmd


def main(argv: list[str]) -> int:
    args, flags = command().parse(argv)
    info = pair_info(args.pair, draft=args.draft, target=args.target, dtype=args.dtype, device=args.device)
    print(json.dumps(info, indent=2) if flags.json else format_info(info))
    return 0


def tokenizer_summary(tok) -> dict:
    """Length, fingerprint, EOS/PAD and chat-template presence of a tokenizer."""
    from specstop.pair.loader import tokenizer_fingerprint

    return {
        "len": len(tok),
        "hash": tokenizer_fingerprint(tok),
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token": tok.pad_token,
        "pad_token_id": tok.pad_token_id,
        "chat_template": bool(getattr(tok, "chat_template", None)),
    }


def pair_info(pair=None, *, draft=None, target=None, dtype="auto", device="cpu") -> dict:
    """Load a pair and describe it as a JSON-serialisable dict."""
    from specstop.pair.loader import load_pair

    resolved = resolve_pair(pair, draft=draft, target=target)
    t0 = time.perf_counter()
    loaded = load_pair(resolved.draft, resolved.target, dtype=dtype, device=device, name=resolved.name)
    load_s = time.perf_counter() - t0
    info = loaded.to_dict()
    info["tokenizer"] = tokenizer_summary(loaded.tokenizer)
    info["load_seconds"] = round(load_s, 2)
    info["cache"] = {
        "root": str(cache_dir()),
        "draft": resolved.draft,
        "target": resolved.target,
        "local": resolved.local,
    }
    if resolved.name in KNOWN_PAIRS:
        info["cache"]["converted"] = is_converted(resolved.name)
        info["cache"]["pair_dir"] = str(converted_pair_dir(resolved.name))
    return info


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def format_info(info: dict) -> str:
    lines = [f"pair: {info['name']}"]
    for role in ("draft", "target"):
        m = info[role]
        lines.append(
            f"  {role:6s} {m['name_or_path']}\n"
            f"         {m['architecture']}, {_params(m['num_parameters'])} parameters ({m['num_parameters']:,}), "
            f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['logits_size']:,} logits, {m['dtype']}\n"
            f"         source sha256: {m['source_sha256'] or '-'}"
        )
    t = info["tokenizer"]
    lines.append(
        f"tokenizer: {t['len']:,} tokens, hash {t['hash']}, eos {t['eos_token']!r} ({t['eos_token_id']}), "
        f"pad {t['pad_token']!r} ({t['pad_token_id']}), chat template: {'yes' if t['chat_template'] else 'no'}"
    )
    v = info["vocab"]
    lines.append(
        f"vocab: shared {v['shared_vocab_size']:,}; logits draft {v['draft_logits_size']:,} / target "
        f"{v['target_logits_size']:,}; {v['rule']}"
    )
    c = info["cache"]
    lines.append(f"cache: {c['root']}" + (f" (pair folder {c['pair_dir']})" if "pair_dir" in c else ""))
    lines.append(f"loaded in {info['load_seconds']:.1f}s")
    return "\n".join(lines)
