"""FLOPs and memory against independent transcriptions of Megatron-LM and Korthikanti et al. 2022.

Every reference below is transcribed from its source (named in each function's comment), with
Megatron's ``args`` replaced by keyword arguments; nothing here calls pipesim to compute them.
"""
import types

import pytest

import pipesim
from pipesim.plan.flops import layer_flops, model_flops
from pipesim.plan.footprint import layer_activations, param_bytes
from pipesim.plan.model import ModelSpec
from pipesim.plan.parallelism import Parallelism


# -- transcriptions ----------------------------------------------------------------------------
def megatron_num_floating_point_operations(args, batch_size):
    """NVIDIA/Megatron-LM megatron/training/training.py, num_floating_point_operations ->
    transformer_flops (commit 001b00c2), the path without MLA, MTP, linear attention, latent MoE
    or attention output gate."""
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_experts is None:
        num_dense_layers = args.num_layers
        num_moe_layers = 0
        num_experts_routed_to = 0
    else:
        moe_layer_pattern = [1 if (i % args.moe_layer_freq == 0) else 0 for i in range(args.num_layers)]
        num_moe_layers = sum(moe_layer_pattern)
        num_dense_layers = args.num_layers - num_moe_layers
        num_experts_routed_to = args.moe_router_topk
    num_layers = args.num_layers
    moe_ffn_hidden_size = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    shared_expert_ffn_hidden_size = (0 if args.moe_shared_expert_intermediate_size is None
                                     else args.moe_shared_expert_intermediate_size)
    forward_backward_expansion_factor = 3
    fma_expansion_factor = 2
    ffn_expansion_factor = 3 if args.swiglu else 2
    query_projection_size = args.kv_channels * args.num_attention_heads
    key_projection_size = args.kv_channels * args.num_query_groups
    value_projection_size = args.kv_channels * args.num_query_groups
    standard_self_attn_term = (
        forward_backward_expansion_factor * fma_expansion_factor * (
            args.hidden_size * (query_projection_size + key_projection_size + value_projection_size)
            + query_projection_size * args.seq_length / 2 * 2
            + query_projection_size * args.hidden_size))
    self_attn_term = standard_self_attn_term * num_layers
    return batch_size * args.seq_length * (
        forward_backward_expansion_factor * fma_expansion_factor * args.hidden_size * (
            (args.ffn_hidden_size * ffn_expansion_factor) * num_dense_layers
            + (moe_ffn_hidden_size * num_experts_routed_to * ffn_expansion_factor) * num_moe_layers
            + (shared_expert_ffn_hidden_size * ffn_expansion_factor) * num_moe_layers)
        + self_attn_term
        + forward_backward_expansion_factor * fma_expansion_factor * args.hidden_size
        * args.padded_vocab_size)


def megatron_weight_and_optimizer_memory(args):
    """NVIDIA/Megatron-LM megatron/training/theoretical_memory_usage.py,
    compute_weight_and_optimizer_memory (commit 00caa53a), without MLA and MTP."""
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = query_projection_size / args.hidden_size
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    num_experts = 1 if args.num_experts is None else args.num_experts
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1
    shared = 0 if args.moe_shared_expert_intermediate_size is None else args.moe_shared_expert_intermediate_size
    if args.num_experts is not None:
        pattern = [1 if (i % args.moe_layer_freq == 0) else 0 for i in range(args.num_layers)]
        num_dense_layers = args.num_layers - sum(pattern)
        num_moe_layers = sum(pattern)
        moe_ffn_hidden_size = args.moe_ffn_hidden_size
    else:
        num_dense_layers, num_moe_layers, moe_ffn_hidden_size = args.num_layers, 0, 0
    norm_size = 1 if args.normalization == "RMSNorm" else 2
    self_attn_term = (2 * args.hidden_size * args.hidden_size
                      * ((1 + (args.num_query_groups / args.num_attention_heads))
                         * query_projection_to_hidden_size_ratio))
    dense = 2 * args.hidden_size * ((args.ffn_hidden_size * gated_linear_multiplier) + norm_size) + self_attn_term
    moe = 2 * args.hidden_size * ((moe_ffn_hidden_size * num_experts * gated_linear_multiplier)
                                  + (shared * gated_linear_multiplier) + norm_size) + self_attn_term
    embedding_size = args.hidden_size * args.padded_vocab_size
    final_layernorm = norm_size * args.hidden_size
    block = dense * num_dense_layers + moe * num_moe_layers + final_layernorm
    most_loaded = (block / args.pipeline_model_parallel_size + embedding_size) / args.tensor_model_parallel_size
    if args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size == 1:
        most_loaded += embedding_size / args.tensor_model_parallel_size
    num_bytes_per_parameter = 18 if not args.use_distributed_optimizer else 6 + (12 / args.data_parallel_size)
    return most_loaded * num_bytes_per_parameter, final_layernorm


