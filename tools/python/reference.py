#!/usr/bin/python3
"""Float64 numpy reference of the decoder forward pass specserve serves.

Independent of the C++ engine: reads a HF model directory (config.json and
model.safetensors, or the shards of model.safetensors.index.json; F32, F16 or
BF16 storage) with numpy only and computes logits in float64, following
HF transformers' LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM:

  x = embed[ids]
  per layer: h = rmsnorm(x) * w_in
             q, k, v = h Wq^T (+ bq), h Wk^T (+ bk), h Wv^T (+ bv)
             qwen3: q, k = rmsnorm over head_dim per head * q_norm / k_norm
             q, k = rope(q, k, position_ids)  (rotate_half; cos and sin times
                    the attention factor)
             x += softmax(q k^T / sqrt(head_dim), causal over token order) v
                  Wo^T (+ bo)
             x += (silu(h2 Wg^T) * (h2 Wu^T)) Wd^T, h2 = rmsnorm(x) * w_post
  logits = (rmsnorm(x) * w_final) lm_head^T   (lm_head = embed when tied)

RoPE inverse frequencies follow transformers' modeling_rope_utils for the
rope_scaling types default / linear / llama3 / yarn (see rope_frequencies).

Usage (prints JSON):
  reference.py --model DIR --token_ids 5,9,2 [--position_ids 0,7,9]
      [--rows all|last|0,2] [--greedy N [--start_position P]]
Output: {"rows": [...], "logits": [[vocab floats] per row],
         "greedy": [N ids], "greedy_margins": [top1 - top2 per step]}.
Greedy token 0 comes from the last row; token i > 0 from feeding token i - 1
at position start_position + i - 1 (default: last position id + 1).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _read_safetensors(path):
    """Returns {name: float64 ndarray} of one safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[base + begin:base + end]
        shape = info["shape"]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif info["dtype"] in _DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(_DTYPES[info["dtype"]])
                                .newbyteorder("<"))
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}")
        out[name] = arr.astype(np.float64).reshape(shape)
    return out


def load_tensors(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(_read_safetensors(os.path.join(model_dir, shard)))
        return tensors
    return _read_safetensors(os.path.join(model_dir, "model.safetensors"))


def rope_frequencies(cfg, head_dim):
    """(inv_freq [head_dim / 2], attention_factor) per transformers'
    modeling_rope_utils (_compute_{default,linear_scaling,llama3,yarn}_...)."""
    # transformers >= 5 keeps rope_theta and the scaling in rope_parameters.
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or rs.get("rope_theta") or 10000.0)
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = theta ** -exponents
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(rs["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        old = float(rs["original_max_position_embeddings"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        old = float(rs.get("original_max_position_embeddings") or
                    cfg.get("max_position_embeddings", 2048))
        beta_fast = float(rs.get("beta_fast") or 32)
        beta_slow = float(rs.get("beta_slow") or 1)

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = rs.get("attention_factor")
        if att is None:
            if rs.get("mscale") and rs.get("mscale_all_dim"):
                att = mscale(factor, rs["mscale"]) / mscale(
                    factor, rs["mscale_all_dim"])
            else:
                att = mscale(factor)

        def corr(rot):
            return head_dim * math.log(old / (rot * 2 * math.pi)) / (
                2 * math.log(theta))

        lo, hi = corr(beta_fast), corr(beta_slow)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2) - lo) / (hi - lo), 0, 1)
        extrap_weight = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrap_weight) + inv_freq * extrap_weight
        return inv, float(att)
    raise ValueError(f"rope_scaling type {kind!r} not supported")


