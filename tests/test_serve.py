"""`causal-adapter serve` (docs/serving.md): a live server in a subprocess on a free port, driven with the `openai`
client and plain HTTP (httpx); nothing mocked. Two adapters on the embedded tiny base (different heads and
value units: different text and values); every answer is compared with the same adapter in-process
(`generate`, `predict_values`, the CLI). A second small server (--api-key, --max-queue 1, --max-batch-size 1)
holds the tests of the key, the full queue, the disconnect and the graceful shutdown (the last test)."""
import json
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install 'causal_adapter[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra: pip install 'causal_adapter[serve]'")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from causal_adapter.commands.main import main  # noqa: E402
from causal_adapter.data.conversations import inference_prompt  # noqa: E402
from causal_adapter.modeling.generation import generate  # noqa: E402
from causal_adapter.numbers import NumberTokenizer  # noqa: E402
from serve_fixtures import TINY_FLAGS, Server, make_adapter, tiny_base  # noqa: E402

KEY = "test-key"
PROMPTS = ["Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971:", "The price was", "Hello",
           "3 apples and 4.5 pears cost", "x"]
RTOL = 2e-6  # a row's values in a batch vs alone: float rounding only (docs/cli.md)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, qwen_tokenizer):
    """a, b: two adapters (b's calibrated 90% intervals unbounded: -inf, inf); root/: the runtime root, with c (a
    copy of a), an empty folder and a link out of it."""
    d = tmp_path_factory.mktemp("serve")
    a = make_adapter(d / "a", qwen_tokenizer, seed=2, value_loc=39.0, value_scale=38.0)
    b = make_adapter(d / "b", qwen_tokenizer, seed=6, value_loc=500.0, value_scale=100.0, calibration_rows=8)
    root = d / "root"
    root.mkdir()
    shutil.copytree(a, root / "c")
    (root / "empty").mkdir()
    (root / "elsewhere").symlink_to(b, target_is_directory=True)
    shutil.copytree(a, root / "linked")  # inside the root, but its tensors are a link to b's, outside it
    (root / "linked" / "causal_adapter_model.safetensors").unlink()
    (root / "linked" / "causal_adapter_model.safetensors").symlink_to(b / "causal_adapter_model.safetensors")
    return {"a": a, "b": b, "root": root, "dir": d}


@pytest.fixture(scope="module")
def servers(adapters):
    """Both servers, started together: "main" (a, b, runtime loading under root/) and "tight" (a, with a key,
    one request at a time)."""
    d = adapters["dir"]
    main_server = Server(["--adapter", f"a={adapters['a']}", "--adapter", f"b={adapters['b']}",
                          "--runtime-adapter-root", str(adapters["root"])], d / "main.log")
    tight = Server(["--adapter", f"a={adapters['a']}", "--api-key", KEY, "--max-queue", "1", "--max-batch-size", "1",
                    "--scheduler", "tick", "--no-prefix-cache"], d / "tight.log")
    try:
        yield {"main": main_server.wait_ready(), "tight": tight.wait_ready()}
    finally:
        main_server.stop()
        tight.stop()


@pytest.fixture(scope="module")
def url(servers):
    return servers["main"].url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(adapters, qwen_tokenizer):
    """The same adapters in-process, each alone on its own base."""
    from causal_adapter import CausalModel

    return {n: CausalModel.from_pretrained(tiny_base(), adapters[n], tokenizer=qwen_tokenizer) for n in "ab"}


def expected(model, tok, prompt, max_tokens, stop=None):
    """(text, numbers) of `causal-adapter generate`'s default decoding (deterministic), cut before a stop string."""
    out = generate(model, prompt, tokenizer=tok, max_new_tokens=max_tokens, stop_strings=stop)
    text, numbers = out.texts[0], out.numbers[0]
    if stop and stop in text:
        text = text[:text.index(stop)]
        kept, pos = [], 0
        for n in numbers:  # the numbers written before the cut
            pos = text.find(n["text"], pos)
            if pos < 0:
                break
            kept.append(n)
            pos += len(n["text"])
        numbers = kept
    return text, numbers


def assert_values(values, numbers, rel=RTOL):
    assert len(values) == len(numbers)
    for v, n in zip(values, numbers):
        assert v["text"] == n["text"]
        tol = rel * (abs(n["loc"]) + n["scale"])  # loc = value_loc + value_scale Y': its rounding scales with both
        for k in ("value", "loc", "scale"):
            assert v[k] == pytest.approx(n[k], abs=tol)
        for level in (50, 90):
            assert (v[f"lower_{level}"], v[f"upper_{level}"]) == pytest.approx(n[f"interval_{level}"], abs=tol)
            assert (v[f"raw_lower_{level}"], v[f"raw_upper_{level}"]) == pytest.approx(n[f"raw_interval_{level}"],
                                                                                       abs=tol)


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=120, **kw)


