"""Benchmark of the OvR classification loss at Qwen2.5-0.5B size (C=896, V=151,936).

Variants, forward + backward, frozen and trainable W (b_cls always trains):
  naive     reference_ovr_loss (materialises [N, V]; skipped when it cannot fit)
  fused     fused_ovr_loss(compile=False): eager elementwise part
  compiled  fused_ovr_loss(compile=True): the elementwise part as one torch.compile'd kernel
            (the default on CUDA for float32 problems of N x V >= 2^24; opt-in on CPU)
  ce        the softmax baseline F.cross_entropy(h @ W.T, labels)
Each measurement runs in its own subprocess (2 threads), rounds interleave the variants, the best time is kept;
extra peak memory is VmHWM above the RSS once the inputs exist; "% sgemm" and "bound" (the least time ratio to CE
an OvR head, with twice CE's matmul flops, can reach at 100% of sgemm): docs/benchmarks.md.

    python benchmarks/ovr_loss.py            # N in 512, 2048, 8192 (~15 min on 2 cores)
    python benchmarks/ovr_loss.py --quick    # small V and N, ~1 min
Prints a table and ends with one line "RESULT key=value ...".

On a GPU (docs/benchmarks.md, "On a GPU"), one process, every variant in turn (`device_main`):

    python benchmarks/ovr_loss.py --device cuda      # N = 8,192 and 65,536; ~1 min on an H100

  ce               F.cross_entropy on bf16 logits, as plain LoRA computes it under autocast (transformers'
                   loss: logits = h @ W.T in bf16 under torch.autocast, upcast to float32, cross-entropy)
  liger            Liger's fused linear cross-entropy (liger-kernel), bf16 h and W
  cce              Apple's Cut Cross-Entropy (cut-cross-entropy), bf16 h and W
  ovr_triton_bf16  fused_ovr_loss(backend="triton", gemm_precision="bf16"); float32 inputs, W float32
                   (--w-dtype bf16: W in bf16, as on a base held in bf16)
  ovr_triton_tf32  the same with gemm_precision="tf32"
  ovr_torch_tf32   fused_ovr_loss(backend="torch", gemm_precision="tf32"): the chunked loop (reference;
                   only N <= --torch-max-n, run after the others)
W frozen and W trainable, forward + backward, best of --repeats after --warmup, CUDA-synchronised; extra memory
from torch.cuda.max_memory_allocated() (the OvR limit: extra <= grads + 32 MiB). A variant that cannot be
installed, imported or fitted is reported and skipped; the RESULT line comes once before the reference
(``complete=0``) and again at the end (``complete=1``). Extras: ``pip install liger-kernel==0.8.5
cut-cross-entropy==25.1.1``. `--device cpu` runs the same path at tiny shapes (a smoke test).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

MIB = 2**20


# --------------------------------------------------------------------------- child side
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _sgemm_rate(T: int, Vc: int, C: int, trainable: bool, repeats: int = 5) -> float:
    """GFLOP/s of the GEMMs one fused block runs, at the block's shapes."""
    import torch

    lu, W, G = torch.randn(T, C), torch.randn(Vc, C), torch.randn(T, Vc)
    out_tv, out_tc, out_vc, bias = torch.empty(T, Vc), torch.zeros(T, C), torch.zeros(Vc, C), torch.zeros(Vc)
    gemms = [lambda: torch.addmm(bias, lu, W.T, out=out_tv), lambda: out_tc.addmm_(G, W)]
    if trainable:
        gemms.append(lambda: out_vc.addmm_(G.T, lu))
    total = 0.0
    for f in gemms:
        f()
        best = min(_timed(f) for _ in range(repeats))
        total += best
    return len(gemms) * 2 * T * Vc * C / total / 1e9


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def child(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from causal_adapter.modeling.loss import chunk_sizes, fused_ovr_loss, reference_ovr_loss

    torch.set_num_threads(spec["threads"])
    N, C, V, variant, trainable = spec["N"], spec["C"], spec["V"], spec["variant"], spec["trainable"]
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(V, C, generator=g) * 0.02).requires_grad_(trainable)
    loc_U = (torch.randn(N, C, generator=g) * 3).requires_grad_()
    scale_Up = (10.0 + torch.rand(N, C, generator=g)).requires_grad_()
    b = torch.zeros(V, requires_grad=True)
    thr = torch.tensor(100.0)
    labels = torch.randint(0, V, (N,), generator=g)
    kw = dict(vocab_chunk=spec.get("vocab_chunk"), token_chunk=spec.get("token_chunk"))
    params = [loc_U, b] + ([scale_Up] if variant != "ce" else []) + ([W] if trainable else [])

    def step(n=N):
        for p in params:
            p.grad = None
        lu, su, y = loc_U[:n], scale_Up[:n], labels[:n]
        if variant == "ce":
            loss = F.cross_entropy(lu @ W.T, y)
        elif variant == "naive":
            loss = reference_ovr_loss(lu, su, W, b, thr, y)
        else:
            loss = fused_ovr_loss(lu, su, W, b, thr, y, compile=variant == "compiled", **kw)
        loss.backward()

    step(min(N, 64))  # warm up thread pools and code paths outside the measurement
    for p in params:
        p.grad = None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base_kb = _status_kb("VmRSS")
    times = [_timed(step) for _ in range(spec["iters"])]
    peak_kb = _status_kb("VmHWM")

    # gradients the variant has to return (the memory lower bound)
    lb = (N * C * (1 if variant == "ce" else 2) + V + (V * C if trainable else 0)) * 4
    gemms = (3 if variant == "ce" else 6) if trainable else (2 if variant == "ce" else 4)
    res = dict(time=min(times), extra_mib=(peak_kb - base_kb) / 1024, lb_mib=lb / MIB,
               gflops=gemms * 2 * N * V * C / min(times) / 1e9)
    if variant in ("fused", "compiled"):
        w_temps = 1 + 3 * trainable
        T, Vc = chunk_sizes(N, V, C, 4, w_temps, kw["vocab_chunk"], kw["token_chunk"], None)
        res.update(T=T, Vc=Vc, sgemm=_sgemm_rate(T, Vc, C, trainable))
    return res


