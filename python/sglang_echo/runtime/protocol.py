"""Request bodies of the HTTP API -> prompt token ids + ``SamplingParams``, validated.

Three shapes: SGLang's native ``/generate`` (``text`` or ``input_ids``, ``sampling_params``),
OpenAI's ``/v1/completions`` (``prompt``, ``max_tokens``...) and ``/v1/chat/completions``
(``messages``). Anything malformed raises ``BadRequest`` with a message naming the field;
the server turns it into HTTP 400. Unknown fields are ignored, as SGLang does, so real
clients that send extra options (``return_logprob``, ``lora_path``...) still work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sglang_echo.runtime.request import SamplingParams

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """The request cannot be served as sent; the message says which field and why."""


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    max_tokens_given: bool  # False: the default may be shortened to fit the context
    include_usage: bool = False  # OpenAI stream_options.include_usage
    rid: str | None = None


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
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
    return value


def _get_float(d: dict, key: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
    value = d.get(key)
    if value is None:
        return default
    if not _is_num(value) or value > hi or value < lo or (lo_open and value == lo):
        span = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise BadRequest(f"{key} must be a number in {span}, got {value!r}")
    return float(value)


def _stop_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise BadRequest("stop must be a string or a list of strings")


def _sampling(d: dict, max_key: str, default_max: int | None) -> tuple[SamplingParams, bool]:
    given = d.get(max_key) is not None
    max_new = _get_int(d, max_key, default_max, 1)
    top_k = d.get("top_k", -1)
    if top_k is None:
        top_k = -1
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"top_k must be -1 (all) or an integer >= 1, got {top_k!r}")
    stop_ids = d.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of integers")
    ignore_eos = d.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be true or false, got {ignore_eos!r}")
    seed = d.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    params = SamplingParams(
        max_new_tokens=max_new if max_new is not None else 0,
        temperature=_get_float(d, "temperature", 1.0, 0.0, 100.0, lo_open=False),
        top_p=_get_float(d, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        ignore_eos=ignore_eos,
        stop=_stop_list(d.get("stop")),
        stop_token_ids=list(stop_ids),
        seed=seed,
    )
    return params, given


def _token_ids(value: object, field: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise BadRequest(f"{field} must be a list of integers (token ids)")
    return list(value)


def _encode(text: object, tokenizer, field: str) -> list[int]:
    if not isinstance(text, str):
        raise BadRequest(f"{field} must be a string")
    if tokenizer is None:
        raise BadRequest(
            f"{field} is text but the checkpoint ships no tokenizer.json; send token ids"
        )
    return tokenizer.encode(text).ids


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
    params, given = _sampling(sp, "max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    rid = d.get("rid")
    return ParsedRequest(
        ids, params, _stream(d), given, rid=rid if isinstance(rid, str) and rid else None
    )


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
    params, given = _sampling(d, "max_tokens", OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS)
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
        parts.append(f"<|{m['role']}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def parse_chat(d: dict, tokenizer) -> ParsedRequest:
    """OpenAI ``/v1/chat/completions``: ``messages``, ``max_tokens`` or
    ``max_completion_tokens`` (default: what the context leaves)."""
    _n_is_one(d)
    ids = _encode(render_chat(d.get("messages")), tokenizer, "messages")
    key = "max_completion_tokens" if d.get("max_completion_tokens") is not None else "max_tokens"
    params, given = _sampling(d, key, None)
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
        raise BadRequest("the prompt is empty")
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
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
