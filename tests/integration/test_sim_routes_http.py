"""The simulator's routes besides chat and completions, over HTTP against a real `sluice sim`
process: pooling (embeddings, Cohere embed, rerank, score), tokenize, batch chat, audio
uploads, LoRA adapters, the Responses store (GET, cancel, background), and what each costs
the engine (its vLLM metrics), including aborts when a streaming client disconnects."""

from __future__ import annotations

import io
import json
import socket
import time
import wave
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from tests.integration.conftest import SimFactory, SimProcess, start_sim
from tests.shapes import golden, same_shape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shared_sim() -> Iterator[SimProcess]:
    sim = start_sim("--profile", "tiny", "--speed", "4", "--lora-modules", "sql-lora=/adapters/sql")
    yield sim
    sim.stop()


def post(sim: SimProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(sim.url + path, json=body, timeout=20, **kw)


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- pooling -------------------------------------------------------------------------------


def test_embeddings_cost_one_prefill_only_request_per_input(sim: SimProcess) -> None:
    before = sim.metrics()
    r = post(sim, "/v1/embeddings", {"input": ["a" * 40, "b" * 80, "c"]})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert body["usage"] == {
        "prompt_tokens": 10 + 20 + 1,
        "total_tokens": 31,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    after = sim.metrics()
    done = 'vllm:request_success_total{finished_reason="stop"}'
    assert after[done] - before[done] == 3
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 31
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"]
    assert after["vllm:kv_cache_usage_perc"] == 0.0


def test_embeddings_inputs_and_errors(shared_sim: SimProcess) -> None:
    by_ids = post(shared_sim, "/v1/embeddings", {"input": [1, 2, 3]}).json()
    assert by_ids["usage"]["prompt_tokens"] == 3
    chat = post(
        shared_sim, "/v1/embeddings", {"messages": [{"role": "user", "content": "x" * 8}]}
    ).json()
    assert chat["usage"]["prompt_tokens"] == 1 + 4 + 2 + 1  # begin, header, 2 tokens, eot
    lora = post(shared_sim, "/v1/embeddings", {"input": "x", "model": "sql-lora"}).json()
    assert lora["model"] == "sql-lora"
    too_long = post(shared_sim, "/v1/embeddings", {"input": "x" * 4 * 2049})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "input_tokens"
    assert "maximum context length is 2048 tokens" in too_long.json()["error"]["message"]
    truncated = post(
        shared_sim, "/v1/embeddings", {"input": "x" * 4 * 2049, "truncate_prompt_tokens": 100}
    )
    assert truncated.json()["usage"]["prompt_tokens"] == 100
    missing = post(shared_sim, "/v1/embeddings", {"model": "sluice-sim"})
    assert missing.status_code == 400
    assert missing.json()["error"]["type"] == "Bad Request"
    assert missing.json()["error"]["param"] == "body.input"
    wrong_type = httpx.post(shared_sim.url + "/v1/embeddings", content=b"{}", timeout=10)
    assert wrong_type.status_code == 400
    assert "Only 'application/json' is allowed" in wrong_type.json()["error"]["message"]
    unknown = post(shared_sim, "/v1/embeddings", {"input": "x", "model": "nope"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The model `nope` does not exist."


def test_cohere_embed(shared_sim: SimProcess) -> None:
    body = post(
        shared_sim,
        "/v2/embed",
        {"texts": ["hello world"], "embedding_types": ["float", "ubinary"], "output_dimension": 16},
    ).json()
    assert body["response_type"] == "embeddings_by_type"
    assert body["texts"] == ["hello world"]
    assert len(body["embeddings"]["float"][0]) == 16
    assert len(body["embeddings"]["ubinary"][0]) == 2
    assert body["meta"] == {
        "api_version": {"version": "2"},
        "billed_units": {"input_tokens": 3, "image_tokens": 0},
    }
    floats = post(shared_sim, "/v1/embeddings", {"input": "hello world", "dimensions": 16}).json()
    assert body["embeddings"]["float"][0] == floats["data"][0]["embedding"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_ranks_the_documents_that_share_words_first(
    shared_sim: SimProcess, path: str
) -> None:
    docs = ["the weather is nice", "how to bake bread", "baking bread at home", "cats"]
    r = post(shared_sim, path, {"query": "bake bread", "documents": docs, "top_n": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("score-")
    assert [x["index"] for x in body["results"]] == [1, 2]
    assert body["results"][0]["document"] == {"text": docs[1], "multi_modal": None}
    assert body["results"][0]["relevance_score"] > body["results"][1]["relevance_score"] > 0
    # every query and document is one prefill: 3 + 5 + 5 + 5 + 1 tokens
    assert body["usage"] == {"prompt_tokens": 19, "total_tokens": 19}
    again = post(shared_sim, path, {"query": "bake bread", "documents": docs, "top_n": 2})
    assert again.json()["results"] == body["results"]


def test_score_pairs(shared_sim: SimProcess) -> None:
    one_to_n = post(shared_sim, "/score", {"text_1": "bake bread", "text_2": ["bread", "cats"]})
    data = one_to_n.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and data[0]["score"] > data[1]["score"]
    n_to_n = post(shared_sim, "/v1/score", {"queries": ["a", "b"], "documents": ["a", "b"]})
    assert [d["score"] for d in n_to_n.json()["data"]] == [pytest.approx(1.0)] * 2
    bad = post(shared_sim, "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert bad.status_code == 400
    assert "1:1, 1:N or N:N" in bad.json()["error"]["message"]


# -- tokenize, batch -----------------------------------------------------------------------


def test_tokenize_counts_as_the_generation_routes_do(shared_sim: SimProcess) -> None:
    messages = [{"role": "user", "content": "Tell me a joke about fish"}]
    tokenized = post(shared_sim, "/tokenize", {"messages": messages}).json()
    chat = post(shared_sim, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert tokenized["count"] == chat["usage"]["prompt_tokens"] == len(tokenized["tokens"])
    assert same_shape(tokenized, golden()["serve"]["tokenize"])
    assert tokenized["max_model_len"] == 2048
    prompt = "Ünïcode and ascii, mixed 🐟"
    ids = post(shared_sim, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert len(ids["token_strs"]) == ids["count"] == 8  # 31 bytes in 4-byte pieces
    back = post(shared_sim, "/detokenize", {"tokens": ids["tokens"]}).json()
    assert back == {"prompt": prompt}
    assert same_shape(back, golden()["serve"]["detokenize"])
    bad = post(shared_sim, "/detokenize", {"tokens": [7]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]


def test_batch_chat(shared_sim: SimProcess) -> None:
    convs = [[{"role": "user", "content": "x" * 4 * i}] for i in (1, 2, 3)]
    r = post(
        shared_sim,
        "/v1/chat/completions/batch",
        {"messages": convs, "max_tokens": 3, "ignore_eos": True},
    )
    body = r.json()
    assert body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(len(c["message"]["content"].split()) == 3 for c in body["choices"])
    assert body["usage"] == {
        "prompt_tokens": 11 + 12 + 13,
        "total_tokens": 45,
        "completion_tokens": 9,
    }
    bad = post(shared_sim, "/v1/chat/completions/batch", {"messages": convs, "n": 2})
    assert bad.status_code == 400 and "n > 1" in bad.json()["error"]["message"]


# -- audio ---------------------------------------------------------------------------------


def wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x01\x00" * int(seconds * rate))
    return out.getvalue()


def test_transcription_is_costed_from_the_uploads_duration(sim: SimProcess) -> None:
    before = sim.metrics()
    audio = wav(40.0)  # two windows: 30 s and 10 s
    r = httpx.post(
        sim.url + "/v1/audio/transcriptions",
        files={"file": ("a.wav", audio, "audio/wav")},
        data={"model": "sluice-sim", "language": "en"},
        timeout=30,
    )
    assert r.status_code == 200
    body = r.json()
    assert body["usage"] == {"type": "duration", "seconds": 40}
    assert same_shape(body, golden()["serve"]["transcription"])
    assert len(body["text"].split()) == 90 + 30  # 3 tokens a second
    after = sim.metrics()
    done = 'vllm:request_success_total{finished_reason="stop"}'
    assert after[done] - before[done] == 2
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * 1504
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 120
    again = httpx.post(
        sim.url + "/v1/audio/transcriptions", files={"file": ("a.wav", audio)}, timeout=30
    )
    assert again.json() == body


def test_translation_stream(shared_sim: SimProcess) -> None:
    with httpx.stream(
        "POST",
        shared_sim.url + "/v1/audio/translations",
        files={"file": ("a.wav", wav(2.0))},
        data={"stream": "true", "stream_include_usage": "true"},
        timeout=30,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"translation.chunk"}
    words = [c["choices"][0]["delta"]["content"] for c in chunks[:-1]]
    assert len(words) == 6 and chunks[-2]["choices"][0]["finish_reason"] == "stop"
    last = {**chunks[-2], "object": "transcription.chunk"}  # vLLM's golden is a transcription's
    assert same_shape(last, golden()["serve"]["transcription.chunk"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    plain = httpx.post(
        shared_sim.url + "/v1/audio/translations", files={"file": ("a.wav", wav(2.0))}, timeout=30
    ).json()
    assert plain == {"text": "".join(words)}


def test_audio_errors(shared_sim: SimProcess) -> None:
    url = shared_sim.url + "/v1/audio/transcriptions"
    missing = httpx.post(url, data={"model": "sluice-sim"}, files={"other": ("x", b"1")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "body.file"
    verbose = httpx.post(
        url, files={"file": ("a.wav", wav(1))}, data={"response_format": "verbose_json"}
    )
    assert verbose.status_code == 400
    assert "verbose_json" in verbose.json()["error"]["message"]


# -- models and LoRA -----------------------------------------------------------------------


def test_lora_adapters_listed_loaded_and_unloaded(sim_factory: SimFactory) -> None:
    sim = sim_factory(
        "--profile", "tiny", "--lora-modules", "a=/lora/a", "--allow-runtime-lora-updating"
    )
    ids = lambda: [m["id"] for m in httpx.get(sim.url + "/v1/models").json()["data"]]  # noqa: E731
    assert ids() == ["sluice-sim", "a"]
    card = httpx.get(sim.url + "/v1/models").json()["data"][1]
    assert (card["root"], card["parent"]) == ("/lora/a", "sluice-sim")
    loaded = post(sim, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/lora/b"})
    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'b' added successfully."
    assert ids() == ["sluice-sim", "a", "b"]
    again = post(sim, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/lora/b"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    chat = post(
        sim, "/v1/chat/completions", {"model": "b", "messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 200 and chat.json()["model"] == "b"
    assert post(sim, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    assert ids() == ["sluice-sim", "a"]
    gone = post(sim, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert gone.status_code == 404


def test_lora_updates_are_not_served_unless_allowed(shared_sim: SimProcess) -> None:
    r = post(shared_sim, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/x"})
    assert r.status_code == 404


# -- the Responses store -------------------------------------------------------------------


@pytest.fixture
def store_sim(sim_factory: SimFactory) -> SimProcess:
    # slow: 4 ms steps run at 1/5 speed, so a 200-token answer takes about 4 s
    return sim_factory("--profile", "tiny", "--speed", "0.2", "--enable-responses-store")


def test_stored_responses_are_fetched_and_continued(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "4", "--enable-responses-store")
    first = post(sim, "/v1/responses", {"input": "x" * 20, "max_output_tokens": 3}).json()
    fetched = httpx.get(sim.url + f"/v1/responses/{first['id']}").json()
    assert fetched == first
    follow = post(
        sim,
        "/v1/responses",
        {"input": "y" * 8, "max_output_tokens": 2, "previous_response_id": first["id"]},
    ).json()
    # the previous prompt (5 + 5 + 5) and answer (5 + its tokens) come before the new input
    answer = len(first["output"][0]["content"][0]["text"].encode())
    expected = 5 + (5 + 5) + (5 + -(-answer // 4)) + (5 + 2)
    assert follow["usage"]["input_tokens"] == expected
    cancel = httpx.post(sim.url + f"/v1/responses/{first['id']}/cancel")
    assert cancel.status_code == 400
    assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."


def test_background_response_is_queued_then_completed(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "4", "--enable-responses-store")
    queued = post(
        sim,
        "/v1/responses",
        {"input": "x", "max_output_tokens": 5, "background": True, "temperature": 0},
    ).json()
    assert (queued["status"], queued["output"], queued["background"]) == ("queued", [], True)
    url = sim.url + f"/v1/responses/{queued['id']}"
    wait_for(lambda: httpx.get(url).json()["status"] != "queued")
    done = httpx.get(url).json()
    assert done["status"] in ("completed", "incomplete")
    assert done["usage"]["output_tokens"] >= 1


def test_cancel_aborts_a_background_response(store_sim: SimProcess) -> None:
    queued = post(
        store_sim,
        "/v1/responses",
        {"input": "x", "max_output_tokens": 1000, "background": True, "ignore_eos": True},
    ).json()
    wait_for(lambda: store_sim.metrics()["vllm:num_requests_running"] == 1)
    cancelled = httpx.post(store_sim.url + f"/v1/responses/{queued['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    wait_for(
        lambda: store_sim.metrics()['vllm:request_success_total{finished_reason="abort"}'] == 1
    )
    m = store_sim.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
    stored = httpx.get(store_sim.url + f"/v1/responses/{queued['id']}").json()
    assert stored["status"] == "cancelled"


def test_background_stream_is_replayed_from_a_sequence_number(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "4", "--enable-responses-store")
    body = {"input": "x", "max_output_tokens": 3, "background": True, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", sim.url + "/v1/responses", json=body, timeout=20) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(11))
    assert events[-1]["type"] == "response.completed"
    response_id = events[0]["response"]["id"]
    url = sim.url + f"/v1/responses/{response_id}?stream=true&starting_after=6"
    with httpx.stream("GET", url, timeout=20) as r:
        replay = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert replay == events[7:]


# -- disconnects abort ---------------------------------------------------------------------


def _open_stream_and_close_after_first_event(sim: SimProcess, path: str, body: Any) -> None:
    """A raw client: send the request, read until the first SSE event, then close."""
    host, port = sim.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        seen = b""
        while b"\n\n" not in seen.partition(b"\r\n\r\n")[2]:
            chunk = conn.recv(65536)
            assert chunk, "the stream ended before its first event"
            seen += chunk


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "x", "stream": True, "max_output_tokens": 1000}),
        (
            "/v1/messages",
            {
                "model": "sluice-sim",
                "max_tokens": 1000,
                "stream": True,
                "messages": [{"role": "user", "content": "x"}],
            },
        ),
    ],
)
def test_a_streaming_client_that_disconnects_aborts_its_request(
    store_sim: SimProcess, path: str, body: dict[str, Any]
) -> None:
    body = {**body, "ignore_eos": True}
    _open_stream_and_close_after_first_event(store_sim, path, body)
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    wait_for(lambda: store_sim.metrics()[abort] == 1)
    m = store_sim.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0
    assert m['vllm:request_success_total{finished_reason="length"}'] == 0


# -- bad input -----------------------------------------------------------------------------

ROUTES = [
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v2/embed",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/score",
    "/v1/score",
    "/tokenize",
    "/detokenize",
    "/v1/chat/completions/batch",
]
BAD_BODIES: list[Any] = [
    [],
    "text",
    {},
    {"model": 5},
    {"input": {"x": 1}, "messages": 3, "query": [1], "documents": 7, "tokens": "x"},
    {"input": [[1, "a"]], "messages": [[]], "texts": [], "text_1": [], "text_2": []},
    {"model": "sluice-sim", "messages": [{"role": "user", "content": {"a": 1}}], "max_tokens": 1},
    {"input": [{"type": "message"}], "max_output_tokens": -1, "top_n": -1, "prompt": 7},
    {"input": "x", "max_output_tokens": 1.5, "temperature": "hot", "stream": "yes"},
]


@pytest.mark.parametrize("path", ROUTES)
def test_bad_input_gets_a_clear_error_never_a_crash(shared_sim: SimProcess, path: str) -> None:
    not_json = httpx.post(
        shared_sim.url + path,
        content=b"{nope",
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert not_json.status_code == 400, not_json.text
    refused = 0
    for body in BAD_BODIES:
        r = post(shared_sim, path, body)
        assert r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code >= 400:  # (a route ignores fields it does not know, as vLLM does)
            refused += 1
            answer = r.json()
            assert "error" in answer and answer["error"]["message"], (body, answer)
    assert refused >= len(BAD_BODIES) - 2


def test_bad_uploads_get_a_clear_error(shared_sim: SimProcess) -> None:
    url = shared_sim.url + "/v1/audio/transcriptions"
    cases = [
        httpx.post(url, content=b"--x\r\n", headers={"Content-Type": "multipart/form-data"}),
        httpx.post(
            url, content=b"junk", headers={"Content-Type": "multipart/form-data; boundary=b"}
        ),
        httpx.post(url, json={"file": "x"}),
        httpx.post(url, files={"file": ("a.wav", b"")}),
        httpx.post(url, files={"file": ("a.wav", wav(1))}, data={"stream": "maybe"}),
        httpx.post(url, files={"file": ("a.wav", wav(1))}, data={"max_completion_tokens": "x"}),
        httpx.post(url, files={"file": ("a.wav", wav(1))}, data={"model": "nope"}),
        # a header that claims one byte a second: far past vLLM's 600 s limit
        httpx.post(url, files={"file": ("a.wav", wav(1)[:28] + b"\x01\x00\x00\x00" + wav(1)[32:])}),
    ]
    for r in cases:
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error"]["message"]
    assert "maximum allowed duration of 600s" in cases[-1].json()["error"]["message"]
