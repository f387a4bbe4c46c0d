"""Workloads: which prompts to send, how long the answers should be, and when each request arrives.

The client has no tokenizer, so lengths are in tokens only approximately for text:
- /v1/completions with a random, prefix-shared or mixed dataset sends the prompt as a list of token ids
  (OpenAI allows `prompt: [ids]`), so the server sees exactly `input_len` prompt tokens;
- /v1/chat/completions needs text, so prompts are built from common English words (about one token
  each, plus the chat template's own tokens). The server's `usage` gives the true count either way.
- multi-turn is text on both endpoints: each turn resends the previous answers, which are text.

Datasets: independent requests (random, prefix-shared, mixed, a .jsonl file), or conversations
(multi-turn): chains of requests where turn k + 1 is built from turn k's answer and sent after it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DATASETS = ("random", "prefix-shared", "multi-turn", "mixed")   # or a path to a .jsonl file
ENDPOINTS = ("completions", "chat")

# Common short words, each a single token in the usual BPE vocabularies.
COMMON_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part over new sound take only little work know place year live "
    "me back give most very after thing our just name good sentence man think say great where help through "
    "much before line right too mean old any same tell boy follow came want show also around form three "
    "small set put end does another well large must big even such because turn here why ask went men read "
    "need land different home us move try kind hand picture again change off play spell air away animal "
    "house point page letter mother answer found study still learn should world high every near add food "
    "between own below country plant last school father keep tree never start city earth eye light thought "
    "head under story saw left few while along might close something seem next hard open example begin life "
    "always those both paper together got group often run important until children side feet car mile night"
).split()


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload; exactly one of `prompt` and `messages` is set."""
    prompt: str | list[int] | None      # completions: text or token ids
    messages: list[dict[str, Any]] | None  # chat
    prompt_len: int | None               # tokens (ids) or words (text) we asked for; None: unknown (jsonl)
    output_len: int                      # max_tokens


def sample_lengths(rng: np.random.Generator, num: int, length: int, range_ratio: float) -> list[int]:
    """`num` integers uniform in [length*(1-r), length*(1+r)], never below 1."""
    eps = 1e-9  # 100 * 1.1 is 110.00000000000001: keep the integers inside the interval
    low = max(1, math.ceil(length * (1.0 - range_ratio) - eps))
    high = max(low, math.floor(length * (1.0 + range_ratio) + eps))
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def _random_ids(rng: np.random.Generator, n: int, vocab_range: tuple[int, int]) -> list[int]:
    return [int(x) for x in rng.integers(vocab_range[0], vocab_range[1], size=n)]


def _random_words(rng: np.random.Generator, n: int) -> str:
    return " ".join(COMMON_WORDS[i] for i in rng.integers(0, len(COMMON_WORDS), size=n))


def synthetic_requests(*, endpoint: str, num_prompts: int, input_len: int, output_len: int,
                       range_ratio: float = 0.0, prefix_len: int = 0,
                       vocab_range: tuple[int, int] = (1000, 20000), seed: int = 0,
                       output_range_ratio: float | None = None) -> list[RequestSpec]:
    """Random prompts, each `prefix_len` shared tokens followed by a unique random suffix of about
    `input_len` tokens (dataset `random` is `prefix_len=0`, `prefix-shared` is `prefix_len>0`).
    Output lengths vary by `output_range_ratio` (None: by `range_ratio` too)."""
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = sample_lengths(rng, num_prompts, output_len,
                                 range_ratio if output_range_ratio is None else output_range_ratio)
    if endpoint == "completions":
        prefix: list[int] = _random_ids(rng, prefix_len, vocab_range)
        return [RequestSpec(prompt=prefix + _random_ids(rng, n, vocab_range), messages=None,
                            prompt_len=prefix_len + n, output_len=m)
                for n, m in zip(input_lens, output_lens)]
    prefix_text = _random_words(rng, prefix_len)
    specs = []
    for n, m in zip(input_lens, output_lens):
        text = (prefix_text + " " + _random_words(rng, n)) if prefix_len else _random_words(rng, n)
        specs.append(RequestSpec(prompt=None, messages=[{"role": "user", "content": text}],
                                 prompt_len=prefix_len + n, output_len=m))
    return specs


def mixed_requests(*, endpoint: str, num_prompts: int, output_len: int, short_fraction: float = 0.8,
                   short_len: tuple[int, int] = (32, 128), long_len: tuple[int, int] = (1024, 2048),
                   output_range_ratio: float = 0.0, vocab_range: tuple[int, int] = (1000, 20000),
                   seed: int = 0) -> list[RequestSpec]:
    """Independent requests, round(short_fraction * num_prompts) of them short (length uniform in
    short_len, both ends included) and the rest long (uniform in long_len), short and long in a seeded
    random order; prompts built as `random`'s are (token ids for completions, common words for chat).
    The count is exact rather than drawn per request so that a small run has the fraction asked for."""
    rng = np.random.default_rng(seed)
    num_short = round(short_fraction * num_prompts)
    is_short = rng.permutation(np.arange(num_prompts) < num_short)
    input_lens = [int(rng.integers(low, high + 1)) for low, high in
                  (short_len if short else long_len for short in is_short)]
    output_lens = sample_lengths(rng, num_prompts, output_len, output_range_ratio)
    if endpoint == "completions":
        return [RequestSpec(prompt=_random_ids(rng, n, vocab_range), messages=None, prompt_len=n, output_len=m)
                for n, m in zip(input_lens, output_lens)]
    return [RequestSpec(prompt=None, messages=[{"role": "user", "content": _random_words(rng, n)}],
                        prompt_len=n, output_len=m) for n, m in zip(input_lens, output_lens)]


