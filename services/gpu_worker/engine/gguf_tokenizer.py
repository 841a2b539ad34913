"""A Hugging Face tokenizer rebuilt from a GGUF file's `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and
special ids as metadata. Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`, what Llama 3,
SmolLM and most recent Llama-architecture checkpoints use) is rebuilt; the pre-tokenizer
follows `tokenizer.ggml.pre`, with the split rules llama.cpp applies for that name. Tokens
llama.cpp marks CONTROL become special added tokens, USER_DEFINED ones plain added tokens
(both are matched whole, as llama.cpp does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tok_models

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# Llama 3's split (llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3), used by every name mapped to it below.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the pre-tokenizer's kind: "gpt2" (GPT-2's regex), "digits" (each digit
# alone, then GPT-2's regex: SmolLM/StarCoder), "llama3"
PRE_TOKENIZERS = {
    "default": "gpt2", "gpt-2": "gpt2", "gpt2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "smaug-bpe": "llama3",
    "falcon3": "llama3", "dbrx": "llama3",
}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata cannot be rebuilt; the message says which key and why."""


@dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer: Tokenizer
    config: dict[str, Any]  # tokenizer_config.json (without the chat template)
    special_ids: dict[str, int]  # bos/eos/pad/unk token ids the file names


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def _pre_tokenizer(pre: str | None, add_prefix_space: bool) -> Any:
    kind = PRE_TOKENIZERS.get(pre or "default")
    if kind is None:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=kind != "llama3")
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind == "llama3":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
    return byte_level


def build_tokenizer(meta: dict[str, Any], context_length: int) -> GGUFTokenizer:
    """The tokenizer `meta` (the file's `tokenizer.*` keys, decoded) describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model {kind!r} is not supported: only 'gpt2' (byte-level BPE) is rebuilt "
            "(SentencePiece 'llama' vocabularies, e.g. Llama 2's, are not)")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise GGUFTokenizerError("the file has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))  # type: ignore[arg-type]
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix"))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    # CONTROL tokens spelled outside the byte alphabet are llama.cpp mislabels: skipped (as transformers does)
    control = [t for t, k in zip(tokens, types) if k == CONTROL and set(t) <= spelled]
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    ids = {name: meta[f"tokenizer.ggml.{key}"] for name, key in (
        ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"), ("unk", "unknown_token_id"))
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= meta[f"tokenizer.ggml.{key}"] < len(tokens)}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and "bos" in ids
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos" in ids
    if add_bos or add_eos:
        bos = [tokens[ids["bos"]]] if add_bos else []
        eos = [tokens[ids["eos"]]] if add_eos else []
        single = " ".join([*bos, "$A", *eos])
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B')}",
            special_tokens=[(tokens[ids[k]], ids[k]) for k, on in (("bos", add_bos), ("eos", add_eos)) if on])
    added = {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": t in control} for t in control + user}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{k}_token": tokens[i] for k, i in ids.items()},
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False, "model_max_length": context_length,
        "added_tokens_decoder": dict(sorted(added.items(), key=lambda kv: int(kv[0]))),
    }
    return GGUFTokenizer(tok, config, ids)
