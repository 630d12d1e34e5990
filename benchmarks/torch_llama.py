"""The torch side of `torch_pipeline.py`: a plain llama in torch (RMSNorm, NeoX-style RoPE, SwiGLU,
causal `F.scaled_dot_product_attention`), cut into pipeline stages, and the two torch workers: the
unpipelined step in one process and one rank of the 4-process `torch.distributed.pipelining` step.
The driver, the measurement and the jaxpar side are in `torch_pipeline.py`, which starts these."""

from __future__ import annotations

import datetime
import json
import sys
import time

from torch_pipeline import (ADAM, CLIP, EPS, INIT_STD, MICRO, P, malloc_trim, peak_rss, reset_peak_rss, say,
                            torch_schedule_of)


def torch_model_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight

    def rope(x, cos, sin):  # x [B, N, T, H]; the two halves of each head rotate (jaxpar's convention)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    class Block(nn.Module):
        def __init__(self, a):
            super().__init__()
            D, N, K, F_ = a.d_model, a.heads, a.kv_heads, a.d_ff
            self.N, self.K, self.H = N, K, D // N
            self.attn_norm, self.mlp_norm = RMSNorm(D), RMSNorm(D)
            self.wq = nn.Linear(D, N * self.H, bias=False)
            self.wk = nn.Linear(D, K * self.H, bias=False)
            self.wv = nn.Linear(D, K * self.H, bias=False)
            self.wo = nn.Linear(N * self.H, D, bias=False)
            self.w_gate = nn.Linear(D, F_, bias=False)
            self.w_up = nn.Linear(D, F_, bias=False)
            self.w_down = nn.Linear(F_, D, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).view(B, T, self.N, self.H).transpose(1, 2)
            k = self.wk(h).view(B, T, self.K, self.H).transpose(1, 2)
            v = self.wv(h).view(B, T, self.K, self.H).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.K != self.N)
            x = x + self.wo(o.transpose(1, 2).reshape(B, T, self.N * self.H))
            h = self.mlp_norm(x)
            return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    class Llama(nn.Module):
        """Layers [lo, hi) of the model, with the embedding if lo == 0 and the head if hi == n_layers."""

        def __init__(self, a, lo: int = 0, hi: int | None = None):
            super().__init__()
            hi = a.layers if hi is None else hi
            self.first, self.last = lo == 0, hi == a.layers
            H = a.d_model // a.heads
            inv = 1.0 / 10000.0 ** (torch.arange(0, H, 2, dtype=torch.float32) / H)
            ang = torch.arange(a.seq, dtype=torch.float32)[:, None] * inv[None, :]
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
            # Every rank draws the whole model from one seed and keeps its layers: the pipeline's
            # stages together are the unpipelined model.
            g = torch.Generator().manual_seed(0)
            blocks = [Block(a) for _ in range(a.layers)]
            embed, norm, head = nn.Embedding(a.vocab, a.d_model), RMSNorm(a.d_model), nn.Linear(a.d_model, a.vocab, False)
            out_std = INIT_STD / (2 * a.layers) ** 0.5  # residual-branch outputs, as jaxpar
            for mod in [embed, head] + blocks:
                for name, prm in mod.named_parameters():
                    if prm.dim() >= 2:
                        std = out_std if name.endswith(("wo.weight", "w_down.weight")) else INIT_STD
                        with torch.no_grad():
                            prm.normal_(0.0, std, generator=g)
            self.embed = embed if self.first else None
            self.blocks = nn.ModuleList(blocks[lo:hi])
            self.norm, self.head = (norm, head) if self.last else (None, None)

        def forward(self, x):
            if self.first:
                x = self.embed(x)
            for b in self.blocks:
                x = b(x, self.cos, self.sin)
            if self.last:
                x = self.head(self.norm(x))
            return x

    return Llama


