"""Which detokenizer copy decodes which completion: sticky, so decode state stays in one place.

The detokenizer keeps per-completion state (the incremental decode window, text held back
for stop strings), so all tokens of one completion must reach the same copy, in order. The
scheduler, the only sender of tokens, assigns each completion to a live copy by rendezvous
hashing (stable while the set of copies is stable) and sends it there on the copy's own
subject; NATS keeps the order of one publisher's messages on one subject. When a copy dies,
its completions move to another copy, with the tokens the dead copy had (`replay_token_ids`):
the new copy decodes them silently, which restores the text the old one held back for a stop
string (its text so far was already delivered), then goes on from the next tokens.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

from llmbus.bus import subjects
from llmbus.bus.liveness import Liveness
from llmbus.bus.messages import FinishReason, RequestTokens


def _weight(key: str, instance_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{instance_id}".encode(),
                                          digest_size=8).digest(), "little")


@dataclass
class DetokenizerRouting:
    liveness: Liveness = field(default_factory=Liveness)
    assigned: dict[tuple[str, int], str] = field(default_factory=dict)
    sent: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # tokens so far

    def route(self, updates: list[RequestTokens], now: float) -> dict[str, list[RequestTokens]]:
        """Updates grouped by the subject of the detokenizer copy each completion goes to."""
        alive = {h.instance_id for h in self.liveness.alive(now)}
        out: dict[str, list[RequestTokens]] = defaultdict(list)
        for update in updates:
            key = (update.request_id, update.index)
            instance = self.assigned.get(key)
            if instance not in alive:
                if instance is not None:  # its copy died: the next one catches up first
                    update.replay_token_ids = list(self.sent.get(key, ()))
                instance = (max(alive, key=lambda i: _weight(f"{key[0]}#{key[1]}", i))
                            if alive else None)
            if update.finish_reason != FinishReason.NONE:
                self.assigned.pop(key, None)
                self.sent.pop(key, None)
            elif instance is not None:
                self.assigned[key] = instance
                self.sent.setdefault(key, []).extend(update.new_token_ids)
            # No copy heard from yet (start-up): the shared subject, where copies queue.
            subject = (subjects.detokenizer_tokens(instance) if instance is not None
                       else subjects.DETOKENIZER_TOKENS)
            out[subject].append(update)
        return out
