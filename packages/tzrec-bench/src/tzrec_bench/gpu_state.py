"""The GPU's SM clock, temperature and power while a benchmark times something.

A power-capped GPU runs the same kernel at different clocks as it warms up: on an H100 held
at its 700 W cap, the attention forward at N=4096 measured from 475 to 510 TFLOP/s across runs
of one day, with SM clocks from about 1500 MHz (near 75 C) to 1900 MHz. A figure is comparable
with another only next to the clock it ran at, so the benchmarks print one.

:class:`GpuStateSampler` runs ``nvidia-smi`` in the background for the whole benchmark; each
timed call asks for the samples taken inside its own time window (:meth:`GpuStateSampler.window`).
Without ``nvidia-smi`` every window reads ``None`` and the benchmark prints ``n/a``.

Power is ``power.draw.instant`` where the driver has it. Plain ``power.draw`` is a one-second
average on Ampere and newer GPUs (NVML's documented behaviour), longer than most timed windows:
read that way, the same N=256 forward showed 515-545 W in one run and 176-211 W in another.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import List, Optional, Sequence, Tuple

_QUERY = "timestamp,clocks.sm,temperature.gpu"
_TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"
Sample = Tuple[float, float, float, float]  # (epoch seconds, MHz, C, W)


@dataclass(frozen=True)
class GpuState:
    """What the GPU did during one timed window."""

    sm_clock_mhz: float  # median
    max_temperature_c: float
    power_w: float  # median
    samples: int

    def cell(self) -> str:
        """``1815 MHz 57 C 689 W``."""
        return (f"{self.sm_clock_mhz:.0f} MHz {self.max_temperature_c:.0f} C "
                f"{self.power_w:.0f} W")


def power_field(smi: str, gpu: str) -> str:
    """``power.draw.instant`` if this ``nvidia-smi`` reads it for ``gpu``, else ``power.draw``."""
    try:
        probe = subprocess.run(
            [smi, "--query-gpu=power.draw.instant", "--format=csv,noheader,nounits",
             f"--id={gpu}"], capture_output=True, text=True, timeout=10)
        float(probe.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return "power.draw"
    return "power.draw.instant" if probe.returncode == 0 else "power.draw"


def parse_samples(text: str) -> List[Sample]:
    """The samples in ``nvidia-smi --query-gpu=timestamp,clocks.sm,temperature.gpu,<power>
    --format=csv,noheader,nounits`` output; lines that do not parse (a partial last line,
    ``[N/A]`` values) are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            stamp = datetime.strptime(fields[0], _TIMESTAMP_FORMAT).timestamp()
            clock, temperature, power = (float(f) for f in fields[1:])
        except ValueError:
            continue
        samples.append((stamp, clock, temperature, power))
    return samples


def summarize(samples: Sequence[Sample], start: float, end: float) -> Optional[GpuState]:
    """The state over the samples taken in ``[start, end]`` (epoch seconds); ``None`` if none."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return None
    return GpuState(
        sm_clock_mhz=statistics.median(s[1] for s in inside),
        max_temperature_c=max(s[2] for s in inside),
        power_w=statistics.median(s[3] for s in inside),
        samples=len(inside),
    )


class GpuStateSampler:
    """``nvidia-smi`` sampling one GPU every ``interval_ms`` while the ``with`` block runs; a
    reader thread collects the samples (line-buffered through ``stdbuf`` where it exists)."""

    def __init__(self, gpu: str, interval_ms: int = 50) -> None:
        self.gpu = gpu
        self.interval_ms = interval_ms
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None
        self._samples: List[Sample] = []
        self.power_field: Optional[str] = None  # set once nvidia-smi is found

    def __enter__(self) -> "GpuStateSampler":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        self.power_field = power_field(smi, self.gpu)
        stdbuf = shutil.which("stdbuf")
        command = ([stdbuf, "-oL"] if stdbuf else []) + [
            smi, f"--query-gpu={_QUERY},{self.power_field}", "--format=csv,noheader,nounits",
            f"--loop-ms={self.interval_ms}", f"--id={self.gpu}",
        ]
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=1.0)

    def window(self, start: float, end: float, timeout_s: float = 2.0) -> Optional[GpuState]:
        """The state between epoch times ``start`` and ``end``, once a sample after ``end`` has
        arrived (or ``timeout_s`` has passed)."""
        if self._proc is None:
            return None
        deadline = time.time() + timeout_s
        while time.time() < deadline and not (self._samples and self._samples[-1][0] >= end):
            time.sleep(0.02)
        return summarize(list(self._samples), start, end)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._samples.extend(parse_samples(line))


def device_id(index: int) -> str:
    """The ``nvidia-smi --id`` of torch's CUDA device ``index``: its PCI bus id, which stays
    right when ``CUDA_VISIBLE_DEVICES`` renumbers the devices (the index otherwise)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return str(index)
    return f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{props.pci_device_id:02X}.0"
