"""`causal-adapter serve` under load (docs/serving.md): step-level scheduling (continuous batching) against tick batching
(the scheduling before it, `--scheduler tick`), in one run, with the figures servers are judged by: throughput, TTFT
(time to first token) p50 / p99 and ITL (inter-token latency) p50 / p99, measured by the clients on streamed answers.

    python benchmarks/serving.py                                              # CPU: embedded tiny Qwen2, h256, 4 layers
    python benchmarks/serving.py --hidden-size 896 --layers 8 --device cuda   # GPU (about 2 minutes on an H100)
    python benchmarks/serving.py --engine vllm --vllm-python vllm-venv/bin/python   # ours against vLLM's server

Two adapters on one base, requests alternating between them, prompts of 12 yearly sunspot counts (each phase its
own: no shared prefix outside phase 5); servers ``step`` (the default), ``tick`` (`--scheduler tick`) and, in phase 5,
``step`` with `--no-prefix-cache`, each its own process, `--max-batch-size 32` (docs/serving.md, "Load and speed").
Phases:

1. idle: short requests (16 tokens) streamed one at a time to the step server: the TTFT of an idle server (p50, the
   mean of two measures: before phase 2 and before phase 3).
2. equal: 32 clients, each sending --requests greedy completions of 16 tokens one after the other, to each server,
   then in-process `generate_batched` of the same requests at batch 32 (the two adapters mixed, as served), in turn
   for --rounds rounds (new prompts each round), the best of each kept: served tokens/s over in-process tokens/s
   (target >= 0.9 for step). The step server's capacity (requests/s of the mixed lengths below) follows from it.
3. mixed lengths: streamed requests arriving as a Poisson process, output lengths mixed (half 16 tokens, half
   log-uniform in 32..256; eos ignored, so every request writes exactly its length), the same arrivals and lengths
   for both servers, at two rates: the latency run at --load times the capacity (--poisson-requests requests; target:
   the short requests' TTFT p50 on step <= 2x the idle TTFT) and the throughput run at --burst times the capacity
   (--burst-requests requests, more than either server can take: target step / tick throughput >= 1.5). Below its
   capacity a server's throughput is the offered rate, whatever its scheduling; above it, the scheduling decides.
   Throughput = tokens / (last answer - first request); TTFT of all and of the short requests; ITL between two
   streamed chunks.
4. load: 64 clients x 4 requests to the step server: every request must come back 200 (0 lost, 0 5xx).
5. prefix: the bundled chat corpus' test conversations (up to their last user turn; 16 tokens each) as chat
   completions to one adapter (a chat application), arriving at --chat-load times the capacity, to the step server with its prefix cache and to one without:
   prompt tokens computed and read from the cache (/health), TTFT p50 / p99 with and without.

Ends with ``RESULT key=value ...`` and one ``TARGET`` line per target (PASS / FAIL).

    python benchmarks/serving.py --horizon-itl    # alone: 4 streams' ITL with and without a horizon beside them

--horizon-itl: 4 streams of 256 tokens to the step server, alone and with a horizon (/v1/predict, 100 paths x 12
steps, its lanes rows of the running batch) sent once they write, twice each way in turn: their ITL p50 and longest
gap each way (the run of the smaller p50), and the horizon's seconds.

--engine vllm (docs/serve_at_scale.md, "Speed"): one adapter on the tiny base (saved), exported (softmax) and served by
vLLM and by us, one at a time in turn for --rounds rounds, the best of each: idle TTFT (8 streamed requests) and the
equal phase (32 clients). ``RESULT engine=vllm ...``: both and their ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from causal_adapter.commands.serve import keep_large_blocks
from common import free_port


HEADERS = ("Yearly sunspot numbers.", "Sunspot counts by year:", "Annual mean sunspot number.", "Wolf numbers, yearly.",
           "Sunspots per year (SILSO).")


def sunspot_prompts(n: int) -> list[str]:
    """n prompts (up to 1,480) that share no 16-token prefix: windows of 12 yearly counts (296 starts) under five
    headers, so no phase reads another's prompts from the prefix cache."""
    import statsmodels.api as sm

    df = sm.datasets.sunspots.load_pandas().data
    years, values = df["YEAR"].astype(int).tolist(), df["SUNACTIVITY"].tolist()
    starts = len(years) - 13
    if n > len(HEADERS) * starts:
        raise ValueError(f"at most {len(HEADERS) * starts} distinct prompts")
    prompts = []
    for i in range(n):
        s = (i * 7) % starts
        window = ", ".join(f"{years[j]}: {values[j]:.1f}" for j in range(s, s + 12))
        prompts.append(f"{HEADERS[i // starts]} {window}, {years[s + 12]}:")
    return prompts


