#!/usr/bin/env python3
"""model_ref: a float64 PyTorch reference of the Qwen3-MoE, Mixtral and DeepSeek-V3 causal
LM forward (written after Hugging Face's modeling_qwen3_moe.py, modeling_mixtral.py and
modeling_deepseek_v3.py: MLA attention with YaRN RoPE, sigmoid group-limited routing,
shared experts) with a PEFT LoRA adapter, for tests/test_model.c and tests/test_mla.c.

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


def yarn_get_mscale(scale=1, mscale=1):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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
        self.deepseek = c["architectures"][0] == "DeepseekV3ForCausalLM"
        self.H, self.Hkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.Dh = c.get("head_dim") or c["hidden_size"] // self.H
        self.eps = c["rms_norm_eps"]
        self.K = c["num_experts_per_tok"]
        if self.deepseek:
            self.mla_init()

    def linear(self, module, x):
        y = x @ self.w[module + ".weight"].T
        p = self.ad.pair(module)
        if p is not None:
            y = y + self.ad.scale * ((x @ p[0].T) @ p[1].T)
        return y

    def rmsnorm(self, x, name, eps=None):
        eps = self.eps if eps is None else eps
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * self.w[name]

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

    # ---- DeepSeek-V3: multi-head latent attention ----

    def mla_init(self):
        c = self.c
        self.qk_nope, self.qk_rope = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        self.v_head, self.kv_rank = c["v_head_dim"], c["kv_lora_rank"]
        self.q_rank = c.get("q_lora_rank")
        self.qk_head = self.qk_nope + self.qk_rope
        rs = c.get("rope_scaling")
        self.scaling = self.qk_head ** -0.5
        self.inv_freq, self.attention_scaling = self.yarn(rs) if rs else (
            1.0 / (c["rope_theta"] ** (torch.arange(0, self.qk_rope, 2) / self.qk_rope)), 1.0)
        if rs and rs.get("mscale_all_dim"):
            m = yarn_get_mscale(rs["factor"], rs["mscale_all_dim"])
            self.scaling = self.scaling * m * m

    def yarn(self, rs):
        """transformers' _compute_yarn_parameters for dim = qk_rope_head_dim."""
        assert rs.get("type", rs.get("rope_type")) == "yarn"
        base, dim, factor = self.c["rope_theta"], self.qk_rope, rs["factor"]
        orig = rs.get("original_max_position_embeddings") or self.c["max_position_embeddings"]
        att = rs.get("attention_factor")
        ms, ms_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if att is None:
            att = (yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, ms_all)
                   if ms and ms_all else yarn_get_mscale(factor))
        beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

        def corr(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2) / dim)
        extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        keep = 1 - ramp
        return inter * (1 - keep) + extra * keep, att

    def rope_mla(self, x, pos):
        """x (H, T, d): RoPE on all d dims, interleaved pairs first when rope_interleave."""
        ang = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat([ang, ang], -1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        h, s, d = x.shape
        if self.c.get("rope_interleave", True):
            x = x.view(h, s, d // 2, 2).transpose(3, 2).reshape(h, s, d)
        rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    def mla(self, l, x, pos, cu):
        p = "model.layers.%d.self_attn." % l
        T, H = x.shape[0], self.H
        if self.q_rank:
            qa = self.rmsnorm(self.linear(p + "q_a_proj", x), p + "q_a_layernorm.weight", 1e-6)
            q = self.linear(p + "q_b_proj", qa)
        else:
            q = self.linear(p + "q_proj", x)
        q = q.view(T, H, self.qk_head).transpose(0, 1)
        q_pass, q_rot = torch.split(q, [self.qk_nope, self.qk_rope], -1)
        ckv = self.linear(p + "kv_a_proj_with_mqa", x)
        k_pass, k_rot = torch.split(ckv, [self.kv_rank, self.qk_rope], -1)
        kv = self.linear(p + "kv_b_proj", self.rmsnorm(k_pass, p + "kv_a_layernorm.weight", 1e-6))
        kv = kv.view(T, H, self.qk_nope + self.v_head).transpose(0, 1)
        k_pass, v = torch.split(kv, [self.qk_nope, self.v_head], -1)
        q_rot = self.rope_mla(q_rot, pos)
        k_rot = self.rope_mla(k_rot.view(1, T, self.qk_rope), pos).expand(H, T, self.qk_rope)
        query, key = torch.cat([q_pass, q_rot], -1), torch.cat([k_pass, k_rot], -1)
        outs = []
        for b in range(len(cu) - 1):
            s0, s1 = cu[b], cu[b + 1]
            n = s1 - s0
            s = query[:, s0:s1] @ key[:, s0:s1].transpose(1, 2) * self.scaling
            mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
            s = s.masked_fill(~mask, float("-inf"))
            outs.append((torch.softmax(s, -1) @ v[:, s0:s1]).transpose(0, 1).reshape(n, -1))
        return self.linear(p + "o_proj", torch.cat(outs, 0))

    def deepseek_moe(self, l, x):
        """DeepseekV3MoE: sigmoid scores, group-limited top-k on scores + bias, shared experts."""
        c, p = self.c, "model.layers.%d.mlp." % l
        E, G = c["n_routed_experts"], c["n_group"]
        scores = torch.sigmoid(x @ self.w[p + "gate.weight"].T)
        choice = scores + self.w[p + "gate.e_score_correction_bias"][None, :]
        gs = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        gi = torch.topk(gs, k=c["topk_group"], dim=-1, sorted=False)[1]
        gm = torch.zeros_like(gs).scatter_(1, gi, 1)
        sm = gm.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        choice = choice.masked_fill(~sm.bool(), 0.0)
        topi = torch.topk(choice, k=self.K, dim=-1, sorted=False)[1]
        topw = scores.gather(1, topi)
        if c.get("norm_topk_prob"):
            topw = topw / (topw.sum(-1, keepdim=True) + 1e-20)
        topw = topw * c["routed_scaling_factor"]
        out = torch.zeros_like(x)
        for e in range(E):
            rows, slot = torch.nonzero(topi == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.mlp(p + "experts.%d." % e, x[rows])
            out = out.index_add(0, rows, topw[rows, slot][:, None] * y)
        if c.get("n_shared_experts"):
            out = out + self.mlp(p + "shared_experts.", x)
        return out

    def mlp(self, prefix, x, names=("gate_proj", "up_proj", "down_proj")):
        g = self.linear(prefix + names[0], x)
        u = self.linear(prefix + names[1], x)
        return self.linear(prefix + names[2], torch.nn.functional.silu(g) * u)

    def is_moe(self, l):
        c = self.c
        if self.mixtral:
            return True
        if self.deepseek:
            return l >= c.get("first_k_dense_replace", 0) and l % c.get("moe_layer_freq", 1) == 0
        return l not in c.get("mlp_only_layers", []) and (l + 1) % c.get("decoder_sparse_step", 1) == 0

    def moe(self, l, x):
        if self.deepseek:
            return self.deepseek_moe(l, x)
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
            attn = self.mla if self.deepseek else self.attention
            x = x + attn(l, self.rmsnorm(x, p + "input_layernorm.weight"), pos, cu)
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
