"""The bench's client (vllm bench serve's request function) against a fake OpenAI-compatible
server that streams on a known schedule."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.loadgen.client import RequestFailed, vllm_stream

pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")

FIRST_S, GAP_S, TOKENS = 0.15, 0.08, 4
SLOW_TOKENS, SLOW_GAP_S = 6, 0.3  # max_tokens SLOW_TOKENS: a stream longer than its reads' timeout
STALL_TOKENS, STALL_S = 5, 3.0  # max_tokens STALL_TOKENS: no token for STALL_S


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.bodies.append(body)
        if body["max_tokens"] > 100:
            msg = b'{"error": {"message": "max_tokens too large"}}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(obj: object) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        base = {"id": "x", "object": "text_completion", "created": 0, "model": body["model"]}
        # max_tokens 2 * TOKENS: fewer tokens than asked for, and no usage (a stream cut short)
        per_chunk = 2 if body["max_tokens"] == 2 * TOKENS else 1
        slow = body["max_tokens"] == SLOW_TOKENS
        tokens, gap_s = (SLOW_TOKENS, SLOW_GAP_S) if slow else (TOKENS, GAP_S)
        time.sleep(STALL_S if body["max_tokens"] == STALL_TOKENS else FIRST_S)
        for i in range(tokens):
            if i:
                time.sleep(gap_s)
            send({**base, "choices": [{"index": 0, "text": "a", "token_ids": [7] * per_chunk,
                                       "logprobs": None, "finish_reason": None}]})
        if per_chunk == 1:
            send({**base, "choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                   "completion_tokens": tokens, "total_tokens": 0}})
        send("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


@pytest.fixture
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Handler.bodies.clear()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_ttft_gaps_and_tokens_come_from_the_stream(server: str) -> None:
    stream = vllm_stream(timeout_s=10)
    for _ in range(2):  # the second request reuses the stream function
        s = stream(server, "m", [5, 6, 7], TOKENS)
        # no upper bound by a margin (noise can break any): the first token's time is bounded by
        # the server's send time below and by the request's own end (latency) above
        assert FIRST_S <= s.ttft_s < s.latency_s
        assert len(s.gaps_s) == TOKENS - 1
        # No token is seen before the server sent it (a bound noise cannot break: a late read
        # of one token only shortens the gap after it, so single gaps are not bounded below).
        arrivals = [s.ttft_s + sum(s.gaps_s[:i]) for i in range(TOKENS)]
        assert all(t >= FIRST_S + i * GAP_S for i, t in enumerate(arrivals)), arrivals
        # and they are read as they come, not all at the end of the stream (a third of the schedule)
        assert sum(s.gaps_s) >= GAP_S, s.gaps_s  # a client that reads at the end sees ~0
        assert s.output_tokens == TOKENS and s.prompt_tokens == 3
        assert s.latency_s >= s.ttft_s + sum(s.gaps_s) * 0.99
    body = _Handler.bodies[-1]
    assert body["prompt"] == [5, 6, 7] and body["stream"] is True
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == TOKENS


def test_the_timeout_bounds_each_wait_not_the_whole_stream(server: str) -> None:
    """timeout_s bounds the connect and each read, as the old clients' did (http.client's socket
    timeout, openai's per-operation one): a stream that keeps sending is never cut for its
    length (1.65 s here, past a 1 s timeout; each wait 0.3 s)."""
    s = vllm_stream(timeout_s=1.0)(server, "m", [1, 2], SLOW_TOKENS)
    assert s.output_tokens == SLOW_TOKENS and s.latency_s > 1.0
    t0 = time.perf_counter()
    with pytest.raises(RequestFailed, match="Timeout"):  # a server that stops sending: one wait's timeout
        vllm_stream(timeout_s=0.5)(server, "m", [1], STALL_TOKENS)
    assert time.perf_counter() - t0 < STALL_S


def test_a_stream_short_of_max_tokens_is_a_failed_request(server: str) -> None:
    """ignore_eos asks for every token: fewer (here no usage chunk either) is never a sample."""
    with pytest.raises(RequestFailed, match="0 output tokens of 8"):
        vllm_stream(timeout_s=10)(server, "m", [1], 2 * TOKENS)


def test_an_error_answer_is_a_failed_request(server: str) -> None:
    with pytest.raises(RequestFailed, match="Bad Request"):
        vllm_stream(timeout_s=10)(server, "m", [1], 1000)


def test_no_server_is_a_failed_request() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RequestFailed, match=f"127.0.0.1:{port}: .*[Cc]onnect"):
        vllm_stream(timeout_s=10)(f"http://127.0.0.1:{port}", "m", [1], 4)
