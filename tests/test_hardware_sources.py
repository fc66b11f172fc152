"""Every figure of every preset that the time or memory model reads names where it comes from
(a datasheet, a paper, NCCL's source, a fit, a measurement, or "assumed"); a figure carried over
from A100's fit says so."""
from __future__ import annotations

import pytest

from pipesim.hardware import FITTED, get_hardware, hardware_names

READ = ("peaks", "memory_bytes", "fp8_flops", "mxfp8_flops", "nvfp4_flops", "fp32_flops", "gemm_e_max", "gemm_dim_half",
        "mem_efficiency", "flash_e_max", "launch_overhead", "memory_reserve", "fragmentation",
        "link_bus_efficiency", "network_bus_efficiency", "link_latency", "network_latency",
        "nvlink_domain")


@pytest.mark.parametrize("name", hardware_names())
def test_every_figure_of_a_preset_names_its_source(name):
    hw = get_hardware(name)
    missing = [f for f in READ if not hw.source(f)]
    assert not missing, f"{name}: no source for {missing}"
    if hw.extrapolated:
        assert "A100" in hw.source("gemm_dim_half") and "extrapolated" in hw.source("gemm_dim_half")
    else:
        # A100 fitted on its two tables; the GPUs of pipesim/data/fitted.json on published
        # Megatron-Bridge runs, each fitted figure saying so, the rest still carried over
        assert name == "A100" or name in FITTED["gpus"]
        for figure in (["gemm_e_max"] if name == "A100" else list(FITTED["gpus"][name])):
            assert "fitted" in hw.source(figure), (name, figure)
        if name != "A100":
            assert "extrapolated" in hw.source("gemm_dim_half")
