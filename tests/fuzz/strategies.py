"""Hypothesis strategies for the front door: JSON values, request shapes, raw bodies and headers.

Every strategy mixes plausible values with garbage so that a share of the generated requests is valid
(and reaches the engine) while the rest probes the checks: wrong types everywhere, numbers past every
bound (written into the JSON text, NaN and Infinity included), odd strings (lone surrogates, NUL,
template syntax), deep nesting, bodies that are not JSON or not UTF-8, bodies over the size limit.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

API_KEY = "fuzz-api-key"
ROUTER_KEY = "fuzz-router-key"
ROUTER_KEY_HEADER = "X-PDServe-Router-Key"

# ----------------------------------------------------------------------------- JSON values

EXTREME_INTS = [0, 1, -1, 2, 3, 4, 16, 63, 64, 65, 2**31 - 1, 2**31, -2**31, 2**32, 2**53 + 1, 2**63 - 1,
                2**63, -2**63, -2**63 - 1, 2**64 - 1, 2**64, 10**19, -10**19, 10**100]
EXTREME_FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 4.0, 100.0, 100.00000000001, 1e-300, 5e-324, 1e308, -1e308,
                  1.7976931348623157e308, 1e19, 2.0**63, float("nan"), float("inf"), float("-inf")]
ODD_STRINGS = ["", " ", "\x00", "\ud800", "\udfff", "\ud83d", "é", "🙂🙂", "\u2028", "\ufeff", "null", "NaN",
               "16", "true", "</s>", "<s>", "<unk>", "{{ 7 * 7 }}", "{% for x in range(10**9) %}x{% endfor %}",
               "\\", '"', "\r\n", "a" * 2000, "hello world", "fake-model", "default", "user", "Bearer",
               "http://127.0.0.1:1/", "%s%s%n", "../../etc/passwd"]

ints = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-5, 70), st.integers())
floats = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(-3, 3), st.floats())
texts = st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=20))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(texts, st.sampled_from(["role", "content", "type",
                                                                                 "text", "name"])),
                                               children, max_size=4)),
    max_leaves=6)


def nested(depth: int, leaf: object = 1) -> object:
    """[[[...leaf...]]], depth lists deep (built without recursion)."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def dumps(value: object) -> bytes:
    """JSON text as Python writes it: NaN and Infinity included, lone surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


# ----------------------------------------------------------------------------- request fields

def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """st.one_of with weights (hypothesis picks one_of's branches far from evenly, and the same branch
    given twice counts once): branch i is drawn pairs[i][0] times out of the sum."""
    indices = [i for i, (weight, _) in enumerate(pairs) for _ in range(weight)]
    return st.sampled_from(indices).flatmap(lambda i: pairs[i][1])


def garbage_or(valid: st.SearchStrategy, weight: int = 3) -> st.SearchStrategy:
    """valid values `weight` times out of weight + 1, garbage (any JSON value) otherwise."""
    return weighted((weight, valid), (1, json_values))


small_counts = st.integers(1, 4)
temperatures = st.one_of(st.floats(0, 2), st.sampled_from([0, 0.0, 1, 100, 100.0, 1e-300, 5e-324]), floats, ints)
top_ps = st.one_of(st.floats(0, 1), st.sampled_from([1, 1.0, 5e-324, 1e-300, 0.999999999999]), floats, ints)
top_ks = st.one_of(st.integers(-2, 50), st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 10**19]), ints, floats)
seeds = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from([-2**63, 2**64 - 1, 2**64, -2**63 - 1, 0]),
                  ints, floats)
stops = st.one_of(texts, st.lists(texts, max_size=4), st.just([]), st.just(["x"] * 33), st.just(["y" * 1025]),
                  st.lists(st.sampled_from(["t3", "t5 ", " ", "</s>", "!", "."]), min_size=1, max_size=3))
stop_token_ids = st.one_of(st.lists(st.integers(0, 100), max_size=4), st.lists(ints, max_size=3),
                           st.just(list(range(1025))), st.just([2**31 - 1, 0, 2]))
booleans = garbage_or(st.booleans(), weight=3)
stream_options = st.one_of(st.fixed_dictionaries({}, optional={"include_usage": booleans}), json_values)

KV_FIELDS = {   # vLLM's field names, each with a value of the right type
    "do_remote_decode": st.booleans(), "do_remote_prefill": st.booleans(),
    "remote_engine_id": st.one_of(st.sampled_from(["fuzz-engine", "other-engine"]), texts),
    "remote_request_id": st.one_of(st.sampled_from(["r-1", "cmpl-x"]), texts),
    "remote_block_ids": st.lists(st.one_of(st.integers(0, 10), ints), max_size=4),
    "remote_host": st.one_of(st.sampled_from(["127.0.0.1", "localhost", "::1", "10.0.0.1"]), texts),
    "remote_port": st.one_of(st.integers(0, 70000), ints),
    "tp_size": st.one_of(st.integers(1, 8), ints), "transfer_id": texts,
    "num_remote_tokens": st.one_of(st.integers(0, 100), ints),
    "first_token_ids": st.lists(st.one_of(st.integers(0, 50000), ints), max_size=3),
}
# Each field right-typed or wrong-typed; unknown keys; too many keys; not an object at all.
kv_transfer_params = st.one_of(
    st.fixed_dictionaries({}, optional={name: garbage_or(values, weight=1) for name, values in KV_FIELDS.items()}),
    st.fixed_dictionaries({name: values for name, values in KV_FIELDS.items()}),
    st.dictionaries(texts, json_values, max_size=3),
    st.just({f"k{i}": i for i in range(40)}),
    json_values)

SAMPLING_FIELDS = {
    "temperature": temperatures, "top_p": top_ps, "top_k": top_ks, "seed": seeds, "stop": stops,
    "stop_token_ids": stop_token_ids, "ignore_eos": booleans,
}
COMMON_FIELDS = {
    **SAMPLING_FIELDS,
    "model": st.one_of(st.sampled_from(["fake-model", "default", "gpt-4", "x" * 1025]), st.none(), json_values),
    "stream": booleans, "stream_options": stream_options, "return_token_ids": booleans,
    "n": garbage_or(st.sampled_from([1, 1.0, 2, 0])), "best_of": garbage_or(st.sampled_from([1, 2])),
    "logprobs": garbage_or(st.sampled_from([None, False, 0, True, 5])),
    "top_logprobs": garbage_or(st.sampled_from([None, 0, 3])),
    "presence_penalty": garbage_or(st.floats(-3, 3)), "frequency_penalty": garbage_or(st.floats(-3, 3)),
    "user": json_values, "logit_bias": json_values,
}


def max_tokens_values(valid: st.SearchStrategy = small_counts) -> st.SearchStrategy:
    """Small valid counts mixed with garbage; never null (null means "up to the model's length")."""
    garbage = st.one_of(ints.filter(lambda v: not 1 <= v <= 8), floats.filter(lambda v: v != 4.0),
                        texts, st.booleans(), st.lists(ints, max_size=2), st.just({"n": 4}), st.just("4"))
    return weighted((4, valid), (1, st.sampled_from([1.0, 2.0, 4.0])), (2, garbage))


# ----------------------------------------------------------------------------- prompts and messages

def prompts(words: list[str], vocab_size: int, max_chars: int, max_model_len: int) -> st.SearchStrategy:
    text = st.lists(st.sampled_from(words), min_size=1, max_size=6).map(" ".join)
    token_ids = st.lists(st.integers(0, vocab_size + 2), min_size=1, max_size=8)
    return st.one_of(
        text, text, token_ids, texts, st.text(max_size=40),
        st.lists(text, min_size=1, max_size=2), st.lists(token_ids, min_size=1, max_size=2),   # batches
        st.sampled_from([[], "", [[]], [0], [vocab_size - 1], [vocab_size], [2**31 - 1], [2**31], [-1], [True],
                         [1.0], ["a", 1], " " * 10, words[0] + " " * max_chars,
                         " ".join([words[0]] * (max_model_len + 2)), [1] * (max_model_len + 1)]),
        st.just("x" * (max_chars + 1)), json_values)


def messages(words: list[str]) -> st.SearchStrategy:
    text = st.lists(st.sampled_from(words), min_size=0, max_size=5).map(" ".join)
    part = weighted((3, st.fixed_dictionaries({"type": st.just("text"), "text": garbage_or(text, 4)})),
                    (1, st.fixed_dictionaries({"type": st.sampled_from(["image_url", "text", "TEXT"]),
                                               "image_url": json_values})), (1, json_values))
    content = weighted((6, text), (2, st.lists(part, min_size=1, max_size=3)), (1, st.none()), (1, texts),
                       (1, json_values))
    role = weighted((6, st.sampled_from(["user", "user", "user", "assistant", "system", "tool", "developer"])),
                    (1, st.sampled_from(["User", "function", "", "root"])), (1, json_values))
    message = weighted(
        (8, st.fixed_dictionaries({"role": role, "content": content})),
        (2, st.fixed_dictionaries({"role": role}, optional={"content": content, "name": garbage_or(texts, 2),
                                                            "tool_calls": json_values})),
        (1, json_values))
    return weighted((8, st.lists(message, min_size=1, max_size=3)), (1, st.just([])), (1, json_values),
                    (1, st.just([{"role": "user", "content": "hello"}] * 4097)))


@st.composite
def _requests(draw, required: dict, optional: dict, max_optional: int = 6) -> dict:
    """The required fields, plus up to max_optional of the optional ones (a few at a time: drawing every
    optional field of every request would cost most of the time budget, and rarely adds a finding)."""
    body = draw(st.fixed_dictionaries(required))
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=max_optional, unique=True)):
        body[name] = draw(optional[name])
    return body


def completion_requests(words: list[str], vocab_size: int, max_chars: int, max_model_len: int,
                        max_tokens: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """A /v1/completions body: plausible fields with random (often wrong) values."""
    required = {"prompt": prompts(words, vocab_size, max_chars, max_model_len)}
    optional = {**COMMON_FIELDS, "echo": booleans, "max_completion_tokens": max_tokens_values()}
    if max_tokens is None:
        optional["max_tokens"] = max_tokens_values()
    else:
        required["max_tokens"] = max_tokens
        del optional["max_completion_tokens"]   # it would win over max_tokens
    optional["kv_transfer_params"] = kv_transfer_params
    return _with_extras(_requests(required, optional))


def chat_requests(words: list[str], max_tokens: st.SearchStrategy | None = None) -> st.SearchStrategy:
    required = {"messages": messages(words)}
    optional = {**COMMON_FIELDS, "add_generation_prompt": booleans, "kv_transfer_params": kv_transfer_params,
                "chat_template": st.one_of(st.none(), texts), "max_completion_tokens": max_tokens_values(),
                "chat_template_kwargs": st.one_of(
                    st.dictionaries(st.one_of(st.sampled_from(["enable_thinking", "tokenize", "chat_template",
                                                               "messages", "tools"]), texts),
                                    json_values, max_size=3), json_values)}
    if max_tokens is None:
        optional["max_tokens"] = max_tokens_values()
    else:
        required["max_tokens"] = max_tokens
        del optional["max_completion_tokens"]
    return _with_extras(_requests(required, optional))


def _with_extras(requests: st.SearchStrategy) -> st.SearchStrategy:
    """Sometimes a few unknown keys on top (vendor extras are ignored)."""
    extras = st.dictionaries(st.one_of(texts, st.sampled_from(["foo", "prompt_logprobs", "guided_json"])),
                             json_values, max_size=2)
    return weighted((3, requests), (1, st.builds(lambda r, e: {**e, **r}, requests, extras)))


# ----------------------------------------------------------------------------- raw bodies

def raw_bodies(json_bodies: st.SearchStrategy, over_limit_bytes: int) -> st.SearchStrategy:
    """Bytes on the wire: valid JSON, broken JSON, not JSON, not UTF-8, too deep, too large."""
    encoded = json_bodies.map(dumps)
    truncated = st.builds(lambda data, cut: data[:max(0, len(data) - 1 - cut)], encoded, st.integers(0, 40))
    spliced = st.builds(lambda data, i, junk: data[:i % (len(data) + 1)] + junk + data[i % (len(data) + 1):],
                        encoded, st.integers(0, 200),
                        st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\x80", b"\x00",
                                         b"\xf8\x88\x80\x80\x80", b"NaN", b"Infinity", b",", b"}"]))
    deep = st.sampled_from([900, 950, 980, 990, 1000, 2000, 10_000]).flatmap(lambda n: st.sampled_from([
        b"[" * n + b"]" * n, b"[" * n, b'{"a":' * n + b"1" + b"}" * n,
        b'{"prompt": ' + b"[" * n + b"1" + b"]" * n + b', "max_tokens": 2}',
        b'{"model": ' + b"[" * n + b"]" * n + b', "tokens": [1]}',
        b'{"messages": [{"role": "user", "content": ' + b"[" * n + b"]" * n + b"}]}",
        b'{"kv_transfer_params": {"remote_block_ids": ' + b"[" * n + b"]" * n + b'}, "prompt": "hi"}',
    ]))
    numbers_in_text = st.sampled_from([
        b'{"prompt": "hello", "max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"prompt": "hello", "max_tokens": NaN}', b'{"prompt": "hello", "temperature": NaN}',
        b'{"prompt": "hello", "temperature": Infinity}', b'{"prompt": "hello", "top_p": -Infinity}',
        b'{"prompt": "hello", "seed": 1e400}', b'{"prompt": "hello", "seed": -1e400}',
        b'{"prompt": [1e400]}', b'{"prompt": [NaN]}', b'{"prompt": "hello", "max_tokens": 2.5e0}',
        b'{"prompt": "hello", "top_k": 10000000000000000000}', b'{"prompt": "hello", "seed": 18446744073709551616}',
        b'{"tokens": [NaN]}', b'{"tokens": [1e400, 2]}', b'{"tokens": [' + b"9" * 5000 + b"]}",
        b'{"kv_transfer_params": {"remote_port": NaN, "remote_request_id": "r-1"}}',
        b'{"kv_transfer_params": {"remote_port": 100000000000000000000000, "remote_request_id": "r-1", '
        b'"remote_engine_id": "fuzz-engine"}}',
    ])
    not_objects = st.one_of(json_values.filter(lambda v: not isinstance(v, dict)).map(dumps),
                            st.sampled_from([b"", b" ", b"null", b"[]", b'"prompt"', b"1", b"true", b"\n"]))
    other_encodings = json_bodies.flatmap(lambda body: st.sampled_from([
        json.dumps(body).encode("utf-16"), json.dumps(body).encode("utf-32"),
        b"\xef\xbb\xbf" + json.dumps(body).encode(), json.dumps(body, ensure_ascii=False).encode("utf-8",
                                                                                            "surrogatepass")]))
    duplicate_keys = st.just(b'{"prompt": "hello", "prompt": [1, 2], "max_tokens": 1, "max_tokens": "x"}')
    large = st.sampled_from([
        b'{"prompt": "' + b"hello " * ((100 << 10) // 6) + b'", "max_tokens": 1}',   # parsed off the loop
        b'{"prompt": "' + b"a" * over_limit_bytes + b'"}',                     # over the limit: 413
        b'{"tokens": [' + b"1," * (60 << 10) + b'1]}',
        b'{"messages": [' + b'{"role": "user", "content": "hi"},' * 3000 + b'{"role": "user", "content": "x"}]}',
    ])
    return st.one_of(encoded, encoded, truncated, spliced, deep, numbers_in_text, not_objects,
                     st.binary(max_size=64), other_encodings, duplicate_keys, large)


# ----------------------------------------------------------------------------- headers

header_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=40)
content_types = st.sampled_from(["application/json", "application/json", "application/json; charset=utf-8",
                                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                 "multipart/form-data; boundary=xyz", "application/json; charset=latin-1",
                                 "application/octet-stream", "", "*/*", "application/jsonx"])


def headers(*, router_key_share: int = 1) -> st.SearchStrategy:
    """Headers an aiohttp client can send (str values, no control characters)."""
    wrong_auth = st.sampled_from([f"bearer {API_KEY}", f"Bearer  {API_KEY}", f"Bearer {API_KEY} ", "Bearer",
                                  "Bearer " + "k" * 6000, "Basic Zm9vOmJhcg==", f"Bearer {API_KEY}é", ""])
    auth = weighted((12, st.just(f"Bearer {API_KEY}")), (1, wrong_auth), (1, header_text.map(lambda s: "Bearer " + s)))
    router = weighted((router_key_share, st.just(ROUTER_KEY)),
                      (1, st.sampled_from(["", "wrong", ROUTER_KEY + "x", ROUTER_KEY.upper()])), (1, header_text))
    return st.fixed_dictionaries({"Authorization": auth}, optional={
        "Content-Type": content_types, ROUTER_KEY_HEADER: router,
        "X-Request-Id": st.one_of(header_text, st.sampled_from(["", "a" * 8000, "r-1", "é🙂"])),
        "Accept": st.sampled_from(["text/event-stream", "*/*", "application/json"]),
        "Content-Encoding": st.sampled_from(["identity"] * 16 + ["gzip", "deflate", "br", "x-unknown"]),
    })


# Raw header lines (bytes) for a plain socket: what no well-behaved client would send.
_obs_text = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F))
raw_header_values = st.one_of(
    _obs_text, st.sampled_from([b"Bearer \xff\xfe", b"Bearer " + API_KEY.encode() + b"\xff",
                                b"Bearer " + API_KEY.encode(), ("Bearer " + API_KEY + "é").encode("latin-1"),
                                b"\xc3\x28", b"Bearer \xed\xa0\x80", b"Bearer " + b"k" * 8000,
                                b"Bearer " + b"k" * 20_000, b"Bearer \x01", b"Bearer \x00x", b"\x7f"]))
raw_header_names = st.sampled_from([b"Authorization", b"Authorization", b"Content-Type", b"X-PDServe-Router-Key",
                                    b"X-Request-Id", b"Accept", b"Cookie", b"X-Forwarded-For", b"Transfer-Encoding",
                                    b"Content-Length", b"Expect", b"\xff-Header", b"Bad Name", b""])
raw_headers = st.lists(st.tuples(raw_header_names, raw_header_values), max_size=4)


def is_valid_http_header(name: bytes, value: bytes) -> bool:
    """What an HTTP parser accepts: a token name; a value without control characters (obs-text allowed)."""
    token = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return bool(name) and all(c in token for c in name) and all(c >= 0x20 and c != 0x7F or c == 0x09 for c in value)


# aiohttp refuses a second one of these (400, text/plain): as its parser does, not as pdserve does.
SINGLETON_HEADERS = {b"content-length", b"content-location", b"content-range", b"content-type", b"etag", b"host",
                     b"max-forwards", b"server", b"transfer-encoding", b"user-agent"}


def is_plain_http(lines: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]]) -> bool:
    """Whether these header lines (`extra` being the fuzzer's, on top of a request that has Host and
    Content-Length) are HTTP that aiohttp's parser hands to the application."""
    names = [b"host", b"content-length"] + [n.lower() for n, _ in lines]
    return (all(is_valid_http_header(n, v) and len(v) < 8190 for n, v in lines)
            and not any(n.lower() == b"transfer-encoding" for n, _ in extra)
            and all(names.count(n) == 1 for n in SINGLETON_HEADERS if n in names))
