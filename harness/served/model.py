"""The served model: a Qwen3-architecture decoder in plain PyTorch.

RMSNorm, rotary embeddings (rotate-half), grouped-query attention with RMSNorm on each head's
queries and keys, a SwiGLU MLP, and tied (or untied) embeddings; projections are fused (q|k|v and
gate|up) as serving engines do. Attention never runs here: the model writes each layer's keys and
values into the paged cache and hands queries to an `AttentionOps` (harness/served/ops.py), which
calls the attention target's `prefill` / `decode` contract with a candidate's kernels or the
baselines. Weights are random from a seed (scaled so that greedy decoding has clear winners, not a
sea of near-ties) or read from a local folder of safetensors files in Hugging Face's Qwen3 names.
Each part of a forward pass can be marked with a profiler range (`annotate=True`) so the profile
can say where the time goes. Not covered: tokenizers, hub downloads, quantization, sliding windows.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# Random weights, scaled by config `served.random_init` (`init` below). Logits of a unit-RMS final state
# get std logit_std, so the top token usually stands clear of the runner-up. Every q_norm weight is
# query_gain, so attention picks out some keys (which keys are present matters, as in a trained model)
# without making the network chaotic: a sharper attention makes bf16 rounding noise grow through the
# layers until greedy tokens part at clear leads. Attention and MLP outputs get max(1, embedding std /
# embed_per_output_gain), so they outweigh the token's own embedding in the residual stream (a narrow
# model needs more: its embedding rows are longer); with tied embeddings a dominant own embedding makes
# greedy decoding repeat the last token forever. Tuned on the tiny and 0.6B shapes (docs/SERVED.md): the
# median lead of the top token is over 1 logprob, and a decode that drops the newest token moves most
# requests' tokens.
_NULL = contextlib.nullcontext()


class ModelError(Exception):
    """Weights that cannot be used; one line naming the file or tensor."""


@dataclass
class StepBatch:
    """One engine step: prefill tokens of newly admitted sequences first, then one decode token for
    each running sequence. Host-side lengths travel along so nothing needs a device sync."""
    tokens: torch.Tensor            # int64 [T]
    positions: torch.Tensor         # int64 [T]
    slots: torch.Tensor             # int64 [T]: block * block_size + offset of each token's K/V
    prefill_lens: list[int]
    cu_seqlens: torch.Tensor | None  # int32 [P + 1]
    decode_lens: list[int]          # context length of each decode sequence, its new token included
    block_table: torch.Tensor | None  # int32 [D, max blocks]
    seq_lens: torch.Tensor | None   # int32 [D]
    sample_idx: torch.Tensor        # int64 [P + D]: the rows whose next token is sampled

    @property
    def prefill_tokens(self) -> int:
        return sum(self.prefill_lens)


def hf_shapes(p: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the preset, by its name in a Hugging Face Qwen3 checkpoint."""
    H, D, I = p.hidden, p.head_dim, p.intermediate
    shapes = {"model.embed_tokens.weight": (p.vocab, H), "model.norm.weight": (H,)}
    if not p.tied_embeddings:
        shapes["lm_head.weight"] = (p.vocab, H)
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "input_layernorm.weight": (H,), pre + "post_attention_layernorm.weight": (H,),
            pre + "self_attn.q_proj.weight": (p.q_heads * D, H), pre + "self_attn.k_proj.weight": (p.kv_heads * D, H),
            pre + "self_attn.v_proj.weight": (p.kv_heads * D, H), pre + "self_attn.o_proj.weight": (H, p.q_heads * D),
            pre + "self_attn.q_norm.weight": (D,), pre + "self_attn.k_norm.weight": (D,),
            pre + "mlp.gate_proj.weight": (I, H), pre + "mlp.up_proj.weight": (I, H), pre + "mlp.down_proj.weight": (H, I),
        })
    return shapes


def random_weights(p: Any, dtype: torch.dtype, device: torch.device, init: Any) -> dict[str, torch.Tensor]:
    """Seeded, drawn on the device in a fixed order: every process gets the same weights. `init`: the
    gains (config served.random_init: logit_std, query_gain, embed_per_output_gain)."""
    gen = torch.Generator(device=device).manual_seed(p.seed)
    embed_std = init.logit_std / math.sqrt(p.hidden)
    out_gain = max(1.0, embed_std / init.embed_per_output_gain)
    fan_in = {"q_proj": p.hidden, "k_proj": p.hidden, "v_proj": p.hidden, "o_proj": p.q_heads * p.head_dim,
              "gate_proj": p.hidden, "up_proj": p.hidden, "down_proj": p.intermediate}
    out = {}
    for name, shape in hf_shapes(p).items():
        kind = name.split(".")[-2]
        if name.endswith("norm.weight"):
            gain = init.query_gain if kind == "q_norm" else 1.0
            out[name] = torch.full(shape, gain, dtype=dtype, device=device)
            continue
        if kind in ("embed_tokens", "lm_head"):
            std = embed_std
        else:
            std = (out_gain if kind in ("o_proj", "down_proj") else 1.0) / math.sqrt(fan_in[kind])
        out[name] = (torch.randn(shape, generator=gen, device=device) * std).to(dtype)
    return out


