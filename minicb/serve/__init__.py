"""Serving over HTTP: minicb's engine behind an OpenAI-compatible API.

In this package you will learn what a server adds around an engine that
already batches continuously (chapter 06):

- a *protocol*: the JSON a client sends and gets back, checked before anything
  reaches the engine (protocol.py);
- an *engine loop*: one thread owns the engine and steps it while there is
  work; requests reach it through a thread-safe queue and their tokens go back
  to each request's asyncio queue, one hand-off per step (loop.py; the
  objects the two threads pass are in events.py);
- *text*: turning a growing list of token ids into text deltas, and the stop
  strings the engine does not know about (text.py);
- *routes*: completions and chat completions, streamed as server-sent events or
  answered whole, errors in OpenAI's shape (app.py);
- *observability*: Prometheus metrics (metrics.py) and a live dashboard that
  draws the same slot timeline and block map as minicb.viz (dashboard.py,
  dashboard.html).

    python -m minicb serve --port 8000          # then open http://127.0.0.1:8000/
    python -m minicb bench-serve --url http://127.0.0.1:8000

The server owns no batching logic of its own: every scheduling decision is the
engine's. It only moves requests in and tokens out, and keeps a disconnected
client from holding KV blocks.
"""