def chat_requests(n: int) -> list[list[dict]]:
    """The chat corpus' test conversations up to their last user turn (what a client sends)."""
    from causal_adapter.data.corpora import chat_corpus

    rows = chat_corpus()["test"]["messages"][:n]
    return [m[:max(i for i, x in enumerate(m) if x["role"] == "user") + 1] for m in rows]


def make_adapters(directory: Path, hidden_size: int, layers: int, save_base: bool = False) -> list[Path]:
    """Two saved adapters on the embedded tiny base; save_base: the base too, with the real tokenizer, in .../base."""
    import torch

    from causal_adapter import CausalAdapterConfig, get_causal_model
    from causal_adapter.saving.assets import load_base

    base, tokenizer = load_base(None, "qwen2", "float32", hidden_size, layers)
    if save_base:
        base.save_pretrained(directory / "base")
        tokenizer.save_pretrained(directory / "base")
    paths = []
    for i in range(2):
        model = get_causal_model(base, CausalAdapterConfig(num_token_id=len(tokenizer), seed=i, value_loc=80.0,
                                                           value_scale=40.0 + 10 * i), tokenizer=tokenizer)
        with torch.no_grad():
            g = torch.Generator().manual_seed(i)
            model.abduction.loc.weight.add_(0.02 * torch.randn(model.abduction.loc.weight.shape, generator=g))
        paths.append(model.save_pretrained(directory / f"adapter{i}"))
    return paths