def load_weights(folder: Path | str, p: Any, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"{folder}: no such weights folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder}: no *.safetensors files")
    found: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            found.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{f}: cannot read ({e})") from None
    out = {}
    for name, shape in hf_shapes(p).items():
        t = found.get(name)
        if t is None:
            raise ModelError(f"{folder}: missing tensor {name}")
        if tuple(t.shape) != shape:
            raise ModelError(f"{folder}: {name} has shape {list(t.shape)}; the preset says {list(shape)}")
        out[name] = t.to(device=device, dtype=dtype)
    return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Qwen3:
    def __init__(self, p: Any, weights: dict[str, torch.Tensor], annotate: bool = False) -> None:
        self.p = p
        self.region = torch.profiler.record_function if annotate else (lambda name: _NULL)
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(p.layers):
            pre = f"model.layers.{i}."
            g = lambda n: w[pre + n]                                               # noqa: E731
            self.layers.append({
                "ln1": g("input_layernorm.weight"), "ln2": g("post_attention_layernorm.weight"),
                "qkv": torch.cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"), g("self_attn.v_proj.weight")]),
                "q_norm": g("self_attn.q_norm.weight"), "k_norm": g("self_attn.k_norm.weight"),
                "o": g("self_attn.o_proj.weight"),
                "gate_up": torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]), "down": g("mlp.down_proj.weight"),
            })
        dev = self.embed.device
        self.inv_freq = 1.0 / (p.rope_theta ** (torch.arange(0, p.head_dim, 2, device=dev, dtype=torch.float32) / p.head_dim))
        self.sm_scale = 1.0 / math.sqrt(p.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, b: StepBatch, cache, ops) -> torch.Tensor:
        """Logits (float32) of the rows in b.sample_idx: one per prefill sequence, one per decode one."""
        p, R = self.p, self.region
        T, Hq, Hkv, D, H, I = b.tokens.shape[0], p.q_heads, p.kv_heads, p.head_dim, p.hidden, p.intermediate
        P = b.prefill_tokens
        with R("kevo.copies"):
            x = F.embedding(b.tokens, self.embed)
        with R("kevo.rope"):
            angles = b.positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
            cos, sin = angles.cos().to(self.dtype)[:, None, :], angles.sin().to(self.dtype)[:, None, :]
        for i, L in enumerate(self.layers):
            with R("kevo.norm"):
                h = F.rms_norm(x, (H,), L["ln1"], p.rms_eps)
            with R("kevo.gemm"):
                qkv = F.linear(h, L["qkv"])
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            with R("kevo.norm"):
                q = F.rms_norm(q.view(T, Hq, D), (D,), L["q_norm"], p.rms_eps)
                k = F.rms_norm(k.view(T, Hkv, D), (D,), L["k_norm"], p.rms_eps)
            with R("kevo.rope"):
                q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            with R("kevo.copies"):
                v = v.reshape(T, Hkv, D).contiguous()
                cache.write(i, k, v, b.slots)
            parts = []
            if P:
                with R("kevo.attention.prefill"):
                    parts.append(ops.prefill(q[:P], k[:P], v[:P], b.cu_seqlens, max(b.prefill_lens), self.sm_scale,
                                             lens=b.prefill_lens))
            if b.decode_lens:
                with R("kevo.attention.decode"):
                    parts.append(ops.decode(q[P:], cache.k[i], cache.v[i], b.block_table, b.seq_lens, self.sm_scale,
                                            lens=b.decode_lens))
            if len(parts) > 1:
                with R("kevo.copies"):
                    parts = [torch.cat(parts)]
            with R("kevo.gemm"):
                o = F.linear(parts[0].reshape(T, Hq * D), L["o"])
            with R("kevo.residual"):
                x = x + o
            with R("kevo.norm"):
                h = F.rms_norm(x, (H,), L["ln2"], p.rms_eps)
            with R("kevo.gemm"):
                gu = F.linear(h, L["gate_up"])
            with R("kevo.activation"):
                a = F.silu(gu[:, :I]) * gu[:, I:]
            with R("kevo.gemm"):
                d = F.linear(a, L["down"])
            with R("kevo.residual"):
                x = x + d
        with R("kevo.sampling"):
            x = x.index_select(0, b.sample_idx)
        with R("kevo.norm"):
            x = F.rms_norm(x, (H,), self.norm, p.rms_eps)
        with R("kevo.gemm"):
            logits = F.linear(x, self.lm_head)
        return logits


def build_model(p: Any, dtype: torch.dtype, device: torch.device, *, init: Any, annotate: bool = False,
                root: Path | None = None) -> Qwen3:
    """Random weights from the preset's seed and `init`'s gains (config served.random_init), or the preset's
    local safetensors folder (relative paths are read from `root`, the project root)."""
    if p.weights is None:
        weights = random_weights(p, dtype, device, init)
    else:
        folder = Path(p.weights)
        weights = load_weights(folder if folder.is_absolute() or root is None else root / folder, p, dtype, device)
    return Qwen3(p, weights, annotate=annotate)
