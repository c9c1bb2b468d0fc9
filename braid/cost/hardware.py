"""Hardware presets for the analytic cost model.

Each preset gives the *achievable* rates the cost model divides work by (not datasheet
peaks, except ``peak_flops`` which is the MFU denominator). The H200 figures are
calibrated to measurements on a 2x H200 NVLink machine: the TP=2 MLP forward of a
Qwen2-7B-sized layer at 4096 tokens takes 1.34 ms (8.34e11 FLOPs -> ~622 TFLOP/s
achievable), and the all-reduce of a 4096x3584 bf16 tensor takes 0.12 ms (29.4 MB at TP=2:
10 us latency + bytes / 267 GB/s bus bandwidth). The other presets scale from public
datasheets with the same achievable fractions; treat them as starting points and replace
them with a profiled cost file (``--costs``) when accuracy matters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Hardware:
    """Achievable rates of one accelerator and its links.

    ``matmul_flops``/``attn_flops``: achievable FLOP/s of dense matmuls / flash attention;
    ``peak_flops``: datasheet dense bf16 peak (MFU denominator); ``ar_bus_bytes_per_s`` and
    ``ar_latency_s``: ring all-reduce bus bandwidth and fixed latency inside a TP group;
    ``p2p_bytes_per_s``/``p2p_latency_s``: one pipeline send/recv; ``pcie_bytes_per_s``:
    host<->device copy bandwidth per direction; ``pcie_duplex_slowdown``: how much longer a
    copy takes while one in the other direction runs (1 = full duplex, 2 = one shared link;
    ``python -m braid.profile`` measures it); ``p2p_over_pcie``: pipeline traffic shares
    the PCIe link with host copies (PCIe-only boxes); ``memory_bytes``: device memory as the
    driver reports it (``nvidia-smi``'s memory.total, ``torch.cuda.get_device_properties().total_memory``),
    the cap the planner checks a configuration's peak against (:data:`DEVICE_MIB`).
    ``inter_node_bytes_per_s``/``inter_node_latency_s``: what one GPU gets between nodes (its
    InfiniBand/RoCE NIC; collectives and P2P that cross nodes run at this rate);
    ``hbm_bytes_per_s``: achievable device-memory bandwidth (the optimizer step is bound by it).
    """

    name: str
    matmul_flops: float
    attn_flops: float
    peak_flops: float
    ar_bus_bytes_per_s: float
    ar_latency_s: float
    p2p_bytes_per_s: float
    p2p_latency_s: float
    pcie_bytes_per_s: float
    memory_bytes: int
    p2p_over_pcie: bool = False
    pcie_duplex_slowdown: float = 2.0
    inter_node_bytes_per_s: float = 40e9
    inter_node_latency_s: float = 20e-6
    hbm_bytes_per_s: float = 2.5e12

    def __post_init__(self) -> None:
        rates = ("matmul_flops", "attn_flops", "peak_flops", "ar_bus_bytes_per_s", "p2p_bytes_per_s", "pcie_bytes_per_s",
                 "inter_node_bytes_per_s", "hbm_bytes_per_s")
        bad = [n for n in rates if not getattr(self, n) > 0]
        if bad:
            raise ValueError(f"hardware {self.name!r}: rates must be positive, check {', '.join(bad)}")
        if not 1.0 <= self.pcie_duplex_slowdown <= 2.0:
            raise ValueError(f"hardware {self.name!r}: pcie_duplex_slowdown must be in [1, 2], got {self.pcie_duplex_slowdown}")


GB = 1e9
MIB = 1 << 20

# Device memory as nvidia-smi reports it (memory.total, MiB). The datasheets' round figures
# are not bytes of either unit: an H200 "141 GB" reports 143771 MiB (140.4 GiB, 150.8e9
# bytes), an H100 "80 GB" 81559 MiB (79.6 GiB), an A100 "80 GB" (the A800's board) 81920 MiB,
# an H20 "96 GB" 97871 MiB (95.6 GiB).
DEVICE_MIB = {"h200": 143771, "h100": 81559, "a800": 81920, "h20": 97871}

# Between nodes: one 400 Gb/s NIC per GPU (H100/H200/H20 NDR, A800 200 Gb/s), ~80% achievable;
# HBM: ~85% of the datasheet bandwidth (H200 4.8 TB/s, H100 3.35, A800 2.0, H20 4.0).
# pcie_duplex_slowdown: `python -m braid.profile` on an H200 host measured 54.7 GB/s per direction
# and x1.10 with both directions at once (PCIe Gen5, as on H100 SXM hosts); other presets keep 2.
HARDWARE: dict[str, Hardware] = {
    "h200": Hardware("h200", matmul_flops=622e12, attn_flops=450e12, peak_flops=989e12,
                     ar_bus_bytes_per_s=267 * GB, ar_latency_s=10e-6, p2p_bytes_per_s=300 * GB,
                     p2p_latency_s=15e-6, pcie_bytes_per_s=55 * GB, memory_bytes=DEVICE_MIB["h200"] * MIB, pcie_duplex_slowdown=1.1,
                     inter_node_bytes_per_s=40 * GB, hbm_bytes_per_s=4.1e12),
    "h100": Hardware("h100", matmul_flops=600e12, attn_flops=420e12, peak_flops=989e12,
                     ar_bus_bytes_per_s=260 * GB, ar_latency_s=10e-6, p2p_bytes_per_s=300 * GB,
                     p2p_latency_s=15e-6, pcie_bytes_per_s=55 * GB, memory_bytes=DEVICE_MIB["h100"] * MIB, pcie_duplex_slowdown=1.1,
                     inter_node_bytes_per_s=40 * GB, hbm_bytes_per_s=2.85e12),
    # A800: A100 compute, NVLink capped at 400 GB/s -> TP comm is relatively expensive.
    "a800": Hardware("a800", matmul_flops=230e12, attn_flops=170e12, peak_flops=312e12,
                     ar_bus_bytes_per_s=150 * GB, ar_latency_s=12e-6, p2p_bytes_per_s=100 * GB,
                     p2p_latency_s=20e-6, pcie_bytes_per_s=25 * GB, memory_bytes=DEVICE_MIB["a800"] * MIB,
                     inter_node_bytes_per_s=20 * GB, hbm_bytes_per_s=1.7e12),
    # H20: low bf16 FLOPs, full NVLink -> TP comm is relatively cheap (paper Appendix, Table 8).
    "h20": Hardware("h20", matmul_flops=120e12, attn_flops=100e12, peak_flops=148e12,
                    ar_bus_bytes_per_s=267 * GB, ar_latency_s=10e-6, p2p_bytes_per_s=300 * GB,
                    p2p_latency_s=15e-6, pcie_bytes_per_s=55 * GB, memory_bytes=DEVICE_MIB["h20"] * MIB,
                    inter_node_bytes_per_s=40 * GB, hbm_bytes_per_s=3.4e12),
}


def ring_s(nbytes: float, size: int, bytes_per_s: float, latency_s: float, passes: int = 1) -> float:
    """Seconds of a ring collective of ``nbytes`` per rank over ``size`` ranks on one link: ``latency +
    passes * (size - 1) / size * nbytes / rate`` -- ``passes`` 2 for an all-reduce, 1 for a reduce-scatter,
    all-gather or all-to-all (each rank keeps ``1/size`` of its bytes); 0 on one rank."""
    if size == 1:
        return 0.0
    return latency_s + passes * (size - 1) / size * nbytes / bytes_per_s


def get_hardware(name: str) -> Hardware:
    """The preset called ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; valid names: {', '.join(HARDWARE)}") from None
