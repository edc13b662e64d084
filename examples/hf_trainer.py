#!/usr/bin/env python3
"""A small GPT-2 (built from a config: nothing is downloaded) trained by Hugging Face's
transformers.Trainer on examples/data/shakespeare.txt, every optimizer step done by zoffloadd
through zoffload.torch.AdamW.  The change from a plain Trainer script is the optimizer:

    args = TrainingArguments(...)        # first: under torchrun it sets up torch.distributed
    opt = zoffload.torch.AdamW(model.parameters(), lr=args.learning_rate,
                               weight_decay=args.weight_decay, job="hf-gpt2")
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))

The Trainer still makes the learning-rate schedule (cosine here), clips gradients, logs, saves
checkpoint-N/ (optimizer.pt is opt.state_dict(), read from the daemon) and resumes from one
(--resume-from): opt.load_state_dict() writes the state back into the daemon.  Under torchrun
(DDP over gloo on the CPU) every rank keeps its own copy of the state in the daemon; they are
equal, since DDP all-reduces the gradients, which is why the Trainer's rank-0 optimizer.pt is
all a resume needs.

    PYTHONPATH=build/python $VENV/bin/python examples/hf_trainer.py --socket /tmp/zoffload.sock
    torchrun --nproc-per-node 2 examples/hf_trainer.py --socket ... --job hf-ddp

--optimizer torch trains the same run with torch.optim.AdamW, for comparison.
"""
import argparse
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class CharData(torch.utils.data.Dataset):
    """Fixed windows of a text as character ids: input_ids, and the same as labels (GPT-2
    shifts them itself)."""

    def __init__(self, text, vocab, ctx):
        self.ids = torch.tensor([vocab[c] for c in text], dtype=torch.long)
        self.ctx = ctx

    def __len__(self):
        return (len(self.ids) - 1) // self.ctx

    def __getitem__(self, i):
        x = self.ids[i * self.ctx:(i + 1) * self.ctx]
        return {"input_ids": x, "labels": x.clone()}


def build(ctx=64, layers=2, d=64, heads=4, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    with open(os.path.join(HERE, "data", "shakespeare.txt")) as f:
        text = f.read()
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=ctx, n_embd=d, n_layer=layers,
                     n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg), CharData(text, vocab, ctx)


def train(output_dir, steps, *, optimizer="zoffload", socket=None, job="hf-gpt2",
          save_steps=0, resume_from=None, lr=3e-3, batch=8, seed=0, **zoffload_kw):
    """Trains steps steps; returns (trainer, losses by step).  Its final params are
    trainer.model's."""
    from transformers import Trainer, TrainingArguments

    import zoffload.torch

    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch,
        learning_rate=lr, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, seed=seed, data_seed=seed, report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True)
    model, data = build(seed=seed)
    if optimizer == "zoffload":
        opt = zoffload.torch.AdamW(model.parameters(), lr=lr, weight_decay=0.01, job=job,
                                   socket=socket, **zoffload_kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume_from)
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    return trainer, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=os.environ.get("ZOFFLOAD_SOCKET"))
    ap.add_argument("--job", default=os.environ.get("ZOFFLOAD_JOB", "hf-gpt2"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--output-dir", default="hf-gpt2-out")
    ap.add_argument("--resume-from", help="a checkpoint-N directory the Trainer saved")
    ap.add_argument("--optimizer", choices=["zoffload", "torch"], default="zoffload")
    ap.add_argument("--policy", help="cpu, nvme or auto (default: the daemon's)")
    ap.add_argument("--params-out", help="save the final parameters here (torch.save; "
                    "under torchrun each rank's into PARAMS_OUT.rankN)")
    a = ap.parse_args()
    kw = {"policy": a.policy} if a.policy else {}
    trainer, losses = train(a.output_dir, a.steps, optimizer=a.optimizer, socket=a.socket,
                            job=a.job, save_steps=a.save_steps, resume_from=a.resume_from, **kw)
    if a.params_out:
        world = trainer.args.world_size
        out = a.params_out + (f".rank{trainer.args.process_index}" if world > 1 else "")
        torch.save([p.detach().clone() for p in trainer.model.parameters()], out)
    if trainer.args.process_index == 0:
        print(json.dumps({"losses": losses}))
    if a.optimizer == "zoffload":
        trainer.optimizer.optimizer.close()


if __name__ == "__main__":
    main()
