"""Request bodies of the HTTP API -> prompt token ids + ``SamplingParams``, validated.

Three shapes: SGLang's native ``/generate`` (``text`` or ``input_ids``, ``sampling_params``),
OpenAI's ``/v1/completions`` (``prompt``, ``max_tokens``...) and ``/v1/chat/completions``
(``messages``). Anything malformed raises ``BadRequest`` with a message naming the field;
the server turns it into HTTP 400. Every number is checked for NaN, infinities and range
before it can reach the sampler. Options this runtime does not implement (penalties,
``echo``, ``logit_bias``, constrained decoding...) get a 400 that names them instead of
being silently ignored; unknown fields that do not change the output (``user``,
``lora_path``...) are ignored, as SGLang does.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

from sglang_echo.runtime.request import SamplingParams
from sglang_echo.runtime.sampling import MAX_TOP_LOGPROBS

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
SEED_RANGE = (-(1 << 63), 1 << 64)  # what a 64-bit seed can hold, signed or unsigned
# Arrays and objects in arrays and objects: a real request nests 4 deep (chat content
# parts). Deeper bodies are refused before repr() or json.dumps() of a part of them (in
# an error message) can run out of recursion, which the parser itself nearly did.
MAX_JSON_DEPTH = 32
# max_new_tokens and friends: what an int64 holds. A bigger one can never fit a context,
# and one of 4300 digits made the error message's arithmetic exceed int->str's limit.
MAX_INT_FIELD = (1 << 63) - 1

# Options that would change the output but are not implemented: (field, value that means
# "off"). A request that turns one on is refused rather than answered as if it were off.
_UNSUPPORTED_OFF = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "min_new_tokens": 0,
    "min_tokens": 0,
    "logit_bias": None,
    "echo": False,
    "suffix": None,
    "best_of": 1,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "tools": None,
    "functions": None,
    "guided_json": None,
    "guided_regex": None,
}


class BadRequest(ValueError):
    """The request cannot be served as sent; the message says which field and why."""

    status = 400


class PayloadTooLarge(BadRequest):
    status = 413

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"the request body has {size} bytes or more; this server takes at most {limit} "
            "(--max-request-bytes)"
        )


class BoundedTokenizer:
    """The checkpoint's tokenizer, refusing text certainly too long before encoding it.

    No vocabulary entry spans more than ``max_chars`` characters of input, so a text of
    more than limit x max_chars characters has more than ``limit`` tokens: it is refused
    at once instead of after seconds of tokenising.
    """

    def __init__(self, tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.max_chars = max((len(t) for t in vocab), default=1)

    def encode(self, text: str):
        if len(text) > self.max_tokens * self.max_chars:
            raise BadRequest(
                f"the prompt has {len(text)} characters, more than the {self.max_tokens} "
                f"tokens this server takes can hold; shorten it"
            )
        return self.tokenizer.encode(text)


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    max_tokens_given: bool  # False: the default may be shortened to fit the context
    include_usage: bool = False  # OpenAI stream_options.include_usage
    rid: str | None = None
    prompt_seed: int | None = None  # a decode node's synthetic-KV seed (runtime/fake_transfer)


def _nested_deeper_than(data: object, limit: int) -> bool:
    """Whether arrays/objects nest more than ``limit`` levels; iterative, so a deep body
    cannot overflow the stack here."""
    stack = [(data, 1)] if isinstance(data, list | dict) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        # One C pass over the element types: a 100K-token input_ids list costs no
        # Python-level loop.
        if set(map(type, children)) & {list, dict}:
            stack.extend((c, depth + 1) for c in children if isinstance(c, list | dict))
    return False


def parse_json(body: bytes) -> dict:
    """The body of every route, parsed: anything ``json`` cannot or should not turn into
    objects is a ``BadRequest`` (HTTP 400) that says why, never another exception (500)."""
    too_deep = (
        "the request body is not valid JSON: arrays and objects are nested too deeply; "
        f"this server takes at most {MAX_JSON_DEPTH} levels"
    )
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:  # the C parser's own depth check, near sys.getrecursionlimit()
        raise BadRequest(too_deep) from None
    except ValueError as exc:  # the only other one: int() of a number with too many digits
        digits = sys.get_int_max_str_digits()
        raise BadRequest(
            f"the request body is not valid JSON: a number has more than {digits} digits "
            f"(Python's limit); send numbers of at most {digits} digits"
        ) from exc
    # The bracket count bounds the depth from above, in C: most bodies skip the walk.
    deep = body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
    if deep and _nested_deeper_than(data, MAX_JSON_DEPTH):
        raise BadRequest(too_deep)
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _get_int(d: dict, key: str, default: int | None, minimum: int) -> int | None:
    value = d.get(key, default)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise BadRequest(f"{key} must be an integer >= {minimum}, got {value!r}")
    if value > MAX_INT_FIELD:  # not echoed: it may have thousands of digits
        raise BadRequest(
            f"{key} must be less than 2**63, got an integer of {len(str(value))} digits; "
            "ask for fewer tokens"
        )
    return value


def _get_float(d: dict, key: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    value = d.get(key)
    if value is None:
        return default
    ok = _is_num(value) and math.isfinite(value) and lo <= value <= hi
    if not ok or (lo_open and value == lo):
        span = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise BadRequest(f"{key} must be a number in {span}, got {value!r}")
    return float(value)


def check_text(value: str, field: str) -> str:
    """Refuse text that has no UTF-8 form (a lone surrogate such as "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(
            f"{field} holds invalid Unicode at character {exc.start} (a lone surrogate "
            f"{value[exc.start]!r}); send valid UTF-8 text"
        ) from None
    return value


