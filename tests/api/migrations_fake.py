"""The api's Migrations over a stand-in runtime and liveness tables set by hand: what the
migration tests share (no bus, no clock but the test's)."""

from __future__ import annotations

import time

from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import Admission, GenerateRequest, Heartbeat, SamplingParams
from llmbus.services.api.errors import OpenAIError
from llmbus.services.api.migration_bus import Migrations

STAGES = ("scheduler", "tokenizer", "detokenizer", "executor", "api")


class _Runtime:  # what Migrations asks of its bus runtime here
    connected = True

    def bus_time(self) -> float:
        return time.monotonic()

    async def publish(self, *_: object) -> None:  # a resumption's abort of the old attempt
        return None


def migrations_over(alive: set[str], refusals: int,
                    role: str = "mixed") -> tuple[Migrations, list[float]]:
    copies = {stage: Liveness() for stage in STAGES}
    for stage in alive:  # heard from an hour ahead: alive throughout; one engine, e0
        copies[stage].seen(Heartbeat(service=stage, instance_id=f"{stage}-1",
                                     engine_id="e0" if stage in ("scheduler", "executor") else "",
                                     role=role if stage == "scheduler" else ""),
                           time.monotonic() + 3600)
    tries: list[float] = []

    async def admit(_: GenerateRequest) -> Admission:
        tries.append(time.monotonic())
        if len(tries) <= refusals:
            raise OpenAIError(503, "the pipeline did not admit the request in time")
        return Admission(num_prompt_tokens=1)

    async def abort(_: str) -> None:
        return None

    return Migrations(_Runtime(), copies, admit, abort), tries  # type: ignore[arg-type]


REQUEST = GenerateRequest(request_id="r1", reply_subject="api.x", model="m", prompt="hi",
                          params=SamplingParams())