# --------------------------------------------------------------------------- the OpenAI endpoints
def test_models_are_listed(client, url):
    models = client.models.list().data
    assert {"a", "b"} <= {m.id for m in models}
    assert all(m.object == "model" and m.owned_by == "causal_adapter" for m in models)
    assert client.models.retrieve("b").id == "b"
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and {"a", "b"} <= set(health["adapters"])


def test_greedy_completion_equals_generate(client, local, qwen_tokenizer, adapters, tmp_path, capsys):
    for name in "ab":
        for prompt in PROMPTS[:2]:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=6)
            text, numbers = expected(local[name], qwen_tokenizer, prompt, 6)
            choice = r.choices[0]
            assert choice.text == text and choice.finish_reason == "length"
            assert_values(choice.values, numbers, rel=1e-12)  # alone in its batch: the same floats
            assert numbers and all(v["lower_90"] < v["lower_50"] < v["upper_50"] < v["upper_90"] for v in choice.values)
            assert r.usage.completion_tokens == 6 and r.model == name
    a, b = (client.completions.create(model=n, prompt=PROMPTS[1], max_tokens=4).choices[0].text for n in "ab")
    assert a != b  # two adapters, two answers
    # without max_tokens: exactly what `causal-adapter generate --adapter A PROMPT` writes (its defaults)
    out = tmp_path / "g.jsonl"
    assert main(["generate", "--adapter", str(adapters["a"]), *TINY_FLAGS, "--no-progress", "--output", str(out),
                 PROMPTS[0]]) == 0
    cli = json.loads(out.read_text())
    served = client.completions.create(model="a", prompt=PROMPTS[0]).choices[0]
    assert served.text == cli["completion"] and [v["text"] for v in served.values] == [v["text"] for v in cli["values"]]
    for v, w in zip(served.values, cli["values"]):  # its first 16 tokens' keys and values read from the prefix cache
        tol = RTOL * (abs(w["loc"]) + w["scale"])  # as assert_values: the rounding scales with both
        assert set(v) == set(w) and all(v[k] == pytest.approx(w[k], abs=tol) for k in w if k != "text")
    # a list of prompts, n copies, levels of one's own
    r = client.completions.create(model="b", prompt=PROMPTS[1:3], max_tokens=3, n=2, extra_body={"levels": [0.8]})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, prompt in zip(r.choices, [PROMPTS[1]] * 2 + [PROMPTS[2]] * 2):
        assert c.text == expected(local["b"], qwen_tokenizer, prompt, 3)[0]
        assert all({"lower_80", "upper_80"} <= set(v) and "lower_90" not in v for v in c.values)


def test_stop_and_modes(client, local, qwen_tokenizer):
    r = client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=8, stop=" ")
    text, numbers = expected(local["a"], qwen_tokenizer, PROMPTS[1], 8, stop=" ")
    assert r.choices[0].text == text and " " not in text and r.choices[0].finish_reason == "stop"
    assert [v["text"] for v in r.choices[0].values] == [n["text"] for n in numbers] == [text]
    # softmax greedy (mode given, no temperature) = generate's softmax greedy; seeded sampling is reproducible
    soft = client.completions.create(model="b", prompt=PROMPTS[2], max_tokens=4, extra_body={"mode": "softmax"})
    assert soft.choices[0].text == generate(local["b"], PROMPTS[2], tokenizer=qwen_tokenizer, mode="softmax",
                                            max_new_tokens=4).texts[0]
    s1, s2 = (client.completions.create(model="b", prompt=PROMPTS[2], max_tokens=4, temperature=1.0, seed=7).choices[0]
              for _ in range(2))
    assert s1.text == s2.text
    c1, c2 = (client.completions.create(model="a", prompt=PROMPTS[2], max_tokens=4, seed=3,
                                        extra_body={"mode": "causal"}).choices[0] for _ in range(2))
    assert c1.text == c2.text and c1.values == c2.values


def test_chat_completion_uses_the_chat_template(client, local, qwen_tokenizer):
    messages = [{"role": "system", "content": "Numbers only."}, {"role": "user", "content": "Sunspots in 1975?"}]
    r = client.chat.completions.create(model="b", messages=messages, max_tokens=5)
    prompt = inference_prompt(qwen_tokenizer, messages)  # the generation prompt, thinking off (generate --messages)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    text, numbers = expected(local["b"], qwen_tokenizer, prompt, 5)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert_values(r.choices[0].values, numbers, rel=1e-12)
    n_prompt = len(NumberTokenizer(qwen_tokenizer).encode_batch([prompt], return_offsets=False)[0].input_ids)
    assert r.usage.prompt_tokens == n_prompt and r.object == "chat.completion"  # "1975" is one <NUM>
    # OpenAI's content parts are joined; a bad message is a 400 naming it
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sunspots "}, {"type": "text", "text": "in 1975?"}]}]
    plain, joined = (client.chat.completions.create(model="b", messages=m, max_tokens=3).choices[0].message.content
                     for m in (messages[1:], parts))
    assert plain == joined
    with pytest.raises(openai.BadRequestError, match="unknown role 'bot'"):
        client.chat.completions.create(model="b", messages=[{"role": "bot", "content": "x"}], max_tokens=3)