# The completions endpoint has no roles: a conversation is a plain transcript. "Assistant:" ends each
# prompt without a trailing space, so the answer (which a model starts with a space) follows as is.
USER_TURN = "\n\nUser: "
ASSISTANT_TURN = "\n\nAssistant:"


@dataclass(frozen=True)
class Conversation:
    """One user's chat of `num_turns` turns under its group's system prompt. Turn k's prompt is the whole
    history: the system prompt, user messages 0..k-1 each followed by its answer, then user message k.
    So each turn's prompt starts with the previous turn's prompt, character for character (chat: its
    message list starts with the previous one's), as a chat client resending its history does. The
    answers are the text the server actually streamed back for each turn (the runner collects it); only
    a turn that failed is followed by its placeholder answer, deterministic words of its output length."""
    user: int
    group: int
    system: str
    user_messages: tuple[str, ...]
    output_lens: tuple[int, ...]          # max_tokens of each turn
    placeholder_answers: tuple[str, ...]  # each turn's stand-in answer, output_lens[k] words after a space

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)

    def request(self, turn: int, answers: Sequence[str], *, endpoint: str) -> RequestSpec:
        """Turn `turn`'s request, given the answers of the turns before it (answers[k] for k < turn)."""
        if not 0 <= turn < self.num_turns or len(answers) < turn:
            raise ValueError(f"turn {turn}: needs 0 <= turn < {self.num_turns} and the {turn} answers before it")
        history = list(zip(self.user_messages[:turn], answers[:turn]))
        num_words = (len(self.system.split()) + sum(len(m.split()) + len(a.split()) for m, a in history)
                     + len(self.user_messages[turn].split()))
        if endpoint == "chat":
            messages = [{"role": "system", "content": self.system}]
            for message, answer in history:
                messages += [{"role": "user", "content": message}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": self.user_messages[turn]})
            return RequestSpec(prompt=None, messages=messages, prompt_len=num_words,
                               output_len=self.output_lens[turn])
        text = self.system + "".join(f"{USER_TURN}{message}{ASSISTANT_TURN}{answer}" for message, answer in history)
        return RequestSpec(prompt=f"{text}{USER_TURN}{self.user_messages[turn]}{ASSISTANT_TURN}", messages=None,
                           prompt_len=num_words, output_len=self.output_lens[turn])

    def requests(self, *, endpoint: str) -> list[RequestSpec]:
        """Every turn's request with the placeholder answers: the conversation as far as it is known
        before anything is sent."""
        return [self.request(k, self.placeholder_answers, endpoint=endpoint) for k in range(self.num_turns)]


def multi_turn_conversations(*, num_users: int, num_turns: int, num_groups: int, system_len: int, turn_len: int,
                             output_len: int, range_ratio: float = 0.0, output_range_ratio: float | None = None,
                             seed: int = 0) -> list[Conversation]:
    """`num_users` conversations of `num_turns` turns. User u belongs to group u % num_groups, and every
    user of a group has the group's system prompt of `system_len` words: a router with prefix affinity
    can win twice, on the group's system prompt and on each user's own history from its previous turn.
    User messages are about `turn_len` words, answers at most `output_len` tokens (both varied by their
    range ratio, as `random`'s lengths are); everything is common words, seeded."""
    rng = np.random.default_rng(seed)
    systems = [_random_words(rng, system_len) for _ in range(num_groups)]
    answer_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    conversations = []
    for user in range(num_users):
        message_lens = sample_lengths(rng, num_turns, turn_len, range_ratio)
        output_lens = sample_lengths(rng, num_turns, output_len, answer_ratio)
        conversations.append(Conversation(
            user=user, group=user % num_groups, system=systems[user % num_groups],
            user_messages=tuple(_random_words(rng, n) for n in message_lens), output_lens=tuple(output_lens),
            placeholder_answers=tuple(" " + _random_words(rng, m) for m in output_lens)))
    return conversations


def jsonl_requests(path: str | Path, *, endpoint: str, num_prompts: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[RequestSpec]:
    """Requests from a .jsonl file of objects with "prompt" (string) or "messages", and optionally
    "output_len". Lines are taken in order and repeated when the file has fewer than `num_prompts`."""
    rows: list[dict[str, Any]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 is valid in JSON
    except OSError as e:
        raise ValueError(f"dataset: cannot read {path} ({e.strerror or e})") from None
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset: {path}:{line_no}: not valid JSON ({e})") from None
        if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str)
                                             or isinstance(row.get("messages"), list)):
            raise ValueError(f'dataset: {path}:{line_no}: needs "prompt" (string) or "messages" (list)')
        if endpoint == "completions" and not isinstance(row.get("prompt"), str):
            raise ValueError(f'dataset: {path}:{line_no}: endpoint completions needs "prompt"')
        rows.append(row)
    if not rows:
        raise ValueError(f"dataset: {path} has no requests")
    rng = np.random.default_rng(seed)
    default_output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    specs = []
    for i in range(num_prompts):
        row = rows[i % len(rows)]
        m = int(row.get("output_len") or default_output_lens[i])
        if endpoint == "chat":
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            specs.append(RequestSpec(prompt=None, messages=messages, prompt_len=None, output_len=m))
        else:
            specs.append(RequestSpec(prompt=row["prompt"], messages=None, prompt_len=None, output_len=m))
    return specs


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start, the first at 0.

    Gaps are gamma distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a Poisson
    process, below 1 burstier, above 1 more regular. An infinite rate sends everything at once.
    """
    if num <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed + 1)  # +1: independent of the prompt stream of the same seed
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num - 1)
    return [0.0] + [float(t) for t in np.cumsum(gaps)]
