"""How fast and how lean is the OvR loss at vocabulary scale against cross-entropy (docs/benchmarks.md)?

    python benchmarks/ovr_loss.py --device cuda      # N = 8,192 and 65,536 at C = 896, V = 151,936; ~1 min on an H100
    python benchmarks/ovr_loss.py --device cpu --vocab 600 --sizes 48 --repeats 1 --warmup 1   # a smoke test

One process, every variant in turn, W frozen and trainable, forward + backward, best of --repeats after --warmup,
device-synchronised; extra memory from torch.cuda.max_memory_allocated() (the OvR limit: extra <= the gradients
returned + 32 MiB; none on a CPU). Variants: ``ce`` (F.cross_entropy on bf16 logits, as plain LoRA computes it under
autocast), ``liger`` (Liger's fused linear cross-entropy), ``cce`` (Apple's Cut Cross-Entropy), ``ovr_triton_bf16``
/ ``ovr_triton_tf32`` (fused_ovr_loss's Triton sweep; --w-dtype bf16: W in bf16, as on a bf16 base),
``ovr_torch_tf32`` (the chunked torch loop; only N <= --torch-max-n, run last). A variant that cannot be installed,
imported or fitted is reported and skipped; the RESULT line comes once before the torch loop (``complete=0``) and
again at the end (``complete=1``). Extras: ``pip install liger-kernel==0.8.5 cut-cross-entropy==25.1.1``. The CPU
subprocess comparison (naive formula, fused eager / compiled, CE, % of sgemm) ran here up to commit 1c2f799; its
figures: docs/design-notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gc

import torch

from common import best_time, machine_line

MIB = 2**20


DEVICE_VARIANTS = ["ce", "liger", "cce", "ovr_triton_bf16", "ovr_triton_tf32", "ovr_torch_tf32"]
OVR_LIMIT_SLACK_MIB = 32  # the limit: extra memory <= the gradients returned + 32 MiB


def _device_inputs(N: int, V: int, C: int, trainable: bool, device, bf16_copies: bool, w_dtype=None):
    """The problem on `device`: W [V, C] (x0.02, in `w_dtype`, default float32), loc_U [N, C] (x3),
    scale_U' = 10 + U(0, 1), b_cls = 0 (trains), threshold 100, labels; bf16 leaf copies of loc_U and W for
    the bf16 peers."""
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

        _, backend, gemm = variant.split("_")

        def step():
            fused_ovr_loss(x["loc_U"], x["scale_Up"], W, x["b"], x["thr"], y, backend=backend,
                           gemm_precision=gemm).backward()
        return step, [x["loc_U"], x["scale_Up"], x["b"], W]
    raise ValueError(f"unknown variant {variant!r}; choose from {DEVICE_VARIANTS}")


def run_device_variant(variant: str, N: int, V: int, C: int, trainable: bool, device, warmup: int,
                       repeats: int, w_dtype=None) -> dict:
    cuda = torch.device(device).type == "cuda"
    # CE's extra memory: about 12 bytes per logit (bf16 logits, their float32 copy, log-softmax, grads; 14.2 GiB
    # at N = 8,192 on an H200)
    if variant == "ce" and cuda:
        need, free = 12 * N * V, torch.cuda.mem_get_info(device)[0]
        if need > 0.95 * free:
            return dict(skip=f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
    try:
        x = _device_inputs(N, V, C, trainable, device, variant in ("liger", "cce"), w_dtype)
        step, leaves = _device_step(variant, x, device)

        def drop_grads():
            for t in leaves:
                t.grad = None

        for _ in range(warmup):  # before the reset: one-time workspaces and autotuning are not the loss's
            drop_grads()
            step()
        drop_grads()
        gc.collect()
        if cuda:  # the allocator's peak above what the inputs hold
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        best, times = best_time(step, device, warmup=0, repeats=repeats, before_each=drop_grads)
        extra = torch.cuda.max_memory_allocated(device) - start if cuda else None
        grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
        res = dict(time=best, times=[round(t * 1e3, 2) for t in times], grads_mib=grads / MIB,
                   extra_mib=None if extra is None else extra / MIB)
    except ImportError as e:
        res = dict(skip=f"not installed ({e.name or e})")
    except Exception as e:  # OOM, a kernel that fails to compile, a missing backend: reported, not fatal
        first = (str(e).strip().splitlines() or [""])[0][:160]
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        res = dict(skip="out of memory" if oom else f"{type(e).__name__}: {first}")
    x = step = leaves = None  # noqa: F841 (free the inputs before the next variant)
    gc.collect()
    if cuda:  # and the cached blocks (after an out-of-memory error too)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return res


def device_main(args) -> None:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(2)
    C, V = 896, args.vocab or 151936
    sizes = args.sizes or ([8192, 65536] if device.type == "cuda" else [512, 2048])  # a CPU's memory and time
    variants = args.variants or DEVICE_VARIANTS
    print(f"OvR loss on {device.type}: C={C} V={V} N={sizes}, W {args.w_dtype} (ce / ovr); best of {args.repeats} "
          f"after {args.warmup} warm-ups", flush=True)
    print(machine_line(device), flush=True)
    if device.type != "cuda":
        print("triton backend: needs CUDA (on CPU only under TRITON_INTERPRET=1, in the tests)", flush=True)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    ap.add_argument("--sizes", type=int, nargs="*", help="the N values (default 8192 65536; on a CPU 512 2048)")
    ap.add_argument("--variants", nargs="*", default=None, help=" ".join(DEVICE_VARIANTS) + " (default all)")
    ap.add_argument("--modes", nargs="*", default=["frozen", "trainable"])
    ap.add_argument("--vocab", type=int, default=None, help="V (default 151,936)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls before the timed ones")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls (the fastest is kept)")
    ap.add_argument("--w-dtype", default="fp32", choices=("fp32", "bf16"),
                    help="W of the ce / ovr variants (bf16: a base held in bf16; Liger / CCE: always bf16)")
    ap.add_argument("--torch-max-n", type=int, default=8192,
                    help="the ovr_torch reference only up to this N (it is ~10x slower)")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device_main(args)


if __name__ == "__main__":
    main()