def test_streaming_joins_to_the_same_text(client):
    for kw in ({"max_tokens": 7}, {"max_tokens": 8, "stop": ["4", ". "]}):
        full = client.completions.create(model="a", prompt=PROMPTS[0], **kw).choices[0]
        chunks = list(client.completions.create(model="a", prompt=PROMPTS[0], stream=True, **kw))
        assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == full.text
        assert [c.choices[0].finish_reason for c in chunks][-1] == full.finish_reason
        assert chunks[-1].choices[0].values == full.values
    messages = [{"role": "user", "content": "How many?"}]
    full = client.chat.completions.create(model="b", messages=messages, max_tokens=5).choices[0]
    chunks = list(client.chat.completions.create(model="b", messages=messages, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.message.content
    assert [c for c in chunks if c.choices][-1].choices[0].values == full.values
    assert chunks[-1].usage.completion_tokens == 5


def test_each_connection_the_server_accepts_sends_without_delay():
    """TCP_NODELAY on every accepted connection, as uvicorn accepts them (`loop.create_server(sock=...)` on the socket
    `listen` made): asyncio sets it only on sockets that say IPPROTO_TCP. Without it Nagle's algorithm held a stream's
    chunks until the client's delayed ACK: on a reused connection a 16-token stream arrived all at once, ~40 ms late."""
    import asyncio
    import socket

    from causal_adapter.commands.serve import listen

    async def accepted_nodelay() -> int:
        loop = asyncio.get_running_loop()
        seen = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await loop.create_server(Accept, sock=listen("127.0.0.1", 0))
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 30)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_two_adapters_in_concurrent_mixed_requests(client, local, qwen_tokenizer, url):
    """16 requests at once, adapters, endpoints, streaming and max_tokens mixed: each gets its own adapter's answer,
    and requests that arrive together share batches, across the two adapters."""
    jobs = [("ab"[i % 2], PROMPTS[i % 5], 3 + i % 4, ("completion", "chat", "stream")[i % 3]) for i in range(16)]
    barrier = threading.Barrier(len(jobs))
    before = httpx.get(url + "/health").json()

    def ask(job):
        name, prompt, max_tokens, kind = job
        barrier.wait()
        if kind == "chat":
            c = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens).choices[0]
            return c.message.content, c.values
        if kind == "stream":
            chunks = list(client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, stream=True))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].values
        c = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens).choices[0]
        return c.text, c.values

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    for (name, prompt, max_tokens, kind), (text, values) in zip(jobs, answers):
        if kind == "chat":
            prompt = inference_prompt(qwen_tokenizer, [{"role": "user", "content": prompt}])
        want, numbers = expected(local[name], qwen_tokenizer, prompt, max_tokens)
        assert text == want, (name, prompt, max_tokens, kind)
        assert_values(values, numbers)
    after = httpx.get(url + "/health").json()
    assert after["requests"] - before["requests"] == len(jobs)
    assert after["batches"] - before["batches"] < len(jobs)  # some requests ran together
    assert after["mixed_adapter_steps"] > before["mixed_adapter_steps"]  # both adapters in one backbone pass


def _stream_text(client, name, prompt, max_tokens, first=None, **kw):
    """A streamed completion's text and last chunk; `first` (an Event) is set at its first text chunk."""
    text, last = "", None
    for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, stream=True, **kw):
        text += chunk.choices[0].text
        last = chunk
        if first is not None and text:
            first.set()
    return text, last.choices[0]


def test_requests_join_the_running_batch_and_each_gets_its_answer_alone(client, local, qwen_tokenizer, url):
    """Continuous batching, live: 14 requests arriving at random moments (adapters, lengths 2 to 40 tokens, eos or
    not, streaming or not) join one running batch at different steps and leave it as they finish; every answer is
    what its adapter gives its prompt alone (`generate`), and the batch's steps were shared."""
    import random

    rng = random.Random(41)
    jobs = [("ab"[rng.randrange(2)], PROMPTS[rng.randrange(5)], rng.choice([2, 5, 12, 40]), rng.random() < 0.5,
             rng.random() < 0.4, rng.uniform(0, 0.4)) for _ in range(14)]
    before = httpx.get(url + "/health").json()

    def ask(job):
        name, prompt, max_tokens, stream, ignore_eos, delay = job
        time.sleep(delay)
        extra = {"extra_body": {"ignore_eos": True}} if ignore_eos else {}
        if stream:
            text, last = _stream_text(client, name, prompt, max_tokens, **extra)
            return text, last.values, last.finish_reason
        c = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, **extra).choices[0]
        return c.text, c.values, c.finish_reason

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    after = httpx.get(url + "/health").json()
    tokens = 0
    for (name, prompt, max_tokens, _, ignore_eos, _), (text, values, reason) in zip(jobs, answers):
        out = generate(local[name], prompt, tokenizer=qwen_tokenizer, max_new_tokens=max_tokens,
                       eos_token_id=[] if ignore_eos else None)
        assert text == out.texts[0], (name, prompt, max_tokens, ignore_eos)
        assert reason == ("stop" if bool(out.finished[0]) else "length")
        assert_values(values, out.numbers[0])
        tokens += int(out.lengths[0])
    assert after["prefills"] - before["prefills"] >= 3  # rows joined at different steps
    assert after["steps"] - before["steps"] < tokens / 2  # ... of one running batch: steps shared by rows
    assert after["running_rows"] == 0 and after["waiting_rows"] == 0