class Model:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = cfg = json.load(f)
        self.kind = cfg.get("model_type", "llama")
        if self.kind not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"model_type {self.kind!r} not supported")
        self.t = load_tensors(model_dir)
        self.hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.heads
        self.layers = cfg["num_hidden_layers"]
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.inv_freq, self.att = rope_frequencies(cfg, self.head_dim)
        embed = self.t.get("model.embed_tokens.weight")
        if cfg.get("tie_word_embeddings", False):
            if embed is None:
                embed = self.t["lm_head.weight"]
            self.lm_head = embed
        else:
            self.lm_head = self.t["lm_head.weight"]
        self.embed = embed

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) +
                           self.eps) * w

    def _rope(self, x, pos):
        # x [n, heads, D]; rotate_half pairs i with i + D / 2.
        ang = np.asarray(pos, np.float64)[:, None] * self.inv_freq[None, :]
        cos = (np.cos(ang) * self.att)[:, None, :]
        sin = (np.sin(ang) * self.att)[:, None, :]
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def _linear(self, x, name, bias):
        y = x @ self.t[name + ".weight"].T
        if bias:
            y = y + self.t[name + ".bias"]
        return y

    def logits(self, ids, pos):
        """[n, vocab] logits of every row; row i attends to rows 0..i."""
        n, D = len(ids), self.head_dim
        qkv_bias = self.kind == "qwen2" or bool(
            self.cfg.get("attention_bias", False))
        o_bias = self.kind != "qwen2" and bool(
            self.cfg.get("attention_bias", False))
        group = self.heads // self.kv_heads
        mask = np.triu(np.full((n, n), -np.inf), 1)
        x = self.embed[np.asarray(ids)]
        for l in range(self.layers):
            p = f"model.layers.{l}."
            h = self._norm(x, self.t[p + "input_layernorm.weight"])
            q = self._linear(h, p + "self_attn.q_proj", qkv_bias)
            k = self._linear(h, p + "self_attn.k_proj", qkv_bias)
            v = self._linear(h, p + "self_attn.v_proj", qkv_bias)
            q = q.reshape(n, self.heads, D)
            k = k.reshape(n, self.kv_heads, D)
            v = v.reshape(n, self.kv_heads, D)
            if self.kind == "qwen3":
                q = self._norm(q, self.t[p + "self_attn.q_norm.weight"])
                k = self._norm(k, self.t[p + "self_attn.k_norm.weight"])
            q, k = self._rope(q, pos), self._rope(k, pos)
            out = np.empty((n, self.heads, D))
            for hd in range(self.heads):
                g = hd // group
                s = q[:, hd, :] @ k[:, g, :].T / math.sqrt(D) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                s /= s.sum(axis=1, keepdims=True)
                out[:, hd, :] = s @ v[:, g, :]
            x = x + self._linear(out.reshape(n, -1), p + "self_attn.o_proj",
                                 o_bias)
            h = self._norm(x, self.t[p + "post_attention_layernorm.weight"])
            gate = self._linear(h, p + "mlp.gate_proj", False)
            up = self._linear(h, p + "mlp.up_proj", False)
            act = gate / (1 + np.exp(-gate)) * up
            x = x + self._linear(act, p + "mlp.down_proj", False)
        x = self._norm(x, self.t["model.norm.weight"])
        return x @ self.lm_head.T


def _ints(text):
    return [int(t) for t in text.split(",") if t.strip()]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--token_ids", required=True)
    ap.add_argument("--position_ids", default="")
    ap.add_argument("--rows", default="all")
    ap.add_argument("--greedy", type=int, default=0)
    ap.add_argument("--start_position", type=int, default=-1)
    a = ap.parse_args(argv)
    ids = _ints(a.token_ids)
    pos = _ints(a.position_ids) or list(range(len(ids)))
    if len(pos) != len(ids):
        sys.exit("--position_ids must match --token_ids in length")
    m = Model(a.model)
    lg = m.logits(ids, pos)
    rows = (list(range(len(ids))) if a.rows == "all" else
            [len(ids) - 1] if a.rows == "last" else _ints(a.rows))
    result = {"rows": rows, "logits": [lg[r].tolist() for r in rows]}
    if a.greedy > 0:
        start = a.start_position if a.start_position >= 0 else max(pos) + 1
        seq_ids, seq_pos, last = list(ids), list(pos), lg[-1]
        greedy, margins = [], []
        for i in range(a.greedy):
            order = np.argsort(-last, kind="stable")
            greedy.append(int(order[0]))
            margins.append(float(last[order[0]] - last[order[1]]))
            if i + 1 == a.greedy:
                break
            seq_ids.append(greedy[-1])
            seq_pos.append(start + i)
            last = m.logits(seq_ids, seq_pos)[-1]
        result["greedy"] = greedy
        result["greedy_margins"] = margins
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
