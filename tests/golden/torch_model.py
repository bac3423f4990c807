"""torch_model: a compact float32 PyTorch reference of the Hugging Face Qwen3-MoE, Mixtral
and DeepSeek-V3 (Kimi K2) causal language models, with LoRA adapters in the PEFT layout.

It computes what transformers' modeling_qwen3_moe.py / modeling_mixtral.py /
modeling_deepseek_v3.py compute for a checkpoint whose weights are read in float32
(bf16 / f16 weights are widened to float32 first): embedding, RMSNorm, q/k/v/o
projections, Qwen3's per-head q/k RMSNorm, rotary embedding (rotate-half, with linear /
llama3 / yarn scaling), causal grouped-query attention with an optional sliding window,
DeepSeek's multi-head latent attention (latent q and kv projections with their norms, a
shared rope key, the interleaved rope layout, yarn's squared attention scale), the MoE
block (softmax router, top-k, norm_topk_prob; DeepSeek's sigmoid router with selection
bias, group limit and routed scaling; shared experts; SwiGLU experts), dense MLP layers,
the final norm and lm_head (tied or not). A LoRA adapter adds scale * B (A x) to every
projection it names.

Only torch, json and struct are used: no transformers, no safetensors package.

Shapes: T tokens of a packed batch, B sequences (cu_seqlens (B + 1)), D width, H query
heads, Hkv kv heads, Dh head dim, E experts, K experts per token, F expert hidden width,
V vocabulary, R LoRA rank.
"""

import json
import math
import os
import struct

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# safetensors

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def st_load(path):
    """Reads a safetensors file: ({name: tensor}, {metadata}). Tensors share one buffer."""
    with open(path, "rb") as f:
        buf = bytearray(f.read())
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for name, info in header.items():
        if info["dtype"] not in ST_DTYPES:
            raise ValueError("%s: tensor %s has unsupported dtype %s" % (path, name, info["dtype"]))
        dt = ST_DTYPES[info["dtype"]]
        shape = info["shape"]
        b, e = info["data_offsets"]
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dt).element_size()
        if e - b != numel * itemsize:
            raise ValueError("%s: tensor %s: %d bytes for shape %s" % (path, name, e - b, shape))
        if numel == 0:
            out[name] = torch.zeros(shape, dtype=dt)
        else:
            out[name] = torch.frombuffer(buf, dtype=dt, count=numel, offset=base + b).reshape(shape)
    return out, meta


def st_save(path, tensors, metadata=None):
    """Writes {name: tensor} (contiguous CPU tensors) as safetensors, largest elements first
    so that every tensor is aligned to its element size."""
    items = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, t in items:
        t = t.detach().contiguous().cpu()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


