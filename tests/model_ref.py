#!/usr/bin/env python3
"""model_ref: a float64 PyTorch reference of the Qwen3-MoE and Mixtral causal LM forward
(written after Hugging Face's modeling_qwen3_moe.py and modeling_mixtral.py) with a PEFT
LoRA adapter, for tests/test_model.c.

usage: model_ref.py MODEL_DIR ADAPTER_DIR BATCH_JSON

BATCH_JSON holds tokens, positions, cu (B + 1), targets (-1: none), temperature and the
objective weights a, b. Prints three blocks, one number per line:
  # logp     log p(target) per token at the temperature (0 without a target)
  # entropy  entropy of each token's next-token distribution
  # grads    d/dparams of sum_t a_t logp_t + b_t entropy_t, in the adapter file's order
"""
import json
import math
import struct
import sys

import numpy as np
import torch

torch.set_default_dtype(torch.float64)


def load_safetensors(path):
    """name -> (float64 tensor, data offset) for every tensor of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[base + b : base + e]
        dt = info["dtype"]
        if dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif dt == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32).astype(np.float64)
        elif dt == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float64)
        else:
            raise SystemExit("model_ref: unsupported dtype %s of %s" % (dt, name))
        out[name] = (torch.from_numpy(arr.copy()).reshape(info["shape"]), b)
    return out


class Adapter:
    def __init__(self, d):
        cfg = json.load(open(d + "/adapter_config.json"))
        r, alpha = cfg["r"], cfg["lora_alpha"]
        self.scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        tensors = load_safetensors(d + "/adapter_model.safetensors")
        self.order = sorted(tensors, key=lambda k: tensors[k][1])
        self.params = {}
        for k in self.order:
            self.params[k] = tensors[k][0].clone().requires_grad_(True)

    def pair(self, module):
        a = self.params.get("base_model.model." + module + ".lora_A.weight")
        b = self.params.get("base_model.model." + module + ".lora_B.weight")
        return (a, b) if a is not None else None

    def grads(self):
        g = [self.params[k].grad for k in self.order]  # None for idle experts
        return torch.cat([torch.zeros(self.params[k].numel()) if gi is None else gi.reshape(-1)
                          for k, gi in zip(self.order, g)])


class Model:
    def __init__(self, d, adapter):
        self.c = json.load(open(d + "/config.json"))
        self.w = {k: v[0] for k, v in load_safetensors(d + "/model.safetensors").items()}
        self.ad = adapter
        c = self.c
        self.mixtral = c["architectures"][0] == "MixtralForCausalLM"
        self.H, self.Hkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.Dh = c.get("head_dim") or c["hidden_size"] // self.H
        self.eps = c["rms_norm_eps"]
        self.K = c["num_experts_per_tok"]

    def linear(self, module, x):
        y = x @ self.w[module + ".weight"].T
        p = self.ad.pair(module)
        if p is not None:
            y = y + self.ad.scale * ((x @ p[0].T) @ p[1].T)
        return y

    def rmsnorm(self, x, name):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rope(self, x, pos):
        Dh = self.Dh
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, Dh, 2) / Dh))
        ang = pos[:, None] * inv[None, :]
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        rot = torch.cat([-x[..., Dh // 2 :], x[..., : Dh // 2]], -1)
        return x * cos + rot * sin

    def window(self, l):
        c = self.c
        sw = c.get("sliding_window") or 0
        if self.mixtral:
            return sw
        if not c.get("use_sliding_window"):
            return 0
        return sw if l >= c.get("max_window_layers", 28) else 0

    def attention(self, l, x, pos, cu):
        p = "model.layers.%d.self_attn." % l
        T = x.shape[0]
        q = self.linear(p + "q_proj", x).reshape(T, self.H, self.Dh)
        k = self.linear(p + "k_proj", x).reshape(T, self.Hkv, self.Dh)
        v = self.linear(p + "v_proj", x).reshape(T, self.Hkv, self.Dh)
        if not self.mixtral:
            q = self.rmsnorm(q, p + "q_norm.weight")
            k = self.rmsnorm(k, p + "k_norm.weight")
        q, k = self.rope(q, pos), self.rope(k, pos)
        G = self.H // self.Hkv
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        win = self.window(l)
        outs = []
        for b in range(len(cu) - 1):
            s0, s1 = cu[b], cu[b + 1]
            n = s1 - s0
            qs, ks, vs = q[s0:s1].transpose(0, 1), k[s0:s1].transpose(0, 1), v[s0:s1].transpose(0, 1)
            s = qs @ ks.transpose(1, 2) / math.sqrt(self.Dh)
            i = torch.arange(n)[:, None]
            j = torch.arange(n)[None, :]
            mask = j <= i
            if win > 0:
                mask = mask & (i - j < win)
            s = s.masked_fill(~mask, float("-inf"))
            outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1).reshape(n, -1))
        return self.linear(p + "o_proj", torch.cat(outs, 0))

    def mlp(self, prefix, x, names=("gate_proj", "up_proj", "down_proj")):
        g = self.linear(prefix + names[0], x)
        u = self.linear(prefix + names[1], x)
        return self.linear(prefix + names[2], torch.nn.functional.silu(g) * u)

    def is_moe(self, l):
        c = self.c
        if self.mixtral:
            return True
        return l not in c.get("mlp_only_layers", []) and (l + 1) % c.get("decoder_sparse_step", 1) == 0

    def moe(self, l, x):
        blk = "block_sparse_moe" if self.mixtral else "mlp"
        p = "model.layers.%d.%s." % (l, blk)
        probs = torch.softmax(x @ self.w[p + "gate.weight"].T, -1)
        topw, topi = torch.topk(probs, self.K, dim=-1)
        if self.mixtral or self.c.get("norm_topk_prob"):
            topw = topw / topw.sum(-1, keepdim=True)
        names = ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")
        out = torch.zeros_like(x)
        E = probs.shape[1]
        for e in range(E):
            rows, slot = torch.nonzero(topi == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.mlp(p + "experts.%d." % e, x[rows], names)
            out = out.index_add(0, rows, topw[rows, slot][:, None] * y)
        return out

    def forward(self, tokens, pos, cu):
        x = self.w["model.embed_tokens.weight"][tokens]
        for l in range(self.c["num_hidden_layers"]):
            p = "model.layers.%d." % l
            x = x + self.attention(l, self.rmsnorm(x, p + "input_layernorm.weight"), pos, cu)
            h = self.rmsnorm(x, p + "post_attention_layernorm.weight")
            x = x + (self.moe(l, h) if self.is_moe(l) else self.mlp(p + "mlp.", h))
        x = self.rmsnorm(x, "model.norm.weight")
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return x @ head.T


def main():
    model_dir, adapter_dir, batch_path = sys.argv[1:4]
    b = json.load(open(batch_path))
    ad = Adapter(adapter_dir)
    m = Model(model_dir, ad)
    tokens = torch.tensor(b["tokens"], dtype=torch.long)
    pos = torch.tensor(b["positions"], dtype=torch.float64)
    targets = torch.tensor(b["targets"], dtype=torch.long)
    logits = m.forward(tokens, pos, b["cu"]) / b["temperature"]
    lsm = torch.log_softmax(logits, -1)
    has = targets >= 0
    logp = torch.where(has, lsm.gather(1, targets.clamp(min=0)[:, None])[:, 0], torch.zeros(()))
    ent = -(lsm.exp() * lsm).sum(-1)
    loss = (torch.tensor(b["a"]) * logp).sum() + (torch.tensor(b["b"]) * ent).sum()
    loss.backward()
    out = ["# logp"] + ["%.17g" % v for v in logp.tolist()]
    out += ["# entropy"] + ["%.17g" % v for v in ent.tolist()]
    out += ["# grads"] + ["%.17g" % v for v in ad.grads().tolist()]
    print("\n".join(out))


if __name__ == "__main__":
    main()