def test_a_stream_cancelled_mid_batch_leaves_and_the_others_finish_whole(client, local, qwen_tokenizer, url):
    """A client that goes away mid-stream: its row leaves the batch at once (its request counted as aborted); the rows
    beside it finish with exactly their own answers."""
    long = {"model": "a", "prompt": PROMPTS[2], "max_tokens": 300, "stream": True, "ignore_eos": True}
    aborted = _metric(url, "causal_adapter:request_success_total", finished_reason="abort")
    http = httpx.Client(timeout=120)
    cm = http.stream("POST", url + "/v1/completions", json=long)
    response = cm.__enter__()
    lines = response.iter_lines()
    assert next(line for line in lines if line).startswith("data: ")  # it runs
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(_stream_text, client, "b", PROMPTS[0], 60, extra_body={"ignore_eos": True}),
                  pool.submit(lambda: client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=30,
                                                                extra_body={"ignore_eos": True}).choices[0])]
        time.sleep(0.2)
        cm.__exit__(None, None, None)  # the client goes away while the others run beside it
        http.close()
        streamed, plain = others[0].result(), others[1].result()
    want_b = generate(local["b"], PROMPTS[0], tokenizer=qwen_tokenizer, max_new_tokens=60, eos_token_id=[])
    want_a = generate(local["a"], PROMPTS[1], tokenizer=qwen_tokenizer, max_new_tokens=30, eos_token_id=[])
    assert streamed[0] == want_b.texts[0] and plain.text == want_a.texts[0]
    deadline = time.monotonic() + 5
    while _health(url)["running_rows"] or _metric(url, "causal_adapter:request_success_total",
                                                  finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, _health(url)  # the cancelled row left, long before its 300 tokens
        time.sleep(0.05)


def test_a_plain_request_whose_client_goes_away_stops_decoding(url):
    """A non-streaming completion (4000 tokens, eos ignored: seconds of decoding) whose client closes the connection
    while its row runs: the row leaves the batch at once and the request is counted as aborted, as a stream's is."""
    import socket
    from urllib.parse import urlsplit

    aborted = _metric(url, "causal_adapter:request_success_total", finished_reason="abort")
    body = json.dumps({"model": "a", "prompt": PROMPTS[2], "max_tokens": 4000, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:  # plain HTTP: closed at will
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while not _health(url)["running_rows"]:
            assert time.monotonic() < deadline, _health(url)
            time.sleep(0.02)
        time.sleep(0.2)  # it decodes; then the client goes away without reading an answer
    deadline = time.monotonic() + 5
    while _health(url)["running_rows"] or _metric(url, "causal_adapter:request_success_total",
                                                  finished_reason="abort") == aborted:
        assert time.monotonic() < deadline, json.dumps(_health(url))  # its row left, long before its 4000 tokens
        time.sleep(0.05)
    assert _health(url)["accepted"] == 0 and _health(url)["waiting"] == 0  # nothing of it is left


def test_time_to_first_token_is_taken_at_the_first_token(client, url):
    """The TTFT histogram observes a request's first token, not its last: for a 200-token stream it is within the
    client's wait for its first chunk (the server's clock starts later, at the request's arrival, and stops before the
    chunk is sent), far below the stream's whole time."""
    name = "causal_adapter:time_to_first_token_seconds"
    count, total = _metric(url, name + "_count"), _metric(url, name + "_sum")
    t0 = time.perf_counter()
    first = None
    for _ in client.completions.create(model="a", prompt=PROMPTS[2], max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True}):
        first = first or time.perf_counter() - t0
    whole = time.perf_counter() - t0
    assert _metric(url, name + "_count") == count + 1
    ttft = _metric(url, name + "_sum") - total
    assert 0 < ttft <= first + 0.05, (ttft, first, whole)
    assert ttft < whole / 2, (ttft, first, whole)


def test_an_adapter_loaded_and_unloaded_while_rows_run(client, local, qwen_tokenizer, url, adapters):
    """Runtime loading between two steps: rows of `a` keep running while `c2` (a copy of a) is loaded and answers;
    unloading c2 while its row runs: new requests get 404 at once, the running row finishes whole, then it goes."""
    first = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(_stream_text, client, "a", PROMPTS[3], 150, first, extra_body={"ignore_eos": True})
        assert first.wait(60)
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "c2", "lora_path": "c"})
        assert r.status_code == 200 and not running.done()  # loaded while a's row runs
        c2 = client.completions.create(model="c2", prompt=PROMPTS[1], max_tokens=5).choices[0]
        assert c2.text == expected(local["a"], qwen_tokenizer, PROMPTS[1], 5)[0]
        first.clear()
        c2_running = pool.submit(_stream_text, client, "c2", PROMPTS[0], 150, first, extra_body={"ignore_eos": True})
        assert first.wait(60)
        unload = pool.submit(post, url, "/v1/unload_lora_adapter", {"lora_name": "c2"})
        deadline = time.monotonic() + 10
        while "c2" in _health(url)["adapters"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.NotFoundError):  # gone for new requests at once
            client.completions.create(model="c2", prompt="x", max_tokens=2)
        text, last = c2_running.result()
        assert unload.result().status_code == 200
        assert text == generate(local["a"], PROMPTS[0], tokenizer=qwen_tokenizer, max_new_tokens=150,
                                eos_token_id=[]).texts[0] and last.finish_reason == "length"
        assert running.result()[0] == generate(local["a"], PROMPTS[3], tokenizer=qwen_tokenizer, max_new_tokens=150,
                                               eos_token_id=[]).texts[0]
    assert "c2" not in {m.id for m in client.models.list().data}


