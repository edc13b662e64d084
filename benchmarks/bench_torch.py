#!/usr/bin/python3
"""Optimizer step time of zoffload.torch.AdamW for a ~100 M-parameter model on the CPU, beside
torch.optim.AdamW (for-loop and foreach) and beside bench_torch_c, a C program doing the same
work straight through libzclient (the gradients already in the grad slots, as p.grad is its
slot after a step; one step; wait; copy the params out of the param slots), all in one run on
one zoffloadd started here; each figure is the best of --rounds rounds of all four.

    PYTHONPATH=build/python /usr/bin/python3 benchmarks/bench_torch.py [--json]

Figures (--json: a list of {name, value, unit, limit, ratio}):
  speedup_vs_torch_forloop, speedup_vs_torch_foreach: torch's step time / ours (target >= 5)
  overhead_vs_c: ours / the C program's (target <= 1.10)
Environment: $ZOFFLOADD (the daemon) and $BENCH_TORCH_C (the C program) default to the ones
in build-test/.
"""
import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import zoffload.torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_daemon(path, threads, tmp):
    sock = os.path.join(tmp, "sock")
    conf = os.path.join(tmp, "zoffload.conf")
    with open(conf, "w") as f:
        json.dump({"compute": {"worker_threads": threads}, "memory": {"policy": "cpu"}}, f)
    log = open(os.path.join(tmp, "daemon.log"), "w")
    proc = subprocess.Popen([path, "--config", conf, "--socket", sock], stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit("bench_torch: zoffloadd did not start; see " + log.name)
        time.sleep(0.01)
    return proc, sock


def model(tensors, numel):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(numel // 1024, 1024)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn_like(p) * 0.01
    return ps


def time_steps(opt, steps):
    """Median seconds per step; the machine may be shared, the median shrugs off a hiccup."""
    opt.step()                      # warm-up: first-touch of the state, page faults
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024, help="per tensor")
    ap.add_argument("--steps", type=int, default=7, help="timed, after one warm-up each")
    ap.add_argument("--rounds", type=int, default=3, help="each figure the best round's")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="daemon workers, and torch's threads: the same cores for both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    daemon = os.environ.get("ZOFFLOADD", os.path.join(ROOT, "build-test/daemon/zoffloadd"))
    cprog = os.environ.get("BENCH_TORCH_C",
                           os.path.join(ROOT, "build-test/benchmarks/bench_torch_c"))
    nparams = args.tensors * args.numel
    times = {}

    def keep(name, t):
        times[name] = min(t, times.get(name, t))

    with tempfile.TemporaryDirectory(prefix="bench-torch-") as tmp:
        proc, sock = start_daemon(daemon, args.threads, tmp)
        try:
            # Rounds of all four, each figure the best of its rounds: on a shared machine no
            # side gets the quieter moment by its place in the order.
            for rnd in range(args.rounds):
                ps = model(args.tensors, args.numel)
                opt = zoffload.torch.AdamW(ps, lr=1e-3, job=f"bench-torch-{rnd}",
                                           socket=sock)
                # After the warm-up step p.grad is its slot: no gradient copy, as in C.
                keep("zoffload", time_steps(opt, args.steps))
                opt.close()
                del opt, ps
                gc.collect()
                out = subprocess.run([cprog, "--socket", sock, "--tensors", str(args.tensors),
                                      "--numel", str(args.numel), "--steps", str(args.steps)],
                                     capture_output=True, text=True, check=True)
                keep("c", float(out.stdout))
                for name, foreach in (("torch_forloop", False), ("torch_foreach", True)):
                    ps = model(args.tensors, args.numel)
                    keep(name, time_steps(torch.optim.AdamW(ps, lr=1e-3, foreach=foreach),
                                          args.steps))
                    del ps
                    gc.collect()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    figures = [
        ("speedup_vs_torch_forloop", times["torch_forloop"] / times["zoffload"], "x", 5.0),
        ("speedup_vs_torch_foreach", times["torch_foreach"] / times["zoffload"], "x", 5.0),
        ("overhead_vs_c", times["zoffload"] / times["c"], "x", 1.10),
    ]
    summary = (f"bench_torch: {nparams / 1e6:.1f} M fp32 params in {args.tensors} tensors, "
               f"step time: zoffload.torch {times['zoffload']:.3f} s, C through libzclient "
               f"{times['c']:.3f} s, torch AdamW for-loop {times['torch_forloop']:.3f} s, "
               f"foreach {times['torch_foreach']:.3f} s ({args.threads} threads each)")
    if args.json:
        print(summary, file=sys.stderr)
        print(json.dumps([{"name": n, "value": round(v, 3), "unit": u, "limit": lim,
                           "ratio": round(v, 3)} for n, v, u, lim in figures], indent=1))
    else:
        print(summary)
        for n, v, _, lim in figures:
            print(f"  {n:26s} {v:6.2f}   (target {'>=' if n.startswith('speed') else '<='} "
                  f"{lim})")


if __name__ == "__main__":
    main()
