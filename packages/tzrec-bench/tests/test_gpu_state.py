"""The GPU clock/temperature/power sampler the benchmarks print next to their figures."""

from __future__ import annotations

import os
import stat
import sys
import time
from datetime import datetime

from tzrec_bench import gpu_state

LINES = (
    "2026/11/21 15:33:27.503, 1815, 57, 689.15\n"
    "2026/11/21 15:33:27.553, 1500, 75, 699.90\n"
    "2026/11/21 15:33:27.603, [N/A], 75, 699.90\n"  # a field nvidia-smi could not read
    "2026/11/21 15:33:27.653, 1650, 76, 701.00\n"
    "2026/11/21 15:33:27.7"  # cut off mid-line
)


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def test_parse_skips_unreadable_and_partial_lines():
    samples = gpu_state.parse_samples(LINES)
    assert [s[1:] for s in samples] == [(1815, 57, 689.15), (1500, 75, 699.9), (1650, 76, 701.0)]
    assert samples[0][0] == _epoch("2026/11/21 15:33:27.503")


def test_summary_covers_only_the_window():
    samples = gpu_state.parse_samples(LINES)
    state = gpu_state.summarize(samples, _epoch("2026/11/21 15:33:27.550"),
                                _epoch("2026/11/21 15:33:27.700"))
    assert state == gpu_state.GpuState(sm_clock_mhz=1575, max_temperature_c=76, power_w=700.45,
                                       samples=2)
    assert state.cell() == "1575 MHz 76 C 700 W"
    assert gpu_state.summarize(samples, 0.0, 1.0) is None


def test_without_nvidia_smi_every_window_is_none(monkeypatch):
    monkeypatch.setattr(gpu_state.shutil, "which", lambda name: None)
    with gpu_state.GpuStateSampler("0") as sampler:
        assert sampler.window(0.0, time.time()) is None


def test_sampler_reads_a_running_nvidia_smi(tmp_path, monkeypatch):
    # a stand-in nvidia-smi printing one sample every 20 ms with the real clock's timestamps
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import datetime, sys, time\n"
        "while True:\n"
        "    now = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
        "    print(f'{now}, 1800, 60, 650.5', flush=True)\n"
        "    time.sleep(0.02)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with gpu_state.GpuStateSampler("0") as sampler:
        time.sleep(0.5)  # the stand-in's interpreter start-up
        start = time.time()
        time.sleep(0.3)
        state = sampler.window(start, time.time())
    assert state is not None and state.samples >= 5
    assert (state.sm_clock_mhz, state.max_temperature_c, state.power_w) == (1800, 60, 650.5)
