"""One streamed completion against an OpenAI-compatible server (`/v1/completions`), timed.

The prompt goes as token ids, so both servers see exactly the same tokens (no tokenizer round
trip). `ignore_eos` (vLLM's extension) makes every request produce `max_tokens` tokens, and
`return_token_ids` (also vLLM's) puts each chunk's token ids in the chunk, so tokens are counted,
not guessed from text. Two clients, chosen by `make_client`: the `openai` package when it is
installed (what users of these servers run), else `http.client` reading the server-sent events
itself. TTFT is from just before the request is sent to the first chunk that carries a choice;
the gaps are between successive such chunks (vLLM sends one a step).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence

from kvtier.errors import KvtierError

from .stats import Sample

# (base_url, model, prompt ids, max_tokens) -> one timed sample
Stream = Callable[[str, str, Sequence[int], int], Sample]


class RequestFailed(KvtierError):
    """A server answered a benchmark request with an error or an unreadable stream."""


def _body(model: str, prompt: Sequence[int], max_tokens: int) -> dict[str, object]:
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "return_token_ids": True}


def _sample(t0: float, events: Iterator[tuple[float, dict]], prompt_tokens: int) -> Sample:
    times: list[float] = []
    counted = 0
    usage_tokens: int | None = None
    for now, event in events:
        choices = event.get("choices") or []
        if choices:
            times.append(now)
            counted += len(choices[0].get("token_ids") or ())
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            usage_tokens = int(usage["completion_tokens"])
    end = time.perf_counter()
    if not times:
        raise RequestFailed("the stream ended without a token")
    return Sample(ttft_s=times[0] - t0, latency_s=end - t0,
                  gaps_s=tuple(b - a for a, b in zip(times, times[1:])),
                  output_tokens=usage_tokens if usage_tokens is not None else counted,
                  prompt_tokens=prompt_tokens)


def http_stream(timeout_s: float = 600.0) -> Stream:
    """Plain `http.client`, a new loopback connection a request (a kept-alive one may have been
    closed by the server while the other server was busy: uvicorn drops idle ones after 5 s), and
    the server-sent events read line by line."""

    def stream(base_url: str, model: str, prompt: Sequence[int], max_tokens: int) -> Sample:
        u = urllib.parse.urlsplit(base_url)
        payload = json.dumps(_body(model, prompt, max_tokens)).encode()
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
        t0 = time.perf_counter()
        try:
            conn.request("POST", u.path.rstrip("/") + "/v1/completions", body=payload,
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RequestFailed(f"{base_url}: HTTP {resp.status}: {resp.read()[:300]!r}")
            return _sample(t0, _sse(resp), len(prompt))
        except (OSError, http.client.HTTPException) as exc:
            raise RequestFailed(f"{base_url}: {exc}") from exc
        finally:
            conn.close()

    return stream


def _sse(resp: http.client.HTTPResponse) -> Iterator[tuple[float, dict]]:
    while True:
        line = resp.readline()
        if not line:
            return
        now = time.perf_counter()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError as exc:
            raise RequestFailed(f"unreadable event {data[:200]!r}") from exc
        if "error" in event:
            raise RequestFailed(f"server error in stream: {event['error']}")
        yield now, event


def openai_stream(timeout_s: float = 600.0) -> Stream:
    """The `openai` package's client (one per server: it keeps its connections alive)."""
    import openai

    clients: dict[str, openai.OpenAI] = {}

    def stream(base_url: str, model: str, prompt: Sequence[int], max_tokens: int) -> Sample:
        client = clients.get(base_url)
        if client is None:
            client = clients[base_url] = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1",
                                                       api_key="none", max_retries=0, timeout=timeout_s)
        body = _body(model, prompt, max_tokens)
        extra = {k: body.pop(k) for k in ("ignore_eos", "return_token_ids")}
        body.pop("stream")
        t0 = time.perf_counter()
        try:
            chunks = client.completions.create(stream=True, extra_body=extra, **body)  # type: ignore[call-overload]

            def events() -> Iterator[tuple[float, dict]]:
                for chunk in chunks:
                    yield time.perf_counter(), chunk.model_dump()

            return _sample(t0, events(), len(prompt))
        except openai.OpenAIError as exc:
            raise RequestFailed(f"{base_url}: {exc}") from exc

    return stream


def make_client(kind: str, timeout_s: float = 600.0) -> tuple[str, Stream]:
    """("openai" | "http", the stream function); `auto` is openai when it imports."""
    if kind in ("auto", "openai"):
        try:
            import openai  # noqa: F401
        except ImportError:
            if kind == "openai":
                from kvtier.errors import ConfigError

                raise ConfigError("--client openai: the openai package is not installed; "
                                  "pip install openai, or use --client http") from None
        else:
            return "openai", openai_stream(timeout_s)
    return "http", http_stream(timeout_s)


PREFIX_CACHE_SERIES = {"vllm:prefix_cache_hits_total": "engine_cache_hit_tokens",
                       "vllm:external_prefix_cache_hits_total": "external_hit_tokens",
                       "vllm:prefix_cache_queries_total": "prefix_cache_query_tokens"}


def prefix_cache_tokens(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """A vLLM server's prompt-token counters from its /metrics (summed over label sets): tokens
    its own prefix cache served, tokens a KV connector served, tokens looked up."""
    import urllib.request

    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(PREFIX_CACHE_SERIES.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in PREFIX_CACHE_SERIES:
            out[PREFIX_CACHE_SERIES[name]] += float(line.rsplit(" ", 1)[1])
    return out