def torch_adamw(model):
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": ADAM["weight_decay"]},
                              {"params": other, "weight_decay": 0.0}],
                             lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"])


def torch_loss(logits, targets):
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_batches(args, m: int, n: int):
    import torch
    g = torch.Generator().manual_seed(1000 + m)
    return [torch.randint(0, args.vocab, (MICRO * m, args.seq + 1), generator=g) for _ in range(n)]


def load_jaxpar_params(model, path: str, a) -> None:
    """jaxpar's parameter tree (an npz from the jaxpar worker's `dump`) copied into the torch model."""
    import numpy as np
    import torch

    z = np.load(path)
    D, N, K, H = a.d_model, a.heads, a.kv_heads, a.d_model // a.heads
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
    with torch.no_grad():
        model.embed.weight.copy_(t(z["embed"]))
        model.head.weight.copy_(t(z["lm_head"].T))
        model.norm.weight.copy_(t(z["final_norm/scale"]))
        for i, b in enumerate(model.blocks):
            b.attn_norm.weight.copy_(t(z["blocks/attn_norm/scale"][i]))
            b.mlp_norm.weight.copy_(t(z["blocks/mlp_norm/scale"][i]))
            b.wq.weight.copy_(t(z["blocks/attn/wq"][i].reshape(D, N * H).T))
            b.wk.weight.copy_(t(z["blocks/attn/wk"][i].reshape(D, K * H).T))
            b.wv.weight.copy_(t(z["blocks/attn/wv"][i].reshape(D, K * H).T))
            b.wo.weight.copy_(t(z["blocks/attn/wo"][i].reshape(N * H, D).T))
            b.w_gate.weight.copy_(t(z["blocks/mlp/w_gate"][i].T))
            b.w_up.weight.copy_(t(z["blocks/mlp/w_up"][i].T))
            b.w_down.weight.copy_(t(z["blocks/mlp/w_down"][i].T))