def start_server(paths: list[Path], extra: list[str], args, vllm: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Ours of `paths` (a0, a1, ...), or vLLM's of the folder `vllm` (its worker's threads on all cores, as ours)."""
    port, env, log = free_port(), dict(os.environ), tempfile.TemporaryFile("w+")  # a pipe nobody reads would fill
    cmd = [sys.executable, "-m", "causal_adapter", "serve", "--port", str(port), "--max-batch-size", "32",
           "--max-queue", "1024", "--log-level", "warning", *extra]
    cmd += [] if "--base" in extra else ["--tiny-hidden-size", str(args.hidden_size), "--tiny-layers", str(args.layers)]
    cmd += [f"--adapter=a{i}={p}" for i, p in enumerate(paths)] + (["--device", args.device] if args.device else [])
    if vllm:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm), "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--tokenizer-mode", "causal_adapter",
               "--served-model-name", "causal", "--max-num-seqs", "32"]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM reserves 92% of the machine's memory
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited: {log.read()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:  # not listening yet (urllib's URLError is an OSError)
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not come up in 600 s")


# ----------------------------------------------------------------------------- one request
async def request(http, url: str, body: dict, chat: bool = False) -> dict:
    """One streamed request: status, tokens, TTFT (s, from the send), the gaps between streamed chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    t0 = time.perf_counter()
    stamps, tokens, status = [], 0, None
    try:
        async with http.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
            status = r.status
            if status != 200:
                await r.read()
                return {"status": status, "tokens": 0, "ttft": None, "gaps": [], "end": time.perf_counter()}
            async for raw in r.content:  # the server-sent events, a line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - counted as lost
        return {"status": None, "error": repr(e), "tokens": 0, "ttft": None, "gaps": [], "end": time.perf_counter()}
    return {"status": status, "tokens": tokens, "ttft": stamps[0] - t0 if stamps else None,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "end": time.perf_counter(), "start": t0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return math.nan
    return statistics.median(xs) if q == 0.5 else xs[min(len(xs) - 1, int(q * len(xs)))]


def client(timeout: float = 900):
    """The load generator's HTTP client: aiohttp, as vLLM's serving benchmark. It shares the machine's cores with the
    server; httpx spent 1.3 ms of CPU per request here, aiohttp 0.24 (docs/serving.md)."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout),
                                 connector=aiohttp.TCPConnector(limit=0))  # no cap on connections: one per client


async def health(http, url: str) -> dict:
    async with http.get(url + "/health") as r:
        return await r.json()


# ----------------------------------------------------------------------------- phases
async def idle_ttft(url: str, prompts: list[str], n: int = 8, models: tuple = ("a0", "a1")) -> float:
    async with client() as http:
        out = [await request(http, url, {"model": models[i % len(models)], "prompt": prompts[i], "max_tokens": 16,
                                         "ignore_eos": True}) for i in range(n)]
    return pct([r["ttft"] for r in out], 0.5)


async def closed_loop(url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int,
                      models: tuple = ("a0", "a1"), counters: bool = True) -> dict:
    """`clients` clients, each sending `per_client` non-streamed requests in turn; counters: from /health (ours)."""
    import aiohttp

    results = []

    async def one_client(c: int, http) -> None:
        for k in range(per_client):
            i = c * per_client + k
            body = {"model": models[i % len(models)], "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            try:
                async with http.post(url + "/v1/completions", json=body) as r:
                    tokens = (await r.json())["usage"]["completion_tokens"] if r.status == 200 else 0
                    results.append({"status": r.status, "tokens": tokens, "latency": time.perf_counter() - t0})
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                results.append({"status": None, "tokens": 0, "error": repr(e)})

    async with client() as http:
        before = await health(http, url) if counters else {}
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(c, http) for c in range(clients)))
        wall = time.perf_counter() - t0
        after = await health(http, url) if counters else {}
    n, tokens = clients * per_client, sum(r["tokens"] for r in results)
    out = {"tokens_per_s": tokens / wall, "rps": len(results) / wall, "ok": sum(r["status"] == 200 for r in results),
           "lost": n - sum(r["status"] is not None for r in results), "sent": n,
           "status_5xx": sum((r["status"] or 0) >= 500 for r in results)}
    if counters:
        out.update(rows_per_step=tokens / max(1, after["steps"] - before["steps"]),
                   rows=after["generated_rows"] - before["generated_rows"])
    return out


def poisson_schedule(n: int, rate: float, seed: int = 0) -> tuple[list[float], list[int]]:
    """(arrival times in s, output lengths): half 16 tokens, half log-uniform in 32..256."""
    rng = random.Random(seed)
    t, times, lengths = 0.0, [], []
    for i in range(n):
        t += rng.expovariate(rate)
        times.append(t)
        lengths.append(16 if i % 2 == 0 else int(round(math.exp(rng.uniform(math.log(32), math.log(256))))))
    return times, lengths


async def poisson(url: str, bodies: list[dict], times: list[float], chat: bool = False) -> dict:
    async with client() as http:
        before = await health(http, url)
        t0 = time.perf_counter()

        async def at(t: float, body: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            return await request(http, url, body, chat)

        out = await asyncio.gather(*(at(t, b) for t, b in zip(times, bodies)))
        after = await health(http, url)
    ok = [r for r in out if r["status"] == 200]
    span = max(r["end"] for r in out) - t0
    short = [r for r, b in zip(out, bodies) if b.get("max_tokens") == 16 and r["status"] == 200]
    gaps = [g for r in ok for g in r["gaps"]]
    return {"tokens_per_s": sum(r["tokens"] for r in ok) / span, "ok": len(ok), "sent": len(out),
            "ttft_p50": pct([r["ttft"] for r in ok], 0.5), "ttft_p99": pct([r["ttft"] for r in ok], 0.99),
            "short_ttft_p50": pct([r["ttft"] for r in short], 0.5), "short_ttft_p99": pct([r["ttft"] for r in short], 0.99),
            "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99),
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "reused_tokens": after["prefix_reused_tokens"] - before["prefix_reused_tokens"]}


async def horizon_itl(url: str, prompts: list[str], horizon: bool) -> dict:
    """The ITL p50 and longest gap of 4 streams, with a horizon of 100 paths x 12 steps sent beside them or not."""
    async with client() as http:
        streams = [asyncio.ensure_future(request(http, url, {"model": "a0", "prompt": p, "max_tokens": 256,
                                                             "ignore_eos": True})) for p in prompts[:4]]
        took = math.nan
        if horizon:
            await asyncio.sleep(0.3)  # the streams write
            body = {"model": "a0", "prompts": prompts[4:5], "horizon": 12, "paths": 100,
                    "continuations": [[f", {1990 + h}:" for h in range(11)]]}
            t0 = time.perf_counter()
            async with http.post(url + "/v1/predict", json=body) as r:
                assert r.status == 200, await r.text()
            took = time.perf_counter() - t0
        gaps = [g for r in await asyncio.gather(*streams) for g in r["gaps"]]
    return {"p50": pct(gaps, 0.5), "max": max(gaps), "horizon_s": took}


class InProcess:
    """The same base and adapters in this process: generate_batched at batch 32, the two adapters alternating."""

    def __init__(self, paths: list[Path], args):
        import torch

        from causal_adapter import CausalModel
        from causal_adapter.saving.assets import load_base

        base, self.tokenizer = load_base(None, "qwen2", "float32", args.hidden_size, args.layers)
        self.model = CausalModel.from_pretrained(base, paths[0], tokenizer=self.tokenizer, adapter_name="a0")
        self.model.load_adapter(paths[1], "a1", tokenizer=self.tokenizer)
        self.model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        self.tokens_per_s(["warm-up"] * 4, 2)

    def tokens_per_s(self, prompts: list[str], max_tokens: int) -> float:
        import torch

        names = [f"a{i % 2}" for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = self.model.generate_batched(prompts, self.tokenizer, batch_size=32, adapter_names=names,
                                           max_new_tokens=max_tokens, eos_token_id=[])
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        return sum(int(o.lengths[0]) for o in outs) / (time.perf_counter() - t0)


def line(name: str, r: dict) -> str:
    return " ".join([f"{name:22s}"] + [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default=None, help="the servers' --device (default: theirs)")
    ap.add_argument("--requests", type=int, default=4, help="equal phase: requests per client (32 clients)")
    ap.add_argument("--rounds", type=int, default=4, help="equal phase: rounds per server, the best kept")
    ap.add_argument("--poisson-requests", type=int, default=64, help="latency run: requests")
    ap.add_argument("--rate", type=float, default=None, help="latency run: arrivals per second (default: --load x "
                                                               "the step server's capacity)")
    ap.add_argument("--load", type=float, default=0.6, help="latency run: the rate as a fraction of the capacity")
    ap.add_argument("--burst", type=float, default=2.5, help="throughput run: the rate as a multiple of the capacity")
    ap.add_argument("--burst-requests", type=int, default=96)
    ap.add_argument("--chat-requests", type=int, default=226, help="prefix phase: chat corpus test conversations")
    ap.add_argument("--chat-load", type=float, default=0.3,
                    help="prefix phase: the rate as a fraction of the capacity at 16 tokens per request (chat prompts "
                         "are three times longer than the sunspot ones: their prefill is a larger part of the work)")
    ap.add_argument("--horizon-itl", action="store_true", help="only the streams' ITL beside a horizon (docstring)")
    ap.add_argument("--engine", default="ours", choices=["ours", "vllm"], help="vllm: ours against vLLM (docstring)")
    ap.add_argument("--vllm-python", default=sys.executable, help="--engine vllm: a python with vllm (and us)")
    args = ap.parse_args()
    keep_large_blocks()  # the allocator settings of the servers (commands/serve.py), for the in-process baseline too
    per_round = 32 * args.requests
    pool = iter(sunspot_prompts(1480))  # each phase its own prompts: none reads another's from the prefix cache

    def take(n: int) -> list[str]:
        return [next(pool) for _ in range(n)]

    res: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(Path(tmp), args.hidden_size, args.layers, save_base=args.engine == "vllm")
        servers = {}
        try:
            if args.engine == "vllm":
                return versus_vllm(Path(tmp), paths[0], servers, take, args)
            if args.horizon_itl:
                servers["step"] = start_server(paths, [], args)
                asyncio.run(closed_loop(servers["step"][1], take(4), 4, 1, 4))  # warm-up
                r = {}
                for k in ("alone", "with") * 2:  # alternated, the smaller p50 of each kept: the machine's noise
                    x = asyncio.run(horizon_itl(servers["step"][1], take(5), k == "with"))
                    r[k] = x if k not in r or x["p50"] < r[k]["p50"] else r[k]
                print("RESULT " + " ".join(f"itl_{m}_ms_{k}={v[m] * 1000:.1f}" for k, v in r.items()
                                           for m in ("p50", "max")) + f" horizon_s={r['with']['horizon_s']:.2f}")
                return
            servers["step"] = start_server(paths, [], args)
            servers["tick"] = start_server(paths, ["--scheduler", "tick"], args)
            local = InProcess(paths, args)
            for name in servers:  # warm-up
                asyncio.run(closed_loop(servers[name][1], take(4), 4, 1, 4))
            idle = asyncio.run(idle_ttft(servers["step"][1], take(8)))
            print(f"idle                   ttft_p50={idle * 1000:.1f} ms", flush=True)
            for k in range(args.rounds):  # step, tick and in-process in turn: the machine's noise hits them alike
                batch = take(per_round)
                for name in ("step", "tick"):
                    r = asyncio.run(closed_loop(servers[name][1], batch, 32, args.requests, 16))
                    print(line(f"equal {name}", r), flush=True)
                    if f"equal_{name}" not in res or r["tokens_per_s"] > res[f"equal_{name}"]["tokens_per_s"]:
                        res[f"equal_{name}"] = r
                inproc = max(res.get("in_process", {}).get("tokens_per_s", 0.0), local.tokens_per_s(batch, 16))
                res["in_process"] = {"tokens_per_s": inproc}
                print(f"equal in-process       tokens_per_s={inproc:.1f} (best so far)", flush=True)
            del local
            again = asyncio.run(idle_ttft(servers["step"][1], take(8)))  # the idle TTFT again, just before: drift
            print(f"idle (again)           ttft_p50={again * 1000:.1f} ms", flush=True)
            idle = (idle + again) / 2
            capacity = res["equal_step"]["tokens_per_s"] / statistics.mean(poisson_schedule(1000, 1.0)[1])  # req/s
            for seed, (phase, load, n) in enumerate((("latency", args.load, args.poisson_requests),
                                                     ("throughput", args.burst, args.burst_requests))):
                rate = args.rate if args.rate and phase == "latency" else load * capacity
                times, lengths = poisson_schedule(n, rate, seed=seed)
                bodies = [{"model": f"a{i % 2}", "prompt": p, "max_tokens": m, "ignore_eos": True}
                          for i, (p, m) in enumerate(zip(take(n), lengths))]
                for name in ("step", "tick"):
                    res[f"{phase}_{name}"] = r = asyncio.run(poisson(servers[name][1], bodies, times))
                    print(line(f"{phase} {name}", r) + f" rate={rate:.3g}/s", flush=True)
            servers.pop("tick")[0].terminate()
            res["load"] = asyncio.run(closed_loop(servers["step"][1], take(256), 64, 4, 16))
            print(line("load 64x4", res["load"]), flush=True)
            if args.chat_requests:
                chats = chat_requests(args.chat_requests)
                chat_rate = args.chat_load * res["equal_step"]["tokens_per_s"] / 16  # 16 tokens each
                chat_times = poisson_schedule(len(chats), chat_rate, seed=2)[0]
                chat_bodies = [{"model": "a0", "messages": m, "max_tokens": 16, "ignore_eos": True} for m in chats]
                servers["no_prefix"] = start_server(paths, ["--no-prefix-cache"], args)
                asyncio.run(closed_loop(servers["no_prefix"][1], take(4), 4, 1, 4))
                for name, key in (("step", "prefix_on"), ("no_prefix", "prefix_off")):
                    res[key] = asyncio.run(poisson(servers[name][1], chat_bodies, chat_times, chat=True))
                    print(line(f"chat {key}", res[key]) + f" rate={chat_rate:.3g}/s", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    report(res, idle, res["in_process"]["tokens_per_s"], args)


def versus_vllm(tmp: Path, adapter: Path, servers: dict, take, args) -> None:
    """--engine vllm: the idle TTFT and the equal phase, vLLM's server of the exported adapter and ours in turn."""
    subprocess.run([sys.executable, "-m", "causal_adapter", "export-vllm", str(adapter), str(tmp / "out"), "--base",
                    str(tmp / "base")], check=True, stdout=subprocess.DEVNULL)
    servers["vllm"] = start_server([], [], args, vllm=tmp / "out")
    servers["ours"] = start_server([adapter], ["--base", str(tmp / "base")], args)
    models, best = {"vllm": ("causal",), "ours": ("a0",)}, {}
    for name in servers:  # warm-up
        asyncio.run(closed_loop(servers[name][1], take(4), 4, 1, 4, models[name], False))
    for k in range(args.rounds):  # the two in turn, one at a time: the machine's noise hits them alike
        idle, batch = take(8), take(32 * args.requests)
        for name in servers:
            ttft = asyncio.run(idle_ttft(servers[name][1], idle, 8, models[name]))
            r = asyncio.run(closed_loop(servers[name][1], batch, 32, args.requests, 16, models[name], False))
            print(line(f"round {k} {name}", {"idle_ttft_ms": ttft * 1000, **r}), flush=True)
            b = best.setdefault(name, {"ttft": ttft, "tps": r["tokens_per_s"]})
            b.update(ttft=min(b["ttft"], ttft), tps=max(b["tps"], r["tokens_per_s"]))
    v, o = best["vllm"], best["ours"]
    print(f"RESULT engine=vllm vllm_tokens_per_s={v['tps']:.1f} ours_tokens_per_s={o['tps']:.1f} "
          f"vllm_vs_ours_tokens_per_s={v['tps'] / o['tps']:.2f} vllm_idle_ttft_ms={v['ttft'] * 1000:.1f} "
          f"ours_idle_ttft_ms={o['ttft'] * 1000:.1f} vllm_vs_ours_ttft={v['ttft'] / o['ttft']:.2f}")


def report(res: dict, idle: float, inproc: float, args) -> None:
    """The RESULT line and one TARGET line per target."""
    fields = {
        "device": args.device or "default", "idle_ttft_ms": f"{idle * 1000:.1f}",
        "equal_step_tokens_per_s": f"{res['equal_step']['tokens_per_s']:.1f}",
        "equal_tick_tokens_per_s": f"{res['equal_tick']['tokens_per_s']:.1f}",
        "in_process_tokens_per_s_batch32": f"{inproc:.1f}",
        "served_vs_in_process": f"{res['equal_step']['tokens_per_s'] / inproc:.2f}",
        "equal_step_rows_per_step": f"{res['equal_step']['rows_per_step']:.1f}",
        "equal_tick_rows_per_step": f"{res['equal_tick']['rows_per_step']:.1f}",
    }
    for phase in ("latency", "throughput"):
        for name in ("step", "tick"):
            r = res[f"{phase}_{name}"]
            fields.update({f"{phase}_{name}_tokens_per_s": f"{r['tokens_per_s']:.1f}",
                           f"{phase}_{name}_ttft_p50_ms": f"{r['ttft_p50'] * 1000:.0f}",
                           f"{phase}_{name}_ttft_p99_ms": f"{r['ttft_p99'] * 1000:.0f}",
                           f"{phase}_{name}_short_ttft_p50_ms": f"{r['short_ttft_p50'] * 1000:.0f}",
                           f"{phase}_{name}_itl_p50_ms": f"{r['itl_p50'] * 1000:.1f}",
                           f"{phase}_{name}_itl_p99_ms": f"{r['itl_p99'] * 1000:.1f}"})
    thr_s, thr_t = res["throughput_step"], res["throughput_tick"]
    fields.update({"throughput_step_vs_tick": f"{thr_s['tokens_per_s'] / thr_t['tokens_per_s']:.2f}",
                   "short_ttft_vs_idle": f"{res['latency_step']['short_ttft_p50'] / idle:.2f}",
                   "load_ok": res["load"]["ok"], "load_lost": res["load"]["lost"], "load_5xx": res["load"]["status_5xx"]})
    if "prefix_on" in res:
        on, off = res["prefix_on"], res["prefix_off"]
        fields.update({"chat_prefill_tokens_on": on["prefill_tokens"], "chat_prefill_tokens_off": off["prefill_tokens"],
                       "chat_reused_tokens": on["reused_tokens"],
                       "chat_prefill_saved": f"{on['reused_tokens'] / max(1, on['reused_tokens'] + on['prefill_tokens']):.2f}",
                       "chat_ttft_p50_ms_on": f"{on['ttft_p50'] * 1000:.0f}", "chat_ttft_p50_ms_off": f"{off['ttft_p50'] * 1000:.0f}",
                       "chat_ttft_p99_ms_on": f"{on['ttft_p99'] * 1000:.0f}", "chat_ttft_p99_ms_off": f"{off['ttft_p99'] * 1000:.0f}"})
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()))
    for target, ok in (("served tokens/s >= 0.9x in-process generate_batched at 32", float(fields["served_vs_in_process"]) >= 0.9),
                       ("short requests' TTFT p50 <= 2x idle TTFT", float(fields["short_ttft_vs_idle"]) <= 2.0),
                       ("mixed-length throughput >= 1.5x tick batching", float(fields["throughput_step_vs_tick"]) >= 1.5),
                       ("64 clients x 4: 0 lost, 0 5xx", res["load"]["lost"] == 0 and res["load"]["status_5xx"] == 0
                        and res["load"]["ok"] == 256)):
        print(f"TARGET {'PASS' if ok else 'FAIL'}: {target}")


if __name__ == "__main__":
    main()
