"""Load generation against vLLM servers, for `kvtier bench serve`: what `vllm bench serve` cannot do.

`workloads` (prompts from a Mooncake trace, fresh prompts), `client` (one streamed completion,
sent and timed by vLLM's own benchmark client), `drive` (each prompt to every server in turn, on
an idle machine), `stats` (percentiles, ratios, per-server figures, spread over repeats), `proxy`
(a TCP proxy that delays what it forwards), `servers` (`vllm serve` and `redis-server` processes
that are always stopped). docs/vllm.md, "Load generators compared", says what each keeps and why.
Nothing here imports torch or vLLM at import time; `client.vllm_stream` imports vLLM when called.
"""