def load_checkpoint(model_dir):
    """All tensors of model.safetensors or of the shards an index names, as float32."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    files = [os.path.join(model_dir, "model.safetensors")]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(os.path.join(model_dir, s)
                               for s in json.load(f)["weight_map"].values()))
    weights = {}
    for path in files:
        tensors, _ = st_load(path)
        for name, t in tensors.items():
            weights[name] = t.float() if t.is_floating_point() else t
    return weights


# ---------------------------------------------------------------------------
# config.json, with the Hugging Face defaults of each family

class Config:
    def __init__(self, j):
        mt = j.get("model_type", "")
        if mt not in ("qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2"):
            raise ValueError("model_type %r is not one of qwen3_moe, mixtral, deepseek_v3" % mt)
        self.model_type = mt
        self.family = {"kimi_k2": "deepseek_v3"}.get(mt, mt)
        qwen, mix = self.family == "qwen3_moe", self.family == "mixtral"
        g = j.get
        self.V = g("vocab_size")
        self.D = g("hidden_size")
        self.L = g("num_hidden_layers")
        self.H = g("num_attention_heads")
        # HF: num_key_value_heads defaults to 4 (Qwen3-MoE) / 8 (Mixtral) when absent, to H
        # when null.
        hkv = j["num_key_value_heads"] if "num_key_value_heads" in j else (4 if qwen else 8)
        self.Hkv = self.H if hkv is None else hkv
        self.Dh = g("head_dim") or self.D // self.H
        self.eps = g("rms_norm_eps", 1e-6 if qwen else 1e-5 if mix else 1e-6)
        self.tie = bool(g("tie_word_embeddings", False))
        self.max_pos = g("max_position_embeddings", 32768 if qwen else 131072 if mix else 4096)
        rp = g("rope_scaling") or g("rope_parameters") or {}
        self.rope_theta = float(g("rope_theta", rp.get("rope_theta",
                                                       10000.0 if qwen else 1e6 if mix else 1e4)))
        rtype = rp.get("rope_type", rp.get("type", "default"))
        self.rope_scaling = dict(rp, rope_type=rtype) if rtype != "default" else None
        self.aux_coef = g("router_aux_loss_coef", 0.001)
        self.K = g("num_experts_per_tok")
        self.scoring = "softmax"
        self.n_group, self.topk_group, self.routed_scale, self.n_shared = 1, 1, 1.0, 0
        if qwen:
            self.E = g("num_experts")
            self.F_expert = g("moe_intermediate_size")
            self.F_dense = g("intermediate_size")
            self.norm_topk = bool(g("norm_topk_prob", False))
            step = g("decoder_sparse_step", 1)
            only = set(g("mlp_only_layers") or [])
            self.moe_layer = [(l not in only) and self.E > 0 and (l + 1) % step == 0
                              for l in range(self.L)]
            sw = g("sliding_window") if g("use_sliding_window", False) else None
            lt = g("layer_types")
            if lt is None:
                mwl = g("max_window_layers", 28)
                lt = ["sliding_attention" if l >= mwl else "full_attention"
                      for l in range(self.L)]
            self.window = [sw if (sw and lt[l] == "sliding_attention") else None
                           for l in range(self.L)]
            self.qk_norm = True
            self.mlp_prefix = "mlp"
            self.expert_names = ("gate_proj", "up_proj", "down_proj")
        elif mix:
            self.E = g("num_local_experts")
            self.F_expert = self.F_dense = g("intermediate_size")
            self.norm_topk = True  # softmax over the selected logits
            self.moe_layer = [True] * self.L
            self.window = [g("sliding_window")] * self.L
            self.qk_norm = False
            self.mlp_prefix = "block_sparse_moe"
            self.expert_names = ("w1", "w3", "w2")
        else:
            # DeepSeek-V3 / Kimi K2: MLA attention, sigmoid routing, shared experts.
            self.q_lora_rank = g("q_lora_rank") or 0
            self.kv_lora_rank = g("kv_lora_rank")
            self.qk_nope, self.qk_rope = g("qk_nope_head_dim"), g("qk_rope_head_dim")
            self.v_head_dim = g("v_head_dim")
            self.rope_interleave = bool(g("rope_interleave", True))
            self.Dh = self.qk_nope + self.qk_rope
            self.Hkv = self.H
            self.E = g("n_routed_experts")
            self.F_expert = g("moe_intermediate_size")
            self.F_dense = g("intermediate_size")
            self.norm_topk = bool(g("norm_topk_prob", True))
            self.scoring = g("scoring_func", "sigmoid")
            self.n_group, self.topk_group = g("n_group", 8), g("topk_group", 4)
            self.routed_scale = g("routed_scaling_factor", 2.5)
            self.n_shared = g("n_shared_experts") or 0
            fk, freq = g("first_k_dense_replace", 3), g("moe_layer_freq", 1)
            self.moe_layer = [l >= fk and l % freq == 0 for l in range(self.L)]
            self.window = [None] * self.L
            self.qk_norm = False
            self.mlp_prefix = "mlp"
            self.expert_names = ("gate_proj", "up_proj", "down_proj")
        self.mla = self.family == "deepseek_v3"
        # RoPE covers the whole head, or MLA's rope part (HF sets head_dim = qk_rope_head_dim).
        self.rope_dim = self.qk_rope if self.mla else self.Dh
        self.attn_scale = self.Dh ** -0.5
        rs = self.rope_scaling
        if self.mla and rs and rs.get("mscale_all_dim"):
            # DeepseekV3Attention: scaling *= yarn_get_mscale(factor, mscale_all_dim) ** 2
            f = rs["factor"]
            ms = 1.0 if f <= 1 else 0.1 * rs["mscale_all_dim"] * math.log(f) + 1.0
            self.attn_scale *= ms * ms

    @staticmethod
    def load(model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            return Config(json.load(f))


# ---------------------------------------------------------------------------
# RoPE (transformers' modeling_rope_utils)

def rope_inv_freq(cfg):
    """(Dh / 2) inverse frequencies and the cos/sin multiplier (attention_scaling)."""
    dim, base, rs = cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rs is None:
        return inv, 1.0
    t = rs["rope_type"]
    if t == "linear":
        return inv / rs["factor"], 1.0
    if t == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l), 1.0
    if t == "yarn":
        factor = rs["factor"]
        if "original_max_position_embeddings" in rs:
            orig = rs["original_max_position_embeddings"]
            factor = cfg.max_pos / orig
        else:
            orig = cfg.max_pos

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = rs.get("attention_factor")
        if att is None:
            ms, msa = rs.get("mscale"), rs.get("mscale_all_dim")
            att = (get_mscale(factor, ms) / get_mscale(factor, msa) if ms and msa
                   else get_mscale(factor))
        bf, bs = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

        def corr_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr_dim(bf)), 0), min(math.ceil(corr_dim(bs)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extra_factor = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra_factor) + (1.0 / pos_freqs) * extra_factor
        return inv, float(att)
    raise ValueError("rope type %r is not supported" % t)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


# ---------------------------------------------------------------------------
# LoRA adapters (PEFT layout)

PEFT_PREFIX = "base_model.model."


class Adapter:
    """A PEFT LoRA adapter: per module name, A (R, C) and B (OC, R) as float32 leaves."""

    def __init__(self, adapter_dir):
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            c = json.load(f)
        self.r, self.alpha, self.rslora = c["r"], c["lora_alpha"], bool(c.get("use_rslora"))
        self.scale = self.alpha / (math.sqrt(self.r) if self.rslora else self.r)
        tensors, _ = st_load(os.path.join(adapter_dir, "adapter_model.safetensors"))
        self.keys = list(tensors.keys())  # file order
        self.A, self.B = {}, {}
        for key, t in tensors.items():
            if not key.startswith(PEFT_PREFIX):
                raise ValueError("adapter key %s lacks the %s prefix" % (key, PEFT_PREFIX))
            mod, _, kind = key[len(PEFT_PREFIX):].rpartition(".lora_")
            (self.A if kind == "A.weight" else self.B)[mod] = t.float().clone()
        if set(self.A) != set(self.B):
            raise ValueError("adapter: lora_A and lora_B keys do not pair up")

    def key(self, mod, which):
        return "%s%s.lora_%s.weight" % (PEFT_PREFIX, mod, which)

    def params(self):
        """[(peft key, tensor)] for every A and B."""
        out = []
        for mod in self.A:
            out.append((self.key(mod, "A"), self.A[mod]))
            out.append((self.key(mod, "B"), self.B[mod]))
        return out

    def requires_grad_(self, flag=True):
        for _, t in self.params():
            t.requires_grad_(flag)
        return self


# ---------------------------------------------------------------------------
# The model

class MoeModel:
    def __init__(self, cfg, weights, adapter=None):
        self.cfg, self.w, self.adapter = cfg, weights, adapter
        self.inv_freq, self.rope_mscale = rope_inv_freq(cfg)
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie else "lm_head.weight"]
        if adapter is not None:
            unknown = [m for m in adapter.A if m + ".weight" not in weights]
            if unknown:
                raise ValueError("adapter module %s is not a projection of the model" % unknown[0])

    @staticmethod
    def load(model_dir, adapter_dir=None):
        cfg = Config.load(model_dir)
        return MoeModel(cfg, load_checkpoint(model_dir),
                        Adapter(adapter_dir) if adapter_dir else None)

    # -- pieces ---------------------------------------------------------------
    def linear(self, name, x):
        """x (N, C) W^T (+ scale * (x A^T) B^T when the adapter names the module)."""
        y = F.linear(x, self.w[name + ".weight"])
        ad = self.adapter
        if ad is not None and name in ad.A:
            y = y + ad.scale * F.linear(F.linear(x, ad.A[name]), ad.B[name])
        return y

    def rmsnorm(self, x, weight, eps=None):
        var = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(var + (self.cfg.eps if eps is None else eps)))

    def rope(self, x, pos, interleave=False):
        """x (N, h, d) rotated by positions pos (N); interleave first reorders the dims
        (x0, x2, ..., x1, x3, ...) as DeepSeek's apply_rotary_pos_emb_interleave does."""
        if interleave:
            n, h, d = x.shape
            x = x.view(n, h, d // 2, 2).transpose(3, 2).reshape(n, h, d)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_mscale)[:, None, :]
        sin = (emb.sin() * self.rope_mscale)[:, None, :]
        return x * cos + rotate_half(x) * sin

    def mlp(self, prefix, x, names=("gate_proj", "up_proj", "down_proj")):
        g = self.linear(prefix + names[0], x)
        u = self.linear(prefix + names[1], x)
        return self.linear(prefix + names[2], F.silu(g) * u)

    def qkv(self, l, x, pos):
        """Normed layer input x (N, D) -> q (N, H, Dh), k, v (N, Hkv, Dh) after norm and RoPE."""
        c, p = self.cfg, "model.layers.%d.self_attn." % l
        if c.mla:
            return self.mla_qkv(p, x, pos)
        q = self.linear(p + "q_proj", x).view(-1, c.H, c.Dh)
        k = self.linear(p + "k_proj", x).view(-1, c.Hkv, c.Dh)
        v = self.linear(p + "v_proj", x).view(-1, c.Hkv, c.Dh)
        if c.qk_norm:
            q = self.rmsnorm(q, self.w[p + "q_norm.weight"])
            k = self.rmsnorm(k, self.w[p + "k_norm.weight"])
        return self.rope(q, pos), self.rope(k, pos), v

    def mla_qkv(self, p, x, pos):
        """DeepseekV3Attention's projections: q, k (N, H, nope + rope), v (N, H, v_head_dim).
        The latent norms use eps 1e-6 (DeepseekV3RMSNorm's default), not rms_norm_eps."""
        c = self.cfg
        if c.q_lora_rank:
            qa = self.rmsnorm(self.linear(p + "q_a_proj", x), self.w[p + "q_a_layernorm.weight"],
                              1e-6)
            q = self.linear(p + "q_b_proj", qa)
        else:
            q = self.linear(p + "q_proj", x)
        q = q.view(-1, c.H, c.Dh)
        q_pass, q_rot = q.split([c.qk_nope, c.qk_rope], dim=-1)
        ckv = self.linear(p + "kv_a_proj_with_mqa", x)
        k_pass, k_rot = ckv.split([c.kv_lora_rank, c.qk_rope], dim=-1)
        kv = self.linear(p + "kv_b_proj",
                         self.rmsnorm(k_pass, self.w[p + "kv_a_layernorm.weight"], 1e-6))
        k_pass, v = kv.view(-1, c.H, c.qk_nope + c.v_head_dim).split([c.qk_nope, c.v_head_dim],
                                                                   dim=-1)
        q_rot = self.rope(q_rot, pos, c.rope_interleave)
        k_rot = self.rope(k_rot.view(-1, 1, c.qk_rope), pos, c.rope_interleave)
        k = torch.cat((k_pass, k_rot.expand(-1, c.H, -1)), dim=-1)
        return torch.cat((q_pass, q_rot), dim=-1), k, v

    def attend(self, q, k, v, qpos, kpos, window):
        """Causal attention: q (Nq, H, d) at positions qpos against k (Nk, Hkv, d) and
        v (Nk, Hkv, dv) at kpos; query heads share kv heads in groups of H / Hkv."""
        c = self.cfg
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * c.attn_scale
        dist = qpos[:, None] - kpos[None, :]
        allowed = dist >= 0
        if window:
            allowed = allowed & (dist < window)
        s = s.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.einsum("hqk,khd->qhd", p, v).reshape(q.shape[0], -1)

    def router(self, logits, bias=None):
        """Router logits (N, E) -> probs (N, E), idx (N, K), weights (N, K); bias (E) is
        DeepSeek's e_score_correction_bias."""
        c = self.cfg
        if c.scoring == "softmax" and c.n_group <= 1:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            w, idx = torch.topk(probs, c.K, dim=-1)
            if c.norm_topk:
                w = w / w.sum(dim=-1, keepdim=True)
            return probs, idx, w * (1.0 if c.norm_topk else c.routed_scale)
        return deepseek_route(c, logits, bias)

    def moe(self, l, x):
        """The sparse MoE block on x (N, D): (out, probs, idx)."""
        c = self.cfg
        p = "model.layers.%d.%s." % (l, c.mlp_prefix)
        logits = F.linear(x, self.w[p + "gate.weight"])
        probs, idx, w = self.router(logits, self.w.get(p + "gate.e_score_correction_bias"))
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            y = self.mlp("%sexperts.%d." % (p, e), x[tok], c.expert_names)
            out = out.index_add(0, tok, y * w[tok, slot, None])
        if c.n_shared:
            out = out + self.mlp(p + "shared_experts.", x)
        return out, probs, idx

    # -- forward --------------------------------------------------------------
    def hidden(self, tokens, positions, cu_seqlens, routing=None):
        """Final-normed hidden states (T, D) of a packed batch. routing, when a list,
        receives (probs (T, E), idx (T, K)) of every MoE layer."""
        c = self.cfg
        x = self.w["model.embed_tokens.weight"][tokens.long()]
        pos = positions.long()
        cu = [int(v) for v in cu_seqlens]
        for l in range(c.L):
            p = "model.layers.%d." % l
            a = self.rmsnorm(x, self.w[p + "input_layernorm.weight"])
            q, k, v = self.qkv(l, a, pos)
            att = torch.cat([self.attend(q[s:e], k[s:e], v[s:e], pos[s:e], pos[s:e],
                                         c.window[l])
                             for s, e in zip(cu[:-1], cu[1:]) if e > s], dim=0)
            h = x + self.linear(p + "self_attn.o_proj", att)
            a = self.rmsnorm(h, self.w[p + "post_attention_layernorm.weight"])
            if c.moe_layer[l]:
                ff, probs, idx = self.moe(l, a)
                if routing is not None:
                    routing.append((probs, idx))
            else:
                ff = self.mlp(p + "mlp.", a)
            x = h + ff
        return self.rmsnorm(x, self.w["model.norm.weight"])

    def logprobs(self, tokens, positions, cu_seqlens, targets, temperature=1.0, routing=None):
        """logp (T) of targets (0 where the target is -1) and entropy (T) of each token's
        next-token distribution at the temperature."""
        hf = self.hidden(tokens, positions, cu_seqlens, routing)
        z = F.linear(hf, self.lm_head) / temperature
        lp = torch.log_softmax(z, dim=-1)
        entropy = -(lp.exp() * lp).sum(-1)
        tgt = targets.long()
        has = tgt >= 0
        logp = lp.gather(1, tgt.clamp(min=0)[:, None])[:, 0] * has
        return logp, entropy

    # -- generation (KV cache, eager) ------------------------------------------
    @torch.no_grad()
    def generate(self, prompt, max_new, temperature=0.0, seed=0, eos=None):
        """Greedy (temperature 0) or sampled continuation of prompt (list of ids) with a
        KV cache: (new token ids, their logprobs at temperature 1 or the sampling one)."""
        c = self.cfg
        gen = torch.Generator().manual_seed(seed)
        cache = [(None, None) for _ in range(c.L)]
        ids = torch.tensor(prompt, dtype=torch.long)
        start, out, lps = 0, [], []
        for _ in range(max_new):
            pos = torch.arange(start, start + ids.numel())
            x = self.w["model.embed_tokens.weight"][ids]
            for l in range(c.L):
                p = "model.layers.%d." % l
                a = self.rmsnorm(x, self.w[p + "input_layernorm.weight"])
                q, k, v = self.qkv(l, a, pos)
                ck, cv = cache[l]
                ck = k if ck is None else torch.cat((ck, k))
                cv = v if cv is None else torch.cat((cv, v))
                cache[l] = (ck, cv)
                att = self.attend(q, ck, cv, pos, torch.arange(ck.shape[0]), c.window[l])
                h = x + self.linear(p + "self_attn.o_proj", att)
                a = self.rmsnorm(h, self.w[p + "post_attention_layernorm.weight"])
                x = h + (self.moe(l, a)[0] if c.moe_layer[l] else self.mlp(p + "mlp.", a))
            z = F.linear(self.rmsnorm(x[-1:], self.w["model.norm.weight"]), self.lm_head)[0]
            lp = torch.log_softmax(z / (temperature if temperature > 0 else 1.0), dim=-1)
            nxt = (int(torch.multinomial(lp.exp(), 1, generator=gen)) if temperature > 0
                   else int(lp.argmax()))
            out.append(nxt)
            lps.append(float(lp[nxt]))
            start += ids.numel()
            ids = torch.tensor([nxt])
            if eos is not None and nxt in eos:
                break
        return out, lps


def deepseek_route(c, logits, bias):
    """DeepSeek-V3 routing (HF DeepseekV3TopkRouter / MoEGate): logits (N, E) ->
    scores (N, E), idx (N, K), weights (N, K)."""
    if c.scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + (bias if bias is not None else 0.0)
        group_score = choice.view(-1, c.n_group, c.E // c.n_group).topk(2, dim=-1)[0].sum(-1)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float)
        choice = scores
        group_score = scores.view(-1, c.n_group, c.E // c.n_group).max(dim=-1).values
    if c.n_group > 1:
        gidx = torch.topk(group_score, c.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(group_score).scatter_(1, gidx, 1)
        smask = gmask[:, :, None].expand(-1, c.n_group, c.E // c.n_group).reshape(-1, c.E)
        choice = choice.masked_fill(~smask.bool(), 0.0)
    # HF uses sorted=False; sorting gives the same experts and weights in a fixed order.
    idx = torch.topk(choice, c.K, dim=-1, sorted=True)[1]
    w = scores.gather(1, idx)
    if c.norm_topk:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, idx, w * (c.routed_scale if c.scoring == "sigmoid" else 1.0)
    return scores, idx, w * c.routed_scale


# ---------------------------------------------------------------------------
# Losses

def balance_loss_per_layer(routing, E, K, coef, sigmoid=False):
    """moerl's form: sum over MoE layers of coef * E * sum_e f_e P_e, f_e = slots routed
    to e / (T K) (constant), P_e = mean router probability of e (sigmoid scores are first
    normalised per token to sum 1)."""
    total = 0.0
    for probs, idx in routing:
        T = probs.shape[0]
        if sigmoid:
            probs = probs / probs.sum(-1, keepdim=True)
        counts = torch.bincount(idx.reshape(-1), minlength=E).float()
        total = total + coef * E * (counts / (T * K) * probs.mean(0)).sum()
    return total


def balance_loss_hf(routing, E, K, router_aux_loss_coef):
    """transformers' load_balancing_loss_func times router_aux_loss_coef: the router
    probabilities of all MoE layers are pooled before the product."""
    probs = torch.cat([p for p, _ in routing], dim=0)
    _, sel = torch.topk(probs, K, dim=-1)
    mask = F.one_hot(sel, E).float()
    return router_aux_loss_coef * E * (mask.mean(0) * probs.mean(0)[None]).sum()
