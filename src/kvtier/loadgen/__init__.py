"""Load generation against OpenAI-compatible servers, for `kvtier bench serve`.

`workloads` (prompts from a Mooncake trace, fresh prompts), `client` (one streamed completion,
timed), `stats` (percentiles, ratios, per-server figures), `proxy` (a TCP proxy that delays what
it forwards), `servers` (`vllm serve` and `redis-server` processes that are always stopped).
Nothing here imports torch or vLLM; the command that uses them does.
"""
