#!/usr/bin/python3
"""Optimizer step time under FSDP2 (fully_shard with CPUOffloadPolicy, 2 processes over gloo
on the CPU, ~100 M fp32 parameters), zoffload.torch.AdamW beside the peers an FSDP2 user has:
torch.optim.AdamW foreach, and AdamW(fused=True) where this torch steps DTensors with it; and
the end-to-end training step (forward, backward, step) of each.  Measured in the same run on
one zoffloadd started here, each optimizer on a model of its own (the same seed and sizes),
round by round so that no side gets the quieter moment by its place.  Each round's time is
the slower rank's, and a figure is the median of the rounds (the best rounds are printed
beside it): some rounds of a peer ran a third faster than its others here, for the memory
they were given rather than anything the optimizer did (see bench_torch.py).

    PYTHONPATH=build-test/python $VENV/bin/python benchmarks/bench_fsdp2.py [--json] \
        [--size M] [--copied]

Figures (--json: a list of {name, value, unit, limit, ratio}; value = the peer's time /
ours, higher is better; ratio = value / limit, >= 1 meets the target):
  step_speedup_vs_torch_fused (>= 1.0), step_speedup_vs_torch_foreach (>= 1.0),
  q8_step_speedup_vs_torch_fused and _foreach (state_format="q8-moments": 8-bit moments,
  6 B a param fewer each way than fp32's; no target), train_step_speedup_vs_torch_fused,
  train_step_speedup_vs_torch_foreach (no target: the forward and backward are FSDP2's, the
  same for both), the same two with _overlap for zoffload.torch.AdamW(overlap=True), whose
  steps run in backward (so it has no step-only figure), with --copied step_ and
  train_step_speedup_vs_copied_grads (FSDP2's reduce-scatter into the grad slots against the
  same optimizer copying the sharded gradients in, as it did before, on a sixth model: about
  3 GB more; no target), and each side's times in ms (no limit).  Each step timed takes the
  gradients of a backward of its own, untimed.  A peer this torch refuses is skipped and
  named on stderr.
Environment: $ZOFFLOADD (the daemon) defaults to build-test/'s.  Not part of the test run;
exits 77 (skipped) under a torch without FSDP2 (1.13).
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from _bench import ROOT, free_port, start_daemon


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import zoffload.torch

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    d = 2048 if args.size >= 50 else 512
    layers = max(1, round(args.size * 1e6 / (d * d + d)))
    mesh = init_device_mesh("cpu", (args.world,))
    policy = CPUOffloadPolicy(pin_memory=False)     # no CUDA here to pin with

    def sharded_model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
        for layer in m:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(m, mesh=mesh, offload_policy=policy)
        return m

    x = torch.randn(args.batch, d)
    skipped = []
    # A model of its own for each optimizer: one optimizer's writes into params another
    # steps would make the other take them as a new master (ours) or fault in pages that
    # are our param views (the peers), neither of which a real run does.
    models = {"zoffload": sharded_model(), "zoffload_q8": sharded_model(),
              "zoffload_overlap": sharded_model(), "torch_foreach": sharded_model()}
    opts = {"zoffload": zoffload.torch.AdamW(models["zoffload"].parameters(), lr=1e-5,
                                             socket=args.socket, job="bench-fsdp2"),
            "zoffload_q8": zoffload.torch.AdamW(models["zoffload_q8"].parameters(), lr=1e-5,
                                                socket=args.socket, job="bench-fsdp2-q8",
                                                state_format="q8-moments"),
            "zoffload_overlap": zoffload.torch.AdamW(
                models["zoffload_overlap"].parameters(), lr=1e-5, socket=args.socket,
                job="bench-fsdp2-overlap", overlap=True),
            "torch_foreach": torch.optim.AdamW(models["torch_foreach"].parameters(), lr=1e-5,
                                               foreach=True)}
    try:
        models["torch_fused"] = sharded_model()
        fused = torch.optim.AdamW(models["torch_fused"].parameters(), lr=1e-5, fused=True)
        models["torch_fused"](x).square().mean().backward()
        fused.step()
        opts["torch_fused"] = fused
    except (RuntimeError, TypeError, NotImplementedError) as ex:
        del models["torch_fused"]
        skipped.append(f"torch_fused: {type(ex).__name__}: {str(ex).splitlines()[0]}")
    if args.copied:
        # The A/B of the reduce-scatter into the grad slots: this one copies the sharded
        # gradients into its slots, as zoffload.torch did before (_graft.py).
        models["zoffload_copied"] = sharded_model()
        opts["zoffload_copied"] = zoffload.torch.AdamW(
            models["zoffload_copied"].parameters(), lr=1e-5, socket=args.socket,
            job="bench-fsdp2-copied")
        opts["zoffload_copied"]._grafts.uninstall()

    def slowest(t):
        t = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    def backward(name):
        opts[name].zero_grad(set_to_none=True)
        models[name](x).square().mean().backward()

    def train_step(name):
        backward(name)
        opts[name].step()

    times = {}
    for name in opts:
        for _ in range(2):                  # warm-up; the first step learns the layouts
            train_step(name)
    for _ in range(args.rounds):
        for name, opt in opts.items():
            # overlap's steps run in backward: only its training step says what it costs.
            if name != "zoffload_overlap":
                # Each step takes the gradients of a backward of its own, as in training:
                # where FSDP2's reduce-scatter put them is part of what the step costs.
                backward(name)
                times.setdefault("step_" + name, []).append(timed(opt.step))
    for _ in range(args.rounds):
        for name, opt in opts.items():
            # q8's training step differs from fp32's by its step alone, timed above.
            if name != "zoffload_q8":
                times.setdefault("train_" + name, []).append(timed(lambda: train_step(name)))
    nparams = sum(p.numel() for p in models["zoffload"].parameters())
    if args.rank == 0:
        print("RESULT " + json.dumps({"times": {k: statistics.median(v)
                                                for k, v in times.items()},
                                      "best": {k: min(v) for k, v in times.items()},
                                      "skipped": skipped, "params": nparams,
                                      "torch": torch.__version__}), flush=True)
    dist.barrier()
    for name, opt in opts.items():
        if name.startswith("zoffload"):
            opt.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--size", type=float, default=100, help="millions of params")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="each figure the rounds' median")
    ap.add_argument("--copied", action="store_true",
                    help="also zoffload copying the sharded gradients in (the A/B)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="torch's threads per rank (2 ranks), and the daemon's workers "
                         "twice that: the same cores for both")
    ap.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "SOCKET"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.world = 2
    if args.worker:
        args.rank, args.port, args.socket = int(args.worker[0]), args.worker[1], args.worker[2]
        return worker(args)
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except (ImportError, ValueError):
        # torch 1.13 (meson's first interpreter here) has no FSDP2: 77 is meson's "skipped".
        import torch
        print(f"bench_fsdp2: skipped: torch {torch.__version__} has no FSDP2 (fully_shard)",
              file=sys.stderr)
        sys.exit(77)
    daemon = os.environ.get("ZOFFLOADD", os.path.join(ROOT, "build-test/daemon/zoffloadd"))
    with tempfile.TemporaryDirectory(prefix="bench-fsdp2-") as tmp:
        proc, sock = start_daemon(daemon, args.threads * args.world, tmp, "bench_fsdp2")
        try:
            port = str(free_port())
            base = [sys.executable, os.path.abspath(__file__), "--size", str(args.size),
                    "--batch", str(args.batch), "--rounds", str(args.rounds), "--threads",
                    str(args.threads)] + (["--copied"] if args.copied else [])
            workers = [subprocess.Popen(base + ["--worker", str(r), port, sock],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True) for r in range(args.world)]
            outs = [w.communicate() for w in workers]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    for w, (_, err) in zip(workers, outs):
        if w.returncode != 0:
            sys.exit(f"bench_fsdp2: a rank failed:\n{err[-3000:]}")
    (line,) = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[7:])
    t = res["times"]
    figures = []
    for what, ours, limit in (("step", "zoffload", 1.0), ("step", "zoffload_q8", None),
                              ("train", "zoffload", None), ("train", "zoffload_overlap", None)):
        for peer in ("torch_fused", "torch_foreach"):
            if f"{what}_{peer}" in t and f"{what}_{ours}" in t:
                name = ("q8_" if ours == "zoffload_q8" else "") + (
                    f"{'step' if what == 'step' else 'train_step'}_speedup_vs_{peer}" +
                    ("_overlap" if ours == "zoffload_overlap" else ""))
                figures.append((name, t[f"{what}_{peer}"] / t[f"{what}_{ours}"], "x", limit))
    for what in ("step", "train") if args.copied else ():
        # The reduce-scatter into the slots against copying the gradients in: no target.
        figures.append((f"{'step' if what == 'step' else 'train_step'}_speedup_vs_copied_grads",
                        t[f"{what}_zoffload_copied"] / t[f"{what}_zoffload"], "x", None))
    for k, v in t.items():
        figures.append((f"{k}_ms", v * 1e3, "ms", None))
    summary = (f"bench_fsdp2: torch {res['torch']}, {res['params'] / 1e6:.1f} M fp32 params "
               f"under fully_shard (CPUOffloadPolicy) over 2 ranks, {args.threads} torch "
               f"threads per rank, {args.threads * args.world} daemon workers; times (ms), "
               f"median of {args.rounds} rounds (best): " +
               ", ".join(f"{k} {v * 1e3:.1f} ({res['best'][k] * 1e3:.1f})"
                         for k, v in t.items()))
    for what in res["skipped"]:
        print(f"bench_fsdp2: skipped {what}", file=sys.stderr)
    if args.json:
        print(summary, file=sys.stderr)
        print(json.dumps([{"name": n, "value": round(v, 3), "unit": u, "limit": lim,
                           "ratio": round(v / lim, 3) if lim else None}
                          for n, v, u, lim in figures], indent=1))
    else:
        print(summary)
        for n, v, u, lim in figures:
            print(f"  {n:40s} {v:9.2f} {u}" + (f"   (target >= {lim})" if lim else ""))


if __name__ == "__main__":
    main()