def torch_plain_worker(args) -> int:
    import torch

    torch.set_num_threads(args.torch_threads)
    Llama = torch_model_classes()
    n = args.warmup + args.rounds + args.mem_steps + 1
    runs = {}
    for m in args.microbatches:
        model = Llama(args)
        runs[f"m{m}"] = {"model": model, "opt": torch_adamw(model), "batches": torch_batches(args, m, n), "next": 0}

    def one_step(r):
        tok = r["batches"][r["next"] % len(r["batches"])]
        r["next"] += 1
        r["opt"].zero_grad(set_to_none=True)
        loss = torch_loss(r["model"](tok[:, :-1]), tok[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(r["model"].parameters(), CLIP)
        r["opt"].step()
        return float(loss.detach())

    for r in runs.values():
        for _ in range(args.warmup):
            one_step(r)
    say("ready", threads=torch.get_num_threads(), torch_version=torch.__version__)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "check":
            import numpy as np
            model = Llama(args)
            load_jaxpar_params(model, cmd["path"], args)
            batch = torch.from_numpy(np.load(cmd["path"])["batch"].astype(np.int64))
            with torch.no_grad():
                loss = float(torch_loss(model(batch[:, :-1]), batch[:, 1:]))
            say("check", loss=loss)
            continue
        r = runs[cmd["key"]]
        if cmd["cmd"] == "step":
            rss0 = reset_peak_rss()
            t, c = time.perf_counter(), time.process_time()
            loss = one_step(r)
            s, cpu = time.perf_counter() - t, time.process_time() - c
            say("step", s=s, cpu_s=cpu, rss_growth_untrimmed=peak_rss() - rss0, loss=loss)
        elif cmd["cmd"] == "mem":
            malloc_trim()
            rss0 = reset_peak_rss()
            one_step(r)
            say("mem", rss_growth=peak_rss() - rss0, rss_before=rss0)
    return 0


def torch_pipe_worker(args) -> int:
    """One rank of the 4-process torch pipeline; rank 0 talks to the driver and broadcasts its commands."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    rank = args.rank
    dist.init_process_group("gloo", rank=rank, world_size=P, timeout=datetime.timedelta(hours=2))
    Llama = torch_model_classes()
    per = args.layers // P
    first, last = rank == 0, rank == P - 1
    n = args.warmup + args.rounds + args.mem_steps + 1
    classes = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}
    wanted = list(dict.fromkeys(torch_schedule_of(s) for s in args.schedules))
    runs = {}
    for name in wanted:
        for m in args.microbatches:
            model = Llama(args, rank * per, (rank + 1) * per)
            example = (torch.zeros(MICRO, args.seq, dtype=torch.long) if first
                       else torch.zeros(MICRO, args.seq, args.d_model))
            stage = PipelineStage(model, rank, P, torch.device("cpu"), input_args=(example,))
            sched = classes[name](stage, n_microbatches=m, loss_fn=torch_loss, scale_grads=True)
            runs[f"{name}/m{m}"] = {"model": model, "opt": torch_adamw(model), "sched": sched,
                                    "batches": torch_batches(args, m, n), "next": 0}

    def one_step(r):
        tok = r["batches"][r["next"] % len(r["batches"])]
        r["next"] += 1
        r["opt"].zero_grad(set_to_none=True)
        losses = []
        if first:
            r["sched"].step(tok[:, :-1].contiguous(), return_outputs=False)
        elif last:
            r["sched"].step(target=tok[:, 1:].contiguous(), losses=losses, return_outputs=False)
        else:
            r["sched"].step(return_outputs=False)
        # Global-norm clipping over the 4 stages' disjoint parameters: one all-reduce of a scalar.
        grads = [p.grad for p in r["model"].parameters() if p.grad is not None]
        sq = torch.stack([g.pow(2).sum() for g in grads]).sum()
        dist.all_reduce(sq)
        scale = torch.clamp(CLIP / (sq.sqrt() + 1e-6), max=1.0)
        torch._foreach_mul_(grads, scale)
        r["opt"].step()
        return float(torch.stack(losses).detach().mean()) if losses else None

    for r in runs.values():
        for _ in range(args.warmup):
            one_step(r)
    if first:
        say("ready", threads=torch.get_num_threads(), torch_version=torch.__version__,
            schedules={k: type(r["sched"]).__name__ for k, r in runs.items()})
    while True:
        box = [None]
        if first:
            line = sys.stdin.readline()
            box = [json.loads(line) if line.strip() else {"cmd": "quit"}]
        dist.broadcast_object_list(box, src=0)
        cmd = box[0]
        if cmd["cmd"] == "quit":
            break
        r = runs[cmd["key"]]
        if cmd["cmd"] == "step":
            rss0 = reset_peak_rss()
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            loss = one_step(r)
            cpu = time.process_time() - c
            hwm = peak_rss()
            dist.barrier()
            res = {"s": time.perf_counter() - t, "cpu_s": cpu, "rss_growth_untrimmed": hwm - rss0, "loss": loss}
        else:  # mem
            malloc_trim()
            rss0 = reset_peak_rss()
            dist.barrier()
            one_step(r)
            res = {"rss_growth": peak_rss() - rss0, "rss_before": rss0}
            dist.barrier()
        gathered = [None] * P if first else None
        dist.gather_object(res, gathered, dst=0)
        if first:
            if cmd["cmd"] == "step":
                say("step", s=gathered[0]["s"], cpu_s=sum(g["cpu_s"] for g in gathered),
                    cpu_s_per_rank=[g["cpu_s"] for g in gathered],
                    rss_growth_untrimmed=[g["rss_growth_untrimmed"] for g in gathered], loss=gathered[-1]["loss"])
            else:
                say("mem", rss_growth=[g["rss_growth"] for g in gathered],
                    rss_before=[g["rss_before"] for g in gathered])
    dist.destroy_process_group()
    return 0
