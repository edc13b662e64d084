#!/usr/bin/python3
"""A small character-level GPT trained on examples/data/shakespeare.txt, every optimizer step
done by zoffloadd through zoffload.torch.AdamW (the one line that differs from plain torch).

Its job gets a small pinned budget (--pinned-budget) and the "auto" policy, so part of its
optimizer state lives on the daemon's swap directory.  Prints the loss as it goes, a sample,
and what the daemon says about the job.

    PYTHONPATH=build/python /usr/bin/python3 examples/train_gpt.py --socket /tmp/zoffload.sock
"""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import zoffload.torch

HERE = os.path.dirname(os.path.abspath(__file__))


class Block(nn.Module):
    def __init__(self, d, heads, ctx):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads
        self.register_buffer("mask", torch.tril(torch.ones(ctx, ctx, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d=64, heads=4, layers=2, ctx=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d, heads, ctx) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.ctx = ctx

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))

    @torch.no_grad()
    def sample(self, idx, n, generator):
        for _ in range(n):
            logits = self(idx[:, -self.ctx:])[:, -1]
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", help="zoffloadd's socket (default: $ZOFFLOAD_SOCKET)")
    ap.add_argument("--job", default="gpt-example")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pinned-budget", default="512K",
                    help="pinned bytes for the job's state; the rest goes to the swap dir")
    ap.add_argument("--policy", default="auto", choices=["auto", "cpu", "nvme"])
    ap.add_argument("--state-format", default=None,
                    help="how zoffloadd keeps the state: fp32, bf16-moments, q8-moments, "
                         "bf16-master+q8 "
                         "(default: its memory.state_format)")
    ap.add_argument("--text", default=os.path.join(HERE, "data", "shakespeare.txt"))
    args = ap.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    budget = args.pinned_budget
    budget = int(budget[:-1]) * units[budget[-1].upper()] if budget[-1].isalpha() else int(budget)

    text = open(args.text, encoding="utf-8").read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = GPT(len(chars))

    def batch(part):
        src = data[:split] if part == "train" else data[split:]
        ix = torch.randint(len(src) - model.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([src[i:i + model.ctx] for i in ix])
        y = torch.stack([src[i + 1:i + model.ctx + 1] for i in ix])
        return x, y

    # The one line: torch.optim.AdamW(...) becomes zoffload.torch.AdamW(...).
    opt = zoffload.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, job=args.job,
                               socket=args.socket, policy=args.policy, pinned_budget=budget,
                               state_format=args.state_format)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"GPT: {nparams / 1e6:.2f} M parameters, {len(text)} characters of text, "
          f"vocabulary {len(chars)}; optimizer state {nparams * 12 / 2**20:.1f} MiB in zoffloadd "
          f"(job '{args.job}', {args.policy}, {budget / 2**20:.1f} MiB pinned, "
          f"{opt.state_format} state)", flush=True)
    if opt.resumed_step:
        print(f"resuming after step {opt.resumed_step}")
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        x, y = batch("train")
        loss = F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step == 1 or step % 50 == 0 or step == args.steps:
            with torch.no_grad():
                xv, yv = batch("val")
                val = F.cross_entropy(model(xv).reshape(-1, len(chars)), yv.reshape(-1))
            print(f"step {step:4d}  train loss {loss.item():.3f}  val loss {val.item():.3f}  "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)

    # Over several batches: one batch's loss alone is too noisy to compare runs by.
    with torch.no_grad():
        vals = [F.cross_entropy(model(xv).reshape(-1, len(chars)), yv.reshape(-1)).item()
                for xv, yv in (batch("val") for _ in range(8))]
    print(f"final val loss {sum(vals) / len(vals):.6f} (mean of 8 batches)", flush=True)
    out = model.sample(torch.tensor([[chars.index("\n")]]), 200, gen)
    print("sample:\n" + "".join(chars[i] for i in out[0].tolist()[1:]))
    stats = json.loads(opt.stats())
    job = [j for j in json.loads(opt.jobs())["jobs"] if j["name"] == args.job][0]
    lat, pipe = stats["steps"]["latency_ms"], stats["pipeline"]
    print(f"zoffloadd: job '{args.job}': {job['tensors']} tensors, {job['params']} params, "
          f"state {job['pinned_bytes'] / 2**20:.2f} MiB pinned + "
          f"{job['nvme_bytes'] / 2**20:.2f} MiB on NVMe, {job['steps_applied']} steps applied")
    print(f"zoffloadd: kernels {stats['kernel_isa']}, step latency p50 {lat['p50']:.2f} ms, "
          f"p99 {lat['p99']:.2f} ms; NVMe pipeline {pipe['chunks_read']} chunks read, "
          f"{pipe['chunks_written']} written, pinned hit rate {pipe['pinned_hit_rate']:.0%} of the state bytes stepped")
    opt.close()


if __name__ == "__main__":
    main()