# --------------------------------------------------------------------------- parent side
def _mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def run_child(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        return dict(error=(out.stderr.strip().splitlines() or ["killed"])[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def estimate_peak_mib(variant: str, N: int, V: int, C: int, trainable: bool, seen: dict) -> float:
    """Extra memory a run will need: from a smaller N of the same variant if measured
    (peaks of the [N, V] variants grow linearly in N), else a count of [N, V] tensors."""
    prev = [(n, r["extra_mib"]) for (v, n, t), r in seen.items() if v == variant and t == trainable and "time" in r]
    if prev:
        n0, m0 = max(prev)
        return m0 * N / n0
    per = {"naive": 16, "ce": 3, "fused": 0, "compiled": 0}[variant]
    return per * N * V * 4 / MIB + V * C * 4 / MIB


# --------------------------------------------------------------------------- GPU (one process)
DEVICE_VARIANTS = ["ce", "liger", "cce", "ovr_triton_bf16", "ovr_triton_tf32", "ovr_torch_tf32"]
OVR_LIMIT_SLACK_MIB = 32  # the limit: extra memory <= the gradients returned + 32 MiB


def _device_inputs(N: int, V: int, C: int, trainable: bool, device, bf16_copies: bool, w_dtype=None):
    """The problem of the CPU children, on `device`: W [V, C] (x0.02, in `w_dtype`, default float32), loc_U [N, C] (x3),
    scale_U' = 10 + U(0, 1), b_cls = 0 (trains), threshold 100, labels; bf16 leaf copies of loc_U and W for
    the bf16 peers."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    W = (torch.randn(V, C, generator=g, device=device) * 0.02).to(w_dtype or torch.float32)
    x = dict(W=W.requires_grad_(trainable),
             loc_U=(torch.randn(N, C, generator=g, device=device) * 3).requires_grad_(),
             scale_Up=(10.0 + torch.rand(N, C, generator=g, device=device)).requires_grad_(),
             b=torch.zeros(V, device=device, requires_grad=True),
             thr=torch.tensor(100.0, device=device),
             labels=torch.randint(0, V, (N,), generator=g, device=device))
    if bf16_copies:
        x["h16"] = x["loc_U"].detach().bfloat16().requires_grad_()
        x["W16"] = x["W"].detach().bfloat16().requires_grad_(trainable)
    return x


def _device_step(variant: str, x: dict, device):
    """(step function, the leaves that get gradients) of one variant."""
    import torch
    import torch.nn.functional as F

    W, y = x["W"], x["labels"]
    if variant == "ce":
        def step():  # transformers' ForCausalLMLoss inside an autocast forward: bf16 logits, upcast, CE
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                logits = F.linear(x["loc_U"], W)
            F.cross_entropy(logits.float(), y).backward()
        return step, [x["loc_U"], W]
    if variant == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss()
        return (lambda: loss_fn(x["W16"], x["h16"], y).backward()), [x["h16"], x["W16"]]
    if variant == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return (lambda: linear_cross_entropy(x["h16"], x["W16"], y).backward()), [x["h16"], x["W16"]]
    if variant.startswith("ovr_"):
        from causal_adapter.modeling.loss import fused_ovr_loss
        from common import ovr_loss_kwargs

        _, backend, gemm = variant.split("_")
        kw = ovr_loss_kwargs(backend, gemm)

        def step():
            fused_ovr_loss(x["loc_U"], x["scale_Up"], W, x["b"], x["thr"], y, **kw).backward()
        return step, [x["loc_U"], x["scale_Up"], x["b"], W]
    raise ValueError(f"unknown variant {variant!r}; choose from {DEVICE_VARIANTS}")


def _ce_need_bytes(N: int, V: int) -> int:
    """CE's extra memory, about 12 bytes per logit (bf16 logits, their float32 copy, log-softmax, grads;
    measured: 14.2 GiB at N = 8,192 on an H200)."""
    return 12 * N * V


def run_device_variant(variant: str, N: int, V: int, C: int, trainable: bool, device, warmup: int,
                       repeats: int, w_dtype=None) -> dict:
    import torch

    from common import PeakMemory, best_time, free_device_memory, is_oom

    if variant == "ce" and torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if _ce_need_bytes(N, V) > 0.95 * free:
            return dict(skip=f"needs ~{_ce_need_bytes(N, V) / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
    try:
        x = _device_inputs(N, V, C, trainable, device, variant in ("liger", "cce"), w_dtype)
        step, leaves = _device_step(variant, x, device)

        def drop_grads():
            for t in leaves:
                t.grad = None

        mem = PeakMemory(device)
        for _ in range(warmup):  # before the reset: one-time workspaces and autotuning are not the loss's
            drop_grads()
            step()
        drop_grads()
        mem.start()
        best, times = best_time(step, device, warmup=0, repeats=repeats, before_each=drop_grads)
        extra = mem.extra()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
        res = dict(time=best, times=[round(t * 1e3, 2) for t in times], grads_mib=grads / MIB,
                   extra_mib=None if extra is None else extra / MIB)
    except ImportError as e:
        res = dict(skip=f"not installed ({e.name or e})")
    except Exception as e:  # OOM, a kernel that fails to compile, a missing backend: reported, not fatal
        first = (str(e).strip().splitlines() or [""])[0][:160]
        res = dict(skip="out of memory" if is_oom(e) else f"{type(e).__name__}: {first}")
    x = step = leaves = None  # noqa: F841 (free the inputs before the next variant)
    free_device_memory(device)
    return res


def device_main(args) -> None:
    import torch

    from common import machine_line, triton_status

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(2)
    C, V = 896, args.vocab or 151936
    sizes = args.sizes or [8192, 65536]
    variants = args.variants or DEVICE_VARIANTS
    print(f"OvR loss on {device.type}: C={C} V={V} N={sizes}, W {args.w_dtype} (ce / ovr); best of {args.repeats} "
          f"after {args.warmup} warm-ups", flush=True)
    print(machine_line(device), flush=True)
    why = triton_status(device)
    if why:
        print(f"triton backend: {why}", flush=True)
    # the reference (the chunked torch loop, compiled on first use) goes last, after a first report: a
    # compile that outlasts the caller's timeout then leaves the main comparison printed (complete=0)
    main_jobs = [(N, mode, v) for N in sizes for mode in args.modes for v in variants if not v.startswith("ovr_torch")]
    ref_jobs = [(N, mode, v) for N in sizes for mode in args.modes for v in variants
                if v.startswith("ovr_torch") and N <= args.torch_max_n]
    seen = {}
    for i, (N, mode, variant) in enumerate(main_jobs + ref_jobs):
        if i == len(main_jobs) and ref_jobs and main_jobs:
            device_report(seen, sizes, args.modes, variants, device, complete=False)
        res = run_device_variant(variant, N, V, C, mode == "trainable", device, args.warmup, args.repeats,
                                 torch.bfloat16 if args.w_dtype == "bf16" else torch.float32)
        seen[(variant, N, mode)] = res
        if "time" in res:
            mem = "" if res["extra_mib"] is None else f", extra {res['extra_mib']:.0f} MiB"
            print(f"  N={N} {mode} {variant}: {res['time'] * 1e3:.2f} ms{mem}, grads {res['grads_mib']:.0f} MiB "
                  f"(ms: {res['times']})", flush=True)
        else:
            print(f"  N={N} {mode} {variant}: skipped ({res['skip']})", flush=True)
    device_report(seen, sizes, args.modes, variants, device, complete=True)


def device_report(seen: dict, sizes, modes, variants, device, complete: bool) -> None:
    hdr = f"{'N':>6} {'W':>9} {'variant':>16} {'ms':>9} {'x Liger':>8} {'x CE':>6} {'extra MiB':>10} " \
          f"{'grads MiB':>10} {'limit':>6}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    result = {"device": device.type, "complete": int(complete)}
    for N in sizes:
        for mode in modes:
            liger, ce = seen.get(("liger", N, mode), {}), seen.get(("ce", N, mode), {})
            for variant in variants:
                r = seen.get((variant, N, mode))
                if r is None:
                    continue
                if "time" not in r:
                    print(f"{N:>6} {mode:>9} {variant:>16}   skipped: {r['skip']}")
                    result[f"{variant}_{mode}_N{N}"] = "skipped"
                    continue
                x_liger = r["time"] / liger["time"] if "time" in liger else float("nan")
                x_ce = r["time"] / ce["time"] if "time" in ce else float("nan")
                tag = f"{variant}_{mode}_N{N}"
                result[f"{tag}_ms"] = round(r["time"] * 1e3, 2)
                if variant != "liger" and "time" in liger:
                    result[f"{tag}_x_liger"] = round(x_liger, 3)
                if variant != "ce" and "time" in ce:
                    result[f"{tag}_x_ce"] = round(x_ce, 3)
                limit = ""
                if r["extra_mib"] is not None:
                    result[f"{tag}_extra_mib"] = round(r["extra_mib"], 1)
                    if variant.startswith("ovr_"):  # the memory limit
                        ok = r["extra_mib"] <= r["grads_mib"] + OVR_LIMIT_SLACK_MIB
                        limit = "ok" if ok else "OVER"
                        result[f"{tag}_mem_ok"] = int(ok)
                extra = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.0f}"
                print(f"{N:>6} {mode:>9} {variant:>16} {r['time'] * 1e3:>9.2f} {x_liger:>8.2f} {x_ce:>6.2f} "
                      f"{extra:>10} {r['grads_mib']:>10.0f} {limit:>6}")
    print(f"\nlimit: extra <= grads + {OVR_LIMIT_SLACK_MIB} MiB (OvR variants); x Liger / x CE: time ratios "
          "in this run")
    for variant in (v for v in variants if v.startswith("ovr_triton")):  # the GPU targets, per variant
        for mode in modes:
            ratios = [(N, result.get(f"{variant}_{mode}_N{N}_x_liger")) for N in sizes]
            ratios = [(N, x) for N, x in ratios if x is not None]
            if not ratios:
                continue
            (n0, x0), mem = ratios[0], [result.get(f"{variant}_{mode}_N{N}_mem_ok") for N, _ in ratios]
            growth = "; ".join(f"N={N}: {x:.2f}x ({x / x0:.2f} of N={n0}'s ratio)" for N, x in ratios[1:])
            print(f"target {variant} {mode}: N={n0}: {x0:.2f}x Liger ({'met' if x0 <= 1.0 else 'MISSED'}, goal <= 1.0)"
                  + (f"; {growth}" if growth else "")
                  + f"; memory limit {'n/a' if None in mem else 'met' if all(mem) else 'MISSED'}")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="V=16384, N in 256, 1024")
    ap.add_argument("--sizes", type=int, nargs="*", help="override the N values")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="CPU: naive fused compiled ce (default all); with --device: " + " ".join(DEVICE_VARIANTS))
    ap.add_argument("--modes", nargs="*", default=["frozen", "trainable"])
    ap.add_argument("--device", default=None, help="cuda (or cpu): the in-process GPU comparison (see the top)")
    ap.add_argument("--vocab", type=int, default=None, help="with --device: V (default 151,936)")
    ap.add_argument("--warmup", type=int, default=2, help="with --device: untimed calls before the timed ones")
    ap.add_argument("--repeats", type=int, default=5, help="with --device: timed calls (the fastest is kept)")
    ap.add_argument("--w-dtype", default="fp32", choices=("fp32", "bf16"),
                    help="with --device: W of the ce / ovr variants (bf16: a base held in bf16; Liger / CCE: always bf16)")
    ap.add_argument("--torch-max-n", type=int, default=8192,
                    help="with --device: the ovr_torch reference only up to this N (it is ~10x slower)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (best kept)")
    ap.add_argument("--vocab-chunk", type=int, default=None)
    ap.add_argument("--token-chunk", type=int, default=None)
    ap.add_argument("--mem-limit-gib", type=float, default=16.0, help="skip runs needing more")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.device:
        device_main(args)
        return
    args.variants = args.variants or ["naive", "fused", "compiled", "ce"]

    C = 896
    V = 16384 if args.quick else 151936
    sizes = args.sizes or ([256, 1024] if args.quick else [512, 2048, 8192])
    print(f"OvR loss benchmark: C={C} V={V} threads=2 variants={args.variants}", flush=True)
    seen: dict = {}
    for N in sizes:
        rounds = args.rounds or (2 if N * V > 2048 * 151936 else 3)
        for r in range(rounds):
            for mode in args.modes:
                trainable = mode == "trainable"
                for variant in args.variants:
                    key = (variant, N, trainable)
                    if "skip" in seen.get(key, {}):
                        continue
                    need = estimate_peak_mib(variant, N, V, C, trainable, seen)
                    limit = min(args.mem_limit_gib * 1024, _mem_available_mib() - 2048)
                    if need > limit:
                        seen[key] = dict(skip=f"needs ~{need / 1024:.1f} GiB > {limit / 1024:.1f} GiB")
                        print(f"  N={N} {mode} {variant}: skipped ({seen[key]['skip']})", flush=True)
                        continue
                    spec = dict(N=N, C=C, V=V, variant=variant, trainable=trainable, threads=2, iters=1,
                                vocab_chunk=args.vocab_chunk, token_chunk=args.token_chunk)
                    res = run_child(spec)
                    print(f"  N={N} {mode} {variant} round {r + 1}/{rounds}: {res}", flush=True)
                    old = seen.get(key)
                    if "error" in res:
                        seen[key] = dict(skip=res["error"])
                        continue
                    if "sgemm" in res:  # the machine's peak at these shapes: best over all rounds
                        peak_key = ("sgemm", N, trainable)
                        seen[peak_key] = max(seen.get(peak_key, 0.0), res["sgemm"])
                    if old is None or res["time"] < old["time"]:
                        if old is not None:  # memory: keep the worst seen
                            res["extra_mib"] = max(res["extra_mib"], old["extra_mib"])
                        seen[key] = res
                    else:
                        old["extra_mib"] = max(res["extra_mib"], old["extra_mib"])
    report(seen, sizes, args.modes, args.variants)


def report(seen: dict, sizes, modes, variants) -> None:
    hdr = f"{'N':>6} {'W':>9} {'variant':>8} {'time s':>8} {'x CE':>6} {'bound':>6} {'extra MiB':>10} " \
          f"{'grad LB':>8} {'extra-LB':>9} {'GFLOP/s':>8} {'sgemm':>6} {'% sgemm':>8}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    result = {}
    for N in sizes:
        for mode in modes:
            trainable = mode == "trainable"
            ce = seen.get(("ce", N, trainable), {})
            peak = seen.get(("sgemm", N, trainable), float("nan"))
            bound = 2 * ce["gflops"] / peak if "time" in ce else float("nan")
            for variant in variants:
                r = seen.get((variant, N, trainable), {})
                if "time" not in r:
                    print(f"{N:>6} {mode:>9} {variant:>8}   skipped: {r.get('skip', 'not run')}")
                    continue
                ratio = r["time"] / ce["time"] if "time" in ce else float("nan")
                over = r["extra_mib"] - r["lb_mib"]
                frac = r["gflops"] / peak
                print(f"{N:>6} {mode:>9} {variant:>8} {r['time']:>8.2f} {ratio:>6.2f} {bound:>6.2f} "
                      f"{r['extra_mib']:>10.0f} {r['lb_mib']:>8.0f} {over:>9.0f} {r['gflops']:>8.1f} "
                      f"{peak:>6.0f} {100 * frac:>7.0f}%")
                tag = f"{variant}_{mode}_N{N}"
                result[f"{tag}_s"] = round(r["time"], 3)
                result[f"{tag}_extra_over_lb_mib"] = round(over, 1)
                if variant != "ce" and "time" in ce:
                    result[f"{tag}_x_ce"] = round(ratio, 3)
                if variant in ("fused", "compiled"):
                    result[f"{tag}_sgemm_frac"] = round(frac, 3)
                    result[f"{tag}_gflops"] = round(r["gflops"], 1)
            if "time" in ce:
                result[f"bound_{mode}_N{N}_x_ce"] = round(bound, 3)
    print("\nRESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