def test_chats_sharing_a_system_prompt_reuse_its_cache(client, local, qwen_tokenizer, url):
    system = {"role": "system", "content": "You answer with yearly sunspot numbers only, one per line, no words. " * 3}
    before = _health(url)
    for question in ("Sunspots in 1975?", "And in 1976?", "What about 1980?"):
        messages = [system, {"role": "user", "content": question}]
        got = client.chat.completions.create(model="a", messages=messages, max_tokens=4).choices[0].message.content
        assert got == expected(local["a"], qwen_tokenizer, inference_prompt(qwen_tokenizer, messages), 4)[0]
    after = _health(url)
    assert after["prefix_reused_tokens"] - before["prefix_reused_tokens"] >= 2 * 48  # the system prompt's blocks


def _metric(url, name, **labels):
    """One sample of /metrics (Prometheus text, read with prometheus-client's parser); 0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_metrics_in_prometheus_text_format(client, url):
    from prometheus_client.parser import text_string_to_metric_families

    tokens = _metric(url, "causal_adapter:generation_tokens_total")
    client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=3, extra_body={"ignore_eos": True})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"causal_adapter:num_requests_waiting", "causal_adapter:num_requests_running",
            "causal_adapter:num_rows_running", "causal_adapter:time_to_first_token_seconds",
            "causal_adapter:inter_token_latency_seconds", "causal_adapter:generation_tokens",
            "causal_adapter:request_success", "causal_adapter:http_requests"} <= names
    assert _metric(url, "causal_adapter:generation_tokens_total") == tokens + 3
    assert _metric(url, "causal_adapter:time_to_first_token_seconds_count") >= 1
    assert _metric(url, "causal_adapter:inter_token_latency_seconds_count") >= 2
    assert _metric(url, "causal_adapter:http_requests_total", route="/v1/completions", status="404") >= 1
    assert _metric(url, "causal_adapter:http_requests_total", route="/v1/completions", status="200") >= 1
    assert _metric(url, "causal_adapter:request_success_total", finished_reason="length") >= 1
    assert _metric(url, "causal_adapter:num_rows_running") == 0


def test_predict_equals_the_predict_command(url, adapters, local, qwen_tokenizer, tmp_path, capsys):
    data, out = tmp_path / "rows.jsonl", tmp_path / "pred.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:4]))
    assert main(["predict", str(adapters["a"]), *TINY_FLAGS, "--data-file", str(data), "--output", str(out)]) == 0
    cli = [json.loads(line) for line in out.read_text().splitlines()]
    r = post(url, "/v1/predict", {"model": "a", "prompts": PROMPTS[:4]})
    assert r.status_code == 200
    assert r.json()["data"] == cli  # the same rows, columns and floats
    chats = [[{"role": "user", "content": "Sunspots in 1975?"}, {"role": "assistant", "content": "It was 15.5 then"}],
             [{"role": "user", "content": "And in 1976?"}]]
    r = post(url, "/v1/predict", {"model": "b", "messages": chats, "levels": [0.9]})
    prompts = [inference_prompt(qwen_tokenizer, c, to_first_number=True) for c in chats]
    assert r.json()["data"] == local["b"].predict_values(prompts, tokenizer=qwen_tokenizer, levels=[0.9])
    assert r.json()["data"][0]["upper_90"] == float("inf")  # 8 calibration rows cannot bound 90%: JSON's Infinity
    assert list(r.json()["data"][0]) == ["row", "value", "scale", "p_num", "lower_90", "upper_90", "raw_lower_90",
                                         "raw_upper_90", "series", "support", "transform"]


def test_a_stream_keeps_writing_while_a_horizon_runs_beside_it(client, local, qwen_tokenizer):
    """A horizon of 100 paths x 12 steps (its lanes: rows of the running batch, `serving.horizons`) sent while a
    stream runs: the stream's tokens keep arriving while the horizon is still running (the worker ran the whole
    horizon between two of the stream's steps before: no token in between), and both answers are what they are
    alone (the stream's text `generate`'s, the horizon `predict_horizon`'s in-process)."""
    prompt = "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6; 1972:"
    conts = [f"; {1973 + h}:" for h in range(11)]
    body = {"model": "a", "prompts": [prompt], "horizon": 12, "paths": 100, "continuations": [conts], "seed": 5}
    first, times, answer = threading.Event(), [], {}

    def horizon():
        first.wait(60)
        answer["sent"] = time.perf_counter()
        answer["rows"] = client.post("/predict", cast_to=object, body=body)
        answer["done"] = time.perf_counter()

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(horizon)
        text = ""
        for chunk in client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            times.append(time.perf_counter())
            first.set()
        job.result()
    during = [t for t in times if answer["sent"] < t < answer["done"]]
    assert len(during) >= 10, (len(during), len(times), answer["done"] - answer["sent"])
    assert times[-1] > answer["done"]  # the stream was still running when the horizon answered
    ref = generate(local["a"], PROMPTS[1], tokenizer=qwen_tokenizer, max_new_tokens=400, eos_token_id=[])
    assert text == ref.texts[0]
    want = local["a"].predict_horizon([prompt], tokenizer=qwen_tokenizer, horizon=12, paths=100,
                                      continuations=[conts], seed=5)
    got = answer["rows"]["data"]
    for g, w in zip(got[0]["horizon"], want[0]["horizon"]):  # float rounding of another batch shape
        g.pop("calibrated"), g.pop("intervals")
        assert g == pytest.approx(w, rel=1e-4)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("body, status, names", [
    (b'{"model": "a", "prompt": "x",', 400, "not valid JSON"),
    ({"model": "nope", "prompt": "x"}, 404, "'nope' does not exist"),
    ({"model": "a", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "a", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "a", "prompt": 12}, 400, "prompt"),
    ({"model": "a", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "a", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "a", "prompt": "x", "max_tokns": 5}, 400, "max_tokns"),
    ({"model": "a", "prompt": "hello " * 4100, "max_tokens": 4}, 400, "context"),
    ({"model": "a", "prompt": "x", "mode": "greedy"}, 400, "mode"),
    ({"model": "a", "prompt": "x", "mode": "causal", "temperature": 0.7}, 400, "temperature"),
    ({"model": "a", "prompt": "x", "levels": [0.5, 1.5]}, 400, "levels"),
    ({"model": "a", "prompt": "x", "logprobs": 21}, 400, "logprobs"),  # above the limit (test_serve_logprobs.py)
    ({"model": "a", "prompt": ""}, 400, "prompt"),
])
def test_bad_input_gets_a_4xx_naming_the_problem(url, client, body, status, names):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert names in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert client.completions.create(model="a", prompt="x", max_tokens=2).choices[0].finish_reason  # still serving


def test_bad_input_through_the_openai_client(client, url):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|more than the model's context"):
        client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi " * 4000}], max_tokens=200)
    r = post(url, "/v1/predict", {"model": "a", "prompts": ["x"], "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "one way" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", content=b"model=a", timeout=30).status_code == 400


# --------------------------------------------------------------------------- runtime loading
def test_runtime_loading_is_confined_to_its_root(url, client, adapters, local, qwen_tokenizer):
    root = adapters["root"]
    for path in (str(adapters["b"]), "../b", "elsewhere", str(root / "elsewhere")):  # outside, also through a link
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        message = r.json()["error"]["message"]
        assert r.status_code == 403 and "outside" in message and "(directory check:" in message, path
        assert "file check" not in message and r.json()["error"]["code"] == "path_not_allowed"
    # the directory is inside the root, one of its files links out of it: the file check refuses it
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "linked"})
    message = r.json()["error"]["message"]
    assert r.status_code == 403 and "file check" in message and "directory check" not in message
    assert "'causal_adapter_model.safetensors' is a link to" in message and str(adapters["b"].resolve()) in message
    assert "x" not in {m.id for m in client.models.list().data}
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "empty"})
    assert r.status_code == 400 and "causal_adapter_config.json' is missing" in r.json()["error"]["message"]
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(root / "c")})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "c"}).status_code == 400  # twice
    assert "c" in {m.id for m in client.models.list().data}
    text = client.completions.create(model="c", prompt=PROMPTS[1], max_tokens=4).choices[0].text
    assert text == expected(local["a"], qwen_tokenizer, PROMPTS[1], 4)[0]  # c is a copy of a
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="x", max_tokens=2)
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 404
    assert "c" not in {m.id for m in client.models.list().data}
    assert client.completions.create(model="a", prompt=PROMPTS[1], max_tokens=4).choices[0].text == text


