"""One streamed completion against a vLLM server, sent and timed by `vllm bench serve`'s own client.

The request and its timing are vLLM's (`vllm.benchmarks.lib.endpoint_request_func`, the `vllm`
backend's `async_request_openai_completions`): TTFT from just before the request is sent to the
first chunk that carries a choice, the inter-token gaps between successive such chunks (vLLM
sends one a step), latency to the last token, output and prompt tokens from the usage chunk. Run
one workload through both generators against one server and they agree (docs/vllm.md, "Load
generators compared"), so kvtier keeps no HTTP client of its own. What it adds: the prompt goes
as token ids kvtier chose (`workloads`: both servers see exactly the same tokens, no tokenizer
round trip), `ignore_eos` and greedy sampling make every request produce `max_tokens` tokens,
and a request that did not is a failure (`RequestFailed`), never a sample. Each request opens its
own loopback connection (a kept-alive one may have been closed by a server while the other was
busy: uvicorn drops idle ones after 5 s). vLLM is imported when the client is made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.errors import KvtierError

from .stats import Sample

# (base_url, model, prompt ids, max_tokens) -> one timed sample
Stream = Callable[[str, str, Sequence[int], int], Sample]
CLIENT = "vllm.benchmarks"  # the name `kvtier bench serve` reports


class RequestFailed(KvtierError):
    """A server answered a benchmark request with an error, or fewer tokens than asked for."""


def vllm_stream(timeout_s: float = 600.0) -> Stream:
    """`vllm bench serve`'s request function, one request at a time (`drive` sends them so)."""
    import asyncio

    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    async def one(base_url: str, model: str, prompt: Sequence[int], max_tokens: int):  # type: ignore[no-untyped-def]
        request = RequestFuncInput(prompt=list(prompt), api_url=base_url.rstrip("/") + "/v1/completions",
                                   prompt_len=len(prompt), output_len=max_tokens, model=model,
                                   ignore_eos=True, extra_body={"temperature": 0.0})
        # timeout_s bounds the connect and each read, never the whole stream (a long answer is
        # not a failure; vllm bench serve's own total is 6 h)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await async_request_openai_completions(request, session)

    def stream(base_url: str, model: str, prompt: Sequence[int], max_tokens: int) -> Sample:
        out = asyncio.run(one(base_url, model, prompt, max_tokens))
        if not out.success:  # vLLM's error: the HTTP reason, or a traceback (its last line)
            why = (out.error.strip().splitlines() or ["the request failed"])[-1][-300:]
            raise RequestFailed(f"{base_url}: {why}")
        if out.output_tokens != max_tokens:  # ignore_eos: anything else is a stream cut short
            raise RequestFailed(f"{base_url}: {out.output_tokens} output tokens of {max_tokens} asked "
                                "(the stream ended early, or carried no usage)")
        return Sample(ttft_s=out.ttft, latency_s=out.latency, gaps_s=tuple(out.itl),
                      output_tokens=out.output_tokens, prompt_tokens=out.prompt_len or len(prompt))

    return stream


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
