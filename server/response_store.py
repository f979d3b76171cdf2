"""Stored responses (`store: true`): a bounded in-memory map from response id to the response and the conversation
it ended (the chat messages a `previous_response_id` continues from). Oldest first out when full; entries older than
the age limit are gone (404, as an unknown id). One per server (app.state), used on the event loop's thread only;
a restart forgets everything (documented)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as GET returns it
    conversation: list[dict]  # chat messages: the input history, this request's input and its output
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int, max_age: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.max_age, self.clock = max_entries, max_age, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.max_entries <= 0:
            return
        self._expire()
        self._entries[response["id"]] = StoredResponse(response, conversation, self.clock())
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        limit = self.clock() - self.max_age
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at >= limit:
                break
            self._entries.popitem(last=False)