# --------------------------------------------------------------------------- the second server: key, queue, shutdown
def test_api_key_is_required(servers):
    tight = servers["tight"].url
    assert httpx.get(tight + "/health").status_code == 200  # open
    assert httpx.get(tight + "/v1/models").status_code == 401
    r = httpx.get(tight + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tight + "/v1", api_key="wrong", max_retries=0).completions.create(model="a", prompt="x")
    # the whole key or nothing: a proper prefix of it, a bare "Bearer", the key with a tail or without its scheme
    # ("Bearer " with a trailing space is no legal header value: httpx refuses to send it)
    for auth in (f"Bearer {KEY[:3]}", f"Bearer {KEY[:-1]}", "Bearer", f"Bearer {KEY}x", KEY, f"Basic {KEY}"):
        r = httpx.get(tight + "/v1/models", headers={"Authorization": auth})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", auth
    assert httpx.get(tight + "/v1/models", headers={"Authorization": f"bearer  {KEY}"}).status_code == 200
    good = openai.OpenAI(base_url=tight + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="a", prompt="x", max_tokens=2).choices[0].text is not None
    # runtime loading was not enabled: refused, naming the flag
    r = httpx.post(tight + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/tmp"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 403 and "--runtime-adapter-root" in r.json()["error"]["message"]


def test_runtime_root_allows_a_link_that_stays_inside(adapters, tmp_path):
    """The file check refuses links out of the root, not links: a file linked to another file under the root loads."""
    from causal_adapter.serving.scheduler import RequestError
    from causal_adapter.serving.registry import runtime_path

    root = tmp_path / "root"
    shutil.copytree(adapters["a"], root / "inside")
    (root / "inside" / "README.md").unlink()
    (root / "inside" / "README.md").symlink_to(root / "inside" / "causal_adapter_config.json")
    assert runtime_path(root, "inside") == (root / "inside").resolve()
    (root / "inside" / "deep").mkdir()
    (root / "inside" / "deep" / "x.json").symlink_to(adapters["b"] / "causal_adapter_config.json")
    with pytest.raises(RequestError, match=r"'deep/x.json' is a link to .*file check") as e:
        runtime_path(root, "inside")
    assert e.value.status == 403


def _long_stream(url, max_tokens):
    """A streaming request that generates `max_tokens` tokens (eos ignored), and the first line of its answer."""
    client = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"})
    cm = client.stream("POST", url + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": max_tokens,
                                                              "stream": True, "ignore_eos": True})
    response = cm.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    first = next(line for line in lines if line)
    return client, cm, lines, first