def megatron_activation_memory(args, num_microbatches):
    """theoretical_memory_usage.py, compute_activation_memory (the SP + selective path)."""
    activation_memory = (args.seq_length * args.micro_batch_size * args.hidden_size) * (
        18 + (4 * (args.ffn_hidden_size / args.hidden_size)))
    activation_memory *= args.num_layers
    activation_memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    activation_memory += (args.seq_length * args.micro_batch_size * args.hidden_size
                          * args.pipeline_model_parallel_size)
    if args.virtual_pipeline_model_parallel_size is not None:
        penalty = 1 + ((args.pipeline_model_parallel_size - 1)
                       / (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size))
        activation_memory *= penalty
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        activation_memory += (args.seq_length * args.micro_batch_size * args.hidden_size * 4
                              * (1 + (args.padded_vocab_size / args.hidden_size)))
    return activation_memory / args.tensor_model_parallel_size


def megatron_activation_memory_without_sp(args, num_microbatches):
    """theoretical_memory_usage.py, compute_activation_memory_without_sp (its 1.05 overhead
    factor included)."""
    per_layer_memory = (args.seq_length * args.micro_batch_size * args.hidden_size
                        * (10 + (24 / args.tensor_model_parallel_size)))
    total = per_layer_memory * args.num_layers
    total += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    total += args.seq_length * args.micro_batch_size * args.hidden_size * args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            total *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        logits_size = args.seq_length * args.micro_batch_size * args.padded_vocab_size
        logits_size /= args.tensor_model_parallel_size
        final_ln_output = args.seq_length * args.micro_batch_size * args.hidden_size
        total += (logits_size + final_ln_output) * 2
    return total * 1.05


def korthikanti_table2(s, b, h, a, t):
    """Korthikanti et al. 2022, Table 2: activation bytes per transformer layer."""
    return {
        ("none", False, 1): s * b * h * (34 + 5 * a * s / h),
        ("none", False, t): s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", True, t): s * b * h * (34 / t + 5 * a * s / (h * t)),
        ("selective", False, t): s * b * h * (10 + 24 / t),
        ("selective", True, t): s * b * h * 34 / t,
        ("full", False, t): s * b * h * 2,
    }


def korthikanti_eq7(B, s, l, h, V):
    """Eq. 7: model FLOPs per iteration, 72 B s l h^2 (1 + s/6h + V/12hl)."""
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * h * l))


def korthikanti_hfu_full(B, s, l, h, V):
    """Hardware FLOPs with full recomputation, 96 B s l h^2 (1 + s/6h + V/16hl) (§6.3)."""
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * h * l))


def korthikanti_hfu_selective(B, s, l, h, V):
    """Hardware FLOPs with selective recomputation as the paper counts them (its Table 5 HFU):
    72 B s l h^2 (1 + s/3h + V/12hl)."""
    return 72 * B * s * l * h * h * (1 + s / (3 * h) + V / (12 * h * l))


# -- helpers -----------------------------------------------------------------------------------
def megatron_args(m: ModelSpec, tp=1, pp=1, vpp=None, dp=1, mbs=1, dist_opt=False):
    return types.SimpleNamespace(
        kv_channels=m.kv_channels, num_attention_heads=m.heads, hidden_size=m.hidden,
        group_query_attention=m.num_kv_heads != m.heads, num_query_groups=m.num_kv_heads,
        num_experts=m.experts or None, moe_router_topk=m.top_k, swiglu=m.gated,
        moe_shared_expert_intermediate_size=m.shared_expert_ffn_hidden or None,
        moe_layer_freq=m.moe_layer_freq, num_layers=m.layers, moe_ffn_hidden_size=m.moe_ffn,
        ffn_hidden_size=m.ffn, seq_length=m.seq_length, padded_vocab_size=m.padded_vocab(tp),
        normalization="RMSNorm" if m.norm == "rmsnorm" else "LayerNorm",
        untie_embeddings_and_output_weights=not m.tied_embeddings,
        pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
        virtual_pipeline_model_parallel_size=vpp, use_distributed_optimizer=dist_opt,
        data_parallel_size=dp, micro_batch_size=mbs)


