#!/usr/bin/python3
"""DeepSpeed ZeRO-2 with offload_optimizer on the CPU (DeepSpeed's CPU accelerator, gloo, one
process): step time and host memory per parameter with zoffloadd holding the optimizer
(zoffload.deepspeed.initialize) against the same run with DeepSpeed's own DeepSpeedCPUAdam
(the peer), measured side by side in one run.

The model is a stack of --size M parameters of 1024x1024 Linear layers, each followed by a
LayerNorm and a GELU, on a batch of 8 rows, so that the optimizer's share of the iteration is
what it is in a large model's.  The LayerNorm keeps the gradients at a trained model's scale:
without it, 77% of the 50 layers' gradients were below 1e-19 (their squares subnormal), and
every CPU Adam here runs 7-10 times slower on subnormal numbers (16 Mi elements, 1 thread:
ours 20 -> 147 ms, DeepSpeedCPUAdam 20 -> 167, torch's fused 21 -> 244), so the figures
measured how each handles those instead of the step.  Each side runs in a process of its own
(its memory counted alone), alternating, and each figure is the best of --rounds.

    PYTHONPATH=build-test/python TORCH_EXTENSIONS_DIR=... $VENV/bin/python \\
        benchmarks/bench_deepspeed.py [--json] [--size 100] [--clip 1.0]

Figures (--json: a list of {name, value, unit, limit, ratio}; value = the peer's / ours, so
higher is better; ratio = value / limit, >= 1 meets the target):
  speedup_vs_deepspeed_cpu_adam_step: engine.step() (the reduced gradients into the optimizer,
      the step, the new params back into the model), median over the timed steps;
  speedup_vs_deepspeed_cpu_adam_iteration: forward, backward and step;
  host_memory_per_param_vs_deepspeed_cpu_adam: host bytes per parameter after training,
      proportional set size (shared pages counted once) of the trainer, and for ours also of
      the daemon, less what they held before the model was built, each taken after the
      trainer's malloc_trim (see trimmed_pss);
  checkpoint_save_speedup_vs_deepspeed_cpu_adam: after training, zoffload.deepspeed's
      save_checkpoint (the daemon streams the optimizer's state) against engine.save_checkpoint
      of the DeepSpeedCPUAdam run, both into the same file system (the engine's own save
      with zoffload is timed and printed too);
  checkpoint_save_memory_vs_deepspeed_cpu_adam: host bytes per parameter at a save's peak:
      the figure above plus what the save adds at its peak (VmHWM, reset before the save,
      less the RSS then; trainer and daemon), each side's.
  --no-checkpoint leaves the last two out.
Environment: $ZOFFLOADD (the daemon) defaults to build-test's.
"""
import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from _bench import ROOT, free_port, start_daemon
WIDTH = 1024


def pss_bytes(pid):
    """Proportional set size: a page shared by the trainer and the daemon counts half in each."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def trimmed_pss(pids):
    """The trainer's and the daemon's PSS once the trainer's glibc has handed back the freed
    heap pages it keeps (malloc_trim): how many it keeps varies from run to run by 8 B a
    parameter on either side (25 or 33 B for DeepSpeedCPUAdam's run), which measured the
    allocator's luck rather than what the run holds."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return sum(pss_bytes(p) for p in pids)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_reset(pid):
    """The process's peak RSS (VmHWM) set back to its RSS now (clear_refs 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def status_bytes(pid, key):
    """A size from /proc/PID/status: VmRSS, or VmHWM (the peak since peak_reset)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} for {pid}")


def timed_save(pids, save, nparams):
    """save()'s seconds and the peak host memory it took beyond what was there, per param."""
    import gc
    gc.collect()
    base = sum(status_bytes(p, "VmRSS") for p in pids)
    for p in pids:
        peak_reset(p)
    t0 = time.perf_counter()
    save()
    t = time.perf_counter() - t0
    return t, (sum(status_bytes(p, "VmHWM") for p in pids) - base) / nparams