def _refuse_unsupported(d: dict) -> None:
    for key, off in _UNSUPPORTED_OFF.items():
        value = d.get(key)
        if value is None or value == off or (off is None and value in ({}, [], "")):
            continue
        shown = json.dumps(value, ensure_ascii=False)
        reset = "" if off is None else f" or set it to {json.dumps(off)}"
        raise BadRequest(
            f"{key}={shown} is not supported by this server (it would change the "
            f"output); leave it out{reset}"
        )


def _seed(d: dict) -> int | None:
    seed = d.get("seed")
    if seed is None:
        return None
    lo, hi = SEED_RANGE
    if not _is_int(seed) or not lo <= seed < hi:
        raise BadRequest(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
    return seed


def _stop_list(value: object, tokenizer) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise BadRequest("stop must be a string or a list of strings")
    stops = [check_text(s, "stop") for s in value if s]
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            "characters each"
        )
    if stops and tokenizer is None:
        raise BadRequest(
            "stop strings need text, but the checkpoint ships no tokenizer.json; use stop_token_ids"
        )
    return stops


def _sampling(
    d: dict, max_key: str, default_max: int | None, tokenizer
) -> tuple[SamplingParams, bool]:
    _refuse_unsupported(d)
    given = d.get(max_key) is not None
    max_new = _get_int(d, max_key, default_max, 1)
    top_k = d.get("top_k", -1)
    if top_k is None:
        top_k = -1
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"top_k must be -1 (all) or an integer >= 1, got {top_k!r}")
    stop_ids = d.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers >= 0")
    ignore_eos = d.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be true or false, got {ignore_eos!r}")
    params = SamplingParams(
        max_new_tokens=max_new if max_new is not None else 0,
        temperature=_get_float(d, "temperature", 1.0, 0.0, 100.0, lo_open=False),
        top_p=_get_float(d, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        ignore_eos=ignore_eos,
        stop=_stop_list(d.get("stop"), tokenizer),
        stop_token_ids=list(stop_ids),
        seed=_seed(d),
    )
    return params, given


def _top_logprobs(value: object, field: str) -> int:
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{field} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
    return value


def _flag(d: dict, key: str) -> bool:
    value = d.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}")
    return value


def _token_ids(value: object, field: str) -> list[int]:
    # The element types in one C pass (a Python-level check per id cost tens of ms of the
    # GIL per 100K-token prompt, which the engine thread then waited for). JSON yields
    # exact ints, so "every type is int" also rules out bools.
    if not isinstance(value, list) or (value and set(map(type, value)) != {int}):
        raise BadRequest(f"{field} must be a list of integers (token ids)")
    return list(value)


def _encode(text: object, tokenizer, field: str) -> list[int]:
    if not isinstance(text, str):
        raise BadRequest(f"{field} must be a string")
    if tokenizer is None:
        raise BadRequest(
            f"{field} is text but the checkpoint ships no tokenizer.json; send token ids"
        )
    return tokenizer.encode(check_text(text, field)).ids


def _single(value: object, field: str) -> object:
    """SGLang/OpenAI allow a batch (list) of prompts; this server takes one per request."""
    if isinstance(value, list) and value and isinstance(value[0], list | str):
        if len(value) != 1:
            raise BadRequest(f"{field} holds {len(value)} prompts; send one prompt per request")
        return value[0]
    return value


def _stream(d: dict) -> bool:
    stream = d.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    return stream