GRID_MODELS = [
    ModelSpec("gpt", 8, 1024, 16, 512, 50257),
    ModelSpec("gqa-swiglu", 8, 2048, 16, 1024, 32000, kv_heads=4, ffn_hidden=5632, mlp="swiglu",
              norm="rmsnorm", position="rotary", tied_embeddings=False, bias=False),
    ModelSpec("head-dim", 8, 1024, 16, 256, 1000, kv_heads=2, head_dim=128, ffn_hidden=3000,
              mlp="swiglu", norm="rmsnorm", position="rotary", bias=False),
    ModelSpec("moe", 8, 1024, 8, 512, 32000, kv_heads=8, ffn_hidden=2816, mlp="swiglu",
              norm="rmsnorm", position="rotary", tied_embeddings=False, bias=False, experts=8,
              top_k=2, moe_ffn_hidden=1408, shared_expert_ffn_hidden=2816, moe_layer_freq=2),
    pipesim.plan.model.PRESETS["llama3-70b"],
    pipesim.plan.model.PRESETS["mixtral-8x7b"],
]


@pytest.mark.parametrize("model", GRID_MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("tp", [1, 8])
def test_flops_match_megatron_num_floating_point_operations(model, batch, tp):
    ref = megatron_num_floating_point_operations(megatron_args(model, tp=tp), batch)
    assert model_flops(model, batch, tp=tp, causal=True) == pytest.approx(ref, rel=1e-12)


def test_flops_match_korthikanti_eq7_and_the_zero_bubble_split():
    m = ModelSpec("gpt", 24, 2048, 16, 2048, 51200)
    B, s, l, h, V = 4, 2048, 24, 2048, 51200
    assert model_flops(m, B) == pytest.approx(korthikanti_eq7(B, s, l, h, V), rel=1e-12)
    # Zero Bubble (Qi et al. 2024) Table 1: F sbh(24h + 4s), I sbh(24h + 8s), W 24 sbh^2
    lf = layer_flops(m, 1)
    assert (lf.forward, lf.input_grad, lf.weight_grad) == (
        s * h * (24 * h + 4 * s), s * h * (24 * h + 8 * s), s * h * 24 * h)


# Megatron's parameter count has no linear biases and no learned position table
MEMORY_MODELS = [GRID_MODELS[0].with_(bias=False, position="rotary"), *GRID_MODELS[1:4]]


@pytest.mark.parametrize("model", MEMORY_MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("tp, pp, dp, dist", [(1, 1, 1, False), (2, 1, 4, True), (4, 2, 2, False),
                                               (2, 4, 8, True), (1, 2, 1, True)])
def test_weights_and_optimizer_match_megatron(model, tp, pp, dp, dist):
    """Rank 0's weights + gradients + optimizer against compute_weight_and_optimizer_memory.
    Megatron spreads the final norm over all stages (pipesim keeps it on the last) and does
    not count the MoE router (pipesim does): those two terms are corrected for, exactly."""
    ref, final_norm = megatron_weight_and_optimizer_memory(
        megatron_args(model, tp=tp, pp=pp, dp=dp, dist_opt=dist))
    plan = pipesim.Plan.create(model, "H100", tp=tp, pp=pp, dp=dp, zero=1 if dist else 0,
                               global_batch_size=dp * 4)
    derived = plan.derive()
    mine = sum(derived.stage_memory[0].values())
    bytes_per = 18 if not dist else 6 + 12 / dp
    router = sum(model.hidden * model.experts for moe in model.moe_pattern()[:model.layers // pp] if moe)
    expected = ref - final_norm / pp / tp * bytes_per + router / tp * bytes_per
    if pp == 1:
        expected += final_norm / tp * bytes_per
    assert mine == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tp, pp, mbs, m", [(1, 1, 1, 1), (2, 2, 1, 8), (4, 4, 2, 8), (8, 2, 1, 4),
                                            (2, 4, 1, 2)])
def test_activations_match_megatron_sp_selective_from_the_simulated_peak(tp, pp, mbs, m):
    """compute_activation_memory (SP + selective) against 1F1B's simulated peak on rank 0: the
    in-flight microbatches come from the simulator's memory timeline; the one gradient receive
    buffer the simulator also holds is taken out."""
    model = ModelSpec("gpt", 16, 1024, 16, 512, 50257)
    plan = pipesim.Plan.create(model, "H100", tp=tp, pp=pp, micro_batch_size=mbs,
                               global_batch_size=mbs * m, sequence_parallel=True,
                               recompute="selective", flash_attention=False)
    r = pipesim.simulate(plan)
    recv = plan.costs().p2p_bytes if pp > 1 else 0.0
    ref = megatron_activation_memory(megatron_args(model, tp=tp, pp=pp, mbs=mbs), m)
    assert r.memory_breakdown[0]["activations"] - recv == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("tp, pp, mbs, m", [(1, 2, 1, 8), (2, 2, 1, 8), (4, 4, 2, 8), (8, 2, 1, 1)])
def test_activations_match_megatron_without_sp(tp, pp, mbs, m):
    """compute_activation_memory_without_sp (tp, selective; its 1.05 overhead factor
    divided out). Megatron's formula hardcodes the 24 = 4h FFN, so a GPT shape."""
    model = ModelSpec("gpt", 16, 1024, 16, 512, 50257)
    plan = pipesim.Plan.create(model, "H100", tp=tp, pp=pp, micro_batch_size=mbs,
                               global_batch_size=mbs * m, recompute="selective",
                               flash_attention=False)
    r = pipesim.simulate(plan)
    recv = plan.costs().p2p_bytes
    ref = megatron_activation_memory_without_sp(megatron_args(model, tp=tp, pp=pp, mbs=mbs), m)
    assert r.memory_breakdown[0]["activations"] - recv == pytest.approx(ref / 1.05, rel=1e-12)


@pytest.mark.parametrize("s, b, h, a, t", [(2048, 1, 12288, 96, 8), (4096, 2, 4096, 32, 4),
                                           (1024, 4, 2048, 16, 2), (512, 1, 1024, 8, 1)])
def test_korthikanti_table2_exactly(s, b, h, a, t):
    model = ModelSpec("gpt", 4, h, a, s, 51200)
    ref = korthikanti_table2(s, b, h, a, t)
    for (rec, sp, tt), expected in ref.items():
        par = Parallelism(tp=tt, sequence_parallel=sp, recompute=rec, micro_batch_size=b,
                          flash_attention=False)
        assert layer_activations(model, par).total == pytest.approx(expected, rel=1e-12), (rec, sp, tt)
    # W keeps the inputs of the four linear layers: 2 + 2 + 2 + 8 = 14 sbh (tp = 1)
    par = Parallelism(micro_batch_size=b, flash_attention=False)
    assert layer_activations(model, par).weight_grad == 14 * s * b * h


def test_bytes_per_parameter_table():
    """Megatron-LM docs/source/api-guide/dist_optimizer.md: bytes per parameter."""
    for d in (1, 2, 8, 64):
        table = {"fp16": (20, 4 + 16 / d), "bf16": (18, 6 + 12 / d), "fp32": (16, 8 + 8 / d)}
        for precision, (plain, distributed) in table.items():
            assert sum(param_bytes(precision, 0, 1.0, 0.0, d, d).values()) == plain
            assert sum(param_bytes(precision, 1, 1.0, 0.0, d, d).values()) == pytest.approx(distributed)
        # ZeRO-2 shards gradients too, ZeRO-3 the weights as well
        assert sum(param_bytes("bf16", 2, 1.0, 0.0, d, d).values()) == pytest.approx(2 + 16 / d)
        assert sum(param_bytes("bf16", 3, 1.0, 0.0, d, d).values()) == pytest.approx(18 / d)


# Table 5 of Korthikanti et al. 2022 (iteration seconds, MFU %, HFU %), the runs whose
# published utilisations are transcribed here: (full recompute), (SP + selective).
TABLE5 = {
    "175B": ((96, 12288, 96, 64, 64), (18.13, 39.0, 51.9), (13.75, 51.4, 52.8)),
    "530B": ((128, 20480, 105, 280, 280), (49.05, 43.2, 57.6), (37.83, 56.0, 57.0)),
    "1T": ((160, 25600, 128, 512, 512), (94.42, 42.6, 56.8), (71.49, 56.3, 57.0)),
}


@pytest.mark.parametrize("name", sorted(TABLE5))
def test_eq7_eq8_turn_table5_times_into_the_published_utilisation(name):
    (a, h, l, gpus, B), full, selective = TABLE5[name]
    s, V, peak = 2048, 51200, 312e12
    for (seconds, mfu, hfu), hw in ((full, korthikanti_hfu_full), (selective, korthikanti_hfu_selective)):
        assert 100 * korthikanti_eq7(B, s, l, h, V) / (seconds * gpus * peak) == pytest.approx(mfu, abs=0.05)
        assert 100 * hw(B, s, l, h, V) / (seconds * gpus * peak) == pytest.approx(hfu, abs=0.05)
    # pipesim counts the same model FLOPs, and the same hardware FLOPs for full recomputation
    model = ModelSpec(name, l, h, a, s, V)
    plan = pipesim.Plan.create(model, "A100", tp=8, pp=gpus // 8, micro_batch_size=1,
                               global_batch_size=B, recompute="full", flash_attention=False)
    d = plan.derive()
    assert d.model_flops == pytest.approx(korthikanti_eq7(B, s, l, h, V), rel=1e-12)
    assert d.hardware_flops == pytest.approx(korthikanti_hfu_full(B, s, l, h, V), rel=1e-12)
