"""Server-sent events, as an OpenAI-style stream sends them: one parser for every client here.

A streamed answer is lines of text; an event's data follows `data:` (the space after
the colon is optional), each event is JSON but for the stream's last, the bare
`data: [DONE]`, and blank lines and `:` comments sit between them. bench-serve's
`request()` (minicb/bench/serve.py), which tools/soak.py sends through too, and
the server's tests all read streams with these two functions.
"""
from __future__ import annotations

import json
from collections.abc import Iterable

DONE = "[DONE]"


def parse_event(line: str) -> dict | str | None:
    """One line's event: its JSON data, the string "[DONE]", or None for a line that
    carries no data (a blank separator, a comment, another field)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    return data if data == DONE else json.loads(data)


def sse_events(lines: Iterable[str], limit: int | None = None) -> list[dict | str]:
    """Every event of a stream's lines, in order ("[DONE]" stays a string); with `limit`,
    stop reading once that many have come (a client that hangs up early)."""
    events = []
    for line in lines:
        event = parse_event(line)
        if event is not None:
            events.append(event)
            if limit is not None and len(events) >= limit:
                break
    return events