def parse_generate(d: dict, tokenizer) -> ParsedRequest:
    """SGLang ``/generate``: ``text`` or ``input_ids``, ``sampling_params``, ``stream``."""
    if d.get("input_ids") is not None:
        ids = _token_ids(_single(d["input_ids"], "input_ids"), "input_ids")
    elif d.get("text") is not None:
        ids = _encode(_single(d["text"], "text"), tokenizer, "text")
    else:
        raise BadRequest("give 'text' (a string) or 'input_ids' (a list of token ids)")
    sp = d.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object")
    params, given = _sampling(sp, "max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS, tokenizer)
    params.logprobs = _flag(d, "return_logprob")
    params.top_logprobs = _top_logprobs(d.get("top_logprobs_num"), "top_logprobs_num")
    if _flag(d, "return_text_in_logprobs") and not params.logprobs:
        raise BadRequest("return_text_in_logprobs needs return_logprob: true")
    if d.get("logprob_start_len", -1) not in (-1, None):
        raise BadRequest("logprob_start_len (prompt logprobs) is not supported; leave it out")
    rid = d.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise BadRequest(f"rid must be a non-empty string, got {rid!r}")
    return ParsedRequest(ids, params, _stream(d), given, rid=rid)


def _n_is_one(d: dict) -> None:
    n = d.get("n", 1)
    if n not in (1, None):
        raise BadRequest(f"n must be 1 (one choice per request), got {n!r}")


def _usage_flag(d: dict) -> bool:
    opts = d.get("stream_options") or {}
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def parse_completion(d: dict, tokenizer) -> ParsedRequest:
    """OpenAI ``/v1/completions``: ``prompt`` (text or token ids), ``max_tokens``..."""
    _n_is_one(d)
    prompt = d.get("prompt")
    if prompt is None:
        raise BadRequest("prompt is required (a string or a list of token ids)")
    prompt = _single(prompt, "prompt")
    if isinstance(prompt, list):
        ids = _token_ids(prompt, "prompt")
    else:
        ids = _encode(prompt, tokenizer, "prompt")
    params, given = _sampling(d, "max_tokens", OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS, tokenizer)
    n = _top_logprobs(d.get("logprobs"), "logprobs")
    params.logprobs = d.get("logprobs") is not None
    params.top_logprobs = n
    return ParsedRequest(ids, params, _stream(d), given, _usage_flag(d))


def render_chat(messages: object) -> str:
    """A plain role-tagged transcript ending with the assistant's turn.

    The project's checkpoints ship no chat template, so this fixed one is used for all.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            texts = [c.get("text") for c in content if isinstance(c, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest(f"messages[{i}].content parts must be text parts")
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
        check_text(content, f"messages[{i}].content")
        parts.append(f"<|{m['role']}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def parse_chat(d: dict, tokenizer) -> ParsedRequest:
    """OpenAI ``/v1/chat/completions``: ``messages``, ``max_tokens`` or
    ``max_completion_tokens`` (default: what the context leaves)."""
    _n_is_one(d)
    ids = _encode(render_chat(d.get("messages")), tokenizer, "messages")
    key = "max_completion_tokens" if d.get("max_completion_tokens") is not None else "max_tokens"
    fmt = d.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise BadRequest(f"response_format type {fmt.get('type')!r} is not supported; leave it out")
    params, given = _sampling(d, key, None, tokenizer)
    params.logprobs = _flag(d, "logprobs")
    params.top_logprobs = _top_logprobs(d.get("top_logprobs"), "top_logprobs")
    if params.top_logprobs and not params.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true")
    return ParsedRequest(ids, params, _stream(d), given, _usage_flag(d))


def check_prompt(
    req: ParsedRequest, vocab_size: int, context_length: int, pool_tokens: int
) -> None:
    """Token ids in range, prompt non-empty, and prompt + new tokens within the limits.

    An unset max-tokens default shrinks to what the context leaves; a given one that does
    not fit is an error, as in SGLang.
    """
    ids = req.prompt_ids
    if not ids:
        raise BadRequest("the prompt is empty; send at least one token or character")
    if min(ids) < 0 or max(ids) >= vocab_size:  # C passes; the first bad id only on error
        bad = next(t for t in ids if t < 0 or t >= vocab_size)
        raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    limit = min(context_length, pool_tokens + 1)
    room = limit - len(ids)
    if room < 1:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens; this server takes at most {limit - 1} "
            f"(context length {context_length}, KV pool {pool_tokens} tokens)"
        )
    p = req.params
    if not req.max_tokens_given:
        p.max_new_tokens = room if p.max_new_tokens <= 0 else min(p.max_new_tokens, room)
    elif p.max_new_tokens > room:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens and {p.max_new_tokens} new tokens were asked "
            f"for: {len(ids) + p.max_new_tokens} exceeds the limit of {limit} tokens "
            f"(context length {context_length}); shorten the prompt or ask for fewer tokens"
        )
