"""generate_peer: the PyTorch side of bench_generate: eager KV-cache generation of the same
model and weights (float32, tests/golden/torch_model.py's layers), the same prompts and
shapes, timed batched and one sequence at a time, plus a greedy check against the tokens
moerl generated.

usage: generate_peer.py --model DIR --job job.json [--threads N] [--adapter DIR]

job.json (written by bench_generate): {"prompts": [[ids] x NP], "n": G, "max_tokens": N,
"single": S, "threads": T, "greedy_tokens": [[ids], [ids]]}.

Batched: the NP prompts (all of one length) are prefilled once each, their keys and values
repeated for the G samples, then all NP * G sequences decode in lockstep with a
preallocated cache (B, Hkv, P + N, Dh) per layer; every step samples from softmax(logits)
and takes the sampled token's log-probability, as the engine does. The MoE block is the
reference's eager loop over the experts that have tokens (Hugging Face's way). Single:
the first S prompts' G samples one at a time (batch 1, own prefill each).

Prints "RESULT mode=batched tokens=... seconds=... cpu=... tokens_per_s=..." (wall clock
and process CPU time), the same for mode=single, and "CHECK greedy_equal=E total=T".
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "golden"))
from torch_model import MoeModel  # noqa: E402


class KVGen:
    """Batched prefill and decode with a KV cache over MoeModel's layers."""

    def __init__(self, m, batch, max_len):
        c = m.cfg
        self.m, self.c = m, c
        shape = (batch, c.Hkv, max_len, c.Dh)
        self.k = [torch.empty(shape) for _ in range(c.L)]
        self.v = [torch.empty(shape) for _ in range(c.L)]

    def attend(self, q, l, t0, t1):
        """q (B, T, H, Dh) at positions t0 .. t1-1 against cached keys 0 .. t1-1."""
        c = self.c
        B, T = q.shape[0], q.shape[1]
        G = c.H // c.Hkv
        k, v = self.k[l][:B, :, :t1], self.v[l][:B, :, :t1]  # (B, Hkv, t1, Dh)
        qg = q.view(B, T, c.Hkv, G, c.Dh).permute(0, 2, 3, 1, 4).reshape(B, c.Hkv, G * T, c.Dh)
        s = torch.matmul(qg, k.transpose(-1, -2)) * (c.Dh ** -0.5)  # (B, Hkv, G T, t1)
        qpos = torch.arange(t0, t1).repeat(G)
        dist = qpos[:, None] - torch.arange(t1)[None, :]
        ok = dist >= 0
        if c.window[l]:
            ok = ok & (dist < c.window[l])
        if not bool(ok.all()):
            s = s.masked_fill(~ok, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), v)  # (B, Hkv, G T, Dh)
        return o.view(B, c.Hkv, G, T, c.Dh).permute(0, 3, 1, 2, 4).reshape(B * T, c.H * c.Dh)

    def forward(self, tokens, t0):
        """tokens (B, T) at positions t0 .. t0+T-1 of every sequence: the last position's
        logits (B, V); keys and values go into the cache."""
        m, c = self.m, self.c
        B, T = tokens.shape
        x = m.w["model.embed_tokens.weight"][tokens.reshape(-1)]
        pos = torch.arange(t0, t0 + T).repeat(B)
        for l in range(c.L):
            p = "model.layers.%d." % l
            a = m.rmsnorm(x, m.w[p + "input_layernorm.weight"])
            q, k, v = m.qkv(l, a, pos)
            self.k[l][:B, :, t0:t0 + T] = k.view(B, T, c.Hkv, c.Dh).transpose(1, 2)
            self.v[l][:B, :, t0:t0 + T] = v.view(B, T, c.Hkv, c.Dh).transpose(1, 2)
            att = self.attend(q.view(B, T, c.H, c.Dh), l, t0, t0 + T)
            h = x + m.linear(p + "self_attn.o_proj", att)
            a = m.rmsnorm(h, m.w[p + "post_attention_layernorm.weight"])
            ff = m.moe(l, a)[0] if c.moe_layer[l] else m.mlp(p + "mlp.", a)
            x = h + ff
        last = x.view(B, T, c.D)[:, -1]
        return F.linear(m.rmsnorm(last, m.w["model.norm.weight"]), m.lm_head)

    def repeat(self, n_prompts, G, length):
        """Copies each prompt's cache rows to its G samples (rows p G .. p G + G - 1)."""
        for l in range(self.c.L):
            for cache in (self.k[l], self.v[l]):
                src = cache[:n_prompts, :, :length].clone()
                cache[:n_prompts * G, :, :length] = src.repeat_interleave(G, dim=0)


def sample(logits, greedy):
    """Next tokens (B) and their log-probabilities (B) at temperature 1."""
    logp = torch.log_softmax(logits, dim=-1)
    tok = logits.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1)[:, 0]
    return tok, logp.gather(1, tok[:, None])[:, 0]


def generate(m, prompts, G, N, greedy=False):
    """G completions of N tokens for each prompt (equal lengths): (NP G, N) tokens."""
    NP, P = prompts.shape
    gen = KVGen(m, NP * G, P + N)
    logits = gen.forward(prompts, 0)
    gen.repeat(NP, G, P)
    tok, _ = sample(logits.repeat_interleave(G, dim=0), greedy)
    out = [tok]
    for t in range(1, N):
        tok, _ = sample(gen.forward(tok[:, None], P + t - 1), greedy)
        out.append(tok)
    return torch.stack(out, dim=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    with open(a.job) as f:
        job = json.load(f)
    threads = a.threads or job.get("threads", 1)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = MoeModel.load(a.model, a.adapter)
    prompts = torch.tensor(job["prompts"], dtype=torch.long)
    G, N, S = job["n"], job["max_tokens"], job["single"]
    with torch.no_grad():
        generate(m, prompts[:2], 2, 4)  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        out = generate(m, prompts, G, N)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        print("RESULT mode=batched tokens=%d seconds=%.3f cpu=%.3f tokens_per_s=%.1f"
              % (out.numel(), dt, dc, out.numel() / dt), flush=True)
        ntok, t0, c0 = 0, time.perf_counter(), time.process_time()
        for i in range(S):
            for _ in range(G):
                ntok += generate(m, prompts[i:i + 1], 1, N).numel()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if S:
            print("RESULT mode=single tokens=%d seconds=%.3f cpu=%.3f tokens_per_s=%.1f"
                  % (ntok, dt, dc, ntok / dt), flush=True)
        want = job.get("greedy_tokens") or []
        eq = total = 0
        if want:
            got = generate(m, prompts[:len(want)], 1, len(want[0]), greedy=True)
            for i, w in enumerate(want):
                total += len(w)
                eq += sum(int(x == y) for x, y in zip(got[i].tolist(), w))
        print("CHECK greedy_equal=%d total=%d" % (eq, total), flush=True)


if __name__ == "__main__":
    main()
