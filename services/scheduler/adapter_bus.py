"""Admitting a request for a LoRA adapter: its executor prepares the adapter first.

Like a grammar compiled ahead (grammar_bus.py): the executor fetches the adapter from the bus's
store and checks it against the model before the request is scheduled, so a step never waits
for a fetch, and an adapter that is gone or does not fit is refused (a 400) before any token.
An adapter the executor knows already costs one round trip. Which adapters one step mixes is
the planner's (planner.py keeps running requests within the executor's `max_adapters`).
"""

from __future__ import annotations

import nats.errors

from llmbus.bus import subjects
from llmbus.bus.messages import AdapterCommand, AdapterReply, Admission, ErrorCode, SubmitRequest
from llmbus.bus.runtime import ServiceRuntime

# Below the tokenizer's admission timeout (3 s), as a grammar's compile.
PREPARE_TIMEOUT = 2.5


class AdapterAdmission:
    def __init__(self, runtime: ServiceRuntime, engine_id: str, max_adapters: int) -> None:
        self.runtime, self.engine_id, self.max_adapters = runtime, engine_id, max_adapters
        self.preparing: dict[tuple[str, int], bool] = {}  # (request id, attempt) -> aborted

    async def prepare(self, submit: SubmitRequest) -> Admission | None:
        """None once the executor holds the submit's adapter; else the refusal to send."""
        key = (submit.request_id, submit.attempt)
        self.preparing[key] = False
        try:
            refused = await self.ready(submit.params.adapter)
        finally:
            aborted = self.preparing.pop(key)
        if refused is None and aborted:
            return Admission(error_code=ErrorCode.INVALID_REQUEST,
                             error_message="aborted while its adapter was prepared")
        return refused

    async def ready(self, adapter: str) -> Admission | None:
        """None once the executor holds `adapter` (a prefill for another engine asks too)."""
        if not self.max_adapters:
            return Admission(error_code=ErrorCode.INVALID_REQUEST,
                             error_message=f"model {adapter!r} is a LoRA adapter, and engine "
                                           f"{self.engine_id} serves none (its executor was "
                                           "started without --enable-lora)")
        try:
            reply = await self.runtime.request(subjects.executor_adapter(self.engine_id),
                                               AdapterCommand(name=adapter, action="load"),
                                               AdapterReply, timeout=PREPARE_TIMEOUT)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            return Admission(error_code=ErrorCode.OVERLOADED,
                             error_message=f"engine {self.engine_id}'s executor did not "
                                           f"prepare adapter {adapter!r} in time; retry shortly")
        if reply.error:
            return Admission(error_code=ErrorCode.INVALID_REQUEST, error_message=reply.error,
                             error_param="model")
        return None

    def abort(self, request_id: str, up_to_attempt: int | None) -> None:
        """The request (its attempts up to `up_to_attempt`) is refused once prepared."""
        for key in self.preparing:
            if key[0] == request_id and (up_to_attempt is None or key[1] <= up_to_attempt):
                self.preparing[key] = True
