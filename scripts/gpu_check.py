"""Check the agent's GPU paths on a machine with an NVIDIA GPU (the suite runs without one).

    python scripts/gpu_check.py            # prints one line per check and a JSON summary; exit 1 if a check fails

1. NVML: the device this process uses is found through CUDA's UUID; one raw reading;
   PCIe throughput; the sampler (a process of its own) at 1 kHz during a CUDA matmul loop:
   readings per second of each source (NVML's ``gpu`` tier included), CPU cost, and which metrics came out (SM clock, utilisation, power, temperature,
   clock-event reasons, PCIe, NVLink where the GPU has links).
2. CUDA-kernel summarisation: a transformer step on the GPU profiled for a 4-step window
   exactly as the agent does (torch.profiler with CUDA activity, export, trace reader,
   summariser with the NVML samples): kernels become ``compute`` functions on the ``gpu``
   whose hardware columns hold the SM clock, and copies ``memcpy`` on ``pcie``.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch

from lockstep.producers.agent import nvml
from lockstep.producers.agent.meta import discover
from lockstep.producers.agent.profiler import TorchWindow
from lockstep.producers.agent.redact import Redaction
from lockstep.producers.agent.retention import RawStore
from lockstep.producers.agent.sampler import HardwareSampler
from lockstep.producers.agent.settings import AgentConfig
from lockstep.producers.agent.window import process_window
from lockstep.schemas import functions as ft
from lockstep.schemas.records import ProfileTrigger, Sampling

results: dict[str, object] = {}
failures: list[str] = []


def check(name: str, ok: bool, detail: object) -> None:
    results[name] = detail
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        failures.append(name)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to check here")
        return 1
    torch.cuda.set_device(0)
    ident = discover(AgentConfig(job="gpu-check", bootstrap_servers="unused:9092"))
    check(
        "device",
        bool(ident.gpu_uuid) and "/gpu" in ident.meta.device,
        {"device": ident.meta.device, "uuid": ident.gpu_uuid},
    )
    dev = nvml.NvmlDevice.open(ident.gpu_uuid)
    check("nvml", dev is not None, nvml.unavailable_reason() or "opened")
    if dev is None:
        return 1
    r = dev.read()
    check("nvml reading", r.sm_clock_mhz > 0 and r.temp_c > 0 and r.power_mw > 0, r._asdict())
    t0 = time.perf_counter()
    tx, rx = dev.read_pcie()
    check(
        "pcie query",
        not (math.isnan(tx) or math.isnan(rx)),
        {"tx_kbs": tx, "rx_kbs": rx, "seconds": round(time.perf_counter() - t0, 3)},
    )
    check("nvlink", True, {"has_nvlink": dev.has_nvlink, "tx_kib": r.nvlink_tx_kib, "rx_kib": r.nvlink_rx_kib})

    # the sampler while the GPU works
    a = torch.randn(4096, 4096, device="cuda")
    sampler = HardwareSampler(0, 1000.0, gpu_uuid=ident.gpu_uuid)
    sampler.wait_ready()
    sampler.start()
    t0 = time.monotonic()
    host = torch.randn(64 << 20, pin_memory=True)
    while time.monotonic() - t0 < 3.0:
        a = (a @ a).clamp_(-1, 1)
        host.to("cuda", non_blocking=True)  # some PCIe traffic
    torch.cuda.synchronize()
    samples, stats = sampler.stop()
    metrics = sorted(set(samples.column("metric").to_pylist()))
    check(
        "sampler",
        stats.source == "nvml" and {"sm_clock_mhz", "sm_active", "gpu_power_w", "gpu_temp_c"} <= set(metrics),
        {
            "hz_achieved": round(stats.hz_achieved, 1),
            "readings_per_s": {k: round(n / stats.seconds) for k, n in stats.tiers.items()},
            "cpu_share_of_a_core": round(stats.cpu_share, 4),
            "metrics": metrics,
        },
    )
    by_metric = {m: samples.filter(pc.equal(samples.column("metric"), m)).column("value").to_numpy() for m in metrics}
    check(
        "sampled values",
        float(by_metric["sm_active"].mean()) > 0.3,
        {m: round(float(v.mean()), 3) for m, v in by_metric.items()},
    )
    # how often each value actually changed between readings: the rate worth sampling it at
    check(
        "changes per second",
        True,
        {m: round(float(np.count_nonzero(np.diff(v))) / stats.seconds, 1) for m, v in by_metric.items()},
    )

    # CUDA kernels summarised with the samples, as the agent does it
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 4).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 256, 512)

    def step() -> None:
        model(x.cuda(non_blocking=True)).square().mean().backward()  # a host-to-device copy, kernels
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()

    for _ in range(3):
        step()
    start, steps = 100, 4
    with tempfile.TemporaryDirectory() as tmp:
        sampler = HardwareSampler(0, 100.0, gpu_uuid=ident.gpu_uuid).start()
        window = TorchWindow(Sampling(hardware_hz=100))
        boundaries = {start: time.time() * 1e6}
        window.start(start)
        for s in range(start, start + steps):
            step()
            if s + 1 < start + steps:
                boundaries[s + 1] = time.time() * 1e6
                window.step()
        prof = window.stop()
        samples, _ = sampler.stop()
        trig = ProfileTrigger(job="gpu-check", window="w-gpu", start_step=start, steps=steps, expected_workers=1)
        out = process_window(
            prof,
            trig,
            ident.meta,
            samples,
            boundaries,
            "nvml",
            Redaction(),
            RawStore(Path(tmp), 1 << 30),
            min_share=0.001,
        )
    check(
        "window",
        len(out.batches) == steps,
        {
            "batches": len(out.batches),
            "trace_bytes": out.trace_bytes,
            "events": out.events,
            "seconds": round(out.seconds, 2),
        },
    )
    table = ft.unpack(out.batches[0].functions)
    rows = table.to_pylist()
    kernels = [r for r in rows if r["kind"] == "compute" and r["resource"] == "gpu"]
    copies = [r for r in rows if r["kind"] == "memcpy"]
    check("kernels", bool(kernels), [r["function"][:60] for r in sorted(kernels, key=lambda r: -r["critical_us"])[:5]])
    clocked = [r for r in kernels if r["sm_clock_mhz"] == r["sm_clock_mhz"]]  # not NaN
    check(
        "kernel hardware",
        len(clocked) == len(kernels),
        {
            "with_sm_clock": len(clocked),
            "kernels": len(kernels),
            "sm_clock_mhz": [round(r["sm_clock_mhz"]) for r in clocked[:5]],
        },
    )
    check("copies", bool(copies), [(r["function"][:40], r["resource"], r["pcie_gbps"]) for r in copies[:3]])
    check("bytes per step", True, {"function_table": len(out.batches[0].functions), "functions": len(rows)})
    print(json.dumps({"failures": failures, **results}, default=str, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
