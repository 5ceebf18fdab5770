#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""torch_ref.py - the PyTorch side of `gradjit-bench --compare torch`.

Runs the reference workloads of docs/benchmarks.md in PyTorch eager mode with
exactly the shapes of bench/workloads.c and prints one JSON document on
stdout (progress and warnings go to stderr). gradjit-bench starts it with the
system interpreter (/usr/bin/python3, where Debian's python3-torch lives),
the same thread count, and OPENBLAS_CORETYPE set to the core gradjit uses.

    torch_ref.py [--workloads W1,W2,...] [--steps N] [--warmup N]
                 [--threads N] [--seed N] [--w4-checkpoint 0|1]

Measured per workload, as in gradjit-bench: forward time (the forward call up
to the scalar loss) and backward time (loss.backward() until it returns, every
.grad written), median and minimum over the timed steps after the warm-up
steps; the loss of the first step; for a workload with an update after the
backward (W5's SGD, G1's and G2's AdamW), that update's median time
(upd_ms_median; gradjit-bench leaves it out of its comparison, as it leaves
out its own). Gradients are reset to None between steps
(as gradjit-bench does) and every parameter must have received a .grad.
Weights come from torch.manual_seed(seed): the same distributions as gradjit
(torch.nn.Linear's init, which gradjit copies), not the same numbers, so
losses are comparable only in magnitude.

Exit status: 0 with JSON on stdout; 3 if PyTorch cannot be imported (a
message on stderr says how to install it); 1 on any other failure.
"""
import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import sys
import time

try:
    import torch
    import torch.nn.functional as F
    import torch.utils.checkpoint
except ImportError as e:  # the bench turns this into a clear message
    sys.stderr.write(
        "torch_ref.py: PyTorch is not importable by %s (%s). On Debian: "
        "apt install python3-torch\n" % (sys.executable, e))
    sys.exit(3)


# ----------------------------------------------------------------- helpers

def openblas_libs():
    """Every OpenBLAS library mapped into this process (path -> CDLL)."""
    found = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if path.startswith("/") and ("blas" in path or "lapack" in path) and path not in found:
                    try:
                        lib = ctypes.CDLL(path)
                        lib.openblas_get_corename.restype = ctypes.c_char_p
                        found[path] = lib
                    except (OSError, AttributeError):
                        pass
    except OSError:
        pass
    return found


def blas_info(threads):
    """Sets OpenBLAS's thread count in every loaded copy and reports the core."""
    libs = openblas_libs()
    cores, configs = set(), set()
    for lib in libs.values():
        try:
            lib.openblas_set_num_threads(ctypes.c_int(threads))
        except AttributeError:
            pass
        cores.add(lib.openblas_get_corename().decode())
        try:
            lib.openblas_get_config.restype = ctypes.c_char_p
            configs.add(lib.openblas_get_config().decode())
        except AttributeError:
            pass
    blas_threads = None
    for lib in libs.values():
        try:
            blas_threads = int(lib.openblas_get_num_threads())
        except AttributeError:
            pass
    return {
        "blas_core": ",".join(sorted(cores)) if cores else "not OpenBLAS",
        "blas_config": " | ".join(sorted(configs)),
        "blas_libraries": sorted(libs),
        "blas_threads": blas_threads,
    }


def linear(i, o, dtype=torch.float32):
    lin = torch.nn.Linear(i, o)  # kaiming-uniform weight, uniform bias
    return [lin.weight.detach().to(dtype).requires_grad_(), lin.bias.detach().to(dtype).requires_grad_()]


def layer_norm(c):
    return [torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)]


def mlp3_loss(p, x, labels):
    h = F.gelu(F.linear(x, p[0], p[1]), approximate="tanh")   # [N, H]
    h = F.gelu(F.linear(h, p[2], p[3]), approximate="tanh")   # [N, H]
    return F.cross_entropy(F.linear(h, p[4], p[5]), labels)    # mean over N


# --------------------------------------------------------------- workloads
# Each setup returns (params, forward, after_backward or None).

def w1_setup(args):
    p = linear(784, 1024) + linear(1024, 1024) + linear(1024, 10)
    x = torch.randn(256, 784)
    labels = torch.randint(0, 10, (256,))
    return p, lambda: mlp3_loss(p, x, labels), None


def f1_setup(args):  # the Fashion-MNIST MLP of the main job
    p = linear(784, 512) + linear(512, 256) + linear(256, 10)
    x = torch.randn(128, 784)
    labels = torch.randint(0, 10, (128,))
    return p, lambda: mlp3_loss(p, x, labels), None


def w2_setup(args):
    x, w, b = (torch.randn(4194304).requires_grad_() for _ in range(3))

    def fwd():
        return (torch.tanh(x * w + b) * torch.sigmoid(x) + torch.exp(-(x * x))).sum()
    return [x, w, b], fwd, None


W3_B, W3_T, W3_C, W3_H = 8, 128, 256, 4


def w3_setup(args):
    p = layer_norm(W3_C) + linear(W3_C, 3 * W3_C) + linear(W3_C, W3_C) + layer_norm(W3_C) \
        + linear(W3_C, 4 * W3_C) + linear(4 * W3_C, W3_C)
    x = torch.randn(W3_B, W3_T, W3_C)
    mask = torch.triu(torch.ones(W3_T, W3_T, dtype=torch.bool), diagonal=1)  # key j > query i
    hd = W3_C // W3_H

    def heads(qkv, idx):  # [B,T,3C] -> [B,H,T,hd]
        return qkv.narrow(2, idx * W3_C, W3_C).reshape(W3_B, W3_T, W3_H, hd).permute(0, 2, 1, 3)

    def fwd():
        a = F.layer_norm(x, (W3_C,), p[0], p[1], 1e-5)
        qkv = F.linear(a, p[2], p[3])
        q, k, v = heads(qkv, 0), heads(qkv, 1), heads(qkv, 2)
        att = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(hd))
        att = torch.softmax(att.masked_fill(mask, -1e9), dim=-1)
        y = torch.matmul(att, v).permute(0, 2, 1, 3).reshape(W3_B, W3_T, W3_C)
        h = x + F.linear(y, p[4], p[5])
        m = F.layer_norm(h, (W3_C,), p[6], p[7], 1e-5)
        m = F.linear(F.gelu(F.linear(m, p[8], p[9]), approximate="tanh"), p[10], p[11])
        out = h + m
        return (out * out).mean()
    return p, fwd, None


def w4_setup(args, checkpointed=None):
    if checkpointed is None:
        checkpointed = args.w4_checkpoint
    p = []
    for _ in range(8):
        p += linear(512, 2048) + linear(2048, 512)
    x = torch.randn(128, 512)

    def layer(y, w1, b1, w2, b2):
        return y + F.linear(F.gelu(F.linear(y, w1, b1), approximate="tanh"), w2, b2)

    def fwd():
        y = x
        for l in range(8):
            if checkpointed:
                y = torch.utils.checkpoint.checkpoint(layer, y, *p[4 * l:4 * l + 4],
                                                      use_reentrant=False)
            else:
                y = layer(y, *p[4 * l:4 * l + 4])
        return (y * y).mean()
    return p, fwd, None


W5_LR = 1e-3


def w5_setup(args):
    masters = linear(784, 1024) + linear(1024, 1024) + linear(1024, 10)
    for m in masters:
        m.requires_grad_(False)
    p = [m.to(torch.bfloat16).requires_grad_() for m in masters]
    x = torch.randn(256, 784)
    labels = torch.randint(0, 10, (256,))

    def fwd():
        return mlp3_loss([q.float() for q in p], x, labels)

    def after():  # untimed SGD on the f32 masters, then param = bf16(master)
        with torch.no_grad():
            for q, m in zip(p, masters):
                m.add_(q.grad.float(), alpha=-W5_LR)
                q.copy_(m)
    return p, fwd, after


# GPT-2 as llm.c's train_gpt2.c computes it (G1: 6 layers, 384 channels, 6
# heads; G2: GPT-2 124M), B 4, T 64, the tokens the bytes of G_TEXT, as
# bench/workloads.c; llm.c's AdamW after each backward (timed apart: upd).
G_B, G_T, G_V, G_VP, G_MAXT = 4, 64, 50257, 50304, 1024
G_TEXT = "/usr/share/common-licenses/GPL-3"


def gpt2_setup(args, n_layer, c, n_head):
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * n_layer)

    def normal(rows, cols, sd=std):
        return (torch.randn(rows, cols) * sd).requires_grad_()

    def vec(n, v):
        return torch.full((n,), float(v), requires_grad=True)
    wte = torch.randn(G_VP, c) * std
    wte[G_V:] = 0.0  # llm.c's padded rows
    wte.requires_grad_()
    wpe = normal(G_MAXT, c)
    layers = []
    for _ in range(n_layer):
        layers.append([vec(c, 1), vec(c, 0), normal(3 * c, c), vec(3 * c, 0),
                       normal(c, c, proj_std), vec(c, 0), vec(c, 1), vec(c, 0),
                       normal(4 * c, c), vec(4 * c, 0), normal(c, 4 * c, proj_std), vec(c, 0)])
    lnf = [vec(c, 1), vec(c, 0)]
    with open(G_TEXT, "rb") as f:
        data = f.read(G_B * G_T + 1)
    if len(data) != G_B * G_T + 1:
        raise RuntimeError("%s holds fewer than %d bytes" % (G_TEXT, G_B * G_T + 1))
    x = torch.tensor(list(data[:-1]), dtype=torch.long).view(G_B, G_T)
    y = torch.tensor(list(data[1:]), dtype=torch.long).view(G_B, G_T)
    mask = torch.triu(torch.ones(G_T, G_T, dtype=torch.bool), diagonal=1)
    hs = c // n_head
    pos = torch.arange(G_T)

    def heads(t):  # (B, T, C) -> (B, NH, T, hs)
        return t.reshape(G_B, G_T, n_head, hs).transpose(1, 2)

    def fwd():
        h = F.embedding(x, wte) + F.embedding(pos, wpe)
        for (l1w, l1b, qw, qb, pw, pb, l2w, l2b, fw, fb, f2w, f2b) in layers:
            a = F.layer_norm(h, (c,), l1w, l1b, 1e-5)
            q, k, v = F.linear(a, qw, qb).split(c, dim=2)
            att = torch.matmul(heads(q), heads(k).transpose(2, 3)) * (1.0 / math.sqrt(hs))
            att = torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            o = torch.matmul(att, heads(v)).transpose(1, 2).reshape(G_B, G_T, c)
            h = h + F.linear(o, pw, pb)
            m = F.layer_norm(h, (c,), l2w, l2b, 1e-5)
            h = h + F.linear(F.gelu(F.linear(m, fw, fb), approximate="tanh"), f2w, f2b)
        h = F.layer_norm(h, (c,), lnf[0], lnf[1], 1e-5)
        logits = F.linear(h, wte)  # (B, T, Vp), tied to wte
        return F.cross_entropy(logits[..., :G_V].reshape(-1, G_V), y.reshape(-1))
    params = [wte, wpe] + [t for layer in layers for t in layer] + lnf
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return params, fwd, opt.step