def _health(url):
    return httpx.get(url + "/health").json()


def test_full_queue_answers_503_and_a_gone_client_frees_its_slot(servers):
    tight = servers["tight"].url
    auth = {"Authorization": f"Bearer {KEY}"}
    small = {"model": "a", "prompt": "x", "max_tokens": 2}
    client, cm, _, first = _long_stream(tight, 4000)  # would hold the one slot for 10 s and more
    assert first.startswith("data: ")
    r = httpx.post(tight + "/v1/completions", json=small, headers=auth)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
    cm.__exit__(None, None, None)  # the client goes away mid-stream
    client.close()
    deadline = time.monotonic() + 3
    while _health(tight)["accepted"] or _health(tight)["running"]:  # slot freed, generation stopped early
        assert time.monotonic() < deadline, _health(tight)
        time.sleep(0.05)
    assert httpx.post(tight + "/v1/completions", json=small, headers=auth).status_code == 200


def test_a_failing_job_fails_alone_and_the_worker_goes_on(adapters, qwen_tokenizer):
    """The scheduler and the engine in-process, on the real model: a job that raises gets a 500, the generation
    requests around it are answered, the slots are all freed."""
    import asyncio

    from causal_adapter.serving.engine import CallSpec, Decoding, Engine, GenerateSpec
    from causal_adapter.serving.registry import Registry, load_adapters
    from causal_adapter.serving.scheduler import Job, Scheduler

    model = load_adapters(tiny_base(), qwen_tokenizer, {"a": adapters["a"]})
    registry = Registry(None, None)
    registry.add("a", adapters["a"])
    engine = Engine(model, qwen_tokenizer, registry, max_batch_size=4)

    def boom(model):
        raise RuntimeError("boom")

    loop = asyncio.new_event_loop()
    scheduler = Scheduler(engine, max_queue=8, batch_wait_s=0.05)
    jobs = [Job("generate", GenerateSpec("a", Decoding(), prompts=[PROMPTS[1]], max_tokens=3)),
            Job("call", CallSpec(boom)),
            Job("generate", GenerateSpec("a", Decoding(), prompts=[PROMPTS[2]], max_tokens=2))]
    for j in jobs:
        scheduler.submit(j.attach(loop))
    scheduler.start()
    scheduler.close()
    loop.run_until_complete(asyncio.sleep(0))
    ends = []
    for j in jobs:
        events = [j.events.get_nowait() for _ in range(j.events.qsize())]
        ends += [e for e in events if e[0] in ("done", "error")]
    assert [e[0] for e in ends] == ["done", "error", "done"]
    assert ends[1][1].status == 500 and "boom" in ends[1][1].message
    assert ends[0][1]["completion_tokens"] == 3 and scheduler.stats()["accepted"] == 0
    loop.close()


