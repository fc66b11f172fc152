"""Shared pieces of the checkpoint tests: a tiny config, in-process trainers on a hand-made
topology (no process group: a rank of any layout can be built and loaded alone), and the
worker run in forked ranks by `pipeexec.launch`."""
from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import torch

from pipeexec.config import TrainConfig
from pipeexec.parallel.mesh import Mesh
from pipeexec.run.assemble import assemble
from pipeexec.topology import Topology, channel_keys, destroy_topology, init_topology
from pipeexec.training.train import Trainer, train

# decay_steps is fixed so that a run stopped early (smaller --steps) follows the same LR curve.
TINY = TrainConfig.from_flat(layers=6, hidden=16, heads=2, seq_len=8, vocab=32, steps=4,
                             decay_steps=8, lr=3e-3, min_lr=3e-4, warmup_steps=1,
                             weight_decay=0.1, clip_grad=0.5, microbatches=2, micro_batch_size=4,
                             seed=11, p2p_timeout=60.0, collective_timeout=120.0)


def fake_topology(pp: int = 1, dp: int = 1, pp_rank: int = 0, dp_rank: int = 0,
                  store=None) -> Topology:
    # No process groups: such a rank can be built, loaded and saved, not stepped (unless alone).
    return Topology.of(Mesh(pp=pp, dp=dp), pp_rank * dp + dp_rank, device=torch.device("cpu"),
                       backend="gloo", store=store, p2p_groups={k: None for k in channel_keys(pp)})


def local_trainer(cfg: TrainConfig, pp_rank: int = 0, dp_rank: int = 0, store=None) -> Trainer:
    par = cfg.plan.parallelism
    return assemble(cfg, fake_topology(par.pp, par.dp, pp_rank, dp_rank, store))


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.named_parameters().items()}


def checkpoint_worker(board, cfg: TrainConfig, options, snapshot_at: tuple[int, ...] = ()) -> dict:
    """One rank: load/save per ``options`` around the training loop; return losses, parameters
    at the iterations in ``snapshot_at`` and at the end, and the checkpoint metrics."""
    from pipeexec.checkpoint import CheckpointManager

    topo = init_topology(cfg.plan.parallelism.pp, cfg.plan.parallelism.dp, timeout=120)
    try:
        trainer = assemble(cfg, topo, board=board)
        manager = CheckpointManager(options)
        manager.load(trainer)
        start = trainer.iteration
        snaps = {}

        def on_step(tr, stats):
            manager.on_step(tr, stats)
            if tr.iteration in snapshot_at:
                snaps[tr.iteration] = params_of(tr)

        res = train(trainer, on_step=on_step)
        manager.finish(trainer)
        snaps[trainer.iteration] = params_of(trainer)
        return {"losses": res.losses, "start": start, "params": snaps, "pp_rank": topo.pp_rank,
                "dp_rank": topo.dp_rank, "metrics": manager.metrics(),
                "loaded": None if manager.loaded is None else manager.loaded.__dict__}
    finally:
        destroy_topology(topo)


def merge_params(results: list[dict], iteration: int, dp_rank: int = 0) -> dict[str, torch.Tensor]:
    """The whole model at ``iteration`` from the pipeline ranks of replica ``dp_rank``."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        if r["dp_rank"] == dp_rank:
            out.update(r["params"][iteration])
    return out


def flip_bit(path: Path, record: str | None = None, bit: int = 0x01) -> str:
    """Flip one bit in the middle of a record's stored bytes (``record``: its name, or the part
    after the archive's folder, e.g. ``data.pkl``; default: the largest record) of a torch zip
    file; return the record's full name. The offset is read from the record's local header
    (its length varies: torch pads it to align the data), so the flip lands in the data, which
    the record's CRC-32 covers, and never in a header."""
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if record is None or i.filename == record
                 or i.filename.endswith("/" + record)]
        info = max(infos, key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.compress_size // 2] ^= bit
    path.write_bytes(bytes(data))
    return info.filename
