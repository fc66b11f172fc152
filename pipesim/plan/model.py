"""`ModelSpec`: the shape of a decoder-only transformer, dense or mixture-of-experts.

One frozen value holds what FLOPs, parameters and activations depend on: layers, width, heads,
key/value heads (GQA / MQA), head dim, FFN size, MLP kind (GeLU, two matrices; SwiGLU, three),
norm (LayerNorm has a bias, RMSNorm none), vocabulary (padded as Megatron pads it), training
sequence length, tied or untied embeddings, learned or rotary positions, dropout, linear biases,
and MoE (experts, top-k, expert and shared-expert FFN sizes, which layers are MoE).

Defaults reproduce the GPT-3 shape (Brown et al. 2020, Table 2.1): kv heads = heads, head dim
= hidden / heads, FFN = 4 hidden, GeLU, LayerNorm, learned positions, tied embeddings, biases.
The first six fields keep the order of the original ``pipesim.plan.transformer.ModelSpec``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..fields import typed_fields
from ..units import format_count

MLP_KINDS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. ``None`` fields take the GPT-3 defaults (module docstring)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_length: int
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    position: str = "learned"
    tied_embeddings: bool = True
    bias: bool = True              # biases on the linear layers (GPT-2/3 yes, Llama no)
    qkv_bias: bool | None = None   # biases on the q, k, v projections alone (Qwen2); None: `bias`
    dropout: bool = True           # hidden / attention dropout (its masks are activations)
    experts: int = 0               # 0: dense
    top_k: int = 0
    moe_ffn_hidden: int | None = None
    shared_expert_ffn_hidden: int = 0
    shared_expert_gate: bool = False   # the shared expert's output times sigmoid(x w), w: hidden (Qwen2-MoE)
    qk_norm: bool = False          # RMSNorm (weight: head_dim) on each head's q and k (Qwen3)
    moe_layer_freq: int = 1        # every k-th layer is MoE, from layer 0 (Megatron's moe_layer_freq)
    first_dense_layers: int = 0    # the first k layers dense (DeepSeek's first_k_dense_replace)
    # multi-latent attention (DeepSeek-V2/V3): q and kv down-projected to these ranks (an
    # RMSNorm each), then up-projected per head; head_dim is then the q/k head dim without its
    # rotary part (qk_nope_head_dim), qk_rope_head_dim the rotary part (k's shared by all
    # heads), v_head_dim the value head dim. kv_lora_rank None: ordinary (GQA) attention.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    v_head_dim: int | None = None
    # sliding-window attention on `sliding_window_layers` of the layers (GPT-OSS: every other
    # layer attends the last 128 tokens); 0: every layer attends the whole causal context
    sliding_window: int = 0
    sliding_window_layers: int = 0
    # multi-token prediction (DeepSeek-V3): this many extra MoE layers after the last, each
    # with a projection of [norm(h); norm(embedding)] (2h -> h) and its own pass through the
    # shared output layer; on the last pipeline stage
    mtp_layers: int = 0
    moe_bias: bool = False         # biases on the experts' and the router's linear layers (GPT-OSS)
    attention_sinks: bool = False  # a learned logit per head (GPT-OSS): `heads` parameters
    max_position: int | None = None  # learned position table size (default seq_length)
    # the vocabulary is padded to a multiple of this (times tp): Megatron's
    # --make-vocab-size-divisible-by (128); 1 for a model whose tables are not padded
    vocab_divisible_by: int = 128
    # where the shape came from: a Hugging Face ``model_type`` ("llama", "qwen2", "mixtral",
    # "gpt2"...) and its config.json, which holds what the shape does not (rope theta, norm
    # epsilon, initializer range, sliding window...): what an executor builds that family's own
    # modules from (`from_hf_config` sets both). None: a shape alone (a preset, the built-in GPT).
    # Provenance, not shape: equality and hashing compare the shape alone.
    family: str | None = field(default=None, compare=False)
    hf_config: dict | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "seq_length", "vocab", "vocab_divisible_by"):
            _positive(self, f)
        for f in ("kv_heads", "head_dim", "ffn_hidden", "moe_ffn_hidden", "max_position"):
            if getattr(self, f) is not None:
                _positive(self, f)
        if self.qkv_bias not in (None, True, False):
            raise PlanError(f"model.qkv_bias: true, false or null (as bias), got {self.qkv_bias!r}")
        for f, allowed in (("mlp", MLP_KINDS), ("norm", NORMS), ("position", POSITIONS)):
            value = str(getattr(self, f)).lower()
            if value not in allowed:
                raise PlanError(f"model.{f}: {getattr(self, f)!r} is not one of {', '.join(allowed)}")
            object.__setattr__(self, f, value)
        if self.heads % self.num_kv_heads:
            raise PlanError(f"model.kv_heads: heads ({self.heads}) must be a multiple of kv_heads "
                            f"({self.num_kv_heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise PlanError(f"model.heads: hidden ({self.hidden}) is not a multiple of heads "
                            f"({self.heads}): each head is hidden / heads wide unless head_dim "
                            "gives its width")
        if self.position == "rotary" and self.kv_channels % 2:
            raise PlanError(f"model.head_dim: {self.kv_channels} is odd; rotary position "
                            "embeddings rotate pairs of channels, so a head needs an even width")
        if self.experts < 0 or self.top_k < 0 or self.shared_expert_ffn_hidden < 0:
            raise PlanError("model: experts, top_k and shared_expert_ffn_hidden must be >= 0")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise PlanError(f"model.top_k: must be in 1..experts ({self.experts}) for an MoE model, "
                            f"got {self.top_k}")
        if self.moe_layer_freq < 1:
            raise PlanError(f"model.moe_layer_freq: must be >= 1, got {self.moe_layer_freq}")
        for f in ("first_dense_layers", "qk_rope_head_dim", "sliding_window",
                  "sliding_window_layers", "mtp_layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"model.{f}: must be an integer >= 0, got {v!r}")
        for f in ("q_lora_rank", "kv_lora_rank", "v_head_dim"):
            if getattr(self, f) is not None:
                _positive(self, f)
        if self.kv_lora_rank is None and (self.q_lora_rank or self.qk_rope_head_dim
                                          or self.v_head_dim):
            raise PlanError("model.kv_lora_rank: q_lora_rank, qk_rope_head_dim and v_head_dim "
                            "describe multi-latent attention, which needs kv_lora_rank")
        if self.sliding_window_layers > self.layers:
            raise PlanError(f"model.sliding_window_layers: at most layers ({self.layers}), got "
                            f"{self.sliding_window_layers}")
        if self.sliding_window_layers and not self.sliding_window:
            raise PlanError("model.sliding_window: sliding_window_layers needs a window size")
        if self.family is not None and (not isinstance(self.family, str) or not self.family):
            raise PlanError(f"model.family: a Hugging Face model_type such as 'llama', or null, "
                            f"got {self.family!r}")
        if self.hf_config is not None and not isinstance(self.hf_config, dict):
            raise PlanError(f"model.hf_config: a config.json object, or null, got "
                            f"{type(self.hf_config).__name__}")

    # -- derived shapes ------------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_channels(self) -> int:
        """Head dim (Megatron's ``kv_channels``); hidden / heads unless given."""
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Query/key head dim: head dim, plus the rotary part under MLA."""
        return self.kv_channels + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.kv_channels if self.v_head_dim is None else self.v_head_dim

    @property
    def q_size(self) -> int:
        """Width of the query projection, heads x head dim (MLA: heads x q/k head dim)."""
        return self.heads * self.qk_head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection, kv heads x head dim (MLA: each
        head's key after the up-projection, as training materialises them)."""
        return self.num_kv_heads * self.qk_head_dim

    @property
    def attention_width(self) -> float:
        """What the score and value matmuls scale with: ``4 b s^2 * attention_width`` FLOPs a
        layer (full attention). ``q_size`` for ordinary attention; MLA's scores run over the
        q/k head dim and its values over the value head dim: the mean of the two widths."""
        return self.heads * (self.qk_head_dim + self.value_head_dim) / 2

    def attention_span(self, s: int | None = None) -> float:
        """Mean keys a query's scores span over the full ``s x s`` (sliding-window layers
        attend ``min(s, window)``; the rest ``s``), averaged over the layers."""
        s = self.seq_length if s is None else s
        if not self.sliding_window_layers:
            return float(s)
        local = self.sliding_window_layers / self.layers
        return (1 - local) * s + local * min(s, 2 * self.sliding_window)

    @property
    def ffn(self) -> int:
        return 4 * self.hidden if self.ffn_hidden is None else self.ffn_hidden

    @property
    def moe_ffn(self) -> int:
        return self.ffn if self.moe_ffn_hidden is None else self.moe_ffn_hidden

    @property
    def gated(self) -> bool:
        return self.mlp == "swiglu"

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def moe_pattern(self) -> list[bool]:
        """For each layer, whether it is an MoE layer (Megatron: ``i % moe_layer_freq == 0``,
        after the ``first_dense_layers``)."""
        if not self.is_moe:
            return [False] * self.layers
        k = self.first_dense_layers
        return [i >= k and (i - k) % self.moe_layer_freq == 0 for i in range(self.layers)]

    def padded_vocab(self, tp: int = 1, divisible_by: int | None = None) -> int:
        """Vocabulary padded as Megatron pads it: up to a multiple of ``divisible_by * tp``
        (default `vocab_divisible_by`; ``--make-vocab-size-divisible-by``,
        megatron/training/tokenizer ``_vocab_size_with_padding``)."""
        multiple = (self.vocab_divisible_by if divisible_by is None else divisible_by) * tp
        return -(-self.vocab // multiple) * multiple

    # -- parameters ----------------------------------------------------------------------------
    def attention_weight_shapes(self) -> list[tuple[str, int, int]]:
        """The attention's weight matrices as (name, in, out), whole (before tensor
        parallelism): QKV and the output projection, or MLA's down/up projections."""
        h, a = self.hidden, self.heads
        if not self.is_mla:
            return [("qkv", h, self.q_size + 2 * self.kv_size), ("proj", self.q_size, h)]
        qk, v, rope, kvr = self.qk_head_dim, self.value_head_dim, self.qk_rope_head_dim, \
            self.kv_lora_rank
        q = ([("q_down", h, self.q_lora_rank), ("q_up", self.q_lora_rank, a * qk)]
             if self.q_lora_rank else [("q", h, a * qk)])
        return q + [("kv_down", h, kvr + rope), ("kv_up", kvr, a * (self.kv_channels + v)),
                    ("proj", a * v, h)]

    def attention_params(self) -> int:
        q, kv, h = self.q_size, self.kv_size, self.hidden
        if self.is_mla:     # the projections, and the two latent RMSNorms
            weights = sum(i * o for _, i, o in self.attention_weight_shapes())
            return weights + (self.q_lora_rank or 0) + self.kv_lora_rank + \
                (h if self.bias else 0) + (self.heads if self.attention_sinks else 0)
        weights = h * (q + 2 * kv) + q * h
        qkv = self.bias if self.qkv_bias is None else self.qkv_bias
        return weights + ((q + 2 * kv) if qkv else 0) + (h if self.bias else 0) + \
            (self.heads if self.attention_sinks else 0)

    def mlp_params(self, ffn: int, bias: bool | None = None) -> int:
        h = self.hidden
        weights = self.mlp_matrices * h * ffn
        biases = ((2 if self.gated else 1) * ffn + h) if (self.bias if bias is None else bias) else 0
        return weights + biases

    def norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def layer_params(self, moe: bool = False) -> dict[str, int]:
        """Parameters of one layer by kind: ``dense`` (attention, norms, dense or shared MLP,
        router) and ``expert`` (routed experts, all of them)."""
        dense = self.attention_params() + 2 * self.norm_params()
        dense += 2 * self.kv_channels if self.qk_norm else 0          # q_norm, k_norm
        if not moe:
            return {"dense": dense + self.mlp_params(self.ffn), "expert": 0}
        dense += (self.hidden + (1 if self.moe_bias else 0)) * self.experts   # router
        if self.shared_expert_ffn_hidden:
            dense += self.mlp_params(self.shared_expert_ffn_hidden)
            dense += self.hidden if self.shared_expert_gate else 0
        expert_bias = True if self.moe_bias else None
        return {"dense": dense,
                "expert": self.experts * self.mlp_params(self.moe_ffn, bias=expert_bias)}

    def embedding_params(self, tp: int = 1) -> int:
        """Word embedding (padded vocab) plus a learned position table."""
        pos = (self.max_position or self.seq_length) * self.hidden if self.position == "learned" else 0
        return self.padded_vocab(tp) * self.hidden + pos

    def head_params(self, tp: int = 1) -> int:
        """Final norm, and the output layer when it is not tied to the embedding."""
        out = 0 if self.tied_embeddings else self.padded_vocab(tp) * self.hidden
        return self.norm_params() + out

    def mtp_params(self) -> dict[str, int]:
        """One multi-token-prediction module: an MoE layer, its 2h -> h projection and three
        RMSNorms (embedding and output layer shared with the model)."""
        p = dict(self.layer_params(self.is_moe))
        p["dense"] += 2 * self.hidden * self.hidden + 3 * self.norm_params()
        return p

    def num_params(self, tp: int = 1) -> int:
        """All parameters (tied embeddings counted once; multi-token prediction included)."""
        layers = sum(sum(self.layer_params(moe).values()) for moe in self.moe_pattern())
        layers += self.mtp_layers * sum(self.mtp_params().values())
        return layers + self.embedding_params(tp) + self.head_params(tp)

    def active_params(self, tp: int = 1) -> int:
        """Parameters a token passes through (top-k of the experts)."""
        total = 0
        for moe in self.moe_pattern():
            p = self.layer_params(moe)
            total += p["dense"] + (p["expert"] * self.top_k // self.experts if moe else 0)
        return total + self.embedding_params(tp) + self.head_params(tp)

    # -- values --------------------------------------------------------------------------------
    def with_(self, **changes: Any) -> "ModelSpec":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "model") -> "ModelSpec":
        typed_fields(cls, data, "model", source, PlanError)
        try:
            return cls(**data)
        except TypeError as exc:
            raise PlanError(f"{source}: {exc}") from None

    @classmethod
    def from_hf_config(cls, path: "str | Path | dict", name: str | None = None,
                       seq_length: int | None = None) -> "ModelSpec":
        """Read a Hugging Face ``config.json`` (plain JSON, no transformers import).

        Llama family (llama, mistral, qwen2, qwen3: ``hidden_size``, ``num_key_value_heads``,
        ``intermediate_size``, ``head_dim``...), Mixtral (``num_local_experts``,
        ``num_experts_per_tok``), Qwen-MoE (``num_experts``, ``moe_intermediate_size``,
        ``shared_expert_intermediate_size``) and GPT-2 (``n_embd``, ``n_layer``, ``n_head``,
        ``n_positions``, ``n_inner``). ``seq_length`` defaults to ``max_position_embeddings``
        (``n_positions``).
        """
        from .hf_config import spec_from_hf_config

        return spec_from_hf_config(cls, path, name=name, seq_length=seq_length)

    def __repr__(self) -> str:
        parts = [f"{self.name!r}", f"layers={self.layers}", f"hidden={self.hidden}",
                 f"heads={self.heads}"]
        if self.num_kv_heads != self.heads:
            parts.append(f"kv_heads={self.num_kv_heads}")
        parts += [f"ffn={self.ffn}", self.mlp, self.norm, f"seq={self.seq_length}",
                  f"vocab={self.vocab}"]
        if self.is_moe:
            parts.append(f"experts={self.experts} top_k={self.top_k} moe_ffn={self.moe_ffn}")
        parts.append(f"params={format_count(self.num_params())}")
        return f"ModelSpec({', '.join(parts)})"


def _positive(spec: ModelSpec, field: str) -> None:
    value = getattr(spec, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"model.{field}: must be a positive integer, got {value!r}")


# -- presets -----------------------------------------------------------------------------------
def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    # GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
    # (n_layers, d_model, n_heads; n_ctx = 2048; GPT-2 BPE vocabulary of 50257 tokens).
    return ModelSpec(name, layers, hidden, heads, 2048, 50257)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int,
           seq: int, **kw: Any) -> ModelSpec:
    kw.setdefault("bias", False)
    return ModelSpec(name, layers, hidden, heads, seq, vocab, kv_heads=kv, ffn_hidden=ffn,
                     mlp="swiglu", norm="rmsnorm", position="rotary", tied_embeddings=False,
                     dropout=False, **kw)


PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", 8, 512, 8, 512, 32000),
    "gpt3-1.3b": _gpt3("gpt3-1.3b", 24, 2048, 16),
    "gpt3-2.7b": _gpt3("gpt3-2.7b", 32, 2560, 32),
    "gpt3-6.7b": _gpt3("gpt3-6.7b", 32, 4096, 32),
    "gpt3-13b": _gpt3("gpt3-13b", 40, 5120, 40),
    "gpt3-175b": _gpt3("gpt3-175b", 96, 12288, 96),
    # Llama 2: Touvron et al. 2023, "Llama 2", Table 1 (context 4k; GQA for 70B) and the
    # meta-llama/Llama-2-{7b,70b}-hf config.json (intermediate_size 11008 / 28672, 8 kv heads).
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 (8B: 32 layers, 4096,
    # FFN 14336, 32 heads, 8 kv heads; 70B: 80, 8192, 28672, 64, 8; 405B: 126, 16384, 53248,
    # 128, 8; vocabulary 128K = 128256 tokens; pre-training sequence length 8192, §3.4.1).
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # Mixtral 8x7B: Jiang et al. 2024, "Mixtral of Experts", Table 1 (dim 4096, 32 layers,
    # head_dim 128, hidden_dim 14336, 32 heads, 8 kv heads, 8 experts, top-2, vocab 32000;
    # context 32768; here a 4096-token training default, override with seq_length).
    "mixtral-8x7b": _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096,
                           experts=8, top_k=2, moe_ffn_hidden=14336),
    # Qwen1.5-MoE-A2.7B: Qwen/Qwen1.5-MoE-A2.7B config.json (hidden_size 2048, 24 layers,
    # 16 heads, 60 experts, 4 per token, moe_intermediate_size 1408, a shared expert of 5632,
    # vocab 151936, max_position_embeddings 8192); q/k/v biases, as Qwen2's attention has;
    # the shared expert's sigmoid gate (Qwen2MoeSparseMoeBlock.shared_expert_gate).
    "qwen1.5-moe-a2.7b": _llama("qwen1.5-moe-a2.7b", 24, 2048, 16, 16, 5632, 151936, 8192,
                                experts=60, top_k=4, moe_ffn_hidden=1408,
                                shared_expert_ffn_hidden=5632, shared_expert_gate=True,
                                qkv_bias=True),
    # Qwen3-30B-A3B: Qwen/Qwen3-30B-A3B config.json (hidden_size 2048, 48 layers, 32 heads of
    # head_dim 128, 4 kv heads, 128 experts, 8 per token, moe_intermediate_size 768, vocab
    # 151936); a 4096-token training default.
    "qwen3-30b-a3b": _llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, 4096, head_dim=128,
                            experts=128, top_k=8, moe_ffn_hidden=768, qk_norm=True),
    # Qwen3-235B-A22B: Qwen/Qwen3-235B-A22B config.json (hidden_size 4096, 94 layers, 64 heads
    # of head_dim 128, 4 kv heads, 128 experts, 8 per token, moe_intermediate_size 1536,
    # vocab 151936, tie_word_embeddings false); 235B total, 22B active (its model card).
    "qwen3-235b-a22b": _llama("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, 4096,
                              head_dim=128, experts=128, top_k=8, moe_ffn_hidden=1536,
                              qk_norm=True),
    # gpt-oss-120b: openai/gpt-oss-120b config.json (hidden_size 2880, 36 layers, 64 heads of
    # head_dim 64, 8 kv heads, 128 local experts, 4 per token, intermediate_size 2880,
    # vocab 201088, sliding_window 128 on every other layer (layer_types), attention_bias
    # true, router and experts with biases, a learned sink logit per head, untied); 116.8B
    # total, 5.1B active (OpenAI's gpt-oss model card, Table 1).
    "gpt-oss-120b": _llama("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 4096, head_dim=64,
                           experts=128, top_k=4, moe_ffn_hidden=2880, bias=True,
                           moe_bias=True, attention_sinks=True, sliding_window=128,
                           sliding_window_layers=18),
    # DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json (hidden_size 7168, 61 layers, 128 heads,
    # q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
    # v_head_dim 128, intermediate_size 18432 for the first_k_dense_replace 3 dense layers,
    # 256 routed experts (moe_intermediate_size 2048), 8 per token, n_shared_experts 1, vocab
    # 129280, untied); 671B total, 37B active (DeepSeek-V3 technical report, without its
    # 14B multi-token-prediction module, which this preset leaves out).
    "deepseek-v3": _llama("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096, head_dim=128,
                          experts=256, top_k=8, moe_ffn_hidden=2048,
                          shared_expert_ffn_hidden=2048, first_dense_layers=3,
                          q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                          v_head_dim=128),
    # Kimi K2: moonshotai/Kimi-K2-Instruct config.json (DeepSeek-V3's architecture with 64
    # heads, 384 routed experts, first_k_dense_replace 1, vocab 163840); 1.04T total, 32B
    # active (Kimi K2 technical report).
    "kimi-k2": _llama("kimi-k2", 61, 7168, 64, 64, 18432, 163840, 4096, head_dim=128,
                      experts=384, top_k=8, moe_ffn_hidden=2048, shared_expert_ffn_hidden=2048,
                      first_dense_layers=1, q_lora_rank=1536, kv_lora_rank=512,
                      qk_rope_head_dim=64, v_head_dim=128),
}


