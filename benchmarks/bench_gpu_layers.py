"""One transformer layer's F, B, I and W, measured on a device, against pipesim's per-operator
prediction for that device's figures: the check of the time model that a GPU allows.

    python benchmarks/bench_gpu_layers.py --device cuda --hardware H200 --hardware H200.json
    OMP_NUM_THREADS=1 python benchmarks/bench_gpu_layers.py --device cpu --quick --hardware cpu.json
    python benchmarks/bench_gpu_layers.py --from tests/data/h200_layers.json --hardware H200

Each unit is built by pipeexec as a run builds it (the built-in GPT's block, a Hugging Face
Llama decoder layer, a model's head with its loss), in bf16 on the device, and timed as the
executor's split-backward probe times a stage: F, then B (the full backward) after another
forward, then F, I and W (`pipeexec.pipeline.backward`), each between CUDA events (wall clock
on a CPU), the median over the repeats after warm-up. The prediction is
`pipesim.plan.operators.pass_times` of the same shape, micro-batch and precision, for every
``--hardware`` given (a preset or a hardware file), so a preset's datasheet-and-fit figures and
a file measured on the device (``pipeexec calibrate-hardware``) sit side by side. B is
predicted as I + W. The bytes the forward saves for the backward (every saved tensor's
storage once, parameters left out, counted by a saved-tensors hook) are set against the plan's
activation formula (`pipesim.plan.footprint`, plus what a Hugging Face family's modules save
beyond it, `pipeexec.analysis.hf_activations`). ``--out FILE`` writes every row as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipesim.hardware import get_hardware
from pipesim.plan.footprint import head_activations, layer_activations
from pipesim.plan.model import ModelSpec
from pipesim.plan.operators import head_ops, layer_ops, pass_times
from pipesim.plan.parallelism import Parallelism

OPS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Unit:
    label: str
    spec: ModelSpec
    micro_batch: int
    part: str            # "layer" or "head"


def llama_config(hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int = 128256) -> dict:
    """A Llama-3 shaped Hugging Face config (one layer: the unit is one of them)."""
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": 1, "vocab_size": vocab, "max_position_embeddings": 8192,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def gpt_spec(name: str, hidden: int, heads: int, seq: int, vocab: int = 50304) -> ModelSpec:
    return ModelSpec(name, layers=1, hidden=hidden, heads=heads, seq_length=seq, vocab=vocab,
                     ffn_hidden=4 * hidden, dropout=False, tied_embeddings=False)


def units(quick: bool) -> list[Unit]:
    if quick:        # CPU: small enough for seconds
        seq = 256
        gpt = gpt_spec("gpt h256", 256, 4, seq, vocab=4096)
        llama = ModelSpec.from_hf_config(llama_config(256, 688, 4, 2, vocab=4096),
                                         name="llama h256", seq_length=seq)
        return [Unit("gpt h256 block", gpt, 1, "layer"), Unit("llama h256 layer", llama, 1, "layer"),
                Unit("llama h256 head", llama, 1, "head")]
    seq = 4096
    out = []
    for hidden, heads in ((4096, 32), (2048, 16), (1024, 16)):
        spec = gpt_spec(f"gpt h{hidden}", hidden, heads, seq)
        for b in ((1, 2) if hidden == 4096 else (1,)):
            out.append(Unit(f"gpt h{hidden} block", spec, b, "layer"))
    l8 = ModelSpec.from_hf_config(llama_config(4096, 14336, 32, 8), name="llama3-8b",
                                  seq_length=seq)
    l1 = ModelSpec.from_hf_config(llama_config(2048, 8192, 32, 8), name="llama3.2-1b",
                                  seq_length=seq)
    out += [Unit("llama3-8b layer", l8, 1, "layer"), Unit("llama3-8b layer", l8, 2, "layer"),
            Unit("llama3.2-1b layer", l1, 1, "layer"), Unit("llama3-8b head", l8, 1, "head")]
    return out


def predicted(unit: Unit, hw) -> dict[str, float]:
    par = Parallelism(micro_batch_size=unit.micro_batch, precision="bf16")
    ops = layer_ops(unit.spec, par) if unit.part == "layer" else head_ops(unit.spec, par)
    t = pass_times(ops, hw, "bf16")
    return {"F": t.F, "B": t.I + t.W, "I": t.I, "W": t.W, "gemm_flops_F": t.flops_F}


def predicted_activations(unit: Unit) -> float:
    """Bytes the plan counts as this unit's activations for one microbatch."""
    from pipeexec.analysis.hf_activations import head_extra, layer_extra

    par = Parallelism(micro_batch_size=unit.micro_batch, precision="bf16")
    hf = unit.spec.family is not None
    if unit.part == "head":
        return head_activations(unit.spec, par) + (head_extra(unit.spec, par) if hf else 0.0)
    return layer_activations(unit.spec, par).total + (
        layer_extra(unit.spec, par, moe=False) if hf else 0.0)


class SavedBytes:
    """Bytes of the distinct storages autograd saves inside the ``with`` block, parameters
    left out: what the forward keeps for the backward (the unit's input too, when an operator
    saves it: a layer's activations include its input, as the formulas count them)."""

    def __init__(self, exclude) -> None:
        from torch.autograd.graph import saved_tensors_hooks

        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._sizes: dict[int, int] = {}
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self._exclude:
            self._sizes[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self._sizes.values())


