"""LoRA adapters at the api: which adapter a request's `model` names, and what the engines'
answers to a load mean.

A request's `model` is the base model's name (or absent): the base generates; or the name of
an adapter in the bus's adapter store (services/adapter_store_bus.py): that adapter generates
(`SamplingParams.adapter`); anything else is a 404 `model_not_found`. The store is the one
truth every api copy shares, so an adapter loaded through one copy serves through every other
at once: a name not known here is asked of the store. A name found there is trusted for
`HIT_TTL` seconds without asking again, so an adapter unloaded through another copy stops
serving here within that time (at once through the copy that unloaded it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from litestar.datastructures import State

from llmbus.bus.messages import AdapterReply
from llmbus.services.adapter_store_bus import AdapterStore, AdapterStoreUnavailable
from llmbus.services.api.errors import OpenAIError

HIT_TTL = 1.0  # seconds a name found in the store serves without asking the store again
ENABLE_FLAG = "--enable-lora"  # how an engine is started to serve adapters


@dataclass
class AdapterNames:
    """Adapter names lately found in the store, each with the time it was found. Time is an
    argument."""

    ttl: float = HIT_TTL
    _found_at: dict[str, float] = field(default_factory=dict)

    def known(self, name: str, now: float) -> bool:
        found_at = self._found_at.get(name)
        return found_at is not None and now - found_at < self.ttl

    def found(self, name: str, now: float) -> None:
        if len(self._found_at) > 1024:  # names come from clients: keep the live ones only
            self._found_at = {n: t for n, t in self._found_at.items() if now - t < self.ttl}
        self._found_at[name] = now

    def forget(self, name: str) -> None:
        self._found_at.pop(name, None)


def model_not_found(model: str, base: str) -> OpenAIError:
    return OpenAIError(404, f"the model `{model}` does not exist; this server serves `{base}` "
                       "and the LoRA adapters that /v1/models lists", param="model",
                       code="model_not_found")


def store_unavailable(exc: AdapterStoreUnavailable) -> OpenAIError:
    return OpenAIError(503, f"LoRA adapters are unavailable: {exc}",
                       headers={"Retry-After": "1"})


class ModelChoice(NamedTuple):
    name: str  # what responses name as their model: the base's, or the adapter's
    adapter: str  # the adapter that generates (SamplingParams.adapter); "" for the base
    base: str  # the base model's name (metrics label their series with it)


async def resolve_model(state: State, model: str | None) -> ModelChoice:
    """What a request's `model` picks (the base where it is absent); OpenAIError 404 for a
    model that is neither the base nor a stored adapter, 503 where the store fails."""
    base = (await state.engine.model_info()).model_name
    if model is None or model == base:
        return ModelChoice(base, "", base)
    store: AdapterStore | None = state.adapter_store
    names: AdapterNames = state.adapter_names
    if store is None:
        raise model_not_found(model, base)
    now = time.monotonic()
    if not names.known(model, now):
        try:
            if not await store.has(model):
                raise model_not_found(model, base)
        except AdapterStoreUnavailable as exc:
            raise store_unavailable(exc) from None
        names.found(model, now)
    return ModelChoice(model, model, base)


def load_refusal(replies: list[AdapterReply], engine_ids: set[str],
                 timeout: float) -> OpenAIError | None:
    """Why a load did not take, from the replies of the engines that were alive when it was
    sent (`engine_ids`); None where it did: no engine refused, and one at least serves
    adapters. An engine that did not answer is not waited for: it reads the adapter from the
    store when a request needs it."""
    errors = [f"engine {r.engine_id}: {r.error}"
              for r in sorted(replies, key=lambda r: r.engine_id) if r.error]
    if errors:
        return OpenAIError(400, "; ".join(errors), param="lora_path")
    if any(r.enabled for r in replies):
        return None
    if replies:
        return OpenAIError(400, "no engine serves LoRA adapters: start engines with "
                           f"`{ENABLE_FLAG}`", param="lora_name")
    if not engine_ids:
        return OpenAIError(503, "no engine is up to check the adapter; retry shortly",
                           headers={"Retry-After": "1"})
    return OpenAIError(503, f"no engine answered within {timeout:g} s (engines "
                       f"{', '.join(sorted(engine_ids))})", headers={"Retry-After": "1"})
