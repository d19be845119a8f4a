"""Prompt tokens of a chat or completion request, as the routing request's ``input_tokens``.

With a tokenizer for the request's model (``gateway.tokenizers``: model -> a local
``tokenizer.json`` in the Hugging Face ``tokenizers`` format, loaded once at start; the optional
dependency ``xroute[tokenizers]``) each text is counted by it. Nothing is downloaded: a tokenizer
named by a hub id rather than a file is refused at start, and a model without one is estimated.

The estimate (no tokenizer for the model), the rule documented in ``docs/gateway.md``:

* a text: ``ceil(characters / 4)`` -- OpenAI's rule of thumb for English (about 4 characters a
  token); it undercounts code and most other languages, which tokenize denser;
* a chat: the sum over the messages of their texts' tokens plus 4 per message (its role and
  delimiters), plus 3 that prime the reply -- the accounting of OpenAI's cookbook for its chat
  formats; ``tools`` definitions are counted as the text of their JSON;
* a prompt given as token ids (``/v1/completions``): their number, exactly.

A message's text is its ``content`` (a string, or the ``text`` of its parts: images and audio are
not counted, their cost depends on the model), its ``name``, and its tool calls' names and
arguments. The chat template a server applies is not (it differs per model): with a tokenizer the
count is the texts' tokens plus the same per-message allowance.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from xroute.errors import ConfigError

#: per chat message: its role and delimiters; per chat: the reply's priming (module docstring)
PER_MESSAGE = 4
PER_CHAT = 3
#: characters per token of the estimate
CHARS_PER_TOKEN = 4
#: prompts longer than this (characters) are tokenized off the event loop
LONG_PROMPT_CHARS = 32_768


def estimate(text: str) -> int:
    """``ceil(len(text) / 4)``: the estimate's tokens of one text."""
    return -(-len(text) // CHARS_PER_TOKEN)


def message_texts(message: Mapping[str, Any]) -> list[str]:
    """The texts of one chat message that count as prompt (module docstring)."""
    out: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"])
    name = message.get("name")
    if isinstance(name, str):
        out.append(name)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping):
                out.extend(v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))
    return out


def chat_texts(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """Every text of a chat request and its fixed allowance (per message and per chat)."""
    messages = body.get("messages") or []
    texts = [t for m in messages if isinstance(m, Mapping) for t in message_texts(m)]
    tools = body.get("tools")
    if tools:
        texts.append(json.dumps(tools, separators=(",", ":")))
    return texts, PER_MESSAGE * len(messages) + PER_CHAT


def prompt_parts(prompt: Any) -> tuple[list[str], int]:
    """A completion request's ``prompt``: its texts, and the tokens it gives as ids."""
    if isinstance(prompt, str):
        return [prompt], 0
    if isinstance(prompt, list):
        texts: list[str] = []
        ids = 0
        for x in prompt:
            if isinstance(x, str):
                texts.append(x)
            elif isinstance(x, list):
                ids += len(x)
            elif isinstance(x, int | float):  # a token id (JSON Schema's integer: 12 or 12.0)
                ids += 1
        return texts, ids
    return [], 0


def prompt_chars(texts: Iterable[str]) -> int:
    return sum(len(t) for t in texts)


class PromptCounter:
    """Counts prompt tokens per model: its tokenizer when configured, else the estimate."""

    def __init__(self, tokenizers: Mapping[str, Path], models: Iterable[str]):
        known = set(models)
        self.tokenizers: dict[str, Any] = {}
        for model, path in tokenizers.items():
            where = f"router settings: field 'gateway.tokenizers.{model}'"
            if model not in known:
                raise ConfigError(f"{where}: unknown model '{model}' (known: {', '.join(sorted(known))})")
            if not Path(path).is_file():
                raise ConfigError(f"{where}: '{path}' is not a file (a local tokenizer.json; nothing is downloaded)")
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ConfigError(f"{where}: counting with a tokenizer needs the 'tokenizers' package "
                                  "(pip install 'xroute[tokenizers]')") from None
            try:
                self.tokenizers[model] = Tokenizer.from_file(str(path))
            except Exception as e:
                raise ConfigError(f"{where}: '{path}' is not a tokenizers file ({type(e).__name__}: {e})") from None

    def method(self, model: str) -> str:
        """``"tokenizer"`` or ``"estimate"``: how ``model``'s prompts are counted."""
        return "tokenizer" if model in self.tokenizers else "estimate"

    def count(self, model: str, texts: list[str], fixed: int) -> int:
        """The tokens of ``texts`` under ``model``'s tokenizer (else the estimate), plus ``fixed``."""
        tok = self.tokenizers.get(model)
        if tok is None:
            return fixed + sum(estimate(t) for t in texts)
        if not texts:
            return fixed
        return fixed + sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
