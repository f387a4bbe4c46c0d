"""Incremental detokenization with stop strings.

Text is decoded in a small window of tokens (a few prompt tokens of context, so a leading space
is kept) and only emitted once it no longer ends in a partial UTF-8 character. Stop strings can
span token boundaries: the last (longest stop string - 1) characters are held back until the
request finishes or the text moves past them; a stop string ends the request and is cut from the
output.
"""
from __future__ import annotations

from pdserve.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5


def fast_decoder(tokenizer):
    """decode(ids) -> text without special tokens. The Rust tokenizer directly when transformers'
    wrapper would add nothing to it (no clean-up of spaces): the wrapper costs several times the
    decode itself, twice per token of every running request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 decode=None) -> None:
        self._decode = decode or (fast_decoder(tokenizer) if tokenizer is not None else None)
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""       # all output text so far
        self.emitted = 0     # characters of self.text already handed out
        self.stopped = False
        self._prefix_text: str | None = None  # decode of tokens[prefix_offset:read_offset]

    def update(self, new_token_ids: list[int]) -> bool:
        """Add tokens; True when a stop string was found (the request must stop)."""
        if self._decode is None or self.stopped:
            return False
        before = len(self.text)
        for token_id in new_token_ids:
            self.tokens.append(token_id)
            if self._prefix_text is None:  # the window moved (or the first token)
                self._prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            prefix = self._prefix_text
            full = self._decode(self.tokens[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
                self._prefix_text = None
        if self.stop and len(self.text) > before:
            search_from = max(0, before - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
            if hits:
                index, s = min(hits)
                self.text = self.text[:index + len(s)] if self.include_stop else self.text[:index]
                self.stopped = True
        return self.stopped

    def resume(self, token_ids: list[int]) -> bool:
        """Take tokens whose text the client already has (a request resumed after the instance that
        generated them died): the state becomes what that instance's was after emitting them, text held
        back for a stop string and a character split across tokens included, so the text goes on
        exactly where the client's stopped. True when they hold a stop string (they should not)."""
        stopped = self.update(token_ids)
        self.take_new_text(finished=False)
        return stopped

    def take_new_text(self, finished: bool) -> str:
        end = len(self.text) if (finished or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        new, self.emitted = self.text[self.emitted:end], end
        return new
