"""train_peer: the PyTorch side of bench_train_step: the same LoRA training step (forward
with logprobs and entropy, backward to the adapter's gradients only) in eager PyTorch on
the same model, adapter and batch (tests/golden/torch_model.py, float32).

usage: train_peer.py --model DIR --adapter DIR --batch batch.safetensors [--threads N]
                     [--steps S] [--warmup W]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "golden"))
import torch_model as tm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = tm.MoeModel.load(a.model, a.adapter)
    params = [t for _, t in model.adapter.requires_grad_(True).params()]
    batch, meta = tm.st_load(a.batch)
    temperature = float(meta.get("temperature", "1"))
    T = batch["tokens"].numel()
    fwd, bwd, cpu, loss0 = [], [], [], None
    for i in range(a.warmup + a.steps):
        c0, t0 = time.process_time(), time.perf_counter()
        for p in params:
            p.grad = None
        logp, ent = model.logprobs(batch["tokens"], batch["positions"], batch["cu_seqlens"],
                                   batch["targets"], temperature)
        loss = (batch["dlogp"] * logp).sum() + (batch["dentropy"] * ent).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2, c2 = time.perf_counter(), time.process_time()
        if i == 0:
            loss0 = float(loss)
        if i >= a.warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            cpu.append(c2 - c0)
    steps = [f + b for f, b in zip(fwd, bwd)]
    mt, mf, mb, mc = (statistics.median(x) for x in (steps, fwd, bwd, cpu))
    print("torch %s: %d threads; step (median of %d): %.1f ms = forward %.1f + backward %.1f; "
          "%.0f tokens/s; CPU time %.1f ms per step"
          % (torch.__version__, torch.get_num_threads(), a.steps, 1e3 * mt, 1e3 * mf, 1e3 * mb,
             T / mt, 1e3 * mc))
    print("RESULT torch tokens_per_s=%.1f step_ms=%.2f fwd_ms=%.2f bwd_ms=%.2f cpu_ms=%.2f "
          "loss0=%.9g" % (T / mt, 1e3 * mt, 1e3 * mf, 1e3 * mb, 1e3 * mc, loss0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
