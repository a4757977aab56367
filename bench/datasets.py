"""Benchmark workloads: prompts of exact token lengths, a shared prefix, or a JSONL file.

Lengths are exact because prompts are built from words that are each one token with a leading
space: byte-level BPE pre-tokenizers split text at spaces before merging, so N such words are N
tokens. Every prompt is still checked (and trimmed if needed) against the model's tokenizer,
so the same seed gives the same prompts, of the same lengths, on every server.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Common English words; those that are not one token for the model's tokenizer are dropped.
WORDS = """
the of and to in is was for on that with as by at from his her an which are this be had not
but have they it one all were first new more after their who also two its has can out up into
other time only some most when over many years there then may about made three such these
city used world known under while during part since state between would could should where
people called several well later four through because both high being year before first life
school work house water music family name number group area system form government company
place point home game power line order river land book light city story world number night
study history word health field market money week service change table energy report price
model music voice paper space level board child report friend answer garden window season
summer winter spring autumn morning evening mountain island forest ocean valley desert bridge
road train station engine metal stone glass wood cloud storm rain snow wind fire earth plant
animal horse bird fish tree flower fruit bread milk coffee sugar salt color green blue red
yellow black white small large little great young old long short early late simple strong
""".split()


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload; `prompt_len` counts the tokens of `system` + `prompt`."""

    prompt: str | None = None
    system: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_len: int | None = None
    max_tokens: int | None = None  # per-request override (JSONL), else the run's --max-tokens


def single_token_words(tokenizer: Tokenizer, words: Sequence[str] = WORDS) -> list[str]:
    """The words that `tokenizer` spells as one token when preceded by a space."""
    unique = sorted(set(words))
    found = [w for w in unique if len(tokenizer.encode(" " + w)) == 1]
    if len(found) < 16:
        raise ValueError(f"only {len(found)} single-token words for this tokenizer; "
                         "use --dataset jsonl")
    return found


def exact_text(tokenizer: Tokenizer, words: Sequence[str], num_tokens: int,
               rng: random.Random) -> str:
    """Text of exactly `num_tokens` tokens made of random `words` (each ' word')."""
    chosen = [rng.choice(words) for _ in range(num_tokens)]
    for _ in range(4 * num_tokens + 8):  # merges across words are rare; trim or pad until exact
        text = "".join(" " + w for w in chosen)
        count = len(tokenizer.encode(text))
        if count == num_tokens:
            return text
        if count > num_tokens:
            chosen.pop()
        else:
            chosen.append(rng.choice(words))
    raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens")


def random_dataset(tokenizer: Tokenizer, *, num_requests: int, input_len: int,
                   seed: int = 0) -> list[BenchRequest]:
    """Distinct prompts of exactly `input_len` tokens each, the same for a given seed."""
    rng = random.Random(seed)
    words = single_token_words(tokenizer)
    return [BenchRequest(prompt=exact_text(tokenizer, words, input_len, rng),
                         prompt_len=input_len) for _ in range(num_requests)]


def shared_prefix_dataset(tokenizer: Tokenizer, *, num_requests: int, prefix_len: int,
                          input_len: int, seed: int = 0) -> list[BenchRequest]:
    """One system text of `prefix_len` tokens shared by all, then a distinct question each.

    This is the workload prefix caching is for: after the first request, only the question
    needs a prefill.
    """
    rng = random.Random(seed)
    words = single_token_words(tokenizer)
    system = exact_text(tokenizer, words, prefix_len, rng)
    return [BenchRequest(system=system, prompt=exact_text(tokenizer, words, input_len, rng),
                         prompt_len=prefix_len + input_len) for _ in range(num_requests)]


def parse_jsonl_line(line: str, tokenizer: Tokenizer | None = None) -> BenchRequest | None:
    """One `{"prompt": ...}` or `{"messages": [...]}` line (blank lines give None)."""
    if not line.strip():
        return None
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError("each line must be a JSON object")
    max_tokens = record.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError("`max_tokens` must be a positive integer")
    if isinstance(record.get("prompt"), str):
        prompt = record["prompt"]
        prompt_len = None if tokenizer is None else len(tokenizer.encode(prompt))
        return BenchRequest(prompt=prompt, prompt_len=prompt_len, max_tokens=max_tokens)
    messages = record.get("messages")
    if isinstance(messages, list) and messages and all(
            isinstance(m, dict) and "role" in m for m in messages):
        return BenchRequest(messages=messages, max_tokens=max_tokens)
    raise ValueError('each line needs "prompt" (a string) or "messages" (a list of messages)')


def jsonl_dataset(path: str | Path, *, num_requests: int | None = None,
                  tokenizer: Tokenizer | None = None) -> list[BenchRequest]:
    """The first `num_requests` requests of a JSONL file (all of them when None)."""
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                request = parse_jsonl_line(line, tokenizer)
            except (ValueError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc
            if request is not None:
                requests.append(request)
            if num_requests is not None and len(requests) == num_requests:
                break
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def request_body(request: BenchRequest, *, chat: bool, model: str, max_tokens: int,
                 ignore_eos: bool, include_usage: bool,
                 json_schema: dict | None = None) -> dict[str, Any]:
    """The streaming JSON body of one request for /v1/chat/completions or /v1/completions;
    with `json_schema`, its output is constrained to it (OpenAI's `response_format`, which
    vLLM and llmbus take on both endpoints)."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "max_tokens": request.max_tokens or max_tokens, "temperature": 0.0}
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "bench", "schema": json_schema}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM / llama.cpp extension; llmbus accepts it too
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if chat:
        if request.messages is not None:
            body["messages"] = request.messages
        else:
            system = [{"role": "system", "content": request.system}] if request.system else []
            body["messages"] = [*system, {"role": "user", "content": request.prompt or ""}]
    else:
        if request.messages is not None:
            raise ValueError("a request with `messages` needs --endpoint chat")
        body["prompt"] = (request.system or "") + (request.prompt or "")
    return body


def dialect_body(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """A chat request's body as the Responses or the Messages API takes it (the same
    conversation, output cap and sampling), or unchanged for the other endpoints."""
    if endpoint not in ("responses", "messages"):
        return body
    extra = {k: body[k] for k in ("ignore_eos", "response_format") if k in body}
    common = {"model": body["model"], "stream": body["stream"],
              "temperature": body["temperature"], **extra}
    if endpoint == "responses":
        return common | {"input": body["messages"], "max_output_tokens": body["max_tokens"]}
    system = "".join(m["content"] for m in body["messages"] if m["role"] == "system")
    turns = [m for m in body["messages"] if m["role"] != "system"]
    return common | {"messages": turns, "max_tokens": body["max_tokens"],
                     **({"system": system} if system else {})}