def child(which, size, steps, sock, daemon_pid, threads, port, clip, ckpt_dir):
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import deepspeed

    torch.set_num_threads(threads)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None   # gloo is enough
    deepspeed.init_distributed(dist_backend="gloo")
    import zoffload.deepspeed as zds
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])      # its op loaded beforehand

    pids = [os.getpid()] + ([daemon_pid] if which == "ours" else [])
    before = trimmed_pss(pids)
    torch.manual_seed(0)
    layers = []
    for _ in range(max(1, round(size * 1e6 / (WIDTH * WIDTH + 3 * WIDTH)))):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    nparams = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "overlap_comm": True,
                                 "contiguous_gradients": True,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": False}},
           "steps_per_print": 1 << 30}
    if clip:
        cfg["gradient_clipping"] = clip
    if which == "ours":
        engine, opt, _, _ = zds.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg, job=f"bench-ds-{os.getpid()}",
                                           socket=sock)
    else:
        p = cfg.pop("optimizer")["params"]
        opt = DeepSpeedCPUAdam(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"],
                               adamw_mode=True)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, WIDTH, generator=g)
    step_t, iter_t, daemon_cpu = [], [], []
    for i in range(steps + 2):                  # two warm-up steps: first touch of the state
        c0 = cpu_seconds(daemon_pid) if which == "ours" else 0.0
        t0 = time.perf_counter()
        loss = engine(x).square().mean()
        engine.backward(loss)
        t1 = time.perf_counter()
        c1 = cpu_seconds(daemon_pid) if which == "ours" else 0.0
        engine.step()
        t2 = time.perf_counter()
        if i >= 2:
            step_t.append(t2 - t1)
            iter_t.append(t2 - t0)
            daemon_cpu.append(c1 - c0)
    untrimmed = sum(pss_bytes(p) for p in pids)
    after = trimmed_pss(pids)
    saves = {}
    if ckpt_dir:
        # The engine's own save (the optimizer's state_dict, pickled), and ours streamed by
        # the daemon; each into a directory of its own, removed after.
        ways = [("engine", lambda d: engine.save_checkpoint(d, tag="t"))]
        if which == "ours":
            ways.append(("streamed", lambda d: zds.save_checkpoint(engine, d, tag="t")))
        for name, save in ways:
            d = os.path.join(ckpt_dir, f"{which}-{name}")
            saves[name] = timed_save(pids, lambda: save(d), nparams)
            subprocess.run(["rm", "-rf", d], check=True)
    print(json.dumps({"params": nparams, "step_s": statistics.median(step_t),
                      "saves": saves,
                      "iter_s": statistics.median(iter_t),
                      "bytes_per_param": (after - before) / nparams,
                      "untrimmed_bytes_per_param": (untrimmed - before) / nparams,
                      # The daemon's CPU time while the trainer ran forward and backward.
                      "daemon_cpu_fwd_bwd_s": statistics.median(daemon_cpu)}), flush=True)
    engine.destroy()
    if which == "ours":
        opt.optimizer.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--size", type=float, default=100, help="model size, M parameters")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="the config's gradient_clipping (0: none), for both sides")
    ap.add_argument("--steps", type=int, default=5, help="timed, after two warm-up steps")
    ap.add_argument("--rounds", type=int, default=2, help="each figure the best round's")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="daemon workers, and torch's threads: the same cores for both")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="leave out the checkpoint save figures")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--daemon-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.size, args.steps, args.socket, args.daemon_pid, args.threads,
              free_port(), args.clip, args.ckpt_dir)
        return
    try:
        # DeepSpeed's logger writes to the stdout it finds at import: stderr, so --json stays JSON.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    except ImportError as ex:
        sys.exit(f"bench_deepspeed: deepspeed is not importable here ({ex}): nothing to "
                 "compare with")
    daemon = os.environ.get("ZOFFLOADD", os.path.join(ROOT, "build-test/daemon/zoffloadd"))
    best = {}
    with tempfile.TemporaryDirectory(prefix="bench-ds-") as tmp:
        proc, sock = start_daemon(daemon, args.threads, tmp, "bench_deepspeed")
        try:
            for _ in range(args.rounds):
                for which in ("ours", "ref"):
                    out = subprocess.run(
                        [sys.executable, os.path.abspath(__file__), "--child", which,
                         "--size", str(args.size), "--clip", str(args.clip), "--steps",
                         str(args.steps), "--socket", sock, "--daemon-pid", str(proc.pid),
                         "--threads", str(args.threads)] +
                        ([] if args.no_checkpoint else ["--ckpt-dir", tmp]),
                        capture_output=True, text=True)
                    if out.returncode != 0:
                        sys.exit(f"bench_deepspeed: the {which} run failed:\n"
                                 f"{out.stdout[-3000:]}{out.stderr[-3000:]}")
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                    b = best.setdefault(which, got)
                    for k in ("step_s", "iter_s", "bytes_per_param", "untrimmed_bytes_per_param",
                              "daemon_cpu_fwd_bwd_s"):
                        b[k] = min(b[k], got[k])
                    for k, (t, m) in got["saves"].items():
                        bt, bm = b["saves"][k]
                        b["saves"][k] = (min(bt, t), min(bm, m))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    ours, ref = best["ours"], best["ref"]
    figures = [
        ("speedup_vs_deepspeed_cpu_adam_step", ref["step_s"] / ours["step_s"], "x", 1.0),
        ("speedup_vs_deepspeed_cpu_adam_iteration", ref["iter_s"] / ours["iter_s"], "x", 1.0),
        ("host_memory_per_param_vs_deepspeed_cpu_adam",
         ref["bytes_per_param"] / ours["bytes_per_param"], "x", 1.0),
    ]
    if not args.no_checkpoint:
        (st, sm), (et, em), (rt, rm) = (ours["saves"]["streamed"], ours["saves"]["engine"],
                                        ref["saves"]["engine"])
        figures += [
            ("checkpoint_save_speedup_vs_deepspeed_cpu_adam", rt / st, "x", 1.0),
            ("checkpoint_save_memory_vs_deepspeed_cpu_adam",
             (ref["bytes_per_param"] + rm) / (ours["bytes_per_param"] + sm), "x", 1.0),
        ]
    summary = (f"bench_deepspeed: ZeRO-2, offload_optimizer cpu, {ours['params'] / 1e6:.1f} M "
               f"fp32 params, {args.threads} threads; engine.step() s: zoffload "
               f"{ours['step_s']:.4f}, DeepSpeedCPUAdam {ref['step_s']:.4f}; iteration s: "
               f"{ours['iter_s']:.4f} / {ref['iter_s']:.4f}; host bytes per param: "
               f"{ours['bytes_per_param']:.1f} / {ref['bytes_per_param']:.1f} (before "
               f"malloc_trim: {ours['untrimmed_bytes_per_param']:.1f} / "
               f"{ref['untrimmed_bytes_per_param']:.1f}); the daemon's "
               f"CPU during forward and backward: {ours['daemon_cpu_fwd_bwd_s']:.3f} s")
    if not args.no_checkpoint:
        summary += (f"; checkpoint save s (peak host bytes per param it added): streamed "
                    f"{st:.2f} ({sm:.2f}), the engine's with zoffload {et:.2f} ({em:.2f}), "
                    f"DeepSpeedCPUAdam's {rt:.2f} ({rm:.2f})")
    if args.json:
        print(summary, file=sys.stderr)
        print(json.dumps([{"name": n, "value": round(v, 3), "unit": u, "limit": lim,
                           "ratio": round(v / lim, 3)} for n, v, u, lim in figures], indent=1))
    else:
        print(summary)
        for n, v, _, lim in figures:
            print(f"  {n:44s} {v:6.2f}   (target >= {lim})")


if __name__ == "__main__":
    main()
