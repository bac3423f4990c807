"""make_golden: golden tensors of the PyTorch reference (torch_model.py) for one model,
adapter and packed batch, written as a safetensors file.

usage: make_golden.py --model DIR [--adapter DIR] --inputs IN.safetensors --out OUT.safetensors

IN holds the batch and the loss:
  tokens (T) I32, positions (T) I32, cu_seqlens (B + 1) I32, targets (T) I32 (-1: none),
  dlogp (T) F32, dentropy (T) F32: the loss is
      loss = sum_t dlogp[t] logp[t] + sum_t dentropy[t] entropy[t] + aux,
  aux = sum over MoE layers of aux_coef * E * sum_e f_e P_e (moerl's balance loss; 0 when
  aux_coef is 0), or with aux_pool = 1 transformers' load_balancing_loss_func over all
  MoE layers times aux_coef / K (softmax routers); metadata: temperature, aux_coef,
  aux_pool (0 if absent), and the AdamW run: adamw_steps, lr, beta1, beta2, eps,
  weight_decay.

OUT holds:
  logp (T), entropy (T), loss (1), aux_loss (1), aux_loss_hf (1): transformers' pooled
  load_balancing_loss_func times aux_coef / K (equal to aux_loss for one MoE layer;
  0 for sigmoid routers),
  routing (T, M, K) I32 the experts each MoE layer chose (descending probability),
  grad.<PEFT key> the gradient of loss for every adapter tensor,
  adamw.<PEFT key> the adapter tensors after adamw_steps steps of torch.optim.AdamW on
  loss (forward, backward, step, each step), adamw_loss (adamw_steps) the loss before
  each step.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_model as tm  # noqa: E402


def loss_of(model, batch, meta, routing):
    logp, ent = model.logprobs(batch["tokens"], batch["positions"], batch["cu_seqlens"],
                               batch["targets"], float(meta["temperature"]), routing)
    loss = (batch["dlogp"] * logp).sum() + (batch["dentropy"] * ent).sum()
    aux = torch.zeros(())
    coef = float(meta.get("aux_coef", "0"))
    if coef > 0 and routing and meta.get("aux_pool", "0") == "1":
        aux = tm.balance_loss_hf(routing, model.cfg.E, model.cfg.K, coef / model.cfg.K)
    elif coef > 0 and routing:
        aux = tm.balance_loss_per_layer(routing, model.cfg.E, model.cfg.K, coef,
                                        model.cfg.scoring == "sigmoid")
    return logp, ent, loss + aux, aux


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    batch, meta = tm.st_load(a.inputs)
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    model = tm.MoeModel.load(a.model, a.adapter)
    ad = model.adapter
    if ad is not None:
        ad.requires_grad_(True)

    routing = []
    logp, ent, loss, aux = loss_of(model, batch, meta, routing)
    out = {"logp": logp.detach(), "entropy": ent.detach(),
           "loss": loss.detach().reshape(1).float(), "aux_loss": aux.detach().reshape(1).float()}
    coef = float(meta.get("aux_coef", "0"))
    hf = torch.zeros(())
    if routing and model.cfg.scoring == "softmax":
        hf = tm.balance_loss_hf(routing, model.cfg.E, model.cfg.K, coef / model.cfg.K)
    out["aux_loss_hf"] = hf.detach().reshape(1).float()
    if routing:
        out["routing"] = torch.stack([idx for _, idx in routing], dim=1).to(torch.int32)
    if ad is not None:
        params = ad.params()
        grads = torch.autograd.grad(loss, [t for _, t in params], allow_unused=True)
        for (key, t), g in zip(params, grads):
            out["grad." + key] = (torch.zeros_like(t) if g is None else g).detach()
        steps = int(meta.get("adamw_steps", "0"))
        if steps > 0:
            opt = torch.optim.AdamW([t for _, t in params], lr=float(meta["lr"]),
                                    betas=(float(meta["beta1"]), float(meta["beta2"])),
                                    eps=float(meta["eps"]),
                                    weight_decay=float(meta["weight_decay"]))
            losses = []
            for _ in range(steps):
                opt.zero_grad()
                loss = loss_of(model, batch, meta, [])[2]
                losses.append(float(loss))
                loss.backward()
                for _, t in params:
                    if t.grad is None:
                        t.grad = torch.zeros_like(t)
                opt.step()
            for key, t in params:
                out["adamw." + key] = t.detach().clone()
            out["adamw_loss"] = torch.tensor(losses, dtype=torch.float32)
    tm.st_save(a.out, out, {"format": "pt"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