WORKLOADS = {"W1": ("mlp", w1_setup), "W2": ("pointwise", w2_setup), "W3": ("block", w3_setup),
             "W4": ("deep-mlp-ckpt", w4_setup), "W5": ("bf16-mlp", w5_setup),
             "W4N": ("deep-mlp", lambda args: w4_setup(args, checkpointed=False)),
             "F1": ("fashion-mlp", f1_setup),
             "G1": ("gpt2-d6", lambda args: gpt2_setup(args, 6, 384, 6)),
             "G2": ("gpt2-124M", lambda args: gpt2_setup(args, 12, 768, 12))}


# ------------------------------------------------------------------ driver

def run(wid, args):
    name, setup = WORKLOADS[wid]
    torch.manual_seed(args.seed)
    params, fwd, after = setup(args)
    fwd_ms, bwd_ms, upd_ms = [], [], []
    loss_first = loss_last = None
    for i in range(args.warmup + args.steps):
        for q in params:
            q.grad = None
        t0 = time.perf_counter()
        loss = fwd()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for k, q in enumerate(params):
            if q.grad is None or q.grad.dtype != q.dtype:
                raise RuntimeError("%s: parameter %d got no .grad of its dtype" % (wid, k))
        t3 = time.perf_counter()
        if after:
            after()
        t4 = time.perf_counter()
        lv = float(loss.detach())
        if i == 0:
            loss_first = lv
        loss_last = lv
        if i >= args.warmup:
            fwd_ms.append((t1 - t0) * 1e3)
            bwd_ms.append((t2 - t1) * 1e3)
            upd_ms.append((t4 - t3) * 1e3)
    return {"id": wid, "name": name, "mode": "torch-eager", "ok": True, "steps": args.steps,
            "fwd_ms_median": statistics.median(fwd_ms), "fwd_ms_min": min(fwd_ms),
            "bwd_ms_median": statistics.median(bwd_ms), "bwd_ms_min": min(bwd_ms),
            "upd_ms_median": statistics.median(upd_ms) if after else None,
            "loss_first": loss_first, "loss_last": loss_last,
            "param_elems": sum(q.numel() for q in params)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0: one per CPU this process may use")
    ap.add_argument("--seed", type=int, default=20240611)
    ap.add_argument("--w4-checkpoint", type=int, default=0, choices=(0, 1))
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    threads = args.threads if args.threads > 0 else len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    info = blas_info(threads)
    out = {"torch_version": torch.__version__, "python": sys.executable,
           "python_version": platform.python_version(), "threads": torch.get_num_threads(),
           "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
           "w4_checkpoint": bool(args.w4_checkpoint), "steps": args.steps,
           "warmup": args.warmup, "seed": args.seed, "results": []}
    out.update(info)
    status = 0
    for wid in [w.strip().upper() for w in args.workloads.split(",") if w.strip()]:
        if wid not in WORKLOADS:
            ap.error("unknown workload %s" % wid)
        sys.stderr.write("torch_ref.py: %s ...\n" % wid)
        try:
            with torch.autograd.set_grad_enabled(True):
                out["results"].append(run(wid, args))
        except Exception as e:  # report the failure in the JSON, keep going
            out["results"].append({"id": wid, "name": WORKLOADS[wid][0], "mode": "torch-eager",
                                   "ok": False, "error": "%s: %s" % (type(e).__name__, e)})
            status = 1
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