def measure(unit: Unit, device: str, repeats: int) -> dict[str, float]:
    """Medians of F, B, I, W (seconds) of ``unit`` built as pipeexec builds it."""
    import torch
    from torch.autograd.graph import get_gradient_edge

    from pipeexec.model import gpt_stack
    from pipeexec.models.hf import hf_layer_stack
    from pipeexec.pipeline.backward import backward_input, full_backward

    dev = torch.device(device)
    stack = gpt_stack(unit.spec) if unit.spec.family is None else hf_layer_stack(unit.spec)
    index = 1 if unit.part == "layer" else unit.spec.layers + 1
    gen = torch.Generator().manual_seed(0)
    module = stack.factory(index, gen).to(device=dev, dtype=torch.bfloat16)
    params = [p for p in module.parameters() if p.requires_grad]
    b, s, h = unit.micro_batch, unit.spec.seq_length, unit.spec.hidden
    x0 = torch.randn(b, s, h, device=dev, dtype=torch.bfloat16)
    targets = torch.randint(0, unit.spec.vocab, (b, s), device=dev)
    grad = torch.randn(b, s, h, device=dev, dtype=torch.bfloat16)

    def timed(fn):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            value = fn()
            end.record()
            end.synchronize()
            return value, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - t0

    def forward(x):
        with torch.enable_grad():
            y = module(x)
            if unit.part == "head":
                return stack.loss_fn(y.float(), targets), None
            return y, grad

    def other():                      # another microbatch between passes, as in a schedule
        with torch.no_grad():
            module(x0)

    x = x0.detach().requires_grad_(True)
    with SavedBytes(params) as saved:
        forward(x)
    saved_bytes = saved.total
    del x, saved
    times = {op: [] for op in OPS}
    for r in range(repeats + 2):      # the first two: warm-up (kernel choice, allocator)
        keep = r >= 2
        for split in (False, True):
            x = x0.detach().requires_grad_(True)
            (root, g), t = timed(lambda: forward(x))
            if keep:
                times["F"].append(t)
            edge = get_gradient_edge(root)
            other()
            if not split:
                _, t = timed(lambda: full_backward(edge, g, x, params))
                if keep:
                    times["B"].append(t)
                continue
            (_, _, wgrad), t = timed(lambda: backward_input(edge, g, x, params))
            if keep:
                times["I"].append(t)
            root = edge = None
            other()
            _, t = timed(lambda: wgrad.compute(params))
            if keep:
                times["W"].append(t)
    del module
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    out = {op: statistics.median(v) for op, v in times.items()}
    out["saved_bytes"] = float(saved_bytes)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hardware", action="append", default=None,
                    help="a preset or hardware file to predict with (repeat for several)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="CPU-sized units")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--from", dest="stored", default=None, metavar="FILE.json",
                    help="no measuring: predict the measurements an earlier --out stored (e.g. "
                         "tests/data/h200_layers.json) with today's model")
    ns = ap.parse_args(argv)
    hws = [get_hardware(h) for h in (ns.hardware or ["H200"])]
    stored = None
    if ns.stored:
        data = json.loads(Path(ns.stored).read_text())
        stored = {(r["unit"], r["micro_batch"]): r["measured"] for r in data["rows"]}
        print(f"measured on {data['meta'].get('gpu', data['meta']['device'])} "
              f"({data['meta']['date']}), predicted now")
    rows = []
    for unit in units(ns.quick):
        if stored is not None and (unit.label, unit.micro_batch) not in stored:
            continue
        got = (stored[(unit.label, unit.micro_batch)] if stored is not None
               else measure(unit, ns.device, ns.repeats))
        preds = {hw.name: predicted(unit, hw) for hw in hws}
        flops = next(iter(preds.values()))["gemm_flops_F"]
        act = predicted_activations(unit)
        rows.append({"unit": unit.label, "micro_batch": unit.micro_batch,
                     "seq": unit.spec.seq_length, "measured": got,
                     "predicted": {k: {op: v[op] for op in OPS} for k, v in preds.items()},
                     "predicted_activation_bytes": act,
                     "F_tflops": flops / got["F"] / 1e12})
        print(f"{unit.label} mb {unit.micro_batch}: F {got['F'] * 1e3:.3f} ms "
              f"({flops / got['F'] / 1e12:.1f} TFLOP/s of model FLOPs); saved for the backward "
              f"{got['saved_bytes'] / 2**20:.1f} MiB, plan {act / 2**20:.1f} MiB "
              f"({act / got['saved_bytes'] - 1:+.1%})", flush=True)
    names = [hw.name for hw in hws]
    head = "| unit | mb | pass | measured (ms) | " + " | ".join(
        f"{n} (ms) | {n} / measured" for n in names) + " |"
    print()
    print(head)
    print("|---|---:|---|---:|" + "---:|---:|" * len(names))
    for r in rows:
        for op in OPS:
            m = r["measured"][op]
            cells = " | ".join(f"{r['predicted'][n][op] * 1e3:.3f} | "
                               f"{r['predicted'][n][op] / m:.2f}" for n in names)
            print(f"| {r['unit']} | {r['micro_batch']} | {op} | {m * 1e3:.3f} | {cells} |")
    for n in names:
        ratios = [r["predicted"][n][op] / r["measured"][op] for r in rows for op in OPS]
        print(f"{n}: predicted / measured over every row: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}")
    if ns.out and stored is None:
        meta = {"device": ns.device, "hardware": names, "date": time.strftime("%Y-%m-%d")}
        try:
            import torch
            if ns.device.startswith("cuda"):
                meta.update(gpu=torch.cuda.get_device_name(ns.device), torch=torch.__version__,
                            cuda=torch.version.cuda)
        except Exception:                       # noqa: BLE001 - metadata only
            pass
        Path(ns.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