def test_serve_errors_at_startup_are_one_line(adapters, tmp_path, capsys, monkeypatch, qwen_tokenizer):
    from causal_adapter import get_causal_model
    from causal_adapter.saving.assets import build_tiny_qwen

    other = tmp_path / "qwen3"
    qwen3 = build_tiny_qwen("qwen3", hidden_size=32, num_layers=1)
    get_causal_model(qwen3, tokenizer=qwen_tokenizer).save_pretrained(other)
    for args, message in (
            ([f"a={adapters['a']}", f"x={other}"], "different bases"),
            ([f"a={adapters['a']}", f"a={adapters['b']}"], "given twice"),
            ([f"a.b={adapters['a']}"], "adapter name"),
            ([str(adapters["a"])], "NAME=DIR")):
        assert main(["serve", *[x for a in args for x in ("--adapter", a)]]) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) <= 2, err
    assert main(["serve", "--adapter", f"a={adapters['a']}", "--adapter", f"x={other}", "--tiny-hidden-size", "32",
                 "--tiny-layers", "1"]) == 1
    assert "adapter 'x'" in capsys.readouterr().err  # the base given by flags: the misfit adapter is named
    monkeypatch.setitem(__import__("sys").modules, "fastapi", None)
    assert main(["serve", "--adapter", f"a={adapters['a']}"]) == 1
    assert 'pip install "causal_adapter[serve]"' in capsys.readouterr().err


def test_graceful_shutdown_finishes_the_request_in_flight(servers):
    """SIGTERM while a request streams: the server stops only after that request got all its tokens."""
    server = servers["tight"]
    client, cm, lines, first = _long_stream(server.url, 400)
    server.proc.send_signal(signal.SIGTERM)
    rest = [line for line in lines if line]
    cm.__exit__(None, None, None)
    client.close()
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in [first] + rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)


def test_streamed_deltas_join_to_generate_text_on_any_tokens(qwen_tokenizer):
    """The streaming decoder (`RowText`: segments of decoded tokens, kept once whole; `streamable`: what may be sent)
    against `generate`'s own decode, on random rows: words, numbers side by side, special tokens, tokens that end
    mid-character, a number ending the prompt; and a stop string is never sent, not even its first characters."""
    import random

    import torch

    from causal_adapter.modeling.generation.stream import decode_continuation  # GenerationOutput.texts' decode
    from causal_adapter.modeling.generation.stream import RowText, streamable

    ntok = NumberTokenizer(qwen_tokenizer)
    rng = random.Random(0)
    partial = [i for i in range(2000, 60000, 7) if "\ufffd" in qwen_tokenizer.decode([i])][:50]
    streamed = total = 0
    for trial in range(120):
        ids, values = [], []
        for _ in range(rng.randint(1, 90)):
            r = rng.random()
            tok, v = ((ntok.num_token_id, round(rng.uniform(-999, 999), rng.randint(0, 2))) if r < 0.25 else
                      (rng.choice(partial), 0.0) if r < 0.4 else (rng.choice([151643, 151645]), 0.0) if r < 0.43 else
                      (rng.randint(0, 151000), 0.0))
            ids.append(tok)
            values.append(v)
        prompt, prompt_values = ([ntok.num_token_id], [12.5]) if trial % 2 else ([785], [0.0])
        text = decode_continuation(ntok, torch.tensor(ids), torch.tensor(values, dtype=torch.float64), prompt[-1],
                                   prompt_values[-1])
        stop = text[len(text) // 2:len(text) // 2 + 2] if trial % 3 == 0 and len(text) > 4 else None
        stops = (stop,) if stop and "\ufffd" not in stop else ()
        row = RowText(ntok, prompt[-1], prompt_values[-1])
        row.SEGMENT = rng.choice([1, 3, 32])
        sent = ""
        for tok, v in zip(ids, values):
            grown = row.add(tok, v)
            assert text.startswith(grown.rstrip("\ufffd"))  # the row's text so far, as the final decode has it
            safe = streamable(grown, stops)
            sent = grown[:max(safe, len(sent))]
            if stops and stops[0] in grown:
                break  # the row stops on the token that completes its stop string
        final = text[:text.index(stops[0])] if stops else text
        assert final.startswith(sent) and not (stops and stops[0][0] in sent[len(final) - len(stops[0]):] and
                                                 stops[0] in sent), (trial, sent[-30:], final[-30:])
        streamed, total = streamed + len(sent), total + len(final)
    assert streamed > 0.9 * total  # held back: the start of a stop string, a character not finished yet