# The presets that are Hugging Face models, as their config.json on the model's hub page
# (GPT-3 and tiny as openai-community/gpt2's architecture, GPT-3's sizes: Brown et al. 2020
# describe GPT-3 as GPT-2's model with some attention layers locally banded, which the family's
# dense attention does not do; meta-llama/Llama-2-7b-hf, Llama-2-70b-hf, Meta-Llama-3-8B, Meta-Llama-3-70B,
# Llama-3.1-405B, mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen3-30B-A3B):
# the keys a transformers class reads beyond the shape (rope theta and scaling, norm epsilon,
# context). A plan made from such a preset names its family, so pipeexec builds it as that
# family's modules, and `pipesim models NAME --config-out DIR` writes the file
# (`hf_config.hf_config_for` writes the shape in). Each reads back as its preset (a test).
def _hf(model_type: str, eps: float, theta: float, context: int, **keys: Any) -> dict:
    return {"model_type": model_type, "hidden_act": "silu", "rms_norm_eps": eps,
            "rope_theta": theta, "max_position_embeddings": context,
            "tie_word_embeddings": False, "initializer_range": 0.02, **keys}


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_GPT2 = {"model_type": "gpt2", "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
         "initializer_range": 0.02, "tie_word_embeddings": True}
_HF_PRESETS: dict[str, dict] = {
    "tiny": dict(_GPT2, n_positions=512),
    **{name: dict(_GPT2, n_positions=2048) for name in PRESETS if name.startswith("gpt3-")},
    "llama2-7b": _hf("llama", 1e-5, 10000.0, 4096, bos_token_id=1, eos_token_id=2),
    "llama2-70b": _hf("llama", 1e-5, 10000.0, 4096, bos_token_id=1, eos_token_id=2),
    "llama3-8b": _hf("llama", 1e-5, 500000.0, 8192, bos_token_id=128000, eos_token_id=128001),
    "llama3-70b": _hf("llama", 1e-5, 500000.0, 8192, bos_token_id=128000, eos_token_id=128001),
    "llama3-405b": _hf("llama", 1e-5, 500000.0, 131072, rope_scaling=_LLAMA3_SCALING,
                       bos_token_id=128000, eos_token_id=128001),
    "mixtral-8x7b": _hf("mixtral", 1e-5, 1e6, 32768, sliding_window=None, bos_token_id=1,
                        eos_token_id=2),
    "qwen1.5-moe-a2.7b": _hf("qwen2_moe", 1e-6, 1e6, 8192, decoder_sparse_step=1,
                             norm_topk_prob=False, qkv_bias=True),
    "qwen3-30b-a3b": _hf("qwen3_moe", 1e-6, 1e6, 40960, decoder_sparse_step=1,
                         norm_topk_prob=True, attention_bias=False),
}
PRESETS.update({name: replace(PRESETS[name], family=cfg["model_type"], hf_config=cfg,
                               ffn_hidden=PRESETS[name].ffn)       # GPT-2's n_inner spelled out
                for name, cfg in _HF_PRESETS.items()})


def model_names() -> list[str]:
    return list(PRESETS)


def get_model(name: "str | ModelSpec") -> ModelSpec:
    """A preset by name (case-insensitive), a ``config.json`` path or a folder holding one, or
    a ModelSpec unchanged."""
    if isinstance(name, ModelSpec):
        return name
    key = str(name).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(str(name))
    if key.endswith(".json") or path.is_file() or (path / "config.json").is_file():
        return ModelSpec.from_hf_config(name)
    raise PlanError(f"model: unknown model preset {name!r}; known: {', '.join(PRESETS)} "
                    "(or give a Hugging Face config.json, or a folder holding one)")
