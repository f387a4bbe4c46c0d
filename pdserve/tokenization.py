"""Prompt → token ids the way every pdserve process does it: the instances before generating, the router
before matching a prompt against the instances' cached KV blocks (the same ids, so the same block hashes)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jinja2

from pdserve.protocol import RESERVED_TEMPLATE_KWARGS, ChatCompletionRequest, ProtocolError


def tokenize(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens).input_ids]
    except Exception:   # noqa: BLE001 - e.g. lone surrogates the Rust tokenizer refuses
        raise ProtocolError(400, "cannot tokenize the prompt (invalid characters?)", "prompt") from None


def detokenize(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)


def apply_chat_template(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    # protocol.py refuses reserved keys; dropping them again keeps this safe for any caller.
    kwargs = {k: v for k, v in req.chat_template_kwargs.items() if k not in RESERVED_TEMPLATE_KWARGS}
    try:
        result = tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                               tokenize=True, **kwargs)
    except Exception as e:   # noqa: BLE001 - template errors (role order, missing template) are the request's
        # jinja2's TemplateError text is the template's own message (e.g. "roles must alternate").
        reason = str(e) if isinstance(e, jinja2.TemplateError) else "the messages do not fit it"
        raise ProtocolError(400, f"cannot apply the chat template: {reason}", "messages") from None
    # transformers 5 returns a BatchEncoding (a Mapping), older versions a list of ids.
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if result and isinstance(result[0], list):
        result = result[0]
    return [int(t) for t in result]
