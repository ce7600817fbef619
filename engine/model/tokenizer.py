"""Tokenizer from a GGUF file (converted once by transformers, then cached) or a Hugging Face directory."""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

from kvledger.engine.model.default_model import default_model_path
from kvledger.engine.model.weights import cache_dir_for

_CACHE_SUBDIR = "tokenizer"


def _convert_gguf_tokenizer(path: str):
    """The slow path (~3 s): build a fast tokenizer from the GGUF metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _load_gguf_tokenizer(path: str, use_cache: bool):
    from transformers import AutoTokenizer

    cache = cache_dir_for(path) / _CACHE_SUBDIR
    if use_cache and cache.is_dir():
        return AutoTokenizer.from_pretrained(cache)
    tok = _convert_gguf_tokenizer(path)
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache.parent, prefix=f".{_CACHE_SUBDIR}.")
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)  # atomic; loses harmlessly to a concurrent writer
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _generation_eos(model_dir: Path) -> list[int]:
    gen = model_dir / "generation_config.json"
    if not gen.is_file():
        return []
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return eos if isinstance(eos, list) else ([] if eos is None else [eos])


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_eos: list[int] | tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        eos = [hf_tokenizer.eos_token_id, *extra_eos]
        self.eos_token_ids: frozenset[int] = frozenset(e for e in eos if e is not None)

    @classmethod
    def load(cls, source: str | os.PathLike | None = None, use_cache: bool = True) -> Tokenizer:
        """source: a .gguf file, a Hugging Face directory, or None for the embedded default model."""
        if source is None:
            source = default_model_path()
        p = Path(source)
        if p.suffix == ".gguf":
            return cls(_load_gguf_tokenizer(str(p), use_cache))
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(p), extra_eos=_generation_eos(p))

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        return tuple(t.content for t in self.hf.added_tokens_decoder.values() if t.special and t.content)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text any one token stands for (special tokens included), so
        that a text of n bytes has at least ceil(n / max_token_bytes) tokens."""
        ids = [[i] for i in range(len(self.hf))]
        texts = self.hf.batch_decode(ids, skip_special_tokens=False)
        return max(len(t.encode("utf-8", "surrogatepass")) for t in texts)

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without tokenizing it."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Chat messages -> prompt token ids. Message content is text: special-token text inside it
        (a user writing "<|im_end|><|im_start|>system") stays text and never becomes a role marker."""
        specials = self.special_token_texts
        if not any(s in m["content"] for m in messages for s in specials):
            return self.encode(self.chat_prompt(messages, add_generation_prompt), add_special_tokens=False)
        # render with a marker in place of each content, then tokenize the template's own text
        # with special tokens and each content with special tokens split into ordinary text
        marks = [f"\x00{secrets.token_hex(8)}-{i}\x00" for i in range(len(messages))]
        rendered = self.chat_prompt([{**m, "content": mark} for m, mark in zip(messages, marks)], add_generation_prompt)
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
        if sorted(p for p in pieces if p in marks) != sorted(marks):
            raise ValueError(
                "messages: a message contains special-token text and this model's chat template "
                "does not keep message content verbatim, so it cannot be kept as text"
            )
        content = {mark: m["content"] for m, mark in zip(messages, marks)}
        ids: list[int] = []
        for piece in pieces:
            if piece in content:
                ids += self.hf.encode(content[piece], add_special_tokens=False, split_special_tokens=True)
            elif piece:
                ids += self.encode(piece, add_special_tokens=False)
        return ids

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
